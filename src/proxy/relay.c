/*
 * relay — one client request through the proxy (PROTOCOL.md §1).  A
 * disaggregated completion sends the prefill body to a prefill instance and,
 * at the same time, the decode body to a decode instance, then relays the
 * decode response to the client as it arrives.  The decode response (its
 * status too) is held (bounded; reading stops beyond RELAY_HOLD_MAX) until
 * the prefill answered, and the prefill's verdict comes first: a prefill 4xx
 * reaches the client unchanged (status, Content-Type, body), any other
 * prefill failure becomes a clear 502/504 naming it, and only after a 2xx
 * prefill is the decode's answer (success or error) relayed.  So when both
 * reject, the client gets the prefill's status whichever answered first.  A
 * refused connection (nothing sent) is retried on another
 * instance of that role (for a prefill, the decode request is re-issued too,
 * since it names the prefill's engine).  A client that disconnects cancels
 * both upstream requests (their connections are closed).
 *
 * The wait for P ends early when D has failed (its 5xx is relayed at once,
 * P's request cancelled) or when P stops answering its health probes
 * (UPSTREAM_HUNG_MISSES probe timeouts in a row): a relay still waiting for
 * that P answers D's complete answer if there is one, else a 502 naming P.
 * A D that answers 400 "bootstrap server ... knows no engine '<the id sent>'"
 * (the prefill restarted after its engine table was read; D pulled nothing)
 * makes the relay re-read that prefill's table and resend the decode request
 * once, with the new engine id and the same transfer id (P's answer, and the
 * KV it holds for the transfer, stay as they are); the client sees D's 400
 * only when the re-read shows no new id.  A first 400 of D is read whole
 * (<= RELAY_4XXBODY_MAX) before anything of it is relayed.
 * A streamed (SSE) decode answer is relayed whole events at a time, so that
 * when D fails mid-stream the client gets a final `data: {"error": ...}`
 * event, `data: [DONE]` and a properly ended stream, as vLLM's server sends
 * on an error mid-stream (the openai client raises APIError on it).
 */
#include "proxy/proxy_internal.h"

#include "base/clock.h"
#include "base/log.h"
#include "proxy/api_error.h"
#include "proxy/pd_request.h"

#include <errno.h>
#include <event2/buffer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MOD                "proxy"
#define RELAY_HOLD_MAX     (1u << 20)  /* decode bytes held while the prefill is pending */
#define RELAY_ERRBODY_MAX  2048        /* prefill error body quoted in a 502 message */
#define RELAY_4XXBODY_MAX  (64u << 10) /* prefill 4xx body relayed unchanged up to this */
#define RELAY_SSE_TAIL_MAX (64u << 10) /* partial SSE event held back; beyond it sent as is */

/* P_GONE: P's request was abandoned (D failed, or P stopped answering). */
typedef enum p_state { P_NONE = 0, P_PENDING, P_OK, P_GONE } p_state;

typedef struct relay {
    proxy *px;                         /* owner */
    struct relay *prev, *next;         /* px->relays list */
    hs_req *client;                    /* the client request; NULL once replied/gone */
    json_t *body;                      /* parsed client body (NULL for passthrough) */
    char request_id[PD_UUID_LEN + 1];  /* X-Request-Id sent upstream */
    char transfer_id[PD_UUID_LEN + 6]; /* "xfer-<uuid4>" */
    char *p_body;                      /* prefill body (JSON text) */
    upstream *p;                       /* chosen prefill */
    char p_engine_id[128];             /* that rank's engine id (copied: tables change) */
    char p_group[520];                 /* its model + KV layout (copied: a slot may be reused) */
    int p_rank;                        /* that dp rank */
    hc_req *p_req;                     /* prefill request in flight */
    p_state p_st;                      /* prefill progress */
    int p_status;                      /* its HTTP status */
    struct evbuffer *p_err;            /* (<= RELAY_4XXBODY_MAX + 1) its error body */
    char p_ctype[128];                 /* its Content-Type */
    uint64_t p_tried;                  /* prefill upstreams that refused (bit = index) */
    uint64_t p_start_ns;               /* prefill dispatch time */
    kv_route_req kv;                   /* kv_aware: the prompt's token ids and block hashes */
    uint64_t p_kv_tokens;              /* kv_aware: its uncached tokens, on p's pending count */
    char *d_body;                      /* decode body (JSON text), NULL for passthrough GET */
    upstream *d;                       /* chosen decode */
    hc_req *d_req;                     /* decode request in flight */
    uint64_t d_tried;                  /* decode upstreams that refused */
    uint64_t d_start_ns;               /* decode dispatch time */
    int d_status;                      /* decode HTTP status (0 before its head) */
    http_header *d_hdrs;               /* (d_nhdrs) copied decode response headers */
    int d_nhdrs;                       /* count */
    int64_t d_clen;                    /* decode Content-Length, -1 when chunked/close-delimited */
    int d_done;                        /* decode response complete */
    int d_paused;                      /* decode reading paused (backpressure) */
    struct evbuffer *held; /* (<= RELAY_HOLD_MAX + one read) decode bytes before the gate opened */
    int started;           /* client reply head sent */
    uint64_t t0_ns;        /* client request complete */
    uint64_t p_done_ns;    /* prefill response end */
    int first_byte;        /* first body byte relayed */
    int sse;               /* D's answer is an event stream without a Content-Length */
    struct evbuffer *sse_tail; /* (< RELAY_SSE_TAIL_MAX) bytes after the last relayed event */
    int engine_wait;    /* D named p_engine_id unknown: its answer waits for P's table re-read */
    int engine_retried; /* D was resent once with a re-read engine id (never twice) */
} relay;

