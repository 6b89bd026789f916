/*
 * http — the HTTP side of `disagg serve`: the event loop, the listener on
 * base/http_server (the project's one HTTP/1.1 layer: parsing, limits, 413
 * for a body over the limit, the header / body / keep-alive deadlines), the
 * router (404 unknown route, 405 wrong method with an Allow header, 401
 * without the API key, 503 while the model loads), CORS, the loader thread
 * and the info endpoints (/health, /version, /v1/models, /metrics).  Replies
 * go through reply.c; generation requests to completion.c / chat.c, which
 * use gen.c.
 */
#include "server/server_ctx.h"

#include "base/clock.h"
#include "base/http_server.h"
#include "base/log.h"
#include "base/net.h"
#include "connector/kv_events_publisher.h"
#include "connector/mooncake/mooncake_connector.h"
#include "model/model_config.h"

#include <errno.h>
#include <event2/event.h>
#include <event2/thread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#ifndef DISAGG_VERSION
#define DISAGG_VERSION "0.1.0"
#endif

void server_config_init(server_config *c) {
    memset(c, 0, sizeof *c);
    c->host = "0.0.0.0";
    c->port = 8000;
    c->max_body_bytes = (size_t)32 << 20;
    c->header_timeout_s = 60;   /* nginx's client_header_timeout */
    c->keepalive_timeout_s = 5; /* uvicorn's and vLLM's */
    c->body_timeout_s = 60;     /* nginx's client_body_timeout (there per read; here whole) */
    c->log_requests = 1;
    c->log_stats = 1;
    c->max_logprobs = 20; /* vLLM's default */
    c->generation_config = "auto";
    engine_config_init(&c->engine);
}

/* ---- info endpoints --------------------------------------------------------------- */

static void handle_health(server *s, hs_req *req) {
    server_reply_text(req, atomic_load(&s->ready) == 1 ? 200 : 503, NULL, "", 0);
}

/* vLLM's /load: {"server_load": requests in flight}; here the engine's running, waiting
 * and parked (waiting for remote KV) requests, 0 while the model loads -- what
 * vllm-router's power_of_two policy reads. */
static void handle_load(server *s, hs_req *req) {
    engine_stats st;
    memset(&st, 0, sizeof st);
    if (s->eng) engine_get_stats(s->eng, &st);
    json_int_t load = (json_int_t)st.num_running + st.num_waiting + st.num_parked;
    server_reply_json(req, 200, json_pack("{s:I}", "server_load", load), NULL);
}

/* vLLM's POST /reset_prefix_cache: every cached block is forgotten at the engine's next
 * step (refused, with a warning in the log, while cached blocks are in use); 200 at once. */
static void handle_reset_prefix_cache(server *s, hs_req *req) {
    engine_reset_prefix_cache(s->eng);
    server_reply_text(req, 200, NULL, "", 0);
}

static void handle_version(server *s, hs_req *req) {
    (void)s;
    server_reply_json(req, 200, json_pack("{s:s}", "version", DISAGG_VERSION), NULL);
}

/* One entry per served name, the first the one responses report (vLLM's list). */
static void handle_models(server *s, hs_req *req) {
    json_t *data = json_array();
    for (int i = -1; data && i < s->cfg.n_more_model_names; i++) {
        const char *name = i < 0 ? s->model_name : s->cfg.more_model_names[i];
        json_t *m = json_pack("{s:s,s:s,s:I,s:s,s:s,s:n}", "id", name, "object", "model", "created",
                              (json_int_t)time(NULL), "owned_by", "disagg", "root",
                              s->cfg.model ? s->cfg.model : s->model_name, "parent");
        if (m && s->max_model_len > 0)
            json_object_set_new(m, "max_model_len", json_integer(s->max_model_len));
        json_array_append_new(data, m);
    }
    server_reply_json(req, 200, json_pack("{s:s,s:o}", "object", "list", "data", data), NULL);
}

