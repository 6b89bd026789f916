/*
 * cmd_proxy — `disagg proxy`: parses the command line (the flags of vLLM's
 * disaggregated-serving example proxy plus ours) and runs src/proxy.
 */
#include "cli/commands.h"

#include "base/file.h"
#include "base/flags.h"
#include "base/log.h"
#include "cli/discovery_cli.h"
#include "model/chat_template.h"
#include "model/hf_cache.h"
#include "model/prompt_ids.h"
#include "model/tokenizer.h"
#include "proxy/proxy.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What the flags set. */
static struct proxy_args {
    proxy_config cfg;
    proxy_upstream pre[POLICY_MAX_BACKENDS], dec[POLICY_MAX_BACKENDS];
    const char *alias_v[4][POLICY_MAX_BACKENDS]; /* prefiller hosts, ports, decoder hosts, ports */
    int alias_n[4];
    discovery_cli disc;
    /* --policy kv_aware; "not given" is NULL, -1 or 0 (the defaults are kv_route's) */
    const char *tokenizer, *chat_template, *topic;
    kv_route_endpoint ep[POLICY_MAX_BACKENDS], rep[POLICY_MAX_BACKENDS];
    int nep, nrep;
    int events_port, replay_port; /* -1: not given */
    double load_weight;           /* -1: not given */
    long long max_blocks;         /* 0: not given */
    int pool_fetch;               /* --kv-pool-fetch */
} A;

/* The tokenizer --policy kv_aware hashes prompts with: the instances' own. */
static struct proxy_tok {
    tokenizer *tok;
    chat_template *ct;
} T;

static int prompt_tokens(void *arg, const json_t *body, int chat, int32_t **ids, size_t *n,
                         char *err, size_t errcap) {
    struct proxy_tok *t = arg;
    return prompt_ids_of_body(t->tok, t->ct, body, chat, ids, n, err, errcap);
}

/* --kv-events-endpoint URL=tcp://HOST:PORT (and the replay one): repeatable. */
static int kv_endpoint_flag(flags_parser *p, const flag_def *d, const char *v) {
    int replay = strstr(d->name, "replay") != NULL;
    const char *eq = v ? strchr(v, '=') : NULL;
    const char *ep = eq ? eq + 1 : NULL;
    int ok = eq && eq > v &&
             ((!strncmp(ep, "tcp://", 6) && strchr(ep + 6, ':')) ||
              (!strncmp(ep, "ipc://", 6) && ep[6]));
    if (!ok) {
        flags_error(p,
                    "%s '%s' is not accepted; give PREFILL_URL=tcp://HOST:PORT (the URL of a "
                    "--prefill, then the ZMQ endpoint of its %s; ipc://PATH also works)",
                    d->name, v ? v : "", replay ? "replay ROUTER" : "KV events publisher");
        return -1;
    }
    int *cnt = replay ? &A.nrep : &A.nep;
    if (*cnt >= POLICY_MAX_BACKENDS) {
        flags_error(p, "at most %d %s flags", POLICY_MAX_BACKENDS, d->name);
        return -1;
    }
    char *url = strndup(v, (size_t)(eq - v));
    if (!url) return -1;
    kv_route_endpoint *e = &(replay ? A.rep : A.ep)[(*cnt)++];
    e->url = url;
    e->endpoint = ep;
    return 0;
}

/* --prefill URL [BOOTSTRAP]: BOOTSTRAP a port, "none" (the default port 8998, as vLLM's
 * MooncakeConnector proxy), host:port or http://host:port.  --decode URL [URL..]: one or more
 * decode instances. */
