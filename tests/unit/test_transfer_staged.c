/* Unit tests: tcp with device memory through pinned staging buffers, and the
 * engine's choice of transport per request.  "Device memory" is a fake
 * device behind a real transfer_device_ops table: its addresses are a
 * PROT_NONE reservation (any direct access by the transfer layer crashes the
 * test), its bytes live in a host backing store, and its copies are queued
 * per stream and only performed at sync() — so a missing sync, a copy into
 * the wrong slot or a slot reused too early delivers wrong bytes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/clock.h"
#include "disagg/transfer.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#define DEVBUF (24u << 20)

/* ---- the fake device ----------------------------------------------------- */

/* Every fake device region and cuda_ipc alias, so that a device-to-device
 * copy can translate both ends. */
typedef struct fake_region {
    char *va, *back;
    size_t size;
} fake_region;
static fake_region regions[8];
static pthread_mutex_t regions_mu = PTHREAD_MUTEX_INITIALIZER;

static void region_add(char *va, char *back, size_t size) {
    pthread_mutex_lock(&regions_mu);
    for (int i = 0; i < 8; i++)
        if (!regions[i].va) {
            regions[i] = (fake_region){va, back, size};
            break;
        }
    pthread_mutex_unlock(&regions_mu);
}
static void region_del(char *va) {
    pthread_mutex_lock(&regions_mu);
    for (int i = 0; i < 8; i++)
        if (regions[i].va == va) regions[i].va = NULL;
    pthread_mutex_unlock(&regions_mu);
}
static char *translate_any(uintptr_t p, size_t len) {
    char *r = NULL;
    pthread_mutex_lock(&regions_mu);
    for (int i = 0; i < 8 && !r; i++)
        if (regions[i].va && p >= (uintptr_t)regions[i].va &&
            p + len <= (uintptr_t)regions[i].va + regions[i].size)
            r = regions[i].back + (p - (uintptr_t)regions[i].va);
    pthread_mutex_unlock(&regions_mu);
    return r;
}

typedef struct copy_job {
    int to_host; /* 1 to host, 0 from host, 2 device to device (host = dst) */
    void *host;
    uintptr_t dev;
    size_t len;
} copy_job;

typedef struct fake_stream {
    struct fake_dev *d;
    int device;
    copy_job q[64];
    int n;
} fake_stream;

typedef struct fake_dev {
    char *va;   /* PROT_NONE: the addresses registered as "cuda:0" */
    char *back; /* where the bytes are */
    size_t size;
    atomic_int fail_copies; /* > 0: the next copy fails */
    _Atomic uint64_t to_host, from_host, bytes_to_host, bytes_from_host, syncs;
    atomic_int pinned_live, streams_live, max_queued;
    _Atomic uint64_t d2d, bytes_d2d;
    _Atomic uint64_t batches; /* copy_device_batch calls */
    atomic_int exports, opens, closes;
} fake_dev;

static char *translate(fake_dev *d, uintptr_t dev, size_t len) {
    uintptr_t base = (uintptr_t)d->va;
    if (dev < base || dev + len > base + d->size) return NULL;
    return d->back + (dev - base);
}

