/*
 * messages — POST /v1/messages, Anthropic's Messages API as vLLM serves it.  The request
 * (system, messages with text / tool_use / tool_result content blocks, max_tokens,
 * stop_sequences, temperature, top_p, top_k, tools with input_schema, tool_choice
 * auto / any / tool / none, stream) is translated into a chat completions body, which
 * chat.c renders and tokenizes; the gen lifecycle runs it and this module renders the
 * Anthropic "message" (text and tool_use content blocks, stop_reason end_turn /
 * max_tokens / stop_sequence / tool_use, usage) or its stream: message_start,
 * content_block_start / content_block_delta (text_delta, input_json_delta) /
 * content_block_stop, message_delta, message_stop.
 */
#include "server/gen.h"
#include "server/reasoning.h"
#include "server/tool_parser.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct msg_ext {
    int block;       /* stream: blocks started so far */
    int think_state; /* stream: the thinking block 0 not started, 1 open, 2 closed */
    int think_index;
    bool text_open; /* stream: the text block is open (index text_index) */
    int text_index;
    const char *stop_reason; /* stream: for message_delta */
    json_t *stop_sequence;
} msg_ext;

static void msg_ext_free(void *p) {
    msg_ext *x = p;
    if (!x) return;
    json_decref(x->stop_sequence);
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

/* Text of a string or of a list of text blocks (other blocks: -1 naming it). */
static json_t *blocks_text(const json_t *c, const char *where, const char *param, oai_error *err) {
    if (json_is_string(c)) return json_incref((json_t *)c);
    if (!json_is_array(c)) {
        bad(err, param, "%s must be a string or a list of text blocks", where);
        return NULL;
    }
    json_t *out = json_string("");
    for (size_t i = 0; i < json_array_size(c); i++) {
        const json_t *b = json_array_get(c, i);
        const char *ty = json_string_value(json_object_get(b, "type"));
        const json_t *t = json_object_get(b, "text");
        if (!ty || strcmp(ty, "text") || !json_is_string(t)) {
            json_decref(out);
            bad(err, param, "%s: block %zu is of type '%s'; accepted here: text", where, i,
                ty ? ty : "?");
            return NULL;
        }
        size_t a = json_string_length(out), n = json_string_length(t);
        char *buf = malloc(a + n + 1);
        if (!buf) {
            json_decref(out);
            return NULL;
        }
        memcpy(buf, json_string_value(out), a);
        memcpy(buf + a, json_string_value(t), n);
        json_decref(out);
        out = json_stringn(buf, a + n);
        free(buf);
    }
    return out;
}

/* One Anthropic message → chat messages appended to msgs. */
static int message_to_chat(const json_t *m, size_t idx, json_t *msgs, oai_error *err) {
    char where[64];
    snprintf(where, sizeof where, "messages[%zu]", idx);
    const char *role = json_string_value(json_object_get(m, "role"));
    const json_t *content = json_object_get(m, "content");
    if (!json_is_object(m) || !role || (strcmp(role, "user") && strcmp(role, "assistant")))
        return bad(err, "messages",
                   "%s must be {\"role\": \"user\" | \"assistant\", \"content\": ...}", where);
    if (json_is_string(content)) {
        json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", role, "content", content));
        return 0;
    }
    if (!json_is_array(content))
        return bad(err, "messages", "%s: 'content' must be a string or a list of content blocks",
                   where);
    json_t *text = json_string("");
    json_t *calls = json_array();
    bool is_user = !strcmp(role, "user");
    bool has_text = false;
    for (size_t i = 0; i < json_array_size(content); i++) {
        const json_t *b = json_array_get(content, i);
        const char *ty = json_string_value(json_object_get(b, "type"));
        if (ty && !strcmp(ty, "text") && json_is_string(json_object_get(b, "text"))) {
            json_t *one = json_pack("[O]", b);
            json_t *t = blocks_text(one, where, "messages", err);
            json_decref(one);
            if (!t) goto fail;
            char *joined = NULL;
            if (asprintf(&joined, "%s%s", json_string_value(text), json_string_value(t)) < 0)
                joined = NULL;
            json_decref(t);
            if (!joined) goto fail;
            json_decref(text);
            text = json_string(joined);
            free(joined);
            has_text = true;
        } else if (ty && !strcmp(ty, "tool_use") && !is_user) {
            const json_t *id = json_object_get(b, "id"), *name = json_object_get(b, "name");
            const json_t *input = json_object_get(b, "input");
            if (!json_is_string(id) || !json_is_string(name)) {
                bad(err, "messages", "%s: a tool_use block needs string 'id' and 'name'", where);
                goto fail;
            }
            char *args = input ? json_dumps(input, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
            json_array_append_new(calls, json_pack("{s:O,s:s,s:{s:O,s:s}}", "id", id, "type",
                                                   "function", "function", "name", name,
                                                   "arguments", args ? args : "{}"));
            free(args);
        } else if (ty && !strcmp(ty, "tool_result") && is_user) {
            const json_t *id = json_object_get(b, "tool_use_id");
            if (!json_is_string(id)) {
                bad(err, "messages", "%s: a tool_result block needs a string 'tool_use_id'", where);
                goto fail;
            }
            const json_t *c = json_object_get(b, "content");
            json_t *t = c ? blocks_text(c, where, "messages", err) : json_string("");
            if (!t) goto fail;
            json_array_append_new(
                msgs, json_pack("{s:s,s:O,s:o}", "role", "tool", "tool_call_id", id, "content", t));
        } else if (ty && (!strcmp(ty, "thinking") || !strcmp(ty, "redacted_thinking")) &&
                   !is_user) {
            continue; /* earlier reasoning is not rendered again */
        } else {
            bad(err, "messages",
                "%s: block %zu is of type '%s'; accepted: text, tool_use (assistant), tool_result "
                "(user) — images and documents are not supported",
                where, i, ty ? ty : "?");
            goto fail;
        }
    }
    if (json_array_size(calls) > 0) {
        json_array_append_new(msgs, json_pack("{s:s,s:O,s:O}", "role", "assistant", "content", text,
                                              "tool_calls", calls));
    } else if (has_text || !is_user) {
        json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", role, "content", text));
    }
    json_decref(text);
    json_decref(calls);
    return 0;
fail:
    json_decref(text);
    json_decref(calls);
    return -1;
}

static json_t *to_chat(const json_t *in, oai_error *err) {
    json_t *chat = json_object();
    json_t *msgs = json_array();
    json_object_set_new(chat, "messages", msgs);
    /* kv_transfer_params: disagg proxy's P/D fields (vLLM's extension, as in chat) */
    static const char *const pass[] = {"model", "temperature", "top_p",
                                       "top_k", "stream",      "kv_transfer_params"};
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)in, k, v) {
        bool known = false;
        for (size_t i = 0; i < sizeof pass / sizeof *pass; i++)
            if (!strcmp(k, pass[i])) {
                json_object_set(chat, k, v);
                known = true;
            }
        if (known || json_is_null(v) || !strcmp(k, "messages") || !strcmp(k, "system") ||
            !strcmp(k, "max_tokens") || !strcmp(k, "stop_sequences") || !strcmp(k, "tools") ||
            !strcmp(k, "tool_choice") || !strcmp(k, "metadata") || !strcmp(k, "service_tier"))
            continue;
        bad(err, k,
            "'%s' is not supported by /v1/messages; accepted: model, messages, max_tokens, system, "
            "stop_sequences, temperature, top_p, top_k, tools, tool_choice, stream, metadata",
            k);
        goto fail;
    }
    const json_t *sys = json_object_get(in, "system");
    if (sys && !json_is_null(sys)) {
        json_t *t = blocks_text(sys, "'system'", "system", err);
        if (!t) goto fail;
        json_array_append_new(msgs, json_pack("{s:s,s:o}", "role", "system", "content", t));
    }
    const json_t *m = json_object_get(in, "messages");
    if (!json_is_array(m) || json_array_size(m) == 0) {
        bad(err, "messages", "'messages' is required: a non-empty list of messages");
        goto fail;
    }
    for (size_t i = 0; i < json_array_size(m); i++)
        if (message_to_chat(json_array_get(m, i), i, msgs, err)) goto fail;
    const json_t *mt = json_object_get(in, "max_tokens");
    if (!json_is_integer(mt) || json_integer_value(mt) < 1) {
        bad(err, "max_tokens", "'max_tokens' is required: a positive integer");
        goto fail;
    }
    json_object_set(chat, "max_tokens", (json_t *)mt);
    const json_t *ss = json_object_get(in, "stop_sequences");
    if (ss && !json_is_null(ss)) {
        if (!json_is_array(ss)) {
            bad(err, "stop_sequences", "'stop_sequences' must be a list of strings");
            goto fail;
        }
        json_object_set(chat, "stop", (json_t *)ss);
    }
    const json_t *tools = json_object_get(in, "tools");
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools)) {
            bad(err, "tools", "'tools' must be a list of {\"name\", \"input_schema\"} tools");
            goto fail;
        }
        json_t *out = json_array();
        json_object_set_new(chat, "tools", out);
        for (size_t i = 0; i < json_array_size(tools); i++) {
            const json_t *t = json_array_get(tools, i);
            const json_t *name = json_object_get(t, "name");
            const char *ty = json_string_value(json_object_get(t, "type"));
            if (!json_is_string(name) || (ty && strcmp(ty, "custom"))) {
                bad(err, "tools",
                    "'tools' element %zu must be {\"name\": ..., \"input_schema\": "
                    "...} (server tools are not supported)",
                    i);
                goto fail;
            }
            json_t *f = json_pack("{s:O}", "name", name);
            const json_t *d = json_object_get(t, "description");
            const json_t *sc = json_object_get(t, "input_schema");
            if (json_is_string(d)) json_object_set(f, "description", (json_t *)d);
            if (sc && !json_is_null(sc)) json_object_set(f, "parameters", (json_t *)sc);
            json_array_append_new(out, json_pack("{s:s,s:o}", "type", "function", "function", f));
        }
    }
    const json_t *tc = json_object_get(in, "tool_choice");
    if (tc && !json_is_null(tc)) {
        const char *ty = json_string_value(json_object_get(tc, "type"));
        if (ty && !strcmp(ty, "auto"))
            json_object_set_new(chat, "tool_choice", json_string("auto"));
        else if (ty && !strcmp(ty, "none"))
            json_object_set_new(chat, "tool_choice", json_string("none"));
        else if (ty && !strcmp(ty, "any"))
            json_object_set_new(chat, "tool_choice", json_string("required"));
        else if (ty && !strcmp(ty, "tool") && json_is_string(json_object_get(tc, "name")))
            json_object_set_new(chat, "tool_choice",
                                json_pack("{s:s,s:{s:O}}", "type", "function", "function", "name",
                                          json_object_get(tc, "name")));
        else {
            bad(err, "tool_choice",
                "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} "
                "or {\"type\": \"tool\", \"name\": ...}");
            goto fail;
        }
    }
    return chat;
