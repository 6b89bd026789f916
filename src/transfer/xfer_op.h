/*
 * xfer_op — one unit of work on a transport: a chunk of one request of one
 * batch (large requests are striped into several).  A transport owns an op
 * from submit until it hands it to its sink (transport.h), which frees it.
 */
#ifndef DISAGG_TRANSFER_XFER_OP_H
#define DISAGG_TRANSFER_XFER_OP_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define XFER_OP_PRIV 48 /* bytes of transport-private state per op */

struct batch;
struct peer;
struct stage_slot;

typedef struct xfer_op {
    struct xfer_op *next;       /* queue link, owned by whoever holds the op */
    struct batch *batch;        /* owning batch (kept alive while ops are in flight) */
    const atomic_int *canceled; /* the batch's cancel flag (read without its lock) */
    struct peer *peer;          /* target segment */
    uint32_t req;               /* request index within the batch */
    uint8_t opcode;             /* TRANSFER_READ / TRANSFER_WRITE */
    char *local;                /* local bytes: source of WRITE, destination of READ */
    uint64_t remote;            /* absolute address in the target process */
    size_t len;                 /* bytes, > 0 */
    uint64_t deadline_ns;       /* clock_now_ns() value after which it fails */
    uint32_t tries;             /* paths tried so far (retry on another path / NIC) */
    /* Staged device memory (staging.h): local is the pinned slot; dev is
     * the device address the bytes come from / go to.  NULL slot = plain. */
    struct stage_slot *slot;
    char *dev;
    int device; /* N of "cuda:N" when dev is set */
    void *conn; /* the transport's per-peer state, for staged ops */
    /* The transport's own per-op state (transport_ops.prepare fills it;
     * e.g. rdma's remote keys and send-queue position). */
    _Alignas(8) unsigned char priv[XFER_OP_PRIV];
} xfer_op;

/* True when the op's batch was cancelled (skip it if not yet on the wire). */
static inline int xfer_op_canceled(const xfer_op *op) {
    return atomic_load(op->canceled);
}

/* Where transports hand their ops back (transfer_engine.c owns it):
 * done    — the op ended with err (0 = ok); the sink frees it;
 * reroute — this transport cannot serve the op's peer after all (e.g. the
 *           kernel refused shm): the engine moves the peer to another
 *           transport and resubmits the op there. */
typedef struct xfer_sink {
    void (*done)(void *ctx, xfer_op *op, int err);
    void (*reroute)(void *ctx, xfer_op *op, int err);
    void *ctx;
} xfer_sink;

static inline void xfer_done(const xfer_sink *s, xfer_op *op, int err) {
    s->done(s->ctx, op, err);
}

#endif
