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
        o->r->deadline_ns =
            clock_now_ns() + (uint64_t)((o->c->env.abort_request_timeout_s + 60) * 1e9);
        pthread_mutex_unlock(&o->c->mu);
    }
    return 0;
}

/* Find the producer's side-channel endpoint for engine_id via its bootstrap server. */
static int resolve_endpoint(mooncake_connector *c, const char *bootstrap, const char *engine_id,
                            char *ep, size_t cap, char *err, size_t errcap) {
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
    int rc = bootstrap_client_query(bootstrap, &retry, &t, err, errcap);
    if (rc) return rc;
    const char *addr = NULL;
    const bootstrap_engine *pe = NULL;
    for (size_t i = 0; i < t.n && !pe; i++)
        if (t.engines[i].engine_id && !strcmp(t.engines[i].engine_id, engine_id))
            pe = &t.engines[i];
    if (pe) { /* the prefill ranks this decode rank pulls from (tp_pull.h) */
        xfer_kv_shape sh;
        tp_pull_peer peers[8];
        int np = tp_shape_from_fingerprint(c->region.fingerprint, &sh, err, errcap);
        if (np == 0) np = tp_pull_peers(pe, &c->tp, sh.n_kv_heads, peers, 8, err, errcap);
        if (np == 1) addr = peers[0].addr;
        if (np > 1)
            snprintf(err, errcap,
                     "prefill engine %s has TP %d: decode tp_rank %d of %d must pull from %d "
                     "prefill ranks, which this connector does not do yet (docs/parallel.md)",
                     pe->engine_id, pe->tp_size, c->tp.tp_rank, c->tp.tp_size, np);
        if (np != 1) {
            bootstrap_table_free(&t);
            return -ENOTSUP;
        }
    }
    if (!addr) {
        snprintf(err, errcap, "bootstrap server %s knows no engine '%s' (remote_engine_id)",
                 bootstrap, engine_id);
        bootstrap_table_free(&t);
        return -ENOENT;
    }
    snprintf(ep, cap, "%s", addr);
    bootstrap_table_free(&t);
    return 0;
}

static void load_observe_locked(mooncake_connector *c, double s) {
    static const double b[12] = MOONCAKE_LOAD_BUCKETS;
    c->st.load_count++;
    c->st.load_sum_s += s;
    for (int i = 0; i < 12; i++)
        if (s <= b[i]) c->st.load_buckets[i]++;
}

