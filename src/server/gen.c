/*
 * gen — generation request lifecycle (see gen.h).
 */
#include "server/gen.h"
#include "server/beam_search.h"

#include "engine/kv_connector.h"

#include "base/clock.h"
#include "base/http_server.h"
#include "base/log.h"
#include "connector/mooncake/mooncake_connector.h"
#include "model/sampler.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* One engine event copied off the engine thread. */
typedef struct gen_event {
    struct gen_event *next;              /* queue link */
    gen_choice *c;                       /* the choice it belongs to */
    engine_event_kind kind;              /* TOKEN or FINISHED */
    engine_token tok;                    /* TOKEN: the token */
    char finish_reason[16];              /* FINISHED */
    int32_t stop_token;                  /* FINISHED: eos/stop id or -1 */
    char *error;                         /* FINISHED with "error" */
    int error_status;                    /* its HTTP status (0 = 500) */
    int n_prompt, n_cached, n_generated; /* FINISHED: usage */
    int n_tier_cached;                   /* FINISHED: of n_cached, from the offload tiers */
    int kv_role, n_kv_recv, n_computed;  /* FINISHED: P/D accounting */
    int kv_layerwise;                    /* FINISHED: the KV came layer by layer */
    metrics_request timing;              /* FINISHED: the engine's timeline */
    engine_token *prompt_lp;             /* (n_prompt) prompt logprobs, or NULL */
} gen_event;

/* ---- the engine thread side ---------------------------------------------- */

void gen_engine_event_fn(void *ctx, const engine_event *ev) {
    gen_choice *c = ctx;
    server *s = c->r->s;
    gen_event *g = calloc(1, sizeof *g);
    if (!g) {
        LOG_E("server", "out of memory queueing an engine event; request %s will hang", c->r->id);
        return;
    }
    g->c = c;
    g->kind = ev->kind;
    if (ev->kind == ENGINE_EV_TOKEN) {
        g->tok = *ev->token;
    } else {
        snprintf(g->finish_reason, sizeof g->finish_reason, "%s",
                 ev->finish_reason ? ev->finish_reason : "error");
        g->stop_token = ev->stop_token;
        g->error = ev->error ? strdup(ev->error) : NULL;
        g->error_status = ev->error_status;
        g->n_prompt = ev->n_prompt;
        g->n_cached = ev->n_cached;
        g->n_tier_cached = ev->n_tier_cached;
        g->n_generated = ev->n_generated;
        g->kv_role = ev->kv_role;
        g->n_kv_recv = ev->n_kv_received;
        g->kv_layerwise = ev->kv_layerwise;
        g->n_computed = ev->n_prompt_computed;
        g->timing.t_queued_ns = ev->t_queued_ns;
        g->timing.t_scheduled_ns = ev->t_scheduled_ns;
        g->timing.t_first_token_ns = ev->t_first_token_ns;
        g->timing.t_last_token_ns = ev->t_last_token_ns;
        if (ev->prompt_logprobs && ev->n_prompt > 0) {
            g->prompt_lp = malloc((size_t)ev->n_prompt * sizeof *g->prompt_lp);
            if (g->prompt_lp)
                memcpy(g->prompt_lp, ev->prompt_logprobs,
                       (size_t)ev->n_prompt * sizeof *g->prompt_lp);
        }
    }
    pthread_mutex_lock(&s->q_lock);
    if (s->q_tail)
        s->q_tail->next = g;
    else
        s->q_head = g;
    s->q_tail = g;
    pthread_mutex_unlock(&s->q_lock);
    event_active(s->wake, EV_READ, 0);
}

/* ---- request allocation ---------------------------------------------------- */

gen_req *gen_req_new(server *s, hs_req *http, bool chat, const gen_ops *ops) {
    gen_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->s = s;
    r->http = http;
    r->chat = chat;
    r->ops = ops;
    r->t_arrival = clock_now_ns();
    r->created = (long long)time(NULL);
    const char *xr = http_head_get(hs_req_head(http), "X-Request-Id");
    if (xr && *xr) {
        r->x_request_id = strndup(xr, 120);
        snprintf(r->id, sizeof r->id, "%s-%s", chat ? "chatcmpl" : "cmpl", r->x_request_id);
    } else {
        uint64_t a = ++s->next_id, b = clock_now_ns();
        snprintf(r->id, sizeof r->id, "%s-%016llx%016llx", chat ? "chatcmpl" : "cmpl",
                 (unsigned long long)b, (unsigned long long)(a * 0x9E3779B97F4A7C15ull));
    }
    return r;
}

