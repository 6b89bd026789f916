/*
 * decoder — the decoder forward of every architecture model/arch.c describes (see
 * decoder.h).  Reads top-down like the math: embed, then per layer attention block and
 * MLP block, then the head.  Every step is one operation of
 * kernels/backend.h on the state's stream; nothing here touches device memory directly.
 */
#include "model/decoder.h"

#include "base/log.h"
#include "model/arch.h"
#include "model/hf_cache.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DECODER_MAX_GROUP 64 /* query heads per KV head */

/* ---- model ---------------------------------------------------------------- */

int decoder_load(decoder_model *m, const char *model_arg, int progress, char *err, size_t errlen) {
    return decoder_load_on(m, model_arg, backend_cpu_default(), progress, err, errlen);
}

int decoder_load_on(decoder_model *m, const char *model_arg, backend *be, int progress, char *err,
                    size_t errlen) {
    return decoder_load_ex(m, model_arg, be, progress, 0, err, errlen);
}

/* --quantization fp8: quantize an unquantized checkpoint at load; an FP8 checkpoint already
 * is (vLLM accepts the flag on one too); another method is refused */
static int decoder_quant_online(model_config *c, const char *dir, char *err, size_t errlen) {
    if (c->quant.kind == QUANT_FP8 || c->quant.kind == QUANT_FP8_CT) return 0;
    if (c->quant.kind != QUANT_NONE) {
        snprintf(err, errlen, "%s/config.json: --quantization fp8 on a %s checkpoint", dir,
                 quant_kind_name(c->quant.kind));
        return -EINVAL;
    }
    c->quant.kind = QUANT_FP8_ONLINE;
    return 0;
}

int decoder_load_ex(decoder_model *m, const char *model_arg, backend *be, int progress, int dummy,
                    char *err, size_t errlen) {
    return decoder_load_tp(m, model_arg, be, progress, dummy, NULL, err, errlen);
}

int decoder_load_tp(decoder_model *m, const char *model_arg, backend *be, int progress, int dummy,
                    collective *coll, char *err, size_t errlen) {
    memset(m, 0, sizeof *m);
    m->be = be;
    int rc = hf_cache_resolve(model_arg, m->dir, sizeof m->dir, err, errlen);
    if (rc) return rc;
    if ((rc = model_config_load(&m->cfg, m->dir, err, errlen))) return rc;
    if ((dummy & DECODER_LOAD_FP8) && (rc = decoder_quant_online(&m->cfg, m->dir, err, errlen)))
        return rc;
    if (m->cfg.n_experts && m->cfg.quant.kind != QUANT_NONE) {
        snprintf(err, errlen,
                 "%s/config.json: FP8 weights (%s) with a mixture-of-experts model (%d experts) "
                 "are not implemented: the expert kernels take bf16, f16 or f32 weights; "
                 "accepted: an unquantized MoE checkpoint, or FP8 with a dense model",
                 m->dir,
                 m->cfg.quant.kind == QUANT_FP8_ONLINE ? "--quantization fp8"
                                                       : "its quantization_config",
                 m->cfg.n_experts);
        return -ENOTSUP;
    }
    if (m->cfg.n_heads / m->cfg.n_kv_heads > DECODER_MAX_GROUP || m->cfg.head_dim > 1024) {
        snprintf(err, errlen,
                 "%s/config.json: %d query heads per KV head and head_dim %d; supported: at most "
                 "%d and 1024",
                 m->dir, m->cfg.n_heads / m->cfg.n_kv_heads, m->cfg.head_dim, DECODER_MAX_GROUP);
        return -EINVAL;
    }
    if (m->cfg.sliding_window && !backend_attention_window(be)) {
        snprintf(err, errlen,
                 "%s/config.json: sliding_window %d (shorter than max_position_embeddings %d) is "
                 "not implemented on %s; accepted devices: cpu, cuda",
                 m->dir, m->cfg.sliding_window, m->cfg.max_position, backend_name(be));
        return -ENOTSUP;
    }
    if (coll && m->cfg.quant.kind != QUANT_NONE) {
        snprintf(err, errlen,
                 "%s: FP8 weights with tensor parallelism (-tp > 1) are not implemented (the scale "
                 "tensors are not sharded); accepted: -tp 1 with FP8, or an unquantized checkpoint",
                 m->dir);
        return -ENOTSUP;
    }
    if (coll && (!(m->tp = calloc(1, sizeof *m->tp)) ||
                 (rc = tp_shard_init(m->tp, &m->cfg, coll, err, errlen)))) {
        decoder_free(m);
        return rc ? rc : -ENOMEM;
    }
    tp_shard_config(m->tp, &m->cfg, &m->local);
    uint64_t seed = (dummy & DECODER_LOAD_DUMMY) ? 0x5eed : 0;
    if ((rc = weights_load_tp(&m->w, be, &m->cfg, m->dir, seed, m->tp, err, errlen))) {
        decoder_free(m);
        return rc;
    }
    int half = m->cfg.head_dim / 2;
    float *inv = malloc((size_t)half * sizeof(float));
    m->rope_buf = inv ? backend_buffer_alloc(be, (size_t)half * sizeof(float), 0) : NULL;
    backend_stream *st = m->rope_buf ? backend_stream_create(be) : NULL;
    rc = st ? 0 : -ENOMEM;
    if (!rc) {
        /* as transformers computes it for the config's rope variant (model/arch.c) */
        arch_rope_table(&m->cfg, inv, &m->rope_attn);
        rc = backend_upload(st, backend_buffer_ptr(m->rope_buf), inv, (size_t)half * sizeof(float));
        m->rope_inv_freq = backend_buffer_ptr(m->rope_buf);
    }
    backend_stream_free(st);
    free(inv);
    if (rc) {
        snprintf(err, errlen, "cannot place the RoPE table on %s", backend_name(be));
        decoder_free(m);
        return rc;
    }
    if (progress && !(dummy & DECODER_LOAD_DUMMY)) st_set_prefault(&m->w.st, m->dir);
    return 0;
}

