/*
 * transfer_options — parsers for the values of `disagg bench transfer`'s
 * options that base/flags has no type for (a list's sizes by base/bytesize's
 * grammar, durations) and the size formatter its tables use.  tb_parse_size
 * prints its own error; for a duration the caller prints the error naming the
 * bad value and the accepted forms.
 */
#include "bench/transfer_bench.h"
#include "base/bytesize.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* A byte size by base/bytesize's grammar, within [min, max]; prints the error
 * naming opt and returns 2 when it is not accepted. */
int tb_parse_size(const char *opt, const char *s, uint64_t min, uint64_t max, size_t *out) {
    char what[64], err[512];
    uint64_t v;
    snprintf(what, sizeof what, "disagg bench transfer: %s", opt);
    if (bytesize_parse_range(what, s, min, max, &v, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 2;
    }
    *out = (size_t)v;
    return 0;
}

int tb_parse_duration(const char *s, double *out) {
    if (!s || !*s) return -1;
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    if (errno || end == s || !isfinite(v)) return -1;
    if (!strcmp(end, "ms"))
        v /= 1000.0;
    else if (*end && strcmp(end, "s"))
        return -1;
    if (!(v > 0) || v > 3600) return -1;
    *out = v;
    return 0;
}

const char *tb_format_size(size_t n, char *buf, size_t cap) {
    static const char *units[] = {"B", "KiB", "MiB", "GiB"};
    int u = 0;
    size_t v = n;
    while (u < 3 && v >= 1024 && v % 1024 == 0) {
        v /= 1024;
        u++;
    }
    snprintf(buf, cap, "%zu %s", v, units[u]);
    return buf;
}
