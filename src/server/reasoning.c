/*
 * reasoning — <think> splitting of chat output (see reasoning.h).
 */
#include "server/reasoning.h"

#include <string.h>

#define THINK_OPEN  "<think>"
#define THINK_CLOSE "</think>"

int reasoning_kind_from_name(const char *name, reasoning_kind *out) {
    if (!strcmp(name, "qwen3")) {
        *out = REASONING_QWEN3;
        return 0;
    }
    if (!strcmp(name, "deepseek_r1")) {
        *out = REASONING_DEEPSEEK_R1;
        return 0;
    }
    return -1;
}

static const char *find(const char *h, size_t n, const char *needle) {
    return memmem(h, n, needle, strlen(needle));
}

/* Bytes at the end of text[0, len) that are a proper prefix of tag. */
static size_t partial_tail(const char *text, size_t len, const char *tag) {
    size_t tl = strlen(tag);
    for (size_t k = tl - 1; k > 0; k--)
        if (len >= k && !memcmp(text + len - k, tag, k)) return k;
    return 0;
}

/* last occurrence of needle in h[0, n), or NULL */
static const char *find_last(const char *h, size_t n, const char *needle) {
    const char *last = NULL, *p = h;
    size_t nl = strlen(needle);
    while ((p = memmem(p, n - (size_t)(p - h), needle, nl))) {
        last = p;
        p += 1;
        if ((size_t)(p - h) >= n) break;
    }
    return last;
}

bool reasoning_prompt_closes(const char *text, size_t len) {
    const char *o = find_last(text, len, THINK_OPEN), *c = find_last(text, len, THINK_CLOSE);
    return c && (!o || c > o);
}

void reasoning_split_final(reasoning_kind k, const char *text, size_t len, reasoning_split *out) {
    *out = (reasoning_split){.c_start = 0, .c_end = len};
    if (k == REASONING_NONE) return;
    if (k == REASONING_QWEN3 && !find(text, len, THINK_CLOSE)) return;
    const char *open = find(text, len, THINK_OPEN);
    size_t start = open ? (size_t)(open - text) + strlen(THINK_OPEN) : 0;
    const char *close = find(text + start, len - start, THINK_CLOSE);
    if (!close) { /* deepseek_r1 without "</think>"; qwen3's only "</think>" before "<think>" */
        *out = (reasoning_split){true, start, len, len, len};
        return;
    }
    size_t ce = (size_t)(close - text);
    *out = (reasoning_split){true, start, ce, ce + strlen(THINK_CLOSE), len};
}

void reasoning_split_stream(reasoning_kind k, bool prompt_closed, const char *text, size_t len,
                            bool final, reasoning_split *out) {
    *out = (reasoning_split){.c_start = 0, .c_end = len};
    if (k == REASONING_NONE) return;
    const char *open = find(text, len, THINK_OPEN);
    size_t start;
    if (open) {
        start = (size_t)(open - text) + strlen(THINK_OPEN);
    } else if (k == REASONING_DEEPSEEK_R1 || !prompt_closed) {
        /* reasoning from the start (R1; qwen3 unless the prompt closed a block: the thinking
         * templates open it in the prompt); a partial "<think>" at the very start waits */
        size_t hold = final ? 0 : partial_tail(text, len, THINK_OPEN);
        if (hold == len && len > 0) {
            *out = (reasoning_split){true, 0, 0, 0, 0};
            return;
        }
        start = 0;
    } else {
        /* qwen3 without "<think>" after a prompt that closed a block (enable_thinking false):
         * content, but a partial "<think>" waits */
        out->c_end = len - (final ? 0 : partial_tail(text, len, THINK_OPEN));
        return;
    }
    const char *close = find(text + start, len - start, THINK_CLOSE);
    if (!close) {
        size_t hold = final ? 0 : partial_tail(text + start, len - start, THINK_CLOSE);
        *out = (reasoning_split){true, start, len - hold, len, len};
        return;
    }
    size_t ce = (size_t)(close - text);
    *out = (reasoning_split){true, start, ce, ce + strlen(THINK_CLOSE), len};
}
