/* policy — see policy.h. */
#include "proxy/policy.h"

#include <errno.h>
#include <string.h>

int policy_parse(const char *s, policy_kind *out) {
    if (!strcmp(s, "least_loaded"))
        *out = POLICY_LEAST_LOADED;
    else if (!strcmp(s, "round_robin"))
        *out = POLICY_ROUND_ROBIN;
    else
        return -EINVAL;
    return 0;
}

const char *policy_name(policy_kind k) {
    return k == POLICY_ROUND_ROBIN ? "round_robin" : "least_loaded";
}

static int eligible(const backend *b, uint64_t exclude) {
    return b->ready && !(exclude >> b->index & 1) && (b->role == BACKEND_DECODE || b->nengines > 0);
}

/* Slots a backend contributes to round-robin: its dp ranks (1 for decode). */
static int slots(const backend *b) {
    return b->role == BACKEND_PREFILL ? b->nengines : 1;
}

backend *policy_pick(policy_kind k, backend *list, int n, unsigned *rr, uint64_t exclude,
                     const pd_engine **engine) {
    backend *best = NULL;
    int rank_idx = 0;
    if (k == POLICY_ROUND_ROBIN) {
        int total = 0;
        for (int i = 0; i < n; i++)
            if (eligible(&list[i], exclude)) total += slots(&list[i]);
        if (total == 0) return NULL;
        int pick = (int)(*rr % (unsigned)total);
        (*rr)++;
        for (int i = 0; i < n && !best; i++) {
            if (!eligible(&list[i], exclude)) continue;
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
            backend *b = &list[(start + (unsigned)j) % (unsigned)n];
            if (eligible(b, exclude) && (!best || b->outstanding < best->outstanding)) best = b;
        }
        if (!best) return NULL;
        if (best->role == BACKEND_PREFILL)
            rank_idx = (int)(best->rank_rr++ % (unsigned)best->nengines);
    }
    if (engine) *engine = best->role == BACKEND_PREFILL ? &best->engines[rank_idx] : NULL;
    return best;
}
