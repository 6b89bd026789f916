/*
 * server_ctx — the state every server module shares (internal to
 * src/server): the event loop, the engine and tokenizer once loaded, the
 * metrics, the engine-event queue and small helpers for replying.  All of it
 * is touched on the event-loop thread only, except the queue (own mutex) and
 * `ready` (atomic, set by the loader thread).
 */
#ifndef DISAGG_SERVER_SERVER_CTX_H
#define DISAGG_SERVER_SERVER_CTX_H

#include "engine/engine.h"
#include "model/chat_template.h"
#include "model/mistral_chat.h"
#include "model/tokenizer.h"
#include "server/metrics.h"
#include "server/openai_request.h"
#include "server/sbuf.h"
#include "server/structured.h"
#include "server/tool_parser.h"
#include "server/server.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

struct event_base;
struct event;
struct evbuffer;
struct gen_event;
struct gen_req;
typedef struct hs_server hs_server; /* base/http_server.h */
typedef struct hs_req hs_req;
typedef struct prep prep;

typedef struct server {
    server_config cfg;                /* copy of the configuration */
    const char *model_name;           /* served model name */
    struct event_base *base;          /* the one event loop */
    hs_server *http;                  /* listener and connections (base/http_server) */
    struct event *wake;               /* activated by the engine thread: drain the queue */
    struct event *ready_ev;           /* activated by the loader thread when it ends */
    struct event *sig_int, *sig_term; /* stop the loop */
    atomic_int ready;                 /* 1: engine + tokenizer loaded; -1: loading failed */
    char load_error[1024];            /* why loading failed */
    pthread_t loader;                 /* engine_create runs here */
    engine *eng;                      /* NULL until ready */
    struct mooncake_connector *conn;  /* KV connector (--kv-transfer-config), or NULL */
    struct kv_events_publisher *kvev; /* KV event publisher (--kv-events-config), or NULL */
    tokenizer *tok;                   /* NULL until ready */
    grammar_vocab *gvocab;            /* structured outputs: the vocabulary (with tok) */
    structured_cache *gcache;         /* compiled grammars by request constraint */
    chat_template *tmpl;              /* NULL when the model has no (supported) template */
    char tmpl_error[512];             /* why tmpl is NULL */
    mistral_chat *mistral;            /* mistral mode: chats by mistral-common, not tmpl */
    const tool_parser *tools;         /* parses tool calls (cfg.tool_parser or hermes) */
    const tool_call_grammar *tool_grammar; /* its format for tool_choice required / named */
    int max_model_len;                /* engine_max_model_len */
    int block_size;                   /* tokens per KV block */
    oai_defaults defaults;            /* request defaults (generation_config.json) */
    server_metrics metrics;           /* Prometheus series */
    pthread_mutex_t q_lock;           /* guards q_head / q_tail */
    struct gen_event *q_head;         /* engine events waiting for the loop, FIFO */
    struct gen_event *q_tail;
    int n_live;           /* generation requests in flight */
    struct gen_req *live; /* those requests, a doubly linked list */
    uint64_t next_id;     /* request id counter */
    prep *prep;           /* the request preparation thread (prep.c), or NULL */
} server;

/* ---- replies (reply.c) --------------------------------------------------- */
/* Send a JSON body (consumes body) with status and the X-Request-Id header
 * when req_id is not NULL. */
void server_reply_json(hs_req *req, int status, json_t *body, const char *req_id);
/* Send JSON text (malloc'ed, consumed) with status. */
void server_reply_json_text(hs_req *req, int status, char *text);
/* Send an OpenAI-style error. */
void server_reply_error(hs_req *req, const oai_error *e, const char *req_id);
void server_reply_errorf(hs_req *req, int status, const char *type, const char *param,
                         const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* Send a body of the given type (NULL: none, as for an empty body). */
void server_reply_text(hs_req *req, int status, const char *content_type, const char *body,
                       size_t len);
/* Copy the request body into a NUL-terminated malloc'ed buffer. */
char *server_read_body(hs_req *req, size_t *len);
/* Name a token for logprobs: decoded text or "token_id:N". */
int server_token_namer(void *ctx, int32_t id, sbuf *out);
int server_token_namer_ids(void *ctx, int32_t id, sbuf *out);

/* ---- preparation off the loop (prep.c) ------------------------------------ */
/* Bodies this large are parsed and tokenized on the preparation thread. */
#define PREP_INLINE_MAX ((size_t)256 << 10)
typedef struct prep_job prep_job;
struct prep_job {
    server *s;             /* set by prep_submit */
    hs_req *http;          /* the request; NULL once the client left (or shutdown answered) */
    struct evbuffer *body; /* the body, moved out of the request */
    int detached;          /* the client left while the job was away */
    /* Preparation thread: body is the whole request body (len bytes). */
    void (*work)(prep_job *j, const char *body, size_t len);
    /* Loop thread: reply on http (NULL: the request is gone or already
     * answered, only free) and free the job. */
    void (*done)(prep_job *j);
    void *arg;          /* the endpoint's data */
    int rc;             /* the work's result, for done */
    prep_job *next;     /* queue link */
    prep_job *all_next; /* prep's list of jobs away */
};
/* Start the thread (0, or -1: requests are then prepared on the loop). */
int prep_init(server *s);
/* 1 when req's body is large enough to be prepared off the loop. */
int prep_wants(server *s, hs_req *req);
/* Move j->http's body to the thread; j->work runs there, j->done here. */
void prep_submit(server *s, prep_job *j);
/* Shutdown, before hs_server_free: stop the thread, answer 503 to the jobs away. */
void prep_free(server *s);

/* ---- handlers ------------------------------------------------------------ */
void server_completion_handle(server *s, hs_req *req); /* completion.c */
void server_chat_handle(server *s, hs_req *req);       /* chat.c */
void server_responses_handle(server *s, hs_req *req);  /* responses.c */
void server_messages_handle(server *s, hs_req *req);   /* messages.c */
void server_tokenize_handle(server *s, hs_req *req);   /* tokenize.c */
void server_detokenize_handle(server *s, hs_req *req); /* tokenize.c */
/* Render messages (+ tools, + chat_template_kwargs or NULL) with the chat
 * template and tokenize (chat.c). */
int server_chat_render_ids(server *s, const json_t *messages, const json_t *tools,
                           const json_t *kwargs, bool add_generation_prompt, bool add_special,
                           int32_t **ids, size_t *n, oai_error *err);
/* Parse a chat completions body, render and tokenize it into r (a gen_req, gen.h): 0, or
 * -1 with r->err set (chat.c).  The Responses and Messages endpoints translate their bodies
 * into this one. */
int server_chat_prepare(server *s, struct gen_req *r, const char *body, size_t len);
/* For those translations: the request body as a JSON object (new reference), or NULL with a
 * 400 in r->err; and server_chat_prepare of a translated chat body (the reference is taken). */
struct json_t *server_body_object(struct gen_req *r, const char *body, size_t len);
int server_chat_prepare_json(server *s, struct gen_req *r, struct json_t *chat);
/* Drain the engine-event queue (gen.c), on the loop thread. */
void gen_drain_events(server *s);
/* Shutdown, after engine_destroy: free the requests still in flight (their
 * connections are then closed by hs_server_free). */
void gen_free_live(server *s);
/* Free queued events without handling them (shutdown). */
void gen_drop_events(server *s);

#endif
