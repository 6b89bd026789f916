/*
 * test_chat_template — src/model/chat_template against transformers'
 * apply_chat_template (tests/data/tokenizer/chat.jsonl, written by
 * tools/gen_tokenizer_golden.py), the README's 31-token chat from HF, the
 * recognition of the template text, and errors for bad messages; and the
 * official Qwen3, Llama 3.1/3.2/3.3 and Mistral v0.3/Nemo templates
 * (the .jinja files of tests/data/chat_templates) against the renderings in
 * tests/data/chat_templates/golden.jsonl (tests/tools/gen_chat_golden.py:
 * transformers' render_jinja_template over many conversations).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "model/chat_template.h"
#include "model/tokenizer.h"

static char g_tok_dir[4096];  /* ../shared/data/qwen2.5-tokenizer */
static char g_data_dir[4096]; /* tests/data/tokenizer */
static tokenizer *g_tok;      /* Qwen2.5 tokenizer (for its chat_template text) */
static chat_template *g_ct;   /* recognised from it */

static int setup_all(void **state) {
    (void)state;
    snprintf(g_tok_dir, sizeof(g_tok_dir), "%s/../shared/data/qwen2.5-tokenizer",
             DISAGG_SOURCE_DIR);
    snprintf(g_data_dir, sizeof(g_data_dir), "%s/tests/data/tokenizer", DISAGG_SOURCE_DIR);
    struct stat st;
    if (stat(g_tok_dir, &st) != 0) {
        fprintf(stderr,
                "FAIL: shared test data not found at %s (expected the Qwen2.5 tokenizer files in "
                "../shared/data/qwen2.5-tokenizer beside the source tree)\n",
                g_tok_dir);
        return -1;
    }
    char err[512] = "";
    if (tokenizer_load(g_tok_dir, &g_tok, err, sizeof(err))) {
        fprintf(stderr, "FAIL: tokenizer_load(%s): %s\n", g_tok_dir, err);
        return -1;
    }
    if (chat_template_init(tokenizer_chat_template(g_tok), &g_ct, err, sizeof(err))) {
        fprintf(stderr, "FAIL: chat_template_init: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown_all(void **state) {
    (void)state;
    chat_template_free(g_ct);
    tokenizer_free(g_tok);
    return 0;
}

static char *render(const char *messages_json, const char *tools_json, bool agp, int *rc, char *err,
                    size_t cap) {
    json_error_t je;
    json_t *m = json_loads(messages_json, 0, &je);
    if (!m) fail_msg("bad test JSON %s: %s", messages_json, je.text);
    json_t *t = tools_json ? json_loads(tools_json, 0, &je) : NULL;
    chat_template_opts o = {.add_generation_prompt = agp};
    char *out = NULL;
    *rc = chat_template_render(g_ct, m, t, &o, &out, NULL, err, cap);
    json_decref(m);
    json_decref(t);
    return out;
}

/* chat.jsonl: every rendering equals transformers' byte for byte. */
static void test_golden_renderings(void **state) {
    (void)state;
    char path[4200];
    snprintf(path, sizeof(path), "%s/chat.jsonl", g_data_dir);
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open golden file %s", path);
    char *line = NULL;
    size_t cap = 0, n = 0, bad = 0, with_tools = 0, with_calls = 0;
    ssize_t k;
    while ((k = getline(&line, &cap, f)) > 0) {
        n++;
        json_error_t je;
        json_t *o = json_loadb(line, (size_t)k, 0, &je);
        if (!o) fail_msg("%s:%zu: %s", path, n, je.text);
        json_t *want = json_object_get(o, "text");
        json_t *tools = json_object_get(o, "tools");
        chat_template_opts opts = {
            .add_generation_prompt = json_is_true(json_object_get(o, "add_generation_prompt")),
            .parse_tool_arguments = json_is_true(json_object_get(o, "parse_tool_arguments")),
        };
        char *got = NULL, err[512] = "";
        size_t len = 0;
        int rc = chat_template_render(g_ct, json_object_get(o, "messages"), tools, &opts, &got,
                                      &len, err, sizeof(err));
        if (rc || len != json_string_length(want) ||
            memcmp(got, json_string_value(want), len) != 0) {
            fprintf(stderr, "MISMATCH chat.jsonl:%zu %s rc=%d %s\n--- want\n%s\n--- got\n%s\n", n,
                    json_string_value(json_object_get(o, "name")), rc, err, json_string_value(want),
                    got ? got : "");
            bad++;
        }
        if (json_array_size(tools)) with_tools++;
        if (strstr(json_string_value(want), "<tool_call>\n{\"name\": \"get") ||
            strstr(json_string_value(want), "<tool_call>\n{\"name\": \"search"))
            with_calls++;
        free(got);
        json_decref(o);
    }
    free(line);
    fclose(f);
    fprintf(stderr,
            "chat.jsonl: %zu renderings (%zu with tools, %zu with tool calls), %zu "
            "mismatches\n",
            n, with_tools, with_calls, bad);
    assert_true(n >= 40);
    assert_true(with_calls >= 8);
    assert_int_equal(bad, 0);
}

/* README of the shared data: this chat tokenizes to these 31 ids (HF). */
static void test_readme_chat_ids(void **state) {
    (void)state;
    static const int32_t want[] = {151644, 8948,  198,    2610,   525,    1207,   16948, 11,
                                   3465,   553,   54364,  14817,  13,     1446,   525,   264,
                                   10950,  17847, 13,     151645, 198,    151644, 872,   198,
                                   9707,   0,     151645, 198,    151644, 77091,  198};
    int rc;
    char err[256];
    char *text =
        render("[{\"role\":\"user\",\"content\":\"Hello!\"}]", NULL, true, &rc, err, sizeof(err));
    assert_int_equal(rc, 0);
    int32_t *ids;
    size_t n;
    assert_int_equal(tokenizer_encode(g_tok, text, strlen(text), true, &ids, &n, err, sizeof(err)),
                     0);
    assert_int_equal(n, 31);
    assert_memory_equal(ids, want, sizeof(want));
    free(ids);
    free(text);
}

static void test_recognition(void **state) {
    (void)state;
    assert_int_equal(chat_template_get_kind(g_ct), CHAT_TEMPLATE_QWEN25);
    const char *orig = tokenizer_chat_template(g_tok);
    char err[512];
    chat_template *ct = NULL;
    /* re-indented (whitespace outside literals that Jinja strips): still
     * recognised; a tab after the final newline would be printed */
    size_t n = strlen(orig);
    char *reindent = malloc(2 * n + 1);
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        reindent[j++] = orig[i];
        if (orig[i] == '\n' && i + 1 < n) reindent[j++] = '\t';
    }
    reindent[j] = 0;
    assert_int_equal(chat_template_init(reindent, &ct, err, sizeof(err)), 0);
    chat_template_free(ct);
    free(reindent);
    /* a changed literal (Qwen2's shorter default prompt): refused */
    char *changed = strdup(orig);
    char *p = strstr(changed, "You are Qwen, created by Alibaba Cloud.");
    assert_non_null(p);
    memcpy(p, "You are Kwen", 12);
    assert_int_equal(chat_template_init(changed, &ct, err, sizeof(err)), -ENOTSUP);
    assert_null(ct);
    assert_non_null(strstr(err, "unsupported chat template"));
    free(changed);
    /* other templates */
    const char *llama = "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] "
                        "+ '<|end_header_id|>\\n\\n' + message['content'] | trim + "
                        "'<|eot_id|>' }}{% endfor %}";
    assert_int_equal(chat_template_init(llama, &ct, err, sizeof(err)), -ENOTSUP);
    assert_non_null(strstr(err, "unsupported chat template"));
    assert_int_equal(chat_template_init("", &ct, err, sizeof(err)), -ENOTSUP);
    assert_int_equal(chat_template_init(NULL, &ct, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "no chat template"));
}

static void expect_render_error(const char *messages, const char *tools, const char *needle) {
    int rc;
    char err[512] = "";
    char *out = render(messages, tools, true, &rc, err, sizeof(err));
    assert_int_equal(rc, -EINVAL);
    assert_null(out);
    if (!strstr(err, needle)) fail_msg("error \"%s\" lacks \"%s\"", err, needle);
}

static void test_bad_messages(void **state) {
    (void)state;
    expect_render_error("[]", NULL, "non-empty array");
    expect_render_error("{\"role\":\"user\"}", NULL, "non-empty array");
    expect_render_error("[1]", NULL, "messages[0] is not an object");
    expect_render_error("[{\"role\":\"developer\",\"content\":\"x\"}]", NULL,
                        "messages[0].role \"developer\" is not supported");
    expect_render_error("[{\"content\":\"x\"}]", NULL, "role \"(missing)\"");
    expect_render_error("[{\"role\":\"user\",\"content\":5}]", NULL, "messages[0].content must");
    expect_render_error(
        "[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]", NULL,
        "messages[0].content[0]: unsupported content part (type \"image_url\")");
    expect_render_error("[{\"role\":\"user\",\"content\":\"x\"}]", "{\"a\":1}",
                        "tools must be an array");
    expect_render_error("[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\","
                        "\"tool_calls\":[{\"function\":{\"arguments\":{}}}]}]",
                        NULL, "messages[1].tool_calls[0]: function name must be a string");
    expect_render_error("[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\","
                        "\"tool_calls\":[{\"function\":{\"name\":\"f\"}}]}]",
                        NULL, "arguments is missing");
    expect_render_error("[{\"role\":\"user\",\"content\":\"x\",\"tool_calls\":[{}]}]", NULL,
                        "only assistant messages have tool_calls");
    /* parse_tool_arguments with invalid JSON */
    json_t *m = json_loads("[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":"
                           "\"f\",\"arguments\":\"{bad\"}}]}]",
                           0, NULL);
    chat_template_opts o = {.parse_tool_arguments = true};
    char *out = NULL, err[256] = "";
    assert_int_equal(chat_template_render(g_ct, m, NULL, &o, &out, NULL, err, sizeof(err)),
                     -EINVAL);
    assert_non_null(strstr(err, "arguments is not valid JSON"));
    json_decref(m);
}

/* tojson against values Python's json.dumps gives (python3 -c 'import json;
 * print(json.dumps(...))'). */
static void test_tojson(void **state) {
    (void)state;
    struct {
        const char *in, *want;
    } cases[] = {
        {"[0.1, 1e20, 1e16, 1e15, -2.5, 1e-05, 0.0001, 123.456, -0.0, 1.5e300, 5e-324]",
         "[0.1, 1e+20, 1e+16, 1000000000000000.0, -2.5, 1e-05, 0.0001, 123.456, -0.0, 1.5e+300, "
         "5e-324]"},
        {"{\"a\": [1, -2, 9223372036854775807], \"b\": {}, \"c\": [], \"d\": null, \"e\": true}",
         "{\"a\": [1, -2, 9223372036854775807], \"b\": {}, \"c\": [], \"d\": null, \"e\": true}"},
        {"[\"q\\\"b\\\\s\\/n\\n\\r\\t\\b\\f\\u0001\\u001f\\u007f é 中 🦙 \\u2028\"]",
         "[\"q\\\"b\\\\s/n\\n\\r\\t\\b\\f\\u0001\\u001f\x7f é 中 🦙 \u2028\"]"},
        {"{\"z\": 1, \"a\": 2, \"m\": 3}", "{\"z\": 1, \"a\": 2, \"m\": 3}"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        json_error_t je;
        json_t *x = json_loads(cases[i].in, JSON_DECODE_ANY, &je);
        if (!x) fail_msg("case %zu: %s", i, je.text);
        char *s;
        assert_int_equal(chat_template_tojson(x, &s, NULL), 0);
        if (strcmp(s, cases[i].want) != 0)
            fail_msg("tojson case %zu:\n want %s\n got  %s", i, cases[i].want, s);
        free(s);
        json_decref(x);
    }
}

static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *s = malloc((size_t)n + 1);
    if (fread(s, 1, (size_t)n, f) != (size_t)n) fail_msg("short read of %s", path);
    s[n] = 0;
    fclose(f);
    return s;
}

static const struct {
    const char *file;
    chat_template_kind kind;
    const char *name;
} FAMILY[] = {
    {"qwen2.5.jinja", CHAT_TEMPLATE_QWEN25, "qwen2.5"},
    {"qwen3.jinja", CHAT_TEMPLATE_QWEN3, "qwen3"},
    {"qwen3-initial.jinja", CHAT_TEMPLATE_QWEN3, "qwen3"},
    {"llama3.1.jinja", CHAT_TEMPLATE_LLAMA31, "llama3.1"},
    {"llama3.2.jinja", CHAT_TEMPLATE_LLAMA32, "llama3.2"},
    {"mistral-v0.3.jinja", CHAT_TEMPLATE_MISTRAL_V3, "mistral-v0.3"},
    {"mistral-nemo.jinja", CHAT_TEMPLATE_MISTRAL_NEMO, "mistral-nemo"},
    {"mistral-small-2501.jinja", CHAT_TEMPLATE_MISTRAL_SMALL, "mistral-small"},
    {"mistral-small-3.1.jinja", CHAT_TEMPLATE_MISTRAL_SMALL, "mistral-small"},
};
#define N_FAMILY (sizeof(FAMILY) / sizeof(FAMILY[0]))

/* Each official template is recognised as its family; whitespace Jinja
 * strips does not matter; a changed literal or printed whitespace does. */
static void test_family_recognition(void **state) {
    (void)state;
    char path[4400], err[512];
    for (size_t i = 0; i < N_FAMILY; i++) {
        snprintf(path, sizeof path, "%s/tests/data/chat_templates/%s", DISAGG_SOURCE_DIR,
                 FAMILY[i].file);
        char *t = read_text(path);
        chat_template *ct = NULL;
        if (chat_template_init(t, &ct, err, sizeof err)) fail_msg("%s: %s", FAMILY[i].file, err);
        assert_int_equal(chat_template_get_kind(ct), FAMILY[i].kind);
        assert_string_equal(chat_template_name(ct), FAMILY[i].name);
        chat_template_free(ct);
        size_t n = strlen(t);
        /* a printed newline after the last tag: refused */
        char *more = malloc(n + 3);
        memcpy(more, t, n);
        memcpy(more + n, "\n\n", 3);
        assert_int_equal(chat_template_init(more, &ct, err, sizeof err), -ENOTSUP);
        /* indentation and newlines before each dashed tag: still recognised */
        char *re = malloc(3 * n + 1);
        size_t j = 0;
        for (size_t k = 0; k < n; k++) {
            if (t[k] == '{' && k + 2 < n && (t[k + 1] == '%' || t[k + 1] == '{') &&
                t[k + 2] == '-') {
                re[j++] = '\n';
                re[j++] = ' ';
            }
            re[j++] = t[k];
        }
        re[j] = 0;
        if (chat_template_init(re, &ct, err, sizeof err))
            fail_msg("%s re-indented: %s", FAMILY[i].file, err);
        chat_template_free(ct);
        /* one character of a string literal changed: refused */
        char *lit = strdup(t);
        char *q = strstr(lit, "<|");
        if (!q) q = strstr(lit, "[INST");
        assert_non_null(q);
        q[1] = '?';
        assert_int_equal(chat_template_init(lit, &ct, err, sizeof err), -ENOTSUP);
        assert_non_null(strstr(err, "unsupported chat template"));
        /* a dash removed (whitespace control changes): refused */
        char *dash = strdup(t);
        char *d = strstr(dash, "{%- endfor %}");
        assert_non_null(d);
        d[2] = ' ';
        assert_int_equal(chat_template_init(dash, &ct, err, sizeof err), -ENOTSUP);
        free(dash);
        free(lit);
        free(re);
        free(more);
        free(t);
    }
}

/* golden.jsonl: every case renders as transformers' render_jinja_template
 * did, or fails where the template raised. */
static void test_family_goldens(void **state) {
    (void)state;
    char path[4400], err[512];
    chat_template *cts[N_FAMILY] = {0};
    for (size_t i = 0; i < N_FAMILY; i++) {
        snprintf(path, sizeof path, "%s/tests/data/chat_templates/%s", DISAGG_SOURCE_DIR,
                 FAMILY[i].file);
        char *t = read_text(path);
        if (chat_template_init(t, &cts[i], err, sizeof err)) fail_msg("%s: %s", path, err);
        free(t);
    }
    snprintf(path, sizeof path, "%s/tests/data/chat_templates/conversations.json",
             DISAGG_SOURCE_DIR);
    json_error_t je;
    json_t *cv = json_load_file(path, 0, &je);
    if (!cv) fail_msg("%s: %s", path, je.text);
    snprintf(path, sizeof path, "%s/tests/data/chat_templates/golden.jsonl", DISAGG_SOURCE_DIR);
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    char *line = NULL;
    size_t cap = 0, n = 0, bad = 0, errors = 0, per[N_FAMILY] = {0};
    ssize_t k;
    while ((k = getline(&line, &cap, f)) > 0) {
        n++;
        json_t *o = json_loadb(line, (size_t)k, 0, &je);
        if (!o) fail_msg("%s:%zu: %s", path, n, je.text);
        const char *file = json_string_value(json_object_get(o, "template"));
        size_t fi = 0;
        while (fi < N_FAMILY && strcmp(FAMILY[fi].file, file))
            fi++;
        assert_true(fi < N_FAMILY);
        per[fi]++;
        const char *name = json_string_value(json_object_get(o, "name"));
        json_t *msgs = json_object_get(json_object_get(cv, "conversations"), name);
        json_t *tools =
            json_is_true(json_object_get(o, "tools")) ? json_object_get(cv, "tools") : NULL;
        chat_template_opts opts = {
            .add_generation_prompt = json_is_true(json_object_get(o, "add_generation_prompt")),
            .parse_tool_arguments = true,
            .kwargs = json_object_get(o, "kwargs"),
            .now = json_integer_value(json_object_get(o, "now")), /* strftime_now's time */
        };
        char *got = NULL;
        size_t len = 0;
        err[0] = 0;
        int rc = chat_template_render(cts[fi], msgs, tools, &opts, &got, &len, err, sizeof err);
        json_t *want = json_object_get(o, "text");
        const char *want_err = json_string_value(json_object_get(o, "error"));
        bool ok;
        if (want_err) {
            errors++;
            /* the template's own message (raise_exception) is in ours */
            char head[40];
            snprintf(head, sizeof head, "%s", want_err);
            ok = rc == -EINVAL && !got &&
                 (strstr(want_err, "can only concatenate") || strstr(err, head));
        } else {
            ok = rc == 0 && len == json_string_length(want) &&
                 !memcmp(got, json_string_value(want), len);
        }
        if (!ok) {
            char *kw = json_dumps(opts.kwargs, JSON_COMPACT);
            fprintf(stderr,
                    "MISMATCH golden.jsonl:%zu %s %s tools=%d agp=%d kwargs=%s rc=%d err=%s\n"
                    "--- want\n%s\n--- got\n%s\n",
                    n, file, name, tools != NULL, opts.add_generation_prompt, kw, rc, err,
                    want_err ? want_err : json_string_value(want), got ? got : "");
            free(kw);
            bad++;
        }
        free(got);
        json_decref(o);
    }
    free(line);
    fclose(f);
    json_decref(cv);
    for (size_t i = 0; i < N_FAMILY; i++) {
        chat_template_free(cts[i]);
        assert_true(per[i] >= 40);
    }
    fprintf(stderr, "golden.jsonl: %zu cases (%zu where the template raises), %zu mismatches\n", n,
            errors, bad);
    assert_true(n >= 1000);
    assert_int_equal(bad, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_renderings),
        cmocka_unit_test(test_readme_chat_ids),
        cmocka_unit_test(test_recognition),
        cmocka_unit_test(test_bad_messages),
        cmocka_unit_test(test_tojson),
        cmocka_unit_test(test_family_recognition),
        cmocka_unit_test(test_family_goldens),
    };
    return cmocka_run_group_tests(tests, setup_all, teardown_all);
}
