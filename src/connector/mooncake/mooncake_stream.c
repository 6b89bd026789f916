/* mooncake_stream — P's layer-wise streaming (mooncake_internal.h, docs/connector.md
 * "Layer-wise streaming").
 *
 * A decoder that says "disagg_layerwise": true in its pull, for a request still prefilling
 * here, gets a stream thread instead of waiting for the prefill's end: the engine reports
 * every prefill chunk of the request (hook prefill_chunk: its tokens, its block table, its
 * step) and marks each layer's KV as the forward writes it (kernels/backend.h "layer
 * progress"); the thread writes layer l of the chunk's blocks into the decoder's while the
 * forward computes layer l + 1, and the pull's FINISH (listing the request in ok_reqs and in
 * "disagg_layerwise") follows the last layer of the last chunk.  The decoder reads nothing
 * before that FINISH, so a partial write is never decoded; on any failure the FINISH lists
 * the request in err_reqs (or never comes: P died), as on the whole-request path. */
#include "connector/mooncake/mooncake_internal.h"

#define LW_WAIT_NS (50 * NS_PER_MS) /* a stream thread re-checks its stop flag this often */

int mc_pull_can_stream(const mooncake_connector *c, const side_channel_pull *pull, size_t req) {
    const side_channel_req_blocks *rb = &pull->reqs[req];
    return pull->layerwise && c->cfg.layerwise && pull->n_regions == 1 &&
           pull->remote_tp_size == 1 && c->tp.tp_size == 1 &&
           (uint64_t)pull->block_lens[0] == c->region.block_bytes &&
           (uint64_t)pull->kv_block_lens[0] == c->region.block_bytes && rb->n_groups == 1 &&
           rb->groups[0].n > 0;
}

void mc_prod_free_chunks(prod_req *p) {
    for (size_t i = 0; i < p->n_chunks; i++)
        free(p->chunks[i].blocks);
    free(p->chunks);
    p->chunks = NULL;
    p->n_chunks = p->cap_chunks = 0;
}

/* Engine thread (must not block): a prefill chunk of a remote-decode request runs in
 * `step`.  Every chunk is kept (a streaming pull may come after the first ones ran) until
 * the prefill ends without a stream, or the request is forgotten. */
void mc_prefill_chunk(void *ctx, void *hp, uint64_t id, const int32_t *blocks, int n_blocks,
                      int start, int end, int n_prompt, uint64_t step,
                      struct backend_layer_progress *lp) {
    mooncake_connector *c = ctx;
    handle *h = hp;
    (void)id;
    if (!h || !h->is_producer || n_blocks <= 0) return;
    prod_req *p = h->p;
    int32_t *copy = malloc((size_t)n_blocks * sizeof *copy);
    if (copy) memcpy(copy, blocks, (size_t)n_blocks * sizeof *copy);
    pthread_mutex_lock(&c->mu);
    if (p->prefill_over || p->state == P_DONE || p->state == P_FAILED) {
        pthread_mutex_unlock(&c->mu);
        free(copy);
        return;
    }
    if (copy && p->n_chunks == p->cap_chunks) {
        size_t cap = p->cap_chunks ? 2 * p->cap_chunks : 8;
        lw_chunk *v = realloc(p->chunks, cap * sizeof *v);
        if (v) {
            p->chunks = v;
            p->cap_chunks = cap;
        }
    }
    if (!copy || p->n_chunks == p->cap_chunks) { /* out of memory: whole-request send at the end */
        p->sent_upto = INT32_MIN;
        free(copy);
    } else {
        /* tokens before start that no chunk covered (prefix-cache hits) are ready now; a
         * start below sent_upto is a chunk computed again (after a preemption) */
        int lo = p->sent_upto >= 0 && start > p->sent_upto ? p->sent_upto : start;
        p->chunks[p->n_chunks++] = (lw_chunk){lo, start, end, step, copy, n_blocks};
        if (p->sent_upto >= 0) p->sent_upto = end;
    }
    p->n_prompt = n_prompt;
    p->lp = lp;
    pthread_cond_broadcast(&c->lw_cv);
    pthread_mutex_unlock(&c->mu);
}

