/*
 * fp8 — OCP FP8 e4m3 ("float8_e4m3fn": 1 sign, 4 exponent, 3 mantissa bits, bias 7, no
 * infinities, 0x7f / 0xff NaN, largest finite 448) on the host, exact: the element of an FP8
 * KV cache (kernels/backend.h BACKEND_F8E4M3).  Header-only.
 *   fp8_e4m3_to_f32:   the exact value (every e4m3 value is an f32).
 *   fp8_e4m3_from_f32: round to nearest, ties to even, saturating to +-448 (what CUDA's
 *                      __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) and vLLM's KV
 *                      cache write do); NaN stays NaN (0x7f with the sign).
 */
#ifndef DISAGG_KERNELS_FP8_H
#define DISAGG_KERNELS_FP8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define FP8_E4M3_MAX 448.0f

static inline float fp8_e4m3_to_f32(uint8_t b) {
    int s = b >> 7, e = (b >> 3) & 0xf, m = b & 7;
    float v;
    if (e == 0xf && m == 7) return s ? -NAN : NAN;
    if (e == 0)
        v = ldexpf((float)m, -9); /* subnormal: m / 8 * 2^-6 */
    else
        v = ldexpf((float)(8 + m), e - 10); /* (1 + m / 8) * 2^(e - 7) */
    return s ? -v : v;
}

static inline uint8_t fp8_e4m3_from_f32(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint8_t s = (uint8_t)((u >> 24) & 0x80);
    if (isnan(x)) return (uint8_t)(s | 0x7f);
    float a = fabsf(x);
    if (a >= FP8_E4M3_MAX) return (uint8_t)(s | 0x7e); /* saturate (and +-inf) */
    /* the spacing of e4m3 values around a: 2^-9 below 2^-6 (subnormals), else 2^(E - 3) */
    int E;
    frexpf(a, &E); /* a = f * 2^E, f in [0.5, 1): a in [2^(E-1), 2^E) */
    int ex = E - 1 < -6 ? -6 : E - 1;     /* the binade's exponent (subnormals: -6) */
    float q = ldexpf(a, 3 - ex);          /* a in units of the spacing: exact (power of 2) */
    float r = nearbyintf(q);              /* ties to even under the default rounding mode */
    if (r == 0.0f) return s;
    /* r units of 2^(ex - 3); r may have carried to 16 (the next binade) */
    if (ex == -6 && r < 8.0f) return (uint8_t)(s | (uint8_t)r); /* subnormal */
    if (r >= 16.0f) r *= 0.5f, ex++;
    int be = ex + 7, m = (int)r - 8;
    if (be > 15 || (be == 15 && m > 6)) return (uint8_t)(s | 0x7e);
    return (uint8_t)(s | (uint8_t)(be << 3) | (uint8_t)m);
}

#endif
