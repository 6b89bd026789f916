/*
 * test_quant — FP8 pieces that need no model: the e4m3 -> f32 table (backend_e4m3_to_f32)
 * against the format's definition for all 256 codes, the f32 -> e4m3 rounding
 * (quant_f32_to_e4m3: nearest, ties to even, saturating at 448) against exhaustive search over
 * the codes, the block quantizer's scales and partial blocks, and quantization_config parsing:
 * fp8 (block / per tensor) and compressed-tensors FP8 accepted, every other method refused
 * naming it and listing the accepted ones.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "model/quant.h"

/* the definition: S.EEEE.MMM, bias 7, E = 0 subnormal, S.1111.111 NaN */
static double e4m3_def(int c) {
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return NAN;
    double v = e ? (1.0 + m / 8.0) * pow(2.0, e - 7) : m / 8.0 * pow(2.0, -6);
    return s ? -v : v;
}

static void test_e4m3_table_exact(void **st) {
    (void)st;
    uint8_t codes[256];
    float out[256];
    for (int i = 0; i < 256; i++)
        codes[i] = (uint8_t)i;
    backend_e4m3_to_f32(out, codes, 256);
    for (int i = 0; i < 256; i++) {
        double d = e4m3_def(i);
        if (isnan(d))
            assert_true(isnan(out[i]));
        else if ((double)out[i] != d || !!signbit(out[i]) != (i >> 7))
            fail_msg("e4m3 0x%02x: %.9g, definition %.9g", i, (double)out[i], d);
    }
    assert_true(out[0x7e] == 448.0f && out[0x01] == 0x1p-9f && out[0x38] == 1.0f);
}

static void test_f32_to_e4m3_rounding(void **st) {
    (void)st;
    /* every code round-trips */
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f) continue;
        float v = (float)e4m3_def(c);
        assert_int_equal(quant_f32_to_e4m3(v), c);
    }
    assert_int_equal(quant_f32_to_e4m3(NAN) & 0x7f, 0x7f);
    assert_int_equal(quant_f32_to_e4m3(1e9f), 0x7e);
    assert_int_equal(quant_f32_to_e4m3(-500.0f), 0xfe);
    /* nearest, ties to the even code, against a search over the codes */
    uint64_t r = 12345;
    for (int it = 0; it < 200000; it++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        float v;
        if (it % 4 == 0) { /* exact midpoints of neighbouring codes */
            int c = (int)(r >> 33) % 0x7e;
            v = (float)((e4m3_def(c) + e4m3_def(c + 1)) / 2);
        } else {
            v = (float)ldexp((double)(r >> 40) / (1 << 24) * 2 - 1, (int)((r >> 20) % 24) - 14);
        }
        double a = fabs((double)v);
        int best = 0;
        for (int c = 1; c <= 0x7e; c++) {
            double dc = fabs(e4m3_def(c) - a), db = fabs(e4m3_def(best) - a);
            if (dc < db || (dc == db && (c & 1) == 0 && (best & 1))) best = c;
        }
        if (v < 0 || (v == 0 && signbit(v))) best |= 0x80;
        if (quant_f32_to_e4m3(v) != best)
            fail_msg("e4m3(%.9g) = 0x%02x, nearest-even 0x%02x", (double)v, quant_f32_to_e4m3(v),
                     best);
    }
}

/* scales amax / 448 per block, partial blocks included; the dequantized matrix is within half
 * a code step of the original */
static void test_quant_fp8_matrix(void **st) {
    (void)st;
    int N = 130, K = 200, bn = 128, bk = 128, nkb = 2;
    float *w = malloc((size_t)N * K * 4), s[4], deq;
    uint8_t *q = malloc((size_t)N * K);
    assert_non_null(w), assert_non_null(q);
    for (int i = 0; i < N * K; i++)
        w[i] = sinf((float)i * 0.37f) * (i % 7 + 1);
    for (int i = 0; i < K; i++) /* an all-zero block row part: scale 1 */
        w[129 * K + i] = w[128 * K + i] = i < 128 ? 0.0f : w[128 * K + i];
    quant_fp8_matrix(q, s, w, N, K, bn, bk);
    for (int b = 0; b < 4; b++) {
        int r0 = (b / nkb) * bn, c0 = (b % nkb) * bk;
        float amax = 0;
        for (int r = r0; r < N && r < r0 + bn; r++)
            for (int c = c0; c < K && c < c0 + bk; c++)
                amax = fmaxf(amax, fabsf(w[r * K + c]));
        assert_true(s[b] == (amax > 0 ? amax / 448.0f : 1.0f));
    }
    for (int r = 0; r < N; r++)
        for (int c = 0; c < K; c++) {
            float sc = s[(r / bn) * nkb + c / bk];
            backend_e4m3_to_f32(&deq, &q[r * K + c], 1);
            deq *= sc;
            assert_true(fabsf(deq - w[r * K + c]) <= fabsf(w[r * K + c]) / 16 + sc * 0x1p-10f);
        }
    free(w);
    free(q);
}

