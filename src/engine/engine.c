/*
 * engine — see engine.h.  One step thread runs the loop
 *   take new requests and aborts -> plan (scheduler) -> forward (model) ->
 *   commit -> sample the items that reached their end -> emit events,
 * so every request's tokens come from the same batch-invariant forward
 * whatever else is running.  The KV region is one anonymous mapping of
 * num_blocks blocks (block-major, model/decoder.h's kv_store).
 */
#include "engine/engine.h"
#include "engine/gpu_budget.h"

#include "base/clock.h"
#include "base/log.h"
#include "engine/block_pool.h"
#include "engine/kv_load_cost.h"
#include "engine/kv_offload.h"
#include "engine/mask_worker.h"
#include "engine/scheduler.h"
#include "kernels/backend.h"
#include "kernels/collective.h"
#include "model/arch.h"
#include "model/decoder.h"
#include "grammar/grammar.h"
#include "model/sampler.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MOD                   "engine"
#define PROMPT_LOGPROBS_CHUNK 32 /* prompt-logprob requests prefill in chunks this size */

typedef struct ereq {
    seq s;                   /* scheduler state: tokens, blocks */
    engine_request_params p; /* copy; p.prompt points into s.tokens */
    int32_t *stop_ids;       /* (p.n_stop_token_ids) copy */
    engine_event_fn fn;
    void *ctx;
    sampler *smp; /* per-request sampler: seed stream, penalty counts */
    int n_generated;
    engine_token *prompt_lp; /* (n_prompt) when prompt_logprobs >= 0 */
    int prompt_lp_done;      /* prompt logprobs filled up to this position */
    uint64_t t_arrival_ns;
    uint64_t t_scheduled_ns, t_first_token_ns, t_last_token_ns; /* 0 = not yet */
    int kv_role;                                                /* kv_role_of_request */
    void *kv_handle;   /* the connector's per-request state */
    int loading;       /* consumer: start_load() sent, load_done() not yet */
    int needs_park;    /* consumer: waiting for blocks to park with */
    int pool_fetch;    /* a prefix of the prompt's KV is pulled from another instance first */
    int zombie;        /* finished to the client, blocks wait for load_done() */
    int error_status;  /* HTTP status for an "error" finish (0 = internal, 500) */
    struct ereq *next; /* inbox or live list */

    int n_kv_received;     /* usage: prompt tokens whose KV came from the producer */
    int n_prompt_computed; /* usage: prompt tokens run through the model here */
    int kv_layerwise;      /* usage: the producer streamed the KV layer by layer */

    grammar *gm;           /* structured outputs: the constraint, or NULL */
    grammar_state gs;      /* its state after the output so far */
    const uint32_t *gmask; /* this step's allowed tokens (mask_worker: filled during the forward) */
} ereq;

typedef struct kept_blocks { /* blocks held outside any request */
    uint64_t id;             /* producer: the request they were kept for (0: quarantine) */
    uint64_t expire_ns;      /* quarantine: freed at this time (0: until released) */
    int32_t *blocks;
    int n;
    struct kept_blocks *next;
} kept_blocks;

typedef struct kv_note { /* a connector's answer, queued for the step thread */
    uint64_t id;
    int kind; /* 0 load done, 1 release, 2 pin a prefix (engine_kv_pin_prefix) */
    int ok, recompute;
    int n_tokens;    /* load done (pool fetch): prompt tokens filled; pin: count of tokens */
    int32_t *tokens; /* pin: (n_tokens) the token ids whose cached prefix is pinned */
    uint64_t key;    /* pin: the connector's key for the answer */
    uint64_t hold_ns;    /* failure: keep the blocks out of use this long */
    int http_status;     /* failure: its HTTP status (0 = 500) */
    int has_first;       /* ok: the producer's first output token came with the KV */
    int32_t first_token; /* that token */
    int layerwise;       /* ok: the producer streamed it layer by layer */
    char error[512];
    struct kv_note *next;
} kv_note;

struct engine {
    engine_config cfg;
    decoder_model model;
    backend *be; /* the compute device: weights, KV region, work */
    decoder_state *state;
    kv_store kv;     /* the KV region (a buffer of be) */
    size_t kv_bytes; /* its length */
    /* cfg.tp_kv_fds: rank r's KV region (r >= 1) mapped here, kv_bytes each, else NULL */
    void *tp_kv[COLLECTIVE_MAX_RANKS];
    block_pool bp;
    scheduler sched;
    sched_plan plan;
    decoder_seq *fwd;    /* (max_num_seqs) forward descriptors */
    float *logits;       /* (max_num_seqs, vocab) last-token logits (in logits_hb) */
    backend_buffer *logits_hb; /* page-locked on a GPU: the host-sampled rows come at full speed */
    float *plogits;      /* (PROMPT_LOGPROBS_CHUNK, vocab) prompt-logprob chunk */
    int *sidx;           /* (max_num_seqs) this step's host-sampled items */
    sample_result *sres; /* (max_num_seqs) their draws, by item */
    int sample_threads;  /* threads sampling them: the step thread and sample_threads - 1 */
    int32_t *amax;       /* (max_num_seqs) greedy tokens computed on the device */
    int dev_greedy;      /* 1: plain greedy requests take the device argmax (not on the CPU) */
    mask_worker *masks;  /* the constrained rows' token masks, filled while the forward runs */
    int grammar_overlap; /* under mu: 1 masks overlap the forward, 0 filled before it */
    int grammar_device_mask; /* under mu: 1 constrained rows are masked on the device */
    int warned_mask_pick;    /* a device pick outside its row's mask was logged */

    int vocab;
    int max_model_len;

    pthread_t thread;
    pthread_mutex_t mu; /* guards inbox, aborts, stop, stats */
    pthread_cond_t cv;
    ereq *inbox;      /* submitted, not yet seen by the step thread (LIFO) */
    uint64_t *aborts; /* (n_aborts) ids to cancel */
    size_t n_aborts, cap_aborts;
    int stop;
    uint64_t next_id;
    engine_stats stats; /* snapshot published after every step */

    backend_layer_progress *lp; /* layer marks for the connector's prefill_chunk, or NULL */
    uint64_t step_seq;          /* step thread only: the forwards run so far */

    ereq *live;               /* step thread only: every request it owns */
    engine_kv_connector conn; /* hooks (conn.classify NULL = none) */
    kv_note *notes;           /* under mu: connector answers (LIFO) */
    kept_blocks *kept;        /* step thread only */
    int n_kept, n_loading;
    int n_parkwait;    /* consumers not yet parked (not in the scheduler) */
    kvev_log events;   /* step thread: this step's KV cache events */
    kv_offload *off;   /* the KV offload tiers, or NULL */
    backend_stream *off_st; /* their copies' stream */
    kv_load_cost cost;      /* (off) copy or recompute a tier's block */
    int off_ready;          /* under mu: a tier load ended (the step thread reaps it) */
    uint64_t steps_during_loads; /* step thread: forwards run while tier copies were pending */
    int stalled_on_loads; /* step thread: nothing could run until a tier copy ends (sleep) */
    engine_kv_event_sink sink; /* under mu: sink.publish NULL = no events */
    int reset_cache;           /* under mu: engine_reset_prefix_cache() asked */
    int n_quarantined; /* blocks held after abandoned loads (see quarantine) */
};

void engine_config_init(engine_config *c) {
    memset(c, 0, sizeof *c);
    c->block_size = 0; /* auto: backend_block_size_default() */
    c->kv_cache_fraction = 0.25;
    c->gpu_memory_utilization = 0.9;
    c->max_num_seqs = 64;
    c->max_num_batched_tokens = 2048;
    c->enable_prefix_caching = 1;
    c->device = "cpu";
    c->grammar_overlap = 1;
    c->grammar_device_mask = 1;
    c->kv_cache_dtype = -1;
}

/* ---- requests --------------------------------------------------------------- */

void engine_sampling_init(engine_sampling *s) {
    memset(s, 0, sizeof *s);
    s->temperature = 1.0f;
    s->top_p = 1.0f;
    s->repetition_penalty = 1.0f;
    s->logprobs = -1;
    s->prompt_logprobs = -1;
}

/* The request's sampling values as the model's sampler takes them (it
 * validates them; stop ids are the engine's business, not the sampler's). */
static int engine_sampling_to_params(const engine_sampling *sp, const engine_request_params *p,
                                     sampler_params *out, char *err, size_t errlen) {
    sampler_params_default(out);
    out->temperature = sp->temperature;
    out->top_k = sp->top_k;
    out->top_p = sp->top_p;
    out->min_p = sp->min_p;
    out->repetition_penalty = sp->repetition_penalty;
    out->presence_penalty = sp->presence_penalty;
    out->frequency_penalty = sp->frequency_penalty;
    out->has_seed = sp->has_seed;
    out->seed = sp->seed;
    out->logprobs = sp->logprobs < 0 ? 0 : sp->logprobs;
    out->bias_ids = sp->logit_bias_ids, out->bias = sp->logit_bias, out->n_bias = sp->n_logit_bias;
    out->allowed = sp->allowed_token_ids, out->n_allowed = sp->n_allowed_token_ids;
    out->bad_ids = sp->bad_word_ids, out->bad_lens = sp->bad_word_lens;
    out->n_bad = sp->n_bad_words;
    (void)p;
    return sampler_params_check(out, 1 << 30, err, errlen);
}

/* log_softmax(row)[chosen] and the top_n most likely tokens, for prompt logprobs. */
static void row_logprobs(const float *l, int vocab, int32_t chosen, int top_n, engine_token *t) {
    float mx = -INFINITY;
    for (int i = 0; i < vocab; i++)
        if (l[i] > mx) mx = l[i];
    double sum = 0;
    for (int i = 0; i < vocab; i++)
        sum += exp((double)(l[i] - mx));
    float lse = mx + (float)log(sum);
    t->logprob = l[chosen] - lse;
    int n = 0;
    for (int i = 0; i < vocab && top_n > 0; i++) {
        if (n == top_n && l[i] <= l[t->top_ids[n - 1]]) continue;
        int j = n < top_n ? n++ : n - 1;
        while (j > 0 && l[t->top_ids[j - 1]] < l[i]) {
            t->top_ids[j] = t->top_ids[j - 1];
            j--;
        }
        t->top_ids[j] = i;
    }
    for (int i = 0; i < n; i++)
        t->top_logprobs[i] = l[t->top_ids[i]] - lse;
    t->n_top = n;
}

static void ereq_free(ereq *r) {
    if (r->smp) sampler_free(r->smp);
    grammar_unref(r->gm);
    seq_free(&r->s);
    free(r->stop_ids);
    free(r->prompt_lp);
    free(r);
}

