/* Unit tests of --policy kv_aware's choice (src/proxy/kv_route.c) over fake prefills whose
 * indexes are fed KVEventBatch payloads: the longest cached prefix wins; the tiers count less
 * than the device cache; a holder whose queue costs more than its cache saves loses (the
 * "load" result); nothing cached and no token ids fall back to least_loaded; the counters;
 * with pool_fetch, a pick that is not the holder of the longest prefix names the holder. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/prom.h"
#include "proxy/kv_index.h"
#include "proxy/kv_route.h"
#include "tests/unit/fake_upstream.h"

#include <event2/event.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BS   4
#define NTOK 32 /* the prompt: 8 blocks */

/* The prompt's token ids: the fake tokenizer gives ids 1..NTOK for any body. */
static int fake_tokens(void *arg, const json_t *body, int chat, int32_t **ids, size_t *n, char *err,
                       size_t errcap) {
    (void)arg;
    (void)body;
    (void)chat;
    (void)err;
    (void)errcap;
    *ids = malloc(NTOK * sizeof **ids);
    for (int i = 0; i < NTOK; i++)
        (*ids)[i] = i + 1;
    *n = NTOK;
    return 0;
}

/* Feeds b's index: the first nb blocks of the prompt stored in medium, with hashes base+i. */
static void hold(upstream *b, int nb, const char *medium, uint64_t base) {
    if (!b->kv) b->kv = kv_index_new(1000);
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, 0);
    msgpack_pack_array(&pk, 1);
    msgpack_pack_array(&pk, 8);
    msgpack_pack_str(&pk, 11);
    msgpack_pack_str_body(&pk, "BlockStored", 11);
    msgpack_pack_array(&pk, (size_t)nb);
    for (int i = 0; i < nb; i++)
        msgpack_pack_uint64(&pk, base + (uint64_t)i);
    msgpack_pack_nil(&pk);
    msgpack_pack_array(&pk, (size_t)nb * BS);
    for (int i = 0; i < nb * BS; i++)
        msgpack_pack_int(&pk, i + 1);
    msgpack_pack_int(&pk, BS);
    msgpack_pack_nil(&pk);
    msgpack_pack_str(&pk, strlen(medium));
    msgpack_pack_str_body(&pk, medium, strlen(medium));
    msgpack_pack_nil(&pk);
    msgpack_pack_int(&pk, 0);
    char err[256];
    assert_int_equal(kv_index_apply(b->kv, sb.data, sb.size, err, sizeof err), 0);
    msgpack_sbuffer_destroy(&sb);
}

typedef struct fixture {
    struct event_base *base;
    kv_route *kr;
    upstream p[3];
    unsigned rr;
} fixture;

static int setup_with(void **state, int pool_fetch) {
    fixture *f = calloc(1, sizeof *f);
    f->base = event_base_new();
    kv_route_config c;
    kv_route_config_default(&c);
    c.tokens = fake_tokens;
    c.pool_fetch = pool_fetch;
    char err[256];
    f->kr = kv_route_new(f->base, &c, err, sizeof err);
    assert_non_null(f->kr);
    for (int i = 0; i < 3; i++) {
        fake(&f->p[i], UPSTREAM_PREFILL, i, 1);
        snprintf(f->p[i].url, sizeof f->p[i].url, "http://p%d:8000", i);
        snprintf(f->p[i].bootstrap_url, sizeof f->p[i].bootstrap_url, "http://p%d:8998", i);
        char eid[32];
        snprintf(eid, sizeof eid, "engine-p%d", i);
        f->p[i].engines[0].engine_id = strdup(eid);
    }
    *state = f;
    return 0;
}

static int setup(void **state) {
    return setup_with(state, 0);
}

static int setup_pool(void **state) {
    return setup_with(state, 1);
}

static int teardown(void **state) {
    fixture *f = *state;
    for (int i = 0; i < 3; i++)
        upstream_free(&f->p[i]);
    kv_route_free(f->kr);
    event_base_free(f->base);
    free(f);
    return 0;
}

/* One choice for a chat request; *uncached gets what the chosen one lacks, *pool its pool
 * source (when not NULL). */
static upstream *pick_req(fixture *f, uint64_t exclude, uint64_t *uncached, kv_route_req *pool) {
    kv_route_req rq = {0};
    json_t *body = json_pack("{s:[]}", "messages");
    const pd_engine *eng = NULL;
    uint64_t u = 0;
    upstream *b = kv_route_pick(f->kr, f->p, 3, &f->rr, exclude, NULL, &eng, &rq, body,
                                "/v1/chat/completions", &u);
    if (b) assert_ptr_equal(eng, &b->engines[0]);
    if (uncached) *uncached = u;
    if (pool) *pool = rq;
    kv_route_req_free(&rq);
    json_decref(body);
    return b;
}

static upstream *pick(fixture *f, uint64_t exclude, uint64_t *uncached) {
    return pick_req(f, exclude, uncached, NULL);
}

static double counter(fixture *f, const char *series) {
    prom o;
    prom_init(&o, 1 << 20, PROM_STYLE_INT);
    kv_route_write_metrics(f->kr, f->p, 3, &o);
    char line[300]; /* a sample line starts with the series (HELP and TYPE lines with '#') */
    snprintf(line, sizeof line, "\n%s ", series);
    const char *s = strstr(prom_text(&o), line);
    double v = s ? atof(s + strlen(line)) : -1;
    prom_free(&o);
    return v;
}

