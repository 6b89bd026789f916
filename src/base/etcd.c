/* etcd — see etcd.h. */
#include "base/etcd.h"

#include "base/clock.h"
#include "base/curl_glue.h"

#include <ctype.h>
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ETCD_BODY_MAX (64u << 20) /* largest answer accepted (a range of many keys) */

struct etcd_client {
    CURL *curl;                           /* the one handle (keeps connections alive) */
    char *endpoints[ETCD_MAX_ENDPOINTS];  /* (n) "host:port" */
    int n;                                /* endpoint count */
    int cur;                              /* endpoint to try first */
    int tls;                              /* https */
    char *ca_file, *cert_file, *key_file; /* TLS files or NULL */
    char *user, *password;                /* auth or NULL */
    char token[512];                      /* auth token, "" before authenticating */
    long timeout_ms;                      /* per request */
    atomic_int *abort_flag;               /* etcd_client_set_abort */
    char err[1024];                       /* last failure */
};

/* ---- small helpers ------------------------------------------------------------------ */

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static char *b64_encode(const void *data, size_t len) {
    const unsigned char *p = data;
    char *out = malloc(4 * ((len + 2) / 3) + 1), *o = out;
    if (!out) return NULL;
    for (size_t i = 0; i < len; i += 3) {
        unsigned v = (unsigned)p[i] << 16 | (i + 1 < len ? (unsigned)p[i + 1] << 8 : 0) |
                     (i + 2 < len ? p[i + 2] : 0);
        *o++ = B64[v >> 18 & 63];
        *o++ = B64[v >> 12 & 63];
        *o++ = i + 1 < len ? B64[v >> 6 & 63] : '=';
        *o++ = i + 2 < len ? B64[v & 63] : '=';
    }
    *o = 0;
    return out;
}

static int b64_val(int c) {
    const char *q = c ? strchr(B64, c) : NULL;
    return q ? (int)(q - B64) : -1;
}

/* Decodes s (padding optional); NULL on a bad character.  NUL-terminated. */
static char *b64_decode(const char *s, size_t *len) {
    size_t n = strlen(s);
    char *out = malloc(n / 4 * 3 + 4);
    if (!out) return NULL;
    size_t o = 0;
    unsigned acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n && s[i] != '='; i++) {
        int v = b64_val((unsigned char)s[i]);
        if (v < 0) {
            free(out);
            return NULL;
        }
        acc = acc << 6 | (unsigned)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[o++] = (char)(acc >> bits & 0xff);
        }
    }
    out[o] = 0;
    *len = o;
    return out;
}

/* An int64 the gateway wrote as "123" or 123; 0 when absent. */
static int64_t j_i64(const json_t *o, const char *key) {
    const json_t *v = json_object_get(o, key);
    if (json_is_integer(v)) return (int64_t)json_integer_value(v);
    if (json_is_string(v)) return strtoll(json_string_value(v), NULL, 10);
    return 0;
}

