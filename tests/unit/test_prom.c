/* Unit tests: base/prom — the Prometheus text renderer against the exposition
 * format 0.0.4: HELP/TYPE once per family (counters named _total), label
 * escaping (backslash, double quote, newline), histogram shape (cumulative
 * buckets, le last, +Inf = _count, then _count and _sum), summaries, info
 * gauges, both number styles, and the errors (a family twice, bad names,
 * samples outside their family, the size cap). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/prom.h"

#include <errno.h>
#include <math.h>
#include <string.h>

static void test_values(void **state) {
    (void)state;
    char b[32];
    static const struct {
        double v;
        const char *f, *i; /* FLOAT, INT */
    } cases[] = {
        {3, "3.0", "3"},
        {0.25, "0.25", "0.25"},
        {0.1, "0.1", "0.1"},
        {1e-7, "1e-07", "1e-07"},
        {0.0005, "0.0005", "0.0005"},
        {-2, "-2.0", "-2"},
        {2.5, "2.5", "2.5"},
        {1e16, "1e+16", "1e+16"},
        {0.1 + 0.2, "0.30000000000000004", "0.30000000000000004"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        prom_format_value(cases[k].v, PROM_STYLE_FLOAT, b, sizeof b);
        assert_string_equal(b, cases[k].f);
        prom_format_value(cases[k].v, PROM_STYLE_INT, b, sizeof b);
        assert_string_equal(b, cases[k].i);
    }
    prom_format_value(INFINITY, PROM_STYLE_FLOAT, b, sizeof b);
    assert_string_equal(b, "+Inf");
    prom_format_value(-INFINITY, PROM_STYLE_INT, b, sizeof b);
    assert_string_equal(b, "-Inf");
    prom_format_value(NAN, PROM_STYLE_FLOAT, b, sizeof b);
    assert_string_equal(b, "NaN");
}

/* A whole small exposition, byte for byte. */
static void test_shape(void **state) {
    (void)state;
    prom p;
    prom_init(&p, 1 << 16, PROM_STYLE_INT);
    prom_family(&p, "x_requests", PROM_COUNTER, "Requests.");
    prom_sample_u64(&p, 18446744073709551615ull, "code", "2xx", NULL); /* exact */
    prom_sample_u64(&p, 0, "code", "5xx", NULL);
    prom_family(&p, "x_up", PROM_GAUGE, "Up.");
    prom_sample(&p, 1, NULL);
    static const double bounds[] = {0.5, 1, 2.5};
    static const uint64_t per[] = {1, 0, 2}; /* one above 2.5 */
    prom_hist h = {bounds, 3, per, 0, 4, 7.25};
    prom_family(&p, "x_latency_seconds", PROM_HISTOGRAM, "Latency.");
    prom_histogram(&p, &h, "phase", "a", NULL);
    static const uint64_t cum[] = {1, 1, 3};
    prom_hist hc = {bounds, 3, cum, 1, 3, 0.1};
    prom_histogram(&p, &hc, "phase", "b", NULL);
    prom_family(&p, "x_send_seconds", PROM_SUMMARY, "Send.");
    prom_summary(&p, 2, 0.5, NULL);
    prom_info(&p, "x_build_info", "Build.", "version", "1.2", NULL);
    assert_int_equal(prom_error(&p), 0);
    const char *want = "# HELP x_requests_total Requests.\n"
                       "# TYPE x_requests_total counter\n"
                       "x_requests_total{code=\"2xx\"} 18446744073709551615\n"
                       "x_requests_total{code=\"5xx\"} 0\n"
                       "# HELP x_up Up.\n"
                       "# TYPE x_up gauge\n"
                       "x_up 1\n"
                       "# HELP x_latency_seconds Latency.\n"
                       "# TYPE x_latency_seconds histogram\n"
                       "x_latency_seconds_bucket{phase=\"a\",le=\"0.5\"} 1\n"
                       "x_latency_seconds_bucket{phase=\"a\",le=\"1\"} 1\n"
                       "x_latency_seconds_bucket{phase=\"a\",le=\"2.5\"} 3\n"
                       "x_latency_seconds_bucket{phase=\"a\",le=\"+Inf\"} 4\n"
                       "x_latency_seconds_count{phase=\"a\"} 4\n"
                       "x_latency_seconds_sum{phase=\"a\"} 7.25\n"
                       "x_latency_seconds_bucket{phase=\"b\",le=\"0.5\"} 1\n"
                       "x_latency_seconds_bucket{phase=\"b\",le=\"1\"} 1\n"
                       "x_latency_seconds_bucket{phase=\"b\",le=\"2.5\"} 3\n"
                       "x_latency_seconds_bucket{phase=\"b\",le=\"+Inf\"} 3\n"
                       "x_latency_seconds_count{phase=\"b\"} 3\n"
                       "x_latency_seconds_sum{phase=\"b\"} 0.1\n"
                       "# HELP x_send_seconds Send.\n"
                       "# TYPE x_send_seconds summary\n"
                       "x_send_seconds_count 2\n"
                       "x_send_seconds_sum 0.5\n"
                       "# HELP x_build_info Build.\n"
                       "# TYPE x_build_info gauge\n"
                       "x_build_info{version=\"1.2\"} 1\n";
    assert_string_equal(prom_text(&p), want);
    assert_int_equal(p.len, strlen(want));
    prom_free(&p);
}

