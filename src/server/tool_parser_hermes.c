/*
 * tool_parser_hermes — Qwen2.5 / Hermes tool calls, as vLLM's "hermes" parser:
 *   text before the first "<tool_call>" is the content (null when empty);
 *   each "<tool_call>{json}</tool_call>" block (the last one may be cut by
 *   the end of generation) holds {"name": ..., "arguments": {...}}.  If any
 *   block is not valid JSON of that shape the whole output is content.
 */
#include "server/tool_parser.h"

#include <string.h>

#define HERMES_START "<tool_call>"
#define HERMES_END   "</tool_call>"

static json_t *hermes_one(const char *p, size_t n) {
    json_t *j = json_loadb(p, n, 0, NULL);
    if (!j) return NULL;
    json_t *name = json_object_get(j, "name");
    json_t *call = NULL;
    if (json_is_string(name)) {
        char id[64];
        tool_call_id_openai(id, sizeof id);
        call = tool_call_new_json(id, json_string_value(name), json_string_length(name),
                                  json_object_get(j, "arguments"));
    }
    json_decref(j);
    return call;
}

static int hermes_parse(const char *text, size_t len, json_t **calls, size_t *content_len) {
    *calls = NULL;
    *content_len = 0;
    const size_t sl = strlen(HERMES_START), el = strlen(HERMES_END);
    const char *start = memmem(text, len, HERMES_START, sl);
    if (!start) return 0;
    json_t *arr = json_array();
    if (!arr) return -1;
    const char *p = start, *end = text + len;
    while (p && p < end) {
        const char *body = p + sl;
        const char *close = memmem(body, (size_t)(end - body), HERMES_END, el);
        const char *body_end = close ? close : end;
        json_t *call = hermes_one(body, (size_t)(body_end - body));
        if (!call) {
            json_decref(arr);
            return 0;
        }
        json_array_append_new(arr, call);
        if (!close) break;
        p = close + el;
        p = memmem(p, (size_t)(end - p), HERMES_START, sl);
    }
    *calls = arr;
    *content_len = (size_t)(start - text);
    return (int)json_array_size(arr);
}

static size_t hermes_safe_prefix(const char *text, size_t len) {
    return tool_parser_before_tag(text, len, HERMES_START);
}

/* as Qwen2.5's template shows it: "<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>" */
static const tool_call_grammar HERMES_GRAMMAR = {
    .before = "",
    .open = HERMES_START "\n{\"name\": ",
    .quoted_name = true,
    .mid = ", \"arguments\": ",
    .close = "}\n" HERMES_END,
    .sep = "\n",
    .after = "",
};

const tool_parser tool_parser_hermes = {
    .name = "hermes",
    .format = "Qwen2.5's <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>",
    .parse = hermes_parse,
    .safe_prefix = hermes_safe_prefix,
    .grammar = &HERMES_GRAMMAR,
};