static void test_longest_prefix_wins(void **state) {
    fixture *f = *state;
    hold(&f->p[0], 2, "GPU", 100);
    hold(&f->p[2], 5, "GPU", 200);
    uint64_t un;
    assert_ptr_equal(pick(f, 0, &un), &f->p[2]);
    assert_int_equal(un, NTOK - 5 * BS);
    /* the holder excluded (it refused a connection): the next longest */
    assert_ptr_equal(pick(f, 1u << 2, NULL), &f->p[0]);
    assert_int_equal(counter(f, "disagg_proxy_kv_aware_requests_total{result=\"hit\"}"), 2);
    assert_int_equal(counter(f, "disagg_proxy_kv_aware_cached_tokens_total"), 7 * BS);
    assert_int_equal(
        counter(f, "disagg_proxy_kv_index_blocks{backend=\"http://p2:8000\",medium=\"GPU\"}"), 5);
}

/* 4 blocks in the host tier (0.8 each) beat 3 on the device, lose to 4 on the device; 6 on
 * disk (0.5 each) lose to 4 on the device. */
static void test_tiers_count_less(void **state) {
    fixture *f = *state;
    hold(&f->p[0], 4, "CPU", 100);
    hold(&f->p[1], 3, "GPU", 200);
    assert_ptr_equal(pick(f, 0, NULL), &f->p[0]);
    hold(&f->p[2], 4, "GPU", 300);
    assert_ptr_equal(pick(f, 0, NULL), &f->p[2]);
    upstream_free(&f->p[0]);
    fake(&f->p[0], UPSTREAM_PREFILL, 0, 1);
    hold(&f->p[0], 6, "DISK", 400);
    assert_ptr_equal(pick(f, 0, NULL), &f->p[2]);
}

/* The holder's queued tokens cost more than its cache saves: another wins ("load"). */
static void test_load_outweighs_cache(void **state) {
    fixture *f = *state;
    hold(&f->p[1], 4, "GPU", 100); /* saves 16 tokens */
    f->p[1].kv_pending_tokens = 10;
    assert_ptr_equal(pick(f, 0, NULL), &f->p[1]); /* 32-16+10 = 26 < 32 */
    f->p[1].kv_pending_tokens = 40;
    upstream *b = pick(f, 0, NULL); /* 56 > 32: p0 or p2 */
    assert_true(b == &f->p[0] || b == &f->p[2]);
    assert_int_equal(counter(f, "disagg_proxy_kv_aware_requests_total{result=\"load\"}"), 1);
}

/* Nothing cached: least_loaded's choice, counted as a miss; a body without tokens
 * (/v1/responses) too, counted no_tokens. */
static void test_fallbacks(void **state) {
    fixture *f = *state;
    f->p[0].outstanding = 3;
    f->p[1].outstanding = 1;
    f->p[2].outstanding = 2;
    assert_ptr_equal(pick(f, 0, NULL), &f->p[1]);
    assert_int_equal(counter(f, "disagg_proxy_kv_aware_requests_total{result=\"miss\"}"), 1);
    kv_route_req rq = {0};
    json_t *body = json_pack("{s:s}", "input", "hi");
    uint64_t u = 99;
    assert_ptr_equal(
        kv_route_pick(f->kr, f->p, 3, &f->rr, 0, NULL, NULL, &rq, body, "/v1/responses", &u),
        &f->p[1]);
    assert_int_equal(u, 0);
    kv_route_req_free(&rq);
    json_decref(body);
    assert_int_equal(counter(f, "disagg_proxy_kv_aware_requests_total{result=\"no_tokens\"}"), 1);
    /* nobody eligible */
    assert_null(pick(f, 7, NULL));
}

/* --kv-pool-fetch: load sends the prompt to p2 while p1 holds 4 blocks (in its host tier): p1 is named the pool source, with the 16 tokens it holds; the holder
 * chosen, or pool_fetch off, names none. */
static void test_pool_source_names_the_holder(void **state) {
    fixture *f = *state;
    hold(&f->p[1], 4, "CPU", 100);
    hold(&f->p[2], 1, "GPU", 200); /* holds less than p1 */
    kv_route_req rq;
    assert_ptr_equal(pick_req(f, 0, NULL, &rq), &f->p[1]);
    assert_int_equal(rq.pool_tokens, 0);
    f->p[1].kv_pending_tokens = 100;
    upstream *b = pick_req(f, 0, NULL, &rq);
    assert_ptr_equal(b, &f->p[2]); /* 32 - 4 < 32 */
    assert_int_equal(rq.pool_tokens, 4 * BS);
    assert_string_equal(rq.pool_engine_id, "engine-p1");
    assert_string_equal(rq.pool_bootstrap, "http://p1:8998");
    assert_int_equal(counter(f, "disagg_proxy_kv_pool_source_requests_total"), 1);
    assert_int_equal(counter(f, "disagg_proxy_kv_pool_source_tokens_total"), 4 * BS);
    /* the holder out of rotation: nothing to fetch from */
    assert_ptr_equal(pick_req(f, 1u << 1, NULL, &rq), &f->p[2]);
    assert_int_equal(rq.pool_tokens, 0);
}

static void test_no_pool_source_without_the_flag(void **state) {
    fixture *f = *state;
    hold(&f->p[1], 4, "GPU", 100);
    f->p[1].kv_pending_tokens = 100;
    kv_route_req rq;
    assert_ptr_not_equal(pick_req(f, 0, NULL, &rq), &f->p[1]);
    assert_int_equal(rq.pool_tokens, 0);
    assert_int_equal(counter(f, "disagg_proxy_kv_pool_source_requests_total"), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_longest_prefix_wins, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tiers_count_less, setup, teardown),
        cmocka_unit_test_setup_teardown(test_load_outweighs_cache, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fallbacks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pool_source_names_the_holder, setup_pool, teardown),
        cmocka_unit_test_setup_teardown(test_no_pool_source_without_the_flag, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
