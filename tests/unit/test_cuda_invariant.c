/*
 * test_cuda_invariant — the CUDA backend's batch-invariant mode (backend_options.
 * batch_invariant, `--batch-invariant`; kernels/cuda/cuda_invariant.h) is invariant, bit for
 * bit, not merely close to the CPU:
 *   - backend_matmul: every row of an M-row GEMM equals that row computed alone, for M from
 *     1 to 9000 (chunked beyond the algorithm's row limit) on the tiny and the 7B shapes;
 *   - backend_attention: a sequence's outputs are the same prefilled at once, in chunks
 *     (>= 16 tokens: the prefill tiles; < 16: the split path), token by token and in a batch
 *     of other sequences, with bf16 and f32 KV, head_dim 16/32/128, GQA 2..7;
 *   - the model (model/decoder.c over kernels/backend.h, CUDA graphs on, as serve runs it): a
 *     prompt's logits (every position, its greedy continuation included) are the same
 *     prefilled at once, then decoded, token by token, in chunks, and in a batch of 1..63
 *     other sequences of mixed lengths and schedules -- on the random tiny model, the
 *     default model and, when DISAGG_INV_7B names a directory made by
 *     tools/gen_random_qwen2_gpu.py --shape 7b, on 7B-shaped random weights.
 * The same scenarios in the fast mode are printed (how many rows differ there), which shows
 * what the checks would catch.  DISAGG_INV_GEMM_BENCH=1 also prints the GEMM times of the
 * fast mode and of the invariant mode at several reference row counts (7B shapes).
 * No GPU (or no module): every test is skipped with a loud line saying why.
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
#include <time.h>

#include "kernels/backend.h"
#include "model/decoder.h"

/* $DISAGG_SRC: the source tree when the binary runs elsewhere (the GPU machine's bundle) */
static const char *const src_built = DISAGG_SOURCE_DIR;
static const char *src_dir(void) {
    const char *e = getenv("DISAGG_SRC");
    return e && *e ? e : src_built;
}
#undef DISAGG_SOURCE_DIR
#define DISAGG_SOURCE_DIR src_dir()
#include "test_model_fixture.h"

static char why[1024];
static int have_gpu;

static int setup(void **st) {
    backend *be = NULL;
    backend_options o;
    backend_options_init(&o);
    o.batch_invariant = 1;
    if (backend_open("cuda", &o, &be, why, sizeof why)) {
        fprintf(stderr,
                "\n******** SKIP test_cuda_invariant: needs a CUDA GPU and the CUDA module: %s "
                "********\n\n",
                why);
        return 0;
    }
    fprintf(stderr, "test_cuda_invariant: %s\n", backend_name(be));
    backend_close(be);
    have_gpu = 1;
    return 0;
}
#define NEED_GPU()                                                                                 \
    do {                                                                                           \
        if (!have_gpu) {                                                                           \
            fprintf(stderr, "SKIP %s: needs a CUDA GPU (%s)\n", __func__, why);                    \
            skip();                                                                                \
        }                                                                                          \
    } while (0)

static int on_cpu; /* the harness on the CPU backend (always batch-invariant): no GPU needed */

/* DISAGG_INV_NO_FAST=1: skip the fast-mode comparisons (a shorter run) */
static int with_fast(void) {
    const char *e = getenv("DISAGG_INV_NO_FAST");
    return !(e && *e && strcmp(e, "0"));
}

static backend *open_cuda(int inv) {
    if (on_cpu) return backend_cpu_default();
    backend *be = NULL;
    backend_options o;
    backend_options_init(&o);
    o.batch_invariant = inv;
    char err[1024];
    int rc = backend_open("cuda", &o, &be, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, 0);
    return be;
}

