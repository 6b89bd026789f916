/*
 * tool_calls — parses a Qwen2.5 / Hermes-style assistant output into OpenAI
 * tool calls, as vLLM's "hermes" tool parser does:
 *   text before the first "<tool_call>" is the message content (null when
 *   empty); each "<tool_call>{json}</tool_call>" block (the last one may be
 *   cut by the end of generation) holds {"name": ..., "arguments": {...}} and
 *   becomes {"id": "chatcmpl-tool-<hex>", "type": "function",
 *   "function": {"name", "arguments": <arguments as a JSON string>}}.
 * If any block is not valid JSON of that shape the whole output is plain
 * content (vLLM's fallback).  Arguments are serialised as Python's
 * json.dumps(..., ensure_ascii=False) writes them (", " and ": ", floats as
 * repr), through model/chat_template's tojson.
 */
#ifndef DISAGG_SERVER_TOOL_CALLS_H
#define DISAGG_SERVER_TOOL_CALLS_H

#include <jansson.h>
#include <stddef.h>

#define TOOL_CALL_START "<tool_call>"
#define TOOL_CALL_END   "</tool_call>"

/* Returns the number of tool calls found (0: plain content).  On > 0,
 * *calls is a new JSON array and *content_len the length of the content
 * prefix (0: content is null).  Returns < 0 on allocation failure. */
int tool_calls_parse(const char *text, size_t len, json_t **calls, size_t *content_len);

/* Streaming: how many leading bytes of text can be shown as content now —
 * everything before "<tool_call>" or before a trailing partial "<tool_c".. */
size_t tool_calls_safe_prefix(const char *text, size_t len);

#endif
