/* http_server — see http_server.h. */
#include "base/http_server.h"

#include "base/clock.h"
#include "base/log.h"

#include <arpa/inet.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/net.h"

#define MOD "http"
/* After a protocol error reply the connection reads (and drops) what the client
 * still sends, up to this long, before closing: closing with unread input would
 * reset the connection and the client could lose the reply (nginx's
 * lingering_close). */
#define LINGER_S 2.0

typedef enum conn_state {
    CONN_READ_HEAD = 0, /* waiting for (more of) a request head */
    CONN_READ_BODY,     /* reading the body of the parsed head */
    CONN_HANDLING,      /* request handed to the handler, reply not ended */
    CONN_CLOSING        /* reply ended or error sent: close once output is flushed */
} conn_state;

typedef struct hs_conn hs_conn;

struct hs_req {
    hs_conn *conn;                /* owning connection */
    http_head head;               /* the request head (owned) */
    struct evbuffer *body;        /* (body bytes) decoded request body */
    char *path;                   /* target up to '?' (malloc'ed) */
    hs_close_fn close_cb;         /* client went away before the reply ended */
    void *close_arg;              /* its argument */
    hs_drain_fn drain_cb;         /* output drained below the low watermark */
    void *drain_arg;              /* its argument */
    struct evbuffer *out_headers; /* "Name: value\r\n" lines for the reply, or NULL */
    int started;                  /* reply head sent */
    int chunked;                  /* reply uses chunked coding */
    int paused;                   /* hs_reply_data reported the high watermark */
};

struct hs_conn {
    hs_server *srv;           /* owner */
    struct bufferevent *bev;  /* the client socket */
    char peer[64];            /* "ip:port" */
    conn_state state;         /* see conn_state */
    http_head head;           /* head being read (valid in CONN_READ_BODY) */
    http_body_reader body_rd; /* body framing of that head */
    struct evbuffer *body;    /* (body bytes) so far */
    hs_req *req;              /* request being served (CONN_HANDLING) */
    int keep_alive;           /* connection stays open after this reply */
    struct evbuffer *stage;   /* reply bytes being composed, sent by conn_flush */
    struct event *flush_ev;   /* deferred conn_flush (hs_reply_flush) */
    struct event *deadline;   /* header / request deadline; bytes do not move it */
    uint64_t started_ns;      /* clock_now_ns when the request started (see hs_config) */
    int receiving;            /* a request's first byte came and it is not dispatched */
    int armed_early;          /* the head deadline runs from accept / the last reply */
    int lingering;            /* error sent: draining input until EOF or LINGER_S, then close */
    int in_process;           /* inside process_input (defer frees) */
    int want_free;            /* free when process_input unwinds */
    hs_conn *prev, *next;     /* server's connection list */
};

struct hs_server {
    struct event_base *base;     /* loop */
    struct evconnlistener *lst;  /* listening socket */
    hs_config cfg;               /* limits and timeouts */
    hs_handler_fn handler;       /* request callback */
    void *handler_arg;           /* its argument */
    hs_error_body_fn error_body; /* builds protocol error bodies */
    hs_conn *conns;              /* live connections */
    int nconns;                  /* their count */
    uint16_t port;               /* bound port */
    struct event *resume_ev;     /* re-enables accepting after EMFILE */
    uint64_t accept_errors;      /* accept failures (logged once per pause) */
};

void hs_config_default(hs_config *c) {
    memset(c, 0, sizeof *c);
    c->limits.max_head_bytes = 64 * 1024;
    c->limits.max_headers = 100;
    c->max_body_bytes = 16u << 20;
    c->header_timeout_s = 60;
    c->request_timeout_s = 60;
    c->idle_timeout_s = 75;
    c->write_timeout_s = 300;
    c->max_output_bytes = 256 * 1024;
    c->max_connections = 16384;
}

static struct timeval tv_of(double s) {
    struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
    return tv;
}

