/*
 * structured — the request forms of structured outputs, one grammar per request, and
 * the cache of compiled grammars (see structured.h).
 */
#include "server/structured.h"

#include "base/err.h"
#include "model/tokenizer.h"
#include "server/tool_parser.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CACHE_SLOTS 32

grammar_vocab *structured_vocab_new(const tokenizer *tok, int n_vocab) {
    int nt = tokenizer_vocab_size(tok);
    const uint8_t **bytes = calloc((size_t)n_vocab + 1, sizeof *bytes);
    size_t *lens = calloc((size_t)n_vocab + 1, sizeof *lens);
    uint8_t *special = calloc((size_t)n_vocab + 1, 1);
    grammar_vocab *v = NULL;
    if (bytes && lens && special) {
        for (int i = 0; i < n_vocab; i++) {
            if (i >= nt) {
                special[i] = 1;
                continue;
            }
            bytes[i] = tokenizer_token_bytes(tok, i, &lens[i]);
            special[i] = tokenizer_is_special(tok, i) || !bytes[i];
        }
        v = grammar_vocab_new(n_vocab, bytes, lens, special);
    }
    free(bytes);
    free(lens);
    free(special);
    return v;
}

typedef struct slot {
    char *key; /* kind byte + options byte + text */
    size_t key_len;
    grammar *g;
    unsigned long long used;
} slot;

struct structured_cache {
    pthread_mutex_t mu;
    const grammar_vocab *vocab;
    slot slots[CACHE_SLOTS];
    unsigned long long tick;
};

structured_cache *structured_cache_new(const grammar_vocab *vocab) {
    structured_cache *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    pthread_mutex_init(&c->mu, NULL);
    c->vocab = vocab;
    return c;
}

void structured_cache_free(structured_cache *c) {
    if (!c) return;
    for (int i = 0; i < CACHE_SLOTS; i++) {
        free(c->slots[i].key);
        grammar_unref(c->slots[i].g);
    }
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* The compiled grammar of (kind, text, ws), from the cache or compiled now. */
static grammar *cache_get(structured_cache *c, grammar_kind kind, const char *text, size_t len,
                          int any_ws, char *err, size_t errlen) {
    size_t kl = len + 2;
    char *key = malloc(kl);
    if (!key) return NULL;
    key[0] = (char)kind;
    key[1] = (char)any_ws;
    memcpy(key + 2, text, len);
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < CACHE_SLOTS; i++)
        if (c->slots[i].g && c->slots[i].key_len == kl && !memcmp(c->slots[i].key, key, kl)) {
            c->slots[i].used = ++c->tick;
            grammar *g = grammar_ref(c->slots[i].g);
            pthread_mutex_unlock(&c->mu);
            free(key);
            return g;
        }
    pthread_mutex_unlock(&c->mu);
    grammar_options opt = {.any_whitespace = any_ws};
    grammar *g = grammar_compile(kind, text, len, &opt, c->vocab, err, errlen);
    if (!g) {
        free(key);
        return NULL;
    }
    pthread_mutex_lock(&c->mu);
    int victim = 0;
    for (int i = 0; i < CACHE_SLOTS; i++) {
        if (!c->slots[i].g) {
            victim = i;
            break;
        }
        if (c->slots[i].used < c->slots[victim].used) victim = i;
    }
    slot *s = &c->slots[victim];
    free(s->key);
    grammar_unref(s->g);
    s->key = key;
    s->key_len = kl;
    s->g = grammar_ref(g);
    s->used = ++c->tick;
    pthread_mutex_unlock(&c->mu);
    return g;
}

/* A schema given as an object or as JSON text, as compact text (malloc'd). */
static char *schema_text(json_t *v) {
    if (json_is_string(v)) return strdup(json_string_value(v));
    if (json_is_object(v) || json_is_boolean(v))
        return json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    return NULL;
}

typedef struct want {
    grammar_kind kind;
    char *text; /* malloc'd */
    const char *field;
    int tools; /* tool calls (in the tool parser's format) */
} want;

