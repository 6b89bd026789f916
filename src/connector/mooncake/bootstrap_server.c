/* bootstrap_server — see bootstrap_server.h.  Parts: the registry table, the
 * /register validation, HTTP handlers, thread lifecycle. */
#include "connector/mooncake/bootstrap_server.h"

#include "base/auth.h"
#include "base/log.h"
#include "base/net.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/util.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MOD "bootstrap"

/* ---- registry -------------------------------------------------------------- */

typedef struct bs_worker {
    int tp_rank;                  /* tensor-parallel rank */
    int pp_rank;                  /* pipeline-parallel rank */
    char addr[BOOTSTRAP_MAX_STR]; /* side-channel endpoint "tcp://ip:port" */
} bs_worker;

typedef struct bs_engine {
    int dp_rank;                       /* data-parallel rank (table key) */
    char engine_id[BOOTSTRAP_MAX_STR]; /* owner of this dp_rank */
    bs_worker *workers;                /* (n) sorted by (tp, pp) */
    size_t n, cap;
} bs_engine;

struct bootstrap_server {
    struct event_base *base; /* the server thread's loop */
    struct evhttp *http;     /* HTTP server on base */
    struct event *stop_ev;   /* fires when stop_pipe is written */
    int stop_pipe[2];        /* [0] read by the loop, [1] written by stop() */
    int listen_fd;           /* listening socket */
    int listen_owned;        /* 1 once evhttp owns (and will close) listen_fd */
    uint16_t port;           /* bound port */
    pthread_t thread;        /* runs event_base_dispatch */
    int thread_started;      /* 1 once thread is valid */
    pthread_mutex_t mu;      /* guards the table below */
    bs_engine *engines;      /* (n_engines) sorted by dp_rank */
    size_t n_engines, cap_engines;
    size_t n_workers; /* total over engines, <= BOOTSTRAP_MAX_WORKERS */
    char secret[256]; /* /register's shared secret, "" = none */
    atomic_ulong auth_rejected;
    time_t auth_logged;      /* last refusal log line (server thread only) */
    double header_timeout_s; /* header deadline (BOOTSTRAP_HEADER_TIMEOUT_S) */
    struct bs_conn *conns;   /* connections with a header deadline (server thread) */
};

#define STR_(x) #x
#define STR(x)  STR_(x)

static bs_engine *find_engine(bootstrap_server *s, int dp) {
    for (size_t i = 0; i < s->n_engines; i++)
        if (s->engines[i].dp_rank == dp) return &s->engines[i];
    return NULL;
}

static bs_worker *find_worker(bs_engine *e, int tp, int pp) {
    for (size_t i = 0; i < e->n; i++)
        if (e->workers[i].tp_rank == tp && e->workers[i].pp_rank == pp) return &e->workers[i];
    return NULL;
}