/* Sends the staged reply bytes: straight to the socket when nothing is queued
 * (saves the epoll round trip and the add/remove of write interest), the rest
 * through the bufferevent's output. */
static void conn_flush(hs_conn *c) {
    struct evbuffer *out = bufferevent_get_output(c->bev);
    if (evbuffer_get_length(out) == 0 && evbuffer_get_length(c->stage) > 0) {
        struct evbuffer_iovec v[16];
        int n = evbuffer_peek(c->stage, -1, NULL, v, 16);
        struct msghdr m = {0};
        m.msg_iov = (struct iovec *)v; /* evbuffer_iovec is struct iovec on POSIX */
        m.msg_iovlen = (size_t)(n < 16 ? n : 16);
        ssize_t w = sendmsg(bufferevent_getfd(c->bev), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) evbuffer_drain(c->stage, (size_t)w);
    }
    if (evbuffer_get_length(c->stage)) evbuffer_add_buffer(out, c->stage);
}

/* Unsent reply bytes. */
static size_t conn_unsent(hs_conn *c) {
    return evbuffer_get_length(bufferevent_get_output(c->bev));
}

static void req_free(hs_req *r) {
    http_head_free(&r->head);
    evbuffer_free(r->body);
    if (r->out_headers) evbuffer_free(r->out_headers);
    free(r->path);
    free(r);
}

static void conn_free(hs_conn *c) {
    if (c->in_process) {
        c->want_free = 1;
        return;
    }
    hs_server *s = c->srv;
    if (c->req) {
        hs_req *r = c->req;
        c->req = NULL;
        if (r->close_cb) r->close_cb(r, r->close_arg);
        req_free(r);
    }
    http_head_free(&c->head);
    if (c->body) evbuffer_free(c->body);
    bufferevent_free(c->bev);
    evbuffer_free(c->stage);
    event_free(c->flush_ev);
    event_free(c->deadline);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->nconns--;
    free(c);
}

/* The error reply is out: stop sending, drain the input until EOF or LINGER_S. */
static void linger_start(hs_conn *c) {
    shutdown(bufferevent_getfd(c->bev), SHUT_WR);
    evbuffer_drain(bufferevent_get_input(c->bev),
                   evbuffer_get_length(bufferevent_get_input(c->bev)));
    struct timeval tv = tv_of(LINGER_S);
    event_add(c->deadline, &tv);
}

/* Sends a protocol error reply and closes the connection after it. */
static void conn_error(hs_conn *c, int status, const char *message) {
    LOG_D(MOD, "%s: %d %s", c->peer, status, message);
    char *body = c->srv->error_body ? c->srv->error_body(status, message) : NULL;
    if (body)
        evbuffer_add_printf(c->stage,
                            "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                            "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                            status, http_reason(status), strlen(body), body);
    else
        evbuffer_add_printf(c->stage,
                            "HTTP/1.1 %d %s\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
                            status, http_reason(status));
    free(body);
    conn_flush(c);
    http_head_free(&c->head);
    c->receiving = 0;
    c->armed_early = 0;
    event_del(c->deadline);
    c->state = CONN_CLOSING;
    c->lingering = 1;
    bufferevent_set_timeouts(c->bev, NULL, NULL);
    if (conn_unsent(c) == 0) linger_start(c);
}

static int head_status(int rc) {
    return rc == HTTP_EHEAD_TOO_LARGE || rc == HTTP_ETOO_MANY_HEADERS ? 431 : 400;
}

/* Arms the deadline at end_ns (0: none). */
static void deadline_at(hs_conn *c, uint64_t end_ns) {
    if (!end_ns) {
        event_del(c->deadline);
        return;
    }
    uint64_t now = clock_now_ns(), left = end_ns > now ? end_ns - now : 0;
    struct timeval tv = {(time_t)(left / 1000000000u), (suseconds_t)(left % 1000000000u / 1000)};
    event_add(c->deadline, &tv);
}

/* The earlier of two deadlines `a_s` after `a_from` and `b_s` after `b_from`
 * (a limit of 0 or less: none; both none: 0). */
