/*
 * fuzz_bootstrap_table — the GET /query answer of a bootstrap server (any
 * host on the network can answer) through bootstrap_table_parse, which a
 * decode instance and the proxy use to find prefill workers.  An accepted
 * table must be sorted by dp_rank with tp/pp sizes >= 0 (0 when a rank lists no worker), and every
 * lookup the connector does on it must stay in bounds.
 */
#include "fuzz/fuzz_util.h"

#include "connector/mooncake/bootstrap_client.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    bootstrap_table t;
    char err[256];
    err[0] = 0;
    int rc = bootstrap_table_parse((const char *)data, size, &t, err, sizeof err);
    if (rc != 0) {
        if (!err[0]) abort();
        return 0;
    }
    for (size_t i = 0; i < t.n; i++) {
        const bootstrap_engine *e = &t.engines[i];
        if (i > 0 && t.engines[i - 1].dp_rank >= e->dp_rank) abort();
        if (e->tp_size < 0 || e->pp_size < 0 || !e->engine_id) abort(); /* 0: none registered */
        if (bootstrap_table_find(&t, e->dp_rank) != e) abort();
        int tp_end = e->tp_size < 64 ? e->tp_size : 64; /* ranks go to 4096: sample */
        int pp_end = e->pp_size < 64 ? e->pp_size : 64;
        for (int tp = -1; tp <= tp_end; tp++)
            for (int pp = -1; pp <= pp_end; pp++) {
                const char *a = bootstrap_engine_addr(e, tp, pp);
                if (a) (void)strlen(a);
                if (a && (tp < 0 || pp < 0 || tp >= e->tp_size || pp >= e->pp_size)) abort();
            }
    }
    (void)bootstrap_table_find(&t, -1);
    bootstrap_table_free(&t);
    return 0;
}
