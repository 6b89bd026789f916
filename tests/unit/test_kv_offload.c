/* Unit tests: engine/kv_offload — the host tier's LRU, the disk tier under it, a block's
 * bytes surviving the round trip, corrupt and foreign slots refused, the events; the
 * asynchronous loads on the loader thread (slots pinned while loaded, a clear meanwhile,
 * a corrupt slot found by the loader, the notify callback, the synchronous mode); the disk
 * writer thread (a full queue dropping, a queued block loaded from its buffer, a clear and a
 * shutdown with writes queued), a torn slot refused, the O_DIRECT modes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/kv_offload.h"
#include "kernels/backend.h"

#include <fcntl.h>
#include <stdatomic.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/vfs.h>
#include <unistd.h>

#define BB 1000 /* block bytes */
#define NB 8    /* device blocks */

static unsigned char kv[NB * BB];

static void fill(int block, int seed) {
    for (int i = 0; i < BB; i++)
        kv[block * BB + i] = (unsigned char)(seed * 31 + i * 7);
}

static int holds(int block, int seed) {
    for (int i = 0; i < BB; i++)
        if (kv[block * BB + i] != (unsigned char)(seed * 31 + i * 7)) return 0;
    return 1;
}

static int load(kv_offload *o, uint64_t hash, int block) {
    int64_t h = kv_offload_lookup(o, hash);
    return h < 0 ? -1 : kv_offload_load(o, h, block);
}

static void test_host_lru(void **state) {
    (void)state;
    backend_stream *st = backend_stream_create(backend_cpu_default());
    kv_offload_config c = {3 * BB, NULL, 0, BB, 42, 16, 0, 0, 0, 0, 0, 0};
    kv_offload *o;
    char err[256];
    assert_int_equal(kv_offload_create(&c, st, kv, &o, err, sizeof err), 0);
    kvev_log log = {0};
    kv_offload_set_events(o, &log);
    for (int k = 0; k < 3; k++) {
        fill(k, k + 1);
        assert_int_equal(kv_offload_store(o, 100 + (uint64_t)k, k), 0);
    }
    assert_int_equal(kv_offload_lookup(o, 100) >= 0, 1); /* 100 is now most recent */
    fill(3, 4);
    assert_int_equal(kv_offload_store(o, 103, 3), 0); /* evicts 101, the least recent */
    assert_true(kv_offload_lookup(o, 101) < 0);
    memset(kv, 0, sizeof kv);
    assert_int_equal(load(o, 100, 5), 0);
    assert_true(holds(5, 1));
    assert_int_equal(load(o, 103, 6), 0);
    assert_true(holds(6, 4));
    assert_int_equal(load(o, 999, 6), -1);
    /* storing a hash the tier has is a refresh, not a copy */
    kv_offload_stats s;
    kv_offload_get_stats(o, &s);
    uint64_t stored = s.stored[KV_TIER_HOST];
    assert_int_equal(kv_offload_store(o, 100, 5), 0);
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.stored[KV_TIER_HOST], stored);
    assert_int_equal(s.evicted[KV_TIER_HOST], 1);
    assert_int_equal(s.loaded[KV_TIER_HOST], 2);
    assert_int_equal(s.resident[KV_TIER_HOST], 3);
    /* events: 4 stores (CPU, no tokens, coalesced), 1 removal */
    assert_int_equal(log.n, 3);
    assert_int_equal(log.ev[0].kind, KVEV_STORED);
    assert_int_equal(log.ev[0].medium, KVEV_MEDIUM_CPU);
    assert_int_equal(log.ev[0].n_hashes, 3);
    assert_int_equal(log.ev[0].n_tokens, 0);
    assert_int_equal(log.ev[1].kind, KVEV_REMOVED);
    assert_true(log.ev[1].hashes[0] == 101);
    assert_int_equal(log.ev[2].kind, KVEV_STORED);
    kv_offload_clear(o);
    assert_true(kv_offload_lookup(o, 100) < 0);
    kv_events_free(&log);
    kv_offload_destroy(o);
    backend_stream_free(st);
}

