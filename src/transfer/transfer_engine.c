/*
 * transfer_engine — the transfer engine's public API
 * (include/disagg/transfer.h): owns the configuration, this engine's
 * registrations, its handshake server, the table of opened peer segments and
 * the batch table, and routes each request's chunks to a transport
 * (transport.h), known only through the transport table (transports.c): the
 * peer's preferred one (the first whose prefer() says so when it is opened),
 * or — when the memory on either side rules that out (device memory and
 * shm) — the next one in the table that reaches both.  Everything a
 * transport needs of the engine's side — registering memory, describing the
 * segment, a listener, a peer's first contact — goes through its ops.  The
 * transports end every chunk through the engine's sink.
 */
#include "disagg/transfer.h"

#include "base/auth.h"
#include "base/clock.h"
#include "base/log.h"
#include "base/net.h"
#include "transfer/batch.h"
#include "transfer/handshake.h"
#include "transfer/metadata_etcd.h"
#include "transfer/registry.h"
#include "transfer/segment_desc.h"
#include "transfer/transport.h"
#include "transfer/xfer_op.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MOD            "transfer"
#define MAX_IFACES     TRANSPORT_MAX_IFACES
#define DEFAULT_LANES  2
#define DEFAULT_STRIPE (1u << 20)

typedef struct peer {
    transfer_segment handle; /* (generation << 32) | (index + 1) */
    char name[96];           /* segment name as opened */
    net_addr rpc_addr;       /* its handshake port */
    pthread_mutex_t mu;      /* guards desc, pref, conn */
    segment_desc desc;       /* last fetched descriptor */
    int same_host;
    int pref;                  /* preferred transport (index into the engine's tp) */
    void *conn[TRANSPORT_MAX]; /* each transport's state for it, opened on first use */
    int closed;
} peer;

struct transfer_engine {
    transfer_config cfg;
    char hostname[64];     /* advertised host (numeric) */
    char device_name[256]; /* whitelist copy */
    char segment_name[96]; /* "host:rpc_port" */
    char host_id[96];
    net_iface_addr ifaces[MAX_IFACES]; /* allowed local interface addresses */
    int nifaces;
    int whitelisted; /* device_name was given */
    uint16_t rpc_port, data_port;
    char *secret;       /* shared secret, NULL = none */
    net_addr bind_host; /* where the listeners bind */

    pthread_rwlock_t reg_lock; /* guards regs; servers hold it (read) while copying */
    registry regs;

    handshake_server *hs;
    /* The transport table's instances (tp[t] NULL: not in use here), in
     * table order; fb: the fallback's index. */
    transport *tp[TRANSPORT_MAX];
    int ntp, fb;
    transport_env env; /* what the transports were created with */
    xfer_sink sink;    /* where the transports end ops */

    /* Device memory: the installed table (devp NULL = none) and how many
     * registrations are device memory. */
    transfer_device_ops dev;
    const transfer_device_ops *devp;
    size_t ndev_regs;
    stage_stats stage;

    pthread_mutex_t peers_mu; /* guards peers array */
    peer **peers;
    size_t npeers, peers_cap;

    batch_table batches;

    _Atomic uint64_t bytes_written, bytes_read, requests_ok, requests_failed;
    _Atomic uint64_t bytes_served, requests_rejected, shm_fallbacks, auth_refused;
    metadata_etcd *meta; /* cfg.metadata_server: the segment in etcd, or NULL */
};

/* ---- configuration ------------------------------------------------------- */

void transfer_config_init(transfer_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->protocol = TRANSFER_PROTO_AUTO;
    cfg->lanes = DEFAULT_LANES;
    cfg->stripe_bytes = DEFAULT_STRIPE;
    cfg->timeout_base_ns = 30 * NS_PER_S;
    cfg->timeout_per_byte_ns = 1.0;
    cfg->connect_timeout_ns = 5 * NS_PER_S;
}

static uint64_t request_deadline(const transfer_engine *e, size_t len) {
    double per = e->cfg.timeout_per_byte_ns * (double)len;
    return clock_now_ns() + e->cfg.timeout_base_ns + (uint64_t)(per > 1e15 ? 1e15 : per);
}

/* ---- engine lifecycle ---------------------------------------------------- */

static void op_done(void *ctx, xfer_op *op, int err);
static void op_reroute(void *ctx, xfer_op *op, int err);

/* The handshake's type-0 frame: a peer's first contact for a transport
 * (rdma connecting its queue pair). */
static char *accept_cb(void *ctx, const char *body, size_t len, char *err, size_t cap) {
    transfer_engine *e = ctx;
    for (int t = 0; t < e->ntp; t++)
        if (e->tp[t] && e->tp[t]->ops->accept)
            return e->tp[t]->ops->accept(e->tp[t], body, len, err, cap);
    snprintf(err, cap, "this engine does not run rdma (protocol %d or no NIC)",
             (int)e->cfg.protocol);
    return NULL;
}

/* This engine's segment descriptor: the engine's fields and its buffers,
 * then what each transport adds (keys, reach, data endpoints, NICs). */
static void describe_into(transfer_engine *e, segment_desc *d, int *rc) {
    snprintf(d->name, sizeof d->name, "%s", e->segment_name);
    d->disagg_version = SEGMENT_DISAGG_VERSION;
    snprintf(d->host_id, sizeof d->host_id, "%s", e->host_id);
    d->pid = (int)getpid();
    pthread_rwlock_rdlock(&e->reg_lock);
    *rc = 0;
    for (size_t i = 0; i < e->regs.n && *rc == 0; i++)
        *rc = registry_add(&d->buffers, e->regs.v[i].addr, e->regs.v[i].length,
                           e->regs.v[i].location);
    for (int t = 0; *rc == 0 && t < e->ntp; t++)
        if (e->tp[t] && e->tp[t]->ops->describe) e->tp[t]->ops->describe(e->tp[t], &e->regs, d);
    pthread_rwlock_unlock(&e->reg_lock);
}

static char *describe(void *ctx) {
    transfer_engine *e = ctx;
    segment_desc d;
    segment_desc_init(&d);
    int rc;
    describe_into(e, &d, &rc);
    char *json = rc == 0 ? segment_desc_encode(&d) : NULL;
    segment_desc_free(&d);
    return json;
}

/* The handshake port is bound: name the segment before anyone can ask for it. */
static void rpc_bound(void *ctx, uint16_t port) {
    transfer_engine *e = ctx;
    e->rpc_port = port;
    net_addr adv;
    net_resolve(e->hostname, port, &adv);
    net_addr_format(&adv, e->segment_name, sizeof e->segment_name);
}

