/* mooncake_connector — see mooncake_connector.h. */
#include "connector/mooncake/mooncake_connector.h"

#include "base/auth.h"
#include "base/clock.h"
#include "base/log.h"
#include "base/net.h"
#include "base/text.h"
#include "connector/kv_transfer_config.h"
#include "connector/mooncake/bootstrap_client.h"
#include "connector/mooncake/bootstrap_server.h"
#include "connector/mooncake/id_table.h"
#include "connector/mooncake/side_channel.h"
#include "connector/mooncake/side_channel_msg.h"
#include "connector/mooncake/tp_pull.h"
#include "connector/mooncake/xfer_plan.h"
#include "disagg/transfer.h"
#include "kernels/backend.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD              "connector.mooncake"
#define ID_MAX           128
#define REAPER_PERIOD_NS (50 * NS_PER_MS)
#define MAX_RELEASES      64 /* consumer: "release your blocks" messages in flight */
#define RELEASE_TIMEOUT_S 5.0
#define PROBE_AFTER_NS   (3 * NS_PER_S) /* a pull waiting longer gets its producer probed */
#define PROBE_PERIOD_NS  (2 * NS_PER_S)
#define BEAT_PERIOD_NS   (10 * NS_PER_S) /* CONTINUE to a pull waiting on a live request */
#define CANCEL_ACK_S     5.0             /* D waits this long for P to acknowledge a cancel */
#define LOOKUP_ANSWER_S   2.0 /* D's bootstrap lookup: connect + answer deadline per attempt */

/* Failure counters (disagg:kv_transfer_failures_total{side,reason}). */
enum {
    FP_UNKNOWN_TRANSFER, /* no request with the pulled transfer_id arrived in time */
    FP_PREFILL_ENDED,    /* the request ended (abort, error) before its KV was ready */
    FP_WRITE_FAILED,     /* writing into the decoder failed */
    FP_REFUSED,          /* the pull did not fit (layout, groups, memory) */
    FP_CANCELLED,        /* the decoder cancelled it */
    FP_BAD_PARAMS,       /* a request's kv_transfer_params were refused (400) */
    FP_COUNT
};
static const char *const FP_NAMES[FP_COUNT] = {"unknown_transfer", "prefill_ended", "write_failed",
                                               "refused",          "cancelled",     "bad_params"};
enum {
    FC_BAD_PARAMS,            /* kv_transfer_params refused (400) or unknown engine */
    FC_BOOTSTRAP_UNREACHABLE, /* P's bootstrap server did not answer */
    FC_PRODUCER_UNREACHABLE,  /* P's side channel closed or P stopped answering */
    FC_PRODUCER_ERROR,        /* P answered that the transfer failed */
    FC_TIMEOUT,               /* no KV within the decoder's deadline */
    FC_CANCELLED,             /* the client went away during the pull */
    FC_LOCAL,                 /* decoder-side: memory, threads */
    FC_EVICTED,               /* evicted at max_remote_loads: P did not know its transfer */
    FC_BUSY,                  /* refused at max_remote_loads */
    FC_COUNT
};
static const char *const FC_NAMES[FC_COUNT] = {"bad_params",
                                               "bootstrap_unreachable",
                                               "producer_unreachable",
                                               "producer_error",
                                               "timeout",
                                               "cancelled",
                                               "decoder",
                                               "evicted",
                                               "too_many_loads"};

/* ---- state ------------------------------------------------------------------ */

typedef enum prod_state {
    P_UNKNOWN = 0,    /* a pull named this transfer_id before the request arrived */
    P_PREFILLING = 1, /* the request is being prefilled */
    P_READY = 2,      /* blocks kept, waiting for the pull */
    P_SENDING = 3,    /* a sender is writing them */
    P_DONE = 4,       /* pulled (or released / expired): blocks freed */
    P_FAILED = 5,     /* the prefill did not finish: pulls get an error */
} prod_state;

struct pull_job;

typedef struct pull_part { /* one request of a pull, waiting for its producer entry */
    struct pull_job *job;
    size_t req; /* index in job->pull->reqs */
    struct pull_part *next;
} pull_part;

typedef struct prod_req {
    char transfer_id[ID_MAX];
    uint64_t id; /* the engine's request id */
    prod_state state;
    int32_t *blocks; /* (n_blocks) kept blocks, P_READY and after */
    int n_blocks;
    int kept;             /* blocks are held in the engine: engine_kv_release owed */
    int engine_released;  /* the engine dropped its handle */
    uint64_t deadline_ns; /* P_READY: expiry; P_UNKNOWN/P_PREFILLING with waiters: give up */
    char fail_msg[192];
    int fail_reason;     /* P_FAILED: FP_* */
    int cancelled;       /* a decoder cancelled its pull: release the blocks once ready */
    int32_t first_token; /* the first output token the prefill sampled, -1 = none yet */
    pull_part *waiters;
    struct prod_req *next, *prev;   /* c->prods (prev: O(1) unlink) */
    struct prod_req *unext, *uprev; /* c->u_head..u_tail while P_UNKNOWN (oldest last) */
} prod_req;

typedef struct pull_job { /* one pull from a decoder, until its final reply */
    side_channel_call *call;
    side_channel_pull *pull;
    size_t pending;   /* requests not yet done */
    char **ok, **err; /* (n_reqs) borrowed req ids */
    size_t n_ok, n_err;
    char **ft_reqs;     /* (n_reqs) ok requests with P's first token ... */
    int32_t *ft_tokens; /* ... and that token ("disagg_first_tokens") */
    size_t n_ft;
    char err_msg[256];
    uint64_t beat_ns; /* last reply (or arrival): a CONTINUE follows every BEAT_PERIOD_NS */
} pull_job;

typedef struct send_task {
    pull_job *job;
    size_t req;
    prod_req *p;
    struct send_task *next;
} send_task;

typedef struct cons_req {
    struct mooncake_connector *c;
    uint64_t id;
    char transfer_id[ID_MAX];
    char remote_engine_id[ID_MAX];
    char bootstrap[256]; /* "http://host:port" */
    int32_t *blocks;     /* (n_blocks) all the prompt's blocks */
    int n_blocks, n_local_tokens, n_prompt;
    atomic_int cancel; /* raised by abort or the deadline */
    uint64_t deadline_ns;
    uint64_t started_ns; /* the pull thread started */
    int unreachable;     /* the liveness probe found the producer gone */
    int timed_out;       /* the reaper's deadline cancelled the pull */
    int p_unknown;       /* the producer said it does not know the transfer id (yet) */
    int evicted;         /* cancelled to make room at max_remote_loads */
    int loading;         /* a pull thread owns it */
    int released;        /* the engine dropped its handle */
    void *h;             /* that handle (freed at destroy when the engine never released it) */
    struct cons_req *next;
} cons_req;

typedef struct handle { /* what the engine holds per request */
    int is_producer;
    void *p; /* prod_req* or cons_req* */
} handle;

struct mooncake_connector {
    kv_transfer_config cfg;
    kv_transfer_env env;
    kv_protocol proto; /* effective */
    engine *eng;
    engine_kv_region region;
    tp_local tp; /* this instance's TP shape (tp_pull.h) */
    transfer_engine *te;
    char segment[128]; /* our transfer-engine segment name */
    char host[64];     /* advertised host */
    /* producer */
    bootstrap_server *bs;
    side_channel_server *sc;
    char sc_addr[160]; /* "tcp://host:port" */
    send_task *q_head, *q_tail;
    pthread_t *senders;
    int n_senders;
    pthread_cond_t q_cv;
    prod_req *prods;
    id_table prod_index;       /* transfer_id -> prod_req, every entry of prods */
    int n_unknown;             /* prods in P_UNKNOWN: pulls ahead of their request */
    prod_req *u_head, *u_tail; /* those, newest first (eviction takes the oldest) */
    uint64_t pulls_evicted;    /* P_UNKNOWN entries evicted at max_pending_pulls */
    char listen_host[256];     /* the server's --host ("" = all interfaces) */
    /* consumer */
    cons_req *conss;
    int n_pull_threads;
    int n_evicting;            /* pull threads of evicted loads, still ending */
    int n_releases;            /* release threads (release_remote) */
    uint64_t releases_dropped; /* releases not sent: MAX_RELEASES were in flight */
    atomic_int release_cancel; /* raised at destroy */
    /* shared */
    pthread_mutex_t mu; /* guards everything mutable above and the stats */
    pthread_cond_t cv;  /* reaper wake-up / pull threads drained */
    pthread_t reaper;
    int stop;
    mooncake_stats st;
    uint64_t fail_p[FP_COUNT], fail_c[FC_COUNT]; /* failure counters */
    uint64_t cancel_acked, cancel_unacked;       /* consumer: cancels acknowledged or not */
};

static int is_producer_role(const mooncake_connector *c) {
    return c->cfg.role != KV_ROLE_CONSUMER;
}
static int is_consumer_role(const mooncake_connector *c) {
    return c->cfg.role != KV_ROLE_PRODUCER;
}

/* ---- producer: pulls and senders ----------------------------------------------- */

/* O(1): the index, not a walk of prods (issue 11 section 3: a flood of
 * bogus pulls must not slow the lookups of real ones). */
static prod_req *prod_find(mooncake_connector *c, const char *transfer_id) {
    return id_table_get(&c->prod_index, transfer_id);
}

static prod_req *prod_new(mooncake_connector *c, const char *transfer_id, prod_state st) {
    prod_req *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    snprintf(p->transfer_id, sizeof p->transfer_id, "%s", transfer_id);
    if (id_table_put(&c->prod_index, p->transfer_id, p) != 0) {
        free(p);
        return NULL;
    }
    p->state = st;
    p->first_token = -1;
    p->next = c->prods;
    if (c->prods) c->prods->prev = p;
    c->prods = p;
    return p;
}

/* Caller holds mu.  p enters P_UNKNOWN (a pull ahead of its request). */
static void unknown_push_locked(mooncake_connector *c, prod_req *p) {
    p->uprev = NULL;
    p->unext = c->u_head;
    if (c->u_head) c->u_head->uprev = p;
    c->u_head = p;
    if (!c->u_tail) c->u_tail = p;
    c->n_unknown++;
}

/* Caller holds mu.  p leaves P_UNKNOWN. */
static void unknown_remove_locked(mooncake_connector *c, prod_req *p) {
    if (p->uprev)
        p->uprev->unext = p->unext;
    else
        c->u_head = p->unext;
    if (p->unext)
        p->unext->uprev = p->uprev;
    else
        c->u_tail = p->uprev;
    p->unext = p->uprev = NULL;
    c->n_unknown--;
}

