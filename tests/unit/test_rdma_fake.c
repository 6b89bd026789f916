/* Unit tests: the rdma transport above the verbs calls, over the in-memory
 * fake verbs layer (fake_verbs.h): two engines in this process, real
 * handshake sockets for the descriptor and the queue-pair exchange, one-sided
 * WRITE / READ that really move bytes, striping over NICs, selective
 * signaling, a failed NIC's requests retried on the other, the tcp fallback
 * when there is no NIC, GPU-memory registration (peermem / DMA-BUF), and the
 * completion poller sleeping on the fake's completion channels (an idle
 * transport, or one waiting on slow completions, does not poll). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/clock.h"
#include "disagg/transfer.h"
#include "base/net.h"
#include "fake_verbs.h"
#include "transfer/handshake.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define BUF (8u << 20)

typedef struct fixture {
    transfer_engine *target, *init;
    uint8_t *tmem, *imem;
    transfer_segment seg;
} fixture;

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint64_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static void fill(uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)rnd();
}

static void cfg_rdma(transfer_config *c, const char *nics) {
    transfer_config_init(c);
    c->local_hostname = "127.0.0.1";
    c->protocol = TRANSFER_PROTO_RDMA;
    c->device_name = nics;
    c->timeout_base_ns = 5 * NS_PER_S;
    c->connect_timeout_ns = NS_PER_S;
}

static int make(fixture *f, int nnics, const char *tnics, const char *inics, int target_rdma) {
    fv_reset(nnics);
    rdma_verbs_override(&FAKE_VERBS);
    transfer_config c;
    cfg_rdma(&c, tnics);
    if (!target_rdma) c.protocol = TRANSFER_PROTO_TCP, c.device_name = NULL;
    if (transfer_engine_create(&c, &f->target)) return -1;
    cfg_rdma(&c, inics);
    if (transfer_engine_create(&c, &f->init)) return -1;
    f->tmem = aligned_alloc(4096, BUF);
    f->imem = aligned_alloc(4096, BUF);
    fill(f->tmem, BUF);
    if (transfer_register(f->target, f->tmem, BUF, "cpu") ||
        transfer_register(f->init, f->imem, BUF, "cpu"))
        return -1;
    return transfer_open_segment(f->init, transfer_engine_segment_name(f->target), &f->seg);
}

static int setup2(void **state) {
    fixture *f = calloc(1, sizeof *f);
    *state = f;
    return make(f, 2, "", "", 1);
}

static int teardown(void **state) {
    fixture *f = *state;
    transfer_engine_destroy(f->init);
    transfer_engine_destroy(f->target);
    free(f->tmem);
    free(f->imem);
    free(f);
    assert_int_equal(atomic_load(&fv.open_qps), 0);
    assert_int_equal(atomic_load(&fv.open_mrs), 0);
    assert_int_equal(atomic_load(&fv.open_nics), 0);
    rdma_verbs_override(NULL);
    return 0;
}

static int run(fixture *f, const transfer_request *r, size_t n) {
    transfer_batch b;
    assert_int_equal(transfer_batch_alloc(f->init, n, &b), 0);
    assert_int_equal(transfer_batch_submit(f->init, b, r, n), 0);
    int rc = transfer_batch_wait(f->init, b, 20 * NS_PER_S);
    assert_int_equal(transfer_batch_free(f->init, b), 0);
    return rc;
}

static uint64_t raddr(fixture *f, size_t off) {
    return (uint64_t)(uintptr_t)(f->tmem + off);
}

static void test_roundtrip_striped(void **state) {
    fixture *f = *state;
    transfer_segment_info info;
    assert_int_equal(transfer_segment_get_info(f->init, f->seg, &info), 0);
    assert_int_equal(info.protocol, TRANSFER_PROTO_RDMA);
    transfer_stats t0;
    transfer_engine_get_stats(f->target, &t0);
    static const size_t sizes[] = {1, 13, 4096, 65537, (1u << 20) + 3, (3u << 20) + 999};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        size_t len = sizes[s], lo = rnd() % 1000, ro = rnd() % 1000;
        fill(f->imem + lo, len);
        transfer_request w = {TRANSFER_WRITE, f->imem + lo, f->seg, raddr(f, ro), len};
        assert_int_equal(run(f, &w, 1), 0);
        assert_memory_equal(f->tmem + ro, f->imem + lo, len);
        memset(f->imem + (4u << 20), 0, len);
        transfer_request r = {TRANSFER_READ, f->imem + (4u << 20), f->seg, raddr(f, ro), len};
        assert_int_equal(run(f, &r, 1), 0);
        assert_memory_equal(f->imem + (4u << 20), f->tmem + ro, len);
    }
    /* One-sided: the target's tcp server moved nothing. */
    transfer_stats t1;
    transfer_engine_get_stats(f->target, &t1);
    assert_int_equal(t1.bytes_served, t0.bytes_served);
    /* Striped over both NICs, and most work requests unsignaled. */
    uint64_t w0 = atomic_load(&fv.nics[0].wrs), w1 = atomic_load(&fv.nics[1].wrs);
    uint64_t s0 = atomic_load(&fv.nics[0].signaled), s1 = atomic_load(&fv.nics[1].signaled);
    assert_true(w0 > 0 && w1 > 0);
    assert_true(s0 + s1 > 0 && s0 + s1 < w0 + w1);
}

