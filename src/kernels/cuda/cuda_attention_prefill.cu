/*
 * cuda_attention_prefill — attention of the prefill tiles (sequences with >= 16 new tokens
 * in the batch) over the paged bf16 KV, FlashAttention-2 style (online softmax, causal):
 * k_prefill_attention_mma (128-row tiles, 4 warps of 32 rows, mma.sync; the default),
 * k_prefill_attention_mma8w (the same tiles on 8 warps of 16 rows: grids that leave SMs
 * idle), k_prefill_attention_wmma (64-row tiles on wmma: head_dim 16).  The batch's other
 * tokens go to the decode kernels (cuda_attention_decode.cu) in the same call
 * (attention_mixed).  The superseded generations live in dev/cuda/prefill_attention.cu.
 */
#include "kernels/cuda/cuda_common.cuh"

#include <mma.h>

#define FA_BK 64 /* keys per tile */

static size_t prefill_wmma_smem(int hd) {
    return (size_t)(FA_BQ + 2 * FA_BK) * hd * 2 /* Q, K, V bf16 */ + 4 * 16 * FA_BK * 4 /* S */ +
           4 * 16 * FA_BK * 2 /* P */ + 4 * 16 * (size_t)hd * 4 /* O */ + 2 * 64 * 4 /* m, l */;
}

/* Flash attention (online softmax) over the paged bf16 KV for prefill tiles: CTA = (tile of
 * up to 64 consecutive new tokens of one sequence, query head).  tiles (n, 3): first token,
 * rows, sequence.  The tile's positions are pos[t0] .. pos[t0] + rows - 1; keys 0 ..
 * pos[t0] + rows - 1 are read tile by tile through the block table, causally masked.
 * S = Q K^T and O += P V on tensor cores (wmma bf16, f32 accumulate); softmax in f32. */
