/* registry — see registry.h. */
#include "transfer/registry.h"

#include "disagg/transfer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void registry_init(registry *r) {
    memset(r, 0, sizeof *r);
}

void registry_free(registry *r) {
    free(r->v);
    memset(r, 0, sizeof *r);
}

/* Index of the first entry with addr > a (upper bound). */
static size_t upper_bound(const registry *r, uint64_t a) {
    size_t lo = 0, hi = r->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (r->v[mid].addr <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int registry_add(registry *r, uint64_t addr, uint64_t length, const char *location) {
    if (length == 0 || addr + length < addr) return TRANSFER_EINVAL;
    size_t i = upper_bound(r, addr); /* entries [0,i) start at or before addr */
    if (i > 0) {
        const registry_entry *prev = &r->v[i - 1];
        if (prev->addr + prev->length > addr) return TRANSFER_EOVERLAP;
    }
    if (i < r->n && r->v[i].addr < addr + length) return TRANSFER_EOVERLAP;
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 8;
        registry_entry *v = realloc(r->v, cap * sizeof *v);
        if (!v) return TRANSFER_ENOMEM;
        r->v = v;
        r->cap = cap;
    }
    memmove(&r->v[i + 1], &r->v[i], (r->n - i) * sizeof *r->v);
    registry_entry *e = &r->v[i];
    e->addr = addr;
    e->length = length;
    snprintf(e->location, sizeof e->location, "%s", location ? location : "cpu:0");
    e->reach = 0;
    e->nkeys = 0;
    e->ipc_len = 0;
    e->ipc_off = 0;
    r->n++;
    return 0;
}

int registry_remove(registry *r, uint64_t addr) {
    size_t i = upper_bound(r, addr);
    if (i == 0 || r->v[i - 1].addr != addr) return TRANSFER_ENOTREG;
    i--;
    memmove(&r->v[i], &r->v[i + 1], (r->n - i - 1) * sizeof *r->v);
    r->n--;
    return 0;
}

const registry_entry *registry_find(const registry *r, uint64_t addr, uint64_t length) {
    if (length == 0 || addr + length < addr) return NULL;
    size_t i = upper_bound(r, addr);
    if (i == 0) return NULL;
    const registry_entry *e = &r->v[i - 1];
    uint64_t end = e->addr + e->length;
    return (addr >= e->addr && addr + length <= end) ? e : NULL;
}