void decoder_free(decoder_model *m) {
    if (m->tp) tp_shard_free(m->tp);
    free(m->tp);
    weights_free(&m->w);
    backend_buffer_free(m->rope_buf);
    memset(m, 0, sizeof *m);
}

/* ---- KV store ----------------------------------------------------------- */

size_t decoder_kv_block_bytes_dt(const model_config *c, int block_size, backend_dtype dt) {
    return (size_t)c->n_layers * 2 * (size_t)block_size * (size_t)(c->n_kv_heads * c->head_dim) *
           backend_dtype_size(dt);
}

size_t decoder_kv_block_bytes(const model_config *c, int block_size) {
    return decoder_kv_block_bytes_dt(c, block_size, BACKEND_F32);
}

int kv_store_init(kv_store *kv, const model_config *c, int n_blocks, int block_size) {
    return kv_store_init_on(kv, backend_cpu_default(), c, n_blocks, block_size, BACKEND_F32,
                            BACKEND_BUF_ZERO);
}

int kv_store_init_on(kv_store *kv, backend *be, const model_config *c, int n_blocks, int block_size,
                     backend_dtype dt, int flags) {
    memset(kv, 0, sizeof *kv);
    if (n_blocks <= 0 || block_size <= 0) return -EINVAL;
    if (!backend_kv_dtype_ok(be, dt)) return -ENOTSUP;
    kv->buf =
        backend_buffer_alloc(be, (size_t)n_blocks * decoder_kv_block_bytes_dt(c, block_size, dt),
                             flags | BACKEND_BUF_ZERO);
    if (!kv->buf) return -ENOMEM;
    kv->base = backend_buffer_ptr(kv->buf);
    kv->n_blocks = n_blocks;
    kv->block_size = block_size;
    kv->n_layers = c->n_layers;
    kv->kv_dim = c->n_kv_heads * c->head_dim;
    kv->n_kv_heads = c->n_kv_heads;
    kv->head_dim = c->head_dim;
    kv->dtype = dt;
    return 0;
}

void kv_store_free(kv_store *kv) {
    backend_buffer_free(kv->buf);
    memset(kv, 0, sizeof *kv);
}

/* ---- state ---------------------------------------------------------------- */

enum { B_X, B_Y, B_XB, B_Q, B_K, B_V, B_ATT, B_HB, B_HB2, B_RL, B_IDS, B_RW, B_COUNT };

struct decoder_state {
    int max_tokens;     /* capacity in tokens */
    backend_stream *st; /* the stream all work goes to (owned) */
    backend_dtype act;  /* activation dtype (residual stream, q/k/v) */
    backend_dtype mm;   /* matmul-input dtype (normed rows, attention out, SwiGLU out) */
    backend_buffer *buf[B_COUNT];
    void *x;                    /* (T, hidden) residual stream */
    void *y;                    /* (T, hidden) o_proj / down_proj output, added into x by the
                                   next add_rmsnorm; rows gathered for lm_head */
    void *xb;                   /* (T, hidden) of mm: normed input */
    void *q;                    /* (T, q_dim) */
    void *k;                    /* (T, kv_dim) */
    void *v;                    /* (T, kv_dim) */
    void *att;                  /* (T, q_dim) of mm: attention output */
    void *hb;                   /* (T, intermediate) of mm: silu(gate) * up */
    void *hb2;                  /* (T, intermediate) up (the generic gate_up; NULL when cat) */
    void *rlog;                 /* (T, n_experts) f32 router logits (MoE models) */
    void *ids;                  /* (T, top_k) int32 chosen experts */
    void *rw;                   /* (T, top_k) f32 their weights */
    backend_buffer *logits_buf; /* (logits_cap, vocab) f32 lm_head output */
    backend_buffer *amax_buf;   /* (logits_cap) int32 greedy ids on the device */
    int logits_cap;             /* rows of logits_buf */
    int32_t *amax_host;         /* (logits_cap) */
    /* structured outputs' masks (decoder_seq.allow): mask_host, page-locked, holds mask_cap row
     * indices then mask_cap bitmask rows; mask_dev the same on the device */
    backend_buffer *mask_host, *mask_dev;
    int mask_cap, mask_words;
    void (*mask_hook)(void *ctx);
    void *mask_ctx;
    /* the batch's host metadata (backend_batch) */
    int32_t *tokens, *tok_seq, *tok_pos, *out_rows; /* (max_tokens) each */
    int32_t *qo_indptr, *kv_len, *bt_indptr;        /* (max_tokens + 1) each */
    int32_t *bt_indices;                            /* (bt_cap) */
    int bt_cap;
    /* recorded decode steps (decoder_state_set_graphs): batch-size buckets, 0 = eager */
    int graph_buckets[DECODER_MAX_BUCKETS];
    int n_buckets;
    const void *graph_kv; /* the KV region the recorded steps use */
    int32_t *pad_meta;    /* (4 * max bucket + 2) host arrays of a padded batch */
};

