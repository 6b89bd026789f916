/*
 * tool_parser — turns a chat completion's text into OpenAI tool calls, as
 * vLLM's --tool-call-parser NAME does.  One parser per model family, each in
 * its own file (tool_parser_NAME.c), behind the table of tool_parser.c:
 *   hermes       Qwen2.5 / Hermes: <tool_call>{"name", "arguments"}</tool_call> blocks
 *   llama3_json  Llama 3.1/3.2/3.3: [<|python_tag|>]{"name", "parameters"} objects, "; " between
 *   mistral      Mistral: [TOOL_CALLS][{"name", "arguments"}, ...] (tokenizers before v11) or
 *                [TOOL_CALLS]name[ARGS]{...} per call (v11+, Tekken)
 * Every parser gives either tool calls (and the content before them, possibly
 * none) or, when no call parses, the whole text as content.  A call is
 * {"id", "type": "function", "function": {"name", "arguments": <JSON text>}};
 * arguments are written as Python's json.dumps(..., ensure_ascii=False)
 * writes them (model/chat_template's tojson), except where the parser passes
 * the model's own text on (mistral v11, as vLLM).
 *
 * Streaming: the text is held back from the first byte that may belong to a
 * call (safe_prefix); at the end of the stream the whole text is parsed and
 * the calls sent in one delta — unless some of their text was already sent
 * as content, then it stays content (tool_parser_stream_calls).
 */
#ifndef DISAGG_SERVER_TOOL_PARSER_H
#define DISAGG_SERVER_TOOL_PARSER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

/* The output a tool_choice "required" / named function is constrained to, in the parser's own
 * format: before (call (sep call)*) after, each call  open NAME mid ARGUMENTS close  with NAME
 * a JSON string (quoted_name) or bare. */
typedef struct tool_call_grammar {
    const char *before, *open, *mid, *close, *sep, *after;
    bool quoted_name;
} tool_call_grammar;

typedef struct tool_parser {
    const char *name;   /* --tool-call-parser NAME */
    const char *format; /* what the model writes, for help and messages */
    /* The calls in text: their number (0: none parses, the text is content), *calls a new
     * array and *content_len the bytes of content before them (0: content is null).  < 0 on
     * allocation failure. */
    int (*parse)(const char *text, size_t len, json_t **calls, size_t *content_len);
    /* Streaming: how many leading bytes of text can be sent as content now. */
    size_t (*safe_prefix)(const char *text, size_t len);
    /* The call starts with a special token (its text must not be skipped by the decoder). */
    const char *special_token;
    const tool_call_grammar *grammar; /* tool_choice required / named */
    /* Another grammar where the tokenizer has the token alt_token (mistral v11: [ARGS]). */
    const char *alt_token;
    const tool_call_grammar *alt_grammar;
} tool_parser;

/* The parsers (tool_parser_NAME.c). */
extern const tool_parser tool_parser_hermes, tool_parser_llama3_json, tool_parser_mistral;

/* "hermes, llama3_json, mistral": the accepted names, for messages. */
#define TOOL_PARSER_NAMES "hermes, llama3_json, mistral"

/* The parser named NAME, or NULL. */
const tool_parser *tool_parser_find(const char *name);
/* The parser used when --tool-call-parser is not given: hermes. */
const tool_parser *tool_parser_default(void);

/* Streaming, at the end of a choice: tool_parser's parse of text, but 0 (content) when some of
 * the calls' text was already sent (sent > *content_len). */
int tool_parser_stream_calls(const tool_parser *p, const char *text, size_t len, size_t sent,
                             json_t **calls, size_t *content_len);

/* ---- shared by the parsers -------------------------------------------------------------- */

/* {"id": id, "type": "function", "function": {"name": name, "arguments": args}}; NULL on
 * allocation failure. */
json_t *tool_call_new(const char *id, const char *name, size_t name_len, const char *args,
                      size_t args_len);
/* The same with arguments as json.dumps(args, ensure_ascii=False) ({} when NULL). */
json_t *tool_call_new_json(const char *id, const char *name, size_t name_len, const json_t *args);
/* vLLM's ids: "chatcmpl-tool-" + 32 hex digits (make_tool_call_id), and Mistral's: 9
 * characters of [A-Za-z0-9] (MistralToolCall.generate_random_id). */
void tool_call_id_openai(char *out, size_t cap);
void tool_call_id_mistral(char out[10]);
/* Bytes of text before tag, or before a trailing partial tag; len when neither. */
size_t tool_parser_before_tag(const char *text, size_t len, const char *tag);

#endif
