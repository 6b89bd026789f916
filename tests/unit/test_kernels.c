/*
 * test_kernels — the CPU kernels: AVX2 and scalar reference give bit-identical matmuls
 * for every weight dtype and awkward shapes (K not a multiple of 8, N not a multiple of 4,
 * 1..8 tokens, with and without bias); both agree with a double-precision naive product;
 * a matmul row does not depend on the other rows in the batch or the thread count; f16/bf16
 * conversions match known encodings (incl. subnormals, infinities); the pool runs every
 * task exactly once.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_matmul.h"
#include "kernels/cpu/cpu_pool.h"

static uint64_t g_rng = 0x1234567;
static float frand(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((g_rng >> 40) & 0xffffff) / 16777216.0f * 2.0f - 1.0f;
}

/* w as dtype from f32 values (bf16 by truncation, f16 via the hardware-free path: values are
 * chosen exactly representable). */
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
        } else { /* f16 of a value k/1024 with |k| < 1024: exact */
            float v = f[i];
            int k = (int)lrintf(v * 1024.0f);
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

static float wval(const void *w, cpu_dtype dt, size_t i) {
    if (dt == CPU_F32) return ((const float *)w)[i];
    if (dt == CPU_BF16) return cpu_ref_bf16_to_f32(((const uint16_t *)w)[i]);
    return cpu_ref_f16_to_f32(((const uint16_t *)w)[i]);
}

static void test_matmul_avx2_vs_ref(void **st) {
    (void)st;
    if (cpu_isa_force(CPU_ISA_AVX2) != 0) skip();
    cpu_pool *pool = cpu_pool_init(3);
    int Ks[] = {8, 13, 64, 100, 896}, Ns[] = {1, 4, 7, 33, 150};
    for (int dt = 0; dt < 3; dt++)
        for (size_t ki = 0; ki < 5; ki++)
            for (size_t ni = 0; ni < 5; ni++)
                for (int T = 1; T <= 8; T += (T < 4 ? 1 : 4)) {
                    int K = Ks[ki], N = Ns[ni];
                    float *wf = malloc((size_t)N * K * 4), *x = malloc((size_t)T * K * 4),
                          *b = malloc((size_t)N * 4);
                    for (int i = 0; i < N * K; i++)
                        wf[i] = (float)((int)(frand() * 1000)) / 1024.0f;
                    for (int i = 0; i < T * K; i++)
                        x[i] = frand();
                    for (int i = 0; i < N; i++)
                        b[i] = frand();
                    void *w = make_weights((cpu_dtype)dt, wf, (size_t)N * K);
                    float *ya = malloc((size_t)T * N * 4), *yr = malloc((size_t)T * N * 4);
                    for (int withb = 0; withb < 2; withb++) {
                        cpu_matmul(pool, ya, x, w, (cpu_dtype)dt, withb ? b : NULL, T, N, K);
                        cpu_ref_matmul(yr, x, w, (cpu_dtype)dt, withb ? b : NULL, T, N, K);
                        if (memcmp(ya, yr, (size_t)T * N * 4))
                            fail_msg("avx2 != scalar: dtype %s T %d N %d K %d bias %d",
                                     cpu_dtype_name((cpu_dtype)dt), T, N, K, withb);
                        for (int t = 0; t < T; t++)
                            for (int n = 0; n < N; n++) {
                                double s = withb ? b[n] : 0, mag = fabs(s);
                                for (int k = 0; k < K; k++) {
                                    double p = (double)x[t * K + k] *
                                               wval(w, (cpu_dtype)dt, (size_t)n * K + k);
                                    s += p;
                                    mag += fabs(p);
                                }
                                if (fabs(ya[t * N + n] - s) > 1e-6 * mag + 1e-7)
                                    fail_msg("dtype %s T %d N %d K %d: %g vs exact %g",
                                             cpu_dtype_name((cpu_dtype)dt), T, N, K, ya[t * N + n],
                                             s);
                            }
                        /* each row alone equals its row in the batch */
                        for (int t = 0; t < T; t++) {
                            cpu_matmul(NULL, yr, x + (size_t)t * K, w, (cpu_dtype)dt,
                                       withb ? b : NULL, 1, N, K);
                            if (memcmp(yr, ya + (size_t)t * N, (size_t)N * 4))
                                fail_msg("row %d of a %d-row batch differs from the row alone (N "
                                         "%d K %d)",
                                         t, T, N, K);
                        }
                    }
                    free(wf);
                    free(x);
                    free(b);
                    free(w);
                    free(ya);
                    free(yr);
                }
    cpu_pool_free(pool);
}

static void test_matmul_batch(void **st) {
    (void)st;
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
    for (int o = 0; o < 3; o++)
        assert_memory_equal(y1[o], y2[o], sizeof(float) * (size_t)(o == 2 ? 1 : T) * Ns[o]);
    cpu_pool_free(pool);
}

static void test_vector_ops(void **st) {
    (void)st;
    float a[37], b[37], y1[37], y2[37];
    for (int i = 0; i < 37; i++)
        a[i] = frand(), b[i] = frand(), y1[i] = y2[i] = frand();
    cpu_isa prev = cpu_isa_get();
    for (int n = 1; n <= 37; n += 3)
        assert_true(cpu_dot(a, b, n) == cpu_ref_dot(a, b, n));
    /* the GQA helpers equal per-head cpu_dot / cpu_axpy, bit for bit */
    float q[7 * 37], o1[7], yh[7 * 37], yr[7 * 37], wts[7];
    for (int i = 0; i < 7 * 37; i++)
        q[i] = frand(), yh[i] = yr[i] = frand();
    for (int h = 0; h < 7; h++)
        wts[h] = frand();
    for (int n = 5; n <= 37; n += 16) {
        cpu_dot_heads(o1, q, b, 7, n);
        for (int h = 0; h < 7; h++)
            assert_true(o1[h] == cpu_dot(q + h * n, b, n));
        cpu_axpy_heads(yh, wts, a, 7, n);
        for (int h = 0; h < 7; h++)
            cpu_axpy(yr + h * n, wts[h], a, n);
        assert_memory_equal(yh, yr, sizeof(float) * 7 * (size_t)n);
    }
    cpu_axpy(y1, 0.37f, a, 37);
    cpu_ref_axpy(y2, 0.37f, a, 37);
    assert_memory_equal(y1, y2, sizeof y1);
    cpu_isa_force(prev);
}

static void test_conversions(void **st) {
    (void)st;
    struct {
        uint16_t h;
        float f;
    } f16[] = {{0x3c00, 1.0f},          {0xc000, -2.0f},        {0x7bff, 65504.0f},
               {0x0001, 5.9604645e-8f}, {0x03ff, 6.097555e-5f}, {0x0400, 6.1035156e-5f},
               {0x8000, -0.0f},         {0x3555, 0.33325195f}};
    for (size_t i = 0; i < sizeof f16 / sizeof f16[0]; i++)
        assert_true(cpu_ref_f16_to_f32(f16[i].h) == f16[i].f);
    assert_true(isinf(cpu_ref_f16_to_f32(0x7c00)) && cpu_ref_f16_to_f32(0x7c00) > 0);
    assert_true(isnan(cpu_ref_f16_to_f32(0x7e00)));
    assert_true(cpu_ref_bf16_to_f32(0x3f80) == 1.0f);
    assert_true(cpu_ref_bf16_to_f32(0xc0a0) == -5.0f);
    /* the AVX2 row conversion equals the reference for all 65536 f16 / bf16 patterns */
    uint16_t all[65536];
    float r1[65536], r2[65536];
    for (int i = 0; i < 65536; i++)
        all[i] = (uint16_t)i;
    for (int dt = 1; dt < 3; dt++) {
        cpu_row_to_f32(r1, all, (cpu_dtype)dt, 65536);
        cpu_ref_row_to_f32(r2, all, (cpu_dtype)dt, 65536);
        for (int i = 0; i < 65536; i++)
            if (memcmp(&r1[i], &r2[i], 4) && !(isnan(r1[i]) && isnan(r2[i])))
                fail_msg("%s 0x%04x: avx2 %g ref %g", cpu_dtype_name((cpu_dtype)dt), i, r1[i],
                         r2[i]);
    }
}

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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_avx2_vs_ref),
        cmocka_unit_test(test_matmul_batch),
        cmocka_unit_test(test_vector_ops),
        cmocka_unit_test(test_conversions),
        cmocka_unit_test(test_pool),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
