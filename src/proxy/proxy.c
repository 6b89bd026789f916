/* proxy — see proxy.h. */
#include "proxy/proxy_internal.h"

#include "base/clock.h"
#include "base/auth.h"
#include "base/log.h"
#include "proxy/api_error.h"
#include "proxy/membership.h"

#include <errno.h>
#include <event2/event.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>

#define MOD "proxy"

void proxy_config_default(proxy_config *c) {
    memset(c, 0, sizeof *c);
    c->host = "127.0.0.1";
    c->port = 8000;
    c->policy = POLICY_LEAST_LOADED;
    c->max_body_bytes = 16u << 20;
    c->max_headers = 100;
    c->max_head_bytes = 64 * 1024;
    c->connect_timeout_s = 5;
    c->upstream_timeout_s = 600;
    c->health_interval_s = 1;
    c->client_timeout_s = 60;
    c->client_header_timeout_s = 60;
    c->keepalive_timeout_s = 75;
    c->upstream_keepalive_s = 4; /* below the upstreams' own (disagg serve and vLLM: 5 s) */
    c->shutdown_timeout_s = 30;
    c->prefix_bytes = POLICY_PREFIX_BYTES;
}

void proxy_count_status(proxy *px, int status) {
    int cls = status / 100;
    if (cls >= 1 && cls <= 5) px->responses[cls]++;
}

