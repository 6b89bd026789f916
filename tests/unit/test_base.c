/* test_base — base/rng (fixed sequences), base/uuid (format, uniqueness, a
 * new seed after fork) and base/err (formatting, truncation, NULL buffers). */
#include "base/acceptor.h"
#include "base/clock.h"
#include "base/err.h"
#include "base/net.h"
#include "base/rng.h"
#include "base/uuid.h"

#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

/* splitmix64 and xoshiro256** reference values (Vigna's C code, seed 0 /
 * state seeded from splitmix64(0)); the sampler's seeded streams and
 * the transfer harness's pattern (bench/transfer_pattern.c) rely on these exact sequences. */
static void test_rng_sequences(void **state) {
    (void)state;
    assert_true(rng_mix64(0) == 0xe220a8397b1dcdafull);
    uint64_t x = 0;
    assert_true(rng_splitmix64(&x) == 0xe220a8397b1dcdafull);
    assert_true(rng_splitmix64(&x) == 0x6e789e6aa1b965f4ull);
    assert_true(rng_splitmix64(&x) == 0x06c45d188009454full);
    assert_true(x == 3 * 0x9e3779b97f4a7c15ull);
    rng_state a, b;
    rng_seed(&a, 42);
    rng_seed(&b, 42);
    for (int i = 0; i < 100; i++)
        assert_true(rng_next(&a) == rng_next(&b));
    rng_seed(&b, 43);
    assert_true(rng_next(&a) != rng_next(&b));
    /* xoshiro256** on state {1, 2, 3, 4}: first outputs */
    rng_state s = {{1, 2, 3, 4}};
    assert_true(rng_next(&s) == 11520ull);
    assert_true(rng_next(&s) == 0ull);
    assert_true(rng_next(&s) == 1509978240ull);
    assert_true(rng_next(&s) == 1215971899390074240ull);
    for (int i = 0; i < 1000; i++) {
        double u = rng_uniform(&a);
        assert_true(u >= 0.0 && u < 1.0);
    }
}

static int is_uuid4(const char *u) {
    if (strlen(u) != UUID_STR_LEN) return 0;
    for (int i = 0; i < UUID_STR_LEN; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (u[i] != '-') return 0;
        } else if (!strchr("0123456789abcdef", u[i])) {
            return 0;
        }
    }
    return u[14] == '4' && strchr("89ab", u[19]) != NULL;
}

static void test_uuid4(void **state) {
    (void)state;
    char a[UUID_STR_LEN + 1], b[UUID_STR_LEN + 1];
    uuid4(a);
    uuid4(b);
    assert_true(is_uuid4(a));
    assert_true(is_uuid4(b));
    assert_string_not_equal(a, b);
    /* a forked child draws its own seed: its next id differs from the parent's */
    int p[2];
    assert_int_equal(pipe(p), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char c[UUID_STR_LEN + 1];
        uuid4(c);
        ssize_t w = write(p[1], c, UUID_STR_LEN);
        _exit(w == UUID_STR_LEN ? 0 : 1);
    }
    char child[UUID_STR_LEN + 1] = "";
    assert_int_equal(read(p[0], child, UUID_STR_LEN), UUID_STR_LEN);
    child[UUID_STR_LEN] = 0;
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    uuid4(a);
    assert_true(is_uuid4(child));
    assert_string_not_equal(a, child);
    close(p[0]);
    close(p[1]);
}

static void test_err(void **state) {
    (void)state;
    char e[16];
    err_set(e, sizeof e, "bad %s: %d", "value", 7);
    assert_string_equal(e, "bad value: 7");
    err_set(e, sizeof e, "%s", "a message longer than sixteen bytes");
    assert_int_equal(strlen(e), sizeof e - 1); /* truncated, NUL-terminated */
    err_set(NULL, 10, "ignored %d", 1);        /* no buffer: nothing written */
    e[0] = 'x';
    err_set(e, 0, "ignored");
    assert_int_equal(e[0], 'x');
    assert_int_equal(err_fail(e, sizeof e, -EINVAL, "no %s", "way"), -EINVAL);
    assert_string_equal(e, "no way");
    assert_int_equal(err_fail(NULL, 0, -ENOENT, "x"), -ENOENT);
}

/* ---- acceptor ------------------------------------------------------------ */

typedef struct echo_srv {
    atomic_int served; /* connections whose serve callback ran */
    atomic_int active; /* serve callbacks running now */
    atomic_int peak;   /* most at once */
} echo_srv;

