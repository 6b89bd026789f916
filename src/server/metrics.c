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
    } else if (q->n_kv_received > 0) { /* a pool fetch: the prefix pulled from a holder */
        m->external_queries += (uint64_t)q->n_kv_received;
        m->external_hits += (uint64_t)q->n_kv_received;
    }
    if (!q->t_first_token_ns || q->n_prompt <= 0) return; /* never prefilled */
    long long cached = q->n_cached > 0 ? q->n_cached : 0;
    long long ext = q->n_kv_received > 0 ? q->n_kv_received : 0;
    if (cached > q->n_prompt) cached = q->n_prompt;
    if (ext > q->n_prompt - cached) ext = q->n_prompt - cached;
    long long computed = q->n_prompt - cached - ext;
    long long tier = q->n_tier_cached > 0 ? q->n_tier_cached : 0;
    if (tier > cached) tier = cached;
    cached -= tier; /* the tiers' copies: external_kv_transfer, as vLLM's OffloadingConnector */
    ext += tier;
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

static void gauge(prom *p, const char *name, const char *help, double v) {
    prom_family(p, name, PROM_GAUGE, help);
    prom_sample(p, v, NULL);
}

static void counter(prom *p, const char *name, const char *help, double v) {
    prom_family(p, name, PROM_COUNTER, help);
    prom_sample(p, v, NULL);
}

static void hist(prom *p, const char *name, const char *help, const metrics_histogram *h) {
    /* buckets[n_bounds] (above every bound) is only in count, the +Inf bucket */
    prom_hist v = {h->bounds, h->n_bounds, h->buckets, 0, h->count, h->sum};
    prom_family(p, name, PROM_HISTOGRAM, help);
    prom_histogram(p, &v, NULL);
}

