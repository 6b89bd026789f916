/* Unit tests: the tcp transport's initiator (src/transfer/tcp_client.c) against a minimal
 * in-process Mooncake v2 data server on loopback whose connections can be made silent (a
 * black hole: they read everything and answer nothing, no error, no EOF). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/clock.h"
#include "base/net.h"
#include "disagg/transfer.h"
#include "transfer/tcp_client.h"
#include "transfer/tcp_server.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- the data server ----------------------------------------------------------------- */

#define MAX_CONNS 32

typedef struct fake_server {
    int lfd;
    net_addr addr;
    pthread_t acceptor;
    pthread_mutex_t mu;
    int fds[MAX_CONNS];
    atomic_int silent[MAX_CONNS]; /* 1: reads and drops, never answers */
    pthread_t th[MAX_CONNS];
    int n; /* connections accepted */
} fake_server;

typedef struct conn_arg {
    fake_server *s;
    int i;
} conn_arg;

static void *serve_conn(void *arg) {
    conn_arg *a = arg;
    fake_server *s = a->s;
    int i = a->i, fd = s->fds[i];
    free(a);
    static char sink[1 << 16];
    for (;;) {
        uint8_t h[TCP_HEADER_LEN];
        uint64_t size, addr;
        uint8_t op;
        if (net_recv_all(fd, h, sizeof h, clock_now_ns() + 60 * NS_PER_S)) break;
        tcp_header_decode(h, &size, &addr, &op);
        for (uint64_t left = size; left > 0;) { /* a WRITE's payload: dropped */
            size_t k = left < sizeof sink ? (size_t)left : sizeof sink;
            if (net_recv_all(fd, sink, k, clock_now_ns() + 60 * NS_PER_S)) goto out;
            left -= k;
        }
        if (atomic_load(&s->silent[i])) continue; /* the black hole */
        uint64_t st = TCP_STATUS_MAGIC | TCP_STATUS_OK;
        if (net_send_all(fd, &st, sizeof st, clock_now_ns() + 10 * NS_PER_S)) break;
    }
out:
    return NULL;
}