static void handle_metrics(server *s, hs_req *req) {
    engine_stats st;
    memset(&st, 0, sizeof st);
    if (s->eng) engine_get_stats(s->eng, &st);
    prom p;
    prom_init(&p, (size_t)16 << 20, PROM_STYLE_FLOAT);
    int rc = metrics_render(&s->metrics, &st, s->block_size, s->model_name, &p);
    if (!rc && s->conn) { /* disagg:kv_* */
        rc = mooncake_connector_metrics(s->conn, &p);
        /* the first-token handoff (docs/connector.md) */
        prom_set_style(&p, PROM_STYLE_INT);
        prom_family(&p, "disagg:kv_first_token_handoffs", PROM_COUNTER,
                    "Remote-prefill requests whose first output token came from the producer (no "
                    "prompt position recomputed), by outcome.");
        prom_sample_u64(&p, st.first_token_handoffs, "outcome", "used", NULL);
        prom_sample_u64(&p, st.first_token_refused, "outcome", "refused", NULL);
        rc = prom_error(&p);
    }
    if (!rc && s->kvev) { /* --kv-events-config: what a subscriber should have received */
        uint64_t sent, dropped;
        kv_events_publisher_counts(s->kvev, &sent, &dropped);
        prom_set_style(&p, PROM_STYLE_INT);
        prom_family(&p, "disagg:kv_events_batches", PROM_COUNTER,
                    "KV event batches published on the ZMQ socket, or dropped (queue full).");
        prom_sample_u64(&p, sent, "outcome", "published", NULL);
        prom_sample_u64(&p, dropped, "outcome", "dropped", NULL);
        rc = prom_error(&p);
    }
    if (rc) LOG_E("server", "/metrics: %s", strerror(-rc));
    server_reply_text(req, rc ? 500 : 200, "text/plain; version=0.0.4; charset=utf-8",
                      rc ? "" : prom_text(&p), rc ? 0 : p.len);
    prom_free(&p);
}

/* ---- router ---------------------------------------------------------------------- */

typedef void (*route_fn)(server *s, hs_req *req);

typedef struct route {
    const char *path; /* exact path */
    int method;       /* ROUTE_GET (HEAD too) or ROUTE_POST */
    int needs_engine; /* 503 until the model is loaded */
    int needs_key;    /* --api-key applies (the /v1 routes, as vLLM) */
    route_fn fn;      /* handler */
} route;

enum { ROUTE_GET = 1, ROUTE_POST = 2 };

static const route ROUTES[] = {
    {"/v1/completions", ROUTE_POST, 1, 1, server_completion_handle},
    {"/v1/chat/completions", ROUTE_POST, 1, 1, server_chat_handle},
    {"/v1/responses", ROUTE_POST, 1, 1, server_responses_handle},
    {"/v1/messages", ROUTE_POST, 1, 1, server_messages_handle},
    {"/v1/models", ROUTE_GET, 0, 1, handle_models},
    {"/tokenize", ROUTE_POST, 1, 0, server_tokenize_handle},
    {"/detokenize", ROUTE_POST, 1, 0, server_detokenize_handle},
    {"/health", ROUTE_GET, 0, 0, handle_health},
    {"/ping", ROUTE_GET | ROUTE_POST, 0, 0, handle_health},
    {"/load", ROUTE_GET, 0, 0, handle_load},
    {"/version", ROUTE_GET, 0, 0, handle_version},
    {"/metrics", ROUTE_GET, 0, 0, handle_metrics},
    {"/reset_prefix_cache", ROUTE_POST, 1, 0, handle_reset_prefix_cache},
};
#define NROUTES (sizeof ROUTES / sizeof ROUTES[0])

/* The key as Authorization: Bearer KEY, or as x-api-key: KEY (how the Anthropic SDK sends it,
 * for /v1/messages). */
