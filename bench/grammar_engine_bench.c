/*
 * grammar_engine_bench — `disagg bench grammar --engine MODEL`: what structured outputs cost
 * the serving engine's decode step, with the token masks filled while the forward runs
 * (engine/mask_worker.h) and filled serially before it (DISAGG_GRAMMAR_OVERLAP=0), against
 * the same batch unconstrained; the masks applied on the device (the default) or, mode host,
 * the constrained rows' logits brought to the host (DISAGG_GRAMMAR_DEVICE_MASK=0).
 *
 * For each batch size N of --seqs and each mode of --modes (none: no constraint; serial;
 * overlap) it keeps N requests in flight on one engine (a finished request is replaced at
 * once: a closed loop at concurrency N), each a --prompt-len-token prompt of random ids and
 * up to --max-tokens tokens out under the constraint, until --steps engine steps have run;
 * then it prints the engine's own step timings (engine_stats) over those steps: the whole
 * step, the forward, the mask fill (the mask thread's time when overlapped) and what the
 * step thread waited for the masks.  Every run compiles the constraint afresh (the first
 * steps meet new states: their masks cost a vocabulary walk each); with --distinct every
 * request compiles its own (every request's states are new, as with many distinct schemas).
 */
#include "bench/bench.h"

#include "base/clock.h"
#include "base/rng.h"
#include "engine/engine.h"
#include "grammar/grammar.h"
#include "model/tokenizer.h"
#include "server/structured.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GEB_MAX_SEQS 1024
#define GEB_MAX_LIST 16

typedef struct geb_slot {
    int busy;            /* a request is in flight */
    grammar *g;          /* its own grammar (--distinct), else NULL */
    struct geb_run *run; /* back pointer for the callback */
} geb_slot;

typedef struct geb_run {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_free;   /* slots whose request finished */
    int n_errors; /* requests that ended in "error" */
    char error[256];
    geb_slot *slots;
} geb_run;

