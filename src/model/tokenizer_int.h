/*
 * tokenizer_int — the private parts of model/tokenizer shared by its files
 * (not for other modules):
 *   tokenizer_text.c    growable buffers, hashing, UTF-8 rules, the ByteLevel map
 *   tokenizer_norm.c    normalizers (NFC/NFD/NFKC/NFKD, Prepend, Replace, Strip)
 *   tokenizer_pre.c     pre-tokenizers (Split, ByteLevel, Metaspace)
 *   tokenizer_bpe.c     vocab and merge tables, BPE on one word, the word cache
 *   tokenizer_load.c    tokenizer.json / tokenizer_config.json parsing
 *   tokenizer_decode.c  decoders (ByteLevel; Replace+ByteFallback+Fuse+Strip;
 *                       Metaspace) and the stream decoder
 *   tokenizer.c         the encode pipeline (added tokens, post-processor), accessors
 * Every step mirrors Hugging Face `tokenizers` (see tokenizer.h).
 */
#ifndef DISAGG_MODEL_TOKENIZER_INT_H
#define DISAGG_MODEL_TOKENIZER_INT_H

#include "model/tokenizer.h"

#include <jansson.h>
#include <oniguruma.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- buffers, hashing (tokenizer_text.c) ---- */

typedef struct tok_ids {
    int32_t *v; /* (cap) ids */
    size_t n;   /* used */
    size_t cap; /* allocated */
} tok_ids;

typedef struct tok_bytes {
    uint8_t *v; /* (cap) bytes */
    size_t n;   /* used */
    size_t cap; /* allocated */
} tok_bytes;

int tok_ids_push(tok_ids *a, int32_t id);
int tok_bytes_append(tok_bytes *b, const void *p, size_t n);
uint64_t tok_hash_bytes(const uint8_t *p, size_t n);
uint64_t tok_hash_u64(uint64_t x);
size_t tok_pow2_at_least(size_t n);

/* ---- UTF-8 (tokenizer_text.c) ---- */

/* 1..4: a valid character of that length; -k: the first k bytes are one
 * maximal invalid subpart; 0: a valid prefix cut short by the end. */
int tok_utf8_step(const uint8_t *s, size_t n);
/* Append s[0..n) replacing invalid subparts with U+FFFD (Rust's
 * from_utf8_lossy); when !final an unfinished trailing character is held
 * back and its length returned in *held. */
int tok_utf8_lossy_append(tok_bytes *out, const uint8_t *s, size_t n, bool final, size_t *held);
/* One code point of valid UTF-8 at s (its length in *len). */
int32_t tok_utf8_cp(const uint8_t *s, size_t n, int *len);
/* Last code point before s[end]; *start is where it begins. */
int32_t tok_cp_before(const uint8_t *s, size_t end, size_t *start);
bool tok_cp_is_ws(int32_t c);   /* Rust char::is_whitespace */
bool tok_cp_is_word(int32_t c); /* Rust c.is_alphanumeric() || c == '_' */
extern const uint8_t tok_utf8_replacement[3];

/* ---- ByteLevel map and global init (tokenizer_text.c) ---- */

enum { CL_L = 1, CL_N = 2, CL_S = 4 }; /* \p{L}, \p{N}, \s */

extern uint8_t tok_ascii_class[128]; /* CL_* bits of each ASCII char, as Oniguruma has them */
void tok_global_init_once(void);
/* Byte-level string -> raw bytes; false (out unchanged) if a char is unmapped. */
bool tok_byte_level_to_bytes(const char *s, size_t n, tok_bytes *out);

/* ---- the tokenizer object ---- */

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

enum { NORM_UTF8PROC = 1, NORM_PREPEND, NORM_REPLACE, NORM_REPLACE_RE, NORM_STRIP };

typedef struct tok_norm {
    int kind;     /* NORM_* */
    int flags;    /* NORM_UTF8PROC: utf8proc options */
    char *a;      /* PREPEND: text; REPLACE: pattern (malloc'ed) */
    size_t alen;  /* bytes of a */
    char *b;      /* REPLACE, REPLACE_RE: content (malloc'ed) */
    size_t blen;  /* bytes of b */
    OnigRegex re; /* REPLACE_RE: the pattern */
    bool left;    /* STRIP: strip the left end */
    bool right;   /* STRIP: strip the right end */
} tok_norm;

