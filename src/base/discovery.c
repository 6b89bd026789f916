/* discovery — see discovery.h. */
#include "base/discovery.h"

#include "base/clock.h"
#include "base/etcd.h"
#include "base/log.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#define MOD "discovery"

/* ---- URL and options ---------------------------------------------------------------- */

void discovery_opts_default(discovery_opts *o) {
    memset(o, 0, sizeof *o);
    snprintf(o->prefix, sizeof o->prefix, "%s", DISCOVERY_DEFAULT_PREFIX);
    o->ttl_s = DISCOVERY_TTL_DEFAULT;
    o->update_s = DISCOVERY_UPDATE_DEFAULT;
    o->timeout_s = 2.0;
}

int discovery_parse_url(const char *url, discovery_opts *o, char *err, size_t errcap) {
    static const char *const accepted =
        "accepted: etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (etcds:// for TLS)";
    const char *p;
    if (!strncasecmp(url, "etcd://", 7)) {
        o->tls = 0;
        p = url + 7;
    } else if (!strncasecmp(url, "etcds://", 8)) {
        o->tls = 1;
        p = url + 8;
    } else {
        snprintf(err, errcap, "'%s' is not an etcd URL; %s", url, accepted);
        return -EINVAL;
    }
    size_t n = strcspn(p, "/");
    if (n == 0) {
        snprintf(err, errcap, "'%s' names no etcd endpoint; %s", url, accepted);
        return -EINVAL;
    }
    if (n >= sizeof o->endpoints) {
        snprintf(err, errcap, "'%s': the endpoint list is too long", url);
        return -EINVAL;
    }
    if (memchr(p, '@', n)) {
        snprintf(err, errcap,
                 "'%s': credentials do not go in the URL; use --etcd-user and "
                 "$DISAGG_ETCD_PASSWORD",
                 url);
        return -EINVAL;
    }
    /* every endpoint is checked by the client, with the same message */
    char tmp[1024];
    memcpy(tmp, p, n);
    tmp[n] = 0;
    etcd_options eo = {.endpoints = tmp};
    etcd_client *c;
    char e2[400];
    if (etcd_client_new(&eo, &c, e2, sizeof e2)) {
        snprintf(err, errcap, "'%s': %s", url, e2);
        return -EINVAL;
    }
    etcd_client_free(c);
    const char *path = p + n;
    size_t pl = strlen(path);
    while (pl > 1 && path[pl - 1] == '/')
        pl--; /* "/x/" = "/x" */
    if (pl <= 1) {
        snprintf(o->prefix, sizeof o->prefix, "%s", DISCOVERY_DEFAULT_PREFIX);
    } else {
        if (pl >= sizeof o->prefix) {
            snprintf(err, errcap, "'%s': the prefix is longer than %zu bytes", url,
                     sizeof o->prefix - 1);
            return -EINVAL;
        }
        for (size_t i = 0; i < pl; i++)
            if (!isgraph((unsigned char)path[i]) || path[i] == '?' || path[i] == '#') {
                snprintf(err, errcap,
                         "'%s': the prefix may hold printable characters other than ? and # "
                         "only",
                         url);
                return -EINVAL;
            }
        memcpy(o->prefix, path, pl);
        o->prefix[pl] = 0;
    }
    memcpy(o->endpoints, tmp, n + 1);
    snprintf(o->url, sizeof o->url, "%s", url);
    return 0;
}

int discovery_parse_ttl(const char *v, double *out, char *err, size_t errcap) {
    char *end;
    errno = 0;
    double d = v && *v ? strtod(v, &end) : NAN;
    if (!v || !*v || *end || errno || !(d >= DISCOVERY_TTL_MIN && d <= DISCOVERY_TTL_MAX)) {
        snprintf(err, errcap, "'%s' is not accepted; accepted: seconds, a number in [%g, %g]",
                 v ? v : "", DISCOVERY_TTL_MIN, DISCOVERY_TTL_MAX);
        return -EINVAL;
    }
    *out = d;
    return 0;
}

/* ---- the record --------------------------------------------------------------------- */

static const char *url_hostport(const char *url) {
    const char *s = strstr(url, "://");
    return s ? s + 3 : url;
}

