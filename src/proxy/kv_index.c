/* kv_index — see kv_index.h. */
#include "proxy/kv_index.h"

#include <errno.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

/* ---- an open-addressing table of 64-bit keys (linear probing, backward-shift delete) ---- */

typedef struct slot {
    uint64_t key;  /* instance hash (eng) or chain hash (loc) */
    uint64_t val;  /* eng: the block's chain hash */
    uint32_t refs; /* loc: instance hashes naming this chain hash */
    uint8_t media; /* bit per kv_medium */
    uint8_t used;  /* the slot holds an entry */
} slot;

typedef struct table {
    slot *s;    /* (cap) slots */
    size_t cap; /* a power of two, or 0 */
    size_t n;   /* entries */
} table;

static size_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (size_t)k;
}

static slot *t_find(const table *t, uint64_t key) {
    if (!t->cap) return NULL;
    for (size_t i = mix(key) & (t->cap - 1);; i = (i + 1) & (t->cap - 1)) {
        if (!t->s[i].used) return NULL;
        if (t->s[i].key == key) return &t->s[i];
    }
}

static int t_grow(table *t) {
    size_t cap = t->cap ? t->cap * 2 : 1024;
    slot *s = calloc(cap, sizeof *s);
    if (!s) return -ENOMEM;
    for (size_t i = 0; i < t->cap; i++) {
        if (!t->s[i].used) continue;
        size_t j = mix(t->s[i].key) & (cap - 1);
        while (s[j].used)
            j = (j + 1) & (cap - 1);
        s[j] = t->s[i];
    }
    free(t->s);
    t->s = s;
    t->cap = cap;
    return 0;
}

/* A new entry for key (not present); NULL when out of memory. */
static slot *t_insert(table *t, uint64_t key) {
    if ((t->n + 1) * 4 > t->cap * 3 && t_grow(t)) return NULL;
    size_t i = mix(key) & (t->cap - 1);
    while (t->s[i].used)
        i = (i + 1) & (t->cap - 1);
    memset(&t->s[i], 0, sizeof t->s[i]);
    t->s[i].key = key;
    t->s[i].used = 1;
    t->n++;
    return &t->s[i];
}

static void t_delete(table *t, slot *e) {
    size_t i = (size_t)(e - t->s), mask = t->cap - 1;
    t->s[i].used = 0;
    t->n--;
    for (size_t j = (i + 1) & mask; t->s[j].used; j = (j + 1) & mask) {
        size_t home = mix(t->s[j].key) & mask;
        /* move j back into the hole at i unless its home lies cyclically in (i, j] */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            t->s[i] = t->s[j];
            t->s[j].used = 0;
            i = j;
        }
    }
}

static void t_clear(table *t) {
    if (t->cap) memset(t->s, 0, t->cap * sizeof *t->s);
    t->n = 0;
}

/* ---- the index ------------------------------------------------------------------------- */

struct kv_index {
    table eng;         /* instance hash -> chain hash, media */
    table loc;         /* chain hash -> refs, media */
    size_t max_blocks; /* eng entries at most */
    kv_index_stats st; /* counters; blocks[] and total kept current */
};

kv_index *kv_index_new(size_t max_blocks) {
    kv_index *x = calloc(1, sizeof *x);
    if (x) x->max_blocks = max_blocks ? max_blocks : 1;
    return x;
}

void kv_index_free(kv_index *x) {
    if (!x) return;
    free(x->eng.s);
    free(x->loc.s);
    free(x);
}

void kv_index_clear(kv_index *x) {
    t_clear(&x->eng);
    t_clear(&x->loc);
    memset(x->st.blocks, 0, sizeof x->st.blocks);
    x->st.total = 0;
}

void kv_index_get_stats(const kv_index *x, kv_index_stats *out) {
    *out = x->st;
    out->total = x->eng.n;
}

static uint64_t chain_one(uint64_t parent, const int32_t *ids, int bs) {
    return XXH3_64bits_withSeed(ids, (size_t)bs * sizeof *ids, parent);
}

