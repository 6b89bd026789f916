/*
 * tokenizer_norm — the normalizers of tokenizer.json, as HF tokenizers'
 * normalizers/ apply them to each piece of text between added tokens:
 * NFC/NFD/NFKC/NFKD (utf8proc), Prepend (a non-empty piece gets the text in
 * front), Replace (every non-overlapping occurrence of a string or an
 * Oniguruma regex, left to right), Strip (Rust whitespace at either end), and
 * Sequence of these.  NFC alone has a fast path that only normalizes spans
 * holding a code point >= U+0300.
 */
#include "model/tokenizer_int.h"

#include "base/err.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

void tok_norm_free(tok_norm *nm) {
    free(nm->a);
    free(nm->b);
    if (nm->re) onig_free(nm->re);
    memset(nm, 0, sizeof(*nm));
}

static tok_norm *norm_slot(tokenizer *t, const char *path, char *err, size_t cap) {
    if (t->n_norm == TOK_MAX_NORM) {
        err_set(err, cap, "%s: more than %d normalizers", path, TOK_MAX_NORM);
        return NULL;
    }
    tok_norm *nm = &t->norm[t->n_norm];
    memset(nm, 0, sizeof(*nm));
    return nm;
}

static int norm_parse_leaf(tok_norm *nm, const char *type, const char *path, json_t *n, char *err,
                           size_t cap);

int tok_parse_normalizer(tokenizer *t, const char *path, json_t *n, char *err, size_t cap) {
    if (!n || json_is_null(n)) return 0;
    const char *type = json_string_value(json_object_get(n, "type"));
    if (!type) {
        err_set(err, cap, "%s: normalizer has no \"type\"", path);
        return -EINVAL;
    }
    if (strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(n, "normalizers");
        if (!json_is_array(list)) {
            err_set(err, cap, "%s: Sequence normalizer has no \"normalizers\" array", path);
            return -EINVAL;
        }
        size_t i;
        json_t *x;
        json_array_foreach(list, i, x) {
            int rc = tok_parse_normalizer(t, path, x, err, cap);
            if (rc) return rc;
        }
        return 0;
    }
    tok_norm *nm = norm_slot(t, path, err, cap);
    if (!nm) return -ENOTSUP;
    int rc = norm_parse_leaf(nm, type, path, n, err, cap);
    if (rc) {
        tok_norm_free(nm);
        return rc;
    }
    t->n_norm++;
    return 0;
}

static int norm_parse_leaf(tok_norm *nm, const char *type, const char *path, json_t *n, char *err,
                           size_t cap) {
    if (strcmp(type, "NFC") == 0) {
        nm->kind = NORM_UTF8PROC;
        nm->flags = UTF8PROC_STABLE | UTF8PROC_COMPOSE;
    } else if (strcmp(type, "NFD") == 0) {
        nm->kind = NORM_UTF8PROC;
        nm->flags = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE;
    } else if (strcmp(type, "NFKC") == 0) {
        nm->kind = NORM_UTF8PROC;
        nm->flags = UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
    } else if (strcmp(type, "NFKD") == 0) {
        nm->kind = NORM_UTF8PROC;
        nm->flags = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
    } else if (strcmp(type, "Prepend") == 0) {
        const char *p = json_string_value(json_object_get(n, "prepend"));
        if (!p) {
            err_set(err, cap, "%s: Prepend normalizer has no string \"prepend\"", path);
            return -EINVAL;
        }
        nm->kind = NORM_PREPEND;
        nm->a = strdup(p);
        nm->alen = strlen(p);
        if (!nm->a) return -ENOMEM;
    } else if (strcmp(type, "Replace") == 0) {
        json_t *pat = json_object_get(n, "pattern");
        const char *rx = json_string_value(json_object_get(pat, "Regex"));
        const char *lit = json_string_value(json_object_get(pat, "String"));
        const char *content = json_string_value(json_object_get(n, "content"));
        if ((!rx && !lit) || !content) {
            err_set(err, cap,
                    "%s: Replace normalizer needs \"pattern\" {\"String\": ...} or {\"Regex\": "
                    "...} and a string \"content\"",
                    path);
            return -EINVAL;
        }
        if (lit && !*lit) {
            err_set(err, cap, "%s: Replace normalizer with an empty pattern", path);
            return -EINVAL;
        }
        nm->kind = lit ? NORM_REPLACE : NORM_REPLACE_RE;
        nm->b = strdup(content);
        nm->blen = strlen(content);
        if (!nm->b) return -ENOMEM;
        if (lit) {
            nm->a = strdup(lit);
            nm->alen = strlen(lit);
            if (!nm->a) return -ENOMEM;
        } else {
            int rc = tok_compile(path, "Replace normalizer", rx, &nm->re, err, cap);
            if (rc) return rc;
        }
    } else if (strcmp(type, "Strip") == 0) {
        nm->kind = NORM_STRIP;
        nm->left = json_is_true(json_object_get(n, "strip_left"));
        nm->right = json_is_true(json_object_get(n, "strip_right"));
    } else {
        err_set(err, cap,
                "%s: unsupported normalizer type \"%s\" (supported: NFC, NFD, NFKC, NFKD, "
                "Prepend, Replace, Strip, Sequence of these, null)",
                path, type);
        return -ENOTSUP;
    }
    return 0;
}

