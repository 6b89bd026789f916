/* Unit tests: bootstrap server (libevent) and client (libcurl) in one process:
 * register/query round trip and the exact /query JSON of PROTOCOL.md §2,
 * conflicts (400), idempotent re-registration, the retry policy (3 attempts,
 * backoff 1 s then 2 s doubling to a 10 s cap) against a closed port and a
 * server that never answers, /query table parsing, clean stop without fd leaks. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/clock.h"
#include "base/net.h"
#include "base/curl_glue.h"
#include "connector/mooncake/bootstrap_client.h"
#include "connector/mooncake/bootstrap_server.h"

#include <dirent.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int count_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

static bootstrap_server *start(char *server, size_t cap) {
    bootstrap_server *s = NULL;
    char err[256] = "";
    int rc = bootstrap_server_start("127.0.0.1", 0, &s, err, sizeof err);
    if (rc) fail_msg("start: %s", err);
    snprintf(server, cap, "127.0.0.1:%u", (unsigned)bootstrap_server_port(s));
    return s;
}

typedef struct sleep_log {
    double v[16]; /* requested sleeps */
    int n;
} sleep_log;

static void fake_sleep(double s, void *ud) {
    sleep_log *l = ud;
    if (l->n < 16) l->v[l->n++] = s;
}

static void test_register_and_query(void **state) {
    (void)state;
    char server[64], err[512];
    bootstrap_server *s = start(server, sizeof server);
    bootstrap_retry r;
    bootstrap_retry_init(&r, 5.0);
    bootstrap_registration a = {"engine-A", 0, 0, 0, "tcp://10.0.0.2:53817"};
    bootstrap_registration b = {"engine-A", 0, 1, 0, "tcp://10.0.0.2:53818"};
    bootstrap_registration c = {"engine-B", 1, 0, 0, "tcp://10.0.0.3:50000"};
    assert_int_equal(bootstrap_client_register(server, &b, &r, err, sizeof err), 0);
    assert_int_equal(bootstrap_client_register(server, &a, &r, err, sizeof err), 0);
    assert_int_equal(bootstrap_client_register(server, &c, &r, err, sizeof err), 0);
    /* an identical repeat (client retry after a timeout) is fine */
    assert_int_equal(bootstrap_client_register(server, &a, &r, err, sizeof err), 0);
    assert_int_equal(bootstrap_server_count_workers(s, 0, "engine-A"), 2);
    assert_int_equal(bootstrap_server_count_workers(s, 0, "engine-B"), 0);
    assert_int_equal(bootstrap_server_count_workers(s, 1, NULL), 1);
    assert_int_equal(bootstrap_server_count_workers(s, 2, NULL), 0);

    char *json = bootstrap_server_query_json(s);
    assert_string_equal(json, "{\"0\":{\"engine_id\":\"engine-A\",\"worker_addr\":{\"0\":{\"0\":"
                              "\"tcp://10.0.0.2:53817\"},\"1\":{\"0\":\"tcp://10.0.0.2:53818\"}}},"
                              "\"1\":{\"engine_id\":\"engine-B\",\"worker_addr\":{\"0\":{\"0\":"
                              "\"tcp://10.0.0.3:50000\"}}}}");
    free(json);

    bootstrap_table t;
    assert_int_equal(bootstrap_client_query(server, &r, &t, err, sizeof err), 0);
    assert_int_equal(t.n, 2);
    const bootstrap_engine *e0 = bootstrap_table_find(&t, 0);
    assert_non_null(e0);
    assert_string_equal(e0->engine_id, "engine-A");
    assert_int_equal(e0->tp_size, 2);
    assert_int_equal(e0->pp_size, 1);
    assert_string_equal(bootstrap_engine_addr(e0, 1, 0), "tcp://10.0.0.2:53818");
    assert_null(bootstrap_engine_addr(e0, 2, 0));
    assert_null(bootstrap_engine_addr(e0, 0, 1));
    assert_string_equal(bootstrap_table_find(&t, 1)->engine_id, "engine-B");
    assert_null(bootstrap_table_find(&t, 7));
    bootstrap_table_free(&t);

    /* the client also takes the remote_bootstrap_addr URL form */
    char url[80];
    snprintf(url, sizeof url, "http://%s/", server);
    assert_int_equal(bootstrap_client_query(url, &r, &t, err, sizeof err), 0);
    assert_int_equal(t.n, 2);
    bootstrap_table_free(&t);
    bootstrap_server_stop(s);
}

