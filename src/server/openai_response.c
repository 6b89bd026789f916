/*
 * openai_response — JSON bodies, SSE chunks, usage and logprobs (see
 * openai_response.h).
 */
#include "server/openai_response.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static json_t *nullable(json_t *x) {
    return x ? x : json_null();
}

json_t *oai_usage_json(const oai_usage *u) {
    json_t *o = json_object();
    json_object_set_new(o, "prompt_tokens", json_integer(u->prompt_tokens));
    json_object_set_new(o, "total_tokens", json_integer(u->prompt_tokens + u->completion_tokens));
    json_object_set_new(o, "completion_tokens", json_integer(u->completion_tokens));
    json_object_set_new(
        o, "prompt_tokens_details",
        u->cached_tokens < 0 ? json_null() : json_pack("{s:i}", "cached_tokens", u->cached_tokens));
    if (u->kv_transfer) { /* an extension field: OpenAI and vLLM clients ignore it */
        json_t *kv = json_pack("{s:i,s:i}", "received_prompt_tokens", u->received_tokens,
                               "computed_prompt_tokens", u->computed_tokens);
        if (kv && u->kv_pulled) /* the pull streamed layer by layer (docs/connector.md) */
            json_object_set_new(kv, "layerwise", json_boolean(u->kv_layerwise));
        json_object_set_new(o, "kv_transfer", kv);
    }
    return o;
}

double oai_logprob_value(float lp) {
    if (isnan(lp) || lp < -9999.0f) return -9999.0;
    return (double)lp;
}

/* Token string through the namer; NULL on failure. */
static json_t *token_string(const oai_namer *nm, int32_t id, sbuf *tmp) {
    sbuf_reset(tmp);
    if (nm->fn(nm->ctx, id, tmp)) return NULL;
    return json_stringn(tmp->data ? tmp->data : "", tmp->len);
}

static size_t utf8_chars(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) c++;
    return c;
}

json_t *oai_cmpl_logprobs_new(void) {
    return json_pack("{s:[],s:[],s:[],s:[]}", "text_offset", "token_logprobs", "tokens",
                     "top_logprobs");
}

int oai_cmpl_logprobs_add(json_t *lp, const engine_token *t, int n_top, bool no_logprob,
                          size_t *offset, const oai_namer *nm) {
    sbuf tmp;
    sbuf_init(&tmp, 1 << 20);
    int rc = -ENOMEM;
    json_t *tok = token_string(nm, t->id, &tmp);
    if (!tok) goto out;
    size_t tok_chars = utf8_chars(tmp.data ? tmp.data : "", tmp.len);
    json_array_append_new(json_object_get(lp, "text_offset"), json_integer((json_int_t)*offset));
    *offset += tok_chars;
    json_array_append_new(json_object_get(lp, "token_logprobs"),
                          no_logprob ? json_null() : json_real(oai_logprob_value(t->logprob)));
    json_array_append_new(json_object_get(lp, "tokens"), tok);
    json_t *top = json_null();
    if (!no_logprob) {
        top = json_object();
        int n = n_top < t->n_top ? n_top : t->n_top;
        for (int i = 0; i < n; i++) {
            json_t *s = token_string(nm, t->top_ids[i], &tmp);
            if (!s) {
                json_decref(top);
                goto out;
            }
            json_object_set_new(top, json_string_value(s),
                                json_real(oai_logprob_value(t->top_logprobs[i])));
            json_decref(s);
        }
        /* vLLM adds the sampled token when it is not among the top n */
        json_t *s = token_string(nm, t->id, &tmp);
        if (!s) {
            json_decref(top);
            goto out;
        }
        if (!json_object_get(top, json_string_value(s)))
            json_object_set_new(top, json_string_value(s),
                                json_real(oai_logprob_value(t->logprob)));
        json_decref(s);
    }
    json_array_append_new(json_object_get(lp, "top_logprobs"), top);
    rc = 0;
out:
    sbuf_free(&tmp);
    return rc;
}

json_t *oai_chat_logprobs_new(void) {
    return json_pack("{s:[]}", "content");
}

static json_t *bytes_array(const char *s, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(a, json_integer((unsigned char)s[i]));
    return a;
}

