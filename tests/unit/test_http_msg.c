/* test_http_msg — base/http_msg, the HTTP/1.1 parser every server of the
 * project uses (disagg serve, the proxy, the bootstrap server): request and
 * status heads and body framing against RFC 9112 byte streams (fed byte by
 * byte too), malformed inputs and limits.  (Moved from test_proxy.c.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/http_msg.h"

#include <errno.h>
#include <event2/buffer.h>
#include <stdlib.h>
#include <string.h>

static const http_limits LIM = {1024, 8};

static int parse_str(const char *s, int is_request, http_head *h, struct evbuffer **rest) {
    struct evbuffer *in = evbuffer_new();
    evbuffer_add(in, s, strlen(s));
    int rc = http_head_parse(in, is_request, &LIM, h);
    if (rest)
        *rest = in;
    else
        evbuffer_free(in);
    return rc;
}

static void test_request_head(void **state) {
    (void)state;
    http_head h;
    struct evbuffer *rest;
    assert_int_equal(
        parse_str("POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length:  12 \r\n"
                  "Connection: close\r\n\r\n{\"a\":1}",
                  1, &h, &rest),
        1);
    assert_string_equal(h.method, "POST");
    assert_string_equal(h.target, "/v1/completions?x=1");
    assert_int_equal(h.minor, 1);
    assert_int_equal(h.nheaders, 3);
    assert_string_equal(http_head_get(&h, "content-length"), "12");
    assert_int_equal(h.content_length, 12);
    assert_int_equal(h.keep_alive, 0);
    assert_int_equal(evbuffer_get_length(rest), 7); /* body left in the buffer */
    http_head_free(&h);
    evbuffer_free(rest);

    /* incomplete, then HTTP/1.0 default close, bare LF line ends */
    assert_int_equal(parse_str("GET / HTTP/1.1\r\nHost: a\r\n", 1, &h, NULL), 0);
    assert_int_equal(parse_str("GET / HTTP/1.0\nHost: a\n\n", 1, &h, NULL), 1);
    assert_int_equal(h.keep_alive, 0);
    assert_int_equal(h.content_length, -1);
    http_head_free(&h);

    /* malformed */
    const char *bad[] = {"NONSENSE\r\n\r\n",
                         "GET /\r\n\r\n",
                         "GET / HTTP/2.0\r\n\r\n",
                         "get / HTTP/1.1\r\n\r\n",
                         "GET / HTTP/1.1\r\nNoColon\r\n\r\n",
                         "GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
                         "GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n",
                         "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                         "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                         "POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(parse_str(bad[i], 1, &h, NULL), HTTP_EBAD_MESSAGE);

    /* limits: 9 headers > 8; head over 1024 bytes */
    char many[512] = "GET / HTTP/1.1\r\n";
    for (int i = 0; i < 9; i++)
        strcat(many, "X-A: b\r\n");
    strcat(many, "\r\n");
    assert_int_equal(parse_str(many, 1, &h, NULL), HTTP_ETOO_MANY_HEADERS);
    char *big = malloc(2000);
    strcpy(big, "GET / HTTP/1.1\r\nX: ");
    memset(big + strlen(big), 'a', 1500);
    big[19 + 1500] = 0;
    assert_int_equal(parse_str(big, 1, &h, NULL), HTTP_EHEAD_TOO_LARGE);
    free(big);
}

static void test_status_head(void **state) {
    (void)state;
    http_head h;
    assert_int_equal(parse_str("HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n"
                               "Content-Length: 5\r\n\r\n",
                               0, &h, NULL),
                     1);
    assert_int_equal(h.status, 503);
    assert_int_equal(h.chunked, 1);
    assert_int_equal(h.content_length, -1); /* Transfer-Encoding wins */
    http_head_free(&h);
    assert_int_equal(parse_str("HTTP/1.1 200\r\n\r\n", 0, &h, NULL), 1);
    assert_int_equal(h.status, 200);
    http_head_free(&h);
    assert_int_equal(parse_str("HTTP/1.1 2x0 OK\r\n\r\n", 0, &h, NULL), HTTP_EBAD_MESSAGE);
}

/* Feeds `wire` one byte at a time and returns the decoded body. */
static char *decode_body(const char *head, const char *wire, int *rc_out) {
    http_head h;
    assert_int_equal(parse_str(head, 0, &h, NULL), 1);
    http_body_reader r;
    http_body_init(&r, &h, 0);
    struct evbuffer *in = evbuffer_new(), *out = evbuffer_new();
    int rc = 0;
    for (size_t i = 0; wire[i] && rc == 0; i++) {
        evbuffer_add(in, wire + i, 1);
        rc = http_body_read(&r, in, out);
    }
    *rc_out = rc;
    size_t n = evbuffer_get_length(out);
    char *s = calloc(1, n + 1);
    evbuffer_remove(out, s, n);
    evbuffer_free(in);
    evbuffer_free(out);
    http_head_free(&h);
    return s;
}

static void test_body_framing(void **state) {
    (void)state;
    int rc;
    /* RFC 9112 7.1 chunked coding with an extension and a trailer */
    char *s = decode_body("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                          "5;name=v\r\nhello\r\n7\r\n, world\r\n0\r\nX-T: 1\r\n\r\n", &rc);
    assert_int_equal(rc, 1);
    assert_string_equal(s, "hello, world");
    free(s);
    s = decode_body("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "5\r\nhelloXX", &rc);
    assert_int_equal(rc, HTTP_EBAD_MESSAGE);
    free(s);
    s = decode_body("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "zz\r\n", &rc);
    assert_int_equal(rc, HTTP_EBAD_MESSAGE);
    free(s);
    s = decode_body("HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", "abcdEXTRA", &rc);
    assert_int_equal(rc, 1);
    assert_string_equal(s, "abcd");
    free(s);
    s = decode_body("HTTP/1.1 200 OK\r\n\r\n", "until close", &rc);
    assert_int_equal(rc, 0); /* ends only at EOF */
    assert_string_equal(s, "until close");
    free(s);
    http_head h;
    http_body_reader r;
    assert_int_equal(parse_str("HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n", 0, &h, NULL),
                     1);
    http_body_init(&r, &h, 0);
    assert_int_equal(r.mode, HTTP_BODY_NONE);
    http_head_free(&h);
}

static void test_error_types(void **state) {
    (void)state;
    assert_string_equal(http_error_type(400), "BadRequestError");
    assert_string_equal(http_error_type(404), "NotFoundError");
    assert_string_equal(http_error_type(413), "RequestEntityTooLargeError");
    assert_string_equal(http_error_type(422), "BadRequestError");
    assert_string_equal(http_error_type(500), "InternalServerError");
    assert_string_equal(http_error_type(502), "BadGatewayError");
    assert_string_equal(http_error_type(503), "ServiceUnavailableError");
    assert_string_equal(http_error_type(504), "GatewayTimeoutError");
    assert_string_equal(http_error_type(599), "InternalServerError");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_request_head),
        cmocka_unit_test(test_status_head),
        cmocka_unit_test(test_body_framing),
        cmocka_unit_test(test_error_types),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
