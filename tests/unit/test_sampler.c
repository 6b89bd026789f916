/*
 * test_sampler — the sampler against distributions computed here independently:
 * greedy and tie-breaking, empirical frequencies under temperature / top-k / top-p / min-p
 * (20000 seeded draws vs. the analytic probabilities), seed reproducibility, repetition /
 * presence / frequency penalties, logprobs, stop ids, and invalid parameters.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/sampler.h"

#define V 5
static const double P5[V] = {0.5, 0.3, 0.1, 0.07, 0.03}; /* a known distribution */

static void fill(float *l) {
    for (int i = 0; i < V; i++)
        l[i] = (float)log(P5[i]) + 3.0f; /* shift: softmax unchanged */
}

/* Draws n samples with p, compares frequencies with want[] (must sum to 1). */
static void check_freq(const sampler_params *p, const double *want, int n) {
    char err[256];
    sampler *s = sampler_init(p, V, NULL, 0, err, sizeof err);
    assert_non_null(s);
    int cnt[V] = {0};
    for (int i = 0; i < n; i++) {
        float l[V];
        fill(l);
        sample_result r;
        assert_int_equal(sampler_sample(s, l, &r), 0);
        cnt[r.token]++;
    }
    for (int i = 0; i < V; i++) {
        double f = (double)cnt[i] / n, sd = sqrt(want[i] * (1 - want[i]) / n);
        if (fabs(f - want[i]) > 5 * sd + 1e-9)
            fail_msg("token %d: frequency %.4f, expected %.4f (5 sd = %.4f)", i, f, want[i],
                     5 * sd);
    }
    sampler_free(s);
}

static void test_distributions(void **st) {
    (void)st;
    sampler_params p;
    sampler_params_default(&p);
    p.has_seed = 1;
    p.seed = 7;
    p.temperature = 1.0f;
    check_freq(&p, P5, 20000);
    /* temperature 0.5: p^2 renormalised */
    double w[V], z = 0;
    for (int i = 0; i < V; i++)
        z += w[i] = P5[i] * P5[i];
    for (int i = 0; i < V; i++)
        w[i] /= z;
    p.temperature = 0.5f;
    check_freq(&p, w, 20000);
    p.temperature = 1.0f;
    p.top_k = 2; /* {0.5, 0.3} renormalised */
    double k2[V] = {0.625, 0.375, 0, 0, 0};
    check_freq(&p, k2, 20000);
    p.top_k = 0;
    p.top_p = 0.6f; /* 0.5 < 0.6, 0.8 >= 0.6: keep two */
    check_freq(&p, k2, 20000);
    p.top_p = 0.85f; /* 0.8 < 0.85 <= 0.9: keep three */
    double k3[V] = {0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9, 0, 0};
    check_freq(&p, k3, 20000);
    p.top_p = 1.0f;
    p.min_p = 0.15f; /* keep p >= 0.075: 0.5, 0.3, 0.1 */
    check_freq(&p, k3, 20000);
}

/* Large vocabulary: the top-p (and top-k) set (found here by a full sort in double) is exactly what
 * is sampled from. */
static const float *g_l;
static int cmp_l(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return g_l[x] > g_l[y] ? -1 : g_l[x] < g_l[y] ? 1 : x - y;
}

static void test_top_p_large_vocab(void **st) {
    (void)st;
    enum { BV = 50000 };
    static float l[BV], w[BV];
    static int order[BV], in_set[BV], seen[BV];
    uint64_t x = 99;
    for (int i = 0; i < BV; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        double u = (double)(x >> 11) / 9007199254740992.0;
        l[i] = (float)(-1.0 * log(-log(u + 1e-300) + 1e-300)); /* Gumbel-like logits */
        order[i] = i;
    }
    g_l = l;
    qsort(order, BV, sizeof *order, cmp_l);
    double z = 0, cum = 0;
    for (int i = 0; i < BV; i++)
        z += exp((double)l[i] - l[order[0]]);
    int set = 0;
    while (cum < 0.5)
        cum += exp((double)l[order[set]] - l[order[0]]) / z, in_set[order[set++]] = 1;
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 1.0f;
    p.top_p = 0.5f;
    p.has_seed = 1;
    char err[256];
    sampler *s = sampler_init(&p, BV, NULL, 0, err, sizeof err);
    int distinct = 0;
    for (int r = 0; r < 3000; r++) {
        memcpy(w, l, sizeof l);
        sample_result res;
        sampler_sample(s, w, &res);
        if (!in_set[res.token])
            fail_msg("token %d sampled outside the top-p set of %d tokens", res.token, set);
        distinct += !seen[res.token]++;
    }
    assert_true(set > 1);
    if (set <= 50) assert_int_equal(distinct, set); /* every member shows up */
    sampler_free(s);
    /* top-k with a large k (the bucketed path): only the k best ever come out */
    p.top_p = 1.0f;
    p.top_k = 100;
    p.temperature = 3.0f; /* flat enough that the whole set is reachable */
    memset(in_set, 0, sizeof in_set);
    for (int i = 0; i < 100; i++)
        in_set[order[i]] = 1;
    s = sampler_init(&p, BV, NULL, 0, err, sizeof err);
    for (int r = 0; r < 3000; r++) {
        memcpy(w, l, sizeof l);
        sample_result res;
        sampler_sample(s, w, &res);
        if (!in_set[res.token]) fail_msg("token %d sampled outside the top-100", res.token);
    }
    sampler_free(s);
}

