/* bootstrap_client — see bootstrap_client.h.  Parts: URL building, one HTTP
 * attempt, the retry loop, /query table parsing. */
#include "connector/mooncake/bootstrap_client.h"
#include "connector/mooncake/bootstrap_server.h"

#include "base/auth.h"
#include "base/curl_glue.h"
#include "base/log.h"
#include "base/net.h"

#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MOD          "bootstrap"
#define MAX_RESPONSE (16u << 20)
#define MAX_RANK     BOOTSTRAP_MAX_RANK

void bootstrap_retry_init(bootstrap_retry *r, double timeout_s) {
    memset(r, 0, sizeof *r);
    r->attempts = 3;
    r->timeout_s = timeout_s > 0 ? timeout_s : 30.0;
    r->backoff_s = 1.0;
    r->backoff_max_s = 10.0;
}

/* "http://host:port" + path into url; server may already be a URL. */
static int build_url(const char *server, const char *path, char *url, size_t cap, char *err,
                     size_t err_cap) {
    const char *hp = server ? server : "";
    if (strncmp(hp, "http://", 7) == 0) hp += 7;
    char host[256];
    uint16_t port = 0;
    size_t n = strlen(hp);
    char tmp[300];
    if (n >= sizeof tmp) n = sizeof tmp - 1;
    memcpy(tmp, hp, n);
    tmp[n] = '\0';
    if (n && tmp[n - 1] == '/') tmp[n - 1] = '\0';
    if (net_split_host_port(tmp, host, sizeof host, &port, 0) != 0 || !host[0]) {
        snprintf(err, err_cap,
                 "bootstrap server address '%s' is not accepted; accepted: \"host:port\" or "
                 "\"http://host:port\" (port 1..65535)",
                 server ? server : "(null)");
        return BOOTSTRAP_EINVAL;
    }
    int v6 = strchr(host, ':') != NULL;
    snprintf(url, cap, "http://%s%s%s:%u%s", v6 ? "[" : "", host, v6 ? "]" : "", (unsigned)port,
             path);
    return 0;
}

typedef struct resp_buf {
    char *data; /* (len) body, NUL-terminated */
    size_t len;
    int overflow; /* body exceeded MAX_RESPONSE */
} resp_buf;

static size_t on_body(char *ptr, size_t size, size_t nmemb, void *ud) {
    resp_buf *b = ud;
    size_t n = size * nmemb;
    if (b->len + n > MAX_RESPONSE) {
        b->overflow = 1;
        return 0;
    }
    char *nd = realloc(b->data, b->len + n + 1);
    if (!nd) return 0;
    memcpy(nd + b->len, ptr, n);
    b->data = nd;
    b->len += n;
    b->data[b->len] = '\0';
    return n;
}

static int retryable(CURLcode c) {
    switch (c) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_GOT_NOTHING:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_PARTIAL_FILE:
        return 1;
    default:
        return 0;
    }
}

int bootstrap_auth_header(const char *secret, long long ts, const char *body, size_t len, char *out,
                          size_t cap) {
    if (!secret || !secret[0] || !body) return BOOTSTRAP_EINVAL;
    char tss[32];
    snprintf(tss, sizeof tss, "%lld", ts);
    const void *parts[4] = {BOOTSTRAP_AUTH_LABEL "\n", tss, "\n", body};
    size_t lens[4] = {strlen(BOOTSTRAP_AUTH_LABEL) + 1, strlen(tss), 1, len};
    uint8_t mac[AUTH_MAC_LEN];
    char hex[2 * AUTH_MAC_LEN + 1];
    if (auth_hmacv(secret, strlen(secret), parts, lens, 4, mac) != 0) return BOOTSTRAP_EINVAL;
    auth_hex(mac, sizeof mac, hex);
    int n = snprintf(out, cap, "%s: v1 ts=%s mac=%s", BOOTSTRAP_AUTH_HEADER, tss, hex);
    return n > 0 && (size_t)n < cap ? 0 : BOOTSTRAP_EINVAL;
}

