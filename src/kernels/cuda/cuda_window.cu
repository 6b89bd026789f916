/*
 * cuda_window — sliding-window attention on the GPU (see cuda_window.h).  One CTA of
 * CW_WARPS warps per (token, query head): warp w takes keys lo + w, lo + w + CW_WARPS, ...;
 * per key the lanes split the head's elements, the dot product is a warp reduction, and the
 * warp keeps an online softmax (max m, sum l, unnormalised o) in f32; the warps' partials
 * are folded in warp order at the end.
 */
#include "kernels/cuda/cuda_mma.cuh" /* kv_off */
#include "kernels/cuda/cuda_window.h"

#include <cuda_bf16.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>

#define CW_WARPS 4
#define CW_MAX_PER_LANE 32 /* hd <= 32 * 32 */

template <typename T> __device__ __forceinline__ float cw_ld(const T *p);
template <> __device__ __forceinline__ float cw_ld<float>(const float *p) {
    return *p;
}
template <> __device__ __forceinline__ float cw_ld<__nv_bfloat16>(const __nv_bfloat16 *p) {
    return __bfloat162float(*p);
}
template <typename T> __device__ __forceinline__ void cw_st(T *p, float v);
template <> __device__ __forceinline__ void cw_st<float>(float *p, float v) {
    *p = v;
}
template <> __device__ __forceinline__ void cw_st<__nv_bfloat16>(__nv_bfloat16 *p, float v) {
    *p = __float2bfloat16(v);
}

template <typename KT, typename OT>
__global__ void __launch_bounds__(CW_WARPS * 32)
    k_att_window(OT *out, const float *q, const KT *kv, int bs, int n_layers, int layer,
                 const int32_t *pos, const int32_t *seq, const int32_t *bts, int bt_stride, int nh,
                 int nkv, int hd, float scale, int window) {
    extern __shared__ float sm[]; /* q (hd), then per warp (m, l, o[hd]) */
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    OT *o = out + ((size_t)t * nh + h) * hd;
    const int p = pos[t];
    if (p < 0) { /* graph padding: no keys */
        for (int d = threadIdx.x; d < hd; d += blockDim.x)
            cw_st(o + d, 0.0f);
        return;
    }
    const int lo = window > 0 && p + 1 > window ? p + 1 - window : 0;
    const int kvd = nkv * hd, kvh = h / (nh / nkv);
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    float *qs = sm, *part = sm + hd + w * (hd + 2);
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        qs[d] = q[((size_t)t * nh + h) * hd + d];
    __syncthreads();
    float m = -INFINITY, l = 0.0f, acc[CW_MAX_PER_LANE];
    const int per = (hd + 31) / 32;
    for (int i = 0; i < per; i++)
        acc[i] = 0.0f;
    for (int j = lo + w; j <= p; j += CW_WARPS) {
        const KT *k = kv + kv_off(bt, j, bs, n_layers, kvd, layer, 0) + (size_t)kvh * hd;
        const KT *v = kv + kv_off(bt, j, bs, n_layers, kvd, layer, 1) + (size_t)kvh * hd;
        float dot = 0.0f;
        for (int i = 0; i < per; i++) {
            int d = lane + 32 * i;
            if (d < hd) dot = fmaf(qs[d], cw_ld(k + d), dot);
        }
        for (int off = 16; off > 0; off >>= 1)
            dot += __shfl_xor_sync(0xffffffffu, dot, off);
        float s = dot * scale, mn = fmaxf(m, s);
        float corr = expf(m - mn), e = expf(s - mn); /* m = -inf first: corr 0 */
        l = l * corr + e;
        for (int i = 0; i < per; i++) {
            int d = lane + 32 * i;
            if (d < hd) acc[i] = fmaf(e, cw_ld(v + d), acc[i] * corr);
        }
        m = mn;
    }
    if (lane == 0) part[0] = m, part[1] = l;
    for (int i = 0; i < per; i++) {
        int d = lane + 32 * i;
        if (d < hd) part[2 + d] = acc[i];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int ww = 0; ww < CW_WARPS; ww++)
        M = fmaxf(M, sm[hd + ww * (hd + 2)]);
    float L = 0.0f;
    for (int ww = 0; ww < CW_WARPS; ww++) {
        const float *pw = sm + hd + ww * (hd + 2);
        if (pw[1] > 0.0f) L += pw[1] * expf(pw[0] - M);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float od = 0.0f;
        for (int ww = 0; ww < CW_WARPS; ww++) {
            const float *pw = sm + hd + ww * (hd + 2);
            if (pw[1] > 0.0f) od += pw[2 + d] * expf(pw[0] - M);
        }
        cw_st(o + d, od / L);
    }
}

int cw_attention(cudaStream_t stream, void *out, int out_bf16, const float *q, const void *kv,
                 int kv_bf16, int bs, int n_layers, int layer, const int32_t *pos,
                 const int32_t *seq, const int32_t *bt, int bt_stride, int T, int nh, int nkv,
                 int hd, float scale, int window) {
    if (T <= 0) return 0;
    if (hd < 1 || hd > 32 * CW_MAX_PER_LANE || nkv < 1 || nh % nkv) return -EINVAL;
    dim3 grid((unsigned)T, (unsigned)nh);
    size_t smem = ((size_t)hd + CW_WARPS * ((size_t)hd + 2)) * sizeof(float);
    typedef __nv_bfloat16 bf;
    if (kv_bf16 && out_bf16)
        k_att_window<bf, bf><<<grid, CW_WARPS * 32, smem, stream>>>(
            (bf *)out, q, (const bf *)kv, bs, n_layers, layer, pos, seq, bt, bt_stride, nh, nkv,
            hd, scale, window);
    else if (kv_bf16)
        k_att_window<bf, float><<<grid, CW_WARPS * 32, smem, stream>>>(
            (float *)out, q, (const bf *)kv, bs, n_layers, layer, pos, seq, bt, bt_stride, nh,
            nkv, hd, scale, window);
    else if (out_bf16)
        k_att_window<float, bf><<<grid, CW_WARPS * 32, smem, stream>>>(
            (bf *)out, q, (const float *)kv, bs, n_layers, layer, pos, seq, bt, bt_stride, nh,
            nkv, hd, scale, window);
    else
        k_att_window<float, float><<<grid, CW_WARPS * 32, smem, stream>>>(
            (float *)out, q, (const float *)kv, bs, n_layers, layer, pos, seq, bt, bt_stride, nh,
            nkv, hd, scale, window);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "cuda: sliding-window attention launch failed: %s\n",
                cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}
