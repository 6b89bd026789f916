/*
 * cpu_avx512bf16 — the bf16-weight matmul on AVX512_BF16 (`vdpbf16ps`), the "bf16xP dot" of
 * cpu_matmul.h.  Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 (CMakeLists.txt):
 * nothing here runs unless cpu_isa_get() chose an avx512bf16 ISA by cpuid.
 *
 * The activations are split once per matmul call into P bf16 parts (P = 3 for avx512bf16,
 * 1 for avx512bf16-fast): x0 = bf16(x), x1 = bf16(x - x0), x2 = bf16(x - x0 - x1) (round to
 * nearest even), stored per token as [x0 (Kp) | x1 (Kp) | x2 (Kp)] with Kp = K rounded up to
 * 32 and zeros after K.  Each output is then
 *   16 lane accumulators: for every 32-block b of k and every part p in order,
 *   acc = dpbf16(acc, xp_b, w_b) (the tail block of w masked to zeros);
 *   t[i] = acc[i] + acc[i + 8]; s = ((t0+t4)+(t2+t6)) + ((t1+t5)+(t3+t7)); s + bias.
 * Every (row, token) follows that sequence whatever the tile, the batch or the thread, so
 * the results are batch-invariant on this ISA; with P = 3 they differ from the canonical f32
 * dot of the AVX2 and scalar paths by rounding only (x is carried to 24 significant bits,
 * every bf16 x bf16 product is exact in f32); with P = 1 the activations are rounded to bf16,
 * as llama.cpp's bf16 path does (relative error up to 2^-9 per product).
 */
#include "kernels/cpu/cpu_matmul.h"

#include <immintrin.h>
#include <string.h>

#define NT_MAX 6 /* tokens per register tile: 4 rows x 6 tokens = 24 accumulators */

size_t cpu_bf16x_stride(int K, int parts) {
    return (size_t)parts * (((size_t)K + 31) & ~(size_t)31);
}

void cpu_bf16x_split(uint16_t *xs, const float *x, int T, int K, int parts) {
    const size_t kp = cpu_bf16x_stride(K, 1);
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * K;
        uint16_t *h = xs + (size_t)t * parts * kp;
        for (size_t k = 0; k < kp; k += 16) {
            int rem = K - (int)k;
            __mmask16 m =
                rem >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (rem > 0 ? rem : 0)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(m, xr + k);
            for (int part = 0; part < parts; part++) {
                __m256bh vh = _mm512_cvtneps_pbh(v);
                _mm256_storeu_si256((__m256i *)(h + part * kp + k), (__m256i)vh);
                /* bf16 -> f32 is exact (the high half of the bits); the residual is exact too */
                v = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                         _mm512_cvtepu16_epi32((__m256i)vh), 16)));
            }
        }
    }
}