/* The paired block ids of position blocks [b0, b1) of a chunk: P's from its table, D's by
 * the tail pairing (D asked for the last n_d of the prompt's n_total blocks). */
static size_t pair_blocks(const lw_chunk *ch, const side_channel_block_group *g, int n_total,
                          int b0, int b1, int64_t *p_ids, int64_t *d_ids) {
    int off = n_total - (int)g->n;
    size_t k = 0;
    for (int i = b0 < off ? off : b0; i < b1 && i < ch->n_blocks && i < n_total; i++) {
        p_ids[k] = ch->blocks[i];
        d_ids[k++] = g->ids[i - off];
    }
    return k;
}

typedef struct stream_acc { /* what a stream wrote */
    uint64_t bytes;
    size_t runs;
    unsigned via;
} stream_acc;

static int write_layers(mooncake_connector *c, const side_channel_pull *pull, const int64_t *p_ids,
                        const int64_t *d_ids, size_t n, int n_layers, int first, int count,
                        xfer_run *runs, stream_acc *acc, char *err, size_t cap) {
    if (n == 0) return 0;
    int k =
        xfer_plan_layers(p_ids, d_ids, n, (uint64_t)(uintptr_t)c->region.base,
                         pull->kv_caches_base_addr[0], c->region.block_bytes,
                         (uint64_t)c->region.n_blocks, n_layers, first, count, runs, n, err, cap);
    if (k < 0) return k;
    uint64_t bytes = 0;
    unsigned via = 0;
    int rc = mc_write_runs(c, pull, runs, (size_t)k, &bytes, &via, err, cap);
    acc->via |= via;
    if (rc == 0) {
        acc->bytes += bytes;
        acc->runs += (size_t)k;
        pthread_mutex_lock(&c->mu); /* the byte counters move as the layers go */
        c->st.bytes_sent += bytes;
        c->st.descriptors_sent += (size_t)k;
        pthread_mutex_unlock(&c->mu);
    }
    return rc;
}

/* Write one chunk: its ready tokens at once, then layer by layer as the forward marks them
 * (layers already written when the thread gets to them go together). */
static int stream_chunk(mooncake_connector *c, send_task *t, const lw_chunk *ch, int n_prompt,
                        struct backend_layer_progress *lp, int n_layers, stream_acc *acc, char *err,
                        size_t cap) {
    const side_channel_pull *pull = t->job->pull;
    const side_channel_block_group *g = &pull->reqs[t->req].groups[0];
    int bs = c->region.block_size;
    int n_total = (n_prompt + bs - 1) / bs;
    if ((int64_t)g->n > n_total) {
        snprintf(err, cap, "the decode side asked for %zu blocks but the prompt fills %d", g->n,
                 n_total);
        return -EINVAL;
    }
    size_t max = (size_t)ch->n_blocks + 1;
    int64_t *p_ids = malloc(max * sizeof *p_ids), *d_ids = malloc(max * sizeof *d_ids);
    xfer_run *runs = malloc(max * sizeof *runs);
    int rc = 0;
    if (!p_ids || !d_ids || !runs) {
        snprintf(err, cap, "producer out of memory");
        rc = -ENOMEM;
    }
    if (rc == 0 && ch->ready_lo < ch->start) { /* there before this step: every layer now */
        size_t n =
            pair_blocks(ch, g, n_total, ch->ready_lo / bs, (ch->start + bs - 1) / bs, p_ids, d_ids);
        rc = write_layers(c, pull, p_ids, d_ids, n, n_layers, 0, n_layers, runs, acc, err, cap);
    }
    size_t n =
        rc ? 0 : pair_blocks(ch, g, n_total, ch->start / bs, (ch->end + bs - 1) / bs, p_ids, d_ids);
    for (int l = 0; rc == 0 && l < n_layers;) {
        for (;;) {
            if (atomic_load(&t->stop)) {
                snprintf(err, cap, "%s", t->stop_why ? t->stop_why : "stopped");
                rc = -ECANCELED;
                break;
            }
            int w = backend_layer_wait(lp, ch->step, l, LW_WAIT_NS);
            if (w == 0) break;
            if (w != -ETIMEDOUT) {
                snprintf(err, cap, "waiting for layer %d of the prefill failed (%d)", l, w);
                rc = -EIO;
                break;
            }
        }
        if (rc) break;
        int k = 1;
        while (l + k < n_layers && backend_layer_wait(lp, ch->step, l + k, 0) == 0)
            k++;
        rc = write_layers(c, pull, p_ids, d_ids, n, n_layers, l, k, runs, acc, err, cap);
        l += k;
    }
    free(p_ids);
    free(d_ids);
    free(runs);
    return rc;
}