static void test_conflicts_are_400_not_retried(void **state) {
    (void)state;
    char server[64], err[512];
    bootstrap_server *s = start(server, sizeof server);
    sleep_log log = {0};
    bootstrap_retry r;
    bootstrap_retry_init(&r, 5.0);
    r.sleep_fn = fake_sleep;
    r.sleep_ud = &log;
    bootstrap_registration a = {"engine-A", 0, 0, 0, "tcp://10.0.0.2:1"};
    assert_int_equal(bootstrap_client_register(server, &a, &r, err, sizeof err), 0);
    bootstrap_registration other_engine = {"engine-X", 0, 1, 0, "tcp://10.0.0.9:1"};
    assert_int_equal(bootstrap_client_register(server, &other_engine, &r, err, sizeof err),
                     BOOTSTRAP_EHTTP);
    assert_non_null(strstr(err, "HTTP 400"));
    assert_non_null(
        strstr(err, "Engine ID mismatch for dp_rank=0: expected engine-A, got engine-X"));
    bootstrap_registration moved = {"engine-A", 0, 0, 0, "tcp://10.0.0.2:2"};
    assert_int_equal(bootstrap_client_register(server, &moved, &r, err, sizeof err),
                     BOOTSTRAP_EHTTP);
    assert_non_null(strstr(err, "already registered at tcp://10.0.0.2:1"));
    assert_int_equal(log.n, 0); /* an HTTP answer is never retried */
    /* the table is unchanged */
    char *json = bootstrap_server_query_json(s);
    assert_string_equal(json, "{\"0\":{\"engine_id\":\"engine-A\",\"worker_addr\":{\"0\":{\"0\":"
                              "\"tcp://10.0.0.2:1\"}}}}");
    free(json);
    bootstrap_server_stop(s);
}

/* A port with nothing listening: bind an ephemeral port, then close it. */
static uint16_t closed_port(void) {
    net_addr a;
    assert_int_equal(net_resolve("127.0.0.1", 0, &a), 0);
    int fd = net_listen(&a, 1);
    assert_true(fd >= 0);
    net_addr b;
    net_local_addr(fd, &b);
    uint16_t p = net_addr_port(&b);
    close(fd);
    return p;
}

static void test_retry_connection_refused(void **state) {
    (void)state;
    char server[64], err[512];
    snprintf(server, sizeof server, "127.0.0.1:%u", (unsigned)closed_port());
    sleep_log log = {0};
    bootstrap_retry r;
    bootstrap_retry_init(&r, 2.0);
    r.sleep_fn = fake_sleep;
    r.sleep_ud = &log;
    bootstrap_registration a = {"e", 0, 0, 0, "tcp://x:1"};
    assert_int_equal(bootstrap_client_register(server, &a, &r, err, sizeof err),
                     BOOTSTRAP_EUNREACH);
    assert_int_equal(log.n, 2); /* 3 attempts, 2 backoffs */
    assert_true(log.v[0] == 1.0 && log.v[1] == 2.0);
    assert_non_null(strstr(err, "failed after 3 attempts"));
    assert_non_null(strstr(err, server));
    /* longer: doubling capped at 10 s */
    log.n = 0;
    r.attempts = 7;
    bootstrap_table t;
    assert_int_equal(bootstrap_client_query(server, &r, &t, err, sizeof err), BOOTSTRAP_EUNREACH);
    double want[] = {1, 2, 4, 8, 10, 10};
    assert_int_equal(log.n, 6);
    for (int i = 0; i < 6; i++)
        assert_true(log.v[i] == want[i]);
    assert_int_equal(t.n, 0);
}