/* One step: cur[0..*len) -> a new malloc'ed, NUL-terminated buffer. */
static int norm_step(const tok_norm *nm, const uint8_t *cur, size_t len, uint8_t **out,
                     size_t *out_len) {
    tok_bytes b = {0};
    int rc = 0;
    switch (nm->kind) {
    case NORM_UTF8PROC: {
        uint8_t *o = NULL;
        utf8proc_ssize_t k =
            utf8proc_map(cur, (utf8proc_ssize_t)len, &o, (utf8proc_option_t)nm->flags);
        if (k < 0) return -EILSEQ;
        *out = o;
        *out_len = (size_t)k;
        return 0;
    }
    case NORM_PREPEND:
        if (len > 0) rc = tok_bytes_append(&b, nm->a, nm->alen);
        if (!rc) rc = tok_bytes_append(&b, cur, len);
        break;
    case NORM_REPLACE: {
        size_t i = 0, run = 0;
        while (!rc && i + nm->alen <= len) {
            if (memcmp(cur + i, nm->a, nm->alen) == 0) {
                rc = tok_bytes_append(&b, cur + run, i - run);
                if (!rc) rc = tok_bytes_append(&b, nm->b, nm->blen);
                i += nm->alen;
                run = i;
            } else {
                i++;
            }
        }
        if (!rc) rc = tok_bytes_append(&b, cur + run, len - run);
        break;
    }
    case NORM_REPLACE_RE: {
        OnigRegion *rg = onig_region_new();
        if (!rg) return -ENOMEM;
        size_t pos = 0, run = 0;
        while (!rc && pos <= len) {
            int r = onig_search(nm->re, cur, cur + len, cur + pos, cur + len, rg, ONIG_OPTION_NONE);
            if (r < 0) break; /* no more matches (or a match error: the rest is kept) */
            size_t ms = (size_t)rg->beg[0], me = (size_t)rg->end[0];
            if (me > ms) {
                rc = tok_bytes_append(&b, cur + run, ms - run);
                if (!rc) rc = tok_bytes_append(&b, nm->b, nm->blen);
                run = pos = me;
            } else { /* empty match: HF skips it */
                if (ms >= len) break;
                int l;
                tok_utf8_cp(cur + ms, len - ms, &l);
                pos = ms + (size_t)l;
            }
        }
        onig_region_free(rg, 1);
        if (!rc) rc = tok_bytes_append(&b, cur + run, len - run);
        break;
    }
    case NORM_STRIP: {
        size_t s = 0, e = len;
        while (nm->left && s < e) {
            int l;
            if (!tok_cp_is_ws(tok_utf8_cp(cur + s, e - s, &l))) break;
            s += (size_t)l;
        }
        while (nm->right && e > s) {
            size_t st;
            if (!tok_cp_is_ws(tok_cp_before(cur, e, &st))) break;
            e = st;
        }
        rc = tok_bytes_append(&b, cur + s, e - s);
        break;
    }
    default:
        return -EINVAL;
    }
    if (!rc) rc = tok_bytes_append(&b, "", 1);
    if (rc) {
        free(b.v);
        return rc;
    }
    *out = b.v;
    *out_len = b.n - 1;
    return 0;
}

int tok_normalize(const tokenizer *t, const uint8_t *s, size_t n, char **out, size_t *out_len) {
    uint8_t *cur = malloc(n + 1);
    if (!cur) return -ENOMEM;
    memcpy(cur, s, n);
    cur[n] = 0;
    size_t len = n;
    for (int k = 0; k < t->n_norm; k++) {
        uint8_t *o = NULL;
        size_t ol = 0;
        int rc = norm_step(&t->norm[k], cur, len, &o, &ol);
        free(cur);
        if (rc) return rc;
        cur = o;
        len = ol;
    }
    *out = (char *)cur;
    *out_len = len;
    return 0;
}

/* NFC fast path.  Text whose code points are all below U+0300 is NFC, and a
 * character below U+0300 is a starter that is never the second half of a
 * composition, so the boundary before it is safe: only spans holding a code
 * point >= U+0300 (lead byte >= 0xCC), from the character before them to the
 * next character below U+0300, go through utf8proc. */
static bool utf8_is_low_lead(uint8_t b) {
    return b < 0x80 || (b >= 0xC2 && b < 0xCC);
}

static int tok_nfc_spans(const tokenizer *t, const uint8_t *s, size_t n, tok_bytes *out,
                         bool *changed) {
    *changed = false;
    size_t pos = 0;
    for (;;) {
        size_t h = pos;
        while (h < n && (s[h] < 0xCC || s[h] > 0xF4 || (s[h] & 0xC0) == 0x80))
            h++;
        if (h == n) break;
        size_t seg = h;
        if (h > pos) { /* start of the character before h */
            seg = h - 1;
            while (seg > pos && (s[seg] & 0xC0) == 0x80)
                seg--;
        }
        size_t e = h + 1;
        while (e < n && !utf8_is_low_lead(s[e]))
            e++;
        char *norm = NULL;
        size_t nlen = 0;
        if (tok_normalize(t, s + seg, e - seg, &norm, &nlen)) return -EILSEQ;
        int rc = tok_bytes_append(out, s + pos, seg - pos);
        if (!rc) rc = tok_bytes_append(out, norm, nlen);
        free(norm);
        if (rc) return rc;
        *changed = true;
        pos = e;
    }
    if (*changed) return tok_bytes_append(out, s + pos, n - pos);
    return 0;
}

int tok_normalize_piece(const tokenizer *t, const uint8_t *s, size_t n, char **out,
                        size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    if (t->n_norm == 0) return 0;
    if (t->nfc_only) {
        tok_bytes b = {0};
        bool changed;
        int rc = tok_nfc_spans(t, s, n, &b, &changed);
        if (rc || !changed) {
            free(b.v);
            return rc;
        }
        *out = (char *)b.v;
        *out_len = b.n;
        return 0;
    }
    if (t->norm_ascii_noop) {
        bool ascii = true;
        for (size_t i = 0; i < n && ascii; i++)
            ascii = s[i] < 0x80;
        if (ascii) return 0;
    }
    return tok_normalize(t, s, n, out, out_len);
}
