/*
 * sampler — see sampler.h.  Token counts live in a small open-addressing hash map (a
 * request sees few distinct tokens), so a sampler costs O(tokens seen), not O(vocab).
 */
#include "model/sampler.h"

#include "base/clock.h"
#include "base/rng.h"

#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct tok_count {
    int32_t token;  /* -1 = empty slot */
    int32_t out;    /* occurrences in the output */
    int32_t prompt; /* 1 if in the prompt */
} tok_count;

struct sampler {
    sampler_params p;  /* validated parameters */
    int vocab;         /* logits per row */
    rng_state rng;     /* xoshiro256** state */
    tok_count *counts; /* (cap) hash map */
    int cap, used;     /* slots, used slots */
    int32_t *idx;      /* (vocab) candidate ids scratch */
    float *raw;        /* (vocab) copy of the raw logits (for logprobs) */
    float *prob;       /* (vocab) relative probabilities scratch (top-p) */
    /* the logit processors' own copies (the params' pointers point here) */
    int32_t *bias_ids;
    float *bias;
    uint32_t *allowed; /* (vocab / 32) bit mask, NULL = all */
    int32_t *bad_ids, *bad_lens;
    int32_t *recent; /* the last bad_ctx output tokens (a ring), for multi-token bad words */
    int bad_ctx, n_recent;
};

/* ---- params ----------------------------------------------------------------- */

void sampler_params_default(sampler_params *p) {
    memset(p, 0, sizeof *p);
    p->temperature = 0.0f;
    p->top_p = 1.0f;
    p->repetition_penalty = 1.0f;
}

