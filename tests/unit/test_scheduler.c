/* Unit tests: engine/scheduler — chunked prefill under the token budget,
 * decode batching, prefix-cache admission, preemption by recompute, parking,
 * prefixes copied back from a lower tier in the background (SEQ_LOADING). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/scheduler.h"

typedef struct env {
    block_pool bp;
    scheduler s;
    sched_plan p;
} env;

static void env_init(env *e, int blocks, int bs, int max_seqs, int max_tokens) {
    assert_int_equal(block_pool_init(&e->bp, blocks), 0);
    sched_config c = {bs, max_seqs, max_tokens, 1};
    assert_int_equal(sched_init(&e->s, &c, &e->bp), 0);
    assert_int_equal(sched_plan_init(&e->p, &c), 0);
}

static void env_free(env *e) {
    sched_plan_free(&e->p);
    sched_free(&e->s);
    block_pool_free_all(&e->bp);
}

static void make_seq(seq *q, uint64_t id, int n, int first, int max_tokens) {
    int32_t t[512];
    for (int i = 0; i < n; i++)
        t[i] = first + i;
    assert_int_equal(seq_init(q, id, t, n, max_tokens), 0);
}

/* Run a step and "sample" token 7 for every item that reached its end. */
static void step(env *e) {
    sched_step(&e->s, &e->p);
    sched_commit(&e->s, &e->p);
    for (int i = 0; i < e->p.n_items; i++)
        if (e->p.items[i].logits) seq_append(e->p.items[i].s, 7);
}

static void test_chunked_prefill(void **state) {
    (void)state;
    env e;
    env_init(&e, 64, 4, 8, 10);
    seq a, b;
    make_seq(&a, 1, 25, 100, 4);
    make_seq(&b, 2, 3, 500, 4);
    sched_add(&e.s, &a);
    sched_add(&e.s, &b);
    /* step 1: 10 tokens of a (budget), b waits */
    sched_step(&e.s, &e.p);
    assert_int_equal(e.p.n_items, 1);
    assert_int_equal(e.p.items[0].count, 10);
    assert_int_equal(e.p.items[0].logits, 0);
    sched_commit(&e.s, &e.p);
    assert_int_equal(a.n_computed, 10);
    assert_int_equal(a.n_blocks, 3);
    /* step 2: 10 more of a; step 3: last 5 of a + 3 of b */
    step(&e);
    sched_step(&e.s, &e.p);
    assert_int_equal(e.p.n_items, 2);
    assert_int_equal(e.p.items[0].count, 5);
    assert_int_equal(e.p.items[0].logits, 1);
    assert_int_equal(e.p.items[1].count, 3);
    assert_int_equal(e.p.n_tokens, 8);
    sched_commit(&e.s, &e.p);
    seq_append(&a, 7);
    seq_append(&b, 7);
    /* step 4: both decode one token */
    sched_step(&e.s, &e.p);
    assert_int_equal(e.p.n_items, 2);
    assert_int_equal(e.p.items[0].count, 1);
    assert_int_equal(e.p.items[0].start, 25);
    assert_int_equal(e.p.items[1].count, 1);
    sched_commit(&e.s, &e.p);
    sched_finish(&e.s, &a, 0);
    sched_finish(&e.s, &b, 0);
    assert_int_equal(block_pool_num_used(&e.bp), 0);
    seq_free(&a);
    seq_free(&b);
    env_free(&e);
}

