/* Unit tests: server/metrics — Prometheus text exposition (format 0.0.4):
 * HELP/TYPE lines, vLLM metric names, counters with _total, cumulative
 * histogram buckets with le labels, label escaping, values as Python's
 * prometheus_client writes them (the renderer itself: test_prom.c). */
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
    prom out;
    prom_init(&out, 1 << 20, PROM_STYLE_FLOAT);
    assert_int_equal(metrics_render(&m, &st, 16, "my \"model\"\\x", &out), 0);
    const char *t = prom_text(&out);
    const char *L = "{model_name=\"my \\\"model\\\"\\\\x\",engine=\"0\"}";
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
    /* counters: HELP/TYPE name the _total sample (prometheus_client's format 0.0.4) */
    expect_line(t, "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.");
    expect_line(t, "# TYPE vllm:prompt_tokens_total counter");
    assert_null(strstr(t, "# TYPE vllm:prompt_tokens counter"));
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
    expect_line(t, "vllm:request_success_total{model_name=\"my \\\"model\\\"\\\\x\",engine=\"0\","
                   "finished_reason=\"length\"} 2.0");
    expect_line(t, "vllm:request_success_total{model_name=\"my \\\"model\\\"\\\\x\",engine=\"0\","
                   "finished_reason=\"stop\"} 1.0");
    expect_line(t, "# TYPE vllm:time_to_first_token_seconds histogram");
    expect_line(t, "vllm:time_to_first_token_seconds_bucket{model_name=\"my \\\"model\\\"\\\\x\","
                   "engine=\"0\",le=\"0.001\"} 0.0");
    expect_line(t, "vllm:time_to_first_token_seconds_bucket{model_name=\"my \\\"model\\\"\\\\x\","
                   "engine=\"0\",le=\"0.005\"} 2.0");
    expect_line(t, "vllm:time_to_first_token_seconds_bucket{model_name=\"my \\\"model\\\"\\\\x\","
                   "engine=\"0\",le=\"2560.0\"} 2.0");
    expect_line(t, "vllm:time_to_first_token_seconds_bucket{model_name=\"my \\\"model\\\"\\\\x\","
                   "engine=\"0\",le=\"+Inf\"} 3.0");
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
    prom_free(&out);
}

static void test_1_2_5(void **state) {
    (void)state;
    double b[METRICS_MAX_BUCKETS];
    int n = metrics_1_2_5_bounds(1024, b, METRICS_MAX_BUCKETS);
    static const double want[] = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000};
    assert_int_equal(n, 10);
    for (int i = 0; i < n; i++)
        assert_true(b[i] == want[i]);
    assert_int_equal(metrics_1_2_5_bounds(1000, b, METRICS_MAX_BUCKETS), 10); /* <= max */
    assert_int_equal(metrics_1_2_5_bounds(0.5, b, METRICS_MAX_BUCKETS), 0);
    assert_int_equal(metrics_1_2_5_bounds(1e30, b, 4), 4); /* capped */
}

