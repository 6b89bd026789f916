/*
 * test_mistral_chat — src/model/mistral_chat's choice of the mistral-common
 * tokenizer file in a directory (what `--tokenizer-mode auto` looks for) and
 * its refusals before any tokenizer is needed.  The encodings themselves are
 * checked against mistral-common in tests/integration/test_mistral_mode.py.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/mistral_chat.h"

static char g_dir[256]; /* a fresh temporary directory per test */

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/test_mistral_chat.XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static void touch(const char *name, const char *text) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static int teardown(void **state) {
    (void)state;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

static const char *base(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static void test_no_file(void **state) {
    (void)state;
    char path[512];
    touch("tokenizer.json", "{}");
    touch("tokenizer.model", "x"); /* a plain SentencePiece file is not mistral-common's */
    touch("tokenizer.model.vx", "x");
    assert_false(mistral_chat_find_file(g_dir, path, sizeof path));
    mistral_chat *mc = (mistral_chat *)1;
    char err[512];
    assert_true(mistral_chat_open(g_dir, NULL, &mc, err, sizeof err) < 0);
    assert_null(mc);
    assert_non_null(
        strstr(err, "no mistral-common tokenizer file (tekken.json or tokenizer.model.v*)"));
}

static void test_highest_spm_version(void **state) {
    (void)state;
    char path[512];
    touch("tokenizer.model.v3", "x");
    touch("tokenizer.model.v7m1", "x");
    touch("tokenizer.model.v7", "x");
    touch("tokenizer.model.v2", "x");
    assert_true(mistral_chat_find_file(g_dir, path, sizeof path));
    assert_string_equal(base(path), "tokenizer.model.v7");
}

static void test_tekken_first(void **state) {
    (void)state;
    char path[512];
    touch("tokenizer.model.v7", "x");
    touch("tekken.json", "{}");
    assert_true(mistral_chat_find_file(g_dir, path, sizeof path));
    assert_string_equal(base(path), "tekken.json");
}

static void test_auto_needs_the_mistral_format(void **state) {
    (void)state;
    touch("tokenizer.model.v3", "x");
    assert_false(mistral_chat_auto(g_dir)); /* vLLM: only with consolidated*.safetensors */
    touch("consolidated.safetensors.index.json", "{}");
    assert_false(mistral_chat_auto(g_dir));
    touch("consolidated-00001-of-00002.safetensors", "");
    assert_true(mistral_chat_auto(g_dir));
}

static void test_refused_versions(void **state) {
    (void)state;
    char err[512];
    mistral_chat *mc = NULL;
    touch("tokenizer.model.v11", "x"); /* v11 exists only as Tekken */
    assert_true(mistral_chat_open(g_dir, NULL, &mc, err, sizeof err) < 0);
    assert_non_null(strstr(err, "accepted for SentencePiece: v1, v2, v3, v7"));
    touch("tokenizer.model.v15", "x");
    assert_true(mistral_chat_open(g_dir, NULL, &mc, err, sizeof err) < 0);
    assert_non_null(strstr(err, "v15 is not supported"));
    touch("tekken.json", "{\"config\": {\"version\": \"v15\"}}");
    assert_true(mistral_chat_open(g_dir, NULL, &mc, err, sizeof err) < 0);
    assert_non_null(strstr(
        err, "tokenizer version \"v15\" is not supported; accepted: v1, v2, v3, v7, v11, v13"));
    touch("tekken.json", "{\"config\": {}}");
    assert_true(mistral_chat_open(g_dir, NULL, &mc, err, sizeof err) < 0);
    assert_non_null(strstr(err, "no config.version string"));
    touch("tekken.json", "{\"config\": ");
    assert_true(mistral_chat_open(g_dir, NULL, &mc, err, sizeof err) < 0);
    assert_non_null(strstr(err, "tekken.json"));
    assert_null(mc);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_no_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_highest_spm_version, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tekken_first, setup, teardown),
        cmocka_unit_test_setup_teardown(test_auto_needs_the_mistral_format, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refused_versions, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
