/*
 * collective — the tensor-parallel group's communication behind one interface
 * (docs/parallel.md): N ranks as N processes of one host.  Two things travel:
 *
 *  - the collectives of the sharded forward, on activations in a backend's memory: in-place
 *    all-reduce (sum) and all-gather.  CPU ranks (host addresses) go through a shared-memory
 *    segment; CUDA ranks through the CUDA module's NCCL communicator (kernels/cuda/cuda_tp.h)
 *    once collective_attach_nccl() joined it (all-gather then is an all-reduce of a zeroed
 *    buffer holding each rank's part at its offset: exact, and NCCL's table needs nothing more);
 *  - the step broadcast: rank 0 (the engine front: scheduler, API) sends each step's batch to
 *    the other ranks as one host message (collective_send / collective_recv), always through
 *    the shared-memory segment, whichever device computes.
 *
 * Determinism.  The shared-memory all-reduce sums rank 0 + rank 1 + ... + rank N-1 in that
 * order, element by element in f32, and every rank computes the whole sum the same way: every
 * rank ends with bit-identical values, the same every run.
 *
 * Faults.  Every rank holds a robust process-shared mutex in the segment for its lifetime;
 * a wait that lasts checks its peers' mutexes (EOWNERDEAD: the peer died, whatever the way,
 * zombie or not), and a rank that sees a dead peer poisons the group: every call of every
 * rank then returns -EPIPE at once (logged once per rank, naming the rank that died) instead
 * of waiting forever.
 *
 * Lifecycle: rank 0 makes the group (collective_create: a memfd, mapped shared) before it
 * spawns the other ranks, which inherit the descriptor (collective_open with its number);
 * every rank calls collective_join with its rank before the first collective.
 */
#ifndef DISAGG_KERNELS_COLLECTIVE_H
#define DISAGG_KERNELS_COLLECTIVE_H

#include "kernels/backend.h"

#include <stddef.h>

typedef struct collective collective;

#define COLLECTIVE_MAX_RANKS 8

/* A new group of n_ranks (2..COLLECTIVE_MAX_RANKS) in a fresh memfd segment with room for
 * slot_bytes per rank per collective (the largest all-reduce / all-gather part) and msg_bytes
 * of step message.  The caller is rank 0 (collective_join(c, 0) still needed).  0, or a
 * negative errno with err saying what. */
int collective_create(int n_ranks, size_t slot_bytes, size_t msg_bytes, collective **out, char *err,
                      size_t errlen);
/* The group of an inherited segment descriptor (collective_fd of rank 0's). */
int collective_open(int fd, collective **out, char *err, size_t errlen);
/* The segment's descriptor, to hand to a spawned rank (it must survive exec: the caller
 * clears FD_CLOEXEC in the child). */
int collective_fd(const collective *c);
/* Takes rank `rank`'s place (its liveness mutex).  0, or -EINVAL (taken, out of range). */
int collective_join(collective *c, int rank);
void collective_free(collective *c); /* NULL is fine; leaves the group (peers see it gone) */

int collective_rank(const collective *c);
int collective_size(const collective *c);
size_t collective_slot_bytes(const collective *c);
size_t collective_msg_bytes(const collective *c); /* the step channel's capacity */

/* Device collectives of the CUDA module's NCCL for buffers of be (a CUDA backend): joins the
 * NCCL group (rank 0 makes the unique id and sends it over the step channel; every rank calls
 * this at the same point).  0, or a negative errno with err saying why (no module, no NCCL). */
int collective_attach_nccl(collective *c, backend *be, int device, char *err, size_t errlen);

/* buf (n elements of dt) = the sum over the ranks, in place, on every rank.  On the CPU
 * (shared memory): dt F32, buf a host address, n * 4 <= collective_slot_bytes; st is synced
 * first.  With NCCL: dt F32 or BF16 in be's memory.  0, -EPIPE (a peer died), -EINVAL. */
int collective_all_reduce(collective *c, backend_stream *st, void *buf, backend_dtype dt, size_t n);
/* dst (size * bytes) = the ranks' src (bytes each) concatenated in rank order, on every rank. */
int collective_all_gather(collective *c, backend_stream *st, void *dst, const void *src,
                          size_t bytes);

/* The step channel: rank 0 sends n bytes (<= msg_bytes) to every other rank, which receive
 * them with collective_recv (waiting as long as it takes: rank 0 may be idle; *n gets the
 * length).  collective_send returns once every rank has taken the previous message.
 * 0, -EPIPE (a peer died), -EMSGSIZE. */
int collective_send(collective *c, const void *msg, size_t n);
int collective_recv(collective *c, void *msg, size_t cap, size_t *n);

/* Marks the group failed (every rank's calls return -EPIPE); what = why, logged. */
void collective_poison(collective *c, const char *what);
int collective_poisoned(const collective *c);

/* Seconds spent in all-reduce / all-gather by this rank and their number (for the bench). */
void collective_stats(const collective *c, double *seconds, long *calls);

#endif
