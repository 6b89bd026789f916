/* Unit tests: --kv-transfer-config JSON and the VLLM_MOONCAKE_* environment
 * (PROTOCOL.md §4): defaults, every accepted value,
 * and a matrix of bad inputs whose messages must name the key and the
 * accepted values. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "connector/kv_transfer_config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kv_transfer_config parse_ok(const char *json) {
    kv_transfer_config c;
    char err[1024];
    int rc = kv_transfer_config_parse(json, &c, err, sizeof err);
    if (rc != 0) fail_msg("parse of %s failed: %s", json, err);
    return c;
}

/* Parse must fail and the message must contain every needle. */
static void parse_bad(const char *json, const char *needle1, const char *needle2) {
    kv_transfer_config c;
    char err[1024];
    int rc = kv_transfer_config_parse(json, &c, err, sizeof err);
    if (rc != KV_CONFIG_EINVAL) fail_msg("parse of %s: rc %d, expected an error", json, rc);
    if (needle1 && !strstr(err, needle1))
        fail_msg("parse of %s: message '%s' lacks '%s'", json, err, needle1);
    if (needle2 && !strstr(err, needle2))
        fail_msg("parse of %s: message '%s' lacks '%s'", json, err, needle2);
}

static int is_uuid4(const char *s) {
    if (strlen(s) != 36) return 0;
    for (int i = 0; i < 36; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (s[i] != '-') return 0;
        } else if (!strchr("0123456789abcdef", s[i])) {
            return 0;
        }
    }
    return s[14] == '4' && strchr("89ab", s[19]) != NULL;
}

static void test_minimal_producer_defaults(void **state) {
    (void)state;
    kv_transfer_config c =
        parse_ok("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\"}");
    assert_string_equal(c.kv_connector, "MooncakeConnector");
    assert_int_equal(c.role, KV_ROLE_PRODUCER);
    assert_true(c.engine_id_generated);
    assert_true(is_uuid4(c.engine_id));
    assert_int_equal(c.load_failure_policy, KV_LOAD_FAILURE_FAIL);
    assert_int_equal(c.num_workers, 10);
    assert_int_equal(c.protocol, KV_PROTOCOL_RDMA);
    assert_true(c.rdma_requested);
    assert_string_equal(c.device_name, "");
    assert_string_equal(c.bootstrap_host, "");
    assert_int_equal(c.bootstrap_port, 0);
    assert_string_equal(c.ignored_keys, "");
    assert_string_equal(c.unknown_extra_keys, "");
    /* two parses give two different engine ids */
    kv_transfer_config d =
        parse_ok("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\"}");
    assert_string_not_equal(c.engine_id, d.engine_id);
}

