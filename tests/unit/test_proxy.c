/* Unit tests of the proxy's pure parts: the PROTOCOL.md §1 body rewriting,
 * the §2 /query table, URL and bootstrap parsing, and the routing policies.
 * (HTTP heads and body framing, base/http_msg: test_http_msg.c.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "proxy/upstream.h"
#include "proxy/pd_request.h"
#include "proxy/policy.h"
#include "tests/unit/fake_upstream.h"

#include <errno.h>
#include <event2/buffer.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

static json_t *J(const char *s) {
    json_error_t e;
    json_t *j = json_loads(s, 0, &e);
    assert_non_null(j);
    return j;
}

static void test_prefill_and_decode_bodies(void **state) {
    (void)state;
    json_t *client = J("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                       "\"max_tokens\":50,\"max_completion_tokens\":50,\"stream\":true,"
                       "\"stream_options\":{\"include_usage\":true},\"temperature\":0.5,"
                       "\"min_tokens\":4,\"min_completion_tokens\":4}");
    json_t *p = pd_prefill_body(client, "xfer-1");
    /* expected per PROTOCOL.md §1 (1), written out by hand */
    json_t *want_p = J("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                       "\"max_tokens\":1,\"max_completion_tokens\":1,\"stream\":false,"
                       "\"temperature\":0.5,\"kv_transfer_params\":{\"do_remote_decode\":true,"
                       "\"do_remote_prefill\":false,\"transfer_id\":\"xfer-1\"}}");
    assert_true(json_equal(p, want_p));
    json_t *d = pd_decode_body(client, "eng-0", "http://10.0.0.2:8998", "xfer-1");
    json_t *want_d = json_deep_copy(client);
    json_object_set_new(want_d, "kv_transfer_params",
                        J("{\"do_remote_decode\":false,\"do_remote_prefill\":true,"
                          "\"remote_engine_id\":\"eng-0\",\"remote_bootstrap_addr\":"
                          "\"http://10.0.0.2:8998\",\"transfer_id\":\"xfer-1\"}"));
    assert_true(json_equal(d, want_d));
    /* the client's body is not modified */
    assert_true(json_is_true(json_object_get(client, "stream")));
    /* max_completion_tokens is not invented */
    json_t *c2 = J("{\"prompt\":\"x\"}");
    json_t *p2 = pd_prefill_body(c2, "t");
    assert_null(json_object_get(p2, "max_completion_tokens"));
    assert_int_equal(json_integer_value(json_object_get(p2, "max_tokens")), 1);
    json_decref(c2);
    json_decref(p2);
    /* n > 1: P prefills once (n 1), D gets the client's n */
    json_t *c3 = J("{\"prompt\":\"x\",\"n\":3,\"best_of\":3}");
    json_t *p3 = pd_prefill_body(c3, "t");
    assert_int_equal(json_integer_value(json_object_get(p3, "n")), 1);
    assert_null(json_object_get(p3, "best_of")); /* best_of follows n: dropped for P */
    json_t *d3 = pd_decode_body(c3, "e", "http://h:1", "t");
    assert_int_equal(json_integer_value(json_object_get(d3, "n")), 3);
    assert_int_equal(json_integer_value(json_object_get(d3, "best_of")), 3);
    json_decref(c3);
    json_decref(p3);
    json_decref(d3);
    /* /v1/responses: P is limited by max_output_tokens (max_tokens is not a Responses field) */
    json_t *c4 = J("{\"input\":\"x\",\"max_output_tokens\":40,\"stream\":true}");
    json_t *p4 = pd_prefill_body_for(c4, "t", "/v1/responses");
    assert_int_equal(json_integer_value(json_object_get(p4, "max_output_tokens")), 1);
    assert_null(json_object_get(p4, "max_tokens"));
    assert_true(json_is_false(json_object_get(p4, "stream")));
    json_t *c5 = J("{\"messages\":[],\"max_tokens\":9}");
    json_t *p5 = pd_prefill_body_for(c5, "t", "/v1/messages");
    assert_int_equal(json_integer_value(json_object_get(p5, "max_tokens")), 1);
    char param[64], msg[256];
    assert_int_equal(pd_check_api_body(c4, "/v1/responses", param, sizeof param, msg, sizeof msg),
                     0);
    json_t *c6 = J("{\"messages\":[]}");
    assert_int_not_equal(
        pd_check_api_body(c6, "/v1/messages", param, sizeof param, msg, sizeof msg), 0);
    assert_string_equal(param, "max_tokens");
    json_t *c7 = J("{\"input\":\"x\",\"max_output_tokens\":0}");
    assert_int_not_equal(
        pd_check_api_body(c7, "/v1/responses", param, sizeof param, msg, sizeof msg), 0);
    assert_string_equal(param, "max_output_tokens");
    json_decref(c4);
    json_decref(p4);
    json_decref(c5);
    json_decref(p5);
    json_decref(c6);
    json_decref(c7);
    json_decref(client);
    json_decref(p);
    json_decref(want_p);
    json_decref(d);
    json_decref(want_d);

    char err[200];
    json_t *out;
    assert_int_equal(pd_parse_client_body("[1]", 3, &out, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "array"));
    assert_int_equal(pd_parse_client_body("{\"a\":", 5, &out, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "not valid JSON"));
    assert_int_equal(pd_parse_client_body("{}", 2, &out, err, sizeof err), 0);
    json_decref(out);
}

