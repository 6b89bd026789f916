/* prom — see prom.h. */
#include "base/prom.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void prom_init(prom *p, size_t max, prom_style style) {
    memset(p, 0, sizeof *p);
    p->max = max;
    p->style = style;
}

void prom_free(prom *p) {
    free(p->data);
    free(p->seen);
    memset(p, 0, sizeof *p);
}

int prom_error(const prom *p) {
    return p->err;
}

const char *prom_text(const prom *p) {
    return p->data ? p->data : "";
}

void prom_set_style(prom *p, prom_style style) {
    p->style = style;
}

void prom_const_labels(prom *p, const char *const *kv, int n) {
    if (n < 0 || n > PROM_MAX_LABELS || (n && !kv)) {
        if (!p->err) p->err = -EINVAL;
        return;
    }
    p->const_kv = kv;
    p->n_const = n;
}

/* ---- the buffer -------------------------------------------------------- */

static void put(prom *p, const char *s, size_t n) {
    if (p->err) return;
    if (n > p->max - p->len) {
        p->err = -ENOSPC;
        return;
    }
    if (p->len + n + 1 > p->cap) {
        size_t cap = p->cap ? p->cap : 4096;
        while (cap < p->len + n + 1)
            cap *= 2;
        char *d = realloc(p->data, cap);
        if (!d) {
            p->err = -ENOMEM;
            return;
        }
        p->data = d;
        p->cap = cap;
    }
    memcpy(p->data + p->len, s, n);
    p->len += n;
    p->data[p->len] = 0;
}

static void puts_(prom *p, const char *s) {
    put(p, s, strlen(s));
}

/* s with backslash and newline escaped (and double quote when quote: label values). */
static void put_escaped(prom *p, const char *s, int quote) {
    const char *run = s;
    for (; *s; s++) {
        const char *esc = *s == '\\'           ? "\\\\"
                          : *s == '\n'         ? "\\n"
                          : quote && *s == '"' ? "\\\""
                                               : 0;
        if (!esc) continue;
        put(p, run, (size_t)(s - run));
        put(p, esc, 2);
        run = s + 1;
    }
    put(p, run, (size_t)(s - run));
}

/* ---- names ------------------------------------------------------------- */

static int name_char(char c, int first, int colon) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':') ||
           (!first && c >= '0' && c <= '9');
}

/* A metric name ([a-zA-Z_:][a-zA-Z0-9_:]*) or, without colon, a label name. */
static int valid_name(const char *s, int colon) {
    if (!s || !*s) return 0;
    for (const char *c = s; *c; c++)
        if (!name_char(*c, c == s, colon)) return 0;
    return colon || strncmp(s, "__", 2) != 0; /* label names starting __ are reserved */
}

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static void fail(prom *p, int err) {
    if (!p->err) p->err = err;
}

/* ---- numbers ----------------------------------------------------------- */

