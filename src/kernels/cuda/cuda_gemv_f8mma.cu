/*
 * cuda_gemv_f8mma — the FP8 (e4m3) weight-only decode GEMV on the tensor cores, for T = 1..16
 * tokens (DISAGG_CUDA_FP8_MMA=1; off by default until measured on the H200; cuda_common.cuh):
 *
 *   y (T, N) f32 = x (T, K) bf16 . (w (N, K) e4m3 * scale)^T (+ bias), the gate|up form
 *   h (T, I) = silu(x wg^T) * (x wu^T) with w = [wg; wu] (2I, K) in one matrix, and the q|k|v
 *   form with k_gemv_qkv's epilogue (bias, RoPE, q out, the KV write).
 *
 * Why the tensor cores: the CUDA-core e4m3 GEMVs (cuda_gemv.cu, cuda_gemv_fp8.cu) spend per
 * weight a conversion to f16, one to f32, an unpack of x and an FMA, and reached 45-65 % of
 * the copy rate.  Here a weight costs half an instruction (the hardware e4m3x2 -> f16x2
 * conversion, exact) and the products go to mma.sync m16n8k16 (f16 x f16, f32 accumulate):
 * the weights are the A side (16 rows), the tokens the N = 8 side (two n-tiles for T > 8).
 * f16 and not bf16 because e4m3 -> f16 is one instruction and exact, while e4m3 -> bf16 takes
 * bit operations and a multiply by 2^120 per pair.  x is bf16: converted to f16 exactly where
 * |x| < 65536 (bf16 has fewer mantissa bits; below 2^-14 f16 keeps fewer, a negligible loss);
 * a warp that sees a larger |x| recomputes its part in f32 on the CUDA cores (k_f8mma's
 * fallback: slow, exact, never on the usual activations).
 *
 * Layout: a lane (group g = lane / 4, t = lane % 4) loads 16 consecutive weight bytes of two
 * rows (the tile's rows g and g + 8) at columns 64 c + 16 t .. + 15 of chunk c; the four u32
 * of that load are the A fragments of the chunk's four mma steps.  Since a dot product may
 * add its terms in any order, mma step j's logical k (2t, 2t+1 | 2t+8, 2t+9) is the physical
 * column 64 c + 16 t + 4 j + (0, 1 | 2, 3); the lane's B fragment is x of token g (n-tile 0)
 * or g + 8 (n-tile 1) at the same columns: 16 bf16 (two 16-byte loads through L1), converted
 * once for the warp's MT tiles.  8 x 16 bytes of weight loads a lane are in flight before the
 * first is used (16 with DB: the next 8 issued before these are used).  A tile's rows: 16
 * consecutive rows; in the gate|up form gate rows 8p..8p+7 with up rows I+8p..I+8p+7, so each
 * lane holds the gate and the up value of the same output (SwiGLU in registers); in the
 * q|k|v form 8 RoPE pairs (rows j, j + hd/2 of one head) or 16 v rows.  Split-K inside the
 * CTA: SK warps share a tile, each a range of chunks, their sums added in split order through
 * shared memory (the same bits every run).  tools/emulate_fp8_mma_layout.py checks this
 * layout in numpy.
 * Scales (backend_wscale): one a row (per tensor, per channel: bk >= K) multiplied at the
 * end; blocks of bk columns with bk a multiple of 64 (128 x 128) folded in per chunk.
 */
#include "kernels/cuda/cuda_common.cuh"

#define FM_WARPS 8  /* warps a CTA */
#define FM_MAXT  16 /* tokens at most (two n-tiles of 8) */

struct fm_sc {
    const float *s; /* (ceil(rows / bn), nkb) f32 */
    int bn, bk, nkb;
};

__device__ __forceinline__ uint64_t fm_evict_first() {
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ uint4 fm_ld_stream(const uint4 *p, uint64_t pol) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(pol));
    return v;
}
/* four e4m3 (one u32, element 0 in the low byte) -> two f16x2: lo = elements 0, 1, hi = 2, 3
 * (element 0 / 2 in the low half), exactly */
__device__ __forceinline__ void fm_e4m3x4(uint32_t v, uint32_t &lo, uint32_t &hi) {
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
        "cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(v));
}
/* bf16x2 -> f16x2 (nearest even: exact for 2^-14 <= |x| < 65536, inf above); m: the largest
 * |x| seen, in f16 (inf once one did not fit) */