static void test_prefix_cache_admission(void **state) {
    (void)state;
    env e;
    env_init(&e, 64, 4, 8, 100);
    seq a, b, c;
    make_seq(&a, 1, 18, 100, 2);
    sched_add(&e.s, &a);
    step(&e);
    sched_finish(&e.s, &a, 0);
    /* b shares a's first 16 tokens (4 full blocks): those come from the cache */
    make_seq(&b, 2, 18, 100, 2);
    b.tokens[17] = 9999;
    sched_add(&e.s, &b);
    sched_step(&e.s, &e.p);
    assert_int_equal(b.n_cached, 16);
    assert_int_equal(e.p.items[0].start, 16);
    assert_int_equal(e.p.items[0].count, 2);
    sched_commit(&e.s, &e.p);
    /* an exact repeat of a 16-token prompt leaves its last token to compute */
    make_seq(&c, 3, 16, 100, 2);
    sched_add(&e.s, &c);
    sched_step(&e.s, &e.p);
    assert_int_equal(c.n_cached, 12);
    assert_int_equal(e.p.items[e.p.n_items - 1].count, 4);
    assert_true(e.bp.hits >= 7);
    sched_finish(&e.s, &b, 0);
    sched_finish(&e.s, &c, 0);
    assert_int_equal(block_pool_num_used(&e.bp), 0);
    seq_free(&a);
    seq_free(&b);
    seq_free(&c);
    env_free(&e);
}

static void test_preemption(void **state) {
    (void)state;
    env e;
    env_init(&e, 6, 4, 8, 64);
    seq a, b;
    make_seq(&a, 1, 11, 100, 20); /* 3 blocks */
    make_seq(&b, 2, 11, 300, 20); /* 3 blocks */
    sched_add(&e.s, &a);
    sched_add(&e.s, &b);
    step(&e);
    assert_int_equal(block_pool_num_free(&e.bp), 0);
    /* a and b have 12 tokens (3 full blocks); the next step fits, the one after
     * needs a 4th block for a: none free, so b (admitted last) is preempted */
    step(&e);
    assert_int_equal(e.p.n_preempted, 0);
    step(&e);
    assert_int_equal(e.p.n_preempted, 1);
    assert_ptr_equal(e.p.preempted[0], &b);
    assert_int_equal(b.state, SEQ_WAITING);
    assert_int_equal(b.n_computed, 0);
    assert_int_equal(b.n_tokens, 13); /* its generated tokens are kept, recomputed later */
    assert_int_equal(e.s.num_preemptions, 1);
    sched_finish(&e.s, &a, 0);
    /* b comes back and recomputes all 12 tokens */
    sched_step(&e.s, &e.p);
    assert_int_equal(e.p.n_items, 1);
    assert_ptr_equal(e.p.items[0].s, &b);
    assert_int_equal(e.p.items[0].count, 13 - b.n_cached);
    sched_commit(&e.s, &e.p);
    sched_finish(&e.s, &b, 0);
    assert_int_equal(block_pool_num_used(&e.bp), 0);
    seq_free(&a);
    seq_free(&b);
    env_free(&e);
}

static void test_park_unpark(void **state) {
    (void)state;
    env e;
    env_init(&e, 16, 4, 2, 64);
    seq a, b;
    make_seq(&a, 1, 10, 100, 4);
    make_seq(&b, 2, 5, 300, 4);
    sched_add(&e.s, &a);
    assert_int_equal(sched_park_with_blocks(&e.s, &a), 0);
    assert_int_equal(a.n_blocks, 3);
    assert_int_equal(a.state, SEQ_PARKED);
    sched_add(&e.s, &b);
    sched_step(&e.s, &e.p); /* a is skipped while parked; b runs */
    assert_int_equal(e.p.n_items, 1);
    assert_ptr_equal(e.p.items[0].s, &b);
    sched_commit(&e.s, &e.p);
    seq_append(&b, 7);
    /* remote KV arrived for all but the last prompt token */
    sched_unpark(&e.s, &a, 9);
    sched_step(&e.s, &e.p);
    assert_int_equal(e.p.n_items, 2);
    assert_ptr_equal(e.p.items[0].s, &a);
    assert_int_equal(e.p.items[0].start, 9);
    assert_int_equal(e.p.items[0].count, 1);
    assert_int_equal(e.p.items[0].logits, 1);
    sched_commit(&e.s, &e.p);
    assert_int_equal(a.n_hashed, 2);
    /* finishing with keep_blocks leaves them referenced (the connector owns them) */
    sched_finish(&e.s, &a, 1);
    assert_int_equal(block_pool_num_used(&e.bp), 3 + b.n_blocks);
    block_pool_release(&e.bp, a.blocks, a.n_blocks);
    sched_finish(&e.s, &b, 0);
    assert_int_equal(block_pool_num_used(&e.bp), 0);
    seq_free(&a);
    seq_free(&b);
    env_free(&e);
}

