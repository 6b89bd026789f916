/*
 * rdma_verbs — the verbs the rdma transport (rdma.h) uses, as a table of
 * function pointers: rdma_ibv.c implements it over libibverbs; the unit
 * tests install an in-memory implementation (tests/unit/fake_verbs.h) whose
 * queue pairs really copy bytes and really complete, with injectable NIC
 * failures.  Everything above this table is exercised without a NIC.
 * Functions return 0 or a negative errno.
 */
#ifndef DISAGG_TRANSFER_RDMA_VERBS_H
#define DISAGG_TRANSFER_RDMA_VERBS_H

#include <stddef.h>
#include <stdint.h>

#define RDMA_GID_LEN 16

typedef struct rdma_port_info {
    char name[64];             /* "mlx5_0" */
    uint16_t lid;              /* 0 on RoCE */
    uint8_t gid[RDMA_GID_LEN]; /* the GID at the chosen index */
    int gid_index;
    int mtu; /* active path MTU in bytes */
} rdma_port_info;

/* What each side of an RC connection tells the other (the handshake). */
typedef struct rdma_qp_attr {
    uint32_t qpn;
    uint16_t lid;
    uint8_t gid[RDMA_GID_LEN];
    int gid_index; /* local only */
    int mtu;       /* bytes: the smaller of both sides' is used */
} rdma_qp_attr;

enum { RDMA_WR_WRITE = 0, RDMA_WR_READ = 1 };

typedef struct rdma_wr {
    uint64_t wr_id;
    int opcode; /* RDMA_WR_WRITE / RDMA_WR_READ */
    void *local;
    uint32_t len;
    uint32_t lkey;
    uint64_t remote;
    uint32_t rkey;
    int signaled;
} rdma_wr;

typedef struct rdma_wc {
    uint64_t wr_id;
    uint32_t qpn;
    int status; /* 0 = success, else the verbs status (logged) */
} rdma_wc;

typedef struct rdma_nic rdma_nic; /* an open device: context, PD, CQ */
typedef struct rdma_mr rdma_mr;
typedef struct rdma_qp rdma_qp;

typedef struct rdma_verbs {
    const char *name; /* "libibverbs", "fake" */
    void *ctx;
    /* Devices with an active port (at most max); the number, or < 0. */
    int (*list)(void *ctx, rdma_port_info *out, int max);
    int (*open)(void *ctx, const rdma_port_info *port, rdma_nic **out);
    void (*close)(rdma_nic *nic);
    int (*reg_mr)(rdma_nic *nic, void *addr, size_t len, rdma_mr **mr, uint32_t *lkey,
                  uint32_t *rkey);
    /* DMA-BUF registration (GPU memory without nvidia-peermem). */
    int (*reg_dmabuf_mr)(rdma_nic *nic, uint64_t offset, size_t len, uint64_t iova, int fd,
                         rdma_mr **mr, uint32_t *lkey, uint32_t *rkey);
    void (*dereg_mr)(rdma_mr *mr);
    int (*create_qp)(rdma_nic *nic, int max_wr, rdma_qp **qp, uint32_t *qpn);
    /* RESET -> INIT -> RTR -> RTS towards remote. */
    int (*connect_qp)(rdma_qp *qp, const rdma_qp_attr *local, const rdma_qp_attr *remote);
    void (*destroy_qp)(rdma_qp *qp);
    /* Post a chain of n work requests. */
    int (*post)(rdma_qp *qp, const rdma_wr *wrs, int n);
    /* Reap up to max completions of the NIC's CQ without blocking. */
    int (*poll)(rdma_nic *nic, rdma_wc *out, int max);
    /* Completion events (the CQ is created on a completion channel):
     * cq_fd: the channel's descriptor, readable while an event is pending
     * (poll(2) it; it is non-blocking).  req_notify: arm the CQ so that the
     * next completion queued on it raises one event (completions already in
     * the CQ may not: poll again after arming).  get_event: consume and
     * acknowledge the pending events: 0, or -EAGAIN when there was none. */
    int (*cq_fd)(rdma_nic *nic);
    int (*req_notify)(rdma_nic *nic);
    int (*get_event)(rdma_nic *nic);
} rdma_verbs;

/* libibverbs (NULL when this build has no libibverbs). */
const rdma_verbs *rdma_verbs_ibv(void);

/* The table engines created from now on use (tests: a fake); NULL = the
 * default, rdma_verbs_ibv(). */
void rdma_verbs_override(const rdma_verbs *v);
const rdma_verbs *rdma_verbs_current(void);

#endif
