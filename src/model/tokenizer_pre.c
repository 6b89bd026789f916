/*
 * tokenizer_pre — the pre-tokenizers of tokenizer.json, as HF tokenizers'
 * pre_tokenizers/ split a piece into words:
 *   Split     Oniguruma regex, behavior Isolated (matches and the gaps between
 *             them are words; empty ones vanish).  The Qwen2 and Llama 3
 *             patterns have an ASCII fast path whose character classes come
 *             from Oniguruma (test_split_fast_path compares it with Oniguruma).
 *   ByteLevel optional prefix space and the GPT-2 regex (the byte <-> unicode
 *             map itself needs no work: words stay raw bytes).
 *   Metaspace ' ' -> the replacement (U+2581), prepended per prepend_scheme
 *             (always; first: only on the piece at offset 0 of the input),
 *             optionally split before each replacement (MergedWithNext).
 */
#include "model/tokenizer_int.h"

#include "base/err.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* The Qwen2 / Qwen2.5 split pattern, and Llama 3's (\p{N}{1,3} where Qwen2
 * has \p{N}).  Their matches over ASCII text are found by qwen_match_ascii
 * below; anything involving a non-ASCII character goes to Oniguruma. */
static const char QWEN2_PATTERN[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char LLAMA3_PATTERN[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* Escape a literal for Oniguruma (Split pattern {"String": ...}). */
char *tok_regex_escape(const char *s) {
    size_t n = strlen(s);
    char *o = malloc(2 * n + 1);
    if (!o) return NULL;
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        if (strchr("\\^$.|?*+()[]{}-/ #&~", s[i])) o[j++] = '\\';
        o[j++] = s[i];
    }
    o[j] = 0;
    return o;
}

int tok_compile(const char *path, const char *what, const char *pattern, OnigRegex *re, char *err,
                size_t cap) {
    OnigErrorInfo einfo;
    int r = onig_new(re, (const OnigUChar *)pattern, (const OnigUChar *)pattern + strlen(pattern),
                     ONIG_OPTION_NONE, ONIG_ENCODING_UTF8, ONIG_SYNTAX_RUBY, &einfo);
    if (r != ONIG_NORMAL) {
        char msg[ONIG_MAX_ERROR_MESSAGE_LEN];
        onig_error_code_to_str((OnigUChar *)msg, r, &einfo);
        err_set(err, cap, "%s: %s regex %s does not compile: %s", path, what, pattern, msg);
        *re = NULL;
        return -EINVAL;
    }
    return 0;
}

static const char *GPT2_PATTERN =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int pre_parse_metaspace(const char *path, json_t *p, tok_pre *s, char *err, size_t cap) {
    s->kind = PRE_METASPACE;
    const char *rep = json_string_value(json_object_get(p, "replacement"));
    if (!rep) rep = "\u2581";
    size_t rl = strlen(rep);
    if (rl == 0 || rl >= sizeof(s->rep) || tok_utf8_step((const uint8_t *)rep, rl) != (int)rl) {
        err_set(err, cap, "%s: Metaspace replacement \"%s\" is not one character", path, rep);
        return -EINVAL;
    }
    memcpy(s->rep, rep, rl);
    s->rep_len = rl;
    json_t *ps = json_object_get(p, "prepend_scheme");
    json_t *aps = json_object_get(p, "add_prefix_space"); /* older files */
    const char *scheme = json_string_value(ps);
    if (!ps || json_is_null(ps))
        s->prepend = (!aps || json_is_true(aps)) ? PREPEND_ALWAYS : PREPEND_NEVER;
    else if (scheme && strcmp(scheme, "always") == 0)
        s->prepend = PREPEND_ALWAYS;
    else if (scheme && strcmp(scheme, "first") == 0)
        s->prepend = PREPEND_FIRST;
    else if (scheme && strcmp(scheme, "never") == 0)
        s->prepend = PREPEND_NEVER;
    else {
        err_set(err, cap,
                "%s: Metaspace prepend_scheme is not one of \"always\", \"first\", "
                "\"never\"",
                path);
        return -EINVAL;
    }
    json_t *sp = json_object_get(p, "split");
    s->split = !sp || json_is_true(sp);
    return 0;
}

int tok_parse_pre(tokenizer *t, const char *path, json_t *p, char *err, size_t cap) {
    if (!p || json_is_null(p)) return 0;
    const char *type = json_string_value(json_object_get(p, "type"));
    if (!type) {
        err_set(err, cap, "%s: pre_tokenizer has no \"type\"", path);
        return -EINVAL;
    }
    if (strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(p, "pretokenizers");
        if (!json_is_array(list)) {
            err_set(err, cap, "%s: Sequence pre_tokenizer has no \"pretokenizers\" array", path);
            return -EINVAL;
        }
        size_t i;
        json_t *x;
        json_array_foreach(list, i, x) {
            int rc = tok_parse_pre(t, path, x, err, cap);
            if (rc) return rc;
        }
        return 0;
    }
    if (t->n_pre == TOK_MAX_PRE) {
        err_set(err, cap, "%s: more than %d pre_tokenizers", path, TOK_MAX_PRE);
        return -ENOTSUP;
    }
    tok_pre *s = &t->pre[t->n_pre];
    memset(s, 0, sizeof(*s));
    if (strcmp(type, "Split") == 0) {
        const char *beh = json_string_value(json_object_get(p, "behavior"));
        if (!beh || strcmp(beh, "Isolated") != 0) {
            err_set(err, cap, "%s: unsupported Split behavior \"%s\" (supported: Isolated)", path,
                    beh ? beh : "(missing)");
            return -ENOTSUP;
        }
        if (json_is_true(json_object_get(p, "invert"))) {
            err_set(err, cap, "%s: unsupported Split with invert=true", path);
            return -ENOTSUP;
        }
        json_t *pat = json_object_get(p, "pattern");
        const char *rx = json_string_value(json_object_get(pat, "Regex"));
        const char *lit = json_string_value(json_object_get(pat, "String"));
        if (!rx && !lit) {
            err_set(err, cap, "%s: Split pattern is neither {\"Regex\": ...} nor {\"String\": ...}",
                    path);
            return -EINVAL;
        }
        char *esc = NULL;
        if (!rx) {
            esc = tok_regex_escape(lit);
            if (!esc) return -ENOMEM;
        }
        int rc = tok_compile(path, "pre_tokenizer", rx ? rx : esc, &s->re, err, cap);
        free(esc);
        if (rc) return rc;
        s->kind = PRE_SPLIT;
        s->fast = !rx                               ? FAST_NONE
                  : strcmp(rx, QWEN2_PATTERN) == 0  ? FAST_QWEN2
                  : strcmp(rx, LLAMA3_PATTERN) == 0 ? FAST_LLAMA3
                                                    : FAST_NONE;
    } else if (strcmp(type, "ByteLevel") == 0) {
        s->kind = PRE_BYTE_LEVEL;
        s->add_prefix_space = json_is_true(json_object_get(p, "add_prefix_space"));
        json_t *ur = json_object_get(p, "use_regex");
        if (!ur || json_is_true(ur)) {
            int rc = tok_compile(path, "pre_tokenizer", GPT2_PATTERN, &s->re, err, cap);
            if (rc) return rc;
        }
    } else if (strcmp(type, "Metaspace") == 0) {
        int rc = pre_parse_metaspace(path, p, s, err, cap);
        if (rc) return rc;
    } else {
        err_set(err, cap,
                "%s: unsupported pre_tokenizer type \"%s\" (supported: Split, ByteLevel, "
                "Metaspace, Sequence of these)",
                path, type);
        return -ENOTSUP;
    }
    t->n_pre++;
    return 0;
}

/* One match of QWEN2_PATTERN (or LLAMA3_PATTERN) starting at i (the pattern matches at every
 * position), decided from ASCII characters only: returns its end, or 0 when
 * a non-ASCII character takes part in the decision (then Oniguruma decides).
 * Alternatives are tried in the pattern's order, as a backtracking engine
 * does. */
static size_t qwen_match_ascii(const uint8_t *s, size_t n, size_t i, int max_digits) {
#define CH(k)  ((k) < n ? (int)s[k] : -1) /* -1: end of text */
#define CLS(c) ((c) < 0 ? 0 : tok_ascii_class[c])
    int c0 = s[i];
    if (c0 >= 0x80) return 0;
    /* (?i:'s|'t|'re|'ve|'m|'ll|'d) */
    if (c0 == '\'') {
        int c1 = CH(i + 1), c2 = CH(i + 2);
        if (c1 >= 0x80) return 0;
        c1 = c1 >= 'A' && c1 <= 'Z' ? c1 + 32 : c1;
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 2;
        if (c1 == 'r' || c1 == 'v' || c1 == 'l') {
            if (c2 >= 0x80) return 0;
            c2 = c2 >= 'A' && c2 <= 'Z' ? c2 + 32 : c2;
            if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
                return i + 3;
        }
    }
    int k0 = CLS(c0);
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    size_t ls = n; /* where the letter run starts, n if the alternative fails */
    if (k0 & CL_L) {
        ls = i;
    } else if (c0 != '\r' && c0 != '\n' && !(k0 & CL_N)) {
        int c1 = CH(i + 1);
        if (c1 >= 0x80) return 0;
        if (CLS(c1) & CL_L) ls = i + 1;
    }
    if (ls < n) {
        size_t e = ls;
        while (e < n && s[e] < 0x80 && (tok_ascii_class[s[e]] & CL_L))
            e++;
        if (e < n && s[e] >= 0x80) return 0;
        return e;
    }
    /* \p{N} (Qwen2) or \p{N}{1,3} (Llama 3): greedy up to max_digits */
    if (k0 & CL_N) {
        size_t e = i + 1;
        while (e < n && e - i < (size_t)max_digits) {
            if (s[e] >= 0x80) return 0; /* may be a non-ASCII digit */
            if (!(tok_ascii_class[s[e]] & CL_N)) break;
            e++;
        }
        return e;
    }
    /* ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
    size_t ps = n;
    if (!(k0 & (CL_S | CL_L | CL_N))) {
        ps = i;
    } else if (c0 == ' ') {
        int c1 = CH(i + 1);
        if (c1 >= 0x80) return 0;
        if (c1 >= 0 && !(CLS(c1) & (CL_S | CL_L | CL_N))) ps = i + 1;
    }
    if (ps < n) {
        size_t e = ps;
        while (e < n && s[e] < 0x80 && !(tok_ascii_class[s[e]] & (CL_S | CL_L | CL_N)))
            e++;
        if (e < n && s[e] >= 0x80) return 0;
        while (e < n && (s[e] == '\r' || s[e] == '\n'))
            e++;
        return e;
    }
    /* c0 is whitespace: \s*[\r\n]+ | \s+(?!\S) | \s+ */
    size_t e = i, last_nl = n;
    while (e < n && s[e] < 0x80 && (tok_ascii_class[s[e]] & CL_S)) {
        if (s[e] == '\r' || s[e] == '\n') last_nl = e;
        e++;
    }
    if (e < n && s[e] >= 0x80) return 0; /* may be more (unicode) whitespace */
    if (last_nl < n) return last_nl + 1;
    if (e == n) return e;
    if (e - i >= 2) return e - 1;
    return e;
#undef CH
#undef CLS
}

/* Split s by the step's regex, Isolated: matches and the gaps between them
 * are pieces; empty pieces vanish. */
static int enc_regex_split(enc_ctx *c, int step, const tok_pre *p, const uint8_t *s, size_t n) {
    OnigRegex re = p->re;
    size_t pos = 0, last = 0;
    int rc;
    while (pos < n) {
        if (p->fast && pos == last) {
            size_t e = qwen_match_ascii(s, n, pos, p->fast);
            if (e > pos) {
                if ((rc = tok_enc_pre(c, step + 1, s + pos, e - pos))) return rc;
                last = pos = e;
                continue;
            }
        }
        int r = onig_search(re, s, s + n, s + pos, s + n, c->region, ONIG_OPTION_NONE);
        if (r == ONIG_MISMATCH) break;
        if (r < 0) {
            char msg[ONIG_MAX_ERROR_MESSAGE_LEN];
            onig_error_code_to_str((OnigUChar *)msg, r);
            err_set(c->err, c->err_cap, "pre-tokenizer regex failed: %s", msg);
            return -EIO;
        }
        size_t ms = (size_t)c->region->beg[0], me = (size_t)c->region->end[0];
        if (me == ms) { /* empty match: step over one character */
            int l;
            tok_utf8_cp(s + me, n - me, &l);
            pos = me + (size_t)l;
            continue;
        }
        if (ms > last && (rc = tok_enc_pre(c, step + 1, s + last, ms - last))) return rc;
        if ((rc = tok_enc_pre(c, step + 1, s + ms, me - ms))) return rc;
        last = pos = me;
    }
    if (last < n) return tok_enc_pre(c, step + 1, s + last, n - last);
    return 0;
}

/* Metaspace: spaces become the replacement, which is prepended per the
 * scheme; with split, a word starts at each replacement character. */
static int enc_metaspace(enc_ctx *c, int step, const tok_pre *p, const uint8_t *s, size_t n) {
    bool at_origin = s == c->origin;
    tok_bytes *b = &c->prefix[step];
    b->n = 0;
    bool starts = n >= p->rep_len && memcmp(s, p->rep, p->rep_len) == 0;
    int rc = 0;
    if (!starts && n > 0 && s[0] == ' ') starts = true; /* it becomes the replacement */
    if (!starts && (p->prepend == PREPEND_ALWAYS || (p->prepend == PREPEND_FIRST && at_origin)))
        rc = tok_bytes_append(b, p->rep, p->rep_len);
    size_t run = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        if (s[i] != ' ') continue;
        rc = tok_bytes_append(b, s + run, i - run);
        if (!rc) rc = tok_bytes_append(b, p->rep, p->rep_len);
        run = i + 1;
    }
    if (!rc) rc = tok_bytes_append(b, s + run, n - run);
    if (rc) return rc;
    if (!p->split) return tok_enc_pre(c, step + 1, b->v, b->n);
    /* MergedWithNext: cut before every replacement character */
    const uint8_t *v = b->v;
    size_t len = b->n, start = 0;
    for (size_t i = 1; i + p->rep_len <= len; i++) {
        if (memcmp(v + i, p->rep, p->rep_len) != 0) continue;
        if ((rc = tok_enc_pre(c, step + 1, v + start, i - start))) return rc;
        start = i;
    }
    return tok_enc_pre(c, step + 1, v + start, len - start);
}

int tok_enc_pre(enc_ctx *c, int step, const uint8_t *s, size_t n) {
    if (n == 0) return 0;
    const tokenizer *t = c->t;
    if (step == t->n_pre) return tok_bpe_word(t, s, n, c->out);
    const tok_pre *p = &t->pre[step];
    if (p->kind == PRE_BYTE_LEVEL && p->add_prefix_space && s[0] != ' ') {
        tok_bytes *b = &c->prefix[step];
        b->n = 0;
        if (tok_bytes_append(b, " ", 1) || tok_bytes_append(b, s, n)) return -ENOMEM;
        s = b->v;
        n = b->n;
    }
    if (p->kind == PRE_METASPACE) return enc_metaspace(c, step, p, s, n);
    if (!p->re) return tok_enc_pre(c, step + 1, s, n);
    return enc_regex_split(c, step, p, s, n);
}