static const hc_callbacks P_CB, D_CB;

static void relay_free(relay *r) {
    r->px->inflight--;
    if (r->prev)
        r->prev->next = r->next;
    else
        r->px->relays = r->next;
    if (r->next) r->next->prev = r->prev;
    if (r->sse_tail) evbuffer_free(r->sse_tail);
    json_decref(r->body);
    kv_route_req_free(&r->kv);
    free(r->p_body);
    free(r->d_body);
    if (r->p_err) evbuffer_free(r->p_err);
    if (r->held) evbuffer_free(r->held);
    for (int i = 0; i < r->d_nhdrs; i++) {
        free(r->d_hdrs[i].name);
        free(r->d_hdrs[i].value);
    }
    free(r->d_hdrs);
    free(r);
}

static double secs(uint64_t ns) {
    return (double)ns / 1e9;
}

static void p_finish_metrics(relay *r, int failed) {
    upstream *p = r->p;
    p->outstanding--;
    p->kv_pending_tokens -= r->p_kv_tokens;
    r->p_kv_tokens = 0;
    metrics_hist_observe(&p->latency, secs(clock_now_ns() - r->p_start_ns));
    if (failed) p->errors++;
}

static void d_finish_metrics(relay *r, int failed) {
    upstream *d = r->d;
    d->outstanding--;
    metrics_hist_observe(&d->latency, secs(clock_now_ns() - r->d_start_ns));
    if (failed) d->errors++;
}

static void cancel_p(relay *r) {
    if (!r->p_req) return;
    hc_cancel(r->p_req);
    r->p_req = NULL;
    p_finish_metrics(r, 0);
}

static void cancel_d(relay *r) {
    if (!r->d_req) return;
    hc_cancel(r->d_req);
    r->d_req = NULL;
    d_finish_metrics(r, 0);
}

/* D failed after an event stream was started: the partial event held back
 * is dropped, the client gets a final error event (vLLM's streaming error
 * shape: {"error": {"message", "type", "param", "code"}}) and [DONE], and
 * the stream ends properly (terminating chunk). */
static void end_stream_with_error(relay *r, int status, const char *msg) {
    evbuffer_drain(r->sse_tail, evbuffer_get_length(r->sse_tail));
    char *e = api_error_json(status, msg);
    struct evbuffer *o = evbuffer_new();
    if (o) {
        evbuffer_add_printf(o, "data: %s\n\ndata: [DONE]\n\n", e ? e : "{\"error\":{}}");
        hs_reply_data(r->client, o);
        evbuffer_free(o);
    }
    free(e);
    hs_reply_end(r->client);
}

/* Error reply to the client (if it is still there) and the end of the relay. */
static void relay_fail(relay *r, int status, proxy_error_kind kind, const char *msg) {
    cancel_p(r);
    cancel_d(r);
    if (r->client) {
        if (r->started && r->sse) {
            LOG_W(MOD, "request %s: %s; ending the event stream with an error event", r->request_id,
                  msg);
            r->px->errors[kind]++;
            end_stream_with_error(r, status, msg);
        } else if (r->started) {
            LOG_W(MOD, "request %s: %s; closing the client connection mid-reply", r->request_id,
                  msg);
            r->px->errors[kind]++;
            hs_reply_abort(r->client);
        } else {
            LOG_W(MOD, "request %s: %s", r->request_id, msg);
            proxy_reply_error(r->px, r->client, status, kind, "%s", msg);
        }
        r->client = NULL;
    }
    relay_free(r);
}