/* Whether a can be bound on this host (it is one of its addresses). */
static int host_is_local(const net_addr *a) {
    int fd = socket(a->ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return 1; /* let the real bind report it */
    net_addr t = *a;
    net_addr_set_port(&t, 0);
    int ok = bind(fd, (const struct sockaddr *)&t.ss, t.len) == 0 || errno != EADDRNOTAVAIL;
    close(fd);
    return ok;
}

static int choose_hostname(transfer_engine *e, const transfer_config *cfg) {
    const char *h =
        cfg->local_hostname && *cfg->local_hostname ? cfg->local_hostname : getenv("VLLM_HOST_IP");
    net_addr a;
    if (h && *h) {
        if (net_resolve(h, 0, &a) != 0) {
            LOG_E(MOD, "local hostname '%s' does not resolve to an address", h);
            return TRANSFER_EINVAL;
        }
    } else if (e->nifaces > 0) {
        a = e->ifaces[0].addr;
    } else {
        net_resolve("127.0.0.1", 0, &a);
    }
    net_addr_host(&a, e->hostname, sizeof e->hostname);
    return 0;
}

int transfer_engine_create(const transfer_config *cfg_in, transfer_engine **out) {
    if (!out) return TRANSFER_EINVAL;
    transfer_config def;
    transfer_config_init(&def);
    const transfer_config *cfg = cfg_in ? cfg_in : &def;
    if (cfg->protocol != TRANSFER_PROTO_AUTO && cfg->protocol != TRANSFER_PROTO_TCP &&
        cfg->protocol != TRANSFER_PROTO_SHM && cfg->protocol != TRANSFER_PROTO_RDMA) {
        LOG_E(MOD, "unknown protocol %d (accepted: auto, tcp, shm, rdma)", (int)cfg->protocol);
        return TRANSFER_EINVAL;
    }
    if (cfg->lanes < 0 || cfg->lanes > 64) {
        LOG_E(MOD, "lanes %d out of range (accepted: 1..64, 0 = default %d)", cfg->lanes,
              DEFAULT_LANES);
        return TRANSFER_EINVAL;
    }
    transfer_engine *e = calloc(1, sizeof *e);
    if (!e) return TRANSFER_ENOMEM;
    e->cfg = *cfg;
    if (!e->cfg.lanes) e->cfg.lanes = DEFAULT_LANES;
    if (!e->cfg.stripe_bytes) e->cfg.stripe_bytes = DEFAULT_STRIPE;
    if (!e->cfg.timeout_base_ns) e->cfg.timeout_base_ns = def.timeout_base_ns;
    if (e->cfg.timeout_per_byte_ns <= 0) e->cfg.timeout_per_byte_ns = def.timeout_per_byte_ns;
    if (!e->cfg.connect_timeout_ns) e->cfg.connect_timeout_ns = def.connect_timeout_ns;
    snprintf(e->device_name, sizeof e->device_name, "%s", cfg->device_name ? cfg->device_name : "");
    e->cfg.device_name = e->device_name;
    e->cfg.local_hostname = NULL;
    e->whitelisted = e->device_name[0] != 0;
    segment_host_id(e->host_id, sizeof e->host_id);
    pthread_rwlock_init(&e->reg_lock, NULL);
    registry_init(&e->regs);
    pthread_mutex_init(&e->peers_mu, NULL);
    int rc = batch_table_init(&e->batches);
    if (rc) goto fail_early;

    const char *bad = NULL;
    /* With rdma, device_name names NICs (as Mooncake's); tcp uses every
     * interface. */
    int rdma = cfg->protocol == TRANSFER_PROTO_RDMA;
    if (rdma) e->whitelisted = 0;
    e->nifaces = net_list_iface_addrs(rdma ? "" : e->device_name, e->ifaces, MAX_IFACES, &bad);
    if (e->nifaces < 0) {
        LOG_E(MOD, "device_name '%s': no interface named '%s' on this host", e->device_name,
              bad ? bad : "?");
        rc = TRANSFER_EINVAL;
        goto fail_early;
    }
    if (e->whitelisted && e->nifaces == 0) {
        LOG_E(MOD, "device_name '%s': none of these interfaces is up with an address",
              e->device_name);
        rc = TRANSFER_EINVAL;
        goto fail_early;
    }
    if ((rc = choose_hostname(e, cfg)) != 0) goto fail_early;

    if (cfg->auth_secret && *cfg->auth_secret && !(e->secret = strdup(cfg->auth_secret))) {
        rc = TRANSFER_ENOMEM;
        goto fail_early;
    }
    e->cfg.auth_secret = e->secret;

    /* Bind only where peers must reach us (docs/transfer.md, Security): the
     * handshake port on the advertised host, the data port there and on
     * each whitelisted interface address (the advertised data_addrs). */
    net_addr host;
    if (net_resolve(e->hostname, 0, &host) != 0) {
        LOG_E(MOD, "advertised host '%s' does not resolve", e->hostname);
        rc = TRANSFER_EINVAL;
        goto fail_early;
    }
    if (!host_is_local(&host)) {
        /* A NAT'd or forwarded address (e.g. VLLM_HOST_IP of a container's
         * host): it cannot be bound here, so listen on every interface. */
        LOG_W(MOD,
              "advertised host %s is not an address of this host: the handshake and data "
              "ports listen on all interfaces",
              e->hostname);
        net_resolve(host.ss.ss_family == AF_INET6 ? "::" : "0.0.0.0", 0, &host);
    }
    e->bind_host = host;
    e->sink = (xfer_sink){.done = op_done, .reroute = op_reroute, .ctx = e};
    e->env = (transport_env){.sink = &e->sink,
                             .protocol = e->cfg.protocol,
                             .lanes = e->cfg.lanes,
                             .stripe = e->cfg.stripe_bytes,
                             .connect_timeout_ns = e->cfg.connect_timeout_ns,
                             .timeout_base_ns = e->cfg.timeout_base_ns,
                             .timeout_per_byte_ns = e->cfg.timeout_per_byte_ns,
                             .secret = e->secret,
                             .device_name = e->device_name,
                             .self_name = e->segment_name,
                             .dev = &e->devp,
                             .stage = &e->stage,
                             .reg_lock = &e->reg_lock,
                             .regs = &e->regs,
                             .hostname = e->hostname,
                             .bind_host = &e->bind_host,
                             .data_port = cfg->data_port,
                             .max_conns_per_peer = cfg->max_conns_per_peer,
                             .ifaces = e->ifaces,
                             .nifaces = e->nifaces,
                             .whitelisted = e->whitelisted,
                             .bytes_served = &e->bytes_served,
                             .rejected = &e->requests_rejected,
                             .auth_refused = &e->auth_refused};
    /* The transports (and their listeners) before the handshake port: its
     * callbacks use them.  The fallback (the table's last) must come up. */
    e->ntp = transport_table_len;
    e->fb = -1;
    for (int t = 0; t < e->ntp; t++) {
        rc = transport_table[t]->create(&e->env, &e->tp[t]);
        if (rc == TRANSFER_ENOSEG && !(t == e->ntp - 1)) {
            e->tp[t] = NULL; /* not in use here */
            rc = 0;
        } else if (rc) {
            e->tp[t] = NULL;
            goto fail;
        } else if (e->tp[t]->flags & TRANSPORT_FALLBACK) {
            e->fb = t;
        }
    }
    if (e->fb < 0) {
        LOG_E(MOD, "the transport table has no fallback transport");
        rc = TRANSFER_EINVAL;
        goto fail;
    }
    {
        /* The data port the descriptor advertises. */
        segment_desc d;
        segment_desc_init(&d);
        int drc;
        describe_into(e, &d, &drc);
        e->data_port = d.tcp_data_port;
        segment_desc_free(&d);
    }
    net_addr hs_addr = host;
    net_addr_set_port(&hs_addr, cfg->rpc_port);
    handshake_server_cfg hcfg = {.describe = describe,
                                 .bound = rpc_bound,
                                 .ctx = e,
                                 .self_name = e->segment_name,
                                 .secret = e->secret,
                                 .auth_refused = &e->auth_refused,
                                 .connect = accept_cb};
    if ((rc = handshake_server_start(&hs_addr, &hcfg, &e->hs)) != 0) goto fail;
    if (cfg->metadata_server && *cfg->metadata_server) {
        e->meta =
            metadata_etcd_open(cfg->metadata_server, e->segment_name, e->hostname, e->rpc_port);
        char *d = e->meta ? describe(e) : NULL;
        if (!d || metadata_etcd_publish(e->meta, d)) {
            free(d);
            metadata_etcd_close(e->meta);
            e->meta = NULL;
            rc = TRANSFER_EINVAL;
            goto fail;
        }
        free(d);
    }
    e->cfg.metadata_server = NULL; /* not kept: the caller's string */
    LOG_D(MOD, "engine %s up (tcp data port %u, %d interface address(es))", e->segment_name,
          e->data_port, e->nifaces);
    *out = e;
    return 0;
fail:
    handshake_server_stop(e->hs); /* first: its callbacks use the transports */
    for (int t = 0; t < e->ntp; t++)
        if (e->tp[t]) e->tp[t]->ops->destroy(e->tp[t]);
fail_early:
    free(e->secret);
    batch_table_destroy(&e->batches);
    registry_free(&e->regs);
    pthread_rwlock_destroy(&e->reg_lock);
    pthread_mutex_destroy(&e->peers_mu);
    free(e);
    return rc;
}

/* The descriptor in etcd follows the registrations. */
static void republish(transfer_engine *e) {
    if (!e->meta) return;
    char *d = describe(e);
    if (d) metadata_etcd_publish(e->meta, d);
    free(d);
}

void transfer_engine_destroy(transfer_engine *e) {
    if (!e) return;
    metadata_etcd_close(e->meta); /* Mooncake peers stop finding it first */
    e->meta = NULL;
    /* Cancel every batch so queued chunks end without going out. */
    pthread_mutex_lock(&e->batches.mu);
    for (size_t i = 0; i < e->batches.cap; i++)
        if (e->batches.slots[i]) atomic_store(&e->batches.slots[i]->canceled, 1);
    pthread_mutex_unlock(&e->batches.mu);
    /* The handshake port first: its callbacks (describe, accept) use the
     * transports. */
    handshake_server_stop(e->hs);
    e->hs = NULL;
    /* Transport by transport, in table order (the fallback last: the ops
     * the others drain may be re-routed to it, which is still up). */
    for (int t = 0; t < e->ntp; t++) {
        for (size_t i = 0; i < e->npeers; i++) {
            peer *p = e->peers[i];
            pthread_mutex_lock(&p->mu);
            void *c = p->conn[t];
            p->conn[t] = NULL;
            pthread_mutex_unlock(&p->mu);
            if (c) e->tp[t]->ops->close_peer(e->tp[t], c);
        }
        if (e->tp[t]) e->tp[t]->ops->destroy(e->tp[t]);
    }
    for (size_t i = 0; i < e->npeers; i++) {
        peer *p = e->peers[i];
        segment_desc_free(&p->desc);
        pthread_mutex_destroy(&p->mu);
        free(p);
    }
    free(e->peers);
    batch_table_destroy(&e->batches);
    registry_free(&e->regs);
    pthread_rwlock_destroy(&e->reg_lock);
    pthread_mutex_destroy(&e->peers_mu);
    free(e->secret);
    free(e);
}

const char *transfer_engine_segment_name(const transfer_engine *e) {
    return e ? e->segment_name : "";
}

uint16_t transfer_engine_data_port(const transfer_engine *e) {
    return e ? e->data_port : 0;
}

/* ---- registration -------------------------------------------------------- */

int transfer_register(transfer_engine *e, void *addr, size_t length, const char *location) {
    if (!e || !addr || length == 0) {
        LOG_E(MOD, "register: %s", !addr ? "NULL address" : "zero length");
        return TRANSFER_EINVAL;
    }
    const char *loc = location && *location ? location : "cpu:0";
    int device = -1;
    if (strncmp(loc, "cuda", 4) == 0) {
        if (transport_location_parse_device(loc, &device) != 0) {
            LOG_E(MOD, "register: bad device location '%s' (accepted: cuda:N, N in 0..%d)", loc,
                  TRANSPORT_MAX_DEVICES - 1);
            return TRANSFER_EINVAL;
        }
    } else if (strcmp(loc, "cpu") != 0 && strncmp(loc, "cpu:", 4) != 0) {
        LOG_E(MOD, "register: unknown location '%s' (accepted: cpu, cpu:N, cuda:N)", loc);
        return TRANSFER_EINVAL;
    }
    pthread_rwlock_wrlock(&e->reg_lock);
    int rc = 0;
    if (device >= 0 && !e->devp) {
        LOG_E(MOD,
              "register: location '%s' is device memory, but no device-memory ops are installed "
              "(transfer_engine_set_device_ops: the CUDA backend does that)",
              loc);
        rc = TRANSFER_EINVAL;
    }
    if (rc == 0) rc = registry_add(&e->regs, (uint64_t)(uintptr_t)addr, length, loc);
    if (rc == 0) {
        /* Each transport keeps what peers need (NIC keys, IPC handles); a
         * failure undoes the others and the registration. */
        registry_entry *r =
            (registry_entry *)registry_find(&e->regs, (uint64_t)(uintptr_t)addr, length);
        int t = 0;
        for (; t < e->ntp && rc == 0; t++)
            if (e->tp[t] && e->tp[t]->ops->register_mem)
                rc = e->tp[t]->ops->register_mem(e->tp[t], r);
        if (rc) {
            for (int u = 0; u < t - 1; u++)
                if (e->tp[u] && e->tp[u]->ops->deregister_mem)
                    e->tp[u]->ops->deregister_mem(e->tp[u], r);
            registry_remove(&e->regs, (uint64_t)(uintptr_t)addr);
        }
    }
    if (rc == 0 && device >= 0) e->ndev_regs++;
    pthread_rwlock_unlock(&e->reg_lock);
    if (rc == TRANSFER_EOVERLAP)
        LOG_E(MOD, "register: [%p, +%zu) overlaps an existing registration", addr, length);
    if (rc == 0) republish(e);
    return rc;
}

int transfer_unregister(transfer_engine *e, void *addr) {
    if (!e) return TRANSFER_EINVAL;
    /* The write lock waits for tcp server threads copying into this memory. */
    pthread_rwlock_wrlock(&e->reg_lock);
    const registry_entry *r = registry_find(&e->regs, (uint64_t)(uintptr_t)addr, 1);
    int exact = r && r->addr == (uint64_t)(uintptr_t)addr;
    int was_dev = exact && location_is_device(r->location);
    for (int t = 0; exact && t < e->ntp; t++)
        if (e->tp[t] && e->tp[t]->ops->deregister_mem) e->tp[t]->ops->deregister_mem(e->tp[t], r);
    int rc = registry_remove(&e->regs, (uint64_t)(uintptr_t)addr);
    if (rc == 0 && was_dev) e->ndev_regs--;
    pthread_rwlock_unlock(&e->reg_lock);
    if (rc == 0) republish(e);
    return rc;
}

int transfer_engine_set_device_ops(transfer_engine *e, const transfer_device_ops *ops) {
    if (!e) return TRANSFER_EINVAL;
    if (ops && (!ops->stream_create || !ops->stream_destroy || !ops->copy_to_host ||
                !ops->copy_from_host || !ops->sync || !ops->alloc_pinned || !ops->free_pinned)) {
        LOG_E(MOD, "set_device_ops: every function of the table is required (one is NULL)");
        return TRANSFER_EINVAL;
    }
    pthread_rwlock_wrlock(&e->reg_lock);
    int rc = 0;
    if (e->ndev_regs > 0 || (e->devp && ops)) {
        /* Staging threads and connections hold the installed table. */
        LOG_E(MOD, "set_device_ops: %s",
              e->ndev_regs ? "device memory is registered (unregister it first)"
                           : "a table is already installed");
        rc = TRANSFER_EBUSY;
    } else if (ops) {
        e->dev = *ops;
        e->devp = &e->dev;
    } else {
        e->devp = NULL;
    }
    pthread_rwlock_unlock(&e->reg_lock);
    return rc;
}

void transfer_engine_get_device_stats(transfer_engine *e, transfer_device_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!e) return;
    out->staged_bytes_out = atomic_load(&e->stage.out);
    out->staged_bytes_in = atomic_load(&e->stage.in);
}