int metrics_render(const server_metrics *m, const engine_stats *st, int block_size,
                   const char *model_name, prom *p) {
    /* every sample's first labels, as vLLM's prometheus_client writes them (labelnames,
     * then the family's own, le last) */
    const char *const L[] = {"model_name", model_name ? model_name : "", "engine",
                             METRICS_ENGINE_LABEL};
    prom_style style0 = p->style;
    const char *const *kv0 = p->const_kv;
    int n0 = p->n_const;
    prom_set_style(p, PROM_STYLE_FLOAT);
    prom_const_labels(p, L, 2);
    double usage = engine_stats_kv_usage(st);
    gauge(p, "vllm:num_requests_running", "Number of requests in model execution batches.",
          st->num_running);
    gauge(p, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
          st->num_waiting);
    gauge(p, "vllm:gpu_cache_usage_perc",
          "KV-cache usage. 1 means 100 percent usage (the KV cache lives in host memory here).",
          usage);
    gauge(p, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage);
    gauge(p, "disagg:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage);
    gauge(p, "disagg:kv_blocks_used", "KV-cache blocks in use by requests.", st->num_blocks_used);
    gauge(p, "disagg:kv_blocks_capacity", "KV-cache blocks in the region.", st->num_blocks);
    gauge(p, "disagg:num_requests_parked",
          "Requests parked waiting for something outside the step loop (remote KV).",
          st->num_parked);
    counter(p, "vllm:prompt_tokens", "Number of prefill tokens processed.",
            (double)st->prompt_tokens);
    counter(p, "vllm:generation_tokens", "Number of generation tokens processed.",
            (double)st->generation_tokens);
    counter(p, "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens (full blocks).",
            (double)st->prefix_queries * block_size);
    counter(p, "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens (full blocks).",
            (double)st->prefix_hits * block_size);
    counter(p, "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.",
            (double)m->external_queries + (double)st->offload_queries * block_size);
    counter(p, "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.",
            (double)m->external_hits + (double)st->offload_hits * block_size);
    static const char *sources[METRICS_SOURCE_COUNT] = {"local_compute", "local_cache_hit",
                                                        "external_kv_transfer"};
    prom_family(p, "vllm:prompt_tokens_by_source", PROM_COUNTER,
                "Number of prompt tokens by source.");
    for (int i = 0; i < METRICS_SOURCE_COUNT; i++)
        prom_sample(p, (double)m->prompt_by_source[i], "source", sources[i], NULL);
    counter(p, "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
            (double)(m->prompt_by_source[METRICS_SOURCE_LOCAL_CACHE_HIT] +
                     m->prompt_by_source[METRICS_SOURCE_EXTERNAL]));
    counter(p, "disagg:prefix_cache_queries_blocks", "Prefix cache queries, in blocks.",
            (double)st->prefix_queries);
    counter(p, "disagg:prefix_cache_hits_blocks", "Prefix cache hits, in blocks.",
            (double)st->prefix_hits);
    counter(p, "disagg:kv_cache_evicted_blocks",
            "Cached KV blocks the device cache evicted (reused for other KV).",
            (double)st->prefix_evictions);
    if (st->has_offload) {
        static const char *tiers[KV_TIER_COUNT] = {"host", "disk"};
        const kv_offload_stats *o = &st->offload;
#define PER_TIER_OF(name, type, help, arr, scale)                                                  \
    do {                                                                                           \
        prom_family(p, name, type, help);                                                          \
        for (int t = 0; t < KV_TIER_COUNT; t++)                                                    \
            if (t == KV_TIER_HOST || o->capacity[KV_TIER_DISK])                                    \
                prom_sample(p, (double)(arr)[t] * (scale), "tier", tiers[t], NULL);                \
    } while (0)
#define PER_TIER(name, type, help, field, scale) PER_TIER_OF(name, type, help, o->field, scale)
        PER_TIER("disagg:kv_offload_blocks_stored", PROM_COUNTER,
                 "KV blocks written into an offload tier.", stored, 1);
        PER_TIER("disagg:kv_offload_blocks_loaded", PROM_COUNTER,
                 "KV blocks copied back from an offload tier instead of recomputed.", loaded, 1);
        PER_TIER("disagg:kv_offload_blocks_evicted", PROM_COUNTER,
                 "KV blocks an offload tier dropped to make room (LRU).", evicted, 1);
        PER_TIER("disagg:kv_offload_bytes_stored", PROM_COUNTER,
                 "Bytes written into an offload tier.", bytes_stored, 1);
        PER_TIER("disagg:kv_offload_bytes_loaded", PROM_COUNTER,
                 "Bytes copied back from an offload tier.", bytes_loaded, 1);
        PER_TIER("disagg:kv_offload_load_seconds", PROM_COUNTER,
                 "Time spent copying blocks back from an offload tier.", load_ns, 1e-9);
        PER_TIER("disagg:kv_offload_store_seconds", PROM_COUNTER,
                 "Step-thread time spent storing into an offload tier (host: the copy down; "
                 "disk: the write when synchronous, else queueing it).",
                 store_ns, 1e-9);
        PER_TIER("disagg:kv_offload_hits", PROM_COUNTER,
                 "Offload lookups (after a device-cache miss) found in a tier.", hits, 1);
        PER_TIER("disagg:kv_offload_blocks_resident", PROM_GAUGE,
                 "KV blocks an offload tier holds.", resident, 1);
        PER_TIER("disagg:kv_offload_blocks_capacity", PROM_GAUGE,
                 "KV blocks an offload tier holds at most.", capacity, 1);
        PER_TIER_OF("disagg:kv_offload_blocks_declined", PROM_COUNTER,
                 "KV blocks an offload tier held that were recomputed instead: the copy was "
                 "estimated slower than their prefill.",
                    st->offload_declined, 1);
        PER_TIER_OF("disagg:kv_offload_bandwidth_bytes_per_second", PROM_GAUGE,
                 "The copy-or-recompute estimate of an offload tier's load bandwidth "
                 "(exponentially averaged from its loads, or DISAGG_KV_OFFLOAD_BANDWIDTH).",
                    st->offload_bps, 1);
#undef PER_TIER
#undef PER_TIER_OF
        gauge(p, "disagg:kv_offload_loads_in_flight",
              "Asynchronous copies from the offload tiers queued or running (blocks).",
              (double)o->in_flight);
        gauge(p, "disagg:kv_offload_requests_loading",
              "Requests waiting for copies from the offload tiers (out of the batch; counted "
              "in vllm:num_requests_waiting too).",
              (double)st->offload_loading);
        counter(p, "disagg:kv_offload_steps_during_loads",
                "Engine forwards that ran while copies from the offload tiers were pending.",
                (double)st->offload_steps_during_loads);
        counter(p, "disagg:kv_offload_load_waits",
                "Requests that waited for copies from the offload tiers.",
                (double)st->offload_load_waits);
        counter(p, "disagg:kv_offload_load_wait_seconds",
                "Time requests waited for copies from the offload tiers (first copy started to "
                "last one ended).",
                (double)st->offload_load_wait_ns * 1e-9);
        gauge(p, "disagg:kv_offload_prefill_tokens_per_second",
              "The copy-or-recompute estimate of the prefill rate (exponentially averaged).",
              st->offload_prefill_tps);
        counter(p, "disagg:kv_offload_probes",
                "Declined tier copies made anyway to measure the tier again.",
                (double)st->offload_probes);
        counter(p, "disagg:kv_offload_lookups",
                "Offload tier lookups after a device prefix-cache miss, in blocks.",
                (double)o->lookups);
        counter(p, "disagg:kv_offload_corrupt_blocks",
                "Disk-tier blocks that failed their checksum or header checks (recomputed).",
                (double)o->corrupt);
        counter(p, "disagg:kv_offload_write_errors",
                "Disk-tier writes that failed (full disk, I/O error): the block was dropped.",
                (double)o->write_errors);
        if (o->capacity[KV_TIER_DISK]) {
            gauge(p, "disagg:kv_offload_writes_queued",
                  "Disk-tier writes queued for the writer thread or being written (blocks).",
                  (double)o->writes_queued);
            counter(p, "disagg:kv_offload_writes_dropped",
                    "Blocks the host tier evicted that were not written to disk: the write "
                    "queue was full (the disk is behind).",
                    (double)o->writes_dropped);
            gauge(p, "disagg:kv_offload_disk_direct_io",
                  "1 when the disk tier's slab is read and written with O_DIRECT, 0 when "
                  "through the page cache.",
                  (double)o->direct_io);
        }
    }
    counter(p, "vllm:num_preemptions", "Cumulative number of preemptions.",
            (double)st->num_preemptions);
    counter(p, "disagg:engine_steps", "Engine steps executed.", (double)st->steps);
    counter(p, "disagg:http_requests", "HTTP requests received.", (double)m->http_requests);
    static const char *dkinds[METRICS_DEADLINE_COUNT] = {"header", "body", "keepalive"};
    prom_family(p, "disagg:http_deadline_closes", PROM_COUNTER,
                "Connections closed on a deadline (header, body: 408; keepalive: idle).");
    for (int i = 0; i < METRICS_DEADLINE_COUNT; i++)
        prom_sample(p, (double)m->deadline_closes[i], "kind", dkinds[i], NULL);
    static const char *reasons[METRICS_FINISH_COUNT] = {"stop", "length", "abort", "error"};
    prom_family(p, "vllm:request_success", PROM_COUNTER,
                "Count of successfully processed requests.");
    for (int i = 0; i < METRICS_FINISH_COUNT; i++)
        prom_sample(p, (double)m->finished[i], "finished_reason", reasons[i], NULL);
    hist(p, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         &m->ttft);
    hist(p, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
         &m->itl);
    hist(p, "vllm:request_time_per_output_token_seconds",
         "Histogram of time_per_output_token_seconds per request.", &m->tpot);
    hist(p, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
         &m->e2e);
    hist(p, "vllm:request_queue_time_seconds",
         "Histogram of time spent in WAITING phase for request.", &m->queue);
    hist(p, "vllm:request_inference_time_seconds",
         "Histogram of time spent in RUNNING phase for request.", &m->inference);
    hist(p, "vllm:request_prefill_time_seconds",
         "Histogram of time spent in PREFILL phase for request.", &m->prefill);
    hist(p, "vllm:request_decode_time_seconds",
         "Histogram of time spent in DECODE phase for request.", &m->decode);
    hist(p, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", &m->prompt_tokens);
    hist(p, "vllm:request_generation_tokens", "Number of generation tokens processed.",
         &m->generation_tokens);
    hist(p, "vllm:request_prefill_kv_computed_tokens",
         "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
         &m->prefill_kv_computed);
    hist(p, "vllm:request_params_n", "Histogram of the n request parameter.", &m->params_n);
    hist(p, "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
         &m->params_max_tokens);
    static const double step_bounds[] = ENGINE_STEP_TOKEN_BOUNDS;
    uint64_t steps = 0;
    for (int i = 0; i <= ENGINE_STEP_TOKEN_NB; i++)
        steps += st->step_tokens_buckets[i];
    prom_hist it = {step_bounds, ENGINE_STEP_TOKEN_NB,       st->step_tokens_buckets, 0,
                    steps,       (double)st->step_tokens_sum};
    prom_family(p, "vllm:iteration_tokens_total", PROM_HISTOGRAM,
                "Histogram of number of tokens per engine_step.");
    prom_histogram(p, &it, NULL);
    /* disagg:kernels_info: which compute kernels this engine runs (the CPU ISA chosen by
     * cpuid or DISAGG_CPU_ISA, or "cuda") */
    if (st->kernels[0])
        prom_info(p, "disagg:kernels_info",
                  "The compute kernels in use (label kernels: avx512f, avx512bf16, avx2, scalar, "
                  "cuda).",
                  "kernels", st->kernels, NULL);
    /* vllm:cache_config_info: CacheConfig.metrics_info() — the fields that mean something
     * here, as strings; vLLM's labels: the config's keys and engine, no model_name */
    char bs[16], gmu[32], nblocks[16];
    snprintf(bs, sizeof bs, "%d", m->block_size);
    prom_format_value(m->gpu_memory_utilization, PROM_STYLE_FLOAT, gmu, sizeof gmu);
    snprintf(nblocks, sizeof nblocks, "%d", st->num_blocks);
    prom_const_labels(p, NULL, 0);
    prom_info(p, "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "block_size",
              bs, "cache_dtype", m->cache_dtype, "enable_prefix_caching",
              m->enable_prefix_caching ? "True" : "False", "gpu_memory_utilization", gmu,
              "num_cpu_blocks", "None", "num_gpu_blocks", nblocks, "engine", METRICS_ENGINE_LABEL,
              NULL);
    prom_set_style(p, style0);
    prom_const_labels(p, kv0, n0);
    return prom_error(p);
}
