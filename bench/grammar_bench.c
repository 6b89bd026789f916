/*
 * grammar_bench — `disagg bench grammar`: the CPU cost of structured outputs' token
 * masks over a real vocabulary, and the masks themselves for comparison with xgrammar.
 *
 *   disagg bench grammar --tokenizer DIR (--json-schema FILE | --regex RE | --grammar FILE |
 *                        --choice JSON | --json-object) [--walks N] [--max-steps N]
 *                        [--seed S] [--compact]
 *     random walks through the grammar (each step: the state's mask, a random allowed
 *     token, the advance); prints the compile time, the first walk's cost per token
 *     (masks computed as the walk meets new states: cold) and the later walks' (warm),
 *     and the cost of applying a mask to a row of logits.
 *   ... --docs DOCS.jsonl
 *     instead of random walks, replays documents (one JSON string a line: the text) as the
 *     model would write them (the tokenizer's tokens), twice: the first pass meets every
 *     state first (cold: masks computed), the second finds them cached (warm); per token
 *     the mask and the advance, and each token is checked against the mask.
 *   disagg bench grammar --tokenizer DIR --masks CASES.jsonl
 *     CASES: one JSON object a line, {"kind": "json_schema" | "json_object" | "regex" |
 *     "grammar" | "choice", "text": ..., "tokens": [ids], "compact": bool}; prints for
 *     each case a line {"steps": [{"n": allowed tokens, "accepting": 0|1, "hash": the sum
 *     mod 2^64 of splitmix64(id) over the allowed ids, "ids": [...] with --ids}]}
 *     or {"error": message}: the mask before each token and after the last.
 */
#include "bench/bench.h"

#include "base/clock.h"
#include "base/log.h"
#include "base/rng.h"
#include "grammar/grammar.h"
#include "model/tokenizer.h"
#include "server/structured.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *b = malloc(cap);
    for (size_t r; b && (r = fread(b + n, 1, cap - n - 1, f)) > 0;) {
        n += r;
        if (n + 1 == cap) {
            char *q = realloc(b, cap *= 2);
            if (!q) {
                free(b);
                b = NULL;
            }
            b = q;
        }
    }
    fclose(f);
    if (b) b[n] = 0;
    *len = n;
    return b;
}

static int kind_of(const char *s, grammar_kind *k) {
    static const struct {
        const char *name;
        grammar_kind kind;
    } kinds[] = {{"json_schema", GRAMMAR_JSON_SCHEMA},
                 {"json_object", GRAMMAR_JSON_OBJECT},
                 {"regex", GRAMMAR_REGEX},
                 {"grammar", GRAMMAR_GBNF},
                 {"choice", GRAMMAR_CHOICE}};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (!strcmp(s, kinds[i].name)) {
            *k = kinds[i].kind;
            return 0;
        }
    return -1;
}

static int mask_count(const uint32_t *m, int n) {
    int c = 0;
    for (int w = 0; w < (n + 31) / 32; w++)
        c += __builtin_popcount(m[w]);
    return c;
}

static int run_masks(grammar_vocab *v, const char *path, int with_ids) {
    size_t len;
    char *text = read_all(path, &len);
    if (!text) {
        fprintf(stderr, "bench grammar: cannot read %s\n", path);
        return 1;
    }
    int n = grammar_vocab_size(v);
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        json_error_t je;
        json_t *c = json_loads(line, 0, &je);
        json_t *out = json_object();
        grammar_kind kind;
        const char *ks = json_string_value(json_object_get(c, "kind"));
        const char *gt = json_string_value(json_object_get(c, "text"));
        if (!c || !ks || kind_of(ks, &kind) || !gt) {
            json_object_set_new(out, "error", json_string("bad case line"));
        } else {
            char err[1024] = "";
            grammar_options opt = {.any_whitespace = !json_is_true(json_object_get(c, "compact"))};
            grammar *g = grammar_compile(kind, gt, strlen(gt), &opt, v, err, sizeof err);
            if (!g)
                json_object_set_new(out, "error", json_string(err));
            else {
                json_t *steps = json_array(), *toks = json_object_get(c, "tokens");
                grammar_state s = grammar_start(g);
                for (size_t i = 0; i <= json_array_size(toks); i++) {
                    const uint32_t *m = grammar_state_mask(g, s);
                    json_t *st = json_object();
                    uint64_t h = 0;
                    json_t *ids = with_ids ? json_array() : NULL;
                    for (int t = 0; t < n; t++)
                        if (m[t >> 5] >> (t & 31) & 1u) {
                            uint64_t z = (uint64_t)t + 0x9E3779B97F4A7C15ULL;
                            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
                            z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
                            h += z ^ (z >> 31);
                            if (ids) json_array_append_new(ids, json_integer(t));
                        }
                    char hs[24];
                    snprintf(hs, sizeof hs, "%016llx", (unsigned long long)h);
                    json_object_set_new(st, "n", json_integer(mask_count(m, n)));
                    json_object_set_new(st, "accepting",
                                        json_integer(grammar_state_accepting(g, s)));
                    json_object_set_new(st, "hash", json_string(hs));
                    if (ids) json_object_set_new(st, "ids", ids);
                    json_array_append_new(steps, st);
                    if (i == json_array_size(toks)) break;
                    int32_t t = (int32_t)json_integer_value(json_array_get(toks, i));
                    s = grammar_advance_token(g, s, t);
                    if (s == GRAMMAR_DEAD) {
                        json_object_set_new(out, "dead_at", json_integer((json_int_t)i));
                        break;
                    }
                }
                json_object_set_new(out, "steps", steps);
                grammar_unref(g);
            }
        }
        char *o = json_dumps(out, JSON_COMPACT);
        printf("%s\n", o);
        free(o);
        json_decref(out);
        json_decref(c);
    }
    free(text);
    return 0;
}

