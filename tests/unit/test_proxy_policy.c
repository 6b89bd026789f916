/* Unit tests of the proxy's routing with --discovery (policy.c): the
 * published load in least_loaded, --policy prefix (rendezvous hash bounded by
 * load), model/KV-layout groups and retiring upstreams; and the prompt prefix
 * hash of pd_request.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "proxy/upstream.h"
#include "proxy/pd_request.h"
#include "proxy/policy.h"
#include "tests/unit/fake_upstream.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --discovery: published load, --policy prefix (bounded by load), model/KV-layout groups. */
static void test_policy_discovery(void **state) {
    (void)state;
    upstream p[4];
    for (int i = 0; i < 4; i++) {
        fake(&p[i], UPSTREAM_PREFILL, i, 1);
        snprintf(p[i].url, sizeof p[i].url, "http://10.0.0.%d:8100", i + 1);
        snprintf(p[i].group, sizeof p[i].group, "m|L");
    }
    unsigned rr = 0;
    const pd_engine *e;
    /* the published count (other proxies' requests) outweighs our own outstanding */
    p[0].has_load = 1, p[0].pub_running = 5;
    p[1].outstanding = 2;
    p[2].has_load = 1, p[2].pub_waiting = 3;
    p[3].has_load = 1, p[3].pub_running = 1, p[3].pub_kv_usage = 0.5;
    assert_ptr_equal(policy_pick(POLICY_LEAST_LOADED, p, 4, &rr, 0, NULL, &e), &p[3]);
    p[3].pub_running = 2; /* 2.5 vs 2: ours */
    assert_ptr_equal(policy_pick(POLICY_LEAST_LOADED, p, 4, &rr, 0, NULL, &e), &p[1]);
    assert_true(policy_load(&p[0]) == 5 && policy_load(&p[1]) == 2);
    /* prefix: one prefix always goes to the same prefill while loads are even */
    for (int i = 0; i < 4; i++)
        p[i].has_load = 0, p[i].outstanding = 0, p[i].pub_running = 0;
    int hits[4] = {0};
    for (int k = 0; k < 64; k++) {
        char prompt[64];
        snprintf(prompt, sizeof prompt, "system prompt number %d", k);
        policy_hint h = {policy_hash(prompt, strlen(prompt)), NULL};
        upstream *a = policy_pick(POLICY_PREFIX, p, 4, &rr, 0, &h, &e);
        upstream *b = policy_pick(POLICY_PREFIX, p, 4, &rr, 0, &h, &e);
        assert_ptr_equal(a, b);
        hits[a->index]++;
    }
    for (int i = 0; i < 4; i++) /* and the prefixes spread over all of them */
        assert_true(hits[i] > 0);
    /* ...but not beyond the load bound */
    policy_hint h = {policy_hash("x", 1), NULL};
    upstream *pref = policy_pick(POLICY_PREFIX, p, 4, &rr, 0, &h, &e);
    pref->outstanding = POLICY_PREFIX_SLACK;
    assert_ptr_equal(policy_pick(POLICY_PREFIX, p, 4, &rr, 0, &h, &e), pref);
    pref->outstanding = POLICY_PREFIX_SLACK + 1;
    assert_ptr_not_equal(policy_pick(POLICY_PREFIX, p, 4, &rr, 0, &h, &e), pref);
    pref->outstanding = 0;
    /* groups: only the matching model and KV layout */
    snprintf(p[0].group, sizeof p[0].group, "m|other");
    snprintf(p[1].group, sizeof p[1].group, "m|other");
    snprintf(p[2].group, sizeof p[2].group, "m|other");
    policy_hint g = {0, "m|L"};
    for (int k = 0; k < 8; k++)
        assert_ptr_equal(policy_pick(POLICY_LEAST_LOADED, p, 4, &rr, 0, &g, &e), &p[3]);
    p[3].retiring = 1; /* a retiring instance gets nothing */
    assert_null(policy_pick(POLICY_ROUND_ROBIN, p, 4, &rr, 0, &g, &e));
    policy_kind k;
    assert_int_equal(policy_parse("prefix", &k), 0);
    assert_int_equal(k, POLICY_PREFIX);
    for (int i = 0; i < 4; i++)
        free(p[i].engines);
}

/* p2c: the less loaded of two distinct random draws; the most loaded of three
 * is never chosen, the other two both are; one eligible instance is chosen. */
static void test_p2c(void **state) {
    (void)state;
    upstream d[3];
    for (int i = 0; i < 3; i++)
        fake(&d[i], UPSTREAM_DECODE, i, 0);
    d[2].has_load = 1, d[2].pub_running = 9;
    unsigned rr = 0;
    int hits[3] = {0};
    for (int k = 0; k < 200; k++)
        hits[policy_pick(POLICY_P2C, d, 3, &rr, 0, NULL, NULL)->index]++;
    assert_int_equal(hits[2], 0);
    assert_true(hits[0] > 20 && hits[1] > 20);
    assert_ptr_equal(policy_pick(POLICY_P2C, d, 3, &rr, 1 | 2, NULL, NULL), &d[2]);
    assert_null(policy_pick(POLICY_P2C, d, 3, &rr, 7, NULL, NULL));
    policy_kind k;
    assert_int_equal(policy_parse("p2c", &k), 0);
    assert_string_equal(policy_name(k), "p2c");
}

static void test_prefix_hash(void **state) {
    (void)state;
    json_t *a = json_pack("{s:s}", "prompt", "You are a helpful assistant. Question one");
    json_t *b = json_pack("{s:s}", "prompt", "You are a helpful assistant. Question two");
    json_t *c = json_pack("{s:[s]}", "prompt", "You are a helpful assistant. Question one");
    json_t *m = json_pack("{s:[{s:s,s:s}]}", "messages", "role", "user", "content", "hi");
    json_t *none = json_pack("{s:i}", "max_tokens", 3);
    assert_int_equal(pd_prefix_hash(a, 20), pd_prefix_hash(b, 20)); /* same first 20 bytes */
    assert_int_not_equal(pd_prefix_hash(a, 256), pd_prefix_hash(b, 256));
    assert_int_equal(pd_prefix_hash(a, 256), pd_prefix_hash(c, 256)); /* a list's first */
    assert_int_not_equal(pd_prefix_hash(m, 256), 0);
    assert_int_equal(pd_prefix_hash(none, 256), 0);
    json_decref(a);
    json_decref(b);
    json_decref(c);
    json_decref(m);
    json_decref(none);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_policy_discovery),
        cmocka_unit_test(test_prefix_hash),
        cmocka_unit_test(test_p2c),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
