/*
 * cuda_gemv — the decode GEMV of the CUDA module (cuda_common.cuh): y = x w^T for T = 1..2
 * tokens, weight-streaming bound (one warp a weight row, or S warps a row split over K),
 * with the gate|up GEMV (SwiGLU in its epilogue) and the q|k|v GEMV (bias, RoPE and the KV
 * write in its epilogue).  matmul (cuda_gemm.cu) takes the GEMV where gemv_ok() says so.
 * Every kernel has two weight formats (template WF): bf16 (WF_BF16: a 16-byte load is 8
 * weights, dotted with one uint4 of x) and FP8 e4m3 (WF_F8: a 16-byte load is 16 weights,
 * converted exactly to f32, dotted with two uint4 of x in f32, the 16-term sum times the f32
 * scale of their block) -- FP8 weights get the same split-K, fusions and PDL as bf16.
 */
#include "kernels/cuda/cuda_common.cuh"

/* y (T, N) f32 = x (T, K) bf16 . w (N, K)^T bf16 (+ bias) for small T (decode): one warp per
 * weight row, 16-byte loads, f32 accumulation; weight-streaming bound. */
__device__ __forceinline__ float bf_lo(uint32_t v) {
    return __uint_as_float(v << 16);
}
__device__ __forceinline__ float bf_hi(uint32_t v) {
    return __uint_as_float(v & 0xffff0000u);
}
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    return bf_lo(a.x) * bf_lo(b.x) + bf_hi(a.x) * bf_hi(b.x) + bf_lo(a.y) * bf_lo(b.y) +
           bf_hi(a.y) * bf_hi(b.y) + bf_lo(a.z) * bf_lo(b.z) + bf_hi(a.z) * bf_hi(b.z) +
           bf_lo(a.w) * bf_lo(b.w) + bf_hi(a.w) * bf_hi(b.w);
}
/* weights: read once, never again this step: no L1 allocation, first out of L2 (pol: an
 * L2::evict_first policy from l2_evict_first()) */
__device__ __forceinline__ uint64_t l2_evict_first() {
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ uint4 ld_stream(const uint4 *p, uint64_t pol) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(pol));
    return v;
}

/* The decode GEMV for T = 1..2 tokens: NR weight rows per warp (1; or gate row i with up
 * row I + i for the fused gate|up + SwiGLU; or a RoPE pair / two v rows for the fused q|k|v),
 * lanes stride K in 16-byte loads, GV_U loads of each row in flight per lane before any is
 * used.  The
 * loop runs over warp-uniform batches of 32 x GV_U uint4.  The first batch of weight loads is
 * issued before pdl_wait(): with programmatic dependent launch it overlaps the previous
 * kernel's tail (the weights never depend on it).  x (T, K) bf16 through L1 (small, every
 * warp reads it). */
#define GV_U 8
#define GV_S (32 * GV_U)
#define GV_MAXW 8 /* warps a CTA at most (DISAGG_CUDA_GEMV_WARPS) */
#define GV_MAXS 8 /* split-K factor at most (DISAGG_CUDA_GEMV_SPLIT) */
/* WF: bit 0 the weights' format (0 bf16, 1 FP8 e4m3), bit 1 the double-buffered loop of
 * gv_rows (DISAGG_CUDA_GEMV_DB; the same sums in the same order, so the same bits) */
#define WF_BF16 0
#define WF_F8   1
#define WF_DB   2
#define WF_IS_F8(WF) (((WF) & WF_F8) != 0)
/* the scales of FP8 weights on the device side: row r's scales at s + (r / bn) nkb; the
 * scale of weight uint4 g (columns 16 g .. 16 g + 15, one block: gemv_f8_ok) is column
 * g >> ksh when bk / 16 is 2^ksh (ksh 31 when one scale spans the row), else 16 g / bk */
