/*
 * test_backend_ops — every operation of kernels/backend.h on every backend this machine
 * has, against a straightforward double-precision reference written here, on random inputs
 * of awkward shapes (odd widths, K not a multiple of 8, partial KV blocks, scrambled block
 * tables, GQA ratios 1..7, prefill, decode and mixed batches), in the style of ggml's
 * test-backend-ops.  Each operation states its tolerance per activation dtype (tol_f32 for
 * the CPU's f32, tol_bf16 for a backend computing in bf16).  The CPU backend always runs;
 * the CUDA backend runs when backend_open("cuda") succeeds (each backend is checked against
 * the same reference, so CUDA and CPU agree within the sum of their tolerances), else a
 * loud SKIP line says why.  A further backend is one more entry in g_be.  Also: buffers (zeroed
 * allocation, upload/download, copy, the KV flag), the plan's checks, and the registry's
 * errors for unknown devices and a missing CUDA module.
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

#include "kernels/backend.h"
#include "kernels/fp8.h"

#define MAX_BE 2
static backend *g_be[MAX_BE]; /* [0] cpu, [1] cuda when available */
static int g_n_be;

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* [0, 1) */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) / 9007199254740992.0;
}
static float frand(void) { /* [-1, 1) */
    return (float)(urand() * 2.0 - 1.0);
}
static int irand(int n) { /* [0, n) */
    return (int)(urand() * n);
}

/* ---- dtype helpers ---------------------------------------------------------------- */

static uint16_t f32_to_bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* f16 of a multiple of 1/1024 in (-1, 1): exact */
static uint16_t f32_to_f16_exact(float v) {
    int k = (int)lrintf(v * 1024.0f);
    uint16_t sign = k < 0 ? 0x8000 : 0;
    k = abs(k);
    if (k == 0) return sign;
    int e = 0;
    while ((k >> e) > 1)
        e++;
    return (uint16_t)(sign | ((uint32_t)(e - 10 + 15) << 10) | ((uint32_t)(k << (10 - e)) & 0x3ff));
}

/* Rounds v (n) to what dtype dt can hold, in place: the reference sees the same values. */
static void round_to(float *v, size_t n, backend_dtype dt) {
    for (size_t i = 0; i < n; i++) {
        if (dt == BACKEND_BF16) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
        if (dt == BACKEND_F16) v[i] = roundf(v[i] * 1024.0f) / 1024.0f;
    }
}
static float *rand_vec(size_t n, backend_dtype dt) {
    float *v = malloc(n * sizeof *v);
    assert_non_null(v);
    for (size_t i = 0; i < n; i++)
        v[i] = frand() * (dt == BACKEND_F16 ? 0.999f : 1.0f);
    round_to(v, n, dt);
    return v;
}

/* a device buffer holding host f32 values (n) as dt */
static backend_buffer *to_dev(backend_stream *st, const float *v, size_t n, backend_dtype dt) {
    backend *be = backend_stream_backend(st);
    backend_buffer *b = backend_buffer_alloc(be, n * backend_dtype_size(dt), 0);
    assert_non_null(b);
    void *tmp = malloc(n * backend_dtype_size(dt));
    assert_non_null(tmp);
    for (size_t i = 0; i < n; i++) {
        if (dt == BACKEND_F32) ((float *)tmp)[i] = v[i];
        if (dt == BACKEND_BF16) ((uint16_t *)tmp)[i] = f32_to_bf16(v[i]);
        if (dt == BACKEND_F16) ((uint16_t *)tmp)[i] = f32_to_f16_exact(v[i]);
    }
    assert_int_equal(backend_upload(st, backend_buffer_ptr(b), tmp, n * backend_dtype_size(dt)), 0);
    free(tmp);
    return b;
}
/* host f32 copy of n elements of dt at device address dev */
static float *from_dev(backend_stream *st, const void *dev, size_t n, backend_dtype dt) {
    assert_int_equal(backend_stream_sync(st), 0);
    void *tmp = malloc(n * backend_dtype_size(dt));
    float *out = malloc(n * sizeof *out);
    assert_non_null(tmp);
    assert_non_null(out);
    assert_int_equal(backend_download(st, tmp, dev, n * backend_dtype_size(dt)), 0);
    for (size_t i = 0; i < n; i++)
        out[i] = dt == BACKEND_F32 ? ((float *)tmp)[i] : bf16_to_f32(((uint16_t *)tmp)[i]);
    free(tmp);
    return out;
}
#define DEV(b) backend_buffer_ptr(b)

/* the largest |got - want| / (1 + |want|) (NaN: infinity) */
static double max_err(const float *got, const double *want, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]) / (1.0 + fabs(want[i]));
        if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
    }
    return worst;
}
/* |got - want| <= tol * (1 + |want|) everywhere, else fail naming the op and element */
static void check_close(const char *what, const backend *be, const float *got, const double *want,
                        size_t n, double tol) {
    double worst = 0;
    size_t wi = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]) / (1.0 + fabs(want[i]));
        if (!(e <= worst)) worst = e, wi = i; /* NaN counts as worst */
    }
    if (!(worst <= tol))
        fail_msg("%s on %s: element %zu is %.9g, reference %.9g (error %.3g > tolerance %.3g)",
                 what, backend_name(be), wi, (double)got[wi], want[wi], worst, tol);
}
/* check_close with slack[i] more room at element i (slack NULL: none) */
static void check_close_slack(const char *what, const backend *be, const float *got,
                              const double *want, const double *slack, size_t n, double tol) {
    double worst = -1;
    size_t wi = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]), room = tol * (1.0 + fabs(want[i]));
        double e = (d - (slack ? slack[i] : 0.0)) / room; /* <= 1: within */
        if (!(e <= worst)) worst = e, wi = i;           /* NaN counts as worst */
    }
    if (!(worst <= 1.0))
        fail_msg("%s on %s: element %zu is %.9g, reference %.9g (error %.3g > tolerance %.3g + "
                 "%.3g)",
                 what, backend_name(be), wi, (double)got[wi], want[wi],
                 fabs((double)got[wi] - want[wi]), tol * (1.0 + fabs(want[wi])),
                 slack ? slack[wi] : 0.0);
}
static double tol_for(const backend *be, double tol_f32, double tol_bf16) {
    return backend_act_dtype(be) == BACKEND_F32 ? tol_f32 : tol_bf16;
}

/* ---- the batch ------------------------------------------------------------------------ */

/* S sequences with n_new[s] new tokens after start[s] cached ones, block tables drawn
 * without repetition from n_blocks blocks. */
typedef struct test_batch {
    int S, T, bs, n_blocks;
    int32_t tokens[512], tok_seq[512], tok_pos[512], out_rows[512];
    int32_t qo[65], kv_len[64], bt_ptr[65], bt[1024];
    backend_batch b;
} test_batch;

static void make_batch(test_batch *tb, int S, const int *start, const int *n_new, int bs,
                       int n_blocks, int vocab) {
    memset(tb, 0, sizeof *tb);
    tb->S = S, tb->bs = bs, tb->n_blocks = n_blocks;
    int perm[1024];
    for (int i = 0; i < n_blocks; i++)
        perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = irand(i + 1), x = perm[i];
        perm[i] = perm[j], perm[j] = x;
    }
    int t = 0, nb = 0;
    for (int s = 0; s < S; s++) {
        int end = start[s] + n_new[s], need = (end + bs - 1) / bs;
        assert_true(nb + need <= n_blocks);
        for (int j = 0; j < need; j++)
            tb->bt[nb + j] = perm[nb + j];
        nb += need;
        for (int j = 0; j < n_new[s]; j++, t++) {
            tb->tokens[t] = irand(vocab);
            tb->tok_seq[t] = s;
            tb->tok_pos[t] = start[s] + j;
        }
        tb->qo[s + 1] = t;
        tb->kv_len[s] = end;
        tb->bt_ptr[s + 1] = nb;
    }
    tb->T = t;
    tb->b = (backend_batch){t,          S,          tb->tokens, tb->tok_seq, tb->tok_pos, tb->qo,
                            tb->kv_len, tb->bt_ptr, tb->bt,     0,           tb->out_rows};
}

/* ---- operations ------------------------------------------------------------------------ */

static void test_embed(void **state) {
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be);
        for (int dt = 0; dt < 3; dt++) {
            int vocab = 37, hidden = 13 + 8 * dt;
            float *table = rand_vec((size_t)vocab * hidden, (backend_dtype)dt);
            backend_buffer *tb_ = to_dev(st, table, (size_t)vocab * hidden, (backend_dtype)dt);
            test_batch tb;
            int start[2] = {0, 5}, n_new[2] = {6, 3};
            make_batch(&tb, 2, start, n_new, 4, 8, vocab);
            assert_int_equal(backend_plan(st, &tb.b), 0);
            backend_buffer *out = backend_buffer_alloc(be, (size_t)tb.T * hidden * 4, 0);
            assert_int_equal(backend_embed(st, DEV(out), a, DEV(tb_), (backend_dtype)dt, hidden),
                             0);
            float *got = from_dev(st, DEV(out), (size_t)tb.T * hidden, a);
            double *want = malloc(sizeof(double) * tb.T * hidden);
            for (int t = 0; t < tb.T; t++)
                for (int i = 0; i < hidden; i++)
                    want[t * hidden + i] = table[(size_t)tb.tokens[t] * hidden + i];
            check_close("embed", be, got, want, (size_t)tb.T * hidden, tol_for(be, 0, 4e-3));
            free(got), free(want), free(table);
            backend_buffer_free(out), backend_buffer_free(tb_);
        }
        backend_stream_free(st);
    }
}

static void test_rmsnorm(void **state) {
    int shapes[][2] = {{1, 1}, {3, 7}, {5, 64}, {2, 129}, {4, 896}};
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be);
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            int rows = shapes[k][0], n = shapes[k][1];
            float *x = rand_vec((size_t)rows * n, a), *w = rand_vec((size_t)n, BACKEND_F32);
            backend_buffer *bx = to_dev(st, x, (size_t)rows * n, a),
                           *bw = to_dev(st, w, (size_t)n, BACKEND_F32),
                           *bo = backend_buffer_alloc(be, (size_t)rows * n * 4, 0);
            const float eps = 1e-6f;
            assert_int_equal(backend_rmsnorm(st, DEV(bo), a, DEV(bx), a, DEV(bw), rows, n, eps), 0);
            double *want = malloc(sizeof(double) * rows * n);
            for (int r = 0; r < rows; r++) {
                double ss = 0;
                for (int i = 0; i < n; i++)
                    ss += (double)x[r * n + i] * x[r * n + i];
                double inv = 1.0 / sqrt(ss / n + eps);
                for (int i = 0; i < n; i++)
                    want[r * n + i] = w[i] * (x[r * n + i] * inv);
            }
            float *got = from_dev(st, DEV(bo), (size_t)rows * n, a);
            check_close("rmsnorm", be, got, want, (size_t)rows * n, tol_for(be, 2e-6, 1e-2));
            free(got);
            /* in place (out == x) */
            assert_int_equal(backend_rmsnorm(st, DEV(bx), a, DEV(bx), a, DEV(bw), rows, n, eps), 0);
            got = from_dev(st, DEV(bx), (size_t)rows * n, a);
            check_close("rmsnorm in place", be, got, want, (size_t)rows * n,
                        tol_for(be, 2e-6, 1e-2));
            free(got), free(want), free(x), free(w);
            backend_buffer_free(bx), backend_buffer_free(bw), backend_buffer_free(bo);
        }
        backend_stream_free(st);
    }
}

static void test_matmul(void **state) {
    /* the last five take the CUDA decode GEMV (K % 8 == 0; T = 1 by default, T <= 2 with
     * DISAGG_CUDA_GEMV=2): a row shorter than a warp's 16-byte loads, N not a multiple of the
     * rows of a CTA, K past one batch of loads in flight (256 x 8) with a partial batch after
     * it */
    /* ... and those of K 2056 and more its split-K form (DISAGG_CUDA_GEMV_SPLIT: few rows,
     * long K; by default K 2056 takes 4 splits of 72 uint4s, the last 41, K 4104 and 8200 8;
     * with =8 forced the last split of K 2056 is empty; odd N leaves dead rows in the last CTA
     * at 2 rows a warp, DISAGG_CUDA_GEMV_SPLIT_ROWS) */
    int shapes[][3] = {{1, 1, 1},     {1, 5, 7},    {3, 9, 8},    {7, 13, 33},   {2, 64, 100},
                       {17, 31, 129}, {1, 1, 8},    {1, 37, 264}, {2, 13, 520},  {1, 7, 4104},
                       {2, 5, 2056},  {1, 9, 8200}, {2, 3, 8200}, {1, 301, 4104}};
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be);
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
            for (int dt = 0; dt < 3; dt++)
                for (int withb = 0; withb < 2; withb++) {
                    int T = shapes[k][0], N = shapes[k][1], K = shapes[k][2];
                    /* K > 129: bf16-exact x and w (f16 weights skipped), so that the GPU's
                     * rounding to bf16 is exact and only the f32 sums differ (over 4k terms
                     * the operands' rounding alone would pass 4e-2 of 1 + |ref|) */
                    int exact = K > 129;
                    if (exact && dt == BACKEND_F16) continue;
                    float *x = rand_vec((size_t)T * K, exact ? BACKEND_BF16 : a),
                          *w = rand_vec((size_t)N * K, exact ? BACKEND_BF16 : (backend_dtype)dt),
                          *bias = rand_vec((size_t)N, BACKEND_F32);
                    /* weights as the model loads them: backend_weights_load from host bytes */
                    backend_stream *cst = backend_stream_create(g_be[0]);
                    backend_buffer *tmp = to_dev(cst, w, (size_t)N * K, (backend_dtype)dt);
                    backend_dtype stored;
                    backend_buffer *bw = backend_weights_load(be, DEV(tmp), (backend_dtype)dt,
                                                              (size_t)N * K, &stored);
                    assert_non_null(bw);
                    backend_buffer *bx = to_dev(st, x, (size_t)T * K, a),
                                   *bb = to_dev(st, bias, (size_t)N, BACKEND_F32),
                                   *by = backend_buffer_alloc(be, (size_t)T * N * 4, 0),
                                   *by2 = backend_buffer_alloc(be, (size_t)T * N * 4, 0);
                    /* two ops in one dispatch, the second without bias and f32 out */
                    backend_matmul_op ops[2] = {{DEV(by),
                                                 a,
                                                 DEV(bx),
                                                 a,
                                                 DEV(bw),
                                                 stored,
                                                 withb ? DEV(bb) : NULL,
                                                 T,
                                                 N,
                                                 K,
                                                 {NULL, 0, 0, NULL}},
                                                {DEV(by2),
                                                 BACKEND_F32,
                                                 DEV(bx),
                                                 a,
                                                 DEV(bw),
                                                 stored,
                                                 NULL,
                                                 T,
                                                 N,
                                                 K,
                                                 {NULL, 0, 0, NULL}}};
                    assert_int_equal(backend_matmul(st, ops, 2), 0);
                    double *want = malloc(sizeof(double) * T * N),
                           *want2 = malloc(sizeof(double) * T * N);
                    for (int t = 0; t < T; t++)
                        for (int n = 0; n < N; n++) {
                            double s = 0;
                            for (int i = 0; i < K; i++)
                                s += (double)x[t * K + i] * w[(size_t)n * K + i];
                            want2[t * N + n] = s;
                            want[t * N + n] = s + (withb ? bias[n] : 0);
                        }
                    float *got = from_dev(st, DEV(by), (size_t)T * N, a),
                          *got2 = from_dev(st, DEV(by2), (size_t)T * N, BACKEND_F32);
                    char what[96];
                    snprintf(what, sizeof what, "matmul T %d N %d K %d %s%s", T, N, K,
                             backend_dtype_name((backend_dtype)dt), withb ? " +bias" : "");
                    /* a GPU backend rounds GEMM inputs and weights to bf16 (tensor cores;
                     * f16 and f32 weights are stored bf16) whatever its activation dtype:
                     * 2^-9 relative per operand over K <= 129 terms, 4e-2 of 1 + |ref| */
                    double tol1 = backend_is_cpu(be) ? tol_for(be, 1e-5, 2e-2)
                                  : exact            ? 1e-4
                                                     : 4e-2,
                           tol2 = backend_is_cpu(be) ? tol_for(be, 1e-5, 1e-2)
                                  : exact            ? 1e-4
                                                     : 4e-2;
                    check_close(what, be, got, want, (size_t)T * N, tol1);
                    check_close(what, be, got2, want2, (size_t)T * N, tol2);
                    /* run to run the same bits (split-K partials add in a fixed order) */
                    assert_int_equal(backend_matmul(st, &ops[1], 1), 0);
                    float *got3 = from_dev(st, DEV(by2), (size_t)T * N, BACKEND_F32);
                    assert_memory_equal(got2, got3, sizeof(float) * T * N);
                    free(got3);
                    free(got), free(got2), free(want), free(want2), free(x), free(w), free(bias);
                    backend_buffer_free(bw), backend_buffer_free(tmp);
                    backend_buffer_free(bx), backend_buffer_free(bb), backend_buffer_free(by),
                        backend_buffer_free(by2);
                    backend_stream_free(cst);
                }
        backend_stream_free(st);
    }
}

/* FP8 weights (backend_weights_load_fp8): random e4m3 codes (no NaN) and scales per tensor,
 * per channel and per 128 x 128 block (partial blocks in rows and columns), against a host
 * reference in double of x . (e4m3 * scale)^T.  The CPU dequantizes to f32 at load (1e-5);
 * CUDA's e4m3 GEMV (T <= DISAGG_CUDA_FP8_GEMV, default 8, K % 16 == 0) multiplies the scale
 * onto 16-term partial sums in f32 (1e-4), its larger T run cuBLASLt over the bf16 twin (e4m3 *
 * scale rounded to bf16: 2^-9 per weight, 1e-2 of 1 + |ref|; with DISAGG_CUDA_FP8_TWIN=0 the
 * GEMV, 8 tokens a launch).  K = 24 (not a multiple of 16): the twin at every T, or without a
 * twin the GEMV's scalar form -- no shape is refused. */