/* Many small requests in one batch: selective signaling retires unsignaled
 * ones through a later signaled completion. */
static void test_selective_signaling(void **state) {
    fixture *f = *state;
    enum { N = 200 };
    transfer_request reqs[N];
    fill(f->imem, N * 1000);
    for (int i = 0; i < N; i++)
        reqs[i] = (transfer_request){TRANSFER_WRITE, f->imem + i * 1000, f->seg,
                                     raddr(f, 100 + (size_t)i * 1000), 1000};
    uint64_t w = atomic_load(&fv.nics[0].wrs) + atomic_load(&fv.nics[1].wrs);
    uint64_t s = atomic_load(&fv.nics[0].signaled) + atomic_load(&fv.nics[1].signaled);
    assert_int_equal(run(f, reqs, N), 0);
    assert_memory_equal(f->tmem + 100, f->imem, N * 1000);
    uint64_t dw = atomic_load(&fv.nics[0].wrs) + atomic_load(&fv.nics[1].wrs) - w;
    uint64_t ds = atomic_load(&fv.nics[0].signaled) + atomic_load(&fv.nics[1].signaled) - s;
    assert_int_equal(dw, N);
    assert_true(ds >= 2 && ds <= N / 4);
}

/* A NIC fails: its requests complete with errors and are retried on the
 * other NIC; every byte arrives; later requests avoid the failed one. */
static void test_nic_failover(void **state) {
    fixture *f = *state;
    atomic_store(&fv.nics[0].failed, 1);
    size_t len = 5u << 20;
    fill(f->imem, len);
    transfer_request w = {TRANSFER_WRITE, f->imem, f->seg, raddr(f, 7), len};
    assert_int_equal(run(f, &w, 1), 0);
    assert_memory_equal(f->tmem + 7, f->imem, len);
    transfer_stats st;
    transfer_engine_get_stats(f->init, &st);
    assert_true(st.path_retries > 0);
    uint64_t b1 = atomic_load(&fv.nics[1].bytes);
    assert_true(b1 >= len - (256u << 10) * 2);
    uint64_t w0 = atomic_load(&fv.nics[0].wrs);
    fill(f->imem, 100000);
    transfer_request w2 = {TRANSFER_WRITE, f->imem, f->seg, raddr(f, 0), 100000};
    assert_int_equal(run(f, &w2, 1), 0);
    assert_memory_equal(f->tmem, f->imem, 100000);
    assert_int_equal(atomic_load(&fv.nics[0].wrs), w0); /* the dead QP is not used again */
    /* Both gone: requests fail, nothing hangs. */
    atomic_store(&fv.nics[1].failed, 1);
    assert_int_equal(run(f, &w2, 1), TRANSFER_ECONN);
}

/* The poller sleeps on the completion channels: idle (nothing in flight),
 * and while work is in flight but its completions are held back (a slow
 * NIC), it does not poll; released, the completions wake it and the batch
 * completes.  Before completion channels it polled every 20 µs while work
 * was in flight (~50000 polls a second) and woke 10 times a second idle. */
