/* rdma — see rdma.h. */
#include "transfer/rdma.h"

#include "base/clock.h"
#include "base/log.h"
#include "transfer/handshake.h"
#include "transfer/staging.h"

#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#define MOD          "transfer.rdma"
#define MAX_NICS     REGISTRY_MAX_KEYS
#define QP_DEPTH     256 /* work requests outstanding per QP */
#define SIGNAL_EVERY 16  /* one signaled work request in this many */
#define POLL_BATCH   32

static _Atomic(const rdma_verbs *) g_override;

void rdma_verbs_override(const rdma_verbs *v) {
    atomic_store(&g_override, v);
}

const rdma_verbs *rdma_verbs_current(void) {
    const rdma_verbs *v = atomic_load(&g_override);
    return v ? v : rdma_verbs_ibv();
}

int transfer_rdma_device_count(void) {
    const rdma_verbs *v = rdma_verbs_current();
    rdma_port_info ports[32];
    int n = v ? v->list(v->ctx, ports, 32) : 0;
    return n > 0 ? n : 0;
}

int rdma_use_dmabuf(void) {
    const char *v = getenv("WITH_NVIDIA_PEERMEM");
    return v && strcmp(v, "0") == 0;
}

/* An op's rdma state (xfer_op.priv): the remote buffer's key on each of the
 * peer's NICs, and the op's position in its queue pair's send queue (the
 * error it ends with once off the queue). */
typedef struct rdma_op {
    uint32_t rkey[MAX_NICS];
    uint32_t nkeys;
    uint64_t seq;
} rdma_op;
_Static_assert(sizeof(rdma_op) <= XFER_OP_PRIV, "rdma_op must fit in xfer_op.priv");

static inline rdma_op *R(xfer_op *op) {
    return (rdma_op *)(void *)op->priv;
}

typedef struct nic {
    rdma_port_info port;
    rdma_nic *h;
} nic;

typedef struct mreg {
    uint64_t addr, len;
    rdma_mr *mr[MAX_NICS];
    uint32_t lkey[MAX_NICS];
} mreg;

struct rconn;

typedef struct qpc {
    struct rconn *conn;
    int nic, peer_nic;
    rdma_qp *qp;
    uint32_t qpn;
    int dead;
    xfer_op *f_head, *f_tail; /* posted, in order */
    xfer_op *p_head, *p_tail; /* waiting for room in the send queue */
    int posted;               /* work requests outstanding */
    uint64_t seq;             /* next op's sequence number */
} qpc;

typedef struct rconn {
    char peer[96];
    qpc q[MAX_NICS];
    int nq;
    unsigned rr;
    uint64_t retries;
} rconn;

typedef struct accepted {
    char key[200]; /* the requester's local_nic_path */
    rdma_qp *qp;
    struct accepted *next;
} accepted;

typedef struct rstate {
    const rdma_verbs *v;
    rdma_transport_cfg cfg;
    const xfer_sink *sink;
    nic nics[MAX_NICS];
    int nnics;
    pthread_rwlock_t reg_mu; /* guards regs */
    mreg *regs;
    size_t nregs, cap;
    pthread_mutex_t mu; /* guards every qpc, conns, accepted */
    qpc **live;         /* initiator QPs (for completions) */
    size_t nlive, live_cap;
    int outstanding; /* work requests outstanding on all QPs */
    accepted *acc;
    atomic_int stop;
    int wake_fd;             /* eventfd: written by destroy to stop the poller */
    _Atomic uint64_t sleeps; /* times the poller went to sleep (debug log) */
    pthread_t poller;
} rstate;

/* ---- registration ---------------------------------------------------------- */

static const mreg *mreg_find(rstate *s, uint64_t addr, size_t len) {
    for (size_t i = 0; i < s->nregs; i++)
        if (addr >= s->regs[i].addr && addr + len <= s->regs[i].addr + s->regs[i].len)
            return &s->regs[i];
    return NULL;
}

static void mreg_release(rstate *s, mreg *m) {
    for (int k = 0; k < s->nnics; k++)
        if (m->mr[k]) s->v->dereg_mr(m->mr[k]);
}

