/* http_client — see http_client.h. */
#include "base/http_client.h"

#include "base/log.h"
#include "base/net.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#define MOD "upstream"

typedef struct hc_conn hc_conn;

struct hc_conn {
    hc_pool *pool;           /* owner */
    struct bufferevent *bev; /* the socket */
    hc_req *req;             /* request in flight, NULL while idle */
    int connected;           /* TCP connect completed */
    int uses;                /* requests started on it */
    hc_conn *next_idle;      /* pool idle list link */
};

struct hc_pool {
    struct event_base *base; /* loop */
    char host[256];          /* upstream host as given */
    uint16_t port;           /* upstream port */
    net_addr addr;           /* resolved once */
    int resolved;            /* 0: resolution failed (requests fail HC_ERESOLVE) */
    hc_conn *idle;           /* idle keep-alive connections */
    int nidle;               /* their count */
    int max_idle;            /* cap on idle connections kept */
    double keepalive_s;      /* idle connection lifetime, 0 = unbounded */
};

struct hc_req {
    hc_pool *pool;         /* where it goes */
    hc_conn *conn;         /* its connection, NULL before start / after end */
    struct evbuffer *wire; /* (request bytes) kept to resend on a stale keep-alive */
    int is_head;           /* HEAD request: response has no body */
    hc_callbacks cb;       /* user callbacks */
    void *arg;             /* their argument */
    hc_timeouts t;         /* timeouts */
    http_head head;        /* response head (after have_head) */
    int have_head;         /* head parsed */
    http_body_reader rd;   /* body framing */
    struct evbuffer *data; /* (decoded bytes) handed to on_data */
    int got_bytes;         /* any response byte received */
    int paused;            /* reading stopped by hc_pause */
    int retried;           /* resent once after a stale keep-alive */
    int in_cb;             /* inside a user callback */
    int cancelled;         /* hc_cancel called (inside a callback) */
    int pending_err;       /* error to report from the kick event */
    struct event *kick;    /* deferred work: start failure, resume after pause */
};

static const http_limits RESP_LIMITS = {64 * 1024, 200};

const char *hc_strerror(int err) {
    switch (err) {
    case 0:
        return "ok";
    case HC_ECONNECT:
        return "connection failed (refused or unreachable)";
    case HC_ERESET:
        return "connection closed before the response ended";
    case HC_ETIMEOUT:
        return "timed out waiting for the response";
    case HC_EPROTO:
        return "malformed HTTP response";
    case HC_ERESOLVE:
        return "host name did not resolve";
    default:
        return "error";
    }
}

static struct timeval tv_of(double s) {
    struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
    return tv;
}

hc_pool *hc_pool_new(struct event_base *base, const char *host, uint16_t port, int max_idle) {
    hc_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->base = base;
    snprintf(p->host, sizeof p->host, "%s", host);
    p->port = port;
    p->max_idle = max_idle;
    p->resolved = net_resolve(host, port, &p->addr) == 0;
    if (!p->resolved) LOG_W(MOD, "cannot resolve upstream host '%s'", host);
    return p;
}

static void conn_close(hc_conn *c) {
    bufferevent_free(c->bev);
    free(c);
}

static void pool_remove_idle(hc_pool *p, hc_conn *c) {
    for (hc_conn **pp = &p->idle; *pp; pp = &(*pp)->next_idle)
        if (*pp == c) {
            *pp = c->next_idle;
            p->nidle--;
            return;
        }
}

void hc_pool_free(hc_pool *p) {
    if (!p) return;
    while (p->idle) {
        hc_conn *c = p->idle;
        p->idle = c->next_idle;
        conn_close(c);
    }
    free(p);
}

void hc_pool_set_keepalive(hc_pool *p, double idle_s) {
    p->keepalive_s = idle_s > 0 ? idle_s : 0;
}

int hc_pool_idle(const hc_pool *p) {
    return p->nidle;
}

static void req_free(hc_req *r) {
    if (r->conn) {
        r->conn->req = NULL;
        conn_close(r->conn);
        r->conn = NULL;
    }
    http_head_free(&r->head);
    evbuffer_free(r->wire);
    evbuffer_free(r->data);
    event_free(r->kick);
    free(r);
}

/* Ends the request: on_done then free.  A cancelled request ends silently. */
static void req_end(hc_req *r, int err) {
    if (!r->cancelled && r->cb.on_done) {
        r->in_cb++;
        r->cb.on_done(r, err, r->arg);
        r->in_cb--;
    }
    req_free(r);
}