fail:
    json_decref(chat);
    return NULL;
}

static int msg_prepare(server *s, gen_req *r, const char *body, size_t len) {
    json_t *in = server_body_object(r, body, len);
    if (!in) return -1;
    json_t *chat = to_chat(in, &r->err);
    json_decref(in);
    if (!chat) return -1;
    int rc = server_chat_prepare_json(s, r, chat);
    if (rc && !strcmp(r->err.param, "stop"))
        snprintf(r->err.param, sizeof r->err.param, "stop_sequences");
    return rc;
}

/* ---- rendering ------------------------------------------------------------------ */

typedef struct msg_split {
    const char *content;
    size_t content_len;
    json_t *calls; /* or NULL */
} msg_split;

static void msg_split_final(gen_req *r, gen_choice *c, size_t sent, msg_split *o) {
    const char *all = c->text.data ? c->text.data : "";
    reasoning_split sp;
    reasoning_split_final((reasoning_kind)r->s->cfg.reasoning_parser, all, c->text.len, &sp);
    o->content = all + sp.c_start;
    o->content_len = sp.c_end - sp.c_start;
    o->calls = NULL;
    size_t cl = 0;
    int n = r->o.parse_tool_calls ? tool_parser_stream_calls(r->s->tools, o->content,
                                                             o->content_len, sent, &o->calls, &cl)
                                  : 0;
    if (n > 0) {
        o->content_len = cl;
    } else {
        json_decref(o->calls);
        o->calls = NULL;
    }
}

