/*
 * bytesize — the one grammar for byte sizes given on the command line, in the
 * environment or in a config file (`--kv-cache-memory 512M`, `--buffer-size 1G`).
 *
 *   size   := number [suffix] ["B" | "iB"]
 *   number := digits ["." digits] | "." digits        (decimal, no sign, no exponent)
 *   suffix := K | M | G | T                            (binary: 1K = 1024, 1M = 1024K, ...)
 *
 * Letters are case-insensitive; "B" alone ("4096B") means bytes.  A fraction
 * needs a suffix and the result is rounded down to a whole byte (1.5K = 1536,
 * 0.3K = 307).  Refused: empty, negative, signs, spaces, exponents, an unknown
 * suffix, trailing garbage, more than UINT64_MAX bytes, and (per call site)
 * a value outside [min, max] — a site that allows 0 passes min = 0.
 */
#ifndef DISAGG_BASE_BYTESIZE_H
#define DISAGG_BASE_BYTESIZE_H

#include <stddef.h>
#include <stdint.h>

/* The accepted forms, for --help texts and error messages. */
#define BYTESIZE_FORMS                                                                             \
    "digits with an optional fraction and an optional K, M, G or T suffix (binary: 1K = 1024), "   \
    "optionally followed by B or iB, e.g. 4096, 64K, 512M, 1.5G, 2GiB"

/* Parse s by the grammar above into *out (unchanged on failure).  Returns 0,
 * or -EINVAL with *why (when why is non-NULL) set to a static phrase saying
 * what is wrong ("it is empty", "it is negative", ...). */
int bytesize_parse(const char *s, uint64_t *out, const char **why);

/* bytesize_parse() plus the range check [min, max].  On failure returns
 * -EINVAL and writes into err (cap bytes) the one message format:
 *   "<what> '<s>' is not accepted: <why>; accepted: a size of <min>..<max> bytes:
 *    <BYTESIZE_FORMS>"
 * where <what> is the caller's context, e.g. "disagg serve: --kv-cache-memory". */
int bytesize_parse_range(const char *what, const char *s, uint64_t min, uint64_t max, uint64_t *out,
                         char *err, size_t cap);

/* v in the shortest exact form of the grammar ("64M", "1536", "1T"). */
void bytesize_format(uint64_t v, char *buf, size_t cap);

#endif