__device__ __forceinline__ uint32_t fm_bf2h(uint32_t q, __half2 &m) {
    __half2 h = __floats2half2_rn(__uint_as_float(q << 16), __uint_as_float(q & 0xffff0000u));
    m = __hmax2(m, __habs2(h));
    return *reinterpret_cast<uint32_t *>(&h);
}
/* d += A . B, m16n8k16 row.col, f16 inputs, f32 accumulators */
__device__ __forceinline__ void fm_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t fm_word(const uint4 &v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

/* the q|k|v epilogue's arguments (MODE 2; as k_gemv_qkv's): q out (T, nh hd), the KV cache
 * (y, of type OT) with its layout, the positions, sequences and block tables of the T tokens */
struct fm_qkv {
    float *q;
    const int32_t *pos, *seq, *bts;
    const float *inv_freq;
    int bt_stride, nh, nkv, hd, bs, n_layers, layer;
    float ksc, vsc;
};

/* the weight row behind tile row r (0..15) of tile p: MODE 0 rows 16p + r; MODE 1 gate row
 * 8p + r (r < 8) or up row I + 8p + r - 8; MODE 2 (q|k|v, hd a multiple of 16) the RoPE pairs
 * of q and k head hh = p / (hd / 16), rows hh hd + j and + hd / 2 for j = 8 (p % (hd / 16)) +
 * r % 8, then the v rows 16 at a time; clamped into the matrix (a dead row re-reads the
 * last; its result is not stored).  N: rows (MODE 0, 2) or I (MODE 1). */
template <int MODE>
__device__ __forceinline__ int fm_row(int p, int r, int N, const fm_qkv &qa) {
    if (MODE == 0) return min(16 * p + r, N - 1);
    if (MODE == 1) {
        int o = min(8 * p + (r & 7), N - 1);
        return r < 8 ? o : N + o;
    }
    int hq = qa.hd / 16, nr = (qa.nh + qa.nkv) * hq;
    if (p < nr) return (p / hq) * qa.hd + (p % hq) * 8 + (r & 7) + (r < 8 ? 0 : qa.hd / 2);
    return min((qa.nh + qa.nkv) * qa.hd + 16 * (p - nr) + r, N - 1);
}

/* MODE 0: y (T, N) f32 = x w^T (+ bias); MODE 1: y (T, N) OT = silu(x wg^T) * (x wu^T), w
 * (2N, K).  BS 0: one scale a row (applied at the end); 1: scale blocks of bk columns (bk a
 * multiple of 64), folded in per chunk.  Tiles: ceil(N / 16) (MODE 0) or ceil(N / 8) (MODE 1);
 * a warp takes MT consecutive tiles (the x of a chunk converted once for MT x 16 rows), a CTA
 * FM_WARPS / SK such warp tiles, SK warps each, warp sp taking chunks [sp lenc, (sp + 1) lenc)
 * of the ceil(K / 64).  FM_LD / MT chunks of loads in flight: 8 x 16 bytes a lane. */
#define FM_LD 4 /* chunks x tiles a lane loads before using them (two 16-byte loads each) */
template <int NT, int MT, int MODE, typename OT, int BS, int DB>
__global__ void __launch_bounds__(32 * FM_WARPS)
    k_f8mma(OT *__restrict__ y, const bf16 *__restrict__ x, const uint8_t *__restrict__ w,
            fm_sc sc, const float *__restrict__ bias, int T, int N, int K, int SK, int lenc,
            fm_qkv qa) {
    constexpr int U = FM_LD / MT;
    __shared__ float red[FM_WARPS][MT][NT][4][32];
    const int wi = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n_tiles = MODE == 0   ? (N + 15) / 16
                        : MODE == 1 ? (N + 7) / 8
                                    : (qa.nh + qa.nkv) * (qa.hd / 16) + qa.nkv * qa.hd / 16;
    const int p0 = (blockIdx.x * (FM_WARPS / SK) + wi / SK) * MT, sp = wi % SK;
    const int K16 = K / 16, CH = (K16 + 3) / 4;
    const int c_lo = sp * lenc, c_hi = min(CH, c_lo + lenc);
    const int live = p0 < n_tiles; /* (a tile p0 + m >= n_tiles computes, its rows clamped) */
    int rlo[MT], rhi[MT];
#pragma unroll
    for (int m = 0; m < MT; m++) {
        rlo[m] = live ? fm_row<MODE>(p0 + m, g, N, qa) : 0;
        rhi[m] = live ? fm_row<MODE>(p0 + m, g + 8, N, qa) : 0;
    }
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int q = 0; q < 4; q++)
                acc[m][n][q] = 0.0f;
    __half2 xm = __float2half2_rn(0.0f); /* the largest |x| this lane converted */
    if (live && c_lo < c_hi) {
        const uint4 *wl[MT], *wh[MT];
        const float *sl[MT], *sh[MT];
#pragma unroll
        for (int m = 0; m < MT; m++) {
            wl[m] = reinterpret_cast<const uint4 *>(w + (size_t)rlo[m] * K);
            wh[m] = reinterpret_cast<const uint4 *>(w + (size_t)rhi[m] * K);
            sl[m] = sc.s + (size_t)(rlo[m] / sc.bn) * sc.nkb;
            sh[m] = sc.s + (size_t)(rhi[m] / sc.bn) * sc.nkb;
        }
        const uint4 *xr[NT];
#pragma unroll
        for (int n = 0; n < NT; n++) /* token g + 8n (no load when it is >= T) */
            xr[n] = reinterpret_cast<const uint4 *>(x + (size_t)min(g + 8 * n, T - 1) * K);
        const uint64_t pol = fm_evict_first();
        uint4 wa[U][MT][2], wb[U][MT][2];
        float sa[U][MT][2], sb[U][MT][2];
        /* the chunks cb .. cb + U - 1 (those < c_hi) into W / S */
        auto load = [&](uint4(&W)[U][MT][2], float(&S)[U][MT][2], int cb) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                int c = cb + u, i = 4 * c + t; /* this lane's uint4 of the row */
                int ok = c < c_hi && i < K16;
                int kb = BS && c < c_hi ? (64 * c) / sc.bk : 0;
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    W[u][m][0] = ok ? fm_ld_stream(wl[m] + i, pol) : make_uint4(0, 0, 0, 0);
                    W[u][m][1] = ok ? fm_ld_stream(wh[m] + i, pol) : make_uint4(0, 0, 0, 0);
                    if (BS) {
                        S[u][m][0] = __ldg(sl[m] + kb);
                        S[u][m][1] = __ldg(sh[m] + kb);
                    }
                }
            }
        };
        /* the products of the chunks cb0 .. cb0 + U - 1 (those < c_hi), loaded in W / S */
        auto compute = [&](const uint4(&W)[U][MT][2], const float(&S)[U][MT][2], int cb0) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                int c = cb0 + u, i = 4 * c + t;
                if (c >= c_hi) break; /* warp-uniform */
                uint32_t xb[NT][8];
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    uint4 v0 = make_uint4(0, 0, 0, 0), v1 = make_uint4(0, 0, 0, 0);
                    if (g + 8 * n < T && i < K16) {
                        v0 = __ldg(xr[n] + 2 * i);
                        v1 = __ldg(xr[n] + 2 * i + 1);
                    }
                    xb[n][0] = fm_bf2h(v0.x, xm), xb[n][1] = fm_bf2h(v0.y, xm);
                    xb[n][2] = fm_bf2h(v0.z, xm), xb[n][3] = fm_bf2h(v0.w, xm);
                    xb[n][4] = fm_bf2h(v1.x, xm), xb[n][5] = fm_bf2h(v1.y, xm);
                    xb[n][6] = fm_bf2h(v1.z, xm), xb[n][7] = fm_bf2h(v1.w, xm);
                }
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    float d[NT][4];
#pragma unroll
                    for (int n = 0; n < NT; n++)
