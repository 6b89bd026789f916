/*
 * sbuf — a growable byte buffer with a mandatory growth cap (curl's dynbuf
 * idea): every append either fits under the cap or fails with -ENOSPC, so a
 * hostile request cannot make the server grow a buffer without bound.  The
 * contents are always NUL-terminated for convenience.
 */
#ifndef DISAGG_SERVER_SBUF_H
#define DISAGG_SERVER_SBUF_H

#include <stdarg.h>
#include <stddef.h>

typedef struct sbuf {
    char *data; /* (len + 1) bytes, NUL-terminated; NULL until the first append */
    size_t len; /* bytes used, without the NUL */
    size_t cap; /* bytes allocated */
    size_t max; /* growth cap: len never exceeds this */
} sbuf;

void sbuf_init(sbuf *b, size_t max);
void sbuf_free(sbuf *b);
/* Returns 0 or -ENOSPC (cap reached) / -ENOMEM. */
int sbuf_append(sbuf *b, const char *p, size_t n);
int sbuf_appendf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Drop the first n bytes (n <= len). */
void sbuf_consume(sbuf *b, size_t n);
void sbuf_reset(sbuf *b);
/* Hands the buffer to the caller (malloc'ed, NUL-terminated, never NULL on
 * success) and leaves b empty; NULL on allocation failure. */
char *sbuf_detach(sbuf *b, size_t *len);

#endif
