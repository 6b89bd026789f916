/* Unit tests: tp_pull — the connector's TP pairing: the KV shape from the layout
 * fingerprint, the prefill ranks (and side-channel addresses) a decode rank pulls from, read
 * from a real bootstrap /query body, with refusals; and the producer's runs for a pull naming
 * the decoder's TP shape, checked by copying bytes into a simulated decoder shard and
 * comparing with the heads that rank must hold (and, for TP 1 -> TP 1, against the runs of
 * the whole-block planner the producer used before). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "connector/mooncake/tp_pull.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void test_shape_from_fingerprint(void **state) {
    (void)state;
    xfer_kv_shape sh;
    char err[256];
    assert_int_equal(
        tp_shape_from_fingerprint("qwen2:L24:kvh2:hd64:bs16:bf16:layer-kv-token-major:v151936", &sh,
                                  err, sizeof err),
        0);
    assert_true(sh.n_layers == 24 && sh.n_kv_heads == 2 && sh.head_dim == 64 &&
                sh.block_size == 16 && sh.elem_bytes == 2);
    assert_int_equal(tp_shape_from_fingerprint("qwen2:L2:kvh4:hd8:bs4:f32:layer-kv-token-major:v9",
                                               &sh, err, sizeof err),
                     0);
    assert_int_equal(sh.elem_bytes, 4);
    /* an FP8 KV cache (e4m3, one byte), with its checkpoint scales' field after the vocab */
    assert_int_equal(
        tp_shape_from_fingerprint("qwen2:L28:kvh4:hd128:bs16:fp8e4m3:layer-kv-token-major:v152064"
                                  ":kvs1a2b3c4d",
                                  &sh, err, sizeof err),
        0);
    assert_int_equal(sh.elem_bytes, 1);
    assert_int_equal(tp_shape_from_fingerprint("qwen2:L2:kvh4:hd8:bs4:f64:layer-kv-token-major:v9",
                                               &sh, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_int_equal(tp_shape_from_fingerprint("llama:L2", &sh, err, sizeof err), XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "is not <family>:L<layers>"));
    assert_int_equal(tp_shape_from_fingerprint(NULL, &sh, err, sizeof err), XFER_PLAN_EINVAL);
}

static void parse(const char *json, bootstrap_table *t) {
    char err[256];
    if (bootstrap_table_parse(json, strlen(json), t, err, sizeof err)) fail_msg("%s", err);
}

static void test_peers_from_bootstrap_table(void **state) {
    (void)state;
    char err[256];
    tp_pull_peer peers[8];
    bootstrap_table t;
    /* P TP 2 (both ranks registered), D TP 1: both ranks, each one head of two */
    parse("{\"0\": {\"engine_id\": \"p\", \"worker_addr\": {\"0\": {\"0\": \"tcp://10.0.0.1:5\"},"
          " \"1\": {\"0\": \"tcp://10.0.0.1:6\"}}}}",
          &t);
    tp_local d1 = {1, 0};
    assert_int_equal(tp_pull_peers(&t.engines[0], &d1, 2, peers, 8, err, sizeof err), 2);
    assert_string_equal(peers[0].addr, "tcp://10.0.0.1:5");
    assert_string_equal(peers[1].addr, "tcp://10.0.0.1:6");
    assert_true(peers[1].p_rank == 1 && peers[1].heads.n_heads == 1 && peers[1].heads.d_off == 1);
    /* D TP 2 rank 1 pairs with P rank 1 only */
    tp_local d2 = {2, 1};
    assert_int_equal(tp_pull_peers(&t.engines[0], &d2, 2, peers, 8, err, sizeof err), 1);
    assert_true(peers[0].p_rank == 1 && peers[0].heads.head0 == 1);
    /* 3 KV heads cannot be split over P's 2 ranks */
    assert_int_equal(tp_pull_peers(&t.engines[0], &d1, 3, peers, 8, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "prefill tensor-parallel size 2 cannot hold 3 KV heads"));
    /* not enough room */
    assert_int_equal(tp_pull_peers(&t.engines[0], &d1, 2, peers, 1, err, sizeof err),
                     XFER_PLAN_ENOSPC);
    bootstrap_table_free(&t);
    /* only tp_rank 1 registered so far: tp_rank 0 is missing */
    parse(
        "{\"0\": {\"engine_id\": \"p\", \"worker_addr\": {\"1\": {\"0\": \"tcp://10.0.0.1:6\"}}}}",
        &t);
    assert_int_equal(tp_pull_peers(&t.engines[0], &d1, 2, peers, 8, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "has not registered tp_rank 0 (of 2)"));
    bootstrap_table_free(&t);
    /* pipeline parallelism is refused */
    parse("{\"0\": {\"engine_id\": \"p\", \"worker_addr\": {\"0\": {\"0\": \"tcp://a:1\", \"1\": "
          "\"tcp://a:2\"}}}}",
          &t);
    assert_int_equal(tp_pull_peers(&t.engines[0], &d1, 2, peers, 8, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "2 pipeline-parallel ranks"));
    bootstrap_table_free(&t);
}

