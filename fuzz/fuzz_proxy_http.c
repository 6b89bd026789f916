/* fuzz-requires: src/base/http_msg.h
 *
 * fuzz_proxy_http — the HTTP/1.1 parser of base/ (src/base/http_msg.c),
 * which reads client requests (the proxy is the front door) and upstream
 * responses: http_head_parse and the body framing (Content-Length, chunked,
 * until close).  Input byte 0: bit 0 request (1) or response (0), bit 1 the
 * response answers a HEAD request; byte 1: the size of the pieces the stream
 * arrives in (1..256); the rest is the byte stream.
 *
 * The stream is parsed twice, at once and piece by piece as a socket would
 * deliver it, and both must agree (head fields, body bytes, outcome).  An
 * accepted head must account for every line it contains (start line, one
 * header per line, blank line): a parser that silently stops early could
 * drop a Content-Length or Transfer-Encoding header.
 */
#include "fuzz/fuzz_util.h"

#include "base/http_msg.h"

#include <event2/buffer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const http_limits LIMITS = {1024, 16}; /* small, so the limits are reached */

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    return 0;
}

typedef struct outcome {
    int head_rc;          /* last http_head_parse result */
    http_head head;       /* when head_rc == 1 */
    int body_rc;          /* last http_body_read result (when head_rc == 1) */
    struct evbuffer *out; /* decoded body */
    size_t head_bytes;    /* bytes the head took (drained) */
} outcome;

/* Feed stream[0..n) in pieces of `piece` bytes (n at once when piece == 0). */
static void run(const uint8_t *s, size_t n, size_t piece, int is_request, int is_head, outcome *o) {
    struct evbuffer *in = evbuffer_new();
    memset(o, 0, sizeof *o);
    o->out = evbuffer_new();
    http_body_reader rd;
    size_t fed = 0;
    o->head_rc = 0;
    while (fed < n || piece == 0) {
        size_t k = piece == 0 ? n : (n - fed < piece ? n - fed : piece);
        evbuffer_add(in, s + fed, k);
        fed += k;
        if (o->head_rc == 0) {
            o->head_rc = http_head_parse(in, is_request, &LIMITS, &o->head);
            if (o->head_rc < 0) break;
            if (o->head_rc == 1) {
                o->head_bytes = fed - evbuffer_get_length(in);
                http_body_init(&rd, &o->head, is_head);
            }
        }
        if (o->head_rc == 1) {
            o->body_rc = http_body_read(&rd, in, o->out);
            if (o->body_rc != 0) break;
        }
        if (piece == 0) break;
    }
    evbuffer_free(in);
}

/* s[0..head_bytes) is the head as received (after leading empty lines of a
 * request): count its lines. */
static void check_lines(const uint8_t *s, size_t head_bytes, int is_request, const http_head *h) {
    size_t i = 0, lines = 0;
    while (is_request && i < head_bytes && (s[i] == '\r' || s[i] == '\n'))
        i++;
    for (; i < head_bytes; i++)
        lines += s[i] == '\n';
    if (lines != (size_t)h->nheaders + 2) {
        fprintf(stderr, "a head of %zu lines gave a start line and %d headers\n", lines,
                h->nheaders);
        abort();
    }
}

static void same(const outcome *a, const outcome *b) {
    if (a->head_rc != b->head_rc) {
        fprintf(stderr, "head: at once %d, in pieces %d\n", a->head_rc, b->head_rc);
        abort();
    }
    if (a->head_rc != 1) return;
    const http_head *x = &a->head, *y = &b->head;
    if (strcmp(x->method, y->method) || (x->target && strcmp(x->target, y->target)) ||
        x->status != y->status || x->minor != y->minor || x->nheaders != y->nheaders ||
        x->content_length != y->content_length || x->chunked != y->chunked ||
        x->keep_alive != y->keep_alive) {
        fprintf(stderr, "heads differ between at once and in pieces\n");
        abort();
    }
    size_t la = evbuffer_get_length(a->out), lb = evbuffer_get_length(b->out);
    /* a body that needs more bytes may hold fewer decoded bytes in pieces only
     * if it failed earlier; with the whole stream both saw the same bytes */
    if (a->body_rc != b->body_rc || la != lb ||
        (la && memcmp(evbuffer_pullup(a->out, -1), evbuffer_pullup(b->out, -1), la) != 0)) {
        fprintf(stderr, "bodies differ: at once rc %d %zu bytes, in pieces rc %d %zu bytes\n",
                a->body_rc, la, b->body_rc, lb);
        abort();
    }
}

static void outcome_free(outcome *o) {
    if (o->head_rc == 1) http_head_free(&o->head);
    evbuffer_free(o->out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    int is_request = data[0] & 1, is_head = (data[0] >> 1) & 1;
    size_t piece = (size_t)data[1] % 256 + 1;
    const uint8_t *s = data + 2;
    size_t n = size - 2;
    outcome a, b;
    run(s, n, 0, is_request, is_head, &a);
    run(s, n, piece, is_request, is_head, &b);
    if (a.head_rc == 1) {
        check_lines(s, a.head_bytes, is_request, &a.head);
        if (a.head.content_length < -1) abort();
        (void)http_head_get(&a.head, "content-length");
        (void)http_head_count(&a.head, "transfer-encoding");
        (void)http_reason(a.head.status);
    }
    same(&a, &b);
    outcome_free(&a);
    outcome_free(&b);
    return 0;
}
