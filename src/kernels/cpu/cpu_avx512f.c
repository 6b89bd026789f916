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

/* ---- attention for two query heads that share the key / value rows (GQA) --------------
 * The same arithmetic as cpu_dot_rows / cpu_axpy_rows for each head, bit for bit (the
 * canonical dot's 8 lanes, the hsum8x8 tree; the value rows in position order), with twice
 * the independent accumulator chains and each key / value row loaded once for both heads. */

/* 8 elements of row r (f32 or bf16) at column d, in both 256-bit halves */
static inline __attribute__((always_inline)) __m512 kv_bcast8(const void *k, int bf16, size_t o) {
    if (bf16) {
        __m256i h = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)k + o)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_castpd_ps(
        _mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)((const float *)k + o))));
}

static inline __attribute__((always_inline)) __m512 kv_load16(const void *k, int bf16, size_t o) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)k + o))),
            16));
    return _mm512_loadu_ps((const float *)k + o);
}

static inline __attribute__((always_inline)) __m512 cat2(const float *a, const float *b) {
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_loadu_pd((const double *)a)),
                           _mm256_loadu_pd((const double *)b), 1));
}

/* the canonical tree of 8 accumulators at once (cpu_matmul.c's hsum8x8) */
static inline __attribute__((always_inline)) __m256 hsum8x8_(const __m256 *A) {
    __m256 x04 = _mm256_add_ps(_mm256_permute2f128_ps(A[0], A[4], 0x20),
                               _mm256_permute2f128_ps(A[0], A[4], 0x31));
    __m256 x15 = _mm256_add_ps(_mm256_permute2f128_ps(A[1], A[5], 0x20),
                               _mm256_permute2f128_ps(A[1], A[5], 0x31));
    __m256 x26 = _mm256_add_ps(_mm256_permute2f128_ps(A[2], A[6], 0x20),
                               _mm256_permute2f128_ps(A[2], A[6], 0x31));
    __m256 x37 = _mm256_add_ps(_mm256_permute2f128_ps(A[3], A[7], 0x20),
                               _mm256_permute2f128_ps(A[3], A[7], 0x31));
    __m256 y01 = _mm256_add_ps(_mm256_shuffle_ps(x04, x15, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(x04, x15, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 y23 = _mm256_add_ps(_mm256_shuffle_ps(x26, x37, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(x26, x37, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Positions [0, m & ~7) of cpu_dot_rows for heads q0 and q1 (n <= 128); returns how many. */
static inline __attribute__((always_inline)) int
dot_rows2_dt(float *out0, float *out1, const float *q0, const float *q1, const void *k, int bf16,
             size_t stride, int m, int n, float scale) {
    const int n8 = n & ~7;
    __m512 qz[16]; /* [q0 d..d+7 | q1 d..d+7] */
    for (int d = 0; d < n8; d += 8)
        qz[d / 8] = cat2(q0 + d, q1 + d);
    const __m256 sc = _mm256_set1_ps(scale);
    int i = 0;
    for (; i + 8 <= m; i += 8) {
        const size_t kb = (size_t)i * stride;
        __m512 A[8];
        for (int p = 0; p < 8; p++)
            A[p] = _mm512_setzero_ps();
        for (int d = 0; d < n8; d += 8)
            for (int p = 0; p < 8; p++)
                A[p] = _mm512_fmadd_ps(qz[d / 8], kv_bcast8(k, bf16, kb + (size_t)p * stride + d),
                                       A[p]);
        __m256 lo[8], hi[8];
        for (int p = 0; p < 8; p++) {
            lo[p] = _mm512_castps512_ps256(A[p]);
            hi[p] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(A[p]), 1));
        }
        __m256 s0 = hsum8x8_(lo), s1 = hsum8x8_(hi);
        if (n8 < n) { /* the tail of each dot, in order, before the scale */
            float t0[8], t1[8];
            _mm256_storeu_ps(t0, s0);
            _mm256_storeu_ps(t1, s1);
            for (int p = 0; p < 8; p++)
                for (int d = n8; d < n; d++) {
                    size_t o = kb + (size_t)p * stride + d;
                    float kv = bf16 ? cpu_ref_bf16_to_f32(((const uint16_t *)k)[o])
                                    : ((const float *)k)[o];
                    t0[p] = __builtin_fmaf(q0[d], kv, t0[p]);
                    t1[p] = __builtin_fmaf(q1[d], kv, t1[p]);
                }
            s0 = _mm256_loadu_ps(t0);
            s1 = _mm256_loadu_ps(t1);
        }
        _mm256_storeu_ps(out0 + i, _mm256_mul_ps(s0, sc));
        _mm256_storeu_ps(out1 + i, _mm256_mul_ps(s1, sc));
    }
    return i;
}

int cpu_x512_dot_rows2(float *out0, float *out1, const float *q0, const float *q1, const void *k,
                       int bf16, size_t stride, int m, int n, float scale) {
    if (n > 128) return 0;
    return bf16 ? dot_rows2_dt(out0, out1, q0, q1, k, 1, stride, m, n, scale)
                : dot_rows2_dt(out0, out1, q0, q1, k, 0, stride, m, n, scale);
}

/* Columns [0, n & ~63) of cpu_axpy_rows for heads y0 (weights a0) and y1 (a1); returns how
 * many. */
static inline __attribute__((always_inline)) int axpy_rows2_dt(float *y0, float *y1,
                                                               const float *a0, const float *a1,
                                                               const void *v, int bf16,
                                                               size_t stride, int m, int n) {
    int c = 0;
    for (; c + 64 <= n; c += 64) {
        __m512 c0[4], c1[4];
        for (int r = 0; r < 4; r++) {
            c0[r] = _mm512_loadu_ps(y0 + c + 16 * r);
            c1[r] = _mm512_loadu_ps(y1 + c + 16 * r);
        }
        for (int i = 0; i < m; i++) {
            const size_t vi = (size_t)i * stride + c;
            __m512 b0 = _mm512_set1_ps(a0[i]), b1 = _mm512_set1_ps(a1[i]);
            for (int r = 0; r < 4; r++) {
                __m512 vv = kv_load16(v, bf16, vi + 16 * r);
                c0[r] = _mm512_fmadd_ps(b0, vv, c0[r]);
                c1[r] = _mm512_fmadd_ps(b1, vv, c1[r]);
            }
        }
        for (int r = 0; r < 4; r++) {
            _mm512_storeu_ps(y0 + c + 16 * r, c0[r]);
            _mm512_storeu_ps(y1 + c + 16 * r, c1[r]);
        }
    }
    return c;
}

int cpu_x512_axpy_rows2(float *y0, float *y1, const float *a0, const float *a1, const void *v,
                        int bf16, size_t stride, int m, int n) {
    return bf16 ? axpy_rows2_dt(y0, y1, a0, a1, v, 1, stride, m, n)
                : axpy_rows2_dt(y0, y1, a0, a1, v, 0, stride, m, n);
}
