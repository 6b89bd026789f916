/*
 * cuda_window — the CUDA backend's sliding-window attention (Mistral's sliding_window,
 * backend_kv.window > 0): for token t at position p and query head h, softmax(scale * q .
 * K[j]) V[j] over keys j = max(0, p - window + 1) .. p of its sequence, read through the
 * block table from the paged KV region (bf16 or f32).  A separate translation unit of
 * libdisagg_cuda.so; cuda_backend.cuh calls it for every attention of a windowed model (so
 * a token's result does not depend on the batch or the prompt's chunking: one CTA per
 * (token, query head), its keys in a fixed order).  Correct first, not tuned: prefill reads
 * each key once per query head (docs/models.md).
 */
#ifndef DISAGG_KERNELS_CUDA_WINDOW_H
#define DISAGG_KERNELS_CUDA_WINDOW_H

#include <cuda_runtime.h>
#include <stdint.h>

/* out (T, nh, hd): f32 (out_bf16 0) or bf16; q (T, nh, hd) f32; kv the region (kv_bf16: bf16
 * elements, else f32); pos/seq (T) and bt (S x bt_stride) device metadata of the plan (a
 * negative position is graph padding: its row is zeroed).  hd <= 1024.  0, -EINVAL (bad
 * shape) or -EIO (launch failure, logged). */
int cw_attention(cudaStream_t stream, void *out, int out_bf16, const float *q, const void *kv,
                 int kv_bf16, int bs, int n_layers, int layer, const int32_t *pos,
                 const int32_t *seq, const int32_t *bt, int bt_stride, int T, int nh, int nkv,
                 int hd, float scale, int window);

#endif
