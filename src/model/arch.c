/*
 * arch — the architecture description from config.json (see arch.h).  One table of the
 * families; the per-family quirks are fields of model_config that the forward
 * (model/decoder.c) and the weight loader read.  The RoPE tables follow transformers'
 * modeling_rope_utils.py step by step, in f32 where it computes in f32 (torch tensors)
 * and in double where it computes on Python floats.
 */
#include "model/arch.h"
#include "model/quant.h"

#include "kernels/backend.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

enum { MOE_NONE, MOE_QWEN3, MOE_MIXTRAL };

typedef struct family {
    const char *arch;       /* architectures[0] */
    const char *model_type; /* model_type (used when architectures is absent) */
    const char *name;       /* arch_family() */
    int qkv_bias;           /* q/k/v projections carry biases */
    int qk_norm;            /* per-head RMSNorm of q and k (q_norm, k_norm) */
    int window;             /* sliding_window honoured (Mistral) */
    int bias_key;           /* attention_bias / mlp_bias exist in the config (must be false) */
    int head_dim_default;   /* head_dim when config.json has none (0: hidden / heads) */
    int moe;                /* MOE_NONE, MOE_QWEN3 or MOE_MIXTRAL: the sparse MLP's fields */
} family;

static const family families[] = {
    {"Qwen2ForCausalLM", "qwen2", "qwen2", 1, 0, 0, 0, 0, MOE_NONE},
    {"Qwen3ForCausalLM", "qwen3", "qwen3", 0, 1, 0, 1, 128, MOE_NONE},
    {"LlamaForCausalLM", "llama", "llama", 0, 0, 0, 1, 0, MOE_NONE},
    {"MistralForCausalLM", "mistral", "mistral", 0, 0, 1, 0, 0, MOE_NONE},
    {"Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe", 0, 1, 0, 1, 0, MOE_QWEN3},
    {"MixtralForCausalLM", "mixtral", "mixtral", 0, 0, 1, 0, 0, MOE_MIXTRAL},
};
#define N_FAMILIES (sizeof families / sizeof families[0])
#define ACCEPTED_ARCHS                                                                             \
    "Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM (Llama 3.x), MistralForCausalLM, "     \
    "Qwen3MoeForCausalLM, MixtralForCausalLM"
#define ACCEPTED_ROPE "default, linear, dynamic, yarn, llama3"

static const family *find_family(const model_config *c, const char *mt) {
    for (size_t i = 0; i < N_FAMILIES; i++)
        if (c->arch[0] ? !strcmp(c->arch, families[i].arch)
                       : mt && !strcmp(mt, families[i].model_type))
            return &families[i];
    return NULL;
}

const char *arch_family(const model_config *c) {
    const family *f = find_family(c, NULL);
    return f ? f->name : "qwen2";
}

static double num(const json_t *o, const char *k, double dflt) {
    json_t *v = json_object_get(o, k);
    return json_is_number(v) ? json_number_value(v) : dflt;
}

