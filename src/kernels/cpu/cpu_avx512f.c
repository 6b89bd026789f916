/*
 * cpu_avx512f — the bf16-weight matmul on AVX-512F f32 FMAs, the "f32x16 dot" of
 * cpu_matmul.h.  Compiled with -mavx512f only (CMakeLists.txt): nothing here runs unless
 * cpu_isa_get() chose the avx512f ISA by cpuid.
 *
 * The weights stay bf16 in memory and are widened in registers: a 512-bit load holds 32 bf16
 * of a row, i.e. 16 dwords (w[2j] low, w[2j+1] high); `vpslld 16` makes the even elements f32
 * and `vpandd 0xffff0000` the odd ones (one instruction per 16 weights).  The activations are
 * rearranged once per matmul call to match, per token and per 32-block of k:
 *   xp[b*32 + j] = x[b*32 + 2j], xp[b*32 + 16 + j] = x[b*32 + 2j + 1] (j < 16),
 * zeros after K (stride Kp = K rounded up to 32).  Each output is then
 *   16 lane accumulators: for every 32-block b, acc = fma(xe_b, we_b, acc) then
 *   acc = fma(xo_b, wo_b, acc) (the tail block of w zero-filled);
 *   t[i] = acc[i] + acc[i + 8]; s = ((t0+t4)+(t2+t6)) + ((t1+t5)+(t3+t7)); s + bias.
 * Every (row, token) follows that sequence whatever the tile, the batch or the thread, so
 * the results are batch-invariant on this ISA.  The products are exact f32 products of the
 * f32 activation and the bf16 weight and each step one fused multiply-add, as in the
 * canonical dot of the avx2 path: the same accuracy, a different summation order (16 lanes
 * over k = 2j / 2j+1 of each 32-block instead of 8 lanes over k mod 8), so the roundings
 * differ from avx2 / scalar.
 */
#include "kernels/cpu/cpu_matmul.h"

#include <immintrin.h>
#include <string.h>

#define NT_MAX 6 /* tokens per register tile: 4 rows x 6 tokens = 24 accumulators */

size_t cpu_f32x_stride(int K) {
    return ((size_t)K + 31) & ~(size_t)31;
}

void cpu_f32x_perm(float *xp, const float *x, int T, int K) {
    const size_t kp = cpu_f32x_stride(K);
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_add_epi32(ie, _mm512_set1_epi32(1));
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * K;
        float *d = xp + (size_t)t * kp;
        for (size_t k = 0; k < kp; k += 32) {
            int rem = K - (int)k, r0 = rem > 16 ? 16 : rem, r1 = rem > 32 ? 16 : rem - 16;
            __mmask16 m0 = r0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << r0) - 1);
            __mmask16 m1 = r1 >= 16  ? (__mmask16)0xffff
                           : r1 <= 0 ? (__mmask16)0
                                     : (__mmask16)((1u << r1) - 1);
            __m512 a = _mm512_maskz_loadu_ps(m0, xr + k),
                   b = _mm512_maskz_loadu_ps(m1, xr + k + 16);
            _mm512_storeu_ps(d + k, _mm512_permutex2var_ps(a, ie, b));
            _mm512_storeu_ps(d + k + 16, _mm512_permutex2var_ps(a, io, b));
        }
    }
}