static int api_key_ok(server *s, hs_req *req) {
    if (!s->cfg.api_key || !*s->cfg.api_key) return 1;
    const char *h = http_head_get(hs_req_head(req), "Authorization");
    if (h && !strncasecmp(h, "Bearer ", 7))
        h += 7;
    else
        h = http_head_get(hs_req_head(req), "x-api-key");
    if (!h) return 0;
    size_t a = strlen(h), b = strlen(s->cfg.api_key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a && i < b; i++)
        diff |= (unsigned char)(h[i] ^ s->cfg.api_key[i]);
    return diff == 0;
}

/* ---- CORS (vLLM's CORSMiddleware: --allowed-origins/-methods/-headers, --allow-credentials) ---
 * As Starlette's middleware: a request with an Origin header gets Access-Control-Allow-Origin
 * when the origin is allowed ("*" when every origin is and credentials are off, else the origin
 * itself with Vary: Origin); a preflight (OPTIONS with Access-Control-Request-Method) is
 * answered here: 200 "OK" with the allowed methods and headers, or 400 naming what was
 * disallowed. */

/* 1 when list (a JSON array of strings; NULL = ["*"]) holds "*" or item (case-insensitive
 * when ci). */
static int cors_list_has(const json_t *list, const char *item, size_t len, int ci) {
    if (!list) return 1;
    size_t i;
    const json_t *v;
    json_array_foreach(list, i, v) {
        const char *x = json_string_value(v);
        if (!x) continue;
        if (!strcmp(x, "*")) return 1;
        if (strlen(x) == len && (ci ? !strncasecmp(x, item, len) : !strncmp(x, item, len)))
            return 1;
    }
    return 0;
}

/* 1 when list is NULL or holds "*" (no entry is "\x01") */
#define CORS_WILD(list) cors_list_has((list), "\x01", 1, 0)

static void cors_allow_origin(const server *s, hs_req *out, const char *origin) {
    int wild = !s->cfg.cors_origins || CORS_WILD(s->cfg.cors_origins);
    if (wild && !s->cfg.cors_credentials)
        hs_req_add_header(out, "Access-Control-Allow-Origin", "*");
    else {
        hs_req_add_header(out, "Access-Control-Allow-Origin", origin);
        hs_req_add_header(out, "Vary", "Origin");
    }
    if (s->cfg.cors_credentials) hs_req_add_header(out, "Access-Control-Allow-Credentials", "true");
}

