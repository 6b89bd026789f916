/*
 * test_kernels — the CPU kernels, once per ISA (scalar, AVX2), each compared with references
 * written here from the specification in cpu_matmul.h, not with cpu_ref.c (which is the
 * scalar path itself, so comparing it with the dispatched kernel on a CPU without AVX2 would
 * compare it with itself):
 *  - canon_dot(): the canonical dot (8 fmaf lanes, the fixed horizontal-sum tree, fmaf
 *    tail, then + bias), bit for bit, for every weight dtype and awkward shapes (K not a
 *    multiple of 8, N not a multiple of 4, 1..8 and 100 tokens, with and without bias);
 *  - a double-precision naive product, within rounding;
 *  - f16 / bf16 decoders written here (ldexpf), for all 65536 patterns, and known encodings.
 * Also: a matmul row does not depend on the other rows of the batch or the thread count,
 * cpu_matmul_batch equals its cpu_matmuls, the AVX2 path equals cpu_ref.c bit for bit, and
 * the pool runs every task exactly once.
 *
 * An ISA this CPU lacks is not tested: its tests are skipped with a message saying so, and
 * the binary exits 77 (ctest reports the test Skipped) unless something failed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_matmul.h"
#include "kernels/cpu/cpu_pool.h"

static const cpu_isa ISA_SCALAR = CPU_ISA_SCALAR, ISA_AVX2 = CPU_ISA_AVX2,
                     ISA_AVX512BF16 = CPU_ISA_AVX512BF16,
                     ISA_AVX512BF16_FAST = CPU_ISA_AVX512BF16_FAST, ISA_AVX512F = CPU_ISA_AVX512F;
static int g_skipped; /* tests skipped for a missing ISA */

/* Run the current test on the ISA in *state; skip loudly if the CPU lacks it. */
static cpu_isa use_isa(void **state) {
    cpu_isa isa = *(const cpu_isa *)*state;
    if (cpu_isa_force(isa) != 0) {
        fprintf(stderr,
                "SKIPPED: this CPU lacks %s (avx2: avx2, fma and f16c; avx512f: also avx512f; "
                "avx512bf16: also avx512f, avx512bw, avx512vl and avx512_bf16): the %s kernels "
                "are NOT tested here\n",
                cpu_isa_name(isa), cpu_isa_name(isa));
        g_skipped++;
        skip();
    }
    assert_int_equal(cpu_isa_get(), isa);
    return isa;
}

static uint64_t g_rng = 0x1234567;
static float frand(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((g_rng >> 40) & 0xffffff) / 16777216.0f * 2.0f - 1.0f;
}

/* ---- references written from the specification ------------------------------ */

static float my_f16(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 31  ? (m ? NAN : INFINITY)
              : e == 0 ? ldexpf((float)m, -24)              /* subnormal: m * 2^-24 */
                       : ldexpf((float)(m + 1024), e - 25); /* (1 + m/1024) * 2^(e-15) */
    return (h & 0x8000) ? -v : v;
}

