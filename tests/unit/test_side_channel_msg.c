/* Unit tests: side-channel msgpack messages (PROTOCOL.md §3) against golden
 * bytes produced by msgspec — the encoder vLLM's MooncakeConnector uses
 * (tests/golden/gen_side_channel_msg.py) — plus hostile inputs: truncated,
 * oversized, wrong types, missing keys, huge declared counts, deep nesting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "connector/mooncake/side_channel_msg.h"
#include "tests/golden/side_channel_msg_golden.h"

#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- golden decode ------------------------------------------------------ */

static void test_decode_golden_pull_min(void **state) {
    (void)state;
    side_channel_pull p;
    char err[256];
    assert_int_equal(
        side_channel_pull_decode(GOLDEN_PULL_MIN, sizeof GOLDEN_PULL_MIN, &p, err, sizeof err), 0);
    assert_string_equal(p.remote_hostname, "10.0.0.3");
    assert_int_equal(p.remote_port, 17001);
    assert_int_equal(p.remote_tp_size, 1);
    assert_int_equal(p.remote_tp_rank, 0);
    assert_int_equal(p.n_reqs, 2);
    assert_string_equal(p.reqs[0].req_id, "cmpl-1");
    assert_string_equal(p.reqs[0].transfer_id, "xfer-a");
    assert_int_equal(p.reqs[0].n_groups, 1);
    assert_int_equal(p.reqs[0].groups[0].n, 5);
    int64_t want[] = {3, 4, 5, 200, 70000};
    for (int i = 0; i < 5; i++)
        assert_int_equal(p.reqs[0].groups[0].ids[i], want[i]);
    assert_string_equal(p.reqs[1].req_id, "cmpl-2");
    assert_string_equal(p.reqs[1].transfer_id, "xfer-b");
    assert_int_equal(p.reqs[1].n_groups, 0); /* release */
    assert_int_equal(p.n_regions, 1);
    assert_true(p.kv_caches_base_addr[0] == 0x7F0000001000ull);
    assert_int_equal(p.block_lens[0], 1835008);
    assert_int_equal(p.kv_block_lens[0], 1835008);
    assert_int_equal(p.n_layer_names, 0);
    assert_int_equal(p.n_layer_indices, 0);
    assert_int_equal(p.n_group_indices, 0);
    assert_int_equal(p.remote_pp_size, 1);
    assert_null(p.layout);
    side_channel_pull_free(&p);
    assert_null(p.arena);
}

static void test_decode_golden_pull_full(void **state) {
    (void)state;
    side_channel_pull p;
    char err[256];
    assert_int_equal(
        side_channel_pull_decode(GOLDEN_PULL_FULL, sizeof GOLDEN_PULL_FULL, &p, err, sizeof err),
        0);
    assert_string_equal(p.remote_hostname, "decode-host");
    assert_int_equal(p.remote_port, 65535);
    assert_int_equal(p.remote_tp_size, 4);
    assert_int_equal(p.remote_tp_rank, 3);
    assert_int_equal(p.reqs[0].n_groups, 2);
    assert_int_equal(p.reqs[0].groups[0].n, 1);
    assert_int_equal(p.reqs[0].groups[1].ids[1], 2);
    assert_true(p.kv_caches_base_addr[0] == UINT64_MAX);
    assert_true(p.kv_caches_base_addr[1] == 0);
    assert_int_equal(p.kv_block_lens[0], 2048);
    assert_int_equal(p.n_layer_names, 2);
    assert_string_equal(p.registered_layer_names[1], "model.layers.1.self_attn");
    assert_int_equal(p.registered_layer_indices[1], 1);
    assert_int_equal(p.registered_group_indices[1], -1);
    assert_int_equal(p.remote_pp_size, 2);
    side_channel_pull_free(&p);
}

static void test_decode_golden_replies(void **state) {
    (void)state;
    side_channel_reply r;
    char err[256];
    assert_int_equal(side_channel_reply_decode(GOLDEN_REPLY_FINISH, sizeof GOLDEN_REPLY_FINISH, &r,
                                               err, sizeof err),
                     0);
    assert_int_equal(r.status, SIDE_CHANNEL_FINISH);
    assert_int_equal(r.n_ok, 2);
    assert_string_equal(r.ok_reqs[1], "cmpl-2");
    assert_int_equal(r.n_err, 0);
    assert_null(r.err_msg);
    side_channel_reply_free(&r);
    assert_int_equal(side_channel_reply_decode(GOLDEN_REPLY_ERROR, sizeof GOLDEN_REPLY_ERROR, &r,
                                               err, sizeof err),
                     0);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_int_equal(r.n_err, 1);
    assert_string_equal(r.err_reqs[0], "cmpl-3");
    assert_string_equal(r.err_msg, "Timeout waiting for P side ready.");
    side_channel_reply_free(&r);
    assert_int_equal(side_channel_reply_decode(GOLDEN_REPLY_CONTINUE, sizeof GOLDEN_REPLY_CONTINUE,
                                               &r, err, sizeof err),
                     0);
    assert_int_equal(r.status, SIDE_CHANNEL_CONTINUE);
    assert_string_equal(side_channel_status_name(r.status), "CONTINUE");
    side_channel_reply_free(&r);
}

/* ---- golden encode: our bytes equal msgspec's --------------------------- */

static void assert_bytes(const char *got, size_t got_len, const unsigned char *want,
                         size_t want_len) {
    if (got_len != want_len) fail_msg("length %zu, want %zu", got_len, want_len);
    for (size_t i = 0; i < want_len; i++)
        if ((unsigned char)got[i] != want[i])
            fail_msg("byte %zu: 0x%02x, want 0x%02x", i, (unsigned char)got[i], want[i]);
}

