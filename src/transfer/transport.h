/*
 * transport — the interface every data transport implements (tcp, shm,
 * rdma, cuda_ipc): a table of operations (NIXL's backend-plugin shape) that
 * the transfer engine selects per peer and, where the memory on either side
 * rules the preferred one out, per request.  The engine knows transports
 * only through this table (transports.c lists them); it never names one.
 *
 * A transport instance is created once per engine (create, from the
 * engine's transport_env).  Its lifetime on the two sides of a transfer:
 *   target side    — register_mem / deregister_mem (NIXL's registerMem /
 *                    deregisterMem: NIC keys, IPC handles), describe (what
 *                    goes into this engine's segment descriptor, NIXL's
 *                    getPublicData), accept (a peer's first contact through
 *                    the handshake port, e.g. rdma's queue-pair connect; a
 *                    transport with its own listener, tcp's data server,
 *                    starts it in create);
 *   initiator side — prefer / can_reach (selection), open_peer / update_peer
 *                    (NIXL's connect / loadRemoteMD), prepare + submit
 *                    (chunk ops, xfer_op.h, linked by next, each ended
 *                    through the sink it was created with — never by
 *                    calling into the engine), cancel, close_peer.
 */
#ifndef DISAGG_TRANSFER_TRANSPORT_H
#define DISAGG_TRANSFER_TRANSPORT_H

#include "base/net.h"
#include "disagg/transfer.h"
#include "transfer/registry.h"
#include "transfer/segment_desc.h"
#include "transfer/xfer_op.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define TRANSPORT_MAX         8  /* entries of the transport table (transports.c) */
#define TRANSPORT_MAX_DEVICES 16 /* "cuda:N": N in 0..TRANSPORT_MAX_DEVICES-1 */
#define TRANSPORT_MAX_IFACES  16 /* transport_env.ifaces */

/* What the engine knows about a peer when a transport opens it. */
typedef struct transport_peer {
    const char *name;         /* segment name */
    const segment_desc *desc; /* its descriptor (valid during open_peer only) */
    int same_host;            /* same boot id and pid namespace */
    const net_addr *rpc_addr; /* its handshake port (rdma connects its QPs there; tcp's
                                 default data host) */
} transport_peer;

/* Memory locations as the registry stores them ("cpu", "cpu:N", "cuda:N"). */
static inline int location_is_device(const char *loc) {
    return loc && loc[0] == 'c' && loc[1] == 'u' && loc[2] == 'd' && loc[3] == 'a';
}

/* Parse "cuda:N" into N (0..TRANSPORT_MAX_DEVICES-1): 0 or TRANSFER_EINVAL. */
int transport_location_parse_device(const char *loc, int *device);

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

/* Staged device-memory bytes (transfer_device_stats). */
typedef struct stage_stats {
    _Atomic uint64_t out, in;
} stage_stats;

/* What the engine gives every transport at create (it outlives them). */
typedef struct transport_env {
    const xfer_sink *sink;       /* where ops end */
    transfer_protocol protocol;  /* the engine's configured protocol */
    int lanes;                   /* tcp connections per path */
    size_t stripe;               /* chunk bytes of host-memory requests (tcp) */
    uint64_t connect_timeout_ns; /* connecting to a peer */
    uint64_t timeout_base_ns;    /* a request's deadline: base + per_byte * size */
    double timeout_per_byte_ns;
    const char *secret;      /* auth_secret, NULL = none */
    const char *device_name; /* the whitelist: NICs under rdma, interfaces otherwise */
    const char *self_name;   /* this engine's segment name (filled in before use) */
    const transfer_device_ops *const *dev; /* the installed device-memory ops (NULL inside) */
    stage_stats *stage;                    /* staged bytes (stats) */
    /* The target side. */
    pthread_rwlock_t *reg_lock;   /* guards regs; servers hold it (read) while bytes move */
    const registry *regs;         /* this engine's registrations */
    const char *hostname;         /* advertised host (numeric) */
    const net_addr *bind_host;    /* where listeners bind (port ignored) */
    uint16_t data_port;           /* the configured tcp data port (0 = ephemeral) */
    int max_conns_per_peer;       /* as configured (0 = $DISAGG_KV_MAX_CONNS_PER_PEER or default) */
    const net_iface_addr *ifaces; /* allowed local interface addresses */
    int nifaces;
    int whitelisted;                                          /* device_name names interfaces */
    _Atomic uint64_t *bytes_served, *rejected, *auth_refused; /* stats */
} transport_env;