static int set_err(etcd_client *c, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int set_err(etcd_client *c, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    return rc;
}

void etcd_prefix_end(const char *prefix, char *out) {
    size_t n = strlen(prefix);
    memcpy(out, prefix, n + 1);
    while (n > 0) {
        unsigned char ch = (unsigned char)out[n - 1];
        if (ch < 0xff) {
            out[n - 1] = (char)(ch + 1);
            out[n] = 0;
            return;
        }
        n--; /* 0xff: carry into the previous byte */
    }
    out[0] = 0; /* every key (etcd's "\0" range end) */
}

/* ---- client ------------------------------------------------------------------------- */

static char *dup_opt(const char *s) {
    return s && *s ? strdup(s) : NULL;
}

/* "host:port": a host (name, IPv4 or [IPv6]) and a port 1..65535. */
static int valid_endpoint(const char *e, size_t n) {
    if (n == 0 || n > 300) return 0;
    const char *colon = NULL;
    for (size_t i = 0; i < n; i++)
        if (e[i] == ':') colon = e + i;
    if (!colon || colon == e || (size_t)(colon - e) + 1 >= n) return 0;
    if (e[0] == '[' ? colon[-1] != ']' : memchr(e, ':', (size_t)(colon - e)) != NULL) return 0;
    for (const char *p = e; p < colon; p++)
        if (isspace((unsigned char)*p) || *p == '/' || *p == '@') return 0;
    long port = 0;
    for (const char *p = colon + 1; p < e + n; p++) {
        if (!isdigit((unsigned char)*p)) return 0;
        port = port * 10 + (*p - '0');
        if (port > 65535) return 0;
    }
    return port >= 1;
}

int etcd_client_new(const etcd_options *o, etcd_client **out, char *err, size_t errcap) {
    *out = NULL;
    curl_glue_init();
    etcd_client *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, errcap, "out of memory");
        return -ENOMEM;
    }
    const char *s = o->endpoints ? o->endpoints : "";
    while (*s) {
        size_t n = strcspn(s, ",");
        if (!valid_endpoint(s, n) || c->n >= ETCD_MAX_ENDPOINTS) {
            if (c->n >= ETCD_MAX_ENDPOINTS)
                snprintf(err, errcap, "more than %d etcd endpoints", ETCD_MAX_ENDPOINTS);
            else
                snprintf(err, errcap,
                         "etcd endpoint '%.*s' is not accepted; accepted: host:port with a port "
                         "1..65535 ([v6]:port for IPv6), comma-separated",
                         (int)n, s);
            etcd_client_free(c);
            return -EINVAL;
        }
        c->endpoints[c->n] = strndup(s, n);
        if (!c->endpoints[c->n]) break;
        c->n++;
        s += n;
        if (*s == ',' && !*++s) {
            snprintf(err, errcap, "etcd endpoint list '%s' ends with a comma", o->endpoints);
            etcd_client_free(c);
            return -EINVAL;
        }
    }
    if (c->n == 0) {
        snprintf(err, errcap, "no etcd endpoint given; accepted: host:port[,host:port...]");
        etcd_client_free(c);
        return -EINVAL;
    }
    c->tls = o->tls;
    c->ca_file = dup_opt(o->ca_file);
    c->cert_file = dup_opt(o->cert_file);
    c->key_file = dup_opt(o->key_file);
    c->user = dup_opt(o->user);
    c->password = o->password ? strdup(o->password) : strdup("");
    c->timeout_ms = (long)((o->timeout_s > 0 ? o->timeout_s : 2.0) * 1000);
    c->curl = curl_easy_init();
    if (!c->curl || !c->password) {
        snprintf(err, errcap, "out of memory");
        etcd_client_free(c);
        return -ENOMEM;
    }
    *out = c;
    return 0;
}

void etcd_client_free(etcd_client *c) {
    if (!c) return;
    if (c->curl) curl_easy_cleanup(c->curl);
    for (int i = 0; i < c->n; i++)
        free(c->endpoints[i]);
    free(c->ca_file);
    free(c->cert_file);
    free(c->key_file);
    free(c->user);
    free(c->password);
    free(c);
}

void etcd_client_set_abort(etcd_client *c, atomic_int *flag) {
    c->abort_flag = flag;
}

const char *etcd_client_error(const etcd_client *c) {
    return c->err;
}

const char *etcd_client_endpoint(const etcd_client *c) {
    return c->endpoints[c->cur];
}

/* ---- one HTTP exchange -------------------------------------------------------------- */

typedef struct xfer {
    etcd_client *c;    /* owner */
    char *buf;         /* (len, cap) bytes received and not consumed */
    size_t len, cap;   /* fill and size */
    etcd_watch_fn fn;  /* watch: per event */
    void *arg;         /* its argument */
    int64_t *next_rev; /* watch: resume revision */
    int created;       /* watch: the create answer came */
    int stop_rc;       /* watch: why the stream was cut (0: not cut) */
} xfer;

