/*
 * cuda_attention_decode — paged GQA attention of the tokens that are not prefill tiles (the
 * decode tokens), split over the KV in fixed chunks of ATT_CHUNK positions and combined in
 * split order (a token's result never depends on its batch): k_decode_attention_mma (tensor
 * cores; bf16 KV, head_dim 64/128, up to 8 query heads a KV head: the 7B decode) and
 * k_decode_attention (scalar FMAs: every other shape, f32 KV), then
 * k_decode_attention_combine.
 */
#include "kernels/cuda/cuda_common.cuh"

/* ---- attention (scalar split kernel) ---------------------------------------------------- */

#define ATT_WARPS 8
#define ATT_U 4
#define ATT_CHUNK 128 /* KV positions per split of the decode kernel */
#define ATT_MAXG 8

/* grid (T, n_kv, splits), ATT_WARPS warps.  Each warp walks keys k0+w, k0+w+ATT_WARPS, ...
 * keeping an online softmax per query head of the group; the warps are merged at the end.
 * splits == 1: writes the normalised output; else unnormalised partials and (m, l). */
template <typename KT, typename OT, int ND>
__global__ void __launch_bounds__(ATT_WARPS * 32)
    k_decode_attention(OT *out, float *part, float *ml, const float *q, const KT *kv, int bs,
                int n_layers, int layer, const int32_t *pos, const int32_t *seq,
                const int32_t *bts, int bt_stride, int nh, int nkv, int hd, int chunk,
                float scale, const int32_t *list, float ksc, float vsc) {
    int ti = blockIdx.x, kvh = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    int t = list ? list[ti] : ti; /* token; partials are indexed by ti */
    int G = nh / nkv, kvd = nkv * hd;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int n = pos[t] + 1;
    int k0 = sp * chunk, k1 = min(n, k0 + chunk);
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    __shared__ float qs[ATT_MAXG * ND * 32];
    __shared__ float sm[ATT_WARPS][ATT_MAXG], sl[ATT_WARPS][ATT_MAXG];
    __shared__ float sacc[ATT_WARPS][ATT_MAXG * ND * 32];
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x)
        qs[i] = q[(size_t)t * nh * hd + (size_t)kvh * G * hd + i] * scale;
    __syncthreads();
    float m[ATT_MAXG], l[ATT_MAXG], acc[ATT_MAXG][ND];
#pragma unroll
    for (int g = 0; g < ATT_MAXG; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int d = 0; d < ND; d++)
            acc[g][d] = 0.0f;
    }
    /* ATT_U consecutive keys per warp per step: their loads are all in flight at once */
    for (int j0 = k0 + w * ATT_U; j0 < k1; j0 += ATT_WARPS * ATT_U) {
        float kk[ATT_U][ND], vv[ATT_U][ND];
#pragma unroll
        for (int u = 0; u < ATT_U; u++) {
            int j = j0 + u;
            if (j < k1) {
                const KT *kr = kv + kv_off(bt, j, bs, n_layers, kvd, layer, 0) + (size_t)kvh * hd;
                const KT *vr = kv + kv_off(bt, j, bs, n_layers, kvd, layer, 1) + (size_t)kvh * hd;
#pragma unroll
                for (int d = 0; d < ND; d++) {
                    int e = lane + 32 * d;
                    kk[u][d] = e < hd ? load_kv(kr + e, ksc) : 0.0f;
                    vv[u][d] = e < hd ? load_kv(vr + e, vsc) : 0.0f;
                }
            } else {
#pragma unroll
                for (int d = 0; d < ND; d++)
                    kk[u][d] = vv[u][d] = 0.0f;
            }
        }
#pragma unroll
        for (int g = 0; g < ATT_MAXG; g++) {
            if (g >= G) break;
            float sc[ATT_U];
#pragma unroll
            for (int u = 0; u < ATT_U; u++) {
                float s = 0.0f;
#pragma unroll
                for (int d = 0; d < ND; d++) {
                    int e = lane + 32 * d;
                    if (e < hd) s += qs[g * hd + e] * kk[u][d];
                }
                sc[u] = s;
            }
#pragma unroll
            for (int u = 0; u < ATT_U; u++)
                sc[u] = j0 + u < k1 ? warp_sum(sc[u]) : -INFINITY;
            float mn = m[g];
#pragma unroll
            for (int u = 0; u < ATT_U; u++)
                mn = fmaxf(mn, sc[u]);
            float corr = __expf(m[g] - mn);
            l[g] *= corr;
#pragma unroll
            for (int d = 0; d < ND; d++)
                acc[g][d] *= corr;
#pragma unroll
            for (int u = 0; u < ATT_U; u++) {
                float pe = __expf(sc[u] - mn);
                l[g] += pe;
#pragma unroll
                for (int d = 0; d < ND; d++)
                    acc[g][d] += pe * vv[u][d];
            }
            m[g] = mn;
        }
    }
