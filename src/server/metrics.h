/*
 * metrics — the server's Prometheus metrics: histograms and counters the
 * HTTP handlers observe (time to first token, inter-token latency, end-to-end
 * latency, finished requests by reason) and the engine's gauges and counters
 * (engine_stats), rendered in the Prometheus text exposition format 0.0.4
 * with vLLM's metric names and buckets (vllm/v1/metrics/loggers.py) so that
 * dashboards and `vllm bench`-style scrapers written for vLLM work unchanged.
 * disagg-specific series use the "disagg:" prefix.  Updated and rendered on
 * the server's event-loop thread only (no locking).
 */
#ifndef DISAGG_SERVER_METRICS_H
#define DISAGG_SERVER_METRICS_H

#include "engine/engine.h"
#include "base/prom.h"

#include <stdint.h>

#define METRICS_MAX_BUCKETS 32
/* The `engine` label's value: one engine per process, as vLLM's first ("0"). */
#define METRICS_ENGINE_LABEL "0"

typedef struct metrics_histogram {
    const double *bounds; /* (n_bounds) upper bounds, ascending, without +Inf */
    int n_bounds;         /* <= METRICS_MAX_BUCKETS */
    uint64_t buckets[METRICS_MAX_BUCKETS + 1]; /* per bucket counts, last = above all bounds */
    uint64_t count;                            /* observations */
    double sum;                                /* sum of observations */
} metrics_histogram;

typedef enum metrics_finish {
    METRICS_FINISH_STOP = 0,
    METRICS_FINISH_LENGTH,
    METRICS_FINISH_ABORT,
    METRICS_FINISH_ERROR,
    METRICS_FINISH_COUNT
} metrics_finish;

/* Why the server closed a connection on a deadline (base/http_server, http.c on_deadline). */
typedef enum metrics_deadline {
    METRICS_DEADLINE_HEADER = 0, /* head not complete in time: 408 */
    METRICS_DEADLINE_BODY,       /* body not complete in time: 408 */
    METRICS_DEADLINE_KEEPALIVE,  /* idle keep-alive connection closed (normal) */
    METRICS_DEADLINE_COUNT
} metrics_deadline;

/* vllm:prompt_tokens_by_source's source label */
typedef enum metrics_source {
    METRICS_SOURCE_LOCAL_COMPUTE = 0, /* "local_compute": run through the model here */
    METRICS_SOURCE_LOCAL_CACHE_HIT,   /* "local_cache_hit": this instance's prefix cache */
    METRICS_SOURCE_EXTERNAL,          /* "external_kv_transfer": received from a producer */
    METRICS_SOURCE_COUNT
} metrics_source;

typedef struct server_metrics {
    metrics_histogram ttft;                   /* vllm:time_to_first_token_seconds */
    metrics_histogram itl;                    /* vllm:inter_token_latency_seconds */
    metrics_histogram tpot;                   /* vllm:request_time_per_output_token_seconds */
    metrics_histogram e2e;                    /* vllm:e2e_request_latency_seconds */
    metrics_histogram queue;                  /* vllm:request_queue_time_seconds */
    metrics_histogram inference;              /* vllm:request_inference_time_seconds */
    metrics_histogram prefill;                /* vllm:request_prefill_time_seconds */
    metrics_histogram decode;                 /* vllm:request_decode_time_seconds */
    metrics_histogram prompt_tokens;          /* vllm:request_prompt_tokens */
    metrics_histogram generation_tokens;      /* vllm:request_generation_tokens */
    metrics_histogram params_n;               /* vllm:request_params_n */
    metrics_histogram params_max_tokens;      /* vllm:request_params_max_tokens */
    metrics_histogram prefill_kv_computed;    /* vllm:request_prefill_kv_computed_tokens */
    double token_bounds[METRICS_MAX_BUCKETS]; /* 1-2-5 up to max_model_len (vLLM's) */
    /* vllm:cache_config_info (metrics_set_config) */
    int block_size, enable_prefix_caching, max_model_len;
    double gpu_memory_utilization;
    char cache_dtype[16];
    uint64_t finished[METRICS_FINISH_COUNT]; /* vllm:request_success_total by reason */
    /* vllm:prompt_tokens_by_source_total: prompt tokens of prefilled requests by where their
     * KV came from (vLLM's PromptTokenStats sources) */
    uint64_t prompt_by_source[METRICS_SOURCE_COUNT];
    /* vllm:external_prefix_cache_queries/_hits_total (tokens): the KV connector's external
     * cache -- here D's remote-prefill requests: their prompt tokens / those received from P */
    uint64_t external_queries, external_hits;
    uint64_t http_requests;                           /* disagg:http_requests_total */
    uint64_t deadline_closes[METRICS_DEADLINE_COUNT]; /* disagg:http_deadline_closes_total */
} server_metrics;

void metrics_init(server_metrics *m);
/* Once the engine is loaded (before any request is observed): the token-count
 * histograms get vLLM's 1-2-5 buckets up to max_model_len, and
 * vllm:cache_config_info its labels. */
void metrics_set_config(server_metrics *m, const engine_config *cfg, int max_model_len);
/* vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... <= max_value; at most
 * cap bounds.  Returns how many. */
int metrics_1_2_5_bounds(double max_value, double *out, int cap);
void metrics_observe(metrics_histogram *h, double v);
/* Maps an engine / server finish reason ("stop", "length", "tool_calls",
 * "abort", "error") to the counter it belongs to. */
metrics_finish metrics_finish_of(const char *reason);

/* One engine request finished (the FINISHED event): vLLM's per-request
 * histograms.  Times are clock_now_ns values, 0 where it never happened;
 * max_tokens_param <= 0: the request set none (not observed, as vLLM);
 * n_param > 0: observe vllm:request_params_n (once per parent prompt). */
typedef struct metrics_request {
    uint64_t t_queued_ns, t_scheduled_ns, t_first_token_ns, t_last_token_ns;
    int n_prompt, n_generated, max_tokens_param, n_param;
    /* where the prompt's KV came from: n_cached from the prefix cache (n_tier_cached of those
     * copied back from the offload tiers: external_kv_transfer, as vLLM counts its
     * OffloadingConnector's), n_kv_received from a producer or a pool fetch
     * (remote_prefill: the request asked a producer for it); the rest was computed here.
     * Counted (prompt_tokens_by_source, prefill_kv_computed) once the prompt was prefilled
     * (t_first_token_ns != 0), as vLLM counts at the first output. */
    int n_cached, n_tier_cached, n_kv_received, remote_prefill;
} metrics_request;
void metrics_observe_request(server_metrics *m, const metrics_request *q);
/* The part of it about where the prompt's KV came from (prompt_tokens_by_source,
 * prompt_tokens_cached, external_prefix_cache_*, request_prefill_kv_computed_tokens):
 * local_compute = n_prompt - cached - received, so the three sources sum to the prompt. */
void metrics_observe_prompt_sources(server_metrics *m, const metrics_request *q);

/* Writes the server's families to out (base/prom, values as prometheus_client
 * writes them; out's style and constant labels are left as they were).
 * block_size turns the engine's block-granular prefix-cache counters into
 * vLLM's token-granular ones.  Returns 0 or out's error (<0). */
int metrics_render(const server_metrics *m, const engine_stats *st, int block_size,
                   const char *model_name, prom *out);

#endif
