/* GPU tests of the transfer engine with device memory (scripts/gpu_check.sh; CI has no GPU:
 * it skips, saying so loudly).  Two processes on one GPU: this one and a target started as
 * `disagg bench transfer --location cuda:0 --mode target` (its device buffer registered as
 * cuda:0, its cudaIpcMemHandle published in its descriptor; it checks bytes on request).
 * The ops are the CUDA module's (kernels/cuda/cuda_transfer_ops.cu), the engine the real one:
 *   cuda_ipc: bytes both ways at unaligned offsets and odd sizes, one mapping per peer;
 *             32 contiguous requests = one device copy, 3 scattered = one batch (one
 *             gather/scatter kernel launch); out-of-range
 *             requests refused with nothing copied; a target SIGKILLed while writes run:
 *             they end (ECONN), no hang, the mapping is released and the target's device
 *             memory comes back;
 *   staged tcp (protocol tcp): device memory on both sides, bytes both ways;
 *   the DMA-BUF export (cuMemGetHandleForAddressRange) of device memory. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "bench/transfer_bench.h"
#include "disagg/transfer.h"
#include "kernels/cuda/cuda_transfer.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NS 1000000000ull

static const dcu_transfer_api *api;
static transfer_device_ops ops;
static char disagg_bin[PATH_MAX];

/* The pattern of bench/transfer_pattern.c (the target checks with it): byte at offset o
 * is byte o % 8 of tb_pattern_word(seed, o / 8). */
static void pat_fill(void *buf, uint64_t key, size_t len, uint64_t seed) {
    uint8_t *b = buf;
    for (size_t i = 0; i < len; i++) {
        uint64_t o = key + i;
        b[i] = (uint8_t)(tb_pattern_word(seed, o / 8) >> (8 * (o % 8)));
    }
}
static size_t pat_check(const void *buf, uint64_t key, size_t len, uint64_t seed, size_t *first) {
    const uint8_t *b = buf;
    size_t bad = 0;
    (void)first;
    for (size_t i = 0; i < len; i++) {
        uint64_t o = key + i;
        bad += b[i] != (uint8_t)(tb_pattern_word(seed, o / 8) >> (8 * (o % 8)));
    }
    return bad;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * NS + (uint64_t)ts.tv_nsec;
}

typedef struct target {
    pid_t pid;
    FILE *in, *out;
    char segment[128];
    unsigned long long dev, host;
    size_t length;
} target;

/* tokens: the target's device buffer is 2 x tokens/16 blocks of 917,504 bytes + 4 KiB. */
static int target_start(target *t, int tokens) {
    int to[2], from[2];
    if (pipe2(to, O_CLOEXEC) || pipe2(from, O_CLOEXEC)) return -1;
    char tok[32];
    snprintf(tok, sizeof tok, "%d", tokens);
    const char *args[] = {disagg_bin, "bench",  "transfer", "--location", "cuda:0",
                          "--mode",   "target", "--tokens", tok,          NULL};
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(to[0], STDIN_FILENO);
        dup2(from[1], STDOUT_FILENO);
        execv(disagg_bin, (char *const *)args);
        _exit(127);
    }
    close(to[0]);
    close(from[1]);
    t->pid = pid;
    t->in = fdopen(to[1], "w");
    t->out = fdopen(from[0], "r");
    /* its ready line (bench/transfer_bench.h): one JSON object, buffers[0] the device buffer,
     * buffers[1] the host one */
    char line[4096];
    json_t *j = fgets(line, sizeof line, t->out) ? json_loads(line, 0, NULL) : NULL;
    json_t *bufs = json_object_get(j, "buffers");
    const char *seg = json_string_value(json_object_get(j, "segment"));
    if (!seg || json_array_size(bufs) != 2 || strlen(seg) >= sizeof t->segment) {
        fprintf(stderr, "the target printed no ready line\n");
        json_decref(j);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    snprintf(t->segment, sizeof t->segment, "%s", seg);
    t->dev =
        (unsigned long long)json_integer_value(json_object_get(json_array_get(bufs, 0), "addr"));
    t->length = (size_t)json_integer_value(json_object_get(json_array_get(bufs, 0), "length"));
    t->host =
        (unsigned long long)json_integer_value(json_object_get(json_array_get(bufs, 1), "addr"));
    json_decref(j);
    return 0;
}