int gen_prepare_constraint(server *s, gen_req *r) {
    char err[1024] = "";
    int tool_fmt = 0;
    if (structured_from_request(s->gcache, r->o.body, r->o.kind == OAI_CHAT, s->tool_grammar,
                                &r->constraint, &tool_fmt, err, sizeof err)) {
        const char *param = strstr(err, "tool") == err ? "tool_choice" : NULL;
        oai_error_set(&r->err, 400, "BadRequestError", param, "%s", err);
        return -1;
    }
    if (r->constraint && r->o.use_beam_search) {
        oai_error_set(
            &r->err, 400, "BadRequestError", "tool_choice",
            "a constrained output (tool_choice \"required\" or a named tool) is not "
            "applied by beam search; accepted with use_beam_search: \"auto\" or \"none\"");
        return -1;
    }
    if (tool_fmt) r->o.parse_tool_calls = true;
    /* a format that starts with a special token ([TOOL_CALLS]) needs its text (vLLM's mistral
     * parser sets skip_special_tokens=False the same way) */
    if (r->o.parse_tool_calls && s->tools->special_token) r->o.skip_special_tokens = false;
    return 0;
}

/* One bad word's variant (text) tokenized and appended, unless it is vLLM's skipped case:
 * the prefix-space variant is kept only when it tokenizes to as many tokens as the plain one
 * and starts with a different token. */
static int bad_word_add(server *s, gen_req *r, const char *text, size_t len, int prefix_variant,
                        int *n_seq, int *n_tok, int *cap) {
    int32_t *ids = NULL;
    size_t n = 0;
    char msg[256];
    if (tokenizer_encode(s->tok, text, len, false, &ids, &n, msg, sizeof msg)) {
        oai_error_set(&r->err, 400, "BadRequestError", "bad_words", "bad_words: %s", msg);
        return -1;
    }
    oai_request *o = &r->o;
    int last_len = *n_seq ? o->bad_word_lens[*n_seq - 1] : 0;
    int keep = n > 0 && (!prefix_variant ||
                         ((int)n == last_len && ids[0] != o->bad_word_ids[*n_tok - last_len]));
    if (keep && *n_tok + (int)n > SAMPLER_MAX_BAD_TOKENS) {
        free(ids);
        oai_error_set(&r->err, 400, "BadRequestError", "bad_words",
                      "'bad_words' tokenize to more than %d tokens in all; accepted: at most %d",
                      SAMPLER_MAX_BAD_TOKENS, SAMPLER_MAX_BAD_TOKENS);
        return -1;
    }
    if (keep) {
        if (*n_tok + (int)n > *cap) {
            int ncap = (*n_tok + (int)n) * 2;
            int32_t *g = realloc(o->bad_word_ids, (size_t)ncap * sizeof *g);
            if (!g) {
                free(ids);
                oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
                return -1;
            }
            o->bad_word_ids = g, *cap = ncap;
        }
        memcpy(o->bad_word_ids + *n_tok, ids, n * sizeof *ids);
        *n_tok += (int)n;
        o->bad_word_lens[(*n_seq)++] = (int32_t)n;
    }
    free(ids);
    return 0;
}

int gen_prepare_bad_words(server *s, gen_req *r) {
    oai_request *o = &r->o;
    if (o->n_bad_words == 0) return 0;
    o->bad_word_lens = malloc((size_t)o->n_bad_words * 2 * sizeof *o->bad_word_lens);
    if (!o->bad_word_lens) {
        oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
        return -1;
    }
    int n_seq = 0, n_tok = 0, cap = 0;
    for (int i = 0; i < o->n_bad_words; i++) {
        /* vLLM: the word with its leading spaces stripped, then " " + it (a word at the start
         * of the text and in its middle are different tokens) */
        const char *w = o->bad_words[i];
        while (*w == ' ')
            w++;
        size_t wl = strlen(w);
        char *sp = malloc(wl + 2);
        if (!sp) {
            oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
            return -1;
        }
        sp[0] = ' ';
        memcpy(sp + 1, w, wl + 1);
        int rc = bad_word_add(s, r, w, wl, 0, &n_seq, &n_tok, &cap);
        if (!rc) rc = bad_word_add(s, r, sp, wl + 1, 1, &n_seq, &n_tok, &cap);
        free(sp);
        if (rc) return -1;
    }
    o->sampling.bad_word_ids = o->bad_word_ids;
    o->sampling.bad_word_lens = o->bad_word_lens;
    o->sampling.n_bad_words = n_seq;
    return 0;
}

