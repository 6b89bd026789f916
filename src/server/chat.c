/*
 * chat — POST /v1/chat/completions: messages (+ tools) rendered through the
 * model's chat template (model/chat_template) and tokenized, then the gen
 * lifecycle with the chat rendering ("chat.completion" objects, role and
 * content deltas, chat-format logprobs) and tool-call parsing into tool_calls
 * when the request has tools (tool_parser.h: --tool-call-parser, hermes by
 * default).  With
 * --reasoning-parser the <think> part goes to reasoning_content (message and
 * stream deltas) and tool calls are parsed from the rest (reasoning.c).
 */
#include "server/gen.h"
#include "server/reasoning.h"
#include "server/tool_parser.h"
#include "model/prompt_ids.h"

#include <stdlib.h>
#include <string.h>

static const oai_usage *choice_usage(gen_req *r, gen_choice *c, oai_usage *u) {
    if (!r->o.continuous_usage_stats) return NULL;
    *u = (oai_usage){.prompt_tokens = r->n_pids[c->prompt],
                     .completion_tokens = c->n_tokens,
                     .cached_tokens = -1};
    return u;
}

static int chat_stream_start(gen_req *r, sbuf *sse) {
    int rc = 0;
    for (int i = 0; i < r->n_ch && !rc; i++) {
        json_t *delta = json_pack("{s:s,s:s}", "role", "assistant", "content", "");
        rc = oai_sse_event(sse, oai_chat_chunk(r->id, r->created, r->s->model_name, i, delta, NULL,
                                               NULL, NULL, NULL, r->o.include_usage));
    }
    return rc;
}

/* The streaming split of the text released so far (no reasoning parser:
 * all content). */
static void chat_split(gen_req *r, gen_choice *c, bool final, reasoning_split *sp) {
    reasoning_split_stream((reasoning_kind)r->s->cfg.reasoning_parser, r->think_closed,
                           c->text.data ? c->text.data : "", c->text.len, final, sp);
}

/* End (in text) of the content that may be shown now: tool-call text held. */
static size_t chat_content_end(gen_req *r, gen_choice *c, const reasoning_split *sp) {
    if (!r->o.parse_tool_calls) return sp->c_end;
    return sp->c_start +
           r->s->tools->safe_prefix(c->text.data + sp->c_start, sp->c_end - sp->c_start);
}

/* Sets delta.reasoning_content to the reasoning not sent yet, if any. */
static void chat_reasoning_delta(gen_choice *c, const reasoning_split *sp, json_t *delta) {
    if (!sp->has_reasoning || sp->r_end - sp->r_start <= c->r_sent) return;
    json_object_set_new(
        delta, "reasoning_content",
        json_stringn(c->text.data + sp->r_start + c->r_sent, sp->r_end - sp->r_start - c->r_sent));
    c->r_sent = sp->r_end - sp->r_start;
}

static int chat_stream_delta(gen_req *r, gen_choice *c, const char *text, size_t len, sbuf *sse) {
    (void)text;
    (void)len;
    reasoning_split sp;
    chat_split(r, c, false, &sp);
    if (c->sent < sp.c_start) c->sent = sp.c_start;
    size_t end = chat_content_end(r, c, &sp);
    if (end < c->sent) end = c->sent;
    json_t *delta = json_object();
    chat_reasoning_delta(c, &sp, delta);
    if (end > c->sent)
        json_object_set_new(delta, "content", json_stringn(c->text.data + c->sent, end - c->sent));
    if (json_object_size(delta) == 0 && !c->logprobs) {
        json_decref(delta);
        return 0;
    }
    if (json_object_size(delta) == 0) json_object_set_new(delta, "content", json_string(""));
    oai_usage u;
    json_t *chunk =
        oai_chat_chunk(r->id, r->created, r->s->model_name, c->index, delta, c->logprobs, NULL,
                       NULL, choice_usage(r, c, &u), r->o.include_usage);
    c->logprobs = NULL;
    c->sent = end;
    return oai_sse_event(sse, chunk);
}

