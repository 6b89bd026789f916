/*
 * mooncake_internal — the MooncakeConnector's shared state, private to its three parts:
 * mooncake_producer.c (P: pulls from decoders, the sender pool), mooncake_consumer.c (D:
 * pulls to producers, bootstrap lookups, "release your blocks") and mooncake_connector.c
 * (the engine hooks, the reaper, lifecycle and metrics).  Functions shared between the
 * parts carry the mc_ prefix.
 */
#ifndef DISAGG_CONNECTOR_MOONCAKE_INTERNAL_H
#define DISAGG_CONNECTOR_MOONCAKE_INTERNAL_H

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
#include "connector/mooncake/mooncake_connector.h"

#define MOD               "connector.mooncake"
#define ID_MAX            128
#define REAPER_PERIOD_NS  (50 * NS_PER_MS)
#define MAX_RELEASES      64 /* consumer: "release your blocks" messages in flight */
#define RELEASE_TIMEOUT_S 5.0
#define PROBE_AFTER_NS    (3 * NS_PER_S) /* a pull waiting longer gets its producer probed */
#define PROBE_PERIOD_NS   (2 * NS_PER_S)
#define BEAT_PERIOD_NS    (10 * NS_PER_S) /* CONTINUE to a pull waiting on a live request */
#define CANCEL_ACK_S      5.0             /* D waits this long for P to acknowledge a cancel */
#define MC_TP_MAX         8   /* TP ranks of one instance (serve -tp: 1, 2, 4, 8) */
#define MC_PULL_TARGETS   64  /* (decode rank, prefill rank) pairs of one transfer */
#define LOOKUP_ANSWER_S   2.0 /* D's bootstrap lookup: connect + answer deadline per attempt */
#define POOL_TIMEOUT_S    5.0 /* a pool fetch: the holder's silence before the prompt is
                                 computed here instead (it pins and sends at once) */
#define POOL_TX_PREFIX    "pool-" /* transfer ids of pool fetches */

/* Pool fetches that fell back to computing the prompt (disagg:kv_pool_fetch_fallbacks_total). */
enum {
    PF_EVICTED,     /* the holder no longer held the whole prefix */
    PF_UNREACHABLE, /* its bootstrap server or side channel did not answer */
    PF_TIMEOUT,     /* no KV within POOL_TIMEOUT_S */
    PF_ERROR,       /* the holder refused or failed the transfer */
    PF_BUSY,        /* max_remote_loads pulls in flight, or local resources */
    PF_COUNT
};
/* pool_source requests not fetched (disagg:kv_pool_fetch_skipped_total). */
enum {
    PS_CACHED,  /* the local prefix cache held as much */
    PS_COST,    /* pool_fetch auto: the transfer was estimated slower than the prefill */
    PS_NEVER,   /* pool_fetch never */
    PS_SHORT,   /* not one full block to fetch before the last prompt token */
    PS_COUNT
};

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

/* One prefill chunk of a remote-decode request (engine hook prefill_chunk), for
 * layer-wise streaming: tokens [ready_lo, start) were there before its step (send them at
 * once), [start, end) are written layer by layer in step `step`. */
typedef struct lw_chunk {
    int ready_lo, start, end;
    uint64_t step;
    int32_t *blocks; /* (n_blocks) the request's block table at that step */
    int n_blocks;
} lw_chunk;

typedef struct pull_part { /* one request of a pull, waiting for its producer entry */
    struct pull_job *job;
    size_t req; /* index in job->pull->reqs */
    struct pull_part *next;
    int layerwise; /* the pull asked for layer-wise streaming and can have it */
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
    /* a pool fetch served here: no request of ours, the blocks are pinned by the engine
     * (engine_kv_pin_prefix) under pin_key; P_PREFILLING until they are */
    int pool;
    uint64_t pin_key;
    int pool_blocks; /* full blocks of the tokens the pull named: all must be pinned */
    int32_t first_token; /* the first output token the prefill sampled, -1 = none yet */
    /* Pulls of this transfer (one per pair of P rank and D rank, vLLM's TpKVTopology):
     * expected = max(this TP size, the decoder's), set by the first pull; the blocks are
     * freed when every expected pull was written (or the decoder released them) and none is
     * being written. */
    int pulls_expected, pulls_started, pulls_done;
    pull_part *waiters;
    /* layer-wise streaming (mooncake_stream.c) */
    int n_prompt;                     /* prompt tokens (prefill_chunk) */
    lw_chunk *chunks;                 /* (n_chunks) every chunk the engine ran, in order */
    size_t n_chunks, cap_chunks;
    int sent_upto;                    /* tokens covered by the chunks so far */
    struct backend_layer_progress *lp; /* the engine's layer marks */
    int streaming;                    /* a stream thread serves the pull (state P_SENDING) */
    int prefill_over;                 /* request_finished came: 1 kept, -1 not kept */
    uint64_t prefill_end_ns;          /* when (the streamed send's exposed time counts from it) */
    struct prod_req *next, *prev;   /* c->prods (prev: O(1) unlink) */
    struct prod_req *unext, *uprev; /* c->u_head..u_tail while P_UNKNOWN (oldest last) */
} prod_req;