static void client_gone(hs_req *req, void *arg) {
    relay *r = arg;
    LOG_I(MOD, "request %s: client disconnected; cancelling the upstream requests", r->request_id);
    r->client = NULL;
    r->px->errors[PERR_CLIENT_GONE]++;
    cancel_p(r);
    cancel_d(r);
    relay_free(r);
}

static void client_drained(hs_req *req, void *arg) {
    relay *r = arg;
    if (r->d_paused && r->d_req) {
        r->d_paused = 0;
        hc_pause(r->d_req, 0);
    }
}

/* The decode's answer, error or not, waits for the prefill's verdict; a
 * decode that failed (5xx, complete) does not: P's request is then
 * cancelled (there is no transfer left to prefill for). */
static int gate_open(relay *r) {
    if (r->p_st != P_PENDING) return 1;
    if (!r->d_done || r->d_status < 500) return 0;
    LOG_I(MOD, "request %s: decode %s answered HTTP %d; relaying it without waiting for prefill %s",
          r->request_id, r->d->url, r->d_status, r->p->url);
    cancel_p(r);
    r->p_st = P_GONE;
    return 1;
}

/* Offset just past the last "\n\n" (an SSE event's end) in b, 0 if none;
 * scanned backwards from the end (it is within the last event). */
static size_t last_event_end(struct evbuffer *b) {
    int n = evbuffer_peek(b, -1, NULL, NULL, 0);
    if (n <= 0) return 0;
    struct evbuffer_iovec stackv[16], *v = stackv;
    if (n > 16 && !(v = malloc((size_t)n * sizeof *v))) return evbuffer_get_length(b);
    evbuffer_peek(b, -1, NULL, v, n);
    size_t off = evbuffer_get_length(b), found = 0;
    int next_nl = 0; /* the byte after the one at off is '\n' */
    for (int i = n - 1; i >= 0 && !found; i--) {
        const char *p = v[i].iov_base;
        for (size_t j = v[i].iov_len; j-- > 0;) {
            off--;
            if (p[j] != '\n') {
                next_nl = 0;
            } else if (next_nl) {
                found = off + 2;
                break;
            } else {
                next_nl = 1;
            }
        }
    }
    if (v != stackv) free(v);
    return found;
}

/* Whether b ends with "\n\n". */
static int ends_event(struct evbuffer *b) {
    size_t n = evbuffer_get_length(b);
    char two[2];
    if (n < 2) return 0;
    struct evbuffer_ptr p;
    if (evbuffer_ptr_set(b, &p, n - 2, EVBUFFER_PTR_SET) < 0) return 0;
    return evbuffer_copyout_from(b, &p, two, 2) == 2 && two[0] == '\n' && two[1] == '\n';
}

/* Relays decode bytes to the client, pausing the decode on backpressure.
 * An event stream goes out whole events at a time (a partial one waits in
 * sse_tail), unless final (the decode's answer ended) or the tail is large. */
static void send_client(relay *r, struct evbuffer *data, int final) {
    if (r->sse && !final) {
        if (!evbuffer_get_length(r->sse_tail) && ends_event(data)) {
            /* the usual case: whole events */
        } else {
            evbuffer_add_buffer(r->sse_tail, data);
            size_t end = evbuffer_get_length(r->sse_tail) >= RELAY_SSE_TAIL_MAX
                             ? evbuffer_get_length(r->sse_tail)
                             : last_event_end(r->sse_tail);
            if (!end) return;
            evbuffer_remove_buffer(r->sse_tail, data, end);
        }
    } else if (r->sse && data != r->sse_tail && evbuffer_get_length(r->sse_tail)) {
        evbuffer_prepend_buffer(data, r->sse_tail); /* final: what was held goes first */
    }
    if (evbuffer_get_length(data) && !r->first_byte) {
        r->first_byte = 1;
        metrics_hist_observe(&r->px->t_first_byte, secs(clock_now_ns() - r->t0_ns));
    }
    if (!evbuffer_get_length(data)) return;
    if (hs_reply_data(r->client, data) == 1 && r->d_req && !r->d_paused) {
        r->d_paused = 1;
        hc_pause(r->d_req, 1);
    }
}