static void test_retry_timeout_never_hangs(void **state) {
    (void)state;
    /* a listener that never accepts: the TCP handshake completes in the kernel,
     * the HTTP answer never comes */
    net_addr a;
    assert_int_equal(net_resolve("127.0.0.1", 0, &a), 0);
    int fd = net_listen(&a, 16);
    assert_true(fd >= 0);
    net_addr b;
    net_local_addr(fd, &b);
    char server[64], err[512];
    snprintf(server, sizeof server, "127.0.0.1:%u", (unsigned)net_addr_port(&b));
    sleep_log log = {0};
    bootstrap_retry r;
    bootstrap_retry_init(&r, 0.2);
    r.sleep_fn = fake_sleep;
    r.sleep_ud = &log;
    bootstrap_table t;
    uint64_t t0 = clock_now_ns();
    assert_int_equal(bootstrap_client_query(server, &r, &t, err, sizeof err), BOOTSTRAP_EUNREACH);
    double elapsed = (double)(clock_now_ns() - t0) / 1e9;
    assert_int_equal(log.n, 2);
    assert_true(elapsed >= 0.55 && elapsed < 3.0);
    assert_non_null(strstr(err, "timeout 0.2 s each"));
    close(fd);
}

static void test_bad_server_address(void **state) {
    (void)state;
    char err[512];
    bootstrap_table t;
    const char *bad[] = {"", "localhost", "host:0", "host:99999", "[::1:80", NULL};
    for (int i = 0; bad[i]; i++) {
        assert_int_equal(bootstrap_client_query(bad[i], NULL, &t, err, sizeof err),
                         BOOTSTRAP_EINVAL);
        assert_non_null(strstr(err, "accepted: \"host:port\""));
    }
    assert_int_equal(bootstrap_client_query(NULL, NULL, &t, err, sizeof err), BOOTSTRAP_EINVAL);
    /* register with a bad address fails cleanly too (it once freed an unset buffer) */
    bootstrap_registration reg = {"e", 0, 0, 0, "tcp://x:1"};
    for (int i = 0; bad[i]; i++) {
        assert_int_equal(bootstrap_client_register(bad[i], &reg, NULL, err, sizeof err),
                         BOOTSTRAP_EINVAL);
        assert_non_null(strstr(err, "accepted: \"host:port\""));
    }
    bootstrap_registration no_addr = {"e", 0, 0, 0, NULL};
    assert_int_equal(bootstrap_client_register("h:1", &no_addr, NULL, err, sizeof err),
                     BOOTSTRAP_EINVAL);
}

static void test_table_parse(void **state) {
    (void)state;
    char err[256];
    bootstrap_table t;
    const char *ok = "{\"1\":{\"engine_id\":\"b\",\"worker_addr\":{\"0\":{\"1\":\"tcp://h:2\"}}},"
                     "\"0\":{\"engine_id\":\"a\",\"worker_addr\":{}}}";
    assert_int_equal(bootstrap_table_parse(ok, strlen(ok), &t, err, sizeof err), 0);
    assert_int_equal(t.n, 2);
    assert_int_equal(t.engines[0].dp_rank, 0); /* sorted */
    assert_int_equal(t.engines[0].tp_size, 0);
    assert_int_equal(t.engines[1].tp_size, 1);
    assert_int_equal(t.engines[1].pp_size, 2);
    assert_null(bootstrap_engine_addr(&t.engines[1], 0, 0));
    assert_string_equal(bootstrap_engine_addr(&t.engines[1], 0, 1), "tcp://h:2");
    bootstrap_table_free(&t);
    const char *bad[] = {"",
                         "[]",
                         "{\"x\":{\"engine_id\":\"a\",\"worker_addr\":{}}}",
                         "{\"-1\":{\"engine_id\":\"a\",\"worker_addr\":{}}}",
                         "{\"01\":{\"engine_id\":\"a\",\"worker_addr\":{}}}",
                         "{\"99999\":{\"engine_id\":\"a\",\"worker_addr\":{}}}",
                         "{\"0\":{\"engine_id\":1,\"worker_addr\":{}}}",
                         "{\"0\":{\"engine_id\":\"a\"}}",
                         "{\"0\":{\"engine_id\":\"a\",\"worker_addr\":{\"0\":\"tcp://h:1\"}}}",
                         "{\"0\":{\"engine_id\":\"a\",\"worker_addr\":{\"0\":{\"0\":5}}}}",
                         "{\"0\":{\"engine_id\":\"a\",\"worker_addr\":{\"0\":{\"x\":\"a\"}}}}",
                         NULL};
    for (int i = 0; bad[i]; i++) {
        if (bootstrap_table_parse(bad[i], strlen(bad[i]), &t, err, sizeof err) != BOOTSTRAP_EINVAL)
            fail_msg("accepted: %s", bad[i]);
        assert_true(strstr(err, "bootstrap query") != NULL);
        assert_int_equal(t.n, 0);
    }
}

