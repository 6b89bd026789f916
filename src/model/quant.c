/*
 * quant — quantization_config as vLLM reads it (FP8 accepted, the rest refused by name) and
 * the host-side FP8 quantizer of --quantization fp8.
 */
#include "model/quant.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

const char *quant_kind_name(quant_kind k) {
    switch (k) {
    case QUANT_NONE:
        return "none";
    case QUANT_FP8:
        return "fp8";
    case QUANT_FP8_CT:
        return "compressed-tensors (fp8)";
    case QUANT_FP8_ONLINE:
        return "fp8 (quantized at load)";
    }
    return "?";
}

/* compressed-tensors: one quantization args object (weights or input_activations) must be
 * 8-bit float; what it is otherwise, for the error */
static const char *ct_args_bad(const json_t *a, const char **strategy) {
    json_int_t bits = json_integer_value(json_object_get(a, "num_bits"));
    const char *type = json_string_value(json_object_get(a, "type"));
    *strategy = json_string_value(json_object_get(a, "strategy"));
    if (!type || strcmp(type, "float")) return type && !strcmp(type, "int") ? "int" : "non-float";
    if (bits != 8) return bits == 4 ? "4-bit float (nvfp4 / mxfp4)" : "float of other width";
    return NULL;
}

static int parse_ct(model_quant *q, const json_t *qc, const char *where, char *err, size_t errlen) {
    const char *fmt = json_string_value(json_object_get(qc, "format"));
    if (fmt && strcmp(fmt, "float-quantized") && strcmp(fmt, "naive-quantized")) {
        snprintf(err, errlen,
                 "%s: compressed-tensors format \"%s\" is not supported (accepted: "
                 "float-quantized FP8; %s)",
                 where, fmt, QUANT_ACCEPTED);
        return -EINVAL;
    }
    /* parts of a compressed-tensors config that change the math beyond FP8 weights */
    const json_t *tc = json_object_get(qc, "transform_config"),
                 *sp = json_object_get(qc, "sparsity_config");
    if (tc && !json_is_null(tc) && !(json_is_object(tc) && !json_object_size(tc))) {
        snprintf(err, errlen,
                 "%s: compressed-tensors transform_config (rotations applied to the weights and "
                 "activations) is not supported; accepted: %s",
                 where, QUANT_ACCEPTED);
        return -EINVAL;
    }
    const char *sfmt = json_string_value(json_object_get(sp, "format"));
    if (sfmt && strcmp(sfmt, "dense")) {
        snprintf(err, errlen,
                 "%s: compressed-tensors sparsity_config format \"%s\" (compressed sparse "
                 "weights) is not supported; accepted: format \"dense\" or none, with %s",
                 where, sfmt, QUANT_ACCEPTED);
        return -EINVAL;
    }
    const json_t *groups = json_object_get(qc, "config_groups");
    if (!json_is_object(groups) || !json_object_size(groups)) {
        snprintf(err, errlen,
                 "%s: compressed-tensors quantization_config has no config_groups (accepted: %s)",
                 where, QUANT_ACCEPTED);
        return -EINVAL;
    }
    const char *gname;
    json_t *g;
    json_object_foreach((json_t *)groups, gname, g) {
        const json_t *w = json_object_get(g, "weights"),
                     *ia = json_object_get(g, "input_activations");
        const char *strat = NULL, *bad = w ? ct_args_bad(w, &strat) : "absent";
        if (!bad && strat && strcmp(strat, "tensor") && strcmp(strat, "channel") &&
            strcmp(strat, "block"))
            bad = strat; /* group, tensor_group: the int4 / nvfp4 layouts */
        if (bad) {
            snprintf(err, errlen,
                     "%s: compressed-tensors config_groups.%s weights are %s (%s scheme, e.g. "
                     "int8 w8a8, w4a16, nvfp4): not supported; accepted: %s",
                     where, gname, bad, strat ? strat : "?", QUANT_ACCEPTED);
            return -EINVAL;
        }
        if (ia && !json_is_null(ia)) {
            const char *as = NULL, *abad = ct_args_bad(ia, &as);
            if (abad) {
                snprintf(err, errlen,
                         "%s: compressed-tensors config_groups.%s input_activations are %s: not "
                         "supported; accepted: %s",
                         where, gname, abad, QUANT_ACCEPTED);
                return -EINVAL;
            }
            if (!json_is_true(json_object_get(ia, "dynamic"))) q->act_static = 1;
        }
        q->ct_strategy = strat && !strcmp(strat, "tensor")  ? QUANT_CT_TENSOR
                         : strat && !strcmp(strat, "block") ? QUANT_CT_BLOCK
                                                            : QUANT_CT_CHANNEL;
        if (q->ct_strategy == QUANT_CT_BLOCK) { /* block_structure [rows, cols], default 128 */
            const json_t *bs = json_object_get(w, "block_structure");
            json_int_t a = 128, b = 128;
            if (bs && !json_is_null(bs)) {
                a = json_integer_value(json_array_get(bs, 0));
                b = json_integer_value(json_array_get(bs, 1));
                if (!json_is_array(bs) || json_array_size(bs) != 2 || a < 1 || b < 1 ||
                    a > 65536 || b > 65536) {
                    snprintf(err, errlen,
                             "%s: compressed-tensors config_groups.%s weights.block_structure is "
                             "not accepted (accepted: two positive integers, e.g. [128, 128])",
                             where, gname);
                    return -EINVAL;
                }
            }
            q->block_n = (int)a;
            q->block_k = (int)b;
        }
    }
    q->kind = QUANT_FP8_CT;
    q->scale_suffix = "weight_scale";
    return 0;
}