static void relay_complete(relay *r) {
    uint64_t now = clock_now_ns();
    if (r->p_done_ns) metrics_hist_observe(&r->px->t_decode, secs(now - r->p_done_ns));
    metrics_hist_observe(&r->px->t_total, secs(now - r->t0_ns));
    proxy_count_status(r->px, r->d_status);
    if (r->d_status / 100 != 2) r->px->errors[PERR_DECODE_REJECTED]++;
    if (r->sse && evbuffer_get_length(r->sse_tail)) send_client(r, r->sse_tail, 1);
    hs_reply_end(r->client);
    r->client = NULL;
    relay_free(r);
}

/* Called whenever the gate may have opened: start the reply, flush held
 * bytes, end it if the decode already finished.  Returns 1 if r was freed. */
static int relay_advance(relay *r) {
    if (!r->d_status || r->engine_wait || !gate_open(r)) return 0;
    /* a first 400 of D is read whole before it is relayed: it may be the
     * consumer's "knows no engine" (stale_engine), which is not relayed */
    if (!r->started && !r->d_done && r->d_status == 400 && r->body && !r->engine_retried &&
        evbuffer_get_length(r->held) <= RELAY_4XXBODY_MAX)
        return 0;
    if (!r->started) {
        hs_reply_start(r->client, r->d_status, r->d_hdrs, r->d_nhdrs, r->d_clen);
        r->started = 1;
        if (evbuffer_get_length(r->held))
            send_client(r, r->held, r->d_done);
        else if (!r->d_done)
            hs_reply_flush(r->client); /* headers now, body as it comes */
    }
    if (r->d_done) {
        relay_complete(r);
        return 1;
    }
    return 0;
}

/* ---- sending ---------------------------------------------------------- */

static char *headers_for(relay *r, int with_rank) {
    proxy *px = r->px;
    const char *auth = px->auth_header;
    char client_auth[1100] = "";
    if (!auth[0] && r->client) {
        const char *a = http_head_get(hs_req_head(r->client), "Authorization");
        if (a && strlen(a) < 1024)
            snprintf(client_auth, sizeof client_auth, "Authorization: %s\r\n", a);
        auth = client_auth;
    }
    char *h = NULL;
    int n;
    if (with_rank)
        n = asprintf(&h,
                     "Content-Type: application/json\r\nX-Request-Id: %s\r\n"
                     "X-data-parallel-rank: %d\r\n%s",
                     r->request_id, r->p_rank, auth);
    else
        n = asprintf(&h, "%sX-Request-Id: %s\r\n%s",
                     r->d_body ? "Content-Type: application/json\r\n" : "", r->request_id, auth);
    return n < 0 ? NULL : h;
}

static int send_decode(relay *r);

/* "no other prefill instance is reachable (http://a:1, http://b:2 refused the
 * connection)", naming the instances tried, or "no prefill instance is ready". */
static void tried_message(char *msg, size_t cap, const char *role, const upstream *b, int n,
                          uint64_t tried) {
    if (!tried) {
        snprintf(msg, cap, "no %s instance is ready", role);
        return;
    }
    size_t len = (size_t)snprintf(msg, cap, "no other %s instance is reachable (", role);
    const char *sep = "";
    for (int i = 0; i < n && i < 64 && len < cap; i++)
        if (tried & (1ull << i)) {
            len += (size_t)snprintf(msg + len, cap - len, "%s%s", sep, b[i].url);
            sep = ", ";
        }
    if (len < cap) snprintf(msg + len, cap - len, " refused the connection or is unreachable)");
}

/* Picks a prefill (not tried yet) and a decode, builds the decode body for
 * that prefill and sends both.  Returns 1 if r was freed. */
