/* Unit tests: server/openai_request — parsing and validation of completions
 * and chat request bodies: defaults, every field's accepted range, and the
 * OpenAI error shape (status, type, param naming the field). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "server/openai_request.h"

#include <string.h>

static oai_defaults g_def;

static int setup(void **state) {
    (void)state;
    oai_defaults_init(&g_def);
    g_def.served_model_name = "tiny";
    g_def.model_path = "models/tiny";
    return 0;
}

static int parse(oai_kind k, const char *body, oai_request *r, oai_error *e) {
    memset(e, 0, sizeof *e);
    return oai_request_parse(r, k, body, strlen(body), &g_def, e);
}

/* The body must be refused with status and param; the message must name the
 * field and contain `needle` (the accepted values). */
static void expect_bad(oai_kind k, const char *body, int status, const char *param,
                       const char *needle) {
    oai_request r;
    oai_error e;
    int rc = parse(k, body, &r, &e);
    if (rc == 0) {
        oai_request_free(&r);
        fail_msg("accepted %s", body);
    }
    assert_int_equal(e.status, status);
    assert_string_equal(e.param, param);
    if (!strstr(e.message, needle))
        fail_msg("message for %s: '%s' lacks '%s'", body, e.message, needle);
}

static void test_completion_defaults(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(parse(OAI_COMPLETIONS, "{\"model\":\"tiny\",\"prompt\":\"Hello\"}", &r, &e),
                     0);
    assert_int_equal(r.n_prompts, 1);
    assert_string_equal(r.prompts[0].text, "Hello");
    assert_int_equal(r.n, 1);
    assert_int_equal(r.max_tokens, 16); /* OpenAI's completions default */
    assert_int_equal(r.logprobs, -1);
    assert_true(r.skip_special_tokens);
    assert_true(r.add_special_tokens);
    assert_false(r.stream);
    assert_true(r.sampling.temperature == 1.0f && r.sampling.top_p == 1.0f);
    assert_int_equal(r.sampling.has_seed, 0);
    assert_null(r.kv_transfer_params);
    oai_request_free(&r);
}

static void test_generation_config_defaults(void **state) {
    (void)state;
    oai_defaults d = g_def;
    d.temperature = 0.8f;
    d.top_p = 0.95f;
    oai_request r;
    oai_error e;
    const char *b = "{\"prompt\":\"x\",\"top_p\":0.5}";
    assert_int_equal(oai_request_parse(&r, OAI_COMPLETIONS, b, strlen(b), &d, &e), 0);
    assert_true(r.sampling.temperature == 0.8f); /* from the model */
    assert_true(r.sampling.top_p == 0.5f);       /* the request wins */
    oai_request_free(&r);
}

static void test_prompt_forms(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(parse(OAI_COMPLETIONS, "{\"prompt\":[1,2,3]}", &r, &e), 0);
    assert_int_equal(r.n_prompts, 1);
    assert_null(r.prompts[0].text);
    assert_int_equal(r.prompts[0].n_ids, 3);
    assert_int_equal(r.prompts[0].ids[2], 3);
    oai_request_free(&r);
    assert_int_equal(parse(OAI_COMPLETIONS, "{\"prompt\":[\"a\",\"bc\"]}", &r, &e), 0);
    assert_int_equal(r.n_prompts, 2);
    assert_string_equal(r.prompts[1].text, "bc");
    oai_request_free(&r);
    assert_int_equal(parse(OAI_COMPLETIONS, "{\"prompt\":[[5],[6,7]]}", &r, &e), 0);
    assert_int_equal(r.n_prompts, 2);
    assert_int_equal(r.prompts[1].n_ids, 2);
    assert_int_equal(r.prompts[1].ids[1], 7);
    oai_request_free(&r);
    expect_bad(OAI_COMPLETIONS, "{}", 400, "prompt", "required");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"\"}", 400, "prompt", "empty");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":[]}", 400, "prompt", "empty");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":7}", 400, "prompt", "list of token ids");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":[\"a\",[1]]}", 400, "prompt", "mixed");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":[1,-2]}", 400, "prompt", "non-negative");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":[1,\"x\"]}", 400, "prompt", "element 1");
}

