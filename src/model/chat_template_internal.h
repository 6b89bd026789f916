/*
 * chat_template_internal — what chat_template.c (recognition, tojson, the
 * messages as the template sees them, Qwen2.5) shares with
 * chat_template_families.c (Qwen3, Llama 3.x, Mistral).  Not a public header.
 * Its functions carry the module prefix chat_template_ (the files' own
 * helpers are static ct_*).
 */
#ifndef DISAGG_MODEL_CHAT_TEMPLATE_INTERNAL_H
#define DISAGG_MODEL_CHAT_TEMPLATE_INTERNAL_H

#include "model/chat_template.h"

#include <stdbool.h>
#include <stddef.h>

typedef struct ct_buf {
    char *v;    /* (cap) bytes, NUL-terminated when v != NULL */
    size_t n;   /* used, without the NUL */
    size_t cap; /* allocated */
    int oom;    /* set once an allocation failed */
} ct_buf;

void chat_template_put(ct_buf *b, const char *s, size_t n);
void chat_template_puts(ct_buf *b, const char *s);
/* json.dumps(x, ensure_ascii=False) (indent < 0) or with indent=N. */
void chat_template_json(ct_buf *b, const json_t *x, int indent);

/* One message as the template sees it (vLLM's parsed conversation). */
typedef struct ct_msg {
    const char *role;         /* "system", "user", "assistant" or "tool" */
    char *content;            /* text content (parts joined), malloc'ed */
    size_t content_len;       /* bytes of content */
    const json_t *tool_calls; /* array (possibly empty) or NULL when absent / null */
    const char *tool_call_id; /* NULL when absent */
    const char *name;         /* NULL when absent */
    const char *reasoning;    /* reasoning_content when a string, else NULL */
    size_t reasoning_len;     /* its bytes */
} ct_msg;

/* Python str.strip() / lstrip / rstrip of Unicode whitespace (Jinja's trim):
 * narrows [*s, *s + *n). */
void chat_template_py_strip(const char **s, size_t *n, bool left, bool right);
/* str.strip(chars) with the one character c. */
void chat_template_strip_char(const char **s, size_t *n, char c, bool left, bool right);
/* Python truthiness of a JSON value (NULL: undefined, false). */
bool chat_template_truthy(const json_t *x);
/* Number of code points of UTF-8 text (Jinja's |length of a string). */
size_t chat_template_utf8_len(const char *s, size_t n);
/* The tool call's arguments after vLLM's preprocessing (parse_args: a JSON
 * string becomes its value, null / "" become {}).  *owned is set to a new
 * reference the caller drops, or NULL.  -EINVAL with err on bad JSON. */
int chat_template_tool_args(const json_t *fn, bool parse_args, size_t mi, size_t ci,
                            const json_t **args, json_t **owned, char *err, size_t cap);

int chat_template_render_qwen3(const ct_msg *ms, size_t n, const json_t *tools,
                               const chat_template_opts *o, ct_buf *b, char *err, size_t cap);
int chat_template_render_llama3(const ct_msg *ms, size_t n, const json_t *tools, bool v31,
                                const chat_template_opts *o, ct_buf *b, char *err, size_t cap);
int chat_template_render_mistral(const ct_msg *ms, size_t n, const json_t *tools, bool v3,
                                 const chat_template_opts *o, ct_buf *b, char *err, size_t cap);

int chat_template_render_mistral_small(const ct_msg *ms, size_t n, const chat_template_opts *o,
                                       ct_buf *b, char *err, size_t cap);
/* strftime of o->now (0: the clock) in local time, as transformers' strftime_now. */
void chat_template_strftime_now(const chat_template_opts *o, const char *fmt, char *out,
                                size_t cap);

#endif
