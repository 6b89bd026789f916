/* mooncake_connector — the engine hooks, the reaper, lifecycle and metrics (mooncake_internal.h).
 */
#include "connector/mooncake/mooncake_internal.h"

#include "base/uuid.h"

/* Failure reasons as the metrics name them (FP_* producer, FC_* consumer). */
static const char *const FP_NAMES[FP_COUNT] = {"unknown_transfer", "prefill_ended", "write_failed",
                                               "refused",          "cancelled",     "bad_params"};
static const char *const FC_NAMES[FC_COUNT] = {"bad_params",
                                               "bootstrap_unreachable",
                                               "producer_unreachable",
                                               "producer_error",
                                               "timeout",
                                               "cancelled",
                                               "decoder",
                                               "evicted",
                                               "too_many_loads"};

/* ---- engine hooks ---------------------------------------------------------------- */

static const char *jstr(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* remote_bootstrap_addr as bootstrap_client accepts it: "[http://]host:port[/]". */
static int bootstrap_addr_ok(const char *s) {
    if (strlen(s) >= 256) return 0;
    if (!strncmp(s, "http://", 7)) s += 7;
    char tmp[256], host[256];
    snprintf(tmp, sizeof tmp, "%s", s);
    size_t n = strlen(tmp);
    if (n && tmp[n - 1] == '/') tmp[n - 1] = '\0';
    uint16_t port = 0;
    return net_split_host_port(tmp, host, sizeof host, &port, 0) == 0 && host[0] &&
           !strchr(host, '/') && !strchr(host, ' ');
}

/* The JSON kind of o[k] for messages; "nothing" when absent. */
static const char *kind_of(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return v ? text_json_kind(v) : "nothing";
}

/* ---- pool fetch: kv_transfer_params.pool_source (docs/kv_pool.md) ------------------ */

typedef struct pool_source {
    char engine_id[ID_MAX];
    char bootstrap[256];
    int n_tokens; /* the prefix the holder caches, in tokens */
} pool_source;

/* Reads kv_transfer_params.pool_source: 0 when absent or null, 1 with *ps, -1 with err. */
static int parse_pool_source(mooncake_connector *c, json_t *o, int n_prompt, int remote_prefill,
                             pool_source *ps, char *err, size_t errlen) {
    json_t *v = json_object_get(o, "pool_source");
    if (!v || json_is_null(v)) return 0;
    static const char accepted[] = "{\"remote_engine_id\": the holder's engine id, "
                                   "\"remote_bootstrap_addr\": \"http://host:port\" of its "
                                   "bootstrap server, \"num_tokens\": the prefix it holds, in "
                                   "tokens}";
    if (!json_is_object(v)) {
        snprintf(err, errlen, "kv_transfer_params.pool_source must be an object %s, got %s",
                 accepted, text_json_kind(v));
        return -1;
    }
    const char *key;
    json_t *x;
    json_object_foreach(v, key, x) {
        if (strcmp(key, "remote_engine_id") && strcmp(key, "remote_bootstrap_addr") &&
            strcmp(key, "num_tokens")) {
            snprintf(err, errlen,
                     "kv_transfer_params.pool_source has an unknown key '%.64s'; accepted: %s", key,
                     accepted);
            return -1;
        }
    }
    if (remote_prefill) {
        snprintf(err, errlen,
                 "kv_transfer_params.pool_source cannot be combined with do_remote_prefill: the "
                 "producer sends the whole prompt's KV");
        return -1;
    }
    if (!is_consumer_role(c)) {
        snprintf(err, errlen,
                 "kv_transfer_params.pool_source needs kv_role kv_consumer or kv_both (this "
                 "instance pulls the prefix); this instance is %s",
                 kv_role_name(c->cfg.role));
        return -1;
    }
    const char *eid = jstr(v, "remote_engine_id"), *boot = jstr(v, "remote_bootstrap_addr");
    json_t *nt = json_object_get(v, "num_tokens");
    if (!eid || !*eid || strlen(eid) >= ID_MAX) {
        snprintf(err, errlen,
                 "kv_transfer_params.pool_source.remote_engine_id must be a non-empty string "
                 "(below %d bytes), got %s",
                 ID_MAX, kind_of(v, "remote_engine_id"));
        return -1;
    }
    if (!strcmp(eid, c->cfg.engine_id)) {
        snprintf(err, errlen,
                 "kv_transfer_params.pool_source.remote_engine_id '%s' is this instance: a pool "
                 "source is another instance",
                 eid);
        return -1;
    }
    if (!boot || !bootstrap_addr_ok(boot)) {
        snprintf(err, errlen,
                 "kv_transfer_params.pool_source.remote_bootstrap_addr %s%.200s%s is not "
                 "accepted; accepted: \"http://host:port\" or \"host:port\" (port 1..65535)",
                 boot ? "'" : "", boot ? boot : kind_of(v, "remote_bootstrap_addr"),
                 boot ? "'" : "");
        return -1;
    }
    if (!json_is_integer(nt) || json_integer_value(nt) < 1 ||
        json_integer_value(nt) > n_prompt) {
        char shown[64];
        if (json_is_integer(nt))
            snprintf(shown, sizeof shown, "%lld", (long long)json_integer_value(nt));
        else
            snprintf(shown, sizeof shown, "%s", kind_of(v, "num_tokens"));
        snprintf(err, errlen,
                 "kv_transfer_params.pool_source.num_tokens must be an integer from 1 to the "
                 "prompt's %d tokens, got %s",
                 n_prompt, shown);
        return -1;
    }
    snprintf(ps->engine_id, sizeof ps->engine_id, "%s", eid);
    snprintf(ps->bootstrap, sizeof ps->bootstrap, "%s", boot);
    ps->n_tokens = (int)json_integer_value(nt);
    return 1;
}

/* pool_fetch auto: is pulling n_blocks blocks faster than computing their n_tokens here?
 * The transfer: the blocks' bytes x the seconds per byte the previous fetches took (their
 * round trips included); the prefill: the tokens x the seconds per token of the engine's
 * prefill steps.  Before either is measured: yes (the fetch measures).  Every 16th fetch
 * judged slower is taken anyway, so that the estimate follows the links and the load.
 * Caller holds mu. */
static int pool_worth_it_locked(mooncake_connector *c, int n_tokens, int n_blocks) {
    if (c->cfg.pool_fetch == KV_POOL_FETCH_ALWAYS) return 1;
    engine_stats st;
    engine_get_stats(c->eng, &st);
    if (!st.prefill_forward_tokens || c->pool_s_per_byte <= 0) return 1;
    double prefill_s = (double)n_tokens * (double)st.prefill_forward_ns / 1e9 /
                       (double)st.prefill_forward_tokens;
    double bytes = (double)n_blocks * (double)c->region.block_bytes * c->tp.tp_size;
    double xfer_s = bytes * c->pool_s_per_byte;
    if (xfer_s < prefill_s) return 1;
    LOG_D(MOD, "pool fetch of %d tokens not taken: transfer %.3f ms estimated, prefill %.3f ms",
          n_tokens, xfer_s * 1e3, prefill_s * 1e3);
    return (c->pool_skipped[PS_COST] + 1) % 16 == 0;
}

/* The pool fetch of a request whose kv_transfer_params name a pool source: a cons_req, or
 * NULL (counted as skipped: nothing worth pulling, or pool_fetch says no). */
static cons_req *pool_fetch_new(mooncake_connector *c, uint64_t id, const pool_source *ps,
                                const int32_t *prompt, int n_prompt) {
    int bs = c->region.block_size;
    int upto = ps->n_tokens < n_prompt - 1 ? ps->n_tokens : n_prompt - 1; /* last: logits */
    int n_blocks = upto > 0 ? upto / bs : 0;
    pthread_mutex_lock(&c->mu);
    int skip = c->cfg.pool_fetch == KV_POOL_FETCH_NEVER ? PS_NEVER
               : n_blocks == 0                          ? PS_SHORT
               : !pool_worth_it_locked(c, n_blocks * bs, n_blocks) ? PS_COST
                                                                   : -1;
    if (skip >= 0) {
        c->pool_skipped[skip]++;
        pthread_mutex_unlock(&c->mu);
        return NULL;
    }
    pthread_mutex_unlock(&c->mu);
    cons_req *r = calloc(1, sizeof *r);
    int32_t *tok = malloc((size_t)n_blocks * bs * sizeof *tok);
    if (!r || !tok) {
        free(r);
        free(tok);
        return NULL;
    }
    memcpy(tok, prompt, (size_t)n_blocks * bs * sizeof *tok);
    char u[UUID_STR_LEN + 1];
    uuid4(u);
    r->c = c;
    r->id = id;
    r->n_prompt = n_prompt;
    r->pool = 1;
    r->tokens = tok;
    r->pool_tokens = n_blocks * bs;
    snprintf(r->transfer_id, sizeof r->transfer_id, POOL_TX_PREFIX "%s", u);
    snprintf(r->remote_engine_id, sizeof r->remote_engine_id, "%s", ps->engine_id);
    snprintf(r->bootstrap, sizeof r->bootstrap, "%s", ps->bootstrap);
    return r;
}

static int classify(void *ctx, uint64_t id, const char *kv_params, const int32_t *prompt,
                    int n_prompt, void **out, char *err, size_t errlen) {
    mooncake_connector *c = ctx;
    *out = NULL;
    json_error_t je;
    json_t *o = json_loads(kv_params, 0, &je);
    if (!o || json_is_null(o)) {
        json_decref(o);
        return o ? KV_REQ_LOCAL
                 : (snprintf(err, errlen, "kv_transfer_params is not valid JSON: %s", je.text), -1);
    }
    if (!json_is_object(o)) {
        json_decref(o);
        snprintf(err, errlen, "kv_transfer_params must be an object or null");
        return -1;
    }
    int remote_decode = json_is_true(json_object_get(o, "do_remote_decode"));
    int remote_prefill = json_is_true(json_object_get(o, "do_remote_prefill"));
    const char *tid = jstr(o, "transfer_id");
    int role = KV_REQ_LOCAL;
    handle *h = NULL;
    const char *bad_flag = NULL;
    static const char *const FLAGS[2] = {"do_remote_decode", "do_remote_prefill"};
    for (int i = 0; i < 2 && !bad_flag; i++) {
        json_t *v = json_object_get(o, FLAGS[i]);
        if (v && !json_is_boolean(v) && !json_is_null(v)) bad_flag = FLAGS[i];
    }
    if (bad_flag) {
        snprintf(err, errlen, "kv_transfer_params.%s must be true or false, got %s", bad_flag,
                 kind_of(o, bad_flag));
        role = -1;
    } else if (remote_decode && remote_prefill) {
        snprintf(err, errlen,
                 "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true");
        role = -1;
    } else if (remote_decode || remote_prefill) {
        if (!tid || !*tid || strlen(tid) >= ID_MAX) {
            snprintf(err, errlen,
                     "kv_transfer_params.transfer_id must be a non-empty string (below %d bytes)",
                     ID_MAX);
            role = -1;
        }
    }
    pool_source ps;
    int has_pool = 0;
    if (role == 0) {
        has_pool = parse_pool_source(c, o, n_prompt, remote_prefill, &ps, err, errlen);
        if (has_pool < 0) role = -1;
    }
    if (role == 0 && remote_decode) {
        if (!is_producer_role(c)) {
            snprintf(err, errlen,
                     "do_remote_decode needs kv_role kv_producer or kv_both; this instance is %s",
                     kv_role_name(c->cfg.role));
            role = -1;
        } else {
            pthread_mutex_lock(&c->mu);
            prod_req *p = mc_prod_find(c, tid);
            if (p && p->state != P_UNKNOWN) {
                snprintf(err, errlen, "kv_transfer_params.transfer_id '%s' is already in use", tid);
                role = -1;
            } else if (!p && !(p = mc_prod_new(c, tid, P_PREFILLING))) {
                snprintf(err, errlen, "out of memory");
                role = -1;
            } else {
                if (p->state == P_UNKNOWN) mc_unknown_remove_locked(c, p);
                p->state = P_PREFILLING;
                p->deadline_ns = 0; /* pulls waiting for it now wait for the prefill */
                uint64_t now = clock_now_ns();
                for (pull_part *w = p->waiters; w; w = w->next) { /* "known now" */
                    side_channel_reply cr = {.status = SIDE_CHANNEL_CONTINUE};
                    side_channel_call_reply(w->job->call, &cr);
                    w->job->beat_ns = now;
                }
                p->id = id;
                h = malloc(sizeof *h);
                if (h) *h = (handle){1, p, NULL};
                role = KV_REQ_REMOTE_DECODE;
                mc_stream_start_locked(c, p); /* a streaming pull came ahead of it */
            }
            pthread_mutex_unlock(&c->mu);
        }
    } else if (role == 0 && remote_prefill) {
        const char *eid = jstr(o, "remote_engine_id"), *boot = jstr(o, "remote_bootstrap_addr");
        if (!is_consumer_role(c)) {
            snprintf(err, errlen,
                     "do_remote_prefill needs kv_role kv_consumer or kv_both; this instance is %s",
                     kv_role_name(c->cfg.role));
            role = -1;
        } else if (!eid || !*eid || strlen(eid) >= ID_MAX) {
            snprintf(err, errlen,
                     "kv_transfer_params.remote_engine_id must be a non-empty string (below %d "
                     "bytes), got %s",
                     ID_MAX, kind_of(o, "remote_engine_id"));
            role = -1;
        } else if (!boot || !bootstrap_addr_ok(boot)) {
            snprintf(err, errlen,
                     "kv_transfer_params.remote_bootstrap_addr %s%.200s%s is not accepted; "
                     "accepted: \"http://host:port\" or \"host:port\" (port 1..65535)",
                     boot ? "'" : "", boot ? boot : kind_of(o, "remote_bootstrap_addr"),
                     boot ? "'" : "");
            role = -1;
        } else {
            cons_req *r = calloc(1, sizeof *r);
            h = malloc(sizeof *h);
            if (!r || !h) {
                free(r);
                free(h);
                h = NULL;
                snprintf(err, errlen, "out of memory");
                role = -1;
            } else {
                r->c = c;
                r->id = id;
                r->n_prompt = n_prompt;
                snprintf(r->transfer_id, sizeof r->transfer_id, "%s", tid);
                snprintf(r->remote_engine_id, sizeof r->remote_engine_id, "%s", eid);
                snprintf(r->bootstrap, sizeof r->bootstrap, "%s", boot);
                *h = (handle){0, r, NULL};
                r->h = h;
                pthread_mutex_lock(&c->mu);
                r->next = c->conss;
                c->conss = r;
                pthread_mutex_unlock(&c->mu);
                role = KV_REQ_REMOTE_PREFILL;
            }
        }
    }
    if (role >= 0 && has_pool > 0) {
        cons_req *r = pool_fetch_new(c, id, &ps, prompt, n_prompt);
        if (r && !h && !(h = calloc(1, sizeof *h))) {
            free(r->tokens);
            free(r);
            r = NULL;
        }
        if (r) {
            h->pool = r;
            r->h = h->p ? NULL : h; /* a handle of its own: freed at destroy if never released */
            pthread_mutex_lock(&c->mu);
            r->next = c->conss;
            c->conss = r;
            pthread_mutex_unlock(&c->mu);
            role |= KV_REQ_POOL_FETCH;
        }
    }
    if (role < 0) {
        pthread_mutex_lock(&c->mu);
        if (remote_prefill || has_pool < 0 || (bad_flag && !strcmp(bad_flag, "do_remote_prefill")))
            c->fail_c[FC_BAD_PARAMS]++;
        else
            c->fail_p[FP_BAD_PARAMS]++;
        pthread_mutex_unlock(&c->mu);
    }
    json_decref(o);
    *out = h;
    return role;
}

static void start_load(void *ctx, void *hp, uint64_t id, const int32_t *blocks, int n_blocks,
                       int n_local_tokens, int n_prompt) {
    mooncake_connector *c = ctx;
    handle *h = hp;
    cons_req *r = h->pool ? h->pool : h->p;
    if (r->pool && n_local_tokens >= r->pool_tokens) { /* the local prefix cache has it all */
        pthread_mutex_lock(&c->mu);
        c->pool_skipped[PS_CACHED]++;
        pthread_mutex_unlock(&c->mu);
        engine_kv_load_done_prefix(c->eng, id, n_local_tokens);
        return;
    }
    r->blocks = malloc((size_t)(n_blocks ? n_blocks : 1) * sizeof *r->blocks);
    if (!r->blocks) {
        engine_kv_load_done(c->eng, id, 0, 0, 0, "decoder out of memory");
        return;
    }
    memcpy(r->blocks, blocks, (size_t)n_blocks * sizeof *blocks);
    r->n_blocks = n_blocks;
    r->n_local_tokens = n_local_tokens;
    r->n_prompt = n_prompt;
    r->started_ns = clock_now_ns();
    r->deadline_ns =
        r->started_ns + (uint64_t)((r->pool ? POOL_TIMEOUT_S + 2 * LOOKUP_ANSWER_S + 1
                                            : c->env.abort_request_timeout_s + 60) *
                                   1e9);
    pthread_mutex_lock(&c->mu);
    int cap = c->cfg.max_remote_loads;
    if (!c->stop && c->n_pull_threads - c->n_evicting >= cap && c->n_pull_threads < 2 * cap) {
        /* Full: evict the oldest load whose producer said it does not know
         * the transfer id (a bogus pull, or one far ahead of its request);
         * its thread ends within the cancel's acknowledgement (5 s), so at
         * most 2 x max_remote_loads pull threads exist. */
        cons_req *old = NULL;
        for (cons_req *q = c->conss; q; q = q->next)
            if (q->loading && q->p_unknown && !q->evicted &&
                (!old || q->started_ns < old->started_ns))
                old = q;
        if (old) {
            old->evicted = 1;
            c->n_evicting++;
            atomic_store(&old->cancel, SIDE_CHANNEL_CANCEL_ASK);
        }
    }
    if (r->pool && (c->n_pull_threads - c->n_evicting >= cap || c->stop)) {
        c->pool_fallbacks[PF_BUSY]++;
        pthread_mutex_unlock(&c->mu);
        engine_kv_load_failed(c->eng, id, 1, 0, 0, "too many remote KV loads in flight");
        return;
    }
    if (c->n_pull_threads - c->n_evicting >= cap || c->n_pull_threads >= 2 * cap || c->stop) {
        c->fail_c[FC_BUSY]++;
        c->st.pulls_failed++;
        pthread_mutex_unlock(&c->mu);
        char msg[300];
        snprintf(msg, sizeof msg,
                 "too many remote KV loads in flight: %d loads wait for their producers "
                 "(kv_connector_extra_config.max_remote_loads %d); retry later or add decode "
                 "instances",
                 cap, cap);
        mc_release_remote(c, r->bootstrap, r->remote_engine_id, r->transfer_id);
        engine_kv_load_failed(c->eng, id, c->cfg.load_failure_policy == KV_LOAD_FAILURE_RECOMPUTE,
                              0, 503, msg);
        return;
    }
    r->loading = 1;
    c->st.loading++;
    c->n_pull_threads++;
    pthread_mutex_unlock(&c->mu);
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &at, mc_pull_main, r);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        pthread_mutex_lock(&c->mu);
        r->loading = 0;
        c->st.loading--;
        c->n_pull_threads--;
        if (r->pool) c->pool_fallbacks[PF_BUSY]++;
        pthread_mutex_unlock(&c->mu);
        engine_kv_load_done(c->eng, id, 0,
                            r->pool || c->cfg.load_failure_policy == KV_LOAD_FAILURE_RECOMPUTE, 0,
                            "cannot start a pull thread");
    }
}

