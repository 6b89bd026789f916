/* kv_route — see kv_route.h. */
#include "proxy/kv_route.h"

#include "base/log.h"
#include "proxy/kv_index.h"
#include "proxy/kv_subscriber.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define MOD "proxy"

/* A block only in a lower tier counts as this much of a block in the instance's own cache:
 * a copy back is cheaper than a prefill, but not free. */
#define KV_ROUTE_HOST_WEIGHT 0.8
#define KV_ROUTE_DISK_WEIGHT 0.5

typedef enum kv_result { KV_HIT = 0, KV_LOAD, KV_MISS, KV_NO_TOKENS, KV_RESULTS } kv_result;

struct kv_route {
    kv_route_config cfg;          /* settings (strings owned by the caller) */
    void *zctx;                   /* ZMQ context of every subscription */
    struct event_base *base;      /* the proxy's loop */
    uint64_t results[KV_RESULTS]; /* requests by routing result */
    uint64_t prompt_tokens;       /* prompt tokens of the requests routed with tokens */
    uint64_t cached_tokens;       /* of them, held by the chosen prefill (any medium) */
    uint64_t pool_named;          /* requests sent with a pool source */
    uint64_t pool_tokens;         /* the tokens those sources held */
    double mean_uncached;         /* moving mean of the uncached tokens of a prefill */
};

void kv_route_config_default(kv_route_config *c) {
    memset(c, 0, sizeof *c);
    c->events_port = 5557;
    c->topic = "";
    c->load_weight = 1;
    c->max_blocks = (size_t)1 << 22;
    c->replay_timeout_s = 5;
}

kv_route *kv_route_new(struct event_base *base, const kv_route_config *c, char *err,
                       size_t errcap) {
    if (!c->tokens) {
        snprintf(err, errcap, "--policy kv_aware needs the instances' tokenizer (--tokenizer)");
        return NULL;
    }
    kv_route *kr = calloc(1, sizeof *kr);
    if (!kr || !(kr->zctx = zmq_ctx_new())) {
        free(kr);
        snprintf(err, errcap, "cannot create a ZMQ context");
        return NULL;
    }
    kr->cfg = *c;
    kr->base = base;
    return kr;
}

void kv_route_free(kv_route *kr) {
    if (!kr) return;
    zmq_ctx_term(kr->zctx); /* every socket is closed by then (LINGER 0) */
    free(kr);
}

static const char *endpoint_for(const kv_route_endpoint *list, int n, const upstream *b) {
    for (int i = 0; i < n; i++) {
        char host[256], e[300];
        uint16_t port;
        if (!upstream_parse_url(list[i].url, host, sizeof host, &port, e, sizeof e) &&
            port == b->port && !strcmp(host, b->host))
            return list[i].endpoint;
    }
    return NULL;
}

int kv_route_attach(kv_route *kr, upstream *b, char *err, size_t errcap) {
    if (b->role != UPSTREAM_PREFILL) return 0;
    char ep[300], rep[300] = "";
    int v6 = strchr(b->host, ':') != NULL;
    const char *e = endpoint_for(kr->cfg.endpoints, kr->cfg.nendpoints, b);
    if (e)
        snprintf(ep, sizeof ep, "%s", e);
    else
        snprintf(ep, sizeof ep, "tcp://%s%s%s:%d", v6 ? "[" : "", b->host, v6 ? "]" : "",
                 kr->cfg.events_port);
    e = endpoint_for(kr->cfg.replay, kr->cfg.nreplay, b);
    if (e)
        snprintf(rep, sizeof rep, "%s", e);
    else if (kr->cfg.replay_port)
        snprintf(rep, sizeof rep, "tcp://%s%s%s:%d", v6 ? "[" : "", b->host, v6 ? "]" : "",
                 kr->cfg.replay_port);
    b->kv = kv_index_new(kr->cfg.max_blocks);
    if (!b->kv) {
        snprintf(err, errcap, "out of memory");
        return -ENOMEM;
    }
    kv_subscriber_opts o = {ep, rep, kr->cfg.topic, kr->cfg.replay_timeout_s};
    b->kvsub = kv_subscriber_new(kr->base, kr->zctx, b->url, &o, b->kv, err, errcap);
    if (!b->kvsub) {
        kv_index_free(b->kv);
        b->kv = NULL;
        return -EINVAL;
    }
    return 0;
}

void kv_route_restarted(upstream *b, const char *why) {
    if (b->kvsub) kv_subscriber_reset(b->kvsub, why);
}