static void test_matmul_fp8(void **state) {
    (void)state;
    int shapes[][3] = {{1, 5, 16},    {1, 37, 272}, {3, 200, 336},  {8, 130, 4112},
                       {2, 129, 400}, {9, 33, 256}, {64, 257, 384}, {5, 3, 24},
                       {1, 37, 4128}, {2, 300, 2064}, /* split-K GEMVs */
                       {64, 256, 384}, {100, 512, 2064}, /* CUDA: the e4m3 GEMM (W8A8) */
                       {32, 400, 768}, /* K / 128 not a multiple of 4: the twin */
                       {48, 272, 1024}, {16, 512, 2048}}; /* its 128 x 128 block form (K % 512
                                                             == 0), a partial row block */
    const char *ge = getenv("DISAGG_CUDA_FP8_GEMV");
    int gemv_t = ge ? atoi(ge) : 8;
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be);
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
            for (int lay = 0; lay < 3; lay++) {
                int T = shapes[k][0], N = shapes[k][1], K = shapes[k][2];
                int bn = lay == 0 ? N : lay == 1 ? 1 : 128, bk = lay == 2 ? 128 : K;
                int nkb = (K + bk - 1) / bk, ng = (N + bn - 1) / bn * nkb;
                uint8_t *q = malloc((size_t)N * K);
                float *sc = malloc((size_t)ng * sizeof *sc), *wf = malloc((size_t)N * K * 4);
                assert_non_null(q), assert_non_null(sc), assert_non_null(wf);
                for (int i = 0; i < ng; i++)
                    sc[i] =
                        (float)((0.2 + urand()) * 2.0 / (448.0 * sqrt((double)K))); /* dots ~1 */
                for (size_t i = 0; i < (size_t)N * K; i++) {
                    do
                        q[i] = (uint8_t)irand(256);
                    while ((q[i] & 0x7f) == 0x7f);
                }
                backend_e4m3_to_f32(wf, q, (size_t)N * K);
                float *x = rand_vec((size_t)T * K, BACKEND_BF16),
                      *bias = rand_vec((size_t)N, BACKEND_F32);
                backend_dtype stored;
                backend_wscale ws;
                backend_buffer *bw =
                    backend_weights_load_fp8(be, q, N, K, sc, bn, bk, &stored, &ws);
                assert_non_null(bw);
                assert_true(stored == BACKEND_F8E4M3 ? ws.s != NULL : ws.s == NULL);
                backend_buffer *bx = to_dev(st, x, (size_t)T * K, a),
                               *bb = to_dev(st, bias, (size_t)N, BACKEND_F32),
                               *by = backend_buffer_alloc(be, (size_t)T * N * 4, 0);
                backend_matmul_op op = {DEV(by), BACKEND_F32, DEV(bx), a, DEV(bw), stored,
                                        DEV(bb), T,           N,       K, ws};
                assert_int_equal(backend_matmul(st, &op, 1), 0);
                double *want = malloc(sizeof(double) * T * N);
                for (int t = 0; t < T; t++)
                    for (int n = 0; n < N; n++) {
                        double acc = bias[n];
                        for (int i = 0; i < K; i++)
                            acc += (double)x[t * K + i] * wf[(size_t)n * K + i] *
                                   sc[(n / bn) * nkb + i / bk];
                        want[t * N + n] = acc;
                    }
                float *got = from_dev(st, DEV(by), (size_t)T * N, BACKEND_F32);
                char what[96];
                snprintf(what, sizeof what, "fp8 matmul T %d N %d K %d scales %s", T, N, K,
                         lay == 0   ? "per tensor"
                         : lay == 1 ? "per channel"
                                    : "128x128");
                double tol = backend_is_cpu(be) ? 1e-5 : (T <= gemv_t && K % 16 == 0) ? 1e-4 : 1e-2;
                /* CUDA at T > the GEMV's, 128 x 128 weight blocks, N a multiple of 16 and K of
                 * 128: cuBLASLt's block-scaled e4m3 GEMM on x quantized in 128-column groups a
                 * token (W8A8 block FP8, cuda_gemm_fp8.cu; DISAGG_CUDA_FP8_GEMM=0: off)
                 * where cuBLASLt has it, else the twin: the result must match one of the two
                 * computations -- want8 emulates the quantization (scale amax / 448 of the
                 * group in f32, e4m3 of x * (1 / scale), nearest even) and leaves only the f32
                 * accumulation (1e-4) */
                int blk = lay == 2 && K % 128 == 0;
                int w8a8 = !backend_is_cpu(be) && T > gemv_t && blk &&
                           N % 16 == 0 && K % 16 == 0 &&
                           !(getenv("DISAGG_CUDA_FP8_GEMM") &&
                             !strcmp(getenv("DISAGG_CUDA_FP8_GEMM"), "0"));
                double *want8 = w8a8 ? malloc(sizeof(double) * T * N) : NULL;
                const int gw = 128; /* the activation's scale groups */
                for (int t = 0; w8a8 && t < T; t++) {
                    for (int n = 0; n < N; n++)
                        want8[t * N + n] = bias[n];
                    for (int g0 = 0; g0 < K; g0 += gw) {
                        float amax = 0.0f;
                        for (int i = g0; i < g0 + gw; i++)
                            amax = fmaxf(amax, fabsf(x[t * K + i]));
                        float xs = amax > 0.0f ? amax / 448.0f : 1.0f, inv = 1.0f / xs;
                        for (int n = 0; n < N; n++) {
                            double acc = 0;
                            for (int i = g0; i < g0 + gw; i++)
                                acc += (double)fp8_e4m3_to_f32(
                                           fp8_e4m3_from_f32(x[t * K + i] * inv)) *
                                       wf[(size_t)n * K + i];
                            want8[t * N + n] += acc * xs * sc[(n / bn) * nkb + g0 / bk];
                        }
                    }
                }
                /* the e4m3 GEMM against its emulation: 1e-3 (outputs ~1), not the f32 GEMM's
                 * 1e-4 -- Hopper's tensor cores add e4m3 products in reduced precision (about
                 * 14 bits: DeepSeek-V3's report, 3.3.2), cuBLASLt promotes to f32 at each
                 * 128-wide block.  A wrong scale layout misses it by 1e-1 (the first form,
                 * 3 December) */
                double e8 = w8a8 ? max_err(got, want8, (size_t)T * N) : 0.0;
                int took8 = w8a8 && e8 <= 1e-3;
                if (w8a8) print_message("  %s: %.3g from the W8A8 emulation\n", what, e8);
                if (!took8) check_close(what, be, got, want, (size_t)T * N, tol);
                /* the residual form (CUDA at T >= 64: cuBLASLt's epilogue onto resid, over the
                 * twin): resid + the same product */
                float *r0 = rand_vec((size_t)T * N, BACKEND_F32);
                backend_buffer *br = to_dev(st, r0, (size_t)T * N, BACKEND_F32);
                assert_int_equal(backend_matmul_residual(st, &op, DEV(br)), 0);
                float *gr = from_dev(st, DEV(br), (size_t)T * N, BACKEND_F32);
                for (int i = 0; i < T * N; i++) {
                    want[i] += r0[i];
                    if (want8) want8[i] += r0[i];
                }
                strncat(what, " (+= residual)", sizeof what - strlen(what) - 1);
                if (!(w8a8 && max_err(gr, want8, (size_t)T * N) <= 1e-3))
                    check_close(what, be, gr, want, (size_t)T * N, tol);
                if (took8) print_message("  %s: the e4m3 GEMM (W8A8)\n", what);
                free(want8);
                free(r0), free(gr);
                backend_buffer_free(br);
                /* a matmul of FP8 weights without their scales is refused */
                if (stored == BACKEND_F8E4M3) {
                    backend_matmul_op bad = op;
                    memset(&bad.w_scale, 0, sizeof bad.w_scale);
                    assert_int_equal(backend_matmul(st, &bad, 1), -EINVAL);
                }
                free(got), free(want), free(x), free(bias), free(q), free(sc), free(wf);
                backend_buffer_free(bw), backend_buffer_free(bx), backend_buffer_free(bb),
                    backend_buffer_free(by);
            }
        backend_stream_free(st);
    }
}

static void test_rope(void **state) {
    int cases[][3] = {{2, 1, 8}, {7, 7, 6}, {4, 2, 64}, {14, 2, 64}};
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be);
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            int nq = cases[c][0], nk = cases[c][1], hd = cases[c][2], half = hd / 2;
            test_batch tb;
            int start[3] = {0, 1000, 4090}, n_new[3] = {5, 1, 3};
            make_batch(&tb, 3, start, n_new, 512, 16, 100);
            assert_int_equal(backend_plan(st, &tb.b), 0);
            float inv[512];
            for (int i = 0; i < half; i++)
                inv[i] = 1.0f / powf(1000000.0f, (float)(2 * i) / (float)hd);
            float *q = rand_vec((size_t)tb.T * nq * hd, a),
                  *k = rand_vec((size_t)tb.T * nk * hd, a);
            backend_buffer *bq = to_dev(st, q, (size_t)tb.T * nq * hd, a),
                           *bk = to_dev(st, k, (size_t)tb.T * nk * hd, a),
                           *bf = to_dev(st, inv, (size_t)half, BACKEND_F32);
            assert_int_equal(backend_rope(st, DEV(bq), nq, DEV(bk), nk, a, hd, DEV(bf)), 0);
            for (int which = 0; which < 2; which++) {
                int nh = which ? nk : nq;
                const float *in = which ? k : q;
                size_t n = (size_t)tb.T * nh * hd;
                double *want = malloc(sizeof(double) * n);
                for (int t = 0; t < tb.T; t++)
                    for (int h = 0; h < nh; h++)
                        for (int i = 0; i < half; i++) {
                            double ang = (double)((float)tb.tok_pos[t] * inv[i]);
                            const float *v = in + ((size_t)t * nh + h) * hd;
                            double *o = want + ((size_t)t * nh + h) * hd;
                            o[i] = v[i] * cos(ang) - v[i + half] * sin(ang);
                            o[i + half] = v[i + half] * cos(ang) + v[i] * sin(ang);
                        }
                float *got = from_dev(st, DEV(which ? bk : bq), n, a);
                check_close(which ? "rope k" : "rope q", be, got, want, n, tol_for(be, 2e-6, 1e-2));
                free(got), free(want);
            }
            free(q), free(k);
            backend_buffer_free(bq), backend_buffer_free(bk), backend_buffer_free(bf);
        }
        backend_stream_free(st);
    }
}

/* element offset of K/V of (block, layer, which, slot, head, d) in the region's layout */
static size_t kv_index(const backend_kv *kv, int blk, int l, int which, int slot, int h, int d) {
    size_t kvd = (size_t)kv->n_kv_heads * kv->head_dim;
    size_t per_block = (size_t)kv->n_layers * 2 * kv->block_size * kvd;
    return (size_t)blk * per_block + (((size_t)l * 2 + which) * kv->block_size + slot) * kvd +
           (size_t)h * kv->head_dim + d;
}

static void test_kv_write(void **state) {
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be), kdt = backend_kv_dtype_default(be);
        backend_kv kv = {NULL, kdt, 12, 5, 3, 2, 6, 0, NULL, NULL};
        size_t n_el = backend_kv_block_bytes(&kv) / backend_dtype_size(kdt) * kv.n_blocks;
        assert_int_equal(backend_kv_block_bytes(&kv),
                         (size_t)3 * 2 * 5 * 2 * 6 * backend_dtype_size(kdt));
        backend_buffer *region =
            backend_buffer_alloc(be, n_el * backend_dtype_size(kdt), BACKEND_BUF_KV);
        assert_non_null(region);
        kv.base = DEV(region);
        test_batch tb;
        int start[3] = {0, 7, 3}, n_new[3] = {9, 1, 2};
        make_batch(&tb, 3, start, n_new, kv.block_size, kv.n_blocks, 10);
        assert_int_equal(backend_plan(st, &tb.b), 0);
        int kvd = kv.n_kv_heads * kv.head_dim, layer = 1;
        float *k = rand_vec((size_t)tb.T * kvd, a), *v = rand_vec((size_t)tb.T * kvd, a);
        round_to(k, (size_t)tb.T * kvd, kdt), round_to(v, (size_t)tb.T * kvd, kdt);
        backend_buffer *bk = to_dev(st, k, (size_t)tb.T * kvd, a),
                       *bv = to_dev(st, v, (size_t)tb.T * kvd, a);
        assert_int_equal(backend_kv_write(st, &kv, layer, DEV(bk), DEV(bv), a), 0);
        float *got = from_dev(st, kv.base, n_el, kdt);
        double *want = calloc(n_el, sizeof(double));
        for (int t = 0; t < tb.T; t++) {
            int s = tb.tok_seq[t], p = tb.tok_pos[t];
            int blk = tb.bt[tb.bt_ptr[s] + p / kv.block_size], slot = p % kv.block_size;
            for (int h = 0; h < kv.n_kv_heads; h++)
                for (int d = 0; d < kv.head_dim; d++) {
                    want[kv_index(&kv, blk, layer, 0, slot, h, d)] =
                        k[t * kvd + h * kv.head_dim + d];
                    want[kv_index(&kv, blk, layer, 1, slot, h, d)] =
                        v[t * kvd + h * kv.head_dim + d];
                }
        }
        check_close("kv_write (every other slot stays zero)", be, got, want, n_el, 0);
        free(got), free(want), free(k), free(v);
        backend_buffer_free(bk), backend_buffer_free(bv), backend_buffer_free(region);
        backend_stream_free(st);
    }
}

static int g_window; /* attention_case's sliding window (0: none) */

/* attention of a batch (start, n_new per sequence) with GQA group `group` */
static void attention_case(backend *be, int S, const int *start, const int *n_new, int n_kv_heads,
                           int group, int hd, int bs) {
    backend_stream *st = backend_stream_create(be);
    backend_dtype a = backend_act_dtype(be), kdt = backend_kv_dtype_default(be);
    int total_blocks = 0;
    for (int s = 0; s < S; s++)
        total_blocks += (start[s] + n_new[s] + bs - 1) / bs;
    backend_kv kv = {NULL, kdt, total_blocks + 3, bs, 2, n_kv_heads, hd, g_window, NULL, NULL};
    size_t n_el = backend_kv_block_bytes(&kv) / backend_dtype_size(kdt) * kv.n_blocks;
    test_batch tb;
    make_batch(&tb, S, start, n_new, bs, kv.n_blocks, 10);
    /* every position's K/V (history and this call's), written through the layout */
    int layer = 1, nh = n_kv_heads * group, kvd = n_kv_heads * hd;
    float *region = rand_vec(n_el, kdt);
    backend_buffer *breg = to_dev(st, region, n_el, kdt);
    kv.base = DEV(breg);
    float *q = rand_vec((size_t)tb.T * nh * hd, a);
    for (size_t i = 0; i < (size_t)tb.T * nh * hd; i++)
        q[i] *= 3.0f; /* peakier softmax */
    round_to(q, (size_t)tb.T * nh * hd, a);
    backend_buffer *bq = to_dev(st, q, (size_t)tb.T * nh * hd, a),
                   *bo = backend_buffer_alloc(be, (size_t)tb.T * nh * hd * 4, 0);
    assert_int_equal(backend_plan(st, &tb.b), 0);
    const float scale = (float)(1.0 / sqrt((double)hd));
    if (g_window && !backend_attention_window(be)) { /* refused, not ignored */
        assert_int_equal(backend_attention(st, DEV(bo), DEV(bq), a, &kv, layer, nh, scale),
                         -ENOTSUP);
        free(q), free(region);
        backend_buffer_free(bq), backend_buffer_free(bo), backend_buffer_free(breg);
        backend_stream_free(st);
        return;
    }
    assert_int_equal(backend_attention(st, DEV(bo), DEV(bq), a, &kv, layer, nh, scale), 0);
    double *want = calloc((size_t)tb.T * nh * hd, sizeof(double));
    double *sc = malloc(sizeof(double) * 8192);
    for (int t = 0; t < tb.T; t++) {
        int s = tb.tok_seq[t], p = tb.tok_pos[t];
        /* keys lo..p: p - window + 1.. with a window (the others contribute nothing) */
        int lo = g_window && p + 1 > g_window ? p + 1 - g_window : 0;
        for (int h = 0; h < nh; h++) {
            int kh = h / group;
            const float *qq = q + ((size_t)t * nh + h) * hd;
            double mx = -INFINITY, sum = 0;
            for (int j = 0; j < lo; j++)
                sc[j] = -INFINITY;
            for (int j = lo; j <= p; j++) {
                int blk = tb.bt[tb.bt_ptr[s] + j / bs];
                double d = 0;
                for (int i = 0; i < hd; i++)
                    d += (double)qq[i] * region[kv_index(&kv, blk, layer, 0, j % bs, kh, i)];
                sc[j] = d * scale;
                if (sc[j] > mx) mx = sc[j];
            }
            for (int j = 0; j <= p; j++)
                sum += (sc[j] = exp(sc[j] - mx));
            double *o = want + ((size_t)t * nh + h) * hd;
            for (int j = 0; j <= p; j++) {
                int blk = tb.bt[tb.bt_ptr[s] + j / bs];
                for (int i = 0; i < hd; i++)
                    o[i] += sc[j] / sum * region[kv_index(&kv, blk, layer, 1, j % bs, kh, i)];
            }
        }
    }
    float *got = from_dev(st, DEV(bo), (size_t)tb.T * nh * hd, a);
    char what[128];
    snprintf(what, sizeof what,
             "attention (%d seqs, %d kv heads x group %d, hd %d, bs %d, window %d)", S, n_kv_heads,
             group, hd, bs, g_window);
    (void)kvd;
    /* a GPU backend's prefill kernel rounds q and the softmax weights to bf16 for the tensor
     * cores when the KV cache is bf16: the bf16 tolerance applies there */
    double tol = backend_is_cpu(be) || kdt != BACKEND_BF16 ? tol_for(be, 2e-6, 2e-2) : 2e-2;
    if (g_window && !backend_is_cpu(be)) tol = 1e-5; /* cuda_window.cu: f32 throughout */
    check_close(what, be, got, want, (size_t)tb.T * nh * hd, tol);
    free(got), free(want), free(sc), free(q), free(region);
    backend_buffer_free(bq), backend_buffer_free(bo), backend_buffer_free(breg);
    backend_stream_free(st);
}

/* The CPU backend: a token's attention output is the same, bit for bit, whether it comes
 * alone (a decode step: its keys split in chunks over the threads) or as the last of a batch
 * of n_new > 8 tokens (one task per token and KV head, its chunks in turn) -- across several
 * key chunks of 256 positions, and with a block size (24) that does not divide them. */
static void attention_alone_case(backend *be, int start, int n_new, int n_kv_heads, int group,
                                 int hd, int bs, backend_dtype kdt) {
    backend_stream *st = backend_stream_create(be);
    int nb = (start + n_new + bs - 1) / bs;
    backend_kv kv = {NULL, kdt, nb + 3, bs, 2, n_kv_heads, hd, g_window, NULL, NULL};
    size_t n_el = backend_kv_block_bytes(&kv) / backend_dtype_size(kdt) * kv.n_blocks;
    test_batch tb;
    make_batch(&tb, 1, &start, &n_new, bs, kv.n_blocks, 10);
    int layer = 1, nh = n_kv_heads * group, T = tb.T;
    float *region = rand_vec(n_el, kdt);
    backend_buffer *breg = to_dev(st, region, n_el, kdt);
    kv.base = DEV(breg);
    float *q = rand_vec((size_t)T * nh * hd, BACKEND_F32);
    for (size_t i = 0; i < (size_t)T * nh * hd; i++)
        q[i] *= 3.0f;
    backend_buffer *bq = to_dev(st, q, (size_t)T * nh * hd, BACKEND_F32),
                   *bo = backend_buffer_alloc(be, (size_t)T * nh * hd * 4, 0),
                   *bo1 = backend_buffer_alloc(be, (size_t)nh * hd * 4, 0);
    const float scale = (float)(1.0 / sqrt((double)hd));
    assert_int_equal(backend_plan(st, &tb.b), 0);
    assert_int_equal(backend_attention(st, DEV(bo), DEV(bq), BACKEND_F32, &kv, layer, nh, scale),
                     0);
    int32_t qo1[2] = {0, 1};
    backend_batch one = tb.b;
    one.n_tokens = 1;
    one.tokens = tb.tokens + T - 1, one.tok_seq = tb.tok_seq + T - 1;
    one.tok_pos = tb.tok_pos + T - 1, one.qo_indptr = qo1;
    assert_int_equal(backend_plan(st, &one), 0);
    assert_int_equal(backend_attention(st, DEV(bo1),
                                       (const float *)DEV(bq) + (size_t)(T - 1) * nh * hd,
                                       BACKEND_F32, &kv, layer, nh, scale),
                     0);
    float *all = from_dev(st, DEV(bo), (size_t)T * nh * hd, BACKEND_F32),
          *alone = from_dev(st, DEV(bo1), (size_t)nh * hd, BACKEND_F32);
    int diff = 0;
    for (int i = 0; i < nh * hd; i++)
        diff += memcmp(&all[(size_t)(T - 1) * nh * hd + i], &alone[i], sizeof(float)) != 0;
    if (diff)
        fail_msg("attention at position %d (bs %d, %s KV): %d of %d outputs differ between the "
                 "token alone and the token in a batch of %d",
                 start + n_new - 1, bs, kdt == BACKEND_BF16 ? "bf16" : "f32", diff, nh * hd, T);
    free(all), free(alone), free(q), free(region);
    backend_buffer_free(bq), backend_buffer_free(bo), backend_buffer_free(bo1);
    backend_buffer_free(breg);
    backend_stream_free(st);
}

/* The CPU backend: the same keys and values give the same attention output, bit for bit,
 * whatever the block size (the CPU default 128 is cut into 64-position pieces per kernel
 * call; 16 was the default before; 24 and 5 do not divide the 256-position chunks) -- for a
 * decode token alone and for the tokens of a prefill chunk. */
static float *block_size_run(backend *be, int start, int n_new, int n_kv_heads, int group, int hd,
                             int bs, backend_dtype kdt, const float *kk, const float *vv,
                             const float *q) {
    backend_stream *st = backend_stream_create(be);
    int np = start + n_new, nb = (np + bs - 1) / bs, layer = 1, nh = n_kv_heads * group;
    backend_kv kv = {NULL, kdt, nb + 3, bs, 2, n_kv_heads, hd, 0, NULL, NULL};
    size_t n_el = backend_kv_block_bytes(&kv) / backend_dtype_size(kdt) * kv.n_blocks;
    test_batch tb;
    make_batch(&tb, 1, &start, &n_new, bs, kv.n_blocks, 10);
    float *region = calloc(n_el, sizeof(float));
    for (int j = 0; j < np; j++) /* position j of the sequence, through its block table */
        for (int h = 0; h < n_kv_heads; h++)
            for (int d = 0; d < hd; d++) {
                size_t e = ((size_t)j * n_kv_heads + h) * hd + d;
                region[kv_index(&kv, tb.bt[j / bs], layer, 0, j % bs, h, d)] = kk[e];
                region[kv_index(&kv, tb.bt[j / bs], layer, 1, j % bs, h, d)] = vv[e];
            }
    backend_buffer *breg = to_dev(st, region, n_el, kdt);
    kv.base = DEV(breg);
    size_t nq = (size_t)n_new * nh * hd;
    backend_buffer *bq = to_dev(st, q, nq, BACKEND_F32), *bo = backend_buffer_alloc(be, nq * 4, 0);
    assert_int_equal(backend_plan(st, &tb.b), 0);
    assert_int_equal(backend_attention(st, DEV(bo), DEV(bq), BACKEND_F32, &kv, layer, nh,
                                       (float)(1.0 / sqrt((double)hd))),
                     0);
    float *out = from_dev(st, DEV(bo), nq, BACKEND_F32);
    free(region);
    backend_buffer_free(bq), backend_buffer_free(bo), backend_buffer_free(breg);
    backend_stream_free(st);
    return out;
}

static void test_attention_block_sizes(void **state) {
    const int bss[] = {128, 16, 24, 5, 64};
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        if (!backend_is_cpu(be)) continue; /* the CUDA kernels: test_cuda_invariant */
        for (int kd = 0; kd < 2; kd++)
            for (int c = 0; c < 2; c++) {
                backend_dtype kdt = kd ? BACKEND_BF16 : BACKEND_F32;
                int nkv = 2, group = 7, hd = 64, n_new = c ? 12 : 1, start = c ? 700 : 1000;
                int np = start + n_new, nh = nkv * group;
                size_t nkvel = (size_t)np * nkv * hd, nq = (size_t)n_new * nh * hd;
                float *kk = rand_vec(nkvel, kdt), *vv = rand_vec(nkvel, kdt);
                float *q = rand_vec(nq, BACKEND_F32);
                for (size_t i = 0; i < nq; i++)
                    q[i] *= 3.0f;
                float *ref =
                    block_size_run(be, start, n_new, nkv, group, hd, bss[0], kdt, kk, vv, q);
                for (int b = 1; b < (int)(sizeof bss / sizeof bss[0]); b++) {
                    float *got =
                        block_size_run(be, start, n_new, nkv, group, hd, bss[b], kdt, kk, vv, q);
                    int diff = 0;
                    for (size_t i = 0; i < nq; i++)
                        diff += memcmp(&got[i], &ref[i], sizeof(float)) != 0;
                    if (diff)
                        fail_msg("attention of %d token(s) after %d (%s KV): %d of %zu outputs "
                                 "differ between block sizes %d and %d",
                                 n_new, start, kd ? "bf16" : "f32", diff, nq, bss[0], bss[b]);
                    free(got);
                }
                free(ref), free(kk), free(vv), free(q);
            }
    }
}

