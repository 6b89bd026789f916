/*
 * quant — quantized checkpoints and load-time quantization, as vLLM reads them.
 *
 * config.json's quantization_config says how the checkpoint's linear layers are stored; the
 * accepted ones are FP8 (OCP e4m3 weights with f32 scales):
 *   quant_method "fp8"                 weight_block_size [bn, bk] (Qwen3-*-FP8, DeepSeek):
 *                                      <layer>.weight_scale_inv, one per bn x bk block;
 *                                      without it per tensor: <layer>.weight_scale
 *   quant_method "compressed-tensors"  (llm-compressor FP8 / FP8_DYNAMIC): every config group's
 *                                      weights num_bits 8, type float, strategy tensor, channel
 *                                      or block; <layer>.weight_scale (shape [1], [N, 1] or
 *                                      the block grid)
 * with activation_scheme dynamic or static (an input_scale tensor per layer).  The scale's
 * granularity is read from the scale tensor's shape, so a layer the config leaves unquantized
 * (lm_head, modules_to_not_convert, ignore) simply is bf16/f16/f32 in the file.  Activations
 * are not quantized by disagg (weight-only compute; static input_scale tensors are accepted and
 * not used): a static scheme's checkpoint computes with the dynamic range of each token, which
 * is at least as accurate.
 * Everything else (awq, gptq, bitsandbytes, nvfp4 / modelopt, int8 w8a8, mxfp4, ...) is
 * refused at load, naming the method and listing the accepted ones (QUANT_ACCEPTED).
 *
 * --quantization fp8 on an unquantized checkpoint quantizes each linear layer's weight at load
 * (vLLM's online FP8): one scale per output channel, amax / 448, round to nearest even.
 */
#ifndef DISAGG_MODEL_QUANT_H
#define DISAGG_MODEL_QUANT_H

#include <stddef.h>
#include <stdint.h>

struct json_t;

#define QUANT_ACCEPTED                                                                             \
    "quant_method \"fp8\" (per tensor, or weight_block_size blocks), \"compressed-tensors\" "      \
    "FP8 (float, 8 bits: strategy tensor, channel or block)"
#define QUANT_E4M3_MAX 448.0f

typedef enum quant_kind {
    QUANT_NONE = 0,      /* unquantized checkpoint */
    QUANT_FP8 = 1,       /* quant_method "fp8" */
    QUANT_FP8_CT = 2,    /* compressed-tensors FP8 */
    QUANT_FP8_ONLINE = 3 /* --quantization fp8 on an unquantized checkpoint */
} quant_kind;

typedef struct model_quant {
    quant_kind kind;
    int block_n, block_k;     /* QUANT_FP8 with weight_block_size; else 0 */
    int act_static;           /* activation_scheme "static" (input_scale tensors present) */
    const char *scale_suffix; /* "weight_scale_inv" (fp8 blocks) or "weight_scale" */
    int ct_strategy;          /* QUANT_FP8_CT: the weights' strategy (QUANT_CT_*) */
} model_quant;

/* compressed-tensors weight strategies (what --load-format dummy quantizes its random
 * weights in; a real checkpoint's scale tensors say it by their shape) */
enum { QUANT_CT_CHANNEL = 0, QUANT_CT_TENSOR = 1, QUANT_CT_BLOCK = 2 };

/* Reads config.json's quantization_config (qc; NULL or JSON null: QUANT_NONE).  where names
 * the file for errors.  0, or -EINVAL with err naming what is not accepted. */
int quant_parse(model_quant *q, const struct json_t *qc, const char *where, char *err,
                size_t errlen);
const char *quant_kind_name(quant_kind k); /* "none", "fp8", "compressed-tensors", ... */

/* f32 -> e4m3fn, round to nearest even, saturating at +-448 (NaN stays NaN). */
uint8_t quant_f32_to_e4m3(float x);
/* Quantizes a matrix (N, K) given as f32 rows: one scale per block_n x block_k block
 * (amax / 448; an all-zero block gets scale 1), q = e4m3(w / scale).  scales has
 * ceil(N / block_n) * ceil(K / block_k) entries (row-major grid). */
void quant_fp8_matrix(uint8_t *q, float *scales, const float *w, int N, int K, int block_n,
                      int block_k);

#endif
