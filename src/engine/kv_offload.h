/*
 * kv_offload — the KV cache's lower tiers: a host-memory tier (--kv-offloading-size)
 * and under it an optional disk tier (--kv-offloading-disk), both LRU, keyed by the
 * prefix cache's block hashes (block_pool.h).  A cached block the device cache evicts
 * is copied to the host tier (kv_offload_store); a block the host tier evicts goes to
 * the disk tier; a prefix block the device cache lacks comes back by copy
 * (kv_offload_lookup + kv_offload_load) into a free device block instead of being
 * recomputed.  A block found again stays in its tier (its LRU position refreshed), so
 * evicting it from the device once more costs no copy.
 *
 * The bytes move through the compute backend (backend_download / backend_upload: the
 * device's KV region to and from host memory).  Disk slots are checksummed (XXH3 of
 * the bytes, seeded with the block hash and the layout key): a corrupt, truncated or
 * foreign slot is detected, dropped and the block recomputed; a failed write (full
 * disk, I/O error, file size limit) drops the block with a warning.  The layout key
 * (model, KV dtype, block size, block bytes) is in every disk slot's header, and the
 * slab file is created empty at start and removed at exit: never stale KV.
 *
 * Loads run on a loader thread of the tiers' own (kv_offload_load_async): the step thread
 * names the slot and the device block, the loader reads the disk slot into its staging
 * buffer and checks it, uploads the bytes through a stream of its own (CUDA: a second
 * stream, so the copy overlaps the forward on the compute stream) and reports the load
 * done (kv_offload_reap, after the notify callback).  It takes up to 32 queued loads at a
 * time: their host-tier copies are enqueued back to back and synced once; the slot is pinned meanwhile (no
 * eviction, no reuse; a clear drops it when the load ends).  kv_offload_load is the same
 * copy on the calling thread, for callers that need the bytes at once.
 *
 * Disk writes (the host tier's LRU victim going down) run on a writer thread: the step
 * thread copies the victim's bytes (with the slot header) into one of a bounded set of
 * aligned write buffers and queues it; with every buffer taken (the disk is behind) the
 * disk copy is dropped and counted (writes_dropped), the step never waits.  The disk slot
 * is findable at once and pinned until its write ended; a load of it meanwhile is served
 * from the queued buffer.  The slab is opened with O_DIRECT where the filesystem accepts
 * it (KV_DIRECT_IO_*): reads and writes are whole 4 KiB-aligned slots from aligned buffers.
 *
 * Not thread-safe apart from the loader and the writer: the engine's step thread owns it
 * (the engine copies the stats into engine_stats after each step).  Stores into the host
 * tier (evictions from the device) are synchronous on that thread.
 */
#ifndef DISAGG_ENGINE_KV_OFFLOAD_H
#define DISAGG_ENGINE_KV_OFFLOAD_H

#include "engine/kv_events.h"

#include <stddef.h>
#include <stdint.h>

struct backend_stream;

enum { KV_TIER_HOST = 0, KV_TIER_DISK = 1, KV_TIER_COUNT = 2 };

typedef struct kv_offload_config {
    size_t host_bytes;    /* host tier size (> 0) */
    const char *disk_dir; /* disk tier directory, NULL = no disk tier */
    size_t disk_bytes;    /* disk tier size (> 0 with disk_dir) */
    size_t block_bytes;   /* one KV block */
    uint64_t layout_key;  /* model, dtype, block layout: kv_offload_layout_key */
    int block_size;       /* tokens per block (events) */
    int sync_loads;       /* 1: kv_offload_load_async copies on the calling thread (comparison) */
    unsigned load_delay_ms; /* each load (either kind) waits this long first: a slow medium */
    int sync_writes;      /* 1: disk writes on the calling thread (comparison); 0: the writer thread */
    int write_queue;      /* disk writes queued at most (0: KV_OFFLOAD_WRITE_QUEUE_BYTES of
                           * buffers, from 16 to 4096 blocks) */
    unsigned write_delay_ms; /* each disk write waits this long first: a slow disk */
    int direct_io;        /* KV_DIRECT_IO_* */
} kv_offload_config;

/* How the disk slab is opened.  AUTO: O_DIRECT (no page cache) unless the filesystem
 * refuses it or keeps files in memory anyway (tmpfs, ramfs): then buffered, with an info
 * line naming the filesystem.  ON: O_DIRECT or the creation fails.  OFF: buffered. */
enum { KV_DIRECT_IO_AUTO = 0, KV_DIRECT_IO_ON = 1, KV_DIRECT_IO_OFF = 2 };
#define KV_OFFLOAD_WRITE_QUEUE_BYTES ((size_t)64 << 20)

