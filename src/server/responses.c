/*
 * responses — POST /v1/responses, OpenAI's Responses API as vLLM serves it, without
 * storage.  The request (input as a string or a list of items, instructions,
 * max_output_tokens, temperature, top_p, function tools, tool_choice, text.format, stream
 * and vLLM's sampling extras) is translated into a chat completions body, which chat.c
 * renders and tokenizes; the gen lifecycle runs it and this module renders the "response"
 * object (message, function_call and reasoning output items, usage with input/output
 * tokens) or the stream of Responses events: response.created, response.in_progress,
 * response.output_item.added, response.content_part.added, response.output_text.delta,
 * response.output_text.done, response.content_part.done, response.output_item.done (and
 * response.function_call_arguments.delta / .done for calls), response.completed.
 * Responses are not stored: `store` is accepted and ignored (as vLLM without its store),
 * previous_response_id, background and conversation are refused.
 */
#include "server/gen.h"
#include "server/reasoning.h"
#include "server/tool_parser.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct resp_ext {
    json_t *req;      /* the Responses request (echoed in the response object) */
    int seq;          /* stream: next sequence_number */
    bool msg_open;    /* stream: the message item and its text part were announced */
    int msg_index;    /* its output_index */
    int rs_state;     /* stream: the reasoning item 0 not started, 1 open, 2 done */
    int rs_index;     /* its output_index */
    json_t *items;    /* stream: the output items in the order they were emitted */
    char msg_id[200]; /* "msg_..." */
} resp_ext;

static void resp_ext_free(void *p) {
    resp_ext *x = p;
    if (!x) return;
    json_decref(x->req);
    json_decref(x->items);
    free(x);
}

