/*
 * chat_template_families — native renderings of the Qwen3, Llama 3.x and
 * Mistral templates (see chat_template.h).  Each renderer follows its
 * template (the .jinja files of tests/data/chat_templates) statement by statement; the
 * comments quote the statements.  Where the template would raise (its
 * raise_exception, or a Jinja type error such as adding a non-string), the
 * render fails with -EINVAL and a message naming the message and field.
 */
#include "model/chat_template_internal.h"

#include "base/err.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ======================================================================
 * Python string helpers
 * ====================================================================== */

/* Decode the code point at s[i] (n bytes left); *len gets its size. */
static unsigned ct_cp(const unsigned char *s, size_t n, size_t *len) {
    unsigned c = s[0];
    size_t l = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (l > n) l = 1;
    unsigned v = l == 1 ? c : c & (0x7F >> l);
    for (size_t k = 1; k < l; k++)
        v = (v << 6) | (s[k] & 0x3F);
    *len = l;
    return v;
}

/* Python's str.isspace(). */
static bool ct_py_space(unsigned c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
           c == 0x202F || c == 0x205F || c == 0x3000;
}

void chat_template_py_strip(const char **sp, size_t *np, bool left, bool right) {
    const unsigned char *s = (const unsigned char *)*sp;
    size_t n = *np;
    while (left && n > 0) {
        size_t l;
        if (!ct_py_space(ct_cp(s, n, &l))) break;
        s += l;
        n -= l;
    }
    while (right && n > 0) {
        size_t k = n - 1; /* start of the last code point */
        while (k > 0 && (s[k] & 0xC0) == 0x80)
            k--;
        size_t l;
        if (!ct_py_space(ct_cp(s + k, n - k, &l)) || k + l != n) break;
        n = k;
    }
    *sp = (const char *)s;
    *np = n;
}

void chat_template_strip_char(const char **s, size_t *n, char c, bool left, bool right) {
    while (left && *n > 0 && (*s)[0] == c) {
        (*s)++;
        (*n)--;
    }
    while (right && *n > 0 && (*s)[*n - 1] == c)
        (*n)--;
}

bool chat_template_truthy(const json_t *x) {
    if (!x) return false;
    switch (json_typeof(x)) {
    case JSON_NULL:
    case JSON_FALSE:
        return false;
    case JSON_TRUE:
        return true;
    case JSON_INTEGER:
        return json_integer_value(x) != 0;
    case JSON_REAL:
        return json_real_value(x) != 0.0;
    case JSON_STRING:
        return json_string_length(x) > 0;
    case JSON_ARRAY:
        return json_array_size(x) > 0;
    case JSON_OBJECT:
        return json_object_size(x) > 0;
    }
    return false;
}

size_t chat_template_utf8_len(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) k++;
    return k;
}

static const char *ct_memstr(const char *h, size_t hn, const char *needle) {
    size_t nn = strlen(needle);
    if (nn > hn) return NULL;
    for (size_t i = 0; i + nn <= hn; i++)
        if (!memcmp(h + i, needle, nn)) return h + i;
    return NULL;
}

static const char *ct_memrstr(const char *h, size_t hn, const char *needle) {
    size_t nn = strlen(needle);
    if (nn > hn) return NULL;
    for (size_t i = hn - nn + 1; i-- > 0;)
        if (!memcmp(h + i, needle, nn)) return h + i;
    return NULL;
}

static bool ct_starts(const char *s, size_t n, const char *p) {
    size_t k = strlen(p);
    return n >= k && !memcmp(s, p, k);
}
static bool ct_ends(const char *s, size_t n, const char *p) {
    size_t k = strlen(p);
    return n >= k && !memcmp(s + n - k, p, k);
}

static const json_t *ct_kw(const chat_template_opts *o, const char *key) {
    return o->kwargs && json_is_object(o->kwargs) ? json_object_get(o->kwargs, key) : NULL;
}

/* ======================================================================
 * Qwen3
 * ====================================================================== */

/* The tool calls of an assistant message:
 *   {%- for tool_call in message.tool_calls %}
 *     {%- if (loop.first and content) or (not loop.first) %}{{- '\n' }}{%- endif %}
 *     {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
 *     {{- '<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
 *     {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
 *     {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
 *     {{- '}\n</tool_call>' }}
 *   {%- endfor %} */
