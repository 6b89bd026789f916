/*
 * batch — the batch table: generation-tagged handles (a stale or forged
 * handle is TRANSFER_ESTALE, never a use-after-free), per-request status and
 * the condition variable that transfer_batch_wait() sleeps on.  One mutex
 * guards the table and every batch in it; completions take it briefly.
 */
#ifndef DISAGG_TRANSFER_BATCH_H
#define DISAGG_TRANSFER_BATCH_H

#include "disagg/transfer.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

typedef struct batch_req {
    transfer_state state;
    int error;            /* first error of its chunks */
    size_t transferred;   /* bytes of completed chunks */
    uint32_t chunks_left; /* chunks not yet ended */
    unsigned transports;  /* bit (1u << transfer_protocol) per transport given chunks */
} batch_req;

typedef struct batch {
    transfer_batch handle; /* (generation << 32) | (slot + 1) */
    size_t cap;            /* max requests over its lifetime */
    size_t n;              /* requests submitted so far */
    batch_req *reqs;       /* (cap) */
    uint32_t ops_inflight; /* chunk ops still owned by transports */
    size_t reqs_pending;   /* submitted requests still PENDING */
    atomic_int canceled;   /* cancel requested (read by transports without the lock) */
    int waiters;           /* threads sleeping in transfer_batch_wait */
    pthread_cond_t cv;     /* broadcast when a request ends */
} batch;

typedef struct batch_table {
    pthread_mutex_t mu;
    batch **slots; /* (cap) NULL = free */
    uint32_t *gen; /* (cap) generation of each slot, bumped on free */
    size_t cap;
} batch_table;

int batch_table_init(batch_table *t);
/* Frees every batch (caller made sure no op is in flight). */
void batch_table_destroy(batch_table *t);
int batch_table_alloc(batch_table *t, size_t max_requests, transfer_batch *out);
/* Caller holds t->mu.  NULL if the handle is stale or malformed. */
batch *batch_table_lookup_locked(batch_table *t, transfer_batch h);
/* Caller holds t->mu; TRANSFER_EBUSY while ops are in flight. */
int batch_table_free_locked(batch_table *t, transfer_batch h);
/* Caller holds t->mu: one chunk of request `req` ended with err (0 = ok). */
void batch_chunk_done_locked(batch *b, uint32_t req, size_t bytes, int err);

#endif