static void test_disk_tier(void **state) {
    (void)state;
    char dir[] = "/tmp/kvoff-XXXXXX";
    assert_non_null(mkdtemp(dir));
    backend_stream *st = backend_stream_create(backend_cpu_default());
    kv_offload_config c = {1 * BB, dir, 4 * 8192, BB, 42, 16, 0, 0, 0, 0, 0, 0};
    kv_offload *o;
    char err[256];
    assert_int_equal(kv_offload_create(&c, st, kv, &o, err, sizeof err), 0);
    const char *path = kv_offload_disk_path(o);
    assert_true(strncmp(path, dir, strlen(dir)) == 0);
    for (int k = 0; k < 4; k++) { /* a host tier of one block: 3 go to disk */
        fill(k, 10 + k);
        assert_int_equal(kv_offload_store(o, 200 + (uint64_t)k, k), 0);
    }
    kv_offload_drain_writes(o); /* on the file now (the writer thread) */
    memset(kv, 0, sizeof kv);
    assert_int_equal(load(o, 200, 7), 0); /* from the disk */
    assert_true(holds(7, 10));
    /* corrupt slot 1 (hash 201): refused, dropped */
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    unsigned char x = 0x55;
    assert_int_equal(pwrite(fd, &x, 1, 4096 + 64 + 10), 1);
    close(fd);
    assert_int_equal(load(o, 201, 7), -1);
    assert_true(kv_offload_lookup(o, 201) < 0);
    kv_offload_stats s;
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.corrupt, 1);
    assert_int_equal(s.loaded[KV_TIER_DISK], 1);
    assert_int_equal(load(o, 202, 7), 0);
    assert_true(holds(7, 12));
    kv_offload_destroy(o);
    assert_int_equal(access(path, F_OK), -1); /* removed */
    /* too small: an error naming the flag */
    kv_offload_config bad = {BB - 1, NULL, 0, BB, 42, 16, 0, 0, 0, 0, 0, 0};
    assert_int_equal(kv_offload_create(&bad, st, kv, &o, err, sizeof err), -1);
    assert_non_null(strstr(err, "--kv-offloading-size"));
    backend_stream_free(st);
    rmdir(dir);
}

static atomic_int notified;

static void on_load_ended(void *ctx) {
    (void)ctx;
    atomic_fetch_add(&notified, 1);
}

/* The next ended load (waits up to 10 s for the loader). */
static kv_offload_done reap_one(kv_offload *o) {
    kv_offload_done d;
    memset(&d, 0, sizeof d);
    for (int i = 0; i < 10000; i++) {
        if (kv_offload_reap(o, &d, 1) == 1) return d;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    fail_msg("no load ended within 10 s");
    return d;
}

static void test_async_host(void **state) {
    (void)state;
    backend_stream *st = backend_stream_create(backend_cpu_default());
    kv_offload_config c = {3 * BB, NULL, 0, BB, 42, 16, 0, 200, 0, 0, 0, 0}; /* loads take 200 ms */
    kv_offload *o;
    char err[256];
    assert_int_equal(kv_offload_create(&c, st, kv, &o, err, sizeof err), 0);
    kv_offload_set_notify(o, on_load_ended, NULL);
    atomic_store(&notified, 0);
    for (int k = 0; k < 3; k++) {
        fill(k, k + 1);
        assert_int_equal(kv_offload_store(o, 100 + (uint64_t)k, k), 0);
    }
    assert_int_equal(kv_offload_find(o, 101), KV_TIER_HOST);
    assert_int_equal(kv_offload_find(o, 999), -1);
    memset(kv + 5 * BB, 0, BB);
    assert_int_equal(kv_offload_load_async(o, 100, 5, 77), 0);
    assert_int_equal(kv_offload_load_async(o, 999, 6, 78), -1); /* no tier has it */
    assert_int_equal(kv_offload_in_flight(o), 1);
    /* 100 is being loaded (into block 5, which nothing else touches meanwhile): three more
     * blocks evict 101, 102 and 103, never 100 */
    for (int k = 3; k < 6; k++) {
        fill(k - 3, k + 1);
        assert_int_equal(kv_offload_store(o, 100 + (uint64_t)k, k - 3), 0);
    }
    assert_int_equal(kv_offload_find(o, 100), KV_TIER_HOST);
    assert_int_equal(kv_offload_find(o, 101), -1);
    assert_int_equal(kv_offload_find(o, 103), -1);
    kv_offload_done d = reap_one(o);
    assert_true(d.tag == 77 && d.block == 5 && d.tier == KV_TIER_HOST && d.ok == 1);
    assert_true(d.ns >= 150000000ull); /* the delay is the loader's time, not the caller's */
    assert_true(holds(5, 1));
    assert_int_equal(atomic_load(&notified), 1);
    assert_int_equal(kv_offload_in_flight(o), 0);
    kv_offload_stats s;
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.loaded[KV_TIER_HOST], 1);
    assert_int_equal(s.resident[KV_TIER_HOST], 3);
    /* a clear while a load reads a slot: the hash is gone at once, the slot when it ends */
    assert_int_equal(kv_offload_load_async(o, 105, 6, 79), 0);
    kv_offload_clear(o);
    assert_int_equal(kv_offload_find(o, 105), -1);
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.resident[KV_TIER_HOST], 1);
    d = reap_one(o);
    assert_true(d.ok && d.block == 6 && holds(6, 6));
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.resident[KV_TIER_HOST], 0);
    /* every slot free again: three stores fit without evicting */
    for (int k = 0; k < 3; k++) assert_int_equal(kv_offload_store(o, 300 + (uint64_t)k, k), 0);
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.resident[KV_TIER_HOST], 3);
    /* destroyed with a load queued: joined, nothing leaks */
    assert_int_equal(kv_offload_load_async(o, 300, 7, 80), 0);
    kv_offload_destroy(o);
    backend_stream_free(st);
}

