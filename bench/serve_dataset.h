/*
 * serve_dataset — the datasets of `disagg bench serve`, named and shaped as `vllm bench
 * serve --dataset-name` names them:
 *
 *   random             --random-input-len words (common English words, about one token each)
 *   prefix_repetition  --prefix-repetition-num-prefixes shared prefixes of
 *                      --prefix-repetition-prefix-len words, each followed by
 *                      --num-prompts / num-prefixes distinct suffixes of -suffix-len words
 *   custom             a JSONL file (--dataset-path): {"prompt": "..."} one prompt a line, or a
 *                      multi-turn conversation a line: {"messages": [...]} or
 *                      {"conversation": [...]} of {"role", "content"} turns; or a JSON array
 *                      of such objects (vLLM's benchmarks/multi_turn format, [{"id",
 *                      "messages"}]).  A conversation's user turns are sent one after the
 *                      other, each after the previous answer arrived and with it in the history.
 *   sharegpt           a ShareGPT JSON file: [{"conversations": [{"from": "human", "value":
 *                      ...}, {"from": "gpt", "value": ...}, ...]}]: the first turn is the
 *                      prompt, the second's token count the output length (as vLLM).
 *
 * Every bad file gets an error naming the file, the line or entry, and what is accepted.
 */
#ifndef DISAGG_BENCH_SERVE_DATASET_H
#define DISAGG_BENCH_SERVE_DATASET_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

enum { SD_RANDOM, SD_PREFIX_REPETITION, SD_CUSTOM, SD_SHAREGPT };

/* One item: a single prompt, or a conversation of n_turns user turns. */
typedef struct sd_item {
    char *prompt; /* a single prompt (NULL for a conversation) */
    json_t *conv; /* a conversation: [{"role", "content"}] as in the file, NULL for a prompt */
    int n_turns;  /* user turns: 1 for a prompt */
    int in_len;   /* prompt length: words (random datasets), tokens (sharegpt), 0 unknown */
    int out_len;  /* max_tokens of each request */
} sd_item;

/* Counts the tokens of text (sharegpt: the server's /tokenize); -1 when it cannot. */
typedef int (*sd_count_fn)(void *ctx, const char *text);

typedef struct sd_opts {
    int kind;         /* SD_* */
    const char *path; /* --dataset-path */
    int num_prompts;  /* --num-prompts */
    uint64_t *rng;    /* splitmix64 state (--seed) */
    int disable_shuffle, no_oversample;
    int input_len, output_len; /* random */
    double range_ratio;
    int prefix_len, suffix_len, num_prefixes, prefix_output_len; /* prefix_repetition */
    int custom_output_len;                                       /* custom */
    int sharegpt_output_len; /* sharegpt: 0 = the gpt reply's token count */
    sd_count_fn count;
    void *count_ctx;
} sd_opts;

/* Builds the items; 0, or -1 with the reason in err. */
int sd_load(const sd_opts *o, sd_item **items, int *n, char *err, size_t cap);
void sd_free(sd_item *items, int n);

/* The dataset names, index = SD_*, NULL-ended. */
extern const char *const SD_NAMES[];

#endif