static void test_attention_alone_vs_batch(void **state) {
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        if (!backend_is_cpu(be)) continue; /* the CUDA kernels: test_cuda_invariant */
        for (int kd = 0; kd < 2; kd++) {
            backend_dtype kdt = kd ? BACKEND_BF16 : BACKEND_F32;
            attention_alone_case(be, 1000, 12, 2, 7, 64, 16, kdt); /* 4 chunks, Qwen2.5-0.5B */
            attention_alone_case(be, 600, 20, 2, 3, 32, 24, kdt);  /* blocks across chunks */
            attention_alone_case(be, 240, 17, 1, 2, 12, 5, kdt);   /* hd 12: the tails */
        }
    }
}

/* Mistral's sliding window: a query at p attends to keys p - W + 1..p.  The CPU against the
 * reference (windows shorter than, across and longer than its 256-key chunks; decode, chunk
 * and prefill; the chunk split of few tokens and the per-token split of many), and a token's
 * output the same bits alone and in a batch; CUDA (kernels/cuda/cuda_window.cu) against the
 * same reference; a backend without windows refuses (-ENOTSUP). */
static void test_attention_window(void **state) {
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        g_window = 8;
        int s1[1] = {0}, n1[1] = {37}; /* prefill longer than the window */
        attention_case(be, 1, s1, n1, 2, 3, 16, 16);
        int s2[3] = {40, 0, 300}, n2[3] = {3, 21, 1}; /* chunk, prefill, decode */
        attention_case(be, 3, s2, n2, 2, 2, 32, 5);
        g_window = 300; /* a window across the chunks of 256 */
        int s3[2] = {1000, 250}, n3[2] = {1, 12};
        attention_case(be, 2, s3, n3, 2, 7, 64, 24);
        int s4[1] = {700}, n4[1] = {20}; /* many tokens: one task per token and KV head */
        attention_case(be, 1, s4, n4, 2, 2, 32, 16);
        g_window = 5000; /* longer than every context: as no window */
        int s5[1] = {100}, n5[1] = {2};
        attention_case(be, 1, s5, n5, 1, 4, 16, 16);
        if (backend_is_cpu(be))
            for (int w = 0; w < 2; w++) {
                g_window = w ? 300 : 7;
                backend_dtype kdt = w ? BACKEND_BF16 : BACKEND_F32;
                attention_alone_case(be, 1000, 12, 2, 7, 64, 16, kdt);
                attention_alone_case(be, 600, 20, 2, 3, 32, 24, kdt);
            }
        g_window = 0;
    }
}

static void test_attention(void **state) {
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        int s0[1] = {0}, n0[1] = {1}; /* one token, nothing cached */
        attention_case(be, 1, s0, n0, 1, 1, 8, 16);
        int s1[1] = {0}, n1[1] = {37}; /* prefill over partial blocks */
        attention_case(be, 1, s1, n1, 2, 7, 64, 16);
        int s2[4] = {5, 100, 16, 1}, n2[4] = {1, 1, 1, 1}; /* decode batch */
        attention_case(be, 4, s2, n2, 2, 2, 32, 16);
        int s3[3] = {40, 0, 9}, n3[3] = {3, 21, 1}; /* mixed: chunk, prefill, decode */
        attention_case(be, 3, s3, n3, 3, 4, 12, 5);
        int s4[2] = {300, 0}, n4[2] = {2, 5}; /* long context, block size 1 */
        attention_case(be, 2, s4, n4, 1, 3, 6, 1);
        int s5[3] = {0, 200, 7}, n5[3] = {150, 70, 1}; /* long prefill, chunk, decode: hd 128 */
        attention_case(be, 3, s5, n5, 4, 7, 128, 16);
        /* the CUDA prefill kernel's 128-row tiles: three tiles, the last partial (333 = 2 x 128
         * + 77), and a chunk whose first query sits mid-block (77 % 16) with a partial tile
         * over the diagonal; GQA 7 as Qwen2.5-7B, hd 128 */
        int s6[2] = {0, 77}, n6[2] = {333, 170};
        attention_case(be, 2, s6, n6, 2, 7, 128, 16);
        /* hd 64, GQA 2, block size 32: a chunk after 130 cached tokens (tiles of 128 + 2) */
        int s7[1] = {130}, n7[1] = {130};
        attention_case(be, 1, s7, n7, 4, 2, 64, 32);
        /* hd 32, one KV head for 4 query heads, tiles of 128 + 12 from position 5 */
        int s8[2] = {5, 3}, n8[2] = {140, 1};
        attention_case(be, 2, s8, n8, 1, 4, 32, 16);
        /* decode after 1000 and 700 tokens (the CPU splits their keys in chunks of 256), and
         * a block size (24) that does not divide the chunks */
        int s9[2] = {1000, 700}, n9[2] = {1, 1};
        attention_case(be, 2, s9, n9, 2, 7, 64, 24);
    }
}

/* The fused operations (backend_add_rmsnorm, backend_qkv, backend_gate_up) against a double
 * reference on bf16-exact inputs: the CPU runs their generic forms (the plain ops), CUDA its
 * own kernels over q|k|v and gate|up concatenated by backend_weights_load_cat. */
static void bf16_mat(uint16_t *h, float *f, size_t n) {
    for (size_t i = 0; i < n; i++) {
        f[i] = bf16_to_f32(f32_to_bf16(frand()));
        h[i] = f32_to_bf16(f[i]);
    }
}

static void test_fused_ops(void **state) {
    enum { H = 64, NH = 4, NKV = 2, HD = 16, KVD = NKV * HD, I = 96, L = 2, LAYER = 1 };
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be), mm = backend_mm_dtype(be),
                      kdt = backend_kv_dtype_default(be);
        int cat = backend_wants_cat(be);
        test_batch tb;
        int start[2] = {0, 5}, n_new[2] = {7, 1};
        make_batch(&tb, 2, start, n_new, 4, 8, 10);
        assert_int_equal(backend_plan(st, &tb.b), 0);
        int T = tb.T;
        /* weights (bf16 on the host, kept alive: the CPU backend aliases them) */
        static uint16_t hq[H * H], hk[KVD * H], hv[KVD * H], hg[I * H], hu[I * H];
        static float fq[H * H], fk[KVD * H], fv[KVD * H], fg[I * H], fu[I * H];
        bf16_mat(hq, fq, H * H), bf16_mat(hk, fk, KVD * H), bf16_mat(hv, fv, KVD * H);
        bf16_mat(hg, fg, I * H), bf16_mat(hu, fu, I * H);
        float bias[H + 2 * KVD], inv[HD / 2], nw[H];
        for (int i = 0; i < H + 2 * KVD; i++)
            bias[i] = frand();
        for (int i = 0; i < HD / 2; i++)
            inv[i] = 1.0f / powf(10000.0f, (float)(2 * i) / HD);
        for (int i = 0; i < H; i++)
            nw[i] = 1.0f + 0.1f * frand();
        backend_dtype sq = BACKEND_BF16, sk, sv, sg, su, scat;
        backend_buffer *bq = NULL, *bk = NULL, *bv = NULL, *bg = NULL, *bu = NULL, *bqkv = NULL,
                       *bgu = NULL;
        const void *wq, *wk, *wv, *wg, *wu, *wqkv = NULL, *wgu = NULL;
        if (cat) {
            const void *s3[3] = {hq, hk, hv}, *s2[2] = {hg, hu};
            backend_dtype d3[3] = {BACKEND_BF16, BACKEND_BF16, BACKEND_BF16};
            size_t n3[3] = {H * H, KVD * H, KVD * H}, n2[2] = {I * H, I * H};
            assert_non_null(bqkv = backend_weights_load_cat(be, s3, d3, n3, 3, &scat));
            assert_non_null(bgu = backend_weights_load_cat(be, s2, d3, n2, 2, &scat));
            size_t es = backend_dtype_size(scat);
            wqkv = DEV(bqkv), wgu = DEV(bgu);
            wq = wqkv, wk = (const char *)wqkv + (size_t)H * H * es;
            wv = (const char *)wk + (size_t)KVD * H * es;
            wg = wgu, wu = (const char *)wgu + (size_t)I * H * es;
            sq = sk = sv = sg = su = scat;
        } else {
            assert_null(backend_weights_load_cat(be, (const void *const[]){hq}, &sq,
                                                 (const size_t[]){1}, 1, &scat));
            assert_non_null(bq = backend_weights_load(be, hq, BACKEND_BF16, H * H, &sq));
            assert_non_null(bk = backend_weights_load(be, hk, BACKEND_BF16, KVD * H, &sk));
            assert_non_null(bv = backend_weights_load(be, hv, BACKEND_BF16, KVD * H, &sv));
            assert_non_null(bg = backend_weights_load(be, hg, BACKEND_BF16, I * H, &sg));
            assert_non_null(bu = backend_weights_load(be, hu, BACKEND_BF16, I * H, &su));
            wq = DEV(bq), wk = DEV(bk), wv = DEV(bv), wg = DEV(bg), wu = DEV(bu);
        }
        backend_buffer *bbias = to_dev(st, bias, H + 2 * KVD, BACKEND_F32),
                       *binv = to_dev(st, inv, HD / 2, BACKEND_F32),
                       *bnw = to_dev(st, nw, H, BACKEND_F32);
        const float *dbias = DEV(bbias);
        /* x (residual, act) and y (added into it); xb = norm(x + y) in mm */
        float *x = rand_vec((size_t)T * H, BACKEND_BF16),
              *y = rand_vec((size_t)T * H, BACKEND_BF16);
        backend_buffer *bx = to_dev(st, x, (size_t)T * H, a), *by = to_dev(st, y, (size_t)T * H, a),
                       *bxb = backend_buffer_alloc(be, (size_t)T * H * backend_dtype_size(mm), 0);
        assert_int_equal(
            backend_add_rmsnorm(st, DEV(bxb), mm, DEV(bx), DEV(by), a, DEV(bnw), T, H, 1e-6f), 0);
        float *gx = from_dev(st, DEV(bx), (size_t)T * H, a),
              *gxb = from_dev(st, DEV(bxb), (size_t)T * H, mm);
        double *wx = malloc(sizeof(double) * T * H), *wxb = malloc(sizeof(double) * T * H);
        float *xb = malloc(sizeof(float) * T * H); /* the normed rows as the device has them */
        for (int t = 0; t < T; t++) {
            double ss = 0;
            for (int i = 0; i < H; i++) {
                wx[t * H + i] = (double)x[t * H + i] + y[t * H + i];
                ss += wx[t * H + i] * wx[t * H + i];
            }
            double r = 1.0 / sqrt(ss / H + 1e-6);
            for (int i = 0; i < H; i++)
                wxb[t * H + i] = nw[i] * wx[t * H + i] * r;
        }
        memcpy(xb, gxb, sizeof(float) * T * H);
        check_close("add_rmsnorm: x += add", be, gx, wx, (size_t)T * H, 1e-6);
        check_close("add_rmsnorm: out", be, gxb, wxb, (size_t)T * H,
                    mm == BACKEND_F32 ? 1e-5 : 8e-3);
        /* qkv */
        backend_kv kv = {NULL, kdt, tb.n_blocks, tb.bs, L, NKV, HD, 0, NULL, NULL};
        size_t n_el = backend_kv_block_bytes(&kv) / backend_dtype_size(kdt) * kv.n_blocks;
        backend_buffer *region =
            backend_buffer_alloc(be, n_el * backend_dtype_size(kdt), BACKEND_BUF_KV);
        kv.base = DEV(region);
        backend_buffer *bqo = backend_buffer_alloc(be, (size_t)T * H * backend_dtype_size(a), 0),
                       *bks = backend_buffer_alloc(be, (size_t)T * KVD * backend_dtype_size(a), 0),
                       *bvs = backend_buffer_alloc(be, (size_t)T * KVD * backend_dtype_size(a), 0);
        backend_qkv_op op = {.x = DEV(bxb),
                             .x_dt = mm,
                             .T = T,
                             .hidden = H,
                             .n_heads = NH,
                             .wq = wq,
                             .wk = wk,
                             .wv = wv,
                             .w_dt = sq,
                             .bq = dbias,
                             .bk = dbias + H,
                             .bv = dbias + H + KVD,
                             .wqkv = wqkv,
                             .bqkv = wqkv ? dbias : NULL,
                             .q = DEV(bqo),
                             .k = DEV(bks),
                             .v = DEV(bvs),
                             .dt = a,
                             .inv_freq = DEV(binv),
                             .kv = &kv,
                             .layer = LAYER};
        assert_int_equal(backend_qkv(st, &op), 0);
        float *gq = from_dev(st, DEV(bqo), (size_t)T * H, a),
              *gkv = from_dev(st, kv.base, n_el, kdt);
        double *wq_ = calloc((size_t)T * H, sizeof(double)), *wkv = calloc(n_el, sizeof(double));
        for (int t = 0; t < T; t++) {
            double row[H + 2 * KVD];
            for (int n = 0; n < H + 2 * KVD; n++) {
                const float *w = n < H         ? fq + n * H
                                 : n < H + KVD ? fk + (n - H) * H
                                               : fv + (n - H - KVD) * H;
                double acc = bias[n];
                for (int i = 0; i < H; i++)
                    acc += (double)xb[t * H + i] * w[i];
                row[n] = acc;
            }
            int p = tb.tok_pos[t];
            for (int hh = 0; hh < NH + NKV; hh++) /* rope on q heads then k heads */
                for (int i = 0; i < HD / 2; i++) {
                    float ang = (float)p * inv[i];
                    double c = cos(ang), sn = sin(ang), u = row[hh * HD + i],
                           w = row[hh * HD + i + HD / 2];
                    row[hh * HD + i] = u * c - w * sn;
                    row[hh * HD + i + HD / 2] = w * c + u * sn;
                }
            for (int n = 0; n < H; n++)
                wq_[t * H + n] = row[n];
            int s = tb.tok_seq[t], blk = tb.bt[tb.bt_ptr[s] + p / kv.block_size],
                slot = p % kv.block_size;
            for (int hh = 0; hh < NKV; hh++)
                for (int d = 0; d < HD; d++) {
                    wkv[kv_index(&kv, blk, LAYER, 0, slot, hh, d)] = row[H + hh * HD + d];
                    wkv[kv_index(&kv, blk, LAYER, 1, slot, hh, d)] = row[H + KVD + hh * HD + d];
                }
        }
        check_close("qkv: q (bias, RoPE)", be, gq, wq_, (size_t)T * H, 1e-4);
        check_close("qkv: K/V in the cache (every other slot zero)", be, gkv, wkv, n_el,
                    kdt == BACKEND_F32 ? 1e-4 : 8e-3);
        /* qkv with Qwen3's per-head q/k RMSNorm before RoPE, no biases (the CPU: the generic
         * form; CUDA: the q|k|v GEMM and kernels/cuda/cuda_qknorm.cu) */
        float qn[HD], kn[HD];
        for (int i = 0; i < HD; i++)
            qn[i] = 1.0f + 0.3f * frand(), kn[i] = 1.0f + 0.3f * frand();
        backend_buffer *bqn = to_dev(st, qn, HD, BACKEND_F32),
                       *bkn = to_dev(st, kn, HD, BACKEND_F32);
        backend_qkv_op opn = op;
        opn.bq = opn.bk = opn.bv = opn.bqkv = NULL;
        opn.q_norm = DEV(bqn), opn.k_norm = DEV(bkn), opn.qk_eps = 1e-6f;
        assert_int_equal(backend_qkv(st, &opn), 0);
        float *gqn = from_dev(st, DEV(bqo), (size_t)T * H, a),
              *gkvn = from_dev(st, kv.base, n_el, kdt);
        for (int t = 0; t < T; t++) {
            double row[H + 2 * KVD];
            for (int n = 0; n < H + 2 * KVD; n++) {
                const float *w = n < H         ? fq + n * H
                                 : n < H + KVD ? fk + (n - H) * H
                                               : fv + (n - H - KVD) * H;
                double acc = 0;
                for (int i = 0; i < H; i++)
                    acc += (double)xb[t * H + i] * w[i];
                row[n] = acc;
            }
            for (int hh = 0; hh < NH + NKV; hh++) { /* the per-head norm, then rope */
                double ss = 0, *v = row + hh * HD;
                for (int i = 0; i < HD; i++)
                    ss += v[i] * v[i];
                double r = 1.0 / sqrt(ss / HD + 1e-6);
                for (int i = 0; i < HD; i++)
                    v[i] = (hh < NH ? qn[i] : kn[i]) * v[i] * r;
            }
            int p = tb.tok_pos[t];
            for (int hh = 0; hh < NH + NKV; hh++)
                for (int i = 0; i < HD / 2; i++) {
                    float ang = (float)p * inv[i];
                    double c = cos(ang), sn = sin(ang), u = row[hh * HD + i],
                           w = row[hh * HD + i + HD / 2];
                    row[hh * HD + i] = u * c - w * sn;
                    row[hh * HD + i + HD / 2] = w * c + u * sn;
                }
            for (int n = 0; n < H; n++)
                wq_[t * H + n] = row[n];
            int s = tb.tok_seq[t], blk = tb.bt[tb.bt_ptr[s] + p / kv.block_size],
                slot = p % kv.block_size;
            for (int hh = 0; hh < NKV; hh++)
                for (int d = 0; d < HD; d++) {
                    wkv[kv_index(&kv, blk, LAYER, 0, slot, hh, d)] = row[H + hh * HD + d];
                    wkv[kv_index(&kv, blk, LAYER, 1, slot, hh, d)] = row[H + KVD + hh * HD + d];
                }
        }
        /* bf16 activations: the normed q/k round once more than the plain path */
        check_close("qkv + q/k norm: q", be, gqn, wq_, (size_t)T * H,
                    a == BACKEND_F32 ? 1e-4 : 2e-2);
        check_close("qkv + q/k norm: K/V in the cache", be, gkvn, wkv, n_el,
                    kdt == BACKEND_F32 && a == BACKEND_F32 ? 1e-4 : 2e-2);
        free(gqn), free(gkvn);
        backend_buffer_free(bqn), backend_buffer_free(bkn);
        /* gate_up */
        backend_buffer *bh = backend_buffer_alloc(be, (size_t)T * I * backend_dtype_size(mm), 0),
                       *bh2 = cat ? NULL
                                  : backend_buffer_alloc(be, (size_t)T * I * backend_dtype_size(mm),
                                                         0);
        backend_mlp_op mo = {.x = DEV(bxb),
                             .x_dt = mm,
                             .T = T,
                             .hidden = H,
                             .inter = I,
                             .w_gate = wg,
                             .w_up = wu,
                             .w_dt = sg,
                             .w_gate_up = wgu,
                             .h = DEV(bh),
                             .h2 = bh2 ? DEV(bh2) : NULL,
                             .h_dt = mm};
        assert_int_equal(backend_gate_up(st, &mo), 0);
        float *gh = from_dev(st, DEV(bh), (size_t)T * I, mm);
        double *wh = malloc(sizeof(double) * T * I);
        for (int t = 0; t < T; t++)
            for (int n = 0; n < I; n++) {
                double gg = 0, uu = 0;
                for (int i = 0; i < H; i++) {
                    gg += (double)xb[t * H + i] * fg[n * H + i];
                    uu += (double)xb[t * H + i] * fu[n * H + i];
                }
                wh[t * I + n] = gg / (1.0 + exp(-gg)) * uu;
            }
        check_close("gate_up: silu(gate) * up", be, gh, wh, (size_t)T * I,
                    mm == BACKEND_F32 ? 1e-4 : 8e-3);
        (void)su, (void)sk, (void)sv;
        free(gx), free(gxb), free(wx), free(wxb), free(xb), free(x), free(y), free(gq), free(gkv);
        free(wq_), free(wkv), free(gh), free(wh);
        backend_buffer *bufs[] = {bq, bk, bv,  bg,     bu,  bqkv, bgu, bbias, binv, bnw,
                                  bx, by, bxb, region, bqo, bks,  bvs, bh,    bh2};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            backend_buffer_free(bufs[i]);
        backend_stream_free(st);
    }
}

/* backend_gate_up on a prefill-sized batch (T = 130: the CUDA backend's gate|up GEMM then
 * writes bf16 and SwiGLU reads that, see cb_gate_up; under 64 tokens it stays f32, which
 * test_fused_ops covers).  Tolerance: a GPU backend rounds gate and up to bf16 before
 * silu(gate) * up (as a bf16 model run by transformers does) and h to bf16 after, three
 * roundings of 2^-8: 2e-2; the CPU as in test_fused_ops. */
