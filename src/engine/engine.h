/*
 * engine — the serving engine: owns the model, the paged KV cache (one
 * region, block-major, registered with the transfer engine by the connector),
 * the block pool, the scheduler and the step thread that runs continuous
 * batching.  The server submits tokenized requests and receives events
 * (new tokens, finish) through a callback that runs on the engine thread.
 *
 * Threading: engine_submit / engine_abort / engine_get_stats are thread-safe
 * and never block on the step loop for long; event callbacks run on the
 * engine thread and must not block (hand the event to your own loop).
 */
#ifndef DISAGG_ENGINE_ENGINE_H
#define DISAGG_ENGINE_ENGINE_H

#include "engine/kv_connector.h"
#include "engine/kv_events.h"
#include "engine/kv_offload.h"

#include <stddef.h>
#include <stdint.h>

typedef struct engine engine;
struct model_config;

typedef struct engine_config {
    const char *model;             /* directory or hub name in the HF cache */
    int block_size;                /* tokens per KV block (0, the default: auto, 128 cpu / 16 cuda) */
    size_t kv_cache_bytes;         /* KV region size; 0 = kv_cache_fraction of RAM */
    double kv_cache_fraction;      /* default 0.25 */
    int max_num_seqs;              /* default 64 */
    int max_num_batched_tokens;    /* default 2048 */
    int max_model_len;             /* 0 = the model's max_position_embeddings */
    int enable_prefix_caching;     /* default 1 */
    uint64_t seed;                 /* engine-wide seed for unseeded sampling */
    int threads;                   /* compute threads, 0 = all cores */
    int progress;                  /* show model-loading progress on a tty */
    const char *device;            /* backend_open device: "cpu" (default), "auto", "cuda[:N]" */
    int kv_cache_dtype;            /* backend_dtype of the KV cache; -1 = the device's default */
    double gpu_memory_utilization; /* GPU: device-memory fraction for everything (0.9) */
    int enforce_eager;             /* GPU: no CUDA graphs (default: decode steps as graphs) */
    int batch_invariant;           /* --batch-invariant: backend_options.batch_invariant */
    int load_dummy;                /* --load-format dummy: random weights, config.json alone */
    int quant_fp8;                 /* --quantization fp8: quantize the weights at load */
    /* KV offload tiers (engine/kv_offload.h): blocks the KV cache evicts go to host memory
     * (and from there to disk) and come back by copy.  0 / NULL = none. */
    size_t kv_offload_bytes;         /* --kv-offloading-size: the host tier */
    const char *kv_offload_disk_dir; /* --kv-offloading-disk: the disk tier's directory */
    size_t kv_offload_disk_bytes;    /* --kv-offloading-disk-size */
    struct collective *tp_group;   /* -tp > 1: rank 0's group (tp_worker.h: the rest), or NULL */
    /* -tp > 1 on the CPU with a KV connector: per rank (index 1..N-1) an empty memfd that
     * rank 0 sizes to the rank's KV region and maps, and the worker maps as its region, so
     * that the connector moves every rank's KV heads (engine_get_kv_region_rank).  NULL:
     * the workers' regions are private. */
    const int *tp_kv_fds;
    /* Structured outputs: 1 (the default) fills a step's grammar masks on a worker thread
     * while the forward runs (engine/mask_worker.h), 0 on the step thread before it (the
     * serial path; the outputs are the same).  The environment variable
     * DISAGG_GRAMMAR_OVERLAP (0 or 1), when set, overrides it at engine_create. */
    int grammar_overlap;
    /* Structured outputs: 1 (the default) applies a constrained row's bitmask to its logits on
     * the device (backend_token_bitmask) and, when the request is plain greedy, picks the token
     * there (only the id comes back, as for an unconstrained greedy row); other constrained
     * rows come back masked and are drawn on the host as before.  Rows of requests that want
     * logprobs keep the host path (their logprobs are those of the raw distribution).  0: every
     * constrained row's logits come to the host and the sampler masks them.  The tokens are the
     * same either way.  DISAGG_GRAMMAR_DEVICE_MASK (0 or 1), when set, overrides it at
     * engine_create.  (DISAGG_SAMPLE_THREADS=N: the host draws of a step on N threads; default
     * 1 on the CPU backend, min(8, online CPUs / 2) on a device.) */
    int grammar_device_mask;
} engine_config;