static void test_encode_matches_msgspec(void **state) {
    (void)state;
    int64_t ids1[] = {3, 4, 5, 200, 70000};
    side_channel_block_group g1 = {ids1, 5};
    side_channel_req_blocks reqs[2] = {{"cmpl-1", "xfer-a", &g1, 1}, {"cmpl-2", "xfer-b", NULL, 0}};
    uint64_t base[] = {0x7F0000001000ull};
    int64_t lens[] = {1835008};
    side_channel_pull p = {.remote_hostname = "10.0.0.3",
                           .remote_port = 17001,
                           .remote_tp_size = 1,
                           .remote_tp_rank = 0,
                           .reqs = reqs,
                           .n_reqs = 2,
                           .kv_caches_base_addr = base,
                           .block_lens = lens,
                           .kv_block_lens = lens,
                           .n_regions = 1,
                           .remote_pp_size = 1};
    char *buf;
    size_t len;
    assert_int_equal(side_channel_pull_encode(&p, &buf, &len), 0);
    assert_bytes(buf, len, GOLDEN_PULL_MIN, sizeof GOLDEN_PULL_MIN);
    free(buf);

    int64_t i0[] = {0}, i12[] = {1, 2};
    side_channel_block_group gs[2] = {{i0, 1}, {i12, 2}};
    side_channel_req_blocks r1 = {"r", "x", gs, 2};
    uint64_t base2[] = {UINT64_MAX, 0};
    int64_t bl[] = {4096, 8192}, kbl[] = {2048, 8192}, li[] = {0, 1}, gi[] = {0, -1};
    char *names[] = {"model.layers.0.self_attn", "model.layers.1.self_attn"};
    side_channel_pull q = {.remote_hostname = "decode-host",
                           .remote_port = 65535,
                           .remote_tp_size = 4,
                           .remote_tp_rank = 3,
                           .reqs = &r1,
                           .n_reqs = 1,
                           .kv_caches_base_addr = base2,
                           .block_lens = bl,
                           .kv_block_lens = kbl,
                           .n_regions = 2,
                           .registered_layer_names = names,
                           .n_layer_names = 2,
                           .registered_layer_indices = li,
                           .n_layer_indices = 2,
                           .registered_group_indices = gi,
                           .n_group_indices = 2,
                           .remote_pp_size = 2};
    assert_int_equal(side_channel_pull_encode(&q, &buf, &len), 0);
    assert_bytes(buf, len, GOLDEN_PULL_FULL, sizeof GOLDEN_PULL_FULL);
    free(buf);

    char *ok[] = {"cmpl-1", "cmpl-2"}, *bad[] = {"cmpl-3"};
    side_channel_reply r = {.status = SIDE_CHANNEL_FINISH, .ok_reqs = ok, .n_ok = 2};
    assert_int_equal(side_channel_reply_encode(&r, &buf, &len), 0);
    assert_bytes(buf, len, GOLDEN_REPLY_FINISH, sizeof GOLDEN_REPLY_FINISH);
    free(buf);
    side_channel_reply e = {.status = SIDE_CHANNEL_ERROR,
                            .err_reqs = bad,
                            .n_err = 1,
                            .err_msg = "Timeout waiting for P side ready."};
    assert_int_equal(side_channel_reply_encode(&e, &buf, &len), 0);
    assert_bytes(buf, len, GOLDEN_REPLY_ERROR, sizeof GOLDEN_REPLY_ERROR);
    free(buf);
    side_channel_reply c = {.status = SIDE_CHANNEL_CONTINUE};
    assert_int_equal(side_channel_reply_encode(&c, &buf, &len), 0);
    assert_bytes(buf, len, GOLDEN_REPLY_CONTINUE, sizeof GOLDEN_REPLY_CONTINUE);
    free(buf);
}