#pragma unroll
    for (int g = 0; g < ATT_MAXG; g++) {
        if (g >= G) break;
        if (lane == 0) {
            sm[w][g] = m[g];
            sl[w][g] = l[g];
        }
#pragma unroll
        for (int d = 0; d < ND; d++) {
            int e = lane + 32 * d;
            if (e < hd) sacc[w][g * hd + e] = acc[g][d];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
        int g = i / hd, e = i % hd;
        float M = -INFINITY;
        for (int ww = 0; ww < ATT_WARPS; ww++)
            M = fmaxf(M, sm[ww][g]);
        float L = 0.0f, A = 0.0f;
        if (M != -INFINITY)
            for (int ww = 0; ww < ATT_WARPS; ww++) {
                float f = sm[ww][g] == -INFINITY ? 0.0f : __expf(sm[ww][g] - M);
                L += sl[ww][g] * f;
                A += sacc[ww][i] * f;
            }
        int head = kvh * G + g;
        if (splits == 1) {
            store_as(out + (size_t)t * nh * hd + (size_t)head * hd + e, L > 0 ? A / L : 0.0f);
        } else {
            size_t pi = ((size_t)ti * nh + head) * splits + sp;
            part[pi * hd + e] = A;
            if (e == 0) {
                ml[pi * 2] = M;
                ml[pi * 2 + 1] = L;
            }
        }
    }
}

/* one block per (token, head), CB_THREADS threads: the split weights exp(m_s - M) into shared
 * memory first (every split's (m, l) read in parallel), then groups of threads sum disjoint
 * splits of each output element with independent loads in flight, and the groups add up in
 * a fixed order.  (It was one thread per element walking the splits one dependent load
 * after another: ~10 us a layer at 32 splits, a 4k context.)  Dynamic shared memory:
 * splits floats. */
#define CB_THREADS 256
/* an empty split (weight 0) adds an exact zero, whatever its partial holds */
__device__ __forceinline__ float wpart(float p, float f) {
    return f == 0.0f ? 0.0f : p * f;
}
template <typename OT>
__global__ void __launch_bounds__(CB_THREADS)
    k_decode_attention_combine(OT *out, const float *part, const float *ml, int nh, int hd,
                               int splits, const int32_t *list) {
    pdl_wait();
    extern __shared__ float cf[]; /* splits */
    __shared__ float red[CB_THREADS];
    __shared__ float sM, sL;
    int th = blockIdx.x; /* ti * nh + head */
    int ti = th / nh, head = th % nh;
    size_t orow = ((size_t)(list ? list[ti] : ti) * nh + head) * hd;
    const float *mlh = ml + (size_t)th * splits * 2;
    float M = -INFINITY;
    for (int s = threadIdx.x; s < splits; s += blockDim.x)
        M = fmaxf(M, mlh[2 * s]);
    red[threadIdx.x] = M;
    __syncthreads();
    if (threadIdx.x < 32) {
        float m = -INFINITY;
        for (int i = threadIdx.x; i < blockDim.x; i += 32)
            m = fmaxf(m, red[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (threadIdx.x == 0) sM = m;
    }
    __syncthreads();
    M = sM;
    float L = 0.0f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        float ms = mlh[2 * s];
        float f = ms == -INFINITY ? 0.0f : __expf(ms - M);
        cf[s] = f;
        L += mlh[2 * s + 1] * f;
    }
    __syncthreads(); /* red[] is reused */
    red[threadIdx.x] = L;
    __syncthreads();
    if (threadIdx.x < 32) {
        float l = 0.0f;
        for (int i = threadIdx.x; i < blockDim.x; i += 32)
            l += red[i];
        l = warp_sum(l);
        if (threadIdx.x == 0) sL = l;
    }
    __syncthreads();
    L = sL;
    int ng = blockDim.x / hd; /* groups over the splits (hd <= blockDim) */
    if (ng < 1) ng = 1;
    int grp = threadIdx.x / hd, e = threadIdx.x % hd;
    const float *ph = part + (size_t)th * splits * hd;
    float A = 0.0f;
    if (grp < ng) {
        int s = grp;
        for (; s + 3 * ng < splits; s += 4 * ng) {
            float p0 = ph[(size_t)s * hd + e], p1 = ph[(size_t)(s + ng) * hd + e];
            float p2 = ph[(size_t)(s + 2 * ng) * hd + e], p3 = ph[(size_t)(s + 3 * ng) * hd + e];
            A += wpart(p0, cf[s]) + wpart(p1, cf[s + ng]) + wpart(p2, cf[s + 2 * ng]) +
                 wpart(p3, cf[s + 3 * ng]);
        }
        for (; s < splits; s += ng)
            A += wpart(ph[(size_t)s * hd + e], cf[s]);
    }
    pdl_trigger(); /* late: the partials are read */
    __syncthreads();
    red[threadIdx.x] = A;
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float a = 0.0f;
        for (int g = 0; g < ng; g++)
            a += red[g * hd + i];
        store_as(out + orow + i, L > 0 ? a / L : 0.0f);
    }
}