/* The location of the local registration holding [addr, +len) in loc: 1, or
 * 0 when the range is not registered. */
static int local_registered(transfer_engine *e, const void *addr, size_t len, char *loc, size_t cap,
                            uint64_t *lo, uint64_t *hi) {
    pthread_rwlock_rdlock(&e->reg_lock);
    const registry_entry *r = registry_find(&e->regs, (uint64_t)(uintptr_t)addr, len);
    if (r) {
        snprintf(loc, cap, "%s", r->location);
        *lo = r->addr;
        *hi = r->addr + r->length;
    }
    pthread_rwlock_unlock(&e->reg_lock);
    return r != NULL;
}

/* ---- segments ------------------------------------------------------------ */

static peer *peer_lookup(transfer_engine *e, transfer_segment h) {
    uint64_t idx = (uint64_t)h & 0xffffffffu;
    pthread_mutex_lock(&e->peers_mu);
    peer *p = (idx >= 1 && idx <= e->npeers) ? e->peers[idx - 1] : NULL;
    if (p && (p->handle != h || p->closed)) p = NULL;
    pthread_mutex_unlock(&e->peers_mu);
    return p;
}

/* Fetch (or re-fetch) p's descriptor.  Caller holds p->mu. */
static void peer_view_locked(transfer_engine *e, peer *p, transport_peer *v);