static int set_want(want *w, grammar_kind kind, char *text, const char *field, char *err,
                    size_t errlen) {
    if (w->field) {
        free(text);
        return err_fail(err, errlen, -EINVAL,
                        "only one structured-output constraint may be given per request; got "
                        "'%s' and '%s'",
                        w->field, field);
    }
    w->kind = kind;
    w->text = text;
    w->field = field;
    return 0;
}

/* One constraint given as a vLLM StructuredOutputsParams-like object or a legacy field. */
static int from_field(want *w, const char *field, const char *what, json_t *v, char *err,
                      size_t errlen) {
    if (!v || json_is_null(v)) return 0;
    if (!strcmp(what, "json")) {
        char *t = schema_text(v);
        if (!t)
            return err_fail(err, errlen, -EINVAL,
                            "'%s' must be a JSON Schema (an object, or its JSON text)", field);
        return set_want(w, GRAMMAR_JSON_SCHEMA, t, field, err, errlen);
    }
    if (!strcmp(what, "regex") || !strcmp(what, "grammar")) {
        if (!json_is_string(v))
            return err_fail(err, errlen, -EINVAL, "'%s' must be a string", field);
        return set_want(w, !strcmp(what, "regex") ? GRAMMAR_REGEX : GRAMMAR_GBNF,
                        strdup(json_string_value(v)), field, err, errlen);
    }
    if (!strcmp(what, "choice")) {
        if (!json_is_array(v) || !json_array_size(v))
            return err_fail(err, errlen, -EINVAL, "'%s' must be a non-empty list of strings",
                            field);
        for (size_t i = 0; i < json_array_size(v); i++)
            if (!json_is_string(json_array_get(v, i)))
                return err_fail(err, errlen, -EINVAL,
                                "'%s' must be a list of strings; element %zu is not", field, i);
        return set_want(w, GRAMMAR_CHOICE, json_dumps(v, JSON_COMPACT), field, err, errlen);
    }
    if (!strcmp(what, "json_object")) {
        if (!json_is_boolean(v))
            return err_fail(err, errlen, -EINVAL, "'%s' must be true or false", field);
        if (json_is_false(v)) return 0;
        return set_want(w, GRAMMAR_JSON_OBJECT, strdup(""), field, err, errlen);
    }
    return 0;
}

/* GBNF of the literal text s: "..." with quotes and backslashes escaped; nothing for "". */
static void gbnf_literal(char *out, size_t cap, const char *s) {
    size_t n = 0;
    out[0] = 0;
    if (!*s) return;
    out[n++] = '"';
    for (; *s && n + 4 < cap; s++) {
        if (*s == '"' || *s == '\\') out[n++] = '\\';
        if (*s == '\n') {
            out[n++] = '\\';
            out[n++] = 'n';
            continue;
        }
        out[n++] = *s;
    }
    out[n++] = '"';
    out[n] = 0;
}