/* One attempt.  Returns the CURLcode; *status = HTTP status when CURLE_OK.
 * secret: sign the POST body (a fresh timestamp per attempt). */
static CURLcode attempt(const char *url, const char *post_body, const char *secret,
                        double timeout_s, long *status, resp_buf *body) {
    long ms = (long)(timeout_s * 1000.0);
    if (ms < 1) ms = 1;
    /* a kept handle: D's lookup per request reuses its connection to the producer's
     * bootstrap server (no TCP handshake; the server keeps connections alive) */
    CURL *h = curl_glue_take(url, ms, ms);
    if (!h) return CURLE_OUT_OF_MEMORY;
    struct curl_slist *hdr = NULL;
    curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, body);
    if (post_body) {
        hdr = curl_slist_append(hdr, "Content-Type: application/json");
        char auth[160];
        if (secret && bootstrap_auth_header(secret, (long long)time(NULL), post_body,
                                            strlen(post_body), auth, sizeof auth) == 0)
            hdr = curl_slist_append(hdr, auth);
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, post_body);
    }
    CURLcode c = curl_easy_perform(h);
    if (c == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, status);
    curl_slist_free_all(hdr);
    curl_glue_give(h);
    return c;
}

static void real_sleep(double s, void *ud) {
    (void)ud;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* The retry loop.  On 0, *body holds a 200 answer (caller frees body->data). */
static int request(const char *what, const char *server, const char *path, const char *post_body,
                   const char *secret, const bootstrap_retry *retry, resp_buf *body, char *err,
                   size_t err_cap) {
    memset(body, 0, sizeof *body);
    curl_glue_init();
    bootstrap_retry def;
    if (!retry) {
        bootstrap_retry_init(&def, 30.0);
        retry = &def;
    }
    char url[400];
    int rc = build_url(server, path, url, sizeof url, err, err_cap);
    if (rc) return rc;
    int attempts = retry->attempts > 0 ? retry->attempts : 1;
    double backoff = retry->backoff_s;
    CURLcode last = CURLE_OK;
    for (int a = 1; a <= attempts; a++) {
        memset(body, 0, sizeof *body);
        long status = 0;
        last = attempt(url, post_body, secret, retry->timeout_s, &status, body);
        if (last == CURLE_OK) {
            if (status == 200) return 0;
            /* an answer: not retried */
            const char *detail = body->data ? body->data : "";
            if (status == 401 || status == 403) {
                snprintf(err, err_cap,
                         "bootstrap %s at %s refused our authentication (HTTP %ld): %.400s%s", what,
                         url, status, detail,
                         secret ? ""
                                : " -- this instance has no auth_secret; set "
                                  "kv_connector_extra_config.auth_secret or "
                                  "DISAGG_KV_SECRET to the bootstrap server's secret");
                free(body->data);
                body->data = NULL;
                return BOOTSTRAP_EAUTH;
            }
            snprintf(err, err_cap, "bootstrap %s at %s: HTTP %ld: %.400s", what, url, status,
                     detail);
            free(body->data);
            body->data = NULL;
            return BOOTSTRAP_EHTTP;
        }
        free(body->data);
        body->data = NULL;
        if (body->overflow) {
            snprintf(err, err_cap, "bootstrap %s at %s: answer larger than %u bytes", what, url,
                     MAX_RESPONSE);
            return BOOTSTRAP_EINVAL;
        }
        if (!retryable(last)) {
            snprintf(err, err_cap, "bootstrap %s at %s failed: %s", what, url,
                     curl_easy_strerror(last));
            return last == CURLE_OUT_OF_MEMORY ? BOOTSTRAP_ENOMEM : BOOTSTRAP_EINVAL;
        }
        if (a < attempts) {
            LOG_W(MOD, "bootstrap %s at %s: attempt %d/%d failed (%s); retrying in %.1f s", what,
                  url, a, attempts, curl_easy_strerror(last), backoff);
            (retry->sleep_fn ? retry->sleep_fn : real_sleep)(backoff, retry->sleep_ud);
            backoff *= 2;
            if (backoff > retry->backoff_max_s) backoff = retry->backoff_max_s;
        }
    }
    snprintf(err, err_cap,
             "bootstrap %s at %s failed after %d attempts (timeout %.1f s each, "
             "VLLM_MOONCAKE_CONNECTOR_TIMEOUT): %s; is the bootstrap server (prefill instance "
             "rank 0 or `disagg bootstrap`) running and reachable?",
             what, url, attempts, retry->timeout_s, curl_easy_strerror(last));
    return BOOTSTRAP_EUNREACH;
}

int bootstrap_client_register(const char *server, const bootstrap_registration *reg,
                              const bootstrap_retry *retry, char *err, size_t err_cap) {
    return bootstrap_client_register_auth(server, reg, NULL, retry, err, err_cap);
}

int bootstrap_client_register_auth(const char *server, const bootstrap_registration *reg,
                                   const char *secret, const bootstrap_retry *retry, char *err,
                                   size_t err_cap) {
    if (secret && !secret[0]) secret = NULL;
    if (!reg || !reg->engine_id || !reg->addr) {
        snprintf(err, err_cap, "bootstrap register: engine_id and addr are required");
        return BOOTSTRAP_EINVAL;
    }
    json_t *j =
        json_pack("{s:s,s:i,s:i,s:i,s:s}", "engine_id", reg->engine_id, "dp_rank", reg->dp_rank,
                  "tp_rank", reg->tp_rank, "pp_rank", reg->pp_rank, "addr", reg->addr);
    char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!text) return BOOTSTRAP_ENOMEM;
    resp_buf body;
    int rc = request("register", server, "/register", text, secret, retry, &body, err, err_cap);
    free(text);
    free(body.data);
    if (rc == 0)
        LOG_I(MOD, "registered engine_id=%s dp=%d tp=%d pp=%d addr=%s at %s", reg->engine_id,
              reg->dp_rank, reg->tp_rank, reg->pp_rank, reg->addr, server);
    return rc;
}

