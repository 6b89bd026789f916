/* block_pool — see block_pool.h. */
#include "engine/block_pool.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define HT_EMPTY 0
#define HT_TOMB  1

int block_pool_init(block_pool *bp, int32_t n) {
    memset(bp, 0, sizeof *bp);
    if (n <= 0) return -1;
    bp->num_blocks = n;
    bp->ht_cap = 16;
    while (bp->ht_cap < (size_t)n * 2)
        bp->ht_cap <<= 1;
    bp->ref = calloc((size_t)n, sizeof *bp->ref);
    bp->hash = calloc((size_t)n, sizeof *bp->hash);
    bp->prev = malloc((size_t)n * sizeof *bp->prev);
    bp->next = malloc((size_t)n * sizeof *bp->next);
    bp->ht_keys = calloc(bp->ht_cap, sizeof *bp->ht_keys);
    bp->ht_vals = calloc(bp->ht_cap, sizeof *bp->ht_vals);
    if (!bp->ref || !bp->hash || !bp->prev || !bp->next || !bp->ht_keys || !bp->ht_vals) {
        block_pool_free_all(bp);
        return -1;
    }
    for (int32_t i = 0; i < n; i++) {
        bp->prev[i] = i - 1;
        bp->next[i] = i + 1 < n ? i + 1 : -1;
    }
    bp->free_head = 0;
    bp->free_tail = n - 1;
    bp->num_free = n;
    return 0;
}

void block_pool_free_all(block_pool *bp) {
    free(bp->ref);
    free(bp->hash);
    free(bp->prev);
    free(bp->next);
    free(bp->ht_keys);
    free(bp->ht_vals);
    memset(bp, 0, sizeof *bp);
}

/* ---- hash table: prefix hash -> block id ---------------------------------- */

static size_t ht_find_slot(const block_pool *bp, uint64_t key) {
    size_t mask = bp->ht_cap - 1, i = (size_t)key & mask;
    while (bp->ht_keys[i] != HT_EMPTY && bp->ht_keys[i] != key)
        i = (i + 1) & mask;
    return i; /* the key's slot, or the first empty slot of its probe run */
}

static int32_t ht_get(const block_pool *bp, uint64_t key) {
    size_t i = ht_find_slot(bp, key);
    return bp->ht_keys[i] == key ? bp->ht_vals[i] : -1;
}

static void ht_rebuild(block_pool *bp) {
    memset(bp->ht_keys, 0, bp->ht_cap * sizeof *bp->ht_keys);
    bp->ht_tomb = 0;
    for (int32_t b = 0; b < bp->num_blocks; b++) {
        if (!bp->hash[b]) continue;
        size_t i = ht_find_slot(bp, bp->hash[b]);
        bp->ht_keys[i] = bp->hash[b];
        bp->ht_vals[i] = b;
    }
}

static void ht_put(block_pool *bp, uint64_t key, int32_t val) {
    size_t mask = bp->ht_cap - 1, i = (size_t)key & mask;
    while (bp->ht_keys[i] != HT_EMPTY && bp->ht_keys[i] != HT_TOMB && bp->ht_keys[i] != key)
        i = (i + 1) & mask;
    if (bp->ht_keys[i] == HT_TOMB) bp->ht_tomb--;
    bp->ht_keys[i] = key;
    bp->ht_vals[i] = val;
}

static void ht_del(block_pool *bp, uint64_t key) {
    size_t i = ht_find_slot(bp, key);
    if (bp->ht_keys[i] != key) return;
    bp->ht_keys[i] = HT_TOMB;
    if (++bp->ht_tomb > bp->ht_cap / 4) ht_rebuild(bp);
}

/* ---- free queue ----------------------------------------------------------- */

static void fq_remove(block_pool *bp, int32_t b) {
    if (bp->prev[b] >= 0)
        bp->next[bp->prev[b]] = bp->next[b];
    else
        bp->free_head = bp->next[b];
    if (bp->next[b] >= 0)
        bp->prev[bp->next[b]] = bp->prev[b];
    else
        bp->free_tail = bp->prev[b];
    bp->prev[b] = bp->next[b] = -1;
    bp->num_free--;
}

static void fq_push_tail(block_pool *bp, int32_t b) {
    bp->prev[b] = bp->free_tail;
    bp->next[b] = -1;
    if (bp->free_tail >= 0)
        bp->next[bp->free_tail] = b;
    else
        bp->free_head = b;
    bp->free_tail = b;
    bp->num_free++;
}

int block_pool_alloc(block_pool *bp, int32_t n, int32_t *out) {
    if (n < 0 || n > bp->num_free) return -1;
    for (int32_t k = 0; k < n; k++) {
        int32_t b = bp->free_head;
        fq_remove(bp, b);
        if (bp->hash[b]) { /* evict its cached content */
            bp->evictions++;
            if (bp->tier.evicted) bp->tier.evicted(bp->tier.ctx, b, bp->hash[b]);
            if (bp->events) kv_events_removed(bp->events, KVEV_MEDIUM_GPU, bp->hash[b]);
            /* the block forgets the hash first: ht_del may rebuild the table from hash[] */
            uint64_t h = bp->hash[b];
            bp->hash[b] = 0;
            ht_del(bp, h);
        }
        bp->ref[b] = 1;
        out[k] = b;
    }
    return 0;
}