static int send_pd(relay *r) {
    proxy *px = r->px;
    const pd_engine *eng = NULL;
    policy_hint hint = {0, NULL};
    if (px->cfg.policy == POLICY_PREFIX)
        hint.prefix_hash = pd_prefix_hash(r->body, (size_t)px->cfg.prefix_bytes);
    uint64_t kv_tokens = 0;
    upstream *p =
        px->kv ? kv_route_pick(px->kv, px->prefill, px->nprefill, &px->rr_prefill, r->p_tried,
                               &hint, &eng, &r->kv, r->body, hs_req_path(r->client), &kv_tokens)
               : policy_pick(px->cfg.policy, px->prefill, px->nprefill, &px->rr_prefill, r->p_tried,
                             &hint, &eng);
    if (!p) {
        char msg[1024];
        tried_message(msg, sizeof msg, "prefill", px->prefill, px->nprefill, r->p_tried);
        relay_fail(r, 503, PERR_NOT_READY, msg);
        return 1;
    }
    /* Fresh ids for every attempt: a decode instance may still be aborting
     * the request of a previous attempt. */
    char u[PD_UUID_LEN + 1];
    uuid4(r->request_id);
    uuid4(u);
    snprintf(r->transfer_id, sizeof r->transfer_id, "xfer-%s", u);
    json_t *pb = pd_prefill_body_for(r->body, r->transfer_id, hs_req_path(r->client));
    if (pb && px->kv && r->kv.pool_tokens > 0) /* the holder of a longer prefix (kv_route.h) */
        json_object_set_new(json_object_get(pb, "kv_transfer_params"), "pool_source",
                            json_pack("{s:s, s:s, s:i}", "remote_engine_id",
                                      r->kv.pool_engine_id, "remote_bootstrap_addr",
                                      r->kv.pool_bootstrap, "num_tokens", r->kv.pool_tokens));
    free(r->p_body);
    r->p_body = pb ? json_dumps(pb, JSON_COMPACT) : NULL;
    json_decref(pb);
    if (!r->p_body) {
        relay_fail(r, 500, PERR_PREFILL, "out of memory building the prefill request");
        return 1;
    }
    r->p = p;
    r->p_rank = eng->dp_rank;
    snprintf(r->p_group, sizeof r->p_group, "%s", p->group);
    snprintf(r->p_engine_id, sizeof r->p_engine_id, "%s", eng->engine_id);
    json_t *db = pd_decode_body(r->body, r->p_engine_id, p->bootstrap_url, r->transfer_id);
    free(r->d_body);
    r->d_body = db ? json_dumps(db, JSON_COMPACT) : NULL;
    json_decref(db);
    if (!r->d_body) {
        relay_fail(r, 500, PERR_DECODE, "out of memory building the decode request");
        return 1;
    }
    char *hdr = headers_for(r, 1);
    hc_timeouts t = {px->cfg.connect_timeout_s, px->cfg.upstream_timeout_s};
    r->p_st = P_PENDING;
    r->p_status = 0;
    r->p_start_ns = clock_now_ns();
    r->p_req = hc_request(p->pool, "POST", hs_req_path(r->client), hdr, r->p_body,
                          strlen(r->p_body), &t, &P_CB, r);
    free(hdr);
    if (!r->p_req) {
        relay_fail(r, 500, PERR_PREFILL, "out of memory sending the prefill request");
        return 1;
    }
    p->outstanding++;
    p->requests++;
    r->p_kv_tokens = px->kv ? kv_tokens : 0;
    p->kv_pending_tokens += r->p_kv_tokens;
    LOG_D(MOD, "request %s: %s to prefill %s dp rank %d, transfer_id %s", r->request_id,
          hs_req_path(r->client), p->url, r->p_rank, r->transfer_id);
    return send_decode(r);
}

/* Sends the decode request (body already built) to a decode not tried yet. */
static int send_decode(relay *r) {
    proxy *px = r->px;
    /* a decode pairs with the prefill's group (model and KV layout) */
    policy_hint hint = {0, r->body ? r->p_group : NULL};
    upstream *d = policy_pick(px->cfg.policy, px->decode, px->ndecode, &px->rr_decode, r->d_tried,
                              &hint, NULL);
    if (!d) {
        char msg[1024];
        tried_message(msg, sizeof msg, "decode", px->decode, px->ndecode, r->d_tried);
        relay_fail(r, 503, PERR_NOT_READY, msg);
        return 1;
    }
    r->d = d;
    char *hdr = headers_for(r, 0);
    hc_timeouts t = {px->cfg.connect_timeout_s, px->cfg.upstream_timeout_s};
    r->d_start_ns = clock_now_ns();
    const char *target = r->body ? hs_req_path(r->client) : hs_req_head(r->client)->target;
    r->d_req = hc_request(d->pool, r->d_body ? "POST" : "GET", target, hdr, r->d_body,
                          r->d_body ? strlen(r->d_body) : 0, &t, &D_CB, r);
    free(hdr);
    if (!r->d_req) {
        relay_fail(r, 500, PERR_DECODE, "out of memory sending the decode request");
        return 1;
    }
    d->outstanding++;
    d->requests++;
    return 0;
}