int bootstrap_client_query(const char *server, const bootstrap_retry *retry, bootstrap_table *out,
                           char *err, size_t err_cap) {
    memset(out, 0, sizeof *out);
    resp_buf body;
    int rc = request("query", server, "/query", NULL, NULL, retry, &body, err, err_cap);
    if (rc) return rc;
    rc = bootstrap_table_parse(body.data ? body.data : "", body.len, out, err, err_cap);
    free(body.data);
    return rc;
}

/* ---- table ------------------------------------------------------------------ */

/* Decimal rank key "0".."4096" (no sign, no leading zeros). */
static int parse_rank_key(const char *k) {
    if (!k[0] || strlen(k) > 4 || (k[0] == '0' && k[1])) return -1;
    int v = 0;
    for (const char *p = k; *p; p++) {
        if (*p < '0' || *p > '9') return -1;
        v = v * 10 + (*p - '0');
    }
    return v <= MAX_RANK ? v : -1;
}

static int cmp_engine(const void *a, const void *b) {
    const bootstrap_engine *x = a, *y = b;
    return (x->dp_rank > y->dp_rank) - (x->dp_rank < y->dp_rank);
}

static int parse_engine(const char *dpk, json_t *ev, bootstrap_engine *e, char *err, size_t cap) {
    e->dp_rank = parse_rank_key(dpk);
    json_t *id = json_object_get(ev, "engine_id");
    json_t *wa = json_object_get(ev, "worker_addr");
    if (e->dp_rank < 0 || !json_is_object(ev) || !json_is_string(id) || !json_is_object(wa)) {
        snprintf(err, cap,
                 "bootstrap query: entry '%.40s' is not {\"engine_id\": str, \"worker_addr\": "
                 "{tp: {pp: addr}}} under a dp_rank key",
                 dpk);
        return BOOTSTRAP_EINVAL;
    }
    e->engine_id = strdup(json_string_value(id));
    if (!e->engine_id) return BOOTSTRAP_ENOMEM;
    const char *tpk, *ppk;
    json_t *tpv, *ppv;
    /* sizes first, then fill */
    json_object_foreach(wa, tpk, tpv) {
        int tp = parse_rank_key(tpk);
        if (tp < 0 || !json_is_object(tpv)) {
            snprintf(err, cap, "bootstrap query: dp %s: bad tp_rank entry '%.40s'", dpk, tpk);
            return BOOTSTRAP_EINVAL;
        }
        if (tp + 1 > e->tp_size) e->tp_size = tp + 1;
        json_object_foreach(tpv, ppk, ppv) {
            int pp = parse_rank_key(ppk);
            if (pp < 0 || !json_is_string(ppv)) {
                snprintf(err, cap, "bootstrap query: dp %s tp %s: bad pp_rank entry '%.40s'", dpk,
                         tpk, ppk);
                return BOOTSTRAP_EINVAL;
            }
            if (pp + 1 > e->pp_size) e->pp_size = pp + 1;
        }
    }
    size_t slots = (size_t)e->tp_size * (size_t)e->pp_size;
    if (slots > BOOTSTRAP_MAX_GRID) {
        snprintf(err, cap, "bootstrap query: dp %s: %d x %d workers is too many", dpk, e->tp_size,
                 e->pp_size);
        return BOOTSTRAP_EINVAL;
    }
    e->addr = calloc(slots ? slots : 1, sizeof *e->addr);
    if (!e->addr) return BOOTSTRAP_ENOMEM;
    json_object_foreach(wa, tpk, tpv) {
        int tp = parse_rank_key(tpk);
        json_object_foreach(tpv, ppk, ppv) {
            int pp = parse_rank_key(ppk);
            char **slot = &e->addr[(size_t)tp * (size_t)e->pp_size + (size_t)pp];
            if (!*slot && !(*slot = strdup(json_string_value(ppv)))) return BOOTSTRAP_ENOMEM;
        }
    }
    return 0;
}