typedef struct kv_offload_stats {
    uint64_t stored[KV_TIER_COUNT];  /* blocks written into the tier */
    uint64_t loaded[KV_TIER_COUNT];  /* blocks copied back to the device from the tier */
    uint64_t evicted[KV_TIER_COUNT]; /* blocks the tier dropped to make room (LRU) */
    uint64_t bytes_stored[KV_TIER_COUNT], bytes_loaded[KV_TIER_COUNT];
    uint64_t load_ns[KV_TIER_COUNT]; /* time spent loading (copy, read, checksum) */
    uint64_t store_ns[KV_TIER_COUNT]; /* the caller's time storing (host: the copy down; disk:
                                       * the write with sync_writes, else the queueing) */
    uint64_t lookups, hits[KV_TIER_COUNT];
    uint64_t corrupt;      /* disk slots that failed their checks (recomputed) */
    uint64_t write_errors; /* disk writes that failed (the block was dropped) */
    int64_t resident[KV_TIER_COUNT]; /* blocks held now */
    int64_t capacity[KV_TIER_COUNT]; /* blocks the tier holds at most */
    int64_t in_flight;               /* asynchronous loads queued or copying now */
    int64_t writes_queued;   /* disk writes queued or being written now (the writer thread) */
    uint64_t writes_dropped; /* disk copies dropped because the write queue was full */
    int direct_io;           /* 1: the slab is read and written with O_DIRECT */
} kv_offload_stats;

/* One asynchronous load that ended (kv_offload_reap). */
typedef struct kv_offload_done {
    uint64_t tag;  /* the caller's, from kv_offload_load_async */
    int32_t block; /* the device block it filled */
    int tier;      /* KV_TIER_* it came from */
    int ok;        /* 1: the block holds the bytes; 0: recompute (a disk slot failed its checks) */
    uint64_t ns;   /* the loader's time on it (read, checks, upload; not the queueing) */
} kv_offload_done;

typedef struct kv_offload kv_offload;

/* An XXH3 fingerprint of what makes KV bytes meaningful: the model (its directory and
 * shape), the KV dtype and the block layout. */
uint64_t kv_offload_layout_key(const char *model, int layers, int kv_heads, int head_dim,
                               const char *dtype, int block_size, size_t block_bytes);

/* The tiers copy blocks of the KV region at kv_base (device address, block-major,
 * block_bytes apart) through stream st.  -1 with err (what was wrong) on failure. */
int kv_offload_create(const kv_offload_config *c, struct backend_stream *st, void *kv_base,
                      kv_offload **out, char *err, size_t errlen);
/* NULL is fine; stops the loader (loads not started are dropped), removes the slab file */
void kv_offload_destroy(kv_offload *o);

/* Events (medium CPU / DISK) are recorded into log when set. */
void kv_offload_set_events(kv_offload *o, kvev_log *log);

/* Copy device block `block` (cached under hash) into the host tier; nothing when the
 * tier holds hash already (refreshed instead).  0, or -1 when the copy failed. */
int kv_offload_store(kv_offload *o, uint64_t hash, int32_t block);
/* A handle to hash's copy in some tier (refreshed as most recently used), -1 if none. */
int64_t kv_offload_lookup(kv_offload *o, uint64_t hash);
/* Copy the block of handle into device block `block` on the calling thread: 0, or -1 (a
 * disk slot that failed its checks is dropped: the caller recomputes). */
int kv_offload_load(kv_offload *o, int64_t handle, int32_t block);
/* Which tier holds hash (KV_TIER_*), -1 if none.  No side effects (no LRU refresh, no count). */
int kv_offload_find(const kv_offload *o, uint64_t hash);
/* kv_offload_lookup(hash) and a load of it into device block `block` on the loader thread;
 * block must stay untouched until kv_offload_reap reports it.  0 queued, -1 when no tier
 * holds hash (counted as a lookup) or no memory. */
int kv_offload_load_async(kv_offload *o, uint64_t hash, int32_t block, uint64_t tag);
/* Up to max loads that ended since the last call (stats, slot checks and events done here,
 * on the owner's thread); their count.  The disk writes that ended are settled too (their
 * slots unpinned, their buffers reused, failures counted). */
int kv_offload_reap(kv_offload *o, kv_offload_done *out, int max);
/* Loads queued or copying (not yet reaped). */
int kv_offload_in_flight(const kv_offload *o);
/* Of those, the ones the loader has not finished. */
int kv_offload_busy(kv_offload *o);
/* fn(ctx) is called from the loader thread each time loads end (a batch of them), and from the writer
 * thread each time a disk write ends (the owner then reaps: kv_offload_reap); set before
 * the first load or store. */
void kv_offload_set_notify(kv_offload *o, void (*fn)(void *ctx), void *ctx);
/* Drop every block of every tier (reset_prefix_cache); a slot being loaded goes when its
 * load ends. */
void kv_offload_clear(kv_offload *o);
void kv_offload_get_stats(kv_offload *o, kv_offload_stats *out);
/* Wait until every queued disk write ended, and settle them (tests, benchmarks). */
void kv_offload_drain_writes(kv_offload *o);
/* The disk tier's slab file ("" when none): tests corrupt it. */
const char *kv_offload_disk_path(const kv_offload *o);

#endif
