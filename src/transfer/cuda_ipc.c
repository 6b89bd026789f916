/* cuda_ipc — see cuda_ipc.h. */
#include "transfer/cuda_ipc.h"

#include "base/log.h"
#include "transfer/staging.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#define MOD "transfer.cuda_ipc"

typedef struct ipc_buf {
    registry_entry e; /* the peer's buffer (addr, length, handle, offset) */
    void *base;       /* mapped allocation base here, NULL until first use */
    int device;       /* mapped on this local device */
} ipc_buf;

typedef struct ipc_conn {
    pthread_mutex_t mu; /* guards bufs, gone */
    ipc_buf *bufs;
    size_t n;
    int pid;  /* the peer process (same host, same pid namespace), 0 = unknown */
    int gone; /* it exited: its mappings are released, every op fails ECONN */
    char name[96];
} ipc_conn;

typedef struct ipc_state {
    const transfer_device_ops *const *dev;
    pthread_mutex_t mu; /* guards streams; held while a list is copied */
    void *stream[STAGE_MAX_DEVICES];
    const transfer_device_ops *stream_owner;
} ipc_state;

int cuda_ipc_supported(const transfer_device_ops *d) {
    return d && d->ipc_export && d->ipc_open && d->ipc_close && d->copy_device;
}

static int ipc_can_reach(const transport *t, const transport_peer *p, const char *local_loc,
                         const registry_entry *remote) {
    const ipc_state *s = t->state;
    return p->same_host && cuda_ipc_supported(*s->dev) && location_is_device(local_loc) && remote &&
           location_is_device(remote->location) && remote->ipc_len > 0 &&
           remote_reachable(remote, REACH_IPC);
}

/* Replace c's buffer list with d's ipc buffers, moving over the mappings of buffers that
 * stay; the old list (its remaining mappings: buffers that went away) is left in *old /
 * *oldn for the caller to unmap and free.  Out of memory: c keeps its list, *old NULL. */
static void copy_bufs(ipc_conn *c, const segment_desc *d, ipc_buf **old, size_t *oldn) {
    *old = NULL;
    *oldn = 0;
    size_t n = 0;
    for (size_t i = 0; i < d->buffers.n; i++)
        n += d->buffers.v[i].ipc_len > 0;
    ipc_buf *v = calloc(n ? n : 1, sizeof *v);
    if (!v) return; /* keep the old list */
    size_t k = 0;
    for (size_t i = 0; i < d->buffers.n; i++)
        if (d->buffers.v[i].ipc_len > 0) {
            v[k].e = d->buffers.v[i];
            /* keep an existing mapping of the same buffer */
            for (size_t j = 0; j < c->n; j++)
                if (c->bufs[j].base && c->bufs[j].e.addr == v[k].e.addr &&
                    c->bufs[j].e.ipc_len == v[k].e.ipc_len &&
                    !memcmp(c->bufs[j].e.ipc, v[k].e.ipc, v[k].e.ipc_len)) {
                    v[k].base = c->bufs[j].base;
                    v[k].device = c->bufs[j].device;
                    c->bufs[j].base = NULL;
                }
            k++;
        }
    *old = c->bufs;
    *oldn = c->n;
    c->bufs = v;
    c->n = n;
}

static void unmap_all(const transfer_device_ops *d, ipc_conn *c) {
    for (size_t i = 0; i < c->n; i++)
        if (c->bufs[i].base && d) d->ipc_close(d->ctx, c->bufs[i].base);
}

static int ipc_open_peer(transport *t, const transport_peer *p, void **out) {
    (void)t;
    ipc_conn *c = calloc(1, sizeof *c);
    if (!c) return TRANSFER_ENOMEM;
    pthread_mutex_init(&c->mu, NULL);
    c->pid = p->desc->pid;
    snprintf(c->name, sizeof c->name, "%s", p->name);
    ipc_buf *none;
    size_t nnone;
    copy_bufs(c, p->desc, &none, &nnone);
    free(none);
    *out = c;
    return 0;
}

static void ipc_update_peer(transport *t, void *conn, const transport_peer *p) {
    ipc_state *s = t->state;
    ipc_conn *c = conn;
    pthread_mutex_lock(&c->mu);
    ipc_buf *old;
    size_t oldn;
    if (p->desc->pid != c->pid) { /* another process now answers for the segment */
        c->pid = p->desc->pid;
        c->gone = 0;
    }
    copy_bufs(c, p->desc, &old, &oldn);
    if (old) { /* buffers that went away: unmap */
        ipc_conn gone = {.bufs = old, .n = oldn};
        unmap_all(*s->dev, &gone);
        free(old);
    }
    pthread_mutex_unlock(&c->mu);
}

/* The peer address `remote` of `len` bytes as a pointer in this process
 * (mapping its buffer on first use), or NULL.  Caller holds c->mu. */