static void test_idle_no_wakeups(void **state) {
    fixture *f = *state;
    fill(f->imem, 100000);
    transfer_request w = {TRANSFER_WRITE, f->imem, f->seg, raddr(f, 0), 100000};
    assert_int_equal(run(f, &w, 1), 0); /* connected */
    /* let the poller settle: the last completions' events (both NICs) may still be handled
     * after run() returns, later on a loaded machine; wait until 200 ms pass without a poll
     * or an arm (at most 5 s), then count what an idle second costs */
    for (int i = 0; i < 25; i++) {
        uint64_t p = atomic_load(&fv.polls), a = atomic_load(&fv.arms);
        nanosleep(&(struct timespec){0, 200000000}, NULL);
        if (atomic_load(&fv.polls) == p && atomic_load(&fv.arms) == a) break;
    }
    struct timespec sec = {1, 0};
    uint64_t p0 = atomic_load(&fv.polls), a0 = atomic_load(&fv.arms);
    nanosleep(&sec, NULL);
    uint64_t idle_polls = atomic_load(&fv.polls) - p0, idle_arms = atomic_load(&fv.arms) - a0;
    print_message("idle 1 s: %llu polls, %llu arms\n", (unsigned long long)idle_polls,
                  (unsigned long long)idle_arms);
    assert_int_equal(idle_polls, 0);
    assert_int_equal(idle_arms, 0);

    fv_hold(0, 1);
    fv_hold(1, 1);
    size_t len = 3u << 20;
    fill(f->imem, len);
    transfer_request big = {TRANSFER_WRITE, f->imem, f->seg, raddr(f, 5), len};
    transfer_batch b;
    assert_int_equal(transfer_batch_alloc(f->init, 1, &b), 0);
    assert_int_equal(transfer_batch_submit(f->init, b, &big, 1), 0);
    nanosleep(&(struct timespec){0, 100000000}, NULL); /* posted (a worker thread) */
    p0 = atomic_load(&fv.polls);
    nanosleep(&sec, NULL);
    uint64_t held_polls = atomic_load(&fv.polls) - p0;
    print_message("in flight, completions held 1 s: %llu polls\n", (unsigned long long)held_polls);
    assert_true(held_polls < 20); /* the worker's own posting polls nothing; ~0 */
    transfer_status st;
    assert_int_equal(transfer_batch_get_status(f->init, b, 0, &st), 0);
    assert_int_equal(st.state, TRANSFER_STATE_PENDING);
    fv_hold(0, 0);
    fv_hold(1, 0);
    assert_int_equal(transfer_batch_wait(f->init, b, 20 * NS_PER_S), 0);
    assert_int_equal(transfer_batch_free(f->init, b), 0);
    assert_memory_equal(f->tmem + 5, f->imem, len);
    assert_true(atomic_load(&fv.events) > 0);
}

/* Under load: many batches back to back over both NICs, each completing
 * through the event path (a lost wakeup fails the wait's deadline). */
static void test_events_under_load(void **state) {
    fixture *f = *state;
    for (int it = 0; it < 50; it++) {
        size_t len = 1 + rnd() % (1u << 20), lo = rnd() % 4096, ro = rnd() % 4096;
        fill(f->imem + lo, len);
        transfer_request w = {TRANSFER_WRITE, f->imem + lo, f->seg, raddr(f, ro), len};
        assert_int_equal(run(f, &w, 1), 0);
        assert_memory_equal(f->tmem + ro, f->imem + lo, len);
    }
}

/* A range outside the target's buffers never reaches a NIC. */
static void test_remote_rejected(void **state) {
    fixture *f = *state;
    transfer_request w = {TRANSFER_WRITE, f->imem, f->seg, raddr(f, BUF - 10), 100};
    assert_int_equal(run(f, &w, 1), TRANSFER_EREMOTEADDR);
}

/* device_name whitelists NICs: only fake1 carries traffic; an unknown NIC
 * fails engine creation. */
static void test_whitelist(void **state) {
    fixture *f = calloc(1, sizeof *f);
    *state = f;
    assert_int_equal(make(f, 2, "fake1", "fake1", 1), 0);
    fill(f->imem, 3u << 20);
    transfer_request w = {TRANSFER_WRITE, f->imem, f->seg, raddr(f, 0), 3u << 20};
    assert_int_equal(run(f, &w, 1), 0);
    assert_memory_equal(f->tmem, f->imem, 3u << 20);
    assert_int_equal(atomic_load(&fv.nics[0].wrs), 0);
    assert_true(atomic_load(&fv.nics[1].wrs) > 0);
    assert_int_equal(transfer_rdma_device_count(), 2);
    transfer_config c;
    cfg_rdma(&c, "fake1,mlx5_9");
    transfer_engine *e = NULL;
    assert_int_equal(transfer_engine_create(&c, &e), TRANSFER_EINVAL);
}

/* "rdma" requested, no NIC: tcp with a warning, transfers work.  A tcp-only
 * peer is reached over tcp too. */