/* the previous combine: one thread per output element walks the splits in order; kept for
 * large batches (T > CB_SEQ_T), where the blocks are many and fill the GPU anyway (with the
 * parallel form for every T, decode steps at batch 64 and 128 measured 0.1-0.6 % slower than
 * before it; this split itself was not measured on the device) */
template <typename OT>
__global__ void k_decode_attention_combine_seq(OT *out, const float *part, const float *ml, int nh,
                                               int hd, int splits, const int32_t *list) {
    int th = blockIdx.x; /* ti * nh + head */
    int ti = th / nh, head = th % nh;
    size_t orow = ((size_t)(list ? list[ti] : ti) * nh + head) * hd;
    float M = -INFINITY;
    for (int s = 0; s < splits; s++)
        M = fmaxf(M, ml[((size_t)th * splits + s) * 2]);
    for (int e = threadIdx.x; e < hd; e += blockDim.x) {
        float L = 0.0f, A = 0.0f;
        for (int s = 0; s < splits; s++) {
            float ms = ml[((size_t)th * splits + s) * 2];
            if (ms == -INFINITY) continue;
            float f = __expf(ms - M);
            L += ml[((size_t)th * splits + s) * 2 + 1] * f;
            A += part[((size_t)th * splits + s) * hd + e] * f;
        }
        store_as(out + orow + e, L > 0 ? A / L : 0.0f);
    }
}
#define CB_SEQ_T 8

/* the combine launch: splits floats of dynamic shared memory (at most 48 KiB: 12,288 splits,
 * a context of 1.5 M positions) */
template <typename OT>
static int att_combine(dcu_ctx *c, OT *out, int T, int nh, int hd, int splits) {
    if (T > CB_SEQ_T) {
        k_decode_attention_combine_seq<OT><<<T * nh, hd < 128 ? 128 : hd, 0, c->stream>>>(
            out, c->att_part, c->att_ml, nh, hd, splits, c->att_list);
        return launch_check("att_combine");
    }
    if ((size_t)splits * 4 > 48 * 1024 || hd > CB_THREADS) {
        fprintf(stderr,
                "cuda: attention combine of %d splits, head_dim %d: accepted at most 12288 "
                "splits (a context of %d positions) and head_dim <= %d\n",
                splits, hd, 12288 * ATT_CHUNK, CB_THREADS);
        return -EINVAL;
    }
    return launch_pdl(c, "att_combine", k_decode_attention_combine<OT>, dim3(T * nh),
                      dim3(CB_THREADS), (size_t)splits * 4, out, (const float *)c->att_part,
                      (const float *)c->att_ml, nh, hd, splits, c->att_list);
}

