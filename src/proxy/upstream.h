/*
 * upstream — one upstream instance of the proxy (a prefill or a decode
 * server): its address and bootstrap address (from `--prefill URL
 * [BOOTSTRAP_PORT]` / `--decode URL`), connection pools, health state and
 * discovery (GET /health until 200, then for a prefill GET {bootstrap}/query
 * for dp_rank -> engine_id, PROTOCOL.md §1-2), and per-upstream load and
 * latency counters.  A upstream that fails a probe or refuses a connection is
 * taken out of rotation; the periodic probe puts it back.  A prefill's probe
 * re-reads its engine table every time (GET /health, then GET /query): a
 * prefill restarted between two probes has new engine ids, and no probe of it
 * may ever fail.
 */
#ifndef DISAGG_PROXY_BACKEND_H
#define DISAGG_PROXY_BACKEND_H

#include "base/http_client.h"
#include "proxy/metrics.h"
#include "proxy/pd_request.h"

#include <stdint.h>

struct event_base;
struct upstream;

typedef enum upstream_role { UPSTREAM_PREFILL = 0, UPSTREAM_DECODE = 1 } upstream_role;

#define UPSTREAM_DEFAULT_BOOTSTRAP_PORT 8998
/* Health probes in a row that got no HTTP answer (timeout, reset, refused)
 * before the requests waiting for a prefill stop waiting: with the probe
 * timeout of 2 s and a timed-out probe repeated at once, a stopped prefill
 * is given up ~4-5 s after it stopped (one miss only takes it out of
 * rotation for new requests). */
#define UPSTREAM_HUNG_MISSES 2

typedef struct upstream_env {
    struct event_base *base; /* loop */
    const char *auth_header; /* "Authorization: Bearer KEY\r\n" for probes, or NULL */
    double probe_timeout_s;  /* per probe request */
    double pool_keepalive_s; /* idle pooled connection lifetime (hc_pool_set_keepalive) */
    /* called (why: the last probe's failure) each time a upstream's probes
     * have got no answer UPSTREAM_HUNG_MISSES times or more in a row */
    void (*on_unresponsive)(struct upstream *b, const char *why, void *arg);
    /* called when a prefill's engine ids differ from those it had before (a restart) */
    void (*on_restart)(struct upstream *b, const char *why, void *arg);
    /* called when a table re-read asked by upstream_refresh_table ended: ok = the
     * table was read (b->engines is current), 0 = it could not be read */
    void (*on_table)(struct upstream *b, int ok, void *arg);
    void *cb_arg; /* their argument */
} upstream_env;

typedef struct upstream {
    upstream_role role;          /* prefill or decode */
    int index;                   /* position in its role's list (exclusion bit) */
    char url[300];               /* "http://host:port" (label in logs and metrics) */
    char host[256];              /* API host */
    uint16_t port;               /* API port */
    char bootstrap_url[300];     /* prefill: "http://host:port" of its bootstrap server */
    char bootstrap_host[256];    /* prefill: bootstrap host */
    uint16_t bootstrap_port;     /* prefill: bootstrap port */
    hc_pool *pool;               /* keep-alive connections to the API */
    hc_pool *bootstrap_pool;     /* prefill: connections to the bootstrap server */
    const upstream_env *env;     /* shared settings */
    int healthy;                 /* last probe passed and no connection refused since */
    int ready;                   /* usable: healthy and (decode, or engine table known) */
    int ever_ready;              /* was ready at least once */
    pd_engine *engines;          /* prefill: (nengines) dp rank -> engine_id, by rank */
    int nengines;                /* number of dp ranks */
    unsigned rank_rr;            /* next dp rank (index into engines) for this upstream */
    int outstanding;             /* requests in flight on it */
    uint64_t requests;           /* requests sent */
    uint64_t errors;             /* requests that failed (connection, timeout, HTTP >= 500) */
    uint64_t transitions;        /* times it was taken out or put back */
    metrics_hist latency;        /* request start -> response end */
    hc_req *probe;               /* probe in flight */
    int probe_stage;             /* 0: /health, 1: /query */
    struct evbuffer *probe_body; /* (bytes) /query answer being read */
    int probe_status;            /* HTTP status of the probe */
    int misses;                  /* probes in a row that got no HTTP answer */
    char last_error[1024];       /* why it is out of rotation */
    /* membership (--discovery, membership.c); a --prefill/--decode upstream is active,
     * not discovered, with an empty group and no published load */
    int active;           /* the slot holds an instance */
    int discovered;       /* it came from etcd */
    int retiring;         /* its key is gone: no new requests, freed once idle */
    char key[512];        /* its etcd key */
    char group[520];      /* "MODEL|KV_LAYOUT": P and D pair only when equal ("" = any) */
    char engine_ids[256]; /* prefill: engine id(s) published, to notice a restart */
    int has_load;         /* the fields below were published */
    int pub_running;      /* published running requests */
    int pub_waiting;      /* published waiting requests */
    double pub_kv_usage;  /* published KV cache usage 0..1 */
    /* --policy kv_aware (kv_route.c), prefills only */
    struct kv_index *kv;         /* what its KV cache holds, from its KV events (or NULL) */
    struct kv_subscriber *kvsub; /* the subscription feeding kv */
    uint64_t kv_pending_tokens;  /* uncached prompt tokens of this proxy's prefills on it */
    char engines_seen[256];      /* engine ids of its last /query: a change is a restart */
    /* engine table re-reads asked by upstream_refresh_table (a decode named its engine
     * unknown): 0 none, 1 wanted (after the probe in flight), 2 the /query in flight is it */
    int refresh_state;
    /* times its /query showed new engine ids, by what read it: [0] the periodic
     * probe, [1] a re-read asked by upstream_refresh_table */
    uint64_t table_changes[2];
} upstream;

/* Parses "http://host[:port][/]" or "host:port" into host/port; -EINVAL with
 * a message in err naming the bad part. */
int upstream_parse_url(const char *url, char *host, size_t host_cap, uint16_t *port, char *err,
                       size_t errcap);
/* The bootstrap address of a prefill at url (API host api_host): bootstrap
 * NULL (port 8998 on the API host), "PORT", "host:port" or "http://host:port". */
int upstream_parse_bootstrap(const char *url, const char *api_host, const char *bootstrap,
                             char *host, size_t host_cap, uint16_t *port, char *err, size_t errcap);
/* bootstrap: NULL (port 8998 on the API host), "PORT", "host:port" or
 * "http://host:port". */
int upstream_init(upstream *b, upstream_role role, int index, const char *url,
                  const char *bootstrap, const upstream_env *env, char *err, size_t errcap);
void upstream_free(upstream *b);
/* Starts a probe unless one is in flight (or the upstream is retiring). */
void upstream_probe(upstream *b);
/* Prefill: re-read its bootstrap /query table now (after the probe in flight, if
 * any); env->on_table is called when that read ends.  -1 when the upstream is
 * retiring or inactive (nothing will be called). */
int upstream_refresh_table(upstream *b);
/* A request found it unreachable: take it out of rotation until a probe passes. */
void upstream_mark_down(upstream *b, const char *why);
const char *upstream_role_name(upstream_role r);

#endif
