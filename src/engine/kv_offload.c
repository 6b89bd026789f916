/* kv_offload — see kv_offload.h. */
#include "engine/kv_offload.h"

#include "base/clock.h"
#include "base/log.h"
#include "kernels/backend.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#define MOD        "kv_offload"
#define HT_EMPTY   (-1)
#define HT_TOMB    (-2)
#define DISK_MAGIC 0x314b564b47534944ull /* "DISGKVK1" */
#define DISK_HDR   64                    /* bytes before a slot's data */
#define DISK_ALIGN 4096

/* ---- one tier's slots: hash index, LRU order, free slots ------------------------- */

typedef struct tier {
    int32_t n_slots, n_used;
    uint64_t *key;        /* (n_slots) the block hash a used slot holds */
    int32_t *prev, *next; /* (n_slots) LRU list of used slots, head = least recent */
    int32_t head, tail;
    int32_t *free_slots; /* (n_slots) stack */
    int32_t n_free;
    int32_t *ht; /* (ht_cap) slot, HT_EMPTY or HT_TOMB */
    size_t ht_cap, ht_tomb;
    int32_t *pins; /* (n_slots) loads reading the slot now: out of the LRU list while > 0 */
    unsigned char *doomed; /* (n_slots) dropped while pinned: freed when the last load ends */
} tier;

static int tier_init(tier *t, int32_t n) {
    memset(t, 0, sizeof *t);
    t->n_slots = n;
    t->head = t->tail = -1;
    t->ht_cap = 16;
    while (t->ht_cap < (size_t)n * 2)
        t->ht_cap <<= 1;
    t->key = calloc((size_t)n, sizeof *t->key);
    t->prev = malloc((size_t)n * sizeof *t->prev);
    t->next = malloc((size_t)n * sizeof *t->next);
    t->free_slots = malloc((size_t)n * sizeof *t->free_slots);
    t->ht = malloc(t->ht_cap * sizeof *t->ht);
    t->pins = calloc((size_t)n, sizeof *t->pins);
    t->doomed = calloc((size_t)n, 1);
    if (!t->key || !t->prev || !t->next || !t->free_slots || !t->ht || !t->pins || !t->doomed)
        return -1;
    for (int32_t i = 0; i < n; i++)
        t->free_slots[i] = n - 1 - i; /* slot 0 first */
    t->n_free = n;
    for (size_t i = 0; i < t->ht_cap; i++)
        t->ht[i] = HT_EMPTY;
    return 0;
}

static void tier_free(tier *t) {
    free(t->key);
    free(t->prev);
    free(t->next);
    free(t->free_slots);
    free(t->ht);
    free(t->pins);
    free(t->doomed);
    memset(t, 0, sizeof *t);
}

static size_t ht_slot_of(const tier *t, uint64_t key) {
    size_t mask = t->ht_cap - 1, i = (size_t)(key ^ key >> 29) & mask;
    while (t->ht[i] != HT_EMPTY && (t->ht[i] == HT_TOMB || t->key[t->ht[i]] != key))
        i = (i + 1) & mask;
    return i;
}

static int32_t tier_find(const tier *t, uint64_t key) {
    if (!t->n_slots) return -1;
    size_t i = ht_slot_of(t, key);
    return t->ht[i] >= 0 ? t->ht[i] : -1;
}

static void lru_unlink(tier *t, int32_t s) {
    if (t->prev[s] >= 0)
        t->next[t->prev[s]] = t->next[s];
    else
        t->head = t->next[s];
    if (t->next[s] >= 0)
        t->prev[t->next[s]] = t->prev[s];
    else
        t->tail = t->prev[s];
}

static void lru_push_tail(tier *t, int32_t s) {
    t->prev[s] = t->tail;
    t->next[s] = -1;
    if (t->tail >= 0)
        t->next[t->tail] = s;
    else
        t->head = s;
    t->tail = s;
}

static void tier_touch(tier *t, int32_t s) {
    if (t->pins[s]) return; /* out of the list while loaded; back at the tail after */
    lru_unlink(t, s);
    lru_push_tail(t, s);
}

static void ht_rebuild(tier *t) {
    for (size_t i = 0; i < t->ht_cap; i++)
        t->ht[i] = HT_EMPTY;
    t->ht_tomb = 0;
    for (int32_t s = 0; s < t->n_slots; s++) { /* pinned slots are in no LRU list: every key */
        if (!t->key[s]) continue;
        size_t mask = t->ht_cap - 1, i = (size_t)(t->key[s] ^ t->key[s] >> 29) & mask;
        while (t->ht[i] != HT_EMPTY)
            i = (i + 1) & mask;
        t->ht[i] = s;
    }
}

/* slot s (taken from the free stack) now holds key, most recently used */
static void tier_insert(tier *t, int32_t s, uint64_t key) {
    t->key[s] = key;
    size_t mask = t->ht_cap - 1, i = (size_t)(key ^ key >> 29) & mask;
    while (t->ht[i] >= 0)
        i = (i + 1) & mask;
    if (t->ht[i] == HT_TOMB) t->ht_tomb--;
    t->ht[i] = s;
    lru_push_tail(t, s);
    t->n_used++;
}

static void ht_forget(tier *t, int32_t s) {
    size_t i = ht_slot_of(t, t->key[s]);
    if (t->ht[i] == s) {
        t->ht[i] = HT_TOMB;
        t->ht_tomb++;
    }
    t->key[s] = 0; /* first: a rebuild reads key[] */
    if (t->ht_tomb > t->ht_cap / 4) ht_rebuild(t);
}

/* Drop used slot s: freed now, or (a load reads it) unfindable now and freed when the
 * last load ends (tier_unpin). */
static void tier_remove(tier *t, int32_t s) {
    ht_forget(t, s);
    if (t->pins[s]) {
        t->doomed[s] = 1;
        return;
    }
    lru_unlink(t, s);
    t->free_slots[t->n_free++] = s;
    t->n_used--;
}