static int bad(oai_error *e, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int bad(oai_error *e, const char *param, const char *fmt, ...) {
    char msg[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    oai_error_set(e, 400, "BadRequestError", param, "%s", msg);
    return -1;
}

/* A message content: a string, or a list of text parts (input_text, output_text, text)
 * joined.  NULL with err set when a part is not text. */
static json_t *content_text(const json_t *c, const char *where, oai_error *err) {
    if (json_is_string(c)) return json_incref((json_t *)c);
    if (!json_is_array(c)) {
        bad(err, "input", "%s: 'content' must be a string or a list of text parts", where);
        return NULL;
    }
    size_t cap = 64, len = 0;
    char *buf = malloc(cap);
    if (!buf) return NULL;
    for (size_t i = 0; i < json_array_size(c); i++) {
        const json_t *p = json_array_get(c, i);
        const char *ty = json_string_value(json_object_get(p, "type"));
        const json_t *t = json_object_get(p, "text");
        if (!ty || !json_is_string(t) ||
            (strcmp(ty, "input_text") && strcmp(ty, "output_text") && strcmp(ty, "text"))) {
            free(buf);
            bad(err, "input",
                "%s: content part %zu is of type '%s'; accepted: input_text, output_text (images, "
                "files and audio are not supported)",
                where, i, ty ? ty : "?");
            return NULL;
        }
        size_t n = json_string_length(t);
        if (len + n + 1 > cap) {
            while (len + n + 1 > cap)
                cap *= 2;
            char *g = realloc(buf, cap);
            if (!g) {
                free(buf);
                return NULL;
            }
            buf = g;
        }
        memcpy(buf + len, json_string_value(t), n);
        len += n;
    }
    json_t *s = json_stringn(buf, len);
    free(buf);
    return s;
}

/* input items → chat messages (appended to msgs). */
static int input_to_messages(const json_t *input, json_t *msgs, oai_error *err) {
    if (json_is_string(input)) {
        json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "user", "content", input));
        return 0;
    }
    if (!json_is_array(input) || json_array_size(input) == 0)
        return bad(err, "input", "'input' must be a string or a non-empty list of input items");
    for (size_t i = 0; i < json_array_size(input); i++) {
        const json_t *it = json_array_get(input, i);
        char where[64];
        snprintf(where, sizeof where, "input item %zu", i);
        if (!json_is_object(it)) return bad(err, "input", "%s must be an object", where);
        const char *type = json_string_value(json_object_get(it, "type"));
        const char *role = json_string_value(json_object_get(it, "role"));
        if (role && (!type || !strcmp(type, "message"))) {
            if (strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "system") &&
                strcmp(role, "developer"))
                return bad(err, "input",
                           "%s has role '%s'; accepted: user, assistant, system, developer", where,
                           role);
            json_t *c = content_text(json_object_get(it, "content"), where, err);
            if (!c) return -1;
            json_array_append_new(msgs, json_pack("{s:s,s:o}", "role",
                                                  !strcmp(role, "developer") ? "system" : role,
                                                  "content", c));
        } else if (type && !strcmp(type, "function_call")) {
            const json_t *name = json_object_get(it, "name"),
                         *args = json_object_get(it, "arguments");
            const json_t *cid = json_object_get(it, "call_id");
            if (!json_is_string(name) || !json_is_string(args) || !json_is_string(cid))
                return bad(err, "input",
                           "%s (function_call) needs string 'call_id', 'name' and 'arguments'",
                           where);
            json_t *call = json_pack("{s:O,s:s,s:{s:O,s:O}}", "id", cid, "type", "function",
                                     "function", "name", name, "arguments", args);
            json_t *last = json_array_get(msgs, json_array_size(msgs) - 1);
            json_t *calls = json_object_get(last, "tool_calls");
            if (last && json_is_array(calls) &&
                !strcmp(json_string_value(json_object_get(last, "role")), "assistant")) {
                json_array_append_new(calls, call);
            } else {
                json_array_append_new(msgs, json_pack("{s:s,s:s,s:[o]}", "role", "assistant",
                                                      "content", "", "tool_calls", call));
            }
        } else if (type && !strcmp(type, "function_call_output")) {
            const json_t *cid = json_object_get(it, "call_id"),
                         *out = json_object_get(it, "output");
            if (!json_is_string(cid))
                return bad(err, "input", "%s (function_call_output) needs a string 'call_id'",
                           where);
            json_t *c = content_text(out, where, err);
            if (!c) return -1;
            json_array_append_new(msgs, json_pack("{s:s,s:O,s:o}", "role", "tool", "tool_call_id",
                                                  cid, "content", c));
        } else if (type && !strcmp(type, "reasoning")) {
            continue; /* the model's earlier reasoning is not rendered again */
        } else {
            return bad(err, "input",
                       "%s is of type '%s'; accepted: message (role + content), function_call, "
                       "function_call_output, reasoning",
                       where, type ? type : "?");
        }
    }
    return 0;
}

/* Responses tools (flat) → chat tools. */
static int tools_to_chat(const json_t *tools, json_t *chat, oai_error *err) {
    if (!json_is_array(tools)) return bad(err, "tools", "'tools' must be a list of tools");
    json_t *out = json_array();
    for (size_t i = 0; i < json_array_size(tools); i++) {
        const json_t *t = json_array_get(tools, i);
        const char *ty = json_string_value(json_object_get(t, "type"));
        const json_t *name = json_object_get(t, "name");
        if (!ty || strcmp(ty, "function") || !json_is_string(name)) {
            json_decref(out);
            return bad(err, "tools",
                       "'tools' element %zu must be {\"type\": \"function\", \"name\": ..., "
                       "\"parameters\": ...}%s",
                       i,
                       ty && strcmp(ty, "function") ? " (built-in tools such as web_search are "
                                                      "not supported)"
                                                    : "");
        }
        json_t *f = json_pack("{s:O}", "name", name);
        const json_t *d = json_object_get(t, "description"), *p = json_object_get(t, "parameters");
        if (json_is_string(d)) json_object_set(f, "description", (json_t *)d);
        if (p && !json_is_null(p)) json_object_set(f, "parameters", (json_t *)p);
        json_array_append_new(out, json_pack("{s:s,s:o}", "type", "function", "function", f));
    }
    json_object_set_new(chat, "tools", out);
    return 0;
}