int discovery_record_key(const char *prefix, const discovery_record *r, char *out, size_t cap) {
    int n = snprintf(out, cap, "%s/instances/%s/%s", prefix, r->role, url_hostport(r->url));
    return n < 0 || (size_t)n >= cap ? -ENAMETOOLONG : 0;
}

char *discovery_record_json(const discovery_record *r) {
    json_t *j =
        json_pack("{s:s,s:s,s:s,s:s,s:s,s:s,s:{s:i,s:i,s:f},s:I,s:s}", "role", r->role, "url",
                  r->url, "bootstrap", r->bootstrap, "model", r->model, "engine_id", r->engine_id,
                  "kv_layout", r->kv_layout, "load", "running", r->running, "waiting", r->waiting,
                  "kv_usage", r->kv_usage, "pid", (json_int_t)r->pid, "hostname", r->hostname);
    char *s = j ? json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(j);
    return s;
}

static void copy_str(const json_t *o, const char *key, char *out, size_t cap) {
    const char *v = json_string_value(json_object_get(o, key));
    snprintf(out, cap, "%s", v ? v : "");
}

int discovery_record_parse(const char *txt, size_t len, discovery_record *r, char *err,
                           size_t errcap) {
    memset(r, 0, sizeof *r);
    json_error_t je;
    json_t *j = json_loadb(txt, len, 0, &je);
    if (!json_is_object(j)) {
        snprintf(err, errcap, "not a JSON object (%s)", j ? "another JSON value" : je.text);
        json_decref(j);
        return -EINVAL;
    }
    copy_str(j, "role", r->role, sizeof r->role);
    copy_str(j, "url", r->url, sizeof r->url);
    copy_str(j, "bootstrap", r->bootstrap, sizeof r->bootstrap);
    copy_str(j, "model", r->model, sizeof r->model);
    copy_str(j, "engine_id", r->engine_id, sizeof r->engine_id);
    copy_str(j, "kv_layout", r->kv_layout, sizeof r->kv_layout);
    copy_str(j, "hostname", r->hostname, sizeof r->hostname);
    r->pid = (long)json_integer_value(json_object_get(j, "pid"));
    json_t *load = json_object_get(j, "load");
    r->running = (int)json_integer_value(json_object_get(load, "running"));
    r->waiting = (int)json_integer_value(json_object_get(load, "waiting"));
    r->kv_usage = json_number_value(json_object_get(load, "kv_usage"));
    json_decref(j);
    if (strcmp(r->role, "prefill") && strcmp(r->role, "decode") && strcmp(r->role, "bootstrap")) {
        snprintf(err, errcap, "role '%s' is not prefill, decode or bootstrap", r->role);
        return -EINVAL;
    }
    if (strncmp(r->url, "http://", 7) || !r->url[7]) {
        snprintf(err, errcap, "url '%s' is not http://host:port", r->url);
        return -EINVAL;
    }
    if (r->running < 0 || r->waiting < 0 || !(r->kv_usage >= 0 && r->kv_usage <= 1.5)) {
        snprintf(err, errcap, "load is out of range");
        return -EINVAL;
    }
    return 0;
}

int discovery_record_same_instance(const discovery_record *a, const discovery_record *b) {
    return !strcmp(a->role, b->role) && !strcmp(a->url, b->url) &&
           !strcmp(a->bootstrap, b->bootstrap) && !strcmp(a->model, b->model) &&
           !strcmp(a->kv_layout, b->kv_layout);
}

static int make_client(const discovery_opts *o, etcd_client **c, char *err, size_t errcap) {
    etcd_options eo = {.endpoints = o->endpoints,
                       .tls = o->tls,
                       .ca_file = o->ca_file,
                       .cert_file = o->cert_file,
                       .key_file = o->key_file,
                       .user = o->user,
                       .password = o->password,
                       .timeout_s = o->timeout_s};
    return etcd_client_new(&eo, c, err, errcap);
}

/* Sleeps up to ns, returning early once *stop is set. */
static void nap(atomic_int *stop, uint64_t ns) {
    uint64_t end = clock_now_ns() + ns;
    while (!atomic_load(stop) && clock_now_ns() < end)
        clock_sleep_ns(ns < 20000000 ? ns : 20000000);
}

/* ---- registrar ---------------------------------------------------------------------- */

