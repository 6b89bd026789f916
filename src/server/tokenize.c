/*
 * tokenize — POST /tokenize and POST /detokenize as vLLM serves them
 * (vllm/entrypoints/openai/serving_tokenization.py):
 *   /tokenize {"prompt": text, "add_special_tokens": true, "return_token_strs": false}
 *          or {"messages": [...], "tools": [...], "add_generation_prompt": true,
 *              "add_special_tokens": false, "return_token_strs": false}
 *     → {"count": N, "max_model_len": M, "tokens": [...], "token_strs": null | [...]}
 *   /detokenize {"tokens": [ids]} → {"prompt": text}
 * token_strs are the vocabulary strings ("Ġhello", "▁hello", "<0x0A>"), as
 * convert_ids_to_tokens gives them.
 */
#include "server/gen.h"

#include <stdlib.h>
#include <string.h>

static json_t *token_str(const tokenizer *tok, int32_t id) {
    size_t n = 0;
    const char *str = tokenizer_token_str(tok, id, &n);
    return str ? json_stringn(str, n) : json_null();
}

static json_t *parse_body(server *s, const char *body, size_t len, oai_error *err) {
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    if (!root) {
        oai_error_set(err, 400, "BadRequestError", NULL,
                      "Invalid JSON body: %s at line %d column %d", je.text, je.line, je.column);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        oai_error_set(err, 400, "BadRequestError", NULL, "The request body must be a JSON object");
        return NULL;
    }
    json_t *m = json_object_get(root, "model");
    if (m && !json_is_null(m) &&
        (!json_is_string(m) || strlen(json_string_value(m)) != json_string_length(m) ||
         !oai_model_name_ok(&s->defaults, json_string_value(m)))) {
        char names[512];
        oai_model_names_list(&s->defaults, names, sizeof names);
        oai_error_set(err, 404, "NotFoundError", "model",
                      "The model `%s` does not exist. Accepted: %s",
                      json_is_string(m) ? json_string_value(m) : "(not a string)", names);
        json_decref(root);
        return NULL;
    }
    return root;
}

static int get_flag(json_t *o, const char *key, bool def, bool *out, oai_error *err) {
    json_t *v = json_object_get(o, key);
    *out = def;
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) {
        oai_error_set(err, 400, "BadRequestError", key, "'%s' must be a boolean (true or false)",
                      key);
        return -1;
    }
    *out = json_is_true(v);
    return 0;
}

/* The /tokenize answer for body: 0 and *resp, or -1 and *err (on the loop or
 * the preparation thread). */
static int tokenize_run(server *s, const char *body, size_t len, json_t **resp,
                        oai_error *err_out) {
    oai_error err;
    json_t *root = parse_body(s, body, len, &err);
    if (!root) {
        *err_out = err;
        return -1;
    }
    json_t *prompt = json_object_get(root, "prompt");
    json_t *messages = json_object_get(root, "messages");
    int32_t *ids = NULL;
    size_t n = 0;
    bool strs = false, add_special, add_gen;
    if (get_flag(root, "return_token_strs", false, &strs, &err)) goto fail;
    if (messages && !json_is_null(messages)) {
        if (!json_is_array(messages) || json_array_size(messages) == 0) {
            oai_error_set(&err, 400, "BadRequestError", "messages",
                          "'messages' must be a non-empty list of messages");
            goto fail;
        }
        json_t *tools = json_object_get(root, "tools");
        if (tools && !json_is_null(tools) && !json_is_array(tools)) {
            oai_error_set(&err, 400, "BadRequestError", "tools", "'tools' must be a list of tools");
            goto fail;
        }
        if (get_flag(root, "add_generation_prompt", true, &add_gen, &err) ||
            get_flag(root, "add_special_tokens", false, &add_special, &err))
            goto fail;
        json_t *kw = json_object_get(root, "chat_template_kwargs");
        if (kw && !json_is_null(kw) && !json_is_object(kw)) {
            oai_error_set(&err, 400, "BadRequestError", "chat_template_kwargs",
                          "'chat_template_kwargs' must be an object of template variables");
            goto fail;
        }
        if (server_chat_render_ids(s, messages, json_is_array(tools) ? tools : NULL,
                                   json_is_object(kw) ? kw : NULL, add_gen, add_special, &ids, &n,
                                   &err))
            goto fail;
    } else if (json_is_string(prompt)) {
        char msg[512] = "";
        if (get_flag(root, "add_special_tokens", true, &add_special, &err)) goto fail;
        if (tokenizer_encode(s->tok, json_string_value(prompt), json_string_length(prompt),
                             add_special, &ids, &n, msg, sizeof msg)) {
            oai_error_set(&err, 400, "BadRequestError", "prompt", "%s", msg);
            goto fail;
        }
    } else {
        oai_error_set(
            &err, 400, "BadRequestError", prompt ? "prompt" : NULL,
            "/tokenize needs 'prompt' (a string) or 'messages' (a list of chat messages)");
        goto fail;
    }
    json_t *toks = json_array(), *ts = strs ? json_array() : json_null();
    for (size_t i = 0; i < n; i++) {
        json_array_append_new(toks, json_integer(ids[i]));
        if (strs) json_array_append_new(ts, token_str(s->tok, ids[i]));
    }
    free(ids);
    json_decref(root);
    *resp = json_pack("{s:I,s:i,s:o,s:o}", "count", (json_int_t)n, "max_model_len",
                      s->max_model_len, "tokens", toks, "token_strs", ts);
    return 0;
fail:
    free(ids);
    json_decref(root);
    *err_out = err;
    return -1;
}