/* vLLM's per-request histograms from one engine timeline, and iteration tokens. */
static void test_request_histograms(void **state) {
    (void)state;
    server_metrics m;
    metrics_init(&m);
    engine_config cfg;
    engine_config_init(&cfg);
    cfg.block_size = 32;
    metrics_set_config(&m, &cfg, 100);
    const uint64_t s = 1000000000ull; /* 1 s in ns */
    metrics_request q = {.t_queued_ns = 10 * s,
                         .t_scheduled_ns = 10 * s + s / 2, /* queued 0.5 s */
                         .t_first_token_ns = 11 * s,       /* prefill 0.5 s */
                         .t_last_token_ns = 13 * s,        /* decode 2 s */
                         .n_prompt = 7,
                         .n_generated = 20,
                         .max_tokens_param = 0, /* not given: not observed */
                         .n_param = 2};
    metrics_observe_request(&m, &q);
    q.t_first_token_ns = q.t_last_token_ns = 0; /* aborted before any token */
    q.n_param = 0;                              /* a second child of the same prompt */
    q.max_tokens_param = 64;
    metrics_observe_request(&m, &q);
    assert_int_equal(m.queue.count, 2);
    assert_true(m.queue.sum == 1.0);
    assert_true(m.prefill.sum == 0.5 && m.decode.sum == 2.0 && m.inference.sum == 2.5);
    assert_int_equal(m.params_n.count, 1);
    assert_int_equal(m.params_max_tokens.count, 1);
    assert_true(m.prompt_tokens.sum == 14);
    engine_stats st;
    memset(&st, 0, sizeof st);
    st.num_blocks = 10;
    st.step_tokens_buckets[0] = 3;                    /* le 1 */
    st.step_tokens_buckets[ENGINE_STEP_TOKEN_NB] = 1; /* above 16384 */
    st.step_tokens_sum = 3 + 20000;
    prom out;
    prom_init(&out, 1 << 20, PROM_STYLE_FLOAT);
    assert_int_equal(metrics_render(&m, &st, 32, "m", &out), 0);
    const char *t = prom_text(&out);
    expect_line(t, "# TYPE vllm:request_queue_time_seconds histogram");
    expect_line(t, "vllm:request_queue_time_seconds_sum{model_name=\"m\",engine=\"0\"} 1.0");
    expect_line(t,
                "vllm:request_prompt_tokens_bucket{model_name=\"m\",engine=\"0\",le=\"5.0\"} 0.0");
    expect_line(t,
                "vllm:request_prompt_tokens_bucket{model_name=\"m\",engine=\"0\",le=\"10.0\"} 2.0");
    expect_line(
        t, "vllm:request_prompt_tokens_bucket{model_name=\"m\",engine=\"0\",le=\"100.0\"} 2.0");
    assert_null(
        strstr(t, "vllm:request_prompt_tokens_bucket{model_name=\"m\",engine=\"0\",le=\"200.0\"}"));
    expect_line(t, "vllm:request_generation_tokens_sum{model_name=\"m\",engine=\"0\"} 40.0");
    expect_line(t, "vllm:request_params_n_bucket{model_name=\"m\",engine=\"0\",le=\"2.0\"} 1.0");
    expect_line(t, "vllm:request_params_max_tokens_count{model_name=\"m\",engine=\"0\"} 1.0");
    expect_line(t,
                "vllm:iteration_tokens_total_bucket{model_name=\"m\",engine=\"0\",le=\"1.0\"} 3.0");
    expect_line(
        t, "vllm:iteration_tokens_total_bucket{model_name=\"m\",engine=\"0\",le=\"16384.0\"} 3.0");
    expect_line(
        t, "vllm:iteration_tokens_total_bucket{model_name=\"m\",engine=\"0\",le=\"+Inf\"} 4.0");
    expect_line(t, "vllm:iteration_tokens_total_count{model_name=\"m\",engine=\"0\"} 4.0");
    expect_line(t, "vllm:iteration_tokens_total_sum{model_name=\"m\",engine=\"0\"} 20003.0");
    expect_line(t, "vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\","
                   "enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\","
                   "num_cpu_blocks=\"None\",num_gpu_blocks=\"10\",engine=\"0\"} 1.0");
    prom_free(&out);
}

/* Where a prompt's tokens came from: the offload tiers' copies are external_kv_transfer
 * (vLLM's OffloadingConnector is a KV connector), the device cache's local_cache_hit. */
static void test_prompt_sources(void **state) {
    (void)state;
    server_metrics m;
    metrics_init(&m);
    metrics_request q = {
        .t_first_token_ns = 1, .n_prompt = 100, .n_cached = 64, .n_tier_cached = 48};
    metrics_observe_prompt_sources(&m, &q);
    assert_int_equal(m.prompt_by_source[METRICS_SOURCE_LOCAL_COMPUTE], 36);
    assert_int_equal(m.prompt_by_source[METRICS_SOURCE_LOCAL_CACHE_HIT], 16);
    assert_int_equal(m.prompt_by_source[METRICS_SOURCE_EXTERNAL], 48);
    /* a count past the cached tokens is cut to them; a pool fetch adds its received ones */
    q = (metrics_request){.t_first_token_ns = 1,
                          .n_prompt = 100,
                          .n_cached = 16,
                          .n_tier_cached = 32,
                          .n_kv_received = 32};
    metrics_observe_prompt_sources(&m, &q);
    assert_int_equal(m.prompt_by_source[METRICS_SOURCE_LOCAL_COMPUTE], 36 + 52);
    assert_int_equal(m.prompt_by_source[METRICS_SOURCE_LOCAL_CACHE_HIT], 16);
    assert_int_equal(m.prompt_by_source[METRICS_SOURCE_EXTERNAL], 48 + 48);
    assert_int_equal(m.external_queries, 32);
    assert_int_equal(m.external_hits, 32);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_render), cmocka_unit_test(test_1_2_5),
                                       cmocka_unit_test(test_request_histograms),
                                       cmocka_unit_test(test_prompt_sources)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
