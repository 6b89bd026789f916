/*
 * mistral_chat — mistral-common's chat encoding (see mistral_chat.h): read the
 * OpenAI messages, validate (MistralRequestValidator, test mode), normalize
 * (InstructRequestNormalizer / V7 / V13) and encode (InstructTokenizerV1..V13)
 * into ids.  The control-token ids come from the tokenizer, the version from
 * the mistral-common tokenizer file beside it.
 */
#include "model/mistral_chat.h"

#include "base/err.h"
#include "model/chat_template_internal.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MC_SYSTEM, MC_USER, MC_ASSISTANT, MC_TOOL };
static const char *const ROLE_NAMES[] = {"system", "user", "assistant", "tool"};

/* The control tokens a version uses, by mistral-common's SpecialTokens names. */
enum {
    T_INST,
    T_END_INST,
    T_TOOLS,
    T_END_TOOLS,
    T_RESULTS,
    T_END_RESULTS,
    T_CALLS,
    T_SYSTEM,
    T_END_SYSTEM,
    T_CONTENT,
    T_ARGS,
    T_CALL_ID,
    T_COUNT
};
static const char *const TOKEN_NAMES[T_COUNT] = {
    "[INST]",          "[/INST]",      "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[SYSTEM_PROMPT]",   "[/SYSTEM_PROMPT]",   "[TOOL_CONTENT]",
    "[ARGS]",          "[CALL_ID]"};

struct mistral_chat {
    const tokenizer *tok; /* encodes the text; outlives the handle */
    int version;          /* 1, 2, 3, 7, 11 or 13 */
    bool tekken;          /* tekken.json (else a SentencePiece tokenizer.model.vN) */
    char name[8];         /* "v3" */
    int32_t bos, eos;     /* the tokenizer's */
    int32_t t[T_COUNT];   /* control token ids; -1 where the version has none */
};

/* ---- the tokenizer file and its version ------------------------------- */

/* "tokenizer.model.v7" / "tokenizer.model.v7m1" -> 7; -1 when not that form */
static int spm_file_version(const char *name) {
    static const char P[] = "tokenizer.model.v";
    if (strncmp(name, P, sizeof P - 1)) return -1;
    const char *d = name + sizeof P - 1;
    if (*d < '0' || *d > '9') return -1;
    return atoi(d);
}

bool mistral_chat_find_file(const char *dir, char *path, size_t cap) {
    snprintf(path, cap, "%s/tekken.json", dir);
    FILE *f = fopen(path, "rb");
    if (f) {
        fclose(f);
        return true;
    }
    DIR *d = opendir(dir);
    if (!d) return false;
    int best = -1;
    char best_name[256] = "";
    struct dirent *e;
    while ((e = readdir(d))) {
        int v = spm_file_version(e->d_name);
        /* the highest version; of one version the shortest name (v7 before v7m1) */
        if (v > best || (v == best && v >= 0 && strlen(e->d_name) < strlen(best_name))) {
            if (strlen(e->d_name) >= sizeof best_name) continue;
            best = v;
            snprintf(best_name, sizeof best_name, "%s", e->d_name);
        }
    }
    closedir(d);
    if (best < 0) return false;
    snprintf(path, cap, "%s/%s", dir, best_name);
    return true;
}

bool mistral_chat_auto(const char *dir) {
    char path[4096];
    if (!mistral_chat_find_file(dir, path, sizeof path)) return false;
    DIR *d = opendir(dir);
    if (!d) return false;
    bool found = false;
    struct dirent *e;
    while (!found && (e = readdir(d))) {
        size_t n = strlen(e->d_name);
        found = !strncmp(e->d_name, "consolidated", 12) && n >= 12 + 12 &&
                !strcmp(e->d_name + n - 12, ".safetensors");
    }
    closedir(d);
    return found;
}

static bool version_ok(int v) {
    return v == 1 || v == 2 || v == 3 || v == 7 || v == 11 || v == 13;
}

