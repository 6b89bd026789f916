/* Unit tests: server/tool_parser — the --tool-call-parser formats (hermes,
 * llama3_json, mistral) on model text.  The llama3_json and mistral cases are
 * those of vLLM's own tests of its parsers:
 *   tests/entrypoints/openai/tool_parsers/test_llama3_json_tool_parser.py
 *   tests/tool_use/test_mistral_tool_parser.py
 * (vllm-project/vllm), with the arguments compared as the exact text vLLM
 * returns (json.dumps(..., ensure_ascii=False), or the model's own text for
 * Mistral v11+). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "grammar/grammar.h"
#include "model/tokenizer.h"
#include "server/structured.h"
#include "server/tool_parser.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

/* Parses text with parser name; checks the number of calls and the content length, and returns
 * the calls (NULL when none). */
static json_t *parse(const char *name, const char *text, int want_n, size_t want_content) {
    const tool_parser *p = tool_parser_find(name);
    assert_non_null(p);
    json_t *calls = NULL;
    size_t cl = 12345;
    int n = p->parse(text, strlen(text), &calls, &cl);
    if (n != want_n) fail_msg("%s: %d calls in '%s', expected %d", name, n, text, want_n);
    if (n == 0) {
        assert_null(calls);
        return NULL;
    }
    assert_int_equal(json_array_size(calls), (size_t)n);
    assert_int_equal(cl, want_content);
    return calls;
}

/* calls[i] is a function call of name with exactly the arguments text args. */
static void check_call(json_t *calls, size_t i, const char *name, const char *args) {
    json_t *c = json_array_get(calls, i);
    assert_string_equal(json_string_value(json_object_get(c, "type")), "function");
    json_t *f = json_object_get(c, "function");
    assert_string_equal(json_string_value(json_object_get(f, "name")), name);
    assert_string_equal(json_string_value(json_object_get(f, "arguments")), args);
}

static const char *call_id(json_t *calls, size_t i) {
    return json_string_value(json_object_get(json_array_get(calls, i), "id"));
}

/* vLLM's MistralToolCall ids: 9 characters of [A-Za-z0-9]. */
static void check_mistral_id(const char *id) {
    assert_non_null(id);
    assert_int_equal(strlen(id), 9);
    for (int i = 0; i < 9; i++)
        assert_true(isalnum((unsigned char)id[i]));
}

static void test_table(void **state) {
    (void)state;
    assert_ptr_equal(tool_parser_find("hermes"), &tool_parser_hermes);
    assert_ptr_equal(tool_parser_find("llama3_json"), &tool_parser_llama3_json);
    assert_ptr_equal(tool_parser_find("mistral"), &tool_parser_mistral);
    assert_ptr_equal(tool_parser_default(), &tool_parser_hermes);
    assert_null(tool_parser_find("pythonic"));
    assert_null(tool_parser_find(""));
    assert_null(tool_parser_find("Mistral"));
}

