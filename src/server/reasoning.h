/*
 * reasoning — splits a chat completion's text into reasoning_content and
 * content as vLLM's --reasoning-parser does, on the text (the tags are
 * matched as text, so it works whatever the tokenizer):
 *   deepseek_r1: an optional "<think>" is dropped (text before it too); the
 *     text up to the first "</think>" is reasoning, the rest content.  With
 *     no "</think>" everything is reasoning and content is null (R1 models
 *     open the <think> block in the prompt).
 *   qwen3: reasoning only when the output holds "</think>": the text up to it
 *     is reasoning (after the first "<think>" when the output has one: the
 *     Qwen3-Thinking-2507 templates put "<think>" in the prompt, so their
 *     output has only the closing tag), the text after it content; without
 *     "</think>" all of it is content (vLLM's Qwen3ReasoningParser).
 * Empty content becomes null, as vLLM's `content or None`.  Streaming
 * follows vLLM's streaming rule: text after "<think>" (deepseek_r1: from the
 * start; qwen3: from the start too unless the prompt closed a think block --
 * reasoning_prompt_closes, Qwen3's enable_thinking false -- as vLLM's qwen3
 * parser and its reasoning-ended check of the prompt do) streams as
 * reasoning_content until "</think>", then as content; a trailing partial tag
 * is held back until it is decided.  So, as in vLLM, a qwen3 output with no
 * tag at all after a prompt that closed no block streams as reasoning and is
 * content in its final form.  Tool calls are parsed from the content part only
 * (tool_parser.h).
 */
#ifndef DISAGG_SERVER_REASONING_H
#define DISAGG_SERVER_REASONING_H

#include <stdbool.h>
#include <stddef.h>

typedef enum reasoning_kind {
    REASONING_NONE = 0,
    REASONING_QWEN3,
    REASONING_DEEPSEEK_R1,
} reasoning_kind;

/* The parser named by --reasoning-parser: 0, or -1 for an unknown name. */
int reasoning_kind_from_name(const char *name, reasoning_kind *out);
/* "qwen3, deepseek_r1": the accepted names, for error messages. */
#define REASONING_PARSERS "qwen3, deepseek_r1"

typedef struct reasoning_split {
    bool has_reasoning; /* reasoning is present (possibly "") */
    size_t r_start;     /* reasoning = text[r_start, r_end) */
    size_t r_end;
    size_t c_start; /* content = text[c_start, c_end) */
    size_t c_end;
} reasoning_split;

/* Whether a prompt (its rendered text, or the tail of it) closed a think block: its last
 * think tag is "</think>" (Qwen3's template with enable_thinking false). */
bool reasoning_prompt_closes(const char *text, size_t len);
/* Final split of the whole output. */
void reasoning_split_final(reasoning_kind k, const char *text, size_t len, reasoning_split *out);
/* Streaming split of the text released so far: the parts that may be shown
 * now (each only grows as text is appended).  final: no more text comes, so
 * nothing is held back. */
void reasoning_split_stream(reasoning_kind k, bool prompt_closed, const char *text, size_t len,
                            bool final, reasoning_split *out);

#endif
