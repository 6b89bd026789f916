/*
 * transport_tcp — the tcp transport behind the transport interface
 * (transport.h): one tcp_client per peer; chunks whose local memory is on a
 * device go through the stager (staging.h) first.  The tcp clients end ops
 * through this transport's own sink, which hands staged ops back to the
 * stager (host->device copy, slot freed) before the engine sees them.
 */
#include "transfer/transport_tcp.h"

#include "base/clock.h"
#include "base/log.h"
#include "transfer/staging.h"
#include "transfer/tcp_client.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#define MOD "transfer.tcp"

typedef struct tcp_state {
    xfer_sink inner;        /* what the tcp clients end ops through */
    xfer_sink final;        /* what the stager ends staged ops through */
    const xfer_sink *outer; /* the engine's */
    tcp_transport_cfg cfg;
    pthread_mutex_t mu; /* guards stg creation */
    stager *stg;
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

static int tcp_open_peer(transport *t, const transport_peer *p, void **conn) {
    tcp_state *s = t->state;
    if (p->npaths == 0) {
        LOG_E(MOD, "segment %s has no usable tcp data address", p->name);
        return TRANSFER_ENOSEG;
    }
    tcp_conn *c = calloc(1, sizeof *c);
    if (!c) return TRANSFER_ENOMEM;
    int rc = tcp_client_create(&s->inner, p->paths, p->npaths, s->cfg.lanes,
                               s->cfg.connect_timeout_ns, s->cfg.secret, &c->client);
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
    pthread_mutex_destroy(&s->mu);
    free(s);
    free(t);
}

static const transport_ops TCP_OPS = {
    .name = "tcp",
    .proto = TRANSFER_PROTO_TCP,
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
    t->ops = &TCP_OPS;
    t->sink = sink;
    t->stripe = cfg->stripe;
    t->state = s;
    *out = t;
    return 0;
}

size_t tcp_transport_stripe_for(const transport *t, int staged) {
    return staged && t->stripe > STAGE_SLOT_BYTES ? STAGE_SLOT_BYTES : t->stripe;
}