/* rope_scaling (4.x) / rope_parameters (5.x) into c->rope */
static int parse_rope(model_config *c, const json_t *o, const char *where, char *err,
                      size_t errlen) {
    model_rope *r = &c->rope;
    const char *key = "rope_parameters";
    json_t *rp = json_object_get(o, key);
    if (!json_is_object(rp) || !json_object_get(rp, "factor")) {
        json_t *rs = json_object_get(o, "rope_scaling");
        if (json_is_object(rs)) rp = rs, key = "rope_scaling";
    }
    snprintf(r->type, sizeof r->type, "default");
    r->factor = 1.0;
    r->attention_factor = 1.0;
    if (!json_is_object(rp)) return 0;
    const char *t = json_string_value(json_object_get(rp, "rope_type"));
    if (!t) t = json_string_value(json_object_get(rp, "type"));
    if (!t) t = "default";
    if (strcmp(t, "default") && strcmp(t, "linear") && strcmp(t, "dynamic") && strcmp(t, "yarn") &&
        strcmp(t, "llama3")) {
        snprintf(err, errlen, "%s: %s.rope_type '%s' is not supported (accepted: %s)", where, key,
                 t, ACCEPTED_ROPE);
        return -EINVAL;
    }
    snprintf(r->type, sizeof r->type, "%s", t);
    json_t *prf = json_object_get(rp, "partial_rotary_factor");
    if (json_is_number(prf) && json_number_value(prf) != 1.0) {
        snprintf(err, errlen, "%s: %s.partial_rotary_factor %g is not supported (accepted: 1.0)",
                 where, key, json_number_value(prf));
        return -EINVAL;
    }
    if (!strcmp(t, "default")) return 0;
    json_t *f = json_object_get(rp, "factor");
    if (!json_is_number(f) && strcmp(t, "yarn")) {
        snprintf(err, errlen, "%s: %s of type '%s' needs a numeric \"factor\"", where, key, t);
        return -EINVAL;
    }
    r->factor = json_is_number(f) ? json_number_value(f) : 0.0;
    /* transformers: the top-level original_max_position_embeddings wins, then the rope
     * dict's, then max_position_embeddings */
    json_t *om = json_object_get(o, "original_max_position_embeddings");
    if (!json_is_integer(om)) om = json_object_get(rp, "original_max_position_embeddings");
    r->original_max_position = json_is_integer(om) ? (int)json_integer_value(om) : c->max_position;
    if (!strcmp(t, "linear") || !strcmp(t, "dynamic")) {
        if (!(r->factor > 0)) goto bad_factor;
        return 0;
    }
    if (!strcmp(t, "llama3")) {
        r->low_freq_factor = num(rp, "low_freq_factor", NAN);
        r->high_freq_factor = num(rp, "high_freq_factor", NAN);
        if (!(r->factor > 0) || !(r->low_freq_factor > 0) ||
            !(r->high_freq_factor > r->low_freq_factor) || !json_is_integer(om)) {
            snprintf(err, errlen,
                     "%s: %s of type 'llama3' needs factor > 0, 0 < low_freq_factor < "
                     "high_freq_factor and original_max_position_embeddings",
                     where, key);
            return -EINVAL;
        }
        return 0;
    }
    /* yarn */
    if (!json_is_number(f)) r->factor = (double)c->max_position / r->original_max_position;
    if (!(r->factor > 0)) goto bad_factor;
    double af = num(rp, "attention_factor", NAN), ms = num(rp, "mscale", 0),
           msa = num(rp, "mscale_all_dim", 0);
#define GET_MSCALE(scale, m) ((scale) <= 1 ? 1.0 : 0.1 * (m)*log(scale) + 1.0)
    if (isnan(af))
        af = ms != 0 && msa != 0 ? GET_MSCALE(r->factor, ms) / GET_MSCALE(r->factor, msa)
                                 : GET_MSCALE(r->factor, 1.0);
#undef GET_MSCALE
    r->attention_factor = af;
    r->beta_fast = num(rp, "beta_fast", 0);
    r->beta_slow = num(rp, "beta_slow", 0);
    if (r->beta_fast == 0) r->beta_fast = 32; /* transformers: `or 32` */
    if (r->beta_slow == 0) r->beta_slow = 1;
    json_t *tr = json_object_get(rp, "truncate");
    r->truncate = tr ? !json_is_false(tr) : 1;
    return 0;
bad_factor:
    snprintf(err, errlen, "%s: %s.factor must be positive", where, key);
    return -EINVAL;
}

/* an optional integer field: *out unchanged when absent or null; -EINVAL unless in [lo, hi] */
static int opt_int(const json_t *o, const char *k, int lo, int hi, int *out, const char *where,
                   char *err, size_t errlen) {
    json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        snprintf(err, errlen, "%s: \"%s\" must be an integer in [%d, %d]", where, k, lo, hi);
        return -EINVAL;
    }
    *out = (int)json_integer_value(v);
    return 0;
}

/* The sparse MLP's description, with transformers' defaults for absent fields
 * (Qwen3MoeConfig: 128 experts, top 8, moe_intermediate_size 768, decoder_sparse_step 1,
 * norm_topk_prob false, no mlp_only_layers; MixtralConfig: 8 experts, top 2, every layer
 * sparse, always renormalised, the experts as wide as intermediate_size). */
