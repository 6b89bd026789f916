/*
 * kv_events — the KV cache events of one engine step, as vLLM's KVCacheEvent
 * union names them: BlockStored (full blocks entered a cache tier, with their
 * tokens and the hash of the block before the first), BlockRemoved (blocks
 * left a tier) and AllBlocksCleared.  The block pool and the offload tiers
 * record here; after each step the engine hands a non-empty log to its sink
 * (the ZMQ publisher, connector/kv_events_publisher.h) and clears it.
 * Consecutive stores of one chain (each block's parent the previous block) and
 * consecutive removals of one medium coalesce into one event, as vLLM's.
 * Not thread-safe: the engine's step thread owns it.
 */
#ifndef DISAGG_ENGINE_KV_EVENTS_H
#define DISAGG_ENGINE_KV_EVENTS_H

#include <stdint.h>

typedef enum kvev_kind {
    KVEV_STORED = 0,
    KVEV_REMOVED = 1,
    KVEV_CLEARED = 2,
} kvev_kind;

/* Where the blocks live: vLLM's medium strings "GPU" (the engine's own KV
 * cache, whatever the device), "CPU" (the host-memory tier), "DISK". */
typedef enum kvev_medium {
    KVEV_MEDIUM_GPU = 0,
    KVEV_MEDIUM_CPU = 1,
    KVEV_MEDIUM_DISK = 2,
} kvev_medium;

const char *kv_events_medium_name(kvev_medium m);

typedef struct kvev_event {
    kvev_kind kind;
    kvev_medium medium;
    int has_parent;  /* STORED: the first block has a parent block */
    uint64_t parent; /* STORED: its hash */
    uint64_t *hashes;
    int n_hashes, cap_hashes;
    int32_t *tokens; /* STORED: block_size tokens per hash */
    int n_tokens, cap_tokens;
    int block_size; /* STORED */
} kvev_event;

typedef struct kvev_log {
    kvev_event *ev; /* (cap) events [0, n); storage past n is kept for reuse */
    int n, cap;
    int oom; /* an allocation failed: events were lost since the last clear */
} kvev_log;

/* A full block (block_size tokens) with hash, chained from parent (0 = the
 * first block of a sequence: no parent), entered medium.  tokens NULL: a lower
 * tier's block, announced as vLLM's offloading does (no tokens, no parent). */
void kv_events_stored(kvev_log *l, kvev_medium medium, uint64_t parent, uint64_t hash,
                 const int32_t *tokens, int block_size);
void kv_events_removed(kvev_log *l, kvev_medium medium, uint64_t hash);
void kv_events_cleared(kvev_log *l);
void kv_events_reset(kvev_log *l); /* forget the events (storage kept) */
void kv_events_free(kvev_log *l);

#endif