static int peer_fetch_locked(transfer_engine *e, peer *p) {
    char *mine = describe(e);
    segment_desc d;
    char err[256] = "";
    int rc = handshake_fetch(&p->rpc_addr, p->name, e->segment_name, mine, e->secret,
                             clock_now_ns() + e->cfg.connect_timeout_ns, &d, err, sizeof err);
    free(mine);
    if (rc) {
        LOG_W(MOD, "open segment %s: %s", p->name, err);
        return rc;
    }
    if (d.tcp_proto_version != SEGMENT_TCP_PROTO_VERSION) {
        LOG_E(MOD, "segment %s speaks tcp protocol version %d (this engine speaks %d)", p->name,
              d.tcp_proto_version, SEGMENT_TCP_PROTO_VERSION);
        segment_desc_free(&d);
        return TRANSFER_EVERSION;
    }
    segment_desc_free(&p->desc);
    p->desc = d;
    for (int t = 0; t < e->ntp; t++)
        if (p->conn[t] && e->tp[t]->ops->update_peer) {
            transport_peer v;
            peer_view_locked(e, p, &v);
            e->tp[t]->ops->update_peer(e->tp[t], p->conn[t], &v);
        }
    return 0;
}

/* What transports see of p.  Caller holds p->mu. */
static void peer_view_locked(transfer_engine *e, peer *p, transport_peer *v) {
    (void)e;
    v->name = p->name;
    v->desc = &p->desc;
    v->same_host = p->same_host;
    v->rpc_addr = &p->rpc_addr;
}

/* Open transport t's state for p if not yet.  Caller holds p->mu. */
static int peer_conn_locked(transfer_engine *e, peer *p, int t) {
    if (p->conn[t]) return 0;
    transport_peer v;
    peer_view_locked(e, p, &v);
    return e->tp[t]->ops->open_peer(e->tp[t], &v, &p->conn[t]);
}