static uint64_t deadline_min(uint64_t a_from, double a_s, uint64_t b_from, double b_s) {
    uint64_t a = a_s > 0 ? a_from + (uint64_t)(a_s * 1e9) : 0;
    uint64_t b = b_s > 0 ? b_from + (uint64_t)(b_s * 1e9) : 0;
    return !a ? b : !b ? a : a < b ? a : b;
}

/* A request's head starts now (its first byte, or the accept / the last
 * reply with head_from_*): no idle timeout, the head deadline runs. */
static void head_starts(hs_conn *c) {
    hs_config *cfg = &c->srv->cfg;
    c->started_ns = clock_now_ns();
    bufferevent_set_timeouts(c->bev, NULL, NULL);
    deadline_at(c, deadline_min(c->started_ns, cfg->header_timeout_s, c->started_ns,
                                cfg->request_timeout_s));
}

/* Between requests: the next head's deadline now (head_from_*), or the
 * idle timeout until its first byte. */
static void wait_next(hs_conn *c, int first) {
    hs_config *cfg = &c->srv->cfg;
    if (first ? cfg->head_from_accept : cfg->head_from_reply) {
        c->armed_early = 1;
        head_starts(c);
        return;
    }
    struct timeval it = tv_of(cfg->idle_timeout_s);
    bufferevent_set_timeouts(c->bev, &it, NULL);
}

/* The first byte of a request. */
static void request_begins(hs_conn *c) {
    c->receiving = 1;
    if (!c->armed_early) head_starts(c);
}

static void deadline_cb(evutil_socket_t fd, short what, void *arg) {
    hs_conn *c = arg;
    hs_server *s = c->srv;
    if (c->lingering) { /* the client did not close in LINGER_S */
        conn_free(c);
        return;
    }
    if (!c->receiving && !c->armed_early) return;
    if (!c->receiving && !s->cfg.idle_408) { /* nothing was asked */
        LOG_D(MOD, "%s: no request within %g s: closing", c->peer, s->cfg.header_timeout_s);
        if (s->cfg.on_deadline) s->cfg.on_deadline(s->cfg.on_deadline_arg, HS_DEADLINE_IDLE);
        conn_free(c);
        return;
    }
    int head = c->state == CONN_READ_HEAD;
    c->receiving = 0;
    c->armed_early = 0;
    LOG_D(MOD, "%s: request not received in time (%s): 408, closing", c->peer,
          head ? "head" : "body");
    if (s->cfg.on_deadline)
        s->cfg.on_deadline(s->cfg.on_deadline_arg, head ? HS_DEADLINE_HEADER : HS_DEADLINE_BODY);
    conn_error(c, 408,
               head ? "timed out reading the request head (see --client-header-timeout)"
                    : "timed out reading the request (see --client-timeout)");
}

static void dispatch(hs_conn *c) {
    hs_req *r = calloc(1, sizeof *r);
    if (!r) {
        conn_error(c, 500, "out of memory");
        return;
    }
    r->conn = c;
    r->head = c->head;
    memset(&c->head, 0, sizeof c->head);
    r->body = c->body;
    c->body = NULL;
    size_t plen = strcspn(r->head.target, "?");
    r->path = strndup(r->head.target, plen);
    c->keep_alive = r->head.keep_alive;
    c->req = r;
    c->state = CONN_HANDLING;
    c->receiving = 0;
    c->armed_early = 0;
    event_del(c->deadline);
    /* No read timeout while serving: the client waits for us.  Reading stays
     * on so that EOF (client gone) is seen at once. */
    struct timeval wt = tv_of(c->srv->cfg.write_timeout_s);
    bufferevent_set_timeouts(c->bev, NULL, &wt);
    c->srv->handler(r, c->srv->handler_arg);
}

/* Parses what the input holds; returns when it needs more bytes or a request
 * is being served. */