int mistral_chat_open(const char *dir, const tokenizer *tok, mistral_chat **out, char *err,
                      size_t cap) {
    *out = NULL;
    char path[4096];
    if (!mistral_chat_find_file(dir, path, sizeof path)) {
        err_set(err, cap,
                "--tokenizer-mode mistral: %s has no mistral-common tokenizer file (tekken.json "
                "or tokenizer.model.v*)",
                dir);
        return -ENOENT;
    }
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    mistral_chat *mc = calloc(1, sizeof *mc);
    if (!mc) return -ENOMEM;
    mc->tok = tok;
    mc->tekken = !strcmp(base, "tekken.json");
    if (mc->tekken) {
        json_error_t je;
        json_t *root = json_load_file(path, JSON_ALLOW_NUL, &je);
        const json_t *v = json_object_get(json_object_get(root, "config"), "version");
        if (!root || !json_is_string(v) || json_string_value(v)[0] != 'v') {
            err_set(err, cap, "%s: %s", path,
                    root ? "no config.version string (\"v3\", \"v7\", ...)" : je.text);
            json_decref(root);
            free(mc);
            return -EINVAL;
        }
        mc->version = atoi(json_string_value(v) + 1);
        if (!version_ok(mc->version)) {
            err_set(err, cap,
                    "%s: tokenizer version \"%s\" is not supported; accepted: v1, v2, v3, v7, "
                    "v11, v13",
                    path, json_string_value(v));
            json_decref(root);
            free(mc);
            return -EINVAL;
        }
        json_decref(root);
    } else {
        mc->version = spm_file_version(base);
        if (!version_ok(mc->version)) {
            err_set(err, cap,
                    "%s: tokenizer version v%d is not supported; accepted: v1, v2, v3, v7 "
                    "(SentencePiece), v3, v7, v11, v13 (Tekken)",
                    path, mc->version);
            free(mc);
            return -EINVAL;
        }
        if (mc->version >= 11) {
            err_set(err, cap,
                    "%s: version v%d exists only as Tekken (tekken.json); accepted for "
                    "SentencePiece: v1, v2, v3, v7",
                    path, mc->version);
            free(mc);
            return -EINVAL;
        }
    }
    snprintf(mc->name, sizeof mc->name, "v%d", mc->version);
    mc->bos = tokenizer_bos_id(tok);
    mc->eos = tokenizer_eos_id(tok);
    if (mc->bos < 0) mc->bos = tokenizer_token_id(tok, "<s>");
    if (mc->eos < 0) mc->eos = tokenizer_token_id(tok, "</s>");
    if (mc->bos < 0 || mc->eos < 0) {
        err_set(err, cap, "--tokenizer-mode mistral: the tokenizer in %s has no %s token", dir,
                mc->bos < 0 ? "bos (<s>)" : "eos (</s>)");
        free(mc);
        return -EINVAL;
    }
    for (int k = 0; k < T_COUNT; k++) {
        mc->t[k] = -1;
        bool needed = mc->version >= 2 && k <= T_CALLS;
        needed |= mc->version >= 7 && k <= T_CONTENT;
        needed |= mc->version >= 11;
        if (!needed) continue;
        mc->t[k] = tokenizer_token_id(tok, TOKEN_NAMES[k]);
        if (mc->t[k] < 0) {
            err_set(err, cap,
                    "--tokenizer-mode mistral: %s says version %s but the tokenizer in %s has "
                    "no %s token",
                    base, mc->name, dir, TOKEN_NAMES[k]);
            free(mc);
            return -EINVAL;
        }
    }
    *out = mc;
    return 0;
}

void mistral_chat_free(mistral_chat *mc) {
    free(mc);
}

const char *mistral_chat_version(const mistral_chat *mc) {
    return mc->name;
}

bool mistral_chat_is_tekken(const mistral_chat *mc) {
    return mc->tekken;
}

/* ---- messages ---------------------------------------------------------- */

typedef struct mc_call {
    char *id;   /* as given, its last 9 characters when longer (vLLM) */
    char *name; /* function name */
    char *args; /* arguments normalized: json.dumps(json.loads(a)), "{}" when empty */
} mc_call;

typedef struct mc_msg {
    int role;         /* MC_* */
    ct_buf text;      /* content, its text parts joined with "\n\n" */
    mc_call *calls;   /* assistant: (n_calls) */
    size_t n_calls;   /* 0: none */
    bool has_calls;   /* tool_calls present and non-empty */
    const char *id;   /* tool: tool_call_id (in the request's JSON), truncated copy below */
    char *id_own;     /* tool: the id used */
    const char *name; /* tool: name or NULL */
    bool prefix;      /* assistant: continued (no eos) */
} mc_msg;

typedef struct mc_conv {
    mc_msg *m;  /* (n) */
    size_t n;   /* used */
    size_t cap; /* allocated */
} mc_conv;

static void mc_msg_free(mc_msg *m) {
    free(m->text.v);
    for (size_t k = 0; k < m->n_calls; k++) {
        free(m->calls[k].id);
        free(m->calls[k].name);
        free(m->calls[k].args);
    }
    free(m->calls);
    free(m->id_own);
}

static void mc_conv_free(mc_conv *c) {
    for (size_t i = 0; i < c->n; i++)
        mc_msg_free(&c->m[i]);
    free(c->m);
    c->m = NULL;
    c->n = c->cap = 0;
}

static mc_msg *mc_conv_push(mc_conv *c) {
    if (c->n == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 8;
        mc_msg *m = realloc(c->m, cap * sizeof *m);
        if (!m) return NULL;
        c->m = m;
        c->cap = cap;
    }
    mc_msg *m = &c->m[c->n++];
    memset(m, 0, sizeof *m);
    return m;
}

/* Append a non-empty piece of text, "\n\n" before it when text is not empty
 * (mistral-common's _aggregate_content_chunks: both separators are "\n\n"). */
static void mc_join(ct_buf *b, const char *s, size_t n) {
    if (!n) return;
    if (b->n) chat_template_puts(b, "\n\n");
    chat_template_put(b, s, n);
}