void gen_req_free(gen_req *r) {
    if (!r) return;
    for (int i = 0; i < r->n_ch; i++) {
        gen_choice *c = &r->ch[i];
        detok_stream_free(&c->ds);
        sbuf_free(&c->text);
        json_decref(c->logprobs);
        json_decref(c->stop_reason);
        json_decref(c->prompt_logprobs);
        json_decref(c->echo_logprobs);
        free(c->error);
    }
    free(r->ch);
    beam_search_free(r->beam);
    if (r->ext_free) r->ext_free(r->ext);
    grammar_unref(r->constraint);
    for (int i = 0; i < r->n_prompts; i++) {
        if (r->pids) free(r->pids[i]);
        if (r->ptext) free(r->ptext[i]);
    }
    free(r->pids);
    free(r->n_pids);
    free(r->ptext);
    free(r->ptext_len);
    free(r->x_request_id);
    free(r->kv_params_text);
    oai_request_free(&r->o);
    free(r);
}

static void gen_abort_all(gen_req *r, const char *why);

/* Reply r->err on http in the endpoint's error shape. */
static void gen_reply_error(gen_req *r, hs_req *http) {
    json_t *b = r->ops->error_body ? r->ops->error_body(r, &r->err) : NULL;
    if (b)
        server_reply_json(http, r->err.status, b, r->x_request_id);
    else
        server_reply_error(http, &r->err, r->x_request_id);
}

/* ---- output ------------------------------------------------------------------ */

/* The client left (base/http_server sees it at once: it keeps reading while
 * a request is served); the request is freed after this returns. */
static void gen_close_cb(hs_req *http, void *arg) {
    gen_req *r = arg;
    r->http = NULL;
    r->detached = true;
    if (r->client_gone) return;
    r->client_gone = true;
    gen_abort_all(r, "client disconnected");
}

void gen_send_chunk(gen_req *r, sbuf *sse) {
    if (sse->len == 0) return;
    if (!r->client_gone && r->streaming && r->http) {
        struct evbuffer *b = evbuffer_new();
        if (b) {
            evbuffer_add(b, sse->data, sse->len);
            (void)hs_reply_data(r->http, b); /* no backpressure: the stream is bounded */
            evbuffer_free(b);
        }
    }
    sbuf_reset(sse);
}

void gen_usage(const gen_req *r, oai_usage *u) {
    memset(u, 0, sizeof *u);
    for (int p = 0; p < r->n_prompts; p++)
        u->prompt_tokens += r->n_pids[p];
    for (int i = 0; i < r->n_ch; i++) { /* every sequence generated, also best_of's dropped */
        u->completion_tokens += r->ch[i].n_tokens;
        if (r->ch[i].seq == 0) u->cached_tokens += r->ch[i].n_cached;
        if (r->ch[i].kv_role) u->kv_transfer = true;
        if (r->ch[i].kv_role == KV_REQ_REMOTE_PREFILL) u->kv_pulled = true;
        if (r->ch[i].kv_layerwise) u->kv_layerwise = true;
        u->received_tokens += r->ch[i].n_kv_received;
        u->computed_tokens += r->ch[i].n_prompt_computed;
    }
}

static int cmp_best(const void *a, const void *b) {
    const gen_choice *x = a, *y = b;
    if (x->prompt != y->prompt) return x->prompt - y->prompt;
    if (x->cum_logprob != y->cum_logprob) return x->cum_logprob > y->cum_logprob ? -1 : 1;
    return x->seq - y->seq;
}

/* best_of > n (vLLM's): per prompt, the n sequences of highest cumulative logprob (ties: the
 * earlier sequence) become choices p * n .. p * n + n - 1 in that order; the others are
 * dropped from the response (their tokens still count in usage).  The choices are reordered
 * so: every engine callback has ended. */
static void gen_choose_best_of(gen_req *r) {
    int n = r->o.n, k = r->o.best_of;
    if (k <= n) return;
    qsort(r->ch, (size_t)r->n_ch, sizeof *r->ch, cmp_best);
    for (int i = 0; i < r->n_ch; i++) {
        gen_choice *c = &r->ch[i];
        int rank = i % k;
        c->dropped = rank >= n;
        c->index = c->prompt * n + rank;
    }
}

static void gen_free_and_account(gen_req *r) {
    server *s = r->s;
    s->n_live--;
    if (r->prev)
        r->prev->next = r->next;
    else
        s->live = r->next;
    if (r->next) r->next->prev = r->prev;
    gen_req_free(r);
}

static void gen_abort_all(gen_req *r, const char *why) {
    int n = 0;
    for (int i = 0; i < r->n_ch && r->s->eng; i++)
        if (r->ch[i].submitted && !r->ch[i].engine_done) {
            engine_abort(r->s->eng, r->ch[i].eid);
            n++;
        }
    if (r->s->eng) beam_search_abort(r);
    LOG_I("server", "%s: %s, aborted %d engine request(s)", r->id, why, n);
}

