/*
 * cuda_kernels — the CUDA module (see cuda_module.h): device context, buffers, the
 * forward's kernels (embedding gather, RMSNorm with fused residual add, RoPE, SwiGLU,
 * KV write into paged blocks, paged GQA attention split over KV blocks, argmax), GEMMs
 * through cuBLASLt (bf16 in, f32 accumulate and out); kernels/backend.h on top of them
 * (cuda_backend.cuh, the module's one entry point).  Built for sm_90 plus compute_90 PTX; linked against the static CUDA runtime and
 * libcublasLt, so the module needs libcuda (the driver) and libcublasLt at load time.
 */
#include "kernels/cuda/cuda_module.h"
#include "kernels/cuda/cuda_mma.cuh" /* pack_bf2, mma_bf16, ldsm_x4(_t), cp_async16, kv_off */

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

static void seterr(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ---- context ---------------------------------------------------------------- */

#define PLAN_CACHE 256
#define FA_BQ 64   /* prefill query rows per CTA: 4 warps x 16 */
#define FA_BQ3 128 /* k_flash3's default: 8 warps x 16 */
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
    int gemv_db;    /* the GEMV's loads double-buffered (DISAGG_CUDA_GEMV_DB=1; off by default:
                       twice the registers, half the warps, measured slower) */
    int qkv_fuse;   /* the q|k|v GEMV with bias, RoPE and the KV write in its epilogue
                       (DISAGG_CUDA_QKV_FUSE=0: the GEMV, then k_qkv_finish) */
    int gemv_warps; /* rows (warps) per CTA of the GEMV (DISAGG_CUDA_GEMV_WARPS=2|4|8, default 4) */
    int gemv_split; /* split-K of the GEMVs with fewer rows than the GPU has warp slots (o, down,
                       q|k|v): 0 = auto (default; gemv_split_for), 1 = off, 2|4|8 = that factor
                       (DISAGG_CUDA_GEMV_SPLIT=auto|1|2|4|8) */
    int qkv_split;  /* the same for the fused q|k|v GEMV (DISAGG_CUDA_QKV_SPLIT=auto|1|2|4|8) */
    int gemv_split_rows; /* rows a warp of the split-K GEMV (DISAGG_CUDA_GEMV_SPLIT_ROWS=1|2,
                            default 2) */
    const int32_t *att_list; /* token list of the next split-attention launch (NULL: all) */
    int no_flash;            /* DISAGG_CUDA_NO_FLASH=1: prefill through the split kernel too */
    unsigned gen;            /* bumped whenever a scratch buffer moves (recorded graphs go stale) */
    int tune;                /* DISAGG_CUDA_GEMM_TUNE=1: time cuBLASLt's candidates (T <= 256) */
    int flash2;              /* the mma.sync prefill kernel k_flash2 (DISAGG_CUDA_FLASH2=0: wmma) */
    int att_mma;             /* decode attention on tensor cores (DISAGG_CUDA_ATT_MMA=0: off) */
    int flash_pipe;          /* k_flash2 with cp.async double buffering (DISAGG_CUDA_FLASH_PIPE=0) */
    int flash3;              /* prefill on k_flash3 (DISAGG_CUDA_FLASH3=0: k_flash2) */
    int flash_bq;            /* k_flash3's query rows a CTA: 128 (default) or 64
                                (DISAGG_CUDA_FLASH_BQ=64) */
    int flash_mt;            /* 128-row tiles: 2 = k_flash4 (32 rows a warp), 1 = k_flash3
                                (16; DISAGG_CUDA_FLASH_MT=1|2) */
    int gu_bf16_min_t;       /* gate|up GEMMs of T >= this write bf16 (DISAGG_CUDA_GU_BF16=T;
                                0: always f32) */
    int skinny_max;          /* GEMMs of T <= this on k_skinny (DISAGG_CUDA_SKINNY=T; default 0:
                                off, measured slower than cuBLASLt on the H200) */
    int norm4;               /* (add +) RMSNorm on k_rmsnorm4 (DISAGG_CUDA_NORM4=0: k_rmsnorm) */
    int flash_auto;          /* k_flash3 (8 warps) instead of k_flash4 when the 128-row tiles
                                leave SMs idle (DISAGG_CUDA_FLASH_AUTO=0: always k_flash4) */
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

static int launch_check(const char *what) {
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

static int probe(int device, dcu_info *info, char *err, size_t errlen) {
    dcu_info tmp;
    if (!info) info = &tmp;
    memset(info, 0, sizeof *info);
    info->device = device;
    info->runtime_version = CUDART_VERSION;
    int drv = 0;
    cudaError_t e = cudaDriverGetVersion(&drv);
    info->driver_version = drv;
    if (e != cudaSuccess || drv == 0) {
        seterr(err, errlen,
               "no NVIDIA driver found (libcuda.so.1 is not installed or cannot load%s%s); "
               "install the NVIDIA driver for CUDA %d.%d or newer, or use --device cpu",
               e != cudaSuccess ? ": " : "", e != cudaSuccess ? cudaGetErrorString(e) : "",
               CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
        return -ENODEV;
    }
    if (drv / 1000 < CUDART_VERSION / 1000) {
        seterr(err, errlen,
               "the NVIDIA driver supports CUDA %d.%d but this build needs CUDA %d.%d "
               "(CUDART_VERSION %d); install an NVIDIA driver for CUDA %d (e.g. the %s "
               "series) or rebuild disagg with CUDA %d's nvcc",
               drv / 1000, drv % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10,
               CUDART_VERSION, CUDART_VERSION / 1000, CUDART_VERSION >= 13000 ? "580" : "525",
               drv / 1000);
        return -ENODEV;
    }
    int n = 0;
    e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
        seterr(err, errlen, "no CUDA GPU is visible (%s%s%s); use --device cpu",
               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices",
               cvd ? ", CUDA_VISIBLE_DEVICES=" : "", cvd ? cvd : "");
        return -ENODEV;
    }
    info->n_devices = n;
    if (device < 0 || device >= n) {
        seterr(err, errlen, "CUDA device %d does not exist; %d visible (0..%d)", device, n,
               n - 1);
        return -ENODEV;
    }
    cudaDeviceProp p;
    if ((e = cudaGetDeviceProperties(&p, device)) != cudaSuccess) {
        seterr(err, errlen, "cudaGetDeviceProperties(%d): %s", device, cudaGetErrorString(e));
        return -ENODEV;
    }
    snprintf(info->name, sizeof info->name, "%s", p.name);
    info->cc_major = p.major;
    info->cc_minor = p.minor;
    info->n_sm = p.multiProcessorCount;
    info->total_mem = p.totalGlobalMem;
    if (p.major < 9) {
        seterr(err, errlen,
               "%s has compute capability %d.%d; this build runs on 9.0 (Hopper) and newer",
               p.name, p.major, p.minor);
        return -ENODEV;
    }
    int cur = -1;
    cudaGetDevice(&cur);
    if (cudaSetDevice(device) == cudaSuccess) {
        size_t fr = 0, tot = 0;
        if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) info->free_mem = fr;
    }
    return 0;
}

/* DISAGG_CUDA_GEMV_SPLIT / _QKV_SPLIT: unset or "auto" 0 (auto), "0" or "1" 1 (off), 2|4|8;
 * anything else auto */
static int split_env(const char *name) {
    const char *e = getenv(name);
    if (!e || !strcmp(e, "auto")) return 0;
    int v = atoi(e);
    return v == 0 && !strcmp(e, "0") ? 1 : v == 1 || v == 2 || v == 4 || v == 8 ? v : 0;
}

static dcu_ctx *ctx_create(int device, char *err, size_t errlen) {
    dcu_info info;
    if (probe(device, &info, err, errlen)) return NULL;
    dcu_ctx *c = (dcu_ctx *)calloc(1, sizeof *c);
    if (!c) return NULL;
    c->device = device;
    c->n_sm = info.n_sm;
    c->gemv_max_t = getenv("DISAGG_CUDA_GEMV") ? atoi(getenv("DISAGG_CUDA_GEMV")) : 1;
    if (c->gemv_max_t < 0 || c->gemv_max_t > GEMV_MAX_T) c->gemv_max_t = GEMV_MAX_T;
    c->pdl = !(getenv("DISAGG_CUDA_PDL") && !strcmp(getenv("DISAGG_CUDA_PDL"), "0"));
    c->norm_pdl =
        !(getenv("DISAGG_CUDA_NORM_PDL") && !strcmp(getenv("DISAGG_CUDA_NORM_PDL"), "0"));
    c->gemv_db = getenv("DISAGG_CUDA_GEMV_DB") && atoi(getenv("DISAGG_CUDA_GEMV_DB")) > 0;
    c->qkv_fuse =
        !(getenv("DISAGG_CUDA_QKV_FUSE") && !strcmp(getenv("DISAGG_CUDA_QKV_FUSE"), "0"));
    c->gemv_warps = getenv("DISAGG_CUDA_GEMV_WARPS") ? atoi(getenv("DISAGG_CUDA_GEMV_WARPS")) : 4;
    if (c->gemv_warps != 2 && c->gemv_warps != 4 && c->gemv_warps != 8) c->gemv_warps = 4;
    c->gemv_split = split_env("DISAGG_CUDA_GEMV_SPLIT");
    c->qkv_split = split_env("DISAGG_CUDA_QKV_SPLIT");
    c->gemv_split_rows = getenv("DISAGG_CUDA_GEMV_SPLIT_ROWS") &&
                                 atoi(getenv("DISAGG_CUDA_GEMV_SPLIT_ROWS")) == 1
                             ? 1
                             : 2;
    c->no_flash = getenv("DISAGG_CUDA_NO_FLASH") && atoi(getenv("DISAGG_CUDA_NO_FLASH")) > 0;
    c->flash2 = !(getenv("DISAGG_CUDA_FLASH2") && !strcmp(getenv("DISAGG_CUDA_FLASH2"), "0"));
    c->att_mma = !(getenv("DISAGG_CUDA_ATT_MMA") && !strcmp(getenv("DISAGG_CUDA_ATT_MMA"), "0"));
    c->flash_pipe =
        !(getenv("DISAGG_CUDA_FLASH_PIPE") && !strcmp(getenv("DISAGG_CUDA_FLASH_PIPE"), "0"));
    c->flash3 = !(getenv("DISAGG_CUDA_FLASH3") && !strcmp(getenv("DISAGG_CUDA_FLASH3"), "0"));
    c->flash_bq = getenv("DISAGG_CUDA_FLASH_BQ") && atoi(getenv("DISAGG_CUDA_FLASH_BQ")) == FA_BQ
                      ? FA_BQ
                      : FA_BQ3;
    c->flash_mt = getenv("DISAGG_CUDA_FLASH_MT") && atoi(getenv("DISAGG_CUDA_FLASH_MT")) == 1 ? 1 : 2;
    c->gu_bf16_min_t = getenv("DISAGG_CUDA_GU_BF16") ? atoi(getenv("DISAGG_CUDA_GU_BF16")) : 64;
    c->skinny_max = getenv("DISAGG_CUDA_SKINNY") ? atoi(getenv("DISAGG_CUDA_SKINNY")) : 0;
    if (c->skinny_max > 32) c->skinny_max = 32;
    c->tune = getenv("DISAGG_CUDA_GEMM_TUNE") && atoi(getenv("DISAGG_CUDA_GEMM_TUNE")) > 0;
    c->norm4 = !(getenv("DISAGG_CUDA_NORM4") && !strcmp(getenv("DISAGG_CUDA_NORM4"), "0"));
    c->flash_auto =
        !(getenv("DISAGG_CUDA_FLASH_AUTO") && !strcmp(getenv("DISAGG_CUDA_FLASH_AUTO"), "0"));
    c->gemm_sweep = getenv("DISAGG_CUDA_GEMM_SWEEP") ? atoi(getenv("DISAGG_CUDA_GEMM_SWEEP")) : 0;
    c->gemm_algo = getenv("DISAGG_CUDA_GEMM_ALGO") ? atoi(getenv("DISAGG_CUDA_GEMM_ALGO")) : -1;
    c->qkv_bf16_min_t = getenv("DISAGG_CUDA_QKV_BF16") ? atoi(getenv("DISAGG_CUDA_QKV_BF16")) : 64;
    c->resid_min_t = getenv("DISAGG_CUDA_RESID_GEMM") ? atoi(getenv("DISAGG_CUDA_RESID_GEMM")) : 64;
    cudaError_t e;
    if ((e = cudaSetDevice(device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        seterr(err, errlen, "CUDA device %d: %s", device, cudaGetErrorString(e));
        free(c);
        return NULL;
    }
    cublasStatus_t s = cublasLtCreate(&c->lt);
    if (s != CUBLAS_STATUS_SUCCESS) {
        seterr(err, errlen, "cublasLtCreate failed (status %d)", (int)s);
        cudaStreamDestroy(c->stream);
        free(c);
        return NULL;
    }
    c->ws_bytes = 64u << 20;
    if (cudaMalloc(&c->ws, c->ws_bytes) != cudaSuccess ||
        cudaMalloc((void **)&c->amax_tmp, (size_t)AMX_ROWS * AMX_PARTS * 2 * sizeof(int32_t)) !=
            cudaSuccess) {
        seterr(err, errlen, "out of GPU memory for the cuBLASLt workspace (64 MiB)");
        cublasLtDestroy(c->lt);
        cudaStreamDestroy(c->stream);
        free(c);
        return NULL;
    }
    return c;
}

static void ctx_free(dcu_ctx *c) {
    if (!c) return;
    cudaStreamSynchronize(c->stream);
    for (int i = 0; i < PLAN_CACHE; i++)
        if (c->plans[i].valid) {
            cublasLtMatmulDescDestroy(c->plans[i].op);
            cublasLtMatrixLayoutDestroy(c->plans[i].a);
            cublasLtMatrixLayoutDestroy(c->plans[i].b);
            cublasLtMatrixLayoutDestroy(c->plans[i].c);
        }
    for (int i = 0; i < PLAN16_CACHE; i++)
        if (c->plans16[i].valid) {
            cublasLtMatmulDescDestroy(c->plans16[i].op);
            cublasLtMatrixLayoutDestroy(c->plans16[i].a);
            cublasLtMatrixLayoutDestroy(c->plans16[i].b);
            cublasLtMatrixLayoutDestroy(c->plans16[i].c);
        }
    cudaFree(c->ws);
    cudaFree(c->att_part);
    cudaFree(c->att_ml);
    cudaFree(c->amax_tmp);
    cublasLtDestroy(c->lt);
    cudaStreamDestroy(c->stream);
    free(c);
}

static int dupload(dcu_ctx *c, void *dst, const void *src, size_t n) {
    CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, c->stream));
    CK(cudaStreamSynchronize(c->stream));
    return 0;
}
static int ddownload(dcu_ctx *c, void *dst, const void *src, size_t n) {
    CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, c->stream));
    CK(cudaStreamSynchronize(c->stream));
    return 0;
}
/* ---- small kernels ------------------------------------------------------------ */

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets it */
__device__ float block_sum(float v) {
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

__global__ void k_to_bf16(bf16 *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16(src[i]);
}

__global__ void k_f16_to_bf16(bf16 *dst, const __half *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16(__half2float(src[i]));
}

static int grid_for(size_t n, int threads) {
    size_t g = (n + threads - 1) / threads;
    return (int)(g > 65535 * 4 ? 65535 * 4 : (g ? g : 1));
}

static int to_bf16(dcu_ctx *c, void *dst, const float *src, size_t n) {
    k_to_bf16<<<grid_for(n, 256), 256, 0, c->stream>>>((bf16 *)dst, src, n);
    return launch_check("to_bf16");
}

template <typename OT>
__global__ void k_rmsnorm(OT *out, float *x, const float *add, const float *w, const int32_t *rows,
                          int n, float eps, int write_back) {
    pdl_trigger();
    pdl_wait();
    int r = blockIdx.x;
    int src = rows ? rows[r] : r;
    float *xr = x + (size_t)src * n;
    const float *ar = add ? add + (size_t)src * n : NULL;
    extern __shared__ float vbuf[];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i];
        if (ar) v += ar[i];
        vbuf[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = vbuf[i];
        if (write_back) xr[i] = v;
        store_as(out + (size_t)r * n + i, w[i] * (v * inv));
    }
}

