/* batch — see batch.h. */
#include "transfer/batch.h"

#include "base/clock.h"

#include <stdlib.h>
#include <string.h>

int batch_table_init(batch_table *t) {
    memset(t, 0, sizeof *t);
    return pthread_mutex_init(&t->mu, NULL) == 0 ? 0 : TRANSFER_ESYS;
}

static void batch_destroy(batch *b) {
    pthread_cond_destroy(&b->cv);
    free(b->reqs);
    free(b);
}

void batch_table_destroy(batch_table *t) {
    for (size_t i = 0; i < t->cap; i++)
        if (t->slots[i]) batch_destroy(t->slots[i]);
    free(t->slots);
    free(t->gen);
    pthread_mutex_destroy(&t->mu);
    memset(t, 0, sizeof *t);
}

int batch_table_alloc(batch_table *t, size_t max_requests, transfer_batch *out) {
    if (max_requests == 0 || max_requests > (1u << 24) || !out) return TRANSFER_EINVAL;
    batch *b = calloc(1, sizeof *b);
    if (!b) return TRANSFER_ENOMEM;
    b->reqs = calloc(max_requests, sizeof *b->reqs);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int crc = pthread_cond_init(&b->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (!b->reqs || crc) {
        free(b->reqs);
        free(b);
        return TRANSFER_ENOMEM;
    }
    b->cap = max_requests;
    pthread_mutex_lock(&t->mu);
    size_t slot = 0;
    while (slot < t->cap && t->slots[slot])
        slot++;
    if (slot == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        batch **s = realloc(t->slots, cap * sizeof *s);
        if (s) t->slots = s;
        uint32_t *g = s ? realloc(t->gen, cap * sizeof *g) : NULL;
        if (!s || !g) {
            pthread_mutex_unlock(&t->mu);
            batch_destroy(b);
            return TRANSFER_ENOMEM;
        }
        t->gen = g;
        for (size_t i = t->cap; i < cap; i++) {
            t->slots[i] = NULL;
            t->gen[i] = 1;
        }
        t->cap = cap;
    }
    t->slots[slot] = b;
    b->handle = ((uint64_t)t->gen[slot] << 32) | (uint64_t)(slot + 1);
    *out = b->handle;
    pthread_mutex_unlock(&t->mu);
    return 0;
}

batch *batch_table_lookup_locked(batch_table *t, transfer_batch h) {
    uint64_t idx = h & 0xffffffffu;
    if (idx == 0 || idx > t->cap) return NULL;
    batch *b = t->slots[idx - 1];
    return (b && b->handle == h) ? b : NULL;
}

int batch_table_free_locked(batch_table *t, transfer_batch h) {
    batch *b = batch_table_lookup_locked(t, h);
    if (!b) return TRANSFER_ESTALE;
    if (b->ops_inflight || b->waiters) return TRANSFER_EBUSY;
    size_t slot = (h & 0xffffffffu) - 1;
    t->slots[slot] = NULL;
    t->gen[slot]++;
    if (t->gen[slot] == 0) t->gen[slot] = 1;
    batch_destroy(b);
    return 0;
}

void batch_chunk_done_locked(batch *b, uint32_t req, size_t bytes, int err) {
    batch_req *r = &b->reqs[req];
    if (err == 0)
        r->transferred += bytes;
    else if (r->error == 0)
        r->error = err;
    if (r->chunks_left > 0 && --r->chunks_left == 0) {
        if (r->error == 0)
            r->state = TRANSFER_STATE_COMPLETED;
        else if (r->error == TRANSFER_ETIMEDOUT)
            r->state = TRANSFER_STATE_TIMEOUT;
        else if (r->error == TRANSFER_ECANCELED)
            r->state = TRANSFER_STATE_CANCELED;
        else
            r->state = TRANSFER_STATE_FAILED;
        b->reqs_pending--;
        pthread_cond_broadcast(&b->cv);
    }
}