static decoder_state *state_new(const decoder_model *m, int max_tokens, backend_stream *st) {
    const model_config *c = &m->local;
    if (max_tokens <= 0 || !st) {
        backend_stream_free(st);
        return NULL;
    }
    decoder_state *s = calloc(1, sizeof *s);
    if (!s) {
        backend_stream_free(st);
        return NULL;
    }
    s->st = st;
    s->act = backend_act_dtype(m->be);
    s->mm = backend_mm_dtype(m->be);
    s->max_tokens = max_tokens;
    s->mask_words = (m->cfg.vocab_size + 31) / 32; /* decoder_seq.allow covers the whole vocabulary */
    size_t T = (size_t)max_tokens, h = (size_t)c->hidden_size, qd = (size_t)c->q_dim,
           kvd = (size_t)(c->n_kv_heads * c->head_dim), I = (size_t)c->intermediate_size,
           ea = backend_dtype_size(s->act), em = backend_dtype_size(s->mm);
    int cat = backend_wants_cat(m->be), dense = 0;
    for (int l = 0; l < c->n_layers && !dense; l++)
        dense = !model_layer_is_moe(c, l);
    size_t E = (size_t)c->n_experts, K = (size_t)(E ? c->n_experts_per_tok : 0);
    /* hb, hb2: only dense MLPs use them (a sparse MLP's scratch is backend_moe's own) */
    size_t width[B_COUNT] = {h, h, h, qd, kvd, kvd, qd, dense ? I : 0, cat || !dense ? 0 : I,
                             E, K, K};
    size_t es[B_COUNT] = {ea, ea, em, ea, ea, ea, em, em, em, 4, 4, 4};
    void **ptr[B_COUNT] = {&s->x,   &s->y,   &s->xb,   &s->q,  &s->k,   &s->v,
                           &s->att, &s->hb,  &s->hb2,  &s->rlog, &s->ids, &s->rw};
    int ok = 1;
    for (int i = 0; i < B_COUNT && ok; i++) {
        if (!width[i]) continue; /* not needed by this model on this backend */
        s->buf[i] = backend_buffer_alloc(m->be, T * width[i] * es[i], 0);
        ok = s->buf[i] != NULL;
        if (ok) *ptr[i] = backend_buffer_ptr(s->buf[i]);
    }
    int32_t **arr[7] = {&s->tokens,    &s->tok_seq, &s->tok_pos,  &s->out_rows,
                        &s->qo_indptr, &s->kv_len,  &s->bt_indptr};
    for (int i = 0; i < 7 && ok; i++)
        ok = (*arr[i] = malloc((T + 1) * sizeof(int32_t))) != NULL;
    if (!ok) {
        decoder_state_free(s);
        return NULL;
    }
    return s;
}

decoder_state *decoder_state_create(const decoder_model *m, int max_tokens) {
    return state_new(m, max_tokens, backend_stream_create(m->be));
}

decoder_state *decoder_state_init(const decoder_model *m, int max_tokens, int n_threads) {
    return state_new(m, max_tokens, backend_stream_create_threads(m->be, n_threads));
}

void decoder_state_free(decoder_state *s) {
    if (!s) return;
    backend_stream_free(s->st);
    for (int i = 0; i < B_COUNT; i++)
        backend_buffer_free(s->buf[i]);
    backend_buffer_free(s->logits_buf);
    backend_buffer_free(s->amax_buf);
    free(s->amax_host);
    backend_buffer_free(s->mask_host);
    backend_buffer_free(s->mask_dev);
    free(s->tokens);
    free(s->tok_seq);
    free(s->tok_pos);
    free(s->out_rows);
    free(s->qo_indptr);
    free(s->kv_len);
    free(s->bt_indptr);
    free(s->bt_indices);
    free(s->pad_meta);
    free(s);
}

int decoder_state_max_tokens(const decoder_state *s) {
    return s->max_tokens;
}

