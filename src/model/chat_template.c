/*
 * chat_template — native rendering of known chat templates (see
 * chat_template.h).  Recognition compares the template text with the known
 * Qwen2.5 Instruct template after removing whitespace outside string
 * literals: every tag of that template strips the whitespace before it
 * ({%- / {{-), so such whitespace cannot change the output, while any change
 * to a literal, an expression or a whitespace-control dash is refused.
 * Rendering follows the template's Jinja statement by statement; the comments
 * quote the statement each block implements.
 */
#include "model/chat_template.h"

#include "base/err.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct chat_template {
    chat_template_kind kind; /* which known template this is */
};

/* The chat_template of Qwen2.5-*-Instruct's tokenizer_config.json. */
static const char QWEN25_TEMPLATE[] =
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' "
    "}}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n";

static const char QWEN25_DEFAULT_SYSTEM[] =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

/* ======================================================================
 * string builder
 * ====================================================================== */

typedef struct ct_buf {
    char *v;    /* (cap) bytes, NUL-terminated when v != NULL */
    size_t n;   /* used, without the NUL */
    size_t cap; /* allocated */
    int oom;    /* set once an allocation failed */
} ct_buf;

static void ct_put(ct_buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 1024;
        while (nc < b->n + n + 1)
            nc *= 2;
        char *nv = realloc(b->v, nc);
        if (!nv) {
            b->oom = 1;
            return;
        }
        b->v = nv;
        b->cap = nc;
    }
    memcpy(b->v + b->n, s, n);
    b->n += n;
    b->v[b->n] = 0;
}

static void ct_puts(ct_buf *b, const char *s) {
    ct_put(b, s, strlen(s));
}

/* ======================================================================
 * recognition
 * ====================================================================== */

/* Copy of s without whitespace outside '...' / "..." literals (a literal may
 * hold backslash escapes). */
static char *ct_normalize(const char *s) {
    size_t n = strlen(s);
    char *o = malloc(n + 1);
    if (!o) return NULL;
    size_t j = 0;
    char quote = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (quote) {
            o[j++] = c;
            if (c == '\\' && i + 1 < n) {
                o[j++] = s[++i];
            } else if (c == quote) {
                quote = 0;
            }
        } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v') {
            continue;
        } else {
            if (c == '\'' || c == '"') quote = c;
            o[j++] = c;
        }
    }
    o[j] = 0;
    return o;
}

int chat_template_init(const char *text, chat_template **out, char *err, size_t err_cap) {
    *out = NULL;
    if (!text) {
        err_set(err, err_cap,
                "the model has no chat template (no \"chat_template\" in "
                "tokenizer_config.json); use the completions API with a raw prompt");
        return -EINVAL;
    }
    char *a = ct_normalize(text), *b = ct_normalize(QWEN25_TEMPLATE);
    int rc = 0;
    if (!a || !b) {
        rc = -ENOMEM;
    } else if (strcmp(a, b) != 0) {
        err_set(err, err_cap,
                "unsupported chat template (%zu bytes, starting \"%.60s\"): only the "
                "Qwen2.5 Instruct ChatML template is rendered natively; use the completions "
                "API with a prompt formatted by the client",
                strlen(text), text);
        rc = -ENOTSUP;
    }
    free(a);
    free(b);
    if (rc) return rc;
    chat_template *ct = calloc(1, sizeof(*ct));
    if (!ct) return -ENOMEM;
    ct->kind = CHAT_TEMPLATE_QWEN25;
    *out = ct;
    return 0;
}

void chat_template_free(chat_template *ct) {
    free(ct);
}
chat_template_kind chat_template_get_kind(const chat_template *ct) {
    return ct->kind;
}

/* ======================================================================
 * tojson: Python json.dumps(x, ensure_ascii=False)
 * ====================================================================== */

static void ct_json_string(ct_buf *b, const char *s, size_t n) {
    ct_put(b, "\"", 1);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char tmp[8];
        if (c == '"')
            esc = "\\\"";
        else if (c == '\\')
            esc = "\\\\";
        else if (c == '\n')
            esc = "\\n";
        else if (c == '\r')
            esc = "\\r";
        else if (c == '\t')
            esc = "\\t";
        else if (c == '\b')
            esc = "\\b";
        else if (c == '\f')
            esc = "\\f";
        else if (c < 0x20) {
            snprintf(tmp, sizeof(tmp), "\\u%04x", c);
            esc = tmp;
        }
        if (!esc) continue;
        ct_put(b, s + run, i - run);
        ct_puts(b, esc);
        run = i + 1;
    }
    ct_put(b, s + run, n - run);
    ct_put(b, "\"", 1);
}

