/*
 * rdma — the rdma transport (transport.h) over a verbs table (rdma_verbs.h):
 * RC queue pairs, one-sided WRITE / READ straight between registered
 * memory (host memory, or GPU memory registered through nvidia-peermem or
 * DMA-BUF), no target thread involved.
 *
 * NICs: every active device, or those named in the device_name whitelist.
 * Every registration is registered on each NIC; the descriptor lists the
 * NICs ("devices": name, lid, gid) and each buffer's rkeys in that order
 * (Mooncake's fields).  Opening a peer connects one QP per local NIC to a
 * NIC of the peer (local NIC i -> peer NIC i mod n) with Mooncake's
 * handshake (type 0 frame: local_nic_path / peer_nic_path "segment@nic",
 * qp_num, plus local_lid / local_gid / mtu); chunks stripe over the QPs.
 * Selective signaling: one signaled work request in SIGNAL_EVERY (and the
 * last of each post); a signaled completion retires every op before it.
 * A QP whose NIC fails (error completion or failed post) is dropped and its
 * ops are retried on the peer's other QPs.
 */
#ifndef DISAGG_TRANSFER_RDMA_H
#define DISAGG_TRANSFER_RDMA_H

#include "transfer/rdma_verbs.h"
#include "transfer/registry.h"
#include "transfer/segment_desc.h"
#include "transfer/transport.h"

typedef struct rdma_transport_cfg {
    const rdma_verbs *verbs;
    const char *device_name; /* comma-separated NIC whitelist; NULL/"" = all */
    const char *self_name;   /* this engine's segment name (filled in before use) */
    uint64_t connect_timeout_ns;
    const transfer_device_ops *const *dev; /* for DMA-BUF registration */
    const char *secret; /* auth_secret: each queue-pair handshake is authenticated (NULL = none) */
} rdma_transport_cfg;

/* TRANSFER_ENOSEG when no usable NIC is found (the caller falls back to
 * tcp), TRANSFER_EINVAL when a whitelisted NIC does not exist. */
int rdma_transport_create(const xfer_sink *sink, const rdma_transport_cfg *cfg, transport **out);

/* The table's entry (transports.c). */
extern const transport_ops rdma_transport_ops;
/* Whether registering GPU memory goes through DMA-BUF (WITH_NVIDIA_PEERMEM=0). */
int rdma_use_dmabuf(void);

#endif