static const char *const PASS[] = {"model",
                                   "temperature",
                                   "top_p",
                                   "stream",
                                   "top_k",
                                   "min_p",
                                   "repetition_penalty",
                                   "seed",
                                   "stop",
                                   "ignore_eos",
                                   "presence_penalty",
                                   "frequency_penalty",
                                   "logit_bias",
                                   "skip_special_tokens",
                                   "include_stop_str_in_output",
                                   "chat_template_kwargs",
                                   "kv_transfer_params"};
static const char *const ECHOED[] = {
    "store",        "metadata",         "parallel_tool_calls", "user",
    "service_tier", "prompt_cache_key", "safety_identifier"};

/* The Responses body → a chat completions body (NULL with err set). */
static json_t *to_chat(const json_t *in, oai_error *err) {
    json_t *chat = json_object();
    json_t *msgs = json_array();
    json_object_set_new(chat, "messages", msgs);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)in, k, v) {
        bool known = false;
        for (size_t i = 0; i < sizeof PASS / sizeof *PASS; i++)
            if (!strcmp(k, PASS[i])) {
                json_object_set(chat, k, v);
                known = true;
            }
        for (size_t i = 0; i < sizeof ECHOED / sizeof *ECHOED; i++)
            if (!strcmp(k, ECHOED[i])) known = true;
        if (known || !strcmp(k, "input") || !strcmp(k, "instructions") ||
            !strcmp(k, "max_output_tokens") || !strcmp(k, "tools") || !strcmp(k, "tool_choice") ||
            !strcmp(k, "text") || json_is_null(v))
            continue;
        if (!strcmp(k, "previous_response_id") || !strcmp(k, "conversation")) {
            bad(err, k,
                "'%s' is not supported: this server does not store responses; send the "
                "whole conversation in 'input'",
                k);
            goto fail;
        }
        if (!strcmp(k, "background") && json_is_false(v)) continue;
        if (!strcmp(k, "truncation") && json_is_string(v) &&
            !strcmp(json_string_value(v), "disabled"))
            continue;
        if (!strcmp(k, "include") && json_is_array(v) && json_array_size(v) == 0) continue;
        if (!strcmp(k, "top_logprobs") && json_is_integer(v) && json_integer_value(v) == 0)
            continue;
        bad(err, k,
            "'%s' is not supported by /v1/responses here; accepted: input, instructions, "
            "max_output_tokens, temperature, top_p, tools (function), tool_choice, text.format, "
            "stream, store (ignored: nothing is stored), metadata, parallel_tool_calls, user, "
            "truncation \"disabled\", and vLLM's top_k, min_p, repetition_penalty, seed, stop, "
            "ignore_eos, presence_penalty, frequency_penalty, logit_bias",
            k);
        goto fail;
    }
    const json_t *ins = json_object_get(in, "instructions");
    if (ins && !json_is_null(ins)) {
        if (!json_is_string(ins)) {
            bad(err, "instructions", "'instructions' must be a string");
            goto fail;
        }
        json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "system", "content", ins));
    }
    const json_t *input = json_object_get(in, "input");
    if (!input || json_is_null(input)) {
        bad(err, "input", "'input' is required: a string or a list of input items");
        goto fail;
    }
    if (input_to_messages(input, msgs, err)) goto fail;
    const json_t *mo = json_object_get(in, "max_output_tokens");
    if (mo && !json_is_null(mo)) {
        if (!json_is_integer(mo) || json_integer_value(mo) < 1) {
            bad(err, "max_output_tokens", "'max_output_tokens' must be a positive integer");
            goto fail;
        }
        json_object_set(chat, "max_tokens", (json_t *)mo);
    }
    const json_t *tools = json_object_get(in, "tools");
    if (tools && !json_is_null(tools) && tools_to_chat(tools, chat, err)) goto fail;
    const json_t *tc = json_object_get(in, "tool_choice");
    if (tc && !json_is_null(tc)) {
        if (json_is_string(tc)) {
            json_object_set(chat, "tool_choice", (json_t *)tc);
        } else if (json_is_object(tc) && json_is_string(json_object_get(tc, "name"))) {
            json_object_set_new(chat, "tool_choice",
                                json_pack("{s:s,s:{s:O}}", "type", "function", "function", "name",
                                          json_object_get(tc, "name")));
        } else {
            bad(err, "tool_choice",
                "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                "{\"type\": \"function\", \"name\": ...}");
            goto fail;
        }
    }
    const json_t *text = json_object_get(in, "text");
    const json_t *fmt = json_object_get(text, "format");
    if (text && !json_is_null(text) && !json_is_object(text)) {
        bad(err, "text", "'text' must be an object such as {\"format\": {\"type\": \"text\"}}");
        goto fail;
    }
    if (fmt && !json_is_null(fmt)) {
        const char *ty = json_string_value(json_object_get(fmt, "type"));
        if (ty && !strcmp(ty, "json_schema")) {
            json_t *js = json_pack("{s:O*,s:O*}", "name", json_object_get(fmt, "name"), "schema",
                                   json_object_get(fmt, "schema"));
            if (json_object_get(fmt, "strict"))
                json_object_set(js, "strict", json_object_get(fmt, "strict"));
            json_object_set_new(chat, "response_format",
                                json_pack("{s:s,s:o}", "type", "json_schema", "json_schema", js));
        } else if (ty && !strcmp(ty, "json_object")) {
            json_object_set_new(chat, "response_format", json_pack("{s:s}", "type", "json_object"));
        } else if (!ty || strcmp(ty, "text")) {
            bad(err, "text",
                "'text.format.type' must be \"text\", \"json_schema\" or "
                "\"json_object\"");
            goto fail;
        }
    }
    return chat;
fail:
    json_decref(chat);
    return NULL;
}

