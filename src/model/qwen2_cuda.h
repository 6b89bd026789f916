/*
 * qwen2_cuda — the Qwen2 forward on a CUDA GPU through the CUDA module
 * (kernels/cuda/cuda_module.h): uploads a loaded qwen2_model's weights to HBM (bf16),
 * allocates the paged KV region there (same block-major layout as kv_store, bf16 or f32)
 * and runs qwen2_seq batches with the same meaning as qwen2_forward.  Logits come back
 * f32 to host; greedy ids can be taken on the device.
 */
#ifndef DISAGG_MODEL_QWEN2_CUDA_H
#define DISAGG_MODEL_QWEN2_CUDA_H

#include "kernels/cuda/cuda_module.h"
#include "model/qwen2.h"

typedef struct qwen2_cuda {
    const dcu_api *api;
    dcu_ctx *ctx;
    dcu_model *dm;
    dcu_info info;
    dcu_kv kv; /* the KV region in HBM (base NULL until kv_alloc) */
    int max_tokens, max_seqs, max_blocks;
    int vocab;
    /* host scratch for one batch */
    int32_t *tok, *pos, *seq, *bt, *out_rows, *amax;
    float *logits; /* (max_tokens, vocab) */
} qwen2_cuda;

/* Opens device `device`, uploads m's weights (progress on stderr when progress).  Errors
 * (module/driver/GPU missing, out of GPU memory) in err.  */
int qwen2_cuda_open(qwen2_cuda *g, const qwen2_model *m, int device, int max_tokens, int max_seqs,
                    int max_blocks, int progress, char *err, size_t errlen);
void qwen2_cuda_close(qwen2_cuda *g);

/* Allocates (zeroed) the KV region: n_blocks of block_size tokens, dtype DCU_BF16|DCU_F32. */
int qwen2_cuda_kv_alloc(qwen2_cuda *g, const model_config *c, int n_blocks, int block_size,
                        int dtype, char *err, size_t errlen);

/* Bytes of one KV block for dtype. */
size_t qwen2_cuda_kv_block_bytes(const model_config *c, int block_size, int dtype);

/* As qwen2_forward; greedy (may be NULL): per sequence, the argmax of its last row's logits
 * (taken on the device), for sequences with logits or without. */
int qwen2_cuda_forward(qwen2_cuda *g, qwen2_seq *seqs, int n_seqs, int32_t *greedy);

#endif
