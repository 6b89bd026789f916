/*
 * registry — a set of disjoint memory ranges ([addr, addr+length)) with a
 * location tag, kept sorted by address so that "does [a, a+n) lie inside one
 * range?" is a binary search.  Used for this engine's own registrations (what
 * the tcp server accepts) and for a peer's buffers as its descriptor lists
 * them (what the shm initiator checks).  Not thread-safe: the owner locks.
 */
#ifndef DISAGG_TRANSFER_REGISTRY_H
#define DISAGG_TRANSFER_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#define REGISTRY_MAX_KEYS 8
#define REGISTRY_IPC_MAX  64

typedef struct registry_entry {
    uint64_t addr;     /* first byte */
    uint64_t length;   /* bytes, > 0 */
    char location[32]; /* "cpu:0", "cuda:1", ... */
    unsigned reach;    /* a peer's buffer: transports that reach it (transport.h), 0 = unknown */
    /* rdma: the buffer's remote key on each of the owner's NICs (in the
     * order of its descriptor's "devices"); nkeys = 0 without rdma. */
    uint32_t rkey[REGISTRY_MAX_KEYS];
    uint32_t nkeys;
    /* cuda_ipc: the allocation's handle and the buffer's offset in it
     * (ipc_len = 0: none). */
    uint8_t ipc[REGISTRY_IPC_MAX];
    uint32_t ipc_len;
    uint64_t ipc_off;
} registry_entry;

typedef struct registry {
    registry_entry *v; /* (n) sorted by addr, pairwise disjoint */
    size_t n, cap;
} registry;

void registry_init(registry *r);
void registry_free(registry *r);
/* 0, TRANSFER_EINVAL (zero length / wraps around), TRANSFER_EOVERLAP, TRANSFER_ENOMEM. */
int registry_add(registry *r, uint64_t addr, uint64_t length, const char *location);
/* Remove the entry that starts at addr: 0 or TRANSFER_ENOTREG. */
int registry_remove(registry *r, uint64_t addr);
/* The entry containing all of [addr, addr+length), or NULL (also for length 0
 * or a range that wraps around). */
const registry_entry *registry_find(const registry *r, uint64_t addr, uint64_t length);

#endif
