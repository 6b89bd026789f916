/* staging — see staging.h. */
#include "transfer/staging.h"

#include "base/clock.h"
#include "base/log.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MOD "transfer.staging"

int stage_parse_device(const char *loc, int *device) {
    return transport_location_parse_device(loc, device);
}

static int slot_stream(const transfer_device_ops *dev, stage_slot *sl, int device, void **out) {
    if (!sl->stream[device]) {
        int rc = dev->stream_create(dev->ctx, device, &sl->stream[device]);
        if (rc) {
            sl->stream[device] = NULL;
            LOG_E(MOD, "cannot create a copy stream on cuda:%d (%d)", device, rc);
            return TRANSFER_ESYS;
        }
    }
    *out = sl->stream[device];
    return 0;
}

struct stager {
    const transfer_device_ops *dev;
    stage_stats *stats;
    const xfer_sink *sink;
    stager_send_fn send;
    void *send_ctx;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    xfer_op *work_h, *work_t; /* ops waiting for a slot */
    xfer_op *done_h, *done_t; /* READs whose bytes are in their slot */
    stage_slot slots[STAGE_SLOTS];
    stage_slot *free_slots;
    int nslots;   /* slots whose buffer could be allocated */
    int inflight; /* ops taken and not yet ended */
    int stop;
    pthread_t thread;
};

static void q_push(xfer_op **h, xfer_op **t, xfer_op *op) {
    op->next = NULL;
    if (*t)
        (*t)->next = op;
    else
        *h = op;
    *t = op;
}

static xfer_op *q_pop(xfer_op **h, xfer_op **t) {
    xfer_op *op = *h;
    if (op) {
        *h = op->next;
        if (!*h) *t = NULL;
        op->next = NULL;
    }
    return op;
}

/* Caller holds s->mu. */
static void slot_release_locked(stager *s, stage_slot *sl) {
    sl->next = s->free_slots;
    s->free_slots = sl;
    pthread_cond_broadcast(&s->cv);
}

/* End op (outside the lock), giving back its slot when no other op's bytes are in it. */
static void finish(stager *s, xfer_op *op, int err) {
    stage_slot *sl = op->slot;
    op->slot = NULL;
    op->local = NULL;
    pthread_mutex_lock(&s->mu);
    if (sl && --sl->refs == 0) slot_release_locked(s, sl);
    s->inflight--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    xfer_done(s->sink, op, err);
}

/* A READ's reply is in its slot: copy it to the device. */
static void run_h2d(stager *s, xfer_op *op) {
    void *st;
    int rc = slot_stream(s->dev, op->slot, op->device, &st);
    if (rc == 0 && s->dev->copy_from_host(s->dev->ctx, st, op->dev, op->slot->buf, op->len) != 0)
        rc = TRANSFER_ESYS;
    if (rc == 0 && s->dev->sync(s->dev->ctx, st) != 0) rc = TRANSFER_ESYS;
    if (rc == 0)
        atomic_fetch_add(&s->stats->in, op->len);
    else
        LOG_E(MOD, "host->device copy of %zu bytes to cuda:%d failed", op->len, op->device);
    finish(s, op, rc);
}

/* ops (n, a list through next) share one slot: a READ alone, or WRITEs of one device whose
 * bytes fit in it together.  Stage the WRITEs' bytes -- every device->host copy queued on the
 * slot's stream, then one sync (small pieces, such as one layer of many KV blocks, would
 * otherwise cost a sync each) -- and send them. */
static void run_start(stager *s, xfer_op *ops, int n) {
    stage_slot *sl = ops->slot;
    if (ops->opcode != TRANSFER_WRITE) {
        if (xfer_op_canceled(ops)) {
            finish(s, ops, TRANSFER_ECANCELED);
            return;
        }
        ops->local = sl->buf;
        s->send(s->send_ctx, ops);
        return;
    }
    void *st;
    int rc = slot_stream(s->dev, sl, ops->device, &st);
    size_t off = 0, bytes = 0;
    for (xfer_op *op = ops; op && rc == 0; op = op->next) {
        op->local = sl->buf + off;
        off += op->len;
        if (xfer_op_canceled(op)) continue;
        if (s->dev->copy_to_host(s->dev->ctx, st, op->local, op->dev, op->len) != 0)
            rc = TRANSFER_ESYS;
        bytes += op->len;
    }
    if (rc == 0 && s->dev->sync(s->dev->ctx, st) != 0) rc = TRANSFER_ESYS;
    if (rc)
        LOG_E(MOD, "device->host copy of %zu bytes (%d pieces) from cuda:%d failed", bytes, n,
              ops->device);
    else
        atomic_fetch_add(&s->stats->out, bytes);
    for (xfer_op *op = ops, *next; op; op = next) {
        next = op->next;
        op->next = NULL;
        if (rc)
            finish(s, op, rc);
        else if (xfer_op_canceled(op))
            finish(s, op, TRANSFER_ECANCELED);
        else
            s->send(s->send_ctx, op);
    }
}

