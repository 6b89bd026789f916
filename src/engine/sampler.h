/*
 * sampler — turns one row of logits into the next token, as vLLM does:
 * penalties (repetition on prompt + output, presence and frequency on the
 * output), then temperature (0 = greedy, ties to the lowest id), top-k, top-p
 * and min-p, then a draw from the request's own random stream (xoshiro256**,
 * seeded per request: the same seed gives the same tokens).  Logprobs are
 * those of the raw model output (vLLM's default), computed apart.
 */
#ifndef DISAGG_ENGINE_SAMPLER_H
#define DISAGG_ENGINE_SAMPLER_H

#include "engine/engine.h"

#include <stddef.h>
#include <stdint.h>

typedef struct sampler_rng {
    uint64_t s[4]; /* xoshiro256** state */
} sampler_rng;

void sampler_rng_seed(sampler_rng *r, uint64_t seed);
/* Uniform double in [0, 1). */
double sampler_rng_uniform(sampler_rng *r);

/* Checks the request's sampling values; err names the bad field and the
 * accepted range.  0 or -EINVAL. */
int sampler_validate(const engine_sampling *s, char *err, size_t errlen);

/* The next token from logits (vocab), which are overwritten (scratch).
 * tokens: the sequence so far (n_tokens, of which n_prompt are the prompt),
 * for the penalties. */
int32_t sampler_sample(const engine_sampling *s, float *logits, int vocab, const int32_t *tokens,
                       int n_tokens, int n_prompt, sampler_rng *rng);

/* Log-probability of `chosen` under log_softmax(logits), and the top_n most
 * likely tokens (descending; ties by lower id).  top_n <= ENGINE_MAX_TOP_LOGPROBS. */
void sampler_logprobs(const float *logits, int vocab, int32_t chosen, int top_n, float *chosen_lp,
                      int32_t *top_ids, float *top_lps, int *n_top);

#endif