static int ct_qwen3_calls(ct_buf *b, const ct_msg *m, size_t mi, size_t content_len,
                          const chat_template_opts *o, char *err, size_t cap) {
    size_t i;
    json_t *tc;
    json_array_foreach(m->tool_calls, i, tc) {
        if ((i == 0 && content_len > 0) || i > 0) chat_template_puts(b, "\n");
        const json_t *f = json_object_get(tc, "function");
        if (chat_template_truthy(f)) tc = (json_t *)f;
        if (!json_is_object(tc)) {
            err_set(err, cap, "messages[%zu].tool_calls[%zu] is not an object", mi, i);
            return -EINVAL;
        }
        const char *name = json_string_value(json_object_get(tc, "name"));
        if (!name) {
            err_set(err, cap, "messages[%zu].tool_calls[%zu]: function name must be a string", mi,
                    i);
            return -EINVAL;
        }
        const json_t *args = NULL;
        json_t *owned = NULL;
        int rc =
            chat_template_tool_args(tc, o->parse_tool_arguments, mi, i, &args, &owned, err, cap);
        if (rc) return rc;
        chat_template_puts(b, "<tool_call>\n{\"name\": \"");
        chat_template_puts(b, name);
        chat_template_puts(b, "\", \"arguments\": ");
        if (json_is_string(args))
            chat_template_put(b, json_string_value(args), json_string_length(args));
        else
            chat_template_json(b, args, -1);
        chat_template_puts(b, "}\n</tool_call>");
        json_decref(owned);
    }
    return 0;
}

int chat_template_render_qwen3(const ct_msg *ms, size_t n, const json_t *tools,
                               const chat_template_opts *o, ct_buf *b, char *err, size_t cap) {
    bool first_system = !strcmp(ms[0].role, "system");
    if (json_array_size(tools) > 0) { /* {%- if tools %} */
        chat_template_puts(b, "<|im_start|>system\n");
        if (first_system) {
            chat_template_put(b, ms[0].content, ms[0].content_len);
            chat_template_puts(b, "\n\n");
        }
        chat_template_puts(
            b, "# Tools\n\nYou may call one or more functions to assist with the user "
               "query.\n\nYou are provided with function signatures within <tools></tools> "
               "XML tags:\n<tools>");
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) {
            chat_template_puts(b, "\n");
            chat_template_json(b, t, -1);
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
    }
    /* ns.last_query_index: the last user message that is not a tool response */
    size_t last_query = n - 1;
    for (size_t k = n; k-- > 0;) {
        const ct_msg *m = &ms[k];
        if (!strcmp(m->role, "user") &&
            !(ct_starts(m->content, m->content_len, "<tool_response>") &&
              ct_ends(m->content, m->content_len, "</tool_response>"))) {
            last_query = k;
            break;
        }
    }
    for (size_t i = 0; i < n; i++) {
        const ct_msg *m = &ms[i];
        if (!strcmp(m->role, "user") || (!strcmp(m->role, "system") && i > 0)) {
            chat_template_puts(b, "<|im_start|>");
            chat_template_puts(b, m->role);
            chat_template_puts(b, "\n");
            chat_template_put(b, m->content, m->content_len);
            chat_template_puts(b, "<|im_end|>\n");
        } else if (!strcmp(m->role, "assistant")) {
            const char *content = m->content, *reasoning = "";
            size_t clen = m->content_len, rlen = 0;
            if (m->reasoning) {
                reasoning = m->reasoning;
                rlen = m->reasoning_len;
            } else if (ct_memstr(content, clen, "</think>")) {
                /* reasoning = content.split('</think>')[0].rstrip('\n')
                 *                    .split('<think>')[-1].lstrip('\n') */
                const char *end = ct_memstr(content, clen, "</think>");
                size_t r0 = (size_t)(end - content);
                const char *r = content;
                chat_template_strip_char(&r, &r0, '\n', false, true);
                const char *open = ct_memrstr(r, r0, "<think>");
                if (open) {
                    r0 -= (size_t)(open + 7 - r);
                    r = open + 7;
                }
                chat_template_strip_char(&r, &r0, '\n', true, false);
                reasoning = r;
                rlen = r0;
                /* content = content.split('</think>')[-1].lstrip('\n') */
                const char *last = ct_memrstr(content, clen, "</think>") + 8;
                clen -= (size_t)(last - content);
                content = last;
                chat_template_strip_char(&content, &clen, '\n', true, false);
            }
            chat_template_puts(b, "<|im_start|>assistant\n");
            if (i > last_query && (i + 1 == n || rlen > 0)) {
                const char *r = reasoning, *c = content;
                size_t rl = rlen, cl = clen;
                chat_template_strip_char(&r, &rl, '\n', true, true);
                chat_template_strip_char(&c, &cl, '\n', true, false);
                chat_template_puts(b, "<think>\n");
                chat_template_put(b, r, rl);
                chat_template_puts(b, "\n</think>\n\n");
                chat_template_put(b, c, cl);
            } else {
                chat_template_put(b, content, clen);
            }
            if (json_array_size(m->tool_calls) > 0) {
                int rc = ct_qwen3_calls(b, m, i, clen, o, err, cap);
                if (rc) return rc;
            }
            chat_template_puts(b, "<|im_end|>\n");
        } else if (!strcmp(m->role, "tool")) {
            if (i == 0 || strcmp(ms[i - 1].role, "tool")) chat_template_puts(b, "<|im_start|>user");
            chat_template_puts(b, "\n<tool_response>\n");
            chat_template_put(b, m->content, m->content_len);
            chat_template_puts(b, "\n</tool_response>");
            if (i + 1 == n || strcmp(ms[i + 1].role, "tool")) chat_template_puts(b, "<|im_end|>\n");
        }
    }
    if (o->add_generation_prompt) {
        chat_template_puts(b, "<|im_start|>assistant\n");
        /* {%- if enable_thinking is defined and enable_thinking is false %} */
        if (json_is_false(ct_kw(o, "enable_thinking")))
            chat_template_puts(b, "<think>\n\n</think>\n\n");
    }
    return 0;
}

