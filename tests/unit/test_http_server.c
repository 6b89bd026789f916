/* test_http_server — base/http_server over real loopback sockets: the
 * deadline modes the server and the bootstrap server use (head deadline from
 * accept with or without a 408 for a silent connection, from the previous
 * reply, a body deadline from the head's end) and their on_deadline counts,
 * headers added to a reply (and refused with CR/LF), an empty protocol error
 * body, and the lingering close that lets a client still sending an
 * over-limit body read its 413. */
#include "base/clock.h"
#include "base/http_server.h"
#include "base/net.h"

#include <errno.h>
#include <event2/event.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

typedef struct fixture {
    struct event_base *base;
    hs_server *srv;
    struct event *stop_ev;
    int stop_pipe[2]; /* written by stop(): the loop thread breaks */
    pthread_t thread;
    int counts[3];     /* on_deadline calls by hs_deadline_kind (loop thread; read after join) */
    int add_header_rc; /* hs_req_add_header with a CR in the value */
} fixture;

static void on_deadline(void *arg, hs_deadline_kind kind) {
    fixture *f = arg;
    f->counts[kind]++;
}

static void handler(hs_req *r, void *arg) {
    fixture *f = arg;
    f->add_header_rc = hs_req_add_header(r, "X-Bad", "a\r\nInjected: 1");
    hs_req_add_header(r, "X-Test", "yes");
    hs_reply(r, 200, "text/plain", NULL, "ok", 2);
}

static void on_stop(evutil_socket_t fd, short what, void *arg) {
    event_base_loopbreak(arg);
}

static void *loop_main(void *arg) {
    fixture *f = arg;
    event_base_dispatch(f->base);
    return NULL;
}

static uint16_t start(fixture *f, const hs_config *cfg, hs_error_body_fn eb) {
    memset(f, 0, sizeof *f);
    f->base = event_base_new();
    assert_non_null(f->base);
    hs_config c = *cfg;
    c.on_deadline = on_deadline;
    c.on_deadline_arg = f;
    f->srv = hs_server_new(f->base, "127.0.0.1", 0, &c, handler, f, eb);
    assert_non_null(f->srv);
    assert_int_equal(pipe(f->stop_pipe), 0);
    f->stop_ev = event_new(f->base, f->stop_pipe[0], EV_READ, on_stop, f->base);
    event_add(f->stop_ev, NULL);
    assert_int_equal(pthread_create(&f->thread, NULL, loop_main, f), 0);
    return hs_server_port(f->srv);
}

static void stop(fixture *f) {
    assert_int_equal(write(f->stop_pipe[1], "x", 1), 1);
    pthread_join(f->thread, NULL);
    close(f->stop_pipe[0]);
    close(f->stop_pipe[1]);
    hs_server_free(f->srv);
    event_free(f->stop_ev);
    event_base_free(f->base);
}

static int dial(uint16_t port) {
    net_addr a;
    assert_int_equal(net_resolve("127.0.0.1", port, &a), 0);
    int fd = net_connect(&a, NULL, clock_now_ns() + NS_PER_S);
    assert_true(fd >= 0);
    return fd;
}

static void send_str(int fd, const char *s) {
    assert_int_equal(net_send_all(fd, s, strlen(s), clock_now_ns() + 5 * NS_PER_S), 0);
}

/* Reads until EOF (or limit_s); returns the bytes read (NUL-terminated) and
 * the seconds it took in *took. */
static size_t read_all(int fd, char *buf, size_t cap, double limit_s, double *took) {
    uint64_t t0 = clock_now_ns(), end = t0 + (uint64_t)(limit_s * 1e9);
    size_t got = 0;
    for (;;) {
        uint64_t now = clock_now_ns();
        if (now >= end) break;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, (int)((end - now) / 1000000) + 1) <= 0) continue;
        ssize_t n = read(fd, buf + got, cap - 1 - got);
        if (n <= 0) break;
        got += (size_t)n;
        if (got + 1 >= cap) break;
    }
    buf[got] = 0;
    if (took) *took = (double)(clock_now_ns() - t0) / 1e9;
    return got;
}

