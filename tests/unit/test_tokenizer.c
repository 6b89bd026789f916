/*
 * test_tokenizer — src/model/tokenizer against Hugging Face `tokenizers`.
 *
 * Expected values come from HF only: the 46 vectors and known ids in
 * ../shared/data/qwen2.5-tokenizer, and tests/data/tokenizer/ written by
 * tools/gen_tokenizer_golden.py (encode.jsonl, decode.jsonl, added.json,
 * meta.json with the id hash of the whole sotu corpus).  Also: load errors,
 * invalid UTF-8, the stream decoder, and encoding speed (printed, not
 * asserted).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <utf8proc.h>

#include "model/tokenizer.h"

/* ---- fixtures ---------------------------------------------------------- */

static char g_tok_dir[4096];  /* ../shared/data/qwen2.5-tokenizer */
static char g_data_dir[4096]; /* tests/data/tokenizer */
static tokenizer *g_tok;      /* the Qwen2.5 tokenizer, loaded once */

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
    int rc = tokenizer_load(g_tok_dir, &g_tok, err, sizeof(err));
    if (rc) {
        fprintf(stderr, "FAIL: tokenizer_load(%s): %s\n", g_tok_dir, err);
        return -1;
    }
    return 0;
}

static int teardown_all(void **state) {
    (void)state;
    tokenizer_free(g_tok);
    return 0;
}

/* Read a whole file (NUL-terminated); fails the test if missing. */
static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = 0;
    fclose(f);
    if (len) *len = (size_t)n;
    return buf;
}

/* Calls fn for every JSON line of a tests/data/tokenizer file. */
typedef void (*line_fn)(json_t *obj, size_t lineno, void *arg);
static size_t for_each_jsonl(const char *name, line_fn fn, void *arg) {
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", g_data_dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open golden file %s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0, lineno = 0;
    ssize_t k;
    while ((k = getline(&line, &cap, f)) > 0) {
        lineno++;
        json_error_t je;
        json_t *o = json_loadb(line, (size_t)k, JSON_ALLOW_NUL, &je);
        if (!o) fail_msg("%s:%zu: bad JSON: %s", path, lineno, je.text);
        fn(o, lineno, arg);
        json_decref(o);
    }
    free(line);
    fclose(f);
    return lineno;
}

