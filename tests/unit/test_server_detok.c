/* Unit tests: server/detok_stream — stop strings with holdback (a stop
 * string is never partially emitted, text is cut at the earliest stop,
 * characters are never split) and streaming detokenization of real token ids
 * against the text Hugging Face decoded (tests/data/tokenizer/decode.jsonl,
 * Qwen2.5 tokenizer in ../shared/data/qwen2.5-tokenizer). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "server/detok_stream.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Push pieces one at a time; after each push the released text must never
 * end inside a stop string's prefix that later completes.  Returns the whole
 * released text (caller frees) and the stop index. */
static char *run_pieces(const char *const *pieces, int n, char *const *stops, int n_stops,
                        bool include, int *stop_index, sbuf *steps) {
    detok_stream d;
    assert_int_equal(detok_stream_init(&d, NULL, true, stops, n_stops, include), 0);
    sbuf out;
    sbuf_init(&out, 1 << 20);
    for (int i = 0; i < n; i++) {
        size_t before = out.len;
        int rc = detok_stream_push_text(&d, pieces[i], strlen(pieces[i]), &out);
        assert_true(rc == 0 || rc == 1);
        if (steps)
            sbuf_appendf(steps, "[%.*s]", (int)(out.len - before),
                         out.data ? out.data + before : "");
        if (rc == 1) break;
    }
    if (d.stop_index < 0) assert_int_equal(detok_stream_finish(&d, &out), 0);
    *stop_index = d.stop_index;
    detok_stream_free(&d);
    return sbuf_detach(&out, NULL);
}

static void test_no_stops_passthrough(void **state) {
    (void)state;
    const char *p[] = {"Hel", "lo", " world"};
    int si;
    sbuf steps;
    sbuf_init(&steps, 1 << 16);
    char *t = run_pieces(p, 3, NULL, 0, false, &si, &steps);
    assert_string_equal(t, "Hello world");
    assert_string_equal(steps.data, "[Hel][lo][ world]"); /* nothing held back */
    assert_int_equal(si, -1);
    free(t);
    sbuf_free(&steps);
}

static void test_stop_across_pieces_is_never_emitted(void **state) {
    (void)state;
    char *stops[] = {"END"};
    const char *p[] = {"abc E", "N", "D tail"};
    int si;
    sbuf steps;
    sbuf_init(&steps, 1 << 16);
    char *t = run_pieces(p, 3, stops, 1, false, &si, &steps);
    assert_string_equal(t, "abc ");
    assert_int_equal(si, 0);
    /* "E" and "EN" were held, never released */
    assert_string_equal(steps.data, "[abc][ ][]");
    free(t);
    sbuf_free(&steps);
}

static void test_false_alarm_is_released(void **state) {
    (void)state;
    char *stops[] = {"END"};
    const char *p[] = {"xE", "Nx", "yz"};
    int si;
    char *t = run_pieces(p, 3, stops, 1, false, &si, NULL);
    assert_string_equal(t, "xENxyz");
    assert_int_equal(si, -1);
    free(t);
}

static void test_earliest_stop_wins_and_include(void **state) {
    (void)state;
    char *stops[] = {"world", "lo w"};
    const char *p[] = {"hello world"};
    int si;
    char *t = run_pieces(p, 1, stops, 2, false, &si, NULL);
    assert_string_equal(t, "hel");
    assert_int_equal(si, 1);
    free(t);
    t = run_pieces(p, 1, stops, 2, true, &si, NULL);
    assert_string_equal(t, "hello w"); /* include_stop_str_in_output */
    free(t);
}

static void test_holdback_keeps_characters_whole(void **state) {
    (void)state;
    char *stops[] = {"xyz1"};
    /* "é" is 2 bytes: the holdback boundary (3 bytes) would split it */
    const char *p[] = {"aé", "bc", "d"};
    int si;
    sbuf steps;
    sbuf_init(&steps, 1 << 16);
    char *t = run_pieces(p, 3, stops, 1, false, &si, &steps);
    assert_string_equal(t, "aébcd");
    assert_string_equal(steps.data, "[][a][é]");
    free(t);
    sbuf_free(&steps);
}