template <typename KT, typename OT, int ND>
static void launch_att(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                       const int32_t *pos, const int32_t *seq, const int32_t *bts, int bt_stride,
                       int T, int nh, int nkv, int hd, int splits, int chunk, float scale) {
    dim3 grid(T, nkv, splits);
    k_decode_attention<KT, OT, ND><<<grid, ATT_WARPS * 32, 0, c->stream>>>(
        out, c->att_part, c->att_ml, q, (const KT *)kv->base, kv->block_size, kv->n_layers, layer,
        pos, seq, bts, bt_stride, nh, nkv, hd, chunk, scale, c->att_list, kv->k_scale,
        kv->v_scale);
    if (splits > 1) att_combine<OT>(c, out, T, nh, hd, splits);
}

template <typename KT, typename OT>
static int att_nd(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                  const int32_t *pos, const int32_t *seq, const int32_t *bts, int bt_stride, int T,
                  int nh, int nkv, int hd, int splits, int chunk, float scale) {
    int nd = (hd + 31) / 32;
    if (nd <= 1)
        launch_att<KT, OT, 1>(c, out, q, kv, layer, pos, seq, bts, bt_stride, T, nh, nkv, hd,
                              splits, chunk, scale);
    else if (nd <= 2)
        launch_att<KT, OT, 2>(c, out, q, kv, layer, pos, seq, bts, bt_stride, T, nh, nkv, hd,
                              splits, chunk, scale);
    else if (nd <= 4)
        launch_att<KT, OT, 4>(c, out, q, kv, layer, pos, seq, bts, bt_stride, T, nh, nkv, hd,
                              splits, chunk, scale);
    else
        return -EINVAL;
    return launch_check("attention");
}

static int launch_att_mma(dcu_ctx *c, void *out, int bf_out, const float *q, const dcu_kv *kv,
                          int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts,
                          int bt_stride, int T, int nh, int nkv, int hd, int splits, int chunk,
                          float scale);

int attention_scaled(dcu_ctx *c, void *out, int out_dtype, const float *q,
                            const dcu_kv *kv, int layer, const int32_t *pos, const int32_t *seq,
                            const int32_t *bts, int bt_stride, int T, int nh, int nkv, int hd,
                            int max_ctx, float scale) {
    if (T <= 0) return 0;
    if (nkv <= 0 || nh % nkv || nh / nkv > ATT_MAXG || hd > 128 || hd % 2) {
        fprintf(stderr,
                "cuda: attention with %d query heads, %d KV heads, head_dim %d is not "
                "supported; accepted: at most %d query heads per KV head, even head_dim <= 128\n",
                nh, nkv, hd, ATT_MAXG);
        return -EINVAL;
    }
    /* split over KV in fixed chunks of ATT_CHUNK positions: a token's keys are cut the same
     * way whatever else is in the batch, so its result does not depend on the batch (the
     * combine adds empty splits as exact zeros) */
    int chunk = ATT_CHUNK, splits = (max_ctx + chunk - 1) / chunk;
    if (splits < 1) splits = 1;
    if (splits > 1) {
        size_t need = (size_t)T * nh * splits * hd, need_ml = (size_t)T * nh * splits * 2;
        if (need > c->att_part_cap) {
            cudaFree(c->att_part);
            c->att_part = NULL;
            c->att_part_cap = 0;
            c->gen++;
            if (cudaMalloc((void **)&c->att_part, need * 4) != cudaSuccess) return -ENOMEM;
            c->att_part_cap = need;
        }
        if (need_ml > c->att_ml_cap) {
            cudaFree(c->att_ml);
            c->att_ml = NULL;
            c->att_ml_cap = 0;
            c->gen++;
            if (cudaMalloc((void **)&c->att_ml, need_ml * 4) != cudaSuccess) return -ENOMEM;
            c->att_ml_cap = need_ml;
        }
    }
    int bf_kv = kv->dtype == DCU_BF16, bf_out = out_dtype == DCU_BF16;
    int f8_kv = kv->dtype == DCU_F8E4M3;
    if ((bf_kv || f8_kv) && (hd == 64 || hd == 128) && nh / nkv <= 8)
        return launch_att_mma(c, out, bf_out, q, kv, layer, pos, seq, bts, bt_stride, T, nh, nkv,
                              hd, splits, chunk, scale);
    if (f8_kv && bf_out)
        return att_nd<f8e4m3, bf16>(c, (bf16 *)out, q, kv, layer, pos, seq, bts, bt_stride, T, nh,
                                    nkv, hd, splits, chunk, scale);
    if (f8_kv)
        return att_nd<f8e4m3, float>(c, (float *)out, q, kv, layer, pos, seq, bts, bt_stride, T,
                                     nh, nkv, hd, splits, chunk, scale);
    if (bf_kv && bf_out)
        return att_nd<bf16, bf16>(c, (bf16 *)out, q, kv, layer, pos, seq, bts, bt_stride, T, nh,
                                  nkv, hd, splits, chunk, scale);
    if (bf_kv)
        return att_nd<bf16, float>(c, (float *)out, q, kv, layer, pos, seq, bts, bt_stride, T,
                                   nh, nkv, hd, splits, chunk, scale);
    if (bf_out)
        return att_nd<float, bf16>(c, (bf16 *)out, q, kv, layer, pos, seq, bts, bt_stride, T, nh,
                                   nkv, hd, splits, chunk, scale);
    return att_nd<float, float>(c, (float *)out, q, kv, layer, pos, seq, bts, bt_stride, T, nh,
                                nkv, hd, splits, chunk, scale);
}



