/*
 * chat — POST /v1/chat/completions: messages (+ tools) rendered through the
 * model's chat template (model/chat_template) and tokenized, then the gen
 * lifecycle with the chat rendering ("chat.completion" objects, role and
 * content deltas, chat-format logprobs) and Hermes <tool_call> parsing into
 * tool_calls when the request has tools (tool_calls.c).
 */
#include "server/gen.h"
#include "server/tool_calls.h"

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

/* Bytes of text that may be shown as content now. */
static size_t chat_content_end(gen_req *r, gen_choice *c) {
    if (!r->o.parse_tool_calls) return c->text.len;
    return tool_calls_safe_prefix(c->text.data ? c->text.data : "", c->text.len);
}

static int chat_stream_delta(gen_req *r, gen_choice *c, const char *text, size_t len, sbuf *sse) {
    (void)text;
    (void)len;
    size_t end = chat_content_end(r, c);
    if (end < c->sent) end = c->sent;
    if (end == c->sent && !c->logprobs) return 0;
    json_t *delta = json_object();
    json_object_set_new(delta, "content", json_stringn(c->text.data + c->sent, end - c->sent));
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
    if (r->o.parse_tool_calls &&
        tool_calls_parse(c->text.data ? c->text.data : "", c->text.len, &calls, &content_len) > 0) {
        if (content_len > c->sent)
            json_object_set_new(delta, "content",
                                json_stringn(c->text.data + c->sent, content_len - c->sent));
        for (size_t i = 0; i < json_array_size(calls); i++)
            json_object_set_new(json_array_get(calls, i), "index", json_integer((json_int_t)i));
        json_object_set_new(delta, "tool_calls", calls);
        if (!strcmp(reason, "stop")) reason = "tool_calls";
    } else if (c->text.len > c->sent) {
        json_object_set_new(delta, "content",
                            json_stringn(c->text.data + c->sent, c->text.len - c->sent));
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
    for (int i = 0; i < r->n_ch; i++) {
        gen_choice *c = &r->ch[i];
        const char *text = c->text.data ? c->text.data : "";
        size_t len = c->text.len;
        json_t *calls = NULL;
        const char *reason = c->finish_reason;
        bool content_null = false;
        size_t content_len = 0;
        if (r->o.parse_tool_calls && tool_calls_parse(text, len, &calls, &content_len) > 0) {
            /* a call: the text before it is the content; no call: all of it (hermes) */
            len = content_len;
            content_null = len == 0;
            if (!strcmp(reason, "stop")) reason = "tool_calls";
        }
        json_array_append_new(choices, oai_chat_choice(c->index, text, len, content_null, calls,
                                                       json_incref(c->logprobs), reason,
                                                       json_incref(c->stop_reason)));
    }
    oai_usage u;
    gen_usage(r, &u);
    json_t *resp = oai_response(true, r->id, r->created, r->s->model_name, choices, &u);
    json_t *plp = r->n_ch > 0 ? r->ch[0].prompt_logprobs : NULL;
    json_object_set_new(resp, "prompt_logprobs", plp ? json_incref(plp) : json_null());
    return resp;
}

static const gen_ops CHAT_OPS = {chat_stream_start, chat_stream_delta, chat_stream_finish,
                                 chat_build};

/* Render and tokenize the conversation (shared with /tokenize). */
int chat_render_ids(server *s, const json_t *messages, const json_t *tools,
                    bool add_generation_prompt, bool add_special, int32_t **ids, size_t *n,
                    oai_error *err) {
    if (!s->tmpl) {
        oai_error_set(err, 400, "BadRequestError", "messages",
                      "chat is unavailable for this model: %s; use /v1/completions", s->tmpl_error);
        return -1;
    }
    chat_template_opts opts = {.add_generation_prompt = add_generation_prompt,
                               .parse_tool_arguments = true};
    char *text = NULL, msg[512] = "";
    size_t len = 0;
    if (chat_template_render(s->tmpl, messages, tools, &opts, &text, &len, msg, sizeof msg)) {
        oai_error_set(err, 400, "BadRequestError", "messages", "%s", msg);
        return -1;
    }
    int rc = tokenizer_encode(s->tok, text, len, add_special, ids, n, msg, sizeof msg);
    free(text);
    if (rc) {
        oai_error_set(err, 400, "BadRequestError", "messages", "%s", msg);
        return -1;
    }
    return 0;
}

/* Parse, render and tokenize (on the loop or the preparation thread). */
static int chat_prepare(server *s, gen_req *r, const char *body, size_t len) {
    if (oai_request_parse(&r->o, OAI_CHAT, body, len, &s->defaults, &r->err)) return -1;
    r->pids = calloc(1, sizeof *r->pids);
    r->n_pids = calloc(1, sizeof *r->n_pids);
    if (!r->pids || !r->n_pids) {
        oai_error_set(&r->err, 500, "InternalServerError", NULL, "out of memory");
        return -1;
    }
    r->n_prompts = 1;
    size_t n = 0;
    if (chat_render_ids(s, r->o.messages, r->o.tools, r->o.add_generation_prompt,
                        r->o.add_special_tokens, &r->pids[0], &n, &r->err))
        return -1;
    r->n_pids[0] = (int)n;
    if (n == 0) {
        oai_error_set(&r->err, 400, "BadRequestError", "messages",
                      "the conversation renders to no tokens");
        return -1;
    }
    return 0;
}

void chat_handle(server *s, hs_req *req) {
    gen_req *r = gen_req_new(s, req, true, &CHAT_OPS);
    if (!r) {
        server_reply_errorf(req, 500, "InternalServerError", NULL, "out of memory");
        return;
    }
    gen_prepare_and_start(r, chat_prepare);
}
