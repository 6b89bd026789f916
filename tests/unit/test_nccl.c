/*
 * test_nccl — the tensor-parallel communicator (kernels/cuda/cuda_tp.h) and the rendezvous
 * its ranks use to share the NCCL unique id (kernels/tp_rendezvous.h):
 *   - the rendezvous: publish / wait (also across processes), its timeout and bad inputs;
 *   - NCCL loads from the CUDA module (the toolkit's libnccl, dlopen()ed), its major equals
 *     the header's, unique ids are fresh (no GPU needed);
 *   - one rank on GPU 0: in-place f32 and bf16 all-reduce leaves the data as it was, and
 *     bad arguments are refused with a message;
 *   - N ranks, one process per GPU, when N >= 2 GPUs are visible: rank 0 publishes the id,
 *     every rank joins and all-reduces f32 and bf16; each checks the exact sum.
 * Every CUDA/NCCL step runs in a forked child, so the parent never initialises CUDA (a
 * forked child of a CUDA process cannot use the GPU).  No GPU (or no module): those tests
 * are skipped with a loud line saying why.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_module.h"
#include "kernels/cuda/cuda_tp.h"
#include "kernels/tp_rendezvous.h"

#define CHILD_SKIP 77

static char tmpdir[256];

/* Runs fn(arg) in a child; returns its exit status (0 pass, 77 skip, else fail), or -1 when
 * it did not finish within timeout_s (then it is killed). */
static int in_child(int (*fn)(void *), void *arg, int timeout_s) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) _exit(fn(arg));
    for (int waited = 0; waited < timeout_s * 100; waited++) {
        int st;
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

/* ---- rendezvous (no GPU) ------------------------------------------------------------- */

static int publish_late(void *arg) {
    struct timespec ts = {0, 150 * 1000 * 1000};
    nanosleep(&ts, NULL);
    char err[256];
    unsigned char id[DTP_ID_BYTES];
    for (int i = 0; i < DTP_ID_BYTES; i++)
        id[i] = (unsigned char)(i * 7 + 1);
    return tp_rendezvous_publish((const char *)arg, id, sizeof id, err, sizeof err) ? 1 : 0;
}

static void test_rendezvous(void **state) {
    (void)state;
    char path[512], err[512];
    unsigned char id[DTP_ID_BYTES], got[DTP_ID_BYTES];
    snprintf(path, sizeof path, "%s/nccl-id", tmpdir);
    /* nobody published: a timeout naming the path */
    assert_int_equal(tp_rendezvous_wait(path, got, sizeof got, 0.05, err, sizeof err), -ETIMEDOUT);
    assert_non_null(strstr(err, "did not appear within 0.05 s"));
    assert_non_null(strstr(err, path));
    for (int i = 0; i < DTP_ID_BYTES; i++)
        id[i] = (unsigned char)(255 - i);
    assert_int_equal(tp_rendezvous_publish(path, id, sizeof id, err, sizeof err), 0);
    memset(got, 0, sizeof got);
    assert_int_equal(tp_rendezvous_wait(path, got, sizeof got, 1, err, sizeof err), 0);
    assert_memory_equal(id, got, sizeof id);
    /* another size than expected */
    assert_int_equal(tp_rendezvous_wait(path, got, 64, 1, err, sizeof err), -EPROTO);
    assert_non_null(strstr(err, "holds 128 bytes, expected 64"));
    unlink(path);
    /* published by another process while this one waits */
    int status = 0;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) _exit(publish_late(path));
    assert_int_equal(tp_rendezvous_wait(path, got, sizeof got, 10, err, sizeof err), 0);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    for (int i = 0; i < DTP_ID_BYTES; i++)
        assert_int_equal(got[i], (unsigned char)(i * 7 + 1));
    unlink(path);
    /* bad inputs */
    assert_int_equal(tp_rendezvous_publish("", id, sizeof id, err, sizeof err), -EINVAL);
    assert_int_equal(tp_rendezvous_publish(path, id, TP_RENDEZVOUS_MAX + 1, err, sizeof err),
                     -EINVAL);
    assert_int_equal(tp_rendezvous_wait(path, got, sizeof got, -1, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "timeout of -1 s"));
    char nodir[600];
    snprintf(nodir, sizeof nodir, "%s/no/such/dir/id", tmpdir);
    assert_true(tp_rendezvous_publish(nodir, id, sizeof id, err, sizeof err) < 0);
    assert_non_null(strstr(err, "cannot create"));
}

/* ---- NCCL from the module -------------------------------------------------------------- */

