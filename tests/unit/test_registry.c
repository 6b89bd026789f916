/* Unit tests: registry (interval lookup), segment descriptor encode/decode,
 * wire headers, host:port parsing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/net.h"
#include "disagg/transfer.h"
#include "transfer/handshake.h"
#include "transfer/registry.h"
#include "transfer/segment_desc.h"
#include "transfer/tcp_server.h"

#include <stdlib.h>
#include <string.h>

static void test_registry_bounds(void **state) {
    (void)state;
    registry r;
    registry_init(&r);
    assert_int_equal(registry_add(&r, 1000, 100, "cpu:0"), 0);
    assert_int_equal(registry_add(&r, 2000, 100, "cpu:0"), 0);
    assert_int_equal(registry_add(&r, 500, 100, NULL), 0);
    /* zero length, wrap-around and overlaps are rejected */
    assert_int_equal(registry_add(&r, 3000, 0, "cpu"), TRANSFER_EINVAL);
    assert_int_equal(registry_add(&r, UINT64_MAX - 10, 100, "cpu"), TRANSFER_EINVAL);
    assert_int_equal(registry_add(&r, 1099, 2, "cpu"), TRANSFER_EOVERLAP);
    assert_int_equal(registry_add(&r, 950, 51, "cpu"), TRANSFER_EOVERLAP);
    assert_int_equal(registry_add(&r, 1000, 100, "cpu"), TRANSFER_EOVERLAP);
    assert_int_equal(registry_add(&r, 900, 2000, "cpu"), TRANSFER_EOVERLAP);
    assert_int_equal(registry_add(&r, 1100, 900, "cpu"), 0); /* touching is fine */
    assert_int_equal(r.n, 4);
    for (size_t i = 1; i < r.n; i++)
        assert_true(r.v[i - 1].addr + r.v[i - 1].length <= r.v[i].addr);

    /* lookups: whole range must be inside one entry */
    assert_non_null(registry_find(&r, 1000, 100));
    assert_non_null(registry_find(&r, 1050, 50));
    assert_null(registry_find(&r, 1050, 51 + 900 + 1)); /* spans two entries */
    assert_null(registry_find(&r, 1099, 2)); /* [1000,1100) and [1100,2000) are two entries */
    assert_null(registry_find(&r, 600, 1));
    assert_null(registry_find(&r, 0, 1));
    assert_null(registry_find(&r, 2100, 1));
    assert_null(registry_find(&r, 1000, 0));
    assert_null(registry_find(&r, UINT64_MAX, 2));
    assert_int_equal(registry_remove(&r, 1001), TRANSFER_ENOTREG);
    assert_int_equal(registry_remove(&r, 1000), 0);
    assert_null(registry_find(&r, 1000, 1));
    assert_int_equal(registry_remove(&r, 1000), TRANSFER_ENOTREG);
    registry_free(&r);
}

static void test_registry_many(void **state) {
    (void)state;
    registry r;
    registry_init(&r);
    /* insert 10000 ranges in a scrambled order, check lookups at every edge */
    for (uint64_t i = 0; i < 10000; i++) {
        uint64_t k = (i * 7919) % 10000;
        assert_int_equal(registry_add(&r, 1000000 + k * 100, 50, "cpu:0"), 0);
    }
    for (uint64_t k = 0; k < 10000; k++) {
        uint64_t a = 1000000 + k * 100;
        assert_non_null(registry_find(&r, a, 50));
        assert_non_null(registry_find(&r, a + 49, 1));
        assert_null(registry_find(&r, a + 49, 2));
        assert_null(registry_find(&r, a + 50, 1));
        assert_null(registry_find(&r, a - 1, 1));
    }
    registry_free(&r);
}

static void test_desc_roundtrip(void **state) {
    (void)state;
    segment_desc d, e;
    segment_desc_init(&d);
    strcpy(d.name, "[::1]:1234");
    d.tcp_data_port = 4321;
    d.disagg_version = 1;
    strcpy(d.host_id, "boot/42");
    d.pid = 99;
    d.num_data_addrs = 2;
    strcpy(d.data_addrs[0], "10.0.0.1:4321");
    strcpy(d.data_addrs[1], "10.0.1.1:4321");
    registry_add(&d.buffers, 0x7f0000001000ull, 1ull << 30, "cpu:0");
    registry_add(&d.buffers, 0x1000, 4096, "cpu:1");
    char *js = segment_desc_encode(&d);
    assert_non_null(js);
    char err[256];
    assert_int_equal(segment_desc_decode(js, strlen(js), &e, err, sizeof err), 0);
    assert_string_equal(e.name, d.name);
    assert_int_equal(e.tcp_data_port, 4321);
    assert_int_equal(e.tcp_proto_version, 2);
    assert_string_equal(e.host_id, "boot/42");
    assert_int_equal(e.pid, 99);
    assert_int_equal(e.num_data_addrs, 2);
    assert_string_equal(e.data_addrs[1], "10.0.1.1:4321");
    assert_int_equal(e.buffers.n, 2);
    assert_int_equal(e.buffers.v[1].addr, 0x7f0000001000ull);
    assert_string_equal(e.buffers.v[0].location, "cpu:1");
    free(js);
    segment_desc_free(&d);
    segment_desc_free(&e);
}

