/* kv_load_cost — see kv_load_cost.h. */
#include "engine/kv_load_cost.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const tier_names[KV_TIER_COUNT] = {"host", "disk"};

void kv_load_cost_init(kv_load_cost *c, size_t block_bytes, int block_size) {
    memset(c, 0, sizeof *c);
    c->block_bytes = block_bytes;
    c->block_size = block_size;
    c->policy = KV_LOAD_POLICY_COST;
    c->tier_bps[KV_TIER_HOST] = KV_LOAD_COST_SEED_HOST_BPS;
    c->tier_bps[KV_TIER_DISK] = KV_LOAD_COST_SEED_DISK_BPS;
    c->prefill_tps = KV_LOAD_COST_SEED_PREFILL;
    c->step_s = KV_LOAD_COST_SEED_STEP;
}

/* "123", "1.5e9", "200M", "2G", "64k": > 0, finite; -1 otherwise */
static int parse_rate(const char *s, size_t len, double *out) {
    char buf[64];
    if (len == 0 || len >= sizeof buf) return -1;
    memcpy(buf, s, len);
    buf[len] = 0;
    char *end;
    double v = strtod(buf, &end);
    if (end == buf) return -1;
    if (*end == 'k' || *end == 'K')
        v *= 1e3, end++;
    else if (*end == 'M')
        v *= 1e6, end++;
    else if (*end == 'G')
        v *= 1e9, end++;
    if (*end || !(v > 0) || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

int kv_load_cost_configure(kv_load_cost *c, const char *policy, const char *bandwidth, char *err,
                           size_t errlen) {
    if (policy && *policy) {
        if (!strcmp(policy, "cost"))
            c->policy = KV_LOAD_POLICY_COST;
        else if (!strcmp(policy, "always"))
            c->policy = KV_LOAD_POLICY_ALWAYS;
        else {
            snprintf(err, errlen,
                     "DISAGG_KV_OFFLOAD_COPY='%s' is not accepted (cost: copy a tier's block back "
                     "when the copy is estimated faster than its prefill, the default; always: "
                     "copy every block a tier holds)",
                     policy);
            return -1;
        }
    }
    if (!bandwidth || !*bandwidth) return 0;
    double bps[KV_TIER_COUNT];
    int set[KV_TIER_COUNT] = {0};
    for (const char *p = bandwidth; *p;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        const char *eq = memchr(p, '=', len);
        int t = -1;
        for (int k = 0; eq && k < KV_TIER_COUNT; k++)
            if ((size_t)(eq - p) == strlen(tier_names[k]) && !memcmp(p, tier_names[k], eq - p))
                t = k;
        if (t < 0 || set[t] || parse_rate(eq + 1, len - (size_t)(eq + 1 - p), &bps[t])) {
            snprintf(err, errlen,
                     "DISAGG_KV_OFFLOAD_BANDWIDTH='%s' is not accepted at '%.*s' (accepted: "
                     "host=BYTES_PER_S,disk=BYTES_PER_S, either or both, once each, each a "
                     "number > 0 with an optional k, M or G suffix, e.g. disk=200M)",
                     bandwidth, (int)len, p);
            return -1;
        }
        set[t] = 1;
        p += len + (comma ? 1 : 0);
        if (comma && !*p) { /* a trailing comma */
            snprintf(err, errlen,
                     "DISAGG_KV_OFFLOAD_BANDWIDTH='%s' ends with a comma (accepted: "
                     "host=BYTES_PER_S,disk=BYTES_PER_S)",
                     bandwidth);
            return -1;
        }
    }
    for (int t = 0; t < KV_TIER_COUNT; t++)
        if (set[t]) {
            c->tier_bps[t] = bps[t];
            c->tier_fixed[t] = 1;
        }
    return 0;
}

void kv_load_cost_observe_load(kv_load_cost *c, int tier, size_t bytes, uint64_t ns) {
    if (tier < 0 || tier >= KV_TIER_COUNT || c->tier_fixed[tier] || !bytes) return;
    double bps = (double)bytes / ((double)(ns ? ns : 1) * 1e-9);
    c->tier_bps[tier] += KV_LOAD_COST_ALPHA * (bps - c->tier_bps[tier]);
}

void kv_load_cost_observe_prefill(kv_load_cost *c, uint64_t tokens, uint64_t ns) {
    if (!tokens) return;
    double tps = (double)tokens / ((double)(ns ? ns : 1) * 1e-9);
    c->prefill_tps += KV_LOAD_COST_ALPHA * (tps - c->prefill_tps);
}

void kv_load_cost_observe_step(kv_load_cost *c, uint64_t ns) {
    c->step_s += KV_LOAD_COST_ALPHA * ((double)ns * 1e-9 - c->step_s);
}

int kv_load_cost_inline(const kv_load_cost *c, const signed char *kinds, int n) {
    double t = 0;
    for (int i = 0; i < n; i++)
        if (kinds[i] != KV_LOAD_DEVICE) t += kv_load_cost_copy_s(c, kinds[i]);
    return t < KV_LOAD_COST_INLINE * c->step_s;
}

double kv_load_cost_copy_s(const kv_load_cost *c, int tier) {
    return (double)c->block_bytes / c->tier_bps[tier];
}

double kv_load_cost_recompute_s(const kv_load_cost *c) {
    return (double)c->block_size / c->prefill_tps;
}

int kv_load_cost_plan(kv_load_cost *c, const signed char *kinds, int n) {
    if (n <= 0) return 0;
    if (c->policy == KV_LOAD_POLICY_ALWAYS) return n;
    double save = kv_load_cost_recompute_s(c), sum = 0, best = 0;
    int j = 0;
    for (int i = 0; i < n; i++) {
        sum += save - (kinds[i] == KV_LOAD_DEVICE ? 0.0 : kv_load_cost_copy_s(c, kinds[i]));
        if (sum > best) best = sum, j = i + 1;
    }
    if (j == n) return n;
    /* declined: the tier of the first block left out that a tier holds (a probe re-measures
     * it now and then); every tier block left out is counted */
    int t = -1;
    for (int i = j; i < n; i++)
        if (kinds[i] != KV_LOAD_DEVICE && t < 0) t = kinds[i];
    if (t >= 0 && !c->tier_fixed[t] && ++c->declines_since_probe[t] >= KV_LOAD_COST_PROBE) {
        c->declines_since_probe[t] = 0;
        c->probes++;
        return n;
    }
    for (int i = j; i < n; i++)
        if (kinds[i] != KV_LOAD_DEVICE) c->declined[kinds[i]]++;
    return j;
}