static int parse(const char *js, model_quant *q, char *err, size_t errlen) {
    json_error_t je;
    json_t *o = json_loads(js, 0, &je);
    assert_non_null(o);
    int rc = quant_parse(q, o, "config.json", err, errlen);
    json_decref(o);
    return rc;
}

static void test_parse_accepted(void **st) {
    (void)st;
    model_quant q;
    char err[512];
    assert_int_equal(parse("{\"quant_method\":\"fp8\",\"activation_scheme\":\"dynamic\","
                           "\"fmt\":\"e4m3\",\"weight_block_size\":[128,128]}",
                           &q, err, sizeof err),
                     0);
    assert_int_equal(q.kind, QUANT_FP8);
    assert_int_equal(q.block_n, 128);
    assert_string_equal(q.scale_suffix, "weight_scale_inv");
    assert_int_equal(
        parse("{\"quant_method\":\"fp8\",\"activation_scheme\":\"static\"}", &q, err, sizeof err),
        0);
    assert_int_equal(q.block_n, 0);
    assert_int_equal(q.act_static, 1);
    assert_string_equal(q.scale_suffix, "weight_scale");
    assert_int_equal(
        parse("{\"quant_method\":\"compressed-tensors\",\"format\":\"float-quantized\","
              "\"config_groups\":{\"g\":{\"targets\":[\"Linear\"],\"weights\":{\"num_bits\":8,"
              "\"type\":\"float\",\"strategy\":\"channel\"},\"input_activations\":{\"num_bits\":8,"
              "\"type\":\"float\",\"strategy\":\"token\",\"dynamic\":true}}},\"ignore\":[\"lm_"
              "head\"]}",
              &q, err, sizeof err),
        0);
    assert_int_equal(q.kind, QUANT_FP8_CT);
    assert_int_equal(q.act_static, 0);
}

static void refused(const char *js, const char *name) {
    model_quant q;
    char err[512] = "";
    assert_int_equal(parse(js, &q, err, sizeof err), -EINVAL);
    if (!strstr(err, name) || !strstr(err, "accepted"))
        fail_msg("error for %s does not name it and the accepted ones: %s", name, err);
}

static void test_parse_refused(void **st) {
    (void)st;
    refused("{\"quant_method\":\"awq\",\"bits\":4}", "awq");
    refused("{\"quant_method\":\"gptq\",\"bits\":4}", "gptq");
    refused("{\"quant_method\":\"bitsandbytes\"}", "bitsandbytes");
    refused("{\"quant_method\":\"modelopt\",\"quant_algo\":\"NVFP4\"}", "modelopt");
    refused("{\"quant_method\":\"mxfp4\"}", "mxfp4");
    refused("{\"bits\":4}", "quant_method");
    refused("{\"quant_method\":\"fp8\",\"fmt\":\"e5m2\"}", "e5m2");
    refused("{\"quant_method\":\"fp8\",\"weight_block_size\":[128]}", "weight_block_size");
    /* compressed-tensors int8 w8a8, w4a16, nvfp4 */
    refused("{\"quant_method\":\"compressed-tensors\",\"config_groups\":{\"g\":{\"weights\":"
            "{\"num_bits\":8,\"type\":\"int\",\"strategy\":\"channel\"}}}}",
            "int");
    refused("{\"quant_method\":\"compressed-tensors\",\"format\":\"pack-quantized\","
            "\"config_groups\":{\"g\":{\"weights\":{\"num_bits\":4,\"type\":\"int\","
            "\"strategy\":\"group\"}}}}",
            "pack-quantized");
    refused("{\"quant_method\":\"compressed-tensors\",\"config_groups\":{\"g\":{\"weights\":"
            "{\"num_bits\":4,\"type\":\"float\",\"strategy\":\"tensor_group\"}}}}",
            "4-bit float");
    refused("{\"quant_method\":\"compressed-tensors\"}", "config_groups");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_e4m3_table_exact), cmocka_unit_test(test_f32_to_e4m3_rounding),
        cmocka_unit_test(test_quant_fp8_matrix), cmocka_unit_test(test_parse_accepted),
        cmocka_unit_test(test_parse_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
