/* discovery_cli — see discovery_cli.h. */
#include "cli/discovery_cli.h"

#include "base/clock.h"
#include "base/log.h"
#include "connector/kv_transfer_config.h"
#include "engine/engine.h"
#include "model/hf_cache.h"
#include "model/model_config.h"

#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void discovery_cli_init(discovery_cli *d) {
    memset(d, 0, sizeof *d);
    discovery_opts_default(&d->o);
}

static int on_flag(flags_parser *p, const flag_def *def, const char *val) {
    return discovery_cli_flag(flags_cmd(p), def->dst, def->name, val) ? -1 : 0;
}

void discovery_cli_flags(discovery_cli *d, int with_advertise,
                         flag_def out[DISCOVERY_CLI_NFLAGS + 1]) {
    const flag_def all[] = {
        {FLAG_CUSTOM_("--discovery", d, on_flag), .metavar = "etcd://H:P[,H:P..][/PREFIX]",
         .help = "discover instances through etcd (etcds:// for TLS; PREFIX default /disagg; "
                 "docs/scaling.md)"},
        {FLAG_CUSTOM_("--discovery-ttl", d, on_flag), .metavar = "S",
         .help = "lease TTL of the registration, seconds (default 5): a killed instance "
                 "disappears after it"},
        {FLAG_CUSTOM_("--discovery-advertise", d, on_flag), .metavar = "H",
         .help = "the host others reach this instance at (default VLLM_HOST_IP, else --host "
                 "unless a wildcard, else the host name)"},
        {FLAG_CUSTOM_("--etcd-user", d, on_flag), .metavar = "U",
         .help = "etcd user (password from $DISAGG_ETCD_PASSWORD)"},
        {FLAG_CUSTOM_("--etcd-cacert", d, on_flag), .metavar = "F",
         .help = "CA bundle for etcds:// (default: the system's)"},
        {FLAG_CUSTOM_("--etcd-cert", d, on_flag), .metavar = "F",
         .help = "TLS client certificate for etcds:// (with --etcd-key)"},
        {FLAG_CUSTOM_("--etcd-key", d, on_flag), .metavar = "F", .help = "its private key"},
    };
    int n = 0;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (with_advertise || (strcmp(all[i].name, "--discovery-ttl") &&
                               strcmp(all[i].name, "--discovery-advertise")))
            out[n++] = all[i];
    memset(&out[n], 0, sizeof out[n]);
}

int discovery_cli_flag(const char *cmd, discovery_cli *d, const char *flag, const char *val) {
    char err[1400];
    if (!strcmp(flag, "--discovery")) {
        if (discovery_parse_url(val, &d->o, err, sizeof err)) {
            fprintf(stderr, "disagg %s: --discovery %s\n", cmd, err);
            return -1;
        }
        d->set = 1;
    } else if (!strcmp(flag, "--discovery-ttl")) {
        if (discovery_parse_ttl(val, &d->o.ttl_s, err, sizeof err)) {
            fprintf(stderr, "disagg %s: --discovery-ttl %s\n", cmd, err);
            return -1;
        }
    } else if (!strcmp(flag, "--discovery-advertise")) {
        if (!*val || strpbrk(val, "/: ") || strlen(val) > 200) {
            if (!(val[0] == '[' && strchr(val, ']'))) {
                fprintf(stderr,
                        "disagg %s: --discovery-advertise '%s' is not accepted; accepted: a host "
                        "name or IP address (no port, [v6] for IPv6)\n",
                        cmd, val);
                return -1;
            }
        }
        d->advertise = val;
    } else {
        const char **slot = !strcmp(flag, "--etcd-user")     ? &d->o.user
                            : !strcmp(flag, "--etcd-cacert") ? &d->o.ca_file
                            : !strcmp(flag, "--etcd-cert")   ? &d->o.cert_file
                                                             : &d->o.key_file;
        if (!*val) {
            fprintf(stderr, "disagg %s: %s needs a non-empty value\n", cmd, flag);
            return -1;
        }
        if (slot != &d->o.user && access(val, R_OK) != 0) {
            fprintf(stderr, "disagg %s: %s '%s' cannot be read: %s\n", cmd, flag, val,
                    strerror(errno));
            return -1;
        }
        *slot = val;
    }
    return 0;
}

