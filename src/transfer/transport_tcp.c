/*
 * transport_tcp — the tcp transport behind the transport interface
 * (transport.h): its target side is the data server (tcp_server.h, started
 * by create on the advertised host and each whitelisted interface address,
 * which the descriptor lists as data_addrs); its initiator side one
 * tcp_client per peer over the paths to the peer's data addresses; chunks
 * whose local memory is on a device go through the stager (staging.h)
 * first.  The tcp clients end ops through this transport's own sink, which
 * hands staged ops back to the stager (host->device copy, slot freed)
 * before the engine sees them.
 */
#include "transfer/transport_tcp.h"

#include "base/clock.h"
#include "base/log.h"
#include "transfer/staging.h"
#include "transfer/tcp_client.h"
#include "transfer/tcp_server.h"

#include <pthread.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MOD "transfer.tcp"

typedef struct tcp_state {
    xfer_sink inner;        /* what the tcp clients end ops through */
    xfer_sink final;        /* what the stager ends staged ops through */
    const xfer_sink *outer; /* the engine's */
    tcp_transport_cfg cfg;
    pthread_mutex_t mu; /* guards stg creation */
    stager *stg;
    /* The data server and what the descriptor advertises of it. */
    const transport_env *env;
    tcp_server *ts;
    uint16_t data_port;
    char data_addrs[SEGMENT_MAX_DATA_ADDRS][64]; /* whitelisted addresses listened on */
    int ndata_addrs;
} tcp_state;

typedef struct tcp_conn {
    tcp_client *client;
    atomic_int staged;  /* staged ops taken and not yet ended */
    atomic_int closing; /* close_peer started: staged ops are not sent */
} tcp_conn;

static void inner_done(void *ctx, xfer_op *op, int err) {
    tcp_state *s = ctx;
    if (op->dev)
        stager_complete(s->stg, op, err);
    else
        xfer_done(s->outer, op, err);
}

/* A staged op ended (slot already freed). */
static void final_done(void *ctx, xfer_op *op, int err) {
    tcp_state *s = ctx;
    tcp_conn *c = op->conn;
    xfer_done(s->outer, op, err);
    atomic_fetch_sub(&c->staged, 1);
}

static void inner_reroute(void *ctx, xfer_op *op, int err) {
    inner_done(ctx, op, err); /* tcp has nowhere else to go */
}

/* The stager staged a WRITE (or readied a READ's slot): send it. */
static void staged_send(void *ctx, xfer_op *op) {
    tcp_state *s = ctx;
    tcp_conn *c = op->conn;
    if (atomic_load(&c->closing)) {
        inner_done(s, op, TRANSFER_ECANCELED);
        return;
    }
    tcp_client_submit(c->client, op);
}

static int tcp_can_reach(const transport *t, const transport_peer *p, const char *local_loc,
                         const registry_entry *remote) {
    const tcp_state *s = t->state;
    (void)p;
    if (location_is_device(local_loc) && !*s->cfg.dev) return 0;
    return remote_reachable(remote, REACH_TCP);
}

/* Paths to p: one per advertised data endpoint, with a local source address
 * on the same subnet when a device_name whitelist is in force. */
static int peer_paths(const tcp_state *s, const transport_peer *p, tcp_path *paths) {
    const segment_desc *d = p->desc;
    const transport_env *env = s->env;
    int n = 0;
    char host[64];
    uint16_t port;
    if (d->num_data_addrs == 0) { /* a Mooncake peer, or no whitelist there */
        paths[0].dst = *p->rpc_addr;
        net_addr_set_port(&paths[0].dst, d->tcp_data_port);
        n = 1;
    }
    for (size_t i = 0; i < d->num_data_addrs && n < TCP_CLIENT_MAX_PATHS; i++) {
        if (net_split_host_port(d->data_addrs[i], host, sizeof host, &port, 0) != 0 ||
            net_resolve(host, port, &paths[n].dst) != 0) {
            LOG_W("transfer", "segment %s advertises an unusable data address '%s'", p->name,
                  d->data_addrs[i]);
            continue;
        }
        n++;
    }
    for (int i = 0; i < n; i++) {
        paths[i].has_src = 0;
        if (env->whitelisted) {
            int best = -1;
            for (int k = 0; k < env->nifaces; k++) {
                if (env->ifaces[k].addr.ss.ss_family != paths[i].dst.ss.ss_family) continue;
                if (net_same_subnet(&env->ifaces[k].addr, &paths[i].dst,
                                    env->ifaces[k].prefix_len)) {
                    best = k;
                    break;
                }
                if (best < 0) best = k;
            }
            if (best >= 0) {
                paths[i].src = env->ifaces[best].addr;
                paths[i].has_src = 1;
            }
        }
        char dst[80], src[80] = "any";
        net_addr_format(&paths[i].dst, dst, sizeof dst);
        if (paths[i].has_src) net_addr_host(&paths[i].src, src, sizeof src);
        snprintf(paths[i].label, sizeof paths[i].label, "%s -> %s", src, dst);
    }
    return n;
}

