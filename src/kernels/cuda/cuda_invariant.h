/*
 * cuda_invariant — the CUDA backend's batch-invariant mode (`--batch-invariant`):
 * kernels whose result for one token does not depend on what else is in the batch, how
 * many rows a GEMM has, or how the prompt was chunked.  Built into libdisagg_cuda.so beside
 * the fast mode's op families (cuda_common.cuh; cuda_backend.cu calls these when a
 * backend was opened with backend_options.batch_invariant).
 *
 * GEMM.  Per (N, K) shape, a reference cuBLASLt algorithm chosen once per process from the
 * heuristic at a fixed reference row count (64, not the call's M), checked with
 * cublasLtMatmulAlgoCheck: a fixed tile, split-K count and reduction scheme (never in place),
 * so a row's dot products are summed in one order whatever M is.  For speed at other sizes,
 * each power-of-two bucket of M (1, 2, 4 .. 8192 rows) may use another algorithm, but only
 * one proven to compute the reference's bits: the first of cuBLASLt's candidates at that
 * size (as offered, or with the reference's split-K count and reduction forced on it) whose
 * output on a probe (up to 128 random rows times the call's own weights) equals the
 * reference's bit for bit; else the reference.  No timing enters the choice, so every
 * process (a prefill and a decode instance) picks the same.  Calls with more rows than the
 * workspace allows run in chunks of rows (rows are independent).
 *
 * Attention.  The KV length is cut into tiles of IV_BK (64) positions, fixed by position.
 * For a (token, query head) row, each tile gives a partial (max m, sum l, unnormalised o)
 * on tensor cores (bf16 Q/K/V/P, f32 accumulation), and the partials are folded in tile
 * order with one formula (explicitly rounded f32 ops, no contraction).  Prefill tiles fold
 * in registers; the other tokens (decode, short chunks) compute every tile in parallel,
 * write the partials and fold them in a combine kernel, in the same order with the same
 * formula: the same bits whether a token was prefilled at once, in chunks or one by one,
 * alone or in a batch.  The decode partials (head_dim 64/128) come from k_iv_dec: 4 warps a
 * (token, KV head, split of consecutive tiles), the GQA group's heads as the rows of one MMA
 * tile, each tile copied once into shared memory with the next one's copy in flight; the
 * tiles per CTA follow the grid's shape and change no bit ($DISAGG_CUDA_INV_ATT forces them;
 * 0: the one-warp-per-tile k_iv_part, also used for head_dim 16/32).  KV bf16 (or f32,
 * rounded to bf16 as it is read), head_dim 16/32/64/128, any number of query heads per KV
 * head.
 *
 * RMSNorm, RoPE, SwiGLU, the KV write, argmax and the gathers of the fast mode are
 * already per-row computations with a fixed order and are used unchanged.
 */
#ifndef DISAGG_KERNELS_CUDA_INVARIANT_H
#define DISAGG_KERNELS_CUDA_INVARIANT_H

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#define IV_BK 64 /* KV positions per attention tile (the fold unit) */

/* GEMM policy of one stream: the reference M the algorithm is chosen at, whether split-K (a
 * fixed split count, reduced in a separate deterministic step) is allowed, and whether the
 * per-bucket algorithms are used.  iv_policy_default(): $DISAGG_CUDA_INV_GEMM_M (default
 * 64), $DISAGG_CUDA_INV_SPLITK (1), $DISAGG_CUDA_INV_BUCKETS (1); $DISAGG_CUDA_INV_LOG=1 logs
 * every choice. */
typedef struct iv_policy {
    int m_ref;
    int splitk;
    int buckets; /* per power-of-two row bucket, an algorithm proven bit-identical to the
                  * reference on a probe ($DISAGG_CUDA_INV_BUCKETS, default 1) */
    int gu16;    /* the gate|up GEMM writes bf16 at every row count, SwiGLU reads that
                  * ($DISAGG_CUDA_INV_GU16, default 1; cuda_backend.cu's cb_gate_up) */
    int order;   /* buckets of >= 512 rows try the fast mode's prefill tiles first
                  * ($DISAGG_CUDA_INV_ORDER, default 1; the pick is still probe-verified) */
} iv_policy;
iv_policy iv_policy_default(void);

/* y (T, N) f32 = x (T, K) bf16 . w (N, K)^T bf16 (+ bias f32) with the shape's pinned
 * algorithm.  0 or -EIO (logged). */
int iv_matmul(cublasLtHandle_t lt, int device, cudaStream_t st, void *ws, size_t ws_bytes,
              const iv_policy *pol, float *y, const void *x, const void *w, const float *bias,
              int T, int N, int K);

/* The same with y (T, N) bf16: the epilogue rounds each f32 sum to bf16 (no bias); its own
 * reference and buckets, verified on the probe's bf16 output. */
int iv_matmul_bf16out(cublasLtHandle_t lt, int device, cudaStream_t st, void *ws,
                      size_t ws_bytes, const iv_policy *pol, void *y, const void *x,
                      const void *w, int T, int N, int K);

/* Scratch for the partials of the split path (one per stream). */
typedef struct iv_scratch {
    float *part;
    size_t cap; /* floats */
} iv_scratch;
void iv_scratch_free(iv_scratch *sc);

/* out (T, nh * hd) f32 = causal GQA attention of q (T, nh * hd) f32 over the paged KV
 * (kv_bf16: bf16, else f32), as backend_attention.  tiles (n_tiles, 3: first token, tokens
 * <= 64, sequence) are prefill tiles (tokens of a sequence, consecutive positions); rest
 * (n_rest) the other tokens; ctx: the largest position + 1 among them (sizes the grid;
 * fixed for a recorded graph).  gen is bumped when the scratch moves; capturing: no
 * allocation allowed (-EINVAL).  0 or a negative errno (logged). */
int iv_attention(cudaStream_t st, iv_scratch *sc, unsigned *gen, int capturing, float *out,
                 const float *q, const void *kv_base, int kv_bf16, int block_size, int n_layers,
                 int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts,
                 int bt_stride, const int32_t *tiles, int n_tiles, const int32_t *rest,
                 int n_rest, int ctx, int nh, int nkv, int hd, float scale);

#endif
