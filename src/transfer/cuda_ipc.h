/*
 * cuda_ipc — the same-host transport for device memory on both sides
 * (transport.h), written against the device-memory ops table (transfer.h):
 * the target exports each device registration once (ipc_export: a CUDA IPC
 * or VMM shareable handle, published in its descriptor), the initiator maps
 * a peer's buffer once (ipc_open, cached per peer until it is closed) and
 * moves the bytes with device-to-device copies on its own stream per
 * device; a list of chunks becomes as few copies as their contiguity allows
 * (adjacent on both sides, same direction).  Copies run in the submitting
 * thread, which then syncs the stream and ends the chunks.
 */
#ifndef DISAGG_TRANSFER_CUDA_IPC_H
#define DISAGG_TRANSFER_CUDA_IPC_H

#include "transfer/transport.h"

/* dev: the engine's installed table (NULL inside: none). */
int cuda_ipc_transport_create(const xfer_sink *sink, const transfer_device_ops *const *dev,
                              transport **out);
/* The table's entry (transports.c). */
extern const transport_ops cuda_ipc_transport_ops;
/* Whether the table offers the four ipc functions. */
int cuda_ipc_supported(const transfer_device_ops *d);

#endif