static void test_gate_up_prefill(void **state) {
    enum { H = 72, I = 200, T = 130 };
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype mm = backend_mm_dtype(be);
        int cat = backend_wants_cat(be);
        test_batch tb;
        int start[1] = {0}, n_new[1] = {T};
        make_batch(&tb, 1, start, n_new, 16, 16, 10);
        assert_int_equal(backend_plan(st, &tb.b), 0);
        uint16_t *hg = malloc(sizeof(uint16_t) * I * H), *hu = malloc(sizeof(uint16_t) * I * H);
        float *fg = malloc(sizeof(float) * I * H), *fu = malloc(sizeof(float) * I * H);
        assert_non_null(hg), assert_non_null(hu), assert_non_null(fg), assert_non_null(fu);
        bf16_mat(hg, fg, (size_t)I * H), bf16_mat(hu, fu, (size_t)I * H);
        backend_dtype sg = BACKEND_BF16, scat, d2[2] = {BACKEND_BF16, BACKEND_BF16};
        backend_buffer *bg = NULL, *bu = NULL, *bgu = NULL;
        const void *wg, *wu, *wgu = NULL;
        if (cat) {
            const void *s2[2] = {hg, hu};
            size_t n2[2] = {(size_t)I * H, (size_t)I * H};
            assert_non_null(bgu = backend_weights_load_cat(be, s2, d2, n2, 2, &scat));
            wgu = DEV(bgu);
            wg = wgu, wu = (const char *)wgu + (size_t)I * H * backend_dtype_size(scat);
            sg = scat;
        } else {
            assert_non_null(bg = backend_weights_load(be, hg, BACKEND_BF16, (size_t)I * H, &sg));
            assert_non_null(bu = backend_weights_load(be, hu, BACKEND_BF16, (size_t)I * H, &sg));
            wg = DEV(bg), wu = DEV(bu);
        }
        float *x = rand_vec((size_t)T * H, mm);
        backend_buffer *bx = to_dev(st, x, (size_t)T * H, mm),
                       *bh = backend_buffer_alloc(be, (size_t)T * I * backend_dtype_size(mm), 0),
                       *bh2 = cat ? NULL
                                  : backend_buffer_alloc(be, (size_t)T * I * backend_dtype_size(mm),
                                                         0);
        backend_mlp_op mo = {.x = DEV(bx),
                             .x_dt = mm,
                             .T = T,
                             .hidden = H,
                             .inter = I,
                             .w_gate = wg,
                             .w_up = wu,
                             .w_dt = sg,
                             .w_gate_up = wgu,
                             .h = DEV(bh),
                             .h2 = bh2 ? DEV(bh2) : NULL,
                             .h_dt = mm};
        assert_int_equal(backend_gate_up(st, &mo), 0);
        float *gh = from_dev(st, DEV(bh), (size_t)T * I, mm);
        double *wh = malloc(sizeof(double) * T * I);
        assert_non_null(wh);
        for (int t = 0; t < T; t++)
            for (int n = 0; n < I; n++) {
                double gg = 0, uu = 0;
                for (int i = 0; i < H; i++) {
                    gg += (double)x[t * H + i] * fg[n * H + i];
                    uu += (double)x[t * H + i] * fu[n * H + i];
                }
                wh[t * I + n] = gg / (1.0 + exp(-gg)) * uu;
            }
        double tol = backend_is_cpu(be) ? (mm == BACKEND_F32 ? 1e-4 : 8e-3) : 2e-2;
        check_close("gate_up (130 tokens): silu(gate) * up", be, gh, wh, (size_t)T * I, tol);
        free(gh), free(wh), free(x), free(hg), free(hu), free(fg), free(fu);
        backend_buffer *bufs[] = {bg, bu, bgu, bx, bh, bh2};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            backend_buffer_free(bufs[i]);
        backend_stream_free(st);
    }
}

/* backend_gate_up at the decode sizes (1 and 2 tokens) with the gate|up matrix as one
 * (backend_wants_cat): the CUDA backend runs it as one GEMV with the SwiGLU in its epilogue
 * (T = 1; T = 2 too with DISAGG_CUDA_GEMV=2; else the GEMM and k_swiglu).
 * Awkward sizes: I not a multiple of the rows of a CTA, K = 8 (one load of a lane), 264 and
 * 2056 (a partial batch of loads, one past a full batch of 256 x 8). */
static void test_gate_up_gemv(void **state) {
    int shapes[][3] = {{1, 37, 264}, {2, 37, 264}, {1, 5, 8}, {2, 3, 2056}, {1, 130, 2056}};
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        if (!backend_wants_cat(be)) continue;
        backend_stream *st = backend_stream_create(be);
        backend_dtype mm = backend_mm_dtype(be);
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            int T = shapes[k][0], I = shapes[k][1], H = shapes[k][2];
            test_batch tb;
            int start[1] = {3}, n_new[1] = {T};
            make_batch(&tb, 1, start, n_new, 4, 8, 10);
            assert_int_equal(backend_plan(st, &tb.b), 0);
            uint16_t *hgu = malloc(sizeof(uint16_t) * 2 * I * H);
            float *fgu = malloc(sizeof(float) * 2 * I * H);
            bf16_mat(hgu, fgu, (size_t)2 * I * H);
            const void *s2[2] = {hgu, hgu + (size_t)I * H};
            backend_dtype d2[2] = {BACKEND_BF16, BACKEND_BF16}, scat;
            size_t n2[2] = {(size_t)I * H, (size_t)I * H};
            backend_buffer *bgu = backend_weights_load_cat(be, s2, d2, n2, 2, &scat);
            assert_non_null(bgu);
            float *x = rand_vec((size_t)T * H, BACKEND_BF16);
            backend_buffer *bx = to_dev(st, x, (size_t)T * H, mm),
                           *bh =
                               backend_buffer_alloc(be, (size_t)T * I * backend_dtype_size(mm), 0);
            backend_mlp_op mo = {.x = DEV(bx),
                                 .x_dt = mm,
                                 .T = T,
                                 .hidden = H,
                                 .inter = I,
                                 .w_gate = DEV(bgu),
                                 .w_up = (const char *)DEV(bgu) +
                                         (size_t)I * H * backend_dtype_size(scat),
                                 .w_dt = scat,
                                 .w_gate_up = DEV(bgu),
                                 .h = DEV(bh),
                                 .h2 = NULL,
                                 .h_dt = mm};
            assert_int_equal(backend_gate_up(st, &mo), 0);
            float *gh = from_dev(st, DEV(bh), (size_t)T * I, mm);
            double *wh = malloc(sizeof(double) * T * I);
            for (int t = 0; t < T; t++)
                for (int n = 0; n < I; n++) {
                    double gg = 0, uu = 0;
                    for (int i = 0; i < H; i++) {
                        gg += (double)x[t * H + i] * fgu[(size_t)n * H + i];
                        uu += (double)x[t * H + i] * fgu[(size_t)(I + n) * H + i];
                    }
                    wh[t * I + n] = gg / (1.0 + exp(-gg)) * uu;
                }
            char what[80];
            snprintf(what, sizeof what, "gate_up gemv T %d I %d K %d", T, I, H);
            /* bf16 h (8e-3 of 1 + |ref|, as test_fused_ops) on top of the dot products' f32
             * accumulation over K <= 2056 */
            check_close(what, be, gh, wh, (size_t)T * I, mm == BACKEND_F32 ? 1e-4 : 1e-2);
            free(gh), free(wh), free(x), free(hgu), free(fgu);
            backend_buffer_free(bgu), backend_buffer_free(bx), backend_buffer_free(bh);
        }
        backend_stream_free(st);
    }
}

/* backend_gate_up over FP8 gate|up weights (one (2I, K) e4m3 matrix, scales per tensor, per
 * channel, 128 x 128) at decode sizes: CUDA's fused GEMV (SwiGLU epilogue, split-K for K >= 2048
 * at these few rows) over the e4m3 bytes; the CPU's dequantized f32.  Against a host reference
 * in double of silu(x wg^T) * (x wu^T) with w = e4m3 * scale. */
static void test_gate_up_fp8(void **state) {
    (void)state;
    int shapes[][3] = {{1, 128, 272}, {2, 256, 2064}, {1, 256, 4128}};
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype mm = backend_mm_dtype(be);
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
            for (int lay = 0; lay < 3; lay++) {
                int T = shapes[k][0], I = shapes[k][1], H = shapes[k][2], N = 2 * I;
                int bn = lay == 0 ? N : lay == 1 ? 1 : 128, bk = lay == 2 ? 128 : H;
                int nkb = (H + bk - 1) / bk, ng = (N + bn - 1) / bn * nkb;
                test_batch tb;
                int start[1] = {3}, n_new[1] = {T};
                make_batch(&tb, 1, start, n_new, 4, 8, 10);
                assert_int_equal(backend_plan(st, &tb.b), 0);
                uint8_t *q = malloc((size_t)N * H);
                float *sc = malloc((size_t)ng * sizeof *sc), *wf = malloc((size_t)N * H * 4);
                assert_non_null(q), assert_non_null(sc), assert_non_null(wf);
                for (int i = 0; i < ng; i++)
                    sc[i] = (float)((0.2 + urand()) * 2.0 / (448.0 * sqrt((double)H)));
                for (size_t i = 0; i < (size_t)N * H; i++) {
                    do
                        q[i] = (uint8_t)irand(256);
                    while ((q[i] & 0x7f) == 0x7f);
                }
                backend_e4m3_to_f32(wf, q, (size_t)N * H);
                backend_dtype stored;
                backend_wscale ws;
                backend_buffer *bw = backend_weights_load_fp8(be, q, N, H, sc, bn, bk, &stored, &ws);
                assert_non_null(bw);
                /* the up half as its own matrix (I a multiple of bn or one scale a tensor) */
                backend_wscale su = ws;
                size_t es = backend_dtype_size(stored);
                if (ws.s) {
                    su.s = ws.s + (bn >= N ? 0 : (size_t)(I / bn) * nkb);
                    if (ws.twin) su.twin = (const char *)ws.twin + (size_t)I * H * 2;
                }
                float *x = rand_vec((size_t)T * H, BACKEND_BF16);
                backend_buffer *bx = to_dev(st, x, (size_t)T * H, mm),
                               *bh = backend_buffer_alloc(be, (size_t)T * I * backend_dtype_size(mm), 0),
                               *bh2 = backend_buffer_alloc(be, (size_t)T * I * backend_dtype_size(mm), 0);
                backend_mlp_op mo = {.x = DEV(bx),
                                     .x_dt = mm,
                                     .T = T,
                                     .hidden = H,
                                     .inter = I,
                                     .w_gate = DEV(bw),
                                     .w_up = (const char *)DEV(bw) + (size_t)I * H * es,
                                     .w_dt = stored,
                                     .w_gate_up = backend_wants_cat(be) ? DEV(bw) : NULL,
                                     .h = DEV(bh),
                                     .h2 = backend_wants_cat(be) ? NULL : DEV(bh2),
                                     .h_dt = mm,
                                     .s_gate = ws,
                                     .s_up = su,
                                     .s_gate_up = ws};
                assert_int_equal(backend_gate_up(st, &mo), 0);
                float *gh = from_dev(st, DEV(bh), (size_t)T * I, mm);
                double *wh = malloc(sizeof(double) * T * I);
                for (int t = 0; t < T; t++)
                    for (int n = 0; n < I; n++) {
                        double gg = 0, uu = 0;
                        for (int i = 0; i < H; i++) {
                            gg += (double)x[t * H + i] * wf[(size_t)n * H + i] *
                                  sc[(n / bn) * nkb + i / bk];
                            uu += (double)x[t * H + i] * wf[(size_t)(I + n) * H + i] *
                                  sc[((I + n) / bn) * nkb + i / bk];
                        }
                        wh[t * I + n] = gg / (1.0 + exp(-gg)) * uu;
                    }
                char what[96];
                snprintf(what, sizeof what, "fp8 gate_up T %d I %d K %d scales %s", T, I, H,
                         lay == 0 ? "per tensor" : lay == 1 ? "per channel" : "128x128");
                check_close(what, be, gh, wh, (size_t)T * I, mm == BACKEND_F32 ? 1e-4 : 1e-2);
                free(gh), free(wh), free(x), free(q), free(sc), free(wf);
                backend_buffer_free(bw), backend_buffer_free(bx), backend_buffer_free(bh),
                    backend_buffer_free(bh2);
            }
        backend_stream_free(st);
    }
}

/* ---- the tensor-core FP8 GEMV (CUDA, DISAGG_CUDA_FP8_MMA) ------------------------------ */

/* a CUDA backend opened with DISAGG_CUDA_FP8_MMA=1 (the variable restored after), or NULL with
 * a loud SKIP line */
/* a second CUDA backend and a stream of it with DISAGG_CUDA_FP8_MMA=1: the switch is read
 * when a stream's context is made (ctx_create), so the stream is created while it is set */
static backend *open_fp8_mma(const char *test, backend_stream **st) {
    *st = NULL;
    if (g_n_be < 2) {
        print_message("*** SKIP %s: no CUDA backend here (the tensor-core FP8 GEMV needs the "
                      "GPU)\n",
                      test);
        return NULL;
    }
    const char *old = getenv("DISAGG_CUDA_FP8_MMA");
    char *keep = old ? strdup(old) : NULL;
    setenv("DISAGG_CUDA_FP8_MMA", "1", 1);
    backend *bm = NULL;
    char err[512];
    int rc = backend_open("cuda", NULL, &bm, err, sizeof err);
    if (!rc) *st = backend_stream_create(bm);
    if (keep)
        setenv("DISAGG_CUDA_FP8_MMA", keep, 1);
    else
        unsetenv("DISAGG_CUDA_FP8_MMA");
    free(keep);
    if (rc) fail_msg("%s: a second CUDA backend did not open: %s", test, err);
    assert_non_null(*st);
    return bm;
}

/* random e4m3 codes (no NaN) for an (N, K) matrix and its f32 values */
static void fp8_rand_matrix(uint8_t *q, float *wf, size_t n) {
    for (size_t i = 0; i < n; i++) {
        do
            q[i] = (uint8_t)irand(256);
        while ((q[i] & 0x7f) == 0x7f);
    }
    backend_e4m3_to_f32(wf, q, n);
}

/* backend_matmul over FP8 weights on the tensor-core GEMV (a backend opened with
 * DISAGG_CUDA_FP8_MMA=1) against a host reference in double of x . (e4m3 * scale)^T + bias, at
 * the CUDA-core GEMV's tolerance (1e-4 of 1 + |ref|), for T = 1, 2, 7, 9, 16 and scales per
 * tensor, per channel and 128 x 128: N and K not multiples of 16 rows / 64 columns (partial
 * tiles and chunks), K = 16, long rows (split-K), and the Qwen2.5-7B shapes (down 3584 x 18944,
 * q|k|v 4608 x 3584, o 3584 x 3584; every 61st row and the last against the reference).  The
 * default CUDA backend (the CUDA-core GEMV for T <= 8, the bf16 twin above) runs the same
 * product, its error printed beside.  One case puts |x| = 131072 (beyond f16) into token 0: the
 * warps that see it recompute in f32. */
static void test_fp8_mma_gemv(void **state) {
    (void)state;
    backend_stream *sm;
    backend *bm = open_fp8_mma("test_fp8_mma_gemv", &sm);
    if (!bm) return;
    backend *bd = g_be[1];
    int shapes[][2] = {{37, 272}, {200, 336}, {130, 4112}, {3, 16},
                       {129, 2064}, {3584, 18944}, {4608, 3584}, {3584, 3584}};
    int Ts[] = {1, 2, 7, 9, 16};
    backend_stream *sd = backend_stream_create(bd);
    backend_dtype a = backend_act_dtype(bm);
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int N = shapes[k][0], K = shapes[k][1], big = (size_t)N * K > 4000000;
        uint8_t *q = malloc((size_t)N * K);
        float *wf = malloc((size_t)N * K * 4);
        assert_non_null(q), assert_non_null(wf);
        fp8_rand_matrix(q, wf, (size_t)N * K);
        for (int lay = 0; lay < 3; lay++) {
            int bn = lay == 0 ? N : lay == 1 ? 1 : 128, bk = lay == 2 ? 128 : K;
            int nkb = (K + bk - 1) / bk, ng = (N + bn - 1) / bn * nkb;
            float *sc = malloc((size_t)ng * sizeof *sc);
            assert_non_null(sc);
            for (int i = 0; i < ng; i++)
                sc[i] = (float)((0.2 + urand()) * 2.0 / (448.0 * sqrt((double)K)));
            backend_dtype dtm, dtd;
            backend_wscale wsm, wsd;
            backend_buffer *bwm = backend_weights_load_fp8(bm, q, N, K, sc, bn, bk, &dtm, &wsm);
            backend_buffer *bwd = backend_weights_load_fp8(bd, q, N, K, sc, bn, bk, &dtd, &wsd);
            assert_non_null(bwm), assert_non_null(bwd);
            assert_int_equal(dtm, BACKEND_F8E4M3);
            for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                int T = Ts[ti], huge = k == 1 && lay == 1 && T >= 7;
                float *x = rand_vec((size_t)T * K, BACKEND_BF16),
                      *bias = rand_vec((size_t)N, BACKEND_F32);
                if (huge) x[K / 3] = 131072.0f; /* token 0: not an f16 */
                backend_buffer *bxm = to_dev(sm, x, (size_t)T * K, a),
                               *bbm = to_dev(sm, bias, (size_t)N, BACKEND_F32),
                               *bym = backend_buffer_alloc(bm, (size_t)T * N * 4, 0);
                backend_buffer *bxd = to_dev(sd, x, (size_t)T * K, a),
                               *bbd = to_dev(sd, bias, (size_t)N, BACKEND_F32),
                               *byd = backend_buffer_alloc(bd, (size_t)T * N * 4, 0);
                backend_matmul_op om = {DEV(bym), BACKEND_F32, DEV(bxm), a, DEV(bwm), dtm,
                                        DEV(bbm), T,           N,        K, wsm};
                backend_matmul_op od = {DEV(byd), BACKEND_F32, DEV(bxd), a, DEV(bwd), dtd,
                                        DEV(bbd), T,           N,        K, wsd};
                assert_int_equal(backend_matmul(sm, &om, 1), 0);
                assert_int_equal(backend_matmul(sd, &od, 1), 0);
                float *gm = from_dev(sm, DEV(bym), (size_t)T * N, BACKEND_F32);
                float *gd = from_dev(sd, DEV(byd), (size_t)T * N, BACKEND_F32);
                /* the rows checked: all, or every 61st and the last of the 7B shapes */
                int step = big ? 61 : 1, nr = (N - 1) / step + 1 + ((N - 1) % step != 0);
                double *want = malloc(sizeof(double) * T * nr);
                float *cm = malloc(sizeof(float) * T * nr), *cd = malloc(sizeof(float) * T * nr);
                assert_non_null(want), assert_non_null(cm), assert_non_null(cd);
                size_t m = 0;
                for (int t = 0; t < T; t++)
                    for (int r = 0; r < nr; r++, m++) {
                        int n = r * step < N ? r * step : N - 1;
                        double acc = bias[n];
                        for (int i = 0; i < K; i++)
                            acc += (double)x[(size_t)t * K + i] * wf[(size_t)n * K + i] *
                                   sc[(n / bn) * nkb + i / bk];
                        want[m] = acc;
                        cm[m] = gm[(size_t)t * N + n], cd[m] = gd[(size_t)t * N + n];
                    }
                char what[128];
                snprintf(what, sizeof what, "fp8 mma gemv T %d N %d K %d scales %s%s", T, N, K,
                         lay == 0   ? "per tensor"
                         : lay == 1 ? "per channel"
                                    : "128x128",
                         huge ? " (|x| 131072: the f32 fallback)" : "");
                print_message("  %s: error %.2g (the default path: %.2g)\n", what,
                              max_err(cm, want, m), max_err(cd, want, m));
                check_close(what, bm, cm, want, m, 1e-4);
                free(want), free(cm), free(cd), free(gm), free(gd), free(x), free(bias);
                backend_buffer_free(bxm), backend_buffer_free(bbm), backend_buffer_free(bym);
                backend_buffer_free(bxd), backend_buffer_free(bbd), backend_buffer_free(byd);
            }
            free(sc);
            backend_buffer_free(bwm), backend_buffer_free(bwd);
        }
        free(q), free(wf);
    }
    backend_stream_free(sm), backend_stream_free(sd);
    backend_close(bm);
}

/* backend_gate_up over one (2I, K) FP8 gate|up matrix on the tensor-core GEMV (SwiGLU in its
 * epilogue; DISAGG_CUDA_FP8_MMA=1) against a host reference in double of silu(x wg^T) * (x
 * wu^T), h in the backend's matmul dtype (1e-2 of 1 + |ref| for bf16, as test_gate_up_fp8),
 * T = 1, 2, 7, 16, scales per tensor / per channel / 128 x 128: I not a multiple of 8, K not
 * of 64, and the Qwen2.5-7B gate|up (I 18944, K 3584; every 61st output and the last). */
static void test_fp8_mma_gate_up(void **state) {
    (void)state;
    backend_stream *st;
    backend *bm = open_fp8_mma("test_fp8_mma_gate_up", &st);
    if (!bm) return;
    int shapes[][2] = {{100, 272}, {256, 2064}, {18944, 3584}};
    int Ts[] = {1, 2, 7, 16};
    backend_dtype mm = backend_mm_dtype(bm);
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int I = shapes[k][0], H = shapes[k][1], N = 2 * I, big = (size_t)N * H > 4000000;
        uint8_t *q = malloc((size_t)N * H);
        float *wf = malloc((size_t)N * H * 4);
        assert_non_null(q), assert_non_null(wf);
        fp8_rand_matrix(q, wf, (size_t)N * H);
        for (int lay = 0; lay < 3; lay++) {
            int bn = lay == 0 ? N : lay == 1 ? 1 : 128, bk = lay == 2 ? 128 : H;
            int nkb = (H + bk - 1) / bk, ng = (N + bn - 1) / bn * nkb;
            float *sc = malloc((size_t)ng * sizeof *sc);
            assert_non_null(sc);
            for (int i = 0; i < ng; i++)
                sc[i] = (float)((0.2 + urand()) * 2.0 / (448.0 * sqrt((double)H)));
            backend_dtype stored;
            backend_wscale ws;
            backend_buffer *bw = backend_weights_load_fp8(bm, q, N, H, sc, bn, bk, &stored, &ws);
            assert_non_null(bw);
            backend_wscale su = ws;
            if (ws.s) {
                su.s = ws.s + (bn >= N ? 0 : (size_t)(I / bn) * nkb);
                if (ws.twin) su.twin = (const char *)ws.twin + (size_t)I * H * 2;
            }
            for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                int T = Ts[ti];
                test_batch tb;
                int start[1] = {3}, n_new[1] = {T};
                make_batch(&tb, 1, start, n_new, 4, 8, 10);
                assert_int_equal(backend_plan(st, &tb.b), 0);
                float *x = rand_vec((size_t)T * H, BACKEND_BF16);
                size_t es = backend_dtype_size(stored), hb = (size_t)T * I * backend_dtype_size(mm);
                int cat = backend_wants_cat(bm);
                backend_buffer *bx = to_dev(st, x, (size_t)T * H, mm),
                               *bh = backend_buffer_alloc(bm, hb, 0),
                               *bh2 = cat ? NULL : backend_buffer_alloc(bm, hb, 0);
                backend_mlp_op mo = {.x = DEV(bx),
                                     .x_dt = mm,
                                     .T = T,
                                     .hidden = H,
                                     .inter = I,
                                     .w_gate = DEV(bw),
                                     .w_up = (const char *)DEV(bw) + (size_t)I * H * es,
                                     .w_dt = stored,
                                     .w_gate_up = cat ? DEV(bw) : NULL,
                                     .h = DEV(bh),
                                     .h2 = cat ? NULL : DEV(bh2),
                                     .h_dt = mm,
                                     .s_gate = ws,
                                     .s_up = su,
                                     .s_gate_up = ws};
                assert_int_equal(backend_gate_up(st, &mo), 0);
                float *gh = from_dev(st, DEV(bh), (size_t)T * I, mm);
                int step = big ? 61 : 1, nr = (I - 1) / step + 1 + ((I - 1) % step != 0);
                double *wh = malloc(sizeof(double) * T * nr);
                float *ch = malloc(sizeof(float) * T * nr);
                assert_non_null(wh), assert_non_null(ch);
                size_t m = 0;
                for (int t = 0; t < T; t++)
                    for (int r = 0; r < nr; r++, m++) {
                        int n = r * step < I ? r * step : I - 1;
                        double gg = 0, uu = 0;
                        for (int i = 0; i < H; i++) {
                            gg += (double)x[(size_t)t * H + i] * wf[(size_t)n * H + i] *
                                  sc[(n / bn) * nkb + i / bk];
                            uu += (double)x[(size_t)t * H + i] * wf[(size_t)(I + n) * H + i] *
                                  sc[((I + n) / bn) * nkb + i / bk];
                        }
                        wh[m] = gg / (1.0 + exp(-gg)) * uu;
                        ch[m] = gh[(size_t)t * I + n];
                    }
                char what[96];
                snprintf(what, sizeof what, "fp8 mma gate_up T %d I %d K %d scales %s", T, I, H,
                         lay == 0 ? "per tensor" : lay == 1 ? "per channel" : "128x128");
                print_message("  %s: error %.2g\n", what, max_err(ch, wh, m));
                check_close(what, bm, ch, wh, m, mm == BACKEND_F32 ? 1e-4 : 1e-2);
                free(gh), free(wh), free(ch), free(x);
                backend_buffer_free(bx), backend_buffer_free(bh);
                if (bh2) backend_buffer_free(bh2);
            }
            free(sc);
            backend_buffer_free(bw);
        }
        free(q), free(wf);
    }
    backend_stream_free(st);
    backend_close(bm);
}

