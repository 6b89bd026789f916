/*
 * qwen2_cuda — see qwen2_cuda.h.
 */
#include "model/qwen2_cuda.h"

#include "base/log.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static dcu_host_mat hm(const weight_mat *w) {
    dcu_host_mat r = {w->data, (int)w->dtype, w->rows, w->cols};
    return r;
}

int qwen2_cuda_open(qwen2_cuda *g, const qwen2_model *m, int device, int max_tokens, int max_seqs,
                    int max_blocks, int progress, char *err, size_t errlen) {
    memset(g, 0, sizeof *g);
    const model_config *c = &m->cfg;
    if (max_tokens <= 0 || max_seqs <= 0 || max_blocks <= 0) {
        snprintf(err, errlen, "qwen2_cuda: max_tokens %d, max_seqs %d, max_blocks %d must be > 0",
                 max_tokens, max_seqs, max_blocks);
        return -EINVAL;
    }
    g->api = cuda_open(device, &g->info, err, errlen);
    if (!g->api) return -ENODEV;
    g->ctx = g->api->ctx_create(device, err, errlen);
    if (!g->ctx) return -ENODEV;
    dcu_host_layer *L = calloc((size_t)c->n_layers, sizeof *L);
    if (!L) {
        qwen2_cuda_close(g);
        return -ENOMEM;
    }
    for (int l = 0; l < c->n_layers; l++) {
        const layer_weights *w = &m->w.layers[l];
        L[l] = (dcu_host_layer){w->attn_norm, hm(&w->wq),     hm(&w->wk),   hm(&w->wv),
                                w->bq,        w->bk,          w->bv,        hm(&w->wo),
                                w->mlp_norm,  hm(&w->w_gate), hm(&w->w_up), hm(&w->w_down)};
    }
    dcu_model_desc d = {
        .vocab = c->vocab_size,
        .hidden = c->hidden_size,
        .n_layers = c->n_layers,
        .n_heads = c->n_heads,
        .n_kv_heads = c->n_kv_heads,
        .head_dim = c->head_dim,
        .inter = c->intermediate_size,
        .rms_eps = c->rms_norm_eps,
        .rope_inv_freq = m->rope_inv_freq,
        .embed = hm(&m->w.embed),
        .lm_head = hm(&m->w.lm_head),
        .tied = m->w.lm_head.data == m->w.embed.data,
        .final_norm = m->w.final_norm,
        .layers = L,
        .max_tokens = max_tokens,
        .max_seqs = max_seqs,
        .max_blocks = max_blocks,
        .progress = progress,
    };
    g->dm = g->api->model_create(g->ctx, &d, err, errlen);
    free(L);
    if (!g->dm) {
        qwen2_cuda_close(g);
        return -ENOMEM;
    }
    g->max_tokens = max_tokens;
    g->max_seqs = max_seqs;
    g->max_blocks = max_blocks;
    g->vocab = c->vocab_size;
    size_t T = (size_t)max_tokens;
    g->tok = malloc(T * 4);
    g->pos = malloc(T * 4);
    g->seq = malloc(T * 4);
    g->out_rows = malloc(T * 4);
    g->amax = malloc(T * 4);
    g->bt = malloc((size_t)max_seqs * max_blocks * 4);
    g->logits = malloc(T * (size_t)c->vocab_size * 4);
    if (!g->tok || !g->pos || !g->seq || !g->out_rows || !g->amax || !g->bt || !g->logits) {
        qwen2_cuda_close(g);
        snprintf(err, errlen, "qwen2_cuda: out of host memory");
        return -ENOMEM;
    }
    return 0;
}

void qwen2_cuda_close(qwen2_cuda *g) {
    if (g->api) {
        if (g->kv.base) g->api->free(g->ctx, g->kv.base);
        if (g->dm) g->api->model_free(g->dm);
        if (g->ctx) g->api->ctx_free(g->ctx);
    }
    free(g->tok);
    free(g->pos);
    free(g->seq);
    free(g->out_rows);
    free(g->amax);
    free(g->bt);
    free(g->logits);
    memset(g, 0, sizeof *g);
}

size_t qwen2_cuda_kv_block_bytes(const model_config *c, int block_size, int dtype) {
    return (size_t)c->n_layers * 2 * (size_t)block_size * (size_t)(c->n_kv_heads * c->head_dim) *
           (dtype == DCU_F32 ? 4 : 2);
}

