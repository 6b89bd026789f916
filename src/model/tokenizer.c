/*
 * tokenizer — the encode pipeline and the accessors (see tokenizer.h for the
 * steps, tokenizer_int.h for the files of the module).
 *
 * encode: added tokens with normalized=false are split out of the raw text;
 * each piece between them is normalized, then split around the added tokens
 * with normalized=true; each remaining piece goes through the pre-tokenizers
 * (tokenizer_pre.c) and BPE (tokenizer_bpe.c); add_special wraps the ids in
 * the post-processor's template (or tokenizer_config's add_bos/add_eos).
 */
#include "model/tokenizer_int.h"

#include "base/err.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static bool tok_id_ok(const tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_ids && t->has_id[id];
}

static int enc_added(enc_ctx *c, const uint8_t *s, size_t n, bool normalized);

/* Normalize one piece of the raw text (at_origin: it starts at offset 0),
 * then split it around the normalized added tokens and pre-tokenize. */
static int enc_normalized_piece(enc_ctx *c, const uint8_t *s, size_t n, bool at_origin) {
    const tokenizer *t = c->t;
    char *cur = NULL;
    size_t len = 0;
    int rc = tok_normalize_piece(t, s, n, &cur, &len);
    if (rc) {
        err_set(c->err, c->err_cap, "normalization failed");
        return rc;
    }
    const uint8_t *u = cur ? (const uint8_t *)cur : s;
    if (!cur) len = n;
    c->origin = at_origin ? u : NULL;
    rc = t->any_added_norm && !c->no_added ? enc_added(c, u, len, true) : tok_enc_pre(c, 0, u, len);
    c->origin = NULL;
    free(cur);
    return rc;
}

/* Leftmost-longest match of an added token (of the given normalized class)
 * at or after pos; returns its index or -1. */
static int added_find(const tokenizer *t, const uint8_t *s, size_t n, size_t pos, bool normalized,
                      size_t *at) {
    const uint8_t *first = t->added_first[normalized];
    for (size_t i = pos; i < n; i++) {
        if (!first[s[i]]) continue;
        int best = -1;
        for (size_t k = 0; k < t->n_added; k++) {
            const tok_added *a = &t->added[k];
            if (a->normalized != normalized || (uint8_t)a->content[0] != s[i] || a->len > n - i)
                continue;
            if (memcmp(a->content, s + i, a->len) != 0) continue;
            if (best < 0 || a->len > t->added[best].len) best = (int)k;
        }
        if (best >= 0) {
            *at = i;
            return best;
        }
    }
    return -1;
}

/* Split s around added tokens (HF AddedVocabulary::find_matches). */
static int enc_added(enc_ctx *c, const uint8_t *s, size_t n, bool normalized) {
    const tokenizer *t = c->t;
    size_t done = 0, pos = 0;
    int rc;
    while (pos < n) {
        size_t at;
        int k = added_find(t, s, n, pos, normalized, &at);
        if (k < 0) break;
        const tok_added *a = &t->added[k];
        size_t start = at, stop = at + a->len;
        pos = stop;
        if (a->single_word) {
            size_t b;
            bool ok_l = start == 0 || !tok_cp_is_word(tok_cp_before(s, start, &b));
            int l;
            bool ok_r = stop == n || !tok_cp_is_word(tok_utf8_cp(s + stop, n - stop, &l));
            if (!ok_l || !ok_r) continue;
        }
        if (start < done) continue; /* swallowed by a previous rstrip */
        if (a->lstrip) {
            while (start > done) {
                size_t b;
                if (!tok_cp_is_ws(tok_cp_before(s, start, &b))) break;
                start = b;
            }
        }
        if (a->rstrip) {
            while (stop < n) {
                int l;
                if (!tok_cp_is_ws(tok_utf8_cp(s + stop, n - stop, &l))) break;
                stop += (size_t)l;
            }
            pos = stop;
        }
        if (start > done) {
            rc = normalized ? tok_enc_pre(c, 0, s + done, start - done)
                            : enc_normalized_piece(c, s + done, start - done, done == 0);
            if (rc) return rc;
        }
        if ((rc = tok_ids_push(c->out, a->id))) return rc;
        done = stop;
    }
    if (done < n)
        return normalized ? tok_enc_pre(c, 0, s + done, n - done)
                          : enc_normalized_piece(c, s + done, n - done, done == 0);
    return 0;
}

