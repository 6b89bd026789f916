/*
 * beam_search — vLLM's beam search on the server's loop (see beam_search.h).
 */
#include "server/beam_search.h"

#include "base/http_msg.h"
#include "base/log.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct bs_beam {
    int32_t *toks; /* generated tokens (eos last for a completed beam that keeps it) */
    int n;         /* tokens */
    double cum;    /* cumulative logprob */
    bool eos_stop; /* completed on eos: finish_reason "stop" */
} bs_beam;

/* One step request's result. */
typedef struct bs_result {
    bool got;                                 /* its token arrived */
    int32_t id;                               /* the sampled token */
    float logprob;                            /* its logprob */
    int n_top;                                /* top entries */
    int32_t top_ids[ENGINE_MAX_TOP_LOGPROBS]; /* descending */
    float top_lps[ENGINE_MAX_TOP_LOGPROBS];
} bs_result;

typedef struct bs_prompt {
    int prompt;     /* index in r->pids */
    int max_tokens; /* steps */
    int step;       /* steps done */
    bs_beam *live;  /* (n_live) live beams, at most width */
    int n_live;
    bs_beam *done; /* (n_done) completed beams */
    int n_done, cap_done;
    gen_choice *slots; /* (width) this step's engine requests */
    bs_result *res;    /* (width) their results */
    int n_inflight;    /* slots submitted and not yet FINISHED */
    bool finished;     /* the choices are filled */
} bs_prompt;

struct beam_search {
    gen_req *r;
    int width;    /* beam width = n */
    int eos;      /* the tokenizer's eos id, -1 when none */
    bs_prompt *p; /* (n_prompts) */
    int n_prompts;
    bool failed; /* a step failed: no further steps */
};

typedef struct bs_cand {
    int beam;    /* parent beam */
    int32_t tok; /* token */
    double cum;  /* parent's cumulative logprob + the token's */
    int order;   /* candidate order, for a stable ranking */
} bs_cand;

static void beam_free(bs_beam *b) {
    free(b->toks);
    b->toks = NULL;
}

void beam_search_free(struct beam_search *b) {
    if (!b) return;
    for (int i = 0; i < b->n_prompts; i++) {
        bs_prompt *p = &b->p[i];
        for (int k = 0; k < p->n_live; k++)
            beam_free(&p->live[k]);
        for (int k = 0; k < p->n_done; k++)
            beam_free(&p->done[k]);
        free(p->live);
        free(p->done);
        free(p->slots);
        free(p->res);
    }
    free(b->p);
    free(b);
}

static void bs_fail(struct beam_search *b, int status, const char *type, const char *msg) {
    gen_req *r = b->r;
    b->failed = true;
    if (!r->has_err) {
        r->has_err = true;
        oai_error_set(&r->err, status, type, NULL, "%s", msg);
    }
}

/* Submit one step of prompt p: one engine request per live beam. */
static int bs_submit_step(struct beam_search *b, bs_prompt *p) {
    gen_req *r = b->r;
    const int32_t *pids = r->pids[p->prompt];
    int np = r->n_pids[p->prompt];
    for (int i = 0; i < p->n_live; i++) {
        bs_beam *bm = &p->live[i];
        int32_t *ids = malloc((size_t)(np + bm->n) * sizeof *ids);
        if (!ids) {
            bs_fail(b, 500, "InternalServerError", "out of memory");
            return -ENOMEM;
        }
        memcpy(ids, pids, (size_t)np * sizeof *ids);
        if (bm->n) memcpy(ids + np, bm->toks, (size_t)bm->n * sizeof *ids);
        engine_request_params q;
        memset(&q, 0, sizeof q);
        q.prompt = ids;
        q.n_prompt = np + bm->n;
        q.max_tokens = 1;
        /* vLLM's step: SamplingParams(logprobs=2 * width, max_tokens=1, temperature) */
        engine_sampling_init(&q.sampling);
        q.sampling.temperature = r->o.sampling.temperature;
        q.sampling.logprobs = 2 * b->width;
        q.request_id = r->id;
        /* the first step carries the transfer: a decoder pulls the prompt's KV with it, a
         * prefiller keeps it for the decoder; later steps find it in the prefix cache */
        q.kv_transfer_params = p->step == 0 && p->prompt == 0 ? r->kv_params_text : NULL;
        q.first_token_handoff_ok = 0; /* every step needs the distribution */
        gen_choice *s = &p->slots[i];
        memset(s, 0, sizeof *s);
        s->r = r;
        s->prompt = p->prompt;
        s->index = i;
        memset(&p->res[i], 0, sizeof p->res[i]);
        char err[512] = "";
        int rc = engine_submit(r->s->eng, &q, gen_engine_event_fn, s, &s->eid, err, sizeof err);
        free(ids);
        if (rc) {
            bs_fail(b, rc == -EINVAL ? 400 : 500,
                    rc == -EINVAL ? "BadRequestError" : "InternalServerError",
                    err[0] ? err : "the engine refused the request");
            return rc;
        }
        s->submitted = true;
        p->n_inflight++;
        r->n_pending++;
    }
    return 0;
}