int quant_parse(model_quant *q, const json_t *qc, const char *where, char *err, size_t errlen) {
    memset(q, 0, sizeof *q);
    if (!qc || json_is_null(qc)) return 0;
    const char *m = json_string_value(json_object_get(qc, "quant_method"));
    if (!json_is_object(qc) || !m) {
        snprintf(err, errlen, "%s: quantization_config has no quant_method (accepted: %s)", where,
                 QUANT_ACCEPTED);
        return -EINVAL;
    }
    if (!strcmp(m, "compressed-tensors")) return parse_ct(q, qc, where, err, errlen);
    if (strcmp(m, "fp8")) {
        snprintf(err, errlen,
                 "%s: quantization_config quant_method \"%s\" is not supported; accepted: %s",
                 where, m, QUANT_ACCEPTED);
        return -EINVAL;
    }
    const char *fmt = json_string_value(json_object_get(qc, "fmt"));
    if (fmt && strcmp(fmt, "e4m3")) {
        snprintf(err, errlen, "%s: fp8 fmt \"%s\" is not supported (accepted: e4m3)", where, fmt);
        return -EINVAL;
    }
    const char *as = json_string_value(json_object_get(qc, "activation_scheme"));
    if (as && strcmp(as, "dynamic") && strcmp(as, "static")) {
        snprintf(err, errlen,
                 "%s: fp8 activation_scheme \"%s\" is not supported (accepted: dynamic, static)",
                 where, as);
        return -EINVAL;
    }
    q->act_static = as && !strcmp(as, "static");
    q->kind = QUANT_FP8;
    q->scale_suffix = "weight_scale";
    const json_t *bs = json_object_get(qc, "weight_block_size");
    if (bs && !json_is_null(bs)) {
        json_int_t a = json_integer_value(json_array_get(bs, 0)),
                   b = json_integer_value(json_array_get(bs, 1));
        if (!json_is_array(bs) || json_array_size(bs) != 2 || a < 1 || b < 1 || a > 65536 ||
            b > 65536) {
            snprintf(
                err, errlen,
                "%s: fp8 weight_block_size is not accepted (accepted: two positive integers, e.g. "
                "[128, 128])",
                where);
            return -EINVAL;
        }
        q->block_n = (int)a;
        q->block_k = (int)b;
        q->scale_suffix = "weight_scale_inv";
    }
    return 0;
}

uint8_t quant_f32_to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return 0x7f;         /* NaN */
    if (u >= 0x43e00000u) return sign | 0x7e; /* >= 448: saturate */
    if (u < 0x3c800000u) {                    /* < 2^-6: subnormal, steps of 2^-9 */
        float a;
        memcpy(&a, &u, 4);
        return sign | (uint8_t)rintf(a * 512.0f); /* 8 steps carry into 2^-6 */
    }
    u += 0x7ffffu + ((u >> 20) & 1); /* round the mantissa to 3 bits, even */
    int e = (int)(u >> 23) - 127 + 7, m = (int)((u >> 20) & 7);
    int code = (e << 3) | m;
    return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

void quant_fp8_matrix(uint8_t *q, float *scales, const float *w, int N, int K, int block_n,
                      int block_k) {
    int nkb = (K + block_k - 1) / block_k;
    for (int bn = 0; bn * block_n < N; bn++)
        for (int bk = 0; bk < nkb; bk++) {
            int r1 = (bn + 1) * block_n < N ? (bn + 1) * block_n : N;
            int c1 = (bk + 1) * block_k < K ? (bk + 1) * block_k : K;
            float amax = 0.0f;
            for (int r = bn * block_n; r < r1; r++)
                for (int c = bk * block_k; c < c1; c++)
                    amax = fmaxf(amax, fabsf(w[(size_t)r * K + c]));
            float s = amax > 0.0f ? amax / QUANT_E4M3_MAX : 1.0f;
            scales[(size_t)bn * nkb + bk] = s;
            for (int r = bn * block_n; r < r1; r++)
                for (int c = bk * block_k; c < c1; c++)
                    q[(size_t)r * K + c] = quant_f32_to_e4m3(w[(size_t)r * K + c] / s);
        }
}
