/*
 * transport_tcp — the tcp transport (transport.h): the data server
 * (tcp_server) and tcp_client, with device memory staged through pinned host
 * buffers (staging.h).
 */
#ifndef DISAGG_TRANSFER_TRANSPORT_TCP_H
#define DISAGG_TRANSFER_TRANSPORT_TCP_H

#include "transfer/staging.h"
#include "transfer/transport.h"

typedef struct tcp_transport_cfg {
    int lanes; /* per path */
    uint64_t connect_timeout_ns;
    const char *secret;                    /* NULL = none; must outlive the transport */
    size_t stripe;                         /* chunk bytes of host-memory requests */
    const transfer_device_ops *const *dev; /* the engine's installed table (NULL inside: none) */
    stage_stats *stage_stats;
} tcp_transport_cfg;

/* The initiator side alone (no data server). */
int tcp_transport_create(const xfer_sink *sink, const tcp_transport_cfg *cfg, transport **out);
/* The table's entry (transports.c): create also starts the data server. */
extern const transport_ops tcp_transport_ops;

#endif