/* Bytes at the target's device offset off that differ from the pattern keyed from key. */
static long long target_check(target *t, uint64_t off, size_t len, uint64_t key, uint64_t seed) {
    fprintf(t->in, "verify %llu %zu %llu %llu\n", (unsigned long long)off, len,
            (unsigned long long)key, (unsigned long long)seed);
    fflush(t->in);
    char line[128];
    long long bad = -1;
    if (!fgets(line, sizeof line, t->out) || sscanf(line, "bad %lld", &bad) != 1) return -1;
    return bad;
}

static void target_stop(target *t) {
    if (t->pid <= 0) return;
    fprintf(t->in, "quit\n");
    fclose(t->in);
    fclose(t->out);
    waitpid(t->pid, NULL, 0);
    t->pid = 0;
}

/* local device memory through pinned staging */
static void dev_fill(void *dev, size_t len, uint64_t key, uint64_t seed) {
    void *h = ops.alloc_pinned(ops.ctx, len), *st;
    assert_non_null(h);
    assert_int_equal(ops.stream_create(ops.ctx, 0, &st), 0);
    pat_fill(h, key, len, seed);
    assert_int_equal(ops.copy_from_host(ops.ctx, st, dev, h, len), 0);
    assert_int_equal(ops.sync(ops.ctx, st), 0);
    ops.stream_destroy(ops.ctx, st);
    ops.free_pinned(ops.ctx, h);
}
static size_t dev_bad(const void *dev, size_t len, uint64_t key, uint64_t seed) {
    void *h = ops.alloc_pinned(ops.ctx, len), *st;
    assert_non_null(h);
    assert_int_equal(ops.stream_create(ops.ctx, 0, &st), 0);
    assert_int_equal(ops.copy_to_host(ops.ctx, st, h, dev, len), 0);
    assert_int_equal(ops.sync(ops.ctx, st), 0);
    size_t bad = pat_check(h, key, len, seed, NULL);
    ops.stream_destroy(ops.ctx, st);
    ops.free_pinned(ops.ctx, h);
    return bad;
}

typedef struct fixture {
    target t;
    transfer_engine *e;
    transfer_segment seg;
    char *dev;
    size_t len;
} fixture;

#define LOCAL (64u << 20)

static int setup_proto(void **state, transfer_protocol proto) {
    fixture *f = calloc(1, sizeof *f);
    if (target_start(&f->t, 1024)) return -1; /* 2 x 64 blocks: 117 MB */
    transfer_config c;
    transfer_config_init(&c);
    c.local_hostname = "127.0.0.1";
    c.protocol = proto;
    c.timeout_base_ns = 10 * NS;
    f->len = LOCAL;
    f->dev = api->alloc(0, f->len);
    if (!f->dev || transfer_engine_create(&c, &f->e) ||
        transfer_engine_set_device_ops(f->e, &ops) ||
        transfer_register(f->e, f->dev, f->len, "cuda:0") ||
        transfer_open_segment(f->e, f->t.segment, &f->seg))
        return -1;
    *state = f;
    return 0;
}
static int setup_ipc(void **state) {
    return setup_proto(state, TRANSFER_PROTO_AUTO);
}
static int setup_tcp(void **state) {
    return setup_proto(state, TRANSFER_PROTO_TCP);
}
static int teardown(void **state) {
    fixture *f = *state;
    transfer_engine_destroy(f->e);
    api->free(0, f->dev);
    target_stop(&f->t);
    free(f);
    return 0;
}

