/*
 * serve_bench — `disagg bench serve`: the equivalent of `vllm bench serve` against any
 * OpenAI-compatible endpoint.  Datasets as vLLM names them (bench/serve_dataset.h: random,
 * prefix_repetition, custom JSONL prompts or multi-turn conversations, sharegpt); requests sent
 * at --request-rate (Poisson, or gamma with --burstiness) and/or under --max-concurrency, each
 * streamed (SSE, stream_options.include_usage) on its own connection from one libevent loop
 * (base/http_client: the body is parsed as each read brings it in).  A conversation's next turn
 * is ready when the previous answer has arrived, with that answer in its history (so the
 * server's prefix cache sees the real reuse); its first turn arrives by the rate.  The token
 * counts reported are the server's usage numbers.  Measures TTFT (first content chunk), ITL
 * (between content chunks), TPOT ((e2e - ttft) / (output tokens - 1)) and end-to-end latency;
 * prints mean, median and --metric-percentiles, throughput and goodput (vLLM's: every SLO met),
 * and writes them under vLLM's JSON keys with --json FILE.
 */
#include "bench/bench.h"
#include "bench/serve_dataset.h"

#include "base/flags.h"
#include "base/http_client.h"
#include "base/rng.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef struct sb_opts {
    char host[256];       /* from --base-url */
    int port;             /* from --base-url */
    const char *base_url; /* --base-url */
    const char *endpoint; /* --endpoint */
    const char *model;    /* --model, NULL: the first of GET /v1/models */
    const char *label;    /* --label */
    sd_opts ds;           /* --dataset-name and its options */
    int num_prompts;      /* --num-prompts */
    double rate;          /* --request-rate, INFINITY = all at once */
    double burstiness;    /* --burstiness (gamma shape; 1 = Poisson) */
    int max_concurrency;  /* --max-concurrency, 0 = unlimited */
    int ignore_eos;       /* --ignore-eos (the random dataset sets it, as vLLM) */
    uint64_t seed;        /* --seed */
    double goodput_ttft_ms, goodput_tpot_ms, goodput_e2el_ms; /* --goodput, < 0 = unset */
    double pct[8];                                            /* --metric-percentiles */
    int n_pct;
    int save_detailed;  /* --save-detailed: per-request lists in the JSON */
    int metrics;        /* --percentile-metrics: bits SB_M_* */
    double temperature; /* --temperature */
    int save_result;    /* --save-result: vLLM's file name under --result-dir */
    const char *result_dir, *result_filename;
    const char *backend;   /* --backend as given, NULL: from the endpoint */
    const char *json_path; /* --json */
    const char *api_key;   /* OPENAI_API_KEY */
    int progress;          /* progress bar on a tty */
    /* P/D mode: requests go to a prefill (P) and this decode (D) instance at
     * once, the way the proxy sends them (PROTOCOL.md section 1) */
    const char *pd_prefill; /* --pd-prefill URL, NULL = colocated */
    char p_host[256];
    int p_port;
    const char *pd_bootstrap; /* --pd-bootstrap URL (default http://<P host>:8998) */
    char b_host[256];
    int b_port;
    char engine_id[160]; /* P's engine id for dp rank 0 (from /query) */
} sb_opts;

typedef struct sb_req {
    struct sb_run *run; /* owner */
    int index;          /* request number */
    int item, turn;     /* the dataset item and its user turn (0 for a single prompt) */
    char *body;         /* JSON request body, built when the request is sent */
    const char *path;   /* the endpoint it goes to */
    hc_req *req;        /* the decode (or colocated) request, NULL when over */
    int status;         /* its HTTP status, 0 = no head (yet) */
    double t_ready;     /* due (its arrival, or the previous turn's answer), monotonic */
    double t_start;     /* sent (after t_ready when --max-concurrency made it wait) */
    double t_first;     /* first content chunk, 0 = none yet */
    double t_last;      /* latest content chunk */
    double t_end;       /* completion */
    double *itl;        /* (n_itl) inter-chunk gaps */
    int n_itl, cap_itl;
    int prompt_tokens, output_tokens; /* from usage */
    int ok;                           /* finished with [DONE] and HTTP 200 */
    int sent;                         /* sent (a later turn of a failed conversation is not) */
    char err[256];                    /* why it failed */
    char *sse;                        /* unparsed SSE bytes */
    size_t sse_len;
    char *text; /* the generated text (the next turn's history) */
    size_t text_len, text_cap;
    /* P/D mode */
    char *p_body;   /* the prefill request */
    hc_req *p_req;  /* the prefill request, NULL when over */
    double t_p_end; /* the prefill answered */
    int p_status;   /* its HTTP status, 0 = no answer */
} sb_req;

/* A conversation in flight: the messages sent so far, with the server's answers. */
typedef struct sb_conv {
    json_t *hist; /* [{"role", "content"}] */
    int next_msg; /* the next message of the item's conv to add */
    int first;    /* the index of its first request in run->reqs */
} sb_conv;

typedef struct sb_run {
    sb_opts *o;
    struct event_base *base;
    hc_pool *pool;   /* connections to --base-url (one per request: none kept idle) */
    hc_pool *p_pool; /* P/D: to --pd-prefill */
    sd_item *items;  /* the dataset (n_items) */
    int n_items;
    sb_conv *convs; /* (n_items) */
    sb_req *reqs;   /* (n_reqs): every user turn of every item, item by item */
    int n_reqs;
    int next_item; /* next item whose first turn is due */
    int *ready;    /* requests ready to go (a FIFO, n_reqs slots) */
    int ready_head, ready_tail;
    int in_flight, done;
    int p_in_flight;     /* P/D: prefill requests not answered yet (the run waits for them) */
    int p_grace;         /* ... and the 30 s it waits for them at the end has begun */
    double t0;           /* benchmark start */
    struct event *timer; /* next arrival */
    double *arrival;     /* (n_items) offsets of the items' first turns */
    double kv[4]; /* P/D over the run: D load seconds sum, count; P send seconds sum, count */
} sb_run;

