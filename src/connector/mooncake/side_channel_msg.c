/* side_channel_msg — see side_channel_msg.h.  Parts: arena, pre-scan of raw
 * msgpack, typed getters over msgpack-c objects, pull, reply. */
#include "connector/mooncake/side_channel_msg.h"

#include "base/err.h"

#include <msgpack.h>
#include <stdarg.h>
#include <stdalign.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena: every decoded pointer of one message, freed at once ---------- */

typedef struct arena_chunk {
    struct arena_chunk *next; /* older chunk */
    size_t used;              /* bytes handed out from data */
    size_t cap;               /* bytes in data */
    alignas(max_align_t) unsigned char data[];
} arena_chunk;

static void *arena_alloc(void **arena, size_t n) {
    n = (n + 15) & ~(size_t)15;
    arena_chunk *c = *arena;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        arena_chunk *nc = malloc(sizeof *nc + cap);
        if (!nc) return NULL;
        nc->next = c;
        nc->used = 0;
        nc->cap = cap;
        *arena = c = nc;
    }
    void *p = c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

static void arena_free(void *arena) {
    arena_chunk *c = arena;
    while (c) {
        arena_chunk *next = c->next;
        free(c);
        c = next;
    }
}

/* ---- pre-scan ------------------------------------------------------------
 * Walks one msgpack object without allocating, so that msgpack-c's unpacker
 * (which allocates a container's elements from its declared count) never sees
 * a count larger than the bytes that could hold it, a nesting deeper than
 * SIDE_CHANNEL_MAX_DEPTH, or more than SCAN_MAX_OBJECTS objects in total. */

#define SCAN_MAX_OBJECTS (2u * SIDE_CHANNEL_MAX_BLOCK_IDS)

typedef struct scan_state {
    const unsigned char *p; /* message bytes */
    size_t len;             /* message length */
    size_t pos;             /* cursor */
    size_t objects;         /* objects seen so far */
    const char *why;        /* first failure */
} scan_state;

static int scan_need(scan_state *s, size_t n) {
    if (s->len - s->pos < n) {
        s->why = "truncated message";
        return -1;
    }
    return 0;
}

static uint64_t scan_be(scan_state *s, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++)
        v = (v << 8) | s->p[s->pos + (size_t)i];
    s->pos += (size_t)bytes;
    return v;
}

static int scan_object(scan_state *s, int depth);

static int scan_container(scan_state *s, uint64_t count, int per, int depth) {
    if (depth >= SIDE_CHANNEL_MAX_DEPTH) {
        s->why = "nesting deeper than the limit";
        return -1;
    }
    /* every element takes at least one byte */
    if (count > (s->len - s->pos) / (uint64_t)per) {
        s->why = "truncated or corrupt: container count larger than the remaining bytes";
        return -1;
    }
    for (uint64_t i = 0; i < count * (uint64_t)per; i++)
        if (scan_object(s, depth + 1)) return -1;
    return 0;
}

static int scan_skip(scan_state *s, uint64_t n) {
    if (scan_need(s, n)) return -1;
    s->pos += n;
    return 0;
}

static int scan_object(scan_state *s, int depth) {
    if (++s->objects > SCAN_MAX_OBJECTS) {
        s->why = "too many objects";
        return -1;
    }
    if (scan_need(s, 1)) return -1;
    unsigned b = s->p[s->pos++];
    if (b <= 0x7f || b >= 0xe0) return 0;                        /* fixint */
    if (b <= 0x8f) return scan_container(s, b & 0x0f, 2, depth); /* fixmap */
    if (b <= 0x9f) return scan_container(s, b & 0x0f, 1, depth); /* fixarray */
    if (b <= 0xbf) return scan_skip(s, b & 0x1f);                /* fixstr */
    switch (b) {
    case 0xc0:
    case 0xc2:
    case 0xc3:
        return 0;
    case 0xc4:
    case 0xd9:
        if (scan_need(s, 1)) return -1;
        return scan_skip(s, scan_be(s, 1));
    case 0xc5:
    case 0xda:
        if (scan_need(s, 2)) return -1;
        return scan_skip(s, scan_be(s, 2));
    case 0xc6:
    case 0xdb:
        if (scan_need(s, 4)) return -1;
        return scan_skip(s, scan_be(s, 4));
    case 0xc7:
        if (scan_need(s, 1)) return -1;
        return scan_skip(s, scan_be(s, 1) + 1);
    case 0xc8:
        if (scan_need(s, 2)) return -1;
        return scan_skip(s, scan_be(s, 2) + 1);
    case 0xc9:
        if (scan_need(s, 4)) return -1;
        return scan_skip(s, scan_be(s, 4) + 1);
    case 0xca:
        return scan_skip(s, 4);
    case 0xcb:
        return scan_skip(s, 8);
    case 0xcc:
    case 0xd0:
        return scan_skip(s, 1);
    case 0xcd:
    case 0xd1:
        return scan_skip(s, 2);
    case 0xce:
    case 0xd2:
        return scan_skip(s, 4);
    case 0xcf:
    case 0xd3:
        return scan_skip(s, 8);
    case 0xd4:
        return scan_skip(s, 2);
    case 0xd5:
        return scan_skip(s, 3);
    case 0xd6:
        return scan_skip(s, 5);
    case 0xd7:
        return scan_skip(s, 9);
    case 0xd8:
        return scan_skip(s, 17);
    case 0xdc:
        if (scan_need(s, 2)) return -1;
        return scan_container(s, scan_be(s, 2), 1, depth);
    case 0xdd:
        if (scan_need(s, 4)) return -1;
        return scan_container(s, scan_be(s, 4), 1, depth);
    case 0xde:
        if (scan_need(s, 2)) return -1;
        return scan_container(s, scan_be(s, 2), 2, depth);
    case 0xdf:
        if (scan_need(s, 4)) return -1;
        return scan_container(s, scan_be(s, 4), 2, depth);
    default:
        s->why = "invalid msgpack type byte 0xc1";
        return -1;
    }
}

