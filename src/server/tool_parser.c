/*
 * tool_parser — the table of --tool-call-parser names and what the parsers
 * share (see tool_parser.h).
 */
#include "server/tool_parser.h"

#include "base/rng.h"

#include "model/chat_template.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const tool_parser *const PARSERS[] = {&tool_parser_hermes, &tool_parser_llama3_json,
                                             &tool_parser_mistral};

const tool_parser *tool_parser_find(const char *name) {
    for (size_t i = 0; i < sizeof PARSERS / sizeof PARSERS[0]; i++)
        if (!strcmp(PARSERS[i]->name, name)) return PARSERS[i];
    return NULL;
}

const tool_parser *tool_parser_default(void) {
    return &tool_parser_hermes;
}

int tool_parser_stream_calls(const tool_parser *p, const char *text, size_t len, size_t sent,
                             json_t **calls, size_t *content_len) {
    int n = p->parse(text, len, calls, content_len);
    if (n > 0 && sent > *content_len) {
        json_decref(*calls);
        *calls = NULL;
        *content_len = 0;
        return 0;
    }
    return n;
}

json_t *tool_call_new(const char *id, const char *name, size_t name_len, const char *args,
                      size_t args_len) {
    return json_pack("{s:s,s:s,s:{s:s%,s:s%}}", "id", id, "type", "function", "function", "name",
                     name, name_len, "arguments", args, args_len);
}

json_t *tool_call_new_json(const char *id, const char *name, size_t name_len, const json_t *args) {
    char *s = NULL;
    size_t n = 0;
    json_t *empty = args ? NULL : json_object();
    int rc = chat_template_tojson(args ? args : empty, &s, &n);
    json_decref(empty);
    json_t *call = rc || !s ? NULL : tool_call_new(id, name, name_len, s, n);
    free(s);
    return call;
}

void tool_call_id_openai(char *out, size_t cap) {
    snprintf(out, cap, "chatcmpl-tool-%016llx%016llx", (unsigned long long)rng_global_next(),
             (unsigned long long)rng_global_next());
}

void tool_call_id_mistral(char out[10]) {
    static const char ALNUM[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    uint64_t r = rng_global_next();
    for (int i = 0; i < 9; i++) {
        out[i] = ALNUM[r % 62];
        r /= 62; /* 62^9 < 2^64: nine draws from one word */
    }
    out[9] = 0;
}

size_t tool_parser_before_tag(const char *text, size_t len, const char *tag) {
    const size_t tl = strlen(tag);
    const char *start = memmem(text, len, tag, tl);
    if (start) return (size_t)(start - text);
    /* the longest suffix of text that is a proper prefix of the tag */
    for (size_t k = tl - 1; k > 0; k--)
        if (len >= k && !memcmp(text + len - k, tag, k)) return len - k;
    return len;
}
