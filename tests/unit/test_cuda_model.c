/*
 * test_cuda_model — the serving Qwen2 forward (model/decoder.c over kernels/backend.h) on the
 * CUDA backend against the CPU (every op on its own: test_backend_ops): the whole forward
 * (random tiny bf16 model, the Llama 3 / Qwen3 / Mistral tiny models and the trained default
 * model, with the fused q|k|v and gate|up
 * GEMMs, residual adds fused into RMSNorm, bf16 GEMM inputs; the device argmax of the
 * greedy path against the downloaded logits) against the CPU forward, the greedy continuations of
 * tests/data/sotu-tiny/ greedy.json (Hugging Face, f32) and, when DISAGG_GPU_REF_DIR names a folder
 * made by tools/gpu_hf_reference.py, Hugging Face transformers' logits computed on the GPU.
 *
 * Tolerances (bf16 GEMM inputs and weights, f32 accumulation; the CPU keeps f32 activations):
 *   embed, kv_write (f32 KV), rope: 1e-6 relative; rmsnorm, swiglu (f32 out): 1e-5;
 *   bf16 outputs: 1 bf16 ulp (2^-8 relative); matmul: 1e-3 of sum |x||w|;
 *   attention: 1e-4 absolute with f32 KV (split kernel, f32 throughout), 2e-2 with bf16 KV
 *   (the prefill kernel rounds q and the softmax weights to bf16 for the tensor cores);
 *   whole model logits: max |gpu - cpu| <= 0.03 * max |cpu logit| per row (bf16 rounding of
 *   every GEMM input over all layers), and <= 0.05 against HF on the GPU (bf16 and f32);
 *   greedy continuations equal to HF's, or diverging only where the reference's top-2
 *   margin is below 0.25 (a near tie, recorded in greedy.json), and at least half equal.
 *
 * No GPU (or no module): every test is skipped with a loud line saying why.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <jansson.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_matmul.h"
#include "kernels/cuda/cuda_module.h" /* DCU_F32 / DCU_BF16 (= BACKEND_F32 / _BF16) */
#include "model/decoder.h"
#include "test_model_fixture.h"

static backend *G; /* the CUDA backend, NULL without a GPU */
static char why[1024];

static int setup(void **st) {
    if (backend_open("cuda", NULL, &G, why, sizeof why)) {
        fprintf(stderr,
                "\n******** SKIP test_cuda_model: needs a CUDA GPU and the CUDA module: %s "
                "********\n\n",
                why);
        G = NULL;
    } else {
        fprintf(stderr, "test_cuda_model: %s\n", backend_name(G));
    }
    return 0;
}
static int teardown(void **st) {
    backend_close(G);
    return 0;
}
#define NEED_GPU()                                                                                 \
    do {                                                                                           \
        if (!G) {                                                                                  \
            fprintf(stderr, "SKIP %s: needs a CUDA GPU (%s)\n", __func__, why);                    \
            skip();                                                                                \
        }                                                                                          \
    } while (0)

/* The serving forward on the GPU: model, workspace, KV region. */
typedef struct gpu_model {
    decoder_model m;
    decoder_state *s;
    kv_store kv;
} gpu_model;

static void gpu_open(gpu_model *g, const char *dir, int max_tokens, int n_blocks, int bs,
                     backend_dtype kv_dt) {
    char err[1024];
    int rc = decoder_load_on(&g->m, dir, G, 0, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, 0);
    g->s = decoder_state_create(&g->m, max_tokens);
    assert_non_null(g->s);
    assert_int_equal(kv_store_init_on(&g->kv, G, &g->m.cfg, n_blocks, bs, kv_dt, BACKEND_BUF_KV),
                     0);
}

static void gpu_close(gpu_model *g) {
    decoder_state_free(g->s);
    kv_store_free(&g->kv);
    decoder_free(&g->m);
}

static int gpu_fwd(gpu_model *g, decoder_seq *q) {
    return decoder_forward(&g->m, g->s, &g->kv, q, 1);
}