int transfer_open_segment(transfer_engine *e, const char *name, transfer_segment *out) {
    if (!e || !name || !out) return TRANSFER_EINVAL;
    char host[64];
    uint16_t port;
    if (net_split_host_port(name, host, sizeof host, &port, 0) != 0) {
        LOG_E(MOD, "segment name '%s' is not \"ip:port\" or \"[ipv6]:port\"", name);
        return TRANSFER_EINVAL;
    }
    pthread_mutex_lock(&e->peers_mu);
    for (size_t i = 0; i < e->npeers; i++) {
        if (!e->peers[i]->closed && strcmp(e->peers[i]->name, name) == 0) {
            *out = e->peers[i]->handle;
            pthread_mutex_unlock(&e->peers_mu);
            return 0;
        }
    }
    pthread_mutex_unlock(&e->peers_mu);

    peer *p = calloc(1, sizeof *p);
    if (!p) return TRANSFER_ENOMEM;
    snprintf(p->name, sizeof p->name, "%s", name);
    pthread_mutex_init(&p->mu, NULL);
    segment_desc_init(&p->desc);
    if (net_resolve(host, port, &p->rpc_addr) != 0) {
        LOG_E(MOD, "segment '%s': host '%s' does not resolve", name, host);
        free(p);
        return TRANSFER_ENOSEG;
    }
    int rc = peer_fetch_locked(e, p);
    if (rc == 0) {
        p->same_host = p->desc.disagg_version > 0 && strcmp(p->desc.host_id, e->host_id) == 0;
        /* The preferred transport: the first in table order that says so. */
        transport_peer v;
        peer_view_locked(e, p, &v);
        p->pref = -1;
        for (int t = 0; t < e->ntp && p->pref < 0 && rc == 0; t++) {
            int want = e->tp[t] && e->tp[t]->ops->prefer ? e->tp[t]->ops->prefer(e->tp[t], &v) : 0;
            if (want < 0)
                rc = want;
            else if (want)
                p->pref = t;
        }
        if (rc == 0 && p->pref < 0) p->pref = e->fb;
    }
    if (rc) {
        segment_desc_free(&p->desc);
        pthread_mutex_destroy(&p->mu);
        free(p);
        return rc == TRANSFER_ECONN || rc == TRANSFER_ETIMEDOUT ? TRANSFER_ENOSEG : rc;
    }
    pthread_mutex_lock(&e->peers_mu);
    for (size_t i = 0; i < e->npeers; i++) { /* lost a race with another opener? */
        if (!e->peers[i]->closed && strcmp(e->peers[i]->name, name) == 0) {
            *out = e->peers[i]->handle;
            pthread_mutex_unlock(&e->peers_mu);
            segment_desc_free(&p->desc);
            pthread_mutex_destroy(&p->mu);
            free(p);
            return 0;
        }
    }
    if (e->npeers == e->peers_cap) {
        size_t cap = e->peers_cap ? e->peers_cap * 2 : 16;
        peer **v = realloc(e->peers, cap * sizeof *v);
        if (!v) {
            pthread_mutex_unlock(&e->peers_mu);
            segment_desc_free(&p->desc);
            free(p);
            return TRANSFER_ENOMEM;
        }
        e->peers = v;
        e->peers_cap = cap;
    }
    e->peers[e->npeers++] = p;
    p->handle = (transfer_segment)(((uint64_t)1 << 32) | e->npeers);
    *out = p->handle;
    pthread_mutex_unlock(&e->peers_mu);
    LOG_D(MOD, "opened segment %s via %s", name, e->tp[p->pref]->ops->name);
    return 0;
}

int transfer_close_segment(transfer_engine *e, transfer_segment seg) {
    if (!e) return TRANSFER_EINVAL;
    peer *p = peer_lookup(e, seg);
    if (!p) return TRANSFER_ESTALE;
    pthread_mutex_lock(&e->peers_mu);
    p->closed = 1; /* the struct lives until the engine goes: ops may point to it */
    pthread_mutex_unlock(&e->peers_mu);
    void *conn[TRANSPORT_MAX];
    pthread_mutex_lock(&p->mu);
    for (int t = 0; t < e->ntp; t++) {
        conn[t] = p->conn[t];
        p->conn[t] = NULL;
    }
    pthread_mutex_unlock(&p->mu);
    for (int t = 0; t < e->ntp; t++)
        if (conn[t]) e->tp[t]->ops->close_peer(e->tp[t], conn[t]);
    return 0;
}

