/*
 * cuda_common — the CUDA module's private header (one per module, as ggml-cuda's common.cuh):
 * the device context (dcu_ctx: device, stream, cuBLASLt handle and plan caches, the kernel
 * switches read once from the environment), launch helpers (CK, launch_check, programmatic
 * dependent launch), device helpers shared by several op families, and the host entry points
 * each op family's file gives the others.  The files, one an op family:
 *   cuda_context.cu          device probe, context create/free, blocking copies
 *   cuda_norm.cu             RMSNorm (+ residual add), RoPE, SwiGLU, add/bias, KV write,
 *                            the q|k|v finish (bias + RoPE + KV write), bf16 conversion
 *   cuda_gemm.cu             cuBLASLt GEMMs (plans, the prefill rule, tuning, bf16 output,
 *                            beta = 1 residual) and the copy/GEMM ceilings; its cuBLASLt glue
 *                            (lt_desc_nt, lt_cfg) is shared with cuda_invariant.cu
 *   cuda_gemv.cu             the decode GEMV (T = 1..2, split-K, fused gate|up and q|k|v)
 *   cuda_attention_decode.cu split-KV decode attention (tensor cores and scalar) + combine
 *   cuda_attention_prefill.cu  prefill attention over 128/64-row tiles (mma.sync, wmma)
 *   cuda_sampling.cu         argmax
 *   cuda_moe.cu              mixture of experts: routing, decode GEMVs over the chosen
 *                            experts, the sort by expert and the grouped GEMM (cuda_moe.h)
 *   cuda_backend.cu          kernels/backend.h on top of them (buffers, streams, plans,
 *                            CUDA graphs, per-op timing; the module's one entry point)
 * Built for sm_90 plus compute_90 PTX; linked against the static CUDA runtime and
 * libcublasLt, so the module needs libcuda (the driver) and libcublasLt at load time.  Every
 * function here returns 0 or a negative errno value unless it says otherwise.
 */
#ifndef DISAGG_KERNELS_CUDA_COMMON_CUH
#define DISAGG_KERNELS_CUDA_COMMON_CUH

#include "kernels/cuda/cuda_module.h"
#include "kernels/cuda/cuda_mma.cuh" /* pack_bf2, mma_bf16, ldsm_x4(_t), cp_async16, kv_off */

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <errno.h>
#include <pthread.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <type_traits>

typedef __nv_bfloat16 bf16;

void seterr(char *err, size_t errlen, const char *fmt, ...);

/* ---- context ---------------------------------------------------------------- */

#define PLAN_CACHE 256
#define FA_BQ 64   /* prefill tiles of k_prefill_attention_wmma and the batch-invariant mode */
#define FA_BQ3 128 /* prefill tiles of k_prefill_attention_mma(8w) */
#define PLAN16_CACHE 32

typedef struct gemm_plan {
    int T, N, K, valid;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
} gemm_plan;

#define GEMV_MAX_T 2   /* the GEMV's largest T (its kernels exist for T = 1, 2) */
#define AMX_ROWS 4096 /* argmax rows that take the two-stage kernel (more: one block a row) */
#define AMX_PARTS 32  /* blocks a row in its first stage */

