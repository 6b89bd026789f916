/*
 * server — `disagg serve`: the OpenAI-compatible HTTP server in front of one
 * engine.  One libevent event-loop thread serves every connection (no thread
 * per connection); the engine runs its own step thread and hands events to
 * the loop through a queue (see gen.h).  The model loads on a loader thread
 * while the server already answers: /health is 503 until the engine is ready,
 * then 200.  server_run returns when SIGINT or SIGTERM arrives.
 */
#ifndef DISAGG_SERVER_SERVER_H
#define DISAGG_SERVER_SERVER_H

#include "engine/engine.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

struct tool_parser;

/* --tokenizer-mode (vLLM's): auto is mistral when the tokenizer directory has a
 * mistral-common file (tekken.json, tokenizer.model.v*), else hf; hf and slow are
 * the tokenizer.json tokenizer with the chat template; mistral encodes chats by
 * mistral-common's rules (model/mistral_chat.h). */
enum {
    SERVER_TOKENIZER_MODE_AUTO,
    SERVER_TOKENIZER_MODE_HF,
    SERVER_TOKENIZER_MODE_SLOW,
    SERVER_TOKENIZER_MODE_MISTRAL
};

typedef struct server_config {
    const char *host;                    /* listen address (default "0.0.0.0") */
    int port;                            /* listen port (default 8000) */
    const char *model;                   /* MODEL as given (directory or hub name) */
    const char *served_model_name;       /* name in /v1/models and responses; NULL = model */
    const char *const *more_model_names; /* (n_more_model_names) further --served-model-name */
    int n_more_model_names;              /* names, served too (listed, accepted as "model") */
    const char *api_key;                 /* Bearer key required on the /v1 routes; NULL = none */
    const char *kv_transfer_config; /* --kv-transfer-config JSON text, kept for the connector */
    const char *kv_events_config;   /* --kv-events-config JSON text (vLLM's KVEventsConfig) */
    size_t max_body_bytes;          /* request body limit (default 32 MiB) → 413 */
    double header_timeout_s;        /* head complete this long after its first byte (60) */
    double keepalive_timeout_s;     /* idle keep-alive connection closed after (5) */
    double body_timeout_s;          /* body complete this long after the head (60) */
    int log_requests;               /* log one line per request (default 1) */
    int log_stats;                  /* --disable-log-stats clears it (default 1) */
    const char *tokenizer_dir;      /* --tokenizer, resolved; NULL = the model directory */
    const char *chat_template;      /* --chat-template text; NULL = the tokenizer's */
    int tokenizer_mode;             /* --tokenizer-mode: a SERVER_TOKENIZER_MODE_* */
    int reasoning_parser;           /* --reasoning-parser: a reasoning_kind (server/reasoning.h),
                                       0 = none: <think> text stays in content */
    const struct tool_parser *tool_parser; /* --tool-call-parser (server/tool_parser.h);
                                              NULL = hermes */
    int max_logprobs;               /* --max-logprobs: most (top_)logprobs a request asks (20) */
    const char *generation_config;  /* "auto" (default: the model's generation_config.json),
                                       "vllm" (none), or a directory holding one */
    const char *override_generation_config; /* --override-generation-config JSON (checked by
                                               oai_defaults_override), applied over the
                                               generation config's defaults; NULL = none */
    const char *root_path; /* --root-path: proxy prefix, informational (as uvicorn) */
    /* CORS (vLLM's --allowed-origins/--allowed-methods/--allowed-headers, JSON lists, and
     * --allow-credentials); NULL lists = ["*"] */
    json_t *cors_origins, *cors_methods, *cors_headers;
    int cors_credentials;
    engine_config engine; /* passed to engine_create */
    /* Called (on the loader thread) with the engine once it is loaded, before /health turns
     * 200, and with NULL before it is destroyed, when server_run is returning; between the
     * two the callee may call the engine's thread-safe functions (engine_get_stats) from any
     * thread.  `disagg serve --discovery` publishes the engine's load this way.  NULL = none. */
    void (*on_engine)(void *arg, engine *e);
    void *on_engine_arg; /* its argument */
} server_config;

void server_config_init(server_config *c);

/* Serve until SIGINT/SIGTERM.  Returns 0, or < 0 when the listen socket
 * cannot be opened or the model fails to load (message on stderr). */
int server_run(const server_config *cfg);

#endif
