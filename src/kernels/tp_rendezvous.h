/*
 * tp_rendezvous — how the ranks of one tensor-parallel group (one process per GPU, one
 * host) agree on the NCCL unique id before ncclCommInitRank (kernels/cuda/cuda_tp.h): rank 0
 * publishes a small blob under a path in a directory the ranks share (e.g. the instance's
 * run directory); every other rank waits for it, with a deadline.  The blob is written to a
 * temporary name and rename()d into place, so a reader sees all of it or nothing.  Plain C,
 * no CUDA: testable anywhere.
 */
#ifndef DISAGG_KERNELS_TP_RENDEZVOUS_H
#define DISAGG_KERNELS_TP_RENDEZVOUS_H

#include <stddef.h>

#define TP_RENDEZVOUS_MAX 4096 /* largest blob */

/* Writes n bytes of data as path (mode 0600).  0, or a negative errno with err saying what. */
int tp_rendezvous_publish(const char *path, const void *data, size_t n, char *err, size_t errlen);
/* Waits up to timeout_s for path to appear, then reads exactly n bytes into data.
 * -ETIMEDOUT (err names the path and the wait), -EPROTO when the file holds another size,
 * another negative errno for an I/O failure. */
int tp_rendezvous_wait(const char *path, void *data, size_t n, double timeout_s, char *err,
                       size_t errlen);

#endif