static int chat_stream_finish(gen_req *r, gen_choice *c, sbuf *sse) {
    json_t *delta = json_object();
    const char *reason = c->finish_reason;
    json_t *calls = NULL;
    size_t content_len = 0;
    reasoning_split sp;
    chat_split(r, c, true, &sp);
    chat_reasoning_delta(c, &sp, delta);
    if (c->sent < sp.c_start) c->sent = sp.c_start;
    const char *ct = c->text.data ? c->text.data + sp.c_start : "";
    size_t clen = sp.c_end - sp.c_start;
    size_t sent = c->sent > sp.c_start ? c->sent - sp.c_start : 0;
    if (r->o.parse_tool_calls &&
        tool_parser_stream_calls(r->s->tools, ct, clen, sent, &calls, &content_len) > 0) {
        if (sp.c_start + content_len > c->sent)
            json_object_set_new(
                delta, "content",
                json_stringn(c->text.data + c->sent, sp.c_start + content_len - c->sent));
        for (size_t i = 0; i < json_array_size(calls); i++)
            json_object_set_new(json_array_get(calls, i), "index", json_integer((json_int_t)i));
        json_object_set_new(delta, "tool_calls", calls);
        if (!strcmp(reason, "stop")) reason = "tool_calls";
    } else if (sp.c_end > c->sent) {
        json_object_set_new(delta, "content",
                            json_stringn(c->text.data + c->sent, sp.c_end - c->sent));
    }
    c->sent = c->text.len;
    oai_usage u;
    json_t *chunk =
        oai_chat_chunk(r->id, r->created, r->s->model_name, c->index, delta, c->logprobs, reason,
                       json_incref(c->stop_reason), choice_usage(r, c, &u), r->o.include_usage);
    c->logprobs = NULL;
    return oai_sse_event(sse, chunk);
}

static json_t *chat_build(gen_req *r) {
    json_t *choices = json_array();
    reasoning_kind rk = (reasoning_kind)r->s->cfg.reasoning_parser;
    for (int i = 0; i < r->n_ch; i++) {
        gen_choice *c = &r->ch[i];
        if (c->dropped) continue;
        const char *all = c->text.data ? c->text.data : "";
        reasoning_split sp;
        reasoning_split_final(rk, all, c->text.len, &sp);
        const char *text = all + sp.c_start;
        size_t len = sp.c_end - sp.c_start;
        json_t *calls = NULL;
        const char *reason = c->finish_reason;
        /* with a reasoning parser, empty content is null (vLLM's `content or None`) */
        bool content_null = rk != REASONING_NONE && len == 0;
        size_t content_len = 0;
        if (r->o.parse_tool_calls && r->s->tools->parse(text, len, &calls, &content_len) > 0) {
            /* a call: the text before it is the content; no call: all of it */
            len = content_len;
            content_null = len == 0;
            if (!strcmp(reason, "stop")) reason = "tool_calls";
        }
        json_t *ch = oai_chat_choice(c->index, text, len, content_null, calls,
                                     json_incref(c->logprobs), reason, json_incref(c->stop_reason));
        if (rk != REASONING_NONE) {
            json_t *msg = json_object_get(ch, "message");
            json_object_set_new(msg, "reasoning_content",
                                sp.has_reasoning
                                    ? json_stringn(all + sp.r_start, sp.r_end - sp.r_start)
                                    : json_null());
        }
        json_array_append_new(choices, ch);
    }
    oai_usage u;
    gen_usage(r, &u);
    json_t *resp = oai_response(true, r->id, r->created, r->s->model_name, choices, &u);
    json_t *plp = r->n_ch > 0 ? r->ch[0].prompt_logprobs : NULL;
    json_object_set_new(resp, "prompt_logprobs", plp ? json_incref(plp) : json_null());
    return resp;
}

