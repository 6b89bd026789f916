/* bootstrap_server — see bootstrap_server.h.  Parts: the registry table, the
 * /register validation, HTTP handlers, thread lifecycle. */
#include "connector/mooncake/bootstrap_server.h"

#include "base/auth.h"
#include "base/clock.h"
#include "base/http_server.h"
#include "base/log.h"
#include "base/net.h"

#include <arpa/inet.h>
#include <ctype.h>
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
    int refused;                  /* consecutive liveness probes refused */
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
    /* Liveness prober (its own thread): every probe_ns, a TCP connect to each
     * registered side channel; BOOTSTRAP_PROBE_DROP refusals in a row drop
     * the worker.  probe_ns 0 = off (and conflicts are never replaced). */
    uint64_t probe_ns;
    pthread_t prober;
    int prober_started, prober_stop; /* prober_stop guarded by mu */
    pthread_cond_t prober_cv;        /* on CLOCK_MONOTONIC; signalled by stop */
    atomic_ulong dropped;
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

/* ---- side-channel addresses -------------------------------------------------- */

/* Parses "tcp://HOST:PORT" (HOST a hostname, an IPv4 address or [IPv6]; PORT
 * 1..65535) into host (without brackets) and port; NULL, or why not. */
static const char *parse_sc_addr(const char *addr, char *host, size_t host_cap, uint16_t *port) {
    if (strncmp(addr, "tcp://", 6) != 0) return "it does not start with tcp://";
    const char *h = addr + 6, *colon;
    size_t hl;
    if (*h == '[') {
        const char *end = strchr(h, ']');
        if (!end) return "the IPv6 address has no closing ']'";
        hl = (size_t)(end - h - 1);
        if (hl == 0 || hl >= host_cap) return "the IPv6 address is empty or too long";
        memcpy(host, h + 1, hl);
        host[hl] = '\0';
        struct in6_addr a6;
        if (inet_pton(AF_INET6, host, &a6) != 1) return "the bracketed host is not an IPv6 address";
        if (end[1] != ':') return "no :PORT after the IPv6 address";
        colon = end + 1;
    } else {
        colon = strrchr(h, ':');
        if (!colon || colon == h) return colon ? "the host is empty" : "there is no :PORT";
        hl = (size_t)(colon - h);
        if (hl >= host_cap || hl > 253) return "the host is longer than 253 characters";
        memcpy(host, h, hl);
        host[hl] = '\0';
        int all_num = 1;
        for (const char *p = host; *p; p++) {
            if (!isalnum((unsigned char)*p) && *p != '-' && *p != '.')
                return strchr(host, ':') ? "an IPv6 host must be in brackets ([::1])"
                                         : "the host has a character other than letters, digits, "
                                           "'-' and '.'";
            if (!isdigit((unsigned char)*p) && *p != '.') all_num = 0;
        }
        struct in_addr a4;
        if (all_num && inet_pton(AF_INET, host, &a4) != 1) return "the host is not an IPv4 address";
        for (const char *l = host; *l;) { /* hostname labels: 1..63, no '-' at the ends */
            size_t n = strcspn(l, ".");
            if (n == 0 || n > 63 || l[0] == '-' || l[n - 1] == '-')
                return "the host is not a valid hostname";
            l += n + (l[n] == '.');
            if (l[-1] == '.' && !*l) return "the host is not a valid hostname";
        }
    }
    const char *ps = colon + 1;
    if (!*ps || strlen(ps) > 5 || strspn(ps, "0123456789") != strlen(ps))
        return "the port is not a number in 1-65535";
    long pn = strtol(ps, NULL, 10);
    if (pn < 1 || pn > 65535) return "the port is not a number in 1-65535";
    *port = (uint16_t)pn;
    return NULL;
}

/* Probe outcome of a side-channel address. */
enum { PROBE_ALIVE, PROBE_REFUSED, PROBE_UNKNOWN };

