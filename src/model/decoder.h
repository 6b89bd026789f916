/*
 * decoder — the decoder-only transformer forward of every architecture model/arch.c describes
 * (Qwen2, Qwen3, Llama 3.x, Mistral, Qwen3-MoE, Mixtral: docs/models.md), on any compute
 * backend (kernels/backend.h): embeddings, per layer RMSNorm -> q/k/v (biases when the
 * description has them) -> [per-head RMSNorm of q and k] -> RoPE (rotate-half, the variant's
 * frequency table) -> GQA causal attention over the paged KV store [within the sliding window]
 * -> o_proj -> residual -> RMSNorm -> SwiGLU MLP (Qwen3-MoE / Mixtral sparse layers: router ->
 * backend_moe_route -> backend_moe over the chosen experts) -> residual, final RMSNorm and
 * lm_head (tied or not).  On the CPU backend: f32 compute from bf16/f16/f32 weights.
 *
 * The KV cache is a kv_store: one backend buffer of blocks, block-major as DESIGN.md "The
 * KV region" says — block b holds, for block_size tokens, every layer's K and V:
 *   block (n_layers, 2 [K,V], block_size, n_kv_heads * head_dim) of the KV dtype
 * so block_bytes = layers * 2 * block_size * kv_heads * head_dim * sizeof(dtype).  A
 * sequence names its blocks with a block table (position p lives in block
 * table[p / block_size], slot p % block_size).  The engine's paged KV cache owns the region
 * and the tables and passes them in; nothing here keeps per-sequence state.
 *
 * Batch invariance: a sequence's logits are bit-identical whatever else is in the batch
 * and however its positions were split into calls (one prefill, chunks, or one token at a
 * time), because every backend operation computes each output element in one fixed order
 * (backend.h "Determinism") and attention for position p reads keys 0..p in order.
 *
 * CPU conveniences: decoder_load, kv_store_init and decoder_state_init keep their original
 * CPU-only signatures (tests, generate, bench); the *_on / decoder_state_create variants
 * take the backend.
 */
#ifndef DISAGG_MODEL_DECODER_H
#define DISAGG_MODEL_DECODER_H

#include "kernels/backend.h"
#include "model/model_config.h"
#include "model/tp_shard.h"
#include "model/weights.h"

#include <stddef.h>
#include <stdint.h>

typedef struct decoder_model {
    model_config cfg;           /* hyper-parameters */
    model_weights w;            /* weights, in buffers of be */
    char dir[4096];             /* resolved model directory */
    backend *be;                /* where weights and work live (not owned) */
    backend_buffer *rope_buf;   /* rope_inv_freq's buffer */
    const float *rope_inv_freq; /* (head_dim / 2) f32, device address */
    float rope_attn;            /* the rope's cos/sin factor (yarn), folded into the scale */
    /* tensor parallelism (model/tp_shard.h): this rank's share, NULL at TP 1 */
    tp_shard *tp;
    model_config local; /* the shapes this rank computes (heads, KV heads, MLP widths; the
                           KV store's): cfg cut by tp, cfg itself at TP 1 */
} decoder_model;

/* model_arg: a directory or a hub name in the HF cache.  progress: warm the page cache
 * showing progress on a tty.  decoder_load: on the CPU backend (backend_cpu_default). */
int decoder_load(decoder_model *m, const char *model_arg, int progress, char *err, size_t errlen);
int decoder_load_on(decoder_model *m, const char *model_arg, backend *be, int progress, char *err,
                    size_t errlen);
/* dummy: flags -- DECODER_LOAD_DUMMY: --load-format dummy (config.json alone, random weights:
 * model/weights.h); DECODER_LOAD_FP8: --quantization fp8 (model/quant.h: an unquantized
 * checkpoint's linear layers quantized at load; an FP8 checkpoint loads as it is). */
#define DECODER_LOAD_DUMMY 1
#define DECODER_LOAD_FP8   2
int decoder_load_ex(decoder_model *m, const char *model_arg, backend *be, int progress, int dummy,
                    char *err, size_t errlen);
/* coll non-NULL: rank collective_rank(coll) of a tensor-parallel group; loads only that
 * rank's share of the weights, and decoder_forward runs the group's collectives (rank 0 also
 * sends each forward's batch to the other ranks, which run it from tp_step_recv). */
int decoder_load_tp(decoder_model *m, const char *model_arg, backend *be, int progress, int dummy,
                    collective *coll, char *err, size_t errlen);
void decoder_free(decoder_model *m);

typedef struct kv_store {
    void *base;          /* (n_blocks, n_layers, 2, block_size, kv_dim) device address */
    int n_blocks;        /* blocks in the region */
    int block_size;      /* tokens per block */
    int n_layers;        /* must equal the model's */
    int kv_dim;          /* n_kv_heads * head_dim, must equal the model's */
    int n_kv_heads;      /* KV heads */
    int head_dim;        /* elements per head */
    backend_dtype dtype; /* element type */
    backend_buffer *buf; /* the region (backend_buffer_location says where it lives) */
} kv_store;

