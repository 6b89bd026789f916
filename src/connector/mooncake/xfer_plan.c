/* xfer_plan — see xfer_plan.h. */
#include "connector/mooncake/xfer_plan.h"

#include <stdio.h>

/* a * b + c without wrapping; -1 on overflow. */
static int mul_add(uint64_t a, uint64_t b, uint64_t c, uint64_t *out) {
    if (b && a > (UINT64_MAX - c) / b) return -1;
    *out = a * b + c;
    return 0;
}

/* Both planners' checks of the block ids (d asks for n_d of p's n_p; P's tail goes). */
static int too_few(size_t n_p, size_t n_d, char *err, size_t err_cap) {
    snprintf(err, err_cap, "the decode side asked for %zu blocks but the prefill side holds %zu",
             n_d, n_p);
    return XFER_PLAN_ETOOFEW;
}

static int ids_ok(const int64_t *src_ids, const int64_t *d_ids, size_t n_d, uint64_t p_num_blocks,
                  char *err, size_t err_cap) {
    for (size_t i = 0; i < n_d; i++) {
        if (src_ids[i] < 0 || (uint64_t)src_ids[i] >= p_num_blocks || d_ids[i] < 0) {
            snprintf(err, err_cap, "block id out of range: prefill %lld (of %llu), decode %lld",
                     (long long)src_ids[i], (unsigned long long)p_num_blocks, (long long)d_ids[i]);
            return XFER_PLAN_EINVAL;
        }
    }
    return 0;
}

int xfer_plan_request(const int64_t *p_ids, size_t n_p, const int64_t *d_ids, size_t n_d,
                      const xfer_region *p_regions, const xfer_region *d_regions, size_t n_regions,
                      uint64_t p_num_blocks, xfer_run *runs, size_t max_runs, char *err,
                      size_t err_cap) {
    if (n_d == 0) return 0;
    if (n_p < n_d) return too_few(n_p, n_d, err, err_cap);
    for (size_t r = 0; r < n_regions; r++) {
        const xfer_region *p = &p_regions[r], *d = &d_regions[r];
        if (p->kv_block_len != d->kv_block_len || p->kv_block_len == 0 ||
            p->kv_block_len > p->block_len || d->kv_block_len > d->block_len) {
            snprintf(err, err_cap,
                     "KV region %zu does not match: prefill block_len %llu kv_block_len %llu, "
                     "decode block_len %llu kv_block_len %llu",
                     r, (unsigned long long)p->block_len, (unsigned long long)p->kv_block_len,
                     (unsigned long long)d->block_len, (unsigned long long)d->kv_block_len);
            return XFER_PLAN_EINVAL;
        }
    }
    const int64_t *src_ids = p_ids + (n_p - n_d); /* the tail */
    int rc = ids_ok(src_ids, d_ids, n_d, p_num_blocks, err, err_cap);
    if (rc) return rc;
    size_t n = 0;
    for (size_t r = 0; r < n_regions; r++) {
        const xfer_region *p = &p_regions[r], *d = &d_regions[r];
        int dense = p->block_len == p->kv_block_len && d->block_len == d->kv_block_len;
        for (size_t i = 0; i < n_d;) {
            size_t j = i + 1;
            while (dense && j < n_d && src_ids[j] == src_ids[j - 1] + 1 &&
                   d_ids[j] == d_ids[j - 1] + 1)
                j++;
            if (n == max_runs) {
                snprintf(err, err_cap, "more than %zu transfer runs", max_runs);
                return XFER_PLAN_ENOSPC;
            }
            xfer_run *run = &runs[n++];
            if (mul_add((uint64_t)src_ids[i], p->block_len, p->base, &run->src) ||
                mul_add((uint64_t)d_ids[i], d->block_len, d->base, &run->dst) ||
                mul_add((uint64_t)(j - i - 1), p->kv_block_len, p->kv_block_len, &run->len) ||
                run->src > UINT64_MAX - run->len || run->dst > UINT64_MAX - run->len) {
                snprintf(err, err_cap, "block address overflows 64 bits (region %zu)", r);
                return XFER_PLAN_EINVAL;
            }
            i = j;
        }
    }
    return (int)n;
}

/* ---- tensor parallelism (xfer_plan.h "tensor parallelism") ----------------------------- */

