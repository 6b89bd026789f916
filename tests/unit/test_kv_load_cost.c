/* Unit tests: engine/kv_load_cost — copy or recompute a prefix block an offload tier
 * holds: the seeds, the averages, the best prefix, the probes, the switches. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/kv_load_cost.h"

#include <math.h>
#include <string.h>

#define D KV_LOAD_DEVICE
#define H KV_TIER_HOST
#define K KV_TIER_DISK

/* 1 MB blocks of 16 tokens */
static void init(kv_load_cost *c) {
    kv_load_cost_init(c, 1000000, 16);
}

/* The seeds favour copying: a host and a disk copy beat a 16-token prefill. */
static void test_seeds_copy(void **state) {
    (void)state;
    kv_load_cost c;
    init(&c);
    assert_true(kv_load_cost_copy_s(&c, H) < kv_load_cost_recompute_s(&c));
    assert_true(kv_load_cost_copy_s(&c, K) < kv_load_cost_recompute_s(&c));
    const signed char kinds[] = {D, H, H, K, K};
    assert_int_equal(kv_load_cost_plan(&c, kinds, 5), 5);
    assert_int_equal(c.declined[H] + c.declined[K], 0);
    assert_int_equal(kv_load_cost_plan(&c, kinds, 0), 0);
}

/* Measurements move the estimates toward what they saw, exponentially. */
static void test_averages(void **state) {
    (void)state;
    kv_load_cost c;
    init(&c);
    for (int i = 0; i < 200; i++) kv_load_cost_observe_load(&c, K, 1000000, 10000000); /* 100 MB/s */
    assert_true(fabs(c.tier_bps[K] - 1e8) < 1e6);
    assert_true(fabs(c.tier_bps[H] - KV_LOAD_COST_SEED_HOST_BPS) < 1); /* the other: untouched */
    double before = c.prefill_tps;
    kv_load_cost_observe_prefill(&c, 1000, 1000000000); /* 1000 tokens/s: one step of it */
    assert_true(fabs(c.prefill_tps - (before + KV_LOAD_COST_ALPHA * (1000 - before))) < 1e-6);
    kv_load_cost_observe_prefill(&c, 0, 5); /* nothing computed: no observation */
    kv_load_cost_observe_load(&c, 7, 1, 1); /* no such tier: ignored */
    kv_load_cost_observe_load(&c, H, 1000000, 0); /* 0 ns: counted as 1 ns, finite */
    assert_true(isfinite(c.tier_bps[H]));
}

/* A slow disk (10 ms a block) against a fast prefill (16 tokens in 1.6 ms): the host
 * blocks are copied, the prefix stops at the first disk block unless device blocks
 * after it pay for it. */
static void test_best_prefix(void **state) {
    (void)state;
    kv_load_cost c;
    init(&c);
    assert_int_equal(kv_load_cost_configure(&c, NULL, "disk=100M", NULL, 0), 0);
    c.prefill_tps = 1e4; /* 1.6 ms a block; disk 10 ms, host 0.1 ms */
    const signed char a[] = {H, H, K, K, H};
    assert_int_equal(kv_load_cost_plan(&c, a, 5), 2);
    assert_int_equal(c.declined[K], 2);
    assert_int_equal(c.declined[H], 1); /* after the disk blocks: left out too */
    /* one disk block (-8.4 ms) then six device blocks (+9.6 ms): worth it */
    const signed char b[] = {H, K, D, D, D, D, D, D};
    assert_int_equal(kv_load_cost_plan(&c, b, 8), 8);
    /* with five device blocks (+8.0 ms) it is not: the host block alone */
    assert_int_equal(kv_load_cost_plan(&c, b, 7), 1);
    /* device blocks only: all, whatever the tiers cost */
    const signed char d[] = {D, D, D};
    assert_int_equal(kv_load_cost_plan(&c, d, 3), 3);
    /* everything slower than the prefill: nothing */
    c.prefill_tps = 1e9;
    assert_int_equal(kv_load_cost_plan(&c, a, 5), 0);
}

/* A measured tier that is declined is copied anyway every KV_LOAD_COST_PROBE-th time, to
 * be measured again; a fixed bandwidth never is. */
