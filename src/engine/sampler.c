/* sampler — see sampler.h. */
#include "engine/sampler.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- random stream -------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void sampler_rng_seed(sampler_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

double sampler_rng_uniform(sampler_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return (double)(result >> 11) * 0x1.0p-53;
}

/* ---- validation ------------------------------------------------------------- */

void engine_sampling_init(engine_sampling *s) {
    memset(s, 0, sizeof *s);
    s->temperature = 1.0f;
    s->top_p = 1.0f;
    s->top_k = 0;
    s->repetition_penalty = 1.0f;
    s->logprobs = -1;
    s->prompt_logprobs = -1;
}

int sampler_validate(const engine_sampling *s, char *err, size_t errlen) {
#define BAD(...)                                                                                   \
    do {                                                                                           \
        snprintf(err, errlen, __VA_ARGS__);                                                        \
        return -EINVAL;                                                                            \
    } while (0)
    if (!(s->temperature >= 0.0f) || !isfinite(s->temperature))
        BAD("temperature must be a finite number >= 0 (0 = greedy), got %g",
            (double)s->temperature);
    if (!(s->top_p > 0.0f && s->top_p <= 1.0f))
        BAD("top_p must be in (0, 1], got %g", (double)s->top_p);
    if (s->top_k < -1) BAD("top_k must be -1 or 0 (disabled) or at least 1, got %d", s->top_k);
    if (!(s->min_p >= 0.0f && s->min_p <= 1.0f))
        BAD("min_p must be in [0, 1], got %g", (double)s->min_p);
    if (!(s->repetition_penalty > 0.0f) || !isfinite(s->repetition_penalty))
        BAD("repetition_penalty must be > 0 (1 = off), got %g", (double)s->repetition_penalty);
    if (!(s->presence_penalty >= -2.0f && s->presence_penalty <= 2.0f))
        BAD("presence_penalty must be in [-2, 2], got %g", (double)s->presence_penalty);
    if (!(s->frequency_penalty >= -2.0f && s->frequency_penalty <= 2.0f))
        BAD("frequency_penalty must be in [-2, 2], got %g", (double)s->frequency_penalty);
    if (s->logprobs < -1 || s->logprobs > ENGINE_MAX_TOP_LOGPROBS)
        BAD("logprobs must be between 0 and %d, got %d", ENGINE_MAX_TOP_LOGPROBS, s->logprobs);
    if (s->prompt_logprobs < -1 || s->prompt_logprobs > ENGINE_MAX_TOP_LOGPROBS)
        BAD("prompt_logprobs must be between 0 and %d, got %d", ENGINE_MAX_TOP_LOGPROBS,
            s->prompt_logprobs);
    return 0;
#undef BAD
}

/* ---- sampling ---------------------------------------------------------------- */

static void apply_penalties(const engine_sampling *s, float *l, int vocab, const int32_t *tokens,
                            int n_tokens, int n_prompt) {
    int rep = s->repetition_penalty != 1.0f;
    int pres = s->presence_penalty != 0.0f, freq = s->frequency_penalty != 0.0f;
    if (!rep && !pres && !freq) return;
    /* Count output occurrences; mark prompt occurrences.  Sparse: only the
     * tokens present are touched, in a small open-addressing table. */
    size_t cap = 64;
    while (cap < (size_t)n_tokens * 2)
        cap <<= 1;
    int32_t *key = malloc(cap * sizeof *key);
    int32_t *cnt = calloc(cap, sizeof *cnt); /* output count */
    uint8_t *inp = calloc(cap, sizeof *inp); /* seen in prompt */
    if (!key || !cnt || !inp) goto out;
    memset(key, 0xff, cap * sizeof *key);
    for (int i = 0; i < n_tokens; i++) {
        int32_t t = tokens[i];
        if (t < 0 || t >= vocab) continue;
        size_t h = ((uint32_t)t * 2654435761u) & (cap - 1);
        while (key[h] != -1 && key[h] != t)
            h = (h + 1) & (cap - 1);
        key[h] = t;
        if (i < n_prompt)
            inp[h] = 1;
        else
            cnt[h]++;
    }
    for (size_t h = 0; h < cap; h++) {
        if (key[h] == -1) continue;
        float *x = &l[key[h]];
        if (rep) *x = *x > 0 ? *x / s->repetition_penalty : *x * s->repetition_penalty;
        if (cnt[h] > 0) *x -= s->presence_penalty + s->frequency_penalty * (float)cnt[h];
    }
out:
    free(key);
    free(cnt);
    free(inp);
}