static int resp_prepare(server *s, gen_req *r, const char *body, size_t len) {
    json_t *in = server_body_object(r, body, len);
    if (!in) return -1;
    json_t *chat = to_chat(in, &r->err);
    resp_ext *x = r->ext;
    x->req = in;
    if (!chat) return -1;
    int rc = server_chat_prepare_json(s, r, chat);
    if (rc) { /* the chat fields' names in Responses terms */
        if (!strcmp(r->err.param, "messages")) snprintf(r->err.param, sizeof r->err.param, "input");
        if (!strcmp(r->err.param, "max_tokens"))
            snprintf(r->err.param, sizeof r->err.param, "max_output_tokens");
    }
    return rc;
}

/* ---- rendering --------------------------------------------------------------------- */

static json_t *text_part(const char *t, size_t n) {
    return json_pack("{s:s,s:s%,s:[],s:[]}", "type", "output_text", "text", t, n, "annotations",
                     "logprobs");
}

static json_t *message_item(const char *id, const char *t, size_t n, const char *status) {
    return json_pack("{s:s,s:s,s:s,s:s,s:[o]}", "id", id, "type", "message", "role", "assistant",
                     "status", status, "content", text_part(t, n));
}

static json_t *call_item(gen_req *r, const json_t *call, int i, const char *status) {
    const json_t *f = json_object_get(call, "function");
    char fid[240];
    snprintf(fid, sizeof fid, "fc_%s_%d", r->id + 5, i);
    return json_pack("{s:s,s:s,s:O,s:O,s:O,s:s}", "type", "function_call", "id", fid, "call_id",
                     json_object_get(call, "id"), "name", json_object_get(f, "name"), "arguments",
                     json_object_get(f, "arguments"), "status", status);
}

/* The final split of c's text: reasoning, content (before the calls) and calls. */
typedef struct resp_split {
    reasoning_split sp;
    const char *content;
    size_t content_len;
    json_t *calls; /* or NULL */
} resp_split;

static void resp_split_final(gen_req *r, gen_choice *c, resp_split *o) {
    const char *all = c->text.data ? c->text.data : "";
    reasoning_split_final((reasoning_kind)r->s->cfg.reasoning_parser, all, c->text.len, &o->sp);
    o->content = all + o->sp.c_start;
    o->content_len = o->sp.c_end - o->sp.c_start;
    o->calls = NULL;
    size_t cl = 0;
    if (r->o.parse_tool_calls && r->s->tools->parse(o->content, o->content_len, &o->calls, &cl) > 0)
        o->content_len = cl;
    else if (o->calls) {
        json_decref(o->calls);
        o->calls = NULL;
    }
}

