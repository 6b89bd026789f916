/*
 * fuzz_discovery — what other writers of the etcd prefix and the command line
 * hand to base/discovery: byte0 even = an instance record value (anyone who
 * can write the prefix can put one) through discovery_record_parse; odd = a
 * --discovery URL through discovery_parse_url.  Checks beyond "no crash":
 * every refusal names its reason; an accepted record has a known role, an
 * http:// URL and a sane load, and survives a JSON round trip unchanged; an
 * accepted URL has endpoints and a prefix starting with '/'.
 */
#include "fuzz/fuzz_util.h"

#include "base/discovery.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    char err[1400];
    err[0] = 0;
    if (data[0] % 2 == 0) {
        discovery_record r, back;
        int rc = discovery_record_parse((const char *)data + 1, size - 1, &r, err, sizeof err);
        if (rc) {
            if (rc != -EINVAL || !err[0]) abort();
            return 0;
        }
        if (strcmp(r.role, "prefill") && strcmp(r.role, "decode") && strcmp(r.role, "bootstrap"))
            abort();
        if (strncmp(r.url, "http://", 7) || r.running < 0 || r.waiting < 0 || !(r.kv_usage >= 0))
            abort();
        char *j = discovery_record_json(&r);
        if (!j) return 0;
        if (discovery_record_parse(j, strlen(j), &back, err, sizeof err) ||
            !discovery_record_same_instance(&r, &back) || back.running != r.running ||
            back.waiting != r.waiting || strcmp(back.engine_id, r.engine_id))
            abort();
        free(j);
        return 0;
    }
    char *text = fuzz_strndup(data + 1, size - 1);
    discovery_opts o;
    discovery_opts_default(&o);
    int rc = discovery_parse_url(text, &o, err, sizeof err);
    if (rc) {
        if (rc != -EINVAL || !err[0]) abort();
    } else if (!o.endpoints[0] || o.prefix[0] != '/') {
        abort();
    }
    free(text);
    return 0;
}