int transfer_refresh_segment(transfer_engine *e, transfer_segment seg) {
    if (!e) return TRANSFER_EINVAL;
    peer *p = peer_lookup(e, seg);
    if (!p) return TRANSFER_ESTALE;
    pthread_mutex_lock(&p->mu);
    int rc = peer_fetch_locked(e, p);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int transfer_segment_get_info(transfer_engine *e, transfer_segment seg,
                              transfer_segment_info *info) {
    if (!e || !info) return TRANSFER_EINVAL;
    peer *p = peer_lookup(e, seg);
    if (!p) return TRANSFER_ESTALE;
    pthread_mutex_lock(&p->mu);
    memset(info, 0, sizeof *info);
    snprintf(info->name, sizeof info->name, "%s", p->name);
    snprintf(info->host_id, sizeof info->host_id, "%s", p->desc.host_id);
    info->pid = p->desc.pid;
    info->protocol = e->tp[p->pref]->ops->proto;
    info->tcp_proto_version = p->desc.tcp_proto_version;
    info->num_buffers = p->desc.buffers.n;
    info->num_data_addrs = p->desc.num_data_addrs;
    pthread_mutex_unlock(&p->mu);
    return 0;
}

int transfer_segment_get_buffers(transfer_engine *e, transfer_segment seg,
                                 transfer_buffer_info *out, size_t max) {
    if (!e || (!out && max)) return TRANSFER_EINVAL;
    peer *p = peer_lookup(e, seg);
    if (!p) return TRANSFER_ESTALE;
    pthread_mutex_lock(&p->mu);
    size_t n = p->desc.buffers.n < max ? p->desc.buffers.n : max;
    for (size_t i = 0; i < n; i++) {
        out[i].addr = p->desc.buffers.v[i].addr;
        out[i].length = p->desc.buffers.v[i].length;
        snprintf(out[i].location, sizeof out[i].location, "%s", p->desc.buffers.v[i].location);
    }
    pthread_mutex_unlock(&p->mu);
    return (int)n;
}

/* ---- op completion (the transports' sink) ---------------------------------- */

static void op_done(void *ctx, xfer_op *op, int err) {
    transfer_engine *e = ctx;
    if (err == 0) {
        atomic_fetch_add(op->opcode == TRANSFER_WRITE ? &e->bytes_written : &e->bytes_read,
                         op->len);
    }
    pthread_mutex_lock(&e->batches.mu);
    batch *b = op->batch;
    transfer_state before = b->reqs[op->req].state;
    batch_chunk_done_locked(b, op->req, op->len, err);
    transfer_state after = b->reqs[op->req].state;
    b->ops_inflight--;
    pthread_mutex_unlock(&e->batches.mu);
    if (before == TRANSFER_STATE_PENDING && after != TRANSFER_STATE_PENDING)
        atomic_fetch_add(after == TRANSFER_STATE_COMPLETED ? &e->requests_ok : &e->requests_failed,
                         1);
    free(op);
}

/* A transport cannot serve op's peer (shm refused by the kernel): move the
 * peer to the fallback and re-route op there. */
static void op_reroute(void *ctx, xfer_op *op, int err) {
    transfer_engine *e = ctx;
    peer *p = op->peer;
    int fb = e->fb;
    pthread_mutex_lock(&p->mu);
    if (p->pref != fb) {
        const transport_ops *from = e->tp[p->pref]->ops;
        p->pref = fb;
        atomic_fetch_add(&e->shm_fallbacks, 1);
        LOG_W(MOD, "segment %s: %s; using %s", p->name,
              from->reroute_why ? from->reroute_why : from->name, e->tp[fb]->ops->name);
    }
    int rc = peer_conn_locked(e, p, fb);
    void *conn = p->conn[fb];
    pthread_mutex_unlock(&p->mu);
    (void)err;
    op->next = NULL;
    pthread_mutex_lock(&e->batches.mu); /* the status says the fallback carried it too */
    op->batch->reqs[op->req].transports |= 1u << (unsigned)e->tp[fb]->ops->proto;
    pthread_mutex_unlock(&e->batches.mu);
    if (rc)
        op_done(e, op, rc);
    else
        e->tp[fb]->ops->submit(e->tp[fb], conn, op);
}

/* ---- batches ------------------------------------------------------------- */

int transfer_batch_alloc(transfer_engine *e, size_t max_requests, transfer_batch *out) {
    if (!e) return TRANSFER_EINVAL;
    return batch_table_alloc(&e->batches, max_requests, out);
}

/* The peer's buffer holding [addr, +len) (copied to *out): 1, or 0 when its
 * descriptor has none — after re-fetching the descriptor once per submit
 * (it may have registered more since) when `refetch` is set. */
static int remote_entry(transfer_engine *e, peer *p, uint64_t addr, size_t len, int refetch,
                        int *refreshed, registry_entry *out) {
    pthread_mutex_lock(&p->mu);
    const registry_entry *r = registry_find(&p->desc.buffers, addr, len);
    if (!r && refetch && !*refreshed) {
        *refreshed = 1;
        if (peer_fetch_locked(e, p) == 0) r = registry_find(&p->desc.buffers, addr, len);
    }
    if (r) *out = *r;
    pthread_mutex_unlock(&p->mu);
    return r != NULL;
}

typedef struct route {
    peer *p;
    int t;      /* transport index */
    void *conn; /* its state for p */
    size_t stripe;
    int device;            /* local memory on cuda:device, or -1 */
    int have;              /* remote is the peer's buffer holding the range */
    registry_entry remote; /* (have) for the transport's prepare */
    int reject;            /* the preferred transport's range check failed: EREMOTEADDR */
} route;

/* Pick the transport for one request: the peer's preferred one when it
 * reaches both sides' memory, else the first in table order that does.
 * Caller holds p->mu.  0, or TRANSFER_EINVAL when none reaches. */
static int choose_locked(transfer_engine *e, peer *p, const char *local_loc,
                         const registry_entry *remote, int *t_out) {
    transport_peer v;
    peer_view_locked(e, p, &v);
    /* Those tried first (device memory on both sides of one host: cuda_ipc
     * before anything but an explicit tcp). */
    for (int t = 0; t < e->ntp; t++)
        if (t != p->pref && e->tp[t] && (e->tp[t]->flags & TRANSPORT_FIRST) &&
            e->tp[t]->ops->can_reach(e->tp[t], &v, local_loc, remote)) {
            *t_out = t;
            return 0;
        }
    if (e->tp[p->pref]->ops->can_reach(e->tp[p->pref], &v, local_loc, remote)) {
        *t_out = p->pref;
        return 0;
    }
    for (int t = 0; t < e->ntp; t++)
        if (t != p->pref && e->tp[t] && e->tp[t]->ops->can_reach(e->tp[t], &v, local_loc, remote)) {
            *t_out = t;
            return 0;
        }
    return TRANSFER_EINVAL;
}

int transfer_batch_submit(transfer_engine *e, transfer_batch h, const transfer_request *reqs,
                          size_t n) {
    if (!e || (!reqs && n)) return TRANSFER_EINVAL;
    if (n == 0) return 0;
    route *rt = calloc(n, sizeof *rt);
    if (!rt) return TRANSFER_ENOMEM;
    int rc = 0, refreshed = 0;
    size_t nops = 0;
    /* 1. Validate everything before anything is queued. */
    uint64_t llo = 0, lhi = 0; /* the local registration of the last routed request */
    for (size_t i = 0; i < n && rc == 0; i++) {
        const transfer_request *r = &reqs[i];
        char loc[32] = "";
        uint64_t la = (uint64_t)(uintptr_t)r->local;
        /* A request to the same segment, inside the same local registration and the same
         * remote buffer as the one before (a request's blocks, one layer of them), routes as
         * it did: no lookups or locks again. */
        if (i > 0 && rt[i - 1].p && !rt[i - 1].reject && rt[i - 1].have &&
            r->target == reqs[i - 1].target && r->length > 0 && r->local &&
            (r->opcode == TRANSFER_READ || r->opcode == TRANSFER_WRITE) && la >= llo && la < lhi &&
            r->length <= lhi - la && r->remote_addr >= rt[i - 1].remote.addr &&
            r->remote_addr < rt[i - 1].remote.addr + rt[i - 1].remote.length &&
            r->length <= rt[i - 1].remote.addr + rt[i - 1].remote.length - r->remote_addr) {
            rt[i] = rt[i - 1];
            nops += (r->length + rt[i].stripe - 1) / rt[i].stripe;
            continue;
        }
        if ((r->opcode != TRANSFER_READ && r->opcode != TRANSFER_WRITE) || r->length == 0 ||
            !r->local) {
            LOG_E(MOD, "submit: request %zu is invalid (opcode %d, length %zu)", i, (int)r->opcode,
                  r->length);
            rc = TRANSFER_EINVAL;
        } else if (!local_registered(e, r->local, r->length, loc, sizeof loc, &llo, &lhi)) {
            LOG_E(MOD,
                  "submit: request %zu: local range [%p, +%zu) is not inside a registered buffer",
                  i, r->local, r->length);
            rc = TRANSFER_ENOTREG;
        } else if (!(rt[i].p = peer_lookup(e, r->target))) {
            LOG_E(MOD, "submit: request %zu names an unknown or closed segment", i);
            rc = TRANSFER_ESTALE;
        }
        if (rc) break;
        peer *p = rt[i].p;
        rt[i].device = -1;
        if (location_is_device(loc)) transport_location_parse_device(loc, &rt[i].device);
        /* shm needs the range in the peer's descriptor (the target's
         * threads do not check it), rdma its keys: a miss re-fetches it once. */
        registry_entry *remote = &rt[i].remote;
        pthread_mutex_lock(&p->mu);
        unsigned pflags = e->tp[p->pref]->flags;
        pthread_mutex_unlock(&p->mu);
        int have = remote_entry(e, p, r->remote_addr, r->length, (pflags & TRANSPORT_REFETCH) != 0,
                                &refreshed, remote);
        rt[i].have = have;
        pthread_mutex_lock(&p->mu);
        if ((pflags & TRANSPORT_RANGE_CHECK) && !have && rt[i].device < 0)
            rt[i].reject = 1; /* the range check: the request fails, the batch goes on */
        else
            rc = choose_locked(e, p, loc, have ? remote : NULL, &rt[i].t);
        if (rt[i].reject) {
        } else if (rc) {
            LOG_E(MOD,
                  "submit: request %zu: no transport reaches local %s memory and the peer's "
                  "%s memory (device memory needs the device-memory ops on both sides)",
                  i, loc, have ? remote->location : "unlisted");
        } else {
            rc = peer_conn_locked(e, p, rt[i].t);
            rt[i].conn = p->conn[rt[i].t];
            if (rc && rt[i].t != e->fb && (e->tp[rt[i].t]->flags & TRANSPORT_OPEN_FALLBACK)) {
                /* e.g. no rdma queue pair: the fallback, as with no NIC */
                LOG_W(MOD, "segment %s: %s connection failed; using %s", p->name,
                      e->tp[rt[i].t]->ops->name, e->tp[e->fb]->ops->name);
                p->pref = e->fb;
                rc = choose_locked(e, p, loc, have ? remote : NULL, &rt[i].t);
                if (rc == 0) rc = peer_conn_locked(e, p, rt[i].t);
                rt[i].conn = p->conn[rt[i].t];
            }
        }
        pthread_mutex_unlock(&p->mu);
        if (rc) break;
        if (rt[i].reject) continue;
        transport *tp = e->tp[rt[i].t];
        rt[i].stripe =
            tp->ops->stripe_for ? tp->ops->stripe_for(tp, rt[i].device >= 0) : tp->stripe;
        nops += (r->length + rt[i].stripe - 1) / rt[i].stripe;
    }
    xfer_op **ops = rc == 0 ? calloc(nops ? nops : 1, sizeof *ops) : NULL;
    if (rc == 0 && !ops) rc = TRANSFER_ENOMEM;
    for (size_t k = 0; rc == 0 && k < nops; k++)
        if (!(ops[k] = calloc(1, sizeof *ops[k]))) rc = TRANSFER_ENOMEM;
    /* 2. Claim request slots. */
    size_t base = 0;
    batch *b = NULL;
    if (rc == 0) {
        pthread_mutex_lock(&e->batches.mu);
        b = batch_table_lookup_locked(&e->batches, h);
        if (!b)
            rc = TRANSFER_ESTALE;
        else if (b->n + n > b->cap)
            rc = TRANSFER_ENOSPACE;
        else {
            base = b->n;
            b->n += n;
            b->ops_inflight += (uint32_t)nops;
            for (size_t i = 0; i < n; i++) {
                batch_req *q = &b->reqs[base + i];
                q->transferred = 0;
                q->transports = rt[i].reject ? 0 : 1u << (unsigned)e->tp[rt[i].t]->ops->proto;
                if (rt[i].reject) {
                    q->state = TRANSFER_STATE_FAILED;
                    q->error = TRANSFER_EREMOTEADDR;
                    atomic_fetch_add(&e->requests_failed, 1);
                } else {
                    q->state = TRANSFER_STATE_PENDING;
                    q->error = 0;
                    q->chunks_left = (uint32_t)((reqs[i].length + rt[i].stripe - 1) / rt[i].stripe);
                    b->reqs_pending++;
                }
            }
        }
        pthread_mutex_unlock(&e->batches.mu);
    }
    if (rc) {
        if (rc == TRANSFER_ESTALE && b == NULL && ops) LOG_E(MOD, "submit: stale batch handle");
        for (size_t k = 0; ops && k < nops; k++)
            free(ops[k]);
        free(ops);
        free(rt);
        return rc;
    }
    /* 3. Cut into chunks; each run of consecutive requests for the same
     * peer and transport goes to it as one list. */
    size_t k = 0;
    xfer_op *head = NULL, *tail = NULL;
    int cur = -1;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && rt[i].reject) continue;
        if (head && (i == n || (size_t)cur >= n || rt[i].p != rt[cur].p || rt[i].t != rt[cur].t)) {
            e->tp[rt[cur].t]->ops->submit(e->tp[rt[cur].t], rt[cur].conn, head);
            head = tail = NULL;
        }
        if (i == n) break;
        cur = (int)i;
        const transfer_request *r = &reqs[i];
        size_t stripe = rt[i].stripe;
        uint64_t deadline = request_deadline(e, r->length);
        for (size_t off = 0; off < r->length; off += stripe) {
            xfer_op *op = ops[k++];
            op->next = NULL;
            op->batch = b;
            op->canceled = &b->canceled;
            op->peer = rt[i].p;
            op->req = (uint32_t)(base + i);
            op->opcode = (uint8_t)r->opcode;
            op->remote = r->remote_addr + off;
            op->len = r->length - off < stripe ? r->length - off : stripe;
            op->deadline_ns = deadline;
            op->device = rt[i].device;
            op->local = (char *)r->local + off;
            transport *tp = e->tp[rt[i].t];
            if (tp->ops->prepare) tp->ops->prepare(tp, op, rt[i].have ? &rt[i].remote : NULL);
            if (tail)
                tail->next = op;
            else
                head = op;
            tail = op;
        }
    }
    free(ops);
    free(rt);
    return 0;
}

