/* Unit tests: base/flags — every row type with its range and its error, environment
 * fallbacks, "did you mean" (close names only), missing values, repeated flags, "--", custom
 * rows that take their own words, and the help text generated from the table. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/flags.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the fixture: one table of every type ------------------------------------------------ */

static struct {
    int on, eager, quiet;
    int port;
    int64_t big;
    uint16_t small;
    double frac, secs;
    const char *name;
    size_t bytes;
    int level;
    flag_list names;
    json_t *obj;
    const char *pos[4];
    int npos;
    int custom_calls;
    const char *custom_last;
    int varargs_n;
    const char *varargs[4];
} V;

static int custom(flags_parser *p, const flag_def *d, const char *v) {
    V.custom_calls++;
    V.custom_last = v;
    if (v && !strcmp(v, "bad")) {
        flags_error(p, "%s '%s' is not accepted; accepted: anything but bad", d->name, v);
        return -1;
    }
    return 0;
}

static int varargs(flags_parser *p, const flag_def *d, const char *v) {
    V.varargs_n = 0;
    if (v) V.varargs[V.varargs_n++] = v;
    const char *w;
    while ((w = flags_peek(p)) && strncmp(w, "--", 2) && V.varargs_n < 4)
        V.varargs[V.varargs_n++] = flags_take(p);
    return 0;
}

static int positional(flags_parser *p, const char *w) {
    if (V.npos == 4) {
        flags_error(p, "too many words");
        return -1;
    }
    V.pos[V.npos++] = w;
    return 0;
}

static const flag_def ROWS[] = {
    {FLAG_BOOL_("--on", &V.on), .help = "a switch"},
    {FLAG_BOOL_("--enforce-eager", &V.eager), .opts = FLAG_NEGATABLE, .env = "TF_EAGER",
     .help = "a switch with a --no- form"},
    {FLAG_BOOL_("--disable-chatter", &V.quiet), .opts = FLAG_STORE_FALSE, .help = "clears it"},
    {FLAG_INT_("--port", &V.port, 0, 65535), .aliases = "-p", .env = "TF_PORT",
     .help = "listen port (default 8000)"},
    {FLAG_INT_("--big", &V.big, -5, 1LL << 40), .help = "a wide integer"},
    {FLAG_INT_("--small", &V.small, 0, 65535), .help = "a narrow one"},
    {FLAG_DOUBLE_("--fraction", &V.frac, 0, 1), .opts = FLAG_OPEN_LO, .unit = "a fraction",
     .metavar = "F", .help = "in (0, 1]"},
    {FLAG_DOUBLE_("--timeout", &V.secs, 0, 60), .unit = "seconds", .metavar = "S",
     .help = "in [0, 60]"},
    {FLAG_STRING_("--name", &V.name), .env = "TF_NAME", .metavar = "NAME", .help = "a word"},
    {FLAG_BYTES_("--memory", &V.bytes, 1, 1ull << 40), .help = "a size"},
    {FLAG_CHOICE_("--level", &V.level, "low", "mid", "high"), .metavar = "low|mid|high",
     .help = "one of three"},
    {FLAG_LIST_("--served-model-name", &V.names), .hi = 3, .unit = "name",
     .metavar = "NAME [NAME ...]", .help = "one or more names"},
    {FLAG_JSON_("--obj", &V.obj, JSON_OBJECT), .help = "a JSON object"},
    {FLAG_CUSTOM_("--custom", NULL, custom), .metavar = "X", .help = "checked by a function"},
    {FLAG_CUSTOM_("--words", NULL, varargs), .opts = FLAG_VARARGS, .metavar = "W [W..]",
     .help = "takes its own words"},
    {FLAG_NO_EFFECT_("--tuning", "a knob disagg lacks"), .opts = FLAG_SWITCH | FLAG_NEGATABLE,
     .help = "accepted, no effect"},
    {FLAG_NO_EFFECT_("--compilation-config", "a knob disagg lacks"), .metavar = "JSON",
     .help = "accepted, no effect"},
    {FLAG_REFUSED_("--enable-lora", "LoRA adapters are not supported")},
    {FLAG_TEXT_("--enable-lora, ...", "refused, naming the feature")},
    {FLAG_INT_("--hidden-knob", &V.port, 0, 9), .opts = FLAG_HIDDEN, .help = "not listed"},
    {0}};
