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

/* An evicted hash must be gone even when the eviction's tombstone rebuilds the table
 * (once a rebuild re-inserted the hash being evicted: a later lookup returned a block
 * that held other KV). */
static void test_evicted_hash_gone(void **state) {
    (void)state;
    block_pool bp;
    assert_int_equal(block_pool_init(&bp, 12), 0);
    for (int round = 0; round < 50; round++) {
        int32_t ids[6];
        assert_int_equal(block_pool_alloc(&bp, 6, ids), 0);
        for (int i = 0; i < 6; i++)
            block_pool_set_hash(&bp, ids[i], 100ull * (uint64_t)round + (uint64_t)i + 2);
        block_pool_release(&bp, ids, 6);
        for (int r = 0; r <= round; r++)
            for (int i = 0; i < 6; i++) {
                uint64_t h = 100ull * (uint64_t)r + (uint64_t)i + 2;
                int32_t b = block_pool_lookup(&bp, h);
                assert_int_equal(b >= 0, r >= round - 1); /* 12 blocks: the last two rounds */
                if (b >= 0) {
                    assert_true(bp.hash[b] == h);
                    block_pool_release(&bp, &b, 1);
                }
            }
    }
    block_pool_free_all(&bp);
}

typedef struct fake_tier {
    uint64_t stored[64];
    int n_stored;
    int loads, fail;
    uint64_t last_load;
    int32_t last_block;
} fake_tier;

static void ft_evicted(void *ctx, int32_t block, uint64_t hash) {
    fake_tier *t = ctx;
    (void)block;
    t->stored[t->n_stored++] = hash;
}

static int ft_load(void *ctx, uint64_t hash, int32_t block) {
    fake_tier *t = ctx;
    t->loads++;
    t->last_load = hash;
    t->last_block = block;
    for (int i = 0; i < t->n_stored; i++)
        if (t->stored[i] == hash && !t->fail) return 0;
    return -1;
}

/* The lower-tier hooks: evictions are offered to the tier, device misses asked of it; a
 * loaded block joins the device cache (BlockStored), a failed load gives the block back;
 * the events say what entered and left. */
