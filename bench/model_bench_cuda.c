/*
 * model_bench_cuda — `disagg bench model MODEL --device cuda`: the Qwen2 forward on the GPU
 * (CUDA module) beside the ceilings measured in the same run: HBM copy bandwidth
 * (cudaMemcpy device to device, bytes read + written) and the cuBLASLt bf16 GEMM rate
 * (8192^3 and the model's MLP shape at 4096 tokens).
 *   weights upload (page cache -> HBM), prefill of each --prompt-lens (one sequence, one
 *   forward), decode steps at each --batches with --context tokens already cached per
 *   sequence (KV contents do not change the timing), and batch 1 at --long-context.
 * decode bound = copy bandwidth / (weight bytes + KV bytes read per step).
 */
#include "bench/bench.h"

#include "base/clock.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_module.h"
#include "model/qwen2.h"
#include "model/qwen2_cuda.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BS      16
#define MAXLIST 16

static int parse_list(const char *flag, const char *v, int *out, int *n) {
    *n = 0;
    if (!v) goto bad;
    const char *p = v;
    while (*p && *n < MAXLIST) {
        char *end;
        long x = strtol(p, &end, 10);
        if (end == p || x < 1 || x > 1 << 20 || (*end && *end != ',')) goto bad;
        out[(*n)++] = (int)x;
        p = *end ? end + 1 : end;
    }
    if (*n) return 0;
bad:
    fprintf(stderr,
            "disagg bench model: %s '%s' is invalid; accepted: comma-separated integers in [1, "
            "1048576], at most %d\n",
            flag, v ? v : "", MAXLIST);
    return -1;
}

static double now_s(void) {
    return (double)clock_now_ns() / 1e9;
}

/* n_seqs sequences, one token each at position ctx + step, blocks laid out consecutively */
static int decode_run(qwen2_cuda *g, int n_seqs, int ctx, int steps, int32_t *tables, int per_seq,
                      double *sec) {
    qwen2_seq *q = calloc((size_t)n_seqs, sizeof *q);
    int32_t *tok = calloc((size_t)n_seqs, 4), *next = calloc((size_t)n_seqs, 4);
    if (!q || !tok || !next) return -ENOMEM;
    for (int i = 0; i < n_seqs; i++) {
        tok[i] = (i * 31 + 7) % 1000;
        for (int b = 0; b < per_seq; b++)
            tables[(size_t)i * per_seq + b] = i * per_seq + b;
    }
    int rc = 0;
    double best = 1e30;
    for (int round = 0; round < 2 && !rc; round++) {
        double t0 = 0;
        for (int s = 0; s < steps + 2 && !rc; s++) {
            if (s == 2) t0 = now_s(); /* two warm-up steps */
            for (int i = 0; i < n_seqs; i++)
                q[i] = (qwen2_seq){&tok[i], 1,    ctx + s, &tables[(size_t)i * per_seq],
                                   per_seq, NULL, 0};
            rc = qwen2_cuda_forward(g, q, n_seqs, next);
            for (int i = 0; i < n_seqs; i++)
                tok[i] = next[i];
        }
        double el = (now_s() - t0) / steps;
        if (el < best) best = el;
    }
    *sec = best;
    free(q), free(tok), free(next);
    return rc;
}

/* The path `disagg serve --device cuda` runs: model/qwen2.c over kernels/backend.h ops on
 * the CUDA backend (unfused ops, f32 activations, logits downloaded every step as the
 * engine's sampler needs them). */