static const flag_def *const TABLES[] = {ROWS, NULL};

static char *err_buf;
static size_t err_len;

static flags_spec spec(FILE *err) {
    flags_spec s = {.cmd = "test",
                    .usage = "usage: test [options] WORD...\n\noptions:\n",
                    .tables = TABLES,
                    .help_col = 24,
                    .underscores = 1,
                    .positional = positional,
                    .err = err};
    return s;
}

/* Parses the words (argv[0] added); the error text lands in err_buf. */
static int parse_v(const char *first, va_list ap) {
    char *argv[32];
    int argc = 0;
    argv[argc++] = "test";
    for (const char *w = first; w && argc < 32; w = va_arg(ap, const char *))
        argv[argc++] = (char *)w;
    flag_list_free(&V.names);
    json_decref(V.obj);
    memset(&V, 0, sizeof V);
    V.quiet = 1; /* --disable-chatter's default: on */
    free(err_buf);
    err_buf = NULL;
    FILE *err = open_memstream(&err_buf, &err_len);
    flags_spec s = spec(err);
    int rc = flags_parse(&s, argc, argv);
    fclose(err);
    return rc;
}

static int parse(const char *first, ...) {
    va_list ap;
    va_start(ap, first);
    int rc = parse_v(first, ap);
    va_end(ap);
    return rc;
}

static void refused(const char *needle, const char *first, ...) {
    va_list ap;
    va_start(ap, first);
    int rc = parse_v(first, ap);
    va_end(ap);
    assert_int_equal(rc, -1);
    if (!strstr(err_buf, needle)) fail_msg("'%s' not in: %s", needle, err_buf);
    assert_non_null(strstr(err_buf, "disagg test: "));
}

/* ---- types ------------------------------------------------------------------------------- */

static void test_bool(void **st) {
    (void)st;
    assert_int_equal(parse("--on", "--enforce-eager", NULL), 0);
    assert_int_equal(V.on, 1);
    assert_int_equal(V.eager, 1);
    assert_int_equal(parse("--enforce-eager", "--no-enforce-eager", NULL), 0);
    assert_int_equal(V.eager, 0);
    assert_int_equal(parse("--on", NULL), 0);
    assert_int_equal(V.quiet, 1);
    assert_int_equal(parse("--disable-chatter", NULL), 0);
    assert_int_equal(V.quiet, 0);
    refused("--on takes no value (got '1')", "--on=1", NULL);
    refused("--no-enforce-eager takes no value", "--no-enforce-eager=0", NULL);
    /* --no- only where the row says so */
    refused("unknown option '--no-on'", "--no-on", NULL);
}

static void test_int(void **st) {
    (void)st;
    assert_int_equal(parse("--port", "8080", "--big=1099511627776", "--small", "65535", NULL), 0);
    assert_int_equal(V.port, 8080);
    assert_true(V.big == 1LL << 40);
    assert_int_equal(V.small, 65535);
    assert_int_equal(parse("-p", "0", "--big", "-5", NULL), 0);
    assert_int_equal(V.port, 0);
    assert_true(V.big == -5);
    refused("--port '65536' is not accepted; accepted: an integer in [0, 65535]", "--port", "65536",
            NULL);
    refused("--port 'x' is not accepted; accepted: an integer in [0, 65535]", "--port=x", NULL);
    refused("--port '1.5' is not accepted", "-p", "1.5", NULL);
    refused("--port '' is not accepted", "--port=", NULL);
    refused("--big '-6' is not accepted; accepted: an integer in [-5, 1099511627776]", "--big",
            "-6", NULL);
    refused("--big '99999999999999999999' is not accepted", "--big", "99999999999999999999", NULL);
}

static void test_double(void **st) {
    (void)st;
    assert_int_equal(parse("--fraction", "1", "--timeout", "0", NULL), 0);
    assert_true(V.frac == 1.0 && V.secs == 0.0);
    assert_int_equal(parse("--fraction=0.25", NULL), 0);
    assert_true(V.frac == 0.25);
    refused("--fraction expects a fraction, a number in (0, 1], got '0'", "--fraction", "0", NULL);
    refused("--fraction expects a fraction, a number in (0, 1], got '1.5'", "--fraction", "1.5",
            NULL);
    refused("--timeout expects seconds, a number in [0, 60], got 'soon'", "--timeout", "soon",
            NULL);
    refused("--timeout expects seconds, a number in [0, 60], got 'nan'", "--timeout", "nan", NULL);
}