#pragma unroll
                        for (int q = 0; q < 4; q++)
                            d[n][q] = BS ? 0.0f : acc[m][n][q];
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        uint32_t a0, a1, a2, a3; /* rows g, g + 8; columns 4j + 0, 1 | 2, 3 */
                        fm_e4m3x4(fm_word(W[u][m][0], j), a0, a2);
                        fm_e4m3x4(fm_word(W[u][m][1], j), a1, a3);
#pragma unroll
                        for (int n = 0; n < NT; n++)
                            fm_mma(d[n], a0, a1, a2, a3, xb[n][2 * j], xb[n][2 * j + 1]);
                    }
#pragma unroll
                    for (int n = 0; n < NT; n++) {
                        if (BS) {
                            acc[m][n][0] = fmaf(S[u][m][0], d[n][0], acc[m][n][0]);
                            acc[m][n][1] = fmaf(S[u][m][0], d[n][1], acc[m][n][1]);
                            acc[m][n][2] = fmaf(S[u][m][1], d[n][2], acc[m][n][2]);
                            acc[m][n][3] = fmaf(S[u][m][1], d[n][3], acc[m][n][3]);
                        } else {
#pragma unroll
                            for (int q = 0; q < 4; q++)
                                acc[m][n][q] = d[n][q];
                        }
                    }
                }
            }
        };
        int c0 = c_lo;
        load(wa, sa, c0);
        pdl_wait(); /* x is the previous kernel's output; the weights are not */
        if (DB) { /* two buffers: the next U chunks' loads in flight while these are used */
            for (;;) {
                if (c0 + U < c_hi) load(wb, sb, c0 + U);
                compute(wa, sa, c0);
                c0 += U;
                if (c0 >= c_hi) break;
                if (c0 + U < c_hi) load(wa, sa, c0 + U);
                compute(wb, sb, c0);
                c0 += U;
                if (c0 >= c_hi) break;
            }
        } else {
            for (;;) {
                compute(wa, sa, c0);
                c0 += U;
                if (c0 >= c_hi) break;
                load(wa, sa, c0);
            }
        }
    } else {
        pdl_wait();
    }
    pdl_trigger(); /* late: the next kernel's CTAs start once this grid's loads are done */

    /* |x| >= 65536 somewhere in this warp's columns: f16 could not hold it; the warp's sums
     * again in f32 on the CUDA cores (each weight times its block's scale when BS) */
    if (__any_sync(0xffffffffu, fmaxf(__low2float(xm), __high2float(xm)) > 65504.0f) && live) {
        const int k_lo = 64 * c_lo, k_hi = min(K, 64 * c_hi);
#pragma unroll
        for (int m = 0; m < MT; m++) {
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int q = 0; q < 4; q++)
                    acc[m][n][q] = 0.0f;
            for (int r = 0; r < 16; r++) {
                int row = fm_row<MODE>(p0 + m, r, N, qa);
                const uint8_t *wr = w + (size_t)row * K;
                const float *sr = sc.s + (size_t)(row / sc.bn) * sc.nkb;
                for (int tok = 0; tok < T; tok++) {
                    float v = 0.0f;
                    for (int k = k_lo + lane; k < k_hi; k += 32) {
                        __half_raw hw =
                            __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)wr[k], __NV_E4M3);
                        float wf = __half2float(*reinterpret_cast<__half *>(&hw));
                        if (BS) wf *= __ldg(sr + k / sc.bk);
                        v = fmaf(wf, __bfloat162float(x[(size_t)tok * K + k]), v);
                    }
                    v = warp_sum(v);
                    /* its place in the mma layout: n-tile tok / 8, lane 4 (r % 8) + (tok % 8)
                     * / 2, accumulator 2 (r / 8) + tok % 2 */
                    int nt = tok >> 3, owner = 4 * (r & 7) + ((tok & 7) >> 1),
                        qi = 2 * (r >> 3) + (tok & 1);
#pragma unroll
                    for (int n = 0; n < NT; n++)
#pragma unroll
                        for (int q = 0; q < 4; q++)
                            if (n == nt && q == qi && lane == owner) acc[m][n][q] = v;
                }
            }
        }
    }

    if (SK > 1) { /* the tiles' SK partial sums, added in split order by their first warp */
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int q = 0; q < 4; q++)
                    red[wi][m][n][q][lane] = acc[m][n][q];
        __syncthreads();
        if (sp) return;
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    float v = 0.0f;
                    for (int s = 0; s < SK; s++)
                        v += red[wi + s][m][n][q][lane];
                    acc[m][n][q] = v;
                }
    }
    if (!live) return;
    /* lane (g, t): accumulators 0, 1 = tile row g, tokens 8n + 2t, 8n + 2t + 1; 2, 3 = row g + 8 */