static uint64_t rs = 0x2545f4914f6cdd1dull;
static float frand(void) { /* [-1, 1) */
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return (float)((rs >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}
static int irand(int n) {
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return (int)((rs >> 33) % (uint64_t)n);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- GEMM ------------------------------------------------------------------------------ */

typedef struct gemm_bufs {
    backend_buffer *x, *w, *y, *bias;
    int maxM, N, K;
} gemm_bufs;

static void gemm_alloc(backend *be, backend_stream *s, gemm_bufs *g, int maxM, int N, int K) {
    g->maxM = maxM, g->N = N, g->K = K;
    float *hx = malloc((size_t)maxM * K * 4), *hb = malloc((size_t)N * 4);
    uint16_t *hw = malloc((size_t)N * K * 2);
    assert_non_null(hx);
    assert_non_null(hw);
    for (size_t i = 0; i < (size_t)maxM * K; i++)
        hx[i] = frand();
    for (size_t i = 0; i < (size_t)N * K; i++) {
        float f = frand() * 0.05f;
        uint32_t u;
        memcpy(&u, &f, 4);
        hw[i] = (uint16_t)(u >> 16);
    }
    for (int i = 0; i < N; i++)
        hb[i] = frand();
    backend_dtype stored;
    g->w = backend_weights_load(be, hw, BACKEND_BF16, (size_t)N * K, &stored);
    g->x = backend_buffer_alloc(be, (size_t)maxM * K * 4, 0);
    g->y = backend_buffer_alloc(be, (size_t)maxM * N * 4, 0);
    g->bias = backend_buffer_alloc(be, (size_t)N * 4, 0);
    assert_non_null(g->w);
    assert_non_null(g->x);
    assert_non_null(g->y);
    assert_non_null(g->bias);
    assert_int_equal(backend_upload(s, backend_buffer_ptr(g->x), hx, (size_t)maxM * K * 4), 0);
    assert_int_equal(backend_upload(s, backend_buffer_ptr(g->bias), hb, (size_t)N * 4), 0);
    free(hx), free(hw), free(hb);
}
static void gemm_free(gemm_bufs *g) {
    backend_buffer_free(g->x), backend_buffer_free(g->w), backend_buffer_free(g->y);
    backend_buffer_free(g->bias);
}
/* y rows [0, M) = x rows [r0, r0 + M) . w^T (+ bias) */
static int gemm_run(backend_stream *s, gemm_bufs *g, int r0, int M, int bias) {
    backend_matmul_op op = {backend_buffer_ptr(g->y),
                            BACKEND_F32,
                            (char *)backend_buffer_ptr(g->x) + (size_t)r0 * g->K * 4,
                            BACKEND_F32,
                            backend_buffer_ptr(g->w),
                            BACKEND_BF16,
                            bias ? backend_buffer_ptr(g->bias) : NULL,
                            M,
                            g->N,
                            g->K, {NULL, 0, 0, NULL}};
    int rc = backend_matmul(s, &op, 1);
    return rc ? rc : backend_stream_sync(s);
}

/* rows compared: a sample of each M's rows against the same rows computed alone */
static int gemm_differ(backend *be, int N, int K, const int *Ms, int nM, int *checked) {
    backend_stream *s = backend_stream_create(be);
    assert_non_null(s);
    int maxM = 0;
    for (int i = 0; i < nM; i++)
        maxM = Ms[i] > maxM ? Ms[i] : maxM;
    gemm_bufs g;
    gemm_alloc(be, s, &g, maxM, N, K);
    enum { NS = 12 };
    int rows[NS] = {0, 1, 2, 3, 7, 15, 16, 31, 63, 64, 100, maxM - 1};
    float *ref = malloc((size_t)NS * N * 4), *got = malloc((size_t)N * 4);
    for (int i = 0; i < NS; i++) {
        if (rows[i] >= maxM) rows[i] = maxM - 1;
        assert_int_equal(gemm_run(s, &g, rows[i], 1, i & 1), 0);
        assert_int_equal(backend_download(s, ref + (size_t)i * N, backend_buffer_ptr(g.y),
                                          (size_t)N * 4),
                         0);
    }
    int differ = 0;
    *checked = 0;
    for (int mi = 0; mi < nM; mi++) {
        int M = Ms[mi];
        for (int bias = 0; bias < 2; bias++) {
            assert_int_equal(gemm_run(s, &g, 0, M, bias), 0);
            for (int i = 0; i < NS; i++) {
                if (rows[i] >= M || (i & 1) != bias) continue;
                assert_int_equal(backend_download(s, got,
                                                  (char *)backend_buffer_ptr(g.y) +
                                                      (size_t)rows[i] * N * 4,
                                                  (size_t)N * 4),
                                 0);
                (*checked)++;
                if (memcmp(got, ref + (size_t)i * N, (size_t)N * 4)) differ++;
            }
        }
    }
    free(ref), free(got);
    gemm_free(&g);
    backend_stream_free(s);
    return differ;
}

static void test_matmul_invariant(void **st) {
    NEED_GPU();
    static const int shapes[][2] = {{256, 256},   {1024, 256},  {256, 1024},  {4096, 256},
                                    {64, 64},     {160, 64},    {3584, 3584}, {512, 3584},
                                    {18944, 3584}, {3584, 18944}, {152064, 3584}};
    static const int Ms[] = {1, 2, 3, 5, 8, 13, 16, 24, 31, 32, 33, 64, 100, 128, 257, 512, 1000,
                             2048, 4100, 9000};
    int nM = (int)(sizeof Ms / sizeof Ms[0]);
    backend *inv = open_cuda(1), *fast = open_cuda(0);
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int N = shapes[k][0], K = shapes[k][1], n = nM, checked = 0, fchecked = 0;
        if ((size_t)N * K > (size_t)100e6) n = nM - 2; /* the lm_head: M <= 2048 */
        int d = gemm_differ(inv, N, K, Ms, n, &checked);
        int fd = with_fast() ? gemm_differ(fast, N, K, Ms, n, &fchecked) : -1;
        fprintf(stderr,
                "  matmul N=%-6d K=%-5d M 1..%d: invariant mode %d/%d sampled rows differ from "
                "the row alone (fast mode: %d/%d)\n",
                N, K, Ms[n - 1], d, checked, fd, fchecked);
        assert_int_equal(d, 0);
    }
    backend_close(inv);
    backend_close(fast);
}

/* gate|up + SwiGLU (backend_gate_up over the concatenated weights, bf16 x and h: the
 * invariant mode's bf16-output GEMM at every row count): sampled rows of h for M = 1 .. 9000
 * against the row alone */
static int gate_up_differ(backend *be, int I, int H, const int *Ms, int nM, int *checked) {
    backend_stream *s = backend_stream_create(be);
    assert_non_null(s);
    int maxM = 0;
    for (int i = 0; i < nM; i++)
        maxM = Ms[i] > maxM ? Ms[i] : maxM;
    uint16_t *hx = malloc((size_t)maxM * H * 2), *hw = malloc((size_t)2 * I * H * 2);
    assert_non_null(hx);
    assert_non_null(hw);
    for (size_t i = 0; i < (size_t)maxM * H; i++) {
        float f = frand();
        uint32_t u;
        memcpy(&u, &f, 4);
        hx[i] = (uint16_t)(u >> 16);
    }
    for (size_t i = 0; i < (size_t)2 * I * H; i++) {
        float f = frand() * 0.05f;
        uint32_t u;
        memcpy(&u, &f, 4);
        hw[i] = (uint16_t)(u >> 16);
    }
    backend_dtype stored;
    backend_buffer *w = backend_weights_load(be, hw, BACKEND_BF16, (size_t)2 * I * H, &stored),
                   *x = backend_buffer_alloc(be, (size_t)maxM * H * 2, 0),
                   *h = backend_buffer_alloc(be, (size_t)maxM * I * 2, 0);
    assert_non_null(w);
    assert_non_null(x);
    assert_non_null(h);
    assert_int_equal(backend_upload(s, backend_buffer_ptr(x), hx, (size_t)maxM * H * 2), 0);
    enum { NS = 12 };
    int rows[NS] = {0, 1, 2, 3, 7, 15, 16, 31, 63, 64, 100, maxM - 1};
    uint16_t *ref = malloc((size_t)NS * I * 2), *got = malloc((size_t)I * 2);
    for (int i = 0; i < NS; i++) {
        if (rows[i] >= maxM) rows[i] = maxM - 1;
        backend_mlp_op o = {(char *)backend_buffer_ptr(x) + (size_t)rows[i] * H * 2,
                            BACKEND_BF16, 1, H, I, NULL, NULL, BACKEND_BF16,
                            backend_buffer_ptr(w), backend_buffer_ptr(h), NULL, BACKEND_BF16, {NULL, 0, 0, NULL}, {NULL, 0, 0, NULL}, {NULL, 0, 0, NULL}};
        assert_int_equal(backend_gate_up(s, &o), 0);
        assert_int_equal(backend_download(s, ref + (size_t)i * I, backend_buffer_ptr(h),
                                          (size_t)I * 2),
                         0);
    }
    int differ = 0;
    *checked = 0;
    for (int mi = 0; mi < nM; mi++) {
        int M = Ms[mi];
        backend_mlp_op o = {backend_buffer_ptr(x), BACKEND_BF16, M, H, I, NULL, NULL,
                            BACKEND_BF16, backend_buffer_ptr(w), backend_buffer_ptr(h), NULL,
                            BACKEND_BF16, {NULL, 0, 0, NULL}, {NULL, 0, 0, NULL}, {NULL, 0, 0, NULL}};
        assert_int_equal(backend_gate_up(s, &o), 0);
        for (int i = 0; i < NS; i++) {
            if (rows[i] >= M) continue;
            assert_int_equal(backend_download(s, got,
                                              (char *)backend_buffer_ptr(h) +
                                                  (size_t)rows[i] * I * 2,
                                              (size_t)I * 2),
                             0);
            (*checked)++;
            if (memcmp(got, ref + (size_t)i * I, (size_t)I * 2)) differ++;
        }
    }
    free(ref), free(got), free(hx), free(hw);
    backend_buffer_free(w), backend_buffer_free(x), backend_buffer_free(h);
    backend_stream_free(s);
    return differ;
}

static void test_gate_up_invariant(void **st) {
    NEED_GPU();
    static const int shapes[][2] = {{256, 256}, {1024, 512}, {4864, 896}, {18944, 3584}};
    static const int Ms[] = {1, 2, 3, 8, 16, 31, 63, 64, 65, 100, 128, 257, 512, 1000, 2048,
                             4100, 9000};
    int nM = (int)(sizeof Ms / sizeof Ms[0]);
    backend *inv = open_cuda(1), *fast = open_cuda(0);
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int I = shapes[k][0], H = shapes[k][1], checked = 0, fchecked = 0;
        int d = gate_up_differ(inv, I, H, Ms, nM, &checked);
        int fd = with_fast() ? gate_up_differ(fast, I, H, Ms, nM, &fchecked) : -1;
        fprintf(stderr,
                "  gate_up inter=%-6d hidden=%-5d M 1..%d: invariant mode %d/%d sampled rows "
                "differ from the row alone (fast mode: %d/%d)\n",
                I, H, Ms[nM - 1], d, checked, fd, fchecked);
        assert_int_equal(d, 0);
    }
    backend_close(inv);
    backend_close(fast);
}

/* timing of the 7B GEMM shapes (DISAGG_INV_GEMM_BENCH=1): fast mode and invariant mode with
 * the algorithm chosen at several reference row counts */
static void test_matmul_bench(void **st) {
    NEED_GPU();
    const char *want = getenv("DISAGG_INV_GEMM_BENCH");
    if (!want || !*want || !strcmp(want, "0")) {
        fprintf(stderr, "SKIP %s: set DISAGG_INV_GEMM_BENCH=1\n", __func__);
        skip();
    }
    static const int shapes[][2] = {{3584, 3584}, {512, 3584}, {18944, 3584}, {3584, 18944},
                                    {152064, 3584}};
    static const int Ms[] = {1, 8, 32, 64, 512, 4096};
    static const char *pols[] = {"fast", "1", "8", "64", "256", "1024", "64 nosplitk"};
    int nP = (int)(sizeof pols / sizeof pols[0]), nM = (int)(sizeof Ms / sizeof Ms[0]);
    backend *inv = open_cuda(1), *fast = open_cuda(0);
    int bench_differ = 0;
    float *rowM = malloc(152064 * 4), *row1 = malloc(152064 * 4);
    fprintf(stderr, "  GEMM microseconds per call (y f32 = x bf16 . w bf16^T), policy = fast or "
                    "invariant algorithm chosen at M_ref\n");
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int N = shapes[k][0], K = shapes[k][1];
        fprintf(stderr, "  N=%d K=%d\n  %-14s", N, K, "M_ref \\ M");
        for (int mi = 0; mi < nM; mi++)
            fprintf(stderr, " %9d", Ms[mi]);
        fprintf(stderr, "\n");
        backend_stream *s0 = backend_stream_create(inv);
        gemm_bufs g;
        gemm_alloc(inv, s0, &g, 4096, N, K);
        backend_stream_free(s0);
        for (int p = 0; p < nP; p++) {
            if (p) {
                char b[16];
                snprintf(b, sizeof b, "%d", atoi(pols[p]));
                setenv("DISAGG_CUDA_INV_GEMM_M", b, 1);
                setenv("DISAGG_CUDA_INV_SPLITK", strstr(pols[p], "nosplitk") ? "0" : "1", 1);
            }
            backend_stream *s = backend_stream_create(p ? inv : fast);
            fprintf(stderr, "  %-14s", pols[p]);
            for (int mi = 0; mi < nM; mi++) {
                int M = Ms[mi];
                if ((size_t)N * K > (size_t)60e6 && M > 512) {
                    fprintf(stderr, " %9s", "-");
                    continue;
                }
                for (int r = 0; r < 3; r++)
                    assert_int_equal(gemm_run(s, &g, 0, M, 0), 0);
                int reps = M >= 512 ? 10 : 50;
                double t0 = now_s();
                for (int r = 0; r < reps; r++) {
                    backend_matmul_op op = {backend_buffer_ptr(g.y), BACKEND_F32,
                                            backend_buffer_ptr(g.x), BACKEND_F32,
                                            backend_buffer_ptr(g.w), BACKEND_BF16,
                                            NULL,                    M,
                                            N,                       K, {NULL, 0, 0, NULL}};
                    assert_int_equal(backend_matmul(s, &op, 1), 0);
                }
                assert_int_equal(backend_stream_sync(s), 0);
                double us = (now_s() - t0) / reps * 1e6;
                /* row 0 of this M against row 0 alone (same algorithm): '*' if it differs */
                assert_int_equal(backend_download(s, rowM, backend_buffer_ptr(g.y), (size_t)N * 4), 0);
                assert_int_equal(gemm_run(s, &g, 0, 1, 0), 0);
                assert_int_equal(backend_download(s, row1, backend_buffer_ptr(g.y), (size_t)N * 4), 0);
                int same = !memcmp(rowM, row1, (size_t)N * 4);
                if (p && !same) bench_differ++;
                fprintf(stderr, " %8.1f%s", us, same ? " " : "*");
            }
            fprintf(stderr, "\n");
            backend_stream_free(s);
        }
        gemm_free(&g);
    }
    unsetenv("DISAGG_CUDA_INV_GEMM_M");
    unsetenv("DISAGG_CUDA_INV_SPLITK");
    fprintf(stderr, "  (*: row 0 of the M-row GEMM differs from row 0 alone; invariant policies: %d)\n",
            bench_differ);
    free(rowM), free(row1);
    assert_int_equal(bench_differ, 0);
    backend_close(inv);
    backend_close(fast);
}