int beam_search_start(gen_req *r, const int *max_tokens) {
    struct beam_search *b = calloc(1, sizeof *b);
    if (!b) goto oom;
    r->beam = b;
    b->r = r;
    b->width = r->o.n;
    b->eos = tokenizer_eos_id(r->s->tok);
    b->n_prompts = r->n_prompts;
    b->p = calloc((size_t)r->n_prompts, sizeof *b->p);
    if (!b->p) goto oom;
    for (int i = 0; i < r->n_prompts; i++) {
        bs_prompt *p = &b->p[i];
        p->prompt = i;
        p->max_tokens = max_tokens[i];
        p->live = calloc((size_t)b->width, sizeof *p->live);
        p->slots = calloc((size_t)b->width, sizeof *p->slots);
        p->res = calloc((size_t)b->width, sizeof *p->res);
        if (!p->live || !p->slots || !p->res) goto oom;
        p->n_live = 1; /* the prompt alone, cumulative logprob 0 */
    }
    for (int i = 0; i < r->n_prompts; i++)
        if (bs_submit_step(b, &b->p[i])) {
            beam_search_abort(r);
            return -EINVAL;
        }
    return 0;
oom:
    r->has_err = true;
    oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
    return -ENOMEM;
}

void beam_search_abort(gen_req *r) {
    struct beam_search *b = r->beam;
    if (!b) return;
    b->failed = true;
    for (int i = 0; i < b->n_prompts; i++) {
        bs_prompt *p = &b->p[i];
        for (int k = 0; k < b->width; k++)
            if (p->slots[k].submitted && !p->slots[k].engine_done)
                engine_abort(r->s->eng, p->slots[k].eid);
    }
}

void beam_search_on_token(gen_choice *slot, const engine_token *t) {
    struct beam_search *b = slot->r->beam;
    bs_result *res = &b->p[slot->prompt].res[slot->index];
    res->got = true;
    res->id = t->id;
    res->logprob = t->logprob;
    res->n_top = t->n_top < ENGINE_MAX_TOP_LOGPROBS ? t->n_top : ENGINE_MAX_TOP_LOGPROBS;
    memcpy(res->top_ids, t->top_ids, (size_t)res->n_top * sizeof *res->top_ids);
    memcpy(res->top_lps, t->top_logprobs, (size_t)res->n_top * sizeof *res->top_lps);
}

/* get_beam_search_score: cum / (len ** length_penalty), len = prompt + tokens, less a
 * final eos. */
static double bs_score(const struct beam_search *b, const bs_prompt *p, const bs_beam *bm) {
    int len = b->r->n_pids[p->prompt] + bm->n;
    if (bm->n > 0 && bm->toks[bm->n - 1] == b->eos) len--;
    return bm->cum / pow((double)len, (double)b->r->o.length_penalty);
}

static int cmp_cand(const void *x, const void *y) {
    const bs_cand *a = x, *c = y;
    if (a->cum != c->cum) return a->cum > c->cum ? -1 : 1;
    return a->order - c->order;
}

