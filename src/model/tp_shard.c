/*
 * tp_shard — one rank's share of a tensor-parallel decoder and the step message (see
 * tp_shard.h).  Which tensor is cut how is decided here by its Hugging Face name; weights.c
 * applies the cut, decoder.c calls the all-reduces and the lm_head gather.
 */
#include "model/tp_shard.h"

#include "base/log.h"
#include "model/decoder.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "tp"

int tp_shard_check(const model_config *c, int n, char *err, size_t errlen) {
    if (n == 1) return 0;
    const char *what = NULL;
    int val = 0;
    if (c->n_heads % n)
        what = "num_attention_heads", val = c->n_heads;
    else if (c->n_kv_heads % n && n % c->n_kv_heads)
        what = "num_key_value_heads (N must divide it or be a multiple of it)", val = c->n_kv_heads;
    else if (c->intermediate_size % n)
        what = "intermediate_size", val = c->intermediate_size;
    else if (c->n_experts && c->moe_intermediate_size % n)
        what = "moe_intermediate_size", val = c->moe_intermediate_size;
    if (!what) return 0;
    snprintf(err, errlen,
             "--tensor-parallel-size %d does not divide the model's %s %d; accepted: a size "
             "dividing the heads and the MLP widths",
             n, what, val);
    return -EINVAL;
}

int tp_shard_init(tp_shard *sh, const model_config *c, collective *coll, char *err, size_t errlen) {
    memset(sh, 0, sizeof *sh);
    int n = collective_size(coll), r = collective_rank(coll),
        rc = tp_shard_check(c, n, err, errlen);
    if (rc) return rc;
    sh->size = n;
    sh->rank = r;
    sh->coll = coll;
    sh->head_dim = c->head_dim;
    sh->n_heads = c->n_heads / n;
    sh->head0 = r * sh->n_heads;
    if (n <= c->n_kv_heads) {
        sh->n_kv_heads = c->n_kv_heads / n;
        sh->kv_head0 = r * sh->n_kv_heads;
    } else { /* replicated: rank r holds head r K / N */
        sh->n_kv_heads = 1;
        sh->kv_head0 = r * c->n_kv_heads / n;
    }
    sh->inter = c->intermediate_size / n;
    sh->inter0 = r * sh->inter;
    sh->moe_inter = c->n_experts ? c->moe_intermediate_size / n : 0;
    sh->moe_inter0 = r * sh->moe_inter;
    sh->vocab = c->vocab_size;
    sh->vocab_part = (c->vocab_size + n - 1) / n;
    sh->vocab0 = r * sh->vocab_part;
    return 0;
}

void tp_shard_free(tp_shard *sh) {
    double secs = 0;
    long calls = 0;
    if (sh->coll) collective_stats(sh->coll, &secs, &calls);
    if (calls) /* the cost of tensor parallelism's communication, for the benchmarks */
        LOG_I(MOD, "rank %d: %ld collectives, %.3f s in them (%.1f us each)", sh->rank, calls,
              secs, secs / (double)calls * 1e6);
    backend_buffer_free(sh->head_buf);
    sh->head_buf = NULL;
    sh->head_cap = 0;
}