struct dcu_ctx {
    int device;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *ws;           /* cuBLASLt workspace */
    size_t ws_bytes;
    gemm_plan plans[PLAN_CACHE];
    int next_plan;
    gemm_plan plans16[PLAN16_CACHE]; /* GEMMs with a bf16 output (matmul_bf16out) */
    int next_plan16;
    int n_sm;
    float *att_part; /* split-attention partials */
    float *att_ml;   /* (m, l) per partial */
    size_t att_part_cap, att_ml_cap;
    int32_t *amax_tmp; /* argmax partials: AMX_ROWS x AMX_PARTS (value, index) pairs */
    int last_err;
    int fp8_gemv_max_t; /* FP8 GEMMs of T <= this on the FP8 GEMV (DISAGG_CUDA_FP8_GEMV=0..8,
                           default 8; larger T: cuBLASLt bf16 on the twin) */
    int fp8_mma_max_t;  /* FP8 GEMMs of T <= this on the tensor-core e4m3 GEMV (cuda_gemv_f8mma.cu;
                           DISAGG_CUDA_FP8_MMA=1: T <= 16, =N: T <= N; default 0: off) */
    int fp8_mma_split;  /* its warps a tile (DISAGG_CUDA_FP8_MMA_SPLIT=auto|1|2|4|8; 0 auto) */
    int fp8_mma_mt;     /* its 16-row tiles a warp (DISAGG_CUDA_FP8_MMA_MT=1|2; 0 auto) */
    int fp8_mma_db;     /* its loads double-buffered (DISAGG_CUDA_FP8_MMA_DB=0|1; -1 auto) */
    int fp8_gemm;       /* FP8 weights in 128 x 128 blocks at larger T on the e4m3 tensor cores
                           (cuda_gemm_fp8.cu; the default; DISAGG_CUDA_FP8_GEMM=0: the bf16
                           twin) */
    int gemv_max_t; /* GEMMs of T <= this on the GEMV (DISAGG_CUDA_GEMV=0|1|2, default 1; 0: every
                       T through cuBLASLt; at T = 2 cuBLASLt measured faster) */
    int pdl;        /* programmatic dependent launch of the decode kernels (default on;
                       DISAGG_CUDA_PDL=0: off).  With the triggers late (after the loads) it
                       measured 4.52-4.56 against 4.58-4.59 ms a batch-1 step at 4k with CUDA
                       graphs on the H200 (1 December, 18:33); with entry triggers it had been
                       slower (4.66 against 4.61) */
    int norm_pdl;   /* k_rmsnorm4 launched with PDL, its trigger at entry, so the next GEMV's
                       CTAs start streaming weights while it runs (DISAGG_CUDA_NORM_PDL=0: an
                       ordinary launch) */
    int qkv_fuse;   /* the q|k|v GEMV with bias, RoPE and the KV write in its epilogue
                       (DISAGG_CUDA_QKV_FUSE=0: the GEMV, then k_qkv_finish) */
    int gemv_warps; /* rows (warps) per CTA of the GEMV (DISAGG_CUDA_GEMV_WARPS=2|4|8, default 4) */
    int gemv_split; /* split-K of the GEMVs with fewer rows than the GPU has warp slots (o, down,
                       q|k|v): 0 = auto (default; gemv_split_for), 1 = off, 2|4|8 = that factor
                       (DISAGG_CUDA_GEMV_SPLIT=auto|1|2|4|8) */
    int qkv_split;  /* the same for the fused q|k|v GEMV (DISAGG_CUDA_QKV_SPLIT=auto|1|2|4|8) */
    int gemv_split_rows; /* rows a warp of the split-K GEMV (DISAGG_CUDA_GEMV_SPLIT_ROWS=1|2,
                            default 2) */
    int gemv_db;         /* the GEMVs' double-buffered load loop: 0 off, 1 FP8 weights only
                            (default), 2 every GEMV (DISAGG_CUDA_GEMV_DB=0|f8|1) */
    const int32_t *att_list; /* token list of the next split-attention launch (NULL: all) */
    unsigned gen;            /* bumped whenever a scratch buffer moves (recorded graphs go stale) */
    int tune;                /* DISAGG_CUDA_GEMM_TUNE=1: time cuBLASLt's candidates (T <= 256) */
    int flash_mt;            /* 128-row prefill tiles: 2 = k_prefill_attention_mma (4 warps of
                                32 rows), 1 = k_prefill_attention_mma8w (8 warps of 16;
                                DISAGG_CUDA_FLASH_MT=1|2) */
    int gu_bf16_min_t;       /* gate|up GEMMs of T >= this write bf16 (DISAGG_CUDA_GU_BF16=T;
                                0: always f32) */
    int flash_auto;          /* k_prefill_attention_mma8w instead of k_prefill_attention_mma when
                                the 128-row tiles leave SMs idle (DISAGG_CUDA_FLASH_AUTO=0:
                                always k_prefill_attention_mma) */
    int gemm_sweep;          /* DISAGG_CUDA_GEMM_SWEEP=1: time cuBLASLt's candidates of every
                                prefill GEMM (T >= PF_GEMM_MIN_T) and print them; 2: also use
                                the fastest (a timing-based choice: for measuring only) */
    int gemm_algo;           /* DISAGG_CUDA_GEMM_ALGO=i: prefill GEMMs on candidate i (default
                                -1: the fixed rule, pf_rule) */
    int qkv_bf16_min_t;      /* q|k|v GEMMs of T >= this write bf16 for k_qkv_finish
                                (DISAGG_CUDA_QKV_BF16=T, default 64; 0: always f32) */
    int resid_min_t;         /* backend_matmul_residual folds the add into the GEMM (cuBLASLt
                                beta = 1) for T >= this (DISAGG_CUDA_RESID_GEMM=T, default 64;
                                0: never, the model keeps the add in the norm) */
};