/* A beam of parent's tokens + tok (tok < 0: none). */
static int bs_extend(const bs_beam *parent, int32_t tok, double cum, bs_beam *out) {
    out->n = parent->n + (tok >= 0);
    out->toks = malloc((size_t)(out->n ? out->n : 1) * sizeof *out->toks);
    if (!out->toks) return -ENOMEM;
    if (parent->n) memcpy(out->toks, parent->toks, (size_t)parent->n * sizeof *out->toks);
    if (tok >= 0) out->toks[parent->n] = tok;
    out->cum = cum;
    out->eos_stop = false;
    return 0;
}

static int bs_add_done(bs_prompt *p, bs_beam *bm) {
    if (p->n_done == p->cap_done) {
        int cap = p->cap_done ? p->cap_done * 2 : 16;
        bs_beam *g = realloc(p->done, (size_t)cap * sizeof *g);
        if (!g) return -ENOMEM;
        p->done = g, p->cap_done = cap;
    }
    p->done[p->n_done++] = *bm;
    return 0;
}

/* Every slot of the step is back: the new beams (vLLM's selection). */
static int bs_advance(struct beam_search *b, bs_prompt *p) {
    gen_req *r = b->r;
    int w = b->width, nc = 0;
    bs_cand *cand = malloc((size_t)p->n_live * (ENGINE_MAX_TOP_LOGPROBS + 1) * sizeof *cand);
    bs_beam *next = calloc((size_t)w, sizeof *next);
    if (!cand || !next) {
        free(cand);
        free(next);
        return -ENOMEM;
    }
    for (int i = 0; i < p->n_live; i++) {
        const bs_result *res = &p->res[i];
        if (!res->got) continue;
        bool sampled_in = false;
        /* vLLM's logprobs entry: the sampled token, then the top ones */
        for (int k = 0; k < res->n_top; k++)
            if (res->top_ids[k] == res->id) sampled_in = true;
        if (!sampled_in) {
            cand[nc] = (bs_cand){i, res->id, p->live[i].cum + res->logprob, nc};
            nc++;
        }
        for (int k = 0; k < res->n_top; k++) {
            cand[nc] = (bs_cand){i, res->top_ids[k], p->live[i].cum + res->top_lps[k], nc};
            nc++;
        }
    }
    int rc = 0;
    int kept = 0;
    for (int k = 0; k < nc && !rc; k++) {
        if (r->o.ignore_eos || cand[k].tok != b->eos) {
            cand[kept++] = cand[k];
            continue;
        }
        /* eos completes the beam; its tokens end with eos only with include_stop_str */
        bs_beam d;
        rc = bs_extend(&p->live[cand[k].beam], r->o.include_stop_str_in_output ? b->eos : -1,
                       cand[k].cum, &d);
        if (!rc) {
            d.eos_stop = true;
            rc = bs_add_done(p, &d);
            if (rc) beam_free(&d);
        }
    }
    qsort(cand, (size_t)kept, sizeof *cand, cmp_cand);
    int nn = kept < w ? kept : w;
    for (int k = 0; k < nn && !rc; k++)
        rc = bs_extend(&p->live[cand[k].beam], cand[k].tok, cand[k].cum, &next[k]);
    for (int k = 0; k < p->n_live; k++)
        beam_free(&p->live[k]);
    free(p->live);
    p->live = next;
    p->n_live = nn;
    p->step++;
    free(cand);
    return rc;
}

typedef struct bs_ranked {
    bs_beam *bm;
    double score;
    int order;
} bs_ranked;

static int cmp_ranked(const void *x, const void *y) {
    const bs_ranked *a = x, *c = y;
    if (a->score != c->score) return a->score > c->score ? -1 : 1;
    return a->order - c->order; /* Python's sort is stable */
}