static int rdma_register_mem(transport *t, registry_entry *e) {
    rstate *s = t->state;
    mreg m = {.addr = e->addr, .len = e->length};
    int dev = location_is_device(e->location), use_dmabuf = dev && rdma_use_dmabuf();
    int fd = -1;
    uint64_t off = 0;
    if (use_dmabuf) {
        const transfer_device_ops *d = s->cfg.dev ? *s->cfg.dev : NULL;
        if (!d || !d->get_dmabuf) {
            LOG_E(MOD,
                  "register %s memory at 0x%llx: WITH_NVIDIA_PEERMEM=0 needs DMA-BUF export, which "
                  "the installed device-memory ops do not offer",
                  e->location, (unsigned long long)e->addr);
            return TRANSFER_EINVAL;
        }
        int rc = d->get_dmabuf(d->ctx, (const void *)(uintptr_t)e->addr, e->length, &fd, &off);
        if (rc) {
            LOG_E(MOD, "register %s memory at 0x%llx: DMA-BUF export failed (%d)", e->location,
                  (unsigned long long)e->addr, rc);
            return TRANSFER_ESYS;
        }
    }
    uint32_t rkeys[MAX_NICS];
    int rc = 0;
    for (int k = 0; k < s->nnics && rc == 0; k++) {
        int r = use_dmabuf ? s->v->reg_dmabuf_mr(s->nics[k].h, off, e->length, e->addr, fd,
                                                 &m.mr[k], &m.lkey[k], &rkeys[k])
                           : s->v->reg_mr(s->nics[k].h, (void *)(uintptr_t)e->addr, e->length,
                                          &m.mr[k], &m.lkey[k], &rkeys[k]);
        if (r == 0) continue;
        m.mr[k] = NULL;
        if (dev && !use_dmabuf && r == -EFAULT)
            LOG_E(MOD,
                  "Failed to register memory 0x%llx (%llu bytes, %s) on %s: Bad address [14]: "
                  "the NIC cannot map this GPU memory (the nvidia-peermem module is not "
                  "loaded); set WITH_NVIDIA_PEERMEM=0 to register it through DMA-BUF instead",
                  (unsigned long long)e->addr, (unsigned long long)e->length, e->location,
                  s->nics[k].port.name);
        else
            LOG_E(MOD, "Failed to register memory 0x%llx (%llu bytes, %s) on %s: %s [%d]",
                  (unsigned long long)e->addr, (unsigned long long)e->length, e->location,
                  s->nics[k].port.name, strerror(-r), -r);
        rc = r == -ENOMEM ? TRANSFER_ENOMEM : TRANSFER_ESYS;
    }
    if (fd >= 0) close(fd);
    if (rc == 0) {
        pthread_rwlock_wrlock(&s->reg_mu);
        if (s->nregs == s->cap) {
            size_t cap = s->cap ? s->cap * 2 : 16;
            mreg *v = realloc(s->regs, cap * sizeof *v);
            if (!v)
                rc = TRANSFER_ENOMEM;
            else {
                s->regs = v;
                s->cap = cap;
            }
        }
        if (rc == 0) s->regs[s->nregs++] = m;
        pthread_rwlock_unlock(&s->reg_mu);
    }
    if (rc) {
        mreg_release(s, &m);
        return rc;
    }
    e->nkeys = (uint32_t)s->nnics;
    memcpy(e->rkey, rkeys, (size_t)s->nnics * sizeof rkeys[0]);
    return 0;
}

static void rdma_deregister_mem(transport *t, const registry_entry *r) {
    rstate *s = t->state;
    uint64_t addr = r->addr;
    pthread_rwlock_wrlock(&s->reg_mu);
    for (size_t i = 0; i < s->nregs; i++)
        if (s->regs[i].addr == addr) {
            mreg_release(s, &s->regs[i]);
            s->regs[i] = s->regs[--s->nregs];
            break;
        }
    pthread_rwlock_unlock(&s->reg_mu);
}

static void gid_format(const uint8_t *g, char *out, size_t cap) {
    size_t o = 0;
    for (int i = 0; i < RDMA_GID_LEN && o + 3 < cap; i++)
        o += (size_t)snprintf(out + o, cap - o, i ? ":%02x" : "%02x", g[i]);
}

static int gid_parse(const char *s, uint8_t *g) {
    for (int i = 0; i < RDMA_GID_LEN; i++) {
        unsigned x;
        if (sscanf(s, "%2x", &x) != 1) return -1;
        g[i] = (uint8_t)x;
        s += 2;
        if (i < RDMA_GID_LEN - 1 && *s++ != ':') return -1;
    }
    return *s ? -1 : 0;
}

/* The NICs ("devices", rdma_mtu) and each buffer's keys on them. */
static void rdma_describe(transport *t, const registry *regs, segment_desc *d) {
    rstate *s = t->state;
    for (size_t i = 0; i < d->buffers.n && i < regs->n; i++) {
        registry_entry *b = &d->buffers.v[i];
        b->nkeys = regs->v[i].nkeys;
        memcpy(b->rkey, regs->v[i].rkey, sizeof b->rkey);
        if (b->nkeys) b->reach |= REACH_RDMA;
    }
    d->num_devices = 0;
    int mtu = 0;
    for (int k = 0; k < s->nnics && k < SEGMENT_MAX_DEVICES; k++) {
        segment_device *sd = &d->devices[d->num_devices++];
        snprintf(sd->name, sizeof sd->name, "%s", s->nics[k].port.name);
        sd->lid = s->nics[k].port.lid;
        gid_format(s->nics[k].port.gid, sd->gid, sizeof sd->gid);
        if (!mtu || s->nics[k].port.mtu < mtu) mtu = s->nics[k].port.mtu;
    }
    d->rdma_mtu = mtu;
}

