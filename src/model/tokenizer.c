/*
 * tokenizer — byte-level BPE from Hugging Face tokenizer.json, and the
 * tokenizer_config.json fields the server needs.  See tokenizer.h for the
 * pipeline; every step mirrors Hugging Face `tokenizers` (added_vocabulary.rs,
 * normalizers, pre_tokenizers/split.rs + byte_level.rs, models/bpe/word.rs,
 * decoders/byte_level.rs), whose output tests/data/tokenizer/ holds.
 *
 * Tables (built once at load, read-only afterwards):
 *   vocab hash   raw token bytes -> model id (open addressing)
 *   merge hash   (left id, right id) -> (rank, merged id)
 *   tok_off/len  id -> bytes the id decodes to, in one arena
 * The word cache (raw word bytes -> ids, direct-mapped) is the only mutable
 * state and has its own mutex.
 */
#include "model/tokenizer.h"

#include "base/err.h"

#include <errno.h>
#include <oniguruma.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include <jansson.h>

/* ======================================================================
 * small helpers: error text, growable buffers, hashing
 * ====================================================================== */

typedef struct tok_ids {
    int32_t *v; /* (cap) ids */
    size_t n;   /* used */
    size_t cap; /* allocated */
} tok_ids;

static int tok_ids_push(tok_ids *a, int32_t id) {
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 64;
        int32_t *nv = realloc(a->v, nc * sizeof(*nv));
        if (!nv) return -ENOMEM;
        a->v = nv;
        a->cap = nc;
    }
    a->v[a->n++] = id;
    return 0;
}

typedef struct tok_bytes {
    uint8_t *v; /* (cap) bytes */
    size_t n;   /* used */
    size_t cap; /* allocated */
} tok_bytes;

static int tok_bytes_append(tok_bytes *b, const void *p, size_t n) {
    if (n >= PTRDIFF_MAX - b->n) return -ENOMEM; /* no object is that large */
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->n + n + 1)
            nc *= 2;
        uint8_t *nv = realloc(b->v, nc);
        if (!nv) return -ENOMEM;
        b->v = nv;
        b->cap = nc;
    }
    memcpy(b->v + b->n, p, n);
    b->n += n;
    return 0;
}

static uint64_t tok_hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a, then a final mix */
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

static uint64_t tok_hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static size_t tok_pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n)
        c *= 2;
    return c;
}

/* ======================================================================
 * UTF-8: validation and lossy decoding with Rust's rules
 * ====================================================================== */

/* Classify the sequence at s[0..n): 1..4 = a valid character of that length;
 * -k = invalid, the first k bytes are one maximal invalid subpart (one
 * U+FFFD); 0 = a valid prefix cut short by the end of the input. */
static int utf8_step(const uint8_t *s, size_t n) {
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    int need;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 1;
    } else if (c == 0xE0) {
        need = 2;
        lo = 0xA0;
    } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
        need = 2;
    } else if (c == 0xED) {
        need = 2;
        hi = 0x9F;
    } else if (c == 0xF0) {
        need = 3;
        lo = 0x90;
    } else if (c >= 0xF1 && c <= 0xF3) {
        need = 3;
    } else if (c == 0xF4) {
        need = 3;
        hi = 0x8F;
    } else {
        return -1;
    }
    for (int i = 1; i <= need; i++) {
        if ((size_t)i >= n) return 0;
        uint8_t b = s[i];
        if (i == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return -i;
    }
    return need + 1;
}

size_t tokenizer_utf8_check(const char *text, size_t len) {
    const uint8_t *s = (const uint8_t *)text;
    size_t i = 0;
    while (i < len) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        int k = utf8_step(s + i, len - i);
        if (k <= 0) return i;
        i += (size_t)k;
    }
    return len;
}

static const uint8_t utf8_replacement[3] = {0xEF, 0xBF, 0xBD};

/* Append s[0..n) to out, replacing invalid subparts with U+FFFD; when
 * final is false an incomplete trailing character is left unconsumed and its
 * length returned in *held (else it becomes U+FFFD). */
static int utf8_lossy_append(tok_bytes *out, const uint8_t *s, size_t n, bool final, size_t *held) {
    size_t i = 0, run = 0; /* run: start of the pending valid run */
    if (held) *held = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        int k = utf8_step(s + i, n - i);
        if (k > 0) {
            i += (size_t)k;
            continue;
        }
        if (tok_bytes_append(out, s + run, i - run)) return -ENOMEM;
        if (k == 0) {
            if (!final) {
                if (held) *held = n - i;
                return 0;
            }
            if (tok_bytes_append(out, utf8_replacement, 3)) return -ENOMEM;
            return 0;
        }
        if (tok_bytes_append(out, utf8_replacement, 3)) return -ENOMEM;
        i += (size_t)(-k);
        run = i;
    }
    return tok_bytes_append(out, s + run, i - run);
}

/* Decode one code point from valid UTF-8 at s (length in *len). */
static int32_t utf8_cp(const uint8_t *s, size_t n, int *len) {
    utf8proc_int32_t cp = -1;
    utf8proc_ssize_t k = utf8proc_iterate(s, (utf8proc_ssize_t)n, &cp);
    *len = k > 0 ? (int)k : 1;
    return cp;
}

/* ======================================================================
 * ByteLevel: the GPT-2 bytes <-> printable unicode map
 * ====================================================================== */

#define BYTE_MAP_CPS 324 /* code points used by the map are < 324 */

typedef struct tok_byte_map {
    uint16_t byte_to_cp[256];         /* byte -> code point */
    int16_t cp_to_byte[BYTE_MAP_CPS]; /* code point -> byte, -1 if none */
} tok_byte_map;

static tok_byte_map g_byte_map;
enum { CL_L = 1, CL_N = 2, CL_S = 4 }; /* \p{L}, \p{N}, \s */
static uint8_t g_ascii_class[128];     /* CL_* bits of each ASCII char, as Oniguruma has them */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void tok_global_init(void) {
    int n = 0;
    for (int c = 0; c < BYTE_MAP_CPS; c++)
        g_byte_map.cp_to_byte[c] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        int cp = printable ? b : 256 + n++;
        g_byte_map.byte_to_cp[b] = (uint16_t)cp;
        g_byte_map.cp_to_byte[cp] = (int16_t)b;
    }
    OnigEncoding enc[1] = {ONIG_ENCODING_UTF8};
    onig_initialize(enc, 1);
    /* ASCII character classes exactly as Oniguruma matches them */
    static const char *cls_pat[3] = {"\\p{L}", "\\p{N}", "\\s"};
    for (int k = 0; k < 3; k++) {
        OnigRegex re;
        OnigErrorInfo ei;
        const OnigUChar *pp = (const OnigUChar *)cls_pat[k];
        if (onig_new(&re, pp, pp + strlen(cls_pat[k]), ONIG_OPTION_NONE, ONIG_ENCODING_UTF8,
                     ONIG_SYNTAX_RUBY, &ei) != ONIG_NORMAL)
            continue; /* cannot happen; the class stays empty and the fast path is off */
        for (int ch = 0; ch < 128; ch++) {
            OnigUChar c = (OnigUChar)ch;
            if (onig_match(re, &c, &c + 1, &c, NULL, ONIG_OPTION_NONE) == 1)
                g_ascii_class[ch] |= (uint8_t)(1 << k);
        }
        onig_free(re);
    }
}

