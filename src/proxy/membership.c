/* membership — see membership.h. */
#include "proxy/membership.h"

#include "base/discovery.h"
#include "base/log.h"
#include "proxy/proxy_internal.h"

#include <errno.h>
#include <event2/event.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "proxy"

struct membership {
    discovery_watcher *w;                         /* the etcd watcher (its own thread) */
    struct event *timer;                          /* reconcile tick on the loop */
    uint64_t gen;                                 /* generation last reconciled */
    discovery_record rec[2][POLICY_MAX_BACKENDS]; /* record of each discovered slot, by role */
    uint64_t added, removed, ignored;             /* instances that joined, left, had no slot */
    int bootstraps;                               /* standalone bootstrap servers registered */
};

static upstream *slots(proxy *px, int role) {
    return role ? px->decode : px->prefill;
}

static int *count(proxy *px, int role) {
    return role ? &px->ndecode : &px->nprefill;
}

static const discovery_instance *find(const discovery_instance *l, int n, const char *key) {
    for (int i = 0; i < n; i++)
        if (!strcmp(l[i].key, key)) return &l[i];
    return NULL;
}

static void take_load(upstream *b, const discovery_record *r) {
    b->has_load = 1;
    b->pub_running = r->running;
    b->pub_waiting = r->waiting;
    b->pub_kv_usage = r->kv_usage;
}

static void retire(membership *m, upstream *b, const char *why) {
    LOG_I(MOD, "%s %s leaves the rotation: %s", upstream_role_name(b->role), b->url, why);
    upstream_mark_down(b, why);
    b->retiring = 1;
    m->removed++;
}

static void add(proxy *px, membership *m, int role, const discovery_instance *e) {
    upstream *list = slots(px, role);
    int i = 0;
    while (i < POLICY_MAX_BACKENDS && list[i].active)
        i++;
    if (i == POLICY_MAX_BACKENDS) {
        if (!m->ignored++)
            LOG_W(MOD, "%s: more than %d %s instances; the rest are ignored", e->key,
                  POLICY_MAX_BACKENDS, role ? "decode" : "prefill");
        return;
    }
    upstream *b = &list[i];
    char err[512];
    if (upstream_init(b, role ? UPSTREAM_DECODE : UPSTREAM_PREFILL, i, e->rec.url,
                      role ? NULL : (e->rec.bootstrap[0] ? e->rec.bootstrap : NULL), &px->env, err,
                      sizeof err)) {
        LOG_W(MOD, "ignoring %s: %s", e->key, err);
        upstream_free(b);
        return;
    }
    if (px->kv && kv_route_attach(px->kv, b, err, sizeof err))
        LOG_W(MOD, "%s: no KV events, kv_aware routes it as holding nothing: %s", e->key, err);
    b->discovered = 1;
    snprintf(b->key, sizeof b->key, "%s", e->key);
    snprintf(b->group, sizeof b->group, "%s|%s", e->rec.model, e->rec.kv_layout);
    snprintf(b->engine_ids, sizeof b->engine_ids, "%s", e->rec.engine_id);
    take_load(b, &e->rec);
    m->rec[role][i] = e->rec;
    if (i + 1 > *count(px, role)) *count(px, role) = i + 1;
    m->added++;
    LOG_I(MOD, "%s %s joins (%s; model %s, KV layout %s)", upstream_role_name(b->role), b->url,
          e->key, e->rec.model, e->rec.kv_layout);
    upstream_probe(b);
}

static void reconcile(proxy *px, membership *m) {
    discovery_instance *l;
    int n;
    m->gen = discovery_watcher_snapshot(m->w, &l, &n);
    if (!l) return;
    m->bootstraps = 0;
    for (int i = 0; i < n; i++)
        m->bootstraps += !strcmp(l[i].rec.role, "bootstrap");
    for (int role = 0; role < 2; role++) {
        upstream *list = slots(px, role);
        const char *rname = role ? "decode" : "prefill";
        for (int i = 0; i < *count(px, role); i++) { /* the slots we have */
            upstream *b = &list[i];
            if (!b->active || !b->discovered || b->retiring) continue;
            const discovery_instance *e = find(l, n, b->key);
            if (!e) {
                retire(m, b, "its etcd key is gone (stopped, or its lease expired)");
                continue;
            }
            if (!discovery_record_same_instance(&e->rec, &m->rec[role][i])) {
                retire(m, b, "its etcd record names another address, model or KV layout");
                continue;
            }
            take_load(b, &e->rec);
            if (strcmp(b->engine_ids, e->rec.engine_id) != 0) {
                if (b->engine_ids[0] && e->rec.engine_id[0] && role == 0) {
                    LOG_I(MOD, "prefill %s has a new engine id (restarted): re-reading its table",
                          b->url);
                    upstream_mark_down(b, "its engine id changed (restarted)");
                    upstream_probe(b);
                }
                snprintf(b->engine_ids, sizeof b->engine_ids, "%s", e->rec.engine_id);
            }
            m->rec[role][i] = e->rec;
        }
        for (int k = 0; k < n; k++) { /* keys without a slot */
            if (strcmp(l[k].rec.role, rname)) continue;
            int have = 0;
            for (int i = 0; i < *count(px, role) && !have; i++)
                have = list[i].active && !list[i].retiring && !strcmp(list[i].key, l[k].key);
            if (!have) add(px, m, role, &l[k]);
        }
    }
    free(l);
}