uint32_t *decoder_state_mask_rows(decoder_state *s, int n) {
    if (n < 1) n = 1;
    if (n > s->mask_cap) {
        backend *be = backend_stream_backend(s->st);
        int cap = n < 16 ? 16 : n;
        size_t bytes = (size_t)cap * sizeof(int32_t) * (1 + (size_t)s->mask_words);
        backend_buffer *h = backend_buffer_alloc(be, bytes, BACKEND_BUF_HOST),
                       *d = h ? backend_buffer_alloc(be, bytes, 0) : NULL;
        if (!d) {
            backend_buffer_free(h);
            return NULL;
        }
        backend_buffer_free(s->mask_host);
        backend_buffer_free(s->mask_dev);
        s->mask_host = h, s->mask_dev = d, s->mask_cap = cap;
    }
    return (uint32_t *)backend_buffer_ptr(s->mask_host) + s->mask_cap;
}

void decoder_state_set_mask_hook(decoder_state *s, void (*fn)(void *ctx), void *ctx) {
    s->mask_hook = fn;
    s->mask_ctx = ctx;
}

int decoder_state_set_graphs(decoder_state *s, int max_batch) {
    backend_graph_reset(s->st);
    s->n_buckets = 0;
    backend *be = backend_stream_backend(s->st);
    if (max_batch <= 0 || !backend_graph_supported(be)) return 0;
    /* the generic MoE reads the routing back to the host: not recordable */
    if (s->rlog && backend_moe_generic(be)) return 0;
    if (max_batch > s->max_tokens) max_batch = s->max_tokens;
    free(s->pad_meta);
    s->pad_meta = malloc(((size_t)max_batch * 9 + 4) * sizeof(int32_t));
    if (!s->pad_meta) return -ENOMEM;
    /* vLLM's capture sizes: 1, 2, 4, then every multiple of 8, up to max_batch */
    for (int b = 1; b <= max_batch && s->n_buckets < DECODER_MAX_BUCKETS; b = b < 8 ? b * 2 : b + 8)
        s->graph_buckets[s->n_buckets++] = b;
    if (s->graph_buckets[s->n_buckets - 1] != max_batch && s->n_buckets < DECODER_MAX_BUCKETS)
        s->graph_buckets[s->n_buckets++] = max_batch;
    return s->n_buckets;
}

int decoder_state_graphs(const decoder_state *s) {
    return backend_graph_count(s->st);
}

static int check_seqs(const decoder_model *m, const decoder_state *s, const kv_store *kv,
                      const decoder_seq *seqs, int n_seqs, int *total) {
    const model_config *c = &m->local;
    if (kv->n_layers != c->n_layers || kv->kv_dim != c->n_kv_heads * c->head_dim || !kv->buf) {
        LOG_E("model", "kv store shape (layers %d, kv_dim %d) does not match the model (%d, %d)",
              kv->n_layers, kv->kv_dim, c->n_layers, c->n_kv_heads * c->head_dim);
        return -EINVAL;
    }
    backend *kb = backend_buffer_backend(kv->buf);
    if (kb != m->be && !(backend_is_cpu(kb) && backend_is_cpu(m->be))) {
        LOG_E("model", "kv store on %s, the model on %s", backend_name(kb), backend_name(m->be));
        return -EINVAL;
    }
    int T = 0;
    for (int i = 0; i < n_seqs; i++) {
        const decoder_seq *q = &seqs[i];
        int end = q->start_pos + q->n_tokens;
        if (q->n_tokens <= 0 || q->start_pos < 0) {
            LOG_E("model",
                  "sequence %d: n_tokens %d, start_pos %d (need n_tokens >= 1, start_pos >= 0)", i,
                  q->n_tokens, q->start_pos);
            return -EINVAL;
        }
        if (end > c->max_position) {
            LOG_E("model", "sequence %d: position %d beyond max_position_embeddings %d", i, end - 1,
                  c->max_position);
            return -EINVAL;
        }
        if ((long)q->n_blocks * kv->block_size < end) {
            LOG_E("model", "sequence %d: %d blocks of %d tokens cannot hold %d positions", i,
                  q->n_blocks, kv->block_size, end);
            return -EINVAL;
        }
        for (int b = 0; b < (end + kv->block_size - 1) / kv->block_size; b++)
            if (q->block_table[b] < 0 || q->block_table[b] >= kv->n_blocks) {
                LOG_E("model", "sequence %d: block id %d outside the KV store [0, %d)", i,
                      q->block_table[b], kv->n_blocks);
                return -EINVAL;
            }
        for (int t = 0; t < q->n_tokens; t++)
            if (q->tokens[t] < 0 || q->tokens[t] >= c->vocab_size) {
                LOG_E("model", "sequence %d: token id %d outside the vocabulary [0, %d)", i,
                      q->tokens[t], c->vocab_size);
                return -EINVAL;
            }
        T += q->n_tokens;
    }
    if (T > s->max_tokens) {
        LOG_E("model", "%d tokens in one forward call; the workspace holds %d", T, s->max_tokens);
        return -EINVAL;
    }
    *total = T;
    return 0;
}

/* Fills the batch's host metadata for the backend and plans it: token rows, positions,
 * block tables, and the rows whose logits are wanted (every row of a logits_all sequence,
 * else its last), in sequence order. */