/* The content of messages[i]: a string, null, or an array of text parts. */
static int mc_content(const json_t *m, size_t i, ct_buf *b, char *err, size_t cap) {
    const json_t *c = json_object_get(m, "content");
    if (!c || json_is_null(c)) return 0;
    if (json_is_string(c)) {
        mc_join(b, json_string_value(c), json_string_length(c));
        return 0;
    }
    if (!json_is_array(c)) {
        err_set(err, cap, "messages[%zu].content must be a string, null or an array of text parts",
                i);
        return -EINVAL;
    }
    size_t k;
    const json_t *p;
    json_array_foreach(c, k, p) {
        const json_t *type = json_object_get(p, "type");
        const json_t *text = json_object_get(p, "text");
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") ||
            !json_is_string(text)) {
            err_set(err, cap,
                    "messages[%zu].content[%zu]: --tokenizer-mode mistral accepts only "
                    "{\"type\": \"text\", \"text\": ...} parts (got type %s)",
                    i, k, json_is_string(type) ? json_string_value(type) : "(none)");
            return -EINVAL;
        }
        mc_join(b, json_string_value(text), json_string_length(text));
    }
    return 0;
}

/* mistral-common's _normalize_json_content: empty -> "{}", valid JSON ->
 * json.dumps(json.loads(s), ensure_ascii=False), anything else unchanged. */
static char *mc_norm_json(const char *s, size_t n) {
    if (!s || !n) return strdup("{}");
    json_t *v = json_loadb(s, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    if (!v) return strndup(s, n);
    ct_buf b = {0};
    chat_template_json(&b, v, -1);
    json_decref(v);
    if (b.oom) {
        free(b.v);
        return NULL;
    }
    return b.v;
}

static bool mc_name_ok(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > 64) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-'))
            return false;
    }
    return true;
}

static bool mc_id_ok(const char *s) {
    if (strlen(s) != 9) return false;
    for (int i = 0; i < 9; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')))
            return false;
    }
    return true;
}

/* vLLM's truncate_tool_call_ids: an id longer than 9 keeps its last 9 characters. */
static char *mc_truncate_id(const char *id) {
    size_t n = strlen(id);
    return strdup(n > 9 ? id + n - 9 : id);
}

static int mc_read_calls(const mistral_chat *mc, const json_t *calls, size_t i, mc_msg *m,
                         char *err, size_t cap) {
    size_t nc = json_array_size(calls);
    m->calls = calloc(nc, sizeof *m->calls);
    if (!m->calls) return -ENOMEM;
    size_t k;
    const json_t *tc;
    json_array_foreach(calls, k, tc) {
        const json_t *fn = json_object_get(tc, "function");
        const json_t *name = json_object_get(fn, "name");
        const json_t *args = json_object_get(fn, "arguments");
        const json_t *id = json_object_get(tc, "id");
        if (!json_is_string(name)) {
            err_set(err, cap, "messages[%zu].tool_calls[%zu].function.name must be a string", i, k);
            return -EINVAL;
        }
        if (!mc_name_ok(json_string_value(name))) {
            err_set(err, cap,
                    "messages[%zu].tool_calls[%zu]: Function name was %s but must be a-z, A-Z, "
                    "0-9, or contain underscores and dashes, with a maximum length of 64.",
                    i, k, json_string_value(name));
            return -EINVAL;
        }
        if (!json_is_string(id) || !json_string_length(id)) {
            err_set(err, cap, "messages[%zu].tool_calls[%zu].id must be a non-empty string", i, k);
            return -EINVAL;
        }
        mc_call *c = &m->calls[m->n_calls++];
        c->id = mc_truncate_id(json_string_value(id));
        c->name = strdup(json_string_value(name));
        if (json_is_string(args)) {
            c->args = mc_norm_json(json_string_value(args), json_string_length(args));
        } else if (!args || json_is_null(args)) {
            c->args = strdup("{}");
        } else { /* an object where a string belongs: its JSON text */
            ct_buf b = {0};
            chat_template_json(&b, args, -1);
            c->args = b.v;
        }
        if (!c->id || !c->name || !c->args) return -ENOMEM;
        if (mc->version >= 3 && mc->version < 13 && !mc_id_ok(c->id)) {
            err_set(err, cap,
                    "messages[%zu].tool_calls[%zu]: Tool call id was %s but must be a-z, A-Z, "
                    "0-9, with a length of 9.",
                    i, k, c->id);
            return -EINVAL;
        }
    }
    m->has_calls = m->n_calls > 0;
    return 0;
}

/* Read the OpenAI messages as mistral-common's ChatCompletionRequest.from_openai
 * sees them, and validate them (MistralRequestValidator, test mode). */