/* prometheus_client's style, constant labels first and le last. */
static void test_float_style_const_labels(void **state) {
    (void)state;
    prom p;
    prom_init(&p, 1 << 16, PROM_STYLE_FLOAT);
    const char *const L[] = {"model_name", "m", "engine", "0"};
    prom_const_labels(&p, L, 2);
    prom_family(&p, "vllm:hits", PROM_COUNTER, "Hits.");
    prom_sample(&p, 2, "source", "local", NULL);
    static const double bounds[] = {1, 2};
    static const uint64_t per[] = {0, 2, 1};
    prom_hist h = {bounds, 2, per, 0, 3, 4};
    prom_family(&p, "vllm:n", PROM_HISTOGRAM, "N.");
    prom_histogram(&p, &h, NULL);
    prom_const_labels(&p, NULL, 0);
    prom_info(&p, "vllm:cfg_info", "Cfg.", "a", "x", "engine", "0", NULL);
    assert_int_equal(prom_error(&p), 0);
    assert_string_equal(prom_text(&p),
                        "# HELP vllm:hits_total Hits.\n"
                        "# TYPE vllm:hits_total counter\n"
                        "vllm:hits_total{model_name=\"m\",engine=\"0\",source=\"local\"} 2.0\n"
                        "# HELP vllm:n N.\n"
                        "# TYPE vllm:n histogram\n"
                        "vllm:n_bucket{model_name=\"m\",engine=\"0\",le=\"1.0\"} 0.0\n"
                        "vllm:n_bucket{model_name=\"m\",engine=\"0\",le=\"2.0\"} 2.0\n"
                        "vllm:n_bucket{model_name=\"m\",engine=\"0\",le=\"+Inf\"} 3.0\n"
                        "vllm:n_count{model_name=\"m\",engine=\"0\"} 3.0\n"
                        "vllm:n_sum{model_name=\"m\",engine=\"0\"} 4.0\n"
                        "# HELP vllm:cfg_info Cfg.\n"
                        "# TYPE vllm:cfg_info gauge\n"
                        "vllm:cfg_info{a=\"x\",engine=\"0\"} 1.0\n");
    prom_free(&p);
}

static void test_escaping(void **state) {
    (void)state;
    prom p;
    prom_init(&p, 1 << 16, PROM_STYLE_INT);
    /* label values: backslash, double quote, newline; HELP: backslash and newline only */
    prom_family(&p, "x", PROM_GAUGE, "a \\ b \"q\"\nnext");
    prom_sample(&p, 1, "url", "http://a\"b\\c\nd", "empty", "", NULL);
    assert_int_equal(prom_error(&p), 0);
    assert_string_equal(prom_text(&p), "# HELP x a \\\\ b \"q\"\\nnext\n"
                                       "# TYPE x gauge\n"
                                       "x{url=\"http://a\\\"b\\\\c\\nd\",empty=\"\"} 1\n");
    prom_free(&p);
}