static void test_stops_off_before_min_tokens(void **state) {
    (void)state;
    char *stops[] = {"ab"};
    detok_stream d;
    assert_int_equal(detok_stream_init(&d, NULL, true, stops, 1, false), 0);
    sbuf out;
    sbuf_init(&out, 1 << 16);
    detok_stream_set_stops(&d, false);
    assert_int_equal(detok_stream_push_text(&d, "xab", 3, &out), 0); /* ignored, not held */
    assert_string_equal(out.data, "xab");
    detok_stream_set_stops(&d, true);
    assert_int_equal(detok_stream_push_text(&d, "cab", 3, &out), 1);
    assert_string_equal(out.data, "xabc");
    sbuf_free(&out);
    detok_stream_free(&d);
}

/* Real ids: the stream decoder + stop strings must equal HF's decode,
 * truncated at the first occurrence of the stop string. */
static void test_tokens_against_hf(void **state) {
    (void)state;
    char dir[4096], path[4096], err[512];
    snprintf(dir, sizeof dir, "%s/../shared/data/qwen2.5-tokenizer", DISAGG_SOURCE_DIR);
    snprintf(path, sizeof path, "%s/tests/data/tokenizer/decode.jsonl", DISAGG_SOURCE_DIR);
    tokenizer *tok = NULL;
    if (tokenizer_load(dir, &tok, err, sizeof err)) fail_msg("tokenizer_load(%s): %s", dir, err);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[1 << 16];
    int cases = 0, stopped = 0;
    while (fgets(line, sizeof line, f)) {
        json_t *j = json_loads(line, JSON_ALLOW_NUL, NULL);
        assert_non_null(j);
        const char *want = json_string_value(json_object_get(j, "text"));
        bool skip = json_is_true(json_object_get(j, "skip_special"));
        json_t *ids = json_object_get(j, "ids");
        size_t wl = json_string_length(json_object_get(j, "text"));
        /* a stop string taken from the middle of the expected text */
        char stop[8] = "";
        if (wl >= 8) {
            size_t at = wl / 2;
            while (at > 0 && ((unsigned char)want[at] & 0xC0) == 0x80)
                at--;
            size_t l = 0;
            while (l < 3 && at + l < wl)
                l++;
            while (at + l < wl && ((unsigned char)want[at + l] & 0xC0) == 0x80)
                l++;
            memcpy(stop, want + at, l);
            stop[l] = 0;
            if (strlen(stop) != l) stop[0] = 0; /* no NUL inside a stop string */
        }
        char *stops[] = {stop};
        detok_stream d;
        assert_int_equal(detok_stream_init(&d, tok, skip, stops, stop[0] ? 1 : 0, false), 0);
        sbuf out;
        sbuf_init(&out, 1 << 20);
        int rc = 0;
        for (size_t i = 0; i < json_array_size(ids) && rc == 0; i++)
            rc = detok_stream_push_token(&d, (int32_t)json_integer_value(json_array_get(ids, i)),
                                         &out);
        assert_true(rc == 0 || rc == 1);
        if (rc == 0) assert_int_equal(detok_stream_finish(&d, &out), 0);
        const char *hit = stop[0] ? memmem(want, wl, stop, strlen(stop)) : NULL;
        size_t expect_len = hit ? (size_t)(hit - want) : wl;
        if (out.len != expect_len || memcmp(out.data ? out.data : "", want, expect_len))
            fail_msg("line %d: got '%s' want '%.*s' (stop '%s')", cases + 1,
                     out.data ? out.data : "", (int)expect_len, want, stop);
        if (hit) stopped++;
        sbuf_free(&out);
        detok_stream_free(&d);
        json_decref(j);
        cases++;
    }
    fclose(f);
    assert_true(cases > 1000);
    assert_true(stopped > 500);
    tokenizer_free(tok);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_stops_passthrough),
        cmocka_unit_test(test_stop_across_pieces_is_never_emitted),
        cmocka_unit_test(test_false_alarm_is_released),
        cmocka_unit_test(test_earliest_stop_wins_and_include),
        cmocka_unit_test(test_holdback_keeps_characters_whole),
        cmocka_unit_test(test_stops_off_before_min_tokens),
        cmocka_unit_test(test_tokens_against_hf),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
