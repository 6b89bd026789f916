/*
 * backend — the compute device behind the model, in the spirit of ggml-backend: an opaque
 * device handle, buffers in the device's memory, in-order streams of operations, and the
 * operations the Qwen2 forward needs.  model/decoder.c calls only this header; the CPU
 * backend (kernels/cpu/cpu_backend.c) is the original CPU code behind it, the CUDA backend
 * (kernels/cuda/, loaded as the module libdisagg_cuda.so so the binary needs no CUDA
 * library until --device cuda) implements the same contract in HBM.
 *
 * Memory.  Every pointer an operation takes is a *device address*: a pointer returned by
 * backend_buffer_ptr() plus a byte offset (char arithmetic on it is fine; it must not be
 * dereferenced on the host unless backend_buffer_is_host() says so).  On the CPU backend
 * device addresses are ordinary host pointers.  Host data moves in and out only through
 * backend_upload / backend_download (or lives in a host-addressable buffer).  Small
 * per-call metadata (token ids, positions, block tables) is passed as *host* arrays in a
 * backend_batch (backend_plan), which the backend copies to where its kernels need it.
 *
 * Layouts.  All tensors are dense and row-major: "(T, N)" means T rows of N contiguous
 * elements, element (t, n) at index t * N + n.  Activations of T tokens are (T, width).
 * A weight matrix "(N, K)" is stored as the checkpoint stores it (out_features rows of
 * in_features), and a matmul computes y = x · w^T.  Norm weights and biases are always
 * f32 vectors on the device.
 *
 * Dtypes.  Every pointer argument comes with its dtype (or is documented as f32).  The
 * CPU backend computes in f32: activations, logits are f32, KV f32, bf16 or FP8 e4m3 (weights
 * f32, f16 or bf16); it returns -ENOTSUP for other activation dtypes.  The CUDA backend keeps weights
 * and KV in bf16 (or KV in f32) and chooses its activation dtype, which the model reads
 * from backend_act_dtype().  Logits are always f32.
 *
 * The KV region.  One buffer of n_blocks blocks, block-major as DESIGN.md "The KV region"
 * says: block b occupies [base + b * block_bytes, base + (b + 1) * block_bytes) and holds,
 * for block_size tokens, every layer's K and V:
 *   block (n_layers, 2 [0 = K, 1 = V], block_size, n_kv_heads, head_dim) of kv dtype
 *   block_bytes = n_layers * 2 * block_size * n_kv_heads * head_dim * dtype size
 * so K (which = 0) or V (which = 1) of layer l, slot s (position p of a sequence lives in
 * block table[p / block_size], slot p % block_size), KV head h, element d is at element
 *   b * (block_bytes / size) + ((l * 2 + which) * block_size + s) * kv_dim + h * head_dim + d
 * with kv_dim = n_kv_heads * head_dim.  The same layout in device memory on every backend;
 * backend_location() says where it lives, for transfer_register().
 *
 * Streams and errors.  Operations are enqueued on a backend_stream and run in order; the
 * CPU backend runs each one before returning, the CUDA backend may return before the work
 * is done.  backend_stream_sync() waits for everything enqueued and returns the first
 * device error.  backend_upload / backend_download / backend_copy are ordered on the
 * stream and complete before they return (host memory may be reused at once).  Every
 * function returns 0 or a negative errno: -EINVAL for bad arguments (logged by backend.c,
 * naming the operation and the value), -ENOTSUP for a dtype the backend lacks, -ENOMEM,
 * -EIO for a device failure (logged by the backend with the device's own message).
 *
 * Determinism.  Each backend computes every output element of an operation in one fixed
 * order that does not depend on the batch's other rows, the split into calls, or the
 * number of threads (the CPU backend's canonical dot, kernels/cpu/cpu_matmul.h), so a
 * sequence's logits do not depend on what else is batched with it.
 *
 * Threads.  A stream is used by one thread at a time; different streams of one backend
 * may be used concurrently (on the CPU backend, only when they run on different thread
 * pools).  Buffers may be freed from any thread once no enqueued work uses them.
 */
#ifndef DISAGG_KERNELS_BACKEND_H
#define DISAGG_KERNELS_BACKEND_H

#include <stddef.h>
#include <stdint.h>

typedef struct backend backend;               /* a device (opaque) */
typedef struct backend_buffer backend_buffer; /* memory on that device (opaque) */
typedef struct backend_stream backend_stream; /* an in-order queue of work (opaque) */

/* Element types; the values equal kernels/cpu cpu_dtype's.  BACKEND_F8E4M3 is OCP FP8 e4m3
 * ("float8_e4m3fn": 1 sign, 4 exponent, 3 mantissa bits, bias 7, no infinities, max 448), the
 * element of FP8 weights and of an FP8 KV cache; it always comes with scales (per tensor,
 * channel or block), which the operation that reads it is given beside it. */
typedef enum backend_dtype {
    BACKEND_F32 = 0,
    BACKEND_F16 = 1,
    BACKEND_BF16 = 2,
    BACKEND_F8E4M3 = 3
} backend_dtype;

