/*
 * qwen2 — Qwen2 forward pass (see qwen2.h).  Reads top-down like the math: embed, then
 * per layer attention block and MLP block, then the head.  Threading: matmuls split
 * weight rows, attention splits (token, head) pairs, the MLP activation splits tokens;
 * none of these splits changes any value.
 */
#include "model/qwen2.h"

#include "base/log.h"
#include "kernels/cpu/cpu_matmul.h"
#include "model/hf_cache.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QWEN2_MAX_GROUP 64 /* query heads per KV head */

/* ---- model ---------------------------------------------------------------- */

int qwen2_load(qwen2_model *m, const char *model_arg, int progress, char *err, size_t errlen) {
    memset(m, 0, sizeof *m);
    int rc = hf_cache_resolve(model_arg, m->dir, sizeof m->dir, err, errlen);
    if (rc) return rc;
    if ((rc = model_config_load(&m->cfg, m->dir, err, errlen))) return rc;
    if (m->cfg.n_heads / m->cfg.n_kv_heads > QWEN2_MAX_GROUP || m->cfg.head_dim > 1024) {
        snprintf(err, errlen,
                 "%s/config.json: %d query heads per KV head and head_dim %d; supported: at most "
                 "%d and 1024",
                 m->dir, m->cfg.n_heads / m->cfg.n_kv_heads, m->cfg.head_dim, QWEN2_MAX_GROUP);
        return -EINVAL;
    }
    if ((rc = weights_load(&m->w, &m->cfg, m->dir, err, errlen))) return rc;
    int half = m->cfg.head_dim / 2;
    m->rope_inv_freq = malloc((size_t)half * sizeof(float));
    if (!m->rope_inv_freq) {
        weights_free(&m->w);
        return -ENOMEM;
    }
    /* as transformers: 1 / theta ** (arange(0, d, 2) / d), in f32 */
    for (int i = 0; i < half; i++)
        m->rope_inv_freq[i] =
            1.0f / powf(m->cfg.rope_theta, (float)(2 * i) / (float)m->cfg.head_dim);
    if (progress) st_set_prefault(&m->w.st, m->dir);
    return 0;
}

void qwen2_free(qwen2_model *m) {
    weights_free(&m->w);
    free(m->rope_inv_freq);
    memset(m, 0, sizeof *m);
}

/* ---- KV store ----------------------------------------------------------- */

size_t qwen2_kv_block_bytes(const model_config *c, int block_size) {
    return (size_t)c->n_layers * 2 * (size_t)block_size * (size_t)(c->n_kv_heads * c->head_dim) *
           sizeof(float);
}

int kv_store_init(kv_store *kv, const model_config *c, int n_blocks, int block_size) {
    memset(kv, 0, sizeof *kv);
    if (n_blocks <= 0 || block_size <= 0) return -EINVAL;
    kv->base = calloc((size_t)n_blocks, qwen2_kv_block_bytes(c, block_size));
    if (!kv->base) return -ENOMEM;
    kv->n_blocks = n_blocks;
    kv->block_size = block_size;
    kv->n_layers = c->n_layers;
    kv->kv_dim = c->n_kv_heads * c->head_dim;
    return 0;
}

void kv_store_free(kv_store *kv) {
    free(kv->base);
    memset(kv, 0, sizeof *kv);
}

/* K (which=0) or V (which=1) of a position of a sequence, layer l: (kv_dim) */
static inline float *kv_at(const kv_store *kv, const int32_t *table, int pos, int l, int which) {
    size_t blk = (size_t)table[pos / kv->block_size], slot = (size_t)(pos % kv->block_size);
    size_t per_block = (size_t)kv->n_layers * 2 * kv->block_size * kv->kv_dim;
    return kv->base + blk * per_block +
           (((size_t)l * 2 + which) * kv->block_size + slot) * kv->kv_dim;
}

/* ---- state ---------------------------------------------------------------- */

struct qwen2_state {
    int max_tokens;   /* capacity in tokens */
    cpu_pool *pool;   /* threads (not owned) */
    float *x;         /* (T, hidden) residual stream */
    float *xb;        /* (T, hidden) normed input */
    float *q;         /* (T, hidden) */
    float *k;         /* (T, kv_dim) */
    float *v;         /* (T, kv_dim) */
    float *att;       /* (T, hidden) attention output */
    float *hb;        /* (T, intermediate) gate, then silu(gate) * up */
    float *hb2;       /* (T, intermediate) up */
    int32_t *tok_seq; /* (T) sequence index of each token */
    int32_t *tok_pos; /* (T) position of each token */
    float *head_in;   /* (max_tokens, hidden) rows gathered for lm_head */
    float *head_out;  /* (head_cap, vocab) lm_head output of last-token rows */
    int head_cap;     /* rows of head_out */
};