static json_t *tool_use_block(const json_t *call) {
    const json_t *f = json_object_get(call, "function");
    json_t *input =
        json_loads(json_string_value(json_object_get(f, "arguments")), JSON_DECODE_ANY, NULL);
    if (!json_is_object(input)) {
        json_decref(input);
        input = json_object();
    }
    return json_pack("{s:s,s:O,s:O,s:o}", "type", "tool_use", "id", json_object_get(call, "id"),
                     "name", json_object_get(f, "name"), "input", input);
}

static const char *stop_reason(gen_choice *c, bool calls) {
    if (calls && strcmp(c->finish_reason, "length")) return "tool_use";
    if (!strcmp(c->finish_reason, "length")) return "max_tokens";
    if (json_is_string(c->stop_reason)) return "stop_sequence";
    return "end_turn";
}

static json_t *msg_build(gen_req *r) {
    gen_choice *c = &r->ch[0];
    msg_split o;
    msg_split_final(r, c, 0, &o);
    json_t *content = json_array();
    reasoning_split sp;
    reasoning_split_final((reasoning_kind)r->s->cfg.reasoning_parser,
                          c->text.data ? c->text.data : "", c->text.len, &sp);
    if (sp.has_reasoning) /* --reasoning-parser: a thinking block first */
        json_array_append_new(content, json_pack("{s:s,s:s%,s:s}", "type", "thinking", "thinking",
                                                 c->text.data + sp.r_start, sp.r_end - sp.r_start,
                                                 "signature", ""));
    if (o.content_len > 0 || !o.calls)
        json_array_append_new(
            content, json_pack("{s:s,s:s%}", "type", "text", "text", o.content, o.content_len));
    for (size_t i = 0; o.calls && i < json_array_size(o.calls); i++)
        json_array_append_new(content, tool_use_block(json_array_get(o.calls, i)));
    oai_usage u;
    gen_usage(r, &u);
    json_t *m =
        json_pack("{s:s,s:s,s:s,s:s,s:o,s:s,s:o,s:{s:i,s:i}}", "id", r->id, "type", "message",
                  "role", "assistant", "model", r->s->model_name, "content", content, "stop_reason",
                  stop_reason(c, o.calls != NULL), "stop_sequence",
                  json_is_string(c->stop_reason) ? json_incref(c->stop_reason) : json_null(),
                  "usage", "input_tokens", u.prompt_tokens, "output_tokens", u.completion_tokens);
    json_decref(o.calls);
    return m;
}