size_t backend_dtype_size(backend_dtype dt);      /* 4, 2 or 1; 0 for an unknown value */
const char *backend_dtype_name(backend_dtype dt); /* "float32", "float16", "bfloat16", "float8_e4m3fn" */
/* "auto" (-> *out = -1), "float32"/"f32", "float16"/"f16"/"half", "bfloat16"/"bf16".
 * Returns 0, or -EINVAL for anything else (the caller words the error; accepted names are
 * BACKEND_DTYPE_NAMES). */
#define BACKEND_DTYPE_NAMES "auto, bfloat16, float16, float32"
int backend_dtype_parse(const char *s, int *out);
/* --kv-cache-dtype: backend_dtype_parse's names plus vLLM's "fp8" and "fp8_e4m3" (and
 * "float8_e4m3fn") for BACKEND_F8E4M3.  Returns 0 or -EINVAL (fp8_e5m2, int8, ...: the caller
 * words the error with BACKEND_KV_DTYPE_NAMES). */
#define BACKEND_KV_DTYPE_NAMES "auto, bfloat16, float16, float32, fp8, fp8_e4m3"
int backend_kv_dtype_parse(const char *s, int *out);

/* ---- devices ---------------------------------------------------------------------- */

typedef struct backend_options {
    int n_threads;  /* CPU: compute threads of the backend's own pool (0 = one per CPU) */
    int progress;   /* show weight-upload progress on a tty */
    int device_ord; /* filled by backend_open from "cuda:N" (0 for "cuda"); ignored by cpu */
    /* --batch-invariant: a row's results must not depend on the rest of the batch, the GEMM's
     * row count or the prompt's chunking (CUDA: kernels/cuda/cuda_invariant.h; the CPU
     * backend always is, and ignores it) */
    int batch_invariant;
} backend_options;

void backend_options_init(backend_options *o); /* zeros: all CPUs, no progress, device 0 */

/* device: "auto" (cuda when the CUDA module loads and a GPU is visible, else cpu), "cpu",
 * "cpu:0", "cuda", "cuda:N".  opts may be NULL (defaults).  On failure *out is NULL and
 * err says what was wrong and what is accepted; "cuda" without the module fails with
 * -ENOENT ("built without CUDA" / "module libdisagg_cuda.so not found: <dlerror>").
 * The module is looked up as $DISAGG_CUDA_MODULE when set, else libdisagg_cuda.so in the
 * executable's directory, else by the dynamic linker's search path.  "auto" falls back to
 * the CPU (logged once at info level, with the reason) when the module or a GPU is missing. */
#define BACKEND_DEVICE_NAMES "auto, cpu, cuda, cuda:N"
int backend_open(const char *device, const backend_options *opts, backend **out, char *err,
                 size_t errlen);
void backend_close(backend *be); /* NULL is fine; every buffer and stream must be freed first */

/* The process-wide CPU backend with no threads of its own (streams bring a pool, see
 * kernels/cpu/cpu_backend.h).  Never freed; backend_close() on it does nothing. */
backend *backend_cpu_default(void);

const char *backend_name(const backend *be);     /* "cpu", "cuda:0 (NVIDIA H200)", ... */
const char *backend_location(const backend *be); /* "cpu:0", "cuda:0": transfer_register() */
int backend_is_cpu(const backend *be);           /* 1 for the CPU backend */
/* 1 when backend_attention honours backend_kv.window (the CPU and CUDA backends) */
int backend_attention_window(const backend *be);
/* Which kernels compute: the CPU's ISA ("avx2", "avx512f", ... chosen by cpuid or
 * DISAGG_CPU_ISA) or "cuda".  Results are bit-exact only between equal names. */
const char *backend_kernels_name(const backend *be);
/* A line for the start-up log: the CPU's ISA choice and why (cpuid, the override), or
 * the backend's name. */
const char *backend_kernels_describe(const backend *be);
/* n elements of a host row of dtype dt (f32, f16, bf16) widened to f32 (host memory). */
void backend_row_to_f32(float *out, const void *row, backend_dtype dt, int n);
backend_dtype backend_act_dtype(const backend *be); /* activations the model should use */
/* The dtype the model should give matmuls their inputs in (normed rows, attention output,
 * SwiGLU output: made by backend_add_rmsnorm, backend_attention_to, backend_gate_up):
 * the activation dtype on the CPU, bf16 on CUDA (no conversion pass before each GEMM). */
backend_dtype backend_mm_dtype(const backend *be);
/* 1 when the backend computes q|k|v and gate|up as one GEMM each: the model then loads
 * them concatenated (backend_weights_load_cat) and gives backend_qkv / backend_gate_up the
 * concatenated matrices.  0 on the CPU (its weights stay in the safetensors mapping). */
int backend_wants_cat(const backend *be);
backend_dtype backend_kv_dtype_default(const backend *be); /* "auto" KV dtype: f32 cpu, bf16 cuda */
int backend_kv_dtype_ok(const backend *be, backend_dtype dt); /* 1 if KV of dt is supported */
int backend_block_size_default(const backend *be); /* "auto" block size: 128 cpu, 16 cuda */
/* The address of symbol `name` in the backend's loaded module (libdisagg_cuda.so), NULL on
 * the CPU backend or when the module has none: how a layer above finds what the module
 * offers beside the backend, e.g. the transfer engine's device-memory ops
 * (kernels/cuda/cuda_transfer.h DCU_TRANSFER_SYMBOL) for the KV region. */
