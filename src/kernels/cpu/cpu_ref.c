/*
 * cpu_ref — scalar reference kernels (and the fallback on CPUs without AVX2/FMA).
 * Compiled without AVX so it runs anywhere; follows the canonical dot of cpu_matmul.h
 * exactly (fmaf per lane, same horizontal-sum tree), so results equal the AVX2 path's.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("no-avx,no-avx2,no-fma,no-f16c")
#endif

#include "kernels/cpu/cpu_matmul.h"

#include <math.h>
#include <string.h>

float cpu_ref_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float cpu_ref_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13); /* inf / nan */
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float ref_load(const void *w, cpu_dtype dt, size_t i) {
    switch (dt) {
    case CPU_BF16:
        return cpu_ref_bf16_to_f32(((const uint16_t *)w)[i]);
    case CPU_F16:
        return cpu_ref_f16_to_f32(((const uint16_t *)w)[i]);
    default:
        return ((const float *)w)[i];
    }
}

static float ref_dot_any(const float *x, const void *w, cpu_dtype dt, size_t w_off, int n) {
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int k = 0;
    for (; k + 8 <= n; k += 8)
        for (int l = 0; l < 8; l++)
            a[l] = fmaf(x[k + l], ref_load(w, dt, w_off + k + l), a[l]);
    float s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    for (; k < n; k++)
        s = fmaf(x[k], ref_load(w, dt, w_off + k), s);
    return s;
}

void cpu_ref_matmul(float *y, const float *x, const void *w, cpu_dtype wt, const float *bias, int T,
                    int N, int K) {
    for (int t = 0; t < T; t++)
        for (int n = 0; n < N; n++) {
            float s = ref_dot_any(x + (size_t)t * K, w, wt, (size_t)n * K, K);
            y[(size_t)t * N + n] = bias ? s + bias[n] : s;
        }
}

float cpu_ref_dot(const float *a, const float *b, int n) {
    return ref_dot_any(a, b, CPU_F32, 0, n);
}

void cpu_ref_axpy(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++)
        y[i] = fmaf(a, x[i], y[i]);
}

void cpu_ref_row_to_f32(float *out, const void *row, cpu_dtype dt, int n) {
    for (int i = 0; i < n; i++)
        out[i] = ref_load(row, dt, (size_t)i);
}

/* ---- f32x16 dot (the avx512f path's arithmetic, in scalar code) ------------------- */