static void test_full_config(void **state) {
    (void)state;
    kv_transfer_config c =
        parse_ok("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_consumer\","
                 "\"engine_id\":\"engine-7\",\"kv_load_failure_policy\":\"recompute\","
                 "\"kv_connector_extra_config\":{\"num_workers\":32,\"mooncake_protocol\":\"tcp\","
                 "\"device_name\":\"eth0,ib0\",\"bootstrap_server_address\":\"10.1.2.3:9000\"}}");
    assert_int_equal(c.role, KV_ROLE_CONSUMER);
    assert_string_equal(c.engine_id, "engine-7");
    assert_false(c.engine_id_generated);
    assert_int_equal(c.load_failure_policy, KV_LOAD_FAILURE_RECOMPUTE);
    assert_int_equal(c.num_workers, 32);
    assert_int_equal(c.protocol, KV_PROTOCOL_TCP);
    assert_false(c.rdma_requested);
    assert_string_equal(c.device_name, "eth0,ib0");
    assert_string_equal(c.bootstrap_host, "10.1.2.3");
    assert_int_equal(c.bootstrap_port, 9000);

    c = parse_ok("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
                 "\"kv_load_failure_policy\":\"fail\",\"engine_id\":null,"
                 "\"kv_connector_extra_config\":{\"mooncake_protocol\":\"shm\",\"num_workers\":1,"
                 "\"bootstrap_server_address\":\"http://[::1]:8998\"}}");
    assert_int_equal(c.role, KV_ROLE_BOTH);
    assert_true(c.engine_id_generated);
    assert_int_equal(c.protocol, KV_PROTOCOL_SHM);
    assert_int_equal(kv_transfer_config_effective_protocol(&c, 0), KV_PROTOCOL_SHM);
    assert_int_equal(c.num_workers, 1);
    assert_string_equal(c.bootstrap_host, "::1");
    assert_int_equal(c.bootstrap_port, 8998);

    c = parse_ok("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\","
                 "\"kv_connector_extra_config\":{\"mooncake_protocol\":\"rdma\","
                 "\"num_workers\":1024}}");
    assert_int_equal(c.protocol, KV_PROTOCOL_RDMA);
    assert_true(c.rdma_requested);
    assert_int_equal(c.num_workers, 1024);
    assert_int_equal(kv_transfer_config_effective_protocol(&c, 1), KV_PROTOCOL_RDMA);
    assert_int_equal(kv_transfer_config_effective_protocol(&c, 0), KV_PROTOCOL_TCP);
    assert_int_equal(kv_transfer_config_effective_protocol(&c, 0), KV_PROTOCOL_TCP);
    assert_string_equal(kv_role_name(KV_ROLE_BOTH), "kv_both");
    assert_string_equal(kv_protocol_name(KV_PROTOCOL_SHM), "shm");
    assert_string_equal(kv_load_failure_policy_name(KV_LOAD_FAILURE_RECOMPUTE), "recompute");
}

static void test_vllm_fields_accepted_and_ignored(void **state) {
    (void)state;
    kv_transfer_config c =
        parse_ok("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\","
                 "\"kv_buffer_device\":\"cuda\",\"kv_buffer_size\":1e9,\"kv_rank\":0,"
                 "\"kv_parallel_size\":2,\"kv_ip\":\"127.0.0.1\",\"kv_port\":14579,"
                 "\"kv_connector_module_path\":\"mooncake.mooncake_connector_v1\","
                 "\"enable_permute_local_kv\":false,"
                 "\"kv_connector_extra_config\":{\"use_native\":false,\"num_worker\":3}}");
    assert_string_equal(c.ignored_keys,
                        "kv_buffer_device,kv_buffer_size,kv_rank,kv_parallel_size,kv_ip,kv_port,"
                        "kv_connector_module_path,enable_permute_local_kv");
    /* unknown extra keys are warnings, not errors, and do not set num_workers */
    assert_string_equal(c.unknown_extra_keys, "use_native,num_worker");
    assert_int_equal(c.num_workers, 10);
    /* null where vLLM allows None */
    c = parse_ok("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\","
                 "\"kv_rank\":null,\"kv_connector_module_path\":null,\"kv_buffer_size\":5}");
    assert_string_equal(c.ignored_keys, "kv_rank,kv_connector_module_path,kv_buffer_size");
}

static void test_bad_json_and_shape(void **state) {
    (void)state;
    parse_bad("", "not valid JSON", "accepted");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",", "not valid JSON", "line 1");
    parse_bad("{'kv_role':'kv_producer'}", "not valid JSON", NULL);
    parse_bad("[1,2]", "an array", "accepted: a JSON object");
    parse_bad("\"MooncakeConnector\"", "a string", "a JSON object");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\","
              "\"kv_role\":\"kv_consumer\"}",
              "not valid JSON", "duplicate");
    kv_transfer_config c;
    char err[64];
    assert_int_equal(kv_transfer_config_parse(NULL, &c, err, sizeof err), KV_CONFIG_EINVAL);
    /* a tiny error buffer is truncated, never overrun */
    char tiny[8];
    assert_int_equal(kv_transfer_config_parse("{", &c, tiny, sizeof tiny), KV_CONFIG_EINVAL);
    assert_int_equal(strlen(tiny), 7);
}