qwen2_state *qwen2_state_init(const qwen2_model *m, int max_tokens, cpu_pool *pool) {
    const model_config *c = &m->cfg;
    if (max_tokens <= 0) return NULL;
    qwen2_state *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    size_t T = (size_t)max_tokens, h = (size_t)c->hidden_size,
           kvd = (size_t)(c->n_kv_heads * c->head_dim), I = (size_t)c->intermediate_size;
    s->max_tokens = max_tokens;
    s->pool = pool;
    s->x = malloc(T * h * 4);
    s->xb = malloc(T * h * 4);
    s->q = malloc(T * h * 4);
    s->k = malloc(T * kvd * 4);
    s->v = malloc(T * kvd * 4);
    s->att = malloc(T * h * 4);
    s->hb = malloc(T * I * 4);
    s->hb2 = malloc(T * I * 4);
    s->tok_seq = malloc(T * 4);
    s->tok_pos = malloc(T * 4);
    s->head_in = malloc(T * h * 4);
    if (!s->x || !s->xb || !s->q || !s->k || !s->v || !s->att || !s->hb || !s->hb2 || !s->tok_seq ||
        !s->tok_pos || !s->head_in) {
        qwen2_state_free(s);
        return NULL;
    }
    return s;
}

void qwen2_state_free(qwen2_state *s) {
    if (!s) return;
    free(s->x);
    free(s->xb);
    free(s->q);
    free(s->k);
    free(s->v);
    free(s->att);
    free(s->hb);
    free(s->hb2);
    free(s->tok_seq);
    free(s->tok_pos);
    free(s->head_in);
    free(s->head_out);
    free(s);
}

int qwen2_state_max_tokens(const qwen2_state *s) {
    return s->max_tokens;
}

/* ---- small ops ------------------------------------------------------------ */

/* out (n) = w * (x / sqrt(mean(x^2) + eps)) */
static void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++)
        out[i] = w[i] * (x[i] * inv);
}

/* rotate-half RoPE on n_heads vectors of head_dim at vec (n_heads, head_dim) */
static void rope(float *vec, int n_heads, int head_dim, const float *cosv, const float *sinv) {
    int half = head_dim / 2;
    for (int hh = 0; hh < n_heads; hh++) {
        float *v = vec + (size_t)hh * head_dim;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cosv[i] - b * sinv[i];
            v[i + half] = b * cosv[i] + a * sinv[i];
        }
    }
}

/* ---- attention ------------------------------------------------------------ */

typedef struct att_job {
    const qwen2_model *m;
    qwen2_state *s;
    const kv_store *kv;
    const qwen2_seq *seqs;
    int layer;
} att_job;

/* One token and one KV head: the `group` query heads sharing it read each K/V row once.
 * Per head: scores = q.k * scale over positions 0..pos in order, softmax, out = sum p_i v_i
 * in order -- the same arithmetic whatever the batch or chunking. */
static void att_task(void *ctx, int task) {
    const att_job *j = ctx;
    const model_config *c = &j->m->cfg;
    int hd = c->head_dim, group = c->n_heads / c->n_kv_heads;
    int t = task / c->n_kv_heads, kvh = task % c->n_kv_heads;
    int pos = j->s->tok_pos[t], np = pos + 1;
    const qwen2_seq *sq = &j->seqs[j->s->tok_seq[t]];
    float *scores = cpu_scratch(1, (size_t)group * np); /* (group, pos + 1) */
    if (!scores) abort(); /* a worker cannot report; group * (pos + 1) floats */
    const float *q =
        j->s->q + (size_t)t * c->hidden_size + (size_t)kvh * group * hd; /* (group, hd) */
    float *out =
        j->s->att + (size_t)t * c->hidden_size + (size_t)kvh * group * hd; /* (group, hd) */
    const float scale = (float)(1.0 / sqrt((double)hd));
    float mx[QWEN2_MAX_GROUP], sum[QWEN2_MAX_GROUP], w[QWEN2_MAX_GROUP];
    for (int g = 0; g < group; g++)
        mx[g] = -INFINITY, sum[g] = 0.0f;
    for (int p = 0; p < np; p++) {
        const float *k = kv_at(j->kv, sq->block_table, p, j->layer, 0) + (size_t)kvh * hd;
        cpu_dot_heads(w, q, k, group, hd);
        for (int g = 0; g < group; g++) {
            float sc = w[g] * scale;
            scores[(size_t)g * np + p] = sc;
            if (sc > mx[g]) mx[g] = sc;
        }
    }
    for (int g = 0; g < group; g++)
        for (int p = 0; p < np; p++) {
            float e = expf(scores[(size_t)g * np + p] - mx[g]);
            scores[(size_t)g * np + p] = e;
            sum[g] += e;
        }
    memset(out, 0, (size_t)group * hd * sizeof(float));
    for (int p = 0; p < np; p++) {
        const float *v = kv_at(j->kv, sq->block_table, p, j->layer, 1) + (size_t)kvh * hd;
        for (int g = 0; g < group; g++)
            w[g] = scores[(size_t)g * np + p] / sum[g];
        cpu_axpy_heads(out, w, v, group, hd);
    }
}

