/*
 * model_config — a decoder's hyper-parameters and architecture description from
 * config.json (transformers 4.x and 5.x spellings; the families and their quirks:
 * model/arch.h) and the sampling defaults of generation_config.json.  The KV layout
 * (layers, kv heads, head dim) derived from it must agree between prefill and decode.
 */
#ifndef DISAGG_MODEL_CONFIG_H
#define DISAGG_MODEL_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "model/quant.h"

#define MODEL_MAX_EOS 8
#define MODEL_MAX_MLP_ONLY 1024 /* mlp_only_layers entries are layer indices below this */

/* RoPE scaling as transformers reads rope_scaling / rope_parameters (model/arch.c) */
typedef struct model_rope {
    char type[16];               /* default, linear, dynamic, yarn, llama3 */
    double factor;               /* linear, dynamic, yarn, llama3 */
    double low_freq_factor;      /* llama3 */
    double high_freq_factor;     /* llama3 */
    int original_max_position;   /* llama3, yarn */
    double beta_fast, beta_slow; /* yarn (32, 1 when absent) */
    int truncate;                /* yarn: truncate the correction range (default 1) */
    double attention_factor;     /* yarn: cos/sin scale (given or from mscale); else 1 */
} model_rope;

typedef struct model_config {
    char arch[64];              /* architectures[0], e.g. Qwen2ForCausalLM */
    int vocab_size;             /* embedding rows */
    int hidden_size;            /* model width */
    int n_layers;               /* num_hidden_layers */
    int n_heads;                /* num_attention_heads */
    int n_kv_heads;             /* num_key_value_heads (GQA) */
    int head_dim;               /* head_dim, else the family's default (hidden / heads) */
    int q_dim;                  /* n_heads * head_dim: q and attention width (may != hidden) */
    int qkv_bias;               /* q/k/v projections have biases (Qwen2) */
    int qk_norm;                /* per-head RMSNorm of q and k before RoPE (Qwen3) */
    int sliding_window;         /* attention sees the last sliding_window keys (Mistral); 0 all */
    model_rope rope;            /* RoPE variant (arch_rope_table computes its table) */
    int intermediate_size;      /* MLP width (a dense layer's) */
    /* mixture of experts (Qwen3-MoE, Mixtral: model/arch.c); n_experts 0: every layer dense */
    int n_experts;             /* num_experts / num_local_experts */
    int n_experts_per_tok;     /* top_k of the router */
    int norm_topk_prob;        /* renormalise the top_k weights (Qwen3-MoE's flag; Mixtral 1) */
    int moe_intermediate_size; /* one expert's width (Mixtral: intermediate_size) */
    int decoder_sparse_step;   /* layer l is sparse when (l + 1) % step == 0 ... */
    uint64_t mlp_only[MODEL_MAX_MLP_ONLY / 64]; /* ... and its bit (mlp_only_layers) is clear */
    int max_position;           /* max_position_embeddings */
    float rms_norm_eps;         /* RMSNorm epsilon */
    float rope_theta;           /* RoPE base */
    int tie_embeddings;         /* lm_head shares embed_tokens */
    char dtype[16];             /* torch_dtype / dtype as written ("bfloat16", ...) */
    int bos_token_id;           /* -1 if absent */
    int eos_ids[MODEL_MAX_EOS]; /* config + generation_config eos ids */
    int n_eos;
    /* generation_config.json sampling defaults (has_gen_defaults = file present) */
    int has_gen_defaults;
    float gen_temperature;        /* 1.0 if absent */
    float gen_top_p;              /* 1.0 if absent */
    int gen_top_k;                /* 0 (off) if absent */
    float gen_repetition_penalty; /* 1.0 if absent */
    model_quant quant;            /* quantization_config (model/quant.h); QUANT_NONE if absent */
} model_config;

/* 1 when layer l's MLP is a mixture of experts (c->n_experts > 0, l not in mlp_only_layers,
 * (l + 1) % decoder_sparse_step == 0: transformers' Qwen3MoeDecoderLayer rule). */
int model_layer_is_moe(const model_config *c, int l);

/* Reads dir/config.json and dir/generation_config.json (optional). */
int model_config_load(model_config *c, const char *dir, char *err, size_t errlen);
/* Same from JSON text (tests); gen_json may be NULL. */
int model_config_parse(model_config *c, const char *config_json, const char *gen_json,
                       const char *where, char *err, size_t errlen);

#endif