/* Forgets a decode response (before re-issuing the decode request). */
static void reset_d(relay *r) {
    for (int i = 0; i < r->d_nhdrs; i++) {
        free(r->d_hdrs[i].name);
        free(r->d_hdrs[i].value);
    }
    free(r->d_hdrs);
    r->d_hdrs = NULL;
    r->d_nhdrs = 0;
    r->d_status = 0;
    r->d_clen = -1;
    r->d_done = 0;
    r->d_paused = 0;
    r->sse = 0;
    evbuffer_drain(r->held, evbuffer_get_length(r->held));
    evbuffer_drain(r->sse_tail, evbuffer_get_length(r->sse_tail));
}

/* ---- prefill callbacks -------------------------------------------------- */

static void p_head(hc_req *q, const http_head *h, void *arg) {
    relay *r = arg;
    r->p_status = h->status;
    const char *ct = http_head_get(h, "Content-Type");
    snprintf(r->p_ctype, sizeof r->p_ctype, "%s", ct && strlen(ct) < sizeof r->p_ctype ? ct : "");
}

static void p_data(hc_req *q, struct evbuffer *data, void *arg) {
    relay *r = arg;
    if (r->p_status / 100 == 2) return; /* the 1-token answer is discarded */
    size_t have = evbuffer_get_length(r->p_err);
    /* One byte beyond the limit tells "too large to relay" from "exactly the limit". */
    if (have <= RELAY_4XXBODY_MAX)
        evbuffer_remove_buffer(data, r->p_err, RELAY_4XXBODY_MAX + 1 - have);
}

/* The prefill rejected the request (4xx): the client gets that answer as is
 * (status, Content-Type, body); the decode request is cancelled. */
static void relay_prefill_rejected(relay *r) {
    cancel_d(r);
    size_t n = evbuffer_get_length(r->p_err);
    LOG_I(MOD, "request %s: prefill %s answered HTTP %d; relaying it", r->request_id, r->p->url,
          r->p_status);
    r->px->errors[PERR_PREFILL_REJECTED]++;
    proxy_count_status(r->px, r->p_status);
    http_header ct = {"Content-Type", r->p_ctype[0] ? r->p_ctype : "application/json"};
    hs_reply_start(r->client, r->p_status, &ct, 1, (int64_t)n);
    if (n) hs_reply_data(r->client, r->p_err);
    hs_reply_end(r->client);
    r->client = NULL;
    relay_free(r);
}

static void p_done(hc_req *q, int err, void *arg) {
    relay *r = arg;
    r->p_req = NULL;
    upstream *p = r->p;
    if (err == HC_ECONNECT || err == HC_ERESOLVE) {
        p_finish_metrics(r, 1);
        char why[160];
        snprintf(why, sizeof why, "connection refused or unreachable (%s)", hc_strerror(err));
        upstream_mark_down(p, why);
        r->px->retries[UPSTREAM_PREFILL]++;
        r->p_tried |= 1ull << p->index;
        LOG_W(MOD, "request %s: prefill %s unreachable; retrying on another prefill", r->request_id,
              p->url);
        cancel_d(r); /* its body names this prefill's engine */
        reset_d(r);
        (void)send_pd(r);
        return;
    }
    char msg[RELAY_ERRBODY_MAX + 300];
    if (err) {
        p_finish_metrics(r, 1);
        snprintf(msg, sizeof msg, "prefill instance %s failed: %s", p->url, hc_strerror(err));
        relay_fail(r, err == HC_ETIMEOUT ? 504 : 502, PERR_PREFILL, msg);
        return;
    }
    if (r->p_status / 100 == 4 && evbuffer_get_length(r->p_err) <= RELAY_4XXBODY_MAX) {
        p_finish_metrics(r, 0);
        relay_prefill_rejected(r);
        return;
    }
    if (r->p_status / 100 != 2) {
        p_finish_metrics(r, r->p_status >= 500);
        size_t n = evbuffer_get_length(r->p_err);
        if (n > RELAY_ERRBODY_MAX) n = RELAY_ERRBODY_MAX;
        snprintf(msg, sizeof msg, "prefill instance %s failed: HTTP %d%s%.*s", p->url, r->p_status,
                 n ? ": " : "", (int)n, n ? (const char *)evbuffer_pullup(r->p_err, -1) : "");
        relay_fail(r, 502, PERR_PREFILL, msg);
        return;
    }
    p_finish_metrics(r, 0);
    r->p_st = P_OK;
    r->p_done_ns = clock_now_ns();
    metrics_hist_observe(&r->px->t_prefill, secs(r->p_done_ns - r->p_start_ns));
    if (r->d_paused && r->d_req && !r->started) {
        r->d_paused = 0;
        hc_pause(r->d_req, 0);
    }
    (void)relay_advance(r);
}