static int run(fixture *f, const transfer_request *r, size_t n, unsigned *via) {
    transfer_batch b;
    assert_int_equal(transfer_batch_alloc(f->e, n, &b), 0);
    int rc = transfer_batch_submit(f->e, b, r, n);
    if (rc == 0) rc = transfer_batch_wait(f->e, b, 30 * NS);
    transfer_status st;
    if (via && transfer_batch_get_overall(f->e, b, &st) == 0) *via = st.transports;
    assert_int_equal(transfer_batch_free(f->e, b), 0);
    return rc;
}

/* Write local [lo, +len) to the target at ro, check it there; read it back to lo2. */
static void roundtrip(fixture *f, size_t lo, size_t ro, size_t len, size_t lo2, uint64_t seed,
                      unsigned want_via) {
    dev_fill(f->dev + lo, len, lo, seed);
    unsigned via = 0;
    transfer_request w = {TRANSFER_WRITE, f->dev + lo, f->seg, f->t.dev + ro, len};
    assert_int_equal(run(f, &w, 1, &via), 0);
    assert_int_equal(via, want_via);
    assert_int_equal(target_check(&f->t, ro, len, lo, seed), 0);
    transfer_request r = {TRANSFER_READ, f->dev + lo2, f->seg, f->t.dev + ro, len};
    assert_int_equal(run(f, &r, 1, &via), 0);
    assert_int_equal(via, want_via);
    assert_int_equal(dev_bad(f->dev + lo2, len, lo, seed), 0);
}

static void test_ipc_bytes(void **state) {
    fixture *f = *state;
    int maps0 = api->open_mappings();
    static const size_t sizes[] = {1, 4099, (1u << 20) + 7, (5u << 20) + 3, 20u << 20};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
        roundtrip(f, 13 + k, 4097 + 31 * k, sizes[k], (32u << 20) + 5 + k, 0x1000 + k,
                  1u << TRANSFER_PROTO_CUDA_IPC);
    assert_int_equal(api->open_mappings(), maps0 + 1); /* mapped once */
    transfer_segment_info info;
    assert_int_equal(transfer_segment_get_info(f->e, f->seg, &info), 0);
    printf("  cuda_ipc: %zu sizes both ways, 1 B .. 20 MiB at odd offsets, verified; one mapping\n",
           sizeof sizes / sizeof sizes[0]);
    assert_int_equal(transfer_close_segment(f->e, f->seg), 0);
    assert_int_equal(api->open_mappings(), maps0); /* closing unmaps */
}

static void test_ipc_coalesce(void **state) {
    fixture *f = *state;
    enum { N = 32 };
    transfer_request reqs[N];
    size_t off = 0;
    for (int i = 0; i < N; i++) {
        size_t len = 1000 + (size_t)i * 7919 % 50000;
        reqs[i] =
            (transfer_request){TRANSFER_WRITE, f->dev + 3 + off, f->seg, f->t.dev + 11 + off, len};
        off += len;
    }
    dev_fill(f->dev + 3, off, 3, 0x2222);
    uint64_t c0 = api->d2d_copies();
    assert_int_equal(run(f, reqs, N, NULL), 0);
    assert_int_equal(api->d2d_copies() - c0, 1);
    assert_int_equal(target_check(&f->t, 11, off, 3, 0x2222), 0);
    transfer_request scat[3] = {reqs[0], reqs[5], reqs[9]};
    dev_fill(f->dev + 3, off, 3, 0x4444); /* new bytes: the scattered copies must move them */
    c0 = api->d2d_copies();
    assert_int_equal(run(f, scat, 3, NULL), 0);
    /* one gather/scatter kernel launch (DISAGG_CUDA_BATCH_COPY=each: three copies) */
    const char *mode = getenv("DISAGG_CUDA_BATCH_COPY");
    int each = mode && !strcmp(mode, "each");
    assert_int_equal(api->d2d_copies() - c0, each ? 3 : 1);
    for (int k = 0; k < 3; k++)
        assert_int_equal(target_check(&f->t, scat[k].remote_addr - f->t.dev, scat[k].length,
                                      (uint64_t)((char *)scat[k].local - (char *)f->dev), 0x4444),
                         0);
    printf("  cuda_ipc: 32 contiguous requests (%zu bytes) = 1 copy, 3 scattered = %d device "
           "operation(s)\n",
           off, each ? 3 : 1);
}