/* JSON array of ints -> malloc'ed int32 array. */
static int32_t *json_ids(json_t *arr, size_t *n) {
    *n = json_array_size(arr);
    int32_t *v = malloc((*n + 1) * sizeof(int32_t));
    assert_non_null(v);
    for (size_t i = 0; i < *n; i++)
        v[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    return v;
}

static void print_ids(const char *label, const int32_t *v, size_t n) {
    fprintf(stderr, "  %s (%zu):", label, n);
    for (size_t i = 0; i < n && i < 40; i++)
        fprintf(stderr, " %d", v[i]);
    fprintf(stderr, n > 40 ? " ...\n" : "\n");
}

/* Encode and compare; returns true when equal, printing a diff otherwise. */
static bool check_encode(const tokenizer *tok, const char *text, size_t len, const int32_t *want,
                         size_t nwant, const char *where) {
    int32_t *ids = NULL;
    size_t n = 0;
    char err[256] = "";
    int rc = tokenizer_encode(tok, text, len, true, &ids, &n, err, sizeof(err));
    bool ok = rc == 0 && n == nwant && memcmp(ids, want, n * sizeof(int32_t)) == 0;
    if (!ok) {
        fprintf(stderr, "MISMATCH %s: text (%zu bytes) \"%.*s\" rc=%d %s\n", where, len,
                (int)(len < 200 ? len : 200), text, rc, err);
        print_ids("want", want, nwant);
        if (rc == 0) print_ids("got ", ids, n);
    }
    free(ids);
    return ok;
}

/* ---- known values ------------------------------------------------------ */

static void test_config(void **state) {
    (void)state;
    assert_int_equal(tokenizer_vocab_size(g_tok), 151665);
    assert_int_equal(tokenizer_eos_id(g_tok), 151645);
    assert_string_equal(tokenizer_eos_token(g_tok), "<|im_end|>");
    assert_int_equal(tokenizer_pad_id(g_tok), 151643);
    assert_int_equal(tokenizer_bos_id(g_tok), -1);
    assert_int_equal(tokenizer_model_max_length(g_tok), 131072);
    assert_non_null(tokenizer_chat_template(g_tok));
    assert_int_equal(tokenizer_token_id(g_tok, "<|im_start|>"), 151644);
    assert_int_equal(tokenizer_token_id(g_tok, "<tool_call>"), 151657);
    assert_int_equal(tokenizer_token_id(g_tok, "ĠHello"), 21927);
    assert_int_equal(tokenizer_token_id(g_tok, "no such token here"), -1);
    assert_true(tokenizer_is_special(g_tok, 151645));
    assert_false(tokenizer_is_special(g_tok, 151657)); /* <tool_call> is not special */
    assert_false(tokenizer_is_special(g_tok, 9707));
    size_t n = 0;
    const uint8_t *b = tokenizer_token_bytes(g_tok, 21927, &n);
    assert_int_equal(n, 6);
    assert_memory_equal(b, " Hello", 6);
}

static void test_known_ids(void **state) {
    (void)state; /* from ../shared/data/qwen2.5-tokenizer/README.md (HF tokenizers) */
    static const int32_t hw[] = {9707, 1879}, sh[] = {21927}, hnw[] = {14990, 271, 14615},
                         im[] = {40, 2776}, nh[] = {108386, 3837, 99489};
    assert_true(check_encode(g_tok, "Hello world", 11, hw, 2, "README"));
    assert_true(check_encode(g_tok, " Hello", 6, sh, 1, "README"));
    assert_true(check_encode(g_tok, "hello\n\nworld", 12, hnw, 3, "README"));
    assert_true(check_encode(g_tok, "I'm", 3, im, 2, "README"));
    const char *zh = "你好，世界";
    assert_true(check_encode(g_tok, zh, strlen(zh), nh, 3, "README"));
}

/* vocab-test.inp / .out: inputs separated by "\n__ggml_vocab_test__\n". */
static void test_vocab_test_vectors(void **state) {
    (void)state;
    char path[4200];
    snprintf(path, sizeof(path), "%s/vocab-test.inp", g_tok_dir);
    char *inp = read_file(path, NULL);
    snprintf(path, sizeof(path), "%s/vocab-test.out", g_tok_dir);
    char *out = read_file(path, NULL);
    const char *sep = "\n__ggml_vocab_test__\n";
    char *p = inp, *o = out;
    size_t count = 0, bad = 0;
    for (;;) {
        char *e = strstr(p, sep);
        if (!e) break;
        char *oe = strchr(o, '\n');
        assert_non_null(oe);
        *oe = 0;
        int32_t want[512];
        size_t nw = 0;
        for (char *q = o; *q;) {
            char *end;
            long v = strtol(q, &end, 10);
            if (end == q) break;
            assert_true(nw < 512);
            want[nw++] = (int32_t)v;
            q = end;
        }
        char where[64];
        snprintf(where, sizeof(where), "vocab-test #%zu", count);
        if (!check_encode(g_tok, p, (size_t)(e - p), want, nw, where)) bad++;
        count++;
        p = e + strlen(sep);
        o = oe + 1;
    }
    free(inp);
    free(out);
    fprintf(stderr, "vocab-test: %zu vectors, %zu mismatches\n", count, bad);
    assert_int_equal(count, 46);
    assert_int_equal(bad, 0);
}

/* ---- golden files ------------------------------------------------------ */

typedef struct golden_stats {
    size_t n;     /* vectors seen */
    size_t bad;   /* mismatches */
    size_t extra; /* vectors a secondary check applied to */
} golden_stats;

static void encode_line(json_t *o, size_t lineno, void *arg) {
    golden_stats *st = arg;
    json_t *jt = json_object_get(o, "text");
    size_t nw;
    int32_t *want = json_ids(json_object_get(o, "ids"), &nw);
    char where[96];
    snprintf(where, sizeof(where), "encode.jsonl:%zu (%s)", lineno,
             json_string_value(json_object_get(o, "cat")));
    if (!check_encode(g_tok, json_string_value(jt), json_string_length(jt), want, nw, where))
        st->bad++;
    st->n++;
    free(want);
}

static void test_golden_encode(void **state) {
    (void)state;
    golden_stats st = {0};
    for_each_jsonl("encode.jsonl", encode_line, &st);
    fprintf(stderr, "encode.jsonl: %zu vectors, %zu mismatches\n", st.n, st.bad);
    assert_true(st.n >= 3000);
    assert_int_equal(st.bad, 0);
}

/* Decoding HF's ids gives back every NFC input. */
static void roundtrip_line(json_t *o, size_t lineno, void *arg) {
    golden_stats *st = arg;
    st->n++;
    if (!json_is_true(json_object_get(o, "nfc"))) return;
    st->extra++;
    json_t *jt = json_object_get(o, "text");
    size_t nw;
    int32_t *ids = json_ids(json_object_get(o, "ids"), &nw);
    char *txt = NULL;
    size_t len = 0;
    char err[256];
    int rc = tokenizer_decode(g_tok, ids, nw, false, &txt, &len, err, sizeof(err));
    if (rc || len != json_string_length(jt) || memcmp(txt, json_string_value(jt), len) != 0) {
        fprintf(stderr, "ROUNDTRIP MISMATCH encode.jsonl:%zu rc=%d\n", lineno, rc);
        st->bad++;
    }
    free(txt);
    free(ids);
}

static void test_golden_roundtrip(void **state) {
    (void)state;
    golden_stats st = {0};
    for_each_jsonl("encode.jsonl", roundtrip_line, &st);
    fprintf(stderr, "roundtrip: %zu NFC inputs of %zu, %zu mismatches\n", st.extra, st.n, st.bad);
    assert_true(st.extra > st.n / 2);
    assert_int_equal(st.bad, 0);
}

/* decode.jsonl: whole decode and stream decode both equal HF's decode; every
 * stream piece is valid UTF-8 (no half characters). */
static void decode_line(json_t *o, size_t lineno, void *arg) {
    golden_stats *st = arg;
    st->n++;
    size_t n;
    int32_t *ids = json_ids(json_object_get(o, "ids"), &n);
    bool skip = json_is_true(json_object_get(o, "skip_special"));
    json_t *jt = json_object_get(o, "text");
    const char *want = json_string_value(jt);
    size_t wlen = json_string_length(jt);
    char *txt = NULL;
    size_t len = 0;
    char err[256];
    int rc = tokenizer_decode(g_tok, ids, n, skip, &txt, &len, err, sizeof(err));
    if (rc || len != wlen || memcmp(txt, want, len) != 0) {
        fprintf(stderr, "DECODE MISMATCH decode.jsonl:%zu rc=%d %s\n  want \"%s\"\n  got  \"%s\"\n",
                lineno, rc, rc ? err : "", want, rc ? "" : txt);
        st->bad++;
    }
    free(txt);

    tokenizer_stream ts;
    tokenizer_stream_init(&ts, skip);
    size_t cap = TOKENIZER_STREAM_OUT_CAP(g_tok);
    char *piece = malloc(cap);
    char *acc = malloc(wlen * 2 + 3 * n + 16);
    size_t alen = 0, plen;
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        ok = tokenizer_stream_push(g_tok, &ts, ids[i], piece, cap, &plen) == 0 &&
             tokenizer_utf8_check(piece, plen) == plen;
        memcpy(acc + alen, piece, plen);
        alen += plen;
    }
    ok = ok && tokenizer_stream_flush(&ts, piece, cap, &plen) == 0;
    memcpy(acc + alen, piece, plen);
    alen += plen;
    if (!ok || alen != wlen || memcmp(acc, want, wlen) != 0) {
        fprintf(stderr, "STREAM MISMATCH decode.jsonl:%zu\n", lineno);
        st->bad++;
    }
    free(piece);
    free(acc);
    free(ids);
}