static json_t *reasoning_item(gen_req *r, const resp_split *o, gen_choice *c) {
    char id[240];
    snprintf(id, sizeof id, "rs_%s", r->id + 5);
    return json_pack("{s:s,s:s,s:[],s:[{s:s,s:s%}],s:n}", "id", id, "type", "reasoning", "summary",
                     "content", "type", "reasoning_text", "text", c->text.data + o->sp.r_start,
                     o->sp.r_end - o->sp.r_start, "status");
}

static json_t *resp_usage(gen_req *r) {
    oai_usage u;
    gen_usage(r, &u);
    return json_pack("{s:i,s:{s:i},s:i,s:{s:i},s:i}", "input_tokens", u.prompt_tokens,
                     "input_tokens_details", "cached_tokens",
                     u.cached_tokens > 0 ? u.cached_tokens : 0, "output_tokens",
                     u.completion_tokens, "output_tokens_details", "reasoning_tokens", 0,
                     "total_tokens", u.prompt_tokens + u.completion_tokens);
}

static json_t *echo_or(const json_t *req, const char *key, json_t *dflt) {
    const json_t *v = json_object_get(req, key);
    if (v && !json_is_null(v)) {
        json_decref(dflt);
        return json_incref((json_t *)v);
    }
    return dflt;
}

/* A float parameter as the number the client wrote (0.95, not 0.949999988). */
static json_t *short_real(float f) {
    char b[32];
    snprintf(b, sizeof b, "%.7g", (double)f);
    return json_real(strtod(b, NULL));
}

/* The response object; output NULL: [] (in progress). */
static json_t *resp_object(gen_req *r, const char *status, json_t *output, bool with_usage) {
    resp_ext *x = r->ext;
    const json_t *q = x->req;
    json_t *incomplete = json_null();
    if (!strcmp(status, "incomplete"))
        incomplete = json_pack("{s:s}", "reason", "max_output_tokens");
    json_t *tools = echo_or(q, "tools", json_array());
    json_t *o = json_pack(
        "{s:s,s:s,s:I,s:s,s:s,s:o,s:o,s:o,s:o,s:o,s:o,s:o,s:o,s:o,s:b,s:o,s:o,s:n,s:n,s:o,s:o,"
        "s:s,s:o,s:o,s:s,s:o,s:o}",
        "id", r->id, "object", "response", "created_at", (json_int_t)r->created, "model",
        r->s->model_name, "status", status, "incomplete_details", incomplete, "instructions",
        echo_or(q, "instructions", json_null()), "metadata", echo_or(q, "metadata", json_null()),
        "output", output ? output : json_array(), "parallel_tool_calls",
        echo_or(q, "parallel_tool_calls", json_true()), "temperature",
        short_real(r->o.sampling.temperature), "tool_choice",
        echo_or(q, "tool_choice", json_string("auto")), "tools", tools, "top_p",
        short_real(r->o.sampling.top_p), "background", 0, "max_output_tokens",
        echo_or(q, "max_output_tokens", json_null()), "previous_response_id", json_null(), "prompt",
        "reasoning", "text", echo_or(q, "text", json_pack("{s:{s:s}}", "format", "type", "text")),
        "top_logprobs", json_integer(0), "truncation", "disabled", "usage",
        with_usage ? resp_usage(r) : json_null(), "user", echo_or(q, "user", json_null()),
        "service_tier", "auto", "store", json_false(), "error", json_null());
    return o;
}

static const char *final_status(gen_choice *c) {
    return c && !strcmp(c->finish_reason ? c->finish_reason : "", "length") ? "incomplete"
                                                                            : "completed";
}