struct gv_sc {
    const float *s;
    int bn, bk, nkb, ksh;
};
__device__ __forceinline__ const float *gv_srow(const gv_sc &sc, int row) {
    return sc.s + (size_t)(row / sc.bn) * sc.nkb;
}
template <int NR, int WF, int U = GV_U>
__device__ __forceinline__ void gv_load(uint4 (&wv)[NR][U], float (&sv)[NR][U],
                                        const uint4 *const *wr, const float *const *sr, int i0,
                                        int ib, int K8, uint64_t pol, const gv_sc &sc) {
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = i0 + 32 * u;
            wv[r][u] = i < K8 ? ld_stream(wr[r] + i, pol) : make_uint4(0, 0, 0, 0);
            if constexpr (WF_IS_F8(WF)) {
                int g = ib + i; /* the uint4's index in the whole row */
                sv[r][u] = i < K8 ? __ldg(sr[r] + (sc.ksh >= 0 ? g >> sc.ksh : (16 * g) / sc.bk))
                                  : 0.0f;
            }
        }
}
template <int TT, int NR, int WF, int U = GV_U>
__device__ __forceinline__ void gv_fma(float (&acc)[NR][TT], const uint4 (&wv)[NR][U],
                                       const float (&sv)[NR][U], const uint4 *__restrict__ x,
                                       int xs, int i0, int K8) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        int i = i0 + 32 * u;
        if (i < K8) {
            if constexpr (WF_IS_F8(WF)) {
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    float wf[16];
                    f8_cvt4(wv[r][u].x, wf);
                    f8_cvt4(wv[r][u].y, wf + 4);
                    f8_cvt4(wv[r][u].z, wf + 8);
                    f8_cvt4(wv[r][u].w, wf + 12);
#pragma unroll
                    for (int t = 0; t < TT; t++) {
                        const uint4 *xr = x + (size_t)t * xs + 2 * i;
                        acc[r][t] = fmaf(sv[r][u], f8_dot16(wf, __ldg(xr), __ldg(xr + 1)),
                                         acc[r][t]);
                    }
                }
            } else {
#pragma unroll
                for (int t = 0; t < TT; t++) {
                    uint4 xv = __ldg(x + (size_t)t * xs + i);
#pragma unroll
                    for (int r = 0; r < NR; r++)
                        acc[r][t] += dot8(wv[r][u], xv);
                }
            }
        }
    }
}
/* acc[r][t] = this lane's part of row r . token t (warp_sum it) over weight uint4s 0 .. K8 - 1
 * of wr[r] and the matching x (token t at x + t xs: xs = uint4s of x's whole row; a split-K
 * warp passes its range's start in wr and x, its length as K8 and, FP8, its first uint4's
 * index in the row as ib, with sr[r] = gv_srow(row r)); calls pdl_wait() */
template <int TT, int NR, int WF>
__device__ __forceinline__ void gv_rows(float (&acc)[NR][TT], const uint4 *const *wr,
                                        const uint4 *__restrict__ x, int xs, int K8, int lane,
                                        const float *const *sr, int ib, const gv_sc &sc) {
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int t = 0; t < TT; t++)
            acc[r][t] = 0.0f;
    uint64_t pol = l2_evict_first();
    int base = 0;
    if constexpr (WF & WF_DB) {
        /* double-buffered: batch b + 1's loads are in flight while batch b is converted and
         * summed (GV_U / 2 loads of each row a buffer: the single loop's registers; the 1
         * December form, GV_U a buffer for bf16, doubled them and lost: half the warps
         * resident); a lane still takes its uint4s in increasing order, so the sums are the
         * single loop's, bit for bit */
        constexpr int U = GV_U / 2, SB = 32 * U;
        uint4 wa[NR][U], wb[NR][U];
        float sa[NR][U], sb[NR][U];
        gv_load<NR, WF, U>(wa, sa, wr, sr, lane, ib, K8, pol, sc);
        if (SB < K8) gv_load<NR, WF, U>(wb, sb, wr, sr, SB + lane, ib, K8, pol, sc);
        pdl_wait();
        for (;;) {
            gv_fma<TT, NR, WF, U>(acc, wa, sa, x, xs, base + lane, K8);
            base += SB;
            if (base >= K8) break;
            if (base + SB < K8) gv_load<NR, WF, U>(wa, sa, wr, sr, base + SB + lane, ib, K8, pol, sc);
            gv_fma<TT, NR, WF, U>(acc, wb, sb, x, xs, base + lane, K8);
            base += SB;
            if (base >= K8) break;
            if (base + SB < K8) gv_load<NR, WF, U>(wb, sb, wr, sr, base + SB + lane, ib, K8, pol, sc);
        }
    } else {
        uint4 wa[NR][GV_U];
        float sa[NR][GV_U];
        gv_load<NR, WF>(wa, sa, wr, sr, base + lane, ib, K8, pol, sc);
        pdl_wait();
        for (;;) {
            gv_fma<TT, NR, WF>(acc, wa, sa, x, xs, base + lane, K8);
            base += GV_S;
            if (base >= K8) break;
            gv_load<NR, WF>(wa, sa, wr, sr, base + lane, ib, K8, pol, sc);
        }
    }
}
/* x's uint4s per weight uint4 */
#define GV_XW(WF) (WF_IS_F8(WF) ? 2 : 1)

