/*
 * cmd_generate — `disagg generate MODEL --prompt TEXT [--chat] [--max-tokens N] [sampling]`:
 * loads the model on the CPU, tokenizes the prompt (or takes --prompt-ids), prefills it in
 * chunks, then decodes one token at a time, streaming text to stdout as it is produced
 * (whole UTF-8 characters only).  Sampling defaults come from generation_config.json when
 * the model has one (as vLLM does), flags override them.  Timings go to stderr.
 */
#include "cli/commands.h"

#include "base/clock.h"
#include "base/log.h"
#include "model/chat_template.h"
#include "model/decoder.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GEN_CHUNK 256 /* prefill tokens per forward call */
#define GEN_BLOCK 16  /* KV block size */

static int gen_usage(FILE *f, int rc) {
    fprintf(f, "usage: disagg generate MODEL (--prompt TEXT | --prompt-ids ID,ID,...) [options]\n"
               "  MODEL                   model directory or hub name in the Hugging Face cache\n"
               "  --prompt TEXT           prompt text (tokenized with the model's tokenizer.json)\n"
               "  --prompt-ids IDS        prompt as comma-separated token ids instead of text\n"
               "  --chat                  wrap the prompt as a user message in the chat template\n"
               "  --system TEXT           system message for --chat (default: the template's)\n"
               "  --max-tokens N          tokens to generate (default 128)\n"
               "  --max-model-len N       context limit (default max_position_embeddings)\n"
               "  --temperature T         0 = greedy (default: generation_config.json, else 0)\n"
               "  --top-k K  --top-p P  --min-p P\n"
               "  --repetition-penalty R  --presence-penalty P  --frequency-penalty F\n"
               "  --seed S                reproducible sampling\n"
               "  --ignore-eos            do not stop at end-of-sequence tokens\n"
               "  --ids                   print token ids (one per line) instead of text\n"
               "  --threads N             CPU threads (default: all)\n");
    return rc;
}