static int xfer_append(xfer *x, const char *p, size_t n) {
    if (x->len + n + 1 > x->cap) {
        size_t cap = x->cap ? x->cap : 4096;
        while (cap < x->len + n + 1)
            cap *= 2;
        if (cap > ETCD_BODY_MAX) return -1;
        char *b = realloc(x->buf, cap);
        if (!b) return -1;
        x->buf = b;
        x->cap = cap;
    }
    memcpy(x->buf + x->len, p, n);
    x->len += n;
    x->buf[x->len] = 0;
    return 0;
}

static int parse_kv(const json_t *j, etcd_kv *kv) {
    memset(kv, 0, sizeof *kv);
    const char *k = json_string_value(json_object_get(j, "key"));
    const char *v = json_string_value(json_object_get(j, "value"));
    size_t klen;
    kv->key = b64_decode(k ? k : "", &klen);
    kv->value = b64_decode(v ? v : "", &kv->value_len);
    kv->mod_revision = j_i64(j, "mod_revision");
    kv->lease = j_i64(j, "lease");
    if (!kv->key || !kv->value) {
        free(kv->key);
        free(kv->value);
        memset(kv, 0, sizeof *kv);
        return -EPROTO;
    }
    return 0;
}

/* One watch stream message (a line of the gateway's stream). */
static int watch_message(xfer *x, const char *line, size_t n) {
    json_error_t je;
    json_t *j = json_loadb(line, n, 0, &je);
    if (!j) return set_err(x->c, -EPROTO, "etcd watch: unparsable message: %s", je.text);
    int rc = 0;
    json_t *res = json_object_get(j, "result");
    json_t *e = json_object_get(j, "error");
    if (e || !json_is_object(res)) {
        const char *m = json_string_value(json_object_get(e, "message"));
        rc = set_err(x->c, -EPROTO, "etcd watch failed: %s", m ? m : "no result in the answer");
        goto out;
    }
    if (json_is_true(json_object_get(res, "created"))) x->created = 1;
    int64_t compact = j_i64(res, "compact_revision");
    if (compact > 0) {
        rc = set_err(x->c, -ERANGE, "etcd watch: revision %lld was compacted (now %lld)",
                     (long long)*x->next_rev, (long long)compact);
        goto out;
    }
    if (json_is_true(json_object_get(res, "canceled"))) {
        const char *why = json_string_value(json_object_get(res, "cancel_reason"));
        rc = set_err(x->c, -EPROTO, "etcd canceled the watch: %s", why ? why : "no reason given");
        goto out;
    }
    int64_t hrev = j_i64(json_object_get(res, "header"), "revision");
    json_t *events = json_object_get(res, "events");
    size_t i;
    json_t *ev;
    json_array_foreach(events, i, ev) {
        etcd_kv kv;
        if (parse_kv(json_object_get(ev, "kv"), &kv)) {
            rc = set_err(x->c, -EPROTO, "etcd watch: an event with a bad key or value");
            goto out;
        }
        const char *type = json_string_value(json_object_get(ev, "type"));
        int del = type && !strcmp(type, "DELETE");
        int stop = x->fn(x->arg, del, &kv);
        if (kv.mod_revision >= *x->next_rev) *x->next_rev = kv.mod_revision + 1;
        free(kv.key);
        free(kv.value);
        if (stop) {
            rc = set_err(x->c, -ECANCELED, "watch stopped");
            goto out;
        }
    }
    /* The created answer's header revision is not a resume point: the events
     * between start_rev and it follow it, and a cut stream must replay them. */
    (void)hrev;
out:
    json_decref(j);
    return rc;
}

