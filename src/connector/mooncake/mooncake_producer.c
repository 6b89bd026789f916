/* mooncake_producer — P's side: pulls from decoders, the sender pool (mooncake_internal.h). */
#include "connector/mooncake/mooncake_internal.h"

/* ---- producer: pulls and senders ----------------------------------------------- */

/* O(1): the index, not a walk of prods (a flood of
 * bogus pulls must not slow the lookups of real ones). */
prod_req *mc_prod_find(mooncake_connector *c, const char *transfer_id) {
    return id_table_get(&c->prod_index, transfer_id);
}

prod_req *mc_prod_new(mooncake_connector *c, const char *transfer_id, prod_state st) {
    prod_req *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    snprintf(p->transfer_id, sizeof p->transfer_id, "%s", transfer_id);
    if (id_table_put(&c->prod_index, p->transfer_id, p) != 0) {
        free(p);
        return NULL;
    }
    p->state = st;
    p->first_token = -1;
    p->next = c->prods;
    if (c->prods) c->prods->prev = p;
    c->prods = p;
    return p;
}

/* Caller holds mu.  p enters P_UNKNOWN (a pull ahead of its request). */
static void unknown_push_locked(mooncake_connector *c, prod_req *p) {
    p->uprev = NULL;
    p->unext = c->u_head;
    if (c->u_head) c->u_head->uprev = p;
    c->u_head = p;
    if (!c->u_tail) c->u_tail = p;
    c->n_unknown++;
}

/* Caller holds mu.  p leaves P_UNKNOWN. */
void mc_unknown_remove_locked(mooncake_connector *c, prod_req *p) {
    if (p->uprev)
        p->uprev->unext = p->unext;
    else
        c->u_head = p->unext;
    if (p->unext)
        p->unext->uprev = p->uprev;
    else
        c->u_tail = p->uprev;
    p->unext = p->uprev = NULL;
    c->n_unknown--;
}

/* Caller holds mu.  Reply to a pull whose requests are all done. */
static void job_finish_locked(mooncake_connector *c, pull_job *job) {
    side_channel_reply r = {.status = SIDE_CHANNEL_FINISH,
                            .ok_reqs = job->ok,
                            .n_ok = job->n_ok,
                            .err_reqs = job->err,
                            .n_err = job->n_err,
                            .err_msg = job->n_err ? job->err_msg : NULL,
                            .ft_reqs = job->ft_reqs,
                            .ft_tokens = job->ft_tokens,
                            .n_ft = job->n_ft,
                            .lw_reqs = job->lw_reqs,
                            .n_lw = job->n_lw};
    side_channel_call_reply(job->call, &r);
    side_channel_pull_release(job->pull);
    free(job->ok);
    free(job->err);
    free(job->ft_reqs);
    free(job->ft_tokens);
    free(job->lw_reqs);
    free(job);
    (void)c;
}

/* Caller holds mu.  One request of job ended. */
void mc_job_req_done_locked(mooncake_connector *c, pull_job *job, size_t req, int ok,
                            const char *why) {
    char *rid = job->pull->reqs[req].req_id;
    if (ok) {
        job->ok[job->n_ok++] = rid;
    } else {
        job->err[job->n_err++] = rid;
        if (!job->err_msg[0] && why) snprintf(job->err_msg, sizeof job->err_msg, "%s", why);
    }
    if (--job->pending == 0) job_finish_locked(c, job);
}

/* Caller holds mu.  Drop the hold mc_on_pull keeps while it walks the requests. */
static void job_drop_hold_locked(mooncake_connector *c, pull_job *job) {
    if (--job->pending == 0) job_finish_locked(c, job);
}

/* Caller holds mu.  Free p's blocks in the engine (once). */
void mc_prod_release_blocks_locked(mooncake_connector *c, prod_req *p) {
    if (p->kept) {
        engine_kv_release(c->eng, p->id);
        p->kept = 0;
        c->st.kept--;
    }
}

/* Caller holds mu.  p became ready or failed: serve or fail its waiters.  A ready p serves
 * as many pulls as the TP shapes pair (pulls_expected: one per pair of P rank and D rank);
 * one more is refused as a second pull of the same transfer. */
