/*
 * test_model_sotu — the CPU Qwen2 forward on the shipped trained model
 * (models/disagg-sotu-tiny) against its independent PyTorch/transformers reference outputs
 * (tests/data/sotu-tiny): the six greedy continuations token for token (prefill, then one
 * token per forward, stopping at the eos ids), and the held-out negative log-likelihood of
 * the first SOTU_WINDOWS 1024-token windows, each within 1e-5 relative (all 50 windows:
 * set SOTU_WINDOWS=50 in the environment; the full run gives 216918.151 vs 216918.151).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/decoder.h"

static decoder_model g_m;

static int setup(void **st) {
    (void)st;
    char err[1024];
    if (decoder_load(&g_m, DISAGG_SOURCE_DIR "/models/disagg-sotu-tiny", 0, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **st) {
    (void)st;
    decoder_free(&g_m);
    return 0;
}

static json_t *load_json(const char *name) {
    char p[1024];
    snprintf(p, sizeof p, "%s/tests/data/sotu-tiny/%s", DISAGG_SOURCE_DIR, name);
    json_error_t je;
    json_t *j = json_load_file(p, 0, &je);
    if (!j) fail_msg("%s: %s", p, je.text);
    return j;
}

static void test_greedy(void **st) {
    (void)st;
    json_t *g = load_json("greedy.json");
    int V = g_m.cfg.vocab_size,
        max_new = (int)json_integer_value(json_object_get(g, "max_new_tokens"));
    json_t *eos = json_object_get(g, "eos_token_ids");
    decoder_state *s = decoder_state_init(&g_m, 512, 0);
    float *logits = malloc((size_t)V * sizeof(float));
    size_t pi;
    json_t *pr;
    json_array_foreach(json_object_get(g, "prompts"), pi, pr) {
        json_t *jp = json_object_get(pr, "prompt_ids"), *jo = json_object_get(pr, "output_ids");
        int n = (int)json_array_size(jp);
        int32_t *ids = malloc((size_t)(n + max_new) * sizeof *ids);
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)json_integer_value(json_array_get(jp, (size_t)i));
        kv_store kv;
        int nb = (n + max_new) / 16 + 1;
        assert_int_equal(kv_store_init(&kv, &g_m.cfg, nb, 16), 0);
        int32_t *table = malloc((size_t)nb * sizeof *table);
        for (int b = 0; b < nb; b++)
            table[b] = b;
        decoder_seq q = {ids, n, 0, table, nb, logits, 0, NULL, NULL};
        assert_int_equal(decoder_forward(&g_m, s, &kv, &q, 1), 0);
        int out = 0;
        for (; out < max_new; out++) {
            int best = 0;
            for (int v = 1; v < V; v++)
                if (logits[v] > logits[best]) best = v;
            if (out >= (int)json_array_size(jo))
                fail_msg("prompt %zu: reference stopped after %d tokens, we produced %d more", pi,
                         out, best);
            int want = (int)json_integer_value(json_array_get(jo, (size_t)out));
            if (best != want)
                fail_msg("prompt %zu step %d: token %d, transformers %d", pi, out, best, want);
            int stop = 0;
            for (size_t e = 0; e < json_array_size(eos); e++)
                stop |= best == (int)json_integer_value(json_array_get(eos, e));
            if (stop) {
                out++;
                break;
            }
            ids[n + out] = best;
            decoder_seq d = {&ids[n + out], 1, n + out, table, nb, logits, 0, NULL, NULL};
            assert_int_equal(decoder_forward(&g_m, s, &kv, &d, 1), 0);
        }
        assert_int_equal(out, (int)json_array_size(jo));
        kv_store_free(&kv);
        free(table);
        free(ids);
    }
    free(logits);
    decoder_state_free(s);
    json_decref(g);
}

static void test_heldout_nll(void **st) {
    (void)st;
    json_t *h = load_json("heldout_eval.json"), *hi = load_json("heldout_ids.json");
    json_t *jids = json_object_get(hi, "ids"), *pw = json_object_get(h, "per_window");
    int W = (int)json_integer_value(json_object_get(h, "eval_context")), V = g_m.cfg.vocab_size;
    int total = (int)json_array_size(jids);
    int32_t *ids = malloc((size_t)total * sizeof *ids);
    for (int i = 0; i < total; i++)
        ids[i] = (int32_t)json_integer_value(json_array_get(jids, (size_t)i));
    decoder_state *s = decoder_state_init(&g_m, W, 0);
    float *logits = malloc((size_t)W * V * sizeof(float));
    kv_store kv;
    int nb = W / 16 + 1;
    assert_int_equal(kv_store_init(&kv, &g_m.cfg, nb, 16), 0);
    int32_t *table = malloc((size_t)nb * sizeof *table);
    for (int b = 0; b < nb; b++)
        table[b] = b;
    double sum = 0, worst = 0, want = 0;
    int w = 0, max_w = getenv("SOTU_WINDOWS") ? atoi(getenv("SOTU_WINDOWS")) : 6;
    for (int start = 0; start < total && w < max_w; start += W, w++) {
        int n = total - start < W ? total - start : W;
        decoder_seq q = {ids + start, n, 0, table, nb, logits, 1, NULL, NULL};
        assert_int_equal(decoder_forward(&g_m, s, &kv, &q, 1), 0);
        double wsum = 0;
        for (int t = 1; t < n; t++) {
            const float *row = logits + (size_t)(t - 1) * V;
            float mx = row[0];
            for (int v = 1; v < V; v++)
                if (row[v] > mx) mx = row[v];
            double z = 0;
            for (int v = 0; v < V; v++)
                z += (double)expf(row[v] - mx);
            wsum += log(z) + mx - row[ids[start + t]];
        }
        double ref = json_number_value(json_object_get(json_array_get(pw, (size_t)w), "sum_nll"));
        double rel = fabs(wsum - ref) / ref;
        if (rel > worst) worst = rel;
        if (rel > 1e-5)
            fail_msg("window %d: NLL %.6f, transformers %.6f (rel %.2g)", w, wsum, ref, rel);
        sum += wsum;
        want += ref;
    }
    if (w == (int)json_array_size(pw)) want = json_number_value(json_object_get(h, "sum_nll"));
    fprintf(stderr,
            "held-out NLL of %d windows %.4f vs transformers %.4f (worst window rel %.2g)\n", w,
            sum, want, worst);
    assert_true(fabs(sum - want) / want < 1e-6);
    kv_store_free(&kv);
    free(table);
    free(logits);
    free(ids);
    decoder_state_free(s);
    json_decref(h);
    json_decref(hi);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_heldout_nll),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