static int32_t argmax(const float *l, int vocab) {
    int32_t best = 0;
    for (int i = 1; i < vocab; i++)
        if (l[i] > l[best]) best = i;
    return best;
}

typedef struct cand {
    float logit;
    int32_t id;
} cand;

static int cand_desc(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return x->id - y->id;
}

int32_t sampler_sample(const engine_sampling *s, float *l, int vocab, const int32_t *tokens,
                       int n_tokens, int n_prompt, sampler_rng *rng) {
    apply_penalties(s, l, vocab, tokens, n_tokens, n_prompt);
    if (s->temperature < 1e-5f) return argmax(l, vocab);
    float inv_t = 1.0f / s->temperature;
    float mx = -INFINITY;
    for (int i = 0; i < vocab; i++) {
        l[i] *= inv_t;
        if (l[i] > mx) mx = l[i];
    }
    int k = s->top_k > 0 && s->top_k < vocab ? s->top_k : vocab;
    int filter = k < vocab || s->top_p < 1.0f || s->min_p > 0.0f;
    if (!filter) { /* plain softmax draw over the whole vocabulary, in id order */
        double sum = 0;
        for (int i = 0; i < vocab; i++)
            sum += exp((double)(l[i] - mx));
        double u = sampler_rng_uniform(rng) * sum, acc = 0;
        for (int i = 0; i < vocab; i++) {
            acc += exp((double)(l[i] - mx));
            if (acc > u) return i;
        }
        return argmax(l, vocab);
    }
    /* Candidates above min_p (relative to the max), sorted descending. */
    float floor_logit = s->min_p > 0.0f ? mx + logf(s->min_p) : -INFINITY;
    cand *c = malloc((size_t)vocab * sizeof *c);
    if (!c) return argmax(l, vocab);
    int n = 0;
    for (int i = 0; i < vocab; i++)
        if (l[i] >= floor_logit) c[n++] = (cand){l[i], i};
    qsort(c, (size_t)n, sizeof *c, cand_desc);
    if (n > k) n = k;
    double total = 0;
    double *p = malloc((size_t)n * sizeof *p);
    if (!p) {
        int32_t id = c[0].id;
        free(c);
        return id;
    }
    for (int i = 0; i < n; i++)
        total += (p[i] = exp((double)(c[i].logit - mx)));
    if (s->top_p < 1.0f) { /* smallest prefix with mass >= top_p (at least one) */
        double acc = 0, want = (double)s->top_p * total;
        int m = 0;
        while (m < n) {
            acc += p[m++];
            if (acc >= want) break;
        }
        n = m;
        total = acc;
    }
    double u = sampler_rng_uniform(rng) * total, acc = 0;
    int32_t id = c[n - 1].id;
    for (int i = 0; i < n; i++) {
        acc += p[i];
        if (acc > u) {
            id = c[i].id;
            break;
        }
    }
    free(p);
    free(c);
    return id;
}

void sampler_logprobs(const float *l, int vocab, int32_t chosen, int top_n, float *chosen_lp,
                      int32_t *top_ids, float *top_lps, int *n_top) {
    float mx = -INFINITY;
    for (int i = 0; i < vocab; i++)
        if (l[i] > mx) mx = l[i];
    double sum = 0;
    for (int i = 0; i < vocab; i++)
        sum += exp((double)(l[i] - mx));
    float lse = mx + (float)log(sum);
    if (chosen_lp) *chosen_lp = chosen >= 0 && chosen < vocab ? l[chosen] - lse : -INFINITY;
    if (top_n > ENGINE_MAX_TOP_LOGPROBS) top_n = ENGINE_MAX_TOP_LOGPROBS;
    if (top_n > vocab) top_n = vocab;
    int n = 0; /* insertion into a sorted array of at most top_n */
    for (int i = 0; i < vocab && top_n > 0; i++) {
        if (n == top_n && l[i] <= l[top_ids[n - 1]]) continue;
        int j = n < top_n ? n++ : n - 1;
        while (j > 0 && l[top_ids[j - 1]] < l[i]) {
            top_ids[j] = top_ids[j - 1];
            j--;
        }
        top_ids[j] = i;
    }
    for (int i = 0; i < n; i++)
        top_lps[i] = l[top_ids[i]] - lse;
    if (n_top) *n_top = n;
}