/* ======================================================================
 * Llama 3.1 / 3.2 / 3.3
 * ====================================================================== */

static void ct_put_trim(ct_buf *b, const char *s, size_t n) {
    chat_template_py_strip(&s, &n, true, true);
    chat_template_put(b, s, n);
}

/* The tool definitions: {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }} */
static void ct_llama_tools(ct_buf *b, const json_t *tools) {
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        chat_template_json(b, t, 4);
        chat_template_puts(b, "\n\n");
    }
}

static const char LLAMA_FORMAT[] =
    "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name "
    "and its value}.Do not use variables.\n\n";

static bool ct_in_list(const json_t *list, const char *s) {
    size_t i;
    json_t *v;
    json_array_foreach(list, i,
                       v) if (json_is_string(v) && !strcmp(json_string_value(v), s)) return true;
    return false;
}

/* An assistant message with tool_calls (exactly one). */
static int ct_llama_call(ct_buf *b, const ct_msg *m, size_t mi, const json_t *builtin,
                         const chat_template_opts *o, char *err, size_t cap) {
    if (json_array_size(m->tool_calls) != 1) {
        err_set(err, cap,
                "chat template: This model only supports single tool-calls at once! "
                "(messages[%zu] has %zu)",
                mi, json_array_size(m->tool_calls));
        return -EINVAL;
    }
    /* {%- set tool_call = message.tool_calls[0].function %} */
    const json_t *fn = json_object_get(json_array_get(m->tool_calls, 0), "function");
    const char *name = json_string_value(json_object_get(fn, "name"));
    if (!json_is_object(fn) || !name) {
        err_set(err, cap,
                "messages[%zu].tool_calls[0].function must be an object with a string name", mi);
        return -EINVAL;
    }
    const json_t *args = NULL;
    json_t *owned = NULL;
    int rc = chat_template_tool_args(fn, o->parse_tool_arguments, mi, 0, &args, &owned, err, cap);
    if (rc) return rc;
    chat_template_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    if (builtin && ct_in_list(builtin, name)) {
        /* {{- "<|python_tag|>" + tool_call.name + ".call(" }} arg_name="arg_val", ... ")" */
        if (!json_is_object(args)) {
            err_set(err, cap,
                    "messages[%zu].tool_calls[0]: a builtin tool's arguments must be "
                    "an object",
                    mi);
            json_decref(owned);
            return -EINVAL;
        }
        chat_template_puts(b, "<|python_tag|>");
        chat_template_puts(b, name);
        chat_template_puts(b, ".call(");
        const char *k;
        json_t *v;
        size_t idx = 0, cnt = json_object_size(args);
        json_object_foreach((json_t *)args, k, v) {
            if (!json_is_string(v)) {
                err_set(err, cap,
                        "messages[%zu].tool_calls[0]: builtin tool argument \"%s\" must be a "
                        "string (the template concatenates it)",
                        mi, k);
                json_decref(owned);
                return -EINVAL;
            }
            chat_template_puts(b, k);
            chat_template_puts(b, "=\"");
            chat_template_put(b, json_string_value(v), json_string_length(v));
            chat_template_puts(b, "\"");
            if (++idx < cnt) chat_template_puts(b, ", ");
        }
        chat_template_puts(b, ")");
    } else {
        chat_template_puts(b, "{\"name\": \"");
        chat_template_puts(b, name);
        chat_template_puts(b, "\", \"parameters\": ");
        chat_template_json(b, args, -1);
        chat_template_puts(b, "}");
    }
    json_decref(owned);
    chat_template_puts(b, builtin ? "<|eom_id|>" : "<|eot_id|>");
    return 0;
}