static int f_stream_create(void *ctx, int device, void **out) {
    fake_stream *s = calloc(1, sizeof *s);
    if (!s) return -1;
    s->d = ctx;
    s->device = device;
    atomic_fetch_add(&s->d->streams_live, 1);
    *out = s;
    return 0;
}
static void f_stream_destroy(void *ctx, void *st) {
    fake_stream *s = st;
    assert_int_equal(s->n, 0); /* destroyed with copies never synced */
    atomic_fetch_sub(&((fake_dev *)ctx)->streams_live, 1);
    free(s);
}
static int enqueue(fake_stream *s, int to_host, void *host, uintptr_t dev, size_t len) {
    fake_dev *d = s->d;
    if (atomic_load(&d->fail_copies) > 0 && atomic_fetch_sub(&d->fail_copies, 1) > 0) return -5;
    if (!translate(d, dev, len) || s->n == 64) return -22;
    s->q[s->n++] = (copy_job){to_host, host, dev, len};
    int m = atomic_load(&d->max_queued);
    while (s->n > m && !atomic_compare_exchange_weak(&d->max_queued, &m, s->n)) {
    }
    return 0;
}
static int f_to_host(void *ctx, void *st, void *host, const void *dev, size_t len) {
    fake_dev *d = ctx;
    atomic_fetch_add(&d->to_host, 1);
    atomic_fetch_add(&d->bytes_to_host, len);
    return enqueue(st, 1, host, (uintptr_t)dev, len);
}
static int f_from_host(void *ctx, void *st, void *dev, const void *host, size_t len) {
    fake_dev *d = ctx;
    atomic_fetch_add(&d->from_host, 1);
    atomic_fetch_add(&d->bytes_from_host, len);
    return enqueue(st, 0, (void *)host, (uintptr_t)dev, len);
}
static int f_sync(void *ctx, void *st) {
    fake_dev *d = ctx;
    fake_stream *s = st;
    atomic_fetch_add(&d->syncs, 1);
    for (int i = 0; i < s->n; i++) {
        copy_job *j = &s->q[i];
        if (j->to_host == 2) {
            char *dst = translate_any((uintptr_t)j->host, j->len);
            char *src = translate_any(j->dev, j->len);
            assert_non_null(dst);
            assert_non_null(src);
            memcpy(dst, src, j->len);
            continue;
        }
        char *b = translate(d, j->dev, j->len);
        if (j->to_host)
            memcpy(j->host, b, j->len);
        else
            memcpy(b, j->host, j->len);
    }
    s->n = 0;
    return 0;
}
static void *f_alloc_pinned(void *ctx, size_t len) {
    void *p = malloc(len);
    if (p) {
        memset(p, 0xEE, len); /* stale staging bytes are visible, never zero by luck */
        atomic_fetch_add(&((fake_dev *)ctx)->pinned_live, 1);
    }
    return p;
}
static void f_free_pinned(void *ctx, void *p) {
    atomic_fetch_sub(&((fake_dev *)ctx)->pinned_live, 1);
    free(p);
}

/* cuda_ipc: the handle names the exporting region; opening it maps a new
 * alias (another PROT_NONE reservation onto the same bytes), so the
 * transport's base + offset arithmetic is checked for real. */
typedef struct fake_handle {
    uint64_t magic;
    uintptr_t va;
} fake_handle;
#define HANDLE_MAGIC 0x4650434849504331ull