static int upstream_flag(flags_parser *p, const flag_def *d, const char *v) {
    int is_p = d->name[2] == 'p';
    if (!v) {
        v = flags_peek(p);
        if (v && strncmp(v, "--", 2)) flags_take(p);
    }
    if (!v || (!flags_inline(p) && !strncmp(v, "--", 2)) || !*v) {
        flags_error(p, "%s needs a URL (http://host:port)%s", d->name,
                    is_p ? ", then optionally a bootstrap port, 'none' or host:port" : "");
        return -1;
    }
    int *cnt = is_p ? &A.cfg.nprefill : &A.cfg.ndecode;
    for (;;) {
        if (*cnt >= POLICY_MAX_BACKENDS) {
            flags_error(p, "at most %d %s instances", POLICY_MAX_BACKENDS, d->name + 2);
            return -1;
        }
        proxy_upstream *u = &(is_p ? A.pre : A.dec)[(*cnt)++];
        u->url = v;
        u->bootstrap = NULL;
        const char *next = flags_peek(p);
        if (is_p && next && strncmp(next, "--", 2)) u->bootstrap = flags_take(p);
        next = flags_peek(p);
        if (!next || !strncmp(next, "--", 2)) return 0;
        if (is_p) {
            flags_error(p,
                        "--prefill %s %s: unexpected '%s'; --prefill takes a URL and an optional "
                        "bootstrap port ('none' or a number, or host:port); give each prefill "
                        "instance its own --prefill",
                        u->url, u->bootstrap, next);
            return -1;
        }
        v = flags_take(p); /* --decode URL URL ... */
    }
}

/* The host/port flags of vLLM's toy_proxy_server.py: --prefiller-hosts H... --prefiller-ports
 * P... (d->dst: 0 prefiller hosts, 1 prefiller ports, 2 decoder hosts, 3 decoder ports). */
static int toy_flag(flags_parser *p, const flag_def *d, const char *v) {
    int k = (int)(d->dst ? *(const int *)d->dst : 0), got = 0;
    if (v) { /* --prefiller-hosts=H: its first value */
        A.alias_v[k][A.alias_n[k]++] = v;
        got++;
    }
    const char *w;
    while ((w = flags_peek(p)) && strncmp(w, "--", 2)) {
        if (A.alias_n[k] >= POLICY_MAX_BACKENDS) {
            flags_error(p, "at most %d values for %s", POLICY_MAX_BACKENDS, flags_spelled(p));
            return -1;
        }
        A.alias_v[k][A.alias_n[k]++] = flags_take(p);
        got++;
    }
    if (!got) {
        flags_error(p, "%s needs at least one value", flags_spelled(p));
        return -1;
    }
    return 0;
}

static int policy_flag(flags_parser *p, const flag_def *d, const char *v) {
    if (!policy_parse(v, &A.cfg.policy)) return 0;
    flags_error(p,
                "%s '%s' is not accepted; use least_loaded, round_robin, prefix, p2c or kv_aware",
                d->name, v);
    return -1;
}

static int log_level_flag(flags_parser *p, const flag_def *d, const char *v) {
    int l = log_parse_level(v);
    if (l < 0) {
        flags_error(p, "%s '%s' is not accepted; use debug, info, warn or error", d->name, v);
        return -1;
    }
    log_set_level((log_level)l);
    return 0;
}

static const int TOY[4] = {0, 1, 2, 3};