/* The tool-call grammar over tools (only the one named only, if given) in format f. */
static char *tools_gbnf(json_t *tools, const char *only, int any_ws,
                        const tool_call_grammar *fmt, char *err, size_t errlen) {
    size_t cap = 4096, n = 0;
    char *out = malloc(cap);
    if (!out) return NULL;
    out[0] = 0;
#define APPEND(str)                                                                                \
    do {                                                                                           \
        size_t l_ = strlen(str);                                                                   \
        while (n + l_ + 1 > cap) {                                                                 \
            cap *= 2;                                                                              \
            char *q_ = realloc(out, cap);                                                          \
            if (!q_) {                                                                             \
                free(out);                                                                         \
                return NULL;                                                                       \
            }                                                                                      \
            out = q_;                                                                              \
        }                                                                                          \
        memcpy(out + n, str, l_ + 1);                                                              \
        n += l_;                                                                                   \
    } while (0)
    char line[512];
    int next = 0, k = 0;
    char alts[8192] = "";
    for (size_t i = 0; i < json_array_size(tools); i++) {
        json_t *f = json_object_get(json_array_get(tools, i), "function");
        const char *name = json_string_value(json_object_get(f, "name"));
        if (!name || (only && strcmp(only, name))) continue;
        json_t *params = json_object_get(f, "parameters");
        char *schema = params && !json_is_null(params)
                           ? json_dumps(params, JSON_COMPACT | JSON_ENCODE_ANY)
                           : strdup("{\"type\":\"object\",\"additionalProperties\":true}");
        char rn[32];
        snprintf(rn, sizeof rn, "tool%d-args", k);
        char e2[400] = "";
        char *rules = grammar_json_schema_rules(schema, strlen(schema), any_ws, rn, k == 0, next,
                                                &next, e2, sizeof e2);
        free(schema);
        if (!rules) {
            err_set(err, errlen, "tools: the parameters of function '%s': %s", name, e2);
            free(out);
            return NULL;
        }
        APPEND(rules);
        free(rules);
        /* tool<k> ::= OPEN NAME MID tool<k>-args CLOSE, NAME a JSON string or bare */
        char *qn = NULL;
        if (fmt->quoted_name) {
            json_t *js = json_string(name);
            qn = json_dumps(js, JSON_ENCODE_ANY);
            json_decref(js);
        }
        size_t tl = strlen(fmt->open) + strlen(qn ? qn : name) + 1;
        char *text = malloc(tl), *lit = malloc(2 * tl + 8);
        if (!text || !lit) {
            free(qn);
            free(text);
            free(lit);
            free(out);
            return NULL;
        }
        snprintf(text, tl, "%s%s", fmt->open, qn ? qn : name);
        free(qn);
        gbnf_literal(lit, 2 * tl + 8, text);
        free(text);
        snprintf(line, sizeof line, "tool%d ::= ", k);
        APPEND(line);
        APPEND(lit);
        free(lit);
        char mid[128], close[128];
        gbnf_literal(mid, sizeof mid, fmt->mid);
        gbnf_literal(close, sizeof close, fmt->close);
        snprintf(line, sizeof line, " %s tool%d-args %s\n", mid, k, close);
        APPEND(line);
        size_t al = strlen(alts);
        snprintf(alts + al, sizeof alts - al, "%stool%d", k ? " | " : "", k);
        k++;
    }
    if (!k) {
        free(out);
        err_set(err, errlen, "tool_choice names the function '%s', which is not in 'tools'",
                only ? only : "");
        return NULL;
    }
    snprintf(line, sizeof line, "tool-call ::= %s\n", alts);
    APPEND(line);
    char before[128], sep[128], after[128];
    gbnf_literal(before, sizeof before, fmt->before);
    gbnf_literal(sep, sizeof sep, fmt->sep);
    gbnf_literal(after, sizeof after, fmt->after);
    if (only)
        snprintf(line, sizeof line, "root ::= %s tool-call %s\n", before, after);
    else
        snprintf(line, sizeof line, "root ::= %s tool-call (%s tool-call)* %s\n", before, sep, after);
    APPEND(line);
#undef APPEND
    return out;
}