static int f_ipc_export(void *ctx, const void *dev, size_t len, void *handle, size_t *hl,
                        uint64_t *off) {
    fake_dev *d = ctx;
    if (!translate(d, (uintptr_t)dev, len) || *hl < sizeof(fake_handle)) return -22;
    fake_handle h = {HANDLE_MAGIC, (uintptr_t)d->va};
    memcpy(handle, &h, sizeof h);
    *hl = sizeof h;
    *off = (uintptr_t)dev - (uintptr_t)d->va;
    atomic_fetch_add(&d->exports, 1);
    return 0;
}
static int f_ipc_open(void *ctx, int device, const void *handle, size_t hl, void **base) {
    fake_dev *d = ctx;
    fake_handle h;
    if (hl != sizeof h) return -22;
    memcpy(&h, handle, sizeof h);
    char *back = translate_any(h.va, DEVBUF);
    if (h.magic != HANDLE_MAGIC || !back || device != 0) return -22;
    char *alias = mmap(NULL, DEVBUF, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (alias == MAP_FAILED) return -12;
    region_add(alias, back, DEVBUF);
    atomic_fetch_add(&d->opens, 1);
    *base = alias;
    return 0;
}
static void f_ipc_close(void *ctx, void *base) {
    fake_dev *d = ctx;
    region_del(base);
    munmap(base, DEVBUF);
    atomic_fetch_add(&d->closes, 1);
}
static int f_copy_device(void *ctx, void *st, void *dst, const void *src, size_t len) {
    fake_dev *d = ctx;
    fake_stream *s = st;
    atomic_fetch_add(&d->d2d, 1);
    atomic_fetch_add(&d->bytes_d2d, len);
    if (!translate_any((uintptr_t)dst, len) || !translate_any((uintptr_t)src, len) || s->n == 64)
        return -22;
    s->q[s->n++] = (copy_job){2, dst, (uintptr_t)src, len};
    return 0;
}

/* A batch is its copies queued as one operation (the CUDA module: one kernel launch). */
static int f_copy_device_batch(void *ctx, void *st, void *const *dst, const void *const *src,
                               const size_t *len, size_t n) {
    fake_dev *d = ctx;
    atomic_fetch_add(&d->batches, 1);
    for (size_t i = 0; i < n; i++) {
        int rc = f_copy_device(ctx, st, dst[i], src[i], len[i]);
        if (rc) return rc;
    }
    return 0;
}

static void fake_init(fake_dev *d, transfer_device_ops *ops) {
    memset(d, 0, sizeof *d);
    d->size = DEVBUF;
    d->va = mmap(NULL, DEVBUF, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    assert_true(d->va != MAP_FAILED);
    d->back = malloc(DEVBUF);
    assert_non_null(d->back);
    region_add(d->va, d->back, DEVBUF);
    *ops = (transfer_device_ops){.ctx = d,
                                 .stream_create = f_stream_create,
                                 .stream_destroy = f_stream_destroy,
                                 .copy_to_host = f_to_host,
                                 .copy_from_host = f_from_host,
                                 .sync = f_sync,
                                 .alloc_pinned = f_alloc_pinned,
                                 .free_pinned = f_free_pinned};
}
static void fake_free(fake_dev *d) {
    assert_int_equal(atomic_load(&d->pinned_live), 0);
    assert_int_equal(atomic_load(&d->streams_live), 0);
    assert_int_equal(atomic_load(&d->opens), atomic_load(&d->closes));
    region_del(d->va);
    munmap(d->va, DEVBUF);
    free(d->back);
}

/* ---- fixture: two engines, each with a device and host memory ------------ */

typedef struct fixture {
    transfer_engine *target, *init;
    fake_dev tdev, idev;
    transfer_device_ops tops, iops;
    uint8_t *thost, *ihost;
    transfer_segment seg;
} fixture;

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static void fill_random(uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)rnd();
}

static int with_ipc;

static void add_ipc(transfer_device_ops *o) {
    o->ipc_export = f_ipc_export;
    o->ipc_open = f_ipc_open;
    o->ipc_close = f_ipc_close;
    o->copy_device = f_copy_device;
    o->copy_device_batch = f_copy_device_batch;
}

static int setup_proto(void **state, transfer_protocol proto) {
    fixture *f = calloc(1, sizeof *f);
    transfer_config c;
    transfer_config_init(&c);
    c.local_hostname = "127.0.0.1";
    c.timeout_base_ns = 5 * NS_PER_S;
    c.connect_timeout_ns = NS_PER_S;
    c.protocol = proto;
    if (transfer_engine_create(&c, &f->target) || transfer_engine_create(&c, &f->init)) return -1;
    fake_init(&f->tdev, &f->tops);
    fake_init(&f->idev, &f->iops);
    if (with_ipc) {
        add_ipc(&f->tops);
        add_ipc(&f->iops);
    }
    if (transfer_engine_set_device_ops(f->target, &f->tops) ||
        transfer_engine_set_device_ops(f->init, &f->iops))
        return -1;
    f->thost = malloc(DEVBUF);
    f->ihost = malloc(DEVBUF);
    fill_random((uint8_t *)f->tdev.back, DEVBUF);
    fill_random(f->thost, DEVBUF);
    if (transfer_register(f->target, f->tdev.va, DEVBUF, "cuda:0") ||
        transfer_register(f->target, f->thost, DEVBUF, "cpu") ||
        transfer_register(f->init, f->idev.va, DEVBUF, "cuda:0") ||
        transfer_register(f->init, f->ihost, DEVBUF, "cpu"))
        return -1;
    if (transfer_open_segment(f->init, transfer_engine_segment_name(f->target), &f->seg)) return -1;
    *state = f;
    return 0;
}
static int setup_auto(void **state) {
    with_ipc = 0;
    return setup_proto(state, TRANSFER_PROTO_AUTO);
}
static int setup_tcp(void **state) {
    with_ipc = 0;
    return setup_proto(state, TRANSFER_PROTO_TCP);
}
static int setup_ipc(void **state) {
    with_ipc = 1;
    return setup_proto(state, TRANSFER_PROTO_AUTO);
}

static int setup_ipc_tcp(void **state) {
    with_ipc = 1;
    return setup_proto(state, TRANSFER_PROTO_TCP);
}

static int teardown(void **state) {
    fixture *f = *state;
    transfer_engine_destroy(f->init);
    transfer_engine_destroy(f->target);
    fake_free(&f->tdev);
    fake_free(&f->idev);
    free(f->thost);
    free(f->ihost);
    free(f);
    return 0;
}

static int run(fixture *f, const transfer_request *r, size_t n) {
    transfer_batch b;
    assert_int_equal(transfer_batch_alloc(f->init, n, &b), 0);
    assert_int_equal(transfer_batch_submit(f->init, b, r, n), 0);
    int rc = transfer_batch_wait(f->init, b, 30 * NS_PER_S);
    assert_int_equal(transfer_batch_free(f->init, b), 0);
    return rc;
}

/* Addresses: local side (li = init device?) and remote side. */
static char *lptr(fixture *f, int dev, size_t off) {
    return dev ? f->idev.va + off : (char *)f->ihost + off;
}
static uint8_t *lbytes(fixture *f, int dev, size_t off) {
    return dev ? (uint8_t *)f->idev.back + off : f->ihost + off;
}
static uint64_t rptr(fixture *f, int dev, size_t off) {
    return (uint64_t)(uintptr_t)(dev ? f->tdev.va + off : (char *)f->thost + off);
}
static uint8_t *rbytes(fixture *f, int dev, size_t off) {
    return dev ? (uint8_t *)f->tdev.back + off : f->thost + off;
}

/* WRITE then READ back, every combination of device / host on each side,
 * sizes from 1 byte to several staging chunks, odd offsets. */
static void test_roundtrip_all_locations(void **state) {
    fixture *f = *state;
    static const size_t sizes[] = {1, 7, 4097, (1u << 20) - 3, (1u << 20) + 1, (3u << 20) + 12345};
    for (int ld = 0; ld <= 1; ld++)
        for (int rd = 0; rd <= 1; rd++)
            for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
                size_t len = sizes[s], loff = 1 + rnd() % 4096, roff = 3 + rnd() % 4096;
                fill_random(lbytes(f, ld, loff), len);
                transfer_request w = {TRANSFER_WRITE, lptr(f, ld, loff), f->seg, rptr(f, rd, roff),
                                      len};
                assert_int_equal(run(f, &w, 1), 0);
                assert_memory_equal(rbytes(f, rd, roff), lbytes(f, ld, loff), len);
                /* read it back into another local place */
                size_t boff = (6u << 20) + 5;
                memset(lbytes(f, ld, boff), 0, len);
                transfer_request r = {TRANSFER_READ, lptr(f, ld, boff), f->seg, rptr(f, rd, roff),
                                      len};
                assert_int_equal(run(f, &r, 1), 0);
                assert_memory_equal(lbytes(f, ld, boff), rbytes(f, rd, roff), len);
            }
}