static json_t *resp_build(gen_req *r) {
    gen_choice *c = &r->ch[0];
    resp_split o;
    resp_split_final(r, c, &o);
    json_t *out = json_array();
    if (o.sp.has_reasoning) json_array_append_new(out, reasoning_item(r, &o, c));
    resp_ext *x = r->ext;
    if (o.content_len > 0 || !o.calls)
        json_array_append_new(out, message_item(x->msg_id, o.content, o.content_len, "completed"));
    for (size_t i = 0; o.calls && i < json_array_size(o.calls); i++)
        json_array_append_new(out, call_item(r, json_array_get(o.calls, i), (int)i, "completed"));
    json_decref(o.calls);
    return resp_object(r, final_status(c), out, true);
}

/* ---- streaming ------------------------------------------------------------------------ */

/* event: TYPE / data: {"type": TYPE, "sequence_number": N, ...fields} */
static int resp_event(gen_req *r, sbuf *sse, const char *type, json_t *fields) {
    resp_ext *x = r->ext;
    json_t *e = json_pack("{s:s,s:i}", "type", type, "sequence_number", x->seq++);
    json_object_update(e, fields);
    json_decref(fields);
    char *t = json_dumps(e, JSON_COMPACT);
    json_decref(e);
    if (!t) return -1;
    int rc = sbuf_appendf(sse, "event: %s\ndata: %s\n\n", type, t);
    free(t);
    return rc;
}

static int resp_stream_start(gen_req *r, sbuf *sse) {
    resp_event(r, sse, "response.created",
               json_pack("{s:o}", "response", resp_object(r, "in_progress", NULL, false)));
    return resp_event(r, sse, "response.in_progress",
                      json_pack("{s:o}", "response", resp_object(r, "in_progress", NULL, false)));
}

static void open_message(gen_req *r, sbuf *sse) {
    resp_ext *x = r->ext;
    if (x->msg_open) return;
    x->msg_open = true;
    x->msg_index = (int)json_array_size(x->items);
    json_array_append_new(x->items, json_null()); /* its place; the final item at the end */
    resp_event(r, sse, "response.output_item.added",
               json_pack("{s:i,s:{s:s,s:s,s:s,s:s,s:[]}}", "output_index", x->msg_index, "item",
                         "id", x->msg_id, "type", "message", "role", "assistant", "status",
                         "in_progress", "content"));
    resp_event(r, sse, "response.content_part.added",
               json_pack("{s:s,s:i,s:i,s:o}", "item_id", x->msg_id, "output_index", x->msg_index,
                         "content_index", 0, "part", text_part("", 0)));
}

static void text_delta(gen_req *r, sbuf *sse, const char *t, size_t n) {
    resp_ext *x = r->ext;
    if (n == 0) return;
    open_message(r, sse);
    resp_event(r, sse, "response.output_text.delta",
               json_pack("{s:s,s:i,s:i,s:s%,s:[]}", "item_id", x->msg_id, "output_index",
                         x->msg_index, "content_index", 0, "delta", t, n, "logprobs"));
}

static void rs_id(gen_req *r, char *id, size_t cap) {
    snprintf(id, cap, "rs_%s", r->id + 5);
}

/* Reasoning text streamed as a reasoning item: opened on its first text. */
static void reasoning_delta(gen_req *r, sbuf *sse, const char *t, size_t n) {
    resp_ext *x = r->ext;
    char id[240];
    rs_id(r, id, sizeof id);
    if (x->rs_state == 0) {
        x->rs_state = 1;
        x->rs_index = (int)json_array_size(x->items);
        json_array_append_new(x->items, json_null()); /* its place; the final item at the end */
        resp_event(r, sse, "response.output_item.added",
                   json_pack("{s:i,s:{s:s,s:s,s:[],s:[],s:n}}", "output_index", x->rs_index, "item",
                             "id", id, "type", "reasoning", "summary", "content", "status"));
    }
    if (n > 0)
        resp_event(r, sse, "response.reasoning_text.delta",
                   json_pack("{s:s,s:i,s:i,s:s%}", "item_id", id, "output_index", x->rs_index,
                             "content_index", 0, "delta", t, n));
}