/* Echoes bytes until the peer closes (or acceptor_stop shuts the socket). */
static void echo_serve(void *ctx, acceptor_conn *c) {
    echo_srv *e = ctx;
    int now = atomic_fetch_add(&e->active, 1) + 1;
    int p = atomic_load(&e->peak);
    while (now > p && !atomic_compare_exchange_weak(&e->peak, &p, now)) {
    }
    atomic_fetch_add(&e->served, 1);
    assert_non_null(strchr(c->peer, ':'));
    for (;;) {
        char b[64];
        struct pollfd pf = {.fd = c->fd, .events = POLLIN};
        if (poll(&pf, 1, 10000) <= 0) break;
        ssize_t n = read(c->fd, b, sizeof b);
        if (n <= 0 || net_send_all(c->fd, b, (size_t)n, clock_now_ns() + NS_PER_S)) break;
    }
    atomic_fetch_sub(&e->active, 1);
}

static int listen_any(uint16_t *port) {
    net_addr a;
    assert_int_equal(net_resolve("127.0.0.1", 0, &a), 0);
    int fd = net_listen(&a, 16);
    assert_true(fd >= 0);
    net_addr b;
    net_local_addr(fd, &b);
    *port = net_addr_port(&b);
    return fd;
}

static int dial(uint16_t port) {
    net_addr a;
    assert_int_equal(net_resolve("127.0.0.1", port, &a), 0);
    int fd = net_connect(&a, NULL, clock_now_ns() + NS_PER_S);
    assert_true(fd >= 0);
    return fd;
}

/* 1: the connection echoed "x"; 0: it was closed without an answer. */
static int echoes(int fd) {
    char b = 0;
    if (net_send_all(fd, "x", 1, clock_now_ns() + NS_PER_S)) return 0;
    return net_recv_all(fd, &b, 1, clock_now_ns() + 2 * NS_PER_S) == 0 && b == 'x';
}

static void test_acceptor(void **state) {
    (void)state;
    echo_srv e = {0};
    uint16_t port;
    int lfd = listen_any(&port);
    acceptor_cfg cfg = {.what = "test connection",
                        .max_conns = 2,
                        .nodelay = 1,
                        .shutdown_on_stop = 1,
                        .serve = echo_serve,
                        .ctx = &e};
    acceptor *a = NULL;
    assert_int_equal(acceptor_start(&lfd, 1, &cfg, &a), 0);
    int c1 = dial(port), c2 = dial(port);
    assert_true(echoes(c1));
    assert_true(echoes(c2));
    int c3 = dial(port); /* over max_conns, not waiting: closed at once */
    assert_false(echoes(c3));
    close(c3);
    close(c2); /* frees a slot */
    int c4 = -1;
    for (int i = 0; i < 100; i++) { /* the slot frees once c2's thread has ended */
        c4 = dial(port);
        if (echoes(c4)) break;
        close(c4);
        c4 = -1;
        usleep(10000);
    }
    assert_true(c4 >= 0);
    assert_true(atomic_load(&e.peak) <= 2);
    acceptor_stop(a); /* shuts c1 and c4 down and waits for their threads */
    assert_int_equal(atomic_load(&e.active), 0);
    char b;
    assert_true(read(c1, &b, 1) <= 0);
    close(c1);
    close(c4);
    int c5 = socket(AF_INET, SOCK_STREAM, 0); /* the listener is closed */
    net_addr to;
    net_resolve("127.0.0.1", port, &to);
    assert_true(connect(c5, (struct sockaddr *)&to.ss, to.len) < 0);
    close(c5);

    /* wait_when_full: the third connection is served once a slot frees */
    echo_srv w = {0};
    lfd = listen_any(&port);
    cfg = (acceptor_cfg){.max_conns = 1, .wait_when_full = 1, .serve = echo_serve, .ctx = &w};
    assert_int_equal(acceptor_start(&lfd, 1, &cfg, &a), 0);
    c1 = dial(port);
    assert_true(echoes(c1));
    c2 = dial(port); /* in the backlog */
    close(c1);
    assert_true(echoes(c2));
    close(c2);
    acceptor_stop(a);
    assert_int_equal(atomic_load(&w.served), 2);
    assert_int_equal(atomic_load(&w.peak), 1);

    /* bad arguments: refused, the listener closed */
    lfd = listen_any(&port);
    cfg.max_conns = 0;
    assert_int_equal(acceptor_start(&lfd, 1, &cfg, &a), -EINVAL);
    assert_true(fcntl(lfd, F_GETFD) < 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rng_sequences),
        cmocka_unit_test(test_uuid4),
        cmocka_unit_test(test_err),
        cmocka_unit_test(test_acceptor),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