void *backend_module_symbol(const backend *be, const char *name);
/* Device memory: *free_b bytes free now, *total_b in all (CPU: available and physical RAM). */
int backend_memory(const backend *be, size_t *free_b, size_t *total_b);
/* The transfer engine's device-memory ops (include/disagg/transfer.h) for device memory of
 * be's GPU `device` (the CUDA module's table), for a KV region the transfer engine moves.
 * 0, or -EINVAL with err saying why (the CPU backend: host memory needs none; a module
 * without the table or of another ABI). */
struct transfer_device_ops;
int backend_transfer_device_ops(const backend *be, int device, struct transfer_device_ops *out,
                                char *err, size_t errlen);

/* ---- buffers ---------------------------------------------------------------------- */

#define BACKEND_MOE_MAX_EXPERTS 512 /* experts of one MoE layer (backend_moe_route) */

#define BACKEND_BUF_ZERO 0x1 /* contents start zeroed */
/* The KV region: one large allocation registered for transfers (CPU: anonymous mapping,
 * reserved lazily, transparent huge pages; CUDA: one cudaMalloc).  Implies ZERO. */
#define BACKEND_BUF_KV 0x2
/* Host memory the device copies to and from at full speed (backend_upload/download): CUDA
 * page-locked (cudaHostAlloc, portable), the CPU backend plain memory.  The host reads and
 * writes it directly (backend_buffer_is_host is 1, ptr is a host address). */
#define BACKEND_BUF_HOST 0x4

/* Returns NULL on failure (logged with the size and the device's reason). */
backend_buffer *backend_buffer_alloc(backend *be, size_t bytes, int flags);
/* A matrix of weights (n elements of src_dtype at host address src, e.g. in the safetensors
 * mapping).  The backend stores it as it computes best and says how in *stored: the CPU
 * backend aliases src (zero copy: src must outlive the buffer) and keeps its dtype; CUDA
 * copies it to HBM as bf16 (f16/f32 converted).  NULL on failure (logged). */
backend_buffer *backend_weights_load(backend *be, const void *src, backend_dtype src_dtype,
                                     size_t n, backend_dtype *stored);
/* Several matrices of the same width as one buffer, rows of srcs[0] first (q|k|v, gate|up,
 * a layer's experts stacked): part i is ns[i] elements of src_dts[i] at host address srcs[i],
 * 1 <= n_parts <= BACKEND_WEIGHTS_CAT_MAX_PARTS.  Stored as backend_weights_load stores (one
 * dtype for all parts, in *stored).  NULL on failure (logged), or when the backend lacks it
 * (backend_wants_cat() is 0). */
#define BACKEND_WEIGHTS_CAT_MAX_PARTS (2 * BACKEND_MOE_MAX_EXPERTS)
backend_buffer *backend_weights_load_cat(backend *be, const void *const *srcs,
                                         const backend_dtype *src_dts, const size_t *ns,
                                         int n_parts, backend_dtype *stored);
void backend_buffer_free(backend_buffer *b);       /* NULL is fine */
void *backend_buffer_ptr(const backend_buffer *b); /* device address of byte 0 */
size_t backend_buffer_size(const backend_buffer *b);
int backend_buffer_is_host(const backend_buffer *b);          /* 1: the host may read/write ptr */
const char *backend_buffer_location(const backend_buffer *b); /* as backend_location */
backend *backend_buffer_backend(const backend_buffer *b);

/* ---- streams ---------------------------------------------------------------------- */

/* A stream on the backend's own resources (CPU: the backend's pool, or none for
 * backend_cpu_default(), which runs inline).  NULL on failure (logged). */
backend_stream *backend_stream_create(backend *be);
/* A stream whose work runs on n_threads host threads of its own (the CPU backend:
 * 1 = the calling thread alone, 0 = one per online CPU, N = N threads; freed with the
 * stream) instead of the backend's pool.  Backends without host compute threads (CUDA)
 * ignore n_threads: backend_stream_create().  NULL on failure (logged). */
backend_stream *backend_stream_create_threads(backend *be, int n_threads);
void backend_stream_free(backend_stream *st); /* syncs first; NULL is fine */
int backend_stream_sync(backend_stream *st);
backend *backend_stream_backend(const backend_stream *st);

/* Host <-> device copies of bytes at device address dev (see "Streams": they complete
 * before returning).  backend_copy: device to device, may overlap only if dst == src. */
int backend_upload(backend_stream *st, void *dev, const void *host, size_t bytes);
int backend_download(backend_stream *st, void *host, const void *dev, size_t bytes);
int backend_copy(backend_stream *st, void *dst, const void *src, size_t bytes);
int backend_memset_zero(backend_stream *st, void *dev, size_t bytes);
/* An upload that returns once it is enqueued (CUDA: one cudaMemcpyAsync on the stream,
 * ordered after the work enqueued before it and before the work enqueued after it): bytes
 * from offset `offset` of host buffer hb (made with BACKEND_BUF_HOST on the stream's
 * backend) to device address dev.  The host bytes must not change until the stream has
 * synced (backend_stream_sync, or a later backend_download, which syncs).  The CPU backend
 * copies at once.  Not while the stream records a graph (-EINVAL). */