/* ---- streaming ---------------------------------------------------------------------- */

static int msg_event(sbuf *sse, const char *type, json_t *fields) {
    json_t *e = json_pack("{s:s}", "type", type);
    json_object_update(e, fields);
    json_decref(fields);
    char *t = json_dumps(e, JSON_COMPACT);
    json_decref(e);
    if (!t) return -1;
    int rc = sbuf_appendf(sse, "event: %s\ndata: %s\n\n", type, t);
    free(t);
    return rc;
}

static int msg_stream_start(gen_req *r, sbuf *sse) {
    return msg_event(sse, "message_start",
                     json_pack("{s:{s:s,s:s,s:s,s:s,s:[],s:n,s:n,s:{s:i,s:i}}}", "message", "id",
                               r->id, "type", "message", "role", "assistant", "model",
                               r->s->model_name, "content", "stop_reason", "stop_sequence", "usage",
                               "input_tokens", r->n_pids[0], "output_tokens", 0));
}

static void thinking_delta(gen_req *r, sbuf *sse, const char *t, size_t n) {
    msg_ext *x = r->ext;
    if (x->think_state == 0) {
        x->think_state = 1;
        x->think_index = x->block++;
        msg_event(sse, "content_block_start",
                  json_pack("{s:i,s:{s:s,s:s,s:s}}", "index", x->think_index, "content_block",
                            "type", "thinking", "thinking", "", "signature", ""));
    }
    if (n > 0)
        msg_event(sse, "content_block_delta",
                  json_pack("{s:i,s:{s:s,s:s%}}", "index", x->think_index, "delta", "type",
                            "thinking_delta", "thinking", t, n));
}