static void test_greedy_and_ties(void **st) {
    (void)st;
    sampler_params p;
    sampler_params_default(&p);
    char err[256];
    sampler *s = sampler_init(&p, V, NULL, 0, err, sizeof err);
    float l[V] = {0.1f, 2.0f, -1.0f, 2.0f, 1.9f};
    sample_result r;
    sampler_sample(s, l, &r);
    assert_int_equal(r.token, 1); /* tie 1 vs 3: lower id */
    sampler_free(s);
}

/* which requests the engine may give the device argmax (no logits downloaded) */
static void test_plain_greedy(void **st) {
    (void)st;
    char err[256];
    struct {
        const char *what;
        float temperature, rep, presence, freq;
        int top_k, logprobs, want;
    } cases[] = {
        {"greedy", 0.0f, 1.0f, 0.0f, 0.0f, 0, 0, 1},
        {"top_k 1 at temperature 0.8", 0.8f, 1.0f, 0.0f, 0.0f, 1, 0, 1},
        {"temperature 0.8", 0.8f, 1.0f, 0.0f, 0.0f, 0, 0, 0},
        {"greedy with logprobs", 0.0f, 1.0f, 0.0f, 0.0f, 0, 2, 0},
        {"greedy with repetition penalty", 0.0f, 1.1f, 0.0f, 0.0f, 0, 0, 0},
        {"greedy with presence penalty", 0.0f, 1.0f, 0.5f, 0.0f, 0, 0, 0},
        {"greedy with frequency penalty", 0.0f, 1.0f, 0.0f, 0.5f, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        sampler_params p;
        sampler_params_default(&p);
        p.temperature = cases[i].temperature;
        p.repetition_penalty = cases[i].rep;
        p.presence_penalty = cases[i].presence;
        p.frequency_penalty = cases[i].freq;
        p.top_k = cases[i].top_k;
        p.logprobs = cases[i].logprobs;
        sampler *s = sampler_init(&p, V, NULL, 0, err, sizeof err);
        assert_non_null(s);
        if (sampler_plain_greedy(s) != cases[i].want) fail_msg("%s", cases[i].what);
        sampler_free(s);
    }
}

/* sampler_sample_premasked (logits the constraint was applied to on the device) draws the
 * tokens sampler_sample_masked draws from the raw logits, seed for seed, under temperature,
 * top-k, top-p, min-p, the penalties and a logit bias; its logprob is 0. */
static void test_premasked_equals_masked(void **st) {
    (void)st;
    enum { W = 1000, STEPS = 300 };
    uint32_t allow[(W + 31) / 32];
    float raw[W], a[W], b[W];
    int32_t bias_id = 7;
    float bias = 2.0f;
    for (int cfg = 0; cfg < 5; cfg++) {
        sampler_params p;
        sampler_params_default(&p);
        p.temperature = cfg == 4 ? 0.0f : 0.7f + 0.3f * (float)cfg;
        p.top_k = cfg == 1 ? 40 : cfg == 3 ? 300 : 0;
        p.top_p = cfg == 2 || cfg == 3 ? 0.9f : 1.0f;
        p.min_p = cfg == 3 ? 0.01f : 0.0f;
        p.repetition_penalty = cfg >= 2 ? 1.3f : 1.0f;
        p.frequency_penalty = cfg == 2 ? 0.5f : 0.0f;
        p.presence_penalty = cfg == 4 ? -0.5f : 0.0f;
        p.bias_ids = &bias_id, p.bias = &bias, p.n_bias = cfg == 1;
        p.has_seed = 1;
        p.seed = 99 + (uint64_t)cfg;
        char err[256];
        int32_t prompt[3] = {1, 2, 3};
        sampler *sm = sampler_init(&p, W, prompt, 3, err, sizeof err),
                *sp = sampler_init(&p, W, prompt, 3, err, sizeof err);
        assert_non_null(sm);
        assert_non_null(sp);
        uint32_t x = 17u + (uint32_t)cfg;
        for (int step = 0; step < STEPS; step++) {
            for (int i = 0; i < W; i++) {
                x = x * 1664525u + 1013904223u;
                raw[i] = (float)(x >> 8) / 16777216.0f * 8.0f - 4.0f;
            }
            for (int w = 0; w < (W + 31) / 32; w++) {
                x = x * 1664525u + 1013904223u;
                allow[w] = step % 3 == 0 ? x & (x >> 7) : step % 3 == 1 ? x : 0xFFFFFFFFu;
            }
            allow[0] |= 1u << 5;
            memcpy(a, raw, sizeof raw);
            for (int i = 0; i < W; i++) /* the device's mask */
                b[i] = allow[i / 32] >> (i % 32) & 1u ? raw[i] : -INFINITY;
            sample_result ra, rb;
            assert_int_equal(sampler_sample_masked(sm, a, allow, &ra), 0);
            assert_int_equal(sampler_sample_premasked(sp, b, allow, &rb), 0);
            if (ra.token != rb.token)
                fail_msg("config %d step %d: masked drew %d, premasked %d", cfg, step, ra.token,
                         rb.token);
            assert_true(allow[rb.token / 32] >> (rb.token % 32) & 1u);
            assert_true(rb.logprob == 0.0f);
        }
        sampler_free(sm);
        sampler_free(sp);
    }
}

static void test_seed_reproducible(void **st) {
    (void)st;
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = 1.0f;
    p.has_seed = 1;
    p.seed = 12345;
    char err[256];
    int a[64], b[64], c[64], same = 1;
    for (int run = 0; run < 3; run++) {
        if (run == 2) p.seed = 54321;
        sampler *s = sampler_init(&p, V, NULL, 0, err, sizeof err);
        for (int i = 0; i < 64; i++) {
            float l[V];
            fill(l);
            sample_result r;
            sampler_sample(s, l, &r);
            (run == 0 ? a : run == 1 ? b : c)[i] = r.token;
        }
        sampler_free(s);
    }
    assert_memory_equal(a, b, sizeof a);
    for (int i = 0; i < 64; i++)
        same &= a[i] == c[i];
    assert_false(same);
}

/* sampler_accept_drawn: a sampler told the first token another sampler with the same
 * parameters and seed drew (a prefill instance's) continues that sampler's stream
 * exactly — the seeded first-token handoff; penalties see the token too.  A sampler
 * that only sampler_accept()s it (no skipped draw) drifts off the stream. */
static void test_accept_drawn_continues_stream(void **st) {
    (void)st;
    for (int greedy = 0; greedy < 2; greedy++) {
        sampler_params p;
        sampler_params_default(&p);
        p.temperature = greedy ? 0.0f : 1.0f;
        p.frequency_penalty = 0.3f;
        p.has_seed = 1;
        p.seed = 777;
        char err[256];
        sampler *a = sampler_init(&p, V, NULL, 0, err, sizeof err);
        sampler *b = sampler_init(&p, V, NULL, 0, err, sizeof err);
        sampler *c = sampler_init(&p, V, NULL, 0, err, sizeof err);
        assert_true(a && b && c);
        float l[V];
        sample_result r;
        fill(l);
        sampler_sample(a, l, &r); /* the producer's draw */
        sampler_accept_drawn(b, r.token);
        sampler_accept(c, r.token);
        int same_c = 1;
        for (int i = 0; i < 64; i++) {
            sample_result ra, rb, rc;
            fill(l);
            sampler_sample(a, l, &ra);
            fill(l);
            sampler_sample(b, l, &rb);
            fill(l);
            sampler_sample(c, l, &rc);
            assert_int_equal(ra.token, rb.token);
            same_c &= ra.token == rc.token;
        }
        if (!greedy) assert_false(same_c); /* the skipped draw matters */
        sampler_free(a);
        sampler_free(b);
        sampler_free(c);
    }
}

static void test_penalties(void **st) {
    (void)st;
    sampler_params p;
    sampler_params_default(&p);
    char err[256];
    sample_result r;
    /* repetition: token 0 in the prompt, 2.0 / 2 = 1.0 < 1.5 */
    p.repetition_penalty = 2.0f;
    int32_t prompt[1] = {0};
    sampler *s = sampler_init(&p, V, prompt, 1, err, sizeof err);
    float l[V] = {2.0f, 1.5f, -1.0f, 0.0f, 0.0f};
    sampler_sample(s, l, &r);
    assert_int_equal(r.token, 1);
    /* 1 is now an output token too: 0 -> 1.0, 1 -> 0.75, 4 unpenalised 1.1 wins */
    float l2[V] = {2.0f, 1.5f, -1.0f, 0.0f, 1.1f};
    sampler_sample(s, l2, &r);
    assert_int_equal(r.token, 4);
    sampler_free(s);
    /* negative logits are multiplied */
    float l3[V] = {-1.0f, -1.5f, -5.0f, -5.0f, -5.0f};
    s = sampler_init(&p, V, prompt, 1, err, sizeof err);
    sampler_sample(s, l3, &r);
    assert_int_equal(r.token, 1); /* -1 * 2 = -2 < -1.5 */
    sampler_free(s);
    /* frequency and presence: output-only */
    sampler_params_default(&p);
    p.frequency_penalty = 0.3f;
    p.presence_penalty = 0.2f;
    s = sampler_init(&p, V, prompt, 1, err, sizeof err);
    sampler_accept(s, 1);
    sampler_accept(s, 1);
    float l4[V] = {1.0f, 1.75f, 0.0f, 0.0f, 0.0f}; /* 1.75 - 0.6 - 0.2 = 0.95 < 1.0 */
    sampler_sample(s, l4, &r);
    assert_int_equal(r.token, 0);
    float l5[V] = {1.0f, 1.85f, 0.0f, 0.0f, 0.0f}; /* 1.85 - 0.8 = 1.05 > 1.0 - 0.5 */
    sampler_sample(s, l5, &r);
    assert_int_equal(r.token, 1);
    sampler_free(s);
}

static void test_logprobs_and_stop(void **st) {
    (void)st;
    sampler_params p;
    sampler_params_default(&p);
    p.logprobs = 3;
    p.stop_ids[0] = 0;
    p.n_stop = 1;
    p.repetition_penalty = 1.5f; /* must not change the reported (raw) logprobs */
    char err[256];
    int32_t prompt[1] = {1};
    sampler *s = sampler_init(&p, V, prompt, 1, err, sizeof err);
    float l[V];
    fill(l);
    sample_result r;
    sampler_sample(s, l, &r);
    assert_int_equal(r.token, 0);
    assert_int_equal(r.is_stop, 1);
    assert_true(fabs(r.logprob - log(0.5)) < 1e-5);
    assert_int_equal(r.n_top, 3);
    int want[3] = {0, 1, 2};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(r.top_ids[i], want[i]);
        assert_true(fabs(r.top_logprobs[i] - log(P5[want[i]])) < 1e-5);
    }
    sampler_free(s);
}