/* MODE 0: y (T, N) f32 = x w^T (+ bias), one row a warp; MODE 1: h (T, I) =
 * silu(x wg^T) * (x wu^T) in OT, wg = rows 0..I-1 of w, wu = rows I..2I-1 (N = I). */
template <int TT, int MODE, typename OT, int WF>
__global__ void __launch_bounds__(256)
    k_gemv(OT *__restrict__ y, const uint4 *__restrict__ x, const uint4 *__restrict__ w,
            const float *__restrict__ bias, int N, int K8, gv_sc sc) {
    constexpr int NR = MODE == 1 ? 2 : 1;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) { /* N: rows of the output (I for MODE 1) */
        pdl_wait();
        return;
    }
    const uint4 *wr[NR];
    const float *sr[NR] = {};
    wr[0] = w + (size_t)row * K8;
    if (NR == 2) wr[NR - 1] = w + (size_t)(row + N) * K8;
    if constexpr (WF_IS_F8(WF)) {
        sr[0] = gv_srow(sc, row);
        if (NR == 2) sr[NR - 1] = gv_srow(sc, row + N);
    }
    float acc[NR][TT];
    gv_rows<TT, NR, WF>(acc, wr, x, GV_XW(WF) * K8, K8, lane, sr, 0, sc);
    pdl_trigger(); /* late: the next kernel's CTAs start once this grid's loads are done */
#pragma unroll
    for (int t = 0; t < TT; t++) {
        float v0 = warp_sum(acc[0][t]);
        if (MODE == 1) {
            float v1 = warp_sum(acc[NR - 1][t]);
            if (lane == 0) store_as(y + (size_t)t * N + row, v0 / (1.0f + expf(-v0)) * v1);
        } else if (lane == 0) {
            store_as(y + (size_t)t * N + row, v0 + (bias ? bias[row] : 0.0f));
        }
    }
}

/* Split-K form of k_gemv MODE 0 (DISAGG_CUDA_GEMV_SPLIT): S consecutive warps of a CTA share
 * NR output rows (DISAGG_CUDA_GEMV_SPLIT_ROWS=1|2: a warp streams NR rows at once, NR x GV_U
 * loads in flight a lane, as the gate|up GEMV), warp s of them taking the uint4s [s len,
 * min(K8, (s + 1) len)) of each, so a GEMV of few long rows (the 7B down_proj: 3,584 rows of
 * 37 KB, a partial second wave of warps) has S times the warps in flight.  The S partial sums
 * meet in shared memory and the rows' first warp adds them in split order (fixed: the same
 * bits every run), then the bias.  (The add + RMSNorm of the next operation in the
 * epilogue of the CTA that finishes last — threadfence, an integer count, k_rmsnorm4's
 * arithmetic, the same bits — measured 0.35 ms a step slower than the separate k_rmsnorm4 on
 * the H200 with CUDA graphs, 4.97 vs 4.62 ms at batch 1, 4k: removed.) */