typedef struct tokenize_job {
    prep_job job;  /* first: the prep job */
    char *resp;    /* the answer as JSON text, when job.rc == 0 */
    oai_error err; /* the error, when job.rc != 0 */
} tokenize_job;

static void tokenize_work(prep_job *j, const char *body, size_t len) {
    tokenize_job *t = (tokenize_job *)j;
    json_t *resp = NULL;
    j->rc = tokenize_run(j->s, body, len, &resp, &t->err);
    if (j->rc == 0) { /* 7 M tokens are 50 MB of JSON: rendered here, not on the loop */
        t->resp = json_dumps(resp, JSON_COMPACT);
        json_decref(resp);
    }
}

static void tokenize_done(prep_job *j) {
    tokenize_job *t = (tokenize_job *)j;
    if (j->http && j->rc == 0)
        server_reply_json_text(j->http, 200, t->resp); /* consumes resp */
    else if (j->http)
        server_reply_error(j->http, &t->err, NULL);
    else
        free(t->resp);
    free(t);
}

void server_tokenize_handle(server *s, hs_req *req) {
    tokenize_job *t = prep_wants(s, req) ? calloc(1, sizeof *t) : NULL;
    if (t) { /* a long prompt: tokenized off the loop */
        t->job.http = req;
        t->job.work = tokenize_work;
        t->job.done = tokenize_done;
        prep_submit(s, &t->job);
        return;
    }
    size_t len = 0;
    char *body = server_read_body(req, &len);
    json_t *resp = NULL;
    oai_error err;
    if (!body) oai_error_set(&err, 500, "InternalServerError", NULL, "out of memory");
    int rc = body ? tokenize_run(s, body, len, &resp, &err) : -1;
    free(body);
    if (rc)
        server_reply_error(req, &err, NULL);
    else
        server_reply_json(req, 200, resp, NULL);
}

void server_detokenize_handle(server *s, hs_req *req) {
    oai_error err;
    size_t blen = 0;
    char *body = server_read_body(req, &blen);
    if (!body) {
        server_reply_errorf(req, 500, "InternalServerError", NULL, "out of memory");
        return;
    }
    json_t *root = parse_body(s, body, blen, &err);
    free(body);
    if (!root) {
        server_reply_error(req, &err, NULL);
        return;
    }
    json_t *t = json_object_get(root, "tokens");
    int32_t *ids = NULL;
    char *text = NULL;
    size_t n = json_array_size(t), len = 0;
    int vocab = tokenizer_vocab_size(s->tok);
    if (!json_is_array(t)) {
        oai_error_set(&err, 400, "BadRequestError", "tokens",
                      "'tokens' is required: a list of token ids");
        goto fail;
    }
    ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) {
        oai_error_set(&err, 500, "InternalServerError", NULL, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(t, i);
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) >= vocab) {
            oai_error_set(&err, 400, "BadRequestError", "tokens",
                          "'tokens' element %zu is not a token id: accepted are integers 0..%d", i,
                          vocab - 1);
            goto fail;
        }
        ids[i] = (int32_t)json_integer_value(e);
    }
    char msg[512] = "";
    if (tokenizer_decode(s->tok, ids, n, false, &text, &len, msg, sizeof msg)) {
        oai_error_set(&err, 400, "BadRequestError", "tokens", "%s", msg);
        goto fail;
    }
    server_reply_json(req, 200, json_pack("{s:s%}", "prompt", text, len), NULL);
    free(text);
    free(ids);
    json_decref(root);
    return;
fail:
    free(ids);
    json_decref(root);
    server_reply_error(req, &err, NULL);
}
