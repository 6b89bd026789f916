/*
 * model_config — config.json / generation_config.json reader.  The shape here, the family
 * and its quirks (and every refusal) in model/arch.c; rope_theta at top level
 * (transformers 4.x) or in rope_parameters (5.x); torch_dtype (4.x) or dtype (5.x).
 */
#include "model/model_config.h"

#include "model/arch.h"

#include "base/file.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int get_int(json_t *o, const char *k, int *out, int required, const char *where, char *err,
                   size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) {
        if (required) {
            snprintf(err, errlen, "%s: missing \"%s\"", where, k);
            return -EINVAL;
        }
        return 1;
    }
    if (!json_is_integer(v) || json_integer_value(v) <= 0 || json_integer_value(v) > (1 << 30)) {
        snprintf(err, errlen, "%s: \"%s\" must be a positive integer", where, k);
        return -EINVAL;
    }
    *out = (int)json_integer_value(v);
    return 0;
}

static void add_eos(model_config *c, json_t *v) {
    if (json_is_integer(v)) {
        int id = (int)json_integer_value(v);
        for (int i = 0; i < c->n_eos; i++)
            if (c->eos_ids[i] == id) return;
        if (c->n_eos < MODEL_MAX_EOS) c->eos_ids[c->n_eos++] = id;
    } else if (json_is_array(v)) {
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) add_eos(c, x);
    }
}

int model_config_parse(model_config *c, const char *config_json, const char *gen_json,
                       const char *where, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    json_error_t je;
    json_t *o = json_loads(config_json, 0, &je);
    if (!o || !json_is_object(o)) {
        snprintf(err, errlen, "%s: not a JSON object (%s, line %d)", where,
                 o ? "wrong type" : je.text, je.line);
        json_decref(o);
        return -EINVAL;
    }
    int rc = -EINVAL;
    json_t *arch = json_array_get(json_object_get(o, "architectures"), 0);
    const char *mt = json_string_value(json_object_get(o, "model_type"));
    snprintf(c->arch, sizeof c->arch, "%s", json_is_string(arch) ? json_string_value(arch) : "");
    if (arch_check(c, mt, where, err, errlen)) goto out;
    if (get_int(o, "vocab_size", &c->vocab_size, 1, where, err, errlen) < 0 ||
        get_int(o, "hidden_size", &c->hidden_size, 1, where, err, errlen) < 0 ||
        get_int(o, "num_hidden_layers", &c->n_layers, 1, where, err, errlen) < 0 ||
        get_int(o, "num_attention_heads", &c->n_heads, 1, where, err, errlen) < 0 ||
        get_int(o, "intermediate_size", &c->intermediate_size, 1, where, err, errlen) < 0)
        goto out;
    c->n_kv_heads = c->n_heads;
    c->max_position = 32768;
    if (get_int(o, "num_key_value_heads", &c->n_kv_heads, 0, where, err, errlen) < 0 ||
        get_int(o, "max_position_embeddings", &c->max_position, 0, where, err, errlen) < 0)
        goto out;
    c->head_dim = 0;
    if (get_int(o, "head_dim", &c->head_dim, 0, where, err, errlen) < 0) goto out;
    json_t *eps = json_object_get(o, "rms_norm_eps");
    c->rms_norm_eps = json_is_number(eps) ? (float)json_number_value(eps) : 1e-6f;
    json_t *rp = json_object_get(o, "rope_parameters");
    json_t *theta = json_object_get(o, "rope_theta");
    if (json_is_object(rp) && !json_is_number(theta)) theta = json_object_get(rp, "rope_theta");
    c->rope_theta = json_is_number(theta) ? (float)json_number_value(theta) : 10000.0f;
    if (!(c->rope_theta > 0) || !(c->rms_norm_eps > 0)) {
        snprintf(err, errlen, "%s: rope_theta and rms_norm_eps must be positive", where);
        goto out;
    }
    if (arch_describe(c, o, where, err, errlen)) goto out;
    if (c->n_heads % c->n_kv_heads != 0 || c->head_dim % 2 != 0) {
        snprintf(err, errlen,
                 "%s: inconsistent attention shape: num_attention_heads %d, num_key_value_heads "
                 "%d, head_dim %d (need heads %% kv_heads == 0, even head_dim)",
                 where, c->n_heads, c->n_kv_heads, c->head_dim);
        goto out;
    }
    json_t *tie = json_object_get(o, "tie_word_embeddings");
    c->tie_embeddings = tie ? json_is_true(tie) : 0;
    json_t *dt = json_object_get(o, "dtype");
    if (!json_is_string(dt)) dt = json_object_get(o, "torch_dtype");
    snprintf(c->dtype, sizeof c->dtype, "%s", json_is_string(dt) ? json_string_value(dt) : "");
    json_t *bos = json_object_get(o, "bos_token_id");
    c->bos_token_id = json_is_integer(bos) ? (int)json_integer_value(bos) : -1;
    add_eos(c, json_object_get(o, "eos_token_id"));

    c->gen_temperature = 1.0f;
    c->gen_top_p = 1.0f;
    c->gen_repetition_penalty = 1.0f;
    if (gen_json) {
        json_t *g = json_loads(gen_json, 0, &je);
        if (!json_is_object(g)) {
            snprintf(err, errlen, "%s: generation_config.json is not a JSON object", where);
            json_decref(g);
            goto out;
        }
        c->has_gen_defaults = 1;
        add_eos(c, json_object_get(g, "eos_token_id"));
        json_t *v;
        if (json_is_number(v = json_object_get(g, "temperature")))
            c->gen_temperature = (float)json_number_value(v);
        if (json_is_number(v = json_object_get(g, "top_p")))
            c->gen_top_p = (float)json_number_value(v);
        if (json_is_integer(v = json_object_get(g, "top_k")))
            c->gen_top_k = (int)json_integer_value(v);
        if (json_is_number(v = json_object_get(g, "repetition_penalty")))
            c->gen_repetition_penalty = (float)json_number_value(v);
        if (json_is_false(json_object_get(g, "do_sample"))) c->gen_temperature = 0.0f;
        json_decref(g);
    }
    rc = 0;
out:
    json_decref(o);
    return rc;
}

