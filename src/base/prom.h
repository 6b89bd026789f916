/*
 * prom — the one Prometheus text renderer (exposition format 0.0.4) of the
 * server, the proxy and the KV connector.
 *
 * A writer holds a growable, capped buffer.  Metrics are written family by
 * family: prom_family() writes the family's # HELP and # TYPE lines (once: a
 * family opened twice is an error, so all samples of a family stay together,
 * as the format requires), then its samples follow.  A counter family is
 * named without "_total": its HELP/TYPE lines and samples carry "_total", as
 * Python's prometheus_client writes format 0.0.4 (its parser then reads the
 * family as a counter).  Histograms get cumulative _bucket lines (le last,
 * +Inf = _count), then _count and _sum; summaries _count and _sum.
 *
 * Labels: a sample's labels are the writer's constant labels (prom_const_labels:
 * e.g. vLLM's model_name and engine) followed by the sample's own, given as
 * name, value pairs ended by NULL.  Values are escaped (backslash, double
 * quote, newline); names are checked against the format.
 *
 * Numbers: PROM_STYLE_FLOAT writes every value as prometheus_client does
 * ("3.0", "0.25", "+Inf", le="1.0"); PROM_STYLE_INT writes integral values as
 * integers ("3", le="1") and others as their shortest round-trip decimal.
 *
 * Errors are sticky: the first (-ENOMEM, -ENOSPC past the cap, -EINVAL for a
 * bad name or a sample outside its family) is kept and later calls do
 * nothing; prom_error() says which.  Not thread-safe (one writer per caller).
 */
#ifndef DISAGG_BASE_PROM_H
#define DISAGG_BASE_PROM_H

#include <stddef.h>
#include <stdint.h>

typedef enum prom_type { PROM_COUNTER, PROM_GAUGE, PROM_HISTOGRAM, PROM_SUMMARY } prom_type;

typedef enum prom_style {
    PROM_STYLE_FLOAT = 0, /* prometheus_client's: "3.0", le="1.0" */
    PROM_STYLE_INT,       /* integral values as integers: "3", le="1" */
} prom_style;

#define PROM_MAX_LABELS 16 /* constant + own labels of one sample */

typedef struct prom {
    char *data; /* (len + 1) bytes, NUL-terminated; NULL until the first write */
    size_t len; /* bytes written */
    size_t cap; /* bytes allocated */
    size_t max; /* growth cap: len never exceeds it */
    int err;    /* first error (0: none) */
    prom_style style;
    const char *const *const_kv; /* constant labels: name, value pairs */
    int n_const;                 /* pairs in const_kv */
    const char *fam;             /* the open family's name */
    prom_type fam_type;
    uint64_t *seen; /* hashes of the families written so far */
    int n_seen, cap_seen;
} prom;

/* A histogram's state, as its owner keeps it.  counts has n_bounds entries:
 * per bucket (observations in (bounds[i-1], bounds[i]]) or, with cumulative,
 * observations <= bounds[i]; anything above the last bound is only in count.
 * The +Inf bucket is count. */
typedef struct prom_hist {
    const double *bounds; /* ascending upper bounds, without +Inf */
    int n_bounds;
    const uint64_t *counts;
    int cumulative;
    uint64_t count; /* observations */
    double sum;     /* their sum */
} prom_hist;

/* An empty writer whose text never grows past max bytes. */
void prom_init(prom *p, size_t max, prom_style style);
void prom_free(prom *p);
/* 0 or the first error (<0). */
int prom_error(const prom *p);
/* The text (NUL-terminated, "" when nothing was written); valid until the next write. */
const char *prom_text(const prom *p);
void prom_set_style(prom *p, prom_style style);
/* Labels put first on every sample from now on: n pairs of name, value (kv is
 * not copied: it must outlive its use).  NULL, 0: none. */
void prom_const_labels(prom *p, const char *const *kv, int n);

/* Opens family name (without "_total" for a counter): its # HELP and # TYPE lines. */
void prom_family(prom *p, const char *name, prom_type type, const char *help);
/* A sample of the open counter or gauge family: labels are name, value, ..., NULL. */
void prom_sample(prom *p, double v, ...) __attribute__((sentinel));
/* The same with an integer value (exact in PROM_STYLE_INT). */
void prom_sample_u64(prom *p, uint64_t v, ...) __attribute__((sentinel));
/* The _bucket, _count and _sum lines of one series of the open histogram family. */
void prom_histogram(prom *p, const prom_hist *h, ...) __attribute__((sentinel));
/* The _count and _sum lines of one series of the open summary family. */
void prom_summary(prom *p, uint64_t count, double sum, ...) __attribute__((sentinel));
/* An info-style gauge: family name with one sample of value 1 carrying labels. */
void prom_info(prom *p, const char *name, const char *help, ...) __attribute__((sentinel));

/* v as a sample value in style (needs 32 bytes): NaN, +Inf, -Inf, an
 * integral value as "3.0" (FLOAT) or "3" (INT), else the shortest decimal
 * that reads back as v (Python's repr). */
void prom_format_value(double v, prom_style style, char *buf, size_t cap);

#endif
