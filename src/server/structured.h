/*
 * structured — structured outputs in requests: the vLLM / OpenAI request forms
 * (response_format json_object / json_schema, structured_outputs {json, regex, choice,
 * grammar, json_object}, the legacy guided_json / guided_regex / guided_choice /
 * guided_grammar, tool_choice "required" or a named function) turned into one grammar
 * (grammar/) compiled over the model's vocabulary, with a small cache of compiled
 * grammars (their lazily built states and masks live on across requests).
 */
#ifndef DISAGG_SERVER_STRUCTURED_H
#define DISAGG_SERVER_STRUCTURED_H

#include "grammar/grammar.h"

#include <jansson.h>
#include <stddef.h>

struct tokenizer;
struct tool_call_grammar;

/* The grammar view of a tokenizer's vocabulary over n_vocab ids (the model's logits
 * row; ids past the tokenizer's are never allowed). NULL on allocation failure. */
grammar_vocab *structured_vocab_new(const struct tokenizer *tok, int n_vocab);

typedef struct structured_cache structured_cache;
structured_cache *structured_cache_new(const grammar_vocab *vocab);
void structured_cache_free(structured_cache *c);

/* The constraint of request body (c NULL: any constraint is an error) (chat: is_chat; tools as the
 * body gives them): *out = NULL when there is none, else a grammar reference the caller unrefs (or
 * hands on).  tool_choice "required" / a named function constrain the output to tool calls in
 * tool_fmt, the tool parser's format (server/tool_parser.h); *tool_call_format is then 1, so the
 * server parses the output as tool calls.  -EINVAL with err
 * naming the problem (a 400). */
int structured_from_request(structured_cache *c, json_t *body, int is_chat,
                            const struct tool_call_grammar *tool_fmt, grammar **out,
                            int *tool_call_format, char *err, size_t errlen);

#endif
