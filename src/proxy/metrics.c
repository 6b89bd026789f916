/* metrics — see metrics.h. */
#include "proxy/metrics.h"

/* upper bounds in seconds */
static const double hist_bounds[METRICS_NBUCKETS] = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};

void metrics_hist_observe(metrics_hist *h, double s) {
    for (int i = 0; i < METRICS_NBUCKETS; i++)
        if (s <= hist_bounds[i]) {
            h->bucket[i]++;
            break;
        }
    h->count++;
    h->sum += s;
}

prom_hist metrics_hist_view(const metrics_hist *h) {
    prom_hist v = {hist_bounds, METRICS_NBUCKETS, h->bucket, 0, h->count, h->sum};
    return v;
}