static void test_max_num_seqs(void **state) {
    (void)state;
    env e;
    env_init(&e, 64, 4, 2, 64);
    seq q[3];
    for (int i = 0; i < 3; i++) {
        make_seq(&q[i], (uint64_t)i, 3, 100 * i, 4);
        sched_add(&e.s, &q[i]);
    }
    sched_step(&e.s, &e.p);
    assert_int_equal(e.p.n_items, 2);
    assert_int_equal(e.s.n_waiting, 1);
    sched_commit(&e.s, &e.p);
    for (int i = 0; i < 3; i++)
        sched_finish(&e.s, &q[i], 0);
    assert_int_equal(block_pool_num_used(&e.bp), 0);
    for (int i = 0; i < 3; i++)
        seq_free(&q[i]);
    env_free(&e);
}

/* A lower tier that keeps the hashes the pool evicts and records the copies started. */
typedef struct async_tier {
    uint64_t held[64];
    int n_held;
    int32_t block[16];
    uint64_t tag[16];
    int n_started;
} async_tier;

static void at_evicted(void *ctx, int32_t block, uint64_t hash) {
    async_tier *t = ctx;
    (void)block;
    t->held[t->n_held++] = hash;
}

static int at_find(void *ctx, uint64_t hash) {
    async_tier *t = ctx;
    for (int i = 0; i < t->n_held; i++)
        if (t->held[i] == hash) return 0;
    return -1;
}

static int at_load(void *ctx, uint64_t hash, int32_t block) {
    (void)ctx, (void)hash, (void)block;
    return -1; /* the synchronous path is not used here */
}

static int at_load_async(void *ctx, uint64_t hash, int32_t block, uint64_t tag) {
    async_tier *t = ctx;
    if (at_find(ctx, hash) < 0) return -1;
    t->block[t->n_started] = block;
    t->tag[t->n_started++] = tag;
    return 0;
}

/* Compute q (13 tokens: 3 full blocks) to its end, finish it, then evict every cached block
 * into the tier. */
static void compute_and_evict(env *e, seq *q) {
    sched_add(&e->s, q);
    while (q->n_computed < q->n_tokens) step(e);
    sched_finish(&e->s, q, 0);
    int32_t all[16];
    assert_int_equal(block_pool_alloc(&e->bp, 16, all), 0);
    block_pool_release(&e->bp, all, 16);
}

/* The tier's blocks come back in the background: the sequence waits (SEQ_LOADING, out of
 * the batch, its blocks held twice) while another is admitted; then it waits first in line
 * holding nothing and takes the copied blocks from the device cache; a failed copy cuts its
 * prefix there; an abort meanwhile leaves the copies' blocks to the copies; the cost model
 * may decline. */
