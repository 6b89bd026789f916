/* scheduler — see scheduler.h. */
#include "engine/scheduler.h"

#include "base/clock.h"

#include <stdlib.h>
#include <string.h>

int sched_init(scheduler *s, const sched_config *cfg, block_pool *bp) {
    memset(s, 0, sizeof *s);
    if (cfg->block_size <= 0 || cfg->max_num_seqs <= 0 || cfg->max_num_batched_tokens <= 0)
        return -1;
    s->cfg = *cfg;
    s->bp = bp;
    return 0;
}

void sched_free(scheduler *s) {
    free(s->kinds);
    memset(s, 0, sizeof *s);
}

int sched_plan_init(sched_plan *p, const sched_config *cfg) {
    memset(p, 0, sizeof *p);
    p->items = calloc((size_t)cfg->max_num_seqs, sizeof *p->items);
    p->preempted = calloc((size_t)cfg->max_num_seqs + 1, sizeof *p->preempted);
    return p->items && p->preempted ? 0 : -1;
}

void sched_plan_free(sched_plan *p) {
    free(p->items);
    free(p->preempted);
    memset(p, 0, sizeof *p);
}

int seq_init(seq *q, uint64_t id, const int32_t *prompt, int n_prompt, int max_tokens) {
    memset(q, 0, sizeof *q);
    if (n_prompt <= 0 || max_tokens < 0) return -1;
    q->id = id;
    q->cap_tokens = n_prompt + max_tokens + 1;
    q->tokens = malloc((size_t)q->cap_tokens * sizeof *q->tokens);
    if (!q->tokens) return -1;
    memcpy(q->tokens, prompt, (size_t)n_prompt * sizeof *prompt);
    q->n_tokens = q->n_prompt = n_prompt;
    return 0;
}

void seq_free(seq *q) {
    free(q->tokens);
    free(q->blocks);
    free(q->hashes);
    memset(q, 0, sizeof *q);
}

int seq_append(seq *q, int32_t token) {
    if (q->n_tokens >= q->cap_tokens) return -1;
    q->tokens[q->n_tokens++] = token;
    return 0;
}

int sched_blocks_for(const scheduler *s, int n_tokens) {
    return (n_tokens + s->cfg.block_size - 1) / s->cfg.block_size;
}

/* ---- lists ---------------------------------------------------------------- */

static void list_unlink(seq **head, seq **tail, seq *q) {
    if (q->prev)
        q->prev->next = q->next;
    else
        *head = q->next;
    if (q->next)
        q->next->prev = q->prev;
    else
        *tail = q->prev;
    q->prev = q->next = NULL;
}

static void list_push_tail(seq **head, seq **tail, seq *q) {
    q->next = NULL;
    q->prev = *tail;
    if (*tail)
        (*tail)->next = q;
    else
        *head = q;
    *tail = q;
}

static void list_push_head(seq **head, seq **tail, seq *q) {
    q->prev = NULL;
    q->next = *head;
    if (*head)
        (*head)->prev = q;
    else
        *tail = q;
    *head = q;
}

void sched_add(scheduler *s, seq *q) {
    q->state = SEQ_WAITING;
    list_push_tail(&s->wait_head, &s->wait_tail, q);
    s->n_waiting++;
}

/* ---- blocks --------------------------------------------------------------- */

static int ensure_capacity(seq *q, int n_blocks) {
    if (n_blocks <= q->cap_blocks) return 0;
    int cap = q->cap_blocks ? q->cap_blocks : 4;
    while (cap < n_blocks)
        cap *= 2;
    int32_t *b = realloc(q->blocks, (size_t)cap * sizeof *b);
    if (!b) return -1;
    q->blocks = b;
    uint64_t *h = realloc(q->hashes, (size_t)cap * sizeof *h);
    if (!h) return -1;
    q->hashes = h;
    q->cap_blocks = cap;
    return 0;
}