static void test_golden_decode(void **state) {
    (void)state;
    golden_stats st = {0};
    for_each_jsonl("decode.jsonl", decode_line, &st);
    fprintf(stderr, "decode.jsonl: %zu vectors (whole + stream), %zu mismatches\n", st.n, st.bad);
    assert_true(st.n >= 1000);
    assert_int_equal(st.bad, 0);
}

/* ---- modified tokenizer.json copies ------------------------------------ */

static char *make_temp_dir(void) {
    char *d = strdup("/tmp/disagg_tok_XXXXXX");
    assert_non_null(mkdtemp(d));
    return d;
}

static void remove_temp_dir(char *d) {
    const char *names[] = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"};
    char p[256];
    for (size_t i = 0; i < 3; i++) {
        snprintf(p, sizeof(p), "%s/%s", d, names[i]);
        unlink(p);
    }
    rmdir(d);
    free(d);
}

static json_t *load_qwen_json(void) {
    char path[4200];
    snprintf(path, sizeof(path), "%s/tokenizer.json", g_tok_dir);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j) fail_msg("%s: %s", path, je.text);
    return j;
}

static void write_json(const char *dir, const char *name, json_t *j) {
    char p[256];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    assert_int_equal(json_dump_file(j, p, JSON_COMPACT | JSON_PRESERVE_ORDER), 0);
}