/* Byte-level string (UTF-8) -> raw bytes.  Returns false (and leaves out
 * untouched past its length on entry) when a character is not in the map. */
static bool byte_level_to_bytes(const char *s, size_t n, tok_bytes *out) {
    size_t start = out->n;
    const uint8_t *p = (const uint8_t *)s;
    size_t i = 0;
    while (i < n) {
        int l;
        int32_t cp = utf8_cp(p + i, n - i, &l);
        if (cp < 0 || cp >= BYTE_MAP_CPS || g_byte_map.cp_to_byte[cp] < 0) {
            out->n = start;
            return false;
        }
        uint8_t b = (uint8_t)g_byte_map.cp_to_byte[cp];
        if (tok_bytes_append(out, &b, 1)) {
            out->n = start;
            return false;
        }
        i += (size_t)l;
    }
    return true;
}

/* The ByteLevel decoder's rule for one token: map every character back to
 * its byte; if any character is not in the map, use the token's own UTF-8. */
static int token_decode_bytes(const char *s, size_t n, tok_bytes *out) {
    if (byte_level_to_bytes(s, n, out)) return 0;
    return tok_bytes_append(out, s, n);
}

/* ======================================================================
 * the tokenizer object
 * ====================================================================== */

typedef struct tok_added {
    char *content;    /* token text (UTF-8) */
    size_t len;       /* bytes of content */
    int32_t id;       /* its id */
    bool special;     /* skipped by decode(skip_special) */
    bool normalized;  /* matched after normalization (else on raw text) */
    bool lstrip;      /* swallows whitespace on its left */
    bool rstrip;      /* swallows whitespace on its right */
    bool single_word; /* only matches when not inside a word */
} tok_added;

enum { PRE_SPLIT = 1, PRE_BYTE_LEVEL = 2 };

typedef struct tok_pre {
    int kind;              /* PRE_SPLIT or PRE_BYTE_LEVEL */
    OnigRegex re;          /* the split pattern; NULL for ByteLevel without regex */
    bool add_prefix_space; /* ByteLevel: prepend ' ' to a piece not starting with one */
    bool qwen_fast;        /* re is QWEN2_PATTERN: ASCII matches skip Oniguruma */
} tok_pre;

/* The Qwen2 / Qwen2.5 split pattern.  Its matches over ASCII text are found by
 * qwen_match_ascii below, with character classes taken from Oniguruma
 * itself; anything involving a non-ASCII character goes to Oniguruma. */
static const char QWEN2_PATTERN[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

#define TOK_MAX_ID         (1 << 24) /* ids are dense: tables are sized by the largest */
#define TOK_MAX_NORM       4
#define TOK_MAX_PRE        4
#define TOK_CACHE_SLOTS    65536 /* direct-mapped word cache */
#define TOK_CACHE_MAX_WORD 64    /* words longer than this are not cached */

typedef struct tok_merge {
    uint64_t key;  /* left id << 32 | right id; UINT64_MAX when the slot is empty */
    uint32_t rank; /* merge priority: index in model.merges (lower merges first) */
    int32_t nid;   /* id of the merged token */
} tok_merge;

typedef struct tok_cache_slot {
    uint8_t *key;   /* word bytes (malloc'ed), NULL if empty */
    uint32_t klen;  /* bytes of key */
    uint32_t n_ids; /* ids of the word */
    int32_t *ids;   /* (n_ids) */
} tok_cache_slot;

struct tokenizer {
    /* ids: every id 0..n_ids-1 may or may not exist (has_id) */
    int32_t n_ids;       /* one more than the largest id */
    uint8_t *has_id;     /* (n_ids) 1: model vocab, 2: added token only, 0: unused id */
    uint8_t *is_special; /* (n_ids) 1 for added tokens marked special */
    uint8_t *arena;      /* decoded bytes of all tokens, back to back */
    size_t *tok_off;     /* (n_ids) offset of an id's bytes in arena */
    uint32_t *tok_len;   /* (n_ids) length of an id's bytes */
    size_t max_tok_len;  /* longest tok_len */

    /* model vocab: raw bytes -> id */
    int32_t *vocab_ht;    /* (vocab_mask+1) ids, -1 empty */
    size_t vocab_mask;    /* table size - 1 (power of two) */
    int32_t byte_id[256]; /* id of each single byte, -1 if none */
    bool ignore_merges;   /* BPE: a word found whole in the vocab is not merged */

    /* merges: (left << 32 | right) -> rank, merged id */
    tok_merge *merges; /* (merge_mask+1) slots, key UINT64_MAX when empty */
    size_t merge_mask; /* table size - 1 */

    tok_added *added;            /* (n_added) added tokens, in tokenizer.json order */
    size_t n_added;              /* entries of added */
    bool any_added_norm;         /* some added token has normalized=true */
    bool any_added_raw;          /* some added token has normalized=false */
    uint8_t added_first[2][256]; /* [normalized][byte]: 1 if an added token starts with it */

    int norm_flags[TOK_MAX_NORM]; /* utf8proc option sets, applied in order */
    int n_norm;                   /* entries of norm_flags */
    bool nfc_only;                /* the normalizer is exactly NFC (fast path) */
    tok_pre pre[TOK_MAX_PRE];     /* pre-tokenizer steps, applied in order */
    int n_pre;                    /* entries of pre */

    /* tokenizer_config.json */
    int32_t eos_id, pad_id, bos_id; /* -1 when absent */
    char *eos_token;                /* text, NULL when absent */
    bool add_bos, add_eos;          /* add_special adds these */
    uint64_t model_max_length;      /* 0 when absent */
    char *chat_template;            /* NULL when absent */

    pthread_mutex_t cache_mu; /* guards cache */
    tok_cache_slot *cache;    /* (TOK_CACHE_SLOTS) */
};

/* ---- vocab hash ---- */

static int32_t vocab_find(const tokenizer *t, const uint8_t *p, size_t n) {
    size_t i = tok_hash_bytes(p, n) & t->vocab_mask;
    for (;;) {
        int32_t id = t->vocab_ht[i];
        if (id < 0) return -1;
        if (t->tok_len[id] == n && memcmp(t->arena + t->tok_off[id], p, n) == 0) return id;
        i = (i + 1) & t->vocab_mask;
    }
}

static void vocab_insert(tokenizer *t, int32_t id) {
    const uint8_t *p = t->arena + t->tok_off[id];
    size_t i = tok_hash_bytes(p, t->tok_len[id]) & t->vocab_mask;
    while (t->vocab_ht[i] >= 0)
        i = (i + 1) & t->vocab_mask;
    t->vocab_ht[i] = id;
}

/* ---- merge hash ---- */

static bool merge_find(const tokenizer *t, int32_t a, int32_t b, uint32_t *rank, int32_t *nid) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = tok_hash_u64(key) & t->merge_mask;
    for (;;) {
        uint64_t k = t->merges[i].key;
        if (k == UINT64_MAX) return false;
        if (k == key) {
            *rank = t->merges[i].rank;
            *nid = t->merges[i].nid;
            return true;
        }
        i = (i + 1) & t->merge_mask;
    }
}

