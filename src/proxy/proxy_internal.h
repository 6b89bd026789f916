/*
 * proxy_internal — the proxy state shared by proxy.c (front end, probes,
 * metrics) and relay.c (per-request P/D dispatch and relay).  Not a public
 * header.
 */
#ifndef DISAGG_PROXY_PROXY_INTERNAL_H
#define DISAGG_PROXY_PROXY_INTERNAL_H

#include "proxy/upstream.h"
#include "base/http_server.h"
#include "proxy/metrics.h"
#include "proxy/proxy.h"

#include <jansson.h>

typedef enum proxy_endpoint {
    EP_COMPLETIONS = 0, /* POST /v1/completions */
    EP_CHAT,            /* POST /v1/chat/completions */
    EP_MODELS,          /* GET /v1/models */
    EP_HEALTH,          /* GET /health */
    EP_METRICS,         /* GET /metrics */
    EP_RESPONSES,       /* POST /v1/responses (OpenAI Responses) */
    EP_MESSAGES,        /* POST /v1/messages (Anthropic Messages) */
    EP_OTHER,           /* anything else (404/405) */
    EP_COUNT
} proxy_endpoint;

typedef enum proxy_error_kind {
    PERR_BAD_REQUEST = 0,  /* invalid JSON, non-object body */
    PERR_NOT_FOUND,        /* unknown path */
    PERR_METHOD,           /* wrong method */
    PERR_NOT_READY,        /* no ready prefill/decode instance */
    PERR_PREFILL,          /* prefill request failed (502) */
    PERR_DECODE,           /* decode request failed before or during the reply */
    PERR_CLIENT_GONE,      /* client disconnected before the reply ended */
    PERR_PREFILL_REJECTED, /* prefill answered 4xx: relayed unchanged */
    PERR_DECODE_REJECTED,  /* decode answered non-2xx (after a 2xx prefill): relayed */
    PERR_UNAUTHORIZED,     /* --api-key set and the client did not send it */
    PERR_COUNT
} proxy_error_kind;

typedef struct membership membership;
struct relay;

struct proxy {
    struct event_base *base;     /* loop */
    proxy_config cfg;            /* settings (strings owned by the caller) */
    hs_server *srv;              /* front end */
    upstream_env env;            /* shared upstream settings */
    char auth_header[512];       /* "Authorization: Bearer KEY\r\n" or "" */
    upstream *prefill;           /* (nprefill) slots; with discovery POLICY_MAX_BACKENDS of them */
    int nprefill;                /* slots in use (with discovery some may be inactive) */
    upstream *decode;            /* (ndecode) */
    int ndecode;                 /* slots in use */
    membership *members;         /* --discovery (membership.c), or NULL */
    kv_route *kv;                /* --policy kv_aware (kv_route.c), or NULL */
    unsigned rr_prefill;         /* round-robin cursor over prefill slots */
    unsigned rr_decode;          /* round-robin cursor over decode instances */
    struct event *probe_timer;   /* periodic health probes */
    int draining;                /* stop signal received: no new requests, finishing the rest */
    uint64_t drain_deadline_ns;  /* when draining gives up on requests still running */
    struct event *drain_timer;   /* checks whether the drain is over */
    int inflight;                /* client requests being relayed */
    struct relay *relays;        /* (inflight) those requests, a list (relay.c) */
    uint64_t requests[EP_COUNT]; /* client requests by endpoint */
    uint64_t responses[6];       /* client responses by status class (index = status/100) */
    uint64_t errors[PERR_COUNT]; /* failures by kind */
    uint64_t retries[2]; /* requests resent to another upstream after a refused connect, by role */
    uint64_t engine_retries;   /* decode requests resent with a prefill's re-read engine id */
    metrics_hist t_prefill;    /* P dispatch -> P response end */
    metrics_hist t_decode;     /* P response end -> D response end (the decode part) */
    metrics_hist t_first_byte; /* client request -> first byte relayed */
    metrics_hist t_total;      /* client request -> reply end */
};

/* Sends an OpenAI-style error reply and counts it. */
void proxy_reply_error(proxy *px, hs_req *req, int status, proxy_error_kind kind, const char *fmt,
                       ...) __attribute__((format(printf, 5, 6)));
/* Counts a reply's status (for replies not sent by proxy_reply_error). */
void proxy_count_status(proxy *px, int status);

/* relay.c: a disaggregated completion: body is the parsed client body (the
 * relay takes the reference). */
void relay_start_pd(proxy *px, hs_req *req, json_t *body);
/* relay.c: a request forwarded as is to one decode instance (GET /v1/models). */
void relay_start_passthrough(proxy *px, hs_req *req);
/* relay.c: prefill b stopped answering (why): the requests still waiting
 * for it stop waiting (D's complete answer is relayed, else a 502). */
void relay_upstream_unresponsive(proxy *px, upstream *b, const char *why);
/* relay.c: prefill b's engine table was re-read (ok) or could not be (0): the
 * requests whose decode named its old engine unknown are resent to a decode
 * with the new engine id, or get that decode's answer. */
void relay_upstream_table(proxy *px, upstream *b, int ok);

#endif