/* k_rmsnorm with 16-byte accesses, the row in registers (no shared-memory copy): thread i
 * holds float4s i, i + blockDim, ... (at most RN_VPT; blockDim = n / 4 / RN_VPT rounded up to
 * a warp); the residual written back and the added rows streamed (__stcs / __ldcs: neither is
 * read again before the next norm, while the bf16 out feeds the next GEMM from L2).  Needs
 * n % 4 == 0, n <= 4 * RN_VPT * 1024 and 16-byte aligned x, add, w (8-byte for a bf16 out). */
#define RN_VPT 8
template <typename OT>
__global__ void __launch_bounds__(1024)
    k_rmsnorm4(OT *out, float *x, const float *add, const float *w, const int32_t *rows, int n,
               float eps, int write_back) {
    pdl_trigger(); /* a one-wave kernel at decode: the next GEMV's CTAs may start streaming
                      their weights while it runs (launched with launch_pdl, c->norm_pdl) */
    pdl_wait();
    int r = blockIdx.x, n4 = n >> 2;
    int src = rows ? rows[r] : r;
    float4 *xr = (float4 *)(x + (size_t)src * n);
    const float4 *ar = add ? (const float4 *)(add + (size_t)src * n) : NULL;
    float4 v[RN_VPT];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RN_VPT; k++) {
        int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            float4 a = xr[i];
            if (ar) {
                float4 b = __ldcs(ar + i);
                a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
            }
            v[k] = a;
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
        }
    }
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    const float4 *w4 = (const float4 *)w;
#pragma unroll
    for (int k = 0; k < RN_VPT; k++) {
        int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            float4 a = v[k], g = __ldg(w4 + i);
            if (write_back) __stcs(xr + i, a);
            float o0 = g.x * (a.x * inv), o1 = g.y * (a.y * inv), o2 = g.z * (a.z * inv),
                  o3 = g.w * (a.w * inv);
            if constexpr (sizeof(OT) == 2) {
                __nv_bfloat162 h[2] = {__floats2bfloat162_rn(o0, o1), __floats2bfloat162_rn(o2, o3)};
                *(uint2 *)(out + (size_t)r * n + 4 * (size_t)i) = *(const uint2 *)h;
            } else {
                *(float4 *)(out + (size_t)r * n + 4 * (size_t)i) = make_float4(o0, o1, o2, o3);
            }
        }
    }
}

static int rmsnorm(dcu_ctx *c, void *out, int out_dtype, float *x, const float *add,
                   const float *w, const int32_t *rows, int n_rows, int n, float eps,
                   int write_back) {
    if (n_rows <= 0) return 0;
    if (c->norm4 && n % 4 == 0 && n <= 4 * RN_VPT * 1024 &&
        !(((uintptr_t)x | (uintptr_t)add | (uintptr_t)w) & 15) &&
        !((uintptr_t)out & (out_dtype == DCU_BF16 ? 7 : 15))) {
        int th = (n / 4 + RN_VPT - 1) / RN_VPT;
        th = (th + 31) / 32 * 32;
        if (c->norm_pdl)
            return out_dtype == DCU_BF16
                       ? launch_pdl(c, "rmsnorm (16-byte)", k_rmsnorm4<bf16>, dim3(n_rows),
                                    dim3(th), 0, (bf16 *)out, x, add, w, rows, n, eps, write_back)
                       : launch_pdl(c, "rmsnorm (16-byte)", k_rmsnorm4<float>, dim3(n_rows),
                                    dim3(th), 0, (float *)out, x, add, w, rows, n, eps,
                                    write_back);
        if (out_dtype == DCU_BF16)
            k_rmsnorm4<bf16><<<n_rows, th, 0, c->stream>>>((bf16 *)out, x, add, w, rows, n, eps,
                                                           write_back);
        else
            k_rmsnorm4<float><<<n_rows, th, 0, c->stream>>>((float *)out, x, add, w, rows, n,
                                                            eps, write_back);
        return launch_check("rmsnorm (16-byte)");
    }
    int th = n >= 1024 ? 1024 : (n >= 256 ? 256 : 128);
    size_t sh = (size_t)n * sizeof(float);
    if (sh > 48 * 1024) return -EINVAL;
    if (out_dtype == DCU_BF16)
        return launch_pdl(c, "rmsnorm", k_rmsnorm<bf16>, dim3(n_rows), dim3(th), sh, (bf16 *)out,
                          x, add, w, rows, n, eps, write_back);
    return launch_pdl(c, "rmsnorm", k_rmsnorm<float>, dim3(n_rows), dim3(th), sh, (float *)out, x,
                      add, w, rows, n, eps, write_back);
}

__global__ void k_rope(float *x, int stride, const int32_t *pos, const float *inv_freq,
                       int n_heads, int hd) {
    int t = blockIdx.x, half = hd / 2;
    float p = (float)pos[t];
    for (int i = threadIdx.x; i < n_heads * half; i += blockDim.x) {
        int hh = i / half, j = i % half;
        float a = p * inv_freq[j];
        float cs = cosf(a), sn = sinf(a);
        float *v = x + (size_t)t * stride + (size_t)hh * hd;
        float u = v[j], w = v[j + half];
        v[j] = u * cs - w * sn;
        v[j + half] = w * cs + u * sn;
    }
}

static int rope(dcu_ctx *c, float *x, int stride, const int32_t *pos, const float *inv_freq,
                int T, int n_heads, int hd) {
    if (T <= 0) return 0;
    k_rope<<<T, 128, 0, c->stream>>>(x, stride, pos, inv_freq, n_heads, hd);
    return launch_check("rope");
}

template <typename OT>
__global__ void k_swiglu(OT *out, const float *gu, int I) {
    int t = blockIdx.y;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < I; i += gridDim.x * blockDim.x) {
        float g = gu[(size_t)t * 2 * I + i], u = gu[(size_t)t * 2 * I + I + i];
        store_as(out + (size_t)t * I + i, g / (1.0f + expf(-g)) * u);
    }
}

/* h = silu(g) * u from a bf16 gate|up row (the GEMM's bf16 output): 8 elements a thread,
 * 16-byte loads (I % 8 == 0), else one */
template <typename OT>
__global__ void k_swiglu16(OT *out, const bf16 *gu, int I) {
    int t = blockIdx.y;
    const bf16 *g = gu + (size_t)t * 2 * I, *u = g + I;
    OT *o = out + (size_t)t * I;
    if (I % 8 == 0) {
        for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * 8; i < I;
             i += gridDim.x * blockDim.x * 8) {
            uint4 gv = *(const uint4 *)(g + i), uv = *(const uint4 *)(u + i);
            const bf16 *gp = (const bf16 *)&gv, *up = (const bf16 *)&uv;
            float hv[8];
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float x = __bfloat162float(gp[e]);
                hv[e] = x / (1.0f + expf(-x)) * __bfloat162float(up[e]);
            }
            if constexpr (sizeof(OT) == 2) { /* one 16-byte store */
                __nv_bfloat162 w[4];
#pragma unroll
                for (int e = 0; e < 4; e++)
                    w[e] = __floats2bfloat162_rn(hv[2 * e], hv[2 * e + 1]);
                *(uint4 *)(o + i) = *(const uint4 *)w;
            } else {
                *(float4 *)(o + i) = make_float4(hv[0], hv[1], hv[2], hv[3]);
                *(float4 *)(o + i + 4) = make_float4(hv[4], hv[5], hv[6], hv[7]);
            }
        }
    } else {
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < I; i += gridDim.x * blockDim.x) {
            float x = __bfloat162float(g[i]);
            store_as(o + i, x / (1.0f + expf(-x)) * __bfloat162float(u[i]));
        }
    }
}

static int swiglu16(dcu_ctx *c, void *out, int out_dtype, const bf16 *gu, int T, int I) {
    if (T <= 0) return 0;
    int per = I % 8 == 0 ? 8 * 256 : 256;
    dim3 g((I + per - 1) / per, T);
    if (out_dtype == DCU_BF16)
        k_swiglu16<bf16><<<g, 256, 0, c->stream>>>((bf16 *)out, gu, I);
    else
        k_swiglu16<float><<<g, 256, 0, c->stream>>>((float *)out, gu, I);
    return launch_check("swiglu (bf16 gate|up)");
}