#pragma unroll
    for (int m = 0; m < MT; m++) {
        const int p = p0 + m;
        if (p >= n_tiles) break;
        const float slo = BS ? 1.0f : __ldg(sc.s + (size_t)(rlo[m] / sc.bn) * sc.nkb);
        const float shi = BS ? 1.0f : __ldg(sc.s + (size_t)(rhi[m] / sc.bn) * sc.nkb);
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int tok = 8 * n + 2 * t + e;
                if (tok >= T) continue;
                float vlo = acc[m][n][e] * slo, vhi = acc[m][n][2 + e] * shi;
                if constexpr (MODE == 0) {
                    int olo = 16 * p + g, ohi = olo + 8;
                    if (olo < N)
                        store_as(y + (size_t)tok * N + olo, vlo + (bias ? bias[olo] : 0.0f));
                    if (ohi < N)
                        store_as(y + (size_t)tok * N + ohi, vhi + (bias ? bias[ohi] : 0.0f));
                } else if constexpr (MODE == 1) {
                    int o = 8 * p + g;
                    if (o < N) store_as(y + (size_t)tok * N + o, vlo / (1.0f + expf(-vlo)) * vhi);
                } else { /* k_gemv_qkv's epilogue for the pair (rlo, rhi) */
                    const int h = qa.nh * qa.hd, kvd = qa.nkv * qa.hd, hq = qa.hd / 16;
                    const int rl = rlo[m], rh = rhi[m];
                    float u = vlo + (bias ? bias[rl] : 0.0f), v = vhi + (bias ? bias[rh] : 0.0f);
                    int ps = qa.pos[tok], pad = ps < 0;
                    const int32_t *bt = qa.bts + (size_t)qa.seq[tok] * qa.bt_stride;
                    if (p < (qa.nh + qa.nkv) * hq) {
                        int hh = p / hq, j = (p % hq) * 8 + g;
                        float an = (pad ? 0.0f : (float)ps) * qa.inv_freq[j];
                        float cs = cosf(an), sn = sinf(an);
                        float o0 = u * cs - v * sn, o1 = v * cs + u * sn;
                        if (hh < qa.nh) {
                            qa.q[(size_t)tok * h + rl] = o0;
                            qa.q[(size_t)tok * h + rh] = o1;
                        } else if (!pad) {
                            size_t ok = kv_off(bt, ps, qa.bs, qa.n_layers, kvd, qa.layer, 0);
                            store_kv(y + ok + (rl - h), o0, qa.ksc);
                            store_kv(y + ok + (rh - h), o1, qa.ksc);
                        }
                    } else if (!pad) {
                        size_t ov = kv_off(bt, ps, qa.bs, qa.n_layers, kvd, qa.layer, 1);
                        store_kv(y + ov + (rl - h - kvd), u, qa.vsc);
                        store_kv(y + ov + (rh - h - kvd), v, qa.vsc);
                    }
                }
            }
    }
}