template <int TT, int S, int NR, int WF>
__global__ void __launch_bounds__(256)
    k_gemv_sk(float *__restrict__ y, const uint4 *__restrict__ x, const uint4 *__restrict__ w,
              const float *__restrict__ bias, int N, int K8, int len, gv_sc sc) {
    __shared__ float red[GV_MAXW][NR][TT];
    int wi = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = (blockIdx.x * ((blockDim.x >> 5) / S) + wi / S) * NR, sp = wi % S;
    int lo = sp * len, n = min(K8 - lo, len);
    float acc[NR][TT];
    if (row < N && n > 0) {
        const uint4 *wr[NR];
        const float *sr[NR] = {};
#pragma unroll
        for (int r = 0; r < NR; r++) {
            wr[r] = w + (size_t)min(row + r, N - 1) * K8 + lo; /* a dead row re-reads the last */
            if constexpr (WF_IS_F8(WF)) sr[r] = gv_srow(sc, min(row + r, N - 1));
        }
        gv_rows<TT, NR, WF>(acc, wr, x + (size_t)GV_XW(WF) * lo, GV_XW(WF) * K8, n, lane, sr, lo,
                            sc);
    } else {
#pragma unroll
        for (int r = 0; r < NR; r++)
#pragma unroll
            for (int t = 0; t < TT; t++)
                acc[r][t] = 0.0f;
        pdl_wait();
    }
    pdl_trigger(); /* late, as k_gemv */
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int t = 0; t < TT; t++) {
            float v = warp_sum(acc[r][t]);
            if (lane == 0) red[wi][r][t] = v;
        }
    __syncthreads();
    if (sp == 0 && lane < NR * TT) {
        int r = lane / TT, t = lane % TT;
        if (row + r < N) {
            float v = 0.0f;
#pragma unroll
            for (int q = 0; q < S; q++)
                v += red[wi + q][r][t];
            y[(size_t)t * N + row + r] = v + (bias ? bias[row + r] : 0.0f);
        }
    }
}

/* The q|k|v GEMV with k_qkv_finish in its epilogue: warp pi takes a RoPE pair (rows
 * hh hd + j and + hd/2 of q head or k head hh, j < hd/2) or two adjacent v rows, adds the
 * bias, rotates, and writes q to qout (T, nh hd) and k, v into the cache (no KV for a
 * padding row, pos < 0) — the same arithmetic as k_qkv_finish on the GEMV's output.  S > 1:
 * split-K as k_gemv_sk (S warps a pair, uint4s [s len, (s + 1) len) each, the partial sums
 * added in split order by the pair's first warp, which runs the epilogue). */
