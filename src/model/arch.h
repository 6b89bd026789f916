/*
 * arch — what an architecture is, from config.json as transformers reads it: which
 * families disagg runs (Qwen2, Qwen3, Llama 3.x, Mistral, Qwen3-MoE, Mixtral), each one's
 * description (biases, q/k norms, head_dim, sliding window, RoPE variant, tying, experts) in
 * model_config, and the RoPE
 * frequency table of each variant computed as transformers' modeling_rope_utils.py does.
 * Everything a checkpoint asks for that the forward does not do is refused here, naming
 * the field and what is accepted (docs/models.md).
 */
#ifndef DISAGG_MODEL_ARCH_H
#define DISAGG_MODEL_ARCH_H

#include "model/model_config.h"

#include <stddef.h>

struct json_t;

/* 0 when architectures[0] (c->arch; or, when empty, model_type mt) names a family disagg
 * runs, else -EINVAL with err naming it and the accepted ones. */
int arch_check(const model_config *c, const char *mt, const char *where, char *err,
               size_t errlen);
/* The family from architectures[0] / model_type, the description fields of c and the
 * refusals.  c's shape fields (hidden, heads, ...) are read by the caller first; this
 * fills head_dim (when config.json has none), q_dim, qkv_bias, qk_norm, sliding_window and
 * rope.  0, or -EINVAL with err naming the field. */
int arch_describe(model_config *c, const struct json_t *o, const char *where, char *err,
                  size_t errlen);

/* The RoPE table: inv_freq (head_dim / 2) f32 as transformers computes it for c->rope
 * (default, linear, dynamic within max_position_embeddings, yarn, llama3), and the factor
 * transformers multiplies cos and sin by (yarn's attention factor, else 1). */
void arch_rope_table(const model_config *c, float *inv_freq, float *attn_factor);

/* "qwen2", "qwen3", "llama", "mistral", "qwen3moe", "mixtral": the short name (KV layout
 * fingerprint's first field). */
const char *arch_family(const model_config *c);

#endif