int transfer_batch_wait(transfer_engine *e, transfer_batch h, uint64_t timeout_ns) {
    if (!e) return TRANSFER_EINVAL;
    uint64_t deadline = clock_now_ns() + timeout_ns;
    if (deadline < timeout_ns) deadline = UINT64_MAX;
    pthread_mutex_lock(&e->batches.mu);
    batch *b = batch_table_lookup_locked(&e->batches, h);
    if (!b) {
        pthread_mutex_unlock(&e->batches.mu);
        return TRANSFER_ESTALE;
    }
    int rc = 0;
    b->waiters++;
    while (b->reqs_pending > 0) {
        if (clock_now_ns() >= deadline) {
            rc = TRANSFER_ETIMEDOUT;
            break;
        }
        struct timespec ts = clock_to_timespec(deadline);
        pthread_cond_timedwait(&b->cv, &e->batches.mu, &ts);
    }
    b->waiters--;
    if (rc == 0)
        for (size_t i = 0; i < b->n; i++)
            if (b->reqs[i].state != TRANSFER_STATE_COMPLETED) {
                rc = b->reqs[i].error ? b->reqs[i].error : TRANSFER_ECANCELED;
                break;
            }
    pthread_mutex_unlock(&e->batches.mu);
    return rc;
}

int transfer_batch_get_status(transfer_engine *e, transfer_batch h, size_t index,
                              transfer_status *st) {
    if (!e || !st) return TRANSFER_EINVAL;
    pthread_mutex_lock(&e->batches.mu);
    batch *b = batch_table_lookup_locked(&e->batches, h);
    int rc = !b ? TRANSFER_ESTALE : index >= b->n ? TRANSFER_EINVAL : 0;
    if (rc == 0) {
        st->state = b->reqs[index].state;
        st->error = b->reqs[index].error;
        st->transferred_bytes = b->reqs[index].transferred;
        st->transports = b->reqs[index].transports;
    }
    pthread_mutex_unlock(&e->batches.mu);
    return rc;
}

