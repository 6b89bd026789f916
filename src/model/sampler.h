/*
 * sampler — turns a row of logits into the next token of one request: repetition,
 * presence and frequency penalties, then greedy (temperature 0) or temperature + top-k +
 * top-p + min-p sampling with a per-request seeded generator (same seed, same logits ->
 * same tokens), logprobs of the chosen and the top-N tokens, and stop token ids.
 * Semantics follow vLLM's SamplingParams: repetition_penalty applies to prompt and output
 * tokens, presence/frequency penalties to output tokens; logprobs are those of the raw
 * model distribution (before penalties and temperature).
 */
#ifndef DISAGG_MODEL_SAMPLER_H
#define DISAGG_MODEL_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

#define SAMPLER_MAX_LOGPROBS 20
#define SAMPLER_MAX_STOP     64

typedef struct sampler_params {
    float temperature;                  /* 0 = greedy; accepted [0, 100] */
    int top_k;                          /* 0 or -1 = off; else >= 1 */
    float top_p;                        /* (0, 1]; 1 = off */
    float min_p;                        /* [0, 1]; 0 = off */
    float repetition_penalty;           /* (0, 100]; 1 = off */
    float presence_penalty;             /* [-2, 2] */
    float frequency_penalty;            /* [-2, 2] */
    int has_seed;                       /* seed given: reproducible */
    uint64_t seed;                      /* the seed when has_seed */
    int logprobs;                       /* top-N logprobs to report, 0..SAMPLER_MAX_LOGPROBS */
    int32_t stop_ids[SAMPLER_MAX_STOP]; /* token ids that end the request */
    int n_stop;                         /* entries of stop_ids */
    /* Logit processors (vLLM's order: allowed_token_ids, bad_words, logit_bias, then the
     * penalties), all on the logits after the raw logprobs are taken.  The arrays are the
     * caller's; sampler_init copies them. */
    const int32_t *bias_ids;  /* logit_bias: (n_bias) token ids ... */
    const float *bias;        /* ... and what is added to their logits, [-100, 100] */
    int n_bias;               /* 0 = off */
    const int32_t *allowed;   /* allowed_token_ids: (n_allowed) the only tokens that may come */
    int n_allowed;            /* 0 = off (an empty list is refused by the API layer) */
    const int32_t *bad_ids;   /* bad_words as token sequences, concatenated: (sum bad_lens) */
    const int32_t *bad_lens;  /* (n_bad) length of each sequence, >= 1: its last token is */
    int n_bad;                /* banned when the output so far ends with the rest of it */
} sampler_params;

#define SAMPLER_MAX_BAD_TOKENS 1024 /* all bad-word tokens of one request (vLLM's limit) */

typedef struct sample_result {
    int32_t token;                            /* chosen token */
    float logprob;                            /* its log-probability (raw distribution) */
    int is_stop;                              /* token is a stop id */
    int n_top;                                /* entries below (= params.logprobs) */
    int32_t top_ids[SAMPLER_MAX_LOGPROBS];    /* most likely tokens, best first */
    float top_logprobs[SAMPLER_MAX_LOGPROBS]; /* their log-probabilities */
} sample_result;

typedef struct sampler sampler;

/* Greedy, no penalties, no logprobs, no stops. */
void sampler_params_default(sampler_params *p);
/* 0 if valid; else -EINVAL and err names the bad value and the accepted range. */
int sampler_params_check(const sampler_params *p, int vocab_size, char *err, size_t errlen);

/* prompt (n_prompt) feeds the repetition penalty.  NULL on invalid params (err set). */
sampler *sampler_init(const sampler_params *p, int vocab_size, const int32_t *prompt, int n_prompt,
                      char *err, size_t errlen);
void sampler_free(sampler *s);
/* Picks the next token from logits (vocab_size; modified in place) and records it as
 * output for the penalties. */
int sampler_sample(sampler *s, float *logits, sample_result *out);
/* sampler_sample with a constraint: only tokens whose bit is set in allow (bit i of word
 * i / 32, vocab_size bits) may be chosen (they get -inf after the penalties); logprobs
 * stay those of the raw distribution.  allow must admit at least one token; NULL: none. */
int sampler_sample_masked(sampler *s, float *logits, const uint32_t *allow, sample_result *out);
/* sampler_sample_masked for logits the constraint was already applied to (on the device:
 * backend_token_bitmask) of a request that wants no logprobs (params.logprobs 0): the same
 * token for the same logits and seed, without the raw log-softmax pass and its copy of the
 * row (out->logprob is 0: the raw distribution is gone anyway).  With logprobs > 0 it is
 * sampler_sample_masked. */
int sampler_sample_premasked(sampler *s, float *logits, const uint32_t *allow, sample_result *out);
/* 1 when the next token is the plain argmax of the raw logits: greedy (temperature 0 or
 * top_k 1), no penalties, no logit processors and no logprobs — the device may pick it (backend_argmax: the
 * largest logit, lowest id on ties, as here) and the logits need not be downloaded. */
int sampler_plain_greedy(const sampler *s);
/* Records a token produced elsewhere (e.g. the first token from a prefill instance). */
void sampler_accept(sampler *s, int32_t token);
/* Records token as sampler_sample would have chosen it elsewhere with the same
 * parameters, seed and logits (a prefill instance's first token): the generator
 * advances past the one draw sampler_sample makes when it samples (none when
 * greedy), so the next sampler_sample continues that sampler's stream exactly. */
void sampler_accept_drawn(sampler *s, int32_t token);

#endif