void kv_index_chain(const int32_t *ids, size_t n, int block_size, uint64_t *out) {
    uint64_t h = 0;
    if (block_size <= 0) return;
    for (size_t b = 0; (b + 1) * (size_t)block_size <= n; b++)
        out[b] = h = chain_one(h, ids + b * (size_t)block_size, block_size);
}

static int fastest(uint8_t media) {
    for (int m = 0; m < KV_MEDIA; m++)
        if (media >> m & 1) return m;
    return -1;
}

int kv_index_match(const kv_index *x, const uint64_t *chain, int n, int *per_medium) {
    if (per_medium) memset(per_medium, 0, KV_MEDIA * sizeof *per_medium);
    int i = 0;
    for (; i < n; i++) {
        const slot *l = t_find(&x->loc, chain[i]);
        if (!l || !l->media) break;
        if (per_medium) per_medium[fastest(l->media)]++;
    }
    return i;
}

static void media_count(kv_index *x, uint8_t before, uint8_t after) {
    for (int m = 0; m < KV_MEDIA; m++) {
        if ((before >> m & 1) && !(after >> m & 1)) x->st.blocks[m]--;
        if (!(before >> m & 1) && (after >> m & 1)) x->st.blocks[m]++;
    }
}

/* The instance's block hash leaves medium bits `media` (all: forget it). */
static void block_remove(kv_index *x, uint64_t h, uint8_t media) {
    slot *e = t_find(&x->eng, h);
    if (!e) return;
    uint8_t before = e->media;
    e->media &= (uint8_t)~media;
    media_count(x, before, e->media);
    slot *l = t_find(&x->loc, e->val);
    if (l && l->refs == 1) l->media = e->media;
    if (e->media) return;
    uint64_t local = e->val;
    t_delete(&x->eng, e);
    l = t_find(&x->loc, local);
    if (l && --l->refs == 0) t_delete(&x->loc, l);
}

static void block_store(kv_index *x, uint64_t h, uint64_t local, uint8_t m) {
    slot *e = t_find(&x->eng, h);
    if (e && e->val != local) { /* the instance reused the hash for other tokens */
        block_remove(x, h, 0xff);
        e = NULL;
    }
    if (!e) {
        if (x->eng.n >= x->max_blocks) {
            x->st.dropped++;
            return;
        }
        slot *l = t_find(&x->loc, local);
        if (!l && !(l = t_insert(&x->loc, local))) {
            x->st.dropped++;
            return;
        }
        if (!(e = t_insert(&x->eng, h))) {
            if (!l->refs) t_delete(&x->loc, l);
            x->st.dropped++;
            return;
        }
        e->val = local;
        l = t_find(&x->loc, local); /* the insert may have moved nothing, but be safe */
        l->refs++;
    }
    uint8_t before = e->media;
    e->media |= m;
    media_count(x, before, e->media);
    slot *l = t_find(&x->loc, local);
    if (l) l->media |= m;
}

/* ---- decoding a KVEventBatch ------------------------------------------------------------ */

static int fail(char *err, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return -EINVAL;
}

static int str_is(const msgpack_object *o, const char *s) {
    size_t n = strlen(s);
    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == n && !memcmp(o->via.str.ptr, s, n);
}

/* A block hash: an integer as is, bytes (vLLM's sha256 digests) by their XXH3-64. */
static int hash_of(const msgpack_object *o, uint64_t *h) {
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        *h = o->via.u64;
        return 0;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        *h = (uint64_t)o->via.i64;
        return 0;
    case MSGPACK_OBJECT_BIN:
        *h = XXH3_64bits(o->via.bin.ptr, o->via.bin.size);
        return 0;
    case MSGPACK_OBJECT_STR:
        *h = XXH3_64bits(o->via.str.ptr, o->via.str.size);
        return 0;
    default:
        return -EINVAL;
    }
}