static void test_sampling_ranges(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(parse(OAI_COMPLETIONS,
                           "{\"prompt\":\"x\",\"temperature\":0,\"top_p\":0.9,\"top_k\":-1,"
                           "\"min_p\":0.1,\"presence_penalty\":-2,\"frequency_penalty\":2,"
                           "\"repetition_penalty\":1.1,\"seed\":-5,\"n\":3,\"max_tokens\":4,"
                           "\"min_tokens\":2,\"ignore_eos\":true}",
                           &r, &e),
                     0);
    assert_true(r.sampling.temperature == 0.0f);
    assert_int_equal(r.sampling.top_k, 0); /* -1 means off */
    assert_true(r.sampling.presence_penalty == -2.0f && r.sampling.frequency_penalty == 2.0f);
    assert_int_equal(r.sampling.has_seed, 1);
    assert_true(r.sampling.seed == (uint64_t)-5);
    assert_int_equal(r.n, 3);
    assert_int_equal(r.max_tokens, 4);
    assert_int_equal(r.min_tokens, 2);
    assert_true(r.ignore_eos);
    oai_request_free(&r);
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":-0.1}", 400, "temperature",
               "between 0");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", 400, "temperature",
               "got a string");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_p\":0}", 400, "top_p", "greater than 0");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_p\":1.5}", 400, "top_p", "at most 1");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_k\":-2}", 400, "top_k", "-1 or 0");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"top_k\":1.5}", 400, "top_k",
               "positive integer");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"min_p\":2}", 400, "min_p", "between 0 and 1");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"presence_penalty\":3}", 400,
               "presence_penalty", "between -2 and 2");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"frequency_penalty\":-3}", 400,
               "frequency_penalty", "between -2 and 2");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"repetition_penalty\":0}", 400,
               "repetition_penalty", "greater than 0");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":0}", 400, "n", "between 1 and 128");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":1.5}", 400, "n", "integer");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":0}", 400, "max_tokens",
               "between 1");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":2,\"min_tokens\":3}", 400,
               "min_tokens", "at most max_tokens");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"seed\":\"1\"}", 400, "seed", "integer");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"ignore_eos\":1}", 400, "ignore_eos",
               "boolean");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":3,\"best_of\":2}", 400, "best_of",
               "must be at least 'n' (3)");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"best_of\":2,\"stream\":true}", 400,
               "best_of", "cannot be streamed");
}

static void test_stop_and_logprobs(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(parse(OAI_COMPLETIONS,
                           "{\"prompt\":\"x\",\"stop\":\"\\n\",\"logprobs\":3,\"echo\":true,\"stop_"
                           "token_ids\":[7]}",
                           &r, &e),
                     0);
    assert_int_equal(r.n_stop, 1);
    assert_string_equal(r.stop[0], "\n");
    assert_int_equal(r.logprobs, 3);
    assert_int_equal(r.sampling.logprobs, 3);
    assert_int_equal(r.sampling.prompt_logprobs, 3); /* echo + logprobs: the prompt's too */
    assert_int_equal(r.n_stop_token_ids, 1);
    oai_request_free(&r);
    assert_int_equal(parse(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":[\"a\",\"bb\"]}", &r, &e),
                     0);
    assert_int_equal(r.n_stop, 2);
    assert_int_equal(r.sampling.prompt_logprobs, -1);
    oai_request_free(&r);
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":5}", 400, "stop",
               "a string or a list of strings");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":[\"a\",3]}", 400, "stop", "element 1");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":[\"\"]}", 400, "stop", "non-empty");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logprobs\":21}", 400, "logprobs",
               "between 0 and 20");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logprobs\":true}", 400, "logprobs", "integer");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"prompt_logprobs\":30}", 400, "prompt_logprobs",
               "between 0 and 20");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"suffix\":\"s\"}", 400, "suffix",
               "not supported");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":{\"a5\":1}}", 400, "logit_bias",
               "must be an integer");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":{\"5\":\"1\"}}", 400,
               "logit_bias", "must be a number");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":[5]}", 400, "logit_bias",
               "must be an object");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"allowed_token_ids\":[]}", 400,
               "allowed_token_ids", "is empty");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"allowed_token_ids\":[1,-2]}", 400,
               "allowed_token_ids", "non-negative");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"bad_words\":[\"a\",\"\"]}", 400, "bad_words",
               "element 1");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"bad_words\":\"a\"}", 400, "bad_words",
               "list of strings");
}