int gemv_f8mma_ok(int T, int K, int bk, const void *x, const void *w) {
    return T >= 1 && T <= FM_MAXT && K >= 16 && K % 16 == 0 && (bk >= K || bk % 64 == 0) &&
           !(((uintptr_t)x | (uintptr_t)w) & 15);
}

/* tiles a warp (MT): setting 1|2 (DISAGG_CUDA_FP8_MMA_MT), else 2 where the 16-row tiles
 * alone fill 16 warps a multiprocessor (the 7B gate|up), 1 otherwise.  Warps a warp tile
 * (split-K, SK): setting 1|2|4|8 (DISAGG_CUDA_FP8_MMA_SPLIT), else (0, auto) doubled from 1
 * while the warps are fewer than 16 a multiprocessor and each split keeps at least FM_LD / MT
 * chunks: the 7B shapes gate|up MT 2 SK 2; down, o, q|k|v MT 1 SK 8 */
static void f8mma_shape(const dcu_ctx *c, int tiles, int CH, int *mt, int *sk) {
    long slots = (long)c->n_sm * 16;
    int m = c->fp8_mma_mt == 1 || c->fp8_mma_mt == 2 ? c->fp8_mma_mt : tiles >= slots ? 2 : 1;
    int wt = (tiles + m - 1) / m, s = 1;
    if (c->fp8_mma_split > 0) {
        s = c->fp8_mma_split;
        while (s > 1 && CH / s < 1)
            s >>= 1;
    } else {
        while (s < FM_WARPS && (long)wt * s < slots && CH / (2 * s) >= FM_LD / m)
            s *= 2;
    }
    *mt = m, *sk = s;
}

