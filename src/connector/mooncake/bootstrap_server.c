/* bootstrap_server — see bootstrap_server.h.  Parts: the registry table, the
 * /register validation, HTTP handlers, thread lifecycle. */
#include "connector/mooncake/bootstrap_server.h"

#include "base/auth.h"
#include "base/http_server.h"
#include "base/log.h"
#include "base/net.h"

#include <errno.h>
#include <event2/event.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>
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
    hs_server *http;         /* HTTP server on base (base/http_server) */
    struct event *stop_ev;   /* fires when stop_pipe is written */
    int stop_pipe[2];        /* [0] read by the loop, [1] written by stop() */
    uint16_t port;           /* bound port */
    pthread_t thread;        /* runs event_base_dispatch */
    int thread_started;      /* 1 once thread is valid */
    pthread_mutex_t mu;      /* guards the table below */
    bs_engine *engines;      /* (n_engines) sorted by dp_rank */
    size_t n_engines, cap_engines;
    size_t n_workers; /* total over engines, <= BOOTSTRAP_MAX_WORKERS */
    char secret[256]; /* /register's shared secret, "" = none */
    atomic_ulong auth_rejected;
    time_t auth_logged; /* last refusal log line (server thread only) */
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

static void send_json_h(hs_req *req, int code, const char *extra_headers, json_t *body) {
    char *text = body ? json_dumps(body, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(body);
    hs_reply(req, code, "application/json", extra_headers, text ? text : "",
             text ? strlen(text) : 0);
    free(text);
}

static void send_json(hs_req *req, int code, json_t *body) {
    send_json_h(req, code, NULL, body);
}

static void send_detail(hs_req *req, int code, const char *detail) {
    send_json(req, code, json_pack("{s:s}", "detail", detail));
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
static const char *check_auth(bootstrap_server *s, hs_req *req, const char *body, size_t len,
                              int *status, char *buf, size_t cap) {
    const char *h = http_head_get(hs_req_head(req), BOOTSTRAP_AUTH_HEADER);
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

static void handle_register(bootstrap_server *s, hs_req *req) {
    size_t len = 0;
    const char *data = hs_req_body(req, &len);
    if (s->secret[0]) {
        int status;
        char buf[256];
        const char *why = check_auth(s, req, data, len, &status, buf, sizeof buf);
        if (why) {
            unsigned long n = atomic_fetch_add(&s->auth_rejected, 1) + 1;
            time_t now = time(NULL);
            if (now - s->auth_logged >= 10) { /* at most one line per 10 s */
                LOG_W(MOD, "refusing a /register from %s (%lu refused in all): %s",
                      hs_req_peer(req), n, why);
                s->auth_logged = now;
            }
            return send_detail(req, status, why);
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
        send_json(req, 422, json_pack("{s:o}", "detail", errors));
        return;
    }
    if (!json_is_object(body)) {
        add_error(errors, "model_attributes_type", NULL,
                  "Input should be a valid dictionary or object to extract fields from");
        json_decref(body);
        send_json(req, 422, json_pack("{s:o}", "detail", errors));
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
        send_json(req, 422, json_pack("{s:o}", "detail", errors));
        return;
    }
    json_decref(errors);
    char detail[3 * BOOTSTRAP_MAX_STR];
    int code = registry_add(s, engine_id, dp, tp, pp, addr, detail, sizeof detail);
    json_decref(body);
    if (code == 200)
        send_json(req, 200, json_pack("{s:s}", "status", "ok"));
    else
        send_detail(req, 400, detail);
}

static void handle_query(bootstrap_server *s, hs_req *req) {
    char *text = bootstrap_server_query_json(s);
    hs_reply(req, 200, "application/json", NULL, text ? text : "", text ? strlen(text) : 0);
    free(text);
}

/* Deadlines (base/http_server): the head must be complete header_timeout_s
 * after the accept, or after the previous response (keep-alive); bytes do not
 * move it.  Past it: 408 and close, or just close when nothing was sent.  The
 * body (<= BOOTSTRAP_MAX_BODY) must follow within BOOTSTRAP_BODY_TIMEOUT_S. */
#define BOOTSTRAP_BODY_TIMEOUT_S 30.0

static void on_request(hs_req *req, void *arg) {
    bootstrap_server *s = arg;
    const char *path = hs_req_path(req);
    const char *m = hs_req_head(req)->method;
    if (strcmp(path, "/register") == 0) {
        if (!strcmp(m, "POST")) return handle_register(s, req);
        return send_json_h(req, 405, "Allow: POST\r\n",
                           json_pack("{s:s}", "detail", "Method Not Allowed"));
    }
    if (strcmp(path, "/query") == 0) {
        if (!strcmp(m, "GET") || !strcmp(m, "HEAD")) return handle_query(s, req);
        return send_json_h(req, 405, "Allow: GET\r\n",
                           json_pack("{s:s}", "detail", "Method Not Allowed"));
    }
    send_detail(req, 404, "Not Found");
}

/* Protocol errors (400 malformed, 413, 431): FastAPI's {"detail": ...};
 * a 408 has no body. */
static char *error_body(int status, const char *message) {
    if (status == 408) return NULL;
    json_t *j = json_pack("{s:s}", "detail", message);
    char *t = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return t;
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
    hs_server_free(s->http); /* closes the listener and every connection */
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
    s->stop_pipe[0] = s->stop_pipe[1] = -1;
    pthread_mutex_init(&s->mu, NULL);
    int rc = -ENOMEM;
    if (pipe(s->stop_pipe) != 0) {
        rc = -errno;
        snprintf(err, err_cap, "bootstrap server: pipe: %s", strerror(errno));
        goto fail;
    }
    s->base = event_base_new();
    if (!s->base) {
        snprintf(err, err_cap, "bootstrap server: cannot create the event loop");
        goto fail;
    }
    net_addr addr;
    if ((rc = net_resolve(host, port, &addr)) != 0) {
        snprintf(err, err_cap, "bootstrap server: cannot resolve host '%s': %s", host,
                 strerror(-rc));
        goto fail;
    }
    hs_config hc;
    hs_config_default(&hc);
    hc.limits.max_head_bytes = 16384;
    hc.max_body_bytes = BOOTSTRAP_MAX_BODY;
    hc.header_timeout_s = header_timeout_s;
    hc.request_timeout_s = 0;
    hc.body_timeout_s = BOOTSTRAP_BODY_TIMEOUT_S;
    hc.head_from_accept = hc.head_from_reply = 1;
    hc.write_timeout_s = 30;
    int fd = net_listen(&addr, 128);
    if (fd < 0) {
        rc = fd;
        snprintf(err, err_cap,
                 "bootstrap server: cannot listen on %s:%u: %s (set VLLM_MOONCAKE_BOOTSTRAP_PORT "
                 "or --port to a free port)",
                 host, (unsigned)port, strerror(-rc));
        goto fail;
    }
    s->http = hs_server_new_fd(s->base, fd, &hc, on_request, s, error_body);
    if (!s->http) {
        rc = -ENOMEM;
        snprintf(err, err_cap, "bootstrap server: cannot accept on the listener");
        goto fail;
    }
    s->port = hs_server_port(s->http);
    rc = -ENOMEM;
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