static void test_async_disk_and_sync_mode(void **state) {
    (void)state;
    char dir[] = "/tmp/kvoff-XXXXXX";
    assert_non_null(mkdtemp(dir));
    backend_stream *st = backend_stream_create(backend_cpu_default());
    for (int sync = 0; sync < 2; sync++) {
        kv_offload_config c = {1 * BB, dir, 4 * 8192, BB, 42, 16, sync, 0, 0, 0, 0, 0};
        kv_offload *o;
        char err[256];
        assert_int_equal(kv_offload_create(&c, st, kv, &o, err, sizeof err), 0);
        for (int k = 0; k < 4; k++) { /* a host tier of one block: 200..202 go to disk */
            fill(k, 10 + k);
            assert_int_equal(kv_offload_store(o, 200 + (uint64_t)k, k), 0);
        }
        assert_int_equal(kv_offload_find(o, 201), KV_TIER_DISK);
        kv_offload_drain_writes(o);
        int fd = open(kv_offload_disk_path(o), O_RDWR); /* corrupt slot 1 (hash 201) */
        unsigned char x = 0x55;
        assert_int_equal(pwrite(fd, &x, 1, 4096 + 64 + 10), 1);
        close(fd);
        memset(kv, 0, sizeof kv);
        assert_int_equal(kv_offload_load_async(o, 200, 6, 1), 0);
        assert_int_equal(kv_offload_load_async(o, 201, 7, 2), 0);
        if (sync) assert_int_equal(kv_offload_busy(o), 0); /* both done on this thread */
        kv_offload_done a = reap_one(o), b = reap_one(o);
        assert_true(a.tag == 1 && a.ok && a.tier == KV_TIER_DISK && holds(6, 10));
        assert_true(b.tag == 2 && !b.ok);
        kv_offload_stats s;
        kv_offload_get_stats(o, &s);
        assert_int_equal(s.corrupt, 1);
        assert_int_equal(s.loaded[KV_TIER_DISK], 1);
        assert_int_equal(kv_offload_find(o, 201), -1); /* dropped */
        kv_offload_destroy(o);
    }
    backend_stream_free(st);
    rmdir(dir);
}

/* The writer thread: a slow disk (300 ms a write) and a queue of one write.  The host tier's
 * victims go down without the caller waiting; the one queued is findable and loads from
 * its queued bytes (inline and on the loader); the others are dropped and counted; drained,
 * the block is on the file. */