template <int HD, typename OT>
__global__ void __launch_bounds__(128)
    k_prefill_attention_wmma(OT *out, const float *q, const bf16 *kv, int bs, int n_layers,
                             int layer, const int32_t *tiles, const int32_t *pos,
                             const int32_t *bts, int bt_stride, int nh, int nkv, float scale) {
    using namespace nvcuda;
    int tile = blockIdx.x, h = blockIdx.y, kvh = h / (nh / nkv), kvd = nkv * HD;
    int t0 = tiles[3 * tile], rows = tiles[3 * tile + 1], sq = tiles[3 * tile + 2];
    const int32_t *bt = bts + (size_t)sq * bt_stride;
    int p0 = pos[t0], kmax = p0 + rows;
    extern __shared__ __align__(16) char smem[];
    bf16 *Qs = (bf16 *)smem, *Ks = Qs + FA_BQ * HD, *Vs = Ks + FA_BK * HD;
    float *Ss = (float *)(Vs + FA_BK * HD);
    bf16 *Ps = (bf16 *)(Ss + 4 * 16 * FA_BK);
    float *Os = (float *)(Ps + 4 * 16 * FA_BK);
    float *Ms = Os + 4 * 16 * HD, *Ls = Ms + 64;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wr0 = warp * 16;
    for (int i = threadIdx.x; i < FA_BQ * HD; i += 128) {
        int r = i / HD, d = i % HD;
        float v = r < rows ? q[(size_t)(t0 + r) * nh * HD + (size_t)h * HD + d] * scale : 0.0f;
        Qs[i] = __float2bfloat16(v);
    }
    for (int i = threadIdx.x; i < 4 * 16 * HD; i += 128)
        Os[i] = 0.0f;
    if (threadIdx.x < 64) Ms[threadIdx.x] = -INFINITY, Ls[threadIdx.x] = 0.0f;
    __syncthreads();
    for (int k0 = 0; k0 < kmax; k0 += FA_BK) {
        for (int i = threadIdx.x; i < FA_BK * HD / 8; i += 128) {
            int r = i / (HD / 8), c8 = i % (HD / 8), j = k0 + r;
            uint4 kz = make_uint4(0, 0, 0, 0), vz = kz;
            if (j < kmax) {
                kz = *(const uint4 *)(kv + kv_off(bt, j, bs, n_layers, kvd, layer, 0) +
                                      (size_t)kvh * HD + c8 * 8);
                vz = *(const uint4 *)(kv + kv_off(bt, j, bs, n_layers, kvd, layer, 1) +
                                      (size_t)kvh * HD + c8 * 8);
            }
            *(uint4 *)(Ks + r * HD + c8 * 8) = kz;
            *(uint4 *)(Vs + r * HD + c8 * 8) = vz;
        }
        __syncthreads();
        if (wr0 < rows && k0 <= p0 + wr0 + 15) {
            float *Sw = Ss + warp * 16 * FA_BK;
            bf16 *Pw = Ps + warp * 16 * FA_BK;
            float *Ow = Os + warp * 16 * HD;
#pragma unroll
            for (int n = 0; n < FA_BK / 16; n++) {
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
                wmma::fill_fragment(acc, 0.0f);
#pragma unroll
                for (int kk = 0; kk < HD / 16; kk++) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b;
                    wmma::load_matrix_sync(a, Qs + wr0 * HD + kk * 16, HD);
                    wmma::load_matrix_sync(b, Ks + n * 16 * HD + kk * 16, HD);
                    wmma::mma_sync(acc, a, b, acc);
                }
                wmma::store_matrix_sync(Sw + n * 16, acc, FA_BK, wmma::mem_row_major);
            }
            __syncwarp();
            int r = lane >> 1, c0 = (lane & 1) * 32, qpos = p0 + wr0 + r;
            float *srow = Sw + r * FA_BK;
            float mx = -INFINITY;
            for (int cc = 0; cc < 32; cc++) {
                int j = k0 + c0 + cc;
                float v = (j <= qpos && wr0 + r < rows) ? srow[c0 + cc] : -INFINITY;
                srow[c0 + cc] = v;
                mx = fmaxf(mx, v);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            float mold = Ms[wr0 + r], mnew = fmaxf(mold, mx);
            float corr = mnew == -INFINITY ? 1.0f : __expf(mold - mnew);
            float sum = 0.0f;
            for (int cc = 0; cc < 32; cc++) {
                float v = srow[c0 + cc];
                float e = v == -INFINITY ? 0.0f : __expf(v - mnew);
                bf16 eb = __float2bfloat16(e);
                Pw[r * FA_BK + c0 + cc] = eb;
                sum += __bfloat162float(eb); /* the weights P V uses */
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            for (int d = (lane & 1) * (HD / 2); d < (lane & 1) * (HD / 2) + HD / 2; d++)
                Ow[r * HD + d] *= corr;
            __syncwarp();
            if ((lane & 1) == 0) {
                Ms[wr0 + r] = mnew;
                Ls[wr0 + r] = Ls[wr0 + r] * corr + sum;
            }
#pragma unroll
            for (int dn = 0; dn < HD / 16; dn++) {
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
                wmma::load_matrix_sync(o, Ow + dn * 16, HD, wmma::mem_row_major);
#pragma unroll
                for (int kk = 0; kk < FA_BK / 16; kk++) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
                    wmma::load_matrix_sync(a, Pw + kk * 16, FA_BK);
                    wmma::load_matrix_sync(b, Vs + kk * 16 * HD + dn * 16, HD);
                    wmma::mma_sync(o, a, b, o);
                }
                wmma::store_matrix_sync(Ow + dn * 16, o, HD, wmma::mem_row_major);
            }
            __syncwarp();
        }
        __syncthreads();
    }
    float *Ow = Os + warp * 16 * HD;
    for (int i = lane; i < 16 * HD; i += 32) {
        int r = i / HD, d = i % HD;
        if (wr0 + r < rows) {
            float L = Ls[wr0 + r];
            store_as(out + (size_t)(t0 + wr0 + r) * nh * HD + (size_t)h * HD + d,
                     L > 0 ? Ow[i] / L : 0.0f);
        }
    }
}

template <int HD, typename OT>
static int launch_prefill_wmma(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                        const int32_t *tiles, int n_tiles, const int32_t *pos, const int32_t *bts,
                        int bt_stride, int nh, int nkv, float scale) {
    size_t sh = prefill_wmma_smem(HD);
    static int attr_done[2][8];
    int oi = sizeof(OT) == 2, hi = HD / 16 - 1;
    if (!attr_done[oi][hi]) {
        cudaFuncSetAttribute(k_prefill_attention_wmma<HD, OT>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sh);
        attr_done[oi][hi] = 1;
    }
    dim3 grid(n_tiles, nh);
    k_prefill_attention_wmma<HD, OT><<<grid, 128, sh, c->stream>>>(out, q, (const bf16 *)kv->base,
                                                          kv->block_size, kv->n_layers, layer,
                                                          tiles, pos, bts, bt_stride, nh, nkv,
                                                          scale);
    return launch_check("prefill_attention_wmma");
}

#define F2_PAD 8

/* k_prefill_attention_mma8w — mma.sync m16n8k16, Q/S/P/O in registers, ldmatrix from padded
 * shared memory, cp.async double buffering of 64-key K/V tiles, 16 query rows a warp and
 * 16 * NW a CTA (NW = 8: 128-row tiles, each K/V tile read from L2 serves 128 rows); Q
 * scaled by scale * log2(e) so the softmax is one ex2 an element;
 * the causal mask only on the tiles that cross a warp's diagonal; grid (query head, tile)
 * with the heads fastest (a GQA group's CTAs run together and share K/V in L2) and the last
 * (longest) tiles of the batch first. */