static void request_finished(void *ctx, void *hp, uint64_t id, const char *reason,
                             const int32_t *blocks, int n_blocks, int n_prompt, int keep) {
    mooncake_connector *c = ctx;
    handle *h = hp;
    if (!h) return;
    if (h->pool && !blocks) /* aborted during its pool fetch: stop the pull */
        atomic_store(&h->pool->cancel, SIDE_CHANNEL_CANCEL_ASK);
    if (!h->p) return;
    if (!h->is_producer) { /* consumer aborted during its load: stop the pull */
        atomic_store(&((cons_req *)h->p)->cancel, SIDE_CHANNEL_CANCEL_ASK);
        return;
    }
    prod_req *p = h->p;
    pthread_mutex_lock(&c->mu);
    p->prefill_end_ns = clock_now_ns();
    if (p->streaming) { /* a stream thread writes the last layers and answers the pull */
        p->prefill_over = -1;
        if (keep && (p->blocks = malloc((size_t)(n_blocks ? n_blocks : 1) * sizeof *p->blocks))) {
            memcpy(p->blocks, blocks, (size_t)n_blocks * sizeof *blocks);
            p->n_blocks = n_blocks;
            p->kept = 1;
            c->st.kept++;
            p->prefill_over = 1;
        } else if (keep) {
            snprintf(p->fail_msg, sizeof p->fail_msg, "producer out of memory");
            engine_kv_release(c->eng, id); /* kept by the engine, not by us */
        } else {
            snprintf(p->fail_msg, sizeof p->fail_msg,
                     "the prefill request ended with '%s' before its KV was ready", reason);
        }
        pthread_cond_broadcast(&c->lw_cv);
        mc_prod_wake_waiters_locked(c, p); /* any second pull: already being pulled */
        pthread_mutex_unlock(&c->mu);
        return;
    }
    mc_prod_free_chunks(p); /* no stream: a later pull takes the whole-request path */
    if (keep) {
        p->blocks = malloc((size_t)(n_blocks ? n_blocks : 1) * sizeof *p->blocks);
        if (p->blocks) memcpy(p->blocks, blocks, (size_t)n_blocks * sizeof *blocks);
        p->n_blocks = n_blocks;
        p->kept = 1;
        c->st.kept++;
        p->state = p->blocks ? P_READY : P_FAILED;
        if (!p->blocks) {
            snprintf(p->fail_msg, sizeof p->fail_msg, "producer out of memory");
            mc_prod_release_blocks_locked(c, p);
        }
        p->deadline_ns = clock_now_ns() + (uint64_t)(c->env.abort_request_timeout_s * 1e9);
        if (p->state == P_READY && p->cancelled && !p->waiters) { /* its decoder gave up */
            p->state = P_DONE;
            mc_prod_release_blocks_locked(c, p);
        }
    } else {
        p->state = P_FAILED;
        p->fail_reason = FP_PREFILL_ENDED;
        snprintf(p->fail_msg, sizeof p->fail_msg,
                 "the prefill request ended with '%s' before its KV was ready", reason);
    }
    (void)n_prompt;
    (void)id;
    mc_prod_wake_waiters_locked(c, p);
    pthread_mutex_unlock(&c->mu);
}