/* Pre-scan then unpack exactly one object spanning the whole buffer. */
static int unpack_one(const char *what, const void *buf, size_t len, msgpack_unpacked *u, char *err,
                      size_t cap) {
    if (!buf || len == 0) {
        err_set(err, cap, "side-channel %s: empty message", what);
        return SIDE_CHANNEL_EINVAL;
    }
    if (len > SIDE_CHANNEL_MAX_MSG_BYTES) {
        err_set(err, cap, "side-channel %s: message of %zu bytes exceeds the limit of %u bytes",
                what, len, SIDE_CHANNEL_MAX_MSG_BYTES);
        return SIDE_CHANNEL_EINVAL;
    }
    scan_state s = {.p = buf, .len = len};
    if (scan_object(&s, 0)) {
        err_set(err, cap, "side-channel %s: malformed msgpack at byte %zu of %zu: %s", what, s.pos,
                len, s.why);
        return SIDE_CHANNEL_EINVAL;
    }
    if (s.pos != len) {
        err_set(err, cap, "side-channel %s: %zu trailing bytes after the message", what,
                len - s.pos);
        return SIDE_CHANNEL_EINVAL;
    }
    size_t off = 0;
    msgpack_unpack_return r = msgpack_unpack_next(u, buf, len, &off);
    if (r == MSGPACK_UNPACK_NOMEM_ERROR) {
        err_set(err, cap, "side-channel %s: out of memory unpacking %zu bytes", what, len);
        return SIDE_CHANNEL_ENOMEM;
    }
    if (r != MSGPACK_UNPACK_SUCCESS || off != len) {
        err_set(err, cap, "side-channel %s: msgpack-c rejected the message (code %d)", what,
                (int)r);
        return SIDE_CHANNEL_EINVAL;
    }
    if (u->data.type != MSGPACK_OBJECT_MAP) {
        err_set(err, cap, "side-channel %s: expected a msgpack map keyed by field name", what);
        return SIDE_CHANNEL_EINVAL;
    }
    return 0;
}

/* ---- typed getters ------------------------------------------------------ */

typedef struct dec_ctx {
    const char *what; /* "pull" / "reply" */
    void **arena;     /* owner of the copies */
    char *err;        /* message out */
    size_t cap;
} dec_ctx;

static const char *obj_type_name(const msgpack_object *o) {
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        return "nil";
    case MSGPACK_OBJECT_BOOLEAN:
        return "a boolean";
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        return "an integer";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        return "a float";
    case MSGPACK_OBJECT_STR:
        return "a string";
    case MSGPACK_OBJECT_ARRAY:
        return "an array";
    case MSGPACK_OBJECT_MAP:
        return "a map";
    case MSGPACK_OBJECT_BIN:
        return "binary";
    case MSGPACK_OBJECT_EXT:
        return "an extension";
    }
    return "?";
}

static int bad_type(dec_ctx *c, const char *key, const char *want, const msgpack_object *o) {
    err_set(c->err, c->cap, "side-channel %s: '%s': expected %s, got %s", c->what, key, want,
            obj_type_name(o));
    return SIDE_CHANNEL_EINVAL;
}

static int get_str(dec_ctx *c, const char *key, const msgpack_object *o, char **out) {
    if (o->type != MSGPACK_OBJECT_STR) return bad_type(c, key, "a string", o);
    uint32_t n = o->via.str.size;
    if (n > SIDE_CHANNEL_MAX_STR) {
        err_set(c->err, c->cap, "side-channel %s: '%s': string of %u bytes exceeds %u", c->what,
                key, n, SIDE_CHANNEL_MAX_STR);
        return SIDE_CHANNEL_EINVAL;
    }
    if (n && memchr(o->via.str.ptr, '\0', n)) {
        err_set(c->err, c->cap, "side-channel %s: '%s': string contains a NUL byte", c->what, key);
        return SIDE_CHANNEL_EINVAL;
    }
    char *s = arena_alloc(c->arena, (size_t)n + 1);
    if (!s) return SIDE_CHANNEL_ENOMEM;
    if (n) memcpy(s, o->via.str.ptr, n);
    *out = s;
    return 0;
}

static int get_i64(dec_ctx *c, const char *key, const msgpack_object *o, int64_t *out) {
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > (uint64_t)INT64_MAX) {
            err_set(c->err, c->cap, "side-channel %s: '%s': integer %llu out of range", c->what,
                    key, (unsigned long long)o->via.u64);
            return SIDE_CHANNEL_EINVAL;
        }
        *out = (int64_t)o->via.u64;
        return 0;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *out = o->via.i64;
        return 0;
    }
    return bad_type(c, key, "an integer", o);
}

static int get_i64_range(dec_ctx *c, const char *key, const msgpack_object *o, int64_t lo,
                         int64_t hi, int64_t *out) {
    int rc = get_i64(c, key, o, out);
    if (rc) return rc;
    if (*out < lo || *out > hi) {
        err_set(c->err, c->cap, "side-channel %s: '%s': %lld is out of range %lld..%lld", c->what,
                key, (long long)*out, (long long)lo, (long long)hi);
        return SIDE_CHANNEL_EINVAL;
    }
    return 0;
}