/* Caller holds mu.  Reply to a pull whose requests are all done. */
static void job_finish_locked(mooncake_connector *c, pull_job *job) {
    side_channel_reply r = {.status = SIDE_CHANNEL_FINISH,
                            .ok_reqs = job->ok,
                            .n_ok = job->n_ok,
                            .err_reqs = job->err,
                            .n_err = job->n_err,
                            .err_msg = job->n_err ? job->err_msg : NULL,
                            .ft_reqs = job->ft_reqs,
                            .ft_tokens = job->ft_tokens,
                            .n_ft = job->n_ft};
    side_channel_call_reply(job->call, &r);
    side_channel_pull_release(job->pull);
    free(job->ok);
    free(job->err);
    free(job->ft_reqs);
    free(job->ft_tokens);
    free(job);
    (void)c;
}

/* Caller holds mu.  One request of job ended. */
static void job_req_done_locked(mooncake_connector *c, pull_job *job, size_t req, int ok,
                                const char *why) {
    char *rid = job->pull->reqs[req].req_id;
    if (ok) {
        job->ok[job->n_ok++] = rid;
    } else {
        job->err[job->n_err++] = rid;
        if (!job->err_msg[0] && why) snprintf(job->err_msg, sizeof job->err_msg, "%s", why);
    }
    if (--job->pending == 0) job_finish_locked(c, job);
}

/* Caller holds mu.  Drop the hold on_pull keeps while it walks the requests. */
static void job_drop_hold_locked(mooncake_connector *c, pull_job *job) {
    if (--job->pending == 0) job_finish_locked(c, job);
}

/* Caller holds mu.  Free p's blocks in the engine (once). */
static void prod_release_blocks_locked(mooncake_connector *c, prod_req *p) {
    if (p->kept) {
        engine_kv_release(c->eng, p->id);
        p->kept = 0;
        c->st.kept--;
    }
}

/* Caller holds mu.  p became ready or failed: serve or fail its waiters. */
static void prod_wake_waiters_locked(mooncake_connector *c, prod_req *p) {
    pull_part *w = p->waiters;
    p->waiters = NULL;
    while (w) {
        pull_part *n = w->next;
        if (p->state == P_READY) {
            send_task *t = malloc(sizeof *t);
            if (t) {
                *t = (send_task){w->job, w->req, p, NULL};
                p->state = P_SENDING;
                if (c->q_tail)
                    c->q_tail->next = t;
                else
                    c->q_head = t;
                c->q_tail = t;
                pthread_cond_signal(&c->q_cv);
            } else {
                job_req_done_locked(c, w->job, w->req, 0, "producer out of memory");
            }
        } else {
            const char *why = p->state == P_FAILED ? p->fail_msg
                              : p->state == P_SENDING || p->state == P_DONE
                                  ? "transfer already pulled by another request"
                                  : "no such transfer";
            c->fail_p[p->state == P_FAILED ? p->fail_reason : FP_REFUSED]++;
            job_req_done_locked(c, w->job, w->req, 0, why);
        }
        free(w);
        w = n;
    }
}

static void prod_maybe_free_locked(mooncake_connector *c, prod_req *p) {
    if (!p->engine_released && p->state != P_UNKNOWN) return;
    if (p->waiters || p->state == P_SENDING || p->state == P_READY || p->state == P_PREFILLING)
        return;
    if (p->state == P_UNKNOWN) unknown_remove_locked(c, p); /* e.g. a cancelled pull's entry */
    id_table_del(&c->prod_index, p->transfer_id);
    if (p->prev)
        p->prev->next = p->next;
    else
        c->prods = p->next;
    if (p->next) p->next->prev = p->prev;
    free(p->blocks);
    free(p);
}

/* A consumer request goes once the engine released it and no pull thread owns it. */
static void cons_maybe_free_locked(mooncake_connector *c, cons_req *r) {
    if (!r->released || r->loading) return;
    for (cons_req **pp = &c->conss; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    free(r->blocks);
    free(r);
}

/* Write p's blocks (the tail D asked for) into D's region. */
/* The transfer_status.transports bits of a write as "cuda_ipc", "tcp+shm", ... */
static const char *transports_str(unsigned via, char *buf, size_t cap) {
    static const transfer_protocol order[4] = {TRANSFER_PROTO_TCP, TRANSFER_PROTO_SHM,
                                               TRANSFER_PROTO_RDMA, TRANSFER_PROTO_CUDA_IPC};
    size_t o = 0;
    buf[0] = 0;
    for (int i = 0; i < 4; i++)
        if (via & (1u << (unsigned)order[i]) && o < cap)
            o += (size_t)snprintf(buf + o, cap - o, "%s%s", o ? "+" : "",
                                  transfer_protocol_name(order[i]));
    return buf[0] ? buf : "no transport";
}

static int send_blocks(mooncake_connector *c, const side_channel_pull *pull,
                       const side_channel_req_blocks *rb, const prod_req *p, uint64_t *bytes,
                       size_t *nruns, unsigned *via, char *err, size_t cap) {
    char viabuf[64];
    *via = 0;
    if (pull->n_regions != 1) {
        snprintf(err, cap,
                 "decoder registered %zu KV regions; this producer has one block-major region "
                 "(layouts differ)",
                 pull->n_regions);
        return -EINVAL;
    }
    const side_channel_block_group *g = &rb->groups[0];
    int64_t *pids = malloc((size_t)(p->n_blocks ? p->n_blocks : 1) * sizeof *pids);
    if (!pids) {
        snprintf(err, cap, "producer out of memory");
        return -ENOMEM;
    }
    for (int i = 0; i < p->n_blocks; i++)
        pids[i] = p->blocks[i];
    /* the decoder's TP shape decides which heads go where (tp_pull.h, xfer_plan.h) */
    xfer_run *runs = NULL;
    size_t n_runs = 0;
    int n = tp_send_runs(&c->region, &c->tp, pull, pids, (size_t)p->n_blocks, g->ids, g->n, &runs,
                         &n_runs, err, cap);
    free(pids);
    if (n < 0) return n;
    n = (int)n_runs;
    void **src = malloc((size_t)(n ? n : 1) * sizeof *src);
    uint64_t *dst = malloc((size_t)(n ? n : 1) * sizeof *dst);
    size_t *len = malloc((size_t)(n ? n : 1) * sizeof *len);
    int rc = -ENOMEM;
    if (src && dst && len) {
        *bytes = 0;
        for (int i = 0; i < n; i++) {
            src[i] = (void *)(uintptr_t)runs[i].src;
            dst[i] = runs[i].dst;
            len[i] = (size_t)runs[i].len;
            *bytes += runs[i].len;
        }
        char target[320];
        if (strchr(pull->remote_hostname, ':'))
            snprintf(target, sizeof target, "[%s]:%" PRId64, pull->remote_hostname,
                     pull->remote_port);
        else
            snprintf(target, sizeof target, "%s:%" PRId64, pull->remote_hostname,
                     pull->remote_port);
        rc = transfer_sync_write_via(c->te, target, src, dst, len, (size_t)n, via);
        if (rc)
            snprintf(err, cap, "writing %zu KV bytes to decoder %s over %s failed: %s",
                     (size_t)*bytes, target, transports_str(*via, viabuf, sizeof viabuf),
                     transfer_strerror(rc));
        *nruns = (size_t)n;
    } else {
        snprintf(err, cap, "producer out of memory");
    }
    free(src);
    free(dst);
    free(len);
    free(runs);
    return rc;
}

static void *sender_main(void *arg) {
    mooncake_connector *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->q_head && !c->stop)
            pthread_cond_wait(&c->q_cv, &c->mu);
        if (!c->q_head) break;
        send_task *t = c->q_head;
        c->q_head = t->next;
        if (!c->q_head) c->q_tail = NULL;
        pthread_mutex_unlock(&c->mu);
        char err[320] = "";
        uint64_t bytes = 0;
        size_t nruns = 0;
        unsigned via = 0;
        char viabuf[64];
        uint64_t t0 = clock_now_ns();
        int rc = send_blocks(c, t->job->pull, &t->job->pull->reqs[t->req], t->p, &bytes, &nruns,
                             &via, err, sizeof err);
        pthread_mutex_lock(&c->mu);
        prod_req *p = t->p;
        if (rc == 0) {
            static const transfer_protocol order[4] = {TRANSFER_PROTO_TCP, TRANSFER_PROTO_SHM,
                                                       TRANSFER_PROTO_RDMA,
                                                       TRANSFER_PROTO_CUDA_IPC};
            int first = 1;
            for (int i = 0; i < 4; i++)
                if (via & (1u << (unsigned)order[i])) {
                    first &= c->st.transport_requests[i] == 0;
                    c->st.transport_requests[i]++;
                    c->st.transport_bytes[i] += bytes; /* a mixed write counts in each */
                }
            c->st.send_count++;
            c->st.send_sum_s += (double)(clock_now_ns() - t0) / 1e9;
            c->st.bytes_sent += bytes;
            c->st.descriptors_sent += nruns;
            c->st.transfers_ok++;
            if (first) /* once per transport: which one the KV moves over */
                LOG_I(MOD, "KV of transfer %s (%" PRIu64 " bytes, %s memory) moved over %s",
                      p->transfer_id, bytes, c->region.location,
                      transports_str(via, viabuf, sizeof viabuf));
            LOG_D(MOD, "transfer %s: %" PRIu64 " bytes in %zu descriptors over %s, %.2f ms",
                  p->transfer_id, bytes, nruns, transports_str(via, viabuf, sizeof viabuf),
                  (double)(clock_now_ns() - t0) / 1e6);
        } else {
            c->st.transfers_failed++;
            c->fail_p[FP_WRITE_FAILED]++;
            LOG_W(MOD, "transfer %s: %s", p->transfer_id, err);
        }
        p->state = P_DONE;
        prod_release_blocks_locked(c, p); /* one decoder rank: pulled once */
        if (rc == 0 && p->first_token >= 0 && c->cfg.first_token_handoff && t->job->ft_reqs &&
            t->job->ft_tokens) { /* the first-token handoff: D need not recompute it */
            t->job->ft_reqs[t->job->n_ft] = t->job->pull->reqs[t->req].req_id;
            t->job->ft_tokens[t->job->n_ft++] = p->first_token;
        }
        job_req_done_locked(c, t->job, t->req, rc == 0, rc ? err : NULL);
        prod_wake_waiters_locked(c, p); /* any second pull of the same id */
        prod_maybe_free_locked(c, p);
        free(t);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Length of a layout fingerprint without its kernels field (engine/kv_connector.h). */
static size_t layout_len(const char *fp) {
    const char *k = strstr(fp, ENGINE_KERNELS_TAG);
    return k ? (size_t)(k - fp) : strlen(fp);
}

/* Same layout?  A peer whose KV was computed by other kernels (another CPU ISA, or a GPU)
 * is accepted -- the bytes mean the same -- and reported once: the decode is then not
 * bit-identical to a colocated run on either machine. */
static int layout_compatible(const char *peer, const char *mine) {
    size_t n = layout_len(peer);
    if (n != layout_len(mine) || strncmp(peer, mine, n) != 0) return 0;
    static atomic_int warned;
    if (strcmp(peer + n, mine + n) != 0 && !atomic_exchange(&warned, 1))
        LOG_W(MOD,
              "P/D pair across kernels: decoder %s, producer %s (%s vs %s); the KV layout is "
              "the same, but results are not bit-identical to a colocated run (exactness across "
              "ISAs is not promised)",
              peer + n + (peer[n] ? strlen(ENGINE_KERNELS_TAG) : 0),
              mine + n + (mine[n] ? strlen(ENGINE_KERNELS_TAG) : 0), peer, mine);
    return 1;
}

/* Side-channel thread: a decoder's pull.  Must not block. */
static void on_pull(void *ud, side_channel_call *call, side_channel_pull *pull) {
    mooncake_connector *c = ud;
    if (pull->layout && !layout_compatible(pull->layout, c->region.fingerprint)) {
        char msg[400];
        snprintf(msg, sizeof msg,
                 "KV layout mismatch: decoder has %s, producer has %s (same model, dtype and "
                 "--block-size are required)",
                 pull->layout, c->region.fingerprint);
        LOG_W(MOD, "refusing a pull: %s", msg);
        pthread_mutex_lock(&c->mu);
        c->fail_p[FP_REFUSED]++;
        pthread_mutex_unlock(&c->mu);
        side_channel_reply r = {.status = SIDE_CHANNEL_ERROR, .err_msg = msg};
        side_channel_call_reply(call, &r);
        side_channel_pull_release(pull);
        return;
    }
    if (!pull->layout && pull->n_regions == 1 &&
        (uint64_t)pull->block_lens[0] != c->region.block_bytes) {
        char msg[256];
        snprintf(msg, sizeof msg,
                 "KV block size mismatch: decoder blocks are %" PRId64 " bytes, producer's %zu",
                 pull->block_lens[0], c->region.block_bytes);
        pthread_mutex_lock(&c->mu);
        c->fail_p[FP_REFUSED]++;
        pthread_mutex_unlock(&c->mu);
        side_channel_reply r = {.status = SIDE_CHANNEL_ERROR, .err_msg = msg};
        side_channel_call_reply(call, &r);
        side_channel_pull_release(pull);
        return;
    }
    pull_job *job = calloc(1, sizeof *job);
    char **ok = calloc(pull->n_reqs + 1, sizeof *ok), **er = calloc(pull->n_reqs + 1, sizeof *er);
    if (!job || !ok || !er) {
        free(job);
        free(ok);
        free(er);
        side_channel_reply r = {.status = SIDE_CHANNEL_ERROR, .err_msg = "producer out of memory"};
        side_channel_call_reply(call, &r);
        side_channel_pull_release(pull);
        return;
    }
    job->call = call;
    job->pull = pull;
    job->ok = ok;
    job->err = er;
    job->ft_reqs = calloc(pull->n_reqs + 1, sizeof *job->ft_reqs); /* NULL: no handoff */
    job->ft_tokens = calloc(pull->n_reqs + 1, sizeof *job->ft_tokens);
    job->pending = pull->n_reqs + 1; /* +1 held until the loop is done */
    uint64_t now = clock_now_ns();
    job->beat_ns = now;
    /* A transfer_id no request of ours carries yet may still arrive (P and D
     * get the request at the same time): wait for it, but only so long. */
    uint64_t wait_deadline = now + (uint64_t)(c->env.unknown_transfer_timeout_s * 1e9);
    char **unk = calloc(pull->n_reqs + 1, sizeof *unk); /* parts waiting for unknown ids */
    size_t n_unk = 0;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < pull->n_reqs; i++) {
        const side_channel_req_blocks *rb = &pull->reqs[i];
        prod_req *p = prod_find(c, rb->transfer_id);
        size_t nids = 0;
        for (size_t g = 0; g < rb->n_groups; g++)
            nids += rb->groups[g].n;
        /* No block ids: "nothing to send, release your blocks" -- what vLLM's
         * decoder sends for a request it will not load (and ours for one it
         * rejected, or dropped before its pull).  Blocks kept now are freed;
         * a request still prefilling, or not here yet, is released as soon as
         * it is ready. */
        if (nids == 0 && p) {
            if (p->state == P_READY) {
                p->state = P_DONE;
                prod_release_blocks_locked(c, p);
                prod_maybe_free_locked(c, p);
            } else if (p->state == P_PREFILLING || p->state == P_UNKNOWN) {
                p->cancelled = 1;
                if (p->state == P_UNKNOWN && !p->waiters) p->deadline_ns = wait_deadline;
            }
            job_req_done_locked(c, job, i, 1, NULL);
            continue;
        }
        if (nids != 0 && rb->n_groups != 1) {
            c->fail_p[FP_REFUSED]++;
            job_req_done_locked(c, job, i, 0,
                                "this producer has one KV group; the pull names several");
            continue;
        }
        if (!p && c->n_unknown >= c->cfg.max_pending_pulls) {
            /* Full: evict the oldest waiting pull, O(1).  A real pull ahead
             * of its request is young (its request is on the way), so a
             * flood evicts its own entries first. */
            prod_req *old = c->u_tail;
            unknown_remove_locked(c, old);
            old->state = P_FAILED;
            old->fail_reason = FP_UNKNOWN_TRANSFER;
            snprintf(old->fail_msg, sizeof old->fail_msg,
                     "evicted: %d newer pulls for transfer ids this producer does not know "
                     "arrived first (kv_connector_extra_config.max_pending_pulls)",
                     c->cfg.max_pending_pulls);
            if (c->pulls_evicted++ % 1000 == 0)
                LOG_W(MOD,
                      "%d pulls wait for unknown transfer ids (max_pending_pulls): evicting the "
                      "oldest (%" PRIu64 " evicted so far; a flood of bogus pulls?)",
                      c->n_unknown + 1, c->pulls_evicted);
            prod_wake_waiters_locked(c, old);
            old->engine_released = 1;
            prod_maybe_free_locked(c, old);
        }
        if (!p) {
            if (!(p = prod_new(c, rb->transfer_id, P_UNKNOWN))) {
                job_req_done_locked(c, job, i, 0, "producer out of memory");
                continue;
            }
            unknown_push_locked(c, p);
        }
        if (nids == 0) { /* a release ahead of its request: remembered (capped, timed) */
            p->cancelled = 1;
            p->deadline_ns = wait_deadline;
            job_req_done_locked(c, job, i, 1, NULL);
            continue;
        }
        pull_part *w = malloc(sizeof *w);
        if (!w) {
            job_req_done_locked(c, job, i, 0, "producer out of memory");
            continue;
        }
        *w = (pull_part){job, i, p->waiters};
        p->waiters = w;
        if (p->state == P_UNKNOWN) {
            if (!p->deadline_ns || p->deadline_ns > wait_deadline) p->deadline_ns = wait_deadline;
            if (unk) unk[n_unk++] = rb->req_id;
        } else if (p->state == P_PREFILLING) {
            /* queued or running here: no deadline (the abort timeout counts
             * from the end of the prefill); heartbeats keep D waiting */
        } else {
            prod_wake_waiters_locked(c, p);
        }
    }
    if (n_unk && job->pending > 1) {
        /* Tell the decoder at once which of its requests wait for a transfer id
         * this producer does not know (yet): at its max_remote_loads it evicts
         * such a pull first, so bogus pulls cannot starve real ones. */
        side_channel_reply r = {
            .status = SIDE_CHANNEL_CONTINUE, .unknown_reqs = unk, .n_unknown = n_unk};
        side_channel_call_reply(job->call, &r);
        job->beat_ns = now;
    }
    free(unk);
    job_drop_hold_locked(c, job);
    pthread_mutex_unlock(&c->mu);
}