static int serve_path(const char *model_arg, const int *prompts, int n_prompts, int ctx,
                      int long_ctx, int steps, int kv_dtype) {
    char err[4096];
    backend *be = NULL;
    backend_options o;
    backend_options_init(&o);
    if (backend_open("cuda", &o, &be, err, sizeof err)) {
        fprintf(stderr, "disagg bench model: %s\n", err);
        return -ENODEV;
    }
    qwen2_model m;
    if (qwen2_load_on(&m, model_arg, be, 0, err, sizeof err)) {
        fprintf(stderr, "disagg bench model: %s\n", err);
        backend_close(be);
        return -EIO;
    }
    const model_config *c = &m.cfg;
    int B = 32, max_prompt = 0;
    for (int i = 0; i < n_prompts; i++)
        max_prompt = prompts[i] > max_prompt ? prompts[i] : max_prompt;
    int per_ctx = (ctx + steps + 2 + BS - 1) / BS, per_long = (long_ctx + steps + 2 + BS - 1) / BS;
    int per_prompt = (max_prompt + BS - 1) / BS;
    int nb = B * per_ctx;
    if (per_long > nb) nb = per_long;
    if (per_prompt > nb) nb = per_prompt;
    kv_store kv;
    int max_tokens = max_prompt > B ? max_prompt : B;
    qwen2_state *s = qwen2_state_create(&m, max_tokens);
    int32_t *tables = calloc((size_t)nb, 4), *toks = calloc((size_t)max_tokens, 4);
    float *logits = malloc((size_t)B * c->vocab_size * 4);
    qwen2_seq *q = calloc((size_t)B, sizeof *q);
    int rc = kv_store_init_on(&kv, be, c, nb, BS, kv_dtype == DCU_F32 ? BACKEND_F32 : BACKEND_BF16,
                              BACKEND_BUF_KV);
    if (rc || !s || !tables || !toks || !logits || !q) {
        fprintf(stderr, "disagg bench model: serving path: out of memory\n");
        rc = -ENOMEM;
        goto out;
    }
    for (int b = 0; b < nb; b++)
        tables[b] = b;
    printf("\nserving path (disagg serve --device cuda: model/qwen2.c over kernels/backend.h, "
           "logits downloaded each step)\n");
    printf("%-28s %12s %14s\n", "prefill (one sequence)", "ms", "tok/s");
    for (int i = 0; i < n_prompts && !rc; i++) {
        int L = prompts[i];
        for (int t = 0; t < L; t++)
            toks[t] = (t * 7919 + 1) % (c->vocab_size < 100000 ? c->vocab_size : 100000);
        double best = 1e30;
        for (int r = 0; r < 3 && !rc; r++) {
            qwen2_seq one = {toks, L, 0, tables, (L + BS - 1) / BS, logits, 0};
            double s0 = now_s();
            rc = qwen2_forward(&m, s, &kv, &one, 1);
            double el = now_s() - s0;
            if (r && el < best) best = el;
        }
        printf("%-28d %12.2f %14.0f\n", L, best * 1e3, L / best);
    }
    for (int mode = 0; mode < 2 && !rc; mode++) {
        /* mode 0: every step eager (--enforce-eager); 1: decode steps as CUDA graphs (serve's
         * default); the first two steps (warm-up, record) are not timed */
        if (qwen2_state_set_graphs(s, mode ? B : 0) < 0) rc = -ENOMEM;
        printf("%-10s %8s %12s %12s   %s\n", "decode", "context", "ms/step", "tok/s",
               mode ? "CUDA graphs" : "eager (--enforce-eager)");
        int cases[2][2] = {{1, long_ctx}, {B, ctx}};
        for (int k = 0; k < 2 && !rc; k++) {
            int n = cases[k][0], C = cases[k][1], per = k ? per_ctx : per_long;
            double best = 1e30;
            for (int round = 0; round < 2 && !rc; round++) {
                double t0 = 0;
                for (int st = 0; st < steps + 2 && !rc; st++) {
                    if (st == 2) t0 = now_s();
                    for (int i = 0; i < n; i++) {
                        toks[i] = (i * 31 + st) % 1000;
                        q[i] = (qwen2_seq){&toks[i], 1,
                                           C + st,   &tables[(size_t)i * per],
                                           per,      logits + (size_t)i * c->vocab_size,
                                           0};
                    }
                    rc = qwen2_forward(&m, s, &kv, q, n);
                }
                double el = (now_s() - t0) / steps;
                if (el < best) best = el;
            }
            printf("%-10d %8d %12.3f %12.0f\n", n, C, best * 1e3, n / best);
        }
    }
    if (rc) fprintf(stderr, "disagg bench model: serving-path forward failed (%d)\n", rc);
out:
    free(tables), free(toks), free(logits), free(q);
    qwen2_state_free(s);
    kv_store_free(&kv);
    qwen2_free(&m);
    backend_close(be);
    return rc;
}