static void process_input(hs_conn *c) {
    hs_server *s = c->srv;
    struct evbuffer *in = bufferevent_get_input(c->bev);
    c->in_process = 1;
    for (;;) {
        if (c->state == CONN_READ_HEAD) {
            if (evbuffer_get_length(in) == 0) break;
            if (!c->receiving) request_begins(c);
            int rc = http_head_parse(in, 1, &s->cfg.limits, &c->head);
            if (rc == 0) break;
            if (rc < 0) {
                conn_error(c, rc == -ENOMEM ? 500 : head_status(rc),
                           rc == HTTP_EHEAD_TOO_LARGE     ? "request head too large"
                           : rc == HTTP_ETOO_MANY_HEADERS ? "too many request headers"
                                                          : "malformed HTTP request");
                break;
            }
            if (c->head.content_length > (int64_t)s->cfg.max_body_bytes) {
                char msg[160];
                snprintf(msg, sizeof msg,
                         "request body of %lld bytes is over the limit of %zu bytes",
                         (long long)c->head.content_length, s->cfg.max_body_bytes);
                conn_error(c, 413, msg);
                break;
            }
            const char *expect = http_head_get(&c->head, "Expect");
            if (expect && !strcasecmp(expect, "100-continue") && c->head.minor >= 1) {
                evbuffer_add(c->stage, "HTTP/1.1 100 Continue\r\n\r\n", 25);
                conn_flush(c);
            }
            http_body_init(&c->body_rd, &c->head, 0);
            c->body = evbuffer_new();
            deadline_at(c, deadline_min(c->started_ns, s->cfg.request_timeout_s, clock_now_ns(),
                                        s->cfg.body_timeout_s));
            c->state = CONN_READ_BODY;
        }
        if (c->state == CONN_READ_BODY) {
            int rc = http_body_read(&c->body_rd, in, c->body);
            if (evbuffer_get_length(c->body) > s->cfg.max_body_bytes) {
                char msg[160];
                snprintf(msg, sizeof msg, "request body is over the limit of %zu bytes",
                         s->cfg.max_body_bytes);
                conn_error(c, 413, msg);
                break;
            }
            if (rc < 0) {
                conn_error(c, 400, "malformed chunked request body");
                break;
            }
            if (rc == 0) break;
            dispatch(c);
            continue;
        }
        break; /* HANDLING or CLOSING: pipelined bytes wait in the input */
    }
    c->in_process = 0;
    if (c->want_free) conn_free(c);
}

static void read_cb(struct bufferevent *bev, void *arg) {
    hs_conn *c = arg;
    if (c->lingering) {
        evbuffer_drain(bufferevent_get_input(bev), evbuffer_get_length(bufferevent_get_input(bev)));
        return;
    }
    if (c->state == CONN_READ_HEAD || c->state == CONN_READ_BODY) process_input(c);
}

static void write_cb(struct bufferevent *bev, void *arg) {
    hs_conn *c = arg;
    if (c->state == CONN_CLOSING) {
        if (evbuffer_get_length(bufferevent_get_output(bev)) == 0) {
            if (c->lingering)
                linger_start(c);
            else
                conn_free(c);
        }
        return;
    }
    if (c->req && c->req->paused) {
        c->req->paused = 0;
        if (c->req->drain_cb) c->req->drain_cb(c->req, c->req->drain_arg);
    }
}

static void event_cb(struct bufferevent *bev, short what, void *arg) {
    hs_conn *c = arg;
    (void)bev;
    /* The only read timeout is the idle one (no byte of a request yet):
     * close silently, as a keep-alive connection's end. */
    hs_server *s = c->srv;
    if ((what & BEV_EVENT_TIMEOUT) && (what & BEV_EVENT_READING) && s->cfg.on_deadline)
        s->cfg.on_deadline(s->cfg.on_deadline_arg, HS_DEADLINE_IDLE);
    LOG_D(MOD, "%s: connection %s", c->peer,
          what & BEV_EVENT_EOF       ? "closed by the client"
          : what & BEV_EVENT_TIMEOUT ? (what & BEV_EVENT_READING ? "idle (keep-alive timeout)"
                                                                 : "not reading (write timeout)")
                                     : "error");
    conn_free(c);
}