static int swiglu(dcu_ctx *c, void *out, int out_dtype, const float *gu, int T, int I) {
    if (T <= 0) return 0;
    dim3 g((I + 255) / 256 > 64 ? 64 : (I + 255) / 256, T);
    if (out_dtype == DCU_BF16)
        k_swiglu<bf16><<<g, 256, 0, c->stream>>>((bf16 *)out, gu, I);
    else
        k_swiglu<float><<<g, 256, 0, c->stream>>>((float *)out, gu, I);
    return launch_check("swiglu");
}

__global__ void k_add(float *x, const float *y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

static int add(dcu_ctx *c, float *x, const float *y, size_t n) {
    if (!n) return 0;
    k_add<<<grid_for(n, 256), 256, 0, c->stream>>>(x, y, n);
    return launch_check("add");
}

__global__ void k_bias(float *y, const float *b, int N, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] += b[i % N];
}

template <typename KT>
__global__ void k_kv_write(KT *kv, int bs, int n_layers, int kvd, int layer, const float *k,
                           const float *v, int stride, const int32_t *pos, const int32_t *seq,
                           const int32_t *bts, int bt_stride) {
    int t = blockIdx.x;
    if (pos[t] < 0) return; /* a padding row of a recorded decode step */
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    size_t ok = kv_off(bt, pos[t], bs, n_layers, kvd, layer, 0);
    size_t ov = kv_off(bt, pos[t], bs, n_layers, kvd, layer, 1);
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) {
        store_as(kv + ok + i, k[(size_t)t * stride + i]);
        store_as(kv + ov + i, v[(size_t)t * stride + i]);
    }
}

static int kv_write(dcu_ctx *c, const dcu_kv *kv, int layer, const float *k, const float *v,
                    int stride, const int32_t *pos, const int32_t *seq, const int32_t *bts,
                    int bt_stride, int T) {
    if (T <= 0) return 0;
    if (kv->dtype == DCU_BF16)
        k_kv_write<bf16><<<T, 128, 0, c->stream>>>((bf16 *)kv->base, kv->block_size, kv->n_layers,
                                                   kv->kv_dim, layer, k, v, stride, pos, seq, bts,
                                                   bt_stride);
    else
        k_kv_write<float><<<T, 128, 0, c->stream>>>((float *)kv->base, kv->block_size,
                                                    kv->n_layers, kv->kv_dim, layer, k, v, stride,
                                                    pos, seq, bts, bt_stride);
    return launch_check("kv_write");
}

/* The forward's fused step after the QKV GEMM: bias, RoPE on q and k, q to qout (T, nh*hd),
 * k and v into the KV cache. qkv (T, (nh + 2 nkv) hd) of IT: f32, or bf16 (the GEMM's output
 * rounded by its epilogue, prefill-sized T: half the bytes written and read back). */
__device__ __forceinline__ float ld_f(const float *p) {
    return *p;
}
__device__ __forceinline__ float ld_f(const bf16 *p) {
    return __bfloat162float(*p);
}
template <typename KT, typename IT = float>
__global__ void k_qkv_finish(float *qout, KT *kv, int bs, int n_layers, int layer, const IT *qkv,
                             const float *bias, const int32_t *pos, const int32_t *seq,
                             const int32_t *bts, int bt_stride, const float *inv_freq, int nh,
                             int nkv, int hd) {
    pdl_trigger();
    pdl_wait();
    int t = blockIdx.x, half = hd / 2, h = nh * hd, kvd = nkv * hd, W = h + 2 * kvd;
    const IT *row = qkv + (size_t)t * W;
    /* grid (T, blocks): the rope items (q and k heads, hd / 2 each) and the v elements,
     * each spread over the blocks of the token (one block took ~2,600 items alone at batch 1) */
    int n_rope = (nh + nkv) * half;
    int i0 = blockIdx.y * blockDim.x + threadIdx.x, istep = gridDim.y * blockDim.x;
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    int p = pos[t], pad = p < 0; /* a padding row of a recorded decode step: no KV */
    size_t ok = pad ? 0 : kv_off(bt, p, bs, n_layers, kvd, layer, 0);
    size_t ov = pad ? 0 : kv_off(bt, p, bs, n_layers, kvd, layer, 1);
    float fp = pad ? 0.0f : (float)p;
    /* a stride of whole heads (istep % half == 0: 128 threads, head_dim 64 / 128 / 256)
     * keeps j fixed for the thread: its cos / sin once, not once a head (the same values) */
    const int fixed_j = istep % half == 0 && i0 < n_rope;
    float cs0 = 0.0f, sn0 = 0.0f;
    if (fixed_j) {
        float a = fp * inv_freq[i0 % half];
        cs0 = cosf(a), sn0 = sinf(a);
    }
    for (int i = i0; i < n_rope; i += istep) {
        int hh = i / half, j = i % half;
        int o = hh * hd + j; /* q heads then k heads: contiguous in row */
        float u = ld_f(row + o) + (bias ? bias[o] : 0.0f);
        float w = ld_f(row + o + half) + (bias ? bias[o + half] : 0.0f);
        float cs = cs0, sn = sn0;
        if (!fixed_j) {
            float a = fp * inv_freq[j];
            cs = cosf(a), sn = sinf(a);
        }
        float r0 = u * cs - w * sn, r1 = w * cs + u * sn;
        if (hh < nh) {
            qout[(size_t)t * h + o] = r0;
            qout[(size_t)t * h + o + half] = r1;
        } else if (!pad) {
            int ko = o - h;
            store_as(kv + ok + ko, r0);
            store_as(kv + ok + ko + half, r1);
        }
    }
    if (pad) return;
    for (int vi = i0; vi < kvd; vi += istep)
        store_as(kv + ov + vi, ld_f(row + h + kvd + vi) + (bias ? bias[h + kvd + vi] : 0.0f));
}

/* k_qkv_finish for a bf16 q|k|v (the prefill path, cb_qkv) with two adjacent elements a
 * thread: bf16x2 loads, float2 / paired stores, the cos / sin of its two angles once (the
 * block's stride is whole heads).  Each element's arithmetic is k_qkv_finish's, so the
 * results are bit-identical; needs head_dim % 4 == 0 and blockDim % (head_dim / 4) == 0. */
template <typename KT> __device__ __forceinline__ void store2_as(KT *p, float a, float b);
template <> __device__ __forceinline__ void store2_as<float>(float *p, float a, float b) {
    *(float2 *)p = make_float2(a, b);
}
template <> __device__ __forceinline__ void store2_as<bf16>(bf16 *p, float a, float b) {
    *(__nv_bfloat162 *)p = __floats2bfloat162_rn(a, b);
}
template <typename KT>
__global__ void k_qkv_finish2(float *qout, KT *kv, int bs, int n_layers, int layer, const bf16 *qkv,
                              const float *bias, const int32_t *pos, const int32_t *seq,
                              const int32_t *bts, int bt_stride, const float *inv_freq, int nh,
                              int nkv, int hd) {
    int t = blockIdx.x, half = hd / 2, hp = half / 2, h = nh * hd, kvd = nkv * hd, W = h + 2 * kvd;
    const bf16 *row = qkv + (size_t)t * W;
    int n_pairs = (nh + nkv) * hp;
    int i0 = blockIdx.y * blockDim.x + threadIdx.x, istep = gridDim.y * blockDim.x;
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    int p = pos[t], pad = p < 0;
    size_t ok = pad ? 0 : kv_off(bt, p, bs, n_layers, kvd, layer, 0);
    size_t ov = pad ? 0 : kv_off(bt, p, bs, n_layers, kvd, layer, 1);
    float fp = pad ? 0.0f : (float)p;
    int j = 2 * (i0 % hp); /* the same for every item of the thread (istep % hp == 0) */
    float a0 = fp * inv_freq[j], a1 = fp * inv_freq[j + 1];
    float c0 = cosf(a0), s0 = sinf(a0), c1 = cosf(a1), s1 = sinf(a1);
    for (int i = i0; i < n_pairs; i += istep) {
        int hh = i / hp, o = hh * hd + j;
        float2 u = __bfloat1622float2(*(const __nv_bfloat162 *)(row + o)),
               w = __bfloat1622float2(*(const __nv_bfloat162 *)(row + o + half));
        if (bias) {
            u.x += bias[o], u.y += bias[o + 1];
            w.x += bias[o + half], w.y += bias[o + half + 1];
        } else {
            u.x += 0.0f, u.y += 0.0f, w.x += 0.0f, w.y += 0.0f;
        }
        float r00 = u.x * c0 - w.x * s0, r10 = w.x * c0 + u.x * s0;
        float r01 = u.y * c1 - w.y * s1, r11 = w.y * c1 + u.y * s1;
        if (hh < nh) {
            *(float2 *)(qout + (size_t)t * h + o) = make_float2(r00, r01);
            *(float2 *)(qout + (size_t)t * h + o + half) = make_float2(r10, r11);
        } else if (!pad) {
            int ko = o - h;
            store2_as(kv + ok + ko, r00, r01);
            store2_as(kv + ok + ko + half, r10, r11);
        }
    }
    if (pad) return;
    for (int vi = 2 * i0; vi < kvd; vi += 2 * istep) {
        float2 v = __bfloat1622float2(*(const __nv_bfloat162 *)(row + h + kvd + vi));
        store2_as(kv + ov + vi, v.x + (bias ? bias[h + kvd + vi] : 0.0f),
                  v.y + (bias ? bias[h + kvd + vi + 1] : 0.0f));
    }
}

/* ---- attention ------------------------------------------------------------------ */

#define ATT_WARPS 8
#define ATT_U 4
#define ATT_CHUNK 128 /* KV positions per split of the decode kernel */
#define ATT_MAXG 8

/* grid (T, n_kv, splits), ATT_WARPS warps.  Each warp walks keys k0+w, k0+w+ATT_WARPS, ...
 * keeping an online softmax per query head of the group; the warps are merged at the end.
 * splits == 1: writes the normalised output; else unnormalised partials and (m, l). */