/* ---- consumer: pulls ------------------------------------------------------------ */

typedef struct pull_outcome {
    mooncake_connector *c;
    cons_req *r;
    const char *my_req;
    int ok;              /* our request was in ok_reqs */
    int done;            /* a final reply came */
    int32_t first_token; /* P's first output token for our request ("disagg_first_tokens"), -1 */
    char err[320];
} pull_outcome;

static int on_reply(void *ud, const side_channel_reply *r) {
    pull_outcome *o = ud;
    for (size_t i = 0; i < r->n_ok; i++)
        if (!strcmp(r->ok_reqs[i], o->my_req)) o->ok = 1;
    for (size_t i = 0; i < r->n_err; i++)
        if (!strcmp(r->err_reqs[i], o->my_req)) {
            o->ok = 0;
            snprintf(o->err, sizeof o->err, "producer failed the transfer: %s",
                     r->err_msg ? r->err_msg : "no reason given");
        }
    if (r->status == SIDE_CHANNEL_ERROR) {
        o->ok = 0;
        snprintf(o->err, sizeof o->err, "producer refused the pull: %s",
                 r->err_msg ? r->err_msg : "no reason given");
    }
    for (size_t i = 0; i < r->n_ft; i++)
        if (!strcmp(r->ft_reqs[i], o->my_req)) o->first_token = r->ft_tokens[i];
    if (r->status != SIDE_CHANNEL_CONTINUE) {
        o->done = 1;
    } else { /* the producer is alive and still has the request: extend the deadline */
        int unknown = 0;
        for (size_t i = 0; i < r->n_unknown; i++)
            if (!strcmp(r->unknown_reqs[i], o->my_req)) unknown = 1;
        pthread_mutex_lock(&o->c->mu);
        o->r->p_unknown = unknown;
        o->r->deadline_ns =
            clock_now_ns() + (uint64_t)((o->c->env.abort_request_timeout_s + 60) * 1e9);
        pthread_mutex_unlock(&o->c->mu);
    }
    return 0;
}

/* Find the producer's side-channel endpoint for engine_id via its bootstrap server. */
static int resolve_endpoint(mooncake_connector *c, const char *bootstrap, const char *engine_id,
                            char *ep, size_t cap, char *err, size_t errcap) {
    /* A bootstrap server answers /query from its own thread in microseconds:
     * one that accepts but does not answer (a hung or stopped producer, a
     * wrong address) is gone.  Each attempt gets LOOKUP_ANSWER_S (or the
     * connector timeout when shorter), two attempts 0.5 s apart: the request
     * fails within about 5 s, not 2 x VLLM_MOONCAKE_CONNECTOR_TIMEOUT. */
    bootstrap_retry retry;
    bootstrap_retry_init(&retry, c->env.connector_timeout_s < LOOKUP_ANSWER_S
                                     ? c->env.connector_timeout_s
                                     : LOOKUP_ANSWER_S);
    retry.attempts = 2;
    retry.backoff_s = 0.5;
    bootstrap_table t;
    int rc = bootstrap_client_query(bootstrap, &retry, &t, err, errcap);
    if (rc) return rc;
    const char *addr = NULL;
    const bootstrap_engine *pe = NULL;
    for (size_t i = 0; i < t.n && !pe; i++)
        if (t.engines[i].engine_id && !strcmp(t.engines[i].engine_id, engine_id))
            pe = &t.engines[i];
    if (pe) { /* the prefill ranks this decode rank pulls from (tp_pull.h) */
        xfer_kv_shape sh;
        tp_pull_peer peers[8];
        int np = tp_shape_from_fingerprint(c->region.fingerprint, &sh, err, errcap);
        if (np == 0) np = tp_pull_peers(pe, &c->tp, sh.n_kv_heads, peers, 8, err, errcap);
        if (np == 1) addr = peers[0].addr;
        if (np > 1)
            snprintf(err, errcap,
                     "prefill engine %s has TP %d: decode tp_rank %d of %d must pull from %d "
                     "prefill ranks, which this connector does not do yet (docs/parallel.md)",
                     pe->engine_id, pe->tp_size, c->tp.tp_rank, c->tp.tp_size, np);
        if (np != 1) {
            bootstrap_table_free(&t);
            return -ENOTSUP;
        }
    }
    if (!addr) {
        snprintf(err, errcap, "bootstrap server %s knows no engine '%s' (remote_engine_id)",
                 bootstrap, engine_id);
        bootstrap_table_free(&t);
        return -ENOENT;
    }
    snprintf(ep, cap, "%s", addr);
    bootstrap_table_free(&t);
    return 0;
}