/* ---- completions ----------------------------------------------------------- */

static int post_locked(rstate *s, qpc *q, xfer_op *ops, xfer_op **fail);

/* Caller holds s->mu: q's NIC or link failed — drop q, hand back its ops. */
static xfer_op *qpc_kill_locked(rstate *s, qpc *q) {
    xfer_op *all = q->f_head, *tail = q->f_tail;
    if (tail)
        tail->next = q->p_head;
    else
        all = q->p_head;
    s->outstanding -= q->posted;
    q->f_head = q->f_tail = q->p_head = q->p_tail = NULL;
    q->posted = 0;
    q->dead = 1;
    return all;
}

/* Caller holds s->mu: a live QP of op's connection other than `avoid`. */
static qpc *pick_locked(rconn *c, const qpc *avoid) {
    for (int i = 0; i < c->nq; i++) {
        qpc *q = &c->q[(c->rr++) % (unsigned)c->nq];
        if (!q->dead && q != avoid) return q;
    }
    return NULL;
}

/* Ops of a failed QP (or that could not be posted): to another QP of the
 * same peer, at most once per QP, else they end with err; ops marked
 * tries == UINT32_MAX carry their own error in seq and are not retried.
 * Caller holds s->mu; ended ops go to *done (ended outside the lock). */
static void retry_locked(rstate *s, rconn *c, xfer_op *ops, xfer_op **done, int err) {
    while (ops) {
        xfer_op *op = ops;
        ops = op->next;
        op->next = NULL;
        if (op->tries == UINT32_MAX) {
            op->next = *done;
            *done = op;
            continue;
        }
        qpc *q = ++op->tries <= (uint32_t)c->nq ? pick_locked(c, NULL) : NULL;
        if (!q || xfer_op_canceled(op)) {
            R(op)->seq = (uint64_t)(int64_t)(q ? TRANSFER_ECANCELED : err);
            op->next = *done;
            *done = op;
            continue;
        }
        c->retries++;
        xfer_op *f = NULL;
        post_locked(s, q, op, &f);
        while (f) { /* back into the loop: retried elsewhere or ended */
            xfer_op *n = f->next;
            f->next = ops;
            ops = f;
            f = n;
        }
    }
}

static void end_list(rstate *s, xfer_op *l) {
    while (l) {
        xfer_op *n = l->next;
        xfer_done(s->sink, l, (int)(int64_t)R(l)->seq);
        l = n;
    }
}

static qpc *qpc_by_qpn_locked(rstate *s, int nic, uint32_t qpn) {
    for (size_t i = 0; i < s->nlive; i++)
        if (s->live[i]->nic == nic && s->live[i]->qpn == qpn) return s->live[i];
    return NULL;
}

/* Reap every NIC's completions once: the number reaped. */
static int rdma_poll_once(rstate *s) {
    rdma_wc wc[POLL_BATCH];
    int total = 0;
    for (int k = 0; k < s->nnics; k++) {
        int n = s->v->poll(s->nics[k].h, wc, POLL_BATCH);
        if (n <= 0) continue;
        total += n;
        xfer_op *done = NULL;
        pthread_mutex_lock(&s->mu);
        for (int i = 0; i < n; i++) {
            qpc *q = qpc_by_qpn_locked(s, k, wc[i].qpn);
            if (!q || q->dead) continue; /* closed, or already failed over */
            if (wc[i].status == 0) {
                /* Retire every op up to the signaled one (RC: in order). */
                while (q->f_head && R(q->f_head)->seq <= wc[i].wr_id) {
                    xfer_op *op = q->f_head;
                    q->f_head = op->next;
                    if (!q->f_head) q->f_tail = NULL;
                    q->posted--;
                    s->outstanding--;
                    R(op)->seq = 0;
                    op->next = done;
                    done = op;
                }
                if (q->p_head) { /* room again: post what waited */
                    xfer_op *p = q->p_head, *f = NULL;
                    q->p_head = q->p_tail = NULL;
                    post_locked(s, q, p, &f);
                    if (f) retry_locked(s, q->conn, f, &done, TRANSFER_ECONN);
                }
                continue;
            }
            LOG_W(MOD, "%s: work request failed on %s (status %d): %s", q->conn->peer,
                  s->nics[k].port.name, wc[i].status,
                  "retrying its queue pair's requests on another NIC");
            xfer_op *ops = qpc_kill_locked(s, q);
            retry_locked(s, q->conn, ops, &done, TRANSFER_ECONN);
        }
        pthread_mutex_unlock(&s->mu);
        end_list(s, done);
    }
    return total;
}