static int parse_moe(model_config *c, const family *f, const json_t *o, const char *where,
                     char *err, size_t errlen) {
    const int max_e = BACKEND_MOE_MAX_EXPERTS;
    c->decoder_sparse_step = 1;
    if (f->moe == MOE_MIXTRAL) {
        c->n_experts = 8, c->n_experts_per_tok = 2, c->norm_topk_prob = 1;
        c->moe_intermediate_size = c->intermediate_size;
        if (opt_int(o, "num_local_experts", 1, max_e, &c->n_experts, where, err, errlen))
            return -EINVAL;
    } else {
        c->n_experts = 128, c->n_experts_per_tok = 8, c->moe_intermediate_size = 768;
        /* transformers 5 maps num_experts onto num_local_experts: either spelling */
        const char *ne = json_object_get(o, "num_experts") ? "num_experts" : "num_local_experts";
        if (opt_int(o, ne, 0, max_e, &c->n_experts, where, err, errlen) ||
            opt_int(o, "moe_intermediate_size", 1, 1 << 30, &c->moe_intermediate_size, where, err,
                    errlen) ||
            opt_int(o, "decoder_sparse_step", 1, 1 << 30, &c->decoder_sparse_step, where, err,
                    errlen))
            return -EINVAL;
        json_t *nt = json_object_get(o, "norm_topk_prob");
        if (nt && !json_is_boolean(nt) && !json_is_null(nt)) {
            snprintf(err, errlen, "%s: \"norm_topk_prob\" must be true or false", where);
            return -EINVAL;
        }
        c->norm_topk_prob = json_is_true(nt);
        json_t *mo = json_object_get(o, "mlp_only_layers"), *x;
        size_t i;
        if (mo && !json_is_null(mo) && !json_is_array(mo)) {
            snprintf(err, errlen, "%s: \"mlp_only_layers\" must be a list of layer indices", where);
            return -EINVAL;
        }
        json_array_foreach(mo, i, x) {
            json_int_t l = json_is_integer(x) ? json_integer_value(x) : -1;
            if (l < 0 || (l >= MODEL_MAX_MLP_ONLY && l < c->n_layers)) {
                snprintf(err, errlen,
                         "%s: mlp_only_layers[%zu] must be a layer index in [0, %d) (at most %d)",
                         where, i, c->n_layers, MODEL_MAX_MLP_ONLY - 1);
                return -EINVAL;
            }
            if (l < c->n_layers) c->mlp_only[l / 64] |= 1ull << (l % 64);
        }
    }
    if (opt_int(o, "num_experts_per_tok", 1, max_e, &c->n_experts_per_tok, where, err, errlen))
        return -EINVAL;
    if (c->n_experts && c->n_experts_per_tok > c->n_experts) {
        snprintf(err, errlen,
                 "%s: num_experts_per_tok %d is more than the %d experts (accepted: 1 .. %d)",
                 where, c->n_experts_per_tok, c->n_experts, c->n_experts);
        return -EINVAL;
    }
    return 0;
}

int arch_check(const model_config *c, const char *mt, const char *where, char *err, size_t errlen) {
    if (find_family(c, mt)) return 0;
    snprintf(err, errlen, "%s: unsupported architecture '%s' (model_type '%s'); accepted: %s",
             where, c->arch[0] ? c->arch : "(none)", mt ? mt : "(none)", ACCEPTED_ARCHS);
    return -EINVAL;
}

int arch_describe(model_config *c, const struct json_t *jo, const char *where, char *err,
                  size_t errlen) {
    const json_t *o = jo;
    const char *mt = json_string_value(json_object_get(o, "model_type"));
    const family *f = find_family(c, mt);
    if (!f) return arch_check(c, mt, where, err, errlen);
    if (!c->head_dim)
        c->head_dim = f->head_dim_default ? f->head_dim_default : c->hidden_size / c->n_heads;
    if (c->head_dim < 1 || c->head_dim % 2) {
        snprintf(err, errlen,
                 "%s: head_dim %d (hidden_size %d / num_attention_heads %d when config.json has no "
                 "head_dim) is not accepted; accepted: a positive even head_dim",
                 where, c->head_dim, c->hidden_size, c->n_heads);
        return -EINVAL;
    }
    c->q_dim = c->n_heads * c->head_dim;
    c->qkv_bias = f->qkv_bias;
    c->qk_norm = f->qk_norm;
    /* what the forward does not do: refused, never ignored */
    static const char *const never[] = {"attention_sink", "sinks", "attn_logit_softcapping",
                                        "final_logit_softcapping"};
    int qrc = quant_parse(&c->quant, json_object_get(o, "quantization_config"), where, err, errlen);
    if (qrc) return qrc;
    for (size_t i = 0; i < sizeof never / sizeof never[0]; i++) {
        json_t *v = json_object_get(o, never[i]);
        if (v && !json_is_null(v) && !json_is_false(v)) {
            snprintf(err, errlen, "%s: \"%s\" is not supported (accepted: absent or null)", where,
                     never[i]);
            return -EINVAL;
        }
    }
    json_t *prf = json_object_get(o, "partial_rotary_factor");
    if (json_is_number(prf) && json_number_value(prf) != 1.0) {
        snprintf(err, errlen, "%s: partial_rotary_factor %g is not supported (accepted: 1.0)",
                 where, json_number_value(prf));
        return -EINVAL;
    }
    const char *act = json_string_value(json_object_get(o, "hidden_act"));
    if (!act) act = json_string_value(json_object_get(o, "hidden_activation"));
    if (act && strcmp(act, "silu")) {
        snprintf(err, errlen, "%s: hidden_act '%s' is not supported (accepted: silu)", where, act);
        return -EINVAL;
    }
    static const char *const biases[] = {"attention_bias", "mlp_bias"};
    for (int i = 0; i < 2; i++)
        if (json_is_true(json_object_get(o, biases[i]))) {
            snprintf(err, errlen, "%s: %s=true is not supported for %s (accepted: false)", where,
                     biases[i], f->arch);
            return -EINVAL;
        }
    json_t *lt = json_object_get(o, "layer_types");
    size_t i;
    json_t *x;
    if (json_is_array(lt)) json_array_foreach(lt, i, x) {
            const char *s = json_string_value(x);
            if (!s ||
                (strcmp(s, "full_attention") && !(f->window && !strcmp(s, "sliding_attention")))) {
                snprintf(err, errlen,
                         "%s: layer_types[%zu] '%s' is not supported for %s (accepted: "
                         "full_attention)",
                         where, i, s ? s : "?", f->arch);
                return -EINVAL;
            }
        }
    json_t *sw = json_object_get(o, "sliding_window");
    if (f->window) {
        if (sw && !json_is_null(sw)) {
            if (!json_is_integer(sw) || json_integer_value(sw) <= 0 ||
                json_integer_value(sw) > (1 << 30)) {
                snprintf(err, errlen, "%s: \"sliding_window\" must be a positive integer or null",
                         where);
                return -EINVAL;
            }
            /* a window at least as long as the context changes nothing */
            if (json_integer_value(sw) < c->max_position)
                c->sliding_window = (int)json_integer_value(sw);
        }
    } else if (json_is_true(json_object_get(o, "use_sliding_window"))) {
        snprintf(err, errlen,
                 "%s: use_sliding_window=true is not supported for %s (accepted: false; sliding "
                 "windows: MistralForCausalLM)",
                 where, f->arch);
        return -EINVAL;
    }
    if (f->moe && parse_moe(c, f, o, where, err, errlen)) return -EINVAL;
    return parse_rope(c, o, where, err, errlen);
}