void *mc_pull_main(void *arg) {
    cons_req *r = arg;
    mooncake_connector *c = r->c;
    uint64_t t0 = clock_now_ns();
    char ep[256], err[320] = "";
    pull_outcome o = {.c = c, .r = r, .first_token = -1};
    int status = 502, reason = FC_PRODUCER_ERROR, acked = 0;
    char my_req[32];
    snprintf(my_req, sizeof my_req, "d-%" PRIu64, r->id);
    o.my_req = my_req;
    uint64_t hold_ns = 0; /* set when a pull went out and its final reply never came */
    int rc = resolve_endpoint(c, r->bootstrap, r->remote_engine_id, ep, sizeof ep, err, sizeof err);
    if (rc == -ENOENT) {
        status = 400; /* the bootstrap server answered: the engine id is wrong */
        reason = FC_BAD_PARAMS;
    } else if (rc == -ENOTSUP) { /* the producer's TP shape cannot be pulled from here */
        reason = FC_PRODUCER_ERROR;
    } else if (rc) {
        reason = FC_BOOTSTRAP_UNREACHABLE;
    }
    if (rc == 0) {
        int bs = c->region.block_size;
        int first =
            r->n_local_tokens / bs; /* blocks before this came from the local prefix cache */
        side_channel_block_group g = {0};
        g.n = (size_t)(r->n_blocks - first);
        g.ids = malloc((g.n ? g.n : 1) * sizeof *g.ids);
        for (size_t i = 0; g.ids && i < g.n; i++)
            g.ids[i] = r->blocks[first + (int)i];
        side_channel_req_blocks rb = {my_req, r->transfer_id, &g, 1};
        uint64_t base = (uint64_t)(uintptr_t)c->region.base;
        int64_t blen = (int64_t)c->region.block_bytes;
        char host[64];
        uint16_t port = 0;
        net_split_host_port(c->segment, host, sizeof host, &port, 0);
        side_channel_pull pull = {.remote_hostname = host,
                                  .remote_port = port,
                                  .remote_tp_size = c->tp.tp_size,
                                  .remote_tp_rank = c->tp.tp_rank,
                                  .reqs = &rb,
                                  .n_reqs = 1,
                                  .kv_caches_base_addr = &base,
                                  .block_lens = &blen,
                                  .kv_block_lens = &blen,
                                  .n_regions = 1,
                                  .remote_pp_size = 1,
                                  .layout = c->region.fingerprint,
                                  .layerwise = c->cfg.layerwise};
        double timeout = c->env.abort_request_timeout_s + 60;
        if (!g.ids) {
            rc = -ENOMEM;
            status = 500;
            reason = FC_LOCAL;
            snprintf(err, sizeof err, "decoder out of memory");
        } else {
            rc = side_channel_pull_run_ex(
                ep, &pull, c->cfg.auth_secret[0] ? c->cfg.auth_secret : NULL, timeout, &r->cancel,
                CANCEL_ACK_S, &acked, on_reply, &o, err, sizeof err);
            /* Abandoned without the producer's final reply (and without its
             * acknowledgement of our cancel): its sender may still be writing
             * into these blocks, for at most its transfer deadline (30 s + 1 ns
             * per byte, Mooncake's default) — keep them out of use that long,
             * plus a margin.  An acknowledged cancel frees them at once. */
            if (rc != 0 && rc != SIDE_CHANNEL_EREFUSED && !o.done && !acked)
                hold_ns = 35 * 1000000000ull + (uint64_t)g.n * (uint64_t)c->region.block_bytes;
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
                reason = FC_CANCELLED;
            else if (rc == SIDE_CHANNEL_ETIMEDOUT)
                status = 504, reason = FC_TIMEOUT;
            else if (rc != 0)
                reason = FC_PRODUCER_UNREACHABLE;
        }
        free(g.ids);
        if (rc == 0 && !o.ok && !o.err[0])
            snprintf(o.err, sizeof o.err, "producer's reply did not list this request");
        if (rc == 0 && !o.ok) snprintf(err, sizeof err, "%s", o.err);
        if (rc == SIDE_CHANNEL_ECANCELED && r->unreachable) {
            snprintf(err, sizeof err,
                     "producer unreachable: its bootstrap server %s stopped answering",
                     r->bootstrap);
            reason = FC_PRODUCER_UNREACHABLE;
        } else if (rc == SIDE_CHANNEL_ECANCELED && r->evicted) {
            snprintf(err, sizeof err,
                     "too many remote KV loads in flight: evicted to make room "
                     "(kv_connector_extra_config.max_remote_loads %d) -- the producer %s did not "
                     "know this transfer id",
                     c->cfg.max_remote_loads, ep);
            status = 503;
            reason = FC_EVICTED;
        } else if (rc == SIDE_CHANNEL_ECANCELED && r->timed_out) {
            snprintf(err, sizeof err, "no KV from producer %s within the decoder's deadline", ep);
            status = 504;
            reason = FC_TIMEOUT;
        }
    }
    int ok = rc == 0 && o.ok;
    double secs = (double)(clock_now_ns() - t0) / 1e9;
    if (!ok)
        LOG_W(MOD, "request %" PRIu64 " (transfer %s): remote KV load failed: %s", r->id,
              r->transfer_id, err);
    char msg[400];
    snprintf(msg, sizeof msg, "remote prefill failed (transfer %s): %s", r->transfer_id, err);
    int recompute = c->cfg.load_failure_policy == KV_LOAD_FAILURE_RECOMPUTE;
    pthread_mutex_lock(&c->mu); /* counted before the client can see the outcome */
    if (ok) {
        c->st.pulls_ok++;
        if (o.layerwise) c->st.layerwise_pulled++;
        load_observe_locked(c, secs);
    } else {
        c->st.pulls_failed++;
        c->fail_c[reason]++;
    }
    pthread_mutex_unlock(&c->mu);
    if (ok)
        engine_kv_load_done_streamed(
            c->eng, r->id, o.first_token >= 0 && c->cfg.first_token_handoff ? o.first_token : -1,
            o.layerwise);
    else
        engine_kv_load_failed(c->eng, r->id, recompute, hold_ns, status, msg);
    pthread_mutex_lock(&c->mu);
    c->st.loading--;
    c->n_pull_threads--;
    if (r->evicted) c->n_evicting--;
    r->loading = 0;
    mc_cons_maybe_free_locked(c, r);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
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
    char ep[256], err[320] = "", host[64];
    int rc = resolve_endpoint(c, j->bootstrap, j->engine_id, ep, sizeof ep, err, sizeof err);
    if (rc == 0) {
        static atomic_uint seq;
        char req[48];
        snprintf(req, sizeof req, "d-release-%u", atomic_fetch_add(&seq, 1));
        side_channel_block_group g = {0};
        side_channel_req_blocks rb = {req, j->transfer_id, &g, 1};
        uint64_t base = (uint64_t)(uintptr_t)c->region.base;
        int64_t blen = (int64_t)c->region.block_bytes;
        uint16_t port = 0;
        net_split_host_port(c->segment, host, sizeof host, &port, 0);
        side_channel_pull pull = {.remote_hostname = host,
                                  .remote_port = port,
                                  .remote_tp_size = c->tp.tp_size,
                                  .remote_tp_rank = c->tp.tp_rank,
                                  .reqs = &rb,
                                  .n_reqs = 1,
                                  .kv_caches_base_addr = &base,
                                  .block_lens = &blen,
                                  .kv_block_lens = &blen,
                                  .n_regions = 1,
                                  .remote_pp_size = 1,
                                  .layout = c->region.fingerprint};
        rc = side_channel_pull_run_ex(ep, &pull, c->cfg.auth_secret[0] ? c->cfg.auth_secret : NULL,
                                      RELEASE_TIMEOUT_S, &c->release_cancel, 0, NULL, NULL, NULL,
                                      err, sizeof err);
    }
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
