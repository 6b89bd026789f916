/*
 * staging — tcp with device memory: pinned host staging buffers between the
 * device (through the installed transfer_device_ops) and the socket.
 *
 * Initiator (stager): the tcp transport hands it the chunk ops whose local
 * memory is on a device (op->dev).  Its thread takes a free slot (pinned
 * buffer + stream), for a WRITE copies device->host into it and then
 * submits the op to the tcp client with local = the slot; for a READ the
 * reply lands in the slot and the thread copies it host->device before the
 * op ends.  nslots chunks are in flight at once, so the copies of one chunk
 * overlap the socket transfer of the others.
 *
 * Target (stage_pair): a tcp server connection serving device memory
 * alternates between two slots: receive chunk k into slot k%2 while the
 * host->device copy of chunk k-1 runs on the other stream (WRITE); copy
 * chunk k+1 device->host while chunk k is sent (READ).
 */
#ifndef DISAGG_TRANSFER_STAGING_H
#define DISAGG_TRANSFER_STAGING_H

#include "disagg/transfer.h"
#include "transfer/transport.h"
#include "transfer/xfer_op.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define STAGE_SLOT_BYTES  (1u << 20) /* a staged chunk */
#define STAGE_SLOTS       8          /* initiator chunks in flight per engine */
#define STAGE_GATHER_MAX  64 /* small WRITEs staged together into one slot (one sync) */
#define STAGE_MAX_DEVICES TRANSPORT_MAX_DEVICES

typedef struct stage_slot {
    char *buf;                       /* pinned, STAGE_SLOT_BYTES */
    void *stream[STAGE_MAX_DEVICES]; /* created on first use per device */
    struct stage_slot *next;         /* free list */
    int refs;                        /* ops whose bytes are in it (small WRITEs share one) */
} stage_slot;

/* Parse "cuda:N" into N (0..STAGE_MAX_DEVICES-1): 0 or TRANSFER_EINVAL. */
int stage_parse_device(const char *loc, int *device);

/* The counters an engine keeps: stage_stats (transport.h). */

typedef struct stager stager;
/* submit(ctx, op): send a staged op (op->local is the slot) over tcp. */
typedef void (*stager_send_fn)(void *ctx, xfer_op *op);

int stager_create(const transfer_device_ops *dev, stage_stats *stats, const xfer_sink *sink,
                  stager_send_fn send, void *send_ctx, stager **out);
/* Take ownership of an op with op->dev set (op->local unused). */
void stager_submit(stager *s, xfer_op *op);
/* The tcp client finished a staged op: H2D for a READ, free the slot, end it. */
void stager_complete(stager *s, xfer_op *op, int err);
/* Waits for every staged op to end (callers stopped submitting). */
void stager_destroy(stager *s);

/* Target side: two slots of one connection. */
typedef struct stage_pair {
    const transfer_device_ops *dev;
    int device;
    char *buf[2];
    void *stream[2];
} stage_pair;

/* Make the pair ready for device `device` (allocates on first use). */
int stage_pair_ready(stage_pair *p, const transfer_device_ops *dev, int device);
void stage_pair_free(stage_pair *p);

#endif