static void flush_cb(evutil_socket_t fd, short what, void *arg) {
    conn_flush(arg);
}

static void accept_cb(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int salen,
                      void *arg) {
    hs_server *s = arg;
    (void)l;
    if (s->nconns >= s->cfg.max_connections) {
        LOG_W(MOD, "connection limit %d reached: closing a new connection", s->cfg.max_connections);
        evutil_closesocket(fd);
        return;
    }
    hs_conn *c = calloc(1, sizeof *c);
    if (!c) {
        evutil_closesocket(fd);
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->srv = s;
    net_addr a;
    memcpy(&a.ss, sa, (size_t)salen);
    a.len = (socklen_t)salen;
    net_addr_format(&a, c->peer, sizeof c->peer);
    c->bev = bufferevent_socket_new(s->base, fd, BEV_OPT_CLOSE_ON_FREE);
    c->stage = evbuffer_new();
    c->flush_ev = event_new(s->base, -1, 0, flush_cb, c);
    c->deadline = evtimer_new(s->base, deadline_cb, c);
    if (!c->bev || !c->stage || !c->flush_ev || !c->deadline) {
        if (c->bev)
            bufferevent_free(c->bev);
        else
            evutil_closesocket(fd);
        if (c->stage) evbuffer_free(c->stage);
        if (c->flush_ev) event_free(c->flush_ev);
        if (c->deadline) event_free(c->deadline);
        free(c);
        return;
    }
    bufferevent_setcb(c->bev, read_cb, write_cb, event_cb, c);
    bufferevent_set_max_single_read(c->bev, 256 * 1024);
    bufferevent_set_max_single_write(c->bev, 256 * 1024);
    bufferevent_setwatermark(c->bev, EV_READ, 0, s->cfg.limits.max_head_bytes + (1u << 20));
    bufferevent_setwatermark(c->bev, EV_WRITE, s->cfg.max_output_bytes / 4, 0);
    wait_next(c, 1);
    bufferevent_enable(c->bev, EV_READ | EV_WRITE);
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->nconns++;
}

static void resume_cb(evutil_socket_t fd, short what, void *arg) {
    hs_server *s = arg;
    if (s->lst) evconnlistener_enable(s->lst);
}

/* accept() failed (EMFILE/ENFILE: out of descriptors): pause accepting for
 * 100 ms instead of spinning on the always-readable listening socket. */
static void accept_error_cb(struct evconnlistener *l, void *arg) {
    hs_server *s = arg;
    int err = EVUTIL_SOCKET_ERROR();
    if (s->accept_errors++ % 100 == 0)
        LOG_W(MOD, "accept failed: %s (%d connections open); pausing new connections for 100 ms",
              strerror(err), s->nconns);
    evconnlistener_disable(l);
    struct timeval tv = {0, 100000};
    event_add(s->resume_ev, &tv);
}

static hs_server *server_alloc(struct event_base *base, const hs_config *cfg, hs_handler_fn handler,
                               void *arg, hs_error_body_fn error_body) {
    hs_server *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->base = base;
    s->cfg = *cfg;
    s->handler = handler;
    s->handler_arg = arg;
    s->error_body = error_body;
    return s;
}

static hs_server *server_listening(hs_server *s) {
    s->resume_ev = evtimer_new(s->base, resume_cb, s);
    evconnlistener_set_error_cb(s->lst, accept_error_cb);
    net_addr bound;
    if (net_local_addr(evconnlistener_get_fd(s->lst), &bound) == 0) s->port = net_addr_port(&bound);
    return s;
}

hs_server *hs_server_new(struct event_base *base, const char *host, uint16_t port,
                         const hs_config *cfg, hs_handler_fn handler, void *arg,
                         hs_error_body_fn error_body) {
    net_addr addr;
    int rc = net_resolve(host, port, &addr);
    if (rc) {
        LOG_E(MOD, "cannot resolve listen address '%s': %s", host, strerror(-rc));
        return NULL;
    }
    hs_server *s = server_alloc(base, cfg, handler, arg, error_body);
    if (!s) return NULL;
    s->lst = evconnlistener_new_bind(base, accept_cb, s, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE,
                                     4096, (struct sockaddr *)&addr.ss, (int)addr.len);
    if (!s->lst) {
        LOG_E(MOD, "cannot listen on %s:%u: %s", host, port, strerror(errno));
        free(s);
        return NULL;
    }
    return server_listening(s);
}

hs_server *hs_server_new_fd(struct event_base *base, int listen_fd, const hs_config *cfg,
                            hs_handler_fn handler, void *arg, hs_error_body_fn error_body) {
    hs_server *s = server_alloc(base, cfg, handler, arg, error_body);
    if (s) {
        evutil_make_socket_nonblocking(listen_fd);
        s->lst = evconnlistener_new(base, accept_cb, s, LEV_OPT_CLOSE_ON_FREE, -1, listen_fd);
    }
    if (!s || !s->lst) {
        LOG_E(MOD, "cannot accept on a listening socket: out of memory");
        free(s);
        close(listen_fd);
        return NULL;
    }
    return server_listening(s);
}

uint16_t hs_server_port(const hs_server *s) {
    return s->port;
}
int hs_server_connections(const hs_server *s) {
    return s->nconns;
}

void hs_server_stop_listening(hs_server *s) {
    if (!s->lst) return;
    evconnlistener_free(s->lst);
    s->lst = NULL;
    if (s->resume_ev) event_del(s->resume_ev);
}

void hs_server_free(hs_server *s) {
    if (!s) return;
    if (s->lst) evconnlistener_free(s->lst);
    if (s->resume_ev) event_free(s->resume_ev);
    while (s->conns)
        conn_free(s->conns);
    free(s);
}

const http_head *hs_req_head(const hs_req *r) {
    return &r->head;
}
const char *hs_req_path(const hs_req *r) {
    return r->path ? r->path : "";
}
const char *hs_req_body(hs_req *r, size_t *len) {
    *len = evbuffer_get_length(r->body);
    return *len ? (const char *)evbuffer_pullup(r->body, -1) : "";
}
void hs_req_set_close_cb(hs_req *r, hs_close_fn cb, void *arg) {
    r->close_cb = cb;
    r->close_arg = arg;
}
void hs_req_set_drain_cb(hs_req *r, hs_drain_fn cb, void *arg) {
    r->drain_cb = cb;
    r->drain_arg = arg;
}
const char *hs_req_peer(const hs_req *r) {
    return r->conn->peer;
}
struct evbuffer *hs_req_body_buffer(hs_req *r) {
    return r->body;
}
int hs_req_add_header(hs_req *r, const char *name, const char *value) {
    if (strpbrk(name, "\r\n:") || strpbrk(value, "\r\n")) return -EINVAL; /* no injection */
    if (!r->out_headers && !(r->out_headers = evbuffer_new())) return -ENOMEM;
    return evbuffer_add_printf(r->out_headers, "%s: %s\r\n", name, value) < 0 ? -ENOMEM : 0;
}

/* The request is over: free it and get ready for the next one. */
static void req_finish(hs_req *r) {
    hs_conn *c = r->conn;
    c->req = NULL;
    req_free(r);
    if (!c->keep_alive) {
        c->state = CONN_CLOSING;
        bufferevent_disable(c->bev, EV_READ);
        if (evbuffer_get_length(bufferevent_get_output(c->bev)) == 0) conn_free(c);
        return;
    }
    c->state = CONN_READ_HEAD;
    wait_next(c, 0);
    if (!c->in_process && evbuffer_get_length(bufferevent_get_input(c->bev)) > 0) process_input(c);
}

static void add_conn_header(hs_req *r, struct evbuffer *out) {
    if (!r->conn->keep_alive)
        evbuffer_add(out, "Connection: close\r\n", 19);
    else if (r->head.minor == 0)
        evbuffer_add(out, "Connection: keep-alive\r\n", 24);
}

int hs_reply(hs_req *r, int status, const char *content_type, const char *extra_headers,
             const void *body, size_t len) {
    struct evbuffer *out = r->conn->stage;
    evbuffer_add_printf(out, "HTTP/1.1 %d %s\r\n", status, http_reason(status));
    if (content_type) evbuffer_add_printf(out, "Content-Type: %s\r\n", content_type);
    if (extra_headers) evbuffer_add(out, extra_headers, strlen(extra_headers));
    if (r->out_headers) evbuffer_add_buffer(out, r->out_headers);
    evbuffer_add_printf(out, "Content-Length: %zu\r\n", len);
    add_conn_header(r, out);
    evbuffer_add(out, "\r\n", 2);
    if (strcmp(r->head.method, "HEAD") != 0) evbuffer_add(out, body, len);
    conn_flush(r->conn);
    req_finish(r);
    return 0;
}

static int is_hop_by_hop(const char *name) {
    /* RFC 9110 7.6.1 connection-specific fields, and the framing we redo. */
    static const char *const hop[] = {"Connection",     "Keep-Alive",       "Transfer-Encoding",
                                      "Content-Length", "Proxy-Connection", "TE",
                                      "Trailer",        "Upgrade"};
    for (size_t i = 0; i < sizeof hop / sizeof hop[0]; i++)
        if (!strcasecmp(name, hop[i])) return 1;
    return 0;
}

int hs_reply_start(hs_req *r, int status, const http_header *headers, int n,
                   int64_t content_length) {
    struct evbuffer *out = r->conn->stage;
    evbuffer_add_printf(out, "HTTP/1.1 %d %s\r\n", status, http_reason(status));
    for (int i = 0; i < n; i++)
        if (!is_hop_by_hop(headers[i].name))
            evbuffer_add_printf(out, "%s: %s\r\n", headers[i].name, headers[i].value);
    if (r->out_headers) evbuffer_add_buffer(out, r->out_headers);
    if (content_length >= 0) {
        evbuffer_add_printf(out, "Content-Length: %lld\r\n", (long long)content_length);
    } else if (r->head.minor >= 1) {
        evbuffer_add(out, "Transfer-Encoding: chunked\r\n", 28);
        r->chunked = 1;
    } else {
        r->conn->keep_alive = 0; /* HTTP/1.0: body ends at close */
    }
    add_conn_header(r, out);
    evbuffer_add(out, "\r\n", 2);
    r->started = 1;
    return 0;
}

void hs_reply_flush(hs_req *r) {
    /* After the callbacks of this loop turn: bytes that arrive with the
     * head (the usual case) then go out in the same write. */
    event_active(r->conn->flush_ev, EV_TIMEOUT, 0);
}

int hs_reply_data(hs_req *r, struct evbuffer *data) {
    size_t n = evbuffer_get_length(data);
    if (n == 0) return 0;
    struct evbuffer *out = r->conn->stage;
    if (r->chunked) evbuffer_add_printf(out, "%zx\r\n", n);
    evbuffer_add_buffer(out, data);
    if (r->chunked) evbuffer_add(out, "\r\n", 2);
    conn_flush(r->conn);
    if (conn_unsent(r->conn) > r->conn->srv->cfg.max_output_bytes) {
        r->paused = 1;
        return 1;
    }
    return 0;
}

int hs_reply_end(hs_req *r) {
    if (r->chunked) evbuffer_add(r->conn->stage, "0\r\n\r\n", 5);
    conn_flush(r->conn);
    req_finish(r);
    return 0;
}

void hs_reply_abort(hs_req *r) {
    r->close_cb = NULL;
    r->conn->keep_alive = 0;
    hs_conn *c = r->conn;
    c->state = CONN_CLOSING;
    conn_free(c);
}