static void thinking_stop(gen_req *r, sbuf *sse) {
    msg_ext *x = r->ext;
    if (x->think_state != 1) return;
    x->think_state = 2;
    msg_event(sse, "content_block_stop", json_pack("{s:i}", "index", x->think_index));
}

static void text_delta(gen_req *r, sbuf *sse, const char *t, size_t n) {
    msg_ext *x = r->ext;
    if (n == 0) return;
    thinking_stop(r, sse);
    if (!x->text_open) {
        x->text_open = true;
        x->text_index = x->block++;
        msg_event(sse, "content_block_start",
                  json_pack("{s:i,s:{s:s,s:s}}", "index", x->text_index, "content_block", "type",
                            "text", "text", ""));
    }
    msg_event(sse, "content_block_delta",
              json_pack("{s:i,s:{s:s,s:s%}}", "index", x->text_index, "delta", "type", "text_delta",
                        "text", t, n));
}

static int msg_stream_delta(gen_req *r, gen_choice *c, const char *text, size_t len, sbuf *sse) {
    (void)text;
    (void)len;
    reasoning_split sp;
    reasoning_split_stream((reasoning_kind)r->s->cfg.reasoning_parser, r->think_closed,
                           c->text.data ? c->text.data : "", c->text.len, false, &sp);
    msg_ext *x = r->ext;
    if (sp.has_reasoning && x->think_state < 2 && sp.r_end - sp.r_start > c->r_sent) {
        thinking_delta(r, sse, c->text.data + sp.r_start + c->r_sent,
                       sp.r_end - sp.r_start - c->r_sent);
        c->r_sent = sp.r_end - sp.r_start;
    }
    if (c->sent < sp.c_start) c->sent = sp.c_start;
    size_t end = sp.c_end;
    if (r->o.parse_tool_calls)
        end =
            sp.c_start + r->s->tools->safe_prefix(c->text.data + sp.c_start, sp.c_end - sp.c_start);
    if (end > c->sent) {
        text_delta(r, sse, c->text.data + c->sent, end - c->sent);
        c->sent = end;
    }
    return 0;
}