static void streams_remove_locked(mooncake_connector *c, send_task *t) {
    for (int i = 0; i < c->n_streams; i++)
        if (c->streams[i] == t) {
            c->streams[i] = c->streams[--c->n_streams];
            break;
        }
}

static void *stream_main(void *arg) {
    send_task *t = arg;
    mooncake_connector *c = t->c;
    prod_req *p = t->p;
    const side_channel_pull *pull = t->job->pull;
    char err[320] = "";
    stream_acc acc = {0};
    xfer_kv_shape sh;
    /* a layout this file cannot cut into layers: the whole blocks at the prefill's end */
    int layers = tp_shape_from_fingerprint(c->region.fingerprint, &sh, err, sizeof err) == 0 &&
                 sh.n_layers > 0 && c->region.block_bytes % (size_t)sh.n_layers == 0;
    int rc = 0;
    err[0] = '\0';
    size_t next = 0;
    int reason = FP_WRITE_FAILED;
    pthread_mutex_lock(&c->mu);
    while (rc == 0) {
        if (atomic_load(&t->stop) || c->stop) {
            snprintf(err, sizeof err, "%s",
                     t->stop_why ? t->stop_why : "the producer is shutting down");
            rc = -ECANCELED;
            break;
        }
        if (!layers) {
            next = p->n_chunks; /* nothing streamed: the fallback below sends it all */
        } else if (next < p->n_chunks) {
            lw_chunk ch = p->chunks[next++]; /* its blocks stay until p is freed */
            int n_prompt = p->n_prompt;
            struct backend_layer_progress *lp = p->lp;
            pthread_mutex_unlock(&c->mu);
            rc = stream_chunk(c, t, &ch, n_prompt, lp, sh.n_layers, &acc, err, sizeof err);
            pthread_mutex_lock(&c->mu);
            continue;
        }
        if (p->prefill_over > 0) break; /* every chunk written */
        if (p->prefill_over < 0 || p->engine_released) {
            snprintf(err, sizeof err, "%s",
                     p->fail_msg[0] ? p->fail_msg : "the prefill request was dropped");
            rc = -EIO;
            reason = FP_PREFILL_ENDED;
            break;
        }
        pthread_cond_wait(&c->lw_cv, &c->mu);
    }
    int streamed = rc == 0, live = 1;
    if (rc == 0 && (!layers || p->sent_upto < p->n_prompt || p->n_prompt == 0)) {
        /* the chunks did not cover the prompt (no layer marks, out of memory): the kept
         * blocks go whole, as on the whole-request path */
        streamed = 0;
        pthread_mutex_unlock(&c->mu);
        uint64_t bytes = 0;
        size_t nruns = 0;
        unsigned via = 0;
        rc = mc_send_blocks(c, 0, pull, &pull->reqs[t->req], p, &bytes, &nruns, &via, err,
                            sizeof err);
        acc.bytes = bytes; /* the counters take the whole send (and what went before) */
        acc.runs = nruns;
        acc.via |= via;
        live = 0;
        pthread_mutex_lock(&c->mu);
    }
    if (rc == -ECANCELED) {
        c->fail_p[FP_CANCELLED]++;
        LOG_W(MOD, "transfer %s (layer-wise): stopped: %s", p->transfer_id,
              t->stop_why ? t->stop_why : "cancelled");
    } else if (reason == FP_PREFILL_ENDED) {
        c->fail_p[FP_PREFILL_ENDED]++;
    } else {
        mc_count_write_locked(c, p, rc, acc.bytes, acc.runs, acc.via,
                              p->prefill_end_ns ? p->prefill_end_ns : clock_now_ns(), live);
        if (rc) LOG_W(MOD, "transfer %s (layer-wise): %s", p->transfer_id, err);
    }
    if (rc == 0 && streamed) c->st.layerwise_sent++;
    streams_remove_locked(c, t);
    p->streaming = 0;
    if (p->prefill_over > 0) { /* the blocks are kept: this pull was theirs */
        p->state = P_DONE;
        mc_prod_release_blocks_locked(c, p);
    } else if (p->prefill_over < 0 || p->engine_released) {
        p->state = P_FAILED;
    } else { /* stopped while the prefill runs: its blocks go as soon as it ends */
        p->state = P_PREFILLING;
        p->cancelled = 1;
    }
    pull_job *job = t->job;
    const char *rid = pull->reqs[t->req].req_id;
    if (rc == 0 && p->first_token >= 0 && c->cfg.first_token_handoff && job->ft_reqs &&
        job->ft_tokens) {
        job->ft_reqs[job->n_ft] = (char *)rid;
        job->ft_tokens[job->n_ft++] = p->first_token;
    }
    if (rc == 0 && streamed && job->lw_reqs) job->lw_reqs[job->n_lw++] = (char *)rid;
    mc_job_req_done_locked(c, job, t->req, rc == 0, rc ? err : NULL);
    if (p->state != P_PREFILLING) mc_prod_wake_waiters_locked(c, p);
    mc_prod_maybe_free_locked(c, p);
    pthread_cond_broadcast(&c->cv); /* destroy waits for the stream threads */
    pthread_mutex_unlock(&c->mu);
    free(t);
    return NULL;
}