static void test_headers_and_head_from_reply(void **state) {
    (void)state;
    fixture f;
    hs_config c;
    hs_config_default(&c);
    c.header_timeout_s = 0.5;
    c.head_from_accept = c.head_from_reply = 1; /* the bootstrap server's mode */
    uint16_t port = start(&f, &c, NULL);
    int fd = dial(port);
    send_str(fd, "GET /x HTTP/1.1\r\nHost: a\r\n\r\n");
    char buf[4096];
    double took;
    read_all(fd, buf, sizeof buf, 5.0, &took); /* the reply, then EOF at the next deadline */
    assert_non_null(strstr(buf, "HTTP/1.1 200 OK\r\n"));
    assert_non_null(strstr(buf, "\r\nX-Test: yes\r\n"));
    assert_null(strstr(buf, "Injected"));
    assert_null(strstr(buf, "408")); /* nothing asked after the reply: closed silently */
    assert_true(took < 4.0);
    close(fd);
    stop(&f);
    assert_int_equal(f.add_header_rc, -EINVAL);
    assert_int_equal(f.counts[HS_DEADLINE_IDLE], 1);
}

static void test_head_from_accept_408_and_body_deadline(void **state) {
    (void)state;
    fixture f;
    hs_config c;
    hs_config_default(&c);
    c.header_timeout_s = 0.4;
    c.request_timeout_s = 0;
    c.body_timeout_s = 0.4;
    c.head_from_accept = 1;
    c.idle_408 = 1; /* the server's mode: a silent new connection gets 408 */
    uint16_t port = start(&f, &c, NULL);
    char buf[4096];
    int fd = dial(port);
    read_all(fd, buf, sizeof buf, 5.0, NULL);
    assert_true(strncmp(buf, "HTTP/1.1 408 ", 13) == 0);
    assert_non_null(strstr(buf, "Content-Length: 0\r\n")); /* no error body callback: empty */
    assert_null(strstr(buf, "Content-Type"));
    close(fd);
    /* head in, body never completes: 408 at the body deadline although bytes keep coming */
    fd = dial(port);
    send_str(fd, "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{");
    uint64_t t0 = clock_now_ns();
    size_t got = 0;
    while (clock_now_ns() - t0 < 5 * NS_PER_S) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 100) > 0) {
            ssize_t n = read(fd, buf + got, sizeof buf - 1 - got);
            if (n <= 0) break;
            got += (size_t)n;
        } else if (send(fd, " ", 1, MSG_NOSIGNAL) != 1) {
            break;
        }
    }
    buf[got] = 0;
    assert_true(strncmp(buf, "HTTP/1.1 408 ", 13) == 0);
    close(fd);
    stop(&f);
    assert_int_equal(f.counts[HS_DEADLINE_HEADER], 1);
    assert_int_equal(f.counts[HS_DEADLINE_BODY], 1);
}

static char *json_error_body(int status, const char *message) {
    char *b = malloc(256);
    if (b) snprintf(b, 256, "{\"status\":%d,\"message\":\"%s\"}", status, message);
    return b;
}

static void test_linger_after_413(void **state) {
    (void)state;
    fixture f;
    hs_config c;
    hs_config_default(&c);
    c.max_body_bytes = 1024;
    uint16_t port = start(&f, &c, json_error_body);
    int fd = dial(port);
    size_t n = (size_t)4 << 20; /* far more than the socket buffers hold */
    char *big = malloc(n + 128);
    assert_non_null(big);
    int h = snprintf(big, 128, "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: %zu\r\n\r\n", n);
    memset(big + h, 'a', n);
    /* the whole body goes out although the server answered after the head */
    assert_int_equal(net_send_all(fd, big, (size_t)h + n, clock_now_ns() + 10 * NS_PER_S), 0);
    free(big);
    shutdown(fd, SHUT_WR);
    char buf[4096];
    read_all(fd, buf, sizeof buf, 5.0, NULL);
    assert_true(strncmp(buf, "HTTP/1.1 413 ", 13) == 0);
    assert_non_null(strstr(buf, "Content-Type: application/json\r\n"));
    assert_non_null(strstr(buf, "{\"status\":413,"));
    close(fd);
    /* still serving */
    fd = dial(port);
    send_str(fd, "GET /y HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    read_all(fd, buf, sizeof buf, 5.0, NULL);
    assert_true(strncmp(buf, "HTTP/1.1 200 ", 13) == 0);
    close(fd);
    stop(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_headers_and_head_from_reply),
        cmocka_unit_test(test_head_from_accept_408_and_body_deadline),
        cmocka_unit_test(test_linger_after_413),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
