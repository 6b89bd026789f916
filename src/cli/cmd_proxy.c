/*
 * cmd_proxy — `disagg proxy`: parses the command line (the flags of vLLM's
 * disaggregated-serving example proxy plus ours) and runs src/proxy.
 */
#include "cli/commands.h"

#include "base/flags.h"
#include "base/log.h"
#include "cli/discovery_cli.h"
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
} A;

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
    flags_error(p, "%s '%s' is not accepted; use least_loaded, round_robin, prefix or p2c", d->name,
                v);
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
             "herding of several proxies on stale published load)"},
    {FLAG_INT_("--prefix-bytes", &A.cfg.prefix_bytes, 1, 1 << 20),
     .help = "prompt bytes --policy prefix hashes (default 256)"},
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
             "least_loaded|round_robin|prefix|p2c]\n"
             "                    [--api-key KEY]\n\n"
             "P/D router: sends each OpenAI request to a prefill instance (max_tokens 1) and, at\n"
             "the same time, to a decode instance, and relays the decode response.\n\n",
    .tables = PROXY_TABLES,
    .help_col = 29,
};

int cmd_proxy(int argc, char **argv) {
    proxy_config_default(&A.cfg);
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
    return proxy_run(&cfg);
}
