/*
 * err — the one way a function writes its error message into a caller's
 * buffer (the `char *err, size_t errlen` pair most modules take): printf
 * formatting, truncated to the buffer, nothing written when err is NULL or
 * the buffer empty.
 */
#ifndef DISAGG_BASE_ERR_H
#define DISAGG_BASE_ERR_H

#include <stdarg.h>
#include <stddef.h>

/* Formats into err (cap bytes, NUL-terminated). */
void err_set(char *err, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void err_vset(char *err, size_t cap, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));
/* err_set, then returns rc: `return err_fail(err, cap, -EINVAL, "...", ...);`. */
int err_fail(char *err, size_t cap, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