/* Bytes of one block of f32 KV (decoder_kv_block_bytes_dt: of KV dtype dt).  A TP rank's
 * region: pass the model's `local` shapes. */
size_t decoder_kv_block_bytes(const model_config *c, int block_size);
size_t decoder_kv_block_bytes_dt(const model_config *c, int block_size, backend_dtype dt);
/* Allocates a zeroed f32 region for n_blocks on the CPU (tests, generate, bench). */
int kv_store_init(kv_store *kv, const model_config *c, int n_blocks, int block_size);
/* The same on backend be, of KV dtype dt (backend_kv_dtype_ok), with buffer flags
 * (BACKEND_BUF_KV for the engine's registered region).  -ENOTSUP for a dtype be lacks,
 * -ENOMEM when the region cannot be allocated (logged with the size). */
int kv_store_init_on(kv_store *kv, backend *be, const model_config *c, int n_blocks, int block_size,
                     backend_dtype dt, int flags);
void kv_store_free(kv_store *kv);

typedef struct decoder_seq {
    const int32_t *tokens;      /* (n_tokens) tokens at positions start_pos.. */
    int n_tokens;               /* new tokens this call (>= 1) */
    int start_pos;              /* tokens already in the KV cache for this sequence */
    const int32_t *block_table; /* (n_blocks) covering positions [0, start_pos + n_tokens) */
    int n_blocks;               /* entries in block_table */
    float *logits;              /* out: (n_tokens, vocab) if logits_all, else (vocab); NULL: none */
    int logits_all;             /* 1: logits of every new token, 0: of the last one */
    int32_t *argmax;            /* out: the greedy token of the last new row (the largest
                                   logit, lowest id on ties, computed on the device: with
                                   logits NULL nothing else comes back), or NULL */
    const uint32_t *allow;      /* in: structured outputs: the tokens the last new row may
                                   take, a packed bitmask of the model's vocab_size tokens (bit
                                   t % 32 of word t / 32, xgrammar's layout), or NULL.  Applied
                                   on the device to that row's logits (-inf elsewhere) before
                                   its argmax and its download.  Read once the forward reaches
                                   the head, after the state's mask hook returned; the k-th
                                   sequence with a mask should use row k of
                                   decoder_state_mask_rows (no copy) or memory outside them */
} decoder_seq;

typedef struct decoder_state decoder_state;

/* Workspace for up to max_tokens tokens per forward call, with its own stream on the
 * model's backend (the backend's threads).  NULL on failure (logged). */
decoder_state *decoder_state_create(const decoder_model *m, int max_tokens);
/* CPU convenience: on the CPU backend, the work runs on n_threads threads of the state's
 * own (1: the calling thread alone, 0: one per online CPU); on another backend n_threads
 * is ignored and this is decoder_state_create. */
decoder_state *decoder_state_init(const decoder_model *m, int max_tokens, int n_threads);
void decoder_state_free(decoder_state *s);
int decoder_state_max_tokens(const decoder_state *s);

/* Structured outputs (decoder_seq.allow).  Page-locked host rows for the masks of up to n
 * sequences, row k at words * k (words = (vocab_size + 31) / 32), valid until a call with a
 * larger n or the state's free; the forward uploads the rows it uses in one asynchronous copy
 * on the state's stream.  NULL on allocation failure (logged). */
uint32_t *decoder_state_mask_rows(decoder_state *s, int n);
/* fn(ctx) is called by decoder_forward once the step's work up to the logits is enqueued and
 * before any allow mask is read, when some sequence has one (the engine waits there for its
 * mask thread, so the masks are filled while the device computes the forward).  NULL: none. */
void decoder_state_set_mask_hook(decoder_state *s, void (*fn)(void *ctx), void *ctx);

/* Decode steps (one new token per sequence, each wanting its logits) of up to max_batch
 * sequences run as recorded graphs on a backend that has them (CUDA graphs): the batch is
 * padded to a bucket of 1, 2, 4, 8, 16, 24, ... max_batch (vLLM's sizes), each recorded on
 * its second use and replayed after.  Results equal the eager run of the padded batch.
 * max_batch 0 (--enforce-eager) or a backend without graphs: every step eager.  Returns the
 * number of buckets (0: eager) or -ENOMEM. */
#define DECODER_MAX_BUCKETS 64
int decoder_state_set_graphs(decoder_state *s, int max_batch);
int decoder_state_graphs(const decoder_state *s); /* graphs recorded so far */

/* Runs the new tokens of n_seqs sequences (sum of n_tokens <= max_tokens): writes their K/V
 * into kv (on the model's backend) and their logits (host memory, f32) and/or greedy
 * tokens (decoder_seq.argmax).  Returns 0 or
 * -EINVAL (bad token id, position beyond max_position_embeddings, block table too short or
 * out of range, kv of another shape or backend; logged with the values), or the backend's
 * error (-ENOMEM, -EIO, -ENOTSUP). */
int decoder_forward(const decoder_model *m, decoder_state *s, const kv_store *kv, decoder_seq *seqs,
                    int n_seqs);

#endif