void engine_config_init(engine_config *c);

typedef struct engine_sampling {
    float temperature;        /* 0 = greedy */
    float top_p;              /* 1 = off */
    int top_k;                /* 0 or -1 = off */
    float min_p;              /* 0 = off */
    float repetition_penalty; /* 1 = off */
    float presence_penalty;   /* 0 = off */
    float frequency_penalty;  /* 0 = off */
    int has_seed;
    uint64_t seed;       /* per-request seed: reproducible output */
    int logprobs;        /* -1: none; N >= 0: chosen token's logprob + top N */
    int prompt_logprobs; /* -1: none; N >= 0: prompt tokens' logprobs + top N */
    /* Logit processors (model/sampler.h sampler_params): the caller's arrays, read by
     * engine_submit only (the request's sampler copies them; token ids are checked against
     * the vocabulary there, an out-of-range one refused with -EINVAL naming it). */
    const int32_t *logit_bias_ids; /* logit_bias: (n_logit_bias) token ids ... */
    const float *logit_bias;       /* ... and their biases, [-100, 100] */
    int n_logit_bias;
    const int32_t *allowed_token_ids; /* (n_allowed_token_ids); 0 = every token */
    int n_allowed_token_ids;
    const int32_t *bad_word_ids;  /* bad_words as token sequences, concatenated */
    const int32_t *bad_word_lens; /* (n_bad_words) their lengths */
    int n_bad_words;
} engine_sampling;

void engine_sampling_init(engine_sampling *s);

typedef struct engine_request_params {
    const int32_t *prompt; /* (n_prompt) token ids */
    int n_prompt;
    int max_tokens; /* > 0 */
    int min_tokens; /* eos/stop ids ignored before this many */
    int ignore_eos;
    const int32_t *stop_token_ids; /* (n_stop_token_ids) besides the model's eos */
    int n_stop_token_ids;
    engine_sampling sampling;
    const char *request_id;         /* for logs */
    const char *kv_transfer_params; /* JSON text for the KV connector, or NULL */
    /* Consumer: the producer's first token may replace recomputing the last prompt
     * position (engine_kv_load_done_first_token) — the caller says the request is one
     * output sequence (n == 1); the engine also requires no logprobs / prompt_logprobs. */
    int first_token_handoff_ok;
    /* Structured outputs: the grammar the output must follow (grammar/, compiled over this
     * engine's vocabulary), or NULL.  The engine takes a reference.  Each sampled token
     * is masked to the grammar's allowed tokens (the mask filled while the forward runs:
     * engine_config.grammar_overlap); the model's eos and the stop ids are allowed exactly
     * when the grammar accepts. */
    struct grammar *grammar;
} engine_request_params;

#define ENGINE_MAX_TOP_LOGPROBS 20

typedef struct engine_token {
    int32_t id;
    float logprob; /* of the chosen token (if asked) */
    int n_top;     /* entries in top_* */
    int32_t top_ids[ENGINE_MAX_TOP_LOGPROBS];
    float top_logprobs[ENGINE_MAX_TOP_LOGPROBS]; /* descending */
    int stop; /* this token ends the request (an eos or stop id): vLLM leaves its text out of the
                 output unless include_stop_str_in_output */
} engine_token;

typedef enum engine_event_kind {
    ENGINE_EV_TOKEN = 0,   /* one new token */
    ENGINE_EV_FINISHED = 1 /* last event of a request */
} engine_event_kind;