/* One layer of many KV blocks: 200 strided 4 KiB pieces.  The stager packs small WRITEs into
 * one pinned slot -- all their device->host copies queued, one sync -- so the initiator syncs
 * far fewer times than there are pieces; every byte still lands where it belongs. */
static void test_small_writes_share_slots(void **state) {
    fixture *f = *state;
    enum { N = 200, PIECE = 4096, STRIDE = 3 * 4096 + 64 };
    transfer_request reqs[N];
    for (int i = 0; i < N; i++)
        reqs[i] = (transfer_request){TRANSFER_WRITE, f->idev.va + 5 + (size_t)i * STRIDE, f->seg,
                                     rptr(f, 1, 7 + (size_t)i * STRIDE), PIECE};
    fill_random((uint8_t *)f->idev.back, (size_t)N * STRIDE + 16);
    uint64_t s0 = atomic_load(&f->idev.syncs), c0 = atomic_load(&f->idev.to_host);
    assert_int_equal(run(f, reqs, N), 0);
    for (int i = 0; i < N; i++)
        assert_memory_equal(f->tdev.back + 7 + (size_t)i * STRIDE,
                            f->idev.back + 5 + (size_t)i * STRIDE, PIECE);
    uint64_t syncs = atomic_load(&f->idev.syncs) - s0;
    assert_int_equal(atomic_load(&f->idev.to_host) - c0, N); /* a copy per piece ... */
    assert_true(syncs < N / 4);                              /* ... not a sync per piece */
    printf("  %d pieces of %d bytes staged with %llu syncs\n", N, PIECE, (unsigned long long)syncs);
}