/* backend_qkv over one FP8 q|k|v matrix on the tensor-core GEMV with the bias, RoPE and KV-write
 * epilogue (DISAGG_CUDA_FP8_MMA=1): q (bias, RoPE) and the f32 K/V written into the cache
 * against a host reference in double (1e-4 of 1 + |ref|), T = 1, 2, 7, 16 sequences of one new
 * token each, scales per tensor / per channel / 128 x 128, a small head layout (hd 16, GQA 3)
 * and the Qwen2.5-7B one (28 q heads, 4 KV heads, hd 128, hidden 3584). */
static void test_fp8_mma_qkv(void **state) {
    (void)state;
    backend_stream *st;
    backend *bm = open_fp8_mma("test_fp8_mma_qkv", &st);
    if (!bm) return;
    int shapes[][4] = {{6, 2, 16, 272}, {28, 4, 128, 3584}}; /* nh, nkv, hd, hidden */
    int Ts[] = {1, 2, 7, 16};
    enum { L = 2, LAYER = 1 };
    backend_dtype mm = backend_mm_dtype(bm);
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int NH = shapes[k][0], NKV = shapes[k][1], HD = shapes[k][2], H = shapes[k][3];
        int Q = NH * HD, KVD = NKV * HD, W = Q + 2 * KVD;
        uint8_t *q8 = malloc((size_t)W * H);
        float *wf = malloc((size_t)W * H * 4), *bias = rand_vec((size_t)W, BACKEND_F32);
        float *inv = malloc(sizeof(float) * HD / 2);
        assert_non_null(q8), assert_non_null(wf), assert_non_null(inv);
        fp8_rand_matrix(q8, wf, (size_t)W * H);
        for (int i = 0; i < HD / 2; i++)
            inv[i] = 1.0f / powf(10000.0f, (float)(2 * i) / HD);
        for (int lay = 0; lay < 3; lay++) {
            int bn = lay == 0 ? W : lay == 1 ? 1 : 128, bk = lay == 2 ? 128 : H;
            int nkb = (H + bk - 1) / bk, ng = (W + bn - 1) / bn * nkb;
            float *sc = malloc((size_t)ng * sizeof *sc);
            assert_non_null(sc);
            for (int i = 0; i < ng; i++)
                sc[i] = (float)((0.2 + urand()) * 2.0 / (448.0 * sqrt((double)H)));
            backend_dtype stored;
            backend_wscale ws;
            backend_buffer *bw = backend_weights_load_fp8(bm, q8, W, H, sc, bn, bk, &stored, &ws);
            assert_non_null(bw);
            for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                int T = Ts[ti], start[16], n_new[16];
                for (int i = 0; i < T; i++)
                    start[i] = 5 + 7 * i, n_new[i] = 1;
                test_batch tb;
                make_batch(&tb, T, start, n_new, 8, 256, 10);
                assert_int_equal(backend_plan(st, &tb.b), 0);
                float *x = rand_vec((size_t)T * H, BACKEND_BF16);
                backend_buffer *bx = to_dev(st, x, (size_t)T * H, mm),
                               *bb = to_dev(st, bias, W, BACKEND_F32),
                               *binv = to_dev(st, inv, HD / 2, BACKEND_F32);
                backend_kv kv = {NULL, BACKEND_F32, tb.n_blocks, tb.bs, L, NKV, HD, 0, NULL, NULL};
                size_t n_el = backend_kv_block_bytes(&kv) / 4 * kv.n_blocks;
                backend_buffer *region = backend_buffer_alloc(bm, n_el * 4, BACKEND_BUF_KV);
                kv.base = DEV(region);
                backend_buffer *bq = backend_buffer_alloc(bm, (size_t)T * Q * 4, 0),
                               *bk_ = backend_buffer_alloc(bm, (size_t)T * KVD * 4, 0),
                               *bv = backend_buffer_alloc(bm, (size_t)T * KVD * 4, 0);
                const float *db = DEV(bb);
                const char *w0 = DEV(bw);
                size_t es = backend_dtype_size(stored);
                backend_qkv_op op = {.x = DEV(bx),
                                     .x_dt = mm,
                                     .T = T,
                                     .hidden = H,
                                     .n_heads = NH,
                                     .wq = w0,
                                     .wk = w0 + (size_t)Q * H * es,
                                     .wv = w0 + (size_t)(Q + KVD) * H * es,
                                     .w_dt = stored,
                                     .bq = db,
                                     .bk = db + Q,
                                     .bv = db + Q + KVD,
                                     .wqkv = w0,
                                     .bqkv = db,
                                     .sqkv = ws,
                                     .q = DEV(bq),
                                     .k = DEV(bk_),
                                     .v = DEV(bv),
                                     .dt = BACKEND_F32,
                                     .inv_freq = DEV(binv),
                                     .kv = &kv,
                                     .layer = LAYER};
                assert_int_equal(backend_qkv(st, &op), 0);
                float *gq = from_dev(st, DEV(bq), (size_t)T * Q, BACKEND_F32);
                float *gkv = from_dev(st, kv.base, n_el, BACKEND_F32);
                double *wq = calloc((size_t)T * Q, sizeof(double)),
                       *wkv = calloc(n_el, sizeof(double)), *row = malloc(sizeof(double) * W);
                assert_non_null(wq), assert_non_null(wkv), assert_non_null(row);
                for (int t = 0; t < T; t++) {
                    for (int n = 0; n < W; n++) {
                        double acc = bias[n];
                        for (int i = 0; i < H; i++)
                            acc += (double)x[(size_t)t * H + i] * wf[(size_t)n * H + i] *
                                   sc[(n / bn) * nkb + i / bk];
                        row[n] = acc;
                    }
                    int p = tb.tok_pos[t];
                    for (int hh = 0; hh < NH + NKV; hh++)
                        for (int i = 0; i < HD / 2; i++) {
                            float ang = (float)p * inv[i];
                            double c = cos(ang), sn = sin(ang), u = row[hh * HD + i],
                                   w = row[hh * HD + i + HD / 2];
                            row[hh * HD + i] = u * c - w * sn;
                            row[hh * HD + i + HD / 2] = w * c + u * sn;
                        }
                    for (int n = 0; n < Q; n++)
                        wq[(size_t)t * Q + n] = row[n];
                    int sq = tb.tok_seq[t], blk = tb.bt[tb.bt_ptr[sq] + p / kv.block_size],
                        slot = p % kv.block_size;
                    for (int hh = 0; hh < NKV; hh++)
                        for (int d = 0; d < HD; d++) {
                            wkv[kv_index(&kv, blk, LAYER, 0, slot, hh, d)] = row[Q + hh * HD + d];
                            wkv[kv_index(&kv, blk, LAYER, 1, slot, hh, d)] =
                                row[Q + KVD + hh * HD + d];
                        }
                }
                char what[128];
                snprintf(what, sizeof what, "fp8 mma qkv T %d nh %d nkv %d hd %d K %d scales %s: q",
                         T, NH, NKV, HD, H,
                         lay == 0 ? "per tensor" : lay == 1 ? "per channel" : "128x128");
                print_message("  %s: error %.2g, K/V %.2g\n", what, max_err(gq, wq, (size_t)T * Q),
                              max_err(gkv, wkv, n_el));
                check_close(what, bm, gq, wq, (size_t)T * Q, 1e-4);
                strncat(what, " -> K/V in the cache", sizeof what - strlen(what) - 1);
                check_close(what, bm, gkv, wkv, n_el, 1e-4);
                free(gq), free(gkv), free(wq), free(wkv), free(row), free(x);
                backend_buffer *bufs[] = {bx, bb, binv, region, bq, bk_, bv};
                for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
                    backend_buffer_free(bufs[i]);
            }
            free(sc);
            backend_buffer_free(bw);
        }
        free(q8), free(wf), free(bias), free(inv);
    }
    backend_stream_free(st);
    backend_close(bm);
}

/* backend_qkv at the decode sizes (1 and 2 tokens) over the concatenated q|k|v matrix: the
 * CUDA backend's fused GEMV (bias, RoPE and the KV write in its epilogue), split-K for long
 * rows (DISAGG_CUDA_QKV_SPLIT; by default hidden 2056 takes 2 splits, 4104 4), GQA 3.  Run
 * twice: the second q and cache must be the same bits (the splits add in a fixed order). */
static void test_qkv_gemv(void **state) {
    enum { NH = 6, NKV = 2, HD = 16, KVD = NKV * HD, W = NH * HD + 2 * KVD, L = 2, LAYER = 1 };
    int shapes[][2] = {{1, 2056}, {2, 2056}, {1, 4104}, {2, 4104}, {1, 264}};
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        if (!backend_wants_cat(be)) continue;
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be), mm = backend_mm_dtype(be),
                      kdt = backend_kv_dtype_default(be);
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            int T = shapes[k][0], H = shapes[k][1], Q = NH * HD;
            test_batch tb;
            int start[2] = {5, 37}, n_new[2] = {1, 1};
            make_batch(&tb, T, start, n_new, 8, 12, 10);
            assert_int_equal(backend_plan(st, &tb.b), 0);
            uint16_t *hw = malloc(sizeof(uint16_t) * W * H);
            float *fw = malloc(sizeof(float) * W * H), bias[W], inv[HD / 2];
            bf16_mat(hw, fw, (size_t)W * H);
            for (int i = 0; i < W; i++)
                bias[i] = frand();
            for (int i = 0; i < HD / 2; i++)
                inv[i] = 1.0f / powf(10000.0f, (float)(2 * i) / HD);
            const void *s3[3] = {hw, hw + (size_t)Q * H, hw + (size_t)(Q + KVD) * H};
            backend_dtype d3[3] = {BACKEND_BF16, BACKEND_BF16, BACKEND_BF16}, scat;
            size_t n3[3] = {(size_t)Q * H, (size_t)KVD * H, (size_t)KVD * H};
            backend_buffer *bw = backend_weights_load_cat(be, s3, d3, n3, 3, &scat);
            assert_non_null(bw);
            size_t es = backend_dtype_size(scat);
            const char *w0 = DEV(bw);
            float *x = rand_vec((size_t)T * H, BACKEND_BF16);
            backend_buffer *bx = to_dev(st, x, (size_t)T * H, mm),
                           *bb = to_dev(st, bias, W, BACKEND_F32),
                           *binv = to_dev(st, inv, HD / 2, BACKEND_F32);
            backend_kv kv = {NULL, kdt, tb.n_blocks, tb.bs, L, NKV, HD, 0, NULL, NULL};
            size_t n_el = backend_kv_block_bytes(&kv) / backend_dtype_size(kdt) * kv.n_blocks;
            backend_buffer *region =
                backend_buffer_alloc(be, n_el * backend_dtype_size(kdt), BACKEND_BUF_KV);
            kv.base = DEV(region);
            backend_buffer *bq = backend_buffer_alloc(be, (size_t)T * Q * backend_dtype_size(a), 0),
                           *bk =
                               backend_buffer_alloc(be, (size_t)T * KVD * backend_dtype_size(a), 0),
                           *bv =
                               backend_buffer_alloc(be, (size_t)T * KVD * backend_dtype_size(a), 0);
            const float *db = DEV(bb);
            backend_qkv_op op = {.x = DEV(bx),
                                 .x_dt = mm,
                                 .T = T,
                                 .hidden = H,
                                 .n_heads = NH,
                                 .wq = w0,
                                 .wk = w0 + (size_t)Q * H * es,
                                 .wv = w0 + (size_t)(Q + KVD) * H * es,
                                 .w_dt = scat,
                                 .bq = db,
                                 .bk = db + Q,
                                 .bv = db + Q + KVD,
                                 .wqkv = w0,
                                 .bqkv = db,
                                 .q = DEV(bq),
                                 .k = DEV(bk),
                                 .v = DEV(bv),
                                 .dt = a,
                                 .inv_freq = DEV(binv),
                                 .kv = &kv,
                                 .layer = LAYER};
            float *gq[2], *gkv[2];
            for (int rep = 0; rep < 2; rep++) {
                assert_int_equal(backend_qkv(st, &op), 0);
                gq[rep] = from_dev(st, DEV(bq), (size_t)T * Q, a);
                gkv[rep] = from_dev(st, kv.base, n_el, kdt);
            }
            double *wq = calloc((size_t)T * Q, sizeof(double)), *wkv = calloc(n_el, sizeof(double));
            for (int t = 0; t < T; t++) {
                double row[W];
                for (int n = 0; n < W; n++) {
                    double acc = bias[n];
                    for (int i = 0; i < H; i++)
                        acc += (double)x[(size_t)t * H + i] * fw[(size_t)n * H + i];
                    row[n] = acc;
                }
                int p = tb.tok_pos[t];
                for (int hh = 0; hh < NH + NKV; hh++)
                    for (int i = 0; i < HD / 2; i++) {
                        float ang = (float)p * inv[i];
                        double c = cos(ang), sn = sin(ang), u = row[hh * HD + i],
                               w = row[hh * HD + i + HD / 2];
                        row[hh * HD + i] = u * c - w * sn;
                        row[hh * HD + i + HD / 2] = w * c + u * sn;
                    }
                for (int n = 0; n < Q; n++)
                    wq[t * Q + n] = row[n];
                int s = tb.tok_seq[t], blk = tb.bt[tb.bt_ptr[s] + p / kv.block_size],
                    slot = p % kv.block_size;
                for (int hh = 0; hh < NKV; hh++)
                    for (int d = 0; d < HD; d++) {
                        wkv[kv_index(&kv, blk, LAYER, 0, slot, hh, d)] = row[Q + hh * HD + d];
                        wkv[kv_index(&kv, blk, LAYER, 1, slot, hh, d)] = row[Q + KVD + hh * HD + d];
                    }
            }
            char what[96];
            snprintf(what, sizeof what, "qkv gemv T %d hidden %d: q (bias, RoPE)", T, H);
            check_close(what, be, gq[0], wq, (size_t)T * Q, 1e-4);
            snprintf(what, sizeof what, "qkv gemv T %d hidden %d: K/V in the cache", T, H);
            check_close(what, be, gkv[0], wkv, n_el, kdt == BACKEND_F32 ? 1e-4 : 8e-3);
            assert_memory_equal(gq[0], gq[1], sizeof(float) * T * Q);
            assert_memory_equal(gkv[0], gkv[1], sizeof(float) * n_el);
            for (int rep = 0; rep < 2; rep++)
                free(gq[rep]), free(gkv[rep]);
            free(wq), free(wkv), free(x), free(hw), free(fw);
            backend_buffer *bufs[] = {bw, bx, bb, binv, region, bq, bk, bv};
            for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
                backend_buffer_free(bufs[i]);
        }
        backend_stream_free(st);
    }
}

static void test_swiglu_add(void **state) {
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be);
        int rows = 5, n = 77;
        size_t N = (size_t)rows * n;
        float *g = rand_vec(N, a), *u = rand_vec(N, a);
        for (size_t i = 0; i < N; i++)
            g[i] *= 8.0f; /* both tails of silu */
        round_to(g, N, a);
        backend_buffer *bg = to_dev(st, g, N, a), *bu = to_dev(st, u, N, a);
        assert_int_equal(backend_swiglu(st, DEV(bg), DEV(bu), a, rows, n), 0);
        double *want = malloc(sizeof(double) * N);
        for (size_t i = 0; i < N; i++)
            want[i] = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
        float *got = from_dev(st, DEV(bg), N, a);
        check_close("swiglu", be, got, want, N, tol_for(be, 2e-6, 1e-2));
        free(got);
        /* residual add: u += (the swiglu result) */
        assert_int_equal(backend_add(st, DEV(bu), DEV(bg), a, N), 0);
        for (size_t i = 0; i < N; i++)
            want[i] += u[i];
        got = from_dev(st, DEV(bu), N, a);
        check_close("add", be, got, want, N, tol_for(be, 2e-6, 1e-2));
        free(got), free(want), free(g), free(u);
        backend_buffer_free(bg), backend_buffer_free(bu);
        backend_stream_free(st);
    }
}

static void test_gather_argmax(void **state) {
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be);
        test_batch tb;
        int start[3] = {0, 2, 9}, n_new[3] = {4, 1, 3};
        make_batch(&tb, 3, start, n_new, 4, 12, 10);
        int rows[5] = {3, 4, 0, 7, 3}; /* any order, repeats allowed */
        memcpy(tb.out_rows, rows, sizeof rows);
        tb.b.n_out = 5;
        assert_int_equal(backend_plan(st, &tb.b), 0);
        int w = 19;
        float *x = rand_vec((size_t)tb.T * w, a);
        backend_buffer *bx = to_dev(st, x, (size_t)tb.T * w, a),
                       *bo = backend_buffer_alloc(be, 5 * (size_t)w * 4, 0);
        assert_int_equal(backend_gather_rows(st, DEV(bo), DEV(bx), a, w), 0);
        double want[5 * 19];
        for (int r = 0; r < 5; r++)
            for (int i = 0; i < w; i++)
                want[r * w + i] = x[rows[r] * w + i];
        float *got = from_dev(st, DEV(bo), 5 * (size_t)w, a);
        check_close("gather_rows", be, got, want, 5 * (size_t)w, 0);
        free(got), free(x);
        /* argmax: ties go to the first, NaN never wins */
        int R = 4, V = 1001;
        float *lg = rand_vec((size_t)R * V, BACKEND_F32);
        lg[0 * V + 500] = 5.0f, lg[0 * V + 700] = 5.0f; /* tie: 500 */
        lg[1 * V + 0] = NAN, lg[1 * V + 3] = 9.0f;      /* 3 */
        lg[2 * V + 1000] = 2.0f;                        /* last */
        lg[3 * V + 0] = 7.0f;                           /* first */
        backend_buffer *bl = to_dev(st, lg, (size_t)R * V, BACKEND_F32),
                       *bi32 = backend_buffer_alloc(be, (size_t)R * 4, 0);
        assert_int_equal(backend_argmax(st, DEV(bi32), DEV(bl), R, V), 0);
        int32_t idx[4];
        assert_int_equal(backend_stream_sync(st), 0);
        assert_int_equal(backend_download(st, idx, DEV(bi32), sizeof idx), 0);
        assert_int_equal(idx[0], 500);
        assert_int_equal(idx[1], 3);
        assert_int_equal(idx[2], 1000);
        assert_int_equal(idx[3], 0);
        free(lg);
        backend_buffer_free(bx), backend_buffer_free(bo), backend_buffer_free(bl),
            backend_buffer_free(bi32);
        backend_stream_free(st);
    }
}

/* Structured outputs' token masks: backend_token_bitmask against a bit-by-bit reference, the
 * masks and row indices uploaded with backend_upload_async from a host buffer, on shapes of a
 * vocabulary not a multiple of 32, a logits row wider than the vocabulary (padded ids: always
 * -inf, also where the mask's last word has bits set beyond the vocabulary) and a row named
 * twice; then the masked rows' argmax is the reference's best allowed token. */
