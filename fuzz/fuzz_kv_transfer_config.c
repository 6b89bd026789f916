/*
 * fuzz_kv_transfer_config — the --kv-transfer-config JSON (user/deployment
 * input, PROTOCOL.md §4) through kv_transfer_config_parse.  Checks beyond
 * "no crash": a failed parse always explains itself, an accepted one has a
 * known role/protocol/policy and NUL-terminated strings.
 */
#include "fuzz/fuzz_util.h"

#include "connector/kv_transfer_config.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = fuzz_strndup(data, size);
    kv_transfer_config c;
    char err[512];
    err[0] = 0;
    int rc = kv_transfer_config_parse(text, &c, err, sizeof err);
    if (rc != 0) {
        if (rc != KV_CONFIG_EINVAL || !err[0]) abort(); /* every refusal names its reason */
    } else {
        if ((unsigned)c.role > KV_ROLE_BOTH || (unsigned)c.protocol > KV_PROTOCOL_SHM ||
            (unsigned)c.load_failure_policy > KV_LOAD_FAILURE_RECOMPUTE)
            abort();
        if (c.num_workers < 1 || c.num_workers > KV_CONFIG_NUM_WORKERS_MAX) abort();
        if (!memchr(c.engine_id, 0, sizeof c.engine_id) ||
            !memchr(c.device_name, 0, sizeof c.device_name) ||
            !memchr(c.bootstrap_host, 0, sizeof c.bootstrap_host))
            abort();
        (void)kv_role_name(c.role);
        (void)kv_protocol_name(kv_transfer_config_effective_protocol(&c, 0));
    }
    free(text);
    return 0;
}
