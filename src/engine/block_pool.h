/*
 * block_pool — the KV-cache block allocator: reference-counted block ids, a
 * free queue in LRU order, and automatic prefix caching.  A full block whose
 * KV has been computed gets a hash chained from its predecessor's
 * (block_pool_hash_tokens); while the hash is set, a later request with the
 * same prefix finds the block (block_pool_lookup) and shares it instead of
 * recomputing.  Freed blocks keep their hash and stay findable until the
 * allocator reuses them, least recently freed first — vLLM's design.
 * Not thread-safe: the engine's step loop owns it.  Block ids index the KV
 * region (engine/kv_cache.h); the pool knows nothing about their bytes.
 */
#ifndef DISAGG_ENGINE_BLOCK_POOL_H
#define DISAGG_ENGINE_BLOCK_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef struct block_pool {
    int32_t num_blocks;
    int32_t *ref;         /* (num_blocks) reference count; 0 = in the free queue */
    uint64_t *hash;       /* (num_blocks) prefix hash, 0 = none */
    int32_t *prev, *next; /* (num_blocks) free-queue links, -1 = none */
    int32_t free_head, free_tail, num_free;
    uint64_t *ht_keys;      /* (ht_cap) open-addressing hash -> block; 0 = empty */
    int32_t *ht_vals;       /* (ht_cap) */
    size_t ht_cap;          /* power of two, >= 2 * num_blocks */
    size_t ht_tomb;         /* deleted slots (key 1 = tombstone) */
    uint64_t hits, queries; /* prefix-cache statistics, in blocks */
} block_pool;

int block_pool_init(block_pool *bp, int32_t num_blocks);
void block_pool_free_all(block_pool *bp);

/* Take n blocks off the free queue (LRU first), dropping any cached hash they
 * carried.  All or nothing: -1 (and nothing taken) when fewer are free. */
int block_pool_alloc(block_pool *bp, int32_t n, int32_t *out);
/* Drop one reference to each; blocks reaching 0 join the free queue's tail
 * (most recently freed), keeping their hash.  Freed in reverse order so that
 * the tail of a sequence is evicted before its head. */
void block_pool_release(block_pool *bp, const int32_t *ids, int32_t n);
/* A cached full block with this hash, now referenced once more (taken off the
 * free queue if it was there); -1 when none.  Counts a query / hit. */
int32_t block_pool_lookup(block_pool *bp, uint64_t hash);
/* Whether a cached block with this hash exists (no side effects). */
int block_pool_contains(const block_pool *bp, uint64_t hash);
/* Record that block id now holds the full block with this hash (first writer
 * wins: if another block already has the hash, nothing changes). */
void block_pool_set_hash(block_pool *bp, int32_t id, uint64_t hash);
/* One more reference to a block already in use. */
void block_pool_ref(block_pool *bp, int32_t id);
int32_t block_pool_num_free(const block_pool *bp);
int32_t block_pool_num_used(const block_pool *bp);

/* Hash of a full block of tokens, chained from the previous block's hash (0
 * for the first).  Never returns 0 or 1 (reserved). */
uint64_t block_pool_hash_tokens(uint64_t parent, const int32_t *tokens, int32_t n);

#endif