static void test_layout_extension_roundtrip(void **state) {
    (void)state;
    int64_t ids[] = {7};
    side_channel_block_group g = {ids, 1};
    side_channel_req_blocks r = {"req", "xfer", &g, 1};
    uint64_t base[] = {4096};
    int64_t lens[] = {64};
    side_channel_pull p = {.remote_hostname = "h",
                           .remote_port = 1,
                           .remote_tp_size = 1,
                           .reqs = &r,
                           .n_reqs = 1,
                           .kv_caches_base_addr = base,
                           .block_lens = lens,
                           .kv_block_lens = lens,
                           .n_regions = 1,
                           .remote_pp_size = 1,
                           .layout = "qwen2:L24:kv2:hd64:bs16:f32"};
    char *buf;
    size_t len;
    assert_int_equal(side_channel_pull_encode(&p, &buf, &len), 0);
    side_channel_pull d;
    char err[256];
    assert_int_equal(side_channel_pull_decode(buf, len, &d, err, sizeof err), 0);
    assert_string_equal(d.layout, "qwen2:L24:kv2:hd64:bs16:f32");
    assert_int_equal(d.reqs[0].groups[0].ids[0], 7);
    side_channel_pull_free(&d);
    /* the extension key is the only addition: a decoder of vLLM's fields sees 9 keys */
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    assert_int_equal(msgpack_unpack_next(&u, buf, len, &off), MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(u.data.via.map.size, 9);
    const msgpack_object_kv *last = &u.data.via.map.ptr[8];
    assert_int_equal(last->key.via.str.size, strlen(SIDE_CHANNEL_LAYOUT_KEY));
    assert_memory_equal(last->key.via.str.ptr, SIDE_CHANNEL_LAYOUT_KEY, 13);
    msgpack_unpacked_destroy(&u);
    free(buf);
}

/* ---- hostile and malformed input ---------------------------------------- */

/* Build a pull map with msgpack-c, letting a callback replace or drop keys. */
typedef struct pull_override {
    const char *drop;    /* key to leave out */
    const char *key;     /* key whose value is replaced */
    const char *raw_hex; /* its replacement, msgpack bytes as hex */
} pull_override;

static void pack_hex(msgpack_sbuffer *sb, const char *hex) {
    for (size_t i = 0; hex[i] && hex[i + 1]; i += 2) {
        char b[3] = {hex[i], hex[i + 1], 0};
        char c = (char)strtol(b, NULL, 16);
        msgpack_sbuffer_write(sb, &c, 1);
    }
}

static void pack_s(msgpack_packer *pk, const char *s) {
    msgpack_pack_str(pk, strlen(s));
    msgpack_pack_str_body(pk, s, strlen(s));
}

static msgpack_sbuffer build_pull(pull_override o) {
    static const char *const keys[] = {"remote_hostname", "remote_port",   "remote_tp_size",
                                       "remote_tp_rank",  "req_blocks",    "kv_caches_base_addr",
                                       "block_lens",      "kv_block_lens", "some_future_key"};
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    size_t n = 9 - (o.drop != NULL);
    msgpack_pack_map(&pk, n);
    for (size_t i = 0; i < 9; i++) {
        const char *k = keys[i];
        if (o.drop && strcmp(o.drop, k) == 0) continue;
        pack_s(&pk, k);
        if (o.key && strcmp(o.key, k) == 0) {
            pack_hex(&sb, o.raw_hex);
            continue;
        }
        switch (i) {
        case 0:
            pack_s(&pk, "d");
            break;
        case 1:
            msgpack_pack_int(&pk, 9000);
            break;
        case 2:
            msgpack_pack_int(&pk, 2);
            break;
        case 3:
            msgpack_pack_int(&pk, 1);
            break;
        case 4:
            msgpack_pack_map(&pk, 1);
            pack_s(&pk, "req");
            msgpack_pack_array(&pk, 2);
            pack_s(&pk, "xfer");
            msgpack_pack_array(&pk, 1);
            msgpack_pack_array(&pk, 2);
            msgpack_pack_int(&pk, 1);
            msgpack_pack_int(&pk, 2);
            break;
        case 5:
            msgpack_pack_array(&pk, 1);
            msgpack_pack_uint64(&pk, 1u << 20);
            break;
        case 6:
        case 7:
            msgpack_pack_array(&pk, 1);
            msgpack_pack_int(&pk, 4096);
            break;
        case 8: /* unknown keys are ignored, whatever their value */
            msgpack_pack_map(&pk, 1);
            msgpack_pack_nil(&pk);
            msgpack_pack_float(&pk, 1.5f);
            break;
        }
    }
    return sb;
}

static void pull_bad(pull_override o, const char *needle) {
    msgpack_sbuffer sb = build_pull(o);
    side_channel_pull p;
    char err[256];
    int rc = side_channel_pull_decode(sb.data, sb.size, &p, err, sizeof err);
    if (rc != SIDE_CHANNEL_EINVAL)
        fail_msg("override %s/%s=%s: rc %d, expected an error", o.drop ? o.drop : "-",
                 o.key ? o.key : "-", o.raw_hex ? o.raw_hex : "-", rc);
    if (!strstr(err, needle)) fail_msg("message '%s' lacks '%s'", err, needle);
    assert_null(p.arena);
    msgpack_sbuffer_destroy(&sb);
}

static void test_built_pull_ok(void **state) {
    (void)state;
    msgpack_sbuffer sb = build_pull((pull_override){0});
    side_channel_pull p;
    char err[256];
    assert_int_equal(side_channel_pull_decode(sb.data, sb.size, &p, err, sizeof err), 0);
    assert_int_equal(p.remote_tp_rank, 1);
    assert_int_equal(p.reqs[0].groups[0].ids[1], 2);
    side_channel_pull_free(&p);
    /* a flat block-id list (older vLLM: one KV group) is one group */
    msgpack_sbuffer_destroy(&sb);
    sb = build_pull((pull_override){.key = "req_blocks",
                                    .raw_hex = "81a3726571"
                                               "92a478666572"
                                               "93010203"});
    assert_int_equal(side_channel_pull_decode(sb.data, sb.size, &p, err, sizeof err), 0);
    assert_int_equal(p.reqs[0].n_groups, 1);
    assert_int_equal(p.reqs[0].groups[0].n, 3);
    assert_int_equal(p.reqs[0].groups[0].ids[2], 3);
    side_channel_pull_free(&p);
    msgpack_sbuffer_destroy(&sb);
}

static void test_pull_missing_and_wrong_types(void **state) {
    (void)state;
    static const char *const required[] = {"remote_hostname", "remote_port",  "remote_tp_size",
                                           "remote_tp_rank",  "req_blocks",   "kv_caches_base_addr",
                                           "block_lens",      "kv_block_lens"};
    for (size_t i = 0; i < 8; i++) {
        char want[96];
        snprintf(want, sizeof want, "missing required key '%s'", required[i]);
        pull_bad((pull_override){.drop = required[i]}, want);
    }
    pull_bad((pull_override){.key = "remote_hostname", .raw_hex = "05"},
             "'remote_hostname': expected a string, got an integer");
    pull_bad((pull_override){.key = "remote_hostname", .raw_hex = "c40164"},
             "expected a string, got binary");
    pull_bad((pull_override){.key = "remote_hostname", .raw_hex = "a26100"}, "NUL byte");
    pull_bad((pull_override){.key = "remote_port", .raw_hex = "a3393030"},
             "'remote_port': expected an integer, got a string");
    pull_bad((pull_override){.key = "remote_port", .raw_hex = "cb4000000000000000"}, "got a float");
    pull_bad((pull_override){.key = "remote_port", .raw_hex = "00"}, "out of range 1..65535");
    pull_bad((pull_override){.key = "remote_port", .raw_hex = "ce00010000"},
             "65536 is out of range");
    pull_bad((pull_override){.key = "remote_port", .raw_hex = "c3"}, "got a boolean");
    pull_bad((pull_override){.key = "remote_tp_rank", .raw_hex = "02"}, "out of range 0..1");
    pull_bad((pull_override){.key = "remote_tp_rank", .raw_hex = "ff"}, "-1 is out of range");
    pull_bad((pull_override){.key = "remote_tp_size", .raw_hex = "00"}, "'remote_tp_size'");
    pull_bad((pull_override){.key = "req_blocks", .raw_hex = "90"}, "'req_blocks': expected a map");
    /* value not a 2-tuple, transfer id not a string, negative and float block ids */
    pull_bad((pull_override){.key = "req_blocks",
                             .raw_hex = "81a3726571"
                                        "91a478666572"},
             "expected [transfer_id");
    pull_bad((pull_override){.key = "req_blocks",
                             .raw_hex = "81a3726571"
                                        "920190"},
             "'req_blocks transfer_id': expected a string");
    pull_bad((pull_override){.key = "req_blocks",
                             .raw_hex = "81a3726571"
                                        "92a4786665729191ff"},
             "-1 is out of range");
    pull_bad((pull_override){.key = "req_blocks",
                             .raw_hex = "81a3726571"
                                        "92a47866657291"
                                        "91cb3ff0000000000000"},
             "got a float");
    pull_bad((pull_override){.key = "req_blocks",
                             .raw_hex = "8101"
                                        "92a4786665729191"
                                        "01"},
             "'req_blocks key': expected a string");
    /* the same request id twice */
    pull_bad((pull_override){.key = "req_blocks",
                             .raw_hex = "82a3726571"
                                        "92a178"
                                        "90"
                                        "a3726571"
                                        "92a179"
                                        "90"},
             "request id 'req' twice");
    /* regions */
    pull_bad((pull_override){.key = "kv_caches_base_addr", .raw_hex = "91ff"},
             "unsigned 64-bit integers");
    pull_bad((pull_override){.key = "kv_caches_base_addr", .raw_hex = "920102"},
             "must have the same length, got 2, 1 and 1");
    pull_bad((pull_override){.key = "kv_block_lens", .raw_hex = "91cd2000"},
             "kv_block_len 8192 exceeds block_len 4096");
    pull_bad((pull_override){.key = "block_lens", .raw_hex = "a0"},
             "'block_lens': expected an array");
}

static void test_pull_duplicate_key(void **state) {
    (void)state;
    /* {"remote_port": 1, "remote_port": 2, ...}: build by hand */
    msgpack_sbuffer sb = build_pull((pull_override){0});
    /* duplicate via raw surgery: bump map count and append a second remote_port */
    unsigned char *d = (unsigned char *)sb.data;
    assert_int_equal(d[0], 0x89);
    d[0] = 0x8a;
    pack_hex(&sb, "ab72656d6f74655f706f727401");
    side_channel_pull p;
    char err[256];
    assert_int_equal(side_channel_pull_decode(sb.data, sb.size, &p, err, sizeof err),
                     SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, "key 'remote_port' appears twice"));
    msgpack_sbuffer_destroy(&sb);
}