/* A TP 1 producer answering a decoder of TP 2, rank 1: it writes the second half of the
 * heads of every row of the blocks asked for, and nothing else. */
static void test_send_runs_into_a_decoder_shard(void **state) {
    (void)state;
    enum { L = 2, BS = 4, H = 4, HD = 8, ES = 2, NB = 6 };
    const size_t row = H * HD * ES, rows = L * 2 * BS, bb = rows * row;
    uint8_t *p = malloc(NB * bb), *d = malloc(NB * bb / 2);
    assert_non_null(p);
    assert_non_null(d);
    for (size_t i = 0; i < NB * bb; i++)
        p[i] = (uint8_t)(i * 131u + 7u);
    memset(d, 0xEE, NB * bb / 2);
    engine_kv_region reg = {
        .base = p, .bytes = NB * bb, .block_bytes = bb, .n_blocks = NB, .block_size = BS};
    snprintf(reg.fingerprint, sizeof reg.fingerprint,
             "qwen2:L%d:kvh%d:hd%d:bs%d:bf16:layer-kv-token-major:v10", L, H, HD, BS);
    tp_local own = {1, 0}; /* an instance of one rank */
    assert_true(own.tp_size == 1 && own.tp_rank == 0);
    uint64_t dbase = (uint64_t)(uintptr_t)d;
    int64_t dbl = (int64_t)(bb / 2);
    side_channel_pull pull = {.remote_tp_size = 2,
                              .remote_tp_rank = 1,
                              .kv_caches_base_addr = &dbase,
                              .block_lens = &dbl,
                              .kv_block_lens = &dbl,
                              .n_regions = 1};
    int64_t pids[] = {0, 4, 5}, dids[] = {2, 3};
    xfer_run *runs = NULL;
    size_t n = 0;
    char err[256];
    assert_int_equal(tp_send_runs(&reg, &own, &pull, pids, 3, dids, 2, &runs, &n, err, sizeof err),
                     0);
    assert_int_equal(n, 2 * rows); /* one run per row: the right half of each P row */
    for (size_t i = 0; i < n; i++)
        memcpy((void *)(uintptr_t)runs[i].dst, (const void *)(uintptr_t)runs[i].src, runs[i].len);
    free(runs);
    for (int b = 0; b < NB; b++)
        for (size_t r = 0; r < rows; r++)
            for (size_t x = 0; x < row / 2; x++) {
                uint8_t got = d[b * (bb / 2) + r * (row / 2) + x];
                if (b == 2 || b == 3) {
                    size_t src = (size_t)(b == 2 ? 4 : 5) * bb + r * row + row / 2 + x;
                    assert_int_equal(got, p[src]);
                } else {
                    assert_int_equal(got, 0xEE);
                }
            }
    /* a decoder whose kv_block_len is not what its rank holds */
    int64_t whole = (int64_t)bb;
    pull.kv_block_lens = &whole;
    assert_int_equal(tp_send_runs(&reg, &own, &pull, pids, 3, dids, 2, &runs, &n, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "kv_block_len 1024 is not 512, what tp_rank 1 of 2 holds"));
    /* TP 1 -> TP 1: the same runs as the whole-block planner */
    pull.remote_tp_size = 1;
    pull.remote_tp_rank = 0;
    pull.block_lens = &whole;
    int64_t dids1[] = {1, 2, 3};
    assert_int_equal(tp_send_runs(&reg, &own, &pull, pids, 3, dids1, 3, &runs, &n, err, sizeof err),
                     0);
    xfer_run old[4];
    xfer_region pr = {(uint64_t)(uintptr_t)p, bb, bb}, dr = {dbase, bb, bb};
    int m = xfer_plan_request(pids, 3, dids1, 3, &pr, &dr, 1, NB, old, 4, err, sizeof err);
    assert_int_equal((int)n, m);
    for (int i = 0; i < m; i++)
        assert_true(runs[i].src == old[i].src && runs[i].dst == old[i].dst &&
                    runs[i].len == old[i].len);
    free(runs);
    /* a release plans nothing */
    assert_int_equal(tp_send_runs(&reg, &own, &pull, pids, 3, NULL, 0, &runs, &n, err, sizeof err),
                     0);
    assert_int_equal(n, 0);
    assert_null(runs);
    free(p);
    free(d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shape_from_fingerprint),
        cmocka_unit_test(test_peers_from_bootstrap_table),
        cmocka_unit_test(test_send_runs_into_a_decoder_shard),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
