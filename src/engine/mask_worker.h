/*
 * mask_worker — a step's structured-output token masks, filled while the forward runs.
 *
 * The engine's step knows, before the forward, every constrained row that will be
 * sampled and the grammar state it is in (the state after the output so far).  Each
 * such row's allowed tokens -- the state's mask (grammar/: a table lookup for a state met
 * before, a walk of the vocabulary for a new one) plus the stop tokens where the grammar
 * accepts -- go into a bitmask of its own, as xgrammar's fill_next_token_bitmask does for
 * vLLM.  mask_worker_start hands the rows to the worker's threads and returns at once;
 * the engine runs the forward; mask_worker_join waits for the rows and the sampler
 * applies them to the logits.  The forward's device (or, on the CPU backend, its thread
 * pool) and the mask threads then work at the same time.  With overlap off every row is
 * filled in mask_worker_start, on the caller's thread (the serial path, for comparison:
 * the bitmasks are the same either way, so the outputs are).
 *
 * The rows' grammars must not be advanced between start and join (the engine advances
 * them only after sampling).  Not thread-safe: one caller (the engine's step thread).
 */
#ifndef DISAGG_ENGINE_MASK_WORKER_H
#define DISAGG_ENGINE_MASK_WORKER_H

#include "grammar/grammar.h"

#include <stdint.h>

typedef struct mask_worker mask_worker;

/* Masks over vocab tokens (bitmask words (vocab + 31) / 32); eos_ids (n_eos, copied): the
 * model's stop tokens, allowed where a row's grammar accepts.  n_threads >= 1 worker
 * threads (started at the first overlapped step).  NULL on allocation failure. */
mask_worker *mask_worker_new(int vocab, const int32_t *eos_ids, int n_eos, int n_threads);
void mask_worker_free(mask_worker *w); /* joins its threads; NULL is fine */

/* Begin a step's rows (after the previous step's join). */
void mask_worker_reset(mask_worker *w);
/* Add a row: grammar g (borrowed until join) in state s, with the request's stop ids
 * (n_stop, borrowed until join), its bitmask written to dst ((vocab + 31) / 32 words: the
 * engine passes the model's page-locked mask rows, which go to the device as they are) or,
 * dst NULL, to a buffer of the worker's.  Returns the row's bitmask, filled by join, or NULL
 * on allocation failure. */
uint32_t *mask_worker_add(mask_worker *w, grammar *g, grammar_state s, const int32_t *stop_ids,
                          int n_stop, uint32_t *dst);
/* Fill the rows: overlap 1 hands them to the threads and returns; overlap 0 (or a thread
 * that could not start) fills them here. */
void mask_worker_start(mask_worker *w, int overlap);
/* Wait until every row is filled; rows no thread has taken yet are filled here. */
void mask_worker_join(mask_worker *w);

/* The same threads for the step's other per-row work: runs fn(ctx, i) for every i < n on the
 * threads and the calling thread, and returns when all are done (the engine samples its
 * host-sampled rows this way, each row's sampler touched by one thread).  Call it between a
 * join and the next start. */
typedef void (*mask_worker_fn)(void *ctx, int i);
void mask_worker_run(mask_worker *w, int n, mask_worker_fn fn, void *ctx);

/* Timings of the last step's rows: fill_ns the time spent filling them (threads' busy
 * time, summed), wait_ns the time the caller spent in start and join for them (serial:
 * the whole fill; overlapped: what the forward did not hide). */
void mask_worker_last(mask_worker *w, int *rows, uint64_t *fill_ns, uint64_t *wait_ns);

#endif