static int plan_batch(const decoder_model *m, decoder_state *s, const kv_store *kv,
                      const decoder_seq *seqs, int n_seqs, int T) {
    int nbt = 0;
    for (int i = 0; i < n_seqs; i++)
        nbt += (seqs[i].start_pos + seqs[i].n_tokens + kv->block_size - 1) / kv->block_size;
    if (nbt > s->bt_cap) {
        int32_t *p = realloc(s->bt_indices, (size_t)nbt * sizeof *p);
        if (!p) return -ENOMEM;
        s->bt_indices = p;
        s->bt_cap = nbt;
    }
    int t = 0, n_out = 0, b = 0;
    s->qo_indptr[0] = s->bt_indptr[0] = 0;
    for (int i = 0; i < n_seqs; i++) {
        const decoder_seq *q = &seqs[i];
        int end = q->start_pos + q->n_tokens, nb = (end + kv->block_size - 1) / kv->block_size;
        memcpy(s->bt_indices + b, q->block_table, (size_t)nb * sizeof(int32_t));
        b += nb;
        for (int j = 0; j < q->n_tokens; j++, t++) {
            s->tokens[t] = tp_shard_token(m->tp, q->tokens[j]); /* the rank's embedding row */
            s->tok_seq[t] = i;
            s->tok_pos[t] = q->start_pos + j;
            if ((q->logits && q->logits_all) || ((q->logits || q->argmax) && j == q->n_tokens - 1))
                s->out_rows[n_out++] = t;
        }
        s->qo_indptr[i + 1] = t;
        s->kv_len[i] = end;
        s->bt_indptr[i + 1] = b;
    }
    backend_batch bb = {
        T,         n_seqs,       s->tokens,     s->tok_seq, s->tok_pos, s->qo_indptr,
        s->kv_len, s->bt_indptr, s->bt_indices, n_out,      s->out_rows};
    return backend_plan(s->st, &bb) ? -EINVAL : n_out;
}

#define TRY(call)                                                                                  \
    do {                                                                                           \
        if ((rc = (call)) != 0) return rc;                                                         \
    } while (0)

/* A sparse MLP: y (T, hidden) = the weighted sum of the chosen experts of norm(x) (s->xb):
 * router logits in f32, the routing as transformers computes it, then the experts. */
static int moe_block(const decoder_model *m, decoder_state *s, const layer_weights *L, int T) {
    const model_config *c = &m->local;
    int rc, h = c->hidden_size, E = c->n_experts, k = c->n_experts_per_tok;
    backend_stream *st = s->st;
    backend_matmul_op r = {s->rlog, BACKEND_F32, s->xb, s->mm, L->router.data, L->router.dtype,
                           NULL,    T,           E,     h, {0}};
    TRY(backend_matmul(st, &r, 1));
    TRY(backend_moe_route(st, s->ids, s->rw, s->rlog, T, E, k, c->norm_topk_prob));
    backend_moe_op op = {.x = s->xb,
                         .x_dt = s->mm,
                         .T = T,
                         .hidden = h,
                         .inter = c->moe_intermediate_size,
                         .n_experts = E,
                         .top_k = k,
                         .ids = s->ids,
                         .weights = s->rw,
                         .w_gate = L->ex_gate,
                         .w_up = L->ex_up,
                         .w_down = L->ex_down,
                         .w_gate_up_all = L->ex_gate_up_all,
                         .w_down_all = L->ex_down_all,
                         .w_dt = L->expert_dt,
                         .out = s->y,
                         .out_dt = s->act};
    return backend_moe(st, &op);
}