template <int TT, typename KT, int S, int WF>
__global__ void __launch_bounds__(256)
    k_gemv_qkv(float *__restrict__ qout, KT *kv, const uint4 *__restrict__ x,
               const uint4 *__restrict__ w, const float *__restrict__ bias, int K8, int len,
               int bs, int n_layers, int layer, const int32_t *pos, const int32_t *seq,
               const int32_t *bts, int bt_stride, const float *inv_freq, int nh, int nkv, int hd,
               float ksc, float vsc, gv_sc sc) {
    int wi = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int pi = blockIdx.x * ((blockDim.x >> 5) / S) + wi / S, sp = wi % S;
    int half = hd / 2, h = nh * hd, kvd = nkv * hd, n_rope = (nh + nkv) * half;
    int live = pi < n_rope + kvd / 2;
    if (S == 1 && !live) {
        pdl_wait();
        return;
    }
    int rope = pi < n_rope, hh = rope ? pi / half : 0, j = rope ? pi % half : 0;
    int r0 = rope ? hh * hd + j : h + kvd + 2 * (pi - n_rope), r1 = rope ? r0 + half : r0 + 1;
    int lo = sp * len, n = min(K8 - lo, len);
    float acc[2][TT];
    if (live && n > 0) {
        const uint4 *wr[2] = {w + (size_t)r0 * K8 + lo, w + (size_t)r1 * K8 + lo};
        const float *sr[2] = {};
        if constexpr (WF_IS_F8(WF)) sr[0] = gv_srow(sc, r0), sr[1] = gv_srow(sc, r1);
        gv_rows<TT, 2, WF>(acc, wr, x + (size_t)GV_XW(WF) * lo, GV_XW(WF) * K8, n, lane, sr, lo,
                           sc);
    } else {
#pragma unroll
        for (int t = 0; t < TT; t++)
            acc[0][t] = acc[1][t] = 0.0f;
        pdl_wait();
    }
    pdl_trigger(); /* late, as k_gemv */
    float us[TT], vs[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) {
        us[t] = warp_sum(acc[0][t]) + 0.0f;
        vs[t] = warp_sum(acc[1][t]) + 0.0f;
    }
    if constexpr (S > 1) {
        __shared__ float red[GV_MAXW][2][TT];
        if (lane == 0)
#pragma unroll
            for (int t = 0; t < TT; t++)
                red[wi][0][t] = us[t], red[wi][1][t] = vs[t];
        __syncthreads();
        if (sp || !live) return;
#pragma unroll
        for (int t = 0; t < TT; t++) {
            float u = 0.0f, v = 0.0f;
#pragma unroll
            for (int q = 0; q < S; q++)
                u += red[wi + q][0][t], v += red[wi + q][1][t];
            us[t] = u, vs[t] = v;
        }
    }
#pragma unroll
    for (int t = 0; t < TT; t++) {
        float u = us[t], v = vs[t];
        if (lane) continue;
        u = u + (bias ? bias[r0] : 0.0f);
        v = v + (bias ? bias[r1] : 0.0f);
        int p = pos[t], pad = p < 0;
        const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
        if (rope) {
            float a = (pad ? 0.0f : (float)p) * inv_freq[j];
            float cs = cosf(a), sn = sinf(a);
            float o0 = u * cs - v * sn, o1 = v * cs + u * sn;
            if (hh < nh) {
                qout[(size_t)t * h + r0] = o0;
                qout[(size_t)t * h + r1] = o1;
            } else if (!pad) {
                size_t ok = kv_off(bt, p, bs, n_layers, kvd, layer, 0);
                store_kv(kv + ok + (r0 - h), o0, ksc);
                store_kv(kv + ok + (r1 - h), o1, ksc);
            }
        } else if (!pad) {
            size_t ov = kv_off(bt, p, bs, n_layers, kvd, layer, 1);
            store_kv(kv + ov + (r0 - h - kvd), u, vsc);
            store_kv(kv + ov + (r1 - h - kvd), v, vsc);
        }
    }
}

/* Split-K factor for a GEMV of `rows` warps (rows, or q|k|v pairs) over K8 uint4s; setting =
 * c->gemv_split (o, down: DISAGG_CUDA_GEMV_SPLIT) or c->qkv_split (DISAGG_CUDA_QKV_SPLIT): 1
 * (none) when the rows alone fill the GPU's warp slots (n_sm x 64) or the setting is 1; 2|4|8
 * that factor (halved while a split would be under 32 uint4s);
 * by default (auto) doubled while the warps are fewer than the slots and each split keeps
 * at least min_len uint4s (GV_MIN_LEN, 1 KB of a row, for o/down; GV_MIN_LEN_QKV, 2 KB, for
 * q|k|v): the 7B down_proj and o_proj 4, q|k|v 2 (the 17:57 run of 1 December: o at 4
 * splits 0.01-0.04 ms a step faster than at 2, q|k|v at 4 no faster than at 2, at 8 0.2 ms
 * slower). */
#define GV_MIN_LEN 64
#define GV_MIN_LEN_QKV 128
static int gemv_split_for(const dcu_ctx *c, int setting, int rows, int K8, int min_len) {
    int slots = c->n_sm * 64, s = 1;
    if (setting == 1 || rows >= slots) return 1;
    if (setting > 1) {
        s = setting;
        while (s > 1 && K8 / s < 32)
            s >>= 1;
        return s;
    }
    while (s < GV_MAXS && rows * s < slots && K8 / (2 * s) >= min_len)
        s *= 2;
    return s;
}
/* a split's length in uint4s: K8 / S rounded up to whole 128-byte lines */
static int gemv_split_len(int K8, int S) {
    return S == 1 ? K8 : ((K8 + S - 1) / S + 7) / 8 * 8;
}

