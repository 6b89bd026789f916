/*
 * cuda_qknorm — the end of the CUDA backend's fused backend_qkv for Qwen3's per-head q/k
 * RMSNorm: from the q|k|v GEMM's f32 output (T, (nh + 2 nkv) * hd), per token and head: the
 * bias (if any), then for q and k heads rmsnorm with the head's weight (ss summed over the
 * head, inv = 1 / sqrtf(ss / hd + eps), w * (x * inv): backend_rmsnorm's arithmetic) and RoPE
 * (rotate-half, f32 angle pos * inv_freq, cosf / sinf), q to qout (T, nh * hd) f32, K and V
 * into the layer's KV slots (bf16 or f32).  A negative position (graph padding) writes no KV.
 * A separate translation unit of libdisagg_cuda.so, called from cb_qkv (cuda_backend.cuh).
 */
#ifndef DISAGG_KERNELS_CUDA_QKNORM_H
#define DISAGG_KERNELS_CUDA_QKNORM_H

#include <cuda_runtime.h>
#include <stdint.h>

/* kv_kind: 0 f32, 1 bf16, 2 FP8 e4m3 KV (K written as e4m3(k / k_scale), V as
 * e4m3(v / v_scale); the scales are ignored for the other kinds).
 * 0, -EINVAL (hd odd or > 1024) or -EIO (launch failure, logged). */
int cq_qknorm_finish(cudaStream_t stream, float *qout, void *kv, int kv_kind, int bs, int n_layers,
                     int layer, const float *qkv, const float *bias, const float *q_norm,
                     const float *k_norm, float eps, const int32_t *pos, const int32_t *seq,
                     const int32_t *bt, int bt_stride, const float *inv_freq, int T, int nh,
                     int nkv, int hd, float k_scale, float v_scale);

#endif
