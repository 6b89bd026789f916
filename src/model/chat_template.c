/*
 * chat_template — native rendering of known chat templates (see
 * chat_template.h).  Recognition fingerprints the template text after
 * removing what cannot change Jinja's output (with transformers' settings
 * trim_blocks and lstrip_blocks): comments; whitespace between tags that a
 * "-" of the tag beside it, trim_blocks (one newline after a block tag) or
 * lstrip_blocks (indentation before a block tag) removes; inside tags,
 * whitespace except one space between two name characters.  String literals
 * and any text that reaches the output are kept verbatim, so a change to a
 * literal, an expression, a whitespace-control dash or printed text gives a
 * different fingerprint and is refused.  Qwen2.5 is rendered here, the other
 * families in chat_template_families.c; each renderer follows its template
 * statement by statement.
 */
#include "model/chat_template.h"
#include "model/chat_template_internal.h"

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
    const char *name;        /* its short name */
};

/* Fingerprints of the official templates (tests/data/chat_templates/). */
static const struct {
    uint64_t fp;
    chat_template_kind kind;
    const char *name;
} KNOWN[] = {
    {0x459bcd63a3a39c83ULL, CHAT_TEMPLATE_QWEN25, "qwen2.5"},   /* Qwen2.5-*-Instruct */
    {0x0cb9ec50d781dc91ULL, CHAT_TEMPLATE_QWEN3, "qwen3"},      /* Qwen3 (current revision) */
    {0xb0ecc192d1c41426ULL, CHAT_TEMPLATE_QWEN3, "qwen3"},      /* Qwen3 (first release) */
    {0x1d40505d9ab6f24eULL, CHAT_TEMPLATE_LLAMA31, "llama3.1"}, /* Llama 3.1 and 3.3 Instruct */
    {0xd58690cd89bada39ULL, CHAT_TEMPLATE_LLAMA32, "llama3.2"}, /* Llama 3.2 Instruct */
    {0xac42841821ca0ebdULL, CHAT_TEMPLATE_MISTRAL_V3,
     "mistral-v0.3"}, /* Mistral-7B-Instruct-v0.3 */
    {0xe3ef5b5e324fbd8fULL, CHAT_TEMPLATE_MISTRAL_NEMO,
     "mistral-nemo"}, /* Mistral-Nemo-Instruct-2407 */
    {0x65875616c7d31148ULL, CHAT_TEMPLATE_MISTRAL_SMALL,
     "mistral-small"}, /* Mistral-Small-24B-Instruct-2501 */
    {0xc2312a1bdd70c1adULL, CHAT_TEMPLATE_MISTRAL_SMALL,
     "mistral-small"}, /* Mistral-Small-3.1-24B-Instruct-2503 (tokenizer_config.json) */
};

static const char QWEN25_DEFAULT_SYSTEM[] =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

/* ======================================================================
 * string builder
 * ====================================================================== */