/* ---- whole model -------------------------------------------------------------- */

#define BS 16

/* every row's max |gpu - cpu| / max |cpu logit| within tol, but for max_over rows (a mixture
 * of experts' routing near-ties, test_model_moe) */
static double compare_model_n(const char *dir, const int32_t *ids, int n, int kv_dtype, double tol,
                              int max_over) {
    char err[1024];
    decoder_model m;
    int rc = decoder_load(&m, dir, 0, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, 0);
    int V = m.cfg.vocab_size, nb = (n + BS - 1) / BS + 1;
    decoder_state *s = decoder_state_init(&m, n, 1);
    kv_store kv;
    assert_int_equal(kv_store_init(&kv, &m.cfg, nb, BS), 0);
    int32_t table[512];
    for (int b = 0; b < nb; b++)
        table[b] = nb - 1 - b;
    float *cpu = malloc((size_t)n * V * 4), *gpu = malloc((size_t)n * V * 4);
    decoder_seq sq = {ids, n, 0, table, nb, cpu, 1, NULL, NULL};
    assert_int_equal(decoder_forward(&m, s, &kv, &sq, 1), 0);
    gpu_model g;
    gpu_open(&g, dir, n, nb, BS, (backend_dtype)kv_dtype);
    /* prefill in two chunks: the first n/2 tokens, then the rest (chunked prefill path);
     * the device argmax of the last row rides along */
    int half = n / 2 > 0 ? n / 2 : 1;
    int32_t amax = -1;
    decoder_seq g1 = {ids, half, 0, table, nb, gpu, 1, NULL, NULL};
    assert_int_equal(gpu_fwd(&g, &g1), 0);
    if (n > half) {
        decoder_seq g2 = {ids + half, n - half, half, table, nb, gpu + (size_t)half * V, 1, &amax, NULL};
        assert_int_equal(gpu_fwd(&g, &g2), 0);
        int hb = 0;
        const float *last = gpu + (size_t)(n - 1) * V;
        for (int v = 1; v < V; v++)
            if (last[v] > last[hb]) hb = v;
        assert_int_equal(amax, hb); /* device argmax == host argmax of the downloaded row */
    }
    double worst = 0;
    int top_agree = 0, over = 0;
    for (int t = 0; t < n; t++) {
        double mx = 0, e = 0;
        int bc = 0, bg = 0;
        for (int v = 0; v < V; v++) {
            float a = cpu[(size_t)t * V + v], b = gpu[(size_t)t * V + v];
            if (fabsf(a) > mx) mx = fabsf(a);
            if (fabsf(a - b) > e) e = fabsf(a - b);
            if (a > cpu[(size_t)t * V + bc]) bc = v;
            if (b > gpu[(size_t)t * V + bg]) bg = v;
        }
        top_agree += bc == bg;
        if (e / mx > worst) worst = e / mx;
        over += !(e / mx <= tol);
    }
    fprintf(stderr,
            "  model %s, %d tokens, %s KV: max |gpu-cpu| / max|logit| %.2e (tol %.2e; %d rows "
            "past it, %d allowed), argmax agrees on %d/%d rows\n",
            dir, n, kv_dtype == DCU_BF16 ? "bf16" : "f32", worst, tol, over, max_over, top_agree,
            n);
    assert_true(over <= max_over);
    gpu_close(&g);
    kv_store_free(&kv);
    decoder_state_free(s);
    decoder_free(&m);
    free(cpu), free(gpu);
    return worst;
}

static double compare_model(const char *dir, const int32_t *ids, int n, int kv_dtype, double tol) {
    return compare_model_n(dir, ids, n, kv_dtype, tol, 0);
}

static void test_model_tiny_random(void **st) {
    NEED_GPU();
    char dir[1024];
    json_t *g = fixture_model("tiny-bf16", dir, sizeof dir);
    assert_non_null(g);
    int32_t ids[300];
    for (int i = 0; i < 300; i++)
        ids[i] = (int32_t)((i * 7919 + 13) % 1000);
    compare_model(dir, ids, 300, DCU_F32, 0.03);
    compare_model(dir, ids, 300, DCU_BF16, 0.03);
    json_decref(g);
}