static void write_text(const char *dir, const char *name, const char *text) {
    char p[256];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* added.json: tokens with lstrip / rstrip / single_word / normalized, with
 * the ids HF gave after appending them to Qwen's added_tokens. */
static void test_added_token_flags(void **state) {
    (void)state;
    char path[4200];
    snprintf(path, sizeof(path), "%s/added.json", g_data_dir);
    json_error_t je;
    json_t *spec = json_load_file(path, 0, &je);
    if (!spec) fail_msg("%s: %s", path, je.text);
    json_t *tj = load_qwen_json();
    json_array_extend(json_object_get(tj, "added_tokens"), json_object_get(spec, "added_tokens"));
    char *dir = make_temp_dir();
    write_json(dir, "tokenizer.json", tj);
    json_decref(tj);
    tokenizer *tok = NULL;
    char err[512] = "";
    int rc = tokenizer_load(dir, &tok, err, sizeof(err));
    if (rc) fail_msg("load: %s", err);
    size_t i, bad = 0;
    json_t *v;
    json_array_foreach(json_object_get(spec, "vectors"), i, v) {
        size_t nw;
        int32_t *want = json_ids(json_object_get(v, "ids"), &nw);
        json_t *jt = json_object_get(v, "text");
        char where[64];
        snprintf(where, sizeof(where), "added.json vector %zu", i);
        if (!check_encode(tok, json_string_value(jt), json_string_length(jt), want, nw, where))
            bad++;
        free(want);
    }
    fprintf(stderr, "added.json: %zu vectors, %zu mismatches\n", i, bad);
    assert_true(i >= 400);
    assert_int_equal(bad, 0);
    /* special flag of the extra tokens: <L> (151665) special, <R> (151666) not */
    assert_true(tokenizer_is_special(tok, 151665));
    assert_false(tokenizer_is_special(tok, 151666));
    tokenizer_free(tok);
    json_decref(spec);
    remove_temp_dir(dir);
}

/* The same tokenizer with merges written as "a b" strings (older files). */
typedef struct merges_ctx {
    golden_stats st;      /* counts */
    const tokenizer *tok; /* the "a b" merges tokenizer */
} merges_ctx;

static void merges_line(json_t *o, size_t lineno, void *arg) {
    merges_ctx *c = arg;
    if (lineno % 5) return; /* a fifth of the vectors is plenty */
    size_t nw;
    int32_t *want = json_ids(json_object_get(o, "ids"), &nw);
    json_t *jt = json_object_get(o, "text");
    char where[64];
    snprintf(where, sizeof(where), "encode.jsonl:%zu (string merges)", lineno);
    if (!check_encode(c->tok, json_string_value(jt), json_string_length(jt), want, nw, where))
        c->st.bad++;
    c->st.n++;
    free(want);
}

static void test_string_merges(void **state) {
    (void)state;
    json_t *tj = load_qwen_json();
    json_t *merges = json_object_get(json_object_get(tj, "model"), "merges");
    size_t i;
    json_t *m;
    json_array_foreach(merges, i, m) {
        assert_true(json_is_array(m)); /* the shared file uses pairs */
        char buf[1024];
        snprintf(buf, sizeof(buf), "%s %s", json_string_value(json_array_get(m, 0)),
                 json_string_value(json_array_get(m, 1)));
        json_array_set_new(merges, i, json_string(buf));
    }
    char *dir = make_temp_dir();
    write_json(dir, "tokenizer.json", tj);
    json_decref(tj);
    merges_ctx c = {0};
    char err[512] = "";
    tokenizer *tok = NULL;
    if (tokenizer_load(dir, &tok, err, sizeof(err))) fail_msg("load: %s", err);
    c.tok = tok;
    for_each_jsonl("encode.jsonl", merges_line, &c);
    fprintf(stderr, "string merges: %zu vectors, %zu mismatches\n", c.st.n, c.st.bad);
    assert_true(c.st.n > 500);
    assert_int_equal(c.st.bad, 0);
    tokenizer_free(tok);
    remove_temp_dir(dir);
}

/* ---- streaming, errors -------------------------------------------------- */

static void test_stream_holds_partial_chars(void **state) {
    (void)state;
    /* " 🦙" is 11162 99 247 in HF's vocab-test: " \xF0\x9F", "\xA6", "\x99" */
    int32_t ids[] = {11162, 99, 247};
    tokenizer_stream ts;
    tokenizer_stream_init(&ts, false);
    size_t cap = TOKENIZER_STREAM_OUT_CAP(g_tok), len;
    char *out = malloc(cap);
    assert_int_equal(tokenizer_stream_push(g_tok, &ts, ids[0], out, cap, &len), 0);
    assert_int_equal(len, 1); /* the space, not the half emoji */
    assert_int_equal(out[0], ' ');
    assert_int_equal(tokenizer_stream_push(g_tok, &ts, ids[1], out, cap, &len), 0);
    assert_int_equal(len, 0); /* nothing until the character is complete */
    assert_int_equal(tokenizer_stream_push(g_tok, &ts, ids[2], out, cap, &len), 0);
    assert_int_equal(len, 4);
    assert_memory_equal(out, "🦙", 4);
    /* a cut-off character becomes one U+FFFD at the flush */
    tokenizer_stream_init(&ts, false);
    assert_int_equal(tokenizer_stream_push(g_tok, &ts, ids[0], out, cap, &len), 0);
    assert_int_equal(len, 1);
    assert_int_equal(tokenizer_stream_flush(&ts, out, cap, &len), 0);
    assert_int_equal(len, 3);
    assert_memory_equal(out, "\xEF\xBF\xBD", 3);
    /* skip_special drops <|im_end|>, keeps <tool_call> */
    tokenizer_stream_init(&ts, true);
    assert_int_equal(tokenizer_stream_push(g_tok, &ts, 151645, out, cap, &len), 0);
    assert_int_equal(len, 0);
    assert_int_equal(tokenizer_stream_push(g_tok, &ts, 151657, out, cap, &len), 0);
    assert_int_equal(len, 11);
    /* bad id, small buffer */
    assert_int_equal(tokenizer_stream_push(g_tok, &ts, 999999, out, cap, &len), -EINVAL);
    assert_int_equal(tokenizer_stream_push(g_tok, &ts, 9707, out, 4, &len), -ENOSPC);
    free(out);
}

static void test_invalid_utf8(void **state) {
    (void)state;
    struct {
        const char *s;
        size_t len;
        size_t off;
    } cases[] = {
        {"abc\xff", 4, 3},
        {"ab\xc3", 3, 2},
        {"\xc0\xaf", 2, 0},
        {"x\xed\xa0\x80y", 5, 1},
        /* surrogate */ {"\xf4\x90\x80\x80", 4, 0},
        {"ok \xe2\x82", 5, 3},
        {"\x80", 1, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int32_t *ids = (int32_t *)1;
        size_t n = 7;
        char err[256] = "";
        int rc =
            tokenizer_encode(g_tok, cases[i].s, cases[i].len, false, &ids, &n, err, sizeof(err));
        assert_int_equal(rc, -EILSEQ);
        assert_null(ids);
        assert_int_equal(n, 0);
        char want[64];
        snprintf(want, sizeof(want), "byte offset %zu", cases[i].off);
        if (!strstr(err, want)) fail_msg("error \"%s\" does not name %s", err, want);
    }
    /* embedded NUL is valid text */
    int32_t *ids;
    size_t n;
    assert_int_equal(tokenizer_encode(g_tok, "a\0b", 3, false, &ids, &n, NULL, 0), 0);
    assert_int_equal(n, 3);
    free(ids);
    /* empty text: zero ids */
    assert_int_equal(tokenizer_encode(g_tok, "", 0, false, &ids, &n, NULL, 0), 0);
    assert_int_equal(n, 0);
    free(ids);
}

static void test_decode_errors(void **state) {
    (void)state;
    int32_t bad[] = {9707, -1};
    char *txt = (char *)1;
    char err[256] = "";
    assert_int_equal(tokenizer_decode(g_tok, bad, 2, false, &txt, NULL, err, sizeof(err)), -EINVAL);
    assert_null(txt);
    assert_non_null(strstr(err, "-1"));
    int32_t big[] = {151665};
    assert_int_equal(tokenizer_decode(g_tok, big, 1, false, &txt, NULL, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "151665"));
    /* empty decode */
    size_t len = 9;
    assert_int_equal(tokenizer_decode(g_tok, NULL, 0, false, &txt, &len, err, sizeof(err)), 0);
    assert_int_equal(len, 0);
    assert_string_equal(txt, "");
    free(txt);
}

/* A load error must name the file and the problem. */
static void expect_load_error(const char *dir, const char *needle1, const char *needle2) {
    tokenizer *tok = (tokenizer *)1;
    char err[1024] = "";
    int rc = tokenizer_load(dir, &tok, err, sizeof(err));
    assert_true(rc < 0);
    assert_null(tok);
    if (!strstr(err, needle1) || (needle2 && !strstr(err, needle2)))
        fail_msg("load error \"%s\" lacks \"%s\" / \"%s\"", err, needle1, needle2 ? needle2 : "");
}

static void test_load_errors(void **state) {
    (void)state;
    expect_load_error("/nonexistent/dir", "/nonexistent/dir/tokenizer.json", "cannot open");
    char *dir = make_temp_dir();
    write_text(dir, "tokenizer.json", "{\"model\": {\"type\": \"BPE\",\n \"vocab\": {\"a\": 0,}");
    expect_load_error(dir, "tokenizer.json", "malformed JSON at line 2");
    write_text(dir, "tokenizer.json", "[1, 2]");
    expect_load_error(dir, "tokenizer.json", "not a JSON object");
    write_text(dir, "tokenizer.json", "{\"version\": \"1.0\"}");
    expect_load_error(dir, "tokenizer.json", "\"model\" is missing");
    write_text(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}}}");
    expect_load_error(dir, "tokenizer.json", "unsupported model type \"WordPiece\"");
    write_text(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": "
               "[\"a c\"]}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}");
    expect_load_error(dir, "merges[0]", "second token");
    write_text(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": "
               "[[\"a\"]]}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}");
    expect_load_error(dir, "merges[0]", "neither");
    write_text(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": \"x\"}, \"merges\": []}}");
    expect_load_error(dir, "model.vocab[\"a\"]", "integer");
    write_text(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 2000000000}, "
               "\"merges\": []}}");
    expect_load_error(dir, "tokenizer.json", "token id 2000000000 is too large");
    write_text(dir, "tokenizer.json",
               "{\"normalizer\": {\"type\": \"Lowercase\"}, \"model\": {\"type\": \"BPE\", "
               "\"vocab\": {\"a\": 0}, \"merges\": []}}");
    expect_load_error(dir, "tokenizer.json", "unsupported normalizer type \"Lowercase\"");
    write_text(dir, "tokenizer.json",
               "{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(a\"}, "
               "\"behavior\": \"Isolated\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, "
               "\"merges\": []}}");
    expect_load_error(dir, "tokenizer.json", "does not compile");
    write_text(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
               "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}, \"decoder\": {\"type\": "
               "\"Metaspace\"}}");
    expect_load_error(dir, "tokenizer.json", "ByteLevel tokenizer with a Replace");
    write_text(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [], "
               "\"unk_token\": \"<unk>\"}}");
    expect_load_error(dir, "tokenizer.json", "unk_token \"<unk>\" is not in the vocab");
    write_text(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
               "\"post_processor\": {\"type\": \"RobertaProcessing\"}}");
    expect_load_error(dir, "tokenizer.json",
                      "unsupported post_processor type \"RobertaProcessing\"");
    write_text(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
               "\"pre_tokenizer\": {\"type\": \"Metaspace\", \"prepend_scheme\": \"sometimes\"}}");
    expect_load_error(dir, "tokenizer.json", "prepend_scheme");
    /* a valid tokenizer.json with a broken tokenizer_config.json */
    json_t *tj = load_qwen_json();
    write_json(dir, "tokenizer.json", tj);
    json_decref(tj);
    write_text(dir, "tokenizer_config.json", "{\"eos_token\": \"<|nope|>\"}");
    expect_load_error(dir, "tokenizer_config.json", "eos_token \"<|nope|>\"");
    write_text(dir, "tokenizer_config.json", "{\"eos_token\": 5}");
    expect_load_error(dir, "tokenizer_config.json", "eos_token is neither");
    write_text(dir, "tokenizer_config.json", "{\"eos_token\": ");
    expect_load_error(dir, "tokenizer_config.json", "malformed JSON");
    /* AddedToken objects are accepted */
    write_text(dir, "tokenizer_config.json",
               "{\"eos_token\": {\"content\": \"<|endoftext|>\", \"special\": true}, "
               "\"bos_token\": \"<|im_start|>\", \"add_bos_token\": true}");
    tokenizer *tok = NULL;
    char err[512];
    if (tokenizer_load(dir, &tok, err, sizeof(err))) fail_msg("%s", err);
    assert_int_equal(tokenizer_eos_id(tok), 151643);
    assert_int_equal(tokenizer_bos_id(tok), 151644);
    assert_null(tokenizer_chat_template(tok));
    int32_t *ids;
    size_t n;
    assert_int_equal(tokenizer_encode(tok, "Hello world", 11, true, &ids, &n, NULL, 0), 0);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], 151644); /* add_bos_token honoured with add_special */
    free(ids);
    tokenizer_free(tok);
    /* chat_template as a list of named templates: "default" is taken */
    write_text(dir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}, "
               "{\"name\": \"default\", \"template\": \"D\"}]}");
    if (tokenizer_load(dir, &tok, err, sizeof(err))) fail_msg("%s", err);
    assert_string_equal(tokenizer_chat_template(tok), "D");
    tokenizer_free(tok);
    write_text(dir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}]}");
    expect_load_error(dir, "tokenizer_config.json", "no entry named \"default\"");
    /* no chat_template in the config: chat_template.jinja beside it */
    write_text(dir, "tokenizer_config.json", "{}");
    write_text(dir, "chat_template.jinja", "{{ messages }}");
    if (tokenizer_load(dir, &tok, err, sizeof(err))) fail_msg("%s", err);
    assert_string_equal(tokenizer_chat_template(tok), "{{ messages }}");
    assert_int_equal(tokenizer_eos_id(tok), -1);
    tokenizer_free(tok);
    /* transformers' "no limit" model_max_length (1e30 written as an integer) */
    write_text(dir, "tokenizer_config.json",
               "{\"model_max_length\": 1000000000000000019884624838656}");
    if (tokenizer_load(dir, &tok, err, sizeof(err))) fail_msg("%s", err);
    assert_int_equal(tokenizer_model_max_length(tok), 0);
    tokenizer_free(tok);
    write_text(dir, "tokenizer_config.json", "{\"model_max_length\": 131072}");
    if (tokenizer_load(dir, &tok, err, sizeof(err))) fail_msg("%s", err);
    assert_int_equal(tokenizer_model_max_length(tok), 131072);
    tokenizer_free(tok);
    remove_temp_dir(dir);
}