static void load_observe_locked(mooncake_connector *c, double s) {
    static const double b[12] = MOONCAKE_LOAD_BUCKETS;
    c->st.load_count++;
    c->st.load_sum_s += s;
    for (int i = 0; i < 12; i++)
        if (s <= b[i]) c->st.load_buckets[i]++;
}

static void *pull_main(void *arg) {
    cons_req *r = arg;
    mooncake_connector *c = r->c;
    uint64_t t0 = clock_now_ns();
    char ep[256], err[320] = "";
    pull_outcome o = {.c = c, .r = r, .first_token = -1};
    int status = 502, reason = FC_PRODUCER_ERROR, acked = 0;
    char my_req[32];
    snprintf(my_req, sizeof my_req, "d-%" PRIu64, r->id);
    o.my_req = my_req;
    uint64_t hold_ns = 0; /* set when a pull went out and its final reply never came */
    int rc = resolve_endpoint(c, r->bootstrap, r->remote_engine_id, ep, sizeof ep, err, sizeof err);
    if (rc == -ENOENT) {
        status = 400; /* the bootstrap server answered: the engine id is wrong */
        reason = FC_BAD_PARAMS;
    } else if (rc == -ENOTSUP) { /* the producer's TP shape cannot be pulled from here */
        reason = FC_PRODUCER_ERROR;
    } else if (rc) {
        reason = FC_BOOTSTRAP_UNREACHABLE;
    }
    if (rc == 0) {
        int bs = c->region.block_size;
        int first =
            r->n_local_tokens / bs; /* blocks before this came from the local prefix cache */
        side_channel_block_group g = {0};
        g.n = (size_t)(r->n_blocks - first);
        g.ids = malloc((g.n ? g.n : 1) * sizeof *g.ids);
        for (size_t i = 0; g.ids && i < g.n; i++)
            g.ids[i] = r->blocks[first + (int)i];
        side_channel_req_blocks rb = {my_req, r->transfer_id, &g, 1};
        uint64_t base = (uint64_t)(uintptr_t)c->region.base;
        int64_t blen = (int64_t)c->region.block_bytes;
        char host[64];
        uint16_t port = 0;
        net_split_host_port(c->segment, host, sizeof host, &port, 0);
        side_channel_pull pull = {.remote_hostname = host,
                                  .remote_port = port,
                                  .remote_tp_size = c->tp.tp_size,
                                  .remote_tp_rank = c->tp.tp_rank,
                                  .reqs = &rb,
                                  .n_reqs = 1,
                                  .kv_caches_base_addr = &base,
                                  .block_lens = &blen,
                                  .kv_block_lens = &blen,
                                  .n_regions = 1,
                                  .remote_pp_size = 1,
                                  .layout = c->region.fingerprint};
        double timeout = c->env.abort_request_timeout_s + 60;
        if (!g.ids) {
            rc = -ENOMEM;
            status = 500;
            reason = FC_LOCAL;
            snprintf(err, sizeof err, "decoder out of memory");
        } else {
            rc = side_channel_pull_run_ex(
                ep, &pull, c->cfg.auth_secret[0] ? c->cfg.auth_secret : NULL, timeout, &r->cancel,
                CANCEL_ACK_S, &acked, on_reply, &o, err, sizeof err);
            /* Abandoned without the producer's final reply (and without its
             * acknowledgement of our cancel): its sender may still be writing
             * into these blocks, for at most its transfer deadline (30 s + 1 ns
             * per byte, Mooncake's default) — keep them out of use that long,
             * plus a margin.  An acknowledged cancel frees them at once. */
            if (rc != 0 && rc != SIDE_CHANNEL_EREFUSED && !o.done && !acked)
                hold_ns = 35 * 1000000000ull + (uint64_t)g.n * (uint64_t)c->region.block_bytes;
            if (rc == SIDE_CHANNEL_ECANCELED) {
                pthread_mutex_lock(&c->mu);
                if (atomic_load(&r->cancel) == SIDE_CHANNEL_CANCEL_ASK) {
                    if (acked)
                        c->cancel_acked++;
                    else
                        c->cancel_unacked++;
                }
                pthread_mutex_unlock(&c->mu);
            }
            if (rc == SIDE_CHANNEL_ECANCELED)
                reason = FC_CANCELLED;
            else if (rc == SIDE_CHANNEL_ETIMEDOUT)
                status = 504, reason = FC_TIMEOUT;
            else if (rc != 0)
                reason = FC_PRODUCER_UNREACHABLE;
        }
        free(g.ids);
        if (rc == 0 && !o.ok && !o.err[0])
            snprintf(o.err, sizeof o.err, "producer's reply did not list this request");
        if (rc == 0 && !o.ok) snprintf(err, sizeof err, "%s", o.err);
        if (rc == SIDE_CHANNEL_ECANCELED && r->unreachable) {
            snprintf(err, sizeof err,
                     "producer unreachable: its bootstrap server %s stopped answering",
                     r->bootstrap);
            reason = FC_PRODUCER_UNREACHABLE;
        } else if (rc == SIDE_CHANNEL_ECANCELED && r->evicted) {
            snprintf(err, sizeof err,
                     "too many remote KV loads in flight: evicted to make room "
                     "(kv_connector_extra_config.max_remote_loads %d) -- the producer %s did not "
                     "know this transfer id",
                     c->cfg.max_remote_loads, ep);
            status = 503;
            reason = FC_EVICTED;
        } else if (rc == SIDE_CHANNEL_ECANCELED && r->timed_out) {
            snprintf(err, sizeof err, "no KV from producer %s within the decoder's deadline", ep);
            status = 504;
            reason = FC_TIMEOUT;
        }
    }
    int ok = rc == 0 && o.ok;
    double secs = (double)(clock_now_ns() - t0) / 1e9;
    if (!ok)
        LOG_W(MOD, "request %" PRIu64 " (transfer %s): remote KV load failed: %s", r->id,
              r->transfer_id, err);
    char msg[400];
    snprintf(msg, sizeof msg, "remote prefill failed (transfer %s): %s", r->transfer_id, err);
    int recompute = c->cfg.load_failure_policy == KV_LOAD_FAILURE_RECOMPUTE;
    pthread_mutex_lock(&c->mu); /* counted before the client can see the outcome */
    if (ok) {
        c->st.pulls_ok++;
        load_observe_locked(c, secs);
    } else {
        c->st.pulls_failed++;
        c->fail_c[reason]++;
    }
    pthread_mutex_unlock(&c->mu);
    if (ok && o.first_token >= 0 && c->cfg.first_token_handoff)
        engine_kv_load_done_first_token(c->eng, r->id, o.first_token);
    else if (ok)
        engine_kv_load_done(c->eng, r->id, 1, recompute, 0, NULL);
    else
        engine_kv_load_failed(c->eng, r->id, recompute, hold_ns, status, msg);
    pthread_mutex_lock(&c->mu);
    c->st.loading--;
    c->n_pull_threads--;
    if (r->evicted) c->n_evicting--;
    r->loading = 0;
    cons_maybe_free_locked(c, r);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* ---- consumer: "release your blocks" ----------------------------------------------- */

typedef struct release_job {
    mooncake_connector *c;
    char transfer_id[ID_MAX], engine_id[ID_MAX], bootstrap[256];
} release_job;

/* Tell the producer that its KV for transfer_id will not be pulled: a pull
 * whose request has no block ids, as vLLM's decoder sends for a request it
 * will not load (so a vLLM producer frees them too).  Bounded: the lookup
 * (about 5 s) and RELEASE_TIMEOUT_S for the answer. */
static void *release_main(void *arg) {
    release_job *j = arg;
    mooncake_connector *c = j->c;
    char ep[256], err[320] = "", host[64];
    int rc = resolve_endpoint(c, j->bootstrap, j->engine_id, ep, sizeof ep, err, sizeof err);
    if (rc == 0) {
        static atomic_uint seq;
        char req[48];
        snprintf(req, sizeof req, "d-release-%u", atomic_fetch_add(&seq, 1));
        side_channel_block_group g = {0};
        side_channel_req_blocks rb = {req, j->transfer_id, &g, 1};
        uint64_t base = (uint64_t)(uintptr_t)c->region.base;
        int64_t blen = (int64_t)c->region.block_bytes;
        uint16_t port = 0;
        net_split_host_port(c->segment, host, sizeof host, &port, 0);
        side_channel_pull pull = {.remote_hostname = host,
                                  .remote_port = port,
                                  .remote_tp_size = c->tp.tp_size,
                                  .remote_tp_rank = c->tp.tp_rank,
                                  .reqs = &rb,
                                  .n_reqs = 1,
                                  .kv_caches_base_addr = &base,
                                  .block_lens = &blen,
                                  .kv_block_lens = &blen,
                                  .n_regions = 1,
                                  .remote_pp_size = 1,
                                  .layout = c->region.fingerprint};
        rc = side_channel_pull_run_ex(ep, &pull, c->cfg.auth_secret[0] ? c->cfg.auth_secret : NULL,
                                      RELEASE_TIMEOUT_S, &c->release_cancel, 0, NULL, NULL, NULL,
                                      err, sizeof err);
    }
    if (rc)
        LOG_W(MOD, "transfer %s: telling the producer to release its KV failed: %s", j->transfer_id,
              err);
    else
        LOG_D(MOD, "transfer %s: the producer was told to release its KV", j->transfer_id);
    pthread_mutex_lock(&c->mu);
    c->n_releases--;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    free(j);
    return NULL;
}

/* Start telling the producer (at most MAX_RELEASES at once; beyond, its abort
 * timeout frees the blocks).  Caller does not hold mu. */
static void release_remote(mooncake_connector *c, const char *bootstrap, const char *engine_id,
                           const char *transfer_id) {
    release_job *j = calloc(1, sizeof *j);
    pthread_mutex_lock(&c->mu);
    int ok = j && !c->stop && c->n_releases < MAX_RELEASES;
    if (ok)
        c->n_releases++;
    else if (c->releases_dropped++ % 100 == 0)
        LOG_W(MOD,
              "transfer %s: %d releases already in flight: the producer keeps this KV until "
              "its abort timeout (%" PRIu64 " releases not sent so far)",
              transfer_id, MAX_RELEASES, c->releases_dropped);
    pthread_mutex_unlock(&c->mu);
    if (!ok) {
        free(j);
        return;
    }
    j->c = c;
    snprintf(j->transfer_id, sizeof j->transfer_id, "%s", transfer_id);
    snprintf(j->engine_id, sizeof j->engine_id, "%s", engine_id);
    snprintf(j->bootstrap, sizeof j->bootstrap, "%s", bootstrap);
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &at, release_main, j);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        free(j);
        pthread_mutex_lock(&c->mu);
        c->n_releases--;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
}