static void test_bad_values_matrix(void **state) {
    (void)state;
    /* connector */
    parse_bad("{\"kv_role\":\"kv_producer\"}", "kv_connector is required", "MooncakeConnector");
    parse_bad("{\"kv_connector\":null,\"kv_role\":\"kv_producer\"}", "kv_connector is required",
              NULL);
    parse_bad("{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_producer\"}",
              "'NixlConnector' is a vLLM connector that disagg does not implement",
              "accepted: \"MooncakeConnector\"");
    parse_bad("{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_producer\"}",
              "does not implement", NULL);
    parse_bad("{\"kv_connector\":\"MoonCakeConector\",\"kv_role\":\"kv_producer\"}",
              "did you mean 'MooncakeConnector'", "accepted");
    parse_bad("{\"kv_connector\":\"Foo\",\"kv_role\":\"kv_producer\"}", "not a known connector",
              "accepted: \"MooncakeConnector\"");
    parse_bad("{\"kv_connector\":7,\"kv_role\":\"kv_producer\"}", "kv_connector: 7 is an integer",
              "a string or null");
    /* role */
    parse_bad("{\"kv_connector\":\"MooncakeConnector\"}", "kv_role is required",
              "kv_producer, kv_consumer, kv_both");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"producer\"}",
              "kv_role: 'producer' is not accepted", "accepted: kv_producer, kv_consumer, kv_both");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_prodcer\"}",
              "did you mean 'kv_producer'", NULL);
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"both\"}",
              "did you mean 'kv_both'", NULL);
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":1}", "kv_role: 1 is an integer",
              NULL);
    /* engine id */
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\",\"engine_id\":\"\"}",
              "engine_id", "non-empty string");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\",\"engine_id\":5}",
              "engine_id: 5 is an integer", "a string or null");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"engine_id\":\"a\\nb\"}",
              "engine_id", "control characters");
    char longid[400];
    int n = snprintf(longid, sizeof longid,
                     "{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
                     "\"engine_id\":\"");
    memset(longid + n, 'x', 200);
    snprintf(longid + n + 200, sizeof longid - (size_t)n - 200, "\"}");
    parse_bad(longid, "engine_id", "at most 127 bytes");
    /* policy */
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"kv_load_failure_policy\":\"retry\"}",
              "kv_load_failure_policy: 'retry' is not accepted", "accepted: fail, recompute");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"kv_load_failure_policy\":null}",
              "kv_load_failure_policy: null is null", "a string");
    /* unknown top-level key with and without a hint */
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"kv_rol\":\"kv_both\"}",
              "unknown key 'kv_rol' (did you mean 'kv_role'?)", "accepted keys: kv_connector");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"kv_conector_extra_config\":{}}",
              "did you mean 'kv_connector_extra_config'", NULL);
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"zzzzzzzzzz\":1}",
              "unknown key 'zzzzzzzzzz'; accepted keys", NULL);
    /* vLLM field types */
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\",\"kv_port\":\"1\"}",
              "kv_port: \"1\" is a string", "accepted: an integer");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"kv_buffer_size\":\"1e9\"}",
              "kv_buffer_size", "a number");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"enable_permute_local_kv\":1}",
              "enable_permute_local_kv", "true or false");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"kv_connector_extra_config\":[]}",
              "kv_connector_extra_config: [] is an array", "an object");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\",\"kv_rank\":1.5}",
              "kv_rank", "an integer or null");
}

static void test_bad_extra_config_matrix(void **state) {
    (void)state;
    static const char *const bad_workers[] = {"0", "-1", "1025", "10.5", "\"10\"", "true", "null"};
    for (size_t i = 0; i < sizeof bad_workers / sizeof bad_workers[0]; i++) {
        char json[256];
        snprintf(json, sizeof json,
                 "{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
                 "\"kv_connector_extra_config\":{\"num_workers\":%s}}",
                 bad_workers[i]);
        parse_bad(json, "kv_connector_extra_config.num_workers", "an integer from 1 to 1024");
    }
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"kv_connector_extra_config\":{\"mooncake_protocol\":\"RDMA2\"}}",
              "mooncake_protocol: 'RDMA2' is not accepted", "accepted: rdma, tcp, shm");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"kv_connector_extra_config\":{\"mooncake_protocol\":\"tpc\"}}",
              "did you mean 'tcp'", NULL);
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"kv_connector_extra_config\":{\"mooncake_protocol\":null}}",
              "mooncake_protocol: null is null", "accepted: rdma, tcp, shm");
    parse_bad("{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
              "\"kv_connector_extra_config\":{\"device_name\":3}}",
              "device_name: 3", "a string");
    static const char *const bad_addr[] = {
        "\"host\"", "\"host:0\"", "\"host:70000\"", "\":8998\"", "\"[::1:8998\"", "8998", "\"\""};
    for (size_t i = 0; i < sizeof bad_addr / sizeof bad_addr[0]; i++) {
        char json[256];
        snprintf(json, sizeof json,
                 "{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_both\","
                 "\"kv_connector_extra_config\":{\"bootstrap_server_address\":%s}}",
                 bad_addr[i]);
        parse_bad(json, "bootstrap_server_address", "\"host:port\"");
    }
}

