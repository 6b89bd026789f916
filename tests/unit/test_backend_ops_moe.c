/*
 * test_backend_ops_moe — the mixture-of-experts operations of kernels/backend.h
 * (backend_moe_route, backend_moe) on every backend this machine has, as test_backend_ops
 * does for the others: the CPU always, CUDA when backend_open("cuda") succeeds (else a loud
 * SKIP line), and on CUDA also the generic form (DISAGG_MOE_GENERIC=1) against its own.
 *   - routing against torch (tests/data/model/golden-moe-route.json,
 * tools/gen_golden_moe_route.py): the ids exactly, the weights within 1e-6; on exact ties (where
 * torch's order is its own) the chosen probabilities position by position and backend.h's rule, the
 * lower index first;
 *   - the experts against a plain double-precision reference (per token, per chosen expert,
 *     the three dot products), with skewed routing: every token to the same experts,
 *     experts with no token, top_k = n_experts, one token; per-expert and stacked weights,
 *     f32 and bf16 weights;
 *   - batch invariance: a token's row is the same bits alone and in a batch routed
 *     differently (the CPU);
 *   - bad arguments are refused with -EINVAL.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"

#define MAX_BE 2
static backend *g_be[MAX_BE]; /* [0] cpu, [1] cuda when available */
static int g_n_be;

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static float frand(void) { /* [-1, 1) */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((double)(g_rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

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
static float *rand_vec(size_t n, backend_dtype dt) {
    float *v = malloc(n * sizeof *v);
    assert_non_null(v);
    for (size_t i = 0; i < n; i++) {
        v[i] = frand();
        if (dt == BACKEND_BF16) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
    }
    return v;
}
/* a device buffer holding host f32 values (n) as dt (f32 or bf16) */
static backend_buffer *to_dev(backend_stream *st, const void *v, size_t n, backend_dtype dt) {
    backend_buffer *b = backend_buffer_alloc(backend_stream_backend(st), n * 4, 0);
    assert_non_null(b);
    void *tmp = malloc(n * 4);
    assert_non_null(tmp);
    for (size_t i = 0; i < n; i++) {
        if (dt == BACKEND_BF16)
            ((uint16_t *)tmp)[i] = f32_to_bf16(((const float *)v)[i]);
        else
            ((uint32_t *)tmp)[i] = ((const uint32_t *)v)[i]; /* f32 or int32 bytes */
    }
    assert_int_equal(backend_upload(st, backend_buffer_ptr(b), tmp, n * backend_dtype_size(dt)), 0);
    free(tmp);
    return b;
}
static float *from_dev(backend_stream *st, const void *dev, size_t n, backend_dtype dt) {
    assert_int_equal(backend_stream_sync(st), 0);
    void *tmp = malloc(n * 4);
    float *out = malloc(n * sizeof *out);
    assert_non_null(tmp);
    assert_non_null(out);
    assert_int_equal(backend_download(st, tmp, dev, n * backend_dtype_size(dt)), 0);
    for (size_t i = 0; i < n; i++)
        out[i] = dt == BACKEND_BF16 ? bf16_to_f32(((uint16_t *)tmp)[i]) : ((float *)tmp)[i];
    free(tmp);
    return out;
}
#define DEV(b) backend_buffer_ptr(b)

static void set_generic(int on) {
    if (on)
        setenv("DISAGG_MOE_GENERIC", "1", 1);
    else
        setenv("DISAGG_MOE_GENERIC", "0", 1); /* the backend's own kernels (opt-in) */
}
/* the forms to run on be: its own, and on a backend that has one also the generic form */
static int n_forms(const backend *be) {
    return backend_moe_generic(be) ? 1 : 2;
}

/* ---- routing against torch ------------------------------------------------------------ */

static void check_route_case(backend_stream *st, json_t *c, size_t ci) {
    backend *be = backend_stream_backend(st);
    int E = (int)json_integer_value(json_object_get(c, "n_experts"));
    int k = (int)json_integer_value(json_object_get(c, "top_k"));
    int norm = json_is_true(json_object_get(c, "norm")),
        ties = json_is_true(json_object_get(c, "ties"));
    json_t *jl = json_object_get(c, "logits"), *ji = json_object_get(c, "ids"),
           *jw = json_object_get(c, "weights");
    int T = (int)json_array_size(jl);
    float *l = malloc((size_t)T * E * sizeof *l);
    assert_non_null(l);
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++)
            l[(size_t)t * E + e] = (float)json_real_value(json_array_get(json_array_get(jl, t), e));
    backend_buffer *bl = to_dev(st, l, (size_t)T * E, BACKEND_F32);
    backend_buffer *bi = backend_buffer_alloc(be, (size_t)T * k * 4, 0),
                   *bw = backend_buffer_alloc(be, (size_t)T * k * 4, 0);
    assert_int_equal(backend_moe_route(st, DEV(bi), DEV(bw), DEV(bl), T, E, k, norm), 0);
    assert_int_equal(backend_stream_sync(st), 0);
    int32_t *ids = malloc((size_t)T * k * 4);
    float *w = malloc((size_t)T * k * 4);
    assert_int_equal(backend_download(st, ids, DEV(bi), (size_t)T * k * 4), 0);
    assert_int_equal(backend_download(st, w, DEV(bw), (size_t)T * k * 4), 0);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int id = ids[t * k + j];
            int want = (int)json_integer_value(json_array_get(json_array_get(ji, t), j));
            double ww = json_real_value(json_array_get(json_array_get(jw, t), j));
            if (!(fabs(w[t * k + j] - ww) <= 1e-6 * fabs(ww) + 1e-30))
                fail_msg("route case %zu (%d experts, top %d) on %s: token %d weight %d is %.9g, "
                         "torch %.9g",
                         ci, E, k, backend_name(be), t, j, w[t * k + j], ww);
            if (!ties && id != want)
                fail_msg("route case %zu (%d experts, top %d) on %s: token %d choice %d is "
                         "expert %d, torch %d",
                         ci, E, k, backend_name(be), t, j, id, want);
            assert_true(id >= 0 && id < E);
            /* ties: torch's pick has our pick's logit, and no unchosen expert of the same
             * logit has a lower index (backend.h: the lower index first) */
            const float *row = l + (size_t)t * E;
            assert_true(row[id] == row[want] || fabs(row[id] - row[want]) < 1e-6);
            for (int e = 0; e < id; e++) {
                int chosen = 0;
                for (int i = 0; i < k; i++)
                    chosen |= ids[t * k + i] == e;
                if (!chosen && row[e] == row[id])
                    fail_msg("route case %zu on %s: token %d chose expert %d over expert %d of "
                             "the same logit (ties go to the lower index)",
                             ci, backend_name(be), t, id, e);
            }
        }
    free(ids), free(w), free(l);
    backend_buffer_free(bl), backend_buffer_free(bi), backend_buffer_free(bw);
}

static void test_route_against_torch(void **state) {
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/data/model/golden-moe-route.json", DISAGG_SOURCE_DIR);
    json_error_t je;
    json_t *g = json_load_file(path, 0, &je);
    if (!g) fail_msg("%s: %s", path, je.text);
    for (int b = 0; b < g_n_be; b++)
        for (int form = 0; form < n_forms(g_be[b]); form++) {
            set_generic(form == 1);
            backend_stream *st = backend_stream_create(g_be[b]);
            size_t ci;
            json_t *c;
            json_array_foreach(json_object_get(g, "cases"), ci, c) check_route_case(st, c, ci);
            backend_stream_free(st);
        }
    set_generic(0);
    json_decref(g);
}

/* ---- the experts against a double-precision reference ----------------------------------- */

typedef struct moe_case {
    const char *what;
    int T, E, k;
    int route;            /* 0: from random logits through backend_moe_route; else fixed ids */
    const int32_t *fixed; /* (k) the experts every token picks (route != 0) */
} moe_case;

static double silu(double g) {
    return g / (1.0 + exp(-g));
}

/* out (T, H) reference: per token, per chosen expert, dots in double */
static void reference(double *out, const float *x, const float *wg, const float *wu,
                      const float *wd, const int32_t *ids, const float *rw, int T, int H, int I,
                      int k) {
    double *h = malloc((size_t)I * sizeof *h);
    for (int t = 0; t < T; t++) {
        double *o = out + (size_t)t * H;
        for (int i = 0; i < H; i++)
            o[i] = 0;
        for (int j = 0; j < k; j++) {
            int e = ids[t * k + j];
            const float *xr = x + (size_t)t * H;
            for (int r = 0; r < I; r++) {
                double g = 0, u = 0;
                const float *gr = wg + ((size_t)e * I + r) * H, *ur = wu + ((size_t)e * I + r) * H;
                for (int c = 0; c < H; c++)
                    g += (double)gr[c] * xr[c], u += (double)ur[c] * xr[c];
                h[r] = silu(g) * u;
            }
            for (int c = 0; c < H; c++) {
                double d = 0;
                const float *dr = wd + ((size_t)e * H + c) * I;
                for (int r = 0; r < I; r++)
                    d += (double)dr[r] * h[r];
                o[c] += (double)rw[t * k + j] * d;
            }
        }
    }
    free(h);
}

static void run_moe_case(backend_stream *st, const moe_case *mc, backend_dtype wdt, int stacked,
                         float **result) {
    backend *be = backend_stream_backend(st);
    const int T = mc->T, E = mc->E, k = mc->k, H = 72, I = 40;
    const backend_dtype act = backend_act_dtype(be);
    float *x = rand_vec((size_t)T * H, act);
    float *wg = rand_vec((size_t)E * I * H, wdt), *wu = rand_vec((size_t)E * I * H, wdt),
          *wd = rand_vec((size_t)E * H * I, wdt);
    int32_t *ids = malloc((size_t)T * k * 4);
    float *rw = malloc((size_t)T * k * 4);
    backend_buffer *bi = backend_buffer_alloc(be, (size_t)T * k * 4, 0),
                   *bw = backend_buffer_alloc(be, (size_t)T * k * 4, 0);
    if (!mc->route) {
        float *l = rand_vec((size_t)T * E, BACKEND_F32);
        backend_buffer *bl = to_dev(st, l, (size_t)T * E, BACKEND_F32);
        assert_int_equal(backend_moe_route(st, DEV(bi), DEV(bw), DEV(bl), T, E, k, 1), 0);
        assert_int_equal(backend_stream_sync(st), 0);
        assert_int_equal(backend_download(st, ids, DEV(bi), (size_t)T * k * 4), 0);
        assert_int_equal(backend_download(st, rw, DEV(bw), (size_t)T * k * 4), 0);
        backend_buffer_free(bl);
        free(l);
    } else {
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++) {
                ids[t * k + j] = mc->fixed[j];
                rw[t * k + j] = 0.25f + 0.5f * (float)j / k + 0.01f * (float)(t % 7);
            }
        assert_int_equal(backend_upload(st, DEV(bi), ids, (size_t)T * k * 4), 0);
        assert_int_equal(backend_upload(st, DEV(bw), rw, (size_t)T * k * 4), 0);
    }
    /* the weights: per expert (separate buffers) or stacked (gate_e, up_e interleaved) */
    backend_buffer **bufs = calloc((size_t)3 * E + 2, sizeof *bufs);
    const void **pg = calloc((size_t)3 * E, sizeof *pg), **pu = pg + E, **pd = pg + 2 * E;
    const void *gu_all = NULL, *d_all = NULL;
    size_t m = (size_t)I * H;
    if (stacked) {
        float *gu = malloc(2 * m * E * sizeof *gu);
        for (int e = 0; e < E; e++) {
            memcpy(gu + 2 * m * e, wg + m * e, m * sizeof *gu);
            memcpy(gu + 2 * m * e + m, wu + m * e, m * sizeof *gu);
        }
        bufs[0] = to_dev(st, gu, 2 * m * E, wdt);
        bufs[1] = to_dev(st, wd, m * E, wdt);
        gu_all = DEV(bufs[0]), d_all = DEV(bufs[1]);
        free(gu);
    } else {
        for (int e = 0; e < E; e++) {
            bufs[3 * e] = to_dev(st, wg + m * e, m, wdt);
            bufs[3 * e + 1] = to_dev(st, wu + m * e, m, wdt);
            bufs[3 * e + 2] = to_dev(st, wd + m * e, m, wdt);
            pg[e] = DEV(bufs[3 * e]), pu[e] = DEV(bufs[3 * e + 1]), pd[e] = DEV(bufs[3 * e + 2]);
        }
    }
    backend_buffer *bx = to_dev(st, x, (size_t)T * H, act);
    backend_buffer *bo = backend_buffer_alloc(be, (size_t)T * H * 4, 0);
    backend_moe_op op = {.x = DEV(bx),
                         .x_dt = act,
                         .T = T,
                         .hidden = H,
                         .inter = I,
                         .n_experts = E,
                         .top_k = k,
                         .ids = DEV(bi),
                         .weights = DEV(bw),
                         .w_gate = stacked ? NULL : pg,
                         .w_up = stacked ? NULL : pu,
                         .w_down = stacked ? NULL : pd,
                         .w_gate_up_all = gu_all,
                         .w_down_all = d_all,
                         .w_dt = wdt,
                         .out = DEV(bo),
                         .out_dt = act};
    int rc = backend_moe(st, &op);
    if (rc == -ENOTSUP && !stacked && backend_wants_cat(be)) {
        fprintf(stderr, "  (%s: per-expert weights not supported, stacked only)\n",
                backend_name(be));
    } else {
        assert_int_equal(rc, 0);
        float *got = from_dev(st, DEV(bo), (size_t)T * H, act);
        double *want = malloc((size_t)T * H * sizeof *want);
        reference(want, x, wg, wu, wd, ids, rw, T, H, I, k);
        /* f32 throughout (the CPU): element by element.  Matmul inputs in bf16 (CUDA, either
         * form: x and h rounded): the error of an element is that of its token's row (|want|
         * up to ~60 here: bf16 h moves an element by ~0.1 however small it is), so relative
         * to 1 + the row's largest |want| -- 0.007 at most over many draws of these cases,
         * where a wrong expert, row or column is off by the row's scale */
        int bf = act != BACKEND_F32 || backend_mm_dtype(be) != BACKEND_F32;
        double tol = bf ? 2e-2 : 2e-5, worst = 0;
        size_t wi = 0;
        for (size_t i = 0; i < (size_t)T * H; i++) {
            double scale = fabs(want[i]);
            if (bf)
                for (size_t c = i - i % H; c < i - i % H + H; c++)
                    scale = fabs(want[c]) > scale ? fabs(want[c]) : scale;
            double e = fabs(got[i] - want[i]) / (1.0 + scale);
            if (!(e <= worst)) worst = e, wi = i;
        }
        if (!(worst <= tol))
            fail_msg("moe %s (%s weights, %s, %s) on %s: element %zu (token %zu) is %.9g, "
                     "reference %.9g (error %.3g > %.3g)",
                     mc->what, backend_dtype_name(wdt), stacked ? "stacked" : "per expert",
                     backend_moe_generic(be) ? "generic" : "own", backend_name(be), wi,
                     wi / (size_t)H, got[wi], want[wi], worst, tol);
        if (result)
            *result = got;
        else
            free(got);
        free(want);
    }
    for (int i = 0; i < 3 * E + 2; i++)
        backend_buffer_free(bufs[i]);
    free(bufs), free(pg);
    backend_buffer_free(bx), backend_buffer_free(bo), backend_buffer_free(bi),
        backend_buffer_free(bw);
    free(x), free(wg), free(wu), free(wd), free(ids), free(rw);
}