static void expect_bad(sampler_params *p, const char *needle) {
    char err[256] = "";
    assert_int_equal(sampler_params_check(p, V, err, sizeof err), -EINVAL);
    if (!strstr(err, needle)) fail_msg("error '%s' does not mention '%s'", err, needle);
    assert_null(sampler_init(p, V, NULL, 0, err, sizeof err));
    sampler_params_default(p);
}

/* logit_bias, allowed_token_ids, bad_words (vLLM's logit processors): greedy picks the
 * biased / allowed token; a two-token bad word bans its last token only after its first;
 * logprobs stay the raw distribution's; the sampled distribution under allowed_token_ids is
 * the renormalised restriction; and none of them is a "plain greedy" request. */
static void test_logit_processors(void **st) {
    (void)st;
    char err[256];
    sampler_params p;
    sampler_params_default(&p);
    sample_result r;
    float l[V];
    /* logit_bias: +3 on token 2 (logit log 0.1 + 3 + 3 > log 0.5 + 3) */
    int32_t bid[1] = {2};
    float bv[1] = {3.0f};
    p.bias_ids = bid, p.bias = bv, p.n_bias = 1, p.logprobs = 1;
    sampler *s = sampler_init(&p, V, NULL, 0, err, sizeof err);
    assert_non_null(s);
    assert_false(sampler_plain_greedy(s));
    fill(l);
    assert_int_equal(sampler_sample(s, l, &r), 0);
    assert_int_equal(r.token, 2);
    assert_true(fabs(r.logprob - log(0.1)) < 1e-5); /* raw, before the bias */
    assert_int_equal(r.top_ids[0], 0);
    sampler_free(s);
    /* allowed_token_ids {3, 4}: greedy 3; sampled at temperature 1: 0.07 : 0.03 */
    sampler_params_default(&p);
    int32_t al[2] = {4, 3};
    p.allowed = al, p.n_allowed = 2;
    s = sampler_init(&p, V, NULL, 0, err, sizeof err);
    assert_non_null(s);
    assert_false(sampler_plain_greedy(s));
    fill(l);
    assert_int_equal(sampler_sample(s, l, &r), 0);
    assert_int_equal(r.token, 3);
    sampler_free(s);
    p.temperature = 1.0f, p.has_seed = 1, p.seed = 11;
    double want[V] = {0, 0, 0, 0.7, 0.3};
    check_freq(&p, want, 20000);
    /* bad words: [0] always banned; [1, 2]: 2 banned right after a 1 */
    sampler_params_default(&p);
    int32_t bad[3] = {0, 1, 2}, lens[2] = {1, 2};
    p.bad_ids = bad, p.bad_lens = lens, p.n_bad = 2;
    s = sampler_init(&p, V, NULL, 0, err, sizeof err);
    assert_non_null(s);
    fill(l);
    assert_int_equal(sampler_sample(s, l, &r), 0);
    assert_int_equal(r.token, 1); /* 0 banned */
    l[0] = 0, l[1] = 0, l[2] = 9, l[3] = 1, l[4] = 0;
    assert_int_equal(sampler_sample(s, l, &r), 0);
    assert_int_equal(r.token, 3); /* 2 follows the 1 just produced: banned */
    l[0] = 0, l[1] = 0, l[2] = 9, l[3] = 1, l[4] = 0;
    assert_int_equal(sampler_sample(s, l, &r), 0);
    assert_int_equal(r.token, 2); /* after a 3 it is allowed */
    sampler_free(s);
    /* bad values */
    sampler_params_default(&p);
    int32_t oob[1] = {V};
    p.bias_ids = oob, p.bias = bv, p.n_bias = 1;
    assert_null(sampler_init(&p, V, NULL, 0, err, sizeof err));
    assert_non_null(strstr(err, "logit_bias"));
    sampler_params_default(&p);
    p.allowed = oob, p.n_allowed = 1;
    assert_null(sampler_init(&p, V, NULL, 0, err, sizeof err));
    assert_non_null(strstr(err, "allowed_token_ids"));
    sampler_params_default(&p);
    p.bad_ids = oob, p.bad_lens = lens, p.n_bad = 1;
    assert_null(sampler_init(&p, V, NULL, 0, err, sizeof err));
    assert_non_null(strstr(err, "bad_words"));
}