/* What the proxy refuses before contacting an instance: param names the field. */
static void expect_refused(const char *body, int chat, const char *param, const char *needle) {
    json_t *j = J(body);
    char prm[64], msg[512];
    assert_int_equal(pd_check_client_body(j, chat, prm, sizeof prm, msg, sizeof msg), -EINVAL);
    assert_string_equal(prm, param);
    if (!strstr(msg, needle)) fail_msg("'%s' not in '%s' (body %s)", needle, msg, body);
    json_decref(j);
}

static void expect_accepted(const char *body, int chat) {
    json_t *j = J(body);
    char prm[64], msg[512];
    if (pd_check_client_body(j, chat, prm, sizeof prm, msg, sizeof msg))
        fail_msg("%s refused: %s: %s", body, prm, msg);
    json_decref(j);
}

static void test_client_body_checks(void **state) {
    (void)state;
    expect_refused("{\"prompt\":\"x\",\"n\":0}", 0, "n", "'n' must be an integer");
    expect_refused("{\"prompt\":\"x\",\"n\":true}", 0, "n", "got a boolean");
    expect_refused("{\"prompt\":\"x\",\"n\":2.5}", 0, "n", "got a number");
    expect_refused("{\"prompt\":\"x\",\"n\":2,\"best_of\":1}", 0, "best_of",
                   "'best_of' (1) must be at least 'n' (2)");
    expect_refused("{\"prompt\":\"x\",\"best_of\":2,\"stream\":true}", 0, "best_of",
                   "cannot be streamed");
    expect_refused("{\"prompt\":\"x\",\"best_of\":0}", 0, "best_of", "got 0");
    expect_refused("{\"prompt\":\"x\",\"max_tokens\":0}", 0, "max_tokens", "between 1 and");
    expect_refused("{\"prompt\":\"x\",\"max_tokens\":\"5\"}", 0, "max_tokens", "got a string");
    expect_refused("{\"prompt\":\"x\",\"min_tokens\":-1}", 0, "min_tokens", "got -1");
    expect_refused("{\"prompt\":\"x\",\"max_tokens\":2,\"min_tokens\":3}", 0, "min_tokens",
                   "'min_tokens' (3) must be at most max_tokens (2)");
    expect_refused("{\"prompt\":\"x\",\"stream\":1}", 0, "stream", "boolean");
    expect_refused("{\"prompt\":\"x\",\"stream_options\":{}}", 0, "stream_options",
                   "only be set when 'stream' is true");
    expect_refused("{\"prompt\":\"x\",\"stream\":true,\"stream_options\":[]}", 0, "stream_options",
                   "must be an object");
    expect_refused("{\"prompt\":\"x\",\"stream\":true,\"prompt_logprobs\":0}", 0, "prompt_logprobs",
                   "not available when 'stream' is true");
    expect_refused("{}", 0, "prompt", "'prompt' is required");
    expect_refused("{\"prompt\":{}}", 0, "prompt", "got an object");
    expect_refused("{\"prompt\":\"x\"}", 1, "messages", "'messages' is required");
    expect_refused("{\"messages\":{}}", 1, "messages", "got an object");
    expect_refused("{\"messages\":[],\"n\":0}", 1, "messages", "an empty list");
    expect_refused("{\"messages\":[{}],\"max_completion_tokens\":0}", 1, "max_completion_tokens",
                   "got 0");
    /* chat: max_completion_tokens wins over max_tokens */
    expect_refused("{\"messages\":[{}],\"max_tokens\":9,\"max_completion_tokens\":2,"
                   "\"min_tokens\":3}",
                   1, "min_tokens", "at most max_tokens (2)");
    expect_accepted("{\"messages\":[{}],\"max_tokens\":2,\"max_completion_tokens\":9,"
                    "\"min_tokens\":3}",
                    1);
    /* completions: max_completion_tokens is not its field (left to the instances) */
    expect_accepted("{\"prompt\":\"x\",\"max_completion_tokens\":0}", 0);
    expect_accepted("{\"prompt\":[1,2],\"n\":3.0,\"best_of\":3,\"max_tokens\":null,"
                    "\"stream\":null,\"stream_options\":null,\"min_tokens\":0}",
                    0);
    expect_accepted("{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"include_usage\":"
                    "true},\"prompt_logprobs\":null,\"temperature\":\"left to the server\"}",
                    0);
    expect_accepted("{\"prompt\":\"x\",\"prompt_logprobs\":2}", 0);
}