/* Inserts unless the pair is already there (HF keeps the first rank too). */
static void merge_insert(tokenizer *t, int32_t a, int32_t b, uint32_t rank, int32_t nid) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = tok_hash_u64(key) & t->merge_mask;
    while (t->merges[i].key != UINT64_MAX) {
        if (t->merges[i].key == key) return;
        i = (i + 1) & t->merge_mask;
    }
    t->merges[i] = (tok_merge){.key = key, .rank = rank, .nid = nid};
}

/* ======================================================================
 * loading
 * ====================================================================== */

static json_t *tok_load_json(const char *path, char *err, size_t cap, int *rc) {
    json_error_t je;
    json_t *root = json_load_file(path, JSON_DECODE_ANY, &je);
    if (!root) {
        FILE *f = fopen(path, "rb");
        if (!f) {
            *rc = -ENOENT;
            err_set(err, cap, "%s: cannot open: %s", path, strerror(errno));
        } else {
            fclose(f);
            *rc = -EINVAL;
            err_set(err, cap, "%s: malformed JSON at line %d column %d: %s", path, je.line,
                    je.column, je.text);
        }
        return NULL;
    }
    if (!json_is_object(root)) {
        *rc = -EINVAL;
        err_set(err, cap, "%s: top level is not a JSON object", path);
        json_decref(root);
        return NULL;
    }
    return root;
}

/* Escape a literal for Oniguruma (Split pattern {"String": ...}). */
static char *tok_regex_escape(const char *s) {
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

static int tok_compile(const char *path, const char *pattern, OnigRegex *re, char *err,
                       size_t cap) {
    OnigErrorInfo einfo;
    int r = onig_new(re, (const OnigUChar *)pattern, (const OnigUChar *)pattern + strlen(pattern),
                     ONIG_OPTION_NONE, ONIG_ENCODING_UTF8, ONIG_SYNTAX_RUBY, &einfo);
    if (r != ONIG_NORMAL) {
        char msg[ONIG_MAX_ERROR_MESSAGE_LEN];
        onig_error_code_to_str((OnigUChar *)msg, r, &einfo);
        err_set(err, cap, "%s: pre_tokenizer regex %s does not compile: %s", path, pattern, msg);
        *re = NULL;
        return -EINVAL;
    }
    return 0;
}

static const char *GPT2_PATTERN =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int tok_parse_normalizer(tokenizer *t, const char *path, json_t *n, char *err, size_t cap) {
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
    int flags;
    if (strcmp(type, "NFC") == 0)
        flags = UTF8PROC_STABLE | UTF8PROC_COMPOSE;
    else if (strcmp(type, "NFD") == 0)
        flags = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE;
    else if (strcmp(type, "NFKC") == 0)
        flags = UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
    else if (strcmp(type, "NFKD") == 0)
        flags = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
    else {
        err_set(err, cap,
                "%s: unsupported normalizer type \"%s\" (supported: NFC, NFD, NFKC, NFKD, "
                "Sequence of these, null)",
                path, type);
        return -ENOTSUP;
    }
    if (t->n_norm == TOK_MAX_NORM) {
        err_set(err, cap, "%s: more than %d normalizers", path, TOK_MAX_NORM);
        return -ENOTSUP;
    }
    t->norm_flags[t->n_norm++] = flags;
    return 0;
}

static int tok_parse_pre(tokenizer *t, const char *path, json_t *p, char *err, size_t cap) {
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
        int rc = tok_compile(path, rx ? rx : esc, &s->re, err, cap);
        free(esc);
        if (rc) return rc;
        s->kind = PRE_SPLIT;
        s->qwen_fast = rx && strcmp(rx, QWEN2_PATTERN) == 0;
    } else if (strcmp(type, "ByteLevel") == 0) {
        s->kind = PRE_BYTE_LEVEL;
        s->add_prefix_space = json_is_true(json_object_get(p, "add_prefix_space"));
        json_t *ur = json_object_get(p, "use_regex");
        if (!ur || json_is_true(ur)) {
            int rc = tok_compile(path, GPT2_PATTERN, &s->re, err, cap);
            if (rc) return rc;
        }
    } else {
        err_set(err, cap,
                "%s: unsupported pre_tokenizer type \"%s\" (supported: Split, ByteLevel, "
                "Sequence of these)",
                path, type);
        return -ENOTSUP;
    }
    t->n_pre++;
    return 0;
}

/* Resolve a byte-level merge half to an id. */
static int32_t tok_lookup_piece(tokenizer *t, const char *s, size_t n, tok_bytes *scratch) {
    scratch->n = 0;
    if (!byte_level_to_bytes(s, n, scratch)) {
        scratch->n = 0;
        if (tok_bytes_append(scratch, s, n)) return -1;
    }
    return vocab_find(t, scratch->v, scratch->n);
}