/* ---- decode attention on tensor cores ------------------------------------------------- */

/* The split kernel's work (grid (tokens, KV heads, splits of ATT_CHUNK positions); the same
 * partials and combine) on mma.sync m16n8k16 for bf16 KV, head_dim 64/128, up to 8 query
 * heads per KV head: CTA = (token, KV head, split), 4 warps of 32 keys each; K and V read
 * once for the whole GQA group, straight from global memory into fragments (16-byte loads,
 * no shared memory until the 4 warps merge).
 *   S = Q K^T: A = Q (the group's heads as rows 0..G-1 of 16, scaled, bf16), B = K^T; the
 *   head_dim order inside a 32-wide chunk is permuted alike on both sides (a dot product
 *   does not care), so each thread's K operand is one 16-byte load: thread (g, qd) reads
 *   K[key 8j + g][32p + 8qd .. +7] for k-steps 2p (words x, y) and 2p + 1 (words z, w).
 *   O^T = V^T P^T: A = V^T (16 head_dim rows x 16 keys), B = P^T (keys x heads), which is
 *   exactly S's accumulator layout, rounded to bf16; thread (g, qd) reads V rows of keys
 *   2qd, 2qd+1, 2qd+8, 2qd+9 at head_dim 64h + 8g .. +7 and pairs keys with byte_perm.
 *   Row m of O^T tile mt is element i = 2 mt + (m >= 8) of those loads: d = 64 (i / 8) +
 *   8 g + i % 8.  Softmax in f32 on the S fragments (the row max over a quad of lanes). */
#define AM_WARPS 4
#define AM_KEYS (ATT_CHUNK / AM_WARPS)

__device__ __forceinline__ uint32_t u4_word(const uint4 &u, int i) {
    return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}
/* bf16 element e of a and of b (keys k, k + 1) as one register: a's in the low half */
__device__ __forceinline__ uint32_t pair_bf(const uint4 &a, const uint4 &b, int e) {
    return __byte_perm(u4_word(a, e >> 1), u4_word(b, e >> 1), (e & 1) ? 0x7632 : 0x5410);
}

/* 8 KV elements as 8 bf16 (bf16 KV: one 16-byte load; FP8 KV: one 8-byte load converted
 * exactly, the scales applied outside: k_scale folded into q's scale, v_scale into O) */
__device__ __forceinline__ uint4 kv_ld8(const bf16 *p) {
    return *(const uint4 *)p;
}
__device__ __forceinline__ uint4 kv_ld8(const f8e4m3 *p) {
    return e4m3x8_to_bf8(*(const uint2 *)p);
}