/* Replays docs through g: 0, or 1 when a document breaks the grammar. */
static int run_docs(grammar *g, const tokenizer *tok, const char *path) {
    size_t len;
    char *text = read_all(path, &len);
    if (!text) {
        fprintf(stderr, "bench grammar: cannot read %s\n", path);
        return 1;
    }
    double ns[2] = {0, 0}, worst[2] = {0, 0};
    long ntok[2] = {0, 0};
    int ndocs = 0, rc = 0;
    for (int pass = 0; pass < 2 && !rc; pass++) {
        char *copy = strdup(text);
        char *save = NULL;
        for (char *line = strtok_r(copy, "\n", &save); line && !rc;
             line = strtok_r(NULL, "\n", &save)) {
            json_t *j = json_loads(line, JSON_DECODE_ANY, NULL);
            if (!json_is_string(j)) {
                json_decref(j);
                continue;
            }
            int32_t *ids = NULL;
            size_t n = 0;
            char err[256];
            if (tokenizer_encode(tok, json_string_value(j), json_string_length(j), false, &ids, &n,
                                 err, sizeof err)) {
                json_decref(j);
                continue;
            }
            ndocs += pass == 0;
            grammar_state s = grammar_start(g);
            for (size_t i = 0; i < n; i++) {
                uint64_t a = clock_now_ns();
                const uint32_t *m = grammar_state_mask(g, s);
                int ok = m[ids[i] >> 5] >> (ids[i] & 31) & 1u;
                grammar_state ns2 = grammar_advance_token(g, s, ids[i]);
                double c = (double)(clock_now_ns() - a);
                ns[pass] += c;
                if (c > worst[pass]) worst[pass] = c;
                ntok[pass]++;
                if (!ok || ns2 == GRAMMAR_DEAD) {
                    fprintf(stderr, "bench grammar: token %zu (%d) of %s is not allowed\n", i,
                            ids[i], line);
                    rc = 1;
                    break;
                }
                s = ns2;
            }
            if (!rc && !grammar_state_accepting(g, s)) {
                fprintf(stderr, "bench grammar: the grammar does not accept %s\n", line);
                rc = 1;
            }
            free(ids);
            json_decref(j);
        }
        free(copy);
    }
    printf("documents       %d (%ld tokens a pass)\n", ndocs, ntok[0]);
    printf("first pass      %.2f us/token, worst token %.2f ms (masks computed as states appear)\n",
           ntok[0] ? ns[0] / 1e3 / (double)ntok[0] : 0.0, worst[0] / 1e6);
    printf("second pass     %.2f us/token, worst token %.1f us (mask + advance, cached)\n",
           ntok[1] ? ns[1] / 1e3 / (double)ntok[1] : 0.0, worst[1] / 1e3);
    free(text);
    return rc;
}

