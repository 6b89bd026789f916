/* upstream — see upstream.h. */
#include "proxy/upstream.h"

#include "base/log.h"
#include "proxy/kv_index.h"
#include "proxy/kv_subscriber.h"

#include <ctype.h>
#include <errno.h>
#include <event2/buffer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MOD "proxy"

const char *upstream_role_name(upstream_role r) {
    return r == UPSTREAM_PREFILL ? "prefill" : "decode";
}

int upstream_parse_url(const char *url, char *host, size_t host_cap, uint16_t *port, char *err,
                       size_t errcap) {
    const char *p = url;
    if (!strncasecmp(p, "https://", 8)) {
        snprintf(err, errcap, "'%s': https is not supported; use http://host:port", url);
        return -EINVAL;
    }
    if (!strncasecmp(p, "http://", 7)) p += 7;
    size_t n = strcspn(p, "/");
    if (p[n] && strcmp(p + n, "/") != 0) {
        snprintf(err, errcap, "'%s': a path is not accepted; give http://host:port", url);
        return -EINVAL;
    }
    char hp[300];
    if (n == 0 || n >= sizeof hp) {
        snprintf(err, errcap, "'%s' is not an http://host:port address", url);
        return -EINVAL;
    }
    memcpy(hp, p, n);
    hp[n] = 0;
    const char *colon = hp[0] == '[' ? strstr(hp, "]:") : strrchr(hp, ':');
    if (hp[0] == '[' && colon) colon++;
    if (!colon || (hp[0] != '[' && strchr(hp, ':') != colon)) {
        if (hp[0] == '[' || strchr(hp, ':')) {
            snprintf(err, errcap, "'%s': malformed host:port", url);
            return -EINVAL;
        }
        if (strlen(hp) >= host_cap) return -EINVAL;
        strcpy(host, hp);
        *port = 80;
        return 0;
    }
    char *end;
    long v = strtol(colon + 1, &end, 10);
    if (!isdigit((unsigned char)colon[1]) || *end || v < 1 || v > 65535) {
        snprintf(err, errcap, "'%s': port '%s' is not 1..65535", url, colon + 1);
        return -EINVAL;
    }
    size_t hl = (size_t)(colon - hp);
    const char *h = hp;
    if (hp[0] == '[') {
        h = hp + 1;
        hl -= 2;
    }
    if (hl == 0 || hl >= host_cap) {
        snprintf(err, errcap, "'%s': missing or too long host", url);
        return -EINVAL;
    }
    memcpy(host, h, hl);
    host[hl] = 0;
    *port = (uint16_t)v;
    return 0;
}

int upstream_parse_bootstrap(const char *url, const char *api_host, const char *bootstrap,
                             char *host, size_t host_cap, uint16_t *port, char *err,
                             size_t errcap) {
    snprintf(host, host_cap, "%s", api_host);
    *port = UPSTREAM_DEFAULT_BOOTSTRAP_PORT;
    /* vLLM's MooncakeConnector proxy: "none" (any case) = the default port */
    if (!bootstrap || !strcasecmp(bootstrap, "none")) return 0;
    const char *q = bootstrap;
    while (isdigit((unsigned char)*q))
        q++;
    if (*bootstrap && !*q) {
        long v = strtol(bootstrap, NULL, 10);
        if (v < 1 || v > 65535 || q - bootstrap > 5) {
            snprintf(err, errcap, "bootstrap port '%s' of %s is not 1..65535", bootstrap, url);
            return -EINVAL;
        }
        *port = (uint16_t)v;
        return 0;
    }
    if (!strchr(bootstrap, ':')) {
        snprintf(err, errcap,
                 "bootstrap '%s' of %s is not accepted: give a port number, 'none' (the default "
                 "port %d), host:port or http://host:port",
                 bootstrap, url, UPSTREAM_DEFAULT_BOOTSTRAP_PORT);
        return -EINVAL;
    }
    return upstream_parse_url(bootstrap, host, host_cap, port, err, errcap);
}

static void format_url(char *out, size_t cap, const char *host, uint16_t port) {
    int v6 = strchr(host, ':') != NULL;
    snprintf(out, cap, "http://%s%s%s:%u", v6 ? "[" : "", host, v6 ? "]" : "", port);
}