/* The poller sleeps in poll(2) on every NIC's completion channel and the
 * wake eventfd (written by destroy): nothing runs while no completion
 * arrives.  The standard verbs pattern: drain the CQs, arm them, poll once
 * more (a completion queued between the last empty poll and the arming
 * raises no event), then sleep; on an event, consume and acknowledge it and
 * start over (re-arm, drain).  A NIC whose CQ cannot be armed, or whose
 * channel reports an error, is polled every DEGRADED_MS instead. */
#define DEGRADED_MS 10

static void *poller_main(void *arg) {
    rstate *s = arg;
    struct pollfd pf[MAX_NICS + 1];
    int degraded[MAX_NICS] = {0};
    for (int k = 0; k < s->nnics; k++)
        pf[k] = (struct pollfd){.fd = s->v->cq_fd(s->nics[k].h), .events = POLLIN};
    pf[s->nnics] = (struct pollfd){.fd = s->wake_fd, .events = POLLIN};
    for (;;) {
        if (atomic_load(&s->stop)) break;
        while (rdma_poll_once(s) > 0) {
        }
        int timeout = -1;
        for (int k = 0; k < s->nnics; k++) {
            if (!degraded[k]) {
                int rc = s->v->req_notify(s->nics[k].h);
                if (rc) {
                    LOG_W(MOD, "%s: cannot arm the completion queue (%s): polling it every %d ms",
                          s->nics[k].port.name, strerror(-rc), DEGRADED_MS);
                    degraded[k] = 1;
                    pf[k].fd = -1;
                }
            }
            if (degraded[k]) timeout = DEGRADED_MS;
        }
        if (rdma_poll_once(s) > 0) continue; /* queued before the arming */
        atomic_fetch_add(&s->sleeps, 1);
        int n = poll(pf, (nfds_t)s->nnics + 1, timeout);
        if (n < 0 && errno != EINTR) {
            LOG_E(MOD, "poll on the completion channels: %s; polling every %d ms", strerror(errno),
                  DEGRADED_MS);
            for (int k = 0; k < s->nnics; k++)
                degraded[k] = 1, pf[k].fd = -1;
            continue;
        }
        for (int k = 0; n > 0 && k < s->nnics; k++) {
            if (pf[k].fd < 0 || !pf[k].revents) continue;
            if (pf[k].revents & (POLLERR | POLLHUP | POLLNVAL)) {
                LOG_W(MOD, "%s: completion channel failed: polling its CQ every %d ms",
                      s->nics[k].port.name, DEGRADED_MS);
                degraded[k] = 1;
                pf[k].fd = -1;
                continue;
            }
            s->v->get_event(s->nics[k].h); /* consumed and acknowledged (-EAGAIN: none) */
        }
    }
    return NULL;
}

/* ---- posting ----------------------------------------------------------------- */

/* Caller holds s->mu.  Post ops (linked) on q while its send queue has room;
 * the rest wait in q's pending list.  Ops that cannot be posted (no local
 * key, post failed: the NIC is gone) go to *fail. */
static int post_locked(rstate *s, qpc *q, xfer_op *ops, xfer_op **fail) {
    rdma_wr wrs[SIGNAL_EVERY * 4];
    xfer_op *batch[SIGNAL_EVERY * 4];
    int n = 0;
    pthread_rwlock_rdlock(&s->reg_mu);
    while (ops || n) {
        xfer_op *op = NULL;
        if (ops && q->posted + n < QP_DEPTH && n < (int)(sizeof wrs / sizeof wrs[0])) {
            op = ops;
            ops = op->next;
            op->next = NULL;
            const mreg *m = mreg_find(s, (uint64_t)(uintptr_t)op->local, op->len);
            if (xfer_op_canceled(op) || !m || (uint32_t)q->peer_nic >= R(op)->nkeys) {
                R(op)->seq = (uint64_t)(int64_t)(xfer_op_canceled(op) ? TRANSFER_ECANCELED
                                                                      : TRANSFER_EREMOTEADDR);
                op->tries = UINT32_MAX; /* not retried */
                op->next = *fail;
                *fail = op;
                continue;
            }
            R(op)->seq = q->seq++;
            wrs[n] =
                (rdma_wr){.wr_id = R(op)->seq,
                          .opcode = op->opcode == TRANSFER_WRITE ? RDMA_WR_WRITE : RDMA_WR_READ,
                          .local = op->local,
                          .len = (uint32_t)op->len,
                          .lkey = m->lkey[q->nic],
                          .remote = op->remote,
                          .rkey = R(op)->rkey[q->peer_nic],
                          .signaled = (q->seq % SIGNAL_EVERY) == 0};
            batch[n++] = op;
            continue;
        }
        if (n == 0) { /* the send queue is full: the rest wait for completions */
            if (ops) {
                if (q->p_tail)
                    q->p_tail->next = ops;
                else
                    q->p_head = ops;
                while (ops->next)
                    ops = ops->next;
                q->p_tail = ops;
            }
            break;
        }
        wrs[n - 1].signaled = 1; /* the last of a post always completes */
        int rc = s->v->post(q->qp, wrs, n);
        for (int i = 0; i < n; i++) {
            if (rc) {
                batch[i]->next = *fail;
                *fail = batch[i];
                continue;
            }
            if (q->f_tail)
                q->f_tail->next = batch[i];
            else
                q->f_head = batch[i];
            q->f_tail = batch[i];
        }
        if (rc == 0) {
            q->posted += n;
            s->outstanding += n;
        } else {
            LOG_W(MOD, "%s: posting on %s failed: %s", q->conn->peer, s->nics[q->nic].port.name,
                  strerror(-rc));
        }
        n = 0;
        if (rc) { /* this NIC is gone: everything else goes elsewhere */
            xfer_op *rest = qpc_kill_locked(s, q);
            while (ops) {
                xfer_op *nx = ops->next;
                ops->next = rest;
                rest = ops;
                ops = nx;
            }
            while (rest) {
                xfer_op *nx = rest->next;
                rest->next = *fail;
                *fail = rest;
                rest = nx;
            }
            break;
        }
    }
    pthread_rwlock_unlock(&s->reg_mu);
    return 0;
}