/* ---- engine hooks ---------------------------------------------------------------- */

static const char *jstr(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* remote_bootstrap_addr as bootstrap_client accepts it: "[http://]host:port[/]". */
static int bootstrap_addr_ok(const char *s) {
    if (strlen(s) >= 256) return 0;
    if (!strncmp(s, "http://", 7)) s += 7;
    char tmp[256], host[256];
    snprintf(tmp, sizeof tmp, "%s", s);
    size_t n = strlen(tmp);
    if (n && tmp[n - 1] == '/') tmp[n - 1] = '\0';
    uint16_t port = 0;
    return net_split_host_port(tmp, host, sizeof host, &port, 0) == 0 && host[0] &&
           !strchr(host, '/') && !strchr(host, ' ');
}

/* The JSON kind of o[k] for messages; "nothing" when absent. */
static const char *kind_of(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return v ? text_json_kind(v) : "nothing";
}

static int classify(void *ctx, uint64_t id, const char *kv_params, int n_prompt, void **out,
                    char *err, size_t errlen) {
    mooncake_connector *c = ctx;
    *out = NULL;
    json_error_t je;
    json_t *o = json_loads(kv_params, 0, &je);
    if (!o || json_is_null(o)) {
        json_decref(o);
        return o ? KV_REQ_LOCAL
                 : (snprintf(err, errlen, "kv_transfer_params is not valid JSON: %s", je.text), -1);
    }
    if (!json_is_object(o)) {
        json_decref(o);
        snprintf(err, errlen, "kv_transfer_params must be an object or null");
        return -1;
    }
    int remote_decode = json_is_true(json_object_get(o, "do_remote_decode"));
    int remote_prefill = json_is_true(json_object_get(o, "do_remote_prefill"));
    const char *tid = jstr(o, "transfer_id");
    int role = KV_REQ_LOCAL;
    handle *h = NULL;
    const char *bad_flag = NULL;
    static const char *const FLAGS[2] = {"do_remote_decode", "do_remote_prefill"};
    for (int i = 0; i < 2 && !bad_flag; i++) {
        json_t *v = json_object_get(o, FLAGS[i]);
        if (v && !json_is_boolean(v) && !json_is_null(v)) bad_flag = FLAGS[i];
    }
    if (bad_flag) {
        snprintf(err, errlen, "kv_transfer_params.%s must be true or false, got %s", bad_flag,
                 kind_of(o, bad_flag));
        role = -1;
    } else if (remote_decode && remote_prefill) {
        snprintf(err, errlen,
                 "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true");
        role = -1;
    } else if (remote_decode || remote_prefill) {
        if (!tid || !*tid || strlen(tid) >= ID_MAX) {
            snprintf(err, errlen,
                     "kv_transfer_params.transfer_id must be a non-empty string (below %d bytes)",
                     ID_MAX);
            role = -1;
        }
    }
    if (role == 0 && remote_decode) {
        if (!is_producer_role(c)) {
            snprintf(err, errlen,
                     "do_remote_decode needs kv_role kv_producer or kv_both; this instance is %s",
                     kv_role_name(c->cfg.role));
            role = -1;
        } else {
            pthread_mutex_lock(&c->mu);
            prod_req *p = prod_find(c, tid);
            if (p && p->state != P_UNKNOWN) {
                snprintf(err, errlen, "kv_transfer_params.transfer_id '%s' is already in use", tid);
                role = -1;
            } else if (!p && !(p = prod_new(c, tid, P_PREFILLING))) {
                snprintf(err, errlen, "out of memory");
                role = -1;
            } else {
                if (p->state == P_UNKNOWN) unknown_remove_locked(c, p);
                p->state = P_PREFILLING;
                p->deadline_ns = 0; /* pulls waiting for it now wait for the prefill */
                uint64_t now = clock_now_ns();
                for (pull_part *w = p->waiters; w; w = w->next) { /* "known now" */
                    side_channel_reply cr = {.status = SIDE_CHANNEL_CONTINUE};
                    side_channel_call_reply(w->job->call, &cr);
                    w->job->beat_ns = now;
                }
                p->id = id;
                h = malloc(sizeof *h);
                if (h) *h = (handle){1, p};
                role = KV_REQ_REMOTE_DECODE;
            }
            pthread_mutex_unlock(&c->mu);
        }
    } else if (role == 0 && remote_prefill) {
        const char *eid = jstr(o, "remote_engine_id"), *boot = jstr(o, "remote_bootstrap_addr");
        if (!is_consumer_role(c)) {
            snprintf(err, errlen,
                     "do_remote_prefill needs kv_role kv_consumer or kv_both; this instance is %s",
                     kv_role_name(c->cfg.role));
            role = -1;
        } else if (!eid || !*eid || strlen(eid) >= ID_MAX) {
            snprintf(err, errlen,
                     "kv_transfer_params.remote_engine_id must be a non-empty string (below %d "
                     "bytes), got %s",
                     ID_MAX, kind_of(o, "remote_engine_id"));
            role = -1;
        } else if (!boot || !bootstrap_addr_ok(boot)) {
            snprintf(err, errlen,
                     "kv_transfer_params.remote_bootstrap_addr %s%.200s%s is not accepted; "
                     "accepted: \"http://host:port\" or \"host:port\" (port 1..65535)",
                     boot ? "'" : "", boot ? boot : kind_of(o, "remote_bootstrap_addr"),
                     boot ? "'" : "");
            role = -1;
        } else {
            cons_req *r = calloc(1, sizeof *r);
            h = malloc(sizeof *h);
            if (!r || !h) {
                free(r);
                free(h);
                h = NULL;
                snprintf(err, errlen, "out of memory");
                role = -1;
            } else {
                r->c = c;
                r->id = id;
                r->n_prompt = n_prompt;
                snprintf(r->transfer_id, sizeof r->transfer_id, "%s", tid);
                snprintf(r->remote_engine_id, sizeof r->remote_engine_id, "%s", eid);
                snprintf(r->bootstrap, sizeof r->bootstrap, "%s", boot);
                *h = (handle){0, r};
                r->h = h;
                pthread_mutex_lock(&c->mu);
                r->next = c->conss;
                c->conss = r;
                pthread_mutex_unlock(&c->mu);
                role = KV_REQ_REMOTE_PREFILL;
            }
        }
    }
    if (role < 0) {
        pthread_mutex_lock(&c->mu);
        if (remote_prefill || (bad_flag && !strcmp(bad_flag, "do_remote_prefill")))
            c->fail_c[FC_BAD_PARAMS]++;
        else
            c->fail_p[FP_BAD_PARAMS]++;
        pthread_mutex_unlock(&c->mu);
    }
    json_decref(o);
    *out = h;
    return role;
}

static void start_load(void *ctx, void *hp, uint64_t id, const int32_t *blocks, int n_blocks,
                       int n_local_tokens, int n_prompt) {
    mooncake_connector *c = ctx;
    handle *h = hp;
    cons_req *r = h->p;
    r->blocks = malloc((size_t)(n_blocks ? n_blocks : 1) * sizeof *r->blocks);
    if (!r->blocks) {
        engine_kv_load_done(c->eng, id, 0, 0, 0, "decoder out of memory");
        return;
    }
    memcpy(r->blocks, blocks, (size_t)n_blocks * sizeof *blocks);
    r->n_blocks = n_blocks;
    r->n_local_tokens = n_local_tokens;
    r->n_prompt = n_prompt;
    r->started_ns = clock_now_ns();
    r->deadline_ns = r->started_ns + (uint64_t)((c->env.abort_request_timeout_s + 60) * 1e9);
    pthread_mutex_lock(&c->mu);
    int cap = c->cfg.max_remote_loads;
    if (!c->stop && c->n_pull_threads - c->n_evicting >= cap && c->n_pull_threads < 2 * cap) {
        /* Full: evict the oldest load whose producer said it does not know
         * the transfer id (a bogus pull, or one far ahead of its request);
         * its thread ends within the cancel's acknowledgement (5 s), so at
         * most 2 x max_remote_loads pull threads exist. */
        cons_req *old = NULL;
        for (cons_req *q = c->conss; q; q = q->next)
            if (q->loading && q->p_unknown && !q->evicted &&
                (!old || q->started_ns < old->started_ns))
                old = q;
        if (old) {
            old->evicted = 1;
            c->n_evicting++;
            atomic_store(&old->cancel, SIDE_CHANNEL_CANCEL_ASK);
        }
    }
    if (c->n_pull_threads - c->n_evicting >= cap || c->n_pull_threads >= 2 * cap || c->stop) {
        c->fail_c[FC_BUSY]++;
        c->st.pulls_failed++;
        pthread_mutex_unlock(&c->mu);
        char msg[300];
        snprintf(msg, sizeof msg,
                 "too many remote KV loads in flight: %d loads wait for their producers "
                 "(kv_connector_extra_config.max_remote_loads %d); retry later or add decode "
                 "instances",
                 cap, cap);
        release_remote(c, r->bootstrap, r->remote_engine_id, r->transfer_id);
        engine_kv_load_failed(c->eng, id, c->cfg.load_failure_policy == KV_LOAD_FAILURE_RECOMPUTE,
                              0, 503, msg);
        return;
    }
    r->loading = 1;
    c->st.loading++;
    c->n_pull_threads++;
    pthread_mutex_unlock(&c->mu);
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &at, pull_main, r);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        pthread_mutex_lock(&c->mu);
        r->loading = 0;
        c->st.loading--;
        c->n_pull_threads--;
        pthread_mutex_unlock(&c->mu);
        engine_kv_load_done(c->eng, id, 0, c->cfg.load_failure_policy == KV_LOAD_FAILURE_RECOMPUTE,
                            0, "cannot start a pull thread");
    }
}

