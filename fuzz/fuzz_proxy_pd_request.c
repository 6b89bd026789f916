/* fuzz-requires: src/proxy/pd_request.h
 *
 * fuzz_proxy_pd_request — what the proxy does with a client's JSON body and a
 * bootstrap server's /query answer (src/proxy/pd_request.c, PROTOCOL.md
 * sections 1-2).  Input byte 0: even, the rest is a client body, which is
 * parsed and rewritten into the prefill and the decode bodies; odd, the rest
 * is a /query table for pd_parse_query.  Checks: the prefill body asks for
 * one token without streaming and carries do_remote_decode; the decode body
 * carries do_remote_prefill with the engine id, bootstrap address and
 * transfer id it was given; a parsed table is sorted by dp_rank.
 */
#include "fuzz/fuzz_util.h"

#include "proxy/pd_request.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    return 0;
}

static int is_true(json_t *o, const char *k) {
    return json_is_true(json_object_get(o, k));
}

static void client_body(const char *buf, size_t len) {
    json_t *client = NULL;
    char err[256];
    err[0] = 0;
    if (pd_parse_client_body(buf, len, &client, err, sizeof err) != 0) {
        if (client || !err[0]) abort();
        return;
    }
    if (!json_is_object(client)) abort();
    const char *xfer = "xfer-00000000-0000-4000-8000-000000000000";
    json_t *pre = pd_prefill_body(client, xfer);
    json_t *dec = pd_decode_body(client, "p-0", "10.0.0.2:8998", xfer);
    if (!json_is_object(pre) || !json_is_object(dec)) abort();
    json_t *mt = json_object_get(pre, "max_tokens");
    if (json_integer_value(mt) != 1 || json_is_true(json_object_get(pre, "stream")) ||
        json_object_get(pre, "stream_options") || json_object_get(pre, "min_tokens")) {
        char *t = json_dumps(pre, 0);
        fprintf(stderr, "prefill body does not ask for one token without streaming: %s\n", t);
        abort();
    }
    if (!is_true(json_object_get(pre, "kv_transfer_params"), "do_remote_decode")) abort();
    json_t *kv = json_object_get(dec, "kv_transfer_params");
    const char *eid = json_string_value(json_object_get(kv, "remote_engine_id"));
    if (!is_true(kv, "do_remote_prefill") || !eid || strcmp(eid, "p-0")) {
        char *t = json_dumps(dec, 0);
        fprintf(stderr, "decode body lacks the remote prefill parameters: %s\n", t);
        abort();
    }
    json_decref(pre);
    json_decref(dec);
    json_decref(client);
}

static void query_table(const char *buf, size_t len) {
    pd_engine *rows = NULL;
    int n = 0;
    char err[256];
    err[0] = 0;
    int rc = pd_parse_query(buf, len, &rows, &n, err, sizeof err);
    if (rc != 0) {
        if ((rc != -EINVAL && rc != -ENOENT) || !err[0]) abort();
        return;
    }
    if (n < 1) abort();
    for (int i = 0; i < n; i++) {
        if (!rows[i].engine_id || rows[i].tp_size < 0) abort();
        if (i > 0 && rows[i - 1].dp_rank >= rows[i].dp_rank) abort();
    }
    pd_engines_free(rows, n);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (data[0] & 1)
        query_table((const char *)data + 1, size - 1);
    else
        client_body((const char *)data + 1, size - 1);
    return 0;
}
