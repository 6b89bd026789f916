/*
 * scheduler — continuous batching with chunked prefill, as vLLM's v1
 * scheduler: every step, running sequences first (one token each when
 * decoding, a chunk when still prefilling), then waiting ones in FCFS order,
 * under max_num_batched_tokens and max_num_seqs.  New sequences first take the
 * longest cached prefix of full blocks from the block pool.  When blocks run
 * out, the most recently admitted running sequence is preempted (its blocks
 * released, recomputed later).  A sequence may be parked (waiting for remote
 * KV) without holding up the others.  Prefix blocks an offload tier holds come
 * back by copy when engine/kv_load_cost.h says the copy is faster than their
 * prefill; the copies run asynchronously (block_pool_load_async) while the
 * sequence waits in SEQ_LOADING, out of the batch, and the engine reports each
 * copy's end (sched_load_done).  The scheduler plans; the engine runs the
 * model and reports back with sched_commit().
 */
#ifndef DISAGG_ENGINE_SCHEDULER_H
#define DISAGG_ENGINE_SCHEDULER_H

#include "engine/block_pool.h"
#include "engine/kv_load_cost.h"

#include <stdint.h>

typedef enum seq_state {
    SEQ_WAITING = 0,  /* queued, no KV computed (or preempted) */
    SEQ_RUNNING = 1,  /* has blocks, scheduled every step */
    SEQ_PARKED = 2,   /* has blocks, waiting for something outside (remote KV) */
    SEQ_FINISHED = 3, /* blocks released (or handed to the connector) */
    SEQ_LOADING = 4,  /* has blocks, waiting for copies from the offload tiers (in no list) */
} seq_state;

typedef struct seq {
    uint64_t id;
    int32_t *tokens; /* (cap_tokens) prompt then generated tokens */
    int n_tokens, cap_tokens, n_prompt;
    int n_computed;  /* KV present for tokens[0, n_computed) */
    int n_cached;    /* of those, taken from the prefix cache at admission */
    int n_tier_cached;  /* the most prompt tokens one admission copied back from the offload
                         * tiers (metrics: vLLM counts them as external_kv_transfer); a later
                         * admission finding them in the device cache keeps the count */
    int n_tier_pending; /* SEQ_LOADING: blocks of its prefix being copied from the tiers */
    int32_t *blocks; /* (cap_blocks) block table */
    int n_blocks, cap_blocks;
    uint64_t *hashes; /* (cap_blocks) prefix hash of full blocks [0, n_hashed) */
    int n_hashed;
    seq_state state;
    int num_preemptions;
    int no_prefix_cache;     /* skip prefix-cache lookup at admission */
    int max_chunk;           /* most tokens computed in one step, 0 = no limit */
    int n_loads;             /* SEQ_LOADING: tier copies into its blocks not ended yet */
    int load_end;            /* SEQ_LOADING: blocks [0, load_end) are good (a failed copy cuts) */
    int reserve;             /* SEQ_LOADING: free blocks kept for its first chunk after them */
    int no_tier_loads;       /* a copy of its failed: its prefix comes from the device cache only */
    uint64_t t_load_ns;      /* SEQ_LOADING: when its copies started */
    struct seq *prev, *next; /* links in the scheduler's waiting or running list */
    void *owner;             /* the engine's request */
} seq;

typedef struct sched_config {
    int block_size;
    int max_num_seqs;
    int max_num_batched_tokens;
    int enable_prefix_caching;
} sched_config;

typedef struct sched_item {
    seq *s;
    int start;  /* first position computed this step */
    int count;  /* tokens computed this step */
    int logits; /* this chunk reaches the end: sample a token */
} sched_item;

typedef struct sched_plan {
    sched_item *items; /* (max_num_seqs) */
    int n_items;
    int n_tokens;    /* sum of counts */
    seq **preempted; /* (max_num_seqs) preempted this step (engine informs owners) */
    int n_preempted;
} sched_plan;

/* Where tier copies run: inline (at admission, on the step thread), auto (inline when the
 * cost model says they take under a tenth of a step, else background), background (the
 * loader thread, the request in SEQ_LOADING). */
enum { SCHED_LOADS_INLINE = 0, SCHED_LOADS_AUTO = 1, SCHED_LOADS_BACKGROUND = 2 };

typedef struct scheduler {
    sched_config cfg;
    block_pool *bp;
    seq *wait_head, *wait_tail; /* FCFS */
    seq *run_head, *run_tail;   /* admission order */
    int n_waiting, n_running, n_parked;
    int n_loading; /* SEQ_LOADING sequences */
    int reserved;  /* free blocks the SEQ_LOADING sequences keep for their first chunks */
    uint64_t num_preemptions;
    /* the offload tiers' copies: whether to copy (NULL = always) and how (async_loads: in
     * the background with block_pool_load_async, else block_pool_lookup_tiered) */
    kv_load_cost *cost;
    int async_loads; /* SCHED_LOADS_*: where the admission's tier copies run */
    signed char *kinds; /* (cap_kinds) scratch: where each prefix block is */
    int cap_kinds;
    uint64_t loads_waited, load_wait_ns; /* sequences that waited for copies, and how long */
} scheduler;

int sched_init(scheduler *s, const sched_config *cfg, block_pool *bp);
void sched_free(scheduler *s);
int sched_plan_init(sched_plan *p, const sched_config *cfg);
void sched_plan_free(sched_plan *p);

/* seq helpers: allocate token storage for a prompt (copied). */
int seq_init(seq *q, uint64_t id, const int32_t *prompt, int n_prompt, int max_tokens);
void seq_free(seq *q);
/* Append a generated token (capacity was reserved by seq_init). */
int seq_append(seq *q, int32_t token);

void sched_add(scheduler *s, seq *q);
/* Plan one step into p. Returns the number of items. */
int sched_step(scheduler *s, sched_plan *p);
/* The model ran the plan: advance n_computed and register full blocks' hashes. */
void sched_commit(scheduler *s, const sched_plan *p);
/* Remove q from whichever list it is on; release its blocks unless keep_blocks
 * (the connector keeps a prefill's blocks for the decoder). */
void sched_finish(scheduler *s, seq *q, int keep_blocks);
/* Give q blocks for all its prompt tokens now (remote KV will fill them) and
 * park it; the longest cached prefix is reused.  -1 if blocks are short. */
int sched_park_with_blocks(scheduler *s, seq *q);
/* Take q's block table away without releasing the blocks (the caller now owns
 * the references, *blocks is malloc'd); q has no KV afterwards. */
void sched_take_blocks(scheduler *s, seq *q, int32_t **blocks, int *n_blocks);
/* A tier copy into q's block ended (ok: the block holds its KV and joins the device cache).
 * q NULL (the request is gone) or no longer loading: only the copy's reference goes.  When
 * q's last copy ends, q keeps its prefix up to the first failed copy and waits at the head
 * of the queue holding it; when the head of the queue cannot be admitted, every waiting
 * sequence lets its blocks go (they stay in the device cache), so none holds up another. */
void sched_load_done(scheduler *s, seq *q, int32_t block, int ok);
/* q's KV for [0, n_computed) arrived: back to running. */
void sched_unpark(scheduler *s, seq *q, int n_computed);
/* Number of blocks needed to hold n tokens. */
int sched_blocks_for(const scheduler *s, int n_tokens);

#endif