enum { PRE_SPLIT = 1, PRE_BYTE_LEVEL = 2, PRE_METASPACE = 3 };
enum { FAST_NONE = 0, FAST_QWEN2 = 1, FAST_LLAMA3 = 3 }; /* value: max digits per \p{N} */
enum { PREPEND_NEVER = 0, PREPEND_FIRST, PREPEND_ALWAYS };

typedef struct tok_pre {
    int kind;              /* PRE_* */
    OnigRegex re;          /* the split pattern; NULL for ByteLevel without regex */
    bool add_prefix_space; /* ByteLevel: prepend ' ' to a piece not starting with one */
    int fast;              /* FAST_*: re is a known pattern whose ASCII matches skip Oniguruma */
    char rep[8];           /* Metaspace: the replacement character (UTF-8) */
    size_t rep_len;        /* bytes of rep */
    int prepend;           /* Metaspace: PREPEND_* */
    bool split;            /* Metaspace: split before each replacement character */
} tok_pre;

#define TOK_MAX_ID         (1 << 24) /* ids are dense: tables are sized by the largest */
#define TOK_MAX_NORM       8
#define TOK_MAX_PRE        4
#define TOK_MAX_POST       8     /* ids a post-processor template adds on each side */
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
    uint8_t *is_byte;    /* (n_ids) 1 for ByteFallback tokens <0xXX> (decode to one byte) */
    uint8_t *arena;      /* decoded bytes of all tokens, back to back */
    size_t *tok_off;     /* (n_ids) offset of an id's bytes in arena */
    uint32_t *tok_len;   /* (n_ids) length of an id's bytes */
    size_t max_tok_len;  /* longest tok_len */
    uint8_t *keys;       /* vocabulary strings of all tokens (UTF-8), back to back */
    size_t *key_off;     /* (n_ids) offset of an id's string in keys */
    uint32_t *key_len;   /* (n_ids) its length */

    /* model: byte_level: words are raw bytes and the vocab is keyed by the
     * bytes a token stands for; else (SentencePiece style) words are UTF-8
     * characters and the vocab is keyed by its strings */
    bool byte_level;          /* ByteLevel pre-tokenizer or decoder */
    int32_t *vocab_ht;        /* (vocab_mask+1) ids, -1 empty */
    size_t vocab_mask;        /* table size - 1 (power of two) */
    int32_t byte_id[256];     /* id of each single byte word, -1 if none */
    int32_t fallback_id[256]; /* byte_fallback: id of <0xXX>, -1 if none */
    bool ignore_merges;       /* BPE: a word found whole in the vocab is not merged */
    bool byte_fallback;       /* BPE: unknown chars become <0xXX> tokens */
    bool fuse_unk;            /* BPE: consecutive unknown chars make one unk */
    int32_t unk_id;           /* BPE unk_token id, -1 none (unknown chars are dropped) */

    /* merges: (left << 32 | right) -> rank, merged id */
    tok_merge *merges; /* (merge_mask+1) slots, key UINT64_MAX when empty */
    size_t merge_mask; /* table size - 1 */

    tok_added *added;            /* (n_added) added tokens, in tokenizer.json order */
    size_t n_added;              /* entries of added */
    bool any_added_norm;         /* some added token has normalized=true */
    bool any_added_raw;          /* some added token has normalized=false */
    uint8_t added_first[2][256]; /* [normalized][byte]: 1 if an added token starts with it */

    tok_norm norm[TOK_MAX_NORM]; /* normalizer steps, applied in order */
    int n_norm;                  /* entries of norm */
    bool nfc_only;               /* the normalizer is exactly NFC (fast path) */
    bool norm_ascii_noop;        /* every step leaves ASCII text unchanged */
    tok_pre pre[TOK_MAX_PRE];    /* pre-tokenizer steps, applied in order */
    int n_pre;                   /* entries of pre */

    /* post-processor TemplateProcessing (single): ids around the text */
    bool has_template;
    int32_t post_pre[TOK_MAX_POST], post_suf[TOK_MAX_POST];
    int n_post_pre, n_post_suf;

    /* decoder */
    bool dec_byte_level;     /* ByteLevel: characters map back to bytes */
    char *dec_from, *dec_to; /* Replace (String) or Metaspace: from -> to in each token */
    size_t dec_from_len, dec_to_len;
    bool dec_byte_fallback; /* ByteFallback: a run of <0xXX> ids that is not UTF-8
                             * becomes one U+FFFD per id */
    uint32_t dec_strip;     /* Strip/Metaspace: leading strip_char chars removed */
    char dec_strip_char;    /* the character Strip removes (ASCII) */

    /* tokenizer_config.json */
    int32_t eos_id, pad_id, bos_id; /* -1 when absent */
    char *eos_token;                /* text, NULL when absent */
    bool add_bos, add_eos;          /* add_special adds these (no template) */
    uint64_t model_max_length;      /* 0 when absent */
    char *chat_template;            /* NULL when absent */

    pthread_mutex_t cache_mu; /* guards cache */
    tok_cache_slot *cache;    /* (TOK_CACHE_SLOTS) */
};