static void request_finished(void *ctx, void *hp, uint64_t id, const char *reason,
                             const int32_t *blocks, int n_blocks, int n_prompt, int keep) {
    mooncake_connector *c = ctx;
    handle *h = hp;
    if (!h) return;
    if (!h->is_producer) { /* consumer aborted during its load: stop the pull */
        atomic_store(&((cons_req *)h->p)->cancel, SIDE_CHANNEL_CANCEL_ASK);
        return;
    }
    prod_req *p = h->p;
    pthread_mutex_lock(&c->mu);
    if (keep) {
        p->blocks = malloc((size_t)(n_blocks ? n_blocks : 1) * sizeof *p->blocks);
        if (p->blocks) memcpy(p->blocks, blocks, (size_t)n_blocks * sizeof *blocks);
        p->n_blocks = n_blocks;
        p->kept = 1;
        c->st.kept++;
        p->state = p->blocks ? P_READY : P_FAILED;
        if (!p->blocks) {
            snprintf(p->fail_msg, sizeof p->fail_msg, "producer out of memory");
            prod_release_blocks_locked(c, p);
        }
        p->deadline_ns = clock_now_ns() + (uint64_t)(c->env.abort_request_timeout_s * 1e9);
        if (p->state == P_READY && p->cancelled && !p->waiters) { /* its decoder gave up */
            p->state = P_DONE;
            prod_release_blocks_locked(c, p);
        }
    } else {
        p->state = P_FAILED;
        p->fail_reason = FP_PREFILL_ENDED;
        snprintf(p->fail_msg, sizeof p->fail_msg,
                 "the prefill request ended with '%s' before its KV was ready", reason);
    }
    (void)n_prompt;
    (void)id;
    prod_wake_waiters_locked(c, p);
    pthread_mutex_unlock(&c->mu);
}

/* Producer: the prefill sampled its first output token (sent with the KV). */
static void first_token(void *ctx, void *hp, uint64_t id, int32_t token) {
    mooncake_connector *c = ctx;
    handle *h = hp;
    if (!h || !h->is_producer) return;
    pthread_mutex_lock(&c->mu);
    ((prod_req *)h->p)->first_token = token;
    pthread_mutex_unlock(&c->mu);
    (void)id;
}

static void request_released(void *ctx, void *hp, uint64_t id) {
    mooncake_connector *c = ctx;
    handle *h = hp;
    if (!h) return;
    pthread_mutex_lock(&c->mu);
    if (h->is_producer) {
        prod_req *p = h->p;
        p->engine_released = 1;
        if (p->state == P_PREFILLING) { /* finished without request_finished (engine stop) */
            p->state = P_FAILED;
            snprintf(p->fail_msg, sizeof p->fail_msg, "the prefill request was dropped");
            prod_wake_waiters_locked(c, p);
        }
        prod_maybe_free_locked(c, p);
    } else {
        cons_req *r = h->p;
        r->released = 1;
        if (!r->started_ns) { /* dropped before its pull (aborted while queued) */
            release_job tmp;
            snprintf(tmp.bootstrap, sizeof tmp.bootstrap, "%s", r->bootstrap);
            snprintf(tmp.engine_id, sizeof tmp.engine_id, "%s", r->remote_engine_id);
            snprintf(tmp.transfer_id, sizeof tmp.transfer_id, "%s", r->transfer_id);
            cons_maybe_free_locked(c, r);
            pthread_mutex_unlock(&c->mu);
            release_remote(c, tmp.bootstrap, tmp.engine_id, tmp.transfer_id);
            free(h);
            return;
        }
        cons_maybe_free_locked(c, r);
    }
    pthread_mutex_unlock(&c->mu);
    free(h);
    (void)id;
}

void mooncake_connector_release_unused(mooncake_connector *c, const char *kv_params) {
    if (!c || !kv_params || !is_consumer_role(c)) return;
    json_t *o = json_loads(kv_params, 0, NULL);
    if (json_is_object(o) && json_is_true(json_object_get(o, "do_remote_prefill"))) {
        const char *tid = jstr(o, "transfer_id"), *eid = jstr(o, "remote_engine_id"),
                   *boot = jstr(o, "remote_bootstrap_addr");
        if (tid && *tid && strlen(tid) < ID_MAX && eid && *eid && strlen(eid) < ID_MAX && boot &&
            bootstrap_addr_ok(boot))
            release_remote(c, boot, eid, tid);
    }
    json_decref(o);
}

/* ---- reaper: expiries and deadlines -------------------------------------------------- */

/* Caller holds mu.  A pull waiting on p (queued or prefilling here) gets an
 * empty CONTINUE every BEAT_PERIOD_NS, so the decoder's per-reply timeout
 * (vLLM: ABORT_REQUEST_TIMEOUT + 60 s) does not fail a request that is only
 * slow to come out of this producer's queue.  vLLM's decoder reads an empty
 * CONTINUE as "nothing yet". */
static void beat_waiters_locked(mooncake_connector *c, prod_req *p, uint64_t now) {
    for (pull_part *w = p->waiters; w; w = w->next) {
        if (now - w->job->beat_ns < BEAT_PERIOD_NS) continue;
        w->job->beat_ns = now;
        char *rid = w->job->pull->reqs[w->req].req_id;
        side_channel_reply r = {.status = SIDE_CHANNEL_CONTINUE};
        if (p->state == P_UNKNOWN) /* still unknown: say so again */
            r.unknown_reqs = &rid, r.n_unknown = 1;
        side_channel_call_reply(w->job->call, &r);
    }
}

/* Side-channel thread: a decoder cancels requests of its pull.  Waiting or
 * queued parts end now; a part being written ends when its write does.  The
 * pull's final FINISH, sent when its last part ended, is the acknowledgement:
 * after it nothing more is written into the decoder's blocks. */
static void on_cancel(void *ud, const void *peer, size_t peer_len, const side_channel_cancel *cx) {
    mooncake_connector *c = ud;
    static const char why[] = "cancelled by the decoder";
    pthread_mutex_lock(&c->mu);
    for (size_t k = 0; k < cx->n; k++) {
        const char *rid = cx->req_ids[k], *tid = cx->transfer_ids[k];
        prod_req *p = prod_find(c, tid);
        for (pull_part **pw = p ? &p->waiters : NULL; pw && *pw;) {
            pull_part *w = *pw;
            if (side_channel_call_peer_is(w->job->call, peer, peer_len) &&
                !strcmp(w->job->pull->reqs[w->req].req_id, rid)) {
                *pw = w->next;
                c->fail_p[FP_CANCELLED]++;
                job_req_done_locked(c, w->job, w->req, 0, why);
                free(w);
                p->cancelled = 1;
            } else {
                pw = &w->next;
            }
        }
        for (send_task **pt = &c->q_head, *prev = NULL; *pt;) {
            send_task *t = *pt;
            if (side_channel_call_peer_is(t->job->call, peer, peer_len) &&
                !strcmp(t->job->pull->reqs[t->req].req_id, rid) &&
                !strcmp(t->p->transfer_id, tid)) {
                *pt = t->next;
                if (c->q_tail == t) c->q_tail = prev;
                prod_req *tp = t->p;
                tp->state = P_DONE; /* never sent: its decoder gave up, free the blocks */
                prod_release_blocks_locked(c, tp);
                c->fail_p[FP_CANCELLED]++;
                job_req_done_locked(c, t->job, t->req, 0, why);
                prod_wake_waiters_locked(c, tp);
                prod_maybe_free_locked(c, tp);
                free(t);
            } else {
                prev = t;
                pt = &t->next;
            }
        }
        if (p && p->cancelled && p->state == P_READY && !p->waiters) {
            p->state = P_DONE;
            prod_release_blocks_locked(c, p);
            prod_maybe_free_locked(c, p);
        } else if (p && p->state == P_UNKNOWN && !p->waiters && p->cancelled) {
            /* Remembered for a while: if the request still arrives, its KV is
             * released as soon as it is ready instead of waiting for a pull
             * that will not come (the reaper forgets it after the deadline). */
            p->deadline_ns = clock_now_ns() + (uint64_t)(c->env.unknown_transfer_timeout_s * 1e9);
        }
    }
    pthread_mutex_unlock(&c->mu);
}

/* Side-channel thread: the connection conn of a decoder closed (it stopped,
 * crashed or was killed).  Its waiting pulls end, and the transfers they
 * waited for are released as soon as they are ready (or at once) instead of
 * being kept for the abort timeout: nobody is left to pull them. */