/* Register; returns 200 or 400 (detail filled) or 507-as-400 when full. */
static int registry_add(bootstrap_server *s, const char *engine_id, int dp, int tp, int pp,
                        const char *addr, char *detail, size_t cap) {
    pthread_mutex_lock(&s->mu);
    int code = 400;
    bs_engine *e = find_engine(s, dp);
    if (e && strcmp(e->engine_id, engine_id) != 0) {
        snprintf(detail, cap, "Engine ID mismatch for dp_rank=%d: expected %s, got %s", dp,
                 e->engine_id, engine_id);
        goto out;
    }
    bs_worker *w = e ? find_worker(e, tp, pp) : NULL;
    if (w) {
        if (strcmp(w->addr, addr) == 0) {
            code = 200; /* a retry after a client timeout: not an error */
        } else {
            snprintf(detail, cap,
                     "Worker with dp_rank=%d, tp_rank=%d, pp_rank=%d is already registered at "
                     "%s, but still want to register at %s",
                     dp, tp, pp, w->addr, addr);
        }
        goto out;
    }
    int max_tp = tp, max_pp = pp; /* the grid GET /query clients will allocate */
    for (size_t i = 0; e && i < e->n; i++) {
        if (e->workers[i].tp_rank > max_tp) max_tp = e->workers[i].tp_rank;
        if (e->workers[i].pp_rank > max_pp) max_pp = e->workers[i].pp_rank;
    }
    if ((long long)(max_tp + 1) * (max_pp + 1) > BOOTSTRAP_MAX_GRID) {
        snprintf(detail, cap,
                 "Worker with dp_rank=%d, tp_rank=%d, pp_rank=%d would make a %d x %d tp x pp "
                 "grid; at most %d workers per dp_rank",
                 dp, tp, pp, max_tp + 1, max_pp + 1, BOOTSTRAP_MAX_GRID);
        goto out;
    }
    if (s->n_workers >= BOOTSTRAP_MAX_WORKERS) {
        snprintf(detail, cap, "bootstrap registry is full (%d workers)", BOOTSTRAP_MAX_WORKERS);
        goto out;
    }
    if (!e) {
        if (s->n_engines == s->cap_engines) {
            size_t nc = s->cap_engines ? 2 * s->cap_engines : 8;
            bs_engine *ne = realloc(s->engines, nc * sizeof *ne);
            if (!ne) goto oom;
            s->engines = ne;
            s->cap_engines = nc;
        }
        size_t at = 0;
        while (at < s->n_engines && s->engines[at].dp_rank < dp)
            at++;
        memmove(&s->engines[at + 1], &s->engines[at], (s->n_engines - at) * sizeof *s->engines);
        e = &s->engines[at];
        memset(e, 0, sizeof *e);
        e->dp_rank = dp;
        snprintf(e->engine_id, sizeof e->engine_id, "%s", engine_id);
        s->n_engines++;
    }
    if (e->n == e->cap) {
        size_t nc = e->cap ? 2 * e->cap : 4;
        bs_worker *nw = realloc(e->workers, nc * sizeof *nw);
        if (!nw) goto oom;
        e->workers = nw;
        e->cap = nc;
    }
    size_t at = 0;
    while (at < e->n && (e->workers[at].tp_rank < tp ||
                         (e->workers[at].tp_rank == tp && e->workers[at].pp_rank < pp)))
        at++;
    memmove(&e->workers[at + 1], &e->workers[at], (e->n - at) * sizeof *e->workers);
    e->workers[at].tp_rank = tp;
    e->workers[at].pp_rank = pp;
    snprintf(e->workers[at].addr, sizeof e->workers[at].addr, "%s", addr);
    e->n++;
    s->n_workers++;
    code = 200;
    LOG_D(MOD, "registered engine_id=%s dp_rank=%d tp_rank=%d pp_rank=%d at %s", engine_id, dp, tp,
          pp, addr);
    goto out;
oom:
    snprintf(detail, cap, "out of memory");
out:
    pthread_mutex_unlock(&s->mu);
    return code;
}

char *bootstrap_server_query_json(bootstrap_server *s) {
    json_t *root = json_object();
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->n_engines; i++) {
        const bs_engine *e = &s->engines[i];
        json_t *wa = json_object();
        for (size_t j = 0; j < e->n; j++) {
            char tp[16], pp[16];
            snprintf(tp, sizeof tp, "%d", e->workers[j].tp_rank);
            snprintf(pp, sizeof pp, "%d", e->workers[j].pp_rank);
            json_t *tpo = json_object_get(wa, tp);
            if (!tpo) {
                tpo = json_object();
                json_object_set_new(wa, tp, tpo);
            }
            json_object_set_new(tpo, pp, json_string(e->workers[j].addr));
        }
        json_t *eo = json_object();
        json_object_set_new(eo, "engine_id", json_string(e->engine_id));
        json_object_set_new(eo, "worker_addr", wa);
        char dp[16];
        snprintf(dp, sizeof dp, "%d", e->dp_rank);
        json_object_set_new(root, dp, eo);
    }
    pthread_mutex_unlock(&s->mu);
    char *text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    return text;
}