static int child_load(void *arg) {
    (void)arg;
    char err[1024];
    const dtp_api *t = cuda_tp_load(err, sizeof err);
    if (!t) {
        fprintf(stderr, "\n******** SKIP test_nccl load: no CUDA module: %s ********\n\n", err);
        return CHILD_SKIP;
    }
    int v = 0;
    if (t->load(&v, err, sizeof err)) {
        fprintf(stderr, "test_nccl: NCCL did not load (built against %d, %s): %s\n", t->built_nccl,
                t->nccl_path, err);
        return 1;
    }
    fprintf(stderr, "test_nccl: NCCL %d loaded (module built against %d; build found %s)\n", v,
            t->built_nccl, t->nccl_path);
    if (v / 10000 != t->built_nccl / 10000) return 1;
    unsigned char a[DTP_ID_BYTES], b[DTP_ID_BYTES], zero[DTP_ID_BYTES] = {0};
    if (t->unique_id(a, err, sizeof err) || t->unique_id(b, err, sizeof err)) {
        fprintf(stderr, "test_nccl: ncclGetUniqueId: %s\n", err);
        return 1;
    }
    if (!memcmp(a, b, sizeof a) || !memcmp(a, zero, sizeof a)) {
        fprintf(stderr, "test_nccl: two unique ids are equal or empty\n");
        return 1;
    }
    return 0;
}

static void check_child(int rc, const char *what) {
    if (rc == CHILD_SKIP) skip();
    if (rc != 0) fail_msg("%s: child exited %d%s", what, rc, rc == -1 ? " (timed out)" : "");
}

static void test_nccl_loads(void **state) {
    (void)state;
    check_child(in_child(child_load, NULL, 60), "NCCL load");
}

/* ---- all-reduce on GPUs ------------------------------------------------------------------ */

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16); /* exact for the small integers used here */
}
static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

typedef struct rank_job {
    int rank, n_ranks;
    char id_path[512];
} rank_job;

#define N_ELEMS ((1u << 20) + 3u)

/* small integers: every partial sum of up to 8 ranks stays below 256 in magnitude, so the
 * bf16 sums are exact whatever order NCCL adds in */
static float value(int rank, size_t i) {
    return (float)((rank + 1) * (int)(i % 5u) - 2);
}

/* One rank: join the group, all-reduce f32 then bf16, check the exact sums. */
static int child_rank(void *arg) {
    const rank_job *j = arg;
    char err[1024];
    char dev[32];
    snprintf(dev, sizeof dev, "cuda:%d", j->rank);
    backend *be = NULL;
    if (backend_open(dev, NULL, &be, err, sizeof err)) {
        fprintf(stderr, "\n******** SKIP test_nccl rank %d: needs a CUDA GPU: %s ********\n\n",
                j->rank, err);
        return CHILD_SKIP;
    }
    const dtp_api *t = cuda_tp_load(err, sizeof err);
    if (!t) {
        fprintf(stderr, "test_nccl rank %d: %s\n", j->rank, err);
        return 1;
    }
    unsigned char id[DTP_ID_BYTES];
    int rc = j->rank == 0 ? t->unique_id(id, err, sizeof err) : 0;
    if (!rc && j->rank == 0 && j->n_ranks > 1)
        rc = tp_rendezvous_publish(j->id_path, id, sizeof id, err, sizeof err);
    if (!rc && j->rank > 0) rc = tp_rendezvous_wait(j->id_path, id, sizeof id, 60, err, sizeof err);
    if (rc) {
        fprintf(stderr, "test_nccl rank %d: %s\n", j->rank, err);
        return 1;
    }
    if (j->n_ranks == 1) {
        /* refusals, before the real communicator */
        if (t->comm_init(0, 1, 1, id, err, sizeof err) || !strstr(err, "rank 1 of 1")) {
            fprintf(stderr, "test_nccl: rank 1 of 1 was not refused (%s)\n", err);
            return 1;
        }
        if (t->comm_init(4096, 1, 0, id, err, sizeof err) || !strstr(err, "not available")) {
            fprintf(stderr, "test_nccl: device 4096 was not refused (%s)\n", err);
            return 1;
        }
    }
    dtp_comm *c = t->comm_init(j->rank, j->n_ranks, j->rank, id, err, sizeof err);
    const char *nvls = getenv("NCCL_NVLS_ENABLE");
    if (!c || !nvls || strcmp(nvls, "0")) {
        fprintf(stderr, "test_nccl rank %d: %s (NCCL_NVLS_ENABLE=%s)\n", j->rank,
                c ? "NVLS not off" : err, nvls ? nvls : "unset");
        t->comm_free(c);
        return 1;
    }
    backend_stream *ctx = backend_stream_create(be);
    float *h = malloc(N_ELEMS * sizeof *h);
    uint16_t *hb = malloc(N_ELEMS * sizeof *hb);
    backend_buffer *db = ctx ? backend_buffer_alloc(be, N_ELEMS * sizeof(float), 0) : NULL;
    void *d = db ? backend_buffer_ptr(db) : NULL;
    int bad = !ctx || !h || !hb || !d;
    if (bad) fprintf(stderr, "test_nccl rank %d: setup failed\n", j->rank);
    float sum_k = (float)(j->n_ranks * (j->n_ranks + 1) / 2);
    for (int pass = 0; pass < 2 && !bad; pass++) { /* 0: f32, 1: bf16 */
        for (size_t i = 0; i < N_ELEMS; i++) {
            h[i] = value(j->rank, i);
            hb[i] = to_bf16(h[i]);
        }
        bad = backend_upload(ctx, d, pass ? (void *)hb : (void *)h,
                        N_ELEMS * (pass ? sizeof *hb : sizeof *h)) ||
              t->all_reduce(c, d, N_ELEMS, pass ? DCU_BF16 : DCU_F32, NULL, err, sizeof err) ||
              t->sync(c, err, sizeof err) ||
              backend_download(ctx, pass ? (void *)hb : (void *)h, d,
                          N_ELEMS * (pass ? sizeof *hb : sizeof *h));
        if (bad) {
            fprintf(stderr, "test_nccl rank %d: all-reduce %s: %s\n", j->rank,
                    pass ? "bf16" : "f32", err);
            break;
        }
        for (size_t i = 0; i < N_ELEMS && !bad; i++) {
            float want = sum_k * (float)(i % 5u) - 2.0f * (float)j->n_ranks;
            float got = pass ? from_bf16(hb[i]) : h[i];
            if (got != want) {
                fprintf(stderr, "test_nccl rank %d of %d: %s element %zu = %g, want %g\n", j->rank,
                        j->n_ranks, pass ? "bf16" : "f32", i, (double)got, (double)want);
                bad = 1;
            }
        }
    }
    if (!bad && t->all_reduce(c, d, 4, DCU_F16, NULL, err, sizeof err) != -EINVAL) {
        fprintf(stderr, "test_nccl: an f16 all-reduce was not refused\n");
        bad = 1;
    }
    if (!bad)
        fprintf(stderr, "test_nccl rank %d of %d: f32 and bf16 all-reduce of %u elements exact\n",
                j->rank, j->n_ranks, N_ELEMS);
    backend_buffer_free(db);
    backend_stream_free(ctx);
    t->comm_free(c);
    backend_close(be);
    free(h);
    free(hb);
    return bad;
}