int structured_from_request(structured_cache *c, json_t *body, int is_chat,
                            const tool_call_grammar *tool_fmt, grammar **out,
                            int *tool_call_format, char *err, size_t errlen) {
    *out = NULL;
    *tool_call_format = 0;
    want w = {0};
    int rc = 0;
    int any_ws = 1;
    json_t *so = json_object_get(body, "structured_outputs");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so))
            return err_fail(err, errlen, -EINVAL,
                            "'structured_outputs' must be an object with one of json, regex, "
                            "choice, grammar, json_object");
        static const char *const keys[] = {"json", "regex", "choice", "grammar", "json_object"};
        static const char *const names[] = {
            "structured_outputs.json", "structured_outputs.regex", "structured_outputs.choice",
            "structured_outputs.grammar", "structured_outputs.json_object"};
        for (int i = 0; i < 5 && !rc; i++)
            rc = from_field(&w, names[i], keys[i], json_object_get(so, keys[i]), err, errlen);
        if (json_is_true(json_object_get(so, "disable_any_whitespace"))) any_ws = 0;
    }
    /* vLLM's older spelling: guided_decoding_backend "xgrammar:disable-any-whitespace" */
    const char *be = json_string_value(json_object_get(body, "guided_decoding_backend"));
    if (be && strstr(be, "disable-any-whitespace")) any_ws = 0;
    static const char *const legacy[] = {"guided_json", "guided_regex", "guided_choice",
                                         "guided_grammar"};
    static const char *const lkind[] = {"json", "regex", "choice", "grammar"};
    for (int i = 0; i < 4 && !rc; i++)
        rc = from_field(&w, legacy[i], lkind[i], json_object_get(body, legacy[i]), err, errlen);
    json_t *rf = json_object_get(body, "response_format");
    if (!rc && rf && !json_is_null(rf)) {
        const char *t = json_string_value(json_object_get(rf, "type"));
        if (!json_is_object(rf) || !t)
            rc = err_fail(err, errlen, -EINVAL,
                          "'response_format' must be {\"type\": \"text\" | \"json_object\" | "
                          "\"json_schema\", ...}");
        else if (!strcmp(t, "json_object"))
            rc = set_want(&w, GRAMMAR_JSON_OBJECT, strdup(""), "response_format", err, errlen);
        else if (!strcmp(t, "json_schema")) {
            json_t *js = json_object_get(rf, "json_schema");
            json_t *sch = json_is_object(js) ? json_object_get(js, "schema") : NULL;
            if (!sch) sch = json_is_object(js) ? json_object_get(js, "json_schema") : NULL;
            char *txt = sch ? schema_text(sch) : NULL;
            if (!txt)
                rc = err_fail(err, errlen, -EINVAL,
                              "'response_format' json_schema needs \"json_schema\": {\"name\": "
                              "..., \"schema\": {...}}");
            else
                rc = set_want(&w, GRAMMAR_JSON_SCHEMA, txt, "response_format", err, errlen);
        } else if (strcmp(t, "text"))
            rc = err_fail(err, errlen, -EINVAL,
                          "'response_format' type '%s' is not supported; accepted: text, "
                          "json_object, json_schema",
                          t);
    }
    json_t *tc = json_object_get(body, "tool_choice"), *tools = json_object_get(body, "tools");
    if (!rc && json_is_string(tc) && !strcmp(json_string_value(tc), "required")) {
        if (!json_is_array(tools) || !json_array_size(tools))
            rc = err_fail(err, errlen, -EINVAL,
                          "tool_choice \"required\" needs a non-empty 'tools'");
        else {
            /* the arguments compact, as the hermes template writes them: ", " and ": " */
            char *g = tools_gbnf(tools, NULL, 0, tool_fmt, err, errlen);
            rc = g ? set_want(&w, GRAMMAR_GBNF, g, "tool_choice", err, errlen) : -EINVAL;
            w.tools = 1;
        }
    } else if (!rc && json_is_object(tc)) {
        const char *name =
            json_string_value(json_object_get(json_object_get(tc, "function"), "name"));
        if (!name)
            rc = err_fail(err, errlen, -EINVAL,
                          "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
                          "\"function\", \"function\": {\"name\": ...}}");
        else if (!json_is_array(tools))
            rc = err_fail(err, errlen, -EINVAL, "a named tool_choice needs 'tools'");
        else {
            char *g = tools_gbnf(tools, name, 0, tool_fmt, err, errlen);
            rc = g ? set_want(&w, GRAMMAR_GBNF, g, "tool_choice", err, errlen) : -EINVAL;
            w.tools = 1;
        }
    }
    (void)is_chat;
    if (!rc && w.field && !c)
        rc = err_fail(err, errlen, -EINVAL,
                      "structured outputs are unavailable: the vocabulary could not be built");
    if (!rc && w.field) {
        char e2[512] = "";
        *out = cache_get(c, w.kind, w.text, strlen(w.text), any_ws, e2, sizeof e2);
        if (!*out) {
            err_set(err, errlen, "%s: %s", w.field, e2);
            rc = -EINVAL;
        }
        *tool_call_format = w.tools && *out;
    }
    free(w.text);
    return rc;
}
