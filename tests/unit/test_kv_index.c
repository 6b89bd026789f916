/* Unit tests of the proxy's KV index (src/proxy/kv_index.c): KVEventBatch payloads packed here
 * as vLLM's msgspec encoder lays them out (events as tagged arrays, or as maps tagged "type"),
 * applied, and prompts matched against them: stored chains, parents, media, removals, the
 * clear, blocks whose parent is unknown, hashes as bytes, malformed batches, the block cap,
 * and the table under many inserts and deletes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "proxy/kv_index.h"

#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#define BS 4

typedef struct batch {
    msgpack_sbuffer buf;
    msgpack_packer pk;
} batch;

static void str(msgpack_packer *pk, const char *s) {
    msgpack_pack_str(pk, strlen(s));
    msgpack_pack_str_body(pk, s, strlen(s));
}

/* [ts, [<nev events follow>], 0]: the events are packed by the caller, then batch_end. */
static void batch_begin(batch *b, int nev) {
    msgpack_sbuffer_init(&b->buf);
    msgpack_packer_init(&b->pk, &b->buf, msgpack_sbuffer_write);
    msgpack_pack_array(&b->pk, 3);
    msgpack_pack_double(&b->pk, 1.5);
    msgpack_pack_array(&b->pk, (size_t)nev);
}

static int batch_apply(batch *b, kv_index *x) {
    msgpack_pack_int(&b->pk, 0);
    char err[256];
    int rc = kv_index_apply(x, b->buf.data, b->buf.size, err, sizeof err);
    msgpack_sbuffer_destroy(&b->buf);
    return rc;
}

/* ["BlockStored", hashes, parent|nil, tokens, BS, nil, medium, nil]; parent 0 = nil;
 * tokens NULL = none (a tier's event). */
static void stored(batch *b, const uint64_t *h, int n, uint64_t parent, const int32_t *tokens,
                   const char *medium) {
    msgpack_packer *pk = &b->pk;
    msgpack_pack_array(pk, 8);
    str(pk, "BlockStored");
    msgpack_pack_array(pk, (size_t)n);
    for (int i = 0; i < n; i++)
        msgpack_pack_uint64(pk, h[i]);
    if (parent)
        msgpack_pack_uint64(pk, parent);
    else
        msgpack_pack_nil(pk);
    msgpack_pack_array(pk, tokens ? (size_t)n * BS : 0);
    for (int i = 0; tokens && i < n * BS; i++)
        msgpack_pack_int32(pk, tokens[i]);
    msgpack_pack_int(pk, BS);
    msgpack_pack_nil(pk);
    str(pk, medium);
    msgpack_pack_nil(pk);
}

static void removed(batch *b, const uint64_t *h, int n, const char *medium) {
    msgpack_pack_array(&b->pk, 3);
    str(&b->pk, "BlockRemoved");
    msgpack_pack_array(&b->pk, (size_t)n);
    for (int i = 0; i < n; i++)
        msgpack_pack_uint64(&b->pk, h[i]);
    str(&b->pk, medium);
}

static int match(kv_index *x, const int32_t *ids, size_t n, int *per) {
    uint64_t chain[64];
    kv_index_chain(ids, n, BS, chain);
    return kv_index_match(x, chain, (int)(n / BS), per);
}