static int arg_num(const char *flag, const char *v, double lo, double hi, double *out) {
    char *end;
    double x = v ? strtod(v, &end) : 0;
    if (!v || !*v || *end || !(x >= lo && x <= hi)) {
        fprintf(stderr, "disagg generate: %s '%s' is invalid; accepted: a number in [%g, %g]\n",
                flag, v ? v : "", lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

static int parse_ids(const char *s, int32_t **out, int *n) {
    int cap = 16, k = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    const char *p = s;
    while (ids && *p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr,
                    "disagg generate: --prompt-ids '%s' is invalid; accepted: comma-separated "
                    "token ids\n",
                    s);
            free(ids);
            return -1;
        }
        if (k == cap) ids = realloc(ids, (size_t)(cap *= 2) * sizeof *ids);
        if (!ids) break;
        ids[k++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    *out = ids;
    *n = k;
    return ids ? 0 : -1;
}

typedef struct gen_opts {
    const char *model, *prompt, *prompt_ids, *system;
    int chat, ids_out, ignore_eos, threads, max_tokens, max_model_len;
    int set_temp, set_top_p, set_top_k, set_rep; /* flags given (override generation_config) */
    sampler_params sp;
} gen_opts;

static int gen_parse(int argc, char **argv, gen_opts *o) {
    memset(o, 0, sizeof *o);
    sampler_params_default(&o->sp);
    o->max_tokens = 128;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        double x;
#define NUM(flag, lo, hi, dst)                                                                     \
    if (!strcmp(a, flag)) {                                                                        \
        if (arg_num(flag, v, lo, hi, &x)) return 2;                                                \
        dst;                                                                                       \
        i++;                                                                                       \
        continue;                                                                                  \
    }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return gen_usage(stdout, 0) - 1;
        if (!strcmp(a, "--chat")) {
            o->chat = 1;
            continue;
        }
        if (!strcmp(a, "--ids")) {
            o->ids_out = 1;
            continue;
        }
        if (!strcmp(a, "--ignore-eos")) {
            o->ignore_eos = 1;
            continue;
        }
        if (!strcmp(a, "--prompt") || !strcmp(a, "--prompt-ids") || !strcmp(a, "--system")) {
            if (!v) {
                fprintf(stderr, "disagg generate: %s needs a value\n", a);
                return 2;
            }
            *(!strcmp(a, "--prompt")   ? &o->prompt
              : !strcmp(a, "--system") ? &o->system
                                       : &o->prompt_ids) = v;
            i++;
            continue;
        }
        NUM("--max-tokens", 1, 1 << 24, o->max_tokens = (int)x);
        NUM("--max-model-len", 1, 1 << 24, o->max_model_len = (int)x);
        NUM("--threads", 1, 1024, o->threads = (int)x);
        NUM("--temperature", -1e30, 1e30, (o->sp.temperature = (float)x, o->set_temp = 1));
        NUM("--top-k", -1e30, 1e30, (o->sp.top_k = (int)x, o->set_top_k = 1));
        NUM("--top-p", -1e30, 1e30, (o->sp.top_p = (float)x, o->set_top_p = 1));
        NUM("--min-p", -1e30, 1e30, o->sp.min_p = (float)x);
        NUM("--repetition-penalty", -1e30, 1e30,
            (o->sp.repetition_penalty = (float)x, o->set_rep = 1));
        NUM("--presence-penalty", -1e30, 1e30, o->sp.presence_penalty = (float)x);
        NUM("--frequency-penalty", -1e30, 1e30, o->sp.frequency_penalty = (float)x);
        NUM("--seed", 0, 18446744073709551615.0, (o->sp.seed = (uint64_t)x, o->sp.has_seed = 1));
#undef NUM
        if (a[0] == '-') {
            fprintf(stderr, "disagg generate: unknown option '%s'\n", a);
            return gen_usage(stderr, 2);
        }
        if (o->model) {
            fprintf(stderr, "disagg generate: unexpected argument '%s' (MODEL is '%s')\n", a,
                    o->model);
            return 2;
        }
        o->model = a;
    }
    if (!o->model) {
        fprintf(stderr, "disagg generate: MODEL is missing\n");
        return gen_usage(stderr, 2);
    }
    if (!o->prompt == !o->prompt_ids) {
        fprintf(stderr,
                "disagg generate: give exactly one of --prompt TEXT and --prompt-ids IDS\n");
        return 2;
    }
    if ((o->prompt && !*o->prompt) || (o->prompt_ids && !*o->prompt_ids)) {
        fprintf(stderr, "disagg generate: the prompt is empty; give at least one token\n");
        return 2;
    }
    if (o->chat && o->prompt_ids) {
        fprintf(stderr, "disagg generate: --chat needs --prompt TEXT (not --prompt-ids)\n");
        return 2;
    }
    return 0;
}

/* Text (or chat-rendered text) -> ids. */
static int gen_tokenize(const gen_opts *o, const tokenizer *tok, int32_t **ids, int *n) {
    char err[1024];
    char *text = NULL;
    size_t len = 0;
    if (o->chat) {
        chat_template *ct = NULL;
        const char *tt = tokenizer_chat_template(tok);
        if (!tt || chat_template_init(tt, &ct, err, sizeof err)) {
            fprintf(stderr, "disagg generate: %s\n",
                    tt ? err : "the model's tokenizer_config.json has no chat template");
            return -1;
        }
        json_t *msgs = json_array();
        if (o->system)
            json_array_append_new(msgs,
                                  json_pack("{s:s,s:s}", "role", "system", "content", o->system));
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "user", "content", o->prompt));
        chat_template_opts co = {.add_generation_prompt = true, .parse_tool_arguments = true};
        int rc = chat_template_render(ct, msgs, NULL, &co, &text, &len, err, sizeof err);
        json_decref(msgs);
        chat_template_free(ct);
        if (rc) {
            fprintf(stderr, "disagg generate: chat template: %s\n", err);
            return -1;
        }
    }
    size_t nn = 0;
    int rc = o->chat ? tokenizer_encode(tok, text, len, false, ids, &nn, err, sizeof err)
                     : tokenizer_encode(tok, o->prompt, strlen(o->prompt), true, ids, &nn, err,
                                        sizeof err);
    free(text);
    if (rc) {
        fprintf(stderr, "disagg generate: tokenizing the prompt: %s\n", err);
        return -1;
    }
    *n = (int)nn;
    return 0;
}