/* A SentencePiece-style tokenizer.json made by hand (the real Mistral files are
 * checked against HF in tests/integration/test_tokenizer_families.py): BPE over
 * characters with Metaspace, unk with and without fuse_unk, byte_fallback, the
 * Replace+ByteFallback+Fuse+Strip decoder, TemplateProcessing; expected ids and
 * texts are what HF tokenizers 0.23 gives for the same JSON. */
static void write_spm_json(const char *dir, bool fuse_unk, bool byte_fallback) {
    char buf[2048];
    snprintf(buf, sizeof buf,
             "{\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\u2581\", "
             "\"prepend_scheme\": \"always\", \"split\": false}, "
             "\"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": "
             "[{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}}, {\"Sequence\": {\"id\": "
             "\"A\", \"type_id\": 0}}], \"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": "
             "[8], \"tokens\": [\"<s>\"]}}}, "
             "\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", "
             "\"pattern\": {\"String\": \"\u2581\"}, \"content\": \" \"}, {\"type\": "
             "\"ByteFallback\"}, {\"type\": \"Fuse\"}, {\"type\": \"Strip\", \"content\": \" \", "
             "\"start\": 1, \"stop\": 0}]}, "
             "\"added_tokens\": [{\"id\": 8, \"content\": \"<s>\", \"special\": true, "
             "\"normalized\": false}], "
             "\"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"fuse_unk\": %s, "
             "\"byte_fallback\": %s, \"vocab\": {\"<unk>\": 0, \"\u2581\": 1, \"a\": 2, \"b\": 3, "
             "\"\u2581a\": 4, \"ab\": 5, \"<0xE4>\": 6, \"<0xBD>\": 7, \"<s>\": 8}, "
             "\"merges\": [[\"\u2581\", \"a\"], [\"a\", \"b\"]]}}",
             fuse_unk ? "true" : "false", byte_fallback ? "true" : "false");
    write_text(dir, "tokenizer.json", buf);
}