void mc_prod_wake_waiters_locked(mooncake_connector *c, prod_req *p) {
    pull_part *w = p->waiters;
    p->waiters = NULL;
    while (w) {
        pull_part *n = w->next;
        if (!p->pulls_expected && p->state == P_READY) {
            int64_t d = w->job->pull->remote_tp_size;
            p->pulls_expected = d > c->tp.tp_size && d <= XFER_TP_MAX ? (int)d : c->tp.tp_size;
        }
        if ((p->state == P_READY || p->state == P_SENDING) &&
            p->pulls_started < p->pulls_expected) {
            send_task *t = malloc(sizeof *t);
            if (t) {
                *t = (send_task){.job = w->job, .req = w->req, .p = p};
                p->state = P_SENDING;
                p->pulls_started++;
                if (c->q_tail)
                    c->q_tail->next = t;
                else
                    c->q_head = t;
                c->q_tail = t;
                pthread_cond_signal(&c->q_cv);
            } else {
                mc_job_req_done_locked(c, w->job, w->req, 0, "producer out of memory");
            }
        } else {
            const char *why = p->state == P_FAILED ? p->fail_msg
                              : p->state == P_SENDING || p->state == P_DONE ||
                                      p->state == P_READY
                                  ? "transfer already pulled by another request"
                                  : "no such transfer";
            c->fail_p[p->state == P_FAILED ? p->fail_reason : FP_REFUSED]++;
            mc_job_req_done_locked(c, w->job, w->req, 0, why);
        }
        free(w);
        w = n;
    }
}

/* Caller holds mu.  One pull of p was written (sent 1) or dropped before it was (0): once
 * none is being written, p is done when every expected pull came or its decoder released it
 * (blocks freed), else ready for the next pull. */
void mc_prod_send_ended_locked(mooncake_connector *c, prod_req *p, int sent) {
    if (sent)
        p->pulls_done++;
    else
        p->pulls_started--;
    if (p->pulls_started > p->pulls_done) return; /* another rank's write is in flight */
    if (p->pulls_done >= p->pulls_expected || p->cancelled || !sent) {
        p->state = P_DONE;
        mc_prod_release_blocks_locked(c, p);
    } else {
        p->state = P_READY; /* more ranks pull it; the abort timeout still runs */
    }
}

void mc_prod_maybe_free_locked(mooncake_connector *c, prod_req *p) {
    if (!p->engine_released && p->state != P_UNKNOWN) return;
    if (p->waiters || p->state == P_SENDING || p->state == P_READY || p->state == P_PREFILLING)
        return;
    if (p->state == P_UNKNOWN) mc_unknown_remove_locked(c, p); /* e.g. a cancelled pull's entry */
    id_table_del(&c->prod_index, p->transfer_id);
    if (p->prev)
        p->prev->next = p->next;
    else
        c->prods = p->next;
    if (p->next) p->next->prev = p->prev;
    mc_prod_free_chunks(p);
    free(p->blocks);
    free(p);
}