static void test_query_table(void **state) {
    (void)state;
    const char *q =
        "{\"1\": {\"engine_id\": \"e1\", \"worker_addr\": {\"0\": {\"0\": \"tcp://a:1\"},"
        " \"1\": {\"0\": \"tcp://a:2\"}}}, \"0\": {\"engine_id\": \"e0\", "
        "\"worker_addr\": {\"0\": {\"0\": \"tcp://a:3\"}}}}";
    pd_engine *rows;
    int n;
    char err[200];
    assert_int_equal(pd_parse_query(q, strlen(q), &rows, &n, err, sizeof err), 0);
    assert_int_equal(n, 2);
    assert_int_equal(rows[0].dp_rank, 0);
    assert_string_equal(rows[0].engine_id, "e0");
    assert_int_equal(rows[1].tp_size, 2);
    pd_engines_free(rows, n);
    assert_int_equal(pd_parse_query("{}", 2, &rows, &n, err, sizeof err), -ENOENT);
    assert_int_equal(
        pd_parse_query("{\"x\": {\"engine_id\": \"e\"}}", 25, &rows, &n, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "'x'"));
    assert_int_equal(pd_parse_query("{\"0\": {}}", 9, &rows, &n, err, sizeof err), -EINVAL);
    assert_int_equal(pd_parse_query("[]", 2, &rows, &n, err, sizeof err), -EINVAL);
}