static int get_array(dec_ctx *c, const char *key, const msgpack_object *o, size_t max,
                     const msgpack_object_array **out) {
    if (o->type != MSGPACK_OBJECT_ARRAY) return bad_type(c, key, "an array", o);
    if (o->via.array.size > max) {
        err_set(c->err, c->cap, "side-channel %s: '%s': %u elements exceed the limit of %zu",
                c->what, key, o->via.array.size, max);
        return SIDE_CHANNEL_EINVAL;
    }
    *out = &o->via.array;
    return 0;
}

static int get_i64_list(dec_ctx *c, const char *key, const msgpack_object *o, size_t max,
                        int64_t lo, int64_t **out, size_t *n) {
    const msgpack_object_array *a = NULL;
    int rc = get_array(c, key, o, max, &a);
    if (rc) return rc;
    int64_t *v = arena_alloc(c->arena, (a->size ? a->size : 1) * sizeof *v);
    if (!v) return SIDE_CHANNEL_ENOMEM;
    for (uint32_t i = 0; i < a->size; i++)
        if ((rc = get_i64_range(c, key, &a->ptr[i], lo, INT64_MAX, &v[i]))) return rc;
    *out = v;
    *n = a->size;
    return 0;
}

static int get_u64_list(dec_ctx *c, const char *key, const msgpack_object *o, size_t max,
                        uint64_t **out, size_t *n) {
    const msgpack_object_array *a = NULL;
    int rc = get_array(c, key, o, max, &a);
    if (rc) return rc;
    uint64_t *v = arena_alloc(c->arena, (a->size ? a->size : 1) * sizeof *v);
    if (!v) return SIDE_CHANNEL_ENOMEM;
    for (uint32_t i = 0; i < a->size; i++) {
        if (a->ptr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return bad_type(c, key, "a list of unsigned 64-bit integers", &a->ptr[i]);
        v[i] = a->ptr[i].via.u64;
    }
    *out = v;
    *n = a->size;
    return 0;
}

/* list[str]; nil accepted (as empty) only when nil_ok. */
static int get_str_list(dec_ctx *c, const char *key, const msgpack_object *o, size_t max,
                        int nil_ok, char ***out, size_t *n) {
    if (nil_ok && o->type == MSGPACK_OBJECT_NIL) {
        *out = NULL;
        *n = 0;
        return 0;
    }
    const msgpack_object_array *a = NULL;
    int rc = get_array(c, key, o, max, &a);
    if (rc) return rc;
    char **v = arena_alloc(c->arena, (a->size ? a->size : 1) * sizeof *v);
    if (!v) return SIDE_CHANNEL_ENOMEM;
    for (uint32_t i = 0; i < a->size; i++)
        if ((rc = get_str(c, key, &a->ptr[i], &v[i]))) return rc;
    *out = v;
    *n = a->size;
    return 0;
}

/* Index of the key in names[] for a str key, -1 for an unknown (or non-str) key. */
static int key_index(const msgpack_object *k, const char *const *names, int n) {
    if (k->type != MSGPACK_OBJECT_STR) return -1;
    for (int i = 0; i < n; i++)
        if (strlen(names[i]) == k->via.str.size &&
            memcmp(names[i], k->via.str.ptr, k->via.str.size) == 0)
            return i;
    return -1;
}

/* Look the known keys up once: found[i] = value or NULL; duplicates rejected. */
static int index_map(dec_ctx *c, const msgpack_object_map *m, const char *const *names, int n,
                     const msgpack_object **found) {
    for (int i = 0; i < n; i++)
        found[i] = NULL;
    for (uint32_t j = 0; j < m->size; j++) {
        int i = key_index(&m->ptr[j].key, names, n);
        if (i < 0) continue; /* unknown keys are ignored, as msgspec does */
        if (found[i]) {
            err_set(c->err, c->cap, "side-channel %s: key '%s' appears twice", c->what, names[i]);
            return SIDE_CHANNEL_EINVAL;
        }
        found[i] = &m->ptr[j].val;
    }
    return 0;
}

static int missing(dec_ctx *c, const char *key) {
    err_set(c->err, c->cap, "side-channel %s: missing required key '%s'", c->what, key);
    return SIDE_CHANNEL_EINVAL;
}

/* ---- pull ---------------------------------------------------------------- */

enum {
    P_HOST,
    P_PORT,
    P_TP_SIZE,
    P_TP_RANK,
    P_REQ_BLOCKS,
    P_BASE_ADDR,
    P_BLOCK_LENS,
    P_KV_BLOCK_LENS,
    P_LAYER_NAMES,
    P_LAYER_INDICES,
    P_GROUP_INDICES,
    P_PP_SIZE,
    P_LAYOUT,
    P_LAYERWISE,
    P_POOL_TOKENS,
    P_NKEYS
};
static const char *const PULL_KEYS[P_NKEYS] = {"remote_hostname",
                                               "remote_port",
                                               "remote_tp_size",
                                               "remote_tp_rank",
                                               "req_blocks",
                                               "kv_caches_base_addr",
                                               "block_lens",
                                               "kv_block_lens",
                                               "registered_layer_names",
                                               "registered_layer_indices",
                                               "registered_group_indices",
                                               "remote_pp_size",
                                               SIDE_CHANNEL_LAYOUT_KEY,
                                               SIDE_CHANNEL_LAYERWISE_KEY,
                                               SIDE_CHANNEL_POOL_TOKENS_KEY};

/* One req_blocks entry: [transfer_id, [[ids], ...]].  A flat [ids] (older vLLM,
 * one KV group) is accepted as one group. */
static int decode_req(dec_ctx *c, const msgpack_object_kv *kv, side_channel_req_blocks *r,
                      size_t *ids_total) {
    int rc;
    if ((rc = get_str(c, "req_blocks key", &kv->key, &r->req_id))) return rc;
    const msgpack_object_array *t = NULL;
    if ((rc = get_array(c, "req_blocks value", &kv->val, 2, &t))) return rc;
    if (t->size != 2) {
        err_set(c->err, c->cap,
                "side-channel pull: req_blocks['%s']: expected [transfer_id, [[block ids], "
                "...]], got %u elements",
                r->req_id, t->size);
        return SIDE_CHANNEL_EINVAL;
    }
    if ((rc = get_str(c, "req_blocks transfer_id", &t->ptr[0], &r->transfer_id))) return rc;
    const msgpack_object_array *g = NULL;
    if ((rc = get_array(c, "req_blocks block ids", &t->ptr[1], SIDE_CHANNEL_MAX_BLOCK_IDS, &g)))
        return rc;
    int flat = g->size > 0 && g->ptr[0].type != MSGPACK_OBJECT_ARRAY;
    size_t n_groups = flat ? 1 : g->size;
    if (n_groups > SIDE_CHANNEL_MAX_GROUPS) {
        err_set(c->err, c->cap,
                "side-channel pull: req_blocks['%s']: %zu KV groups exceed the limit of %d",
                r->req_id, n_groups, SIDE_CHANNEL_MAX_GROUPS);
        return SIDE_CHANNEL_EINVAL;
    }
    r->n_groups = n_groups;
    r->groups = arena_alloc(c->arena, (n_groups ? n_groups : 1) * sizeof *r->groups);
    if (!r->groups) return SIDE_CHANNEL_ENOMEM;
    for (size_t i = 0; i < n_groups; i++) {
        const msgpack_object *ids = flat ? &t->ptr[1] : &g->ptr[i];
        if ((rc = get_i64_list(c, "req_blocks block ids", ids, SIDE_CHANNEL_MAX_BLOCK_IDS, 0,
                               &r->groups[i].ids, &r->groups[i].n)))
            return rc;
        *ids_total += r->groups[i].n;
        if (*ids_total > SIDE_CHANNEL_MAX_BLOCK_IDS) {
            err_set(c->err, c->cap, "side-channel pull: more than %u block ids in one pull",
                    SIDE_CHANNEL_MAX_BLOCK_IDS);
            return SIDE_CHANNEL_EINVAL;
        }
    }
    return 0;
}

static int cmp_req_id(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Request ids are map keys: msgspec builds a dict, so a repeated one is an error. */
static int check_unique_reqs(dec_ctx *c, const side_channel_pull *p) {
    if (p->n_reqs < 2) return 0;
    char **ids = malloc(p->n_reqs * sizeof *ids);
    if (!ids) return SIDE_CHANNEL_ENOMEM;
    for (size_t i = 0; i < p->n_reqs; i++)
        ids[i] = p->reqs[i].req_id;
    qsort(ids, p->n_reqs, sizeof *ids, cmp_req_id);
    int rc = 0;
    for (size_t i = 1; i < p->n_reqs && !rc; i++)
        if (strcmp(ids[i - 1], ids[i]) == 0) {
            err_set(c->err, c->cap, "side-channel pull: req_blocks: request id '%s' twice", ids[i]);
            rc = SIDE_CHANNEL_EINVAL;
        }
    free(ids);
    return rc;
}

static int decode_pull(dec_ctx *c, const msgpack_object_map *m, side_channel_pull *p) {
    const msgpack_object *f[P_NKEYS];
    int rc = index_map(c, m, PULL_KEYS, P_NKEYS, f);
    if (rc) return rc;
    for (int i = P_HOST; i <= P_KV_BLOCK_LENS; i++)
        if (!f[i]) return missing(c, PULL_KEYS[i]);
    if ((rc = get_str(c, PULL_KEYS[P_HOST], f[P_HOST], &p->remote_hostname))) return rc;
    if ((rc = get_i64_range(c, PULL_KEYS[P_PORT], f[P_PORT], 1, 65535, &p->remote_port))) return rc;
    if ((rc = get_i64_range(c, PULL_KEYS[P_TP_SIZE], f[P_TP_SIZE], 1, 65536, &p->remote_tp_size)))
        return rc;
    if ((rc = get_i64_range(c, PULL_KEYS[P_TP_RANK], f[P_TP_RANK], 0, p->remote_tp_size - 1,
                            &p->remote_tp_rank)))
        return rc;
    /* req_blocks */
    if (f[P_REQ_BLOCKS]->type != MSGPACK_OBJECT_MAP)
        return bad_type(c, "req_blocks", "a map of request id -> [transfer_id, block ids]",
                        f[P_REQ_BLOCKS]);
    const msgpack_object_map *rb = &f[P_REQ_BLOCKS]->via.map;
    if (rb->size > SIDE_CHANNEL_MAX_REQS) {
        err_set(c->err, c->cap, "side-channel pull: %u requests exceed the limit of %d", rb->size,
                SIDE_CHANNEL_MAX_REQS);
        return SIDE_CHANNEL_EINVAL;
    }
    p->n_reqs = rb->size;
    p->reqs = arena_alloc(c->arena, (rb->size ? rb->size : 1) * sizeof *p->reqs);
    if (!p->reqs) return SIDE_CHANNEL_ENOMEM;
    size_t ids_total = 0;
    for (uint32_t i = 0; i < rb->size; i++)
        if ((rc = decode_req(c, &rb->ptr[i], &p->reqs[i], &ids_total))) return rc;
    if ((rc = check_unique_reqs(c, p))) return rc;
    /* regions */
    size_t n_lens = 0, n_kv = 0;
    if ((rc = get_u64_list(c, PULL_KEYS[P_BASE_ADDR], f[P_BASE_ADDR], SIDE_CHANNEL_MAX_REGIONS,
                           &p->kv_caches_base_addr, &p->n_regions)))
        return rc;
    if ((rc = get_i64_list(c, PULL_KEYS[P_BLOCK_LENS], f[P_BLOCK_LENS], SIDE_CHANNEL_MAX_REGIONS, 0,
                           &p->block_lens, &n_lens)))
        return rc;
    if ((rc = get_i64_list(c, PULL_KEYS[P_KV_BLOCK_LENS], f[P_KV_BLOCK_LENS],
                           SIDE_CHANNEL_MAX_REGIONS, 0, &p->kv_block_lens, &n_kv)))
        return rc;
    if (n_lens != p->n_regions || n_kv != p->n_regions) {
        err_set(c->err, c->cap,
                "side-channel pull: kv_caches_base_addr, block_lens and kv_block_lens must have "
                "the same length, got %zu, %zu and %zu",
                p->n_regions, n_lens, n_kv);
        return SIDE_CHANNEL_EINVAL;
    }
    for (size_t i = 0; i < p->n_regions; i++)
        if (p->kv_block_lens[i] > p->block_lens[i]) {
            err_set(c->err, c->cap,
                    "side-channel pull: region %zu: kv_block_len %lld exceeds block_len %lld", i,
                    (long long)p->kv_block_lens[i], (long long)p->block_lens[i]);
            return SIDE_CHANNEL_EINVAL;
        }
    /* optional */
    if (f[P_LAYER_NAMES] &&
        (rc = get_str_list(c, PULL_KEYS[P_LAYER_NAMES], f[P_LAYER_NAMES], SIDE_CHANNEL_MAX_REGIONS,
                           0, &p->registered_layer_names, &p->n_layer_names)))
        return rc;
    if (f[P_LAYER_INDICES] &&
        (rc = get_i64_list(c, PULL_KEYS[P_LAYER_INDICES], f[P_LAYER_INDICES],
                           SIDE_CHANNEL_MAX_REGIONS, INT64_MIN, &p->registered_layer_indices,
                           &p->n_layer_indices)))
        return rc;
    if (f[P_GROUP_INDICES] &&
        (rc = get_i64_list(c, PULL_KEYS[P_GROUP_INDICES], f[P_GROUP_INDICES],
                           SIDE_CHANNEL_MAX_REGIONS, INT64_MIN, &p->registered_group_indices,
                           &p->n_group_indices)))
        return rc;
    p->remote_pp_size = 1;
    if (f[P_PP_SIZE] &&
        (rc = get_i64_range(c, PULL_KEYS[P_PP_SIZE], f[P_PP_SIZE], 1, 65536, &p->remote_pp_size)))
        return rc;
    if (f[P_LAYOUT] && f[P_LAYOUT]->type != MSGPACK_OBJECT_NIL &&
        (rc = get_str(c, PULL_KEYS[P_LAYOUT], f[P_LAYOUT], &p->layout)))
        return rc;
    /* an extension never fails a pull: only true asks for streaming */
    p->layerwise = f[P_LAYERWISE] && f[P_LAYERWISE]->type == MSGPACK_OBJECT_BOOLEAN &&
                   f[P_LAYERWISE]->via.boolean;
    if (f[P_POOL_TOKENS] &&
        (rc = get_i64_list(c, PULL_KEYS[P_POOL_TOKENS], f[P_POOL_TOKENS],
                           SIDE_CHANNEL_MAX_POOL_TOKENS, 0, &p->pool_tokens, &p->n_pool_tokens)))
        return rc;
    if (p->n_pool_tokens && p->n_reqs != 1) {
        err_set(c->err, c->cap,
                "side-channel pull: %s names the prefix of one request; the pull has %zu",
                SIDE_CHANNEL_POOL_TOKENS_KEY, p->n_reqs);
        return SIDE_CHANNEL_EINVAL;
    }
    return 0;
}

int side_channel_pull_decode(const void *buf, size_t len, side_channel_pull *out, char *err,
                             size_t err_cap) {
    memset(out, 0, sizeof *out);
    if (err && err_cap) err[0] = '\0';
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    int rc = unpack_one("pull", buf, len, &u, err, err_cap);
    if (rc == 0) {
        dec_ctx c = {.what = "pull", .arena = &out->arena, .err = err, .cap = err_cap};
        rc = decode_pull(&c, &u.data.via.map, out);
        if (rc == SIDE_CHANNEL_ENOMEM) err_set(err, err_cap, "side-channel pull: out of memory");
    }
    msgpack_unpacked_destroy(&u);
    if (rc) side_channel_pull_free(out);
    return rc;
}

void side_channel_pull_free(side_channel_pull *p) {
    if (!p) return;
    arena_free(p->arena);
    memset(p, 0, sizeof *p);
}

/* ---- reply --------------------------------------------------------------- */

enum { R_STATUS, R_OK, R_ERR, R_MSG, R_FT, R_UNK, R_LW, R_NKEYS };
static const char *const REPLY_KEYS[R_NKEYS] = {"status",
                                                "ok_reqs",
                                                "err_reqs",
                                                "err_msg",
                                                SIDE_CHANNEL_FIRST_TOKENS_KEY,
                                                SIDE_CHANNEL_UNKNOWN_KEY,
                                                SIDE_CHANNEL_LAYERWISE_KEY};

/* "disagg_unknown_reqs" / "disagg_layerwise": ["<req id>", ...]; anything else is dropped
 * (an extension must never fail a pull). */
static int get_req_list(dec_ctx *c, const msgpack_object *o, char ***list, size_t *n_list) {
    if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size == 0) return 0;
    size_t n = o->via.array.size;
    if (n > SIDE_CHANNEL_MAX_REQS) return 0;
    *list = arena_alloc(c->arena, n * sizeof **list);
    if (!*list) return SIDE_CHANNEL_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        const msgpack_object *e = &o->via.array.ptr[i];
        if (e->type != MSGPACK_OBJECT_STR || e->via.str.size == 0 ||
            e->via.str.size > SIDE_CHANNEL_MAX_STR)
            continue;
        char *id = arena_alloc(c->arena, e->via.str.size + 1);
        if (!id) return SIDE_CHANNEL_ENOMEM;
        memcpy(id, e->via.str.ptr, e->via.str.size);
        (*list)[(*n_list)++] = id;
    }
    return 0;
}

