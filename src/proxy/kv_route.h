/*
 * kv_route — `--policy kv_aware` (vllm-router's name): prefills are chosen by
 * what their KV caches hold, as their KV events tell it.  Each prefill instance
 * gets a kv_index fed by a kv_subscriber (its events endpoint: given per URL
 * with --kv-events-endpoint URL=tcp://HOST:PORT, else tcp://<its host>:
 * --kv-events-port); a request's prompt is turned into token ids by the
 * tokenizer callback (the instances' tokenizer and chat template, loaded by
 * `disagg proxy --tokenizer`), its full blocks hashed (kv_index_chain, at each
 * instance's block size), and every eligible prefill scored:
 *
 *   cached(u) = block_size x (GPU blocks + 0.8 x blocks only in the host tier
 *               + 0.5 x blocks only on disk) of the prompt's longest prefix u holds
 *   queued(u) = uncached prompt tokens of this proxy's prefills in flight on u
 *               + (published requests - this proxy's) x the mean of those tokens
 *   cost(u)   = (prompt tokens - cached(u)) + load_weight x queued(u)
 *
 * the lowest cost wins (ties: the lower load, then round robin).  When no
 * eligible prefill holds any block of the prompt (or it has no tokens: too short,
 * /v1/responses or /v1/messages bodies, a tokenizer error) the choice is
 * least_loaded's.  Decodes are always least_loaded.  With pool_fetch (--kv-pool-fetch), a
 * request sent to a prefill that holds less of its prompt than another eligible prefill
 * (load made it cheaper) names that holder in kv_route_req.pool_* (its engine id, bootstrap
 * address and the tokens it holds): the relay puts it in the prefill's
 * kv_transfer_params.pool_source, and the prefill pulls that prefix (docs/kv_pool.md).  The
 * index is advisory:
 * events lag the instances by a step, and a request routed on a block evicted
 * meanwhile only loses the hit.
 */
#ifndef DISAGG_PROXY_KV_ROUTE_H
#define DISAGG_PROXY_KV_ROUTE_H

#include "base/prom.h"
#include "proxy/policy.h"
#include "proxy/upstream.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

struct event_base;

/* The token ids of a request body's first prompt (chat: messages rendered); 0 and a
 * malloc'ed *ids, or nonzero with err.  Installed by the command (cli/cmd_proxy.c). */
typedef int (*kv_route_tokens_fn)(void *arg, const json_t *body, int chat, int32_t **ids, size_t *n,
                                  char *err, size_t errcap);

typedef struct kv_route_endpoint {
    const char *url;      /* a --prefill URL */
    const char *endpoint; /* tcp://HOST:PORT */
} kv_route_endpoint;

typedef struct kv_route_config {
    const kv_route_endpoint *endpoints; /* (nendpoints) --kv-events-endpoint URL=EP */
    int nendpoints;
    const kv_route_endpoint *replay; /* (nreplay) --kv-events-replay-endpoint URL=EP */
    int nreplay;
    int events_port;           /* --kv-events-port: the others' endpoint tcp://<host>:PORT (5557) */
    int replay_port;           /* --kv-events-replay-port: the others' replay (0 = none) */
    const char *topic;         /* --kv-events-topic-filter ("") */
    double load_weight;        /* --kv-aware-load-weight (1) */
    size_t max_blocks;         /* --kv-index-max-blocks: per instance (4194304) */
    double replay_timeout_s;   /* one replay's deadline (5) */
    int pool_fetch;            /* --kv-pool-fetch: name the holder of the longest prefix */
    kv_route_tokens_fn tokens; /* the prompt's token ids */
    void *tokens_arg;          /* its argument */
} kv_route_config;

/* Per request: its token ids and block hashes, computed once (retries reuse them). */
typedef struct kv_route_req {
    int done;        /* tokenized (or failed to) */
    int32_t *ids;    /* (n) token ids, NULL when the request has none */
    size_t n;        /* count */
    uint64_t *chain; /* (nchain) block hashes at block size chain_bs */
    int nchain;      /* full blocks */
    int chain_bs;    /* their block size (0: none yet) */
    int counted;     /* its result is in the counters */
    /* the last pick's pool source (pool_tokens 0: none): the eligible prefill holding the
     * longest prefix of the prompt when the pick is another one holding less */
    char pool_engine_id[128]; /* its engine id (dp rank 0's) */
    char pool_bootstrap[300]; /* its bootstrap address, "http://host:port" */
    int pool_tokens;          /* the prefix it holds (any medium), in tokens */
} kv_route_req;

typedef struct kv_route kv_route;

void kv_route_config_default(kv_route_config *c);
/* The ZMQ context and the settings (the strings stay the caller's).  NULL with err. */
kv_route *kv_route_new(struct event_base *base, const kv_route_config *c, char *err, size_t errcap);
void kv_route_free(kv_route *kr);
/* Gives prefill b its index and subscription (upstream_free frees them; kr must outlive
 * them); 0, or -EINVAL with err (a bad endpoint). */
int kv_route_attach(kv_route *kr, upstream *b, char *err, size_t errcap);
/* b restarted (its engine ids changed): its index is dropped. */
void kv_route_restarted(upstream *b, const char *why);

/* Chooses a prefill for the request of path with client body body (policy_pick's
 * contract for the other arguments); *uncached gets the prompt tokens the chosen prefill
 * does not hold (to count on its kv_pending_tokens while the prefill runs). */
upstream *kv_route_pick(kv_route *kr, upstream *list, int n, unsigned *rr, uint64_t exclude,
                        const policy_hint *hint, const pd_engine **engine, kv_route_req *rq,
                        const json_t *body, const char *path, uint64_t *uncached);
void kv_route_req_free(kv_route_req *rq);
/* The kv_aware series of /metrics, for the prefills list[0..n). */
void kv_route_write_metrics(const kv_route *kr, const upstream *list, int n, prom *o);

#endif
