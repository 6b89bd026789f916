/*
 * cmd_proxy — `disagg proxy`: parses the command line (the flags of vLLM's
 * disaggregated-serving example proxy plus ours) and runs src/proxy.
 */
#include "cli/commands.h"

#include "base/log.h"
#include "base/text.h"
#include "cli/discovery_cli.h"
#include "proxy/proxy.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void proxy_usage(FILE *f) {
    fprintf(
        f,
        "usage: disagg proxy --prefill URL [BOOTSTRAP] [--prefill ...] --decode URL [--decode "
        "...]\n"
        "       disagg proxy --discovery etcd://HOST:PORT[,HOST:PORT..]/PREFIX [options]\n"
        "                    [--host H] [--port N] [--policy least_loaded|round_robin|prefix|p2c]\n"
        "                    [--api-key "
        "KEY]\n\n"
        "P/D router: sends each OpenAI request to a prefill instance (max_tokens 1) and, at\n"
        "the same time, to a decode instance, and relays the decode response.\n\n"
        "  --prefill URL [BOOTSTRAP]  prefill instance http://host:port; BOOTSTRAP is its "
        "bootstrap\n"
        "                             server: a port on the same host, 'none' (the default, "
        "8998)\n"
        "                             or host:port (repeatable)\n"
        "  --decode URL [URL..]       decode instance(s) http://host:port (repeatable)\n"
        "  --flag=value               every flag also takes its value this way\n"
        "  --prefiller-hosts H.. --prefiller-ports P.. --decoder-hosts H.. --decoder-ports P..\n"
        "                             the same in the form of vLLM's toy_proxy_server.py "
        "(bootstrap\n"
        "                             port 8998 on each prefill host)\n"
        "  --host H                   listen address (default 127.0.0.1)\n"
        "  --port N                   listen port (default 8000)\n"
        "  --policy P                 least_loaded (default: the least load, outstanding or\n"
        "                             published), round_robin, or prefix (prefills: prompts\n"
        "                             sharing their first bytes go to one prefill, bounded by\n"
        "                             load; decodes least_loaded), or p2c (the less loaded of\n"
        "                             two random instances: no herding of several proxies on\n"
        "                             stale published load)\n"
        "  --prefix-bytes N           prompt bytes --policy prefix hashes (default 256)\n"
        "  --api-key KEY              clients must send 'Authorization: Bearer KEY' on /v1 paths\n"
        "                             (401 otherwise; /health and /metrics stay open) and it is\n"
        "                             sent upstream (default: no check, the client's\n"
        "                             Authorization header is passed through)\n"
        "  --max-body-bytes N         client request body limit (default 16777216)\n"
        "  --max-headers N            client request header count limit (default 100)\n"
        "  --connect-timeout S        upstream connect timeout, seconds (default 5)\n"
        "  --timeout S                longest upstream silence, seconds (default 600)\n"
        "  --health-interval S        health probe period, seconds (default 1)\n"
        "  --client-timeout S         deadline to receive a client's whole request, from its "
        "first\n"
        "                             byte; bytes do not extend it (default 60) -> 408\n"
        "  --client-header-timeout S  deadline to receive a request head, from its first byte\n"
        "                             (nginx's client_header_timeout; default 60) -> 408\n"
        "  --timeout-keep-alive S     close a client connection idle this long between requests\n"
        "                             (default 75)\n"
        "  --upstream-keepalive-timeout S  close a pooled upstream connection idle this long;\n"
        "                             below the upstreams' own (5 s for disagg serve and vLLM)\n"
        "                             (default 4)\n"
        "  --shutdown-timeout S       on SIGTERM/SIGINT, wait for requests in flight (default 30)\n"
        "  --log-level L              debug|info|warn|error (default info, or DISAGG_LOG_LEVEL)\n");
    discovery_cli_usage(f, 0);
}

static int parse_double(const char *flag, const char *v, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double d = strtod(v, &end);
    if (!*v || *end || errno || d < lo || d > hi) {
        fprintf(stderr, "disagg proxy: %s '%s' is not a number in [%g, %g]\n", flag, v, lo, hi);
        return -EINVAL;
    }
    *out = d;
    return 0;
}

static int parse_long(const char *flag, const char *v, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (!*v || *end || errno || n < lo || n > hi) {
        fprintf(stderr, "disagg proxy: %s '%s' is not an integer in [%ld, %ld]\n", flag, v, lo, hi);
        return -EINVAL;
    }
    *out = n;
    return 0;
}