/* ---- attention --------------------------------------------------------------------------- */

#define AT_BS 16

typedef struct at_case {
    int nh, nkv, hd;
    backend_dtype kv_dt;
} at_case;

/* One call: the sequences' token ranges [lo, hi) (of their L positions), KV already written.
 * q_all (nseq, L, nh*hd) host; out_all receives the outputs of the tokens computed. */
static void at_call(backend_stream *s, const backend_kv *kv, const at_case *c, int nseq,
                    const int *lo, const int *hi, int L, int32_t (*tables)[64], const float *q_all,
                    float *out_all, backend_buffer *qb, backend_buffer *ob, int max_ctx_pad) {
    int W = c->nh * c->hd, T = 0;
    for (int i = 0; i < nseq; i++)
        T += hi[i] - lo[i];
    int32_t *tok = calloc((size_t)T, 4), *tseq = malloc((size_t)T * 4),
            *tpos = malloc((size_t)T * 4), *qo = malloc((size_t)(nseq + 1) * 4),
            *kvl = malloc((size_t)nseq * 4), *bti = malloc((size_t)(nseq + 1) * 4),
            *bt = malloc((size_t)nseq * 64 * 4);
    float *hq = malloc((size_t)T * W * 4), *ho = malloc((size_t)T * W * 4);
    int t = 0, nbt = 0;
    qo[0] = 0, bti[0] = 0;
    for (int i = 0; i < nseq; i++) {
        for (int p = lo[i]; p < hi[i]; p++, t++) {
            tseq[t] = i, tpos[t] = p;
            memcpy(hq + (size_t)t * W, q_all + ((size_t)i * L + p) * W, (size_t)W * 4);
        }
        qo[i + 1] = t;
        kvl[i] = hi[i];
        int need = (hi[i] + AT_BS - 1) / AT_BS;
        memcpy(bt + nbt, tables[i], (size_t)need * 4);
        nbt += need;
        bti[i + 1] = nbt;
    }
    int32_t *orow = malloc((size_t)T * 4);
    for (int i = 0; i < T; i++)
        orow[i] = i;
    backend_batch b = {T, nseq, tok, tseq, tpos, qo, kvl, bti, bt, max_ctx_pad ? T : 0, orow};
    assert_int_equal(backend_upload(s, backend_buffer_ptr(qb), hq, (size_t)T * W * 4), 0);
    if (max_ctx_pad) {
        /* a recorded decode step's plan (one token per sequence): the padded context */
        assert_int_equal(backend_graph_plan(s, &b, max_ctx_pad, 64), 0);
    } else {
        assert_int_equal(backend_plan(s, &b), 0);
    }
    assert_int_equal(backend_attention(s, backend_buffer_ptr(ob), backend_buffer_ptr(qb),
                                       BACKEND_F32, kv, 1, c->nh, 1.0f / sqrtf((float)c->hd)),
                     0);
    assert_int_equal(backend_download(s, ho, backend_buffer_ptr(ob), (size_t)T * W * 4), 0);
    t = 0;
    for (int i = 0; i < nseq; i++)
        for (int p = lo[i]; p < hi[i]; p++, t++)
            memcpy(out_all + ((size_t)i * L + p) * W, ho + (size_t)t * W, (size_t)W * 4);
    free(tok), free(tseq), free(tpos), free(qo), free(kvl), free(bti), free(bt), free(hq), free(ho);
    free(orow);
}