/* Every engine request has finished: send what is left and free. */
static void gen_complete(gen_req *r) {
    if (r->client_gone || !r->http) { /* nobody to answer: the HTTP request is freed */
        gen_free_and_account(r);
        return;
    }
    hs_req_set_close_cb(r->http, NULL, NULL);
    if (r->streaming) {
        sbuf sse;
        sbuf_init(&sse, (size_t)1 << 30);
        if (r->ops->stream_end) {
            r->ops->stream_end(r, &sse);
        } else {
            if (r->o.include_usage) {
                oai_usage u;
                gen_usage(r, &u);
                oai_sse_event(&sse,
                              oai_usage_chunk(r->chat, r->id, r->created, r->s->model_name, &u));
            }
            oai_sse_done(&sse);
        }
        gen_send_chunk(r, &sse);
        sbuf_free(&sse);
        hs_reply_end(r->http);
    } else if (r->has_err) {
        gen_reply_error(r, r->http);
    } else {
        gen_choose_best_of(r);
        json_t *body = r->ops->build_response(r);
        if (body)
            server_reply_json(r->http, 200, body, r->x_request_id);
        else
            server_reply_errorf(r->http, 500, "InternalServerError", NULL,
                                "out of memory rendering the response");
    }
    if (r->s->cfg.log_requests) {
        oai_usage u;
        gen_usage(r, &u);
        LOG_I("server", "%s: %d choice(s), prompt %d tokens, completion %d tokens, %.3f s", r->id,
              r->n_ch, u.prompt_tokens, u.completion_tokens,
              (double)(clock_now_ns() - r->t_arrival) / 1e9);
    }
    gen_free_and_account(r);
}

/* The HTTP status and OpenAI error type of a choice that ended in error: the
 * engine's (a KV load names 400 / 502 / 503 / 504), else 500. */
static int gen_error_status(const gen_choice *c) {
    int s = c->error_status;
    return s >= 400 && s <= 599 ? s : 500;
}

static const char *gen_error_type(const gen_choice *c) {
    return http_error_type(gen_error_status(c)); /* the engine's: 400, 500, 502, 503, 504 */
}

/* The choice produced its last output. */
static void gen_choice_done(gen_choice *c, const char *reason) {
    gen_req *r = c->r;
    c->out_done = true;
    c->finish_reason = reason;
    server_metrics *m = &r->s->metrics;
    uint64_t now = clock_now_ns();
    m->finished[metrics_finish_of(reason)]++;
    metrics_observe(&m->e2e, (double)(now - r->t_arrival) / 1e9);
    if (c->n_tokens > 1)
        metrics_observe(&m->tpot, (double)(c->t_last - c->t_first) / 1e9 / (c->n_tokens - 1));
    if (r->streaming && !r->client_gone) {
        sbuf sse;
        sbuf_init(&sse, (size_t)1 << 30);
        if (c->error) {
            oai_error e;
            oai_error_set(&e, gen_error_status(c), gen_error_type(c), NULL, "%s", c->error);
            if (r->ops->stream_error) {
                r->ops->stream_error(r, &e, &sse);
            } else {
                char *j = oai_error_json(&e);
                if (j) sbuf_appendf(&sse, "data: %s\n\n", j);
                free(j);
            }
        } else {
            r->ops->stream_finish(r, c, &sse);
        }
        gen_send_chunk(r, &sse);
        sbuf_free(&sse);
    }
}

void gen_choice_emit(gen_choice *c, const char *reason) {
    gen_req *r = c->r;
    if (r->streaming && !r->client_gone && !c->error && c->text.len > c->sent) {
        sbuf sse;
        sbuf_init(&sse, (size_t)1 << 30);
        r->ops->stream_delta(r, c, c->text.data + c->sent, c->text.len - c->sent, &sse);
        gen_send_chunk(r, &sse);
        sbuf_free(&sse);
    }
    gen_choice_done(c, reason);
}

/* Submit choice c to the engine (with the request's kv_transfer_params when
 * with_kv); on failure r->err is set.  0 or a negative error. */