/* ---- vocab, merges, BPE (tokenizer_bpe.c) ---- */

/* The vocab lookup key of id (bytes for byte-level, the string otherwise). */
const uint8_t *tok_match_key(const tokenizer *t, int32_t id, size_t *n);
int32_t tok_vocab_find(const tokenizer *t, const uint8_t *p, size_t n);
void tok_vocab_insert(tokenizer *t, int32_t id);
void tok_merge_insert(tokenizer *t, int32_t a, int32_t b, uint32_t rank, int32_t nid);
/* Append the ids of one pre-tokenized word. */
int tok_bpe_word(const tokenizer *t, const uint8_t *w, size_t n, tok_ids *out);

/* ---- normalizers (tokenizer_norm.c) ---- */

int tok_parse_normalizer(tokenizer *t, const char *path, json_t *n, char *err, size_t cap);
/* Apply every normalizer step to s[0..n); *out malloc'ed, NUL-terminated. */
int tok_normalize(const tokenizer *t, const uint8_t *s, size_t n, char **out, size_t *out_len);
/* Normalize one piece; *out is NULL when the piece is unchanged. */
int tok_normalize_piece(const tokenizer *t, const uint8_t *s, size_t n, char **out,
                        size_t *out_len);
void tok_norm_free(tok_norm *nm);

/* ---- pre-tokenizers (tokenizer_pre.c) ---- */

typedef struct enc_ctx {
    const tokenizer *t;
    tok_ids *out;                  /* ids produced so far */
    OnigRegion *region;            /* match registers, reused */
    tok_bytes prefix[TOK_MAX_PRE]; /* per-step scratch (prefix space, Metaspace) */
    const uint8_t *origin;         /* the piece at original offset 0, NULL when none */
    char *err;                     /* caller's error buffer */
    size_t err_cap;
    bool no_added;                 /* added tokens are plain text (tokenizer_encode_plain) */
} enc_ctx;

int tok_parse_pre(tokenizer *t, const char *path, json_t *p, char *err, size_t cap);
int tok_compile(const char *path, const char *what, const char *pattern, OnigRegex *re, char *err,
                size_t cap);
char *tok_regex_escape(const char *s);
/* Run pre-tokenizer steps step.. on s, then BPE on each word. */
int tok_enc_pre(enc_ctx *c, int step, const uint8_t *s, size_t n);

/* ---- decoders (tokenizer_decode.c) ---- */

int tok_parse_decoder(tokenizer *t, const char *path, json_t *d, char *err, size_t cap);
/* The bytes a vocabulary string decodes to, per the decoder (appended to out);
 * *is_byte set for a ByteFallback <0xXX> token. */
int tok_decode_key(const tokenizer *t, const char *s, size_t n, tok_bytes *out, bool *is_byte);

#endif
