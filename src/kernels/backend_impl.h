/*
 * backend_impl — what a backend implements: the function table behind kernels/backend.h
 * and the structs its opaque handles point to.  Only backends (kernels/cpu/cpu_backend.c,
 * kernels/cuda/) and the registry (kernels/backend.c) include this; everything else uses
 * backend.h.  backend.c checks the public functions' arguments (null pointers, sizes,
 * dtypes it can name) before calling the table, so implementations may assume them;
 * dtype support is the implementation's to check (-ENOTSUP).
 *
 * A module (libdisagg_cuda.so) exports one C symbol, BACKEND_MODULE_OPEN_SYMBOL, of type
 * backend_module_open_fn; backend_open("cuda[:N]") dlopen()s the module and calls it with
 * BACKEND_ABI_VERSION, which the module compares with the version it was built with
 * (mismatch: -EPROTO and an error naming both).
 */
#ifndef DISAGG_KERNELS_BACKEND_IMPL_H
#define DISAGG_KERNELS_BACKEND_IMPL_H

#include "kernels/backend.h"

/* Bump on any change to backend.h's types or this file's structs. */
#define BACKEND_ABI_VERSION 9

typedef struct backend_iface {
    /* device */
    void (*free)(backend *be); /* frees be->ctx and be itself */
    int (*memory)(const backend *be, size_t *free_b, size_t *total_b);
    /* buffers: fill b->ptr, b->size, b->is_host, b->impl; return 0 or -errno (logged) */
    int (*buffer_alloc)(backend *be, backend_buffer *b, size_t bytes, int flags);
    int (*weights_load)(backend *be, backend_buffer *b, const void *src, backend_dtype src_dt,
                        size_t n, backend_dtype *stored);
    void (*buffer_free)(backend *be, backend_buffer *b); /* releases b->impl / b->ptr only */
    /* streams: fill st->impl */
    int (*stream_create)(backend *be, backend_stream *st);
    void (*stream_free)(backend_stream *st); /* releases st->impl only (synced before) */
    int (*stream_sync)(backend_stream *st);
    int (*upload)(backend_stream *st, void *dev, const void *host, size_t bytes);
    int (*download)(backend_stream *st, void *host, const void *dev, size_t bytes);
    int (*copy)(backend_stream *st, void *dst, const void *src, size_t bytes);
    int (*memset_zero)(backend_stream *st, void *dev, size_t bytes);
    int (*plan)(backend_stream *st, const backend_batch *b); /* b already checked */
    /* operations, as in backend.h */
    int (*embed)(backend_stream *st, void *out, backend_dtype out_dt, const void *table,
                 backend_dtype table_dt, int hidden);
    int (*rmsnorm)(backend_stream *st, void *out, backend_dtype out_dt, const void *x,
                   backend_dtype x_dt, const float *w, int rows, int n, float eps);
    int (*matmul)(backend_stream *st, const backend_matmul_op *ops, int n_ops);
    int (*rope)(backend_stream *st, void *q, int n_q_heads, void *k, int n_k_heads,
                backend_dtype dt, int head_dim, const float *inv_freq);
    int (*kv_write)(backend_stream *st, const backend_kv *kv, int layer, const void *k,
                    const void *v, backend_dtype dt);
    int (*attention)(backend_stream *st, void *out, const void *q, backend_dtype dt,
                     const backend_kv *kv, int layer, int n_heads, float scale);
    int (*swiglu)(backend_stream *st, void *g, const void *u, backend_dtype dt, int rows, int n);
    int (*add)(backend_stream *st, void *y, const void *x, backend_dtype dt, size_t n);
    int (*gather_rows)(backend_stream *st, void *out, const void *x, backend_dtype dt, int width);
    int (*argmax)(backend_stream *st, int32_t *out, const float *logits, int rows, int vocab);
    /* recorded decode steps (optional: NULL on a backend without them) */
    int (*graph_plan)(backend_stream *st, const backend_batch *b, int max_ctx, int max_blocks);
    int (*graph_begin)(backend_stream *st);
    int (*graph_end)(backend_stream *st, int ok);
    void (*graph_reset)(backend_stream *st);
    int (*graph_count)(const backend_stream *st);
    /* fused operations and extras (optional: NULL runs the generic form in backend.c) */
    int (*weights_load_cat)(backend *be, backend_buffer *b, const void *const *srcs,
                            const backend_dtype *src_dts, const size_t *ns, int n_parts,
                            backend_dtype *stored);
    int (*add_rmsnorm)(backend_stream *st, void *out, backend_dtype out_dt, void *x,
                       const void *add, backend_dtype x_dt, const float *w, int rows, int n,
                       float eps);
    int (*qkv)(backend_stream *st, const backend_qkv_op *op);     /* op->wqkv != NULL */
    int (*gate_up)(backend_stream *st, const backend_mlp_op *op); /* op->w_gate_up != NULL */
    int (*attention_to)(backend_stream *st, void *out, backend_dtype out_dt, const void *q,
                        backend_dtype dt, const backend_kv *kv, int layer, int n_heads,
                        float scale);
    int (*measure)(backend *be, double *copy_gbs, double *gemm_tflops, int M, int N, int K);
    int (*matmul_residual)(backend_stream *st, const backend_matmul_op *op, void *resid);
    int (*residual_fused)(backend_stream *st, int T); /* NULL: 0 */
    /* mixture of experts, as backend.h (optional: NULL runs the generic form of
     * kernels/backend_moe.c, as DISAGG_MOE_GENERIC=1 does) */
    int (*moe_route)(backend_stream *st, int32_t *ids, float *weights, const float *logits, int T,
                     int n_experts, int top_k, int norm);
    int (*moe)(backend_stream *st, const backend_moe_op *op);
    /* FP8 weights (optional: NULL dequantizes to an f32 buffer in backend.c, the CPU's way) */
    int (*weights_load_fp8)(backend *be, backend_buffer *b, const uint8_t *src, int N, int K,
                            const float *scales, int block_n, int block_k, backend_dtype *stored,
                            backend_wscale *ws);
    /* layer-progress events (optional: NULL where an operation is done when it returns, the
     * CPU).  event_record returns 1 when it recorded nothing (the stream records a graph);
     * event_query 1 done, 0 pending, -EIO. */
    int (*event_new)(backend *be, void **ev);
    void (*event_free)(backend *be, void *ev);
    int (*event_record)(backend_stream *st, void *ev);
    int (*event_query)(backend *be, void *ev);
    /* structured outputs: backend_upload_async (hb checked: a host buffer of the stream's
     * backend, the range inside it) and backend_token_bitmask (arguments checked) */
    int (*upload_async)(backend_stream *st, void *dev, const void *host, size_t bytes);
    int (*token_bitmask)(backend_stream *st, float *logits, int width, const int32_t *bitmask,
                         const int32_t *rows, int n, int vocab);
} backend_iface;