/* Puts a finished connection back in the pool or closes it. */
static void conn_release(hc_req *r, int reusable) {
    hc_conn *c = r->conn;
    r->conn = NULL;
    c->req = NULL;
    hc_pool *p = c->pool;
    if (!reusable || p->nidle >= p->max_idle ||
        evbuffer_get_length(bufferevent_get_input(c->bev)) > 0) {
        conn_close(c);
        return;
    }
    struct timeval kt = tv_of(p->keepalive_s); /* conn_event_cb closes it when it fires */
    bufferevent_set_timeouts(c->bev, p->keepalive_s > 0 ? &kt : NULL, NULL);
    bufferevent_enable(c->bev, EV_READ);
    c->next_idle = p->idle;
    p->idle = c;
    p->nidle++;
}

static void conn_read_cb(struct bufferevent *bev, void *arg);
static void conn_event_cb(struct bufferevent *bev, short what, void *arg);

/* Attaches r to an idle connection or a new one and queues its bytes. */
static int req_start(hc_req *r, int fresh_only) {
    hc_pool *p = r->pool;
    hc_conn *c = NULL;
    if (!fresh_only && p->idle) {
        c = p->idle;
        p->idle = c->next_idle;
        p->nidle--;
    } else {
        c = calloc(1, sizeof *c);
        if (!c) return -ENOMEM;
        c->pool = p;
        c->bev = bufferevent_socket_new(p->base, -1, BEV_OPT_CLOSE_ON_FREE);
        if (!c->bev) {
            free(c);
            return -ENOMEM;
        }
        bufferevent_setwatermark(c->bev, EV_READ, 0, 256 * 1024);
        bufferevent_set_max_single_read(c->bev, 256 * 1024);
        bufferevent_set_max_single_write(c->bev, 256 * 1024);
    }
    c->req = r;
    c->uses++;
    r->conn = c;
    bufferevent_setcb(c->bev, conn_read_cb, NULL, conn_event_cb, c);
    struct timeval it = tv_of(r->t.idle_s), ct = tv_of(r->t.connect_s);
    struct evbuffer *out = bufferevent_get_output(c->bev);
    const char *wire = (const char *)evbuffer_pullup(r->wire, -1);
    size_t len = evbuffer_get_length(r->wire), sent = 0;
    if (c->connected && evbuffer_get_length(out) == 0) { /* straight to the socket */
        ssize_t w = send(bufferevent_getfd(c->bev), wire, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) sent = (size_t)w;
    }
    if (sent < len) evbuffer_add(out, wire + sent, len - sent);
    if (!c->connected) {
        bufferevent_set_timeouts(c->bev, &it, &ct);
        bufferevent_enable(c->bev, EV_READ | EV_WRITE);
        if (bufferevent_socket_connect(c->bev, (struct sockaddr *)&p->addr.ss, (int)p->addr.len) <
            0)
            return HC_ECONNECT;
    } else {
        /* EV_WRITE stays enabled from the connect: bytes left in the output
         * are written when the socket allows; enabling it again would cost a
         * write-readiness round trip for nothing. */
        bufferevent_set_timeouts(c->bev, &it, &it);
        bufferevent_enable(c->bev, EV_READ);
    }
    return 0;
}

static void kick_cb(evutil_socket_t fd, short what, void *arg);

hc_req *hc_request(hc_pool *p, const char *method, const char *target, const char *headers,
                   const void *body, size_t body_len, const hc_timeouts *t, const hc_callbacks *cb,
                   void *arg) {
    hc_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->pool = p;
    r->cb = *cb;
    r->arg = arg;
    r->t = *t;
    r->is_head = !strcmp(method, "HEAD");
    r->wire = evbuffer_new();
    r->data = evbuffer_new();
    r->kick = event_new(p->base, -1, 0, kick_cb, r);
    if (!r->wire || !r->data || !r->kick) {
        if (r->wire) evbuffer_free(r->wire);
        if (r->data) evbuffer_free(r->data);
        if (r->kick) event_free(r->kick);
        free(r);
        return NULL;
    }
    int v6 = strchr(p->host, ':') != NULL;
    evbuffer_add_printf(r->wire, "%s %s HTTP/1.1\r\nHost: %s%s%s:%u\r\n", method, target,
                        v6 ? "[" : "", p->host, v6 ? "]" : "", p->port);
    if (headers) evbuffer_add(r->wire, headers, strlen(headers));
    if (body_len || !strcmp(method, "POST"))
        evbuffer_add_printf(r->wire, "Content-Length: %zu\r\n", body_len);
    evbuffer_add(r->wire, "\r\n", 2);
    if (body_len) evbuffer_add(r->wire, body, body_len);
    int rc = p->resolved ? req_start(r, 0) : HC_ERESOLVE;
    if (rc) {
        r->pending_err = rc == -ENOMEM ? HC_ECONNECT : rc;
        event_active(r->kick, EV_TIMEOUT, 0);
    }
    return r;
}

/* Parses what the connection's input holds; returns 1 when it ended (and
 * freed) the request. */