int upstream_init(upstream *b, upstream_role role, int index, const char *url,
                  const char *bootstrap, const upstream_env *env, char *err, size_t errcap) {
    memset(b, 0, sizeof *b);
    b->role = role;
    b->index = index;
    b->env = env;
    b->active = 1;
    int rc = upstream_parse_url(url, b->host, sizeof b->host, &b->port, err, errcap);
    if (rc) return rc;
    format_url(b->url, sizeof b->url, b->host, b->port);
    if (role == UPSTREAM_PREFILL) {
        rc = upstream_parse_bootstrap(url, b->host, bootstrap, b->bootstrap_host,
                                      sizeof b->bootstrap_host, &b->bootstrap_port, err, errcap);
        if (rc) return rc;
        format_url(b->bootstrap_url, sizeof b->bootstrap_url, b->bootstrap_host, b->bootstrap_port);
        b->bootstrap_pool = hc_pool_new(env->base, b->bootstrap_host, b->bootstrap_port, 2);
        if (b->bootstrap_pool) hc_pool_set_keepalive(b->bootstrap_pool, env->pool_keepalive_s);
    }
    b->pool = hc_pool_new(env->base, b->host, b->port, 1024);
    if (b->pool) hc_pool_set_keepalive(b->pool, env->pool_keepalive_s);
    b->probe_body = evbuffer_new();
    if (!b->pool || !b->probe_body || (role == UPSTREAM_PREFILL && !b->bootstrap_pool)) {
        snprintf(err, errcap, "out of memory");
        return -ENOMEM;
    }
    snprintf(b->last_error, sizeof b->last_error, "waiting for its first health probe");
    return 0;
}

void upstream_free(upstream *b) {
    if (b->refresh_state && b->env && b->env->on_table) b->env->on_table(b, 0, b->env->cb_arg);
    hc_cancel(b->probe);
    b->probe = NULL;
    hc_pool_free(b->pool);
    hc_pool_free(b->bootstrap_pool);
    if (b->probe_body) evbuffer_free(b->probe_body);
    pd_engines_free(b->engines, b->nengines);
    kv_subscriber_free(b->kvsub);
    kv_index_free(b->kv);
    memset(b, 0, sizeof *b);
}

static void set_state(upstream *b, int healthy, int ready, const char *why) {
    if (why) snprintf(b->last_error, sizeof b->last_error, "%s", why);
    if (b->ready != ready) {
        b->transitions++;
        if (ready)
            LOG_I(MOD, "%s %s is ready%s", upstream_role_name(b->role), b->url,
                  b->ever_ready ? " again: back in rotation" : "");
        else
            LOG_W(MOD, "%s %s taken out of rotation: %s", upstream_role_name(b->role), b->url,
                  b->last_error);
    }
    b->healthy = healthy;
    b->ready = ready;
    if (ready) b->ever_ready = 1;
}

void upstream_mark_down(upstream *b, const char *why) {
    if (b->role == UPSTREAM_PREFILL) {
        pd_engines_free(b->engines, b->nengines);
        b->engines = NULL;
        b->nengines = 0;
    }
    set_state(b, 0, 0, why);
}

static void probe_head(hc_req *r, const http_head *h, void *arg) {
    upstream *b = arg;
    b->probe_status = h->status;
}

static void probe_data(hc_req *r, struct evbuffer *data, void *arg) {
    upstream *b = arg;
    if (evbuffer_get_length(b->probe_body) < (1u << 20)) evbuffer_add_buffer(b->probe_body, data);
}

static void probe_start(upstream *b, int stage);

/* A table re-read asked by upstream_refresh_table ended (ok: the table was read). */
static void refresh_ended(upstream *b, int ok) {
    b->refresh_state = 0;
    if (b->env->on_table) b->env->on_table(b, ok, b->env->cb_arg);
}

/* Starts GET /query; a wanted re-read that cannot start ends as failed. */
static void start_query(upstream *b) {
    probe_start(b, 1);
    if (!b->probe && b->refresh_state == 2) refresh_ended(b, 0);
}

/* The /query answer of b (len bytes at txt): the new table, or why it is not one. */
static int take_table(upstream *b, const char *txt, size_t len, int refresh, char *why,
                      size_t whycap) {
    pd_engine *rows;
    int n;
    char perr[300];
    int rc = pd_parse_query(txt ? txt : "", len, &rows, &n, perr, sizeof perr);
    if (rc) {
        snprintf(why, whycap, "%s/query: %s", b->bootstrap_url, perr);
        return rc;
    }
    pd_engines_free(b->engines, b->nengines);
    b->engines = rows;
    b->nengines = n;
    char seen[sizeof b->engines_seen];
    size_t off = 0;
    seen[0] = 0;
    for (int i = 0; i < n && off < sizeof seen; i++)
        off += (size_t)snprintf(seen + off, sizeof seen - off, "%s%s", i ? "," : "",
                                rows[i].engine_id);
    /* the usual case: nothing changed; an empty table (engines not registered
     * yet) is no restart and leaves the ids seen as they were */
    if (!n || !strcmp(seen, b->engines_seen)) return 0;
    if (b->engines_seen[0]) {
        char w[600];
        snprintf(w, sizeof w, "engine %.250s after %.250s", seen, b->engines_seen);
        b->table_changes[refresh]++;
        LOG_W(MOD, "prefill %s restarted (its /query, read %s, names %s): using the new engine ids",
              b->url, refresh ? "because a decode named its engine unknown" : "by the health probe",
              w);
        if (b->env->on_restart) b->env->on_restart(b, w, b->env->cb_arg);
    }
    snprintf(b->engines_seen, sizeof b->engines_seen, "%s", seen);
    for (int i = 0; i < n; i++)
        LOG_I(MOD, "prefill %s dp rank %d: engine_id %s (tp %d)", b->url, rows[i].dp_rank,
              rows[i].engine_id, rows[i].tp_size);
    return 0;
}

