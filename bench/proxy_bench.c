/*
 * proxy_bench — `disagg bench proxy`: what the P/D proxy adds.  Forks a fast
 * static upstream (answers /health, /query and completions at once, JSON or
 * SSE, on one libevent loop) and a `disagg proxy` in front of it (the same
 * process serves as prefill, bootstrap and decode), then drives both with an
 * in-process load generator on keep-alive connections:
 *   1. latency: non-streaming completions at concurrency 1 and 64, direct to
 *      the upstream vs through the proxy -> added p50/p99;
 *   2. relay rate: long SSE responses, direct vs through the proxy (MB/s);
 *   3. many streams: N concurrent streaming clients whose responses last
 *      about a second each (default 1000), counting errors.
 * Prints markdown tables (docs/proxy.md, docs/benchmarks.md).
 */
#include "bench/bench.h"

#include "base/clock.h"
#include "base/flags.h"
#include "base/log.h"
#include "base/http_client.h"
#include "base/http_server.h"
#include "proxy/proxy.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/net.h"

/* ---- the fast upstream ------------------------------------------------------ */

typedef struct up_stream {
    hs_req *req;        /* client of the upstream (the proxy or the load generator) */
    struct event *tick; /* next event timer (paced streams) */
    int left;           /* events still to send */
    double interval_s;  /* pace (0 = all at once) */
} up_stream;

static const char UP_JSON[] =
    "{\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":1700000000,\"model\":"
    "\"bench\",\"choices\":[{\"index\":0,\"text\":\" a b c d e f g h\",\"finish_reason\":"
    "\"length\",\"logprobs\":null}],\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":8,"
    "\"total_tokens\":16},\"kv_transfer_params\":null}";
static const char UP_EVENT[] =
    "data: {\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":1700000000,"
    "\"model\":\"bench\",\"choices\":[{\"index\":0,\"text\":\" tok\",\"finish_reason\":null,"
    "\"logprobs\":null}]}\n\n";
static const char UP_DONE[] = "data: [DONE]\n\n";

static void up_stream_free(up_stream *s) {
    event_free(s->tick);
    free(s);
}

static void up_gone(hs_req *req, void *arg) {
    up_stream_free(arg);
}

static void up_tick(evutil_socket_t fd, short what, void *arg) {
    up_stream *s = arg;
    struct evbuffer *b = evbuffer_new();
    int burst = s->interval_s > 0 ? 1 : s->left;
    for (int i = 0; i < burst && s->left > 0; i++, s->left--)
        evbuffer_add(b, UP_EVENT, sizeof UP_EVENT - 1);
    if (s->left == 0) evbuffer_add(b, UP_DONE, sizeof UP_DONE - 1);
    hs_reply_data(s->req, b);
    evbuffer_free(b);
    if (s->left == 0) {
        hs_req_set_close_cb(s->req, NULL, NULL);
        hs_reply_end(s->req);
        up_stream_free(s);
        return;
    }
    struct timeval tv = {0, (suseconds_t)(s->interval_s * 1e6)};
    event_add(s->tick, &tv);
}

/* Request knobs ride in the body: "stream":true, "bench_events":N, "bench_interval_ms":M. */
static int body_int(const char *body, const char *key, int dflt) {
    const char *p = strstr(body, key);
    return p ? atoi(p + strlen(key)) : dflt;
}

static void up_handle(hs_req *req, void *arg) {
    struct event_base *base = arg;
    const char *path = hs_req_path(req);
    if (!strcmp(path, "/health")) {
        hs_reply(req, 200, "application/json", NULL, "", 0);
    } else if (!strcmp(path, "/query")) {
        static const char q[] =
            "{\"0\":{\"engine_id\":\"bench-engine\",\"worker_addr\":{\"0\":{\"0\":"
            "\"tcp://127.0.0.1:1\"}}}}";
        hs_reply(req, 200, "application/json", NULL, q, sizeof q - 1);
    } else {
        size_t n;
        const char *body = hs_req_body(req, &n);
        char tmp[512];
        snprintf(tmp, sizeof tmp, "%.*s", (int)(n < 511 ? n : 511), body);
        if (!strstr(tmp, "\"stream\":true")) {
            hs_reply(req, 200, "application/json", NULL, UP_JSON, sizeof UP_JSON - 1);
            return;
        }
        static const http_header h[] = {{"Content-Type", "text/event-stream; charset=utf-8"}};
        hs_reply_start(req, 200, h, 1, -1);
        up_stream *s = calloc(1, sizeof *s);
        s->req = req;
        s->left = body_int(tmp, "\"bench_events\":", 16);
        s->interval_s = body_int(tmp, "\"bench_interval_ms\":", 0) / 1000.0;
        s->tick = event_new(base, -1, 0, up_tick, s);
        hs_req_set_close_cb(req, up_gone, s);
        up_tick(-1, 0, s);
    }
}