int chat_template_render_llama3(const ct_msg *ms, size_t n, const json_t *tools, bool v31,
                                const chat_template_opts *o, ct_buf *b, char *err, size_t cap) {
    chat_template_puts(b, o->bos_token ? o->bos_token : "<|begin_of_text|>");
    /* {%- if custom_tools is defined %}{%- set tools = custom_tools %} */
    const json_t *custom = ct_kw(o, "custom_tools");
    if (custom) tools = json_is_null(custom) ? NULL : custom;
    if (tools && !json_is_array(tools)) {
        err_set(err, cap, "chat_template_kwargs.custom_tools must be a list of tools or null");
        return -EINVAL;
    }
    const json_t *tium = ct_kw(o, "tools_in_user_message");
    bool tools_in_user = tium ? chat_template_truthy(tium) : true;
    const json_t *ds = ct_kw(o, "date_string");
    char today[64];
    const char *date;
    if (ds) {
        if (!json_is_string(ds)) {
            err_set(err, cap,
                    "chat_template_kwargs.date_string must be a string (e.g. \"26 Jul "
                    "2024\")");
            return -EINVAL;
        }
        date = json_string_value(ds);
    } else if (v31) {
        date = "26 Jul 2024";
    } else { /* strftime_now("%d %b %Y"), as transformers defines it */
        chat_template_strftime_now(o, "%d %b %Y", today, sizeof today);
        date = today;
    }
    const json_t *builtin = v31 ? ct_kw(o, "builtin_tools") : NULL;
    if (builtin && !json_is_array(builtin)) {
        err_set(err, cap, "chat_template_kwargs.builtin_tools must be a list of tool names");
        return -EINVAL;
    }
    size_t i = 0;
    const char *sys = "";
    size_t sys_len = 0;
    if (!strcmp(ms[0].role, "system")) {
        sys = ms[0].content;
        sys_len = ms[0].content_len;
        i = 1;
    }
    chat_template_puts(b, "<|start_header_id|>system<|end_header_id|>\n\n");
    if (builtin || tools) chat_template_puts(b, "Environment: ipython\n");
    if (builtin) {
        /* "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") */
        chat_template_puts(b, "Tools: ");
        size_t k, shown = 0;
        json_t *v;
        json_array_foreach(builtin, k, v) {
            if (!json_is_string(v)) {
                err_set(err, cap, "chat_template_kwargs.builtin_tools[%zu] must be a string", k);
                return -EINVAL;
            }
            if (!strcmp(json_string_value(v), "code_interpreter")) continue;
            if (shown++) chat_template_puts(b, ", ");
            chat_template_puts(b, json_string_value(v));
        }
        chat_template_puts(b, "\n\n");
    }
    chat_template_puts(b, "Cutting Knowledge Date: December 2023\nToday Date: ");
    chat_template_puts(b, date);
    chat_template_puts(b, "\n\n");
    if (tools && !tools_in_user) {
        chat_template_puts(b,
                           "You have access to the following functions. To call a function, please "
                           "respond with JSON for a function call.");
        chat_template_puts(b, LLAMA_FORMAT);
        ct_llama_tools(b, tools);
    }
    ct_put_trim(b, sys, sys_len);
    chat_template_puts(b, "<|eot_id|>");
    if (tools_in_user && tools) {
        if (i >= n) {
            err_set(err, cap,
                    "chat template: Cannot put tools in the first user message when "
                    "there's no first user message!");
            return -EINVAL;
        }
        chat_template_puts(b, "<|start_header_id|>user<|end_header_id|>\n\n");
        chat_template_puts(
            b, "Given the following functions, please respond with a JSON for a function call "
               "with its proper arguments that best answers the given prompt.\n\n");
        chat_template_puts(b, LLAMA_FORMAT);
        ct_llama_tools(b, tools);
        ct_put_trim(b, ms[i].content, ms[i].content_len);
        chat_template_puts(b, "<|eot_id|>");
        i++;
    }
    for (; i < n; i++) {
        const ct_msg *m = &ms[i];
        bool is_tool = !strcmp(m->role, "tool");
        if (!(is_tool || m->tool_calls)) {
            chat_template_puts(b, "<|start_header_id|>");
            chat_template_puts(b, m->role);
            chat_template_puts(b, "<|end_header_id|>\n\n");
            ct_put_trim(b, m->content, m->content_len);
            chat_template_puts(b, "<|eot_id|>");
        } else if (m->tool_calls) {
            int rc = ct_llama_call(b, m, i, builtin, o, err, cap);
            if (rc) return rc;
        } else {
            /* a string is iterable: {{- message.content | tojson }} */
            chat_template_puts(b, "<|start_header_id|>ipython<|end_header_id|>\n\n");
            json_t *c = json_stringn(m->content, m->content_len);
            if (!c) return -ENOMEM;
            chat_template_json(b, c, -1);
            json_decref(c);
            chat_template_puts(b, "<|eot_id|>");
        }
    }
    if (o->add_generation_prompt)
        chat_template_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return 0;
}

