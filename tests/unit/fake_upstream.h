/* fake_upstream — ready proxy upstreams for the policy tests (test_proxy.c, test_proxy_policy.c).
 */
#ifndef DISAGG_TESTS_FAKE_BACKEND_H
#define DISAGG_TESTS_FAKE_BACKEND_H

#include "proxy/upstream.h"

#include <stdlib.h>
#include <string.h>

/* A ready, healthy, active upstream of role at index with ranks dp ranks (0: none). */
static inline void fake(upstream *b, upstream_role role, int index, int ranks) {
    memset(b, 0, sizeof *b);
    b->role = role;
    b->index = index;
    b->ready = b->healthy = b->active = 1;
    b->nengines = ranks;
    if (ranks) {
        b->engines = calloc((size_t)ranks, sizeof *b->engines);
        for (int i = 0; i < ranks; i++)
            b->engines[i].dp_rank = i;
    }
}

#endif