static void test_truncated_everywhere(void **state) {
    (void)state;
    /* every strict prefix of a valid message is rejected without a crash */
    for (size_t n = 0; n < sizeof GOLDEN_PULL_FULL; n++) {
        side_channel_pull p;
        char err[256];
        int rc = side_channel_pull_decode(GOLDEN_PULL_FULL, n, &p, err, sizeof err);
        if (rc != SIDE_CHANNEL_EINVAL) fail_msg("prefix %zu accepted", n);
        if (n > 0 && !strstr(err, "truncated")) fail_msg("prefix %zu: '%s'", n, err);
    }
    for (size_t n = 0; n < sizeof GOLDEN_REPLY_ERROR; n++) {
        side_channel_reply r;
        char err[256];
        assert_int_equal(side_channel_reply_decode(GOLDEN_REPLY_ERROR, n, &r, err, sizeof err),
                         SIDE_CHANNEL_EINVAL);
    }
    /* trailing bytes */
    unsigned char two[sizeof GOLDEN_REPLY_CONTINUE + 1];
    memcpy(two, GOLDEN_REPLY_CONTINUE, sizeof GOLDEN_REPLY_CONTINUE);
    two[sizeof GOLDEN_REPLY_CONTINUE] = 0xc0;
    side_channel_reply r;
    char err[256];
    assert_int_equal(side_channel_reply_decode(two, sizeof two, &r, err, sizeof err),
                     SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, "1 trailing bytes"));
}

