/*
 * xfer_plan — for one request of a pull, which bytes of P's KV regions are
 * written where in D's (PROTOCOL.md §3 "Semantics", vLLM's
 * _build_transfer_params): D asked for n_d blocks, P holds n_p >= n_d; P sends
 * the TAIL of its blocks (D had a local prefix hit for the rest), pairing
 * p_ids[n_p - n_d + i] with d_ids[i].  Block address = base + id * block_len;
 * kv_block_len bytes are copied per block; runs where both sides' ids are
 * consecutive are coalesced into one descriptor when blocks are dense
 * (block_len == kv_block_len on both sides).  Pure arithmetic: the transfer
 * engine (transfer/) does the copies and checks D's addresses on arrival.
 */
#ifndef DISAGG_CONNECTOR_MOONCAKE_XFER_PLAN_H
#define DISAGG_CONNECTOR_MOONCAKE_XFER_PLAN_H

#include <stddef.h>
#include <stdint.h>

#define XFER_PLAN_EINVAL  (-22) /* inconsistent regions or bad block ids */
#define XFER_PLAN_ETOOFEW (-61) /* P holds fewer blocks than D asked for (ENODATA) */
#define XFER_PLAN_ENOSPC  (-28) /* more runs than the caller's array holds */

typedef struct xfer_region {
    uint64_t base;         /* address of block 0 */
    uint64_t block_len;    /* stride between blocks, bytes */
    uint64_t kv_block_len; /* payload per block, bytes (<= block_len) */
} xfer_region;

typedef struct xfer_run {
    uint64_t src; /* address in P's region */
    uint64_t dst; /* address in D's region */
    uint64_t len; /* bytes */
} xfer_run;

/* Fill runs[0..] (capacity max_runs) for every region pair r (p_regions[r] ->
 * d_regions[r]); returns the number of runs, 0 when n_d == 0 (a release), or a
 * negative code with a message in err.  p_num_blocks bounds P's own ids. */
int xfer_plan_request(const int64_t *p_ids, size_t n_p, const int64_t *d_ids, size_t n_d,
                      const xfer_region *p_regions, const xfer_region *d_regions, size_t n_regions,
                      uint64_t p_num_blocks, xfer_run *runs, size_t max_runs, char *err,
                      size_t err_cap);

#endif