static void test_tier_loads(void **state) {
    (void)state;
    env e;
    env_init(&e, 16, 4, 8, 64);
    async_tier at = {0};
    e.bp.tier = (block_pool_tier){&at, at_evicted, at_load, at_find, at_load_async};
    e.s.async_loads = SCHED_LOADS_BACKGROUND;
    seq a, b, c, d, f;
    make_seq(&a, 1, 13, 100, 1);
    compute_and_evict(&e, &a);
    assert_int_equal(at.n_held, 3);
    make_seq(&b, 2, 13, 100, 4); /* a's prompt: 3 blocks in the tier */
    make_seq(&c, 3, 5, 900, 4);  /* another: computed now */
    sched_add(&e.s, &b);
    sched_add(&e.s, &c);
    sched_step(&e.s, &e.p);
    assert_int_equal(e.p.n_items, 1);
    assert_ptr_equal(e.p.items[0].s, &c); /* the batch went on without b */
    sched_commit(&e.s, &e.p);
    assert_int_equal(b.state, SEQ_LOADING);
    assert_int_equal(e.s.n_loading, 1);
    assert_int_equal(e.s.n_waiting, 0);
    assert_int_equal(b.n_blocks, 3);
    assert_int_equal(b.n_loads, 3);
    assert_int_equal(at.n_started, 3);
    for (int i = 0; i < 3; i++) {
        assert_true(at.block[i] == b.blocks[i] && at.tag[i] == 2);
        assert_int_equal(e.bp.ref[b.blocks[i]], 2); /* b's and the copy's */
    }
    assert_int_equal(e.bp.ext_hits, 3);
    /* copies end: the first well, the second not, the third well (cached, not b's) */
    int32_t b2 = b.blocks[2];
    sched_load_done(&e.s, &b, b.blocks[0], 1);
    sched_load_done(&e.s, &b, b.blocks[1], 0);
    assert_int_equal(b.state, SEQ_LOADING);
    sched_load_done(&e.s, &b, b2, 1);
    /* b waits first in line with its prefix up to the failed copy */
    assert_int_equal(b.state, SEQ_WAITING);
    assert_ptr_equal(e.s.wait_head, &b);
    assert_int_equal(e.s.n_loading, 0);
    assert_int_equal(b.n_blocks, 1);
    assert_int_equal(b.n_computed, 4);
    assert_int_equal(b.n_cached, 4);
    assert_int_equal(b.n_tier_cached, 4); /* the one good copy before the cut */
    assert_true(block_pool_contains(&e.bp, b.hashes[0]));
    assert_true(block_pool_contains(&e.bp, b.hashes[2])); /* copied well: cached */
    assert_int_equal(e.bp.ref[b2], 0);                     /* and free */
    assert_int_equal(e.s.loads_waited, 1);
    at.n_started = 0;
    step(&e); /* b runs from its 4 loaded tokens (the failed block is computed) */
    assert_int_equal(b.state, SEQ_RUNNING);
    assert_int_equal(b.n_cached, 4);
    assert_int_equal(b.n_tier_cached, 4); /* found in the device cache now: still the tier's */
    assert_true(b.n_computed > 4);
    assert_int_equal(at.n_started, 0);
    sched_finish(&e.s, &b, 0);
    sched_finish(&e.s, &c, 0);
    /* an abort while loading: the copies keep their blocks until they end */
    int32_t all[16];
    assert_int_equal(block_pool_alloc(&e.bp, 16, all), 0);
    block_pool_release(&e.bp, all, 16);
    at.n_started = 0;
    make_seq(&d, 4, 13, 100, 4);
    sched_add(&e.s, &d);
    sched_step(&e.s, &e.p);
    assert_int_equal(d.state, SEQ_LOADING);
    assert_int_equal(at.n_started, 3);
    sched_finish(&e.s, &d, 0);
    assert_int_equal(e.s.n_loading, 0);
    assert_int_equal(block_pool_num_used(&e.bp), 3);
    for (int i = 0; i < 3; i++) sched_load_done(&e.s, NULL, at.block[i], 1);
    assert_int_equal(block_pool_num_used(&e.bp), 0);
    seq_free(&d);
    /* the cost model: a 1 B/s tier is slower than any prefill: recomputed, no copy */
    kv_load_cost cost;
    kv_load_cost_init(&cost, 1000, 4);
    assert_int_equal(kv_load_cost_configure(&cost, NULL, "host=1", NULL, 0), 0);
    e.s.cost = &cost;
    at.n_started = 0;
    make_seq(&f, 5, 13, 100, 4);
    sched_add(&e.s, &f);
    sched_step(&e.s, &e.p);
    assert_int_equal(f.state, SEQ_RUNNING);
    assert_int_equal(f.n_cached, 0);
    assert_int_equal(at.n_started, 0);
    assert_int_equal(cost.declined[KV_TIER_HOST], 3);
    sched_finish(&e.s, &f, 0);
    seq_free(&a);
    seq_free(&b);
    seq_free(&c);
    seq_free(&f);
    env_free(&e);
}