static int tcp_open_peer(transport *t, const transport_peer *p, void **conn) {
    tcp_state *s = t->state;
    tcp_path paths[TCP_CLIENT_MAX_PATHS];
    int npaths = peer_paths(s, p, paths);
    if (npaths == 0) {
        LOG_E(MOD, "segment %s has no usable tcp data address", p->name);
        return TRANSFER_ENOSEG;
    }
    tcp_conn *c = calloc(1, sizeof *c);
    if (!c) return TRANSFER_ENOMEM;
    int rc = tcp_client_create(&s->inner, paths, npaths, s->cfg.lanes, s->cfg.connect_timeout_ns,
                               s->cfg.secret, &c->client);
    if (rc) {
        free(c);
        return rc;
    }
    *conn = c;
    return 0;
}

static void tcp_submit(transport *t, void *conn, xfer_op *ops) {
    tcp_state *s = t->state;
    tcp_conn *c = conn;
    while (ops) {
        xfer_op *op = ops;
        ops = op->next;
        op->next = NULL;
        if (!op->dev) {
            tcp_client_submit(c->client, op);
            continue;
        }
        op->conn = c;
        pthread_mutex_lock(&s->mu);
        int rc = s->stg ? 0
                        : stager_create(*s->cfg.dev, s->cfg.stage_stats, &s->final, staged_send, s,
                                        &s->stg);
        pthread_mutex_unlock(&s->mu);
        if (rc) {
            xfer_done(s->outer, op, rc);
            continue;
        }
        atomic_fetch_add(&c->staged, 1);
        stager_submit(s->stg, op);
    }
}

static void tcp_cancel(transport *t, void *conn, const struct batch *b) {
    (void)t;
    tcp_client_cancel(((tcp_conn *)conn)->client, b);
}

static uint64_t tcp_retries(transport *t, void *conn) {
    (void)t;
    return tcp_client_retries(((tcp_conn *)conn)->client);
}

static void tcp_close_peer(transport *t, void *conn) {
    (void)t;
    tcp_conn *c = conn;
    if (!c) return;
    atomic_store(&c->closing, 1);
    /* Staged ops still with the stager come back through staged_send (and
     * end there) or are already on the client, whose destroy ends them. */
    tcp_client_destroy(c->client);
    struct timespec ms = {0, 1000000};
    while (atomic_load(&c->staged) > 0)
        nanosleep(&ms, NULL);
    free(c);
}

static void tcp_destroy(transport *t) {
    if (!t) return;
    tcp_state *s = t->state;
    stager_destroy(s->stg);
    tcp_server_stop(s->ts);
    pthread_mutex_destroy(&s->mu);
    free(s);
    free(t);
}

static int tcp_create(const transport_env *env, transport **out);

static int tcp_prefer(const transport *t, const transport_peer *p) {
    (void)t;
    (void)p;
    return 1; /* when nothing better is */
}

/* The data port, the whitelisted data addresses, and every buffer. */
static void tcp_describe(transport *t, const registry *regs, segment_desc *d) {
    const tcp_state *s = t->state;
    (void)regs;
    d->tcp_data_port = s->data_port;
    for (int i = 0; i < s->ndata_addrs && d->num_data_addrs < SEGMENT_MAX_DATA_ADDRS; i++)
        snprintf(d->data_addrs[d->num_data_addrs++], sizeof d->data_addrs[0], "%s",
                 s->data_addrs[i]);
    for (size_t i = 0; i < d->buffers.n; i++)
        d->buffers.v[i].reach |= REACH_TCP;
}

/* Chunk size for a request (staged: at most one staging slot). */
static size_t tcp_stripe_for(const transport *t, int device) {
    return device && t->stripe > STAGE_SLOT_BYTES ? STAGE_SLOT_BYTES : t->stripe;
}

/* Device memory is staged: tcp picks the host buffer, op->dev is the source. */
static void tcp_prepare(transport *t, xfer_op *op, const registry_entry *remote) {
    (void)t;
    (void)remote;
    if (op->device >= 0 && !op->dev) {
        op->dev = op->local;
        op->local = NULL;
    }
}

const transport_ops tcp_transport_ops = {
    .name = "tcp",
    .proto = TRANSFER_PROTO_TCP,
    .create = tcp_create,
    .prefer = tcp_prefer,
    .describe = tcp_describe,
    .stripe_for = tcp_stripe_for,
    .prepare = tcp_prepare,
    .can_reach = tcp_can_reach,
    .open_peer = tcp_open_peer,
    .submit = tcp_submit,
    .cancel = tcp_cancel,
    .retries = tcp_retries,
    .close_peer = tcp_close_peer,
    .destroy = tcp_destroy,
};

int tcp_transport_create(const xfer_sink *sink, const tcp_transport_cfg *cfg, transport **out) {
    transport *t = calloc(1, sizeof *t);
    tcp_state *s = calloc(1, sizeof *s);
    if (!t || !s) {
        free(t);
        free(s);
        return TRANSFER_ENOMEM;
    }
    s->outer = sink;
    s->cfg = *cfg;
    s->inner = (xfer_sink){.done = inner_done, .reroute = inner_reroute, .ctx = s};
    s->final = (xfer_sink){.done = final_done, .reroute = final_done, .ctx = s};
    pthread_mutex_init(&s->mu, NULL);
    t->ops = &tcp_transport_ops;
    t->sink = sink;
    t->stripe = cfg->stripe;
    t->state = s;
    *out = t;
    return 0;
}

