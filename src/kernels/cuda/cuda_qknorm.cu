/*
 * cuda_qknorm — per-head q/k RMSNorm + RoPE + KV write after the q|k|v GEMM (see
 * cuda_qknorm.h).  Grid (T, nh + 2 nkv): one CTA of 128 threads per (token, head); a q or k
 * head is staged in shared memory, its sum of squares reduced in thread order by one warp
 * (lane i adds elements i, i + 32, ... then a fixed butterfly), normed and rotated; a v head
 * is copied (with its bias) into the cache.
 */
#include "kernels/cuda/cuda_mma.cuh" /* kv_off */
#include "kernels/cuda/cuda_qknorm.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>

template <typename T> __device__ __forceinline__ void cq_st(T *p, float v);
template <> __device__ __forceinline__ void cq_st<float>(float *p, float v) {
    *p = v;
}
template <> __device__ __forceinline__ void cq_st<__nv_bfloat16>(__nv_bfloat16 *p, float v) {
    *p = __float2bfloat16(v);
}
/* the FP8 KV element: e4m3(v / scale), nearest even, saturated (cvt.rn.satfinite) */
struct cq_f8 {
    unsigned char b;
};
template <> __device__ __forceinline__ void cq_st<cq_f8>(cq_f8 *p, float v) {
    p->b = (unsigned char)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

template <typename KT>
__global__ void __launch_bounds__(128)
    k_qknorm_finish(float *qout, KT *kv, int bs, int n_layers, int layer, const float *qkv,
                    const float *bias, const float *q_norm, const float *k_norm, float eps,
                    const int32_t *pos, const int32_t *seq, const int32_t *bts, int bt_stride,
                    const float *inv_freq, int nh, int nkv, int hd, float ksc, float vsc) {
    extern __shared__ float x[]; /* (hd) the head, then 1: its inverse rms */
    const int t = blockIdx.x, hh = blockIdx.y, half = hd / 2, kvd = nkv * hd;
    const int W = (nh + 2 * nkv) * hd, base = hh * hd;
    const float *row = qkv + (size_t)t * W;
    const int p = pos[t], pad = p < 0;
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    if (hh >= nh + nkv) { /* a v head: bias and into the cache */
        if (pad) return;
        size_t ov = kv_off(bt, p, bs, n_layers, kvd, layer, 1) + (size_t)(hh - nh - nkv) * hd;
        for (int d = threadIdx.x; d < hd; d += blockDim.x)
            cq_st(kv + ov + d, (row[base + d] + (bias ? bias[base + d] : 0.0f)) / vsc);
        return;
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        x[d] = row[base + d] + (bias ? bias[base + d] : 0.0f);
    __syncthreads();
    if (threadIdx.x < 32) {
        float ss = 0.0f;
        for (int d = threadIdx.x; d < hd; d += 32)
            ss = fmaf(x[d], x[d], ss);
        for (int off = 16; off > 0; off >>= 1)
            ss += __shfl_xor_sync(0xffffffffu, ss, off);
        if (threadIdx.x == 0) x[hd] = 1.0f / sqrtf(ss / (float)hd + eps);
    }
    __syncthreads();
    const float inv = x[hd], *wn = hh < nh ? q_norm : k_norm;
    const float fp = pad ? 0.0f : (float)p;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        float u = wn[j] * (x[j] * inv), w = wn[j + half] * (x[j + half] * inv);
        float a = fp * inv_freq[j], cs = cosf(a), sn = sinf(a);
        float r0 = u * cs - w * sn, r1 = w * cs + u * sn;
        if (hh < nh) {
            qout[(size_t)t * nh * hd + base + j] = r0;
            qout[(size_t)t * nh * hd + base + j + half] = r1;
        } else if (!pad) {
            size_t ok = kv_off(bt, p, bs, n_layers, kvd, layer, 0) + (size_t)(hh - nh) * hd;
            cq_st(kv + ok + j, r0 / ksc);
            cq_st(kv + ok + j + half, r1 / ksc);
        }
    }
}

int cq_qknorm_finish(cudaStream_t stream, float *qout, void *kv, int kv_kind, int bs, int n_layers,
                     int layer, const float *qkv, const float *bias, const float *q_norm,
                     const float *k_norm, float eps, const int32_t *pos, const int32_t *seq,
                     const int32_t *bt, int bt_stride, const float *inv_freq, int T, int nh,
                     int nkv, int hd, float k_scale, float v_scale) {
    if (T <= 0) return 0;
    if (hd < 2 || hd % 2 || hd > 1024) return -EINVAL;
    dim3 grid((unsigned)T, (unsigned)(nh + 2 * nkv));
    size_t smem = ((size_t)hd + 1) * sizeof(float);
    if (kv_kind != 2) k_scale = v_scale = 1.0f; /* x / 1.0f: the same bits */
#define QKN(KT)                                                                                    \
    k_qknorm_finish<KT><<<grid, 128, smem, stream>>>(qout, (KT *)kv, bs, n_layers, layer, qkv,     \
                                                     bias, q_norm, k_norm, eps, pos, seq, bt,      \
                                                     bt_stride, inv_freq, nh, nkv, hd, k_scale,    \
                                                     v_scale)
    if (kv_kind == 2)
        QKN(cq_f8);
    else if (kv_kind)
        QKN(__nv_bfloat16);
    else
        QKN(float);
#undef QKN
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "cuda: q/k norm finish launch failed: %s\n", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}