static void usage(FILE *f) {
    fprintf(
        f, "usage: disagg bench grammar --tokenizer DIR (--json-schema FILE | --regex RE | "
           "--grammar FILE | --choice JSON | --json-object) [--walks N] [--max-steps N] "
           "[--seed S] [--compact] [--docs DOCS.jsonl]\n"
           "       disagg bench grammar --tokenizer DIR --masks CASES.jsonl [--ids]\n"
           "       disagg bench grammar --engine MODEL ... (the engine's step with masks: "
           "--engine MODEL --help)\n\n"
           "  --tokenizer DIR     the tokenizer (tokenizer.json) whose vocabulary the masks cover\n"
           "  --json-schema FILE  constrain to a JSON Schema\n"
           "  --regex RE          constrain to a regular expression\n"
           "  --grammar FILE      constrain to a GBNF / EBNF grammar (start rule root)\n"
           "  --choice JSON       constrain to one of a JSON list of strings\n"
           "  --json-object       constrain to any JSON object\n"
           "  --compact           JSON without free whitespace (disable_any_whitespace)\n"
           "  --walks N           random walks through the grammar (default 20)\n"
           "  --max-steps N       tokens per walk at most (default 200)\n"
           "  --seed S            the walks' random seed (default 1)\n"
           "  --docs DOCS.jsonl   replay documents (a JSON string a line) instead, twice\n"
           "  --masks CASES.jsonl print the masks along given token walks (JSON lines)\n"
           "  --ids               with --masks: the allowed ids too, not just count and hash\n");
}