int xfer_tp_check_size(int tp, int n_kv_heads, const char *who, char *err, size_t err_cap) {
    if (n_kv_heads < 1) {
        snprintf(err, err_cap, "the model has %d KV heads; at least 1 is needed", n_kv_heads);
        return XFER_PLAN_EINVAL;
    }
    if (tp < 1 || tp > XFER_TP_MAX) {
        snprintf(err, err_cap, "%s tensor-parallel size %d is out of range (1..%d)", who, tp,
                 XFER_TP_MAX);
        return XFER_PLAN_EINVAL;
    }
    if (n_kv_heads % tp != 0 && tp % n_kv_heads != 0) {
        snprintf(err, err_cap,
                 "%s tensor-parallel size %d cannot hold %d KV heads: the TP size must divide "
                 "the KV heads (split) or be a multiple of them (replicated)",
                 who, tp, n_kv_heads);
        return XFER_PLAN_EINVAL;
    }
    return 0;
}

int xfer_tp_check(int p_tp, int d_tp, int n_kv_heads, char *err, size_t err_cap) {
    int rc = xfer_tp_check_size(p_tp, n_kv_heads, "prefill", err, err_cap);
    if (!rc) rc = xfer_tp_check_size(d_tp, n_kv_heads, "decode", err, err_cap);
    if (rc) return rc;
    if ((p_tp >= d_tp ? p_tp % d_tp : d_tp % p_tp) != 0) {
        snprintf(err, err_cap,
                 "prefill tensor-parallel size %d and decode tensor-parallel size %d do not "
                 "divide one another (one must be a multiple of the other)",
                 p_tp, d_tp);
        return XFER_PLAN_EINVAL;
    }
    return 0;
}

void xfer_tp_heads(int tp, int rank, int n_kv_heads, int *head0, int *n) {
    if (tp <= n_kv_heads) {
        *n = n_kv_heads / tp;
        *head0 = rank * *n;
    } else {
        *n = 1;
        *head0 = (int)((int64_t)rank * n_kv_heads / tp);
    }
}

int xfer_tp_peers(int p_tp, int d_tp, int d_rank, int *p_ranks, int max) {
    if (p_tp < 1 || d_tp < 1 || d_rank < 0 || d_rank >= d_tp) return XFER_PLAN_EINVAL;
    if (d_tp >= p_tp) {
        if (max < 1) return XFER_PLAN_ENOSPC;
        p_ranks[0] = d_rank / (d_tp / p_tp);
        return 1;
    }
    int k = p_tp / d_tp;
    if (max < k) return XFER_PLAN_ENOSPC;
    for (int i = 0; i < k; i++)
        p_ranks[i] = d_rank * k + i;
    return k;
}

int xfer_tp_consumers(int p_tp, int d_tp, int p_rank) {
    if (p_tp < 1 || d_tp < 1 || p_rank < 0 || p_rank >= p_tp) return XFER_PLAN_EINVAL;
    return d_tp >= p_tp ? d_tp / p_tp : 1;
}

int xfer_tp_slice_of(int p_tp, int p_rank, int d_tp, int d_rank, int n_kv_heads, xfer_tp_slice *out,
                     char *err, size_t err_cap) {
    int rc = xfer_tp_check(p_tp, d_tp, n_kv_heads, err, err_cap);
    if (rc) return rc;
    if (p_rank < 0 || p_rank >= p_tp || d_rank < 0 || d_rank >= d_tp) {
        snprintf(err, err_cap,
                 "tensor-parallel rank out of range: prefill %d of %d, decode %d of %d", p_rank,
                 p_tp, d_rank, d_tp);
        return XFER_PLAN_EINVAL;
    }
    int peers[XFER_TP_MAX], np = xfer_tp_peers(p_tp, d_tp, d_rank, peers, XFER_TP_MAX);
    int first = np > 0 ? peers[0] : 0;
    if (np < 1 || p_rank < first || p_rank >= first + np) {
        snprintf(err, err_cap,
                 "prefill tp_rank %d is not paired with decode tp_rank %d (prefill TP %d, decode "
                 "TP %d: that decode rank pulls from prefill ranks %d..%d)",
                 p_rank, d_rank, p_tp, d_tp, first, first + np - 1);
        return XFER_PLAN_EINVAL;
    }
    int ph, pn, dh, dn;
    xfer_tp_heads(p_tp, p_rank, n_kv_heads, &ph, &pn);
    xfer_tp_heads(d_tp, d_rank, n_kv_heads, &dh, &dn);
    int lo = ph > dh ? ph : dh, hi = ph + pn < dh + dn ? ph + pn : dh + dn;
    *out = (xfer_tp_slice){.head0 = lo, .n_heads = hi > lo ? hi - lo : 0};
    /* replicated P heads: a lower paired rank holding the same head writes it */
    if (out->n_heads && p_rank > first) {
        int qh, qn;
        xfer_tp_heads(p_tp, p_rank - 1, n_kv_heads, &qh, &qn);
        if (qh == ph) out->n_heads = 0;
    }
    if (out->n_heads) {
        out->p_off = lo - ph;
        out->d_off = lo - dh;
    } else {
        out->head0 = 0;
    }
    return 0;
}