static void expect_ids(const tokenizer *tok, const char *text, bool add, const int32_t *want,
                       size_t n_want) {
    int32_t *ids = NULL;
    size_t n = 0;
    char err[256] = "";
    if (tokenizer_encode(tok, text, strlen(text), add, &ids, &n, err, sizeof err))
        fail_msg("encode(%s): %s", text, err);
    bool same = n == n_want;
    for (size_t i = 0; same && i < n; i++)
        same = ids[i] == want[i];
    if (!same) {
        char got[256] = "";
        for (size_t i = 0; i < n && strlen(got) < 200; i++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%d ", ids[i]);
        fail_msg("encode(\"%s\") = [%s]", text, got);
    }
    free(ids);
}

static void expect_decode(const tokenizer *tok, const int32_t *ids, size_t n, bool skip,
                          const char *want) {
    char *txt = NULL;
    size_t len = 0;
    assert_int_equal(tokenizer_decode(tok, ids, n, skip, &txt, &len, NULL, 0), 0);
    assert_string_equal(txt, want);
    free(txt);
}

static void test_sentencepiece_style(void **state) {
    (void)state;
    char *dir = make_temp_dir();
    char err[512] = "";
    tokenizer *tok = NULL;
    write_spm_json(dir, true, false);
    if (tokenizer_load(dir, &tok, err, sizeof err)) fail_msg("%s", err);
    expect_ids(tok, "a xyz b", false, (const int32_t[]){4, 1, 0, 1, 3}, 5);
    expect_ids(tok, " ab", false, (const int32_t[]){4, 3}, 2); /* starts with ▁: no prepend */
    expect_ids(tok, "a", true, (const int32_t[]){8, 4}, 2);    /* the template's <s> */
    expect_ids(tok, "<s>a", false, (const int32_t[]){8, 4}, 2);
    expect_decode(tok, (const int32_t[]){4, 1, 0, 1, 3}, 5, false, "a <unk> b");
    expect_decode(tok, (const int32_t[]){8, 4, 3}, 3, true, "ab");
    expect_decode(tok, (const int32_t[]){8, 4, 3}, 3, false, "<s> ab");
    size_t n;
    const char *str = tokenizer_token_str(tok, 4, &n);
    assert_int_equal(n, 4);
    assert_memory_equal(str, "\u2581a", 4);
    assert_int_equal(tokenizer_token_id(tok, "\u2581a"), 4);
    /* the stream decodes a continuation: the leading space stays */
    tokenizer_stream st;
    tokenizer_stream_init(&st, true);
    char out[256], all[256] = "";
    size_t k;
    const int32_t seq[] = {8, 4, 1, 0, 1, 3};
    for (size_t i = 0; i < 6; i++) {
        assert_int_equal(tokenizer_stream_push(tok, &st, seq[i], out, sizeof out, &k), 0);
        strncat(all, out, k);
    }
    assert_string_equal(all, " a <unk> b");
    tokenizer_free(tok);

    write_spm_json(dir, false, false); /* one unk per unknown character */
    if (tokenizer_load(dir, &tok, err, sizeof err)) fail_msg("%s", err);
    expect_ids(tok, "a xyz b", false, (const int32_t[]){4, 1, 0, 0, 0, 1, 3}, 7);
    tokenizer_free(tok);

    write_spm_json(dir, true, true); /* byte fallback: 你 is E4 BD A0, A0 has no token */
    if (tokenizer_load(dir, &tok, err, sizeof err)) fail_msg("%s", err);
    expect_ids(tok, "\xe4\xbd\xa0", false, (const int32_t[]){1, 0}, 2); /* not all bytes: unk */
    /* a run of byte tokens that is not UTF-8: one U+FFFD per token */
    expect_decode(tok, (const int32_t[]){6, 7, 2}, 3, false,
                  "\xef\xbf\xbd\xef\xbf\xbd"
                  "a");
    tokenizer_free(tok);
    remove_temp_dir(dir);
}

/* Random strings dense in combining marks, Hangul jamo and bytes that are
 * invalid UTF-8: encode either rejects them (invalid) or decode(encode(x))
 * equals utf8proc's NFC of the whole string (checks the span-wise NFC fast
 * path and that nothing is lost).  Never crashes. */
static void test_random_strings(void **state) {
    (void)state;
    static const int32_t pool[] = {
        'a',    'e',    'A',    ' ',     '\n',    '\'',   's',    '1',    0xE9,   0xC5,   0x212B,
        0x2126, 0x0300, 0x0301, 0x0308,  0x0323,  0x0327, 0x030A, 0x0345, 0x1100, 0x1161, 0x11A8,
        0xAC00, 0x0915, 0x093C, 0x0958,  0x0B47,  0x0B3E, 0x0CD5, 0x0DCF, 0x05B7, 0x0653, 0x3099,
        0x304B, 0xFF8A, 0xFF9F, 0x1F44D, 0x1F3FD, 0x200D, 0xFE0F, 0x0F73, 0x0344, 0x0F71, 0x2ADC};
    srand(12345);
    size_t valid = 0, invalid = 0, bad = 0;
    for (int iter = 0; iter < 3000; iter++) {
        uint8_t buf[256];
        size_t n = 0;
        int len = 1 + rand() % 24;
        bool inject = rand() % 5 == 0;
        for (int k = 0; k < len; k++) {
            if (inject && rand() % 8 == 0) {
                buf[n++] = (uint8_t)(0x80 + rand() % 0x80); /* a stray byte */
                continue;
            }
            n += (size_t)utf8proc_encode_char(pool[rand() % (sizeof(pool) / sizeof(pool[0]))],
                                              buf + n);
        }
        int32_t *ids = NULL;
        size_t nid;
        char err[256];
        int rc = tokenizer_encode(g_tok, (char *)buf, n, false, &ids, &nid, err, sizeof(err));
        size_t off = tokenizer_utf8_check((char *)buf, n);
        if (off < n) {
            invalid++;
            if (rc != -EILSEQ) bad++;
            continue;
        }
        valid++;
        assert_int_equal(rc, 0);
        uint8_t *nfc = NULL;
        utf8proc_ssize_t nl =
            utf8proc_map(buf, (utf8proc_ssize_t)n, &nfc, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
        assert_true(nl >= 0);
        char *txt;
        size_t tl;
        assert_int_equal(tokenizer_decode(g_tok, ids, nid, false, &txt, &tl, err, sizeof(err)), 0);
        if (tl != (size_t)nl || memcmp(txt, nfc, tl) != 0) {
            fprintf(stderr, "RANDOM MISMATCH iter %d\n", iter);
            bad++;
        }
        free(txt);
        free(nfc);
        free(ids);
    }
    fprintf(stderr, "random strings: %zu valid, %zu invalid, %zu mismatches\n", valid, invalid,
            bad);
    assert_true(valid > 1000 && invalid > 100);
    assert_int_equal(bad, 0);
}

/* The ASCII fast path for Qwen's split pattern against Oniguruma alone: the
 * same tokenizer.json with the pattern wrapped in (?:...) (same language, so
 * not recognised as the fast-path pattern) must give the same ids for random
 * strings over all ASCII characters plus non-ASCII letters, spaces and marks
 * that meet the pattern's classes (and 'ſ', which (?i:'s) matches). */
static void test_split_fast_path(void **state) {
    (void)state;
    json_t *tj = load_qwen_json();
    json_t *steps = json_object_get(json_object_get(tj, "pre_tokenizer"), "pretokenizers");
    json_t *pat = json_object_get(json_object_get(json_array_get(steps, 0), "pattern"), "Regex");
    assert_non_null(pat);
    char *wrapped = malloc(json_string_length(pat) + 8);
    sprintf(wrapped, "(?:%s)", json_string_value(pat));
    json_string_set(pat, wrapped);
    free(wrapped);
    char *dir = make_temp_dir();
    write_json(dir, "tokenizer.json", tj);
    json_decref(tj);
    tokenizer *slow = NULL;
    char err[512] = "";
    if (tokenizer_load(dir, &slow, err, sizeof(err))) fail_msg("load: %s", err);
    static const char *extra[] = {"ſ", "\u00a0", "\u3000", "é",      "\u2028", "\u212a", "\xc2\x85",
                                  "ǅ", "١",      "…",      "\u0301", "中",     "🦙"};
    srand(777);
    size_t bad = 0, total_ids = 0;
    for (int iter = 0; iter < 20000; iter++) {
        char buf[256];
        size_t n = 0;
        int len = 1 + rand() % 30;
        for (int k = 0; k < len; k++) {
            int r = rand() % 100;
            if (r < 8) {
                const char *x = extra[rand() % (sizeof(extra) / sizeof(extra[0]))];
                memcpy(buf + n, x, strlen(x));
                n += strlen(x);
            } else if (r < 40) {
                buf[n++] = " \t\n\r\v\f'"[rand() % 8];
            } else if (r < 55) {
                buf[n++] = "sStTrReEvVmMlLdD"[rand() % 16];
            } else {
                buf[n++] = (char)(rand() % 128);
            }
        }
        int32_t *a, *b;
        size_t na, nb;
        assert_int_equal(tokenizer_encode(g_tok, buf, n, false, &a, &na, NULL, 0), 0);
        assert_int_equal(tokenizer_encode(slow, buf, n, false, &b, &nb, NULL, 0), 0);
        if (na != nb || memcmp(a, b, na * sizeof(int32_t)) != 0) {
            if (bad < 5) {
                fprintf(stderr, "FAST PATH MISMATCH on \"%.*s\"\n", (int)n, buf);
                print_ids("oniguruma", b, nb);
                print_ids("fast     ", a, na);
            }
            bad++;
        }
        total_ids += na;
        free(a);
        free(b);
    }
    fprintf(stderr, "split fast path: 20000 strings (%zu ids), %zu differ from Oniguruma\n",
            total_ids, bad);
    assert_int_equal(bad, 0);
    tokenizer_free(slow);
    remove_temp_dir(dir);
}

/* ---- threads share one tokenizer (word cache, regex) --------------------- */

typedef struct thread_vectors {
    json_t **texts; /* (n) input strings */
    json_t **ids;   /* (n) HF ids */
    size_t n;       /* vectors */
    size_t first;   /* this thread's starting vector */
    size_t bad;     /* mismatches seen by this thread */
} thread_vectors;

static void collect_line(json_t *o, size_t lineno, void *arg) {
    (void)lineno;
    thread_vectors *v = arg;
    v->texts[v->n] = json_incref(json_object_get(o, "text"));
    v->ids[v->n] = json_incref(json_object_get(o, "ids"));
    v->n++;
}

static void *encode_thread(void *arg) {
    thread_vectors *v = arg;
    /* every thread walks all vectors twice from its own offset, so threads
     * hit the same cache slots at different times */
    for (size_t r = 0; r < 2 * v->n; r++) {
        size_t i = (v->first + r) % v->n;
        size_t nw = json_array_size(v->ids[i]);
        int32_t *ids;
        size_t n;
        bool ok =
            tokenizer_encode(g_tok, json_string_value(v->texts[i]), json_string_length(v->texts[i]),
                             false, &ids, &n, NULL, 0) == 0 &&
            n == nw;
        for (size_t k = 0; ok && k < n; k++)
            ok = ids[k] == (int32_t)json_integer_value(json_array_get(v->ids[i], k));
        if (ok) free(ids);
        if (!ok) v->bad++;
    }
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    enum { NT = 4, MAXV = 4000 };
    thread_vectors all = {.texts = calloc(MAXV, sizeof(json_t *)),
                          .ids = calloc(MAXV, sizeof(json_t *))};
    for_each_jsonl("encode.jsonl", collect_line, &all);
    assert_true(all.n > 3000 && all.n <= MAXV);
    thread_vectors tv[NT];
    pthread_t th[NT];
    for (int t = 0; t < NT; t++) {
        tv[t] = all;
        tv[t].first = (size_t)t * all.n / NT;
        assert_int_equal(pthread_create(&th[t], NULL, encode_thread, &tv[t]), 0);
    }
    size_t bad = 0;
    for (int t = 0; t < NT; t++) {
        pthread_join(th[t], NULL);
        bad += tv[t].bad;
    }
    fprintf(stderr, "threads: %d x %zu encodes, %zu mismatches\n", NT, 2 * all.n, bad);
    assert_int_equal(bad, 0);
    for (size_t i = 0; i < all.n; i++) {
        json_decref(all.texts[i]);
        json_decref(all.ids[i]);
    }
    free(all.texts);
    free(all.ids);
}

/* ---- the whole corpus: HF's id count and hash, and the speed ------------ */

static void test_corpus_hash_and_speed(void **state) {
    (void)state;
    char path[4200], cmd[4400];
    snprintf(path, sizeof(path), "%s/../shared/data/sotu/sotu.txt.xz", DISAGG_SOURCE_DIR);
    if (access(path, R_OK) != 0) fail_msg("corpus not found: %s", path);
    snprintf(cmd, sizeof(cmd), "xz -dc '%s'", path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 16 << 20, len = 0, k;
    char *text = malloc(cap);
    while ((k = fread(text + len, 1, cap - len, p)) > 0) {
        len += k;
        if (len == cap) text = realloc(text, cap *= 2);
    }
    assert_int_equal(pclose(p), 0);

    snprintf(path, sizeof(path), "%s/meta.json", g_data_dir);
    json_error_t je;
    json_t *meta = json_load_file(path, 0, &je);
    if (!meta) fail_msg("%s: %s", path, je.text);
    assert_int_equal(len, json_integer_value(json_object_get(meta, "sotu_bytes")));

    struct timespec t0, t1, c0, c1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
    int32_t *ids;
    size_t n;
    char err[256];
    assert_int_equal(tokenizer_encode(g_tok, text, len, false, &ids, &n, err, sizeof(err)), 0);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    double cs = (double)(c1.tv_sec - c0.tv_sec) + 1e-9 * (double)(c1.tv_nsec - c0.tv_nsec);
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        for (int b = 0; b < 4; b++) {
            h ^= ((uint32_t)ids[i] >> (8 * b)) & 0xff;
            h *= 0x100000001b3ull;
        }
    char hex[17];
    snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)h);
    fprintf(stderr,
            "sotu corpus: %zu bytes -> %zu tokens in %.3f s wall, %.3f s CPU: %.0f tokens/s, "
            "%.1f MB/s per CPU second (one thread)\n",
            len, n, s, cs, (double)n / cs, (double)len / cs / 1e6);
    assert_int_equal(n, json_integer_value(json_object_get(meta, "sotu_n_ids")));
    assert_string_equal(hex, json_string_value(json_object_get(meta, "sotu_ids_fnv1a64")));

    /* and back */
    char *back;
    size_t blen;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(tokenizer_decode(g_tok, ids, n, false, &back, &blen, err, sizeof(err)), 0);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    fprintf(stderr, "sotu corpus decode: %.0f tokens/s\n", (double)n / s);
    assert_int_equal(blen, len);
    assert_memory_equal(back, text, len);
    free(back);
    free(ids);
    free(text);
    json_decref(meta);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config),
        cmocka_unit_test(test_known_ids),
        cmocka_unit_test(test_vocab_test_vectors),
        cmocka_unit_test(test_golden_encode),
        cmocka_unit_test(test_golden_roundtrip),
        cmocka_unit_test(test_golden_decode),
        cmocka_unit_test(test_added_token_flags),
        cmocka_unit_test(test_string_merges),
        cmocka_unit_test(test_stream_holds_partial_chars),
        cmocka_unit_test(test_invalid_utf8),
        cmocka_unit_test(test_decode_errors),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_sentencepiece_style),
        cmocka_unit_test(test_random_strings),
        cmocka_unit_test(test_split_fast_path),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_corpus_hash_and_speed),
    };
    return cmocka_run_group_tests(tests, setup_all, teardown_all);
}