/* Python repr(float): the shortest digits that round-trip; fixed notation
 * when the decimal exponent is in [-4, 16), else d.ddde+XX. */
static void ct_json_real(ct_buf *b, double v) {
    if (isnan(v)) {
        ct_puts(b, "NaN");
        return;
    }
    if (isinf(v)) {
        ct_puts(b, v > 0 ? "Infinity" : "-Infinity");
        return;
    }
    char e[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof(e), "%.*e", prec - 1, v);
        if (strtod(e, NULL) == v) break;
    }
    /* e = [-]d[.ddd]e[+-]XX */
    const char *p = e;
    bool neg = *p == '-';
    if (neg) p++;
    char digits[24];
    size_t nd = 0;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    char out[64];
    size_t j = 0;
    if (neg) out[j++] = '-';
    if (exp >= -4 && exp < 16) {
        if (exp < 0) {
            out[j++] = '0';
            out[j++] = '.';
            for (int k = 0; k < -exp - 1; k++)
                out[j++] = '0';
            for (size_t k = 0; k < nd; k++)
                out[j++] = digits[k];
        } else {
            for (int k = 0; k <= exp; k++)
                out[j++] = (size_t)k < nd ? digits[k] : '0';
            out[j++] = '.';
            if ((size_t)exp + 1 < nd)
                for (size_t k = (size_t)exp + 1; k < nd; k++)
                    out[j++] = digits[k];
            else
                out[j++] = '0';
        }
        out[j] = 0;
    } else {
        out[j++] = digits[0];
        if (nd > 1) {
            out[j++] = '.';
            for (size_t k = 1; k < nd; k++)
                out[j++] = digits[k];
        }
        snprintf(out + j, sizeof(out) - j, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    }
    ct_puts(b, out);
}

static void ct_json(ct_buf *b, const json_t *x) {
    char tmp[32];
    switch (json_typeof(x)) {
    case JSON_NULL:
        ct_puts(b, "null");
        break;
    case JSON_TRUE:
        ct_puts(b, "true");
        break;
    case JSON_FALSE:
        ct_puts(b, "false");
        break;
    case JSON_INTEGER:
        snprintf(tmp, sizeof(tmp), "%" JSON_INTEGER_FORMAT, json_integer_value(x));
        ct_puts(b, tmp);
        break;
    case JSON_REAL:
        ct_json_real(b, json_real_value(x));
        break;
    case JSON_STRING:
        ct_json_string(b, json_string_value(x), json_string_length(x));
        break;
    case JSON_ARRAY: {
        ct_put(b, "[", 1);
        size_t i;
        json_t *v;
        json_array_foreach(x, i, v) {
            if (i) ct_put(b, ", ", 2);
            ct_json(b, v);
        }
        ct_put(b, "]", 1);
        break;
    }
    case JSON_OBJECT: {
        ct_put(b, "{", 1);
        const char *k;
        size_t klen;
        json_t *v;
        bool first = true;
        void *tmpit;
        json_object_keylen_foreach_safe((json_t *)x, tmpit, k, klen, v) {
            if (!first) ct_put(b, ", ", 2);
            first = false;
            ct_json_string(b, k, klen);
            ct_put(b, ": ", 2);
            ct_json(b, v);
        }
        ct_put(b, "}", 1);
        break;
    }
    }
}

int chat_template_tojson(const json_t *x, char **text_out, size_t *len_out) {
    ct_buf b = {0};
    ct_json(&b, x);
    ct_put(&b, "", 0);
    if (b.oom) {
        free(b.v);
        return -ENOMEM;
    }
    *text_out = b.v;
    if (len_out) *len_out = b.n;
    return 0;
}

/* ======================================================================
 * Qwen2.5 rendering
 * ====================================================================== */

typedef struct ct_msg {
    const char *role; /* "system", "user", "assistant" or "tool" */
    char *content;    /* text content (parts joined), malloc'ed */
    size_t content_len;
    const json_t *tool_calls; /* non-empty array or NULL */
} ct_msg;

/* Content as text: string, null / missing (""), or a list of text parts
 * joined with "\n". */