/* Returns 1 when the request was a preflight and has been answered. */
static int cors_handle(server *s, hs_req *req) {
    const http_head *in = hs_req_head(req);
    hs_req *out = req;
    const char *origin = http_head_get(in, "Origin");
    if (!origin) return 0;
    int origin_ok = cors_list_has(s->cfg.cors_origins, origin, strlen(origin), 0);
    const char *want = http_head_get(in, "Access-Control-Request-Method");
    if (strcmp(in->method, "OPTIONS") || !want) {
        if (origin_ok) cors_allow_origin(s, out, origin);
        return 0;
    }
    char why[256] = "";
    if (!origin_ok) snprintf(why, sizeof why, "origin");
    if (!cors_list_has(s->cfg.cors_methods, want, strlen(want), 1))
        snprintf(why + strlen(why), sizeof why - strlen(why), "%smethod", *why ? ", " : "");
    const char *hdrs = http_head_get(in, "Access-Control-Request-Headers");
    if (hdrs && s->cfg.cors_headers && !CORS_WILD(s->cfg.cors_headers)) {
        static const char *safe[] = {"accept", "accept-language", "content-language",
                                     "content-type"};
        for (const char *p = hdrs; *p;) {
            while (*p == ' ' || *p == ',')
                p++;
            size_t n = strcspn(p, ", ");
            if (!n) break;
            int ok = cors_list_has(s->cfg.cors_headers, p, n, 1);
            for (size_t k = 0; k < 4 && !ok; k++)
                ok = strlen(safe[k]) == n && !strncasecmp(safe[k], p, n);
            if (!ok) {
                snprintf(why + strlen(why), sizeof why - strlen(why), "%sheaders",
                         *why ? ", " : "");
                break;
            }
            p += n;
        }
    }
    if (*why) {
        char msg[300];
        int n = snprintf(msg, sizeof msg, "Disallowed CORS %s", why);
        server_reply_text(req, 400, "text/plain; charset=utf-8", msg, (size_t)n);
        return 1;
    }
    cors_allow_origin(s, out, origin);
    if (!s->cfg.cors_methods || CORS_WILD(s->cfg.cors_methods))
        hs_req_add_header(out, "Access-Control-Allow-Methods",
                          "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT");
    else {
        char *m = NULL;
        size_t i, o = 0, cap = 0;
        const json_t *v;
        json_array_foreach(s->cfg.cors_methods, i, v) cap += strlen(json_string_value(v)) + 2;
        m = calloc(1, cap + 1);
        json_array_foreach(s->cfg.cors_methods, i, v) o +=
            (size_t)snprintf(m + o, cap + 1 - o, "%s%s", i ? ", " : "", json_string_value(v));
        if (m) hs_req_add_header(out, "Access-Control-Allow-Methods", m);
        free(m);
    }
    if (hdrs && (!s->cfg.cors_headers || CORS_WILD(s->cfg.cors_headers)))
        hs_req_add_header(out, "Access-Control-Allow-Headers", hdrs);
    else if (s->cfg.cors_headers) {
        char m[2048] = "Accept, Accept-Language, Content-Language, Content-Type";
        size_t i;
        const json_t *v;
        json_array_foreach(s->cfg.cors_headers, i, v) {
            size_t o = strlen(m);
            snprintf(m + o, sizeof m - o, ", %s", json_string_value(v));
        }
        hs_req_add_header(out, "Access-Control-Allow-Headers", m);
    }
    hs_req_add_header(out, "Access-Control-Max-Age", "600");
    server_reply_text(req, 200, "text/plain; charset=utf-8", "OK", 2);
    return 1;
}

static void http_dispatch(hs_req *req, void *arg) {
    server *s = arg;
    s->metrics.http_requests++;
    if (cors_handle(s, req)) return;
    const char *path = hs_req_path(req);
    const char *mname = hs_req_head(req)->method;
    int method = !strcmp(mname, "GET") || !strcmp(mname, "HEAD") ? ROUTE_GET
                 : !strcmp(mname, "POST")                        ? ROUTE_POST
                                                                 : 0;
    const route *match = NULL;
    for (size_t i = 0; i < NROUTES; i++)
        if (!strcmp(path, ROUTES[i].path)) {
            match = &ROUTES[i];
            break;
        }
    if (!match) {
        server_reply_errorf(
            req, 404, "NotFoundError", NULL,
            "No route for %s; accepted: POST /v1/completions, POST "
            "/v1/chat/completions, POST /v1/responses, POST /v1/messages, GET /v1/models, POST "
            "/tokenize, POST "
            "/detokenize, GET /health, GET|POST /ping, GET /load, GET /version, GET "
            "/metrics",
            path);
        return;
    }
    if (!(method & match->method)) {
        const char *m = match->method == ROUTE_GET    ? "GET"
                        : match->method == ROUTE_POST ? "POST"
                                                      : "GET, POST";
        hs_req_add_header(req, "Allow", m);
        server_reply_errorf(req, 405, "MethodNotAllowed", NULL,
                            "Method not allowed on %s; accepted: %s", path, m);
        return;
    }
    if (match->needs_key && !api_key_ok(s, req)) {
        /* vLLM's AuthenticationMiddleware body, byte for byte */
        server_reply_json(req, 401, json_pack("{s:s}", "error", "Unauthorized"), NULL);
        return;
    }
    if (match->needs_engine && atomic_load(&s->ready) != 1) {
        server_reply_errorf(req, 503, "ServiceUnavailableError", NULL,
                            "The model is still loading; retry when GET /health returns 200");
        return;
    }
    match->fn(s, req);
}