static void rdma_submit(transport *t, void *conn, xfer_op *ops) {
    rstate *s = t->state;
    rconn *c = conn;
    /* Stripe: each op to the next live QP (NIC), then one post per QP. */
    xfer_op *per[MAX_NICS] = {0}, *tail[MAX_NICS] = {0}, *done = NULL;
    pthread_mutex_lock(&s->mu);
    while (ops) {
        xfer_op *op = ops;
        ops = op->next;
        op->next = NULL;
        qpc *q = pick_locked(c, NULL);
        if (!q) {
            R(op)->seq = (uint64_t)(int64_t)TRANSFER_ECONN;
            op->next = done;
            done = op;
            continue;
        }
        int i = (int)(q - c->q);
        if (tail[i])
            tail[i]->next = op;
        else
            per[i] = op;
        tail[i] = op;
    }
    for (int i = 0; i < c->nq; i++) {
        if (!per[i]) continue;
        xfer_op *f = NULL;
        post_locked(s, &c->q[i], per[i], &f);
        /* Ops that never reached a NIC: their own error, or another QP. */
        retry_locked(s, c, f, &done, TRANSFER_ECONN);
    }
    pthread_mutex_unlock(&s->mu);
    end_list(s, done);
}

static int rdma_poll(transport *t) {
    return rdma_poll_once(t->state);
}

/* ---- connection setup -------------------------------------------------------- */

static json_t *attr_json(const char *local_path, const char *peer_path, const rdma_qp_attr *a) {
    char gid[64];
    gid_format(a->gid, gid, sizeof gid);
    return json_pack("{s:s,s:s,s:[I],s:I,s:s,s:i,s:s}", "local_nic_path", local_path,
                     "peer_nic_path", peer_path, "qp_num", (json_int_t)a->qpn, "local_lid",
                     (json_int_t)a->lid, "local_gid", gid, "mtu", a->mtu, "reply_msg", "");
}

static int attr_parse(json_t *o, rdma_qp_attr *a, char *err, size_t cap) {
    json_t *qn = json_object_get(o, "qp_num");
    const char *gid = json_string_value(json_object_get(o, "local_gid"));
    json_t *lid = json_object_get(o, "local_lid"), *mtu = json_object_get(o, "mtu");
    memset(a, 0, sizeof *a);
    if (!json_is_array(qn) || json_array_size(qn) < 1 || !json_is_integer(json_array_get(qn, 0))) {
        snprintf(err, cap, "qp_num must be an array of one or more integers");
        return -1;
    }
    a->qpn = (uint32_t)json_integer_value(json_array_get(qn, 0));
    if (!gid || gid_parse(gid, a->gid) != 0) {
        snprintf(err, cap, "local_gid missing or not 16 colon-separated hex bytes");
        return -1;
    }
    a->lid = json_is_integer(lid) ? (uint16_t)json_integer_value(lid) : 0;
    a->mtu = json_is_integer(mtu) ? (int)json_integer_value(mtu) : 1024; /* Mooncake: its config */
    return 0;
}

static int nic_by_name(rstate *s, const char *name) {
    for (int k = 0; k < s->nnics; k++)
        if (strcmp(s->nics[k].port.name, name) == 0) return k;
    return -1;
}

static void local_attr(rstate *s, int k, uint32_t qpn, rdma_qp_attr *a) {
    memset(a, 0, sizeof *a);
    a->qpn = qpn;
    a->lid = s->nics[k].port.lid;
    memcpy(a->gid, s->nics[k].port.gid, RDMA_GID_LEN);
    a->gid_index = s->nics[k].port.gid_index;
    a->mtu = s->nics[k].port.mtu;
}