/* A consumer request goes once the engine released it and no pull thread owns it. */
void mc_cons_maybe_free_locked(mooncake_connector *c, cons_req *r) {
    if (!r->released || r->loading) return;
    for (cons_req **pp = &c->conss; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    free(r->blocks);
    free(r->tokens);
    free(r);
}

/* Write p's blocks (the tail D asked for) into D's region. */
/* The transfer_status.transports bits of a write as "cuda_ipc", "tcp+shm", ... */
static const char *transports_str(unsigned via, char *buf, size_t cap) {
    static const transfer_protocol order[4] = {TRANSFER_PROTO_TCP, TRANSFER_PROTO_SHM,
                                               TRANSFER_PROTO_RDMA, TRANSFER_PROTO_CUDA_IPC};
    size_t o = 0;
    buf[0] = 0;
    for (int i = 0; i < 4; i++)
        if (via & (1u << (unsigned)order[i]) && o < cap)
            o += (size_t)snprintf(buf + o, cap - o, "%s%s", o ? "+" : "",
                                  transfer_protocol_name(order[i]));
    return buf[0] ? buf : "no transport";
}

/* Write runs into the decoder of pull (its transfer-engine segment). */
int mc_write_runs(mooncake_connector *c, const side_channel_pull *pull, const xfer_run *runs,
                  size_t n, uint64_t *bytes, unsigned *via, char *err, size_t cap) {
    char viabuf[64];
    *via = 0;
    *bytes = 0;
    void **src = malloc((n ? n : 1) * sizeof *src);
    uint64_t *dst = malloc((n ? n : 1) * sizeof *dst);
    size_t *len = malloc((n ? n : 1) * sizeof *len);
    int rc = -ENOMEM;
    if (src && dst && len) {
        for (size_t i = 0; i < n; i++) {
            src[i] = (void *)(uintptr_t)runs[i].src;
            dst[i] = runs[i].dst;
            len[i] = (size_t)runs[i].len;
            *bytes += runs[i].len;
        }
        char target[320];
        if (strchr(pull->remote_hostname, ':'))
            snprintf(target, sizeof target, "[%s]:%" PRId64, pull->remote_hostname,
                     pull->remote_port);
        else
            snprintf(target, sizeof target, "%s:%" PRId64, pull->remote_hostname,
                     pull->remote_port);
        rc = transfer_sync_write_via(c->te, target, src, dst, len, n, via);
        if (rc)
            snprintf(err, cap, "writing %zu KV bytes to decoder %s over %s failed: %s",
                     (size_t)*bytes, target, transports_str(*via, viabuf, sizeof viabuf),
                     transfer_strerror(rc));
    } else {
        snprintf(err, cap, "producer out of memory");
    }
    free(src);
    free(dst);
    free(len);
    return rc;
}

int mc_send_blocks(mooncake_connector *c, int rank, const side_channel_pull *pull,
                   const side_channel_req_blocks *rb, const prod_req *p, uint64_t *bytes,
                   size_t *nruns, unsigned *via, char *err, size_t cap) {
    *via = 0;
    if (pull->n_regions != 1) {
        snprintf(err, cap,
                 "decoder registered %zu KV regions; this producer has one block-major region "
                 "(layouts differ)",
                 pull->n_regions);
        return -EINVAL;
    }
    const side_channel_block_group *g = &rb->groups[0];
    int64_t *pids = malloc((size_t)(p->n_blocks ? p->n_blocks : 1) * sizeof *pids);
    if (!pids) {
        snprintf(err, cap, "producer out of memory");
        return -ENOMEM;
    }
    for (int i = 0; i < p->n_blocks; i++)
        pids[i] = p->blocks[i];
    /* the decoder's TP shape decides which heads go where (tp_pull.h, xfer_plan.h) */
    xfer_run *runs = NULL;
    size_t n_runs = 0;
    tp_local own = {c->tp.tp_size, rank};
    int n = tp_send_runs(&c->rank_region[rank], &own, pull, pids, (size_t)p->n_blocks, g->ids,
                         g->n, &runs, &n_runs, err, cap);
    free(pids);
    if (n < 0) return n;
    int rc = mc_write_runs(c, pull, runs, n_runs, bytes, via, err, cap);
    *nruns = n_runs;
    free(runs);
    return rc;
}

/* Caller holds mu.  Count one request's write (whole or streamed) in the stats. */
void mc_count_write_locked(mooncake_connector *c, const prod_req *p, int rc, uint64_t bytes,
                           size_t nruns, unsigned via, uint64_t t0, int live) {
    char viabuf[64];
    if (rc == 0) {
        static const transfer_protocol order[4] = {TRANSFER_PROTO_TCP, TRANSFER_PROTO_SHM,
                                                   TRANSFER_PROTO_RDMA, TRANSFER_PROTO_CUDA_IPC};
        int first = 1;
        for (int i = 0; i < 4; i++)
            if (via & (1u << (unsigned)order[i])) {
                first &= c->st.transport_requests[i] == 0;
                c->st.transport_requests[i]++;
                c->st.transport_bytes[i] += bytes; /* a mixed write counts in each */
            }
        c->st.send_count++;
        c->st.send_sum_s += (double)(clock_now_ns() - t0) / 1e9;
        if (!live) { /* a stream counted them as they went */
            c->st.bytes_sent += bytes;
            c->st.descriptors_sent += nruns;
        }
        c->st.transfers_ok++;
        if (first) /* once per transport: which one the KV moves over */
            LOG_I(MOD, "KV of transfer %s (%" PRIu64 " bytes, %s memory) moved over %s",
                  p->transfer_id, bytes, c->region.location,
                  transports_str(via, viabuf, sizeof viabuf));
        LOG_D(MOD, "transfer %s: %" PRIu64 " bytes in %zu descriptors over %s, %.2f ms",
              p->transfer_id, bytes, nruns, transports_str(via, viabuf, sizeof viabuf),
              (double)(clock_now_ns() - t0) / 1e6);
    } else {
        c->st.transfers_failed++;
        c->fail_p[FP_WRITE_FAILED]++;
    }
}

void *mc_sender_main(void *arg) {
    mooncake_connector *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->q_head && !c->stop)
            pthread_cond_wait(&c->q_cv, &c->mu);
        if (!c->q_head) break;
        send_task *t = c->q_head;
        c->q_head = t->next;
        if (!c->q_head) c->q_tail = NULL;
        pthread_mutex_unlock(&c->mu);
        char err[320] = "";
        uint64_t bytes = 0;
        size_t nruns = 0;
        unsigned via = 0;
        uint64_t t0 = clock_now_ns();
        int rc = mc_send_blocks(c, t->job->rank, t->job->pull, &t->job->pull->reqs[t->req], t->p,
                                &bytes, &nruns, &via, err, sizeof err);
        pthread_mutex_lock(&c->mu);
        prod_req *p = t->p;
        mc_count_write_locked(c, p, rc, bytes, nruns, via, t0, 0);
        if (rc) LOG_W(MOD, "transfer %s: %s", p->transfer_id, err);
        mc_prod_send_ended_locked(c, p, 1); /* the last of its pulls frees the blocks */
        if (rc == 0 && p->first_token >= 0 && c->cfg.first_token_handoff && t->job->ft_reqs &&
            t->job->ft_tokens) { /* the first-token handoff: D need not recompute it */
            t->job->ft_reqs[t->job->n_ft] = t->job->pull->reqs[t->req].req_id;
            t->job->ft_tokens[t->job->n_ft++] = p->first_token;
        }
        mc_job_req_done_locked(c, t->job, t->req, rc == 0, rc ? err : NULL);
        mc_prod_wake_waiters_locked(c, p); /* any second pull of the same id */
        mc_prod_maybe_free_locked(c, p);
        free(t);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Length of a layout fingerprint without its kernels field (engine/kv_connector.h). */
static size_t layout_len(const char *fp) {
    const char *k = strstr(fp, ENGINE_KERNELS_TAG);
    return k ? (size_t)(k - fp) : strlen(fp);
}

/* Same layout?  A peer whose KV was computed by other kernels (another CPU ISA, or a GPU)
 * is accepted -- the bytes mean the same -- and reported once: the decode is then not
 * bit-identical to a colocated run on either machine. */
static int layout_compatible(const char *peer, const char *mine) {
    size_t n = layout_len(peer);
    if (n != layout_len(mine) || strncmp(peer, mine, n) != 0) return 0;
    static atomic_int warned;
    if (strcmp(peer + n, mine + n) != 0 && !atomic_exchange(&warned, 1))
        LOG_W(MOD,
              "P/D pair across kernels: decoder %s, producer %s (%s vs %s); the KV layout is "
              "the same, but results are not bit-identical to a colocated run (exactness across "
              "ISAs is not promised)",
              peer + n + (peer[n] ? strlen(ENGINE_KERNELS_TAG) : 0),
              mine + n + (mine[n] ? strlen(ENGINE_KERNELS_TAG) : 0), peer, mine);
    return 1;
}

/* The KV dtype a fingerprint names (its sixth field), as backend_dtype_name says it */
static const char *layout_dtype(const char *fp, char *buf, size_t cap) {
    const char *p = fp;
    for (int i = 0; i < 5 && p; i++)
        if ((p = strchr(p, ':'))) p++;
    size_t n = p ? strcspn(p, ":") : 0;
    static const char *const names[][2] = {{"f32", "float32"},
                                           {"f16", "float16"},
                                           {"bf16", "bfloat16"},
                                           {"fp8e4m3", "float8_e4m3fn"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (n == strlen(names[i][0]) && !strncmp(p, names[i][0], n)) return names[i][1];
    snprintf(buf, cap, "%.*s", (int)(n < 32 ? n : 32), p ? p : "?");
    return buf;
}

/* The FP8 KV scales' field of a fingerprint (":kvs<hash>"), "1.0" without one */
static const char *layout_scales(const char *fp, char *buf, size_t cap) {
    const char *k = strstr(fp, ":kvs");
    if (!k) return "1.0";
    snprintf(buf, cap, "%.*s", (int)strcspn(k + 1, ":"), k + 1);
    return buf;
}

/* ---- pool fetch, holder side (docs/kv_pool.md) ------------------------------------ */

/* Caller holds mu.  Request i of a pull naming pool tokens: its transfer id is the
 * fetcher's own; the engine is asked to pin the cached blocks of the tokens' full blocks
 * (mc_prefix_pinned answers), and the pull waits for them as for a prefill.  A second pull
 * of the same transfer (another TP rank of the fetcher) joins the first. */
static void pool_pull_locked(mooncake_connector *c, pull_job *job, size_t i) {
    const side_channel_pull *pull = job->pull;
    const side_channel_req_blocks *rb = &pull->reqs[i];
    int bs = c->region.block_size;
    size_t full = pull->n_pool_tokens / (size_t)bs, nids = 0;
    for (size_t g = 0; g < rb->n_groups; g++)
        nids += rb->groups[g].n;
    const char *refuse = NULL;
    char msg[200];
    if (strncmp(rb->transfer_id, POOL_TX_PREFIX, strlen(POOL_TX_PREFIX)))
        refuse = "a pool fetch's transfer id starts with \"" POOL_TX_PREFIX "\"";
    else if (rb->n_groups != 1 || nids == 0)
        refuse = "a pool fetch names one KV group of block ids";
    else if (pull->n_pool_tokens > (size_t)engine_max_model_len(c->eng)) {
        snprintf(msg, sizeof msg,
                 "the pull names %zu pool tokens; this instance's max_model_len is %d",
                 pull->n_pool_tokens, engine_max_model_len(c->eng));
        refuse = msg;
    } else if (nids > full) {
        snprintf(msg, sizeof msg,
                 "the pull asks for %zu blocks; its %zu pool tokens fill %zu blocks of %d", nids,
                 pull->n_pool_tokens, full, bs);
        refuse = msg;
    }
    for (size_t k = 0; !refuse && k < full * (size_t)bs; k++)
        if (pull->pool_tokens[k] > INT32_MAX) refuse = "a pool token id is beyond int32";
    prod_req *p = refuse ? NULL : mc_prod_find(c, rb->transfer_id);
    if (!refuse && p && !p->pool) refuse = "the transfer id names a request, not a pool fetch";
    if (refuse) {
        c->fail_p[FP_REFUSED]++;
        mc_job_req_done_locked(c, job, i, 0, refuse);
        return;
    }
    pull_part *w = malloc(sizeof *w);
    int32_t *tok = !p ? malloc(full * (size_t)bs * sizeof *tok) : NULL;
    if (!p && tok && (p = mc_prod_new(c, rb->transfer_id, P_PREFILLING))) {
        p->pool = 1;
        p->engine_released = 1; /* no request of the engine: freed once done */
        p->pin_key = ++c->pin_seq;
        p->pool_blocks = (int)full;
        for (size_t k = 0; k < full * (size_t)bs; k++)
            tok[k] = (int32_t)pull->pool_tokens[k];
        if (engine_kv_pin_prefix(c->eng, p->pin_key, tok, (int)(full * (size_t)bs))) {
            p->state = P_FAILED;
            p->fail_reason = FP_REFUSED;
            snprintf(p->fail_msg, sizeof p->fail_msg, "producer out of memory");
        }
    }
    free(tok);
    if (!p || !w) {
        free(w);
        mc_job_req_done_locked(c, job, i, 0, "producer out of memory");
        return;
    }
    *w = (pull_part){job, i, p->waiters, 0};
    p->waiters = w;
    if (p->state != P_PREFILLING) {
        mc_prod_wake_waiters_locked(c, p);
        mc_prod_maybe_free_locked(c, p);
    }
}

/* Engine hook (its step thread): the blocks of pool fetch `key` are pinned (n_blocks of
 * them) -- all of them, or the fetch fails and the fetcher computes the prompt. */
void mc_prefix_pinned(void *ctx, uint64_t key, uint64_t pin_id, const int32_t *blocks,
                      int n_blocks) {
    mooncake_connector *c = ctx;
    pthread_mutex_lock(&c->mu);
    prod_req *p = c->prods;
    while (p && !(p->pool && p->pin_key == key))
        p = p->next;
    if (!p || p->state != P_PREFILLING || n_blocks < p->pool_blocks ||
        !(p->blocks = malloc((size_t)(n_blocks ? n_blocks : 1) * sizeof *p->blocks))) {
        if (pin_id) engine_kv_release(c->eng, pin_id);
        if (p && p->state == P_PREFILLING) {
            p->state = P_FAILED;
            p->fail_reason = FP_REFUSED;
            if (n_blocks < p->pool_blocks) {
                c->pool_not_held++;
                snprintf(p->fail_msg, sizeof p->fail_msg,
                         "pool fetch: this instance no longer holds the prefix (%d of its %d "
                         "blocks cached)",
                         n_blocks, p->pool_blocks);
            } else {
                snprintf(p->fail_msg, sizeof p->fail_msg, "producer out of memory");
            }
            mc_prod_wake_waiters_locked(c, p);
            mc_prod_maybe_free_locked(c, p);
        }
        pthread_mutex_unlock(&c->mu);
        return;
    }
    memcpy(p->blocks, blocks, (size_t)n_blocks * sizeof *blocks);
    p->n_blocks = n_blocks;
    p->id = pin_id;
    p->kept = 1;
    c->st.kept++;
    c->pool_served++;
    p->state = P_READY;
    /* its pulls are here already (they asked for the pin): a short expiry */
    p->deadline_ns = clock_now_ns() + (uint64_t)(POOL_TIMEOUT_S * 1e9);
    if (p->cancelled && !p->waiters) {
        p->state = P_DONE;
        mc_prod_release_blocks_locked(c, p);
    } else {
        mc_prod_wake_waiters_locked(c, p);
    }
    mc_prod_maybe_free_locked(c, p);
    pthread_mutex_unlock(&c->mu);
}

/* Side-channel thread: a decoder's pull.  Must not block. */
void mc_on_pull(void *ud, side_channel_call *call, side_channel_pull *pull) {
    mc_rank_sc *rs = ud;
    mooncake_connector *c = rs->c;
    if (pull->layout && !layout_compatible(pull->layout, c->region.fingerprint)) {
        char msg[480], b1[40], b2[40], b3[40], b4[40];
        const char *dd = layout_dtype(pull->layout, b1, sizeof b1),
                   *pd = layout_dtype(c->region.fingerprint, b2, sizeof b2);
        const char *ds = layout_scales(pull->layout, b3, sizeof b3),
                   *ps = layout_scales(c->region.fingerprint, b4, sizeof b4);
        if (strcmp(dd, pd))
            snprintf(msg, sizeof msg,
                     "KV dtype mismatch: prefill %s, decode %s (P and D need the same "
                     "--kv-cache-dtype); decoder has %s, producer has %s",
                     pd, dd, pull->layout, c->region.fingerprint);
        else if (strcmp(ds, ps))
            snprintf(msg, sizeof msg,
                     "KV scales mismatch: prefill %s, decode %s (FP8 KV of checkpoints with "
                     "different k_scale / v_scale); decoder has %s, producer has %s",
                     ps, ds, pull->layout, c->region.fingerprint);
        else
            snprintf(msg, sizeof msg,
                     "KV layout mismatch: decoder has %s, producer has %s (same model, dtype and "
                     "--block-size are required)",
                     pull->layout, c->region.fingerprint);
        LOG_W(MOD, "refusing a pull: %s", msg);
        pthread_mutex_lock(&c->mu);
        c->fail_p[FP_REFUSED]++;
        pthread_mutex_unlock(&c->mu);
        side_channel_reply r = {.status = SIDE_CHANNEL_ERROR, .err_msg = msg};
        side_channel_call_reply(call, &r);
        side_channel_pull_release(pull);
        return;
    }
    /* a peer without the fingerprint (vLLM): its blocks must be what its TP rank holds of
     * this model's KV (this rank's own size when the TP shapes are equal) */
    uint64_t want_bb = c->region.block_bytes;
    xfer_kv_shape sh;
    char sherr[160];
    if (pull->remote_tp_size >= 1 && pull->remote_tp_size <= XFER_TP_MAX &&
        pull->remote_tp_rank >= 0 && pull->remote_tp_rank < pull->remote_tp_size &&
        (pull->remote_tp_size != c->tp.tp_size || c->tp.tp_size > 1) &&
        tp_shape_from_fingerprint(c->region.fingerprint, &sh, sherr, sizeof sherr) == 0)
        want_bb = xfer_tp_block_bytes(&sh, (int)pull->remote_tp_size, (int)pull->remote_tp_rank);
    if (!pull->layout && pull->n_regions == 1 && (uint64_t)pull->block_lens[0] != want_bb) {
        char msg[256];
        snprintf(msg, sizeof msg,
                 "KV block size mismatch: decoder blocks are %" PRId64 " bytes, producer's %" PRIu64
                 " (what decode tp_rank %" PRId64 " of %" PRId64 " holds)",
                 pull->block_lens[0], want_bb, pull->remote_tp_rank, pull->remote_tp_size);
        pthread_mutex_lock(&c->mu);
        c->fail_p[FP_REFUSED]++;
        pthread_mutex_unlock(&c->mu);
        side_channel_reply r = {.status = SIDE_CHANNEL_ERROR, .err_msg = msg};
        side_channel_call_reply(call, &r);
        side_channel_pull_release(pull);
        return;
    }
    pull_job *job = calloc(1, sizeof *job);
    char **ok = calloc(pull->n_reqs + 1, sizeof *ok), **er = calloc(pull->n_reqs + 1, sizeof *er);
    if (!job || !ok || !er) {
        free(job);
        free(ok);
        free(er);
        side_channel_reply r = {.status = SIDE_CHANNEL_ERROR, .err_msg = "producer out of memory"};
        side_channel_call_reply(call, &r);
        side_channel_pull_release(pull);
        return;
    }
    job->rank = rs->rank;
    job->call = call;
    job->pull = pull;
    job->ok = ok;
    job->err = er;
    job->ft_reqs = calloc(pull->n_reqs + 1, sizeof *job->ft_reqs); /* NULL: no handoff */
    job->ft_tokens = calloc(pull->n_reqs + 1, sizeof *job->ft_tokens);
    job->lw_reqs = calloc(pull->n_reqs + 1, sizeof *job->lw_reqs); /* NULL: none listed */
    job->pending = pull->n_reqs + 1; /* +1 held until the loop is done */
    uint64_t now = clock_now_ns();
    job->beat_ns = now;
    /* A transfer_id no request of ours carries yet may still arrive (P and D
     * get the request at the same time): wait for it, but only so long. */
    uint64_t wait_deadline = now + (uint64_t)(c->env.unknown_transfer_timeout_s * 1e9);
    char **unk = calloc(pull->n_reqs + 1, sizeof *unk); /* parts waiting for unknown ids */
    size_t n_unk = 0;
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < pull->n_reqs; i++) {
        const side_channel_req_blocks *rb = &pull->reqs[i];
        if (pull->n_pool_tokens) {
            pool_pull_locked(c, job, i);
            continue;
        }
        prod_req *p = mc_prod_find(c, rb->transfer_id);
        size_t nids = 0;
        for (size_t g = 0; g < rb->n_groups; g++)
            nids += rb->groups[g].n;
        /* No block ids: "nothing to send, release your blocks" -- what vLLM's
         * decoder sends for a request it will not load (and ours for one it
         * rejected, or dropped before its pull).  Blocks kept now are freed;
         * a request still prefilling, or not here yet, is released as soon as
         * it is ready. */
        if (nids == 0 && p) {
            if (p->state == P_READY) {
                p->state = P_DONE;
                mc_prod_release_blocks_locked(c, p);
                mc_prod_maybe_free_locked(c, p);
            } else if (p->state == P_SENDING) { /* freed when the writes in flight end */
                p->cancelled = 1;
            } else if (p->state == P_PREFILLING || p->state == P_UNKNOWN) {
                p->cancelled = 1;
                if (p->state == P_UNKNOWN && !p->waiters) p->deadline_ns = wait_deadline;
            }
            mc_job_req_done_locked(c, job, i, 1, NULL);
            continue;
        }
        if (nids != 0 && rb->n_groups != 1) {
            c->fail_p[FP_REFUSED]++;
            mc_job_req_done_locked(c, job, i, 0,
                                   "this producer has one KV group; the pull names several");
            continue;
        }
        if (!p && c->n_unknown >= c->cfg.max_pending_pulls) {
            /* Full: evict the oldest waiting pull, O(1).  A real pull ahead
             * of its request is young (its request is on the way), so a
             * flood evicts its own entries first. */
            prod_req *old = c->u_tail;
            mc_unknown_remove_locked(c, old);
            old->state = P_FAILED;
            old->fail_reason = FP_UNKNOWN_TRANSFER;
            snprintf(old->fail_msg, sizeof old->fail_msg,
                     "evicted: %d newer pulls for transfer ids this producer does not know "
                     "arrived first (kv_connector_extra_config.max_pending_pulls)",
                     c->cfg.max_pending_pulls);
            if (c->pulls_evicted++ % 1000 == 0)
                LOG_W(MOD,
                      "%d pulls wait for unknown transfer ids (max_pending_pulls): evicting the "
                      "oldest (%" PRIu64 " evicted so far; a flood of bogus pulls?)",
                      c->n_unknown + 1, c->pulls_evicted);
            mc_prod_wake_waiters_locked(c, old);
            old->engine_released = 1;
            mc_prod_maybe_free_locked(c, old);
        }
        if (!p) {
            if (!(p = mc_prod_new(c, rb->transfer_id, P_UNKNOWN))) {
                mc_job_req_done_locked(c, job, i, 0, "producer out of memory");
                continue;
            }
            unknown_push_locked(c, p);
        }
        if (nids == 0) { /* a release ahead of its request: remembered (capped, timed) */
            p->cancelled = 1;
            p->deadline_ns = wait_deadline;
            mc_job_req_done_locked(c, job, i, 1, NULL);
            continue;
        }
        pull_part *w = malloc(sizeof *w);
        if (!w) {
            mc_job_req_done_locked(c, job, i, 0, "producer out of memory");
            continue;
        }
        *w = (pull_part){job, i, p->waiters, mc_pull_can_stream(c, pull, i)};
        p->waiters = w;
        if (p->state == P_PREFILLING && w->layerwise) {
            mc_stream_start_locked(c, p); /* its prefill runs: its layers go as computed */
        } else if (p->state == P_UNKNOWN) {
            if (!p->deadline_ns || p->deadline_ns > wait_deadline) p->deadline_ns = wait_deadline;
            if (unk) unk[n_unk++] = rb->req_id;
        } else if (p->state == P_PREFILLING) {
            /* queued or running here: no deadline (the abort timeout counts
             * from the end of the prefill); heartbeats keep D waiting */
        } else {
            mc_prod_wake_waiters_locked(c, p);
        }
    }
    if (n_unk && job->pending > 1) {
        /* Tell the decoder at once which of its requests wait for a transfer id
         * this producer does not know (yet): at its max_remote_loads it evicts
         * such a pull first, so bogus pulls cannot starve real ones. */
        side_channel_reply r = {
            .status = SIDE_CHANNEL_CONTINUE, .unknown_reqs = unk, .n_unknown = n_unk};
        side_channel_call_reply(job->call, &r);
        job->beat_ns = now;
    }
    free(unk);
    job_drop_hold_locked(c, job);
    pthread_mutex_unlock(&c->mu);
}