static int mc_read(const mistral_chat *mc, const json_t *messages, mc_conv *raw, char *err,
                   size_t cap) {
    if (!json_is_array(messages) || json_array_size(messages) == 0) {
        err_set(err, cap, "messages: Conversation must have at least one message");
        return -EINVAL;
    }
    size_t n = json_array_size(messages), i;
    const json_t *jm;
    json_array_foreach(messages, i, jm) {
        const char *role = json_string_value(json_object_get(jm, "role"));
        int r = -1;
        for (int k = 0; role && k < 4; k++)
            if (!strcmp(role, ROLE_NAMES[k])) r = k;
        if (r < 0) {
            err_set(err, cap,
                    "messages[%zu].role %s%s%s is not accepted with --tokenizer-mode mistral; "
                    "accepted: system, user, assistant, tool",
                    i, role ? "\"" : "", role ? role : "(missing)", role ? "\"" : "");
            return -EINVAL;
        }
        mc_msg *m = mc_conv_push(raw);
        if (!m) return -ENOMEM;
        m->role = r;
        int rc = mc_content(jm, i, &m->text, err, cap);
        if (rc) return rc;
        if (m->text.oom) return -ENOMEM;
        if (r == MC_SYSTEM) {
            const json_t *c = json_object_get(jm, "content");
            if (!c || json_is_null(c)) {
                err_set(err, cap, "messages[%zu]: System prompt must have content", i);
                return -EINVAL;
            }
        }
        if (r == MC_ASSISTANT) {
            const json_t *calls = json_object_get(jm, "tool_calls");
            if (calls && !json_is_null(calls) && !json_is_array(calls)) {
                err_set(err, cap, "messages[%zu].tool_calls must be an array", i);
                return -EINVAL;
            }
            if (json_array_size(calls)) {
                rc = mc_read_calls(mc, calls, i, m, err, cap);
                if (rc) return rc;
            }
            if (mc->version < 7 && (m->text.n > 0) == m->has_calls) {
                err_set(err, cap,
                        "messages[%zu]: Assistant message must have either content or "
                        "tool_calls, but not both (tokenizer %s).",
                        i, mc->name);
                return -EINVAL;
            }
            m->prefix = i + 1 == n; /* vLLM continues a final assistant message */
        }
        if (r == MC_TOOL) {
            const json_t *id = json_object_get(jm, "tool_call_id");
            const json_t *name = json_object_get(jm, "name");
            if (json_is_string(name)) {
                m->name = json_string_value(name);
                if (!mc_name_ok(m->name)) {
                    err_set(err, cap,
                            "messages[%zu]: Function name was %s but must be a-z, A-Z, 0-9, or "
                            "contain underscores and dashes, with a maximum length of 64.",
                            i, m->name);
                    return -EINVAL;
                }
            }
            if (json_is_string(id)) {
                m->id_own = mc_truncate_id(json_string_value(id));
                if (!m->id_own) return -ENOMEM;
                m->id = m->id_own;
            }
            if (mc->version >= 3 && (!m->id || !m->id[0])) {
                err_set(err, cap, "messages[%zu]: Tool call id has to be defined.", i);
                return -EINVAL;
            }
            if (mc->version >= 3 && mc->version < 13 && !mc_id_ok(m->id)) {
                err_set(err, cap,
                        "messages[%zu]: Tool call id was %s but must be a-z, A-Z, 0-9, with a "
                        "length of 9.",
                        i, m->id);
                return -EINVAL;
            }
        }
    }
    /* structure: one message must be user or system; the order of roles */
    if (n == 1 && raw->m[0].role != MC_USER && raw->m[0].role != MC_SYSTEM) {
        err_set(err, cap,
                "messages: Conversation must start with a user message or system "
                "message");
        return -EINVAL;
    }
    static const unsigned NEXT[4] = {
        [MC_SYSTEM] = 1u << MC_USER | 1u << MC_ASSISTANT | 1u << MC_SYSTEM,
        [MC_USER] = 1u << MC_ASSISTANT | 1u << MC_SYSTEM | 1u << MC_USER,
        [MC_ASSISTANT] = 1u << MC_ASSISTANT | 1u << MC_USER | 1u << MC_TOOL,
        [MC_TOOL] = 1u << MC_ASSISTANT | 1u << MC_TOOL | 1u << MC_USER};
    for (i = 1; i < n; i++) {
        int p = raw->m[i - 1].role, r = raw->m[i].role;
        if (!(NEXT[p] & (1u << r))) {
            err_set(err, cap, "messages[%zu]: Unexpected role '%s' after role '%s'", i,
                    ROLE_NAMES[r], ROLE_NAMES[p]);
            return -EINVAL;
        }
    }
    for (i = 0; i < n && mc->version < 2; i++)
        if (raw->m[i].role == MC_TOOL || raw->m[i].has_calls) {
            err_set(err, cap, "messages[%zu]: Tools not implemented for tokenizer V1", i);
            return -EINVAL;
        }
    if (mc->version == 2) { /* InstructTokenizerV2._validate_tool_results */
        size_t last_user = 0;
        for (i = 0; i < n; i++)
            if (raw->m[i].role == MC_USER) last_user = i;
        bool call_turn = false;
        int results = 0;
        for (i = last_user; i < n; i++) {
            const mc_msg *m = &raw->m[i];
            if (m->role == MC_ASSISTANT) {
                call_turn = m->has_calls;
                results = 0;
            } else if (m->role == MC_TOOL) {
                if (call_turn && ++results > 1) {
                    err_set(err, cap,
                            "messages[%zu]: Tokenizer v2 does not support multiple tool results "
                            "for one assistant turn.",
                            i);
                    return -EINVAL;
                }
            } else {
                call_turn = false;
                results = 0;
            }
        }
    }
    /* every assistant's tool calls answered before the next assistant message */
    long expected = 0;
    for (i = 1; i < n; i++) {
        const mc_msg *m = &raw->m[i];
        if (m->role == MC_TOOL) {
            if (mc->version >= 11) {
                bool known = false;
                const mc_msg *a = NULL;
                /* mistral-common's loop skips the first message: its calls expect nothing */
                for (size_t j = i; j-- > 1;)
                    if (raw->m[j].role == MC_ASSISTANT) {
                        a = &raw->m[j];
                        break;
                    }
                for (size_t k = 0; a && k < a->n_calls; k++)
                    known |= !strcmp(a->calls[k].id, m->id);
                if (!known) {
                    err_set(err, cap, "messages[%zu]: Unexpected tool call id %s in tool results",
                            i, m->id);
                    return -EINVAL;
                }
                for (size_t j = i; j-- > 0 && raw->m[j].role == MC_TOOL;)
                    if (!strcmp(raw->m[j].id, m->id)) {
                        err_set(err, cap,
                                "messages[%zu]: Duplicate tool call id %s in tool results", i,
                                m->id);
                        return -EINVAL;
                    }
            }
            expected--;
        } else if (m->role == MC_ASSISTANT) {
            for (size_t k = 0; mc->version >= 11 && k < m->n_calls; k++)
                for (size_t q = 0; q < k; q++)
                    if (!strcmp(m->calls[q].id, m->calls[k].id)) {
                        err_set(err, cap,
                                "messages[%zu]: Duplicate tool call id %s in assistant message", i,
                                m->calls[k].id);
                        return -EINVAL;
                    }
            if (expected != 0) {
                err_set(err, cap,
                        "messages[%zu]: Not the same number of function calls and responses "
                        "before this assistant message",
                        i);
                return -EINVAL;
            }
            expected = (long)m->n_calls;
        }
    }
    return 0;
}