uint64_t xfer_tp_block_bytes(const xfer_kv_shape *s, int tp, int rank) {
    int h0, n;
    xfer_tp_heads(tp, rank, s->n_kv_heads, &h0, &n);
    return (uint64_t)s->n_layers * 2u * (uint64_t)s->block_size * (uint64_t)n *
           (uint64_t)s->head_dim * (uint64_t)s->elem_bytes;
}

static int shape_ok(const xfer_kv_shape *s, char *err, size_t cap) {
    if (s->n_layers < 1 || s->block_size < 1 || s->n_kv_heads < 1 || s->head_dim < 1 ||
        s->elem_bytes < 1 || s->n_layers > 4096 || s->block_size > 65536 || s->n_kv_heads > 4096 ||
        s->head_dim > 4096 || s->elem_bytes > 16) {
        snprintf(err, cap,
                 "bad KV shape: %d layers, block_size %d, %d KV heads, head_dim %d, %d-byte "
                 "elements (each must be >= 1; at most 4096 layers, block_size 65536, 4096 heads, "
                 "head_dim 4096, 16 bytes)",
                 s->n_layers, s->block_size, s->n_kv_heads, s->head_dim, s->elem_bytes);
        return XFER_PLAN_EINVAL;
    }
    return 0;
}

int xfer_plan_tp_request(const int64_t *p_ids, size_t n_p, const int64_t *d_ids, size_t n_d,
                         const xfer_kv_shape *shape, const xfer_tp_side *p, const xfer_tp_side *d,
                         uint64_t p_num_blocks, xfer_run2d *runs, size_t max_runs, char *err,
                         size_t err_cap) {
    int rc = shape_ok(shape, err, err_cap);
    xfer_tp_slice sl;
    if (!rc)
        rc = xfer_tp_slice_of(p->tp_size, p->tp_rank, d->tp_size, d->tp_rank, shape->n_kv_heads,
                              &sl, err, err_cap);
    if (rc) return rc;
    if (n_d == 0 || sl.n_heads == 0) return 0;
    if (n_p < n_d) return too_few(n_p, n_d, err, err_cap);
    uint64_t head_bytes = (uint64_t)shape->head_dim * (uint64_t)shape->elem_bytes;
    uint64_t rows = (uint64_t)shape->n_layers * 2u * (uint64_t)shape->block_size;
    uint64_t p_bb = xfer_tp_block_bytes(shape, p->tp_size, p->tp_rank);
    uint64_t d_bb = xfer_tp_block_bytes(shape, d->tp_size, d->tp_rank);
    uint64_t p_row = p_bb / rows, d_row = d_bb / rows, len = (uint64_t)sl.n_heads * head_bytes;
    if (p->block_len < p_bb || d->block_len < d_bb) {
        snprintf(err, err_cap,
                 "KV region too small for its heads: prefill block_len %llu (needs %llu), decode "
                 "block_len %llu (needs %llu)",
                 (unsigned long long)p->block_len, (unsigned long long)p_bb,
                 (unsigned long long)d->block_len, (unsigned long long)d_bb);
        return XFER_PLAN_EINVAL;
    }
    const int64_t *src_ids = p_ids + (n_p - n_d); /* the tail */
    rc = ids_ok(src_ids, d_ids, n_d, p_num_blocks, err, err_cap);
    if (rc) return rc;
    int whole = len == p_row && len == d_row; /* same heads on both sides */
    int dense = p->block_len == p_bb && d->block_len == d_bb;
    uint64_t src_off = (uint64_t)sl.p_off * head_bytes, dst_off = (uint64_t)sl.d_off * head_bytes;
    size_t n = 0;
    for (size_t i = 0; i < n_d;) {
        size_t j = i + 1;
        while (dense && j < n_d && src_ids[j] == src_ids[j - 1] + 1 && d_ids[j] == d_ids[j - 1] + 1)
            j++;
        if (n == max_runs) {
            snprintf(err, err_cap, "more than %zu transfer runs", max_runs);
            return XFER_PLAN_ENOSPC;
        }
        xfer_run2d *r = &runs[n++];
        uint64_t nb = (uint64_t)(j - i), last_src, last_dst;
        int bad = mul_add((uint64_t)src_ids[i], p->block_len, p->base, &r->src) ||
                  mul_add((uint64_t)d_ids[i], d->block_len, d->base, &r->dst) ||
                  r->src > UINT64_MAX - src_off || r->dst > UINT64_MAX - dst_off;
        if (!bad) {
            r->src += src_off;
            r->dst += dst_off;
            if (whole) {
                bad = mul_add(nb, p_bb, 0, &r->len);
                r->count = 1;
                r->src_pitch = r->dst_pitch = r->len;
            } else {
                r->len = len;
                r->count = nb * rows;
                r->src_pitch = p_row;
                r->dst_pitch = d_row;
            }
            /* the last byte of the run on each side must fit in 64 bits */
            bad = bad || mul_add(r->count - 1, r->src_pitch, r->src, &last_src) ||
                  mul_add(r->count - 1, r->dst_pitch, r->dst, &last_dst) ||
                  last_src > UINT64_MAX - r->len || last_dst > UINT64_MAX - r->len;
        }
        if (bad) {
            snprintf(err, err_cap, "block address overflows 64 bits");
            return XFER_PLAN_EINVAL;
        }
        i = j;
    }
    return (int)n;
}

