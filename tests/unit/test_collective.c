/*
 * test_collective — kernels/collective.h over shared memory with real processes (fork):
 * the all-reduce sums rank 0 + rank 1 + ... in that order (checked bit for bit against the
 * same sum computed here, on values whose order changes the f32 result) and every rank gets
 * the same bits; the all-gather concatenates in rank order; the step channel delivers every
 * message to every rank in order and refuses one too large; a peer that dies (whatever the
 * way) makes the others' calls return -EPIPE promptly instead of waiting forever; bad
 * arguments are refused.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "kernels/collective.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define N_ELEMS 1000

/* rank r's contribution: magnitudes that make the order of the sum matter in f32 */
static float value(int r, int i) {
    float big = 1e8f * (1.0f + (float)i * 1e-3f);
    return r == 0 ? big : r == 1 ? -big : (float)r * 0.37f + (float)i * 1e-3f;
}

static float expected(int n, int i) {
    float s = value(0, i);
    for (int r = 1; r < n; r++)
        s += value(r, i);
    return s;
}

/* the work of one rank; 0 when everything matched */
static int rank_main(collective *c, int n) {
    int r = collective_rank(c);
    float *buf = malloc(N_ELEMS * sizeof *buf);
    float *all = malloc((size_t)n * 8 * sizeof *all);
    int bad = 0;
    for (int round = 0; round < 5 && !bad; round++) { /* both slot sets, several times */
        for (int i = 0; i < N_ELEMS; i++)
            buf[i] = value(r, i);
        if (collective_all_reduce(c, NULL, buf, BACKEND_F32, N_ELEMS)) bad = 1;
        for (int i = 0; i < N_ELEMS && !bad; i++) {
            float e = expected(n, i);
            if (memcmp(&buf[i], &e, sizeof e)) bad = 2;
        }
        float part[8];
        for (int k = 0; k < 8; k++)
            part[k] = (float)(r * 100 + k + round);
        if (!bad && collective_all_gather(c, NULL, all, part, sizeof part)) bad = 3;
        for (int q = 0; q < n && !bad; q++)
            for (int k = 0; k < 8; k++)
                if (all[q * 8 + k] != (float)(q * 100 + k + round)) bad = 4;
    }
    free(buf);
    free(all);
    return bad;
}

/* in a forked child: rank r on its own handle of c's segment (as a spawned worker has) */
static collective *child_rank(collective *c, int r) {
    char err[256];
    collective *k = NULL;
    if (collective_open(dup(collective_fd(c)), &k, err, sizeof err) || collective_join(k, r))
        _exit(10);
    return k;
}

/* forks ranks 1..n-1 running fn; returns their exit statuses' OR (0: all fine) */
static int run_group(collective *c, int n, int (*fn)(collective *, int), pid_t *pids) {
    for (int r = 1; r < n; r++) {
        pid_t p = fork();
        if (p == 0) _exit(fn(child_rank(c, r), n));
        pids[r] = p;
    }
    return 0;
}

static int wait_all(int n, const pid_t *pids) {
    int worst = 0;
    for (int r = 1; r < n; r++) {
        int st = 0;
        waitpid(pids[r], &st, 0);
        worst |= WIFEXITED(st) ? WEXITSTATUS(st) : 100;
    }
    return worst;
}

static void all_reduce_and_gather_n(int n) {
    char err[256];
    collective *c = NULL;
    assert_int_equal(collective_create(n, 64 << 10, 4096, &c, err, sizeof err), 0);
    assert_int_equal(collective_join(c, 0), 0);
    assert_int_equal(collective_join(c, 1), -EINVAL); /* one rank per handle */
    pid_t pids[COLLECTIVE_MAX_RANKS] = {0};
    run_group(c, n, rank_main, pids);
    assert_int_equal(rank_main(c, n), 0);
    assert_int_equal(wait_all(n, pids), 0);
    double s = -1;
    long calls = 0;
    collective_stats(c, &s, &calls);
    assert_int_equal(calls, 10);
    assert_true(s >= 0);
    collective_free(c);
}

static void test_all_reduce_in_rank_order_2(void **st) {
    (void)st;
    /* the order matters for these values: (a + b) + c != a + (b + c) somewhere */
    int differs = 0;
    for (int i = 0; i < N_ELEMS; i++) {
        float fwd = expected(3, i), rev = value(2, i);
        rev += value(1, i);
        rev += value(0, i);
        differs |= memcmp(&fwd, &rev, sizeof fwd) != 0;
    }
    assert_true(differs);
    all_reduce_and_gather_n(2);
}

static void test_all_reduce_in_rank_order_3_and_8(void **st) {
    (void)st;
    all_reduce_and_gather_n(3);
    all_reduce_and_gather_n(8);
}

