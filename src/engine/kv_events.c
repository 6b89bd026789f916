/* kv_events — see kv_events.h. */
#include "engine/kv_events.h"

#include <stdlib.h>
#include <string.h>

const char *kv_events_medium_name(kvev_medium m) {
    switch (m) {
    case KVEV_MEDIUM_CPU:
        return "CPU";
    case KVEV_MEDIUM_DISK:
        return "DISK";
    default:
        return "GPU";
    }
}

static kvev_event *new_event(kvev_log *l, kvev_kind kind, kvev_medium medium) {
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 16;
        kvev_event *ev = realloc(l->ev, (size_t)cap * sizeof *ev);
        if (!ev) {
            l->oom = 1;
            return NULL;
        }
        memset(ev + l->cap, 0, (size_t)(cap - l->cap) * sizeof *ev);
        l->ev = ev;
        l->cap = cap;
    }
    kvev_event *e = &l->ev[l->n++];
    e->kind = kind;
    e->medium = medium;
    e->has_parent = 0;
    e->parent = 0;
    e->n_hashes = e->n_tokens = e->block_size = 0;
    return e;
}

static int push_hash(kvev_log *l, kvev_event *e, uint64_t h) {
    if (e->n_hashes == e->cap_hashes) {
        int cap = e->cap_hashes ? e->cap_hashes * 2 : 8;
        uint64_t *p = realloc(e->hashes, (size_t)cap * sizeof *p);
        if (!p) {
            l->oom = 1;
            return -1;
        }
        e->hashes = p;
        e->cap_hashes = cap;
    }
    e->hashes[e->n_hashes++] = h;
    return 0;
}

static int push_tokens(kvev_log *l, kvev_event *e, const int32_t *t, int n) {
    if (e->n_tokens + n > e->cap_tokens) {
        int cap = e->cap_tokens ? e->cap_tokens : 256;
        while (cap < e->n_tokens + n)
            cap *= 2;
        int32_t *p = realloc(e->tokens, (size_t)cap * sizeof *p);
        if (!p) {
            l->oom = 1;
            return -1;
        }
        e->tokens = p;
        e->cap_tokens = cap;
    }
    memcpy(e->tokens + e->n_tokens, t, (size_t)n * sizeof *t);
    e->n_tokens += n;
    return 0;
}

void kv_events_stored(kvev_log *l, kvev_medium medium, uint64_t parent, uint64_t hash,
                 const int32_t *tokens, int block_size) {
    kvev_event *e = l->n ? &l->ev[l->n - 1] : NULL;
    /* one chain continues the last event: the block's parent is its last block; blocks
     * without tokens (a lower tier's, as vLLM's offloading reports them) join any */
    int join = e && e->kind == KVEV_STORED && e->medium == medium && e->block_size == block_size &&
               (tokens ? parent && e->n_tokens && e->hashes[e->n_hashes - 1] == parent
                       : e->n_tokens == 0);
    if (!join) {
        e = new_event(l, KVEV_STORED, medium);
        if (!e) return;
        e->has_parent = tokens && parent != 0;
        e->parent = e->has_parent ? parent : 0;
        e->block_size = block_size;
    }
    if (push_hash(l, e, hash)) return;
    if (tokens && push_tokens(l, e, tokens, block_size)) e->n_hashes--;
}

void kv_events_removed(kvev_log *l, kvev_medium medium, uint64_t hash) {
    kvev_event *e = l->n ? &l->ev[l->n - 1] : NULL;
    if (!e || e->kind != KVEV_REMOVED || e->medium != medium) {
        e = new_event(l, KVEV_REMOVED, medium);
        if (!e) return;
    }
    push_hash(l, e, hash);
}

void kv_events_cleared(kvev_log *l) {
    new_event(l, KVEV_CLEARED, KVEV_MEDIUM_GPU);
}

void kv_events_reset(kvev_log *l) {
    l->n = 0;
    l->oom = 0;
}

void kv_events_free(kvev_log *l) {
    for (int i = 0; i < l->cap; i++) {
        free(l->ev[i].hashes);
        free(l->ev[i].tokens);
    }
    free(l->ev);
    memset(l, 0, sizeof *l);
}
