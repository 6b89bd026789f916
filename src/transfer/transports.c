/*
 * transports — the transfer engine's table of transports (transport.h): the
 * only place that names them.  Order: the one tried first when the peer's
 * preferred one cannot reach a request's memory comes first, and the
 * preferred one is the first whose prefer() says so; tcp reaches
 * everything and comes last (the fallback).
 */
#include "transfer/cuda_ipc.h"
#include "transfer/rdma.h"
#include "transfer/shm.h"
#include "transfer/transport.h"
#include "transfer/transport_tcp.h"

#include <stdlib.h>
#include <string.h>

const transport_ops *const transport_table[] = {
    &rdma_transport_ops,
    &shm_transport_ops,
    &cuda_ipc_transport_ops,
    &tcp_transport_ops,
};
const int transport_table_len = (int)(sizeof transport_table / sizeof transport_table[0]);
_Static_assert(sizeof transport_table / sizeof transport_table[0] <= TRANSPORT_MAX,
               "raise TRANSPORT_MAX");

int transport_location_parse_device(const char *loc, int *device) {
    if (!loc || strncmp(loc, "cuda:", 5) != 0) return TRANSFER_EINVAL;
    char *end = NULL;
    long n = strtol(loc + 5, &end, 10);
    if (end == loc + 5 || *end || n < 0 || n >= TRANSPORT_MAX_DEVICES) return TRANSFER_EINVAL;
    *device = (int)n;
    return 0;
}
