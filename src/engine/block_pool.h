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

#include "engine/kv_events.h"

#include <stddef.h>
#include <stdint.h>

/* A lower cache tier under the device cache (engine/kv_offload.h behind it):
 * a cached block the allocator is about to reuse is offered to it first
 * (evicted: its bytes are still intact), and a prefix block the device cache
 * lacks may come back from it (load: the bytes copied into block, 0 on
 * success).  find says which of its levels holds a hash (0, 1, ...; -1 none)
 * without side effects; load_async starts the copy into block and returns at
 * once (0 started), the tier's owner reporting the end to whoever asked (tag
 * is theirs), who then calls block_pool_load_finished.  The hooks run on the
 * pool's (the step) thread; find and load_async may be NULL (no async loads). */
typedef struct block_pool_tier {
    void *ctx;
    void (*evicted)(void *ctx, int32_t block, uint64_t hash);
    int (*load)(void *ctx, uint64_t hash, int32_t block);
    int (*find)(void *ctx, uint64_t hash);
    int (*load_async)(void *ctx, uint64_t hash, int32_t block, uint64_t tag);
} block_pool_tier;

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
    uint64_t ext_queries, ext_hits; /* lower-tier lookups after a device miss, in blocks */
    uint64_t evictions;     /* cached blocks the allocator reused */
    kvev_log *events;       /* when set: BlockStored / BlockRemoved of the device cache */
    int block_size;         /* tokens per block (for the events) */
    block_pool_tier tier;   /* tier.load NULL = no lower tier */
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
/* block_pool_set_hash for the full block of block_size tokens chained from
 * parent (0 = first block), recording a BlockStored event when the block
 * became cached.  Returns 1 then, 0 when the hash was already cached. */
int block_pool_cache_block(block_pool *bp, int32_t id, uint64_t parent, uint64_t hash,
                           const int32_t *tokens);
/* block_pool_lookup, and on a device miss the lower tier: a free block gets
 * the tier's copy of the block (hash, chained from parent, of tokens) and
 * joins the device cache, referenced once.  -1 when neither has it. */
int32_t block_pool_lookup_tiered(block_pool *bp, uint64_t parent, uint64_t hash,
                                 const int32_t *tokens);
/* Which level of the lower tier holds hash (tier.find), -1 when none or no tier. */
int block_pool_tier_find(const block_pool *bp, uint64_t hash);
/* An asynchronous load from the lower tier: a free block, referenced twice (once for
 * the caller, once for the copy: the block cannot be reused before the copy ends, even
 * if the caller lets go), and tier.load_async started into it.  Not cached yet (the
 * caller caches it when the copy ended well).  -1 when no block is free or the tier
 * no longer holds hash (the block goes back).  Counts an external query and hit. */
int32_t block_pool_load_async(block_pool *bp, uint64_t hash, uint64_t tag);
/* The copy into block ended (well or not): drops its reference. */
void block_pool_load_finished(block_pool *bp, int32_t block);
/* Forget every cached hash (vLLM's reset_prefix_cache): refused (-1, nothing
 * changed) while a cached block is in use.  Records AllBlocksCleared. */
int block_pool_reset_cache(block_pool *bp);
/* One more reference to a block already in use. */
void block_pool_ref(block_pool *bp, int32_t id);
int32_t block_pool_num_free(const block_pool *bp);
int32_t block_pool_num_used(const block_pool *bp);

/* Hash of a full block of tokens, chained from the previous block's hash (0
 * for the first).  Never returns 0 or 1 (reserved). */
uint64_t block_pool_hash_tokens(uint64_t parent, const int32_t *tokens, int32_t n);

#endif