static void test_no_nic_fallback(void **state) {
    fixture *f = calloc(1, sizeof *f);
    *state = f;
    assert_int_equal(make(f, 0, "", "", 1), 0);
    assert_int_equal(transfer_rdma_device_count(), 0);
    transfer_segment_info info;
    assert_int_equal(transfer_segment_get_info(f->init, f->seg, &info), 0);
    assert_int_equal(info.protocol, TRANSFER_PROTO_TCP);
    fill(f->imem, 70000);
    transfer_request w = {TRANSFER_WRITE, f->imem, f->seg, raddr(f, 3), 70000};
    assert_int_equal(run(f, &w, 1), 0);
    assert_memory_equal(f->tmem + 3, f->imem, 70000);
}

static void test_tcp_only_peer(void **state) {
    fixture *f = calloc(1, sizeof *f);
    *state = f;
    assert_int_equal(make(f, 2, "", "", 0), 0);
    transfer_segment_info info;
    assert_int_equal(transfer_segment_get_info(f->init, f->seg, &info), 0);
    assert_int_equal(info.protocol, TRANSFER_PROTO_TCP);
    fill(f->imem, 70000);
    transfer_request w = {TRANSFER_WRITE, f->imem, f->seg, raddr(f, 3), 70000};
    assert_int_equal(run(f, &w, 1), 0);
    assert_memory_equal(f->tmem + 3, f->imem, 70000);
}

/* GPU memory: without peermem reg_mr fails (Bad address) and the
 * registration fails; WITH_NVIDIA_PEERMEM=0 registers it via DMA-BUF from
 * the device-ops table, and rdma moves bytes into it. */
static int dmabuf_calls;
static int f_get_dmabuf(void *ctx, const void *dev, size_t len, int *fd, uint64_t *off) {
    (void)ctx;
    (void)dev;
    (void)len;
    dmabuf_calls++;
    *fd = dup(2); /* any descriptor stands for the DMA-BUF (rdma closes it) */
    *off = 0;
    return *fd >= 0 ? 0 : -1;
}
static int s_create(void *c, int d, void **s) {
    (void)c;
    (void)d;
    *s = malloc(1);
    return 0;
}
static void s_destroy(void *c, void *s) {
    (void)c;
    free(s);
}
static int cp(void *c, void *s, void *a, const void *b, size_t n) {
    (void)c;
    (void)s;
    memcpy(a, b, n);
    return 0;
}
static int cp2(void *c, void *s, void *a, const void *b, size_t n) {
    return cp(c, s, a, b, n);
}
static int syn(void *c, void *s) {
    (void)c;
    (void)s;
    return 0;
}
static void *pin(void *c, size_t n) {
    (void)c;
    return malloc(n);
}
static void unpin(void *c, void *p) {
    (void)c;
    free(p);
}

static void test_gpu_registration(void **state) {
    fixture *f = *state;
    transfer_device_ops ops = {.copy_to_host = cp,
                               .copy_from_host = cp2,
                               .stream_create = s_create,
                               .stream_destroy = s_destroy,
                               .sync = syn,
                               .alloc_pinned = pin,
                               .free_pinned = unpin,
                               .get_dmabuf = f_get_dmabuf};
    assert_int_equal(transfer_engine_set_device_ops(f->target, &ops), 0);
    size_t len = 1u << 20;
    uint8_t *gpu = aligned_alloc(4096, len); /* stands for device memory */
    fv.dev_lo = (uintptr_t)gpu;
    fv.dev_hi = (uintptr_t)gpu + len;
    fv.peermem = 0;
    unsetenv("WITH_NVIDIA_PEERMEM"); /* default 1: reg_mr on the device pointer */
    assert_int_equal(transfer_register(f->target, gpu, len, "cuda:0"), TRANSFER_ESYS);
    setenv("WITH_NVIDIA_PEERMEM", "0", 1);
    int before = atomic_load(&fv.dmabuf_regs);
    assert_int_equal(transfer_register(f->target, gpu, len, "cuda:0"), 0);
    assert_int_equal(atomic_load(&fv.dmabuf_regs) - before, 2); /* one per NIC */
    assert_int_equal(dmabuf_calls, 1);
    unsetenv("WITH_NVIDIA_PEERMEM");
    fill(f->imem, 5000);
    transfer_request w = {TRANSFER_WRITE, f->imem, f->seg, (uint64_t)(uintptr_t)gpu + 11, 5000};
    assert_int_equal(run(f, &w, 1), 0); /* descriptor re-fetched on the miss */
    assert_memory_equal(gpu + 11, f->imem, 5000);
    assert_int_equal(transfer_unregister(f->target, gpu), 0);
    free(gpu);
}