int backend_upload_async(backend_stream *st, void *dev, const backend_buffer *hb, size_t offset,
                         size_t bytes);

/* ---- one forward's batch ------------------------------------------------------------ */

/* The tokens of one forward call: T new tokens of S sequences.  Tokens of a sequence are
 * contiguous and in position order; sequence s owns tokens [qo_indptr[s], qo_indptr[s+1])
 * at positions kv_len[s] - n_s .. kv_len[s] - 1 (n_s its token count), and its KV cache
 * after this call holds positions 0 .. kv_len[s] - 1 in the blocks
 * bt_indices[bt_indptr[s] .. bt_indptr[s+1]) (position p in entry p / block_size; at least
 * ceil(kv_len[s] / block_size) entries, each a block id < the region's n_blocks).  tok_seq
 * and tok_pos repeat that per token for kernels that want it flat.  All arrays are host
 * memory; backend_plan copies them (they may be reused once it returns).  out_rows names
 * the token rows backend_gather_rows collects (for logits), in the order given. */
typedef struct backend_batch {
    int n_tokens;              /* T >= 1 */
    int n_seqs;                /* S >= 1 */
    const int32_t *tokens;     /* (T) token ids, for backend_embed */
    const int32_t *tok_seq;    /* (T) sequence index of each token */
    const int32_t *tok_pos;    /* (T) absolute position of each token */
    const int32_t *qo_indptr;  /* (S + 1) token ranges: qo_indptr[0] = 0, [S] = T */
    const int32_t *kv_len;     /* (S) positions in the cache after this call */
    const int32_t *bt_indptr;  /* (S + 1) block-table ranges into bt_indices */
    const int32_t *bt_indices; /* (bt_indptr[S]) block ids */
    int n_out;                 /* rows for backend_gather_rows (0 = none) */
    const int32_t *out_rows;   /* (n_out) token indices in [0, T) */
} backend_batch;

/* Makes b the stream's current batch: the operations below that say "from the plan" use
 * it until the next backend_plan on the stream (which may come before the previous batch's
 * work has finished: the backend keeps what enqueued work needs).  Checks the arrays'
 * consistency (-EINVAL, logged with the value); any T is accepted, the backend grows its
 * copies as needed.  Block ids are the caller's to check against the region (the model
 * does, before planning); a backend need not. */
int backend_plan(backend_stream *st, const backend_batch *b);

/* ---- operations ----------------------------------------------------------------------- */

/* out (T, hidden) of out_dt: row t = row tokens[t] (from the plan) of table (vocab, hidden)
 * of table_dt, converted. */
int backend_embed(backend_stream *st, void *out, backend_dtype out_dt, const void *table,
                  backend_dtype table_dt, int hidden);

/* out (rows, n) of out_dt = w * (x / sqrt(mean(x^2) + eps)) row by row; x (rows, n) of x_dt,
 * w (n) f32.  out may equal x.  CPU: ss summed in order in f32, inv = 1 / sqrtf(ss / n +
 * eps), out = w * (x * inv). */
int backend_rmsnorm(backend_stream *st, void *out, backend_dtype out_dt, const void *x,
                    backend_dtype x_dt, const float *w, int rows, int n, float eps);

/* The scales of an FP8 (BACKEND_F8E4M3) weight matrix w (N, K): element (n, k) stands for
 *   e4m3_to_f32(w[n, k]) * s[(n / block_n) * ceil(K / block_k) + k / block_k]
 * so one f32 scale covers a block of block_n rows by block_k columns, the grid row-major and
 * the last block of a row or column partial when N or K is not a multiple:
 *   per tensor   block_n = N, block_k = K   (one scale)
 *   per channel  block_n = 1, block_k = K   (N scales: llm-compressor's FP8_DYNAMIC)
 *   128 x 128    block_n = block_k = 128    (weight_scale_inv of Qwen3-*-FP8, DeepSeek)
 * s is a device address (backend_weights_load_fp8 places it).  A zero-initialised
 * backend_wscale (s NULL) means "no scales": w is bf16/f16/f32 and the op ignores it.
 * twin: the backend's own companion of the matrix, as backend_weights_load_fp8 filled it
 * (CUDA: the same weights dequantized to bf16 for its prefill GEMMs), NULL on the CPU. */
typedef struct backend_wscale {
    const float *s;       /* f32 scales (device address), NULL: unscaled weights */
    int block_n, block_k; /* rows x columns of w that one scale covers (>= 1 each) */
    const void *twin;     /* backend-private companion (NULL: none) */
} backend_wscale;

/* n e4m3 bytes (host) widened to f32, exactly (a 256-entry table; NaN encodings 0x7f/0xff
 * give NaN). */
void backend_e4m3_to_f32(float *out, const uint8_t *src, size_t n);

/* An FP8 matrix (N, K) of e4m3 bytes at host src with host f32 scales laid out as
 * backend_wscale says (ceil(N / block_n) * ceil(K / block_k) of them).  The backend stores it
 * as it computes best, says how in *stored and fills *ws for the operations: the CPU
 * dequantizes to f32 (w * scale, rounded once: *stored F32, *ws zeroed; 4 bytes a weight),
 * CUDA keeps e4m3 and the scales in HBM (*stored F8E4M3, its decode GEMV reads those) and a
 * bf16 twin for prefill GEMMs (ws->twin).  The returned buffer holds all of it (ws points
 * into it); the host arrays may be freed once it returns.  NULL on failure (logged). */
