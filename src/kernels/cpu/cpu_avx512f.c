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

void cpu_f32x_perm(float *xp, const float *x, int T, int K, int interleave) {
    const size_t kp = cpu_f32x_stride(K);
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_add_epi32(ie, _mm512_set1_epi32(1));
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * K;
        float *d = xp + (size_t)t * (interleave ? 32 : kp);
        const size_t kst = interleave ? (size_t)T : 1; /* block b of token t at d + b*32*kst */
        for (size_t k = 0; k < kp; k += 32) {
            int rem = K - (int)k, r0 = rem > 16 ? 16 : rem, r1 = rem > 32 ? 16 : rem - 16;
            __mmask16 m0 = r0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << r0) - 1);
            __mmask16 m1 = r1 >= 16  ? (__mmask16)0xffff
                           : r1 <= 0 ? (__mmask16)0
                                     : (__mmask16)((1u << r1) - 1);
            __m512 a = _mm512_maskz_loadu_ps(m0, xr + k),
                   b = _mm512_maskz_loadu_ps(m1, xr + k + 16);
            _mm512_storeu_ps(d + k * kst, _mm512_permutex2var_ps(a, ie, b));
            _mm512_storeu_ps(d + k * kst + 16, _mm512_permutex2var_ps(a, io, b));
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

/* The streaming tile (decode batches of 2..8 tokens): NR rows (n0..) x NT tokens of y
 * (stride N); xk: the interleaved activations (block b of token t at xk + (b*T + t) * 32,
 * tokens t0.. of the tile first), so one pointer serves every token.  Per 32-block the even
 * weights are widened once per row, used for all NT tokens and dropped, then the odd ones
 * (the raw row reloaded from L1): NR*NT accumulators + NR widened rows stay in registers
 * (the 4 x 6 tile above holds 24 + 8 and has the compiler redo the widening per token). The
 * same FMA sequence per (row, token) as tile(). pf: prefetch the rows `pf` ahead. */
static inline __attribute__((always_inline)) void tile_s(const int NR, const int NT, float *y,
                                                         int N, const float *xk, int T,
                                                         const uint16_t *w, const float *bias,
                                                         int n0, int K, int pf) {
    const uint16_t *w0 = w + (size_t)n0 * K;
    __m512 acc[8][8];
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++)
            acc[r][t] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const size_t xb = (size_t)T * 32; /* floats per 32-block of all tokens */
    int k = 0;
    for (; k + 32 <= K; k += 32, xk += xb) {
        if (pf)
            for (int r = 0; r < NR; r++)
                _mm_prefetch((const char *)(w0 + (size_t)(pf + r) * K + k), _MM_HINT_T0);
        __m512 wv[8];
        for (int r = 0; r < NR; r++)
            wv[r] = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_loadu_si512(w0 + (size_t)r * K + k), 16));
        for (int t = 0; t < NT; t++) {
            __m512 xe = _mm512_loadu_ps(xk + t * 32);
            for (int r = 0; r < NR; r++)
                acc[r][t] = _mm512_fmadd_ps(xe, wv[r], acc[r][t]);
        }
        for (int r = 0; r < NR; r++)
            wv[r] = _mm512_castsi512_ps(
                _mm512_and_si512(_mm512_loadu_si512(w0 + (size_t)r * K + k), hi));
        for (int t = 0; t < NT; t++) {
            __m512 xo = _mm512_loadu_ps(xk + t * 32 + 16);
            for (int r = 0; r < NR; r++)
                acc[r][t] = _mm512_fmadd_ps(xo, wv[r], acc[r][t]);
        }
    }
    if (k < K) { /* tail block: w zero-filled (never read past the row), x is zero-padded */
        for (int r = 0; r < NR; r++) {
            uint16_t buf[32] = {0};
            memcpy(buf, w0 + (size_t)r * K + k, (size_t)(K - k) * 2);
            __m512i wr = _mm512_loadu_si512(buf);
            __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(wr, 16));
            __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(wr, hi));
            for (int t = 0; t < NT; t++) {
                acc[r][t] = _mm512_fmadd_ps(_mm512_loadu_ps(xk + t * 32), we, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(_mm512_loadu_ps(xk + t * 32 + 16), wo, acc[r][t]);
            }
        }
    }
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < NR; r++) {
            float s = reduce16(acc[r][t]);
            y[(size_t)t * N + n0 + r] = bias ? s + bias[n0 + r] : s;
        }
}

/* rows [n, n_end) of the streaming path for T (2..8) tokens: NR-row tiles of all T tokens
 * (NR * T <= 24 accumulators), then one row at a time; 7 and 8 tokens in two tiles over the
 * same 4 rows (a 3 x 8 tile measured slower: its x stream per row is a third longer) */