/* "disagg_first_tokens": {"<req id>": [token]}; entries of another shape are
 * dropped (an extension must never fail a pull: D then recomputes the token). */
static int get_first_tokens(dec_ctx *c, const msgpack_object *o, side_channel_reply *out) {
    if (o->type != MSGPACK_OBJECT_MAP || o->via.map.size == 0) return 0;
    size_t n = o->via.map.size;
    if (n > SIDE_CHANNEL_MAX_REQS) return 0;
    out->ft_reqs = arena_alloc(c->arena, n * sizeof *out->ft_reqs);
    out->ft_tokens = arena_alloc(c->arena, n * sizeof *out->ft_tokens);
    if (!out->ft_reqs || !out->ft_tokens) return SIDE_CHANNEL_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        const msgpack_object_kv *kv = &o->via.map.ptr[i];
        if (kv->key.type != MSGPACK_OBJECT_STR || kv->key.via.str.size == 0 ||
            kv->key.via.str.size > SIDE_CHANNEL_MAX_STR || kv->val.type != MSGPACK_OBJECT_ARRAY ||
            kv->val.via.array.size != 1 ||
            kv->val.via.array.ptr[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
            kv->val.via.array.ptr[0].via.u64 > INT32_MAX)
            continue;
        char *id = arena_alloc(c->arena, kv->key.via.str.size + 1);
        if (!id) return SIDE_CHANNEL_ENOMEM;
        memcpy(id, kv->key.via.str.ptr, kv->key.via.str.size);
        out->ft_reqs[out->n_ft] = id;
        out->ft_tokens[out->n_ft++] = (int32_t)kv->val.via.array.ptr[0].via.u64;
    }
    return 0;
}

