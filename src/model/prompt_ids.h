/*
 * prompt_ids — the token ids of an OpenAI request's prompt, computed as
 * `disagg serve` computes them: a chat conversation rendered by the chat
 * template (bos/eos as the tokenizer names them, tool-call arguments parsed as
 * vLLM does) and encoded; a completion's prompt (text encoded with its
 * add_special_tokens, or token ids as given).  The server's /v1/chat/completions
 * and /tokenize use prompt_ids_chat; `disagg proxy --policy kv_aware` uses
 * prompt_ids_of_body to hash a request's blocks as the instances' prefix caches do,
 * so the two must agree token for token.
 */
#ifndef DISAGG_MODEL_PROMPT_IDS_H
#define DISAGG_MODEL_PROMPT_IDS_H

#include "model/chat_template.h"
#include "model/tokenizer.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* messages rendered with tools and kwargs (chat_template_kwargs; NULL for none), then
 * encoded.  *ids is malloc'ed.  0, or -EINVAL with err naming what is wrong. */
int prompt_ids_chat(const tokenizer *tok, const chat_template *ct, const json_t *messages,
                    const json_t *tools, const json_t *kwargs, bool add_generation_prompt,
                    bool add_special, int32_t **ids, size_t *n, char *err, size_t errcap);

/* The first prompt of a request body: chat (messages, tools, chat_template_kwargs,
 * add_generation_prompt default true, add_special_tokens default false) or completions
 * (prompt: a string encoded with add_special_tokens, default true; token ids; or a list of
 * either, its first element).  ct may be NULL (chat then fails).  0, or -EINVAL with err. */
int prompt_ids_of_body(const tokenizer *tok, const chat_template *ct, const json_t *body, bool chat,
                       int32_t **ids, size_t *n, char *err, size_t errcap);

#endif