typedef struct pull_job { /* one pull from a decoder, until its final reply */
    int rank; /* the TP rank whose side channel took it: the heads it writes */
    side_channel_call *call;
    side_channel_pull *pull;
    size_t pending;   /* requests not yet done */
    char **ok, **err; /* (n_reqs) borrowed req ids */
    size_t n_ok, n_err;
    char **ft_reqs;     /* (n_reqs) ok requests with P's first token ... */
    int32_t *ft_tokens; /* ... and that token ("disagg_first_tokens") */
    size_t n_ft;
    char **lw_reqs; /* (n_reqs) ok requests whose KV was streamed ("disagg_layerwise") */
    size_t n_lw;
    char err_msg[256];
    uint64_t beat_ns; /* last reply (or arrival): a CONTINUE follows every BEAT_PERIOD_NS */
} pull_job;

typedef struct send_task {
    pull_job *job;
    size_t req;
    prod_req *p;
    struct send_task *next;
    /* a stream thread's task (c->streams): the decoder cancelled or went away */
    atomic_int stop;
    const char *stop_why;
    struct mooncake_connector *c;
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
    /* a pool fetch (kv_transfer_params.pool_source): the prefix pool_tokens (full blocks) of
     * tokens is pulled from remote_engine_id at bootstrap, under a fresh transfer_id */
    int pool;
    int32_t *tokens; /* (pool_tokens) */
    int pool_tokens;
    int loading;         /* a pull thread owns it */
    int released;        /* the engine dropped its handle */
    void *h;             /* that handle (freed at destroy when the engine never released it) */
    struct cons_req *next;
} cons_req;

typedef struct handle { /* what the engine holds per request */
    int is_producer;
    void *p;        /* prod_req* or cons_req* (NULL: a local request with a pool fetch) */
    cons_req *pool; /* the request's pool fetch, or NULL */
} handle;

/* One TP rank's side channel (the producer serves one per rank, as vLLM's TP workers each
 * serve theirs): the callbacks' user data. */
typedef struct mc_rank_sc {
    struct mooncake_connector *c;
    int rank;
    side_channel_server *sc;
    char addr[160]; /* "tcp://host:port", registered under tp_rank = rank */
} mc_rank_sc;

struct mooncake_connector {
    kv_transfer_config cfg;
    kv_transfer_env env;
    kv_protocol proto; /* effective */
    engine *eng;
    engine_kv_region region; /* rank 0's KV region (the engine's own) */
    tp_local tp;             /* this instance's TP shape: {engine_tp_size, 0} (tp_pull.h) */
    /* every rank's region as this process reaches it (engine_get_kv_region_rank; [0] is
     * region): each registered with the transfer engine */
    engine_kv_region rank_region[MC_TP_MAX];
    transfer_engine *te;
    char segment[128]; /* our transfer-engine segment name */
    char host[64];     /* advertised host */
    /* producer */
    bootstrap_server *bs;
    side_channel_server *sc; /* rank 0's (rank_sc[0].sc) */
    char sc_addr[160];       /* its "tcp://host:port" */
    mc_rank_sc rank_sc[MC_TP_MAX]; /* each rank's side channel (tp.tp_size of them) */
    send_task *q_head, *q_tail;
    pthread_t *senders;
    int n_senders;
    pthread_cond_t q_cv;
    prod_req *prods;
    id_table prod_index;       /* transfer_id -> prod_req, every entry of prods */
    int n_unknown;             /* prods in P_UNKNOWN: pulls ahead of their request */
    prod_req *u_head, *u_tail; /* those, newest first (eviction takes the oldest) */
    send_task **streams;       /* (n_streams) stream threads' tasks */
    int n_streams, cap_streams;
    pthread_cond_t lw_cv;      /* a chunk, the prefill's end, a stop: stream threads look */
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
    /* pool fetch (docs/kv_pool.md), consumer: fetches that brought KV, their blocks, bytes,
     * seconds; the fallbacks and skips by reason; holder: pins served and refused */
    uint64_t pool_fetched, pool_blocks, pool_bytes;
    double pool_seconds;
    uint64_t pool_fallbacks[PF_COUNT], pool_skipped[PS_COUNT];
    uint64_t pool_served, pool_not_held;
    double pool_s_per_byte; /* measured transfer time per byte (EWMA), 0 = none yet */
    double pool_rtt_s;      /* measured fixed cost of a fetch (EWMA of the smallest) */
    uint64_t pin_seq;       /* the last pin key given */
};

