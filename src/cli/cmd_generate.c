/*
 * cmd_generate — `disagg generate MODEL --prompt TEXT [--chat] [--max-tokens N] [sampling]`:
 * loads the model on the CPU, tokenizes the prompt (or takes --prompt-ids), prefills it in
 * chunks, then decodes one token at a time, streaming text to stdout as it is produced
 * (whole UTF-8 characters only).  Sampling defaults come from generation_config.json when
 * the model has one (as vLLM does), flags override them.  Timings go to stderr.
 */
#include "cli/commands.h"

#include "base/clock.h"
#include "base/flags.h"
#include "base/log.h"
#include "model/chat_template.h"
#include "model/decoder.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

#include <errno.h>
#include <limits.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GEN_CHUNK 256 /* prefill tokens per forward call */
#define GEN_BLOCK 16  /* KV block size */

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

static int on_model(flags_parser *p, const char *word) {
    gen_opts *o = flags_arg(p);
    if (o->model) {
        flags_error(p, "unexpected argument '%s' (MODEL is '%s')", word, o->model);
        return -1;
    }
    o->model = word;
    return 0;
}

/* The sampling flags: a number each (the sampler checks its range), marking it given. */
static int sampling(flags_parser *p, const flag_def *d, const char *v) {
    gen_opts *o = flags_arg(p);
    double x;
    if (flags_double(p, d, v, &x)) return -1;
    const char *n = d->name + 2;
    if (!strcmp(n, "temperature"))
        o->sp.temperature = (float)x, o->set_temp = 1;
    else if (!strcmp(n, "top-k"))
        o->sp.top_k = (int)x, o->set_top_k = 1;
    else if (!strcmp(n, "top-p"))
        o->sp.top_p = (float)x, o->set_top_p = 1;
    else if (!strcmp(n, "min-p"))
        o->sp.min_p = (float)x;
    else if (!strcmp(n, "repetition-penalty"))
        o->sp.repetition_penalty = (float)x, o->set_rep = 1;
    else if (!strcmp(n, "presence-penalty"))
        o->sp.presence_penalty = (float)x;
    else if (!strcmp(n, "frequency-penalty"))
        o->sp.frequency_penalty = (float)x;
    return 0;
}

static int seed(flags_parser *p, const flag_def *d, const char *v) {
    gen_opts *o = flags_arg(p);
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end || v[0] == '-') {
        flags_error(p, "%s '%s' is not accepted; accepted: an integer in [0, %llu]", d->name, v,
                    ULLONG_MAX);
        return -1;
    }
    o->sp.seed = (uint64_t)x, o->sp.has_seed = 1;
    return 0;
}

#define SAMPLING(nm, mv, text)                                                                     \
    { FLAG_CUSTOM_(nm, NULL, sampling), .lo = -1e30, .hi = 1e30, .metavar = mv, .help = text }

static int gen_parse(int argc, char **argv, gen_opts *o) {
    memset(o, 0, sizeof *o);
    sampler_params_default(&o->sp);
    o->max_tokens = 128;
    const flag_def defs[] = {
        {FLAG_STRING_("--prompt", &o->prompt), .metavar = "TEXT",
         .help = "prompt text (tokenized with the model's tokenizer.json)"},
        {FLAG_STRING_("--prompt-ids", &o->prompt_ids), .metavar = "IDS",
         .help = "prompt as comma-separated token ids instead of text"},
        {FLAG_BOOL_("--chat", &o->chat),
         .help = "wrap the prompt as a user message in the chat template"},
        {FLAG_STRING_("--system", &o->system), .metavar = "TEXT",
         .help = "system message for --chat (default: the template's)"},
        {FLAG_INT_("--max-tokens", &o->max_tokens, 1, 1 << 24),
         .help = "tokens to generate (default 128)"},
        {FLAG_INT_("--max-model-len", &o->max_model_len, 1, 1 << 24),
         .help = "context limit (default max_position_embeddings)"},
        SAMPLING("--temperature", "T", "0 = greedy (default: generation_config.json, else 0)"),
        SAMPLING("--top-k", "K", "keep the K most likely tokens (default: generation_config.json)"),
        SAMPLING("--top-p", "P", "nucleus sampling mass (default: generation_config.json)"),
        SAMPLING("--min-p", "P", "drop tokens below P times the top probability"),
        SAMPLING("--repetition-penalty", "R", "penalize tokens seen in prompt or output"),
        SAMPLING("--presence-penalty", "P", "penalize tokens present in the output"),
        SAMPLING("--frequency-penalty", "F", "penalize tokens by their output count"),
        {FLAG_CUSTOM_("--seed", NULL, seed), .metavar = "S", .help = "reproducible sampling"},
        {FLAG_BOOL_("--ignore-eos", &o->ignore_eos),
         .help = "do not stop at end-of-sequence tokens"},
        {FLAG_BOOL_("--ids", &o->ids_out),
         .help = "print token ids (one per line) instead of text"},
        {FLAG_INT_("--threads", &o->threads, 1, 1024), .help = "CPU threads (default: all)"},
        {0}};
    const flag_def *tables[] = {defs, NULL};
    const flags_spec spec = {
        .cmd = "generate",
        .usage =
            "usage: disagg generate MODEL (--prompt TEXT | --prompt-ids ID,ID,...) [options]\n"
            "  MODEL                   model directory or hub name in the Hugging Face cache\n",
        .tables = tables,
        .help_col = 26,
        .positional = on_model,
        .arg = o};
    int pr = flags_parse(&spec, argc, argv);
    if (pr) return pr == FLAGS_HELP ? -1 : 2;
    if (!o->model) {
        fprintf(stderr, "disagg generate: MODEL is missing (see disagg generate --help)\n");
        return 2;
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
        decoder_seq q = {ids + p, len, p, table, n_blocks, logits, 0, NULL, NULL};
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
        decoder_seq q = {&r.token, 1, pos++, table, n_blocks, logits, 0, NULL, NULL};
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