/* The data connections one peer address may hold: the configured value,
 * else $DISAGG_KV_MAX_CONNS_PER_PEER, else TCP_MAX_PER_PEER.  0 or
 * TRANSFER_EINVAL (logged). */
static int conns_per_peer(const transport_env *env, int *out) {
    int per_peer = env->max_conns_per_peer;
    const char *pp_env = getenv("DISAGG_KV_MAX_CONNS_PER_PEER");
    if (per_peer == 0 && pp_env && *pp_env) {
        char *end;
        errno = 0;
        long v = strtol(pp_env, &end, 10);
        if (errno || *end || v < 1 || v > TCP_MAX_CONNS) {
            LOG_E("transfer", "DISAGG_KV_MAX_CONNS_PER_PEER='%s' is not an integer in 1..%d",
                  pp_env, TCP_MAX_CONNS);
            return TRANSFER_EINVAL;
        }
        per_peer = (int)v;
    }
    if (per_peer < 0 || per_peer > TCP_MAX_CONNS) {
        LOG_E("transfer", "max_conns_per_peer %d out of range (accepted: 1..%d, 0 = default %d)",
              per_peer, TCP_MAX_CONNS, TCP_MAX_PER_PEER);
        return TRANSFER_EINVAL;
    }
    *out = per_peer ? per_peer : TCP_MAX_PER_PEER;
    return 0;
}

/* Start the data server: on the bind host with the configured port, and
 * with that same port on each whitelisted interface address that the host's
 * listener does not already cover (docs/transfer.md, Security). */
static int data_server_start(tcp_state *s) {
    const transport_env *env = s->env;
    int per_peer;
    int rc = conns_per_peer(env, &per_peer);
    if (rc) return rc;
    net_addr binds[1 + TRANSPORT_MAX_IFACES];
    int ok[1 + TRANSPORT_MAX_IFACES], nb = 0, listener_of[TRANSPORT_MAX_IFACES];
    binds[nb] = *env->bind_host;
    net_addr_set_port(&binds[nb++], env->data_port);
    char bound_host[64];
    net_addr_host(env->bind_host, bound_host, sizeof bound_host);
    int wildcard = !strcmp(bound_host, "0.0.0.0") || !strcmp(bound_host, "::");
    int nifaces = env->nifaces < TRANSPORT_MAX_IFACES ? env->nifaces : TRANSPORT_MAX_IFACES;
    for (int i = 0; env->whitelisted && i < nifaces; i++) {
        char h[64];
        net_addr_host(&env->ifaces[i].addr, h, sizeof h);
        if (wildcard || strcmp(h, env->hostname) == 0) {
            listener_of[i] = 0; /* served by the host's listener */
        } else {
            listener_of[i] = nb;
            binds[nb++] = env->ifaces[i].addr;
        }
    }
    tcp_server_env senv = {.reg_lock = env->reg_lock,
                           .regs = env->regs,
                           .timeout_base_ns = env->timeout_base_ns,
                           .timeout_per_byte_ns = env->timeout_per_byte_ns,
                           .bytes_served = env->bytes_served,
                           .rejected = env->rejected,
                           .secret = env->secret,
                           .auth_refused = env->auth_refused,
                           .dev = env->dev,
                           .stage_stats = env->stage,
                           .max_conns_per_peer = per_peer};
    rc = tcp_server_start(binds, nb, &senv, &s->ts, &s->data_port, ok);
    if (rc != 0) return rc;
    for (int i = 0; env->whitelisted && i < nifaces; i++) {
        /* Advertise every whitelisted interface address whose listener is up. */
        if (!ok[listener_of[i]] || s->ndata_addrs == SEGMENT_MAX_DATA_ADDRS) continue;
        net_addr a = env->ifaces[i].addr;
        net_addr_set_port(&a, s->data_port);
        net_addr_format(&a, s->data_addrs[s->ndata_addrs++], sizeof s->data_addrs[0]);
    }
    return 0;
}

/* The table's entry: always there, the fallback of every other transport. */
static int tcp_create(const transport_env *env, transport **out) {
    tcp_transport_cfg cfg = {.lanes = env->lanes,
                             .connect_timeout_ns = env->connect_timeout_ns,
                             .secret = env->secret,
                             .stripe = env->stripe,
                             .dev = env->dev,
                             .stage_stats = env->stage};
    int rc = tcp_transport_create(env->sink, &cfg, out);
    if (rc) return rc;
    tcp_state *s = (*out)->state;
    s->env = env;
    (*out)->env = env;
    (*out)->flags = TRANSPORT_FALLBACK;
    if ((rc = data_server_start(s)) != 0) {
        tcp_destroy(*out);
        *out = NULL;
    }
    return rc;
}