/* "GPU" (or nil: vLLM before media were named) is the instance's own cache; "CPU" the
 * host tier; anything else (DISK, an external store) the slowest. */
static uint8_t medium_bit(const msgpack_object *o) {
    if (!o || o->type != MSGPACK_OBJECT_STR) return 1u << KV_MEDIUM_GPU;
    if (o->via.str.size == 3 && !strncasecmp(o->via.str.ptr, "gpu", 3)) return 1u << KV_MEDIUM_GPU;
    if (o->via.str.size == 3 && !strncasecmp(o->via.str.ptr, "cpu", 3)) return 1u << KV_MEDIUM_CPU;
    return 1u << KV_MEDIUM_DISK;
}

/* The fields of one event, from either layout. */
typedef struct ev_fields {
    const msgpack_object *hashes, *parent, *tokens, *block_size, *medium;
} ev_fields;

static const msgpack_object *map_get(const msgpack_object *m, const char *key) {
    for (uint32_t i = 0; i < m->via.map.size; i++)
        if (str_is(&m->via.map.ptr[i].key, key)) return &m->via.map.ptr[i].val;
    return NULL;
}

static int apply_stored(kv_index *x, const ev_fields *f, size_t k, char *err, size_t cap) {
    const msgpack_object *hs = f->hashes, *tk = f->tokens;
    if (!hs || hs->type != MSGPACK_OBJECT_ARRAY)
        return fail(err, cap, "event %zu (BlockStored): block_hashes is not a list", k);
    uint32_t nb = hs->via.array.size;
    int64_t bs = 0;
    if (f->block_size && f->block_size->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        bs = (int64_t)f->block_size->via.u64;
    if (bs < 0 || bs > 1 << 20)
        return fail(err, cap, "event %zu (BlockStored): block_size %lld is not 1..1048576", k,
                    (long long)bs);
    uint8_t m = medium_bit(f->medium);
    uint64_t hv[1];
    x->st.stored += nb;
    int tokens_ok = bs > 0 && tk && tk->type == MSGPACK_OBJECT_ARRAY &&
                    tk->via.array.size == (uint64_t)nb * (uint64_t)bs && nb > 0;
    if (!tokens_ok) { /* a tier's event: no token ids, blocks known from an earlier one */
        for (uint32_t i = 0; i < nb; i++) {
            if (hash_of(&hs->via.array.ptr[i], hv))
                return fail(err, cap, "event %zu (BlockStored): hash %u is not an integer or bytes",
                            k, i);
            slot *e = t_find(&x->eng, hv[0]);
            if (e)
                block_store(x, hv[0], e->val, m);
            else
                x->st.unchained++;
        }
        return 0;
    }
    x->st.block_size = (int)bs;
    uint64_t plocal = 0;
    if (f->parent && f->parent->type != MSGPACK_OBJECT_NIL) {
        uint64_t ph;
        if (hash_of(f->parent, &ph))
            return fail(err, cap, "event %zu (BlockStored): parent_block_hash is not a hash", k);
        const slot *pe = t_find(&x->eng, ph);
        if (!pe) {
            x->st.unchained += nb;
            return 0;
        }
        plocal = pe->val;
    }
    int32_t *ids = malloc((size_t)bs * sizeof *ids);
    if (!ids) return fail(err, cap, "out of memory");
    for (uint32_t i = 0; i < nb; i++) {
        if (hash_of(&hs->via.array.ptr[i], hv)) {
            free(ids);
            return fail(err, cap, "event %zu (BlockStored): hash %u is not an integer or bytes", k,
                        i);
        }
        for (int64_t t = 0; t < bs; t++) {
            const msgpack_object *o = &tk->via.array.ptr[(uint64_t)i * (uint64_t)bs + (uint64_t)t];
            if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER || o->via.u64 > INT32_MAX) {
                free(ids);
                return fail(err, cap, "event %zu (BlockStored): token_ids holds a non token id", k);
            }
            ids[t] = (int32_t)o->via.u64;
        }
        plocal = chain_one(plocal, ids, (int)bs);
        block_store(x, hv[0], plocal, m);
    }
    free(ids);
    return 0;
}