/* logit_bias (values clamped to [-100, 100] as vLLM), allowed_token_ids and bad_words reach
 * the sampling parameters. */
static void test_logit_processors(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(parse(OAI_COMPLETIONS,
                           "{\"prompt\":\"x\",\"logit_bias\":{\"5\":1.5,\"7\":-300},"
                           "\"allowed_token_ids\":[5,7,9],\"bad_words\":[\" hi\",\"yo\"]}",
                           &r, &e),
                     0);
    assert_int_equal(r.sampling.n_logit_bias, 2);
    assert_int_equal(r.sampling.logit_bias_ids[0], 5);
    assert_true(r.sampling.logit_bias[0] == 1.5f);
    assert_int_equal(r.sampling.logit_bias_ids[1], 7);
    assert_true(r.sampling.logit_bias[1] == -100.0f);
    assert_int_equal(r.sampling.n_allowed_token_ids, 3);
    assert_int_equal(r.sampling.allowed_token_ids[2], 9);
    assert_int_equal(r.n_bad_words, 2);
    assert_string_equal(r.bad_words[0], " hi");
    assert_int_equal(r.sampling.n_bad_words, 0); /* tokenized by the server */
    oai_request_free(&r);
}

static void test_beam_search(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(parse(OAI_COMPLETIONS,
                           "{\"prompt\":\"x\",\"n\":4,\"use_beam_search\":true,"
                           "\"length_penalty\":0.5,\"stream\":true,\"ignore_eos\":true}",
                           &r, &e),
                     0);
    assert_true(r.use_beam_search);
    assert_true(r.length_penalty == 0.5f);
    assert_int_equal(r.n, 4);
    assert_false(r.stream); /* vLLM answers completions' beam search with one body */
    oai_request_free(&r);
    assert_int_equal(parse(OAI_CHAT,
                           "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                           "\"use_beam_search\":true,\"stream\":true}",
                           &r, &e),
                     0);
    assert_true(r.stream); /* chat streams the beams at the end */
    assert_true(r.length_penalty == 1.0f);
    oai_request_free(&r);
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"n\":11,\"use_beam_search\":true}", 400,
               "n", "n from 1 to 10");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"use_beam_search\":true,\"top_k\":3}", 400,
               "top_k", "not applied by beam search");
    expect_bad(OAI_CHAT,
               "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
               "\"use_beam_search\":true,\"logprobs\":true}",
               400, "logprobs", "not returned with use_beam_search");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"length_penalty\":[1]}", 400,
               "length_penalty", "must be a number");
}

static void test_stream_options(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(
        parse(OAI_COMPLETIONS,
              "{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"include_usage\":true}}", &r,
              &e),
        0);
    assert_true(r.stream && r.include_usage && !r.continuous_usage_stats);
    oai_request_free(&r);
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}",
               400, "stream_options", "only be set when 'stream' is true");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"stream\":\"yes\"}", 400, "stream", "boolean");
    expect_bad(OAI_COMPLETIONS,
               "{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"include_usage\":1}}", 400,
               "include_usage", "boolean");
}

static void test_model_and_json(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(parse(OAI_COMPLETIONS, "{\"model\":\"models/tiny\",\"prompt\":\"x\"}", &r, &e),
                     0);
    oai_request_free(&r);
    expect_bad(OAI_COMPLETIONS, "{\"model\":\"gpt-4\",\"prompt\":\"x\"}", 404, "model", "\"tiny\"");
    expect_bad(OAI_COMPLETIONS, "{\"model\":4,\"prompt\":\"x\"}", 400, "model", "string");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":", 400, "", "Invalid JSON");
    expect_bad(OAI_COMPLETIONS, "[1,2]", 400, "", "JSON object");
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"prompt\":\"y\"}", 400, "", "duplicate");
    assert_int_equal(parse(OAI_COMPLETIONS,
                           "{\"prompt\":\"x\",\"kv_transfer_params\":{\"do_remote_decode\":true}}",
                           &r, &e),
                     0);
    assert_non_null(r.kv_transfer_params);
    assert_true(json_is_true(json_object_get(r.kv_transfer_params, "do_remote_decode")));
    oai_request_free(&r);
    expect_bad(OAI_COMPLETIONS, "{\"prompt\":\"x\",\"kv_transfer_params\":[1]}", 400,
               "kv_transfer_params", "object or null");
}

