/*
 * fuzz_bootstrap_server — bytes from the network to the Mooncake bootstrap
 * server (PROTOCOL.md §2), which listens for any host: a real
 * bootstrap_server runs in this process (its event-loop thread) and each input
 * goes to it over a loopback connection.  Input byte 0 picks the shape: even,
 * the rest is a raw HTTP request (libevent's parser and our routing); odd, the
 * rest is the body of a well-formed POST /register (our register-body
 * validation and the registry).  Checks: every answer is an HTTP status
 * line; after a successful register, the server's own GET /query table must
 * be accepted by the client's parser (bootstrap_table_parse) and list it.
 * The server is restarted every RESTART_EVERY inputs so its table stays small.
 */
#include "fuzz/fuzz_util.h"

#include "connector/mooncake/bootstrap_client.h"
#include "connector/mooncake/bootstrap_server.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RESTART_EVERY 512
#define REPLY_CAP     (1u << 16)

static bootstrap_server *g_srv;
static unsigned g_inputs;

static void server_start(void) {
    char err[256];
    if (bootstrap_server_start("127.0.0.1", 0, &g_srv, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz_bootstrap_server: %s\n", err);
        abort();
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    signal(SIGPIPE, SIG_IGN); /* bootstrap_server.h: the embedding process ignores it */
    server_start();
    return 0;
}

static void check_table(void) {
    char *json = bootstrap_server_query_json(g_srv);
    if (!json) abort();
    bootstrap_table t;
    char err[256];
    if (bootstrap_table_parse(json, strlen(json), &t, err, sizeof err) != 0) {
        fprintf(stderr, "the server's own /query table is refused by the client: %s\n%s\n", err,
                json);
        abort();
    }
    if (t.n == 0) abort(); /* something was registered */
    bootstrap_table_free(&t);
    free(json);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (++g_inputs % RESTART_EVERY == 0) {
        bootstrap_server_stop(g_srv);
        server_start();
    }
    uint16_t port = bootstrap_server_port(g_srv);
    static char reply[REPLY_CAP + 1];
    long got;
    if (data[0] & 1) {
        size_t blen = size - 1;
        char head[160];
        int hlen = snprintf(head, sizeof head,
                            "POST /register HTTP/1.1\r\nHost: fuzz\r\nContent-Type: "
                            "application/json\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
                            blen);
        char *req = malloc((size_t)hlen + blen);
        memcpy(req, head, (size_t)hlen);
        memcpy(req + hlen, data + 1, blen);
        got = fuzz_exchange(port, req, (size_t)hlen + blen, reply, REPLY_CAP, 5000);
        free(req);
    } else {
        got = fuzz_exchange(port, data + 1, size - 1, reply, REPLY_CAP, 5000);
    }
    if (got > 0) {
        reply[got < (long)REPLY_CAP ? got : (long)REPLY_CAP] = 0;
        if (got < 12 || memcmp(reply, "HTTP/", 5) != 0) { /* libevent echoes the version */
            fprintf(stderr, "answer is not an HTTP status line: %.80s\n", reply);
            abort();
        }
        if ((data[0] & 1) && memcmp(reply + 9, "200", 3) == 0) check_table();
    } else if (data[0] & 1) {
        fprintf(stderr, "no answer to a well-formed POST /register\n");
        abort();
    }
    return 0;
}