int discovery_cli_finish(const char *cmd, discovery_cli *d) {
    const char *pw = getenv(DISCOVERY_PASSWORD_ENV);
    if (!d->set) {
        if (d->o.user || d->o.ca_file || d->o.cert_file || d->o.key_file || d->advertise) {
            fprintf(stderr,
                    "disagg %s: --etcd-* and --discovery-advertise need --discovery "
                    "etcd://HOST:PORT/PREFIX\n",
                    cmd);
            return -1;
        }
        return 0;
    }
    if (d->o.user) d->o.password = pw ? pw : "";
    if (!d->o.tls && (d->o.ca_file || d->o.cert_file || d->o.key_file)) {
        fprintf(stderr,
                "disagg %s: --etcd-cacert/--etcd-cert/--etcd-key are for TLS: write the URL as "
                "etcds://...\n",
                cmd);
        return -1;
    }
    if (!d->o.cert_file != !d->o.key_file) {
        fprintf(stderr, "disagg %s: --etcd-cert and --etcd-key go together\n", cmd);
        return -1;
    }
    return 0;
}

static int wildcard(const char *h) {
    return !h || !*h || !strcmp(h, "0.0.0.0") || !strcmp(h, "::") || !strcmp(h, "[::]");
}

void discovery_cli_advertise(const discovery_cli *d, const char *listen_host, char *out,
                             size_t cap) {
    const char *ip = getenv("VLLM_HOST_IP");
    if (d->advertise)
        snprintf(out, cap, "%s", d->advertise);
    else if (ip && *ip)
        snprintf(out, cap, "%s", ip);
    else if (!wildcard(listen_host))
        snprintf(out, cap, "%s", listen_host);
    else if (gethostname(out, cap) != 0)
        snprintf(out, cap, "127.0.0.1");
}

static void url_of(char *out, size_t cap, const char *host, unsigned port) {
    int v6 = strchr(host, ':') && host[0] != '[';
    snprintf(out, cap, "http://%s%s%s:%u", v6 ? "[" : "", host, v6 ? "]" : "", port);
}

/* ---- serve: the record and its refresh ------------------------------------------------ */

typedef struct role_ctx {
    serve_registration *g; /* owner (the engine's load) */
    CURL *curl;            /* its registrar thread's own handle */
    char health_url[400];  /* http://127.0.0.1:PORT/health */
    char query_url[400];   /* prefill: bootstrap /query */
    int ready_once;        /* /health answered 200 at least once */
} role_ctx;

struct serve_registration {
    discovery_registrar *reg[2]; /* prefill and/or decode (kv_both registers both) */
    role_ctx ctx[2];             /* their contexts */
    role_ctx dctx;               /* the drainer's (own curl handle) */
    pthread_t drainer;           /* waits for SIGTERM/SIGINT (see drain_main) */
    int has_drainer;             /* it runs */
    atomic_int done;             /* server_run returned: the drainer ends */
    pthread_mutex_t eng_mu;      /* guards eng: the server clears it before destroying it */
    engine *eng;                 /* the server's engine while it runs, else NULL */
};

void serve_registration_set_engine(void *arg, engine *e) {
    serve_registration *g = arg;
    pthread_mutex_lock(&g->eng_mu);
    g->eng = e;
    pthread_mutex_unlock(&g->eng_mu);
}

/* The engine's counters: 0, or -EAGAIN while there is no engine (loading, or stopping). */
static int engine_load(serve_registration *g, engine_stats *st) {
    pthread_mutex_lock(&g->eng_mu);
    int rc = g->eng ? 0 : -EAGAIN;
    if (g->eng) engine_get_stats(g->eng, st);
    pthread_mutex_unlock(&g->eng_mu);
    return rc;
}

static size_t grow(char *p, size_t sz, size_t nm, void *arg) {
    struct {
        char *buf;
        size_t len;
    } *b = arg;
    size_t n = sz * nm;
    if (b->len + n > (4u << 20)) return 0;
    char *q = realloc(b->buf, b->len + n + 1);
    if (!q) return 0;
    memcpy(q + b->len, p, n);
    b->buf = q;
    b->len += n;
    b->buf[b->len] = 0;
    return n;
}

