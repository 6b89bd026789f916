/*
 * test_tp_shard — a tensor-parallel rank's share of the model (model/tp_shard.h) against the
 * whole model: the sotu tiny checkpoint (8 query heads, 2 KV heads, intermediate 1024, vocab
 * 4096, tied embeddings) loaded whole and as rank r of 2, 4 and 8; every matrix of the rank
 * compared element for element with the rows or columns of the whole one it must hold (q/k/v
 * and gate/up rows as zero-copy views of the mapping; o_proj and down_proj columns copied; the
 * embedding's vocab rows plus a zero row; KV heads split at N <= 2 and replicated above),
 * the token remap of the vocab-parallel embedding, the rank's shapes, and the refusals.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "kernels/collective.h"
#include "model/model_config.h"
#include "model/tp_shard.h"
#include "model/weights.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define MODEL DISAGG_SOURCE_DIR "/models/disagg-sotu-tiny"

/* rank r of an n-rank group (a handle of its own on a fresh segment) */
static collective *group_rank(collective **owner, int n, int r) {
    char err[256];
    assert_int_equal(collective_create(n, 4096, 4096, owner, err, sizeof err), 0);
    collective *c = NULL;
    assert_int_equal(collective_open(dup(collective_fd(*owner)), &c, err, sizeof err), 0);
    assert_int_equal(collective_join(c, r), 0);
    return c;
}

static const uint16_t *mat(const weight_mat *m) {
    assert_int_equal(m->dtype, BACKEND_BF16);
    return m->data;
}

static void check_rank(int n, int r) {
    char err[512];
    model_config c;
    assert_int_equal(model_config_load(&c, MODEL, err, sizeof err), 0);
    model_weights whole, part;
    assert_int_equal(weights_load(&whole, &c, MODEL, err, sizeof err), 0);
    collective *owner = NULL, *g = group_rank(&owner, n, r);
    tp_shard sh;
    assert_int_equal(tp_shard_init(&sh, &c, g, err, sizeof err), 0);
    assert_int_equal(
        weights_load_tp(&part, backend_cpu_default(), &c, MODEL, 0, &sh, err, sizeof err), 0);
    int hd = c.head_dim, h = c.hidden_size;
    /* heads: 8 / n query heads; KV heads split (n <= 2) or replicated */
    assert_int_equal(sh.n_heads, c.n_heads / n);
    assert_int_equal(sh.head0, r * c.n_heads / n);
    assert_int_equal(sh.n_kv_heads, n <= c.n_kv_heads ? c.n_kv_heads / n : 1);
    assert_int_equal(sh.kv_head0,
                     n <= c.n_kv_heads ? r * (c.n_kv_heads / n) : r * c.n_kv_heads / n);
    model_config lc;
    tp_shard_config(&sh, &c, &lc);
    assert_int_equal(lc.n_heads, sh.n_heads);
    assert_int_equal(lc.q_dim, sh.n_heads * hd);
    assert_int_equal(lc.intermediate_size, c.intermediate_size / n);
    assert_int_equal(lc.vocab_size, c.vocab_size);
    for (int l = 0; l < c.n_layers; l++) {
        const layer_weights *W = &whole.layers[l], *P = &part.layers[l];
        /* column-parallel: rows (views of the rank's own mapping of the file) */
        assert_int_equal(P->wq.rows, sh.n_heads * hd);
        assert_memory_equal(mat(&P->wq), mat(&W->wq) + (size_t)sh.head0 * hd * h,
                            (size_t)P->wq.rows * h * 2);
        assert_int_equal(P->wk.rows, sh.n_kv_heads * hd);
        assert_memory_equal(mat(&P->wk), mat(&W->wk) + (size_t)sh.kv_head0 * hd * h,
                            (size_t)P->wk.rows * h * 2);
        assert_memory_equal(mat(&P->wv), mat(&W->wv) + (size_t)sh.kv_head0 * hd * h,
                            (size_t)P->wv.rows * h * 2);
        assert_int_equal(P->w_gate.rows, sh.inter);
        assert_memory_equal(mat(&P->w_gate), mat(&W->w_gate) + (size_t)sh.inter0 * h,
                            (size_t)sh.inter * h * 2);
        assert_memory_equal(mat(&P->w_up), mat(&W->w_up) + (size_t)sh.inter0 * h,
                            (size_t)sh.inter * h * 2);
        /* zero copy: inside the mapped file, not a copy of the loader's */
        int in_map = 0;
        for (int f = 0; f < part.st.n_files; f++) {
            const char *b = part.st.files[f].map;
            in_map |= (const char *)P->wq.data >= b &&
                      (const char *)P->wq.data < b + part.st.files[f].size;
        }
        assert_true(in_map);
        for (int i = 0; i < sh.n_kv_heads * hd; i++) /* biases: the same rows */
            assert_true(P->bk[i] == W->bk[sh.kv_head0 * hd + i]);
        /* row-parallel: columns, copied */
        assert_int_equal(P->wo.rows, h);
        assert_int_equal(P->wo.cols, sh.n_heads * hd);
        for (int row = 0; row < h; row += 7)
            assert_memory_equal(mat(&P->wo) + (size_t)row * P->wo.cols,
                                mat(&W->wo) + (size_t)row * W->wo.cols + sh.head0 * hd,
                                (size_t)P->wo.cols * 2);
        assert_int_equal(P->w_down.cols, sh.inter);
        for (int row = 0; row < h; row += 5)
            assert_memory_equal(mat(&P->w_down) + (size_t)row * sh.inter,
                                mat(&W->w_down) + (size_t)row * W->w_down.cols + sh.inter0,
                                (size_t)sh.inter * 2);
        /* replicated */
        assert_memory_equal(P->attn_norm, W->attn_norm, (size_t)h * 4);
    }
    /* vocab-parallel embedding: the rank's rows, then a zero row (tied: the head's rows too) */
    assert_int_equal(sh.vocab_part, (c.vocab_size + n - 1) / n);
    assert_int_equal(part.embed.rows, sh.vocab_part + 1);
    assert_memory_equal(mat(&part.embed), mat(&whole.embed) + (size_t)sh.vocab0 * h,
                        (size_t)sh.vocab_part * h * 2);
    for (int k = 0; k < h; k++)
        assert_int_equal(mat(&part.embed)[(size_t)sh.vocab_part * h + k], 0);
    assert_ptr_equal(part.lm_head.data, part.embed.data);
    /* the token remap: the rank's own tokens to their row, every other to the zero row */
    for (int t = 0; t < c.vocab_size; t += 97) {
        int32_t i = tp_shard_token(&sh, t);
        int mine = t >= sh.vocab0 && t < sh.vocab0 + sh.vocab_part;
        assert_int_equal(i, mine ? t - sh.vocab0 : sh.vocab_part);
    }
    assert_int_equal(tp_shard_token(NULL, 1234), 1234);
    weights_free(&part);
    weights_free(&whole);
    tp_shard_free(&sh);
    collective_free(g);
    collective_free(owner);
}