/* Many odd-sized device requests in one batch: several staged chunks in
 * flight at once; the copy counters account every byte. */
static void test_many_in_flight(void **state) {
    fixture *f = *state;
    enum { N = 24 };
    transfer_request reqs[N];
    size_t off = 0, total = 0;
    for (int i = 0; i < N; i++) {
        size_t len = 1 + rnd() % (300u << 10);
        if (i % 5 == 0) len += (1u << 20) + 17; /* some span two chunks */
        reqs[i] =
            (transfer_request){TRANSFER_WRITE, f->idev.va + off, f->seg, rptr(f, 1, off + 11), len};
        off += len + 9;
        total += len;
    }
    assert_true(off + 20 < DEVBUF / 2);
    fill_random((uint8_t *)f->idev.back, off);
    uint64_t h0 = atomic_load(&f->idev.bytes_to_host), d0 = atomic_load(&f->tdev.bytes_from_host);
    transfer_device_stats is0, ts0;
    transfer_engine_get_device_stats(f->init, &is0);
    transfer_engine_get_device_stats(f->target, &ts0);
    assert_int_equal(run(f, reqs, N), 0);
    for (int i = 0; i < N; i++)
        assert_memory_equal(f->tdev.back + (reqs[i].remote_addr - (uintptr_t)f->tdev.va),
                            f->idev.back + ((char *)reqs[i].local - f->idev.va), reqs[i].length);
    assert_int_equal(atomic_load(&f->idev.bytes_to_host) - h0, total);
    assert_int_equal(atomic_load(&f->tdev.bytes_from_host) - d0, total);
    transfer_device_stats is, ts;
    transfer_engine_get_device_stats(f->init, &is);
    transfer_engine_get_device_stats(f->target, &ts);
    assert_int_equal(is.staged_bytes_out - is0.staged_bytes_out, total);
    assert_int_equal(ts.staged_bytes_in - ts0.staged_bytes_in, total);

    /* and all of it read back in one batch */
    for (int i = 0; i < N; i++) {
        reqs[i].opcode = TRANSFER_READ;
        reqs[i].local = (char *)reqs[i].local + (12u << 20) - 1;
    }
    memset(f->idev.back + (12u << 20) - 1, 0, off);
    assert_int_equal(run(f, reqs, N), 0);
    for (int i = 0; i < N; i++)
        assert_memory_equal(f->idev.back + ((char *)reqs[i].local - f->idev.va),
                            f->tdev.back + (reqs[i].remote_addr - (uintptr_t)f->tdev.va),
                            reqs[i].length);
}

/* Same host (auto): host memory still goes over shm, device memory over
 * staged tcp (shm cannot reach it: a direct access would crash). */
static void test_transport_selection(void **state) {
    fixture *f = *state;
    transfer_segment_info info;
    assert_int_equal(transfer_segment_get_info(f->init, f->seg, &info), 0);
    assert_int_equal(info.protocol, TRANSFER_PROTO_SHM);
    transfer_buffer_info bufs[4];
    int nb = transfer_segment_get_buffers(f->init, f->seg, bufs, 4);
    assert_int_equal(nb, 2);
    int saw_cuda = 0;
    for (int i = 0; i < nb; i++)
        if (bufs[i].addr == (uintptr_t)f->tdev.va) saw_cuda = !strcmp(bufs[i].location, "cuda:0");
    assert_true(saw_cuda);

    transfer_stats t0, t1;
    transfer_engine_get_stats(f->target, &t0);
    fill_random(f->ihost, 100000);
    transfer_request host = {TRANSFER_WRITE, f->ihost, f->seg, rptr(f, 0, 0), 100000};
    assert_int_equal(run(f, &host, 1), 0);
    assert_memory_equal(f->thost, f->ihost, 100000);
    transfer_engine_get_stats(f->target, &t1);
    assert_int_equal(t1.bytes_served, t0.bytes_served); /* shm: the target's tcp server idle */

    transfer_request dev = {TRANSFER_WRITE, f->ihost, f->seg, rptr(f, 1, 0), 100000};
    assert_int_equal(run(f, &dev, 1), 0);
    assert_memory_equal(f->tdev.back, f->ihost, 100000);
    transfer_engine_get_stats(f->target, &t0);
    assert_int_equal(t0.bytes_served, t1.bytes_served + 100000); /* tcp, staged on the target */

    /* a batch mixing both */
    transfer_request mix[2] = {host, dev};
    mix[0].local = f->ihost + 5;
    mix[1].local = f->idev.va + 5;
    fill_random((uint8_t *)f->idev.back + 5, 100000);
    assert_int_equal(run(f, mix, 2), 0);
    assert_memory_equal(f->thost, f->ihost + 5, 100000);
    assert_memory_equal(f->tdev.back, f->idev.back + 5, 100000);
}