backend_buffer *backend_weights_load_fp8(backend *be, const uint8_t *src, int N, int K,
                                         const float *scales, int block_n, int block_k,
                                         backend_dtype *stored, backend_wscale *ws);

/* y (T, N) of y_dt = x (T, K) of x_dt · w (N, K)^T of w_dt + bias (N, f32, or NULL).
 * Accumulates in f32.  y must not overlap x.  w_dt F8E4M3 needs w_scale (see above). */
typedef struct backend_matmul_op {
    void *y;            /* (T, N) out */
    backend_dtype y_dt; /* dtype of y (F32 for logits) */
    const void *x;      /* (T, K) in */
    backend_dtype x_dt; /* dtype of x */
    const void *w;      /* (N, K) weights */
    backend_dtype w_dt; /* dtype of w (as backend_weights_load stored it) */
    const float *bias;  /* (N) f32 or NULL */
    int T, N, K;        /* shapes, all >= 1 */
    backend_wscale w_scale; /* FP8 w: its scales; zero otherwise */
} backend_matmul_op;
#define BACKEND_MATMUL_MAX_OPS 8
/* n_ops (1 .. BACKEND_MATMUL_MAX_OPS) independent matmuls in one dispatch (q/k/v; gate/up);
 * each result equals its own single matmul. */
int backend_matmul(backend_stream *st, const backend_matmul_op *ops, int n_ops);

/* Rotate-half RoPE in place at each token's position (from the plan):
 *   q (T, n_q_heads, head_dim), k (T, n_k_heads, head_dim) of dt (k may be NULL);
 *   angle_i = pos * inv_freq[i], for i < head_dim / 2, v[i], v[i + half] <-
 *   v[i] cos - v[i + half] sin, v[i + half] cos + v[i] sin  (cosf / sinf of the f32 angle).
 * inv_freq: (head_dim / 2) f32 on the device.  head_dim even, <= 1024. */
int backend_rope(backend_stream *st, void *q, int n_q_heads, void *k, int n_k_heads,
                 backend_dtype dt, int head_dim, const float *inv_freq);

/* The KV region as the operations see it (layout in the header comment). */
typedef struct backend_kv {
    void *base;          /* device address of block 0 */
    backend_dtype dtype; /* element type of K and V */
    int n_blocks;        /* blocks in the region */
    int block_size;      /* tokens per block */
    int n_layers;        /* layers per block */
    int n_kv_heads;      /* KV heads */
    int head_dim;        /* elements per head */
    /* sliding-window attention (Mistral's sliding_window): a query at position p attends to
     * keys p - window + 1 .. p only; 0 = every key 0..p.  Only backend_attention reads it
     * (a backend without backend_attention_window returns -ENOTSUP for a nonzero window) */
    int window;
    /* FP8 KV (dtype BACKEND_F8E4M3): the per-tensor scales of each layer's K and V, *host*
     * arrays of n_layers floats (vLLM's k_scale / v_scale: from the checkpoint, else 1.0), or
     * NULL for all 1.0.  Written elements are e4m3(x / scale) -- round to nearest even,
     * saturated to +-448 --, read elements are e4m3 * scale.  The values are passed to the
     * kernels as arguments (a recorded graph keeps them: they never change for a region).
     * Ignored for other dtypes. */
    const float *k_scale, *v_scale;
} backend_kv;
size_t backend_kv_block_bytes(const backend_kv *kv);
/* the scale of layer's K (which 0) or V (1): 1.0 unless an FP8 region has one */
float backend_kv_scale(const backend_kv *kv, int layer, int which);

/* Writes K and V of every token (k, v: (T, n_kv_heads * head_dim) of dt) into layer's
 * slot of the token's position in its sequence's blocks (from the plan), converted to
 * kv->dtype. */
int backend_kv_write(backend_stream *st, const backend_kv *kv, int layer, const void *k,
                     const void *v, backend_dtype dt);

/* Paged causal attention with grouped-query heads, prefill and decode in one call:
 * for token t of sequence s at position p (from the plan) and query head h (KV head
 * h / (n_heads / n_kv_heads)):
 *   out[t, h] = sum_{j <= p} softmax_j(scale * q[t, h] . K[s, j, kvh]) V[s, j, kvh]
 * over positions 0..p of s (kv->window w > 0: p - w + 1..p) read through its block table --
 * the KV of earlier calls and of this call's tokens (written by backend_kv_write for this layer
 * before this call). q, out: (T, n_heads, head_dim) of dt; out must not overlap q.  n_heads a
 * multiple of kv->n_kv_heads, at most 64 query heads per KV head.  The backend picks its kernels
 * per sequence (e.g. a prefill kernel for sequences with many new tokens, a split-KV decode kernel
 * for one); the result is the same math either way.  CPU: scores in f32 in position order,
 * max-subtracted expf, sum in order, out = sum_j (e_j / sum) v_j in position order (fmaf per
 * element). */
int backend_attention(backend_stream *st, void *out, const void *q, backend_dtype dt,
                      const backend_kv *kv, int layer, int n_heads, float scale);

