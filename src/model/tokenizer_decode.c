/*
 * tokenizer_decode — the decoders of tokenizer.json and the stream decoder.
 *
 * Supported, as HF tokenizers' decoders/ apply them to the token strings:
 *   ByteLevel   every character maps back to its byte (a token with an
 *               unmapped character is taken as its own UTF-8);
 *   Sequence of Replace (String pattern), ByteFallback, Fuse, Strip (left
 *               only): the SentencePiece decoder of Llama 2 / Mistral files;
 *   Metaspace   the replacement becomes ' ', the first token loses a leading
 *               ' ' unless prepend_scheme is "never".
 * Each token's bytes are computed once at load (tok_decode_key); decode
 * concatenates them, then applies ByteFallback's rule for runs of <0xXX>
 * tokens (valid UTF-8 as it is, else one U+FFFD per token), Rust's lossy
 * UTF-8 and the Strip.
 */
#include "model/tokenizer_int.h"

#include "base/err.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static int dec_set_replace(tokenizer *t, const char *from, const char *to) {
    free(t->dec_from);
    free(t->dec_to);
    t->dec_from = strdup(from);
    t->dec_to = strdup(to);
    if (!t->dec_from || !t->dec_to) return -ENOMEM;
    t->dec_from_len = strlen(from);
    t->dec_to_len = strlen(to);
    return 0;
}

static int dec_parse_one(tokenizer *t, const char *path, json_t *d, bool in_seq, char *err,
                         size_t cap) {
    const char *type = json_string_value(json_object_get(d, "type"));
    if (!type) {
        err_set(err, cap, "%s: decoder has no \"type\"", path);
        return -EINVAL;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        t->dec_byte_level = true;
        return 0;
    }
    if (strcmp(type, "Sequence") == 0 && !in_seq) {
        json_t *list = json_object_get(d, "decoders");
        if (!json_is_array(list)) {
            err_set(err, cap, "%s: Sequence decoder has no \"decoders\" array", path);
            return -EINVAL;
        }
        size_t i;
        json_t *x;
        json_array_foreach(list, i, x) {
            int rc = dec_parse_one(t, path, x, true, err, cap);
            if (rc) return rc;
        }
        return 0;
    }
    if (strcmp(type, "Replace") == 0) {
        const char *from =
            json_string_value(json_object_get(json_object_get(d, "pattern"), "String"));
        const char *to = json_string_value(json_object_get(d, "content"));
        if (!from || !*from || !to) {
            err_set(err, cap,
                    "%s: Replace decoder needs \"pattern\" {\"String\": non-empty} and a string "
                    "\"content\" (regex patterns are not supported)",
                    path);
            return -ENOTSUP;
        }
        if (t->dec_from) {
            err_set(err, cap, "%s: more than one Replace decoder", path);
            return -ENOTSUP;
        }
        return dec_set_replace(t, from, to);
    }
    if (strcmp(type, "ByteFallback") == 0) {
        t->dec_byte_fallback = true;
        return 0;
    }
    if (strcmp(type, "Fuse") == 0) return 0; /* decode concatenates anyway */
    if (strcmp(type, "Strip") == 0) {
        const char *content = json_string_value(json_object_get(d, "content"));
        json_t *start = json_object_get(d, "start"), *stop = json_object_get(d, "stop");
        if (!content || strlen(content) != 1 || (unsigned char)content[0] >= 0x80 ||
            !json_is_integer(start) || json_integer_value(start) < 0 ||
            json_integer_value(start) > 64 || (stop && json_integer_value(stop) != 0)) {
            err_set(err, cap,
                    "%s: Strip decoder supported with an ASCII \"content\", \"start\" 0..64 and "
                    "\"stop\" 0",
                    path);
            return -ENOTSUP;
        }
        t->dec_strip = (uint32_t)json_integer_value(start);
        t->dec_strip_char = content[0];
        return 0;
    }
    if (strcmp(type, "Metaspace") == 0) {
        const char *rep = json_string_value(json_object_get(d, "replacement"));
        const char *scheme = json_string_value(json_object_get(d, "prepend_scheme"));
        json_t *aps = json_object_get(d, "add_prefix_space");
        int rc = dec_set_replace(t, rep ? rep : "\u2581", " ");
        if (rc) return rc;
        bool strip = scheme ? strcmp(scheme, "never") != 0 : (!aps || json_is_true(aps));
        t->dec_strip = strip ? 1 : 0;
        t->dec_strip_char = ' ';
        return 0;
    }
    err_set(err, cap,
            "%s: unsupported decoder type \"%s\" (supported: ByteLevel, Metaspace, Sequence of "
            "Replace/ByteFallback/Fuse/Strip, null)",
            path, type);
    return -ENOTSUP;
}

int tok_parse_decoder(tokenizer *t, const char *path, json_t *d, char *err, size_t cap) {
    if (!d || json_is_null(d)) return 0;
    return dec_parse_one(t, path, d, false, err, cap);
}