static void emit_finish(engine *e, ereq *r, const char *reason, int32_t stop_token,
                        const char *error) {
    engine_event ev = {.kind = ENGINE_EV_FINISHED,
                       .id = r->s.id,
                       .finish_reason = reason,
                       .stop_token = stop_token,
                       .error = error,
                       .error_status = error ? r->error_status : 0,
                       .n_prompt = r->s.n_prompt,
                       .n_cached = r->s.n_cached,
                       .n_tier_cached = r->s.n_tier_cached,
                       .n_generated = r->n_generated,
                       .kv_role = r->kv_role,
                       .n_kv_received = r->n_kv_received,
                       .n_prompt_computed = r->n_prompt_computed,
                       .kv_layerwise = r->kv_layerwise,
                       .t_queued_ns = r->t_arrival_ns,
                       .t_scheduled_ns = r->t_scheduled_ns,
                       .t_first_token_ns = r->t_first_token_ns,
                       .t_last_token_ns = r->t_last_token_ns,
                       .prompt_logprobs = r->prompt_lp};
    /* Never an unfilled entry: a prompt whose positions were not all computed here
     * (a path that skipped them) reports no prompt logprobs rather than zeros. */
    if (r->prompt_lp && r->prompt_lp_done < r->s.n_prompt) {
        if (!error)
            LOG_E(MOD, "request %llu: prompt logprobs cover %d of %d positions; not reported",
                  (unsigned long long)r->s.id, r->prompt_lp_done, r->s.n_prompt);
        ev.prompt_logprobs = NULL;
    }
    r->fn(r->ctx, &ev);
    (void)e;
}

static void live_remove(engine *e, ereq *r) {
    for (ereq **pp = &e->live; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            return;
        }
}

static void release_handle(engine *e, ereq *r) {
    if (r->kv_handle && e->conn.request_released)
        e->conn.request_released(e->conn.ctx, r->kv_handle, r->s.id);
    r->kv_handle = NULL;
}

static void finish(engine *e, ereq *r, const char *reason, int32_t stop_token, const char *error) {
    int ok_end = !strcmp(reason, "stop") || !strcmp(reason, "length");
    int keep = r->kv_role == KV_REQ_REMOTE_DECODE && ok_end;
    kept_blocks *k = NULL;
    if (keep) {
        k = calloc(1, sizeof *k);
        if (k) k->blocks = malloc((size_t)(r->s.n_blocks ? r->s.n_blocks : 1) * sizeof *k->blocks);
        if (!k || !k->blocks) { /* cannot keep: the pull will find nothing */
            if (k) free(k);
            k = NULL;
            keep = 0;
        }
    }
    if (keep) {
        k->id = r->s.id;
        k->n = r->s.n_blocks;
        memcpy(k->blocks, r->s.blocks, (size_t)k->n * sizeof *k->blocks);
        k->next = e->kept;
        e->kept = k;
        e->n_kept++;
    }
    if (r->needs_park) {
        r->needs_park = 0;
        e->n_parkwait--;
    }
    if (r->loading) {
        /* A transfer may still be writing into its blocks: tell the client and
         * the connector (it cancels the pull) now, free the blocks when the
         * connector reports the load ended (engine_kv_load_done). */
        if (!r->zombie) {
            emit_finish(e, r, reason, stop_token, error);
            if (e->conn.request_finished)
                e->conn.request_finished(e->conn.ctx, r->kv_handle, r->s.id, reason, NULL, 0,
                                         r->s.n_prompt, 0);
        }
        r->zombie = 1;
        return;
    }
    sched_finish(&e->sched, &r->s, keep);
    live_remove(e, r);
    if (r->kv_role == KV_REQ_REMOTE_DECODE && e->conn.request_finished)
        e->conn.request_finished(e->conn.ctx, r->kv_handle, r->s.id, reason, r->s.blocks,
                                 r->s.n_blocks, r->s.n_prompt, keep);
    if (!r->zombie) emit_finish(e, r, reason, stop_token, error);
    release_handle(e, r);
    ereq_free(r);
}

int engine_submit(engine *e, const engine_request_params *p, engine_event_fn fn, void *ctx,
                  uint64_t *id, char *err, size_t errlen) {
    if (!p || !fn) return -EINVAL;
    if (p->n_prompt <= 0) {
        snprintf(err, errlen, "the prompt is empty: at least one token is needed");
        return -EINVAL;
    }
    if (p->max_tokens <= 0) {
        snprintf(err, errlen, "max_tokens must be at least 1 (got %d)", p->max_tokens);
        return -EINVAL;
    }
    if ((long)p->n_prompt + p->max_tokens > e->max_model_len) {
        snprintf(
            err, errlen,
            "this model's maximum context length is %d tokens; the request has %d prompt tokens "
            "and max_tokens %d (%ld in all): shorten the prompt or lower max_tokens",
            e->max_model_len, p->n_prompt, p->max_tokens, (long)p->n_prompt + p->max_tokens);
        return -EINVAL;
    }
    for (int i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= e->vocab) {
            snprintf(err, errlen,
                     "prompt token %d at index %d is out of range (vocabulary has %d tokens)",
                     p->prompt[i], i, e->vocab);
            return -EINVAL;
        }
    for (int i = 0; i < p->n_stop_token_ids; i++)
        if (p->stop_token_ids[i] < 0 || p->stop_token_ids[i] >= e->vocab) {
            snprintf(err, errlen, "stop_token_ids[%d] = %d is out of range (0..%d)", i,
                     p->stop_token_ids[i], e->vocab - 1);
            return -EINVAL;
        }
    const engine_sampling *sp = &p->sampling;
    if (sp->logprobs > ENGINE_MAX_TOP_LOGPROBS || sp->prompt_logprobs > ENGINE_MAX_TOP_LOGPROBS) {
        snprintf(err, errlen, "logprobs / prompt_logprobs may ask for at most %d top tokens",
                 ENGINE_MAX_TOP_LOGPROBS);
        return -EINVAL;
    }
    sampler_params spar;
    int rc = engine_sampling_to_params(sp, p, &spar, err, errlen);
    if (rc) return rc;

    ereq *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    if (seq_init(&r->s, 0, p->prompt, p->n_prompt, p->max_tokens) != 0) {
        free(r);
        return -ENOMEM;
    }
    r->p = *p;
    r->p.prompt = r->s.tokens;
    r->p.request_id = NULL;
    r->p.kv_transfer_params = NULL;
    if (p->n_stop_token_ids > 0) {
        r->stop_ids = malloc((size_t)p->n_stop_token_ids * sizeof *r->stop_ids);
        if (!r->stop_ids) {
            ereq_free(r);
            return -ENOMEM;
        }
        memcpy(r->stop_ids, p->stop_token_ids, (size_t)p->n_stop_token_ids * sizeof *r->stop_ids);
    }
    r->p.stop_token_ids = r->stop_ids;
    r->p.grammar = NULL;
    /* the sampler keeps its own copies of the logit processors' arrays */
    r->p.sampling.logit_bias_ids = NULL, r->p.sampling.logit_bias = NULL;
    r->p.sampling.allowed_token_ids = NULL;
    r->p.sampling.bad_word_ids = NULL, r->p.sampling.bad_word_lens = NULL;
    r->smp = sampler_init(&spar, e->vocab, p->prompt, p->n_prompt, err, errlen);
    if (!r->smp) {
        ereq_free(r);
        return -EINVAL;
    }
    if (p->grammar) {
        r->gm = grammar_ref(p->grammar);
        r->gs = grammar_start(r->gm);
    }
    if (sp->prompt_logprobs >= 0) {
        r->prompt_lp = calloc((size_t)p->n_prompt, sizeof *r->prompt_lp);
        if (!r->prompt_lp) {
            ereq_free(r);
            return -ENOMEM;
        }
        r->s.no_prefix_cache = 1; /* every prompt position must produce logits */
        r->s.max_chunk = PROMPT_LOGPROBS_CHUNK;
        r->prompt_lp_done = 1; /* position 0 has no logprob, only its id */
        r->prompt_lp[0].id = p->prompt[0];
    }
    r->fn = fn;
    r->ctx = ctx;
    r->t_arrival_ns = clock_now_ns();
    pthread_mutex_lock(&e->mu);
    r->s.id = ++e->next_id;
    pthread_mutex_unlock(&e->mu);
    if (p->kv_transfer_params && e->conn.classify) {
        int role = e->conn.classify(e->conn.ctx, r->s.id, p->kv_transfer_params, p->prompt,
                                    p->n_prompt, &r->kv_handle, err, errlen);
        if (role < 0) {
            ereq_free(r);
            return -EINVAL;
        }
        /* prompt logprobs compute every prompt position here anyway: no pool fetch (the
         * connector's handle is released with the request, nothing pulled) */
        r->pool_fetch = (role & KV_REQ_POOL_FETCH) && !r->prompt_lp;
        r->kv_role = role & ~KV_REQ_POOL_FETCH;
        r->needs_park = r->kv_role == KV_REQ_REMOTE_PREFILL || r->pool_fetch;
    }
    pthread_mutex_lock(&e->mu);
    r->s.owner = r;
    r->next = e->inbox;
    e->inbox = r;
    *id = r->s.id;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return 0;
}

