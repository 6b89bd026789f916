/* model_bench_moe — see model_bench_moe.h. */
#include "bench/model_bench_moe.h"

#include <math.h>

/* one layer's matrix parameters with `experts` of its experts (a dense layer: its MLP) */
static double layer_params(const model_config *c, int l, double experts) {
    double h = c->hidden_size, kvd = (double)c->n_kv_heads * c->head_dim, qd = c->q_dim;
    double attn = 2.0 * h * qd + 2.0 * h * kvd;
    if (!model_layer_is_moe(c, l)) return attn + 3.0 * h * c->intermediate_size;
    return attn + (double)c->n_experts * h + experts * 3.0 * h * c->moe_intermediate_size;
}

void mbm_params(const model_config *c, int tied, double *total, double *active_layers) {
    double t = (double)c->vocab_size * c->hidden_size * (tied ? 1 : 2), a = 0;
    for (int l = 0; l < c->n_layers; l++) {
        t += layer_params(c, l, c->n_experts);
        a += layer_params(c, l, c->n_experts_per_tok);
    }
    *total = t;
    *active_layers = a;
}

double mbm_step_params(const model_config *c, int B) {
    double p = (double)c->vocab_size * c->hidden_size, E = c->n_experts; /* the lm_head */
    double read = E > 0 ? E * (1.0 - pow(1.0 - c->n_experts_per_tok / E, B)) : 0;
    for (int l = 0; l < c->n_layers; l++)
        p += layer_params(c, l, read);
    return p;
}