static int receiver(collective *c, int n) {
    (void)n;
    char buf[64];
    size_t got;
    for (int k = 0; k < 50; k++) {
        if (collective_recv(c, buf, sizeof buf, &got)) return 1;
        int v;
        if (got != sizeof v) return 2;
        memcpy(&v, buf, sizeof v);
        if (v != k) return 3;
    }
    return collective_recv(c, buf, sizeof buf, &got) == 0 && got == 0 ? 0 : 4;
}

static void test_step_channel(void **st) {
    (void)st;
    char err[256];
    collective *c = NULL;
    assert_int_equal(collective_create(3, 4096, 64, &c, err, sizeof err), 0);
    assert_int_equal(collective_join(c, 0), 0);
    pid_t pids[COLLECTIVE_MAX_RANKS] = {0};
    run_group(c, 3, receiver, pids);
    for (int k = 0; k < 50; k++)
        assert_int_equal(collective_send(c, &k, sizeof k), 0);
    char big[65] = {0};
    assert_int_equal(collective_send(c, big, sizeof big), -EMSGSIZE);
    assert_int_equal(collective_send(c, big, 0), 0);
    assert_int_equal(wait_all(3, pids), 0);
    collective_free(c);
}

static int die_at_once(collective *c, int n) {
    (void)c, (void)n;
    kill(getpid(), SIGKILL);
    return 0;
}

static int reduce_once(collective *c, int n) {
    (void)n;
    float x = 1;
    return collective_all_reduce(c, NULL, &x, BACKEND_F32, 1) == -EPIPE ? 0 : 1;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void test_a_dead_peer_fails_the_group(void **st) {
    (void)st;
    char err[256];
    collective *c = NULL;
    assert_int_equal(collective_create(3, 4096, 64, &c, err, sizeof err), 0);
    assert_int_equal(collective_join(c, 0), 0);
    /* rank 1 dies (killed: no cleanup of its own), rank 2 waits in an all-reduce */
    pid_t p1 = fork();
    if (p1 == 0) {
        _exit(die_at_once(child_rank(c, 1), 3));
    }
    int s1;
    waitpid(p1, &s1, 0); /* dead (and reaped) before anyone waits on it */
    assert_true(WIFSIGNALED(s1));
    pid_t p2 = fork();
    if (p2 == 0) {
        _exit(reduce_once(child_rank(c, 2), 3));
    }
    double t0 = now();
    float x = 1;
    assert_int_equal(collective_all_reduce(c, NULL, &x, BACKEND_F32, 1), -EPIPE);
    assert_true(collective_poisoned(c));
    int s2;
    waitpid(p2, &s2, 0);
    assert_true(WIFEXITED(s2));
    assert_int_equal(WEXITSTATUS(s2), 0);
    assert_true(now() - t0 < 10); /* promptly, not a hang (no timing beyond that) */
    /* every later call fails too */
    assert_int_equal(collective_send(c, &x, sizeof x), -EPIPE);
    collective_free(c);
}

static void test_bad_arguments(void **st) {
    (void)st;
    char err[256];
    collective *c = NULL;
    assert_int_equal(collective_create(1, 4096, 64, &c, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "accepted 2..8"));
    assert_int_equal(collective_create(9, 4096, 64, &c, err, sizeof err), -EINVAL);
    assert_int_equal(collective_open(0, &c, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "not a tensor-parallel segment"));
    assert_int_equal(collective_create(2, 64, 64, &c, err, sizeof err), 0);
    assert_int_equal(collective_join(c, 2), -EINVAL);
    assert_int_equal(collective_join(c, 0), 0);
    float x[32] = {0};
    assert_int_equal(collective_all_reduce(c, NULL, x, BACKEND_F32, 32), -EINVAL); /* > slot */
    assert_int_equal(collective_all_reduce(c, NULL, x, BACKEND_BF16, 4), -EINVAL);
    assert_int_equal(collective_all_gather(c, NULL, x, x, 100), -EINVAL);
    /* a second handle on the same segment through its descriptor */
    collective *d = NULL;
    assert_int_equal(collective_open(dup(collective_fd(c)), &d, err, sizeof err), 0);
    assert_int_equal(collective_size(d), 2);
    assert_int_equal(collective_join(d, 0), -EINVAL); /* rank 0 is held */
    collective_free(d);
    collective_free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_all_reduce_in_rank_order_2),
        cmocka_unit_test(test_all_reduce_in_rank_order_3_and_8),
        cmocka_unit_test(test_step_channel),
        cmocka_unit_test(test_a_dead_peer_fails_the_group),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