/* Frees retired slots nobody uses any more. */
static void sweep(proxy *px) {
    for (int role = 0; role < 2; role++) {
        upstream *list = slots(px, role);
        for (int i = 0; i < *count(px, role); i++)
            if (list[i].active && list[i].retiring && list[i].outstanding == 0)
                upstream_free(&list[i]);
        while (*count(px, role) > 0 && !list[*count(px, role) - 1].active)
            (*count(px, role))--;
    }
}

static void tick(evutil_socket_t fd, short what, void *arg) {
    proxy *px = arg;
    membership *m = px->members;
    discovery_status st;
    discovery_watcher_status(m->w, &st);
    if (st.generation != m->gen) reconcile(px, m);
    sweep(px);
}

int membership_start(proxy *px, char *err, size_t errcap) {
    membership *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errcap, "out of memory");
        return -ENOMEM;
    }
    int rc = discovery_watcher_start(px->cfg.discovery, &m->w, err, errcap);
    if (rc) {
        free(m);
        return rc;
    }
    px->members = m;
    m->gen = (uint64_t)-1;
    tick(-1, 0, px);
    m->timer = event_new(px->base, -1, EV_PERSIST, tick, px);
    struct timeval tv = {0, 100000};
    event_add(m->timer, &tv);
    discovery_status st;
    discovery_watcher_status(m->w, &st);
    LOG_I(MOD, "discovery: watching %s%s/instances/ on %s: %d instances", px->cfg.discovery->url,
          "", px->cfg.discovery->endpoints, st.instances);
    return 0;
}

void membership_stop(proxy *px) {
    membership *m = px->members;
    if (!m) return;
    if (m->timer) event_free(m->timer);
    discovery_watcher_stop(m->w);
    free(m);
    px->members = NULL;
}

void membership_describe(const proxy *px, char *out, size_t cap) {
    membership *m = px->members;
    out[0] = 0;
    if (!m) return;
    discovery_status st;
    discovery_watcher_status(m->w, &st);
    snprintf(out, cap, "discovery %s: %d instances registered%s%s", px->cfg.discovery->url,
             st.instances,
             st.connected ? "" : "; etcd unreachable: ", st.connected ? "" : st.last_error);
}

void membership_write_metrics(proxy *px, prom *o) {
    membership *m = px->members;
    if (!m) return;
    discovery_status st;
    discovery_watcher_status(m->w, &st);
    prom_family(o, "disagg_proxy_discovery_connected", PROM_GAUGE,
                "1 while etcd answers; 0: routing on the last known instances.");
    prom_sample(o, st.connected, NULL);
    prom_family(o, "disagg_proxy_discovery_instances", PROM_GAUGE,
                "Instances in rotation from etcd, by role (bootstrap: standalone servers).");
    for (int role = 0; role < 2; role++) {
        int c = 0;
        for (int i = 0; i < *count(px, role); i++)
            c += slots(px, role)[i].active && slots(px, role)[i].discovered &&
                 !slots(px, role)[i].retiring;
        prom_sample(o, c, "role", role ? "decode" : "prefill", NULL);
    }
    prom_sample(o, m->bootstraps, "role", "bootstrap", NULL);
    prom_family(o, "disagg_proxy_discovery_changes", PROM_COUNTER,
                "Instances that joined or left the rotation through etcd.");
    prom_sample_u64(o, m->added, "change", "joined", NULL);
    prom_sample_u64(o, m->removed, "change", "left", NULL);
    prom_family(o, "disagg_proxy_discovery_events", PROM_COUNTER, "etcd watch events received.");
    prom_sample_u64(o, st.events, NULL);
    prom_family(o, "disagg_proxy_discovery_errors", PROM_COUNTER,
                "Failed etcd requests (each loss of contact).");
    prom_sample_u64(o, st.errors, NULL);
    prom_family(o, "disagg_proxy_discovery_bad_records", PROM_COUNTER,
                "etcd values under the prefix that were not a valid instance record.");
    prom_sample_u64(o, st.bad_records, NULL);
    /* the label keeps its published name, backend (as the other per-instance series) */
    prom_family(o, "disagg_proxy_backend_published_load", PROM_GAUGE,
                "Running + waiting requests an instance published in etcd.");
    for (int role = 0; role < 2; role++)
        for (int i = 0; i < *count(px, role); i++) {
            upstream *b = &slots(px, role)[i];
            if (!b->active || !b->has_load) continue;
            prom_sample(o, b->pub_running + b->pub_waiting, "role", upstream_role_name(b->role),
                        "backend", b->url, NULL);
        }
}
