/*
 * test_model_batch — batch-invariant numerics of the Qwen2 forward: a sequence's logits
 * are byte-identical whether its positions run in one prefill, in chunks, one token at a
 * time, batched beside other sequences (with their own scattered blocks), on 1 or all
 * threads, and on the AVX2 or the scalar kernels.  Once for the Qwen2 tiny model, once for the
 * Qwen3-MoE one (routing and expert sums included).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <errno.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>

#include <cmocka.h>

#include "kernels/cpu/cpu_matmul.h"
#include "model/decoder.h"
#include "test_model_fixture.h"

#define BS 4  /* small blocks: a 20-token prompt spans 5 */
#define N  20 /* prompt A */
#define NB 13 /* prompt B */

static decoder_model g_m;
static int V;
static int32_t A[N], B[NB];

static const char *g_name = "tiny-bf16"; /* the model of the group being run */

static int setup(void **st) {
    (void)st;
    char dir[1024], err[1024];
    json_t *g = fixture_model(g_name, dir, sizeof dir);
    if (!g) return -1;
    json_decref(g);
    if (decoder_load(&g_m, dir, 0, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    V = g_m.cfg.vocab_size;
    for (int i = 0; i < N; i++)
        A[i] = (int32_t)((i * 7919 + 13) % 151643);
    for (int i = 0; i < NB; i++)
        B[i] = (int32_t)((i * 104729 + 5) % 151643);
    return 0;
}

static int teardown(void **st) {
    (void)st;
    decoder_free(&g_m);
    return 0;
}

/* Reference: A in one prefill, logits of every position: (N, V). */
static float *run_prefill(int threads) {
    kv_store kv;
    assert_int_equal(kv_store_init(&kv, &g_m.cfg, 8, BS), 0);
    int32_t table[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    decoder_state *s = decoder_state_init(&g_m, 64, threads);
    float *out = malloc((size_t)N * V * sizeof(float));
    decoder_seq q = {A, N, 0, table, 8, out, 1, NULL, NULL};
    assert_int_equal(decoder_forward(&g_m, s, &kv, &q, 1), 0);
    decoder_state_free(s);
    kv_store_free(&kv);
    return out;
}

static void assert_rows_equal(const float *want, const float *got, int row0, int n_rows,
                              const char *what) {
    if (memcmp(want + (size_t)row0 * V, got, (size_t)n_rows * V * sizeof(float)))
        fail_msg("%s: logits of positions %d..%d differ from the one-shot prefill", what, row0,
                 row0 + n_rows - 1);
}

static void test_chunks_and_tokens(void **st) {
    (void)st;
    int threads = 0;
    float *ref = run_prefill(threads);
    decoder_state *s = decoder_state_init(&g_m, 64, threads);
    float *out = malloc((size_t)N * V * sizeof(float));
    /* chunks 7 + 8 + 5, blocks in a scattered table */
    kv_store kv;
    assert_int_equal(kv_store_init(&kv, &g_m.cfg, 16, BS), 0);
    int32_t table[5] = {9, 2, 14, 0, 7};
    int chunks[3] = {7, 8, 5}, pos = 0;
    for (int c = 0; c < 3; c++) {
        decoder_seq q = {A + pos, chunks[c], pos, table, 5, out, 1, NULL, NULL};
        assert_int_equal(decoder_forward(&g_m, s, &kv, &q, 1), 0);
        assert_rows_equal(ref, out, pos, chunks[c], "chunked prefill");
        pos += chunks[c];
    }
    /* one token at a time, last-row logits */
    memset(kv.base, 0, (size_t)kv.n_blocks * decoder_kv_block_bytes(&g_m.cfg, BS));
    for (int p = 0; p < N; p++) {
        decoder_seq q = {A + p, 1, p, table, 5, out, 0, NULL, NULL};
        assert_int_equal(decoder_forward(&g_m, s, &kv, &q, 1), 0);
        assert_rows_equal(ref, out, p, 1, "token-by-token");
    }
    kv_store_free(&kv);
    free(out);
    free(ref);
    decoder_state_free(s);
}

static void test_batched_with_others(void **st) {
    (void)st;
    int threads = 0;
    float *ref = run_prefill(threads);
    decoder_state *s = decoder_state_init(&g_m, 64, threads);
    kv_store kv;
    assert_int_equal(kv_store_init(&kv, &g_m.cfg, 24, BS), 0);
    int32_t ta[5] = {3, 11, 20, 6, 1}, tb[4] = {0, 23, 5, 17}, tc[4] = {8, 9, 10, 12};
    float *la = malloc((size_t)N * V * sizeof(float)), *lb = malloc((size_t)NB * V * sizeof(float));
    float *lc = malloc((size_t)V * sizeof(float));
    /* step 1: A's first 9 tokens beside B's whole prompt and C's 2 tokens */
    decoder_seq q1[3] = {{B, NB, 0, tb, 4, lb, 1, NULL, NULL},
                         {A, 9, 0, ta, 5, la, 1, NULL, NULL},
                         {B + 3, 2, 0, tc, 4, lc, 0, NULL, NULL}};
    assert_int_equal(decoder_forward(&g_m, s, &kv, q1, 3), 0);
    assert_rows_equal(ref, la, 0, 9, "batched prefill (with 2 others)");
    /* step 2: A's next 10 tokens beside one decode token of B and of C */
    int32_t bn = 42, cn = 77;
    decoder_seq q2[3] = {{&bn, 1, NB, tb, 4, lb, 0, NULL, NULL},
                         {&cn, 1, 2, tc, 4, lc, 0, NULL, NULL},
                         {A + 9, 10, 9, ta, 5, la, 1, NULL, NULL}};
    assert_int_equal(decoder_forward(&g_m, s, &kv, q2, 3), 0);
    assert_rows_equal(ref, la, 9, 10, "batched chunk (with 2 decodes)");
    /* step 3: A's last token alone vs. beside 2 decode tokens: both must equal */
    decoder_seq q3[3] = {{&bn, 1, NB + 1, tb, 4, lb, 0, NULL, NULL},
                         {A + 19, 1, 19, ta, 5, la, 0, NULL, NULL},
                         {&cn, 1, 3, tc, 4, lc, 0, NULL, NULL}};
    assert_int_equal(decoder_forward(&g_m, s, &kv, q3, 3), 0);
    assert_rows_equal(ref, la, 19, 1, "batched decode");
    free(la);
    free(lb);
    free(lc);
    free(ref);
    kv_store_free(&kv);
    decoder_state_free(s);
}

static int g_skipped; /* tests skipped for a missing ISA */

static void test_threads(void **st) {
    (void)st;
    int p1 = 1, p3 = 3;
    float *r1 = run_prefill(p1), *r3 = run_prefill(p3);
    assert_memory_equal(r1, r3, (size_t)N * V * sizeof(float));
    free(r1);
    free(r3);
}

/* The whole forward gives the same logits on the scalar and the AVX2 kernels (the AVX2 path
 * is forced, not assumed: on a CPU without it this says so and skips). */
static void test_scalar_equals_avx2(void **st) {
    (void)st;
    cpu_isa prev = cpu_isa_get();
    if (cpu_isa_force(CPU_ISA_AVX2) != 0) {
        fprintf(stderr, "SKIPPED: this CPU lacks avx2 (needs avx2, fma and f16c): scalar vs "
                        "avx2 forward NOT compared\n");
        g_skipped++;
        skip();
    }
    int p3 = 3;
    float *ra = run_prefill(p3);
    cpu_isa_force(CPU_ISA_SCALAR);
    float *rs = run_prefill(p3);
    cpu_isa_force(prev);
    if (memcmp(ra, rs, (size_t)N * V * sizeof(float)))
        fail_msg("scalar reference and AVX2 logits differ");
    free(ra);
    free(rs);
}

static void test_bad_inputs(void **st) {
    (void)st;
    decoder_state *s = decoder_state_init(&g_m, 8, 1);
    kv_store kv;
    assert_int_equal(kv_store_init(&kv, &g_m.cfg, 4, BS), 0);
    int32_t table[4] = {0, 1, 2, 3}, bad_table[2] = {0, 4};
    float *out = malloc((size_t)V * sizeof(float));
    int32_t tok_bad = V, ok[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    decoder_seq q = {&tok_bad, 1, 0, table, 4, out, 0, NULL, NULL};
    assert_int_equal(decoder_forward(&g_m, s, &kv, &q, 1), -EINVAL); /* token id >= vocab */
    q = (decoder_seq){ok, 9, 0, table, 4, out, 0, NULL, NULL};
    assert_int_equal(decoder_forward(&g_m, s, &kv, &q, 1), -EINVAL); /* more than max_tokens */
    q = (decoder_seq){ok, 1, 16, table, 4, out, 0, NULL, NULL};
    assert_int_equal(decoder_forward(&g_m, s, &kv, &q, 1), -EINVAL); /* table too short */
    q = (decoder_seq){ok, 2, 3, bad_table, 2, out, 0, NULL, NULL};
    assert_int_equal(decoder_forward(&g_m, s, &kv, &q, 1), -EINVAL); /* block id out of range */
    q = (decoder_seq){ok, 1, g_m.cfg.max_position, table, 4, out, 0, NULL, NULL};
    assert_int_equal(decoder_forward(&g_m, s, &kv, &q, 1), -EINVAL); /* beyond max_position */
    q = (decoder_seq){ok, 0, 0, table, 4, out, 0, NULL, NULL};
    assert_int_equal(decoder_forward(&g_m, s, &kv, &q, 1), -EINVAL); /* empty */
    free(out);
    kv_store_free(&kv);
    decoder_state_free(s);
}

/* Structured outputs' masks (decoder_seq.allow) in a batch: a prefill with every row's logits
 * and a mask from the caller's memory (copied into the state's mask rows: only its last row is
 * masked), a greedy sequence whose mask is the state's row 1 (only the argmax comes back: the
 * best allowed token), and an unmasked one; each against the reference prefill.  A mask in the
 * state's rows at the wrong row is refused. */
static int g_hook_calls;
static void count_hook(void *ctx) {
    (void)ctx;
    g_hook_calls++;
}

static void test_allow_masks(void **st) {
    (void)st;
    float *ref = run_prefill(1);
    kv_store kv;
    assert_int_equal(kv_store_init(&kv, &g_m.cfg, 12, BS), 0);
    decoder_state *s = decoder_state_init(&g_m, 64, 1);
    assert_non_null(s);
    decoder_state_set_mask_hook(s, count_hook, NULL);
    int words = (V + 31) / 32;
    uint32_t *rows = decoder_state_mask_rows(s, 2), *ext = calloc((size_t)words, 4);
    assert_non_null(rows);
    assert_non_null(ext);
    uint32_t x = 12345;
    for (int w = 0; w < words; w++) {
        x = x * 1103515245u + 12345u;
        ext[w] = x & 0x24924924u; /* about every third token */
        x = x * 1103515245u + 12345u;
        rows[words + w] = (x >> 3) & 0x11111111u; /* about every fourth */
    }
    rows[words] |= 1u; /* token 0: each mask allows something */
    ext[0] |= 1u;
    int32_t t0[5] = {0, 1, 2, 3, 4}, t1[3] = {5, 6, 7}, t2[2] = {8, 9};
    float *la = malloc((size_t)N * V * sizeof(float)), *lc = malloc((size_t)V * sizeof(float));
    int32_t amax = -1;
    decoder_seq q[3] = {{A, N, 0, t0, 5, la, 1, NULL, ext},
                        {A, 9, 0, t1, 3, NULL, 0, &amax, rows + words},
                        {A, 5, 0, t2, 2, lc, 0, NULL, NULL}};
    g_hook_calls = 0;
    assert_int_equal(decoder_forward(&g_m, s, &kv, q, 3), 0);
    assert_int_equal(g_hook_calls, 1);
    assert_memory_equal(la, ref, (size_t)(N - 1) * V * sizeof(float)); /* rows before the last */
    for (int t = 0; t < V; t++) {
        float want = ext[t / 32] >> (t % 32) & 1u ? ref[(size_t)(N - 1) * V + t] : -INFINITY;
        if (memcmp(&la[(size_t)(N - 1) * V + t], &want, sizeof want))
            fail_msg("masked last row: token %d is %g, want %g", t, la[(size_t)(N - 1) * V + t], want);
    }
    int best = -1;
    for (int t = 0; t < V; t++)
        if (rows[words + t / 32] >> (t % 32) & 1u && (best < 0 || ref[8 * V + t] > ref[8 * V + best]))
            best = t;
    assert_int_equal(amax, best);
    assert_memory_equal(lc, ref + 4 * (size_t)V, (size_t)V * sizeof(float));
    /* the first masked sequence on row 1 of the state's rows: refused, named */
    decoder_seq bad = {A, 1, 0, t2, 2, lc, 0, NULL, rows + words};
    assert_int_equal(decoder_forward(&g_m, s, &kv, &bad, 1), -EINVAL);
    free(la), free(lc), free(ext), free(ref);
    kv_store_free(&kv);
    decoder_state_free(s);
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
        cmocka_unit_test(test_chunks_and_tokens), cmocka_unit_test(test_batched_with_others),
        cmocka_unit_test(test_threads),           cmocka_unit_test(test_scalar_equals_avx2),
        cmocka_unit_test(test_bad_inputs),        cmocka_unit_test(test_allow_masks),
    };
    int failed = cmocka_run_group_tests_name("qwen2 tiny-bf16", tests, setup, teardown);
    /* the same with a mixture of experts: the router's choices and the experts' sums are
     * part of the invariance (a dense layer between two sparse ones) */
    g_name = "qwen3moe-tiny";
    failed += cmocka_run_group_tests_name("qwen3moe-tiny", tests, setup, teardown);
    return failed == 0 && g_skipped ? 77 : failed; /* 77: ctest reports Skipped */
}
