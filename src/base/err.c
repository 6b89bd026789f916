/* err — see err.h. */
#include "base/err.h"

#include <stdio.h>

void err_vset(char *err, size_t cap, const char *fmt, va_list ap) {
    if (!err || cap == 0) return;
    vsnprintf(err, cap, fmt, ap);
}

void err_set(char *err, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    err_vset(err, cap, fmt, ap);
    va_end(ap);
}

int err_fail(char *err, size_t cap, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    err_vset(err, cap, fmt, ap);
    va_end(ap);
    return rc;
}