/* Two sequences whose copies ended (holding their prefixes) and a preempted one first in
 * line that needs most of the cache: the head cannot be admitted, so the others let their
 * blocks go and the head is admitted next (holding them behind a head that cannot fit
 * stalled the engine for good). */
static void test_loaded_never_block_the_head(void **state) {
    (void)state;
    env e;
    env_init(&e, 16, 4, 8, 64);
    async_tier at = {0};
    e.bp.tier = (block_pool_tier){&at, at_evicted, at_load, at_find, at_load_async};
    e.s.async_loads = SCHED_LOADS_BACKGROUND;
    seq a1, a2, b, d, x;
    make_seq(&a1, 1, 13, 100, 1);
    compute_and_evict(&e, &a1);
    make_seq(&a2, 2, 13, 300, 1);
    compute_and_evict(&e, &a2);
    make_seq(&b, 3, 13, 100, 4);
    make_seq(&d, 4, 13, 300, 4);
    sched_add(&e.s, &b);
    sched_add(&e.s, &d);
    sched_step(&e.s, &e.p);
    assert_int_equal(e.s.n_loading, 2);
    for (int i = 0; i < at.n_started; i++)
        sched_load_done(&e.s, at.tag[i] == 3 ? &b : &d, at.block[i], 1);
    assert_int_equal(e.s.n_waiting, 2);
    assert_int_equal(block_pool_num_used(&e.bp), 6); /* they hold their prefixes */
    make_seq(&x, 5, 50, 700, 4); /* 13 blocks: fits only if they let theirs go */
    sched_add(&e.s, &x);
    e.s.wait_head->prev = NULL; /* move x to the head, as a preempted sequence goes */
    e.s.wait_tail = x.prev;
    x.prev->next = NULL;
    x.next = e.s.wait_head;
    e.s.wait_head->prev = &x;
    e.s.wait_head = &x;
    x.prev = NULL;
    at.n_started = 0;
    int x_ran = 0;
    for (int k = 0; k < 60 && (b.state != SEQ_RUNNING || d.state != SEQ_RUNNING); k++) {
        step(&e);
        x_ran |= x.state == SEQ_RUNNING;
        if (x.state == SEQ_RUNNING && x.n_tokens - x.n_prompt >= 1) sched_finish(&e.s, &x, 0);
        for (int i = 0; i < at.n_started; i++) /* copies (again, after x evicted them) end */
            sched_load_done(&e.s, at.tag[i] == 3 ? &b : &d, at.block[i], 1);
        at.n_started = 0;
    }
    assert_true(x_ran);
    assert_int_equal(x.state, SEQ_FINISHED);
    assert_int_equal(b.state, SEQ_RUNNING);
    assert_int_equal(b.n_cached, 12);
    assert_int_equal(b.n_tier_cached, 12);
    assert_int_equal(d.state, SEQ_RUNNING);
    sched_finish(&e.s, &b, 0);
    sched_finish(&e.s, &d, 0);
    seq_free(&a1);
    seq_free(&a2);
    seq_free(&b);
    seq_free(&d);
    seq_free(&x);
    env_free(&e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chunked_prefill), cmocka_unit_test(test_prefix_cache_admission),
        cmocka_unit_test(test_preemption),      cmocka_unit_test(test_park_unpark),
        cmocka_unit_test(test_max_num_seqs),    cmocka_unit_test(test_tier_loads),
        cmocka_unit_test(test_loaded_never_block_the_head),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