/* the target (sequence 0) under a schedule: chunks[] sizes (0-terminated) alone, or with
 * n_others sequences stepping through their own random chunks in the same calls */
static void at_schedule(backend_stream *s, const backend_kv *kv, const at_case *c, int L,
                        int32_t (*tables)[64], const float *q_all, float *out, backend_buffer *qb,
                        backend_buffer *ob, const int *chunks, int n_others, int graph_pad) {
    int n = 1 + n_others, done[64] = {0}, ci = 0;
    while (1) {
        int idx[64], l2[64], h2[64], m = 0;
        for (int i = 0; i < n; i++) {
            if (done[i] >= L) continue;
            int k;
            if (i == 0) {
                k = chunks[ci] ? chunks[ci++] : 1;
            } else {
                int r = irand(4);
                k = r == 1 ? 1 + irand(15) : r == 2 ? 16 + irand(80) : 1;
            }
            if (done[i] + k > L) k = L - done[i];
            idx[m] = i, l2[m] = done[i], h2[m] = done[i] + k;
            done[i] += k;
            m++;
        }
        if (!m) break;
        static int32_t t2[64][64];
        float *q2 = malloc((size_t)m * L * c->nh * c->hd * 4),
              *o2 = malloc((size_t)m * L * c->nh * c->hd * 4);
        size_t row = (size_t)L * c->nh * c->hd;
        for (int j = 0; j < m; j++) {
            memcpy(t2[j], tables[idx[j]], sizeof t2[j]);
            memcpy(q2 + j * row, q_all + idx[j] * row, row * 4);
        }
        int all_one = 1;
        for (int j = 0; j < m; j++)
            all_one &= h2[j] - l2[j] == 1;
        at_call(s, kv, c, m, l2, h2, L, t2, q2, o2, qb, ob, graph_pad && all_one ? graph_pad : 0);
        for (int j = 0; j < m; j++)
            memcpy(out + idx[j] * row + (size_t)l2[j] * c->nh * c->hd,
                   o2 + j * row + (size_t)l2[j] * c->nh * c->hd,
                   (size_t)(h2[j] - l2[j]) * c->nh * c->hd * 4);
        free(q2), free(o2);
    }
}