/* Close the reasoning item with its whole text. */
static void reasoning_done(gen_req *r, sbuf *sse, const char *t, size_t n) {
    resp_ext *x = r->ext;
    if (x->rs_state != 1) return;
    x->rs_state = 2;
    char id[240];
    rs_id(r, id, sizeof id);
    resp_event(r, sse, "response.reasoning_text.done",
               json_pack("{s:s,s:i,s:i,s:s%}", "item_id", id, "output_index", x->rs_index,
                         "content_index", 0, "text", t, n));
    json_t *item =
        json_pack("{s:s,s:s,s:[],s:[{s:s,s:s%}],s:n}", "id", id, "type", "reasoning", "summary",
                  "content", "type", "reasoning_text", "text", t, n, "status");
    json_array_set(x->items, (size_t)x->rs_index, item);
    resp_event(r, sse, "response.output_item.done",
               json_pack("{s:i,s:o}", "output_index", x->rs_index, "item", item));
}

/* Content that may be sent now: after any reasoning, before text that may be a tool call. */
static int resp_stream_delta(gen_req *r, gen_choice *c, const char *text, size_t len, sbuf *sse) {
    (void)text;
    (void)len;
    reasoning_split sp;
    reasoning_split_stream((reasoning_kind)r->s->cfg.reasoning_parser, r->think_closed,
                           c->text.data ? c->text.data : "", c->text.len, false, &sp);
    resp_ext *x = r->ext;
    if (sp.has_reasoning && x->rs_state < 2 && sp.r_end - sp.r_start > c->r_sent) {
        reasoning_delta(r, sse, c->text.data + sp.r_start + c->r_sent,
                        sp.r_end - sp.r_start - c->r_sent);
        c->r_sent = sp.r_end - sp.r_start;
    }
    if (c->sent < sp.c_start) c->sent = sp.c_start;
    size_t end = sp.c_end;
    if (r->o.parse_tool_calls)
        end =
            sp.c_start + r->s->tools->safe_prefix(c->text.data + sp.c_start, sp.c_end - sp.c_start);
    if (end > c->sent) {
        if (x->rs_state == 1) /* the content started: the reasoning is over */
            reasoning_done(r, sse, c->text.data + sp.r_start, sp.r_end - sp.r_start);
        text_delta(r, sse, c->text.data + c->sent, end - c->sent);
        c->sent = end;
    }
    return 0;
}