static void test_token_bitmask(void **state) {
    static const int shapes[][2] = {{1000, 1000}, {1000, 1024}, {4096, 4096}, {33, 40}, {1, 1}};
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        assert_non_null(st);
        for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
            int vocab = shapes[c][0], width = shapes[c][1], words = (vocab + 31) / 32;
            int R = 6, n = 5, rows[5] = {4, 0, 2, 5, 2}; /* any order; row 2 twice; 1, 3 free */
            float *lg = rand_vec((size_t)R * width, BACKEND_F32);
            /* header: the row indices, then the n masks */
            size_t bytes = (size_t)n * 4 + (size_t)n * words * 4;
            backend_buffer *hb = backend_buffer_alloc(be, bytes, BACKEND_BUF_HOST);
            assert_non_null(hb);
            assert_true(backend_buffer_is_host(hb));
            int32_t *h = backend_buffer_ptr(hb);
            memcpy(h, rows, sizeof rows);
            uint32_t *m = (uint32_t *)h + n;
            for (int k = 0; k < n; k++)
                for (int w = 0; w < words; w++) {
                    int kind = irand(4); /* all, none, sparse, dense */
                    uint32_t a = kind == 0   ? 0xFFFFFFFFu
                                 : kind == 1 ? 0
                                             : (uint32_t)(urand() * 4294967296.0);
                    if (kind == 2) a &= (uint32_t)(urand() * 4294967296.0);
                    m[(size_t)k * words + w] = a;
                }
            if (c == 1) m[words - 1] |= 0xFF000000u; /* bits 1000..1023: beyond the vocabulary */
            if (vocab == 1) m[0] = 0x3; /* token 0 allowed, bit 1 beyond the vocabulary */
            for (int k = 0; k < n; k++) /* every row allows one token at least */
                m[(size_t)k * words] |= 1u << (k % (vocab < 32 ? vocab : 32));
            double *want = malloc((size_t)R * width * sizeof *want);
            assert_non_null(want);
            for (size_t i = 0; i < (size_t)R * width; i++)
                want[i] = lg[i];
            for (int k = 0; k < n; k++)
                for (int t = 0; t < width; t++)
                    if (!(t < vocab && (m[(size_t)k * words + t / 32] >> (t % 32) & 1u)))
                        want[(size_t)rows[k] * width + t] = -INFINITY;
            backend_buffer *bl = to_dev(st, lg, (size_t)R * width, BACKEND_F32),
                           *bm = backend_buffer_alloc(be, bytes, 0),
                           *bo = backend_buffer_alloc(be, (size_t)R * 4, 0);
            assert_non_null(bm);
            assert_int_equal(backend_upload_async(st, DEV(bm), hb, 0, bytes), 0);
            assert_int_equal(backend_token_bitmask(st, DEV(bl), width,
                                                   (const int32_t *)DEV(bm) + n,
                                                   (const int32_t *)DEV(bm), n, vocab),
                             0);
            assert_int_equal(backend_argmax(st, DEV(bo), DEV(bl), R, width), 0);
            float *got = from_dev(st, DEV(bl), (size_t)R * width, BACKEND_F32);
            for (size_t i = 0; i < (size_t)R * width; i++)
                if (!(got[i] == want[i] || (isinf(got[i]) && isinf(want[i]) && got[i] < 0 && want[i] < 0)))
                    fail_msg("token_bitmask on %s: vocab %d width %d: element (%zu, %zu) is %g, "
                             "want %g",
                             backend_name(be), vocab, width, i / (size_t)width, i % (size_t)width,
                             (double)got[i], want[i]);
            int32_t amax[6];
            assert_int_equal(backend_download(st, amax, DEV(bo), sizeof amax), 0);
            for (int r = 0; r < R; r++) {
                int best = 0;
                for (int t = 1; t < width; t++)
                    if (want[(size_t)r * width + t] > want[(size_t)r * width + best]) best = t;
                assert_int_equal(amax[r], best);
            }
            free(got), free(want), free(lg);
            backend_buffer_free(bl), backend_buffer_free(bm), backend_buffer_free(bo);
            backend_buffer_free(hb);
        }
        /* bad arguments: named errors, nothing done */
        backend_buffer *dev = backend_buffer_alloc(be, 64, 0),
                       *hb = backend_buffer_alloc(be, 64, BACKEND_BUF_HOST);
        assert_non_null(dev);
        assert_non_null(hb);
        assert_int_equal(backend_token_bitmask(st, DEV(dev), 8, DEV(dev), DEV(dev), 1, 9), -EINVAL);
        assert_int_equal(backend_token_bitmask(st, DEV(dev), 8, DEV(dev), DEV(dev), 1, 0), -EINVAL);
        assert_int_equal(backend_token_bitmask(st, DEV(dev), 8, NULL, DEV(dev), 1, 8), -EINVAL);
        assert_int_equal(backend_token_bitmask(st, NULL, 8, NULL, NULL, 0, 8), 0); /* no rows */
        assert_int_equal(backend_upload_async(st, DEV(dev), hb, 32, 64), -EINVAL); /* past its end */
        assert_int_equal(backend_upload_async(st, DEV(dev), NULL, 0, 8), -EINVAL);
        if (!backend_is_cpu(be)) /* a device buffer is not host memory */
            assert_int_equal(backend_upload_async(st, DEV(hb), dev, 0, 8), -EINVAL);
        backend_buffer *plain = backend_buffer_alloc(be, 64, 0); /* not made with BUF_HOST */
        assert_non_null(plain);
        assert_int_equal(backend_upload_async(st, DEV(dev), plain, 0, 8), -EINVAL);
        backend_buffer_free(plain), backend_buffer_free(dev), backend_buffer_free(hb);
        backend_stream_free(st);
    }
}

/* ---- buffers, plan checks, registry ------------------------------------------------- */

static void test_buffers(void **state) {
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        assert_non_null(st);
        assert_ptr_equal(backend_stream_backend(st), be);
        for (int flags = BACKEND_BUF_ZERO; flags <= BACKEND_BUF_KV; flags++) {
            size_t n = 3 * 1024 * 1024 + 7; /* odd size */
            backend_buffer *b = backend_buffer_alloc(be, n, flags);
            assert_non_null(b);
            assert_int_equal(backend_buffer_size(b), n);
            assert_ptr_equal(backend_buffer_backend(b), be);
            assert_string_equal(backend_buffer_location(b), backend_location(be));
            unsigned char *h = malloc(n);
            assert_int_equal(backend_download(st, h, DEV(b), n), 0);
            for (size_t i = 0; i < n; i += 4093)
                assert_int_equal(h[i], 0);
            assert_int_equal(h[n - 1], 0);
            for (size_t i = 0; i < n; i++)
                h[i] = (unsigned char)(i * 31 + 7);
            assert_int_equal(backend_upload(st, DEV(b), h, n), 0);
            backend_buffer *c = backend_buffer_alloc(be, n, 0);
            assert_int_equal(backend_copy(st, DEV(c), DEV(b), n), 0);
            unsigned char *h2 = malloc(n);
            assert_int_equal(backend_download(st, h2, DEV(c), n), 0);
            assert_memory_equal(h, h2, n);
            assert_int_equal(backend_memset_zero(st, (char *)DEV(c) + 1, n - 2), 0);
            assert_int_equal(backend_download(st, h2, DEV(c), n), 0);
            assert_int_equal(h2[0], h[0]);
            assert_int_equal(h2[1], 0);
            assert_int_equal(h2[n - 2], 0);
            assert_int_equal(h2[n - 1], h[n - 1]);
            /* overlapping copies are refused */
            assert_int_equal(backend_copy(st, (char *)DEV(b) + 1, DEV(b), 16), -EINVAL);
            free(h), free(h2);
            backend_buffer_free(b), backend_buffer_free(c);
        }
        assert_null(backend_buffer_alloc(be, 0, 0));
        size_t fr = 0, tot = 0;
        assert_int_equal(backend_memory(be, &fr, &tot), 0);
        assert_true(tot > 0 && fr <= tot);
        backend_stream_free(st);
    }
    backend_buffer *hb = backend_buffer_alloc(g_be[0], 1, 0); /* CPU buffers are host memory */
    assert_true(backend_buffer_is_host(hb));
    backend_buffer_free(hb);
}

static void test_plan_checks(void **state) {
    backend_stream *st = backend_stream_create(g_be[0]);
    test_batch tb;
    int start[2] = {0, 3}, n_new[2] = {2, 2};
    make_batch(&tb, 2, start, n_new, 4, 4, 10);
    assert_int_equal(backend_plan(st, &tb.b), 0);
    tb.tok_pos[3] = 9; /* position not what kv_len says */
    assert_int_equal(backend_plan(st, &tb.b), -EINVAL);
    tb.tok_pos[3] = 4;
    tb.qo[2] = 3; /* ranges do not cover T */
    assert_int_equal(backend_plan(st, &tb.b), -EINVAL);
    tb.qo[2] = 4;
    tb.b.n_out = 1, tb.out_rows[0] = 4; /* row outside [0, T) */
    assert_int_equal(backend_plan(st, &tb.b), -EINVAL);
    tb.b.n_out = 0;
    tb.b.n_seqs = 0;
    assert_int_equal(backend_plan(st, &tb.b), -EINVAL);
    tb.b.n_seqs = 2;
    tb.b.bt_indices = NULL;
    assert_int_equal(backend_plan(st, &tb.b), -EINVAL);
    /* operations that need a plan refuse a fresh stream */
    backend_stream *fresh = backend_stream_create(g_be[0]);
    float x[4] = {0}, table[8] = {0};
    assert_int_equal(backend_embed(fresh, x, BACKEND_F32, table, BACKEND_F32, 2), -EINVAL);
    /* the CPU backend computes in f32 only */
    assert_int_equal(backend_add(st, x, x + 2, BACKEND_BF16, 2), -ENOTSUP);
    backend_matmul_op bad = {x, BACKEND_F32, table, BACKEND_F32,       table, BACKEND_F32, NULL,
                             0, 1,           1,     {NULL, 0, 0, NULL}};
    assert_int_equal(backend_matmul(st, &bad, 1), -EINVAL);
    assert_int_equal(backend_matmul(st, &bad, 0), -EINVAL);
    backend_stream_free(fresh);
    backend_stream_free(st);
}

static void test_registry(void **state) {
    char err[512] = "";
    backend *be = (backend *)1;
    assert_int_equal(backend_open("tpu", NULL, &be, err, sizeof err), -EINVAL);
    assert_null(be);
    assert_non_null(strstr(err, "'tpu'"));
    assert_non_null(strstr(err, BACKEND_DEVICE_NAMES));
    assert_int_equal(backend_open("cuda:x", NULL, &be, err, sizeof err), -EINVAL);
    /* a module path that does not exist: the error names the module and what to do */
    setenv("DISAGG_CUDA_MODULE", "/nonexistent/libdisagg_cuda.so", 1);
    assert_int_equal(backend_open("cuda", NULL, &be, err, sizeof err), -ENOENT);
    assert_non_null(strstr(err, "libdisagg_cuda.so"));
    assert_non_null(strstr(err, "--device cpu"));
    /* auto falls back to the CPU */
    assert_int_equal(backend_open("auto", NULL, &be, err, sizeof err), 0);
    assert_true(backend_is_cpu(be));
    assert_string_equal(backend_location(be), "cpu:0");
    backend_close(be);
    unsetenv("DISAGG_CUDA_MODULE");
    assert_int_equal(backend_open("cpu", NULL, &be, err, sizeof err), 0);
    assert_string_equal(backend_name(be), "cpu");
    assert_true(backend_kv_dtype_ok(be, BACKEND_F32));
    assert_true(backend_kv_dtype_ok(be, BACKEND_BF16)); /* opt-in */
    assert_false(backend_kv_dtype_ok(be, BACKEND_F16));
    assert_int_equal(backend_kv_dtype_default(be), BACKEND_F32);
    backend_close(be);
    backend_close(backend_cpu_default()); /* a no-op */
    backend_close(NULL);
    int dt;
    assert_int_equal(backend_dtype_parse("bfloat16", &dt), 0);
    assert_int_equal(dt, BACKEND_BF16);
    assert_int_equal(backend_dtype_parse("auto", &dt), 0);
    assert_int_equal(dt, -1);
    assert_int_equal(backend_dtype_parse("int8", &dt), -EINVAL);
    assert_string_equal(backend_dtype_name(BACKEND_F16), "float16");
}

/* backend_matmul_residual: resid += x . w^T against a double reference, at a prefill-sized T
 * (130: CUDA's fast mode folds the add into cuBLASLt's epilogue, beta = 1, when
 * backend_residual_fused says so) and a decode-sized one (3: the generic form, GEMM into the
 * scratch y then add), awkward N and K; the CPU always runs the generic form and says it is
 * not fused.  Tolerance: the f32 accumulation of K bf16-exact products, 1e-4 relative (as
 * matmul's); bad arguments (resid == y or x) are refused. */
static void test_matmul_residual(void **state) {
    int shapes[][3] = {{130, 200, 72}, {3, 200, 72}, {97, 52, 136}};
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype mm = backend_mm_dtype(be), a = backend_act_dtype(be);
        test_batch tb;
        int start[1] = {0}, n_new[1] = {130};
        make_batch(&tb, 1, start, n_new, 16, 16, 10);
        assert_int_equal(backend_plan(st, &tb.b), 0);
        if (backend_is_cpu(be)) assert_int_equal(backend_residual_fused(st, 130), 0);
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            int T = shapes[k][0], N = shapes[k][1], K = shapes[k][2];
            uint16_t *hw = malloc(sizeof(uint16_t) * N * K);
            float *fw = malloc(sizeof(float) * N * K);
            assert_non_null(hw), assert_non_null(fw);
            bf16_mat(hw, fw, (size_t)N * K);
            backend_dtype sw;
            backend_buffer *bw = backend_weights_load(be, hw, BACKEND_BF16, (size_t)N * K, &sw);
            assert_non_null(bw);
            float *x = rand_vec((size_t)T * K, BACKEND_BF16), *r = rand_vec((size_t)T * N, a);
            backend_buffer *bx = to_dev(st, x, (size_t)T * K, mm),
                           *br = to_dev(st, r, (size_t)T * N, a),
                           *by = backend_buffer_alloc(be, (size_t)T * N * backend_dtype_size(a), 0);
            backend_matmul_op op = {DEV(by), a, DEV(bx), mm, DEV(bw),           sw,
                                    NULL,    T, N,       K,  {NULL, 0, 0, NULL}};
            assert_int_equal(backend_matmul_residual(st, &op, DEV(br)), 0);
            float *got = from_dev(st, DEV(br), (size_t)T * N, a);
            double *want = malloc(sizeof(double) * T * N);
            for (int t = 0; t < T; t++)
                for (int n = 0; n < N; n++) {
                    double acc = 0;
                    for (int i = 0; i < K; i++)
                        acc += (double)x[(size_t)t * K + i] * fw[(size_t)n * K + i];
                    want[(size_t)t * N + n] = r[(size_t)t * N + n] + acc;
                }
            char what[96];
            snprintf(what, sizeof what, "matmul_residual T %d N %d K %d (fused %d)", T, N, K,
                     backend_residual_fused(st, T));
            check_close(what, be, got, want, (size_t)T * N, 1e-4);
            assert_int_equal(backend_matmul_residual(st, &op, DEV(by)), -EINVAL);
            assert_int_equal(backend_matmul_residual(st, &op, DEV(bx)), -EINVAL);
            backend_buffer_free(bx), backend_buffer_free(br), backend_buffer_free(by);
            backend_buffer_free(bw); /* before hw: the CPU backend aliases it */
            free(got), free(want), free(x), free(r), free(hw), free(fw);
        }
        backend_stream_free(st);
    }
}

/* backend_qkv on prefill-sized batches (T = 140 over two sequences, one with cached tokens: the
 * CUDA backend's q|k|v GEMM then writes bf16 and k_qkv_finish reads it, see cb_qkv), GQA 3:1,
 * head_dim 16 (a thread's RoPE pair fixed across heads: one cos / sin) and 24 (not), against
 * the double reference of test_fused_ops.  Tolerance: a GPU backend rounds the GEMM output to
 * bf16 before bias and RoPE (2^-8 of |q| ~ 4) and K/V again in the cache: 2e-2; the CPU 1e-4. */
static void test_qkv_prefill(void **state) {
    enum { H = 48, NH = 6, NKV = 2, L = 2, LAYER = 1, MAXHD = 24 };
    int hds[2] = {16, 24};
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be), mm = backend_mm_dtype(be),
                      kdt = backend_kv_dtype_default(be);
        int cat = backend_wants_cat(be);
        for (int hi = 0; hi < 2; hi++) {
            int HD = hds[hi], KVD = NKV * HD, NQ = NH * HD, W = NQ + 2 * KVD;
            test_batch tb;
            int start[2] = {0, 20}, n_new[2] = {100, 40};
            make_batch(&tb, 2, start, n_new, 16, 16, 10);
            assert_int_equal(backend_plan(st, &tb.b), 0);
            int T = tb.T;
            uint16_t *hw = malloc(sizeof(uint16_t) * W * H);
            float *fw = malloc(sizeof(float) * W * H);
            assert_non_null(hw), assert_non_null(fw);
            bf16_mat(hw, fw, (size_t)W * H);
            float bias[NH * MAXHD + 2 * NKV * MAXHD], inv[MAXHD / 2];
            for (int i = 0; i < W; i++)
                bias[i] = frand();
            for (int i = 0; i < HD / 2; i++)
                inv[i] = 1.0f / powf(10000.0f, (float)(2 * i) / HD);
            backend_dtype sw = BACKEND_BF16;
            backend_buffer *bw = NULL, *bqw = NULL, *bkw = NULL, *bvw = NULL;
            const void *wq, *wk, *wv, *wqkv = NULL;
            if (cat) {
                const void *s3[3] = {hw, hw + (size_t)NQ * H, hw + (size_t)(NQ + KVD) * H};
                backend_dtype d3[3] = {BACKEND_BF16, BACKEND_BF16, BACKEND_BF16};
                size_t n3[3] = {(size_t)NQ * H, (size_t)KVD * H, (size_t)KVD * H};
                assert_non_null(bw = backend_weights_load_cat(be, s3, d3, n3, 3, &sw));
                wqkv = DEV(bw);
                size_t es = backend_dtype_size(sw);
                wq = wqkv, wk = (const char *)wqkv + (size_t)NQ * H * es;
                wv = (const char *)wk + (size_t)KVD * H * es;
            } else {
                assert_non_null(
                    bqw = backend_weights_load(be, hw, BACKEND_BF16, (size_t)NQ * H, &sw));
                assert_non_null(bkw = backend_weights_load(be, hw + (size_t)NQ * H, BACKEND_BF16,
                                                           (size_t)KVD * H, &sw));
                assert_non_null(bvw = backend_weights_load(be, hw + (size_t)(NQ + KVD) * H,
                                                           BACKEND_BF16, (size_t)KVD * H, &sw));
                wq = DEV(bqw), wk = DEV(bkw), wv = DEV(bvw);
            }
            backend_buffer *bbias = to_dev(st, bias, W, BACKEND_F32),
                           *binv = to_dev(st, inv, HD / 2, BACKEND_F32);
            const float *dbias = DEV(bbias);
            float *xb = rand_vec((size_t)T * H, BACKEND_BF16);
            backend_buffer *bx = to_dev(st, xb, (size_t)T * H, mm);
            backend_kv kv = {NULL, kdt, tb.n_blocks, tb.bs, L, NKV, HD, 0, NULL, NULL};
            size_t n_el = backend_kv_block_bytes(&kv) / backend_dtype_size(kdt) * kv.n_blocks;
            backend_buffer *region =
                backend_buffer_alloc(be, n_el * backend_dtype_size(kdt), BACKEND_BUF_KV);
            kv.base = DEV(region);
            backend_buffer *bqo =
                               backend_buffer_alloc(be, (size_t)T * NQ * backend_dtype_size(a), 0),
                           *bks =
                               backend_buffer_alloc(be, (size_t)T * KVD * backend_dtype_size(a), 0),
                           *bvs =
                               backend_buffer_alloc(be, (size_t)T * KVD * backend_dtype_size(a), 0);
            backend_qkv_op op = {.x = DEV(bx),
                                 .x_dt = mm,
                                 .T = T,
                                 .hidden = H,
                                 .n_heads = NH,
                                 .wq = wq,
                                 .wk = wk,
                                 .wv = wv,
                                 .w_dt = sw,
                                 .bq = dbias,
                                 .bk = dbias + NQ,
                                 .bv = dbias + NQ + KVD,
                                 .wqkv = wqkv,
                                 .bqkv = wqkv ? dbias : NULL,
                                 .q = DEV(bqo),
                                 .k = DEV(bks),
                                 .v = DEV(bvs),
                                 .dt = a,
                                 .inv_freq = DEV(binv),
                                 .kv = &kv,
                                 .layer = LAYER};
            assert_int_equal(backend_qkv(st, &op), 0);
            float *gq = from_dev(st, DEV(bqo), (size_t)T * NQ, a),
                  *gkv = from_dev(st, kv.base, n_el, kdt);
            double *wq_ = calloc((size_t)T * NQ, sizeof(double)),
                   *wkv = calloc(n_el, sizeof(double));
            double *row = malloc(sizeof(double) * W);
            assert_non_null(wq_), assert_non_null(wkv), assert_non_null(row);
            for (int t = 0; t < T; t++) {
                for (int n = 0; n < W; n++) {
                    double acc = bias[n];
                    for (int i = 0; i < H; i++)
                        acc += (double)xb[(size_t)t * H + i] * fw[(size_t)n * H + i];
                    row[n] = acc;
                }
                int p = tb.tok_pos[t];
                for (int hh = 0; hh < NH + NKV; hh++)
                    for (int i = 0; i < HD / 2; i++) {
                        float ang = (float)p * inv[i];
                        double c = cos(ang), sn = sin(ang), u = row[hh * HD + i],
                               w = row[hh * HD + i + HD / 2];
                        row[hh * HD + i] = u * c - w * sn;
                        row[hh * HD + i + HD / 2] = w * c + u * sn;
                    }
                for (int n = 0; n < NQ; n++)
                    wq_[(size_t)t * NQ + n] = row[n];
                int s = tb.tok_seq[t], blk = tb.bt[tb.bt_ptr[s] + p / kv.block_size],
                    slot = p % kv.block_size;
                for (int hh = 0; hh < NKV; hh++)
                    for (int d = 0; d < HD; d++) {
                        wkv[kv_index(&kv, blk, LAYER, 0, slot, hh, d)] = row[NQ + hh * HD + d];
                        wkv[kv_index(&kv, blk, LAYER, 1, slot, hh, d)] =
                            row[NQ + KVD + hh * HD + d];
                    }
            }
            char what[96];
            snprintf(what, sizeof what, "qkv prefill (head_dim %d): q (bias, RoPE)", HD);
            check_close(what, be, gq, wq_, (size_t)T * NQ, backend_is_cpu(be) ? 1e-4 : 2e-2);
            snprintf(what, sizeof what, "qkv prefill (head_dim %d): K/V in the cache", HD);
            check_close(what, be, gkv, wkv, n_el, backend_is_cpu(be) ? 1e-4 : 2e-2);
            backend_buffer *bufs[] = {bw, bqw, bkw, bvw, bbias, binv, bx, region, bqo, bks, bvs};
            for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
                backend_buffer_free(bufs[i]);
            free(gq), free(gkv), free(wq_), free(wkv), free(row), free(xb), free(hw), free(fw);
        }
        backend_stream_free(st);
    }
}

