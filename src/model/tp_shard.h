/*
 * tp_shard — one rank's share of a tensor-parallel decoder (docs/parallel.md), as vLLM shards
 * it: q|k|v and gate|up column-parallel (each rank holds rows of W: its query heads, its KV
 * heads, its intermediate slice; zero-copy views of the mapped safetensors on the CPU), o_proj
 * and down_proj row-parallel (columns of W, copied at load) with an all-reduce of their output,
 * the embedding vocab-parallel (rank r's rows [r * P, (r + 1) * P) of the vocabulary, P =
 * ceil(vocab / N), plus a zero row every other token is looked up in; then an all-reduce),
 * lm_head vocab-parallel (the same rows, padded with zeros to P; the logits all-gathered).
 * KV heads: with N <= K (N dividing K) rank r holds [r K / N, (r + 1) K / N); with N > K (K
 * dividing N) they are replicated and rank r holds head r K / N (xfer_plan.h's rule, which
 * the KV transfer between P and D of different TP follows).  A MoE layer's router is
 * replicated and each expert split as a dense MLP is.  Norms, q/k norms: replicated.
 *
 * Also the step message: rank 0 sends each forward's batch (decoder_seq: tokens, positions,
 * block tables, which outputs) to the other ranks, which run the same decoder_forward.
 */
#ifndef DISAGG_MODEL_TP_SHARD_H
#define DISAGG_MODEL_TP_SHARD_H

#include "kernels/backend.h"
#include "kernels/collective.h"
#include "model/model_config.h"

#include <stddef.h>
#include <stdint.h>

typedef struct tp_shard {
    int size, rank;                /* group size N, this rank */
    int head0, n_heads;            /* query heads [head0, head0 + n_heads) */
    int kv_head0, n_kv_heads;      /* KV heads [kv_head0, kv_head0 + n_kv_heads) */
    int inter0, inter;             /* the dense MLP's intermediate slice */
    int moe_inter0, moe_inter;     /* each expert's intermediate slice */
    int vocab, vocab0, vocab_part; /* vocabulary, first row here, rows per rank (padded) */
    int head_dim;                  /* elements per head */
    collective *coll;              /* the group (not owned) */
    backend_buffer *head_buf;      /* lm_head scratch: local then gathered logits */
    size_t head_cap;               /* its bytes */
} tp_shard;

/* Rank collective_rank(coll) of collective_size(coll) for the model c.  -EINVAL with err
 * saying what does not divide: N must divide the query heads, the intermediate sizes, and
 * divide or be a multiple of the KV heads. */
int tp_shard_init(tp_shard *sh, const model_config *c, collective *coll, char *err, size_t errlen);
/* TP size n checked against c alone (before any rank starts): 0 or -EINVAL with err. */
int tp_shard_check(const model_config *c, int n, char *err, size_t errlen);
void tp_shard_free(tp_shard *sh);
/* The rank's shapes: c with its heads, KV heads, q_dim and intermediate sizes (vocab whole). */
void tp_shard_config(const tp_shard *sh, const model_config *c, model_config *out);

/* How a checkpoint tensor is cut for this rank. */
typedef enum tp_split_kind {
    TP_WHOLE, /* replicated */
    TP_ROWS,  /* rows [first, first + count) (a 1-D tensor: elements) */
    TP_COLS,  /* columns [first, first + count) of every row */
    TP_VOCAB  /* rows [first, first + count), then zero rows up to pad_rows */
} tp_split_kind;
typedef struct tp_split {
    tp_split_kind kind;
    int first, count, pad_rows;
} tp_split;
tp_split tp_shard_split(const tp_shard *sh, const char *name);

/* The row of the rank's embedding table for token tok (vocab_part: the zero row). */
int32_t tp_shard_token(const tp_shard *sh, int32_t tok);

/* In-place sum over the ranks of buf (n elements of dt), in chunks that fit the group. */
int tp_shard_all_reduce(tp_shard *sh, backend *be, backend_stream *st, void *buf, backend_dtype dt,
                        size_t n);
/* lm_head over the ranks: op is the whole head's matmul (y: (T, vocab) f32 logits, w: the
 * rank's vocab_part rows); each rank computes its columns, all-gathered into op->y. */
int tp_shard_lm_head(tp_shard *sh, backend *be, backend_stream *st, const backend_matmul_op *op);

/* ---- the step message --------------------------------------------------------------- */

struct decoder_seq;

enum { TP_MSG_STEP = 1, TP_MSG_STOP = 2, TP_MSG_INIT = 3 };

/* What rank 0 tells the workers once, before the first step: the KV region's shape. */
typedef struct tp_init_msg {
    int32_t n_blocks, block_size, kv_dtype, max_tokens;
    int32_t kv_shared; /* 1: the worker maps its KV region from its memfd (rank 0 sized it) */
} tp_init_msg;

/* A worker's copy of the received step (its arrays owned here). */
typedef struct tp_step {
    struct decoder_seq *seqs; /* (n_seqs) */
    int n_seqs, cap_seqs;
    int32_t *ints; /* the message: tokens and block tables point into it */
    size_t cap_ints;
    float *logits; /* host scratch of the rows the step asks for */
    size_t cap_logits;
    int32_t *amax;    /* (cap_seqs) */
    tp_init_msg init; /* TP_MSG_INIT's */
} tp_step;

/* Rank 0: sends the batch (a forward's seqs) to the other ranks. */
int tp_step_send(collective *c, const struct decoder_seq *seqs, int n_seqs);
int tp_step_send_init(collective *c, const tp_init_msg *m);
int tp_step_send_stop(collective *c);
/* Other ranks: the next message into s: TP_MSG_* or a negative errno. */
int tp_step_recv(collective *c, tp_step *s, int vocab);
void tp_step_free(tp_step *s);

#endif
