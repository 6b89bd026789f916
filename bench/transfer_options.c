/*
 * transfer_options — parsers for the values of `disagg bench transfer`'s
 * options (sizes with K/M/G suffixes, durations, bounded integers) and the
 * size formatter its tables use.  The callers print the error that names the
 * bad value and the accepted forms; these only say yes or no.
 */
#include "bench/transfer_bench.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

int tb_parse_size(const char *s, size_t *out) {
    if (!s || !isdigit((unsigned char)s[0])) return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) return -1;
    unsigned long long mul = 1;
    if (*end) {
        switch (toupper((unsigned char)*end)) {
        case 'K':
            mul = 1ull << 10;
            break;
        case 'M':
            mul = 1ull << 20;
            break;
        case 'G':
            mul = 1ull << 30;
            break;
        default:
            return -1;
        }
        end++;
        /* optional "B" or "iB" after the letter */
        if (!strcasecmp(end, "ib") || !strcasecmp(end, "b")) end += strlen(end);
        if (*end) return -1;
    }
    if (v == 0 || v > SIZE_MAX / mul) return -1;
    *out = (size_t)(v * mul);
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

int tb_parse_int(const char *s, long lo, long hi, long *out) {
    if (!s || !*s) return -1;
    errno = 0;
    char *end;
    long v = strtol(s, &end, 10);
    if (errno || *end || end == s || v < lo || v > hi) return -1;
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
