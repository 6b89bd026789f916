/* Unit tests: server/openai_response — SSE chunks and bodies compared byte
 * for byte with the hand-written golden streams in tests/data/server/ (see
 * its README), completions logprobs with echo.  Tool-call parsing:
 * test_tool_parser.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "server/openai_response.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A fixed vocabulary for the tests: id -> string. */
static const char *VOCAB[] = {"<unk>", " Hello", " wörld", "!", "Hi"};

static int test_namer(void *ctx, int32_t id, sbuf *out) {
    (void)ctx;
    sbuf_reset(out);
    if (id < 0 || id >= (int32_t)(sizeof VOCAB / sizeof VOCAB[0])) return -1;
    return sbuf_append(out, VOCAB[id], strlen(VOCAB[id]));
}

static const oai_namer NAMER = {test_namer, NULL};

static char *read_golden(const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tests/data/server/%s", DISAGG_SOURCE_DIR, name);
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return buf;
}

static engine_token tok(int32_t id, float lp) {
    engine_token t;
    memset(&t, 0, sizeof t);
    t.id = id;
    t.logprob = lp;
    return t;
}

static void test_completion_stream_golden(void **state) {
    (void)state;
    sbuf sse;
    sbuf_init(&sse, 1 << 20);
    assert_int_equal(
        oai_sse_event(&sse, oai_completion_chunk("cmpl-abc", 1700000000, "tiny", 0, " Hello", 6,
                                                 NULL, NULL, NULL, NULL, true)),
        0);
    json_t *lp = oai_cmpl_logprobs_new();
    engine_token t = tok(2, -0.5f);
    t.n_top = 2;
    t.top_ids[0] = 3;
    t.top_logprobs[0] = -0.25f;
    t.top_ids[1] = 2;
    t.top_logprobs[1] = -0.5f;
    size_t off = 6;
    assert_int_equal(oai_cmpl_logprobs_add(lp, &t, 1, false, &off, &NAMER), 0);
    assert_int_equal(off, 12); /* " wörld" is 6 characters (7 bytes) */
    const char *w = VOCAB[2];
    oai_sse_event(&sse, oai_completion_chunk("cmpl-abc", 1700000000, "tiny", 0, w, strlen(w), lp,
                                             NULL, NULL, NULL, true));
    oai_sse_event(&sse, oai_completion_chunk("cmpl-abc", 1700000000, "tiny", 0, "", 0, NULL, "stop",
                                             json_string("\n"), NULL, true));
    oai_usage u = {.prompt_tokens = 3, .completion_tokens = 2, .cached_tokens = 0};
    oai_sse_event(&sse, oai_usage_chunk(false, "cmpl-abc", 1700000000, "tiny", &u));
    oai_sse_done(&sse);
    assert_string_equal(sse.data, read_golden("completion_stream.sse"));
    sbuf_free(&sse);
}

static void test_chat_stream_golden(void **state) {
    (void)state;
    sbuf sse;
    sbuf_init(&sse, 1 << 20);
    oai_sse_event(&sse, oai_chat_chunk("chatcmpl-x1", 1700000001, "tiny", 0,
                                       json_pack("{s:s,s:s}", "role", "assistant", "content", ""),
                                       NULL, NULL, NULL, NULL, false));
    json_t *lp = oai_chat_logprobs_new();
    engine_token t = tok(4, -0.5f);
    t.n_top = 3;
    t.top_ids[0] = 4;
    t.top_logprobs[0] = -0.5f;
    t.top_ids[1] = 3;
    t.top_logprobs[1] = -1.25f;
    t.top_ids[2] = 1;
    t.top_logprobs[2] = -3.0f;
    assert_int_equal(oai_chat_logprobs_add(lp, &t, 2, &NAMER), 0);
    oai_sse_event(&sse,
                  oai_chat_chunk("chatcmpl-x1", 1700000001, "tiny", 0,
                                 json_pack("{s:s}", "content", "Hi"), lp, NULL, NULL, NULL, false));
    oai_sse_event(&sse, oai_chat_chunk("chatcmpl-x1", 1700000001, "tiny", 0, NULL, NULL, "length",
                                       NULL, NULL, false));
    oai_sse_done(&sse);
    assert_string_equal(sse.data, read_golden("chat_stream.sse"));
    sbuf_free(&sse);
}

