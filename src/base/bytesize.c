/* bytesize — see bytesize.h for the grammar. */
#include "base/bytesize.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

static int is_digit(char c) {
    return c >= '0' && c <= '9';
}

static char lower(char c) {
    return c >= 'A' && c <= 'Z' ? (char)(c - 'A' + 'a') : c;
}

static int fail(const char **why, const char *msg) {
    if (why) *why = msg;
    return -EINVAL;
}

int bytesize_parse(const char *s, uint64_t *out, const char **why) {
    if (!s || !*s) return fail(why, "it is empty");
    if (*s == '-') return fail(why, "it is negative");
    if (!is_digit(*s) && !(*s == '.' && is_digit(s[1])))
        return fail(why, "it does not start with a digit");
    const char *p = s;
    uint64_t whole = 0;
    int overflow = 0;
    for (; is_digit(*p); p++) {
        unsigned d = (unsigned)(*p - '0');
        if (whole > (UINT64_MAX - d) / 10)
            overflow = 1;
        else
            whole = whole * 10 + d;
    }
    /* fraction: keep up to 18 digits exactly (frac_num / frac_den); later ones
     * change the result by less than a byte */
    uint64_t frac_num = 0, frac_den = 1;
    int has_frac = 0;
    if (*p == '.') {
        p++;
        if (!is_digit(*p)) return fail(why, "the '.' is not followed by a digit");
        for (; is_digit(*p); p++) {
            has_frac = 1;
            if (frac_den < 1000000000000000000ull) {
                frac_num = frac_num * 10 + (uint64_t)(*p - '0');
                frac_den *= 10;
            }
        }
    }
    int shift = 0;
    switch (lower(*p)) {
    case 'k':
        shift = 10;
        break;
    case 'm':
        shift = 20;
        break;
    case 'g':
        shift = 30;
        break;
    case 't':
        shift = 40;
        break;
    default:
        break;
    }
    if (shift) p++;
    if (lower(*p) == 'i' && shift && lower(p[1]) == 'b')
        p += 2;
    else if (lower(*p) == 'b')
        p++;
    if (*p) {
        if (*p == 'e' || *p == 'E') return fail(why, "exponents are not accepted");
        return fail(why, "it ends in something that is not K, M, G, T, B or iB");
    }
    if (has_frac && !shift && frac_num)
        return fail(why, "a fraction of a byte needs a K, M, G or T suffix");
    if (overflow || (shift && whole > (UINT64_MAX >> shift)))
        return fail(why, "it is more than 18446744073709551615 bytes");
    uint64_t v = whole << shift;
    if (shift && frac_num) {
        /* floor(frac_num * 2^shift / frac_den): frac_num < 10^18 and 2^shift <= 2^40,
         * so the product fits in 128 bits; the quotient is < 2^shift */
        unsigned __int128 f = ((unsigned __int128)frac_num << shift) / frac_den;
        if (v > UINT64_MAX - (uint64_t)f)
            return fail(why, "it is more than 18446744073709551615 bytes");
        v += (uint64_t)f;
    }
    *out = v;
    return 0;
}

void bytesize_format(uint64_t v, char *buf, size_t cap) {
    static const char units[] = "TGMK";
    for (int i = 0; i < 4; i++) {
        int shift = 40 - 10 * i;
        if (v && (v & ((1ull << shift) - 1)) == 0) {
            snprintf(buf, cap, "%" PRIu64 "%c", v >> shift, units[i]);
            return;
        }
    }
    snprintf(buf, cap, "%" PRIu64, v);
}

int bytesize_parse_range(const char *what, const char *s, uint64_t min, uint64_t max, uint64_t *out,
                         char *err, size_t cap) {
    const char *why = NULL;
    uint64_t v = 0;
    char lo[32], hi[32], why_buf[64];
    bytesize_format(min, lo, sizeof lo);
    bytesize_format(max, hi, sizeof hi);
    if (bytesize_parse(s, &v, &why) == 0) {
        if (v >= min && v <= max) {
            *out = v;
            return 0;
        }
        snprintf(why_buf, sizeof why_buf, "it is %s %s", v < min ? "less than" : "more than",
                 v < min ? lo : hi);
        why = why_buf;
    }
    if (err && cap)
        snprintf(err, cap, "%s '%s' is not accepted: %s; accepted: a size of %s..%s bytes: %s",
                 what, s ? s : "", why, lo, hi, BYTESIZE_FORMS);
    return -EINVAL;
}
