/*
 * rdma_ibv — the verbs table (rdma_verbs.h) over libibverbs: one context,
 * protection domain, completion channel (non-blocking) and completion queue
 * on it per device; RC queue pairs moved
 * RESET -> INIT -> RTR -> RTS with the peer's QPN / LID / GID / MTU.
 * Built when CMake finds libibverbs (DISAGG_HAVE_IBVERBS).  No machine here
 * has an RDMA NIC: this file is compiled, not run (docs/transfer.md).
 */
#include "transfer/rdma_verbs.h"

#ifdef DISAGG_HAVE_IBVERBS
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <stdlib.h>
#include <string.h>

#define GID_INDEX_ENV "MC_GID_INDEX" /* Mooncake's knob for the GID index */

struct rdma_nic {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    uint8_t port;
};
struct rdma_mr {
    struct ibv_mr *mr;
};
struct rdma_qp {
    rdma_nic *nic;
    struct ibv_qp *qp;
};

static int mtu_bytes(enum ibv_mtu m) {
    return m == IBV_MTU_256    ? 256
           : m == IBV_MTU_512  ? 512
           : m == IBV_MTU_1024 ? 1024
           : m == IBV_MTU_2048 ? 2048
                               : 4096;
}
static enum ibv_mtu mtu_enum(int b) {
    return b >= 4096   ? IBV_MTU_4096
           : b >= 2048 ? IBV_MTU_2048
           : b >= 1024 ? IBV_MTU_1024
           : b >= 512  ? IBV_MTU_512
                       : IBV_MTU_256;
}