/* A load reads slot s: neither evicted nor reused until tier_unpin. */
static void tier_pin(tier *t, int32_t s) {
    if (t->pins[s]++ == 0) lru_unlink(t, s);
}

static void tier_unpin(tier *t, int32_t s) {
    if (--t->pins[s] > 0) return;
    if (t->doomed[s]) {
        t->doomed[s] = 0;
        t->free_slots[t->n_free++] = s;
        t->n_used--;
        return;
    }
    lru_push_tail(t, s); /* just used: most recent */
}

static int32_t tier_take(tier *t) {
    return t->n_free ? t->free_slots[--t->n_free] : -1;
}

/* ---- the pool --------------------------------------------------------------------- */

/* One load for the loader thread (kv_offload_load_async). */
typedef struct load_job {
    uint64_t tag, hash;
    int32_t block, slot;
    int tier;
    int wb;          /* a disk slot whose write is queued: the write buffer it is read from, or -1 */
    int ok;          /* set by the loader */
    const char *why; /* a disk slot's failed check (the step thread drops the slot) */
    uint64_t ns;     /* the loader's time on it */
    struct load_job *next;
} load_job;

struct kv_offload {
    kv_offload_config cfg;
    backend_stream *st;
    char *kv_base; /* device address of block 0 */
    size_t bb;     /* block bytes */
    tier host, disk;
    backend_buffer *host_buf; /* the host tier (BACKEND_BUF_HOST) */
    char *host_mem;           /* its (host.n_slots * bb) bytes */
    size_t host_len;
    int fd; /* the disk tier's slab file, -1 = none */
    int direct; /* fd is O_DIRECT: whole slots from DISK_ALIGN-aligned buffers */
    char path[4096];
    size_t stride; /* a disk slot: header + data, DISK_ALIGN-aligned */
    unsigned char *bounce; /* (stride) a disk slot read or written on the owner's thread */
    int32_t *disk_wb; /* (disk slots) the write buffer whose write fills the slot, or -1 */
    kvev_log *events;
    kv_offload_stats stats;
    uint64_t warned_writes;

    /* the loader thread and its queues */
    backend_stream *load_st;   /* its copies (CUDA: a stream beside the compute stream) */
    backend_buffer *stage_buf; /* (stride) its disk reads (BACKEND_BUF_HOST: pinned on CUDA) */
    unsigned char *stage;
    pthread_t loader;
    int loader_on, mu_on;
    pthread_mutex_t mu; /* guards the two queues and stop */
    pthread_cond_t cv;
    load_job *todo_head, *todo_tail; /* to run, FIFO */
    load_job *done_head, *done_tail; /* ran, not reaped, FIFO */
    int n_done;                      /* on the done list */
    int stop;
    int in_flight; /* owner's thread: loads not reaped yet */
    void (*notify)(void *ctx);
    void *notify_ctx;

    /* the writer thread: write buffers, each one disk slot, owned by the step thread while
     * free; a queued buffer is read by the writer (and by loads of its slot) until settled */
    int nwb;                 /* write buffers (cfg.write_queue) */
    unsigned char *wmem;     /* (nwb * stride) DISK_ALIGN-aligned */
    int32_t *wb_slot;        /* (nwb) the disk slot a buffer's write fills */
    int *wb_refs;            /* (nwb) step thread: its write until settled + loads reading it */
    int *wb_err;             /* (nwb) writer: 0, or the errno of its failed write */
    int32_t *wb_free;        /* (nwb) stack of free buffers */
    int n_wb_free;
    int *wq, wq_head, wq_n;  /* (nwb) queued writes, a ring (under wmu) */
    int *wdone, n_wdone;     /* (nwb) ended, not settled (under wmu) */
    int w_pending;           /* step thread: writes queued, not settled */
    pthread_t writer;
    int writer_on, wmu_on, wstop;
    pthread_mutex_t wmu;
    pthread_cond_t wcv;
};

uint64_t kv_offload_layout_key(const char *model, int layers, int kv_heads, int head_dim,
                               const char *dtype, int block_size, size_t block_bytes) {
    char buf[4608];
    int n = snprintf(buf, sizeof buf, "disagg-kv|%s|L%d|H%d|D%d|%s|bs%d|bb%zu", model ? model : "",
                     layers, kv_heads, head_dim, dtype ? dtype : "", block_size, block_bytes);
    if (n < 0) n = 0;
    if ((size_t)n >= sizeof buf) n = (int)sizeof buf - 1;
    return XXH3_64bits(buf, (size_t)n);
}

static uint64_t checksum(const kv_offload *o, uint64_t hash, const void *data) {
    return XXH3_64bits_withSeed(data, o->bb, hash ^ o->cfg.layout_key ^ 0x6b76706f6f6cull);
}

void kv_offload_set_events(kv_offload *o, kvev_log *log) {
    o->events = log;
}

static void ev_stored(kv_offload *o, kvev_medium m, uint64_t hash) {
    if (o->events) kv_events_stored(o->events, m, 0, hash, NULL, o->cfg.block_size);
}

static void ev_removed(kv_offload *o, kvev_medium m, uint64_t hash) {
    if (o->events) kv_events_removed(o->events, m, hash);
}

/* ---- disk tier -------------------------------------------------------------------- */

static void disk_drop(kv_offload *o, int32_t s) {
    ev_removed(o, KVEV_MEDIUM_DISK, o->disk.key[s]);
    tier_remove(&o->disk, s);
}

/* A slot image: the header, then the block (the rest of the stride stays as it is: zeros). */
static void slot_image(const kv_offload *o, unsigned char *buf, uint64_t hash, const void *data) {
    uint64_t hdr[DISK_HDR / 8] = {DISK_MAGIC, o->cfg.layout_key, hash, o->bb,
                                  checksum(o, hash, data)};
    memcpy(buf, hdr, sizeof hdr);
    memcpy(buf + DISK_HDR, data, o->bb);
}