void arch_rope_table(const model_config *c, float *inv, float *attn_factor) {
    const model_rope *r = &c->rope;
    int dim = c->head_dim, half = dim / 2;
    float base = c->rope_theta;
    *attn_factor = 1.0f;
    /* default: 1 / base ** (arange(0, dim, 2) / dim), the exponent and the power in f32 */
    for (int i = 0; i < half; i++)
        inv[i] = 1.0f / powf(base, (float)(2 * i) / (float)dim);
    if (!strcmp(r->type, "linear")) {
        for (int i = 0; i < half; i++)
            inv[i] /= (float)r->factor;
    } else if (!strcmp(r->type, "llama3")) {
        float factor = (float)r->factor, lo = (float)r->low_freq_factor,
              old = (float)r->original_max_position;
        double low_wl = (double)r->original_max_position / r->low_freq_factor,
               high_wl = (double)r->original_max_position / r->high_freq_factor;
        float fdiff = (float)(r->high_freq_factor - r->low_freq_factor);
        for (int i = 0; i < half; i++) {
            float wl = (float)(2 * M_PI) / inv[i];
            float v = wl > (float)low_wl ? inv[i] / factor : inv[i];
            float smooth = (old / wl - lo) / fdiff;
            float smoothed = (1 - smooth) * v / factor + smooth * v;
            int medium = !(wl < (float)high_wl) && !(wl > (float)low_wl);
            inv[i] = medium ? smoothed : v;
        }
    } else if (!strcmp(r->type, "yarn")) {
        double lb = log(base), om = r->original_max_position;
        double low = dim * log(om / (r->beta_fast * 2 * M_PI)) / (2 * lb);
        double high = dim * log(om / (r->beta_slow * 2 * M_PI)) / (2 * lb);
        if (r->truncate) low = floor(low), high = ceil(high);
        if (low < 0) low = 0;
        if (high > dim - 1) high = dim - 1;
        if (low == high) high += 0.001;
        float factor = (float)r->factor;
        for (int i = 0; i < half; i++) {
            float pos_freq = powf(base, (float)(2 * i) / (float)dim);
            float extra = 1.0f / pos_freq, inter = 1.0f / (factor * pos_freq);
            float ramp = ((float)i - (float)low) / (float)(high - low);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            float ef = 1 - ramp;
            inv[i] = inter * (1 - ef) + extra * ef;
        }
        *attn_factor = (float)r->attention_factor;
    }
    /* dynamic: transformers' table equals the default one up to max_position_embeddings,
     * the longest sequence the forward accepts */
}
