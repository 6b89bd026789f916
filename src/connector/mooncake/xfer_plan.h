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

/* ---- tensor parallelism: which P ranks feed which D rank, and which bytes -----------
 *
 * With TP, each rank's KV region holds only its KV heads, in the same block-major layout:
 *   block (n_layers, 2 [K,V], block_size, local_heads, head_dim) of elem_bytes
 * so a block is rows = n_layers * 2 * block_size rows of local_heads * head_dim elements.
 * Heads are split as vLLM's QKVParallelLinear does: with tp <= H (total KV heads, tp
 * dividing H) rank r holds heads [r * H / tp, (r + 1) * H / tp); with tp > H (H dividing
 * tp) the heads are replicated and rank r holds the one head r * H / tp.  Any other
 * combination is refused.
 *
 * Which P ranks a D rank contacts is vLLM's TpKVTopology.get_target_remote_ranks: with
 * D TP >= P TP (ratio = D/P), D rank d contacts P rank d / ratio; with P TP > D TP
 * (ratio = P/D), it contacts P ranks d * ratio .. d * ratio + ratio - 1.  P TP and D TP
 * must divide one another.  Each contacted P rank writes the heads it shares with the D
 * rank; when P replicates heads, only the lowest contacted P rank holding a head writes
 * it, the others get a request with no heads to write — a release (they count the D rank
 * among their consumers, so they free the blocks at once instead of at the abort timeout).
 *
 * Between shards the bytes of one block are strided: each row carries a head range at an
 * offset, so a pair of block runs becomes one 2-D run (len bytes, count rows, a pitch per
 * side) — what cudaMemcpy2D takes, no gather on the host.  Consecutive block ids on both
 * sides continue the row pitch (dense blocks), so they coalesce into one 2-D run. */

#define XFER_TP_MAX 1024 /* largest TP size accepted */

typedef struct xfer_kv_shape {
    int n_layers;   /* layers per block */
    int block_size; /* tokens per block */
    int n_kv_heads; /* total KV heads of the model (all ranks together) */
    int head_dim;   /* elements per head */
    int elem_bytes; /* bytes per element of the KV dtype */
} xfer_kv_shape;

/* One side of a pull: its TP shape and the rank's KV region. */
typedef struct xfer_tp_side {
    int tp_size;        /* >= 1 */
    int tp_rank;        /* 0..tp_size-1 */
    uint64_t base;      /* address of block 0 of this rank's region */
    uint64_t block_len; /* stride between blocks, bytes (>= the rank's block bytes) */
} xfer_tp_side;

/* The heads one P rank writes into one D rank. */
typedef struct xfer_tp_slice {
    int head0;   /* first global KV head written */
    int n_heads; /* heads written; 0: nothing, the request is a release */
    int p_off;   /* first head's index within P's local heads */
    int d_off;   /* its index within D's local heads */
} xfer_tp_slice;

/* A strided copy: count rows of len bytes; row i is at src + i * src_pitch and goes to
 * dst + i * dst_pitch.  count == 1 is a plain run. */
typedef struct xfer_run2d {
    uint64_t src, dst, len;
    uint64_t count;
    uint64_t src_pitch, dst_pitch;
} xfer_run2d;

/* 0 when a TP size tp can hold n_kv_heads KV heads (see above), else XFER_PLAN_EINVAL
 * with a message naming the numbers and what is accepted. */
int xfer_tp_check_size(int tp, int n_kv_heads, const char *who, char *err, size_t err_cap);
/* Both sides' sizes, and that they divide one another (vLLM's tp_ratio). */
int xfer_tp_check(int p_tp, int d_tp, int n_kv_heads, char *err, size_t err_cap);
/* Heads of rank r of tp: first global head and how many (the rank's local heads). */
void xfer_tp_heads(int tp, int rank, int n_kv_heads, int *head0, int *n);
/* The P ranks D rank d_rank contacts, ascending, into p_ranks (room for max); returns
 * their number or a negative code. */
int xfer_tp_peers(int p_tp, int d_tp, int d_rank, int *p_ranks, int max);
/* How many D ranks contact P rank p_rank (what P waits for before freeing a request). */
int xfer_tp_consumers(int p_tp, int d_tp, int p_rank);
/* What P rank p_rank writes into D rank d_rank; XFER_PLAN_EINVAL with a message when d_rank
 * does not contact p_rank, or the shapes are refused. */
int xfer_tp_slice_of(int p_tp, int p_rank, int d_tp, int d_rank, int n_kv_heads, xfer_tp_slice *out,
                     char *err, size_t err_cap);

/* The 2-D runs P rank p->tp_rank writes into D rank d->tp_rank for one request (tail
 * pairing as xfer_plan_request); returns the number of runs (0: nothing to write: a
 * release, or a P rank whose heads another rank writes) or a negative code with a message.
 * Equal head sets on both sides give whole-block runs (count 1), coalesced as
 * xfer_plan_request does. */
int xfer_plan_tp_request(const int64_t *p_ids, size_t n_p, const int64_t *d_ids, size_t n_d,
                         const xfer_kv_shape *shape, const xfer_tp_side *p, const xfer_tp_side *d,
                         uint64_t p_num_blocks, xfer_run2d *runs, size_t max_runs, char *err,
                         size_t err_cap);

/* Expands 2-D runs into plain runs for a transfer engine that takes (src, dst, len) only;
 * rows that touch on both sides (len == both pitches) stay one run.  Returns the number
 * of runs or XFER_PLAN_ENOSPC (with a message) when out (capacity max) is too small. */
int xfer_run2d_flatten(const xfer_run2d *in, size_t n, xfer_run *out, size_t max, char *err,
                       size_t err_cap);

/* Rank r's block bytes under shape (rows * local heads * head_dim * elem_bytes). */
uint64_t xfer_tp_block_bytes(const xfer_kv_shape *shape, int tp, int rank);

/* ---- layer-wise streaming -----------------------------------------------------------------
 *
 * In the block-major region (block (n_layers, 2, block_size, heads, head_dim)) layer l of a
 * block is the block_len / n_layers bytes at l * that: one layer of a run of blocks is a
 * strided piece, one run per block.  xfer_plan_layers gives the runs that move layers
 * [first, first + count) of n paired blocks (p_ids[i] -> d_ids[i], both regions with
 * block_len bytes a block): one run per block, except that whole blocks (count == n_layers)
 * are coalesced where both sides' ids are consecutive.  Returns the number of runs (n for a
 * layer range), or a negative code with a message (ids out of range: p_num_blocks bounds
 * P's; a layer range outside 0..n_layers; block_len not a multiple of n_layers; runs full). */
int xfer_plan_layers(const int64_t *p_ids, const int64_t *d_ids, size_t n, uint64_t p_base,
                     uint64_t d_base, uint64_t block_len, uint64_t p_num_blocks, int n_layers,
                     int first, int count, xfer_run *runs, size_t max_runs, char *err,
                     size_t err_cap);

#endif