/* The architectures beside Qwen2: Llama 3 (llama3 rope, tied, no biases), Qwen3
 * (q/k norm: kernels/cuda/cuda_qknorm.cu, head_dim 32 != 64/4, yarn) and Mistral (sliding
 * window 8 < the 300 tokens: kernels/cuda/cuda_window.cu, head_dim 24) -- the f32
 * checkpoints, bf16 on the GPU -- against the CPU forward, f32 and bf16 KV. */
static void test_model_arch(void **st) {
    NEED_GPU();
    const char *names[] = {"llama-tiny", "qwen3-tiny", "mistral-tiny"};
    for (int i = 0; i < 3; i++) {
        char dir[1024];
        json_t *g = fixture_model(names[i], dir, sizeof dir);
        assert_non_null(g);
        int32_t ids[300];
        for (int k = 0; k < 300; k++)
            ids[k] = (int32_t)((k * 7919 + 13 * i) % 150000);
        compare_model(dir, ids, 300, DCU_F32, 0.03);
        compare_model(dir, ids, 300, DCU_BF16, 0.03);
        json_decref(g);
    }
}

/* FP8 checkpoints (tools/gen_random_fp8.py): 128 x 128 blocks with partial blocks, per channel
 * (bf16 scales), per tensor -- the GPU's e4m3 + scales (its prefill GEMMs on the bf16 twin)
 * against the CPU's f32 dequantization, f32 and bf16 KV.  The twin is e4m3 * scale rounded to
 * bf16 once, as the f32 checkpoints of test_model_arch are, so the error is theirs, but
 * qwen2-fp8-block-tiny (hidden 192, weights 0.1 n) amplifies it more than the hidden-64
 * models: transformers with every linear's weights and inputs rounded to bf16 and the q|k|v
 * and gate|up outputs too (tools/emulate_gpu_rounding.py) gives 3.69e-2 at f32 KV (the H200
 * measured 3.70e-2; llama-tiny 2.45e-2 both), hence 0.05 here. */
static void test_model_fp8(void **st) {
    NEED_GPU();
    const char *names[] = {"qwen2-fp8-block-tiny", "llama-fp8-channel-tiny",
                           "qwen3-fp8-tensor-tiny", "qwen2-fp8-block512-tiny"};
    for (int i = 0; i < 4; i++) {
        char dir[1024];
        json_t *g = fixture_model(names[i], dir, sizeof dir);
        assert_non_null(g);
        int32_t ids[300];
        for (int k = 0; k < 300; k++)
            ids[k] = (int32_t)((k * 7919 + 31 * i) % 150000);
        /* qwen2-fp8-block512-tiny (every K a multiple of 512) prefills on the W8A8 block GEMM
         * (the default, DISAGG_CUDA_FP8_GEMM): its activations are quantized to e4m3 in
         * 128-column groups too, about 2^-4 relative a value, where the CPU keeps them f32.
         * 0.1 is a first bound, not yet measured on the H200 (added on 4 December without the
         * device): the run prints the error to tighten it by */
        double tol = i == 3 ? 0.1 : 0.05;
        compare_model(dir, ids, 300, DCU_F32, tol);
        compare_model(dir, ids, 300, DCU_BF16, tol);
        json_decref(g);
    }
}

/* The mixtures of experts (Qwen3-MoE with a dense layer, Mixtral with its window) on the
 * GPU's MoE kernels -- and on the generic form (DISAGG_MOE_GENERIC=1) -- against the CPU
 * forward.  bf16 router logits pick the other of two near-tied experts for a few tokens, and
 * such a token's row differs in full: transformers itself with its matmul inputs and weights
 * rounded to bf16 (the GPU's GEMMs) against f32 chooses other experts for 8 token-layers of
 * Qwen3-MoE and puts 8 (Qwen3-MoE) and 12 (Mixtral) of these 300 rows past 0.03, off by up to
 * 0.25 and 0.34 of the largest logit, the other rows within 0.03 (the dense Qwen3 the same
 * way: 0.0235 at most, as on the H200).  So: every row but 30
 * (10%) within 0.05; a wrong kernel moves them all. */
