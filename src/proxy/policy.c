/* policy — see policy.h. */
#include "proxy/policy.h"

#include "base/clock.h"
#include "base/rng.h"

#include <errno.h>
#include <string.h>

int policy_parse(const char *s, policy_kind *out) {
    if (!strcmp(s, "least_loaded"))
        *out = POLICY_LEAST_LOADED;
    else if (!strcmp(s, "round_robin"))
        *out = POLICY_ROUND_ROBIN;
    else if (!strcmp(s, "prefix"))
        *out = POLICY_PREFIX;
    else if (!strcmp(s, "p2c"))
        *out = POLICY_P2C;
    else if (!strcmp(s, "kv_aware"))
        *out = POLICY_KV_AWARE;
    else
        return -EINVAL;
    return 0;
}

const char *policy_name(policy_kind k) {
    return k == POLICY_ROUND_ROBIN ? "round_robin"
           : k == POLICY_PREFIX    ? "prefix"
           : k == POLICY_P2C       ? "p2c"
           : k == POLICY_KV_AWARE  ? "kv_aware"
                                   : "least_loaded";
}

static int group_ok(const upstream *b, const policy_hint *h) {
    return !h || !h->group || !h->group[0] || !b->group[0] || !strcmp(h->group, b->group);
}

int policy_eligible(const upstream *b, uint64_t exclude, const policy_hint *h) {
    return b->active && b->ready && !b->retiring && !(exclude >> b->index & 1) &&
           (b->role == UPSTREAM_DECODE || b->nengines > 0) && group_ok(b, h);
}

double policy_load(const upstream *b) {
    double pub = b->has_load ? (double)b->pub_running + b->pub_waiting : 0;
    double l = b->outstanding > pub ? b->outstanding : pub;
    return l + (b->has_load ? b->pub_kv_usage : 0);
}

uint64_t policy_hash(const void *p, size_t n) {
    const unsigned char *s = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * 1099511628211ull;
    return h ? h : 1;
}

/* Slots a upstream contributes to round-robin: its dp ranks (1 for decode). */
static int slots(const upstream *b) {
    return b->role == UPSTREAM_PREFILL ? b->nengines : 1;
}

upstream *policy_pick(policy_kind k, upstream *list, int n, unsigned *rr, uint64_t exclude,
                      const policy_hint *hint, const pd_engine **engine) {
    upstream *best = NULL;
    int rank_idx = 0;
    if (k == POLICY_P2C) {
        int idx[POLICY_MAX_BACKENDS], m = 0;
        for (int i = 0; i < n && m < POLICY_MAX_BACKENDS; i++)
            if (policy_eligible(&list[i], exclude, hint)) idx[m++] = i;
        if (m == 0) return NULL;
        /* two distinct draws (one when only one is eligible); the proxy is one thread */
        static uint64_t state;
        if (!state) state = clock_now_ns() | 1;
        uint64_t r = rng_splitmix64(&state);
        int a = (int)(r % (uint64_t)m), b = m > 1 ? (int)((r >> 32) % (uint64_t)(m - 1)) : a;
        if (m > 1 && b >= a) b++;
        best =
            policy_load(&list[idx[b]]) < policy_load(&list[idx[a]]) ? &list[idx[b]] : &list[idx[a]];
        if (best->role == UPSTREAM_PREFILL)
            rank_idx = (int)(best->rank_rr++ % (unsigned)best->nengines);
    } else if (k == POLICY_ROUND_ROBIN) {
        int total = 0;
        for (int i = 0; i < n; i++)
            if (policy_eligible(&list[i], exclude, hint)) total += slots(&list[i]);
        if (total == 0) return NULL;
        int pick = (int)(*rr % (unsigned)total);
        (*rr)++;
        for (int i = 0; i < n && !best; i++) {
            if (!policy_eligible(&list[i], exclude, hint)) continue;
            if (pick < slots(&list[i])) {
                best = &list[i];
                rank_idx = pick;
            } else {
                pick -= slots(&list[i]);
            }
        }
    } else {
        unsigned start = *rr;
        (*rr)++;
        for (int j = 0; j < n; j++) {
            upstream *b = &list[(start + (unsigned)j) % (unsigned)n];
            if (policy_eligible(b, exclude, hint) && (!best || policy_load(b) < policy_load(best)))
                best = b;
        }
        if (!best) return NULL;
        if (k == POLICY_PREFIX && hint && hint->prefix_hash && best->role == UPSTREAM_PREFILL) {
            upstream *pref = NULL; /* rendezvous: the highest hash of (prefix, URL) */
            uint64_t top = 0;
            for (int j = 0; j < n; j++) {
                upstream *b = &list[j];
                if (!policy_eligible(b, exclude, hint)) continue;
                uint64_t h = rng_mix64(hint->prefix_hash ^ policy_hash(b->url, strlen(b->url)));
                if (!pref || h > top) pref = b, top = h;
            }
            double lo = policy_load(best);
            if (pref && policy_load(pref) <= lo + POLICY_PREFIX_SLACK + lo / 4) best = pref;
        }
        if (best->role == UPSTREAM_PREFILL)
            rank_idx = (int)(best->rank_rr++ % (unsigned)best->nengines);
    }
    if (engine) *engine = best->role == UPSTREAM_PREFILL ? &best->engines[rank_idx] : NULL;
    return best;
}