/* ==== CUDA mixture of experts (kernels/cuda/cuda_moe.cu) ====================================
 * backend_moe_route and backend_moe on every non-CPU backend against host references written
 * here: the routing's f32 arithmetic as backend.h specifies it (ties included), and the experts
 * in double over the same bf16 values (h rounded to bf16 as the device keeps it).  Each expert
 * case runs on both CUDA paths (DISAGG_CUDA_MOE_DEC_PAIRS=1024: the decode GEMVs where
 * T * top_k <= 1024 and at most 4 pairs an expert on average; =0: the grouped GEMM) with random and skewed routing (every token on the
 * same top_k experts, the others empty). */

/* the routing of one row as backend.h specifies it (f32, expert order, ties: lower first) */
static void moe_route_ref(const float *l, int E, int k, int norm, int32_t *ids, float *w,
                          float *p) {
    float m = -INFINITY, sum = 0.0f;
    for (int e = 0; e < E; e++)
        m = l[e] > m ? l[e] : m;
    for (int e = 0; e < E; e++) {
        p[e] = expf(l[e] - m);
        sum += p[e];
    }
    for (int e = 0; e < E; e++)
        p[e] = p[e] / sum;
    unsigned char used[BACKEND_MOE_MAX_EXPERTS] = {0};
    float tot = 0.0f;
    for (int j = 0; j < k; j++) {
        int be = -1;
        for (int e = 0; e < E; e++)
            if (!used[e] && (be < 0 || p[e] > p[be])) be = e;
        used[be] = 1;
        ids[j] = be;
        w[j] = p[be];
    }
    if (norm) {
        for (int j = 0; j < k; j++)
            tot += w[j];
        for (int j = 0; j < k; j++)
            w[j] = w[j] / tot;
    }
}

static void test_moe_route_cuda(void **state) {
    (void)state;
    setenv("DISAGG_MOE_GENERIC", "0", 1); /* the CUDA kernels (opt-in by default) */
    int Ts[] = {1, 7, 300}, Es[] = {8, 128, 512}, ks[] = {2, 8};
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        if (backend_is_cpu(be)) continue;
        backend_stream *st = backend_stream_create(be);
        for (size_t ti = 0; ti < 3; ti++)
            for (size_t ei = 0; ei < 3; ei++)
                for (size_t ki = 0; ki < 2; ki++)
                    for (int norm = 0; norm < 2; norm++) {
                        int T = Ts[ti], E = Es[ei], k = ks[ki];
                        float *lg = malloc(sizeof(float) * T * E);
                        for (int i = 0; i < T * E; i++)
                            lg[i] = frand() * 4.0f;
                        for (int t = 0; t < T; t++) { /* exact ties: copies of another logit */
                            float *r = lg + (size_t)t * E;
                            for (int q = 0; q < 3; q++)
                                r[irand(E)] = r[irand(E)];
                            if (t % 3 == 0) r[E - 1] = r[0] = 9.0f; /* a tie at the top */
                        }
                        backend_buffer *bl = to_dev(st, lg, (size_t)T * E, BACKEND_F32),
                                       *bid = backend_buffer_alloc(be, sizeof(int32_t) * T * k, 0),
                                       *bw = backend_buffer_alloc(be, sizeof(float) * T * k, 0);
                        assert_int_equal(
                            backend_moe_route(st, DEV(bid), DEV(bw), DEV(bl), T, E, k, norm), 0);
                        assert_int_equal(backend_stream_sync(st), 0);
                        int32_t *gid = malloc(sizeof(int32_t) * T * k);
                        float *gw = malloc(sizeof(float) * T * k);
                        assert_int_equal(
                            backend_download(st, gid, DEV(bid), sizeof(int32_t) * T * k), 0);
                        assert_int_equal(backend_download(st, gw, DEV(bw), sizeof(float) * T * k),
                                         0);
                        int32_t rid[BACKEND_MOE_MAX_EXPERTS];
                        float rw[BACKEND_MOE_MAX_EXPERTS], p[BACKEND_MOE_MAX_EXPERTS];
                        for (int t = 0; t < T; t++) {
                            moe_route_ref(lg + (size_t)t * E, E, k, norm, rid, rw, p);
                            for (int j = 0; j < k; j++) {
                                int g = gid[t * k + j], r = rid[j];
                                /* the device's expf may differ from the host's by an ulp or
                                 * two: a different choice only between p equal to 2e-6 */
                                if (g != r &&
                                    !(g >= 0 && g < E && fabsf(p[g] - p[r]) <= 2e-6f * p[r]))
                                    fail_msg("moe_route T %d E %d k %d norm %d: row %d slot %d "
                                             "chose expert %d (p %.9g), reference %d (p %.9g)",
                                             T, E, k, norm, t, j, g, g >= 0 && g < E ? p[g] : -1.0,
                                             r, p[r]);
                                double d = fabs((double)gw[t * k + j] - rw[j]);
                                if (!(d <= 1e-5 * (1.0 + fabs(rw[j]))))
                                    fail_msg("moe_route T %d E %d k %d norm %d: row %d slot %d "
                                             "weight %.9g, reference %.9g",
                                             T, E, k, norm, t, j, gw[t * k + j], rw[j]);
                            }
                            if (t % 3 == 0 && (gid[t * k] != 0 || gid[t * k + 1] != E - 1))
                                fail_msg("moe_route E %d: a tie at the top must give experts 0 "
                                         "then %d, got %d then %d",
                                         E, E - 1, gid[t * k], gid[t * k + 1]);
                        }
                        free(lg), free(gid), free(gw);
                        backend_buffer_free(bl), backend_buffer_free(bid), backend_buffer_free(bw);
                    }
        /* bad arguments: top_k past n_experts, n_experts past the limit */
        backend_buffer *b = backend_buffer_alloc(be, 4096, 0);
        assert_int_equal(backend_moe_route(st, DEV(b), DEV(b), DEV(b), 1, 4, 5, 1), -EINVAL);
        assert_int_equal(
            backend_moe_route(st, DEV(b), DEV(b), DEV(b), 1, BACKEND_MOE_MAX_EXPERTS + 1, 2, 1),
            -EINVAL);
        backend_buffer_free(b);
        backend_stream_free(st);
    }
}

/* one backend_moe case: T tokens, E experts of (hidden H, inter I), top_k; skew: every token
 * routed to experts 3 .. 3 + k - 1 (mod E); x_dt / out_dt as given */
static void moe_case(backend *be, backend_stream *st, int T, int E, int k, int H, int I, int skew,
                     backend_dtype x_dt, backend_dtype out_dt) {
    size_t ngu = (size_t)E * 2 * I * H, nd = (size_t)E * H * I;
    uint16_t *hgu = malloc(sizeof(uint16_t) * ngu), *hd = malloc(sizeof(uint16_t) * nd);
    float *fgu = malloc(sizeof(float) * ngu), *fd = malloc(sizeof(float) * nd);
    assert_non_null(hgu), assert_non_null(hd), assert_non_null(fgu), assert_non_null(fd);
    bf16_mat(hgu, fgu, ngu);
    bf16_mat(hd, fd, nd);
    backend_dtype sgu, sd;
    backend_buffer *bgu = backend_weights_load(be, hgu, BACKEND_BF16, ngu, &sgu),
                   *bd = backend_weights_load(be, hd, BACKEND_BF16, nd, &sd);
    assert_non_null(bgu), assert_non_null(bd);
    float *lg = malloc(sizeof(float) * T * E);
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++)
            lg[(size_t)t * E + e] = frand() * 2.0f;
    if (skew)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++)
                lg[(size_t)t * E + (3 + j) % E] = 20.0f - j;
    float *x = rand_vec((size_t)T * H, BACKEND_BF16);
    backend_buffer *bx = to_dev(st, x, (size_t)T * H, x_dt),
                   *bl = to_dev(st, lg, (size_t)T * E, BACKEND_F32),
                   *bid = backend_buffer_alloc(be, sizeof(int32_t) * T * k, 0),
                   *bw = backend_buffer_alloc(be, sizeof(float) * T * k, 0),
                   *bo = backend_buffer_alloc(be, (size_t)T * H * backend_dtype_size(out_dt), 0);
    assert_int_equal(backend_moe_route(st, DEV(bid), DEV(bw), DEV(bl), T, E, k, 1), 0);
    assert_int_equal(backend_stream_sync(st), 0);
    int32_t *ids = malloc(sizeof(int32_t) * T * k);
    float *wts = malloc(sizeof(float) * T * k);
    assert_int_equal(backend_download(st, ids, DEV(bid), sizeof(int32_t) * T * k), 0);
    assert_int_equal(backend_download(st, wts, DEV(bw), sizeof(float) * T * k), 0);
    /* the reference: per token, its experts in ascending index, h rounded to bf16; ulp_y: the
     * sum over the token's experts of weight * one bf16 ulp of that expert's down row (the
     * grouped GEMM with bf16 down rows rounds each before the weighted sum: |y| ~ 20 at these
     * sizes, an ulp of 0.125 and more, past 1e-2 of a small sum) */
    /* flip_y: the sum over the token's experts of weight * |down row| * the bf16 step of each h
     * whose rounding the device's f32 sums could send the other way (its f32 error bound
     * straddles a bf16 rounding midpoint; one such flip of an h ~ 10 moves y by ~0.01) */
    double *want = calloc((size_t)T * H, sizeof(double)),
           *ulp_y = calloc((size_t)T * H, sizeof(double)),
           *flip_y = calloc((size_t)T * H, sizeof(double)),
           *slack = calloc((size_t)T * H, sizeof(double)), *hflip = malloc(sizeof(double) * I);
    float *hh = malloc(sizeof(float) * I);
    for (int t = 0; t < T; t++) {
        int order[BACKEND_MOE_MAX_EXPERTS];
        for (int j = 0; j < k; j++)
            order[j] = j;
        for (int a = 1; a < k; a++) /* insertion sort by expert id */
            for (int b2 = a; b2 > 0 && ids[t * k + order[b2]] < ids[t * k + order[b2 - 1]]; b2--) {
                int q = order[b2];
                order[b2] = order[b2 - 1], order[b2 - 1] = q;
            }
        for (int q = 0; q < k; q++) {
            int j = order[q], e = ids[t * k + j];
            assert_true(e >= 0 && e < E);
            const float *g = fgu + (size_t)e * 2 * I * H, *u = g + (size_t)I * H,
                        *dn = fd + (size_t)e * H * I, *xr = x + (size_t)t * H;
            for (int i = 0; i < I; i++) {
                double gg = 0, uu = 0, ag = 0, au = 0;
                for (int c = 0; c < H; c++) {
                    gg += (double)xr[c] * g[(size_t)i * H + c];
                    uu += (double)xr[c] * u[(size_t)i * H + c];
                    ag += fabs((double)xr[c] * g[(size_t)i * H + c]);
                    au += fabs((double)xr[c] * u[(size_t)i * H + c]);
                }
                double sg = gg / (1.0 + exp(-gg)), hv = sg * uu;
                /* f32 sums over H terms: |error| <= H * 2^-24 * sum |terms| (loose by 4x
                 * more); silu' is at most 1.1 */
                double err = 4.0 * H * ldexp(1.0, -24) * (ag * 1.1 * fabs(uu) + fabs(sg) * au) +
                             ldexp(fabs(hv), -20);
                hh[i] = bf16_to_f32(f32_to_bf16((float)hv));
                hflip[i] = fabs((double)bf16_to_f32(f32_to_bf16((float)(hv + err))) -
                                bf16_to_f32(f32_to_bf16((float)(hv - err))));
            }
            for (int r = 0; r < H; r++) {
                double y = 0, fl = 0;
                for (int i = 0; i < I; i++) {
                    y += (double)dn[(size_t)r * I + i] * hh[i];
                    fl += fabs((double)dn[(size_t)r * I + i]) * hflip[i];
                }
                want[(size_t)t * H + r] += (double)wts[t * k + j] * y;
                flip_y[(size_t)t * H + r] += fabs((double)wts[t * k + j]) * fl;
                int ex;
                frexp(y, &ex); /* |y| in [2^(ex-1), 2^ex): a bf16 ulp is 2^(ex-8) */
                ulp_y[(size_t)t * H + r] += fabs((double)wts[t * k + j]) * ldexp(1.0, ex - 8);
            }
        }
    }
    /* 0: the decode GEMVs (with the fused down + sum where T * top_k <= 16), 1: the grouped
     * GEMM, 2: the decode GEMVs with the separate down and k_moe_combine (T * top_k <= 16
     * only), 3: the grouped GEMM with the down rows in bf16 */
    for (int pi = 0; pi < 4; pi++) {
        if (pi == 2 && (long)T * k > 16) continue;
        setenv("DISAGG_CUDA_MOE_DEC_PAIRS", pi == 1 || pi == 3 ? "0" : "1024", 1);
        setenv("DISAGG_CUDA_MOE_FUSED_DOWN", pi == 2 ? "0" : "1", 1);
        setenv("DISAGG_CUDA_MOE_Y_BF16", pi == 3 ? "1" : "0", 1);
        backend_moe_op op = {.x = DEV(bx),
                             .x_dt = x_dt,
                             .T = T,
                             .hidden = H,
                             .inter = I,
                             .n_experts = E,
                             .top_k = k,
                             .ids = DEV(bid),
                             .weights = DEV(bw),
                             .w_gate_up_all = DEV(bgu),
                             .w_down_all = DEV(bd),
                             .w_dt = sgu,
                             .out = DEV(bo),
                             .out_dt = out_dt};
        char what[160];
        snprintf(what, sizeof what, "moe (%s) T %d E %d top_k %d H %d I %d%s x %s out %s",
                 pi == 3                         ? "grouped GEMM, bf16 down rows"
                 : (long)T * k > 1024 || pi == 1 ? "grouped GEMM"
                 : pi == 2                       ? "decode GEMVs, separate sum"
                                                 : "decode GEMVs",
                 T, E, k, H, I, skew ? " skewed" : "", x_dt == BACKEND_BF16 ? "bf16" : "f32",
                 out_dt == BACKEND_BF16 ? "bf16" : "f32");
        float *got[2];
        for (int rep = 0; rep < 2; rep++) {
            assert_int_equal(backend_moe(st, &op), 0);
            got[rep] = from_dev(st, DEV(bo), (size_t)T * H, out_dt);
        }
        /* bf16 h on both sides; f32 accumulation over H and I; a bf16 output rounded; bf16
         * down rows: up to half an ulp of each (one allowed) */
        for (size_t q = 0; q < (size_t)T * H; q++)
            slack[q] = flip_y[q] + (pi == 3 ? ulp_y[q] : 0.0);
        check_close_slack(what, be, got[0], want, slack, (size_t)T * H, 1e-2);
        /* the same call again gives the same bits (no float atomics; the sort's order inside
         * an expert's group does not reach the result) */
        if (memcmp(got[0], got[1], sizeof(float) * T * H))
            fail_msg("%s: a second identical call gave other bits", what);
        free(got[0]), free(got[1]);
    }
    unsetenv("DISAGG_CUDA_MOE_DEC_PAIRS");
    unsetenv("DISAGG_CUDA_MOE_FUSED_DOWN");
    unsetenv("DISAGG_CUDA_MOE_Y_BF16");
    free(hgu), free(hd), free(fgu), free(fd), free(lg), free(x), free(ids), free(wts), free(want),
        free(ulp_y), free(flip_y), free(slack), free(hflip), free(hh);
    backend_buffer *bufs[] = {bgu, bd, bx, bl, bid, bw, bo};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        backend_buffer_free(bufs[i]);
}

/* the routing and the experts recorded in a CUDA graph (a decode step's padding batch of T
 * one-token sequences) and replayed: the same bits as the eager calls, on the decode path */
static void moe_graph_case(backend *be, backend_stream *st, int T, int E, int k, int H, int I) {
    if (!backend_graph_supported(be)) return;
    size_t ngu = (size_t)E * 2 * I * H, nd = (size_t)E * H * I;
    uint16_t *hw = malloc(sizeof(uint16_t) * ngu);
    float *fw = malloc(sizeof(float) * ngu);
    assert_non_null(hw), assert_non_null(fw);
    backend_dtype sgu, sd;
    bf16_mat(hw, fw, ngu);
    backend_buffer *bgu = backend_weights_load(be, hw, BACKEND_BF16, ngu, &sgu);
    bf16_mat(hw, fw, nd);
    backend_buffer *bd = backend_weights_load(be, hw, BACKEND_BF16, nd, &sd);
    assert_non_null(bgu), assert_non_null(bd);
    float *lg = rand_vec((size_t)T * E, BACKEND_F32), *x = rand_vec((size_t)T * H, BACKEND_BF16);
    backend_buffer *bl = to_dev(st, lg, (size_t)T * E, BACKEND_F32),
                   *bx = to_dev(st, x, (size_t)T * H, BACKEND_BF16),
                   *bid = backend_buffer_alloc(be, sizeof(int32_t) * T * k, 0),
                   *bw = backend_buffer_alloc(be, sizeof(float) * T * k, 0),
                   *bo = backend_buffer_alloc(be, sizeof(float) * T * H, 0);
    backend_moe_op op = {.x = DEV(bx),
                         .x_dt = BACKEND_BF16,
                         .T = T,
                         .hidden = H,
                         .inter = I,
                         .n_experts = E,
                         .top_k = k,
                         .ids = DEV(bid),
                         .weights = DEV(bw),
                         .w_gate_up_all = DEV(bgu),
                         .w_down_all = DEV(bd),
                         .w_dt = sgu,
                         .out = DEV(bo),
                         .out_dt = BACKEND_F32};
    assert_int_equal(backend_moe_route(st, DEV(bid), DEV(bw), DEV(bl), T, E, k, 1), 0);
    assert_int_equal(backend_moe(st, &op), 0);
    float *want = from_dev(st, DEV(bo), (size_t)T * H, BACKEND_F32);
    int32_t z[64] = {0}, qo[65], pos[64], seq[64], btp[65] = {0};
    assert_true(T <= 64);
    for (int t = 0; t < T; t++)
        qo[t] = t, pos[t] = -1, seq[t] = t;
    qo[T] = T;
    backend_batch b = {T, T, z, seq, pos, qo, z, btp, z, T, qo};
    for (int pass = 0; pass < 3; pass++) { /* warm-up, record (+ launch), replay */
        assert_int_equal(backend_memset_zero(st, DEV(bo), sizeof(float) * T * H), 0);
        assert_int_equal(backend_graph_plan(st, &b, 1, 1), 0);
        int g = backend_graph_begin(st);
        assert_true(g == (pass == 2));
        if (g == 0) {
            int rc = backend_moe_route(st, DEV(bid), DEV(bw), DEV(bl), T, E, k, 1);
            if (!rc) rc = backend_moe(st, &op);
            assert_int_equal(rc, 0);
            assert_int_equal(backend_graph_end(st, 1), 0);
        }
        float *got = from_dev(st, DEV(bo), (size_t)T * H, BACKEND_F32);
        if (memcmp(got, want, sizeof(float) * T * H))
            fail_msg("moe in a CUDA graph (T %d, pass %d): other bits than the eager calls", T,
                     pass);
        free(got);
    }
    backend_graph_reset(st);
    free(hw), free(fw), free(lg), free(x), free(want);
    backend_buffer *bufs[] = {bgu, bd, bl, bx, bid, bw, bo};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        backend_buffer_free(bufs[i]);
}

static void test_moe_cuda(void **state) {
    (void)state;
    setenv("DISAGG_MOE_GENERIC", "0", 1); /* the CUDA kernels (opt-in by default) */
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        if (backend_is_cpu(be)) continue;
        backend_stream *st = backend_stream_create(be);
        int Ts[] = {1, 7, 64, 300}, Es[] = {8, 128}, ks[] = {2, 8};
        int n = 0;
        for (size_t ti = 0; ti < 4; ti++)
            for (size_t ei = 0; ei < 2; ei++)
                for (size_t ki = 0; ki < 2; ki++)
                    for (int skew = 0; skew < 2; skew++, n++)
                        moe_case(be, st, Ts[ti], Es[ei], ks[ki], 64, 96, skew,
                                 n % 3 == 0 ? BACKEND_F32 : BACKEND_BF16,
                                 n % 2 ? BACKEND_BF16 : BACKEND_F32);
        /* long rows: hidden past one batch of a warp's loads (2080 = 8 x 260 uint4s), and
         * inter past it (the down GEMV's rows) */
        moe_case(be, st, 1, 8, 2, 2080, 96, 0, BACKEND_BF16, BACKEND_F32);
        moe_case(be, st, 7, 8, 2, 2080, 96, 1, BACKEND_BF16, BACKEND_F32);
        moe_case(be, st, 7, 8, 2, 64, 2080, 0, BACKEND_BF16, BACKEND_BF16);
        /* recorded in a CUDA graph: batch 1 and 7 (decode GEMVs), 64 (128 experts, top 8) */
        moe_graph_case(be, st, 1, 128, 8, 64, 96);
        moe_graph_case(be, st, 7, 8, 2, 64, 96);
        moe_graph_case(be, st, 64, 128, 8, 64, 96);
        /* hidden and inter multiples of 8, not of 32: the GEMM's last K step zero-filled */
        moe_case(be, st, 7, 8, 2, 72, 40, 0, BACKEND_F32, BACKEND_F32);
        moe_case(be, st, 300, 8, 2, 72, 40, 1, BACKEND_BF16, BACKEND_F32);
        /* what the CUDA kernels refuse (hidden not a multiple of 8): -ENOTSUP, not a crash */
        backend_buffer *b = backend_buffer_alloc(be, 1 << 16, BACKEND_BUF_ZERO); /* ids 0 */
        backend_moe_op op = {.x = DEV(b),
                             .x_dt = BACKEND_BF16,
                             .T = 1,
                             .hidden = 36,
                             .inter = 64,
                             .n_experts = 4,
                             .top_k = 2,
                             .ids = DEV(b),
                             .weights = DEV(b),
                             .w_gate_up_all = DEV(b),
                             .w_down_all = DEV(b),
                             .w_dt = BACKEND_BF16,
                             .out = DEV(b),
                             .out_dt = BACKEND_F32};
        int rc = backend_moe(st, &op);
        /* -ENOTSUP from the CUDA kernels; 0 where a generic form took it, -EINVAL where that
         * form wants the per-expert arrays: an error code, never a crash */
        assert_true(rc == -ENOTSUP || rc == 0 || rc == -EINVAL);
        assert_int_equal(backend_stream_sync(st), 0);
        op.top_k = 5; /* past n_experts */
        assert_int_equal(backend_moe(st, &op), -EINVAL);
        backend_buffer_free(b);
        backend_stream_free(st);
    }
}