/* ---- loading ---------------------------------------------------------------------- */

/* --generation-config DIR: the sampling defaults of DIR/generation_config.json (checked by
 * the command line before the server starts). */
static void load_generation_config(server *s, const char *dir) {
    char p[4096];
    snprintf(p, sizeof p, "%s/generation_config.json", dir);
    json_error_t je;
    json_t *g = json_load_file(p, 0, &je);
    if (!json_is_object(g)) {
        LOG_W("server", "--generation-config: %s: %s; using no defaults", p, je.text);
        json_decref(g);
        return;
    }
    const json_t *v;
    if ((v = json_object_get(g, "temperature")) && json_is_number(v))
        s->defaults.temperature = (float)json_number_value(v);
    if ((v = json_object_get(g, "top_p")) && json_is_number(v))
        s->defaults.top_p = (float)json_number_value(v);
    if ((v = json_object_get(g, "top_k")) && json_is_integer(v))
        s->defaults.top_k = (int)json_integer_value(v);
    if ((v = json_object_get(g, "repetition_penalty")) && json_is_number(v))
        s->defaults.repetition_penalty = (float)json_number_value(v);
    LOG_I("server",
          "default sampling from %s: temperature %g top_p %g top_k %d repetition_penalty %g (a "
          "request's own values win)",
          p, s->defaults.temperature, s->defaults.top_p, s->defaults.top_k,
          s->defaults.repetition_penalty);
    json_decref(g);
}