/* A failing device copy fails the request (no hang); the next one works. */
static void test_copy_failure(void **state) {
    fixture *f = *state;
    atomic_store(&f->idev.fail_copies, 1);
    transfer_request w = {TRANSFER_WRITE, f->idev.va, f->seg, rptr(f, 1, 0), 5000};
    assert_int_equal(run(f, &w, 1), TRANSFER_ESYS);
    /* The target's host->device copy fails: it drops the connection, the
     * chunk is retried once and fails again. */
    atomic_store(&f->tdev.fail_copies, 1000);
    assert_int_equal(run(f, &w, 1), TRANSFER_ECONN);
    atomic_store(&f->tdev.fail_copies, 0);
    fill_random((uint8_t *)f->idev.back, 5000);
    assert_int_equal(run(f, &w, 1), 0);
    assert_memory_equal(f->tdev.back, f->idev.back, 5000);
}

static void test_device_ops_errors(void **state) {
    fixture *f = *state;
    transfer_device_ops bad = f->iops;
    bad.sync = NULL;
    transfer_engine *e;
    assert_int_equal(transfer_engine_create(NULL, &e), 0);
    assert_int_equal(transfer_engine_set_device_ops(e, &bad), TRANSFER_EINVAL);
    char *mem = f->idev.va;
    assert_int_equal(transfer_register(e, mem, 100, "cuda:0"), TRANSFER_EINVAL); /* no table */
    assert_int_equal(transfer_engine_set_device_ops(e, &f->iops), 0);
    assert_int_equal(transfer_engine_set_device_ops(e, &f->iops), TRANSFER_EBUSY);
    assert_int_equal(transfer_register(e, mem, 100, "cuda:99"), TRANSFER_EINVAL);
    assert_int_equal(transfer_register(e, mem, 100, "cuda:x"), TRANSFER_EINVAL);
    assert_int_equal(transfer_register(e, mem, 100, "cuda:1"), 0);
    assert_int_equal(transfer_engine_set_device_ops(e, NULL), TRANSFER_EBUSY);
    assert_int_equal(transfer_unregister(e, mem), 0);
    assert_int_equal(transfer_engine_set_device_ops(e, NULL), 0);
    transfer_engine_destroy(e);
}

/* The initiator has no device table: it cannot stage its own device
 * memory (nothing reaches it) but writes host memory into the target's. */
static void test_no_local_device_ops(void **state) {
    fixture *f = *state;
    transfer_config c;
    transfer_config_init(&c);
    c.local_hostname = "127.0.0.1";
    transfer_engine *e;
    assert_int_equal(transfer_engine_create(&c, &e), 0);
    uint8_t *mem = malloc(70000);
    fill_random(mem, 70000);
    assert_int_equal(transfer_register(e, mem, 70000, "cpu"), 0);
    const char *name = transfer_engine_segment_name(f->target);
    uint64_t dst = rptr(f, 1, 77);
    size_t len = 70000;
    void *src = mem;
    assert_int_equal(transfer_sync_write(e, name, &src, &dst, &len, 1), 0);
    assert_memory_equal(f->tdev.back + 77, mem, 70000);
    transfer_engine_destroy(e);
    free(mem);
}

/* cuda_ipc (same host, device memory on both sides): the target's region is
 * exported once and mapped once by the initiator; device-to-device copies,
 * no staging, no tcp; contiguous chunks become one copy. */