/* The planned batch's T tokens through every layer: s->x holds the residual stream after. */
static int run_layers(const decoder_model *m, decoder_state *s, const backend_kv *kvp, int T) {
    const model_config *c = &m->local; /* this rank's heads and widths */
    const model_weights *w = &m->w;
    int rc, h = c->hidden_size, I = c->intermediate_size, nh = c->n_heads, qd = c->q_dim;
    const backend_dtype a = s->act, mm = s->mm; /* activations, matmul inputs */
    /* transformers scales cos and sin by the rope's attention factor (yarn): q.k by its
     * square, folded into the softmax scale */
    const float eps = c->rms_norm_eps,
                scale = (float)(1.0 / sqrt((double)c->head_dim)) * m->rope_attn * m->rope_attn;
    const backend_kv bkv = *kvp;
    backend_stream *st = s->st;
    /* where the backend folds the residual add into the o / down GEMMs (CUDA prefill), x += the
     * GEMM's output there and the norms add nothing; else the GEMMs write y and the norm after
     * each adds it (the CPU, decode, --batch-invariant: the same sums either way) */
    const int fused = !m->tp && backend_residual_fused(st, T);
    /* tensor parallelism: the partial sums of each rank (the vocab-parallel embedding, the
     * row-parallel o_proj and down_proj) summed over the group */
    const size_t th = (size_t)T * h;
#define TP_SUM(buf) TRY(m->tp ? tp_shard_all_reduce(m->tp, m->be, st, buf, a, th) : 0)

    TRY(backend_embed(st, s->x, a, w->embed.data, w->embed.dtype, h));
    TP_SUM(s->x);
    for (int l = 0; l < c->n_layers; l++) {
        const layer_weights *L = &w->layers[l];
        /* attention block: x += wo . attention(rope(wq . norm(x)), rope(wk . ..), wv . ..)
         * (Qwen3: rope(qk_norm(wq . norm(x))) per head; Mistral: over the window's keys)
         * (the previous layer's MLP output y joins x here: x += y, then the norm) */
        TRY(backend_add_rmsnorm(st, s->xb, mm, s->x, l && !fused ? s->y : NULL, a, L->attn_norm, T,
                                h, eps));
        backend_qkv_op qkv = {.x = s->xb,
                              .x_dt = mm,
                              .T = T,
                              .hidden = h,
                              .n_heads = nh,
                              .wq = L->wq.data,
                              .wk = L->wk.data,
                              .wv = L->wv.data,
                              .w_dt = L->wq.dtype,
                              .bq = L->bq,
                              .bk = L->bk,
                              .bv = L->bv,
                              .wqkv = L->wqkv.data,
                              .bqkv = L->bqkv,
                              .q = s->q,
                              .k = s->k,
                              .v = s->v,
                              .dt = a,
                              .inv_freq = m->rope_inv_freq,
                              .kv = &bkv,
                              .layer = l,
                              .q_norm = L->q_norm,
                              .k_norm = L->k_norm,
                              .qk_eps = eps,
                              .sq = L->wq.scale,
                              .sk = L->wk.scale,
                              .sv = L->wv.scale,
                              .sqkv = L->wqkv.scale};
        TRY(backend_qkv(st, &qkv));
        TRY(backend_layer_mark(st, l)); /* layer l's KV is written: it may leave (P/D) */
        TRY(backend_attention_to(st, s->att, mm, s->q, a, &bkv, l, nh, scale));
        backend_matmul_op o = {s->y, a, s->att, mm, L->wo.data, L->wo.dtype,
                               NULL, T, h,      qd, L->wo.scale};
        TRY(fused ? backend_matmul_residual(st, &o, s->x) : backend_matmul(st, &o, 1));
        TP_SUM(s->y);
        /* MLP block: x += w_down . (silu(w_gate . norm(x)) * (w_up . norm(x))), or its
         * mixture of experts */
        TRY(backend_add_rmsnorm(st, s->xb, mm, s->x, fused ? NULL : s->y, a, L->mlp_norm, T, h,
                                eps));
        if (L->router.data) {
            TRY(moe_block(m, s, L, T));
            TP_SUM(s->y);
            if (fused) TRY(backend_add(st, s->x, s->y, a, (size_t)T * h));
            continue;
        }
        backend_mlp_op mlp = {.x = s->xb,
                              .x_dt = mm,
                              .T = T,
                              .hidden = h,
                              .inter = I,
                              .w_gate = L->w_gate.data,
                              .w_up = L->w_up.data,
                              .w_dt = L->w_gate.dtype,
                              .w_gate_up = L->w_gate_up.data,
                              .h = s->hb,
                              .h2 = s->hb2,
                              .h_dt = mm,
                              .s_gate = L->w_gate.scale,
                              .s_up = L->w_up.scale,
                              .s_gate_up = L->w_gate_up.scale};
        TRY(backend_gate_up(st, &mlp));
        backend_matmul_op down = {s->y, a, s->hb, mm, L->w_down.data, L->w_down.dtype,
                                  NULL, T, h,     I,  L->w_down.scale};
        TRY(fused ? backend_matmul_residual(st, &down, s->x) : backend_matmul(st, &down, 1));
        TP_SUM(s->y);
    }
#undef TP_SUM
    return fused ? 0 : backend_add(st, s->x, s->y, a, (size_t)T * h);
}

/* logits_buf holds at least rows rows (a new buffer drops the recorded steps using the old) */
static int logits_reserve(const decoder_model *m, decoder_state *s, int rows) {
    if (s->logits_cap >= rows) return 0;
    backend_graph_reset(s->st);
    backend_buffer_free(s->logits_buf);
    backend_buffer_free(s->amax_buf);
    free(s->amax_host);
    s->logits_buf =
        backend_buffer_alloc(m->be, (size_t)rows * m->cfg.vocab_size * sizeof(float), 0);
    s->amax_buf = backend_buffer_alloc(m->be, (size_t)rows * sizeof(int32_t), 0);
    s->amax_host = malloc((size_t)rows * sizeof(int32_t));
    int ok = s->logits_buf && s->amax_buf && s->amax_host;
    s->logits_cap = ok ? rows : 0;
    return ok ? 0 : -ENOMEM;
}

/* head: logits (n_out, vocab) f32 = lm_head · norm(x) of the wanted rows */
static int run_head(const decoder_model *m, decoder_state *s, int n_out) {
    const model_config *c = &m->cfg;
    const model_weights *w = &m->w;
    int rc, h = c->hidden_size;
    const backend_dtype a = s->act;
    backend_stream *st = s->st;
    float *logits = backend_buffer_ptr(s->logits_buf);
    TRY(backend_gather_rows(st, s->y, s->x, a, h));
    TRY(backend_rmsnorm(st, s->xb, s->mm, s->y, a, w->final_norm, n_out, h, c->rms_norm_eps));
    backend_matmul_op head = {logits,           BACKEND_F32, s->xb, s->mm,         w->lm_head.data,
                              w->lm_head.dtype, NULL,        n_out, c->vocab_size, h,
                              w->lm_head.scale};
    return m->tp ? tp_shard_lm_head(m->tp, m->be, st, &head) : backend_matmul(st, &head, 1);
}