int side_channel_reply_decode(const void *buf, size_t len, side_channel_reply *out, char *err,
                              size_t err_cap) {
    memset(out, 0, sizeof *out);
    if (err && err_cap) err[0] = '\0';
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    int rc = unpack_one("reply", buf, len, &u, err, err_cap);
    if (rc == 0) {
        dec_ctx c = {.what = "reply", .arena = &out->arena, .err = err, .cap = err_cap};
        const msgpack_object *f[R_NKEYS];
        int64_t st = 0;
        rc = index_map(&c, &u.data.via.map, REPLY_KEYS, R_NKEYS, f);
        if (rc == 0 && !f[R_STATUS]) rc = missing(&c, "status");
        if (rc == 0) rc = get_i64_range(&c, "status", f[R_STATUS], 0, 2, &st);
        out->status = (side_channel_status)st;
        if (rc == 0 && f[R_OK])
            rc = get_str_list(&c, "ok_reqs", f[R_OK], SIDE_CHANNEL_MAX_REQS, 1, &out->ok_reqs,
                              &out->n_ok);
        if (rc == 0 && f[R_ERR])
            rc = get_str_list(&c, "err_reqs", f[R_ERR], SIDE_CHANNEL_MAX_REQS, 1, &out->err_reqs,
                              &out->n_err);
        if (rc == 0 && f[R_MSG] && f[R_MSG]->type != MSGPACK_OBJECT_NIL)
            rc = get_str(&c, "err_msg", f[R_MSG], &out->err_msg);
        if (rc == 0 && f[R_FT]) rc = get_first_tokens(&c, f[R_FT], out);
        if (rc == 0 && f[R_UNK])
            rc = get_req_list(&c, f[R_UNK], &out->unknown_reqs, &out->n_unknown);
        if (rc == 0 && f[R_LW]) rc = get_req_list(&c, f[R_LW], &out->lw_reqs, &out->n_lw);
        if (rc == SIDE_CHANNEL_ENOMEM) err_set(err, err_cap, "side-channel reply: out of memory");
    }
    msgpack_unpacked_destroy(&u);
    if (rc) side_channel_reply_free(out);
    return rc;
}