static const flag_def PROXY_FLAGS[] = {
    {FLAG_CUSTOM_("--prefill", NULL, upstream_flag), .opts = FLAG_VARARGS,
     .metavar = "URL [BOOTSTRAP]",
     .help = "prefill instance http://host:port; BOOTSTRAP is its bootstrap server: a port on the "
             "same host, 'none' (the default, 8998) or host:port (repeatable)"},
    {FLAG_CUSTOM_("--decode", NULL, upstream_flag), .opts = FLAG_VARARGS, .metavar = "URL [URL..]",
     .help = "decode instance(s) http://host:port (repeatable)"},
    {FLAG_TEXT_("--flag=value", "every flag also takes its value this way")},
    {FLAG_CUSTOM_("--prefiller-hosts", (void *)&TOY[0], toy_flag), .aliases = "--prefiller-host",
     .opts = FLAG_VARARGS,
     .synopsis = "--prefiller-hosts H.. --prefiller-ports P.. --decoder-hosts H.. --decoder-ports "
                 "P..",
     .help = "the same in the form of vLLM's toy_proxy_server.py (bootstrap port 8998 on each "
             "prefill host)"},
    {FLAG_CUSTOM_("--prefiller-ports", (void *)&TOY[1], toy_flag), .aliases = "--prefiller-port",
     .opts = FLAG_VARARGS | FLAG_HIDDEN},
    {FLAG_CUSTOM_("--decoder-hosts", (void *)&TOY[2], toy_flag), .aliases = "--decoder-host",
     .opts = FLAG_VARARGS | FLAG_HIDDEN},
    {FLAG_CUSTOM_("--decoder-ports", (void *)&TOY[3], toy_flag), .aliases = "--decoder-port",
     .opts = FLAG_VARARGS | FLAG_HIDDEN},
    {FLAG_STRING_("--host", &A.cfg.host), .metavar = "H",
     .help = "listen address (default 127.0.0.1)"},
    {FLAG_INT_("--port", &A.cfg.port, 0, 65535), .help = "listen port (default 8000)"},
    {FLAG_CUSTOM_("--policy", NULL, policy_flag), .metavar = "P",
     .help = "least_loaded (default: the least load, outstanding or published), round_robin, or "
             "prefix (prefills: prompts sharing their first bytes go to one prefill, bounded by "
             "load; decodes least_loaded), or p2c (the less loaded of two random instances: no "
             "herding of several proxies on stale published load), or kv_aware (prefills: the "
             "one whose KV cache, as its KV events tell, holds the longest prefix of the prompt, "
             "weighed against its queued tokens; needs --tokenizer)"},
    {FLAG_INT_("--prefix-bytes", &A.cfg.prefix_bytes, 1, 1 << 20),
     .help = "prompt bytes --policy prefix hashes (default 256)"},
    {FLAG_STRING_("--tokenizer", &A.tokenizer), .aliases = "--kv-tokenizer-path",
     .metavar = "DIR|ORG/NAME",
     .help = "kv_aware: the instances' tokenizer (their MODEL or --tokenizer): prompts are "
             "tokenized, and chats rendered, as they do"},
    {FLAG_STRING_("--chat-template", &A.chat_template), .metavar = "FILE|TEMPLATE",
     .help = "kv_aware: the instances' --chat-template, if they have one (default: the "
             "tokenizer's)"},
    {FLAG_CUSTOM_("--kv-events-endpoint", NULL, kv_endpoint_flag), .metavar = "URL=tcp://H:P",
     .help = "kv_aware: the KV events publisher of the --prefill at URL (repeatable; default "
             "tcp://<its host>:--kv-events-port)"},
    {FLAG_INT_("--kv-events-port", &A.events_port, 1, 65535),
     .help = "kv_aware: the publisher port of the prefills without --kv-events-endpoint "
             "(default 5557, vLLM's)"},
    {FLAG_CUSTOM_("--kv-events-replay-endpoint", NULL, kv_endpoint_flag),
     .metavar = "URL=tcp://H:P",
     .help = "kv_aware: the replay endpoint of the --prefill at URL, asked for missed events "
             "(repeatable; default --kv-events-replay-port, else none: a gap drops the index)"},
    {FLAG_INT_("--kv-events-replay-port", &A.replay_port, 1, 65535),
     .help = "kv_aware: the replay port of the prefills without --kv-events-replay-endpoint"},
    {FLAG_STRING_("--kv-events-topic-filter", &A.topic), .metavar = "T",
     .help = "kv_aware: subscribe to KV event messages whose topic starts with T (default: all)"},
    {FLAG_DOUBLE_("--kv-aware-load-weight", &A.load_weight, 0, 1e6), .metavar = "W",
     .help = "kv_aware: cost = uncached prompt tokens + W x tokens queued on the prefill "
             "(default 1; 0: the cache alone)"},
    {FLAG_INT_("--kv-index-max-blocks", &A.max_blocks, 1, 1LL << 32),
     .help = "kv_aware: blocks indexed per prefill at most (default 4194304)"},
    {FLAG_BOOL_("--kv-pool-fetch", &A.pool_fetch),
     .help = "kv_aware: when load sends a prompt to a prefill other than the one holding its "
             "longest prefix, name the holder in kv_transfer_params.pool_source, so that the "
             "prefill pulls that prefix's KV instead of computing it (the prefills must be "
             "kv_both; docs/kv_pool.md)"},
    {FLAG_STRING_("--api-key", &A.cfg.api_key), .metavar = "KEY",
     .help = "clients must send 'Authorization: Bearer KEY' on /v1 paths (401 otherwise; /health "
             "and /metrics stay open) and it is sent upstream (default: no check, the client's "
             "Authorization header is passed through)"},
    {FLAG_INT_("--max-body-bytes", &A.cfg.max_body_bytes, 1, 1LL << 32),
     .help = "client request body limit (default 16777216)"},
    {FLAG_INT_("--max-headers", &A.cfg.max_headers, 1, 10000),
     .help = "client request header count limit (default 100)"},
    {FLAG_DOUBLE_("--connect-timeout", &A.cfg.connect_timeout_s, 0.001, 3600), .unit = "seconds",
     .metavar = "S", .help = "upstream connect timeout, seconds (default 5)"},
    {FLAG_DOUBLE_("--timeout", &A.cfg.upstream_timeout_s, 0.001, 86400), .unit = "seconds",
     .metavar = "S", .help = "longest upstream silence, seconds (default 600)"},
    {FLAG_DOUBLE_("--health-interval", &A.cfg.health_interval_s, 0.01, 3600), .unit = "seconds",
     .metavar = "S", .help = "health probe period, seconds (default 1)"},
    {FLAG_DOUBLE_("--client-timeout", &A.cfg.client_timeout_s, 0.001, 3600), .unit = "seconds",
     .metavar = "S",
     .help = "deadline to receive a client's whole request, from its first byte; bytes do not "
             "extend it (default 60) -> 408"},
    {FLAG_DOUBLE_("--client-header-timeout", &A.cfg.client_header_timeout_s, 0.001, 3600),
     .unit = "seconds", .metavar = "S",
     .help = "deadline to receive a request head, from its first byte (nginx's "
             "client_header_timeout; default 60) -> 408"},
    {FLAG_DOUBLE_("--timeout-keep-alive", &A.cfg.keepalive_timeout_s, 0.001, 86400),
     .unit = "seconds", .metavar = "S",
     .help = "close a client connection idle this long between requests (default 75)"},
    {FLAG_DOUBLE_("--upstream-keepalive-timeout", &A.cfg.upstream_keepalive_s, 0, 86400),
     .unit = "seconds", .metavar = "S",
     .help = "close a pooled upstream connection idle this long; below the upstreams' own (5 s for "
             "disagg serve and vLLM) (default 4)"},
    {FLAG_DOUBLE_("--shutdown-timeout", &A.cfg.shutdown_timeout_s, 0, 86400), .unit = "seconds",
     .metavar = "S", .help = "on SIGTERM/SIGINT, wait for requests in flight (default 30)"},
    {FLAG_CUSTOM_("--log-level", NULL, log_level_flag), .metavar = "L",
     .help = "debug|info|warn|error (default info, or DISAGG_LOG_LEVEL)"},
    {0}};

