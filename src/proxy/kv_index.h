/*
 * kv_index — what one instance's KV cache holds, as its KV events tell it
 * (vLLM's KVEventBatch, docs/kv_pool.md): a KVEventBatch payload (msgpack,
 * events as positional arrays or as maps tagged "type") applied in sequence
 * order keeps a set of blocks, each with the media that hold it (GPU, CPU,
 * DISK).  The instance's own block hashes are opaque here (disagg's XXH3, vLLM's
 * sha256 or Python hash, ints or bytes): the index keys every block by its own
 * chain hash of the block's token ids, which BlockStored carries
 * (kv_index_chain: XXH3-64 of the block's int32 token ids seeded with the
 * parent block's chain hash), and keeps instance hash -> chain hash for the
 * BlockRemoved and tier events that name only the instance's hash.  So the proxy
 * hashes a request's token ids the same way and needs neither the instance's
 * hash function nor its seed.  A block whose parent the index does not know
 * (its BlockStored was missed) is not indexed.  Not thread-safe: the proxy's
 * loop owns it.
 */
#ifndef DISAGG_PROXY_KV_INDEX_H
#define DISAGG_PROXY_KV_INDEX_H

#include <stddef.h>
#include <stdint.h>

typedef enum kv_medium { KV_MEDIUM_GPU = 0, KV_MEDIUM_CPU = 1, KV_MEDIUM_DISK = 2 } kv_medium;
#define KV_MEDIA 3

typedef struct kv_index kv_index;

/* An empty index holding at most max_blocks blocks (later ones are not indexed and
 * are counted in kv_index_stats.dropped).  NULL when out of memory. */
kv_index *kv_index_new(size_t max_blocks);
void kv_index_free(kv_index *x);
/* Forgets every block (AllBlocksCleared, a restart, a gap that replay cannot fill). */
void kv_index_clear(kv_index *x);

/* Applies one KVEventBatch payload.  0, or -EINVAL with err naming what is malformed
 * (the events before the malformed one stay applied). */
int kv_index_apply(kv_index *x, const void *payload, size_t len, char *err, size_t errcap);

typedef struct kv_index_stats {
    size_t blocks[KV_MEDIA]; /* blocks held per medium */
    size_t total;            /* distinct blocks */
    int block_size;          /* tokens per block from the last BlockStored (0: none seen) */
    uint64_t stored;         /* blocks stored (events) */
    uint64_t removed;        /* blocks removed (events) */
    uint64_t cleared;        /* AllBlocksCleared events */
    uint64_t unchained;      /* stored blocks not indexed: parent unknown or no token ids */
    uint64_t dropped;        /* stored blocks not indexed: max_blocks reached */
} kv_index_stats;
void kv_index_get_stats(const kv_index *x, kv_index_stats *out);

/* The chain hashes of the n / block_size full blocks of ids[0..n) into out. */
void kv_index_chain(const int32_t *ids, size_t n, int block_size, uint64_t *out);
/* How many leading blocks of chain[0..n) the instance holds (in any medium); per_medium
 * (KV_MEDIA, may be NULL) counts them by the fastest medium holding each. */
int kv_index_match(const kv_index *x, const uint64_t *chain, int n, int *per_medium);

#endif
