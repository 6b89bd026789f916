/*
 * tool_parser_mistral — Mistral tool calls, as vLLM's "mistral" parser
 * (MistralToolParser).  "[TOOL_CALLS]" is a special token of Mistral's
 * tokenizers, so while a chat with tools (tool_choice not "none") runs under
 * this parser the decoder keeps special tokens (vLLM's adjust_request sets
 * skip_special_tokens=False).  The text before the first "[TOOL_CALLS]" is
 * the content (null when empty); what follows is one of the two formats,
 * told apart by the text (vLLM asks the tokenizer whether it has [ARGS]):
 *   before v11 (Mistral-7B-Instruct-v0.3):  [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
 *     one "[TOOL_CALLS]", then a JSON array read as Python's raw_decode
 *     does (text after it ignored), or else the span from the first "[{" to
 *     the last "}]"; each element needs a string "name", "arguments"
 *     defaults to {}.  Anything else: the whole text is content.
 *   v11+ (Tekken: Mistral-Small-3.1+, Ministral, Devstral):
 *     [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]{...}
 *     each piece after a "[TOOL_CALLS]" is a name up to its first "{" (with
 *     "[ARGS]" dropped; a v11 "[CALL_ID]id" is taken as the call's id) and
 *     the arguments are the rest of the piece, passed on as the model wrote
 *     them (vLLM returns malformed ones too, so the model sees its attempt);
 *     pieces without "{" are skipped.
 * Tool call ids are 9 characters of [A-Za-z0-9], as Mistral's templates and
 * mistral-common require (vLLM's MistralToolCall).
 */
#include "server/tool_parser.h"

#include <ctype.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define TOOL_CALLS "[TOOL_CALLS]"
#define ARGS       "[ARGS]"
#define CALL_ID    "[CALL_ID]"