static flag_def DISCOVERY_FLAGS[DISCOVERY_CLI_NFLAGS + 1];
static const flag_def *const PROXY_TABLES[] = {PROXY_FLAGS, DISCOVERY_FLAGS, NULL};

static const flags_spec PROXY_SPEC = {
    .cmd = "proxy",
    .usage = "usage: disagg proxy --prefill URL [BOOTSTRAP] [--prefill ...] --decode URL "
             "[--decode ...]\n"
             "       disagg proxy --discovery etcd://HOST:PORT[,HOST:PORT..]/PREFIX [options]\n"
             "                    [--host H] [--port N] [--policy "
             "least_loaded|round_robin|prefix|p2c|kv_aware]\n"
             "                    [--api-key KEY]\n\n"
             "P/D router: sends each OpenAI request to a prefill instance (max_tokens 1) and, at\n"
             "the same time, to a decode instance, and relays the decode response.\n\n",
    .tables = PROXY_TABLES,
    .help_col = 29,
};

/* Checks the kv_aware flags and loads the tokenizer into cfg->kv; 0, or 2 (usage error). */
static int kv_setup(proxy_config *cfg, kv_route_config *kc, int discovery) {
    const char *given = A.tokenizer          ? "--tokenizer"
                        : A.chat_template    ? "--chat-template"
                        : A.nep              ? "--kv-events-endpoint"
                        : A.nrep             ? "--kv-events-replay-endpoint"
                        : A.events_port > 0  ? "--kv-events-port"
                        : A.replay_port > 0  ? "--kv-events-replay-port"
                        : A.topic            ? "--kv-events-topic-filter"
                        : A.load_weight >= 0 ? "--kv-aware-load-weight"
                        : A.max_blocks       ? "--kv-index-max-blocks"
                        : A.pool_fetch       ? "--kv-pool-fetch"
                                             : NULL;
    if (cfg->policy != POLICY_KV_AWARE) {
        if (!given) return 0;
        fprintf(stderr, "disagg proxy: %s is only used by --policy kv_aware (the policy is %s)\n",
                given, policy_name(cfg->policy));
        return 2;
    }
    if (!A.tokenizer) {
        fprintf(stderr, "disagg proxy: --policy kv_aware needs --tokenizer DIR|ORG/NAME: the "
                        "instances' tokenizer (their MODEL), to hash prompts as their prefix "
                        "caches do\n");
        return 2;
    }
    for (int r = 0; r < 2; r++) /* each URL names a --prefill (unless they come from etcd) */
        for (int i = 0; i < (r ? A.nrep : A.nep) && !discovery; i++) {
            const kv_route_endpoint *e = &(r ? A.rep : A.ep)[i];
            char h[256], h2[256], err[300];
            uint16_t port, port2;
            int found = 0;
            if (upstream_parse_url(e->url, h, sizeof h, &port, err, sizeof err)) {
                fprintf(stderr, "disagg proxy: %s: %s\n",
                        r ? "--kv-events-replay-endpoint" : "--kv-events-endpoint", err);
                return 2;
            }
            for (int k = 0; k < cfg->nprefill && !found; k++)
                found = !upstream_parse_url(cfg->prefill[k].url, h2, sizeof h2, &port2, err,
                                            sizeof err) &&
                        port == port2 && !strcmp(h, h2);
            if (!found) {
                fprintf(stderr, "disagg proxy: %s %s=%s: %s is not one of the --prefill URLs\n",
                        r ? "--kv-events-replay-endpoint" : "--kv-events-endpoint", e->url,
                        e->endpoint, e->url);
                return 2;
            }
        }
    static char dir[4096];
    char err[1024];
    if (hf_cache_resolve(A.tokenizer, dir, sizeof dir, err, sizeof err) ||
        tokenizer_load(dir, &T.tok, err, sizeof err)) {
        fprintf(stderr, "disagg proxy: --tokenizer %s: %s\n", A.tokenizer, err);
        return 2;
    }
    char *tt = NULL;
    if (A.chat_template) { /* as disagg serve: a file's contents, else the template itself */
        tt = file_read_text(A.chat_template, 1 << 20);
        if (!tt && !strpbrk(A.chat_template, "{}\n")) {
            fprintf(stderr,
                    "disagg proxy: --chat-template '%s' looks like a file path, but it cannot be "
                    "opened (%s); accepted: a Jinja template file or the template text itself\n",
                    A.chat_template, strerror(errno));
            return 2;
        }
        if (!tt) tt = strdup(A.chat_template);
    }
    const char *text = tt ? tt : tokenizer_chat_template(T.tok);
    if (text && chat_template_init(text, &T.ct, err, sizeof err)) {
        if (tt) {
            fprintf(stderr, "disagg proxy: --chat-template: %s\n", err);
            free(tt);
            return 2;
        }
        LOG_W("proxy",
              "kv_aware: the tokenizer's chat template is not usable (%s): chat "
              "requests are routed least_loaded",
              err);
    }
    free(tt);
    kv_route_config_default(kc);
    kc->endpoints = A.ep;
    kc->nendpoints = A.nep;
    kc->replay = A.rep;
    kc->nreplay = A.nrep;
    if (A.events_port > 0) kc->events_port = A.events_port;
    if (A.replay_port > 0) kc->replay_port = A.replay_port;
    if (A.topic) kc->topic = A.topic;
    if (A.load_weight >= 0) kc->load_weight = A.load_weight;
    if (A.max_blocks) kc->max_blocks = (size_t)A.max_blocks;
    kc->pool_fetch = A.pool_fetch;
    kc->tokens = prompt_tokens;
    kc->tokens_arg = &T;
    cfg->kv = kc;
    return 0;
}

