/* Unit tests: engine/sampler — greedy, seeded reproducibility, top-k/top-p/
 * min-p, penalties, logprobs, validation.  Expected values are computed here
 * from the definitions (softmax), not from the sampler. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/sampler.h"

#include <math.h>
#include <string.h>

#define V 50

static void fill(float *l) {
    for (int i = 0; i < V; i++)
        l[i] = (float)((i * 37) % V) / 10.0f; /* a permutation of 0..4.9 */
}

static engine_sampling greedy(void) {
    engine_sampling s;
    engine_sampling_init(&s);
    s.temperature = 0;
    return s;
}

static void test_greedy(void **state) {
    (void)state;
    float l[V];
    fill(l);
    engine_sampling s = greedy();
    int32_t best = 0;
    for (int i = 0; i < V; i++)
        if (l[i] > l[best]) best = i;
    assert_int_equal(sampler_sample(&s, l, V, NULL, 0, 0, NULL), best);
    float t[4] = {1, 3, 3, 2}; /* ties go to the lowest id, like torch.argmax */
    assert_int_equal(sampler_sample(&s, t, 4, NULL, 0, 0, NULL), 1);
}

static void test_seeded_reproducible_and_distributed(void **state) {
    (void)state;
    engine_sampling s;
    engine_sampling_init(&s);
    s.temperature = 1.0f;
    float base[V], l[V];
    fill(base);
    int counts[V] = {0};
    sampler_rng a, b;
    sampler_rng_seed(&a, 1234);
    sampler_rng_seed(&b, 1234);
    enum { N = 20000 };
    for (int i = 0; i < N; i++) {
        memcpy(l, base, sizeof l);
        int32_t x = sampler_sample(&s, l, V, NULL, 0, 0, &a);
        memcpy(l, base, sizeof l);
        int32_t y = sampler_sample(&s, l, V, NULL, 0, 0, &b);
        assert_int_equal(x, y);
        counts[x]++;
    }
    double z = 0;
    for (int i = 0; i < V; i++)
        z += exp(base[i]);
    for (int i = 0; i < V; i++) {
        double p = exp(base[i]) / z, sd = sqrt(N * p * (1 - p));
        assert_true(fabs(counts[i] - N * p) < 5 * sd + 2);
    }
}

static void test_top_k_top_p_min_p(void **state) {
    (void)state;
    float base[V], l[V];
    fill(base);
    int32_t best = 0;
    for (int i = 0; i < V; i++)
        if (base[i] > base[best]) best = i;
    sampler_rng r;
    sampler_rng_seed(&r, 7);
    engine_sampling s;
    engine_sampling_init(&s);
    s.temperature = 5.0f;
    s.top_k = 1;
    for (int i = 0; i < 100; i++) {
        memcpy(l, base, sizeof l);
        assert_int_equal(sampler_sample(&s, l, V, NULL, 0, 0, &r), best);
    }
    engine_sampling_init(&s);
    s.top_p = 1e-6f;
    for (int i = 0; i < 100; i++) {
        memcpy(l, base, sizeof l);
        assert_int_equal(sampler_sample(&s, l, V, NULL, 0, 0, &r), best);
    }
    /* top_k = 3: only the three largest logits are ever drawn */
    engine_sampling_init(&s);
    s.top_k = 3;
    for (int i = 0; i < 300; i++) {
        memcpy(l, base, sizeof l);
        int32_t x = sampler_sample(&s, l, V, NULL, 0, 0, &r);
        assert_true(base[x] >= 4.7f - 1e-6f);
    }
    /* min_p = 0.5: only tokens with p >= 0.5 * p_max, i.e. logit >= max + ln 0.5 */
    engine_sampling_init(&s);
    s.min_p = 0.5f;
    for (int i = 0; i < 300; i++) {
        memcpy(l, base, sizeof l);
        int32_t x = sampler_sample(&s, l, V, NULL, 0, 0, &r);
        assert_true(base[x] >= 4.9f + logf(0.5f) - 1e-6f);
    }
}

