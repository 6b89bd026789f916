/*
 * xfer_op — one unit of work on a transport: a chunk of one request of one
 * batch (large requests are striped into several).  Transports own an op from
 * submit until they call engine_op_done(), which frees it.
 */
#ifndef DISAGG_TRANSFER_XFER_OP_H
#define DISAGG_TRANSFER_XFER_OP_H

#include <stddef.h>
#include <stdint.h>

struct batch;
struct peer;
struct transfer_engine;

typedef struct xfer_op {
    struct xfer_op *next; /* queue link, owned by whoever holds the op */
    struct batch *batch;  /* owning batch (kept alive while ops are in flight) */
    struct peer *peer;    /* target segment */
    uint32_t req;         /* request index within the batch */
    uint8_t opcode;       /* TRANSFER_READ / TRANSFER_WRITE */
    char *local;          /* local bytes: source of WRITE, destination of READ */
    uint64_t remote;      /* absolute address in the target process */
    size_t len;           /* bytes, > 0 */
    uint64_t deadline_ns; /* clock_now_ns() value after which it fails */
    uint32_t tries;       /* paths tried so far (tcp retry on another path) */
} xfer_op;

/* Defined in engine.c: account the op's result to its request, free it. */
void engine_op_done(struct transfer_engine *e, xfer_op *op, int err);
/* Defined in engine.c: true when the op's batch was cancelled (skip it). */
int engine_op_canceled(const xfer_op *op);

#endif