static void test_string_bytes_choice(void **st) {
    (void)st;
    assert_int_equal(parse("--name", "a b", "--memory", "512M", "--level", "high", NULL), 0);
    assert_string_equal(V.name, "a b");
    assert_true(V.bytes == 512ull << 20);
    assert_int_equal(V.level, 2);
    /* a value that looks like a flag is still the value of a flag that takes one */
    assert_int_equal(parse("--name", "--on", NULL), 0);
    assert_string_equal(V.name, "--on");
    assert_int_equal(V.on, 0);
    refused("--memory", "--memory", "lots", NULL);
    refused("'lots'", "--memory", "lots", NULL);
    refused("--level 'top' is not accepted; accepted: low, mid, high", "--level", "top", NULL);
}

static void test_list(void **st) {
    (void)st;
    assert_int_equal(parse("--served-model-name", "a", "b", "--on", "MODEL", NULL), 0);
    assert_int_equal(V.names.n, 2);
    assert_string_equal(V.names.v[0], "a");
    assert_string_equal(V.names.v[1], "b");
    assert_int_equal(V.on, 1);
    assert_int_equal(V.npos, 1);
    assert_string_equal(V.pos[0], "MODEL");
    /* repeated: the last list wins, as argparse's nargs="+" */
    assert_int_equal(parse("--served-model-name", "a", "b", "--served-model-name", "c", NULL), 0);
    assert_int_equal(V.names.n, 1);
    assert_string_equal(V.names.v[0], "c");
    /* --flag=VALUE is one word; a JSON list (a config file's YAML list) is the whole list */
    assert_int_equal(parse("--served-model-name=x", "POS", NULL), 0);
    assert_int_equal(V.names.n, 1);
    assert_int_equal(V.npos, 1);
    assert_int_equal(parse("--served-model-name", "[\"p\", \"q\"]", "POS", NULL), 0);
    assert_int_equal(V.names.n, 2);
    assert_string_equal(V.names.v[1], "q");
    assert_int_equal(V.npos, 1);
    refused("--served-model-name: at most 3 names, got 'd' too", "--served-model-name", "a", "b",
            "c", "d", NULL);
    refused("--served-model-name: a name is empty", "--served-model-name", "", NULL);
    refused("a non-empty JSON list", "--served-model-name", "[1]", NULL);
    refused("--served-model-name needs a value", "--served-model-name", NULL);
}

static void test_json(void **st) {
    (void)st;
    assert_int_equal(parse("--obj", "{\"a\": 1}", "--obj", "{\"b\": 2}", NULL), 0);
    assert_non_null(json_object_get(V.obj, "b")); /* the last one, the first freed */
    assert_null(json_object_get(V.obj, "a"));
    refused("--obj expects a JSON object such as '{\"key\": 1}', got '[1]' (an array)", "--obj",
            "[1]", NULL);
    refused("--obj expects a JSON object", "--obj", "{", NULL);
}

static void test_custom_and_varargs(void **st) {
    (void)st;
    assert_int_equal(parse("--custom", "ok", NULL), 0);
    assert_int_equal(V.custom_calls, 1);
    assert_string_equal(V.custom_last, "ok");
    refused("--custom 'bad' is not accepted; accepted: anything but bad", "--custom", "bad", NULL);
    assert_int_equal(parse("--words", "a", "b", "--on", NULL), 0);
    assert_int_equal(V.varargs_n, 2);
    assert_int_equal(V.on, 1);
    assert_int_equal(parse("--words=a", "b", NULL), 0);
    assert_int_equal(V.varargs_n, 2);
    assert_string_equal(V.varargs[0], "a");
    assert_int_equal(parse("--words", NULL), 0); /* the row decides what "no words" means */
    assert_int_equal(V.varargs_n, 0);
}

static void test_no_effect_and_refused(void **st) {
    (void)st;
    assert_int_equal(parse("--tuning", "--no-tuning", "--compilation-config", "{}", NULL), 0);
    assert_int_equal(V.npos, 0); /* the value was taken by the no-effect row */
    refused("--compilation-config needs a value", "--compilation-config", NULL);
    refused("--enable-lora: LoRA adapters are not supported (see disagg test --help)",
            "--enable-lora", NULL);
    refused("--enable-lora: LoRA", "--enable-lora=1", NULL);
    assert_null(strstr(err_buf, "unknown option"));
}

