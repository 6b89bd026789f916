/* xfer_plan — see xfer_plan.h. */
#include "connector/mooncake/xfer_plan.h"

#include <stdio.h>

/* a * b + c without wrapping; -1 on overflow. */
static int mul_add(uint64_t a, uint64_t b, uint64_t c, uint64_t *out) {
    if (b && a > (UINT64_MAX - c) / b) return -1;
    *out = a * b + c;
    return 0;
}

int xfer_plan_request(const int64_t *p_ids, size_t n_p, const int64_t *d_ids, size_t n_d,
                      const xfer_region *p_regions, const xfer_region *d_regions, size_t n_regions,
                      uint64_t p_num_blocks, xfer_run *runs, size_t max_runs, char *err,
                      size_t err_cap) {
    if (n_d == 0) return 0;
    if (n_p < n_d) {
        snprintf(err, err_cap,
                 "the decode side asked for %zu blocks but the prefill side holds %zu", n_d, n_p);
        return XFER_PLAN_ETOOFEW;
    }
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
    for (size_t i = 0; i < n_d; i++) {
        if (src_ids[i] < 0 || (uint64_t)src_ids[i] >= p_num_blocks || d_ids[i] < 0) {
            snprintf(err, err_cap, "block id out of range: prefill %lld (of %llu), decode %lld",
                     (long long)src_ids[i], (unsigned long long)p_num_blocks, (long long)d_ids[i]);
            return XFER_PLAN_EINVAL;
        }
    }
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
