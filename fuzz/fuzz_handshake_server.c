/*
 * fuzz_handshake_server — bytes from the network to a transfer engine's RPC
 * (handshake) port: a real handshake_server runs in this process and each
 * input is sent to it over a loopback connection, then half-closed.  Checks:
 * whatever the input, the answer is empty (connection closed) or exactly one
 * well-formed frame `u64 len | u8 type | JSON object` of len bytes; for a
 * metadata request carrying a JSON object the answer is our descriptor, which
 * segment_desc_decode must accept.
 */
#include "fuzz/fuzz_util.h"

#include "base/net.h"
#include "transfer/handshake.h"
#include "transfer/segment_desc.h"

#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REPLY_CAP 65536

static handshake_server *g_srv;
static uint16_t g_port;
/* The same descriptor behind a server with a shared secret: no input may get it. */
static handshake_server *g_srv_auth;
static uint16_t g_port_auth;
static char *g_desc; /* our descriptor's JSON */

static char *describe(void *ctx) {
    return strdup(g_desc);
}
static void bound(void *ctx, uint16_t port) {
    g_port = port;
}
static void bound_auth(void *ctx, uint16_t port) {
    g_port_auth = port;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    signal(SIGPIPE, SIG_IGN);
    segment_desc d;
    segment_desc_init(&d);
    snprintf(d.name, sizeof d.name, "127.0.0.1:12345");
    snprintf(d.protocol, sizeof d.protocol, "tcp");
    d.tcp_data_port = 12346;
    d.tcp_proto_version = SEGMENT_TCP_PROTO_VERSION;
    registry_add(&d.buffers, 0x7f0000001000ull, 1u << 20, "cpu:0");
    g_desc = segment_desc_encode(&d);
    segment_desc_free(&d);
    net_addr a;
    handshake_server_cfg cfg = {.describe = describe, .bound = bound, .self_name = "127.0.0.1:0"};
    if (!g_desc || net_resolve("127.0.0.1", 0, &a) != 0 ||
        handshake_server_start(&a, &cfg, &g_srv) != 0 || g_port == 0) {
        fprintf(stderr, "fuzz_handshake_server: cannot start the server\n");
        abort();
    }
    handshake_server_cfg acfg = {
        .describe = describe, .bound = bound_auth, .self_name = "127.0.0.1:0", .secret = "fz"};
    if (handshake_server_start(&a, &acfg, &g_srv_auth) != 0 || g_port_auth == 0) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char reply[REPLY_CAP + 1];
    long got = fuzz_exchange(g_port_auth, data, size, reply, REPLY_CAP, 5000);
    if (got > 0) {
        reply[got] = 0;
        if (memmem(reply, (size_t)got, "\"buffers\"", 9)) {
            fprintf(stderr, "the authenticated server gave its descriptor away\n");
            abort();
        }
    }
    got = fuzz_exchange(g_port, data, size, reply, REPLY_CAP, 5000);
    if (got == 0) return 0;
    uint64_t len;
    uint8_t type;
    /* One frame in Mooncake's framing: typed (the length counts the type
     * byte) or, answering an untyped request, untyped. */
    if (got < HANDSHAKE_HEADER_LEN ||
        handshake_header_decode((const uint8_t *)reply, &len, &type) != 0 ||
        len != (uint64_t)got - (type == HANDSHAKE_TYPE_OLD ? 8 : HANDSHAKE_HEADER_LEN)) {
        fprintf(stderr, "answer is not one frame (%ld bytes)\n", got);
        abort();
    }
    const char *body = reply + (type == HANDSHAKE_TYPE_OLD ? 8 : HANDSHAKE_HEADER_LEN);
    json_error_t je;
    json_t *o = json_loadb(body, len, 0, &je);
    if (!json_is_object(o)) {
        fprintf(stderr, "answer body is not a JSON object: %s\n", je.text);
        abort();
    }
    if (size >= HANDSHAKE_HEADER_LEN && data[8] == HANDSHAKE_TYPE_METADATA &&
        !json_object_get(o, "error")) {
        segment_desc d;
        char err[256];
        segment_desc_init(&d);
        if (segment_desc_decode(body, len, &d, err, sizeof err) != 0) {
            fprintf(stderr, "our own descriptor is refused: %s\n", err);
            abort();
        }
        segment_desc_free(&d);
    }
    json_decref(o);
    return 0;
}