static void test_probes(void **state) {
    (void)state;
    kv_load_cost c;
    init(&c);
    c.tier_bps[K] = 1e6; /* 1 s a block: measured slow */
    const signed char a[] = {K, K};
    int copied = 0;
    for (int i = 0; i < 3 * KV_LOAD_COST_PROBE; i++) copied += kv_load_cost_plan(&c, a, 2) == 2;
    assert_int_equal(copied, 3);
    assert_int_equal(c.probes, 3);
    assert_int_equal(c.declined[K], 2 * (3 * KV_LOAD_COST_PROBE - 3));
    assert_int_equal(kv_load_cost_configure(&c, NULL, "disk=1", NULL, 0), 0);
    copied = 0;
    for (int i = 0; i < 3 * KV_LOAD_COST_PROBE; i++) copied += kv_load_cost_plan(&c, a, 2) == 2;
    assert_int_equal(copied, 0);
    /* fixed: the measurements do not move it */
    kv_load_cost_observe_load(&c, K, 1000000, 1000);
    assert_true(c.tier_bps[K] == 1);
}

/* "always" copies whatever the estimates say. */
static void test_always(void **state) {
    (void)state;
    kv_load_cost c;
    init(&c);
    char err[256];
    assert_int_equal(kv_load_cost_configure(&c, "always", "host=1,disk=1", err, sizeof err), 0);
    assert_int_equal(c.policy, KV_LOAD_POLICY_ALWAYS);
    const signed char a[] = {H, K, K};
    assert_int_equal(kv_load_cost_plan(&c, a, 3), 3);
    assert_int_equal(kv_load_cost_configure(&c, "cost", NULL, err, sizeof err), 0);
    assert_int_equal(kv_load_cost_plan(&c, a, 3), 0);
}

/* Copies under a tenth of a forward are made inline; longer ones in the background. */
static void test_inline(void **state) {
    (void)state;
    kv_load_cost c;
    init(&c); /* host 0.1 ms, disk 0.5 ms a block; a step 20 ms until measured */
    const signed char h[] = {D, H, H, D}, k[] = {K, K, K, K, K};
    assert_true(kv_load_cost_inline(&c, h, 4));  /* 0.2 ms < 2 ms */
    assert_false(kv_load_cost_inline(&c, k, 5)); /* 2.5 ms */
    const signed char d[] = {D, D};
    assert_true(kv_load_cost_inline(&c, d, 2)); /* nothing to copy */
    for (int i = 0; i < 200; i++) kv_load_cost_observe_step(&c, 1000000); /* 1 ms steps */
    assert_true(fabs(c.step_s - 1e-3) < 1e-5);
    assert_false(kv_load_cost_inline(&c, h, 4)); /* 0.2 ms > 0.1 ms */
}

/* The switches' bad values: refused with a message naming the variable and what is accepted. */
static void test_bad_switches(void **state) {
    (void)state;
    static const char *const bad_bw[] = {"disk", "disk=", "disk=0", "disk=-5", "disk=1x",
                                         "gpu=1", "host=1,host=2", "host=1,", "=1", "disk=nan",
                                         "disk=inf", ",", "host=1;disk=2"};
    for (size_t i = 0; i < sizeof bad_bw / sizeof *bad_bw; i++) {
        kv_load_cost c;
        init(&c);
        char err[512] = "";
        assert_int_equal(kv_load_cost_configure(&c, NULL, bad_bw[i], err, sizeof err), -1);
        assert_non_null(strstr(err, "DISAGG_KV_OFFLOAD_BANDWIDTH"));
        assert_non_null(strstr(err, "host=BYTES_PER_S"));
        assert_int_equal(c.tier_fixed[H] + c.tier_fixed[K], 0); /* nothing half-applied */
    }
    kv_load_cost c;
    init(&c);
    char err[512] = "";
    assert_int_equal(kv_load_cost_configure(&c, "sometimes", NULL, err, sizeof err), -1);
    assert_non_null(strstr(err, "DISAGG_KV_OFFLOAD_COPY='sometimes'"));
    assert_non_null(strstr(err, "always"));
    /* good ones, suffixes in powers of 1000 */
    assert_int_equal(kv_load_cost_configure(&c, "", "disk=2G,host=64k", err, sizeof err), 0);
    assert_true(c.tier_bps[K] == 2e9 && c.tier_bps[H] == 64e3);
    assert_int_equal(kv_load_cost_configure(&c, NULL, "host=1.5e9", err, sizeof err), 0);
    assert_true(c.tier_bps[H] == 1.5e9);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_seeds_copy),   cmocka_unit_test(test_averages),
        cmocka_unit_test(test_best_prefix),  cmocka_unit_test(test_probes),
        cmocka_unit_test(test_always),       cmocka_unit_test(test_bad_switches),
        cmocka_unit_test(test_inline),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
