/*
 * mistral_chat — a chat conversation turned into token ids by mistral-common's
 * rules (`--tokenizer-mode mistral`, vLLM's MistralTokenizer), not by a Jinja
 * chat template: the OpenAI messages are normalized as mistral-common's
 * InstructRequestNormalizer does (consecutive messages of one role merged,
 * system prompts joined, tool-call arguments and tool results re-serialized as
 * Python's json.dumps), validated as its MistralRequestValidator does in test
 * mode, and encoded as its InstructTokenizerV1..V13: control tokens ([INST],
 * [/INST], [SYSTEM_PROMPT], [AVAILABLE_TOOLS], [TOOL_CALLS], [TOOL_RESULTS],
 * [TOOL_CONTENT], [ARGS], [CALL_ID]) are ids, each piece of text is encoded
 * alone with no bos/eos and no control token recognised in it.
 *
 * The version comes from the model directory's mistral-common tokenizer file
 * (tekken.json: its config.version; tokenizer.model.vN: the N of its name);
 * the text is encoded by the directory's tokenizer.json (the tokenizer module),
 * whose ids must be the same file's (hub checkpoints ship both).  The control
 * tokens are looked up by name in it; a version whose tokens are missing is
 * refused when the model loads.  Values must agree with mistral-common 1.x
 * (tests/integration/test_mistral_mode.py compares ids with it).
 */
#ifndef DISAGG_MODEL_MISTRAL_CHAT_H
#define DISAGG_MODEL_MISTRAL_CHAT_H

#include "model/tokenizer.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct mistral_chat mistral_chat;

/* The mistral-common tokenizer file of dir (tekken.json, else the
 * tokenizer.model.vN of highest N) written into path, or 0 when there is none. */
bool mistral_chat_find_file(const char *dir, char *path, size_t cap);
/* vLLM's `--tokenizer-mode auto` rule: the mistral mode when dir is a Mistral-format
 * repository (a consolidated*.safetensors file) with a mistral-common tokenizer file. */
bool mistral_chat_auto(const char *dir);

/* Read the version from dir's tokenizer file and look up its control tokens in
 * tok (which must outlive the handle).  Errors name the file and what is
 * accepted (versions v1, v2, v3, v7, v11, v13). */
int mistral_chat_open(const char *dir, const tokenizer *tok, mistral_chat **out, char *err,
                      size_t err_cap);
void mistral_chat_free(mistral_chat *mc);
/* "v3", "v7", ... and whether the file is Tekken (else SentencePiece). */
const char *mistral_chat_version(const mistral_chat *mc);
bool mistral_chat_is_tekken(const mistral_chat *mc);

/* Encode an OpenAI messages array (+ tools array or NULL) as
 * mistral-common's encode_chat_completion, bos first.  A final assistant
 * message is continued (mistral-common's prefix: no eos), as vLLM does.  Tool
 * call ids longer than 9 characters keep their last 9 (vLLM).  *ids is
 * malloc'ed.  -EINVAL with err naming the message and the rule broken. */
int mistral_chat_encode(const mistral_chat *mc, const json_t *messages, const json_t *tools,
                        int32_t **ids, size_t *n, char *err, size_t err_cap);

#endif