/* ---- forms, unknown flags, env, "--" ----------------------------------------------------- */

static void test_unknown_hints(void **st) {
    (void)st;
    refused("unknown option '--portt'; did you mean --port? (see disagg test --help)", "--portt",
            "1", NULL);
    refused("did you mean --served-model-name?", "--served-model-nam", "x", NULL);
    refused("did you mean --enforce-eager?", "--no-enforce-eagr", NULL);
    refused("did you mean --enable-lora?", "--enable-lor", NULL);
    /* underscores are dashes (vLLM): --max_num_seq is reported as --max-num-seq */
    refused("unknown option '--servd-model-name'", "--servd_model_name", NULL);
    /* far from every name: no hint */
    const char *far[] = {"--frobnicate-the-widgets", "--zz", "-px", "--x"};
    for (size_t i = 0; i < sizeof far / sizeof far[0]; i++) {
        refused("unknown option", far[i], NULL);
        if (strstr(err_buf, "did you mean")) fail_msg("%s got a hint: %s", far[i], err_buf);
    }
}

static void test_missing_values(void **st) {
    (void)st;
    refused("--port needs a value (see disagg test --help)", "--port", NULL);
    refused("--name needs a value", "--on", "--name", NULL);
    refused("--level needs a value", "--level", NULL);
}

static void test_repeated_last_wins(void **st) {
    (void)st;
    assert_int_equal(parse("--port", "1", "-p", "2", "--port=3", NULL), 0);
    assert_int_equal(V.port, 3);
    assert_int_equal(parse("--no-enforce-eager", "--enforce-eager", NULL), 0);
    assert_int_equal(V.eager, 1);
}

static void test_double_dash_and_positionals(void **st) {
    (void)st;
    assert_int_equal(parse("a", "--on", "--", "--port", "-", "b", NULL), 0);
    assert_int_equal(V.on, 1);
    assert_int_equal(V.port, 0);
    assert_int_equal(V.npos, 4);
    assert_string_equal(V.pos[1], "--port");
    assert_string_equal(V.pos[2], "-");
    /* the positional handler's refusal stops the parse */
    refused("too many words", "a", "b", "c", "d", "e", NULL);
    /* without a handler, a word is unexpected */
    flags_spec s = spec(NULL);
    s.positional = NULL;
    free(err_buf);
    FILE *err = open_memstream(&err_buf, &err_len);
    s.err = err;
    char *argv[] = {"test", "word"};
    assert_int_equal(flags_parse(&s, 2, argv), -1);
    fclose(err);
    assert_non_null(strstr(err_buf, "unexpected argument 'word'"));
}

static void test_env_fallback(void **st) {
    (void)st;
    setenv("TF_PORT", "7000", 1);
    setenv("TF_NAME", "from-env", 1);
    setenv("TF_EAGER", "1", 1);
    assert_int_equal(parse(NULL), 0);
    assert_int_equal(V.port, 7000);
    assert_string_equal(V.name, "from-env");
    assert_int_equal(V.eager, 1);
    /* the command line wins */
    assert_int_equal(parse("--port", "1", "--no-enforce-eager", NULL), 0);
    assert_int_equal(V.port, 1);
    assert_int_equal(V.eager, 0);
    setenv("TF_EAGER", "0", 1);
    assert_int_equal(parse(NULL), 0);
    assert_int_equal(V.eager, 0);
    /* a bad environment value names the variable and the flag */
    setenv("TF_PORT", "lots", 1);
    refused("TF_PORT='lots' (for --port) is not accepted; accepted: an integer in [0, 65535]",
            NULL);
    setenv("TF_PORT", "", 1); /* empty: not set */
    setenv("TF_EAGER", "yes", 1);
    refused("TF_EAGER='yes' is not an integer (accepted: 0 = off, 1 = on", NULL);
    assert_non_null(strstr(err_buf, "--enforce-eager / --no-enforce-eager"));
    unsetenv("TF_PORT");
    unsetenv("TF_NAME");
    unsetenv("TF_EAGER");
}