static void test_penalties(void **state) {
    (void)state;
    float l[4] = {2.0f, 1.9f, -1.0f, 0.5f};
    int32_t toks[3] = {0, 3, 0}; /* prompt: token 0; output: 3, 0 */
    engine_sampling s = greedy();
    s.repetition_penalty = 2.0f; /* 0 -> 1.0, 3 -> 0.25: 1 wins */
    assert_int_equal(sampler_sample(&s, l, 4, toks, 3, 1, NULL), 1);
    assert_true(fabsf(l[0] - 1.0f) < 1e-6f && fabsf(l[3] - 0.25f) < 1e-6f && l[2] == -1.0f);
    float m[4] = {2.0f, 1.9f, -1.0f, 0.5f};
    s = greedy();
    s.frequency_penalty = 0.2f; /* token 0 appears once in the output: 2.0 - 0.2 */
    assert_int_equal(sampler_sample(&s, m, 4, toks, 3, 1, NULL), 1);
    float n[4] = {2.0f, 1.9f, -1.0f, 0.5f};
    s = greedy();
    s.presence_penalty = 0.05f; /* 1.95 still beats 1.9 */
    assert_int_equal(sampler_sample(&s, n, 4, toks, 3, 1, NULL), 0);
    float o[4] = {2.0f, 1.9f, -1.0f, 0.5f};
    int32_t only_prompt[1] = {0}; /* presence/frequency ignore the prompt */
    s = greedy();
    s.presence_penalty = 2.0f;
    assert_int_equal(sampler_sample(&s, o, 4, only_prompt, 1, 1, NULL), 0);
}

static void test_logprobs(void **state) {
    (void)state;
    float l[V];
    fill(l);
    float lp, top[5];
    int32_t ids[5];
    int n;
    sampler_logprobs(l, V, 3, 5, &lp, ids, top, &n);
    double z = 0;
    for (int i = 0; i < V; i++)
        z += exp(l[i]);
    assert_true(fabs(lp - (l[3] - log(z))) < 1e-5);
    assert_int_equal(n, 5);
    for (int i = 0; i < 5; i++) {
        assert_true(fabs(l[ids[i]] - (4.9 - 0.1 * i)) < 1e-5);
        assert_true(fabs(top[i] - (l[ids[i]] - log(z))) < 1e-5);
    }
    sampler_logprobs(l, V, 0, 0, &lp, ids, top, &n);
    assert_int_equal(n, 0);
}

static void test_validation(void **state) {
    (void)state;
    char err[256];
    engine_sampling s;
    engine_sampling_init(&s);
    assert_int_equal(sampler_validate(&s, err, sizeof err), 0);
    const char *fields[] = {"temperature",
                            "top_p",
                            "top_p",
                            "top_k",
                            "min_p",
                            "repetition_penalty",
                            "presence_penalty",
                            "frequency_penalty",
                            "logprobs",
                            "prompt_logprobs"};
    for (int i = 0; i < 10; i++) {
        engine_sampling_init(&s);
        switch (i) {
        case 0:
            s.temperature = -0.5f;
            break;
        case 1:
            s.top_p = 0;
            break;
        case 2:
            s.top_p = 1.5f;
            break;
        case 3:
            s.top_k = -2;
            break;
        case 4:
            s.min_p = 2;
            break;
        case 5:
            s.repetition_penalty = 0;
            break;
        case 6:
            s.presence_penalty = 3;
            break;
        case 7:
            s.frequency_penalty = -2.5f;
            break;
        case 8:
            s.logprobs = 21;
            break;
        case 9:
            s.prompt_logprobs = -2;
            break;
        }
        err[0] = 0;
        assert_int_equal(sampler_validate(&s, err, sizeof err), -22);
        assert_non_null(strstr(err, fields[i]));
    }
    engine_sampling_init(&s);
    s.temperature = NAN;
    assert_int_equal(sampler_validate(&s, err, sizeof err), -22);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_seeded_reproducible_and_distributed),
        cmocka_unit_test(test_top_k_top_p_min_p),
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test(test_validation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