static int gen_submit(gen_req *r, gen_choice *c, bool with_kv) {
    engine_request_params p;
    memset(&p, 0, sizeof p);
    p.prompt = r->pids[c->prompt];
    p.n_prompt = r->n_pids[c->prompt];
    p.max_tokens = c->max_tokens;
    p.min_tokens = r->o.min_tokens;
    p.ignore_eos = r->o.ignore_eos;
    p.stop_token_ids = r->o.stop_token_ids;
    p.n_stop_token_ids = r->o.n_stop_token_ids;
    p.sampling = r->o.sampling;
    /* choice i of a prompt samples with seed + i, here and on every instance */
    if (p.sampling.has_seed) p.sampling.seed += (uint64_t)c->seq;
    p.request_id = r->id;
    p.kv_transfer_params = with_kv ? r->kv_params_text : NULL;
    p.first_token_handoff_ok =
        r->o.best_of == 1; /* n > 1: choice 0 recomputes (its siblings share its blocks) */
    p.grammar = r->constraint;
    char err[512] = "";
    int rc = engine_submit(r->s->eng, &p, gen_engine_event_fn, c, &c->eid, err, sizeof err);
    if (rc) {
        r->has_err = true;
        oai_error_set(&r->err, rc == -EINVAL ? 400 : 500,
                      rc == -EINVAL ? "BadRequestError" : "InternalServerError", NULL, "%s",
                      err[0] ? err : "the engine refused the request");
        return rc;
    }
    c->submitted = true;
    r->n_pending++;
    return 0;
}

/* Choice 0 produced its first token (its prompt KV is computed or pulled, and
 * cached): submit the deferred choices; they find its prompt blocks in the
 * prefix cache.  Or choice 0 ended without one (error set, or abort): end them
 * the same way. */
static void gen_release_deferred(gen_req *r, bool submit, const char *error) {
    if (r->n_deferred == 0) return;
    r->n_deferred = 0;
    for (int i = 0; i < r->n_ch; i++) {
        gen_choice *c = &r->ch[i];
        if (!c->deferred) continue;
        c->deferred = false;
        if (submit && !r->client_gone && !r->has_err && gen_submit(r, c, false) == 0) continue;
        const char *why = error ? error : r->has_err ? r->err.message : NULL;
        if (why) c->error = strdup(why);
        c->engine_done = true;
        gen_choice_done(c, why ? "error" : "abort");
    }
}

static void gen_add_logprobs(gen_choice *c, const engine_token *t) {
    gen_req *r = c->r;
    if (r->o.logprobs < 0) return;
    if (!c->logprobs) c->logprobs = r->chat ? oai_chat_logprobs_new() : oai_cmpl_logprobs_new();
    if (r->chat)
        oai_chat_logprobs_add(c->logprobs, t, r->o.logprobs, &r->namer);
    else
        oai_cmpl_logprobs_add(c->logprobs, t, r->o.logprobs, false, &c->text_offset, &r->namer);
}

static void gen_on_token(gen_choice *c, const engine_token *t) {
    gen_req *r = c->r;
    if (c->index == 0 && r->n_deferred > 0) gen_release_deferred(r, true, NULL);
    if (c->out_done) return;
    uint64_t now = clock_now_ns();
    server_metrics *m = &r->s->metrics;
    if (c->n_tokens == 0) {
        c->t_first = now;
        metrics_observe(&m->ttft, (double)(now - r->t_arrival) / 1e9);
    } else {
        metrics_observe(&m->itl, (double)(now - c->t_last) / 1e9);
    }
    c->t_last = now;
    c->n_tokens++;
    c->cum_logprob += t->logprob;
    gen_add_logprobs(c, t);
    size_t before = c->text.len;
    detok_stream_set_stops(&c->ds, c->n_tokens >= r->o.min_tokens);
    /* the eos / stop id that ends the request is not text (vLLM's detokenizer drops it) */
    int rc = t->stop && !r->o.include_stop_str_in_output
                 ? 0
                 : detok_stream_push_token(&c->ds, t->id, &c->text);
    if (rc < 0) {
        LOG_E("server", "%s: detokenizing token %d failed (%d)", r->id, t->id, rc);
        c->error = strdup("detokenization failed");
    }
    if (r->streaming && !r->client_gone) {
        sbuf sse;
        sbuf_init(&sse, (size_t)1 << 30);
        r->ops->stream_delta(r, c, c->text.data + before, c->text.len - before, &sse);
        gen_send_chunk(r, &sse);
        sbuf_free(&sse);
    }
    if (rc == 1) { /* stop string */
        c->stop_reason = json_string(r->o.stop[c->ds.stop_index]);
        engine_abort(r->s->eng, c->eid);
        gen_choice_done(c, "stop");
    } else if (rc < 0) {
        engine_abort(r->s->eng, c->eid);
        gen_choice_done(c, "error");
    }
}

