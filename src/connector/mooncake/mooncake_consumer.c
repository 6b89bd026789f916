/* mooncake_consumer — D's side: pulls to producers, bootstrap lookups, releases
 * (mooncake_internal.h). */
#include "connector/mooncake/mooncake_internal.h"

/* ---- consumer: pulls ------------------------------------------------------------ */

typedef struct pull_outcome {
    mooncake_connector *c;
    cons_req *r;
    const char *my_req;
    int ok;              /* our request was in ok_reqs */
    int done;            /* a final reply came */
    int32_t first_token; /* P's first output token for our request ("disagg_first_tokens"), -1 */
    int layerwise;       /* P streamed our request's KV layer by layer ("disagg_layerwise") */
    char err[320];
} pull_outcome;

static int on_reply(void *ud, const side_channel_reply *r) {
    pull_outcome *o = ud;
    for (size_t i = 0; i < r->n_ok; i++)
        if (!strcmp(r->ok_reqs[i], o->my_req)) o->ok = 1;
    for (size_t i = 0; i < r->n_err; i++)
        if (!strcmp(r->err_reqs[i], o->my_req)) {
            o->ok = 0;
            snprintf(o->err, sizeof o->err, "producer failed the transfer: %s",
                     r->err_msg ? r->err_msg : "no reason given");
        }
    if (r->status == SIDE_CHANNEL_ERROR) {
        o->ok = 0;
        snprintf(o->err, sizeof o->err, "producer refused the pull: %s",
                 r->err_msg ? r->err_msg : "no reason given");
    }
    for (size_t i = 0; i < r->n_ft; i++)
        if (!strcmp(r->ft_reqs[i], o->my_req)) o->first_token = r->ft_tokens[i];
    for (size_t i = 0; i < r->n_lw; i++)
        if (!strcmp(r->lw_reqs[i], o->my_req)) o->layerwise = 1;
    if (r->status != SIDE_CHANNEL_CONTINUE) {
        o->done = 1;
    } else { /* the producer is alive and still has the request: extend the deadline */
        int unknown = 0;
        for (size_t i = 0; i < r->n_unknown; i++)
            if (!strcmp(r->unknown_reqs[i], o->my_req)) unknown = 1;
        pthread_mutex_lock(&o->c->mu);
        o->r->p_unknown = unknown;
        if (!o->r->pool) /* a pool fetch keeps its short deadline */
            o->r->deadline_ns =
                clock_now_ns() + (uint64_t)((o->c->env.abort_request_timeout_s + 60) * 1e9);
        pthread_mutex_unlock(&o->c->mu);
    }
    return 0;
}

/* One pull of a transfer: decode rank d_rank's heads from the prefill rank at addr. */
typedef struct pull_target {
    int d_rank;
    char addr[160]; /* the prefill rank's side channel */
} pull_target;

/* Every pull of a transfer, found via the producer's bootstrap server: for each rank of this
 * instance, the prefill ranks it pulls from (tp_pull.h, vLLM's TpKVTopology).  *n of them
 * into tg (room for MC_PULL_TARGETS).  0; -ENOENT: no such engine; -ENOTSUP: its TP shape
 * cannot be pulled from here; else the bootstrap server did not answer. */
static int resolve_targets(mooncake_connector *c, const char *bootstrap, const char *engine_id,
                           pull_target *tg, int *n, char *err, size_t errcap) {
    /* A bootstrap server answers /query from its own thread in microseconds:
     * one that accepts but does not answer (a hung or stopped producer, a
     * wrong address) is gone.  Each attempt gets LOOKUP_ANSWER_S (or the
     * connector timeout when shorter), two attempts 0.5 s apart: the request
     * fails within about 5 s, not 2 x VLLM_MOONCAKE_CONNECTOR_TIMEOUT. */
    bootstrap_retry retry;
    bootstrap_retry_init(&retry, c->env.connector_timeout_s < LOOKUP_ANSWER_S
                                     ? c->env.connector_timeout_s
                                     : LOOKUP_ANSWER_S);
    retry.attempts = 2;
    retry.backoff_s = 0.5;
    bootstrap_table t;
    *n = 0;
    int rc = bootstrap_client_query(bootstrap, &retry, &t, err, errcap);
    if (rc) return rc;
    const bootstrap_engine *pe = NULL;
    for (size_t i = 0; i < t.n && !pe; i++)
        if (t.engines[i].engine_id && !strcmp(t.engines[i].engine_id, engine_id))
            pe = &t.engines[i];
    if (!pe) {
        snprintf(err, errcap, "bootstrap server %s knows no engine '%s' (remote_engine_id)",
                 bootstrap, engine_id);
        bootstrap_table_free(&t);
        return -ENOENT;
    }
    xfer_kv_shape sh;
    rc = tp_shape_from_fingerprint(c->region.fingerprint, &sh, err, errcap);
    for (int d = 0; rc == 0 && d < c->tp.tp_size; d++) {
        tp_local dl = {c->tp.tp_size, d};
        tp_pull_peer peers[MC_TP_MAX];
        int np = tp_pull_peers(pe, &dl, sh.n_kv_heads, peers, MC_TP_MAX, err, errcap);
        if (np < 0) {
            rc = np;
            break;
        }
        for (int i = 0; i < np && *n < MC_PULL_TARGETS; i++) {
            tg[*n].d_rank = d;
            snprintf(tg[*n].addr, sizeof tg[*n].addr, "%s", peers[i].addr);
            (*n)++;
        }
    }
    bootstrap_table_free(&t);
    return rc ? -ENOTSUP : 0;
}