static void test_edit_distance_and_uuid(void **state) {
    (void)state;
    assert_int_equal(kv_config_edit_distance("", ""), 0);
    assert_int_equal(kv_config_edit_distance("abc", ""), 3);
    assert_int_equal(kv_config_edit_distance("kitten", "sitting"), 3);
    assert_int_equal(kv_config_edit_distance("kv_role", "kv_rol"), 1);
    assert_int_equal(kv_config_edit_distance("KV_ROLE", "kv_role"), 0); /* case-insensitive */
}

static void env_clear(void) {
    unsetenv("VLLM_MOONCAKE_BOOTSTRAP_PORT");
    unsetenv("VLLM_MOONCAKE_CONNECTOR_TIMEOUT");
    unsetenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT");
    unsetenv("DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT");
    unsetenv("VLLM_HOST_IP");
    unsetenv("WITH_NVIDIA_PEERMEM");
}

static void env_bad(const char *name, const char *value, const char *accepted) {
    env_clear();
    setenv(name, value, 1);
    kv_transfer_env e;
    char err[512];
    int rc = kv_transfer_env_load(&e, err, sizeof err);
    if (rc != KV_CONFIG_EINVAL) fail_msg("%s='%s' accepted", name, value);
    char want[128];
    snprintf(want, sizeof want, "%s='%s'", name, value);
    if (!strstr(err, want)) fail_msg("message '%s' lacks '%s'", err, want);
    if (!strstr(err, accepted)) fail_msg("message '%s' lacks '%s'", err, accepted);
}

static void test_env_defaults_and_values(void **state) {
    (void)state;
    env_clear();
    kv_transfer_env e;
    char err[512];
    assert_int_equal(kv_transfer_env_load(&e, err, sizeof err), 0);
    assert_int_equal(e.bootstrap_port, 8998);
    assert_true(e.connector_timeout_s == 30.0);
    assert_true(e.abort_request_timeout_s == 480.0);
    assert_true(e.unknown_transfer_timeout_s == 30.0); /* bounded, <= 30 s */
    assert_string_equal(e.host_ip, "");
    assert_int_equal(e.with_nvidia_peermem, -1);

    setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "18998", 1);
    setenv("VLLM_MOONCAKE_CONNECTOR_TIMEOUT", "0.25", 1);
    setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "2", 1);
    setenv("DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT", "1.5", 1);
    setenv("VLLM_HOST_IP", "fe80::1", 1);
    setenv("WITH_NVIDIA_PEERMEM", "0", 1);
    assert_int_equal(kv_transfer_env_load(&e, err, sizeof err), 0);
    assert_int_equal(e.bootstrap_port, 18998);
    assert_true(e.connector_timeout_s == 0.25);
    assert_true(e.abort_request_timeout_s == 2.0);
    assert_true(e.unknown_transfer_timeout_s == 1.5);
    assert_string_equal(e.host_ip, "fe80::1");
    assert_int_equal(e.with_nvidia_peermem, 0);
    setenv("VLLM_HOST_IP", "10.0.0.2", 1);
    setenv("WITH_NVIDIA_PEERMEM", "1", 1);
    setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "", 1); /* empty = unset */
    assert_int_equal(kv_transfer_env_load(&e, err, sizeof err), 0);
    assert_string_equal(e.host_ip, "10.0.0.2");
    assert_int_equal(e.with_nvidia_peermem, 1);
    assert_int_equal(e.bootstrap_port, 8998);
    env_clear();
}