static void test_hermes(void **state) {
    (void)state;
    json_t *calls = parse("hermes",
                          "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                          "{\"city\": \"Paris\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>\n"
                          "{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
                          2, strlen("Let me check."));
    /* arguments as Python's json.dumps writes them */
    check_call(calls, 0, "get_weather", "{\"city\": \"Paris\", \"days\": [1, 2]}");
    check_call(calls, 1, "now", "{}");
    assert_int_equal(strncmp(call_id(calls, 0), "chatcmpl-tool-", 14), 0);
    assert_string_not_equal(call_id(calls, 0), call_id(calls, 1));
    json_decref(calls);
    parse("hermes", "<tool_call>{not json}</tool_call>", 0, 0); /* invalid: plain content */
    parse("hermes", "hello", 0, 0);
    /* cut by the end of generation: still parsed */
    calls = parse("hermes", "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n", 1, 0);
    check_call(calls, 0, "f", "{\"x\": 1}");
    json_decref(calls);
    /* streaming: hold back a partial tag */
    const tool_parser *p = &tool_parser_hermes;
    assert_int_equal(p->safe_prefix("abc<tool_c", 10), 3);
    assert_int_equal(p->safe_prefix("abc<", 4), 3);
    assert_int_equal(p->safe_prefix("a<b", 3), 3);
    assert_int_equal(p->safe_prefix("ab<tool_call>{", 14), 2);
}

static void test_llama3_json(void **state) {
    (void)state;
    /* test_extract_tool_calls_simple: text around the call is dropped, content None */
    json_t *calls =
        parse("llama3_json",
              "Here is the result: {\"name\": \"getOpenIncidentsTool\", \"parameters\": "
              "{}} Would you like to know more?",
              1, 0);
    check_call(calls, 0, "getOpenIncidentsTool", "{}");
    assert_int_equal(strncmp(call_id(calls, 0), "chatcmpl-tool-", 14), 0);
    json_decref(calls);
    /* test_extract_tool_calls_with_arguments */
    calls =
        parse("llama3_json",
              "{\"name\": \"searchTool\", \"parameters\": {\"query\": \"test query\", \"limit\": "
              "10}}",
              1, 0);
    check_call(calls, 0, "searchTool", "{\"query\": \"test query\", \"limit\": 10}");
    json_decref(calls);
    /* test_extract_tool_calls_no_json, test_extract_tool_calls_invalid_json */
    parse("llama3_json", "This is just some text without any tool calls", 0, 0);
    parse("llama3_json", "{\"name\": \"invalidTool\", \"parameters\": {invalid json}", 0, 0);
    /* test_extract_tool_calls_with_arguments_key */
    calls = parse("llama3_json", "{\"name\": \"searchTool\", \"arguments\": {\"query\": \"test\"}}",
                  1, 0);
    check_call(calls, 0, "searchTool", "{\"query\": \"test\"}");
    json_decref(calls);
    /* test_extract_tool_calls_multiple_json (+ _with_whitespace, _with_surrounding_text) */
    const char *multi[] = {
        "{\"name\": \"searchTool\", \"parameters\": {\"query\": \"test1\"}}; "
        "{\"name\": \"getOpenIncidentsTool\", \"parameters\": {}}; "
        "{\"name\": \"searchTool\", \"parameters\": {\"query\": \"test2\"}}",
        "{\"name\": \"searchTool\", \"parameters\": {\"query\": \"test1\"}} ; "
        "{\"name\": \"getOpenIncidentsTool\", \"parameters\": {}} ; "
        "{\"name\": \"searchTool\", \"parameters\": {\"query\": \"test2\"}}",
        "Here are the results: {\"name\": \"searchTool\", \"parameters\": {\"query\": \"test1\"}}; "
        "{\"name\": \"getOpenIncidentsTool\", \"parameters\": {}}; "
        "{\"name\": \"searchTool\", \"parameters\": {\"query\": \"test2\"}} Would you like to know "
        "more?",
    };
    for (int i = 0; i < 3; i++) {
        calls = parse("llama3_json", multi[i], 3, 0);
        check_call(calls, 0, "searchTool", "{\"query\": \"test1\"}");
        check_call(calls, 1, "getOpenIncidentsTool", "{}");
        check_call(calls, 2, "searchTool", "{\"query\": \"test2\"}");
        json_decref(calls);
    }
    /* test_extract_tool_calls_deeply_nested_json */
    calls = parse("llama3_json",
                  "{\"name\": \"complexTool\", \"parameters\": {\"level1\": {\"level2\": "
                  "{\"level3\": {\"level4\": {\"value\": \"deep\"}}}}}}",
                  1, 0);
    check_call(calls, 0, "complexTool",
               "{\"level1\": {\"level2\": {\"level3\": {\"level4\": {\"value\": \"deep\"}}}}}");
    json_decref(calls);
    /* test_extract_tool_calls_multiple_with_deep_nesting */
    calls = parse("llama3_json",
                  "{\"name\": \"simpleTool\", \"parameters\": {\"value\": \"test\"}}; "
                  "{\"name\": \"complexTool\", \"parameters\": {\"config\": {\"database\": "
                  "{\"connection\": {\"pool\": {\"size\": 10}}}}}}",
                  2, 0);
    check_call(calls, 0, "simpleTool", "{\"value\": \"test\"}");
    check_call(calls, 1, "complexTool",
               "{\"config\": {\"database\": {\"connection\": {\"pool\": {\"size\": 10}}}}}");
    json_decref(calls);
    /* test_extract_tool_calls_with_quotes_and_brackets_in_string */
    calls = parse("llama3_json",
                  "{\"name\": \"searchTool\", \"parameters\": {\"query\": \"test {value} "
                  "[complex]\",\"nested\": {\"inner\": \"more {brackets}\"}}}",
                  1, 0);
    check_call(calls, 0, "searchTool",
               "{\"query\": \"test {value} [complex]\", \"nested\": {\"inner\": \"more "
               "{brackets}\"}}");
    json_decref(calls);
    /* test_extract_tool_calls_with_escaped_quotes_in_nested_json */
    calls = parse("llama3_json",
                  "{\"name\": \"parserTool\", \"parameters\": {\"text\": \"He said \\\"Hello "
                  "{world}\\\"\"}}",
                  1, 0);
    check_call(calls, 0, "parserTool", "{\"text\": \"He said \\\"Hello {world}\\\"\"}");
    json_decref(calls);
    /* <|python_tag|> before the call (kept when skip_special_tokens is false); unicode as is */
    calls = parse("llama3_json",
                  "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": "
                  "\"\xe6\x9d\xb1\xe4\xba\xac\", \"t\": 1.5}}",
                  1, 0);
    check_call(calls, 0, "get_weather", "{\"city\": \"\xe6\x9d\xb1\xe4\xba\xac\", \"t\": 1.5}");
    json_decref(calls);
    /* a JSON object that is not a call (no "name", or neither arguments nor parameters) */
    parse("llama3_json", "{\"city\": \"Paris\"}", 0, 0);
    parse("llama3_json", "{\"name\": \"f\"}", 0, 0);
    parse("llama3_json", "{\"name\": 3, \"parameters\": {}}", 0, 0);
    /* streaming: held only when the text starts with "{" or the python tag */
    const tool_parser *p = &tool_parser_llama3_json;
    assert_int_equal(p->safe_prefix("", 0), 0);
    assert_int_equal(p->safe_prefix("{\"na", 4), 0);
    assert_int_equal(p->safe_prefix("<|pyt", 5), 0);
    assert_int_equal(p->safe_prefix("<|python_tag|>{", 15), 0);
    assert_int_equal(p->safe_prefix("<|im", 4), 4);
    assert_int_equal(p->safe_prefix("Sure {", 6), 6);
    /* at the end of a stream whose start went out as content, a call later on stays content */
    const char *late = "Sure: {\"name\": \"f\", \"parameters\": {}}";
    json_t *c2 = NULL;
    size_t cl = 0;
    assert_int_equal(tool_parser_stream_calls(p, late, strlen(late), 6, &c2, &cl), 0);
    assert_null(c2);
    assert_int_equal(tool_parser_stream_calls(p, late + 6, strlen(late + 6), 0, &c2, &cl), 1);
    json_decref(c2);
}

static void test_mistral_before_v11(void **state) {
    (void)state;
    /* test_extract_tool_calls_no_tools */
    parse("mistral", "This is a test", 0, 0);
    /* test_extract_tool_calls: single_tool_add, single_tool_weather, argument_before_name,
     * argument_before_name_and_name_in_argument */
    json_t *calls = parse(
        "mistral", "[TOOL_CALLS][{\"name\": \"add\", \"arguments\":{\"a\": 3.5, \"b\": 4}}]", 1, 0);
    check_call(calls, 0, "add", "{\"a\": 3.5, \"b\": 4}");
    check_mistral_id(call_id(calls, 0));
    json_decref(calls);
    const char *weather = "{\"city\": \"San Francisco\", \"state\": \"CA\", \"unit\": \"celsius\"}";
    calls =
        parse("mistral",
              "[TOOL_CALLS] [{\"name\": \"get_current_weather\", \"arguments\":{\"city\": \"San "
              "Francisco\", \"state\": \"CA\", \"unit\": \"celsius\"}}]",
              1, 0);
    check_call(calls, 0, "get_current_weather", weather);
    json_decref(calls);
    calls = parse("mistral",
                  "[TOOL_CALLS] [{\"arguments\":{\"city\": \"San Francisco\", \"state\": \"CA\", "
                  "\"unit\": \"celsius\"}, \"name\": \"get_current_weather\"}]",
                  1, 0);
    check_call(calls, 0, "get_current_weather", weather);
    json_decref(calls);
    calls = parse("mistral",
                  "[TOOL_CALLS] [{\"arguments\":{\"name\": \"John Doe\"}, \"name\": \"get_age\"}]",
                  1, 0);
    check_call(calls, 0, "get_age", "{\"name\": \"John Doe\"}");
    json_decref(calls);
    /* test_extract_tool_calls_streaming's cases, whole: spaced, strings, two calls */
    calls =
        parse("mistral",
              "[TOOL_CALLS]  [ {\"name\":\"add\" , \"arguments\" : {\"a\": 3, \"b\": 4} } ]", 1, 0);
    check_call(calls, 0, "add", "{\"a\": 3, \"b\": 4}");
    json_decref(calls);
    calls = parse("mistral",
                  "[TOOL_CALLS] [{\"name\": \"add\", \"arguments\":{\"a\": \"3\", \"b\": \"4\"}}]",
                  1, 0);
    check_call(calls, 0, "add", "{\"a\": \"3\", \"b\": \"4\"}");
    json_decref(calls);
    calls =
        parse("mistral",
              "Checking.[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 3.5, \"b\": 4}}, "
              "{\"name\": \"get_current_weather\", \"arguments\":{\"city\": \"San Francisco\", "
              "\"state\": \"CA\", \"unit\": \"celsius\"}}]",
              2, strlen("Checking."));
    check_call(calls, 0, "add", "{\"a\": 3.5, \"b\": 4}");
    check_call(calls, 1, "get_current_weather", weather);
    check_mistral_id(call_id(calls, 1));
    assert_string_not_equal(call_id(calls, 0), call_id(calls, 1));
    json_decref(calls);
    /* raw_decode: text after the array is ignored; a missing "arguments" is {} */
    calls = parse("mistral", "[TOOL_CALLS] [{\"name\": \"now\"}] trailing", 1, 0);
    check_call(calls, 0, "now", "{}");
    json_decref(calls);
    /* the regex fallback: junk before the array */
    calls = parse("mistral", "[TOOL_CALLS] [x [{\"name\": \"now\", \"arguments\": {}}]", 1, 0);
    check_call(calls, 0, "now", "{}");
    json_decref(calls);
    /* not calls: bad JSON, an element without a name, a second [TOOL_CALLS], cut short */
    parse("mistral", "[TOOL_CALLS] [{\"name\": add}]", 0, 0);
    parse("mistral", "[TOOL_CALLS] [{\"arguments\": {}}]", 0, 0);
    parse("mistral", "[TOOL_CALLS] [{\"name\": \"a\"}][TOOL_CALLS] [{\"name\": \"b\"}]", 0, 0);
    parse("mistral", "[TOOL_CALLS] [{\"name\": \"add\", \"arguments\": {\"a\": 1", 0, 0);
    parse("mistral", "[TOOL_CALLS] []", 0, 0);
}

static void test_mistral_v11(void **state) {
    (void)state;
    /* test_extract_tool_calls_v11_tokenizer: single_tool_add, single_tool_weather */
    json_t *calls = parse("mistral", "[TOOL_CALLS]add{\"a\": 3.5, \"b\": 4}", 1, 0);
    check_call(calls, 0, "add", "{\"a\": 3.5, \"b\": 4}");
    check_mistral_id(call_id(calls, 0));
    json_decref(calls);
    calls = parse("mistral",
                  "[TOOL_CALLS]get_current_weather{\"city\": \"San Francisco\", \"state\": \"CA\", "
                  "\"unit\": \"celsius\"}",
                  1, 0);
    check_call(calls, 0, "get_current_weather",
               "{\"city\": \"San Francisco\", \"state\": \"CA\", \"unit\": \"celsius\"}");
    json_decref(calls);
    /* the text as Tekken decodes it with special tokens: [ARGS] between name and arguments,
     * content before, two calls; the arguments as the model wrote them */
    calls = parse("mistral", "Sure.[TOOL_CALLS]add[ARGS]{\"a\":1}[TOOL_CALLS]get_time[ARGS]{}", 2,
                  strlen("Sure."));
    check_call(calls, 0, "add", "{\"a\":1}");
    check_call(calls, 1, "get_time", "{}");
    json_decref(calls);
    /* v11's [CALL_ID]: the model's id is kept when it is a Mistral id */
    calls = parse("mistral", "[TOOL_CALLS]add[CALL_ID]abcDEF123[ARGS]{\"a\": 1}", 1, 0);
    check_call(calls, 0, "add", "{\"a\": 1}");
    assert_string_equal(call_id(calls, 0), "abcDEF123");
    json_decref(calls);
    /* a piece without "{" is skipped (vLLM); none left: content */
    calls = parse("mistral", "[TOOL_CALLS]broken[TOOL_CALLS]add[ARGS]{\"a\": 1}", 1, 0);
    check_call(calls, 0, "add", "{\"a\": 1}");
    json_decref(calls);
    parse("mistral", "[TOOL_CALLS]broken", 0, 0);
    /* streaming: everything from [TOOL_CALLS] (or a partial one at the end) is held */
    const tool_parser *p = &tool_parser_mistral;
    assert_int_equal(p->safe_prefix("Hi [TOOL_", 9), 3);
    assert_int_equal(p->safe_prefix("Hi [TOOL_CALLS]add", 18), 3);
    assert_int_equal(p->safe_prefix("[x]", 3), 3);
    assert_string_equal(p->special_token, "[TOOL_CALLS]");
    assert_string_equal(p->alt_token, "[ARGS]");
}

/* text = before call (sep call)* after, each call in the format f with the arguments args. */
static void format_calls(const tool_call_grammar *f, int n, const char *args, char *out,
                         size_t cap) {
    size_t k = (size_t)snprintf(out, cap, "%s", f->before);
    for (int i = 0; i < n; i++)
        k += (size_t)snprintf(out + k, cap - k, "%s%s%s%s%s%s", i ? f->sep : "", f->open,
                              f->quoted_name ? "\"get_weather\"" : "get_weather", f->mid, args,
                              f->close);
    snprintf(out + k, cap - k, "%s", f->after);
}

/* The output tool_choice "required" / a named function is constrained to is text the same parser
 * reads back: for each format, the grammar (server/structured.c over the tiny model's
 * vocabulary) accepts one and two calls written in it, refuses another function's name, and the
 * parser returns the calls. */
static void test_grammar_round_trip(void **state) {
    (void)state;
    char err[512];
    tokenizer *tok = NULL;
    if (tokenizer_load(DISAGG_SOURCE_DIR "/models/disagg-sotu-tiny", &tok, err, sizeof err))
        fail_msg("%s", err);
    grammar_vocab *gv = structured_vocab_new(tok, tokenizer_vocab_size(tok));
    structured_cache *cache = structured_cache_new(gv);
    assert_non_null(cache);
    const struct {
        const tool_parser *p;
        const tool_call_grammar *f;
    } cases[] = {{&tool_parser_hermes, tool_parser_hermes.grammar},
                 {&tool_parser_llama3_json, tool_parser_llama3_json.grammar},
                 {&tool_parser_mistral, tool_parser_mistral.grammar},
                 {&tool_parser_mistral, tool_parser_mistral.alt_grammar}};
    const char *tools = "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
                        "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": "
                        "{\"type\": \"string\"}}, \"required\": [\"city\"]}}}, {\"type\": "
                        "\"function\", \"function\": {\"name\": \"get_time\"}}]";
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (int named = 0; named < 2; named++) {
            char body_text[1024];
            snprintf(body_text, sizeof body_text, "{\"tools\": %s, \"tool_choice\": %s}", tools,
                     named ? "{\"type\": \"function\", \"function\": {\"name\": "
                             "\"get_weather\"}}"
                           : "\"required\"");
            json_t *body = json_loads(body_text, 0, NULL);
            grammar *g = NULL;
            int tool_fmt = 0;
            if (structured_from_request(cache, body, 1, cases[i].f, &g, &tool_fmt, err, sizeof err))
                fail_msg("%s: %s", cases[i].p->name, err);
            assert_non_null(g);
            assert_int_equal(tool_fmt, 1);
            for (int n = 1; n <= 2; n++) {
                char text[512];
                format_calls(cases[i].f, n, "{\"city\": \"Paris\"}", text, sizeof text);
                grammar_state s =
                    grammar_advance_bytes(g, grammar_start(g), (const uint8_t *)text, strlen(text));
                /* named: exactly one call */
                bool want = n == 1 || !named;
                if (want != (s != GRAMMAR_DEAD && grammar_state_accepting(g, s)))
                    fail_msg("%s grammar (%s) %s '%s'", cases[i].p->name,
                             named ? "named" : "required", want ? "refuses" : "accepts", text);
                json_t *calls = parse(cases[i].p->name, text, n, 0);
                for (int k = 0; k < n; k++)
                    check_call(calls, (size_t)k, "get_weather", "{\"city\": \"Paris\"}");
                json_decref(calls);
            }
            char other[512];
            format_calls(cases[i].f, 1, "{}", other, sizeof other);
            char *w = strstr(other, "get_weather");
            memcpy(w, "get_whether", 11);
            assert_int_equal(
                grammar_advance_bytes(g, grammar_start(g), (const uint8_t *)other, strlen(other)),
                GRAMMAR_DEAD);
            grammar_unref(g);
            json_decref(body);
        }
    }
    structured_cache_free(cache);
    grammar_vocab_free(gv);
    tokenizer_free(tok);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table),       cmocka_unit_test(test_hermes),
        cmocka_unit_test(test_llama3_json), cmocka_unit_test(test_mistral_before_v11),
        cmocka_unit_test(test_mistral_v11), cmocka_unit_test(test_grammar_round_trip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