/* ---- normalization ----------------------------------------------------- */

/* One run of messages of one role [a, b) of raw, aggregated into out. */
static int mc_aggregate_run(const mistral_chat *mc, mc_conv *raw, size_t a, size_t b, mc_conv *out,
                            char ***latest, size_t *n_latest) {
    int role = raw->m[a].role;
    if (role == MC_SYSTEM) {
        if (mc->version < 7) return 0; /* joined into the system prompt */
        for (size_t i = a; i < b; i++) {
            mc_msg *m = mc_conv_push(out);
            if (!m) return -ENOMEM;
            m->role = MC_SYSTEM;
            chat_template_put(&m->text, raw->m[i].text.v ? raw->m[i].text.v : "", raw->m[i].text.n);
            if (m->text.oom) return -ENOMEM;
        }
        return 0;
    }
    if (role == MC_TOOL) {
        size_t first = out->n;
        for (size_t i = a; i < b; i++) {
            mc_msg *m = mc_conv_push(out);
            if (!m) return -ENOMEM;
            m->role = MC_TOOL;
            if (mc->version >= 7) { /* the V7 normalizer keeps the text as it is */
                chat_template_put(&m->text, raw->m[i].text.v ? raw->m[i].text.v : "",
                                  raw->m[i].text.n);
            } else { /* before: JSON re-serialized, empty as {} */
                char *j = mc_norm_json(raw->m[i].text.v, raw->m[i].text.n);
                if (!j) return -ENOMEM;
                chat_template_puts(&m->text, j);
                free(j);
            }
            if (m->text.oom) return -ENOMEM;
            m->name = raw->m[i].name;
            if (raw->m[i].id_own && !(m->id_own = strdup(raw->m[i].id_own))) return -ENOMEM;
            m->id = m->id_own;
        }
        if (mc->version >= 11) { /* v13's normalizer: results in the order of the calls */
            size_t cnt = out->n - first;
            for (size_t x = 1; x < cnt; x++) { /* stable insertion sort by call position */
                mc_msg t = out->m[first + x];
                size_t key = *n_latest;
                for (size_t k = 0; k < *n_latest; k++)
                    if (t.id && !strcmp((*latest)[k], t.id)) {
                        key = k;
                        break;
                    }
                size_t y = x;
                while (y > 0) {
                    const mc_msg *p = &out->m[first + y - 1];
                    size_t pk = *n_latest;
                    for (size_t k = 0; k < *n_latest; k++)
                        if (p->id && !strcmp((*latest)[k], p->id)) {
                            pk = k;
                            break;
                        }
                    if (pk <= key) break;
                    out->m[first + y] = out->m[first + y - 1];
                    y--;
                }
                out->m[first + y] = t;
            }
        }
        for (size_t k = 0; k < *n_latest; k++)
            free((*latest)[k]);
        *n_latest = 0;
        return 0;
    }
    mc_msg *m = mc_conv_push(out);
    if (!m) return -ENOMEM;
    m->role = role;
    for (size_t i = a; i < b; i++) {
        mc_msg *r = &raw->m[i];
        mc_join(&m->text, r->text.v, r->text.n);
        if (role != MC_ASSISTANT || !r->n_calls) continue;
        mc_call *c = realloc(m->calls, (m->n_calls + r->n_calls) * sizeof *c);
        if (!c) return -ENOMEM;
        m->calls = c;
        memcpy(m->calls + m->n_calls, r->calls, r->n_calls * sizeof *c);
        m->n_calls += r->n_calls;
        free(r->calls); /* moved */
        r->calls = NULL;
        r->n_calls = 0;
    }
    for (size_t i = a; i < b; i++)
        m->prefix |= raw->m[i].prefix;
    m->has_calls = m->n_calls > 0;
    if (m->text.oom) return -ENOMEM;
    if (role == MC_ASSISTANT && m->n_calls) {
        char **l = realloc(*latest, (*n_latest + m->n_calls) * sizeof *l);
        if (!l) return -ENOMEM;
        *latest = l;
        for (size_t k = 0; k < m->n_calls; k++)
            if (!(l[(*n_latest)++] = strdup(m->calls[k].id))) return -ENOMEM;
    }
    return 0;
}