/* Give q blocks to hold n_tokens. */
static int grow_blocks(scheduler *s, seq *q, int n_tokens) {
    int need = sched_blocks_for(s, n_tokens) - q->n_blocks;
    if (need <= 0) return 0;
    if (ensure_capacity(q, q->n_blocks + need)) return -1;
    if (block_pool_alloc(s->bp, need, q->blocks + q->n_blocks)) return -1;
    q->n_blocks += need;
    return 0;
}

static void drop_blocks(scheduler *s, seq *q) {
    block_pool_release(s->bp, q->blocks, q->n_blocks);
    q->n_blocks = 0;
    q->n_hashed = 0;
    q->n_computed = 0;
    q->n_cached = 0;
}

/* The longest cached prefix the old way: the device cache, then the lower tier's
 * synchronous copies, block by block (a tier without find/load_async hooks). */
static void take_prefix_walk(scheduler *s, seq *q, int full) {
    int bs = s->cfg.block_size;
    uint64_t h = 0;
    for (int i = 0; i < full; i++) {
        uint64_t parent = h;
        h = block_pool_hash_tokens(parent, q->tokens + i * bs, bs);
        int32_t b = block_pool_lookup_tiered(s->bp, parent, h, q->tokens + i * bs);
        if (b < 0) break;
        q->blocks[q->n_blocks++] = b;
        q->hashes[q->n_hashed++] = h;
    }
}

/* Where each prefix block is (q->hashes[i], s->kinds[i]: the device cache or a tier), for
 * the blocks some cache holds from block 0 on; their count (-1: no memory). */
static int locate_prefix(scheduler *s, seq *q, int full) {
    if (full > s->cap_kinds) {
        signed char *k = realloc(s->kinds, (size_t)full);
        if (!k) return -1;
        s->kinds = k;
        s->cap_kinds = full;
    }
    int bs = s->cfg.block_size, n = 0;
    uint64_t h = 0;
    for (; n < full; n++) {
        h = block_pool_hash_tokens(h, q->tokens + n * bs, bs);
        q->hashes[n] = h;
        if (block_pool_contains(s->bp, h)) {
            s->kinds[n] = KV_LOAD_DEVICE;
            continue;
        }
        int t = q->no_tier_loads ? -1 : block_pool_tier_find(s->bp, h);
        if (t < 0) break;
        s->kinds[n] = (signed char)t;
    }
    return n;
}

/* q->n_tier_cached: the most tokens one admission copied back (its first n_blocks blocks at
 * most: a failed copy cut the prefix). */
static void note_tier_blocks(seq *q, int n_tier_blocks, int bs) {
    if (n_tier_blocks > q->n_blocks) n_tier_blocks = q->n_blocks;
    if (n_tier_blocks * bs > q->n_tier_cached) q->n_tier_cached = n_tier_blocks * bs;
}

/* Take the longest cached prefix of full blocks (at least one token is left to
 * compute, so the last prompt token always produces logits): the device cache's
 * blocks, and the tiers' where the cost model says copy.  Tier copies run in the
 * background when async (the return is 1: q must wait for them, SEQ_LOADING; -1: too
 * few free blocks to start them, q holds nothing and waits), else before this returns
 * (0). */