/* the device form of FP8 scales (zeros for bf16 weights) */
static gv_sc gv_sc_of(const dcu_f8scale *f8, int K) {
    gv_sc sc = {};
    if (!f8) return sc;
    sc.s = f8->s, sc.bn = f8->bn, sc.bk = f8->bk;
    sc.nkb = (K + f8->bk - 1) / f8->bk;
    sc.ksh = sc.nkb == 1 ? 31 : -1;
    if (sc.ksh < 0 && f8->bk % 16 == 0 && !((f8->bk / 16) & (f8->bk / 16 - 1))) {
        sc.ksh = 0;
        while ((16 << sc.ksh) < f8->bk)
            sc.ksh++;
    }
    return sc;
}

/* the split-K GEMV (k_gemv_sk) with S splits, c->gemv_split_rows rows a warp */
template <int WF>
static int gemv_sk_launch(dcu_ctx *c, float *y, const uint4 *xv, const uint4 *wv,
                          const float *bias, int T, int N, int K8, int S, gv_sc sc) {
    int nw = c->gemv_warps, wc = nw > S ? nw : S, len = gemv_split_len(K8, S), nr = c->gemv_split_rows;
    int rpc = wc / S * nr; /* rows a CTA */
    dim3 gs((N + rpc - 1) / rpc), bs(32 * wc);
#define GSK_(TT, SS, NR)                                                                         \
    if (T == TT && S == SS && nr == NR)                                                          \
        return launch_pdl(c, "gemv (split-K)", k_gemv_sk<TT, SS, NR, WF>, gs, bs, 0, y, xv, wv,   \
                          bias, N, K8, len, sc);
#define GSK_S(TT, NR) GSK_(TT, 2, NR) GSK_(TT, 4, NR) GSK_(TT, 8, NR)
    GSK_S(1, 1) GSK_S(2, 1) GSK_S(1, 2) GSK_S(2, 2)
#undef GSK_S
#undef GSK_
    return -EINVAL;
}

/* the double-buffered loop for these weights (c->gemv_db: DISAGG_CUDA_GEMV_DB) */
static int gemv_db_on(const dcu_ctx *c, int wf) {
    return c->gemv_db == 2 || (c->gemv_db == 1 && WF_IS_F8(wf));
}

template <int MODE, typename OT, int WF>
static int gemv_launch(dcu_ctx *c, OT *y, const void *x, const void *w, const float *bias, int T,
                       int N, int K, gv_sc sc) {
    if constexpr (!(WF & WF_DB))
        if (gemv_db_on(c, WF)) return gemv_launch<MODE, OT, WF | WF_DB>(c, y, x, w, bias, T, N, K, sc);
    int nw = c->gemv_warps; /* warps (output rows) per CTA */
    dim3 g((N + nw - 1) / nw), b(32 * nw);
    const uint4 *xv = (const uint4 *)x, *wv = (const uint4 *)w;
    int K8 = WF_IS_F8(WF) ? K / 16 : K / 8; /* weight uint4s a row */
    if constexpr (MODE == 0 && sizeof(OT) == 4) {
        int S = gemv_split_for(c, c->gemv_split, N, K8, GV_MIN_LEN);
        if (S > 1) return gemv_sk_launch<WF>(c, y, xv, wv, bias, T, N, K8, S, sc);
    }
    if (T == 1)
        return launch_pdl(c, "gemv", k_gemv<1, MODE, OT, WF>, g, b, 0, y, xv, wv, bias, N, K8, sc);
    if (T == 2)
        return launch_pdl(c, "gemv", k_gemv<2, MODE, OT, WF>, g, b, 0, y, xv, wv, bias, N, K8, sc);
    return -EINVAL;
}