static int mc_normalize(const mistral_chat *mc, mc_conv *raw, mc_conv *out, ct_buf *sys) {
    char **latest = NULL;
    size_t n_latest = 0;
    int rc = 0;
    for (size_t i = 0; i < raw->n && mc->version < 7; i++)
        if (raw->m[i].role == MC_SYSTEM && raw->m[i].text.n)
            mc_join(sys, raw->m[i].text.v, raw->m[i].text.n);
    size_t a = 0;
    for (size_t i = 1; i <= raw->n && !rc; i++) {
        if (i < raw->n && raw->m[i].role == raw->m[a].role) continue;
        rc = mc_aggregate_run(mc, raw, a, i, out, &latest, &n_latest);
        a = i;
    }
    for (size_t k = 0; k < n_latest; k++)
        free(latest[k]);
    free(latest);
    if (rc) return rc;
    if (out->n == 0 || (mc->version < 7 && out->m[0].role != MC_USER)) {
        if (!mc_conv_push(out)) return -ENOMEM;
        mc_msg t = out->m[out->n - 1];
        memmove(out->m + 1, out->m, (out->n - 1) * sizeof *out->m);
        out->m[0] = t;
        out->m[0].role = MC_USER;
    }
    return sys->oom ? -ENOMEM : 0;
}

/* ---- encoding ---------------------------------------------------------- */

typedef struct mc_ids {
    int32_t *v; /* (cap) */
    size_t n;   /* used */
    size_t cap; /* allocated */
} mc_ids;

static int mc_push(mc_ids *o, int32_t id) {
    if (o->n == o->cap) {
        size_t cap = o->cap ? 2 * o->cap : 256;
        int32_t *v = realloc(o->v, cap * sizeof *v);
        if (!v) return -ENOMEM;
        o->v = v;
        o->cap = cap;
    }
    o->v[o->n++] = id;
    return 0;
}

/* tokenizer.encode(text, bos=False, eos=False): no control token in text */
static int mc_text(const mistral_chat *mc, mc_ids *o, const char *s, size_t n, char *err,
                   size_t cap) {
    int32_t *ids = NULL;
    size_t k = 0;
    int rc = tokenizer_encode_plain(mc->tok, s ? s : "", s ? n : 0, &ids, &k, err, cap);
    for (size_t i = 0; !rc && i < k; i++)
        rc = mc_push(o, ids[i]);
    free(ids);
    return rc;
}

static int mc_json_text(const mistral_chat *mc, mc_ids *o, const json_t *x, char *err, size_t cap) {
    ct_buf b = {0};
    chat_template_json(&b, x, -1);
    int rc = b.oom ? -ENOMEM : mc_text(mc, o, b.v, b.n, err, cap);
    free(b.v);
    return rc;
}

