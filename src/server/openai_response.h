/*
 * openai_response — renders OpenAI response objects: completion and chat
 * completion bodies, their streaming chunks as Server-Sent Events
 * ("data: {json}\n\n", "data: [DONE]\n\n"), usage, and logprobs in both the
 * completions format (text_offset / token_logprobs / tokens / top_logprobs)
 * and the chat format (content: [{token, logprob, bytes, top_logprobs}]),
 * plus vLLM's prompt_logprobs.  Key order and spelling follow vLLM's pydantic
 * models (vllm/entrypoints/openai/protocol.py) so byte streams compare with
 * the golden files in tests/data/server/.  JSON is compact (no spaces), as
 * vLLM's model_dump_json writes it.  Pure: token strings come from a
 * caller-supplied namer, so this is unit-tested without a tokenizer.
 */
#ifndef DISAGG_SERVER_OPENAI_RESPONSE_H
#define DISAGG_SERVER_OPENAI_RESPONSE_H

#include "engine/engine.h"
#include "server/sbuf.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Writes the display string of token id into out (reset first).  Returns 0
 * or < 0.  The server's namer decodes the id (or writes "token_id:N"). */
typedef int (*oai_token_namer)(void *ctx, int32_t id, sbuf *out);

typedef struct oai_namer {
    oai_token_namer fn; /* the function */
    void *ctx;          /* its context (the tokenizer) */
} oai_namer;

typedef struct oai_usage {
    int prompt_tokens;     /* all prompts, once each */
    int completion_tokens; /* all choices */
    int cached_tokens;     /* prompt tokens served from the prefix cache, -1: omit details */
    bool kv_transfer;      /* a P/D request: add "kv_transfer" (the two counts below) */
    int received_tokens;   /* prompt tokens whose KV came from the producer */
    int computed_tokens;   /* prompt tokens computed by this instance */
    bool kv_pulled;        /* a consumer's request: add "layerwise" */
    bool kv_layerwise;     /* the producer streamed its KV layer by layer */
} oai_usage;

json_t *oai_usage_json(const oai_usage *u);

/* vLLM clamps -inf logprobs to -9999.0 so the JSON stays valid. */
double oai_logprob_value(float lp);

/* ---- completions logprobs ---------------------------------------------- */
/* {"text_offset":[],"token_logprobs":[],"tokens":[],"top_logprobs":[]} */
json_t *oai_cmpl_logprobs_new(void);
/* Appends one token: its text offset, its logprob (null when no_logprob, the
 * first prompt token under echo), its string, and a {token: logprob} object
 * of the top n_top alternatives plus the chosen token (null when
 * no_logprob).  *offset advances by the token string's length in
 * characters.  Returns 0 or < 0. */
int oai_cmpl_logprobs_add(json_t *lp, const engine_token *t, int n_top, bool no_logprob,
                          size_t *offset, const oai_namer *nm);

/* ---- chat logprobs ----------------------------------------------------- */
/* {"content":[]} */
json_t *oai_chat_logprobs_new(void);
/* Appends {"token","logprob","bytes","top_logprobs":[{"token","logprob","bytes"} x n_top]}. */
int oai_chat_logprobs_add(json_t *lp, const engine_token *t, int n_top, const oai_namer *nm);

/* vLLM's prompt_logprobs: [null, {"<id>": {"logprob","rank","decoded_token"}}, ...];
 * each entry has the prompt token plus its top n_top alternatives.  rank is the
 * 1-based place among the returned alternatives, null when the prompt token is
 * not among them (the engine does not report ranks beyond the top list). */
json_t *oai_prompt_logprobs_json(const engine_token *pl, int n, int n_top, const oai_namer *nm);

/* ---- bodies and chunks ------------------------------------------------- */
/* Functions taking json_t * values steal the reference (pass NULL for null). */
json_t *oai_completion_choice(int index, const char *text, size_t len, json_t *logprobs,
                              const char *finish_reason, json_t *stop_reason,
                              json_t *prompt_logprobs);
json_t *oai_chat_choice(int index, const char *content, size_t len, bool content_null,
                        json_t *tool_calls, json_t *logprobs, const char *finish_reason,
                        json_t *stop_reason);
/* {"id","object","created","model","choices","usage", [prompt_logprobs,] "kv_transfer_params"}:
 * object is "text_completion" or "chat.completion"; kv_transfer_params is null (the
 * MooncakeConnector's contract: the proxy, not the producer's answer, names the transfer). */
json_t *oai_response(bool chat, const char *id, long long created, const char *model,
                     json_t *choices, const oai_usage *usage);

/* Streaming chunks.  usage: NULL omits the key, else it is written (a json null
 * when usage_null, as OpenAI does on the content chunks when include_usage). */
json_t *oai_completion_chunk(const char *id, long long created, const char *model, int index,
                             const char *text, size_t len, json_t *logprobs,
                             const char *finish_reason, json_t *stop_reason, const oai_usage *usage,
                             bool usage_null);
json_t *oai_chat_chunk(const char *id, long long created, const char *model, int index,
                       json_t *delta, json_t *logprobs, const char *finish_reason,
                       json_t *stop_reason, const oai_usage *usage, bool usage_null);
/* The final usage-only chunk: "choices":[] and usage. */
json_t *oai_usage_chunk(bool chat, const char *id, long long created, const char *model,
                        const oai_usage *usage);

/* "data: <compact json>\n\n" (consumes x) and "data: [DONE]\n\n". */
int oai_sse_event(sbuf *out, json_t *x);
int oai_sse_done(sbuf *out);

#endif