/* The pull message of decode rank d_rank for rb (its region, its TP shape). */
static void pull_message(mooncake_connector *c, int d_rank, side_channel_req_blocks *rb, char *host,
                         size_t host_cap, uint64_t *base, int64_t *blen, side_channel_pull *pull) {
    uint16_t port = 0;
    net_split_host_port(c->segment, host, host_cap, &port, 0);
    *base = (uint64_t)(uintptr_t)c->rank_region[d_rank].base;
    *blen = (int64_t)c->rank_region[d_rank].block_bytes;
    *pull = (side_channel_pull){.remote_hostname = host,
                                .remote_port = port,
                                .remote_tp_size = c->tp.tp_size,
                                .remote_tp_rank = d_rank,
                                .reqs = rb,
                                .n_reqs = 1,
                                .kv_caches_base_addr = base,
                                .block_lens = blen,
                                .kv_block_lens = blen,
                                .n_regions = 1,
                                .remote_pp_size = 1,
                                .layout = c->region.fingerprint};
}

/* Tell the prefill ranks tg (n) that transfer_id will not be pulled (a pull with no block
 * ids, what vLLM's decoder sends), each within RELEASE_TIMEOUT_S; *cancel stops them.
 * Returns how many failed (err: the last reason). */
static int release_targets(mooncake_connector *c, const pull_target *tg, int n,
                           const char *transfer_id, atomic_int *cancel, char *err, size_t errcap) {
    static atomic_uint seq;
    int failed = 0;
    for (int i = 0; i < n; i++) {
        char req[48], host[64];
        snprintf(req, sizeof req, "d-release-%u", atomic_fetch_add(&seq, 1));
        side_channel_block_group g = {0};
        side_channel_req_blocks rb = {req, (char *)transfer_id, &g, 1};
        uint64_t base;
        int64_t blen;
        side_channel_pull pull;
        pull_message(c, tg[i].d_rank, &rb, host, sizeof host, &base, &blen, &pull);
        if (side_channel_pull_run_ex(tg[i].addr, &pull,
                                     c->cfg.auth_secret[0] ? c->cfg.auth_secret : NULL,
                                     RELEASE_TIMEOUT_S, cancel, 0, NULL, NULL, NULL, err, errcap))
            failed++;
    }
    return failed;
}

static void load_observe_locked(mooncake_connector *c, double s) {
    static const double b[12] = MOONCAKE_LOAD_BUCKETS;
    c->st.load_count++;
    c->st.load_sum_s += s;
    for (int i = 0; i < 12; i++)
        if (s <= b[i]) c->st.load_buckets[i]++;
}

/* One pull (decode rank tg->d_rank's heads from the prefill rank at tg->addr) of r's blocks
 * after its local prefix.  0 when the producer listed our request as written; otherwise
 * err, *status, *reason say why and *hold_ns how long the blocks must stay out of use. */
