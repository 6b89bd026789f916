/*
 * metrics — the proxy's latency histograms (rendered by base/prom, as the
 * rest of the proxy's /metrics in proxy.c and membership.c).
 * Single-threaded: owned by the loop.
 */
#ifndef DISAGG_PROXY_METRICS_H
#define DISAGG_PROXY_METRICS_H

#include "base/prom.h"

#include <stdint.h>

#define METRICS_NBUCKETS 16 /* upper bounds 0.5 ms .. 60 s (metrics.c), +Inf implied */

typedef struct metrics_hist {
    uint64_t bucket[METRICS_NBUCKETS]; /* observations <= bound i (not cumulative) */
    uint64_t count;                    /* all observations */
    double sum;                        /* their sum in seconds */
} metrics_hist;

void metrics_hist_observe(metrics_hist *h, double seconds);
/* h as base/prom renders it (prom_histogram). */
prom_hist metrics_hist_view(const metrics_hist *h);

#endif