template <typename KT, typename OT, int ND>
__global__ void __launch_bounds__(ATT_WARPS * 32)
    k_attention(OT *out, float *part, float *ml, const float *q, const KT *kv, int bs,
                int n_layers, int layer, const int32_t *pos, const int32_t *seq,
                const int32_t *bts, int bt_stride, int nh, int nkv, int hd, int chunk,
                float scale, const int32_t *list) {
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
                    kk[u][d] = e < hd ? load_f(kr + e) : 0.0f;
                    vv[u][d] = e < hd ? load_f(vr + e) : 0.0f;
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
    k_att_combine(OT *out, const float *part, const float *ml, int nh, int hd, int splits,
                  const int32_t *list) {
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
__global__ void k_att_combine_seq(OT *out, const float *part, const float *ml, int nh, int hd,
                                  int splits, const int32_t *list) {
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
        k_att_combine_seq<OT><<<T * nh, hd < 128 ? 128 : hd, 0, c->stream>>>(
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
    return launch_pdl(c, "att_combine", k_att_combine<OT>, dim3(T * nh), dim3(CB_THREADS),
                      (size_t)splits * 4, out, (const float *)c->att_part,
                      (const float *)c->att_ml, nh, hd, splits, c->att_list);
}

template <typename KT, typename OT, int ND>
static void launch_att(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                       const int32_t *pos, const int32_t *seq, const int32_t *bts, int bt_stride,
                       int T, int nh, int nkv, int hd, int splits, int chunk, float scale) {
    dim3 grid(T, nkv, splits);
    k_attention<KT, OT, ND><<<grid, ATT_WARPS * 32, 0, c->stream>>>(
        out, c->att_part, c->att_ml, q, (const KT *)kv->base, kv->block_size, kv->n_layers, layer,
        pos, seq, bts, bt_stride, nh, nkv, hd, chunk, scale, c->att_list);
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

static int attention_scaled(dcu_ctx *c, void *out, int out_dtype, const float *q,
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
    if (bf_kv && c->att_mma && (hd == 64 || hd == 128) && nh / nkv <= 8)
        return launch_att_mma(c, out, bf_out, q, kv, layer, pos, seq, bts, bt_stride, T, nh, nkv,
                              hd, splits, chunk, scale);
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




/* ---- prefill attention on tensor cores ---------------------------------------------- */

#include <mma.h>

#define FA_BK 64 /* keys per tile */

static size_t flash_smem(int hd) {
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
    k_flash_prefill(OT *out, const float *q, const bf16 *kv, int bs, int n_layers, int layer,
                    const int32_t *tiles, const int32_t *pos, const int32_t *bts, int bt_stride,
                    int nh, int nkv, float scale) {
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
static int launch_flash(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                        const int32_t *tiles, int n_tiles, const int32_t *pos, const int32_t *bts,
                        int bt_stride, int nh, int nkv, float scale) {
    size_t sh = flash_smem(HD);
    static int attr_done[2][8];
    int oi = sizeof(OT) == 2, hi = HD / 16 - 1;
    if (!attr_done[oi][hi]) {
        cudaFuncSetAttribute(k_flash_prefill<HD, OT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)sh);
        attr_done[oi][hi] = 1;
    }
    dim3 grid(n_tiles, nh);
    k_flash_prefill<HD, OT><<<grid, 128, sh, c->stream>>>(out, q, (const bf16 *)kv->base,
                                                          kv->block_size, kv->n_layers, layer,
                                                          tiles, pos, bts, bt_stride, nh, nkv,
                                                          scale);
    return launch_check("flash_prefill");
}

/* The prefill kernel on mma.sync (FlashAttention-2 layout; the default, DISAGG_CUDA_FLASH2=0
 * goes back to the wmma kernel above, which also serves head_dim 16): the same
 * CTA (64-row tile, query head) and tiles as k_flash_prefill, but Q fragments, S, P and O
 * live in registers (m16n8k16 bf16, f32 accumulate), the softmax runs on the accumulator
 * fragments (each row's 4 owners reduce with two shuffles), K and V tiles (64 keys) are read
 * from padded shared memory with ldmatrix.  head_dim 32/64/128. */
#define F2_PAD 8

static size_t flash2_smem(int hd, int pipe) {
    return (size_t)(pipe ? 2 : 1) * 2 * FA_BK * (hd + F2_PAD) * 2;
}

/* PIPE: K/V tiles through cp.async into two stages, the next tile's copy in flight while
 * the current one is computed (DISAGG_CUDA_FLASH_PIPE=0: one stage, synchronous loads) */
template <int HD, typename OT, int PIPE>
__global__ void __launch_bounds__(128)
    k_flash2(OT *out, const float *q, const bf16 *kv, int bs, int n_layers, int layer,
             const int32_t *tiles, const int32_t *pos, const int32_t *bts, int bt_stride, int nh,
             int nkv, float scale) {
    constexpr int LD = HD + F2_PAD, NT = FA_BK / 8, DT = HD / 8, KS = HD / 16;
    int tile = blockIdx.x, h = blockIdx.y, kvh = h / (nh / nkv), kvd = nkv * HD;
    int t0 = tiles[3 * tile], rows = tiles[3 * tile + 1], sq = tiles[3 * tile + 2];
    const int32_t *bt = bts + (size_t)sq * bt_stride;
    int p0 = pos[t0], kmax = p0 + rows;
    extern __shared__ __align__(16) char smem[];
    bf16 *Ks = (bf16 *)smem, *Vs = Ks + FA_BK * LD;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wr0 = warp * 16;
    /* tile kt's K and V into stage stg (cp.async, one commit group) */
    auto load_async = [&](int stg, int kt) {
        bf16 *K_ = (bf16 *)smem + (size_t)stg * 2 * FA_BK * LD, *V_ = K_ + FA_BK * LD;
        for (int i = threadIdx.x; i < FA_BK * HD / 8; i += 128) {
            int r = i / (HD / 8), c8 = i % (HD / 8), j = kt + r;
            bf16 *kd = K_ + r * LD + c8 * 8, *vd = V_ + r * LD + c8 * 8;
            if (j < kmax) {
                cp_async16(kd, kv + kv_off(bt, j, bs, n_layers, kvd, layer, 0) + (size_t)kvh * HD +
                                   c8 * 8);
                cp_async16(vd, kv + kv_off(bt, j, bs, n_layers, kvd, layer, 1) + (size_t)kvh * HD +
                                   c8 * 8);
            } else {
                *(uint4 *)kd = make_uint4(0, 0, 0, 0);
                *(uint4 *)vd = make_uint4(0, 0, 0, 0);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    if (PIPE) load_async(0, 0);
    int g = lane >> 2, qd = lane & 3;
    /* Q fragments (rows wr0 + g, wr0 + g + 8), scaled, rounded to bf16 */
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
        qa[kk][0] = pack_bf2(x00.x * scale, x00.y * scale);
        qa[kk][1] = pack_bf2(x10.x * scale, x10.y * scale);
        qa[kk][2] = pack_bf2(x01.x * scale, x01.y * scale);
        qa[kk][3] = pack_bf2(x11.x * scale, x11.y * scale);
    }
    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    int qp0 = p0 + r0, qp1 = p0 + r1; /* query positions of the two rows */
    for (int k0 = 0; k0 < kmax; k0 += FA_BK) {
        if (PIPE) {
            int stg = (k0 / FA_BK) & 1;
            if (k0 + FA_BK < kmax)
                load_async(stg ^ 1, k0 + FA_BK); /* the stage the previous tile used */
            else
                asm volatile("cp.async.commit_group;\n" ::);
            asm volatile("cp.async.wait_group 1;\n" ::); /* this tile's copy is done */
            Ks = (bf16 *)smem + (size_t)stg * 2 * FA_BK * LD;
            Vs = Ks + FA_BK * LD;
        } else {
            for (int i = threadIdx.x; i < FA_BK * HD / 8; i += 128) {
                int r = i / (HD / 8), c8 = i % (HD / 8), j = k0 + r;
                uint4 kz = make_uint4(0, 0, 0, 0), vz = kz;
                if (j < kmax) {
                    kz = *(const uint4 *)(kv + kv_off(bt, j, bs, n_layers, kvd, layer, 0) +
                                          (size_t)kvh * HD + c8 * 8);
                    vz = *(const uint4 *)(kv + kv_off(bt, j, bs, n_layers, kvd, layer, 1) +
                                          (size_t)kvh * HD + c8 * 8);
                }
                *(uint4 *)(Ks + r * LD + c8 * 8) = kz;
                *(uint4 *)(Vs + r * LD + c8 * 8) = vz;
            }
        }
        __syncthreads();
        if (wr0 < rows && k0 <= p0 + wr0 + 15) {
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
            /* causal mask and the online softmax on the fragments */
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                int j = k0 + n * 8 + 2 * qd;
                if (j > qp0 || r0 >= rows) s[n][0] = -INFINITY;
                if (j + 1 > qp0 || r0 >= rows) s[n][1] = -INFINITY;
                if (j > qp1 || r1 >= rows) s[n][2] = -INFINITY;
                if (j + 1 > qp1 || r1 >= rows) s[n][3] = -INFINITY;
                mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
                mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            float c0 = mn0 == -INFINITY ? 1.0f : __expf(m0 - mn0);
            float c1 = mn1 == -INFINITY ? 1.0f : __expf(m1 - mn1);
            float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
            uint32_t pa[NT][2];
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                float e0 = __expf(s[n][0] - b0), e1 = __expf(s[n][1] - b0);
                float e2 = __expf(s[n][2] - b1), e3 = __expf(s[n][3] - b1);
                pa[n][0] = pack_bf2(e0, e1);
                pa[n][1] = pack_bf2(e2, e3);
                __nv_bfloat162 p01 = *(__nv_bfloat162 *)&pa[n][0],
                               p23 = *(__nv_bfloat162 *)&pa[n][1];
                sum0 += __low2float(p01) + __high2float(p01); /* the weights P V uses */
                sum1 += __low2float(p23) + __high2float(p23);
            }
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
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
                    /* matrices: keys kk*16 + (m&1)*8 .. +7, d = dn*8 + (m>>1)*8 */
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
        __syncthreads();
    }
    float i0 = l0 > 0 ? 1.0f / l0 : 0.0f, i1 = l1 > 0 ? 1.0f / l1 : 0.0f;
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

template <int HD, typename OT>
static int launch_flash2(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                         const int32_t *tiles, int n_tiles, const int32_t *pos,
                         const int32_t *bts, int bt_stride, int nh, int nkv, float scale) {
    int pipe = c->flash_pipe;
    size_t sh = flash2_smem(HD, pipe);
    static int attr_done[2][2][8];
    int oi = sizeof(OT) == 2, hi = HD / 16 - 1;
    if (!attr_done[pipe][oi][hi]) {
        cudaFuncSetAttribute(pipe ? k_flash2<HD, OT, 1> : k_flash2<HD, OT, 0>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sh);
        attr_done[pipe][oi][hi] = 1;
    }
    dim3 grid(n_tiles, nh);
    if (pipe)
        k_flash2<HD, OT, 1><<<grid, 128, sh, c->stream>>>(out, q, (const bf16 *)kv->base,
                                                          kv->block_size, kv->n_layers, layer,
                                                          tiles, pos, bts, bt_stride, nh, nkv,
                                                          scale);
    else
        k_flash2<HD, OT, 0><<<grid, 128, sh, c->stream>>>(out, q, (const bf16 *)kv->base,
                                                          kv->block_size, kv->n_layers, layer,
                                                          tiles, pos, bts, bt_stride, nh, nkv,
                                                          scale);
    return launch_check("flash2_prefill");
}

/* k_flash3 — the default prefill kernel (DISAGG_CUDA_FLASH3=0 goes back to k_flash2): the
 * k_flash2 layout (mma.sync m16n8k16, Q/S/P/O in registers, ldmatrix from padded shared
 * memory, cp.async double buffering of 64-key K/V tiles) with 16 * NW query rows a CTA
 * (NW = 8: 128-row tiles, DISAGG_CUDA_FLASH_BQ=64 for NW = 4), so each K/V tile read from L2
 * serves twice the rows; Q scaled by scale * log2(e) so the softmax is one ex2 an element;
 * the causal mask only on the tiles that cross a warp's diagonal; grid (query head, tile)
 * with the heads fastest (a GQA group's CTAs run together and share K/V in L2) and the last
 * (longest) tiles of the batch first. */
__device__ __forceinline__ float ex2f(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

static size_t flash3_smem(int hd) {
    return (size_t)2 * 2 * FA_BK * (hd + F2_PAD) * 2;
}

template <int HD, typename OT, int NW>
__global__ void __launch_bounds__(NW * 32, NW == 4 ? 2 : 1)
    k_flash3(OT *out, const float *q, const bf16 *kv, int bs, int n_layers, int layer,
             const int32_t *tiles, int n_tiles, const int32_t *pos, const int32_t *bts,
             int bt_stride, int nh, int nkv, float qscale) {
    constexpr int LD = HD + F2_PAD, NT = FA_BK / 8, DT = HD / 8, KS = HD / 16, NTH = NW * 32;
    int h = blockIdx.x, tile = n_tiles - 1 - (int)blockIdx.y;
    int kvh = h / (nh / nkv), kvd = nkv * HD;
    int t0 = tiles[3 * tile], rows = tiles[3 * tile + 1], sq = tiles[3 * tile + 2];
    const int32_t *bt = bts + (size_t)sq * bt_stride;
    int p0 = pos[t0], kmax = p0 + rows;
    extern __shared__ __align__(16) char smem[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wr0 = warp * 16;
    const bf16 *kvh_base = kv + (size_t)kvh * HD;
    const size_t vgap = (size_t)bs * kvd; /* V of a slot is one (block size x kv_dim) after K */
    /* tile kt's K and V into stage stg (cp.async, one commit group) */
    auto load_async = [&](int stg, int kt) {
        bf16 *K_ = (bf16 *)smem + (size_t)stg * 2 * FA_BK * LD, *V_ = K_ + FA_BK * LD;
#pragma unroll
        for (int i = threadIdx.x; i < FA_BK * HD / 8; i += NTH) {
            int r = i / (HD / 8), c8 = i % (HD / 8), j = kt + r;
            bf16 *kd = K_ + r * LD + c8 * 8, *vd = V_ + r * LD + c8 * 8;
            if (j < kmax) {
                const bf16 *src = kvh_base + kv_off(bt, j, bs, n_layers, kvd, layer, 0) + c8 * 8;
                cp_async16(kd, src);
                cp_async16(vd, src + vgap);
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

template <int HD, typename OT, int NW>
static int launch_flash3_nw(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                            const int32_t *tiles, int n_tiles, const int32_t *pos,
                            const int32_t *bts, int bt_stride, int nh, int nkv, float scale) {
    size_t sh = flash3_smem(HD);
    static int attr_done;
    if (!attr_done) {
        cudaFuncSetAttribute(k_flash3<HD, OT, NW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)sh);
        attr_done = 1;
    }
    dim3 grid(nh, n_tiles);
    k_flash3<HD, OT, NW><<<grid, NW * 32, sh, c->stream>>>(
        out, q, (const bf16 *)kv->base, kv->block_size, kv->n_layers, layer, tiles, n_tiles, pos,
        bts, bt_stride, nh, nkv, scale * 1.4426950408889634f);
    return launch_check("flash3_prefill");
}

/* k_flash4 — k_flash3 with 32 query rows a warp (DISAGG_CUDA_FLASH_MT=2): 4 warps, 128-row
 * tiles, each warp two m16 tiles, so every K and V fragment read from shared memory by
 * ldmatrix feeds two mma instead of one (ldmatrix traffic per FLOP 0.6x of k_flash3's; the
 * FlashAttention-2 layout).  Q (scaled by scale * log2(e), bf16) lives in shared memory and
 * is read by ldmatrix each k-step, which leaves the registers for O (2 x head_dim / 2) and S. */
#define F4_NW 4

static size_t flash4_smem(int hd) {
    return (size_t)(FA_BQ3 + 2 * 2 * FA_BK) * (hd + F2_PAD) * 2;
}

template <int HD, typename OT>
__global__ void __launch_bounds__(F4_NW * 32, 2)
    k_flash4(OT *out, const float *q, const bf16 *kv, int bs, int n_layers, int layer,
             const int32_t *tiles, int n_tiles, const int32_t *pos, const int32_t *bts,
             int bt_stride, int nh, int nkv, float qscale) {
    constexpr int LD = HD + F2_PAD, NT = FA_BK / 8, DT = HD / 8, KS = HD / 16, NTH = F4_NW * 32;
    int h = blockIdx.x, tile = n_tiles - 1 - (int)blockIdx.y;
    int kvh = h / (nh / nkv), kvd = nkv * HD;
    int t0 = tiles[3 * tile], rows = tiles[3 * tile + 1], sq = tiles[3 * tile + 2];
    const int32_t *bt = bts + (size_t)sq * bt_stride;
    int p0 = pos[t0], kmax = p0 + rows;
    extern __shared__ __align__(16) char smem[];
    bf16 *Qs = (bf16 *)smem, *KV0 = Qs + FA_BQ3 * LD;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wr0 = warp * 32;
    const bf16 *kvh_base = kv + (size_t)kvh * HD;
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
                const bf16 *src =
                    kvh_base + (size_t)bt[bi] * per_block + lay_off + (size_t)slot * kvd + c8 * 8;
                cp_async16(kd, src);
                cp_async16(vd, src + vgap);
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

template <int HD, typename OT>
static int launch_flash4(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                         const int32_t *tiles, int n_tiles, const int32_t *pos,
                         const int32_t *bts, int bt_stride, int nh, int nkv, float scale) {
    size_t sh = flash4_smem(HD);
    static int attr_done;
    if (!attr_done) {
        cudaFuncSetAttribute(k_flash4<HD, OT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)sh);
        attr_done = 1;
    }
    dim3 grid(nh, n_tiles);
    k_flash4<HD, OT><<<grid, F4_NW * 32, sh, c->stream>>>(
        out, q, (const bf16 *)kv->base, kv->block_size, kv->n_layers, layer, tiles, n_tiles, pos,
        bts, bt_stride, nh, nkv, scale * 1.4426950408889634f);
    return launch_check("flash4_prefill");
}

/* k_flash4's CTAs are 4 warps: when the grid leaves SMs without a CTA (a 512-token prompt
 * of 28 heads: 112 CTAs for 132 SMs) k_flash3's 8-warp CTAs keep twice the warps busy, so
 * such launches take k_flash3 (c->flash_auto) */
static int flash_mt_for(const dcu_ctx *c, int n_tiles, int nh) {
    if (c->flash_mt == 2 && c->flash_auto && (long)n_tiles * nh < c->n_sm) return 1;
    return c->flash_mt;
}

/* tiles: of FA_BQ3 rows (c->flash_bq == 128): k_flash4 (c->flash_mt == 2) or k_flash3 with
 * 8 warps; of FA_BQ rows: k_flash3 with 4 warps */
template <int HD, typename OT>
static int launch_flash3(dcu_ctx *c, OT *out, const float *q, const dcu_kv *kv, int layer,
                         const int32_t *tiles, int n_tiles, const int32_t *pos,
                         const int32_t *bts, int bt_stride, int nh, int nkv, float scale) {
    if (c->flash_bq == FA_BQ3 && flash_mt_for(c, n_tiles, nh) == 2)
        return launch_flash4<HD, OT>(c, out, q, kv, layer, tiles, n_tiles, pos, bts, bt_stride,
                                     nh, nkv, scale);
    if (c->flash_bq == FA_BQ3)
        return launch_flash3_nw<HD, OT, FA_BQ3 / 16>(c, out, q, kv, layer, tiles, n_tiles, pos,
                                                     bts, bt_stride, nh, nkv, scale);
    return launch_flash3_nw<HD, OT, FA_BQ / 16>(c, out, q, kv, layer, tiles, n_tiles, pos, bts,
                                                bt_stride, nh, nkv, scale);
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

template <int HD, typename OT>
__global__ void __launch_bounds__(AM_WARPS * 32)
    k_att_mma(OT *out, float *part, float *ml, const float *q, const bf16 *kv, int bs,
              int n_layers, int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts,
              int bt_stride, int nh, int nkv, int chunk, float scale, const int32_t *list) {
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
            const bf16 *vp = key < k1 ? kv + kv_off(bt, key, bs, n_layers, kvd, layer, 1) +
                                            (size_t)kvh * HD + 8 * g
                                      : NULL;
#pragma unroll
            for (int u = 0; u < NU; u++)
                va[kk][r][u] = vp ? *(const uint4 *)(vp + 64 * u) : make_uint4(0, 0, 0, 0);
        }
    /* S (4 tiles of 8 keys): row g, keys 8j + 2qd, +1 in s[j][0], s[j][1] */
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
        int key = k0 + 8 * j + g;
        uint4 kr[NP];
        const bf16 *kp = key < k1 ? kv + kv_off(bt, key, bs, n_layers, kvd, layer, 0) +
                                        (size_t)kvh * HD + 8 * qd
                                  : NULL;
#pragma unroll
        for (int p = 0; p < NP; p++)
            kr[p] = kp ? *(const uint4 *)(kp + 32 * p) : make_uint4(0, 0, 0, 0);
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
    const bf16 *kb = (const bf16 *)kv->base;
#define AMM(H, OT)                                                                                \
    launch_pdl(c, "attention (tensor cores)", k_att_mma<H, OT>, grid, dim3(AM_WARPS * 32), 0,     \
               (OT *)out, c->att_part, c->att_ml, q, kb, kv->block_size, kv->n_layers, layer,    \
               pos, seq, bts, bt_stride, nh, nkv, chunk, scale, c->att_list)
    if (hd == 128 && bf_out)
        AMM(128, bf16);
    else if (hd == 128)
        AMM(128, float);
    else if (bf_out)
        AMM(64, bf16);
    else
        AMM(64, float);
#undef AMM
    int rc = launch_check("attention (tensor cores)");
    if (!rc && splits > 1)
        rc = bf_out ? att_combine<bf16>(c, (bf16 *)out, T, nh, hd, splits)
                    : att_combine<float>(c, (float *)out, T, nh, hd, splits);
    return rc;
}

/* Can the prefill kernel take this shape? (bf16 KV, head_dim 16/32/64/128) */
static int flash_ok(const dcu_ctx *c, int kv_dtype, int hd) {
    return !c->no_flash && kv_dtype == DCU_BF16 && (hd == 16 || hd == 32 || hd == 64 || hd == 128);
}

/* Host side: splits a batch into prefill tiles (sequences with >= 16 new tokens, chunks of bq)
 * and the rest (one list entry per token).  seq_of(t) / pos are the per-token host arrays;
 * tokens of a sequence are contiguous.  tiles: (3 * n_tiles), rest: (n_rest).  Returns the
 * largest pos + 1 among the rest. */
static int split_batch(int T, const int32_t *seq, const int32_t *pos, int flash, int bq,
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
static int attention_mixed(dcu_ctx *c, void *out, int out_dtype, const float *q,
                           const dcu_kv *kv, int layer, const int32_t *pos, const int32_t *seq,
                           const int32_t *bts, int bt_stride, int T, int nh, int nkv, int hd,
                           float scale, const int32_t *tiles_d, int n_tiles,
                           const int32_t *tiles3_d, int n_tiles3, const int32_t *rest_d,
                           int n_rest, int rest_ctx) {
    int rc = 0;
    if (n_tiles > 0) {
        int b = out_dtype == DCU_BF16;
#define FL(H)                                                                                    \
    (b ? launch_flash<H, bf16>(c, (bf16 *)out, q, kv, layer, tiles_d, n_tiles, pos, bts,        \
                               bt_stride, nh, nkv, scale)                                       \
       : launch_flash<H, float>(c, (float *)out, q, kv, layer, tiles_d, n_tiles, pos, bts,      \
                                bt_stride, nh, nkv, scale))
#define FL2(H)                                                                                   \
    (b ? launch_flash2<H, bf16>(c, (bf16 *)out, q, kv, layer, tiles_d, n_tiles, pos, bts,       \
                                bt_stride, nh, nkv, scale)                                      \
       : launch_flash2<H, float>(c, (float *)out, q, kv, layer, tiles_d, n_tiles, pos, bts,     \
                                 bt_stride, nh, nkv, scale))
#define FL3(H)                                                                                   \
    (b ? launch_flash3<H, bf16>(c, (bf16 *)out, q, kv, layer, tiles3_d, n_tiles3, pos, bts,     \
                                bt_stride, nh, nkv, scale)                                      \
       : launch_flash3<H, float>(c, (float *)out, q, kv, layer, tiles3_d, n_tiles3, pos, bts,   \
                                 bt_stride, nh, nkv, scale))
        if (c->flash3 && c->flash2 && hd >= 32 && tiles3_d)
            rc = hd == 32 ? FL3(32) : hd == 64 ? FL3(64) : FL3(128);
        else if (c->flash2 && hd >= 32)
            rc = hd == 32 ? FL2(32) : hd == 64 ? FL2(64) : FL2(128);
        else
            rc = hd == 16 ? FL(16) : hd == 32 ? FL(32) : hd == 64 ? FL(64) : FL(128);
#undef FL
#undef FL2
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

/* ---- argmax --------------------------------------------------------------------- */

__global__ void k_argmax(int32_t *out, const float *logits, int vocab) {
    int r = blockIdx.x;
    const float *x = logits + (size_t)r * vocab;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = x[i];
        if (v > best || (v == best && i < bi)) best = v, bi = i;
    }
    __shared__ float sv[1024];
    __shared__ int si[1024];
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float v = sv[threadIdx.x + s];
            int i = si[threadIdx.x + s];
            if (v > sv[threadIdx.x] || (v == sv[threadIdx.x] && i < si[threadIdx.x]))
                sv[threadIdx.x] = v, si[threadIdx.x] = i;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[r] = si[0] == 0x7fffffff ? 0 : si[0];
}

/* the two-stage argmax: grid (rows, AMX_PARTS) blocks of 256 each take a slice of the row
 * (the lowest id wins ties, as k_argmax), then one warp a row reduces the parts.  One block
 * walking a 152k vocabulary took ~40 us; the slices read the row in parallel. */
__device__ __forceinline__ void amx_better(float &bv, int &bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}
__global__ void __launch_bounds__(256) k_argmax_part(int32_t *part, const float *logits,
                                                     int vocab) {
    int r = blockIdx.x, p = blockIdx.y, np = gridDim.y;
    const float *x = logits + (size_t)r * vocab;
    int per = (vocab + np - 1) / np, i0 = p * per, i1 = min(vocab, i0 + per);
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x)
        amx_better(best, bi, x[i], i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, best, o);
        int j = __shfl_xor_sync(0xffffffffu, bi, o);
        amx_better(best, bi, v, j);
    }
    __shared__ float sv[8];
    __shared__ int si[8];
    int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) sv[w] = best, si[w] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < (int)(blockDim.x >> 5); k++)
            amx_better(best, bi, sv[k], si[k]);
        size_t o = ((size_t)r * np + p) * 2;
        part[o] = __float_as_int(best);
        part[o + 1] = bi;
    }
}
__global__ void k_argmax_final(int32_t *out, const int32_t *part, int np) {
    int r = blockIdx.x, lane = threadIdx.x;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int p = lane; p < np; p += 32)
        amx_better(best, bi, __int_as_float(part[((size_t)r * np + p) * 2]),
                   part[((size_t)r * np + p) * 2 + 1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, best, o);
        int j = __shfl_xor_sync(0xffffffffu, bi, o);
        amx_better(best, bi, v, j);
    }
    if (lane == 0) out[r] = bi == 0x7fffffff ? 0 : bi;
}

static int argmax(dcu_ctx *c, int32_t *out, const float *logits, int rows, int vocab) {
    if (rows <= 0) return 0;
    if (rows > AMX_ROWS || vocab < 64 * AMX_PARTS) {
        k_argmax<<<rows, 1024, 0, c->stream>>>(out, logits, vocab);
        return launch_check("argmax");
    }
    k_argmax_part<<<dim3(rows, AMX_PARTS), 256, 0, c->stream>>>(c->amax_tmp, logits, vocab);
    k_argmax_final<<<rows, 32, 0, c->stream>>>(out, c->amax_tmp, AMX_PARTS);
    return launch_check("argmax");
}

/* ---- GEMM (cuBLASLt) -------------------------------------------------------------- */

/* DISAGG_CUDA_GEMM_TUNE=1: decode-sized GEMMs (T <= GEMM_TUNE_MAX_T) pick the fastest of
 * cuBLASLt's first GEMM_TUNE_ALGOS heuristic candidates, timed once per (device, T, N, K) in
 * the process and shared by every context (so every stream computes a shape with the same
 * kernel).  Off by default: on the H200 (7B shapes, batch 1..128) it measured no gain over
 * the first candidate, and a timing-based choice could differ between processes (P and D). */
#define GEMM_TUNE_MAX_T 256
#define GEMM_TUNE_ALGOS 8
#define GEMM_TUNED_CAP 1024
typedef struct gemm_tuned {
    int dev, T, N, K;
    cublasLtMatmulAlgo_t algo;
    float us;
} gemm_tuned;
static gemm_tuned g_tuned[GEMM_TUNED_CAP];
static int g_n_tuned;
static pthread_mutex_t g_tune_mu = PTHREAD_MUTEX_INITIALIZER;

static int tuned_find(int dev, int T, int N, int K, cublasLtMatmulAlgo_t *algo) {
    int found = 0;
    pthread_mutex_lock(&g_tune_mu);
    for (int i = 0; i < g_n_tuned && !found; i++)
        if (g_tuned[i].dev == dev && g_tuned[i].T == T && g_tuned[i].N == N && g_tuned[i].K == K) {
            *algo = g_tuned[i].algo;
            found = 1;
        }
    pthread_mutex_unlock(&g_tune_mu);
    return found;
}

/* times the candidates on x/w/y (y is overwritten; the caller's GEMM runs after) and returns
 * the index of the fastest, or 0 */
static int tune_pick(dcu_ctx *c, gemm_plan *p, const cublasLtMatmulHeuristicResult_t *res, int n,
                     const void *x, const void *w, void *y, float *best_us) {
    cudaEvent_t e0, e1;
    if (cudaEventCreate(&e0) != cudaSuccess) return 0;
    if (cudaEventCreate(&e1) != cudaSuccess) {
        cudaEventDestroy(e0);
        return 0;
    }
    float alpha = 1.0f, beta = 0.0f, best = 1e30f;
    int bi = 0;
    for (int i = 0; i < n; i++) {
        cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
        for (int r = 0; r < 4 && st == CUBLAS_STATUS_SUCCESS; r++) {
            if (r == 1) cudaEventRecord(e0, c->stream);
            st = cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, x, p->b, &beta, y, p->c, y, p->c,
                                &res[i].algo, c->ws, c->ws_bytes, c->stream);
        }
        cudaEventRecord(e1, c->stream);
        float ms = 0;
        if (st != CUBLAS_STATUS_SUCCESS || cudaEventSynchronize(e1) != cudaSuccess ||
            cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) {
            cudaGetLastError();
            continue;
        }
        if (ms < best) best = ms, bi = i;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    *best_us = best * 1e3f / 3;
    return bi;
}

/* Prefill GEMMs (T >= PF_GEMM_MIN_T, fast mode: the batch-invariant mode's GEMMs are
 * iv_matmul's own): cuBLASLt's first PF_ALGOS heuristic candidates, and candidate
 * pf_rule() of them — a fixed rule from the H200 measurements (docs/gpu.md), so the
 * same shape runs the same kernel in every process (no timing decides).  DISAGG_CUDA_GEMM_ALGO=i
 * forces candidate i (0: the heuristic's first, the code before the rule); DISAGG_CUDA_GEMM_SWEEP=1 times every candidate once per plan and prints
 * them (stderr), =2 also takes the fastest (measuring only: that choice can differ between
 * processes). */
#define PF_GEMM_MIN_T 256
#define PF_ALGOS 16

static int cfg_get(const cublasLtMatmulAlgo_t *a, cublasLtMatmulAlgoConfigAttributes_t at) {
    uint32_t v = 0;
    size_t wr = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(a, at, &v, sizeof v, &wr) != CUBLAS_STATUS_SUCCESS)
        return -1;
    return (int)v;
}

/* The fixed rule (H200, cuBLASLt 13.0, Qwen2.5-7B shapes, T = 512 / 2048 / 4096 timed by
 * DISAGG_CUDA_GEMM_SWEEP, docs/benchmarks.md): for T >= 512 the f32-output GEMMs of N = 3584
 * rows (o: K = 3584, down: K = 18944) run the first candidate of tile 112x128, else of tile
 * 128x128, and those of N = 4608 (q|k|v) the first of tile 144x128 (no split-K either way);
 * where the list has none, and for every other shape (the bf16 gate|up too), the heuristic's
 * first.  The heuristic's first at T >= 2048 were 320x128 / 256x128 / 192x192 tiles, 7-13 %
 * slower on these N.  The candidate list is the same for a shape in every process, so is
 * the choice. */
static int pf_rule(const cublasLtMatmulHeuristicResult_t *res, int found, int T, int N,
                   int out16) {
    static const int t3584[] = {CUBLASLT_MATMUL_TILE_112x128, CUBLASLT_MATMUL_TILE_128x128};
    static const int t4608[] = {CUBLASLT_MATMUL_TILE_144x128};
    const int *pref = NULL;
    int n_pref = 0;
    if (out16 || T < 512) return 0;
    if (N == 3584) pref = t3584, n_pref = 2;
    if (N == 4608) pref = t4608, n_pref = 1;
    for (int j = 0; j < n_pref; j++)
        for (int i = 0; i < found; i++)
            if (cfg_get(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID) == pref[j] &&
                cfg_get(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) <= 1)
                return i;
    return 0;
}

static int pf_pick(dcu_ctx *c, gemm_plan *p, cublasLtMatmulPreference_t pref, const void *x,
                   const void *w, void *y, int T, int N, int K, int out16,
                   cublasLtMatmulAlgo_t *algo) {
    cublasLtMatmulHeuristicResult_t res[PF_ALGOS];
    int found = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref,
                                                      PF_ALGOS, res, &found);
    if (s != CUBLAS_STATUS_SUCCESS || found <= 0) return -1;
    int pick = c->gemm_algo >= 0 ? c->gemm_algo : pf_rule(res, found, T, N, out16);
    if (pick >= found) pick = 0;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(c->stream, &cap);
    if (c->gemm_sweep > 0 && cap == cudaStreamCaptureStatusNone && x && w && y) {
        cudaEvent_t e0, e1;
        if (cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess) {
            float alpha = 1.0f, beta = 0.0f, best = 1e30f;
            int bi = pick;
            for (int i = 0; i < found; i++) {
                cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
                for (int r = 0; r < 7 && st == CUBLAS_STATUS_SUCCESS; r++) {
                    if (r == 2) cudaEventRecord(e0, c->stream);
                    st = cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, x, p->b, &beta, y, p->c, y,
                                        p->c, &res[i].algo, c->ws, c->ws_bytes, c->stream);
                }
                cudaEventRecord(e1, c->stream);
                float ms = 0;
                if (st != CUBLAS_STATUS_SUCCESS || cudaEventSynchronize(e1) != cudaSuccess ||
                    cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) {
                    cudaGetLastError();
                    fprintf(stderr, "cuda gemm sweep: T=%d N=%d K=%d%s #%d: failed\n", T, N, K,
                            out16 ? " bf16" : "", i);
                    continue;
                }
                float us = ms * 1e3f / 5;
                if (us < best) best = us, bi = i;
                const cublasLtMatmulAlgo_t *a = &res[i].algo;
                fprintf(stderr,
                        "cuda gemm sweep: T=%d N=%d K=%d%s #%d: %8.1f us %4.0f TFLOP/s (id %d tile "
                        "%d stages %d splitk %d red %d swizzle %d cluster %d ws %zu)%s\n",
                        T, N, K, out16 ? " bf16" : "", i, us, 2.0 * T * N * K / us * 1e-6,
                        cfg_get(a, CUBLASLT_ALGO_CONFIG_ID), cfg_get(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                        cfg_get(a, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                        cfg_get(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                        cfg_get(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                        cfg_get(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                        cfg_get(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), res[i].workspaceSize,
                        i == pick ? " <- rule" : "");
            }
            if (c->gemm_sweep >= 2) pick = bi;
            fprintf(stderr, "cuda gemm sweep: T=%d N=%d K=%d%s: fastest #%d, using #%d\n", T, N,
                    K, out16 ? " bf16" : "", bi, pick);
        }
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
    *algo = res[pick].algo;
    return 0;
}

static gemm_plan *plan_get(dcu_ctx *c, int T, int N, int K, const void *x, const void *w,
                           void *y) {
    for (int i = 0; i < PLAN_CACHE; i++)
        if (c->plans[i].valid && c->plans[i].T == T && c->plans[i].N == N && c->plans[i].K == K)
            return &c->plans[i];
    gemm_plan *p = &c->plans[c->next_plan];
    c->next_plan = (c->next_plan + 1) % PLAN_CACHE;
    if (p->valid) {
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->c);
        p->valid = 0;
    }
    /* column-major view: C (N, T) = W^T-as-stored (op T of a K x N matrix) x X (K x T) */
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    if (cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS)
        return NULL;
    cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, K, N, K);
    cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, K, T, K);
    cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, N, T, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                         &c->ws_bytes, sizeof c->ws_bytes);
    cublasLtMatmulHeuristicResult_t res[GEMM_TUNE_ALGOS];
    int found = 0;
    int cacheable = T <= GEMM_TUNE_MAX_T && c->tune;
    if (!cacheable && T >= PF_GEMM_MIN_T &&
        pf_pick(c, p, pref, x, w, y, T, N, K, 0, &res[0].algo) == 0) {
        cublasLtMatmulPreferenceDestroy(pref);
        p->algo = res[0].algo;
        p->T = T, p->N = N, p->K = K, p->valid = 1;
        return p;
    }
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(c->stream, &cap);
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref,
                                                      cacheable ? GEMM_TUNE_ALGOS : 1, res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s == CUBLAS_STATUS_SUCCESS && found > 0 && cacheable) {
        cublasLtMatmulAlgo_t a;
        if (tuned_find(c->device, T, N, K, &a)) {
            res[0].algo = a;
        } else if (cap == cudaStreamCaptureStatusNone) {
            float us = 0;
            int bi = found > 1 ? tune_pick(c, p, res, found, x, w, y, &us) : 0;
            res[0].algo = res[bi].algo;
            pthread_mutex_lock(&g_tune_mu);
            if (g_n_tuned < GEMM_TUNED_CAP) {
                g_tuned[g_n_tuned] = (gemm_tuned){c->device, T, N, K, res[bi].algo, us};
                g_n_tuned++;
            }
            pthread_mutex_unlock(&g_tune_mu);
        }
    }
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
        fprintf(stderr, "cuda: cuBLASLt has no bf16 GEMM for T=%d N=%d K=%d (status %d)\n", T, N,
                K, (int)s);
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->c);
        return NULL;
    }
    p->algo = res[0].algo;
    p->T = T, p->N = N, p->K = K, p->valid = 1;
    return p;
}

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
 * used (DB: and the next GV_U issued before the current ones are used: double-buffered).  The
 * loop runs over warp-uniform batches of 32 x GV_U uint4.  The first batch of weight loads is
 * issued before pdl_wait(): with programmatic dependent launch it overlaps the previous
 * kernel's tail (the weights never depend on it).  x (T, K) bf16 through L1 (small, every
 * warp reads it). */
#define GV_U 8
#define GV_S (32 * GV_U)
#define GV_MAXW 8 /* warps a CTA at most (DISAGG_CUDA_GEMV_WARPS) */
#define GV_MAXS 8 /* split-K factor at most (DISAGG_CUDA_GEMV_SPLIT) */
template <int NR>
__device__ __forceinline__ void gv_load(uint4 (&wv)[NR][GV_U], const uint4 *const *wr, int i0,
                                        int K8, uint64_t pol) {
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int u = 0; u < GV_U; u++) {
            int i = i0 + 32 * u;
            wv[r][u] = i < K8 ? ld_stream(wr[r] + i, pol) : make_uint4(0, 0, 0, 0);
        }
}
template <int TT, int NR>
__device__ __forceinline__ void gv_fma(float (&acc)[NR][TT], const uint4 (&wv)[NR][GV_U],
                                       const uint4 *__restrict__ x, int xs, int i0, int K8) {
#pragma unroll
    for (int u = 0; u < GV_U; u++) {
        int i = i0 + 32 * u;
        if (i < K8) {
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
/* acc[r][t] = this lane's part of row r . token t (warp_sum it) over uint4s 0 .. K8 - 1 of
 * wr[r] and of x (token t at x + t xs: xs = K8 of the whole row; a split-K warp passes its
 * range's start in wr and x and its length as K8); calls pdl_wait() */
template <int TT, int NR, bool DB>
__device__ __forceinline__ void gv_rows(float (&acc)[NR][TT], const uint4 *const *wr,
                                        const uint4 *__restrict__ x, int xs, int K8, int lane) {
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int t = 0; t < TT; t++)
            acc[r][t] = 0.0f;
    uint64_t pol = l2_evict_first();
    uint4 wa[NR][GV_U];
    int base = 0;
    gv_load<NR>(wa, wr, base + lane, K8, pol);
    pdl_wait();
    if (!DB) {
        for (;;) {
            gv_fma<TT, NR>(acc, wa, x, xs, base + lane, K8);
            base += GV_S;
            if (base >= K8) break;
            gv_load<NR>(wa, wr, base + lane, K8, pol);
        }
    } else {
        uint4 wb[NR][GV_U];
        for (;;) {
            int b1 = base + GV_S;
            if (b1 < K8) gv_load<NR>(wb, wr, b1 + lane, K8, pol);
            gv_fma<TT, NR>(acc, wa, x, xs, base + lane, K8);
            if (b1 >= K8) break;
            int b2 = b1 + GV_S;
            if (b2 < K8) gv_load<NR>(wa, wr, b2 + lane, K8, pol);
            gv_fma<TT, NR>(acc, wb, x, xs, b1 + lane, K8);
            if (b2 >= K8) break;
            base = b2;
        }
    }
}

/* MODE 0: y (T, N) f32 = x w^T (+ bias), one row a warp; MODE 1: h (T, I) =
 * silu(x wg^T) * (x wu^T) in OT, wg = rows 0..I-1 of w, wu = rows I..2I-1 (N = I). */
template <int TT, int MODE, typename OT, bool DB>
__global__ void __launch_bounds__(256)
    k_gemv2(OT *__restrict__ y, const uint4 *__restrict__ x, const uint4 *__restrict__ w,
            const float *__restrict__ bias, int N, int K8) {
    constexpr int NR = MODE == 1 ? 2 : 1;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) { /* N: rows of the output (I for MODE 1) */
        pdl_wait();
        return;
    }
    const uint4 *wr[NR];
    wr[0] = w + (size_t)row * K8;
    if (NR == 2) wr[NR - 1] = w + (size_t)(row + N) * K8;
    float acc[NR][TT];
    gv_rows<TT, NR, DB>(acc, wr, x, K8, K8, lane);
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

/* Split-K form of k_gemv2 MODE 0 (DISAGG_CUDA_GEMV_SPLIT): S consecutive warps of a CTA share
 * NR output rows (DISAGG_CUDA_GEMV_SPLIT_ROWS=1|2: a warp streams NR rows at once, NR x GV_U
 * loads in flight a lane, as the gate|up GEMV), warp s of them taking the uint4s [s len,
 * min(K8, (s + 1) len)) of each, so a GEMV of few long rows (the 7B down_proj: 3,584 rows of
 * 37 KB, a partial second wave of warps) has S times the warps in flight.  The S partial sums
 * meet in shared memory and the rows' first warp adds them in split order (fixed: the same
 * bits every run), then the bias.  (The add + RMSNorm of the next operation in the
 * epilogue of the CTA that finishes last — threadfence, an integer count, k_rmsnorm4's
 * arithmetic, the same bits — measured 0.35 ms a step slower than the separate k_rmsnorm4 on
 * the H200 with CUDA graphs, 4.97 vs 4.62 ms at batch 1, 4k: removed.) */
template <int TT, int S, int NR>
__global__ void __launch_bounds__(256)
    k_gemv_sk(float *__restrict__ y, const uint4 *__restrict__ x, const uint4 *__restrict__ w,
              const float *__restrict__ bias, int N, int K8, int len) {
    __shared__ float red[GV_MAXW][NR][TT];
    int wi = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = (blockIdx.x * ((blockDim.x >> 5) / S) + wi / S) * NR, sp = wi % S;
    int lo = sp * len, n = min(K8 - lo, len);
    float acc[NR][TT];
    if (row < N && n > 0) {
        const uint4 *wr[NR];
#pragma unroll
        for (int r = 0; r < NR; r++)
            wr[r] = w + (size_t)min(row + r, N - 1) * K8 + lo; /* a dead row re-reads the last */
        gv_rows<TT, NR, false>(acc, wr, x + lo, K8, n, lane);
    } else {
#pragma unroll
        for (int r = 0; r < NR; r++)
#pragma unroll
            for (int t = 0; t < TT; t++)
                acc[r][t] = 0.0f;
        pdl_wait();
    }
    pdl_trigger(); /* late, as k_gemv2 */
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
template <int TT, typename KT, int S>
__global__ void __launch_bounds__(256)
    k_gemv_qkv(float *__restrict__ qout, KT *kv, const uint4 *__restrict__ x,
               const uint4 *__restrict__ w, const float *__restrict__ bias, int K8, int len,
               int bs, int n_layers, int layer, const int32_t *pos, const int32_t *seq,
               const int32_t *bts, int bt_stride, const float *inv_freq, int nh, int nkv, int hd) {
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
        gv_rows<TT, 2, false>(acc, wr, x + lo, K8, n, lane);
    } else {
#pragma unroll
        for (int t = 0; t < TT; t++)
            acc[0][t] = acc[1][t] = 0.0f;
        pdl_wait();
    }
    pdl_trigger(); /* late, as k_gemv2 */
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
                store_as(kv + ok + (r0 - h), o0);
                store_as(kv + ok + (r1 - h), o1);
            }
        } else if (!pad) {
            size_t ov = kv_off(bt, p, bs, n_layers, kvd, layer, 1);
            store_as(kv + ov + (r0 - h - kvd), u);
            store_as(kv + ov + (r1 - h - kvd), v);
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

/* the split-K GEMV (k_gemv_sk) with S splits, c->gemv_split_rows rows a warp */
static int gemv_sk_launch(dcu_ctx *c, float *y, const uint4 *xv, const uint4 *wv,
                          const float *bias, int T, int N, int K8, int S) {
    int nw = c->gemv_warps, wc = nw > S ? nw : S, len = gemv_split_len(K8, S), nr = c->gemv_split_rows;
    int rpc = wc / S * nr; /* rows a CTA */
    dim3 gs((N + rpc - 1) / rpc), bs(32 * wc);
#define GSK_(TT, SS, NR)                                                                         \
    if (T == TT && S == SS && nr == NR)                                                          \
        return launch_pdl(c, "gemv (split-K)", k_gemv_sk<TT, SS, NR>, gs, bs, 0, y, xv, wv, bias, \
                          N, K8, len);
#define GSK_S(TT, NR) GSK_(TT, 2, NR) GSK_(TT, 4, NR) GSK_(TT, 8, NR)
    GSK_S(1, 1) GSK_S(2, 1) GSK_S(1, 2) GSK_S(2, 2)
#undef GSK_S
#undef GSK_
    return -EINVAL;
}

template <int MODE, typename OT>
static int gemv_launch(dcu_ctx *c, OT *y, const void *x, const void *w, const float *bias, int T,
                       int N, int K) {
    int nw = c->gemv_warps; /* warps (output rows) per CTA */
    dim3 g((N + nw - 1) / nw), b(32 * nw);
    const uint4 *xv = (const uint4 *)x, *wv = (const uint4 *)w;
    int K8 = K / 8;
    /* double-buffered loads (DISAGG_CUDA_GEMV_DB=1) for one row a warp (MODE 0) only; the
     * two-row forms hold 16 loads in flight already */
    constexpr bool DB = MODE == 0;
    if constexpr (MODE == 0 && sizeof(OT) == 4) {
        int S = c->gemv_db ? 1 : gemv_split_for(c, c->gemv_split, N, K8, GV_MIN_LEN);
        if (S > 1) return gemv_sk_launch(c, y, xv, wv, bias, T, N, K8, S);
    }
    if (MODE == 0 && !c->gemv_db) {
        if (T == 1)
            return launch_pdl(c, "gemv", k_gemv2<1, MODE, OT, false>, g, b, 0, y, xv, wv, bias,
                              N, K8);
        if (T == 2)
            return launch_pdl(c, "gemv", k_gemv2<2, MODE, OT, false>, g, b, 0, y, xv, wv, bias,
                              N, K8);
        return -EINVAL;
    }
    if (T == 1)
        return launch_pdl(c, "gemv", k_gemv2<1, MODE, OT, DB>, g, b, 0, y, xv, wv, bias, N, K8);
    if (T == 2)
        return launch_pdl(c, "gemv", k_gemv2<2, MODE, OT, DB>, g, b, 0, y, xv, wv, bias, N, K8);
    return -EINVAL;
}

static int gemv(dcu_ctx *c, float *y, const void *x, const void *w, const float *bias, int T,
                int N, int K) {
    return gemv_launch<0, float>(c, y, x, w, bias, T, N, K);
}

/* the fused q|k|v GEMV (k_gemv_qkv) for T = 1..2, split-K by gemv_split_for */
template <typename KT>
static int gemv_qkv(dcu_ctx *c, float *qout, KT *kv, const void *x, const void *w,
                    const float *bias, int T, int K, int bs, int n_layers, int layer,
                    const int32_t *pos, const int32_t *seq, const int32_t *bts, int bt_stride,
                    const float *inv_freq, int nh, int nkv, int hd) {
    int nw = c->gemv_warps, pairs = (nh + nkv) * (hd / 2) + nkv * hd / 2, K8 = K / 8;
    int S = gemv_split_for(c, c->qkv_split, pairs, K8, GV_MIN_LEN_QKV), wc = nw > S ? nw : S, rpc = wc / S;
    int len = gemv_split_len(K8, S);
    dim3 g((pairs + rpc - 1) / rpc), b(32 * wc);
    const uint4 *xv = (const uint4 *)x, *wv = (const uint4 *)w;
    if (T < 1 || T > 2) return -EINVAL;
#define GQ_(TT, SS)                                                                              \
    if (T == TT && S == SS)                                                                      \
        return launch_pdl(c, "gemv_qkv", k_gemv_qkv<TT, KT, SS>, g, b, 0, qout, kv, xv, wv, bias, \
                          K8, len, bs, n_layers, layer, pos, seq, bts, bt_stride, inv_freq, nh,   \
                          nkv, hd);
    GQ_(1, 1) GQ_(1, 2) GQ_(1, 4) GQ_(1, 8) GQ_(2, 1) GQ_(2, 2) GQ_(2, 4) GQ_(2, 8)
#undef GQ_
    return -EINVAL;
}

/* y (T, N) f32 = x (T, K) bf16 . w (N, K)^T bf16 (+ bias) for decode-sized T <= 32 on
 * mma.sync m16n8k16: the weights are the M side (16 rows a CTA), the tokens the N side (NT
 * tiles of 8), so a token's output never depends on the other tokens (the same per-column
 * sums for any T <= 32).  4 warps split K (whole 32-wide chunks) and add up in shared memory
 * in a fixed order.  Operands straight from global memory: within a 32-wide chunk the k
 * order is permuted alike for W and x (thread (g, qd) holds k0 + 8qd .. +7 of its rows as one
 * 16-byte load: words x, y feed k-step 0, z, w k-step 1), so every load is 16 bytes and the
 * weights stream once.  Needs K % 32 == 0, N % 16 == 0, 16-byte aligned x and w. */
#define SK_WARPS 8
template <int NT>
__global__ void __launch_bounds__(SK_WARPS * 32)
    k_skinny(float *__restrict__ y, const bf16 *__restrict__ x, const bf16 *__restrict__ w,
             const float *__restrict__ bias, int T, int N, int K) {
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, g = lane >> 2, qd = lane & 3;
    int m0 = blockIdx.x * 16, chunks = K / 32;
    int c0 = wp * chunks / SK_WARPS, c1 = (wp + 1) * chunks / SK_WARPS;
    const bf16 *wa = w + (size_t)(m0 + g) * K + 8 * qd, *wb = wa + (size_t)8 * K;
    const bf16 *xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        int tok = 8 * nt + g;
        xr[nt] = tok < T ? x + (size_t)tok * K + 8 * qd : NULL;
    }
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll 4
    for (int ch = c0; ch < c1; ch++) {
        size_t k = (size_t)ch * 32;
        uint4 ua = __ldcs((const uint4 *)(wa + k)), ub = __ldcs((const uint4 *)(wb + k));
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            uint4 xv = xr[nt] ? __ldg((const uint4 *)(xr[nt] + k)) : make_uint4(0, 0, 0, 0);
            mma_bf16(acc[nt], ua.x, ub.x, ua.y, ub.y, xv.x, xv.y);
            mma_bf16(acc[nt], ua.z, ub.z, ua.w, ub.w, xv.z, xv.w);
        }
    }
    __shared__ float red[SK_WARPS][16][8 * NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        int tk = 8 * nt + 2 * qd;
        red[wp][g][tk] = acc[nt][0];
        red[wp][g][tk + 1] = acc[nt][1];
        red[wp][g + 8][tk] = acc[nt][2];
        red[wp][g + 8][tk + 1] = acc[nt][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * T; i += blockDim.x) {
        int r = i % 16, tk = i / 16;
        float v = 0.0f;
#pragma unroll
        for (int q = 0; q < SK_WARPS; q++)
            v += red[q][r][tk];
        y[(size_t)tk * N + m0 + r] = v + (bias ? bias[m0 + r] : 0.0f);
    }
}

static int skinny(dcu_ctx *c, float *y, const void *x, const void *w, const float *bias, int T,
                  int N, int K) {
    dim3 g(N / 16);
    const bf16 *xb = (const bf16 *)x, *wb = (const bf16 *)w;
    switch ((T + 7) / 8) {
#define SK_(n)                                                                                   \
    case n:                                                                                      \
        k_skinny<n><<<g, SK_WARPS * 32, 0, c->stream>>>(y, xb, wb, bias, T, N, K);               \
        break;
        SK_(1) SK_(2) SK_(3) SK_(4)
#undef SK_
    default:
        return -EINVAL;
    }
    return launch_check("skinny");
}

/* measured on the H200 (7B shapes, serving forward with CUDA graphs, gpu_check ONLY=decode
 * of 2026-12-01 14:51): the GEMV (single-buffered, gate|up + SwiGLU and q|k|v + RoPE/KV
 * fused) takes batch 1 at 4k to 4.75 ms a step against 4.88 with cuBLASLt for every GEMM
 * (5.37 before this GEMV); at T = 2 cuBLASLt is faster (4.87 vs 5.02 ms), so the default is
 * T = 1 only (DISAGG_CUDA_GEMV=2: T <= 2 too; 0: cuBLASLt for every T).  Split over K for
 * the GEMVs of few rows (gemv_split_for; the 18:11 run of 1 December: batch 1 at 4k 4.61 ms
 * against 4.85 unsplit in the same run).  k_skinny (tensor
 * cores) lost to cuBLASLt at T = 1..32.  The fast mode is not batch-invariant either way
 * (cuBLASLt changes kernels with T as well): a sequence's tokens may depend on its batch;
 * --batch-invariant (cuda_invariant.cu) is the mode that makes them not. */
static int gemv_ok(const dcu_ctx *c, int T, int K, const void *x, const void *w) {
    return T >= 1 && T <= c->gemv_max_t && K % 8 == 0 && !(((uintptr_t)x | (uintptr_t)w) & 15);
}

static int matmul(dcu_ctx *c, float *y, const void *x, const void *w, const float *bias, int T,
                  int N, int K) {
    if (T <= 0) return 0;
    if (gemv_ok(c, T, K, x, w)) return gemv(c, y, x, w, bias, T, N, K);
    if (T <= c->skinny_max && K % 32 == 0 && N % 16 == 0 && !(((uintptr_t)x | (uintptr_t)w) & 15))
        return skinny(c, y, x, w, bias, T, N, K);
    gemm_plan *p = plan_get(c, T, N, K, x, w, y);
    if (!p) return -EIO;
    float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t s = cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, x, p->b, &beta, y, p->c, y,
                                      p->c, &p->algo, c->ws, c->ws_bytes, c->stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuda: cublasLtMatmul T=%d N=%d K=%d failed (status %d)\n", T, N, K,
                (int)s);
        return -EIO;
    }
    if (bias) {
        size_t n = (size_t)T * N;
        k_bias<<<grid_for(n, 256), 256, 0, c->stream>>>(y, bias, N, n);
        return launch_check("bias");
    }
    return 0;
}

/* resid (T, N) f32 += x (T, K) bf16 . w (N, K)^T bf16 through cuBLASLt with beta = 1
 * and C = D = resid (in place, one layout): the GEMM's epilogue adds its f32 accumulator onto
 * the residual stream, alpha * acc + beta * C rounded once as x + y was (backend_matmul_residual
 * at prefill-sized T; decode keeps the add in the norm).  The plan is matmul's for the shape;
 * tmp (T, N) f32 takes the candidate timings of DISAGG_CUDA_GEMM_TUNE / _SWEEP when the plan is
 * new (never resid). */
static int matmul_acc(dcu_ctx *c, float *resid, float *tmp, const void *x, const void *w, int T,
                      int N, int K) {
    if (T <= 0) return 0;
    gemm_plan *p = plan_get(c, T, N, K, x, w, tmp);
    if (!p) return -EIO;
    float alpha = 1.0f, beta = 1.0f;
    cublasStatus_t s = cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, x, p->b, &beta, resid, p->c,
                                      resid, p->c, &p->algo, c->ws, c->ws_bytes, c->stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuda: cublasLtMatmul (beta 1) T=%d N=%d K=%d failed (status %d)\n", T, N,
                K, (int)s);
        return -EIO;
    }
    return 0;
}

/* y (T, N) bf16 = x (T, K) bf16 . w (N, K)^T bf16 through cuBLASLt, f32 accumulate, the
 * output rounded to bf16 by the GEMM's epilogue (the prefill gate|up: half the bytes of
 * the f32 output written and read back by SwiGLU).  Its own plan cache (c->plans16). */
static gemm_plan *plan16_get(dcu_ctx *c, int T, int N, int K, const void *x, const void *w,
                             void *y) {
    for (int i = 0; i < PLAN16_CACHE; i++)
        if (c->plans16[i].valid && c->plans16[i].T == T && c->plans16[i].N == N &&
            c->plans16[i].K == K)
            return &c->plans16[i];
    gemm_plan *p = &c->plans16[c->next_plan16];
    c->next_plan16 = (c->next_plan16 + 1) % PLAN16_CACHE;
    if (p->valid) {
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->c);
        p->valid = 0;
    }
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    if (cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS)
        return NULL;
    cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, K, N, K);
    cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, K, T, K);
    cublasLtMatrixLayoutCreate(&p->c, CUDA_R_16BF, N, T, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                         &c->ws_bytes, sizeof c->ws_bytes);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    if (T >= PF_GEMM_MIN_T && pf_pick(c, p, pref, x, w, y, T, N, K, 1, &res.algo) == 0) {
        cublasLtMatmulPreferenceDestroy(pref);
        p->algo = res.algo;
        p->T = T, p->N = N, p->K = K, p->valid = 1;
        return p;
    }
    cublasStatus_t s =
        cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
        fprintf(stderr,
                "cuda: cuBLASLt has no bf16-output GEMM for T=%d N=%d K=%d (status %d)\n", T, N,
                K, (int)s);
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->c);
        return NULL;
    }
    p->algo = res.algo;
    p->T = T, p->N = N, p->K = K, p->valid = 1;
    return p;
}