static void on_term(evutil_socket_t sig, short what, void *arg) {
    event_base_loopexit(arg, NULL);
}

/* Child: serves until SIGTERM; writes its port to fd. */
/* A child's loop: runs until SIGTERM. */
static void serve_until_sigterm(struct event_base *base) {
    struct event *t = evsignal_new(base, SIGTERM, on_term, base);
    event_add(t, NULL);
    event_base_dispatch(base);
    event_free(t);
}

static int run_upstream(int fd) {
    struct event_base *base = proxy_event_base_new();
    hs_config c;
    hs_config_default(&c);
    c.max_output_bytes = 4u << 20;
    hs_server *s = hs_server_new(base, "127.0.0.1", 0, &c, up_handle, base, NULL);
    if (!s) return 1;
    uint16_t port = hs_server_port(s);
    if (write(fd, &port, sizeof port) != sizeof port) return 1;
    close(fd);
    serve_until_sigterm(base);
    hs_server_free(s);
    event_base_free(base);
    return 0;
}

/* Child: the proxy in front of the upstream. */
static int run_proxy(int fd, uint16_t up_port) {
    struct event_base *base = proxy_event_base_new();
    char url[64], boot[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%u", up_port);
    snprintf(boot, sizeof boot, "127.0.0.1:%u", up_port);
    proxy_upstream pre = {url, boot}, dec = {url, NULL};
    proxy_config cfg;
    proxy_config_default(&cfg);
    cfg.port = 0;
    cfg.prefill = &pre;
    cfg.nprefill = 1;
    cfg.decode = &dec;
    cfg.ndecode = 1;
    char err[256];
    proxy *px = proxy_new(base, &cfg, err, sizeof err);
    if (!px) {
        fprintf(stderr, "bench proxy: %s\n", err);
        return 1;
    }
    uint16_t port = proxy_port(px);
    if (write(fd, &port, sizeof port) != sizeof port) return 1;
    close(fd);
    serve_until_sigterm(base);
    proxy_free(px);
    event_base_free(base);
    return 0;
}

typedef int (*child_fn)(int fd, uint16_t arg);
static int child_upstream(int fd, uint16_t arg) {
    return run_upstream(fd);
}

static pid_t spawn(child_fn fn, uint16_t arg, uint16_t *port) {
    int p[2];
    if (pipe(p)) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        _exit(fn(p[1], arg));
    }
    close(p[1]);
    ssize_t n = read(p[0], port, sizeof *port);
    close(p[0]);
    return n == sizeof *port ? pid : -1;
}

/* Blocking GET status (0 when unreachable). */
static int get_status(uint16_t port, const char *path) {
    net_addr a;
    net_resolve("127.0.0.1", port, &a);
    int fd = net_connect(&a, NULL, clock_now_ns() + NS_PER_S);
    if (fd < 0) return 0;
    char req[128], resp[256] = {0};
    int n =
        snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
    int st = 0;
    if (net_send_all(fd, req, (size_t)n, clock_now_ns() + NS_PER_S) == 0 &&
        net_recv_all(fd, resp, 12, clock_now_ns() + NS_PER_S) == 0)
        st = atoi(resp + 9);
    close(fd);
    return st;
}

/* ---- load generator ---------------------------------------------------------- */

typedef struct load {
    struct event_base *base; /* loop */
    hc_pool *pool;           /* connections to the target */
    const char *body;        /* request body */
    int total;               /* requests to complete */
    int concurrency;         /* in flight at once */
    int started, done;       /* progress */
    int errors;              /* failed / bad responses */
    int stream;              /* expect SSE ending in [DONE] */
    double *lat;             /* (total) seconds per request */
    uint64_t bytes;          /* body bytes received */
} load;

typedef struct one {
    load *l;       /* owner */
    uint64_t t0;   /* start */
    int status;    /* HTTP status */
    char tail[16]; /* last bytes of the body */
    size_t ntail;  /* valid bytes in tail */
} one;

static void load_next(load *l);

static void one_head(hc_req *r, const http_head *h, void *arg) {
    ((one *)arg)->status = h->status;
}