static void test_urls(void **state) {
    (void)state;
    char host[256], err[300];
    uint16_t port;
    assert_int_equal(
        upstream_parse_url("http://192.168.0.2:8010", host, sizeof host, &port, err, sizeof err),
        0);
    assert_string_equal(host, "192.168.0.2");
    assert_int_equal(port, 8010);
    assert_int_equal(upstream_parse_url("localhost:9/", host, sizeof host, &port, err, sizeof err),
                     0);
    assert_int_equal(port, 9);
    assert_int_equal(
        upstream_parse_url("http://[::1]:8020", host, sizeof host, &port, err, sizeof err), 0);
    assert_string_equal(host, "::1");
    assert_int_equal(upstream_parse_url("http://h", host, sizeof host, &port, err, sizeof err), 0);
    assert_int_equal(port, 80);
    assert_int_equal(upstream_parse_url("http://h:0", host, sizeof host, &port, err, sizeof err),
                     -EINVAL);
    assert_int_equal(upstream_parse_url("http://h:1/v1", host, sizeof host, &port, err, sizeof err),
                     -EINVAL);
    assert_int_equal(upstream_parse_url("https://h:1", host, sizeof host, &port, err, sizeof err),
                     -EINVAL);
    assert_int_equal(upstream_parse_url("http://", host, sizeof host, &port, err, sizeof err),
                     -EINVAL);

    /* bootstrap: default 8998 on the prefill host, a port, or a full address */
    assert_int_equal(
        upstream_parse_bootstrap("u", "10.0.0.2", NULL, host, sizeof host, &port, err, sizeof err),
        0);
    assert_string_equal(host, "10.0.0.2");
    assert_int_equal(port, 8998);
    assert_int_equal(upstream_parse_bootstrap("u", "10.0.0.2", "9000", host, sizeof host, &port,
                                              err, sizeof err),
                     0);
    assert_int_equal(port, 9000);
    assert_string_equal(host, "10.0.0.2");
    assert_int_equal(upstream_parse_bootstrap("u", "10.0.0.2", "10.0.0.9:7000", host, sizeof host,
                                              &port, err, sizeof err),
                     0);
    assert_string_equal(host, "10.0.0.9");
    assert_int_equal(port, 7000);
    assert_int_equal(
        upstream_parse_bootstrap("u", "h", "70000", host, sizeof host, &port, err, sizeof err),
        -EINVAL);
}

static void test_policies(void **state) {
    (void)state;
    upstream p[2];
    fake(&p[0], UPSTREAM_PREFILL, 0, 2);
    fake(&p[1], UPSTREAM_PREFILL, 1, 1);
    unsigned rr = 0;
    int count[2][2] = {{0}};
    for (int i = 0; i < 6; i++) {
        const pd_engine *e;
        upstream *b = policy_pick(POLICY_ROUND_ROBIN, p, 2, &rr, 0, NULL, &e);
        count[b->index][e->dp_rank]++;
    }
    assert_int_equal(count[0][0], 2);
    assert_int_equal(count[0][1], 2);
    assert_int_equal(count[1][0], 2);
    /* exclusion and readiness */
    const pd_engine *e;
    assert_ptr_equal(policy_pick(POLICY_ROUND_ROBIN, p, 2, &rr, 1, NULL, &e), &p[1]);
    p[1].ready = 0;
    assert_null(policy_pick(POLICY_ROUND_ROBIN, p, 2, &rr, 1, NULL, &e));
    assert_null(policy_pick(POLICY_LEAST_LOADED, p, 2, &rr, 1, NULL, &e));
    p[1].ready = 1;
    /* least loaded: fewest outstanding wins; ties rotate */
    p[0].outstanding = 3;
    p[1].outstanding = 1;
    for (int i = 0; i < 4; i++)
        assert_ptr_equal(policy_pick(POLICY_LEAST_LOADED, p, 2, &rr, 0, NULL, &e), &p[1]);
    p[0].outstanding = p[1].outstanding = 0;
    upstream *x = policy_pick(POLICY_LEAST_LOADED, p, 2, &rr, 0, NULL, &e);
    upstream *y = policy_pick(POLICY_LEAST_LOADED, p, 2, &rr, 0, NULL, &e);
    assert_ptr_not_equal(x, y);
    /* dp ranks of the chosen prefill cycle */
    p[1].ready = 0;
    assert_ptr_equal(policy_pick(POLICY_LEAST_LOADED, p, 2, &rr, 0, NULL, &e), &p[0]);
    int r0 = e->dp_rank;
    assert_ptr_equal(policy_pick(POLICY_LEAST_LOADED, p, 2, &rr, 0, NULL, &e), &p[0]);
    int r1 = e->dp_rank;
    assert_int_not_equal(r0, r1);
    policy_kind k;
    assert_int_equal(policy_parse("round_robin", &k), 0);
    assert_int_equal(k, POLICY_ROUND_ROBIN);
    assert_int_equal(policy_parse("random", &k), -EINVAL);
    free(p[0].engines);
    free(p[1].engines);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefill_and_decode_bodies),
        cmocka_unit_test(test_client_body_checks),
        cmocka_unit_test(test_query_table),
        cmocka_unit_test(test_urls),
        cmocka_unit_test(test_policies),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