int model_layer_is_moe(const model_config *c, int l) {
    if (c->n_experts <= 0 || l < 0 || c->decoder_sparse_step <= 0) return 0;
    if (l < MODEL_MAX_MLP_ONLY && (c->mlp_only[l / 64] >> (l % 64) & 1)) return 0;
    return (l + 1) % c->decoder_sparse_step == 0;
}

/* Checkpoints whose quantization is described beside config.json, not in it: AutoGPTQ /
 * AutoAWQ's quantize_config.json, NVIDIA ModelOpt's hf_quant_config.json.  Without this their
 * packed tensors would fail later as missing weights, without saying why. */
static int side_quant_refused(const char *dir, char *err, size_t errlen) {
    static const char *const files[] = {"quantize_config.json", "hf_quant_config.json"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        if (access(p, F_OK) != 0) continue;
        char *t = file_read_text(p, 1 << 20);
        json_t *o = t ? json_loads(t, 0, NULL) : NULL;
        free(t);
        const json_t *q = json_object_get(o, "quantization");
        const char *m = json_string_value(json_object_get(o, "quant_method"));
        if (!m) m = json_string_value(json_object_get(q, "quant_algo"));
        if (!m) m = i == 0 ? "gptq or awq" : "modelopt";
        snprintf(err, errlen,
                 "%s: a %s-quantized checkpoint (quantization described in %s, not in "
                 "config.json) is not supported; accepted: %s",
                 p, m, files[i], QUANT_ACCEPTED);
        json_decref(o);
        return -EINVAL;
    }
    return 0;
}

int model_config_load(model_config *c, const char *dir, char *err, size_t errlen) {
    char p[4096], g[4096];
    snprintf(p, sizeof p, "%s/config.json", dir);
    snprintf(g, sizeof g, "%s/generation_config.json", dir);
    char *cj = file_read_text(p, 1 << 20);
    if (!cj) {
        snprintf(err, errlen, "%s: cannot read (%s); a model directory needs config.json", p,
                 strerror(errno));
        return -ENOENT;
    }
    char *gj = file_read_text(g, 1 << 20);
    int rc = model_config_parse(c, cj, gj, p, err, errlen);
    free(cj);
    free(gj);
    if (!rc && c->quant.kind == QUANT_NONE) rc = side_quant_refused(dir, err, errlen);
    return rc;
}