static void rows_stream(float *y, int N, const float *xp, int T, const uint16_t *w,
                        const float *bias, int n, int n_end, int K) {
#define TS_CASE(NR_, T_)                                                                           \
    case T_:                                                                                       \
        for (; n + NR_ <= n_end; n += NR_)                                                         \
            tile_s(NR_, T_, y, N, xp, T, w, bias, n, K, n + NR_ + 12 <= N ? 12 : 0);               \
        for (; n < n_end; n++)                                                                     \
            tile_s(1, T_, y, N, xp, T, w, bias, n, K, 0);                                          \
        break;
    switch (T) {
        TS_CASE(8, 2)
        TS_CASE(6, 3)
        TS_CASE(4, 4)
        TS_CASE(4, 5)
        TS_CASE(4, 6)
    default: /* 7, 8: 4 rows x 6 tokens, then the same rows (in L1) for the other 1-2 tokens */
        for (; n + 4 <= n_end; n += 4) {
            tile_s(4, 6, y, N, xp, T, w, bias, n, K, n + 4 + 12 <= N ? 12 : 0);
            if (T == 7)
                tile_s(4, 1, y + 6 * (size_t)N, N, xp + 6 * 32, T, w, bias, n, K, 0);
            else
                tile_s(4, 2, y + 6 * (size_t)N, N, xp + 6 * 32, T, w, bias, n, K, 0);
        }
        for (; n < n_end; n++) {
            tile_s(1, 6, y, N, xp, T, w, bias, n, K, 0);
            if (T == 7)
                tile_s(1, 1, y + 6 * (size_t)N, N, xp + 6 * 32, T, w, bias, n, K, 0);
            else
                tile_s(1, 2, y + 6 * (size_t)N, N, xp + 6 * 32, T, w, bias, n, K, 0);
        }
        break;
    }
#undef TS_CASE
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
    if (stream && T > 1) { /* xp interleaved (cpu_f32x_perm), T <= 8 */
        rows_stream(y, N, xp, T, w, bias, n_beg, n_end, K);
        return;
    }
    if (stream) {
        int n = n_beg;
        /* one token: 8 rows at a time (8 independent accumulator chains) */
        for (; n + 8 <= n_end; n += 8)
            tile(8, 1, y, N, xp, xst, w, bias, n, K, n + 8 + 16 <= N ? 16 : 0);
        for (; n + 4 <= n_end; n += 4)
            tile(4, 1, y, N, xp, xst, w, bias, n, K, n + 4 + 12 <= N ? 12 : 0);
        for (; n < n_end; n++)
            tile(1, 1, y, N, xp, xst, w, bias, n, K, 0);
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

/* ---- attention: query heads that share the key / value rows (GQA) ----------------------
 * The same arithmetic as cpu_dot_rows / cpu_axpy_rows for each head, bit for bit (the
 * canonical dot's 8 lanes, its tree; the value rows in position order), with more
 * independent accumulator chains and each key / value row loaded once for several heads. */

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

/* ---- attention for many query heads (cpu_dot_rows_heads / cpu_axpy_rows_heads) ---------
 * The same arithmetic again, bit for bit, with more sharing: the heads of one KV head go in
 * pairs, up to three pairs against one broadcast of each key row (three FMAs per load
 * instead of one), the odd heads of two KV heads paired across them (each half of the
 * 512-bit key register from its own row), and the canonical tree run on 512-bit vectors
 * (two heads' 8 positions per tree instead of one). */

/* 8 elements of row k (low half) and of row k2 (high half) at o */
static inline __attribute__((always_inline)) __m512 kv_cat8(const void *k, const void *k2,
                                                            int bf16, size_t o) {
    if (bf16) {
        __m256i h = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)((const uint16_t *)k + o))),
            _mm_loadu_si128((const __m128i *)((const uint16_t *)k2 + o)), 1);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return cat2((const float *)k + o, (const float *)k2 + o);
}

/* cpu_matmul.c's hsum8x8 tree on both 256-bit halves of 8 accumulators at once: A[p] = [head a | head b] of
 * position p; returns [a p0..7 | b p0..7], each the canonical tree of its 8 lanes */