/* ======================================================================
 * Mistral 7B Instruct v0.3 / Mistral Nemo
 * ====================================================================== */

static bool ct_same_msg(const ct_msg *a, const ct_msg *b) {
    return !strcmp(a->role, b->role) && a->content_len == b->content_len &&
           !memcmp(a->content, b->content, a->content_len) &&
           ((!a->name && !b->name) || (a->name && b->name && !strcmp(a->name, b->name)));
}

static int ct_mistral_id(const char *id, const char *field, size_t mi, char *err, size_t cap) {
    if (!id || chat_template_utf8_len(id, strlen(id)) != 9) {
        err_set(err, cap,
                "chat template: Tool call IDs should be alphanumeric strings with length 9! "
                "(messages[%zu].%s is %s%s%s)",
                mi, field, id ? "\"" : "", id ? id : "missing", id ? "\"" : "");
        return -EINVAL;
    }
    return 0;
}

static int ct_mistral_tools(ct_buf *b, const json_t *tools, bool v3, char *err, size_t cap) {
    chat_template_puts(b, v3 ? "[AVAILABLE_TOOLS] [" : "[AVAILABLE_TOOLS][");
    size_t i, nt = json_array_size(tools);
    json_t *t;
    json_array_foreach(tools, i, t) {
        const json_t *fn = json_object_get(t, "function"); /* {%- set tool = tool.function %} */
        if (!json_is_object(fn)) {
            err_set(err, cap, "tools[%zu].function must be an object", i);
            return -EINVAL;
        }
        chat_template_puts(b, "{\"type\": \"function\", \"function\": {");
        /* {%- for key, val in tool.items() if key != "return" %} */
        const char *k;
        json_t *v;
        size_t cnt = 0, idx = 0;
        json_object_foreach((json_t *)fn, k, v) cnt += strcmp(k, "return") != 0;
        json_object_foreach((json_t *)fn, k, v) {
            if (!strcmp(k, "return")) continue;
            chat_template_puts(b, "\"");
            chat_template_puts(b, k);
            if (json_is_string(v)) {
                chat_template_puts(b, "\": \"");
                chat_template_put(b, json_string_value(v), json_string_length(v));
                chat_template_puts(b, "\"");
            } else {
                chat_template_puts(b, "\": ");
                chat_template_json(b, v, -1);
            }
            if (++idx < cnt) chat_template_puts(b, ", ");
        }
        chat_template_puts(b, "}}");
        chat_template_puts(b, i + 1 < nt ? ", " : "]");
    }
    chat_template_puts(b, "[/AVAILABLE_TOOLS]");
    return 0;
}

