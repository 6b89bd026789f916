/*
 * tokenizer_text — growable buffers, hashing, UTF-8 validation and lossy
 * decoding with Rust's rules, character classes, and the GPT-2 ByteLevel
 * bytes <-> printable unicode map (see tokenizer_int.h).
 */
#include "model/tokenizer_int.h"

#include <errno.h>
#include <oniguruma.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

int tok_ids_push(tok_ids *a, int32_t id) {
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
int tok_bytes_append(tok_bytes *b, const void *p, size_t n) {
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

uint64_t tok_hash_bytes(const uint8_t *p, size_t n) {
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

uint64_t tok_hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

size_t tok_pow2_at_least(size_t n) {
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
int tok_utf8_step(const uint8_t *s, size_t n) {
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
        int k = tok_utf8_step(s + i, len - i);
        if (k <= 0) return i;
        i += (size_t)k;
    }
    return len;
}

const uint8_t tok_utf8_replacement[3] = {0xEF, 0xBF, 0xBD};

/* Append s[0..n) to out, replacing invalid subparts with U+FFFD; when
 * final is false an incomplete trailing character is left unconsumed and its
 * length returned in *held (else it becomes U+FFFD). */
int tok_utf8_lossy_append(tok_bytes *out, const uint8_t *s, size_t n, bool final, size_t *held) {
    size_t i = 0, run = 0; /* run: start of the pending valid run */
    if (held) *held = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        int k = tok_utf8_step(s + i, n - i);
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
            if (tok_bytes_append(out, tok_utf8_replacement, 3)) return -ENOMEM;
            return 0;
        }
        if (tok_bytes_append(out, tok_utf8_replacement, 3)) return -ENOMEM;
        i += (size_t)(-k);
        run = i;
    }
    return tok_bytes_append(out, s + run, i - run);
}

/* Decode one code point from valid UTF-8 at s (length in *len). */
int32_t tok_utf8_cp(const uint8_t *s, size_t n, int *len) {
    utf8proc_int32_t cp = -1;
    utf8proc_ssize_t k = utf8proc_iterate(s, (utf8proc_ssize_t)n, &cp);
    *len = k > 0 ? (int)k : 1;
    return cp;
}

/* ======================================================================
 * ByteLevel: the GPT-2 bytes <-> printable unicode map
 * ====================================================================== */

#define BYTE_MAP_CPS 324 /* code points used by the map are < 324 */

static struct {
    uint16_t byte_to_cp[256];         /* byte -> code point */
    int16_t cp_to_byte[BYTE_MAP_CPS]; /* code point -> byte, -1 if none */
} byte_map;
uint8_t tok_ascii_class[128];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void tok_global_init(void) {
    int n = 0;
    for (int c = 0; c < BYTE_MAP_CPS; c++)
        byte_map.cp_to_byte[c] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        int cp = printable ? b : 256 + n++;
        byte_map.byte_to_cp[b] = (uint16_t)cp;
        byte_map.cp_to_byte[cp] = (int16_t)b;
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
                tok_ascii_class[ch] |= (uint8_t)(1 << k);
        }
        onig_free(re);
    }
}

/* Byte-level string (UTF-8) -> raw bytes.  Returns false (and leaves out
 * untouched past its length on entry) when a character is not in the map. */
bool tok_byte_level_to_bytes(const char *s, size_t n, tok_bytes *out) {
    size_t start = out->n;
    const uint8_t *p = (const uint8_t *)s;
    size_t i = 0;
    while (i < n) {
        int l;
        int32_t cp = tok_utf8_cp(p + i, n - i, &l);
        if (cp < 0 || cp >= BYTE_MAP_CPS || byte_map.cp_to_byte[cp] < 0) {
            out->n = start;
            return false;
        }
        uint8_t b = (uint8_t)byte_map.cp_to_byte[cp];
        if (tok_bytes_append(out, &b, 1)) {
            out->n = start;
            return false;
        }
        i += (size_t)l;
    }
    return true;
}

void tok_global_init_once(void) {
    pthread_once(&g_once, tok_global_init);
}

/* Last code point before s[end] (valid UTF-8). */
int32_t tok_cp_before(const uint8_t *s, size_t end, size_t *start) {
    size_t i = end - 1;
    while (i > 0 && (s[i] & 0xC0) == 0x80)
        i--;
    int l;
    *start = i;
    return tok_utf8_cp(s + i, end - i, &l);
}

bool tok_cp_is_ws(int32_t c) { /* Rust char::is_whitespace (White_Space) */
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

bool tok_cp_is_word(int32_t c) { /* Rust: c.is_alphanumeric() || c == '_' */
    if (c == '_') return true;
    utf8proc_category_t k = utf8proc_category(c);
    return (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO) ||
           (k >= UTF8PROC_CATEGORY_ND && k <= UTF8PROC_CATEGORY_NO);
}