static void test_hostile_counts_depth_size(void **state) {
    (void)state;
    side_channel_pull p;
    char err[256];
    /* array32 claiming 4 billion elements in 5 bytes: rejected before any allocation */
    static const unsigned char huge_array[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
    assert_int_equal(side_channel_pull_decode(huge_array, sizeof huge_array, &p, err, sizeof err),
                     SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, "container count larger than the remaining bytes"));
    static const unsigned char huge_map[] = {0xdf, 0x7f, 0xff, 0xff, 0xff, 0xc0, 0xc0};
    assert_int_equal(side_channel_pull_decode(huge_map, sizeof huge_map, &p, err, sizeof err),
                     SIDE_CHANNEL_EINVAL);
    /* str32 claiming 4 GiB */
    static const unsigned char huge_str[] = {0x81, 0xdb, 0xff, 0xff, 0xff, 0xff, 0x61};
    assert_int_equal(side_channel_pull_decode(huge_str, sizeof huge_str, &p, err, sizeof err),
                     SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, "truncated"));
    /* nesting 100 deep */
    unsigned char deep[101];
    memset(deep, 0x91, 100);
    deep[100] = 0x01;
    assert_int_equal(side_channel_pull_decode(deep, sizeof deep, &p, err, sizeof err),
                     SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, "nesting"));
    /* reserved type byte */
    static const unsigned char reserved[] = {0x81, 0xc1, 0x01};
    assert_int_equal(side_channel_pull_decode(reserved, sizeof reserved, &p, err, sizeof err),
                     SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, "0xc1"));
    /* not a map at the top */
    static const unsigned char arr[] = {0x92, 0x01, 0x02};
    assert_int_equal(side_channel_pull_decode(arr, sizeof arr, &p, err, sizeof err),
                     SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, "expected a msgpack map"));
    /* empty and oversized */
    assert_int_equal(side_channel_pull_decode(arr, 0, &p, err, sizeof err), SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, "empty message"));
    size_t big = SIDE_CHANNEL_MAX_MSG_BYTES + 1;
    char *huge = calloc(1, big);
    assert_non_null(huge);
    assert_int_equal(side_channel_pull_decode(huge, big, &p, err, sizeof err), SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, "exceeds the limit"));
    free(huge);
}

static void test_limits(void **state) {
    (void)state;
    /* too many requests: a map of SIDE_CHANNEL_MAX_REQS + 1 entries */
    msgpack_sbuffer rb;
    msgpack_sbuffer_init(&rb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &rb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, SIDE_CHANNEL_MAX_REQS + 1);
    for (int i = 0; i < SIDE_CHANNEL_MAX_REQS + 1; i++) {
        char id[16];
        snprintf(id, sizeof id, "r%d", i);
        pack_s(&pk, id);
        msgpack_pack_array(&pk, 2);
        pack_s(&pk, "x");
        msgpack_pack_array(&pk, 0);
    }
    char *hex = malloc(rb.size * 2 + 1);
    for (size_t i = 0; i < rb.size; i++)
        sprintf(hex + 2 * i, "%02x", (unsigned char)rb.data[i]);
    pull_bad((pull_override){.key = "req_blocks", .raw_hex = hex}, "requests exceed the limit");
    free(hex);
    msgpack_sbuffer_destroy(&rb);
    /* too many KV groups in one request */
    msgpack_sbuffer_init(&rb);
    msgpack_pack_map(&pk, 1);
    pack_s(&pk, "r");
    msgpack_pack_array(&pk, 2);
    pack_s(&pk, "x");
    msgpack_pack_array(&pk, SIDE_CHANNEL_MAX_GROUPS + 1);
    for (int i = 0; i < SIDE_CHANNEL_MAX_GROUPS + 1; i++)
        msgpack_pack_array(&pk, 0);
    hex = malloc(rb.size * 2 + 1);
    for (size_t i = 0; i < rb.size; i++)
        sprintf(hex + 2 * i, "%02x", (unsigned char)rb.data[i]);
    pull_bad((pull_override){.key = "req_blocks", .raw_hex = hex}, "KV groups exceed the limit");
    free(hex);
    msgpack_sbuffer_destroy(&rb);
    /* a long string */
    char lng[2 * (3 + SIDE_CHANNEL_MAX_STR + 1) + 1];
    int o = sprintf(lng, "da%04x", SIDE_CHANNEL_MAX_STR + 1);
    for (int i = 0; i < SIDE_CHANNEL_MAX_STR + 1; i++)
        o += sprintf(lng + o, "61");
    pull_bad((pull_override){.key = "remote_hostname", .raw_hex = lng}, "exceeds 4096");
}