int gemv(dcu_ctx *c, float *y, const void *x, const void *w, const float *bias, int T, int N,
         int K) {
    return gemv_launch<0, float, WF_BF16>(c, y, x, w, bias, T, N, K, gv_sc_of(NULL, K));
}

/* FP8 weights: T = 1..2 (the bf16 GEMV's token counts), whole 16-byte loads, a 16-weight
 * load within one scale block */
int gemv_f8_ok(int T, int K, int bk, const void *x, const void *w) {
    return T >= 1 && T <= GEMV_MAX_T && K % 16 == 0 && (bk % 16 == 0 || bk >= K) &&
           !(((uintptr_t)x | (uintptr_t)w) & 15);
}

int gemv_f8(dcu_ctx *c, float *y, const void *x, const void *w, const dcu_f8scale *f8,
            const float *bias, int T, int N, int K) {
    if (!f8 || !gemv_f8_ok(T, K, f8->bk, x, w)) return -EINVAL;
    return gemv_launch<0, float, WF_F8>(c, y, x, w, bias, T, N, K, gv_sc_of(f8, K));
}

/* the fused q|k|v GEMV (k_gemv_qkv) for T = 1..2, split-K by gemv_split_for */
template <typename KT, int WF>
static int gemv_qkv_t(dcu_ctx *c, float *qout, KT *kv, const void *x, const void *w,
                      const float *bias, int T, int K, int bs, int n_layers, int layer,
                      const int32_t *pos, const int32_t *seq, const int32_t *bts, int bt_stride,
                      const float *inv_freq, int nh, int nkv, int hd, float ksc, float vsc,
                      gv_sc sc) {
    if constexpr (!(WF & WF_DB))
        if (gemv_db_on(c, WF))
            return gemv_qkv_t<KT, WF | WF_DB>(c, qout, kv, x, w, bias, T, K, bs, n_layers, layer,
                                               pos, seq, bts, bt_stride, inv_freq, nh, nkv, hd,
                                               ksc, vsc, sc);
    int nw = c->gemv_warps, pairs = (nh + nkv) * (hd / 2) + nkv * hd / 2,
        K8 = WF_IS_F8(WF) ? K / 16 : K / 8;
    int S = gemv_split_for(c, c->qkv_split, pairs, K8, GV_MIN_LEN_QKV), wc = nw > S ? nw : S,
        rpc = wc / S;
    int len = gemv_split_len(K8, S);
    dim3 g((pairs + rpc - 1) / rpc), b(32 * wc);
    const uint4 *xv = (const uint4 *)x, *wv = (const uint4 *)w;
    if (T < 1 || T > 2) return -EINVAL;
#define GQ_(TT, SS)                                                                                \
    if (T == TT && S == SS)                                                                        \
        return launch_pdl(c, "gemv_qkv", k_gemv_qkv<TT, KT, SS, WF>, g, b, 0, qout, kv, xv, wv,    \
                          bias, K8, len, bs, n_layers, layer, pos, seq, bts, bt_stride, inv_freq,  \
                          nh, nkv, hd, ksc, vsc, sc);
    GQ_(1, 1) GQ_(1, 2) GQ_(1, 4) GQ_(1, 8) GQ_(2, 1) GQ_(2, 2) GQ_(2, 4) GQ_(2, 8)
#undef GQ_
    return -EINVAL;
}

/* measured on the H200 (7B shapes, serving forward with CUDA graphs, gpu_check ONLY=decode
 * of 2026-12-01 14:51): the GEMV (single-buffered, gate|up + SwiGLU and q|k|v + RoPE/KV
 * fused) takes batch 1 at 4k to 4.75 ms a step against 4.88 with cuBLASLt for every GEMM
 * (5.37 before this GEMV); at T = 2 cuBLASLt is faster (4.87 vs 5.02 ms), so the default is
 * T = 1 only (DISAGG_CUDA_GEMV=2: T <= 2 too; 0: cuBLASLt for every T).  Split over K for
 * the GEMVs of few rows (gemv_split_for; the 18:11 run of 1 December: batch 1 at 4k 4.61 ms
 * against 4.85 unsplit in the same run).  A tensor-core
 * GEMM for T <= 32 (dev/cuda/gemv_skinny.cu) lost to cuBLASLt at T = 1..32.  The fast mode
 * is not batch-invariant either way
 * (cuBLASLt changes kernels with T as well): a sequence's tokens may depend on its batch;
 * --batch-invariant (cuda_invariant.cu) is the mode that makes them not. */
