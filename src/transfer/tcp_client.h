/*
 * tcp_client — the initiator side of the tcp transport for one peer (transport_tcp.c
 * wraps it in the transport interface): a set of
 * paths (local source address -> peer data address, one per usable NIC pair)
 * and on each path several lanes (persistent connections).  Each lane has a
 * sender thread that gathers queued ops into one sendmsg (header and payload
 * together) and a receiver thread that reads the in-order replies, so many
 * requests are in flight per connection.  A lane that fails hands its ops to
 * another path (bounded retries) before they fail; a reply that does not come
 * before the op's deadline fails it with TRANSFER_ETIMEDOUT.
 */
#ifndef DISAGG_TRANSFER_TCP_CLIENT_H
#define DISAGG_TRANSFER_TCP_CLIENT_H

#include "base/net.h"
#include "transfer/transport.h"
#include "transfer/xfer_op.h"

#include <stdint.h>

#define TCP_CLIENT_MAX_PATHS 16

/* A tcp path: local source address -> peer data address. */
typedef struct tcp_path {
    net_addr dst; /* peer data endpoint */
    net_addr src; /* local source address (has_src) */
    int has_src;
    char label[160]; /* "src -> dst", for logs */
} tcp_path;

typedef struct tcp_client tcp_client;

/* secret: NULL, or the shared secret (kept by pointer: it must outlive the
 * client) with which every connection authenticates before its first
 * request (tcp_server.h). */
int tcp_client_create(const xfer_sink *sink, const tcp_path *paths, int npaths, int lanes_per_path,
                      uint64_t connect_timeout_ns, const char *secret, tcp_client **out);
/* Takes ownership of op; it ends through the sink. */
void tcp_client_submit(tcp_client *c, xfer_op *op);
/* End the queued (not yet sent) ops of batch b now, as TRANSFER_ECANCELED. */
void tcp_client_cancel(tcp_client *c, const struct batch *b);
/* Stops every lane; queued and in-flight ops end with TRANSFER_ECANCELED. */
void tcp_client_destroy(tcp_client *c);
int tcp_client_num_lanes(const tcp_client *c);
/* Bytes sent + received on path i (for multi-NIC checks), and retries. */
uint64_t tcp_client_path_bytes(const tcp_client *c, int path);
uint64_t tcp_client_retries(const tcp_client *c);

#endif