static size_t on_write(char *p, size_t sz, size_t nm, void *arg) {
    xfer *x = arg;
    size_t n = sz * nm;
    if (xfer_append(x, p, n)) return 0;
    if (!x->fn) return n;
    for (;;) { /* the watch stream: one JSON message per line */
        char *nl = memchr(x->buf, '\n', x->len);
        if (!nl) break;
        size_t ln = (size_t)(nl - x->buf);
        int rc = ln ? watch_message(x, x->buf, ln) : 0;
        memmove(x->buf, nl + 1, x->len - ln - 1);
        x->len -= ln + 1;
        x->buf[x->len] = 0;
        if (rc) {
            x->stop_rc = rc;
            return 0; /* cuts the transfer */
        }
    }
    return n;
}

static int on_progress(void *arg, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d) {
    xfer *x = arg;
    return x->c->abort_flag && atomic_load(x->c->abort_flag) ? 1 : 0;
}

/* POSTs body to path on endpoint ep.  Returns the curl result; *status the
 * HTTP status. */
static CURLcode post_once(etcd_client *c, int ep, const char *path, const char *body, xfer *x,
                          long timeout_ms, long *status) {
    CURL *h = c->curl;
    char url[512], auth[600];
    snprintf(url, sizeof url, "%s://%s%s", c->tls ? "https" : "http", c->endpoints[ep], path);
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, c->timeout_ms);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, x);
    curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(h, CURLOPT_XFERINFODATA, x);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    struct curl_slist *hdr = curl_slist_append(NULL, "Content-Type: application/json");
    hdr = curl_slist_append(hdr, "Expect:");
    if (c->token[0]) {
        snprintf(auth, sizeof auth, "Authorization: %s", c->token);
        hdr = curl_slist_append(hdr, auth);
    }
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    if (c->tls) {
        if (c->ca_file) curl_easy_setopt(h, CURLOPT_CAINFO, c->ca_file);
        if (c->cert_file) curl_easy_setopt(h, CURLOPT_SSLCERT, c->cert_file);
        if (c->key_file) curl_easy_setopt(h, CURLOPT_SSLKEY, c->key_file);
    }
    CURLcode rc = curl_easy_perform(h);
    *status = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, status);
    curl_slist_free_all(hdr);
    return rc;
}

static int authenticate(etcd_client *c, int ep);

/* The gateway's error object {"error","code","message"}: is it worth
 * another member (no leader, unavailable) or an auth renewal? */
enum { ANS_OK, ANS_RETRY_OTHER, ANS_REAUTH, ANS_FAIL };

static int classify(etcd_client *c, long status, json_t *j, const char *path) {
    if (status == 200 && j && !json_object_get(j, "error")) return ANS_OK;
    const char *m = json_string_value(json_object_get(j, "message"));
    if (!m) m = json_string_value(json_object_get(j, "error"));
    long code = (long)json_integer_value(json_object_get(j, "code"));
    set_err(c, -EPROTO, "etcd %s on %s answered HTTP %ld%s%s", path, c->endpoints[c->cur], status,
            m ? ": " : "", m ? m : "");
    if (m && (strstr(m, "invalid auth token") || strstr(m, "token"))) return ANS_REAUTH;
    if (code == 14 || status == 503 || (m && (strstr(m, "no leader") || strstr(m, "unavailable"))))
        return ANS_RETRY_OTHER;
    return ANS_FAIL;
}