void side_channel_reply_free(side_channel_reply *r) {
    if (!r) return;
    arena_free(r->arena);
    memset(r, 0, sizeof *r);
}

const char *side_channel_status_name(side_channel_status s) {
    switch (s) {
    case SIDE_CHANNEL_FINISH:
        return "FINISH";
    case SIDE_CHANNEL_CONTINUE:
        return "CONTINUE";
    case SIDE_CHANNEL_ERROR:
        return "ERROR";
    }
    return "?";
}

/* ---- encoding ------------------------------------------------------------ */

static int pack_cstr(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    int rc = msgpack_pack_str(pk, n);
    return rc ? rc : msgpack_pack_str_body(pk, s, n);
}

static int pack_i64s(msgpack_packer *pk, const int64_t *v, size_t n) {
    int rc = msgpack_pack_array(pk, n);
    for (size_t i = 0; i < n && !rc; i++)
        rc = msgpack_pack_int64(pk, v[i]);
    return rc;
}

static int pack_strs(msgpack_packer *pk, char *const *v, size_t n) {
    int rc = msgpack_pack_array(pk, n);
    for (size_t i = 0; i < n && !rc; i++)
        rc = pack_cstr(pk, v[i] ? v[i] : "");
    return rc;
}

static int finish(msgpack_sbuffer *sb, int rc, char **out, size_t *out_len) {
    if (rc) {
        msgpack_sbuffer_destroy(sb);
        return SIDE_CHANNEL_ENOMEM;
    }
    *out_len = sb->size;
    *out = msgpack_sbuffer_release(sb);
    return 0;
}

