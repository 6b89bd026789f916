/* Unit tests: engine/block_pool — allocation, reference counts, LRU reuse,
 * prefix-cache lookups and eviction. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/block_pool.h"

static void test_alloc_release(void **state) {
    (void)state;
    block_pool bp;
    assert_int_equal(block_pool_init(&bp, 8), 0);
    int32_t a[8], b[8];
    assert_int_equal(block_pool_alloc(&bp, 5, a), 0);
    assert_int_equal(block_pool_num_free(&bp), 3);
    assert_int_equal(block_pool_alloc(&bp, 4, b), -1); /* all or nothing */
    assert_int_equal(block_pool_num_free(&bp), 3);
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            assert_int_not_equal(a[i], a[j]);
    block_pool_ref(&bp, a[0]);
    block_pool_release(&bp, a, 5);
    assert_int_equal(block_pool_num_used(&bp), 1); /* a[0] still referenced */
    block_pool_release(&bp, a, 1);
    assert_int_equal(block_pool_num_used(&bp), 0);
    block_pool_release(&bp, a, 1); /* double release is ignored */
    assert_int_equal(block_pool_num_free(&bp), 8);
    block_pool_free_all(&bp);
}

static void test_prefix_cache(void **state) {
    (void)state;
    block_pool bp;
    assert_int_equal(block_pool_init(&bp, 4), 0);
    int32_t toks[32];
    for (int i = 0; i < 32; i++)
        toks[i] = 1000 + i;
    uint64_t h0 = block_pool_hash_tokens(0, toks, 16);
    uint64_t h1 = block_pool_hash_tokens(h0, toks + 16, 16);
    assert_true(h0 > 1 && h1 > 1 && h0 != h1);
    /* the same tokens after a different prefix hash differently */
    assert_true(block_pool_hash_tokens(h1, toks + 16, 16) != h1);
    int32_t a[2];
    assert_int_equal(block_pool_alloc(&bp, 2, a), 0);
    block_pool_set_hash(&bp, a[0], h0);
    block_pool_set_hash(&bp, a[1], h1);
    block_pool_release(&bp, a, 2);
    /* freed blocks stay findable */
    assert_true(block_pool_contains(&bp, h0));
    assert_int_equal(block_pool_lookup(&bp, h0), a[0]);
    assert_int_equal(block_pool_num_free(&bp), 3);
    assert_int_equal(block_pool_lookup(&bp, 12345), -1);
    assert_int_equal(bp.hits, 1);
    assert_int_equal(bp.queries, 2);
    /* allocating everything free evicts the cached h1 block, not a[0] (in use) */
    int32_t c[3];
    assert_int_equal(block_pool_alloc(&bp, 3, c), 0);
    assert_false(block_pool_contains(&bp, h1));
    assert_true(block_pool_contains(&bp, h0));
    block_pool_release(&bp, c, 3);
    block_pool_release(&bp, a, 1);
    block_pool_free_all(&bp);
}

static void test_lru_order(void **state) {
    (void)state;
    block_pool bp;
    assert_int_equal(block_pool_init(&bp, 3), 0);
    int32_t a[3];
    assert_int_equal(block_pool_alloc(&bp, 3, a), 0);
    for (int i = 0; i < 3; i++)
        block_pool_set_hash(&bp, a[i], 100 + (uint64_t)i);
    block_pool_release(&bp, &a[1], 1); /* freed first: evicted first */
    block_pool_release(&bp, &a[0], 1);
    block_pool_release(&bp, &a[2], 1);
    int32_t x;
    assert_int_equal(block_pool_alloc(&bp, 1, &x), 0);
    assert_int_equal(x, a[1]);
    assert_false(block_pool_contains(&bp, 101));
    assert_true(block_pool_contains(&bp, 100) && block_pool_contains(&bp, 102));
    /* a sequence's blocks released together: the tail goes before the head */
    block_pool_release(&bp, &x, 1);
    block_pool_free_all(&bp);
}

static void test_many_hashes(void **state) {
    (void)state;
    block_pool bp;
    assert_int_equal(block_pool_init(&bp, 64), 0);
    /* churn: tombstones must not break lookups */
    for (int round = 0; round < 200; round++) {
        int32_t ids[64];
        assert_int_equal(block_pool_alloc(&bp, 64, ids), 0);
        for (int i = 0; i < 64; i++)
            block_pool_set_hash(&bp, ids[i], 1000ull * (uint64_t)round + (uint64_t)i + 2);
        block_pool_release(&bp, ids, 64);
        for (int i = 0; i < 64; i++)
            assert_true(block_pool_contains(&bp, 1000ull * (uint64_t)round + (uint64_t)i + 2));
    }
    block_pool_free_all(&bp);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_release),
        cmocka_unit_test(test_prefix_cache),
        cmocka_unit_test(test_lru_order),
        cmocka_unit_test(test_many_hashes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