void kv_route_req_free(kv_route_req *rq) {
    free(rq->ids);
    free(rq->chain);
    memset(rq, 0, sizeof *rq);
}

/* The request's block hashes at block size bs (recomputed only when bs changes). */
static void chain_at(kv_route_req *rq, int bs) {
    if (rq->chain_bs == bs) return;
    free(rq->chain);
    rq->chain = NULL;
    rq->nchain = 0;
    rq->chain_bs = bs;
    size_t nb = rq->n / (size_t)bs;
    if (!nb || !(rq->chain = malloc(nb * sizeof *rq->chain))) return;
    kv_index_chain(rq->ids, rq->n, bs, rq->chain);
    rq->nchain = (int)nb;
}

static void tokenize(kv_route *kr, kv_route_req *rq, const json_t *body, const char *path) {
    rq->done = 1;
    int chat = !strcmp(path, "/v1/chat/completions");
    if (!chat && strcmp(path, "/v1/completions")) return; /* Responses, Messages: no tokens */
    char err[512] = "";
    if (kr->cfg.tokens(kr->cfg.tokens_arg, body, chat, &rq->ids, &rq->n, err, sizeof err)) {
        LOG_D(MOD, "kv_aware: the prompt has no token ids (%s): least_loaded", err);
        free(rq->ids);
        rq->ids = NULL;
        rq->n = 0;
    }
}

upstream *kv_route_pick(kv_route *kr, upstream *list, int n, unsigned *rr, uint64_t exclude,
                        const policy_hint *hint, const pd_engine **engine, kv_route_req *rq,
                        const json_t *body, const char *path, uint64_t *uncached) {
    if (!rq->done) tokenize(kr, rq, body, path);
    *uncached = rq->n;
    rq->pool_tokens = 0;
    upstream *best = NULL, *holder = NULL;
    double best_cost = 0, best_load = 0;
    int best_cached = 0, any_cached = 0, holder_cached = 0;
    unsigned start = *rr;
    for (int j = 0; rq->n && j < n; j++) {
        upstream *b = &list[(start + (unsigned)j) % (unsigned)n];
        if (!policy_eligible(b, exclude, hint)) continue;
        kv_index_stats st = {0};
        if (b->kv) kv_index_get_stats(b->kv, &st);
        int cached = 0;
        double wcached = 0;
        if (b->kv && st.block_size > 0) {
            chain_at(rq, st.block_size);
            int per[KV_MEDIA];
            int m = kv_index_match(b->kv, rq->chain, rq->nchain, per);
            cached = m * st.block_size;
            wcached =
                st.block_size * (per[KV_MEDIUM_GPU] + KV_ROUTE_HOST_WEIGHT * per[KV_MEDIUM_CPU] +
                                 KV_ROUTE_DISK_WEIGHT * per[KV_MEDIUM_DISK]);
        }
        any_cached |= cached > 0;
        if (cached > holder_cached && b->nengines > 0) {
            holder = b;
            holder_cached = cached;
        }
        double others = b->has_load ? (double)b->pub_running + b->pub_waiting - b->outstanding : 0;
        double queued =
            (double)b->kv_pending_tokens + (others > 0 ? others * kr->mean_uncached : 0);
        double cost = ((double)rq->n - wcached) + kr->cfg.load_weight * queued;
        double load = policy_load(b);
        if (!best || cost < best_cost || (cost == best_cost && load < best_load)) {
            best = b;
            best_cost = cost;
            best_load = load;
            best_cached = cached;
        }
    }
    kv_result res = !rq->n ? KV_NO_TOKENS : !any_cached ? KV_MISS : best_cached ? KV_HIT : KV_LOAD;
    if (res == KV_NO_TOKENS || res == KV_MISS) {
        best = policy_pick(POLICY_LEAST_LOADED, list, n, rr, exclude, hint, engine);
        best_cached = 0;
    } else {
        (*rr)++;
        if (engine) *engine = &best->engines[best->rank_rr++ % (unsigned)best->nengines];
    }
    if (!best) return NULL;
    if (kr->cfg.pool_fetch && holder && holder != best && holder_cached > best_cached) {
        snprintf(rq->pool_engine_id, sizeof rq->pool_engine_id, "%s", holder->engines[0].engine_id);
        snprintf(rq->pool_bootstrap, sizeof rq->pool_bootstrap, "%s", holder->bootstrap_url);
        rq->pool_tokens = holder_cached;
        kr->pool_named++;
        kr->pool_tokens += (uint64_t)holder_cached;
        LOG_D(MOD, "kv_aware: pool source %s (%d tokens) for a prefill on %s", holder->url,
              holder_cached, best->url);
    }
    if (!rq->counted) {
        rq->counted = 1;
        kr->results[res]++;
        kr->prompt_tokens += rq->n;
        kr->cached_tokens += (uint64_t)best_cached;
    }
    *uncached = rq->n > (size_t)best_cached ? rq->n - (size_t)best_cached : 0;
    kr->mean_uncached += ((double)*uncached - kr->mean_uncached) * 0.1;
    LOG_D(MOD, "kv_aware: %zu prompt tokens, %d cached on %s (%s)", rq->n, best_cached, best->url,
          res == KV_HIT    ? "hit"
          : res == KV_LOAD ? "load"
          : res == KV_MISS ? "miss"
                           : "no tokens");
    return best;
}