static char *rdma_accept(transport *t, const char *body, size_t len, char *err, size_t cap) {
    rstate *s = t->state;
    json_error_t je;
    json_t *o = json_loadb(body, len, 0, &je);
    const char *lp = json_string_value(json_object_get(o, "local_nic_path"));
    const char *pp = json_string_value(json_object_get(o, "peer_nic_path"));
    const char *at = pp ? strrchr(pp, '@') : NULL;
    rdma_qp_attr remote, mine;
    char *out = NULL;
    if (!o || !lp || !pp || !at) {
        snprintf(err, cap,
                 "connect request needs local_nic_path and peer_nic_path "
                 "(\"segment@nic\")");
        goto done;
    }
    if (attr_parse(o, &remote, err, cap) != 0) goto done;
    int k = nic_by_name(s, at + 1);
    if (k < 0) {
        snprintf(err, cap, "Unable to find RDMA device %s", pp);
        goto done;
    }
    rdma_qp *qp;
    uint32_t qpn;
    int rc = s->v->create_qp(s->nics[k].h, QP_DEPTH, &qp, &qpn);
    if (rc) {
        snprintf(err, cap, "cannot create a queue pair on %s: %s", at + 1, strerror(-rc));
        goto done;
    }
    local_attr(s, k, qpn, &mine);
    if ((rc = s->v->connect_qp(qp, &mine, &remote)) != 0) {
        s->v->destroy_qp(qp);
        snprintf(err, cap, "cannot connect the queue pair on %s: %s", at + 1, strerror(-rc));
        goto done;
    }
    accepted *a = calloc(1, sizeof *a);
    if (!a) {
        s->v->destroy_qp(qp);
        snprintf(err, cap, "out of memory");
        goto done;
    }
    snprintf(a->key, sizeof a->key, "%s", lp);
    a->qp = qp;
    pthread_mutex_lock(&s->mu);
    for (accepted **pp2 = &s->acc; *pp2; pp2 = &(*pp2)->next)
        if (strcmp((*pp2)->key, lp) == 0) { /* a reconnect replaces the old QP */
            accepted *old = *pp2;
            *pp2 = old->next;
            s->v->destroy_qp(old->qp);
            free(old);
            break;
        }
    a->next = s->acc;
    s->acc = a;
    pthread_mutex_unlock(&s->mu);
    json_t *r = attr_json(pp, lp, &mine);
    out = json_dumps(r, JSON_COMPACT);
    json_decref(r);
done:
    json_decref(o);
    return out;
}

static int rdma_can_reach(const transport *t, const transport_peer *p, const char *local_loc,
                          const registry_entry *remote) {
    (void)t;
    (void)local_loc; /* every local registration is registered on every NIC */
    return p->desc->num_devices > 0 && remote && remote->nkeys > 0 &&
           remote_reachable(remote, REACH_RDMA);
}

static void conn_free(rstate *s, rconn *c) {
    for (int i = 0; i < c->nq; i++)
        if (c->q[i].qp) s->v->destroy_qp(c->q[i].qp);
    free(c);
}