/* The search of p is over: completed + live ranked, the best width become its choices. */
static int bs_finish_prompt(struct beam_search *b, bs_prompt *p) {
    gen_req *r = b->r;
    p->finished = true;
    int total = p->n_done + p->n_live;
    bs_ranked *rk = malloc((size_t)(total ? total : 1) * sizeof *rk);
    if (!rk) return -ENOMEM;
    int m = 0;
    for (int k = 0; k < p->n_done; k++, m++)
        rk[m] = (bs_ranked){&p->done[k], bs_score(b, p, &p->done[k]), m};
    for (int k = 0; k < p->n_live; k++, m++)
        rk[m] = (bs_ranked){&p->live[k], bs_score(b, p, &p->live[k]), m};
    qsort(rk, (size_t)total, sizeof *rk, cmp_ranked);
    int rc = 0;
    for (int k = 0; k < b->width; k++) {
        gen_choice *c = &r->ch[p->prompt * b->width + k];
        if (k >= total) { /* fewer beams than the width: an empty choice */
            gen_choice_emit(c, "length");
            continue;
        }
        bs_beam *bm = rk[k].bm;
        int nt = bm->n;
        /* vLLM: a final eos is left out of the text (tokenizer.decode of the rest) */
        if (nt > 0 && bm->toks[nt - 1] == b->eos && !r->o.ignore_eos) nt--;
        char *text = NULL;
        size_t len = 0;
        char err[256] = "";
        if (tokenizer_decode(r->s->tok, bm->toks, (size_t)nt, false, &text, &len, err,
                             sizeof err)) {
            LOG_E("server", "%s: decoding a beam failed: %s", r->id, err);
            rc = -EINVAL;
            c->error = strdup("detokenization failed");
            gen_choice_emit(c, "error");
            continue;
        }
        sbuf_append(&c->text, text, len);
        free(text);
        c->n_tokens = bm->n;
        c->cum_logprob = bm->cum;
        if (bm->eos_stop) c->stop_reason = json_integer(b->eos);
        gen_choice_emit(c, bm->eos_stop ? "stop" : "length");
    }
    free(rk);
    return rc;
}

/* The search of p stopped (a failure, or the client left): its choices end with the
 * request's error, streamed when streaming. */
static void bs_end_prompt(struct beam_search *b, bs_prompt *p) {
    gen_req *r = b->r;
    if (p->finished) return;
    p->finished = true;
    for (int k = 0; k < b->width; k++) {
        gen_choice *c = &r->ch[p->prompt * b->width + k];
        if (c->out_done) continue;
        if (r->has_err) {
            c->error = strdup(r->err.message);
            c->error_status = r->err.status;
        }
        gen_choice_emit(c, r->has_err ? "error" : "abort");
    }
}

void beam_search_on_finished(gen_choice *slot, const char *finish_reason, const char *error,
                             int error_status, int kv_role, int n_kv_received, int n_computed) {
    gen_req *r = slot->r;
    struct beam_search *b = r->beam;
    bs_prompt *p = &b->p[slot->prompt];
    slot->engine_done = true;
    p->n_inflight--;
    r->n_pending--;
    /* P/D accounting and usage on the prompt's first choice */
    gen_choice *c0 = &r->ch[p->prompt * b->width];
    if (kv_role) c0->kv_role = kv_role;
    c0->n_kv_received += n_kv_received;
    c0->n_prompt_computed += n_computed;
    if (!strcmp(finish_reason, "error")) {
        int st = error_status >= 400 && error_status <= 599 ? error_status : 500;
        bs_fail(b, st, http_error_type(st), error ? error : "engine error");
        beam_search_abort(r);
    } else if (!p->res[slot->index].got && !b->failed && !r->client_gone) {
        bs_fail(b, 500, "InternalServerError", "a beam search step ended without a token");
        beam_search_abort(r);
    }
    if (p->n_inflight > 0) return;
    if (b->failed || r->client_gone) {
        bs_end_prompt(b, p);
        return;
    }
    if (bs_advance(b, p)) {
        bs_fail(b, 500, "InternalServerError", "out of memory");
        beam_search_abort(r);
        bs_end_prompt(b, p);
        return;
    }
    if (p->step >= p->max_tokens || p->n_live == 0) {
        if (bs_finish_prompt(b, p)) bs_fail(b, 500, "InternalServerError", "detokenization failed");
        return;
    }
    if (bs_submit_step(b, p)) beam_search_abort(r);
    if (p->n_inflight == 0) bs_end_prompt(b, p); /* nothing went out: no event will come */
}