static const gen_ops CHAT_OPS = {
    chat_stream_start, chat_stream_delta, chat_stream_finish, chat_build, NULL, NULL, NULL};

/* Render and tokenize the conversation (shared with /tokenize). */
int server_chat_render_ids(server *s, const json_t *messages, const json_t *tools,
                           const json_t *kwargs, bool add_generation_prompt, bool add_special,
                           int32_t **ids, size_t *n, oai_error *err) {
    if (s->mistral) { /* mistral-common's encoding: bos included, no template options */
        char merr[512] = "";
        if (mistral_chat_encode(s->mistral, messages, tools, ids, n, merr, sizeof merr)) {
            oai_error_set(err, 400, "BadRequestError", "messages", "%s", merr);
            return -1;
        }
        return 0;
    }
    if (!s->tmpl) {
        oai_error_set(err, 400, "BadRequestError", "messages",
                      "chat is unavailable for this model: %s; use /v1/completions", s->tmpl_error);
        return -1;
    }
    char msg[512] = "";
    if (prompt_ids_chat(s->tok, s->tmpl, messages, tools, kwargs, add_generation_prompt,
                        add_special, ids, n, msg, sizeof msg)) {
        oai_error_set(err, 400, "BadRequestError", "messages", "%s", msg);
        return -1;
    }
    return 0;
}

json_t *server_body_object(gen_req *r, const char *body, size_t len) {
    json_error_t je;
    json_t *in = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    if (json_is_object(in)) return in;
    oai_error_set(&r->err, 400, "BadRequestError", NULL,
                  in ? "The request body must be a JSON object"
                     : "Invalid JSON body: %s at line %d column %d",
                  je.text, je.line, je.column);
    json_decref(in);
    return NULL;
}

int server_chat_prepare_json(server *s, gen_req *r, json_t *chat) {
    char *text = json_dumps(chat, JSON_COMPACT);
    json_decref(chat);
    if (!text) {
        oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
        return -1;
    }
    int rc = server_chat_prepare(s, r, text, strlen(text));
    free(text);
    return rc;
}

/* Parse, render and tokenize (on the loop or the preparation thread). */
int server_chat_prepare(server *s, gen_req *r, const char *body, size_t len) {
    if (oai_request_parse(&r->o, OAI_CHAT, body, len, &s->defaults, &r->err)) return -1;
    if (gen_prepare_constraint(s, r) || gen_prepare_bad_words(s, r)) return -1;
    r->pids = calloc(1, sizeof *r->pids);
    r->n_pids = calloc(1, sizeof *r->n_pids);
    if (!r->pids || !r->n_pids) {
        oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
        return -1;
    }
    r->n_prompts = 1;
    size_t n = 0;
    if (server_chat_render_ids(s, r->o.messages, r->o.tools, r->o.chat_template_kwargs,
                               r->o.add_generation_prompt, r->o.add_special_tokens, &r->pids[0], &n,
                               &r->err))
        return -1;
    r->n_pids[0] = (int)n;
    if (s->cfg.reasoning_parser != REASONING_NONE && s->tok && n > 0) {
        /* the generation prompt is the tail: whether it closed a think block */
        size_t tail = n < 64 ? n : 64, tl = 0;
        char *t = NULL, terr[128];
        if (!tokenizer_decode(s->tok, r->pids[0] + n - tail, tail, false, &t, &tl, terr,
                              sizeof terr))
            r->think_closed = reasoning_prompt_closes(t, tl);
        free(t);
    }
    if (n == 0) {
        oai_error_set(&r->err, 400, "BadRequestError", "messages",
                      "the conversation renders to no tokens");
        return -1;
    }
    return 0;
}

void server_chat_handle(server *s, hs_req *req) {
    gen_req *r = gen_req_new(s, req, true, &CHAT_OPS);
    if (!r) {
        server_reply_errorf(req, 500, "InternalServerError", NULL, "out of memory");
        return;
    }
    gen_prepare_and_start(r, server_chat_prepare);
}