static void test_model_moe(void **st) {
    NEED_GPU();
    const char *names[] = {"qwen3moe-tiny", "mixtral-tiny"};
    for (int i = 0; i < 2; i++) {
        char dir[1024];
        json_t *g = fixture_model(names[i], dir, sizeof dir);
        assert_non_null(g);
        int32_t ids[300];
        for (int k = 0; k < 300; k++)
            ids[k] = (int32_t)((k * 7919 + 29 * i) % 150000);
        for (int generic = 0; generic < 2; generic++) {
            setenv("DISAGG_MOE_GENERIC", generic ? "1" : "0", 1); /* 0: the kernels (opt-in) */
            fprintf(stderr, "  %s, %s MoE\n", names[i], generic ? "generic" : "the backend's");
            compare_model_n(dir, ids, 300, DCU_BF16, 0.05, 30);
            unsetenv("DISAGG_MOE_GENERIC");
        }
        compare_model_n(dir, ids, 300, DCU_F32, 0.05, 30);
        json_decref(g);
    }
}

static void test_model_default(void **st) {
    NEED_GPU();
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/disagg-sotu-tiny", DISAGG_SOURCE_DIR);
    int32_t ids[700];
    for (int i = 0; i < 700; i++)
        ids[i] = (int32_t)((i * 104729 + 7) % 4000);
    compare_model(dir, ids, 700, DCU_BF16, 0.03);
}

/* greedy continuations of the golden prompts (HF float32) with device argmax */
#define GREEDY_TIE 0.25
static void test_greedy_golden(void **st) {
    NEED_GPU();
    char dir[1024], path[1200], err[1024];
    snprintf(dir, sizeof dir, "%s/models/disagg-sotu-tiny", DISAGG_SOURCE_DIR);
    snprintf(path, sizeof path, "%s/tests/data/sotu-tiny/greedy.json", DISAGG_SOURCE_DIR);
    json_error_t je;
    json_t *g = json_load_file(path, 0, &je);
    assert_non_null(g);
    gpu_model gc;
    int nb = 64;
    gpu_open(&gc, dir, 256, nb, BS, BACKEND_BF16);
    (void)err;
    int32_t table[64];
    for (int b = 0; b < nb; b++)
        table[b] = (b * 37) % nb;
    size_t pi;
    json_t *p;
    int all = 0, same = 0, ties = 0;
    json_array_foreach(json_object_get(g, "prompts"), pi, p) {
        json_t *jp = json_object_get(p, "prompt_ids"), *jo = json_object_get(p, "output_ids");
        int n = (int)json_array_size(jp), no = (int)json_array_size(jo);
        int32_t ids[512];
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)json_integer_value(json_array_get(jp, (size_t)i));
        int32_t next;
        decoder_seq q = {ids, n, 0, table, nb, NULL, 0, &next, NULL};
        assert_int_equal(gpu_fwd(&gc, &q), 0);
        json_t *jm = json_object_get(p, "top2_logit_margins");
        int k = 0;
        for (; k < no; k++) {
            int want = (int)json_integer_value(json_array_get(jo, (size_t)k));
            if (next != want) break;
            ids[n + k] = next;
            decoder_seq d = {&ids[n + k], 1, n + k, table, nb, NULL, 0, &next, NULL};
            assert_int_equal(gpu_fwd(&gc, &d), 0);
        }
        all++;
        if (k == no) {
            same++;
            fprintf(stderr, "  golden prompt %zu: %d/%d greedy tokens equal to HF\n", pi, k, no);
        } else {
            /* a divergence is allowed only at a near tie of the reference: its top-2 margin
             * there below GREEDY_TIE (the bf16 logit error measured above is ~1e-2 of the
             * largest logit, a few tenths at most) */
            double margin = json_number_value(json_array_get(jm, (size_t)k));
            fprintf(stderr,
                    "  golden prompt %zu: %d/%d greedy tokens equal to HF, then a near tie "
                    "(reference top-2 margin %.4f at step %d, allowed < %.2f)\n",
                    pi, k, no, margin, k, GREEDY_TIE);
            assert_true(margin < GREEDY_TIE);
            ties++;
        }
    }
    fprintf(stderr, "  greedy: %d/%d golden prompts equal in full, %d diverge at a near tie\n",
            same, all, ties);
    assert_int_equal(same + ties, all);
    assert_true(same >= all / 2);
    gpu_close(&gc);
    json_decref(g);
}