struct backend {
    const backend_iface *iface; /* the implementation */
    void *ctx;                  /* the implementation's device state */
    char name[96];              /* backend_name(): "cpu", "cuda:0 (NVIDIA H200)" */
    char location[32];          /* backend_location(): "cpu:0", "cuda:0" */
    int is_cpu;                 /* backend_is_cpu() */
    int attention_window;       /* backend_attention_window(): backend_kv.window honoured */
    backend_dtype act_dtype;    /* backend_act_dtype() */
    backend_dtype mm_dtype;     /* backend_mm_dtype() (0 = F32) */
    backend_dtype kv_dtype;     /* backend_kv_dtype_default() */
    unsigned kv_dtypes;         /* bit (1 << dtype) per KV dtype supported */
    int is_static;              /* 1: backend_close() does nothing (backend_cpu_default) */
    void *module;               /* dlopen handle of the module (closed by backend_close) */
    struct backend_layer_progress *layer_progress; /* backend_layer_progress_new, or NULL */
};

struct backend_buffer {
    backend *be; /* owner */
    void *ptr;   /* device address of byte 0 */
    size_t size; /* bytes */
    int is_host; /* the host may dereference ptr */
    int flags;   /* BACKEND_BUF_* it was made with */
    void *impl;  /* the implementation's per-buffer state */
};

struct backend_stream {
    backend *be;                    /* owner */
    void *impl;                     /* the implementation's per-stream state */
    struct backend_moe_scratch *moe; /* the generic MoE's scratch (kernels/backend_moe.c) */
};

/* Frees st->moe (backend_stream_free calls it). */
void backend_moe_scratch_free(backend_stream *st);

/* The module entry point: opens device ordinal opts->device_ord.  Fills a malloc'ed
 * *out (iface, ctx, name, location, dtypes; module is set by the caller) or returns
 * -errno with err filled (no GPU visible, driver too old: both versions, out of memory). */
#define BACKEND_MODULE_OPEN_SYMBOL "disagg_backend_module_open"
#define BACKEND_MODULE_NAME        "libdisagg_cuda.so"

/* dlopen()s the CUDA module: $DISAGG_CUDA_MODULE, else next to the executable, else the
 * linker's search path.  NULL with why ("<name> not found: <dlerror>") when it is missing. */
void *backend_module_dlopen(char *why, size_t cap);
/* The address of the module's exported `symbol` (another table's getter, beside the
 * backend's: kernels/cuda/cuda_loader.c), for a process that may have no backend open.  The
 * module is opened as backend_open opens it (backend_module_dlopen) and stays loaded for the
 * life of the process.  NULL with err saying why: the module missing ("the CUDA module:
 * <why> (set DISAGG_CUDA_MODULE to its path)"), or the symbol (what: the table's name, e.g.
 * "transfer table"; a module of another build). */
void *backend_module_entry(const char *symbol, const char *what, char *err, size_t errlen);
typedef int (*backend_module_open_fn)(int abi_version, const backend_options *opts, backend **out,
                                      char *err, size_t errlen);

/* The CPU backend's opener (kernels/cpu/cpu_backend.c). */
int cpu_backend_open(const backend_options *opts, backend **out, char *err, size_t errlen);

#endif
