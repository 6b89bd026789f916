/*
 * metrics — Prometheus text rendering with vLLM's metric names (see
 * metrics.h).  Bucket bounds are vLLM's (v1 PrometheusStatLogger).
 */
#include "server/metrics.h"

#include "kernels/backend.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const double TTFT_BOUNDS[] = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                     0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                     20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
static const double ITL_BOUNDS[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                    0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
static const double E2E_BOUNDS[] = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                    5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
#define NB(a) ((int)(sizeof(a) / sizeof((a)[0])))

static void metrics_hist_init(metrics_histogram *h, const double *b, int n) {
    memset(h, 0, sizeof *h);
    h->bounds = b;
    h->n_bounds = n;
}

static const double N_BOUNDS[] = {1, 2, 5, 10, 20}; /* vllm:request_params_n */

void metrics_init(server_metrics *m) {
    memset(m, 0, sizeof *m);
    metrics_hist_init(&m->ttft, TTFT_BOUNDS, NB(TTFT_BOUNDS));
    metrics_hist_init(&m->itl, ITL_BOUNDS, NB(ITL_BOUNDS));
    metrics_hist_init(&m->tpot, ITL_BOUNDS, NB(ITL_BOUNDS));
    metrics_hist_init(&m->e2e, E2E_BOUNDS, NB(E2E_BOUNDS));
    metrics_hist_init(&m->queue, E2E_BOUNDS, NB(E2E_BOUNDS));
    metrics_hist_init(&m->inference, E2E_BOUNDS, NB(E2E_BOUNDS));
    metrics_hist_init(&m->prefill, E2E_BOUNDS, NB(E2E_BOUNDS));
    metrics_hist_init(&m->decode, E2E_BOUNDS, NB(E2E_BOUNDS));
    metrics_hist_init(&m->params_n, N_BOUNDS, NB(N_BOUNDS));
    /* token-count bounds come with metrics_set_config */
    metrics_hist_init(&m->prompt_tokens, m->token_bounds, 0);
    metrics_hist_init(&m->generation_tokens, m->token_bounds, 0);
    metrics_hist_init(&m->params_max_tokens, m->token_bounds, 0);
    metrics_hist_init(&m->prefill_kv_computed, m->token_bounds, 0);
    m->block_size = 16;
    m->gpu_memory_utilization = 0.9;
    snprintf(m->cache_dtype, sizeof m->cache_dtype, "auto");
}

int metrics_1_2_5_bounds(double max_value, double *out, int cap) {
    static const int mant[] = {1, 2, 5};
    int n = 0;
    for (double exp = 1;; exp *= 10)
        for (int i = 0; i < 3; i++) {
            double v = mant[i] * exp;
            if (v > max_value || n >= cap) return n;
            out[n++] = v;
        }
}

void metrics_set_config(server_metrics *m, const engine_config *cfg, int max_model_len) {
    int n = metrics_1_2_5_bounds(max_model_len, m->token_bounds, METRICS_MAX_BUCKETS);
    metrics_histogram *tok[] = {&m->prompt_tokens, &m->generation_tokens, &m->params_max_tokens,
                                &m->prefill_kv_computed};
    for (int i = 0; i < 4; i++)
        if (tok[i]->count == 0) metrics_hist_init(tok[i], m->token_bounds, n);
    m->max_model_len = max_model_len;
    if (cfg) {
        m->block_size = cfg->block_size > 0 ? cfg->block_size : 16;
        m->enable_prefix_caching = cfg->enable_prefix_caching;
        m->gpu_memory_utilization = cfg->gpu_memory_utilization;
        snprintf(m->cache_dtype, sizeof m->cache_dtype, "%s",
                 cfg->kv_cache_dtype < 0 ? "auto"
                                         : backend_dtype_name((backend_dtype)cfg->kv_cache_dtype));
    }
}

static double span_s(uint64_t from, uint64_t to) {
    return from && to && to > from ? (double)(to - from) / 1e9 : 0.0;
}

void metrics_observe_request(server_metrics *m, const metrics_request *q) {
    /* vLLM v1 (IterationStats.update_from_finished_request): queued = scheduled - queued,
     * prefill = first token - scheduled, decode = last token - first token,
     * inference = last token - scheduled */
    metrics_observe(&m->queue, span_s(q->t_queued_ns, q->t_scheduled_ns));
    metrics_observe(&m->prefill, span_s(q->t_scheduled_ns, q->t_first_token_ns));
    metrics_observe(&m->decode, span_s(q->t_first_token_ns, q->t_last_token_ns));
    metrics_observe(&m->inference, span_s(q->t_scheduled_ns, q->t_last_token_ns));
    metrics_observe(&m->prompt_tokens, q->n_prompt);
    metrics_observe(&m->generation_tokens, q->n_generated);
    if (q->max_tokens_param > 0) metrics_observe(&m->params_max_tokens, q->max_tokens_param);
    if (q->n_param > 0) metrics_observe(&m->params_n, q->n_param);
    metrics_observe_prompt_sources(m, q);
}

void metrics_observe_prompt_sources(server_metrics *m, const metrics_request *q) {
    if (q->remote_prefill) { /* the connector was asked for the prompt (vLLM: at scheduling) */
        m->external_queries += (uint64_t)(q->n_prompt > 0 ? q->n_prompt : 0);
        m->external_hits += (uint64_t)(q->n_kv_received > 0 ? q->n_kv_received : 0);
    }
    if (!q->t_first_token_ns || q->n_prompt <= 0) return; /* never prefilled */
    long long cached = q->n_cached > 0 ? q->n_cached : 0;
    long long ext = q->n_kv_received > 0 ? q->n_kv_received : 0;
    if (cached > q->n_prompt) cached = q->n_prompt;
    if (ext > q->n_prompt - cached) ext = q->n_prompt - cached;
    long long computed = q->n_prompt - cached - ext;
    m->prompt_by_source[METRICS_SOURCE_LOCAL_COMPUTE] += (uint64_t)computed;
    m->prompt_by_source[METRICS_SOURCE_LOCAL_CACHE_HIT] += (uint64_t)cached;
    m->prompt_by_source[METRICS_SOURCE_EXTERNAL] += (uint64_t)ext;
    metrics_observe(&m->prefill_kv_computed, (double)computed);
}

void metrics_observe(metrics_histogram *h, double v) {
    int i = 0;
    while (i < h->n_bounds && v > h->bounds[i])
        i++; /* Prometheus buckets are le */
    h->buckets[i]++;
    h->count++;
    h->sum += v;
}

metrics_finish metrics_finish_of(const char *reason) {
    if (!reason) return METRICS_FINISH_ERROR;
    if (!strcmp(reason, "stop") || !strcmp(reason, "tool_calls")) return METRICS_FINISH_STOP;
    if (!strcmp(reason, "length")) return METRICS_FINISH_LENGTH;
    if (!strcmp(reason, "abort")) return METRICS_FINISH_ABORT;
    return METRICS_FINISH_ERROR;
}

void metrics_format_value(double v, char *buf, size_t cap) {
    if (isnan(v)) {
        snprintf(buf, cap, "NaN");
        return;
    }
    if (isinf(v)) {
        snprintf(buf, cap, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    if (v == floor(v) && fabs(v) < 1e16) {
        snprintf(buf, cap, "%.1f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) { /* shortest round-trip, as Python's repr */
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) return;
    }
}

/* Label value escaping of the text format: backslash, double quote, newline. */
static int metrics_append_label(sbuf *out, const char *v) {
    int rc = 0;
    for (const char *p = v; *p && !rc; p++) {
        if (*p == '\\')
            rc = sbuf_append(out, "\\\\", 2);
        else if (*p == '"')
            rc = sbuf_append(out, "\\\"", 2);
        else if (*p == '\n')
            rc = sbuf_append(out, "\\n", 2);
        else
            rc = sbuf_append(out, p, 1);
    }
    return rc;
}

typedef struct metrics_writer {
    sbuf *out;
    const char *model; /* model_name label value */
    int rc;            /* first error */
} metrics_writer;

static void mw_head(metrics_writer *w, const char *name, const char *type, const char *help) {
    if (!w->rc)
        w->rc = sbuf_appendf(w->out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* name{model_name="...",engine="0"[,extra]} value — label order as vLLM's
 * prometheus_client writes it (labelnames, then the family's own, le last). */
static void mw_sample(metrics_writer *w, const char *name, const char *suffix, const char *extra,
                      double v) {
    char val[32];
    metrics_format_value(v, val, sizeof val);
    if (!w->rc) w->rc = sbuf_appendf(w->out, "%s%s{model_name=\"", name, suffix);
    if (!w->rc) w->rc = metrics_append_label(w->out, w->model);
    if (!w->rc)
        w->rc = sbuf_appendf(w->out, "\",engine=\"" METRICS_ENGINE_LABEL "\"%s%s} %s\n",
                             extra ? "," : "", extra ? extra : "", val);
}

static void mw_gauge(metrics_writer *w, const char *name, const char *help, double v) {
    mw_head(w, name, "gauge", help);
    mw_sample(w, name, "", NULL, v);
}

/* A counter's HELP/TYPE carry the "_total" name, as prometheus_client writes
 * format 0.0.4 (its parser then names the family without "_total").  name
 * is the family name, without "_total". */
static void mw_counter_head(metrics_writer *w, const char *name, const char *help) {
    if (!w->rc)
        w->rc =
            sbuf_appendf(w->out, "# HELP %s_total %s\n# TYPE %s_total counter\n", name, help, name);
}

static void mw_counter(metrics_writer *w, const char *name, const char *help, double v) {
    mw_counter_head(w, name, help);
    mw_sample(w, name, "_total", NULL, v);
}

static void mw_hist_buckets(metrics_writer *w, const char *name, const double *bounds, int nb,
                            const uint64_t *buckets, uint64_t count, double sum) {
    uint64_t cum = 0;
    char le[48], val[32];
    for (int i = 0; i <= nb; i++) {
        cum += buckets[i];
        if (i < nb)
            metrics_format_value(bounds[i], val, sizeof val);
        else
            snprintf(val, sizeof val, "+Inf");
        snprintf(le, sizeof le, "le=\"%s\"", val);
        mw_sample(w, name, "_bucket", le, (double)cum);
    }
    mw_sample(w, name, "_count", NULL, (double)count);
    mw_sample(w, name, "_sum", NULL, sum);
}

static void mw_hist(metrics_writer *w, const char *name, const char *help,
                    const metrics_histogram *h) {
    mw_head(w, name, "histogram", help);
    mw_hist_buckets(w, name, h->bounds, h->n_bounds, h->buckets, h->count, h->sum);
}

int metrics_render(const server_metrics *m, const engine_stats *st, int block_size,
                   const char *model_name, sbuf *out) {
    metrics_writer w = {out, model_name ? model_name : "", 0};
    double usage = engine_stats_kv_usage(st);
    mw_gauge(&w, "vllm:num_requests_running", "Number of requests in model execution batches.",
             st->num_running);
    mw_gauge(&w, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             st->num_waiting);
    mw_gauge(&w, "vllm:gpu_cache_usage_perc",
             "KV-cache usage. 1 means 100 percent usage (the KV cache lives in host memory here).",
             usage);
    mw_gauge(&w, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage);
    mw_gauge(&w, "disagg:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage);
    mw_gauge(&w, "disagg:kv_blocks_used", "KV-cache blocks in use by requests.",
             st->num_blocks_used);
    mw_gauge(&w, "disagg:kv_blocks_capacity", "KV-cache blocks in the region.", st->num_blocks);
    mw_gauge(&w, "disagg:num_requests_parked",
             "Requests parked waiting for something outside the step loop (remote KV).",
             st->num_parked);
    mw_counter(&w, "vllm:prompt_tokens", "Number of prefill tokens processed.",
               (double)st->prompt_tokens);
    mw_counter(&w, "vllm:generation_tokens", "Number of generation tokens processed.",
               (double)st->generation_tokens);
    mw_counter(&w, "vllm:prefix_cache_queries",
               "Prefix cache queries, in terms of number of queried tokens (full blocks).",
               (double)st->prefix_queries * block_size);
    mw_counter(&w, "vllm:prefix_cache_hits",
               "Prefix cache hits, in terms of number of cached tokens (full blocks).",
               (double)st->prefix_hits * block_size);
    mw_counter(&w, "vllm:external_prefix_cache_queries",
               "External prefix cache queries from KV connector cross-instance cache sharing, in "
               "terms of number of queried tokens.",
               (double)m->external_queries);
    mw_counter(&w, "vllm:external_prefix_cache_hits",
               "External prefix cache hits from KV connector cross-instance cache sharing, in "
               "terms of number of cached tokens.",
               (double)m->external_hits);
    static const char *sources[METRICS_SOURCE_COUNT] = {"local_compute", "local_cache_hit",
                                                        "external_kv_transfer"};
    mw_counter_head(&w, "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.");
    for (int i = 0; i < METRICS_SOURCE_COUNT; i++) {
        char lab[48];
        snprintf(lab, sizeof lab, "source=\"%s\"", sources[i]);
        mw_sample(&w, "vllm:prompt_tokens_by_source", "_total", lab,
                  (double)m->prompt_by_source[i]);
    }
    mw_counter(&w, "vllm:prompt_tokens_cached",
               "Number of cached prompt tokens (local + external).",
               (double)(m->prompt_by_source[METRICS_SOURCE_LOCAL_CACHE_HIT] +
                        m->prompt_by_source[METRICS_SOURCE_EXTERNAL]));
    mw_counter(&w, "disagg:prefix_cache_queries_blocks", "Prefix cache queries, in blocks.",
               (double)st->prefix_queries);
    mw_counter(&w, "disagg:prefix_cache_hits_blocks", "Prefix cache hits, in blocks.",
               (double)st->prefix_hits);
    mw_counter(&w, "vllm:num_preemptions", "Cumulative number of preemptions.",
               (double)st->num_preemptions);
    mw_counter(&w, "disagg:engine_steps", "Engine steps executed.", (double)st->steps);
    mw_counter(&w, "disagg:http_requests", "HTTP requests received.", (double)m->http_requests);
    static const char *dkinds[METRICS_DEADLINE_COUNT] = {"header", "body", "keepalive"};
    mw_counter_head(&w, "disagg:http_deadline_closes",
                    "Connections closed on a deadline (header, body: 408; keepalive: idle).");
    for (int i = 0; i < METRICS_DEADLINE_COUNT; i++) {
        char lab[32];
        snprintf(lab, sizeof lab, "kind=\"%s\"", dkinds[i]);
        mw_sample(&w, "disagg:http_deadline_closes", "_total", lab, (double)m->deadline_closes[i]);
    }
    static const char *reasons[METRICS_FINISH_COUNT] = {"stop", "length", "abort", "error"};
    mw_counter_head(&w, "vllm:request_success", "Count of successfully processed requests.");
    for (int i = 0; i < METRICS_FINISH_COUNT; i++) {
        char lab[48];
        snprintf(lab, sizeof lab, "finished_reason=\"%s\"", reasons[i]);
        mw_sample(&w, "vllm:request_success", "_total", lab, (double)m->finished[i]);
    }
    mw_hist(&w, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            &m->ttft);
    mw_hist(&w, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            &m->itl);
    mw_hist(&w, "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", &m->tpot);
    mw_hist(&w, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            &m->e2e);
    mw_hist(&w, "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", &m->queue);
    mw_hist(&w, "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", &m->inference);
    mw_hist(&w, "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", &m->prefill);
    mw_hist(&w, "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", &m->decode);
    mw_hist(&w, "vllm:request_prompt_tokens", "Number of prefill tokens processed.",
            &m->prompt_tokens);
    mw_hist(&w, "vllm:request_generation_tokens", "Number of generation tokens processed.",
            &m->generation_tokens);
    mw_hist(&w, "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            &m->prefill_kv_computed);
    mw_hist(&w, "vllm:request_params_n", "Histogram of the n request parameter.", &m->params_n);
    mw_hist(&w, "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            &m->params_max_tokens);
    static const double step_bounds[] = ENGINE_STEP_TOKEN_BOUNDS;
    mw_head(&w, "vllm:iteration_tokens_total", "histogram",
            "Histogram of number of tokens per engine_step.");
    uint64_t steps = 0;
    for (int i = 0; i <= ENGINE_STEP_TOKEN_NB; i++)
        steps += st->step_tokens_buckets[i];
    mw_hist_buckets(&w, "vllm:iteration_tokens_total", step_bounds, ENGINE_STEP_TOKEN_NB,
                    st->step_tokens_buckets, steps, (double)st->step_tokens_sum);
    /* vllm:cache_config_info: CacheConfig.metrics_info() — the fields that mean
     * something here, as strings */
    char info[384], gmu[32];
    metrics_format_value(m->gpu_memory_utilization, gmu, sizeof gmu);
    snprintf(info, sizeof info,
             "block_size=\"%d\",cache_dtype=\"%s\",enable_prefix_caching=\"%s\","
             "gpu_memory_utilization=\"%s\",num_cpu_blocks=\"None\",num_gpu_blocks=\"%d\"",
             m->block_size, m->cache_dtype, m->enable_prefix_caching ? "True" : "False", gmu,
             st->num_blocks);
    /* disagg:kernels_info: which compute kernels this engine runs (the CPU ISA chosen by
     * cpuid or DISAGG_CPU_ISA, or "cuda") */
    if (st->kernels[0]) {
        char lab[64];
        snprintf(lab, sizeof lab, "kernels=\"%s\"", st->kernels);
        mw_head(&w, "disagg:kernels_info", "gauge",
                "The compute kernels in use (label kernels: avx512f, avx512bf16, avx2, scalar, cuda).");
        mw_sample(&w, "disagg:kernels_info", "", lab, 1.0);
    }
    mw_head(&w, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig");
    if (!w.rc) /* vLLM's labels: the config's keys and engine, no model_name */
        w.rc = sbuf_appendf(
            out, "vllm:cache_config_info{%s,engine=\"" METRICS_ENGINE_LABEL "\"} 1.0\n", info);
    return w.rc;
}