/* POSTs a JSON request with fail-over; *ans (may be NULL) gets the answer. */
static int call(etcd_client *c, const char *path, json_t *req, json_t **ans) {
    if (ans) *ans = NULL;
    char *body = json_dumps(req, JSON_COMPACT);
    if (!body) return set_err(c, -ENOMEM, "out of memory");
    int rc = -EIO, reauthed = 0;
    char errs[900] = "";
    size_t el = 0;
    for (int k = 0; k < c->n; k++) {
        int ep = (c->cur + k) % c->n;
        if (c->user && !c->token[0] && (rc = authenticate(c, ep)) != 0) {
            if (rc == -EACCES) break;
            el += (size_t)snprintf(errs + el, el < sizeof errs ? sizeof errs - el : 0, "%s%s",
                                   el ? "; " : "", c->err);
            continue;
        }
        xfer x = {.c = c};
        long status;
        CURLcode cr = post_once(c, ep, path, body, &x, c->timeout_ms, &status);
        if (cr == CURLE_ABORTED_BY_CALLBACK) {
            free(x.buf);
            rc = set_err(c, -ECANCELED, "etcd request cancelled");
            break;
        }
        if (cr != CURLE_OK) {
            free(x.buf);
            if (el < sizeof errs)
                el += (size_t)snprintf(errs + el, sizeof errs - el, "%s%s: %s", el ? "; " : "",
                                       c->endpoints[ep], curl_easy_strerror(cr));
            rc = -EIO;
            continue;
        }
        json_t *j = x.buf ? json_loadb(x.buf, x.len, 0, NULL) : NULL;
        free(x.buf);
        int prev = c->cur;
        c->cur = ep;
        int cls = classify(c, status, j, path);
        if (cls == ANS_OK) {
            if (ans)
                *ans = j;
            else
                json_decref(j);
            free(body);
            return 0;
        }
        json_decref(j);
        if (cls == ANS_REAUTH && c->user && !reauthed) {
            reauthed = 1;
            c->token[0] = 0;
            k--; /* the same endpoint again with a new token */
            continue;
        }
        if (cls == ANS_RETRY_OTHER) {
            if (el < sizeof errs)
                el += (size_t)snprintf(errs + el, sizeof errs - el, "%s%s", el ? "; " : "", c->err);
            c->cur = prev;
            rc = -EAGAIN;
            continue;
        }
        rc = strstr(c->err, "lease not found")                                  ? -ENOENT
             : strstr(c->err, "permission") || strstr(c->err, "authentication") ? -EACCES
                                                                                : -EPROTO;
        break;
    }
    if (rc == -EIO || rc == -EAGAIN)
        set_err(c, rc, "no etcd endpoint answered (%s)", errs[0] ? errs : "no endpoint");
    free(body);
    return rc;
}

static int authenticate(etcd_client *c, int ep) {
    json_t *req = json_pack("{s:s,s:s}", "name", c->user, "password", c->password);
    char *body = req ? json_dumps(req, JSON_COMPACT) : NULL;
    json_decref(req);
    if (!body) return set_err(c, -ENOMEM, "out of memory");
    xfer x = {.c = c};
    long status;
    CURLcode cr = post_once(c, ep, "/v3/auth/authenticate", body, &x, c->timeout_ms, &status);
    free(body);
    if (cr != CURLE_OK) {
        free(x.buf);
        return set_err(c, -EIO, "%s: %s", c->endpoints[ep], curl_easy_strerror(cr));
    }
    json_t *j = x.buf ? json_loadb(x.buf, x.len, 0, NULL) : NULL;
    free(x.buf);
    const char *tok = json_string_value(json_object_get(j, "token"));
    int rc = 0;
    if (status != 200 || !tok || strlen(tok) >= sizeof c->token) {
        const char *m = json_string_value(json_object_get(j, "message"));
        rc = set_err(c,
                     status == 200 || (m && strstr(m, "authentication")) || status == 400 ||
                             status == 401
                         ? -EACCES
                         : -EIO,
                     "etcd authentication as user '%s' on %s failed: HTTP %ld%s%s", c->user,
                     c->endpoints[ep], status, m ? ": " : "", m ? m : "");
    } else {
        snprintf(c->token, sizeof c->token, "%s", tok);
    }
    json_decref(j);
    return rc;
}

/* ---- the operations ----------------------------------------------------------------- */

static json_t *jstr_b64(const void *p, size_t n) {
    char *e = b64_encode(p, n);
    json_t *j = e ? json_string(e) : NULL;
    free(e);
    return j;
}

