/*
 * tp_pull — the connector's side of tensor parallelism (docs/parallel.md): which
 * TP shape this instance has, which prefill ranks a decode rank pulls from (by their
 * side-channel addresses in the bootstrap table), and the runs a prefill rank writes for a
 * pull that names the decode rank's TP shape (remote_tp_size / remote_tp_rank, PROTOCOL.md
 * §3).  The arithmetic is xfer_plan.h's "tensor parallelism"; the model's KV shape comes
 * from the layout fingerprint (engine.c engine_get_kv_region), whose head count is the
 * model's total (a TP rank's region holds its share of them).
 */
#ifndef DISAGG_CONNECTOR_MOONCAKE_TP_PULL_H
#define DISAGG_CONNECTOR_MOONCAKE_TP_PULL_H

#include "connector/mooncake/bootstrap_client.h"
#include "connector/mooncake/side_channel_msg.h"
#include "connector/mooncake/xfer_plan.h"
#include "engine/kv_connector.h"

#include <stddef.h>
#include <stdint.h>

/* This instance's place in its TP group. */
typedef struct tp_local {
    int tp_size; /* ranks in the group, >= 1 */
    int tp_rank; /* this process's rank */
} tp_local;

/* The KV shape from a layout fingerprint "<family>:L<layers>:kvh<heads>:hd<dim>:bs<tokens>:
 * <f32|f16|bf16>:layer-kv-token-major:..."; XFER_PLAN_EINVAL with a message otherwise. */
int tp_shape_from_fingerprint(const char *fp, xfer_kv_shape *out, char *err, size_t err_cap);

/* One prefill rank a decode rank pulls from. */
typedef struct tp_pull_peer {
    int p_rank;          /* prefill tp_rank */
    const char *addr;    /* its side channel, "tcp://ip:port" (points into the table) */
    xfer_tp_slice heads; /* the heads it writes (n_heads 0: a release only) */
} tp_pull_peer;

/* The prefill ranks of p (a bootstrap table entry: its tp_size is P's TP size) that decode
 * rank d pulls from, into out (room for max); returns how many, or a negative code with a
 * message: P with pipeline parallelism, TP sizes that do not fit the heads or each other,
 * a paired prefill rank that has not registered yet. */
int tp_pull_peers(const bootstrap_engine *p, const tp_local *d, int n_kv_heads, tp_pull_peer *out,
                  int max, char *err, size_t err_cap);

/* Producer: the plain runs this rank (own, with region) writes for one request of pull:
 * p_ids (n_p) its blocks, d_ids (n_d) the decoder's; *runs malloc'd (free it), *n_runs
 * their number (0: nothing to write).  0 or a negative code with a message. */
int tp_send_runs(const engine_kv_region *region, const tp_local *own, const side_channel_pull *pull,
                 const int64_t *p_ids, size_t n_p, const int64_t *d_ids, size_t n_d,
                 xfer_run **runs, size_t *n_runs, char *err, size_t err_cap);

#endif