static void test_cuda_ipc(void **state) {
    fixture *f = *state;
    assert_int_equal(atomic_load(&f->tdev.exports), 1);
    transfer_stats t0, t1;
    transfer_engine_get_stats(f->target, &t0);
    uint64_t staged = atomic_load(&f->idev.to_host) + atomic_load(&f->idev.from_host);
    static const size_t sizes[] = {1, 4099, (1u << 20) + 7, (5u << 20) + 3};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t len = sizes[k], lo = 1 + rnd() % 999, ro = 5 + rnd() % 999;
        fill_random((uint8_t *)f->idev.back + lo, len);
        transfer_request w = {TRANSFER_WRITE, lptr(f, 1, lo), f->seg, rptr(f, 1, ro), len};
        assert_int_equal(run(f, &w, 1), 0);
        assert_memory_equal(f->tdev.back + ro, f->idev.back + lo, len);
        transfer_request r = {TRANSFER_READ, lptr(f, 1, (8u << 20) + 1), f->seg, rptr(f, 1, ro),
                              len};
        memset(f->idev.back + (8u << 20) + 1, 0, len);
        assert_int_equal(run(f, &r, 1), 0);
        assert_memory_equal(f->idev.back + (8u << 20) + 1, f->tdev.back + ro, len);
    }
    transfer_engine_get_stats(f->target, &t1);
    assert_int_equal(t1.bytes_served, t0.bytes_served); /* no tcp */
    assert_int_equal(atomic_load(&f->idev.to_host) + atomic_load(&f->idev.from_host), staged);
    assert_int_equal(atomic_load(&f->idev.opens), 1); /* mapped once */

    /* 32 contiguous requests (odd sizes) = one copy; three scattered = three copies in one
     * batch (one device operation). */
    enum { N = 32 };
    transfer_request reqs[N];
    size_t off = 0;
    for (int i = 0; i < N; i++) {
        size_t len = 100 + rnd() % 5000;
        reqs[i] = (transfer_request){TRANSFER_WRITE, lptr(f, 1, 3 + off), f->seg,
                                     rptr(f, 1, 11 + off), len};
        off += len;
    }
    fill_random((uint8_t *)f->idev.back + 3, off);
    uint64_t c0 = atomic_load(&f->idev.d2d), b0 = atomic_load(&f->idev.batches);
    assert_int_equal(run(f, reqs, N), 0);
    assert_memory_equal(f->tdev.back + 11, f->idev.back + 3, off);
    assert_int_equal(atomic_load(&f->idev.d2d) - c0, 1);
    assert_int_equal(atomic_load(&f->idev.batches) - b0, 1);
    transfer_request scat[3] = {reqs[0], reqs[5], reqs[9]};
    fill_random((uint8_t *)f->idev.back + 3, off);
    c0 = atomic_load(&f->idev.d2d);
    b0 = atomic_load(&f->idev.batches);
    assert_int_equal(run(f, scat, 3), 0);
    assert_int_equal(atomic_load(&f->idev.d2d) - c0, 3);
    assert_int_equal(atomic_load(&f->idev.batches) - b0, 1);
    for (int k = 0; k < 3; k++) { /* each landed where it belongs */
        int i = k == 0 ? 0 : k == 1 ? 5 : 9;
        size_t o = (size_t)((char *)reqs[i].local - lptr(f, 1, 0));
        size_t ro = (size_t)(reqs[i].remote_addr - rptr(f, 1, 0));
        assert_memory_equal((uint8_t *)f->tdev.back + ro, (uint8_t *)f->idev.back + o,
                            reqs[i].length);
    }

    /* Host memory on the initiator: not cuda_ipc (staged tcp on the target). */
    fill_random(f->ihost, 9000);
    transfer_request h = {TRANSFER_WRITE, f->ihost, f->seg, rptr(f, 1, 0), 9000};
    assert_int_equal(run(f, &h, 1), 0);
    assert_memory_equal(f->tdev.back, f->ihost, 9000);

    /* Closing the segment unmaps. */
    assert_int_equal(transfer_close_segment(f->init, f->seg), 0);
    assert_int_equal(atomic_load(&f->idev.closes), 1);
}

/* transfer_status.transports and transfer_sync_write_via say which transport carried
 * each request: same host, auto: device memory over cuda_ipc, host memory over shm, a
 * mixed batch both. */