static void test_write_queue(void **state) {
    (void)state;
    char dir[] = "/tmp/kvoff-XXXXXX";
    assert_non_null(mkdtemp(dir));
    backend_stream *st = backend_stream_create(backend_cpu_default());
    kv_offload_config c = {1 * BB, dir, 4 * 8192, BB, 42, 16, 0, 0, 0, 1, 300, 0};
    kv_offload *o;
    char err[256];
    assert_int_equal(kv_offload_create(&c, st, kv, &o, err, sizeof err), 0);
    kv_offload_set_notify(o, on_load_ended, NULL);
    atomic_store(&notified, 0);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int k = 0; k < 4; k++) { /* 200 is queued, 201 and 202 find the queue full */
        fill(k, 20 + k);
        assert_int_equal(kv_offload_store(o, 200 + (uint64_t)k, k), 0);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
    assert_true(ms < 250); /* the stores did not wait for the 300 ms write */
    kv_offload_stats s;
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.writes_queued, 1);
    assert_int_equal(s.writes_dropped, 2);
    assert_int_equal(s.stored[KV_TIER_DISK], 0);
    assert_int_equal(kv_offload_find(o, 200), KV_TIER_DISK);
    assert_int_equal(kv_offload_find(o, 201), -1);
    assert_int_equal(kv_offload_find(o, 202), -1);
    memset(kv, 0, sizeof kv);
    assert_int_equal(load(o, 200, 5), 0); /* inline, from the queued bytes */
    assert_true(holds(5, 20));
    assert_int_equal(kv_offload_load_async(o, 200, 6, 9), 0); /* on the loader, same bytes */
    kv_offload_done d = reap_one(o);
    assert_true(d.tag == 9 && d.ok && d.tier == KV_TIER_DISK && holds(6, 20));
    kv_offload_drain_writes(o);
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.writes_queued, 0);
    assert_int_equal(s.stored[KV_TIER_DISK], 1);
    assert_int_equal(s.resident[KV_TIER_DISK], 1);
    assert_true(atomic_load(&notified) >= 2); /* the load and the write woke the owner */
    memset(kv, 0, sizeof kv);
    assert_int_equal(load(o, 200, 7), 0); /* now from the file */
    assert_true(holds(7, 20));
    /* the buffer is free again: the next victim is queued, not dropped */
    fill(0, 30);
    assert_int_equal(kv_offload_store(o, 210, 0), 0); /* evicts 203 from host to disk */
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.writes_dropped, 2);
    assert_int_equal(s.writes_queued, 1);
    /* a clear while the write is queued: gone at once, the slot freed when the write ends */
    kv_offload_clear(o);
    assert_int_equal(kv_offload_find(o, 203), -1);
    kv_offload_drain_writes(o);
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.resident[KV_TIER_DISK], 0);
    /* destroyed with a write queued: dropped, joined, nothing leaks */
    fill(1, 31);
    assert_int_equal(kv_offload_store(o, 211, 1), 0);
    assert_int_equal(kv_offload_store(o, 212, 1), 0);
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.writes_queued, 1);
    kv_offload_destroy(o);
    backend_stream_free(st);
    rmdir(dir);
}

/* A disk of one slot, its write slow: the next victims find no slot to take (the one slot is
 * being written) and are not kept; their write buffers go back (none leaks: the queue of
 * two takes a write again once the first ended). */