/* ---- FP8 KV cache (e4m3, per-tensor scales) ------------------------------------------- */

/* region bytes of an FP8 KV (n bytes) downloaded */
static uint8_t *bytes_from_dev(backend_stream *st, const void *dev, size_t n) {
    assert_int_equal(backend_stream_sync(st), 0);
    uint8_t *b = malloc(n);
    assert_non_null(b);
    assert_int_equal(backend_download(st, b, dev, n), 0);
    return b;
}

/* kv_write into an FP8 region: every byte is kernels/fp8.h's e4m3(x / scale) (nearest even,
 * saturated to +-448: values up to 1.5 x 448 x scale are written); layers with different
 * scales */
static void test_fp8_kv_write(void **state) {
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        assert_true(backend_kv_dtype_ok(be, BACKEND_F8E4M3));
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be);
        float ks[3] = {1.0f, 0.0375f, 2.5f}, vs[3] = {0.5f, 0.011f, 1.0f};
        backend_kv kv = {NULL, BACKEND_F8E4M3, 12, 5, 3, 2, 6, 0, ks, vs};
        size_t n_el = backend_kv_block_bytes(&kv) * kv.n_blocks;
        assert_int_equal(backend_kv_block_bytes(&kv), (size_t)3 * 2 * 5 * 2 * 6);
        backend_buffer *region = backend_buffer_alloc(be, n_el, BACKEND_BUF_KV);
        assert_non_null(region);
        kv.base = DEV(region);
        test_batch tb;
        int start[3] = {0, 7, 3}, n_new[3] = {9, 1, 2};
        make_batch(&tb, 3, start, n_new, kv.block_size, kv.n_blocks, 10);
        assert_int_equal(backend_plan(st, &tb.b), 0);
        int kvd = kv.n_kv_heads * kv.head_dim;
        for (int layer = 0; layer < 3; layer++) {
            float *k = rand_vec((size_t)tb.T * kvd, a), *v = rand_vec((size_t)tb.T * kvd, a);
            for (int i = 0; i < tb.T * kvd; i++) /* across the range, some past 448 x scale */
                k[i] *= 672.0f * ks[layer] * (float)urand(), v[i] *= 672.0f * vs[layer];
            backend_buffer *bk = to_dev(st, k, (size_t)tb.T * kvd, a),
                           *bv = to_dev(st, v, (size_t)tb.T * kvd, a);
            assert_int_equal(backend_kv_write(st, &kv, layer, DEV(bk), DEV(bv), a), 0);
            uint8_t *got = bytes_from_dev(st, kv.base, n_el);
            for (int t = 0; t < tb.T; t++) {
                int s = tb.tok_seq[t], p = tb.tok_pos[t];
                int blk = tb.bt[tb.bt_ptr[s] + p / kv.block_size], slot = p % kv.block_size;
                for (int e = 0; e < kvd; e++)
                    for (int which = 0; which < 2; which++) {
                        size_t at = kv_index(&kv, blk, layer, which, slot, e / kv.head_dim,
                                             e % kv.head_dim);
                        float x = (which ? v : k)[t * kvd + e];
                        uint8_t want = fp8_e4m3_from_f32(x / (which ? vs : ks)[layer]);
                        if (got[at] != want)
                            fail_msg("fp8 kv_write on %s: layer %d %s of token %d element %d: "
                                     "byte 0x%02x, e4m3(%.9g / %g) is 0x%02x",
                                     backend_name(be), layer, which ? "V" : "K", t, e, got[at],
                                     (double)x, (double)(which ? vs : ks)[layer], want);
                        got[at] = 0;
                    }
            }
            free(got), free(k), free(v);
            backend_buffer_free(bk), backend_buffer_free(bv);
        }
        backend_buffer_free(region);
        backend_stream_free(st);
    }
}

/* attention over an FP8 region (random e4m3 bytes, values about +-2 after the scale) against
 * a reference that dequantizes (e4m3 * scale in double): decode, prefill tiles and a mixed
 * batch, GQA, head_dim 128/64/32/16 (the CUDA tensor-core decode, the 128-row prefill
 * kernels and the scalar kernel), block sizes 16 and 5 */
static void fp8_attention_case(backend *be, int S, const int *start, const int *n_new,
                               int n_kv_heads, int group, int hd, int bs) {
    backend_stream *st = backend_stream_create(be);
    backend_dtype a = backend_act_dtype(be);
    int total_blocks = 0;
    for (int s = 0; s < S; s++)
        total_blocks += (start[s] + n_new[s] + bs - 1) / bs;
    float ks[2] = {0.7f, 0.0139f}, vs[2] = {3.0f, 0.0217f};
    backend_kv kv = {NULL, BACKEND_F8E4M3, total_blocks + 3, bs, 2, n_kv_heads, hd, 0, ks, vs};
    size_t n_el = backend_kv_block_bytes(&kv) * kv.n_blocks;
    test_batch tb;
    make_batch(&tb, S, start, n_new, bs, kv.n_blocks, 10);
    int layer = 1, nh = n_kv_heads * group;
    uint8_t *region = malloc(n_el);
    assert_non_null(region);
    for (size_t i = 0; i < n_el; i++) { /* K of layer 1 ~ +-2 / 0.0139, V ~ +-2 / 0.0217 */
        uint8_t b = fp8_e4m3_from_f32(frand() * 2.0f / 0.0139f);
        region[i] = b;
    }
    backend_buffer *breg = backend_buffer_alloc(be, n_el, BACKEND_BUF_KV);
    assert_non_null(breg);
    assert_int_equal(backend_upload(st, DEV(breg), region, n_el), 0);
    kv.base = DEV(breg);
    float *q = rand_vec((size_t)tb.T * nh * hd, a);
    round_to(q, (size_t)tb.T * nh * hd, a);
    backend_buffer *bq = to_dev(st, q, (size_t)tb.T * nh * hd, a),
                   *bo = backend_buffer_alloc(be, (size_t)tb.T * nh * hd * 4, 0);
    assert_int_equal(backend_plan(st, &tb.b), 0);
    const float scale = (float)(1.0 / sqrt((double)hd));
    assert_int_equal(backend_attention(st, DEV(bo), DEV(bq), a, &kv, layer, nh, scale), 0);
    double *want = calloc((size_t)tb.T * nh * hd, sizeof(double));
    double *sc = malloc(sizeof(double) * 8192);
    assert_non_null(want), assert_non_null(sc);
    for (int t = 0; t < tb.T; t++) {
        int s = tb.tok_seq[t], p = tb.tok_pos[t];
        for (int h = 0; h < nh; h++) {
            int kh = h / group;
            const float *qq = q + ((size_t)t * nh + h) * hd;
            double mx = -INFINITY, sum = 0;
            for (int j = 0; j <= p; j++) {
                int blk = tb.bt[tb.bt_ptr[s] + j / bs];
                double d = 0;
                for (int i = 0; i < hd; i++)
                    d += (double)qq[i] *
                         ((double)fp8_e4m3_to_f32(region[kv_index(&kv, blk, layer, 0, j % bs, kh, i)]) *
                          ks[layer]);
                sc[j] = d * scale;
                if (sc[j] > mx) mx = sc[j];
            }
            for (int j = 0; j <= p; j++)
                sum += (sc[j] = exp(sc[j] - mx));
            double *o = want + ((size_t)t * nh + h) * hd;
            for (int j = 0; j <= p; j++) {
                int blk = tb.bt[tb.bt_ptr[s] + j / bs];
                for (int i = 0; i < hd; i++)
                    o[i] += sc[j] / sum *
                            ((double)fp8_e4m3_to_f32(region[kv_index(&kv, blk, layer, 1, j % bs, kh, i)]) *
                             vs[layer]);
            }
        }
    }
    float *got = from_dev(st, DEV(bo), (size_t)tb.T * nh * hd, a);
    char what[128];
    snprintf(what, sizeof what, "fp8 KV attention (%d seqs, %d kv heads x group %d, hd %d, bs %d)",
             S, n_kv_heads, group, hd, bs);
    /* CPU: dequantized to f32, then the f32 kernels; CUDA: the e4m3 values exactly in bf16, q
     * (times k_scale) and the softmax weights rounded to bf16 for the tensor cores */
    check_close(what, be, got, want, (size_t)tb.T * nh * hd, backend_is_cpu(be) ? 2e-5 : 2e-2);
    free(got), free(want), free(sc), free(q), free(region);
    backend_buffer_free(bq), backend_buffer_free(bo), backend_buffer_free(breg);
    backend_stream_free(st);
}

static void test_fp8_kv_attention(void **state) {
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        int s1[1] = {300}, n1[1] = {1}; /* decode */
        fp8_attention_case(be, 1, s1, n1, 2, 7, 128, 16);
        fp8_attention_case(be, 1, s1, n1, 2, 2, 64, 16);
        fp8_attention_case(be, 1, s1, n1, 1, 3, 32, 5);
        int s2[1] = {0}, n2[1] = {150}; /* prefill: one full tile and a partial one */
        fp8_attention_case(be, 1, s2, n2, 2, 7, 128, 16);
        fp8_attention_case(be, 1, s2, n2, 2, 2, 64, 16);
        fp8_attention_case(be, 1, s2, n2, 1, 2, 32, 16);
        fp8_attention_case(be, 1, s2, n2, 2, 2, 16, 16);
        int s3[3] = {77, 400, 0}, n3[3] = {40, 1, 20}; /* chunk mid-block, decode, prefill */
        fp8_attention_case(be, 3, s3, n3, 2, 7, 128, 16);
        fp8_attention_case(be, 3, s3, n3, 2, 3, 64, 5);
        fp8_attention_case(be, 3, s3, n3, 2, 3, 24, 5);
    }
}

/* The attention block's fused input op (backend_qkv) into an FP8 region: the bytes equal
 * e4m3(x / scale) of what the same op writes into an f32 region -- on CUDA the decode GEMV's
 * epilogue (1 token), k_qkv_finish (3), k_qkv_finish_vec2 (140, bf16 GEMM output) and the
 * Qwen3 q/k norm path; on the CPU the generic form (kv_write). */
static void test_fp8_kv_qkv(void **state) {
    enum { H = 48, NH = 6, NKV = 2, L = 2, LAYER = 1, HD = 16 };
    int KVD = NKV * HD, NQ = NH * HD, W = NQ + 2 * KVD;
    for (int bi = 0; bi < g_n_be; bi++) {
        backend *be = g_be[bi];
        backend_stream *st = backend_stream_create(be);
        backend_dtype a = backend_act_dtype(be), mm = backend_mm_dtype(be);
        int cat = backend_wants_cat(be);
        uint16_t *hw = malloc(sizeof(uint16_t) * W * H);
        float *fw = malloc(sizeof(float) * W * H);
        assert_non_null(hw), assert_non_null(fw);
        bf16_mat(hw, fw, (size_t)W * H);
        float bias[NH * HD + 2 * NKV * HD], inv[HD / 2], qn[HD], kn[HD];
        for (int i = 0; i < W; i++)
            bias[i] = frand() * 8.0f;
        for (int i = 0; i < HD / 2; i++)
            inv[i] = 1.0f / powf(10000.0f, (float)(2 * i) / HD);
        for (int i = 0; i < HD; i++)
            qn[i] = 1.0f + 0.5f * frand(), kn[i] = 1.0f + 0.5f * frand();
        backend_dtype sw = BACKEND_BF16;
        backend_buffer *bw = NULL, *bqw = NULL, *bkw = NULL, *bvw = NULL;
        const void *wq, *wk, *wv, *wqkv = NULL;
        if (cat) {
            const void *s3[3] = {hw, hw + (size_t)NQ * H, hw + (size_t)(NQ + KVD) * H};
            backend_dtype d3[3] = {BACKEND_BF16, BACKEND_BF16, BACKEND_BF16};
            size_t n3[3] = {(size_t)NQ * H, (size_t)KVD * H, (size_t)KVD * H};
            assert_non_null(bw = backend_weights_load_cat(be, s3, d3, n3, 3, &sw));
            wqkv = DEV(bw);
            size_t es = backend_dtype_size(sw);
            wq = wqkv, wk = (const char *)wqkv + (size_t)NQ * H * es;
            wv = (const char *)wk + (size_t)KVD * H * es;
        } else {
            assert_non_null(bqw = backend_weights_load(be, hw, BACKEND_BF16, (size_t)NQ * H, &sw));
            assert_non_null(bkw = backend_weights_load(be, hw + (size_t)NQ * H, BACKEND_BF16,
                                                       (size_t)KVD * H, &sw));
            assert_non_null(bvw = backend_weights_load(be, hw + (size_t)(NQ + KVD) * H,
                                                       BACKEND_BF16, (size_t)KVD * H, &sw));
            wq = DEV(bqw), wk = DEV(bkw), wv = DEV(bvw);
        }
        backend_buffer *bbias = to_dev(st, bias, W, BACKEND_F32),
                       *binv = to_dev(st, inv, HD / 2, BACKEND_F32),
                       *bqn = to_dev(st, qn, HD, BACKEND_F32), *bkn = to_dev(st, kn, HD, BACKEND_F32);
        const float *dbias = DEV(bbias);
        const int Ts[3][2] = {{1, 0}, {2, 1}, {100, 40}}; /* n_new of two sequences */
        for (int ti = 0; ti < 3; ti++)
            for (int norm = 0; norm < 2; norm++) {
                test_batch tb;
                int start[2] = {5, 20}, n_new[2] = {Ts[ti][0], Ts[ti][1]}, S = n_new[1] ? 2 : 1;
                make_batch(&tb, S, start, n_new, 16, 16, 10);
                assert_int_equal(backend_plan(st, &tb.b), 0);
                int T = tb.T;
                float *xb = rand_vec((size_t)T * H, BACKEND_BF16);
                backend_buffer *bx = to_dev(st, xb, (size_t)T * H, mm);
                float ks[L] = {1.0f, 0.03f}, vs[L] = {1.0f, 0.07f};
                backend_kv k32 = {NULL, BACKEND_F32, tb.n_blocks, tb.bs, L, NKV, HD, 0, NULL, NULL};
                backend_kv k8 = {NULL, BACKEND_F8E4M3, tb.n_blocks, tb.bs, L, NKV, HD, 0, ks, vs};
                size_t n_el = backend_kv_block_bytes(&k8) * k8.n_blocks;
                backend_buffer *r32 = backend_buffer_alloc(be, n_el * 4, BACKEND_BUF_KV),
                               *r8 = backend_buffer_alloc(be, n_el, BACKEND_BUF_KV);
                k32.base = DEV(r32), k8.base = DEV(r8);
                backend_buffer *bqo = backend_buffer_alloc(be, (size_t)T * NQ * 4, 0),
                               *bks = backend_buffer_alloc(be, (size_t)T * KVD * 4, 0),
                               *bvs = backend_buffer_alloc(be, (size_t)T * KVD * 4, 0);
                backend_qkv_op op = {.x = DEV(bx),
                                     .x_dt = mm,
                                     .T = T,
                                     .hidden = H,
                                     .n_heads = NH,
                                     .wq = wq,
                                     .wk = wk,
                                     .wv = wv,
                                     .w_dt = sw,
                                     .bq = dbias,
                                     .bk = dbias + NQ,
                                     .bv = dbias + NQ + KVD,
                                     .wqkv = wqkv,
                                     .bqkv = wqkv ? dbias : NULL,
                                     .q = DEV(bqo),
                                     .k = DEV(bks),
                                     .v = DEV(bvs),
                                     .dt = a,
                                     .inv_freq = DEV(binv),
                                     .kv = &k32,
                                     .layer = LAYER,
                                     .q_norm = norm ? DEV(bqn) : NULL,
                                     .k_norm = norm ? DEV(bkn) : NULL,
                                     .qk_eps = 1e-6f};
                assert_int_equal(backend_qkv(st, &op), 0);
                op.kv = &k8;
                assert_int_equal(backend_qkv(st, &op), 0);
                float *f = from_dev(st, k32.base, n_el, BACKEND_F32);
                uint8_t *b8 = bytes_from_dev(st, k8.base, n_el);
                size_t per_layer = (size_t)tb.bs * KVD, bad = 0, first = 0;
                for (size_t i = 0; i < n_el; i++) {
                    int which = (int)(i / per_layer % 2);
                    uint8_t want = fp8_e4m3_from_f32(f[i] / (which ? vs : ks)[LAYER]);
                    if (b8[i] != want && !bad++) first = i;
                }
                if (bad)
                    fail_msg("fp8 qkv on %s (T %d, q/k norm %d): %zu bytes differ from e4m3 of "
                             "the f32 KV / scale, first at %zu: 0x%02x, f32 %.9g -> 0x%02x",
                             backend_name(be), T, norm, bad, first, b8[first], (double)f[first],
                             fp8_e4m3_from_f32(f[first] / ((first / per_layer % 2) ? vs : ks)[LAYER]));
                backend_buffer *bufs[] = {bx, r32, r8, bqo, bks, bvs};
                for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
                    backend_buffer_free(bufs[i]);
                free(f), free(b8), free(xb);
            }
        backend_buffer *bufs[] = {bw, bqw, bkw, bvw, bbias, binv, bqn, bkn};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            backend_buffer_free(bufs[i]);
        free(hw), free(fw);
        backend_stream_free(st);
    }
}

/* --kv-cache-dtype names: vLLM's fp8 / fp8_e4m3 are e4m3; fp8_e5m2 and int8 are refused */
static void test_kv_dtype_names(void **state) {
    int dt = -2;
    assert_int_equal(backend_kv_dtype_parse("fp8", &dt), 0);
    assert_int_equal(dt, BACKEND_F8E4M3);
    assert_int_equal(backend_kv_dtype_parse("fp8_e4m3", &dt), 0);
    assert_int_equal(dt, BACKEND_F8E4M3);
    assert_int_equal(backend_kv_dtype_parse("auto", &dt), 0);
    assert_int_equal(dt, -1);
    assert_int_equal(backend_kv_dtype_parse("bfloat16", &dt), 0);
    assert_int_equal(dt, BACKEND_BF16);
    assert_int_equal(backend_kv_dtype_parse("fp8_e5m2", &dt), -EINVAL);
    assert_int_equal(backend_kv_dtype_parse("int8", &dt), -EINVAL);
    assert_int_equal((int)backend_dtype_size(BACKEND_F8E4M3), 1);
    assert_string_equal(backend_dtype_name(BACKEND_F8E4M3), "float8_e4m3fn");
}

int main(void) {
    char err[512];
    if (backend_open("cpu", NULL, &g_be[0], err, sizeof err)) {
        fprintf(stderr, "test_backend_ops: %s\n", err);
        return 1;
    }
    g_n_be = 1;
    if (backend_open("cuda", NULL, &g_be[1], err, sizeof err) == 0)
        g_n_be = 2;
    else
        fprintf(stderr,
                "\n*** SKIP: CUDA backend not tested (it needs a GPU and the CUDA module): %s\n"
                "*** test_backend_ops checks the CPU backend against the reference only.\n\n",
                err);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_buffers),
        cmocka_unit_test(test_embed),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_matmul_fp8),
        cmocka_unit_test(test_gate_up_fp8),
        cmocka_unit_test(test_fp8_mma_gemv),
        cmocka_unit_test(test_fp8_mma_gate_up),
        cmocka_unit_test(test_fp8_mma_qkv),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_kv_write),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_attention_alone_vs_batch),
        cmocka_unit_test(test_attention_window),
        cmocka_unit_test(test_attention_block_sizes),
        cmocka_unit_test(test_swiglu_add),
        cmocka_unit_test(test_gather_argmax),
        cmocka_unit_test(test_token_bitmask),
        cmocka_unit_test(test_plan_checks),
        cmocka_unit_test(test_registry),
        cmocka_unit_test(test_fused_ops),
        cmocka_unit_test(test_gate_up_prefill),
        cmocka_unit_test(test_gate_up_gemv),
        cmocka_unit_test(test_qkv_gemv),
        cmocka_unit_test(test_matmul_residual),
        cmocka_unit_test(test_qkv_prefill),
        /* CUDA mixture of experts */
        cmocka_unit_test(test_moe_route_cuda),
        cmocka_unit_test(test_moe_cuda),
        cmocka_unit_test(test_fp8_kv_write),
        cmocka_unit_test(test_fp8_kv_attention),
        cmocka_unit_test(test_fp8_kv_qkv),
        cmocka_unit_test(test_kv_dtype_names),
    };
    /* TEST_BACKEND_OPS_FILTER=pattern: only the tests whose name matches (cmocka's filter,
     * e.g. "test_moe*" for gpu_check's ONLY=moe) */
    if (getenv("TEST_BACKEND_OPS_FILTER"))
        cmocka_set_test_filter(getenv("TEST_BACKEND_OPS_FILTER"));
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    for (int i = g_n_be - 1; i >= 0; i--)
        backend_close(g_be[i]);
    return rc;
}