static int rdma_open_peer(transport *t, const transport_peer *p, void **out) {
    rstate *s = t->state;
    const segment_desc *d = p->desc;
    if (d->num_devices == 0) {
        LOG_E(MOD, "segment %s has no RDMA device", p->name);
        return TRANSFER_ENOSEG;
    }
    rconn *c = calloc(1, sizeof *c);
    if (!c) return TRANSFER_ENOMEM;
    snprintf(c->peer, sizeof c->peer, "%s", p->name);
    int rc = 0;
    for (int k = 0; k < s->nnics && rc == 0; k++) {
        qpc *q = &c->q[c->nq];
        q->conn = c;
        q->nic = k;
        q->peer_nic = k % (int)d->num_devices;
        if ((rc = s->v->create_qp(s->nics[k].h, QP_DEPTH, &q->qp, &q->qpn)) != 0) {
            LOG_W(MOD, "cannot create a queue pair on %s: %s", s->nics[k].port.name, strerror(-rc));
            q->qp = NULL;
            rc = 0;
            continue;
        }
        rdma_qp_attr mine, remote;
        local_attr(s, k, q->qpn, &mine);
        char lp[200], pp[200], err[256] = "";
        snprintf(lp, sizeof lp, "%s@%s", s->cfg.self_name, s->nics[k].port.name);
        snprintf(pp, sizeof pp, "%s@%s", d->name, d->devices[q->peer_nic].name);
        json_t *req = attr_json(lp, pp, &mine);
        char *body = json_dumps(req, JSON_COMPACT), *reply = NULL;
        json_decref(req);
        size_t rlen = 0;
        int hr = body ? handshake_connect(p->rpc_addr, p->name, s->cfg.self_name, s->cfg.secret,
                                          body, clock_now_ns() + s->cfg.connect_timeout_ns, &reply,
                                          &rlen, err, sizeof err)
                      : TRANSFER_ENOMEM;
        free(body);
        json_t *ro = hr == 0 ? json_loadb(reply, rlen, 0, NULL) : NULL;
        free(reply);
        if (hr == 0 && (!ro || attr_parse(ro, &remote, err, sizeof err) != 0)) hr = TRANSFER_EPROTO;
        json_decref(ro);
        if (hr == 0 && (hr = s->v->connect_qp(q->qp, &mine, &remote)) != 0)
            snprintf(err, sizeof err, "connecting the queue pair failed: %s", strerror(-hr));
        if (hr) {
            LOG_W(MOD, "segment %s: no queue pair %s -> %s: %s", p->name, lp, pp, err);
            s->v->destroy_qp(q->qp);
            q->qp = NULL;
            continue;
        }
        c->nq++;
    }
    if (c->nq == 0) {
        LOG_E(MOD, "segment %s: no RDMA queue pair could be connected", p->name);
        conn_free(s, c);
        return TRANSFER_ECONN;
    }
    pthread_mutex_lock(&s->mu);
    if (s->nlive + (size_t)c->nq > s->live_cap) {
        size_t cap = (s->live_cap ? s->live_cap * 2 : 16) + (size_t)c->nq;
        qpc **v = realloc(s->live, cap * sizeof *v);
        if (!v) {
            pthread_mutex_unlock(&s->mu);
            conn_free(s, c);
            return TRANSFER_ENOMEM;
        }
        s->live = v;
        s->live_cap = cap;
    }
    for (int i = 0; i < c->nq; i++)
        s->live[s->nlive++] = &c->q[i];
    pthread_mutex_unlock(&s->mu);
    *out = c;
    return 0;
}

static uint64_t rdma_retries(transport *t, void *conn) {
    rstate *s = t->state;
    pthread_mutex_lock(&s->mu);
    uint64_t r = ((rconn *)conn)->retries;
    pthread_mutex_unlock(&s->mu);
    return r;
}

static void rdma_close_peer(transport *t, void *conn) {
    rstate *s = t->state;
    rconn *c = conn;
    xfer_op *all = NULL;
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->nlive;)
        if (s->live[i]->conn == c)
            s->live[i] = s->live[--s->nlive];
        else
            i++;
    for (int i = 0; i < c->nq; i++) {
        xfer_op *l = qpc_kill_locked(s, &c->q[i]);
        while (l) {
            xfer_op *n = l->next;
            R(l)->seq = (uint64_t)(int64_t)TRANSFER_ECANCELED;
            l->next = all;
            all = l;
            l = n;
        }
    }
    pthread_mutex_unlock(&s->mu);
    conn_free(s, c); /* destroying the QPs stops their DMA first */
    end_list(s, all);
}

static void rdma_destroy(transport *t) {
    if (!t) return;
    rstate *s = t->state;
    atomic_store(&s->stop, 1);
    uint64_t one = 1;
    if (write(s->wake_fd, &one, sizeof one) != (ssize_t)sizeof one)
        LOG_E(MOD, "waking the rdma poller: %s", strerror(errno));
    pthread_join(s->poller, NULL);
    close(s->wake_fd);
    LOG_D(MOD, "the completion poller slept %llu times",
          (unsigned long long)atomic_load(&s->sleeps));
    for (accepted *a = s->acc; a;) {
        accepted *n = a->next;
        s->v->destroy_qp(a->qp);
        free(a);
        a = n;
    }
    for (size_t i = 0; i < s->nregs; i++)
        mreg_release(s, &s->regs[i]);
    free(s->regs);
    free(s->live);
    for (int k = 0; k < s->nnics; k++)
        s->v->close(s->nics[k].h);
    pthread_rwlock_destroy(&s->reg_mu);
    pthread_mutex_destroy(&s->mu);
    free(s);
    free(t);
}

static int rdma_create(const transport_env *env, transport **out);

/* Preferred for a peer that advertises NICs. */
static int rdma_prefer(const transport *t, const transport_peer *p) {
    (void)t;
    if (p->desc->num_devices > 0) return 1;
    LOG_W(MOD, "segment %s advertises no RDMA device: using tcp", p->name);
    return 0;
}

static void rdma_prepare(transport *t, xfer_op *op, const registry_entry *remote) {
    (void)t;
    R(op)->nkeys = remote ? remote->nkeys : 0;
    if (remote) memcpy(R(op)->rkey, remote->rkey, sizeof R(op)->rkey);
}