static inline int is_producer_role(const mooncake_connector *c) {
    return c->cfg.role != KV_ROLE_CONSUMER;
}
static inline int is_consumer_role(const mooncake_connector *c) {
    return c->cfg.role != KV_ROLE_PRODUCER;
}

typedef struct release_job {
    mooncake_connector *c;
    char transfer_id[ID_MAX], engine_id[ID_MAX], bootstrap[256];
} release_job;

/* Shared between the parts (each defined in the file its name says: prod_/job_/on_pull/
 * sender_ in mooncake_producer.c, pull_/release_ in mooncake_consumer.c). */
void mc_cons_maybe_free_locked(mooncake_connector *c, cons_req *r);
void mc_prefix_pinned(void *ctx, uint64_t key, uint64_t pin_id, const int32_t *blocks,
                      int n_blocks);
void mc_job_req_done_locked(mooncake_connector *c, pull_job *job, size_t req, int ok,
                            const char *why);
prod_req *mc_prod_find(mooncake_connector *c, const char *transfer_id);
void mc_prod_maybe_free_locked(mooncake_connector *c, prod_req *p);
prod_req *mc_prod_new(mooncake_connector *c, const char *transfer_id, prod_state st);
void mc_prod_release_blocks_locked(mooncake_connector *c, prod_req *p);
void mc_prod_wake_waiters_locked(mooncake_connector *c, prod_req *p);
void mc_release_remote(mooncake_connector *c, const char *bootstrap, const char *engine_id,
                       const char *transfer_id);
void mc_unknown_remove_locked(mooncake_connector *c, prod_req *p);
void mc_on_pull(void *ud, side_channel_call *call, side_channel_pull *pull);
void *mc_pull_main(void *arg);
void *mc_sender_main(void *arg);
/* mooncake_stream.c: layer-wise streaming. */
int mc_pull_can_stream(const mooncake_connector *c, const side_channel_pull *pull, size_t req);
void mc_stream_start_locked(mooncake_connector *c, prod_req *p);
void mc_stream_stop_locked(mooncake_connector *c, const void *peer, size_t peer_len,
                           uint64_t conn, const char *req_id, const char *why);
void mc_prefill_chunk(void *ctx, void *handle, uint64_t id, const int32_t *blocks, int n_blocks,
                      int start, int end, int n_prompt, uint64_t step,
                      struct backend_layer_progress *progress);
void mc_prod_free_chunks(prod_req *p);
void mc_prod_send_ended_locked(mooncake_connector *c, prod_req *p, int sent);
int mc_send_blocks(mooncake_connector *c, int rank, const side_channel_pull *pull,
                   const side_channel_req_blocks *rb, const prod_req *p, uint64_t *bytes,
                   size_t *nruns, unsigned *via, char *err, size_t cap);
int mc_write_runs(mooncake_connector *c, const side_channel_pull *pull, const xfer_run *runs,
                  size_t n, uint64_t *bytes, unsigned *via, char *err, size_t cap);
void mc_count_write_locked(mooncake_connector *c, const prod_req *p, int rc, uint64_t bytes,
                           size_t nruns, unsigned via, uint64_t t0, int live);

#endif
