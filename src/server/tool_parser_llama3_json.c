/*
 * tool_parser_llama3_json — Llama 3.1/3.2/3.3 JSON tool calls, as vLLM's
 * "llama3_json" parser (Llama3JsonToolParser):
 *   the model writes  {"name": ..., "parameters": {...}}  (or "arguments"),
 *   possibly after "<|python_tag|>", several separated by ";".
 *   Non-streaming: every "{" outside an object already read starts a JSON
 *   object (Python's raw_decode); each must decode and hold a string "name"
 *   and an "arguments" or "parameters" value, else the whole text is content.
 *   With one call or more, content is null: text around the objects is
 *   dropped.
 *   Streaming: a call is looked for only when the text starts with "{" or
 *   "<|python_tag|>" (vLLM's streaming rule); otherwise it streams as content.
 * Tool call ids are vLLM's "chatcmpl-tool-<hex>".
 */
#include "server/tool_parser.h"

#include <stdbool.h>
#include <string.h>

#define PYTHON_TAG "<|python_tag|>"

/* One object at text[0] ('{'): the call, and *used the bytes it spans; NULL when it does not
 * decode or lacks the keys (*bad set), or on allocation failure (*bad clear). */
static json_t *llama_one(const char *text, size_t len, size_t *used, bool *bad) {
    json_error_t e;
    *bad = true;
    json_t *j = json_loadb(text, len, JSON_DISABLE_EOF_CHECK | JSON_ALLOW_NUL, &e);
    if (!j) return NULL;
    *used = (size_t)e.position;
    json_t *name = json_object_get(j, "name");
    json_t *args = json_object_get(j, "arguments");
    if (!args) args = json_object_get(j, "parameters");
    json_t *call = NULL;
    if (json_is_string(name) && args) {
        char id[64];
        tool_call_id_openai(id, sizeof id);
        call = tool_call_new_json(id, json_string_value(name), json_string_length(name), args);
        *bad = false;
    }
    json_decref(j);
    return call;
}

static int llama_parse(const char *text, size_t len, json_t **calls, size_t *content_len) {
    *calls = NULL;
    *content_len = 0;
    if (!memchr(text, '{', len)) return 0;
    json_t *arr = json_array();
    if (!arr) return -1;
    size_t i = 0;
    while (i < len) {
        const char *b = memchr(text + i, '{', len - i);
        if (!b) break;
        size_t at = (size_t)(b - text), used = 0;
        bool bad = false;
        json_t *call = llama_one(b, len - at, &used, &bad);
        if (!call) {
            json_decref(arr);
            return bad ? 0 : -1;
        }
        json_array_append_new(arr, call);
        i = at + (used ? used : 1);
    }
    if (json_array_size(arr) == 0) {
        json_decref(arr);
        return 0;
    }
    *calls = arr;
    return (int)json_array_size(arr);
}

static size_t llama_safe_prefix(const char *text, size_t len) {
    if (len == 0 || text[0] == '{') return 0;
    size_t tl = strlen(PYTHON_TAG), k = len < tl ? len : tl;
    if (!memcmp(text, PYTHON_TAG, k)) return 0; /* the tag, or the start of it */
    return len;
}

/* Llama 3.1's template asks for {"name": function name, "parameters": dictionary of argument
 * name and its value}; several calls as vLLM's parser splits them */
static const tool_call_grammar LLAMA3_GRAMMAR = {
    .before = "",
    .open = "{\"name\": ",
    .quoted_name = true,
    .mid = ", \"parameters\": ",
    .close = "}",
    .sep = "; ",
    .after = "",
};

const tool_parser tool_parser_llama3_json = {
    .name = "llama3_json",
    .format = "Llama 3.x's [<|python_tag|>]{\"name\": ..., \"parameters\": ...}",
    .parse = llama_parse,
    .safe_prefix = llama_safe_prefix,
    .grammar = &LLAMA3_GRAMMAR,
};