static void test_reply_bad(void **state) {
    (void)state;
    struct {
        const char *hex, *needle;
    } cases[] = {
        {"80", "missing required key 'status'"},
        {"81a6737461747573 03", "3 is out of range 0..2"},
        {"81a6737461747573 ff", "out of range"},
        {"81a6737461747573 a130", "'status': expected an integer, got a string"},
        {"82a6737461747573 00 a76f6b5f72657173 a178", "'ok_reqs': expected an array"},
        {"82a6737461747573 00 a76f6b5f72657173 9101", "'ok_reqs': expected a string"},
        {"82a6737461747573 02 a76572725f6d7367 05", "'err_msg': expected a string"},
        {"91 00", "expected a msgpack map"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        char clean[128];
        size_t k = 0;
        for (const char *c = cases[i].hex; *c; c++)
            if (*c != ' ') clean[k++] = *c;
        clean[k] = 0;
        pack_hex(&sb, clean);
        side_channel_reply r;
        char err[256];
        int rc = side_channel_reply_decode(sb.data, sb.size, &r, err, sizeof err);
        if (rc != SIDE_CHANNEL_EINVAL) fail_msg("case %zu accepted", i);
        if (!strstr(err, cases[i].needle))
            fail_msg("case %zu: '%s' lacks '%s'", i, err, cases[i].needle);
        msgpack_sbuffer_destroy(&sb);
    }
    /* nil lists and nil err_msg (msgspec's None) are accepted as absent; unknown keys ignored */
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    pack_hex(
        &sb,
        "85a673746174757301a76f6b5f72657173c0a86572725f72657173c0a76572725f6d7367c0a17881c0c0");
    side_channel_reply r;
    char err[256];
    assert_int_equal(side_channel_reply_decode(sb.data, sb.size, &r, err, sizeof err), 0);
    assert_int_equal(r.status, SIDE_CHANNEL_CONTINUE);
    assert_int_equal(r.n_ok, 0);
    assert_int_equal(r.n_err, 0);
    assert_null(r.err_msg);
    side_channel_reply_free(&r);
    msgpack_sbuffer_destroy(&sb);
}

/* The "disagg_first_tokens" reply extension: encoded only when present (vLLM's
 * bytes unchanged otherwise, test_encode_matches_msgspec), round-trips, and
 * entries of another shape are dropped without failing the reply. */
/* "disagg_unknown_reqs": round trip in a CONTINUE; non-string entries are
 * dropped, a value that is not an array is ignored, and neither fails the reply. */
static void test_unknown_reqs_extension(void **state) {
    (void)state;
    char *unk[2] = {"d-1", "d-9"};
    side_channel_reply r = {.status = SIDE_CHANNEL_CONTINUE, .unknown_reqs = unk, .n_unknown = 2};
    char *buf;
    size_t len;
    assert_int_equal(side_channel_reply_encode(&r, &buf, &len), 0);
    side_channel_reply d;
    char err[256];
    assert_int_equal(side_channel_reply_decode(buf, len, &d, err, sizeof err), 0);
    assert_int_equal(d.status, SIDE_CHANNEL_CONTINUE);
    assert_int_equal(d.n_unknown, 2);
    assert_string_equal(d.unknown_reqs[0], "d-1");
    assert_string_equal(d.unknown_reqs[1], "d-9");
    assert_int_equal(d.n_ok + d.n_err + d.n_ft, 0);
    side_channel_reply_free(&d);
    free(buf);
    /* {"status": 1, "disagg_unknown_reqs": ["a", 7, "", ["x"], "b"]}: "a" and "b" */
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    pack_hex(&sb, "82a673746174757301b36469736167675f756e6b6e6f776e5f7265717395a16107a091a178a162");
    assert_int_equal(side_channel_reply_decode(sb.data, sb.size, &d, err, sizeof err), 0);
    assert_int_equal(d.n_unknown, 2);
    assert_string_equal(d.unknown_reqs[0], "a");
    assert_string_equal(d.unknown_reqs[1], "b");
    side_channel_reply_free(&d);
    msgpack_sbuffer_destroy(&sb);
    /* {"status": 1, "disagg_unknown_reqs": {"a": 1}}: ignored */
    msgpack_sbuffer_init(&sb);
    pack_hex(&sb, "82a673746174757301b36469736167675f756e6b6e6f776e5f7265717381a16101");
    assert_int_equal(side_channel_reply_decode(sb.data, sb.size, &d, err, sizeof err), 0);
    assert_int_equal(d.n_unknown, 0);
    side_channel_reply_free(&d);
    msgpack_sbuffer_destroy(&sb);
}

static void test_first_tokens_extension(void **state) {
    (void)state;
    char *ok[2] = {"d-1", "d-2"};
    char *ft_reqs[2] = {"d-1", "d-2"};
    int32_t ft_tokens[2] = {7, 151643};
    side_channel_reply r = {.status = SIDE_CHANNEL_FINISH,
                            .ok_reqs = ok,
                            .n_ok = 2,
                            .ft_reqs = ft_reqs,
                            .ft_tokens = ft_tokens,
                            .n_ft = 2};
    char *buf;
    size_t len;
    assert_int_equal(side_channel_reply_encode(&r, &buf, &len), 0);
    side_channel_reply d;
    char err[256];
    assert_int_equal(side_channel_reply_decode(buf, len, &d, err, sizeof err), 0);
    assert_int_equal(d.n_ok, 2);
    assert_int_equal(d.n_ft, 2);
    assert_string_equal(d.ft_reqs[0], "d-1");
    assert_int_equal(d.ft_tokens[0], 7);
    assert_string_equal(d.ft_reqs[1], "d-2");
    assert_int_equal(d.ft_tokens[1], 151643);
    side_channel_reply_free(&d);
    free(buf);
    /* {"status": 0, "disagg_first_tokens": {"a": [5], "b": "x", "c": [1, 2], "d": [-1],
     *  "e": [2^32], 1: [3], "f": [], "g": 5}}: only "a" survives */
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    pack_hex(&sb, "82a673746174757300b36469736167675f66697273745f746f6b656e73"
                  "88a1619105a162a178a163920102a16491ffa16591cf0000000100000000"
                  "019103a16690a16705");
    assert_int_equal(side_channel_reply_decode(sb.data, sb.size, &d, err, sizeof err), 0);
    assert_int_equal(d.status, SIDE_CHANNEL_FINISH);
    assert_int_equal(d.n_ft, 1);
    assert_string_equal(d.ft_reqs[0], "a");
    assert_int_equal(d.ft_tokens[0], 5);
    side_channel_reply_free(&d);
    msgpack_sbuffer_destroy(&sb);
    /* not a map: ignored */
    msgpack_sbuffer_init(&sb);
    pack_hex(&sb, "82a673746174757300b36469736167675f66697273745f746f6b656e7305");
    assert_int_equal(side_channel_reply_decode(sb.data, sb.size, &d, err, sizeof err), 0);
    assert_int_equal(d.n_ft, 0);
    side_channel_reply_free(&d);
    msgpack_sbuffer_destroy(&sb);
}

/* Deterministic mutation fuzz: flip bytes of the golden messages; decoding must
 * either succeed or fail cleanly (ASan/UBSan builds check the "cleanly"). */
static void test_mutation_fuzz(void **state) {
    (void)state;
    unsigned char buf[sizeof GOLDEN_PULL_FULL];
    uint32_t x = 12345;
    int ok = 0, bad = 0;
    for (int iter = 0; iter < 20000; iter++) {
        memcpy(buf, GOLDEN_PULL_FULL, sizeof buf);
        int flips = 1 + (int)(x % 4);
        for (int f = 0; f < flips; f++) {
            x = x * 1103515245u + 12345u;
            size_t pos = (x >> 8) % sizeof buf;
            x = x * 1103515245u + 12345u;
            buf[pos] = (unsigned char)(x >> 16);
        }
        x = x * 1103515245u + 12345u;
        size_t len = (x >> 4) % 8 == 0 ? (x >> 12) % sizeof buf : sizeof buf;
        side_channel_pull p;
        char err[256];
        if (side_channel_pull_decode(buf, len, &p, err, sizeof err) == 0) {
            ok++;
            side_channel_pull_free(&p);
        } else {
            bad++;
            assert_true(err[0] != '\0');
        }
    }
    assert_true(bad > 0);
    (void)ok;
}

/* The cancel extension: round trip, a pull is "not a cancel", malformed cancels named. */
static void test_cancel_message(void **state) {
    (void)state;
    char *rids[2] = {"d-1", "d-2"}, *tids[2] = {"xfer-a", "xfer-b"};
    side_channel_cancel c = {.req_ids = rids, .transfer_ids = tids, .n = 2};
    char *buf, err[256];
    size_t len;
    assert_int_equal(side_channel_cancel_encode(&c, &buf, &len), 0);
    side_channel_cancel d;
    assert_int_equal(side_channel_cancel_decode(buf, len, &d, err, sizeof err), 0);
    assert_int_equal(d.n, 2);
    assert_string_equal(d.req_ids[1], "d-2");
    assert_string_equal(d.transfer_ids[0], "xfer-a");
    side_channel_cancel_free(&d);
    /* it does not decode as a pull (what a vLLM producer does with it) */
    side_channel_pull p;
    assert_int_not_equal(side_channel_pull_decode(buf, len, &p, err, sizeof err), 0);
    assert_non_null(strstr(err, "remote_hostname"));
    free(buf);
    /* a pull is not a cancel */
    int64_t ids[] = {7};
    side_channel_block_group g = {ids, 1};
    side_channel_req_blocks r = {"req", "xfer", &g, 1};
    uint64_t base[] = {4096};
    int64_t lens[] = {64};
    side_channel_pull pl = {.remote_hostname = "h",
                            .remote_tp_size = 1,
                            .reqs = &r,
                            .n_reqs = 1,
                            .kv_caches_base_addr = base,
                            .block_lens = lens,
                            .kv_block_lens = lens,
                            .n_regions = 1,
                            .remote_pp_size = 1};
    assert_int_equal(side_channel_pull_encode(&pl, &buf, &len), 0);
    assert_int_equal(side_channel_cancel_decode(buf, len, &d, err, sizeof err), 1);
    free(buf);
    /* malformed: the value is not a map; a transfer id is not a string */
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 1);
    msgpack_pack_str_with_body(&pk, "disagg_cancel", 13);
    msgpack_pack_array(&pk, 0);
    assert_true(side_channel_cancel_decode(sb.data, sb.size, &d, err, sizeof err) < 0);
    assert_non_null(strstr(err, "expected a map of req_id to transfer_id, got an array"));
    msgpack_sbuffer_clear(&sb);
    msgpack_pack_map(&pk, 1);
    msgpack_pack_str_with_body(&pk, "disagg_cancel", 13);
    msgpack_pack_map(&pk, 1);
    msgpack_pack_str_with_body(&pk, "d-1", 3);
    msgpack_pack_int(&pk, 5);
    assert_true(side_channel_cancel_decode(sb.data, sb.size, &d, err, sizeof err) < 0);
    assert_non_null(strstr(err, "'transfer_id': expected a string, got an integer"));
    msgpack_sbuffer_destroy(&sb);
}