static void write_failed(kv_offload *o, int e) {
    uint64_t n = o->stats.write_errors++;
    if ((n & (n + 1)) == 0) /* 1st, 2nd, 4th, ... */
        LOG_W(MOD,
              "writing a KV block to %s failed (%s): the block is dropped and will be "
              "recomputed (%llu failed writes so far)",
              o->path, strerror(e), (unsigned long long)n + 1);
}

static void wb_release(kv_offload *o, int b) {
    if (--o->wb_refs[b] == 0) o->wb_free[o->n_wb_free++] = b;
}

/* The disk writes that ended: the slot unpinned (a failed one dropped), the buffer reused
 * once no load reads it.  Owner's thread. */
static void settle_writes(kv_offload *o) {
    if (!o->writer_on) return;
    int done[64], n;
    do {
        pthread_mutex_lock(&o->wmu);
        n = o->n_wdone < 64 ? o->n_wdone : 64;
        memcpy(done, o->wdone + (o->n_wdone - n), (size_t)n * sizeof *done);
        o->n_wdone -= n;
        pthread_mutex_unlock(&o->wmu);
        for (int k = 0; k < n; k++) {
            int b = done[k];
            int32_t s = o->wb_slot[b];
            o->disk_wb[s] = -1;
            o->w_pending--;
            if (!o->wb_err[b]) {
                o->stats.stored[KV_TIER_DISK]++;
                o->stats.bytes_stored[KV_TIER_DISK] += o->bb;
            } else {
                write_failed(o, o->wb_err[b]);
                if (!o->disk.doomed[s]) { /* still listed: unfindable now, freed below */
                    ev_removed(o, KVEV_MEDIUM_DISK, o->disk.key[s]);
                    tier_remove(&o->disk, s);
                }
            }
            tier_unpin(&o->disk, s);
            wb_release(o, b);
        }
    } while (n == 64);
}