static int take_cached_prefix(scheduler *s, seq *q, int async) {
    if (!s->cfg.enable_prefix_caching || q->no_prefix_cache || q->n_blocks > 0) return 0;
    int bs = s->cfg.block_size;
    int full = (q->n_tokens - 1) / bs;
    if (full <= 0 || ensure_capacity(q, full)) return 0;
    block_pool *bp = s->bp;
    int n = bp->tier.find ? locate_prefix(s, q, full) : -1;
    if (n < 0) {
        take_prefix_walk(s, q, full);
        q->n_computed = q->n_cached = q->n_blocks * bs;
        return 0;
    }
    int j = s->cost ? kv_load_cost_plan(s->cost, s->kinds, n) : n;
    /* the device's blocks first (referenced: a tier copy's allocation cannot evict them) */
    int n_tier = 0;
    for (int i = 0; i < j; i++) {
        q->blocks[i] = s->kinds[i] == KV_LOAD_DEVICE ? block_pool_lookup(bp, q->hashes[i]) : -1;
        n_tier += s->kinds[i] != KV_LOAD_DEVICE;
    }
    /* Copies in the background only for a sequence that could be admitted once they end:
     * the copies' blocks and its first chunk's must be free beyond what the sequences
     * already loading reserved for theirs, else it waits first in line (copies for a
     * sequence that then cannot run would only be evicted again). */
    int reserve = 0;
    async = async && n_tier && bp->tier.load_async &&
            !(s->async_loads == SCHED_LOADS_AUTO && s->cost &&
              kv_load_cost_inline(s->cost, s->kinds, j));
    if (async) {
        int chunk = q->n_tokens - j * bs;
        if (chunk > s->cfg.max_num_batched_tokens) chunk = s->cfg.max_num_batched_tokens;
        if (q->max_chunk > 0 && chunk > q->max_chunk) chunk = q->max_chunk;
        reserve = sched_blocks_for(s, j * bs + chunk) - j;
        if (block_pool_num_free(bp) < s->reserved + n_tier + reserve) {
            for (int i = 0; i < j; i++)
                if (s->kinds[i] == KV_LOAD_DEVICE) block_pool_release(bp, &q->blocks[i], 1);
            return -1;
        }
    }
    int end = j, pending = 0;
    for (int i = 0; i < j; i++) {
        if (s->kinds[i] == KV_LOAD_DEVICE) continue;
        int32_t b;
        if (async) {
            bp->queries++; /* the device cache's miss */
            b = block_pool_load_async(bp, q->hashes[i], q->id);
            pending += b >= 0;
        } else {
            b = block_pool_lookup_tiered(bp, i ? q->hashes[i - 1] : 0, q->hashes[i],
                                         q->tokens + i * bs);
        }
        if (b < 0) { /* the tier lost it meanwhile, or no block is free: the prefix ends */
            end = i;
            break;
        }
        q->blocks[i] = b;
    }
    for (int i = end; i < j; i++) /* device blocks after a failed copy: not needed */
        if (s->kinds[i] == KV_LOAD_DEVICE) block_pool_release(bp, &q->blocks[i], 1);
    if (end == j && j < full) { /* the lookup that ended the walk, as a walk counts it */
        bp->queries++;
        if (bp->tier.load) bp->ext_queries++;
    }
    q->n_blocks = q->n_hashed = end;
    int tier_blocks = 0;
    for (int i = 0; i < end; i++)
        tier_blocks += s->kinds[i] != KV_LOAD_DEVICE;
    if (pending) {
        q->state = SEQ_LOADING;
        q->n_tier_pending = tier_blocks;
        q->n_loads = pending;
        q->load_end = end;
        q->t_load_ns = clock_now_ns();
        q->reserve = reserve;
        s->reserved += reserve;
        return 1;
    }
    q->n_computed = q->n_cached = end * bs;
    note_tier_blocks(q, tier_blocks, bs);
    return 0;
}

void sched_load_done(scheduler *s, seq *q, int32_t block, int ok) {
    int i = -1;
    if (q && q->state == SEQ_LOADING)
        for (int k = 0; k < q->n_blocks; k++)
            if (q->blocks[k] == block) {
                i = k;
                break;
            }
    int bs = s->cfg.block_size;
    if (i >= 0 && ok) /* it joins the device cache (BlockStored) */
        block_pool_cache_block(s->bp, block, i ? q->hashes[i - 1] : 0, q->hashes[i],
                               q->tokens + i * bs);
    block_pool_load_finished(s->bp, block);
    if (i < 0) return;
    if (!ok) {
        q->no_tier_loads = 1; /* not again: the rest of the prompt is computed */
        if (i < q->load_end) q->load_end = i;
    }
    if (--q->n_loads > 0) return;
    s->reserved -= q->reserve;
    q->reserve = 0;
    if (q->load_end < q->n_blocks) { /* a failed copy: the prefix ends there */
        block_pool_release(s->bp, q->blocks + q->load_end, q->n_blocks - q->load_end);
        q->n_blocks = q->n_hashed = q->load_end;
    }
    /* first in line with its prefix computed; if it cannot be admitted, it lets the blocks
     * go (sched_step: a waiting sequence never holds up another) */
    q->n_computed = q->n_cached = q->n_blocks * bs;
    /* a failed copy cut the prefix: its tier blocks past the cut are not counted (at most
     * n_blocks of them are, whichever they were) */
    note_tier_blocks(q, q->n_tier_pending, bs);
    q->n_tier_pending = 0;
    s->n_loading--;
    s->loads_waited++;
    s->load_wait_ns += clock_now_ns() - q->t_load_ns;
    q->state = SEQ_WAITING;
    list_push_head(&s->wait_head, &s->wait_tail, q);
    s->n_waiting++;
}