static int at_case_run(backend *be, const at_case *c, int *rows_checked) {
    enum { L = 300, NSEQ = 16 };
    backend_stream *s = backend_stream_create(be);
    assert_non_null(s);
    int W = c->nh * c->hd, kvd = c->nkv * c->hd, nlayers = 2, nb = NSEQ * 24;
    backend_kv kv = {NULL, c->kv_dt, nb, AT_BS, nlayers, c->nkv, c->hd, 0, NULL, NULL};
    backend_buffer *kvb = backend_buffer_alloc(be, backend_kv_block_bytes(&kv) * nb, BACKEND_BUF_KV);
    assert_non_null(kvb);
    kv.base = backend_buffer_ptr(kvb);
    static int32_t tables[NSEQ][64];
    for (int i = 0; i < NSEQ; i++)
        for (int b = 0; b < 24; b++)
            tables[i][b] = nb - 1 - (b * NSEQ + i);
    /* K and V of every sequence's L positions (layer 1), written once through a plan */
    size_t qn = (size_t)NSEQ * L * W;
    float *q_all = malloc(qn * 4), *k = malloc((size_t)NSEQ * L * kvd * 4),
          *v = malloc((size_t)NSEQ * L * kvd * 4);
    for (size_t i = 0; i < qn; i++)
        q_all[i] = frand() * 2.0f;
    for (size_t i = 0; i < (size_t)NSEQ * L * kvd; i++)
        k[i] = frand(), v[i] = frand();
    backend_buffer *qb = backend_buffer_alloc(be, (size_t)NSEQ * L * W * 4, 0),
                   *ob = backend_buffer_alloc(be, (size_t)NSEQ * L * W * 4, 0),
                   *kb = backend_buffer_alloc(be, (size_t)L * kvd * 4, 0),
                   *vb = backend_buffer_alloc(be, (size_t)L * kvd * 4, 0);
    for (int i = 0; i < NSEQ; i++) {
        int32_t tok[L], tseq[L], tpos[L], qo[2] = {0, L}, kvl[1] = {L}, bti[2] = {0, 24};
        for (int p = 0; p < L; p++)
            tok[p] = 0, tseq[p] = 0, tpos[p] = p;
        backend_batch b = {L, 1, tok, tseq, tpos, qo, kvl, bti, tables[i], 0, NULL};
        assert_int_equal(backend_plan(s, &b), 0);
        assert_int_equal(backend_upload(s, backend_buffer_ptr(kb), k + (size_t)i * L * kvd,
                                        (size_t)L * kvd * 4),
                         0);
        assert_int_equal(backend_upload(s, backend_buffer_ptr(vb), v + (size_t)i * L * kvd,
                                        (size_t)L * kvd * 4),
                         0);
        assert_int_equal(backend_kv_write(s, &kv, 1, backend_buffer_ptr(kb),
                                          backend_buffer_ptr(vb), BACKEND_F32),
                         0);
    }
    float *ref = calloc(qn, 4), *got = calloc(qn, 4);
    static const int at_once[] = {L, 0}, chunks[] = {7, 16, 64, 33, 1, 100, 15, 17, 0},
                     by_token[] = {0}, big[] = {48, 48, 48, 48, 48, 0};
    at_schedule(s, &kv, c, L, tables, q_all, ref, qb, ob, at_once, 0, 0);
    struct {
        const int *ch;
        int others, graph;
        const char *name;
    } sc[] = {{chunks, 0, 0, "chunks"},
              {by_token, 0, 0, "token by token"},
              {by_token, 0, 512, "token by token, graph plans"},
              {big, 3, 0, "48-token chunks with 3 others"},
              {chunks, 15, 0, "chunks with 15 others"},
              {by_token, 15, 384, "token by token with 15 others, graph plans"}};
    int differ = 0;
    size_t W0 = (size_t)L * W;
    *rows_checked = 0;
    for (size_t k2 = 0; k2 < sizeof sc / sizeof sc[0]; k2++) {
        if (on_cpu && sc[k2].graph) continue; /* no graphs on the CPU */
        memset(got, 0, qn * 4);
        at_schedule(s, &kv, c, L, tables, q_all, got, qb, ob, sc[k2].ch, sc[k2].others,
                    sc[k2].graph);
        int d = 0;
        for (int p = 0; p < L; p++)
            d += memcmp(got + (size_t)p * W, ref + (size_t)p * W, (size_t)W * 4) != 0;
        (void)W0;
        *rows_checked += L;
        differ += d;
        if (d)
            fprintf(stderr, "    %s: %d of %d positions differ from the prefill at once\n",
                    sc[k2].name, d, L);
    }
    free(q_all), free(k), free(v), free(ref), free(got);
    backend_buffer_free(qb), backend_buffer_free(ob), backend_buffer_free(kb);
    backend_buffer_free(vb), backend_buffer_free(kvb);
    backend_stream_free(s);
    return differ;
}

static void test_attention_invariant(void **st) {
    NEED_GPU();
    static const at_case cases[] = {{4, 2, 16, BACKEND_BF16},  {8, 2, 32, BACKEND_BF16},
                                    {28, 4, 128, BACKEND_BF16}, {8, 8, 64, BACKEND_BF16},
                                    {8, 2, 32, BACKEND_F32},   {28, 4, 128, BACKEND_F32}};
    backend *inv = open_cuda(1), *fast = open_cuda(0);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const at_case *c = &cases[i];
        int n = 0, fn = 0;
        uint64_t save = rs;
        int d = at_case_run(inv, c, &n);
        rs = save;
        int fd = with_fast() ? at_case_run(fast, c, &fn) : -1;
        fprintf(stderr,
                "  attention %d heads / %d KV heads, head_dim %d, %s KV: invariant mode %d/%d "
                "positions differ across 6 schedules (fast mode: %d/%d)\n",
                c->nh, c->nkv, c->hd, c->kv_dt == BACKEND_BF16 ? "bf16" : "f32", d, n, fd, fn);
        assert_int_equal(d, 0);
        /* head_dim 64/128: the decode kernel's other shapes (DISAGG_CUDA_INV_ATT: 0 the
         * one-warp kernel, N key tiles per CTA) give the bits of the prefill at once too */
        static const char *vars[] = {"0", "1", "2", "8"};
        for (size_t v = 0; c->hd >= 64 && v < sizeof vars / sizeof vars[0]; v++) {
            setenv("DISAGG_CUDA_INV_ATT", vars[v], 1);
            rs = save;
            int dv = at_case_run(inv, c, &n);
            fprintf(stderr, "    DISAGG_CUDA_INV_ATT=%s: %d/%d positions differ\n", vars[v], dv,
                    n);
            assert_int_equal(dv, 0);
        }
        unsetenv("DISAGG_CUDA_INV_ATT");
    }
    backend_close(inv);
    backend_close(fast);
}

/* ---- the model ----------------------------------------------------------------------------- */

#define MB 16 /* KV block size */

typedef struct mseq {
    int32_t *toks; /* (len) */
    int len;
    int32_t table[512];
    float *logits; /* (len, V) */
    int done;
} mseq;