template <int HD, typename OT, typename KT>
__global__ void __launch_bounds__(AM_WARPS * 32)
    k_decode_attention_mma(OT *out, float *part, float *ml, const float *q, const KT *kv, int bs,
              int n_layers, int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts,
              int bt_stride, int nh, int nkv, int chunk, float scale, const int32_t *list,
              float vsc) {
    pdl_wait();
    constexpr int NP = HD / 32, NU = HD / 64, MT = HD / 16;
    int ti = blockIdx.x, kvh = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    int t = list ? list[ti] : ti;
    int G = nh / nkv, kvd = nkv * HD;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, qd = lane & 3;
    int n = pos[t] + 1;
    int k0 = sp * chunk + w * AM_KEYS, k1 = min(n, sp * chunk + chunk);
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    __shared__ float sm_m[AM_WARPS][8], sm_l[AM_WARPS][8];
    __shared__ float sm_o[AM_WARPS][8][HD];
    /* Q: row g (head kvh * G + g), the 32-wide chunks permuted as the K loads */
    uint32_t qa[NP][2][2];
    const float *qr = q + (size_t)t * nh * HD + (size_t)(kvh * G + g) * HD;
#pragma unroll
    for (int p = 0; p < NP; p++)
#pragma unroll
        for (int s2 = 0; s2 < 2; s2++) {
            float4 v = g < G ? *(const float4 *)(qr + 32 * p + 8 * qd + 4 * s2)
                             : make_float4(0.f, 0.f, 0.f, 0.f);
            qa[p][s2][0] = pack_bf2(v.x * scale, v.y * scale);
            qa[p][s2][1] = pack_bf2(v.z * scale, v.w * scale);
        }
    /* V first: its loads do not depend on the softmax, so they are in flight with K's (one
     * round trip to memory for the warp's 32 keys instead of two): keys 2qd, 2qd + 1,
     * 2qd + 8, 2qd + 9 of each k-step of 16 keys */
    uint4 va[2][4][NU];
#pragma unroll
    for (int kk = 0; kk < 2; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int key = k0 + 16 * kk + 2 * qd + (r & 1) + (r >> 1) * 8;
            const KT *vp = key < k1 ? kv + kv_off(bt, key, bs, n_layers, kvd, layer, 1) +
                                          (size_t)kvh * HD + 8 * g
                                    : NULL;
#pragma unroll
            for (int u = 0; u < NU; u++)
                va[kk][r][u] = vp ? kv_ld8(vp + 64 * u) : make_uint4(0, 0, 0, 0);
        }
    /* S (4 tiles of 8 keys): row g, keys 8j + 2qd, +1 in s[j][0], s[j][1] */
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
        int key = k0 + 8 * j + g;
        uint4 kr[NP];
        const KT *kp = key < k1 ? kv + kv_off(bt, key, bs, n_layers, kvd, layer, 0) +
                                      (size_t)kvh * HD + 8 * qd
                                : NULL;
#pragma unroll
        for (int p = 0; p < NP; p++)
            kr[p] = kp ? kv_ld8(kp + 32 * p) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int p = 0; p < NP; p++) {
            mma_bf16(s[j], qa[p][0][0], 0u, qa[p][0][1], 0u, kr[p].x, kr[p].y);
            mma_bf16(s[j], qa[p][1][0], 0u, qa[p][1][1], 0u, kr[p].z, kr[p].w);
        }
    }
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int kc = k0 + 8 * j + 2 * qd;
        if (kc >= k1) s[j][0] = -INFINITY;
        if (kc + 1 >= k1) s[j][1] = -INFINITY;
        mx = fmaxf(mx, fmaxf(s[j][0], s[j][1]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float base = mx == -INFINITY ? 0.0f : mx, l = 0.0f;
    uint32_t pb[4]; /* P^T fragments: tile j's keys 2qd, 2qd+1 of head g */
#pragma unroll
    for (int j = 0; j < 4; j++) {
        pb[j] = pack_bf2(__expf(s[j][0] - base), __expf(s[j][1] - base));
        __nv_bfloat162 pp = *(__nv_bfloat162 *)&pb[j];
        l += __low2float(pp) + __high2float(pp); /* the weights P V uses */
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    /* O^T += V^T P^T over two k-steps of 16 keys */
    float o[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
        o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const int iA = 2 * mt, iB = 2 * mt + 1; /* rows g and g + 8 of the tile */
            uint32_t a0 = pair_bf(va[kk][0][iA / 8], va[kk][1][iA / 8], iA % 8);
            uint32_t a1 = pair_bf(va[kk][0][iB / 8], va[kk][1][iB / 8], iB % 8);
            uint32_t a2 = pair_bf(va[kk][2][iA / 8], va[kk][3][iA / 8], iA % 8);
            uint32_t a3 = pair_bf(va[kk][2][iB / 8], va[kk][3][iB / 8], iB % 8);
            mma_bf16(o[mt], a0, a1, a2, a3, pb[2 * kk], pb[2 * kk + 1]);
        }
    }
    pdl_trigger(); /* late: the loads and MMAs are done */
    /* merge the 4 warps: (m, l) per head, O per head and head_dim element */
    if (qd == 0) {
        sm_m[w][g] = mx;
        sm_l[w][g] = l;
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int iA = 2 * mt, iB = 2 * mt + 1;
        int dA = 64 * (iA / 8) + 8 * g + iA % 8, dB = 64 * (iB / 8) + 8 * g + iB % 8;
        sm_o[w][2 * qd][dA] = o[mt][0];
        sm_o[w][2 * qd + 1][dA] = o[mt][1];
        sm_o[w][2 * qd][dB] = o[mt][2];
        sm_o[w][2 * qd + 1][dB] = o[mt][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        int hg = i / HD, e = i % HD;
        float M = -INFINITY;
#pragma unroll
        for (int ww = 0; ww < AM_WARPS; ww++)
            M = fmaxf(M, sm_m[ww][hg]);
        float L = 0.0f, A = 0.0f;
        if (M != -INFINITY)
#pragma unroll
            for (int ww = 0; ww < AM_WARPS; ww++) {
                float f = sm_m[ww][hg] == -INFINITY ? 0.0f : __expf(sm_m[ww][hg] - M);
                L += sm_l[ww][hg] * f;
                A += sm_o[ww][hg][e] * f;
            }
        A *= vsc; /* FP8 KV: v_scale (1 otherwise: the same bits) */
        int head = kvh * G + hg;
        if (splits == 1) {
            store_as(out + (size_t)t * nh * HD + (size_t)head * HD + e, L > 0 ? A / L : 0.0f);
        } else {
            size_t pi = ((size_t)ti * nh + head) * splits + sp;
            part[pi * HD + e] = A;
            if (e == 0) {
                ml[pi * 2] = M;
                ml[pi * 2 + 1] = L;
            }
        }
    }
}

static int launch_att_mma(dcu_ctx *c, void *out, int bf_out, const float *q, const dcu_kv *kv,
                          int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts,
                          int bt_stride, int T, int nh, int nkv, int hd, int splits, int chunk,
                          float scale) {
    dim3 grid(T, nkv, splits);
    int f8 = kv->dtype == DCU_F8E4M3;
    /* FP8 KV: k_scale folded into q's scale, v_scale applied to O */
    float qs = f8 ? scale * kv->k_scale : scale, vsc = f8 ? kv->v_scale : 1.0f;
#define AMM(H, OT, KT)                                                                             \
    launch_pdl(c, "attention (tensor cores)", k_decode_attention_mma<H, OT, KT>, grid,             \
               dim3(AM_WARPS * 32), 0, (OT *)out, c->att_part, c->att_ml, q,                       \
               (const KT *)kv->base, kv->block_size, kv->n_layers, layer, pos, seq, bts,           \
               bt_stride, nh, nkv, chunk, qs, c->att_list, vsc)
#define AMM_KV(H, OT)                                                                              \
    if (f8)                                                                                        \
        AMM(H, OT, f8e4m3);                                                                        \
    else                                                                                           \
        AMM(H, OT, bf16)
    if (hd == 128 && bf_out) {
        AMM_KV(128, bf16);
    } else if (hd == 128) {
        AMM_KV(128, float);
    } else if (bf_out) {
        AMM_KV(64, bf16);
    } else {
        AMM_KV(64, float);
    }
#undef AMM_KV
#undef AMM
    int rc = launch_check("attention (tensor cores)");
    if (!rc && splits > 1)
        rc = bf_out ? att_combine<bf16>(c, (bf16 *)out, T, nh, hd, splits)
                    : att_combine<float>(c, (float *)out, T, nh, hd, splits);
    return rc;
}