static int msg_stream_finish(gen_req *r, gen_choice *c, sbuf *sse) {
    msg_ext *x = r->ext;
    reasoning_split sp;
    reasoning_split_final((reasoning_kind)r->s->cfg.reasoning_parser,
                          c->text.data ? c->text.data : "", c->text.len, &sp);
    if (sp.has_reasoning && x->think_state < 2) {
        size_t rl = sp.r_end - sp.r_start;
        if (rl > c->r_sent || x->think_state == 0)
            thinking_delta(r, sse, c->text.data + sp.r_start + c->r_sent,
                           rl > c->r_sent ? rl - c->r_sent : 0);
    }
    thinking_stop(r, sse);
    size_t done = c->sent > sp.c_start ? c->sent - sp.c_start : 0;
    msg_split o;
    msg_split_final(r, c, done, &o);
    if (o.content_len > done) text_delta(r, sse, o.content + done, o.content_len - done);
    if (x->text_open)
        msg_event(sse, "content_block_stop", json_pack("{s:i}", "index", x->text_index));
    for (size_t i = 0; o.calls && i < json_array_size(o.calls); i++) {
        json_t *b = tool_use_block(json_array_get(o.calls, i));
        json_t *input = json_incref(json_object_get(b, "input"));
        json_object_set_new(b, "input", json_object());
        int idx = x->block++;
        msg_event(sse, "content_block_start",
                  json_pack("{s:i,s:o}", "index", idx, "content_block", b));
        char *args = json_dumps(input, JSON_COMPACT);
        json_decref(input);
        msg_event(sse, "content_block_delta",
                  json_pack("{s:i,s:{s:s,s:s}}", "index", idx, "delta", "type", "input_json_delta",
                            "partial_json", args ? args : "{}"));
        free(args);
        msg_event(sse, "content_block_stop", json_pack("{s:i}", "index", idx));
    }
    x->stop_reason = stop_reason(c, o.calls != NULL);
    x->stop_sequence = json_is_string(c->stop_reason) ? json_incref(c->stop_reason) : NULL;
    json_decref(o.calls);
    c->sent = c->text.len;
    return 0;
}

static int msg_stream_end(gen_req *r, sbuf *sse) {
    msg_ext *x = r->ext;
    gen_choice *c = &r->ch[0];
    if (c->error) return 0;
    msg_event(sse, "message_delta",
              json_pack("{s:{s:s,s:O*},s:{s:i}}", "delta", "stop_reason",
                        x->stop_reason ? x->stop_reason : "end_turn", "stop_sequence",
                        x->stop_sequence ? x->stop_sequence : json_null(), "usage", "output_tokens",
                        c->n_tokens));
    return msg_event(sse, "message_stop", json_object());
}

/* Anthropic's error body: {"type": "error", "error": {"type", "message"}}. */
static json_t *msg_error_body(gen_req *r, const oai_error *e) {
    (void)r;
    int st = e->status;
    const char *type = st == 400   ? "invalid_request_error"
                       : st == 401 ? "authentication_error"
                       : st == 403 ? "permission_error"
                       : st == 404 ? "not_found_error"
                       : st == 413 ? "request_too_large"
                       : st == 429 ? "rate_limit_error"
                       : st == 503 ? "overloaded_error"
                                   : "api_error";
    return json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "type", type, "message",
                     e->message);
}

static int msg_stream_error(gen_req *r, const oai_error *e, sbuf *sse) {
    json_t *b = msg_error_body(r, e);
    char *t = b ? json_dumps(b, JSON_COMPACT) : NULL;
    json_decref(b);
    if (!t) return -1;
    int rc = sbuf_appendf(sse, "event: error\ndata: %s\n\n", t);
    free(t);
    return rc;
}

static const gen_ops MSG_OPS = {msg_stream_start, msg_stream_delta, msg_stream_finish, msg_build,
                                msg_stream_end,   msg_error_body,   msg_stream_error};

void server_messages_handle(server *s, hs_req *req) {
    gen_req *r = gen_req_new(s, req, true, &MSG_OPS);
    msg_ext *x = r ? calloc(1, sizeof *x) : NULL;
    if (!r || !x) {
        free(x);
        if (r) gen_req_free(r);
        server_reply_errorf(req, 500, "InternalServerError", NULL, "out of memory");
        return;
    }
    r->ext = x;
    r->ext_free = msg_ext_free;
    const char *tail = strchr(r->id, '-');
    char id[sizeof r->id];
    snprintf(id, sizeof id, "msg_%s", tail ? tail + 1 : r->id);
    memcpy(r->id, id, sizeof r->id);
    gen_prepare_and_start(r, msg_prepare);
}