static int probe_addr(const char *addr, uint64_t timeout_ns) {
    char host[BOOTSTRAP_MAX_STR];
    uint16_t port;
    net_addr a;
    if (parse_sc_addr(addr, host, sizeof host, &port) || net_resolve(host, port, &a) != 0)
        return PROBE_UNKNOWN;
    int fd = net_connect(&a, NULL, clock_now_ns() + timeout_ns);
    if (fd >= 0) {
        close(fd);
        return PROBE_ALIVE;
    }
    /* Only "nothing listens there" counts: a timeout or an unreachable network
     * may be this server's view only (a firewall), not the decoders'. */
    return fd == -ECONNREFUSED ? PROBE_REFUSED : PROBE_UNKNOWN;
}

/* Caller holds mu: remove worker w of engine index ei (and the engine when it
 * was its last worker). */
static void remove_worker_locked(bootstrap_server *s, size_t ei, bs_worker *w) {
    bs_engine *e = &s->engines[ei];
    size_t wi = (size_t)(w - e->workers);
    memmove(&e->workers[wi], &e->workers[wi + 1], (e->n - wi - 1) * sizeof *e->workers);
    e->n--;
    s->n_workers--;
    if (e->n == 0) {
        free(e->workers);
        memmove(&s->engines[ei], &s->engines[ei + 1], (s->n_engines - ei - 1) * sizeof *e);
        s->n_engines--;
    }
}

/* Before a registration: the entries it conflicts with (another engine_id on
 * its dp_rank, or its (dp,tp,pp) at another address) are dropped when their
 * side channels refuse connections -- a restarted prefill instance replaces
 * its dead predecessor instead of getting 400 until the entry expires. */
static void drop_dead_conflicts(bootstrap_server *s, const char *engine_id, int dp, int tp, int pp,
                                const char *addr) {
    enum { MAXC = 64 };
    typedef char addr_buf[BOOTSTRAP_MAX_STR];
    addr_buf *old = NULL;
    size_t n = 0;
    pthread_mutex_lock(&s->mu);
    bs_engine *e = find_engine(s, dp);
    int whole = e && strcmp(e->engine_id, engine_id) != 0;
    bs_worker *w = e && !whole ? find_worker(e, tp, pp) : NULL;
    size_t want = whole ? e->n : (w && strcmp(w->addr, addr) != 0);
    if (want > 0 && want <= MAXC && (old = malloc(want * sizeof *old))) {
        for (size_t i = 0; i < e->n && n < want; i++)
            if (whole || &e->workers[i] == w) memcpy(old[n++], e->workers[i].addr, sizeof *old);
    }
    pthread_mutex_unlock(&s->mu);
    if (n == 0) return;
    for (size_t i = 0; i < n; i++)
        if (probe_addr(old[i], 300 * NS_PER_MS) != PROBE_REFUSED) {
            free(old);
            return; /* one is alive (or unknown): the conflict stands */
        }
    pthread_mutex_lock(&s->mu);
    e = find_engine(s, dp);
    for (size_t i = 0; e && i < n; i++) {
        size_t ei = (size_t)(e - s->engines);
        for (size_t j = 0; j < e->n; j++) {
            if (strcmp(e->workers[j].addr, old[i]) != 0) continue;
            LOG_W(MOD,
                  "replacing engine_id=%s dp_rank=%d tp_rank=%d pp_rank=%d at %s: its side "
                  "channel refuses connections (the instance is gone)",
                  e->engine_id, dp, e->workers[j].tp_rank, e->workers[j].pp_rank, old[i]);
            atomic_fetch_add(&s->dropped, 1);
            int last = e->n == 1;
            remove_worker_locked(s, ei, &e->workers[j]);
            if (last) e = NULL;
            break;
        }
    }
    pthread_mutex_unlock(&s->mu);
    free(old);
}