static void one_data(hc_req *r, struct evbuffer *d, void *arg) {
    one *o = arg;
    size_t n = evbuffer_get_length(d);
    o->l->bytes += n;
    size_t k = n < 15 ? n : 15; /* keep the last 15 bytes seen */
    char buf[15];
    struct evbuffer_ptr pos;
    evbuffer_ptr_set(d, &pos, n - k, EVBUFFER_PTR_SET);
    evbuffer_copyout_from(d, &pos, buf, k);
    if (o->ntail + k > 15) {
        size_t keep = 15 - k;
        memmove(o->tail, o->tail + o->ntail - keep, keep);
        o->ntail = keep;
    }
    memcpy(o->tail + o->ntail, buf, k);
    o->ntail += k;
    evbuffer_drain(d, n);
}

static void one_done(hc_req *r, int err, void *arg) {
    one *o = arg;
    load *l = o->l;
    int bad = err || o->status != 200;
    if (l->stream && !bad) bad = o->ntail < 14 || memcmp(o->tail + o->ntail - 14, UP_DONE, 14) != 0;
    if (bad) {
        if (l->errors < 5)
            fprintf(stderr, "bench proxy: request failed: %s, HTTP %d\n", hc_strerror(err),
                    o->status);
        l->errors++;
    }
    l->lat[l->done++] = (double)(clock_now_ns() - o->t0) / 1e9;
    free(o);
    if (l->done == l->total)
        event_base_loopbreak(l->base);
    else
        load_next(l);
}