static void test_moe_skewed(void **state) {
    (void)state;
    static const int32_t two[2] = {5, 3}, all4[4] = {2, 0, 3, 1}, one[1] = {6};
    const moe_case cases[] = {
        {"routed (37 tokens, 8 experts, top 2)", 37, 8, 2, 0, NULL},
        {"one token (decode)", 1, 8, 2, 0, NULL},
        {"128 experts top 8 (13 tokens: most experts empty)", 13, 128, 8, 0, NULL},
        {"every token to experts 5 and 3, the rest empty", 29, 8, 2, 1, two},
        {"top_k = n_experts = 4", 9, 4, 4, 1, all4},
        {"every token to expert 6, top 1", 17, 8, 1, 1, one},
    };
    for (int b = 0; b < g_n_be; b++)
        for (int form = 0; form < n_forms(g_be[b]); form++) {
            set_generic(form == 1);
            backend_stream *st = backend_stream_create(g_be[b]);
            for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
                for (int wdt = backend_is_cpu(g_be[b]) ? 0 : 1; wdt < 2; wdt++) /* CUDA: bf16 */
                    for (int stacked = 0; stacked < 2; stacked++) {
                        g_rng = 0x2545f4914f6cdd1dull + c; /* the same inputs per case */
                        run_moe_case(st, &cases[c], wdt ? BACKEND_BF16 : BACKEND_F32, stacked,
                                     NULL);
                    }
            backend_stream_free(st);
        }
    set_generic(0);
}