float cpu_ref_f32x_dot(const float *x, const uint16_t *w, int K) {
    float acc[16] = {0};
    for (int b = 0; b < K; b += 32)
        for (int e = 0; e < 2; e++) /* the even elements of the block, then the odd ones */
            for (int i = 0; i < 16; i++) {
                int k = b + 2 * i + e;
                float xv = k < K ? x[k] : 0.0f, wv = k < K ? cpu_ref_bf16_to_f32(w[k]) : 0.0f;
                acc[i] = fmaf(xv, wv, acc[i]);
            }
    float t[8];
    for (int i = 0; i < 8; i++)
        t[i] = acc[i] + acc[i + 8];
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

/* ---- bf16xP dot (the AVX512_BF16 path's arithmetic, in scalar code) ---------------- */

static float flush_denormal(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t cpu_ref_f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN (quiet) */
    uint32_t u;
    f = flush_denormal(f);
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

float cpu_ref_bf16x_dot(const float *x, const uint16_t *w, int K, int parts) {
    float acc[16] = {0};
    int kp = (K + 31) & ~31;
    for (int half = 0; half < parts * (kp / 32); half++) {
        int b = half / parts * 32, part = half % parts;
        for (int i = 0; i < 16; i++) {
            float p[2];
            for (int e = 0; e < 2; e++) {
                int k = b + 2 * i + e;
                float xv = k < K ? x[k] : 0.0f;
                uint16_t xb = cpu_ref_f32_to_bf16(xv);
                for (int q = 0; q < part; q++) {
                    xv = xv - cpu_ref_bf16_to_f32(xb);
                    xb = cpu_ref_f32_to_bf16(xv);
                }
                float wv = k < K ? flush_denormal(cpu_ref_bf16_to_f32(w[k])) : 0.0f;
                p[e] = flush_denormal(cpu_ref_bf16_to_f32(xb)) * wv; /* exact */
            }
            acc[i] = flush_denormal(acc[i] + p[1]);
            acc[i] = flush_denormal(acc[i] + p[0]);
        }
    }
    float t[8];
    for (int i = 0; i < 8; i++)
        t[i] = acc[i] + acc[i + 8];
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

/* ---- exp and the attention pieces (the AVX2 code does the same per lane) -------------- */

#define EXP_HI    88.3762626647949f  /* above: +inf (2^n would leave the exponent range) */
#define EXP_LO    -87.3365402221680f /* below: 0 */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1    0.693359375f
#define EXP_C2    -2.12194440e-4f
#define EXP_P0    1.9875691500E-4f
#define EXP_P1    1.3981999507E-3f
#define EXP_P2    8.3334519073E-3f
#define EXP_P3    4.1665795894E-2f
#define EXP_P4    1.6666665459E-1f
#define EXP_P5    5.0000001201E-1f

float cpu_ref_expf(float x) {
    if (x != x) return x;
    if (x > EXP_HI) return INFINITY;
    if (x < EXP_LO) return 0.0f;
    float n = rintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_C1, x);
    r = fmaf(n, -EXP_C2, r);
    float p = EXP_P0;
    p = fmaf(p, r, EXP_P1);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P5);
    float rr = r * r;
    float y = fmaf(p, rr, r) + 1.0f;
    uint32_t bits = (uint32_t)((int)n + 127) << 23;
    float sc;
    memcpy(&sc, &bits, 4);
    return y * sc;
}

void cpu_ref_silu_mul(float *g, const float *u, int n) {
    for (int i = 0; i < n; i++)
        g[i] = g[i] / (1.0f + cpu_ref_expf(-g[i])) * u[i];
}

void cpu_ref_dot_rows(float *out, const float *q, const float *k, size_t stride, int m, int n,
                      float scale) {
    for (int i = 0; i < m; i++)
        out[i] = cpu_ref_dot(q, k + (size_t)i * stride, n) * scale;
}

void cpu_ref_softmax(float *s, int n) {
    float mx;
    float sum = cpu_ref_softmax_exp(s, n, &mx);
    int i;
    for (i = 0; i < n; i++)
        s[i] = s[i] / sum;
}

float cpu_ref_softmax_exp(float *s, int n, float *max_out) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++)
        mx = s[i] > mx ? s[i] : mx;
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) {
            s[i + l] = cpu_ref_expf(s[i + l] - mx);
            a[l] += s[i + l];
        }
    float sum = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    for (; i < n; i++) {
        s[i] = cpu_ref_expf(s[i] - mx);
        sum += s[i];
    }
    *max_out = mx;
    return sum;
}

void cpu_ref_axpy_rows(float *y, const float *a, const float *v, size_t stride, int m, int n) {
    for (int i = 0; i < m; i++)
        cpu_ref_axpy(y, a[i], v + (size_t)i * stride, n);
}

void cpu_ref_dot_rows_bf16(float *out, const float *q, const uint16_t *k, size_t stride, int m,
                           int n, float scale) {
    for (int i = 0; i < m; i++) {
        const uint16_t *ki = k + (size_t)i * stride;
        float a[8] = {0};
        int d = 0;
        for (; d + 8 <= n; d += 8)
            for (int l = 0; l < 8; l++)
                a[l] = fmaf(q[d + l], cpu_ref_bf16_to_f32(ki[d + l]), a[l]);
        float s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        for (; d < n; d++)
            s = fmaf(q[d], cpu_ref_bf16_to_f32(ki[d]), s);
        out[i] = s * scale;
    }
}

void cpu_ref_axpy_rows_bf16(float *y, const float *a, const uint16_t *v, size_t stride, int m,
                            int n) {
    for (int i = 0; i < m; i++)
        for (int c = 0; c < n; c++)
            y[c] = fmaf(a[i], cpu_ref_bf16_to_f32(v[(size_t)i * stride + c]), y[c]);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