/* Caller holds mu; p is prefilling.  Its first waiter that asked for streaming (and can
 * have it) gets a stream thread. */
void mc_stream_start_locked(mooncake_connector *c, prod_req *p) {
    if (p->streaming || p->state != P_PREFILLING || c->stop) return;
    pull_part **pw = &p->waiters;
    while (*pw && !(*pw)->layerwise)
        pw = &(*pw)->next;
    if (!*pw) return;
    pull_part *w = *pw;
    if (c->n_streams == c->cap_streams) {
        int cap = c->cap_streams ? 2 * c->cap_streams : 16;
        send_task **v = realloc(c->streams, (size_t)cap * sizeof *v);
        if (!v) return; /* stays a waiter: the whole-request path */
        c->streams = v;
        c->cap_streams = cap;
    }
    send_task *t = calloc(1, sizeof *t);
    if (!t) return;
    t->job = w->job;
    t->req = w->req;
    t->p = p;
    t->c = c;
    atomic_init(&t->stop, 0);
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&th, &at, stream_main, t);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        free(t);
        return;
    }
    *pw = w->next;
    free(w);
    c->streams[c->n_streams++] = t;
    p->streaming = 1;
    p->state = P_SENDING;
}

/* Caller holds mu.  Stop the stream threads of a decoder's pull: by its identity and D
 * request id (a cancel), or by its side-channel connection (conn != 0: it closed). */
void mc_stream_stop_locked(mooncake_connector *c, const void *peer, size_t peer_len, uint64_t conn,
                           const char *req_id, const char *why) {
    for (int i = 0; i < c->n_streams; i++) {
        send_task *t = c->streams[i];
        int hit = conn ? side_channel_call_conn(t->job->call) == conn
                       : side_channel_call_peer_is(t->job->call, peer, peer_len) &&
                             !strcmp(t->job->pull->reqs[t->req].req_id, req_id);
        if (hit && !atomic_load(&t->stop)) {
            t->stop_why = why;
            atomic_store(&t->stop, 1);
        }
    }
    pthread_cond_broadcast(&c->lw_cv);
}