int chat_template_render_mistral(const ct_msg *ms, size_t n, const json_t *tools, bool v3,
                                 const chat_template_opts *o, ct_buf *b, char *err, size_t cap) {
    const char *eos = o->eos_token ? o->eos_token : "</s>";
    size_t first = 0;
    const ct_msg *sys = NULL;
    if (!strcmp(ms[0].role, "system")) {
        sys = &ms[0];
        first = 1;
    }
    /* user_messages[-1]: the last user message */
    const ct_msg *last_user = NULL;
    for (size_t i = first; i < n; i++)
        if (!strcmp(ms[i].role, "user")) last_user = &ms[i];
    /* roles must alternate, skipping tool messages and tool calls */
    size_t idx = 0;
    for (size_t i = first; i < n; i++) {
        const ct_msg *m = &ms[i];
        if (!strcmp(m->role, "tool") || m->tool_calls) continue;
        if ((!strcmp(m->role, "user")) != (idx % 2 == 0)) {
            err_set(err, cap,
                    "chat template: After the optional system message, conversation roles must "
                    "alternate user/assistant/user/assistant/... (messages[%zu] is %s)",
                    i, m->role);
            return -EINVAL;
        }
        idx++;
    }
    chat_template_puts(b, o->bos_token ? o->bos_token : "<s>");
    for (size_t i = first; i < n; i++) {
        const ct_msg *m = &ms[i];
        if (!strcmp(m->role, "user")) {
            if (tools && ct_same_msg(m, last_user)) {
                int rc = ct_mistral_tools(b, tools, v3, err, cap);
                if (rc) return rc;
            }
            chat_template_puts(b, v3 ? "[INST] " : "[INST]");
            if (i + 1 == n && sys) {
                chat_template_put(b, sys->content, sys->content_len);
                chat_template_puts(b, "\n\n");
            }
            chat_template_put(b, m->content, m->content_len);
            chat_template_puts(b, "[/INST]");
        } else if (m->tool_calls) {
            chat_template_puts(b, v3 ? "[TOOL_CALLS] [" : "[TOOL_CALLS][");
            size_t k, nc = json_array_size(m->tool_calls);
            json_t *tc;
            json_array_foreach(m->tool_calls, k, tc) {
                /* {%- set out = tool_call.function|tojson %}{{- out[:-1] }} */
                const json_t *fn = json_object_get(tc, "function");
                if (!json_is_object(fn) || json_object_size(fn) == 0) {
                    err_set(err, cap, "messages[%zu].tool_calls[%zu].function must be an object", i,
                            k);
                    return -EINVAL;
                }
                const json_t *args = NULL;
                json_t *owned = NULL;
                int rc = chat_template_tool_args(fn, o->parse_tool_arguments, i, k, &args, &owned,
                                                 err, cap);
                if (rc) return rc;
                json_t *f2 = json_copy((json_t *)fn);
                if (!f2 || json_object_set(f2, "arguments", (json_t *)args)) {
                    json_decref(f2);
                    json_decref(owned);
                    return -ENOMEM;
                }
                ct_buf fb = {0};
                chat_template_json(&fb, f2, -1);
                json_decref(f2);
                json_decref(owned);
                if (fb.oom) {
                    free(fb.v);
                    return -ENOMEM;
                }
                chat_template_put(b, fb.v, fb.n - 1);
                free(fb.v);
                rc = ct_mistral_id(json_string_value(json_object_get(tc, "id")), "tool_calls[].id",
                                   i, err, cap);
                if (rc) return rc;
                chat_template_puts(b, ", \"id\": \"");
                chat_template_puts(b, json_string_value(json_object_get(tc, "id")));
                chat_template_puts(b, "\"}");
                if (k + 1 < nc) {
                    chat_template_puts(b, ", ");
                } else {
                    chat_template_puts(b, "]");
                    chat_template_puts(b, eos);
                }
            }
        } else if (!strcmp(m->role, "assistant")) {
            if (v3) {
                chat_template_puts(b, " ");
                ct_put_trim(b, m->content, m->content_len);
            } else {
                chat_template_put(b, m->content, m->content_len);
            }
            chat_template_puts(b, eos);
        } else if (!strcmp(m->role, "tool")) {
            chat_template_puts(b, v3 ? "[TOOL_RESULTS] {\"content\": "
                                     : "[TOOL_RESULTS]{\"content\": ");
            chat_template_put(b, m->content, m->content_len);
            chat_template_puts(b, ", ");
            int rc = ct_mistral_id(m->tool_call_id, "tool_call_id", i, err, cap);
            if (rc) return rc;
            chat_template_puts(b, "\"call_id\": \"");
            chat_template_puts(b, m->tool_call_id);
            chat_template_puts(b, "\"}[/TOOL_RESULTS]");
        } else {
            err_set(err, cap,
                    "chat template: Only user and assistant roles are supported, with the "
                    "exception of an initial optional system message! (messages[%zu] is %s)",
                    i, m->role);
            return -EINVAL;
        }
    }
    return 0;
}

