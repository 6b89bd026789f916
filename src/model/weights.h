/*
 * weights — the Qwen2 weight tensors, used in place from the safetensors mapping
 * (bf16, f16 or f32; no f32 copy).  Loading checks every tensor exists with the shape the
 * config implies and a supported dtype; errors name the file and tensor.  Small vectors
 * (norm weights, biases) are converted to f32 copies.
 */
#ifndef DISAGG_MODEL_WEIGHTS_H
#define DISAGG_MODEL_WEIGHTS_H

#include "kernels/cpu/cpu_matmul.h"
#include "model/model_config.h"
#include "model/safetensors.h"

typedef struct weight_mat {
    const void *data; /* (rows, cols) in the mapping */
    cpu_dtype dtype;  /* element type */
    int rows, cols;   /* shape */
} weight_mat;

typedef struct layer_weights {
    float *attn_norm;        /* (hidden) input_layernorm */
    weight_mat wq, wk, wv;   /* (hidden | kv_dim, hidden) */
    float *bq, *bk, *bv;     /* (hidden), (kv_dim), (kv_dim) */
    weight_mat wo;           /* (hidden, hidden) */
    float *mlp_norm;         /* (hidden) post_attention_layernorm */
    weight_mat w_gate, w_up; /* (intermediate, hidden) */
    weight_mat w_down;       /* (hidden, intermediate) */
} layer_weights;

typedef struct model_weights {
    st_set st;             /* mapped files */
    weight_mat embed;      /* (vocab, hidden) */
    layer_weights *layers; /* (n_layers) */
    int n_layers;          /* entries of layers */
    float *final_norm;     /* (hidden) */
    weight_mat lm_head;    /* (vocab, hidden); == embed when tied */
    cpu_dtype dtype;       /* dtype of the big matrices */
    size_t matrix_bytes;   /* bytes of all matrices (lm_head counted once) */
} model_weights;

int weights_load(model_weights *w, const model_config *c, const char *dir, char *err,
                 size_t errlen);
void weights_free(model_weights *w);

#endif