int bench_grammar_main(int argc, char **argv) {
    const char *tokdir = NULL, *masks = NULL, *text = NULL, *docs = NULL;
    char *owned = NULL;
    grammar_kind kind = GRAMMAR_JSON_OBJECT;
    int have_kind = 0, walks = 20, max_steps = 200, ids = 0, compact = 0;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--engine")) return bench_grammar_engine_main(argc, argv);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        size_t len;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            free(owned);
            return 0;
        } else if (!strcmp(a, "--tokenizer") && val)
            tokdir = argv[++i];
        else if (!strcmp(a, "--docs") && val)
            docs = argv[++i];
        else if (!strcmp(a, "--masks") && val)
            masks = argv[++i];
        else if (!strcmp(a, "--ids"))
            ids = 1;
        else if (!strcmp(a, "--compact"))
            compact = 1;
        else if (!strcmp(a, "--json-object"))
            kind = GRAMMAR_JSON_OBJECT, text = "", have_kind = 1;
        else if (!strcmp(a, "--regex") && val)
            kind = GRAMMAR_REGEX, text = argv[++i], have_kind = 1;
        else if (!strcmp(a, "--choice") && val)
            kind = GRAMMAR_CHOICE, text = argv[++i], have_kind = 1;
        else if ((!strcmp(a, "--json-schema") || !strcmp(a, "--grammar")) && val) {
            kind = !strcmp(a, "--grammar") ? GRAMMAR_GBNF : GRAMMAR_JSON_SCHEMA;
            free(owned);
            owned = read_all(argv[++i], &len);
            if (!owned) {
                fprintf(stderr, "bench grammar: cannot read %s\n", argv[i]);
                return 2;
            }
            text = owned;
            have_kind = 1;
        } else if (!strcmp(a, "--walks") && val)
            walks = atoi(argv[++i]);
        else if (!strcmp(a, "--max-steps") && val)
            max_steps = atoi(argv[++i]);
        else if (!strcmp(a, "--seed") && val)
            seed = strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "bench grammar: unknown or incomplete argument '%s'\n", a);
            usage(stderr);
            free(owned);
            return 2;
        }
    }
    if (!tokdir || (!masks && !have_kind) || walks < 1 || max_steps < 1) {
        usage(stderr);
        free(owned);
        return 2;
    }
    char err[1024];
    tokenizer *tok = NULL;
    if (tokenizer_load(tokdir, &tok, err, sizeof err)) {
        fprintf(stderr, "bench grammar: %s\n", err);
        free(owned);
        return 1;
    }
    int n = tokenizer_vocab_size(tok);
    uint64_t t0 = clock_now_ns();
    grammar_vocab *v = structured_vocab_new(tok, n);
    uint64_t t_vocab = clock_now_ns() - t0;
    int rc = 0;
    if (masks) {
        rc = run_masks(v, masks, ids);
        goto out;
    }
    grammar_options opt = {.any_whitespace = !compact};
    t0 = clock_now_ns();
    grammar *g = grammar_compile(kind, text, strlen(text), &opt, v, err, sizeof err);
    uint64_t t_compile = clock_now_ns() - t0;
    if (!g) {
        fprintf(stderr, "bench grammar: %s\n", err);
        rc = 1;
        goto out;
    }
    if (docs) {
        printf("vocabulary      %d tokens (built in %.1f ms)\n", n, (double)t_vocab / 1e6);
        printf("compile         %.3f ms\n", (double)t_compile / 1e6);
        rc = run_docs(g, tok, docs);
        int ns, nm, nn;
        grammar_stats(g, &ns, &nm, &nn);
        printf("states          %d (%d masks, %d stack nodes)\n", ns, nm, nn);
        grammar_unref(g);
        goto out;
    }
    rng_state r;
    rng_seed(&r, seed);
    int32_t *allowed = malloc(sizeof(int32_t) * (size_t)n);
    float *logits = malloc(sizeof(float) * (size_t)n);
    double cold_ns = 0, warm_ns = 0, apply_ns = 0, new_mask_ns = 0;
    long new_masks = 0;
    long cold_tok = 0, warm_tok = 0, apply_n = 0, accepted = 0;
    for (int w = 0; w < walks; w++) {
        grammar_state s = grammar_start(g);
        for (int step = 0; step < max_steps; step++) {
            int nm0;
            grammar_stats(g, NULL, &nm0, NULL);
            uint64_t a = clock_now_ns();
            const uint32_t *m = grammar_state_mask(g, s);
            uint64_t b = clock_now_ns();
            int nm1;
            grammar_stats(g, NULL, &nm1, NULL);
            if (nm1 > nm0) new_mask_ns += (double)(b - a), new_masks++;
            /* apply to a row, as the sampler does */
            for (int i = 0; i < n; i++)
                logits[i] = (float)i;
            uint64_t c0 = clock_now_ns();
            for (int wd = 0; wd < (n + 31) / 32; wd++) {
                uint32_t mm = m[wd];
                if (mm == 0xFFFFFFFFu) continue;
                int base = wd * 32, end = base + 32 < n ? base + 32 : n;
                if (!mm)
                    for (int i = base; i < end; i++)
                        logits[i] = -INFINITY;
                else
                    for (uint32_t z = ~mm; z; z &= z - 1)
                        if (base + __builtin_ctz(z) < n)
                            logits[base + __builtin_ctz(z)] = -INFINITY;
            }
            apply_ns += (double)(clock_now_ns() - c0);
            apply_n++;
            int na = 0;
            for (int i = 0; i < n; i++)
                if (m[i >> 5] >> (i & 31) & 1u) allowed[na++] = i;
            int acc = grammar_state_accepting(g, s);
            if (!na || (acc && rng_next(&r) % 4 == 0)) {
                accepted += acc;
                break;
            }
            int32_t t = allowed[rng_next(&r) % (uint64_t)na];
            uint64_t c = clock_now_ns();
            s = grammar_advance_token(g, s, t);
            uint64_t d = clock_now_ns();
            double cost = (double)(b - a) + (double)(d - c);
            if (w == 0)
                cold_ns += cost, cold_tok++;
            else
                warm_ns += cost, warm_tok++;
            if (s == GRAMMAR_DEAD) {
                fprintf(stderr, "bench grammar: an allowed token %d was rejected\n", t);
                rc = 1;
                break;
            }
        }
    }
    int ns, nm, nn;
    grammar_stats(g, &ns, &nm, &nn);
    printf("vocabulary      %d tokens (built in %.1f ms)\n", n, (double)t_vocab / 1e6);
    printf("compile         %.3f ms\n", (double)t_compile / 1e6);
    printf("walks           %d (max %d steps; %ld ended accepting)\n", walks, max_steps, accepted);
    printf("cold walk       %.1f us/token over %ld tokens (masks computed as states appear)\n",
           cold_tok ? cold_ns / 1e3 / (double)cold_tok : 0.0, cold_tok);
    printf("warm walks      %.2f us/token over %ld tokens (mask + advance)\n",
           warm_tok ? warm_ns / 1e3 / (double)warm_tok : 0.0, warm_tok);
    printf("apply mask      %.1f us/row (-inf over a %d-entry logits row)\n",
           apply_n ? apply_ns / 1e3 / (double)apply_n : 0.0, n);
    printf("states          %d (%d masks, %d stack nodes)\n", ns, nm, nn);
    printf("new mask        %.2f ms each (%ld computed during the walks)\n",
           new_masks ? new_mask_ns / 1e6 / (double)new_masks : 0.0, new_masks);
    free(allowed);
    free(logits);
    grammar_unref(g);
out:
    grammar_vocab_free(v);
    tokenizer_free(tok);
    free(owned);
    return rc;
}
