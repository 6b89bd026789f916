/*
 * openai_request — parses and validates the JSON body of POST /v1/completions
 * and POST /v1/chat/completions (OpenAI's request shapes plus vLLM's
 * extensions) into what the handlers submit to the engine.  Every invalid
 * field gives an oai_error: HTTP status, OpenAI error type, the field name
 * (param) and a message naming the bad value and what is accepted.  Pure: no
 * tokenizer, no engine calls, so it is unit-tested on its own
 * (tests/unit/test_server_request.c).  The checks mirror vLLM's
 * (vllm/entrypoints/openai/protocol.py and SamplingParams._verify_args).
 */
#ifndef DISAGG_SERVER_OPENAI_REQUEST_H
#define DISAGG_SERVER_OPENAI_REQUEST_H

#include "engine/engine.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define OAI_MAX_N        128 /* most choices per request */
#define OAI_MAX_LOGPROBS ENGINE_MAX_TOP_LOGPROBS
#define OAI_MAX_STOPS    64 /* most stop strings */

typedef enum oai_kind {
    OAI_COMPLETIONS = 0, /* /v1/completions */
    OAI_CHAT = 1         /* /v1/chat/completions */
} oai_kind;

typedef struct oai_error {
    int status;         /* HTTP status: 400, 401, 404, 405, 413, 500, 503 */
    const char *type;   /* "BadRequestError", "NotFoundError", ... (static) */
    char param[64];     /* the offending field, "" when none */
    char message[1024]; /* what was wrong and what is accepted */
} oai_error;

void oai_error_set(oai_error *e, int status, const char *type, const char *param, const char *fmt,
                   ...) __attribute__((format(printf, 5, 6)));
/* {"error":{"message","type","param","code"}} (vLLM's ErrorResponse shape);
 * malloc'ed compact JSON, NULL on allocation failure. */
char *oai_error_json(const oai_error *e);

/* Server-side defaults the request is completed with. */
typedef struct oai_defaults {
    const char *served_model_name;    /* the name responses report; accepted as "model" */
    const char *const *model_aliases; /* (n_model_aliases) further --served-model-name names, */
    int n_model_aliases;              /* also accepted (vLLM serves every name) */
    const char *model_path;           /* also accepted as "model" (vLLM accepts the path) */
    float temperature;                /* from generation_config.json, else 1 */
    float top_p;                      /* from generation_config.json, else 1 */
    int top_k;                        /* from generation_config.json, else 0 (off) */
    float repetition_penalty;         /* from generation_config.json, else 1 */
    float min_p;                      /* --override-generation-config, else 0 */
    int max_tokens;                   /* max_new_tokens of --override-generation-config: caps every
                                         request's max_tokens, as vLLM's get_max_tokens; -1: none */
    int max_logprobs;                 /* --max-logprobs: most logprobs a request may ask (20) */
} oai_defaults;

void oai_defaults_init(oai_defaults *d);

/* vLLM's --override-generation-config: a JSON object whose keys (temperature, top_p, top_k,
 * min_p, repetition_penalty, max_new_tokens) replace the generation_config.json defaults of
 * requests that omit them.  Returns 0, or -EINVAL with err naming the bad key or value and
 * what is accepted (d unchanged then).  json NULL or "": nothing. */
int oai_defaults_override(oai_defaults *d, const char *json, char *err, size_t errlen);

/* 1 when m names the served model: a served name or the model path. */
int oai_model_name_ok(const oai_defaults *d, const char *m);
/* Writes the accepted names, quoted and comma-separated, for error messages. */
void oai_model_names_list(const oai_defaults *d, char *out, size_t cap);

typedef struct oai_prompt {
    char *text;      /* UTF-8 prompt when given as text, else NULL */
    size_t text_len; /* bytes of text */
    int32_t *ids;    /* (n_ids) token ids when given as ids, else NULL */
    int n_ids;       /* ids given */
} oai_prompt;

typedef struct oai_request {
    oai_kind kind;                   /* which endpoint */
    char *model;                     /* "model" as given, NULL when absent */
    oai_prompt *prompts;             /* (n_prompts) completions prompts */
    int n_prompts;                   /* >= 1 for completions, 0 for chat */
    json_t *messages;                /* chat: the messages array (own reference) */
    json_t *tools;                   /* chat: tools array or NULL (own reference) */
    bool add_generation_prompt;      /* chat: end the prompt with the assistant header */
    json_t *chat_template_kwargs;    /* chat: vLLM's chat_template_kwargs object, or NULL */
    bool parse_tool_calls;           /* chat: tools given and tool_choice is "auto" */
    bool add_special_tokens;         /* tokenizer's bos/eos (completions: true, chat: false) */
    int n;                           /* choices per prompt */
    int best_of;                     /* sequences generated per prompt (>= n): the n of highest
                                        cumulative logprob are returned (vLLM's best_of) */
    int max_tokens;                  /* -1: as many as max_model_len allows */
    int min_tokens;                  /* eos/stop ignored before this many tokens */
    bool ignore_eos;                 /* keep generating past eos */
    char **stop;                     /* (n_stop) stop strings */
    int n_stop;                      /* stop strings given */
    int32_t *stop_token_ids;         /* (n_stop_token_ids) extra stop ids */
    int n_stop_token_ids;            /* stop ids given */
    engine_sampling sampling;        /* temperature ... seed, logprobs, prompt_logprobs */
    int logprobs;                    /* -1: none; N: chosen token + top N (completions
                                        "logprobs", chat "top_logprobs" with "logprobs") */
    int prompt_logprobs;             /* -1: none; N: vLLM's prompt_logprobs field */
    bool echo;                       /* completions: prepend the prompt to the text */
    bool stream;                     /* Server-Sent Events */
    bool include_usage;              /* stream_options.include_usage */
    bool continuous_usage_stats;     /* stream_options.continuous_usage_stats */
    bool return_tokens_as_token_ids; /* logprob tokens as "token_id:N" */
    bool skip_special_tokens;        /* drop special tokens from the text (default) */
    bool include_stop_str_in_output; /* keep the matched stop string */
    /* logit processors (sampling.* point at these once parsed; bad words are tokenized by
     * the server, which has the tokenizer: bad_word_ids / bad_word_lens) */
    int32_t *logit_bias_ids;         /* logit_bias keys ... */
    float *logit_bias;               /* ... and values, clamped to [-100, 100] as vLLM */
    int32_t *allowed_token_ids;      /* vLLM's allowed_token_ids */
    char **bad_words;                /* (n_bad_words) vLLM's bad_words */
    int n_bad_words;
    int32_t *bad_word_ids, *bad_word_lens; /* the server's tokenization of bad_words */
    bool use_beam_search;            /* vLLM's beam search (beam_search.c), beam width n */
    float length_penalty;            /* beam search: score = cum_logprob / len ** it (1) */
    json_t *kv_transfer_params;      /* vLLM extension, own reference or NULL */
    json_t *body;                    /* the whole request (own reference): structured outputs */
} oai_request;

/* Parse body (len bytes).  Returns 0, or -EINVAL with err filled (the
 * request is then already freed, except kv_transfer_params when the body had
 * an object there: the caller may still act on it).  Free with
 * oai_request_free either way. */
int oai_request_parse(oai_request *r, oai_kind kind, const char *body, size_t len,
                      const oai_defaults *d, oai_error *err);
void oai_request_free(oai_request *r);

#endif