static int apply_removed(kv_index *x, const ev_fields *f, size_t k, char *err, size_t cap) {
    const msgpack_object *hs = f->hashes;
    if (!hs || hs->type != MSGPACK_OBJECT_ARRAY)
        return fail(err, cap, "event %zu (BlockRemoved): block_hashes is not a list", k);
    uint8_t m = medium_bit(f->medium);
    for (uint32_t i = 0; i < hs->via.array.size; i++) {
        uint64_t h;
        if (hash_of(&hs->via.array.ptr[i], &h))
            return fail(err, cap, "event %zu (BlockRemoved): hash %u is not an integer or bytes", k,
                        i);
        x->st.removed++;
        block_remove(x, h, m);
    }
    return 0;
}

static int apply_event(kv_index *x, const msgpack_object *ev, size_t k, char *err, size_t cap) {
    const msgpack_object *tag;
    ev_fields f = {0};
    if (ev->type == MSGPACK_OBJECT_ARRAY && ev->via.array.size > 0) {
        const msgpack_object *a = ev->via.array.ptr;
        uint32_t n = ev->via.array.size;
        tag = &a[0];
        if (str_is(tag, "BlockStored")) {
            /* [tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name] */
            f.hashes = n > 1 ? &a[1] : NULL;
            f.parent = n > 2 ? &a[2] : NULL;
            f.tokens = n > 3 ? &a[3] : NULL;
            f.block_size = n > 4 ? &a[4] : NULL;
            f.medium = n > 6 ? &a[6] : NULL;
        } else if (str_is(tag, "BlockRemoved")) { /* [tag, hashes, medium] */
            f.hashes = n > 1 ? &a[1] : NULL;
            f.medium = n > 2 ? &a[2] : NULL;
        }
    } else if (ev->type == MSGPACK_OBJECT_MAP) {
        tag = map_get(ev, "type");
        if (!tag) return fail(err, cap, "event %zu is a map without \"type\"", k);
        f.hashes = map_get(ev, "block_hashes");
        f.parent = map_get(ev, "parent_block_hash");
        f.tokens = map_get(ev, "token_ids");
        f.block_size = map_get(ev, "block_size");
        f.medium = map_get(ev, "medium");
    } else {
        return fail(err, cap, "event %zu is neither a tagged list nor a map", k);
    }
    if (str_is(tag, "BlockStored")) return apply_stored(x, &f, k, err, cap);
    if (str_is(tag, "BlockRemoved")) return apply_removed(x, &f, k, err, cap);
    if (str_is(tag, "AllBlocksCleared")) {
        kv_index_clear(x);
        x->st.cleared++;
        return 0;
    }
    return 0; /* an event type this proxy does not know: nothing it indexes */
}

int kv_index_apply(kv_index *x, const void *payload, size_t len, char *err, size_t errcap) {
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    int rc;
    if (msgpack_unpack_next(&u, payload, len, &off) != MSGPACK_UNPACK_SUCCESS) {
        rc = fail(err, errcap, "the payload is not msgpack");
        goto out;
    }
    const msgpack_object *b = &u.data;
    if (b->type != MSGPACK_OBJECT_ARRAY || b->via.array.size < 2 ||
        b->via.array.ptr[1].type != MSGPACK_OBJECT_ARRAY) {
        rc = fail(err, errcap, "the payload is not a KVEventBatch [ts, [events...], dp_rank]");
        goto out;
    }
    const msgpack_object *evs = &b->via.array.ptr[1];
    rc = 0;
    for (uint32_t i = 0; i < evs->via.array.size && !rc; i++)
        rc = apply_event(x, &evs->via.array.ptr[i], i, err, errcap);
out:
    msgpack_unpacked_destroy(&u);
    return rc;
}