/* runs the sequences in lock-step calls: sequence i takes its next chunk from sched(i) each
 * call until its len tokens are in; logits of every token */
typedef int (*chunk_fn)(int seq, int done, int call);

static int ch_all(int seq, int done, int call) {
    return 1 << 20;
}
static int ch_one(int seq, int done, int call) {
    return 1;
}
static int g_prompt; /* prompt length: then one token at a time */
static int ch_prompt_then_one(int seq, int done, int call) {
    return done == 0 ? g_prompt : 1;
}
static int ch_mixed(int seq, int done, int call) {
    static const int c[] = {7, 16, 64, 33, 1, 100, 15, 17, 2, 48};
    return c[(call + seq) % 10];
}
static int ch_random(int seq, int done, int call) {
    if (seq == 0) return 48;
    int r = irand(5);
    return r == 0 ? 1 + irand(15) : r == 1 ? 16 + irand(100) : 1;
}

static void m_run(const decoder_model *m, decoder_state *st, const kv_store *kv, mseq *sq, int n,
                  chunk_fn fn, int max_tokens) {
    int V = m->cfg.vocab_size;
    decoder_seq *q = calloc((size_t)n, sizeof *q);
    for (int i = 0; i < n; i++)
        sq[i].done = 0;
    for (int call = 0;; call++) {
        int k = 0, T = 0;
        for (int i = 0; i < n; i++) {
            if (sq[i].done >= sq[i].len) continue;
            int c = fn(i, sq[i].done, call);
            if (c > sq[i].len - sq[i].done) c = sq[i].len - sq[i].done;
            if (T + c > max_tokens) c = max_tokens - T;
            if (c <= 0) continue;
            /* the target keeps every token's logits; the others only their last one's */
            q[k++] = (decoder_seq){sq[i].toks + sq[i].done,
                                 c,
                                 sq[i].done,
                                 sq[i].table,
                                 (sq[i].done + c + MB - 1) / MB,
                                 i ? sq[i].logits : sq[i].logits + (size_t)sq[i].done * V,
                                 i ? 0 : 1, NULL, NULL};
            sq[i].done += c;
            T += c;
        }
        if (!k) break;
        assert_int_equal(decoder_forward(m, st, kv, q, k), 0);
    }
    free(q);
}

static int argmax_row(const float *x, int V) {
    int b = 0;
    for (int v = 1; v < V; v++)
        if (x[v] > x[b]) b = v;
    return b;
}

/* One model, one mode: the target prompt (P tokens + G greedy tokens found alone) under every
 * schedule; returns differing rows (of the target's P + G) against the prefill at once. */
static int model_case(const char *dir, int inv, int P, int G, int *rows, const char *label) {
    backend *be = open_cuda(inv);
    decoder_model m;
    char err[1024];
    int rc = decoder_load_on(&m, dir, be, 0, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, 0);
    int V = m.cfg.vocab_size, L = P + G, NS = 64, max_tokens = 2048;
    int per = (L + 300 + MB - 1) / MB, nb = NS * per;
    assert_true(per <= 512);
    kv_store kv;
    assert_int_equal(kv_store_init_on(&kv, be, &m.cfg, nb, MB, on_cpu ? BACKEND_F32 : BACKEND_BF16,
                                      BACKEND_BUF_KV),
                     0);
    decoder_state *st = decoder_state_create(&m, max_tokens);
    assert_non_null(st);
    assert_true(decoder_state_set_graphs(st, NS) > 0 || on_cpu);
    mseq *sq = calloc((size_t)NS, sizeof *sq);
    int vmax = V < 30000 ? V : 30000;
    for (int i = 0; i < NS; i++) {
        sq[i].len = i ? 1 + irand(L + 100) : L;
        sq[i].toks = malloc((size_t)(L + 300) * 4);
        sq[i].logits = malloc((size_t)(i ? 1 : L + 300) * V * 4);
        assert_non_null(sq[i].logits);
        for (int t = 0; t < L + 300; t++)
            sq[i].toks[t] = irand(vmax);
        for (int b = 0; b < per; b++)
            sq[i].table[b] = nb - 1 - (b * NS + i); /* interleaved, descending */
    }
    /* the target's greedy continuation, found alone (prompt, then one token a step) */
    g_prompt = P;
    for (int gstep = 0; gstep < G; gstep++) {
        sq[0].len = P + gstep;
        m_run(&m, st, &kv, sq, 1, ch_all, max_tokens);
        sq[0].toks[P + gstep] = argmax_row(sq[0].logits + (size_t)(P + gstep - 1) * V, V);
    }
    sq[0].len = L;
    float *ref = malloc((size_t)L * V * 4);
    m_run(&m, st, &kv, sq, 1, ch_all, max_tokens);
    memcpy(ref, sq[0].logits, (size_t)L * V * 4);
    struct {
        chunk_fn fn;
        int others;
        const char *name;
    } sc[] = {{ch_prompt_then_one, 0, "prefill, then decode (graphs)"},
              {ch_one, 0, "token by token"},
              {ch_mixed, 0, "chunks 7,16,64,33,1,100,..."},
              {ch_random, 1, "batch of 2"},
              {ch_random, 7, "batch of 8"},
              {ch_mixed, 31, "batch of 32, mixed chunks"},
              {ch_random, 63, "batch of 64"},
              {ch_prompt_then_one, 63, "batch of 64, prefill then decode (graphs)"}};
    int differ = 0;
    *rows = 0;
    for (size_t k = 0; k < sizeof sc / sizeof sc[0]; k++) {
        memset(sq[0].logits, 0, (size_t)L * V * 4);
        m_run(&m, st, &kv, sq, 1 + sc[k].others, sc[k].fn, max_tokens);
        int d = 0;
        double worst = 0;
        for (int p = 0; p < L; p++) {
            const float *a = sq[0].logits + (size_t)p * V, *b = ref + (size_t)p * V;
            if (memcmp(a, b, (size_t)V * 4)) {
                d++;
                for (int v = 0; v < V; v++)
                    if (fabs(a[v] - b[v]) > worst) worst = fabs(a[v] - b[v]);
            }
        }
        *rows += L;
        differ += d;
        fprintf(stderr, "    %s %-6s %-44s %4d/%d positions differ (max |dlogit| %.3g)\n", label,
                inv ? "inv" : "fast", sc[k].name, d, L, worst);
    }
    fprintf(stderr, "    %s %s: %d graph(s) recorded\n", label, inv ? "inv" : "fast",
            decoder_state_graphs(st));
    for (int i = 0; i < NS; i++)
        free(sq[i].toks), free(sq[i].logits);
    free(sq), free(ref);
    decoder_state_free(st);
    kv_store_free(&kv);
    decoder_free(&m);
    backend_close(be);
    return differ;
}