int cmd_proxy(int argc, char **argv) {
    proxy_config_default(&A.cfg);
    A.events_port = A.replay_port = -1;
    A.load_weight = -1;
    A.cfg.prefill = A.pre;
    A.cfg.decode = A.dec;
    char alias_urls[2][POLICY_MAX_BACKENDS][300];
    discovery_cli_init(&A.disc);
    discovery_cli_flags(&A.disc, 0, DISCOVERY_FLAGS);
    int pr = flags_parse(&PROXY_SPEC, argc, argv);
    if (pr) return pr == FLAGS_HELP ? 0 : 2;
    proxy_config cfg = A.cfg;
    proxy_upstream *pre = A.pre, *dec = A.dec;
    const char *(*alias_v)[POLICY_MAX_BACKENDS] = A.alias_v;
    const int *alias_n = A.alias_n;
    discovery_cli disc = A.disc;
    for (int r = 0; r < 2; r++) { /* pair the toy-proxy host and port lists */
        int nh = alias_n[2 * r], np = alias_n[2 * r + 1];
        if (!nh && !np) continue;
        const char *who = r ? "decoder" : "prefiller";
        if (nh != np && nh != 1 && np != 1) {
            fprintf(stderr, "disagg proxy: %d --%s-hosts but %d --%s-ports: give as many of each\n",
                    nh, who, np, who);
            return 2;
        }
        int n = nh > np ? nh : np;
        for (int k = 0; k < n; k++) {
            const char *h = nh ? alias_v[2 * r][nh == 1 ? 0 : k] : "localhost";
            const char *pt = np ? alias_v[2 * r + 1][np == 1 ? 0 : k] : (r ? "8200" : "8100");
            int *cnt = r ? &cfg.ndecode : &cfg.nprefill;
            if (*cnt >= POLICY_MAX_BACKENDS) {
                fprintf(stderr, "disagg proxy: at most %d %s instances\n", POLICY_MAX_BACKENDS,
                        who);
                return 2;
            }
            snprintf(alias_urls[r][k], sizeof alias_urls[r][k], "http://%s:%s", h, pt);
            proxy_upstream *u = &(r ? dec : pre)[(*cnt)++];
            u->url = alias_urls[r][k];
            u->bootstrap = NULL;
        }
    }
    if (discovery_cli_finish("proxy", &disc)) return 2;
    if (disc.set) cfg.discovery = &disc.o;
    if (!disc.set && (cfg.nprefill == 0 || cfg.ndecode == 0)) {
        fprintf(stderr, "disagg proxy: at least one --prefill and one --decode are needed (or "
                        "--discovery etcd://HOST:PORT/PREFIX)\n");
        flags_help(&PROXY_SPEC, stderr);
        return 2;
    }
    /* Validate URLs here so that a bad one is a usage error (2), not a runtime one. */
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < (r ? cfg.ndecode : cfg.nprefill); i++) {
            char host[256], err[300];
            uint16_t port;
            const proxy_upstream *u = r ? &dec[i] : &pre[i];
            char bhost[256];
            uint16_t bport;
            if (upstream_parse_url(u->url, host, sizeof host, &port, err, sizeof err) ||
                (!r && upstream_parse_bootstrap(u->url, host, u->bootstrap, bhost, sizeof bhost,
                                                &bport, err, sizeof err))) {
                fprintf(stderr, "disagg proxy: --%s %s\n", r ? "decode" : "prefill", err);
                return 2;
            }
        }
    kv_route_config kc;
    int krc = kv_setup(&cfg, &kc, disc.set);
    if (krc) return krc;
    int rc = proxy_run(&cfg);
    chat_template_free(T.ct);
    tokenizer_free(T.tok);
    return rc;
}
