/*
 * completion — POST /v1/completions: prompts (text or token ids, one or many)
 * → token ids, then the gen lifecycle with the completions rendering
 * ("text_completion" objects; echo; logprobs in the completions format).
 */
#include "server/gen.h"

#include <stdlib.h>
#include <string.h>

/* Stream usage for one choice (continuous_usage_stats). */
static const oai_usage *choice_usage(gen_req *r, gen_choice *c, oai_usage *u) {
    if (!r->o.continuous_usage_stats) return NULL;
    *u = (oai_usage){.prompt_tokens = r->n_pids[c->prompt],
                     .completion_tokens = c->n_tokens,
                     .cached_tokens = -1};
    return u;
}

static int cmpl_stream_delta(gen_req *r, gen_choice *c, const char *text, size_t len, sbuf *sse) {
    (void)text;
    (void)len;
    size_t n = c->text.len - c->sent;
    if (n == 0 && !c->logprobs) return 0;
    oai_usage u;
    json_t *chunk = oai_completion_chunk(r->id, r->created, r->s->model_name, c->index,
                                         c->text.data + c->sent, n, c->logprobs, NULL, NULL,
                                         choice_usage(r, c, &u), r->o.include_usage);
    c->logprobs = NULL;
    c->sent = c->text.len;
    return oai_sse_event(sse, chunk);
}

static int cmpl_stream_finish(gen_req *r, gen_choice *c, sbuf *sse) {
    oai_usage u;
    size_t n = c->text.len - c->sent;
    json_t *chunk = oai_completion_chunk(
        r->id, r->created, r->s->model_name, c->index, c->text.data + c->sent, n, c->logprobs,
        c->finish_reason, json_incref(c->stop_reason), choice_usage(r, c, &u), r->o.include_usage);
    c->logprobs = NULL;
    c->sent = c->text.len;
    return oai_sse_event(sse, chunk);
}

/* echo: prompt logprobs first, then the generated tokens'. */
static json_t *cmpl_logprobs(gen_choice *c) {
    if (!c->echo_logprobs) return json_incref(c->logprobs);
    json_t *all = json_deep_copy(c->echo_logprobs);
    if (c->logprobs) {
        const char *keys[] = {"text_offset", "token_logprobs", "tokens", "top_logprobs"};
        for (int k = 0; k < 4; k++)
            json_array_extend(json_object_get(all, keys[k]), json_object_get(c->logprobs, keys[k]));
    }
    return all;
}

static json_t *cmpl_build(gen_req *r) {
    json_t *choices = json_array();
    for (int i = 0; i < r->n_ch; i++) {
        gen_choice *c = &r->ch[i];
        if (c->dropped) continue;
        json_array_append_new(choices, oai_completion_choice(c->index, c->text.data, c->text.len,
                                                             cmpl_logprobs(c), c->finish_reason,
                                                             json_incref(c->stop_reason),
                                                             json_incref(c->prompt_logprobs)));
    }
    oai_usage u;
    gen_usage(r, &u);
    return oai_response(false, r->id, r->created, r->s->model_name, choices, &u);
}

static const gen_ops CMPL_OPS = {
    NULL, cmpl_stream_delta, cmpl_stream_finish, cmpl_build, NULL, NULL, NULL};

/* Tokenize (or copy) every prompt into r->pids; keep its text for echo. */
static int cmpl_prepare_prompts(server *s, gen_req *r) {
    int n = r->o.n_prompts;
    r->pids = calloc((size_t)n, sizeof *r->pids);
    r->n_pids = calloc((size_t)n, sizeof *r->n_pids);
    r->ptext = calloc((size_t)n, sizeof *r->ptext);
    r->ptext_len = calloc((size_t)n, sizeof *r->ptext_len);
    if (!r->pids || !r->n_pids || !r->ptext || !r->ptext_len) {
        oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
        return -1;
    }
    r->n_prompts = n;
    for (int i = 0; i < n; i++) {
        oai_prompt *p = &r->o.prompts[i];
        char err[512] = "";
        if (p->text) {
            int32_t *ids = NULL;
            size_t nid = 0;
            if (tokenizer_encode(s->tok, p->text, p->text_len, r->o.add_special_tokens, &ids, &nid,
                                 err, sizeof err)) {
                oai_error_set(&r->err, 400, "BadRequestError", "prompt", "prompt %d: %s", i, err);
                return -1;
            }
            if (nid == 0) {
                free(ids);
                oai_error_set(&r->err, 400, "BadRequestError", "prompt",
                              "prompt %d encodes to no tokens", i);
                return -1;
            }
            r->pids[i] = ids;
            r->n_pids[i] = (int)nid;
            if (r->o.echo) {
                r->ptext[i] = p->text;
                r->ptext_len[i] = p->text_len;
                p->text = NULL;
            }
        } else {
            r->pids[i] = p->ids;
            r->n_pids[i] = p->n_ids;
            p->ids = NULL;
            int vocab = tokenizer_vocab_size(s->tok);
            for (int k = 0; k < r->n_pids[i]; k++)
                if (r->pids[i][k] >= vocab) {
                    oai_error_set(&r->err, 400, "BadRequestError", "prompt",
                                  "token id %d at position %d of prompt %d is out of range: the "
                                  "vocabulary has ids 0..%d",
                                  r->pids[i][k], k, i, vocab - 1);
                    return -1;
                }
            if (r->o.echo && tokenizer_decode(s->tok, r->pids[i], (size_t)r->n_pids[i], false,
                                              &r->ptext[i], &r->ptext_len[i], err, sizeof err)) {
                oai_error_set(&r->err, 400, "BadRequestError", "prompt", "prompt %d: %s", i, err);
                return -1;
            }
        }
    }
    return 0;
}

/* Parse and tokenize (on the loop or the preparation thread). */
static int cmpl_prepare(server *s, gen_req *r, const char *body, size_t len) {
    if (oai_request_parse(&r->o, OAI_COMPLETIONS, body, len, &s->defaults, &r->err)) return -1;
    if (gen_prepare_constraint(s, r) || gen_prepare_bad_words(s, r)) return -1;
    if (r->o.stream && r->o.echo && r->o.logprobs >= 0) {
        oai_error_set(&r->err, 400, "BadRequestError", "echo",
                      "'echo' together with 'logprobs' is not available when 'stream' is true");
        return -1;
    }
    return cmpl_prepare_prompts(s, r);
}

void server_completion_handle(server *s, hs_req *req) {
    gen_req *r = gen_req_new(s, req, false, &CMPL_OPS);
    if (!r) {
        server_reply_errorf(req, 500, "InternalServerError", NULL, "out of memory");
        return;
    }
    gen_prepare_and_start(r, cmpl_prepare);
}