/* "disagg_layerwise": true in a pull, ["<req id>", ...] in a FINISH; anything else in the pull
 * reads as "no", a malformed reply value is dropped; a pull without it encodes no key. */
static void test_layerwise_extension(void **state) {
    (void)state;
    int64_t ids[] = {7};
    side_channel_block_group g = {ids, 1};
    side_channel_req_blocks r = {"req", "xfer", &g, 1};
    uint64_t base[] = {4096};
    int64_t lens[] = {64};
    side_channel_pull p = {.remote_hostname = "h",
                           .remote_port = 1,
                           .remote_tp_size = 1,
                           .reqs = &r,
                           .n_reqs = 1,
                           .kv_caches_base_addr = base,
                           .block_lens = lens,
                           .kv_block_lens = lens,
                           .n_regions = 1,
                           .remote_pp_size = 1,
                           .layerwise = 1};
    char *buf, *buf0, err[256];
    size_t len, len0;
    assert_int_equal(side_channel_pull_encode(&p, &buf, &len), 0);
    side_channel_pull d;
    assert_int_equal(side_channel_pull_decode(buf, len, &d, err, sizeof err), 0);
    assert_int_equal(d.layerwise, 1);
    side_channel_pull_free(&d);
    assert_non_null(memmem(buf, len, SIDE_CHANNEL_LAYERWISE_KEY, strlen(SIDE_CHANNEL_LAYERWISE_KEY)));
    p.layerwise = 0;
    assert_int_equal(side_channel_pull_encode(&p, &buf0, &len0), 0);
    assert_null(memmem(buf0, len0, SIDE_CHANNEL_LAYERWISE_KEY, strlen(SIDE_CHANNEL_LAYERWISE_KEY)));
    assert_int_equal(side_channel_pull_decode(buf0, len0, &d, err, sizeof err), 0);
    assert_int_equal(d.layerwise, 0);
    side_channel_pull_free(&d);
    free(buf0);
    /* the same pull with "disagg_layerwise": 1 (not a boolean): decoded, not streaming */
    char *one = malloc(len);
    memcpy(one, buf, len);
    assert_int_equal((unsigned char)one[len - 1], 0xc3); /* the last value is true */
    one[len - 1] = 0x01;
    assert_int_equal(side_channel_pull_decode(one, len, &d, err, sizeof err), 0);
    assert_int_equal(d.layerwise, 0);
    side_channel_pull_free(&d);
    free(one);
    free(buf);
    /* reply */
    char *ok[2] = {"d-1", "d-2"}, *lw[1] = {"d-2"};
    side_channel_reply rr = {
        .status = SIDE_CHANNEL_FINISH, .ok_reqs = ok, .n_ok = 2, .lw_reqs = lw, .n_lw = 1};
    assert_int_equal(side_channel_reply_encode(&rr, &buf, &len), 0);
    side_channel_reply dr;
    assert_int_equal(side_channel_reply_decode(buf, len, &dr, err, sizeof err), 0);
    assert_int_equal(dr.n_lw, 1);
    assert_string_equal(dr.lw_reqs[0], "d-2");
    side_channel_reply_free(&dr);
    free(buf);
    /* {"status": 0, "disagg_layerwise": 5}: the reply stands, the key is dropped */
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    pack_hex(&sb, "82a673746174757300b06469736167675f6c617965727769736505");
    assert_int_equal(side_channel_reply_decode(sb.data, sb.size, &dr, err, sizeof err), 0);
    assert_int_equal(dr.status, SIDE_CHANNEL_FINISH);
    assert_int_equal(dr.n_lw, 0);
    side_channel_reply_free(&dr);
    msgpack_sbuffer_destroy(&sb);
}