int qwen2_cuda_kv_alloc(qwen2_cuda *g, const model_config *c, int n_blocks, int block_size,
                        int dtype, char *err, size_t errlen) {
    if (n_blocks <= 0 || block_size <= 0 || (dtype != DCU_BF16 && dtype != DCU_F32)) {
        snprintf(err, errlen, "KV region: %d blocks of %d tokens, dtype %d (need > 0, bf16|f32)",
                 n_blocks, block_size, dtype);
        return -EINVAL;
    }
    size_t bytes = (size_t)n_blocks * qwen2_cuda_kv_block_bytes(c, block_size, dtype);
    if (g->kv.base) g->api->free(g->ctx, g->kv.base);
    g->kv.base = g->api->alloc(g->ctx, bytes);
    if (!g->kv.base) {
        snprintf(err, errlen, "out of GPU memory for the KV cache (%.2f GB for %d blocks)",
                 bytes / 1e9, n_blocks);
        return -ENOMEM;
    }
    g->api->memset0(g->ctx, g->kv.base, bytes);
    g->kv.dtype = dtype;
    g->kv.n_blocks = n_blocks;
    g->kv.block_size = block_size;
    g->kv.n_layers = c->n_layers;
    g->kv.kv_dim = c->n_kv_heads * c->head_dim;
    return g->api->sync(g->ctx, err, errlen);
}

int qwen2_cuda_forward(qwen2_cuda *g, qwen2_seq *seqs, int n_seqs, int32_t *greedy) {
    if (!g->kv.base) {
        LOG_E("qwen2_cuda", "forward before the KV region was allocated");
        return -EINVAL;
    }
    if (n_seqs <= 0 || n_seqs > g->max_seqs) {
        LOG_E("qwen2_cuda", "%d sequences in one call; accepted 1..%d", n_seqs, g->max_seqs);
        return -EINVAL;
    }
    int T = 0, stride = 1;
    for (int i = 0; i < n_seqs; i++) {
        const qwen2_seq *q = &seqs[i];
        int end = q->start_pos + q->n_tokens;
        if (q->n_tokens <= 0 || q->start_pos < 0 || T + q->n_tokens > g->max_tokens) {
            LOG_E("qwen2_cuda",
                  "sequence %d: n_tokens %d, start_pos %d (total %d, workspace holds %d)", i,
                  q->n_tokens, q->start_pos, T + q->n_tokens, g->max_tokens);
            return -EINVAL;
        }
        int need = (end + g->kv.block_size - 1) / g->kv.block_size;
        if (q->n_blocks < need || need > g->max_blocks) {
            LOG_E("qwen2_cuda", "sequence %d: %d blocks of %d tokens cannot hold %d positions", i,
                  q->n_blocks, g->kv.block_size, end);
            return -EINVAL;
        }
        for (int b = 0; b < need; b++)
            if (q->block_table[b] < 0 || q->block_table[b] >= g->kv.n_blocks) {
                LOG_E("qwen2_cuda", "sequence %d: block id %d outside the KV store [0, %d)", i,
                      q->block_table[b], g->kv.n_blocks);
                return -EINVAL;
            }
        for (int t = 0; t < q->n_tokens; t++)
            if (q->tokens[t] < 0 || q->tokens[t] >= g->vocab) {
                LOG_E("qwen2_cuda", "sequence %d: token id %d outside the vocabulary [0, %d)", i,
                      q->tokens[t], g->vocab);
                return -EINVAL;
            }
        if (need > stride) stride = need;
        T += q->n_tokens;
    }
    int n_out = 0, t = 0, want_logits = 0;
    for (int i = 0; i < n_seqs; i++) {
        const qwen2_seq *q = &seqs[i];
        int need = (q->start_pos + q->n_tokens + g->kv.block_size - 1) / g->kv.block_size;
        memcpy(g->bt + (size_t)i * stride, q->block_table, (size_t)need * 4);
        for (int b = need; b < stride; b++)
            g->bt[(size_t)i * stride + b] = 0;
        for (int j = 0; j < q->n_tokens; j++, t++) {
            g->tok[t] = q->tokens[j];
            g->pos[t] = q->start_pos + j;
            g->seq[t] = i;
            if (q->logits && q->logits_all) g->out_rows[n_out++] = t;
        }
        if (!(q->logits && q->logits_all)) g->out_rows[n_out++] = t - 1;
        if (q->logits) want_logits = 1;
    }
    dcu_batch b = {T,      g->tok, g->pos, g->seq,      n_seqs,
                   g->bt,  stride, n_out,  g->out_rows, want_logits ? g->logits : NULL,
                   g->amax};
    char err[512];
    int rc = g->api->forward(g->dm, &g->kv, &b, err, sizeof err);
    if (rc) {
        LOG_E("qwen2_cuda", "%s", err);
        return rc;
    }
    int r = 0;
    size_t V = (size_t)g->vocab;
    for (int i = 0; i < n_seqs; i++) {
        qwen2_seq *q = &seqs[i];
        if (q->logits && q->logits_all) {
            memcpy(q->logits, g->logits + (size_t)r * V, (size_t)q->n_tokens * V * 4);
            r += q->n_tokens;
            if (greedy) greedy[i] = g->amax[r - 1];
        } else {
            if (q->logits) memcpy(q->logits, g->logits + (size_t)r * V, V * 4);
            if (greedy) greedy[i] = g->amax[r];
            r++;
        }
    }
    return 0;
}