static int pull_one(mooncake_connector *c, cons_req *r, const pull_target *tg, pull_outcome *o,
                    int *status, int *reason, uint64_t *hold_ns, char *err, size_t errcap) {
    int bs = c->region.block_size, acked = 0;
    int first = r->n_local_tokens / bs; /* blocks before this came from the local prefix cache */
    side_channel_block_group g = {0};
    g.n = (size_t)((r->pool ? r->pool_tokens / bs : r->n_blocks) - first);
    g.ids = malloc((g.n ? g.n : 1) * sizeof *g.ids);
    if (!g.ids) {
        *status = 500;
        *reason = FC_LOCAL;
        snprintf(err, errcap, "decoder out of memory");
        return -ENOMEM;
    }
    for (size_t i = 0; i < g.n; i++)
        g.ids[i] = r->blocks[first + (int)i];
    side_channel_req_blocks rb = {(char *)o->my_req, r->transfer_id, &g, 1};
    char host[64];
    uint64_t base;
    int64_t blen;
    side_channel_pull pull;
    pull_message(c, tg->d_rank, &rb, host, sizeof host, &base, &blen, &pull);
    pull.layerwise = !r->pool && c->cfg.layerwise && c->tp.tp_size == 1;
    int64_t *ptok = NULL;
    if (r->pool) { /* a pool fetch: the holder pins the cached blocks of these tokens */
        ptok = malloc((size_t)r->pool_tokens * sizeof *ptok);
        if (!ptok) {
            free(g.ids);
            *reason = FC_LOCAL;
            snprintf(err, errcap, "decoder out of memory");
            return -ENOMEM;
        }
        for (int i = 0; i < r->pool_tokens; i++)
            ptok[i] = r->tokens[i];
        pull.pool_tokens = ptok;
        pull.n_pool_tokens = (size_t)r->pool_tokens;
    }
    o->ok = o->done = 0;
    o->err[0] = 0;
    double timeout = r->pool ? POOL_TIMEOUT_S : c->env.abort_request_timeout_s + 60;
    int rc = side_channel_pull_run_ex(tg->addr, &pull,
                                      c->cfg.auth_secret[0] ? c->cfg.auth_secret : NULL, timeout,
                                      &r->cancel, CANCEL_ACK_S, &acked, on_reply, o, err, errcap);
    /* Abandoned without the producer's final reply (and without its
     * acknowledgement of our cancel): its sender may still be writing
     * into these blocks, for at most its transfer deadline (30 s + 1 ns
     * per byte, Mooncake's default) — keep them out of use that long,
     * plus a margin.  An acknowledged cancel frees them at once. */
    if (rc != 0 && rc != SIDE_CHANNEL_EREFUSED && !o->done && !acked)
        *hold_ns = 35 * 1000000000ull + (uint64_t)g.n * (uint64_t)c->region.block_bytes;
    if (rc == SIDE_CHANNEL_ECANCELED) {
        pthread_mutex_lock(&c->mu);
        if (atomic_load(&r->cancel) == SIDE_CHANNEL_CANCEL_ASK) {
            if (acked)
                c->cancel_acked++;
            else
                c->cancel_unacked++;
        }
        pthread_mutex_unlock(&c->mu);
    }
    if (rc == SIDE_CHANNEL_ECANCELED)
        *reason = FC_CANCELLED;
    else if (rc == SIDE_CHANNEL_ETIMEDOUT)
        *status = 504, *reason = FC_TIMEOUT;
    else if (rc != 0)
        *reason = FC_PRODUCER_UNREACHABLE;
    free(g.ids);
    free(ptok);
    if (rc == 0 && !o->ok && !o->err[0])
        snprintf(o->err, sizeof o->err, "producer's reply did not list this request");
    if (rc == 0 && !o->ok) snprintf(err, errcap, "%s", o->err);
    if (rc == SIDE_CHANNEL_ECANCELED && r->unreachable) {
        snprintf(err, errcap, "producer unreachable: its bootstrap server %s stopped answering",
                 r->bootstrap);
        *reason = FC_PRODUCER_UNREACHABLE;
    } else if (rc == SIDE_CHANNEL_ECANCELED && r->evicted) {
        snprintf(err, errcap,
                 "too many remote KV loads in flight: evicted to make room "
                 "(kv_connector_extra_config.max_remote_loads %d) -- the producer %s did not "
                 "know this transfer id",
                 c->cfg.max_remote_loads, tg->addr);
        *status = 503;
        *reason = FC_EVICTED;
    } else if (rc == SIDE_CHANNEL_ECANCELED && r->timed_out) {
        snprintf(err, errcap, "no KV from producer %s within the decoder's deadline", tg->addr);
        *status = 504;
        *reason = FC_TIMEOUT;
    }
    return rc == 0 && o->ok ? 0 : rc ? rc : -EIO;
}

/* The end of a pull thread: its load is no longer in flight; r is freed if nothing else
 * holds it. */