static void model_check(const char *dir, int P, int G, const char *label) {
    int rows = 0, frows = 0;
    uint64_t save = rs;
    int d = model_case(dir, 1, P, G, &rows, label);
    rs = save;
    int fd = with_fast() ? model_case(dir, 0, P, G, &frows, label) : -1;
    fprintf(stderr,
            "  model %s: invariant mode %d/%d logit rows differ across 8 schedules (fast mode: "
            "%d/%d)\n",
            label, d, rows, fd, frows);
    assert_int_equal(d, 0);
}

static void test_model_tiny(void **st) {
    NEED_GPU();
    char dir[1024];
    json_t *g = fixture_model("tiny-bf16", dir, sizeof dir);
    assert_non_null(g);
    json_decref(g);
    model_check(dir, 150, 24, "tiny-bf16");
}

static void test_model_default(void **st) {
    NEED_GPU();
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/disagg-sotu-tiny", DISAGG_SOURCE_DIR);
    model_check(dir, 300, 32, "sotu-tiny");
}

static void test_model_7b(void **st) {
    NEED_GPU();
    const char *dir = getenv("DISAGG_INV_7B");
    if (!dir || !*dir) {
        fprintf(stderr, "SKIP %s: set DISAGG_INV_7B to a directory made by "
                        "tools/gen_random_qwen2_gpu.py --shape 7b\n",
                __func__);
        skip();
    }
    model_check(dir, 128, 8, "7b-random");
}

/* Without a GPU too: the harness itself on the CPU backend, which is batch-invariant by
 * construction -- the schedules above must find 0 differences there (so a difference on the
 * GPU is the GPU's).  Attention with f32 KV (no graph plans), the tiny model's schedules. */
static void test_harness_cpu(void **st) {
    on_cpu = 1;
    at_case c = {4, 2, 16, BACKEND_F32};
    int n = 0;
    int d = at_case_run(backend_cpu_default(), &c, &n);
    fprintf(stderr, "  CPU attention: %d/%d positions differ across the schedules\n", d, n);
    assert_int_equal(d, 0);
    char dir[1024];
    json_t *g = fixture_model("tiny-bf16", dir, sizeof dir);
    assert_non_null(g);
    json_decref(g);
    int rows = 0;
    d = model_case(dir, 1, 40, 6, &rows, "tiny-bf16 (CPU)");
    assert_int_equal(d, 0);
    on_cpu = 0;
}

/* ---- the parts of a decode step (DISAGG_INV_DECODE_BENCH=1) ------------------------------ */

/* device buffer of n bytes filled with random bf16 in [-1, 1) (f32: random floats) */
static backend_buffer *rand_buffer(backend *be, backend_stream *s, size_t n, int f32) {
    backend_buffer *b = backend_buffer_alloc(be, n, 0);
    assert_non_null(b);
    size_t chunk = (size_t)64 << 20;
    uint16_t *h = malloc(chunk);
    assert_non_null(h);
    for (size_t i = 0; i < chunk / 2; i++) {
        float f = frand();
        uint32_t u;
        memcpy(&u, &f, 4);
        h[i] = (uint16_t)(u >> 16);
    }
    if (f32)
        for (size_t i = 0; i < chunk / 4; i++) {
            float f = frand();
            memcpy((char *)h + i * 4, &f, 4);
        }
    for (size_t o = 0; o < n; o += chunk)
        assert_int_equal(backend_upload(s, (char *)backend_buffer_ptr(b) + o, h,
                                        n - o < chunk ? n - o : chunk),
                         0);
    assert_int_equal(backend_stream_sync(s), 0);
    free(h);
    return b;
}

/* The GEMMs of one 7B decode step (28 x q|k|v, o, gate|up, down, then lm_head; x bf16, y f32)
 * and its attention (28 layers, a recorded graph as serve runs it; bf16 KV, 16-token blocks,
 * bf16 output), each timed alone, fast mode against invariant mode (and the invariant decode
 * attention kernels forced by DISAGG_CUDA_INV_ATT), at batch 1, 8, 32, 64 and context 1,024 /
 * 4,096.  Milliseconds per step: what each part contributes to `disagg bench model`. */