static void test_transports_reported(void **state) {
    fixture *f = *state;
    const unsigned IPC = 1u << TRANSFER_PROTO_CUDA_IPC, SHM = 1u << TRANSFER_PROTO_SHM,
                   TCP = 1u << TRANSFER_PROTO_TCP;
    transfer_request reqs[2] = {
        {TRANSFER_WRITE, lptr(f, 1, 3), f->seg, rptr(f, 1, 5), 7777},
        {TRANSFER_WRITE, f->ihost + 9, f->seg, rptr(f, 0, 1), 4444},
    };
    fill_random((uint8_t *)f->idev.back + 3, 7777);
    fill_random(f->ihost + 9, 4444);
    transfer_batch b;
    assert_int_equal(transfer_batch_alloc(f->init, 2, &b), 0);
    assert_int_equal(transfer_batch_submit(f->init, b, reqs, 2), 0);
    assert_int_equal(transfer_batch_wait(f->init, b, 5 * NS_PER_S), 0);
    transfer_status st;
    assert_int_equal(transfer_batch_get_status(f->init, b, 0, &st), 0);
    assert_int_equal(st.transports, IPC);
    assert_int_equal(transfer_batch_get_status(f->init, b, 1, &st), 0);
    assert_int_equal(st.transports, SHM);
    assert_int_equal(transfer_batch_get_overall(f->init, b, &st), 0);
    assert_int_equal(st.transports, IPC | SHM);
    assert_int_equal(transfer_batch_free(f->init, b), 0);
    assert_memory_equal(f->tdev.back + 5, f->idev.back + 3, 7777);
    assert_memory_equal(f->thost + 1, f->ihost + 9, 4444);

    void *src = lptr(f, 1, 0);
    uint64_t dst = rptr(f, 1, 0);
    size_t len = 1000;
    unsigned via = 99;
    assert_int_equal(transfer_sync_write_via(f->init, transfer_engine_segment_name(f->target), &src,
                                             &dst, &len, 1, &via),
                     0);
    assert_int_equal(via, IPC);
    /* out of the peer's buffer: refused, nothing copied, still says nothing carried it */
    uint64_t d2d = atomic_load(&f->idev.d2d);
    dst = rptr(f, 1, DEVBUF - 10);
    assert_int_not_equal(transfer_sync_write_via(f->init, transfer_engine_segment_name(f->target),
                                                 &src, &dst, &len, 1, &via),
                         0);
    assert_int_equal(atomic_load(&f->idev.d2d), d2d);
    assert_int_equal(strcmp(transfer_protocol_name(TRANSFER_PROTO_CUDA_IPC), "cuda_ipc"), 0);
    assert_int_equal(strcmp(transfer_protocol_name(TRANSFER_PROTO_TCP), "tcp"), 0);
    (void)TCP;
}

/* protocol tcp asked for: device memory is staged over tcp even where cuda_ipc could
 * reach it (the connector's mooncake_protocol "tcp"). */
static void test_tcp_asked_stays_tcp(void **state) {
    fixture *f = *state;
    uint64_t d2d = atomic_load(&f->idev.d2d);
    transfer_device_stats is0, is1;
    transfer_engine_get_device_stats(f->init, &is0);
    void *src = lptr(f, 1, 1);
    uint64_t dst = rptr(f, 1, 2);
    size_t len = (3u << 20) + 5;
    fill_random((uint8_t *)f->idev.back + 1, len);
    unsigned via = 0;
    assert_int_equal(transfer_sync_write_via(f->init, transfer_engine_segment_name(f->target), &src,
                                             &dst, &len, 1, &via),
                     0);
    assert_int_equal(via, 1u << TRANSFER_PROTO_TCP);
    assert_memory_equal(f->tdev.back + 2, f->idev.back + 1, len);
    assert_int_equal(atomic_load(&f->idev.d2d), d2d);
    transfer_engine_get_device_stats(f->init, &is1);
    assert_int_equal(is1.staged_bytes_out - is0.staged_bytes_out, len);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_transports_reported, setup_ipc, teardown),
        cmocka_unit_test_setup_teardown(test_tcp_asked_stays_tcp, setup_ipc_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_roundtrip_all_locations, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_roundtrip_all_locations, setup_auto, teardown),
        cmocka_unit_test_setup_teardown(test_small_writes_share_slots, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_many_in_flight, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_transport_selection, setup_auto, teardown),
        cmocka_unit_test_setup_teardown(test_copy_failure, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_device_ops_errors, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_no_local_device_ops, setup_auto, teardown),
        cmocka_unit_test_setup_teardown(test_cuda_ipc, setup_ipc, teardown),
        cmocka_unit_test_setup_teardown(test_roundtrip_all_locations, setup_ipc, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