static void gen_on_finished(gen_choice *c, gen_event *g) {
    gen_req *r = c->r;
    c->engine_done = true;
    r->n_pending--;
    c->n_prompt = g->n_prompt;
    c->n_cached = g->n_cached;
    c->kv_role = g->kv_role;
    c->n_kv_received = g->n_kv_recv;
    c->kv_layerwise = g->kv_layerwise;
    c->n_prompt_computed = g->n_computed;
    metrics_request q = g->timing;
    q.n_prompt = g->n_prompt;
    q.n_generated = c->n_tokens; /* as usage.completion_tokens */
    q.max_tokens_param = r->o.max_tokens;
    q.n_param = c->seq == 0 ? r->o.n : 0; /* once per prompt */
    q.n_cached = g->n_cached;
    q.n_tier_cached = g->n_tier_cached;
    q.n_kv_received = g->n_kv_recv;
    q.remote_prefill = g->kv_role == KV_REQ_REMOTE_PREFILL;
    metrics_observe_request(&r->s->metrics, &q);
    if (g->prompt_lp && r->o.sampling.prompt_logprobs >= 0) {
        /* entry 0 has no logprob; its id is the prompt's first token */
        if (g->n_prompt == r->n_pids[c->prompt]) g->prompt_lp[0].id = r->pids[c->prompt][0];
        if (r->o.prompt_logprobs >= 0)
            c->prompt_logprobs = oai_prompt_logprobs_json(g->prompt_lp, g->n_prompt,
                                                          r->o.prompt_logprobs, &r->namer);
        if (r->o.echo && r->o.logprobs >= 0 && !r->chat) {
            /* echo: the prompt's tokens lead the logprobs, the first without a value */
            json_t *lp = oai_cmpl_logprobs_new();
            size_t off = 0;
            for (int i = 0; i < g->n_prompt; i++)
                oai_cmpl_logprobs_add(lp, &g->prompt_lp[i], r->o.logprobs, i == 0, &off, &r->namer);
            c->echo_logprobs = lp;
        }
    }
    if (c->index == 0 && r->n_deferred > 0) /* it ended before its first token */
        gen_release_deferred(
            r, false,
            !strcmp(g->finish_reason, "error") ? (g->error ? g->error : "engine error") : NULL);
    if (c->out_done) return;
    if (!strcmp(g->finish_reason, "error")) {
        c->error = strdup(g->error ? g->error : "engine error");
        c->error_status = g->error_status;
        if (!r->has_err) {
            r->has_err = true;
            oai_error_set(&r->err, gen_error_status(c), gen_error_type(c), NULL, "%s", c->error);
        }
        gen_choice_done(c, "error");
        return;
    }
    size_t before = c->text.len;
    detok_stream_finish(&c->ds, &c->text);
    if (r->streaming && !r->client_gone && c->text.len > before) {
        sbuf sse;
        sbuf_init(&sse, (size_t)1 << 30);
        r->ops->stream_delta(r, c, c->text.data + before, c->text.len - before, &sse);
        gen_send_chunk(r, &sse);
        sbuf_free(&sse);
    }
    const char *reason = !strcmp(g->finish_reason, "stop")     ? "stop"
                         : !strcmp(g->finish_reason, "length") ? "length"
                                                               : "abort";
    if (!strcmp(reason, "stop") && g->stop_token >= 0)
        for (int i = 0; i < r->o.n_stop_token_ids; i++)
            if (r->o.stop_token_ids[i] == g->stop_token)
                c->stop_reason = json_integer(g->stop_token);
    gen_choice_done(c, reason);
}

/* The queued engine events (FIFO), taken off the queue. */
static gen_event *gen_take_events(server *s) {
    pthread_mutex_lock(&s->q_lock);
    gen_event *g = s->q_head;
    s->q_head = s->q_tail = NULL;
    pthread_mutex_unlock(&s->q_lock);
    return g;
}

static void gen_event_free(gen_event *g) {
    free(g->error);
    free(g->prompt_lp);
    free(g);
}

void gen_drain_events(server *s) {
    gen_event *g = gen_take_events(s);
    while (g) {
        gen_event *next = g->next;
        gen_choice *c = g->c;
        gen_req *r = c->r;
        if (r->beam && g->kind == ENGINE_EV_TOKEN) {
            beam_search_on_token(c, &g->tok);
        } else if (r->beam) {
            beam_search_on_finished(c, g->finish_reason, g->error, g->error_status, g->kv_role,
                                    g->n_kv_recv, g->n_computed);
            if (r->n_pending == 0) gen_complete(r);
        } else if (g->kind == ENGINE_EV_TOKEN) {
            gen_on_token(c, &g->tok);
        } else {
            gen_on_finished(c, g);
            if (r->n_pending == 0) gen_complete(r);
        }
        gen_event_free(g);
        g = next;
    }
}