/* A secret: the queue-pair handshake (type 0) runs after the challenge-response on the
 * same connection, so an authenticated pair uses rdma; a peer with another secret is
 * refused (EAUTH), and a bare type-0 frame (no challenge) gets an authentication error and
 * no queue pair. */
static void test_secret_rdma(void **state) {
    (void)state;
    fv_reset(2);
    rdma_verbs_override(&FAKE_VERBS);
    transfer_config c;
    cfg_rdma(&c, "");
    c.auth_secret = "s3cret";
    transfer_engine *a, *b, *x;
    assert_int_equal(transfer_engine_create(&c, &a), 0);
    assert_int_equal(transfer_engine_create(&c, &b), 0);
    uint8_t *am = aligned_alloc(4096, 1 << 20), *bm = aligned_alloc(4096, 1 << 20);
    fill(am, 1 << 20);
    assert_int_equal(transfer_register(a, am, 1 << 20, "cpu"), 0);
    assert_int_equal(transfer_register(b, bm, 1 << 20, "cpu"), 0);
    transfer_segment seg;
    assert_int_equal(transfer_open_segment(b, transfer_engine_segment_name(a), &seg), 0);
    transfer_segment_info info;
    assert_int_equal(transfer_segment_get_info(b, seg, &info), 0);
    assert_int_equal(info.protocol, TRANSFER_PROTO_RDMA);
    uint64_t w0 = atomic_load(&fv.nics[0].wrs) + atomic_load(&fv.nics[1].wrs);
    void *dst = bm + 7;
    uint64_t src = (uint64_t)(uintptr_t)(am + 3);
    size_t len = 700000;
    assert_int_equal(transfer_sync_read(b, transfer_engine_segment_name(a), &dst, &src, &len, 1),
                     0);
    assert_memory_equal(bm + 7, am + 3, len);
    assert_true(atomic_load(&fv.nics[0].wrs) + atomic_load(&fv.nics[1].wrs) > w0); /* on the NICs */
    unsigned via = 0;
    void *wsrc = bm;
    uint64_t wdst = (uint64_t)(uintptr_t)(am + 100);
    len = 5000;
    assert_int_equal(
        transfer_sync_write_via(b, transfer_engine_segment_name(a), &wsrc, &wdst, &len, 1, &via),
        0);
    assert_int_equal(via, 1u << TRANSFER_PROTO_RDMA);
    assert_memory_equal(am + 100, bm, 5000);

    /* another secret: refused before any queue pair */
    c.auth_secret = "other";
    assert_int_equal(transfer_engine_create(&c, &x), 0);
    assert_int_equal(transfer_open_segment(x, transfer_engine_segment_name(a), &seg),
                     TRANSFER_EAUTH);
    transfer_engine_destroy(x);

    /* a bare connect frame (no challenge): refused with an authentication error */
    net_addr ha;
    char host[64];
    uint16_t port;
    assert_int_equal(
        net_split_host_port(transfer_engine_segment_name(a), host, sizeof host, &port, 0), 0);
    assert_int_equal(net_resolve(host, port, &ha), 0);
    char *reply = NULL, err[256] = "";
    size_t rl = 0;
    int qps = atomic_load(&fv.open_qps);
    int rc = handshake_connect(&ha, NULL, NULL, NULL,
                               "{\"local_nic_path\":\"x@fake0\",\"peer_nic_path\":\"y@fake0\","
                               "\"qp_num\":[1],\"reply_msg\":\"\"}",
                               clock_now_ns() + NS_PER_S, &reply, &rl, err, sizeof err);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(err, "authentication required"));
    assert_int_equal(atomic_load(&fv.open_qps), qps);
    free(reply);

    transfer_engine_destroy(b);
    transfer_engine_destroy(a);
    free(am);
    free(bm);
    assert_int_equal(atomic_load(&fv.open_nics), 0);
    rdma_verbs_override(NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_roundtrip_striped, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_selective_signaling, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_nic_failover, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_remote_rejected, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_idle_no_wakeups, setup2, teardown),
        cmocka_unit_test_setup_teardown(test_events_under_load, setup2, teardown),
        cmocka_unit_test_teardown(test_whitelist, teardown),
        cmocka_unit_test_teardown(test_no_nic_fallback, teardown),
        cmocka_unit_test_teardown(test_tcp_only_peer, teardown),
        cmocka_unit_test_setup_teardown(test_gpu_registration, setup2, teardown),
        cmocka_unit_test(test_secret_rdma),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