static void test_env_bad_matrix(void **state) {
    (void)state;
    const char *ports[] = {"0", "65536", "-1", "80x", "abc", " 80", "8998.0"};
    for (size_t i = 0; i < sizeof ports / sizeof ports[0]; i++)
        env_bad("VLLM_MOONCAKE_BOOTSTRAP_PORT", ports[i], "from 1 to 65535");
    const char *times[] = {"0", "-1", "abc", "inf", "nan", "1s", "1e9"};
    for (size_t i = 0; i < sizeof times / sizeof times[0]; i++) {
        env_bad("VLLM_MOONCAKE_CONNECTOR_TIMEOUT", times[i], "a number > 0");
        env_bad("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", times[i], "a number > 0");
        env_bad("DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT", times[i], "a number > 0");
    }
    const char *ips[] = {"localhost", "10.0.0", "10.0.0.256", "1.2.3.4:80", "::g"};
    for (size_t i = 0; i < sizeof ips / sizeof ips[0]; i++)
        env_bad("VLLM_HOST_IP", ips[i], "numeric IPv4 or IPv6");
    const char *peer[] = {"2", "yes", "true", "01"};
    for (size_t i = 0; i < sizeof peer / sizeof peer[0]; i++)
        env_bad("WITH_NVIDIA_PEERMEM", peer[i], "accepted: 1");
    env_clear();
}

/* auth_secret: the key, else DISAGG_KV_SECRET, else none;
 * a bad value is refused without echoing it. */
static void test_auth_secret_and_pending_cap(void **state) {
    (void)state;
    unsetenv("DISAGG_KV_SECRET");
    const char *base = "{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\"";
    char j[512];
    snprintf(j, sizeof j, "%s}", base);
    kv_transfer_config c = parse_ok(j);
    assert_string_equal(c.auth_secret, "");
    assert_int_equal(c.auth_secret_from_env, 0);
    assert_int_equal(c.max_pending_pulls, KV_CONFIG_PENDING_PULLS_DEFAULT);
    setenv("DISAGG_KV_SECRET", "from-env", 1);
    c = parse_ok(j);
    assert_string_equal(c.auth_secret, "from-env");
    assert_int_equal(c.auth_secret_from_env, 1);
    snprintf(j, sizeof j,
             "%s,\"kv_connector_extra_config\":{\"auth_secret\":\"s3cret\","
             "\"max_pending_pulls\":7}}",
             base);
    c = parse_ok(j); /* the key wins over the environment */
    assert_string_equal(c.auth_secret, "s3cret");
    assert_int_equal(c.auth_secret_from_env, 0);
    assert_int_equal(c.max_pending_pulls, 7);
    unsetenv("DISAGG_KV_SECRET");
    static const char *const bad[] = {"\"\"", "42", "null", "[\"x\"]"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(j, sizeof j, "%s,\"kv_connector_extra_config\":{\"auth_secret\":%s}}", base,
                 bad[i]);
        parse_bad(j, "kv_connector_extra_config.auth_secret", "a non-empty string");
    }
    char big[400];
    memset(big, 'k', 300);
    big[300] = '\0';
    char jb[800];
    snprintf(jb, sizeof jb, "%s,\"kv_connector_extra_config\":{\"auth_secret\":\"%s\"}}", base,
             big);
    parse_bad(jb, "auth_secret", "shorter than 256 bytes");
    kv_transfer_config cb;
    char err[1024];
    assert_int_equal(kv_transfer_config_parse(jb, &cb, err, sizeof err), KV_CONFIG_EINVAL);
    assert_null(strstr(err, big)); /* the secret is never echoed */
    setenv("DISAGG_KV_SECRET", big, 1);
    snprintf(j, sizeof j, "%s}", base);
    parse_bad(j, "DISAGG_KV_SECRET", "shorter than 256 bytes");
    unsetenv("DISAGG_KV_SECRET");
    static const char *const badcap[] = {"0", "-1", "1048577", "\"10\"", "1.5", "null"};
    for (size_t i = 0; i < sizeof badcap / sizeof badcap[0]; i++) {
        snprintf(j, sizeof j, "%s,\"kv_connector_extra_config\":{\"max_pending_pulls\":%s}}", base,
                 badcap[i]);
        parse_bad(j, "kv_connector_extra_config.max_pending_pulls", "an integer from 1 to 1048576");
    }
    /* max_remote_loads: default 512, 1..4096 */
    snprintf(j, sizeof j, "%s}", base);
    assert_int_equal(parse_ok(j).max_remote_loads, KV_CONFIG_REMOTE_LOADS_DEFAULT);
    assert_int_equal(KV_CONFIG_REMOTE_LOADS_DEFAULT, 512);
    snprintf(j, sizeof j, "%s,\"kv_connector_extra_config\":{\"max_remote_loads\":4096}}", base);
    assert_int_equal(parse_ok(j).max_remote_loads, 4096);
    static const char *const badloads[] = {"0", "4097", "\"8\"", "2.5", "null"};
    for (size_t i = 0; i < sizeof badloads / sizeof badloads[0]; i++) {
        snprintf(j, sizeof j, "%s,\"kv_connector_extra_config\":{\"max_remote_loads\":%s}}", base,
                 badloads[i]);
        parse_bad(j, "kv_connector_extra_config.max_remote_loads", "an integer from 1 to 4096");
    }
}