static int ct_content_text(const json_t *m, size_t idx, char **out, size_t *len, char *err,
                           size_t cap) {
    const json_t *c = json_object_get(m, "content");
    ct_buf b = {0};
    ct_put(&b, "", 0);
    if (!c || json_is_null(c)) {
        /* empty */
    } else if (json_is_string(c)) {
        ct_put(&b, json_string_value(c), json_string_length(c));
    } else if (json_is_array(c)) {
        size_t i, n = 0;
        json_t *p;
        json_array_foreach(c, i, p) {
            const char *type = json_string_value(json_object_get(p, "type"));
            json_t *t = json_object_get(p, "text");
            if (!type || strcmp(type, "text") != 0 || !json_is_string(t)) {
                err_set(err, cap,
                        "messages[%zu].content[%zu]: unsupported content part (type \"%s\"); "
                        "accepted: {\"type\": \"text\", \"text\": string}",
                        idx, i, type ? type : "(missing)");
                free(b.v);
                return -EINVAL;
            }
            if (n++) ct_put(&b, "\n", 1);
            ct_put(&b, json_string_value(t), json_string_length(t));
        }
    } else {
        err_set(err, cap, "messages[%zu].content must be a string, null or a list of text parts",
                idx);
        free(b.v);
        return -EINVAL;
    }
    if (b.oom) {
        free(b.v);
        return -ENOMEM;
    }
    *out = b.v;
    *len = b.n;
    return 0;
}

static int ct_collect(const json_t *messages, ct_msg **out, size_t *n_out, char *err, size_t cap) {
    if (!json_is_array(messages) || json_array_size(messages) == 0) {
        err_set(err, cap, "messages must be a non-empty array of message objects");
        return -EINVAL;
    }
    size_t n = json_array_size(messages);
    ct_msg *ms = calloc(n, sizeof(*ms));
    if (!ms) return -ENOMEM;
    *out = ms;
    *n_out = n;
    for (size_t i = 0; i < n; i++) {
        const json_t *m = json_array_get(messages, i);
        if (!json_is_object(m)) {
            err_set(err, cap, "messages[%zu] is not an object", i);
            return -EINVAL;
        }
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!role || (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant") &&
                      strcmp(role, "tool"))) {
            err_set(err, cap,
                    "messages[%zu].role \"%s\" is not supported; accepted: system, user, "
                    "assistant, tool",
                    i, role ? role : "(missing)");
            return -EINVAL;
        }
        ms[i].role = role;
        int rc = ct_content_text(m, i, &ms[i].content, &ms[i].content_len, err, cap);
        if (rc) return rc;
        const json_t *tc = json_object_get(m, "tool_calls");
        if (tc && !json_is_null(tc) && !json_is_array(tc)) {
            err_set(err, cap, "messages[%zu].tool_calls must be an array", i);
            return -EINVAL;
        }
        if (json_array_size(tc) > 0) {
            if (strcmp(role, "assistant") != 0) {
                err_set(err, cap, "messages[%zu]: only assistant messages have tool_calls", i);
                return -EINVAL;
            }
            ms[i].tool_calls = tc;
        }
    }
    return 0;
}

static void ct_free_msgs(ct_msg *ms, size_t n) {
    for (size_t i = 0; ms && i < n; i++)
        free(ms[i].content);
    free(ms);
}

/* {%- for tool_call in message.tool_calls %} ... {%- endfor %} */
static int ct_tool_calls(ct_buf *b, const json_t *calls, size_t mi, bool parse_args, char *err,
                         size_t cap) {
    size_t i;
    json_t *tc;
    json_array_foreach(calls, i, tc) {
        /* {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %} */
        const json_t *f = json_object_get(tc, "function");
        if (f) tc = (json_t *)f;
        if (!json_is_object(tc)) {
            err_set(err, cap, "messages[%zu].tool_calls[%zu]%s is not an object", mi, i,
                    f ? ".function" : "");
            return -EINVAL;
        }
        const char *name = json_string_value(json_object_get(tc, "name"));
        if (!name) {
            err_set(err, cap, "messages[%zu].tool_calls[%zu]: function name must be a string", mi,
                    i);
            return -EINVAL;
        }
        const json_t *args = json_object_get(tc, "arguments");
        json_t *parsed = NULL;
        if (parse_args && (!args || json_is_null(args) ||
                           (json_is_string(args) && json_string_length(args) == 0))) {
            parsed = json_object();
            args = parsed;
        } else if (parse_args && json_is_string(args)) {
            json_error_t je;
            parsed =
                json_loadb(json_string_value(args), json_string_length(args), JSON_DECODE_ANY, &je);
            if (!parsed) {
                err_set(err, cap,
                        "messages[%zu].tool_calls[%zu]: arguments is not valid JSON (%s at "
                        "column %d)",
                        mi, i, je.text, je.column);
                return -EINVAL;
            }
            args = parsed;
        } else if (!args) {
            err_set(err, cap, "messages[%zu].tool_calls[%zu]: arguments is missing", mi, i);
            return -EINVAL;
        }
        /* {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
         * {{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }} */
        ct_puts(b, "\n<tool_call>\n{\"name\": \"");
        ct_puts(b, name);
        ct_puts(b, "\", \"arguments\": ");
        ct_json(b, args);
        ct_puts(b, "}\n</tool_call>");
        json_decref(parsed);
    }
    return 0;
}