int side_channel_pull_encode(const side_channel_pull *p, char **out, size_t *out_len) {
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    int has_names = p->n_layer_names > 0, has_li = p->n_layer_indices > 0,
        has_gi = p->n_group_indices > 0, has_pp = p->remote_pp_size != 1 && p->remote_pp_size != 0,
        has_layout = p->layout != NULL, has_lw = p->layerwise != 0, has_pool = p->n_pool_tokens > 0;
    size_t nkeys =
        8 + (size_t)(has_names + has_li + has_gi + has_pp + has_layout + has_lw + has_pool);
    int rc = msgpack_pack_map(&pk, nkeys);
    rc = rc ? rc : pack_cstr(&pk, "remote_hostname");
    rc = rc ? rc : pack_cstr(&pk, p->remote_hostname ? p->remote_hostname : "");
    rc = rc ? rc : pack_cstr(&pk, "remote_port");
    rc = rc ? rc : msgpack_pack_int64(&pk, p->remote_port);
    rc = rc ? rc : pack_cstr(&pk, "remote_tp_size");
    rc = rc ? rc : msgpack_pack_int64(&pk, p->remote_tp_size);
    rc = rc ? rc : pack_cstr(&pk, "remote_tp_rank");
    rc = rc ? rc : msgpack_pack_int64(&pk, p->remote_tp_rank);
    rc = rc ? rc : pack_cstr(&pk, "req_blocks");
    rc = rc ? rc : msgpack_pack_map(&pk, p->n_reqs);
    for (size_t i = 0; i < p->n_reqs && !rc; i++) {
        const side_channel_req_blocks *r = &p->reqs[i];
        rc = pack_cstr(&pk, r->req_id);
        rc = rc ? rc : msgpack_pack_array(&pk, 2);
        rc = rc ? rc : pack_cstr(&pk, r->transfer_id ? r->transfer_id : "");
        rc = rc ? rc : msgpack_pack_array(&pk, r->n_groups);
        for (size_t g = 0; g < r->n_groups && !rc; g++)
            rc = pack_i64s(&pk, r->groups[g].ids, r->groups[g].n);
    }
    rc = rc ? rc : pack_cstr(&pk, "kv_caches_base_addr");
    rc = rc ? rc : msgpack_pack_array(&pk, p->n_regions);
    for (size_t i = 0; i < p->n_regions && !rc; i++)
        rc = msgpack_pack_uint64(&pk, p->kv_caches_base_addr[i]);
    rc = rc ? rc : pack_cstr(&pk, "block_lens");
    rc = rc ? rc : pack_i64s(&pk, p->block_lens, p->n_regions);
    rc = rc ? rc : pack_cstr(&pk, "kv_block_lens");
    rc = rc ? rc : pack_i64s(&pk, p->kv_block_lens, p->n_regions);
    if (has_names) {
        rc = rc ? rc : pack_cstr(&pk, "registered_layer_names");
        rc = rc ? rc : pack_strs(&pk, p->registered_layer_names, p->n_layer_names);
    }
    if (has_li) {
        rc = rc ? rc : pack_cstr(&pk, "registered_layer_indices");
        rc = rc ? rc : pack_i64s(&pk, p->registered_layer_indices, p->n_layer_indices);
    }
    if (has_gi) {
        rc = rc ? rc : pack_cstr(&pk, "registered_group_indices");
        rc = rc ? rc : pack_i64s(&pk, p->registered_group_indices, p->n_group_indices);
    }
    if (has_pp) {
        rc = rc ? rc : pack_cstr(&pk, "remote_pp_size");
        rc = rc ? rc : msgpack_pack_int64(&pk, p->remote_pp_size);
    }
    if (has_layout) {
        rc = rc ? rc : pack_cstr(&pk, SIDE_CHANNEL_LAYOUT_KEY);
        rc = rc ? rc : pack_cstr(&pk, p->layout);
    }
    if (has_lw) {
        rc = rc ? rc : pack_cstr(&pk, SIDE_CHANNEL_LAYERWISE_KEY);
        rc = rc ? rc : msgpack_pack_true(&pk);
    }
    if (has_pool) {
        rc = rc ? rc : pack_cstr(&pk, SIDE_CHANNEL_POOL_TOKENS_KEY);
        rc = rc ? rc : pack_i64s(&pk, p->pool_tokens, p->n_pool_tokens);
    }
    return finish(&sb, rc, out, out_len);
}