static void on_event(void *ctx, const engine_event *ev) {
    geb_slot *s = ctx;
    if (ev->kind != ENGINE_EV_FINISHED) return;
    geb_run *r = s->run;
    pthread_mutex_lock(&r->mu);
    if (!strcmp(ev->finish_reason, "error") && !r->n_errors++)
        snprintf(r->error, sizeof r->error, "%s", ev->error ? ev->error : "(no message)");
    s->busy = 0;
    r->n_free++;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static int parse_list(const char *flag, const char *v, int *out, int *n) {
    *n = 0;
    for (const char *p = v; *p;) {
        char *end;
        long x = strtol(p, &end, 10);
        if (end == p || x < 1 || x > GEB_MAX_SEQS || (*end && *end != ',') || *n == GEB_MAX_LIST) {
            fprintf(stderr,
                    "bench grammar --engine: %s '%s' is invalid; accepted: comma-separated "
                    "integers in [1, %d], at most %d\n",
                    flag, v, GEB_MAX_SEQS, GEB_MAX_LIST);
            return -1;
        }
        out[(*n)++] = (int)x;
        p = *end ? end + 1 : end;
    }
    if (*n == 0) {
        fprintf(stderr, "bench grammar --engine: %s is empty\n", flag);
        return -1;
    }
    return 0;
}

typedef struct geb_opts {
    const char *model, *tokdir, *device, *text;
    grammar_kind kind;
    int compact, dummy, distinct, threads;
    int seqs[GEB_MAX_LIST], n_seqs;
    int modes[8], n_modes; /* 0 none, 1 serial, 2 overlap, 3 host (repeats allowed) */
    int steps, prompt_len, max_tokens;
    float temperature;
} geb_opts;

static const char *const MODE_NAMES[] = {"none", "serial", "overlap", "host"};

/* One closed-loop run of n requests in mode; prints its row. */
static int run_one(engine *e, const grammar_vocab *v, const geb_opts *o, int n, int mode,
                   int vocab) {
    char err[512];
    grammar_options gopt = {.any_whitespace = !o->compact};
    grammar *shared = NULL;
    if (mode && !o->distinct &&
        !(shared = grammar_compile(o->kind, o->text, strlen(o->text), &gopt, v, err, sizeof err))) {
        fprintf(stderr, "bench grammar --engine: %s\n", err);
        return 1;
    }
    if (mode) engine_set_grammar_overlap(e, mode >= 2);
    engine_set_grammar_device_mask(e, mode != 3); /* host: the logits come back, as before */
    geb_run run;
    memset(&run, 0, sizeof run);
    pthread_mutex_init(&run.mu, NULL);
    clock_cond_init(&run.cv);
    run.slots = calloc((size_t)n, sizeof *run.slots);
    int32_t *prompt = malloc((size_t)o->prompt_len * sizeof *prompt);
    uint64_t *ids = calloc((size_t)n, sizeof *ids);
    if (!run.slots || !prompt || !ids) {
        fprintf(stderr, "bench grammar --engine: out of memory\n");
        free(run.slots);
        free(prompt);
        free(ids);
        grammar_unref(shared);
        return 1;
    }
    rng_state rs;
    rng_seed(&rs, 1000u + (uint64_t)n);
    engine_stats st0, st1;
    engine_get_stats(e, &st0);
    uint64_t t0 = clock_now_ns();
    int rc = 0, submitted = 0;
    for (int i = 0; i < n; i++)
        run.slots[i].run = &run;
    run.n_free = n;
    while (!rc) {
        engine_get_stats(e, &st1);
        if (st1.steps - st0.steps >= (uint64_t)o->steps) break;
        for (int i = 0; i < n && !rc; i++) {
            pthread_mutex_lock(&run.mu);
            int busy = run.slots[i].busy;
            if (!busy) {
                run.slots[i].busy = 1;
                run.n_free--;
            }
            pthread_mutex_unlock(&run.mu);
            if (busy) continue;
            geb_slot *s = &run.slots[i];
            grammar_unref(s->g);
            s->g = NULL;
            if (mode && o->distinct &&
                !(s->g = grammar_compile(o->kind, o->text, strlen(o->text), &gopt, v, err,
                                         sizeof err))) {
                fprintf(stderr, "bench grammar --engine: %s\n", err);
                rc = 1;
            }
            for (int k = 0; k < o->prompt_len; k++)
                prompt[k] = (int32_t)(rng_next(&rs) % (uint64_t)(vocab < 30000 ? vocab : 30000));
            engine_request_params p;
            memset(&p, 0, sizeof p);
            engine_sampling_init(&p.sampling);
            p.sampling.temperature = o->temperature;
            p.sampling.has_seed = 1;
            p.sampling.seed = (uint64_t)submitted;
            p.sampling.logprobs = -1;
            p.sampling.prompt_logprobs = -1;
            p.prompt = prompt;
            p.n_prompt = o->prompt_len;
            p.max_tokens = o->max_tokens;
            p.ignore_eos = 1;
            p.grammar = mode ? (s->g ? s->g : shared) : NULL;
            if (rc == 0 && engine_submit(e, &p, on_event, s, &ids[i], err, sizeof err)) {
                fprintf(stderr, "bench grammar --engine: submit: %s\n", err);
                rc = 1;
            }
            if (rc) {
                pthread_mutex_lock(&run.mu);
                s->busy = 0;
                run.n_free++;
                pthread_mutex_unlock(&run.mu);
            } else
                submitted++;
        }
        /* until a request finishes, or a millisecond (to see the step count) */
        pthread_mutex_lock(&run.mu);
        if (run.n_free == 0) {
            struct timespec ts = clock_to_timespec(clock_now_ns() + 1000000);
            pthread_cond_timedwait(&run.cv, &run.mu, &ts);
        }
        pthread_mutex_unlock(&run.mu);
    }
    uint64_t t1 = clock_now_ns();
    engine_get_stats(e, &st1);
    for (int i = 0; i < n; i++) /* the rest in flight: out of the measurement */
        engine_abort(e, ids[i]);
    pthread_mutex_lock(&run.mu);
    while (run.n_free < n)
        pthread_cond_wait(&run.cv, &run.mu);
    pthread_mutex_unlock(&run.mu);
    if (run.n_errors) {
        fprintf(stderr, "bench grammar --engine: %d request(s) failed: %s\n", run.n_errors,
                run.error);
        rc = 1;
    }
    double steps = (double)(st1.steps - st0.steps);
    double gsteps = (double)(st1.grammar_steps - st0.grammar_steps);
    double gen = (double)(st1.generation_tokens - st0.generation_tokens);
    if (steps > 0)
        printf(
            "%5d  %-7s  %5.0f  %9.1f  %8.1f  %8.2f  %10.2f  %9.2f  %12.3f  %12.3f  %10.1f  %8.0f\n",
            n, MODE_NAMES[mode], steps,
            gsteps > 0 ? (double)(st1.grammar_rows - st0.grammar_rows) / gsteps : 0.0,
            gsteps > 0 ? (double)(st1.grammar_device_rows - st0.grammar_device_rows) / gsteps
                       : 0.0,
            (double)(st1.step_ns - st0.step_ns) / 1e6 / steps,
            (double)(st1.forward_ns - st0.forward_ns) / 1e6 / steps,
            (double)(st1.sample_ns - st0.sample_ns) / 1e6 / steps,
            gsteps > 0 ? (double)(st1.grammar_fill_ns - st0.grammar_fill_ns) / 1e6 / gsteps : 0.0,
            gsteps > 0 ? (double)(st1.grammar_wait_ns - st0.grammar_wait_ns) / 1e6 / gsteps : 0.0,
            gsteps > 0 ? (double)(st1.grammar_fill_ns - st0.grammar_fill_ns) / 1e3 /
                             (double)(st1.grammar_rows - st0.grammar_rows)
                       : 0.0,
            gen / ((double)(t1 - t0) / 1e9));
    fflush(stdout);
    for (int i = 0; i < n; i++)
        grammar_unref(run.slots[i].g);
    grammar_unref(shared);
    free(run.slots);
    free(prompt);
    free(ids);
    pthread_cond_destroy(&run.cv);
    pthread_mutex_destroy(&run.mu);
    return rc;
}

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: disagg bench grammar --engine MODEL [--tokenizer DIR] [--device D] "
        "[--load-format auto|dummy] (--json-schema FILE | --regex RE | --grammar FILE | "
        "--choice JSON | --json-object) [--compact] [--seqs 8,32] [--modes none,serial,overlap] "
        "[--steps N] [--prompt-len N] [--max-tokens N] [--temperature T] [--distinct] "
        "[--threads N]\n\n"
        "  --engine MODEL      run the serving engine on MODEL (a model directory)\n"
        "  --tokenizer DIR     the tokenizer whose vocabulary the masks cover (default: MODEL's)\n"
        "  --device D          cpu (default), cuda[:N], auto\n"
        "  --load-format F     auto (default) or dummy (random weights from config.json)\n"
        "  --seqs LIST         requests in flight, one run each (default 8,32)\n"
        "  --modes LIST        none (no constraint), serial (masks before the forward),\n"
        "                      overlap (masks while the forward runs), host (overlap, but\n"
        "                      the constrained rows' logits come to the host to be masked and\n"
        "                      drawn: DISAGG_GRAMMAR_DEVICE_MASK=0's path; serial and overlap\n"
        "                      mask on the device), run in this order (repeats allowed, 8 at\n"
        "                      most); default none,serial,overlap\n"
        "  --steps N           engine steps measured per run (default 32)\n"
        "  --prompt-len N      prompt tokens per request (default 16)\n"
        "  --max-tokens N      output tokens per request at most (default 64)\n"
        "  --temperature T     sampling temperature (default 0: greedy)\n"
        "  --distinct          every request compiles its own grammar (no shared masks)\n"
        "  --threads N         the CPU backend's compute threads (default: all cores)\n"
        "  the constraint flags as in `disagg bench grammar` (default --json-object)\n\n"
        "Columns: seqs, mode, steps measured, constrained rows per step, of those masked on\n"
        "the device (greedy ones: only the argmax comes back), step ms, forward\n"
        "ms, sample ms (after the forward: sampling, delivery), mask fill ms per step (the mask "
        "thread's time when overlapped), mask wait ms\n"
        "per step (what the step thread waited for the masks), fill us per row, output\n"
        "tokens/s.\n");
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *b = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            char *q = realloc(b, cap = 2 * cap + 8192);
            if (!q) break;
            b = q;
        }
        size_t r = fread(b + n, 1, cap - n - 1, f);
        if (!r) break;
        n += r;
    }
    fclose(f);
    if (b) b[n] = 0;
    return b;
}