void engine_abort(engine *e, uint64_t id) {
    pthread_mutex_lock(&e->mu);
    if (e->n_aborts == e->cap_aborts) {
        size_t cap = e->cap_aborts ? e->cap_aborts * 2 : 16;
        uint64_t *a = realloc(e->aborts, cap * sizeof *a);
        if (!a) {
            pthread_mutex_unlock(&e->mu);
            LOG_E(MOD, "out of memory queueing an abort for request %llu", (unsigned long long)id);
            return;
        }
        e->aborts = a;
        e->cap_aborts = cap;
    }
    e->aborts[e->n_aborts++] = id;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

static void push_note(engine *e, kv_note *n) {
    pthread_mutex_lock(&e->mu);
    n->next = e->notes;
    e->notes = n;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* A note about request id for the step thread (kind 0: load done, 1: release), or NULL after
 * logging what could not be reported. */
static kv_note *note_new(uint64_t id, int kind, const char *what) {
    kv_note *n = calloc(1, sizeof *n);
    if (!n) {
        LOG_E(MOD, "out of memory %s of request %llu", what, (unsigned long long)id);
        return NULL;
    }
    n->id = id;
    n->kind = kind;
    return n;
}

void engine_kv_load_done(engine *e, uint64_t id, int ok, int recompute, uint64_t hold_ns,
                         const char *error) {
    kv_note *n = note_new(id, 0, "reporting the KV load");
    if (!n) return;
    n->ok = ok;
    n->recompute = recompute;
    n->hold_ns = ok ? 0 : hold_ns;
    snprintf(n->error, sizeof n->error, "%s", error ? error : "remote KV load failed");
    push_note(e, n);
}

void engine_kv_load_done_first_token(engine *e, uint64_t id, int32_t token) {
    kv_note *n = note_new(id, 0, "reporting the KV load");
    if (!n) return;
    n->ok = 1;
    n->has_first = 1;
    n->first_token = token;
    push_note(e, n);
}

void engine_kv_load_done_streamed(engine *e, uint64_t id, int32_t token, int layerwise) {
    kv_note *n = note_new(id, 0, "reporting the KV load");
    if (!n) return;
    n->ok = 1;
    n->has_first = token >= 0;
    n->first_token = token;
    n->layerwise = layerwise;
    push_note(e, n);
}

void engine_kv_load_failed(engine *e, uint64_t id, int recompute, uint64_t hold_ns, int http_status,
                           const char *error) {
    kv_note *n = note_new(id, 0, "reporting the KV load");
    if (!n) return;
    n->recompute = recompute;
    n->hold_ns = hold_ns;
    n->http_status = http_status;
    snprintf(n->error, sizeof n->error, "%s", error ? error : "remote KV load failed");
    push_note(e, n);
}

void engine_kv_release(engine *e, uint64_t id) {
    kv_note *n = note_new(id, 1, "releasing the kept blocks");
    if (!n) return;
    push_note(e, n);
}

void engine_kv_load_done_prefix(engine *e, uint64_t id, int n_tokens) {
    kv_note *n = note_new(id, 0, "reporting the KV load");
    if (!n) return;
    n->ok = 1;
    n->n_tokens = n_tokens > 0 ? n_tokens : 0;
    push_note(e, n);
}

int engine_kv_pin_prefix(engine *e, uint64_t key, const int32_t *tokens, int n_tokens) {
    kv_note *n = note_new(0, 2, "pinning a cached prefix");
    if (!n) return -ENOMEM;
    n->key = key;
    n->n_tokens = n_tokens > 0 ? n_tokens : 0;
    n->tokens = malloc((size_t)(n->n_tokens ? n->n_tokens : 1) * sizeof *n->tokens);
    if (!n->tokens) {
        free(n);
        return -ENOMEM;
    }
    memcpy(n->tokens, tokens, (size_t)n->n_tokens * sizeof *tokens);
    push_note(e, n);
    return 0;
}

void engine_set_kv_connector(engine *e, const engine_kv_connector *c) {
    pthread_mutex_lock(&e->mu);
    if (c)
        e->conn = *c;
    else
        memset(&e->conn, 0, sizeof e->conn);
    /* before the first submit: the step thread runs no forward yet */
    if (e->conn.prefill_chunk && !e->lp)
        e->lp = backend_layer_progress_new(e->be, e->model.cfg.n_layers);
    if (!e->lp) e->conn.prefill_chunk = NULL; /* logged: the whole-request path only */
    pthread_mutex_unlock(&e->mu);
}

/* Which kernels compute: the CPU's ISA (chosen by cpuid or DISAGG_CPU_ISA) or the GPU's.
 * Results are bit-exact only between engines with the same kernels (docs/architecture.md). */
static const char *engine_kernels(const engine *e) {
    return backend_kernels_name(e->be);
}

/* FNV-1a (32 bit) of n bytes, continuing from h (2166136261u to start): the fingerprint's
 * short hashes */
static uint32_t fnv1a(uint32_t h, const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 16777619u;
    return h;
}

/* FNV-1a over the bits of every layer's k_scale and v_scale (each least significant byte first) */
static uint32_t engine_kv_scales_hash(const engine *e) {
    uint32_t h = 2166136261u;
    for (int l = 0; l < e->model.cfg.n_layers; l++)
        for (int which = 0; which < 2; which++) {
            float f = (which ? e->model.w.v_scale : e->model.w.k_scale)[l];
            uint32_t u;
            memcpy(&u, &f, 4);
            unsigned char b[4] = {(unsigned char)u, (unsigned char)(u >> 8),
                                  (unsigned char)(u >> 16), (unsigned char)(u >> 24)};
            h = fnv1a(h, b, 4);
        }
    return h;
}

/* FNV-1a of what the RoPE the cached K went through depends on: rope_theta and the scaling
 * parameters as config.json gives them (hex floats: exact), not the table computed from
 * them, whose last bits may differ between two machines' libm.  Two models of one shape whose
 * RoPE differs (Llama 3.0 and 3.1: llama3 scaling) hold different K for the same tokens. */
static uint32_t engine_rope_hash(const model_config *c) {
    const model_rope *r = &c->rope;
    char buf[512];
    int n = snprintf(buf, sizeof buf, "%.15s|%a|%a|%a|%a|%d|%a|%a|%d|%a|%d|%d",
                     r->type, (double)c->rope_theta, r->factor, r->low_freq_factor,
                     r->high_freq_factor, r->original_max_position, r->beta_fast, r->beta_slow,
                     r->truncate, r->attention_factor,
                     strcmp(r->type, "dynamic") ? 0 : c->max_position, c->head_dim);
    return fnv1a(2166136261u, (const unsigned char *)buf,
                 n < 0 ? 0 : n < (int)sizeof buf ? (size_t)n : sizeof buf - 1);
}

/* Rank 0 with shared worker regions (cfg.tp_kv_fds): size each rank's memfd to the region
 * (every rank holds as many blocks of as many heads) and map it. */
static int tp_kv_map(engine *e, char *err, size_t errlen) {
    if (!e->cfg.tp_group || !e->cfg.tp_kv_fds) return 0;
    if (!backend_is_cpu(e->be) || !backend_buffer_is_host(e->kv.buf)) {
        snprintf(err, errlen,
                 "--kv-transfer-config with --tensor-parallel-size %d on %s is not implemented "
                 "(each rank's device KV would need its own transfer engine); accepted: -tp > 1 "
                 "with a connector on the CPU, or -tp 1 on a GPU",
                 collective_size(e->cfg.tp_group), backend_name(e->be));
        return -ENOTSUP;
    }
    for (int r = 1; r < collective_size(e->cfg.tp_group); r++) {
        int fd = e->cfg.tp_kv_fds[r];
        void *p = MAP_FAILED;
        if (fd < 0 || ftruncate(fd, (off_t)e->kv_bytes) ||
            (p = mmap(NULL, e->kv_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) ==
                MAP_FAILED) {
            snprintf(err, errlen, "cannot map rank %d's shared KV region of %zu bytes: %s", r,
                     e->kv_bytes, fd < 0 ? "no memfd" : strerror(errno));
            return -ENOMEM;
        }
        e->tp_kv[r] = p;
    }
    return 0;
}

static void tp_kv_unmap(engine *e) {
    for (int r = 0; r < COLLECTIVE_MAX_RANKS; r++)
        if (e->tp_kv[r]) munmap(e->tp_kv[r], e->kv_bytes), e->tp_kv[r] = NULL;
}

int engine_tp_size(const engine *e) {
    return e->cfg.tp_group ? collective_size(e->cfg.tp_group) : 1;
}

int engine_get_kv_region_rank(const engine *e, int rank, engine_kv_region *out) {
    if (rank < 0 || rank >= engine_tp_size(e) || (rank > 0 && !e->tp_kv[rank])) return -ENOENT;
    engine_get_kv_region(e, out);
    if (rank > 0) out->base = e->tp_kv[rank];
    return 0;
}

void engine_get_kv_region(const engine *e, engine_kv_region *out) {
    const model_config *c = &e->model.cfg;
    memset(out, 0, sizeof *out);
    out->base = e->kv.base;
    out->bytes = e->kv_bytes;
    /* this rank's heads (model.local); the fingerprint names the model's total */
    out->block_bytes = decoder_kv_block_bytes_dt(&e->model.local, e->kv.block_size, e->kv.dtype);
    snprintf(out->location, sizeof out->location, "%s", backend_buffer_location(e->kv.buf));
    out->backend = backend_buffer_backend(e->kv.buf);
    static const char *const short_dt[] = {"f32", "f16", "bf16", "fp8e4m3"};
    out->n_blocks = e->kv.n_blocks;
    out->block_size = e->kv.block_size;
    char quirks[64] = ""; /* what else makes the KV differ: the RoPE, the window */
    size_t qn = (size_t)snprintf(quirks, sizeof quirks, ":rope%08x", engine_rope_hash(c));
    if (c->sliding_window)
        qn += (size_t)snprintf(quirks + qn, sizeof quirks - qn, ":swa%d", c->sliding_window);
    /* FP8 KV with checkpoint scales: the bytes mean e4m3 * scale, so a peer must have the same
     * scales (a hash of their bits; no field when every scale is 1.0, as vLLM's default) */
    if (e->kv.dtype == BACKEND_F8E4M3 && e->model.w.k_scale)
        snprintf(quirks + qn, sizeof quirks - qn, ":kvs%08x", engine_kv_scales_hash(e));
    snprintf(out->fingerprint, sizeof out->fingerprint,
             "%s:L%d:kvh%d:hd%d:bs%d:%s:layer-kv-token-major:v%d%s" ENGINE_KERNELS_TAG "%s",
             arch_family(c), c->n_layers, c->n_kv_heads, c->head_dim, e->kv.block_size,
             short_dt[e->kv.dtype], c->vocab_size, quirks, engine_kernels(e));
}

static ereq *find_live(engine *e, uint64_t id) {
    for (ereq *r = e->live; r; r = r->next)
        if (r->s.id == id) return r;
    return NULL;
}

/* A failed load whose producer may still write into r's blocks: move them
 * into quarantine (freed after hold_ns); r is left without KV. */
static void quarantine(engine *e, ereq *r, uint64_t hold_ns) {
    kept_blocks *k = calloc(1, sizeof *k);
    if (!k) return; /* no memory: the blocks go back now (the lesser evil than a leak) */
    sched_take_blocks(&e->sched, &r->s, &k->blocks, &k->n);
    k->expire_ns = clock_now_ns() + hold_ns;
    k->next = e->kept;
    e->kept = k;
    e->n_quarantined += k->n;
    LOG_W(
        MOD,
        "request %llu: its %d KV blocks stay out of use for %.0f s (the producer may still write)",
        (unsigned long long)r->s.id, k->n, (double)hold_ns / 1e9);
}

/* Free quarantined blocks whose time has come; the earliest pending expiry. */
static uint64_t expire_quarantine(engine *e) {
    uint64_t now = clock_now_ns(), next = 0;
    for (kept_blocks **pp = &e->kept; *pp;) {
        kept_blocks *k = *pp;
        if (k->expire_ns && k->expire_ns <= now) {
            *pp = k->next;
            block_pool_release(&e->bp, k->blocks, k->n);
            e->n_quarantined -= k->n;
            free(k->blocks);
            free(k);
            continue;
        }
        if (k->expire_ns && (!next || k->expire_ns < next)) next = k->expire_ns;
        pp = &k->next;
    }
    return next;
}

static int is_stop_token(const engine *e, const ereq *r, int32_t t);
static void deliver_token(engine *e, ereq *r, const engine_token *tok, int stop);

/* ---- structured outputs (grammar/) ------------------------------------------------ */

/* A constrained request's stop tokens: the model's eos and the request's stop ids
 * (allowed only where the grammar accepts; they end the request even with ignore_eos). */
static int grammar_is_stop(const engine *e, const ereq *r, int32_t t) {
    const model_config *c = &e->model.cfg;
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] == t) return 1;
    for (int i = 0; i < r->p.n_stop_token_ids; i++)
        if (r->stop_ids[i] == t) return 1;
    return 0;
}

/* r's grammar takes token t: 1 when t is a stop token where the grammar accepts (the
 * request ends), 0 when the grammar moved on, -1 when t breaks the grammar (state kept). */
static int grammar_take(engine *e, ereq *r, int32_t t) {
    if (grammar_is_stop(e, r, t)) return grammar_state_accepting(r->gm, r->gs) ? 1 : -1;
    grammar_state ns = grammar_advance_token(r->gm, r->gs, t);
    if (ns == GRAMMAR_DEAD) return -1;
    r->gs = ns;
    return 0;
}

/* The first-token handoff (engine_kv_load_done_first_token): 1 when r takes the
 * producer's token instead of recomputing its last prompt position. */
static int first_token_handoff(engine *e, ereq *r, int32_t token) {
    const char *why = NULL;
    if (token < 0 || token >= e->vocab)
        why = "the token is outside the vocabulary";
    else if (!r->p.first_token_handoff_ok)
        why = "the request has several output sequences (n > 1)";
    else if (r->p.sampling.logprobs >= 0 || r->p.sampling.prompt_logprobs >= 0)
        why = "the request asks for logprobs";
    else if (r->n_generated || r->s.n_tokens != r->s.n_prompt)
        why = "the request already has output";
    else if (r->gm && grammar_take(e, r, token) < 0) /* last: it advances the grammar */
        why = "the token breaks the request's grammar";
    if (why) {
        if (token < 0 || token >= e->vocab)
            LOG_W(MOD,
                  "request %llu: the producer's first token %d is not used (%s, %d ids); "
                  "recomputing the last prompt position",
                  (unsigned long long)r->s.id, token, why, e->vocab);
        else
            LOG_D(MOD, "request %llu: the producer's first token is not used (%s)",
                  (unsigned long long)r->s.id, why);
        pthread_mutex_lock(&e->mu);
        e->stats.first_token_refused++;
        pthread_mutex_unlock(&e->mu);
        return 0;
    }
    /* The producer's prefill sampled it from the same logits a colocated prefill
     * computes, with the same sampler: record it and skip the draw it cost. */
    int stop = (is_stop_token(e, r, token) && 1 > r->p.min_tokens) ||
               (r->gm && grammar_is_stop(e, r, token));
    sampler_accept_drawn(r->smp, token);
    seq_append(&r->s, token);
    sched_unpark(&e->sched, &r->s, r->s.n_prompt); /* no prompt position is computed here */
    if (!r->t_scheduled_ns) r->t_scheduled_ns = clock_now_ns();
    pthread_mutex_lock(&e->mu);
    e->stats.first_token_handoffs++;
    e->stats.generation_tokens++;
    pthread_mutex_unlock(&e->mu);
    LOG_D(MOD, "request %llu: first token %d from the producer (no recompute)",
          (unsigned long long)r->s.id, token);
    engine_token tok;
    memset(&tok, 0, sizeof tok);
    tok.id = token;
    deliver_token(e, r, &tok, stop);
    return 1;
}

/* engine_kv_pin_prefix on the step thread: the cached full blocks of n->tokens (the device
 * cache, then the tiers, as a request's admission walks them) are kept under a fresh id
 * and handed to the connector. */
static void pin_prefix(engine *e, const kv_note *n) {
    int bs = e->sched.cfg.block_size, full = n->n_tokens / bs, got = 0;
    int32_t *blocks = malloc((size_t)(full ? full : 1) * sizeof *blocks);
    uint64_t h = 0;
    for (int i = 0; blocks && e->cfg.enable_prefix_caching && i < full; i++) {
        uint64_t parent = h;
        h = block_pool_hash_tokens(parent, n->tokens + i * bs, bs);
        int32_t b = block_pool_lookup_tiered(&e->bp, parent, h, n->tokens + i * bs);
        if (b < 0) break;
        blocks[got++] = b;
    }
    kept_blocks *k = got ? calloc(1, sizeof *k) : NULL;
    uint64_t pin_id = 0;
    if (k) {
        pthread_mutex_lock(&e->mu);
        pin_id = ++e->next_id; /* request ids and pin ids share the counter: never equal */
        pthread_mutex_unlock(&e->mu);
        *k = (kept_blocks){.id = pin_id, .blocks = blocks, .n = got, .next = e->kept};
        e->kept = k;
        e->n_kept++;
    } else if (got) { /* no memory: nothing pinned */
        block_pool_release(&e->bp, blocks, got);
        got = 0;
    }
    if (e->conn.prefix_pinned) {
        e->conn.prefix_pinned(e->conn.ctx, n->key, pin_id, blocks, got);
    } else if (k) { /* nobody to hand them to */
        e->kept = k->next;
        e->n_kept--;
        block_pool_release(&e->bp, blocks, got);
        free(k);
        free(blocks);
    }
    if (!k) free(blocks);
}

static void handle_note(engine *e, const kv_note *n) {
    if (n->kind == 2) {
        pin_prefix(e, n);
        return;
    }
    if (n->kind == 1) {
        for (kept_blocks **pp = &e->kept; *pp; pp = &(*pp)->next)
            if ((*pp)->id == n->id) {
                kept_blocks *k = *pp;
                *pp = k->next;
                block_pool_release(&e->bp, k->blocks, k->n);
                free(k->blocks);
                free(k);
                e->n_kept--;
                return;
            }
        return;
    }
    ereq *r = find_live(e, n->id);
    if (!r || !r->loading) return;
    r->loading = 0;
    e->n_loading--;
    if (n->hold_ns) quarantine(e, r, n->hold_ns);
    if (r->zombie) { /* aborted meanwhile: now the blocks can go */
        finish(e, r, "abort", -1, NULL);
        return;
    }
    if (r->pool_fetch) { /* a prefix arrived (or none): the rest is computed here */
        int upto = n->ok ? n->n_tokens : 0;
        if (upto > r->s.n_prompt - 1) upto = r->s.n_prompt - 1; /* the last one gives logits */
        if (upto < r->s.n_cached) upto = r->s.n_cached;
        r->n_kv_received = upto - r->s.n_cached;
        if (!n->ok)
            LOG_I(MOD, "request %llu: pool fetch failed (%s); computing its prompt here",
                  (unsigned long long)r->s.id, n->error);
        sched_unpark(&e->sched, &r->s, upto);
        return;
    }
    if (n->ok) {
        /* the KV start_load() asked for: the prompt less the local prefix-cache hits */
        r->n_kv_received = r->s.n_prompt - r->s.n_cached;
        r->kv_layerwise = n->layerwise;
        if (r->prompt_lp && r->prompt_lp_done < r->s.n_prompt) {
            /* Prompt logprobs need every prompt position's logits, which the received
             * KV does not carry: compute the prompt here (the same positions, the same
             * values a colocated instance computes; the KV is rewritten identically). */
            LOG_D(MOD, "request %llu: computing its %d prompt positions for prompt_logprobs",
                  (unsigned long long)r->s.id, r->s.n_prompt);
            sched_unpark(&e->sched, &r->s, r->prompt_lp_done - 1);
        } else if (!n->has_first || !first_token_handoff(e, r, n->first_token))
            sched_unpark(&e->sched, &r->s, r->s.n_prompt - 1); /* recompute the last prompt token */
    } else if (n->recompute) {
        LOG_W(MOD,
              "request %llu: %s; computing its prompt locally (kv_load_failure_policy recompute)",
              (unsigned long long)r->s.id, n->error);
        sched_unpark(&e->sched, &r->s, r->s.n_cached);
    } else {
        r->error_status = n->http_status;
        finish(e, r, "error", -1, n->error);
    }
}

/* Consumers waiting for blocks: park them with blocks for the whole prompt
 * and ask the connector to fill them. */
static void park_consumers(engine *e) {
    for (ereq *r = e->live; r; r = r->next) {
        if (!r->needs_park) continue;
        sched_add(&e->sched, &r->s);
        if (sched_park_with_blocks(&e->sched, &r->s) != 0) { /* retry when blocks free up */
            sched_finish(&e->sched, &r->s, 0);
            continue;
        }
        r->needs_park = 0;
        e->n_parkwait--;
        r->loading = 1;
        e->n_loading++;
        e->conn.start_load(e->conn.ctx, r->kv_handle, r->s.id, r->s.blocks, r->s.n_blocks,
                           r->s.n_cached, r->s.n_prompt);
    }
}

/* ---- KV offload tiers: the block pool's lower tier ------------------------------- */

static void tier_evicted(void *ctx, int32_t block, uint64_t hash) {
    engine *e = ctx;
    if (kv_offload_store(e->off, hash, block))
        LOG_W(MOD, "copying evicted KV block %d to the host tier failed: it is dropped", block);
}

static int tier_load(void *ctx, uint64_t hash, int32_t block) {
    engine *e = ctx;
    int64_t h = kv_offload_lookup(e->off, hash);
    uint64_t t0 = clock_now_ns();
    if (h < 0 || kv_offload_load(e->off, h, block)) return -1;
    kv_load_cost_observe_load(&e->cost, (int)(h >> 32), e->cost.block_bytes, clock_now_ns() - t0);
    return 0;
}

static int tier_find(void *ctx, uint64_t hash) {
    engine *e = ctx;
    return kv_offload_find(e->off, hash);
}

static int tier_load_async(void *ctx, uint64_t hash, int32_t block, uint64_t tag) {
    engine *e = ctx;
    return kv_offload_load_async(e->off, hash, block, tag);
}

/* The tiers' loader thread: a load ended; the step thread reaps it (take_inputs). */
static void tier_load_ended(void *ctx) {
    engine *e = ctx;
    pthread_mutex_lock(&e->mu);
    e->off_ready = 1;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* The tier loads that ended: their blocks join the device cache and their requests, once
 * every copy of theirs ended, wait at the head of the queue (or the blocks go back: the
 * request was aborted meanwhile). */
static void reap_tier_loads(engine *e) {
    kv_offload_done d[64];
    int n;
    while ((n = kv_offload_reap(e->off, d, 64)) > 0)
        for (int k = 0; k < n; k++) {
            if (d[k].ok) kv_load_cost_observe_load(&e->cost, d[k].tier, e->cost.block_bytes, d[k].ns);
            ereq *r = find_live(e, d[k].tag);
            sched_load_done(&e->sched, r ? &r->s : NULL, d[k].block, d[k].ok);
        }
}

/* The environment's switches of the tiers' loads (docs/configuration.md). */
static int offload_env(engine *e, kv_offload_config *oc, char *err, size_t errlen) {
    if (kv_load_cost_configure(&e->cost, getenv("DISAGG_KV_OFFLOAD_COPY"),
                               getenv("DISAGG_KV_OFFLOAD_BANDWIDTH"), err, errlen))
        return -EINVAL;
    const char *lm = getenv("DISAGG_KV_OFFLOAD_LOADS");
    e->sched.async_loads = SCHED_LOADS_AUTO;
    if (lm && *lm) {
        if (strcmp(lm, "auto") && strcmp(lm, "async") && strcmp(lm, "sync")) {
            snprintf(err, errlen,
                     "DISAGG_KV_OFFLOAD_LOADS='%s' is not accepted (auto: tier copies estimated "
                     "under a tenth of a step on the step thread, the others on the loader "
                     "thread while the batch runs, the default; async: all on the loader "
                     "thread; sync: all on the step thread, for comparison)",
                     lm);
            return -EINVAL;
        }
        e->sched.async_loads = !strcmp(lm, "sync")    ? SCHED_LOADS_INLINE
                               : !strcmp(lm, "async") ? SCHED_LOADS_BACKGROUND
                                                      : SCHED_LOADS_AUTO;
        oc->sync_loads = !strcmp(lm, "sync"); /* no loader thread */
    }
    const char *dl = getenv("DISAGG_KV_OFFLOAD_LOAD_DELAY_MS");
    if (dl && *dl) {
        char *end;
        long v = strtol(dl, &end, 10);
        if (*end || v < 0 || v > 60000) {
            snprintf(err, errlen,
                     "DISAGG_KV_OFFLOAD_LOAD_DELAY_MS='%s' is not accepted (an integer in [0, "
                     "60000]: milliseconds each tier load waits first, a slow medium for tests "
                     "and benchmarks; 0, the default: none)",
                     dl);
            return -EINVAL;
        }
        oc->load_delay_ms = (unsigned)v;
    }
    const char *wm = getenv("DISAGG_KV_OFFLOAD_WRITES");
    if (wm && *wm) {
        if (strcmp(wm, "async") && strcmp(wm, "sync")) {
            snprintf(err, errlen,
                     "DISAGG_KV_OFFLOAD_WRITES='%s' is not accepted (async: disk writes on the "
                     "tiers' writer thread, the default; sync: on the step thread, for "
                     "comparison)",
                     wm);
            return -EINVAL;
        }
        oc->sync_writes = !strcmp(wm, "sync");
    }
    const char *wq = getenv("DISAGG_KV_OFFLOAD_WRITE_QUEUE");
    if (wq && *wq) {
        char *end;
        long v = strtol(wq, &end, 10);
        if (*end || v < 1 || v > 4096) {
            snprintf(err, errlen,
                     "DISAGG_KV_OFFLOAD_WRITE_QUEUE='%s' is not accepted (an integer in [1, "
                     "4096]: disk writes queued at most, each one block's buffer; default: "
                     "%zu MiB of buffers, 16 to 4096 blocks)",
                     wq, KV_OFFLOAD_WRITE_QUEUE_BYTES >> 20);
            return -EINVAL;
        }
        oc->write_queue = (int)v;
    }
    const char *wd = getenv("DISAGG_KV_OFFLOAD_WRITE_DELAY_MS");
    if (wd && *wd) {
        char *end;
        long v = strtol(wd, &end, 10);
        if (*end || v < 0 || v > 60000) {
            snprintf(err, errlen,
                     "DISAGG_KV_OFFLOAD_WRITE_DELAY_MS='%s' is not accepted (an integer in [0, "
                     "60000]: milliseconds each disk write waits first, a slow disk for tests "
                     "and benchmarks; 0, the default: none)",
                     wd);
            return -EINVAL;
        }
        oc->write_delay_ms = (unsigned)v;
    }
    const char *dio = getenv("DISAGG_KV_OFFLOAD_DIRECT_IO");
    if (dio && *dio) {
        if (strcmp(dio, "auto") && strcmp(dio, "on") && strcmp(dio, "off")) {
            snprintf(err, errlen,
                     "DISAGG_KV_OFFLOAD_DIRECT_IO='%s' is not accepted (auto: O_DIRECT where the "
                     "filesystem accepts it and is not memory (tmpfs), the default; on: O_DIRECT "
                     "or the start fails; off: buffered through the page cache)",
                     dio);
            return -EINVAL;
        }
        oc->direct_io = !strcmp(dio, "on")    ? KV_DIRECT_IO_ON
                        : !strcmp(dio, "off") ? KV_DIRECT_IO_OFF
                                              : KV_DIRECT_IO_AUTO;
    }
    return 0;
}

static int offload_init(engine *e, const model_config *mc, size_t block_bytes, char *err,
                        size_t errlen) {
    const engine_config *c = &e->cfg;
    if (c->kv_offload_disk_bytes && !c->kv_offload_disk_dir) {
        snprintf(err, errlen, "--kv-offloading-disk-size needs the directory of the disk tier: "
                              "give --kv-offloading-disk DIR too");
        return -EINVAL;
    }
    if (!c->kv_offload_bytes) {
        if (c->kv_offload_disk_dir) {
            snprintf(err, errlen, "--kv-offloading-disk needs the host tier above it: give "
                                  "--kv-offloading-size too");
            return -EINVAL;
        }
        return 0;
    }
    if (!c->enable_prefix_caching) {
        snprintf(err, errlen,
                 "--kv-offloading-size needs the prefix cache (its block hashes key the tiers), "
                 "which --no-enable-prefix-caching turns off; accepted: one or the other");
        return -EINVAL;
    }
    if (c->kv_offload_disk_dir && !c->kv_offload_disk_bytes) {
        snprintf(err, errlen, "--kv-offloading-disk '%s' needs --kv-offloading-disk-size GiB",
                 c->kv_offload_disk_dir);
        return -EINVAL;
    }
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psz > 0 && c->kv_offload_bytes > (size_t)pages / 10 * 9 * (size_t)psz) {
        /* the CPU backend reserves it lazily: a size past memory would start and be killed by
         * the OOM killer later; pinned memory (CUDA) would fail at once, less clearly */
        snprintf(err, errlen,
                 "--kv-offloading-size %.2f GiB is more than 90%% of this machine's memory "
                 "(%.2f GiB); accepted: a host tier that fits in memory",
                 (double)c->kv_offload_bytes / (1 << 30),
                 (double)pages * (double)psz / (1 << 30));
        return -EINVAL;
    }
    kv_offload_config oc = {
        c->kv_offload_bytes,
        c->kv_offload_disk_dir,
        c->kv_offload_disk_bytes,
        block_bytes,
        kv_offload_layout_key(engine_model_dir(e), mc->n_layers, mc->n_kv_heads, mc->head_dim,
                              backend_dtype_name(e->kv.dtype), e->kv.block_size, block_bytes),
        e->kv.block_size,
        0,
        0,
        0,
        0,
        0,
        KV_DIRECT_IO_AUTO,
    };
    kv_load_cost_init(&e->cost, block_bytes, e->kv.block_size);
    int rc = offload_env(e, &oc, err, errlen);
    if (rc) return rc;
    e->off_st = backend_stream_create(e->be);
    if (!e->off_st) {
        snprintf(err, errlen, "cannot create a stream for the KV offload copies");
        return -ENOMEM;
    }
    if (kv_offload_create(&oc, e->off_st, e->kv.base, &e->off, err, errlen)) return -EINVAL;
    kv_offload_set_events(e->off, &e->events);
    kv_offload_set_notify(e->off, tier_load_ended, e);
    e->bp.tier = (block_pool_tier){e, tier_evicted, tier_load, tier_find, tier_load_async};
    e->sched.cost = &e->cost;
    static const char *const where[] = {"on the step thread (DISAGG_KV_OFFLOAD_LOADS=sync)",
                                        "inline when under a tenth of a step, else on the loader",
                                        "on the loader thread (DISAGG_KV_OFFLOAD_LOADS=async)"};
    LOG_I(MOD,
          "KV offload loads: %s, copy %s (a block: %.1f us from the host tier, %.1f us from the "
          "disk, %.1f us to recompute, until measured)",
          where[e->sched.async_loads],
          e->cost.policy == KV_LOAD_POLICY_ALWAYS ? "always" : "when faster than the prefill",
          1e6 * kv_load_cost_copy_s(&e->cost, KV_TIER_HOST),
          1e6 * kv_load_cost_copy_s(&e->cost, KV_TIER_DISK), 1e6 * kv_load_cost_recompute_s(&e->cost));
    return 0;
}

/* ---- KV cache events ------------------------------------------------------------- */

void engine_set_kv_event_sink(engine *e, const engine_kv_event_sink *sink) {
    pthread_mutex_lock(&e->mu);
    if (sink && sink->publish)
        e->sink = *sink;
    else
        memset(&e->sink, 0, sizeof e->sink);
    pthread_mutex_unlock(&e->mu);
}

void engine_reset_prefix_cache(engine *e) {
    pthread_mutex_lock(&e->mu);
    e->reset_cache = 1;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

static void reset_cache(engine *e) {
    if (block_pool_reset_cache(&e->bp)) {
        LOG_W(MOD, "reset_prefix_cache refused: cached blocks are in use by running requests");
        return;
    }
    if (e->off) kv_offload_clear(e->off);
    LOG_I(MOD, "prefix cache reset");
}

/* Hand this step's events to the sink (under mu: the sink may be detached). */
static void flush_events(engine *e) {
    if (e->events.oom) LOG_W(MOD, "out of memory recording KV cache events: some were lost");
    if (e->events.n) {
        pthread_mutex_lock(&e->mu);
        if (e->sink.publish) e->sink.publish(e->sink.ctx, &e->events);
        pthread_mutex_unlock(&e->mu);
    }
    kv_events_reset(&e->events);
}

/* ---- the step ----------------------------------------------------------------- */

static void publish_stats(engine *e) {
    pthread_mutex_lock(&e->mu);
    e->stats.num_running = e->sched.n_running;
    e->stats.num_waiting = e->sched.n_waiting + e->sched.n_loading; /* as vLLM: waiting for KV */
    e->stats.num_parked = e->sched.n_parked;
    e->stats.num_blocks = e->bp.num_blocks;
    e->stats.num_blocks_used = block_pool_num_used(&e->bp);
    e->stats.prefix_queries = e->bp.queries;
    e->stats.prefix_hits = e->bp.hits;
    e->stats.prefix_evictions = e->bp.evictions;
    e->stats.num_preemptions = e->sched.num_preemptions;
    e->stats.num_kept = e->n_kept;
    if (e->off) {
        e->stats.has_offload = 1;
        kv_offload_get_stats(e->off, &e->stats.offload);
        e->stats.offload_queries = e->bp.ext_queries;
        e->stats.offload_hits = e->bp.ext_hits;
        e->stats.offload_loading = e->sched.n_loading;
        e->stats.offload_steps_during_loads = e->steps_during_loads;
        e->stats.offload_load_waits = e->sched.loads_waited;
        e->stats.offload_load_wait_ns = e->sched.load_wait_ns;
        for (int t = 0; t < KV_TIER_COUNT; t++) {
            e->stats.offload_bps[t] = e->cost.tier_bps[t];
            e->stats.offload_declined[t] = e->cost.declined[t];
        }
        e->stats.offload_prefill_tps = e->cost.prefill_tps;
        e->stats.offload_probes = e->cost.probes;
    }
    e->stats.num_loading = e->n_loading;
    pthread_mutex_unlock(&e->mu);
}

/* Take the inbox (oldest first) and the aborts. */
static void take_inputs(engine *e) {
    uint64_t next_expiry = expire_quarantine(e);
    publish_stats(e); /* blocks may have been freed: /metrics must see it even if we sleep now */
    pthread_mutex_lock(&e->mu);
    /* asleep when nothing can run: no request, or only ones waiting for blocks that tier
     * copies hold (the end of a copy wakes it: off_ready) */
    while (!e->stop && !e->inbox && !e->notes && e->n_aborts == 0 && e->sched.n_running == 0 &&
           (e->sched.n_waiting == 0 || e->stalled_on_loads) && !e->reset_cache && !e->off_ready) {
        if (!next_expiry) {
            pthread_cond_wait(&e->cv, &e->mu);
            continue;
        }
        if (clock_now_ns() >= next_expiry) break;
        struct timespec ts = clock_to_timespec(next_expiry); /* cv is on CLOCK_MONOTONIC */
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
    }
    int reset = e->reset_cache;
    e->reset_cache = 0;
    ereq *in = e->inbox;
    e->inbox = NULL;
    kv_note *notes = e->notes;
    e->notes = NULL;
    int off_ready = e->off_ready;
    e->off_ready = 0;
    size_t na = e->n_aborts;
    uint64_t *ab = NULL;
    if (na) {
        ab = malloc(na * sizeof *ab);
        if (ab) memcpy(ab, e->aborts, na * sizeof *ab);
        e->n_aborts = 0;
    }
    pthread_mutex_unlock(&e->mu);
    ereq *rev = NULL; /* the inbox is LIFO: reverse to FCFS */
    while (in) {
        ereq *n = in->next;
        in->next = rev;
        rev = in;
        in = n;
    }
    while (rev) {
        ereq *n = rev->next;
        rev->next = e->live;
        e->live = rev;
        if (rev->needs_park) {
            rev->s.state = SEQ_FINISHED; /* in no scheduler list until parked */
            e->n_parkwait++;
        } else {
            sched_add(&e->sched, &rev->s);
        }
        rev = n;
    }
    for (size_t i = 0; ab && i < na; i++) {
        ereq *r = find_live(e, ab[i]);
        if (r && !r->zombie) finish(e, r, "abort", -1, NULL);
    }
    free(ab);
    if (off_ready) reap_tier_loads(e);
    if (reset) reset_cache(e);
    kv_note *rn = NULL; /* notes are LIFO: handle in arrival order */
    while (notes) {
        kv_note *n = notes->next;
        notes->next = rn;
        rn = notes;
        notes = n;
    }
    while (rn) {
        kv_note *n = rn->next;
        handle_note(e, rn);
        free(rn->tokens);
        free(rn);
        rn = n;
    }
    park_consumers(e);
}

static int is_stop_token(const engine *e, const ereq *r, int32_t t) {
    if (!r->p.ignore_eos) {
        const model_config *c = &e->model.cfg;
        for (int i = 0; i < c->n_eos; i++)
            if (c->eos_ids[i] == t) return 1;
    }
    for (int i = 0; i < r->p.n_stop_token_ids; i++)
        if (r->stop_ids[i] == t) return 1;
    return 0;
}

/* Fill prompt logprobs for positions [from, from + n) from logits rows. */
static void fill_prompt_logprobs(engine *e, ereq *r, const float *rows, int first_pos, int n) {
    for (int k = 0; k < n; k++) {
        int target = first_pos + k + 1; /* row k predicts the token at first_pos + k + 1 */
        if (target >= r->s.n_prompt || target < r->prompt_lp_done) continue;
        engine_token *t = &r->prompt_lp[target];
        t->id = r->s.tokens[target];
        row_logprobs(rows + (size_t)k * (size_t)e->vocab, e->vocab, t->id,
                     r->p.sampling.prompt_logprobs, t);
        r->prompt_lp_done = target + 1;
    }
}

/* tok (already appended to r's tokens) is r's next output: count it, send it,
 * end r on a stop id (stop) or at its length. */
static void deliver_token(engine *e, ereq *r, const engine_token *tok, int stop) {
    r->n_generated++;
    r->t_last_token_ns = clock_now_ns();
    if (!r->t_first_token_ns) r->t_first_token_ns = r->t_last_token_ns;
    engine_token t = *tok;
    t.stop = stop;
    engine_event ev = {.kind = ENGINE_EV_TOKEN, .id = r->s.id, .token = &t};
    r->fn(r->ctx, &ev);
    if (stop)
        finish(e, r, "stop", tok->id, NULL);
    else if (r->n_generated >= r->p.max_tokens || r->s.n_tokens >= e->max_model_len)
        finish(e, r, "length", -1, NULL);
}

/* 1 when item it's constrained row is masked on the device (decoder_seq.allow): its logits
 * come back masked (or, greedy, only the argmax), which gives the host path's tokens exactly,
 * but its raw logprobs would be those of the masked row, so a request that wants logprobs (or
 * prompt logprobs) keeps the host path. */
static int device_masked(const engine *e, const ereq *r, const sched_item *it, int on) {
    (void)e;
    return on && r->gm && it->logits && !r->prompt_lp && r->p.sampling.logprobs < 0;
}

/* The mask hook of the decoder (decoder_state_set_mask_hook): the masks are needed now. */
static void join_masks(void *ctx) {
    engine *e = ctx;
    mask_worker_join(e->masks);
}

/* Draws the next token of this step's k-th host-sampled item (e->sidx[k]) from its logits
 * row, in place, into e->sres (mask_worker_fn: runs on any of the sampling threads). */
static void sample_item(void *ctx, int k) {
    engine *e = ctx;
    int i = e->sidx[k];
    const sched_item *it = &e->plan.items[i];
    ereq *r = it->s->owner;
    float *last = e->fwd[i].logits;
    if (e->fwd[i].logits_all) last += (size_t)(it->count - 1) * (size_t)e->vocab;
    if (r->gm && e->fwd[i].allow) /* masked on the device already, no logprobs wanted */
        sampler_sample_premasked(r->smp, last, r->gmask, &e->sres[i]);
    else if (r->gm)
        sampler_sample_masked(r->smp, last, r->gmask, &e->sres[i]);
    else
        sampler_sample(r->smp, last, &e->sres[i]);
}

static void run_step(engine *e) {
    sched_plan *pl = &e->plan;
    int planned = sched_step(&e->sched, pl);
    e->stalled_on_loads = !planned && e->sched.n_loading > 0;
    if (!planned) return;
    uint64_t t_step = clock_now_ns(); /* the scheduled time of requests first in this plan */
    int n = pl->n_items;
    int k_logits = 0;
    pthread_mutex_lock(&e->mu);
    int overlap = e->grammar_overlap, dev_mask = e->grammar_device_mask;
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < n; i++) {
        const sched_item *it = &pl->items[i];
        ereq *r = it->s->owner;
        decoder_seq *f = &e->fwd[i];
        f->tokens = it->s->tokens + it->start;
        f->n_tokens = it->count;
        f->start_pos = it->start;
        f->block_table = it->s->blocks;
        f->n_blocks = it->s->n_blocks;
        f->logits_all = r->prompt_lp && it->start < r->s.n_prompt;
        f->argmax = NULL;
        f->allow = NULL; /* set below with the masks */
        if (f->logits_all)
            f->logits = e->plogits; /* only one such item per step (see below) */
        else if (it->logits && sampler_plain_greedy(r->smp) &&
                 (r->gm ? device_masked(e, r, it, dev_mask) : e->dev_greedy)) {
            /* greedy, no logprobs, no penalties: only the id comes back (a constrained row's
             * argmax over its masked logits, on every backend) */
            f->logits = NULL;
            f->argmax = &e->amax[i];
        } else
            f->logits = it->logits ? e->logits + (size_t)(k_logits++) * (size_t)e->vocab : NULL;
    }
    /* At most one prompt-logprob chunk per forward: the workspace holds one. */
    int seen = 0;
    for (int i = 0; i < n; i++)
        if (e->fwd[i].logits_all && seen++) {
            e->fwd[i].logits_all = 0;
            e->fwd[i].logits = NULL;
            pl->items[i].count = 0; /* deferred: recomputed next step */
        }
    int m = 0; /* drop deferred items */
    for (int i = 0; i < n; i++) {
        if (pl->items[i].count == 0) continue;
        pl->items[m] = pl->items[i];
        e->fwd[m] = e->fwd[i];
        m++;
    }
    pl->n_items = n = m;
    /* The constrained rows' masks (the state's allowed tokens, and the stop tokens where
     * the grammar accepts) are filled by the mask worker while the forward runs, then
     * joined before sampling; their states do not move until the tokens are sampled.
     * Rows masked on the device get their bitmasks in the model's page-locked mask rows (row k
     * for the k-th such item), which the forward uploads as they are once it has joined the
     * worker (join_masks, after the head is enqueued). */
    mask_worker_reset(e->masks);
    uint32_t *dev_rows = decoder_state_mask_rows(e->state, n); /* cap max_num_seqs: no alloc */
    size_t words = ((size_t)e->vocab + 31) / 32;
    int n_dev_masked = 0;
    for (int i = 0; i < n; i++) {
        const sched_item *it = &pl->items[i];
        ereq *r = it->s->owner;
        if (!(it->logits && r->gm)) continue;
        uint32_t *dst = dev_rows && device_masked(e, r, it, dev_mask)
                            ? dev_rows + (size_t)n_dev_masked++ * words
                            : NULL;
        r->gmask = mask_worker_add(e->masks, r->gm, r->gs, r->stop_ids, r->p.n_stop_token_ids, dst);
        e->fwd[i].allow = dst ? r->gmask : NULL;
    }
    uint64_t step = ++e->step_seq;
    if (e->lp && e->conn.prefill_chunk) { /* the connector streams prefill chunks of remote-decode
                                             requests by layer */
        backend_layer_progress_begin(e->lp, step);
        for (int i = 0; i < n; i++) {
            const sched_item *it = &pl->items[i];
            ereq *r = it->s->owner;
            if (r->kv_role != KV_REQ_REMOTE_DECODE || it->start >= r->s.n_prompt) continue;
            int end = it->start + it->count < r->s.n_prompt ? it->start + it->count : r->s.n_prompt;
            e->conn.prefill_chunk(e->conn.ctx, r->kv_handle, r->s.id, r->s.blocks, r->s.n_blocks,
                                  it->start, end, r->s.n_prompt, step, e->lp);
        }
    }
    mask_worker_start(e->masks, overlap);
    if (e->off && kv_offload_busy(e->off) > 0) e->steps_during_loads++; /* the copies overlap it */
    uint64_t t_fwd = clock_now_ns();
    int rc = decoder_forward(&e->model, e->state, &e->kv, e->fwd, n);
    uint64_t t_fwd_end = clock_now_ns();
    backend_layer_progress_end(e->lp, step); /* synced (or failed): every layer is done */
    mask_worker_join(e->masks);
    uint64_t t_sample = clock_now_ns(); /* the rest of the step: sampling and delivery */
    if (rc != 0 && e->cfg.tp_group) /* the ranks may be out of step now: the group cannot go on */
        collective_poison(e->cfg.tp_group, "rank 0's forward failed");
    if (rc != 0) {
        for (int i = 0; i < n; i++)
            finish(e, pl->items[i].s->owner, "error", -1, "model forward failed");
        return;
    }
    sched_commit(&e->sched, pl);
    /* Draw the host-sampled rows first, in place (nothing reads a logits row after its draw;
     * the sampler takes the logprobs from the raw row before it changes it), on the step
     * thread and the sampling threads: each row's sampler is its own request's, so the draws
     * do not depend on which thread made them.  Delivered in item order below. */
    int n_sample = 0;
    for (int i = 0; i < n; i++) {
        ereq *r = pl->items[i].s->owner;
        if (pl->items[i].logits && !e->fwd[i].argmax && !(r->gm && !r->gmask))
            e->sidx[n_sample++] = i;
    }
    if (e->sample_threads > 1)
        mask_worker_run(e->masks, n_sample, sample_item, e);
    else
        for (int k = 0; k < n_sample; k++)
            sample_item(e, k);
    uint64_t gen = 0, prompt = 0;
    for (int i = 0; i < n; i++) {
        const sched_item *it = &pl->items[i];
        ereq *r = it->s->owner;
        if (!r->t_scheduled_ns) r->t_scheduled_ns = t_step;
        if (it->start < r->s.n_prompt) {
            int np =
                (it->start + it->count < r->s.n_prompt ? it->start + it->count : r->s.n_prompt) -
                it->start;
            prompt += (uint64_t)np;
            r->n_prompt_computed += np;
        }
        if (e->fwd[i].logits_all) /* rows before the last: its draw did not touch them */
            fill_prompt_logprobs(e, r, e->fwd[i].logits, it->start, it->count);
        if (!it->logits) continue;
        engine_token tok;
        memset(&tok, 0, sizeof tok);
        if (r->gm && !r->gmask) {
            finish(e, r, "error", -1, "no memory for the request's grammar mask");
            continue;
        }
        if (e->fwd[i].argmax) { /* the device's greedy pick (no logprobs were asked for) */
            tok.id = *e->fwd[i].argmax;
            if (r->gm && !(r->gmask[tok.id >> 5] >> (tok.id & 31) & 1u)) {
                /* every allowed logit was -inf or NaN: the host sampler's choice, the first
                 * allowed token */
                int32_t t = 0;
                while (t < e->vocab && !(r->gmask[t >> 5] >> (t & 31) & 1u))
                    t++;
                if (!e->warned_mask_pick++) /* finite logits never land here: say so once */
                    LOG_W(MOD,
                          "the device's greedy pick %d of a constrained row is not in its mask "
                          "(every allowed logit -inf or NaN, or the mask was not applied): took "
                          "the first allowed token, %d",
                          tok.id, t);
                tok.id = t < e->vocab ? t : tok.id;
            }
            sampler_accept(r->smp, tok.id);
        } else {
            const sample_result *sr = &e->sres[i]; /* drawn above */
            tok.id = sr->token;
            tok.logprob = sr->logprob;
            tok.n_top = sr->n_top;
            memcpy(tok.top_ids, sr->top_ids, sizeof tok.top_ids);
            memcpy(tok.top_logprobs, sr->top_logprobs, sizeof tok.top_logprobs);
        }
        int gstop = r->gm ? grammar_take(e, r, tok.id) : 0;
        if (gstop < 0) { /* cannot happen: the mask allowed it */
            finish(e, r, "error", -1, "the sampled token breaks the request's grammar");
            continue;
        }
        int stop = gstop || (is_stop_token(e, r, tok.id) && r->n_generated + 1 > r->p.min_tokens);
        if (r->kv_role == KV_REQ_REMOTE_DECODE && r->n_generated == 0 && e->conn.first_token)
            e->conn.first_token(e->conn.ctx, r->kv_handle, r->s.id, tok.id); /* for the decoder */
        seq_append(&r->s, tok.id);
        gen++;
        deliver_token(e, r, &tok, stop);
    }
    /* the prefill rate the tiers' copies are weighed against: steps with a block's worth of
     * prompt tokens (decode-only steps run far fewer tokens a second) */
    if (e->off && prompt >= (uint64_t)e->cfg.block_size)
        kv_load_cost_observe_prefill(&e->cost, prompt + gen, t_fwd_end - t_fwd);
    if (e->off) kv_load_cost_observe_step(&e->cost, t_fwd_end - t_fwd);
    int mrows;
    uint64_t mfill, mwait, t_end = clock_now_ns();
    mask_worker_last(e->masks, &mrows, &mfill, &mwait);
    pthread_mutex_lock(&e->mu);
    e->stats.prompt_tokens += prompt;
    e->stats.generation_tokens += gen;
    e->stats.steps++;
    e->stats.step_ns += t_end - t_step;
    e->stats.forward_ns += t_fwd_end - t_fwd;
    e->stats.sample_ns += t_end - t_sample;
    if (prompt >= (uint64_t)e->cfg.block_size && prompt * 10 >= (prompt + gen) * 9) {
        e->stats.prefill_forward_ns += t_fwd_end - t_fwd; /* a prefill step */
        e->stats.prefill_forward_tokens += prompt + gen;
    }
    if (mrows) {
        e->stats.grammar_steps++;
        e->stats.grammar_rows += (uint64_t)mrows;
        e->stats.grammar_device_rows += (uint64_t)n_dev_masked;
        e->stats.grammar_fill_ns += mfill;
        e->stats.grammar_wait_ns += mwait;
        e->stats.grammar_step_ns += t_end - t_step;
        e->stats.grammar_forward_ns += t_fwd_end - t_fwd;
        e->stats.grammar_sample_ns += t_end - t_sample;
    }
    {
        static const double bounds[] = ENGINE_STEP_TOKEN_BOUNDS;
        int b = 0;
        while (b < ENGINE_STEP_TOKEN_NB && (double)(prompt + gen) > bounds[b])
            b++;
        e->stats.step_tokens_buckets[b]++;
        e->stats.step_tokens_sum += prompt + gen;
    }
    pthread_mutex_unlock(&e->mu);
}

static void *step_main(void *arg) {
    engine *e = arg;
    for (;;) {
        take_inputs(e);
        pthread_mutex_lock(&e->mu);
        int stop = e->stop;
        pthread_mutex_unlock(&e->mu);
        if (stop) break;
        run_step(e);
        flush_events(e);
        publish_stats(e);
    }
    while (e->live)
        finish(e, e->live, "abort", -1, NULL);
    publish_stats(e);
    return NULL;
}

/* ---- lifecycle ---------------------------------------------------------------- */

int engine_create(const engine_config *cfg, engine **out, char *err, size_t errlen) {
    engine_config c = *cfg;
    if (c.block_size < 0 || c.block_size > 1024) {
        snprintf(err, errlen,
                 "block size %d is out of range (accepted: 1..1024, or 0 for auto: 128 on the "
                 "CPU, 16 on CUDA)",
                 c.block_size);
        return -EINVAL;
    }
    if (c.max_num_seqs <= 0 || c.max_num_batched_tokens <= 0) {
        snprintf(err, errlen, "max_num_seqs and max_num_batched_tokens must be positive");
        return -EINVAL;
    }
    const char *ov = getenv("DISAGG_GRAMMAR_OVERLAP");
    if (ov && *ov) {
        if (strcmp(ov, "0") != 0 && strcmp(ov, "1") != 0) {
            snprintf(err, errlen,
                     "DISAGG_GRAMMAR_OVERLAP='%s' is not accepted (0: grammar masks filled before "
                     "the forward, serially; 1: while the forward runs, the default)",
                     ov);
            return -EINVAL;
        }
        c.grammar_overlap = ov[0] == '1';
    }
    const char *dm = getenv("DISAGG_GRAMMAR_DEVICE_MASK");
    if (dm && *dm) {
        if (strcmp(dm, "0") != 0 && strcmp(dm, "1") != 0) {
            snprintf(err, errlen,
                     "DISAGG_GRAMMAR_DEVICE_MASK='%s' is not accepted (1: constrained rows masked "
                     "on the device, greedy ones picked there, the default; 0: their logits "
                     "come to the host and the sampler masks them)",
                     dm);
            return -EINVAL;
        }
        c.grammar_device_mask = dm[0] == '1';
    }
    int sample_threads = 0; /* 0: the backend's default, below */
    const char *st = getenv("DISAGG_SAMPLE_THREADS");
    if (st && *st) {
        char *end;
        long v = strtol(st, &end, 10);
        if (*end || v < 1 || v > 256) {
            snprintf(err, errlen,
                     "DISAGG_SAMPLE_THREADS='%s' is not accepted (an integer in [1, 256]: the "
                     "threads that sample a step's host-sampled rows; 1: the step thread alone, "
                     "the default on the CPU; on CUDA the default is min(8, CPUs / 2))",
                     st);
            return -EINVAL;
        }
        sample_threads = (int)v;
    }
    engine *e = calloc(1, sizeof *e);
    if (!e) return -ENOMEM;
    e->cfg = c;
    e->sample_threads = sample_threads;
    backend_options bo;
    backend_options_init(&bo);
    bo.n_threads = c.threads;
    bo.progress = c.progress;
    bo.batch_invariant = c.batch_invariant;
    int rc = backend_open(c.device, &bo, &e->be, err, errlen);
    if (rc) {
        free(e);
        return rc;
    }
    if (c.tp_group && !backend_is_cpu(e->be) &&
        (rc = collective_attach_nccl(c.tp_group, e->be, 0, err, errlen))) {
        collective_poison(c.tp_group, "rank 0 could not join NCCL");
        backend_close(e->be);
        free(e);
        return rc;
    }
    if (c.block_size == 0) e->cfg.block_size = c.block_size = backend_block_size_default(e->be);
    /* what the device has free before this instance loads anything: what it uses later is
     * measured against it (--gpu-memory-utilization is this instance's budget) */
    size_t free_before = 0, total_before = 0;
    backend_memory(e->be, &free_before, &total_before);
    rc = decoder_load_tp(&e->model, c.model, e->be, c.progress,
                         (c.load_dummy ? DECODER_LOAD_DUMMY : 0) |
                             (c.quant_fp8 ? DECODER_LOAD_FP8 : 0),
                         c.tp_group, err, errlen);
    if (rc) {
        if (c.tp_group) collective_poison(c.tp_group, "rank 0 could not load the model");
        backend_close(e->be);
        free(e);
        return rc;
    }
    const model_config *mc = &e->model.cfg;
    e->vocab = mc->vocab_size;
    e->max_model_len = c.max_model_len > 0 ? c.max_model_len : mc->max_position;
    if (e->max_model_len > mc->max_position) {
        snprintf(err, errlen, "max_model_len %d exceeds the model's max_position_embeddings %d",
                 e->max_model_len, mc->max_position);
        rc = -EINVAL;
        goto fail;
    }
    if (c.max_num_batched_tokens < c.max_num_seqs) e->cfg.max_num_batched_tokens = c.max_num_seqs;
    backend_dtype kv_dt =
        c.kv_cache_dtype < 0 ? backend_kv_dtype_default(e->be) : (backend_dtype)c.kv_cache_dtype;
    if (!backend_kv_dtype_ok(e->be, kv_dt)) {
        snprintf(err, errlen, "--kv-cache-dtype %s is not supported on %s (auto: %s)",
                 backend_dtype_name(kv_dt), backend_name(e->be),
                 backend_dtype_name(backend_kv_dtype_default(e->be)));
        rc = -EINVAL;
        goto fail;
    }
    /* the GPU's FP8 KV kernels: not in the batch-invariant attention nor the sliding-window
     * one (kernels/cuda/cuda_invariant.cu, cuda_window.cu): refused here, not at the first
     * request */
    if (kv_dt == BACKEND_F8E4M3 && !backend_is_cpu(e->be) &&
        (c.batch_invariant || mc->sliding_window)) {
        snprintf(err, errlen,
                 "--kv-cache-dtype fp8 is not implemented on %s with %s; accepted there: "
                 "--kv-cache-dtype auto, bfloat16 or float32",
                 backend_name(e->be),
                 c.batch_invariant ? "--batch-invariant" : "a sliding-window model");
        rc = -EINVAL;
        goto fail;
    }
    /* a TP rank's blocks hold its KV heads (model.local) */
    const model_config *kc = &e->model.local;
    size_t block_bytes = decoder_kv_block_bytes_dt(kc, c.block_size, kv_dt), mem_total = 0,
           mem_free = 0;
    /* activations first: on a GPU the KV cache gets what is left (vLLM's
     * --gpu-memory-utilization: weights + activations + KV <= that fraction of the device) */
    e->state = decoder_state_create(&e->model, e->cfg.max_num_batched_tokens);
    if (e->state && !backend_is_cpu(e->be)) {
        /* decode steps of up to max_num_seqs sequences as CUDA graphs, unless --enforce-eager */
        /* a step with collectives on the NCCL stream is not recorded */
        int nb =
            c.enforce_eager || c.tp_group ? 0 : decoder_state_set_graphs(e->state, c.max_num_seqs);
        if (nb > 0)
            LOG_I(MOD, "decode steps of 1..%d sequences as CUDA graphs (%d batch-size buckets)",
                  c.max_num_seqs < e->cfg.max_num_batched_tokens ? c.max_num_seqs
                                                                 : e->cfg.max_num_batched_tokens,
                  nb);
        else
            LOG_I(MOD, "every step eager%s", c.enforce_eager ? " (--enforce-eager)" : "");
        if (c.batch_invariant)
            LOG_I(MOD, "batch-invariant kernels (--batch-invariant): a request's tokens do not "
                       "depend on the batch or the prompt's chunking");
    }
    if (e->state && backend_is_cpu(e->be) && c.batch_invariant)
        LOG_I(MOD, "batch-invariant requested: the CPU kernels always are (nothing to switch)");
    backend_memory(e->be, &mem_free, &mem_total);
    size_t want =
        c.kv_cache_bytes ? c.kv_cache_bytes : (size_t)((double)mem_total * c.kv_cache_fraction);
    if (!backend_is_cpu(e->be) && !c.kv_cache_bytes) {
        gpu_budget_in bi = {.total = mem_total,
                            .free_before = free_before,
                            .free_now = mem_free,
                            .utilization = c.gpu_memory_utilization,
                            .reserve = (size_t)512 << 20}; /* cuBLASLt, attention scratch, logits */
        gpu_budget_out bo2;
        char berr[768];
        if (gpu_budget_kv(&bi, &bo2, berr, sizeof berr)) {
            snprintf(err, errlen, "%s: %s", backend_name(e->be), berr);
            rc = -EINVAL;
            goto fail;
        }
        want = bo2.kv_bytes;
        LOG_I(MOD,
              "%s: this instance uses %.2f GB for weights and activations (other processes "
              "%.2f GB, %.2f GB free of %.2f GB); --gpu-memory-utilization %.2f leaves %.2f GB "
              "for its KV cache",
              backend_name(e->be), (double)bo2.own / 1e9, (double)bo2.others / 1e9,
              (double)mem_free / 1e9, (double)mem_total / 1e9, c.gpu_memory_utilization,
              (double)want / 1e9);
    }
    size_t nblocks = want / block_bytes;
    size_t min_blocks = (size_t)(e->max_model_len + c.block_size - 1) / (size_t)c.block_size;
    if (nblocks < min_blocks) {
        snprintf(err, errlen,
                 "KV cache of %zu bytes holds %zu blocks of %zu bytes, fewer than one max-length "
                 "request "
                 "needs (%zu): raise %s or lower --max-model-len",
                 want, nblocks, block_bytes, min_blocks,
                 backend_is_cpu(e->be) || c.kv_cache_bytes ? "--kv-cache-memory"
                                                           : "--gpu-memory-utilization");
        rc = -EINVAL;
        goto fail;
    }
    if (nblocks > INT32_MAX / 2) nblocks = INT32_MAX / 2;
    e->kv_bytes = nblocks * block_bytes;
    /* the backend allocates the region (CPU: an anonymous mapping with huge pages) */
    if (kv_store_init_on(&e->kv, e->be, kc, (int)nblocks, c.block_size, kv_dt, BACKEND_BUF_KV)) {
        snprintf(err, errlen, "cannot allocate a KV cache of %zu bytes on %s", e->kv_bytes,
                 backend_name(e->be));
        rc = -ENOMEM;
        goto fail;
    }
    e->fwd = calloc((size_t)c.max_num_seqs, sizeof *e->fwd);
    e->logits_hb = backend_buffer_alloc(e->be, (size_t)c.max_num_seqs * (size_t)e->vocab * sizeof(float),
                                        BACKEND_BUF_HOST);
    e->logits = e->logits_hb ? backend_buffer_ptr(e->logits_hb) : NULL;
    e->plogits = malloc((size_t)PROMPT_LOGPROBS_CHUNK * (size_t)e->vocab * sizeof(float));
    e->sidx = malloc((size_t)c.max_num_seqs * sizeof *e->sidx);
    e->sres = malloc((size_t)c.max_num_seqs * sizeof *e->sres);
    if (!e->sample_threads) { /* the default: see DISAGG_SAMPLE_THREADS in engine.h */
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        e->sample_threads = backend_is_cpu(e->be) || ncpu < 4 ? 1 : ncpu / 2 < 8 ? (int)(ncpu / 2) : 8;
    }
    e->masks = mask_worker_new(e->vocab, mc->eos_ids, mc->n_eos,
                               e->sample_threads > 1 ? e->sample_threads - 1 : 1);
    e->grammar_overlap = c.grammar_overlap;
    e->grammar_device_mask = c.grammar_device_mask;
    if (e->state) { /* the device-masked rows' page-locked bitmasks, one per sequence */
        decoder_state_set_mask_hook(e->state, join_masks, e);
        if (!decoder_state_mask_rows(e->state, c.max_num_seqs)) {
            snprintf(err, errlen, "cannot allocate %d page-locked grammar mask rows on %s",
                     c.max_num_seqs, backend_name(e->be));
            rc = -ENOMEM;
            goto fail;
        }
    }
    e->amax = calloc((size_t)c.max_num_seqs, sizeof *e->amax);
    /* on the CPU the logits are already in host memory: the host sampler's greedy is free */
    e->dev_greedy = !backend_is_cpu(e->be);
    sched_config sc = {c.block_size, c.max_num_seqs, e->cfg.max_num_batched_tokens,
                       c.enable_prefix_caching};
    if (!e->state || !e->fwd || !e->logits || !e->plogits || !e->sidx || !e->sres || !e->amax || !e->masks ||
        block_pool_init(&e->bp, (int32_t)nblocks) || sched_init(&e->sched, &sc, &e->bp) ||
        sched_plan_init(&e->plan, &sc)) {
        snprintf(err, errlen, "out of memory setting up the engine");
        rc = -ENOMEM;
        goto fail;
    }
    e->bp.block_size = c.block_size;
    e->bp.events = &e->events; /* recorded always; published when a sink is attached */
    if (c.tp_group && (c.kv_offload_bytes || c.kv_offload_disk_dir)) {
        snprintf(err, errlen,
                 "--kv-offloading-size / --kv-offloading-disk with -tp > 1 are not implemented (the "
                 "tiers would copy rank 0's KV heads only); accepted: the tiers at -tp 1");
        rc = -EINVAL;
        goto fail;
    }
    if ((rc = offload_init(e, mc, block_bytes, err, errlen))) goto fail;
    if ((rc = tp_kv_map(e, err, errlen))) goto fail;
    if (c.tp_group) { /* the other ranks make the same region and workspace */
        tp_init_msg im = {(int32_t)nblocks, c.block_size, (int32_t)kv_dt,
                          e->cfg.max_num_batched_tokens, e->tp_kv[1] != NULL};
        if ((rc = tp_step_send_init(c.tp_group, &im))) {
            snprintf(err, errlen, "the tensor-parallel ranks are gone (%s)", strerror(-rc));
            goto fail;
        }
        LOG_I(MOD, "tensor parallelism: rank 0 of %d (%d of %d query heads, %d of %d KV heads)",
              e->model.tp->size, e->model.tp->n_heads, mc->n_heads, e->model.tp->n_kv_heads,
              mc->n_kv_heads);
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&e->thread, NULL, step_main, e) != 0) {
        snprintf(err, errlen, "cannot start the engine thread");
        rc = -ENOMEM;
        goto fail;
    }
    if (backend_is_cpu(e->be)) LOG_I(MOD, "cpu kernels: %s", backend_kernels_describe(e->be));
    LOG_I(MOD,
          "model %s on %s (%s kernels): %d layers, hidden %d, vocab %d; KV cache %zu blocks x %d "
          "tokens (%zu tokens, %.1f MiB, %s)",
          e->model.dir, backend_name(e->be), engine_kernels(e), mc->n_layers, mc->hidden_size,
          e->vocab, nblocks, c.block_size, nblocks * (size_t)c.block_size,
          (double)e->kv_bytes / (1 << 20), backend_dtype_name(kv_dt));
    if (kv_dt == BACKEND_F8E4M3)
        LOG_I(MOD, "FP8 KV cache: e4m3 with per-tensor scales %s",
              e->model.w.k_scale ? "k_scale / v_scale from the checkpoint"
                                 : "1.0 (the checkpoint has no k_scale / v_scale)");
    else if (e->model.w.k_scale)
        LOG_I(MOD, "the checkpoint's k_scale / v_scale are not used: the KV cache is %s "
              "(they apply to --kv-cache-dtype fp8)", backend_dtype_name(kv_dt));
    *out = e;
    return 0;
fail:
    if (c.tp_group) collective_poison(c.tp_group, "rank 0's engine did not start");
    sched_plan_free(&e->plan);
    kv_offload_destroy(e->off);
    backend_stream_free(e->off_st);
    block_pool_free_all(&e->bp);
    kv_events_free(&e->events);
    free(e->fwd);
    backend_buffer_free(e->logits_hb);
    free(e->plogits);
    free(e->sidx);
    free(e->sres);
    mask_worker_free(e->masks);
    free(e->amax);
    if (e->state) decoder_state_free(e->state);
    tp_kv_unmap(e);
    kv_store_free(&e->kv);
    decoder_free(&e->model);
    backend_close(e->be);
    free(e);
    return rc;
}