#define CK(call)                                                                             \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "cuda: %s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_), \
                    __FILE__, __LINE__);                                                     \
            return -EIO;                                                                     \
        }                                                                                    \
    } while (0)

static inline int launch_check(const char *what) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "cuda: kernel %s failed to launch: %s\n", what, cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}

/* Programmatic dependent launch (Hopper): a kernel launched with launch_pdl() may start while
 * the previous kernel of the stream still runs; it must call pdl_wait() before it reads or
 * writes anything that kernel touches (only constant inputs, the weights, before).
 * pdl_trigger() lets the next such kernel start once every CTA of this one has called it (or
 * exited).  The decode kernels call it late — after their weight/KV loads — not at entry
 * (the entry form measured 0.1-0.3 ms a step slower than no PDL with graphs on 1 December;
 * likely because single-wave kernels such as the attention and its combine then launched
 * their dependents at once, and several kernels' CTAs sat resident, waiting).
 * Both are no-ops for a kernel launched the ordinary way.  Recorded into CUDA graphs as
 * programmatic edges. */
__device__ __forceinline__ void pdl_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void pdl_trigger() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
template <typename... KArgs, typename... Args>
static int launch_pdl(dcu_ctx *c, const char *what, void (*k)(KArgs...), dim3 grid, dim3 block,
                      size_t smem, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1] = {};
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c->stream;
    cfg.attrs = at;
    cfg.numAttrs = c->pdl ? 1 : 0;
    cudaError_t e = cudaLaunchKernelEx(&cfg, k, ((KArgs)args)...);
    if (e != cudaSuccess) {
        fprintf(stderr, "cuda: kernel %s failed to launch: %s\n", what, cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}
/* ---- device helpers of several op families ------------------------------------------ */

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* FP8 e4m3 weights in the GEMVs: 4 e4m3 (one u32, element 0 in the low byte) -> 4 f32,
 * exactly (the hardware e4m3x2 -> f16x2 conversion); f8_dot16: sum_j w[j] x[j] over 16
 * elements, w f32, x two uint4 of 8 bf16 each, in element order */
__device__ __forceinline__ void f8_cvt4(uint32_t v, float *f) {
    __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
    __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v >> 16), __NV_E4M3);
    float2 a = __half22float2(*reinterpret_cast<__half2 *>(&lo));
    float2 b = __half22float2(*reinterpret_cast<__half2 *>(&hi));
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
}
__device__ __forceinline__ float f8_dot16(const float *w, uint4 xa, uint4 xb) {
    uint32_t xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    float d = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        d = fmaf(w[2 * j], __uint_as_float(xs[j] << 16), d);
        d = fmaf(w[2 * j + 1], __uint_as_float(xs[j] & 0xffff0000u), d);
    }
    return d;
}

/* sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets it */
static __device__ float block_sum(float v) {
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float r = lane < nw ? sh[lane] : 0.0f;
    r = warp_sum(r);
    return r;
}

template <typename T> __device__ __forceinline__ void store_as(T *p, float v);
template <> __device__ __forceinline__ void store_as<float>(float *p, float v) {
    *p = v;
}
template <> __device__ __forceinline__ void store_as<bf16>(bf16 *p, float v) {
    *p = __float2bfloat16(v);
}
__device__ __forceinline__ float load_f(const float *p) {
    return *p;
}
__device__ __forceinline__ float load_f(const bf16 *p) {
    return __bfloat162float(*p);
}

/* ---- the FP8 KV cache's element (e4m3, per-tensor scales) -----------------------------
 * f8e4m3: one byte of OCP e4m3.  Written as e4m3(x / scale), round to nearest even,
 * saturated to +-448 (cvt.rn.satfinite, as vLLM's cache write; kernels/fp8.h on the host);
 * read as e4m3 * scale.  store_kv / load_kv take the scale for every KV type and ignore it
 * for f32 and bf16 (whose bits therefore do not change).  kv_kind: the launchers' KV type
 * switch, 0 f32, 1 bf16, 2 e4m3 (dcu_kv_kind from a DCU dtype). */