/* The sequences' allow masks on their logits rows (in sequence order on the device, n_rows
 * in all): after the mask hook, the masks (row k of mask_host for the k-th masked sequence,
 * copied there when the sequence's pointer is elsewhere) and their row indices go to the
 * device in one asynchronous copy, then backend_token_bitmask. */
static int apply_masks(decoder_state *s, const decoder_seq *seqs, int n_seqs, int V) {
    int n = 0, rc;
    for (int i = 0; i < n_seqs; i++)
        n += seqs[i].allow && (seqs[i].logits || seqs[i].argmax);
    if (!n) return 0;
    if (s->mask_hook) s->mask_hook(s->mask_ctx);
    size_t words = (size_t)s->mask_words;
    if (!decoder_state_mask_rows(s, n)) return -ENOMEM;
    int32_t *hdr = backend_buffer_ptr(s->mask_host);
    uint32_t *rows = (uint32_t *)hdr + s->mask_cap, *end = rows + (size_t)s->mask_cap * words;
    int j = 0;
    for (int i = 0, r = 0; i < n_seqs; i++) {
        const decoder_seq *q = &seqs[i];
        if (!q->logits && !q->argmax) continue;
        int nr = q->logits && q->logits_all ? q->n_tokens : 1;
        if (q->allow) {
            uint32_t *dst = rows + (size_t)j * words;
            if (q->allow != dst) {
                if (q->allow + words > rows && q->allow < end) {
                    LOG_E("model",
                          "sequence %d: its allow mask is row %td of the state's mask rows, "
                          "which the masked sequences must use in order (this one: row %d) or "
                          "not at all (memory outside them is copied in)",
                          i, (q->allow - rows) / (ptrdiff_t)words, j);
                    return -EINVAL;
                }
                memcpy(dst, q->allow, words * sizeof *dst);
            }
            hdr[j++] = r + nr - 1;
        }
        r += nr;
    }
    size_t bytes = ((size_t)s->mask_cap + (size_t)n * words) * sizeof(int32_t);
    int32_t *dev = backend_buffer_ptr(s->mask_dev);
    TRY(backend_upload_async(s->st, dev, s->mask_host, 0, bytes));
    return backend_token_bitmask(s->st, backend_buffer_ptr(s->logits_buf), V,
                                 dev + s->mask_cap, dev, n, V);
}

/* Copies the logits rows (in sequence order from dev) to each sequence's host array; runs of
 * sequences whose host arrays follow each other (the engine's one logits array) go in one
 * download.  Sequences asking for their greedy token get it from one argmax over the rows
 * on the device (only the ids come back). */
static int download_outputs(decoder_state *s, const decoder_seq *seqs, int n_seqs, int n_rows,
                            int V) {
    backend_stream *st = s->st;
    const float *dev = backend_buffer_ptr(s->logits_buf);
    int rc, want_amax = 0;
    TRY(apply_masks(s, seqs, n_seqs, V));
    for (int i = 0; i < n_seqs; i++)
        want_amax |= seqs[i].argmax != NULL;
    if (want_amax) {
        int32_t *d = backend_buffer_ptr(s->amax_buf);
        TRY(backend_argmax(st, d, dev, n_rows, V));
        TRY(backend_download(st, s->amax_host, d, (size_t)n_rows * sizeof(int32_t)));
    }
    size_t r = 0, run_rows = 0, run_dev = 0;
    float *run_host = NULL;
    for (int i = 0; i <= n_seqs; i++) {
        const decoder_seq *q = i < n_seqs ? &seqs[i] : NULL;
        if (q && !q->logits && !q->argmax) continue;
        size_t rows = q ? (q->logits && q->logits_all ? (size_t)q->n_tokens : 1) : 0;
        if (q && q->argmax) *q->argmax = s->amax_host[r + rows - 1];
        if (run_rows && (!q || !q->logits || q->logits != run_host + run_rows * V)) {
            TRY(backend_download(st, run_host, dev + run_dev * V, run_rows * V * sizeof(float)));
            run_rows = 0;
        }
        if (!q) break;
        if (q->logits) {
            if (!run_rows) run_host = q->logits, run_dev = r;
            run_rows += rows;
        }
        r += rows;
    }
    return 0;
}

/* The decode batch's bucket (the smallest recorded batch size >= T), or 0: run it eagerly.
 * Only batches of one new token per sequence, each wanting its logits. */
static int graph_bucket(const decoder_state *s, const decoder_seq *seqs, int n_seqs) {
    if (!s->n_buckets || n_seqs > s->graph_buckets[s->n_buckets - 1]) return 0;
    for (int i = 0; i < n_seqs; i++)
        if (seqs[i].n_tokens != 1 || (!seqs[i].logits && !seqs[i].argmax)) return 0;
    for (int i = 0; i < s->n_buckets; i++)
        if (s->graph_buckets[i] >= n_seqs) return s->graph_buckets[i];
    return 0;
}