/* HF transformers on the GPU (tools/gpu_hf_reference.py writes DISAGG_GPU_REF_DIR/<name>.json) */
static void hf_case(const char *refdir, const char *name, const char *model_dir) {
    char path[2048], err[1024];
    snprintf(path, sizeof path, "%s/%s.json", refdir, name);
    json_error_t je;
    json_t *g = json_load_file(path, 0, &je);
    if (!g) {
        fprintf(stderr, "  no HF reference %s (%s)\n", path, je.text);
        fail();
    }
    gpu_model gc;
    int nb = 128;
    gpu_open(&gc, model_dir, 1024, nb, BS, BACKEND_BF16);
    int V = gc.m.cfg.vocab_size;
    (void)err;
    int32_t table[128];
    for (int b = 0; b < nb; b++)
        table[b] = b;
    size_t ci;
    json_t *cs;
    json_array_foreach(json_object_get(g, "cases"), ci, cs) {
        json_t *jp = json_object_get(cs, "prompt_ids");
        int n = (int)json_array_size(jp);
        int32_t *ids = malloc((size_t)(n + 64) * 4);
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)json_integer_value(json_array_get(jp, (size_t)i));
        float *lg = malloc((size_t)n * V * 4);
        decoder_seq q = {ids, n, 0, table, nb, lg, 1, NULL, NULL};
        assert_int_equal(gpu_fwd(&gc, &q), 0);
        const char *kinds[] = {"bf16", "f32"};
        for (int k = 0; k < 2; k++) {
            char mxk[32];
            snprintf(mxk, sizeof mxk, "max_abs_%s", kinds[k]);
            size_t ri;
            json_t *row;
            double worst = 0;
            json_array_foreach(json_object_get(cs, "rows"), ri, row) {
                int t = (int)json_integer_value(json_object_get(row, "pos"));
                json_t *jid = json_object_get(row, "ids"), *jv = json_object_get(row, kinds[k]);
                double mx = json_number_value(json_object_get(row, mxk)), e = 0;
                for (size_t i = 0; i < json_array_size(jid); i++) {
                    int v = (int)json_integer_value(json_array_get(jid, i));
                    double d =
                        fabs(lg[(size_t)t * V + v] - json_number_value(json_array_get(jv, i)));
                    if (d > e) e = d;
                }
                if (e / mx > worst) worst = e / mx;
            }
            fprintf(stderr,
                    "  HF %s case %zu (%d tokens) vs HF %s on the GPU: max err / max|logit| %.2e "
                    "(tol 0.05)\n",
                    name, ci, n, kinds[k], worst);
            assert_true(worst <= 0.05);
        }
        /* greedy vs HF bf16 generate on the GPU */
        json_t *jo = json_object_get(cs, "greedy_bf16");
        int no = (int)json_array_size(jo), k = 0;
        int32_t next = 0;
        decoder_seq q2 = {ids, n, 0, table, nb, NULL, 0, &next, NULL};
        assert_int_equal(gpu_fwd(&gc, &q2), 0);
        for (; k < no && k < 64; k++) {
            if (next != (int)json_integer_value(json_array_get(jo, (size_t)k))) break;
            ids[n + k] = next;
            decoder_seq d = {&ids[n + k], 1, n + k, table, nb, NULL, 0, &next, NULL};
            assert_int_equal(gpu_fwd(&gc, &d), 0);
        }
        fprintf(stderr, "  HF %s case %zu: greedy %d/%d tokens equal to HF bf16 on the GPU\n", name,
                ci, k, no);
        free(ids), free(lg);
    }
    gpu_close(&gc);
    json_decref(g);
}

