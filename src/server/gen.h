/*
 * gen — the lifecycle of one generation request (completions or chat) from
 * validated request to last byte: it submits one engine request per choice
 * (prompts × n, seeds derived as seed + choice index within the prompt),
 * receives the engine's events through the server's queue (the engine
 * callback runs on the engine thread and only copies the event and wakes the
 * loop), detokenizes with stop strings (detok_stream), accumulates logprobs,
 * counts usage, observes the latency metrics, and either streams chunks or
 * builds the final body through the endpoint's gen_ops (completion.c,
 * chat.c).  A client that disconnects gets its engine requests aborted; the
 * request's memory is freed once every engine request has sent FINISHED.
 */
#ifndef DISAGG_SERVER_GEN_H
#define DISAGG_SERVER_GEN_H

#include "server/detok_stream.h"
#include "server/openai_response.h"
#include "server/server_ctx.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct gen_req gen_req;
/* Parse + tokenize a request body into r: 0, or -1 with r->err set. */
typedef int (*gen_prepare_fn)(server *s, gen_req *r, const char *body, size_t len);

typedef struct gen_choice {
    gen_req *r;                /* owner */
    int index;                 /* choice index in the response */
    int seq;                   /* sequence index within its prompt, 0 .. best_of - 1 */
    bool dropped;              /* best_of > n: not among the n best (not in the response) */
    double cum_logprob;        /* sum of its tokens' logprobs (best_of ranks by it) */
    int prompt;                /* which prompt it continues */
    uint64_t eid;              /* engine request id */
    bool submitted;            /* engine_submit succeeded: a FINISHED event will come */
    bool engine_done;          /* FINISHED received */
    bool out_done;             /* no more output: stop string matched or engine finished */
    bool deferred;             /* n > 1 with kv_transfer_params: submitted after choice 0's
                                  first token, so that it shares choice 0's prompt blocks */
    int max_tokens;            /* the engine's max_tokens for it */
    detok_stream ds;           /* tokens → released text */
    sbuf text;                 /* all released text */
    size_t sent;               /* bytes of text already streamed as content */
    size_t r_sent;             /* bytes of reasoning already streamed (--reasoning-parser) */
    json_t *logprobs;          /* accumulated logprobs (stream: since the last chunk) */
    size_t text_offset;        /* completions logprobs text_offset, in characters */
    int n_tokens;              /* generated tokens that count (up to the stop) */
    const char *finish_reason; /* "stop", "length", "abort", "error", "tool_calls" */
    json_t *stop_reason;       /* matched stop string or stop token id, or NULL */
    json_t *prompt_logprobs;   /* vLLM prompt_logprobs array, or NULL */
    json_t *echo_logprobs;     /* completions echo: prompt part of the logprobs, or NULL */
    int n_prompt;              /* prompt tokens (from the engine) */
    int n_cached;              /* of those, from the prefix cache */
    int kv_role;               /* kv_role_of_request (engine/kv_connector.h) */
    int n_kv_received;         /* of the prompt, tokens whose KV came from a producer */
    int kv_layerwise;          /* that KV was streamed layer by layer */
    int n_prompt_computed;     /* prompt tokens this instance computed */
    char *error;               /* engine error message */
    int error_status;          /* its HTTP status from the engine (0 = 500) */
    uint64_t t_first, t_last;  /* clock_now_ns of the first / latest token */
    bool role_sent;            /* chat stream: the role chunk went out */
} gen_choice;

typedef struct gen_ops {
    /* Streaming only: called once before any chunk (e.g. chat's role chunks). */
    int (*stream_start)(gen_req *r, sbuf *sse);
    /* Streaming only: new text and/or logprobs for c (text may be empty). */
    int (*stream_delta)(gen_req *r, gen_choice *c, const char *text, size_t len, sbuf *sse);
    /* Streaming only: c is finished (finish_reason set), emit its last chunk. */
    int (*stream_finish)(gen_req *r, gen_choice *c, sbuf *sse);
    /* Non-streaming: the response body once every choice is done. */
    json_t *(*build_response)(gen_req *r);
    /* Streaming, optional: the stream's tail once every choice is done (NULL: the usage
     * chunk when asked, then data: [DONE] — the OpenAI chat / completions ending). */
    int (*stream_end)(gen_req *r, sbuf *sse);
    /* Optional: the endpoint's error body for e (NULL: the OpenAI / vLLM
     * {"error": {...}} body). */
    json_t *(*error_body)(gen_req *r, const oai_error *e);
    /* Streaming, optional: the event for an error after the stream started (NULL: a
     * data: {"error": {...}} chunk). */
    int (*stream_error)(gen_req *r, const oai_error *e, sbuf *sse);
} gen_ops;

