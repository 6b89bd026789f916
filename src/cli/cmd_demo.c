/*
 * cmd_demo — `disagg demo`: the newcomer's one command.  Starts a prefill
 * instance (kv_producer), a decode instance (kv_consumer) and the proxy on
 * free localhost ports with the default model, sends one chat request through
 * the proxy, prints the answer as it streams, then the KV transfer it caused
 * (bytes, time, protocol) and where each part ran, and shuts everything down
 * (also on Ctrl-C).  --keep leaves them running and prints commands to try.
 */
#include "base/curl_glue.h"
#include "base/stop_signal.h"
#include "cli/commands.h"

#include "base/flags.h"

#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct demo_proc {
    const char *role; /* "prefill", "decode", "proxy" */
    pid_t pid;
    int port;
    char url[64];
    char log[96]; /* its output goes here */
} demo_proc;

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &l) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

static int spawn(demo_proc *p, char *const argv[], const char *env_kv) {
    p->pid = fork();
    if (p->pid < 0) return -1;
    if (p->pid == 0) {
        FILE *f = fopen(p->log, "w");
        if (f) {
            dup2(fileno(f), 1);
            dup2(fileno(f), 2);
        }
        setpgid(0, 0); /* Ctrl-C goes to the demo; it stops the children itself */
        if (env_kv) putenv((char *)env_kv);
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    return 0;
}

static size_t sink(char *p, size_t s, size_t n, void *ud) {
    (void)p;
    (void)ud;
    return s * n;
}

static long http_get(const char *url, char **body) {
    CURL *c = curl_glue_easy(url, 0, 5000);
    if (!c) return -1;
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = body ? open_memstream(&buf, &len) : NULL;
    if (mem)
        curl_easy_setopt(c, CURLOPT_WRITEDATA, mem);
    else
        curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, sink);
    long code = -1;
    if (curl_easy_perform(c) == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(c);
    if (mem) {
        fclose(mem);
        *body = buf;
    }
    return code;
}

static int wait_healthy(demo_proc *p, int seconds) {
    char url[96];
    snprintf(url, sizeof url, "%s/health", p->url);
    for (int i = 0; i < seconds * 10; i++) {
        if (stop_signal_received()) return -1;
        int st;
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            fprintf(stderr, "disagg demo: the %s instance exited during start-up; its log: %s\n",
                    p->role, p->log);
            p->pid = 0;
            return -1;
        }
        if (http_get(url, NULL) == 200) return 0;
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    fprintf(stderr, "disagg demo: the %s instance was not ready after %d s; its log: %s\n", p->role,
            seconds, p->log);
    return -1;
}

static void stop_all(demo_proc *ps, int n) {
    for (int i = n - 1; i >= 0; i--)
        if (ps[i].pid > 0) kill(ps[i].pid, SIGTERM);
    for (int i = n - 1; i >= 0; i--) {
        if (ps[i].pid <= 0) continue;
        int st;
        for (int k = 0; k < 100 && waitpid(ps[i].pid, &st, WNOHANG) == 0; k++) {
            struct timespec ts = {0, 50 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        if (waitpid(ps[i].pid, &st, WNOHANG) == 0) {
            kill(ps[i].pid, SIGKILL);
            waitpid(ps[i].pid, &st, 0);
        }
        ps[i].pid = 0;
    }
}

/* SSE from the proxy: print each delta as it comes. */
typedef struct stream_ctx {
    char line[65536];
    size_t n;
    int chars;
} stream_ctx;

static size_t on_stream(char *p, size_t s, size_t nmemb, void *ud) {
    stream_ctx *c = ud;
    size_t len = s * nmemb;
    for (size_t i = 0; i < len; i++) {
        if (p[i] != '\n') {
            if (c->n < sizeof c->line - 1) c->line[c->n++] = p[i];
            continue;
        }
        c->line[c->n] = 0;
        if (!strncmp(c->line, "data: ", 6) && strcmp(c->line + 6, "[DONE]")) {
            json_t *ev = json_loads(c->line + 6, 0, NULL);
            json_t *delta =
                json_object_get(json_array_get(json_object_get(ev, "choices"), 0), "delta");
            const char *t = json_string_value(json_object_get(delta, "content"));
            if (t) {
                fputs(t, stdout);
                fflush(stdout);
                c->chars += (int)strlen(t);
            }
            json_decref(ev);
        }
        c->n = 0;
    }
    return len;
}

static int on_progress(void *ud, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d) {
    (void)ud, (void)a, (void)b, (void)c, (void)d;
    return stop_signal_received() ? 1 : 0; /* Ctrl-C aborts the request */
}

/* One value of a Prometheus text body ("name value" or "name{...} value"). */
static double metric(const char *body, const char *name, char *labels, size_t cap) {
    size_t nl = strlen(name);
    for (const char *p = body; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (strncmp(p, name, nl) || (p[nl] != ' ' && p[nl] != '{')) continue;
        const char *v = p + nl;
        if (*v == '{') {
            const char *e = strchr(v, '}');
            if (!e) return 0;
            if (labels) snprintf(labels, cap, "%.*s", (int)(e - v - 1), v + 1);
            v = e + 1;
        }
        return atof(v);
    }
    return 0;
}

static const char *demo_model;

static int on_model(flags_parser *p, const char *word) {
    if (demo_model) {
        flags_error(p, "one MODEL expected, got '%s' and '%s' (see disagg demo --help)", demo_model,
                    word);
        return -1;
    }
    demo_model = word;
    return 0;
}

int cmd_demo(int argc, char **argv) {
    int keep = 0, max_tokens = 64;
    const char *prompt = "Fellow-Citizens of the Senate and House of Representatives, what is the "
                         "state of the Union?";
    const flag_def defs[] = {
        {FLAG_BOOL_("--keep", &keep),
         .help = "leave the three processes running and print commands to try"},
        {FLAG_STRING_("--prompt", &prompt), .metavar = "TEXT",
         .help = "the user message (default: a question for the State of the Union)"},
        {FLAG_INT_("--max-tokens", &max_tokens, 1, 4096),
         .help = "answer length, 1..4096 (default 64)"},
        {0}};
    const flag_def *tables[] = {defs, NULL};
    const flags_spec spec = {
        .cmd = "demo",
        .usage = "usage: disagg demo [--keep] [--prompt TEXT] [--max-tokens N] [MODEL]\n\n"
                 "Starts a prefill instance, a decode instance and the proxy on free localhost\n"
                 "ports (default model: models/disagg-sotu-tiny), sends one chat request through\n"
                 "the proxy, streams the answer, reports the KV transfer it caused, and stops\n"
                 "everything (also on Ctrl-C).\n\n",
        .tables = tables,
        .help_col = 18,
        .positional = on_model};
    int pr = flags_parse(&spec, argc, argv);
    if (pr) return pr == FLAGS_HELP ? 0 : 2;
    const char *model = demo_model;
    if (stop_signal_fd() < 0) return 1;
    curl_glue_init();
    demo_proc ps[3] = {{.role = "prefill"}, {.role = "decode"}, {.role = "proxy"}};
    int boot = free_port();
    for (int i = 0; i < 3; i++) {
        ps[i].port = free_port();
        snprintf(ps[i].url, sizeof ps[i].url, "http://127.0.0.1:%d", ps[i].port);
        snprintf(ps[i].log, sizeof ps[i].log, "/tmp/disagg-demo-%s-%d.log", ps[i].role, ps[i].port);
    }
    char pport[16], dport[16], xport[16], bport[16], benv[64];
    snprintf(pport, sizeof pport, "%d", ps[0].port);
    snprintf(dport, sizeof dport, "%d", ps[1].port);
    snprintf(xport, sizeof xport, "%d", ps[2].port);
    snprintf(bport, sizeof bport, "%d", boot);
    snprintf(benv, sizeof benv, "VLLM_MOONCAKE_BOOTSTRAP_PORT=%d", boot);
    const char *pcfg = "{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\","
                       "\"kv_connector_extra_config\":{\"mooncake_protocol\":\"tcp\"}}";
    const char *dcfg = "{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_consumer\","
                       "\"kv_connector_extra_config\":{\"mooncake_protocol\":\"tcp\"}}";
    char *pargv[16], *dargv[16];
    int k = 0;
    pargv[k++] = "disagg";
    pargv[k++] = "serve";
    if (model) pargv[k++] = (char *)model;
    int k0 = k;
    const char *common[] = {"--host", "127.0.0.1",           "--kv-cache-memory",
                            "256M",   "--served-model-name", "demo"};
    for (int i = 0; i < 6; i++)
        pargv[k++] = (char *)common[i];
    memcpy(dargv, pargv, sizeof pargv);
    int kd = k;
    pargv[k++] = "--port";
    pargv[k++] = pport;
    pargv[k++] = "--kv-transfer-config";
    pargv[k++] = (char *)pcfg;
    pargv[k] = NULL;
    dargv[kd++] = "--port";
    dargv[kd++] = dport;
    dargv[kd++] = "--kv-transfer-config";
    dargv[kd++] = (char *)dcfg;
    dargv[kd] = NULL;
    (void)k0;
    char *xargv[] = {"disagg",  "proxy", "--port",   xport,     "--prefill",
                     ps[0].url, bport,   "--decode", ps[1].url, NULL};
    int rc = 1;
    printf("disagg demo: starting a prefill instance, a decode instance and the proxy (logs in "
           "/tmp)...\n");
    fflush(stdout);
    if (spawn(&ps[0], pargv, benv) || wait_healthy(&ps[0], 120)) goto out;
    if (spawn(&ps[1], dargv, NULL) || wait_healthy(&ps[1], 120)) goto out;
    if (spawn(&ps[2], xargv, NULL) || wait_healthy(&ps[2], 60)) goto out;
    printf("  prefill  pid %-7d %s  (kv_producer, bootstrap :%d)\n", ps[0].pid, ps[0].url, boot);
    printf("  decode   pid %-7d %s  (kv_consumer)\n", ps[1].pid, ps[1].url);
    printf("  proxy    pid %-7d %s  (clients use this)\n\n", ps[2].pid, ps[2].url);
    printf("user> %s\nassistant> ", prompt);
    fflush(stdout);

    json_t *req =
        json_pack("{s:s,s:[{s:s,s:s}],s:i,s:b,s:f}", "model", "demo", "messages", "role", "user",
                  "content", prompt, "max_tokens", max_tokens, "stream", 1, "temperature", 0.0);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    char url[128];
    snprintf(url, sizeof url, "%s/v1/chat/completions", ps[2].url);
    CURL *c = curl_glue_easy(url, 0, 300000);
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    stream_ctx sc = {.n = 0};
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_stream);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &sc);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    CURLcode cr = curl_easy_perform(c);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    free(body);
    printf("\n\n");
    if (stop_signal_received()) {
        printf("disagg demo: interrupted; stopping everything\n");
        goto out;
    }
    if (cr != CURLE_OK || code != 200) {
        fprintf(
            stderr,
            "disagg demo: the request through the proxy failed (%s, HTTP %ld); logs: %s %s %s\n",
            curl_easy_strerror(cr), code, ps[0].log, ps[1].log, ps[2].log);
        goto out;
    }
    char murl[96], *pm = NULL, *dm = NULL, labels[256] = "";
    snprintf(murl, sizeof murl, "%s/metrics", ps[0].url);
    http_get(murl, &pm);
    snprintf(murl, sizeof murl, "%s/metrics", ps[1].url);
    http_get(murl, &dm);
    double bytes = pm ? metric(pm, "disagg:kv_transfer_bytes_total", NULL, 0) : 0;
    double runs = pm ? metric(pm, "disagg:kv_transfer_descriptors_total", NULL, 0) : 0;
    double send_s = pm ? metric(pm, "disagg:kv_send_seconds_sum", NULL, 0) : 0;
    double load_s = dm ? metric(dm, "disagg:kv_load_seconds_sum", NULL, 0) : 0;
    if (pm) metric(pm, "disagg:kv_transfer_info", labels, sizeof labels);
    const char *proto = strstr(labels, "protocol=\"");
    char pname[16] = "?";
    if (proto) sscanf(proto + 10, "%15[^\"]", pname);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    printf("what happened:\n");
    printf("  the proxy sent the request to the prefill instance (1 token, keeps its KV) and, at "
           "the same\n"
           "  time, to the decode instance, which pulled the prompt's KV cache and wrote the "
           "answer.\n");
    printf("  KV transfer: %.0f bytes in %.0f descriptor(s) over %s, written in %.2f ms (a first\n"
           "  transfer includes connecting); the decoder waited %.2f ms for it, prefill included\n",
           bytes, runs, pname, send_s * 1e3, load_s * 1e3);
    printf("  answer: %d characters in %.2f s through the proxy\n", sc.chars, secs);
    free(pm);
    free(dm);
    rc = bytes > 0 ? 0 : 1;
    if (!rc && keep) {
        printf("\n--keep: the three processes stay up (stop them with: kill %d %d %d). Try:\n",
               ps[2].pid, ps[1].pid, ps[0].pid);
        printf("  curl %s/v1/chat/completions -H 'Content-Type: application/json' \\\n"
               "       -d "
               "'{\"model\":\"demo\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}'\n",
               ps[2].url);
        printf("  python3 -c \"import openai; c=openai.OpenAI(base_url='%s/v1', api_key='x'); "
               "print(c.completions.create(model='demo', prompt='The Congress', "
               "max_tokens=20).choices[0].text)\"\n",
               ps[2].url);
        return 0;
    }
out:
    stop_all(ps, 3);
    if (rc == 0) printf("disagg demo: done; prefill, decode and proxy stopped\n");
    return rc;
}