static int matmul_bf16out(dcu_ctx *c, bf16 *y, const void *x, const void *w, int T, int N,
                          int K) {
    if (T <= 0) return 0;
    gemm_plan *p = plan16_get(c, T, N, K, x, w, y);
    if (!p) return -EIO;
    float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t s = cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, x, p->b, &beta, y, p->c, y,
                                      p->c, &p->algo, c->ws, c->ws_bytes, c->stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuda: cublasLtMatmul (bf16 out) T=%d N=%d K=%d failed (status %d)\n", T,
                N, K, (int)s);
        return -EIO;
    }
    return 0;
}

/* ---- ceilings ------------------------------------------------------------------- */

__global__ void k_fill_rand(bf16 *p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u ^ seed;
        x ^= x >> 13;
        x *= 0x5bd1e995u;
        x ^= x >> 15;
        p[i] = __float2bfloat16(((x & 0xffff) / 65536.0f - 0.5f) * 0.1f);
    }
}

static int measure(dcu_ctx *c, double *copy_gbs, double *gemm_tflops, int M, int N, int K) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    int rc = 0;
    /* copy: 2 GiB buffer, D2D, bytes read + written */
    size_t bytes = (size_t)2 << 30;
    void *a = NULL, *b = NULL;
    if (copy_gbs) {
        *copy_gbs = 0;
        if (cudaMalloc(&a, bytes) == cudaSuccess && cudaMalloc(&b, bytes) == cudaSuccess) {
            cudaMemsetAsync(a, 1, bytes, c->stream);
            for (int i = 0; i < 3; i++)
                cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, c->stream);
            cudaEventRecord(e0, c->stream);
            int reps = 10;
            for (int i = 0; i < reps; i++)
                cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, c->stream);
            cudaEventRecord(e1, c->stream);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            *copy_gbs = 2.0 * bytes * reps / (ms / 1e3) / 1e9;
        } else {
            cudaGetLastError();
            rc = -ENOMEM;
        }
        cudaFree(a);
        cudaFree(b);
    }
    if (gemm_tflops) {
        *gemm_tflops = 0;
        bf16 *x = NULL, *w = NULL;
        float *y = NULL;
        if (cudaMalloc((void **)&x, (size_t)M * K * 2) == cudaSuccess &&
            cudaMalloc((void **)&w, (size_t)N * K * 2) == cudaSuccess &&
            cudaMalloc((void **)&y, (size_t)M * N * 4) == cudaSuccess) {
            k_fill_rand<<<1024, 256, 0, c->stream>>>(x, (size_t)M * K, 1);
            k_fill_rand<<<1024, 256, 0, c->stream>>>(w, (size_t)N * K, 2);
            for (int i = 0; i < 3 && !rc; i++)
                rc = matmul(c, y, x, w, NULL, M, N, K);
            cudaEventRecord(e0, c->stream);
            int reps = 10;
            for (int i = 0; i < reps && !rc; i++)
                rc = matmul(c, y, x, w, NULL, M, N, K);
            cudaEventRecord(e1, c->stream);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            if (!rc) *gemm_tflops = 2.0 * M * N * K * reps / (ms / 1e3) / 1e12;
        } else {
            cudaGetLastError();
            rc = -ENOMEM;
        }
        cudaFree(x);
        cudaFree(w);
        cudaFree(y);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return rc;
}

/* ---- kernels/backend.h ------------------------------------------------------------- */

#include "kernels/cuda/cuda_backend.cuh"