void kv_route_write_metrics(const kv_route *kr, const upstream *list, int n, prom *o) {
    static const char *const res[KV_RESULTS] = {"hit", "load", "miss", "no_tokens"};
    prom_family(o, "disagg_proxy_kv_aware_requests", PROM_COUNTER,
                "kv_aware prefill choices: hit (the chosen prefill holds a prefix of the prompt), "
                "load (one does, but load made another cheaper), miss (none does: least_loaded), "
                "no_tokens (no token ids: least_loaded).");
    for (int i = 0; i < KV_RESULTS; i++)
        prom_sample_u64(o, kr->results[i], "result", res[i], NULL);
    prom_family(o, "disagg_proxy_kv_aware_prompt_tokens", PROM_COUNTER,
                "Prompt tokens of the requests kv_aware routed with token ids.");
    prom_sample_u64(o, kr->prompt_tokens, NULL);
    prom_family(o, "disagg_proxy_kv_aware_cached_tokens", PROM_COUNTER,
                "Of them, the tokens of the prefix the chosen prefill held (any medium).");
    prom_sample_u64(o, kr->cached_tokens, NULL);
    prom_family(o, "disagg_proxy_kv_pool_source_requests", PROM_COUNTER,
                "--kv-pool-fetch: prefill requests that named a pool source (the prefill holding "
                "a longer prefix of the prompt than the one chosen).");
    prom_sample_u64(o, kr->pool_named, NULL);
    prom_family(o, "disagg_proxy_kv_pool_source_tokens", PROM_COUNTER,
                "--kv-pool-fetch: the prefix tokens those pool sources held.");
    prom_sample_u64(o, kr->pool_tokens, NULL);
    static const char *const media[KV_MEDIA] = {"GPU", "CPU", "DISK"};
    prom_family(o, "disagg_proxy_kv_index_blocks", PROM_GAUGE,
                "Blocks each prefill holds as its KV events tell it, by medium.");
    for (int i = 0; i < n; i++) {
        if (!list[i].active || !list[i].kv) continue;
        kv_index_stats st;
        kv_index_get_stats(list[i].kv, &st);
        for (int m = 0; m < KV_MEDIA; m++)
            prom_sample_u64(o, st.blocks[m], "backend", list[i].url, "medium", media[m], NULL);
    }
    static const struct {
        const char *name, *help;
    } per[] = {
        {"disagg_proxy_kv_event_batches", "KV event batches applied (live and replayed)."},
        {"disagg_proxy_kv_event_gaps", "Gaps in the KV events' sequence numbers."},
        {"disagg_proxy_kv_event_replays", "Gaps the replay endpoint filled."},
        {"disagg_proxy_kv_index_drops",
         "Times a prefill's index was dropped: a gap not filled, a restart, AllBlocksCleared."},
        {"disagg_proxy_kv_event_errors", "KV event messages or batches that could not be read."},
    };
    for (size_t k = 0; k < sizeof per / sizeof per[0]; k++) {
        prom_family(o, per[k].name, PROM_COUNTER, per[k].help);
        for (int i = 0; i < n; i++) {
            if (!list[i].active || !list[i].kvsub) continue;
            kv_subscriber_stats ss;
            kv_index_stats st;
            kv_subscriber_get_stats(list[i].kvsub, &ss);
            kv_index_get_stats(list[i].kv, &st);
            uint64_t v = k == 0   ? ss.batches
                         : k == 1 ? ss.gaps
                         : k == 2 ? ss.replays
                         : k == 3 ? ss.replay_failed + ss.restarts + st.cleared
                                  : ss.bad;
            prom_sample_u64(o, v, "backend", list[i].url, NULL);
        }
    }
}
