/*
 * cmd_bootstrap — `disagg bootstrap`: run the Mooncake bootstrap server alone
 * (for kv_connector_extra_config.bootstrap_server_address), or talk to one:
 *
 *   disagg bootstrap [--host H] [--port N] [--auth-secret S]   serve until SIGINT/SIGTERM
 *   disagg bootstrap register --server H:P --engine-id E --addr tcp://ip:port
 *                    [--dp-rank N] [--tp-rank N] [--pp-rank N] [--auth-secret S]
 *   disagg bootstrap query --server H:P           print the table (GET /query)
 *
 * The client commands use the connector's retry policy (3 attempts, per-attempt
 * timeout VLLM_MOONCAKE_CONNECTOR_TIMEOUT, backoff 1 s, 2 s).  The shared
 * secret (--auth-secret, else $DISAGG_KV_SECRET) makes the server require an
 * authenticated /register and the register command sign its request
 * (docs/security.md).
 */
#include "cli/commands.h"
#include "cli/discovery_cli.h"

#include "base/auth.h"
#include "base/flags.h"
#include "base/net.h"
#include "base/stop_signal.h"
#include "connector/kv_transfer_config.h"
#include "connector/mooncake/bootstrap_client.h"
#include "connector/mooncake/bootstrap_server.h"

#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BOOTSTRAP_USAGE                                                                            \
    "usage: disagg bootstrap [--host H] [--port N] [--auth-secret S]\n"                            \
    "                        [--client-header-timeout S]\n"                                        \
    "       disagg bootstrap register --server HOST:PORT --engine-id ID --addr tcp://IP:PORT\n"    \
    "                        [--dp-rank N] [--tp-rank N] [--pp-rank N] [--auth-secret S]\n"        \
    "       disagg bootstrap query --server HOST:PORT\n\n"                                         \
    "Runs the Mooncake bootstrap server (POST /register, GET /query) alone, or\n"                  \
    "registers with / queries one.  --port defaults to VLLM_MOONCAKE_BOOTSTRAP_PORT\n"             \
    "(8998); --host to 0.0.0.0 (give the one address the prefill and decode\n"                     \
    "instances and the proxy reach); 0 picks a free port.  Client commands retry 3\n"              \
    "times (per-attempt timeout VLLM_MOONCAKE_CONNECTOR_TIMEOUT, default 30 s).\n"                 \
    "--auth-secret (else $DISAGG_KV_SECRET, which keeps it out of the process list)\n"             \
    "is the shared secret: the server then refuses a /register without a valid\n"                  \
    "X-Disagg-Auth MAC (401/403), and `register` signs its request\n"                              \
    "(docs/security.md).  /query needs no secret.  --client-header-timeout: a\n"                   \
    "request head must be complete S seconds after connecting (or after the previous\n"            \
    "response); bytes do not extend it (default 10) -> 408, close.\n"                              \
    "With --discovery the server registers itself in etcd (role bootstrap) under a\n"              \
    "lease, so that proxies list it (docs/scaling.md).\n\n"                                        \
    "options:\n"

/* --auth-secret's value (else $DISAGG_KV_SECRET, resolve_secret); "" is refused. */
static int secret_flag(flags_parser *p, const flag_def *d, const char *v) {
    if (!v[0] || strlen(v) > 255) {
        flags_error(p,
                    "%s is not accepted: %s; accepted: a non-empty secret of at most 255 bytes (or "
                    "set %s instead)",
                    d->name, !v[0] ? "empty" : "longer than 255 bytes", AUTH_SECRET_ENV);
        return -1;
    }
    return 0;
}

static int resolve_secret(const char *cmd, const char *flag, const char **out) {
    const char *s = auth_secret_resolve(flag);
    if (s && strlen(s) > 255) {
        fprintf(stderr,
                "disagg %s: %s is not accepted: longer than 255 bytes; accepted: a non-empty "
                "secret of at most 255 bytes\n",
                cmd, AUTH_SECRET_ENV);
        return -1;
    }
    *out = s;
    return 0;
}

