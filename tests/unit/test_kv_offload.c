/* Unit tests: engine/kv_offload — the host tier's LRU, the disk tier under it, a block's
 * bytes surviving the round trip, corrupt and foreign slots refused, the events. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/kv_offload.h"
#include "kernels/backend.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
    kv_offload_config c = {3 * BB, NULL, 0, BB, 42, 16};
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
    kv_offload_config c = {1 * BB, dir, 4 * 8192, BB, 42, 16};
    kv_offload *o;
    char err[256];
    assert_int_equal(kv_offload_create(&c, st, kv, &o, err, sizeof err), 0);
    const char *path = kv_offload_disk_path(o);
    assert_true(strncmp(path, dir, strlen(dir)) == 0);
    for (int k = 0; k < 4; k++) { /* a host tier of one block: 3 go to disk */
        fill(k, 10 + k);
        assert_int_equal(kv_offload_store(o, 200 + (uint64_t)k, k), 0);
    }
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
    kv_offload_config bad = {BB - 1, NULL, 0, BB, 42, 16};
    assert_int_equal(kv_offload_create(&bad, st, kv, &o, err, sizeof err), -1);
    assert_non_null(strstr(err, "--kv-offloading-size"));
    backend_stream_free(st);
    rmdir(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_host_lru),
        cmocka_unit_test(test_disk_tier),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