static json_t *jint64(int64_t v) {
    char s[32];
    snprintf(s, sizeof s, "%lld", (long long)v);
    return json_string(s);
}

int etcd_lease_grant(etcd_client *c, int64_t ttl_s, int64_t *id) {
    json_t *req = json_object(), *ans;
    json_object_set_new(req, "TTL", jint64(ttl_s));
    int rc = call(c, "/v3/lease/grant", req, &ans);
    json_decref(req);
    if (rc) return rc;
    *id = j_i64(ans, "ID");
    const char *e = json_string_value(json_object_get(ans, "error"));
    json_decref(ans);
    if (*id == 0) return set_err(c, -EPROTO, "etcd lease grant: no ID in the answer%s", e ? e : "");
    return 0;
}

int etcd_lease_keepalive(etcd_client *c, int64_t id, int64_t *ttl_left) {
    json_t *req = json_object(), *ans;
    json_object_set_new(req, "ID", jint64(id));
    int rc = call(c, "/v3/lease/keepalive", req, &ans);
    json_decref(req);
    if (rc) return rc;
    int64_t ttl = j_i64(json_object_get(ans, "result"), "TTL");
    json_decref(ans);
    if (ttl_left) *ttl_left = ttl;
    if (ttl <= 0) return set_err(c, -ENOENT, "etcd lease %llx expired", (unsigned long long)id);
    return 0;
}

int etcd_lease_revoke(etcd_client *c, int64_t id) {
    json_t *req = json_object();
    json_object_set_new(req, "ID", jint64(id));
    int rc = call(c, "/v3/lease/revoke", req, NULL);
    json_decref(req);
    return rc;
}

int etcd_put(etcd_client *c, const char *key, const char *value, size_t len, int64_t lease) {
    json_t *req = json_object();
    json_object_set_new(req, "key", jstr_b64(key, strlen(key)));
    json_object_set_new(req, "value", jstr_b64(value, len));
    if (lease) json_object_set_new(req, "lease", jint64(lease));
    int rc = call(c, "/v3/kv/put", req, NULL);
    json_decref(req);
    return rc;
}

int etcd_delete(etcd_client *c, const char *key, int prefix, int64_t *deleted) {
    json_t *req = json_object(), *ans;
    json_object_set_new(req, "key", jstr_b64(key, strlen(key)));
    char *end = NULL;
    if (prefix) {
        end = malloc(strlen(key) + 1);
        if (!end) {
            json_decref(req);
            return set_err(c, -ENOMEM, "out of memory");
        }
        etcd_prefix_end(key, end);
        json_object_set_new(req, "range_end", jstr_b64(end, strlen(end)));
    }
    int rc = call(c, "/v3/kv/deleterange", req, &ans);
    json_decref(req);
    free(end);
    if (rc) return rc;
    if (deleted) *deleted = j_i64(ans, "deleted");
    json_decref(ans);
    return 0;
}

void etcd_kvs_free(etcd_kv *kvs, int n) {
    for (int i = 0; i < n; i++) {
        free(kvs[i].key);
        free(kvs[i].value);
    }
    free(kvs);
}

