/*
 * cuda_module — the C ABI of the CUDA kernel module (libdisagg_cuda.so, built from
 * the .cu files of src/kernels/cuda when nvcc is found) and its loader.  The `disagg` binary never
 * links CUDA: cuda_module_load() dlopen()s the module only for `--device cuda`, so the
 * binary starts and serves on the CPU on a machine with no CUDA libraries at all.
 *
 * The module exports one symbol, disagg_cuda_api_v1(), returning a table of functions:
 * device probe, buffers, the forward's ops on device pointers (used by the parity test and
 * the kernel-backend interface) and a whole-model Qwen2 forward (bf16 weights in HBM,
 * GEMMs through cuBLASLt with f32 accumulation, paged KV in the block-major layout of
 * DESIGN.md, bf16 or f32).  Every function returns 0 or a negative errno value and, where
 * it takes err/errlen, writes one sentence saying what failed and what to do.
 *
 * Shapes (all row-major):
 *   activations x (T, n) f32; GEMM inputs bf16 (T, K); weights w (N, K) bf16 in HBM;
 *   KV region (n_blocks, n_layers, 2 [K, V], block_size, kv_dim) of kv_dtype — exactly
 *   the CPU engine's kv_store layout (model/qwen2.h), so P/D and the layout fingerprint
 *   agree given the same dtype.
 */
#ifndef DISAGG_KERNELS_CUDA_MODULE_H
#define DISAGG_KERNELS_CUDA_MODULE_H

#include <stddef.h>
#include <stdint.h>

#define DCU_ABI_VERSION 1
#define DCU_MODULE_NAME "libdisagg_cuda.so"

/* element types; numbering equals cpu_dtype (CPU_F32 0, CPU_F16 1, CPU_BF16 2) */
typedef enum dcu_dtype { DCU_F32 = 0, DCU_F16 = 1, DCU_BF16 = 2 } dcu_dtype;

typedef struct dcu_ctx dcu_ctx;     /* one device, one stream, one cuBLASLt handle */
typedef struct dcu_model dcu_model; /* weights in HBM + activation workspace */

typedef struct dcu_info {
    int device;             /* ordinal used */
    int n_devices;          /* visible devices (CUDA_VISIBLE_DEVICES applies) */
    char name[256];         /* e.g. "NVIDIA H200" */
    int cc_major, cc_minor; /* compute capability */
    int n_sm;               /* multiprocessors */
    size_t total_mem;       /* bytes of device memory */
    size_t free_mem;        /* bytes free now */
    int driver_version;     /* cudaDriverGetVersion: CUDA version the driver supports */
    int runtime_version;    /* CUDART_VERSION the module was built with */
} dcu_info;

/* A host matrix to upload: (rows, cols) of dtype in host memory (e.g. the safetensors
 * mapping); uploaded as bf16 (f16/f32 converted). */
typedef struct dcu_host_mat {
    const void *data;
    int dtype; /* dcu_dtype */
    int rows, cols;
} dcu_host_mat;

typedef struct dcu_host_layer {
    const float *attn_norm;    /* (hidden) */
    dcu_host_mat wq, wk, wv;   /* (hidden|kv_dim, hidden) */
    const float *bq, *bk, *bv; /* (hidden), (kv_dim), (kv_dim); may be NULL (zero) */
    dcu_host_mat wo;           /* (hidden, hidden) */
    const float *mlp_norm;     /* (hidden) */
    dcu_host_mat w_gate, w_up; /* (inter, hidden) */
    dcu_host_mat w_down;       /* (hidden, inter) */
} dcu_host_layer;

typedef struct dcu_model_desc {
    int vocab, hidden, n_layers, n_heads, n_kv_heads, head_dim, inter;
    float rms_eps;
    const float *rope_inv_freq; /* (head_dim / 2), as the CPU computes it */
    dcu_host_mat embed;         /* (vocab, hidden) */
    dcu_host_mat lm_head;       /* (vocab, hidden); same data as embed when tied */
    int tied;                   /* lm_head shares embed's device copy */
    const float *final_norm;    /* (hidden) */
    const dcu_host_layer *layers;
    int max_tokens; /* tokens per forward call (activation workspace) */
    int max_seqs;   /* sequences per forward call */
    int max_blocks; /* block-table entries per sequence */
    int progress;   /* 1: upload progress on stderr (a terminal) */
} dcu_model_desc;

typedef struct dcu_kv {
    void *base; /* device pointer: (n_blocks, n_layers, 2, block_size, kv_dim) */
    int dtype;  /* DCU_BF16 or DCU_F32 */
    int n_blocks, block_size, n_layers, kv_dim;
} dcu_kv;

/* One forward call, host arrays (copied to the device in one transfer). */
typedef struct dcu_batch {
    int n_tokens;                /* T */
    const int32_t *tokens;       /* (T) */
    const int32_t *pos;          /* (T) position of each token */
    const int32_t *seq;          /* (T) sequence index of each token */
    int n_seqs;                  /* sequences */
    const int32_t *block_tables; /* (n_seqs, bt_stride) */
    int bt_stride;               /* entries per row (<= max_blocks) */
    int n_out;                   /* rows whose logits are wanted */
    const int32_t *out_rows;     /* (n_out) token indices */
    float *logits;               /* host out (n_out, vocab) f32, or NULL */
    int32_t *argmax;             /* host out (n_out) greedy ids (lowest id on ties), or NULL */
} dcu_batch;

