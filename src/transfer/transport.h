/*
 * transport — the interface every data transport implements (tcp, shm,
 * rdma, ...): a table of operations that the engine selects per peer and,
 * where the memory on either side rules the preferred one out, per request.
 * A transport instance is created once per engine; open_peer() creates its
 * per-peer state (connections, queue pairs, a pid); submit() takes a list of
 * chunk ops (xfer_op.h, linked by next) for one peer and ends each through
 * the sink it was created with — never by calling into engine.c.
 */
#ifndef DISAGG_TRANSFER_TRANSPORT_H
#define DISAGG_TRANSFER_TRANSPORT_H

#include "base/net.h"
#include "disagg/transfer.h"
#include "transfer/segment_desc.h"
#include "transfer/xfer_op.h"

#include <stddef.h>
#include <stdint.h>

#define TRANSPORT_MAX_PATHS 16

/* A tcp path: local source address -> peer data address. */
typedef struct tcp_path {
    net_addr dst; /* peer data endpoint */
    net_addr src; /* local source address (has_src) */
    int has_src;
    char label[160]; /* "src -> dst", for logs */
} tcp_path;

/* What the engine knows about a peer when a transport opens it. */
typedef struct transport_peer {
    const char *name;         /* segment name */
    const segment_desc *desc; /* its descriptor (valid during open_peer only) */
    int same_host;            /* same boot id and pid namespace */
    const tcp_path *paths;    /* tcp paths (engine.c computes them from desc) */
    int npaths;
    const net_addr *rpc_addr; /* its handshake port (rdma connects its QPs there) */
} transport_peer;

/* Memory locations as the registry stores them ("cpu", "cpu:N", "cuda:N"). */
static inline int location_is_device(const char *loc) {
    return loc && loc[0] == 'c' && loc[1] == 'u' && loc[2] == 'd' && loc[3] == 'a';
}

/* Bits of registry_entry.reach (the descriptor's buffers[].transports). */
#define REACH_TCP  (1u << 0)
#define REACH_SHM  (1u << 1)
#define REACH_RDMA (1u << 2)
#define REACH_IPC  (1u << 3)

/* Whether a peer's buffer says bit is a transport that reaches it (a
 * Mooncake peer lists none: anything may try, the target decides). */
static inline int remote_reachable(const registry_entry *r, unsigned bit) {
    return !r || r->reach == 0 || (r->reach & bit) != 0;
}

struct transport;

typedef struct transport_ops {
    const char *name;        /* "tcp", "shm", "rdma": also the descriptor's name */
    transfer_protocol proto; /* what transfer_segment_info reports */
    /* Can this transport move bytes between local memory at local_loc and
     * the peer's buffer `remote` (its location and, from a disagg peer, the
     * transports it says reach it; NULL: not in the peer's descriptor, the
     * target decides)?  1 or 0. */
    int (*can_reach)(const struct transport *t, const transport_peer *p, const char *local_loc,
                     const registry_entry *remote);
    /* Per-peer state in *conn: 0 or a negative transfer_error (logged). */
    int (*open_peer)(struct transport *t, const transport_peer *p, void **conn);
    /* Take ownership of a list of ops (same peer); each ends through the sink. */
    void (*submit)(struct transport *t, void *conn, xfer_op *ops);
    /* Reap completions without blocking; the number reaped (NULL: the
     * transport's own threads complete ops). */
    int (*poll)(struct transport *t);
    /* End the peer's queued (not yet on the wire) ops of batch b now, as
     * TRANSFER_ECANCELED (NULL: the transport checks the flag itself). */
    void (*cancel)(struct transport *t, void *conn, const struct batch *b);
    /* The peer's descriptor was re-fetched (it may list more buffers):
     * NULL = the transport keeps nothing from it. */
    void (*update_peer)(struct transport *t, void *conn, const transport_peer *p);
    /* Ops retried on another path / NIC so far (stats; NULL = none). */
    uint64_t (*retries)(struct transport *t, void *conn);
    /* Stop the peer's state: queued and in-flight ops end CANCELED. */
    void (*close_peer)(struct transport *t, void *conn);
    void (*destroy)(struct transport *t);
} transport_ops;

typedef struct transport {
    const transport_ops *ops;
    const xfer_sink *sink;
    size_t stripe; /* requests are cut into chunks of at most this many bytes */
    void *state;   /* the implementation's */
} transport;

#endif