static void test_find(void **st) {
    (void)st;
    flags_spec s = spec(NULL);
    int neg = -1;
    const flag_def *d = flags_find(&s, "-p", &neg);
    assert_non_null(d);
    assert_string_equal(d->name, "--port");
    assert_int_equal(neg, 0);
    d = flags_find(&s, "--no-enforce-eager", &neg);
    assert_non_null(d);
    assert_int_equal(neg, 1);
    assert_true(flags_is_switch(d));
    assert_non_null(flags_find(&s, "--served_model_name", NULL));
    assert_null(flags_find(&s, "--no-port", NULL));
    assert_null(flags_find(&s, "--enable-lora, ...", NULL)); /* a help line is no flag */
    assert_false(flags_is_switch(flags_find(&s, "--compilation-config", NULL)));
    assert_true(flags_is_switch(flags_find(&s, "--tuning", NULL)));
}

static void test_help(void **st) {
    (void)st;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    flags_spec s = spec(NULL);
    s.epilog = "the end\n";
    flags_help(&s, f);
    fclose(f);
    /* usage first, epilog last */
    assert_true(!strncmp(buf, "usage: test [options] WORD...\n\noptions:\n", 40));
    assert_non_null(strstr(buf, "the end\n"));
    /* synopsis: aliases first, --no- forms, metavars (given or by type); help at the column */
    assert_non_null(strstr(buf, "\n  -p, --port N          listen port (default 8000)\n"));
    assert_non_null(strstr(buf, "\n  --enforce-eager, --no-enforce-eager  a switch with a --no- "
                                "form\n"));
    assert_non_null(strstr(buf, "\n  --on                  a switch\n"));
    assert_non_null(strstr(buf, "\n  --memory BYTES        a size\n"));
    assert_non_null(strstr(buf, "\n  --obj JSON            a JSON object\n"));
    assert_non_null(strstr(buf, "\n  --served-model-name NAME [NAME ...]  one or more names\n"));
    assert_non_null(strstr(buf, "\n  --words W [W..]       takes its own words\n"));
    assert_non_null(strstr(buf, "\n  --enable-lora, ...    refused, naming the feature\n"));
    /* refused rows and hidden rows are not listed */
    assert_null(strstr(buf, "LoRA adapters"));
    assert_null(strstr(buf, "--hidden-knob"));
    free(buf);

    /* long help wraps at 100 columns, continuation lines at the help column */
    static const flag_def LONG[] = {
        {FLAG_BOOL_("--long", &V.on),
         .help = "one two three four five six seven eight nine ten eleven twelve thirteen "
                 "fourteen fifteen sixteen seventeen eighteen nineteen twenty"},
        {0}};
    const flag_def *const lt[] = {LONG, NULL};
    flags_spec ls = {.cmd = "test", .tables = lt, .help_col = 24};
    buf = NULL;
    f = open_memstream(&buf, &len);
    flags_help(&ls, f);
    fclose(f);
    char *nl = strchr(buf, '\n');
    assert_non_null(nl);
    assert_true(nl - buf <= 100);
    assert_true(!strncmp(nl + 1, "                        ", 24) && nl[25] != ' ');
    assert_non_null(strstr(buf, "twenty\n"));
    free(buf);
}

static void test_help_flag(void **st) {
    (void)st;
    /* --help wins over the errors around it (printed to stdout) */
    assert_int_equal(parse("--bogus", "--help", NULL), FLAGS_HELP);
    assert_int_equal(parse("-h", NULL), FLAGS_HELP);
    /* after "--" it is a word */
    assert_int_equal(parse("--", "--help", NULL), 0);
    assert_string_equal(V.pos[0], "--help");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bool),
        cmocka_unit_test(test_int),
        cmocka_unit_test(test_double),
        cmocka_unit_test(test_string_bytes_choice),
        cmocka_unit_test(test_list),
        cmocka_unit_test(test_json),
        cmocka_unit_test(test_custom_and_varargs),
        cmocka_unit_test(test_no_effect_and_refused),
        cmocka_unit_test(test_unknown_hints),
        cmocka_unit_test(test_missing_values),
        cmocka_unit_test(test_repeated_last_wins),
        cmocka_unit_test(test_double_dash_and_positionals),
        cmocka_unit_test(test_env_fallback),
        cmocka_unit_test(test_find),
        cmocka_unit_test(test_help),
        cmocka_unit_test(test_help_flag),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    flag_list_free(&V.names);
    json_decref(V.obj);
    free(err_buf);
    return rc;
}