/* {"token","logprob","bytes"} */
static json_t *chat_entry(const oai_namer *nm, int32_t id, float logprob, sbuf *tmp) {
    json_t *s = token_string(nm, id, tmp);
    if (!s) return NULL;
    json_t *e = json_object();
    json_object_set_new(e, "token", s);
    json_object_set_new(e, "logprob", json_real(oai_logprob_value(logprob)));
    json_object_set_new(e, "bytes", bytes_array(tmp->data ? tmp->data : "", tmp->len));
    return e;
}

int oai_chat_logprobs_add(json_t *lp, const engine_token *t, int n_top, const oai_namer *nm) {
    sbuf tmp;
    sbuf_init(&tmp, 1 << 20);
    json_t *e = chat_entry(nm, t->id, t->logprob, &tmp);
    if (!e) {
        sbuf_free(&tmp);
        return -ENOMEM;
    }
    json_t *tops = json_array();
    int n = n_top < t->n_top ? n_top : t->n_top;
    for (int i = 0; i < n; i++) {
        json_t *x = chat_entry(nm, t->top_ids[i], t->top_logprobs[i], &tmp);
        if (!x) {
            json_decref(tops);
            json_decref(e);
            sbuf_free(&tmp);
            return -ENOMEM;
        }
        json_array_append_new(tops, x);
    }
    json_object_set_new(e, "top_logprobs", tops);
    json_array_append_new(json_object_get(lp, "content"), e);
    sbuf_free(&tmp);
    return 0;
}

static json_t *prompt_lp_entry(const oai_namer *nm, int32_t id, float lp, json_t *rank, sbuf *tmp) {
    json_t *s = token_string(nm, id, tmp);
    if (!s) {
        json_decref(rank);
        return NULL;
    }
    return json_pack("{s:f,s:o,s:o}", "logprob", oai_logprob_value(lp), "rank", nullable(rank),
                     "decoded_token", s);
}

json_t *oai_prompt_logprobs_json(const engine_token *pl, int n, int n_top, const oai_namer *nm) {
    sbuf tmp;
    sbuf_init(&tmp, 1 << 20);
    json_t *a = json_array();
    for (int i = 0; i < n; i++) {
        if (i == 0) {
            json_array_append_new(a, json_null());
            continue;
        }
        const engine_token *t = &pl[i];
        json_t *o = json_object();
        char key[16];
        int found = -1;
        for (int k = 0; k < t->n_top; k++)
            if (t->top_ids[k] == t->id) found = k;
        snprintf(key, sizeof key, "%d", t->id);
        json_t *e = prompt_lp_entry(nm, t->id, t->logprob,
                                    found >= 0 ? json_integer(found + 1) : NULL, &tmp);
        if (!e) goto fail;
        json_object_set_new(o, key, e);
        int m = n_top < t->n_top ? n_top : t->n_top;
        for (int k = 0; k < m; k++) {
            snprintf(key, sizeof key, "%d", t->top_ids[k]);
            if (json_object_get(o, key)) continue;
            e = prompt_lp_entry(nm, t->top_ids[k], t->top_logprobs[k], json_integer(k + 1), &tmp);
            if (!e) goto fail;
            json_object_set_new(o, key, e);
        }
        json_array_append_new(a, o);
        continue;
    fail:
        json_decref(o);
        json_decref(a);
        sbuf_free(&tmp);
        return NULL;
    }
    sbuf_free(&tmp);
    return a;
}

/* The keys every choice has, in vLLM's order: index, then key (the text, message or delta,
 * taken), logprobs, finish_reason and stop_reason (NULL: null). */
static json_t *choice_new(int index, const char *key, json_t *value, json_t *logprobs,
                          const char *finish_reason, json_t *stop_reason) {
    json_t *c = json_object();
    json_object_set_new(c, "index", json_integer(index));
    json_object_set_new(c, key, value);
    json_object_set_new(c, "logprobs", nullable(logprobs));
    json_object_set_new(c, "finish_reason",
                        finish_reason ? json_string(finish_reason) : json_null());
    json_object_set_new(c, "stop_reason", nullable(stop_reason));
    return c;
}