static inline __attribute__((always_inline)) __m512 hsum8x8_512(const __m512 *A) {
    __m512 x04 = _mm512_add_ps(_mm512_shuffle_f32x4(A[0], A[4], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(A[0], A[4], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 x15 = _mm512_add_ps(_mm512_shuffle_f32x4(A[1], A[5], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(A[1], A[5], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 x26 = _mm512_add_ps(_mm512_shuffle_f32x4(A[2], A[6], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(A[2], A[6], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 x37 = _mm512_add_ps(_mm512_shuffle_f32x4(A[3], A[7], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(A[3], A[7], _MM_SHUFFLE(3, 1, 3, 1)));
    /* 128-bit lane j of x04: (a0+a4, a1+a5, a2+a6, a3+a7) of [a p0, b p0, a p4, b p4][j] */
    __m512 y01 = _mm512_add_ps(_mm512_shuffle_ps(x04, x15, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(x04, x15, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 y23 = _mm512_add_ps(_mm512_shuffle_ps(x26, x37, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(x26, x37, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
    /* r: [a p0-3, b p0-3, a p4-7, b p4-7] */
    return _mm512_shuffle_f32x4(r, r, _MM_SHUFFLE(3, 1, 2, 0));
}

/* NP pairs of heads (qa[j] -> oa[j], qb[j] -> ob[j]); the a heads against rows ka, the b
 * heads against kb (kb == ka: one broadcast load per key row for all 2 NP heads); positions
 * [0, m & ~7), n <= 128. */
static inline __attribute__((always_inline)) void
dot_pairs(const int NP, const int X, float *const *oa, float *const *ob, const float *const *qa,
          const float *const *qb, const void *ka, const void *kb, int bf16, size_t stride, int m,
          int n, float scale) {
    const int n8 = n & ~7;
    __m512 qz[3][16];
    for (int j = 0; j < NP; j++)
        for (int d = 0; d < n8; d += 8)
            qz[j][d / 8] = cat2(qa[j] + d, qb[j] + d);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i = 0; i + 8 <= m; i += 8) {
        const size_t rb = (size_t)i * stride;
        __m512 A[3][8];
        for (int j = 0; j < NP; j++)
            for (int p = 0; p < 8; p++)
                A[j][p] = _mm512_setzero_ps();
        for (int d = 0; d < n8; d += 8) {
            __m512 qd[3];
            for (int j = 0; j < NP; j++)
                qd[j] = qz[j][d / 8];
            for (int p = 0; p < 8; p++) {
                const size_t o = rb + (size_t)p * stride + d;
                __m512 kv = X ? kv_cat8(ka, kb, bf16, o) : kv_bcast8(ka, bf16, o);
                for (int j = 0; j < NP; j++)
                    A[j][p] = _mm512_fmadd_ps(qd[j], kv, A[j][p]);
            }
        }
        for (int j = 0; j < NP; j++) {
            __m512 s = hsum8x8_512(A[j]);
            if (n8 < n) { /* the tail of each dot, in order, before the scale */
                float t[16];
                _mm512_storeu_ps(t, s);
                for (int p = 0; p < 8; p++)
                    for (int d = n8; d < n; d++) {
                        size_t o = rb + (size_t)p * stride + d;
                        float k0 = bf16 ? cpu_ref_bf16_to_f32(((const uint16_t *)ka)[o])
                                        : ((const float *)ka)[o];
                        float k1 = bf16 ? cpu_ref_bf16_to_f32(((const uint16_t *)kb)[o])
                                        : ((const float *)kb)[o];
                        t[p] = __builtin_fmaf(qa[j][d], k0, t[p]);
                        t[8 + p] = __builtin_fmaf(qb[j][d], k1, t[8 + p]);
                    }
                s = _mm512_loadu_ps(t);
            }
            s = _mm512_mul_ps(s, sc);
            _mm256_storeu_ps(oa[j] + i, _mm512_castps512_ps256(s));
            _mm256_storeu_ps(ob[j] + i, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
        }
    }
}

#define DOT_PAIRS(NP, X)                                                                           \
    (bf16 ? dot_pairs(NP, X, oa, ob, qa, qb, ka, kb, 1, stride, m, n, scale)                       \
          : dot_pairs(NP, X, oa, ob, qa, qb, ka, kb, 0, stride, m, n, scale))

int cpu_x512_dot_rows_heads(float *const *out, const float *const *q, const void *const *k,
                            int nh, int bf16, size_t stride, int m, int n, float scale) {
    if (n > 128 || m < 8) return 0;
    int odd[CPU_ATT_MAX_HEADS], nodd = 0;
    for (int h = 0; h < nh;) {
        int e = h + 1; /* the run of heads sharing h's rows */
        while (e < nh && k[e] == k[h])
            e++;
        for (; h + 2 <= e;) { /* pairs, up to three against one load */
            int np = (e - h) / 2 > 3 ? 3 : (e - h) / 2;
            float *oa[3], *ob[3];
            const float *qa[3], *qb[3];
            for (int j = 0; j < np; j++) {
                oa[j] = out[h + 2 * j];
                ob[j] = out[h + 2 * j + 1];
                qa[j] = q[h + 2 * j];
                qb[j] = q[h + 2 * j + 1];
            }
            const void *ka = k[h], *kb = k[h];
            if (np == 3)
                DOT_PAIRS(3, 0);
            else if (np == 2)
                DOT_PAIRS(2, 0);
            else
                DOT_PAIRS(1, 0);
            h += 2 * np;
        }
        if (h < e) odd[nodd++] = h++;
    }
    for (int i = 0; i + 2 <= nodd; i += 2) { /* odd heads of different rows, in pairs */
        float *oa[1] = {out[odd[i]]}, *ob[1] = {out[odd[i + 1]]};
        const float *qa[1] = {q[odd[i]]}, *qb[1] = {q[odd[i + 1]]};
        const void *ka = k[odd[i]], *kb = k[odd[i + 1]];
        DOT_PAIRS(1, 1);
    }
    if (nodd & 1) { /* the last one against itself (computed twice, stored once each) */
        int h = odd[nodd - 1];
        float *oa[1] = {out[h]}, *ob[1] = {out[h]};
        const float *qa[1] = {q[h]}, *qb[1] = {q[h]};
        const void *ka = k[h], *kb = k[h];
        DOT_PAIRS(1, 0);
    }
    return m & ~7;
}

/* NH heads (y[h] += a[h][i] * v_i) sharing the value rows v: each row loaded once for all;
 * columns [0, n & ~63) */
static inline __attribute__((always_inline)) void axpy_heads(const int NH, float *const *y,
                                                             const float *const *a, const void *v,
                                                             int bf16, size_t stride, int m,
                                                             int n) {
    for (int c = 0; c + 64 <= n; c += 64) {
        __m512 acc[4][4];
        for (int h = 0; h < NH; h++)
            for (int r = 0; r < 4; r++)
                acc[h][r] = _mm512_loadu_ps(y[h] + c + 16 * r);
        for (int i = 0; i < m; i++) {
            const size_t vi = (size_t)i * stride + c;
            __m512 vv[4];
            for (int r = 0; r < 4; r++)
                vv[r] = kv_load16(v, bf16, vi + 16 * r);
            for (int h = 0; h < NH; h++) {
                __m512 b = _mm512_set1_ps(a[h][i]);
                for (int r = 0; r < 4; r++)
                    acc[h][r] = _mm512_fmadd_ps(b, vv[r], acc[h][r]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int r = 0; r < 4; r++)
                _mm512_storeu_ps(y[h] + c + 16 * r, acc[h][r]);
    }
}

#define AXPY_HEADS(NH)                                                                             \
    (bf16 ? axpy_heads(NH, y + h, a + h, v[h], 1, stride, m, n)                                    \
          : axpy_heads(NH, y + h, a + h, v[h], 0, stride, m, n))

int cpu_x512_axpy_rows_heads(float *const *y, const float *const *a, const void *const *v, int nh,
                             int bf16, size_t stride, int m, int n) {
    for (int h = 0; h < nh;) {
        int e = h + 1;
        while (e < nh && v[e] == v[h])
            e++;
        while (h < e) { /* groups of at most 4, as even as possible (7 = 4 + 3) */
            int left = e - h, groups = (left + 3) / 4, g = (left + groups - 1) / groups;
            switch (g) {
            case 4:
                AXPY_HEADS(4);
                break;
            case 3:
                AXPY_HEADS(3);
                break;
            case 2:
                AXPY_HEADS(2);
                break;
            default:
                AXPY_HEADS(1);
                break;
            }
            h += g;
        }
    }
    return n & ~63;
}

/* ---- the exponentials of a chunk's partial softmax (cpu_softmax_exp) --------------------
 * cpu_ref_expf / exp8 (cpu_matmul.c) on 16 lanes: the same operations in the same order, so
 * the same bits (the approximation's error is cpu_expf's: <= 2 ulp, test_exp), and the same
 * 8-lane sum: the low then the high 8 of each 16 added in position order. */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_C1), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_C2), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    __m512 rr = _mm512_mul_ps(r, r);
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, rr, r), _mm512_set1_ps(1.0f));
    __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_HI), _CMP_GT_OQ),
                             y, _mm512_set1_ps(__builtin_inff()));
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ),
                             y, _mm512_setzero_ps());
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x);
}

int cpu_x512_softmax_exps(float *s, int n, float mx, float acc8[8]) {
    const __m512 mxv = _mm512_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), mxv));
        _mm512_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
        acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    _mm256_storeu_ps(acc8, acc);
    return i;
}