int cmd_generate(int argc, char **argv) {
    gen_opts o;
    int rc = gen_parse(argc, argv, &o);
    if (rc) return rc < 0 ? 0 : rc;
    decoder_model m;
    char err[4096];
    if (decoder_load(&m, o.model, 1, err, sizeof err)) {
        fprintf(stderr, "disagg generate: %s\n", err);
        return 1;
    }
    const model_config *c = &m.cfg;
    /* sampling defaults from generation_config.json unless given */
    if (c->has_gen_defaults) {
        if (!o.set_temp) o.sp.temperature = c->gen_temperature;
        if (!o.set_top_p) o.sp.top_p = c->gen_top_p;
        if (!o.set_top_k) o.sp.top_k = c->gen_top_k;
        if (!o.set_rep) o.sp.repetition_penalty = c->gen_repetition_penalty;
    }
    tokenizer *tok = NULL;
    int tok_rc = tokenizer_load(m.dir, &tok, err, sizeof err);
    if (tok_rc && (o.prompt || !o.ids_out)) {
        fprintf(stderr,
                "disagg generate: %s (with --prompt-ids and --ids no tokenizer is needed)\n", err);
        decoder_free(&m);
        return 1;
    }
    int32_t *ids = NULL;
    int n = 0, exit_rc = 2; /* bad input until the prompt and parameters are accepted */
    decoder_state *s = NULL;
    sampler *smp = NULL;
    float *logits = NULL;
    int32_t *table = NULL;
    kv_store kv = {0};
    if (o.prompt ? gen_tokenize(&o, tok, &ids, &n) : parse_ids(o.prompt_ids, &ids, &n)) goto out;
    int max_len = o.max_model_len ? o.max_model_len : c->max_position;
    if (max_len > c->max_position) {
        fprintf(
            stderr,
            "disagg generate: --max-model-len %d exceeds the model's max_position_embeddings %d\n",
            max_len, c->max_position);
        goto out;
    }
    if (n == 0) {
        fprintf(stderr, "disagg generate: the prompt has no tokens\n");
        goto out;
    }
    if (n >= max_len) {
        fprintf(stderr,
                "disagg generate: the prompt has %d tokens; max_model_len is %d (leave room for "
                "one more)\n",
                n, max_len);
        goto out;
    }
    for (int i = 0; i < n; i++)
        if (ids[i] >= c->vocab_size) {
            fprintf(stderr,
                    "disagg generate: prompt token id %d is outside the vocabulary [0, %d)\n",
                    ids[i], c->vocab_size);
            goto out;
        }
    if (!o.ignore_eos) {
        for (int i = 0; i < c->n_eos && o.sp.n_stop < SAMPLER_MAX_STOP; i++)
            o.sp.stop_ids[o.sp.n_stop++] = c->eos_ids[i];
        if (tok && tokenizer_eos_id(tok) >= 0 && tokenizer_eos_id(tok) < c->vocab_size)
            o.sp.stop_ids[o.sp.n_stop++] = tokenizer_eos_id(tok);
    }
    if (!(smp = sampler_init(&o.sp, c->vocab_size, ids, n, err, sizeof err))) {
        fprintf(stderr, "disagg generate: %s\n", err);
        goto out;
    }
    exit_rc = 1; /* runtime failures from here */
    int total = n + o.max_tokens < max_len ? n + o.max_tokens : max_len;
    int n_blocks = (total + GEN_BLOCK - 1) / GEN_BLOCK;
    s = decoder_state_init(&m, GEN_CHUNK, o.threads);
    logits = malloc((size_t)c->vocab_size * sizeof *logits);
    table = malloc((size_t)n_blocks * sizeof *table);
    if (!s || !logits || !table || kv_store_init(&kv, c, n_blocks, GEN_BLOCK)) {
        fprintf(stderr, "disagg generate: out of memory\n");
        goto out;
    }
    for (int b = 0; b < n_blocks; b++)
        table[b] = b;
    uint64_t t0 = clock_now_ns();
    for (int p = 0; p < n; p += GEN_CHUNK) {
        int len = n - p < GEN_CHUNK ? n - p : GEN_CHUNK;
        decoder_seq q = {ids + p, len, p, table, n_blocks, logits, 0, NULL};
        if (decoder_forward(&m, s, &kv, &q, 1)) goto out;
    }
    uint64_t t1 = clock_now_ns();
    tokenizer_stream ts;
    tokenizer_stream_init(&ts, true);
    char *buf = tok ? malloc(TOKENIZER_STREAM_OUT_CAP(tok)) : NULL;
    size_t blen = 0;
    int gen = 0, pos = n;
    const char *why = "max tokens";
    for (;;) {
        sample_result r;
        sampler_sample(smp, logits, &r);
        gen++;
        if (r.is_stop) {
            why = "end of sequence";
            break;
        }
        if (o.ids_out) {
            printf("%d\n", r.token);
        } else if (buf && tokenizer_stream_push(tok, &ts, r.token, buf,
                                                TOKENIZER_STREAM_OUT_CAP(tok), &blen) == 0) {
            fwrite(buf, 1, blen, stdout);
        }
        fflush(stdout);
        if (gen >= o.max_tokens) break;
        if (pos + 1 >= max_len) {
            why = "max_model_len";
            break;
        }
        decoder_seq q = {&r.token, 1, pos++, table, n_blocks, logits, 0, NULL};
        if (decoder_forward(&m, s, &kv, &q, 1)) goto out;
    }
    if (buf && !o.ids_out &&
        tokenizer_stream_flush(&ts, buf, TOKENIZER_STREAM_OUT_CAP(tok), &blen) == 0)
        fwrite(buf, 1, blen, stdout);
    if (!o.ids_out) printf("\n");
    free(buf);
    uint64_t t2 = clock_now_ns();
    fprintf(
        stderr,
        "[%d prompt tokens, %.1f tok/s prefill; %d generated, %.2f tok/s decode; stopped: %s]\n", n,
        n / ((double)(t1 - t0) / 1e9), gen, gen > 1 ? (gen - 1) / ((double)(t2 - t1) / 1e9) : 0.0,
        why);
    exit_rc = 0;
out:
    kv_store_free(&kv);
    free(table);
    free(logits);
    sampler_free(smp);
    decoder_state_free(s);
    free(ids);
    tokenizer_free(tok);
    decoder_free(&m);
    return exit_rc;
}