const transport_ops rdma_transport_ops = {
    .name = "rdma",
    .proto = TRANSFER_PROTO_RDMA,
    .create = rdma_create,
    .prefer = rdma_prefer,
    .register_mem = rdma_register_mem,
    .deregister_mem = rdma_deregister_mem,
    .describe = rdma_describe,
    .accept = rdma_accept,
    .prepare = rdma_prepare,
    .can_reach = rdma_can_reach,
    .open_peer = rdma_open_peer,
    .submit = rdma_submit,
    .poll = rdma_poll,
    .retries = rdma_retries,
    .close_peer = rdma_close_peer,
    .destroy = rdma_destroy,
};

/* Whether name is in the comma-separated list (empty list: everything). */
static int whitelisted(const char *list, const char *name) {
    if (!list || !*list) return 1;
    size_t n = strlen(name);
    for (const char *p = list; *p;) {
        const char *e = strchr(p, ',');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == n && strncmp(p, name, n) == 0) return 1;
        p += l + (e ? 1 : 0);
    }
    return 0;
}

int rdma_transport_create(const xfer_sink *sink, const rdma_transport_cfg *cfg, transport **out) {
    const rdma_verbs *v = cfg->verbs;
    if (!v) {
        LOG_W(MOD, "this build has no libibverbs");
        return TRANSFER_ENOSEG;
    }
    rdma_port_info ports[32];
    int n = v->list(v->ctx, ports, 32);
    if (n < 0) n = 0;
    /* Every whitelisted name must exist (a typo would silently use fewer NICs). */
    const char *list = cfg->device_name;
    for (const char *p = list; p && *p;) {
        const char *e = strchr(p, ',');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        int found = 0;
        for (int k = 0; k < n; k++)
            if (strlen(ports[k].name) == l && strncmp(ports[k].name, p, l) == 0) found = 1;
        if (!found && n > 0) {
            LOG_E(MOD, "device_name '%s': no active RDMA device named '%.*s' (found %d)", list,
                  (int)l, p, n);
            return TRANSFER_EINVAL;
        }
        p += l + (e ? 1 : 0);
    }
    transport *t = calloc(1, sizeof *t);
    rstate *s = calloc(1, sizeof *s);
    if (!t || !s) {
        free(t);
        free(s);
        return TRANSFER_ENOMEM;
    }
    s->v = v;
    s->cfg = *cfg;
    s->sink = sink;
    for (int k = 0; k < n && s->nnics < MAX_NICS; k++) {
        if (!whitelisted(list, ports[k].name)) continue;
        nic *ni = &s->nics[s->nnics];
        ni->port = ports[k];
        int rc = v->open(v->ctx, &ports[k], &ni->h);
        if (rc) {
            LOG_W(MOD, "cannot open RDMA device %s: %s", ports[k].name, strerror(-rc));
            continue;
        }
        s->nnics++;
    }
    if (s->nnics == 0) {
        free(s);
        free(t);
        return TRANSFER_ENOSEG;
    }
    pthread_rwlock_init(&s->reg_mu, NULL);
    pthread_mutex_init(&s->mu, NULL);
    s->wake_fd = eventfd(0, EFD_CLOEXEC);
    if (s->wake_fd < 0 || pthread_create(&s->poller, NULL, poller_main, s) != 0) {
        LOG_E(MOD, "cannot start the completion poller: %s", strerror(errno));
        if (s->wake_fd >= 0) close(s->wake_fd);
        pthread_rwlock_destroy(&s->reg_mu);
        pthread_mutex_destroy(&s->mu);
        for (int k = 0; k < s->nnics; k++)
            v->close(s->nics[k].h);
        free(s);
        free(t);
        return TRANSFER_ESYS;
    }
    t->ops = &rdma_transport_ops;
    t->sink = sink;
    t->stripe = 256u << 10;
    t->state = s;
    LOG_I(MOD, "rdma over %d NIC(s) (%s), verbs: %s", s->nnics, s->nics[0].port.name, v->name);
    *out = t;
    return 0;
}

/* The table's entry: only under protocol rdma, and without a usable NIC the
 * engine goes on with tcp. */
static int rdma_create(const transport_env *env, transport **out) {
    if (env->protocol != TRANSFER_PROTO_RDMA) return TRANSFER_ENOSEG;
    rdma_transport_cfg rcfg = {.verbs = rdma_verbs_current(),
                               .device_name = env->device_name,
                               .self_name = env->self_name,
                               .connect_timeout_ns = env->connect_timeout_ns,
                               .dev = env->dev,
                               .secret = env->secret};
    int rc = rdma_transport_create(env->sink, &rcfg, out);
    if (rc == TRANSFER_ENOSEG)
        LOG_W("transfer", "protocol rdma: no RDMA device found%s%s; using tcp",
              env->device_name && env->device_name[0] ? " among " : "",
              env->device_name ? env->device_name : "");
    if (rc == 0) {
        (*out)->env = env;
        (*out)->flags = TRANSPORT_REFETCH | TRANSPORT_OPEN_FALLBACK;
    }
    return rc;
}
