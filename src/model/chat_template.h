/*
 * chat_template — renders OpenAI-style chat messages into the prompt text a
 * model was trained on, natively in C (no Jinja).  The template text from
 * tokenizer_config.json is recognised, not interpreted: its fingerprint (a
 * 64-bit FNV-1a hash of the text after removing what cannot change Jinja's
 * output, see chat_template.c) is looked up in a table of official templates
 * (tests/data/chat_templates/ holds each text):
 *   Qwen2.5 Instruct (ChatML, default system prompt, Hermes tools),
 *   Qwen3 (both published revisions: <think> blocks, enable_thinking),
 *   Llama 3.1 / 3.3 Instruct (one text: JSON tools, builtin_tools, ipython),
 *   Llama 3.2 Instruct (today's date through strftime_now),
 *   Mistral 7B Instruct v0.3 and Mistral Nemo (tools, [TOOL_CALLS]).
 * Any other template is refused with an "unsupported chat template" error
 * instead of a silently wrong prompt.
 *
 * Output must equal transformers' apply_chat_template(..., tokenize=False)
 * byte for byte (tests/unit/test_chat_template.c checks the renderings in
 * tests/data/tokenizer/chat.jsonl and tests/data/chat_templates/golden.jsonl,
 * which jinja2 produced with transformers' environment).  Errors the
 * template raises (raise_exception, or a Jinja type error such as a missing
 * tool call id) are -EINVAL with the template's message.
 *
 * Messages are taken as vLLM hands them to the template: content as text,
 * and only role, content, tool_calls (when not null), tool_call_id, name and
 * reasoning_content (when a string) are seen.
 *
 * Messages and tools are jansson values in the OpenAI request format.  Text
 * content may be a string, null (empty) or a list of {"type": "text",
 * "text": ...} parts, joined with "\n" as vLLM does for string-content
 * templates.  Functions return 0 or a negative errno with a message in err.
 */
#ifndef DISAGG_MODEL_CHAT_TEMPLATE_H
#define DISAGG_MODEL_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

typedef struct chat_template chat_template;

typedef enum chat_template_kind {
    CHAT_TEMPLATE_QWEN25 = 1,   /* Qwen2.5 Instruct ChatML with tools */
    CHAT_TEMPLATE_QWEN3,        /* Qwen3: <think>, enable_thinking */
    CHAT_TEMPLATE_LLAMA31,      /* Llama 3.1 / 3.3 Instruct */
    CHAT_TEMPLATE_LLAMA32,      /* Llama 3.2 Instruct */
    CHAT_TEMPLATE_MISTRAL_V3,   /* Mistral 7B Instruct v0.3 */
    CHAT_TEMPLATE_MISTRAL_NEMO, /* Mistral Nemo Instruct 2407 */
    CHAT_TEMPLATE_MISTRAL_SMALL, /* Mistral-Small-24B-Instruct-2501, Mistral-Small-3.1-2503:
                                    [SYSTEM_PROMPT] (a dated default one), [INST] */
} chat_template_kind;

typedef struct chat_template_opts {
    bool add_generation_prompt; /* end with "<|im_start|>assistant\n" */
    /* vLLM behaviour: a tool call's "arguments" given as a JSON string is
     * parsed into an object before rendering (null or "" becomes {}).  When
     * false the value is rendered as the template sees it (a string is
     * rendered as a JSON string), which is what transformers does. */
    bool parse_tool_arguments;
    /* The request's chat_template_kwargs (a JSON object, or NULL): the
     * template variables it sets.  Used: enable_thinking (Qwen3; only false
     * turns thinking off, as "is false" in the template), date_string,
     * tools_in_user_message, builtin_tools, custom_tools (Llama 3.x).  Other
     * keys are ignored, as Jinja ignores variables a template does not read. */
    const json_t *kwargs;
    /* bos_token / eos_token as tokenizer_config.json names them; NULL: the
     * family's ("<|begin_of_text|>" for Llama 3, "<s>" / "</s>" Mistral). */
    const char *bos_token;
    const char *eos_token;
    /* The time strftime_now reads (Llama 3.2, Mistral-Small), seconds since the epoch, local
     * time as transformers' datetime.now(); 0: the clock. */
    long long now;
} chat_template_opts;

/* Recognise template_text (the "chat_template" of tokenizer_config.json).
 * -ENOTSUP with "unsupported chat template ..." when it is not a known one;
 * -EINVAL when template_text is NULL (the model has no chat template). */
int chat_template_init(const char *template_text, chat_template **out, char *err, size_t err_cap);
void chat_template_free(chat_template *ct);
chat_template_kind chat_template_get_kind(const chat_template *ct);
/* A short name of the recognised template ("qwen2.5", "qwen3", "llama3.1",
 * "llama3.2", "mistral-v0.3", "mistral-nemo", "mistral-small"). */
const char *chat_template_name(const chat_template *ct);
/* The fingerprint recognition compares (see the top of this file). */
uint64_t chat_template_fingerprint(const char *template_text);

/* Render messages (a JSON array of {"role", "content", "tool_calls", ...})
 * with optional tools (JSON array or NULL / json null).  *text_out is
 * malloc'ed and NUL-terminated, *len_out its length.  Bad messages (unknown
 * role, content of the wrong type, malformed tool call) give -EINVAL and a
 * message naming the message index and the field. */
int chat_template_render(const chat_template *ct, const json_t *messages, const json_t *tools,
                         const chat_template_opts *opts, char **text_out, size_t *len_out,
                         char *err, size_t err_cap);

/* Python json.dumps(x, ensure_ascii=False) of a jansson value: ", " and ": "
 * separators, key order kept, floats as Python's repr.  This is the template's
 * `tojson` filter.  Appends to a malloc'ed NUL-terminated string. */
int chat_template_tojson(const json_t *x, char **text_out, size_t *len_out);

#endif