static char *translate_locked(const transfer_device_ops *d, ipc_conn *c, uint64_t remote,
                              size_t len, int device) {
    for (size_t i = 0; i < c->n; i++) {
        ipc_buf *b = &c->bufs[i];
        if (remote < b->e.addr || remote + len > b->e.addr + b->e.length) continue;
        if (b->base && b->device != device) { /* mapped for another local device */
            d->ipc_close(d->ctx, b->base);
            b->base = NULL;
        }
        if (!b->base) {
            int rc = d->ipc_open(d->ctx, device, b->e.ipc, b->e.ipc_len, &b->base);
            if (rc) {
                b->base = NULL;
                LOG_E(MOD, "cannot map the peer's %s buffer at 0x%llx on cuda:%d (%d)",
                      b->e.location, (unsigned long long)b->e.addr, device, rc);
                return NULL;
            }
            b->device = device;
        }
        return (char *)b->base + b->e.ipc_off + (remote - b->e.addr);
    }
    return NULL;
}

static void ipc_submit(transport *t, void *conn, xfer_op *ops) {
    ipc_state *s = t->state;
    ipc_conn *c = conn;
    const transfer_device_ops *d = *s->dev;
    xfer_op *done = ops;
    int rc = d ? 0 : TRANSFER_EINVAL;
    pthread_mutex_lock(&s->mu);
    if (d && s->stream_owner && s->stream_owner != d) { /* the table was replaced */
        for (int k = 0; k < STAGE_MAX_DEVICES; k++)
            if (s->stream[k]) s->stream_owner->stream_destroy(s->stream_owner->ctx, s->stream[k]);
        memset(s->stream, 0, sizeof s->stream);
    }
    pthread_mutex_lock(&c->mu);
    /* A peer that died keeps its memory alive through our mapping: no copy would fail, and
     * nobody would notice.  Like a tcp peer whose connection drops, it fails ECONN, and its
     * mappings are released (the device memory is freed with the last one). */
    if (rc == 0 && !c->gone && c->pid > 0 && kill(c->pid, 0) != 0 && errno == ESRCH) {
        c->gone = 1;
        unmap_all(d, c);
        for (size_t i = 0; i < c->n; i++)
            c->bufs[i].base = NULL;
        LOG_W(MOD,
              "segment %s: the peer process (pid %d) is gone; released its device "
              "memory mappings",
              c->name, c->pid);
    }
    if (rc == 0 && c->gone) rc = TRANSFER_ECONN;
    int used[STAGE_MAX_DEVICES] = {0};
    /* Runs: ops adjacent on both sides with the same direction and device become one copy;
     * with copy_device_batch, every run of a device goes in one operation (one kernel launch
     * over the list: a request's scattered blocks, a layer of them). */
    size_t n_ops = 0;
    for (xfer_op *op = ops; op; op = op->next)
        n_ops++;
    void **bdst = d && d->copy_device_batch ? malloc((n_ops ? n_ops : 1) * sizeof *bdst) : NULL;
    const void **bsrc = bdst ? malloc(n_ops * sizeof *bsrc + 1) : NULL;
    size_t *blen = bsrc ? malloc(n_ops * sizeof *blen + 1) : NULL;
    int *bdev = blen ? malloc(n_ops * sizeof *bdev + 1) : NULL;
    size_t nb = 0;
    for (xfer_op *op = ops; op && rc == 0;) {
        xfer_op *last = op;
        size_t len = op->len;
        while (last->next && last->next->opcode == op->opcode && last->next->device == op->device &&
               last->next->local == last->local + last->len &&
               last->next->remote == last->remote + last->len) {
            last = last->next;
            len += last->len;
        }
        int dev = op->device;
        char *peer = translate_locked(d, c, op->remote, len, dev);
        if (!peer) {
            rc = TRANSFER_EREMOTEADDR;
            break;
        }
        if (!s->stream[dev] && d->stream_create(d->ctx, dev, &s->stream[dev]) != 0) {
            s->stream[dev] = NULL;
            LOG_E(MOD, "cannot create a copy stream on cuda:%d", dev);
            rc = TRANSFER_ESYS;
            break;
        }
        s->stream_owner = d;
        used[dev] = 1;
        void *to = op->opcode == TRANSFER_WRITE ? (void *)peer : op->local;
        const void *from = op->opcode == TRANSFER_WRITE ? (const void *)op->local : peer;
        if (bdev) { /* queued: one operation per device below */
            bdst[nb] = to;
            bsrc[nb] = from;
            blen[nb] = len;
            bdev[nb++] = dev;
        } else if (d->copy_device(d->ctx, s->stream[dev], to, from, len)) {
            LOG_E(MOD, "device-to-device copy of %zu bytes failed", len);
            rc = TRANSFER_ESYS;
        }
        op = last->next;
    }
    for (int k = 0; rc == 0 && bdev && k < STAGE_MAX_DEVICES; k++) {
        if (!used[k]) continue;
        size_t m = 0; /* this device's copies, to the front */
        for (size_t i = 0; i < nb; i++)
            if (bdev[i] == k) {
                void *t = bdst[m];
                const void *f = bsrc[m];
                size_t l = blen[m];
                int dv = bdev[m];
                bdst[m] = bdst[i], bsrc[m] = bsrc[i], blen[m] = blen[i], bdev[m] = bdev[i];
                bdst[i] = t, bsrc[i] = f, blen[i] = l, bdev[i] = dv;
                m++;
            }
        if (d->copy_device_batch(d->ctx, s->stream[k], bdst, bsrc, blen, m)) {
            LOG_E(MOD, "device-to-device batch of %zu copies failed", m);
            rc = TRANSFER_ESYS;
        }
        /* the next device's copies start after these */
        for (size_t i = 0; i + m < nb; i++)
            bdst[i] = bdst[i + m], bsrc[i] = bsrc[i + m], blen[i] = blen[i + m],
            bdev[i] = bdev[i + m];
        nb -= m;
    }
    free(bdst);
    free(bsrc);
    free(blen);
    free(bdev);
    for (int k = 0; k < STAGE_MAX_DEVICES; k++)
        if (used[k] && d->sync(d->ctx, s->stream[k]) != 0 && rc == 0) rc = TRANSFER_ESYS;
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_unlock(&s->mu);
    /* A failure fails the whole list (which copies landed is unknown). */
    while (done) {
        xfer_op *n = done->next;
        xfer_done(t->sink, done, xfer_op_canceled(done) && rc ? TRANSFER_ECANCELED : rc);
        done = n;
    }
}