static void on_gone(void *ud, uint64_t conn) {
    mooncake_connector *c = ud;
    static const char why[] = "the decoder's side-channel connection closed";
    uint64_t now = clock_now_ns();
    int n = 0;
    pthread_mutex_lock(&c->mu);
    for (prod_req *p = c->prods, *next; p; p = next) {
        next = p->next;
        int hit = 0;
        for (pull_part **pw = &p->waiters; *pw;) {
            pull_part *w = *pw;
            if (side_channel_call_conn(w->job->call) == conn) {
                *pw = w->next;
                c->fail_p[FP_CANCELLED]++;
                job_req_done_locked(c, w->job, w->req, 0, why);
                free(w);
                hit = 1;
            } else {
                pw = &w->next;
            }
        }
        if (!hit) continue;
        n++;
        p->cancelled = 1;
        if (p->waiters) continue; /* another pull still wants it */
        if (p->state == P_READY) {
            p->state = P_DONE;
            prod_release_blocks_locked(c, p);
            prod_maybe_free_locked(c, p);
        } else if (p->state == P_UNKNOWN) { /* remembered: a late request is released */
            p->deadline_ns = now + (uint64_t)(c->env.unknown_transfer_timeout_s * 1e9);
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (n)
        LOG_W(MOD,
              "a decoder's side-channel connection closed with %d pull(s) waiting: their KV is "
              "released when ready",
              n);
}

/* Caller holds mu (dropped while probing).  ZeroMQ does not report a peer
 * that vanished, so a pull to a dead producer would wait for its whole
 * timeout: every PROBE_PERIOD_NS, ask the bootstrap server of each producer
 * that a pull has waited on for over PROBE_AFTER_NS; when it does not answer
 * (an embedded bootstrap server dies with its producer), cancel those pulls. */
static void probe_producers_locked(mooncake_connector *c) {
    enum { MAX_PROBES = 16 };
    char addrs[MAX_PROBES][256];
    int n = 0;
    uint64_t now = clock_now_ns();
    for (cons_req *r = c->conss; r && n < MAX_PROBES; r = r->next) {
        if (!r->loading || now - r->started_ns < PROBE_AFTER_NS) continue;
        int dup = 0;
        for (int i = 0; i < n && !dup; i++)
            dup = !strcmp(addrs[i], r->bootstrap);
        if (!dup) snprintf(addrs[n++], sizeof addrs[0], "%s", r->bootstrap);
    }
    if (n == 0) return;
    pthread_mutex_unlock(&c->mu);
    int dead[MAX_PROBES] = {0};
    for (int i = 0; i < n; i++) {
        bootstrap_retry retry;
        bootstrap_retry_init(&retry, 2.0);
        retry.attempts = 1;
        bootstrap_table t;
        char err[256];
        if (bootstrap_client_query(addrs[i], &retry, &t, err, sizeof err) == 0)
            bootstrap_table_free(&t);
        else
            dead[i] = 1;
    }
    pthread_mutex_lock(&c->mu);
    for (cons_req *r = c->conss; r; r = r->next)
        for (int i = 0; i < n; i++)
            if (dead[i] && r->loading && !strcmp(addrs[i], r->bootstrap)) {
                r->unreachable = 1;
                atomic_store(&r->cancel, SIDE_CHANNEL_CANCEL_DROP);
            }
}

static void *reaper_main(void *arg) {
    mooncake_connector *c = arg;
    uint64_t next_probe = 0;
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        struct timespec ts = clock_to_timespec(clock_now_ns() + REAPER_PERIOD_NS);
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        uint64_t now = clock_now_ns();
        for (prod_req *p = c->prods, *next; p; p = next) {
            next = p->next;
            if (p->state == P_READY && now >= p->deadline_ns) {
                LOG_W(MOD,
                      "transfer %s: no decoder pulled it within %.0f s "
                      "(VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT); freeing its %d blocks",
                      p->transfer_id, c->env.abort_request_timeout_s, p->n_blocks);
                p->state = P_DONE;
                c->st.expired++;
                prod_release_blocks_locked(c, p);
                prod_maybe_free_locked(c, p);
            } else if (p->state == P_UNKNOWN && p->waiters && p->deadline_ns &&
                       now >= p->deadline_ns) {
                unknown_remove_locked(c, p);
                p->state = P_FAILED;
                p->fail_reason = FP_UNKNOWN_TRANSFER;
                snprintf(p->fail_msg, sizeof p->fail_msg,
                         "no request with transfer_id '%.80s' reached the producer within %g s "
                         "(DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT)",
                         p->transfer_id, c->env.unknown_transfer_timeout_s);
                LOG_W(MOD, "%s; failing the pull", p->fail_msg);
                prod_wake_waiters_locked(c, p);
                p->engine_released = 1;
                prod_maybe_free_locked(c, p);
            } else if (p->state == P_UNKNOWN && !p->waiters && p->deadline_ns &&
                       now >= p->deadline_ns) { /* a cancelled pull's entry */
                prod_maybe_free_locked(c, p);
            } else if (p->waiters) {
                beat_waiters_locked(c, p, now);
            }
        }
        for (cons_req *r = c->conss; r; r = r->next)
            if (r->loading && now >= r->deadline_ns) {
                r->timed_out = 1;
                atomic_store(&r->cancel, SIDE_CHANNEL_CANCEL_ASK);
            }
        if (now >= next_probe) {
            probe_producers_locked(c);
            next_probe = clock_now_ns() + PROBE_PERIOD_NS;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* ---- lifecycle ------------------------------------------------------------------------ */

/* A wildcard listen address (or none): every interface. */
static int is_wildcard_host(const char *h) {
    return !h || !h[0] || !strcmp(h, "0.0.0.0") || !strcmp(h, "::") || !strcmp(h, "[::]");
}

/* Without a secret, KV ports reachable from other hosts are open to anyone
 * who can connect (docs/security.md): say so loudly, once, at start. */
static void warn_if_exposed(const mooncake_connector *c) {
    if (c->cfg.auth_secret[0]) return;
    char what[600];
    int n = 0;
    if (!net_host_is_loopback(c->host) || c->cfg.device_name[0])
        n += snprintf(what + n, sizeof what - (size_t)n,
                      "transfer handshake and data ports on %s%s%s", c->host,
                      c->cfg.device_name[0] ? " and the device_name interfaces " : "",
                      c->cfg.device_name);
    if (c->sc && !net_host_is_loopback(c->host))
        n += snprintf(what + n, sizeof what - (size_t)n, "%sside channel on %s", n ? ", " : "",
                      c->host);
    if (c->bs && !net_host_is_loopback(c->listen_host))
        n += snprintf(what + n, sizeof what - (size_t)n, "%sbootstrap server on %s:%u",
                      n ? ", " : "", is_wildcard_host(c->listen_host) ? "0.0.0.0" : c->listen_host,
                      (unsigned)bootstrap_server_port(c->bs));
    if (n == 0) return;
    LOG_W(MOD,
          "SECURITY WARNING: no shared secret (DISAGG_KV_SECRET / "
          "kv_connector_extra_config.auth_secret) and KV ports listen beyond loopback (%s): "
          "anyone who can reach them can read or overwrite this instance's KV cache%s. Set the "
          "same DISAGG_KV_SECRET on every prefill, decode and bootstrap server, or keep these "
          "ports on a private network behind a firewall (docs/security.md)",
          what, c->bs ? " and register fake prefill ranks" : "");
}

static int start_producer(mooncake_connector *c, char *err, size_t errlen) {
    char server[300];
    const char *secret = c->cfg.auth_secret[0] ? c->cfg.auth_secret : NULL;
    if (c->cfg.bootstrap_host[0]) {
        snprintf(server, sizeof server, strchr(c->cfg.bootstrap_host, ':') ? "[%s]:%u" : "%s:%u",
                 c->cfg.bootstrap_host, c->cfg.bootstrap_port);
    } else {
        /* The embedded bootstrap server listens where the API does (--host):
         * the proxy and the decoders reach it at the prefill's API host
         * (docs/security.md "Which interfaces"). */
        const char *bh = is_wildcard_host(c->listen_host) ? NULL : c->listen_host;
        int rc =
            bootstrap_server_start_auth(bh, c->env.bootstrap_port, secret, &c->bs, err, errlen);
        if (rc) return rc;
        const char *reach = bh ? bh : "127.0.0.1"; /* a wildcard binds 0.0.0.0 */
        snprintf(server, sizeof server, strchr(reach, ':') ? "[%s]:%u" : "%s:%u", reach,
                 bootstrap_server_port(c->bs));
        LOG_I(MOD, "bootstrap server on %s (VLLM_MOONCAKE_BOOTSTRAP_PORT)", server);
    }
    /* The side channel listens only on the advertised KV host, the address
     * the bootstrap table gives decoders. */
    int rc = side_channel_server_start_auth(c->host, 0, secret, on_pull, c, &c->sc, err, errlen);
    if (rc) return rc;
    side_channel_server_set_cancel_fn(c->sc, on_cancel);
    side_channel_server_set_gone_fn(c->sc, on_gone);
    snprintf(c->sc_addr, sizeof c->sc_addr, strchr(c->host, ':') ? "tcp://[%s]:%u" : "tcp://%s:%u",
             c->host, side_channel_server_port(c->sc));
    c->n_senders = c->cfg.num_workers;
    c->senders = calloc((size_t)c->n_senders, sizeof *c->senders);
    if (!c->senders) return -ENOMEM;
    for (int i = 0; i < c->n_senders; i++)
        pthread_create(&c->senders[i], NULL, sender_main, c);
    bootstrap_retry retry;
    bootstrap_retry_init(&retry, c->env.connector_timeout_s);
    bootstrap_registration reg = {c->cfg.engine_id, 0, c->tp.tp_rank, 0, c->sc_addr};
    rc = bootstrap_client_register_auth(server, &reg, secret, &retry, err, errlen);
    if (rc) {
        if (rc == BOOTSTRAP_EAUTH) LOG_E(MOD, "cannot register with the bootstrap server: %s", err);
        return rc;
    }
    LOG_I(MOD, "producer engine %s registered at %s (side channel %s)", c->cfg.engine_id, server,
          c->sc_addr);
    return 0;
}

/* A KV region in HBM: the backend's device-memory ops go into the transfer engine. */
static int install_device_ops(mooncake_connector *c, char *err, size_t errlen) {
    int dev = 0;
    if (c->region.location[4] == ':') dev = atoi(c->region.location + 5);
    transfer_device_ops ops;
    int rc = backend_transfer_device_ops(c->region.backend, dev, &ops, err, errlen);
    if (rc) return rc;
    rc = transfer_engine_set_device_ops(c->te, &ops);
    if (rc) {
        snprintf(err, errlen, "cannot give the transfer engine the %s memory ops: %s",
                 c->region.location, transfer_strerror(rc));
        return -EINVAL;
    }
    return 0;
}

int mooncake_connector_create(const char *json, engine *eng, mooncake_connector **out, char *err,
                              size_t errlen) {
    return mooncake_connector_create_on(json, NULL, eng, out, err, errlen);
}

int mooncake_connector_create_on(const char *json, const char *listen_host, engine *eng,
                                 mooncake_connector **out, char *err, size_t errlen) {
    mooncake_connector *c = calloc(1, sizeof *c);
    if (!c) return -ENOMEM;
    if (listen_host) snprintf(c->listen_host, sizeof c->listen_host, "%s", listen_host);
    pthread_mutex_init(&c->mu, NULL);
    clock_cond_init(&c->cv); /* the reaper's timed wait takes clock_now_ns deadlines */
    clock_cond_init(&c->q_cv);
    c->eng = eng;
    int rc = kv_transfer_config_parse(json, &c->cfg, err, errlen);
    if (rc == 0) rc = kv_transfer_env_load(&c->env, err, errlen);
    if (rc) {
        free(c);
        return rc;
    }
    int n_nics = transfer_rdma_device_count();
    c->proto = kv_transfer_config_effective_protocol(&c->cfg, n_nics > 0);
    engine_get_kv_region(eng, &c->region);
    int on_device = !strncmp(c->region.location, "cuda", 4);
    c->tp = tp_local_of(&c->region);
    transfer_config tc;
    transfer_config_init(&tc);
    /* The KV host (advertised, and where the side channel listens):
     * VLLM_HOST_IP, else device_name's first interface, else --host when it
     * names one address, else the first interface that is up. */
    tc.local_hostname = c->env.host_ip[0] ? c->env.host_ip
                        : !c->cfg.device_name[0] && !is_wildcard_host(c->listen_host)
                            ? c->listen_host
                            : NULL;
    tc.device_name = c->cfg.device_name;
    /* The best transport both sides support: rdma where this host has a NIC (and the
     * peer lists one); "rdma" without a NIC and the KV in HBM: auto, so that a
     * same-host peer's device memory goes over cuda_ipc and any other over staged tcp;
     * an explicit "tcp" stays tcp (staged for device memory); host memory without a NIC
     * keeps tcp, as before. */
    tc.protocol = c->proto == KV_PROTOCOL_SHM                        ? TRANSFER_PROTO_SHM
                  : c->proto == KV_PROTOCOL_RDMA                     ? TRANSFER_PROTO_RDMA
                  : c->cfg.protocol == KV_PROTOCOL_RDMA && on_device ? TRANSFER_PROTO_AUTO
                                                                     : TRANSFER_PROTO_TCP;
    /* Shared secret of the transfer ports (docs/transfer.md, Security): the
     * auth_secret key, else $DISAGG_KV_SECRET (resolved by the config). */
    tc.auth_secret = c->cfg.auth_secret[0] ? c->cfg.auth_secret : NULL;
    rc = transfer_engine_create(&tc, &c->te);
    if (rc) {
        snprintf(err, errlen, "cannot start the transfer engine (device_name '%s'): %s",
                 c->cfg.device_name, transfer_strerror(rc));
        free(c);
        return -EINVAL;
    }
    if (on_device && (rc = install_device_ops(c, err, errlen)) != 0) {
        transfer_engine_destroy(c->te);
        free(c);
        return rc;
    }
    rc = transfer_register(c->te, c->region.base, c->region.bytes, c->region.location);
    if (rc) {
        snprintf(err, errlen, "cannot register the KV cache with the transfer engine: %s",
                 transfer_strerror(rc));
        transfer_engine_destroy(c->te);
        free(c);
        return -EINVAL;
    }
    snprintf(c->segment, sizeof c->segment, "%s", transfer_engine_segment_name(c->te));
    uint16_t port;
    net_split_host_port(c->segment, c->host, sizeof c->host, &port, 0);
    c->st.role = kv_role_name(c->cfg.role);
    /* HBM without a NIC: the engine picks per peer (cuda_ipc on this host, staged tcp
     * elsewhere); the per-transport counters say which carried each write. */
    c->st.protocol = tc.protocol == TRANSFER_PROTO_AUTO ? "auto" : kv_protocol_name(c->proto);
    c->st.engine_id = c->cfg.engine_id;
    if (id_table_init(&c->prod_index) != 0) {
        snprintf(err, errlen, "out of memory");
        transfer_engine_destroy(c->te);
        free(c);
        return -ENOMEM;
    }
    if (c->cfg.auth_secret[0])
        LOG_I(MOD, "KV ports authenticated with the shared secret (%s)",
              c->cfg.auth_secret_from_env ? "DISAGG_KV_SECRET"
                                          : "kv_connector_extra_config.auth_secret");
    pthread_create(&c->reaper, NULL, reaper_main, c);
    if (is_producer_role(c) && (rc = start_producer(c, err, errlen)) != 0) {
        mooncake_connector_destroy(c);
        return rc < 0 ? rc : -EINVAL;
    }
    warn_if_exposed(c);
    engine_kv_connector hooks = {.ctx = c,
                                 .classify = classify,
                                 .start_load = start_load,
                                 .request_finished = request_finished,
                                 .first_token = first_token,
                                 .request_released = request_released};
    engine_set_kv_connector(eng, &hooks);
    LOG_I(MOD,
          "MooncakeConnector: role %s, engine_id %s, transport %s, transfer segment %s, KV region "
          "%.1f MiB "
          "(%d blocks of %zu bytes)",
          kv_role_name(c->cfg.role), c->cfg.engine_id,
          tc.protocol == TRANSFER_PROTO_AUTO ? "cuda_ipc to this host's GPUs, staged tcp to others"
          : on_device && c->proto == KV_PROTOCOL_TCP ? "tcp (device memory staged)"
                                                     : kv_protocol_name(c->proto),
          c->segment, (double)c->region.bytes / (1 << 20), c->region.n_blocks,
          c->region.block_bytes);
    *out = c;
    return 0;
}

void mooncake_connector_destroy(mooncake_connector *c) {
    if (!c) return;
    if (c->eng) engine_set_kv_connector(c->eng, NULL);
    if (c->sc) side_channel_server_stop(c->sc);
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    for (cons_req *r = c->conss; r; r = r->next)
        atomic_store(&r->cancel, SIDE_CHANNEL_CANCEL_DROP);
    pthread_cond_broadcast(&c->q_cv);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < c->n_senders; i++)
        pthread_join(c->senders[i], NULL);
    pthread_join(c->reaper, NULL);
    atomic_store(&c->release_cancel, SIDE_CHANNEL_CANCEL_DROP);
    pthread_mutex_lock(&c->mu); /* pull threads end within 100 ms of their cancel */
    while (c->n_pull_threads > 0 || c->n_releases > 0)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    if (c->bs) bootstrap_server_stop(c->bs);
    while (c->prods) {
        prod_req *p = c->prods;
        c->prods = p->next;
        for (pull_part *w = p->waiters, *n; w; w = n) {
            n = w->next;
            free(w);
        }
        free(p->blocks);
        free(p);
    }
    while (c->conss) { /* requests still live in the engine (its hooks are gone) */
        cons_req *r = c->conss;
        c->conss = r->next;
        if (!r->released) free(r->h);
        free(r->blocks);
        free(r);
    }
    id_table_free(&c->prod_index);
    transfer_engine_destroy(c->te);
    free(c->senders);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->q_cv);
    free(c);
}

void mooncake_connector_get_stats(mooncake_connector *c, mooncake_stats *out) {
    pthread_mutex_lock(&c->mu);
    *out = c->st;
    pthread_mutex_unlock(&c->mu);
}

int mooncake_connector_metrics(mooncake_connector *c, prom *p) {
    mooncake_stats s;
    mooncake_connector_get_stats(c, &s);
    uint64_t fp[FP_COUNT], fc[FC_COUNT], acked, unacked, evicted;
    int unknown, loads_unknown = 0;
    pthread_mutex_lock(&c->mu);
    memcpy(fp, c->fail_p, sizeof fp);
    memcpy(fc, c->fail_c, sizeof fc);
    acked = c->cancel_acked;
    unacked = c->cancel_unacked;
    evicted = c->pulls_evicted; /* issue 11 section 3: what the KV ports refused */
    unknown = c->n_unknown;
    for (cons_req *r = c->conss; r; r = r->next)
        loads_unknown += r->loading && r->p_unknown && !r->evicted;
    pthread_mutex_unlock(&c->mu);
    uint64_t sc_rej = c->sc ? side_channel_server_auth_rejected(c->sc) : 0;
    uint64_t bs_rej = c->bs ? bootstrap_server_auth_rejected(c->bs) : 0;

    prom_style style0 = p->style;
    const char *const *kv0 = p->const_kv;
    int n0 = p->n_const;
    prom_set_style(p, PROM_STYLE_INT); /* counts as integers */
    prom_const_labels(p, NULL, 0);
    prom_info(p, "disagg:kv_transfer_info", "KV connector role and transport in use.", "role",
              s.role ? s.role : "", "protocol", s.protocol ? s.protocol : "", "engine_id",
              s.engine_id ? s.engine_id : "", NULL);
    prom_family(p, "disagg:kv_transfer_bytes", PROM_COUNTER,
                "Producer: KV bytes written to decoders.");
    prom_sample_u64(p, s.bytes_sent, NULL);
    prom_family(p, "disagg:kv_transfer_descriptors", PROM_COUNTER,
                "Producer: contiguous KV runs written to decoders.");
    prom_sample_u64(p, s.descriptors_sent, NULL);
    prom_family(p, "disagg:kv_transfers", PROM_COUNTER,
                "Per-request KV transfers by side (producer sends, consumer pulls) and result.");
    prom_sample_u64(p, s.transfers_ok, "side", "producer", "result", "ok", NULL);
    prom_sample_u64(p, s.transfers_failed, "side", "producer", "result", "failed", NULL);
    prom_sample_u64(p, s.pulls_ok, "side", "consumer", "result", "ok", NULL);
    prom_sample_u64(p, s.pulls_failed, "side", "consumer", "result", "failed", NULL);
    prom_family(p, "disagg:kv_transfer_expired", PROM_COUNTER,
                "Producer: kept blocks freed by the abort timeout (no decoder pulled them).");
    prom_sample_u64(p, s.expired, NULL);
    prom_family(p, "disagg:kv_transfer_kept_requests", PROM_GAUGE,
                "Producer: requests holding blocks for a pull.");
    prom_sample(p, s.kept, NULL);
    prom_family(p, "disagg:kv_transfer_loading_requests", PROM_GAUGE, "Consumer: pulls in flight.");
    prom_sample(p, s.loading, NULL);
    static const double b[12] = MOONCAKE_LOAD_BUCKETS;
    prom_hist load = {b, 12, s.load_buckets, 1, s.load_count, s.load_sum_s};
    prom_family(p, "disagg:kv_load_seconds", PROM_HISTOGRAM,
                "Consumer: remote KV load latency (pull sent -> KV in place).");
    prom_histogram(p, &load, NULL);
    prom_family(p, "disagg:kv_send_seconds", PROM_SUMMARY,
                "Producer: time to write one request's KV into the decoder (blocks ready -> "
                "written).");
    prom_summary(p, s.send_count, s.send_sum_s, NULL);
    prom_family(p, "disagg:kv_transfer_failures", PROM_COUNTER,
                "Failed KV transfers by side and reason.");
    for (int i = 0; i < FP_COUNT; i++)
        prom_sample_u64(p, fp[i], "side", "producer", "reason", FP_NAMES[i], NULL);
    for (int i = 0; i < FC_COUNT; i++)
        prom_sample_u64(p, fc[i], "side", "consumer", "reason", FC_NAMES[i], NULL);
    prom_family(p, "disagg:kv_cancels", PROM_COUNTER,
                "Consumer: pulls cancelled (client gone or deadline); acked = the producer "
                "confirmed no write can follow, so the blocks were freed at once (else "
                "quarantined).");
    prom_sample_u64(p, acked, "acked", "yes", NULL);
    prom_sample_u64(p, unacked, "acked", "no", NULL);
    static const char *const tn[4] = MOONCAKE_TRANSPORTS;
    prom_family(p, "disagg:kv_transfer_transport_bytes", PROM_COUNTER,
                "Producer: KV bytes written to decoders, by the transport that carried them.");
    for (int i = 0; i < 4; i++)
        prom_sample_u64(p, s.transport_bytes[i], "transport", tn[i], NULL);
    prom_family(p, "disagg:kv_transfer_transport_requests", PROM_COUNTER,
                "Producer: requests whose KV was written, by transport.");
    for (int i = 0; i < 4; i++)
        prom_sample_u64(p, s.transport_requests[i], "transport", tn[i], NULL);
    prom_family(p, "disagg:kv_auth_rejected", PROM_COUNTER,
                "Messages refused for authentication (auth_secret / DISAGG_KV_SECRET), by port.");
    prom_sample_u64(p, sc_rej, "port", "side_channel", NULL);
    prom_sample_u64(p, bs_rej, "port", "bootstrap", NULL);
    prom_family(p, "disagg:kv_pending_pulls_evicted", PROM_COUNTER,
                "Producer: pulls for unknown transfer ids evicted (oldest first) because "
                "max_pending_pulls were waiting.");
    prom_sample_u64(p, evicted, NULL);
    prom_family(p, "disagg:kv_pending_unknown_pulls", PROM_GAUGE,
                "Producer: pulls for transfer ids not known yet, waiting.");
    prom_sample(p, unknown, NULL);
    prom_family(p, "disagg:kv_loads_unknown_transfer", PROM_GAUGE,
                "Consumer: remote KV loads whose producer said it does not know the transfer id "
                "(yet); evicted first at max_remote_loads.");
    prom_sample(p, loads_unknown, NULL);
    prom_set_style(p, style0);
    prom_const_labels(p, kv0, n0);
    return prom_error(p);
}