static void *loader_main(void *arg) {
    server *s = arg;
    char err[1024] = "";
    engine *e = NULL;
    int rc = engine_create(&s->cfg.engine, &e, err, sizeof err);
    if (rc) {
        snprintf(s->load_error, sizeof s->load_error, "loading the engine failed: %s", err);
        goto fail;
    }
    if (s->cfg.kv_transfer_config) { /* attach before the first submit */
        rc = mooncake_connector_create_on(s->cfg.kv_transfer_config, s->cfg.host, e, &s->conn, err,
                                          sizeof err);
        if (rc) {
            snprintf(s->load_error, sizeof s->load_error, "starting the KV connector failed: %s",
                     err);
            engine_destroy(e);
            goto fail;
        }
    }
    if (s->cfg.kv_events_config) { /* attach before the first submit */
        kv_events_config ec;
        rc = kv_events_config_parse(s->cfg.kv_events_config, &ec, err, sizeof err);
        if (!rc && ec.enabled) {
            rc = kv_events_publisher_create(&ec, &s->kvev, err, sizeof err);
            if (!rc) {
                engine_kv_event_sink sink = {s->kvev, kv_events_publisher_publish};
                engine_set_kv_event_sink(e, &sink);
            }
        }
        if (rc) {
            snprintf(s->load_error, sizeof s->load_error,
                     "starting the KV event publisher failed: %s", err);
            if (s->conn) mooncake_connector_destroy(s->conn);
            s->conn = NULL;
            engine_destroy(e);
            goto fail;
        }
    }
    tokenizer *tok = NULL;
    const char *tok_dir = s->cfg.tokenizer_dir ? s->cfg.tokenizer_dir : engine_model_dir(e);
    rc = tokenizer_load(tok_dir, &tok, err, sizeof err);
    if (rc) {
        snprintf(s->load_error, sizeof s->load_error, "loading the tokenizer failed: %s", err);
        if (s->conn) mooncake_connector_destroy(s->conn);
        s->conn = NULL;
        engine_destroy(e);
        goto fail;
    }
    char mfile[4096];
    int mode = s->cfg.tokenizer_mode;
    if (mode == SERVER_TOKENIZER_MODE_AUTO && mistral_chat_auto(tok_dir) &&
        mistral_chat_find_file(tok_dir, mfile, sizeof mfile)) {
        LOG_I("server",
              "--tokenizer-mode auto: a Mistral-format directory (consolidated*.safetensors) with "
              "%s: mode mistral (--tokenizer-mode hf for the chat template instead)",
              mfile);
        mode = SERVER_TOKENIZER_MODE_MISTRAL;
    }
    if (mode == SERVER_TOKENIZER_MODE_MISTRAL) {
        rc = mistral_chat_open(tok_dir, tok, &s->mistral, err, sizeof err);
        if (rc) {
            snprintf(s->load_error, sizeof s->load_error, "loading the tokenizer failed: %s", err);
            tokenizer_free(tok);
            if (s->conn) mooncake_connector_destroy(s->conn);
            s->conn = NULL;
            engine_destroy(e);
            goto fail;
        }
        LOG_I("server", "chats are encoded by mistral-common's rules: tokenizer %s (%s)%s",
              mistral_chat_version(s->mistral),
              mistral_chat_is_tekken(s->mistral) ? "Tekken" : "SentencePiece",
              s->cfg.chat_template ? "; --chat-template is not used" : "");
    }
    const char *tt = s->cfg.chat_template ? s->cfg.chat_template : tokenizer_chat_template(tok);
    if (s->mistral)
        ; /* no chat template */
    else if (!tt)
        snprintf(s->tmpl_error, sizeof s->tmpl_error, "the model has no chat template");
    else if (chat_template_init(tt, &s->tmpl, err, sizeof err))
        snprintf(s->tmpl_error, sizeof s->tmpl_error, "%s", err);
    const model_config *mc = engine_model_config(e);
    const char *gc = s->cfg.generation_config;
    if (gc && strcmp(gc, "auto")) {
        mc = NULL; /* "vllm": no generation_config.json defaults; a directory: its file */
        if (strcmp(gc, "vllm")) load_generation_config(s, gc);
    }
    if (mc && mc->has_gen_defaults) {
        s->defaults.temperature = mc->gen_temperature;
        s->defaults.top_p = mc->gen_top_p;
        s->defaults.top_k = mc->gen_top_k;
        s->defaults.repetition_penalty = mc->gen_repetition_penalty;
        LOG_I("server",
              "default sampling from generation_config.json: temperature %g top_p %g "
              "top_k %d repetition_penalty %g (a request's own values win)",
              mc->gen_temperature, mc->gen_top_p, mc->gen_top_k, mc->gen_repetition_penalty);
    }
    if (s->cfg.override_generation_config) {
        char oerr[512];
        if (oai_defaults_override(&s->defaults, s->cfg.override_generation_config, oerr,
                                  sizeof oerr))
            LOG_W("server", "--override-generation-config: %s (ignored)", oerr); /* checked */
        else
            LOG_I("server",
                  "--override-generation-config %s: default sampling now temperature %g top_p %g "
                  "top_k %d min_p %g repetition_penalty %g max_tokens %d (-1: as many as fit; a "
                  "request's own values win)",
                  s->cfg.override_generation_config, s->defaults.temperature, s->defaults.top_p,
                  s->defaults.top_k, s->defaults.min_p, s->defaults.repetition_penalty,
                  s->defaults.max_tokens);
    }
    s->defaults.model_path = s->cfg.model;
    s->max_model_len = engine_max_model_len(e);
    s->tools = s->cfg.tool_parser ? s->cfg.tool_parser : tool_parser_default();
    s->tool_grammar = s->tools->alt_token && tokenizer_token_id(tok, s->tools->alt_token) >= 0
                          ? s->tools->alt_grammar
                          : s->tools->grammar;
    if (s->tools->special_token && tokenizer_token_id(tok, s->tools->special_token) < 0)
        LOG_W("server",
              "--tool-call-parser %s: the tokenizer has no %s token; tool calls are found only "
              "where the model writes it as text",
              s->tools->name, s->tools->special_token);
    s->gvocab = structured_vocab_new(tok, engine_vocab_size(e));
    s->gcache = s->gvocab ? structured_cache_new(s->gvocab) : NULL;
    s->tok = tok;
    s->eng = e;
    if (s->cfg.on_engine) s->cfg.on_engine(s->cfg.on_engine_arg, e);
    atomic_store(&s->ready, 1);
    event_active(s->ready_ev, EV_READ, 0);
    return NULL;
fail:
    atomic_store(&s->ready, -1);
    event_active(s->ready_ev, EV_READ, 0);
    return NULL;
}