/* ---- fused operations ----------------------------------------------------------------
 * Each is defined by the plain operations it stands for (its "generic" form, which
 * backend.c runs on a backend that lacks it: the CPU backend, whose results are therefore
 * exactly those of the plain sequence); a backend may compute it in fewer passes (CUDA:
 * one GEMM over the concatenated weights and one kernel after it), same math, rounding of
 * its own dtypes. */

/* x (rows, n) of x_dt += add (rows, n) of x_dt (add NULL: nothing added), then out (rows,
 * n) of out_dt = rmsnorm(x) as backend_rmsnorm.  Generic: backend_add, backend_rmsnorm. */
int backend_add_rmsnorm(backend_stream *st, void *out, backend_dtype out_dt, void *x,
                        const void *add, backend_dtype x_dt, const float *w, int rows, int n,
                        float eps);

/* The attention block's input for the planned batch: q = rope(wq . x + bq) to `q`, and
 * k = rope(wk . x + bk), v = wv . x + bv written into `layer`'s KV slots (with q_norm /
 * k_norm: rope(norm(..)) per head).  Generic: backend_matmul of the three (into q, k, v),
 * [backend_rmsnorm per head of q and k,] backend_rope(q, k), backend_kv_write(k, v).  A
 * backend's fused form takes the q/k norms too (CUDA: kernels/cuda/cuda_qknorm.h). */
typedef struct backend_qkv_op {
    const void *x;             /* (T, hidden) normed input */
    backend_dtype x_dt;        /* its dtype */
    int T;                     /* the planned batch's tokens */
    int hidden, n_heads;       /* model width, query heads (KV heads, head_dim from kv) */
    const void *wq, *wk, *wv;  /* (n_heads * head_dim | kv_dim, hidden) */
    backend_dtype w_dt;        /* their dtype (as stored) */
    const float *bq, *bk, *bv; /* f32 biases or NULL */
    const void *wqkv;          /* the three as one matrix (backend_weights_load_cat) or NULL */
    const float *bqkv;         /* their biases as one f32 vector, or NULL (no biases) */
    void *q;                   /* out (T, n_heads * head_dim) of dt, RoPE applied */
    void *k, *v;               /* (T, kv_dim) of dt each: scratch of the generic form */
    backend_dtype dt;          /* dtype of q, k, v */
    const float *inv_freq;     /* RoPE, as backend_rope */
    const backend_kv *kv;      /* the KV region */
    int layer;                 /* the layer whose slots are written */
    /* Qwen3's per-head RMSNorm of q and k before RoPE (q_norm, k_norm: (head_dim) f32 each,
     * or both NULL): each head's head_dim elements normed as backend_rmsnorm with eps
     * qk_eps.  Generic form with them: the three matmuls, backend_rmsnorm of q as
     * (T * n_heads, head_dim) rows and of k as (T * n_kv_heads, head_dim), rope, kv_write */
    const float *q_norm, *k_norm;
    float qk_eps;
    /* FP8 weights (w_dt F8E4M3): the scales of wq, wk, wv and of wqkv; zero otherwise */
    backend_wscale sq, sk, sv, sqkv;
} backend_qkv_op;
int backend_qkv(backend_stream *st, const backend_qkv_op *op);

/* The MLP's first half: h (T, inter) of h_dt = silu(w_gate . x) * (w_up . x).  Generic:
 * backend_matmul of the two (into h and h2, y_dt h_dt), backend_swiglu(h, h2). */
typedef struct backend_mlp_op {
    const void *x;             /* (T, hidden) normed input */
    backend_dtype x_dt;        /* its dtype */
    int T, hidden, inter;      /* shapes */
    const void *w_gate, *w_up; /* (inter, hidden) each */
    backend_dtype w_dt;        /* their dtype */
    const void *w_gate_up;     /* the two as one (2 inter, hidden) matrix, or NULL */
    void *h;                   /* out (T, inter) */
    void *h2;                  /* (T, inter) scratch of the generic form (NULL with w_gate_up) */
    backend_dtype h_dt;        /* dtype of h and h2 */
    /* FP8 weights (w_dt F8E4M3): the scales of w_gate, w_up and w_gate_up; zero otherwise */
    backend_wscale s_gate, s_up, s_gate_up;
} backend_mlp_op;
int backend_gate_up(backend_stream *st, const backend_mlp_op *op);

/* The residual add folded into a GEMM: resid (T, N) of op->y_dt += op->x . op->w^T (+ op->bias),
 * op->y (T, N) of op->y_dt being the generic form's scratch, which must overlap neither resid
 * nor x.  Generic: backend_matmul(op) into op->y, then backend_add(resid, op->y) -- exactly
 * the sum the model's backend_add_rmsnorm(x += y) computes.  backend_residual_fused(st, T) is
 * 1 when the backend computes it in one pass for a batch of T tokens (CUDA's fast mode, T >= 64
 * by default: cuBLASLt's epilogue adds the f32 accumulator onto resid, beta = 1), else 0 (the
 * CPU; decode-sized T; --batch-invariant): the model uses the op only then and otherwise keeps
 * the add in backend_add_rmsnorm (one pass fewer where it is not fused). */