int bench_grammar_engine_main(int argc, char **argv) {
    geb_opts o = {.device = "cpu",
                  .kind = GRAMMAR_JSON_OBJECT,
                  .text = "",
                  .seqs = {8, 32},
                  .n_seqs = 2,
                  .modes = {0, 1, 2},
                  .n_modes = 3,
                  .steps = 32,
                  .prompt_len = 16,
                  .max_tokens = 64};
    char *owned = NULL;
    int rc = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            free(owned);
            return 0;
        } else if (!strcmp(a, "--engine") && val)
            o.model = argv[++i];
        else if (!strcmp(a, "--tokenizer") && val)
            o.tokdir = argv[++i];
        else if (!strcmp(a, "--device") && val)
            o.device = argv[++i];
        else if (!strcmp(a, "--load-format") && val) {
            const char *f = argv[++i];
            if (strcmp(f, "dummy") != 0 && strcmp(f, "auto") != 0) {
                fprintf(stderr,
                        "bench grammar --engine: --load-format '%s' is invalid; accepted: "
                        "auto, dummy\n",
                        f);
                goto out;
            }
            o.dummy = !strcmp(f, "dummy");
        } else if (!strcmp(a, "--compact"))
            o.compact = 1;
        else if (!strcmp(a, "--distinct"))
            o.distinct = 1;
        else if (!strcmp(a, "--json-object"))
            o.kind = GRAMMAR_JSON_OBJECT, o.text = "";
        else if (!strcmp(a, "--regex") && val)
            o.kind = GRAMMAR_REGEX, o.text = argv[++i];
        else if (!strcmp(a, "--choice") && val)
            o.kind = GRAMMAR_CHOICE, o.text = argv[++i];
        else if ((!strcmp(a, "--json-schema") || !strcmp(a, "--grammar")) && val) {
            o.kind = !strcmp(a, "--grammar") ? GRAMMAR_GBNF : GRAMMAR_JSON_SCHEMA;
            free(owned);
            if (!(owned = slurp(argv[++i]))) {
                fprintf(stderr, "bench grammar --engine: cannot read %s\n", argv[i]);
                goto out;
            }
            o.text = owned;
        } else if (!strcmp(a, "--seqs") && val) {
            if (parse_list("--seqs", argv[++i], o.seqs, &o.n_seqs)) goto out;
        } else if (!strcmp(a, "--modes") && val) {
            o.n_modes = 0;
            char buf[64];
            snprintf(buf, sizeof buf, "%s", argv[++i]);
            for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
                int m = !strcmp(tok, "none")      ? 0
                        : !strcmp(tok, "serial")  ? 1
                        : !strcmp(tok, "overlap") ? 2
                        : !strcmp(tok, "host")    ? 3
                                                  : -1;
                if (m < 0 || o.n_modes == 8) {
                    fprintf(stderr,
                            "bench grammar --engine: --modes '%s' is invalid; accepted: "
                            "a comma-separated list of none, serial, overlap, host (8 at "
                            "most)\n",
                            argv[i]);
                    goto out;
                }
                o.modes[o.n_modes++] = m;
            }
        } else if ((!strcmp(a, "--steps") || !strcmp(a, "--prompt-len") ||
                    !strcmp(a, "--max-tokens") || !strcmp(a, "--threads")) &&
                   val) {
            char *end;
            long x = strtol(argv[++i], &end, 10);
            if (*end || x < (strcmp(a, "--threads") ? 1 : 0) || x > 100000) {
                fprintf(stderr,
                        "bench grammar --engine: %s '%s' is invalid; accepted: an "
                        "integer in [%d, 100000]\n",
                        a, argv[i], strcmp(a, "--threads") ? 1 : 0);
                goto out;
            }
            *(!strcmp(a, "--steps")        ? &o.steps
              : !strcmp(a, "--prompt-len") ? &o.prompt_len
              : !strcmp(a, "--max-tokens") ? &o.max_tokens
                                           : &o.threads) = (int)x;
        } else if (!strcmp(a, "--temperature") && val) {
            char *end;
            o.temperature = strtof(argv[++i], &end);
            if (*end || !(o.temperature >= 0 && o.temperature <= 10)) {
                fprintf(stderr,
                        "bench grammar --engine: --temperature '%s' is invalid; accepted: "
                        "a number in [0, 10]\n",
                        argv[i]);
                goto out;
            }
        } else {
            fprintf(stderr, "bench grammar --engine: unknown or incomplete argument '%s'\n", a);
            usage(stderr);
            goto out;
        }
    }
    if (!o.model) {
        usage(stderr);
        goto out;
    }
    int max_seqs = 0;
    for (int i = 0; i < o.n_seqs; i++)
        if (o.seqs[i] > max_seqs) max_seqs = o.seqs[i];
    engine_config c;
    engine_config_init(&c);
    c.model = o.model;
    c.device = o.device;
    c.load_dummy = o.dummy;
    c.threads = o.threads;
    c.max_num_seqs = max_seqs;
    c.max_model_len = o.prompt_len + o.max_tokens + 16;
    c.max_num_batched_tokens = max_seqs * o.prompt_len > 2048 ? max_seqs * o.prompt_len : 2048;
    char err[1024];
    engine *e = NULL;
    uint64_t t0 = clock_now_ns();
    if (engine_create(&c, &e, err, sizeof err)) {
        fprintf(stderr, "bench grammar --engine: %s\n", err);
        rc = 1;
        goto out;
    }
    double t_load = (double)(clock_now_ns() - t0) / 1e9;
    tokenizer *tok = NULL;
    const char *tdir = o.tokdir ? o.tokdir : engine_model_dir(e);
    if (tokenizer_load(tdir, &tok, err, sizeof err)) {
        fprintf(stderr, "bench grammar --engine: the tokenizer: %s\n", err);
        engine_destroy(e);
        rc = 1;
        goto out;
    }
    int vocab = engine_vocab_size(e);
    grammar_vocab *v = structured_vocab_new(tok, vocab);
    grammar_options gopt = {.any_whitespace = !o.compact};
    grammar *probe =
        v ? grammar_compile(o.kind, o.text, strlen(o.text), &gopt, v, err, sizeof err) : NULL;
    if (!probe) {
        fprintf(stderr, "bench grammar --engine: %s\n", v ? err : "out of memory");
        rc = 1;
    } else {
        grammar_unref(probe);
        engine_stats st;
        engine_get_stats(e, &st);
        printf("engine: %s on %s (%s kernels), vocabulary %d, loaded in %.1f s; %d-token "
               "prompts, up to %d tokens out, temperature %g, %s grammar%s\n",
               o.model, o.device, st.kernels, vocab, t_load, o.prompt_len, o.max_tokens,
               (double)o.temperature, o.distinct ? "a distinct" : "one shared",
               o.distinct ? " per request" : " per run");
        printf("sampling threads (DISAGG_SAMPLE_THREADS) %d\n", st.sample_threads);
        printf(" seqs  mode     steps  rows/step  on dev   step ms  forward ms  sample ms  "
               "mask fill ms  mask wait ms  fill us/row     tok/s\n");
        rc = 0;
        for (int i = 0; i < o.n_seqs && !rc; i++)
            for (int m = 0; m < o.n_modes && !rc; m++)
                rc = run_one(e, v, &o, o.seqs[i], o.modes[m], vocab);
    }
    engine_destroy(e);
    grammar_vocab_free(v);
    tokenizer_free(tok);
out:
    free(owned);
    return rc;
}