/* first_token_handoff: on by default, false switches it off, anything but a boolean
 * is refused naming the key and the accepted values. */
static void test_first_token_handoff_switch(void **state) {
    (void)state;
    const char *base = "{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_consumer\"";
    char j[512];
    snprintf(j, sizeof j, "%s}", base);
    assert_int_equal(parse_ok(j).first_token_handoff, 1);
    snprintf(j, sizeof j, "%s,\"kv_connector_extra_config\":{\"first_token_handoff\":false}}",
             base);
    kv_transfer_config c = parse_ok(j);
    assert_int_equal(c.first_token_handoff, 0);
    assert_string_equal(c.unknown_extra_keys, "");
    static const char *const bad[] = {"0", "\"false\"", "null", "[]"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(j, sizeof j, "%s,\"kv_connector_extra_config\":{\"first_token_handoff\":%s}}",
                 base, bad[i]);
        parse_bad(j, "kv_connector_extra_config.first_token_handoff", "true (default) or false");
    }
}

/* layerwise: on by default (both sides), false switches it off, anything but a boolean is
 * refused naming the key and the accepted values. */
static void test_layerwise_switch(void **state) {
    (void)state;
    const char *base = "{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\"";
    char j[512];
    snprintf(j, sizeof j, "%s}", base);
    assert_int_equal(parse_ok(j).layerwise, 1);
    snprintf(j, sizeof j, "%s,\"kv_connector_extra_config\":{\"layerwise\":false}}", base);
    kv_transfer_config c = parse_ok(j);
    assert_int_equal(c.layerwise, 0);
    assert_string_equal(c.unknown_extra_keys, "");
    static const char *const bad[] = {"1", "\"true\"", "null", "{}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(j, sizeof j, "%s,\"kv_connector_extra_config\":{\"layerwise\":%s}}", base, bad[i]);
        parse_bad(j, "kv_connector_extra_config.layerwise", "true (default) or false");
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_first_token_handoff_switch),
        cmocka_unit_test(test_layerwise_switch),
        cmocka_unit_test(test_minimal_producer_defaults),
        cmocka_unit_test(test_full_config),
        cmocka_unit_test(test_vllm_fields_accepted_and_ignored),
        cmocka_unit_test(test_bad_json_and_shape),
        cmocka_unit_test(test_bad_values_matrix),
        cmocka_unit_test(test_bad_extra_config_matrix),
        cmocka_unit_test(test_edit_distance_and_uuid),
        cmocka_unit_test(test_env_defaults_and_values),
        cmocka_unit_test(test_env_bad_matrix),
        cmocka_unit_test(test_auth_secret_and_pending_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
