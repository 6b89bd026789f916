/*
 * fake_verbs — an in-memory implementation of the rdma transport's verbs
 * table (src/transfer/rdma_verbs.h) for unit tests: NICs, memory regions
 * with keys, RC queue pairs between them and completion queues, all in this
 * process.  A posted WRITE / READ really copies bytes between the two
 * registered ranges after checking both keys and bounds, and really
 * completes (signaled work requests, and every failed one, put a completion
 * on the NIC's CQ).  A NIC can be failed: its queue pairs go to the error
 * state and their work requests complete with errors (and the rest are
 * flushed), as on a link loss.  Memory in a "device range" cannot be
 * registered with reg_mr unless peermem is on (it returns -EFAULT, the
 * seed's "Bad address [14]"); reg_dmabuf_mr registers it.
 * Completion events as in verbs: each CQ's channel is an eventfd, signaled
 * when a completion is queued on an armed CQ (arming is one-shot, and
 * completions already queued at arming raise nothing), so a poller that
 * forgets to re-arm or to poll after arming hangs.  A NIC can be held: its
 * completions are queued but neither polled nor signaled until fv_release.
 */
#ifndef DISAGG_TESTS_FAKE_VERBS_H
#define DISAGG_TESTS_FAKE_VERBS_H

#include "transfer/rdma_verbs.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#define FV_MAX_NICS 4
#define FV_MAX_OBJ  1024
#define FV_CQ       8192

enum { FV_WC_OK = 0, FV_WC_FLUSH = 5, FV_WC_REM_ACCESS = 10, FV_WC_RETRY_EXC = 12 };

struct rdma_nic {
    int idx; /* into fv.nics */
    rdma_wc cq[FV_CQ];
    int head, n;
    int efd;   /* the completion channel */
    int armed; /* the next completion signals efd */
};
struct rdma_mr {
    rdma_nic *nic;
    uint64_t addr, len;
    uint32_t key;
};
struct rdma_qp {
    rdma_nic *nic;
    uint32_t qpn, remote_qpn;
    int state; /* 0 reset, 1 ready (RTS), 2 error */
};

typedef struct fv_world {
    pthread_mutex_t mu;
    int nnics;
    struct {
        char name[64];
        atomic_int failed;
        int hold; /* completions wait for fv_release (under mu) */
        _Atomic uint64_t wrs, signaled, bytes;
    } nics[FV_MAX_NICS];
    rdma_nic *open[4 * FV_MAX_NICS];      /* every open NIC object (under mu) */
    _Atomic uint64_t polls, arms, events; /* poll / req_notify / get_event calls */
    rdma_mr *mrs[FV_MAX_OBJ];
    rdma_qp *qps[FV_MAX_OBJ];
    uint32_t next_key, next_qpn;
    int peermem;             /* reg_mr accepts device ranges */
    uint64_t dev_lo, dev_hi; /* the "device memory" range */
    _Atomic int dmabuf_regs, mr_regs, open_mrs, open_qps, open_nics;
} fv_world;

static fv_world fv = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void fv_reset(int nnics) {
    pthread_mutex_lock(&fv.mu);
    fv.nnics = nnics;
    for (int i = 0; i < FV_MAX_NICS; i++) {
        snprintf(fv.nics[i].name, sizeof fv.nics[i].name, "fake%d", i);
        atomic_store(&fv.nics[i].failed, 0);
        atomic_store(&fv.nics[i].wrs, 0);
        atomic_store(&fv.nics[i].signaled, 0);
        atomic_store(&fv.nics[i].bytes, 0);
        fv.nics[i].hold = 0;
    }
    fv.next_key = fv.next_key ? fv.next_key : 0x100;
    fv.next_qpn = fv.next_qpn ? fv.next_qpn : 0x40;
    fv.peermem = 1;
    fv.dev_lo = fv.dev_hi = 0;
    pthread_mutex_unlock(&fv.mu);
}

static int fv_list(void *ctx, rdma_port_info *out, int max) {
    (void)ctx;
    int n = 0;
    for (int i = 0; i < fv.nnics && n < max; i++) {
        memset(&out[n], 0, sizeof out[n]);
        snprintf(out[n].name, sizeof out[n].name, "%s", fv.nics[i].name);
        out[n].lid = (uint16_t)(i + 1);
        out[n].gid[0] = 0xfe;
        out[n].gid[1] = 0x80;
        out[n].gid[15] = (uint8_t)(i + 1);
        out[n].mtu = i == 0 ? 4096 : 1024;
        n++;
    }
    return n;
}