static void proxy_reply_error_hdr(proxy *px, hs_req *req, int status, proxy_error_kind kind,
                                  const char *extra_headers, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

static void reply_error_v(proxy *px, hs_req *req, int status, proxy_error_kind kind,
                          const char *extra_headers, const char *fmt, va_list ap) {
    char msg[4096];
    vsnprintf(msg, sizeof msg, fmt, ap);
    char *body = api_error_json(status, msg);
    px->errors[kind]++;
    proxy_count_status(px, status);
    hs_reply(req, status, "application/json", extra_headers, body ? body : msg,
             strlen(body ? body : msg));
    free(body);
}

void proxy_reply_error(proxy *px, hs_req *req, int status, proxy_error_kind kind, const char *fmt,
                       ...) {
    va_list ap;
    va_start(ap, fmt);
    reply_error_v(px, req, status, kind, NULL, fmt, ap);
    va_end(ap);
}

static void proxy_reply_error_hdr(proxy *px, hs_req *req, int status, proxy_error_kind kind,
                                  const char *extra_headers, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    reply_error_v(px, req, status, kind, extra_headers, fmt, ap);
    va_end(ap);
}

/* 405 with the Allow header listing `allow` ("POST", "GET", "GET, HEAD"). */
static void reply_405(proxy *px, hs_req *req, const char *method, const char *path,
                      const char *allow) {
    char hdr[64];
    snprintf(hdr, sizeof hdr, "Allow: %s\r\n", allow);
    proxy_reply_error_hdr(px, req, 405, PERR_METHOD, hdr, "method %s is not allowed on %s; use %s",
                          method, path, allow);
}

int proxy_ready(const proxy *px) {
    int p = 0, d = 0;
    for (int i = 0; i < px->nprefill; i++)
        p |= px->prefill[i].ready && px->prefill[i].nengines > 0;
    for (int i = 0; i < px->ndecode; i++)
        d |= px->decode[i].ready;
    return p && d;
}

uint16_t proxy_port(const proxy *px) {
    return hs_server_port(px->srv);
}

/* Why the proxy is not ready, for 503 bodies. */
static void not_ready_reason(const proxy *px, char *out, size_t cap) {
    size_t n = (size_t)snprintf(out, cap, "the proxy is not ready: ");
    const char *sep = "";
    for (int r = 0; r < 2; r++) {
        const upstream *list = r ? px->decode : px->prefill;
        int cnt = r ? px->ndecode : px->nprefill, any = 0;
        int known = 0;
        for (int i = 0; i < cnt; i++) {
            any |= list[i].ready;
            known += list[i].active;
        }
        if (any) continue;
        if (!known && n < cap) {
            n += (size_t)snprintf(out + n, cap - n, "%sno %s instance is known", sep,
                                  r ? "decode" : "prefill");
            sep = "; ";
        }
        for (int i = 0; i < cnt && n < cap; i++) {
            if (!list[i].active) continue;
            n +=
                (size_t)snprintf(out + n, cap - n, "%s%s %s: %s", sep,
                                 upstream_role_name(list[i].role), list[i].url, list[i].last_error);
            sep = "; ";
        }
    }
    if (px->members && n < cap) {
        char d[900];
        membership_describe(px, d, sizeof d);
        snprintf(out + n, cap - n, " (%s)", d);
    }
}

/* ---- metrics ---------------------------------------------------------- */

static void write_metrics(proxy *px, prom *o) {
    static const char *const ep_names[EP_COUNT] = {
        "/v1/completions", "/v1/chat/completions", "/v1/models",   "/health",
        "/metrics",        "/v1/responses",        "/v1/messages", "other"};
    static const char *const err_names[PERR_COUNT] = {
        "bad_request",     "not_found",     "method_not_allowed",  "not_ready",
        "prefill_failed",  "decode_failed", "client_disconnected", "prefill_rejected",
        "decode_rejected", "unauthorized"};
    prom_family(o, "disagg_proxy_requests", PROM_COUNTER, "Client requests by endpoint.");
    for (int i = 0; i < EP_COUNT; i++)
        prom_sample_u64(o, px->requests[i], "endpoint", ep_names[i], NULL);
    prom_family(o, "disagg_proxy_responses", PROM_COUNTER, "Client responses by status class.");
    for (int i = 1; i <= 5; i++) {
        char code[8];
        snprintf(code, sizeof code, "%dxx", i);
        prom_sample_u64(o, px->responses[i], "code", code, NULL);
    }
    prom_family(o, "disagg_proxy_errors", PROM_COUNTER, "Failed client requests by reason.");
    for (int i = 0; i < PERR_COUNT; i++)
        prom_sample_u64(o, px->errors[i], "reason", err_names[i], NULL);
    prom_family(o, "disagg_proxy_retries", PROM_COUNTER,
                "Requests resent to another instance after a refused connection.");
    for (int r = 0; r < 2; r++)
        prom_sample_u64(o, px->retries[r], "role", upstream_role_name((upstream_role)r), NULL);
    prom_family(o, "disagg_proxy_stale_engine_retries", PROM_COUNTER,
                "Decode requests resent with a prefill's re-read engine id after the decode "
                "answered that the prefill's bootstrap server knows no engine it was given "
                "(the prefill restarted).");
    prom_sample_u64(o, px->engine_retries, NULL);
    prom_family(o, "disagg_proxy_inflight_requests", PROM_GAUGE, "Client requests being relayed.");
    prom_sample(o, px->inflight, NULL);
    prom_family(o, "disagg_proxy_ready", PROM_GAUGE,
                "1 when a prefill and a decode instance are ready.");
    prom_sample(o, proxy_ready(px), NULL);

    /* per upstream instance; the label keeps its published name, backend */
    static const struct {
        const char *name;
        prom_type type;
        const char *help;
    } per[] = {
        {"disagg_proxy_backend_healthy", PROM_GAUGE, "1 when the instance is in rotation."},
        {"disagg_proxy_backend_outstanding_requests", PROM_GAUGE,
         "Requests in flight on the instance."},
        {"disagg_proxy_backend_requests", PROM_COUNTER, "Requests sent to the instance."},
        {"disagg_proxy_backend_errors", PROM_COUNTER,
         "Requests to the instance that failed (connection, timeout, HTTP 5xx)."},
        {"disagg_proxy_backend_dp_ranks", PROM_GAUGE, "Data-parallel ranks discovered (prefill)."},
    };
    for (size_t m = 0; m < sizeof per / sizeof per[0]; m++) {
        prom_family(o, per[m].name, per[m].type, per[m].help);
        for (int r = 0; r < 2; r++) {
            upstream *list = r ? px->decode : px->prefill;
            int cnt = r ? px->ndecode : px->nprefill;
            for (int i = 0; i < cnt; i++) {
                upstream *b = &list[i];
                if (!b->active) continue;
                uint64_t v = m == 0   ? (uint64_t)b->ready
                             : m == 1 ? (uint64_t)b->outstanding
                             : m == 2 ? b->requests
                             : m == 3 ? b->errors
                                      : (uint64_t)b->nengines;
                if (m == 4 && r) continue;
                prom_sample_u64(o, v, "role", upstream_role_name(b->role), "backend", b->url, NULL);
            }
        }
    }
    prom_family(o, "disagg_proxy_backend_latency_seconds", PROM_HISTOGRAM,
                "Request start to response end per instance.");
    for (int r = 0; r < 2; r++) {
        upstream *list = r ? px->decode : px->prefill;
        int cnt = r ? px->ndecode : px->nprefill;
        for (int i = 0; i < cnt; i++) {
            if (!list[i].active) continue;
            prom_hist h = metrics_hist_view(&list[i].latency);
            prom_histogram(o, &h, "role", upstream_role_name(list[i].role), "backend", list[i].url,
                           NULL);
        }
    }
    prom_family(o, "disagg_proxy_phase_seconds", PROM_HISTOGRAM,
                "Time split of disaggregated requests: prefill (P dispatch to P answer), "
                "decode (P answer to D end), first_byte and total (from the client request).");
    static const char *const phases[] = {"prefill", "decode", "first_byte", "total"};
    const metrics_hist *ph[] = {&px->t_prefill, &px->t_decode, &px->t_first_byte, &px->t_total};
    for (int i = 0; i < 4; i++) {
        prom_hist h = metrics_hist_view(ph[i]);
        prom_histogram(o, &h, "phase", phases[i], NULL);
    }
    prom_family(o, "disagg_proxy_engine_table_refreshes", PROM_COUNTER,
                "Times a prefill's bootstrap /query table was read with engine ids other than "
                "those the proxy had (a restart), by what read it: probe (the health probe, "
                "every period) or unknown_engine (a decode named the engine unknown).");
    for (int i = 0; i < px->nprefill; i++) {
        const upstream *b = &px->prefill[i];
        if (!b->active) continue;
        prom_sample_u64(o, b->table_changes[0], "backend", b->url, "trigger", "probe", NULL);
        prom_sample_u64(o, b->table_changes[1], "backend", b->url, "trigger", "unknown_engine",
                        NULL);
    }
    membership_write_metrics(px, o);
    if (px->kv) kv_route_write_metrics(px->kv, px->prefill, px->nprefill, o);
}

/* ---- routing ---------------------------------------------------------- */

/* --api-key: the client's "Authorization: Bearer <key>" matches (constant time
 * over the key's bytes).  Without --api-key every client is accepted. */
static int client_key_ok(proxy *px, hs_req *req) {
    const char *key = px->cfg.api_key;
    if (!key || !key[0]) return 1;
    /* Authorization: Bearer KEY, or x-api-key: KEY (the Anthropic SDK's, for /v1/messages) */
    const char *h = http_head_get(hs_req_head(req), "Authorization");
    if (h && !strncasecmp(h, "Bearer ", 7))
        h += 7;
    else
        h = http_head_get(hs_req_head(req), "x-api-key");
    if (!h) return 0;
    size_t n = strlen(key);
    return strlen(h) == n && auth_equal(h, key, n);
}

static void handle(hs_req *req, void *arg) {
    proxy *px = arg;
    const char *path = hs_req_path(req);
    const char *method = hs_req_head(req)->method;
    int is_get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    proxy_endpoint ep = !strcmp(path, "/v1/completions")        ? EP_COMPLETIONS
                        : !strcmp(path, "/v1/chat/completions") ? EP_CHAT
                        : !strcmp(path, "/v1/models")           ? EP_MODELS
                        : !strcmp(path, "/health")              ? EP_HEALTH
                        : !strcmp(path, "/healthcheck")         ? EP_HEALTH
                        : !strcmp(path, "/metrics")             ? EP_METRICS
                        : !strcmp(path, "/v1/responses")        ? EP_RESPONSES
                        : !strcmp(path, "/v1/messages")         ? EP_MESSAGES
                                                                : EP_OTHER;
    px->requests[ep]++;
    /* as vLLM's --api-key: every /v1 path needs the key; /health, /metrics are open */
    if (!strncmp(path, "/v1", 3) && (!path[3] || path[3] == '/') && !client_key_ok(px, req)) {
        /* vLLM's AuthenticationMiddleware body, byte for byte */
        static const char body[] = "{\"error\":\"Unauthorized\"}";
        px->errors[PERR_UNAUTHORIZED]++;
        proxy_count_status(px, 401);
        hs_reply(req, 401, "application/json", "WWW-Authenticate: Bearer\r\n", body,
                 sizeof body - 1);
        return;
    }
    if (ep == EP_OTHER) {
        proxy_reply_error(px, req, 404, PERR_NOT_FOUND,
                          "no route for %s %.200s; the proxy serves POST /v1/completions, POST "
                          "/v1/chat/completions, POST /v1/responses, POST /v1/messages, GET "
                          "/v1/models, GET /health, GET /metrics",
                          method, path);
        return;
    }
    if ((ep == EP_COMPLETIONS || ep == EP_CHAT || ep == EP_RESPONSES || ep == EP_MESSAGES) &&
        strcmp(method, "POST") != 0) {
        reply_405(px, req, method, path, "POST");
        return;
    }
    if (ep == EP_MODELS && strcmp(method, "GET") != 0) {
        reply_405(px, req, method, path, "GET");
        return;
    }
    if ((ep == EP_HEALTH || ep == EP_METRICS) && !is_get) {
        reply_405(px, req, method, path, "GET, HEAD");
        return;
    }
    if (ep == EP_METRICS) {
        prom o;
        prom_init(&o, (size_t)16 << 20, PROM_STYLE_INT);
        write_metrics(px, &o);
        int bad = prom_error(&o) != 0;
        if (bad) LOG_E(MOD, "/metrics: %s", strerror(-prom_error(&o)));
        proxy_count_status(px, bad ? 500 : 200);
        hs_reply(req, bad ? 500 : 200, "text/plain; version=0.0.4; charset=utf-8", NULL,
                 bad ? "" : prom_text(&o), bad ? 0 : o.len);
        prom_free(&o);
        return;
    }
    char why[2048];
    if (!strcmp(path, "/healthcheck")) { /* vLLM toy proxy's liveness: 200 while running */
        int ready = proxy_ready(px) && !px->draining, np = 0, nd = 0;
        for (int i = 0; i < px->nprefill; i++) /* with --discovery some slots are free */
            np += px->prefill[i].active && !px->prefill[i].retiring;
        for (int i = 0; i < px->ndecode; i++)
            nd += px->decode[i].active && !px->decode[i].retiring;
        int n = snprintf(why, sizeof why,
                         "{\"status\":\"ok\",\"ready\":%s,\"prefill_instances\":%d,"
                         "\"decode_instances\":%d}",
                         ready ? "true" : "false", np, nd);
        proxy_count_status(px, 200);
        hs_reply(req, 200, "application/json", NULL, why, (size_t)n);
        return;
    }
    if (px->draining && ep != EP_HEALTH) {
        proxy_reply_error(px, req, 503, PERR_NOT_READY, "the proxy is shutting down");
        return;
    }
    if (px->draining || !proxy_ready(px)) {
        if (px->draining)
            snprintf(why, sizeof why, "the proxy is shutting down");
        else
            not_ready_reason(px, why, sizeof why);
        proxy_reply_error(px, req, 503, PERR_NOT_READY, "%s", why);
        return;
    }
    if (ep == EP_HEALTH) {
        proxy_count_status(px, 200);
        hs_reply(req, 200, "application/json", NULL, "{\"status\":\"ok\"}", 15);
        return;
    }
    if (ep == EP_MODELS) {
        relay_start_passthrough(px, req);
        return;
    }
    size_t len;
    const char *body = hs_req_body(req, &len);
    json_t *j;
    if (pd_parse_client_body(body, len, &j, why, sizeof why)) {
        proxy_reply_error(px, req, 400, PERR_BAD_REQUEST, "%s", why);
        return;
    }
    /* what P's copy rewrites is checked here: P cannot refuse it, and once P
     * accepted, a D that refuses it would leave P holding the KV */
    char param[64];
    int bad = ep == EP_RESPONSES || ep == EP_MESSAGES
                  ? pd_check_api_body(j, path, param, sizeof param, why, sizeof why)
                  : pd_check_client_body(j, ep == EP_CHAT, param, sizeof param, why, sizeof why);
    if (bad) {
        json_decref(j);
        LOG_D(MOD, "refused before contacting an instance: %s", why);
        char *eb = api_error_json_param(400, param, why);
        px->errors[PERR_BAD_REQUEST]++;
        proxy_count_status(px, 400);
        hs_reply(req, 400, "application/json", NULL, eb ? eb : why, strlen(eb ? eb : why));
        free(eb);
        return;
    }
    relay_start_pd(px, req, j);
}

/* ---- probes and lifecycle --------------------------------------------- */

static void probe_tick(evutil_socket_t fd, short what, void *arg) {
    proxy *px = arg;
    for (int i = 0; i < px->nprefill; i++)
        upstream_probe(&px->prefill[i]);
    for (int i = 0; i < px->ndecode; i++)
        upstream_probe(&px->decode[i]);
}

static void on_upstream_unresponsive(upstream *b, const char *why, void *arg) {
    if (b->role == UPSTREAM_PREFILL) relay_upstream_unresponsive(arg, b, why);
}

static void on_upstream_restart(upstream *b, const char *why, void *arg) {
    kv_route_restarted(b, why);
}

static void on_upstream_table(upstream *b, int ok, void *arg) {
    relay_upstream_table(arg, b, ok);
}

static char *server_error_body(int status, const char *message) {
    return api_error_json(status, message);
}

proxy *proxy_new(struct event_base *base, const proxy_config *cfg, char *err, size_t errcap) {
    if (!cfg->discovery && (cfg->nprefill < 1 || cfg->ndecode < 1)) {
        snprintf(err, errcap,
                 "at least one --prefill and one --decode instance are needed (got %d and %d)",
                 cfg->nprefill, cfg->ndecode);
        return NULL;
    }
    if (cfg->nprefill > POLICY_MAX_BACKENDS || cfg->ndecode > POLICY_MAX_BACKENDS) {
        snprintf(err, errcap, "at most %d instances per role are accepted", POLICY_MAX_BACKENDS);
        return NULL;
    }
    proxy *px = calloc(1, sizeof *px);
    if (!px) {
        snprintf(err, errcap, "out of memory");
        return NULL;
    }
    px->base = base;
    px->cfg = *cfg;
    if (cfg->api_key && cfg->api_key[0])
        snprintf(px->auth_header, sizeof px->auth_header, "Authorization: Bearer %s\r\n",
                 cfg->api_key);
    px->env.base = base;
    px->env.auth_header = px->auth_header[0] ? px->auth_header : NULL;
    px->env.pool_keepalive_s = cfg->upstream_keepalive_s;
    px->env.probe_timeout_s = cfg->health_interval_s * 2 < 2 ? 2 : cfg->health_interval_s * 2;
    px->env.on_unresponsive = on_upstream_unresponsive;
    px->env.on_restart = on_upstream_restart;
    px->env.on_table = on_upstream_table;
    px->env.cb_arg = px;
    if (cfg->policy == POLICY_KV_AWARE) {
        if (!cfg->kv) {
            snprintf(err, errcap,
                     "--policy kv_aware needs the instances' tokenizer: give --tokenizer");
            goto fail;
        }
        if (!(px->kv = kv_route_new(base, cfg->kv, err, errcap))) goto fail;
    }
    /* with discovery every slot exists from the start: relays point into these arrays */
    size_t np = cfg->discovery ? POLICY_MAX_BACKENDS : (size_t)cfg->nprefill;
    size_t nd = cfg->discovery ? POLICY_MAX_BACKENDS : (size_t)cfg->ndecode;
    px->prefill = calloc(np, sizeof *px->prefill);
    px->decode = calloc(nd, sizeof *px->decode);
    if (!px->prefill || !px->decode) goto oom;
    for (int i = 0; i < cfg->nprefill; i++) {
        if (upstream_init(&px->prefill[i], UPSTREAM_PREFILL, i, cfg->prefill[i].url,
                          cfg->prefill[i].bootstrap, &px->env, err, errcap))
            goto fail;
        px->nprefill++;
        if (px->kv && kv_route_attach(px->kv, &px->prefill[i], err, errcap)) goto fail;
    }
    for (int i = 0; i < cfg->ndecode; i++) {
        if (upstream_init(&px->decode[i], UPSTREAM_DECODE, i, cfg->decode[i].url, NULL, &px->env,
                          err, errcap))
            goto fail;
        px->ndecode++;
    }
    hs_config hc;
    hs_config_default(&hc);
    hc.limits.max_headers = cfg->max_headers;
    hc.limits.max_head_bytes = cfg->max_head_bytes;
    hc.max_body_bytes = cfg->max_body_bytes;
    hc.request_timeout_s = cfg->client_timeout_s;
    hc.header_timeout_s = cfg->client_header_timeout_s;
    hc.idle_timeout_s = cfg->keepalive_timeout_s;
    px->srv = hs_server_new(base, cfg->host, cfg->port, &hc, handle, px, server_error_body);
    if (!px->srv) {
        snprintf(err, errcap, "cannot listen on %s:%u (see the log above)", cfg->host, cfg->port);
        goto fail;
    }
    px->probe_timer = event_new(base, -1, EV_PERSIST, probe_tick, px);
    struct timeval tv = {
        (time_t)cfg->health_interval_s,
        (suseconds_t)((cfg->health_interval_s - (double)(time_t)cfg->health_interval_s) * 1e6)};
    event_add(px->probe_timer, &tv);
    if (cfg->discovery && membership_start(px, err, errcap)) goto fail;
    probe_tick(-1, 0, px);
    return px;
oom:
    snprintf(err, errcap, "out of memory");
fail:
    proxy_free(px);
    return NULL;
}

void proxy_free(proxy *px) {
    if (!px) return;
    hs_server_free(px->srv); /* close callbacks cancel the relays */
    if (px->probe_timer) event_free(px->probe_timer);
    if (px->drain_timer) event_free(px->drain_timer);
    membership_stop(px);
    for (int i = 0; i < px->nprefill; i++)
        upstream_free(&px->prefill[i]);
    for (int i = 0; i < px->ndecode; i++)
        upstream_free(&px->decode[i]);
    free(px->prefill);
    free(px->decode);
    kv_route_free(px->kv); /* after the upstreams: their sockets are of its context */
    free(px);
}

static void drain_check(evutil_socket_t fd, short what, void *arg) {
    proxy *px = arg;
    if (px->inflight == 0) {
        LOG_I(MOD, "no request in flight: stopping");
        event_base_loopexit(px->base, NULL);
    } else if (clock_now_ns() >= px->drain_deadline_ns) {
        LOG_W(MOD, "shutdown timeout: stopping with %d requests in flight", px->inflight);
        event_base_loopexit(px->base, NULL);
    }
}

void proxy_drain(proxy *px) {
    if (px->draining) return;
    px->draining = 1;
    px->drain_deadline_ns = clock_now_ns() + (uint64_t)(px->cfg.shutdown_timeout_s * 1e9);
    hs_server_stop_listening(px->srv);
    LOG_I(MOD, "draining: %d requests in flight, waiting up to %g s", px->inflight,
          px->cfg.shutdown_timeout_s);
    px->drain_timer = event_new(px->base, -1, EV_PERSIST, drain_check, px);
    struct timeval tv = {0, 20000};
    event_add(px->drain_timer, &tv);
    drain_check(-1, 0, px);
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    proxy *px = arg;
    if (px->draining) {
        LOG_I(MOD, "signal %d again: stopping now", (int)sig);
        event_base_loopexit(px->base, NULL);
        return;
    }
    LOG_I(MOD, "signal %d: finishing the requests in flight (again to stop at once)", (int)sig);
    proxy_drain(px);
}

struct event_base *proxy_event_base_new(void) {
    struct event_config *ec = event_config_new();
    if (!ec) return NULL;
    event_config_set_flag(ec, EVENT_BASE_FLAG_EPOLL_USE_CHANGELIST);
    struct event_base *base = event_base_new_with_config(ec);
    event_config_free(ec);
    return base ? base : event_base_new();
}

int proxy_run(const proxy_config *cfg) {
    signal(SIGPIPE, SIG_IGN);
    /* Each client costs up to three descriptors (client, P, D): take the hard limit. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 4096)
        LOG_W(MOD, "only %llu file descriptors allowed (ulimit -n): about %llu concurrent clients",
              (unsigned long long)rl.rlim_cur, (unsigned long long)rl.rlim_cur / 3);
    struct event_base *base = proxy_event_base_new();
    if (!base) {
        LOG_E(MOD, "cannot create the event loop");
        return 1;
    }
    char err[512];
    proxy *px = proxy_new(base, cfg, err, sizeof err);
    if (!px) {
        LOG_E(MOD, "%s", err);
        event_base_free(base);
        return 1;
    }
    struct event *si = evsignal_new(base, SIGINT, on_signal, px);
    struct event *st = evsignal_new(base, SIGTERM, on_signal, px);
    event_add(si, NULL);
    event_add(st, NULL);
    LOG_I(MOD, "listening on http://%s:%u (policy %s, %d prefill, %d decode)", cfg->host,
          proxy_port(px), policy_name(cfg->policy), px->nprefill, px->ndecode);
    for (int i = 0; i < px->nprefill; i++)
        LOG_I(MOD, "prefill %s (bootstrap %s)", px->prefill[i].url, px->prefill[i].bootstrap_url);
    for (int i = 0; i < px->ndecode; i++)
        LOG_I(MOD, "decode %s", px->decode[i].url);
    event_base_dispatch(base);
    proxy_free(px);
    event_free(si);
    event_free(st);
    event_base_free(base);
    return 0;
}