int transfer_batch_get_overall(transfer_engine *e, transfer_batch h, transfer_status *st) {
    if (!e || !st) return TRANSFER_EINVAL;
    pthread_mutex_lock(&e->batches.mu);
    batch *b = batch_table_lookup_locked(&e->batches, h);
    if (!b) {
        pthread_mutex_unlock(&e->batches.mu);
        return TRANSFER_ESTALE;
    }
    memset(st, 0, sizeof *st);
    st->state = b->n ? TRANSFER_STATE_COMPLETED : TRANSFER_STATE_WAITING;
    for (size_t i = 0; i < b->n; i++) {
        const batch_req *q = &b->reqs[i];
        st->transferred_bytes += q->transferred;
        st->transports |= q->transports;
        if (q->state == TRANSFER_STATE_PENDING)
            st->state = TRANSFER_STATE_PENDING;
        else if (q->state != TRANSFER_STATE_COMPLETED && st->state != TRANSFER_STATE_PENDING &&
                 st->error == 0) {
            st->state = q->state;
            st->error = q->error;
        }
    }
    pthread_mutex_unlock(&e->batches.mu);
    return 0;
}

int transfer_batch_cancel(transfer_engine *e, transfer_batch h) {
    if (!e) return TRANSFER_EINVAL;
    pthread_mutex_lock(&e->batches.mu);
    batch *b = batch_table_lookup_locked(&e->batches, h);
    if (b) atomic_store(&b->canceled, 1);
    pthread_mutex_unlock(&e->batches.mu);
    if (!b) return TRANSFER_ESTALE;
    /* Queued chunks end now where the transport can drop them (the others
     * see the flag before they go out).  b is only compared, never read. */
    pthread_mutex_lock(&e->peers_mu);
    for (size_t i = 0; i < e->npeers; i++) {
        peer *p = e->peers[i];
        pthread_mutex_lock(&p->mu);
        for (int t = 0; t < e->ntp; t++)
            if (p->conn[t] && e->tp[t]->ops->cancel) e->tp[t]->ops->cancel(e->tp[t], p->conn[t], b);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&e->peers_mu);
    return 0;
}

int transfer_batch_free(transfer_engine *e, transfer_batch h) {
    if (!e) return TRANSFER_EINVAL;
    pthread_mutex_lock(&e->batches.mu);
    int rc = batch_table_free_locked(&e->batches, h);
    pthread_mutex_unlock(&e->batches.mu);
    return rc;
}

/* ---- synchronous convenience ---------------------------------------------- */

/* Requests of batch h not yet ended (0 for an unknown batch). */
static size_t batch_pending(transfer_engine *e, transfer_batch h) {
    pthread_mutex_lock(&e->batches.mu);
    batch *b = batch_table_lookup_locked(&e->batches, h);
    size_t n = b ? b->reqs_pending : 0;
    pthread_mutex_unlock(&e->batches.mu);
    return n;
}

static int sync_op(transfer_engine *e, const char *target, transfer_opcode opcode,
                   void *const local[], const uint64_t remote[], const size_t len[], size_t n,
                   unsigned *transports) {
    if (transports) *transports = 0;
    if (!e || !target || (n && (!local || !remote || !len))) return TRANSFER_EINVAL;
    if (n == 0) return 0;
    transfer_segment seg;
    int rc = transfer_open_segment(e, target, &seg);
    if (rc) return rc;
    transfer_request *reqs = calloc(n, sizeof *reqs);
    if (!reqs) return TRANSFER_ENOMEM;
    size_t longest = 0;
    for (size_t i = 0; i < n; i++) {
        reqs[i] = (transfer_request){opcode, local[i], seg, remote[i], len[i]};
        if (len[i] > longest) longest = len[i];
    }
    transfer_batch b;
    rc = transfer_batch_alloc(e, n, &b);
    if (rc == 0) {
        rc = transfer_batch_submit(e, b, reqs, n);
        if (rc == 0) {
            /* Each chunk has its own deadline; this outer one only guards
             * against a transport bug. */
            uint64_t t = e->cfg.timeout_base_ns * 2 +
                         (uint64_t)(e->cfg.timeout_per_byte_ns * (double)longest * 2);
            rc = transfer_batch_wait(e, b, t);
            /* ETIMEDOUT is also the result of a chunk that timed out: only a
             * batch still pending is cancelled and waited for (looping on the
             * result would spin forever on a finished, timed-out batch). */
            if (rc == TRANSFER_ETIMEDOUT && batch_pending(e, b)) {
                transfer_batch_cancel(e, b);
                while (batch_pending(e, b))
                    transfer_batch_wait(e, b, NS_PER_S);
                rc = TRANSFER_ETIMEDOUT;
            }
        }
        transfer_status all;
        if (transports && transfer_batch_get_overall(e, b, &all) == 0) *transports = all.transports;
        transfer_batch_free(e, b);
    }
    free(reqs);
    return rc;
}

int transfer_sync_write(transfer_engine *e, const char *target, void *const src[],
                        const uint64_t dst[], const size_t len[], size_t n) {
    return sync_op(e, target, TRANSFER_WRITE, src, dst, len, n, NULL);
}

int transfer_sync_write_via(transfer_engine *e, const char *target, void *const src[],
                            const uint64_t dst[], const size_t len[], size_t n,
                            unsigned *transports) {
    return sync_op(e, target, TRANSFER_WRITE, src, dst, len, n, transports);
}

const char *transfer_protocol_name(transfer_protocol p) {
    switch (p) {
    case TRANSFER_PROTO_AUTO:
        return "auto";
    case TRANSFER_PROTO_TCP:
        return "tcp";
    case TRANSFER_PROTO_SHM:
        return "shm";
    case TRANSFER_PROTO_RDMA:
        return "rdma";
    case TRANSFER_PROTO_CUDA_IPC:
        return "cuda_ipc";
    }
    return "?";
}

int transfer_sync_read(transfer_engine *e, const char *target, void *const dst[],
                       const uint64_t src[], const size_t len[], size_t n) {
    return sync_op(e, target, TRANSFER_READ, dst, src, len, n, NULL);
}

void transfer_engine_get_stats(transfer_engine *e, transfer_stats *out) {
    memset(out, 0, sizeof *out);
    if (!e) return;
    out->bytes_written = atomic_load(&e->bytes_written);
    out->bytes_read = atomic_load(&e->bytes_read);
    out->requests_ok = atomic_load(&e->requests_ok);
    out->requests_failed = atomic_load(&e->requests_failed);
    out->bytes_served = atomic_load(&e->bytes_served);
    out->requests_rejected = atomic_load(&e->requests_rejected);
    out->shm_fallbacks = atomic_load(&e->shm_fallbacks);
    out->auth_refused = atomic_load(&e->auth_refused);
    pthread_mutex_lock(&e->peers_mu);
    for (size_t i = 0; i < e->npeers; i++) {
        peer *p = e->peers[i];
        pthread_mutex_lock(&p->mu);
        for (int t = 0; t < e->ntp; t++)
            if (p->conn[t] && e->tp[t]->ops->retries)
                out->path_retries += e->tp[t]->ops->retries(e->tp[t], p->conn[t]);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&e->peers_mu);
}