static int fv_open(void *ctx, const rdma_port_info *p, rdma_nic **out) {
    (void)ctx;
    for (int i = 0; i < fv.nnics; i++)
        if (strcmp(fv.nics[i].name, p->name) == 0) {
            rdma_nic *n = calloc(1, sizeof *n);
            if (!n) return -ENOMEM;
            n->idx = i;
            if ((n->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0) {
                free(n);
                return -errno;
            }
            pthread_mutex_lock(&fv.mu);
            for (int k = 0; k < 4 * FV_MAX_NICS; k++)
                if (!fv.open[k]) {
                    fv.open[k] = n;
                    break;
                }
            pthread_mutex_unlock(&fv.mu);
            atomic_fetch_add(&fv.open_nics, 1);
            *out = n;
            return 0;
        }
    return -ENODEV;
}

static void fv_close(rdma_nic *n) {
    pthread_mutex_lock(&fv.mu);
    for (int k = 0; k < 4 * FV_MAX_NICS; k++)
        if (fv.open[k] == n) fv.open[k] = NULL;
    pthread_mutex_unlock(&fv.mu);
    close(n->efd);
    atomic_fetch_sub(&fv.open_nics, 1);
    free(n);
}

static int fv_add_mr(rdma_nic *nic, uint64_t addr, size_t len, rdma_mr **mr, uint32_t *lkey,
                     uint32_t *rkey) {
    pthread_mutex_lock(&fv.mu);
    int slot = -1;
    for (int i = 0; i < FV_MAX_OBJ && slot < 0; i++)
        if (!fv.mrs[i]) slot = i;
    rdma_mr *m = slot >= 0 ? calloc(1, sizeof *m) : NULL;
    if (!m) {
        pthread_mutex_unlock(&fv.mu);
        return -ENOMEM;
    }
    m->nic = nic;
    m->addr = addr;
    m->len = len;
    m->key = fv.next_key++;
    fv.mrs[slot] = m;
    pthread_mutex_unlock(&fv.mu);
    atomic_fetch_add(&fv.open_mrs, 1);
    *mr = m;
    *lkey = *rkey = m->key;
    return 0;
}

static int fv_reg_mr(rdma_nic *nic, void *addr, size_t len, rdma_mr **mr, uint32_t *lkey,
                     uint32_t *rkey) {
    uint64_t a = (uint64_t)(uintptr_t)addr;
    if (!fv.peermem && a < fv.dev_hi && a + len > fv.dev_lo) return -EFAULT;
    atomic_fetch_add(&fv.mr_regs, 1);
    return fv_add_mr(nic, a, len, mr, lkey, rkey);
}

static int fv_reg_dmabuf_mr(rdma_nic *nic, uint64_t off, size_t len, uint64_t iova, int fd,
                            rdma_mr **mr, uint32_t *lkey, uint32_t *rkey) {
    (void)off;
    if (fd < 0) return -EBADF;
    atomic_fetch_add(&fv.dmabuf_regs, 1);
    return fv_add_mr(nic, iova, len, mr, lkey, rkey);
}

static void fv_dereg_mr(rdma_mr *m) {
    pthread_mutex_lock(&fv.mu);
    for (int i = 0; i < FV_MAX_OBJ; i++)
        if (fv.mrs[i] == m) fv.mrs[i] = NULL;
    pthread_mutex_unlock(&fv.mu);
    atomic_fetch_sub(&fv.open_mrs, 1);
    free(m);
}

static int fv_create_qp(rdma_nic *nic, int max_wr, rdma_qp **out, uint32_t *qpn) {
    (void)max_wr;
    pthread_mutex_lock(&fv.mu);
    int slot = -1;
    for (int i = 0; i < FV_MAX_OBJ && slot < 0; i++)
        if (!fv.qps[i]) slot = i;
    rdma_qp *q = slot >= 0 ? calloc(1, sizeof *q) : NULL;
    if (q) {
        q->nic = nic;
        q->qpn = fv.next_qpn++;
        fv.qps[slot] = q;
    }
    pthread_mutex_unlock(&fv.mu);
    if (!q) return -ENOMEM;
    atomic_fetch_add(&fv.open_qps, 1);
    *out = q;
    *qpn = q->qpn;
    return 0;
}

static int fv_connect_qp(rdma_qp *q, const rdma_qp_attr *l, const rdma_qp_attr *r) {
    if (l->qpn != q->qpn || r->qpn == 0) return -EINVAL;
    pthread_mutex_lock(&fv.mu);
    q->remote_qpn = r->qpn;
    q->state = 1;
    pthread_mutex_unlock(&fv.mu);
    return 0;
}

static void fv_destroy_qp(rdma_qp *q) {
    pthread_mutex_lock(&fv.mu);
    for (int i = 0; i < FV_MAX_OBJ; i++)
        if (fv.qps[i] == q) fv.qps[i] = NULL;
    pthread_mutex_unlock(&fv.mu);
    atomic_fetch_sub(&fv.open_qps, 1);
    free(q);
}

/* Caller holds fv.mu.  An armed CQ's channel fires once. */
static void fv_signal(rdma_nic *n) {
    if (!n->armed || fv.nics[n->idx].hold) return;
    n->armed = 0;
    uint64_t one = 1;
    if (write(n->efd, &one, sizeof one) != (ssize_t)sizeof one) abort();
}

/* Caller holds fv.mu. */
static void fv_push_wc(rdma_nic *n, uint64_t id, uint32_t qpn, int status) {
    if (n->n == FV_CQ) return; /* overrun: the transport would see a hang (a test failure) */
    n->cq[(n->head + n->n) % FV_CQ] = (rdma_wc){id, qpn, status};
    n->n++;
    fv_signal(n);
}

/* Hold / release NIC i's completions (release: armed CQs with completions fire). */
static void fv_hold(int i, int on) {
    pthread_mutex_lock(&fv.mu);
    fv.nics[i].hold = on;
    for (int k = 0; !on && k < 4 * FV_MAX_NICS; k++)
        if (fv.open[k] && fv.open[k]->idx == i && fv.open[k]->n > 0) fv_signal(fv.open[k]);
    pthread_mutex_unlock(&fv.mu);
}

static rdma_mr *fv_find_mr(rdma_nic *nic_of_idx_owner, int nic_idx, uint32_t key, uint64_t a,
                           uint64_t len) {
    (void)nic_of_idx_owner;
    for (int i = 0; i < FV_MAX_OBJ; i++) {
        rdma_mr *m = fv.mrs[i];
        if (m && m->key == key && m->nic->idx == nic_idx && a >= m->addr &&
            a + len <= m->addr + m->len)
            return m;
    }
    return NULL;
}

static int fv_post(rdma_qp *q, const rdma_wr *w, int n) {
    pthread_mutex_lock(&fv.mu);
    int idx = q->nic->idx;
    rdma_qp *peer = NULL;
    for (int i = 0; i < FV_MAX_OBJ && !peer; i++)
        if (fv.qps[i] && fv.qps[i]->qpn == q->remote_qpn) peer = fv.qps[i];
    for (int i = 0; i < n; i++) {
        atomic_fetch_add(&fv.nics[idx].wrs, 1);
        if (q->state == 2) {
            fv_push_wc(q->nic, w[i].wr_id, q->qpn, FV_WC_FLUSH);
            continue;
        }
        if (q->state != 1 || atomic_load(&fv.nics[idx].failed) || !peer ||
            atomic_load(&fv.nics[peer->nic->idx].failed)) {
            q->state = 2;
            fv_push_wc(q->nic, w[i].wr_id, q->qpn, FV_WC_RETRY_EXC);
            continue;
        }
        rdma_mr *lm = fv_find_mr(q->nic, idx, w[i].lkey, (uint64_t)(uintptr_t)w[i].local, w[i].len);
        rdma_mr *rm = fv_find_mr(peer->nic, peer->nic->idx, w[i].rkey, w[i].remote, w[i].len);
        if (!lm || !rm) {
            q->state = 2;
            fv_push_wc(q->nic, w[i].wr_id, q->qpn, FV_WC_REM_ACCESS);
            continue;
        }
        if (w[i].opcode == RDMA_WR_WRITE)
            memcpy((void *)(uintptr_t)w[i].remote, w[i].local, w[i].len);
        else
            memcpy(w[i].local, (void *)(uintptr_t)w[i].remote, w[i].len);
        atomic_fetch_add(&fv.nics[idx].bytes, w[i].len);
        if (w[i].signaled) {
            atomic_fetch_add(&fv.nics[idx].signaled, 1);
            fv_push_wc(q->nic, w[i].wr_id, q->qpn, FV_WC_OK);
        }
    }
    pthread_mutex_unlock(&fv.mu);
    return 0;
}

static int fv_poll(rdma_nic *nic, rdma_wc *out, int max) {
    atomic_fetch_add(&fv.polls, 1);
    pthread_mutex_lock(&fv.mu);
    int k = 0;
    while (k < max && nic->n > 0 && !fv.nics[nic->idx].hold) {
        out[k++] = nic->cq[nic->head];
        nic->head = (nic->head + 1) % FV_CQ;
        nic->n--;
    }
    pthread_mutex_unlock(&fv.mu);
    return k;
}

static int fv_cq_fd(rdma_nic *nic) {
    return nic->efd;
}

static int fv_req_notify(rdma_nic *nic) {
    atomic_fetch_add(&fv.arms, 1);
    pthread_mutex_lock(&fv.mu);
    nic->armed = 1; /* what is queued already raises nothing (as in verbs) */
    pthread_mutex_unlock(&fv.mu);
    return 0;
}

static int fv_get_event(rdma_nic *nic) {
    atomic_fetch_add(&fv.events, 1);
    uint64_t v;
    return read(nic->efd, &v, sizeof v) == (ssize_t)sizeof v ? 0 : -EAGAIN;
}

static const rdma_verbs FAKE_VERBS = {
    .name = "fake",
    .list = fv_list,
    .open = fv_open,
    .close = fv_close,
    .reg_mr = fv_reg_mr,
    .reg_dmabuf_mr = fv_reg_dmabuf_mr,
    .dereg_mr = fv_dereg_mr,
    .create_qp = fv_create_qp,
    .connect_qp = fv_connect_qp,
    .destroy_qp = fv_destroy_qp,
    .post = fv_post,
    .poll = fv_poll,
    .cq_fd = fv_cq_fd,
    .req_notify = fv_req_notify,
    .get_event = fv_get_event,
};

#endif