int etcd_range_prefix(etcd_client *c, const char *prefix, etcd_kv **kvs, int *n,
                      int64_t *revision) {
    *kvs = NULL;
    *n = 0;
    char *end = malloc(strlen(prefix) + 1);
    if (!end) return set_err(c, -ENOMEM, "out of memory");
    etcd_prefix_end(prefix, end);
    json_t *req = json_object(), *ans;
    json_object_set_new(req, "key", jstr_b64(prefix, strlen(prefix)));
    json_object_set_new(req, "range_end", jstr_b64(end, strlen(end)));
    free(end);
    int rc = call(c, "/v3/kv/range", req, &ans);
    json_decref(req);
    if (rc) return rc;
    json_t *arr = json_object_get(ans, "kvs");
    size_t cnt = json_array_size(arr);
    etcd_kv *out = calloc(cnt ? cnt : 1, sizeof *out);
    if (!out) {
        json_decref(ans);
        return set_err(c, -ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < cnt; i++)
        if (parse_kv(json_array_get(arr, i), &out[i])) {
            etcd_kvs_free(out, (int)i);
            json_decref(ans);
            return set_err(c, -EPROTO, "etcd range: a key or value is not base64");
        }
    if (revision) *revision = j_i64(json_object_get(ans, "header"), "revision");
    json_decref(ans);
    *kvs = out;
    *n = (int)cnt;
    return 0;
}

int etcd_watch_prefix(etcd_client *c, const char *prefix, int64_t start_rev, double max_s,
                      etcd_watch_fn fn, void *arg, int64_t *next_rev) {
    *next_rev = start_rev;
    char *end = malloc(strlen(prefix) + 1);
    if (!end) return set_err(c, -ENOMEM, "out of memory");
    etcd_prefix_end(prefix, end);
    json_t *cr = json_object();
    json_object_set_new(cr, "key", jstr_b64(prefix, strlen(prefix)));
    json_object_set_new(cr, "range_end", jstr_b64(end, strlen(end)));
    json_object_set_new(cr, "start_revision", jint64(start_rev));
    free(end);
    json_t *req = json_pack("{s:o}", "create_request", cr);
    char *body = req ? json_dumps(req, JSON_COMPACT) : NULL;
    json_decref(req);
    if (!body) return set_err(c, -ENOMEM, "out of memory");
    int rc = -EIO;
    char errs[700] = "";
    size_t el = 0;
    for (int k = 0; k < c->n; k++) {
        int ep = (c->cur + k) % c->n;
        if (c->user && !c->token[0] && (rc = authenticate(c, ep)) != 0) {
            if (rc == -EACCES) break;
            continue;
        }
        xfer x = {.c = c, .fn = fn, .arg = arg, .next_rev = next_rev};
        long status;
        CURLcode res = post_once(c, ep, "/v3/watch", body, &x, (long)(max_s * 1000), &status);
        char *rest = x.buf;
        int created = x.created;
        if (x.stop_rc) {
            rc = x.stop_rc;
            free(rest);
            if (rc == -EPROTO && strstr(c->err, "token") && c->user) {
                c->token[0] = 0; /* a token that expired: authenticate again next time */
                rc = -EAGAIN;
            }
            break;
        }
        if (res == CURLE_ABORTED_BY_CALLBACK) {
            free(rest);
            rc = set_err(c, -ECANCELED, "etcd watch cancelled");
            break;
        }
        if (res == CURLE_OPERATION_TIMEDOUT && created) { /* the normal end of a watch turn */
            free(rest);
            c->cur = ep;
            rc = 0;
            break;
        }
        if (res == CURLE_OK && status != 200) {
            json_t *j = rest ? json_loadb(rest, x.len, 0, NULL) : NULL;
            c->cur = ep;
            int cls = classify(c, status, j, "/v3/watch");
            json_decref(j);
            free(rest);
            if (cls == ANS_REAUTH && c->user) c->token[0] = 0;
            if (cls == ANS_RETRY_OTHER || cls == ANS_REAUTH) {
                rc = -EAGAIN;
                continue;
            }
            rc = -EPROTO;
            break;
        }
        free(rest);
        if (created) c->cur = ep;
        if (el < sizeof errs)
            el += (size_t)snprintf(
                errs + el, sizeof errs - el, "%s%s: %s", el ? "; " : "", c->endpoints[ep],
                res == CURLE_OK ? "the watch stream ended" : curl_easy_strerror(res));
        rc = -EIO;
        if (created) break; /* it was watching: the caller ranges again */
    }
    if (rc == -EIO || rc == -EAGAIN)
        set_err(c, rc, "etcd watch: no endpoint could be watched (%s)",
                errs[0] ? errs : "no endpoint");
    free(body);
    return rc;
}