struct gen_req {
    server *s;              /* the server */
    gen_req *prev, *next;   /* s->live list */
    hs_req *http;           /* the HTTP request; NULL once replied or the client left */
    const gen_ops *ops;     /* endpoint rendering */
    oai_request o;          /* the validated request */
    bool chat;              /* chat endpoint */
    bool think_closed;      /* chat with a reasoning parser: the prompt closed a think block
                               (reasoning_prompt_closes) */
    char id[160];           /* "cmpl-..." / "chatcmpl-..." */
    char *x_request_id;     /* X-Request-Id header value, or NULL */
    long long created;      /* unix seconds */
    int n_prompts;          /* prompts */
    int32_t **pids;         /* (n_prompts) token ids of each prompt */
    int *n_pids;            /* (n_prompts) their lengths */
    char **ptext;           /* (n_prompts) prompt text for echo, or NULL */
    size_t *ptext_len;      /* (n_prompts) */
    gen_choice *ch;         /* (n_ch) choices */
    int n_ch;               /* n_prompts * n */
    int n_pending;          /* submitted engine requests not yet FINISHED */
    int n_deferred;         /* choices waiting for choice 0's first token */
    bool streaming;         /* reply started as SSE */
    bool client_gone;       /* the client left: engine requests aborted */
    bool detached;          /* the client left: http was freed (NULL) */
    bool replied;           /* the final reply was sent */
    oai_error err;          /* a failure to report instead of the response */
    bool has_err;           /* err is set */
    uint64_t t_arrival;     /* clock_now_ns at arrival */
    oai_namer namer;        /* token strings for logprobs */
    char *kv_params_text;   /* o.kv_transfer_params as JSON text for the engine, or NULL */
    gen_prepare_fn prepare; /* what the preparation thread runs */

    struct grammar *constraint;  /* structured outputs (structured.c), or NULL: own reference */
    struct beam_search *beam;    /* use_beam_search: the search (beam_search.c), else NULL */
    void *ext;                   /* the endpoint's own state (responses.c, messages.c), or NULL */
    void (*ext_free)(void *ext); /* frees ext */
};

/* Allocate a request for http; fills id, x_request_id, created, arrival.
 * NULL on allocation failure. */
gen_req *gen_req_new(server *s, hs_req *http, bool chat, const gen_ops *ops);
/* Take ownership of prompt i's ids (and text for echo, may be NULL). */
/* Validate lengths, create the choices, submit them and start the stream.
 * After this call r belongs to gen (it replies and frees); on failure before
 * submission it replies the error itself. */
void gen_start(gen_req *r);
/* Prepare r (parse + tokenize: prepare(s, r, body, len) returns 0 or sets
 * r->err) on the loop, or on the preparation thread for a large body, then
 * gen_start it or reply its error.  The endpoints' common entry. */
void gen_prepare_and_start(gen_req *r, gen_prepare_fn prepare);
/* The request's structured-output constraint into r->constraint (a 400 in r->err when
 * it is bad): 0 or -1. */
int gen_prepare_constraint(server *s, gen_req *r);
/* The request's bad_words tokenized as vLLM does (each word as given without its leading
 * spaces, and with one leading space when that tokenizes differently) into its sampling
 * parameters (a 400 in r->err when they exceed the limit): 0 or -1. */
int gen_prepare_bad_words(server *s, gen_req *r);
/* Free a request that never reached gen_start (after replying an error). */
void gen_req_free(gen_req *r);
/* Write an SSE buffer to the client as one chunk. */
void gen_send_chunk(gen_req *r, sbuf *sse);
/* The engine callback: ctx is a gen_choice of a live request (runs on the engine thread,
 * queues the event for the loop). */
void gen_engine_event_fn(void *ctx, const engine_event *ev);
/* c has all its text (c->text) and ends with reason: stream what was not sent and its
 * last chunk (or its error when c->error is set), observe the metrics. */
void gen_choice_emit(gen_choice *c, const char *reason);
/* Usage totals over all choices so far. */
void gen_usage(const gen_req *r, oai_usage *u);

#endif