typedef struct dcu_api {
    int abi;                /* DCU_ABI_VERSION */
    int build_cuda_version; /* CUDART_VERSION at build time, e.g. 13000 */
    /* Driver / device check without keeping anything; fills info when it succeeds. */
    int (*probe)(int device, dcu_info *info, char *err, size_t errlen);
    dcu_ctx *(*ctx_create)(int device, char *err, size_t errlen);
    void (*ctx_free)(dcu_ctx *c);
    int (*ctx_info)(dcu_ctx *c, dcu_info *info);
    int (*sync)(dcu_ctx *c, char *err, size_t errlen);
    /* device buffers */
    void *(*alloc)(dcu_ctx *c, size_t bytes); /* NULL when out of device memory */
    void (*free)(dcu_ctx *c, void *p);
    int (*upload)(dcu_ctx *c, void *dst, const void *src, size_t bytes);   /* synchronous */
    int (*download)(dcu_ctx *c, void *dst, const void *src, size_t bytes); /* synchronous */
    int (*memset0)(dcu_ctx *c, void *dst, size_t bytes);
    int (*copy_d2d)(dcu_ctx *c, void *dst, const void *src, size_t bytes);
    /* ops on device pointers (stream-ordered; sync to observe) */
    int (*to_bf16)(dcu_ctx *c, void *dst, const float *src, size_t n);
    int (*matmul)(dcu_ctx *c, float *y, const void *x_bf16, const void *w_bf16, const float *bias,
                  int T, int N, int K); /* y (T,N) = x (T,K) w (N,K)^T + bias */
    int (*rmsnorm)(dcu_ctx *c, void *out, int out_dtype, float *x, const float *add, const float *w,
                   const int32_t *rows, int n_rows, int n, float eps,
                   int write_back); /* row r: v = x[rows?rows[r]:r] (+ add[..]); write_back:
                                       x = v; out[r] = w * v / rms(v) */
    int (*rope)(dcu_ctx *c, float *x, int row_stride, const int32_t *pos, const float *inv_freq,
                int T, int n_heads, int head_dim); /* rotate-half */
    int (*swiglu)(dcu_ctx *c, void *out, int out_dtype, const float *gate_up, int T,
                  int inter); /* out (T, I) = silu(gu[:, :I]) * gu[:, I:] */
    int (*add)(dcu_ctx *c, float *x, const float *y, size_t n);
    int (*embed)(dcu_ctx *c, float *x, const void *table_bf16, const int32_t *tokens, int T,
                 int hidden);
    int (*kv_write)(dcu_ctx *c, const dcu_kv *kv, int layer, const float *k, const float *v,
                    int row_stride, const int32_t *pos, const int32_t *seq,
                    const int32_t *block_tables, int bt_stride, int T);
    /* out (T, n_heads*head_dim) bf16|f32 = causal GQA attention of q (T, n_heads*head_dim)
     * f32 over keys 0..pos[t] of sequence seq[t] in kv, layer `layer`; max_ctx: the largest
     * pos + 1 in the batch (sizes the split over KV blocks). */
    int (*attention)(dcu_ctx *c, void *out, int out_dtype, const float *q, const dcu_kv *kv,
                     int layer, const int32_t *pos, const int32_t *seq, const int32_t *block_tables,
                     int bt_stride, int T, int n_heads, int n_kv_heads, int head_dim, int max_ctx);
    int (*argmax)(dcu_ctx *c, int32_t *out, const float *logits, int rows, int vocab);
    /* whole model */
    dcu_model *(*model_create)(dcu_ctx *c, const dcu_model_desc *d, char *err, size_t errlen);
    void (*model_free)(dcu_model *m);
    size_t (*model_bytes)(const dcu_model *m); /* weights + workspace in HBM */
    int (*forward)(dcu_model *m, const dcu_kv *kv, const dcu_batch *b, char *err, size_t errlen);
    /* ceilings: device-to-device copy GB/s (bytes read + written), bf16 GEMM TFLOP/s */
    int (*measure)(dcu_ctx *c, double *copy_gbs, double *gemm_tflops, int M, int N, int K);
} dcu_api;

typedef const dcu_api *(*dcu_api_fn)(void);

/* ---- loader (host C, no CUDA dependency) ---------------------------------- */

/* Loads the module: $DISAGG_CUDA_MODULE if set, else libdisagg_cuda.so beside the running
 * executable, else the dynamic loader's search path.  On failure err says what is missing
 * (the module, a CUDA library it needs, the right ABI) and returns NULL.  Loaded once. */
const dcu_api *cuda_module_load(char *err, size_t errlen);

/* True when this binary's build produced the CUDA module (nvcc was found). */
int cuda_module_built(void);

/* Loads the module and checks driver and device: on failure one sentence naming what is
 * missing (module, libcuda/driver, a driver older than the build's CUDA major with both
 * versions, no visible GPU, device ordinal out of range, compute capability below 9.0). */
const dcu_api *cuda_open(int device, dcu_info *info, char *err, size_t errlen);

#endif
