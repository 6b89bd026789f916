/*
 * tokenizer_bpe — the vocab and merge hash tables and BPE on one word, as HF
 * tokenizers' models/bpe (model.rs merge_word, word.rs merge_all): symbols
 * start as bytes (byte-level) or characters (SentencePiece style, with
 * byte_fallback and unk), then the lowest-rank merge applies first, leftmost
 * on ties.  ignore_merges takes a word found whole in the vocab as it is.
 * A direct-mapped cache of recent words is the tokenizer's only mutable state.
 */
#include "model/tokenizer_int.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

const uint8_t *tok_match_key(const tokenizer *t, int32_t id, size_t *n) {
    if (t->byte_level) {
        *n = t->tok_len[id];
        return t->arena + t->tok_off[id];
    }
    *n = t->key_len[id];
    return t->keys + t->key_off[id];
}

/* ---- vocab hash ---- */

int32_t tok_vocab_find(const tokenizer *t, const uint8_t *p, size_t n) {
    size_t i = tok_hash_bytes(p, n) & t->vocab_mask;
    for (;;) {
        int32_t id = t->vocab_ht[i];
        if (id < 0) return -1;
        size_t kn;
        const uint8_t *k = tok_match_key(t, id, &kn);
        if (kn == n && memcmp(k, p, n) == 0) return id;
        i = (i + 1) & t->vocab_mask;
    }
}

void tok_vocab_insert(tokenizer *t, int32_t id) {
    size_t n;
    const uint8_t *p = tok_match_key(t, id, &n);
    size_t i = tok_hash_bytes(p, n) & t->vocab_mask;
    while (t->vocab_ht[i] >= 0)
        i = (i + 1) & t->vocab_mask;
    t->vocab_ht[i] = id;
}

/* ---- merge hash ---- */

static bool merge_find(const tokenizer *t, int32_t a, int32_t b, uint32_t *rank, int32_t *nid) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = tok_hash_u64(key) & t->merge_mask;
    for (;;) {
        uint64_t k = t->merges[i].key;
        if (k == UINT64_MAX) return false;
        if (k == key) {
            *rank = t->merges[i].rank;
            *nid = t->merges[i].nid;
            return true;
        }
        i = (i + 1) & t->merge_mask;
    }
}

/* Inserts unless the pair is already there (HF keeps the first rank too). */
void tok_merge_insert(tokenizer *t, int32_t a, int32_t b, uint32_t rank, int32_t nid) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = tok_hash_u64(key) & t->merge_mask;
    while (t->merges[i].key != UINT64_MAX) {
        if (t->merges[i].key == key) return;
        i = (i + 1) & t->merge_mask;
    }
    t->merges[i] = (tok_merge){.key = key, .rank = rank, .nid = nid};
}

/* ======================================================================
 * BPE on one word
 * ====================================================================== */

typedef struct bpe_sym {
    int32_t id;   /* current token */
    int32_t prev; /* index of the left neighbour, -1 none */
    int32_t next; /* index of the right neighbour, -1 none */
    int32_t len;  /* bytes covered; 0 once merged into its left neighbour */
} bpe_sym;

typedef struct bpe_merge {
    uint32_t rank; /* merge priority (lower first) */
    int32_t pos;   /* index of the left symbol */
    int32_t nid;   /* id the pair becomes */
} bpe_merge;