static int tok_parse_model(tokenizer *t, const char *path, json_t *model, json_t *added_list,
                           char *err, size_t cap) {
    const char *type = json_string_value(json_object_get(model, "type"));
    if (!type || strcmp(type, "BPE") != 0) {
        err_set(err, cap, "%s: unsupported model type \"%s\" (supported: BPE)", path,
                type ? type : "(missing)");
        return -ENOTSUP;
    }
    const char *cont = json_string_value(json_object_get(model, "continuing_subword_prefix"));
    const char *eow = json_string_value(json_object_get(model, "end_of_word_suffix"));
    if ((cont && *cont) || (eow && *eow)) {
        err_set(err, cap,
                "%s: BPE with continuing_subword_prefix/end_of_word_suffix is not supported", path);
        return -ENOTSUP;
    }
    json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout) && json_number_value(dropout) != 0.0) {
        err_set(err, cap, "%s: BPE dropout is not supported", path);
        return -ENOTSUP;
    }
    t->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    json_t *vocab = json_object_get(model, "vocab");
    json_t *merges = json_object_get(model, "merges");
    if (!json_is_object(vocab)) {
        err_set(err, cap, "%s: model.vocab is missing or not an object", path);
        return -EINVAL;
    }
    if (!json_is_array(merges)) {
        err_set(err, cap, "%s: model.merges is missing or not an array", path);
        return -EINVAL;
    }

    /* id range */
    int64_t max_id = -1;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 ||
            json_integer_value(val) > INT32_MAX - 1) {
            err_set(err, cap, "%s: model.vocab[\"%s\"] is not a non-negative integer id", path,
                    key);
            return -EINVAL;
        }
        if (json_integer_value(val) > max_id) max_id = json_integer_value(val);
    }
    size_t i;
    json_array_foreach(added_list, i, val) {
        json_t *id = json_object_get(val, "id");
        const char *content = json_string_value(json_object_get(val, "content"));
        if (!json_is_integer(id) || json_integer_value(id) < 0 ||
            json_integer_value(id) > INT32_MAX - 1 || !content) {
            err_set(err, cap,
                    "%s: added_tokens[%zu] needs an integer \"id\" >= 0 and a string "
                    "\"content\"",
                    path, i);
            return -EINVAL;
        }
        if (json_integer_value(id) > max_id) max_id = json_integer_value(id);
    }
    if (max_id < 0) {
        err_set(err, cap, "%s: model.vocab is empty", path);
        return -EINVAL;
    }
    if (max_id >= TOK_MAX_ID) {
        err_set(err, cap, "%s: token id %lld is too large (ids below %d are supported)", path,
                (long long)max_id, TOK_MAX_ID);
        return -EINVAL;
    }
    t->n_ids = (int32_t)(max_id + 1);
    size_t n = (size_t)t->n_ids;
    t->has_id = calloc(n, 1);
    t->is_special = calloc(n, 1);
    t->tok_off = calloc(n, sizeof(size_t));
    t->tok_len = calloc(n, sizeof(uint32_t));
    t->vocab_mask = tok_pow2_at_least(2 * json_object_size(vocab)) - 1;
    t->vocab_ht = malloc((t->vocab_mask + 1) * sizeof(int32_t));
    if (!t->has_id || !t->is_special || !t->tok_off || !t->tok_len || !t->vocab_ht) return -ENOMEM;
    memset(t->vocab_ht, 0xff, (t->vocab_mask + 1) * sizeof(int32_t));

    /* token bytes into one arena */
    tok_bytes arena = {0};
    json_object_foreach(vocab, key, val) {
        int32_t id = (int32_t)json_integer_value(val);
        if (t->has_id[id]) {
            err_set(err, cap, "%s: model.vocab id %d appears twice (\"%s\")", path, id, key);
            free(arena.v);
            return -EINVAL;
        }
        t->has_id[id] = 1;
        t->tok_off[id] = arena.n;
        if (token_decode_bytes(key, strlen(key), &arena)) {
            free(arena.v);
            return -ENOMEM;
        }
        t->tok_len[id] = (uint32_t)(arena.n - t->tok_off[id]);
    }
    json_array_foreach(added_list, i, val) {
        int32_t id = (int32_t)json_integer_value(json_object_get(val, "id"));
        if (t->has_id[id]) continue; /* an added token that is also in the vocab */
        const char *content = json_string_value(json_object_get(val, "content"));
        t->has_id[id] = 2;
        t->tok_off[id] = arena.n;
        if (token_decode_bytes(content, strlen(content), &arena)) {
            free(arena.v);
            return -ENOMEM;
        }
        t->tok_len[id] = (uint32_t)(arena.n - t->tok_off[id]);
    }
    t->arena = arena.v;
    for (size_t id = 0; id < n; id++) {
        if (t->tok_len[id] > t->max_tok_len) t->max_tok_len = t->tok_len[id];
        if (t->has_id[id] == 1 && vocab_find(t, t->arena + t->tok_off[id], t->tok_len[id]) < 0)
            vocab_insert(t, (int32_t)id);
    }
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        t->byte_id[b] = vocab_find(t, &c, 1);
    }

    /* merges */
    size_t nm = json_array_size(merges);
    t->merge_mask = tok_pow2_at_least(2 * nm + 16) - 1;
    t->merges = malloc((t->merge_mask + 1) * sizeof(tok_merge));
    if (!t->merges) return -ENOMEM;
    for (size_t k = 0; k <= t->merge_mask; k++)
        t->merges[k].key = UINT64_MAX;
    tok_bytes scratch = {0}, joined = {0};
    int rc = 0;
    json_array_foreach(merges, i, val) {
        const char *a, *b;
        size_t la, lb;
        if (json_is_string(val)) {
            const char *s = json_string_value(val);
            const char *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                err_set(err, cap,
                        "%s: merges[%zu] \"%s\" is not two tokens separated by one "
                        "space",
                        path, i, s);
                rc = -EINVAL;
                break;
            }
            a = s;
            la = (size_t)(sp - s);
            b = sp + 1;
            lb = strlen(b);
        } else if (json_is_array(val) && json_array_size(val) == 2 &&
                   json_is_string(json_array_get(val, 0)) &&
                   json_is_string(json_array_get(val, 1))) {
            a = json_string_value(json_array_get(val, 0));
            b = json_string_value(json_array_get(val, 1));
            la = strlen(a);
            lb = strlen(b);
        } else {
            err_set(err, cap, "%s: merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", path, i);
            rc = -EINVAL;
            break;
        }
        int32_t ia = tok_lookup_piece(t, a, la, &scratch);
        int32_t ib = tok_lookup_piece(t, b, lb, &scratch);
        joined.n = 0;
        if (tok_bytes_append(&joined, a, la) || tok_bytes_append(&joined, b, lb)) {
            rc = -ENOMEM;
            break;
        }
        int32_t inew = tok_lookup_piece(t, (const char *)joined.v, joined.n, &scratch);
        if (ia < 0 || ib < 0 || inew < 0) {
            err_set(err, cap, "%s: merges[%zu] (\"%.*s\", \"%.*s\"): %s is not in the vocab", path,
                    i, (int)la, a, (int)lb, b,
                    ia < 0   ? "the first token"
                    : ib < 0 ? "the second token"
                             : "the merged token");
            rc = -EINVAL;
            break;
        }
        merge_insert(t, ia, ib, (uint32_t)i, inew);
    }
    free(scratch.v);
    free(joined.v);
    return rc;
}