void gen_free_live(server *s) {
    while (s->live) {
        gen_req *r = s->live;
        /* its connection is closed by hs_server_free, unanswered */
        if (r->http) hs_req_set_close_cb(r->http, NULL, NULL);
        gen_free_and_account(r);
    }
}

void gen_drop_events(server *s) {
    gen_event *g = gen_take_events(s);
    while (g) {
        gen_event *next = g->next;
        gen_event_free(g);
        g = next;
    }
}

/* ---- start ---------------------------------------------------------------------- */

/* vLLM's wording (its renderer's length check, VLLMValidationError with
 * parameter input_tokens): clients match "maximum context length is N tokens". */
static void gen_context_error(gen_req *r, int mml, int np, long long mt) {
    oai_error_set(&r->err, 400, "BadRequestError", "input_tokens",
                  "This model's maximum context length is %d tokens. However, you requested %lld "
                  "output tokens and your prompt contains %d input tokens, for a total of %lld "
                  "tokens. Please reduce the length of the input prompt or the number of "
                  "requested output tokens. (parameter=input_tokens, value=%d)",
                  mml, mt, np, (long long)np + mt, np);
}

static int gen_check_lengths(gen_req *r, int p, int *max_tokens) {
    int mml = r->s->max_model_len, np = r->n_pids[p];
    int mt = r->o.max_tokens;
    if (mt < 0) {
        if (np >= mml) { /* no room for one output token */
            gen_context_error(r, mml, np, 0);
            return -EINVAL;
        }
        mt = mml - np;
    } else if ((long long)np + mt > mml) {
        gen_context_error(r, mml, np, mt);
        return -EINVAL;
    }
    /* --override-generation-config's max_new_tokens caps every request, as vLLM's
     * get_max_tokens (the min of what fits, the request's and the default's) */
    if (r->s->defaults.max_tokens > 0 && r->s->defaults.max_tokens < mt)
        mt = r->s->defaults.max_tokens;
    if (r->o.min_tokens > mt) {
        oai_error_set(&r->err, 400, "BadRequestError", "min_tokens",
                      "'min_tokens' (%d) is more than the %d tokens that fit after the prompt",
                      r->o.min_tokens, mt);
        return -EINVAL;
    }
    *max_tokens = mt;
    return 0;
}

static void gen_start_stream(gen_req *r) {
    http_header h[3] = {{"Content-Type", "text/event-stream; charset=utf-8"},
                        {"Cache-Control", "no-cache"},
                        {"X-Request-Id", r->x_request_id}};
    hs_reply_start(r->http, 200, h, r->x_request_id ? 3 : 2, -1); /* chunked */
    hs_reply_flush(r->http);
    r->streaming = true;
    sbuf sse;
    sbuf_init(&sse, (size_t)1 << 30);
    if (r->ops->stream_start) r->ops->stream_start(r, &sse);
    gen_send_chunk(r, &sse);
    sbuf_free(&sse);
}

/* A request refused before the engine took it: a decoder tells the producer
 * that the KV it keeps for the request's transfer will not be pulled.  No-op for other requests. */
static void gen_release_unused_kv(gen_req *r) {
    if (!r->s->conn || !r->o.kv_transfer_params) return;
    char *t = json_dumps(r->o.kv_transfer_params, JSON_COMPACT);
    mooncake_connector_release_unused(r->s->conn, t);
    free(t);
}