typedef struct engine_event {
    engine_event_kind kind;
    uint64_t id;               /* the request's engine id */
    const engine_token *token; /* ENGINE_EV_TOKEN */
    /* ENGINE_EV_FINISHED */
    const char *finish_reason; /* "stop" (eos/stop id), "length", "abort", "error" */
    int32_t stop_token;        /* the eos/stop id that ended it, -1 otherwise */
    const char *error;         /* message when finish_reason is "error" */
    int error_status;          /* its HTTP status (400, 502...; 0 = internal, 500) */
    int n_prompt;              /* usage: prompt tokens */
    int n_cached;              /* of those, served from the prefix cache */
    int n_tier_cached;         /* copied back from the tiers (metrics: at most n_cached) */
    int n_generated;           /* usage: completion tokens */
    int kv_role;               /* kv_role_of_request: LOCAL, REMOTE_PREFILL or REMOTE_DECODE */
    int n_kv_received;         /* prompt tokens whose KV a producer sent (consumer, load ok) */
    int n_prompt_computed;     /* prompt tokens this instance ran through the model */
    int kv_layerwise;          /* consumer: the producer streamed the KV layer by layer */
    /* timeline (clock_now_ns; 0 = never happened): submitted, first scheduled,
     * first and last generated token — vLLM's queue/prefill/decode/inference times */
    uint64_t t_queued_ns, t_scheduled_ns, t_first_token_ns, t_last_token_ns;
    /* prompt logprobs (if asked): (n_prompt) entries, entry 0 has no logprob */
    const engine_token *prompt_logprobs;
} engine_event;

typedef void (*engine_event_fn)(void *ctx, const engine_event *ev);

/* Loads the model, sizes and allocates the KV region, starts the step thread.
 * Errors go to err (what was wrong and what is accepted). */
int engine_create(const engine_config *cfg, engine **out, char *err, size_t errlen);
void engine_destroy(engine *e);

/* Queue a request; *id identifies it in events and engine_abort.  Params are
 * copied.  Returns 0 or -EINVAL with err filled (empty prompt, prompt + max
 * tokens beyond max_model_len, bad token id, invalid sampling values). */
int engine_submit(engine *e, const engine_request_params *p, engine_event_fn fn, void *ctx,
                  uint64_t *id, char *err, size_t errlen);
/* Cancel: the request ends with finish_reason "abort" and its blocks are freed.
 * Unknown or finished ids are ignored. */
void engine_abort(engine *e, uint64_t id);

/* KV cache events (vLLM's KVEventBatch): after every step that stored or removed
 * prefix-cache blocks, publish(ctx, log) runs on the engine thread with that step's
 * events; it must copy what it keeps and not block.  Attach before the first submit;
 * NULL detaches (the caller then no longer receives calls once this returns). */
typedef struct engine_kv_event_sink {
    void *ctx;
    void (*publish)(void *ctx, const kvev_log *log);
} engine_kv_event_sink;
void engine_set_kv_event_sink(engine *e, const engine_kv_event_sink *sink);
/* vLLM's reset_prefix_cache: forget every cached block (the device cache and the
 * offload tiers) at the engine's next step, recording AllBlocksCleared; refused with a
 * warning in the log while a cached block is in use.  Asynchronous, thread-safe. */
void engine_reset_prefix_cache(engine *e);

/* Attach a KV connector (before the first submit).  Its classify() runs in
 * engine_submit's thread, the other hooks on the engine thread. */
void engine_set_kv_connector(engine *e, const engine_kv_connector *c);
void engine_get_kv_region(const engine *e, engine_kv_region *out);
/* The TP group's size (1 without -tp), and tensor-parallel rank `rank`'s KV region as this
 * process (rank 0) reaches it: its heads of every block, the same block ids, fingerprint and
 * block bytes as rank 0's; base is the shared mapping of the rank's region (engine_config
 * tp_kv_fds).  0, or -ENOENT (no such rank, or its region is not shared with rank 0). */