static void test_chat_response_golden(void **state) {
    (void)state;
    json_t *choices = json_array();
    json_array_append_new(choices, oai_chat_choice(0, "Hi!", 3, false, NULL, NULL, "stop", NULL));
    oai_usage u = {.prompt_tokens = 10, .completion_tokens = 2, .cached_tokens = 8};
    json_t *r = oai_response(true, "chatcmpl-x2", 1700000002, "tiny", choices, &u);
    char *s = json_dumps(r, JSON_COMPACT);
    json_decref(r);
    char *want = read_golden("chat_response.json");
    want[strcspn(want, "\n")] = 0;
    assert_string_equal(s, want);
    free(s);
}

/* A P/D request's usage carries the kv_transfer extension; others do not. */
static void test_usage_kv_transfer(void **state) {
    (void)state;
    oai_usage u = {.prompt_tokens = 40, .completion_tokens = 3, .cached_tokens = 16};
    json_t *j = oai_usage_json(&u);
    assert_null(json_object_get(j, "kv_transfer"));
    json_decref(j);
    u.kv_transfer = true;
    u.received_tokens = 24;
    u.computed_tokens = 1;
    j = oai_usage_json(&u);
    char *s = json_dumps(json_object_get(j, "kv_transfer"), JSON_COMPACT);
    assert_string_equal(s, "{\"received_prompt_tokens\":24,\"computed_prompt_tokens\":1}");
    free(s);
    json_decref(j);
}

static void test_echo_logprobs_and_clamp(void **state) {
    (void)state;
    json_t *lp = oai_cmpl_logprobs_new();
    size_t off = 0;
    engine_token p0 = tok(1, 0.0f), p1 = tok(2, -1.0f / 0.0f); /* -inf */
    assert_int_equal(oai_cmpl_logprobs_add(lp, &p0, 0, true, &off, &NAMER), 0);
    assert_int_equal(oai_cmpl_logprobs_add(lp, &p1, 0, false, &off, &NAMER), 0);
    char *s = json_dumps(lp, JSON_COMPACT);
    assert_string_equal(s, "{\"text_offset\":[0,6],\"token_logprobs\":[null,-9999.0],\"tokens\":"
                           "[\" Hello\",\" wörld\"],\"top_logprobs\":[null,{\" wörld\":-9999.0}]}");
    free(s);
    json_decref(lp);
}

static void test_prompt_logprobs(void **state) {
    (void)state;
    engine_token pl[2] = {tok(1, 0.0f), tok(3, -2.0f)};
    pl[1].n_top = 2;
    pl[1].top_ids[0] = 4;
    pl[1].top_logprobs[0] = -0.5f;
    pl[1].top_ids[1] = 3;
    pl[1].top_logprobs[1] = -2.0f;
    json_t *a = oai_prompt_logprobs_json(pl, 2, 1, &NAMER);
    char *s = json_dumps(a, JSON_COMPACT);
    assert_string_equal(s, "[null,{\"3\":{\"logprob\":-2.0,\"rank\":2,\"decoded_token\":\"!\"},"
                           "\"4\":{\"logprob\":-0.5,\"rank\":1,\"decoded_token\":\"Hi\"}}]");
    free(s);
    json_decref(a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_completion_stream_golden),
        cmocka_unit_test(test_chat_stream_golden),
        cmocka_unit_test(test_chat_response_golden),
        cmocka_unit_test(test_usage_kv_transfer),
        cmocka_unit_test(test_echo_logprobs_and_clamp),
        cmocka_unit_test(test_prompt_logprobs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