template <int MODE, typename OT>
static int f8mma_launch(dcu_ctx *c, OT *y, const void *x, const void *w, const dcu_f8scale *f8,
                        const float *bias, int T, int N, int K, const fm_qkv &qa) {
    if (!f8 || !f8->s || f8->bn < 1 || f8->bk < 1 || N < 1 || !gemv_f8mma_ok(T, K, f8->bk, x, w))
        return -EINVAL;
    fm_sc sc = {f8->s, f8->bn, f8->bk, (K + f8->bk - 1) / f8->bk};
    int bs = f8->bk < K; /* scale blocks inside a row (bk a multiple of 64: gemv_f8mma_ok) */
    int tiles = MODE == 0   ? (N + 15) / 16
                : MODE == 1 ? (N + 7) / 8
                            : (qa.nh + qa.nkv) * (qa.hd / 16) + qa.nkv * qa.hd / 16;
    int CH = (K / 16 + 3) / 4, MT, SK;
    f8mma_shape(c, tiles, CH, &MT, &SK);
    if (MODE == 2) MT = 1; /* (few tiles: the q|k|v form has MT 1 only) */
    /* double-buffered loads (DISAGG_CUDA_FP8_MMA_DB=0|1; default: for MT 1, the GEMVs of few
     * tiles, whose warps are too few to keep enough bytes in flight single-buffered) */
    int db = c->fp8_mma_db == 0 || c->fp8_mma_db == 1 ? c->fp8_mma_db : MT == 1;
    int lenc = (CH + SK - 1) / SK, tpc = FM_WARPS / SK * MT; /* tiles a CTA */
    dim3 g((tiles + tpc - 1) / tpc), b(32 * FM_WARPS);
    const bf16 *xb = (const bf16 *)x;
    const uint8_t *wb = (const uint8_t *)w;
#define FM_(NT, M, BS, D)                                                                          \
    if ((T > 8) == (NT == 2) && MT == M && bs == BS && db == D)                                    \
        return launch_pdl(c, "gemv_f8mma", k_f8mma<NT, M, MODE, OT, BS, D>, g, b, 0, y, xb, wb,    \
                          sc, bias, T, N, K, SK, lenc, qa);
    FM_(1, 1, 0, 0) FM_(1, 1, 1, 0) FM_(2, 1, 0, 0) FM_(2, 1, 1, 0)
    FM_(1, 1, 0, 1) FM_(1, 1, 1, 1) FM_(2, 1, 0, 1) FM_(2, 1, 1, 1)
    if constexpr (MODE != 2) {
        FM_(1, 2, 0, 0) FM_(1, 2, 1, 0) FM_(2, 2, 0, 0) FM_(2, 2, 1, 0)
        FM_(1, 2, 0, 1) FM_(1, 2, 1, 1) FM_(2, 2, 0, 1) FM_(2, 2, 1, 1)
    }
#undef FM_
    return -EINVAL;
}

int gemv_f8mma(dcu_ctx *c, float *y, const void *x, const void *w, const dcu_f8scale *f8,
               const float *bias, int T, int N, int K) {
    return f8mma_launch<0, float>(c, y, x, w, f8, bias, T, N, K, fm_qkv{});
}

int gemv_f8mma_gate_up(dcu_ctx *c, void *h, int h_dtype, const void *x, const void *w,
                       const dcu_f8scale *f8, int T, int I, int K) {
    return h_dtype == DCU_BF16
               ? f8mma_launch<1, bf16>(c, (bf16 *)h, x, w, f8, NULL, T, I, K, fm_qkv{})
               : f8mma_launch<1, float>(c, (float *)h, x, w, f8, NULL, T, I, K, fm_qkv{});
}

int gemv_f8mma_qkv(dcu_ctx *c, float *qout, void *kv, int kv_kind, const void *x, const void *w,
                   const dcu_f8scale *f8, const float *bias, int T, int K, int bs, int n_layers,
                   int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts,
                   int bt_stride, const float *inv_freq, int nh, int nkv, int hd, float ksc,
                   float vsc) {
    if (hd < 16 || hd % 16 || nh < 1 || nkv < 1) return -EINVAL;
    fm_qkv qa = {qout, pos, seq, bts, inv_freq, bt_stride, nh, nkv, hd, bs, n_layers, layer,
                 ksc, vsc};
    int W = (nh + 2 * nkv) * hd;
    if (kv_kind == 2)
        return f8mma_launch<2, f8e4m3>(c, (f8e4m3 *)kv, x, w, f8, bias, T, W, K, qa);
    qa.ksc = qa.vsc = 1.0f;
    return kv_kind ? f8mma_launch<2, bf16>(c, (bf16 *)kv, x, w, f8, bias, T, W, K, qa)
                   : f8mma_launch<2, float>(c, (float *)kv, x, w, f8, bias, T, W, K, qa);
}