static bool is_ws(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* One element of the pre-v11 array: a call, or NULL (*bad: not a call; else out of memory). */
static json_t *mistral_element(const json_t *e, bool *bad) {
    *bad = true;
    const json_t *name = json_object_get(e, "name");
    if (!json_is_object(e) || !json_is_string(name)) return NULL;
    *bad = false;
    char id[10];
    tool_call_id_mistral(id);
    return tool_call_new_json(id, json_string_value(name), json_string_length(name),
                              json_object_get(e, "arguments"));
}

/* before v11: body is the text after the one [TOOL_CALLS] */
static int mistral_parse_array(const char *body, size_t n, json_t **calls) {
    while (n && is_ws(*body))
        body++, n--;
    while (n && is_ws(body[n - 1]))
        n--;
    json_t *arr = json_loadb(body, n, JSON_DISABLE_EOF_CHECK, NULL);
    if (!json_is_array(arr)) {
        json_decref(arr);
        /* vLLM's fallback: the regex \[{.*}\] (greedy, across lines) */
        const char *a = memmem(body, n, "[{", 2), *z = NULL;
        for (const char *p = body; p + 1 < body + n; p++)
            if (p[0] == '}' && p[1] == ']') z = p + 2;
        arr = a && z && z > a + 2 ? json_loadb(a, (size_t)(z - a), 0, NULL) : NULL;
        if (!json_is_array(arr)) {
            json_decref(arr);
            return 0;
        }
    }
    json_t *out = json_array();
    if (!out) {
        json_decref(arr);
        return -1;
    }
    size_t i, total = json_array_size(arr);
    json_t *e;
    int rc = 0;
    json_array_foreach(arr, i, e) {
        bool bad;
        json_t *call = mistral_element(e, &bad);
        if (!call) {
            rc = bad ? 0 : -1;
            break;
        }
        json_array_append_new(out, call);
    }
    json_decref(arr);
    if (total == 0 || json_array_size(out) != total) {
        json_decref(out);
        return rc;
    }
    *calls = out;
    return (int)total;
}

/* v11+: the pieces after each [TOOL_CALLS] */
static int mistral_parse_named(const char *body, size_t n, json_t **calls) {
    json_t *out = json_array();
    if (!out) return -1;
    const size_t tl = strlen(TOOL_CALLS), al = strlen(ARGS), cl = strlen(CALL_ID);
    const char *p = body, *end = body + n;
    while (p < end) {
        const char *next = memmem(p, (size_t)(end - p), TOOL_CALLS, tl);
        const char *pe = next ? next : end;
        const char *brace = memchr(p, '{', (size_t)(pe - p));
        if (brace) {
            /* the name: [p, brace) without [ARGS]; [CALL_ID]id cut off */
            char *name = malloc((size_t)(brace - p) + 1), id[10] = "";
            size_t nn = 0;
            if (!name) {
                json_decref(out);
                return -1;
            }
            const char *q = p;
            while (q < brace) {
                if ((size_t)(brace - q) >= al && !memcmp(q, ARGS, al)) {
                    q += al;
                    continue;
                }
                if ((size_t)(brace - q) >= cl && !memcmp(q, CALL_ID, cl)) {
                    const char *s = q + cl, *e = s;
                    while (e < brace && isalnum((unsigned char)*e))
                        e++;
                    if (e - s == 9) memcpy(id, s, 9), id[9] = 0;
                    q = e;
                    continue;
                }
                name[nn++] = *q++;
            }
            if (!id[0]) tool_call_id_mistral(id);
            json_t *call = tool_call_new(id, name, nn, brace, (size_t)(pe - brace));
            free(name);
            if (!call) {
                json_decref(out);
                return -1;
            }
            json_array_append_new(out, call);
        }
        p = next ? next + tl : end;
    }
    if (json_array_size(out) == 0) {
        json_decref(out);
        return 0;
    }
    *calls = out;
    return (int)json_array_size(out);
}

static int mistral_parse(const char *text, size_t len, json_t **calls, size_t *content_len) {
    *calls = NULL;
    *content_len = 0;
    const size_t tl = strlen(TOOL_CALLS);
    const char *start = memmem(text, len, TOOL_CALLS, tl);
    if (!start) return 0;
    const char *body = start + tl, *end = text + len;
    const char *first = body;
    while (first < end && is_ws(*first))
        first++;
    int n;
    if (first < end && *first == '[') {
        /* before v11: exactly one [TOOL_CALLS] */
        if (memmem(body, (size_t)(end - body), TOOL_CALLS, tl)) return 0;
        n = mistral_parse_array(body, (size_t)(end - body), calls);
    } else {
        n = mistral_parse_named(body, (size_t)(end - body), calls);
    }
    if (n > 0) *content_len = (size_t)(start - text);
    return n;
}

static size_t mistral_safe_prefix(const char *text, size_t len) {
    return tool_parser_before_tag(text, len, TOOL_CALLS);
}

/* mistral-common's v3 rendering of an assistant's calls: [TOOL_CALLS] [{"name", "arguments"}] */
static const tool_call_grammar MISTRAL_GRAMMAR = {
    .before = TOOL_CALLS " [",
    .open = "{\"name\": ",
    .quoted_name = true,
    .mid = ", \"arguments\": ",
    .close = "}",
    .sep = ", ",
    .after = "]",
};

/* v11+: [TOOL_CALLS]name[ARGS]{...} per call */
static const tool_call_grammar MISTRAL_V11_GRAMMAR = {
    .before = "",
    .open = TOOL_CALLS,
    .quoted_name = false,
    .mid = ARGS,
    .close = "",
    .sep = "",
    .after = "",
};

const tool_parser tool_parser_mistral = {
    .name = "mistral",
    .format = "Mistral's [TOOL_CALLS][{\"name\": ..., \"arguments\": ...}] or, from the v11 "
              "tokenizer, [TOOL_CALLS]name[ARGS]{...}",
    .parse = mistral_parse,
    .safe_prefix = mistral_safe_prefix,
    .special_token = TOOL_CALLS,
    .grammar = &MISTRAL_GRAMMAR,
    .alt_token = ARGS,
    .alt_grammar = &MISTRAL_V11_GRAMMAR,
};