/* "disagg_pool_tokens": the pool fetch's token ids round-trip; a pull without them encodes no
 * key; a negative id and a pool pull of two requests are refused with a message naming the key. */
static void test_pool_tokens_extension(void **state) {
    (void)state;
    int64_t ids[] = {7, 8};
    side_channel_block_group g = {ids, 2};
    side_channel_req_blocks r[2] = {{"req", "pool-1", &g, 1}, {"req2", "pool-2", &g, 1}};
    uint64_t base[] = {4096};
    int64_t lens[] = {64};
    int64_t tok[] = {1, 2, 3, 4000, 0};
    side_channel_pull p = {.remote_hostname = "h",
                           .remote_port = 1,
                           .remote_tp_size = 1,
                           .reqs = r,
                           .n_reqs = 1,
                           .kv_caches_base_addr = base,
                           .block_lens = lens,
                           .kv_block_lens = lens,
                           .n_regions = 1,
                           .remote_pp_size = 1,
                           .pool_tokens = tok,
                           .n_pool_tokens = 5};
    char *buf, err[256];
    size_t len;
    side_channel_pull d;
    assert_int_equal(side_channel_pull_encode(&p, &buf, &len), 0);
    assert_int_equal(side_channel_pull_decode(buf, len, &d, err, sizeof err), 0);
    assert_int_equal(d.n_pool_tokens, 5);
    for (int i = 0; i < 5; i++)
        assert_int_equal(d.pool_tokens[i], tok[i]);
    side_channel_pull_free(&d);
    free(buf);
    tok[1] = -2;
    assert_int_equal(side_channel_pull_encode(&p, &buf, &len), 0);
    assert_int_equal(side_channel_pull_decode(buf, len, &d, err, sizeof err), SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, SIDE_CHANNEL_POOL_TOKENS_KEY));
    free(buf);
    tok[1] = 2;
    p.n_reqs = 2;
    assert_int_equal(side_channel_pull_encode(&p, &buf, &len), 0);
    assert_int_equal(side_channel_pull_decode(buf, len, &d, err, sizeof err), SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, "names the prefix of one request"));
    free(buf);
    p.n_reqs = 1;
    p.n_pool_tokens = 0;
    assert_int_equal(side_channel_pull_encode(&p, &buf, &len), 0);
    assert_null(memmem(buf, len, SIDE_CHANNEL_POOL_TOKENS_KEY, strlen(SIDE_CHANNEL_POOL_TOKENS_KEY)));
    assert_int_equal(side_channel_pull_decode(buf, len, &d, err, sizeof err), 0);
    assert_int_equal(d.n_pool_tokens, 0);
    side_channel_pull_free(&d);
    free(buf);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_tokens_extension),
        cmocka_unit_test(test_cancel_message),
        cmocka_unit_test(test_decode_golden_pull_min),
        cmocka_unit_test(test_decode_golden_pull_full),
        cmocka_unit_test(test_decode_golden_replies),
        cmocka_unit_test(test_encode_matches_msgspec),
        cmocka_unit_test(test_layout_extension_roundtrip),
        cmocka_unit_test(test_built_pull_ok),
        cmocka_unit_test(test_pull_missing_and_wrong_types),
        cmocka_unit_test(test_pull_duplicate_key),
        cmocka_unit_test(test_truncated_everywhere),
        cmocka_unit_test(test_hostile_counts_depth_size),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_reply_bad),
        cmocka_unit_test(test_first_tokens_extension),
        cmocka_unit_test(test_unknown_reqs_extension),
        cmocka_unit_test(test_layerwise_extension),
        cmocka_unit_test(test_mutation_fuzz),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