/* One thread: completions first (they free slots), then new work while a
 * slot is free.  The socket work of the slots in flight runs on the tcp
 * lanes meanwhile. */
static void *stager_main(void *arg) {
    stager *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        xfer_op *op = q_pop(&s->done_h, &s->done_t);
        if (op) {
            pthread_mutex_unlock(&s->mu);
            run_h2d(s, op);
            pthread_mutex_lock(&s->mu);
            continue;
        }
        if (s->work_h && s->free_slots) {
            stage_slot *sl = s->free_slots;
            s->free_slots = sl->next;
            op = q_pop(&s->work_h, &s->work_t);
            op->slot = sl;
            int n = 1;
            size_t used = op->len;
            xfer_op *last = op;
            while (op->opcode == TRANSFER_WRITE && s->work_h && n < STAGE_GATHER_MAX &&
                   s->work_h->opcode == TRANSFER_WRITE && s->work_h->device == op->device &&
                   used + s->work_h->len <= STAGE_SLOT_BYTES) {
                xfer_op *more = q_pop(&s->work_h, &s->work_t);
                more->slot = sl;
                used += more->len;
                last->next = more;
                last = more;
                n++;
            }
            sl->refs = n;
            pthread_mutex_unlock(&s->mu);
            run_start(s, op, n);
            pthread_mutex_lock(&s->mu);
            continue;
        }
        if (s->stop && s->inflight == 0) break;
        pthread_cond_wait(&s->cv, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int stager_create(const transfer_device_ops *dev, stage_stats *stats, const xfer_sink *sink,
                  stager_send_fn send, void *send_ctx, stager **out) {
    stager *s = calloc(1, sizeof *s);
    if (!s) return TRANSFER_ENOMEM;
    s->dev = dev;
    s->stats = stats;
    s->sink = sink;
    s->send = send;
    s->send_ctx = send_ctx;
    for (int i = 0; i < STAGE_SLOTS; i++) {
        stage_slot *sl = &s->slots[s->nslots];
        if (!(sl->buf = dev->alloc_pinned(dev->ctx, STAGE_SLOT_BYTES))) break;
        sl->next = s->free_slots;
        s->free_slots = sl;
        s->nslots++;
    }
    if (s->nslots == 0) {
        LOG_E(MOD, "cannot allocate pinned staging memory (%u bytes)", STAGE_SLOT_BYTES);
        free(s);
        return TRANSFER_ENOMEM;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->thread, NULL, stager_main, s) != 0) {
        for (int i = 0; i < s->nslots; i++)
            dev->free_pinned(dev->ctx, s->slots[i].buf);
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        free(s);
        return TRANSFER_ESYS;
    }
    *out = s;
    return 0;
}

void stager_submit(stager *s, xfer_op *op) {
    op->slot = NULL;
    pthread_mutex_lock(&s->mu);
    s->inflight++;
    q_push(&s->work_h, &s->work_t, op);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void stager_complete(stager *s, xfer_op *op, int err) {
    if (err == 0 && op->opcode == TRANSFER_READ) {
        pthread_mutex_lock(&s->mu);
        q_push(&s->done_h, &s->done_t, op);
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        return;
    }
    finish(s, op, err);
}

void stager_destroy(stager *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    for (int i = 0; i < s->nslots; i++) {
        for (int d = 0; d < STAGE_MAX_DEVICES; d++)
            if (s->slots[i].stream[d]) s->dev->stream_destroy(s->dev->ctx, s->slots[i].stream[d]);
        s->dev->free_pinned(s->dev->ctx, s->slots[i].buf);
    }
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

int stage_pair_ready(stage_pair *p, const transfer_device_ops *dev, int device) {
    if (p->dev && p->device != device) stage_pair_free(p);
    if (p->dev) return 0;
    memset(p, 0, sizeof *p);
    p->dev = dev;
    p->device = device;
    for (int i = 0; i < 2; i++) {
        int bad = !(p->buf[i] = dev->alloc_pinned(dev->ctx, STAGE_SLOT_BYTES));
        if (!bad && dev->stream_create(dev->ctx, device, &p->stream[i]) != 0) {
            p->stream[i] = NULL;
            bad = 1;
        }
        if (bad) {
            LOG_E(MOD, "cannot set up staging for cuda:%d (pinned memory or stream)", device);
            stage_pair_free(p);
            return TRANSFER_ENOMEM;
        }
    }
    return 0;
}

void stage_pair_free(stage_pair *p) {
    if (!p->dev) return;
    for (int i = 0; i < 2; i++) {
        if (p->stream[i]) p->dev->stream_destroy(p->dev->ctx, p->stream[i]);
        if (p->buf[i]) p->dev->free_pinned(p->dev->ctx, p->buf[i]);
    }
    memset(p, 0, sizeof *p);
}