static void test_start_errors_and_no_fd_leak(void **state) {
    (void)state;
    curl_glue_drop_kept(); /* earlier tests' kept connections */
    int before = count_fds();
    char server[64], err[256];
    for (int i = 0; i < 5; i++) {
        bootstrap_server *s = start(server, sizeof server);
        bootstrap_retry r;
        bootstrap_retry_init(&r, 5.0);
        bootstrap_table t;
        assert_int_equal(bootstrap_client_query(server, &r, &t, err, sizeof err), 0);
        assert_int_equal(t.n, 0);
        bootstrap_table_free(&t);
        bootstrap_server_stop(s);
    }
    curl_glue_drop_kept(); /* the lookups' kept connections are the client's, not a leak */
    assert_int_equal(count_fds(), before);
    /* the port in use */
    bootstrap_server *s = start(server, sizeof server);
    bootstrap_server *s2 = NULL;
    int rc = bootstrap_server_start("127.0.0.1", bootstrap_server_port(s), &s2, err, sizeof err);
    assert_true(rc < 0);
    assert_null(s2);
    assert_non_null(strstr(err, "cannot listen on 127.0.0.1:"));
    assert_non_null(strstr(err, "in use"));
    bootstrap_server_stop(s);
    rc = bootstrap_server_start("no-such-host.invalid", 0, &s2, err, sizeof err);
    assert_true(rc < 0);
    assert_non_null(strstr(err, "no-such-host.invalid"));
    bootstrap_server_stop(NULL);
    assert_int_equal(count_fds(), before);
}

/* ---- authentication ------------------------------- */

/* POST /register with an optional extra header; returns the status, body in out. */
static int raw_register(uint16_t port, const char *body, const char *hdr, char *out, size_t cap) {
    net_addr a;
    net_resolve("127.0.0.1", port, &a);
    uint64_t dl = clock_now_ns() + 5 * NS_PER_S;
    int fd = net_connect(&a, NULL, dl);
    assert_true(fd >= 0);
    net_set_nonblock(fd, 0); /* plain blocking reads below, bounded by SO_RCVTIMEO */
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char req[2048];
    int n = snprintf(req, sizeof req,
                     "POST /register HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n%s%s\r\n%s",
                     strlen(body), hdr ? hdr : "", hdr ? "\r\n" : "", body);
    assert_int_equal(net_send_all(fd, req, (size_t)n, dl), 0);
    size_t got = 0;
    ssize_t r;
    while (got + 1 < cap && (r = read(fd, out + got, cap - 1 - got)) > 0)
        got += (size_t)r;
    out[got] = '\0';
    close(fd);
    int status = 0;
    sscanf(out, "HTTP/1.1 %d", &status);
    return status;
}

