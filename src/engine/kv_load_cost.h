/*
 * kv_load_cost — copy or recompute: whether a prefix block that an offload tier holds
 * (engine/kv_offload.h) comes back by copy or is recomputed.  A copy costs
 *   block_bytes / the tier's bandwidth        (bytes/s, measured from the loads done)
 * and saves the prefill of the block's tokens,
 *   block_size / the engine's prefill rate    (tokens/s, measured from the forwards).
 * Both are exponentially averaged (weight KV_LOAD_COST_ALPHA per observation) from
 * seeds that favour the copy (KV_LOAD_COST_SEED_*), so the first requests copy and the
 * measurements decide from then on.  For a prefix whose first n blocks some cache holds
 * (the device cache for free, a tier at its copy cost), kv_load_cost_plan takes the j
 * blocks that maximise the time saved, sum over i < j of (recompute - copy_i): with
 * linear costs that is "every block of a tier whose copy is faster than its prefill,
 * up to the first one that is not" unless device blocks after it pay for it.
 *
 * A tier judged too slow is no longer loaded from, so its bandwidth would never be
 * measured again: every KV_LOAD_COST_PROBE-th declined prefix of a tier is copied anyway
 * (a probe) to measure it afresh.  Switches (docs/configuration.md): policy "always" copies
 * every tier hit (tests); a fixed bandwidth per tier replaces the measurement (and turns
 * the probes off): "disk=1" makes every disk copy cost more than its prefill.
 *
 * Where a copy runs: copies estimated under a tenth of a forward are made inline on the step
 * thread (kv_load_cost_inline), the others on the tiers' loader thread while the batch steps.
 *
 * Not thread-safe: the engine's step thread owns it.
 */
#ifndef DISAGG_ENGINE_KV_LOAD_COST_H
#define DISAGG_ENGINE_KV_LOAD_COST_H

#include "engine/kv_offload.h"

#include <stddef.h>
#include <stdint.h>

#define KV_LOAD_COST_ALPHA        0.1   /* EWMA weight of one observation */
#define KV_LOAD_COST_SEED_HOST_BPS 10e9 /* host tier: a memcpy / pinned PCIe copy */
#define KV_LOAD_COST_SEED_DISK_BPS 2e9  /* disk tier: an NVMe read */
#define KV_LOAD_COST_SEED_PREFILL  1e4  /* tokens/s */
#define KV_LOAD_COST_PROBE        64    /* every 64th declined prefix of a tier is copied */
#define KV_LOAD_COST_SEED_STEP    0.02  /* seconds a forward takes, until measured */
#define KV_LOAD_COST_INLINE       0.1   /* copies under this fraction of a step: inline */

enum { KV_LOAD_DEVICE = -1 }; /* a block kind: in the device cache (no copy) */
enum { KV_LOAD_POLICY_COST = 0, KV_LOAD_POLICY_ALWAYS = 1 };

typedef struct kv_load_cost {
    size_t block_bytes;               /* one KV block */
    int block_size;                   /* tokens per block */
    int policy;                       /* KV_LOAD_POLICY_* */
    double tier_bps[KV_TIER_COUNT];   /* bytes/s of a tier's copies (EWMA, or fixed) */
    int tier_fixed[KV_TIER_COUNT];    /* 1: tier_bps is set, not measured */
    double prefill_tps;               /* tokens/s of the prefill (EWMA) */
    double step_s;                    /* seconds a forward takes (EWMA) */
    uint64_t declined[KV_TIER_COUNT]; /* blocks a tier held that were recomputed instead */
    uint64_t probes;                  /* declined prefixes copied anyway to re-measure */
    uint64_t declines_since_probe[KV_TIER_COUNT];
} kv_load_cost;

void kv_load_cost_init(kv_load_cost *c, size_t block_bytes, int block_size);

/* The switches, as the environment gives them (NULL or "" = the default):
 *   policy     "cost" (the default) or "always"
 *   bandwidth  "host=BYTES_PER_S,disk=BYTES_PER_S" (either or both, each > 0, a number
 *              with an optional k, M or G suffix: powers of 1000)
 * -1 with err naming what was wrong and what is accepted. */
int kv_load_cost_configure(kv_load_cost *c, const char *policy, const char *bandwidth, char *err,
                           size_t errlen);

/* A copy of `bytes` from tier t took ns (on the loader: read, checks, upload). */
void kv_load_cost_observe_load(kv_load_cost *c, int tier, size_t bytes, uint64_t ns);
/* A forward computed `tokens` prompt (and decode) tokens in ns. */
void kv_load_cost_observe_prefill(kv_load_cost *c, uint64_t tokens, uint64_t ns);

/* A forward (of any tokens) took ns. */
void kv_load_cost_observe_step(kv_load_cost *c, uint64_t ns);

/* Estimated seconds to copy one block from tier t, and to recompute one block. */
double kv_load_cost_copy_s(const kv_load_cost *c, int tier);
double kv_load_cost_recompute_s(const kv_load_cost *c);

/* kinds[i] (i < n): KV_LOAD_DEVICE or the tier (KV_TIER_*) holding block i of a prefix, for
 * the n blocks from block 0 on that some cache holds.  Returns how many of them to take
 * (0..n): the best prefix by the time it saves, or n under the "always" policy or for a
 * probe.  Counts the tier blocks left out in declined[]. */
int kv_load_cost_plan(kv_load_cost *c, const signed char *kinds, int n);

/* Whether the copies of the tier blocks among kinds[0, n) are best made inline, on the
 * step thread: their estimated time is under KV_LOAD_COST_INLINE of a forward, so the
 * batch hardly waits, while a copy in the background costs the request a step (it is
 * admitted at the step after the copies end). */
int kv_load_cost_inline(const kv_load_cost *c, const signed char *kinds, int n);

#endif