/* Producer: the prefill sampled its first output token (sent with the KV). */
static void first_token(void *ctx, void *hp, uint64_t id, int32_t token) {
    mooncake_connector *c = ctx;
    handle *h = hp;
    if (!h || !h->is_producer) return;
    pthread_mutex_lock(&c->mu);
    ((prod_req *)h->p)->first_token = token;
    pthread_mutex_unlock(&c->mu);
    (void)id;
}

static void request_released(void *ctx, void *hp, uint64_t id) {
    mooncake_connector *c = ctx;
    handle *h = hp;
    if (!h) return;
    pthread_mutex_lock(&c->mu);
    if (h->pool) { /* its pull thread, if any, frees it when it ends; nothing to release */
        h->pool->released = 1;
        mc_cons_maybe_free_locked(c, h->pool);
    }
    if (!h->p) {
    } else if (h->is_producer) {
        prod_req *p = h->p;
        p->engine_released = 1;
        /* a stream thread waiting for its chunks looks again */
        pthread_cond_broadcast(&c->lw_cv);
        if (p->state == P_PREFILLING) { /* finished without request_finished (engine stop) */
            p->state = P_FAILED;
            snprintf(p->fail_msg, sizeof p->fail_msg, "the prefill request was dropped");
            mc_prod_wake_waiters_locked(c, p);
        }
        mc_prod_maybe_free_locked(c, p);
    } else {
        cons_req *r = h->p;
        r->released = 1;
        if (!r->started_ns) { /* dropped before its pull (aborted while queued) */
            release_job tmp;
            snprintf(tmp.bootstrap, sizeof tmp.bootstrap, "%s", r->bootstrap);
            snprintf(tmp.engine_id, sizeof tmp.engine_id, "%s", r->remote_engine_id);
            snprintf(tmp.transfer_id, sizeof tmp.transfer_id, "%s", r->transfer_id);
            mc_cons_maybe_free_locked(c, r);
            pthread_mutex_unlock(&c->mu);
            mc_release_remote(c, tmp.bootstrap, tmp.engine_id, tmp.transfer_id);
            free(h);
            return;
        }
        mc_cons_maybe_free_locked(c, r);
    }
    pthread_mutex_unlock(&c->mu);
    free(h);
    (void)id;
}