static int resp_stream_finish(gen_req *r, gen_choice *c, sbuf *sse) {
    resp_ext *x = r->ext;
    resp_split o;
    resp_split_final(r, c, &o);
    if (o.sp.has_reasoning && x->rs_state < 2) { /* what was not streamed of it, then done */
        size_t rl = o.sp.r_end - o.sp.r_start;
        if (rl > c->r_sent || x->rs_state == 0)
            reasoning_delta(r, sse, c->text.data + o.sp.r_start + c->r_sent,
                            rl > c->r_sent ? rl - c->r_sent : 0);
        reasoning_done(r, sse, c->text.data + o.sp.r_start, rl);
    } else if (x->rs_state == 1) { /* streamed as reasoning, which the final split does not
                                    * keep (qwen3 without </think>): closed as streamed */
        reasoning_split ss;
        reasoning_split_stream((reasoning_kind)r->s->cfg.reasoning_parser, r->think_closed,
                               c->text.data, c->text.len, true, &ss);
        size_t rl = ss.r_end - ss.r_start < c->r_sent ? ss.r_end - ss.r_start : c->r_sent;
        reasoning_done(r, sse, c->text.data + ss.r_start, rl);
    }
    size_t done = c->sent > o.sp.c_start ? c->sent - o.sp.c_start : 0;
    if (o.calls && done > o.content_len) { /* a call's text went out as content: it stays so */
        json_decref(o.calls);
        o.calls = NULL;
        o.content_len = o.sp.c_end - o.sp.c_start;
    }
    if (o.content_len > done) text_delta(r, sse, o.content + done, o.content_len - done);
    if (x->msg_open || !o.calls) {
        open_message(r, sse);
        size_t n = o.content_len > done ? o.content_len : done;
        json_t *part = text_part(o.content, n);
        resp_event(r, sse, "response.output_text.done",
                   json_pack("{s:s,s:i,s:i,s:s%,s:[]}", "item_id", x->msg_id, "output_index",
                             x->msg_index, "content_index", 0, "text", o.content, n, "logprobs"));
        resp_event(r, sse, "response.content_part.done",
                   json_pack("{s:s,s:i,s:i,s:o}", "item_id", x->msg_id, "output_index",
                             x->msg_index, "content_index", 0, "part", part));
        json_t *item = message_item(x->msg_id, o.content, n, "completed");
        json_array_set(x->items, (size_t)x->msg_index, item);
        resp_event(r, sse, "response.output_item.done",
                   json_pack("{s:i,s:o}", "output_index", x->msg_index, "item", item));
    }
    for (size_t i = 0; o.calls && i < json_array_size(o.calls); i++) {
        json_t *item = call_item(r, json_array_get(o.calls, i), (int)i, "completed");
        int idx = (int)json_array_size(x->items);
        json_t *added = json_deep_copy(item);
        json_object_set_new(added, "status", json_string("in_progress"));
        json_object_set_new(added, "arguments", json_string(""));
        resp_event(r, sse, "response.output_item.added",
                   json_pack("{s:i,s:o}", "output_index", idx, "item", added));
        const char *iid = json_string_value(json_object_get(item, "id"));
        json_t *args = json_object_get(item, "arguments");
        resp_event(r, sse, "response.function_call_arguments.delta",
                   json_pack("{s:s,s:i,s:O}", "item_id", iid, "output_index", idx, "delta", args));
        resp_event(
            r, sse, "response.function_call_arguments.done",
            json_pack("{s:s,s:i,s:O}", "item_id", iid, "output_index", idx, "arguments", args));
        resp_event(r, sse, "response.output_item.done",
                   json_pack("{s:i,s:O}", "output_index", idx, "item", item));
        json_array_append_new(x->items, item);
    }
    json_decref(o.calls);
    c->sent = c->text.len;
    return 0;
}

static int resp_stream_end(gen_req *r, sbuf *sse) {
    resp_ext *x = r->ext;
    gen_choice *c = &r->ch[0];
    if (c->error) return 0; /* the error event went out */
    return resp_event(r, sse, "response.completed",
                      json_pack("{s:o}", "response",
                                resp_object(r, final_status(c), json_incref(x->items), true)));
}

/* An error after the stream started: the Responses "error" event. */
static int resp_stream_error(gen_req *r, const oai_error *e, sbuf *sse) {
    return resp_event(r, sse, "error",
                      json_pack("{s:s,s:s,s:o}", "code", e->type ? e->type : "api_error", "message",
                                e->message, "param",
                                e->param[0] ? json_string(e->param) : json_null()));
}

static const gen_ops RESP_OPS = {resp_stream_start, resp_stream_delta, resp_stream_finish,
                                 resp_build,        resp_stream_end,   NULL,
                                 resp_stream_error};

void server_responses_handle(server *s, hs_req *req) {
    gen_req *r = gen_req_new(s, req, true, &RESP_OPS);
    resp_ext *x = r ? calloc(1, sizeof *x) : NULL;
    if (x) x->items = json_array();
    if (!r || !x || !x->items) {
        if (x) resp_ext_free(x);
        if (r) gen_req_free(r);
        server_reply_errorf(req, 500, "InternalServerError", NULL, "out of memory");
        return;
    }
    r->ext = x;
    r->ext_free = resp_ext_free;
    /* "chatcmpl-X" → "resp_X" */
    const char *tail = strchr(r->id, '-');
    char id[sizeof r->id];
    snprintf(id, sizeof id, "resp_%s", tail ? tail + 1 : r->id);
    memcpy(r->id, id, sizeof r->id);
    snprintf(x->msg_id, sizeof x->msg_id, "msg_%s", r->id + 5);
    gen_prepare_and_start(r, resp_prepare);
}