static float my_bf16(uint16_t h) { /* the high half of an f32 */
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float wval(const void *w, cpu_dtype dt, size_t i) {
    if (dt == CPU_F32) return ((const float *)w)[i];
    if (dt == CPU_BF16) return my_bf16(((const uint16_t *)w)[i]);
    return my_f16(((const uint16_t *)w)[i]);
}

/* The canonical dot of cpu_matmul.h: 8 lane accumulators a[l] = fma(x, w, a[l]) over full
 * 8-blocks, s = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), then s = fma(x, w, s) over the tail. */
static float canon_dot(const float *x, const void *w, cpu_dtype dt, size_t w_off, int n) {
    float a[8] = {0};
    int k = 0;
    for (; k + 8 <= n; k += 8)
        for (int l = 0; l < 8; l++)
            a[l] = fmaf(x[k + l], wval(w, dt, w_off + (size_t)(k + l)), a[l]);
    float s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    for (; k < n; k++)
        s = fmaf(x[k], wval(w, dt, w_off + (size_t)k), s);
    return s;
}

/* The bf16xP dot of the avx512bf16 paths (cpu_avx512bf16.c), from its specification: x split
 * into P bf16 parts (3; 1 for avx512bf16-fast) (round to nearest even, each the rest of the
 * previous), k padded with zeros to a multiple of 32, 16 lanes; for each 32-block and each part in
 * order, lane i adds the products of elements 2i+1 then 2i (vdpbf16ps: products exact, each add
 * rounded to nearest, denormal inputs and results flushed to zero); then lanes i + 8 folded onto i
 * and the canonical tree. */
static float daz(float f) {
    return f != 0 && fabsf(f) < 0x1p-126f ? copysignf(0.0f, f) : f;
}
static float bf16_rne(float f) { /* as a float */
    f = daz(f);
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}
static float bf16x_dot(const float *x, const uint16_t *w, int K, int parts) {
    float acc[16] = {0};
    for (int b = 0; b < K; b += 32)
        for (int part = 0; part < parts; part++)
            for (int i = 0; i < 16; i++)
                for (int e = 1; e >= 0; e--) {
                    int k = b + 2 * i + e;
                    if (k >= K) continue; /* a zero product: adding it changes nothing */
                    float xp = x[k];
                    for (int q = 0; q < part; q++)
                        xp = xp - bf16_rne(xp);
                    acc[i] = daz(acc[i] + daz(bf16_rne(xp)) * daz(my_bf16(w[k])));
                }
    float t[8];
    for (int i = 0; i < 8; i++)
        t[i] = acc[i] + acc[i + 8];
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

/* The f32x16 dot of the avx512f path (cpu_avx512f.c), from its specification: k padded with
 * zeros to a multiple of 32, 16 lanes; for each 32-block, lane i = fma(x, w, lane i) for element
 * 2i, then for element 2i + 1; then lanes i + 8 folded onto i and the canonical tree. */
static float f32x_dot(const float *x, const uint16_t *w, int K) {
    float acc[16] = {0};
    for (int b = 0; b < K; b += 32)
        for (int e = 0; e < 2; e++)
            for (int i = 0; i < 16; i++) {
                int k = b + 2 * i + e;
                if (k < K)
                    acc[i] = fmaf(x[k], my_bf16(w[k]), acc[i]);
                else
                    acc[i] = fmaf(0.0f, 0.0f, acc[i]); /* what the zero padding adds */
            }
    float t[8];
    for (int i = 0; i < 8; i++)
        t[i] = acc[i] + acc[i + 8];
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

/* w as dtype from f32 values (bf16 by truncation; f16 of values k/1024, |k| < 1024: exact). */
static void *make_weights(cpu_dtype dt, const float *f, size_t n) {
    if (dt == CPU_F32) {
        float *w = malloc(n * 4);
        memcpy(w, f, n * 4);
        return w;
    }
    uint16_t *w = malloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &f[i], 4);
        if (dt == CPU_BF16) {
            w[i] = (uint16_t)(u >> 16);
        } else {
            int k = (int)lrintf(f[i] * 1024.0f);
            uint16_t sign = k < 0 ? 0x8000 : 0;
            k = abs(k);
            if (k == 0) {
                w[i] = sign;
                continue;
            }
            int e = 0;
            while ((k >> e) > 1)
                e++;                                            /* k in [2^e, 2^(e+1)) */
            uint32_t man = (uint32_t)((k << (10 - e)) & 0x3ff); /* e <= 9 */
            w[i] = (uint16_t)(sign | ((uint32_t)(e - 10 + 15) << 10) | man);
        }
    }
    return w;
}

/* ---- matmul -------------------------------------------------------------------- */

static void check_matmul(cpu_pool *pool, cpu_dtype dt, int T, int N, int K) {
    float *wf = malloc((size_t)N * K * 4), *x = malloc((size_t)T * K * 4),
          *b = malloc((size_t)N * 4);
    for (int i = 0; i < N * K; i++)
        wf[i] = (float)((int)(frand() * 1000)) / 1024.0f;
    for (int i = 0; i < T * K; i++)
        x[i] = frand();
    for (int i = 0; i < N; i++)
        b[i] = frand();
    void *w = make_weights(dt, wf, (size_t)N * K);
    float *y = malloc((size_t)T * N * 4), *y1 = malloc((size_t)N * 4);
    for (int withb = 0; withb < 2; withb++) {
        const float *bias = withb ? b : NULL;
        cpu_matmul(pool, y, x, w, dt, bias, T, N, K);
        for (int t = 0; t < T; t++)
            for (int n = 0; n < N; n++) {
                int parts = dt == CPU_BF16 ? cpu_isa_bf16_parts(cpu_isa_get()) : 0;
                const uint16_t *wn = (const uint16_t *)w + (size_t)n * K;
                float want = parts ? bf16x_dot(x + (size_t)t * K, wn, K, parts)
                             : dt == CPU_BF16 && cpu_isa_get() == CPU_ISA_AVX512F
                                 ? f32x_dot(x + (size_t)t * K, wn, K)
                                 : canon_dot(x + (size_t)t * K, w, dt, (size_t)n * K, K);
                if (dt == CPU_BF16 && cpu_isa_get() == CPU_ISA_AVX512F) {
                    float r = cpu_ref_f32x_dot(x + (size_t)t * K, wn, K); /* cpu_ref.c agrees */
                    if (memcmp(&r, &want, 4)) fail_msg("cpu_ref_f32x_dot %.9g vs %.9g", r, want);
                }
                if (bias) want = want + bias[n];
                float got = y[(size_t)t * N + n];
                if (memcmp(&got, &want, 4))
                    fail_msg("%s matmul != its specified dot: dtype %s T %d N %d K %d bias %d at "
                             "(%d, %d): %.9g vs %.9g",
                             cpu_isa_name(cpu_isa_get()), cpu_dtype_name(dt), T, N, K, withb, t, n,
                             got, want);
                double s = bias ? bias[n] : 0, mag = fabs(s);
                for (int k = 0; k < K; k++) {
                    double p = (double)x[t * K + k] * wval(w, dt, (size_t)n * K + k);
                    s += p;
                    mag += fabs(p);
                }
                /* stated error: f32-class; avx512bf16-fast rounds x to bf16 (2^-9 relative) */
                double tol = parts == 1 ? 1.0 / 256 : 1e-6;
                if (fabs(got - s) > tol * mag + 1e-7)
                    fail_msg("dtype %s T %d N %d K %d: %g vs exact %g", cpu_dtype_name(dt), T, N, K,
                             got, s);
            }
        /* each row alone, on one thread, equals its row in the batch */
        for (int t = 0; t < T; t++) {
            cpu_matmul(NULL, y1, x + (size_t)t * K, w, dt, bias, 1, N, K);
            if (memcmp(y1, y + (size_t)t * N, (size_t)N * 4))
                fail_msg("row %d of a %d-row batch differs from the row alone (N %d K %d)", t, T, N,
                         K);
        }
    }
    free(wf);
    free(x);
    free(b);
    free(w);
    free(y);
    free(y1);
}

static void test_matmul(void **st) {
    use_isa(st);
    cpu_pool *pool = cpu_pool_init(3);
    int Ks[] = {8, 13, 64, 100, 896}, Ns[] = {1, 4, 7, 33, 150};
    for (int dt = 0; dt < 3; dt++) {
        for (size_t ki = 0; ki < 5; ki++)
            for (size_t ni = 0; ni < 5; ni++)
                for (int T = 1; T <= 9; T++) /* every decode-sized batch (<= 8), one above */
                    check_matmul(pool, (cpu_dtype)dt, T, Ns[ni], Ks[ki]);
        check_matmul(pool, (cpu_dtype)dt, 100, 37, 72); /* several token tasks (96 each) */
        check_matmul(pool, (cpu_dtype)dt, 20, 37, 1100); /* long rows, a prefill-sized batch */
    }
    cpu_pool_free(pool);
}

/* The AVX2 kernels equal cpu_ref.c bit for bit (what the scalar fallback computes). */
static void test_matmul_equals_ref(void **st) {
    use_isa(st);
    int T = 5, N = 37, K = 101;
    float x[5 * 101], wf[37 * 101], y[5 * 37], yr[5 * 37];
    for (int i = 0; i < T * K; i++)
        x[i] = frand();
    for (int i = 0; i < N * K; i++)
        wf[i] = (float)((int)(frand() * 1000)) / 1024.0f;
    for (int dt = 0; dt < 3; dt++) {
        void *w = make_weights((cpu_dtype)dt, wf, (size_t)N * K);
        cpu_matmul(NULL, y, x, w, (cpu_dtype)dt, NULL, T, N, K);
        cpu_ref_matmul(yr, x, w, (cpu_dtype)dt, NULL, T, N, K);
        assert_memory_equal(y, yr, sizeof y);
        free(w);
    }
}

static void test_matmul_batch(void **st) {
    use_isa(st);
    cpu_pool *pool = cpu_pool_init(2);
    int T = 5, K = 40, Ns[3] = {12, 7, 33};
    float x[5 * 40], w[3][33 * 40], b[33], y1[3][5 * 33], y2[3][5 * 33];
    for (int i = 0; i < T * K; i++)
        x[i] = frand();
    for (int o = 0; o < 3; o++)
        for (int i = 0; i < Ns[o] * K; i++)
            w[o][i] = frand();
    for (int i = 0; i < 33; i++)
        b[i] = frand();
    cpu_matmul_op ops[3];
    for (int o = 0; o < 3; o++) {
        ops[o] =
            (cpu_matmul_op){y1[o], x, w[o], CPU_F32, o == 1 ? b : NULL, o == 2 ? 1 : T, Ns[o], K};
        cpu_matmul(NULL, y2[o], x, w[o], CPU_F32, o == 1 ? b : NULL, o == 2 ? 1 : T, Ns[o], K);
    }
    cpu_matmul_batch(pool, ops, 3);
    for (int o = 0; o < 3; o++) {
        int rows = o == 2 ? 1 : T;
        assert_memory_equal(y1[o], y2[o], sizeof(float) * (size_t)rows * Ns[o]);
        for (int t = 0; t < rows; t++)
            for (int n = 0; n < Ns[o]; n++) {
                float want = canon_dot(x + t * K, w[o], CPU_F32, (size_t)n * K, K);
                if (o == 1) want = want + b[n];
                assert_memory_equal(&y1[o][t * Ns[o] + n], &want, 4);
            }
    }
    cpu_pool_free(pool);
}

/* ---- vector helpers ------------------------------------------------------------ */

static void test_vector_ops(void **st) {
    use_isa(st);
    float a[37], b[37], y1[37], y2[37];
    for (int i = 0; i < 37; i++)
        a[i] = frand(), b[i] = frand(), y1[i] = y2[i] = frand();
    for (int n = 1; n <= 37; n += 3) {
        float got = cpu_dot(a, b, n), want = canon_dot(a, b, CPU_F32, 0, n);
        if (memcmp(&got, &want, 4)) fail_msg("cpu_dot n %d: %.9g vs %.9g", n, got, want);
    }
    /* the GQA helpers equal the per-head canonical dot / fma, bit for bit */
    float q[7 * 37], o1[7], yh[7 * 37], yr[7 * 37], wts[7];
    for (int i = 0; i < 7 * 37; i++)
        q[i] = frand(), yh[i] = yr[i] = frand();
    for (int h = 0; h < 7; h++)
        wts[h] = frand();
    for (int n = 5; n <= 37; n += 16) {
        cpu_dot_heads(o1, q, b, 7, n);
        for (int h = 0; h < 7; h++) {
            float want = canon_dot(q + h * n, b, CPU_F32, 0, n);
            assert_memory_equal(&o1[h], &want, 4);
        }
        cpu_axpy_heads(yh, wts, a, 7, n);
        for (int h = 0; h < 7; h++)
            for (int i = 0; i < n; i++)
                yr[h * n + i] = fmaf(wts[h], a[i], yr[h * n + i]);
        assert_memory_equal(yh, yr, sizeof(float) * 7 * (size_t)n);
    }
    cpu_axpy(y1, 0.37f, a, 37);
    for (int i = 0; i < 37; i++)
        y2[i] = fmaf(0.37f, a[i], y2[i]);
    assert_memory_equal(y1, y2, sizeof y1);
}

static void test_conversions(void **st) {
    use_isa(st);
    struct {
        uint16_t h;
        float f;
    } f16[] = {{0x3c00, 1.0f},          {0xc000, -2.0f},        {0x7bff, 65504.0f},
               {0x0001, 5.9604645e-8f}, {0x03ff, 6.097555e-5f}, {0x0400, 6.1035156e-5f},
               {0x8000, -0.0f},         {0x3555, 0.33325195f}};
    for (size_t i = 0; i < sizeof f16 / sizeof f16[0]; i++) {
        assert_true(cpu_ref_f16_to_f32(f16[i].h) == f16[i].f);
        assert_true(my_f16(f16[i].h) == f16[i].f); /* the test's own decoder is right too */
    }
    assert_true(isinf(cpu_ref_f16_to_f32(0x7c00)) && cpu_ref_f16_to_f32(0x7c00) > 0);
    assert_true(isnan(cpu_ref_f16_to_f32(0x7e00)));
    assert_true(cpu_ref_bf16_to_f32(0x3f80) == 1.0f);
    assert_true(cpu_ref_bf16_to_f32(0xc0a0) == -5.0f);
    /* the dispatched row conversion equals the decoders above for all 65536 patterns */
    static uint16_t all[65536];
    static float r1[65536];
    for (int i = 0; i < 65536; i++)
        all[i] = (uint16_t)i;
    for (int dt = 1; dt < 3; dt++) {
        cpu_row_to_f32(r1, all, (cpu_dtype)dt, 65536);
        for (int i = 0; i < 65536; i++) {
            float want = dt == CPU_F16 ? my_f16((uint16_t)i) : my_bf16((uint16_t)i);
            if (memcmp(&r1[i], &want, 4) && !(isnan(r1[i]) && isnan(want)))
                fail_msg("%s %s 0x%04x: %g, expected %g", cpu_isa_name(cpu_isa_get()),
                         cpu_dtype_name((cpu_dtype)dt), i, r1[i], want);
        }
    }
}

/* ---- exp, softmax, SiLU and the attention pieces ---------------------------------- */

static float ulp_of(double v) { /* the float spacing at |v| */
    int e;
    frexp(v, &e);
    return (float)ldexp(1.0, (e - 24 < -149 ? -149 : e - 24));
}

/* cpu_expf: stated error (cpu_matmul.h) <= 2 ulp against exp() in double on [-87.3, 88.3],
 * over 2^22 + 1 points; the AVX2 lanes equal the scalar function bit for bit; the edges. */
static void test_exp(void **st) {
    use_isa(st);
    enum { N = 1 << 22 };
    float *x = malloc((N + 1) * sizeof *x), *y = malloc((N + 1) * sizeof *y);
    assert_non_null(x);
    assert_non_null(y);
    const double lo = -87.33, hi = 88.37;
    for (int i = 0; i <= N; i++)
        x[i] = (float)(lo + (hi - lo) * i / N);
    cpu_expf_vec(y, x, N + 1);
    double worst = 0, worst_x = 0;
    for (int i = 0; i <= N; i++) {
        float s = cpu_ref_expf(x[i]);
        if (memcmp(&s, &y[i], 4))
            fail_msg("%s cpu_expf_vec(%.9g) = %.9g, scalar %.9g", cpu_isa_name(cpu_isa_get()), x[i],
                     y[i], s);
        double e = exp((double)x[i]), err = fabs((double)y[i] - e) / ulp_of(e);
        if (err > worst) worst = err, worst_x = x[i];
    }
    fprintf(stderr, "cpu_expf: worst error %.2f ulp at x = %.9g (%s)\n", worst, worst_x,
            cpu_isa_name(cpu_isa_get()));
    if (worst > 2.0) fail_msg("cpu_expf error %.2f ulp > the stated 2 ulp", worst);
    /* edges: below the range 0, above it +inf, NaN stays NaN, -inf -> 0, 0 -> 1 */
    float edge[8] = {-INFINITY, -1000.0f, -87.34f, 0.0f, -0.0f, 88.4f, INFINITY, NAN}, ye[8];
    cpu_expf_vec(ye, edge, 8);
    assert_true(ye[0] == 0 && ye[1] == 0 && ye[2] == 0 && ye[3] == 1 && ye[4] == 1);
    assert_true(isinf(ye[5]) && ye[5] > 0 && isinf(ye[6]) && isnan(ye[7]));
    for (int i = 0; i < 8; i++) {
        float s = cpu_ref_expf(edge[i]);
        assert_true(memcmp(&s, &ye[i], 4) == 0 || (isnan(s) && isnan(ye[i])));
    }
    free(x);
    free(y);
}

/* Softmax and SiLU from their specification (cpu_matmul.h), with cpu_ref_expf (checked
 * above); the dot/axpy row helpers from the canonical dot and fmaf.  All bit for bit. */
static void test_attention_pieces(void **st) {
    use_isa(st);
    enum { HD = 64, M = 45 };
    static float q[HD + 3], kv[M * 80], out[M], y[HD + 3], yr[HD + 3], a[M];
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        kv[i] = frand();
    for (int i = 0; i < HD + 3; i++)
        q[i] = frand();
    for (int n = 61; n <= HD + 3; n++) /* head dims with and without a tail */
        for (int m = 1; m <= M; m += 11) {
            cpu_dot_rows(out, q, kv, 80, m, n, 0.125f);
            for (int i = 0; i < m; i++) {
                float want = canon_dot(q, kv + (size_t)i * 80, CPU_F32, 0, n) * 0.125f;
                if (memcmp(&want, &out[i], 4))
                    fail_msg("cpu_dot_rows m %d n %d row %d: %.9g vs %.9g", m, n, i, out[i], want);
            }
            for (int i = 0; i < m; i++)
                a[i] = frand();
            for (int i = 0; i < n; i++)
                y[i] = yr[i] = frand();
            cpu_axpy_rows(y, a, kv, 80, m, n);
            for (int i = 0; i < m; i++)
                for (int c = 0; c < n; c++)
                    yr[c] = fmaf(a[i], kv[(size_t)i * 80 + c], yr[c]);
            assert_memory_equal(y, yr, (size_t)n * 4);
            /* bf16 K/V rows (a bf16 KV cache): the same arithmetic on the widened values */
            static uint16_t kb[M * 80];
            static float kf[M * 80];
            cpu_f32_to_bf16_row(kb, kv, M * 80);
            for (int i = 0; i < M * 80; i++) {
                kf[i] = my_bf16(kb[i]);
                float d = fabsf(kf[i] - kv[i]); /* round to nearest: within half a bf16 ulp */
                if (d > fabsf(kv[i]) * 0x1p-8f)
                    fail_msg("cpu_f32_to_bf16_row(%.9g) = %.9g", kv[i], kf[i]);
            }
            cpu_dot_rows_bf16(out, q, kb, 80, m, n, 0.125f);
            for (int i = 0; i < m; i++) {
                float want = canon_dot(q, kf + (size_t)i * 80, CPU_F32, 0, n) * 0.125f;
                if (memcmp(&want, &out[i], 4))
                    fail_msg("cpu_dot_rows_bf16 m %d n %d row %d: %.9g vs %.9g", m, n, i, out[i],
                             want);
            }
            for (int i = 0; i < n; i++)
                y[i] = yr[i] = frand();
            cpu_axpy_rows_bf16(y, a, kb, 80, m, n);
            for (int i = 0; i < m; i++)
                for (int c = 0; c < n; c++)
                    yr[c] = fmaf(a[i], kf[(size_t)i * 80 + c], yr[c]);
            assert_memory_equal(y, yr, (size_t)n * 4);
        }
    /* many heads at once (cpu_dot_rows_heads / cpu_axpy_rows_heads), in runs sharing K/V rows
     * (a GQA group each: 7 + 7 is Qwen2.5-0.5B's, 7 x 4 the 7B's): each head equal to its
     * one-head call, whatever the grouping (pairs sharing a load, odd heads paired across
     * runs, the last odd one alone, the tails of m and n) */
    static const int runs[][5] = {{1}, {2}, {3}, {5}, {6}, {7}, {7, 7}, {7, 7, 7, 7}, {1, 1, 1},
                                  {3, 5}, {2, 1, 4}, {8, 8}, {13},
                                  {14, 14, 14, 14, 14}}; /* 70: more than one call's worth */
    for (size_t ri = 0; ri < sizeof runs / sizeof runs[0]; ri++)
        for (int bf = 0; bf < 2; bf++)
            for (int n = 57; n <= 72; n += 5)
                for (int m = 1; m <= M; m += 4) {
                    enum { MH = 70, ST = 80 + 4 * 16 };
                    static uint16_t kb[M * ST];
                    static float kf[M * ST], qh[MH][80], oh[MH][M], rh[MH][M], yh[MH][80],
                        wh[MH][80], ah[MH][M];
                    for (int i = 0; i < M * ST; i++)
                        kf[i] = frand();
                    cpu_f32_to_bf16_row(kb, kf, M * ST);
                    float *out_p[MH], *y_p[MH];
                    const float *q_p[MH], *a_p[MH];
                    const void *rows_p[MH];
                    int nh = 0;
                    for (int r = 0; r < 5 && runs[ri][r]; r++)
                        for (int g = 0; g < runs[ri][r]; g++, nh++) {
                            rows_p[nh] = bf ? (const void *)(kb + 16 * r) : (const void *)(kf + 16 * r);
                            for (int i = 0; i < n; i++)
                                qh[nh][i] = frand(), yh[nh][i] = wh[nh][i] = frand();
                            for (int i = 0; i < m; i++)
                                ah[nh][i] = frand();
                            out_p[nh] = oh[nh];
                            y_p[nh] = yh[nh];
                            q_p[nh] = qh[nh];
                            a_p[nh] = ah[nh];
                        }
                    cpu_dot_rows_heads(out_p, q_p, rows_p, nh, bf, ST, m, n, 0.125f);
                    cpu_axpy_rows_heads(y_p, a_p, rows_p, nh, bf, ST, m, n);
                    for (int h = 0; h < nh; h++) {
                        if (bf) {
                            cpu_dot_rows_bf16(rh[h], qh[h], rows_p[h], ST, m, n, 0.125f);
                            cpu_axpy_rows_bf16(wh[h], ah[h], rows_p[h], ST, m, n);
                        } else {
                            cpu_dot_rows(rh[h], qh[h], rows_p[h], ST, m, n, 0.125f);
                            cpu_axpy_rows(wh[h], ah[h], rows_p[h], ST, m, n);
                        }
                        if (memcmp(oh[h], rh[h], (size_t)m * 4))
                            fail_msg("cpu_dot_rows_heads run set %zu head %d of %d bf16 %d m %d "
                                     "n %d differs",
                                     ri, h, nh, bf, m, n);
                        if (memcmp(yh[h], wh[h], (size_t)n * 4))
                            fail_msg("cpu_axpy_rows_heads run set %zu head %d of %d bf16 %d m %d "
                                     "n %d differs",
                                     ri, h, nh, bf, m, n);
                    }
                }
    { /* round to nearest even, NaN stays NaN */
        float f[4] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -2.5f, NAN};
        uint16_t h[4];
        cpu_f32_to_bf16_row(h, f, 4);
        assert_int_equal(h[0], 0x3f80); /* tie: to even (down) */
        assert_int_equal(h[1], 0x3f82); /* tie: to even (up) */
        assert_int_equal(h[2], 0xc020);
        assert_true(isnan(my_bf16(h[3])));
    }
    for (int n = 1; n <= 70; n += 3) {
        float s[70], r[70], l[8] = {0};
        for (int i = 0; i < n; i++)
            s[i] = r[i] = frand() * 20;
        cpu_softmax(s, n);
        float mx = -INFINITY;
        for (int i = 0; i < n; i++)
            mx = r[i] > mx ? r[i] : mx;
        int i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++)
                l[j] += r[i + j] = cpu_ref_expf(r[i + j] - mx);
        float sum = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
        for (; i < n; i++)
            sum += r[i] = cpu_ref_expf(r[i] - mx);
        double tot = 0;
        for (i = 0; i < n; i++) {
            r[i] = r[i] / sum;
            tot += s[i];
        }
        assert_memory_equal(s, r, (size_t)n * 4);
        assert_true(fabs(tot - 1.0) < 1e-5);
    }
    /* cpu_softmax_exp (the chunk softmax, 16 lanes at a time on AVX-512) equals its scalar
     * reference bit for bit, out-of-range inputs included: exp(-inf) = 0, below -87.3 -> 0 */
    for (int n = 1; n <= 70; n += 5) {
        float s[70], r[70], ms, mr;
        for (int i = 0; i < n; i++)
            s[i] = r[i] = i % 7 == 3 ? -INFINITY : i % 5 == 1 ? -150.0f : frand() * 60;
        float ls = cpu_softmax_exp(s, n, &ms), lr = cpu_ref_softmax_exp(r, n, &mr);
        assert_memory_equal(&ms, &mr, 4);
        assert_memory_equal(&ls, &lr, 4);
        assert_memory_equal(s, r, (size_t)n * 4);
    }
    float g[37], u[37], gr[37];
    for (int i = 0; i < 37; i++)
        g[i] = gr[i] = frand() * 30, u[i] = frand();
    cpu_silu_mul(g, u, 37);
    for (int i = 0; i < 37; i++) {
        float want = gr[i] / (1.0f + cpu_ref_expf(-gr[i])) * u[i];
        assert_memory_equal(&g[i], &want, 4);
    }
}