void mooncake_connector_release_unused(mooncake_connector *c, const char *kv_params) {
    if (!c || !kv_params || !is_consumer_role(c)) return;
    json_t *o = json_loads(kv_params, 0, NULL);
    if (json_is_object(o) && json_is_true(json_object_get(o, "do_remote_prefill"))) {
        const char *tid = jstr(o, "transfer_id"), *eid = jstr(o, "remote_engine_id"),
                   *boot = jstr(o, "remote_bootstrap_addr");
        if (tid && *tid && strlen(tid) < ID_MAX && eid && *eid && strlen(eid) < ID_MAX && boot &&
            bootstrap_addr_ok(boot))
            mc_release_remote(c, boot, eid, tid);
    }
    json_decref(o);
}

/* ---- reaper: expiries and deadlines -------------------------------------------------- */

/* Caller holds mu.  A pull waiting on p (queued or prefilling here) gets an
 * empty CONTINUE every BEAT_PERIOD_NS, so the decoder's per-reply timeout
 * (vLLM: ABORT_REQUEST_TIMEOUT + 60 s) does not fail a request that is only
 * slow to come out of this producer's queue.  vLLM's decoder reads an empty
 * CONTINUE as "nothing yet". */
static void beat_waiters_locked(mooncake_connector *c, prod_req *p, uint64_t now) {
    for (pull_part *w = p->waiters; w; w = w->next) {
        if (now - w->job->beat_ns < BEAT_PERIOD_NS) continue;
        w->job->beat_ns = now;
        char *rid = w->job->pull->reqs[w->req].req_id;
        side_channel_reply r = {.status = SIDE_CHANNEL_CONTINUE};
        if (p->state == P_UNKNOWN) /* still unknown: say so again */
            r.unknown_reqs = &rid, r.n_unknown = 1;
        side_channel_call_reply(w->job->call, &r);
    }
}

/* Side-channel thread: a decoder cancels requests of its pull.  Waiting or
 * queued parts end now; a part being written ends when its write does.  The
 * pull's final FINISH, sent when its last part ended, is the acknowledgement:
 * after it nothing more is written into the decoder's blocks. */
static void on_cancel(void *ud, const void *peer, size_t peer_len, const side_channel_cancel *cx) {
    mc_rank_sc *rs = ud;
    mooncake_connector *c = rs->c;
    static const char why[] = "cancelled by the decoder";
    pthread_mutex_lock(&c->mu);
    for (size_t k = 0; k < cx->n; k++) {
        const char *rid = cx->req_ids[k], *tid = cx->transfer_ids[k];
        prod_req *p = mc_prod_find(c, tid);
        mc_stream_stop_locked(c, peer, peer_len, 0, rid, why); /* its FINISH follows */
        for (pull_part **pw = p ? &p->waiters : NULL; pw && *pw;) {
            pull_part *w = *pw;
            if (w->job->rank == rs->rank &&
                side_channel_call_peer_is(w->job->call, peer, peer_len) &&
                !strcmp(w->job->pull->reqs[w->req].req_id, rid)) {
                *pw = w->next;
                c->fail_p[FP_CANCELLED]++;
                mc_job_req_done_locked(c, w->job, w->req, 0, why);
                free(w);
                p->cancelled = 1;
            } else {
                pw = &w->next;
            }
        }
        for (send_task **pt = &c->q_head, *prev = NULL; *pt;) {
            send_task *t = *pt;
            if (t->job->rank == rs->rank &&
                side_channel_call_peer_is(t->job->call, peer, peer_len) &&
                !strcmp(t->job->pull->reqs[t->req].req_id, rid) &&
                !strcmp(t->p->transfer_id, tid)) {
                *pt = t->next;
                if (c->q_tail == t) c->q_tail = prev;
                prod_req *tp = t->p;
                /* never sent: its decoder gave up, the blocks are freed (once no other
                 * rank's write of them is in flight) */
                mc_prod_send_ended_locked(c, tp, 0);
                c->fail_p[FP_CANCELLED]++;
                mc_job_req_done_locked(c, t->job, t->req, 0, why);
                mc_prod_wake_waiters_locked(c, tp);
                mc_prod_maybe_free_locked(c, tp);
                free(t);
            } else {
                prev = t;
                pt = &t->next;
            }
        }
        if (p && p->cancelled && p->state == P_READY && !p->waiters) {
            p->state = P_DONE;
            mc_prod_release_blocks_locked(c, p);
            mc_prod_maybe_free_locked(c, p);
        } else if (p && p->state == P_UNKNOWN && !p->waiters && p->cancelled) {
            /* Remembered for a while: if the request still arrives, its KV is
             * released as soon as it is ready instead of waiting for a pull
             * that will not come (the reaper forgets it after the deadline). */
            p->deadline_ns = clock_now_ns() + (uint64_t)(c->env.unknown_transfer_timeout_s * 1e9);
        }
    }
    pthread_mutex_unlock(&c->mu);
}

/* Side-channel thread: the connection conn of a decoder closed (it stopped,
 * crashed or was killed).  Its waiting pulls end, and the transfers they
 * waited for are released as soon as they are ready (or at once) instead of
 * being kept for the abort timeout: nobody is left to pull them. */