/* transport.flags: how the engine routes around this transport. */
#define TRANSPORT_FIRST (1u << 0) /* tried before the peer's preferred one per request */
#define TRANSPORT_REFETCH                                                                          \
    (1u << 1) /* preferred: a range missing from the peer's                                        \
                 descriptor re-fetches it once per submit */
#define TRANSPORT_RANGE_CHECK                                                                      \
    (1u << 2) /* preferred: a host-memory request whose range the                                  \
                 peer does not list fails (TRANSFER_EREMOTEADDR) */
#define TRANSPORT_OPEN_FALLBACK                                                                    \
    (1u << 3)                        /* preferred: open_peer failing moves the peer to             \
                                        the fallback transport */
#define TRANSPORT_FALLBACK (1u << 4) /* reaches everything: where others fall back to */

struct transport;

typedef struct transport_ops {
    const char *name;        /* "tcp", "shm", "rdma": also the descriptor's name */
    transfer_protocol proto; /* what transfer_segment_info reports */
    /* The instance for env: 0, TRANSFER_ENOSEG = not in use here (the
     * engine goes on without it), or an error that fails the engine. */
    int (*create)(const transport_env *env, struct transport **out);
    /* Would this transport be the peer's preferred one: 1 or 0 (the engine
     * takes the first in table order), or a negative transfer_error that
     * fails opening the peer (logged).  NULL = never preferred. */
    int (*prefer)(const struct transport *t, const transport_peer *p);
    /* A local registration was added: keep what peers need in r (keys,
     * handles): 0 or a transfer_error (the registration fails).  NULL = none. */
    int (*register_mem)(struct transport *t, registry_entry *r);
    /* Before the registration r goes (NULL = nothing to undo). */
    void (*deregister_mem)(struct transport *t, const registry_entry *r);
    /* Add to this engine's segment descriptor d, whose buffers list every
     * registration of regs (same order): its own fields, per buffer its
     * keys and reach bit.  Caller holds the registration lock (read). */
    void (*describe)(struct transport *t, const registry *regs, segment_desc *d);
    /* The target side of a peer's first contact through the handshake port
     * (type-0 frame): a request body in, a reply (malloc'd JSON) out, or NULL
     * with err filled.  NULL = this transport takes none. */
    char *(*accept)(struct transport *t, const char *body, size_t len, char *err, size_t cap);
    /* Why ops come back through sink->reroute (the engine's log line). */
    const char *reroute_why;
    /* Can this transport move bytes between local memory at local_loc and
     * the peer's buffer `remote` (its location and, from a disagg peer, the
     * transports it says reach it; NULL: not in the peer's descriptor, the
     * target decides)?  1 or 0. */
    int (*can_reach)(const struct transport *t, const transport_peer *p, const char *local_loc,
                     const registry_entry *remote);
    /* Per-peer state in *conn: 0 or a negative transfer_error (logged). */
    int (*open_peer)(struct transport *t, const transport_peer *p, void **conn);
    /* Chunk bytes for a request whose local memory is on a device or not
     * (NULL: t->stripe). */
    size_t (*stripe_for)(const struct transport *t, int device);
    /* Fill op's transport-private part (op->priv) from the peer's buffer
     * holding it (remote: NULL when the peer's descriptor lists none);
     * called for each chunk before submit.  NULL = nothing to fill. */
    void (*prepare)(struct transport *t, xfer_op *op, const registry_entry *remote);
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
    const transport_env *env; /* set by create where the transport uses it */
    size_t stripe;            /* requests are cut into chunks of at most this many bytes */
    unsigned flags;           /* TRANSPORT_* */
    void *state;              /* the implementation's */
} transport;

/* The table (transports.c): in the order tried when the preferred one
 * cannot reach a request's memory; the fallback last. */
extern const transport_ops *const transport_table[];
extern const int transport_table_len;

#endif