struct f8e4m3 {
    uint8_t b;
};
static inline int dcu_kv_kind(int dtype) {
    return dtype == DCU_BF16 ? 1 : dtype == DCU_F8E4M3 ? 2 : 0;
}
__device__ __forceinline__ uint8_t f32_to_e4m3(float x) {
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ float e4m3_to_f32(uint8_t b) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    return __half2float(__half(h));
}
/* two e4m3 (lo byte first) -> bf16x2 (exact: every e4m3 value is a bf16) */
__device__ __forceinline__ uint32_t e4m3x2_to_bf2(uint16_t two) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)two, __NV_E4M3);
    float2 f = __half22float2(__half2(h));
    __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *(uint32_t *)&b;
}
/* 8 e4m3 (a uint2) -> 8 bf16 (a uint4), in order */
__device__ __forceinline__ uint4 e4m3x8_to_bf8(uint2 v) {
    return make_uint4(e4m3x2_to_bf2((uint16_t)(v.x & 0xffffu)), e4m3x2_to_bf2((uint16_t)(v.x >> 16)),
                      e4m3x2_to_bf2((uint16_t)(v.y & 0xffffu)), e4m3x2_to_bf2((uint16_t)(v.y >> 16)));
}
template <typename KT> __device__ __forceinline__ void store_kv(KT *p, float v, float sc) {
    store_as(p, v);
}
template <> __device__ __forceinline__ void store_kv<f8e4m3>(f8e4m3 *p, float v, float sc) {
    p->b = f32_to_e4m3(v / sc);
}
__device__ __forceinline__ float load_kv(const float *p, float sc) {
    return *p;
}
__device__ __forceinline__ float load_kv(const bf16 *p, float sc) {
    return __bfloat162float(*p);
}
__device__ __forceinline__ float load_kv(const f8e4m3 *p, float sc) {
    return e4m3_to_f32(p->b) * sc;
}

static inline int grid_for(size_t n, int threads) {
    size_t g = (n + threads - 1) / threads;
    return (int)(g > 65535 * 4 ? 65535 * 4 : (g ? g : 1));
}

/* ---- cuda_context.cu ---------------------------------------------------------------- */
int probe(int device, dcu_info *info, char *err, size_t errlen);
dcu_ctx *ctx_create(int device, char *err, size_t errlen);
void ctx_free(dcu_ctx *c);
int dupload(dcu_ctx *c, void *dst, const void *src, size_t n);
int ddownload(dcu_ctx *c, void *dst, const void *src, size_t n);

/* ---- cuda_norm.cu ------------------------------------------------------------------- */
int to_bf16(dcu_ctx *c, void *dst, const float *src, size_t n);
/* the weight upload's conversions: launched on c->stream, not checked (the stream sync is) */
void to_bf16_async(dcu_ctx *c, bf16 *dst, const float *src, size_t n);
void f16_to_bf16_async(dcu_ctx *c, bf16 *dst, const __half *src, size_t n);
int rmsnorm(dcu_ctx *c, void *out, int out_dtype, float *x, const float *add, const float *w,
            const int32_t *rows, int n_rows, int n, float eps, int write_back);
int rope(dcu_ctx *c, float *x, int stride, const int32_t *pos, const float *inv_freq, int T,
         int n_heads, int hd);
int swiglu16(dcu_ctx *c, void *out, int out_dtype, const bf16 *gu, int T, int I);
int swiglu(dcu_ctx *c, void *out, int out_dtype, const float *gu, int T, int I);
int add(dcu_ctx *c, float *x, const float *y, size_t n);
int add_bias(dcu_ctx *c, float *y, const float *b, int N, size_t n);
int kv_write(dcu_ctx *c, const dcu_kv *kv, int layer, const float *k, const float *v, int stride,
             const int32_t *pos, const int32_t *seq, const int32_t *bts, int bt_stride, int T);
/* q|k|v (T, (nh + 2 nkv) hd) of qkv_dtype (DCU_F32 or DCU_BF16) -> bias + RoPE -> q out (f32)
 * and K/V into the cache (kv_kind: 0 f32, 1 bf16, 2 e4m3 / scale); bf16 input with qkv_finish_vec2(hd)
 * runs two elements a thread (k_qkv_finish_vec2, launched the ordinary way), the other
 * forms one RoPE pair a thread with PDL */