static void preempt(scheduler *s, seq *q, sched_plan *p) {
    list_unlink(&s->run_head, &s->run_tail, q);
    s->n_running--;
    drop_blocks(s, q);
    q->state = SEQ_WAITING;
    q->num_preemptions++;
    s->num_preemptions++;
    list_push_head(&s->wait_head, &s->wait_tail, q);
    s->n_waiting++;
    p->preempted[p->n_preempted++] = q;
}

/* ---- planning ------------------------------------------------------------- */

static void plan_add(sched_plan *p, seq *q, int count) {
    sched_item *it = &p->items[p->n_items++];
    it->s = q;
    it->start = q->n_computed;
    it->count = count;
    it->logits = q->n_computed + count == q->n_tokens;
    p->n_tokens += count;
}

int sched_step(scheduler *s, sched_plan *p) {
    p->n_items = p->n_tokens = p->n_preempted = 0;
    int budget = s->cfg.max_num_batched_tokens;
    /* 1. Running sequences, in admission order. */
    for (seq *q = s->run_head; q && budget > 0 && p->n_items < s->cfg.max_num_seqs;) {
        seq *next = q->next;
        if (q->state == SEQ_PARKED) {
            q = next;
            continue;
        }
        int count = q->n_tokens - q->n_computed;
        if (count > budget) count = budget;
        if (q->max_chunk > 0 && count > q->max_chunk) count = q->max_chunk;
        if (count <= 0) {
            q = next;
            continue;
        }
        int preempted_self = 0;
        while (grow_blocks(s, q, q->n_computed + count) != 0) {
            seq *victim = s->run_tail;
            while (victim && victim->state == SEQ_PARKED)
                victim = victim->prev;
            if (!victim) return p->n_items; /* nothing left to preempt */
            preempt(s, victim, p);
            next = victim == next ? NULL : next;
            if (victim == q) {
                preempted_self = 1;
                break;
            }
        }
        if (preempted_self) break;
        plan_add(p, q, count);
        budget -= count;
        q = next;
    }
    /* 2. Waiting sequences, FCFS, while there is room (no preemption to admit). */
    while (s->wait_head && budget > 0 && p->n_items < s->cfg.max_num_seqs &&
           s->n_running + s->n_parked + s->n_loading < s->cfg.max_num_seqs &&
           p->n_preempted == 0) {
        seq *q = s->wait_head;
        int loads = take_cached_prefix(s, q, s->async_loads != SCHED_LOADS_INLINE);
        if (loads > 0) { /* it waits for copies; the batch does not */
            list_unlink(&s->wait_head, &s->wait_tail, q);
            s->n_waiting--;
            s->n_loading++;
            continue;
        }
        int count = q->n_tokens - q->n_computed;
        if (count > budget) count = budget;
        if (q->max_chunk > 0 && count > q->max_chunk) count = q->max_chunk;
        /* the blocks the loading sequences reserved for their first chunks are not taken */
        int need = sched_blocks_for(s, q->n_computed + count) - q->n_blocks;
        if (loads < 0 || (need > 0 && block_pool_num_free(s->bp) - s->reserved < need) ||
            grow_blocks(s, q, q->n_computed + count) != 0) {
            drop_blocks(s, q); /* give cached blocks back; try again next step */
            /* and so do the others whose tier copies ended (they hold their prefix until
             * admitted): behind a head that cannot fit they would hold it up for good */
            for (seq *w = s->wait_head; w; w = w->next)
                if (w->n_blocks) drop_blocks(s, w);
            break;
        }
        list_unlink(&s->wait_head, &s->wait_tail, q);
        s->n_waiting--;
        q->state = SEQ_RUNNING;
        list_push_tail(&s->run_head, &s->run_tail, q);
        s->n_running++;
        plan_add(p, q, count);
        budget -= count;
    }
    return p->n_items;
}