static void ipc_close_peer(transport *t, void *conn) {
    ipc_state *s = t->state;
    ipc_conn *c = conn;
    unmap_all(*s->dev, c);
    free(c->bufs);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static void ipc_destroy(transport *t) {
    if (!t) return;
    ipc_state *s = t->state;
    for (int k = 0; k < STAGE_MAX_DEVICES; k++)
        if (s->stream[k]) s->stream_owner->stream_destroy(s->stream_owner->ctx, s->stream[k]);
    pthread_mutex_destroy(&s->mu);
    free(s);
    free(t);
}

static int ipc_create(const transport_env *env, transport **out);

/* Export device memory once, for same-host peers (a failure only leaves
 * this buffer to the other transports). */
static int ipc_register_mem(transport *t, registry_entry *r) {
    ipc_state *s = t->state;
    const transfer_device_ops *d = *s->dev;
    if (!location_is_device(r->location) || !cuda_ipc_supported(d)) return 0;
    void *addr = (void *)(uintptr_t)r->addr;
    size_t hl = sizeof r->ipc;
    if (d->ipc_export(d->ctx, addr, r->length, r->ipc, &hl, &r->ipc_off) == 0 && hl > 0 &&
        hl <= sizeof r->ipc)
        r->ipc_len = (uint32_t)hl;
    else
        LOG_W("transfer", "register: cannot export %s memory at %p for cuda_ipc", r->location,
              addr);
    return 0;
}

/* Each exported buffer's handle and offset. */
static void ipc_describe(transport *t, const registry *regs, segment_desc *d) {
    (void)t;
    for (size_t i = 0; i < d->buffers.n && i < regs->n; i++) {
        registry_entry *b = &d->buffers.v[i];
        b->ipc_len = regs->v[i].ipc_len;
        b->ipc_off = regs->v[i].ipc_off;
        memcpy(b->ipc, regs->v[i].ipc, sizeof b->ipc);
        if (b->ipc_len) b->reach |= REACH_IPC;
    }
}

const transport_ops cuda_ipc_transport_ops = {
    .name = "cuda_ipc",
    .proto = TRANSFER_PROTO_CUDA_IPC,
    .create = ipc_create,
    .register_mem = ipc_register_mem,
    .describe = ipc_describe,
    .can_reach = ipc_can_reach,
    .open_peer = ipc_open_peer,
    .submit = ipc_submit,
    .update_peer = ipc_update_peer,
    .close_peer = ipc_close_peer,
    .destroy = ipc_destroy,
};

int cuda_ipc_transport_create(const xfer_sink *sink, const transfer_device_ops *const *dev,
                              transport **out) {
    transport *t = calloc(1, sizeof *t);
    ipc_state *s = calloc(1, sizeof *s);
    if (!t || !s) {
        free(t);
        free(s);
        return TRANSFER_ENOMEM;
    }
    s->dev = dev;
    pthread_mutex_init(&s->mu, NULL);
    t->ops = &cuda_ipc_transport_ops;
    t->sink = sink;
    t->stripe = (size_t)1 << 30; /* one copy per request (and runs of them) */
    t->state = s;
    *out = t;
    return 0;
}

/* The table's entry: device memory on both sides of one host goes here
 * before the peer's preferred transport, unless tcp was asked for. */
static int ipc_create(const transport_env *env, transport **out) {
    int rc = cuda_ipc_transport_create(env->sink, env->dev, out);
    if (rc == 0) {
        (*out)->env = env;
        (*out)->flags = env->protocol != TRANSFER_PROTO_TCP ? TRANSPORT_FIRST : 0;
    }
    return rc;
}