__device__ __forceinline__ float ex2f(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* 8 KV elements (global) -> 8 bf16 (shared) of a K/V tile: bf16 KV by cp.async (16 bytes,
 * asynchronous, in the stage's commit group); FP8 KV by one 8-byte load converted exactly to
 * bf16 and stored (synchronous: the scales are applied outside, k_scale folded into q's
 * scale, v_scale into O) */
__device__ __forceinline__ void kv_tile8(bf16 *dst, const bf16 *src) {
    cp_async16(dst, src);
}
__device__ __forceinline__ void kv_tile8(bf16 *dst, const f8e4m3 *src) {
    *(uint4 *)dst = e4m3x8_to_bf8(*(const uint2 *)src);
}

static size_t prefill_mma8w_smem(int hd) {
    return (size_t)2 * 2 * FA_BK * (hd + F2_PAD) * 2;
}

template <int HD, typename OT, int NW, typename KT>
__global__ void __launch_bounds__(NW * 32, NW == 4 ? 2 : 1)
    k_prefill_attention_mma8w(OT *out, const float *q, const KT *kv, int bs, int n_layers,
                              int layer, const int32_t *tiles, int n_tiles, const int32_t *pos,
                              const int32_t *bts, int bt_stride, int nh, int nkv, float qscale,
                              float vsc) {
    constexpr int LD = HD + F2_PAD, NT = FA_BK / 8, DT = HD / 8, KS = HD / 16, NTH = NW * 32;
    int h = blockIdx.x, tile = n_tiles - 1 - (int)blockIdx.y;
    int kvh = h / (nh / nkv), kvd = nkv * HD;
    int t0 = tiles[3 * tile], rows = tiles[3 * tile + 1], sq = tiles[3 * tile + 2];
    const int32_t *bt = bts + (size_t)sq * bt_stride;
    int p0 = pos[t0], kmax = p0 + rows;
    extern __shared__ __align__(16) char smem[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wr0 = warp * 16;
    const KT *kvh_base = kv + (size_t)kvh * HD;
    const size_t vgap = (size_t)bs * kvd; /* V of a slot is one (block size x kv_dim) after K */
    /* tile kt's K and V into stage stg (cp.async, one commit group) */
    auto load_async = [&](int stg, int kt) {
        bf16 *K_ = (bf16 *)smem + (size_t)stg * 2 * FA_BK * LD, *V_ = K_ + FA_BK * LD;
#pragma unroll
        for (int i = threadIdx.x; i < FA_BK * HD / 8; i += NTH) {
            int r = i / (HD / 8), c8 = i % (HD / 8), j = kt + r;
            bf16 *kd = K_ + r * LD + c8 * 8, *vd = V_ + r * LD + c8 * 8;
            if (j < kmax) {
                const KT *src = kvh_base + kv_off(bt, j, bs, n_layers, kvd, layer, 0) + c8 * 8;
                kv_tile8(kd, src);
                kv_tile8(vd, src + vgap);
            } else {
                *(uint4 *)kd = make_uint4(0, 0, 0, 0);
                *(uint4 *)vd = make_uint4(0, 0, 0, 0);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    load_async(0, 0);
    int g = lane >> 2, qd = lane & 3;
    /* Q fragments (rows wr0 + g, wr0 + g + 8), scaled by scale * log2(e), rounded to bf16;
     * rows past the tile are zero (their scores are 0: finite, never stored) */
    uint32_t qa[KS][4];
    int r0 = wr0 + g, r1 = r0 + 8;
    const float *q0 = q + (size_t)(t0 + r0) * nh * HD + (size_t)h * HD;
    const float *q1 = q + (size_t)(t0 + r1) * nh * HD + (size_t)h * HD;
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        int c = kk * 16 + 2 * qd;
        float2 z = make_float2(0.f, 0.f);
        float2 x00 = r0 < rows ? *(const float2 *)(q0 + c) : z;
        float2 x10 = r1 < rows ? *(const float2 *)(q1 + c) : z;
        float2 x01 = r0 < rows ? *(const float2 *)(q0 + c + 8) : z;
        float2 x11 = r1 < rows ? *(const float2 *)(q1 + c + 8) : z;
        qa[kk][0] = pack_bf2(x00.x * qscale, x00.y * qscale);
        qa[kk][1] = pack_bf2(x10.x * qscale, x10.y * qscale);
        qa[kk][2] = pack_bf2(x01.x * qscale, x01.y * qscale);
        qa[kk][3] = pack_bf2(x11.x * qscale, x11.y * qscale);
    }
    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    int qp0 = p0 + r0, qp1 = p0 + r1; /* query positions of the two rows */
    int wfirst = p0 + wr0, wlast = wfirst + 15; /* the warp's first and last query positions */
    for (int k0 = 0, it = 0; k0 < kmax; k0 += FA_BK, it++) {
        int stg = it & 1;
        if (k0 + FA_BK < kmax)
            load_async(stg ^ 1, k0 + FA_BK); /* the stage the previous tile used */
        else
            asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::); /* this tile's copy is done */
        __syncthreads();
        const bf16 *Ks = (const bf16 *)smem + (size_t)stg * 2 * FA_BK * LD, *Vs = Ks + FA_BK * LD;
        if (wr0 < rows && k0 <= wlast) {
            float s[NT][4];
#pragma unroll
            for (int n = 0; n < NT; n++)
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; n++) {
#pragma unroll
                for (int kk = 0; kk < KS; kk += 2) {
                    /* matrices: keys n*8 .. +7, d = kk*16 + m*8 (m = 0..3) */
                    uint32_t b[4];
                    ldsm_x4(b, Ks + (n * 8 + (lane & 7)) * LD + kk * 16 + (lane >> 3) * 8);
                    mma_bf16(s[n], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
                    if (kk + 1 < KS)
                        mma_bf16(s[n], qa[kk + 1][0], qa[kk + 1][1], qa[kk + 1][2],
                                 qa[kk + 1][3], b[2], b[3]);
                }
            }
            if (k0 + FA_BK - 1 > wfirst) { /* the tile crosses the warp's diagonal */
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    int j = k0 + n * 8 + 2 * qd;
                    if (j > qp0) s[n][0] = -INFINITY;
                    if (j + 1 > qp0) s[n][1] = -INFINITY;
                    if (j > qp1) s[n][2] = -INFINITY;
                    if (j + 1 > qp1) s[n][3] = -INFINITY;
                }
            }
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
                mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            /* every row sees key 0 in the first tile (its position >= 0), so the running max
             * is finite from then on; the guards only cover a row masked whole */
            float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
            float c0 = ex2f(m0 - b0), c1 = ex2f(m1 - b1); /* ex2(-inf) = 0 */
            uint32_t pa[NT][2];
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                float e0 = ex2f(s[n][0] - b0), e1 = ex2f(s[n][1] - b0);
                float e2 = ex2f(s[n][2] - b1), e3 = ex2f(s[n][3] - b1);
                pa[n][0] = pack_bf2(e0, e1);
                pa[n][1] = pack_bf2(e2, e3);
                __nv_bfloat162 p01 = *(__nv_bfloat162 *)&pa[n][0],
                               p23 = *(__nv_bfloat162 *)&pa[n][1];
                sum0 += __low2float(p01) + __high2float(p01); /* the weights P V uses */
                sum1 += __low2float(p23) + __high2float(p23);
            }
            /* l: this thread's columns only (the row max, hence c, is the quad's); the quad
             * adds its four partial sums once, after the last tile */
            l0 = l0 * c0 + sum0;
            l1 = l1 * c1 + sum1;
            m0 = mn0, m1 = mn1;
#pragma unroll
            for (int dn = 0; dn < DT; dn++) {
                o[dn][0] *= c0, o[dn][1] *= c0;
                o[dn][2] *= c1, o[dn][3] *= c1;
            }
            /* O += P V: k-steps of 16 keys; V fragments by ldmatrix.trans, two d-tiles a load */
#pragma unroll
            for (int kk = 0; kk < FA_BK / 16; kk++) {
#pragma unroll
                for (int dn = 0; dn < DT; dn += 2) {
                    uint32_t b[4];
                    int m = lane >> 3;
                    ldsm_x4_t(b, Vs + (kk * 16 + (m & 1) * 8 + (lane & 7)) * LD + dn * 8 +
                                     (m >> 1) * 8);
                    mma_bf16(o[dn], pa[2 * kk][0], pa[2 * kk][1], pa[2 * kk + 1][0],
                             pa[2 * kk + 1][1], b[0], b[1]);
                    mma_bf16(o[dn + 1], pa[2 * kk][0], pa[2 * kk][1], pa[2 * kk + 1][0],
                             pa[2 * kk + 1][1], b[2], b[3]);
                }
            }
        }
        __syncthreads(); /* every warp is done with this stage before it is refilled */
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    float i0 = l0 > 0 ? 1.0f / l0 : 0.0f, i1 = l1 > 0 ? 1.0f / l1 : 0.0f;
    if (sizeof(KT) == 1) i0 *= vsc, i1 *= vsc; /* FP8 KV: v_scale */
#pragma unroll
    for (int dn = 0; dn < DT; dn++) {
        int d = dn * 8 + 2 * qd;
        if (r0 < rows) {
            OT *p = out + (size_t)(t0 + r0) * nh * HD + (size_t)h * HD + d;
            store_as(p, o[dn][0] * i0);
            store_as(p + 1, o[dn][1] * i0);
        }
        if (r1 < rows) {
            OT *p = out + (size_t)(t0 + r1) * nh * HD + (size_t)h * HD + d;
            store_as(p, o[dn][2] * i1);
            store_as(p + 1, o[dn][3] * i1);
        }
    }
}

template <int HD, typename OT, int NW, typename KT>
static int launch_prefill_mma8w_kt(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv,
                                   int layer, const int32_t *tiles, int n_tiles,
                                   const int32_t *pos, const int32_t *bts, int bt_stride, int nh,
                                   int nkv, float scale, float vsc) {
    size_t sh = prefill_mma8w_smem(HD);
    static int attr_done;
    if (!attr_done) {
        cudaFuncSetAttribute(k_prefill_attention_mma8w<HD, OT, NW, KT>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sh);
        attr_done = 1;
    }
    dim3 grid(nh, n_tiles);
    k_prefill_attention_mma8w<HD, OT, NW, KT><<<grid, NW * 32, sh, c->stream>>>(
        out, q, (const KT *)kv->base, kv->block_size, kv->n_layers, layer, tiles, n_tiles, pos,
        bts, bt_stride, nh, nkv, scale * 1.4426950408889634f, vsc);
    return launch_check("prefill_attention_mma8w");
}
/* FP8 KV: k_scale folded into q's scale, v_scale applied to O */
template <int HD, typename OT, int NW>
static int launch_prefill_mma8w(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                                const int32_t *tiles, int n_tiles, const int32_t *pos,
                                const int32_t *bts, int bt_stride, int nh, int nkv, float scale) {
    if (kv->dtype == DCU_F8E4M3)
        return launch_prefill_mma8w_kt<HD, OT, NW, f8e4m3>(c, out, q, kv, layer, tiles, n_tiles,
                                                           pos, bts, bt_stride, nh, nkv,
                                                           scale * kv->k_scale, kv->v_scale);
    return launch_prefill_mma8w_kt<HD, OT, NW, bf16>(c, out, q, kv, layer, tiles, n_tiles, pos,
                                                     bts, bt_stride, nh, nkv, scale, 1.0f);
}

/* k_prefill_attention_mma — k_prefill_attention_mma8w with 32 query rows a warp (the default;
 * DISAGG_CUDA_FLASH_MT=1: the 8-warp kernel): 4 warps, 128-row tiles, each warp two m16
 * tiles, so every K and V fragment read from shared memory by ldmatrix feeds two mma instead
 * of one (ldmatrix traffic per FLOP 0.6x of the 8-warp kernel's; the
 * FlashAttention-2 layout).  Q (scaled by scale * log2(e), bf16) lives in shared memory and
 * is read by ldmatrix each k-step, which leaves the registers for O (2 x head_dim / 2) and S. */
#define PA_NW 4

static size_t prefill_mma_smem(int hd) {
    return (size_t)(FA_BQ3 + 2 * 2 * FA_BK) * (hd + F2_PAD) * 2;
}

template <int HD, typename OT, typename KT>
__global__ void __launch_bounds__(PA_NW * 32, 2)
    k_prefill_attention_mma(OT *out, const float *q, const KT *kv, int bs, int n_layers,
                            int layer, const int32_t *tiles, int n_tiles, const int32_t *pos,
                            const int32_t *bts, int bt_stride, int nh, int nkv, float qscale,
                            float vsc) {
    constexpr int LD = HD + F2_PAD, NT = FA_BK / 8, DT = HD / 8, KS = HD / 16, NTH = PA_NW * 32;
    int h = blockIdx.x, tile = n_tiles - 1 - (int)blockIdx.y;
    int kvh = h / (nh / nkv), kvd = nkv * HD;
    int t0 = tiles[3 * tile], rows = tiles[3 * tile + 1], sq = tiles[3 * tile + 2];
    const int32_t *bt = bts + (size_t)sq * bt_stride;
    int p0 = pos[t0], kmax = p0 + rows;
    extern __shared__ __align__(16) char smem[];
    bf16 *Qs = (bf16 *)smem, *KV0 = Qs + FA_BQ3 * LD;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wr0 = warp * 32;
    const KT *kvh_base = kv + (size_t)kvh * HD;
    const size_t vgap = (size_t)bs * kvd;
    /* kv_off's address with the loop-invariant parts hoisted and, for a power-of-two block
     * size, a shift and a mask for the division (the same address) */
    const size_t per_block = (size_t)n_layers * 2 * bs * kvd,
                 lay_off = (size_t)layer * 2 * bs * kvd;
    const int bs_sh = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;
    auto load_async = [&](int stg, int kt) {
        bf16 *K_ = KV0 + (size_t)stg * 2 * FA_BK * LD, *V_ = K_ + FA_BK * LD;
#pragma unroll
        for (int i = threadIdx.x; i < FA_BK * HD / 8; i += NTH) {
            int r = i / (HD / 8), c8 = i % (HD / 8), j = kt + r;
            bf16 *kd = K_ + r * LD + c8 * 8, *vd = V_ + r * LD + c8 * 8;
            if (j < kmax) {
                int bi = bs_sh >= 0 ? j >> bs_sh : j / bs,
                    slot = bs_sh >= 0 ? j & (bs - 1) : j % bs;
                const KT *src =
                    kvh_base + (size_t)bt[bi] * per_block + lay_off + (size_t)slot * kvd + c8 * 8;
                kv_tile8(kd, src);
                kv_tile8(vd, src + vgap);
            } else {
                *(uint4 *)kd = make_uint4(0, 0, 0, 0);
                *(uint4 *)vd = make_uint4(0, 0, 0, 0);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    load_async(0, 0);
    /* Q into shared memory: scaled, bf16, rows past the tile zero */
    for (int i = threadIdx.x; i < FA_BQ3 * HD / 4; i += NTH) {
        int r = i / (HD / 4), c4 = i % (HD / 4);
        float4 v = r < rows ? *(const float4 *)(q + (size_t)(t0 + r) * nh * HD + (size_t)h * HD +
                                                c4 * 4)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
        uint2 pk = make_uint2(pack_bf2(v.x * qscale, v.y * qscale),
                              pack_bf2(v.z * qscale, v.w * qscale));
        *(uint2 *)(Qs + r * LD + c4 * 4) = pk;
    }
    int g = lane >> 2, qd = lane & 3;
    float o[2][DT][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int i = 0; i < DT; i++)
            o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
    float m[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
    float l[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    int wlast = p0 + wr0 + 31;
    for (int k0 = 0, it = 0; k0 < kmax; k0 += FA_BK, it++) {
        int stg = it & 1;
        if (k0 + FA_BK < kmax)
            load_async(stg ^ 1, k0 + FA_BK);
        else
            asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads(); /* this tile's K/V (and, the first time, Q) are visible */
        const bf16 *Ks = KV0 + (size_t)stg * 2 * FA_BK * LD, *Vs = Ks + FA_BK * LD;
        if (wr0 < rows && k0 <= wlast) {
            float s[2][NT][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int n = 0; n < NT; n++)
                    s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KS; kk += 2) {
                /* A fragments of k-steps kk, kk + 1 for both m16 tiles */
                uint32_t qa[2][2][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int sub = 0; sub < 2; sub++)
                        if (kk + sub < KS)
                            ldsm_x4(qa[mt][sub], Qs + (wr0 + mt * 16 + (lane & 15)) * LD +
                                                     (kk + sub) * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    uint32_t b[4];
                    ldsm_x4(b, Ks + (n * 8 + (lane & 7)) * LD + kk * 16 + (lane >> 3) * 8);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        mma_bf16(s[mt][n], qa[mt][0][0], qa[mt][0][1], qa[mt][0][2],
                                 qa[mt][0][3], b[0], b[1]);
                        if (kk + 1 < KS)
                            mma_bf16(s[mt][n], qa[mt][1][0], qa[mt][1][1], qa[mt][1][2],
                                     qa[mt][1][3], b[2], b[3]);
                    }
                }
            }
            uint32_t pa[2][NT][2];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                int mfirst = p0 + wr0 + mt * 16, qp0 = mfirst + g, qp1 = qp0 + 8;
                if (k0 + FA_BK - 1 > mfirst) { /* the tile crosses this m16 tile's diagonal */
#pragma unroll
                    for (int n = 0; n < NT; n++) {
                        int j = k0 + n * 8 + 2 * qd;
                        if (j > qp0) s[mt][n][0] = -INFINITY;
                        if (j + 1 > qp0) s[mt][n][1] = -INFINITY;
                        if (j > qp1) s[mt][n][2] = -INFINITY;
                        if (j + 1 > qp1) s[mt][n][3] = -INFINITY;
                    }
                }
                float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    mx0 = fmaxf(mx0, fmaxf(s[mt][n][0], s[mt][n][1]));
                    mx1 = fmaxf(mx1, fmaxf(s[mt][n][2], s[mt][n][3]));
                }
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
                /* a row whose keys are all masked in this tile keeps its (finite) max */
                float mn0 = fmaxf(m[mt][0], mx0), mn1 = fmaxf(m[mt][1], mx1);
                float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
                float c0 = ex2f(m[mt][0] - b0), c1 = ex2f(m[mt][1] - b1);
                float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    float e0 = ex2f(s[mt][n][0] - b0), e1 = ex2f(s[mt][n][1] - b0);
                    float e2 = ex2f(s[mt][n][2] - b1), e3 = ex2f(s[mt][n][3] - b1);
                    pa[mt][n][0] = pack_bf2(e0, e1);
                    pa[mt][n][1] = pack_bf2(e2, e3);
                    __nv_bfloat162 p01 = *(__nv_bfloat162 *)&pa[mt][n][0],
                                   p23 = *(__nv_bfloat162 *)&pa[mt][n][1];
                    sum0 += __low2float(p01) + __high2float(p01); /* the weights P V uses */
                    sum1 += __low2float(p23) + __high2float(p23);
                }
                l[mt][0] = l[mt][0] * c0 + sum0; /* this thread's columns; the quad adds up last */
                l[mt][1] = l[mt][1] * c1 + sum1;
                m[mt][0] = mn0, m[mt][1] = mn1;
#pragma unroll
                for (int dn = 0; dn < DT; dn++) {
                    o[mt][dn][0] *= c0, o[mt][dn][1] *= c0;
                    o[mt][dn][2] *= c1, o[mt][dn][3] *= c1;
                }
            }
            /* O += P V: each V fragment (ldmatrix.trans, two d-tiles) feeds both m16 tiles */
#pragma unroll
            for (int kk = 0; kk < FA_BK / 16; kk++) {
#pragma unroll
                for (int dn = 0; dn < DT; dn += 2) {
                    uint32_t b[4];
                    int mm = lane >> 3;
                    ldsm_x4_t(b, Vs + (kk * 16 + (mm & 1) * 8 + (lane & 7)) * LD + dn * 8 +
                                     (mm >> 1) * 8);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        mma_bf16(o[mt][dn], pa[mt][2 * kk][0], pa[mt][2 * kk][1],
                                 pa[mt][2 * kk + 1][0], pa[mt][2 * kk + 1][1], b[0], b[1]);
                        mma_bf16(o[mt][dn + 1], pa[mt][2 * kk][0], pa[mt][2 * kk][1],
                                 pa[mt][2 * kk + 1][0], pa[mt][2 * kk + 1][1], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads(); /* every warp is done with this stage before it is refilled */
    }
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        float l0 = l[mt][0], l1 = l[mt][1];
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        float i0 = l0 > 0 ? 1.0f / l0 : 0.0f, i1 = l1 > 0 ? 1.0f / l1 : 0.0f;
        if (sizeof(KT) == 1) i0 *= vsc, i1 *= vsc; /* FP8 KV: v_scale */
        int r0 = wr0 + mt * 16 + g, r1 = r0 + 8;
#pragma unroll
        for (int dn = 0; dn < DT; dn++) {
            int d = dn * 8 + 2 * qd;
            if (r0 < rows) {
                OT *p = out + (size_t)(t0 + r0) * nh * HD + (size_t)h * HD + d;
                store_as(p, o[mt][dn][0] * i0);
                store_as(p + 1, o[mt][dn][1] * i0);
            }
            if (r1 < rows) {
                OT *p = out + (size_t)(t0 + r1) * nh * HD + (size_t)h * HD + d;
                store_as(p, o[mt][dn][2] * i1);
                store_as(p + 1, o[mt][dn][3] * i1);
            }
        }
    }
}

template <int HD, typename OT, typename KT>
static int launch_prefill_mma_kt(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                                 const int32_t *tiles, int n_tiles, const int32_t *pos,
                                 const int32_t *bts, int bt_stride, int nh, int nkv, float scale,
                                 float vsc) {
    size_t sh = prefill_mma_smem(HD);
    static int attr_done;
    if (!attr_done) {
        cudaFuncSetAttribute(k_prefill_attention_mma<HD, OT, KT>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sh);
        attr_done = 1;
    }
    dim3 grid(nh, n_tiles);
    k_prefill_attention_mma<HD, OT, KT><<<grid, PA_NW * 32, sh, c->stream>>>(
        out, q, (const KT *)kv->base, kv->block_size, kv->n_layers, layer, tiles, n_tiles, pos,
        bts, bt_stride, nh, nkv, scale * 1.4426950408889634f, vsc);
    return launch_check("prefill_attention_mma");
}
template <int HD, typename OT>
static int launch_prefill_mma(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                              const int32_t *tiles, int n_tiles, const int32_t *pos,
                              const int32_t *bts, int bt_stride, int nh, int nkv, float scale) {
    if (kv->dtype == DCU_F8E4M3)
        return launch_prefill_mma_kt<HD, OT, f8e4m3>(c, out, q, kv, layer, tiles, n_tiles, pos,
                                                     bts, bt_stride, nh, nkv,
                                                     scale * kv->k_scale, kv->v_scale);
    return launch_prefill_mma_kt<HD, OT, bf16>(c, out, q, kv, layer, tiles, n_tiles, pos, bts,
                                               bt_stride, nh, nkv, scale, 1.0f);
}

/* k_prefill_attention_mma's CTAs are 4 warps: when the grid leaves SMs without a CTA (a
 * 512-token prompt of 28 heads: 112 CTAs for 132 SMs) the 8-warp CTAs of
 * k_prefill_attention_mma8w keep twice the warps busy, so such launches take that kernel
 * (c->flash_auto); DISAGG_CUDA_FLASH_MT=1 takes it always */
int prefill_mma8_for(const dcu_ctx *c, int n_tiles, int nh) {
    if (c->flash_mt == 2 && c->flash_auto && (long)n_tiles * nh < c->n_sm) return 1;
    return c->flash_mt == 1;
}

/* tiles of FA_BQ3 rows */
template <int HD, typename OT>
static int launch_prefill_tiles(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv,
                                int layer, const int32_t *tiles, int n_tiles, const int32_t *pos,
                                const int32_t *bts, int bt_stride, int nh, int nkv, float scale) {
    if (!prefill_mma8_for(c, n_tiles, nh))
        return launch_prefill_mma<HD, OT>(c, out, q, kv, layer, tiles, n_tiles, pos, bts,
                                          bt_stride, nh, nkv, scale);
    return launch_prefill_mma8w<HD, OT, FA_BQ3 / 16>(c, out, q, kv, layer, tiles, n_tiles, pos,
                                                     bts, bt_stride, nh, nkv, scale);
}

/* Can the prefill kernel take this shape? (bf16 KV, head_dim 16/32/64/128; FP8 KV, head_dim
 * 32/64/128: the 128-row kernels, which convert the tiles to bf16 as they load them) */
int flash_ok(const dcu_ctx *c, int kv_dtype, int hd) {
    if (kv_dtype == DCU_F8E4M3) return hd == 32 || hd == 64 || hd == 128;
    return kv_dtype == DCU_BF16 && (hd == 16 || hd == 32 || hd == 64 || hd == 128);
}

/* Host side: splits a batch into prefill tiles (sequences with >= 16 new tokens, chunks of bq)
 * and the rest (one list entry per token).  seq_of(t) / pos are the per-token host arrays;
 * tokens of a sequence are contiguous.  tiles: (3 * n_tiles), rest: (n_rest).  Returns the
 * largest pos + 1 among the rest. */
int split_batch(int T, const int32_t *seq, const int32_t *pos, int flash, int bq,
                       int32_t *tiles, int *n_tiles, int32_t *rest, int *n_rest) {
    int nt = 0, nr = 0, rest_ctx = 0;
    for (int t = 0; t < T;) {
        int e = t;
        while (e < T && seq[e] == seq[t])
            e++;
        if (flash && e - t >= 16) {
            for (int a = t; a < e; a += bq) {
                tiles[3 * nt] = a;
                tiles[3 * nt + 1] = e - a < bq ? e - a : bq;
                tiles[3 * nt + 2] = seq[t];
                nt++;
            }
        } else {
            for (int a = t; a < e; a++) {
                rest[nr++] = a;
                if (pos[a] + 1 > rest_ctx) rest_ctx = pos[a] + 1;
            }
        }
        t = e;
    }
    *n_tiles = nt;
    *n_rest = nr;
    return rest_ctx;
}

/* attention of a split batch: the flash kernel over tiles, the split kernel over the rest */
int attention_mixed(dcu_ctx *c, void *out, int out_dtype, const float *q,
                           const dcu_kv *kv, int layer, const int32_t *pos, const int32_t *seq,
                           const int32_t *bts, int bt_stride, int T, int nh, int nkv, int hd,
                           float scale, const int32_t *tiles_d, int n_tiles,
                           const int32_t *tiles3_d, int n_tiles3, const int32_t *rest_d,
                           int n_rest, int rest_ctx) {
    int rc = 0;
    if (n_tiles > 0) {
        int b = out_dtype == DCU_BF16;
#define FL(H)                                                                                      \
    (b ? launch_prefill_wmma<H, bf16>(c, (bf16 *)out, q, kv, layer, tiles_d, n_tiles, pos, bts,    \
                                      bt_stride, nh, nkv, scale)                                   \
       : launch_prefill_wmma<H, float>(c, (float *)out, q, kv, layer, tiles_d, n_tiles, pos, bts,  \
                                       bt_stride, nh, nkv, scale))
#define FL3(H)                                                                                     \
    (b ? launch_prefill_tiles<H, bf16>(c, (bf16 *)out, q, kv, layer, tiles3_d, n_tiles3, pos, bts, \
                                       bt_stride, nh, nkv, scale)                                  \
       : launch_prefill_tiles<H, float>(c, (float *)out, q, kv, layer, tiles3_d, n_tiles3, pos,    \
                                        bts, bt_stride, nh, nkv, scale))
        if (hd >= 32 && tiles3_d)
            rc = hd == 32 ? FL3(32) : hd == 64 ? FL3(64) : FL3(128);
        else if (kv->dtype == DCU_F8E4M3) /* the wmma kernel reads bf16 KV only */
            rc = -ENOTSUP;
        else
            rc = hd == 16 ? FL(16) : hd == 32 ? FL(32) : hd == 64 ? FL(64) : FL(128);
#undef FL
#undef FL3
        if (rc) return rc;
    }
    if (n_rest > 0) {
        c->att_list = n_rest == T ? NULL : rest_d;
        rc = attention_scaled(c, out, out_dtype, q, kv, layer, pos, seq, bts, bt_stride, n_rest,
                              nh, nkv, hd, rest_ctx, scale);
        c->att_list = NULL;
    }
    return rc;
}