/* The flags (for the "did you mean" hint and the value-taking check). */
static const char *const KNOWN[] = {"--prefill",
                                    "--decode",
                                    "--prefiller-hosts",
                                    "--prefiller-ports",
                                    "--decoder-hosts",
                                    "--decoder-ports",
                                    "--help",
                                    "--host",
                                    "--port",
                                    "--policy",
                                    "--api-key",
                                    "--max-body-bytes",
                                    "--max-headers",
                                    "--connect-timeout",
                                    "--timeout",
                                    "--health-interval",
                                    "--client-timeout",
                                    "--client-header-timeout",
                                    "--timeout-keep-alive",
                                    "--upstream-keepalive-timeout",
                                    "--shutdown-timeout",
                                    "--log-level",
                                    "--prefix-bytes",
                                    "--discovery",
                                    "--etcd-user",
                                    "--etcd-cacert",
                                    "--etcd-cert",
                                    "--etcd-key"};
#define NKNOWN       (sizeof KNOWN / sizeof KNOWN[0])
#define FIRST_VALUED 7 /* KNOWN[FIRST_VALUED..] take one value */

static int unknown_option(const char *a) {
    const char *best = NULL;
    int bd = 99, d;
    for (size_t k = 0; k < NKNOWN; k++)
        if (text_close_name(a, KNOWN[k], &d) && d < bd) bd = d, best = KNOWN[k];
    fprintf(stderr, "disagg proxy: unknown option '%s'", a);
    if (best) fprintf(stderr, "; did you mean %s?", best);
    fprintf(stderr, " (see disagg proxy --help)\n");
    return 2;
}

/* The host/port flags of vLLM's toy_proxy_server.py (0 prefiller hosts,
 * 1 prefiller ports, 2 decoder hosts, 3 decoder ports), or -1. */
static int alias_kind(const char *a) {
    static const char *const names[4][2] = {{"--prefiller-hosts", "--prefiller-host"},
                                            {"--prefiller-ports", "--prefiller-port"},
                                            {"--decoder-hosts", "--decoder-host"},
                                            {"--decoder-ports", "--decoder-port"}};
    for (int k = 0; k < 4; k++)
        if (!strcmp(a, names[k][0]) || !strcmp(a, names[k][1])) return k;
    return -1;
}