int backend_matmul_residual(backend_stream *st, const backend_matmul_op *op, void *resid);
int backend_residual_fused(backend_stream *st, int T);

/* backend_attention with the output in out_dt (the backend's mm dtype: the o_proj input).
 * Generic: backend_attention when out_dt == dt, else -ENOTSUP. */
int backend_attention_to(backend_stream *st, void *out, backend_dtype out_dt, const void *q,
                         backend_dtype dt, const backend_kv *kv, int layer, int n_heads,
                         float scale);

/* ---- mixture of experts (Qwen3-MoE, Mixtral) -------------------------------------------
 * A sparse MLP block: a router picks top_k of n_experts SwiGLU experts per token and the block's
 * output is their weighted sum.  Two operations: the routing (computed exactly as transformers
 * does, so the choices are part of the batch invariance), then the experts. */

/* ids (T, top_k) int32 and weights (T, top_k) f32, device memory, from logits (T, n_experts) f32
 * (the router's backend_matmul with y_dt F32): p = softmax(logits row) in f32 (max subtracted,
 * expf, summed in expert order, p_e = e_e / sum), the top_k largest p in descending order (ties:
 * the lower expert index first -- NOT always torch.topk's order: on the CPU torch orders equal
 * values its own way, e.g. top 2 of 8 equal logits is [6, 5] on torch 2.15, so on exact ties the
 * choice can differ from transformers'; tests/data/model/golden-moe-route.json), then with
 * norm (Qwen3-MoE's norm_topk_prob; Mixtral always) w_j = p_j / (p_0 + ... + p_{k-1}) summed
 * in that order, else w_j = p_j.
 * 1 <= top_k <= n_experts <= BACKEND_MOE_MAX_EXPERTS. */
int backend_moe_route(backend_stream *st, int32_t *ids, float *weights, const float *logits,
                      int T, int n_experts, int top_k, int norm);

/* out (T, hidden) of out_dt = sum over the token's chosen experts, in ascending expert index
 * (transformers' loop order), of weights[t, j] * down_e(silu(gate_e . x[t]) * (up_e . x[t])),
 * accumulated in f32 from zero.  Expert e's matrices: gate_e, up_e (inter, hidden), down_e
 * (hidden, inter), of w_dt.  They come either per expert (w_gate[e], w_up[e], w_down[e]: host
 * arrays of n_experts device addresses, e.g. the CPU's zero-copy mapping) or stacked
 * (w_gate_up_all: (n_experts, 2 * inter, hidden), expert e's gate rows then its up rows;
 * w_down_all: (n_experts, hidden, inter); both from backend_weights_load_cat in that part
 * order) when backend_wants_cat(); a backend uses the form it has.  ids / weights: from
 * backend_moe_route (device).  A token's result does not depend on the other tokens of the
 * batch (how many tokens each expert got, empty experts).  Generic form (backend.c, what the
 * CPU runs): per expert, gather its tokens, backend_gate_up and backend_matmul over them, then
 * per token the weighted sum in ascending expert order.  The backend allocates its own
 * scratch (grown as T grows, kept with the stream). */
typedef struct backend_moe_op {
    const void *x;            /* (T, hidden) normed input */
    backend_dtype x_dt;       /* its dtype */
    int T, hidden, inter;     /* tokens, model width, one expert's intermediate width */
    int n_experts, top_k;     /* as backend_moe_route */
    const int32_t *ids;       /* (T, top_k) device */
    const float *weights;     /* (T, top_k) device */
    const void *const *w_gate, *const *w_up, *const *w_down; /* per expert, or NULL */
    const void *w_gate_up_all, *w_down_all;                 /* stacked, or NULL */
    backend_dtype w_dt;       /* dtype of the expert weights (as stored) */
    void *out;                /* (T, hidden) */
    backend_dtype out_dt;     /* dtype of out */
} backend_moe_op;
int backend_moe(backend_stream *st, const backend_moe_op *op);
/* 1 when backend_moe_route / backend_moe run their generic forms on be: the backend has none
 * of its own, or the environment (read at each call) says DISAGG_MOE_GENERIC=1 (the
 * benchmarks' baseline; kernels/backend_moe.c).  On a device backend the generic forms read the routing
 * back to the host (synchronous copies), so a step using them cannot be recorded as a graph:
 * the model runs such steps eagerly. */
int backend_moe_generic(const backend *be);

/* Ceilings of the device for benchmarks: copy bandwidth (GB/s, bytes read + written, a
 * large device-to-device copy) and the bf16 GEMM rate (TFLOP/s) at M x N x K through the
 * backend's GEMM.  Either pointer may be NULL.  -ENOTSUP on the CPU. */
int backend_measure(backend *be, double *copy_gbs, double *gemm_tflops, int M, int N, int K);

/* g (rows, n) = silu(g) * u = g / (1 + exp(-g)) * u elementwise; u (rows, n); both of dt. */
int backend_swiglu(backend_stream *st, void *g, const void *u, backend_dtype dt, int rows, int n);

/* y (n) += x (n), elementwise, both of dt (the residual stream). */
int backend_add(backend_stream *st, void *y, const void *x, backend_dtype dt, size_t n);