/* GET url: 0 with the body (malloc'ed) when it answered 200. */
static int get(role_ctx *s, const char *url, char **body) {
    struct {
        char *buf;
        size_t len;
    } b = {NULL, 0};
    CURL *h = s->curl;
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 2000L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, grow);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
    long status = 0;
    CURLcode rc = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    if (rc != CURLE_OK || status != 200) {
        free(b.buf);
        return -EIO;
    }
    *body = b.buf ? b.buf : strdup("");
    return *body ? 0 : -ENOMEM;
}

/* The record's load from the engine's counters (no request to the server: the registrar
 * refreshes every DISCOVERY_UPDATE_DEFAULT seconds).  The record is first published once
 * /health answers 200 (the advertised port serves); after that the engine's presence says
 * the server runs. */
static int serve_refresh(void *arg, discovery_record *r) {
    role_ctx *s = arg;
    char *body = NULL;
    if (!s->ready_once) {
        if (get(s, s->health_url, &body)) return 1; /* loading */
        free(body);
    }
    engine_stats st;
    if (engine_load(s->g, &st)) return 1; /* not loaded yet, or stopping */
    r->running = st.num_running;
    r->waiting = st.num_waiting + st.num_parked; /* parked: waiting for their KV */
    r->kv_usage = engine_stats_kv_usage(&st);
    if (s->query_url[0] && !get(s, s->query_url, &body)) { /* the engine id(s) by dp rank */
        json_t *j = json_loads(body, 0, NULL);
        free(body);
        const char *k;
        json_t *v;
        size_t len = 0;
        r->engine_id[0] = 0;
        json_object_foreach(j, k, v) {
            const char *e = json_string_value(json_object_get(v, "engine_id"));
            if (e && len < sizeof r->engine_id)
                len += (size_t)snprintf(r->engine_id + len, sizeof r->engine_id - len, "%s%s",
                                        len ? "," : "", e);
        }
        json_decref(j);
        if (!r->engine_id[0]) return 1; /* its engine has not registered yet */
    }
    s->ready_once = 1;
    return 0;
}

/* The KV layout fingerprint: what a decode's KV cache must share with the prefill's. */
static void kv_layout(const serve_identity *id, char *out, size_t cap) {
    char dir[PATH_MAX], err[512];
    model_config mc;
    const char *d = id->model_dir;
    char blk[16] = "auto"; /* as the dtype: "auto" is the device's (128 cpu, 16 cuda) */
    if (id->block_size > 0) snprintf(blk, sizeof blk, "%d", id->block_size);
    if (hf_cache_resolve(id->model_dir, dir, sizeof dir, err, sizeof err) == 0) d = dir;
    char win[32] = ""; /* a sliding window makes the KV of later layers differ */
    if (model_config_load(&mc, d, err, sizeof err) == 0) {
        if (mc.sliding_window) snprintf(win, sizeof win, ":window=%d", mc.sliding_window);
        snprintf(out, cap, "%s:layers=%d:kv_heads=%d:head_dim=%d%s:dtype=%s:block=%s", mc.arch,
                 mc.n_layers, mc.n_kv_heads, mc.head_dim, win, id->kv_dtype ? id->kv_dtype : "auto",
                 blk);
    } else
        snprintf(out, cap, "model=%s:dtype=%s:block=%s", id->model_name,
                 id->kv_dtype ? id->kv_dtype : "auto", blk);
}

#define DRAIN_GRACE_NS   500000000ull /* proxies see the deletion well within this */
#define DRAIN_TIMEOUT_NS 30000000000ull

/* The stop signals while the drainer holds them: the handler only writes the
 * signal number to a pipe (async-signal-safe); the drainer reads it. */
static int sig_pipe[2] = {-1, -1};
static struct sigaction saved_int, saved_term; /* the server's (libevent's) handlers */

static void on_stop_signal(int sig) {
    unsigned char c = (unsigned char)sig;
    int e = errno;
    ssize_t n = write(sig_pipe[1], &c, 1);
    (void)n;
    errno = e;
}

