/* Unit tests: server/metrics — Prometheus text exposition (format 0.0.4):
 * HELP/TYPE lines, vLLM metric names, counters with _total, cumulative
 * histogram buckets with le labels, label escaping, value formatting as
 * Python's prometheus_client writes it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "server/metrics.h"

#include <stdio.h>
#include <string.h>

static void expect_line(const char *text, const char *line) {
    size_t n = strlen(line);
    for (const char *p = text; (p = strstr(p, line)); p++)
        if ((p == text || p[-1] == '\n') && (p[n] == '\n')) return;
    fail_msg("line not found: %s", line);
}

static void test_values(void **state) {
    (void)state;
    char b[32];
    metrics_format_value(3, b, sizeof b);
    assert_string_equal(b, "3.0");
    metrics_format_value(0.25, b, sizeof b);
    assert_string_equal(b, "0.25");
    metrics_format_value(0.1, b, sizeof b);
    assert_string_equal(b, "0.1");
    metrics_format_value(1.0 / 0.0, b, sizeof b);
    assert_string_equal(b, "+Inf");
    metrics_format_value(1e-7, b, sizeof b);
    assert_string_equal(b, "1e-07");
}

static void test_render(void **state) {
    (void)state;
    server_metrics m;
    metrics_init(&m);
    metrics_observe(&m.ttft, 0.003); /* le 0.005 */
    metrics_observe(&m.ttft, 0.005); /* le is inclusive */
    metrics_observe(&m.ttft, 5000);  /* above every bound */
    m.finished[metrics_finish_of("length")] = 2;
    m.finished[metrics_finish_of("tool_calls")] = 1;
    engine_stats st;
    memset(&st, 0, sizeof st);
    st.num_running = 3;
    st.num_waiting = 1;
    st.num_blocks = 8;
    st.num_blocks_used = 2;
    st.prefix_queries = 5;
    st.prefix_hits = 2;
    st.prompt_tokens = 100;
    st.generation_tokens = 40;
    st.num_preemptions = 7;
    sbuf out;
    sbuf_init(&out, 1 << 20);
    assert_int_equal(metrics_render(&m, &st, 16, "my \"model\"\\x", &out), 0);
    const char *t = out.data;
    const char *L = "{model_name=\"my \\\"model\\\"\\\\x\"}";
    char line[256];
    expect_line(t, "# TYPE vllm:num_requests_running gauge");
    snprintf(line, sizeof line, "vllm:num_requests_running%s 3.0", L);
    expect_line(t, line);
    snprintf(line, sizeof line, "vllm:num_requests_waiting%s 1.0", L);
    expect_line(t, line);
    snprintf(line, sizeof line, "vllm:gpu_cache_usage_perc%s 0.25", L);
    expect_line(t, line);
    snprintf(line, sizeof line, "disagg:kv_cache_usage_perc%s 0.25", L);
    expect_line(t, line);
    snprintf(line, sizeof line, "disagg:kv_blocks_used%s 2.0", L);
    expect_line(t, line);
    expect_line(t, "# TYPE vllm:prompt_tokens counter");
    snprintf(line, sizeof line, "vllm:prompt_tokens_total%s 100.0", L);
    expect_line(t, line);
    snprintf(line, sizeof line, "vllm:generation_tokens_total%s 40.0", L);
    expect_line(t, line);
    snprintf(line, sizeof line, "vllm:prefix_cache_queries_total%s 80.0", L);
    expect_line(t, line);
    snprintf(line, sizeof line, "vllm:prefix_cache_hits_total%s 32.0", L);
    expect_line(t, line);
    snprintf(line, sizeof line, "vllm:num_preemptions_total%s 7.0", L);
    expect_line(t, line);
    expect_line(t, "vllm:request_success_total{finished_reason=\"length\",model_name=\"my "
                   "\\\"model\\\"\\\\x\"} 2.0");
    expect_line(t, "vllm:request_success_total{finished_reason=\"stop\",model_name=\"my "
                   "\\\"model\\\"\\\\x\"} 1.0");
    expect_line(t, "# TYPE vllm:time_to_first_token_seconds histogram");
    expect_line(t, "vllm:time_to_first_token_seconds_bucket{le=\"0.001\",model_name=\"my "
                   "\\\"model\\\"\\\\x\"} 0.0");
    expect_line(t, "vllm:time_to_first_token_seconds_bucket{le=\"0.005\",model_name=\"my "
                   "\\\"model\\\"\\\\x\"} 2.0");
    expect_line(t, "vllm:time_to_first_token_seconds_bucket{le=\"2560.0\",model_name=\"my "
                   "\\\"model\\\"\\\\x\"} 2.0");
    expect_line(t, "vllm:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"my "
                   "\\\"model\\\"\\\\x\"} 3.0");
    snprintf(line, sizeof line, "vllm:time_to_first_token_seconds_count%s 3.0", L);
    expect_line(t, line);
    snprintf(line, sizeof line, "vllm:time_to_first_token_seconds_sum%s 5000.008", L);
    expect_line(t, line);
    expect_line(t, "# TYPE vllm:inter_token_latency_seconds histogram");
    expect_line(t, "# TYPE vllm:e2e_request_latency_seconds histogram");
    /* every line is a comment or "name{labels} value" */
    for (const char *p = t; *p;) {
        const char *e = strchr(p, '\n');
        assert_non_null(e);
        if (*p != '#') {
            const char *brace = memchr(p, '{', (size_t)(e - p));
            const char *close = memchr(p, '}', (size_t)(e - p));
            assert_non_null(brace);
            assert_non_null(close);
            assert_true(close[1] == ' ');
        }
        p = e + 1;
    }
    sbuf_free(&out);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_values),
                                       cmocka_unit_test(test_render)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