int bootstrap_server_count_workers(bootstrap_server *s, int dp_rank, const char *engine_id) {
    pthread_mutex_lock(&s->mu);
    bs_engine *e = find_engine(s, dp_rank);
    int n = e && (!engine_id || strcmp(e->engine_id, engine_id) == 0) ? (int)e->n : 0;
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* ---- HTTP ---------------------------------------------------------------- */

static void send_json(struct evhttp_request *req, int code, const char *reason, json_t *body) {
    char *text = json_dumps(body, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(body);
    struct evbuffer *buf = evbuffer_new();
    if (buf && text) evbuffer_add(buf, text, strlen(text));
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/json");
    evhttp_send_reply(req, code, reason, buf);
    if (buf) evbuffer_free(buf);
    free(text);
}

static void send_detail(struct evhttp_request *req, int code, const char *reason,
                        const char *detail) {
    send_json(req, code, reason, json_pack("{s:s}", "detail", detail));
}

/* One FastAPI-style validation error. */
static void add_error(json_t *errors, const char *type, const char *field, const char *msg) {
    json_t *loc = field ? json_pack("[s,s]", "body", field) : json_pack("[s]", "body");
    json_array_append_new(errors, json_pack("{s:s,s:o,s:s}", "type", type, "loc", loc, "msg", msg));
}

/* Validates the fields of a /register body; appends errors. */
static void check_str(json_t *body, const char *key, json_t *errors, const char **out) {
    json_t *v = json_object_get(body, key);
    *out = NULL;
    if (!v) return add_error(errors, "missing", key, "Field required");
    if (!json_is_string(v))
        return add_error(errors, "string_type", key, "Input should be a valid string");
    size_t n = json_string_length(v);
    const char *s = json_string_value(v);
    if (n == 0)
        return add_error(errors, "string_too_short", key,
                         "String should have at least 1 character");
    if (n >= BOOTSTRAP_MAX_STR)
        return add_error(errors, "string_too_long", key,
                         "String should have at most 255 characters");
    if (strlen(s) != n) return add_error(errors, "string_type", key, "String contains NUL");
    *out = s;
}

static void check_rank(json_t *body, const char *key, json_t *errors, int *out) {
    json_t *v = json_object_get(body, key);
    *out = -1;
    if (!v) return add_error(errors, "missing", key, "Field required");
    if (!json_is_integer(v))
        return add_error(errors, "int_type", key, "Input should be a valid integer");
    json_int_t i = json_integer_value(v);
    if (i < 0)
        return add_error(errors, "greater_than_equal", key,
                         "Input should be greater than or equal to 0");
    if (i > BOOTSTRAP_MAX_RANK)
        return add_error(errors, "less_than_equal", key,
                         "Input should be less than or equal to " STR(BOOTSTRAP_MAX_RANK));
    *out = (int)i;
}

/* NULL when the request's X-Disagg-Auth is valid for body, else why not
 * (*status 401: absent, 403: wrong). */
static const char *check_auth(bootstrap_server *s, struct evhttp_request *req, const char *body,
                              size_t len, int *status, char *buf, size_t cap) {
    const char *h =
        evhttp_find_header(evhttp_request_get_input_headers(req), BOOTSTRAP_AUTH_HEADER);
    *status = 401;
    if (!h)
        return "bootstrap /register requires authentication: this server has a shared secret "
               "(--auth-secret or DISAGG_KV_SECRET) and the request carried "
               "no " BOOTSTRAP_AUTH_HEADER " header; give the registering instance the same secret "
               "(kv_connector_extra_config.auth_secret or DISAGG_KV_SECRET)";
    *status = 403;
    long long ts = 0;
    char hex[2 * AUTH_MAC_LEN + 2];
    int n = 0;
    if (sscanf(h, "v1 ts=%lld mac=%65s%n", &ts, hex, &n) != 2 || h[n] != '\0' ||
        strlen(hex) != 2 * AUTH_MAC_LEN)
        return "bootstrap /register: malformed " BOOTSTRAP_AUTH_HEADER
               " header; accepted: \"v1 ts=<unix seconds> mac=<64 hex digits>\"";
    long long skew = (long long)time(NULL) - ts;
    if (skew > BOOTSTRAP_AUTH_SKEW_S || skew < -BOOTSTRAP_AUTH_SKEW_S) {
        snprintf(buf, cap,
                 "bootstrap /register: the " BOOTSTRAP_AUTH_HEADER
                 " timestamp is %lld s off this server's clock (accepted: within %d s; are the "
                 "hosts' clocks synchronized?)",
                 skew, BOOTSTRAP_AUTH_SKEW_S);
        return buf;
    }
    char tss[32];
    snprintf(tss, sizeof tss, "%lld", ts);
    const void *parts[4] = {BOOTSTRAP_AUTH_LABEL "\n", tss, "\n", body};
    size_t lens[4] = {strlen(BOOTSTRAP_AUTH_LABEL) + 1, strlen(tss), 1, len};
    uint8_t mac[AUTH_MAC_LEN];
    char want[2 * AUTH_MAC_LEN + 1];
    if (auth_hmacv(s->secret, strlen(s->secret), parts, lens, 4, mac) != 0)
        return "bootstrap /register: cannot compute the MAC";
    auth_hex(mac, sizeof mac, want);
    for (char *p = hex; *p; p++)
        if (*p >= 'A' && *p <= 'F') *p = (char)(*p - 'A' + 'a');
    if (!auth_equal(want, hex, 2 * AUTH_MAC_LEN))
        return "bootstrap /register: authentication failed: the MAC does not match (the "
               "registering instance's auth_secret differs from this server's)";
    return NULL;
}

static void handle_register(bootstrap_server *s, struct evhttp_request *req) {
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    const char *data = len ? (const char *)evbuffer_pullup(in, -1) : "";
    if (s->secret[0]) {
        int status;
        char buf[256];
        const char *why = check_auth(s, req, data, len, &status, buf, sizeof buf);
        if (why) {
            unsigned long n = atomic_fetch_add(&s->auth_rejected, 1) + 1;
            time_t now = time(NULL);
            if (now - s->auth_logged >= 10) { /* at most one line per 10 s */
                char peer[64] = "?";
                char *ph = NULL;
                ev_uint16_t pport = 0;
                evhttp_connection_get_peer(evhttp_request_get_connection(req), &ph, &pport);
                if (ph) snprintf(peer, sizeof peer, "%s", ph);
                LOG_W(MOD, "refusing a /register from %s (%lu refused in all): %s", peer, n, why);
                s->auth_logged = now;
            }
            return send_detail(req, status, status == 401 ? "Unauthorized" : "Forbidden", why);
        }
    }
    json_error_t jerr;
    json_t *body = json_loadb(data, len, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &jerr);
    json_t *errors = json_array();
    if (!body) {
        char msg[256];
        snprintf(msg, sizeof msg, "JSON decode error: %s (line %d, column %d)", jerr.text,
                 jerr.line, jerr.column);
        json_array_append_new(errors, json_pack("{s:s,s:[s,i],s:s}", "type", "json_invalid", "loc",
                                                "body", (int)jerr.position, "msg", msg));
        send_json(req, 422, "Unprocessable Entity", json_pack("{s:o}", "detail", errors));
        return;
    }
    if (!json_is_object(body)) {
        add_error(errors, "model_attributes_type", NULL,
                  "Input should be a valid dictionary or object to extract fields from");
        json_decref(body);
        send_json(req, 422, "Unprocessable Entity", json_pack("{s:o}", "detail", errors));
        return;
    }
    const char *engine_id, *addr;
    int dp, tp, pp;
    check_str(body, "engine_id", errors, &engine_id);
    check_rank(body, "dp_rank", errors, &dp);
    check_rank(body, "tp_rank", errors, &tp);
    check_rank(body, "pp_rank", errors, &pp);
    check_str(body, "addr", errors, &addr);
    if (json_array_size(errors) > 0) {
        json_decref(body);
        send_json(req, 422, "Unprocessable Entity", json_pack("{s:o}", "detail", errors));
        return;
    }
    json_decref(errors);
    char detail[3 * BOOTSTRAP_MAX_STR];
    int code = registry_add(s, engine_id, dp, tp, pp, addr, detail, sizeof detail);
    json_decref(body);
    if (code == 200)
        send_json(req, 200, "OK", json_pack("{s:s}", "status", "ok"));
    else
        send_detail(req, 400, "Bad Request", detail);
}

static void handle_query(bootstrap_server *s, struct evhttp_request *req) {
    char *text = bootstrap_server_query_json(s);
    struct evbuffer *buf = evbuffer_new();
    if (buf && text) evbuffer_add(buf, text, strlen(text));
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/json");
    evhttp_send_reply(req, 200, "OK", buf);
    if (buf) evbuffer_free(buf);
    free(text);
}

/* ---- header deadline ----------------------------------------------------------
 * evhttp 2.1's only timeout is per read (30 s here), so a client sending a
 * byte now and then holds a connection forever.  Each connection gets a
 * header deadline: the head must be complete header_timeout_s after accept,
 * or after the previous response; bytes do not move it.  A small equivalent
 * of src/server/http_conn.c's (which the connector may not include, and base/
 * does not link libevent): evhttp_set_bevcb makes the bufferevent here with
 * a callback on its input buffer that sees every arrival before evhttp parses
 * it; a blank line ends the head.  The body (<= BOOTSTRAP_MAX_BODY) is left
 * to the per-read timeout.  Server thread only. */

typedef struct bs_conn {
    bootstrap_server *s;
    struct bufferevent *bev;       /* evhttp owns it */
    struct evhttp_connection *evc; /* once registered */
    struct event *init;            /* deferred registration */
    struct event *timer;           /* the header deadline */
    int timed;                     /* 1 while the deadline runs */
    int got_bytes;                 /* a byte arrived since it was armed */
    int eol;                       /* head scanner: 0 in a line, 1 after LF, 2 after LF CR */
    struct bs_conn *prev, *next;
} bs_conn;

static void bs_conn_input(struct evbuffer *buf, const struct evbuffer_cb_info *info, void *arg);

static void bs_conn_free(bs_conn *c) {
    bootstrap_server *s = c->s;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    if (c->bev) evbuffer_remove_cb(bufferevent_get_input(c->bev), bs_conn_input, c);
    event_free(c->init);
    event_free(c->timer);
    free(c);
}

static void bs_conn_arm(bs_conn *c) {
    double t = c->s->header_timeout_s;
    struct timeval tv = {(time_t)t, (suseconds_t)((t - (double)(time_t)t) * 1e6)};
    c->timed = 1;
    c->got_bytes = 0;
    c->eol = 0;
    event_add(c->timer, &tv);
}

static void bs_conn_closed(struct evhttp_connection *evc, void *arg) {
    (void)evc;
    bs_conn_free(arg); /* evhttp frees the bufferevent right after this */
}

static void bs_conn_timeout(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    bs_conn *c = arg;
    if (!c->evc || !c->timed) return;
    if (c->got_bytes) {
        static const char r408[] = "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
                                   "Content-Length: 0\r\n\r\n";
        LOG_W(MOD, "a client did not complete its request head within %g s: 408, closing",
              c->s->header_timeout_s);
        (void)send(bufferevent_getfd(c->bev), r408, sizeof r408 - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    } else {
        LOG_D(MOD, "connection idle for %g s: closing", c->s->header_timeout_s);
    }
    evhttp_connection_free(c->evc); /* calls bs_conn_closed, which frees c */
}

static void bs_conn_input(struct evbuffer *buf, const struct evbuffer_cb_info *info, void *arg) {
    bs_conn *c = arg;
    if (info->n_added == 0 || !c->timed) return;
    c->got_bytes = 1;
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
                if (c->eol) {
                    c->timed = 0;
                    event_del(c->timer);
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
static void bs_conn_register(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    bs_conn *c = arg;
    bufferevent_data_cb rd = NULL;
    void *evc = NULL;
    bufferevent_getcb(c->bev, &rd, NULL, NULL, &evc);
    if (!rd || !evc || bufferevent_getfd(c->bev) < 0) { /* evhttp gave up on it already */
        bs_conn_free(c);
        return;
    }
    c->evc = evc;
    evhttp_connection_set_closecb(c->evc, bs_conn_closed, c);
}

static struct bufferevent *bs_conn_new_bev(struct event_base *base, void *arg) {
    bootstrap_server *s = arg;
    bs_conn *c = calloc(1, sizeof *c);
    struct bufferevent *bev = bufferevent_socket_new(base, -1, 0); /* as evhttp's own */
    if (!c || !bev) {
        free(c);
        return bev; /* evhttp makes its own when NULL */
    }
    c->s = s;
    c->bev = bev;
    c->init = event_new(base, -1, 0, bs_conn_register, c);
    c->timer = evtimer_new(base, bs_conn_timeout, c);
    if (!c->init || !c->timer ||
        evbuffer_add_cb(bufferevent_get_input(bev), bs_conn_input, c) == NULL) {
        if (c->init) event_free(c->init);
        if (c->timer) event_free(c->timer);
        free(c);
        return bev;
    }
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    bs_conn_arm(c);
    event_active(c->init, EV_TIMEOUT, 0);
    return bev;
}

static bs_conn *bs_conn_of(bootstrap_server *s, struct evhttp_request *req) {
    struct evhttp_connection *evc = evhttp_request_get_connection(req);
    for (bs_conn *c = s->conns; evc && c; c = c->next)
        if (c->evc == evc) return c;
    return NULL;
}

/* The response went out: the next head has a fresh deadline. */
static void bs_conn_reply_done(struct evhttp_request *req, void *arg) {
    bs_conn *c = bs_conn_of(arg, req);
    if (c) bs_conn_arm(c);
}

/* A request is dispatched (also a pipelined one whose head was buffered). */
static void bs_conn_request_begins(bootstrap_server *s, struct evhttp_request *req) {
    bs_conn *c = bs_conn_of(s, req);
    if (!c) return;
    c->timed = 0;
    event_del(c->timer);
    evhttp_request_set_on_complete_cb(req, bs_conn_reply_done, s);
}

static void bs_conn_free_all(bootstrap_server *s) {
    while (s->conns) {
        s->conns->bev = NULL; /* freed with evhttp */
        bs_conn_free(s->conns);
    }
}

static void on_request(struct evhttp_request *req, void *arg) {
    bootstrap_server *s = arg;
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *path = uri ? evhttp_uri_get_path(uri) : NULL;
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    bs_conn_request_begins(s, req);
    if (!path) path = "";
    if (strcmp(path, "/register") == 0) {
        if (cmd == EVHTTP_REQ_POST) return handle_register(s, req);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", "POST");
        return send_detail(req, 405, "Method Not Allowed", "Method Not Allowed");
    }
    if (strcmp(path, "/query") == 0) {
        if (cmd == EVHTTP_REQ_GET || cmd == EVHTTP_REQ_HEAD) return handle_query(s, req);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", "GET");
        return send_detail(req, 405, "Method Not Allowed", "Method Not Allowed");
    }
    send_detail(req, 404, "Not Found", "Not Found");
}

/* ---- lifecycle ------------------------------------------------------------- */

static void on_stop(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    event_base_loopbreak(arg);
}

static void *server_main(void *arg) {
    bootstrap_server *s = arg;
    event_base_dispatch(s->base);
    return NULL;
}

static void server_free(bootstrap_server *s) {
    if (s->http) evhttp_free(s->http); /* closes the listener it accepted on */
    bs_conn_free_all(s);
    if (!s->listen_owned && s->listen_fd >= 0) close(s->listen_fd);
    if (s->stop_ev) event_free(s->stop_ev);
    if (s->base) event_base_free(s->base);
    if (s->stop_pipe[0] >= 0) close(s->stop_pipe[0]);
    if (s->stop_pipe[1] >= 0) close(s->stop_pipe[1]);
    for (size_t i = 0; i < s->n_engines; i++)
        free(s->engines[i].workers);
    free(s->engines);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int bootstrap_server_start(const char *host, uint16_t port, bootstrap_server **out, char *err,
                           size_t err_cap) {
    return bootstrap_server_start_auth(host, port, NULL, out, err, err_cap);
}

unsigned long bootstrap_server_auth_rejected(bootstrap_server *s) {
    return atomic_load(&s->auth_rejected);
}

int bootstrap_server_start_auth(const char *host, uint16_t port, const char *secret,
                                bootstrap_server **out, char *err, size_t err_cap) {
    return bootstrap_server_start_opts(host, port, secret, BOOTSTRAP_HEADER_TIMEOUT_S, out, err,
                                       err_cap);
}

int bootstrap_server_start_opts(const char *host, uint16_t port, const char *secret,
                                double header_timeout_s, bootstrap_server **out, char *err,
                                size_t err_cap) {
    *out = NULL;
    if (!(header_timeout_s > 0) || header_timeout_s > 86400) {
        snprintf(err, err_cap,
                 "bootstrap server: the header timeout must be seconds in (0, 86400], got %g",
                 header_timeout_s);
        return -EINVAL;
    }
    if (!host || !host[0]) host = "0.0.0.0";
    if (secret && strlen(secret) >= sizeof((bootstrap_server *)0)->secret) {
        snprintf(err, err_cap, "bootstrap server: the secret is longer than 255 bytes");
        return -EINVAL;
    }
    bootstrap_server *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    if (secret) snprintf(s->secret, sizeof s->secret, "%s", secret);
    s->header_timeout_s = header_timeout_s;
    s->stop_pipe[0] = s->stop_pipe[1] = -1;
    s->listen_fd = -1;
    pthread_mutex_init(&s->mu, NULL);
    int rc;
    net_addr addr;
    if ((rc = net_resolve(host, port, &addr)) != 0) {
        snprintf(err, err_cap, "bootstrap server: cannot resolve host '%s': %s", host,
                 strerror(-rc));
        goto fail;
    }
    s->listen_fd = net_listen(&addr, 128);
    if (s->listen_fd < 0) {
        rc = s->listen_fd;
        snprintf(err, err_cap,
                 "bootstrap server: cannot listen on %s:%u: %s (set VLLM_MOONCAKE_BOOTSTRAP_PORT "
                 "or --port to a free port)",
                 host, (unsigned)port, strerror(-rc));
        goto fail;
    }
    net_addr bound;
    net_local_addr(s->listen_fd, &bound);
    s->port = net_addr_port(&bound);
    evutil_make_socket_nonblocking(s->listen_fd);
    rc = -ENOMEM;
    if (pipe(s->stop_pipe) != 0) {
        rc = -errno;
        snprintf(err, err_cap, "bootstrap server: pipe: %s", strerror(errno));
        goto fail;
    }
    s->base = event_base_new();
    s->http = s->base ? evhttp_new(s->base) : NULL;
    if (!s->http) {
        snprintf(err, err_cap, "bootstrap server: cannot create the event loop");
        goto fail;
    }
    evhttp_set_max_body_size(s->http, BOOTSTRAP_MAX_BODY);
    evhttp_set_max_headers_size(s->http, 16384);
    evhttp_set_timeout(s->http, 30);
    evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                            EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE | EVHTTP_REQ_PATCH |
                                            EVHTTP_REQ_OPTIONS);
    evhttp_set_gencb(s->http, on_request, s);
    evhttp_set_bevcb(s->http, bs_conn_new_bev, s);
    if (!evhttp_accept_socket_with_handle(s->http, s->listen_fd)) {
        snprintf(err, err_cap, "bootstrap server: evhttp cannot accept on the listener");
        goto fail;
    }
    s->listen_owned = 1;
    s->stop_ev = event_new(s->base, s->stop_pipe[0], EV_READ, on_stop, s->base);
    if (!s->stop_ev || event_add(s->stop_ev, NULL) != 0) {
        snprintf(err, err_cap, "bootstrap server: cannot add the stop event");
        goto fail;
    }
    if ((rc = -pthread_create(&s->thread, NULL, server_main, s)) != 0) {
        snprintf(err, err_cap, "bootstrap server: pthread_create: %s", strerror(-rc));
        goto fail;
    }
    s->thread_started = 1;
    LOG_I(MOD, "bootstrap server listening on %s:%u (%s)", host, (unsigned)s->port,
          s->secret[0] ? "/register requires the shared secret" : "no authentication");
    *out = s;
    return 0;
fail:
    server_free(s);
    return rc ? rc : -EINVAL;
}

uint16_t bootstrap_server_port(const bootstrap_server *s) {
    return s->port;
}

void bootstrap_server_stop(bootstrap_server *s) {
    if (!s) return;
    if (s->thread_started) {
        char b = 1;
        while (write(s->stop_pipe[1], &b, 1) < 0 && errno == EINTR) {
        }
        pthread_join(s->thread, NULL);
    }
    server_free(s);
}