static bool bpe_less(const bpe_merge *a, const bpe_merge *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void bpe_heap_push(bpe_merge *h, size_t *n, bpe_merge m) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!bpe_less(&m, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = m;
}

static bpe_merge bpe_heap_pop(bpe_merge *h, size_t *n) {
    bpe_merge top = h[0];
    bpe_merge last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && bpe_less(&h[c + 1], &h[c])) c++;
        if (!bpe_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

static void bpe_try_pair(const tokenizer *t, const bpe_sym *sy, int32_t pos, bpe_merge *h,
                         size_t *nh) {
    int32_t nx = sy[pos].next;
    if (nx < 0) return;
    bpe_merge m = {.pos = pos};
    if (merge_find(t, sy[pos].id, sy[nx].id, &m.rank, &m.nid)) bpe_heap_push(h, nh, m);
}

static void bpe_sym_add(bpe_sym *sy, int32_t *ns, int32_t id, int32_t len) {
    sy[*ns] = (bpe_sym){.id = id, .prev = *ns - 1, .next = -1, .len = len};
    if (*ns > 0) sy[*ns - 1].next = *ns;
    (*ns)++;
}

/* Byte-level words: one symbol per byte (a byte without a token is dropped,
 * as HF does without an unk token). */
static int32_t bpe_init_bytes(const tokenizer *t, const uint8_t *w, size_t n, bpe_sym *sy) {
    int32_t ns = 0;
    for (size_t i = 0; i < n; i++)
        if (t->byte_id[w[i]] >= 0) bpe_sym_add(sy, &ns, t->byte_id[w[i]], 1);
    return ns;
}

/* Character words (HF BPE::merge_word): one symbol per UTF-8 character found
 * in the vocab; else, with byte_fallback, one <0xXX> symbol per byte when all
 * of them exist; else the unk token (consecutive ones fused when fuse_unk),
 * or nothing without one.  As in HF, a pending unk is only added before the
 * next known character, so byte-fallback symbols may come before it. */
static int32_t bpe_init_chars(const tokenizer *t, const uint8_t *w, size_t n, bpe_sym *sy) {
    int32_t ns = 0, unk_len = 0; /* unk_len > 0: an unk symbol is pending */
    size_t i = 0;
    while (i < n) {
        int l = tok_utf8_step(w + i, n - i);
        if (l <= 0) l = 1; /* not reached: the text is valid UTF-8 */
        int32_t id = tok_vocab_find(t, w + i, (size_t)l);
        if (id >= 0) {
            if (unk_len > 0) bpe_sym_add(sy, &ns, t->unk_id, unk_len);
            unk_len = 0;
            bpe_sym_add(sy, &ns, id, l);
            i += (size_t)l;
            continue;
        }
        bool all = t->byte_fallback;
        for (int k = 0; k < l && all; k++)
            all = t->fallback_id[w[i + k]] >= 0;
        if (all) {
            for (int k = 0; k < l; k++)
                bpe_sym_add(sy, &ns, t->fallback_id[w[i + k]], 1);
        } else if (t->unk_id >= 0) {
            if (unk_len > 0 && !t->fuse_unk) {
                bpe_sym_add(sy, &ns, t->unk_id, unk_len);
                unk_len = 0;
            }
            unk_len += l;
        }
        i += (size_t)l;
    }
    if (unk_len > 0) bpe_sym_add(sy, &ns, t->unk_id, unk_len);
    return ns;
}

static int bpe_word_uncached(const tokenizer *t, const uint8_t *w, size_t n, tok_ids *out) {
    if (t->ignore_merges) {
        int32_t id = tok_vocab_find(t, w, n);
        if (id >= 0) return tok_ids_push(out, id);
    }
    bpe_sym stack_sy[128];
    bpe_merge stack_h[256];
    bpe_sym *sy = n <= 128 ? stack_sy : malloc(n * sizeof(*sy));
    /* each merge adds at most 2 heap entries: n + 2n bounds the heap */
    bpe_merge *h = n <= 80 ? stack_h : malloc(3 * n * sizeof(*h));
    int rc = 0;
    if (!sy || !h) {
        rc = -ENOMEM;
        goto out;
    }
    int32_t ns = t->byte_level ? bpe_init_bytes(t, w, n, sy) : bpe_init_chars(t, w, n, sy);
    size_t nh = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        bpe_try_pair(t, sy, i, h, &nh);
    while (nh > 0) {
        bpe_merge top = bpe_heap_pop(h, &nh);
        bpe_sym *cur = &sy[top.pos];
        if (cur->len == 0 || cur->next < 0) continue;
        int32_t rpos = cur->next;
        uint32_t rank;
        int32_t nid;
        if (!merge_find(t, cur->id, sy[rpos].id, &rank, &nid) || nid != top.nid) continue;
        cur->id = nid;
        cur->len += sy[rpos].len;
        cur->next = sy[rpos].next;
        sy[rpos].len = 0;
        if (cur->next >= 0) sy[cur->next].prev = top.pos;
        if (cur->prev >= 0) bpe_try_pair(t, sy, cur->prev, h, &nh);
        bpe_try_pair(t, sy, top.pos, h, &nh);
    }
    for (int32_t i = 0; i < ns; i++)
        if (sy[i].len > 0 && (rc = tok_ids_push(out, sy[i].id))) break;
out:
    if (sy != stack_sy) free(sy);
    if (h != stack_h) free(h);
    return rc;
}

int tok_bpe_word(const tokenizer *t, const uint8_t *w, size_t n, tok_ids *out) {
    if (n == 0) return 0;
    if (n == 1 && t->byte_id[w[0]] >= 0) return tok_ids_push(out, t->byte_id[w[0]]);
    if (n > TOK_CACHE_MAX_WORD) return bpe_word_uncached(t, w, n, out);
    tokenizer *mt = (tokenizer *)t; /* the cache is the one mutable part */
    tok_cache_slot *slot = &mt->cache[tok_hash_bytes(w, n) & (TOK_CACHE_SLOTS - 1)];
    pthread_mutex_lock(&mt->cache_mu);
    if (slot->key && slot->klen == n && memcmp(slot->key, w, n) == 0) {
        int rc = 0;
        for (uint32_t i = 0; i < slot->n_ids && !rc; i++)
            rc = tok_ids_push(out, slot->ids[i]);
        pthread_mutex_unlock(&mt->cache_mu);
        return rc;
    }
    pthread_mutex_unlock(&mt->cache_mu);
    size_t start = out->n;
    int rc = bpe_word_uncached(t, w, n, out);
    if (rc) return rc;
    size_t k = out->n - start;
    uint8_t *key = malloc(n);
    int32_t *ids = malloc(k * sizeof(int32_t) + 1);
    if (!key || !ids) {
        free(key);
        free(ids);
        return 0; /* the cache is optional */
    }
    memcpy(key, w, n);
    memcpy(ids, out->v + start, k * sizeof(int32_t));
    pthread_mutex_lock(&mt->cache_mu);
    free(slot->key);
    free(slot->ids);
    slot->key = key;
    slot->klen = (uint32_t)n;
    slot->ids = ids;
    slot->n_ids = (uint32_t)k;
    pthread_mutex_unlock(&mt->cache_mu);
    return 0;
}