void chat_template_strftime_now(const chat_template_opts *o, const char *fmt, char *out,
                                size_t cap) {
    time_t now = o->now ? (time_t)o->now : time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    if (!strftime(out, cap, fmt, &tm) && cap) out[0] = 0;
}

/* ======================================================================
 * Mistral-Small 3 / 3.1 (Mistral-Small-24B-Instruct-2501 and the
 * tokenizer_config.json template of Mistral-Small-3.1-24B-Instruct-2503; the
 * latter adds content-block handling that vLLM's string content never takes):
 *   {%- set today = strftime_now("%Y-%m-%d") %}
 *   {%- set default_system_message = "You are Mistral Small 3, ... The current date is " + today
 *       + ".\n\nWhen you're not sure ..." %}
 *   {{- bos_token }}
 *   {%- if messages[0]['role'] == 'system' %} system_message, loop_messages = messages[1:]
 *   {%- else %} the default, all messages {%- endif %}
 *   {{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}
 *   user: [INST]content[/INST]; system: [SYSTEM_PROMPT]content[/SYSTEM_PROMPT];
 *   assistant: content + eos_token; others: raise_exception(...)
 * No generation prompt, no tools (the template ignores both).
 * ====================================================================== */

static const char MISTRAL_SMALL_DEFAULT_1[] =
    "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French "
    "startup headquartered in Paris.\nYour knowledge base was last updated on 2023-10-01. The "
    "current date is ";
static const char MISTRAL_SMALL_DEFAULT_2[] =
    ".\n\nWhen you're not sure about some information, you say that you don't have the "
    "information and don't make up anything.\nIf the user's question is not clear, ambiguous, "
    "or does not provide enough context for you to accurately answer the question, you do not "
    "try to answer it right away and you rather ask the user to clarify their request (e.g. "
    "\"What are some good restaurants around me?\" => \"Where are you?\" or \"When is the next "
    "flight to Tokyo\" => \"Where do you travel from?\")";

int chat_template_render_mistral_small(const ct_msg *ms, size_t n, const chat_template_opts *o,
                                       ct_buf *b, char *err, size_t cap) {
    const char *eos = o->eos_token ? o->eos_token : "</s>";
    chat_template_puts(b, o->bos_token ? o->bos_token : "<s>");
    size_t first = 0;
    chat_template_puts(b, "[SYSTEM_PROMPT]");
    if (n > 0 && !strcmp(ms[0].role, "system")) {
        chat_template_put(b, ms[0].content, ms[0].content_len);
        first = 1;
    } else {
        char today[32];
        chat_template_strftime_now(o, "%Y-%m-%d", today, sizeof today);
        chat_template_puts(b, MISTRAL_SMALL_DEFAULT_1);
        chat_template_puts(b, today);
        chat_template_puts(b, MISTRAL_SMALL_DEFAULT_2);
    }
    chat_template_puts(b, "[/SYSTEM_PROMPT]");
    for (size_t i = first; i < n; i++) {
        const ct_msg *m = &ms[i];
        if (!strcmp(m->role, "user")) {
            chat_template_puts(b, "[INST]");
            chat_template_put(b, m->content, m->content_len);
            chat_template_puts(b, "[/INST]");
        } else if (!strcmp(m->role, "system")) {
            chat_template_puts(b, "[SYSTEM_PROMPT]");
            chat_template_put(b, m->content, m->content_len);
            chat_template_puts(b, "[/SYSTEM_PROMPT]");
        } else if (!strcmp(m->role, "assistant")) {
            chat_template_put(b, m->content, m->content_len);
            chat_template_puts(b, eos);
        } else {
            err_set(err, cap,
                    "chat template: Only user, system and assistant roles are supported! "
                    "(messages[%zu] is %s)",
                    i, m->role);
            return -EINVAL;
        }
    }
    return 0;
}
