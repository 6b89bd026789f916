/*
 * shm — the same-host transport: the initiator copies bytes straight between
 * its memory and the target process's with process_vm_writev/readv (one copy,
 * no socket, the target's threads not involved).  Ranges were checked against
 * the target's registered buffers before an op gets here (transfer_engine.c).  The
 * engine hands over groups of ops (one vectored call each); small groups run
 * inline in the submitting thread, larger ones on a worker pool so that
 * submit returns at once and big batches use every core.
 */
#ifndef DISAGG_TRANSFER_SHM_H
#define DISAGG_TRANSFER_SHM_H

#include "transfer/transport.h"
#include "transfer/xfer_op.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Copy one range: 0, TRANSFER_EPERM (kernel refused: not same user / ptrace
 * policy), TRANSFER_ECONN (process gone), TRANSFER_EREMOTEADDR (remote range
 * not mapped), TRANSFER_ESYS. */
int shm_copy(pid_t pid, int opcode, void *local, uint64_t remote, size_t len);

typedef struct shm_pool shm_pool;

/* Ops end through sink->done; when the kernel refuses shm for a peer
 * (TRANSFER_EPERM) its ops go to sink->reroute instead. */
int shm_pool_create(const xfer_sink *sink, int nthreads, shm_pool **out);
#define SHM_GROUP_OPS   256        /* ops moved by one process_vm_* call */
#define SHM_GROUP_BYTES (1u << 20) /* a group's bytes, so big batches spread over the workers */

/* Run a group of ops (linked by next; same pid and opcode, at most
 * SHM_GROUP_OPS, bytes in all) — inline when small, else on a worker — and
 * end each through the sink. */
void shm_pool_submit(shm_pool *p, xfer_op *ops, size_t bytes, pid_t pid);
void shm_pool_destroy(shm_pool *p);

/* The shm transport (transport.h): a pool of nthreads workers; requests are
 * cut into chunks of stripe bytes. */
int shm_transport_create(const xfer_sink *sink, int nthreads, size_t stripe, transport **out);
/* The table's entry (transports.c). */
extern const transport_ops shm_transport_ops;

#endif