static void test_ipc_out_of_range(void **state) {
    fixture *f = *state;
    uint64_t c0 = api->d2d_copies();
    transfer_request beyond = {TRANSFER_WRITE, f->dev, f->seg, f->t.dev + f->t.length - 100, 200};
    int rc = run(f, &beyond, 1, NULL);
    assert_int_equal(rc, TRANSFER_EREMOTEADDR);
    transfer_request before = {TRANSFER_READ, f->dev, f->seg, f->t.dev - 4096, 100};
    rc = run(f, &before, 1, NULL);
    assert_int_not_equal(rc, 0);
    assert_int_equal(api->d2d_copies(), c0);
    /* a good one still works */
    roundtrip(f, 0, 0, 4096, 1 << 20, 0x3333, 1u << TRANSFER_PROTO_CUDA_IPC);
}

typedef struct writer {
    transfer_engine *e;
    transfer_segment seg;
    char *src;
    uint64_t dst;
    size_t len;
    int ok, rc;
    _Atomic int started;
} writer;

static void *writer_main(void *arg) {
    writer *w = arg;
    uint64_t end = now_ns() + 20 * NS;
    while (now_ns() < end) {
        transfer_request r = {TRANSFER_WRITE, w->src, w->seg, w->dst, w->len};
        transfer_batch b;
        if (transfer_batch_alloc(w->e, 1, &b)) break;
        int rc = transfer_batch_submit(w->e, b, &r, 1);
        if (rc == 0) rc = transfer_batch_wait(w->e, b, 30 * NS);
        transfer_batch_free(w->e, b);
        if (rc) {
            w->rc = rc;
            break;
        }
        w->ok++;
        w->started = 1;
    }
    return NULL;
}

static void test_ipc_peer_killed(void **state) {
    fixture *f = *state;
    size_t free0, total, free1, free2;
    assert_int_equal(api->mem_info(0, &free0, &total), 0);
    target big;
    assert_int_equal(target_start(&big, 8192), 0); /* 2 x 512 blocks: 940 MB */
    assert_int_equal(api->mem_info(0, &free1, &total), 0);
    transfer_segment seg;
    assert_int_equal(transfer_open_segment(f->e, big.segment, &seg), 0);
    int maps0 = api->open_mappings();
    writer w = {f->e, seg, f->dev, big.dev, f->len, 0, 0, 0};
    pthread_t th;
    pthread_create(&th, NULL, writer_main, &w);
    while (!w.started && !w.rc)
        usleep(1000);
    usleep(100000);
    assert_int_equal(api->open_mappings(), maps0 + 1);
    uint64_t t0 = now_ns();
    kill(big.pid, SIGKILL);
    waitpid(big.pid, NULL, 0);
    pthread_join(th, NULL);
    double ended_ms = (double)(now_ns() - t0) / 1e6;
    fclose(big.in);
    fclose(big.out);
    printf("  cuda_ipc: target killed after %d writes of %zu MiB; the writer ended %.1f ms later "
           "with %s\n",
           w.ok, f->len >> 20, ended_ms, transfer_strerror(w.rc));
    assert_int_equal(w.rc, TRANSFER_ECONN);
    assert_true(ended_ms < 10000);                 /* liveness bound, generous */
    assert_int_equal(api->open_mappings(), maps0); /* the mapping was released */
    /* and the dead target's memory came back (our mapping no longer holds it) */
    for (int i = 0; i < 50; i++) {
        assert_int_equal(api->mem_info(0, &free2, &total), 0);
        if (free2 >= free1 + big.length * 9 / 10) break;
        usleep(100000);
    }
    printf("  device memory free: %.0f MB before the target, %.0f with it, %.0f after it died "
           "and the mapping was released\n",
           free0 / 1e6, free1 / 1e6, free2 / 1e6);
    assert_true(free2 >= free1 + big.length * 9 / 10);
    /* the engine goes on with the live peer */
    roundtrip(f, 0, 0, 1 << 20, 2 << 20, 0x4444, 1u << TRANSFER_PROTO_CUDA_IPC);
    transfer_close_segment(f->e, seg);
}