struct discovery_registrar {
    discovery_opts o;        /* options (strings owned by the caller, alive until stop) */
    etcd_client *c;          /* its client */
    discovery_record rec;    /* the record (thread only) */
    char key[600];           /* its key */
    char *published;         /* the value last put, NULL before */
    discovery_refresh_fn fn; /* refresh before each publication */
    void *arg;               /* its argument */
    int64_t lease;           /* current lease, 0 when none */
    uint64_t last_keepalive; /* clock_now_ns of the last renewal */
    uint64_t last_put;       /* clock_now_ns of the last put */
    int down;                /* etcd unreachable (logged once) */
    atomic_int stop;         /* stop asked */
    pthread_t thread;        /* the loop */
};

static void reg_failed(discovery_registrar *g, const char *what) {
    if (!g->down)
        LOG_W(MOD, "%s %s: %s; retrying (the record stays until its lease expires)", what, g->key,
              etcd_client_error(g->c));
    g->down = 1;
}

static void reg_ok(discovery_registrar *g) {
    if (g->down)
        LOG_I(MOD, "etcd answers again (%s): %s re-published", etcd_client_endpoint(g->c), g->key);
    g->down = 0;
}

static void reg_turn(discovery_registrar *g) {
    uint64_t now = clock_now_ns();
    if (!g->lease) {
        if (etcd_lease_grant(g->c, (int64_t)ceil(g->o.ttl_s), &g->lease)) {
            g->lease = 0;
            reg_failed(g, "lease grant for");
            return;
        }
        g->last_keepalive = now;
        free(g->published); /* put again under the new lease */
        g->published = NULL;
    } else if (now - g->last_keepalive >= (uint64_t)(g->o.ttl_s / 3 * 1e9)) {
        int rc = etcd_lease_keepalive(g->c, g->lease, NULL);
        if (rc == -ENOENT) {
            LOG_W(MOD,
                  "the lease of %s expired (etcd was unreachable longer than the TTL, %g s); "
                  "registering again",
                  g->key, g->o.ttl_s);
            g->lease = 0;
            free(g->published);
            g->published = NULL;
            return;
        }
        if (rc) {
            reg_failed(g, "lease keepalive for");
            return;
        }
        g->last_keepalive = now;
    }
    if (g->fn(g->arg, &g->rec) != 0) return; /* not ready: nothing (new) to publish */
    char *v = discovery_record_json(&g->rec);
    if (!v) return;
    /* unchanged: nothing to send, except once a TTL (a key deleted by hand comes back) */
    if (g->published && !strcmp(v, g->published) &&
        now - g->last_put < (uint64_t)(g->o.ttl_s * 1e9)) {
        free(v);
        reg_ok(g);
        return;
    }
    if (etcd_put(g->c, g->key, v, strlen(v), g->lease)) {
        free(v);
        reg_failed(g, "put of");
        return;
    }
    if (!g->published)
        LOG_I(MOD, "registered %s %s as %s (lease %llx, TTL %g s)", g->rec.role, g->rec.url, g->key,
              (unsigned long long)g->lease, g->o.ttl_s);
    free(g->published);
    g->published = v;
    g->last_put = now;
    reg_ok(g);
}

static void *reg_main(void *arg) {
    discovery_registrar *g = arg;
    while (!atomic_load(&g->stop)) {
        reg_turn(g);
        nap(&g->stop, (uint64_t)(g->o.update_s * 1e9));
    }
    return NULL;
}

int discovery_registrar_start(const discovery_opts *o, const discovery_record *r,
                              discovery_refresh_fn fn, void *arg, discovery_registrar **out,
                              char *err, size_t errcap) {
    *out = NULL;
    discovery_registrar *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(err, errcap, "out of memory");
        return -ENOMEM;
    }
    g->o = *o;
    g->rec = *r;
    g->fn = fn;
    g->arg = arg;
    int rc = discovery_record_key(o->prefix, r, g->key, sizeof g->key);
    if (rc) {
        snprintf(err, errcap, "the etcd key of %s is too long", r->url);
        free(g);
        return rc;
    }
    if ((rc = make_client(o, &g->c, err, errcap))) {
        free(g);
        return rc;
    }
    etcd_client_set_abort(g->c, &g->stop);
    if ((rc = etcd_lease_grant(g->c, (int64_t)ceil(o->ttl_s), &g->lease))) {
        snprintf(err, errcap, "cannot register with etcd at %s: %s", o->endpoints,
                 etcd_client_error(g->c));
        etcd_client_free(g->c);
        free(g);
        return rc;
    }
    g->last_keepalive = clock_now_ns();
    if (pthread_create(&g->thread, NULL, reg_main, g)) {
        etcd_lease_revoke(g->c, g->lease);
        etcd_client_free(g->c);
        free(g);
        snprintf(err, errcap, "cannot start the registrar thread");
        return -EAGAIN;
    }
    *out = g;
    return 0;
}