static void on_ready(evutil_socket_t fd, short what, void *arg) {
    server *s = arg;
    if (atomic_load(&s->ready) == 1) {
        /* the engine resolved --block-size auto (128 cpu, 16 cuda) */
        s->block_size = s->cfg.engine.block_size = engine_block_size(s->eng);
        metrics_set_config(&s->metrics, &s->cfg.engine, s->max_model_len);
        LOG_I("server", "ready: model %s served as \"%s\", max_model_len %d", s->cfg.model,
              s->model_name, s->max_model_len);
        if (!s->tmpl) LOG_W("server", "chat completions are unavailable: %s", s->tmpl_error);
    } else {
        LOG_E("server", "%s", s->load_error);
        event_base_loopexit(s->base, NULL);
    }
}

static void on_wake(evutil_socket_t fd, short what, void *arg) {
    gen_drain_events(arg);
}

/* base/http_server closed a connection at a deadline. */
static void on_deadline(void *arg, hs_deadline_kind kind) {
    server *s = arg;
    s->metrics.deadline_closes[kind == HS_DEADLINE_HEADER ? METRICS_DEADLINE_HEADER
                               : kind == HS_DEADLINE_BODY ? METRICS_DEADLINE_BODY
                                                          : METRICS_DEADLINE_KEEPALIVE]++;
}

/* Protocol errors (400 malformed, 413 body over --max-body-bytes, 431): the
 * OpenAI error shape; 408 (a deadline) has no body. */
static char *protocol_error_body(int status, const char *message) {
    if (status == 408) return NULL;
    oai_error e;
    oai_error_set(&e, status, http_error_type(status), NULL, "%s", message);
    return oai_error_json(&e);
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    server *s = arg;
    LOG_I("server", "signal %d: shutting down", (int)sig);
    event_base_loopexit(s->base, NULL);
}

