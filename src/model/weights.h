/*
 * weights — the decoder's weight tensors as buffers of a backend (kernels/backend.h).  The
 * matrices go through backend_weights_load: the CPU backend uses them in place from the
 * safetensors mapping (bf16, f16 or f32; no copy), a GPU backend copies them to its memory
 * in the dtype it computes with (weight_mat.dtype says which).  Small vectors (norm
 * weights, biases) become f32 buffers.  Every pointer here is a device address of the
 * backend's (host pointers on the CPU).  Loading checks every tensor exists with the shape
 * the config implies and a supported dtype; errors name the file and tensor.  On a backend
 * that computes q|k|v and gate|up as one GEMM each (backend_wants_cat) those matrices are
 * loaded concatenated, once (the separate weight_mats are views into them).  A sparse MLP's
 * experts come per expert as the Hub ships them (Qwen3-MoE: mlp.gate / mlp.experts.E.
 * {gate,up,down}_proj; Mixtral: block_sparse_moe.gate / block_sparse_moe.experts.E.{w1,w3,w2}).
 */
#ifndef DISAGG_MODEL_WEIGHTS_H
#define DISAGG_MODEL_WEIGHTS_H

#include "kernels/backend.h"
#include "model/model_config.h"
#include "model/safetensors.h"
#include "model/tp_shard.h"

typedef struct weight_mat {
    const void *data;     /* (rows, cols) device address */
    backend_dtype dtype;  /* element type as the backend stores it */
    int rows, cols;       /* shape */
    backend_wscale scale; /* F8E4M3: its scales (backend.h); zero otherwise */
} weight_mat;

typedef struct layer_weights {
    float *attn_norm;        /* (hidden) input_layernorm */
    weight_mat wq, wk, wv;   /* (q_dim | kv_dim, hidden) */
    float *bq, *bk, *bv;     /* (q_dim), (kv_dim), (kv_dim); NULL without qkv_bias */
    float *q_norm, *k_norm;  /* (head_dim) each (Qwen3's qk_norm), else NULL */
    weight_mat wo;           /* (hidden, q_dim) */
    float *mlp_norm;         /* (hidden) post_attention_layernorm */
    weight_mat w_gate, w_up; /* (intermediate, hidden) */
    weight_mat w_down;       /* (hidden, intermediate) */
    /* backend_wants_cat: q|k|v and gate|up as one matrix each (wq .. w_up then point into
     * them), the q/k/v biases as one vector (bq, bk, bv point into it); else data NULL */
    weight_mat wqkv;      /* (q_dim + 2 kv_dim, hidden) */
    weight_mat w_gate_up; /* (2 intermediate, hidden) */
    float *bqkv;          /* (q_dim + 2 kv_dim), NULL without qkv_bias */
    /* a sparse MLP (model_layer_is_moe; else router.data NULL and no expert): the router and
     * n_experts SwiGLU experts of moe_intermediate_size.  Per expert (host arrays of device
     * addresses, e.g. the CPU's zero-copy views of the safetensors), and on a backend that
     * wants matrices concatenated also stacked as one buffer each (the per-expert addresses
     * then point into it): gate_up_all (n_experts, 2 inter, hidden) = gate_0, up_0, gate_1,
     * up_1, ...; down_all (n_experts, hidden, inter).  Every expert matrix has expert_dt. */
    weight_mat router;                 /* (n_experts, hidden) */
    const void **ex_gate, **ex_up, **ex_down; /* (n_experts) each, one allocation */
    backend_dtype expert_dt;           /* dtype of every expert matrix (as stored) */
    const void *ex_gate_up_all, *ex_down_all; /* stacked, or NULL */
} layer_weights;

typedef struct model_weights {
    st_set st;             /* mapped files */
    weight_mat embed;      /* (vocab, hidden) */
    layer_weights *layers; /* (n_layers) */
    int n_layers;          /* entries of layers */
    float *final_norm;     /* (hidden) */
    weight_mat lm_head;    /* (vocab, hidden); == embed when tied */
    backend_dtype dtype;   /* checkpoint dtype of the big matrices */
    size_t matrix_bytes;   /* checkpoint bytes of all matrices (lm_head counted once) */
    backend *be;           /* where the buffers live (not owned) */
    backend_buffer **bufs; /* (n_bufs) every buffer made, freed by weights_free */
    int n_bufs, cap_bufs;
    unsigned char *st_used; /* (st.n_tensors) 1: bound (the rest is refused) */
    /* the FP8 KV cache's per-tensor scales (vLLM's names: model.layers.N.self_attn.k_scale /
     * v_scale, or the older kv_scale for both): host arrays of n_layers floats, NULL when the
     * checkpoint has none (then 1.0, as vLLM) -- kernels/backend.h backend_kv.k_scale */
    float *k_scale, *v_scale;
    uint64_t dummy_seed;    /* nonzero: --load-format dummy (random weights, no files) */
    void **dummy;           /* (n_dummy) host bytes of made-up tensors the backend aliases */
    int n_dummy, cap_dummy;
    model_quant quant; /* the config's (QUANT_FP8_ONLINE: quantize the decoder's matrices) */
    const tp_shard *tp;     /* tensor parallelism: this rank's cut of each tensor (NULL: whole) */
} model_weights;

/* On the CPU backend (backend_cpu_default). */
int weights_load(model_weights *w, const model_config *c, const char *dir, char *err,
                 size_t errlen);
int weights_load_on(model_weights *w, backend *be, const model_config *c, const char *dir,
                    char *err, size_t errlen);
/* dummy_seed nonzero: --load-format dummy as vLLM has it -- no safetensors read, every
 * tensor of the shapes config.json implies made up (matrices bf16 uniform in +-1/sqrt(cols),
 * deterministic in the seed and the tensor's name; norm weights 1, biases 0) and placed
 * on be as a checkpoint's would be. */
int weights_load_ex(model_weights *w, backend *be, const model_config *c, const char *dir,
                    uint64_t dummy_seed, char *err, size_t errlen);
/* FP8 (c->quant, model/quant.h): a checkpoint's e4m3 matrices come with their scale tensors
 * (<layer>.weight_scale_inv / .weight_scale; input_scale accepted and unused) and go through
 * backend_weights_load_fp8; with QUANT_FP8_ONLINE (--quantization fp8) every linear layer of
 * the decoder (not the embedding or lm_head) is quantized at load, one scale per output
 * channel -- with --load-format dummy per 128 x 128 block, the layout of the FP8 checkpoints
 * the benchmarks stand for. */
/* tp non-NULL: only this rank's share of each tensor (model/tp_shard.h: rows of the
 * column-parallel matrices as views, columns of the row-parallel ones and the vocab-parallel
 * rows copied); every weight_mat then has the rank's shape. */
int weights_load_tp(model_weights *w, backend *be, const model_config *c, const char *dir,
                    uint64_t dummy_seed, const tp_shard *tp, char *err, size_t errlen);
void weights_free(model_weights *w);

#endif