static void load_next(load *l) {
    static const hc_callbacks cb = {one_head, one_data, one_done};
    if (l->started >= l->total) return;
    l->started++;
    one *o = calloc(1, sizeof *o);
    o->l = l;
    o->t0 = clock_now_ns();
    hc_timeouts t = {10, 60};
    hc_request(l->pool, "POST", "/v1/completions", "Content-Type: application/json\r\n", l->body,
               strlen(l->body), &t, &cb, o);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct result {
    double p50_ms, p99_ms, rps, mbps, wall_s;
    int errors;
} result;

static result run_load(uint16_t port, const char *body, int total, int conc, int stream) {
    load l = {0};
    l.base = proxy_event_base_new();
    l.pool = hc_pool_new(l.base, "127.0.0.1", port, conc + 16);
    l.body = body;
    l.total = total;
    l.concurrency = conc;
    l.stream = stream;
    l.lat = calloc((size_t)total, sizeof *l.lat);
    uint64_t t0 = clock_now_ns();
    for (int i = 0; i < conc && i < total; i++)
        load_next(&l);
    event_base_dispatch(l.base);
    double wall = (double)(clock_now_ns() - t0) / 1e9;
    qsort(l.lat, (size_t)total, sizeof *l.lat, cmp_d);
    result r = {l.lat[total / 2] * 1e3,
                l.lat[(size_t)(total * 0.99)] * 1e3,
                total / wall,
                (double)l.bytes / wall / 1e6,
                wall,
                l.errors};
    free(l.lat);
    hc_pool_free(l.pool);
    event_base_free(l.base);
    return r;
}

/* CPU seconds (user + system) a process used so far, from /proc/PID/stat. */
static double proc_cpu_s(pid_t pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); /* comm may contain spaces */
    unsigned long ut = 0, st = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return 0;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* ---- main ------------------------------------------------------------------------- */

int bench_proxy_main(int argc, char **argv) {
    int requests = 5000, streams = 1000, events = 4000;
    const flag_def defs[] = {
        {FLAG_INT_("--requests", &requests, 1, 1 << 24), .metavar = "N",
         .help = "requests per latency measurement (default 5000)"},
        {FLAG_INT_("--streams", &streams, 1, 1 << 20), .metavar = "N",
         .help = "concurrent streaming clients in the last test (default 1000)"},
        {FLAG_INT_("--stream-events", &events, 1, 1 << 24), .metavar = "N",
         .help = "SSE events per response in the relay-rate test (default 4000)"},
        {0}};
    const flag_def *tables[] = {defs, NULL};
    const flags_spec spec = {
        .cmd = "bench proxy",
        .usage = "usage: disagg bench proxy [--requests N] [--streams N] [--stream-events N]\n\n",
        .tables = tables,
        .help_col = 21};
    int pr = flags_parse(&spec, argc, argv);
    if (pr) return pr == FLAGS_HELP ? 0 : 2;
    signal(SIGPIPE, SIG_IGN);
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    if (rl.rlim_cur < (rlim_t)streams * 4 + 100)
        fprintf(stderr, "warning: RLIMIT_NOFILE %llu may be too low for %d streams\n",
                (unsigned long long)rl.rlim_cur, streams);
    log_set_level(LOG_WARN);

    uint16_t up_port, px_port;
    pid_t up = spawn(child_upstream, 0, &up_port);
    if (up < 0) return 1;
    pid_t px = spawn(run_proxy, up_port, &px_port);
    if (px < 0) {
        kill(up, SIGTERM);
        return 1;
    }
    uint64_t deadline = clock_now_ns() + 10 * NS_PER_S;
    while (get_status(px_port, "/health") != 200 && clock_now_ns() < deadline)
        clock_sleep_ns(10 * NS_PER_MS);

    static const char json_body[] = "{\"model\":\"bench\",\"prompt\":\"hello\",\"max_tokens\":8}";
    printf(
        "## disagg bench proxy\n\nupstream: static responder (forked), proxy: 1 prefill + 1 decode "
        "(both the responder), load: keep-alive connections, one client process.\n\n");
    printf("### Added latency (non-streaming completion, %d requests each)\n\n", requests);
    printf("| concurrency | direct p50 ms | direct p99 ms | proxy p50 ms | proxy p99 ms | added "
           "p50 ms "
           "| added p99 ms | proxy req/s | proxy CPU us/req | errors |\n"
           "|---|---|---|---|---|---|---|---|---|---|\n");
    int conc[] = {1, 64};
    int errors = 0;
    for (int c = 0; c < 2; c++) {
        run_load(up_port, json_body, requests / 10 + 1, conc[c], 0); /* warm-up */
        run_load(px_port, json_body, requests / 10 + 1, conc[c], 0);
        result d = run_load(up_port, json_body, requests, conc[c], 0);
        double cpu0 = proc_cpu_s(px);
        result p = run_load(px_port, json_body, requests, conc[c], 0);
        double cpu = proc_cpu_s(px) - cpu0;
        errors += d.errors + p.errors;
        printf("| %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.0f | %.0f | %d |\n", conc[c],
               d.p50_ms, d.p99_ms, p.p50_ms, p.p99_ms, p.p50_ms - d.p50_ms, p.p99_ms - d.p99_ms,
               p.rps, cpu / requests * 1e6, d.errors + p.errors);
        fflush(stdout);
    }

    char sbody[256];
    snprintf(sbody, sizeof sbody,
             "{\"model\":\"bench\",\"prompt\":\"hello\",\"stream\":true,\"bench_events\":%d}",
             events);
    printf("\n### Relay rate (SSE, %d events of %zu bytes per response, 1 client)\n\n", events,
           sizeof UP_EVENT - 1);
    printf("| path | responses | MB/s | events/s | proxy CPU s per GB | errors |\n"
           "|---|---|---|---|---|---|\n");
    for (int k = 0; k < 2; k++) {
        uint16_t port = k ? px_port : up_port;
        run_load(port, sbody, 5, 1, 1);
        double cpu0 = proc_cpu_s(px);
        result r = run_load(port, sbody, 50, 1, 1);
        double cpu = proc_cpu_s(px) - cpu0;
        errors += r.errors;
        if (k)
            printf("| through proxy | 50 | %.0f | %.0f | %.2f | %d |\n", r.mbps, r.rps * events,
                   cpu / (r.mbps * r.wall_s / 1e3), r.errors);
        else
            printf("| direct | 50 | %.0f | %.0f | - | %d |\n", r.mbps, r.rps * events, r.errors);
        fflush(stdout);
    }

    snprintf(sbody, sizeof sbody,
             "{\"model\":\"bench\",\"prompt\":\"hello\",\"stream\":true,\"bench_events\":20,"
             "\"bench_interval_ms\":50}");
    printf("\n### Concurrent streaming clients (20 events 50 ms apart: ~1 s per response)\n\n");
    printf("| path | clients | responses | wall s | p50 s | p99 s | errors |\n"
           "|---|---|---|---|---|---|---|\n");
    for (int k = 0; k < 2; k++) {
        result r = run_load(k ? px_port : up_port, sbody, streams * 2, streams, 1);
        errors += r.errors;
        printf("| %s | %d | %d | %.2f | %.3f | %.3f | %d |\n", k ? "through proxy" : "direct",
               streams, streams * 2, r.wall_s, r.p50_ms / 1e3, r.p99_ms / 1e3, r.errors);
        fflush(stdout);
    }

    kill(px, SIGTERM);
    kill(up, SIGTERM);
    int st1, st2;
    waitpid(px, &st1, 0);
    waitpid(up, &st2, 0);
    if (!WIFEXITED(st1) || WEXITSTATUS(st1) != 0) {
        fprintf(stderr, "bench proxy: the proxy exited abnormally (status %d)\n", st1);
        errors++;
    }
    return errors ? 1 : 0;
}