static int ct_render_qwen25(const json_t *messages, const json_t *tools,
                            const chat_template_opts *o, ct_buf *b, char *err, size_t cap) {
    if (tools && !json_is_null(tools) && !json_is_array(tools)) {
        err_set(err, cap, "tools must be an array of tool objects or null");
        return -EINVAL;
    }
    ct_msg *ms = NULL;
    size_t n = 0;
    int rc = ct_collect(messages, &ms, &n, err, cap);
    if (rc) {
        ct_free_msgs(ms, n);
        return rc;
    }
    bool first_system = strcmp(ms[0].role, "system") == 0;
    if (json_array_size(tools) > 0) { /* {%- if tools %} */
        ct_puts(b, "<|im_start|>system\n");
        if (first_system)
            ct_put(b, ms[0].content, ms[0].content_len);
        else
            ct_puts(b, QWEN25_DEFAULT_SYSTEM);
        ct_puts(b, "\n\n# Tools\n\nYou may call one or more functions to assist with the user "
                   "query.\n\nYou are provided with function signatures within <tools></tools> "
                   "XML tags:\n<tools>");
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) {
            ct_puts(b, "\n");
            ct_json(b, t); /* {{- tool | tojson }} */
        }
        ct_puts(b, "\n</tools>\n\nFor each function call, return a json object with function "
                   "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                   "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
                   "</tool_call><|im_end|>\n");
    } else if (first_system) {
        ct_puts(b, "<|im_start|>system\n");
        ct_put(b, ms[0].content, ms[0].content_len);
        ct_puts(b, "<|im_end|>\n");
    } else {
        ct_puts(b, "<|im_start|>system\n");
        ct_puts(b, QWEN25_DEFAULT_SYSTEM);
        ct_puts(b, "<|im_end|>\n");
    }
    for (size_t i = 0; i < n && !rc; i++) {
        const ct_msg *m = &ms[i];
        bool is_user = !strcmp(m->role, "user"), is_sys = !strcmp(m->role, "system"),
             is_asst = !strcmp(m->role, "assistant"), is_tool = !strcmp(m->role, "tool");
        if (is_user || (is_sys && i > 0) || (is_asst && !m->tool_calls)) {
            ct_puts(b, "<|im_start|>");
            ct_puts(b, m->role);
            ct_puts(b, "\n");
            ct_put(b, m->content, m->content_len);
            ct_puts(b, "<|im_end|>\n");
        } else if (is_asst) {
            ct_puts(b, "<|im_start|>assistant");
            if (m->content_len > 0) { /* {%- if message.content %} */
                ct_puts(b, "\n");
                ct_put(b, m->content, m->content_len);
            }
            rc = ct_tool_calls(b, m->tool_calls, i, o->parse_tool_arguments, err, cap);
            ct_puts(b, "<|im_end|>\n");
        } else if (is_tool) {
            if (i == 0 || strcmp(ms[i - 1].role, "tool") != 0) ct_puts(b, "<|im_start|>user");
            ct_puts(b, "\n<tool_response>\n");
            ct_put(b, m->content, m->content_len);
            ct_puts(b, "\n</tool_response>");
            if (i + 1 == n || strcmp(ms[i + 1].role, "tool") != 0) ct_puts(b, "<|im_end|>\n");
        }
    }
    if (!rc && o->add_generation_prompt) ct_puts(b, "<|im_start|>assistant\n");
    ct_free_msgs(ms, n);
    return rc;
}

int chat_template_render(const chat_template *ct, const json_t *messages, const json_t *tools,
                         const chat_template_opts *opts, char **text_out, size_t *len_out,
                         char *err, size_t err_cap) {
    *text_out = NULL;
    if (len_out) *len_out = 0;
    chat_template_opts def = {.add_generation_prompt = true};
    if (!opts) opts = &def;
    ct_buf b = {0};
    ct_put(&b, "", 0);
    int rc = ct_render_qwen25(messages, tools, opts, &b, err, err_cap);
    if (!rc && b.oom) rc = -ENOMEM;
    if (rc) {
        if (rc == -ENOMEM) err_set(err, err_cap, "chat template: out of memory");
        free(b.v);
        return rc;
    }
    *text_out = b.v;
    if (len_out) *len_out = b.n;
    return 0;
}