static inline float reduce16(__m512 a) {
    __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

/* NR rows (n0..) x NT tokens of y (stride N); w rows of K bf16, xp tokens of stride xst.
 * pf: prefetch the rows `pf` ahead (0: none). */
static inline __attribute__((always_inline)) void tile(const int NR, const int NT, float *y, int N,
                                                       const float *xp, size_t xst,
                                                       const uint16_t *w, const float *bias, int n0,
                                                       int K, int pf) {
    const uint16_t *wr[8];
    for (int r = 0; r < NR; r++)
        wr[r] = w + (size_t)(n0 + r) * K;
    __m512 acc[8][NT_MAX];
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++)
            acc[r][t] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const char *next = (const char *)(w + (size_t)(n0 + pf) * K);
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        if (pf)
            for (int r = 0; r < NR; r++)
                _mm_prefetch(next + ((size_t)r * K + k) * 2, _MM_HINT_T0);
        __m512i wv[8];
        for (int r = 0; r < NR; r++)
            wv[r] = _mm512_loadu_si512(wr[r] + k);
        for (int t = 0; t < NT; t++) {
            __m512 xe = _mm512_loadu_ps(xp + (size_t)t * xst + k);
            for (int r = 0; r < NR; r++)
                acc[r][t] = _mm512_fmadd_ps(xe, _mm512_castsi512_ps(_mm512_slli_epi32(wv[r], 16)),
                                            acc[r][t]);
        }
        for (int t = 0; t < NT; t++) {
            __m512 xo = _mm512_loadu_ps(xp + (size_t)t * xst + k + 16);
            for (int r = 0; r < NR; r++)
                acc[r][t] = _mm512_fmadd_ps(xo, _mm512_castsi512_ps(_mm512_and_si512(wv[r], hi)),
                                            acc[r][t]);
        }
    }
    if (k < K) { /* tail block: w zero-filled (never read past the row), x is zero-padded */
        __m512i wv[8];
        for (int r = 0; r < NR; r++) {
            uint16_t buf[32] = {0};
            memcpy(buf, wr[r] + k, (size_t)(K - k) * 2);
            wv[r] = _mm512_loadu_si512(buf);
        }
        for (int t = 0; t < NT; t++) {
            __m512 xe = _mm512_loadu_ps(xp + (size_t)t * xst + k);
            __m512 xo = _mm512_loadu_ps(xp + (size_t)t * xst + k + 16);
            for (int r = 0; r < NR; r++) {
                acc[r][t] = _mm512_fmadd_ps(xe, _mm512_castsi512_ps(_mm512_slli_epi32(wv[r], 16)),
                                            acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(xo, _mm512_castsi512_ps(_mm512_and_si512(wv[r], hi)),
                                            acc[r][t]);
            }
        }
    }
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < NR; r++) {
            float s = reduce16(acc[r][t]);
            y[(size_t)t * N + n0 + r] = bias ? s + bias[n0 + r] : s;
        }
}

#define TILE_NT(NR, nt, ...)                                                                       \
    switch (nt) {                                                                                  \
    case 1:                                                                                        \
        tile(NR, 1, __VA_ARGS__);                                                                  \
        break;                                                                                     \
    case 2:                                                                                        \
        tile(NR, 2, __VA_ARGS__);                                                                  \
        break;                                                                                     \
    case 3:                                                                                        \
        tile(NR, 3, __VA_ARGS__);                                                                  \
        break;                                                                                     \
    case 4:                                                                                        \
        tile(NR, 4, __VA_ARGS__);                                                                  \
        break;                                                                                     \
    case 5:                                                                                        \
        tile(NR, 5, __VA_ARGS__);                                                                  \
        break;                                                                                     \
    default:                                                                                       \
        tile(NR, 6, __VA_ARGS__);                                                                  \
        break;                                                                                     \
    }

void cpu_f32x_rows(float *y, int N, const float *xp, int T, const uint16_t *w, const float *bias,
                   int n_beg, int n_end, int K, int stream) {
    const size_t xst = cpu_f32x_stride(K);
    /* streaming (decode-sized T): each 4-row group once, every token against it while it is
     * in L1; the rows PF ahead are prefetched.  Larger T: token chunks outer, so one chunk of
     * x and the task's rows stay in L1/L2. */
    const int pf = stream ? 4 * 3 : 0;
    if (stream) {
        int n = n_beg;
        /* one token: 8 rows at a time (8 independent accumulator chains) */
        for (; T == 1 && n + 8 <= n_end; n += 8)
            tile(8, 1, y, N, xp, xst, w, bias, n, K, n + 8 + 16 <= N ? 16 : 0);
        for (; n + 4 <= n_end; n += 4)
            for (int t = 0; t < T; t += NT_MAX) {
                int nt = T - t < NT_MAX ? T - t : NT_MAX;
                TILE_NT(4, nt, y + (size_t)t * N, N, xp + (size_t)t * xst, xst, w, bias, n, K,
                        t == 0 && n + 4 + pf <= N ? pf : 0);
            }
        for (; n < n_end; n++)
            for (int t = 0; t < T; t += NT_MAX) {
                int nt = T - t < NT_MAX ? T - t : NT_MAX;
                TILE_NT(1, nt, y + (size_t)t * N, N, xp + (size_t)t * xst, xst, w, bias, n, K, 0);
            }
        return;
    }
    for (int t = 0; t < T; t += NT_MAX) {
        int nt = T - t < NT_MAX ? T - t : NT_MAX;
        int n = n_beg;
        for (; n + 4 <= n_end; n += 4)
            TILE_NT(4, nt, y + (size_t)t * N, N, xp + (size_t)t * xst, xst, w, bias, n, K, 0);
        for (; n < n_end; n++)
            TILE_NT(1, nt, y + (size_t)t * N, N, xp + (size_t)t * xst, xst, w, bias, n, K, 0);
    }
}
