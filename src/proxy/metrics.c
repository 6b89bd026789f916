/* metrics — see metrics.h. */
#include "proxy/metrics.h"

#include <event2/buffer.h>

const double METRICS_BUCKETS[METRICS_NBUCKETS] = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};

void metrics_hist_observe(metrics_hist *h, double s) {
    for (int i = 0; i < METRICS_NBUCKETS; i++)
        if (s <= METRICS_BUCKETS[i]) {
            h->bucket[i]++;
            break;
        }
    h->count++;
    h->sum += s;
}

void metrics_hist_format(struct evbuffer *out, const char *name, const char *labels,
                         const metrics_hist *h) {
    const char *sep = labels[0] ? "," : "";
    uint64_t cum = 0;
    for (int i = 0; i < METRICS_NBUCKETS; i++) {
        cum += h->bucket[i];
        evbuffer_add_printf(out, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, labels, sep,
                            METRICS_BUCKETS[i], (unsigned long long)cum);
    }
    evbuffer_add_printf(out, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep,
                        (unsigned long long)h->count);
    evbuffer_add_printf(out, "%s_sum{%s} %.9g\n%s_count{%s} %llu\n", name, labels, h->sum, name,
                        labels, (unsigned long long)h->count);
}

void metrics_label_value(const char *v, char *out, size_t cap) {
    size_t o = 0;
    for (; *v && o + 3 < cap; v++) {
        if (*v == '\\' || *v == '"' || *v == '\n') {
            out[o++] = '\\';
            out[o++] = *v == '\n' ? 'n' : *v;
        } else {
            out[o++] = *v;
        }
    }
    out[o] = 0;
}

void metrics_header(struct evbuffer *out, const char *name, const char *type, const char *help) {
    evbuffer_add_printf(out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}