static void test_single_rank_all_reduce(void **state) {
    (void)state;
    rank_job j = {0, 1, ""};
    check_child(in_child(child_rank, &j, 120), "single-rank all-reduce");
}

/* the number of CUDA devices this process sees: cuda:0, cuda:1, ... until one does not open */
static int child_count_gpus(void *arg) {
    (void)arg;
    char err[512], dev[32];
    int n = 0;
    for (; n < 64; n++) {
        backend *be = NULL;
        snprintf(dev, sizeof dev, "cuda:%d", n);
        if (backend_open(dev, NULL, &be, err, sizeof err)) break;
        backend_close(be);
    }
    if (!n) fprintf(stderr, "test_nccl: no GPU: %s\n", err);
    return n;
}

static void test_multi_rank_all_reduce(void **state) {
    (void)state;
    int n = in_child(child_count_gpus, NULL, 60);
    if (n < 2) {
        fprintf(stderr,
                "\n******** SKIP test_nccl multi-rank: needs 2 or more GPUs, %d visible "
                "********\n\n",
                n < 0 ? 0 : n);
        skip();
    }
    rank_job jobs[64];
    pid_t pids[64];
    for (int r = 0; r < n; r++) {
        jobs[r] = (rank_job){.rank = r, .n_ranks = n};
        snprintf(jobs[r].id_path, sizeof jobs[r].id_path, "%s/multi-id", tmpdir);
        fflush(stderr);
        pids[r] = fork();
        assert_true(pids[r] >= 0);
        if (pids[r] == 0) _exit(child_rank(&jobs[r]));
    }
    int failed = 0;
    for (int r = 0; r < n; r++) {
        int st = 0, done = 0;
        for (int waited = 0; waited < 18000 && !done; waited++) { /* 180 s for all */
            if (waitpid(pids[r], &st, WNOHANG) == pids[r]) {
                done = 1;
                break;
            }
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        if (!done) {
            fprintf(stderr, "test_nccl: rank %d did not finish; killing the group\n", r);
            for (int k = r; k < n; k++)
                kill(pids[k], SIGKILL);
            for (int k = r; k < n; k++)
                waitpid(pids[k], NULL, 0);
            fail_msg("%d-rank all-reduce timed out", n);
        }
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) failed++;
    }
    if (failed) fail_msg("%d of %d ranks failed the all-reduce", failed, n);
}

static int setup(void **st) {
    (void)st;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/test_nccl.XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}
static int teardown(void **st) {
    (void)st;
    char p[600];
    snprintf(p, sizeof p, "%s/multi-id", tmpdir);
    unlink(p);
    rmdir(tmpdir);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rendezvous),
        cmocka_unit_test(test_nccl_loads),
        cmocka_unit_test(test_single_rank_all_reduce),
        cmocka_unit_test(test_multi_rank_all_reduce),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