int server_run(const server_config *cfg) {
    server *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    s->cfg = *cfg;
    s->model_name = cfg->served_model_name ? cfg->served_model_name : cfg->model;
    s->block_size = cfg->engine.block_size; /* 0 (auto) until the engine is up: on_ready */
    oai_defaults_init(&s->defaults);
    s->defaults.served_model_name = s->model_name;
    s->defaults.model_aliases = cfg->more_model_names;
    s->defaults.n_model_aliases = cfg->n_more_model_names;
    s->defaults.model_path = cfg->model;
    s->defaults.max_logprobs = cfg->max_logprobs;
    if (cfg->root_path && *cfg->root_path)
        LOG_I("server",
              "--root-path %s: routes stay at /v1/... (a proxy in front strips the prefix, as "
              "with uvicorn)",
              cfg->root_path);
    metrics_init(&s->metrics);
    pthread_mutex_init(&s->q_lock, NULL);
    signal(SIGPIPE, SIG_IGN);
    /* a descriptor per client connection, remote KV load (ZeroMQ) and transfer peer */
    long nofile = net_raise_nofile_limit();
    if (nofile >= 0 && nofile < 4096)
        LOG_W("server",
              "the open-file limit is %ld (ulimit -n; hard limit reached): a decoder at its cap "
              "of remote KV loads needs about 4 descriptors per load; raise it",
              nofile);
    int rc = -1;
    if (evthread_use_pthreads()) {
        LOG_E("server", "libevent has no pthreads support");
        goto out;
    }
    s->base = event_base_new();
    if (!s->base) {
        LOG_E("server", "cannot create the event loop");
        goto out;
    }
    /* base/http_server's deadlines, as nginx / uvicorn name them: the first
     * head within --client-header-timeout of the accept (408 then, even with
     * no byte), a later one within it of its first byte, after
     * --timeout-keep-alive idle between requests; the body within
     * --client-body-timeout of the head's end. */
    hs_config hc;
    hs_config_default(&hc);
    hc.limits.max_head_bytes = 64 * 1024;
    hc.max_body_bytes = cfg->max_body_bytes;
    hc.header_timeout_s = cfg->header_timeout_s;
    hc.request_timeout_s = 0;
    hc.body_timeout_s = cfg->body_timeout_s;
    hc.idle_timeout_s = cfg->keepalive_timeout_s;
    hc.head_from_accept = 1;
    hc.idle_408 = 1;
    hc.write_timeout_s = 3600; /* a client not reading a reply */
    hc.on_deadline = on_deadline;
    hc.on_deadline_arg = s;
    net_addr la;
    int lfd = net_resolve(cfg->host, (uint16_t)cfg->port, &la);
    if (lfd == 0) lfd = net_listen(&la, 4096);
    if (lfd < 0) {
        LOG_E("server",
              "cannot listen on %s:%d: %s (is the port in use? choose another with --port)",
              cfg->host, cfg->port, strerror(-lfd));
        goto out;
    }
    s->http = hs_server_new_fd(s->base, lfd, &hc, http_dispatch, s, protocol_error_body);
    if (!s->http) goto out;
    s->wake = event_new(s->base, -1, 0, on_wake, s);
    s->ready_ev = event_new(s->base, -1, 0, on_ready, s);
    s->sig_int = evsignal_new(s->base, SIGINT, on_signal, s);
    s->sig_term = evsignal_new(s->base, SIGTERM, on_signal, s);
    event_add(s->sig_int, NULL);
    event_add(s->sig_term, NULL);
    LOG_I("server", "listening on http://%s:%d (loading %s)", cfg->host, cfg->port, cfg->model);
    if (prep_init(s))
        LOG_W("server", "no preparation thread: long prompts are tokenized on the loop");
    if (pthread_create(&s->loader, NULL, loader_main, s)) {
        LOG_E("server", "cannot start the loader thread");
        goto out;
    }
    event_base_dispatch(s->base);
    pthread_join(s->loader, NULL);
    rc = atomic_load(&s->ready) == 1 ? 0 : -1;
out:
    if (s->eng && s->cfg.on_engine) s->cfg.on_engine(s->cfg.on_engine_arg, NULL);
    /* the connector detaches itself from the engine, so it goes first */
    if (s->conn) mooncake_connector_destroy(s->conn);
    s->conn = NULL;
    if (s->eng) engine_set_kv_event_sink(s->eng, NULL);
    kv_events_publisher_destroy(s->kvev); /* sends what is queued */
    s->kvev = NULL;
    if (s->eng) engine_destroy(s->eng); /* no engine callback runs after this */
    s->eng = NULL;                      /* close callbacks below must not abort */
    gen_drop_events(s);                 /* events of requests that are freed next */
    gen_free_live(s);
    prep_free(s);            /* before hs_server_free: the requests it holds are answered */
    hs_server_free(s->http); /* closes every connection */
    if (s->tmpl) chat_template_free(s->tmpl);
    mistral_chat_free(s->mistral);
    structured_cache_free(s->gcache); /* after the requests: they hold grammars */
    grammar_vocab_free(s->gvocab);
    if (s->tok) tokenizer_free(s->tok);
    if (s->wake) event_free(s->wake);
    if (s->ready_ev) event_free(s->ready_ev);
    if (s->sig_int) event_free(s->sig_int);
    if (s->sig_term) event_free(s->sig_term);
    if (s->base) event_base_free(s->base);
    pthread_mutex_destroy(&s->q_lock);
    free(s);
    LOG_I("server", "stopped");
    return rc;
}
