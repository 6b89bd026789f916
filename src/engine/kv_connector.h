/*
 * kv_connector — what the engine asks of a KV connector (implemented one
 * layer up, in connector/).  The engine calls these hooks from its step
 * thread; they must not block.  The connector answers asynchronously through
 * engine_kv_load_done() and engine_kv_release() (thread-safe).
 *
 * Life of a request with kv_transfer_params:
 *   classify()          on arrival: local, remote prefill (consumer: the engine
 *                       gives it blocks for the whole prompt and parks it) or
 *                       remote decode (producer: keep the blocks at the end).
 *   start_load()        consumer: blocks are allocated; pull the remote KV into
 *                       them, then engine_kv_load_done().
 *   first_token()       producer: the prefill's sampled token (optional hook).
 *   request_finished()  producer: the request ended; if keep, its blocks stay
 *                       referenced until engine_kv_release(id).  Consumer: the
 *                       request was aborted while loading (cancel the pull;
 *                       engine_kv_load_done() must still follow).
 *   request_released()  the engine is done with the request's handle.
 */
#ifndef DISAGG_ENGINE_KV_CONNECTOR_H
#define DISAGG_ENGINE_KV_CONNECTOR_H

#include <stddef.h>
#include <stdint.h>

struct backend_layer_progress; /* kernels/backend.h */

typedef enum kv_role_of_request {
    KV_REQ_LOCAL = 0,          /* no remote KV involved */
    KV_REQ_REMOTE_PREFILL = 1, /* consumer: load the prompt's KV from a producer */
    KV_REQ_REMOTE_DECODE = 2,  /* producer: keep the KV for a consumer to pull */
} kv_role_of_request;

/* OR'ed into classify()'s role (LOCAL or REMOTE_DECODE): a pool fetch.  The engine parks
 * the request with blocks for its prompt as for a remote prefill and calls start_load();
 * the connector pulls a prefix of the prompt's KV from another instance and reports how
 * many prompt tokens it filled (engine_kv_load_done_prefix), or a failure, after which
 * the prompt is computed here (a pool fetch never fails a request).  Then the request
 * goes on in its role. */
#define KV_REQ_POOL_FETCH 4

typedef struct engine_kv_connector {
    void *ctx;
    /* kv_params: the request's kv_transfer_params as JSON text; prompt (n_prompt) its
     * token ids (valid during the call).  Returns the role (possibly with
     * KV_REQ_POOL_FETCH), or -1 with err filled when the params are invalid (the request
     * is rejected).  *handle: the connector's per-request state (may be NULL). */
    int (*classify)(void *ctx, uint64_t id, const char *kv_params, const int32_t *prompt,
                    int n_prompt, void **handle, char *err, size_t errlen);
    /* Consumer: blocks (n_blocks) hold the whole prompt; the first
     * n_local_tokens tokens' KV is already there (local prefix cache). */
    void (*start_load)(void *ctx, void *handle, uint64_t id, const int32_t *blocks, int n_blocks,
                       int n_local_tokens, int n_prompt);
    /* Producer: the request ended ("stop", "length", "abort", "error").  When
     * keep is set its blocks (n_blocks) stay allocated until
     * engine_kv_release(id).  Consumer: aborted during its load (blocks NULL). */
    void (*request_finished)(void *ctx, void *handle, uint64_t id, const char *finish_reason,
                             const int32_t *blocks, int n_blocks, int n_prompt, int keep);
    /* Producer (optional, may be NULL): the prefill of a remote-decode request
     * sampled its first output token (before request_finished).  The connector
     * may hand it to the consumer with the KV (engine_kv_load_done_first_token). */
    void (*first_token)(void *ctx, void *handle, uint64_t id, int32_t token);
    /* The engine forgets the request (after finish or abort); free handle. */
    void (*request_released)(void *ctx, void *handle, uint64_t id);
    /* Producer (optional, may be NULL; with it the engine marks each layer's KV as the
     * forward writes it, kernels/backend.h "layer progress"): the forward of step `step`
     * computes prompt tokens [start, end) of a remote-decode request (one prefill chunk;
     * n_prompt tokens in all).  blocks (n_blocks) is its block table now: it grows with
     * later chunks, and after a preemption the tokens come again, in new blocks.  Tokens
     * before start were there before this step (prefix cache, earlier chunks).  Layer l
     * of the chunk is written once backend_layer_wait(progress, step, l, ...) returns; the
     * blocks stay the request's until request_finished (which follows the last chunk). */
    void (*prefill_chunk)(void *ctx, void *handle, uint64_t id, const int32_t *blocks,
                          int n_blocks, int start, int end, int n_prompt, uint64_t step,
                          struct backend_layer_progress *progress);
    /* Holder of a pool fetch (optional, may be NULL): the answer to engine_kv_pin_prefix(key):
     * blocks (n_blocks, maybe 0) hold the KV of the first n_blocks full blocks of the tokens
     * asked, pinned (kept) under pin_id until engine_kv_release(pin_id); nothing is pinned
     * (pin_id 0) when n_blocks is 0.  Without the hook the pins are released at once. */
    void (*prefix_pinned)(void *ctx, uint64_t key, uint64_t pin_id, const int32_t *blocks,
                          int n_blocks);
} engine_kv_connector;

/* The KV region, for registration with the transfer engine and the layout
 * fingerprint both sides compare before moving bytes. */
/* The fingerprint's last field: ":kernels-avx2", ":kernels-avx512f", ":kernels-cuda".
 * Peers compare the fingerprint without it (the bytes are the same layout); a difference in
 * it only means the decode will not be bit-identical to a colocated run (it is reported). */
#define ENGINE_KERNELS_TAG ":kernels-"
typedef struct engine_kv_region {
    void *base;
    size_t bytes;
    size_t block_bytes;
    int n_blocks;
    int block_size;
    char location[32];     /* where base lives, for transfer_register: "cpu:0", "cuda:0" */
    char fingerprint[160]; /* model shape, dtype, block size and layout, then
                            * ENGINE_KERNELS_TAG and the kernels that computed the KV */
    /* The device it lives on (kernels/backend.h): device memory needs the module's
     * transfer ops (backend_module_symbol), which the connector installs. */
    const struct backend *backend;
} engine_kv_region;

#endif