static void test_disk_slot_busy_writing(void **state) {
    (void)state;
    char dir[] = "/tmp/kvoff-XXXXXX";
    assert_non_null(mkdtemp(dir));
    backend_stream *st = backend_stream_create(backend_cpu_default());
    kv_offload_config c = {1 * BB, dir, 4096, BB, 42, 16, 0, 0, 0, 2, 200, 0};
    kv_offload *o;
    char err[256];
    assert_int_equal(kv_offload_create(&c, st, kv, &o, err, sizeof err), 0);
    for (int k = 0; k < 5; k++) { /* 4 victims: 400 written, 401..403 not kept */
        fill(k, 60 + k);
        assert_int_equal(kv_offload_store(o, 400 + (uint64_t)k, k), 0);
    }
    kv_offload_stats s;
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.writes_queued, 1);
    assert_int_equal(s.writes_dropped, 0); /* a leaked buffer would have made 403 a drop */
    assert_int_equal(kv_offload_find(o, 401), -1);
    kv_offload_drain_writes(o);
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.stored[KV_TIER_DISK], 1);
    memset(kv, 0, sizeof kv);
    assert_int_equal(load(o, 400, 6), 0);
    assert_true(holds(6, 60));
    /* the slot free to evict again: the next victim (404) replaces 400 */
    fill(0, 99);
    assert_int_equal(kv_offload_store(o, 490, 0), 0);
    kv_offload_drain_writes(o);
    assert_int_equal(kv_offload_find(o, 404), KV_TIER_DISK);
    assert_int_equal(kv_offload_find(o, 400), -1);
    kv_offload_destroy(o);
    backend_stream_free(st);
    rmdir(dir);
}

/* A slot whose write was torn (the header and the first half of the block written, the
 * second half another block's bytes): the checksum refuses it. */
static void test_torn_slot_refused(void **state) {
    (void)state;
    char dir[] = "/tmp/kvoff-XXXXXX";
    assert_non_null(mkdtemp(dir));
    backend_stream *st = backend_stream_create(backend_cpu_default());
    kv_offload_config c = {1 * BB, dir, 4 * 8192, BB, 42, 16, 0, 0, 0, 0, 0, 0};
    kv_offload *o;
    char err[256];
    assert_int_equal(kv_offload_create(&c, st, kv, &o, err, sizeof err), 0);
    for (int k = 0; k < 3; k++) { /* 200 and 201 go to disk slots 0 and 1 */
        fill(k, 40 + k);
        assert_int_equal(kv_offload_store(o, 200 + (uint64_t)k, k), 0);
    }
    kv_offload_drain_writes(o);
    int fd = open(kv_offload_disk_path(o), O_RDWR);
    assert_true(fd >= 0);
    unsigned char half[BB / 2];
    assert_int_equal(pread(fd, half, sizeof half, 4096 + 64 + BB / 2), (ssize_t)sizeof half);
    assert_int_equal(pwrite(fd, half, sizeof half, 64 + BB / 2), (ssize_t)sizeof half);
    close(fd);
    memset(kv, 0, sizeof kv);
    assert_int_equal(load(o, 200, 5), -1);
    assert_int_equal(load(o, 201, 6), 0);
    assert_true(holds(6, 41));
    kv_offload_stats s;
    kv_offload_get_stats(o, &s);
    assert_int_equal(s.corrupt, 1);
    kv_offload_destroy(o);
    backend_stream_free(st);
    rmdir(dir);
}

/* The ways of opening the slab: O_DIRECT off (buffered), on (O_DIRECT, or a creation error
 * naming it where the filesystem refuses), auto on tmpfs (buffered: memory anyway); the
 * blocks come back the same in each, sync and async writes. */