static const int32_t T[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

/* A chain stored in two events (the second names the first's last block as parent) is
 * matched block by block; other tokens, or the same tokens at another position, are not. */
static void test_store_and_match(void **state) {
    (void)state;
    kv_index *x = kv_index_new(100);
    uint64_t h[4] = {101, 102, 103, 104};
    batch b;
    batch_begin(&b, 2);
    stored(&b, h, 2, 0, T, "GPU");
    stored(&b, h + 2, 2, 102, T + 8, "GPU");
    assert_int_equal(batch_apply(&b, x), 0);
    int per[KV_MEDIA];
    assert_int_equal(match(x, T, 16, per), 4);
    assert_int_equal(per[KV_MEDIUM_GPU], 4);
    assert_int_equal(match(x, T, 11, NULL), 2); /* full blocks only */
    int32_t other[16];
    memcpy(other, T, sizeof other);
    other[9] = 99; /* block 2 differs: blocks 0, 1 still match */
    assert_int_equal(match(x, other, 16, NULL), 2);
    assert_int_equal(match(x, T + 4, 12, NULL), 0); /* block 1's tokens, but at position 0 */
    kv_index_stats st;
    kv_index_get_stats(x, &st);
    assert_int_equal(st.total, 4);
    assert_int_equal(st.blocks[KV_MEDIUM_GPU], 4);
    assert_int_equal(st.block_size, BS);
    kv_index_free(x);
}

/* vLLM >= 0.26 lays events out as maps tagged "type"; hashes may be bytes (sha256). */
static void test_map_events_and_byte_hashes(void **state) {
    (void)state;
    kv_index *x = kv_index_new(100);
    batch b;
    batch_begin(&b, 1);
    msgpack_packer *pk = &b.pk;
    msgpack_pack_map(pk, 5);
    str(pk, "type");
    str(pk, "BlockStored");
    str(pk, "block_hashes");
    msgpack_pack_array(pk, 2);
    for (int i = 0; i < 2; i++) {
        msgpack_pack_bin(pk, 32);
        char d[32];
        memset(d, 'a' + i, sizeof d);
        msgpack_pack_bin_body(pk, d, 32);
    }
    str(pk, "parent_block_hash");
    msgpack_pack_nil(pk);
    str(pk, "token_ids");
    msgpack_pack_array(pk, 2 * BS);
    for (int i = 0; i < 2 * BS; i++)
        msgpack_pack_int32(pk, T[i]);
    str(pk, "block_size");
    msgpack_pack_int(pk, BS);
    assert_int_equal(batch_apply(&b, x), 0);
    assert_int_equal(match(x, T, 16, NULL), 2);
    kv_index_free(x);
}

/* A block leaves the GPU but stays in the host tier (a tier's BlockStored names only the
 * hash): still matched, as CPU; removed from the tier too, it is gone with what follows. */
static void test_media_and_removal(void **state) {
    (void)state;
    kv_index *x = kv_index_new(100);
    uint64_t h[3] = {7, 8, 9};
    batch b;
    batch_begin(&b, 1);
    stored(&b, h, 3, 0, T, "GPU");
    assert_int_equal(batch_apply(&b, x), 0);
    batch_begin(&b, 2);
    stored(&b, h + 1, 1, 0, NULL, "CPU");
    removed(&b, h + 1, 1, "GPU");
    assert_int_equal(batch_apply(&b, x), 0);
    int per[KV_MEDIA];
    assert_int_equal(match(x, T, 12, per), 3);
    assert_int_equal(per[KV_MEDIUM_GPU], 2);
    assert_int_equal(per[KV_MEDIUM_CPU], 1);
    batch_begin(&b, 1);
    removed(&b, h + 1, 1, "CPU");
    assert_int_equal(batch_apply(&b, x), 0);
    assert_int_equal(match(x, T, 12, per), 1);
    kv_index_stats st;
    kv_index_get_stats(x, &st);
    assert_int_equal(st.total, 2);
    assert_int_equal(st.blocks[KV_MEDIUM_CPU], 0);
    /* a removal of a hash the index never had changes nothing */
    batch_begin(&b, 1);
    removed(&b, (uint64_t[]){12345}, 1, "GPU");
    assert_int_equal(batch_apply(&b, x), 0);
    kv_index_get_stats(x, &st);
    assert_int_equal(st.total, 2);
    kv_index_free(x);
}

/* A BlockStored whose parent the index never saw (its event was missed) is not indexed;
 * AllBlocksCleared forgets everything. */
static void test_unknown_parent_and_clear(void **state) {
    (void)state;
    kv_index *x = kv_index_new(100);
    uint64_t h[2] = {1, 2};
    batch b;
    batch_begin(&b, 1);
    stored(&b, h + 1, 1, 555, T + 4, "GPU");
    assert_int_equal(batch_apply(&b, x), 0);
    kv_index_stats st;
    kv_index_get_stats(x, &st);
    assert_int_equal(st.total, 0);
    assert_int_equal(st.unchained, 1);
    batch_begin(&b, 2);
    stored(&b, h, 2, 0, T, "GPU");
    msgpack_pack_array(&b.pk, 1);
    str(&b.pk, "AllBlocksCleared");
    assert_int_equal(batch_apply(&b, x), 0);
    assert_int_equal(match(x, T, 8, NULL), 0);
    kv_index_get_stats(x, &st);
    assert_int_equal(st.total, 0);
    assert_int_equal(st.cleared, 1);
    kv_index_free(x);
}

/* Malformed payloads are refused naming what is wrong; unknown event types are skipped. */
static void test_malformed(void **state) {
    (void)state;
    kv_index *x = kv_index_new(100);
    char err[256];
    assert_int_equal(kv_index_apply(x, "\xc1", 1, err, sizeof err), -22);
    assert_non_null(strstr(err, "not msgpack"));
    batch b;
    msgpack_sbuffer_init(&b.buf);
    msgpack_packer_init(&b.pk, &b.buf, msgpack_sbuffer_write);
    msgpack_pack_int(&b.pk, 3);
    assert_int_equal(kv_index_apply(x, b.buf.data, b.buf.size, err, sizeof err), -22);
    assert_non_null(strstr(err, "KVEventBatch"));
    msgpack_sbuffer_destroy(&b.buf);
    batch_begin(&b, 2);
    msgpack_pack_array(&b.pk, 2);
    str(&b.pk, "SomethingNew");
    msgpack_pack_int(&b.pk, 1);
    msgpack_pack_array(&b.pk, 2);
    str(&b.pk, "BlockRemoved");
    msgpack_pack_int(&b.pk, 1); /* not a list */
    msgpack_pack_int(&b.pk, 0);
    assert_int_equal(kv_index_apply(x, b.buf.data, b.buf.size, err, sizeof err), -22);
    assert_non_null(strstr(err, "event 1 (BlockRemoved): block_hashes is not a list"));
    msgpack_sbuffer_destroy(&b.buf);
    kv_index_free(x);
}

/* At most max_blocks are indexed; the rest are counted. */
static void test_cap(void **state) {
    (void)state;
    kv_index *x = kv_index_new(2);
    uint64_t h[4] = {1, 2, 3, 4};
    batch b;
    batch_begin(&b, 1);
    stored(&b, h, 4, 0, T, "GPU");
    assert_int_equal(batch_apply(&b, x), 0);
    kv_index_stats st;
    kv_index_get_stats(x, &st);
    assert_int_equal(st.total, 2);
    assert_int_equal(st.dropped, 2);
    assert_int_equal(match(x, T, 16, NULL), 2);
    kv_index_free(x);
}

/* Many chains stored, every other one removed (the table's backward-shift deletes), the rest
 * still found, the removed ones not. */
static void test_many(void **state) {
    (void)state;
    enum { N = 5000 };
    kv_index *x = kv_index_new(1 << 20);
    for (int i = 0; i < N; i++) {
        int32_t t[BS] = {i, i + 1, i + 2, i + 3};
        batch b;
        batch_begin(&b, 1);
        stored(&b, (uint64_t[]){(uint64_t)i * 7919 + 1}, 1, 0, t, "GPU");
        assert_int_equal(batch_apply(&b, x), 0);
    }
    for (int i = 0; i < N; i += 2) {
        batch b;
        batch_begin(&b, 1);
        removed(&b, (uint64_t[]){(uint64_t)i * 7919 + 1}, 1, "GPU");
        assert_int_equal(batch_apply(&b, x), 0);
    }
    for (int i = 0; i < N; i++) {
        int32_t t[BS] = {i, i + 1, i + 2, i + 3};
        assert_int_equal(match(x, t, BS, NULL), i % 2);
    }
    kv_index_stats st;
    kv_index_get_stats(x, &st);
    assert_int_equal(st.total, N / 2);
    kv_index_free(x);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_store_and_match),
        cmocka_unit_test(test_map_events_and_byte_hashes),
        cmocka_unit_test(test_media_and_removal),
        cmocka_unit_test(test_unknown_parent_and_clear),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_cap),
        cmocka_unit_test(test_many),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