/* A stop signal within timeout_ms (0 when none, or when done is set). */
static int stop_signal_wait(atomic_int *done, int timeout_ms) {
    for (int waited = 0; !atomic_load(done) && waited < timeout_ms; waited += 50) {
        struct pollfd pfd = {sig_pipe[0], POLLIN, 0};
        if (poll(&pfd, 1, 50) == 1) {
            unsigned char c;
            if (read(sig_pipe[0], &c, 1) == 1) return c;
        }
    }
    return 0;
}

/* Requests running, waiting or parked (waiting for their KV) on this instance, -1 if unknown. */
static int local_load(serve_registration *g) {
    engine_stats st;
    if (engine_load(g, &st)) return -1;
    return st.num_running + st.num_waiting + st.num_parked;
}

/* A clean stop of a registered instance.  Once the server answers /health
 * (its own SIGTERM/SIGINT handlers are installed by then), the drainer puts
 * its handler in their place; a stop signal then first deletes the etcd key,
 * so that the proxies stop sending, then waits until no request is running,
 * waiting or parked (at least DRAIN_GRACE_NS, at most DRAIN_TIMEOUT_NS; a
 * second signal cuts it short), and only then hands the signal to the
 * server's handler. */
static void *drain_main(void *arg) {
    serve_registration *g = arg;
    role_ctx *c = &g->dctx;
    while (!atomic_load(&g->done)) { /* the server's handlers are in place once it answers */
        char *body;
        if (!get(c, c->health_url, &body)) {
            free(body);
            break;
        }
        struct timespec ts = {0, 100 * 1000000L};
        nanosleep(&ts, NULL);
    }
    if (atomic_load(&g->done)) return NULL;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &saved_int);
    sigaction(SIGTERM, &sa, &saved_term);
    int sig = 0;
    while (!sig && !atomic_load(&g->done))
        sig = stop_signal_wait(&g->done, 1000);
    if (!sig) return NULL;
    LOG_I("discovery",
          "signal %d: deregistering, then finishing the requests in flight (again to "
          "stop at once)",
          sig);
    for (int k = 0; k < 2; k++) {
        discovery_registrar_stop(g->reg[k]);
        g->reg[k] = NULL;
    }
    uint64_t t0 = clock_now_ns();
    int again = 0, idle = 0;
    while (clock_now_ns() - t0 < DRAIN_TIMEOUT_NS) {
        if ((again = stop_signal_wait(&g->done, 100))) break;
        if (clock_now_ns() - t0 < DRAIN_GRACE_NS) continue;
        idle = local_load(g) <= 0 ? idle + 1 : 0;
        if (idle >= 2) break;
    }
    sigaction(SIGINT, &saved_int, NULL);
    sigaction(SIGTERM, &saved_term, NULL);
    if (!atomic_load(&g->done)) kill(getpid(), again ? again : sig); /* the server stops now */
    return NULL;
}

