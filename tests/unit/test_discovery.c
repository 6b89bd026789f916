/* Unit tests of base/discovery and base/etcd's pure parts: the etcd:// URL,
 * the TTL flag, the instance record (round trip and bad values), the key
 * layout and etcd's prefix range end.  The wire is tested against real etcd
 * processes in tests/integration/test_discovery.py. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/discovery.h"
#include "base/etcd.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static void test_url(void **state) {
    (void)state;
    discovery_opts o;
    char err[512];
    discovery_opts_default(&o);
    assert_int_equal(
        discovery_parse_url("etcd://10.0.0.1:2379,10.0.0.2:2379/prod/", &o, err, sizeof err), 0);
    assert_string_equal(o.endpoints, "10.0.0.1:2379,10.0.0.2:2379");
    assert_string_equal(o.prefix, "/prod");
    assert_int_equal(o.tls, 0);
    assert_int_equal(discovery_parse_url("etcds://[::1]:2379", &o, err, sizeof err), 0);
    assert_string_equal(o.prefix, DISCOVERY_DEFAULT_PREFIX);
    assert_string_equal(o.endpoints, "[::1]:2379");
    assert_int_equal(o.tls, 1);
    static const char *const bad[][2] = {
        {"http://h:1/x", "is not an etcd URL"},
        {"etcd://", "names no etcd endpoint"},
        {"etcd://h/x", "'h' is not accepted"},
        {"etcd://h:0/x", "'h:0' is not accepted"},
        {"etcd://h:65536", "'h:65536' is not accepted"},
        {"etcd://h:1,/x", "ends with a comma"},
        {"etcd://h:1,,g:2", "'' is not accepted"},
        {"etcd://a:b@h:1/x", "credentials do not go in the URL"},
        {"etcd://h:1/a b", "printable characters"},
        {"etcd://h:1/a?b", "printable characters"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        assert_int_equal(discovery_parse_url(bad[i][0], &o, err, sizeof err), -EINVAL);
        if (!strstr(err, bad[i][1])) fail_msg("%s: '%s' lacks '%s'", bad[i][0], err, bad[i][1]);
    }
}

static void test_ttl(void **state) {
    (void)state;
    double t;
    char err[256];
    assert_int_equal(discovery_parse_ttl("2.5", &t, err, sizeof err), 0);
    assert_true(t == 2.5);
    static const char *const bad[] = {"0", "0.99", "3601", "x", "", "2s", "nan", "inf"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(discovery_parse_ttl(bad[i], &t, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "[1, 3600]"));
}

static void test_record(void **state) {
    (void)state;
    discovery_record r, back;
    memset(&r, 0, sizeof r);
    strcpy(r.role, "prefill");
    strcpy(r.url, "http://10.0.0.1:8100");
    strcpy(r.bootstrap, "http://10.0.0.1:8998");
    strcpy(r.model, "Qwen/Qwen2.5-7B \"x\"");
    strcpy(r.engine_id, "e1,e2");
    strcpy(r.kv_layout, "Qwen2ForCausalLM:layers=28");
    r.running = 3, r.waiting = 7, r.kv_usage = 0.25, r.pid = 42;
    char *j = discovery_record_json(&r);
    assert_non_null(j);
    char err[256];
    assert_int_equal(discovery_record_parse(j, strlen(j), &back, err, sizeof err), 0);
    assert_string_equal(back.model, r.model);
    assert_string_equal(back.bootstrap, r.bootstrap);
    assert_int_equal(back.running, 3);
    assert_int_equal(back.waiting, 7);
    assert_true(back.kv_usage == 0.25);
    assert_true(discovery_record_same_instance(&r, &back));
    back.running = 9;
    strcpy(back.engine_id, "e3"); /* load and engine id: still the same instance */
    assert_true(discovery_record_same_instance(&r, &back));
    strcpy(back.kv_layout, "other");
    assert_false(discovery_record_same_instance(&r, &back));
    free(j);
    char key[600];
    assert_int_equal(discovery_record_key("/prod", &r, key, sizeof key), 0);
    assert_string_equal(key, "/prod/instances/prefill/10.0.0.1:8100");
    assert_int_equal(discovery_record_key("/prod", &r, key, 10), -ENAMETOOLONG);
    static const char *const bad[][2] = {
        {"[]", "not a JSON object"},
        {"{", "not a JSON object"},
        {"{\"role\":\"router\",\"url\":\"http://h:1\"}", "role 'router'"},
        {"{\"role\":\"decode\",\"url\":\"ftp://h:1\"}", "url 'ftp://h:1'"},
        {"{\"role\":\"decode\",\"url\":\"http://h:1\",\"load\":{\"running\":-1}}", "load"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(
            discovery_record_parse(bad[i][0], strlen(bad[i][0]), &back, err, sizeof err), -EINVAL);
        if (!strstr(err, bad[i][1])) fail_msg("%s: '%s' lacks '%s'", bad[i][0], err, bad[i][1]);
    }
}

static void test_prefix_end(void **state) {
    (void)state;
    char out[16];
    etcd_prefix_end("/a/", out);
    assert_string_equal(out, "/a0"); /* '/' + 1 */
    etcd_prefix_end("ab\xff", out);
    assert_string_equal(out, "ac");
    etcd_prefix_end("\xff\xff", out);
    assert_string_equal(out, ""); /* every key */
}

static void test_endpoints(void **state) {
    (void)state;
    etcd_client *c;
    char err[256];
    etcd_options o = {.endpoints = "a:1,b:2,[fe80::1]:3"};
    assert_int_equal(etcd_client_new(&o, &c, err, sizeof err), 0);
    assert_string_equal(etcd_client_endpoint(c), "a:1");
    etcd_client_free(c);
    o.endpoints = "";
    assert_int_equal(etcd_client_new(&o, &c, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "no etcd endpoint"));
    o.endpoints = "a:1:2";
    assert_int_equal(etcd_client_new(&o, &c, err, sizeof err), -EINVAL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_url),       cmocka_unit_test(test_ttl),
        cmocka_unit_test(test_record),    cmocka_unit_test(test_prefix_end),
        cmocka_unit_test(test_endpoints),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