static void test_hf_gpu_reference(void **st) {
    NEED_GPU();
    const char *ref = getenv("DISAGG_GPU_REF_DIR");
    char def[1200];
    snprintf(def, sizeof def, "%s/tests/golden/gpu", DISAGG_SOURCE_DIR);
    if (!ref) ref = def;
    char p[1400];
    snprintf(p, sizeof p, "%s/sotu-tiny.json", ref);
    if (access(p, R_OK)) {
        fprintf(stderr, "SKIP %s: no references in %s (tools/gpu_hf_reference.py makes them)\n",
                __func__, ref);
        skip();
    }
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/disagg-sotu-tiny", DISAGG_SOURCE_DIR);
    hf_case(ref, "sotu-tiny", dir);
    json_t *g = fixture_model("tiny-bf16", dir, sizeof dir);
    assert_non_null(g);
    json_decref(g);
    hf_case(ref, "tiny-bf16", dir);
}

/* The serving path (model/decoder.c over kernels/backend.h on the CUDA backend) with decode
 * steps as CUDA graphs against the same requests with every step eager (--enforce-eager):
 * 5 sequences of different prompt lengths decode greedily, finishing one by one (batch
 * 5, 4, 3, 2, 1: buckets 8, 4, 4, 2, 1; one context crosses the 256-position bucket).
 * The greedy tokens must agree (up to near ties: see below).  And a recorded step must equal its own eager
 * warm-up bit for bit: the first decode step is run three times on the graph state (warm-up
 * eager with the padded batch, record + launch, replay) with the same inputs. */
#define GS_N     5
#define GS_STEPS 40
typedef struct gs_run {
    decoder_state *s;
    kv_store kv;
    int32_t toks[GS_N][GS_STEPS + 1];
    float *logits; /* (GS_N, GS_STEPS, V) */
} gs_run;

static int gs_argmax(const float *x, int V) {
    int b = 0;
    for (int v = 1; v < V; v++)
        if (x[v] > x[b]) b = v;
    return b;
}

static void gs_decode(decoder_model *m, backend *be, gs_run *r, int graphs, const int *plen,
                      int32_t (*tables)[64], int nb) {
    int V = m->cfg.vocab_size;
    r->s = decoder_state_create(m, 512);
    assert_non_null(r->s);
    if (graphs) assert_true(decoder_state_set_graphs(r->s, 8) > 0);
    assert_int_equal(kv_store_init_on(&r->kv, be, &m->cfg, nb, BS, BACKEND_BF16, BACKEND_BUF_KV),
                     0);
    r->logits = calloc((size_t)GS_N * GS_STEPS * V, 4);
    float *lg = malloc((size_t)V * 4);
    int32_t prompt[300];
    for (int i = 0; i < GS_N; i++) {
        for (int t = 0; t < plen[i]; t++)
            prompt[t] = (int32_t)((t * 104729 + 7 * i + 3) % 4000);
        decoder_seq q = {prompt, plen[i], 0, tables[i], 64, lg, 0, NULL, NULL};
        assert_int_equal(decoder_forward(m, r->s, &r->kv, &q, 1), 0);
        r->toks[i][0] = gs_argmax(lg, V);
    }
    decoder_seq q[GS_N];
    for (int step = 0; step < GS_STEPS; step++) {
        int n = 0;
        for (int i = 0; i < GS_N; i++) {
            if (step >= GS_STEPS - 6 * i) continue; /* sequence i stops after 40 - 6 i steps */
            q[n++] = (decoder_seq){&r->toks[i][step],
                                 1,
                                 plen[i] + step,
                                 tables[i],
                                 64,
                                 r->logits + ((size_t)i * GS_STEPS + step) * V,
                                 0,
                                 NULL, NULL};
        }
        int reps = graphs && step == 0 ? 3 : 1;
        float *first = NULL;
        for (int k = 0; k < reps; k++) {
            assert_int_equal(decoder_forward(m, r->s, &r->kv, q, n), 0);
            if (reps > 1 && k == 0) {
                first = malloc((size_t)n * V * 4);
                for (int j = 0; j < n; j++)
                    memcpy(first + (size_t)j * V, q[j].logits, (size_t)V * 4);
            } else if (reps > 1) {
                for (int j = 0; j < n; j++)
                    assert_memory_equal(first + (size_t)j * V, q[j].logits, (size_t)V * 4);
            }
        }
        if (first) {
            fprintf(stderr,
                    "  graph: warm-up, recorded and replayed step bit-identical (%d "
                    "sequences, %d graph(s) recorded)\n",
                    n, decoder_state_graphs(r->s));
            assert_true(decoder_state_graphs(r->s) >= 1);
            free(first);
        }
        for (int i = 0; i < GS_N; i++)
            if (step < GS_STEPS - 6 * i)
                r->toks[i][step + 1] = gs_argmax(r->logits + ((size_t)i * GS_STEPS + step) * V, V);
    }
    free(lg);
}

