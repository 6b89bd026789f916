/*
 * test_model_golden — the CPU forward against Hugging Face transformers (float32, eager
 * attention) logits for the random tiny models (tests/data/model/golden-*.json, made by
 * tools/gen_golden_logits.py for Qwen2 and tools/gen_golden_arch.py for Llama 3 (llama3
 * rope, tied), Qwen3 (q/k norm, head_dim 32 != 64/4, yarn rope, tied) and Mistral (sliding
 * window 8 < the prompts, head_dim 24, linear rope), Qwen3-MoE and Mixtral (mixtures of
 * experts, transformers' eager loop over experts)): relative error <= 1e-4 (f32 weights) /
 * 1e-2 (bf16 weights) on the reference's top-16 and 32 fixed vocabulary ids at every stored
 * position, and the 16-token greedy continuation agrees.  The RoPE tables equal
 * transformers' inv_freq and attention scaling.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <math.h>
#include <stdio.h>

#include "kernels/cpu/cpu_matmul.h"
#include "model/arch.h"
#include "model/decoder.h"
#include "test_model_fixture.h"

#define BLOCK 16

static int argmax(const float *v, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

static void check_model_ex(const char *name, double tol, int load_flags) {
    char dir[1024], err[1024];
    json_t *g = fixture_model(name, dir, sizeof dir);
    assert_non_null(g);
    decoder_model m;
    int rc = decoder_load_ex(&m, dir, backend_cpu_default(), 0, load_flags, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, 0);
    decoder_state *s = decoder_state_init(&m, 256, 0);
    assert_non_null(s);
    int V = m.cfg.vocab_size;
    json_t *cases = json_object_get(g, "cases");
    size_t ci;
    json_t *cs;
    double worst = 0;
    json_array_foreach(cases, ci, cs) {
        json_t *jp = json_object_get(cs, "prompt_ids");
        int n = (int)json_array_size(jp);
        int32_t *ids = malloc((size_t)(n + 16) * sizeof *ids);
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)json_integer_value(json_array_get(jp, (size_t)i));
        kv_store kv;
        assert_int_equal(kv_store_init(&kv, &m.cfg, (n + 16) / BLOCK + 1, BLOCK), 0);
        int32_t table[64];
        for (int b = 0; b < kv.n_blocks; b++)
            table[b] = kv.n_blocks - 1 - b; /* any order works */
        float *logits = malloc((size_t)n * V * sizeof(float));
        decoder_seq sq = {ids, n, 0, table, kv.n_blocks, logits, 1, NULL, NULL};
        assert_int_equal(decoder_forward(&m, s, &kv, &sq, 1), 0);
        size_t ri;
        json_t *row;
        json_array_foreach(json_object_get(cs, "rows"), ri, row) {
            int pos = (int)json_integer_value(json_object_get(row, "pos"));
            json_t *rid = json_object_get(row, "ids"), *rl = json_object_get(row, "logits");
            for (size_t k = 0; k < json_array_size(rid); k++) {
                int id = (int)json_integer_value(json_array_get(rid, k));
                double ref = json_real_value(json_array_get(rl, k));
                double got = logits[(size_t)pos * V + id];
                double rel = fabs(got - ref) / fmax(fabs(ref), 1.0);
                if (rel > worst) worst = rel;
                if (rel > tol)
                    fail_msg(
                        "%s case %zu pos %d id %d: got %.7g, transformers %.7g (rel %.3g > %.0e)",
                        name, ci, pos, id, got, ref, rel, tol);
            }
        }
        /* greedy continuation, one token per forward */
        json_t *gr = json_object_get(cs, "greedy");
        int cur = argmax(logits + (size_t)(n - 1) * V, V);
        for (size_t k = 0; k < json_array_size(gr); k++) {
            int want = (int)json_integer_value(json_array_get(gr, k));
            if (cur != want)
                fail_msg("%s case %zu greedy step %zu: got %d, transformers %d", name, ci, k, cur,
                         want);
            ids[n + k] = cur;
            decoder_seq st = {&ids[n + k], 1, n + (int)k, table, kv.n_blocks, logits, 0, NULL, NULL};
            assert_int_equal(decoder_forward(&m, s, &kv, &st, 1), 0);
            cur = argmax(logits, V);
        }
        free(logits);
        free(ids);
        kv_store_free(&kv);
    }
    fprintf(stderr, "%s: worst relative error vs transformers %.3g (tolerance %.0e), isa %s\n",
            name, worst, tol, cpu_isa_name(cpu_isa_get()));
    decoder_state_free(s);
    decoder_free(&m);
    json_decref(g);
}

static void check_model(const char *name, double tol) {
    check_model_ex(name, tol, 0);
}

static int g_skipped; /* tests skipped for a missing ISA */

/* Run on the named ISA (forced, so a CPU without AVX2 cannot quietly test scalar twice). */
static void with_isa(cpu_isa isa, const char *name, double tol) {
    cpu_isa prev = cpu_isa_get();
    if (cpu_isa_force(isa) != 0) {
        fprintf(stderr, "SKIPPED: this CPU lacks %s: %s NOT checked against the golden logits\n",
                cpu_isa_name(isa), name);
        g_skipped++;
        skip();
    }
    check_model(name, tol);
    cpu_isa_force(prev);
}