/* A token's row does not depend on the batch: token 0 alone (its experts to itself) equals
 * token 0 of a batch where the others crowd the same and other experts.  Bit for bit on the
 * CPU; CUDA's own form is checked by its own batch-invariance tests. */
static void test_moe_batch_invariance(void **state) {
    (void)state;
    backend_stream *st = backend_stream_create(g_be[0]);
    const int H = 72, I = 40, E = 8, k = 2;
    float *wg = rand_vec((size_t)E * I * H, BACKEND_BF16),
          *wu = rand_vec((size_t)E * I * H, BACKEND_BF16),
          *wd = rand_vec((size_t)E * H * I, BACKEND_BF16),
          *x = rand_vec((size_t)23 * H, BACKEND_F32);
    const void *pg[8], *pu[8], *pd[8];
    uint16_t *wb = malloc((size_t)3 * E * I * H * 2);
    for (size_t i = 0; i < (size_t)E * I * H; i++) {
        wb[i] = f32_to_bf16(wg[i]);
        wb[(size_t)E * I * H + i] = f32_to_bf16(wu[i]);
        wb[(size_t)2 * E * I * H + i] = f32_to_bf16(wd[i]);
    }
    for (int e = 0; e < E; e++) {
        pg[e] = wb + (size_t)e * I * H;
        pu[e] = wb + (size_t)E * I * H + (size_t)e * I * H;
        pd[e] = wb + (size_t)2 * E * I * H + (size_t)e * H * I;
    }
    int32_t ids[23 * 2];
    float rw[23 * 2], out1[72], *outn = malloc((size_t)23 * H * 4);
    for (int t = 0; t < 23; t++)
        ids[2 * t] = t % 3 ? 4 : 1, ids[2 * t + 1] = t % 5 == 1 ? 7 : 4 - (t % 3 == 0) * 2,
                rw[2 * t] = 0.6f, rw[2 * t + 1] = 0.4f;
    backend_moe_op op = {.x = x,
                         .x_dt = BACKEND_F32,
                         .T = 1,
                         .hidden = H,
                         .inter = I,
                         .n_experts = E,
                         .top_k = k,
                         .ids = ids,
                         .weights = rw,
                         .w_gate = pg,
                         .w_up = pu,
                         .w_down = pd,
                         .w_dt = BACKEND_BF16,
                         .out = out1,
                         .out_dt = BACKEND_F32};
    assert_int_equal(backend_moe(st, &op), 0);
    op.T = 23, op.out = outn;
    assert_int_equal(backend_moe(st, &op), 0);
    assert_memory_equal(out1, outn, sizeof out1);
    /* and the last token alone */
    op.T = 1, op.x = x + 22 * H, op.ids = ids + 44, op.weights = rw + 44, op.out = out1;
    assert_int_equal(backend_moe(st, &op), 0);
    assert_memory_equal(out1, outn + 22 * H, sizeof out1);
    free(wg), free(wu), free(wd), free(x), free(wb), free(outn);
    backend_stream_free(st);
}

