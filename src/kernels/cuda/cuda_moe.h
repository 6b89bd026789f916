/*
 * cuda_moe — the mixture-of-experts ops of the CUDA module (kernels/backend.h: backend_moe_route,
 * backend_moe) on the stacked expert weights:
 *   routing      one warp a token: softmax in f32 (max subtracted, expf, summed in expert
 *                order by one lane), top-k (ties: the lower expert first), renormalisation
 *                summed in selection order: the generic form's f32 operations in its order
 *   decode       T * top_k <= moe_dec_max_pairs (few pairs): three kernels that stream only
 *                the chosen experts' rows: the gate|up GEMV with SwiGLU (a CTA a row block of
 *                one chosen expert, every token that chose it sharing the weight read), the
 *                down GEMV into per-(token, slot) partials, and the weighted sum of a token's
 *                partials in ascending expert order (T * top_k <= 16: down and the sum in
 *                one kernel)
 *   prefill      a counting sort of the (token, slot) pairs by expert (one CTA), then one
 *                tensor-core GEMM kernel over every expert's group of rows in tiles of
 *                16 to 128 rows (moe_gemm_bm: by the tokens an expert) (gate|up with the
 *                SwiGLU in its epilogue, bf16 h), the same kernel for down (f32 rows), and the
 *                same weighted sum through the inverse permutation
 * Every path is CUDA-graph capturable: no host synchronisation, no allocation (the caller's
 * workspace, moe_ws_bytes, grown before a recording).  Weights must be bf16; x f32 (rounded to
 * bf16 into the workspace, as the GEMMs do) or bf16; out f32 or bf16.
 */
#ifndef DISAGG_KERNELS_CUDA_MOE_H
#define DISAGG_KERNELS_CUDA_MOE_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

typedef struct moe_args {
    const void *x;
    int x_bf16; /* 1: x is bf16, 0: f32 */
    int T, hidden, inter, n_experts, top_k;
    const int32_t *ids;
    const float *weights;
    const void *w_gate_up_all, *w_down_all; /* bf16, stacked */
    void *out;
    int out_bf16;
    int path;       /* MOE_PATH_* from moe_path() */
    int fused_down; /* decode with T * top_k <= 16: down and the weighted sum in one kernel
                       (DISAGG_CUDA_MOE_FUSED_DOWN=0: the down GEMV, then k_moe_combine) */
    int y_bf16;     /* grouped GEMM: the down rows in bf16 before the weighted sum (half the
                       bytes written and read back; DISAGG_CUDA_MOE_Y_BF16=1, default off) */
    int gemm_bk32;  /* grouped GEMM: the K step 32 of the first version (DISAGG_CUDA_MOE_GEMM=bk32;
                       default 64; its M tile is 128) */
    int gemm_bm;    /* grouped GEMM: the M tile, 16, 32, 64 or 128 (moe_gemm_bm) */
} moe_args;

#define MOE_PATH_DECODE 0
#define MOE_PATH_GEMM   1

/* the path for T tokens: decode when T * top_k <= max_pairs (DISAGG_CUDA_MOE_DEC_PAIRS,
 * default 512, capped at MOE_DEC_MAXP), at most 4 pairs an expert on average (of the
 * min(T * top_k, n_experts) experts a batch can choose) and !force_gemm, else the grouped
 * GEMM */
#define MOE_DEC_MAXP 1024
int moe_path(int T, int top_k, int n_experts, int max_pairs, int force_gemm);
/* the grouped GEMM's M tile (rows of one expert's group a CTA) for T tokens: force when it is
 * 16, 32, 64 or 128 (DISAGG_CUDA_MOE_BM); with force -1 (DISAGG_CUDA_MOE_BM=auto) the
 * smallest of those at least the pairs an expert on average (rounded up) over the
 * min(T * top_k, n_experts) experts a batch can choose (128 for prefill, 16 for Mixtral's
 * batch 32: 8 tokens an expert); otherwise 128.  The tiles below 128 have not run on a GPU
 * yet (written when the session's device time was spent): opt-in until they have. */
int moe_gemm_bm(int T, int top_k, int n_experts, int force);
/* the shapes the kernels take: hidden and inter multiples of 8 (16-byte rows) */
int moe_shape_ok(int hidden, int inter);
/* workspace bytes for a call (0 never) */
size_t moe_ws_bytes(const moe_args *a);

int moe_route(cudaStream_t st, int32_t *ids, float *w, const float *logits, int T, int E, int k,
              int norm);
int moe_run(cudaStream_t st, int n_sm, void *ws, size_t ws_bytes, const moe_args *a);

#endif