/* Each misuse fails with -EINVAL and writes nothing more (errors are sticky). */
static void expect_einval(void (*misuse)(prom *)) {
    prom p;
    prom_init(&p, 1 << 16, PROM_STYLE_INT);
    prom_family(&p, "ok", PROM_GAUGE, "Ok.");
    prom_sample(&p, 1, NULL);
    size_t len = p.len;
    misuse(&p);
    assert_int_equal(prom_error(&p), -EINVAL);
    prom_family(&p, "later", PROM_GAUGE, "Later.");
    prom_sample(&p, 1, NULL);
    assert_int_equal(prom_error(&p), -EINVAL);
    assert_true(p.len <= len + 200 && !strstr(prom_text(&p), "later"));
    prom_free(&p);
}

static void twice(prom *p) {
    prom_family(p, "ok", PROM_COUNTER, "Again.");
}
static void space_in_name(prom *p) {
    prom_family(p, "bad name", PROM_GAUGE, "x");
}
static void bad_metric_name(prom *p) {
    prom_family(p, "1abc", PROM_GAUGE, "x");
}
static void bad_label_name(prom *p) {
    prom_sample(p, 1, "a-b", "v", NULL);
}
static void reserved_label(prom *p) {
    prom_sample(p, 1, "__name__", "v", NULL);
}
static void dup_label(prom *p) {
    prom_sample(p, 1, "a", "1", "a", "2", NULL);
}
static void null_value(prom *p) {
    prom_sample(p, 1, "a", (const char *)NULL, "b", "x", NULL);
}
static void le_in_histogram(prom *p) {
    static const double b[] = {1};
    static const uint64_t c[] = {0};
    prom_hist h = {b, 1, c, 0, 0, 0};
    prom_family(p, "h", PROM_HISTOGRAM, "H.");
    prom_histogram(p, &h, "le", "5", NULL);
}
static void descending(prom *p) {
    static const double b[] = {2, 1};
    static const uint64_t c[] = {0, 0};
    prom_hist h = {b, 2, c, 0, 0, 0};
    prom_family(p, "h", PROM_HISTOGRAM, "H.");
    prom_histogram(p, &h, NULL);
}
static void wrong_kind(prom *p) {
    static const double b[] = {1};
    static const uint64_t c[] = {0};
    prom_hist h = {b, 1, c, 0, 0, 0};
    prom_histogram(p, &h, NULL); /* the open family is a gauge */
}
static void scalar_on_histogram(prom *p) {
    prom_family(p, "h", PROM_HISTOGRAM, "H.");
    prom_sample(p, 1, NULL);
}

static void test_errors(void **state) {
    (void)state;
    void (*cases[])(prom *) = {twice,          space_in_name, bad_metric_name,    bad_label_name,
                               reserved_label, dup_label,     null_value,         le_in_histogram,
                               descending,     wrong_kind,    scalar_on_histogram};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        expect_einval(cases[i]);
    prom p; /* a sample before any family */
    prom_init(&p, 100, PROM_STYLE_INT);
    prom_sample(&p, 1, NULL);
    assert_int_equal(prom_error(&p), -EINVAL);
    assert_string_equal(prom_text(&p), "");
    prom_free(&p);
}

static void test_cap(void **state) {
    (void)state;
    prom p;
    prom_init(&p, 100, PROM_STYLE_INT);
    prom_family(&p, "x", PROM_GAUGE, "A help text.");
    for (int i = 0; i < 20; i++)
        prom_sample(&p, i, "i", "some label value", NULL);
    assert_int_equal(prom_error(&p), -ENOSPC);
    assert_true(p.len <= 100);
    prom_free(&p);
    prom_init(&p, 100, PROM_STYLE_INT);
    assert_string_equal(prom_text(&p), ""); /* nothing written yet */
    prom_free(&p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_values),
        cmocka_unit_test(test_shape),
        cmocka_unit_test(test_float_style_const_labels),
        cmocka_unit_test(test_escaping),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