/* One liveness round over the table. */
static void probe_round(bootstrap_server *s) {
    typedef struct {
        int dp, tp, pp;
        char addr[BOOTSTRAP_MAX_STR];
    } probe_item;
    pthread_mutex_lock(&s->mu);
    size_t n = s->n_workers, k = 0;
    probe_item *items = n ? malloc(n * sizeof *items) : NULL;
    for (size_t i = 0; items && i < s->n_engines; i++)
        for (size_t j = 0; j < s->engines[i].n && k < n; j++, k++) {
            items[k].dp = s->engines[i].dp_rank;
            items[k].tp = s->engines[i].workers[j].tp_rank;
            items[k].pp = s->engines[i].workers[j].pp_rank;
            memcpy(items[k].addr, s->engines[i].workers[j].addr, sizeof items[k].addr);
        }
    pthread_mutex_unlock(&s->mu);
    for (size_t i = 0; i < k; i++) {
        pthread_mutex_lock(&s->mu);
        int stop = s->prober_stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        int r = probe_addr(items[i].addr, 500 * NS_PER_MS);
        pthread_mutex_lock(&s->mu);
        bs_engine *e = find_engine(s, items[i].dp);
        bs_worker *w = e ? find_worker(e, items[i].tp, items[i].pp) : NULL;
        if (w && strcmp(w->addr, items[i].addr) == 0) { /* still the one probed */
            if (r == PROBE_ALIVE) w->refused = 0;
            if (r == PROBE_REFUSED && ++w->refused >= BOOTSTRAP_PROBE_DROP) {
                LOG_W(MOD,
                      "dropping engine_id=%s dp_rank=%d tp_rank=%d pp_rank=%d at %s: its side "
                      "channel refused %d connections in a row (the instance is gone)",
                      e->engine_id, items[i].dp, items[i].tp, items[i].pp, items[i].addr,
                      w->refused);
                atomic_fetch_add(&s->dropped, 1);
                remove_worker_locked(s, (size_t)(e - s->engines), w);
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
    free(items);
}

static void *prober_main(void *arg) {
    bootstrap_server *s = arg;
    pthread_mutex_lock(&s->mu);
    while (!s->prober_stop) {
        struct timespec ts = clock_to_timespec(clock_now_ns() + s->probe_ns);
        pthread_cond_timedwait(&s->prober_cv, &s->mu, &ts);
        if (s->prober_stop) break;
        pthread_mutex_unlock(&s->mu);
        probe_round(s);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
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
            w->refused = 0;
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
    e->workers[at].refused = 0;
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
    char host[BOOTSTRAP_MAX_STR];
    uint16_t port;
    const char *bad = parse_sc_addr(addr, host, sizeof host, &port);
    if (bad) {
        snprintf(detail, sizeof detail,
                 "addr '%s' is not a side-channel address (%s); accepted: tcp://HOST:PORT with "
                 "HOST a hostname, an IPv4 address or a bracketed IPv6 address ([::1]) and PORT "
                 "1-65535",
                 addr, bad);
        json_decref(body);
        return send_detail(req, 400, detail);
    }
    if (s->probe_ns) drop_dead_conflicts(s, engine_id, dp, tp, pp, addr);
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
    pthread_cond_destroy(&s->prober_cv);
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
    clock_cond_init(&s->prober_cv);
    int rc = -ENOMEM;
    const char *pe = getenv("DISAGG_BOOTSTRAP_PROBE_INTERVAL");
    double probe_s = BOOTSTRAP_PROBE_INTERVAL_S;
    if (pe && *pe) {
        char *end;
        probe_s = strtod(pe, &end);
        if (*end || !(probe_s >= 0) || probe_s > 3600) {
            snprintf(err, err_cap,
                     "bootstrap server: DISAGG_BOOTSTRAP_PROBE_INTERVAL='%s' is not seconds in "
                     "[0, 3600] (0 = no liveness checks)",
                     pe);
            rc = -EINVAL;
            goto fail;
        }
    }
    s->probe_ns = (uint64_t)(probe_s * 1e9);
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
    if (s->probe_ns && pthread_create(&s->prober, NULL, prober_main, s) == 0) s->prober_started = 1;
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

unsigned long bootstrap_server_dropped(bootstrap_server *s) {
    return atomic_load(&s->dropped);
}

void bootstrap_server_stop(bootstrap_server *s) {
    if (!s) return;
    if (s->prober_started) {
        pthread_mutex_lock(&s->mu);
        s->prober_stop = 1;
        pthread_cond_signal(&s->prober_cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->prober, NULL);
    }
    if (s->thread_started) {
        char b = 1;
        while (write(s->stop_pipe[1], &b, 1) < 0 && errno == EINTR) {
        }
        pthread_join(s->thread, NULL);
    }
    server_free(s);
}
