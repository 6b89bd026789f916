/* tp_pull — see tp_pull.h. */
#include "connector/mooncake/tp_pull.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int tp_shape_from_fingerprint(const char *fp, xfer_kv_shape *out, char *err, size_t err_cap) {
    int L = 0, H = 0, hd = 0, bs = 0, used = 0;
    char dt[8] = "", fam[16] = "";
    if (!fp ||
        sscanf(fp, "%15[a-z0-9]:L%d:kvh%d:hd%d:bs%d:%7[a-z0-9]:%n", fam, &L, &H, &hd, &bs, dt,
               &used) != 6 ||
        !used || strncmp(fp + used, "layer-kv-token-major", 20) != 0) {
        snprintf(err, err_cap,
                 "KV layout '%.80s' is not <family>:L<layers>:kvh<heads>:hd<dim>:bs<tokens>:"
                 "<dtype>:layer-kv-token-major",
                 fp ? fp : "(none)");
        return XFER_PLAN_EINVAL;
    }
    int es = !strcmp(dt, "f32")                           ? 4
             : (!strcmp(dt, "f16") || !strcmp(dt, "bf16")) ? 2
             : !strcmp(dt, "fp8e4m3")                      ? 1
                                                           : 0;
    if (!es || L < 1 || H < 1 || hd < 1 || bs < 1) {
        snprintf(err, err_cap,
                 "KV layout '%.80s': bad layers, heads, head_dim, block size or dtype", fp);
        return XFER_PLAN_EINVAL;
    }
    *out = (xfer_kv_shape){L, bs, H, hd, es};
    return 0;
}

int tp_pull_peers(const bootstrap_engine *p, const tp_local *d, int n_kv_heads, tp_pull_peer *out,
                  int max, char *err, size_t err_cap) {
    if (p->pp_size > 1) {
        snprintf(err, err_cap,
                 "prefill engine %s registered %d pipeline-parallel ranks; only pp 1 is supported "
                 "(as vLLM's MooncakeConnector)",
                 p->engine_id, p->pp_size);
        return XFER_PLAN_EINVAL;
    }
    int rc = xfer_tp_check(p->tp_size, d->tp_size, n_kv_heads, err, err_cap);
    if (rc) return rc;
    int ranks[XFER_TP_MAX];
    int n = xfer_tp_peers(p->tp_size, d->tp_size, d->tp_rank, ranks, XFER_TP_MAX);
    if (n < 0 || n > max) {
        snprintf(err, err_cap, "decode tp_rank %d of %d pulls from %d prefill ranks (room for %d)",
                 d->tp_rank, d->tp_size, n, max);
        return n < 0 ? n : XFER_PLAN_ENOSPC;
    }
    for (int i = 0; i < n; i++) {
        const char *a = bootstrap_engine_addr(p, ranks[i], 0);
        if (!a) {
            snprintf(err, err_cap,
                     "prefill engine %s has not registered tp_rank %d (of %d) with its bootstrap "
                     "server",
                     p->engine_id, ranks[i], p->tp_size);
            return XFER_PLAN_EINVAL;
        }
        out[i].p_rank = ranks[i];
        out[i].addr = a;
        rc = xfer_tp_slice_of(p->tp_size, ranks[i], d->tp_size, d->tp_rank, n_kv_heads,
                              &out[i].heads, err, err_cap);
        if (rc) return rc;
    }
    return n;
}

int tp_send_runs(const engine_kv_region *region, const tp_local *own, const side_channel_pull *pull,
                 const int64_t *p_ids, size_t n_p, const int64_t *d_ids, size_t n_d,
                 xfer_run **runs, size_t *n_runs, char *err, size_t err_cap) {
    *runs = NULL;
    *n_runs = 0;
    xfer_kv_shape sh;
    int rc = tp_shape_from_fingerprint(region->fingerprint, &sh, err, err_cap);
    if (rc) return rc;
    if (pull->n_regions != 1 || pull->remote_tp_size < 1 || pull->remote_tp_size > XFER_TP_MAX ||
        pull->remote_tp_rank < 0 || pull->remote_tp_rank >= pull->remote_tp_size) {
        snprintf(err, err_cap, "pull with %zu KV regions, decode tp_rank %lld of %lld",
                 pull->n_regions, (long long)pull->remote_tp_rank, (long long)pull->remote_tp_size);
        return XFER_PLAN_EINVAL;
    }
    xfer_tp_side ps = {own->tp_size, own->tp_rank, (uint64_t)(uintptr_t)region->base,
                       (uint64_t)region->block_bytes};
    xfer_tp_side ds = {(int)pull->remote_tp_size, (int)pull->remote_tp_rank,
                       pull->kv_caches_base_addr[0], (uint64_t)pull->block_lens[0]};
    uint64_t d_bb = xfer_tp_block_bytes(&sh, ds.tp_size, ds.tp_rank);
    if (pull->block_lens[0] < 0 || (uint64_t)pull->kv_block_lens[0] != d_bb) {
        snprintf(err, err_cap,
                 "decoder's kv_block_len %lld is not %llu, what tp_rank %d of %d holds of this "
                 "model's KV",
                 (long long)pull->kv_block_lens[0], (unsigned long long)d_bb, ds.tp_rank,
                 ds.tp_size);
        return XFER_PLAN_EINVAL;
    }
    size_t cap = n_d ? n_d : 1;
    xfer_run2d *r2 = malloc(cap * sizeof *r2);
    if (!r2) {
        snprintf(err, err_cap, "producer out of memory");
        return -ENOMEM;
    }
    int n = xfer_plan_tp_request(p_ids, n_p, d_ids, n_d, &sh, &ps, &ds, (uint64_t)region->n_blocks,
                                 r2, cap, err, err_cap);
    if (n <= 0) {
        free(r2);
        return n;
    }
    size_t flat = 0;
    for (int i = 0; i < n; i++)
        flat += r2[i].len == r2[i].src_pitch && r2[i].len == r2[i].dst_pitch ? 1 : r2[i].count;
    xfer_run *out = malloc(flat * sizeof *out);
    int m = out ? xfer_run2d_flatten(r2, (size_t)n, out, flat, err, err_cap) : -ENOMEM;
    free(r2);
    if (m < 0) {
        if (m == -ENOMEM) snprintf(err, err_cap, "producer out of memory");
        free(out);
        return m;
    }
    *runs = out;
    *n_runs = (size_t)m;
    return 0;
}