int sampler_params_check(const sampler_params *p, int vocab, char *err, size_t errlen) {
#define BAD(...)                                                                                   \
    do {                                                                                           \
        snprintf(err, errlen, __VA_ARGS__);                                                        \
        return -EINVAL;                                                                            \
    } while (0)
    if (!(p->temperature >= 0.0f && p->temperature <= 100.0f))
        BAD("temperature %g is invalid; accepted: 0 (greedy) to 100", (double)p->temperature);
    if (p->top_k < -1 || p->top_k > vocab)
        BAD("top_k %d is invalid; accepted: -1 or 0 (off), or 1 to %d", p->top_k, vocab);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        BAD("top_p %g is invalid; accepted: (0, 1]", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        BAD("min_p %g is invalid; accepted: [0, 1]", (double)p->min_p);
    if (!(p->repetition_penalty > 0.0f && p->repetition_penalty <= 100.0f))
        BAD("repetition_penalty %g is invalid; accepted: (0, 100], 1 = off",
            (double)p->repetition_penalty);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        BAD("presence_penalty %g is invalid; accepted: [-2, 2]", (double)p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        BAD("frequency_penalty %g is invalid; accepted: [-2, 2]", (double)p->frequency_penalty);
    if (p->logprobs < 0 || p->logprobs > SAMPLER_MAX_LOGPROBS)
        BAD("logprobs %d is invalid; accepted: 0 to %d", p->logprobs, SAMPLER_MAX_LOGPROBS);
    if (p->n_stop < 0 || p->n_stop > SAMPLER_MAX_STOP)
        BAD("%d stop token ids; accepted: at most %d", p->n_stop, SAMPLER_MAX_STOP);
    for (int i = 0; i < p->n_stop; i++)
        if (p->stop_ids[i] < 0 || p->stop_ids[i] >= vocab)
            BAD("stop token id %d is outside the vocabulary [0, %d)", p->stop_ids[i], vocab);
    if (p->n_bias < 0 || (p->n_bias && (!p->bias_ids || !p->bias)))
        BAD("logit_bias: %d entries without their arrays", p->n_bias);
    for (int i = 0; i < p->n_bias; i++) {
        if (p->bias_ids[i] < 0 || p->bias_ids[i] >= vocab)
            BAD("logit_bias: token id %d is outside the vocabulary; accepted: 0 to %d",
                p->bias_ids[i], vocab - 1);
        if (!(p->bias[i] >= -100.0f && p->bias[i] <= 100.0f))
            BAD("logit_bias: bias %g of token %d is invalid; accepted: -100 to 100",
                (double)p->bias[i], p->bias_ids[i]);
    }
    if (p->n_allowed < 0 || (p->n_allowed && !p->allowed))
        BAD("allowed_token_ids: %d entries without their array", p->n_allowed);
    for (int i = 0; i < p->n_allowed; i++)
        if (p->allowed[i] < 0 || p->allowed[i] >= vocab)
            BAD("allowed_token_ids: token id %d is outside the vocabulary; accepted: 0 to %d",
                p->allowed[i], vocab - 1);
    if (p->n_bad < 0 || (p->n_bad && (!p->bad_ids || !p->bad_lens)))
        BAD("bad_words: %d sequences without their arrays", p->n_bad);
    long total = 0;
    for (int i = 0; i < p->n_bad; i++) {
        if (p->bad_lens[i] < 1) BAD("bad_words: sequence %d is empty", i);
        total += p->bad_lens[i];
        if (total > SAMPLER_MAX_BAD_TOKENS)
            BAD("bad_words: more than %d tokens in all; accepted: at most %d",
                SAMPLER_MAX_BAD_TOKENS, SAMPLER_MAX_BAD_TOKENS);
    }
    for (long i = 0; i < total; i++)
        if (p->bad_ids[i] < 0 || p->bad_ids[i] >= vocab)
            BAD("bad_words: token id %d is outside the vocabulary; accepted: 0 to %d",
                p->bad_ids[i], vocab - 1);
    return 0;
#undef BAD
}

/* ---- counts ------------------------------------------------------------------- */

static tok_count *count_slot(sampler *s, int32_t tok, int insert) {
    if (insert && (s->used + 1) * 2 > s->cap) {
        int ncap = s->cap ? s->cap * 2 : 64;
        tok_count *nc = malloc((size_t)ncap * sizeof *nc);
        if (!nc) return NULL;
        for (int i = 0; i < ncap; i++)
            nc[i] = (tok_count){-1, 0, 0};
        for (int i = 0; i < s->cap; i++)
            if (s->counts[i].token >= 0) {
                uint32_t h = ((uint32_t)s->counts[i].token * 2654435761u) & (uint32_t)(ncap - 1);
                while (nc[h].token >= 0)
                    h = (h + 1) & (uint32_t)(ncap - 1);
                nc[h] = s->counts[i];
            }
        free(s->counts);
        s->counts = nc;
        s->cap = ncap;
    }
    if (!s->cap) return NULL;
    uint32_t h = ((uint32_t)tok * 2654435761u) & (uint32_t)(s->cap - 1);
    while (s->counts[h].token >= 0) {
        if (s->counts[h].token == tok) return &s->counts[h];
        h = (h + 1) & (uint32_t)(s->cap - 1);
    }
    if (!insert) return NULL;
    s->counts[h] = (tok_count){tok, 0, 0};
    s->used++;
    return &s->counts[h];
}

int sampler_plain_greedy(const sampler *s) {
    const sampler_params *p = &s->p;
    return (p->temperature == 0.0f || p->top_k == 1) && p->repetition_penalty == 1.0f &&
           p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f && p->logprobs == 0 &&
           p->n_bias == 0 && p->n_allowed == 0 && p->n_bad == 0;
}

void sampler_accept(sampler *s, int32_t token) {
    tok_count *c = count_slot(s, token, 1);
    if (c) c->out++;
    if (s->bad_ctx) s->recent[s->n_recent++ % s->bad_ctx] = token;
}

void sampler_accept_drawn(sampler *s, int32_t token) {
    if (!(s->p.temperature == 0.0f || s->p.top_k == 1))
        (void)rng_uniform(&s->rng); /* sampler_sample's one draw per sampled token */
    sampler_accept(s, token);
}

/* ---- lifecycle ---------------------------------------------------------------- */

/* The logit processors' arrays into the sampler (s->p's pointers then point at them). */
static int copy_processors(sampler *s, const sampler_params *p) {
    int n_bad_tok = 0, longest = 0;
    for (int i = 0; i < p->n_bad; i++) {
        n_bad_tok += p->bad_lens[i];
        if (p->bad_lens[i] > longest) longest = p->bad_lens[i];
    }
    if (p->n_bias) {
        s->bias_ids = malloc((size_t)p->n_bias * sizeof *s->bias_ids);
        s->bias = malloc((size_t)p->n_bias * sizeof *s->bias);
        if (!s->bias_ids || !s->bias) return -ENOMEM;
        memcpy(s->bias_ids, p->bias_ids, (size_t)p->n_bias * sizeof *s->bias_ids);
        memcpy(s->bias, p->bias, (size_t)p->n_bias * sizeof *s->bias);
    }
    if (p->n_allowed) {
        s->allowed = calloc((size_t)(s->vocab + 31) / 32, sizeof *s->allowed);
        if (!s->allowed) return -ENOMEM;
        for (int i = 0; i < p->n_allowed; i++)
            s->allowed[p->allowed[i] >> 5] |= 1u << (p->allowed[i] & 31);
    }
    if (p->n_bad) {
        s->bad_ids = malloc((size_t)n_bad_tok * sizeof *s->bad_ids);
        s->bad_lens = malloc((size_t)p->n_bad * sizeof *s->bad_lens);
        s->bad_ctx = longest - 1;
        s->recent = s->bad_ctx ? malloc((size_t)s->bad_ctx * sizeof *s->recent) : NULL;
        if (!s->bad_ids || !s->bad_lens || (s->bad_ctx && !s->recent)) return -ENOMEM;
        memcpy(s->bad_ids, p->bad_ids, (size_t)n_bad_tok * sizeof *s->bad_ids);
        memcpy(s->bad_lens, p->bad_lens, (size_t)p->n_bad * sizeof *s->bad_lens);
    }
    s->p.bias_ids = s->bias_ids, s->p.bias = s->bias;
    s->p.allowed = NULL; /* the mask stands for the list */
    s->p.bad_ids = s->bad_ids, s->p.bad_lens = s->bad_lens;
    return 0;
}

/* The i-th most recent output token (i = 0: the last), or -1 before the output has it. */
static int32_t recent_token(const sampler *s, int i) {
    if (i >= s->n_recent || i >= s->bad_ctx) return -1;
    return s->recent[(s->n_recent - 1 - i) % s->bad_ctx];
}

/* allowed_token_ids, bad_words, logit_bias on the logits (vLLM's order and semantics: a
 * bad word's last token is banned when the output ends with its other tokens; a one-token
 * bad word always). */
static void apply_processors(const sampler *s, float *logits) {
    const sampler_params *p = &s->p;
    int V = s->vocab;
    if (s->allowed)
        for (int i = 0; i < V; i++)
            if (!(s->allowed[i >> 5] >> (i & 31) & 1u)) logits[i] = -INFINITY;
    for (int b = 0, off = 0; b < p->n_bad; off += p->bad_lens[b++]) {
        int len = p->bad_lens[b], match = 1;
        for (int j = 0; j < len - 1 && match; j++) /* bad[off + len - 2 - j] vs recent j */
            match = recent_token(s, j) == p->bad_ids[off + len - 2 - j];
        if (match) logits[p->bad_ids[off + len - 1]] = -INFINITY;
    }
    for (int i = 0; i < p->n_bias; i++)
        logits[p->bias_ids[i]] += p->bias[i];
}

sampler *sampler_init(const sampler_params *p, int vocab, const int32_t *prompt, int n_prompt,
                      char *err, size_t errlen) {
    if (sampler_params_check(p, vocab, err, errlen)) return NULL;
    sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->p = *p;
    s->vocab = vocab;
    s->idx = malloc((size_t)vocab * sizeof *s->idx);
    s->raw = malloc((size_t)vocab * sizeof *s->raw);
    s->prob = malloc((size_t)vocab * sizeof *s->prob);
    if (!s->idx || !s->raw || !s->prob) {
        sampler_free(s);
        return NULL;
    }
    if (copy_processors(s, p)) {
        sampler_free(s);
        return NULL;
    }
    static atomic_uint_fast64_t unseeded;
    uint64_t x = p->has_seed ? p->seed : clock_now_ns() ^ (atomic_fetch_add(&unseeded, 1) << 32);
    rng_seed(&s->rng, x);
    if (p->repetition_penalty != 1.0f)
        for (int i = 0; i < n_prompt; i++) {
            tok_count *c = count_slot(s, prompt[i], 1);
            if (c) c->prompt = 1;
        }
    return s;
}

void sampler_free(sampler *s) {
    if (!s) return;
    free(s->counts);
    free(s->idx);
    free(s->raw);
    free(s->prob);
    free(s->bias_ids);
    free(s->bias);
    free(s->allowed);
    free(s->bad_ids);
    free(s->bad_lens);
    free(s->recent);
    free(s);
}

/* ---- sampling ----------------------------------------------------------------- */

static _Thread_local const float *tl_sort_logits;

static int cmp_desc(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    float lx = tl_sort_logits[x], ly = tl_sort_logits[y];
    if (lx > ly) return -1;
    if (lx < ly) return 1;
    return x < y ? -1 : x > y;
}

/* Top n ids of v (n small), best first, ties to the lower id. */
static void top_n(const float *v, int len, int n, int32_t *ids) {
    int have = 0;
    for (int i = 0; i < len; i++) {
        if (have == n && !(v[i] > v[ids[n - 1]])) continue;
        int j = have < n ? have++ : n - 1;
        while (j > 0 && v[i] > v[ids[j - 1]]) {
            ids[j] = ids[j - 1];
            j--;
        }
        ids[j] = i;
    }
}

/* want_lp: 1 computes the raw distribution's logprobs (the chosen token's, the top N); 0
 * leaves out->logprob 0 (sampler_sample_premasked: the caller wants none) */
static int sample_impl(sampler *s, float *logits, const uint32_t *allow, sample_result *out,
                       int want_lp);

int sampler_sample(sampler *s, float *logits, sample_result *out) {
    return sample_impl(s, logits, NULL, out, 1);
}

int sampler_sample_masked(sampler *s, float *logits, const uint32_t *allow, sample_result *out) {
    return sample_impl(s, logits, allow, out, 1);
}

int sampler_sample_premasked(sampler *s, float *logits, const uint32_t *allow, sample_result *out) {
    return sample_impl(s, logits, allow, out, s->p.logprobs > 0);
}

static int sample_impl(sampler *s, float *logits, const uint32_t *allow, sample_result *out,
                       int want_lp) {
    const sampler_params *p = &s->p;
    int V = s->vocab;
    memset(out, 0, sizeof *out);
    double lse = 0;
    if (want_lp) {
        /* raw log-softmax normaliser for logprobs */
        float mx = logits[0];
        for (int i = 1; i < V; i++)
            if (logits[i] > mx) mx = logits[i];
        double z = 0;
        for (int i = 0; i < V; i++)
            z += (double)expf(logits[i] - mx);
        lse = (double)mx + log(z);
        if (p->logprobs > 0) {
            top_n(logits, V, p->logprobs, out->top_ids);
            out->n_top = p->logprobs;
            for (int i = 0; i < out->n_top; i++)
                out->top_logprobs[i] = (float)(logits[out->top_ids[i]] - lse);
        }
        memcpy(s->raw, logits, (size_t)V * sizeof *logits);
    }
    apply_processors(s, logits);
    /* penalties on the tokens seen */
    for (int i = 0; i < s->cap; i++) {
        tok_count *c = &s->counts[i];
        if (c->token < 0) continue;
        float *l = &logits[c->token];
        float raw = *l;
        if (p->repetition_penalty != 1.0f && (c->prompt || c->out))
            *l = raw > 0 ? raw / p->repetition_penalty : raw * p->repetition_penalty;
        if (c->out) *l -= p->frequency_penalty * (float)c->out + p->presence_penalty;
    }
    if (allow) /* the constraint, after the logprobs (raw) and the penalties */
        for (int w = 0; w < (V + 31) / 32; w++) {
            uint32_t m = allow[w];
            if (m == 0xFFFFFFFFu) continue;
            int base = w * 32, end = base + 32 < V ? base + 32 : V;
            if (!m) /* the common case of a narrow mask: a plain store loop */
                for (int i = base; i < end; i++)
                    logits[i] = -INFINITY;
            else /* only the disallowed ones */
                for (uint32_t z = ~m; z; z &= z - 1)
                    if (base + __builtin_ctz(z) < V) logits[base + __builtin_ctz(z)] = -INFINITY;
        }
    int32_t tok;
    if (p->temperature == 0.0f || p->top_k == 1) {
        tok = 0;
        for (int i = 1; i < V; i++)
            if (logits[i] > logits[tok]) tok = i;
    } else {
        int n = V;
        int32_t *idx = s->idx;
        double full_sum = 0; /* mass of the whole vocabulary when top-p runs without top-k */
        for (int i = 0; i < V; i++)
            idx[i] = i;
        tl_sort_logits = logits;
        int use_k = p->top_k > 0 && p->top_k < V;
        if (use_k && p->top_k <= 64) {
            n = p->top_k;
            top_n(logits, V, n, idx); /* O(V k), best first */
        } else if (use_k || p->top_p < 1.0f) {
            /* top-k (large k) or top-p without sorting the vocabulary: bucket the tokens by
             * the binary exponent of their relative probability, walk the buckets from the
             * best until they hold k tokens (top-k) or top_p of the mass (top-p), and sort only
             * the tokens in those buckets: the cut falls inside the last one */
            float best = logits[0];
            for (int i = 1; i < V; i++)
                if (logits[i] > best) best = logits[i];
            double mass[256] = {0};
            int count[256] = {0};
            float *pr = s->prob;
            for (int i = 0; i < V; i++) {
                pr[i] = expf((logits[i] - best) / p->temperature);
                uint32_t u;
                memcpy(&u, &pr[i], 4);
                mass[u >> 23] += pr[i]; /* exponent bits (probabilities are >= 0) */
                count[u >> 23]++;
                if (!use_k) full_sum += pr[i];
            }
            double want = use_k ? p->top_k : p->top_p * full_sum, cum = 0;
            int e = 255;
            while (e > 0 && cum + (use_k ? count[e] : mass[e]) < want)
                cum += use_k ? count[e--] : mass[e--];
            n = 0;
            for (int i = 0; i < V; i++) {
                uint32_t u;
                memcpy(&u, &pr[i], 4);
                if ((int)(u >> 23) >= e) idx[n++] = i;
            }
            qsort(idx, (size_t)n, sizeof *idx, cmp_desc);
            if (use_k && n > p->top_k) n = p->top_k;
        }
        /* probabilities of the candidates at this temperature (idx[0] is the max when sorted) */
        float cmx = logits[idx[0]];
        for (int i = 1; i < n; i++)
            if (logits[idx[i]] > cmx) cmx = logits[idx[i]];
        double sum = 0;
        float *pr = logits; /* reuse logits as probabilities, indexed by token */
        for (int i = 0; i < n; i++) {
            int t = idx[i];
            pr[t] = expf((logits[t] - cmx) / p->temperature);
            sum += pr[t];
        }
        if (p->top_p < 1.0f) { /* smallest prefix of the sorted candidates reaching top_p */
            double cum = 0;
            int keep = 0;
            while (keep < n) {
                cum += pr[idx[keep]] / (full_sum > 0 ? full_sum : sum);
                keep++;
                if (cum >= p->top_p) break;
            }
            n = keep;
        }
        if (p->min_p > 0.0f) { /* the max has probability weight 1 (exp(0)) */
            int w = 0;
            for (int i = 0; i < n; i++)
                if (pr[idx[i]] >= p->min_p) idx[w++] = idx[i];
            n = w;
        }
        double tot = 0;
        for (int i = 0; i < n; i++)
            tot += pr[idx[i]];
        double u = rng_uniform(&s->rng) * tot, acc = 0;
        tok = idx[n - 1];
        for (int i = 0; i < n; i++) {
            acc += pr[idx[i]];
            if (u < acc) {
                tok = idx[i];
                break;
            }
        }
    }
    if (allow && !(allow[tok >> 5] >> (tok & 31) & 1u)) /* only rounding can land here */
        for (int i = 0; i < V; i++)
            if (allow[i >> 5] >> (i & 31) & 1u) {
                tok = i;
                break;
            }
    out->token = tok;
    out->logprob = want_lp ? (float)((double)s->raw[tok] - lse) : 0.0f;
    for (int i = 0; i < p->n_stop; i++)
        if (p->stop_ids[i] == tok) out->is_stop = 1;
    sampler_accept(s, tok);
    return 0;
}
