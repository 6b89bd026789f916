/*
 * sbuf — growable byte buffer with a growth cap (see sbuf.h).
 */
#include "server/sbuf.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void sbuf_init(sbuf *b, size_t max) {
    b->data = NULL;
    b->len = 0;
    b->cap = 0;
    b->max = max;
}

void sbuf_free(sbuf *b) {
    free(b->data);
    sbuf_init(b, b->max);
}

static int sbuf_reserve(sbuf *b, size_t extra) {
    if (extra > b->max - b->len) return -ENOSPC;
    size_t need = b->len + extra + 1;
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need)
        cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p) return -ENOMEM;
    b->data = p;
    b->cap = cap;
    return 0;
}

int sbuf_append(sbuf *b, const char *p, size_t n) {
    int rc = sbuf_reserve(b, n);
    if (rc) return rc;
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
    return 0;
}

int sbuf_appendf(sbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return -EINVAL;
    int rc = sbuf_reserve(b, (size_t)n);
    if (rc) return rc;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return 0;
}

void sbuf_consume(sbuf *b, size_t n) {
    if (n >= b->len) {
        sbuf_reset(b);
        return;
    }
    memmove(b->data, b->data + n, b->len - n);
    b->len -= n;
    b->data[b->len] = 0;
}

void sbuf_reset(sbuf *b) {
    b->len = 0;
    if (b->data) b->data[0] = 0;
}

char *sbuf_detach(sbuf *b, size_t *len) {
    if (!b->data && sbuf_reserve(b, 0)) return NULL;
    if (!b->data) return NULL;
    b->data[b->len] = 0;
    char *p = b->data;
    if (len) *len = b->len;
    b->data = NULL;
    b->len = b->cap = 0;
    return p;
}