static void test_staged_tcp(void **state) {
    fixture *f = *state;
    transfer_device_stats s0, s1;
    transfer_engine_get_device_stats(f->e, &s0);
    uint64_t c0 = api->d2d_copies();
    roundtrip(f, 7, 4099, 1, 1 << 20, 0x5550, 1u << TRANSFER_PROTO_TCP);
    roundtrip(f, 9, 8191, (7u << 20) + 5, 16u << 20, 0x5551, 1u << TRANSFER_PROTO_TCP);
    roundtrip(f, 1, 3, 30u << 20, 31u << 20, 0x5552, 1u << TRANSFER_PROTO_TCP);
    transfer_engine_get_device_stats(f->e, &s1);
    assert_int_equal(api->d2d_copies(), c0); /* no cuda_ipc */
    uint64_t n = 1 + (7u << 20) + 5 + (30u << 20);
    assert_int_equal(s1.staged_bytes_out - s0.staged_bytes_out, n);
    assert_int_equal(s1.staged_bytes_in - s0.staged_bytes_in, n);
    transfer_request beyond = {TRANSFER_WRITE, f->dev, f->seg, f->t.dev + f->t.length - 100, 200};
    assert_int_equal(run(f, &beyond, 1, NULL), TRANSFER_EREMOTEADDR);
    printf("  staged tcp: 1 B, 7 MiB, 30 MiB both ways, device memory on both sides, verified; "
           "%llu bytes staged each way\n",
           (unsigned long long)n);
}

static void test_dmabuf(void **state) {
    fixture *f = *state;
    int fd = -1;
    uint64_t off = 0;
    int rc = ops.get_dmabuf(ops.ctx, f->dev + 4096, 1 << 20, &fd, &off);
    if (rc == 0) {
        off_t sz = lseek(fd, 0, SEEK_END);
        printf("  dma-buf: cuMemGetHandleForAddressRange gave fd %d of %lld bytes (offset %llu)\n",
               fd, (long long)sz, (unsigned long long)off);
        assert_true(sz >= (off_t)(1 << 20));
        close(fd);
    } else {
        printf("  dma-buf: cuMemGetHandleForAddressRange is not available here (%d)\n", rc);
        assert_int_equal(rc, -ENOTSUP);
    }
}

int main(void) {
    char err[512] = "";
    api = cuda_transfer_load(err, sizeof err);
    if (api && api->device_ops(0, &ops, err, sizeof err)) api = NULL;
    if (!api) {
        printf("******** SKIP test_gpu_transfer: needs a CUDA GPU and the CUDA module: %s "
               "********\n",
               err);
        return 77;
    }
    const char *bin = getenv("DISAGG_BIN");
    if (bin && *bin) {
        snprintf(disagg_bin, sizeof disagg_bin, "%s", bin);
    } else {
        char exe[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        exe[n > 0 ? n : 0] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) *slash = 0;
        snprintf(disagg_bin, sizeof disagg_bin, "%s/disagg", exe);
    }
    setvbuf(stdout, NULL, _IONBF, 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_ipc_bytes, setup_ipc, teardown),
        cmocka_unit_test_setup_teardown(test_ipc_coalesce, setup_ipc, teardown),
        cmocka_unit_test_setup_teardown(test_ipc_out_of_range, setup_ipc, teardown),
        cmocka_unit_test_setup_teardown(test_ipc_peer_killed, setup_ipc, teardown),
        cmocka_unit_test_setup_teardown(test_staged_tcp, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_dmabuf, setup_ipc, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