int side_channel_reply_encode(const side_channel_reply *r, char **out, size_t *out_len) {
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    size_t nkeys = 1 + (r->n_ok > 0) + (r->n_err > 0) + (r->err_msg != NULL) + (r->n_ft > 0) +
                   (r->n_unknown > 0) + (r->n_lw > 0);
    int rc = msgpack_pack_map(&pk, nkeys);
    rc = rc ? rc : pack_cstr(&pk, "status");
    rc = rc ? rc : msgpack_pack_int(&pk, (int)r->status);
    if (r->n_ok) {
        rc = rc ? rc : pack_cstr(&pk, "ok_reqs");
        rc = rc ? rc : pack_strs(&pk, r->ok_reqs, r->n_ok);
    }
    if (r->n_err) {
        rc = rc ? rc : pack_cstr(&pk, "err_reqs");
        rc = rc ? rc : pack_strs(&pk, r->err_reqs, r->n_err);
    }
    if (r->err_msg) {
        rc = rc ? rc : pack_cstr(&pk, "err_msg");
        rc = rc ? rc : pack_cstr(&pk, r->err_msg);
    }
    if (r->n_ft) {
        rc = rc ? rc : pack_cstr(&pk, SIDE_CHANNEL_FIRST_TOKENS_KEY);
        rc = rc ? rc : msgpack_pack_map(&pk, r->n_ft);
        for (size_t i = 0; i < r->n_ft && !rc; i++) {
            rc = pack_cstr(&pk, r->ft_reqs[i] ? r->ft_reqs[i] : "");
            rc = rc ? rc : msgpack_pack_array(&pk, 1);
            rc = rc ? rc : msgpack_pack_int64(&pk, r->ft_tokens[i]);
        }
    }
    if (r->n_unknown) {
        rc = rc ? rc : pack_cstr(&pk, SIDE_CHANNEL_UNKNOWN_KEY);
        rc = rc ? rc : pack_strs(&pk, r->unknown_reqs, r->n_unknown);
    }
    if (r->n_lw) {
        rc = rc ? rc : pack_cstr(&pk, SIDE_CHANNEL_LAYERWISE_KEY);
        rc = rc ? rc : pack_strs(&pk, r->lw_reqs, r->n_lw);
    }
    return finish(&sb, rc, out, out_len);
}

/* ---- cancel -------------------------------------------------------------- */

int side_channel_cancel_encode(const side_channel_cancel *c, char **out, size_t *out_len) {
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    int rc = msgpack_pack_map(&pk, 1);
    rc = rc ? rc : pack_cstr(&pk, SIDE_CHANNEL_CANCEL_KEY);
    rc = rc ? rc : msgpack_pack_map(&pk, c->n);
    for (size_t i = 0; i < c->n && !rc; i++) {
        rc = pack_cstr(&pk, c->req_ids[i] ? c->req_ids[i] : "");
        rc = rc ? rc : pack_cstr(&pk, c->transfer_ids[i] ? c->transfer_ids[i] : "");
    }
    return finish(&sb, rc, out, out_len);
}

int side_channel_cancel_decode(const void *buf, size_t len, side_channel_cancel *out, char *err,
                               size_t err_cap) {
    static const char *const KEYS[1] = {SIDE_CHANNEL_CANCEL_KEY};
    memset(out, 0, sizeof *out);
    if (err && err_cap) err[0] = '\0';
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    int rc = unpack_one("cancel", buf, len, &u, err, err_cap);
    if (rc == 0) {
        dec_ctx c = {.what = "cancel", .arena = &out->arena, .err = err, .cap = err_cap};
        const msgpack_object *f[1];
        rc = index_map(&c, &u.data.via.map, KEYS, 1, f);
        if (rc == 0 && !f[0]) rc = 1; /* not a cancel */
        if (rc == 0 && f[0]->type != MSGPACK_OBJECT_MAP)
            rc = bad_type(&c, SIDE_CHANNEL_CANCEL_KEY, "a map of req_id to transfer_id", f[0]);
        if (rc == 0 && f[0]->via.map.size > SIDE_CHANNEL_MAX_REQS) {
            err_set(err, err_cap, "side-channel cancel: %u requests exceed the limit of %u",
                    f[0]->via.map.size, SIDE_CHANNEL_MAX_REQS);
            rc = SIDE_CHANNEL_EINVAL;
        }
        if (rc == 0) {
            const msgpack_object_map *m = &f[0]->via.map;
            size_t n = m->size ? m->size : 1;
            out->req_ids = arena_alloc(&out->arena, n * sizeof *out->req_ids);
            out->transfer_ids = arena_alloc(&out->arena, n * sizeof *out->transfer_ids);
            if (!out->req_ids || !out->transfer_ids) rc = SIDE_CHANNEL_ENOMEM;
            for (uint32_t i = 0; rc == 0 && i < m->size; i++) {
                rc = get_str(&c, "req_id", &m->ptr[i].key, &out->req_ids[i]);
                if (rc == 0) rc = get_str(&c, "transfer_id", &m->ptr[i].val, &out->transfer_ids[i]);
                if (rc == 0) out->n++;
            }
        }
        if (rc == SIDE_CHANNEL_ENOMEM) err_set(err, err_cap, "side-channel cancel: out of memory");
    }
    msgpack_unpacked_destroy(&u);
    if (rc) side_channel_cancel_free(out);
    return rc;
}

void side_channel_cancel_free(side_channel_cancel *c) {
    if (!c) return;
    arena_free(c->arena);
    memset(c, 0, sizeof *c);
}
