/*
 * qwen2 — the Qwen2 decoder forward on the CPU (f32 compute from bf16/f16/f32 weights):
 * embeddings, per layer RMSNorm -> q/k/v (with biases) -> RoPE (rotate-half) -> GQA
 * causal attention over the paged KV store -> o_proj -> residual -> RMSNorm -> SwiGLU MLP
 * -> residual, final RMSNorm and lm_head (tied or not).
 *
 * The KV cache is a kv_store: one region of blocks, block-major as DESIGN.md "The KV
 * region" says — block b holds, for block_size tokens, every layer's K and V:
 *   block (n_layers, 2 [K,V], block_size, n_kv_heads * head_dim) f32
 * so block_bytes = layers * 2 * block_size * kv_heads * head_dim * 4.  A sequence names
 * its blocks with a block table (position p lives in block table[p / block_size], slot
 * p % block_size).  The engine's paged KV cache owns the region and the tables and passes
 * them in; nothing here keeps per-sequence state.
 *
 * Batch invariance: a sequence's logits are bit-identical whatever else is in the batch
 * and however its positions were split into calls (one prefill, chunks, or one token at a
 * time), because every kernel computes each output element in one fixed order (see
 * kernels/cpu/cpu_matmul.h) and attention for position p reads keys 0..p in order.
 */
#ifndef DISAGG_MODEL_QWEN2_H
#define DISAGG_MODEL_QWEN2_H

#include "kernels/cpu/cpu_pool.h"
#include "model/model_config.h"
#include "model/weights.h"

#include <stddef.h>
#include <stdint.h>

typedef struct qwen2_model {
    model_config cfg;     /* hyper-parameters */
    model_weights w;      /* mapped weights */
    char dir[4096];       /* resolved model directory */
    float *rope_inv_freq; /* (head_dim / 2) */
} qwen2_model;

/* model_arg: a directory or a hub name in the HF cache.  progress: warm the page cache
 * showing progress on a tty. */
int qwen2_load(qwen2_model *m, const char *model_arg, int progress, char *err, size_t errlen);
void qwen2_free(qwen2_model *m);

typedef struct kv_store {
    float *base;    /* (n_blocks, n_layers, 2, block_size, kv_dim) */
    int n_blocks;   /* blocks in the region */
    int block_size; /* tokens per block */
    int n_layers;   /* must equal the model's */
    int kv_dim;     /* n_kv_heads * head_dim, must equal the model's */
} kv_store;

size_t qwen2_kv_block_bytes(const model_config *c, int block_size);
/* Allocates a zeroed region for n_blocks (tests, generate, bench). */
int kv_store_init(kv_store *kv, const model_config *c, int n_blocks, int block_size);
void kv_store_free(kv_store *kv);

typedef struct qwen2_seq {
    const int32_t *tokens;      /* (n_tokens) tokens at positions start_pos.. */
    int n_tokens;               /* new tokens this call (>= 1) */
    int start_pos;              /* tokens already in the KV cache for this sequence */
    const int32_t *block_table; /* (n_blocks) covering positions [0, start_pos + n_tokens) */
    int n_blocks;               /* entries in block_table */
    float *logits;              /* out: (n_tokens, vocab) if logits_all, else (vocab); NULL: none */
    int logits_all;             /* 1: logits of every new token, 0: of the last one */
} qwen2_seq;

typedef struct qwen2_state qwen2_state;

/* Workspace for up to max_tokens tokens per forward call; pool may be NULL (one thread). */
qwen2_state *qwen2_state_init(const qwen2_model *m, int max_tokens, cpu_pool *pool);
void qwen2_state_free(qwen2_state *s);
int qwen2_state_max_tokens(const qwen2_state *s);

/* Runs the new tokens of n_seqs sequences (sum of n_tokens <= max_tokens): writes their K/V
 * into kv and their logits.  Returns 0 or -EINVAL (bad token id, position beyond
 * max_position_embeddings, block table too short or out of range; logged with the values). */
int qwen2_forward(const qwen2_model *m, qwen2_state *s, const kv_store *kv, qwen2_seq *seqs,
                  int n_seqs);

#endif