/* Apply the normalizers to s[0..n); *out is malloc'ed and NUL-terminated. */
static int tok_normalize(const tokenizer *t, const uint8_t *s, size_t n, char **out,
                         size_t *out_len) {
    uint8_t *cur = malloc(n + 1);
    if (!cur) return -ENOMEM;
    memcpy(cur, s, n);
    cur[n] = 0;
    utf8proc_ssize_t len = (utf8proc_ssize_t)n;
    for (int k = 0; k < t->n_norm; k++) {
        uint8_t *o = NULL;
        len = utf8proc_map(cur, len, &o, (utf8proc_option_t)t->norm_flags[k]);
        free(cur);
        if (len < 0) return -EILSEQ;
        cur = o;
    }
    *out = (char *)cur;
    *out_len = (size_t)len;
    return 0;
}

static int tok_parse_added(tokenizer *t, const char *path, json_t *list, char *err, size_t cap) {
    size_t n = json_array_size(list);
    if (n == 0) return 0;
    t->added = calloc(n, sizeof(*t->added));
    if (!t->added) return -ENOMEM;
    size_t i;
    json_t *v;
    json_array_foreach(list, i, v) {
        tok_added *a = &t->added[t->n_added];
        const char *content = json_string_value(json_object_get(v, "content"));
        a->len = strlen(content);
        if (a->len == 0) {
            err_set(err, cap, "%s: added_tokens[%zu] has empty content", path, i);
            return -EINVAL;
        }
        a->id = (int32_t)json_integer_value(json_object_get(v, "id"));
        a->special = json_is_true(json_object_get(v, "special"));
        json_t *norm = json_object_get(v, "normalized");
        /* HF default: normalized = !special */
        a->normalized = norm ? json_is_true(norm) : !a->special;
        if (a->normalized) { /* matched against normalized text: normalize it too */
            int rc = tok_normalize(t, (const uint8_t *)content, a->len, &a->content, &a->len);
            if (rc) {
                err_set(err, cap, "%s: added_tokens[%zu] content is not valid UTF-8", path, i);
                return rc;
            }
        } else {
            a->content = strdup(content);
            if (!a->content) return -ENOMEM;
        }
        a->lstrip = json_is_true(json_object_get(v, "lstrip"));
        a->rstrip = json_is_true(json_object_get(v, "rstrip"));
        a->single_word = json_is_true(json_object_get(v, "single_word"));
        if (a->special) t->is_special[a->id] = 1;
        t->added_first[a->normalized][(uint8_t)a->content[0]] = 1;
        if (a->normalized)
            t->any_added_norm = true;
        else
            t->any_added_raw = true;
        t->n_added++;
    }
    return 0;
}

static int tok_check_decoder(const char *path, json_t *d, const char *what, char *err, size_t cap) {
    if (!d || json_is_null(d)) return 0;
    const char *type = json_string_value(json_object_get(d, "type"));
    if (type && strcmp(type, "ByteLevel") == 0) return 0;
    err_set(err, cap, "%s: unsupported %s type \"%s\" (supported: ByteLevel, null)", path, what,
            type ? type : "(missing)");
    return -ENOTSUP;
}

/* eos_token etc.: a string or an AddedToken object {"content": ...}. */
static const char *cfg_token_text(json_t *v) {
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v)) return json_string_value(json_object_get(v, "content"));
    return NULL;
}

static int tok_read_text_file(const char *path, char **out) {
    FILE *f = fopen(path, "rb");
    if (!f) return -errno;
    tok_bytes b = {0};
    char buf[65536];
    size_t k;
    while ((k = fread(buf, 1, sizeof(buf), f)) > 0) {
        if (tok_bytes_append(&b, buf, k)) {
            fclose(f);
            free(b.v);
            return -ENOMEM;
        }
    }
    fclose(f);
    if (tok_bytes_append(&b, "", 1)) {
        free(b.v);
        return -ENOMEM;
    }
    *out = (char *)b.v;
    return 0;
}

static int tok_parse_config(tokenizer *t, const char *dir, char *err, size_t cap) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
    FILE *probe = fopen(path, "rb");
    if (!probe) return 0; /* optional */
    fclose(probe);
    int rc = 0;
    json_t *cfg = tok_load_json(path, err, cap, &rc);
    if (!cfg) return rc;
    struct {
        const char *key;
        int32_t *id;
    } specs[] = {{"eos_token", &t->eos_id}, {"pad_token", &t->pad_id}, {"bos_token", &t->bos_id}};
    for (size_t k = 0; k < 3; k++) {
        json_t *v = json_object_get(cfg, specs[k].key);
        if (!v || json_is_null(v)) continue;
        const char *s = cfg_token_text(v);
        if (!s) {
            err_set(err, cap, "%s: %s is neither a string nor an object with \"content\"", path,
                    specs[k].key);
            rc = -EINVAL;
            goto out;
        }
        *specs[k].id = tokenizer_token_id(t, s);
        if (*specs[k].id < 0) {
            err_set(err, cap, "%s: %s \"%s\" is not a token of tokenizer.json", path, specs[k].key,
                    s);
            rc = -EINVAL;
            goto out;
        }
        if (k == 0) {
            t->eos_token = strdup(s);
            if (!t->eos_token) {
                rc = -ENOMEM;
                goto out;
            }
        }
    }
    t->add_bos = json_is_true(json_object_get(cfg, "add_bos_token"));
    t->add_eos = json_is_true(json_object_get(cfg, "add_eos_token"));
    json_t *mml = json_object_get(cfg, "model_max_length");
    if (json_is_integer(mml) && json_integer_value(mml) > 0)
        t->model_max_length = (uint64_t)json_integer_value(mml);
    else if (json_is_real(mml) && json_real_value(mml) > 0 && json_real_value(mml) < 1e18)
        t->model_max_length = (uint64_t)json_real_value(mml);

    json_t *ct = json_object_get(cfg, "chat_template");
    const char *tmpl = NULL;
    if (json_is_string(ct)) {
        tmpl = json_string_value(ct);
    } else if (json_is_array(ct)) { /* [{"name": ..., "template": ...}]: take "default" */
        size_t i;
        json_t *x;
        json_array_foreach(ct, i, x) {
            const char *name = json_string_value(json_object_get(x, "name"));
            if (name && strcmp(name, "default") == 0)
                tmpl = json_string_value(json_object_get(x, "template"));
        }
        if (!tmpl) {
            err_set(err, cap, "%s: chat_template list has no entry named \"default\"", path);
            rc = -EINVAL;
            goto out;
        }
    } else if (ct && !json_is_null(ct)) {
        err_set(err, cap, "%s: chat_template is neither a string nor a list", path);
        rc = -EINVAL;
        goto out;
    }
    if (tmpl) {
        t->chat_template = strdup(tmpl);
        if (!t->chat_template) rc = -ENOMEM;
    } else { /* newer transformers write it beside the config */
        snprintf(path, sizeof(path), "%s/chat_template.jinja", dir);
        if (tok_read_text_file(path, &t->chat_template) == -ENOMEM) rc = -ENOMEM;
    }