void discovery_registrar_stop(discovery_registrar *g) {
    if (!g) return;
    atomic_store(&g->stop, 1);
    pthread_join(g->thread, NULL);
    etcd_client_set_abort(g->c, NULL);
    if (g->lease) {
        if (etcd_delete(g->c, g->key, 0, NULL) || etcd_lease_revoke(g->c, g->lease))
            LOG_W(MOD, "could not delete %s on stop: %s (it goes when its lease expires)", g->key,
                  etcd_client_error(g->c));
        else
            LOG_I(MOD, "deregistered %s", g->key);
    }
    etcd_client_free(g->c);
    free(g->published);
    free(g);
}

/* ---- watcher ------------------------------------------------------------------------ */

struct discovery_watcher {
    discovery_opts o;        /* options */
    etcd_client *c;          /* its client (thread only after start) */
    char prefix[300];        /* "PREFIX/instances/" */
    pthread_mutex_t mu;      /* guards the fields below */
    discovery_instance *set; /* (n, cap) current instances */
    int n, cap;              /* count and room */
    discovery_status st;     /* counters and state */
    int64_t rev;             /* next revision to watch from (thread only) */
    atomic_int stop;         /* stop asked */
    pthread_t thread;        /* the loop */
};

static int find_key(const discovery_watcher *w, const char *key) {
    for (int i = 0; i < w->n; i++)
        if (!strcmp(w->set[i].key, key)) return i;
    return -1;
}

static void remove_at(discovery_watcher *w, int i) {
    w->set[i] = w->set[--w->n];
}

/* Puts or deletes one key in the set (mutex held). */
static void apply(discovery_watcher *w, int del, const etcd_kv *kv) {
    int i = find_key(w, kv->key);
    if (del) {
        if (i >= 0) remove_at(w, i);
        return;
    }
    discovery_record r;
    char err[200];
    if (strlen(kv->key) >= sizeof w->set[0].key ||
        discovery_record_parse(kv->value, kv->value_len, &r, err, sizeof err)) {
        if (strlen(kv->key) >= sizeof w->set[0].key) snprintf(err, sizeof err, "key too long");
        w->st.bad_records++;
        LOG_W(MOD, "ignoring %s: %s", kv->key, err);
        if (i >= 0) remove_at(w, i);
        return;
    }
    if (i < 0) {
        if (w->n == w->cap) {
            int cap = w->cap ? w->cap * 2 : 16;
            discovery_instance *s = realloc(w->set, (size_t)cap * sizeof *s);
            if (!s) return;
            w->set = s;
            w->cap = cap;
        }
        i = w->n++;
        snprintf(w->set[i].key, sizeof w->set[i].key, "%s", kv->key);
    }
    w->set[i].rec = r;
}

static int on_event(void *arg, int del, const etcd_kv *kv) {
    discovery_watcher *w = arg;
    pthread_mutex_lock(&w->mu);
    apply(w, del, kv);
    w->st.events++;
    w->st.generation++;
    w->st.instances = w->n;
    pthread_mutex_unlock(&w->mu);
    return atomic_load(&w->stop);
}

/* The whole set again (after a start, a lost contact or a compaction). */
static int range_all(discovery_watcher *w) {
    etcd_kv *kvs;
    int n;
    int64_t rev;
    int rc = etcd_range_prefix(w->c, w->prefix, &kvs, &n, &rev);
    if (rc) return rc;
    pthread_mutex_lock(&w->mu);
    w->n = 0;
    for (int i = 0; i < n; i++)
        apply(w, 0, &kvs[i]);
    w->st.generation++;
    w->st.instances = w->n;
    pthread_mutex_unlock(&w->mu);
    etcd_kvs_free(kvs, n);
    w->rev = rev + 1;
    return 0;
}