static void test_desc_malformed(void **state) {
    (void)state;
    const char *bad[] = {
        "",
        "[]",
        "42",
        "{",
        "{\"name\": 5}",
        "{}",
        "{\"name\":\"a:1\",\"buffers\":{}}",
        "{\"name\":\"a:1\",\"buffers\":[{\"addr\":-1,\"length\":5}]}",
        "{\"name\":\"a:1\",\"buffers\":[{\"addr\":10,\"length\":0}]}",
        "{\"name\":\"a:1\",\"buffers\":[{\"addr\":10,\"length\":10},{\"addr\":15,\"length\":10}]}",
        "{\"name\":\"a:1\",\"tcp_data_port\":70000}",
        "{\"name\":\"a:1\",\"buffers\":[7]}",
        "{\"name\":\"a:1\",\"disagg\":{\"data_addrs\":\"x\"}}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        segment_desc d;
        char err[256] = "";
        assert_int_equal(segment_desc_decode(bad[i], strlen(bad[i]), &d, err, sizeof err),
                         TRANSFER_EPROTO);
        assert_true(strstr(err, "segment descriptor") != NULL);
    }
    /* a Mooncake peer's descriptor (no disagg extension) is fine */
    const char *mc =
        "{\"name\":\"1.2.3.4:5\",\"protocol\":\"tcp\",\"tcp_data_port\":6,"
        "\"buffers\":[{\"name\":\"cpu:0\",\"addr\":4096,\"length\":8192}],\"timestamp\":\"x\"}";
    segment_desc d;
    char err[256];
    assert_int_equal(segment_desc_decode(mc, strlen(mc), &d, err, sizeof err), 0);
    assert_int_equal(d.disagg_version, 0);
    assert_int_equal(d.buffers.n, 1);
    segment_desc_free(&d);
}

static void test_wire_headers(void **state) {
    (void)state;
    uint8_t h[TCP_HEADER_LEN];
    tcp_header_encode(h, 0x0102030405060708ull, 0x1112131415161718ull, 0x81);
    /* little-endian on the wire, as Mooncake's TCP v2 */
    assert_int_equal(h[0], 0x08);
    assert_int_equal(h[7], 0x01);
    assert_int_equal(h[8], 0x18);
    assert_int_equal(h[16], 0x81);
    uint64_t s, a;
    uint8_t op;
    tcp_header_decode(h, &s, &a, &op);
    assert_true(s == 0x0102030405060708ull && a == 0x1112131415161718ull && op == 0x81);
    uint8_t f[HANDSHAKE_HEADER_LEN];
    uint64_t len;
    uint8_t type;
    /* Mooncake's writeString: the length counts the type byte (301 = 0x12d). */
    handshake_header_encode(f, 300, 1);
    assert_int_equal(f[0], 0x2d);
    assert_int_equal(f[1], 1);
    assert_int_equal(f[8], 1);
    assert_int_equal(handshake_header_decode(f, &len, &type), 0);
    assert_true(len == 300 && type == 1);
    /* readString: a first byte above 3 is an untyped frame, all of it body. */
    f[8] = '{';
    assert_int_equal(handshake_header_decode(f, &len, &type), 0);
    assert_true(len == 301 && type == HANDSHAKE_TYPE_OLD);
    /* length 0 is invalid */
    memset(f, 0, sizeof f);
    f[8] = 1;
    assert_int_equal(handshake_header_decode(f, &len, &type), TRANSFER_EPROTO);
    handshake_header_encode(f, (uint64_t)1 << 63, 1);
    assert_int_equal(handshake_header_decode(f, &len, &type), TRANSFER_EPROTO);
}

static void test_host_port(void **state) {
    (void)state;
    char h[64];
    uint16_t p;
    assert_int_equal(net_split_host_port("10.0.0.1:8998", h, sizeof h, &p, 0), 0);
    assert_string_equal(h, "10.0.0.1");
    assert_int_equal(p, 8998);
    assert_int_equal(net_split_host_port("[fe80::1]:80", h, sizeof h, &p, 0), 0);
    assert_string_equal(h, "fe80::1");
    const char *bad[] = {"",        "host", "host:",      ":80",     "h:0",
                         "h:65536", "h:8a", "fe80::1:80", "[::1]80", "[::1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(net_split_host_port(bad[i], h, sizeof h, &p, 0), -22);
    assert_int_equal(net_split_host_port("h:0", h, sizeof h, &p, 1), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_registry_bounds), cmocka_unit_test(test_registry_many),
        cmocka_unit_test(test_desc_roundtrip),  cmocka_unit_test(test_desc_malformed),
        cmocka_unit_test(test_wire_headers),    cmocka_unit_test(test_host_port),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
