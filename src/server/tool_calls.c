/*
 * tool_calls — Hermes <tool_call> output parsing (see tool_calls.h).
 */
#include "server/tool_calls.h"

#include "base/rng.h"

#include "model/chat_template.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A unique-enough id: 32 hex digits from a counter mixed with the clock. */
static void tool_call_id(char *out, size_t cap) {
    static _Atomic uint64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t a = (uint64_t)ts.tv_sec * 1000000007u ^ (uint64_t)ts.tv_nsec;
    uint64_t b = atomic_fetch_add(&counter, 1) + 1;
    uint64_t h[2] = {rng_mix64(a), rng_mix64(b ^ 0x9E3779B97F4A7C15ull)};
    snprintf(out, cap, "chatcmpl-tool-%016llx%016llx", (unsigned long long)h[0],
             (unsigned long long)h[1]);
}

static json_t *parse_one(const char *p, size_t n) {
    json_t *j = json_loadb(p, n, 0, NULL);
    if (!j) return NULL;
    json_t *name = json_object_get(j, "name");
    json_t *args = json_object_get(j, "arguments");
    if (!json_is_string(name)) {
        json_decref(j);
        return NULL;
    }
    char *args_s = NULL;
    size_t args_len = 0;
    json_t *empty = args ? NULL : json_object();
    int rc = chat_template_tojson(args ? args : empty, &args_s, &args_len);
    json_decref(empty);
    if (rc || !args_s) {
        free(args_s);
        json_decref(j);
        return NULL;
    }
    char id[64];
    tool_call_id(id, sizeof id);
    json_t *call = json_pack("{s:s,s:s,s:{s:O,s:s}}", "id", id, "type", "function", "function",
                             "name", name, "arguments", args_s);
    free(args_s);
    json_decref(j);
    return call;
}

int tool_calls_parse(const char *text, size_t len, json_t **calls, size_t *content_len) {
    *calls = NULL;
    *content_len = 0;
    const size_t sl = strlen(TOOL_CALL_START), el = strlen(TOOL_CALL_END);
    const char *start = memmem(text, len, TOOL_CALL_START, sl);
    if (!start) return 0;
    json_t *arr = json_array();
    if (!arr) return -1;
    const char *p = start, *end = text + len;
    while (p && p < end) {
        const char *body = p + sl;
        const char *close = memmem(body, (size_t)(end - body), TOOL_CALL_END, el);
        const char *body_end = close ? close : end;
        json_t *call = parse_one(body, (size_t)(body_end - body));
        if (!call) {
            json_decref(arr);
            return 0;
        }
        json_array_append_new(arr, call);
        if (!close) break;
        p = close + el;
        p = memmem(p, (size_t)(end - p), TOOL_CALL_START, sl);
    }
    *calls = arr;
    *content_len = (size_t)(start - text);
    return (int)json_array_size(arr);
}

size_t tool_calls_safe_prefix(const char *text, size_t len) {
    const size_t sl = strlen(TOOL_CALL_START);
    const char *start = memmem(text, len, TOOL_CALL_START, sl);
    if (start) return (size_t)(start - text);
    /* longest suffix of text that is a proper prefix of the tag */
    for (size_t k = sl - 1; k > 0; k--)
        if (len >= k && !memcmp(text + len - k, TOOL_CALL_START, k)) return len - k;
    return len;
}
