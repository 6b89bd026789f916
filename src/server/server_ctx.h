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
#include "model/tokenizer.h"
#include "server/metrics.h"
#include "server/openai_request.h"
#include "server/sbuf.h"
#include "server/server.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

struct event_base;
struct event;
struct evhttp;
struct evhttp_request;
struct gen_event;
struct gen_req;
struct evhttp_connection;
typedef struct http_conn http_conn;
typedef struct prep prep;

typedef struct server {
    server_config cfg;                /* copy of the configuration */
    const char *model_name;           /* served model name */
    struct event_base *base;          /* the one event loop */
    struct evhttp *http;              /* listener and router */
    struct event *wake;               /* activated by the engine thread: drain the queue */
    struct event *ready_ev;           /* activated by the loader thread when it ends */
    struct event *sig_int, *sig_term; /* stop the loop */
    atomic_int ready;                 /* 1: engine + tokenizer loaded; -1: loading failed */
    char load_error[1024];            /* why loading failed */
    pthread_t loader;                 /* engine_create runs here */
    engine *eng;                      /* NULL until ready */
    struct mooncake_connector *conn;  /* KV connector (--kv-transfer-config), or NULL */
    tokenizer *tok;                   /* NULL until ready */
    chat_template *tmpl;              /* NULL when the model has no (supported) template */
    char tmpl_error[512];             /* why tmpl is NULL */
    int max_model_len;                /* engine_max_model_len */
    int block_size;                   /* tokens per KV block */
    oai_defaults defaults;            /* request defaults (generation_config.json) */
    server_metrics metrics;           /* Prometheus series */
    pthread_mutex_t q_lock;           /* guards q_head / q_tail */
    struct gen_event *q_head;         /* engine events waiting for the loop, FIFO */
    struct gen_event *q_tail;
    int n_live;           /* generation requests in flight */
    struct gen_req *live; /* those requests, a doubly linked list */
    struct event *probe;  /* periodic: notice clients that left a non-streaming request */
    uint64_t next_id;     /* request id counter */
    http_conn *conns;     /* connections with deadlines (http_conn.c), a list */
    http_conn **conn_by_fd; /* (n_conn_by_fd) those connections by socket fd */
    int n_conn_by_fd;
    prep *prep; /* the request preparation thread (prep.c), or NULL */
} server;

/* ---- replies (http.c) ---------------------------------------------------- */
/* Send a JSON body (consumes body) with status and the X-Request-Id header
 * when req_id is not NULL. */
void server_reply_json(struct evhttp_request *req, int status, json_t *body, const char *req_id);
/* Send JSON text (malloc'ed, consumed, sent without a copy) with status. */
void server_reply_json_text(struct evhttp_request *req, int status, char *text);
/* Send an OpenAI-style error. */
void server_reply_error(struct evhttp_request *req, const oai_error *e, const char *req_id);
void server_reply_errorf(struct evhttp_request *req, int status, const char *type,
                         const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Copy the request body into a NUL-terminated malloc'ed buffer. */
char *server_read_body(struct evhttp_request *req, size_t *len);
/* Name a token for logprobs: decoded text or "token_id:N". */
int server_token_namer(void *ctx, int32_t id, sbuf *out);
int server_token_namer_ids(void *ctx, int32_t id, sbuf *out);

/* ---- connection deadlines (http_conn.c) ---------------------------------- */
typedef void (*http_conn_close_fn)(struct evhttp_connection *evc, void *arg);
/* Every connection accepted from now on gets the header deadline and the
 * keep-alive timeout of s->cfg. */
void http_conn_install(server *s);
/* A complete request reached the router: no deadline until its reply ends. */
void http_conn_request_begins(server *s, struct evhttp_request *req);
/* The connection's close callback (evhttp's own is this module's). */
void http_conn_set_close_cb(server *s, struct evhttp_connection *evc, http_conn_close_fn fn,
                            void *arg);
/* Shutdown, after evhttp_free. */
void http_conn_free_all(server *s);

/* ---- preparation off the loop (prep.c) ------------------------------------ */
/* Bodies this large are parsed and tokenized on the preparation thread. */
#define PREP_INLINE_MAX ((size_t)256 << 10)
typedef struct prep_job prep_job;
struct prep_job {
    server *s;                     /* set by prep_submit */
    struct evhttp_request *http;   /* the request; NULL in done() when there is none to answer */
    struct evhttp_connection *evc; /* its connection while attached */
    struct evbuffer *body;         /* the body, moved out of evhttp's buffer */
    int detached;                  /* the client left while the job was away */
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
int prep_wants(server *s, struct evhttp_request *req);
/* Move j->http's body to the thread; j->work runs there, j->done here. */
void prep_submit(server *s, prep_job *j);
/* Shutdown, before evhttp_free: stop the thread, answer 503 to the jobs away. */
void prep_free(server *s);

/* ---- handlers ------------------------------------------------------------ */
void completion_handle(server *s, struct evhttp_request *req); /* completion.c */
void chat_handle(server *s, struct evhttp_request *req);       /* chat.c */
void tokenize_handle(server *s, struct evhttp_request *req);   /* tokenize.c */
void detokenize_handle(server *s, struct evhttp_request *req); /* tokenize.c */
/* Render messages (+ tools) with the chat template and tokenize (chat.c). */
int chat_render_ids(server *s, const json_t *messages, const json_t *tools,
                    bool add_generation_prompt, bool add_special, int32_t **ids, size_t *n,
                    oai_error *err);
/* Drain the engine-event queue (gen.c), on the loop thread. */
void gen_drain_events(server *s);
/* Abort the requests whose client closed its connection while waiting for a
 * non-streaming reply (libevent only notices a close when it writes). */
void gen_probe_clients(server *s);
/* Shutdown, after engine_destroy: free the requests still in flight (their
 * connections are then closed by evhttp_free). */
void gen_free_live(server *s);
/* Free queued events without handling them (shutdown). */
void gen_drop_events(server *s);

#endif
