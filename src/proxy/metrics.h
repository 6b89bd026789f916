/*
 * metrics — the proxy's counters and latency histograms and their Prometheus
 * text exposition (format 0.0.4: # HELP / # TYPE lines, histogram
 * _bucket{le=...} / _sum / _count).  Single-threaded: owned by the loop.
 */
#ifndef DISAGG_PROXY_METRICS_H
#define DISAGG_PROXY_METRICS_H

#include <stddef.h>
#include <stdint.h>

struct evbuffer;

#define METRICS_NBUCKETS 16
extern const double METRICS_BUCKETS[METRICS_NBUCKETS]; /* upper bounds in seconds (+Inf implied) */

typedef struct metrics_hist {
    uint64_t bucket[METRICS_NBUCKETS]; /* observations <= METRICS_BUCKETS[i] (not cumulative) */
    uint64_t count;                    /* all observations */
    double sum;                        /* their sum in seconds */
} metrics_hist;

void metrics_hist_observe(metrics_hist *h, double seconds);
/* Writes name_bucket / name_sum / name_count lines; labels: `a="b",c="d"` or "". */
void metrics_hist_format(struct evbuffer *out, const char *name, const char *labels,
                         const metrics_hist *h);
/* v as a label value (backslash, double quote and newline escaped), cut to
 * fit cap (> 0). */
void metrics_label_value(const char *v, char *out, size_t cap);
/* # HELP and # TYPE lines. */
void metrics_header(struct evbuffer *out, const char *name, const char *type, const char *help);

#endif
