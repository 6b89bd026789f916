/*
 * http_conn — per-connection deadlines that evhttp 2.1 lacks: its only
 * timeout is per read, so a client sending one byte a second holds a
 * connection (and a slot of the loop) forever, and an idle keep-alive
 * connection lives as long as that timeout.  Here every connection gets:
 *   - a header deadline (--client-header-timeout, nginx's
 *     client_header_timeout): the head must be complete this long after its
 *     first byte (a new connection: after it was accepted); bytes do not
 *     move it.  When it passes, the server answers 408 and closes.
 *   - a keep-alive timeout (--timeout-keep-alive, uvicorn's; vLLM's default
 *     5 s): a connection without a byte of a next request this long after a
 *     response is closed.
 *   - a body deadline (--client-body-timeout; nginx's client_body_timeout is
 *     per read, this one is not): once the head is complete, the body must be
 *     in this long after; bytes do not move it.  When it passes, the server
 *     answers 408 and closes.
 * Once the request is dispatched (head and body in, being served) no deadline
 * of ours runs; evhttp's per-read timeout still does.  Each deadline close is
 * counted in disagg:http_deadline_closes_total{kind}.
 *
 * How: evhttp_set_bevcb makes the connection's bufferevent here, with a
 * callback on its input buffer that sees every arrival before evhttp parses
 * it (head start, blank line that ends the head).  The connection's close
 * callback is owned by this module (it frees the state); gen.c registers its
 * own through http_conn_set_close_cb.  The state is found by socket fd.
 * A pipelined request whose head is already buffered when the previous
 * response ends is not timed (evhttp dispatches it at once).
 */
#include "server/server_ctx.h"

#include "base/log.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

typedef enum conn_phase {
    PHASE_NEW = 0,   /* accepted, no byte yet: header deadline from accept */
    PHASE_KEEPALIVE, /* between requests, no byte yet: keep-alive timeout */
    PHASE_HEAD,      /* head bytes arriving: header deadline from the first */
    PHASE_BODY,      /* head complete, body arriving: body deadline from the head's end */
    PHASE_BUSY       /* request dispatched: handling, reply — no deadline here */
} conn_phase;

struct http_conn {
    server *s;                     /* owner */
    struct bufferevent *bev;       /* the connection's bufferevent (evhttp owns it) */
    struct evhttp_connection *evc; /* its evhttp connection, once registered */
    evutil_socket_t fd;            /* its socket, once registered */
    struct event *init;            /* deferred registration (runs before any I/O) */
    struct event *timer;           /* the deadline of the current phase */
    conn_phase phase;              /* see conn_phase */
    int eol;                       /* head scanner: 0 in a line, 1 after LF, 2 after LF CR */
    http_conn_close_fn close_fn;   /* gen.c's close callback, or NULL */
    void *close_arg;               /* its argument */
    struct http_conn *prev, *next; /* server's list */
};

static struct timeval tv_of(double s) {
    struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
    return tv;
}

static void conn_arm(http_conn *c, double s) {
    if (s <= 0) {
        event_del(c->timer);
        return;
    }
    struct timeval tv = tv_of(s);
    event_add(c->timer, &tv);
}

static void conn_input(struct evbuffer *buf, const struct evbuffer_cb_info *info, void *arg);

static void conn_unlink_free(http_conn *c) {
    server *s = c->s;
    if (c->fd >= 0 && c->fd < s->n_conn_by_fd && s->conn_by_fd[c->fd] == c)
        s->conn_by_fd[c->fd] = NULL;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    if (c->bev) evbuffer_remove_cb(bufferevent_get_input(c->bev), conn_input, c);
    event_free(c->init);
    event_free(c->timer);
    free(c);
}

/* evhttp closes the connection (client gone, error, our deadline, shutdown). */
static void conn_closed(struct evhttp_connection *evc, void *arg) {
    http_conn *c = arg;
    if (c->close_fn) c->close_fn(evc, c->close_arg);
    conn_unlink_free(c); /* evhttp frees the bufferevent right after this */
}