static int serve(int argc, char **argv) {
    const char *host = "0.0.0.0", *secret = NULL;
    char err[512];
    kv_transfer_env env;
    if (kv_transfer_env_load(&env, err, sizeof err) != 0) {
        fprintf(stderr, "disagg bootstrap: %s\n", err);
        return 2;
    }
    long port = env.bootstrap_port;
    double header_timeout_s = BOOTSTRAP_HEADER_TIMEOUT_S;
    static discovery_cli disc;
    discovery_cli_init(&disc);
    flag_def dflags[DISCOVERY_CLI_NFLAGS + 1];
    discovery_cli_flags(&disc, 1, dflags);
    const flag_def defs[] = {
        {FLAG_STRING_("--host", &host), .metavar = "H", .help = "listen address (default 0.0.0.0)"},
        {FLAG_INT_("--port", &port, 0, 65535),
         .help = "listen port (default VLLM_MOONCAKE_BOOTSTRAP_PORT, else 8998; 0: a free one)"},
        {FLAG_STRING_("--auth-secret", &secret), .fn = secret_flag, .metavar = "S",
         .help = "shared secret /register requires (default $DISAGG_KV_SECRET)"},
        {FLAG_DOUBLE_("--client-header-timeout", &header_timeout_s, 0, 86400), .opts = FLAG_OPEN_LO,
         .unit = "seconds", .metavar = "S",
         .help = "a request head must be complete S seconds after connecting (default 10)"},
        {0}};
    const flag_def *tables[] = {defs, dflags, NULL};
    const flags_spec spec = {
        .cmd = "bootstrap", .usage = BOOTSTRAP_USAGE, .tables = tables, .help_col = 29};
    int pr = flags_parse(&spec, argc, argv);
    if (pr) return pr == FLAGS_HELP ? 0 : 2;
    signal(SIGPIPE, SIG_IGN); /* a client closing early must not kill the server */
    /* A process-wide handler, not a signal mask: OpenBLAS starts a thread
     * before main() that would otherwise take SIGTERM's default action
     * (base/stop_signal.h). */
    int sfd = stop_signal_fd();
    if (sfd < 0) {
        fprintf(stderr, "disagg bootstrap: cannot install signal handlers: %s\n", strerror(-sfd));
        return 1;
    }
    if (resolve_secret("bootstrap", secret, &secret)) return 2;
    if (discovery_cli_finish("bootstrap", &disc)) return 2;
    if (disc.set && port == 0) {
        fprintf(stderr, "disagg bootstrap: --discovery needs a fixed --port (not 0)\n");
        return 2;
    }
    bootstrap_server *s = NULL;
    if (bootstrap_server_start_opts(host, (uint16_t)port, secret, header_timeout_s, &s, err,
                                    sizeof err) != 0) {
        fprintf(stderr, "disagg bootstrap: %s\n", err);
        return 1;
    }
    if (!secret && !net_host_is_loopback(host))
        fprintf(stderr,
                "disagg bootstrap: SECURITY WARNING: no shared secret (--auth-secret / "
                "DISAGG_KV_SECRET) and the server listens beyond loopback (%s): anyone who can "
                "reach it can register fake prefill ranks. Set the same DISAGG_KV_SECRET here and "
                "on every prefill and decode instance, or keep the port on a private network "
                "behind a firewall (docs/security.md)\n",
                host);
    printf("bootstrap server listening on http://%s:%u%s\n", host,
           (unsigned)bootstrap_server_port(s),
           secret ? " (/register requires the shared secret)" : "");
    fflush(stdout);
    discovery_registrar *reg = NULL;
    if (disc.set &&
        bootstrap_registration_start(&disc, host, (unsigned)bootstrap_server_port(s), &reg)) {
        bootstrap_server_stop(s);
        return 1;
    }
    struct pollfd pfd = {.fd = sfd, .events = POLLIN};
    while (poll(&pfd, 1, -1) < 0 && errno == EINTR) {
    }
    int sig = stop_signal_received();
    discovery_registrar_stop(reg);
    bootstrap_server_stop(s);
    fprintf(stderr, "disagg bootstrap: stopped (%s)\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    return 0;
}

static int client_retry(bootstrap_retry *r) {
    char err[512];
    kv_transfer_env env;
    if (kv_transfer_env_load(&env, err, sizeof err) != 0) {
        fprintf(stderr, "disagg bootstrap: %s\n", err);
        return -1;
    }
    bootstrap_retry_init(r, env.connector_timeout_s);
    return 0;
}

static int do_register(int argc, char **argv) {
    const char *server = NULL, *engine_id = NULL, *addr = NULL, *secret = NULL;
    long dp = 0, tp = 0, pp = 0;
    const flag_def defs[] = {
        {FLAG_STRING_("--server", &server), .metavar = "HOST:PORT",
         .help = "the bootstrap server (required)"},
        {FLAG_STRING_("--engine-id", &engine_id), .metavar = "ID",
         .help = "the prefill engine's id (required)"},
        {FLAG_STRING_("--addr", &addr), .metavar = "tcp://IP:PORT",
         .help = "its side-channel address (required)"},
        {FLAG_INT_("--dp-rank", &dp, 0, 1000000), .help = "data-parallel rank (default 0)"},
        {FLAG_INT_("--tp-rank", &tp, 0, 1000000), .help = "tensor-parallel rank (default 0)"},
        {FLAG_INT_("--pp-rank", &pp, 0, 1000000), .help = "pipeline-parallel rank (default 0)"},
        {FLAG_STRING_("--auth-secret", &secret), .fn = secret_flag, .metavar = "S",
         .help = "sign the request with this shared secret (default $DISAGG_KV_SECRET)"},
        {0}};
    const flag_def *tables[] = {defs, NULL};
    const flags_spec spec = {
        .cmd = "bootstrap register",
        .usage = "usage: disagg bootstrap register --server HOST:PORT --engine-id ID --addr "
                 "tcp://IP:PORT [options]\n\noptions:\n",
        .tables = tables,
        .help_col = 29};
    int pr = flags_parse(&spec, argc, argv);
    if (pr) return pr == FLAGS_HELP ? 0 : 2;
    if (!server || !engine_id || !addr) {
        fprintf(stderr,
                "disagg bootstrap register: --server, --engine-id and --addr are required\n");
        return 2;
    }
    if (resolve_secret("bootstrap register", secret, &secret)) return 2;
    bootstrap_retry r;
    if (client_retry(&r)) return 2;
    bootstrap_registration reg = {engine_id, (int)dp, (int)tp, (int)pp, addr};
    char err[1024];
    if (bootstrap_client_register_auth(server, &reg, secret, &r, err, sizeof err) != 0) {
        fprintf(stderr, "disagg bootstrap register: %s\n", err);
        return 1;
    }
    printf("registered\n");
    return 0;
}

static int do_query(int argc, char **argv) {
    const char *server = NULL;
    const flag_def defs[] = {{FLAG_STRING_("--server", &server), .metavar = "HOST:PORT",
                              .help = "the bootstrap server (required)"},
                             {0}};
    const flag_def *tables[] = {defs, NULL};
    const flags_spec spec = {.cmd = "bootstrap query",
                             .usage = "usage: disagg bootstrap query --server HOST:PORT\n\n"
                                      "Prints the bootstrap server's table (GET /query), one "
                                      "line a worker.\n\noptions:\n",
                             .tables = tables,
                             .help_col = 29};
    int pr = flags_parse(&spec, argc, argv);
    if (pr) return pr == FLAGS_HELP ? 0 : 2;
    if (!server) {
        fprintf(stderr, "disagg bootstrap query: --server is required\n");
        return 2;
    }
    bootstrap_retry r;
    if (client_retry(&r)) return 2;
    bootstrap_table t;
    char err[1024];
    if (bootstrap_client_query(server, &r, &t, err, sizeof err) != 0) {
        fprintf(stderr, "disagg bootstrap query: %s\n", err);
        return 1;
    }
    /* one line per worker: dp engine_id tp pp addr */
    for (size_t i = 0; i < t.n; i++) {
        const bootstrap_engine *e = &t.engines[i];
        for (int tp = 0; tp < e->tp_size; tp++)
            for (int pp = 0; pp < e->pp_size; pp++) {
                const char *a = bootstrap_engine_addr(e, tp, pp);
                if (a)
                    printf("dp=%d engine_id=%s tp=%d pp=%d addr=%s\n", e->dp_rank, e->engine_id, tp,
                           pp, a);
            }
    }
    bootstrap_table_free(&t);
    return 0;
}

int cmd_bootstrap(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "register")) return do_register(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "query")) return do_query(argc - 1, argv + 1);
    return serve(argc, argv);
}