/* A decode step through a recorded graph: the batch padded to B sequences (padding: kv_len
 * 0, position -1, no blocks), positions bucketed to 256, 384, 512, 768, ... (2^k and
 * 1.5 * 2^k: the attention grid and block-table stride of the graph). */
static int forward_graph(const decoder_model *m, decoder_state *s, const kv_store *kv,
                         decoder_seq *seqs, int n_seqs, int B) {
    int rc, V = m->cfg.vocab_size, max_len = 0, nbt = 0;
    for (int i = 0; i < n_seqs; i++)
        if (seqs[i].start_pos + 1 > max_len) max_len = seqs[i].start_pos + 1;
    int C = 256; /* 256, 384, 512, 768, 1024, ...: at most a third of the grid idle */
    while (C < max_len)
        C = (C & (C - 1)) == 0 ? C + C / 2 : C / 3 * 4;
    int max_blocks = (C + kv->block_size - 1) / kv->block_size;
    if (kv->base != s->graph_kv) {
        backend_graph_reset(s->st);
        s->graph_kv = kv->base;
    }
    TRY(logits_reserve(m, s, B));
    for (int i = 0; i < n_seqs; i++)
        nbt += (seqs[i].start_pos + 1 + kv->block_size - 1) / kv->block_size;
    if (nbt > s->bt_cap) {
        int32_t *p = realloc(s->bt_indices, (size_t)nbt * sizeof *p);
        if (!p) return -ENOMEM;
        s->bt_indices = p;
        s->bt_cap = nbt;
    }
    int32_t *tok = s->pad_meta, *seq = tok + B, *pos = seq + B, *orow = pos + B, *qo = orow + B,
            *kvl = qo + B + 1, *bti = kvl + B;
    int b = 0;
    qo[0] = bti[0] = 0;
    for (int i = 0; i < B; i++) {
        int real = i < n_seqs;
        int end = real ? seqs[i].start_pos + 1 : 0,
            nb = (end + kv->block_size - 1) / kv->block_size;
        if (real) memcpy(s->bt_indices + b, seqs[i].block_table, (size_t)nb * sizeof(int32_t));
        b += nb;
        tok[i] = real ? tp_shard_token(m->tp, seqs[i].tokens[0]) : 0;
        seq[i] = i;
        pos[i] = end - 1;
        orow[i] = i;
        qo[i + 1] = i + 1;
        kvl[i] = end;
        bti[i + 1] = b;
    }
    backend_batch bb = {B, B, tok, seq, pos, qo, kvl, bti, s->bt_indices, B, orow};
    const backend_kv bkv = {kv->base,     kv->dtype,      kv->n_blocks, kv->block_size,
                            kv->n_layers, kv->n_kv_heads, kv->head_dim, m->cfg.sliding_window,
                            m->w.k_scale, m->w.v_scale};
    TRY(backend_graph_plan(s->st, &bb, C, max_blocks));
    rc = backend_graph_begin(s->st);
    if (rc < 0) return rc;
    if (rc == 0) {
        rc = run_layers(m, s, &bkv, B);
        if (!rc) rc = run_head(m, s, B);
        int e = backend_graph_end(s->st, rc == 0);
        if (!rc) rc = e;
        if (rc) return rc;
    }
    TRY(download_outputs(s, seqs, n_seqs, B, V));
    return backend_stream_sync(s->st);
}

int decoder_forward(const decoder_model *m, decoder_state *s, const kv_store *kv, decoder_seq *seqs,
                    int n_seqs) {
    const model_config *c = &m->cfg;
    int T, rc = check_seqs(m, s, kv, seqs, n_seqs, &T);
    if (rc) return rc;
    int V = c->vocab_size;
    const backend_kv bkv = {kv->base,     kv->dtype,      kv->n_blocks, kv->block_size,
                            kv->n_layers, kv->n_kv_heads, kv->head_dim, m->cfg.sliding_window,
                            m->w.k_scale, m->w.v_scale};
    backend_stream *st = s->st;
    if (m->tp && m->tp->rank == 0) TRY(tp_step_send(m->tp->coll, seqs, n_seqs)); /* the workers' */
    int B = graph_bucket(s, seqs, n_seqs);
    if (B) {
        if ((rc = forward_graph(m, s, kv, seqs, n_seqs, B)) != -EIO) return rc;
        LOG_E("model", "recorded decode step failed: running every step eagerly from now on");
        backend_stream_sync(st); /* clears nothing, but reports a sticky device error */
        decoder_state_set_graphs(s, 0);
    }
    int n_out = plan_batch(m, s, kv, seqs, n_seqs, T);
    if (n_out < 0) return n_out;
    TRY(run_layers(m, s, &bkv, T));
    if (!n_out) return backend_stream_sync(st);

    TRY(logits_reserve(m, s, n_out));
    TRY(run_head(m, s, n_out));
    TRY(download_outputs(s, seqs, n_seqs, n_out, V));
    return backend_stream_sync(st);
}