/* ---- decode callbacks --------------------------------------------------- */

static void d_head(hc_req *q, const http_head *h, void *arg) {
    relay *r = arg;
    r->d_status = h->status;
    r->d_clen = h->chunked ? -1 : h->content_length;
    const char *ct = http_head_get(h, "Content-Type");
    r->sse = r->d_clen < 0 && ct && !strncasecmp(ct, "text/event-stream", 17);
    r->d_hdrs = calloc((size_t)h->nheaders + 1, sizeof *r->d_hdrs);
    for (int i = 0; r->d_hdrs && i < h->nheaders; i++) {
        r->d_hdrs[i].name = strdup(h->headers[i].name);
        r->d_hdrs[i].value = strdup(h->headers[i].value);
        r->d_nhdrs++;
    }
    if (h->status / 100 != 2 && r->p_st == P_PENDING)
        LOG_I(MOD, "request %s: decode %s answered HTTP %d; holding it for the prefill's verdict",
              r->request_id, r->d->url, h->status);
    (void)relay_advance(r);
}

static void d_data(hc_req *q, struct evbuffer *data, void *arg) {
    relay *r = arg;
    if (r->started) {
        send_client(r, data, 0);
        return;
    }
    evbuffer_add_buffer(r->held, data);
    /* a 400 too large to be the consumer's message: relayed from now on */
    if (r->d_status == 400 && evbuffer_get_length(r->held) > RELAY_4XXBODY_MAX) {
        (void)relay_advance(r); /* D is not done: r stays */
        if (r->started) return;
    }
    if (evbuffer_get_length(r->held) > RELAY_HOLD_MAX && !r->d_paused) {
        r->d_paused = 1;
        hc_pause(q, 1);
    }
}

/* Whether D's complete answer is the consumer's "bootstrap server ... knows no
 * engine '<the engine id sent>'" (HTTP 400, mooncake_consumer.c) for a first
 * attempt whose prefill is still in play: P restarted after its engine table
 * was read. */
static int stale_engine(relay *r) {
    if (!r->body || r->engine_retried || r->d_status != 400 || r->started || r->p_st == P_GONE ||
        r->p_st == P_NONE)
        return 0;
    char needle[200];
    int n = snprintf(needle, sizeof needle, "knows no engine '%s'", r->p_engine_id);
    if (n < 0 || (size_t)n >= sizeof needle) return 0;
    return evbuffer_search(r->held, needle, (size_t)n, NULL).pos >= 0;
}

static void d_done(hc_req *q, int err, void *arg) {
    relay *r = arg;
    r->d_req = NULL;
    upstream *d = r->d;
    if ((err == HC_ECONNECT || err == HC_ERESOLVE) && !r->started) {
        d_finish_metrics(r, 1);
        char why[160];
        snprintf(why, sizeof why, "connection refused or unreachable (%s)", hc_strerror(err));
        upstream_mark_down(d, why);
        r->px->retries[UPSTREAM_DECODE]++;
        r->d_tried |= 1ull << d->index;
        LOG_W(MOD, "request %s: decode %s unreachable; retrying on another decode", r->request_id,
              d->url);
        (void)send_decode(r);
        return;
    }
    if (err) {
        d_finish_metrics(r, 1);
        char msg[512];
        snprintf(msg, sizeof msg, "decode instance %s failed: %s", d->url, hc_strerror(err));
        relay_fail(r, err == HC_ETIMEOUT ? 504 : 502, PERR_DECODE, msg);
        return;
    }
    d_finish_metrics(r, r->d_status >= 500);
    r->d_done = 1;
    if (stale_engine(r)) {
        /* P restarted after its table was read: its bootstrap server knows
         * other engine ids.  D pulled nothing, so D is resent (once) with
         * the id read again; P's answer goes on as it is. */
        LOG_W(MOD,
              "request %s: decode %s answered that prefill %s's bootstrap server knows no engine "
              "'%s' (the prefill restarted); re-reading its engine table",
              r->request_id, d->url, r->p->url, r->p_engine_id);
        r->engine_retried = 1;
        r->engine_wait = 1;
        if (upstream_refresh_table(r->p) == 0) return; /* relay_upstream_table goes on */
        r->engine_wait = 0;
    }
    (void)relay_advance(r);
}