out:
    json_decref(cfg);
    return rc;
}

int tokenizer_load(const char *dir, tokenizer **out, char *err, size_t err_cap) {
    pthread_once(&g_once, tok_global_init);
    *out = NULL;
    char path[4096];
    if (snprintf(path, sizeof(path), "%s/tokenizer.json", dir) >= (int)sizeof(path)) {
        err_set(err, err_cap, "tokenizer directory path too long: %s", dir);
        return -ENAMETOOLONG;
    }
    int rc = 0;
    json_t *root = tok_load_json(path, err, err_cap, &rc);
    if (!root) return rc;
    tokenizer *t = calloc(1, sizeof(*t));
    if (!t) {
        json_decref(root);
        return -ENOMEM;
    }
    t->eos_id = t->pad_id = t->bos_id = -1;
    pthread_mutex_init(&t->cache_mu, NULL);
    t->cache = calloc(TOK_CACHE_SLOTS, sizeof(*t->cache));
    if (!t->cache) {
        rc = -ENOMEM;
        goto fail;
    }

    json_t *model = json_object_get(root, "model");
    json_t *added = json_object_get(root, "added_tokens");
    if (!json_is_object(model)) {
        err_set(err, err_cap, "%s: \"model\" is missing or not an object", path);
        rc = -EINVAL;
        goto fail;
    }
    if (added && !json_is_array(added) && !json_is_null(added)) {
        err_set(err, err_cap, "%s: \"added_tokens\" is not an array", path);
        rc = -EINVAL;
        goto fail;
    }
    if (!json_is_array(added)) added = NULL;
    json_t *empty = json_array();
    rc = tok_parse_normalizer(t, path, json_object_get(root, "normalizer"), err, err_cap);
    t->nfc_only = t->n_norm == 1 && t->norm_flags[0] == (UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (!rc) rc = tok_parse_model(t, path, model, added ? added : empty, err, err_cap);
    if (!rc && added) rc = tok_parse_added(t, path, added, err, err_cap);
    json_decref(empty);
    if (!rc) rc = tok_parse_pre(t, path, json_object_get(root, "pre_tokenizer"), err, err_cap);
    if (!rc)
        rc = tok_check_decoder(path, json_object_get(root, "decoder"), "decoder", err, err_cap);
    if (!rc)
        rc = tok_check_decoder(path, json_object_get(root, "post_processor"), "post_processor", err,
                               err_cap);
    if (!rc) {
        bool byte_level = false;
        for (int k = 0; k < t->n_pre; k++)
            byte_level |= t->pre[k].kind == PRE_BYTE_LEVEL;
        if (!byte_level) {
            err_set(err, err_cap,
                    "%s: pre_tokenizer has no ByteLevel step (only byte-level BPE is supported)",
                    path);
            rc = -ENOTSUP;
        }
    }
    if (rc) goto fail;
    json_decref(root);
    root = NULL;
    rc = tok_parse_config(t, dir, err, err_cap);
    if (rc) goto fail;
    *out = t;
    return 0;
fail:
    if (rc == -ENOMEM) err_set(err, err_cap, "%s: out of memory while loading", path);
    json_decref(root);
    tokenizer_free(t);
    return rc;
}

void tokenizer_free(tokenizer *t) {
    if (!t) return;
    free(t->has_id);
    free(t->is_special);
    free(t->arena);
    free(t->tok_off);
    free(t->tok_len);
    free(t->vocab_ht);
    free(t->merges);
    for (size_t i = 0; i < t->n_added; i++)
        free(t->added[i].content);
    free(t->added);
    for (int k = 0; k < t->n_pre; k++)
        if (t->pre[k].re) onig_free(t->pre[k].re);
    free(t->eos_token);
    free(t->chat_template);
    if (t->cache) {
        for (size_t i = 0; i < TOK_CACHE_SLOTS; i++) {
            free(t->cache[i].key);
            free(t->cache[i].ids);
        }
        free(t->cache);
    }
    pthread_mutex_destroy(&t->cache_mu);
    free(t);
}

/* ======================================================================
 * BPE on one word (raw bytes)
 * ====================================================================== */

typedef struct bpe_sym {
    int32_t id;   /* current token */
    int32_t prev; /* index of the left neighbour, -1 none */
    int32_t next; /* index of the right neighbour, -1 none */
    int32_t len;  /* bytes covered; 0 once merged into its left neighbour */
} bpe_sym;

typedef struct bpe_merge {
    uint32_t rank; /* merge priority (lower first) */
    int32_t pos;   /* index of the left symbol */
    int32_t nid;   /* id the pair becomes */
} bpe_merge;

static bool bpe_less(const bpe_merge *a, const bpe_merge *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void bpe_heap_push(bpe_merge *h, size_t *n, bpe_merge m) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!bpe_less(&m, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = m;
}

static bpe_merge bpe_heap_pop(bpe_merge *h, size_t *n) {
    bpe_merge top = h[0];
    bpe_merge last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && bpe_less(&h[c + 1], &h[c])) c++;
        if (!bpe_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

static void bpe_try_pair(const tokenizer *t, const bpe_sym *sy, int32_t pos, bpe_merge *h,
                         size_t *nh) {
    int32_t nx = sy[pos].next;
    if (nx < 0) return;
    bpe_merge m = {.pos = pos};
    if (merge_find(t, sy[pos].id, sy[nx].id, &m.rank, &m.nid)) bpe_heap_push(h, nh, m);
}

static int bpe_word_uncached(const tokenizer *t, const uint8_t *w, size_t n, tok_ids *out) {
    if (t->ignore_merges) {
        int32_t id = vocab_find(t, w, n);
        if (id >= 0) return tok_ids_push(out, id);
    }
    bpe_sym stack_sy[128];
    bpe_merge stack_h[256];
    bpe_sym *sy = n <= 128 ? stack_sy : malloc(n * sizeof(*sy));
    /* each merge adds at most 2 heap entries: n + 2n bounds the heap */
    bpe_merge *h = n <= 80 ? stack_h : malloc(3 * n * sizeof(*h));
    int rc = 0;
    if (!sy || !h) {
        rc = -ENOMEM;
        goto out;
    }
    int32_t ns = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[w[i]];
        if (id < 0) continue; /* no unk token: HF drops the byte */
        sy[ns] = (bpe_sym){.id = id, .prev = ns - 1, .next = -1, .len = 1};
        if (ns > 0) sy[ns - 1].next = ns;
        ns++;
    }
    size_t nh = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        bpe_try_pair(t, sy, i, h, &nh);
    while (nh > 0) {
        bpe_merge top = bpe_heap_pop(h, &nh);
        bpe_sym *cur = &sy[top.pos];
        if (cur->len == 0 || cur->next < 0) continue;
        int32_t rpos = cur->next;
        uint32_t rank;
        int32_t nid;
        if (!merge_find(t, cur->id, sy[rpos].id, &rank, &nid) || nid != top.nid) continue;
        cur->id = nid;
        cur->len += sy[rpos].len;
        cur->next = sy[rpos].next;
        sy[rpos].len = 0;
        if (cur->next >= 0) sy[cur->next].prev = top.pos;
        if (cur->prev >= 0) bpe_try_pair(t, sy, cur->prev, h, &nh);
        bpe_try_pair(t, sy, top.pos, h, &nh);
    }
    for (int32_t i = 0; i < ns; i++)
        if (sy[i].len > 0 && (rc = tok_ids_push(out, sy[i].id))) break;
out:
    if (sy != stack_sy) free(sy);
    if (h != stack_h) free(h);
    return rc;
}

static int bpe_word(const tokenizer *t, const uint8_t *w, size_t n, tok_ids *out) {
    if (n == 0) return 0;
    if (n == 1 && t->byte_id[w[0]] >= 0) return tok_ids_push(out, t->byte_id[w[0]]);
    if (n > TOK_CACHE_MAX_WORD) return bpe_word_uncached(t, w, n, out);
    tokenizer *mt = (tokenizer *)t; /* the cache is the one mutable part */
    tok_cache_slot *slot = &mt->cache[tok_hash_bytes(w, n) & (TOK_CACHE_SLOTS - 1)];
    pthread_mutex_lock(&mt->cache_mu);
    if (slot->key && slot->klen == n && memcmp(slot->key, w, n) == 0) {
        int rc = 0;
        for (uint32_t i = 0; i < slot->n_ids && !rc; i++)
            rc = tok_ids_push(out, slot->ids[i]);
        pthread_mutex_unlock(&mt->cache_mu);
        return rc;
    }
    pthread_mutex_unlock(&mt->cache_mu);
    size_t start = out->n;
    int rc = bpe_word_uncached(t, w, n, out);
    if (rc) return rc;
    size_t k = out->n - start;
    uint8_t *key = malloc(n);
    int32_t *ids = malloc(k * sizeof(int32_t) + 1);
    if (!key || !ids) {
        free(key);
        free(ids);
        return 0; /* the cache is optional */
    }
    memcpy(key, w, n);
    memcpy(ids, out->v + start, k * sizeof(int32_t));
    pthread_mutex_lock(&mt->cache_mu);
    free(slot->key);
    free(slot->ids);
    slot->key = key;
    slot->klen = (uint32_t)n;
    slot->ids = ids;
    slot->n_ids = (uint32_t)k;
    pthread_mutex_unlock(&mt->cache_mu);
    return 0;
}

/* ======================================================================
 * encoding pipeline
 * ====================================================================== */

typedef struct enc_ctx {
    const tokenizer *t;
    tok_ids *out;                  /* ids produced so far */
    OnigRegion *region;            /* match registers, reused */
    tok_bytes prefix[TOK_MAX_PRE]; /* ByteLevel add_prefix_space scratch, per step */
    char *err;                     /* caller's error buffer */
    size_t err_cap;
} enc_ctx;

static int enc_pre(enc_ctx *c, int step, const uint8_t *s, size_t n);

/* Split s by the step's regex, Isolated: matches and the gaps between them
 * are pieces; empty pieces vanish. */
/* One match of QWEN2_PATTERN starting at i (the pattern matches at every
 * position), decided from ASCII characters only: returns its end, or 0 when
 * a non-ASCII character takes part in the decision (then Oniguruma decides).
 * Alternatives are tried in the pattern's order, as a backtracking engine
 * does. */
static size_t qwen_match_ascii(const uint8_t *s, size_t n, size_t i) {
#define CH(k)  ((k) < n ? (int)s[k] : -1) /* -1: end of text */
#define CLS(c) ((c) < 0 ? 0 : g_ascii_class[c])
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
        while (e < n && s[e] < 0x80 && (g_ascii_class[s[e]] & CL_L))
            e++;
        if (e < n && s[e] >= 0x80) return 0;
        return e;
    }
    /* \p{N} */
    if (k0 & CL_N) return i + 1;
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
        while (e < n && s[e] < 0x80 && !(g_ascii_class[s[e]] & (CL_S | CL_L | CL_N)))
            e++;
        if (e < n && s[e] >= 0x80) return 0;
        while (e < n && (s[e] == '\r' || s[e] == '\n'))
            e++;
        return e;
    }
    /* c0 is whitespace: \s*[\r\n]+ | \s+(?!\S) | \s+ */
    size_t e = i, last_nl = n;
    while (e < n && s[e] < 0x80 && (g_ascii_class[s[e]] & CL_S)) {
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

static int enc_regex_split(enc_ctx *c, int step, const tok_pre *p, const uint8_t *s, size_t n) {
    OnigRegex re = p->re;
    size_t pos = 0, last = 0;
    int rc;
    while (pos < n) {
        if (p->qwen_fast && pos == last) {
            size_t e = qwen_match_ascii(s, n, pos);
            if (e > pos) {
                if ((rc = enc_pre(c, step + 1, s + pos, e - pos))) return rc;
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
            utf8_cp(s + me, n - me, &l);
            pos = me + (size_t)l;
            continue;
        }
        if (ms > last && (rc = enc_pre(c, step + 1, s + last, ms - last))) return rc;
        if ((rc = enc_pre(c, step + 1, s + ms, me - ms))) return rc;
        last = pos = me;
    }
    if (last < n) return enc_pre(c, step + 1, s + last, n - last);
    return 0;
}

static int enc_pre(enc_ctx *c, int step, const uint8_t *s, size_t n) {
    if (n == 0) return 0;
    const tokenizer *t = c->t;
    if (step == t->n_pre) return bpe_word(t, s, n, c->out);
    const tok_pre *p = &t->pre[step];
    if (p->kind == PRE_BYTE_LEVEL && p->add_prefix_space && s[0] != ' ') {
        tok_bytes *b = &c->prefix[step];
        b->n = 0;
        if (tok_bytes_append(b, " ", 1) || tok_bytes_append(b, s, n)) return -ENOMEM;
        s = b->v;
        n = b->n;
    }
    if (!p->re) return enc_pre(c, step + 1, s, n);
    return enc_regex_split(c, step, p, s, n);
}

/* Apply the normalizers to s, then the normalized added tokens, then the
 * pre-tokenizers and the model. */
static int enc_added(enc_ctx *c, const uint8_t *s, size_t n, bool normalized);

/* NFC fast path.  Text whose code points are all below U+0300 is NFC, and a
 * character below U+0300 is a starter that is never the second half of a
 * composition, so the boundary before it is safe: only spans holding a code
 * point >= U+0300 (lead byte >= 0xCC), from the character before them to the
 * next character below U+0300, go through utf8proc.  *out is NULL when s is
 * already NFC. */
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

static int enc_normalized_piece(enc_ctx *c, const uint8_t *s, size_t n) {
    const tokenizer *t = c->t;
    char *cur = NULL;
    size_t len = 0;
    int rc = 0;
    if (t->nfc_only) {
        tok_bytes b = {0};
        bool changed;
        rc = tok_nfc_spans(t, s, n, &b, &changed);
        if (rc) {
            free(b.v);
            err_set(c->err, c->err_cap, "normalization failed");
            return rc;
        }
        cur = (char *)b.v;
        len = b.n;
        if (!changed) {
            free(b.v);
            cur = NULL;
        }
    } else if (t->n_norm > 0) {
        bool ascii = true;
        for (size_t i = 0; i < n && ascii; i++)
            ascii = s[i] < 0x80;
        if (!ascii && tok_normalize(t, s, n, &cur, &len)) {
            err_set(c->err, c->err_cap, "normalization failed");
            return -EILSEQ;
        }
    }
    const uint8_t *u = cur ? (const uint8_t *)cur : s;
    if (!cur) len = n;
    rc = t->any_added_norm ? enc_added(c, u, len, true) : enc_pre(c, 0, u, len);
    free(cur);
    return rc;
}

static bool cp_is_ws(int32_t c) { /* Rust char::is_whitespace (White_Space) */
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

static bool cp_is_word(int32_t c) { /* Rust: c.is_alphanumeric() || c == '_' */
    if (c == '_') return true;
    utf8proc_category_t k = utf8proc_category(c);
    return (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO) ||
           (k >= UTF8PROC_CATEGORY_ND && k <= UTF8PROC_CATEGORY_NO);
}

/* Last code point before s[end] (valid UTF-8). */
static int32_t cp_before(const uint8_t *s, size_t end, size_t *start) {
    size_t i = end - 1;
    while (i > 0 && (s[i] & 0xC0) == 0x80)
        i--;
    int l;
    *start = i;
    return utf8_cp(s + i, end - i, &l);
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
            bool ok_l = start == 0 || !cp_is_word(cp_before(s, start, &b));
            int l;
            bool ok_r = stop == n || !cp_is_word(utf8_cp(s + stop, n - stop, &l));
            if (!ok_l || !ok_r) continue;
        }
        if (start < done) continue; /* swallowed by a previous rstrip */
        if (a->lstrip) {
            while (start > done) {
                size_t b;
                if (!cp_is_ws(cp_before(s, start, &b))) break;
                start = b;
            }
        }
        if (a->rstrip) {
            while (stop < n) {
                int l;
                if (!cp_is_ws(utf8_cp(s + stop, n - stop, &l))) break;
                stop += (size_t)l;
            }
            pos = stop;
        }
        if (start > done) {
            rc = normalized ? enc_pre(c, 0, s + done, start - done)
                            : enc_normalized_piece(c, s + done, start - done);
            if (rc) return rc;
        }
        if ((rc = tok_ids_push(c->out, a->id))) return rc;
        done = stop;
    }
    if (done < n)
        return normalized ? enc_pre(c, 0, s + done, n - done)
                          : enc_normalized_piece(c, s + done, n - done);
    return 0;
}

int tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_special,
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
    enc_ctx c = {.t = t, .out = &out, .err = err, .err_cap = err_cap};
    c.region = onig_region_new();
    int rc = c.region ? 0 : -ENOMEM;
    if (!rc && add_special && t->add_bos && t->bos_id >= 0) rc = tok_ids_push(&out, t->bos_id);
    if (!rc && len > 0) {
        const uint8_t *s = (const uint8_t *)text;
        rc = t->any_added_raw ? enc_added(&c, s, len, false) : enc_normalized_piece(&c, s, len);
    }
    if (!rc && add_special && t->add_eos && t->eos_id >= 0) rc = tok_ids_push(&out, t->eos_id);
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

/* ======================================================================
 * decoding
 * ====================================================================== */

static bool tok_id_ok(const tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_ids && t->has_id[id];
}

int tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, bool skip_special,
                     char **text_out, size_t *len_out, char *err, size_t err_cap) {
    *text_out = NULL;
    if (len_out) *len_out = 0;
    tok_bytes raw = {0}, txt = {0};
    int rc = 0;
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
        rc = tok_bytes_append(&raw, t->arena + t->tok_off[id], t->tok_len[id]);
    }
    if (!rc) rc = utf8_lossy_append(&txt, raw.v ? raw.v : (const uint8_t *)"", raw.n, true, NULL);
    if (!rc) rc = tok_bytes_append(&txt, "", 1);
    free(raw.v);
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
    if (!rc) rc = utf8_lossy_append(&txt, in.v, in.n, false, &held);
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
    memcpy(out, utf8_replacement, 3); /* an unfinished character is one U+FFFD */
    *out_len = 3;
    st->n_pending = 0;
    return 0;
}

/* ======================================================================
 * accessors
 * ====================================================================== */

int32_t tokenizer_token_id(const tokenizer *t, const char *token) {
    size_t n = strlen(token);
    for (size_t k = 0; k < t->n_added; k++)
        if (t->added[k].len == n && memcmp(t->added[k].content, token, n) == 0)
            return t->added[k].id;
    tok_bytes b = {0};
    int32_t id = -1;
    if (byte_level_to_bytes(token, n, &b) && b.n > 0) id = vocab_find(t, b.v, b.n);
    free(b.v);
    return id;
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