int bench_model_cuda_main(int argc, char **argv) {
    const char *model_arg = NULL;
    int prompts[MAXLIST] = {512, 4096}, n_prompts = 2;
    int batches[MAXLIST] = {1, 8, 32, 64, 128}, n_batches = 5;
    int ctx = 1024, long_ctx = 4096, steps = 32, json = 0, kv_dtype = DCU_BF16;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--batch-invariant")) return bench_model_inv_main(argc, argv);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end;
        if (!strcmp(a, "--device")) {
            i++;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--prompt-lens")) {
            if (parse_list(a, v, prompts, &n_prompts)) return 2;
            i++;
        } else if (!strcmp(a, "--batches")) {
            if (parse_list(a, v, batches, &n_batches)) return 2;
            i++;
        } else if (!strcmp(a, "--context") || !strcmp(a, "--long-context") ||
                   !strcmp(a, "--gen-len")) {
            long x = v ? strtol(v, &end, 10) : 0;
            if (!v || *end || x < 1 || x > 1 << 20) {
                fprintf(stderr,
                        "disagg bench model: %s '%s' is invalid; accepted: an integer in "
                        "[1, 1048576]\n",
                        a, v ? v : "");
                return 2;
            }
            *(!strcmp(a, "--context")   ? &ctx
              : !strcmp(a, "--gen-len") ? &steps
                                        : &long_ctx) = (int)x;
            i++;
        } else if (!strcmp(a, "--kv-cache-dtype")) {
            if (v && (!strcmp(v, "auto") || !strcmp(v, "bfloat16")))
                kv_dtype = DCU_BF16;
            else if (v && !strcmp(v, "float32"))
                kv_dtype = DCU_F32;
            else {
                fprintf(stderr,
                        "disagg bench model: --kv-cache-dtype '%s' is invalid; accepted: "
                        "auto, bfloat16, float32\n",
                        v ? v : "");
                return 2;
            }
            i++;
        } else if (a[0] == '-') {
            fprintf(stderr,
                    "disagg bench model --device cuda: unknown option '%s'; accepted: "
                    "--prompt-lens, --batches, --context, --long-context, --gen-len, "
                    "--kv-cache-dtype, --json\n",
                    a);
            return 2;
        } else if (!model_arg) {
            model_arg = a;
        } else {
            fprintf(stderr, "disagg bench model: unexpected argument '%s'\n", a);
            return 2;
        }
    }
    if (!model_arg) {
        fprintf(stderr, "usage: disagg bench model MODEL --device cuda [--prompt-lens 512,4096] "
                        "[--batches 1,8,32,64,128] [--context 1024] [--long-context 4096] "
                        "[--gen-len 32] [--kv-cache-dtype auto|bfloat16|float32] [--json]\n");
        return 2;
    }
    char err[4096];
    qwen2_model m;
    if (qwen2_load(&m, model_arg, 1, err, sizeof err)) {
        fprintf(stderr, "disagg bench model: %s\n", err);
        return 1;
    }
    const model_config *c = &m.cfg;
    /* lengths beyond the model's positions are dropped (small models), saying so */
    for (int i = 0; i < n_prompts; i++)
        if (prompts[i] > c->max_position) {
            printf("(prompt length %d skipped: max_position_embeddings %d)\n", prompts[i],
                   c->max_position);
            memmove(&prompts[i], &prompts[i + 1], (size_t)(n_prompts - i - 1) * sizeof *prompts);
            n_prompts--, i--;
        }
    if (long_ctx + steps + 2 > c->max_position && c->max_position > steps + 3) {
        printf("(long context %d lowered to %d: max_position_embeddings %d)\n", long_ctx,
               c->max_position - steps - 2, c->max_position);
        long_ctx = c->max_position - steps - 2;
    }
    int max_prompt = 0, max_batch = 0;
    for (int i = 0; i < n_prompts; i++)
        max_prompt = prompts[i] > max_prompt ? prompts[i] : max_prompt;
    for (int i = 0; i < n_batches; i++)
        max_batch = batches[i] > max_batch ? batches[i] : max_batch;
    int longest = max_prompt > long_ctx + steps + 2 ? max_prompt : long_ctx + steps + 2;
    if (longest > c->max_position || ctx + steps + 2 > c->max_position) {
        fprintf(stderr, "disagg bench model: %d positions exceed max_position_embeddings %d\n",
                longest, c->max_position);
        qwen2_free(&m);
        return 2;
    }
    int per_ctx = (ctx + steps + 2 + BS - 1) / BS, per_long = (longest + BS - 1) / BS;
    int n_blocks = max_batch * per_ctx > per_long ? max_batch * per_ctx : per_long;
    int max_tokens = max_prompt > max_batch ? max_prompt : max_batch;
    qwen2_cuda g;
    double t0 = now_s();
    if (qwen2_cuda_open(&g, &m, 0, max_tokens, max_batch, per_long, 1, err, sizeof err)) {
        fprintf(stderr, "disagg bench model: --device cuda: %s\n", err);
        qwen2_free(&m);
        return 1;
    }
    double upload_s = now_s() - t0;
    if (qwen2_cuda_kv_alloc(&g, c, n_blocks, BS, kv_dtype, err, sizeof err)) {
        fprintf(stderr, "disagg bench model: %s\n", err);
        qwen2_cuda_close(&g);
        qwen2_free(&m);
        return 1;
    }
    double copy = 0, gemm = 0, gemm_mlp = 0;
    g.api->measure(g.ctx, &copy, &gemm, 8192, 8192, 8192);
    g.api->measure(g.ctx, NULL, &gemm_mlp, 4096, 2 * c->intermediate_size, c->hidden_size);
    double h = c->hidden_size, kvd = (double)c->n_kv_heads * c->head_dim,
           inter = c->intermediate_size;
    double layer_params = h * h * 2 + h * kvd * 2 + 3 * h * inter;
    double wbytes =
        2.0 * (c->n_layers * layer_params +
               (double)c->vocab_size * h * (m.w.lm_head.data == m.w.embed.data ? 1 : 2));
    double head_bytes = 2.0 * c->vocab_size * h;
    double kv_tok = 2.0 * c->n_layers * kvd * (kv_dtype == DCU_BF16 ? 2 : 4);
    printf("GPU %s (%d SMs, %.0f GB), driver CUDA %d, built with %d\n", g.info.name, g.info.n_sm,
           g.info.total_mem / 1e9, g.info.driver_version, g.info.runtime_version);
    printf("model %s: %d layers, hidden %d, %d/%d heads, intermediate %d, vocab %d; %.2f GB of "
           "bf16 weights in HBM, KV %s\n",
           m.dir, c->n_layers, c->hidden_size, c->n_heads, c->n_kv_heads, c->intermediate_size,
           c->vocab_size, wbytes / 1e9, kv_dtype == DCU_BF16 ? "bf16" : "f32");
    printf("ceilings (this run): HBM copy %.0f GB/s (cudaMemcpy D2D, read+write); cuBLASLt bf16 "
           "GEMM %.0f TFLOP/s at 8192^3, %.0f TFLOP/s at %dx%dx%d\n",
           copy, gemm, gemm_mlp, 4096, 2 * c->intermediate_size, c->hidden_size);
    printf("weights page cache -> HBM: %.2f s (%.1f GB/s)\n", upload_s, wbytes / upload_s / 1e9);
    int rc = 0;
    int32_t *tables = calloc((size_t)n_blocks, 4), *toks = calloc((size_t)max_tokens, 4);
    printf("\n%-28s %12s %14s %12s\n", "prefill (one sequence)", "ms", "tok/s", "TFLOP/s");
    for (int i = 0; i < n_prompts && !rc; i++) {
        int L = prompts[i], nb = (L + BS - 1) / BS;
        for (int b = 0; b < nb; b++)
            tables[b] = b;
        for (int t = 0; t < L; t++)
            toks[t] = (t * 7919 + 1) % (c->vocab_size < 100000 ? c->vocab_size : 100000);
        double best = 1e30;
        for (int r = 0; r < 4 && !rc; r++) {
            int32_t next;
            qwen2_seq q = {toks, L, 0, tables, nb, NULL, 0};
            double s0 = now_s();
            rc = qwen2_cuda_forward(&g, &q, 1, &next);
            double el = now_s() - s0;
            if (r && el < best) best = el; /* first one warms up */
        }
        double flops = 2.0 * c->n_layers * layer_params * L + 2.0 * h * c->vocab_size +
                       c->n_layers * 2.0 * 2.0 * h * (double)L * (L + 1) / 2.0;
        printf("%-28d %12.2f %14.0f %12.1f\n", L, best * 1e3, L / best, flops / best / 1e12);
    }
    printf("\n%-10s %8s %12s %12s %14s %12s\n", "decode", "context", "ms/step", "tok/s",
           "GB/s read", "of copy bw");
    int cases[MAXLIST + 1][2], n_cases = 0;
    cases[n_cases][0] = 1, cases[n_cases++][1] = long_ctx;
    for (int i = 0; i < n_batches; i++)
        cases[n_cases][0] = batches[i], cases[n_cases++][1] = ctx;
    for (int i = 0; i < n_cases && !rc; i++) {
        int B = cases[i][0], C = cases[i][1];
        int per = (C + steps + 2 + BS - 1) / BS;
        if ((long)per * B > n_blocks) continue;
        double sec = 0;
        rc = decode_run(&g, B, C, steps, tables, per, &sec);
        double bytes = wbytes - head_bytes + head_bytes + kv_tok * (C + steps / 2.0) * B;
        printf("%-10d %8d %12.3f %12.0f %14.0f %11.0f%%\n", B, C, sec * 1e3, B / sec,
               bytes / sec / 1e9, 100.0 * bytes / sec / 1e9 / copy);
    }
    printf("(best of 2 rounds of %d steps after 2 warm-ups; greedy argmax on the device, no logits "
           "download; eager launches, no CUDA graphs)\n",
           steps);
    if (rc) fprintf(stderr, "disagg bench model: CUDA forward failed (%d)\n", rc);
    qwen2_cuda_close(&g); /* frees the fused copy's HBM before the serving path loads its own */
    if (!rc) rc = serve_path(model_arg, prompts, n_prompts, ctx, long_ctx, steps, kv_dtype);
    (void)json;
    free(tables), free(toks);
    qwen2_free(&m);
    return rc ? 1 : 0;
}