static void test_moe_bad_arguments(void **state) {
    (void)state;
    backend_stream *st = backend_stream_create(g_be[0]);
    float l[16] = {0}, w[4] = {0.5f, 0.5f, 0.25f, 0.75f}, x[8] = {0}, out[8];
    int32_t ids[4] = {0, 1, 9, 2};
    float wgt[64] = {0};
    const void *pe[4] = {wgt, wgt, wgt, wgt};
    assert_int_equal(backend_moe_route(st, ids, w, l, 2, 4, 5, 1), -EINVAL); /* top_k > E */
    assert_int_equal(backend_moe_route(st, ids, w, l, 2, 4, 0, 1), -EINVAL);
    assert_int_equal(backend_moe_route(st, ids, w, l, 1, BACKEND_MOE_MAX_EXPERTS + 1, 1, 1),
                     -EINVAL);
    assert_int_equal(backend_moe_route(st, ids, w, l, 0, 4, 1, 1), -EINVAL);
    backend_moe_op op = {.x = x,
                         .x_dt = BACKEND_F32,
                         .T = 2,
                         .hidden = 4,
                         .inter = 4,
                         .n_experts = 4,
                         .top_k = 2,
                         .ids = ids,
                         .weights = w,
                         .w_gate = pe,
                         .w_up = pe,
                         .w_down = pe,
                         .w_dt = BACKEND_F32,
                         .out = out,
                         .out_dt = BACKEND_F32};
    assert_int_equal(backend_moe(st, &op), -EINVAL); /* ids[2] = 9 is not an expert */
    ids[2] = 3;
    assert_int_equal(backend_moe(st, &op), 0);
    op.w_gate = NULL;
    assert_int_equal(backend_moe(st, &op), -EINVAL); /* neither form complete */
    op.w_gate = pe, op.out = x;
    assert_int_equal(backend_moe(st, &op), -EINVAL); /* out = x */
    op.out = out, op.top_k = 5;
    assert_int_equal(backend_moe(st, &op), -EINVAL);
    /* more parts than a layer's experts can have */
    const void *srcs[1] = {wgt};
    backend_dtype dts[1] = {BACKEND_F32}, stored;
    size_t ns[1] = {4};
    assert_null(backend_weights_load_cat(g_be[0], srcs, dts, ns, BACKEND_WEIGHTS_CAT_MAX_PARTS + 1,
                                         &stored));
    backend_stream_free(st);
}