static inline int qkv_finish_vec2(int hd) {
    return hd % 4 == 0 && 128 % (hd / 4) == 0;
}
int qkv_finish(dcu_ctx *c, float *q, void *kv, int kv_kind, int bs, int n_layers, int layer,
               const void *qkv, int qkv_dtype, const float *bias, const int32_t *pos,
               const int32_t *seq, const int32_t *bts, int bt_stride, const float *inv_freq,
               int T, int nh, int nkv, int hd, float k_scale, float v_scale);

/* ---- cuda_gemv_fp8.cu --------------------------------------------------------------- */
/* the FP8 decode GEMV (weight-only: x bf16, w e4m3 with backend_wscale's scales s, bn x bk a
 * scale) for T = 1..8, and the load-time dequantization to the bf16 twin of the GEMMs */
/* gemv_fp8_ok: the 16-byte-load kernel takes the shape; gemv_fp8 takes every shape (a scalar
 * kernel for the others) */
int gemv_fp8_ok(int T, int K, int bk, const void *x, const void *w);
int gemv_fp8(dcu_ctx *c, float *y, const void *x, const void *w, const float *s, int bn, int bk,
             const float *bias, int T, int N, int K);
int fp8_dequant_bf16(dcu_ctx *c, bf16 *out, const uint8_t *q, const float *s, int bn, int bk,
                     int N, int K);

/* ---- cuda_gemv_f8mma.cu ------------------------------------------------------------- */
/* the FP8 decode GEMV on the tensor cores (weight-only: x bf16, w e4m3, f32 accumulate) for
 * T = 1..16: y (T, N) f32 = x w^T (+ bias), and the gate|up form h (T, I) of h_dtype =
 * silu(x wg^T) * (x wu^T), w = [wg; wu] (2I, K).  gemv_f8mma_ok: K a multiple of 16, the
 * scale blocks whole rows (bk >= K) or multiples of 64 columns, x and w 16-byte aligned. */
int gemv_f8mma_ok(int T, int K, int bk, const void *x, const void *w);
typedef struct dcu_f8scale dcu_f8scale;
int gemv_f8mma(dcu_ctx *c, float *y, const void *x, const void *w, const dcu_f8scale *f8,
               const float *bias, int T, int N, int K);
int gemv_f8mma_gate_up(dcu_ctx *c, void *h, int h_dtype, const void *x, const void *w,
                       const dcu_f8scale *f8, int T, int I, int K);
/* the q|k|v form (bias, RoPE, q out and the KV write as gemv_qkv; hd a multiple of 16) */
int gemv_f8mma_qkv(dcu_ctx *c, float *qout, void *kv, int kv_kind, const void *x, const void *w,
                   const dcu_f8scale *f8, const float *bias, int T, int K, int bs, int n_layers,
                   int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts,
                   int bt_stride, const float *inv_freq, int nh, int nkv, int hd, float ksc,
                   float vsc);

/* ---- cuda_gemm_fp8.cu --------------------------------------------------------------- */
/* W8A8 block FP8 for prefill: x bf16 quantized to e4m3 in 128-column groups a token (sx: T x
 * K / 128, amax / 448 a group, tokens contiguous), then cuBLASLt's
 * block-scaled e4m3 GEMM (sw: the weights' 128 x 128 block scales, row block major); y of kind
 * 0 f32, 1 f32 += (beta 1), 2 bf16.  -ENOTSUP: no cuBLASLt algorithm for the shape
 * (remembered) */
int fp8_act_quant_g128(dcu_ctx *c, uint8_t *q, float *sx, const void *x, int T, int K);
int fp8_gemm_ok(int T, int N, int K);
int fp8_gemm(dcu_ctx *c, void *y, int kind, const uint8_t *xq, const float *sx, const void *w,
             const float *sw, int T, int N, int K);

/* ---- cuda_gemm.cu ------------------------------------------------------------------- */
int matmul(dcu_ctx *c, float *y, const void *x, const void *w, const float *bias, int T, int N,
           int K);
int matmul_acc(dcu_ctx *c, float *resid, float *tmp, const void *x, const void *w, int T, int N,
               int K);