static int encode(const tokenizer *t, const char *text, size_t len, bool add_special, bool no_added,
                  int32_t **ids_out, size_t *n_out, char *err, size_t err_cap) {
    *ids_out = NULL;
    *n_out = 0;
    if (!text && len) {
        err_set(err, err_cap, "tokenizer_encode: NULL text with length %zu", len);
        return -EINVAL;
    }
    size_t bad = tokenizer_utf8_check(text, len);
    if (bad != len) {
        err_set(err, err_cap,
                "invalid UTF-8 at byte offset %zu (byte 0x%02X); input must be "
                "valid UTF-8",
                bad, (unsigned)(uint8_t)text[bad]);
        return -EILSEQ;
    }
    tok_ids out = {0};
    enc_ctx c = {.t = t, .out = &out, .err = err, .err_cap = err_cap, .no_added = no_added};
    c.region = onig_region_new();
    int rc = c.region ? 0 : -ENOMEM;
    if (add_special && t->has_template) {
        for (int k = 0; k < t->n_post_pre && !rc; k++)
            rc = tok_ids_push(&out, t->post_pre[k]);
    } else if (!rc && add_special && t->add_bos && t->bos_id >= 0) {
        rc = tok_ids_push(&out, t->bos_id);
    }
    if (!rc && len > 0) {
        const uint8_t *s = (const uint8_t *)text;
        rc = t->any_added_raw && !no_added ? enc_added(&c, s, len, false)
                                           : enc_normalized_piece(&c, s, len, true);
    }
    if (add_special && t->has_template) {
        for (int k = 0; k < t->n_post_suf && !rc; k++)
            rc = tok_ids_push(&out, t->post_suf[k]);
    } else if (!rc && add_special && t->add_eos && t->eos_id >= 0) {
        rc = tok_ids_push(&out, t->eos_id);
    }
    if (c.region) onig_region_free(c.region, 1);
    for (int k = 0; k < TOK_MAX_PRE; k++)
        free(c.prefix[k].v);
    if (rc) {
        if (rc == -ENOMEM) err_set(err, err_cap, "tokenizer_encode: out of memory");
        free(out.v);
        return rc;
    }
    if (!out.v) out.v = malloc(sizeof(int32_t)); /* a valid pointer even when empty */
    if (!out.v) return -ENOMEM;
    *ids_out = out.v;
    *n_out = out.n;
    return 0;
}

int tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_special,
                     int32_t **ids_out, size_t *n_out, char *err, size_t err_cap) {
    return encode(t, text, len, add_special, false, ids_out, n_out, err, err_cap);
}

int tokenizer_encode_plain(const tokenizer *t, const char *text, size_t len, int32_t **ids_out,
                           size_t *n_out, char *err, size_t err_cap) {
    return encode(t, text, len, false, true, ids_out, n_out, err, err_cap);
}

/* ======================================================================
 * decoding
 * ====================================================================== */

/* ======================================================================
 * accessors
 * ====================================================================== */

int32_t tokenizer_token_id(const tokenizer *t, const char *token) {
    size_t n = strlen(token);
    for (size_t k = 0; k < t->n_added; k++)
        if (t->added[k].len == n && memcmp(t->added[k].content, token, n) == 0)
            return t->added[k].id;
    if (!t->byte_level) return n > 0 ? tok_vocab_find(t, (const uint8_t *)token, n) : -1;
    tok_bytes b = {0};
    int32_t id = -1;
    if (tok_byte_level_to_bytes(token, n, &b) && b.n > 0) id = tok_vocab_find(t, b.v, b.n);
    free(b.v);
    return id;
}

const char *tokenizer_token_str(const tokenizer *t, int32_t id, size_t *len) {
    if (!tok_id_ok(t, id)) return NULL;
    *len = t->key_len[id];
    return (const char *)t->keys + t->key_off[id];
}

const uint8_t *tokenizer_token_bytes(const tokenizer *t, int32_t id, size_t *len) {
    if (!tok_id_ok(t, id)) return NULL;
    *len = t->tok_len[id];
    return t->arena + t->tok_off[id];
}

bool tokenizer_is_special(const tokenizer *t, int32_t id) {
    return tok_id_ok(t, id) && t->is_special[id];
}
int32_t tokenizer_vocab_size(const tokenizer *t) {
    return t->n_ids;
}
size_t tokenizer_max_token_bytes(const tokenizer *t) {
    return t->max_tok_len;
}
int32_t tokenizer_eos_id(const tokenizer *t) {
    return t->eos_id;
}
int32_t tokenizer_pad_id(const tokenizer *t) {
    return t->pad_id;
}
int32_t tokenizer_bos_id(const tokenizer *t) {
    return t->bos_id;
}
const char *tokenizer_eos_token(const tokenizer *t) {
    return t->eos_token;
}
uint64_t tokenizer_model_max_length(const tokenizer *t) {
    return t->model_max_length;
}
const char *tokenizer_chat_template(const tokenizer *t) {
    return t->chat_template;
}