void chat_template_put(ct_buf *b, const char *s, size_t n) {
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

void chat_template_puts(ct_buf *b, const char *s) {
    chat_template_put(b, s, strlen(s));
}

/* ======================================================================
 * recognition
 * ====================================================================== */

static bool ct_ws(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
static bool ct_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

/* End of the tag opened at s[i] ("{{", "{%" or "{#"): the index just past
 * its closing "}}", "%}" or "#}", or n when unterminated. */
static size_t ct_tag_end(const char *s, size_t n, size_t i) {
    char close = s[i + 1] == '{' ? '}' : s[i + 1];
    char quote = 0;
    for (size_t k = i + 2; k < n; k++) {
        char c = s[k];
        if (close == '#') {
            if (c == '#' && k + 1 < n && s[k + 1] == '}') return k + 2;
        } else if (quote) {
            if (c == '\\' && k + 1 < n)
                k++;
            else if (c == quote)
                quote = 0;
        } else if (c == '\'' || c == '"') {
            quote = c;
        } else if (c == close && k + 1 < n && s[k + 1] == '}') {
            return k + 2;
        }
    }
    return n;
}

/* The normalised text described at the top of this file. */
static char *ct_normalize(const char *s) {
    size_t n = strlen(s);
    ct_buf o = {0};
    chat_template_put(&o, "", 0);
    size_t i = 0;
    bool prev_dash = false, prev_block = false, at_start = true;
    while (i < n) {
        /* data up to the next tag */
        size_t j = i;
        while (j < n && !(s[j] == '{' && j + 1 < n &&
                          (s[j + 1] == '{' || s[j + 1] == '%' || s[j + 1] == '#')))
            j++;
        size_t a = i, e = j;
        bool next_tag = j < n;
        bool next_dash = next_tag && j + 2 < n && s[j + 2] == '-';
        bool next_plus = next_tag && j + 2 < n && s[j + 2] == '+';
        bool next_block = next_tag && s[j + 1] != '{';
        if (prev_dash) {
            while (a < e && ct_ws(s[a]))
                a++;
        } else if (prev_block && a < e && s[a] == '\n') {
            a++;
        }
        if (next_dash) {
            while (e > a && ct_ws(s[e - 1]))
                e--;
        } else if (next_block && !next_plus) {
            size_t k = e;
            while (k > a && (s[k - 1] == ' ' || s[k - 1] == '\t'))
                k--;
            if ((k > a && s[k - 1] == '\n') || (k == a && (a > i || at_start))) e = k;
        }
        if (e > a) { /* printed text: kept verbatim, between markers */
            chat_template_put(&o, "\x01", 1);
            chat_template_put(&o, s + a, e - a);
            chat_template_put(&o, "\x01", 1);
        }
        at_start = false;
        if (!next_tag) break;
        size_t te = ct_tag_end(s, n, j);
        char kind = s[j + 1];
        prev_block = kind != '{';
        prev_dash = te - j >= 5 && s[te - 3] == '-';
        if (kind == '#') { /* a comment prints nothing */
            i = te;
            continue;
        }
        char quote = 0;
        char last = 0;
        for (size_t k = j; k < te; k++) {
            char c = s[k];
            if (quote) {
                chat_template_put(&o, &c, 1);
                if (c == '\\' && k + 1 < te) {
                    chat_template_put(&o, &s[++k], 1);
                } else if (c == quote) {
                    quote = 0;
                    last = c;
                }
            } else if (ct_ws(c)) {
                size_t m = k;
                while (m + 1 < te && ct_ws(s[m + 1]))
                    m++;
                if (ct_name_char(last) && m + 1 < te && ct_name_char(s[m + 1]))
                    chat_template_put(&o, " ", 1);
                k = m;
            } else {
                if (c == '\'' || c == '"') quote = c;
                chat_template_put(&o, &c, 1);
                last = c;
            }
        }
        i = te;
    }
    if (o.oom) {
        free(o.v);
        return NULL;
    }
    return o.v;
}

uint64_t chat_template_fingerprint(const char *text) {
    char *t = ct_normalize(text);
    if (!t) return 0;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (const unsigned char *p = (const unsigned char *)t; *p; p++) {
        h ^= *p;
        h *= 0x100000001b3ULL;
    }
    free(t);
    return h;
}

int chat_template_init(const char *text, chat_template **out, char *err, size_t err_cap) {
    *out = NULL;
    if (!text) {
        err_set(err, err_cap,
                "the model has no chat template (no \"chat_template\" in "
                "tokenizer_config.json); use the completions API with a raw prompt");
        return -EINVAL;
    }
    uint64_t fp = chat_template_fingerprint(text);
    if (fp == 0) return -ENOMEM;
    size_t k = 0;
    while (k < sizeof(KNOWN) / sizeof(KNOWN[0]) && KNOWN[k].fp != fp)
        k++;
    if (k == sizeof(KNOWN) / sizeof(KNOWN[0])) {
        err_set(err, err_cap,
                "unsupported chat template (%zu bytes, fingerprint %016llx, starting \"%.60s\"): "
                "the official templates of Qwen2.5, Qwen3, Llama 3.1/3.2/3.3 Instruct, "
                "Mistral 7B Instruct v0.3 and Mistral Nemo are rendered natively; use the "
                "completions API with a prompt formatted by the client",
                strlen(text), (unsigned long long)fp, text);
        return -ENOTSUP;
    }
    chat_template *ct = calloc(1, sizeof(*ct));
    if (!ct) return -ENOMEM;
    ct->kind = KNOWN[k].kind;
    ct->name = KNOWN[k].name;
    *out = ct;
    return 0;
}

void chat_template_free(chat_template *ct) {
    free(ct);
}
chat_template_kind chat_template_get_kind(const chat_template *ct) {
    return ct->kind;
}
const char *chat_template_name(const chat_template *ct) {
    return ct->name;
}

/* ======================================================================
 * tojson: Python json.dumps(x, ensure_ascii=False)
 * ====================================================================== */

static void ct_json_string(ct_buf *b, const char *s, size_t n) {
    chat_template_put(b, "\"", 1);
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
        chat_template_put(b, s + run, i - run);
        chat_template_puts(b, esc);
        run = i + 1;
    }
    chat_template_put(b, s + run, n - run);
    chat_template_put(b, "\"", 1);
}

/* Python repr(float): the shortest digits that round-trip; fixed notation
 * when the decimal exponent is in [-4, 16), else d.ddde+XX. */
static void ct_json_real(ct_buf *b, double v) {
    if (isnan(v)) {
        chat_template_puts(b, "NaN");
        return;
    }
    if (isinf(v)) {
        chat_template_puts(b, v > 0 ? "Infinity" : "-Infinity");
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
    chat_template_puts(b, out);
}

static void ct_indent(ct_buf *b, int indent, int depth) {
    chat_template_put(b, "\n", 1);
    for (int k = 0; k < indent * depth; k++)
        chat_template_put(b, " ", 1);
}

/* json.dumps: separators ", " / ": " without indent; "," + newline and
 * indentation with it (empty containers stay "[]" / "{}"). */
static void ct_json_at(ct_buf *b, const json_t *x, int indent, int depth) {
    char tmp[32];
    switch (json_typeof(x)) {
    case JSON_NULL:
        chat_template_puts(b, "null");
        break;
    case JSON_TRUE:
        chat_template_puts(b, "true");
        break;
    case JSON_FALSE:
        chat_template_puts(b, "false");
        break;
    case JSON_INTEGER:
        snprintf(tmp, sizeof(tmp), "%" JSON_INTEGER_FORMAT, json_integer_value(x));
        chat_template_puts(b, tmp);
        break;
    case JSON_REAL:
        ct_json_real(b, json_real_value(x));
        break;
    case JSON_STRING:
        ct_json_string(b, json_string_value(x), json_string_length(x));
        break;
    case JSON_ARRAY: {
        if (json_array_size(x) == 0) {
            chat_template_puts(b, "[]");
            break;
        }
        chat_template_put(b, "[", 1);
        size_t i;
        json_t *v;
        json_array_foreach(x, i, v) {
            if (i) chat_template_puts(b, indent >= 0 ? "," : ", ");
            if (indent >= 0) ct_indent(b, indent, depth + 1);
            ct_json_at(b, v, indent, depth + 1);
        }
        if (indent >= 0) ct_indent(b, indent, depth);
        chat_template_put(b, "]", 1);
        break;
    }
    case JSON_OBJECT: {
        if (json_object_size(x) == 0) {
            chat_template_puts(b, "{}");
            break;
        }
        chat_template_put(b, "{", 1);
        const char *k;
        size_t klen;
        json_t *v;
        bool first = true;
        void *tmpit;
        json_object_keylen_foreach_safe((json_t *)x, tmpit, k, klen, v) {
            if (!first) chat_template_puts(b, indent >= 0 ? "," : ", ");
            first = false;
            if (indent >= 0) ct_indent(b, indent, depth + 1);
            ct_json_string(b, k, klen);
            chat_template_put(b, ": ", 2);
            ct_json_at(b, v, indent, depth + 1);
        }
        if (indent >= 0) ct_indent(b, indent, depth);
        chat_template_put(b, "}", 1);
        break;
    }
    }
}

void chat_template_json(ct_buf *b, const json_t *x, int indent) {
    ct_json_at(b, x, indent, 0);
}

int chat_template_tojson(const json_t *x, char **text_out, size_t *len_out) {
    ct_buf b = {0};
    chat_template_json(&b, x, -1);
    chat_template_put(&b, "", 0);
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

/* Content as text: string, null / missing (""), or a list of text parts
 * joined with "\n". */
static int ct_content_text(const json_t *m, size_t idx, char **out, size_t *len, char *err,
                           size_t cap) {
    const json_t *c = json_object_get(m, "content");
    ct_buf b = {0};
    chat_template_put(&b, "", 0);
    if (!c || json_is_null(c)) {
        /* empty */
    } else if (json_is_string(c)) {
        chat_template_put(&b, json_string_value(c), json_string_length(c));
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
            if (n++) chat_template_put(&b, "\n", 1);
            chat_template_put(&b, json_string_value(t), json_string_length(t));
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

static const char *ct_opt_string(const json_t *m, const char *key, size_t idx, char *err,
                                 size_t cap, int *rc) {
    const json_t *v = json_object_get(m, key);
    if (!v || json_is_null(v)) return NULL;
    if (!json_is_string(v)) {
        err_set(err, cap, "messages[%zu].%s must be a string", idx, key);
        *rc = -EINVAL;
        return NULL;
    }
    return json_string_value(v);
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
        if (json_is_array(tc)) {
            if (strcmp(role, "assistant") != 0) {
                err_set(err, cap, "messages[%zu]: only assistant messages have tool_calls", i);
                return -EINVAL;
            }
            ms[i].tool_calls = tc;
        }
        ms[i].tool_call_id = ct_opt_string(m, "tool_call_id", i, err, cap, &rc);
        if (!rc) ms[i].name = ct_opt_string(m, "name", i, err, cap, &rc);
        const json_t *rcj = json_object_get(m, "reasoning_content");
        if (!rc && rcj && !json_is_null(rcj) && !json_is_string(rcj)) {
            err_set(err, cap, "messages[%zu].reasoning_content must be a string or null", i);
            rc = -EINVAL;
        }
        if (rc) return rc;
        if (json_is_string(rcj) && !strcmp(role, "assistant")) {
            ms[i].reasoning = json_string_value(rcj);
            ms[i].reasoning_len = json_string_length(rcj);
        }
    }
    return 0;
}

static void ct_free_msgs(ct_msg *ms, size_t n) {
    for (size_t i = 0; ms && i < n; i++)
        free(ms[i].content);
    free(ms);
}

int chat_template_tool_args(const json_t *fn, bool parse_args, size_t mi, size_t ci,
                            const json_t **args, json_t **owned, char *err, size_t cap) {
    *owned = NULL;
    const json_t *a = json_object_get(fn, "arguments");
    if (parse_args &&
        (!a || json_is_null(a) || (json_is_string(a) && json_string_length(a) == 0))) {
        *owned = json_object();
        if (!*owned) return -ENOMEM;
        a = *owned;
    } else if (parse_args && json_is_string(a)) {
        json_error_t je;
        *owned = json_loadb(json_string_value(a), json_string_length(a), JSON_DECODE_ANY, &je);
        if (!*owned) {
            err_set(err, cap,
                    "messages[%zu].tool_calls[%zu]: arguments is not valid JSON (%s at column %d)",
                    mi, ci, je.text, je.column);
            return -EINVAL;
        }
        a = *owned;
    } else if (!a) {
        err_set(err, cap, "messages[%zu].tool_calls[%zu]: arguments is missing", mi, ci);
        return -EINVAL;
    }
    *args = a;
    return 0;
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
        const json_t *args = NULL;
        json_t *parsed = NULL;
        int rc = chat_template_tool_args(tc, parse_args, mi, i, &args, &parsed, err, cap);
        if (rc) return rc;
        /* {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
         * {{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }} */
        chat_template_puts(b, "\n<tool_call>\n{\"name\": \"");
        chat_template_puts(b, name);
        chat_template_puts(b, "\", \"arguments\": ");
        chat_template_json(b, args, -1);
        chat_template_puts(b, "}\n</tool_call>");
        json_decref(parsed);
    }
    return 0;
}

static int ct_render_qwen25(const ct_msg *ms, size_t n, const json_t *tools,
                            const chat_template_opts *o, ct_buf *b, char *err, size_t cap) {
    int rc = 0;
    bool first_system = strcmp(ms[0].role, "system") == 0;
    if (json_array_size(tools) > 0) { /* {%- if tools %} */
        chat_template_puts(b, "<|im_start|>system\n");
        if (first_system)
            chat_template_put(b, ms[0].content, ms[0].content_len);
        else
            chat_template_puts(b, QWEN25_DEFAULT_SYSTEM);
        chat_template_puts(
            b, "\n\n# Tools\n\nYou may call one or more functions to assist with the user "
               "query.\n\nYou are provided with function signatures within <tools></tools> "
               "XML tags:\n<tools>");
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) {
            chat_template_puts(b, "\n");
            chat_template_json(b, t, -1); /* {{- tool | tojson }} */
        }
        chat_template_puts(
            b, "\n</tools>\n\nFor each function call, return a json object with function "
               "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
               "</tool_call><|im_end|>\n");
    } else if (first_system) {
        chat_template_puts(b, "<|im_start|>system\n");
        chat_template_put(b, ms[0].content, ms[0].content_len);
        chat_template_puts(b, "<|im_end|>\n");
    } else {
        chat_template_puts(b, "<|im_start|>system\n");
        chat_template_puts(b, QWEN25_DEFAULT_SYSTEM);
        chat_template_puts(b, "<|im_end|>\n");
    }
    for (size_t i = 0; i < n && !rc; i++) {
        const ct_msg *m = &ms[i];
        bool is_user = !strcmp(m->role, "user"), is_sys = !strcmp(m->role, "system"),
             is_asst = !strcmp(m->role, "assistant"), is_tool = !strcmp(m->role, "tool");
        bool calls = json_array_size(m->tool_calls) > 0;
        if (is_user || (is_sys && i > 0) || (is_asst && !calls)) {
            chat_template_puts(b, "<|im_start|>");
            chat_template_puts(b, m->role);
            chat_template_puts(b, "\n");
            chat_template_put(b, m->content, m->content_len);
            chat_template_puts(b, "<|im_end|>\n");
        } else if (is_asst) {
            chat_template_puts(b, "<|im_start|>assistant");
            if (m->content_len > 0) { /* {%- if message.content %} */
                chat_template_puts(b, "\n");
                chat_template_put(b, m->content, m->content_len);
            }
            rc = ct_tool_calls(b, m->tool_calls, i, o->parse_tool_arguments, err, cap);
            chat_template_puts(b, "<|im_end|>\n");
        } else if (is_tool) {
            if (i == 0 || strcmp(ms[i - 1].role, "tool") != 0)
                chat_template_puts(b, "<|im_start|>user");
            chat_template_puts(b, "\n<tool_response>\n");
            chat_template_put(b, m->content, m->content_len);
            chat_template_puts(b, "\n</tool_response>");
            if (i + 1 == n || strcmp(ms[i + 1].role, "tool") != 0)
                chat_template_puts(b, "<|im_end|>\n");
        }
    }
    if (!rc && o->add_generation_prompt) chat_template_puts(b, "<|im_start|>assistant\n");
    return rc;
}

int chat_template_render(const chat_template *ct, const json_t *messages, const json_t *tools,
                         const chat_template_opts *opts, char **text_out, size_t *len_out,
                         char *err, size_t err_cap) {
    *text_out = NULL;
    if (len_out) *len_out = 0;
    chat_template_opts def = {.add_generation_prompt = true};
    if (!opts) opts = &def;
    if (tools && json_is_null(tools)) tools = NULL;
    if (tools && !json_is_array(tools)) {
        err_set(err, err_cap, "tools must be an array of tool objects or null");
        return -EINVAL;
    }
    if (opts->kwargs && !json_is_null(opts->kwargs) && !json_is_object(opts->kwargs)) {
        err_set(err, err_cap, "chat_template_kwargs must be an object");
        return -EINVAL;
    }
    ct_msg *ms = NULL;
    size_t n = 0;
    int rc = ct_collect(messages, &ms, &n, err, err_cap);
    ct_buf b = {0};
    chat_template_put(&b, "", 0);
    if (!rc) {
        switch (ct->kind) {
        case CHAT_TEMPLATE_QWEN25:
            rc = ct_render_qwen25(ms, n, tools, opts, &b, err, err_cap);
            break;
        case CHAT_TEMPLATE_QWEN3:
            rc = chat_template_render_qwen3(ms, n, tools, opts, &b, err, err_cap);
            break;
        case CHAT_TEMPLATE_LLAMA31:
        case CHAT_TEMPLATE_LLAMA32:
            rc = chat_template_render_llama3(ms, n, tools, ct->kind == CHAT_TEMPLATE_LLAMA31, opts,
                                             &b, err, err_cap);
            break;
        case CHAT_TEMPLATE_MISTRAL_V3:
        case CHAT_TEMPLATE_MISTRAL_NEMO:
            rc = chat_template_render_mistral(ms, n, tools, ct->kind == CHAT_TEMPLATE_MISTRAL_V3,
                                              opts, &b, err, err_cap);
            break;
        case CHAT_TEMPLATE_MISTRAL_SMALL:
            rc = chat_template_render_mistral_small(ms, n, opts, &b, err, err_cap);
            break;
        }
    }
    ct_free_msgs(ms, n);
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