int xfer_run2d_flatten(const xfer_run2d *in, size_t n, xfer_run *out, size_t max, char *err,
                       size_t err_cap) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const xfer_run2d *r = &in[i];
        int touch = r->len == r->src_pitch && r->len == r->dst_pitch;
        uint64_t rows = touch ? 1 : r->count, len = touch ? r->len * r->count : r->len;
        if (rows > max - k) {
            snprintf(err, err_cap, "more than %zu transfer runs", max);
            return XFER_PLAN_ENOSPC;
        }
        for (uint64_t j = 0; j < rows; j++)
            out[k++] = (xfer_run){r->src + j * r->src_pitch, r->dst + j * r->dst_pitch, len};
    }
    return (int)k;
}

/* ---- layer-wise streaming (xfer_plan.h) --------------------------------------------------- */

int xfer_plan_layers(const int64_t *p_ids, const int64_t *d_ids, size_t n, uint64_t p_base,
                     uint64_t d_base, uint64_t block_len, uint64_t p_num_blocks, int n_layers,
                     int first, int count, xfer_run *runs, size_t max_runs, char *err,
                     size_t err_cap) {
    if (n_layers < 1 || block_len == 0 || block_len % (uint64_t)n_layers != 0) {
        snprintf(err, err_cap, "a block of %llu bytes does not hold %d equal layers",
                 (unsigned long long)block_len, n_layers);
        return XFER_PLAN_EINVAL;
    }
    if (first < 0 || count < 1 || first > n_layers - count) {
        snprintf(err, err_cap, "layers %d..%d are outside 0..%d", first, first + count - 1,
                 n_layers - 1);
        return XFER_PLAN_EINVAL;
    }
    int rc = ids_ok(p_ids, d_ids, n, p_num_blocks, err, err_cap);
    if (rc) return rc;
    uint64_t layer_len = block_len / (uint64_t)n_layers;
    uint64_t off = (uint64_t)first * layer_len, len = (uint64_t)count * layer_len;
    int whole = len == block_len;
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        size_t j = i + 1;
        while (whole && j < n && p_ids[j] == p_ids[j - 1] + 1 && d_ids[j] == d_ids[j - 1] + 1)
            j++;
        if (k == max_runs) {
            snprintf(err, err_cap, "more than %zu transfer runs", max_runs);
            return XFER_PLAN_ENOSPC;
        }
        xfer_run *run = &runs[k++];
        uint64_t src, dst;
        if (mul_add((uint64_t)p_ids[i], block_len, p_base, &src) ||
            mul_add((uint64_t)d_ids[i], block_len, d_base, &dst) || src > UINT64_MAX - off ||
            dst > UINT64_MAX - off) {
            snprintf(err, err_cap, "block address overflows 64 bits");
            return XFER_PLAN_EINVAL;
        }
        run->src = src + off;
        run->dst = dst + off;
        run->len = len * (uint64_t)(j - i);
        i = j;
    }
    return (int)k;
}