/* out (n_out, width) row r = x (T, width) row out_rows[r] (from the plan); both of dt.
 * Logits are gather_rows -> rmsnorm -> matmul with y_dt F32. */
int backend_gather_rows(backend_stream *st, void *out, const void *x, backend_dtype dt, int width);

/* Sampling helpers on the device.  out (rows) int32 on the device: index of the largest
 * of each row of logits (rows, vocab) f32 (the first one on ties; NaN never wins). */
int backend_argmax(backend_stream *st, int32_t *out, const float *logits, int rows, int vocab);

/* Structured outputs' token masks (xgrammar's packed bitmask, as vLLM applies it on the
 * device): for k < n, row rows[k] of logits (any number of rows, each `width` f32) keeps its
 * value at token t only when t < vocab and bit t % 32 of word t / 32 of bitmask row k is
 * set; every other token of the row becomes -inf.  bitmask: (n, (vocab + 31) / 32) int32
 * (bit i of word w allows token 32 w + i); rows: (n) int32 row indices.  Both are device
 * addresses (upload them with backend_upload_async from a BACKEND_BUF_HOST buffer).  vocab
 * may be less than width: the ids from vocab to width (a logits row padded beyond the
 * tokenizer's vocabulary) are always disallowed, as are the bits of the last word beyond
 * vocab.  1 <= vocab <= width; a row may repeat (the same mask applied twice). */
int backend_token_bitmask(backend_stream *st, float *logits, int width, const int32_t *bitmask,
                          const int32_t *rows, int n, int vocab);

/* ---- recorded decode steps (CUDA graphs) ------------------------------------------------ */

/* A backend may record the operations of a decode step once and replay them (CUDA graphs,
 * bucketed by batch size as vLLM does).  The caller pads its batch to a bucket of T tokens,
 * one per sequence: a padding sequence has kv_len 0, its token tok_pos -1 and no blocks (its
 * row is computed but it writes no KV, attends to nothing and its logits are to be ignored).
 * backend_graph_plan is backend_plan for such a batch, with the metadata at fixed device
 * addresses of the graph (T, max_ctx, max_blocks): every kv_len <= max_ctx, every block
 * table <= max_blocks entries, n_out == T.  Then backend_graph_begin() returns 1 when that
 * graph is recorded (it is launched: the caller enqueues none of the step's operations and
 * does not call backend_graph_end), or 0: the caller enqueues the step's operations -- the
 * same sequence every time for one graph, no syncs, downloads or allocations -- and calls
 * backend_graph_end(st, ok) (ok = 0 after a failed operation: discards the recording).  The
 * first 0 for a graph runs the operations eagerly (a warm-up that grows the workspaces); the
 * second records and launches them.  Results equal the eager run of the same padded batch.
 * backend_graph_reset() drops every graph of the stream (call it when a buffer the recorded
 * operations use is freed or moved).  backend_graph_supported() is 0 on the CPU backend,
 * where the other functions return -ENOTSUP. */
int backend_graph_supported(const backend *be);
int backend_graph_plan(backend_stream *st, const backend_batch *b, int max_ctx, int max_blocks);
int backend_graph_begin(backend_stream *st);
int backend_graph_end(backend_stream *st, int ok);
void backend_graph_reset(backend_stream *st);
int backend_graph_count(const backend_stream *st); /* graphs recorded on st (tests, logs) */

/* ---- layer progress: how far a forward has written the KV --------------------------------
 *
 * A prefill's KV can leave the device layer by layer while the later layers are computed
 * (layer-wise P/D streaming, docs/connector.md).  A backend_layer_progress belongs to one
 * backend (backend_layer_progress_new attaches it; one per backend) and numbers forwards by
 * the caller's step counter: the engine says backend_layer_progress_begin(lp, step) before a
 * forward and backend_layer_progress_end(lp, step) after it has synced (or failed: the step is
 * over either way); the model calls backend_layer_mark(st, layer) after each layer's KV write
 * and attention, which records "layer written" at that point of the stream (the CUDA backend:
 * one cudaEvent per layer, recorded on the stream; the CPU backend runs each operation before
 * returning, so the mark itself completes it).  Any thread may then wait for a layer of a step
 * with backend_layer_wait.  A mark made while the stream records a graph is not kept (the
 * graph's replays do not record it): such a step's layers complete at its _end.  Without a
 * progress attached, backend_layer_mark does nothing. */
typedef struct backend_layer_progress backend_layer_progress;
/* NULL on failure (logged) or when be already has one. */
backend_layer_progress *backend_layer_progress_new(backend *be, int n_layers);
void backend_layer_progress_free(backend_layer_progress *lp); /* detaches it; NULL is fine */
void backend_layer_progress_begin(backend_layer_progress *lp, uint64_t step);
void backend_layer_progress_end(backend_layer_progress *lp, uint64_t step);
int backend_layer_mark(backend_stream *st, int layer);
/* 0 once layer `layer` of step `step` (and every earlier step) is written, -ETIMEDOUT when
 * timeout_ns passed first, -EIO on a device error, -EINVAL for a layer out of range. */
int backend_layer_wait(backend_layer_progress *lp, uint64_t step, int layer, uint64_t timeout_ns);
/* The step of the last _end (0: none yet). */
uint64_t backend_layer_progress_done(backend_layer_progress *lp);

#endif