/* cfg.write_delay_ms: every disk write waits that long first (a slow disk) */
static void slow_disk(const kv_offload *o) {
    if (!o->cfg.write_delay_ms) return;
    struct timespec ts = {o->cfg.write_delay_ms / 1000,
                          (long)(o->cfg.write_delay_ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

/* The host slot's block goes to the disk tier (the host tier is evicting it). */
static void disk_store(kv_offload *o, uint64_t hash, const void *data) {
    int32_t s = tier_find(&o->disk, hash);
    if (s >= 0) { /* already there (loaded from it earlier): keep that copy */
        tier_touch(&o->disk, s);
        return;
    }
    int b = -1;
    if (o->writer_on) {
        settle_writes(o);
        if (!o->n_wb_free) { /* the disk is behind: drop this copy rather than wait */
            uint64_t n = o->stats.writes_dropped++;
            if ((n & (n + 1)) == 0)
                LOG_W(MOD,
                      "the disk KV tier's writes are behind (%d queued): a block evicted from "
                      "host memory is dropped instead of written to %s (%llu dropped so far)",
                      o->w_pending, o->path, (unsigned long long)n + 1);
            return;
        }
        b = o->wb_free[--o->n_wb_free];
    }
    s = tier_take(&o->disk);
    if (s < 0) {
        int32_t v = o->disk.head;
        if (v < 0) { /* every slot is being loaded or written: the block is not kept */
            if (b >= 0) o->wb_free[o->n_wb_free++] = b;
            return;
        }
        disk_drop(o, v);
        o->stats.evicted[KV_TIER_DISK]++;
        s = tier_take(&o->disk);
    }
    if (b >= 0) { /* queued: findable now, pinned (no eviction, no reuse) until it ended */
        unsigned char *buf = o->wmem + (size_t)b * o->stride;
        slot_image(o, buf, hash, data);
        o->wb_slot[b] = s;
        o->wb_refs[b] = 1;
        o->disk_wb[s] = b;
        o->w_pending++;
        tier_insert(&o->disk, s, hash);
        tier_pin(&o->disk, s);
        ev_stored(o, KVEV_MEDIUM_DISK, hash);
        pthread_mutex_lock(&o->wmu);
        o->wq[(o->wq_head + o->wq_n++) % o->nwb] = b;
        pthread_cond_signal(&o->wcv);
        pthread_mutex_unlock(&o->wmu);
        return;
    }
    slot_image(o, o->bounce, hash, data);
    slow_disk(o);
    ssize_t w = pwrite(o->fd, o->bounce, o->stride, (off_t)s * (off_t)o->stride);
    if (w != (ssize_t)o->stride) {
        write_failed(o, w < 0 ? errno : ENOSPC);
        o->disk.free_slots[o->disk.n_free++] = s;
        return;
    }
    tier_insert(&o->disk, s, hash);
    o->stats.stored[KV_TIER_DISK]++;
    o->stats.bytes_stored[KV_TIER_DISK] += o->bb;
    ev_stored(o, KVEV_MEDIUM_DISK, hash);
}

/* Check a slot image (header and checksum) for hash: NULL, or why it is unusable. */
static const char *slot_check(const kv_offload *o, const unsigned char *buf, uint64_t hash) {
    uint64_t hdr[DISK_HDR / 8];
    memcpy(hdr, buf, sizeof hdr);
    if (hdr[0] != DISK_MAGIC) return "bad magic";
    if (hdr[1] != o->cfg.layout_key) return "another model, dtype or block layout";
    if (hdr[2] != hash || hdr[3] != o->bb) return "another block";
    if (hdr[4] != checksum(o, hash, buf + DISK_HDR)) return "checksum mismatch";
    return NULL;
}

/* Read disk slot s (holding hash) into buf (stride bytes, DISK_ALIGN-aligned: O_DIRECT) and
 * check it: NULL, or why it is unusable.  Any thread: reads only what a pinned slot's load
 * may read. */
static const char *disk_read(const kv_offload *o, unsigned char *buf, int32_t s, uint64_t hash) {
    ssize_t r = pread(o->fd, buf, o->stride, (off_t)s * (off_t)o->stride);
    if (r < 0) return "read error";
    if ((size_t)r < DISK_HDR + o->bb) return "truncated";
    return slot_check(o, buf, hash);
}

/* A disk slot failed its checks at load: counted, logged and dropped (the caller
 * recomputes the block). */
static void disk_bad(kv_offload *o, int32_t s, uint64_t hash, const char *why) {
    o->stats.corrupt++;
    LOG_W(MOD, "KV block %016llx in %s slot %d is unusable (%s): recomputed instead",
          (unsigned long long)hash, o->path, s, why);
    if (o->disk.key[s] == hash) disk_drop(o, s);
}

/* Copy tier t's slot s (holding hash) into device block `block` through st, a disk slot
 * by way of buf, or from write buffer wb (>= 0: its write is queued): 0, or -1 (*why set
 * when a disk slot failed its checks). */
static int copy_in(const kv_offload *o, backend_stream *st, unsigned char *buf, int t, int32_t s,
                   int wb, uint64_t hash, int32_t block, const char **why) {
    *why = NULL;
    char *dst = o->kv_base + (size_t)block * o->bb;
    if (t == KV_TIER_HOST) return backend_upload(st, dst, o->host_mem + (size_t)s * o->bb, o->bb);
    if (wb >= 0) buf = o->wmem + (size_t)wb * o->stride;
    if ((*why = wb >= 0 ? slot_check(o, buf, hash) : disk_read(o, buf, s, hash))) return -1;
    return backend_upload(st, dst, buf + DISK_HDR, o->bb) ? -1 : 0;
}

/* ---- host tier -------------------------------------------------------------------- */

int kv_offload_store(kv_offload *o, uint64_t hash, int32_t block) {
    int32_t s = tier_find(&o->host, hash);
    if (s >= 0) {
        tier_touch(&o->host, s);
        return 0;
    }
    s = tier_take(&o->host);
    if (s < 0) { /* the least recently used host block goes down a tier */
        int32_t v = o->host.head;
        if (v < 0) return 0; /* every slot is being loaded: the block is not kept */
        uint64_t vh = o->host.key[v];
        if (o->fd >= 0) {
            uint64_t t0 = clock_now_ns();
            disk_store(o, vh, o->host_mem + (size_t)v * o->bb);
            o->stats.store_ns[KV_TIER_DISK] += clock_now_ns() - t0;
        }
        ev_removed(o, KVEV_MEDIUM_CPU, vh);
        tier_remove(&o->host, v);
        o->stats.evicted[KV_TIER_HOST]++;
        s = tier_take(&o->host);
    }
    uint64_t t0 = clock_now_ns();
    int rc = backend_download(o->st, o->host_mem + (size_t)s * o->bb,
                              o->kv_base + (size_t)block * o->bb, o->bb);
    o->stats.store_ns[KV_TIER_HOST] += clock_now_ns() - t0;
    if (rc) {
        o->host.free_slots[o->host.n_free++] = s;
        return -1;
    }
    tier_insert(&o->host, s, hash);
    o->stats.stored[KV_TIER_HOST]++;
    o->stats.bytes_stored[KV_TIER_HOST] += o->bb;
    ev_stored(o, KVEV_MEDIUM_CPU, hash);
    return 0;
}

int64_t kv_offload_lookup(kv_offload *o, uint64_t hash) {
    o->stats.lookups++;
    int32_t s = tier_find(&o->host, hash);
    if (s >= 0) {
        tier_touch(&o->host, s);
        o->stats.hits[KV_TIER_HOST]++;
        return s;
    }
    s = tier_find(&o->disk, hash);
    if (s >= 0) {
        tier_touch(&o->disk, s);
        o->stats.hits[KV_TIER_DISK]++;
        return (int64_t)1 << 32 | s;
    }
    return -1;
}

/* cfg.load_delay_ms: every load waits that long first (a slow medium) */
static void slow_medium(const kv_offload *o) {
    if (!o->cfg.load_delay_ms) return;
    struct timespec ts = {o->cfg.load_delay_ms / 1000, (long)(o->cfg.load_delay_ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

int kv_offload_load(kv_offload *o, int64_t handle, int32_t block) {
    int t = (int)(handle >> 32);
    int32_t s = (int32_t)(handle & 0xffffffff);
    tier *tr = t ? &o->disk : &o->host;
    if (handle < 0 || t >= KV_TIER_COUNT || s >= tr->n_slots || !tr->key[s]) return -1;
    uint64_t t0 = clock_now_ns(), hash = tr->key[s];
    slow_medium(o);
    const char *why;
    int rc = copy_in(o, o->st, o->bounce, t, s, t ? o->disk_wb[s] : -1, hash, block, &why);
    if (why) disk_bad(o, s, hash, why);
    if (rc) return -1;
    o->stats.loaded[t]++;
    o->stats.bytes_loaded[t] += o->bb;
    o->stats.load_ns[t] += clock_now_ns() - t0;
    return 0;
}

int kv_offload_find(const kv_offload *o, uint64_t hash) {
    if (tier_find(&o->host, hash) >= 0) return KV_TIER_HOST;
    if (tier_find(&o->disk, hash) >= 0) return KV_TIER_DISK;
    return -1;
}

/* ---- the loader ------------------------------------------------------------------- */

static void run_job(const kv_offload *o, backend_stream *st, unsigned char *buf, load_job *j) {
    uint64_t t0 = clock_now_ns();
    slow_medium(o);
    j->ok = copy_in(o, st, buf, j->tier, j->slot, j->wb, j->hash, j->block, &j->why) == 0;
    j->ns = clock_now_ns() - t0;
}

static void push_done(kv_offload *o, load_job *j) {
    pthread_mutex_lock(&o->mu);
    j->next = NULL;
    if (o->done_tail)
        o->done_tail->next = j;
    else
        o->done_head = j;
    o->done_tail = j;
    o->n_done++;
    pthread_mutex_unlock(&o->mu);
}

/* Loads the loader takes at once: the host-tier copies among them are enqueued back to back
 * and synced once (a sync a block cost the H200 about a third of the copy rate: 917 KB blocks
 * at 31 GB/s), then reported together; the bound keeps the first of them from waiting long
 * for the last (32 blocks of the 7B shape: 29 MB, about 0.6 ms over PCIe 5). */
#define LOADER_BATCH 32

/* jobs b[0..n-1]: host-tier ones enqueued (backend_upload_async), disk ones copied at once
 * through the staging buffer (that upload syncs the stream, the enqueued ones with it); one
 * sync at the end decides the enqueued ones; the time is shared among them */
static void run_batch(kv_offload *o, load_job **b, int n) {
    uint64_t t0 = clock_now_ns(), t_disk = 0;
    int n_async = 0;
    for (int i = 0; i < n; i++) {
        load_job *j = b[i];
        if (j->tier != KV_TIER_HOST) {
            run_job(o, o->load_st, o->stage, j);
            t_disk += j->ns;
            continue;
        }
        slow_medium(o);
        j->why = NULL;
        j->ok = backend_upload_async(o->load_st, o->kv_base + (size_t)j->block * o->bb,
                                     o->host_buf, (size_t)j->slot * o->bb, o->bb) == 0;
        n_async++;
    }
    int synced = backend_stream_sync(o->load_st) == 0;
    uint64_t t = clock_now_ns() - t0;
    uint64_t share = n_async ? (t > t_disk ? t - t_disk : 0) / (uint64_t)n_async : 0;
    for (int i = 0; i < n; i++)
        if (b[i]->tier == KV_TIER_HOST) {
            b[i]->ok = b[i]->ok && synced;
            b[i]->ns = share;
        }
}

static void *loader_main(void *arg) {
    kv_offload *o = arg;
    load_job *b[LOADER_BATCH];
    pthread_mutex_lock(&o->mu);
    for (;;) {
        while (!o->stop && !o->todo_head)
            pthread_cond_wait(&o->cv, &o->mu);
        if (o->stop) break;
        int n = 0;
        while (n < LOADER_BATCH && o->todo_head) {
            b[n++] = o->todo_head;
            o->todo_head = o->todo_head->next;
        }
        if (!o->todo_head) o->todo_tail = NULL;
        pthread_mutex_unlock(&o->mu);
        run_batch(o, b, n);
        for (int i = 0; i < n; i++)
            push_done(o, b[i]);
        if (o->notify) o->notify(o->notify_ctx);
        pthread_mutex_lock(&o->mu);
    }
    pthread_mutex_unlock(&o->mu);
    return NULL;
}

void kv_offload_set_notify(kv_offload *o, void (*fn)(void *ctx), void *ctx) {
    o->notify = fn;
    o->notify_ctx = ctx;
}

int kv_offload_load_async(kv_offload *o, uint64_t hash, int32_t block, uint64_t tag) {
    int64_t h = kv_offload_lookup(o, hash);
    if (h < 0) return -1;
    load_job *j = calloc(1, sizeof *j);
    if (!j) return -1;
    j->tag = tag;
    j->hash = hash;
    j->block = block;
    j->tier = (int)(h >> 32);
    j->slot = (int32_t)(h & 0xffffffff);
    j->wb = j->tier ? o->disk_wb[j->slot] : -1;
    if (j->wb >= 0) o->wb_refs[j->wb]++; /* read from the queued bytes: kept until reaped */
    tier_pin(j->tier ? &o->disk : &o->host, j->slot);
    o->in_flight++;
    if (!o->loader_on) { /* sync_loads: the copy on this thread, reaped as the others */
        run_job(o, o->st, o->bounce, j);
        push_done(o, j);
        if (o->notify) o->notify(o->notify_ctx);
        return 0;
    }
    pthread_mutex_lock(&o->mu);
    if (o->todo_tail)
        o->todo_tail->next = j;
    else
        o->todo_head = j;
    o->todo_tail = j;
    pthread_cond_signal(&o->cv);
    pthread_mutex_unlock(&o->mu);
    return 0;
}

int kv_offload_reap(kv_offload *o, kv_offload_done *out, int max) {
    settle_writes(o);
    int n = 0;
    while (n < max) {
        pthread_mutex_lock(&o->mu);
        load_job *j = o->done_head;
        if (j) {
            o->done_head = j->next;
            if (!o->done_head) o->done_tail = NULL;
            o->n_done--;
        }
        pthread_mutex_unlock(&o->mu);
        if (!j) break;
        tier *tr = j->tier ? &o->disk : &o->host;
        tier_unpin(tr, j->slot);
        if (j->wb >= 0) wb_release(o, j->wb);
        if (j->why) disk_bad(o, j->slot, j->hash, j->why);
        if (j->ok) {
            o->stats.loaded[j->tier]++;
            o->stats.bytes_loaded[j->tier] += o->bb;
            o->stats.load_ns[j->tier] += j->ns;
        }
        out[n++] = (kv_offload_done){j->tag, j->block, j->tier, j->ok, j->ns};
        o->in_flight--;
        free(j);
    }
    return n;
}

int kv_offload_in_flight(const kv_offload *o) {
    return o->in_flight;
}

int kv_offload_busy(kv_offload *o) {
    pthread_mutex_lock(&o->mu);
    int n = o->in_flight - o->n_done;
    pthread_mutex_unlock(&o->mu);
    return n;
}

static void tier_clear(tier *t) {
    while (t->head >= 0)
        tier_remove(t, t->head);
    for (int32_t s = 0; s < t->n_slots; s++) /* being loaded: freed when the load ends */
        if (t->pins[s] && t->key[s]) tier_remove(t, s);
}

void kv_offload_clear(kv_offload *o) {
    tier_clear(&o->host);
    tier_clear(&o->disk);
}

void kv_offload_get_stats(kv_offload *o, kv_offload_stats *out) {
    settle_writes(o);
    *out = o->stats;
    out->writes_queued = o->w_pending;
    out->direct_io = o->direct;
    out->resident[KV_TIER_HOST] = o->host.n_used;
    out->resident[KV_TIER_DISK] = o->disk.n_used;
    out->capacity[KV_TIER_HOST] = o->host.n_slots;
    out->capacity[KV_TIER_DISK] = o->disk.n_slots;
    out->in_flight = o->in_flight;
}

void kv_offload_drain_writes(kv_offload *o) {
    for (;;) {
        settle_writes(o);
        if (!o->w_pending) return;
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
}

const char *kv_offload_disk_path(const kv_offload *o) {
    return o->fd >= 0 ? o->path : "";
}

/* ---- the writer ------------------------------------------------------------------- */

static void *writer_main(void *arg) {
    kv_offload *o = arg;
    pthread_mutex_lock(&o->wmu);
    for (;;) {
        while (!o->wstop && !o->wq_n)
            pthread_cond_wait(&o->wcv, &o->wmu);
        if (o->wstop) break; /* the queued writes are dropped: the slab goes with the pool */
        int b = o->wq[o->wq_head];
        o->wq_head = (o->wq_head + 1) % o->nwb;
        o->wq_n--;
        off_t off = (off_t)o->wb_slot[b] * (off_t)o->stride;
        pthread_mutex_unlock(&o->wmu);
        slow_disk(o);
        ssize_t w = pwrite(o->fd, o->wmem + (size_t)b * o->stride, o->stride, off);
        int err = w == (ssize_t)o->stride ? 0 : w < 0 ? errno : ENOSPC;
        pthread_mutex_lock(&o->wmu);
        o->wb_err[b] = err;
        o->wdone[o->n_wdone++] = b;
        pthread_mutex_unlock(&o->wmu);
        if (o->notify) o->notify(o->notify_ctx);
        pthread_mutex_lock(&o->wmu);
    }
    pthread_mutex_unlock(&o->wmu);
    return NULL;
}

static int writer_start(kv_offload *o, char *err, size_t errlen) {
    pthread_mutex_init(&o->wmu, NULL);
    pthread_cond_init(&o->wcv, NULL);
    o->wmu_on = 1;
    if (o->cfg.sync_writes) return 0;
    size_t fit = KV_OFFLOAD_WRITE_QUEUE_BYTES / o->stride; /* a burst of evictions fits */
    int n = o->nwb = o->cfg.write_queue > 0 ? o->cfg.write_queue
                     : fit < 16                ? 16
                     : fit > 4096              ? 4096
                                               : (int)fit;
    o->wmem = aligned_alloc(DISK_ALIGN, (size_t)n * o->stride);
    o->wb_slot = calloc((size_t)n, sizeof *o->wb_slot);
    o->wb_refs = calloc((size_t)n, sizeof *o->wb_refs);
    o->wb_err = calloc((size_t)n, sizeof *o->wb_err);
    o->wb_free = calloc((size_t)n, sizeof *o->wb_free);
    o->wq = calloc((size_t)n, sizeof *o->wq);
    o->wdone = calloc((size_t)n, sizeof *o->wdone);
    if (!o->wmem || !o->wb_slot || !o->wb_refs || !o->wb_err || !o->wb_free || !o->wq ||
        !o->wdone) {
        snprintf(err, errlen, "out of memory for the disk KV tier's %d write buffers of %zu bytes",
                 n, o->stride);
        return -1;
    }
    memset(o->wmem, 0, (size_t)n * o->stride); /* the padding after a block is written too */
    for (int b = 0; b < n; b++)
        o->wb_free[o->n_wb_free++] = n - 1 - b;
    int rc = pthread_create(&o->writer, NULL, writer_main, o);
    if (rc) {
        snprintf(err, errlen, "cannot start the KV offload writer thread: %s", strerror(rc));
        return -1;
    }
    o->writer_on = 1;
    return 0;
}

/* The name of the filesystem under fd, for the log. */
static const char *fs_name(int fd, char *buf, size_t len) {
    struct statfs sf;
    if (fstatfs(fd, &sf)) return "an unknown filesystem";
    static const struct {
        unsigned long magic;
        const char *name;
    } known[] = {{0xEF53, "ext4"},         {0x58465342, "xfs"},     {0x9123683E, "btrfs"},
                 {0x01021994, "tmpfs"},    {0x858458f6, "ramfs"},   {0x794c7630, "overlayfs"},
                 {0x6969, "nfs"},          {0x2fc12fc1, "zfs"},     {0xF2F52010, "f2fs"},
                 {0x65735546, "fuse"},     {0xFF534D42, "cifs"},    {0x4d44, "vfat"}};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if ((unsigned long)sf.f_type == known[i].magic) return known[i].name;
    snprintf(buf, len, "filesystem type 0x%lx", (unsigned long)sf.f_type);
    return buf;
}

/* the slab's lock for the run's life (remove_stale_slabs leaves a locked slab alone) */
static void slab_lock(const kv_offload *o, int fd) {
    if (flock(fd, LOCK_EX | LOCK_NB) != 0)
        LOG_W(MOD, "cannot lock %s (%s): another run sharing the directory may take it for a "
                   "stale slab", o->path, strerror(errno));
}

/* Open the slab (new, empty) at a fresh name DIR/disagg-kv-PID-N.slab: created exclusively
 * (another container sharing the directory may run a process of the same PID: its slab is
 * never truncated, the next N is taken) and locked (flock) for the run's life, which is what
 * remove_stale_slabs asks before it removes a slab.  O_DIRECT as cfg.direct_io asks and the
 * filesystem allows (a probe write of one slot, then truncated back), else buffered.  fd, or
 * -1 (err set). */
static int open_slab(kv_offload *o, const char *dir, char *err, size_t errlen) {
    static atomic_int serial;
    const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
    int fd = -1;
    for (int tries = 0; tries < 1024 && fd < 0; tries++) {
        snprintf(o->path, sizeof o->path, "%s/disagg-kv-%d-%d.slab", dir, (int)getpid(),
                 atomic_fetch_add(&serial, 1));
        fd = open(o->path, flags, 0600);
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd >= 0) slab_lock(o, fd);
    if (fd < 0) {
        snprintf(err, errlen, "--kv-offloading-disk '%s': cannot create %s: %s; accepted: a "
                 "writable directory", o->cfg.disk_dir, o->path, strerror(errno));
        return -1;
    }
    char fsbuf[64];
    const char *fs = fs_name(fd, fsbuf, sizeof fsbuf);
    if (o->cfg.direct_io == KV_DIRECT_IO_OFF) {
        LOG_I(MOD, "disk tier on %s: buffered I/O (DISAGG_KV_OFFLOAD_DIRECT_IO=off)", fs);
        return fd;
    }
    if (o->cfg.direct_io == KV_DIRECT_IO_AUTO &&
        (!strcmp(fs, "tmpfs") || !strcmp(fs, "ramfs"))) {
        LOG_I(MOD, "disk tier on %s: buffered I/O (the files are in memory; O_DIRECT would "
                   "only add copies)", fs);
        return fd;
    }
    const char *why = NULL;
    int e = 0;
    int dfd = open(o->path, O_RDWR | O_CLOEXEC | O_DIRECT);
    if (dfd < 0) {
        why = "open";
        e = errno;
    } else if (pwrite(dfd, o->bounce, o->stride, 0) != (ssize_t)o->stride) {
        why = "write";
        e = errno;
        close(dfd);
        dfd = -1;
    }
    if (ftruncate(fd, 0)) { /* the probe's slot: the slab starts empty */
    }
    if (dfd < 0) {
        if (o->cfg.direct_io == KV_DIRECT_IO_ON) {
            snprintf(err, errlen, "--kv-offloading-disk '%s' is on %s, which refuses O_DIRECT "
                     "(%s: %s); accepted with DISAGG_KV_OFFLOAD_DIRECT_IO=on: a filesystem "
                     "with direct I/O (ext4, xfs, btrfs); auto falls back to buffered I/O",
                     o->cfg.disk_dir, fs, why, strerror(e));
            close(fd);
            return -1;
        }
        LOG_I(MOD, "disk tier on %s: buffered I/O (the filesystem refuses O_DIRECT: %s: %s)", fs,
              why, strerror(e));
        return fd;
    }
    close(fd); /* its lock with it: the O_DIRECT descriptor takes it (the slab is too new for
                * another run's sweep meanwhile) */
    slab_lock(o, dfd);
    o->direct = 1;
    LOG_I(MOD, "disk tier on %s: O_DIRECT (no page cache)", fs);
    return dfd;
}

/* ---- lifecycle -------------------------------------------------------------------- */

/* The loader: its stream, its staging buffer, its thread (none with sync_loads). */
static int loader_start(kv_offload *o, char *err, size_t errlen) {
    pthread_mutex_init(&o->mu, NULL);
    pthread_cond_init(&o->cv, NULL);
    o->mu_on = 1;
    if (o->cfg.sync_loads) return 0;
    backend *be = backend_stream_backend(o->st);
    o->load_st = backend_stream_create_threads(be, 1); /* the copies run on the loader itself */
    if (!o->load_st) {
        snprintf(err, errlen, "cannot create a stream for the KV offload loads");
        return -1;
    }
    if (o->fd >= 0) {
        /* one slot, DISK_ALIGN-aligned inside the buffer (O_DIRECT; pinned memory on CUDA is
         * page-aligned already, the CPU backend's is malloc's) */
        o->stage_buf = backend_buffer_alloc(be, o->stride + DISK_ALIGN, BACKEND_BUF_HOST);
        if (!o->stage_buf) {
            snprintf(err, errlen, "cannot allocate the disk KV tier's staging buffer (%zu bytes)",
                     o->stride + DISK_ALIGN);
            return -1;
        }
        uintptr_t p = (uintptr_t)backend_buffer_ptr(o->stage_buf);
        o->stage = (unsigned char *)((p + DISK_ALIGN - 1) & ~(uintptr_t)(DISK_ALIGN - 1));
    }
    int rc = pthread_create(&o->loader, NULL, loader_main, o);
    if (rc) {
        snprintf(err, errlen, "cannot start the KV offload loader thread: %s", strerror(rc));
        return -1;
    }
    o->loader_on = 1;
    return 0;
}

/* Slabs a killed run left in dir: removed, so crashes do not fill the disk.  Never read:
 * their blocks may be another model's.  A slab is stale when its PID is gone here, nobody
 * holds its lock (a run in another PID namespace sharing the directory does) and it is older
 * than a few seconds (the moment between a slab's creation and its lock). */
static void remove_stale_slabs(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        int pid, n, end = 0;
        if (sscanf(de->d_name, "disagg-kv-%d-%d.slab%n", &pid, &n, &end) != 2 ||
            de->d_name[end] || pid <= 0)
            continue;
        if (kill(pid, 0) == 0 || errno != ESRCH) continue; /* alive (or not ours to judge) */
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) continue;
        struct stat st;
        int stale = !fstat(fd, &st) && S_ISREG(st.st_mode) &&
                    time(NULL) - st.st_mtime > 10 && !flock(fd, LOCK_EX | LOCK_NB);
        if (stale && !unlink(path)) LOG_I(MOD, "removed %s, left by a run that is gone", path);
        close(fd); /* the lock goes with it */
    }
    closedir(d);
}

int kv_offload_create(const kv_offload_config *c, backend_stream *st, void *kv_base,
                      kv_offload **out, char *err, size_t errlen) {
    *out = NULL;
    if (!c->block_bytes || c->host_bytes < c->block_bytes) {
        snprintf(err, errlen,
                 "--kv-offloading-size holds no KV block (%zu bytes; one block is %zu bytes): "
                 "accepted: at least one block",
                 c->host_bytes, c->block_bytes);
        return -1;
    }
    kv_offload *o = calloc(1, sizeof *o);
    if (!o) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    o->cfg = *c;
    o->cfg.disk_dir = NULL;
    o->st = st;
    o->kv_base = kv_base;
    o->bb = c->block_bytes;
    o->fd = -1;
    o->disk.head = o->disk.tail = -1; /* no disk tier until one is set up */
    size_t nh = c->host_bytes / c->block_bytes;
    if (nh > INT32_MAX / 4) nh = INT32_MAX / 4;
    o->host_len = nh * o->bb;
    /* through the backend: pinned on CUDA, so the tier's copies run at full speed */
    o->host_buf = backend_buffer_alloc(backend_stream_backend(st), o->host_len, BACKEND_BUF_HOST);
    if (!o->host_buf) {
        snprintf(err, errlen, "cannot allocate a host KV tier of %zu bytes (--kv-offloading-size)",
                 o->host_len);
        kv_offload_destroy(o);
        return -1;
    }
    o->host_mem = backend_buffer_ptr(o->host_buf);
    if (tier_init(&o->host, (int32_t)nh)) {
        snprintf(err, errlen, "out of memory for the host KV tier's index");
        kv_offload_destroy(o);
        return -1;
    }
    if (c->disk_dir) {
        o->stride = (DISK_HDR + o->bb + DISK_ALIGN - 1) / DISK_ALIGN * DISK_ALIGN;
        size_t nd = c->disk_bytes / o->stride;
        if (nd == 0) {
            snprintf(err, errlen,
                     "--kv-offloading-disk-size holds no KV block (%zu bytes; one slot is %zu "
                     "bytes): accepted: at least one slot",
                     c->disk_bytes, o->stride);
            kv_offload_destroy(o);
            return -1;
        }
        if (nd > INT32_MAX / 4) nd = INT32_MAX / 4;
        remove_stale_slabs(c->disk_dir);
        o->bounce = aligned_alloc(DISK_ALIGN, o->stride);
        o->disk_wb = malloc(nd * sizeof *o->disk_wb);
        if (!o->bounce || !o->disk_wb || tier_init(&o->disk, (int32_t)nd)) {
            snprintf(err, errlen, "out of memory for the disk KV tier");
            kv_offload_destroy(o);
            return -1;
        }
        memset(o->bounce, 0, o->stride);
        for (size_t i = 0; i < nd; i++)
            o->disk_wb[i] = -1;
        /* a new, empty file: a restart never finds another run's KV */
        o->cfg.disk_dir = c->disk_dir; /* for open_slab's messages only */
        o->fd = open_slab(o, c->disk_dir, err, errlen);
        o->cfg.disk_dir = NULL;
        if (o->fd < 0) {
            kv_offload_destroy(o);
            return -1;
        }
        /* a file size limit (ulimit -f) must fail the write (EFBIG), not kill the server */
        signal(SIGXFSZ, SIG_IGN);
    }
    LOG_I(MOD, "host tier: %d blocks of %zu bytes (%.1f MiB)", o->host.n_slots, o->bb,
          o->host_len / 1048576.0);
    if (o->fd >= 0)
        LOG_I(MOD, "disk tier: %d blocks in %s (slots of %zu bytes, %.1f MiB)", o->disk.n_slots,
              o->path, o->stride, (double)o->disk.n_slots * (double)o->stride / 1048576.0);
    if (loader_start(o, err, errlen) || (o->fd >= 0 && writer_start(o, err, errlen))) {
        kv_offload_destroy(o);
        return -1;
    }
    *out = o;
    return 0;
}

void kv_offload_destroy(kv_offload *o) {
    if (!o) return;
    if (o->loader_on) { /* the load in progress ends; the queued ones are dropped */
        pthread_mutex_lock(&o->mu);
        o->stop = 1;
        pthread_cond_signal(&o->cv);
        pthread_mutex_unlock(&o->mu);
        pthread_join(o->loader, NULL);
    }
    if (o->writer_on) { /* the write in progress ends; the queued ones are dropped */
        pthread_mutex_lock(&o->wmu);
        o->wstop = 1;
        pthread_cond_signal(&o->wcv);
        pthread_mutex_unlock(&o->wmu);
        pthread_join(o->writer, NULL);
    }
    if (o->wmu_on) {
        pthread_mutex_destroy(&o->wmu);
        pthread_cond_destroy(&o->wcv);
    }
    free(o->wmem);
    free(o->wb_slot);
    free(o->wb_refs);
    free(o->wb_err);
    free(o->wb_free);
    free(o->wq);
    free(o->wdone);
    free(o->disk_wb);
    load_job *lists[2] = {o->todo_head, o->done_head};
    for (int i = 0; i < 2; i++)
        for (load_job *j = lists[i], *n; j; j = n) {
            n = j->next;
            free(j);
        }
    if (o->mu_on) {
        pthread_mutex_destroy(&o->mu);
        pthread_cond_destroy(&o->cv);
    }
    backend_stream_free(o->load_st);
    backend_buffer_free(o->stage_buf);
    backend_buffer_free(o->host_buf);
    if (o->fd >= 0) {
        close(o->fd);
        unlink(o->path);
    }
    free(o->bounce);
    tier_free(&o->host);
    tier_free(&o->disk);
    free(o);
}