static void conn_timeout(evutil_socket_t fd, short what, void *arg) {
    http_conn *c = arg;
    if (!c->evc || c->phase == PHASE_BUSY) return;
    if (c->phase == PHASE_KEEPALIVE) {
        LOG_D("server", "fd %d: keep-alive connection idle for %g s: closing", (int)c->fd,
              c->s->cfg.keepalive_timeout_s);
        c->s->metrics.deadline_closes[METRICS_DEADLINE_KEEPALIVE]++;
    } else {
        static const char r408[] = "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
                                   "Content-Length: 0\r\n\r\n";
        int body = c->phase == PHASE_BODY;
        LOG_D("server", "fd %d: request %s not complete within %g s: 408, closing", (int)c->fd,
              body ? "body" : "head", body ? c->s->cfg.body_timeout_s : c->s->cfg.header_timeout_s);
        c->s->metrics.deadline_closes[body ? METRICS_DEADLINE_BODY : METRICS_DEADLINE_HEADER]++;
        (void)send(c->fd, r408, sizeof r408 - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    evhttp_connection_free(c->evc); /* calls conn_closed, which frees c */
}

/* Bytes arrived (or were consumed) in the connection's input buffer. */
static void conn_input(struct evbuffer *buf, const struct evbuffer_cb_info *info, void *arg) {
    http_conn *c = arg;
    if (info->n_added == 0 || c->phase == PHASE_BUSY || c->phase == PHASE_BODY) return;
    if (c->phase != PHASE_HEAD) {
        if (c->phase == PHASE_KEEPALIVE) conn_arm(c, c->s->cfg.header_timeout_s);
        c->phase = PHASE_HEAD; /* a new connection keeps its deadline from accept */
        c->eol = 0;
    }
    size_t len = evbuffer_get_length(buf);
    if (info->n_added > len) return;
    struct evbuffer_ptr pos;
    if (evbuffer_ptr_set(buf, &pos, len - info->n_added, EVBUFFER_PTR_SET) < 0) return;
    struct evbuffer_iovec v[8];
    int n = evbuffer_peek(buf, (ev_ssize_t)info->n_added, &pos, v, 8);
    size_t left = info->n_added;
    for (int i = 0; i < n && i < 8 && left; i++) {
        const unsigned char *p = v[i].iov_base;
        size_t k = v[i].iov_len < left ? v[i].iov_len : left;
        left -= k;
        for (size_t j = 0; j < k; j++) { /* a blank line (LF LF or LF CR LF) ends the head */
            if (p[j] == '\n') {
                if (c->eol) { /* evhttp dispatches it (PHASE_BUSY) once the body is in */
                    c->phase = PHASE_BODY;
                    conn_arm(c, c->s->cfg.body_timeout_s);
                    return;
                }
                c->eol = 1;
            } else {
                c->eol = p[j] == '\r' && c->eol == 1 ? 2 : 0;
            }
        }
    }
}

/* Deferred from the bufferevent's creation: evhttp has made the connection
 * by now (the bufferevent's callback argument) and no I/O has run on it. */
static void conn_register(evutil_socket_t unused, short what, void *arg) {
    http_conn *c = arg;
    server *s = c->s;
    bufferevent_data_cb rd = NULL;
    void *evc = NULL;
    bufferevent_getcb(c->bev, &rd, NULL, NULL, &evc);
    evutil_socket_t fd = bufferevent_getfd(c->bev);
    if (!rd || !evc || fd < 0) { /* evhttp gave up on it already (out of memory) */
        conn_unlink_free(c);
        return;
    }
    /* Responses go out in several small writes (head, then each chunk of a stream): with
     * Nagle's algorithm a keep-alive peer's delayed ACK (the proxy's pooled upstream
     * connections) held the second one ~40 ms, which was most of a P/D TTFT. */
    int one = 1;
    setsockopt((int)fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* not TCP (unix): no-op */
    if (fd >= s->n_conn_by_fd) {
        int n = s->n_conn_by_fd ? s->n_conn_by_fd : 64;
        while (n <= fd)
            n *= 2;
        http_conn **t = realloc(s->conn_by_fd, (size_t)n * sizeof *t);
        if (!t) { /* no deadlines for this one */
            LOG_W("server", "out of memory: connection fd %d runs without deadlines", (int)fd);
            evbuffer_remove_cb(bufferevent_get_input(c->bev), conn_input, c);
            c->bev = NULL;
            conn_unlink_free(c);
            return;
        }
        memset(t + s->n_conn_by_fd, 0, (size_t)(n - s->n_conn_by_fd) * sizeof *t);
        s->conn_by_fd = t;
        s->n_conn_by_fd = n;
    }
    c->evc = evc;
    c->fd = fd;
    s->conn_by_fd[fd] = c;
    evhttp_connection_set_closecb(c->evc, conn_closed, c);
}

static struct bufferevent *conn_new_bev(struct event_base *base, void *arg) {
    server *s = arg;
    http_conn *c = calloc(1, sizeof *c);
    struct bufferevent *bev = bufferevent_socket_new(base, -1, 0); /* as evhttp's own */
    if (!c || !bev) {
        free(c);
        return bev; /* evhttp makes its own when NULL */
    }
    c->s = s;
    c->bev = bev;
    c->fd = -1;
    c->init = event_new(base, -1, 0, conn_register, c);
    c->timer = evtimer_new(base, conn_timeout, c);
    if (!c->init || !c->timer ||
        evbuffer_add_cb(bufferevent_get_input(bev), conn_input, c) == NULL) {
        if (c->init) event_free(c->init);
        if (c->timer) event_free(c->timer);
        free(c);
        return bev;
    }
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    conn_arm(c, s->cfg.header_timeout_s);
    event_active(c->init, EV_TIMEOUT, 0);
    return bev;
}

static http_conn *conn_of(server *s, struct evhttp_connection *evc) {
    struct bufferevent *bev = evc ? evhttp_connection_get_bufferevent(evc) : NULL;
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd < 0 || fd >= s->n_conn_by_fd) return NULL;
    http_conn *c = s->conn_by_fd[fd];
    return c && c->evc == evc ? c : NULL;
}

/* ---- interface (server_ctx.h) --------------------------------------------- */

void http_conn_install(server *s) {
    evhttp_set_bevcb(s->http, conn_new_bev, s);
}

static void conn_reply_done(struct evhttp_request *req, void *arg) {
    server *s = arg;
    http_conn *c = conn_of(s, evhttp_request_get_connection(req));
    if (!c) return;
    c->phase = PHASE_KEEPALIVE; /* evhttp reads the next request, or closes */
    conn_arm(c, s->cfg.keepalive_timeout_s);
}

void http_conn_request_begins(server *s, struct evhttp_request *req) {
    http_conn *c = conn_of(s, evhttp_request_get_connection(req));
    if (!c) return;
    c->phase = PHASE_BUSY;
    event_del(c->timer);
    evhttp_request_set_on_complete_cb(req, conn_reply_done, s);
}

void http_conn_set_close_cb(server *s, struct evhttp_connection *evc, http_conn_close_fn fn,
                            void *arg) {
    http_conn *c = conn_of(s, evc);
    if (c) {
        c->close_fn = fn;
        c->close_arg = arg;
    } else if (evc) {
        evhttp_connection_set_closecb(evc, fn, arg);
    }
}

void http_conn_free_all(server *s) {
    while (s->conns) {
        s->conns->bev = NULL; /* freed with evhttp */
        conn_unlink_free(s->conns);
    }
    free(s->conn_by_fd);
    s->conn_by_fd = NULL;
    s->n_conn_by_fd = 0;
}