static int req_process(hc_req *r) {
    struct evbuffer *in = bufferevent_get_input(r->conn->bev);
    if (evbuffer_get_length(in)) r->got_bytes = 1;
    while (!r->have_head) {
        int rc = http_head_parse(in, 0, &RESP_LIMITS, &r->head);
        if (rc == 0) return 0;
        if (rc < 0) {
            req_end(r, HC_EPROTO);
            return 1;
        }
        if (r->head.status / 100 == 1) { /* 100 Continue and friends: skip */
            http_head_free(&r->head);
            continue;
        }
        r->have_head = 1;
        http_body_init(&r->rd, &r->head, r->is_head);
        if (r->cb.on_head) {
            r->in_cb++;
            r->cb.on_head(r, &r->head, r->arg);
            r->in_cb--;
            if (r->cancelled) {
                req_free(r);
                return 1;
            }
        }
    }
    if (r->paused) return 0;
    int rc = http_body_read(&r->rd, in, r->data);
    if (evbuffer_get_length(r->data) && r->cb.on_data) {
        r->in_cb++;
        r->cb.on_data(r, r->data, r->arg);
        r->in_cb--;
        evbuffer_drain(r->data, evbuffer_get_length(r->data));
        if (r->cancelled) {
            req_free(r);
            return 1;
        }
    } else {
        evbuffer_drain(r->data, evbuffer_get_length(r->data));
    }
    if (rc < 0) {
        req_end(r, HC_EPROTO);
        return 1;
    }
    if (rc == 1) {
        conn_release(r, r->head.keep_alive);
        req_end(r, 0);
        return 1;
    }
    return 0;
}

static void conn_read_cb(struct bufferevent *bev, void *arg) {
    hc_conn *c = arg;
    if (!c->req) { /* bytes on an idle connection: protocol error, drop it */
        pool_remove_idle(c->pool, c);
        conn_close(c);
        return;
    }
    (void)req_process(c->req);
}

static void conn_event_cb(struct bufferevent *bev, short what, void *arg) {
    hc_conn *c = arg;
    hc_req *r = c->req;
    if (what & BEV_EVENT_CONNECTED) {
        c->connected = 1;
        int one = 1;
        setsockopt(bufferevent_getfd(bev), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (r) {
            struct timeval it = tv_of(r->t.idle_s);
            bufferevent_set_timeouts(bev, &it, &it);
        }
        return;
    }
    if (!r) { /* idle connection closed by the upstream, or its keep-alive time is over */
        pool_remove_idle(c->pool, c);
        conn_close(c);
        return;
    }
    if (!c->connected) {
        LOG_D(MOD, "connect to %s:%u failed: %s", c->pool->host, c->pool->port,
              (what & BEV_EVENT_TIMEOUT) ? "timeout" : strerror(EVUTIL_SOCKET_ERROR()));
        req_end(r, HC_ECONNECT);
        return;
    }
    if ((what & (BEV_EVENT_EOF | BEV_EVENT_ERROR)) && !r->got_bytes && c->uses > 1 && !r->retried) {
        /* A keep-alive connection the upstream closed while it sat idle in
         * the pool (EOF or reset before any response byte): resend once on a
         * new connection. */
        r->retried = 1;
        r->conn = NULL;
        c->req = NULL;
        conn_close(c);
        int rc = req_start(r, 1);
        if (rc) req_end(r, HC_ECONNECT);
        return;
    }
    if (what & BEV_EVENT_EOF) {
        if (evbuffer_get_length(bufferevent_get_input(bev)) && req_process(r)) return;
        if (r->have_head && r->rd.mode == HTTP_BODY_UNTIL_CLOSE) {
            conn_release(r, 0);
            req_end(r, 0);
            return;
        }
    }
    req_end(r, (what & BEV_EVENT_TIMEOUT) ? HC_ETIMEOUT : HC_ERESET);
}

static void kick_cb(evutil_socket_t fd, short what, void *arg) {
    hc_req *r = arg;
    if (r->pending_err) {
        req_end(r, r->pending_err);
        return;
    }
    if (r->conn) (void)req_process(r);
}

void hc_cancel(hc_req *r) {
    if (!r) return;
    if (r->in_cb) {
        r->cancelled = 1;
        return;
    }
    req_free(r);
}

void hc_pause(hc_req *r, int paused) {
    if (!r || !r->conn || r->paused == paused) return;
    r->paused = paused;
    if (paused) {
        bufferevent_disable(r->conn->bev, EV_READ);
    } else {
        bufferevent_enable(r->conn->bev, EV_READ);
        event_active(r->kick, EV_TIMEOUT, 0); /* bytes may already wait in the input */
    }
}

int hc_got_response(const hc_req *r) {
    return r->got_bytes;
}
