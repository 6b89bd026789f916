/*
 * fuzz_server_http — bytes from any client to `disagg serve`: a real server
 * (server_run: base/http_server, routing, OpenAI handlers, the engine with the
 * repository's tiny model) runs on a thread of this process and each input
 * goes to it over a loopback connection.  max_model_len is 64 so that no
 * request can ask for long generations.  Input byte 0: even, the rest is a
 * raw HTTP request (half-closed after sending); odd, byte 1 picks the route
 * (completions, chat, tokenize, detokenize) and the rest is the POST body of
 * a well-formed request (not half-closed: the server takes a client's EOF
 * for its leaving and aborts the request, as nginx and uvicorn do).  Checks: every answer is an
 * HTTP status line, and a body — however hostile — never gets a 500 (an internal error) from the
 * JSON routes.
 */
#include "fuzz/fuzz_util.h"

#include "server/server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define TINY_MODEL DISAGG_SOURCE_DIR "/models/disagg-sotu-tiny"
#define REPLY_CAP  (1u << 20)

static server_config g_cfg;
static uint16_t g_port;

static const char *const ROUTES[] = {"/v1/completions", "/v1/chat/completions", "/tokenize",
                                     "/detokenize"};

static void *server_main(void *arg) {
    int rc = server_run(&g_cfg);
    fprintf(stderr, "fuzz_server_http: server_run returned %d\n", rc);
    abort(); /* it serves until the process ends */
}

static uint16_t free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof sa;
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) ||
        getsockname(fd, (struct sockaddr *)&sa, &sl))
        abort();
    close(fd);
    return ntohs(sa.sin_port);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    server_config_init(&g_cfg);
    g_port = free_port();
    g_cfg.host = "127.0.0.1";
    g_cfg.port = g_port;
    g_cfg.model = TINY_MODEL;
    g_cfg.engine.model = TINY_MODEL;
    g_cfg.served_model_name = "tiny";
    g_cfg.log_requests = 0;
    g_cfg.max_body_bytes = 1 << 20;
    g_cfg.engine.max_model_len = 64;
    g_cfg.engine.kv_cache_bytes = 16u << 20;
    g_cfg.engine.max_num_seqs = 8;
    g_cfg.engine.threads = 1;
    pthread_t t;
    if (pthread_create(&t, NULL, server_main, NULL) != 0) abort();
    static const char health[] = "GET /health HTTP/1.1\r\nHost: f\r\nConnection: close\r\n\r\n";
    char reply[256];
    for (int i = 0; i < 1200; i++) { /* up to 120 s for the model to load */
        usleep(100 * 1000);
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(g_port)};
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int up = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
        close(fd);
        if (!up) continue;
        long got = fuzz_exchange(g_port, health, sizeof health - 1, reply, sizeof reply - 1, 5000);
        if (got > 12 && memcmp(reply + 9, "200", 3) == 0) return 0;
    }
    fprintf(stderr, "fuzz_server_http: the server did not become healthy\n");
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    static char reply[REPLY_CAP + 1];
    long got;
    int json_route = data[0] & 1;
    if (json_route) {
        const char *route = ROUTES[data[1] % (sizeof ROUTES / sizeof ROUTES[0])];
        size_t blen = size - 2;
        char head[256];
        int hlen = snprintf(head, sizeof head,
                            "POST %s HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n"
                            "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                            route, blen);
        char *req = malloc((size_t)hlen + blen);
        memcpy(req, head, (size_t)hlen);
        memcpy(req + hlen, data + 2, blen);
        /* complete (Content-Length): no half-close, which would read as the client leaving */
        got = fuzz_exchange_open(g_port, req, (size_t)hlen + blen, reply, REPLY_CAP, 20000);
        free(req);
    } else {
        got = fuzz_exchange(g_port, data + 1, size - 1, reply, REPLY_CAP, 20000);
    }
    if (got <= 0) {
        if (json_route) {
            fprintf(stderr, "no answer to a well-formed POST\n");
            abort();
        }
        return 0;
    }
    reply[got < (long)REPLY_CAP ? got : (long)REPLY_CAP] = 0;
    if (got < 12 || memcmp(reply, "HTTP/", 5) != 0) {
        fprintf(stderr, "answer is not an HTTP status line: %.80s\n", reply);
        abort();
    }
    if (json_route && reply[9] == '5' && memcmp(reply + 9, "503", 3) != 0) {
        fprintf(stderr, "internal error for a client body:\n%.2000s\n", reply);
        abort();
    }
    return 0;
}