void block_pool_release(block_pool *bp, const int32_t *ids, int32_t n) {
    for (int32_t k = n - 1; k >= 0; k--) {
        int32_t b = ids[k];
        if (b < 0 || b >= bp->num_blocks || bp->ref[b] <= 0) continue; /* defensive */
        if (--bp->ref[b] == 0) fq_push_tail(bp, b);
    }
}

int32_t block_pool_lookup(block_pool *bp, uint64_t hash) {
    bp->queries++;
    int32_t b = hash > HT_TOMB ? ht_get(bp, hash) : -1;
    if (b < 0) return -1;
    if (bp->ref[b] == 0) fq_remove(bp, b);
    bp->ref[b]++;
    bp->hits++;
    return b;
}

int block_pool_contains(const block_pool *bp, uint64_t hash) {
    return hash > HT_TOMB && ht_get(bp, hash) >= 0;
}

void block_pool_set_hash(block_pool *bp, int32_t id, uint64_t hash) {
    if (id < 0 || id >= bp->num_blocks || hash <= HT_TOMB || bp->hash[id]) return;
    if (ht_get(bp, hash) >= 0) return;
    bp->hash[id] = hash;
    ht_put(bp, hash, id);
}

int block_pool_cache_block(block_pool *bp, int32_t id, uint64_t parent, uint64_t hash,
                           const int32_t *tokens) {
    if (id < 0 || id >= bp->num_blocks || hash <= HT_TOMB || bp->hash[id]) return 0;
    if (ht_get(bp, hash) >= 0) return 0;
    bp->hash[id] = hash;
    ht_put(bp, hash, id);
    if (bp->events) kv_events_stored(bp->events, KVEV_MEDIUM_GPU, parent, hash, tokens, bp->block_size);
    return 1;
}

/* A block just allocated goes back unused: first out again. */
static void give_back(block_pool *bp, int32_t b) {
    bp->ref[b] = 0;
    if (bp->num_free == 0) {
        fq_push_tail(bp, b);
    } else {
        int32_t h = bp->free_head;
        bp->prev[b] = -1;
        bp->next[b] = h;
        bp->prev[h] = b;
        bp->free_head = b;
        bp->num_free++;
    }
}

int32_t block_pool_lookup_tiered(block_pool *bp, uint64_t parent, uint64_t hash,
                                 const int32_t *tokens) {
    int32_t b = block_pool_lookup(bp, hash);
    if (b >= 0 || !bp->tier.load || hash <= HT_TOMB) return b;
    bp->ext_queries++;
    if (block_pool_alloc(bp, 1, &b)) return -1;
    if (bp->tier.load(bp->tier.ctx, hash, b)) { /* not there: the block goes back, first out */
        give_back(bp, b);
        return -1;
    }
    bp->ext_hits++;
    block_pool_cache_block(bp, b, parent, hash, tokens);
    return b;
}

int block_pool_tier_find(const block_pool *bp, uint64_t hash) {
    if (!bp->tier.find || hash <= HT_TOMB) return -1;
    return bp->tier.find(bp->tier.ctx, hash);
}

int32_t block_pool_load_async(block_pool *bp, uint64_t hash, uint64_t tag) {
    if (!bp->tier.load_async || hash <= HT_TOMB) return -1;
    bp->ext_queries++;
    int32_t b;
    if (block_pool_alloc(bp, 1, &b)) return -1;
    if (bp->tier.load_async(bp->tier.ctx, hash, b, tag)) {
        give_back(bp, b);
        return -1;
    }
    bp->ref[b] = 2; /* the caller's and the copy's */
    bp->ext_hits++;
    return b;
}

void block_pool_load_finished(block_pool *bp, int32_t block) {
    block_pool_release(bp, &block, 1);
}

int block_pool_reset_cache(block_pool *bp) {
    for (int32_t b = 0; b < bp->num_blocks; b++)
        if (bp->hash[b] && bp->ref[b] > 0) return -1;
    for (int32_t b = 0; b < bp->num_blocks; b++)
        bp->hash[b] = 0;
    ht_rebuild(bp);
    if (bp->events) kv_events_cleared(bp->events);
    return 0;
}

void block_pool_ref(block_pool *bp, int32_t id) {
    if (id >= 0 && id < bp->num_blocks && bp->ref[id] > 0) bp->ref[id]++;
}

int32_t block_pool_num_free(const block_pool *bp) {
    return bp->num_free;
}
int32_t block_pool_num_used(const block_pool *bp) {
    return bp->num_blocks - bp->num_free;
}

uint64_t block_pool_hash_tokens(uint64_t parent, const int32_t *tokens, int32_t n) {
    uint64_t h =
        XXH3_64bits_withSeed(tokens, (size_t)n * sizeof *tokens, parent ^ 0x9E3779B97F4A7C15ull);
    return h <= HT_TOMB ? h + 2 : h;
}