/* backend_weights_load_cat with a layer's worth of parts (2 x 128 experts): rows in part
 * order.  Only on a backend that concatenates (CUDA); the CPU keeps matrices apart. */
static void test_weights_load_cat_many_parts(void **state) {
    (void)state;
    for (int b = 0; b < g_n_be; b++) {
        if (!backend_wants_cat(g_be[b])) continue;
        enum { P = 256, N = 24 };
        float *src = malloc((size_t)P * N * sizeof *src);
        const void *srcs[P];
        backend_dtype dts[P], stored;
        size_t ns[P];
        for (int i = 0; i < P * N; i++)
            src[i] = bf16_to_f32(f32_to_bf16((float)(i % 1000) / 7.0f));
        for (int p = 0; p < P; p++)
            srcs[p] = src + (size_t)p * N, dts[p] = BACKEND_F32, ns[p] = N;
        backend_buffer *bb = backend_weights_load_cat(g_be[b], srcs, dts, ns, P, &stored);
        assert_non_null(bb);
        backend_stream *st = backend_stream_create(g_be[b]);
        float *got = from_dev(st, DEV(bb), (size_t)P * N, stored);
        for (int i = 0; i < P * N; i++)
            if (got[i] != src[i])
                fail_msg("load_cat of %d parts: element %d is %g, want %g", P, i, got[i], src[i]);
        free(got), free(src);
        backend_stream_free(st);
        backend_buffer_free(bb);
    }
}

int main(void) {
    char err[512];
    if (backend_open("cpu", NULL, &g_be[0], err, sizeof err)) {
        fprintf(stderr, "test_backend_ops_moe: %s\n", err);
        return 1;
    }
    g_n_be = 1;
    if (backend_open("cuda", NULL, &g_be[1], err, sizeof err) == 0)
        g_n_be = 2;
    else
        fprintf(stderr,
                "\n*** SKIP: CUDA backend not tested (it needs a GPU and the CUDA module): %s\n"
                "*** test_backend_ops_moe checks the CPU backend (the generic MoE) only.\n\n",
                err);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_route_against_torch),
        cmocka_unit_test(test_moe_skewed),
        cmocka_unit_test(test_moe_batch_invariance),
        cmocka_unit_test(test_moe_bad_arguments),
        cmocka_unit_test(test_weights_load_cat_many_parts),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    for (int i = g_n_be - 1; i >= 0; i--)
        backend_close(g_be[i]);
    return rc;
}