/* "<0xAB>" -> 0xAB; -1 if s is not such a token. */
static int byte_token_value(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                       : -1; /* HF: u8::from_str_radix(.., 16) */
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

int tok_decode_key(const tokenizer *t, const char *s, size_t n, tok_bytes *out, bool *is_byte) {
    *is_byte = false;
    if (t->byte_level) {
        if (tok_byte_level_to_bytes(s, n, out)) return 0;
        return tok_bytes_append(out, s, n);
    }
    /* Replace first (a token holding the pattern is no byte token after it) */
    size_t run = 0;
    bool replaced = false;
    if (t->dec_from) {
        for (size_t i = 0; i + t->dec_from_len <= n;) {
            if (memcmp(s + i, t->dec_from, t->dec_from_len) != 0) {
                i++;
                continue;
            }
            if (tok_bytes_append(out, s + run, i - run) ||
                tok_bytes_append(out, t->dec_to, t->dec_to_len))
                return -ENOMEM;
            replaced = true;
            i += t->dec_from_len;
            run = i;
        }
    }
    if (!replaced && t->dec_byte_fallback) {
        int v = byte_token_value(s, n);
        if (v >= 0) {
            uint8_t b = (uint8_t)v;
            *is_byte = true;
            return tok_bytes_append(out, &b, 1);
        }
    }
    return tok_bytes_append(out, s + run, n - run);
}

static bool tok_id_ok(const tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_ids && t->has_id[id];
}

/* End of a run of ByteFallback bytes: as they are when they are valid UTF-8,
 * else one U+FFFD per byte (HF decoders/byte_fallback.rs). */
static int dec_flush_run(tok_bytes *raw, size_t run_start) {
    size_t k = raw->n - run_start;
    if (k == 0 || tokenizer_utf8_check((const char *)raw->v + run_start, k) == k) return 0;
    raw->n = run_start;
    for (size_t i = 0; i < k; i++)
        if (tok_bytes_append(raw, tok_utf8_replacement, 3)) return -ENOMEM;
    return 0;
}

int tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, bool skip_special,
                     char **text_out, size_t *len_out, char *err, size_t err_cap) {
    *text_out = NULL;
    if (len_out) *len_out = 0;
    tok_bytes raw = {0}, txt = {0};
    int rc = 0;
    size_t run_start = 0;
    bool in_run = false;
    for (size_t i = 0; i < n && !rc; i++) {
        int32_t id = ids[i];
        if (!tok_id_ok(t, id)) {
            err_set(err, err_cap,
                    "token id %d at position %zu is not in the vocabulary "
                    "(ids are 0..%d)",
                    id, i, t->n_ids - 1);
            rc = -EINVAL;
            break;
        }
        if (skip_special && t->is_special[id]) continue;
        if (t->dec_byte_fallback) {
            if (t->is_byte[id] && !in_run) {
                in_run = true;
                run_start = raw.n;
            } else if (!t->is_byte[id] && in_run) {
                in_run = false;
                if ((rc = dec_flush_run(&raw, run_start))) break;
            }
        }
        rc = tok_bytes_append(&raw, t->arena + t->tok_off[id], t->tok_len[id]);
    }
    if (!rc && in_run) rc = dec_flush_run(&raw, run_start);
    if (!rc)
        rc = tok_utf8_lossy_append(&txt, raw.v ? raw.v : (const uint8_t *)"", raw.n, true, NULL);
    free(raw.v);
    if (!rc && t->dec_strip > 0) { /* Strip (after Fuse): leading strip chars of the text */
        size_t k = 0;
        while (k < txt.n && k < t->dec_strip && txt.v[k] == (uint8_t)t->dec_strip_char)
            k++;
        memmove(txt.v, txt.v + k, txt.n - k);
        txt.n -= k;
    }
    if (!rc) rc = tok_bytes_append(&txt, "", 1);
    if (rc) {
        if (rc == -ENOMEM) err_set(err, err_cap, "tokenizer_decode: out of memory");
        free(txt.v);
        return rc;
    }
    *text_out = (char *)txt.v;
    if (len_out) *len_out = txt.n - 1;
    return 0;
}

void tokenizer_stream_init(tokenizer_stream *st, bool skip_special) {
    memset(st, 0, sizeof(*st));
    st->skip_special = skip_special;
}

int tokenizer_stream_push(const tokenizer *t, tokenizer_stream *st, int32_t id, char *out,
                          size_t cap, size_t *out_len) {
    *out_len = 0;
    if (!tok_id_ok(t, id)) return -EINVAL;
    if (cap < TOKENIZER_STREAM_OUT_CAP(t)) return -ENOSPC;
    if (st->skip_special && t->is_special[id]) return 0;
    uint8_t buf[4];
    tok_bytes in = {0}, txt = {0};
    /* pending bytes then the token's bytes */
    memcpy(buf, st->pending, (size_t)st->n_pending);
    int rc = tok_bytes_append(&in, buf, (size_t)st->n_pending);
    if (!rc) rc = tok_bytes_append(&in, t->arena + t->tok_off[id], t->tok_len[id]);
    size_t held = 0;
    if (!rc) rc = tok_utf8_lossy_append(&txt, in.v, in.n, false, &held);
    if (!rc) {
        memcpy(st->pending, in.v + in.n - held, held);
        st->n_pending = (int)held;
        memcpy(out, txt.v, txt.n);
        *out_len = txt.n;
    }
    free(in.v);
    free(txt.v);
    return rc;
}

int tokenizer_stream_flush(tokenizer_stream *st, char *out, size_t cap, size_t *out_len) {
    *out_len = 0;
    if (st->n_pending == 0) return 0;
    if (cap < 3) return -ENOSPC;
    memcpy(out, tok_utf8_replacement, 3); /* an unfinished character is one U+FFFD */
    *out_len = 3;
    st->n_pending = 0;
    return 0;
}
