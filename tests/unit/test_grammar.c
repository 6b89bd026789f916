/*
 * test_grammar — the structured-output grammar engine (grammar/): GBNF parsing and its
 * errors, JSON Schema / regex / choice front ends accepting exactly what they should
 * (integer ranges checked exhaustively), UTF-8 code points split across tokens, and every
 * token mask against the brute force (a token is allowed iff its bytes advance the state).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar.h"

static grammar_vocab *vocab;
static int n_vocab;
static uint8_t tok_bytes[2048][8];
static size_t tok_len[2048];

/* All 256 single bytes, then multi-byte tokens from JSON-ish pieces and random strings. */
static int setup(void **state) {
    (void)state;
    static const char *pieces[] = {
        "{\"", "\":",      "\": ", "\",", "\"}",  "true",  "false", "null",  "  ",  "\n", "12",
        "3.",  "-1",       "e+",   "ab",  "abc",  "\\u",   "\\\"",  "[\"",   "\"]", "},", "{",
        "名",  "\xe5\x90", "\x8d", "é",   "\xc3", "\xa9x", "00",    "120",   "-5",  "10", "99",
        "yes", "no",       "ye",   "s!",  "@",    ".com",  "\"x\"", "x\": 1"};
    int n = 0;
    for (int b = 0; b < 256; b++) {
        tok_bytes[n][0] = (uint8_t)b;
        tok_len[n++] = 1;
    }
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) {
        tok_len[n] = strlen(pieces[i]);
        memcpy(tok_bytes[n], pieces[i], tok_len[n]);
        n++;
    }
    unsigned x = 12345;
    const char alpha[] = "{}[]\":, 0123456789abcxyz-.\\e";
    while (n < 1500) {
        x = x * 1103515245u + 12345u;
        size_t l = 2 + (x >> 16) % 5;
        for (size_t k = 0; k < l; k++)
            tok_bytes[n][k] =
                (uint8_t)alpha[((x = x * 1103515245u + 12345u) >> 16) % (sizeof alpha - 1)];
        tok_len[n++] = l;
    }
    n_vocab = n + 2; /* two specials at the end */
    const uint8_t *bytes[2048];
    size_t lens[2048];
    uint8_t special[2048] = {0};
    for (int i = 0; i < n; i++)
        bytes[i] = tok_bytes[i], lens[i] = tok_len[i];
    bytes[n] = (const uint8_t *)"<eos>", lens[n] = 5, special[n] = 1;
    bytes[n + 1] = NULL, lens[n + 1] = 0;
    vocab = grammar_vocab_new(n_vocab, bytes, lens, special);
    return vocab ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    grammar_vocab_free(vocab);
    return 0;
}

static grammar *compile(grammar_kind k, const char *text, int any_ws) {
    char err[512] = "";
    grammar_options o = {.any_whitespace = any_ws};
    grammar *g = grammar_compile(k, text, strlen(text), &o, vocab, err, sizeof err);
    if (!g) fprintf(stderr, "compile failed: %s\n", err);
    assert_non_null(g);
    return g;
}

static int accepts(grammar *g, const char *s) {
    grammar_state st = grammar_advance_bytes(g, grammar_start(g), (const uint8_t *)s, strlen(s));
    return st != GRAMMAR_DEAD && grammar_state_accepting(g, st);
}

static int prefix_ok(grammar *g, const char *s) {
    return grammar_advance_bytes(g, grammar_start(g), (const uint8_t *)s, strlen(s)) !=
           GRAMMAR_DEAD;
}

static void expect_error(grammar_kind k, const char *text, const char *needle) {
    char err[512] = "";
    grammar_options o = {.any_whitespace = 1};
    grammar *g = grammar_compile(k, text, strlen(text), &o, vocab, err, sizeof err);
    if (g || !strstr(err, needle))
        fprintf(stderr, "for %s: got '%s', want '%s'\n", text, err, needle);
    assert_null(g);
    assert_non_null(strstr(err, needle));
}