enum { SB_M_TTFT = 1, SB_M_TPOT = 2, SB_M_ITL = 4, SB_M_E2EL = 8 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- random numbers (base/rng.h splitmix64) ------------------------------------------------- */

static uint64_t g_rng;
static uint64_t rng_u64(void) {
    return rng_splitmix64(&g_rng);
}
static double rng_unit(void) {
    return ((rng_u64() >> 11) + 0.5) / 9007199254740992.0;
}

/* Gamma(shape k, scale 1) by Marsaglia-Tsang. */
static double rng_gamma(double k) {
    if (k < 1) return rng_gamma(k + 1) * pow(rng_unit(), 1 / k);
    double d = k - 1.0 / 3, c = 1 / sqrt(9 * d);
    for (;;) {
        double x, v;
        do {
            double u1 = rng_unit(), u2 = rng_unit();
            x = sqrt(-2 * log(u1)) * cos(2 * M_PI * u2);
            v = 1 + c * x;
        } while (v <= 0);
        v = v * v * v;
        double u = rng_unit();
        if (log(u) < 0.5 * x * x + d - d * v + d * log(v)) return d * v;
    }
}

/* P/D: D's body gets kv_transfer_params for a remote prefill; *p_body gets
 * P's: max_tokens 1, not streamed, remote decode, the same transfer_id. */
static void sb_add_pd(const sb_opts *o, json_t *b, char **p_body) {
    char tid[64];
    snprintf(tid, sizeof tid, "xfer-%016llx%016llx", (unsigned long long)rng_u64(),
             (unsigned long long)rng_u64());
    char boot[300];
    snprintf(boot, sizeof boot, "http://%s:%d", o->b_host, o->b_port);
    json_t *pb = json_deep_copy(b);
    json_object_set_new(pb, "max_tokens", json_integer(1));
    json_object_set_new(pb, "stream", json_false());
    json_object_del(pb, "stream_options");
    json_object_set_new(pb, "kv_transfer_params",
                        json_pack("{s:b,s:b,s:s}", "do_remote_decode", 1, "do_remote_prefill", 0,
                                  "transfer_id", tid));
    *p_body = json_dumps(pb, JSON_COMPACT);
    json_decref(pb);
    json_object_set_new(b, "kv_transfer_params",
                        json_pack("{s:b,s:b,s:s,s:s,s:s}", "do_remote_decode", 0,
                                  "do_remote_prefill", 1, "remote_engine_id", o->engine_id,
                                  "remote_bootstrap_addr", boot, "transfer_id", tid));
}

/* The body of request q: a single prompt to --endpoint (as "prompt", or one user message on
 * the chat endpoint), or a conversation's next user turn with the history so far (the
 * earlier answers in it) to the chat endpoint. */
static char *sb_make_body(sb_run *run, sb_req *q) {
    const sb_opts *o = run->o;
    const sd_item *it = &run->items[q->item];
    json_t *b = json_pack("{s:s,s:i,s:b,s:{s:b},s:f}", "model", o->model, "max_tokens", it->out_len,
                          "stream", 1, "stream_options", "include_usage", 1, "temperature", 0.0);
    if (!b) return NULL;
    if (o->ignore_eos) json_object_set_new(b, "ignore_eos", json_true());
    if (it->conv) {
        sb_conv *c = &run->convs[q->item];
        if (!c->hist) c->hist = json_array();
        /* the file's messages up to and including this turn's user message; the file's
         * assistant messages are replaced by the server's answers (added on completion) */
        size_t n = json_array_size(it->conv);
        while (c->next_msg < (int)n) {
            json_t *m = json_array_get(it->conv, (size_t)c->next_msg++);
            const char *role = json_string_value(json_object_get(m, "role"));
            if (!strcmp(role, "assistant")) continue;
            json_array_append(c->hist, m);
            if (!strcmp(role, "user")) break;
        }
        json_object_set(b, "messages", c->hist);
        q->path = "/v1/chat/completions";
    } else if (strstr(o->endpoint, "chat")) {
        json_object_set_new(b, "messages",
                            json_pack("[{s:s,s:s}]", "role", "user", "content", it->prompt));
        q->path = o->endpoint;
    } else {
        json_object_set_new(b, "prompt", json_string(it->prompt));
        q->path = o->endpoint;
    }
    if (o->pd_prefill) sb_add_pd(o, b, &q->p_body);
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* ---- one request ------------------------------------------------------------------ */

static void sb_send_due(sb_run *run);

static void sb_on_event(sb_req *q, const char *data, size_t n) {
    if (n == 6 && !memcmp(data, "[DONE]", 6)) {
        q->ok = 1;
        return;
    }
    json_t *j = json_loadb(data, n, 0, NULL);
    if (!j) return;
    json_t *usage = json_object_get(j, "usage");
    if (json_is_object(usage)) {
        q->prompt_tokens = (int)json_integer_value(json_object_get(usage, "prompt_tokens"));
        q->output_tokens = (int)json_integer_value(json_object_get(usage, "completion_tokens"));
    }
    json_t *err = json_object_get(j, "error");
    if (err)
        snprintf(q->err, sizeof q->err, "%s", json_string_value(json_object_get(err, "message")));
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    const char *text = NULL;
    if (ch) {
        json_t *t = json_object_get(ch, "text");
        if (!t) t = json_object_get(json_object_get(ch, "delta"), "content");
        text = json_string_value(t);
    }
    if (text && *text) {
        double t = now_s();
        if (q->t_first == 0)
            q->t_first = t;
        else {
            if (q->n_itl == q->cap_itl) {
                q->cap_itl = q->cap_itl ? q->cap_itl * 2 : 64;
                q->itl = realloc(q->itl, (size_t)q->cap_itl * sizeof *q->itl);
            }
            q->itl[q->n_itl++] = t - q->t_last;
        }
        q->t_last = t;
        size_t tl = strlen(text);
        if (q->text_len + tl + 1 > q->text_cap) {
            size_t c = q->text_cap ? q->text_cap * 2 : 256;
            while (c < q->text_len + tl + 1)
                c *= 2;
            char *g = realloc(q->text, c);
            if (!g) {
                snprintf(q->err, sizeof q->err, "out of memory keeping the answer");
                json_decref(j);
                return;
            }
            q->text = g;
            q->text_cap = c;
        }
        memcpy(q->text + q->text_len, text, tl + 1);
        q->text_len += tl;
    }
    json_decref(j);
}

/* SSE bytes as they arrive: each complete event ("data: ...\n\n") is handled now, so its
 * arrival time is the time of the read that completed it. */
static void sb_on_data(hc_req *r, struct evbuffer *in, void *arg) {
    sb_req *q = arg;
    size_t n = evbuffer_get_length(in);
    if (q->status != 200) { /* an error body: the failure is reported as HTTP <status> */
        evbuffer_drain(in, n);
        return;
    }
    char *grown = realloc(q->sse, q->sse_len + n + 1);
    if (!grown) {
        snprintf(q->err, sizeof q->err, "out of memory buffering the stream");
        evbuffer_drain(in, n);
        return;
    }
    q->sse = grown;
    evbuffer_remove(in, q->sse + q->sse_len, n);
    q->sse_len += n;
    size_t start = 0;
    for (size_t i = 0; i + 1 < q->sse_len; i++) {
        if (q->sse[i] == '\n' && q->sse[i + 1] == '\n') {
            if (i - start >= 6 && !memcmp(q->sse + start, "data: ", 6))
                sb_on_event(q, q->sse + start + 6, i - start - 6);
            start = i + 2;
            i++;
        }
    }
    memmove(q->sse, q->sse + start, q->sse_len - start);
    q->sse_len -= start;
}

static void sb_on_head(hc_req *r, const http_head *h, void *arg) {
    sb_req *q = arg;
    q->status = h->status;
}

static void sb_progress(sb_run *run) {
    if (!run->o->progress) return;
    int w = 40, done = run->done, n = run->n_reqs;
    int fill = n ? done * w / n : w;
    fprintf(stderr, "\r[%.*s%*s] %d/%d requests, %.1f s", fill,
            "########################################", w - fill, "", done, n, now_s() - run->t0);
    if (done == n) fputc('\n', stderr);
}

/* The run ends when every request is done and every prefill answered: a decoder can
 * finish a request before its prefill's answer reaches us (the KV and the first token come
 * over the side channel), and that answer is counted too. */
static void sb_maybe_end(sb_run *run) {
    if (run->done < run->n_reqs) return;
    if (run->p_in_flight == 0) {
        event_base_loopexit(run->base, NULL);
    } else if (!run->p_grace) { /* a prefill that never answers: not past 30 s more */
        struct timeval tv = {30, 0};
        run->p_grace = 1;
        event_base_loopexit(run->base, &tv);
    }
}

static void sb_finish(sb_run *run) {
    run->done++;
    sb_progress(run);
    sb_maybe_end(run);
}

static void sb_push_ready(sb_run *run, int i) {
    run->reqs[i].t_ready = now_s();
    run->ready[run->ready_tail++] = i;
}

/* A conversation's turn is over: on success its answer joins the history and the next turn is
 * ready now; on failure the later turns are failed unsent (their history would lack it). */
static void sb_turn_over(sb_run *run, sb_req *q) {
    const sd_item *it = &run->items[q->item];
    if (!it->conv || q->turn + 1 >= it->n_turns) return;
    sb_conv *c = &run->convs[q->item];
    if (q->ok && q->t_first) {
        json_array_append_new(c->hist, json_pack("{s:s,s:s}", "role", "assistant", "content",
                                                 q->text ? q->text : ""));
        sb_push_ready(run, (int)(q - run->reqs) + 1);
        return;
    }
    for (int t = q->turn + 1; t < it->n_turns; t++) {
        sb_req *l = q + (t - q->turn);
        snprintf(l->err, sizeof l->err, "turn %d of the conversation failed", q->turn);
        l->t_end = now_s();
        sb_finish(run);
    }
}

static void sb_on_done(hc_req *r, int err, void *arg) {
    sb_req *q = arg;
    sb_run *run = q->run;
    q->req = NULL; /* freed by http_client when this returns */
    q->t_end = now_s();
    if (err) {
        snprintf(q->err, sizeof q->err, "%s", hc_strerror(err));
        q->ok = 0;
    } else if (q->status != 200) {
        if (!q->err[0]) snprintf(q->err, sizeof q->err, "HTTP %d", q->status);
        q->ok = 0;
    } else if (q->err[0])
        q->ok = 0;
    else if (!q->ok)
        snprintf(q->err, sizeof q->err, "stream ended without [DONE]");
    run->in_flight--;
    sb_turn_over(run, q);
    sb_finish(run);
    if (run->done < run->n_reqs) sb_send_due(run);
}

static void sb_on_p_head(hc_req *r, const http_head *h, void *arg) {
    sb_req *q = arg;
    q->p_status = h->status;
}

static void sb_on_p_done(hc_req *r, int err, void *arg) {
    sb_req *q = arg;
    q->p_req = NULL;
    q->t_p_end = now_s();
    if (err) q->p_status = 0; /* no (whole) answer */
    q->run->p_in_flight--;
    sb_maybe_end(q->run);
}

/* Every request may take an hour (a long run at a high rate queues on the server). */
static const hc_timeouts SB_TIMEOUTS = {3600, 3600};

/* "Content-Type: application/json\r\n" and the Bearer key when OPENAI_API_KEY is set. */
static void sb_headers(const sb_opts *o, char *out, size_t cap) {
    int n = snprintf(out, cap, "Content-Type: application/json\r\n");
    if (o->api_key) snprintf(out + n, cap - (size_t)n, "Authorization: Bearer %s\r\n", o->api_key);
}

/* P/D: the prefill request, sent together with the decode request (no key: the instances
 * of a P/D pair are reached the way the proxy reaches them). */
static void sb_send_prefill(sb_run *run, sb_req *q) {
    static const hc_callbacks cb = {sb_on_p_head, NULL, sb_on_p_done};
    q->p_req = hc_request(run->p_pool, "POST", q->path, "Content-Type: application/json\r\n",
                          q->p_body, strlen(q->p_body), &SB_TIMEOUTS, &cb, q);
    if (!q->p_req)
        q->t_p_end = now_s(); /* out of memory: p_status stays 0, a failure */
    else
        run->p_in_flight++;
}

static void sb_send(sb_run *run, sb_req *q) {
    static const hc_callbacks cb = {sb_on_head, sb_on_data, sb_on_done};
    const sb_opts *o = run->o;
    q->sent = 1;
    q->t_start = now_s();
    q->body = sb_make_body(run, q);
    if (!q->body || (o->pd_prefill && !q->p_body)) {
        q->t_end = now_s();
        snprintf(q->err, sizeof q->err, "out of memory building the request");
        sb_turn_over(run, q);
        sb_finish(run);
        return;
    }
    if (o->pd_prefill) sb_send_prefill(run, q);
    char hdr[600];
    sb_headers(o, hdr, sizeof hdr);
    run->in_flight++;
    q->req =
        hc_request(run->pool, "POST", q->path, hdr, q->body, strlen(q->body), &SB_TIMEOUTS, &cb, q);
    if (!q->req) { /* out of memory: counted as a failed request */
        run->in_flight--;
        q->t_end = now_s();
        snprintf(q->err, sizeof q->err, "out of memory starting the request");
        sb_turn_over(run, q);
        sb_finish(run);
    }
}

static void sb_on_timer(evutil_socket_t fd, short what, void *arg) {
    sb_send_due(arg);
}

/* Items' first turns join the ready FIFO at their arrival offsets; ready requests go while
 * --max-concurrency allows. */
static void sb_send_due(sb_run *run) {
    const sb_opts *o = run->o;
    double t = now_s();
    while (run->next_item < run->n_items && run->t0 + run->arrival[run->next_item] <= t)
        sb_push_ready(run, run->convs[run->next_item++].first);
    while (run->ready_head < run->ready_tail &&
           (o->max_concurrency <= 0 || run->in_flight < o->max_concurrency))
        sb_send(run, &run->reqs[run->ready[run->ready_head++]]);
    if (run->next_item < run->n_items && !evtimer_pending(run->timer, NULL)) {
        double d = run->t0 + run->arrival[run->next_item] - now_s();
        if (d < 0) d = 0;
        struct timeval tv = {(long)d, (long)((d - floor(d)) * 1e6)};
        evtimer_add(run->timer, &tv);
    }
}

/* ---- statistics ---------------------------------------------------------------------- */

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct sb_stat {
    double mean, median, std;
    double pct[8]; /* --metric-percentiles */
} sb_stat;

/* Linear-interpolated percentile of sorted v[0..n), as numpy.percentile. */
static double sb_pct(const double *v, int n, double p) {
    double pos = p / 100 * (n - 1);
    int lo = (int)floor(pos), hi = lo + 1 < n ? lo + 1 : lo;
    return v[lo] + (v[hi] - v[lo]) * (pos - lo);
}

static sb_stat sb_stats(const sb_opts *o, double *v, int n) {
    sb_stat s;
    memset(&s, 0, sizeof s);
    if (n == 0) return s;
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += v[i];
    s.mean = sum / n;
    double var = 0;
    for (int i = 0; i < n; i++)
        var += (v[i] - s.mean) * (v[i] - s.mean);
    s.std = sqrt(var / n);
    s.median = sb_pct(v, n, 50);
    for (int k = 0; k < o->n_pct; k++)
        s.pct[k] = sb_pct(v, n, o->pct[k]);
    return s;
}

/* "99", "99.9": vLLM's p_word. */
static void sb_pword(double p, char *out, size_t cap) {
    if (p == floor(p))
        snprintf(out, cap, "%d", (int)p);
    else
        snprintf(out, cap, "%g", p);
}

static void sb_print_stat(const sb_opts *o, const char *title, const char *name, const char *key,
                          sb_stat s, json_t *res) {
    char k[64], lab[64], pw[16];
    printf("%s\n", title);
    snprintf(lab, sizeof lab, "Mean %s (ms):", name);
    printf("%-40s %-10.2f\n", lab, s.mean * 1e3);
    snprintf(lab, sizeof lab, "Median %s (ms):", name);
    printf("%-40s %-10.2f\n", lab, s.median * 1e3);
    snprintf(k, sizeof k, "mean_%s_ms", key);
    json_object_set_new(res, k, json_real(s.mean * 1e3));
    snprintf(k, sizeof k, "median_%s_ms", key);
    json_object_set_new(res, k, json_real(s.median * 1e3));
    snprintf(k, sizeof k, "std_%s_ms", key);
    json_object_set_new(res, k, json_real(s.std * 1e3));
    for (int i = 0; i < o->n_pct; i++) {
        sb_pword(o->pct[i], pw, sizeof pw);
        snprintf(lab, sizeof lab, "P%s %s (ms):", pw, name);
        printf("%-40s %-10.2f\n", lab, s.pct[i] * 1e3);
        snprintf(k, sizeof k, "p%s_%s_ms", pw, key);
        json_object_set_new(res, k, json_real(s.pct[i] * 1e3));
    }
}

/* vLLM's peak figures: the most output tokens in one 1-second bucket (token times: first
 * chunk, then each inter-chunk gap) and the most requests in flight at one instant
 * (half-open intervals: an end sorts before a start at the same time). */
typedef struct sb_ev {
    double t;
    int d; /* +1 start, -1 end */
} sb_ev;

static int cmp_ev(const void *a, const void *b) {
    const sb_ev *x = a, *y = b;
    if (x->t != y->t) return x->t < y->t ? -1 : 1;
    return x->d - y->d;
}

static void sb_peaks(sb_run *run, double *max_tok_s, int *max_conc) {
    double t_min = INFINITY, t_max = -INFINITY;
    int n = 0;
    *max_tok_s = 0;
    *max_conc = 0;
    for (int i = 0; i < run->n_reqs; i++) {
        sb_req *q = &run->reqs[i];
        if (!q->ok || !q->t_first) continue;
        if (q->t_start < t_min) t_min = q->t_start;
        if (q->t_end > t_max) t_max = q->t_end;
        n++;
    }
    if (!n) return;
    int nb = (int)ceil(t_max - t_min) + 1, ne = 0;
    double *b = calloc((size_t)nb, sizeof *b);
    sb_ev *ev = calloc((size_t)n * 2, sizeof *ev);
    if (!b || !ev) goto out;
    for (int i = 0; i < run->n_reqs; i++) {
        sb_req *q = &run->reqs[i];
        if (!q->ok || !q->t_first) continue;
        double t = q->t_first;
        for (int k = -1; k < q->n_itl; k++) {
            if (k >= 0) t += q->itl[k];
            int bk = (int)(t - t_min);
            if (bk >= 0 && bk < nb) b[bk] += 1;
        }
        ev[ne++] = (sb_ev){q->t_start, 1};
        ev[ne++] = (sb_ev){q->t_end, -1};
    }
    for (int k = 0; k < nb; k++)
        if (b[k] > *max_tok_s) *max_tok_s = b[k];
    qsort(ev, (size_t)ne, sizeof *ev, cmp_ev);
    for (int k = 0, cur = 0; k < ne; k++) {
        cur += ev[k].d;
        if (cur > *max_conc) *max_conc = cur;
    }
out:
    free(b);
    free(ev);
}

/* Multi-turn: the completed turns and their median TTFT and prompt tokens by turn number
 * (turn 1 has no cached history; later turns show what the prefix cache saves). */
static void sb_by_turn(sb_run *run, json_t *res) {
    int max_t = 0;
    for (int i = 0; i < run->n_reqs; i++)
        if (run->items[run->reqs[i].item].conv && run->reqs[i].turn + 1 > max_t)
            max_t = run->reqs[i].turn + 1;
    double *v = calloc((size_t)run->n_reqs + 1, sizeof *v);
    json_t *cnt = json_array(), *ttft = json_array(), *in = json_array();
    if (!v || !cnt || !ttft || !in) {
        free(v);
        json_decref(cnt);
        json_decref(ttft);
        json_decref(in);
        return;
    }
    printf("%s\n", "--------Multi-turn: median TTFT (ms) by turn------");
    for (int t = 0; t < max_t; t++) {
        int n = 0;
        long tok = 0;
        for (int i = 0; i < run->n_reqs; i++) {
            sb_req *q = &run->reqs[i];
            if (!run->items[q->item].conv || q->turn != t || !q->ok || !q->t_first) continue;
            v[n++] = q->t_first - q->t_start;
            tok += q->prompt_tokens;
        }
        qsort(v, (size_t)n, sizeof *v, cmp_d);
        double med = n ? sb_pct(v, n, 50) * 1e3 : 0;
        json_array_append_new(cnt, json_integer(n));
        json_array_append_new(ttft, json_real(med));
        json_array_append_new(in, json_real(n ? (double)tok / n : 0));
        char lab[64];
        snprintf(lab, sizeof lab, "Turn %d (%d, ~%ld prompt tokens):", t + 1, n, n ? tok / n : 0);
        printf("%-40s %-10.2f\n", lab, med);
    }
    json_object_set_new(res, "turn_completed", cnt);
    json_object_set_new(res, "turn_median_ttft_ms", ttft);
    json_object_set_new(res, "turn_mean_input_tokens", in);
    free(v);
}

static int sb_report(sb_run *run, double duration) {
    const sb_opts *o = run->o;
    int n = run->n_reqs, ok = 0;
    long in_tok = 0, out_tok = 0;
    double *ttft = calloc((size_t)n + 1, sizeof(double)),
           *tpot = calloc((size_t)n + 1, sizeof(double));
    double *e2el = calloc((size_t)n + 1, sizeof(double));
    int n_itl = 0, n_tpot = 0, good = 0;
    for (int i = 0; i < n; i++)
        n_itl += run->reqs[i].n_itl;
    double *itl = calloc((size_t)n_itl + 1, sizeof(double));
    if (!ttft || !tpot || !e2el || !itl) {
        fprintf(stderr, "disagg bench serve: out of memory\n");
        return 1;
    }
    n_itl = 0;
    const char *first_err = NULL;
    json_t *input_lens = json_array(), *output_lens = json_array(), *ttfts = json_array(),
           *itls = json_array(), *lats = json_array(), *starts = json_array(),
           *texts = json_array(), *errors = json_array(), *queues = json_array();
    double *qt = calloc((size_t)n + 1, sizeof(double)),
           *e2q = calloc((size_t)n + 1, sizeof(double));
    if (!qt || !e2q) {
        fprintf(stderr, "disagg bench serve: out of memory\n");
        return 1;
    }
    for (int i = 0; i < n; i++) {
        sb_req *q = &run->reqs[i];
        int good_req = q->ok && q->t_first != 0;
        json_array_append_new(input_lens, json_integer(q->prompt_tokens));
        json_array_append_new(output_lens, json_integer(good_req ? q->output_tokens : 0));
        json_array_append_new(ttfts, json_real(good_req ? q->t_first - q->t_start : 0));
        json_t *il = json_array();
        for (int k = 0; good_req && k < q->n_itl; k++)
            json_array_append_new(il, json_real(q->itl[k]));
        json_array_append_new(itls, il);
        json_array_append_new(lats, json_real(good_req ? q->t_end - q->t_start : 0));
        json_array_append_new(queues, json_real(q->sent ? q->t_start - q->t_ready : 0));
        json_array_append_new(starts, json_real(q->sent ? q->t_start - run->t0 : 0));
        json_array_append_new(texts, json_string(q->text ? q->text : ""));
        json_array_append_new(errors, json_string(good_req    ? ""
                                                  : q->err[0] ? q->err
                                                              : "no output"));
        if (!good_req) {
            if (!first_err) first_err = q->err[0] ? q->err : "no output";
            continue;
        }
        double t1 = q->t_first - q->t_start, e = q->t_end - q->t_start;
        ttft[ok] = t1;
        e2el[ok] = e;
        qt[ok] = q->t_start - q->t_ready;
        e2q[ok] = e + qt[ok];
        double tp = q->output_tokens > 1 ? (e - t1) / (q->output_tokens - 1) : 0;
        if (q->output_tokens > 1) tpot[n_tpot++] = tp;
        memcpy(itl + n_itl, q->itl, (size_t)q->n_itl * sizeof(double));
        n_itl += q->n_itl;
        in_tok += q->prompt_tokens;
        out_tok += q->output_tokens;
        /* vLLM's goodput: every SLO given is met (a request of one token has TPOT 0) */
        int g = 1;
        if (o->goodput_ttft_ms >= 0 && t1 * 1e3 > o->goodput_ttft_ms) g = 0;
        if (o->goodput_tpot_ms >= 0 && tp * 1e3 > o->goodput_tpot_ms) g = 0;
        if (o->goodput_e2el_ms >= 0 && e * 1e3 > o->goodput_e2el_ms) g = 0;
        good += g;
        ok++;
    }
    double peak_tok = 0;
    int peak_conc = 0;
    sb_peaks(run, &peak_tok, &peak_conc);
    json_t *res = json_object();
    char date[32];
    time_t now = time(NULL);
    struct tm tmv;
    strftime(date, sizeof date, "%Y%m%d-%H%M%S", localtime_r(&now, &tmv));
    int chat = strstr(o->endpoint, "chat") != NULL;
    for (int i = 0; i < run->n_items; i++)
        chat |= run->items[i].conv != NULL;
    const char *backend = o->backend ? o->backend : chat ? "openai-chat" : "openai";
    json_object_set_new(res, "date", json_string(date));
    json_object_set_new(res, "endpoint_type", json_string(backend));
    json_object_set_new(res, "backend", json_string(backend));
    json_object_set_new(res, "label", o->label ? json_string(o->label) : json_null());
    json_object_set_new(res, "model_id", json_string(o->model));
    json_object_set_new(res, "tokenizer_id", json_string(o->model));
    json_object_set_new(res, "num_prompts", json_integer(o->num_prompts));
    json_object_set_new(res, "request_rate",
                        isinf(o->rate) ? json_string("inf") : json_real(o->rate));
    json_object_set_new(res, "burstiness", json_real(o->burstiness));
    json_object_set_new(res, "max_concurrency",
                        o->max_concurrency ? json_integer(o->max_concurrency) : json_null());
    printf("============ Serving Benchmark Result ============\n");
    printf("%-40s %-10d\n", "Successful requests:", ok);
    printf("%-40s %-10d\n", "Failed requests:", n - ok);
    if (o->max_concurrency > 0)
        printf("%-40s %-10d\n", "Maximum request concurrency:", o->max_concurrency);
    if (!isinf(o->rate)) printf("%-40s %-10.2f\n", "Request rate configured (RPS):", o->rate);
    printf("%-40s %-10.2f\n", "Benchmark duration (s):", duration);
    printf("%-40s %-10ld\n", "Total input tokens:", in_tok);
    printf("%-40s %-10ld\n", "Total generated tokens:", out_tok);
    printf("%-40s %-10.2f\n", "Request throughput (req/s):", ok / duration);
    int has_goodput = o->goodput_ttft_ms >= 0 || o->goodput_tpot_ms >= 0 || o->goodput_e2el_ms >= 0;
    if (has_goodput) printf("%-40s %-10.2f\n", "Request goodput (req/s):", good / duration);
    printf("%-40s %-10.2f\n", "Output token throughput (tok/s):", out_tok / duration);
    printf("%-40s %-10.2f\n", "Peak output token throughput (tok/s):", peak_tok);
    printf("%-40s %-10d\n", "Peak concurrent requests:", peak_conc);
    printf("%-40s %-10.2f\n", "Total Token throughput (tok/s):", (in_tok + out_tok) / duration);
    json_object_set_new(res, "duration", json_real(duration));
    json_object_set_new(res, "completed", json_integer(ok));
    json_object_set_new(res, "failed", json_integer(n - ok));
    json_object_set_new(res, "total_input_tokens", json_integer(in_tok));
    json_object_set_new(res, "total_output_tokens", json_integer(out_tok));
    json_object_set_new(res, "request_throughput", json_real(ok / duration));
    json_object_set_new(res, "request_goodput",
                        has_goodput ? json_real(good / duration) : json_null());
    json_object_set_new(res, "output_throughput", json_real(out_tok / duration));
    json_object_set_new(res, "total_token_throughput", json_real((in_tok + out_tok) / duration));
    json_object_set_new(res, "latencies", json_incref(lats));
    json_object_set_new(res, "queue_times", json_incref(queues));
    json_object_set_new(res, "max_output_tokens_per_s", json_real(peak_tok));
    json_object_set_new(res, "max_concurrent_requests", json_integer(peak_conc));
    json_object_set_new(res, "rtfx", json_real(0));
    if (o->save_detailed) {
        json_object_set_new(res, "input_lens", json_incref(input_lens));
        json_object_set_new(res, "output_lens", json_incref(output_lens));
        json_object_set_new(res, "ttfts", json_incref(ttfts));
        json_object_set_new(res, "itls", json_incref(itls));
        json_object_set_new(res, "start_times", json_incref(starts));
        json_object_set_new(res, "generated_texts", json_incref(texts));
        json_object_set_new(res, "errors", json_incref(errors));
    }
    json_decref(input_lens);
    json_decref(output_lens);
    json_decref(ttfts);
    json_decref(itls);
    json_decref(lats);
    json_decref(starts);
    json_decref(texts);
    json_decref(errors);
    json_decref(queues);
    /* disagg's own: what was run */
    json_object_set_new(res, "dataset_name", json_string(SD_NAMES[o->ds.kind]));
    json_object_set_new(res, "endpoint", json_string(o->endpoint));
    json_object_set_new(res, "base_url", json_string(o->base_url));
    json_object_set_new(res, "pd", json_boolean(o->pd_prefill != NULL));
    int convs = 0;
    for (int i = 0; i < run->n_items; i++)
        convs += run->items[i].conv != NULL;
    if (convs) {
        json_object_set_new(res, "num_conversations", json_integer(convs));
        json_object_set_new(res, "num_requests", json_integer(n));
        sb_by_turn(run, res);
    }
    json_t *slo = has_goodput ? json_object() : json_null();
    if (o->goodput_ttft_ms >= 0) json_object_set_new(slo, "ttft", json_real(o->goodput_ttft_ms));
    if (o->goodput_tpot_ms >= 0) json_object_set_new(slo, "tpot", json_real(o->goodput_tpot_ms));
    if (o->goodput_e2el_ms >= 0) json_object_set_new(slo, "e2el", json_real(o->goodput_e2el_ms));
    json_object_set_new(res, "goodput_slo_ms", slo);
    if (o->metrics & SB_M_TTFT)
        sb_print_stat(o, "---------------Time to First Token----------------", "TTFT", "ttft",
                      sb_stats(o, ttft, ok), res);
    if (o->metrics & SB_M_TPOT)
        sb_print_stat(o, "-----Time per Output Token (excl. 1st token)------", "TPOT", "tpot",
                      sb_stats(o, tpot, n_tpot), res);
    if (o->metrics & SB_M_ITL)
        sb_print_stat(o, "---------------Inter-token Latency----------------", "ITL", "itl",
                      sb_stats(o, itl, n_itl), res);
    if (o->metrics & SB_M_E2EL)
        sb_print_stat(o, "----------------End-to-end Latency----------------", "E2EL", "e2el",
                      sb_stats(o, e2el, ok), res);
    if (o->max_concurrency > 0) { /* vLLM's client-side queueing (a slot's wait) */
        sb_print_stat(o, "--------------Client-side Queueing---------------", "Client Queue Time",
                      "client_queue_time", sb_stats(o, qt, ok), res);
        if (!isinf(o->rate))
            sb_print_stat(o, "-------Queue-inclusive End-to-end Latency--------",
                          "E2EL incl. Client Queue", "e2el_including_client_queue",
                          sb_stats(o, e2q, ok), res);
    }
    free(qt);
    free(e2q);
    if (o->pd_prefill) {
        double *pl = calloc((size_t)n + 1, sizeof(double));
        int p_ok = 0;
        for (int i = 0; i < n; i++)
            if (run->reqs[i].p_status == 200)
                pl[p_ok++] = run->reqs[i].t_p_end - run->reqs[i].t_start;
        printf("%s\n", "----------P/D (prefill instance, KV load)---------");
        printf("%-40s %-10d\n", "Prefill requests ok:", p_ok);
        sb_stat ps = sb_stats(o, pl, p_ok);
        printf("%-40s %-10.2f\n", "Mean prefill request latency (ms):", ps.mean * 1e3);
        double kv = run->kv[1] > 0 ? run->kv[0] / run->kv[1] : 0;
        double send = run->kv[3] > 0 ? run->kv[2] / run->kv[3] : 0;
        printf("%-40s %-10.2f\n", "Mean KV transfer time (P send, ms):", send * 1e3);
        printf("%-40s %-10.2f\n", "Mean KV wait on D (pull->KV, ms):", kv * 1e3);
        if (ps.mean > 0)
            printf("%-40s %-10.2f\n", "KV transfer / prefill latency (%):", 100 * send / ps.mean);
        json_object_set_new(res, "pd_prefill_ok", json_integer(p_ok));
        json_object_set_new(res, "mean_prefill_latency_ms", json_real(ps.mean * 1e3));
        json_object_set_new(res, "mean_kv_transfer_ms", json_real(send * 1e3));
        json_object_set_new(res, "mean_kv_wait_ms", json_real(kv * 1e3));
        json_object_set_new(res, "kv_loads", json_real(run->kv[1]));
        free(pl);
        if (p_ok < n && !first_err) first_err = "a prefill request failed";
    }
    printf("==================================================\n");
    if (first_err)
        fprintf(stderr, "disagg bench serve: %d request(s) failed; first error: %s\n", n - ok,
                first_err);
    int rc = 0;
    if (o->json_path && json_dump_file(res, o->json_path, JSON_INDENT(2))) {
        fprintf(stderr, "disagg bench serve: cannot write %s\n", o->json_path);
        rc = 1;
    }
    if (o->save_result) { /* vLLM's name: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json */
        char name[1024], path[2048], rate[64], conc[48] = "";
        if (isinf(o->rate))
            snprintf(rate, sizeof rate, "inf");
        else if (o->rate == floor(o->rate) && o->rate < 1e15)
            snprintf(rate, sizeof rate, "%.1f", o->rate); /* Python's str(4.0) */
        else
            snprintf(rate, sizeof rate, "%.15g", o->rate);
        if (o->max_concurrency) snprintf(conc, sizeof conc, "-concurrency%d", o->max_concurrency);
        const char *base = strrchr(o->model, '/');
        if (o->result_filename)
            snprintf(name, sizeof name, "%s", o->result_filename);
        else
            snprintf(name, sizeof name, "%s-%sqps%s-%s-%s.json", o->label ? o->label : backend,
                     rate, conc, base ? base + 1 : o->model, date);
        if (o->result_dir) {
            if (mkdir(o->result_dir, 0777) && errno != EEXIST)
                fprintf(stderr, "disagg bench serve: --result-dir %s: %s\n", o->result_dir,
                        strerror(errno));
            snprintf(path, sizeof path, "%s/%s", o->result_dir, name);
        } else
            snprintf(path, sizeof path, "%s", name);
        if (json_dump_file(res, path, JSON_INDENT(2))) {
            fprintf(stderr, "disagg bench serve: cannot write %s\n", path);
            rc = 1;
        } else
            printf("Results written to %s\n", path);
    }
    json_decref(res);
    free(ttft);
    free(tpot);
    free(e2el);
    free(itl);
    return rc ? rc : (ok == n ? 0 : 1);
}

/* ---- setup --------------------------------------------------------------------------- */

/* "http://host[:port][/...]" -> host, port. */
static int sb_url(const char *flag, const char *url, char *host, size_t cap, int *port) {
    const char *u = url;
    if (strncmp(u, "http://", 7)) {
        fprintf(stderr, "disagg bench serve: %s must start with http:// (got '%s')\n", flag, url);
        return -1;
    }
    u += 7;
    const char *colon = strchr(u, ':'), *slash = strchr(u, '/');
    if (colon && slash && slash < colon) colon = NULL;
    size_t hl = colon ? (size_t)(colon - u) : slash ? (size_t)(slash - u) : strlen(u);
    if (hl == 0 || hl >= cap) {
        fprintf(stderr, "disagg bench serve: no host in %s '%s'\n", flag, url);
        return -1;
    }
    memcpy(host, u, hl);
    host[hl] = 0;
    *port = colon ? atoi(colon + 1) : 80;
    if (*port <= 0 || *port > 65535) {
        fprintf(stderr, "disagg bench serve: bad port in %s '%s'\n", flag, url);
        return -1;
    }
    return 0;
}

static int sb_parse_url(sb_opts *o) {
    if (sb_url("--base-url", o->base_url, o->host, sizeof o->host, &o->port)) return -1;
    if (!o->pd_prefill) return 0;
    if (sb_url("--pd-prefill", o->pd_prefill, o->p_host, sizeof o->p_host, &o->p_port)) return -1;
    if (!o->pd_bootstrap) {
        snprintf(o->b_host, sizeof o->b_host, "%s", o->p_host);
        o->b_port = 8998;
        return 0;
    }
    return sb_url("--pd-bootstrap", o->pd_bootstrap, o->b_host, sizeof o->b_host, &o->b_port);
}

/* A blocking GET (its own event loop, 30 s at most): the HTTP status (0: no answer) and the
 * body in *out (malloc'ed, NUL-terminated; NULL without an answer). */
typedef struct sb_get_ctx {
    struct event_base *b; /* the loop */
    int status;           /* from the head */
    struct evbuffer *body;
    int err; /* HC_E* from on_done */
} sb_get_ctx;

static void sb_get_head(hc_req *r, const http_head *h, void *arg) {
    ((sb_get_ctx *)arg)->status = h->status;
}

static void sb_get_data(hc_req *r, struct evbuffer *in, void *arg) {
    evbuffer_add_buffer(((sb_get_ctx *)arg)->body, in);
}

static void sb_get_done(hc_req *r, int err, void *arg) {
    sb_get_ctx *g = arg;
    g->err = err;
    event_base_loopexit(g->b, NULL);
}

static int sb_http(const char *host, int port, const char *method, const char *path,
                   const char *api_key, const char *body, char **out) {
    static const hc_callbacks cb = {sb_get_head, sb_get_data, sb_get_done};
    static const hc_timeouts t = {30, 30};
    sb_get_ctx g = {event_base_new(), 0, evbuffer_new(), 0};
    hc_pool *p = g.b ? hc_pool_new(g.b, host, (uint16_t)port, 0) : NULL;
    char hdr[700] = "";
    int hn = 0;
    if (body) hn = snprintf(hdr, sizeof hdr, "Content-Type: application/json\r\n");
    if (api_key)
        snprintf(hdr + hn, sizeof hdr - (size_t)hn, "Authorization: Bearer %s\r\n", api_key);
    *out = NULL;
    if (p && g.body && hc_request(p, method, path, hdr, body, body ? strlen(body) : 0, &t, &cb, &g))
        event_base_dispatch(g.b);
    else
        g.err = HC_ECONNECT; /* out of memory */
    if (!g.err) {
        size_t n = evbuffer_get_length(g.body);
        *out = malloc(n + 1);
        if (*out) {
            evbuffer_remove(g.body, *out, n);
            (*out)[n] = 0;
        }
    }
    if (p) hc_pool_free(p);
    if (g.body) evbuffer_free(g.body);
    if (g.b) event_base_free(g.b);
    return g.err ? 0 : g.status;
}

static int sb_get(const char *host, int port, const char *path, const char *api_key, char **out) {
    return sb_http(host, port, "GET", path, api_key, NULL, out);
}

/* The token count of text by the server's POST /tokenize (sharegpt's lengths); -1 without an
 * answer. */
static int sb_count_tokens(void *ctx, const char *text) {
    const sb_opts *o = ctx;
    json_t *req = json_pack("{s:s,s:s}", "model", o->model, "prompt", text);
    char *body = req ? json_dumps(req, JSON_COMPACT) : NULL, *resp = NULL;
    json_decref(req);
    int st = body ? sb_http(o->host, o->port, "POST", "/tokenize", o->api_key, body, &resp) : 0;
    free(body);
    json_t *j = st == 200 && resp ? json_loads(resp, 0, NULL) : NULL;
    json_t *c = json_object_get(j, "count"), *t = json_object_get(j, "tokens");
    int n = json_is_integer(c) ? (int)json_integer_value(c)
            : json_is_array(t) ? (int)json_array_size(t)
                               : -1;
    json_decref(j);
    free(resp);
    return n;
}

/* P/D: P's engine id for dp rank 0, from its bootstrap server. */
static int sb_fetch_engine_id(sb_opts *o) {
    char *body = NULL;
    int st = sb_get(o->b_host, o->b_port, "/query", NULL, &body);
    json_t *j = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    const char *id = json_string_value(json_object_get(json_object_get(j, "0"), "engine_id"));
    if (id) snprintf(o->engine_id, sizeof o->engine_id, "%s", id);
    json_decref(j);
    free(body);
    if (!o->engine_id[0]) {
        fprintf(stderr,
                "disagg bench serve: GET http://%s:%d/query gave no engine for dp rank 0; is the "
                "prefill instance's bootstrap server there? (--pd-bootstrap)\n",
                o->b_host, o->b_port);
        return -1;
    }
    return 0;
}

/* A "<name>_sum" and "<name>_count" pair from a server's /metrics. */
static void sb_metric_pair(const char *host, int port, const char *api_key, const char *name,
                           double *sum, double *count) {
    char *body = NULL, key[128];
    *sum = *count = 0;
    if (sb_get(host, port, "/metrics", api_key, &body) == 200 && body) {
        snprintf(key, sizeof key, "\n%s_sum ", name);
        const char *p = strstr(body, key);
        if (p) *sum = atof(p + strlen(key));
        snprintf(key, sizeof key, "\n%s_count ", name);
        p = strstr(body, key);
        if (p) *count = atof(p + strlen(key));
    }
    free(body);
}

/* P/D counters over the run: the decoder's load time (pull sent -> KV in place,
 * which includes waiting for the prefill) and the producer's send time (KV
 * ready -> written into the decoder: the transfer itself). */
static void sb_kv_load(const sb_opts *o, double v[4]) {
    sb_metric_pair(o->host, o->port, o->api_key, "disagg:kv_load_seconds", &v[0], &v[1]);
    sb_metric_pair(o->p_host, o->p_port, o->api_key, "disagg:kv_send_seconds", &v[2], &v[3]);
}

/* GET /v1/models synchronously (before the run): the first model's id. */
static char g_model[256];
static int sb_fetch_model(const sb_opts *o) {
    char *body = NULL;
    int st = sb_get(o->host, o->port, "/v1/models", o->api_key, &body);
    json_t *j = st == 200 && body ? json_loads(body, 0, NULL) : NULL;
    const char *id =
        json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id"));
    if (id) snprintf(g_model, sizeof g_model, "%s", id);
    json_decref(j);
    free(body);
    if (!g_model[0]) {
        fprintf(
            stderr,
            "disagg bench serve: GET %s/v1/models failed; is the server up? (or pass --model)\n",
            o->base_url);
        return -1;
    }
    return 0;
}

static int sb_range_ratio(flags_parser *p, const flag_def *d, const char *v) {
    if (*(double *)d->dst < 1) return 0;
    flags_error(p, "%s must be in [0, 1), got '%s'", d->name, v);
    return -1;
}

static int sb_rate(flags_parser *p, const flag_def *d, const char *v) {
    double *rate = d->dst;
    if (!strcmp(v, "inf")) {
        *rate = INFINITY;
        return 0;
    }
    return flags_double(p, d, v, rate);
}

static int sb_goodput(flags_parser *p, const flag_def *d, const char *v) {
    sb_opts *o = d->dst;
    int any = 0;
    for (const char *g = v ? v : flags_peek(p); g && g[0] != '-'; g = flags_peek(p)) {
        if (g != v) flags_take(p);
        const char *c = strchr(g, ':');
        char *end = NULL;
        double ms = c ? strtod(c + 1, &end) : -1;
        if (!c || end == c + 1 || *end || !(ms >= 0)) {
            flags_error(p, "--goodput '%s'; accepted: ttft:MS tpot:MS e2el:MS (MS a number >= 0)",
                        g);
            return -1;
        }
        if (!strncmp(g, "ttft:", 5))
            o->goodput_ttft_ms = ms;
        else if (!strncmp(g, "tpot:", 5))
            o->goodput_tpot_ms = ms;
        else if (!strncmp(g, "e2el:", 5))
            o->goodput_e2el_ms = ms;
        else {
            flags_error(p, "--goodput '%s'; accepted keys: ttft, tpot, e2el", g);
            return -1;
        }
        any = 1;
        v = NULL;
    }
    if (!any) {
        flags_error(p, "--goodput needs KEY:MS values (ttft:MS tpot:MS e2el:MS)");
        return -1;
    }
    return 0;
}

/* --metric-percentiles "90,99": up to 8 numbers in (0, 100]. */
static int sb_percentiles(flags_parser *p, const flag_def *d, const char *v) {
    sb_opts *o = d->dst;
    o->n_pct = 0;
    for (const char *s = v; *s;) {
        char *end = NULL;
        double x = strtod(s, &end);
        if (end == s || !(x > 0 && x <= 100) || (*end && *end != ',') || o->n_pct == 8) {
            flags_error(p,
                        "--metric-percentiles '%s'; accepted: up to 8 comma-separated numbers in "
                        "(0, 100], e.g. 50,90,99",
                        v);
            return -1;
        }
        o->pct[o->n_pct++] = x;
        s = *end ? end + 1 : end;
    }
    if (!o->n_pct) {
        flags_error(p, "--metric-percentiles needs at least one number, e.g. 99");
        return -1;
    }
    return 0;
}

/* --percentile-metrics "ttft,tpot,itl,e2el": which metrics get mean/median/percentiles. */
static int sb_metrics(flags_parser *p, const flag_def *d, const char *v) {
    sb_opts *o = d->dst;
    static const char *names[] = {"ttft", "tpot", "itl", "e2el"};
    o->metrics = 0;
    for (const char *s = v; *s;) {
        size_t n = strcspn(s, ",");
        int k = 0;
        while (k < 4 && !(strlen(names[k]) == n && !strncmp(s, names[k], n)))
            k++;
        if (k == 4) {
            flags_error(p,
                        "--percentile-metrics '%s'; accepted: a comma-separated list of ttft, "
                        "tpot, itl, e2el",
                        v);
            return -1;
        }
        o->metrics |= 1 << k;
        s += n + (s[n] == ',');
    }
    if (!o->metrics) {
        flags_error(p, "--percentile-metrics needs at least one of ttft, tpot, itl, e2el");
        return -1;
    }
    return 0;
}

int bench_serve_main(int argc, char **argv) {
    sb_opts o;
    memset(&o, 0, sizeof o);
    o.base_url = "http://127.0.0.1:8000";
    o.ds.input_len = 1024;
    o.ds.output_len = 128;
    o.ds.prefix_len = 256;
    o.ds.suffix_len = 256;
    o.ds.num_prefixes = 10;
    o.ds.prefix_output_len = 128;
    o.ds.custom_output_len = 256;
    o.num_prompts = 1000;
    o.rate = INFINITY;
    o.burstiness = 1.0;
    o.pct[0] = 90;
    o.pct[1] = 99;
    o.n_pct = 2;
    o.metrics = SB_M_TTFT | SB_M_TPOT | SB_M_ITL | SB_M_E2EL;
    o.goodput_ttft_ms = o.goodput_tpot_ms = o.goodput_e2el_ms = -1;
    o.progress = isatty(2);
    const char *host = NULL;
    int port = 0, backend = -1;
    o.api_key = getenv("OPENAI_API_KEY");
    int endpoint = 0;
    const flag_def defs[] = {
        {FLAG_STRING_("--base-url", &o.base_url), .metavar = "URL",
         .help = "server (default http://127.0.0.1:8000, or from --host and --port)"},
        {FLAG_STRING_("--host", &host), .metavar = "H",
         .help = "server host when --base-url is not given (default 127.0.0.1)"},
        {FLAG_INT_("--port", &port, 1, 65535), .help = "server port (default 8000)"},
        {FLAG_CHOICE_("--backend", &backend, "openai", "vllm", "openai-chat"), .metavar = "B",
         .help = "vLLM's names for the endpoint: openai and vllm -> /v1/completions, openai-chat "
                 "-> /v1/chat/completions (default: --endpoint)"},
        {FLAG_CHOICE_("--endpoint", &endpoint, "/v1/completions", "/v1/chat/completions"),
         .metavar = "PATH",
         .help = "/v1/completions (default) or /v1/chat/completions; multi-turn conversations "
                 "always go to /v1/chat/completions"},
        {FLAG_STRING_("--model", &o.model), .metavar = "NAME",
         .help = "model name (default: the first of GET /v1/models)"},
        {FLAG_STRING_("--label", &o.label), .metavar = "TEXT",
         .help = "the run's label in the JSON (default none)"},
        {FLAG_CHOICE_("--dataset-name", &o.ds.kind, "random", "prefix_repetition", "custom",
                      "sharegpt"),
         .metavar = "NAME",
         .help = "random (default), prefix_repetition, custom (JSONL prompts or multi-turn "
                 "conversations) or sharegpt (ShareGPT JSON): as vLLM names them"},
        {FLAG_STRING_("--dataset-path", &o.ds.path), .metavar = "FILE",
         .help = "the custom or sharegpt dataset's file"},
        {FLAG_INT_("--num-prompts", &o.num_prompts, 1, 1 << 30),
         .help = "requests; conversations for a multi-turn custom file (default 1000)"},
        {FLAG_BOOL_("--disable-shuffle", &o.ds.disable_shuffle),
         .help = "keep the dataset's order (default: shuffled by --seed)"},
        {FLAG_BOOL_("--no-oversample", &o.ds.no_oversample),
         .help = "fewer prompts than --num-prompts: run those (default: repeat some, as vLLM)"},
        {FLAG_INT_("--random-input-len", &o.ds.input_len, 1, 1 << 30),
         .help = "random: prompt length in words, ~tokens (default 1024)"},
        {FLAG_INT_("--random-output-len", &o.ds.output_len, 1, 1 << 30),
         .help = "random: max_tokens (default 128)"},
        {FLAG_DOUBLE_("--random-range-ratio", &o.ds.range_ratio, 0, 1), .fn = sb_range_ratio,
         .metavar = "R", .help = "random: lengths uniform in [L(1-R), L(1+R)] (default 0)"},
        {FLAG_INT_("--prefix-repetition-prefix-len", &o.ds.prefix_len, 0, 1 << 30),
         .help = "prefix_repetition: shared prefix length in words, ~tokens (default 256)"},
        {FLAG_INT_("--prefix-repetition-suffix-len", &o.ds.suffix_len, 0, 1 << 30),
         .help = "prefix_repetition: each prompt's own suffix in words (default 256)"},
        {FLAG_INT_("--prefix-repetition-num-prefixes", &o.ds.num_prefixes, 1, 1 << 30),
         .help = "prefix_repetition: prefixes; each gets --num-prompts / N prompts (default 10)"},
        {FLAG_INT_("--prefix-repetition-output-len", &o.ds.prefix_output_len, 1, 1 << 30),
         .help = "prefix_repetition: max_tokens (default 128)"},
        {FLAG_INT_("--custom-output-len", &o.ds.custom_output_len, 1, 1 << 30),
         .help = "custom: max_tokens of every request and turn (default 256)"},
        {FLAG_INT_("--sharegpt-output-len", &o.ds.sharegpt_output_len, 1, 1 << 30),
         .help = "sharegpt: max_tokens (default: the gpt reply's token count)"},
        {FLAG_CUSTOM_("--request-rate", &o.rate, sb_rate), .lo = 1e-9, .hi = INFINITY,
         .metavar = "R",
         .help = "requests/s (conversations/s for multi-turn), Poisson arrivals (default inf: all "
                 "at once)"},
        {FLAG_DOUBLE_("--burstiness", &o.burstiness, 1e-9, INFINITY), .metavar = "B",
         .help = "gamma arrivals of shape B (default 1 = Poisson)"},
        {FLAG_INT_("--max-concurrency", &o.max_concurrency, 1, 1 << 30),
         .help = "most requests in flight (default unlimited)"},
        {FLAG_BOOL_("--ignore-eos", &o.ignore_eos),
         .help = "generate exactly max_tokens tokens (always on for the random dataset, as vLLM)"},
        {FLAG_CUSTOM_("--goodput", &o, sb_goodput), .opts = FLAG_VARARGS, .metavar = "KEY:MS ...",
         .help = "SLOs: ttft:MS tpot:MS e2el:MS"},
        {FLAG_CUSTOM_("--metric-percentiles", &o, sb_percentiles), .metavar = "P,P",
         .help = "percentiles reported (default 90,99)"},
        {FLAG_INT_("--seed", &o.seed, 0, LLONG_MAX),
         .help = "dataset and arrival seed (default 0)"},
        {FLAG_STRING_("--json", &o.json_path), .metavar = "FILE",
         .help = "write the results as JSON (vLLM's keys)"},
        {FLAG_BOOL_("--save-detailed", &o.save_detailed),
         .help = "the JSON gets per-request lists: input_lens, output_lens, ttfts, itls, "
                 "start_times, generated_texts, errors"},
        {FLAG_CUSTOM_("--percentile-metrics", &o, sb_metrics), .metavar = "M,M",
         .help = "metrics given percentiles: ttft, tpot, itl, e2el (default all four)"},
        {FLAG_DOUBLE_("--temperature", &o.temperature, 0, 2), .metavar = "T",
         .help = "sampling temperature sent (default 0: greedy; vLLM leaves it to the server)"},
        {FLAG_BOOL_("--save-result", &o.save_result),
         .help =
             "write the JSON under vLLM's file name LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json"},
        {FLAG_STRING_("--result-dir", &o.result_dir), .metavar = "DIR",
         .help = "--save-result's directory (default: the current one)"},
        {FLAG_STRING_("--result-filename", &o.result_filename), .metavar = "NAME",
         .help = "--save-result's file name instead of vLLM's"},
        {FLAG_NO_EFFECT_("--tokenizer", "token counts are the server's usage numbers"),
         .metavar = "NAME", .help = "accepted, no effect: the server counts the tokens"},
        {FLAG_NO_EFFECT_("--trust-remote-code", "no tokenizer is loaded here"), .opts = FLAG_SWITCH,
         .help = "accepted, no effect"},
        {FLAG_BOOL_("--disable-tqdm", &o.progress), .opts = FLAG_STORE_FALSE,
         .help = "no progress bar"},
        {FLAG_STRING_("--pd-prefill", &o.pd_prefill), .metavar = "URL",
         .help = "P/D: --base-url is a kv_consumer; each request also goes to this kv_producer at "
                 "the same time, as the proxy sends them (PROTOCOL.md 1); reports prefill latency "
                 "and the decoder's mean KV load time"},
        {FLAG_STRING_("--pd-bootstrap", &o.pd_bootstrap), .metavar = "URL",
         .help = "P's bootstrap server (default http://<P host>:8998)"},
        {0}};
    const flag_def *tables[] = {defs, NULL};
    const flags_spec spec = {
        .cmd = "bench serve",
        .usage = "usage: disagg bench serve [options]   (the `vllm bench serve` equivalent)\n\n",
        .epilog = "OPENAI_API_KEY, when set, is sent as the Bearer key.\n",
        .tables = tables,
        .help_col = 30};
    int pr = flags_parse(&spec, argc, argv);
    if (pr) return pr == FLAGS_HELP ? 0 : 2;
    o.endpoint = endpoint ? "/v1/chat/completions" : "/v1/completions";
    static const char *const backends[] = {"openai", "vllm", "openai-chat"};
    if (backend >= 0) o.backend = backends[backend];
    if (backend == 2) o.endpoint = "/v1/chat/completions";
    if (backend == 0 || backend == 1) o.endpoint = "/v1/completions";
    static char url_buf[300];
    if ((host || port) && !strcmp(o.base_url, "http://127.0.0.1:8000")) {
        snprintf(url_buf, sizeof url_buf, "http://%s:%d", host ? host : "127.0.0.1",
                 port ? port : 8000);
        o.base_url = url_buf;
    }
    if (o.ds.kind == SD_RANDOM) o.ignore_eos = 1; /* as vLLM: random runs to its lengths */
    if (sb_parse_url(&o)) return 2;
    if (o.pd_bootstrap && !o.pd_prefill) {
        fprintf(stderr, "disagg bench serve: --pd-bootstrap needs --pd-prefill\n");
        return 2;
    }
    int file = o.ds.kind == SD_CUSTOM || o.ds.kind == SD_SHAREGPT;
    if (file != (o.ds.path != NULL)) { /* before any request: the dataset's own message */
        char err[600];
        sd_item *none = NULL;
        int nn = 0;
        sd_load(&o.ds, &none, &nn, err, sizeof err);
        fprintf(stderr, "disagg bench serve: %s\n", err);
        return 2;
    }
    if (o.pd_prefill && sb_fetch_engine_id(&o)) return 1;
    double kv0[4] = {0, 0, 0, 0};
    if (o.pd_prefill) sb_kv_load(&o, kv0);
    if (!o.model) {
        if (sb_fetch_model(&o)) return 1;
        o.model = g_model;
    }
    g_rng = o.seed;
    sb_run run;
    memset(&run, 0, sizeof run);
    run.o = &o;
    o.ds.num_prompts = o.num_prompts;
    o.ds.rng = &g_rng;
    o.ds.count = sb_count_tokens;
    o.ds.count_ctx = &o;
    char err[600];
    if (sd_load(&o.ds, &run.items, &run.n_items, err, sizeof err)) {
        fprintf(stderr, "disagg bench serve: %s\n", err);
        return 2;
    }
    size_t n_items = run.n_items > 0 ? (size_t)run.n_items : 1, n_reqs = 0;
    for (int i = 0; i < run.n_items; i++)
        n_reqs += run.items[i].n_turns > 0 ? (size_t)run.items[i].n_turns : 0;
    if (n_reqs > INT_MAX / 2) {
        fprintf(stderr, "disagg bench serve: %zu requests; at most %d\n", n_reqs, INT_MAX / 2);
        return 2;
    }
    run.n_reqs = (int)n_reqs;
    run.convs = calloc(n_items, sizeof *run.convs);
    run.reqs = calloc(n_reqs + 1, sizeof *run.reqs);
    run.ready = calloc(n_reqs + 1, sizeof *run.ready);
    run.arrival = calloc(n_items, sizeof *run.arrival);
    if (!run.convs || !run.reqs || !run.ready || !run.arrival) {
        fprintf(stderr, "disagg bench serve: out of memory\n");
        return 1;
    }
    double t = 0;
    int k = 0, n_conv = 0;
    for (int i = 0; i < run.n_items; i++) {
        run.convs[i].first = k;
        n_conv += run.items[i].conv != NULL;
        for (int tn = 0; tn < run.items[i].n_turns; tn++, k++) {
            sb_req *q = &run.reqs[k];
            q->run = &run;
            q->index = k;
            q->item = i;
            q->turn = tn;
        }
        run.arrival[i] = t;
        if (!isinf(o.rate)) t += rng_gamma(o.burstiness) / (o.rate * o.burstiness);
    }
    if (n_conv)
        printf("Benchmark: %s dataset, %d requests (%d conversations, %d turns; each turn sent "
               "after the previous answer, on /v1/chat/completions) to %s, model %s, rate %s, "
               "max concurrency %s\n",
               SD_NAMES[o.ds.kind], run.n_reqs, n_conv, run.n_reqs - (run.n_items - n_conv),
               o.base_url, o.model, isinf(o.rate) ? "inf" : "Poisson",
               o.max_concurrency ? "set" : "unlimited");
    else
        printf("Benchmark: %s dataset, %d requests to %s%s, model %s, rate %s, max concurrency "
               "%s\n",
               SD_NAMES[o.ds.kind], run.n_reqs, o.base_url, o.endpoint, o.model,
               isinf(o.rate) ? "inf" : "Poisson", o.max_concurrency ? "set" : "unlimited");
    run.base = event_base_new();
    run.timer = run.base ? evtimer_new(run.base, sb_on_timer, &run) : NULL;
    /* max_idle 0: each request opens its own connection, as vLLM's bench does */
    run.pool = run.base ? hc_pool_new(run.base, o.host, (uint16_t)o.port, 0) : NULL;
    run.p_pool =
        run.base && o.pd_prefill ? hc_pool_new(run.base, o.p_host, (uint16_t)o.p_port, 0) : NULL;
    if (!run.timer || !run.pool || (o.pd_prefill && !run.p_pool)) {
        fprintf(stderr, "disagg bench serve: out of memory\n");
        return 1;
    }
    run.t0 = now_s();
    sb_send_due(&run);
    if (run.done < run.n_reqs) event_base_dispatch(run.base);
    double duration = now_s() - run.t0;
    if (o.pd_prefill) {
        sb_kv_load(&o, run.kv);
        for (int j = 0; j < 4; j++)
            run.kv[j] -= kv0[j];
    }
    int rc = sb_report(&run, duration);
    for (int i = 0; i < run.n_reqs; i++) {
        hc_cancel(run.reqs[i].req); /* a prefill that never answered, say */
        hc_cancel(run.reqs[i].p_req);
        free(run.reqs[i].p_body);
        free(run.reqs[i].body);
        free(run.reqs[i].itl);
        free(run.reqs[i].sse);
        free(run.reqs[i].text);
    }
    for (int i = 0; i < run.n_items; i++)
        json_decref(run.convs[i].hist);
    sd_free(run.items, run.n_items);
    hc_pool_free(run.pool);
    hc_pool_free(run.p_pool);
    event_free(run.timer);
    event_base_free(run.base);
    free(run.reqs);
    free(run.convs);
    free(run.ready);
    free(run.arrival);
    return rc;
}