static void *accept_main(void *arg) {
    fake_server *s = arg;
    for (;;) {
        int fd = accept(s->lfd, NULL, NULL);
        if (fd < 0) break;
        pthread_mutex_lock(&s->mu);
        if (s->n == MAX_CONNS) {
            pthread_mutex_unlock(&s->mu);
            close(fd);
            continue;
        }
        int i = s->n++;
        net_set_nonblock(fd, 1); /* net_recv_all's deadline needs it */
        s->fds[i] = fd;
        conn_arg *a = malloc(sizeof *a);
        a->s = s;
        a->i = i;
        pthread_create(&s->th[i], NULL, serve_conn, a);
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

static fake_server *server_start(void) {
    fake_server *s = calloc(1, sizeof *s);
    assert_non_null(s);
    pthread_mutex_init(&s->mu, NULL);
    assert_int_equal(net_resolve("127.0.0.1", 0, &s->addr), 0);
    s->lfd = net_listen(&s->addr, 16);
    assert_true(s->lfd >= 0);
    net_set_nonblock(s->lfd, 0); /* the acceptor blocks in accept */
    assert_int_equal(net_local_addr(s->lfd, &s->addr), 0);
    pthread_create(&s->acceptor, NULL, accept_main, s);
    return s;
}

static int server_conns(fake_server *s) {
    pthread_mutex_lock(&s->mu);
    int n = s->n;
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* Every connection open now goes silent; later ones are served. */
static void server_black_hole_open_conns(fake_server *s) {
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->n; i++)
        atomic_store(&s->silent[i], 1);
    pthread_mutex_unlock(&s->mu);
}

static void server_stop(fake_server *s) {
    shutdown(s->lfd, SHUT_RDWR);
    pthread_join(s->acceptor, NULL);
    close(s->lfd);
    for (int i = 0; i < s->n; i++) {
        shutdown(s->fds[i], SHUT_RDWR);
        pthread_join(s->th[i], NULL);
        close(s->fds[i]);
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* ---- ops and their sink ---------------------------------------------------------------- */

typedef struct results {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    int err[64];
} results;

static void on_done(void *ctx, xfer_op *op, int err) {
    results *r = ctx;
    pthread_mutex_lock(&r->mu);
    r->err[op->req] = err;
    r->done++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    free(op);
}

static void on_reroute(void *ctx, xfer_op *op, int err) {
    (void)ctx;
    (void)op;
    fail_msg("tcp_client handed an op to the engine's reroute (err %d)", err);
}

static const atomic_int not_canceled;
static char payload[4096];

/* n WRITEs of 4 KB, each failing after deadline_ms; waits for all; returns how many failed
 * (their errors in r->err). */
static int run_writes(tcp_client *cl, results *r, int n, int deadline_ms) {
    pthread_mutex_lock(&r->mu);
    r->done = 0;
    pthread_mutex_unlock(&r->mu);
    uint64_t deadline = clock_now_ns() + (uint64_t)deadline_ms * NS_PER_MS;
    for (int i = 0; i < n; i++) {
        xfer_op *op = calloc(1, sizeof *op);
        assert_non_null(op);
        op->canceled = &not_canceled;
        op->req = (uint32_t)i;
        op->opcode = TRANSFER_WRITE;
        op->local = payload;
        op->remote = 0x10000 + (uint64_t)i * sizeof payload;
        op->len = sizeof payload;
        op->deadline_ns = deadline;
        tcp_client_submit(cl, op);
    }
    pthread_mutex_lock(&r->mu);
    while (r->done < n)
        pthread_cond_wait(&r->cv, &r->mu);
    int failed = 0;
    for (int i = 0; i < n; i++)
        failed += r->err[i] != 0;
    pthread_mutex_unlock(&r->mu);
    return failed;
}

/* A request times out on one lane of a path (its connection went silent): the path's other
 * connections, opened to the same peer the same way and just as silent but idle, are closed
 * with it, so the next requests get fresh connections instead of each waiting out a
 * deadline on a silent one (what a follow-up transfer after a black hole hit, with
 * layer-wise streaming: its small writes had used the second lane before the first went
 * silent, and the first request's failure left that one open). */
static void test_silent_connection_closes_its_path_siblings(void **state) {
    (void)state;
    fake_server *s = server_start();
    results r = {.done = 0};
    pthread_mutex_init(&r.mu, NULL);
    pthread_cond_init(&r.cv, NULL);
    xfer_sink sink = {on_done, on_reroute, &r};
    tcp_path path = {.dst = s->addr};
    snprintf(path.label, sizeof path.label, "any -> fake server");
    tcp_client *cl = NULL;
    assert_int_equal(tcp_client_create(&sink, &path, 1, 2, NS_PER_S, NULL, &cl), 0);
    assert_int_equal(tcp_client_num_lanes(cl), 2);

    /* both lanes connect and carry requests */
    assert_int_equal(run_writes(cl, &r, 8, 5000), 0);
    assert_int_equal(server_conns(s), 2);

    /* a black hole on both connections; one request: it goes on one lane and times out */
    server_black_hole_open_conns(s);
    assert_int_equal(run_writes(cl, &r, 1, 300), 1);
    assert_int_equal(r.err[0], TRANSFER_ETIMEDOUT);

    /* the next requests, on both lanes: every one is answered, over two new connections */
    int failed = run_writes(cl, &r, 8, 3000), first = 0;
    for (int i = 0; i < 8 && !first; i++)
        first = r.err[i];
    if (failed)
        fail_msg("%d of 8 requests after the black hole failed (error %d): a lane kept a "
                 "connection that had gone silent with its sibling",
                 failed, first);
    assert_int_equal(server_conns(s), 4);

    tcp_client_destroy(cl);
    server_stop(s);
    pthread_mutex_destroy(&r.mu);
    pthread_cond_destroy(&r.cv);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_silent_connection_closes_its_path_siblings),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