static void test_gbnf(void **state) {
    (void)state;
    grammar *g = compile(GRAMMAR_GBNF,
                         "# comment\nroot ::= greet \" \" name (\"!\")?\n"
                         "greet ::= \"hi\" | \"hello\"\nname ::= [a-z]+ [0-9]{2,3}\n",
                         1);
    assert_true(accepts(g, "hi bob12"));
    assert_true(accepts(g, "hello x999!"));
    assert_false(accepts(g, "hi bob1"));
    assert_false(accepts(g, "hi bob1234"));
    assert_false(accepts(g, "hey bob12"));
    assert_true(prefix_ok(g, "hel"));
    assert_false(grammar_state_terminated(
        g, grammar_advance_bytes(g, grammar_start(g), (const uint8_t *)"hi a12", 6)));
    assert_true(grammar_state_terminated(
        g, grammar_advance_bytes(g, grammar_start(g), (const uint8_t *)"hi a123!", 8)));
    grammar_unref(g);
    /* alternatives on continuation lines, nested groups, negated classes, any char */
    g = compile(GRAMMAR_GBNF, "root ::= (\"a\" (\"b\" | \"c\")*)\n  | [^a-z] .\n", 1);
    assert_true(accepts(g, "abcbc"));
    assert_true(accepts(g, "A\xe5\x90\x8d"));
    assert_false(accepts(g, "bb"));
    grammar_unref(g);
    expect_error(GRAMMAR_GBNF, "root ::= x", "'x' is used but not defined");
    expect_error(GRAMMAR_GBNF, "start ::= \"a\"", "no 'root' rule");
    expect_error(GRAMMAR_GBNF, "root ::= \"a", "unterminated string");
    expect_error(GRAMMAR_GBNF, "root ::= [a-", "unterminated character class");
    expect_error(GRAMMAR_GBNF, "root ::= root \"a\" | \"b\"", "left-recursive");
    expect_error(GRAMMAR_GBNF, "root ::= (\"a\"", "expected ')'");
    expect_error(GRAMMAR_GBNF, "root ::= \"a\"{3,1}", "bad repetition count");
    expect_error(GRAMMAR_GBNF, "root ::= \"a\"\nroot ::= \"b\"", "defined twice");
}