static void test_direct_io_modes(void **state) {
    (void)state;
    backend_stream *st = backend_stream_create(backend_cpu_default());
    const char *bases[2] = {"/tmp", "/dev/shm"};
    for (int bi = 0; bi < 2; bi++) {
        char dir[64];
        snprintf(dir, sizeof dir, "%s/kvoff-XXXXXX", bases[bi]);
        if (!mkdtemp(dir)) continue; /* no /dev/shm here */
        for (int mode = KV_DIRECT_IO_AUTO; mode <= KV_DIRECT_IO_OFF; mode++)
            for (int sync = 0; sync < 2; sync++) {
                kv_offload_config c = {1 * BB, dir, 4 * 8192, BB, 42, 16, 0, 0, sync, 0, 0, mode};
                kv_offload *o;
                char err[512];
                if (kv_offload_create(&c, st, kv, &o, err, sizeof err)) {
                    assert_int_equal(mode, KV_DIRECT_IO_ON); /* a filesystem without O_DIRECT */
                    assert_non_null(strstr(err, "refuses O_DIRECT"));
                    continue;
                }
                kv_offload_stats s;
                kv_offload_get_stats(o, &s);
                if (mode == KV_DIRECT_IO_ON) assert_int_equal(s.direct_io, 1);
                if (mode == KV_DIRECT_IO_OFF) assert_int_equal(s.direct_io, 0);
                struct statfs sf;
                if (mode == KV_DIRECT_IO_AUTO && !statfs(dir, &sf) && sf.f_type == 0x01021994)
                    assert_int_equal(s.direct_io, 0); /* tmpfs: buffered by choice */
                for (int k = 0; k < 4; k++) {
                    fill(k, 50 + k);
                    assert_int_equal(kv_offload_store(o, 300 + (uint64_t)k, k), 0);
                }
                kv_offload_drain_writes(o);
                memset(kv, 0, sizeof kv);
                for (int k = 0; k < 3; k++) {
                    assert_int_equal(kv_offload_find(o, 300 + (uint64_t)k), KV_TIER_DISK);
                    assert_int_equal(load(o, 300 + (uint64_t)k, 4 + k), 0);
                    assert_true(holds(4 + k, 50 + k));
                }
                kv_offload_get_stats(o, &s);
                assert_int_equal(s.stored[KV_TIER_DISK], 3);
                assert_int_equal(s.corrupt, 0);
                kv_offload_destroy(o);
            }
        rmdir(dir);
    }
    backend_stream_free(st);
}

/* Two runs sharing a directory whose PIDs coincide (containers: both PID 1): a slab name that
 * exists is never truncated or reused -- the next one is taken -- and the slab is locked for
 * the run's life (what another run's stale-slab sweep asks before removing it). */
static void test_slab_names_exclusive(void **state) {
    (void)state;
    char dir[] = "/tmp/kvoff-XXXXXX";
    assert_non_null(mkdtemp(dir));
    backend_stream *st = backend_stream_create(backend_cpu_default());
    kv_offload_config c = {1 * BB, dir, 4 * 8192, BB, 42, 16, 0, 0, 0, 0, 0, 0};
    kv_offload *o;
    char err[256], taken[3][4200];
    assert_int_equal(kv_offload_create(&c, st, kv, &o, err, sizeof err), 0);
    int pid, n;
    const char *base = strrchr(kv_offload_disk_path(o), '/') + 1;
    assert_int_equal(sscanf(base, "disagg-kv-%d-%d.slab", &pid, &n), 2);
    assert_int_equal(pid, (int)getpid());
    int lk = open(kv_offload_disk_path(o), O_RDONLY); /* locked by the run */
    assert_true(lk >= 0);
    assert_int_not_equal(flock(lk, LOCK_EX | LOCK_NB), 0);
    close(lk);
    kv_offload_destroy(o);
    for (int k = 0; k < 3; k++) { /* "another container's" slabs at the next names */
        snprintf(taken[k], sizeof taken[k], "%s/disagg-kv-%d-%d.slab", dir, pid, n + 1 + k);
        FILE *f = fopen(taken[k], "w");
        assert_non_null(f);
        fputs("theirs", f);
        fclose(f);
    }
    assert_int_equal(kv_offload_create(&c, st, kv, &o, err, sizeof err), 0);
    for (int k = 0; k < 3; k++)
        assert_string_not_equal(kv_offload_disk_path(o), taken[k]);
    kv_offload_destroy(o);
    for (int k = 0; k < 3; k++) {
        char buf[16] = "";
        FILE *f = fopen(taken[k], "r");
        assert_non_null(f);
        assert_non_null(fgets(buf, sizeof buf, f));
        fclose(f);
        assert_string_equal(buf, "theirs");
        unlink(taken[k]);
    }
    backend_stream_free(st);
    assert_int_equal(rmdir(dir), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_host_lru),
        cmocka_unit_test(test_disk_tier),
        cmocka_unit_test(test_async_host),
        cmocka_unit_test(test_async_disk_and_sync_mode),
        cmocka_unit_test(test_write_queue),
        cmocka_unit_test(test_torn_slot_refused),
        cmocka_unit_test(test_disk_slot_busy_writing),
        cmocka_unit_test(test_direct_io_modes),
        cmocka_unit_test(test_slab_names_exclusive),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