int bootstrap_table_parse(const char *text, size_t len, bootstrap_table *out, char *err,
                          size_t err_cap) {
    memset(out, 0, sizeof *out);
    json_error_t jerr;
    json_t *root = json_loadb(text, len, 0, &jerr);
    if (!root || !json_is_object(root)) {
        snprintf(err, err_cap, "bootstrap query: answer is not a JSON object: %s",
                 root ? "another JSON type" : jerr.text);
        json_decref(root);
        return BOOTSTRAP_EINVAL;
    }
    size_t n = json_object_size(root);
    out->engines = calloc(n ? n : 1, sizeof *out->engines);
    if (!out->engines) {
        json_decref(root);
        return BOOTSTRAP_ENOMEM;
    }
    const char *k;
    json_t *v;
    int rc = 0;
    json_object_foreach(root, k, v) {
        rc = parse_engine(k, v, &out->engines[out->n], err, err_cap);
        out->n++;
        if (rc) break;
    }
    json_decref(root);
    if (rc) {
        bootstrap_table_free(out);
        return rc;
    }
    qsort(out->engines, out->n, sizeof *out->engines, cmp_engine);
    return 0;
}

const bootstrap_engine *bootstrap_table_find(const bootstrap_table *t, int dp_rank) {
    for (size_t i = 0; i < t->n; i++)
        if (t->engines[i].dp_rank == dp_rank) return &t->engines[i];
    return NULL;
}

const char *bootstrap_engine_addr(const bootstrap_engine *e, int tp_rank, int pp_rank) {
    if (!e || tp_rank < 0 || pp_rank < 0 || tp_rank >= e->tp_size || pp_rank >= e->pp_size)
        return NULL;
    return e->addr[(size_t)tp_rank * (size_t)e->pp_size + (size_t)pp_rank];
}

void bootstrap_table_free(bootstrap_table *t) {
    if (!t) return;
    for (size_t i = 0; i < t->n; i++) {
        bootstrap_engine *e = &t->engines[i];
        if (e->addr)
            for (size_t j = 0; j < (size_t)e->tp_size * (size_t)e->pp_size; j++)
                free(e->addr[j]);
        free(e->addr);
        free(e->engine_id);
    }
    free(t->engines);
    memset(t, 0, sizeof *t);
}