/* ---- MLP activation ------------------------------------------------------- */

typedef struct act_job {
    float *g;       /* (T, I) gate in, silu(gate) * up out */
    const float *u; /* (T, I) up */
    int I;
} act_job;

static void act_task(void *ctx, int t) {
    const act_job *j = ctx;
    float *g = j->g + (size_t)t * j->I;
    const float *u = j->u + (size_t)t * j->I;
    for (int i = 0; i < j->I; i++)
        g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* ---- forward -------------------------------------------------------------- */

static int check_seqs(const qwen2_model *m, const qwen2_state *s, const kv_store *kv,
                      const qwen2_seq *seqs, int n_seqs, int *total) {
    const model_config *c = &m->cfg;
    if (kv->n_layers != c->n_layers || kv->kv_dim != c->n_kv_heads * c->head_dim) {
        LOG_E("qwen2", "kv store shape (layers %d, kv_dim %d) does not match the model (%d, %d)",
              kv->n_layers, kv->kv_dim, c->n_layers, c->n_kv_heads * c->head_dim);
        return -EINVAL;
    }
    int T = 0;
    for (int i = 0; i < n_seqs; i++) {
        const qwen2_seq *q = &seqs[i];
        int end = q->start_pos + q->n_tokens;
        if (q->n_tokens <= 0 || q->start_pos < 0) {
            LOG_E("qwen2",
                  "sequence %d: n_tokens %d, start_pos %d (need n_tokens >= 1, start_pos >= 0)", i,
                  q->n_tokens, q->start_pos);
            return -EINVAL;
        }
        if (end > c->max_position) {
            LOG_E("qwen2", "sequence %d: position %d beyond max_position_embeddings %d", i, end - 1,
                  c->max_position);
            return -EINVAL;
        }
        if ((long)q->n_blocks * kv->block_size < end) {
            LOG_E("qwen2", "sequence %d: %d blocks of %d tokens cannot hold %d positions", i,
                  q->n_blocks, kv->block_size, end);
            return -EINVAL;
        }
        for (int b = 0; b < (end + kv->block_size - 1) / kv->block_size; b++)
            if (q->block_table[b] < 0 || q->block_table[b] >= kv->n_blocks) {
                LOG_E("qwen2", "sequence %d: block id %d outside the KV store [0, %d)", i,
                      q->block_table[b], kv->n_blocks);
                return -EINVAL;
            }
        for (int t = 0; t < q->n_tokens; t++)
            if (q->tokens[t] < 0 || q->tokens[t] >= c->vocab_size) {
                LOG_E("qwen2", "sequence %d: token id %d outside the vocabulary [0, %d)", i,
                      q->tokens[t], c->vocab_size);
                return -EINVAL;
            }
        T += q->n_tokens;
    }
    if (T > s->max_tokens) {
        LOG_E("qwen2", "%d tokens in one forward call; the workspace holds %d", T, s->max_tokens);
        return -EINVAL;
    }
    *total = T;
    return 0;
}

int qwen2_forward(const qwen2_model *m, qwen2_state *s, const kv_store *kv, qwen2_seq *seqs,
                  int n_seqs) {
    const model_config *c = &m->cfg;
    const model_weights *w = &m->w;
    int T, rc = check_seqs(m, s, kv, seqs, n_seqs, &T);
    if (rc) return rc;
    int h = c->hidden_size, kvd = c->n_kv_heads * c->head_dim, I = c->intermediate_size,
        hd = c->head_dim, half = hd / 2;

    /* token -> (sequence, position); embeddings */
    for (int i = 0, t = 0; i < n_seqs; i++)
        for (int j = 0; j < seqs[i].n_tokens; j++, t++) {
            s->tok_seq[t] = i;
            s->tok_pos[t] = seqs[i].start_pos + j;
            const char *row = (const char *)w->embed.data + (size_t)seqs[i].tokens[j] * (size_t)h *
                                                                cpu_dtype_size(w->embed.dtype);
            cpu_row_to_f32(s->x + (size_t)t * h, row, w->embed.dtype, h);
        }

    float cosv[512], sinv[512]; /* head_dim / 2 <= 512 (checked at load) */
    for (int l = 0; l < c->n_layers; l++) {
        const layer_weights *L = &w->layers[l];
        /* attention block */
        for (int t = 0; t < T; t++)
            rmsnorm(s->xb + (size_t)t * h, s->x + (size_t)t * h, L->attn_norm, h, c->rms_norm_eps);
        cpu_matmul_op qkv[3] = {{s->q, s->xb, L->wq.data, L->wq.dtype, L->bq, T, h, h},
                                {s->k, s->xb, L->wk.data, L->wk.dtype, L->bk, T, kvd, h},
                                {s->v, s->xb, L->wv.data, L->wv.dtype, L->bv, T, kvd, h}};
        cpu_matmul_batch(s->pool, qkv, 3);
        for (int t = 0; t < T; t++) {
            float pos = (float)s->tok_pos[t];
            for (int i = 0; i < half; i++) {
                float a = pos * m->rope_inv_freq[i];
                cosv[i] = cosf(a);
                sinv[i] = sinf(a);
            }
            rope(s->q + (size_t)t * h, c->n_heads, hd, cosv, sinv);
            rope(s->k + (size_t)t * kvd, c->n_kv_heads, hd, cosv, sinv);
            const qwen2_seq *sq = &seqs[s->tok_seq[t]];
            memcpy(kv_at(kv, sq->block_table, s->tok_pos[t], l, 0), s->k + (size_t)t * kvd,
                   (size_t)kvd * 4);
            memcpy(kv_at(kv, sq->block_table, s->tok_pos[t], l, 1), s->v + (size_t)t * kvd,
                   (size_t)kvd * 4);
        }
        att_job aj = {m, s, kv, seqs, l};
        cpu_pool_run(s->pool, T * c->n_kv_heads, att_task, &aj);
        cpu_matmul(s->pool, s->xb, s->att, L->wo.data, L->wo.dtype, NULL, T, h, h);
        for (size_t i = 0; i < (size_t)T * h; i++)
            s->x[i] += s->xb[i];
        /* MLP block */
        for (int t = 0; t < T; t++)
            rmsnorm(s->xb + (size_t)t * h, s->x + (size_t)t * h, L->mlp_norm, h, c->rms_norm_eps);
        cpu_matmul_op gate_up[2] = {{s->hb, s->xb, L->w_gate.data, L->w_gate.dtype, NULL, T, I, h},
                                    {s->hb2, s->xb, L->w_up.data, L->w_up.dtype, NULL, T, I, h}};
        cpu_matmul_batch(s->pool, gate_up, 2);
        act_job mj = {s->hb, s->hb2, I};
        cpu_pool_run(s->pool, T, act_task, &mj);
        cpu_matmul(s->pool, s->xb, s->hb, L->w_down.data, L->w_down.dtype, NULL, T, h, I);
        for (size_t i = 0; i < (size_t)T * h; i++)
            s->x[i] += s->xb[i];
    }

    /* head: sequences wanting every row get their own matmul; last rows are batched */
    int n_last = 0;
    for (int i = 0, t0 = 0; i < n_seqs; t0 += seqs[i].n_tokens, i++) {
        if (!seqs[i].logits) continue;
        if (seqs[i].logits_all) {
            for (int j = 0; j < seqs[i].n_tokens; j++)
                rmsnorm(s->head_in + (size_t)j * h, s->x + (size_t)(t0 + j) * h, w->final_norm, h,
                        c->rms_norm_eps);
            cpu_matmul(s->pool, seqs[i].logits, s->head_in, w->lm_head.data, w->lm_head.dtype, NULL,
                       seqs[i].n_tokens, c->vocab_size, h);
        } else {
            n_last++;
        }
    }
    if (n_last) {
        if (s->head_cap < n_last) {
            free(s->head_out);
            s->head_out = malloc((size_t)n_last * c->vocab_size * sizeof(float));
            s->head_cap = s->head_out ? n_last : 0;
            if (!s->head_out) return -ENOMEM;
        }
        int r = 0;
        for (int i = 0, t0 = 0; i < n_seqs; t0 += seqs[i].n_tokens, i++)
            if (seqs[i].logits && !seqs[i].logits_all)
                rmsnorm(s->head_in + (size_t)(r++) * h,
                        s->x + (size_t)(t0 + seqs[i].n_tokens - 1) * h, w->final_norm, h,
                        c->rms_norm_eps);
        cpu_matmul(s->pool, s->head_out, s->head_in, w->lm_head.data, w->lm_head.dtype, NULL,
                   n_last, c->vocab_size, h);
        r = 0;
        for (int i = 0; i < n_seqs; i++)
            if (seqs[i].logits && !seqs[i].logits_all)
                memcpy(seqs[i].logits, s->head_out + (size_t)(r++) * c->vocab_size,
                       (size_t)c->vocab_size * sizeof(float));
    }
    return 0;
}