static void probe_done(hc_req *r, int err, void *arg) {
    upstream *b = arg;
    b->probe = NULL;
    /* this answer is the table re-read a request waits for */
    int refresh = b->probe_stage == 1 && b->refresh_state == 2;
    int table_ok = 0;
    char why[1024];
    const char *what = b->probe_stage == 0 ? "GET /health" : "GET /query";
    const char *where = b->probe_stage == 0 ? b->url : b->bootstrap_url;
    if (err) {
        snprintf(why, sizeof why, "%s%s: %s", where, b->probe_stage ? "/query" : "/health",
                 hc_strerror(err));
        upstream_mark_down(b, why);
        if (b->probe_stage == 0 && ++b->misses >= UPSTREAM_HUNG_MISSES) {
            char w[1100];
            snprintf(w, sizeof w, "%d health probes in a row unanswered, the last: %s", b->misses,
                     why);
            if (b->env->on_unresponsive) b->env->on_unresponsive(b, w, b->env->cb_arg);
        }
        /* a probe that timed out is repeated at once (a refused one waits
         * for the next tick: nothing to wait for, no spinning); a wanted
         * table re-read goes first (out:), so that the requests waiting for it
         * wait one probe timeout at most */
        if (err == HC_ETIMEOUT && b->probe_stage == 0 && b->active && !b->retiring &&
            b->refresh_state != 1)
            probe_start(b, 0);
        goto out;
    }
    if (b->probe_stage == 0) b->misses = 0;
    if (b->probe_status != 200) {
        snprintf(why, sizeof why, "%s on %s answered HTTP %d", what, where, b->probe_status);
        upstream_mark_down(b, why);
        goto out;
    }
    if (b->probe_stage == 0) {
        if (b->role == UPSTREAM_DECODE) {
            set_state(b, 1, 1, NULL);
            goto out;
        }
        /* a prefill's engine table is read on every probe: one restarted
         * between two probes answers /health as before, with new engine ids */
        b->healthy = 1;
        start_query(b);
        return;
    }
    size_t len = evbuffer_get_length(b->probe_body);
    const char *txt = (const char *)evbuffer_pullup(b->probe_body, -1);
    if (take_table(b, txt, len, refresh, why, sizeof why)) {
        upstream_mark_down(b, why);
        goto out;
    }
    table_ok = 1;
    /* a re-read asked after a failed /health does not put it back: the next
     * probe that passes does */
    if (b->healthy) set_state(b, 1, 1, NULL);
out:
    if (refresh)
        refresh_ended(b, table_ok);
    else if (b->refresh_state == 1 && !b->probe && b->active && !b->retiring)
        start_query(b);
}

static void probe_start(upstream *b, int stage) {
    static const hc_callbacks cb = {probe_head, probe_data, probe_done};
    hc_timeouts t = {b->env->probe_timeout_s, b->env->probe_timeout_s};
    b->probe_stage = stage;
    b->probe_status = 0;
    evbuffer_drain(b->probe_body, evbuffer_get_length(b->probe_body));
    b->probe =
        hc_request(stage == 0 ? b->pool : b->bootstrap_pool, "GET",
                   stage == 0 ? "/health" : "/query", b->env->auth_header, NULL, 0, &t, &cb, b);
    if (b->probe && stage == 1 && b->refresh_state == 1) b->refresh_state = 2;
}

int upstream_refresh_table(upstream *b) {
    if (b->role != UPSTREAM_PREFILL || !b->active || b->retiring) return -1;
    /* one is wanted or in flight: either started after a decode had named an engine
     * unknown, so after the restart that made the caller's engine id stale */
    if (b->refresh_state) return 0;
    b->refresh_state = 1;
    if (b->probe) return 0; /* after the probe in flight (probe_done) */
    probe_start(b, 1);
    if (!b->probe) {
        b->refresh_state = 0;
        return -1;
    }
    return 0;
}

void upstream_probe(upstream *b) {
    if (!b->probe && b->active && !b->retiring) probe_start(b, 0);
}