/* ---- pool ------------------------------------------------------------------------ */

static atomic_int g_hits[1000];
static void count_task(void *ctx, int t) {
    (void)ctx;
    atomic_fetch_add(&g_hits[t], 1);
}

static void test_pool(void **st) {
    (void)st;
    for (int threads = 1; threads <= 4; threads++) {
        cpu_pool *p = cpu_pool_init(threads);
        assert_int_equal(cpu_pool_threads(p), threads);
        for (int rep = 0; rep < 200; rep++) {
            int n = 1 + rep * 5 % 1000;
            for (int i = 0; i < n; i++)
                atomic_store(&g_hits[i], 0);
            cpu_pool_run(p, n, count_task, NULL);
            for (int i = 0; i < n; i++)
                assert_int_equal(atomic_load(&g_hits[i]), 1);
        }
        cpu_pool_free(p);
    }
}

/* each test once per ISA, named for it */
#define ISA_TEST(fn, isa, name)                                                                    \
    { #fn "_" name, fn, NULL, NULL, (void *)&isa }
#define PER_ISA(fn)                                                                                \
    ISA_TEST(fn, ISA_SCALAR, "scalar"), ISA_TEST(fn, ISA_AVX2, "avx2"),                            \
        ISA_TEST(fn, ISA_AVX512F, "avx512f"), ISA_TEST(fn, ISA_AVX512BF16, "avx512bf16"),          \
        ISA_TEST(fn, ISA_AVX512BF16_FAST, "avx512bf16_fast")

int main(void) {
    /* clang-format off */
    const struct CMUnitTest tests[] = {
        PER_ISA(test_matmul),
        ISA_TEST(test_matmul_equals_ref, ISA_AVX2, "avx2"),
        PER_ISA(test_matmul_batch),
        PER_ISA(test_vector_ops),
        PER_ISA(test_conversions),
        PER_ISA(test_exp),
        PER_ISA(test_attention_pieces),
        cmocka_unit_test(test_pool),
    };
    /* clang-format on */
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    if (failed == 0 && g_skipped) {
        fprintf(stderr, "SKIPPED: %d test(s) need an ISA this CPU lacks (see above)\n", g_skipped);
        return 77;
    }
    return failed;
}