int engine_tp_size(const engine *e);
int engine_get_kv_region_rank(const engine *e, int rank, engine_kv_region *out);
/* Consumer: the remote KV of request id has arrived (ok) or not.  On failure
 * the request fails with error, or, when recompute is set, computes its
 * prompt locally.  hold_ns > 0 (a failure where the producer may still be
 * writing, e.g. a pull abandoned without its final reply): the request's
 * blocks stay out of use that long before they are freed, so a late write
 * cannot land in another request's KV.  Exactly once per start_load(). */
void engine_kv_load_done(engine *e, uint64_t id, int ok, int recompute, uint64_t hold_ns,
                         const char *error);
/* Consumer: the whole prompt's KV of request id has arrived, and the producer's
 * prefill sampled token as the first output token (the first-token handoff).
 * When the request allows it (first_token_handoff_ok, no logprobs or
 * prompt_logprobs) and token is in the vocabulary, the engine emits token as
 * the request's first output (stop ids, min_tokens and max_tokens apply), advances
 * the request's sampler past the one draw the producer made (a seeded request's
 * later draws equal a colocated run's) and decodes on from it: no prompt position
 * is computed here.  Otherwise it is engine_kv_load_done(e, id, 1, 0, 0, NULL):
 * the last prompt position is recomputed (an out-of-vocabulary token is logged). */
void engine_kv_load_done_first_token(engine *e, uint64_t id, int32_t token);
/* Either of the two above (token < 0: engine_kv_load_done(e, id, 1, 0, 0, NULL)), also
 * saying whether the producer streamed the KV layer by layer (engine_event.kv_layerwise). */
void engine_kv_load_done_streamed(engine *e, uint64_t id, int32_t token, int layerwise);
/* engine_kv_load_done(e, id, 0, recompute, hold_ns, error) that also says
 * which HTTP status the failure is (400: unusable kv_transfer_params, 502/503:
 * producer unreachable or failing, 504: no KV in time; 0 = 500). */
void engine_kv_load_failed(engine *e, uint64_t id, int recompute, uint64_t hold_ns, int http_status,
                           const char *error);
/* Producer: free the blocks kept for request id (after request_finished keep), or the
 * blocks pinned under id (engine_kv_pin_prefix). */
void engine_kv_release(engine *e, uint64_t id);
/* Pool fetch, consumer: the KV of the request's first n_tokens prompt tokens arrived (full
 * blocks; tokens the local prefix cache held are part of them): it computes the rest of its
 * prompt here, those tokens counted as received (engine_event.n_kv_received). */
void engine_kv_load_done_prefix(engine *e, uint64_t id, int n_tokens);
/* Pool fetch, holder: at the next step, pin the cached KV of the longest prefix of the
 * full blocks of tokens (n_tokens) that the device cache or the offload tiers hold
 * (a tier's block is copied into a free device block first), and answer through the
 * connector's prefix_pinned(key, ...).  Thread-safe; -ENOMEM. */
int engine_kv_pin_prefix(engine *e, uint64_t key, const int32_t *tokens, int n_tokens);

/* vllm:iteration_tokens_total's bucket bounds (vLLM v1's PrometheusStatLogger):
 * tokens (prompt + generated) per engine step. */
#define ENGINE_STEP_TOKEN_BOUNDS                                                                   \
    { 1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384 }
#define ENGINE_STEP_TOKEN_NB 13