static void test_golden_f32_avx2(void **st) {
    (void)st;
    with_isa(CPU_ISA_AVX2, "tiny-f32", 1e-4);
}

static void test_golden_bf16(void **st) {
    (void)st;
    with_isa(cpu_isa_get(), "tiny-bf16", 1e-2); /* the detected ISA (f32 runs on both) */
}

/* the architectures beside Qwen2: f32 weights, the detected ISA, and the RoPE table */
static void check_arch(const char *name) {
    char dir[1024], err[1024];
    json_t *g = fixture_model(name, dir, sizeof dir);
    assert_non_null(g);
    decoder_model m;
    int rc = decoder_load(&m, dir, 0, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, 0);
    json_t *inv = json_object_get(g, "rope_inv_freq");
    int half = m.cfg.head_dim / 2;
    assert_int_equal((int)json_array_size(inv), half);
    float tab[512], af;
    arch_rope_table(&m.cfg, tab, &af);
    for (int i = 0; i < half; i++) {
        double ref = json_real_value(json_array_get(inv, (size_t)i));
        if (fabs(tab[i] - ref) > 1e-6 * fabs(ref))
            fail_msg("%s inv_freq[%d]: %.9g, transformers %.9g", name, i, tab[i], ref);
    }
    double ref_af = json_real_value(json_object_get(g, "rope_attention_scaling"));
    if (fabs(af - ref_af) > 1e-6)
        fail_msg("%s attention factor %.9g, transformers %.9g", name, af, ref_af);
    decoder_free(&m);
    json_decref(g);
    check_model(name, 1e-4);
}

static void test_golden_llama3(void **st) {
    (void)st;
    check_arch("llama-tiny");
}

static void test_golden_qwen3(void **st) {
    (void)st;
    check_arch("qwen3-tiny");
}

static void test_golden_mistral_window(void **st) {
    (void)st;
    check_arch("mistral-tiny");
}

/* FP8 checkpoints on the CPU: dequantized at load (e4m3 * scale in f32), against transformers
 * on the f32-dequantized twin (tools/gen_golden_fp8.py): the same weights, so the f32 tolerance.
 * 128 x 128 blocks with partial blocks (quant_method fp8, weight_scale_inv), compressed-tensors
 * per channel (bf16 scales) and per tensor with a static input_scale, and --quantization fp8 on
 * an f32 checkpoint (per-channel scales made at load, as the twin's). */
static void test_golden_fp8_block(void **st) {
    (void)st;
    check_model("qwen2-fp8-block-tiny", 1e-4);
}

static void test_golden_fp8_channel(void **st) {
    (void)st;
    check_model("llama-fp8-channel-tiny", 1e-4);
}

static void test_golden_fp8_tensor_static(void **st) {
    (void)st;
    check_model("qwen3-fp8-tensor-tiny", 1e-4);
}

static void test_golden_fp8_online(void **st) {
    (void)st;
    check_model_ex("qwen2-online-tiny", 1e-4, DECODER_LOAD_FP8);
}

/* mixtures of experts: Qwen3-MoE (a dense layer among sparse ones, norm_topk_prob, q/k
 * norm, head_dim from hidden / heads) and Mixtral (top 2 of 4, sliding window 8) */
static void test_golden_qwen3moe(void **st) {
    (void)st;
    check_arch("qwen3moe-tiny");
}

static void test_golden_mixtral(void **st) {
    (void)st;
    check_arch("mixtral-tiny");
}

static void test_golden_f32_scalar(void **st) {
    (void)st;
    with_isa(CPU_ISA_SCALAR, "tiny-f32", 1e-4);
}

/* DISAGG_CPU_ISA=NAME (the ctest entries unit.NAME.ISA): run on that ISA, or say loudly that
 * this CPU cannot and skip (77), rather than quietly testing another one. */
static int isa_from_env(void) {
    const char *want = getenv("DISAGG_CPU_ISA");
    if (want && *want && strcmp(cpu_isa_name(cpu_isa_get()), want)) {
        fprintf(stderr,
                "SKIPPED: DISAGG_CPU_ISA=%s but this CPU cannot run it (running %s): "
                "NOT tested on %s\n",
                want, cpu_isa_name(cpu_isa_get()), want);
        return 77;
    }
    fprintf(stderr, "kernels: %s\n", cpu_isa_describe());
    return 0;
}

int main(void) {
    if (isa_from_env()) return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_f32_avx2),   cmocka_unit_test(test_golden_bf16),
        cmocka_unit_test(test_golden_f32_scalar), cmocka_unit_test(test_golden_llama3),
        cmocka_unit_test(test_golden_qwen3),      cmocka_unit_test(test_golden_mistral_window),
        cmocka_unit_test(test_golden_qwen3moe),   cmocka_unit_test(test_golden_mixtral),
        cmocka_unit_test(test_golden_fp8_block), cmocka_unit_test(test_golden_fp8_channel),
        cmocka_unit_test(test_golden_fp8_tensor_static), cmocka_unit_test(test_golden_fp8_online),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    return failed == 0 && g_skipped ? 77 : failed; /* 77: ctest reports Skipped */
}