static void test_json_schema(void **state) {
    (void)state;
    grammar *g = compile(GRAMMAR_JSON_SCHEMA,
                         "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\","
                         "\"maxLength\":3},\"age\":{\"type\":\"integer\"},\"ok\":{\"type\":"
                         "\"boolean\"}},\"required\":[\"name\",\"age\"]}",
                         1);
    assert_true(accepts(g, "{\"name\": \"abc\", \"age\": 7}"));
    assert_true(accepts(g, "{ \"name\":\"\",\n\"age\":-12 , \"ok\" : true }"));
    assert_false(accepts(g, "{\"name\": \"abcd\", \"age\": 7}"));        /* maxLength */
    assert_false(accepts(g, "{\"age\": 7, \"name\": \"a\"}"));           /* schema order */
    assert_false(accepts(g, "{\"name\": \"a\"}"));                       /* required */
    assert_false(accepts(g, "{\"name\": \"a\", \"age\": 7, \"x\": 1}")); /* additional */
    assert_false(accepts(g, "{\"name\": \"a\", \"age\": 07}"));
    assert_false(accepts(g, "{\"name\": \"a\nb\", \"age\": 7}")); /* control char */
    grammar_unref(g);
    /* compact: no whitespace but ", " and ": " */
    g = compile(
        GRAMMAR_JSON_SCHEMA,
        "{\"type\":\"array\",\"items\":{\"enum\":[1,\"x\",null]},\"minItems\":1,\"maxItems\":2}",
        0);
    assert_true(accepts(g, "[1, \"x\"]"));
    assert_true(accepts(g, "[null]"));
    assert_false(accepts(g, "[]"));
    assert_false(accepts(g, "[1,\"x\"]"));
    assert_false(accepts(g, "[1, 1, 1]"));
    grammar_unref(g);
    g = compile(
        GRAMMAR_JSON_SCHEMA,
        "{\"$defs\":{\"n\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
        "\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/n\"},{\"type\":\"null\"}]}},\"required\":["
        "\"v\",\"next\"]}},\"$ref\":\"#/$defs/n\"}",
        0);
    assert_true(accepts(g, "{\"v\": 1, \"next\": {\"v\": 2, \"next\": null}}"));
    assert_false(accepts(g, "{\"v\": 1, \"next\": {\"v\": 2}}"));
    grammar_unref(g);
    g = compile(GRAMMAR_JSON_OBJECT, "", 1);
    assert_true(accepts(g, "{\"a\": [1, 2.5e3, {\"b\": null}], \"c\": \"\\u00e9\"}"));
    assert_false(accepts(g, "[1]"));
    grammar_unref(g);
    g = compile(GRAMMAR_JSON_SCHEMA, "{\"type\":\"string\",\"format\":\"date-time\"}", 1);
    assert_true(accepts(g, "\"2024-02-29T13:05:00Z\""));
    assert_true(accepts(g, "\"2024-02-29T13:05:00.25+01:00\""));
    assert_false(accepts(g, "\"2024-13-01T00:00:00Z\""));
    grammar_unref(g);
    expect_error(GRAMMAR_JSON_SCHEMA, "{\"type\":\"foo\"}", "unknown type 'foo'");
    expect_error(GRAMMAR_JSON_SCHEMA, "{\"not\":{}}", "'not' is not supported");
    expect_error(GRAMMAR_JSON_SCHEMA, "{\"$ref\":\"#/$defs/x\"}", "points to nothing");
    expect_error(GRAMMAR_JSON_SCHEMA, "{\"type\":", "not valid JSON");
    expect_error(GRAMMAR_JSON_SCHEMA, "{\"type\":\"integer\",\"minimum\":5,\"maximum\":1}",
                 "range is empty");
}

/* Every integer in [-2100, 2100] against the schema's range. */
static void check_range(const char *schema, long lo, long hi) {
    grammar *g = compile(GRAMMAR_JSON_SCHEMA, schema, 0);
    char buf[32];
    for (long v = -2100; v <= 2100; v++) {
        snprintf(buf, sizeof buf, "%ld", v);
        int want = v >= lo && v <= hi;
        if (accepts(g, buf) != want)
            fprintf(stderr, "%s: %ld %s\n", schema, v, want ? "rejected" : "accepted");
        assert_int_equal(accepts(g, buf), want);
    }
    assert_false(accepts(g, "-0"));
    assert_false(accepts(g, "007"));
    grammar_unref(g);
}

static void test_integer_ranges(void **state) {
    (void)state;
    check_range("{\"type\":\"integer\",\"minimum\":0,\"maximum\":120}", 0, 120);
    check_range("{\"type\":\"integer\",\"minimum\":-50,\"maximum\":50}", -50, 50);
    check_range("{\"type\":\"integer\",\"minimum\":10}", 10, 1L << 40);
    check_range("{\"type\":\"integer\",\"maximum\":999}", -(1L << 40), 999);
    check_range("{\"type\":\"integer\",\"maximum\":-7}", -(1L << 40), -7);
    check_range("{\"type\":\"integer\",\"minimum\":-1234,\"maximum\":-56}", -1234, -56);
    check_range("{\"type\":\"integer\",\"exclusiveMinimum\":0,\"exclusiveMaximum\":1000}", 1, 999);
    check_range("{\"type\":\"integer\",\"minimum\":1999,\"maximum\":2001}", 1999, 2001);
}