static void pull_thread_done(mooncake_connector *c, cons_req *r) {
    pthread_mutex_lock(&c->mu);
    c->st.loading--;
    c->n_pull_threads--;
    if (r->evicted) c->n_evicting--;
    r->loading = 0;
    mc_cons_maybe_free_locked(c, r);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* The end of a pool fetch's pull thread: counted, the engine told (the prefix, or compute
 * it all here), the thread's hold on r dropped. */
static void pool_ended(mooncake_connector *c, cons_req *r, int ok, int reason, double secs,
                       uint64_t hold_ns, const char *err) {
    int bs = c->region.block_size;
    int n_blocks = r->pool_tokens / bs - r->n_local_tokens / bs;
    double bytes = (double)n_blocks * (double)c->region.block_bytes * c->tp.tp_size;
    int fb = strstr(err, "no longer holds")                    ? PF_EVICTED
             : reason == FC_TIMEOUT                            ? PF_TIMEOUT
             : reason == FC_PRODUCER_UNREACHABLE ||
                     reason == FC_BOOTSTRAP_UNREACHABLE        ? PF_UNREACHABLE
             : reason == FC_LOCAL                              ? PF_BUSY
                                                               : PF_ERROR;
    if (ok)
        LOG_D(MOD, "request %" PRIu64 ": pool fetch of %d blocks from %s in %.2f ms", r->id,
              n_blocks, r->bootstrap, secs * 1e3);
    else
        LOG_W(MOD, "request %" PRIu64 ": pool fetch from %s failed (%s); computing the prompt",
              r->id, r->bootstrap, err);
    pthread_mutex_lock(&c->mu); /* counted before the client can see the outcome */
    if (ok) {
        c->pool_fetched++;
        c->pool_blocks += (uint64_t)n_blocks;
        c->pool_bytes += (uint64_t)bytes;
        c->pool_seconds += secs;
        double spb = bytes > 0 ? secs / bytes : 0;
        c->pool_s_per_byte = c->pool_s_per_byte > 0 ? 0.8 * c->pool_s_per_byte + 0.2 * spb : spb;
    } else {
        c->pool_fallbacks[fb]++;
    }
    pthread_mutex_unlock(&c->mu);
    if (ok) {
        engine_kv_load_done_prefix(c->eng, r->id, r->pool_tokens);
    } else {
        char msg[400];
        snprintf(msg, sizeof msg, "pool fetch from %s failed: %s", r->bootstrap, err);
        engine_kv_load_failed(c->eng, r->id, 1, hold_ns, 0, msg);
    }
    pull_thread_done(c, r);
}

void *mc_pull_main(void *arg) {
    cons_req *r = arg;
    mooncake_connector *c = r->c;
    uint64_t t0 = clock_now_ns();
    char err[320] = "";
    pull_outcome o = {.c = c, .r = r, .first_token = -1};
    int status = 502, reason = FC_PRODUCER_ERROR;
    char my_req[32];
    snprintf(my_req, sizeof my_req, "d-%" PRIu64, r->id);
    o.my_req = my_req;
    uint64_t hold_ns = 0; /* set when a pull went out and its final reply never came */
    pull_target tg[MC_PULL_TARGETS];
    int nt = 0, done = 0;
    int rc = resolve_targets(c, r->bootstrap, r->remote_engine_id, tg, &nt, err, sizeof err);
    if (rc == -ENOENT) {
        status = 400; /* the bootstrap server answered: the engine id is wrong */
        reason = FC_BAD_PARAMS;
    } else if (rc == -ENOTSUP) { /* the producer's TP shape cannot be pulled from here */
        reason = FC_PRODUCER_ERROR;
    } else if (rc) {
        reason = FC_BOOTSTRAP_UNREACHABLE;
    }
    /* one pull per pair of decode rank and prefill rank, in turn: every one must succeed */
    int layerwise = 1;
    for (; rc == 0 && done < nt; done++) {
        o.layerwise = 0;
        rc = pull_one(c, r, &tg[done], &o, &status, &reason, &hold_ns, err, sizeof err);
        if (rc && nt > 1) {
            char e2[320];
            snprintf(e2, sizeof e2, "%s (decode tp_rank %d from prefill %s, pull %d of %d)", err,
                     tg[done].d_rank, tg[done].addr, done + 1, nt);
            snprintf(err, sizeof err, "%s", e2);
        }
        layerwise &= o.layerwise;
    }
    int ok = rc == 0;
    double secs = (double)(clock_now_ns() - t0) / 1e9;
    if (r->pool) {
        pool_ended(c, r, ok, reason, secs, hold_ns, err);
        return NULL;
    }
    if (!ok)
        LOG_W(MOD, "request %" PRIu64 " (transfer %s): remote KV load failed: %s", r->id,
              r->transfer_id, err);
    char msg[400];
    snprintf(msg, sizeof msg, "remote prefill failed (transfer %s): %s", r->transfer_id, err);
    int recompute = c->cfg.load_failure_policy == KV_LOAD_FAILURE_RECOMPUTE;
    pthread_mutex_lock(&c->mu); /* counted before the client can see the outcome */
    if (ok) {
        c->st.pulls_ok++;
        if (layerwise) c->st.layerwise_pulled++;
        load_observe_locked(c, secs);
    } else {
        c->st.pulls_failed++;
        c->fail_c[reason]++;
    }
    pthread_mutex_unlock(&c->mu);
    if (ok)
        engine_kv_load_done_streamed(
            c->eng, r->id, o.first_token >= 0 && c->cfg.first_token_handoff ? o.first_token : -1,
            layerwise);
    else
        engine_kv_load_failed(c->eng, r->id, recompute, hold_ns, status, msg);
    /* A pull of several that failed: the other prefill ranks may still keep the request's
     * blocks (those not pulled yet, and ours when one P process serves every rank, which
     * frees them after the last pull): tell every rank, the failed one last, after the
     * request failed (a dead rank must not delay the error).  A rank already pulled has
     * nothing left to free and answers at once. */
    if (!ok && done > 0 && nt > 1) {
        pull_target rel[MC_PULL_TARGETS];
        int nr = 0;
        for (int i = 0; i < nt; i++)
            if (i != done - 1) rel[nr++] = tg[i];
        rel[nr++] = tg[done - 1];
        char rerr[320] = "";
        int nf = release_targets(c, rel, nr, r->transfer_id, &c->release_cancel, rerr, sizeof rerr);
        if (nf)
            LOG_W(MOD, "transfer %s: %d of %d prefill ranks not told to release its KV: %s",
                  r->transfer_id, nf, nr, rerr);
    }
    pull_thread_done(c, r);
    return NULL;
}