/* mistral-common's _parse_json_content: the JSON value of s, else s as a string */
static json_t *mc_parse_json(const char *s) {
    json_t *v = json_loads(s, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    return v ? v : json_string(s);
}

/* [AVAILABLE_TOOLS] json.dumps([tool.model_dump(exclude strict)]) [/AVAILABLE_TOOLS] */
static int mc_tools(const mistral_chat *mc, mc_ids *o, const json_t *tools, char *err, size_t cap) {
    json_t *list = json_array();
    size_t i;
    const json_t *t;
    int rc = list ? 0 : -ENOMEM;
    json_array_foreach(tools, i, t) {
        const json_t *fn = json_object_get(t, "function");
        const json_t *name = json_object_get(fn, "name");
        const json_t *desc = json_object_get(fn, "description");
        const json_t *params = json_object_get(fn, "parameters");
        if (!json_is_string(name) || !mc_name_ok(json_string_value(name))) {
            err_set(err, cap,
                    "tools[%zu].function.name must be a string of a-z, A-Z, 0-9, underscores and "
                    "dashes, at most 64 long",
                    i);
            rc = -EINVAL;
            break;
        }
        if (desc && !json_is_null(desc) && !json_is_string(desc)) {
            err_set(err, cap, "tools[%zu].function.description must be a string", i);
            rc = -EINVAL;
            break;
        }
        if (params && !json_is_null(params) && !json_is_object(params)) {
            err_set(err, cap, "tools[%zu].function.parameters must be an object", i);
            rc = -EINVAL;
            break;
        }
        json_t *f = json_object();
        json_object_set(f, "name", (json_t *)name);
        json_object_set_new(f, "description",
                            json_is_string(desc) ? json_copy((json_t *)desc) : json_string(""));
        json_object_set_new(f, "parameters",
                            json_is_object(params) ? json_deep_copy(params) : json_object());
        json_t *tool = json_object();
        json_object_set_new(tool, "type", json_string("function"));
        json_object_set_new(tool, "function", f);
        json_array_append_new(list, tool);
    }
    if (!rc && !(rc = mc_push(o, mc->t[T_TOOLS])) && !(rc = mc_json_text(mc, o, list, err, cap)))
        rc = mc_push(o, mc->t[T_END_TOOLS]);
    json_decref(list);
    return rc;
}

/* {"name", "arguments"[, "id"]} of a call (_prepare_function_call) */
static json_t *mc_call_json(const mistral_chat *mc, const mc_call *c) {
    json_t *o = json_object();
    json_object_set_new(o, "name", json_string(c->name));
    json_object_set_new(o, "arguments", mc_parse_json(c->args));
    if (mc->version >= 3 && strcmp(c->id, "null")) json_object_set_new(o, "id", json_string(c->id));
    return o;
}

static int mc_calls(const mistral_chat *mc, mc_ids *o, const mc_msg *m, char *err, size_t cap) {
    int rc = 0;
    if (mc->version < 11) { /* [TOOL_CALLS] json.dumps([calls]) */
        json_t *list = json_array();
        for (size_t k = 0; k < m->n_calls; k++)
            json_array_append_new(list, mc_call_json(mc, &m->calls[k]));
        if (!(rc = mc_push(o, mc->t[T_CALLS]))) rc = mc_json_text(mc, o, list, err, cap);
        json_decref(list);
        return rc;
    }
    for (size_t k = 0; k < m->n_calls && !rc; k++) { /* [TOOL_CALLS]name[CALL_ID]id[ARGS]{...} */
        const mc_call *c = &m->calls[k];
        rc = mc_push(o, mc->t[T_CALLS]);
        if (!rc) rc = mc_text(mc, o, c->name, strlen(c->name), err, cap);
        if (!rc && mc->version == 11 && strcmp(c->id, "null")) {
            rc = mc_push(o, mc->t[T_CALL_ID]);
            if (!rc) rc = mc_text(mc, o, c->id, strlen(c->id), err, cap);
        }
        if (!rc) rc = mc_push(o, mc->t[T_ARGS]);
        if (!rc) {
            json_t *args = mc_parse_json(c->args);
            rc = mc_json_text(mc, o, args, err, cap);
            json_decref(args);
        }
    }
    return rc;
}

static int mc_user(const mistral_chat *mc, mc_ids *o, const mc_msg *m, const json_t *tools,
                   bool first, bool last, const ct_buf *sys, char *err, size_t cap) {
    int rc = 0;
    const char *s = m->text.v ? m->text.v : "";
    size_t n = m->text.n;
    if (mc->version == 1) { /* "[INST] {system\n\n}{content} [/INST]" as text */
        ct_buf b = {0};
        chat_template_puts(&b, "[INST] ");
        if (first && sys->n) {
            chat_template_put(&b, sys->v, sys->n);
            chat_template_puts(&b, "\n\n");
        }
        chat_template_put(&b, s, n);
        chat_template_puts(&b, " [/INST]");
        rc = b.oom ? -ENOMEM : mc_text(mc, o, b.v, b.n, err, cap);
        free(b.v);
        return rc;
    }
    bool at = mc->version >= 13 ? first : last;
    if (at && json_array_size(tools)) rc = mc_tools(mc, o, tools, err, cap);
    if (!rc) rc = mc_push(o, mc->t[T_INST]);
    if (!rc && last && sys->n && mc->version < 7) { /* the system prompt, then "\n\n" */
        ct_buf b = {0};
        chat_template_put(&b, sys->v, sys->n);
        chat_template_puts(&b, "\n\n");
        chat_template_put(&b, s, n);
        rc = b.oom ? -ENOMEM : mc_text(mc, o, b.v, b.n, err, cap);
        free(b.v);
    } else if (!rc) {
        rc = mc_text(mc, o, s, n, err, cap);
    }
    if (!rc) rc = mc_push(o, mc->t[T_END_INST]);
    return rc;
}

static int mc_assistant(const mistral_chat *mc, mc_ids *o, const mc_msg *m, bool before_last_user,
                        char *err, size_t cap) {
    int rc = 0;
    size_t n = m->text.n;
    if (mc->version >= 2) /* content.rstrip(" ") */
        while (n && m->text.v[n - 1] == ' ')
            n--;
    /* after the merge of consecutive assistant messages (InstructTokenizerV2 / V7) */
    if (mc->version < 7 && m->has_calls && m->text.n) {
        err_set(err, cap,
                "Cannot have tool calls and content defined in the same assistant message (the "
                "merge of consecutive assistant messages; tokenizer %s)",
                mc->name);
        return -EINVAL;
    }
    if (!m->has_calls && !m->text.n) {
        err_set(err, cap, "Invalid assistant message: no content and no tool_calls");
        return -EINVAL;
    }
    if (mc->version == 2 && m->has_calls && before_last_user) return 0; /* history dropped */
    if (m->text.n) rc = mc_text(mc, o, m->text.v, n, err, cap);
    if (!rc && m->has_calls) rc = mc_calls(mc, o, m, err, cap);
    if (!rc && !m->prefix) rc = mc_push(o, mc->eos);
    return rc;
}

static int mc_tool(const mistral_chat *mc, mc_ids *o, const mc_msg *m, bool before_last_user,
                   char *err, size_t cap) {
    int rc = 0;
    const char *s = m->text.v ? m->text.v : "";
    if (mc->version == 2 && before_last_user) return 0;
    if (mc->version >= 7) {
        rc = mc_push(o, mc->t[T_RESULTS]);
        if (!rc && mc->version < 13) {
            rc = mc_text(mc, o, m->id, strlen(m->id), err, cap);
            if (!rc) rc = mc_push(o, mc->t[T_CONTENT]);
        }
        if (!rc) rc = mc_text(mc, o, s, m->text.n, err, cap);
        if (!rc) rc = mc_push(o, mc->t[T_END_RESULTS]);
        return rc;
    }
    json_t *r = json_object(); /* v2: [{"name", "content"}]; v3: {"content", "call_id"} */
    if (mc->version == 2)
        json_object_set_new(r, "name", m->name ? json_string(m->name) : json_null());
    json_object_set_new(r, "content", mc_parse_json(s));
    if (mc->version == 3) json_object_set_new(r, "call_id", json_string(m->id));
    json_t *x = r;
    if (mc->version == 2) {
        x = json_array();
        json_array_append_new(x, r);
    }
    rc = mc_push(o, mc->t[T_RESULTS]);
    if (!rc) rc = mc_json_text(mc, o, x, err, cap);
    if (!rc) rc = mc_push(o, mc->t[T_END_RESULTS]);
    json_decref(x);
    return rc;
}

int mistral_chat_encode(const mistral_chat *mc, const json_t *messages, const json_t *tools,
                        int32_t **ids, size_t *n, char *err, size_t cap) {
    *ids = NULL;
    *n = 0;
    if (tools && !json_is_array(tools)) {
        err_set(err, cap, "tools must be an array");
        return -EINVAL;
    }
    mc_conv raw = {0}, conv = {0};
    ct_buf sys = {0};
    mc_ids o = {0};
    int rc = mc_read(mc, messages, &raw, err, cap);
    if (!rc) rc = mc_normalize(mc, &raw, &conv, &sys);
    size_t first_user = SIZE_MAX, last_user = SIZE_MAX;
    for (size_t i = 0; !rc && i < conv.n; i++)
        if (conv.m[i].role == MC_USER) {
            if (first_user == SIZE_MAX) first_user = i;
            last_user = i;
        }
    if (!rc) rc = mc_push(&o, mc->bos);
    for (size_t i = 0; !rc && i < conv.n; i++) {
        const mc_msg *m = &conv.m[i];
        bool before = last_user != SIZE_MAX && i < last_user;
        switch (m->role) {
        case MC_USER:
            rc = mc_user(mc, &o, m, tools, i == first_user, i == last_user, &sys, err, cap);
            break;
        case MC_ASSISTANT:
            rc = mc_assistant(mc, &o, m, before, err, cap);
            break;
        case MC_TOOL:
            rc = mc_tool(mc, &o, m, before, err, cap);
            break;
        default: /* v7+: [SYSTEM_PROMPT] text [/SYSTEM_PROMPT] */
            rc = mc_push(&o, mc->t[T_SYSTEM]);
            if (!rc) rc = mc_text(mc, &o, m->text.v, m->text.n, err, cap);
            if (!rc) rc = mc_push(&o, mc->t[T_END_SYSTEM]);
        }
    }
    mc_conv_free(&raw);
    mc_conv_free(&conv);
    free(sys.v);
    if (rc) {
        if (rc == -ENOMEM) err_set(err, cap, "out of memory");
        free(o.v);
        return rc;
    }
    *ids = o.v;
    *n = o.n;
    return 0;
}