static void on_gone(void *ud, uint64_t conn) {
    mc_rank_sc *rs = ud;
    mooncake_connector *c = rs->c;
    static const char why[] = "the decoder's side-channel connection closed";
    uint64_t now = clock_now_ns();
    int n = 0;
    pthread_mutex_lock(&c->mu);
    mc_stream_stop_locked(c, NULL, 0, conn, NULL, why); /* nobody reads what they write */
    for (prod_req *p = c->prods, *next; p; p = next) {
        next = p->next;
        int hit = 0;
        for (pull_part **pw = &p->waiters; *pw;) {
            pull_part *w = *pw;
            if (w->job->rank == rs->rank && side_channel_call_conn(w->job->call) == conn) {
                *pw = w->next;
                c->fail_p[FP_CANCELLED]++;
                mc_job_req_done_locked(c, w->job, w->req, 0, why);
                free(w);
                hit = 1;
            } else {
                pw = &w->next;
            }
        }
        if (!hit) continue;
        n++;
        p->cancelled = 1;
        if (p->waiters) continue; /* another pull still wants it */
        if (p->state == P_READY) {
            p->state = P_DONE;
            mc_prod_release_blocks_locked(c, p);
            mc_prod_maybe_free_locked(c, p);
        } else if (p->state == P_UNKNOWN) { /* remembered: a late request is released */
            p->deadline_ns = now + (uint64_t)(c->env.unknown_transfer_timeout_s * 1e9);
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (n)
        LOG_W(MOD,
              "a decoder's side-channel connection closed with %d pull(s) waiting: their KV is "
              "released when ready",
              n);
}

/* Caller holds mu (dropped while probing).  ZeroMQ does not report a peer
 * that vanished, so a pull to a dead producer would wait for its whole
 * timeout: every PROBE_PERIOD_NS, ask the bootstrap server of each producer
 * that a pull has waited on for over PROBE_AFTER_NS; when it does not answer
 * (an embedded bootstrap server dies with its producer), cancel those pulls. */
static void probe_producers_locked(mooncake_connector *c) {
    enum { MAX_PROBES = 16 };
    char addrs[MAX_PROBES][256];
    int n = 0;
    uint64_t now = clock_now_ns();
    for (cons_req *r = c->conss; r && n < MAX_PROBES; r = r->next) {
        if (!r->loading || now - r->started_ns < PROBE_AFTER_NS) continue;
        int dup = 0;
        for (int i = 0; i < n && !dup; i++)
            dup = !strcmp(addrs[i], r->bootstrap);
        if (!dup) snprintf(addrs[n++], sizeof addrs[0], "%s", r->bootstrap);
    }
    if (n == 0) return;
    pthread_mutex_unlock(&c->mu);
    int dead[MAX_PROBES] = {0};
    for (int i = 0; i < n; i++) {
        bootstrap_retry retry;
        bootstrap_retry_init(&retry, 2.0);
        retry.attempts = 1;
        bootstrap_table t;
        char err[256];
        if (bootstrap_client_query(addrs[i], &retry, &t, err, sizeof err) == 0)
            bootstrap_table_free(&t);
        else
            dead[i] = 1;
    }
    pthread_mutex_lock(&c->mu);
    for (cons_req *r = c->conss; r; r = r->next)
        for (int i = 0; i < n; i++)
            if (dead[i] && r->loading && !strcmp(addrs[i], r->bootstrap)) {
                r->unreachable = 1;
                atomic_store(&r->cancel, SIDE_CHANNEL_CANCEL_DROP);
            }
}

static void *reaper_main(void *arg) {
    mooncake_connector *c = arg;
    uint64_t next_probe = 0;
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        struct timespec ts = clock_to_timespec(clock_now_ns() + REAPER_PERIOD_NS);
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        uint64_t now = clock_now_ns();
        for (prod_req *p = c->prods, *next; p; p = next) {
            next = p->next;
            if (p->state == P_READY && now >= p->deadline_ns) {
                LOG_W(MOD,
                      "transfer %s: no decoder pulled it within %.0f s "
                      "(VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT); freeing its %d blocks",
                      p->transfer_id, c->env.abort_request_timeout_s, p->n_blocks);
                p->state = P_DONE;
                c->st.expired++;
                mc_prod_release_blocks_locked(c, p);
                mc_prod_maybe_free_locked(c, p);
            } else if (p->state == P_UNKNOWN && p->waiters && p->deadline_ns &&
                       now >= p->deadline_ns) {
                mc_unknown_remove_locked(c, p);
                p->state = P_FAILED;
                p->fail_reason = FP_UNKNOWN_TRANSFER;
                snprintf(p->fail_msg, sizeof p->fail_msg,
                         "no request with transfer_id '%.80s' reached the producer within %g s "
                         "(DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT)",
                         p->transfer_id, c->env.unknown_transfer_timeout_s);
                LOG_W(MOD, "%s; failing the pull", p->fail_msg);
                mc_prod_wake_waiters_locked(c, p);
                p->engine_released = 1;
                mc_prod_maybe_free_locked(c, p);
            } else if (p->state == P_UNKNOWN && !p->waiters && p->deadline_ns &&
                       now >= p->deadline_ns) { /* a cancelled pull's entry */
                mc_prod_maybe_free_locked(c, p);
            } else if (p->waiters) {
                beat_waiters_locked(c, p, now);
            }
        }
        /* a streamed pull whose request is still queued here: the same heartbeat */
        for (int i = 0; i < c->n_streams; i++) {
            pull_job *job = c->streams[i]->job;
            if (now - job->beat_ns < BEAT_PERIOD_NS) continue;
            job->beat_ns = now;
            side_channel_reply cr = {.status = SIDE_CHANNEL_CONTINUE};
            side_channel_call_reply(job->call, &cr);
        }
        for (cons_req *r = c->conss; r; r = r->next)
            if (r->loading && now >= r->deadline_ns) {
                r->timed_out = 1;
                atomic_store(&r->cancel, SIDE_CHANNEL_CANCEL_ASK);
            }
        if (now >= next_probe) {
            probe_producers_locked(c);
            next_probe = clock_now_ns() + PROBE_PERIOD_NS;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* ---- lifecycle ------------------------------------------------------------------------ */

/* A wildcard listen address (or none): every interface. */
static int is_wildcard_host(const char *h) {
    return !h || !h[0] || !strcmp(h, "0.0.0.0") || !strcmp(h, "::") || !strcmp(h, "[::]");
}

/* Without a secret, KV ports reachable from other hosts are open to anyone
 * who can connect (docs/security.md): say so loudly, once, at start. */
static void warn_if_exposed(const mooncake_connector *c) {
    if (c->cfg.auth_secret[0]) return;
    char what[600];
    int n = 0;
    if (!net_host_is_loopback(c->host) || c->cfg.device_name[0])
        n += snprintf(what + n, sizeof what - (size_t)n,
                      "transfer handshake and data ports on %s%s%s", c->host,
                      c->cfg.device_name[0] ? " and the device_name interfaces " : "",
                      c->cfg.device_name);
    if (c->sc && !net_host_is_loopback(c->host))
        n += snprintf(what + n, sizeof what - (size_t)n, "%sside channel on %s", n ? ", " : "",
                      c->host);
    if (c->bs && !net_host_is_loopback(c->listen_host))
        n += snprintf(what + n, sizeof what - (size_t)n, "%sbootstrap server on %s:%u",
                      n ? ", " : "", is_wildcard_host(c->listen_host) ? "0.0.0.0" : c->listen_host,
                      (unsigned)bootstrap_server_port(c->bs));
    if (n == 0) return;
    LOG_W(MOD,
          "SECURITY WARNING: no shared secret (DISAGG_KV_SECRET / "
          "kv_connector_extra_config.auth_secret) and KV ports listen beyond loopback (%s): "
          "anyone who can reach them can read or overwrite this instance's KV cache%s. Set the "
          "same DISAGG_KV_SECRET on every prefill, decode and bootstrap server, or keep these "
          "ports on a private network behind a firewall (docs/security.md)",
          what, c->bs ? " and register fake prefill ranks" : "");
}

static int start_producer(mooncake_connector *c, char *err, size_t errlen) {
    char server[300];
    const char *secret = c->cfg.auth_secret[0] ? c->cfg.auth_secret : NULL;
    if (c->cfg.bootstrap_host[0]) {
        snprintf(server, sizeof server, strchr(c->cfg.bootstrap_host, ':') ? "[%s]:%u" : "%s:%u",
                 c->cfg.bootstrap_host, c->cfg.bootstrap_port);
    } else {
        /* The embedded bootstrap server listens where the API does (--host):
         * the proxy and the decoders reach it at the prefill's API host
         * (docs/security.md "Which interfaces"). */
        const char *bh = is_wildcard_host(c->listen_host) ? NULL : c->listen_host;
        int rc =
            bootstrap_server_start_auth(bh, c->env.bootstrap_port, secret, &c->bs, err, errlen);
        if (rc) return rc;
        const char *reach = bh ? bh : "127.0.0.1"; /* a wildcard binds 0.0.0.0 */
        snprintf(server, sizeof server, strchr(reach, ':') ? "[%s]:%u" : "%s:%u", reach,
                 bootstrap_server_port(c->bs));
        LOG_I(MOD, "bootstrap server on %s (VLLM_MOONCAKE_BOOTSTRAP_PORT)", server);
    }
    /* The side channels (one per TP rank, as vLLM's TP workers) listen only on the
     * advertised KV host, the address the bootstrap table gives decoders. */
    for (int r = 0; r < c->tp.tp_size; r++) {
        mc_rank_sc *rs = &c->rank_sc[r];
        rs->c = c;
        rs->rank = r;
        int rc = side_channel_server_start_auth(c->host, 0, secret, mc_on_pull, rs, &rs->sc, err,
                                                errlen);
        if (rc) return rc;
        side_channel_server_set_cancel_fn(rs->sc, on_cancel);
        side_channel_server_set_gone_fn(rs->sc, on_gone);
        snprintf(rs->addr, sizeof rs->addr, strchr(c->host, ':') ? "tcp://[%s]:%u" : "tcp://%s:%u",
                 c->host, side_channel_server_port(rs->sc));
    }
    c->sc = c->rank_sc[0].sc;
    snprintf(c->sc_addr, sizeof c->sc_addr, "%s", c->rank_sc[0].addr);
    c->n_senders = c->cfg.num_workers;
    c->senders = calloc((size_t)c->n_senders, sizeof *c->senders);
    if (!c->senders) return -ENOMEM;
    for (int i = 0; i < c->n_senders; i++)
        pthread_create(&c->senders[i], NULL, mc_sender_main, c);
    bootstrap_retry retry;
    bootstrap_retry_init(&retry, c->env.connector_timeout_s);
    /* every rank under its tp_rank: a decoder learns this instance's TP size from them */
    for (int r = 0; r < c->tp.tp_size; r++) {
        bootstrap_registration reg = {c->cfg.engine_id, 0, r, 0, c->rank_sc[r].addr};
        int rc = bootstrap_client_register_auth(server, &reg, secret, &retry, err, errlen);
        if (rc) {
            if (rc == BOOTSTRAP_EAUTH)
                LOG_E(MOD, "cannot register with the bootstrap server: %s", err);
            return rc;
        }
        LOG_I(MOD, "producer engine %s tp_rank %d of %d registered at %s (side channel %s)",
              c->cfg.engine_id, r, c->tp.tp_size, server, c->rank_sc[r].addr);
    }
    return 0;
}

/* A KV region in HBM: the backend's device-memory ops go into the transfer engine. */
static int install_device_ops(mooncake_connector *c, char *err, size_t errlen) {
    int dev = 0;
    if (c->region.location[4] == ':') dev = atoi(c->region.location + 5);
    transfer_device_ops ops;
    int rc = backend_transfer_device_ops(c->region.backend, dev, &ops, err, errlen);
    if (rc) return rc;
    rc = transfer_engine_set_device_ops(c->te, &ops);
    if (rc) {
        snprintf(err, errlen, "cannot give the transfer engine the %s memory ops: %s",
                 c->region.location, transfer_strerror(rc));
        return -EINVAL;
    }
    return 0;
}

int mooncake_connector_create(const char *json, engine *eng, mooncake_connector **out, char *err,
                              size_t errlen) {
    return mooncake_connector_create_on(json, NULL, eng, out, err, errlen);
}

int mooncake_connector_create_on(const char *json, const char *listen_host, engine *eng,
                                 mooncake_connector **out, char *err, size_t errlen) {
    mooncake_connector *c = calloc(1, sizeof *c);
    if (!c) return -ENOMEM;
    if (listen_host) snprintf(c->listen_host, sizeof c->listen_host, "%s", listen_host);
    pthread_mutex_init(&c->mu, NULL);
    clock_cond_init(&c->cv); /* the reaper's timed wait takes clock_now_ns deadlines */
    clock_cond_init(&c->q_cv);
    clock_cond_init(&c->lw_cv);
    c->eng = eng;
    int rc = kv_transfer_config_parse(json, &c->cfg, err, errlen);
    if (rc == 0) rc = kv_transfer_env_load(&c->env, err, errlen);
    if (rc) {
        free(c);
        return rc;
    }
    int n_nics = transfer_rdma_device_count();
    c->proto = kv_transfer_config_effective_protocol(&c->cfg, n_nics > 0);
    engine_get_kv_region(eng, &c->region);
    int on_device = !strncmp(c->region.location, "cuda", 4);
    c->tp = (tp_local){engine_tp_size(eng), 0};
    if (c->tp.tp_size > MC_TP_MAX) c->tp.tp_size = MC_TP_MAX;
    c->rank_region[0] = c->region;
    for (int r = 1; r < c->tp.tp_size; r++)
        if (engine_get_kv_region_rank(eng, r, &c->rank_region[r])) {
            snprintf(err, errlen,
                     "tensor-parallel rank %d's KV region is not shared with rank 0 (the KV "
                     "connector moves every rank's heads from rank 0's process)",
                     r);
            free(c);
            return -EINVAL;
        }
    transfer_config tc;
    transfer_config_init(&tc);
    /* The KV host (advertised, and where the side channel listens):
     * VLLM_HOST_IP, else device_name's first interface, else --host when it
     * names one address, else the first interface that is up. */
    tc.local_hostname = c->env.host_ip[0] ? c->env.host_ip
                        : !c->cfg.device_name[0] && !is_wildcard_host(c->listen_host)
                            ? c->listen_host
                            : NULL;
    tc.device_name = c->cfg.device_name;
    /* The best transport both sides support: rdma where this host has a NIC (and the
     * peer lists one); "rdma" without a NIC and the KV in HBM: auto, so that a
     * same-host peer's device memory goes over cuda_ipc and any other over staged tcp;
     * an explicit "tcp" stays tcp (staged for device memory); host memory without a NIC
     * keeps tcp, as before. */
    tc.protocol = c->proto == KV_PROTOCOL_SHM                        ? TRANSFER_PROTO_SHM
                  : c->proto == KV_PROTOCOL_RDMA                     ? TRANSFER_PROTO_RDMA
                  : c->cfg.protocol == KV_PROTOCOL_RDMA && on_device ? TRANSFER_PROTO_AUTO
                                                                     : TRANSFER_PROTO_TCP;
    /* Shared secret of the transfer ports (docs/transfer.md, Security): the
     * auth_secret key, else $DISAGG_KV_SECRET (resolved by the config). */
    tc.auth_secret = c->cfg.auth_secret[0] ? c->cfg.auth_secret : NULL;
    rc = transfer_engine_create(&tc, &c->te);
    if (rc) {
        snprintf(err, errlen, "cannot start the transfer engine (device_name '%s'): %s",
                 c->cfg.device_name, transfer_strerror(rc));
        free(c);
        return -EINVAL;
    }
    if (on_device && (rc = install_device_ops(c, err, errlen)) != 0) {
        transfer_engine_destroy(c->te);
        free(c);
        return rc;
    }
    rc = 0;
    for (int r = 0; r < c->tp.tp_size && !rc; r++) /* every rank's heads move from here */
        rc = transfer_register(c->te, c->rank_region[r].base, c->rank_region[r].bytes,
                               c->rank_region[r].location);
    if (rc) {
        snprintf(err, errlen, "cannot register the KV cache with the transfer engine: %s",
                 transfer_strerror(rc));
        transfer_engine_destroy(c->te);
        free(c);
        return -EINVAL;
    }
    snprintf(c->segment, sizeof c->segment, "%s", transfer_engine_segment_name(c->te));
    uint16_t port;
    net_split_host_port(c->segment, c->host, sizeof c->host, &port, 0);
    c->st.role = kv_role_name(c->cfg.role);
    /* HBM without a NIC: the engine picks per peer (cuda_ipc on this host, staged tcp
     * elsewhere); the per-transport counters say which carried each write. */
    c->st.protocol = tc.protocol == TRANSFER_PROTO_AUTO ? "auto" : kv_protocol_name(c->proto);
    c->st.engine_id = c->cfg.engine_id;
    if (id_table_init(&c->prod_index) != 0) {
        snprintf(err, errlen, "out of memory");
        transfer_engine_destroy(c->te);
        free(c);
        return -ENOMEM;
    }
    if (c->cfg.auth_secret[0])
        LOG_I(MOD, "KV ports authenticated with the shared secret (%s)",
              c->cfg.auth_secret_from_env ? "DISAGG_KV_SECRET"
                                          : "kv_connector_extra_config.auth_secret");
    pthread_create(&c->reaper, NULL, reaper_main, c);
    if (is_producer_role(c) && (rc = start_producer(c, err, errlen)) != 0) {
        mooncake_connector_destroy(c);
        return rc < 0 ? rc : -EINVAL;
    }
    warn_if_exposed(c);
    /* layer marks cost the forward a little: only where a pull can ask for them (one rank) */
    int layer_marks = is_producer_role(c) && c->cfg.layerwise && c->tp.tp_size == 1;
    engine_kv_connector hooks = {.ctx = c,
                                 .classify = classify,
                                 .start_load = start_load,
                                 .request_finished = request_finished,
                                 .first_token = first_token,
                                 .request_released = request_released,
                                 .prefill_chunk = layer_marks ? mc_prefill_chunk : NULL,
                                 .prefix_pinned = is_producer_role(c) ? mc_prefix_pinned : NULL};
    engine_set_kv_connector(eng, &hooks);
    LOG_I(MOD,
          "MooncakeConnector: role %s, engine_id %s, transport %s, transfer segment %s, KV region "
          "%.1f MiB "
          "(%d blocks of %zu bytes)",
          kv_role_name(c->cfg.role), c->cfg.engine_id,
          tc.protocol == TRANSFER_PROTO_AUTO ? "cuda_ipc to this host's GPUs, staged tcp to others"
          : on_device && c->proto == KV_PROTOCOL_TCP ? "tcp (device memory staged)"
                                                     : kv_protocol_name(c->proto),
          c->segment, (double)c->region.bytes / (1 << 20), c->region.n_blocks,
          c->region.block_bytes);
    *out = c;
    return 0;
}

void mooncake_connector_destroy(mooncake_connector *c) {
    if (!c) return;
    if (c->eng) engine_set_kv_connector(c->eng, NULL);
    for (int r = 0; r < MC_TP_MAX; r++)
        if (c->rank_sc[r].sc) side_channel_server_stop(c->rank_sc[r].sc);
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    for (cons_req *r = c->conss; r; r = r->next)
        atomic_store(&r->cancel, SIDE_CHANNEL_CANCEL_DROP);
    pthread_cond_broadcast(&c->q_cv);
    pthread_cond_broadcast(&c->cv);
    pthread_cond_broadcast(&c->lw_cv);
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < c->n_senders; i++)
        pthread_join(c->senders[i], NULL);
    pthread_join(c->reaper, NULL);
    atomic_store(&c->release_cancel, SIDE_CHANNEL_CANCEL_DROP);
    pthread_mutex_lock(&c->mu); /* pull threads end within 100 ms of their cancel */
    while (c->n_pull_threads > 0 || c->n_releases > 0 || c->n_streams > 0)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    if (c->bs) bootstrap_server_stop(c->bs);
    while (c->prods) {
        prod_req *p = c->prods;
        c->prods = p->next;
        for (pull_part *w = p->waiters, *n; w; w = n) {
            n = w->next;
            /* its pull ends (the reply goes nowhere: the side channels are stopped) and its
             * job is freed with its last request */
            pthread_mutex_lock(&c->mu);
            mc_job_req_done_locked(c, w->job, w->req, 0, "the producer is stopping");
            pthread_mutex_unlock(&c->mu);
            free(w);
        }
        mc_prod_free_chunks(p);
        free(p->blocks);
        free(p);
    }
    free(c->streams);
    while (c->conss) { /* requests still live in the engine (its hooks are gone) */
        cons_req *r = c->conss;
        c->conss = r->next;
        if (!r->released) free(r->h);
        free(r->blocks);
        free(r->tokens);
        free(r);
    }
    id_table_free(&c->prod_index);
    transfer_engine_destroy(c->te);
    free(c->senders);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->q_cv);
    pthread_cond_destroy(&c->lw_cv);
    free(c);
}

void mooncake_connector_get_stats(mooncake_connector *c, mooncake_stats *out) {
    pthread_mutex_lock(&c->mu);
    *out = c->st;
    pthread_mutex_unlock(&c->mu);
}

/* The pool fetch's families (docs/kv_pool.md). */
static void pool_metrics(mooncake_connector *c, prom *p) {
    static const char *const fbn[PF_COUNT] = {"evicted", "unreachable", "timeout", "error", "busy"};
    static const char *const skn[PS_COUNT] = {"cached_here", "not_worth_it", "pool_fetch_never",
                                              "too_short"};
    pthread_mutex_lock(&c->mu);
    uint64_t req = c->pool_fetched, blocks = c->pool_blocks, bytes = c->pool_bytes;
    double secs = c->pool_seconds;
    uint64_t fb[PF_COUNT], sk[PS_COUNT], served = c->pool_served, not_held = c->pool_not_held;
    memcpy(fb, c->pool_fallbacks, sizeof fb);
    memcpy(sk, c->pool_skipped, sizeof sk);
    pthread_mutex_unlock(&c->mu);
    prom_family(p, "disagg:kv_pool_fetch_requests", PROM_COUNTER,
                "Pool fetch: requests whose prompt prefix was pulled from the instance holding "
                "it (kv_transfer_params.pool_source) instead of computed.");
    prom_sample_u64(p, req, NULL);
    prom_family(p, "disagg:kv_pool_fetch_blocks", PROM_COUNTER, "Pool fetch: KV blocks pulled.");
    prom_sample_u64(p, blocks, NULL);
    prom_family(p, "disagg:kv_pool_fetch_bytes", PROM_COUNTER, "Pool fetch: KV bytes pulled.");
    prom_sample_u64(p, bytes, NULL);
    prom_family(p, "disagg:kv_pool_fetch_seconds", PROM_COUNTER,
                "Pool fetch: time from the holder's lookup to the KV in place, summed.");
    prom_sample(p, secs, NULL);
    prom_family(p, "disagg:kv_pool_fetch_fallbacks", PROM_COUNTER,
                "Pool fetch: fetches that failed, the prompt then computed here, by reason.");
    for (int i = 0; i < PF_COUNT; i++)
        prom_sample_u64(p, fb[i], "reason", fbn[i], NULL);
    prom_family(p, "disagg:kv_pool_fetch_skipped", PROM_COUNTER,
                "Pool fetch: pool_source requests not fetched, by reason.");
    for (int i = 0; i < PS_COUNT; i++)
        prom_sample_u64(p, sk[i], "reason", skn[i], NULL);
    prom_family(p, "disagg:kv_pool_serve_requests", PROM_COUNTER,
                "Pool fetch, holder: prefixes pinned and sent (served), or not held whole any "
                "more (not_held: the fetcher computes the prompt).");
    prom_sample_u64(p, served, "outcome", "served", NULL);
    prom_sample_u64(p, not_held, "outcome", "not_held", NULL);
}

int mooncake_connector_metrics(mooncake_connector *c, prom *p) {
    mooncake_stats s;
    mooncake_connector_get_stats(c, &s);
    uint64_t fp[FP_COUNT], fc[FC_COUNT], acked, unacked, evicted;
    int unknown, loads_unknown = 0;
    pthread_mutex_lock(&c->mu);
    memcpy(fp, c->fail_p, sizeof fp);
    memcpy(fc, c->fail_c, sizeof fc);
    acked = c->cancel_acked;
    unacked = c->cancel_unacked;
    evicted = c->pulls_evicted; /* what the KV ports refused */
    unknown = c->n_unknown;
    for (cons_req *r = c->conss; r; r = r->next)
        loads_unknown += r->loading && r->p_unknown && !r->evicted;
    pthread_mutex_unlock(&c->mu);
    uint64_t sc_rej = 0;
    for (int r = 0; r < MC_TP_MAX; r++)
        if (c->rank_sc[r].sc) sc_rej += side_channel_server_auth_rejected(c->rank_sc[r].sc);
    uint64_t bs_rej = c->bs ? bootstrap_server_auth_rejected(c->bs) : 0;

    prom_style style0 = p->style;
    const char *const *kv0 = p->const_kv;
    int n0 = p->n_const;
    prom_set_style(p, PROM_STYLE_INT); /* counts as integers */
    prom_const_labels(p, NULL, 0);
    prom_info(p, "disagg:kv_transfer_info", "KV connector role and transport in use.", "role",
              s.role ? s.role : "", "protocol", s.protocol ? s.protocol : "", "engine_id",
              s.engine_id ? s.engine_id : "", NULL);
    prom_family(p, "disagg:kv_transfer_bytes", PROM_COUNTER,
                "Producer: KV bytes written to decoders.");
    prom_sample_u64(p, s.bytes_sent, NULL);
    prom_family(p, "disagg:kv_transfer_descriptors", PROM_COUNTER,
                "Producer: contiguous KV runs written to decoders.");
    prom_sample_u64(p, s.descriptors_sent, NULL);
    prom_family(p, "disagg:kv_transfers", PROM_COUNTER,
                "Per-request KV transfers by side (producer sends, consumer pulls) and result.");
    prom_sample_u64(p, s.transfers_ok, "side", "producer", "result", "ok", NULL);
    prom_sample_u64(p, s.transfers_failed, "side", "producer", "result", "failed", NULL);
    prom_sample_u64(p, s.pulls_ok, "side", "consumer", "result", "ok", NULL);
    prom_sample_u64(p, s.pulls_failed, "side", "consumer", "result", "failed", NULL);
    prom_family(p, "disagg:kv_transfer_expired", PROM_COUNTER,
                "Producer: kept blocks freed by the abort timeout (no decoder pulled them).");
    prom_sample_u64(p, s.expired, NULL);
    prom_family(p, "disagg:kv_transfer_kept_requests", PROM_GAUGE,
                "Producer: requests holding blocks for a pull.");
    prom_sample(p, s.kept, NULL);
    prom_family(p, "disagg:kv_transfer_loading_requests", PROM_GAUGE, "Consumer: pulls in flight.");
    prom_sample(p, s.loading, NULL);
    static const double b[12] = MOONCAKE_LOAD_BUCKETS;
    prom_hist load = {b, 12, s.load_buckets, 1, s.load_count, s.load_sum_s};
    prom_family(p, "disagg:kv_load_seconds", PROM_HISTOGRAM,
                "Consumer: remote KV load latency (pull sent -> KV in place).");
    prom_histogram(p, &load, NULL);
    prom_family(p, "disagg:kv_send_seconds", PROM_SUMMARY,
                "Producer: time to write one request's KV into the decoder (blocks ready -> "
                "written).");
    prom_summary(p, s.send_count, s.send_sum_s, NULL);
    prom_family(p, "disagg:kv_transfer_failures", PROM_COUNTER,
                "Failed KV transfers by side and reason.");
    for (int i = 0; i < FP_COUNT; i++)
        prom_sample_u64(p, fp[i], "side", "producer", "reason", FP_NAMES[i], NULL);
    for (int i = 0; i < FC_COUNT; i++)
        prom_sample_u64(p, fc[i], "side", "consumer", "reason", FC_NAMES[i], NULL);
    prom_family(p, "disagg:kv_cancels", PROM_COUNTER,
                "Consumer: pulls cancelled (client gone or deadline); acked = the producer "
                "confirmed no write can follow, so the blocks were freed at once (else "
                "quarantined).");
    prom_sample_u64(p, acked, "acked", "yes", NULL);
    prom_sample_u64(p, unacked, "acked", "no", NULL);
    pool_metrics(c, p);
    static const char *const tn[4] = MOONCAKE_TRANSPORTS;
    prom_family(p, "disagg:kv_transfer_transport_bytes", PROM_COUNTER,
                "Producer: KV bytes written to decoders, by the transport that carried them.");
    for (int i = 0; i < 4; i++)
        prom_sample_u64(p, s.transport_bytes[i], "transport", tn[i], NULL);
    prom_family(p, "disagg:kv_transfer_transport_requests", PROM_COUNTER,
                "Producer: requests whose KV was written, by transport.");
    for (int i = 0; i < 4; i++)
        prom_sample_u64(p, s.transport_requests[i], "transport", tn[i], NULL);
    prom_family(p, "disagg:kv_transfer_layerwise_requests", PROM_COUNTER,
                "Requests whose KV moved layer by layer while the prefill ran (producer: "
                "streamed; consumer: pulls the producer answered as streamed).");
    prom_sample_u64(p, s.layerwise_sent, "side", "producer", NULL);
    prom_sample_u64(p, s.layerwise_pulled, "side", "consumer", NULL);
    prom_family(p, "disagg:kv_auth_rejected", PROM_COUNTER,
                "Messages refused for authentication (auth_secret / DISAGG_KV_SECRET), by port.");
    prom_sample_u64(p, sc_rej, "port", "side_channel", NULL);
    prom_sample_u64(p, bs_rej, "port", "bootstrap", NULL);
    prom_family(p, "disagg:kv_pending_pulls_evicted", PROM_COUNTER,
                "Producer: pulls for unknown transfer ids evicted (oldest first) because "
                "max_pending_pulls were waiting.");
    prom_sample_u64(p, evicted, NULL);
    prom_family(p, "disagg:kv_pending_unknown_pulls", PROM_GAUGE,
                "Producer: pulls for transfer ids not known yet, waiting.");
    prom_sample(p, unknown, NULL);
    prom_family(p, "disagg:kv_loads_unknown_transfer", PROM_GAUGE,
                "Consumer: remote KV loads whose producer said it does not know the transfer id "
                "(yet); evicted first at max_remote_loads.");
    prom_sample(p, loads_unknown, NULL);
    prom_set_style(p, style0);
    prom_const_labels(p, kv0, n0);
    return prom_error(p);
}