void gen_start(gen_req *r) {
    server *s = r->s;
    r->namer.fn = r->o.return_tokens_as_token_ids ? server_token_namer_ids : server_token_namer;
    r->namer.ctx = s->tok;
    int vocab = tokenizer_vocab_size(s->tok);
    int max_tokens[1024];
    for (int p = 0; p < r->n_prompts; p++) {
        for (int i = 0; i < r->n_pids[p]; i++)
            if (r->pids[p][i] >= vocab) {
                oai_error_set(
                    &r->err, 400, "BadRequestError", r->chat ? "messages" : "prompt",
                    "token id %d at position %d is out of range: the vocabulary has ids 0..%d",
                    r->pids[p][i], i, vocab - 1);
                goto fail;
            }
        for (int i = 0; i < r->o.n_stop_token_ids; i++)
            if (r->o.stop_token_ids[i] >= vocab) {
                oai_error_set(&r->err, 400, "BadRequestError", "stop_token_ids",
                              "stop token id %d is out of range: the vocabulary has ids 0..%d",
                              r->o.stop_token_ids[i], vocab - 1);
                goto fail;
            }
        if (gen_check_lengths(r, p, &max_tokens[p])) goto fail;
    }
    r->n_ch = r->n_prompts * r->o.best_of;
    r->ch = calloc((size_t)r->n_ch, sizeof *r->ch);
    if (!r->ch) {
        oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
        goto fail;
    }
    for (int i = 0; i < r->n_ch; i++) {
        gen_choice *c = &r->ch[i];
        c->r = r;
        c->index = i; /* best_of > n: renumbered when the n best are chosen */
        c->prompt = i / r->o.best_of;
        c->seq = i % r->o.best_of;
        c->max_tokens = max_tokens[c->prompt];
        sbuf_init(&c->text, (size_t)1 << 30);
        if (sbuf_append(&c->text, "", 0)) { /* text.data is never NULL from here on */
            oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
            goto fail;
        }
        if (detok_stream_init(&c->ds, s->tok, r->o.skip_special_tokens, r->o.stop, r->o.n_stop,
                              r->o.include_stop_str_in_output)) {
            oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
            goto fail;
        }
        if (r->o.echo && r->ptext && r->ptext[c->prompt]) {
            sbuf_append(&c->text, r->ptext[c->prompt], r->ptext_len[c->prompt]);
            /* the generated tokens' text offsets follow the echoed prompt */
            const char *t = r->ptext[c->prompt];
            for (size_t k = 0; k < r->ptext_len[c->prompt]; k++)
                if (((unsigned char)t[k] & 0xC0) != 0x80) c->text_offset++;
        }
    }
    if (r->o.kv_transfer_params) {
        r->kv_params_text = json_dumps(r->o.kv_transfer_params, JSON_COMPACT);
        if (!r->kv_params_text) {
            oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
            goto fail;
        }
    }
    s->n_live++;
    r->next = s->live;
    if (s->live) s->live->prev = r;
    s->live = r;
    /* n > 1 with kv_transfer_params: one transfer moves the prompt once.  Choice 0
     * carries the params (it pulls the KV on a decoder, keeps it for the decoder on a
     * prefiller); the other choices are submitted without them once choice 0 has
     * produced its first token — its prompt blocks are then in the prefix cache and
     * they share them (gen_release_deferred). */
    int n_now = r->kv_params_text ? 1 : r->n_ch;
    /* beam search submits its steps' requests itself, not the choices */
    if (r->o.use_beam_search) (void)beam_search_start(r, max_tokens);
    for (int i = 0; i < r->n_ch && !r->o.use_beam_search; i++) {
        gen_choice *c = &r->ch[i];
        if (i >= n_now) {
            c->deferred = true;
            r->n_deferred++;
            continue;
        }
        if (gen_submit(r, c, true)) {
            for (int k = 0; k < i; k++)
                engine_abort(s->eng, r->ch[k].eid);
            r->n_deferred = 0;
            break;
        }
    }
    /* Events are handled on this thread, so none is processed before we return:
     * the stream can start after the submissions. */
    if (!r->has_err && r->o.stream) gen_start_stream(r);
    if (r->n_pending > 0) {
        hs_req_set_close_cb(r->http, gen_close_cb, r);
        return; /* gen_complete replies (the error, if any) */
    }
    gen_reply_error(r, r->http);
    gen_free_and_account(r);
    return;
fail:
    gen_release_unused_kv(r);
    gen_reply_error(r, r->http);
    gen_req_free(r);
}

/* ---- preparation (here or on the preparation thread) --------------------------- */

static void gen_prep_work(prep_job *j, const char *body, size_t len) {
    gen_req *r = j->arg;
    j->rc = r->prepare(j->s, r, body, len);
}

static void gen_prep_done(prep_job *j) {
    gen_req *r = j->arg;
    hs_req *http = j->http;
    int rc = j->rc;
    free(j);
    if (!http) { /* the client left (or shutdown answered it) */
        gen_release_unused_kv(r);
        gen_req_free(r);
        return;
    }
    if (rc) {
        gen_release_unused_kv(r);
        gen_reply_error(r, http);
        gen_req_free(r);
        return;
    }
    gen_start(r);
}

void gen_prepare_and_start(gen_req *r, gen_prepare_fn prepare) {
    server *s = r->s;
    prep_job *j = prep_wants(s, r->http) ? calloc(1, sizeof *j) : NULL;
    if (j) {
        r->prepare = prepare;
        j->http = r->http;
        j->work = gen_prep_work;
        j->done = gen_prep_done;
        j->arg = r;
        prep_submit(s, j);
        return;
    }
    size_t len = 0;
    char *body = server_read_body(r->http, &len);
    int rc = -1;
    if (body)
        rc = prepare(s, r, body, len);
    else
        oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
    free(body);
    if (rc) {
        gen_release_unused_kv(r);
        gen_reply_error(r, r->http);
        gen_req_free(r);
        return;
    }
    gen_start(r);
}
