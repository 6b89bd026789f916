/*
 * chat_template — renders OpenAI-style chat messages into the prompt text a
 * model was trained on, natively in C (no Jinja).  The template text from
 * tokenizer_config.json is recognised, not interpreted: today the Qwen2.5
 * Instruct ChatML template (default system prompt, "# Tools" block with
 * <tools></tools>, assistant tool calls as <tool_call> blocks, tool results
 * as <tool_response> in a user turn).  Any other template is refused with an
 * "unsupported chat template" error instead of a silently wrong prompt.
 *
 * Output must equal transformers' apply_chat_template(..., tokenize=False)
 * byte for byte (tests/unit/test_chat_template.c checks the renderings in
 * tests/data/tokenizer/chat.jsonl, which transformers produced).
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

#include <jansson.h>

typedef struct chat_template chat_template;

typedef enum chat_template_kind {
    CHAT_TEMPLATE_QWEN25 = 1, /* Qwen2.5 Instruct ChatML with tools */
} chat_template_kind;

typedef struct chat_template_opts {
    bool add_generation_prompt; /* end with "<|im_start|>assistant\n" */
    /* vLLM behaviour: a tool call's "arguments" given as a JSON string is
     * parsed into an object before rendering (null or "" becomes {}).  When
     * false the value is rendered as the template sees it (a string is
     * rendered as a JSON string), which is what transformers does. */
    bool parse_tool_arguments;
} chat_template_opts;

/* Recognise template_text (the "chat_template" of tokenizer_config.json).
 * -ENOTSUP with "unsupported chat template ..." when it is not a known one;
 * -EINVAL when template_text is NULL (the model has no chat template). */
int chat_template_init(const char *template_text, chat_template **out, char *err, size_t err_cap);
void chat_template_free(chat_template *ct);
chat_template_kind chat_template_get_kind(const chat_template *ct);

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