static void set_connected(discovery_watcher *w, int up) {
    pthread_mutex_lock(&w->mu);
    int was = w->st.connected;
    w->st.connected = up;
    if (!up) {
        w->st.errors++;
        snprintf(w->st.last_error, sizeof w->st.last_error, "%s", etcd_client_error(w->c));
    }
    int n = w->n;
    pthread_mutex_unlock(&w->mu);
    if (was && !up)
        LOG_W(MOD, "etcd unreachable: %s; routing on the last known %d instances, reconnecting",
              etcd_client_error(w->c), n);
    else if (!was && up)
        LOG_I(MOD, "etcd reachable again (%s): %d instances", etcd_client_endpoint(w->c), n);
}

static void *watch_main(void *arg) {
    discovery_watcher *w = arg;
    int need_range = 0;
    while (!atomic_load(&w->stop)) {
        if (need_range) {
            int rc = range_all(w);
            if (rc == -ECANCELED) break;
            if (rc) {
                set_connected(w, 0);
                nap(&w->stop, 500000000ull);
                continue;
            }
            set_connected(w, 1);
            need_range = 0;
        }
        int64_t next;
        int rc = etcd_watch_prefix(w->c, w->prefix, w->rev, 5.0, on_event, w, &next);
        w->rev = next;
        if (rc == -ECANCELED) break;
        if (rc == 0) continue;
        if (rc == -ERANGE) {
            LOG_I(MOD, "%s; reading the whole set again", etcd_client_error(w->c));
        } else {
            set_connected(w, 0);
            nap(&w->stop, 500000000ull);
        }
        need_range = 1;
    }
    return NULL;
}

int discovery_watcher_start(const discovery_opts *o, discovery_watcher **out, char *err,
                            size_t errcap) {
    *out = NULL;
    discovery_watcher *w = calloc(1, sizeof *w);
    if (!w) {
        snprintf(err, errcap, "out of memory");
        return -ENOMEM;
    }
    w->o = *o;
    snprintf(w->prefix, sizeof w->prefix, "%s/instances/", o->prefix);
    pthread_mutex_init(&w->mu, NULL);
    int rc = make_client(o, &w->c, err, errcap);
    if (rc) {
        pthread_mutex_destroy(&w->mu);
        free(w);
        return rc;
    }
    etcd_client_set_abort(w->c, &w->stop);
    if ((rc = range_all(w))) {
        snprintf(err, errcap, "cannot read the instances from etcd at %s: %s", o->endpoints,
                 etcd_client_error(w->c));
        etcd_client_free(w->c);
        pthread_mutex_destroy(&w->mu);
        free(w->set);
        free(w);
        return rc;
    }
    w->st.connected = 1;
    if (pthread_create(&w->thread, NULL, watch_main, w)) {
        snprintf(err, errcap, "cannot start the watcher thread");
        etcd_client_free(w->c);
        pthread_mutex_destroy(&w->mu);
        free(w->set);
        free(w);
        return -EAGAIN;
    }
    *out = w;
    return 0;
}

void discovery_watcher_stop(discovery_watcher *w) {
    if (!w) return;
    atomic_store(&w->stop, 1);
    pthread_join(w->thread, NULL);
    etcd_client_free(w->c);
    pthread_mutex_destroy(&w->mu);
    free(w->set);
    free(w);
}

uint64_t discovery_watcher_snapshot(discovery_watcher *w, discovery_instance **list, int *n) {
    pthread_mutex_lock(&w->mu);
    *list = malloc((size_t)(w->n ? w->n : 1) * sizeof **list);
    *n = 0;
    if (*list) {
        if (w->n) memcpy(*list, w->set, (size_t)w->n * sizeof **list);
        *n = w->n;
    }
    uint64_t g = w->st.generation;
    pthread_mutex_unlock(&w->mu);
    return g;
}

void discovery_watcher_status(discovery_watcher *w, discovery_status *st) {
    pthread_mutex_lock(&w->mu);
    *st = w->st;
    pthread_mutex_unlock(&w->mu);
}