static void test_chat(void **state) {
    (void)state;
    oai_request r;
    oai_error e;
    assert_int_equal(
        parse(OAI_CHAT,
              "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
              "\"max_tokens\":9,\"max_completion_tokens\":5,\"logprobs\":true,\"top_logprobs\":2}",
              &r, &e),
        0);
    assert_int_equal(r.max_tokens, 5); /* max_completion_tokens wins */
    assert_int_equal(r.logprobs, 2);
    assert_true(r.add_generation_prompt);
    assert_false(r.add_special_tokens);
    assert_int_equal(json_array_size(r.messages), 1);
    assert_int_equal(r.max_tokens, 5);
    assert_false(r.parse_tool_calls);
    oai_request_free(&r);
    assert_int_equal(
        parse(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", &r, &e), 0);
    assert_int_equal(r.max_tokens, -1); /* chat: up to max_model_len */
    assert_int_equal(r.logprobs, -1);
    oai_request_free(&r);
    const char *tools =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"function\","
        "\"function\":{\"name\":\"f\",\"parameters\":{}}}]%s}";
    char b[512];
    snprintf(b, sizeof b, tools, "");
    assert_int_equal(parse(OAI_CHAT, b, &r, &e), 0);
    assert_true(r.parse_tool_calls);
    oai_request_free(&r);
    snprintf(b, sizeof b, tools, ",\"tool_choice\":\"none\"");
    assert_int_equal(parse(OAI_CHAT, b, &r, &e), 0);
    assert_false(r.parse_tool_calls);
    assert_non_null(r.tools);
    oai_request_free(&r);
    snprintf(b, sizeof b, tools, ",\"tool_choice\":\"required\""); /* structured.c's grammar */
    assert_int_equal(parse(OAI_CHAT, b, &r, &e), 0);
    assert_true(r.parse_tool_calls);
    assert_non_null(r.body);
    oai_request_free(&r);
    snprintf(b, sizeof b, tools, ",\"tool_choice\":\"any\"");
    expect_bad(OAI_CHAT, b, 400, "tool_choice", "\"required\" or {\"type\": \"function\"");
    expect_bad(OAI_CHAT, "{}", 400, "messages", "required");
    expect_bad(OAI_CHAT, "{\"messages\":[]}", 400, "messages", "non-empty");
    expect_bad(OAI_CHAT, "{\"messages\":[\"hi\"]}", 400, "messages", "element 0");
    expect_bad(OAI_CHAT,
               "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"top_logprobs\":2}", 400,
               "top_logprobs", "'logprobs' set to true");
    expect_bad(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"logprobs\":2}",
               400, "logprobs", "boolean");
    expect_bad(
        OAI_CHAT,
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":[{\"type\":\"x\"}]}", 400,
        "tools", "element 0");
    expect_bad(
        OAI_CHAT,
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_completion_tokens\":0}", 400,
        "max_completion_tokens", "between 1");
}

static void test_error_json(void **state) {
    (void)state;
    oai_error e;
    oai_error_set(&e, 400, "BadRequestError", "n", "'n' must be %d", 1);
    char *s = oai_error_json(&e);
    assert_string_equal(s, "{\"error\":{\"message\":\"'n' must be "
                           "1\",\"type\":\"BadRequestError\",\"param\":\"n\",\"code\":400}}");
    free(s);
    oai_error_set(&e, 404, "NotFoundError", NULL, "no");
    s = oai_error_json(&e);
    assert_string_equal(
        s,
        "{\"error\":{\"message\":\"no\",\"type\":\"NotFoundError\",\"param\":null,\"code\":404}}");
    free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_completion_defaults),
        cmocka_unit_test(test_generation_config_defaults),
        cmocka_unit_test(test_prompt_forms),
        cmocka_unit_test(test_sampling_ranges),
        cmocka_unit_test(test_stop_and_logprobs),
        cmocka_unit_test(test_stream_options),
        cmocka_unit_test(test_beam_search),
        cmocka_unit_test(test_logit_processors),
        cmocka_unit_test(test_model_and_json),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_error_json),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