static void test_every_rank_of_2_4_8(void **st) {
    (void)st;
    for (int n = 2; n <= 8; n *= 2)
        for (int r = 0; r < n; r++)
            check_rank(n, r);
}

static void test_splits_by_name(void **st) {
    (void)st;
    tp_shard sh = {.size = 2,
                   .rank = 1,
                   .head0 = 4,
                   .n_heads = 4,
                   .kv_head0 = 1,
                   .n_kv_heads = 1,
                   .inter0 = 512,
                   .inter = 512,
                   .moe_inter0 = 16,
                   .moe_inter = 16,
                   .vocab = 4095,
                   .vocab0 = 2048,
                   .vocab_part = 2048,
                   .head_dim = 32};
    tp_split s = tp_shard_split(&sh, "model.layers.3.self_attn.q_proj.bias");
    assert_int_equal(s.kind, TP_ROWS);
    assert_int_equal(s.first, 128);
    s = tp_shard_split(&sh, "model.layers.0.self_attn.o_proj.weight");
    assert_int_equal(s.kind, TP_COLS);
    assert_int_equal(s.count, 128);
    s = tp_shard_split(&sh, "model.layers.0.mlp.experts.3.w2.weight");
    assert_int_equal(s.kind, TP_COLS);
    assert_int_equal(s.first, 16);
    s = tp_shard_split(&sh, "model.layers.0.mlp.experts.3.gate_proj.weight");
    assert_int_equal(s.kind, TP_ROWS);
    assert_int_equal(tp_shard_split(&sh, "model.layers.0.mlp.gate.weight").kind, TP_WHOLE);
    assert_int_equal(tp_shard_split(&sh, "model.layers.0.self_attn.q_norm.weight").kind, TP_WHOLE);
    /* the last rank's vocab: 2047 real rows, padded to 2048 (lm_head) or 2049 (embedding) */
    s = tp_shard_split(&sh, "lm_head.weight");
    assert_int_equal(s.kind, TP_VOCAB);
    assert_int_equal(s.count, 2047);
    assert_int_equal(s.pad_rows, 2048);
    assert_int_equal(tp_shard_split(&sh, "model.embed_tokens.weight").pad_rows, 2049);
}

static void test_sizes_that_do_not_divide_are_refused(void **st) {
    (void)st;
    char err[512];
    model_config c;
    assert_int_equal(model_config_load(&c, MODEL, err, sizeof err), 0);
    assert_int_equal(tp_shard_check(&c, 1, err, sizeof err), 0);
    assert_int_equal(tp_shard_check(&c, 8, err, sizeof err), 0); /* KV heads replicated */
    assert_int_equal(tp_shard_check(&c, 16, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "does not divide the model's num_attention_heads 8"));
    c.n_heads = 12, c.n_kv_heads = 3;
    assert_int_equal(tp_shard_check(&c, 2, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "num_key_value_heads"));
    c.n_heads = 8, c.n_kv_heads = 2, c.intermediate_size = 1004;
    assert_int_equal(tp_shard_check(&c, 8, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "intermediate_size 1004"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_rank_of_2_4_8),
        cmocka_unit_test(test_splits_by_name),
        cmocka_unit_test(test_sizes_that_do_not_divide_are_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