typedef struct engine_stats {
    int num_running, num_waiting, num_parked;
    int num_blocks, num_blocks_used;      /* KV cache blocks */
    uint64_t prefix_queries, prefix_hits; /* blocks */
    uint64_t prefix_evictions;            /* cached blocks reused for other KV */
    uint64_t num_preemptions;
    uint64_t prompt_tokens, generation_tokens; /* totals */
    uint64_t steps;
    /* tokens per step: per-bucket counts (last = above all bounds), their sum */
    uint64_t step_tokens_buckets[ENGINE_STEP_TOKEN_NB + 1];
    uint64_t step_tokens_sum;
    int num_kept;                  /* producer requests holding blocks for a pull */
    int num_loading;               /* consumer requests waiting for remote KV */
    uint64_t first_token_handoffs; /* consumer: first tokens taken from the producer */
    uint64_t first_token_refused;  /* consumer: handed-off tokens not used (recomputed) */
    char kernels[32]; /* the compute kernels: the CPU ISA ("avx512f", "avx2", ...) or "cuda" */
    int has_offload;           /* the KV offload tiers are on: offload holds their counts */
    kv_offload_stats offload;  /* (has_offload) */
    uint64_t offload_queries;  /* blocks looked up in the tiers after a device-cache miss */
    uint64_t offload_hits;     /* of those, copied back from a tier */
    int offload_loading;       /* requests waiting for tier copies (counted in num_waiting too) */
    uint64_t offload_steps_during_loads; /* forwards run while tier copies were pending */
    uint64_t offload_load_waits;         /* requests that waited for tier copies */
    uint64_t offload_load_wait_ns;       /* their time waiting (copies started to all ended) */
    double offload_bps[KV_TIER_COUNT];   /* the cost model's bandwidth of each tier, bytes/s */
    double offload_prefill_tps;          /* and its prefill rate, tokens/s */
    uint64_t offload_declined[KV_TIER_COUNT]; /* blocks a tier held, recomputed (cost) */
    uint64_t offload_probes;             /* declined prefixes copied anyway to re-measure */
    /* step timings, summed over the steps (ns): the whole step (plan to the last token
     * sent), its forward, and what follows the forward (sampling, delivering the tokens) */
    uint64_t step_ns, forward_ns, sample_ns;
    /* the forwards of the steps that were prefill (at least a block of prompt tokens, 90 % of
     * the step's tokens): their time (ns) and tokens -- the prefill rate a pool fetch is
     * weighed against */
    uint64_t prefill_forward_ns, prefill_forward_tokens;
    /* the steps that sampled constrained rows (structured outputs): their count, their
     * rows, the time spent filling the rows' masks (on the mask thread when overlapped),
     * the time the step thread waited for them (serial: all of it; overlapped: what the
     * forward did not hide), and these steps' whole, forward and after-forward times */
    uint64_t grammar_steps, grammar_rows;
    uint64_t grammar_device_rows; /* of those rows, masked on the device (decoder_seq.allow) */
    int sample_threads;           /* DISAGG_SAMPLE_THREADS as the engine took it */
    uint64_t grammar_fill_ns, grammar_wait_ns, grammar_step_ns, grammar_forward_ns;
    uint64_t grammar_sample_ns;
} engine_stats;

void engine_get_stats(engine *e, engine_stats *out);
/* Switch structured outputs' mask overlap (engine_config.grammar_overlap) from the next step
 * on: for benchmarks comparing the two on one engine.  Thread-safe. */
void engine_set_grammar_overlap(engine *e, int on);
/* Switch structured outputs' device masks (engine_config.grammar_device_mask) from the next
 * step on: for benchmarks comparing the two on one engine.  Thread-safe. */
void engine_set_grammar_device_mask(engine *e, int on);
/* KV cache usage, 0..1: blocks in use over the blocks of the cache (vllm:kv_cache_usage_perc,
 * and the kv_usage `disagg serve --discovery` publishes). */
static inline double engine_stats_kv_usage(const engine_stats *st) {
    return st->num_blocks > 0 ? (double)st->num_blocks_used / st->num_blocks : 0.0;
}
const struct model_config *engine_model_config(const engine *e);
/* The resolved model directory (tokenizer files live there). */
const char *engine_model_dir(const engine *e);
int engine_max_model_len(const engine *e);
int engine_vocab_size(const engine *e); /* entries of a logits row */
int engine_block_size(const engine *e); /* tokens per KV block (auto resolved) */

#endif