static void test_serving_graphs(void **st) {
    NEED_GPU();
    char dir[1024], err[1024];
    snprintf(dir, sizeof dir, "%s/models/disagg-sotu-tiny", DISAGG_SOURCE_DIR);
    backend *be = G;
    assert_true(backend_graph_supported(be));
    decoder_model m;
    int rc = decoder_load_on(&m, dir, be, 0, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, 0);
    int V = m.cfg.vocab_size, nb = GS_N * 64;
    static int32_t tables[GS_N][64];
    for (int i = 0; i < GS_N; i++)
        for (int b = 0; b < 64; b++)
            tables[i][b] = nb - 1 - (b * GS_N + i); /* interleaved, descending */
    const int plen[GS_N] = {13, 250, 31, 90, 200};
    static gs_run eager, graph;
    gs_decode(&m, be, &eager, 0, plen, tables, nb);
    gs_decode(&m, be, &graph, 1, plen, tables, nb);
    /* A recorded step runs the batch padded to its bucket (5 -> 8, 3 -> 4), an eager one
     * unpadded: different GEMM shapes, and the fast mode is not batch-invariant (cuBLASLt
     * picks kernels by shape), so the two may differ by bf16 rounding.  A greedy token may
     * differ only at a near tie of the eager logits (top-2 margin < 0.25, as the golden
     * tests); that sequence is not compared after it. */
    int differ = 0, ties = 0, total = 0;
    double worst = 0;
    for (int i = 0; i < GS_N; i++)
        for (int step = 0; step < GS_STEPS - 6 * i; step++) {
            total++;
            const float *a = eager.logits + ((size_t)i * GS_STEPS + step) * V,
                        *b = graph.logits + ((size_t)i * GS_STEPS + step) * V;
            if (eager.toks[i][step + 1] != graph.toks[i][step + 1]) {
                int t1 = gs_argmax(a, V);
                float m2 = -INFINITY;
                for (int v = 0; v < V; v++)
                    if (v != t1 && a[v] > m2) m2 = a[v];
                if (a[t1] - m2 < 0.25f) {
                    ties++;
                    fprintf(stderr, "  sequence %d step %d: graphs and eager differ at a near tie "
                                    "(margin %.4f)\n", i, step, a[t1] - m2);
                } else {
                    differ++;
                }
                break;
            }
            for (int v = 0; v < V; v++)
                if (fabs(a[v] - b[v]) > worst) worst = fabs(a[v] - b[v]);
        }
    fprintf(stderr,
            "  serving path, CUDA graphs vs eager: %d/%d greedy tokens differ (+%d at near ties), "
            "max |dlogit| %.3g, %d graphs recorded\n",
            differ, total, ties, worst, decoder_state_graphs(graph.s));
    assert_int_equal(differ, 0);
    assert_true(worst < 0.5); /* bf16 rounding of the activations, not a wrong kernel */
    assert_true(decoder_state_graphs(graph.s) >= 4);
    gs_run *runs[2] = {&eager, &graph};
    for (int k = 0; k < 2; k++) {
        decoder_state_free(runs[k]->s);
        kv_store_free(&runs[k]->kv);
        free(runs[k]->logits);
    }
    decoder_free(&m);
}