static inline float reduce16(__m512 a) {
    __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

/* NR rows (n0..) x NT tokens (t0..) of y (stride N); w rows of K bf16, xs tokens of stride
 * xst.  pf: prefetch the rows `pf` ahead (0: none). */
static inline __attribute__((always_inline)) void tile(const int NR, const int NT, const int NP,
                                                       float *y, int N, const uint16_t *xs,
                                                       size_t xst, const uint16_t *w,
                                                       const float *bias, int n0, int K, int pf) {
    const size_t kp = xst / NP;
    const uint16_t *wr[8];
    for (int r = 0; r < NR; r++)
        wr[r] = w + (size_t)(n0 + r) * K;
    __m512 acc[8][NT_MAX];
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++)
            acc[r][t] = _mm512_setzero_ps();
    const char *next = (const char *)(w + (size_t)(n0 + pf) * K);
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        if (pf)
            for (int r = 0; r < NR; r++)
                _mm_prefetch(next + ((size_t)r * K + k) * 2, _MM_HINT_T0);
        __m512bh wv[8];
        for (int r = 0; r < NR; r++)
            wv[r] = (__m512bh)_mm512_loadu_si512(wr[r] + k);
        for (int t = 0; t < NT; t++) {
            const uint16_t *xh = xs + (size_t)t * xst + k;
            for (int part = 0; part < NP; part++) {
                __m512bh h = (__m512bh)_mm512_loadu_si512(xh + part * kp);
                for (int r = 0; r < NR; r++)
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], h, wv[r]);
            }
        }
    }
    if (k < K) { /* tail block: w masked to zeros, x is zero-padded */
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv[8];
        for (int r = 0; r < NR; r++)
            wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(m, wr[r] + k);
        for (int t = 0; t < NT; t++) {
            const uint16_t *xh = xs + (size_t)t * xst + k;
            for (int part = 0; part < NP; part++) {
                __m512bh h = (__m512bh)_mm512_loadu_si512(xh + part * kp);
                for (int r = 0; r < NR; r++)
                    acc[r][t] = _mm512_dpbf16_ps(acc[r][t], h, wv[r]);
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
        tile(NR, 1, NP, __VA_ARGS__);                                                              \
        break;                                                                                     \
    case 2:                                                                                        \
        tile(NR, 2, NP, __VA_ARGS__);                                                              \
        break;                                                                                     \
    case 3:                                                                                        \
        tile(NR, 3, NP, __VA_ARGS__);                                                              \
        break;                                                                                     \
    case 4:                                                                                        \
        tile(NR, 4, NP, __VA_ARGS__);                                                              \
        break;                                                                                     \
    case 5:                                                                                        \
        tile(NR, 5, NP, __VA_ARGS__);                                                              \
        break;                                                                                     \
    default:                                                                                       \
        tile(NR, 6, NP, __VA_ARGS__);                                                              \
        break;                                                                                     \
    }

static inline __attribute__((always_inline)) void rows_np(const int NP, float *y, int N,
                                                          const uint16_t *xs, int T,
                                                          const uint16_t *w, const float *bias,
                                                          int n_beg, int n_end, int K, int stream) {
    const size_t xst = cpu_bf16x_stride(K, NP);
    /* streaming (decode-sized T): each 4-row group once, every token against it while it is
     * in L1; the rows PF ahead are prefetched.  Larger T: token chunks outer, so one chunk of
     * x and the task's rows stay in L2. */
    const int pf = stream ? 4 * 3 : 0;
    if (stream) {
        int n = n_beg;
        /* one token: 8 rows at a time, 8 independent chains of dependent vdpbf16ps (NP per
         * 32-k block each) to hide their latency; the per-row arithmetic is the same */
        for (; T == 1 && n + 8 <= n_end; n += 8)
            tile(8, 1, NP, y, N, xs, xst, w, bias, n, K, n + 8 + 16 <= N ? 16 : 0);
        for (; n + 4 <= n_end; n += 4)
            for (int t = 0; t < T; t += NT_MAX) {
                int nt = T - t < NT_MAX ? T - t : NT_MAX;
                TILE_NT(4, nt, y + (size_t)t * N, N, xs + (size_t)t * xst, xst, w, bias, n, K,
                        t == 0 && n + 4 + pf <= N ? pf : 0);
            }
        for (; n < n_end; n++)
            for (int t = 0; t < T; t += NT_MAX) {
                int nt = T - t < NT_MAX ? T - t : NT_MAX;
                TILE_NT(1, nt, y + (size_t)t * N, N, xs + (size_t)t * xst, xst, w, bias, n, K, 0);
            }
        return;
    }
    for (int t = 0; t < T; t += NT_MAX) {
        int nt = T - t < NT_MAX ? T - t : NT_MAX;
        int n = n_beg;
        for (; n + 4 <= n_end; n += 4)
            TILE_NT(4, nt, y + (size_t)t * N, N, xs + (size_t)t * xst, xst, w, bias, n, K, 0);
        for (; n < n_end; n++)
            TILE_NT(1, nt, y + (size_t)t * N, N, xs + (size_t)t * xst, xst, w, bias, n, K, 0);
    }
}

void cpu_bf16x_rows(float *y, int N, const uint16_t *xs, int T, const uint16_t *w,
                    const float *bias, int n_beg, int n_end, int K, int stream, int parts) {
    if (parts == 1)
        rows_np(1, y, N, xs, T, w, bias, n_beg, n_end, K, stream);
    else
        rows_np(3, y, N, xs, T, w, bias, n_beg, n_end, K, stream);
}