int serve_registration_start(discovery_cli *d, const serve_identity *id, serve_registration **out) {
    *out = NULL;
    if (!id->kv_transfer_config) {
        fprintf(stderr, "disagg serve: --discovery needs --kv-transfer-config: its kv_role says "
                        "whether this is a prefill (kv_producer) or a decode (kv_consumer) "
                        "instance\n");
        return 2;
    }
    if (id->port <= 0) {
        fprintf(stderr, "disagg serve: --discovery needs a fixed --port (not 0): the port is "
                        "published in etcd before the server opens it\n");
        return 2;
    }
    kv_transfer_config kc;
    kv_transfer_env env;
    char err[1400];
    if (kv_transfer_config_parse(id->kv_transfer_config, &kc, err, sizeof err) ||
        kv_transfer_env_load(&env, err, sizeof err)) {
        fprintf(stderr, "disagg serve: %s\n", err);
        return 2;
    }
    serve_registration *g = calloc(1, sizeof *g);
    if (!g) {
        fprintf(stderr, "disagg serve: out of memory\n");
        return -1;
    }
    pthread_mutex_init(&g->eng_mu, NULL);
    role_ctx *s = &g->ctx[0];
    s->g = g;
    char host[256];
    discovery_cli_advertise(d, id->listen_host, host, sizeof host);
    const char *local = wildcard(id->listen_host) ? "127.0.0.1" : id->listen_host;
    char base[300];
    url_of(base, sizeof base, local, (unsigned)id->port);
    snprintf(s->health_url, sizeof s->health_url, "%s/health", base);

    discovery_record r;
    memset(&r, 0, sizeof r);
    url_of(r.url, sizeof r.url, host, (unsigned)id->port);
    snprintf(r.model, sizeof r.model, "%s", id->model_name);
    kv_layout(id, r.kv_layout, sizeof r.kv_layout);
    r.pid = (long)getpid();
    gethostname(r.hostname, sizeof r.hostname);
    if (kc.bootstrap_host[0]) /* a standalone bootstrap server */
        url_of(r.bootstrap, sizeof r.bootstrap, kc.bootstrap_host, kc.bootstrap_port);
    else
        url_of(r.bootstrap, sizeof r.bootstrap, host, env.bootstrap_port);
    int roles[2], nroles = 0;
    if (kc.role != KV_ROLE_CONSUMER) roles[nroles++] = 0;
    if (kc.role != KV_ROLE_PRODUCER) roles[nroles++] = 1;
    for (int k = 0; k < nroles; k++) {
        g->ctx[k] = *s;
        g->ctx[k].curl = curl_easy_init();
        if (!g->ctx[k].curl) {
            fprintf(stderr, "disagg serve: out of memory\n");
            serve_registration_stop(g);
            return -1;
        }
        discovery_record rr = r;
        snprintf(rr.role, sizeof rr.role, "%s", roles[k] ? "decode" : "prefill");
        if (roles[k]) {
            rr.bootstrap[0] = 0;
            if (!kc.engine_id_generated)
                snprintf(rr.engine_id, sizeof rr.engine_id, "%s", kc.engine_id);
        } else {
            char qb[300];
            if (kc.bootstrap_host[0])
                url_of(qb, sizeof qb, kc.bootstrap_host, kc.bootstrap_port);
            else
                url_of(qb, sizeof qb, local, env.bootstrap_port);
            snprintf(g->ctx[k].query_url, sizeof g->ctx[k].query_url, "%s/query", qb);
        }
        if (discovery_registrar_start(&d->o, &rr, serve_refresh, &g->ctx[k], &g->reg[k], err,
                                      sizeof err)) {
            fprintf(stderr, "disagg serve: --discovery %s: %s\n", d->o.url, err);
            serve_registration_stop(g);
            return -1;
        }
    }
    if (sig_pipe[0] < 0 && pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK) != 0) sig_pipe[0] = -1;
    g->dctx = g->ctx[0];
    g->dctx.curl = curl_easy_init();
    g->has_drainer =
        sig_pipe[0] >= 0 && g->dctx.curl && pthread_create(&g->drainer, NULL, drain_main, g) == 0;
    if (!g->has_drainer)
        LOG_W("discovery", "no drainer thread: a stop signal stops the server at once (its key "
                           "is deleted after)");
    *out = g;
    return 0;
}

void serve_registration_stop(serve_registration *s) {
    if (!s) return;
    atomic_store(&s->done, 1);
    if (s->has_drainer) pthread_join(s->drainer, NULL);
    if (s->dctx.curl) curl_easy_cleanup(s->dctx.curl);
    for (int k = 0; k < 2; k++) {
        discovery_registrar_stop(s->reg[k]);
        if (s->ctx[k].curl) curl_easy_cleanup(s->ctx[k].curl);
    }
    pthread_mutex_destroy(&s->eng_mu);
    free(s);
}

/* ---- bootstrap -------------------------------------------------------------------- */

static int bootstrap_refresh(void *arg, discovery_record *r) {
    return 0;
}

int bootstrap_registration_start(discovery_cli *d, const char *listen_host, unsigned port,
                                 discovery_registrar **out) {
    discovery_record r;
    memset(&r, 0, sizeof r);
    char host[256], err[1400];
    discovery_cli_advertise(d, listen_host, host, sizeof host);
    snprintf(r.role, sizeof r.role, "bootstrap");
    url_of(r.url, sizeof r.url, host, port);
    r.pid = (long)getpid();
    gethostname(r.hostname, sizeof r.hostname);
    if (discovery_registrar_start(&d->o, &r, bootstrap_refresh, NULL, out, err, sizeof err)) {
        fprintf(stderr, "disagg bootstrap: --discovery %s: %s\n", d->o.url, err);
        return -1;
    }
    return 0;
}