int matmul_bf16out(dcu_ctx *c, bf16 *y, const void *x, const void *w, int T, int N, int K);
int measure(dcu_ctx *c, double *copy_gbs, double *gemm_tflops, int M, int N, int K);
/* the cuBLASLt glue of both GEMM paths (here and cuda_invariant.cu): an op descriptor for
 * C (N, M) = W^T-as-stored (op T of a K x N bf16 matrix) x X (K x M), f32 compute and scale;
 * lt_cfg: one attribute of an algorithm's configuration (-1 when cuBLASLt has none) */
cublasStatus_t lt_desc_nt(cublasLtMatmulDesc_t *op);
int lt_cfg(const cublasLtMatmulAlgo_t *a, cublasLtMatmulAlgoConfigAttributes_t at);

/* ---- cuda_gemv.cu ------------------------------------------------------------------- */
struct dcu_f8scale {
    const float *s; /* (ceil(N / bn), ceil(K / bk)) f32, row-major */
    int bn, bk;
};
int gemv_ok(const dcu_ctx *c, int T, int K, const void *x, const void *w);
int gemv(dcu_ctx *c, float *y, const void *x, const void *w, const float *bias, int T, int N,
         int K);
int gemv_f8(dcu_ctx *c, float *y, const void *x, const void *w, const dcu_f8scale *f8,
            const float *bias, int T, int N, int K);
int gemv_f8_ok(int T, int K, int bk, const void *x, const void *w);
/* h (T, I) of h_dtype = silu(x wg^T) * (x wu^T), w = [wg; wu] (2I, K); f8: FP8 weights or NULL */
int gemv_gate_up(dcu_ctx *c, void *h, int h_dtype, const void *x, const void *w,
                 const dcu_f8scale *f8, int T, int I, int K);
/* the fused q|k|v GEMV: bias, RoPE and the KV write (kv_kind: 0 f32, 1 bf16, 2 e4m3 with
 * the layer's scales) in its epilogue */
/* FP8 e4m3 weights in the GEMVs above: w (N, K) e4m3 and one f32 scale s per bn x bk block
 * (backend_wscale); NULL where the weights are bf16.  gemv_f8_ok: the GEMV family takes FP8
 * weights of this shape (T <= 2, K % 16 == 0, bk a multiple of 16 or >= K, 16-byte aligned);
 * T = 3..8 and the other shapes run gemv_fp8 (cuda_gemv_fp8.cu). */
int gemv_qkv(dcu_ctx *c, float *qout, void *kv, int kv_kind, const void *x, const void *w,
             const dcu_f8scale *f8,
             const float *bias, int T, int K, int bs, int n_layers, int layer,
             const int32_t *pos, const int32_t *seq, const int32_t *bts, int bt_stride,
             const float *inv_freq, int nh, int nkv, int hd, float k_scale, float v_scale);

/* ---- cuda_attention_decode.cu ------------------------------------------------------- */
int attention_scaled(dcu_ctx *c, void *out, int out_dtype, const float *q, const dcu_kv *kv,
                     int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts,
                     int bt_stride, int T, int nh, int nkv, int hd, int max_ctx, float scale);

/* ---- cuda_attention_prefill.cu ------------------------------------------------------ */
int flash_ok(const dcu_ctx *c, int kv_dtype, int hd);
int prefill_mma8_for(const dcu_ctx *c, int n_tiles, int nh);
int split_batch(int T, const int32_t *seq, const int32_t *pos, int flash, int bq,
                int32_t *tiles, int *n_tiles, int32_t *rest, int *n_rest);
int attention_mixed(dcu_ctx *c, void *out, int out_dtype, const float *q, const dcu_kv *kv,
                    int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts,
                    int bt_stride, int T, int nh, int nkv, int hd, float scale,
                    const int32_t *tiles_d, int n_tiles, const int32_t *tiles3_d, int n_tiles3,
                    const int32_t *rest_d, int n_rest, int rest_ctx);

/* ---- cuda_sampling.cu --------------------------------------------------------------- */
int argmax(dcu_ctx *c, int32_t *out, const float *logits, int rows, int vocab);
/* backend_token_bitmask: -inf on the tokens of logits rows rows[k] that bitmask row k does not
 * allow (and on every token >= vocab) */
int token_bitmask(dcu_ctx *c, float *logits, int width, const int32_t *bitmask, const int32_t *rows,
                  int n, int vocab);

#endif