static int v_list(void *vctx, rdma_port_info *out, int max) {
    (void)vctx;
    int n = 0, got = 0;
    struct ibv_device **l = ibv_get_device_list(&n);
    if (!l) return 0;
    const char *gi = getenv(GID_INDEX_ENV);
    int gid_index = gi ? atoi(gi) : 0;
    for (int i = 0; i < n && got < max; i++) {
        struct ibv_context *c = ibv_open_device(l[i]);
        if (!c) continue;
        struct ibv_port_attr pa;
        union ibv_gid gid;
        if (ibv_query_port(c, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE &&
            ibv_query_gid(c, 1, gid_index, &gid) == 0) {
            rdma_port_info *p = &out[got++];
            memset(p, 0, sizeof *p);
            strncpy(p->name, ibv_get_device_name(l[i]), sizeof p->name - 1);
            p->lid = pa.lid;
            memcpy(p->gid, gid.raw, RDMA_GID_LEN);
            p->gid_index = gid_index;
            p->mtu = mtu_bytes(pa.active_mtu);
        }
        ibv_close_device(c);
    }
    ibv_free_device_list(l);
    return got;
}

static int v_open(void *vctx, const rdma_port_info *port, rdma_nic **out) {
    (void)vctx;
    int n = 0;
    struct ibv_device **l = ibv_get_device_list(&n);
    if (!l) return -ENODEV;
    rdma_nic *nic = calloc(1, sizeof *nic);
    int rc = -ENODEV;
    for (int i = 0; nic && i < n; i++) {
        if (strcmp(ibv_get_device_name(l[i]), port->name) != 0) continue;
        nic->port = 1;
        int fl = -1;
        if (!(nic->ctx = ibv_open_device(l[i])) || !(nic->pd = ibv_alloc_pd(nic->ctx)) ||
            !(nic->ch = ibv_create_comp_channel(nic->ctx)) ||
            (fl = fcntl(nic->ch->fd, F_GETFL)) < 0 ||
            fcntl(nic->ch->fd, F_SETFL, fl | O_NONBLOCK) < 0 ||
            !(nic->cq = ibv_create_cq(nic->ctx, 4096, NULL, nic->ch, 0))) {
            rc = errno ? -errno : -EIO;
            if (nic->ch) ibv_destroy_comp_channel(nic->ch);
            if (nic->pd) ibv_dealloc_pd(nic->pd);
            if (nic->ctx) ibv_close_device(nic->ctx);
            break;
        }
        rc = 0;
        break;
    }
    ibv_free_device_list(l);
    if (rc) {
        free(nic);
        return nic ? rc : -ENOMEM;
    }
    *out = nic;
    return 0;
}

static void v_close(rdma_nic *nic) {
    ibv_destroy_cq(nic->cq); /* every event was acknowledged (v_get_event) */
    ibv_destroy_comp_channel(nic->ch);
    ibv_dealloc_pd(nic->pd);
    ibv_close_device(nic->ctx);
    free(nic);
}

#define ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)

/* A registration's handle and keys (m NULL: the registration failed, errno says why). */
static int v_wrap_mr(struct ibv_mr *m, rdma_mr **mr, uint32_t *lkey, uint32_t *rkey) {
    if (!m) return errno ? -errno : -EIO;
    if (!(*mr = malloc(sizeof **mr))) {
        ibv_dereg_mr(m);
        return -ENOMEM;
    }
    (*mr)->mr = m;
    *lkey = m->lkey;
    *rkey = m->rkey;
    return 0;
}

static int v_reg_mr(rdma_nic *nic, void *addr, size_t len, rdma_mr **mr, uint32_t *lkey,
                    uint32_t *rkey) {
    return v_wrap_mr(ibv_reg_mr(nic->pd, addr, len, ACCESS), mr, lkey, rkey);
}

static int v_reg_dmabuf_mr(rdma_nic *nic, uint64_t off, size_t len, uint64_t iova, int fd,
                           rdma_mr **mr, uint32_t *lkey, uint32_t *rkey) {
    return v_wrap_mr(ibv_reg_dmabuf_mr(nic->pd, off, len, iova, fd, ACCESS), mr, lkey, rkey);
}

static void v_dereg_mr(rdma_mr *mr) {
    ibv_dereg_mr(mr->mr);
    free(mr);
}

static int v_create_qp(rdma_nic *nic, int max_wr, rdma_qp **out, uint32_t *qpn) {
    struct ibv_qp_init_attr a = {.send_cq = nic->cq,
                                 .recv_cq = nic->cq,
                                 .qp_type = IBV_QPT_RC,
                                 .sq_sig_all = 0, /* selective signaling */
                                 .cap = {.max_send_wr = (uint32_t)max_wr,
                                         .max_recv_wr = 1,
                                         .max_send_sge = 1,
                                         .max_recv_sge = 1}};
    struct ibv_qp *qp = ibv_create_qp(nic->pd, &a);
    if (!qp) return errno ? -errno : -EIO;
    rdma_qp *q = malloc(sizeof *q);
    if (!q) {
        ibv_destroy_qp(qp);
        return -ENOMEM;
    }
    q->nic = nic;
    q->qp = qp;
    *qpn = qp->qp_num;
    *out = q;
    return 0;
}

static int v_connect_qp(rdma_qp *q, const rdma_qp_attr *l, const rdma_qp_attr *r) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.port_num = q->nic->port;
    a.qp_access_flags = ACCESS;
    if (ibv_modify_qp(q->qp, &a,
                      IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        return -errno;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = mtu_enum(l->mtu < r->mtu ? l->mtu : r->mtu);
    a.dest_qp_num = r->qpn;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 16;
    a.min_rnr_timer = 12;
    a.ah_attr.dlid = r->lid;
    a.ah_attr.port_num = q->nic->port;
    int global = 0;
    for (int i = 0; i < RDMA_GID_LEN; i++)
        global |= r->gid[i];
    if (global) { /* RoCE, or IB across subnets */
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, r->gid, RDMA_GID_LEN);
        a.ah_attr.grh.sgid_index = (uint8_t)l->gid_index;
        a.ah_attr.grh.hop_limit = 64;
    }
    if (ibv_modify_qp(q->qp, &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return -errno;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = 0;
    a.max_rd_atomic = 16;
    if (ibv_modify_qp(q->qp, &a,
                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                          IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
        return -errno;
    return 0;
}

static void v_destroy_qp(rdma_qp *q) {
    ibv_destroy_qp(q->qp);
    free(q);
}

static int v_post(rdma_qp *q, const rdma_wr *w, int n) {
    struct ibv_sge sge[64];
    struct ibv_send_wr wr[64], *bad = NULL;
    if (n > 64) return -EINVAL;
    for (int i = 0; i < n; i++) {
        sge[i] = (struct ibv_sge){(uint64_t)(uintptr_t)w[i].local, w[i].len, w[i].lkey};
        memset(&wr[i], 0, sizeof wr[i]);
        wr[i].wr_id = w[i].wr_id;
        wr[i].sg_list = &sge[i];
        wr[i].num_sge = 1;
        wr[i].opcode = w[i].opcode == RDMA_WR_WRITE ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
        wr[i].send_flags = w[i].signaled ? IBV_SEND_SIGNALED : 0;
        wr[i].wr.rdma.remote_addr = w[i].remote;
        wr[i].wr.rdma.rkey = w[i].rkey;
        wr[i].next = i + 1 < n ? &wr[i + 1] : NULL;
    }
    int rc = ibv_post_send(q->qp, wr, &bad);
    return rc ? -rc : 0;
}

static int v_poll(rdma_nic *nic, rdma_wc *out, int max) {
    struct ibv_wc wc[64];
    int n = ibv_poll_cq(nic->cq, max < 64 ? max : 64, wc);
    for (int i = 0; i < n; i++)
        out[i] = (rdma_wc){wc[i].wr_id, wc[i].qp_num, (int)wc[i].status};
    return n < 0 ? -EIO : n;
}

static int v_cq_fd(rdma_nic *nic) {
    return nic->ch->fd;
}

static int v_req_notify(rdma_nic *nic) {
    int rc = ibv_req_notify_cq(nic->cq, 0);
    return rc ? -rc : 0;
}

static int v_get_event(rdma_nic *nic) {
    int got = 0;
    struct ibv_cq *cq;
    void *cq_ctx;
    while (ibv_get_cq_event(nic->ch, &cq, &cq_ctx) == 0) { /* the fd is non-blocking */
        ibv_ack_cq_events(cq, 1);
        got = 1;
    }
    return got ? 0 : -EAGAIN;
}

static const rdma_verbs IBV = {
    .name = "libibverbs",
    .list = v_list,
    .open = v_open,
    .close = v_close,
    .reg_mr = v_reg_mr,
    .reg_dmabuf_mr = v_reg_dmabuf_mr,
    .dereg_mr = v_dereg_mr,
    .create_qp = v_create_qp,
    .connect_qp = v_connect_qp,
    .destroy_qp = v_destroy_qp,
    .post = v_post,
    .poll = v_poll,
    .cq_fd = v_cq_fd,
    .req_notify = v_req_notify,
    .get_event = v_get_event,
};

const rdma_verbs *rdma_verbs_ibv(void) {
    return &IBV;
}
#else
const rdma_verbs *rdma_verbs_ibv(void) {
    return NULL;
}
#endif