static void test_register_requires_secret(void **state) {
    (void)state;
    bootstrap_server *s = NULL;
    char err[1024] = "", server[64];
    assert_int_equal(bootstrap_server_start_auth("127.0.0.1", 0, "s3cret", &s, err, sizeof err), 0);
    uint16_t port = bootstrap_server_port(s);
    snprintf(server, sizeof server, "127.0.0.1:%u", (unsigned)port);
    bootstrap_retry r;
    bootstrap_retry_init(&r, 5.0);
    bootstrap_registration fake = {"engine-F", 0, 0, 0, "tcp://10.9.9.9:1"};
    /* no secret: 401, not retried, both sides say why */
    uint64_t t0 = clock_now_ns();
    assert_int_equal(bootstrap_client_register(server, &fake, &r, err, sizeof err),
                     BOOTSTRAP_EAUTH);
    assert_true(clock_now_ns() - t0 < NS_PER_S);
    assert_non_null(strstr(err, "HTTP 401"));
    assert_non_null(strstr(err, "carried no X-Disagg-Auth header"));
    assert_non_null(strstr(err, "this instance has no auth_secret"));
    /* a different secret: 403 */
    assert_int_equal(bootstrap_client_register_auth(server, &fake, "guess", &r, err, sizeof err),
                     BOOTSTRAP_EAUTH);
    assert_non_null(strstr(err, "HTTP 403"));
    assert_non_null(strstr(err, "MAC does not match"));
    assert_int_equal(bootstrap_server_count_workers(s, 0, NULL), 0);
    assert_int_equal(bootstrap_server_auth_rejected(s), 2);
    /* raw: a valid header over another body (tampered), a stale one, garbage */
    const char *body = "{\"engine_id\":\"engine-A\",\"dp_rank\":0,\"tp_rank\":0,\"pp_rank\":0,"
                       "\"addr\":\"tcp://127.0.0.1:5\"}";
    const char *evil = "{\"engine_id\":\"engine-A\",\"dp_rank\":0,\"tp_rank\":0,\"pp_rank\":0,"
                       "\"addr\":\"tcp://6.6.6.6:5\"}";
    char hdr[200], out[4096];
    assert_int_equal(
        bootstrap_auth_header("s3cret", (long long)time(NULL), body, strlen(body), hdr, sizeof hdr),
        0);
    assert_int_equal(raw_register(port, evil, hdr, out, sizeof out), 403);
    assert_non_null(strstr(out, "MAC does not match"));
    char stale[200];
    assert_int_equal(bootstrap_auth_header("s3cret", (long long)time(NULL) - 1000, body,
                                           strlen(body), stale, sizeof stale),
                     0);
    assert_int_equal(raw_register(port, body, stale, out, sizeof out), 403);
    assert_non_null(strstr(out, "timestamp is 1000 s off"));
    assert_int_equal(raw_register(port, body, "X-Disagg-Auth: Bearer s3cret", out, sizeof out),
                     403);
    assert_non_null(strstr(out, "malformed X-Disagg-Auth header"));
    assert_non_null(strstr(out, "application/json"));
    assert_int_equal(bootstrap_server_count_workers(s, 0, NULL), 0);
    /* the documented header, byte for byte, is accepted; so is the client's */
    assert_int_equal(raw_register(port, body, hdr, out, sizeof out), 200);
    bootstrap_registration good = {"engine-A", 0, 1, 0, "tcp://127.0.0.1:6"};
    assert_int_equal(bootstrap_client_register_auth(server, &good, "s3cret", &r, err, sizeof err),
                     0);
    assert_int_equal(bootstrap_server_count_workers(s, 0, "engine-A"), 2);
    assert_int_equal(bootstrap_server_auth_rejected(s), 5);
    /* /query stays readable without the secret */
    bootstrap_table t;
    assert_int_equal(bootstrap_client_query(server, &r, &t, err, sizeof err), 0);
    assert_int_equal((int)t.n, 1);
    bootstrap_table_free(&t);
    bootstrap_server_stop(s);
    /* a server without a secret ignores the header (a vLLM server would too) */
    s = start(server, sizeof server);
    assert_int_equal(bootstrap_client_register_auth(server, &good, "s3cret", &r, err, sizeof err),
                     0);
    bootstrap_server_stop(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_register_and_query),
        cmocka_unit_test(test_conflicts_are_400_not_retried),
        cmocka_unit_test(test_retry_connection_refused),
        cmocka_unit_test(test_retry_timeout_never_hangs),
        cmocka_unit_test(test_bad_server_address),
        cmocka_unit_test(test_table_parse),
        cmocka_unit_test(test_start_errors_and_no_fd_leak),
        cmocka_unit_test(test_register_requires_secret),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