static void test_decode_bench(void **st) {
    NEED_GPU();
    const char *want = getenv("DISAGG_INV_DECODE_BENCH");
    if (!want || !*want || !strcmp(want, "0")) {
        fprintf(stderr, "SKIP %s: set DISAGG_INV_DECODE_BENCH=1\n", __func__);
        skip();
    }
    enum { NL = 28, NH = 28, NKV = 4, HD = 128, H = 3584, I = 18944, V = 152064, BS = 16 };
    static const int Bs[] = {1, 8, 32, 64}, ctxs[] = {1024, 4096};
    const int nB = 4, nC = 2;
    backend *be[2] = {open_cuda(0), open_cuda(1)};
    static const int shp[5][2] = {{(NH + 2 * NKV) * HD, H}, {H, H}, {2 * I, H}, {H, I}, {V, H}};
    for (int mode = 0; mode < 2; mode++) {
        backend_stream *s = backend_stream_create(be[mode]);
        backend_buffer *w[5], *x = rand_buffer(be[mode], s, (size_t)64 * I * 2, 0),
                              *y = backend_buffer_alloc(be[mode], (size_t)64 * V * 4, 0);
        for (int k = 0; k < 5; k++)
            w[k] = rand_buffer(be[mode], s, (size_t)shp[k][0] * shp[k][1] * 2, 0);
        fprintf(stderr, "  decode-step GEMMs, %s mode, ms per step (28 layers + lm_head):",
                mode ? "invariant" : "fast");
        for (int bi = 0; bi < nB; bi++) {
            int M = Bs[bi];
            double best = 1e30;
            for (int r = 0; r < 4; r++) {
                double t0 = now_s();
                for (int l = 0; l <= NL; l++)
                    for (int k = l < NL ? 0 : 4; k < (l < NL ? 4 : 5); k++) {
                        backend_matmul_op op = {backend_buffer_ptr(y), BACKEND_F32,
                                                backend_buffer_ptr(x), BACKEND_BF16,
                                                backend_buffer_ptr(w[k]), BACKEND_BF16,
                                                NULL, M, shp[k][0], shp[k][1], {NULL, 0, 0, NULL}};
                        assert_int_equal(backend_matmul(s, &op, 1), 0);
                    }
                assert_int_equal(backend_stream_sync(s), 0);
                double el = now_s() - t0;
                if (r && el < best) best = el; /* round 0: the bucket probes */
            }
            fprintf(stderr, "  B=%d %.3f", M, best * 1e3);
        }
        fprintf(stderr, "\n");
        for (int k = 0; k < 5; k++)
            backend_buffer_free(w[k]);
        backend_buffer_free(x), backend_buffer_free(y);
        backend_stream_free(s);
    }
    /* attention: KV for 64 sequences of 4,096 + 16 positions, 28 layers */
    int per = (4096 + 16 + BS - 1) / BS, nb = 64 * per;
    const char *vars[] = {"fast", "inv", "inv old (k_iv_part)", "inv tps 1", "inv tps 2",
                          "inv tps 4", "inv tps 8"};
    const char *env[] = {NULL, NULL, "0", "1", "2", "4", "8"};
    const int nV = 7;
    double ms[7][2][4];
    memset(ms, 0, sizeof ms);
    for (int mode = 0; mode < 2; mode++) {
        backend_stream *s = backend_stream_create(be[mode]);
        backend_kv kv = {NULL, BACKEND_BF16, nb, BS, NL, NKV, HD, 0, NULL, NULL};
        size_t kvbytes = backend_kv_block_bytes(&kv) * nb;
        backend_buffer *kvb = rand_buffer(be[mode], s, kvbytes, 0);
        kv.base = backend_buffer_ptr(kvb);
        backend_buffer *qb = rand_buffer(be[mode], s, (size_t)64 * NH * HD * 4, 1),
                       *ob = backend_buffer_alloc(be[mode], (size_t)64 * NH * HD * 4, 0);
        int32_t *bt = malloc((size_t)nb * 4), tok[64], tseq[64], tpos[64], qo[65], kvl[64],
                bti[65], orow[64];
        for (int i = 0; i < nb; i++)
            bt[i] = (int32_t)(((size_t)i * 7919) % (size_t)nb); /* scattered blocks */
        for (int v = mode ? 1 : 0; v < (mode ? nV : 1); v++) {
            if (env[v]) setenv("DISAGG_CUDA_INV_ATT", env[v], 1);
            else unsetenv("DISAGG_CUDA_INV_ATT");
            for (int ci = 0; ci < nC; ci++)
                for (int bi = 0; bi < nB; bi++) {
                    int B = Bs[bi], ctx = ctxs[ci] + 8, nbs = (ctx + BS - 1) / BS;
                    int C = 256;
                    while (C < ctx)
                        C = (C & (C - 1)) == 0 ? C + C / 2 : C / 3 * 4;
                    qo[0] = bti[0] = 0;
                    for (int i = 0; i < B; i++) {
                        tok[i] = 0, tseq[i] = i, tpos[i] = ctx - 1, qo[i + 1] = i + 1;
                        kvl[i] = ctx, bti[i + 1] = (i + 1) * nbs, orow[i] = i;
                    }
                    int32_t *bti_bt = malloc((size_t)B * nbs * 4);
                    for (int i = 0; i < B; i++)
                        memcpy(bti_bt + (size_t)i * nbs, bt + (size_t)i * per, (size_t)nbs * 4);
                    backend_batch b = {B, B, tok, tseq, tpos, qo, kvl, bti, bti_bt, B, orow};
                    backend_graph_reset(s);
                    assert_int_equal(backend_graph_plan(s, &b, C, (C + BS - 1) / BS), 0);
                    double best = 1e30;
                    for (int r = 0; r < 8; r++) {
                        double t0 = now_s();
                        int g = backend_graph_begin(s);
                        assert_true(g >= 0);
                        if (g == 0) {
                            int rc = 0;
                            for (int l = 0; l < NL && !rc; l++)
                                rc = backend_attention_to(s, backend_buffer_ptr(ob), BACKEND_BF16,
                                                          backend_buffer_ptr(qb), BACKEND_F32,
                                                          &kv, l, NH, 0.0884f);
                            assert_int_equal(rc, 0);
                            assert_int_equal(backend_graph_end(s, 1), 0);
                        }
                        assert_int_equal(backend_stream_sync(s), 0);
                        double el = now_s() - t0;
                        if (r >= 3 && el < best) best = el; /* 0, 1: warm-up, recording */
                    }
                    ms[v][ci][bi] = best * 1e3;
                    free(bti_bt);
                }
        }
        unsetenv("DISAGG_CUDA_INV_ATT");
        backend_graph_reset(s);
        free(bt);
        backend_buffer_free(qb), backend_buffer_free(ob), backend_buffer_free(kvb);
        backend_stream_free(s);
    }
    fprintf(stderr, "  decode-step attention (28 layers, one recorded graph, bf16 KV and output), "
                    "ms per step\n  %-22s", "variant \\ B");
    for (int ci = 0; ci < nC; ci++)
        for (int bi = 0; bi < nB; bi++)
            fprintf(stderr, " %5s%-4d", ci ? "4k:" : "1k:", Bs[bi]);
    fprintf(stderr, "\n");
    for (int v = 0; v < nV; v++) {
        fprintf(stderr, "  %-22s", vars[v]);
        for (int ci = 0; ci < nC; ci++)
            for (int bi = 0; bi < nB; bi++)
                fprintf(stderr, " %9.3f", ms[v][ci][bi]);
        fprintf(stderr, "\n");
    }
    backend_close(be[0]);
    backend_close(be[1]);
}

/* Without a GPU too: the CPU backend accepts the option (it is always batch-invariant). */
static void test_cpu_accepts(void **st) {
    backend *be = NULL;
    backend_options o;
    backend_options_init(&o);
    o.batch_invariant = 1;
    char err[512];
    assert_int_equal(backend_open("cpu", &o, &be, err, sizeof err), 0);
    assert_true(backend_is_cpu(be));
    backend_close(be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_accepts),
        cmocka_unit_test(test_harness_cpu),
        cmocka_unit_test(test_matmul_invariant),
        cmocka_unit_test(test_gate_up_invariant),
        cmocka_unit_test(test_attention_invariant),
        cmocka_unit_test(test_model_tiny),
        cmocka_unit_test(test_model_default),
        cmocka_unit_test(test_model_7b),
        cmocka_unit_test(test_matmul_bench),
        cmocka_unit_test(test_decode_bench),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