int cmd_proxy(int argc, char **argv) {
    proxy_config cfg;
    proxy_config_default(&cfg);
    proxy_upstream pre[POLICY_MAX_BACKENDS], dec[POLICY_MAX_BACKENDS];
    cfg.prefill = pre;
    cfg.decode = dec;
    const char *alias_v[4][POLICY_MAX_BACKENDS]; /* prefiller hosts, ports, decoder hosts, ports */
    int alias_n[4] = {0};
    char alias_urls[2][POLICY_MAX_BACKENDS][300];
    static discovery_cli disc;
    discovery_cli_init(&disc);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        /* --flag=value (argparse's form) as well as --flag value */
        char name[64];
        const char *eq = !strncmp(a, "--", 2) ? strchr(a, '=') : NULL;
        int inl = 0; /* the value is inline: consuming it does not advance i */
        if (eq) {
            if ((size_t)(eq - a) >= sizeof name) return unknown_option(a);
            memcpy(name, a, (size_t)(eq - a));
            name[eq - a] = 0;
            a = name;
            v = eq + 1;
            inl = 1;
        }
        long n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            proxy_usage(stdout);
            return 0;
        }
        int alias = alias_kind(a);
        if (alias >= 0) { /* vLLM toy proxy: --prefiller-hosts H... --prefiller-ports P... */
            int got = 0;
            if (inl) { /* --prefiller-hosts=H: its first value */
                alias_v[alias][alias_n[alias]++] = v;
                got++;
            }
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
                if (alias_n[alias] >= POLICY_MAX_BACKENDS) {
                    fprintf(stderr, "disagg proxy: at most %d values for %s\n", POLICY_MAX_BACKENDS,
                            a);
                    return 2;
                }
                alias_v[alias][alias_n[alias]++] = argv[++i];
                got++;
            }
            if (!got) {
                fprintf(stderr, "disagg proxy: %s needs at least one value\n", a);
                return 2;
            }
            continue;
        }
        if (!strcmp(a, "--prefill") || !strcmp(a, "--decode")) {
            /* --prefill URL [BOOTSTRAP]: BOOTSTRAP a port, "none" (the default port 8998,
             * as vLLM's MooncakeConnector proxy), host:port or http://host:port.
             * --decode URL [URL..]: one or more decode instances. */
            int is_p = a[2] == 'p';
            if (!v || (!inl && !strncmp(v, "--", 2)) || !*v) {
                fprintf(stderr, "disagg proxy: %s needs a URL (http://host:port)%s\n", a,
                        is_p ? ", then optionally a bootstrap port, 'none' or host:port" : "");
                return 2;
            }
            int *cnt = is_p ? &cfg.nprefill : &cfg.ndecode;
            if (!inl) i++;
            for (;;) {
                if (*cnt >= POLICY_MAX_BACKENDS) {
                    fprintf(stderr, "disagg proxy: at most %d %s instances\n", POLICY_MAX_BACKENDS,
                            a + 2);
                    return 2;
                }
                proxy_upstream *u = &(is_p ? pre : dec)[(*cnt)++];
                u->url = v;
                u->bootstrap = NULL;
                if (is_p && i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0)
                    u->bootstrap = argv[++i];
                if (i + 1 >= argc || !strncmp(argv[i + 1], "--", 2)) break;
                if (is_p) {
                    fprintf(stderr,
                            "disagg proxy: --prefill %s %s: unexpected '%s'; --prefill takes a URL "
                            "and an optional bootstrap port ('none' or a number, or host:port); "
                            "give each prefill instance its own --prefill\n",
                            u->url, u->bootstrap, argv[i + 1]);
                    return 2;
                }
                v = argv[++i]; /* --decode URL URL ... */
            }
            continue;
        }

        int is_known = 0;
        for (size_t k = FIRST_VALUED; k < NKNOWN; k++)
            is_known |= !strcmp(a, KNOWN[k]);
        if (!is_known) return unknown_option(a);
        if (!v) {
            fprintf(stderr, "disagg proxy: %s needs a value (see disagg proxy --help)\n", a);
            return 2;
        }
        if (!inl) i++;
        if (discovery_cli_is_flag(a, 0)) {
            if (discovery_cli_flag("proxy", &disc, a, v)) return 2;
        } else if (!strcmp(a, "--prefix-bytes")) {
            if (parse_long(a, v, 1, 1 << 20, &n)) return 2;
            cfg.prefix_bytes = (int)n;
        } else if (!strcmp(a, "--host")) {
            cfg.host = v;
        } else if (!strcmp(a, "--port")) {
            if (parse_long(a, v, 0, 65535, &n)) return 2;
            cfg.port = (uint16_t)n;
        } else if (!strcmp(a, "--policy")) {
            if (policy_parse(v, &cfg.policy)) {
                fprintf(stderr,
                        "disagg proxy: --policy '%s' is not accepted; use least_loaded, "
                        "round_robin, prefix or p2c\n",
                        v);
                return 2;
            }
        } else if (!strcmp(a, "--api-key")) {
            cfg.api_key = v;
        } else if (!strcmp(a, "--max-body-bytes")) {
            if (parse_long(a, v, 1, 1L << 32, &n)) return 2;
            cfg.max_body_bytes = (size_t)n;
        } else if (!strcmp(a, "--max-headers")) {
            if (parse_long(a, v, 1, 10000, &n)) return 2;
            cfg.max_headers = (int)n;
        } else if (!strcmp(a, "--connect-timeout")) {
            if (parse_double(a, v, 0.001, 3600, &cfg.connect_timeout_s)) return 2;
        } else if (!strcmp(a, "--timeout")) {
            if (parse_double(a, v, 0.001, 86400, &cfg.upstream_timeout_s)) return 2;
        } else if (!strcmp(a, "--health-interval")) {
            if (parse_double(a, v, 0.01, 3600, &cfg.health_interval_s)) return 2;
        } else if (!strcmp(a, "--shutdown-timeout")) {
            if (parse_double(a, v, 0, 86400, &cfg.shutdown_timeout_s)) return 2;
        } else if (!strcmp(a, "--client-timeout")) {
            if (parse_double(a, v, 0.001, 3600, &cfg.client_timeout_s)) return 2;
        } else if (!strcmp(a, "--client-header-timeout")) {
            if (parse_double(a, v, 0.001, 3600, &cfg.client_header_timeout_s)) return 2;
        } else if (!strcmp(a, "--timeout-keep-alive")) {
            if (parse_double(a, v, 0.001, 86400, &cfg.keepalive_timeout_s)) return 2;
        } else if (!strcmp(a, "--upstream-keepalive-timeout")) {
            if (parse_double(a, v, 0, 86400, &cfg.upstream_keepalive_s)) return 2;
        } else if (!strcmp(a, "--log-level")) {
            int l = log_parse_level(v);
            if (l < 0) {
                fprintf(stderr,
                        "disagg proxy: --log-level '%s' is not accepted; use debug, info, warn or "
                        "error\n",
                        v);
                return 2;
            }
            log_set_level((log_level)l);
        } else {
            return unknown_option(a);
        }
    }
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
        proxy_usage(stderr);
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