static void register_hashes(scheduler *s, seq *q) {
    int bs = s->cfg.block_size;
    while ((q->n_hashed + 1) * bs <= q->n_computed && q->n_hashed < q->n_blocks) {
        uint64_t parent = q->n_hashed ? q->hashes[q->n_hashed - 1] : 0;
        uint64_t h = block_pool_hash_tokens(parent, q->tokens + q->n_hashed * bs, bs);
        q->hashes[q->n_hashed] = h;
        if (s->cfg.enable_prefix_caching)
            block_pool_cache_block(s->bp, q->blocks[q->n_hashed], parent, h,
                                   q->tokens + q->n_hashed * bs);
        q->n_hashed++;
    }
}

void sched_commit(scheduler *s, const sched_plan *p) {
    for (int i = 0; i < p->n_items; i++) {
        seq *q = p->items[i].s;
        if (q->state != SEQ_RUNNING) continue;
        q->n_computed = p->items[i].start + p->items[i].count;
        register_hashes(s, q);
    }
}

void sched_finish(scheduler *s, seq *q, int keep_blocks) {
    if (q->state == SEQ_WAITING) {
        list_unlink(&s->wait_head, &s->wait_tail, q);
        s->n_waiting--;
    } else if (q->state == SEQ_LOADING) { /* in no list; the copies keep their blocks */
        s->n_loading--;
        s->reserved -= q->reserve;
        q->reserve = 0;
    } else if (q->state == SEQ_RUNNING || q->state == SEQ_PARKED) {
        list_unlink(&s->run_head, &s->run_tail, q);
        if (q->state == SEQ_RUNNING)
            s->n_running--;
        else
            s->n_parked--;
    }
    if (!keep_blocks && q->state != SEQ_FINISHED) {
        int cached = q->n_cached; /* kept for the request's usage report */
        drop_blocks(s, q);
        q->n_cached = cached;
    }
    q->state = SEQ_FINISHED;
}

int sched_park_with_blocks(scheduler *s, seq *q) {
    if (q->state != SEQ_WAITING) return -1;
    take_cached_prefix(s, q, 0);
    if (grow_blocks(s, q, q->n_tokens) != 0) {
        drop_blocks(s, q);
        return -1;
    }
    list_unlink(&s->wait_head, &s->wait_tail, q);
    s->n_waiting--;
    q->state = SEQ_PARKED;
    list_push_tail(&s->run_head, &s->run_tail, q);
    s->n_parked++;
    return 0;
}

void sched_take_blocks(scheduler *s, seq *q, int32_t **blocks, int *n_blocks) {
    (void)s;
    *blocks = q->blocks;
    *n_blocks = q->n_blocks;
    q->blocks = NULL;
    free(q->hashes);
    q->hashes = NULL;
    q->cap_blocks = q->n_blocks = q->n_hashed = q->n_computed = q->n_cached = 0;
}

void sched_unpark(scheduler *s, seq *q, int n_computed) {
    if (q->state != SEQ_PARKED) return;
    q->state = SEQ_RUNNING;
    s->n_parked--;
    s->n_running++;
    if (n_computed > q->n_computed)
        q->n_computed = n_computed < q->n_tokens ? n_computed : q->n_tokens - 1;
    register_hashes(s, q);
}