json_t *oai_completion_choice(int index, const char *text, size_t len, json_t *logprobs,
                              const char *finish_reason, json_t *stop_reason,
                              json_t *prompt_logprobs) {
    json_t *c = choice_new(index, "text", json_stringn(text ? text : "", text ? len : 0), logprobs,
                           finish_reason, stop_reason);
    json_object_set_new(c, "prompt_logprobs", nullable(prompt_logprobs));
    return c;
}

json_t *oai_chat_choice(int index, const char *content, size_t len, bool content_null,
                        json_t *tool_calls, json_t *logprobs, const char *finish_reason,
                        json_t *stop_reason) {
    json_t *msg = json_object();
    json_object_set_new(msg, "role", json_string("assistant"));
    json_object_set_new(msg, "content",
                        content_null ? json_null()
                                     : json_stringn(content ? content : "", content ? len : 0));
    json_object_set_new(msg, "tool_calls", tool_calls ? tool_calls : json_array());
    return choice_new(index, "message", msg, logprobs, finish_reason, stop_reason);
}

static json_t *envelope(const char *object, const char *id, long long created, const char *model) {
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(id));
    json_object_set_new(o, "object", json_string(object));
    json_object_set_new(o, "created", json_integer(created));
    json_object_set_new(o, "model", json_string(model));
    return o;
}

json_t *oai_response(bool chat, const char *id, long long created, const char *model,
                     json_t *choices, const oai_usage *usage) {
    json_t *o = envelope(chat ? "chat.completion" : "text_completion", id, created, model);
    json_object_set_new(o, "choices", choices);
    json_object_set_new(o, "usage", oai_usage_json(usage));
    json_object_set_new(o, "system_fingerprint", json_null());
    json_object_set_new(o, "kv_transfer_params", json_null());
    return o;
}

static void set_usage(json_t *o, const oai_usage *usage, bool usage_null) {
    if (usage)
        json_object_set_new(o, "usage", oai_usage_json(usage));
    else if (usage_null)
        json_object_set_new(o, "usage", json_null());
}

json_t *oai_completion_chunk(const char *id, long long created, const char *model, int index,
                             const char *text, size_t len, json_t *logprobs,
                             const char *finish_reason, json_t *stop_reason, const oai_usage *usage,
                             bool usage_null) {
    json_t *o = envelope("text_completion", id, created, model);
    json_t *c = choice_new(index, "text", json_stringn(text ? text : "", text ? len : 0), logprobs,
                           finish_reason, stop_reason);
    json_object_set_new(o, "choices", json_pack("[o]", c));
    set_usage(o, usage, usage_null);
    return o;
}

json_t *oai_chat_chunk(const char *id, long long created, const char *model, int index,
                       json_t *delta, json_t *logprobs, const char *finish_reason,
                       json_t *stop_reason, const oai_usage *usage, bool usage_null) {
    json_t *o = envelope("chat.completion.chunk", id, created, model);
    json_t *c = choice_new(index, "delta", delta ? delta : json_object(), logprobs, finish_reason,
                           stop_reason);
    json_object_set_new(o, "choices", json_pack("[o]", c));
    set_usage(o, usage, usage_null);
    return o;
}

json_t *oai_usage_chunk(bool chat, const char *id, long long created, const char *model,
                        const oai_usage *usage) {
    json_t *o = envelope(chat ? "chat.completion.chunk" : "text_completion", id, created, model);
    json_object_set_new(o, "choices", json_array());
    json_object_set_new(o, "usage", oai_usage_json(usage));
    return o;
}

int oai_sse_event(sbuf *out, json_t *x) {
    if (!x) return -ENOMEM;
    char *s = json_dumps(x, JSON_COMPACT);
    json_decref(x);
    if (!s) return -ENOMEM;
    int rc = sbuf_append(out, "data: ", 6);
    if (!rc) rc = sbuf_append(out, s, strlen(s));
    if (!rc) rc = sbuf_append(out, "\n\n", 2);
    free(s);
    return rc;
}

int oai_sse_done(sbuf *out) {
    return sbuf_append(out, "data: [DONE]\n\n", 14);
}