static void test_invalid(void **st) {
    (void)st;
    sampler_params p;
    sampler_params_default(&p);
    p.temperature = -0.5f;
    expect_bad(&p, "temperature -0.5");
    p.temperature = NAN;
    expect_bad(&p, "temperature");
    p.top_p = 0.0f;
    expect_bad(&p, "top_p 0");
    p.top_p = 1.5f;
    expect_bad(&p, "top_p 1.5");
    p.top_k = -2;
    expect_bad(&p, "top_k -2");
    p.top_k = V + 1;
    expect_bad(&p, "top_k 6");
    p.min_p = 2.0f;
    expect_bad(&p, "min_p 2");
    p.repetition_penalty = 0.0f;
    expect_bad(&p, "repetition_penalty 0");
    p.presence_penalty = 3.0f;
    expect_bad(&p, "presence_penalty 3");
    p.frequency_penalty = -2.5f;
    expect_bad(&p, "frequency_penalty -2.5");
    p.logprobs = 21;
    expect_bad(&p, "logprobs 21");
    p.n_stop = 1;
    p.stop_ids[0] = V;
    expect_bad(&p, "stop token id 5");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_distributions),
        cmocka_unit_test(test_top_p_large_vocab),
        cmocka_unit_test(test_greedy_and_ties),
        cmocka_unit_test(test_seed_reproducible),
        cmocka_unit_test(test_premasked_equals_masked),
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_logprobs_and_stop),
        cmocka_unit_test(test_invalid),
        cmocka_unit_test(test_logit_processors),
        cmocka_unit_test(test_plain_greedy),
        cmocka_unit_test(test_accept_drawn_continues_stream),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