void tp_shard_config(const tp_shard *sh, const model_config *c, model_config *out) {
    *out = *c;
    if (!sh) return;
    out->n_heads = sh->n_heads;
    out->n_kv_heads = sh->n_kv_heads;
    out->q_dim = sh->n_heads * c->head_dim;
    out->intermediate_size = sh->inter;
    out->moe_intermediate_size = sh->moe_inter;
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

tp_split tp_shard_split(const tp_shard *sh, const char *name) {
    tp_split s = {TP_WHOLE, 0, 0, 0};
    int hd = sh->head_dim;
    if (strstr(name, ".self_attn.q_proj."))
        s = (tp_split){TP_ROWS, sh->head0 * hd, sh->n_heads * hd, 0};
    else if (strstr(name, ".self_attn.k_proj.") || strstr(name, ".self_attn.v_proj."))
        s = (tp_split){TP_ROWS, sh->kv_head0 * hd, sh->n_kv_heads * hd, 0};
    else if (ends_with(name, ".self_attn.o_proj.weight"))
        s = (tp_split){TP_COLS, sh->head0 * hd, sh->n_heads * hd, 0};
    else if (strstr(name, ".experts.")) {
        if (ends_with(name, ".down_proj.weight") || ends_with(name, ".w2.weight"))
            s = (tp_split){TP_COLS, sh->moe_inter0, sh->moe_inter, 0};
        else
            s = (tp_split){TP_ROWS, sh->moe_inter0, sh->moe_inter, 0};
    } else if (ends_with(name, ".mlp.gate_proj.weight") || ends_with(name, ".mlp.up_proj.weight"))
        s = (tp_split){TP_ROWS, sh->inter0, sh->inter, 0};
    else if (ends_with(name, ".mlp.down_proj.weight"))
        s = (tp_split){TP_COLS, sh->inter0, sh->inter, 0};
    else if (!strcmp(name, "model.embed_tokens.weight") || !strcmp(name, "lm_head.weight")) {
        int have = sh->vocab - sh->vocab0;
        if (have > sh->vocab_part) have = sh->vocab_part;
        if (have < 0) have = 0;
        /* the embedding has one more zero row: where every other rank's token looks up */
        s = (tp_split){TP_VOCAB, sh->vocab0, have,
                       sh->vocab_part + (!strcmp(name, "lm_head.weight") ? 0 : 1)};
    }
    return s;
}

int32_t tp_shard_token(const tp_shard *sh, int32_t tok) {
    if (!sh) return tok;
    int32_t i = tok - sh->vocab0;
    return i >= 0 && i < sh->vocab_part ? i : sh->vocab_part;
}

int tp_shard_all_reduce(tp_shard *sh, backend *be, backend_stream *st, void *buf, backend_dtype dt,
                        size_t n) {
    (void)be;
    size_t chunk = collective_slot_bytes(sh->coll) / backend_dtype_size(dt);
    for (size_t o = 0; o < n; o += chunk) {
        size_t k = n - o < chunk ? n - o : chunk;
        int rc =
            collective_all_reduce(sh->coll, st, (char *)buf + o * backend_dtype_size(dt), dt, k);
        if (rc) return rc;
    }
    return 0;
}

int tp_shard_lm_head(tp_shard *sh, backend *be, backend_stream *st, const backend_matmul_op *op) {
    int N = sh->size, P = sh->vocab_part, V = sh->vocab, rc;
    size_t slot = collective_slot_bytes(sh->coll), row = (size_t)P * sizeof(float);
    int rows_per = (int)(slot / row);
    if (rows_per < 1) {
        LOG_E(MOD, "a logits row of %zu bytes per rank does not fit the group's %zu", row, slot);
        return -EINVAL;
    }
    if (rows_per > op->T) rows_per = op->T;
    size_t need = (size_t)rows_per * row * (size_t)(N + 1);
    if (need > sh->head_cap) {
        backend_buffer_free(sh->head_buf);
        sh->head_buf = backend_buffer_alloc(be, need, 0);
        sh->head_cap = sh->head_buf ? need : 0;
        if (!sh->head_buf) return -ENOMEM;
    }
    char *local = backend_buffer_ptr(sh->head_buf), *all = local + (size_t)rows_per * row;
    const char *x = op->x;
    size_t xrow = (size_t)op->K * backend_dtype_size(op->x_dt);
    for (int t0 = 0; t0 < op->T; t0 += rows_per) {
        int k = op->T - t0 < rows_per ? op->T - t0 : rows_per;
        backend_matmul_op m = *op;
        m.y = local;
        m.x = x + (size_t)t0 * xrow;
        m.T = k;
        m.N = P;
        if ((rc = backend_matmul(st, &m, 1))) return rc;
        if ((rc = collective_all_gather(sh->coll, st, all, local, (size_t)k * row))) return rc;
        /* all: (N, k, P) -> y rows t0.., columns r P .. (the padding past V dropped) */
        for (int i = 0; i < k; i++)
            for (int r = 0; r < N; r++) {
                int cols = V - r * P < P ? V - r * P : P;
                if (cols <= 0) continue;
                float *dst = (float *)op->y + (size_t)(t0 + i) * V + (size_t)r * P;
                const char *src = all + ((size_t)r * k + i) * row;
                if (backend_is_cpu(be))
                    memcpy(dst, src, (size_t)cols * sizeof(float));
                else if ((rc = backend_copy(st, dst, src, (size_t)cols * sizeof(float))))
                    return rc;
            }
    }
    return 0;
}

/* ---- the step message ---------------------------------------------------------------
 * int32 words: kind, n_seqs, then per sequence (n_tokens, start_pos, n_blocks, flags),
 * then every sequence's tokens, then every sequence's block table (n_blocks entries).
 * flags: 1 logits wanted, 2 logits_all, 4 argmax wanted. */

static int send_words(collective *c, const int32_t *w, size_t n) {
    return collective_send(c, w, n * sizeof *w);
}

int tp_step_send(collective *c, const decoder_seq *seqs, int n_seqs) {
    size_t n = 2 + 4 * (size_t)n_seqs;
    for (int i = 0; i < n_seqs; i++)
        n += (size_t)seqs[i].n_tokens + (size_t)seqs[i].n_blocks;
    int32_t *w = malloc(n * sizeof *w);
    if (!w) return -ENOMEM;
    size_t o = 2;
    w[0] = TP_MSG_STEP;
    w[1] = n_seqs;
    for (int i = 0; i < n_seqs; i++) {
        const decoder_seq *q = &seqs[i];
        w[o++] = q->n_tokens;
        w[o++] = q->start_pos;
        w[o++] = q->n_blocks;
        w[o++] = (q->logits ? 1 : 0) | (q->logits_all ? 2 : 0) | (q->argmax ? 4 : 0);
    }
    for (int i = 0; i < n_seqs; i++) {
        memcpy(w + o, seqs[i].tokens, (size_t)seqs[i].n_tokens * sizeof *w);
        o += (size_t)seqs[i].n_tokens;
    }
    for (int i = 0; i < n_seqs; i++) {
        memcpy(w + o, seqs[i].block_table, (size_t)seqs[i].n_blocks * sizeof *w);
        o += (size_t)seqs[i].n_blocks;
    }
    int rc = send_words(c, w, n);
    free(w);
    return rc;
}

int tp_step_send_init(collective *c, const tp_init_msg *m) {
    int32_t w[6] = {TP_MSG_INIT,   m->n_blocks, m->block_size,
                    m->kv_dtype,   m->max_tokens, m->kv_shared};
    return send_words(c, w, 6);
}

int tp_step_send_stop(collective *c) {
    int32_t w[1] = {TP_MSG_STOP};
    return send_words(c, w, 1);
}

static int grow(void **p, size_t *cap, size_t want, size_t elem) {
    if (want <= *cap) return 0;
    void *q = realloc(*p, want * elem);
    if (!q) return -ENOMEM;
    *p = q;
    *cap = want;
    return 0;
}

int tp_step_recv(collective *c, tp_step *s, int vocab) {
    size_t want = collective_msg_bytes(c) / sizeof(int32_t) + 1, got = 0;
    if (grow((void **)&s->ints, &s->cap_ints, want, sizeof(int32_t))) return -ENOMEM;
    int rc = collective_recv(c, s->ints, s->cap_ints * sizeof(int32_t), &got);
    if (rc) return rc;
    const int32_t *w = s->ints;
    size_t nw = got / sizeof *w;
    if (nw < 1) return -EPROTO;
    if (w[0] == TP_MSG_STOP) return TP_MSG_STOP;
    if (w[0] == TP_MSG_INIT) {
        if (nw != 6) return -EPROTO;
        s->init = (tp_init_msg){w[1], w[2], w[3], w[4], w[5]};
        return TP_MSG_INIT;
    }
    if (w[0] != TP_MSG_STEP || nw < 2) return -EPROTO;
    int n = w[1];
    if (n < 0 || nw < 2 + 4 * (size_t)n) return -EPROTO;
    if (n > s->cap_seqs) {
        decoder_seq *q = realloc(s->seqs, (size_t)n * sizeof *q);
        int32_t *a = q ? realloc(s->amax, (size_t)n * sizeof *a) : NULL;
        if (q) s->seqs = q;
        if (a) s->amax = a;
        if (!q || !a) return -ENOMEM;
        s->cap_seqs = n;
    }
    size_t o = 2 + 4 * (size_t)n, tok = o, rows = 0;
    for (int i = 0; i < n; i++)
        o += (size_t)w[2 + 4 * i];
    size_t bt = o;
    for (int i = 0; i < n; i++) {
        const int32_t *h = w + 2 + 4 * i;
        rows += (h[3] & 2) ? (size_t)h[0] : (h[3] & 1) ? 1 : 0;
    }
    if (grow((void **)&s->logits, &s->cap_logits, rows * (size_t)vocab, sizeof(float)))
        return -ENOMEM;
    size_t lr = 0;
    for (int i = 0; i < n; i++) {
        const int32_t *h = w + 2 + 4 * i;
        decoder_seq *q = &s->seqs[i];
        memset(q, 0, sizeof *q);
        q->n_tokens = h[0];
        q->start_pos = h[1];
        q->n_blocks = h[2];
        q->tokens = w + tok;
        q->block_table = w + bt;
        if (h[0] < 0 || h[2] < 0 || tok + (size_t)h[0] > bt || bt + (size_t)h[2] > nw)
            return -EPROTO;
        tok += (size_t)h[0];
        bt += (size_t)h[2];
        q->logits_all = (h[3] & 2) != 0;
        if (h[3] & 1) {
            q->logits = s->logits + lr * (size_t)vocab;
            lr += q->logits_all ? (size_t)h[0] : 1;
        }
        q->argmax = (h[3] & 4) ? &s->amax[i] : NULL;
    }
    s->n_seqs = n;
    return TP_MSG_STEP;
}

void tp_step_free(tp_step *s) {
    free(s->seqs);
    free(s->ints);
    free(s->logits);
    free(s->amax);
    memset(s, 0, sizeof *s);
}