/* Without a GPU too: the graph functions on the CPU backend (no graphs: -ENOTSUP, every step
 * eager) and backend_graph_plan's checks of a padded batch (-EINVAL, before the backend). */
static void test_graph_api_cpu(void **st) {
    backend *be = backend_cpu_default();
    assert_false(backend_graph_supported(be));
    backend_stream *s = backend_stream_create(be);
    assert_non_null(s);
    int32_t tok[2] = {1, 2}, seq[2] = {0, 1}, pos[2] = {4, -1}, qo[3] = {0, 1, 2}, kvl[2] = {5, 0},
            bti[3] = {0, 1, 1}, bt[1] = {0}, orow[2] = {0, 1};
    backend_batch b = {2, 2, tok, seq, pos, qo, kvl, bti, bt, 2, orow};
    assert_int_equal(backend_graph_plan(s, &b, 256, 16), -ENOTSUP); /* valid, but no graphs */
    assert_int_equal(backend_graph_begin(s), -ENOTSUP);
    assert_int_equal(backend_graph_end(s, 1), -ENOTSUP);
    assert_int_equal(backend_graph_count(s), 0);
    backend_graph_reset(s);
    backend_batch bad = b;
    bad.n_out = 1; /* every row must be an output row */
    assert_int_equal(backend_graph_plan(s, &bad, 256, 16), -EINVAL);
    bad = b;
    bad.n_seqs = 1; /* one token per sequence */
    assert_int_equal(backend_graph_plan(s, &bad, 256, 16), -EINVAL);
    assert_int_equal(backend_graph_plan(s, &b, 4, 16), -EINVAL);  /* kv_len 5 > max_ctx 4 */
    assert_int_equal(backend_graph_plan(s, &b, 256, 0), -EINVAL); /* max_blocks < 1 */
    pos[1] = 0; /* a padding row (kv_len 0) must have position -1 */
    assert_int_equal(backend_graph_plan(s, &b, 256, 16), -EINVAL);
    pos[1] = -1;
    orow[1] = 0; /* rows out in order */
    assert_int_equal(backend_graph_plan(s, &b, 256, 16), -EINVAL);
    backend_stream_free(s);

    /* the model on the CPU: decoder_state_set_graphs says "eager" (0) and the forward is the
     * eager one (test_model_golden / test_model_batch check it bit for bit) */
    char dir[1024], err[1024];
    snprintf(dir, sizeof dir, "%s/models/disagg-sotu-tiny", DISAGG_SOURCE_DIR);
    decoder_model m;
    assert_int_equal(decoder_load(&m, dir, 0, err, sizeof err), 0);
    decoder_state *qs = decoder_state_init(&m, 16, 1);
    assert_non_null(qs);
    assert_int_equal(decoder_state_set_graphs(qs, 8), 0);
    assert_int_equal(decoder_state_graphs(qs), 0);
    decoder_state_free(qs);
    decoder_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_tiny_random), cmocka_unit_test(test_model_default),
        cmocka_unit_test(test_model_arch), cmocka_unit_test(test_model_moe),
        cmocka_unit_test(test_model_fp8),
        cmocka_unit_test(test_greedy_golden),     cmocka_unit_test(test_serving_graphs),
        cmocka_unit_test(test_graph_api_cpu),     cmocka_unit_test(test_hf_gpu_reference),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
