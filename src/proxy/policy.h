/*
 * policy — which backend (and for a prefill, which dp rank) serves the next
 * request: round_robin cycles over prefill instances × dp ranks (and over
 * decode instances); least_loaded (the default) takes the ready backend with
 * the fewest outstanding requests, ties broken round-robin, and cycles the
 * dp ranks of the chosen prefill.  Only backends that are ready and not in
 * the exclusion mask (tried already for this request) are chosen.
 */
#ifndef DISAGG_PROXY_POLICY_H
#define DISAGG_PROXY_POLICY_H

#include "proxy/backend.h"

#include <stdint.h>

typedef enum policy_kind { POLICY_LEAST_LOADED = 0, POLICY_ROUND_ROBIN = 1 } policy_kind;

#define POLICY_MAX_BACKENDS 64 /* per role: the exclusion mask is 64 bits */

/* "round_robin" | "least_loaded"; -EINVAL otherwise. */
int policy_parse(const char *s, policy_kind *out);
const char *policy_name(policy_kind k);

/* Picks one of list[0..n) or NULL when none is eligible.  *rr is the role's
 * round-robin cursor.  For prefill backends *engine (if not NULL) is set to
 * the chosen dp rank's entry. */
backend *policy_pick(policy_kind k, backend *list, int n, unsigned *rr, uint64_t exclude,
                     const pd_engine **engine);

#endif