void engine_destroy(engine *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    if (e->cfg.tp_group && !collective_poisoned(e->cfg.tp_group))
        tp_step_send_stop(e->cfg.tp_group); /* the workers leave their loops */
    while (e->inbox) {                      /* submitted after the loop ended */
        ereq *r = e->inbox;
        e->inbox = r->next;
        emit_finish(e, r, "abort", -1, NULL);
        ereq_free(r);
    }
    while (e->kept) { /* blocks kept for pulls or in quarantine */
        kept_blocks *k = e->kept;
        e->kept = k->next;
        free(k->blocks);
        free(k);
    }
    while (e->notes) {
        kv_note *n = e->notes;
        e->notes = n->next;
        free(n->tokens);
        free(n);
    }
    free(e->aborts);
    sched_plan_free(&e->plan);
    sched_free(&e->sched);
    kv_offload_destroy(e->off);
    backend_stream_free(e->off_st);
    block_pool_free_all(&e->bp);
    kv_events_free(&e->events);
    free(e->fwd);
    backend_buffer_free(e->logits_hb);
    free(e->plogits);
    free(e->sidx);
    free(e->sres);
    mask_worker_free(e->masks);
    free(e->amax);
    decoder_state_free(e->state);
    backend_layer_progress_free(e->lp);
    tp_kv_unmap(e);
    kv_store_free(&e->kv);
    decoder_free(&e->model);
    backend_close(e->be);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
}

void engine_set_grammar_overlap(engine *e, int on) {
    pthread_mutex_lock(&e->mu);
    e->grammar_overlap = on ? 1 : 0;
    pthread_mutex_unlock(&e->mu);
}

void engine_set_grammar_device_mask(engine *e, int on) {
    pthread_mutex_lock(&e->mu);
    e->grammar_device_mask = on ? 1 : 0;
    pthread_mutex_unlock(&e->mu);
}

void engine_get_stats(engine *e, engine_stats *out) {
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    pthread_mutex_unlock(&e->mu);
    snprintf(out->kernels, sizeof out->kernels, "%s", engine_kernels(e));
    out->sample_threads = e->sample_threads;
}

const struct model_config *engine_model_config(const engine *e) {
    return &e->model.cfg;
}
const char *engine_model_dir(const engine *e) {
    return e->model.dir;
}
int engine_max_model_len(const engine *e) {
    return e->max_model_len;
}

int engine_vocab_size(const engine *e) {
    return e->vocab;
}

int engine_block_size(const engine *e) {
    return e->cfg.block_size;
}