static const hc_callbacks P_CB = {p_head, p_data, p_done};
static const hc_callbacks D_CB = {d_head, d_data, d_done};

/* ---- entry points ------------------------------------------------------- */

static relay *relay_new(proxy *px, hs_req *req, json_t *body) {
    relay *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->px = px;
    r->client = req;
    r->body = body;
    r->d_clen = -1;
    r->t0_ns = clock_now_ns();
    r->held = evbuffer_new();
    r->p_err = evbuffer_new();
    r->sse_tail = evbuffer_new();
    if (!r->held || !r->p_err || !r->sse_tail) {
        if (r->held) evbuffer_free(r->held);
        if (r->p_err) evbuffer_free(r->p_err);
        if (r->sse_tail) evbuffer_free(r->sse_tail);
        free(r);
        return NULL;
    }
    uuid4(r->request_id);
    px->inflight++;
    r->next = px->relays;
    if (r->next) r->next->prev = r;
    px->relays = r;
    hs_req_set_close_cb(req, client_gone, r);
    hs_req_set_drain_cb(req, client_drained, r);
    return r;
}

void relay_start_pd(proxy *px, hs_req *req, json_t *body) {
    relay *r = relay_new(px, req, body);
    if (!r) {
        json_decref(body);
        proxy_reply_error(px, req, 500, PERR_PREFILL, "out of memory");
        return;
    }
    (void)send_pd(r);
}

void relay_start_passthrough(proxy *px, hs_req *req) {
    relay *r = relay_new(px, req, NULL);
    if (!r) {
        proxy_reply_error(px, req, 500, PERR_DECODE, "out of memory");
        return;
    }
    r->p_st = P_NONE;
    (void)send_decode(r);
}

void relay_upstream_table(proxy *px, upstream *b, int ok) {
    relay *next;
    for (relay *r = px->relays; r; r = next) {
        next = r->next;
        if (!r->engine_wait || r->p != b) continue;
        r->engine_wait = 0;
        const pd_engine *e = NULL;
        for (int i = 0; ok && i < b->nengines && !e; i++)
            if (b->engines[i].dp_rank == r->p_rank) e = &b->engines[i];
        if (!e || !strcmp(e->engine_id, r->p_engine_id)) {
            /* not read, the rank is gone, or the same id: D's answer stands */
            LOG_W(MOD, "request %s: prefill %s's engine table %s; relaying decode's answer",
                  r->request_id, b->url,
                  !ok  ? "could not be read again"
                  : !e ? "no longer has the request's dp rank"
                       : "still names the same engine");
            (void)relay_advance(r);
            continue;
        }
        LOG_I(MOD,
              "request %s: resending the decode request with prefill %s's engine %s "
              "(was %s), transfer %s",
              r->request_id, b->url, e->engine_id, r->p_engine_id, r->transfer_id);
        snprintf(r->p_engine_id, sizeof r->p_engine_id, "%s", e->engine_id);
        /* the same transfer id: the restarted P holds (or is computing) its KV */
        json_t *db = pd_decode_body(r->body, r->p_engine_id, b->bootstrap_url, r->transfer_id);
        free(r->d_body);
        r->d_body = db ? json_dumps(db, JSON_COMPACT) : NULL;
        json_decref(db);
        if (!r->d_body) {
            relay_fail(r, 500, PERR_DECODE, "out of memory building the decode request");
            continue;
        }
        reset_d(r);
        px->engine_retries++;
        (void)send_decode(r);
    }
}

void relay_upstream_unresponsive(proxy *px, upstream *b, const char *why) {
    relay *next;
    for (relay *r = px->relays; r; r = next) {
        next = r->next;
        if (r->p != b || r->p_st != P_PENDING || !r->body) continue;
        if (r->p_req) {
            hc_cancel(r->p_req);
            r->p_req = NULL;
            p_finish_metrics(r, 1);
        }
        r->p_st = P_GONE;
        if (r->d_done) { /* D's whole answer is here: it is the client's */
            LOG_W(MOD, "request %s: prefill %s stopped answering (%s); relaying decode's answer",
                  r->request_id, b->url, why);
            (void)relay_advance(r);
            continue;
        }
        char msg[1400];
        snprintf(msg, sizeof msg,
                 "prefill instance %s stopped answering (%s); the request was abandoned", b->url,
                 why);
        relay_fail(r, 502, PERR_PREFILL, msg);
    }
}