/* ---- consumer: "release your blocks" ----------------------------------------------- */

/* Tell the producer that its KV for transfer_id will not be pulled: a pull
 * whose request has no block ids, as vLLM's decoder sends for a request it
 * will not load (so a vLLM producer frees them too).  Bounded: the lookup
 * (about 5 s) and RELEASE_TIMEOUT_S for the answer. */
static void *release_main(void *arg) {
    release_job *j = arg;
    mooncake_connector *c = j->c;
    char err[320] = "";
    pull_target tg[MC_PULL_TARGETS];
    int nt = 0;
    int rc = resolve_targets(c, j->bootstrap, j->engine_id, tg, &nt, err, sizeof err);
    if (rc == 0 && release_targets(c, tg, nt, j->transfer_id, &c->release_cancel, err, sizeof err))
        rc = -EIO;
    if (rc)
        LOG_W(MOD, "transfer %s: telling the producer to release its KV failed: %s", j->transfer_id,
              err);
    else
        LOG_D(MOD, "transfer %s: the producer was told to release its KV", j->transfer_id);
    pthread_mutex_lock(&c->mu);
    c->n_releases--;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    free(j);
    return NULL;
}

/* Start telling the producer (at most MAX_RELEASES at once; beyond, its abort
 * timeout frees the blocks).  Caller does not hold mu. */
void mc_release_remote(mooncake_connector *c, const char *bootstrap, const char *engine_id,
                       const char *transfer_id) {
    release_job *j = calloc(1, sizeof *j);
    pthread_mutex_lock(&c->mu);
    int ok = j && !c->stop && c->n_releases < MAX_RELEASES;
    if (ok)
        c->n_releases++;
    else if (c->releases_dropped++ % 100 == 0)
        LOG_W(MOD,
              "transfer %s: %d releases already in flight: the producer keeps this KV until "
              "its abort timeout (%" PRIu64 " releases not sent so far)",
              transfer_id, MAX_RELEASES, c->releases_dropped);
    pthread_mutex_unlock(&c->mu);
    if (!ok) {
        free(j);
        return;
    }
    j->c = c;
    snprintf(j->transfer_id, sizeof j->transfer_id, "%s", transfer_id);
    snprintf(j->engine_id, sizeof j->engine_id, "%s", engine_id);
    snprintf(j->bootstrap, sizeof j->bootstrap, "%s", bootstrap);
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &at, release_main, j);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        free(j);
        pthread_mutex_lock(&c->mu);
        c->n_releases--;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
}