static void test_tier_hooks_and_events(void **state) {
    (void)state;
    block_pool bp;
    kvev_log log = {0};
    fake_tier ft = {0};
    assert_int_equal(block_pool_init(&bp, 2), 0);
    bp.block_size = 4;
    bp.events = &log;
    bp.tier = (block_pool_tier){&ft, ft_evicted, ft_load, NULL, NULL};
    int32_t toks[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    uint64_t h0 = block_pool_hash_tokens(0, toks, 4), h1 = block_pool_hash_tokens(h0, toks + 4, 4);
    int32_t a[2];
    assert_int_equal(block_pool_alloc(&bp, 2, a), 0);
    assert_int_equal(block_pool_cache_block(&bp, a[0], 0, h0, toks), 1);
    assert_int_equal(block_pool_cache_block(&bp, a[1], h0, h1, toks + 4), 1);
    assert_int_equal(block_pool_cache_block(&bp, a[1], h0, h1, toks + 4), 0); /* already */
    /* one chain: one BlockStored of both blocks, no parent, their 8 tokens */
    assert_int_equal(log.n, 1);
    assert_int_equal(log.ev[0].kind, KVEV_STORED);
    assert_int_equal(log.ev[0].n_hashes, 2);
    assert_false(log.ev[0].has_parent);
    assert_int_equal(log.ev[0].n_tokens, 8);
    assert_memory_equal(log.ev[0].tokens, toks, sizeof toks);
    kv_events_reset(&log);
    block_pool_release(&bp, a, 2);
    int32_t x[2];
    assert_int_equal(block_pool_alloc(&bp, 2, x), 0); /* evicts both: the tier gets them */
    assert_int_equal(ft.n_stored, 2);
    assert_int_equal(log.n, 1);
    assert_int_equal(log.ev[0].kind, KVEV_REMOVED);
    assert_int_equal(log.ev[0].n_hashes, 2);
    assert_false(block_pool_contains(&bp, h0) || block_pool_contains(&bp, h1));
    block_pool_release(&bp, x, 2);
    kv_events_reset(&log);
    /* a device miss comes back from the tier, cached again with its parent */
    int32_t b = block_pool_lookup_tiered(&bp, h0, h1, toks + 4);
    assert_true(b >= 0);
    assert_true(ft.last_load == h1 && ft.last_block == b);
    assert_true(block_pool_contains(&bp, h1));
    assert_int_equal(bp.ext_queries, 1);
    assert_int_equal(bp.ext_hits, 1);
    assert_int_equal(log.n, 1);
    assert_true(log.ev[0].has_parent && log.ev[0].parent == h0);
    /* a failed load: -1, the block back on the free queue, nothing cached */
    ft.fail = 1;
    assert_int_equal(block_pool_lookup_tiered(&bp, 0, h0, toks), -1);
    assert_int_equal(block_pool_num_free(&bp), 1);
    assert_false(block_pool_contains(&bp, h0));
    assert_int_equal(bp.ext_queries, 2);
    assert_int_equal(bp.ext_hits, 1);
    /* reset: refused while a cached block is in use, then everything goes */
    assert_int_equal(block_pool_reset_cache(&bp), -1);
    block_pool_release(&bp, &b, 1);
    kv_events_reset(&log);
    assert_int_equal(block_pool_reset_cache(&bp), 0);
    assert_false(block_pool_contains(&bp, h1));
    assert_int_equal(log.n, 1);
    assert_int_equal(log.ev[0].kind, KVEV_CLEARED);
    kv_events_free(&log);
    block_pool_free_all(&bp);
}

static int ft_find(void *ctx, uint64_t hash) {
    fake_tier *t = ctx;
    for (int i = 0; i < t->n_stored; i++)
        if (t->stored[i] == hash) return 1; /* "level 1" */
    return -1;
}

static int ft_load_async(void *ctx, uint64_t hash, int32_t block, uint64_t tag) {
    fake_tier *t = ctx;
    t->last_block = block;
    t->last_load = tag;
    return ft_find(ctx, hash) >= 0 && !t->fail ? 0 : -1;
}

/* An asynchronous load: the block is referenced by the caller and by the copy, so the
 * caller letting go does not free it; the end of the copy does.  A tier that lost the hash
 * gives the block back at once. */
static void test_load_async(void **state) {
    (void)state;
    block_pool bp;
    fake_tier ft = {0};
    assert_int_equal(block_pool_init(&bp, 3), 0);
    bp.tier = (block_pool_tier){&ft, ft_evicted, ft_load, ft_find, ft_load_async};
    ft.stored[ft.n_stored++] = 1234;
    assert_int_equal(block_pool_tier_find(&bp, 1234), 1);
    assert_int_equal(block_pool_tier_find(&bp, 999), -1);
    int32_t b = block_pool_load_async(&bp, 1234, 42);
    assert_true(b >= 0 && ft.last_block == b && ft.last_load == 42);
    assert_int_equal(bp.ref[b], 2);
    assert_false(block_pool_contains(&bp, 1234)); /* cached by the caller when the copy ends */
    block_pool_release(&bp, &b, 1);                /* the caller goes (an abort) */
    assert_int_equal(block_pool_num_used(&bp), 1);  /* the copy still writes it */
    block_pool_load_finished(&bp, b);
    assert_int_equal(block_pool_num_used(&bp), 0);
    assert_int_equal(block_pool_load_async(&bp, 999, 43), -1); /* not held */
    assert_int_equal(block_pool_num_free(&bp), 3);
    assert_int_equal(bp.ext_queries, 2);
    assert_int_equal(bp.ext_hits, 1);
    /* no free block: -1, nothing started */
    int32_t all[3];
    assert_int_equal(block_pool_alloc(&bp, 3, all), 0);
    ft.last_block = -7;
    assert_int_equal(block_pool_load_async(&bp, 1234, 44), -1);
    assert_int_equal(ft.last_block, -7);
    block_pool_release(&bp, all, 3);
    /* no async hooks: nothing */
    bp.tier = (block_pool_tier){&ft, ft_evicted, ft_load, NULL, NULL};
    assert_int_equal(block_pool_tier_find(&bp, 1234), -1);
    assert_int_equal(block_pool_load_async(&bp, 1234, 45), -1);
    block_pool_free_all(&bp);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_release),
        cmocka_unit_test(test_prefix_cache),
        cmocka_unit_test(test_lru_order),
        cmocka_unit_test(test_many_hashes),
        cmocka_unit_test(test_evicted_hash_gone),
        cmocka_unit_test(test_tier_hooks_and_events),
        cmocka_unit_test(test_load_async),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
