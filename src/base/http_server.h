/*
 * http_server — the HTTP/1.1 server on libevent bufferevents: accepts
 * connections, parses one request at a time per connection (keep-alive,
 * bounded head, header count and body), hands complete requests to a handler,
 * and writes replies either whole or streamed (Content-Length passthrough or
 * chunked).  Unlike evhttp in libevent 2.1 it keeps reading while a request is
 * being served, so a client that disconnects is noticed at once (close
 * callback) and the caller can cancel its work (the proxy: the upstream
 * request); and every protocol error is answered with the caller's
 * OpenAI-style error body.  Used by the proxy (src/proxy).
 * One event loop, no threads.
 */
#ifndef DISAGG_BASE_HTTP_SERVER_H
#define DISAGG_BASE_HTTP_SERVER_H

#include "base/http_msg.h"

#include <stddef.h>
#include <stdint.h>

struct event_base;
struct evbuffer;

typedef struct hs_server hs_server;
typedef struct hs_req hs_req;

/* Why a connection was closed by a deadline (hs_config.on_deadline). */
typedef enum hs_deadline_kind {
    HS_DEADLINE_HEADER = 0, /* the request head was not in time: 408 */
    HS_DEADLINE_BODY,       /* the head was, the rest of the request not: 408 */
    HS_DEADLINE_IDLE        /* no byte of a request in time (keep-alive): closed silently */
} hs_deadline_kind;
typedef void (*hs_deadline_fn)(void *arg, hs_deadline_kind kind);

/* Deadlines: none of them is moved by bytes arriving.  A request's head
 * must be complete header_timeout_s after its first byte (or after the
 * accept / the previous reply, see head_from_*); then the whole request
 * request_timeout_s after that same start, and the body body_timeout_s
 * after the head's end (0: no such deadline).  Passing one answers 408 and
 * closes.  Between requests (and before the first, unless
 * head_from_accept) a connection without a byte of a request is closed
 * silently after idle_timeout_s. */
typedef struct hs_config {
    http_limits limits;         /* head bytes / header count */
    size_t max_body_bytes;      /* request body cap (413 beyond) */
    double header_timeout_s;    /* to receive a request head from its start (deadline) */
    double request_timeout_s;   /* to receive a whole request from its start (deadline; 0: none) */
    double body_timeout_s;      /* to receive the body from the head's end (deadline; 0: none) */
    double idle_timeout_s;      /* connection without a request byte (keep-alive) before close */
    int head_from_accept;       /* 1: a connection's first head starts at accept (no idle wait) */
    int head_from_reply;        /* 1: a later head starts when the previous reply ended */
    int idle_408;               /* 1: a head deadline passing before any byte answers 408 too
                                   (else the connection is closed silently, as idle) */
    double write_timeout_s;     /* client not reading our output for this long: drop */
    size_t max_output_bytes;    /* high watermark of unsent reply bytes (backpressure) */
    int max_connections;        /* accepted connections beyond are closed at once */
    hs_deadline_fn on_deadline; /* told of every deadline close, or NULL */
    void *on_deadline_arg;      /* its argument */
} hs_config;

/* Called with a complete request (head + body).  The handler must eventually
 * reply (hs_reply or hs_reply_start..end) unless the close callback fires. */
typedef void (*hs_handler_fn)(hs_req *req, void *arg);
/* The client went away (or the reply failed) before the reply ended; `req`
 * is freed right after this returns. */
typedef void (*hs_close_fn)(hs_req *req, void *arg);
/* Unsent reply bytes dropped below the low watermark (after hs_reply_data
 * returned 1). */
typedef void (*hs_drain_fn)(hs_req *req, void *arg);
/* Builds the body of a protocol error reply (status 400/408/413/431/...): a
 * malloc'ed JSON string the server frees, or NULL for an empty body (sent
 * without Content-Type; also what a NULL hs_error_body_fn gives). */
typedef char *(*hs_error_body_fn)(int status, const char *message);

void hs_config_default(hs_config *c);
/* Binds host:port and starts accepting on base.  Returns NULL and logs why. */
hs_server *hs_server_new(struct event_base *base, const char *host, uint16_t port,
                         const hs_config *cfg, hs_handler_fn handler, void *arg,
                         hs_error_body_fn error_body);
/* The same on a socket already listening (owned from now on, closed on
 * failure too), for callers that report listen errors themselves. */
hs_server *hs_server_new_fd(struct event_base *base, int listen_fd, const hs_config *cfg,
                            hs_handler_fn handler, void *arg, hs_error_body_fn error_body);
/* Port actually bound (when port 0 was asked). */
uint16_t hs_server_port(const hs_server *s);
/* Closes the listening socket (new connections are refused); open
 * connections stay. */
void hs_server_stop_listening(hs_server *s);
/* Closes the listener and every connection (close callbacks run). */
void hs_server_free(hs_server *s);
int hs_server_connections(const hs_server *s);

const http_head *hs_req_head(const hs_req *r);
/* Path part of the target (before '?'), NUL-terminated. */
const char *hs_req_path(const hs_req *r);
/* The request body: (body_len bytes), contiguous. */
const char *hs_req_body(hs_req *r, size_t *body_len);
void hs_req_set_close_cb(hs_req *r, hs_close_fn cb, void *arg);
void hs_req_set_drain_cb(hs_req *r, hs_drain_fn cb, void *arg);
/* Peer address "ip:port". */
const char *hs_req_peer(const hs_req *r);
/* The body as a buffer (to move it elsewhere with evbuffer_add_buffer). */
struct evbuffer *hs_req_body_buffer(hs_req *r);
/* Adds a header to the reply (sent by hs_reply / hs_reply_start, after their
 * own).  Returns 0, -EINVAL for a name or value with CR, LF (or ':' in the
 * name), -ENOMEM. */
int hs_req_add_header(hs_req *r, const char *name, const char *value);

/* Whole reply; ends the request. extra_headers: "Name: value\r\n" lines or NULL. */
int hs_reply(hs_req *r, int status, const char *content_type, const char *extra_headers,
             const void *body, size_t len);
/* Starts a streamed reply: headers (n of them) copied as given, except
 * hop-by-hop ones; content_length >= 0 sends it as is, -1 uses chunked.  The
 * head goes out with the first hs_reply_data / hs_reply_end, or at
 * hs_reply_flush. */
int hs_reply_start(hs_req *r, int status, const http_header *headers, int n,
                   int64_t content_length);
/* Sends what hs_reply_start queued at the end of this loop turn (it is
 * otherwise sent with the first data). */
void hs_reply_flush(hs_req *r);
/* Appends reply bytes (moved out of `data`).  Returns 1 when unsent output is
 * above the high watermark (the caller should pause its source until the
 * drain callback), 0 otherwise, <0 on error. */
int hs_reply_data(hs_req *r, struct evbuffer *data);
/* Ends a streamed reply (terminating chunk); the request is freed. */
int hs_reply_end(hs_req *r);
/* Aborts: closes the client connection without ending the reply (a streamed
 * body is then visibly truncated).  The close callback does not run. */
void hs_reply_abort(hs_req *r);

#endif
