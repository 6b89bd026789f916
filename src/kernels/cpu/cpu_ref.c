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

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