void prom_format_value(double v, prom_style style, char *buf, size_t cap) {
    if (isnan(v)) {
        snprintf(buf, cap, "NaN");
        return;
    }
    if (isinf(v)) {
        snprintf(buf, cap, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    if (v == floor(v) && fabs(v) < 1e16) {
        snprintf(buf, cap, style == PROM_STYLE_INT ? "%.0f" : "%.1f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) { /* shortest round-trip, as Python's repr */
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) return;
    }
}

/* ---- families and samples ---------------------------------------------- */

static const char *const TYPE_NAMES[] = {"counter", "gauge", "histogram", "summary"};

void prom_family(prom *p, const char *name, prom_type type, const char *help) {
    if (p->err) return;
    p->fam = NULL;
    if (!valid_name(name, 1) || (unsigned)type > PROM_SUMMARY) {
        fail(p, -EINVAL);
        return;
    }
    uint64_t h = name_hash(name);
    for (int i = 0; i < p->n_seen; i++)
        if (p->seen[i] == h) { /* a family's samples must stay together */
            fail(p, -EINVAL);
            return;
        }
    if (p->n_seen == p->cap_seen) {
        int cap = p->cap_seen ? 2 * p->cap_seen : 64;
        uint64_t *s = realloc(p->seen, (size_t)cap * sizeof *s);
        if (!s) {
            fail(p, -ENOMEM);
            return;
        }
        p->seen = s;
        p->cap_seen = cap;
    }
    p->seen[p->n_seen++] = h;
    const char *total = type == PROM_COUNTER ? "_total" : "";
    puts_(p, "# HELP ");
    puts_(p, name);
    puts_(p, total);
    puts_(p, " ");
    put_escaped(p, help ? help : "", 0);
    puts_(p, "\n# TYPE ");
    puts_(p, name);
    puts_(p, total);
    puts_(p, " ");
    puts_(p, TYPE_NAMES[type]);
    puts_(p, "\n");
    if (!p->err) {
        p->fam = name;
        p->fam_type = type;
    }
}

typedef struct labels {
    const char *kv[2 * PROM_MAX_LABELS];
    int n; /* pairs */
} labels;

/* The constant labels, then the NULL-ended pairs of ap; reserved: a label name the family's
 * own lines use (le, quantile).  0 or -EINVAL. */
static int collect(prom *p, labels *l, va_list ap, const char *reserved) {
    l->n = 0;
    for (int i = 0; i < p->n_const; i++) {
        l->kv[2 * i] = p->const_kv[2 * i];
        l->kv[2 * i + 1] = p->const_kv[2 * i + 1];
        l->n++;
    }
    for (;;) {
        const char *k = va_arg(ap, const char *);
        if (!k) break;
        const char *v = va_arg(ap, const char *);
        if (l->n == PROM_MAX_LABELS || !v) return -EINVAL;
        l->kv[2 * l->n] = k;
        l->kv[2 * l->n + 1] = v;
        l->n++;
    }
    for (int i = 0; i < l->n; i++) {
        const char *k = l->kv[2 * i];
        if (!valid_name(k, 0) || (reserved && !strcmp(k, reserved))) return -EINVAL;
        for (int j = 0; j < i; j++)
            if (!strcmp(k, l->kv[2 * j])) return -EINVAL; /* a label twice */
    }
    return 0;
}

/* name+suffix{labels[,extra_k="extra_v"]} value\n */
static void line(prom *p, const char *suffix, const labels *l, const char *extra_k,
                 const char *extra_v, const char *value) {
    puts_(p, p->fam);
    puts_(p, suffix);
    if (l->n || extra_k) {
        puts_(p, "{");
        for (int i = 0; i < l->n; i++) {
            if (i) puts_(p, ",");
            puts_(p, l->kv[2 * i]);
            puts_(p, "=\"");
            put_escaped(p, l->kv[2 * i + 1], 1);
            puts_(p, "\"");
        }
        if (extra_k) {
            if (l->n) puts_(p, ",");
            puts_(p, extra_k);
            puts_(p, "=\"");
            puts_(p, extra_v);
            puts_(p, "\"");
        }
        puts_(p, "}");
    }
    puts_(p, " ");
    puts_(p, value);
    puts_(p, "\n");
}

static void format_u64(prom *p, uint64_t v, char *buf, size_t cap) {
    if (p->style == PROM_STYLE_INT)
        snprintf(buf, cap, "%llu", (unsigned long long)v);
    else
        prom_format_value((double)v, p->style, buf, cap);
}

/* The open family when it has type t (else -EINVAL, and 0). */
static int open_as(prom *p, prom_type t1, prom_type t2) {
    if (p->err) return 0;
    if (!p->fam || (p->fam_type != t1 && p->fam_type != t2)) {
        fail(p, -EINVAL);
        return 0;
    }
    return 1;
}

static void scalar(prom *p, const char *value, va_list ap) {
    labels l;
    int rc = collect(p, &l, ap, NULL);
    if (rc) {
        fail(p, rc);
        return;
    }
    line(p, p->fam_type == PROM_COUNTER ? "_total" : "", &l, NULL, NULL, value);
}

void prom_sample(prom *p, double v, ...) {
    if (!open_as(p, PROM_COUNTER, PROM_GAUGE)) return;
    char val[32];
    prom_format_value(v, p->style, val, sizeof val);
    va_list ap;
    va_start(ap, v);
    scalar(p, val, ap);
    va_end(ap);
}

void prom_sample_u64(prom *p, uint64_t v, ...) {
    if (!open_as(p, PROM_COUNTER, PROM_GAUGE)) return;
    char val[32];
    format_u64(p, v, val, sizeof val);
    va_list ap;
    va_start(ap, v);
    scalar(p, val, ap);
    va_end(ap);
}

static void count_sum(prom *p, const labels *l, uint64_t count, double sum) {
    char val[32];
    format_u64(p, count, val, sizeof val);
    line(p, "_count", l, NULL, NULL, val);
    prom_format_value(sum, p->style, val, sizeof val);
    line(p, "_sum", l, NULL, NULL, val);
}

void prom_histogram(prom *p, const prom_hist *h, ...) {
    if (!open_as(p, PROM_HISTOGRAM, PROM_HISTOGRAM)) return;
    if (!h || h->n_bounds < 0 || (h->n_bounds && (!h->bounds || !h->counts))) {
        fail(p, -EINVAL);
        return;
    }
    labels l;
    va_list ap;
    va_start(ap, h);
    int rc = collect(p, &l, ap, "le");
    va_end(ap);
    if (rc) {
        fail(p, rc);
        return;
    }
    for (int i = 1; i < h->n_bounds; i++)
        if (!(h->bounds[i] > h->bounds[i - 1])) {
            fail(p, -EINVAL); /* le must ascend */
            return;
        }
    uint64_t cum = 0;
    char le[32], val[32];
    for (int i = 0; i < h->n_bounds; i++) {
        cum = h->cumulative ? h->counts[i] : cum + h->counts[i];
        prom_format_value(h->bounds[i], p->style, le, sizeof le);
        format_u64(p, cum, val, sizeof val);
        line(p, "_bucket", &l, "le", le, val);
    }
    format_u64(p, h->count, val, sizeof val);
    line(p, "_bucket", &l, "le", "+Inf", val);
    count_sum(p, &l, h->count, h->sum);
}

void prom_summary(prom *p, uint64_t count, double sum, ...) {
    if (!open_as(p, PROM_SUMMARY, PROM_SUMMARY)) return;
    labels l;
    va_list ap;
    va_start(ap, sum);
    int rc = collect(p, &l, ap, "quantile");
    va_end(ap);
    if (rc) {
        fail(p, rc);
        return;
    }
    count_sum(p, &l, count, sum);
}

void prom_info(prom *p, const char *name, const char *help, ...) {
    prom_family(p, name, PROM_GAUGE, help);
    if (p->err) return;
    char val[32];
    prom_format_value(1, p->style, val, sizeof val);
    va_list ap;
    va_start(ap, help);
    scalar(p, val, ap);
    va_end(ap);
}
