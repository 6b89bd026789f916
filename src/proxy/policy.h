/*
 * policy — which upstream (and for a prefill, which dp rank) serves the next
 * request: round_robin cycles over prefill instances × dp ranks (and over
 * decode instances); least_loaded (the default) takes the ready upstream with
 * the least load, ties broken round-robin, and cycles the dp ranks of the
 * chosen prefill; prefix (for prefills; decodes are least_loaded) sends
 * requests whose prompts share their first bytes to the same prefill — the
 * one with the highest rendezvous hash of (prefix, URL), which every proxy
 * computes alike — unless its load exceeds the least loaded one's by more
 * than POLICY_PREFIX_SLACK requests plus a quarter, then least_loaded; p2c
 * (power of two choices) takes the less loaded of two ready instances drawn
 * at random, which keeps several proxies that see the same stale published
 * load from all sending to the one instance that looks least loaded.
 *
 * Load is the larger of the requests this proxy has outstanding on the
 * upstream and the running + waiting requests the instance published in
 * etcd (--discovery: that count includes other proxies' requests), plus its
 * published KV usage (0..1) as a tie-breaker.  Only upstreams that are ready,
 * not in the exclusion mask (tried already for this request) and, when the
 * hint names a group, of that group (model and KV layout; "" = any) are
 * chosen.
 */
#ifndef DISAGG_PROXY_POLICY_H
#define DISAGG_PROXY_POLICY_H

#include "proxy/upstream.h"

#include <stdint.h>

typedef enum policy_kind {
    POLICY_LEAST_LOADED = 0,
    POLICY_ROUND_ROBIN = 1,
    POLICY_PREFIX = 2,
    POLICY_P2C = 3,
    POLICY_KV_AWARE = 4 /* prefills by their KV caches (kv_route.c); here: least_loaded */
} policy_kind;

#define POLICY_MAX_BACKENDS 64  /* per role: the exclusion mask is 64 bits */
#define POLICY_PREFIX_SLACK 2   /* prefix: extra requests tolerated on the preferred prefill */
#define POLICY_PREFIX_BYTES 256 /* prefix: prompt bytes hashed (default) */

typedef struct policy_hint {
    uint64_t prefix_hash; /* POLICY_PREFIX: hash of the prompt's first bytes (0 = none) */
    const char *group;    /* only upstreams of this group ("" or NULL = any) */
} policy_hint;

/* "round_robin" | "least_loaded" | "prefix" | "p2c" | "kv_aware"; -EINVAL otherwise. */
int policy_parse(const char *s, policy_kind *out);
const char *policy_name(policy_kind k);

/* Picks one of list[0..n) or NULL when none is eligible.  *rr is the role's
 * round-robin cursor.  For prefill upstreams *engine (if not NULL) is set to
 * the chosen dp rank's entry. */
upstream *policy_pick(policy_kind k, upstream *list, int n, unsigned *rr, uint64_t exclude,
                      const policy_hint *hint, const pd_engine **engine);
/* 1 when b may be chosen: ready, not excluded, of the hint's group. */
int policy_eligible(const upstream *b, uint64_t exclude, const policy_hint *hint);
/* The load policy_pick compares (see above). */
double policy_load(const upstream *b);
/* FNV-1a over n bytes (the prefix hash; never 0). */
uint64_t policy_hash(const void *p, size_t n);

#endif