static void test_regex_choice(void **state) {
    (void)state;
    grammar *g = compile(GRAMMAR_REGEX, "^(\\+|-)?\\d{2,3}(\\.[a-c]+)?[^\\s]$", 1);
    assert_true(accepts(g, "12x"));
    assert_true(accepts(g, "-123.abca!"));
    assert_false(accepts(g, "1x"));
    assert_false(accepts(g, "12 "));
    assert_false(accepts(g, "+1234x"));
    grammar_unref(g);
    g = compile(GRAMMAR_REGEX, "(?:ab|c)*[.]{1}", 1);
    assert_true(accepts(g, "abcab."));
    assert_false(accepts(g, "abx."));
    grammar_unref(g);
    g = compile(GRAMMAR_CHOICE, "[\"名前\",\"é\",\"a\\\"b\"]", 1);
    assert_true(accepts(g, "名前"));
    assert_true(accepts(g, "é"));
    assert_true(accepts(g, "a\"b"));
    assert_false(accepts(g, "名"));
    assert_true(prefix_ok(g, "\xe5\x90")); /* inside a code point */
    assert_false(prefix_ok(g, "\xe5\x91"));
    assert_false(prefix_ok(g, "\xc3"
                              "\xa8"));
    grammar_unref(g);
    expect_error(GRAMMAR_REGEX, "(a", "unbalanced '('");
    expect_error(GRAMMAR_REGEX, "a(?=b)", "lookarounds");
    expect_error(GRAMMAR_REGEX, "(a)\\1", "not supported");
    expect_error(GRAMMAR_CHOICE, "[]", "non-empty list");
    expect_error(GRAMMAR_CHOICE, "[1]", "not a string");
}

/* Walks g with pseudo-random allowed tokens; at each state every token's mask bit must
 * equal whether its bytes advance the state (special and empty tokens never). */
static void brute_masks(grammar *g, int walks, int steps) {
    unsigned x = 7;
    for (int w = 0; w < walks; w++) {
        grammar_state s = grammar_start(g);
        for (int k = 0; k < steps; k++) {
            const uint32_t *m = grammar_state_mask(g, s);
            int allowed[2048], na = 0;
            for (int t = 0; t < n_vocab; t++) {
                int bit = m[t >> 5] >> (t & 31) & 1;
                int want = grammar_advance_token(g, s, t) != GRAMMAR_DEAD;
                if (bit != want)
                    fprintf(stderr, "token %d: mask %d, brute force %d\n", t, bit, want);
                assert_int_equal(bit, want);
                if (bit) allowed[na++] = t;
            }
            assert_false(m[(n_vocab - 2) >> 5] >> ((n_vocab - 2) & 31) & 1); /* special */
            if (!na) {
                assert_true(grammar_state_accepting(g, s));
                break;
            }
            x = x * 1103515245u + 12345u;
            s = grammar_advance_token(g, s, allowed[(x >> 8) % (unsigned)na]);
        }
    }
}

static void test_masks_brute_force(void **state) {
    (void)state;
    grammar *g = compile(GRAMMAR_JSON_OBJECT, "", 1);
    brute_masks(g, 6, 40);
    grammar_unref(g);
    g = compile(
        GRAMMAR_JSON_SCHEMA,
        "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\",\"minimum\":-5,"
        "\"maximum\":120},\"s\":{\"type\":\"string\",\"maxLength\":4}},\"required\":[\"x\"]}",
        0);
    brute_masks(g, 6, 30);
    grammar_unref(g);
    g = compile(GRAMMAR_CHOICE, "[\"名前\",\"éa\",\"yes!\",\"no\"]", 1);
    brute_masks(g, 6, 10);
    grammar_unref(g);
    int ns = 0, nm = 0;
    g = compile(GRAMMAR_REGEX, "[a-c]{1,3}@[a-c]+\\.com", 1);
    brute_masks(g, 6, 20);
    grammar_stats(g, &ns, &nm, NULL);
    assert_true(ns > 1 && nm > 1);
    grammar_unref(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gbnf),
        cmocka_unit_test(test_json_schema),
        cmocka_unit_test(test_integer_ranges),
        cmocka_unit_test(test_regex_choice),
        cmocka_unit_test(test_masks_brute_force),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