int gemv_ok(const dcu_ctx *c, int T, int K, const void *x, const void *w) {
    return T >= 1 && T <= c->gemv_max_t && K % 8 == 0 && !(((uintptr_t)x | (uintptr_t)w) & 15);
}

template <int WF>
static int gemv_gate_up_t(dcu_ctx *c, void *h, int h_dtype, const void *x, const void *w,
                          int T, int I, int K, gv_sc sc) {
    return h_dtype == DCU_BF16 ? gemv_launch<1, bf16, WF>(c, (bf16 *)h, x, w, NULL, T, I, K, sc)
                               : gemv_launch<1, float, WF>(c, (float *)h, x, w, NULL, T, I, K, sc);
}
int gemv_gate_up(dcu_ctx *c, void *h, int h_dtype, const void *x, const void *w,
                 const dcu_f8scale *f8, int T, int I, int K) {
    if (f8 && !gemv_f8_ok(T, K, f8->bk, x, w)) return -EINVAL;
    return f8 ? gemv_gate_up_t<WF_F8>(c, h, h_dtype, x, w, T, I, K, gv_sc_of(f8, K))
              : gemv_gate_up_t<WF_BF16>(c, h, h_dtype, x, w, T, I, K, gv_sc_of(NULL, K));
}

template <int WF>
static int gemv_qkv_wf(dcu_ctx *c, float *qout, void *kv, int kv_kind, const void *x,
                       const void *w, const float *bias, int T, int K, int bs, int n_layers,
                       int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts,
                       int bt_stride, const float *inv_freq, int nh, int nkv, int hd, float ksc,
                       float vsc, gv_sc sc) {
    if (kv_kind == 2)
        return gemv_qkv_t<f8e4m3, WF>(c, qout, (f8e4m3 *)kv, x, w, bias, T, K, bs, n_layers,
                                      layer, pos, seq, bts, bt_stride, inv_freq, nh, nkv, hd, ksc,
                                      vsc, sc);
    return kv_kind ? gemv_qkv_t<bf16, WF>(c, qout, (bf16 *)kv, x, w, bias, T, K, bs, n_layers,
                                          layer, pos, seq, bts, bt_stride, inv_freq, nh, nkv, hd,
                                          1.0f, 1.0f, sc)
                   : gemv_qkv_t<float, WF>(c, qout, (float *)kv, x, w, bias, T, K, bs, n_layers,
                                           layer, pos, seq, bts, bt_stride, inv_freq, nh, nkv, hd,
                                           1.0f, 1.0f, sc);
}
int gemv_qkv(dcu_ctx *c, float *qout, void *kv, int kv_kind, const void *x, const void *w,
             const dcu_f8scale *f8, const float *bias, int T, int K, int bs, int n_layers,
             int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts, int bt_stride,
             const float *inv_freq, int nh, int nkv, int hd, float ksc, float vsc) {
    if (f8 && !gemv_f8_ok(T, K, f8->bk, x, w)) return -EINVAL;
    return f8 ? gemv_qkv_wf<WF_F8>(c, qout, kv, kv_kind, x, w, bias, T, K, bs, n_layers, layer,
                                   pos, seq, bts, bt_stride, inv_freq, nh, nkv, hd, ksc, vsc,
                                   gv_sc_of(f8, K))
              : gemv_qkv_wf<WF_BF16>(c, qout, kv, kv_kind, x, w, bias, T, K, bs, n_layers, layer,
                                     pos, seq, bts, bt_stride, inv_freq, nh, nkv, hd, ksc, vsc,
                                     gv_sc_of(NULL, K));
}
