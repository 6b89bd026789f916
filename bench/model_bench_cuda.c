/*
 * model_bench_cuda — `disagg bench model MODEL --device cuda`: the serving Qwen2 forward
 * (model/decoder.c over kernels/backend.h on the CUDA backend) beside the ceilings measured in
 * the same run: HBM copy bandwidth
 * (cudaMemcpy device to device, bytes read + written) and the cuBLASLt bf16 GEMM rate
 * (8192^3 and the model's MLP shape at 4096 tokens).
 *   weights upload (page cache -> HBM), prefill of each --prompt-lens (one sequence, one
 *   forward), decode steps at each --batches with --context tokens already cached per
 *   sequence (KV contents do not change the timing), and batch 1 at --long-context.
 * decode bound = copy bandwidth / (weight bytes + KV bytes read per step).
 */
#include "bench/bench.h"
#include "bench/model_bench_args.h"
#include "bench/model_bench_moe.h"

#include "base/clock.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_module.h" /* DCU_F32 / DCU_BF16 */
#include "model/decoder.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BS 16

static double now_s(void) {
    return (double)clock_now_ns() / 1e9;
}

/* bytes a parameter of a matrix stored as dt (scales bn x bk for FP8) costs the decode: an
 * FP8 matrix's e4m3 byte and its share of the f32 scales (its bf16 twin is read by the
 * prefill GEMMs only), else the dtype's size */
static double read_bytes_per_param(backend_dtype dt, const backend_wscale *ws) {
    if (dt == BACKEND_F8E4M3)
        return 1.0 + 4.0 / ((double)ws->block_n * ws->block_k);
    return (double)backend_dtype_size(dt);
}

/* n_seqs sequences, one token each at position ctx + step, blocks laid out consecutively;
 * greedy on the device (decoder_seq.argmax: only the ids come back, as serve does for greedy
 * requests without logprobs) */
static int decode_run(const decoder_model *m, decoder_state *s, const kv_store *kv, int n_seqs,
                      int ctx, int steps, int32_t *tables, int per_seq, double *sec) {
    decoder_seq *q = calloc((size_t)n_seqs, sizeof *q);
    int32_t *tok = calloc((size_t)n_seqs, 4), *next = calloc((size_t)n_seqs, 4);
    if (!q || !tok || !next) {
        free(q), free(tok), free(next);
        return -ENOMEM;
    }
    for (int i = 0; i < n_seqs; i++) {
        tok[i] = (i * 31 + 7) % 1000;
        for (int b = 0; b < per_seq; b++)
            tables[(size_t)i * per_seq + b] = i * per_seq + b;
    }
    int rc = 0;
    double best = 1e30;
    for (int round = 0; round < 2 && !rc; round++) {
        double t0 = 0;
        for (int st = 0; st < steps + 2 && !rc; st++) {
            if (st == 2) t0 = now_s(); /* two warm-up steps (the graph's warm-up and recording) */
            for (int i = 0; i < n_seqs; i++)
                q[i] = (decoder_seq){.tokens = &tok[i],
                                     .n_tokens = 1,
                                     .start_pos = ctx + st,
                                     .block_table = &tables[(size_t)i * per_seq],
                                     .n_blocks = per_seq,
                                     .argmax = &next[i]};
            rc = decoder_forward(m, s, kv, q, n_seqs);
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

/* One prefill of L tokens (one sequence, one forward), best of 3 after a warm-up; prints its
 * row.  active_layers: the layers' matrix parameters one token multiplies with. */
static int prefill_row(const decoder_model *m, decoder_state *s, const kv_store *kv, int L,
                       double active_layers, int32_t *tables, int32_t *toks) {
    const model_config *c = &m->cfg;
    double h = c->hidden_size, best = 1e30;
    int nb = (L + BS - 1) / BS, rc = 0;
    for (int b = 0; b < nb; b++)
        tables[b] = b;
    for (int t = 0; t < L; t++)
        toks[t] = (t * 7919 + 1) % (c->vocab_size < 100000 ? c->vocab_size : 100000);
    for (int r = 0; r < 4 && !rc; r++) {
        int32_t next;
        decoder_seq q = {
            .tokens = toks, .n_tokens = L, .block_table = tables, .n_blocks = nb, .argmax = &next};
        double s0 = now_s();
        rc = decoder_forward(m, s, kv, &q, 1);
        double el = now_s() - s0;
        if (r && el < best) best = el; /* first one warms up */
    }
    double flops = 2.0 * active_layers * L + 2.0 * h * c->vocab_size +
                   c->n_layers * 2.0 * 2.0 * (double)c->q_dim * (double)L * (L + 1) / 2.0;
    if (!rc) printf("%-28d %12.2f %14.0f %12.1f\n", L, best * 1e3, L / best, flops / best / 1e12);
    return rc;
}

int bench_model_cuda_main(int argc, char **argv) {
    const char *model_arg = NULL;
    int prompts[MB_MAXLIST] = {512, 4096}, n_prompts = 2;
    int batches[MB_MAXLIST] = {1, 8, 32, 64, 128}, n_batches = 5;
    int ctx = 1024, long_ctx = 4096, steps = 32, json = 0, kv_dtype = DCU_BF16;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--batch-invariant")) return bench_model_inv_main(argc, argv);
    const char *kv_arg = NULL, *lf_arg = NULL, *q_arg = NULL;
    int dummy = 0;
    const mb_opt opts[] = {
        {"--load-format", MB_WORD, &lf_arg, NULL},
        {"--prompt-lens", MB_LIST, prompts, &n_prompts},
        {"--batches", MB_LIST, batches, &n_batches},
        {"--context", MB_INT, &ctx, NULL},
        {"--long-context", MB_INT, &long_ctx, NULL},
        {"--gen-len", MB_INT, &steps, NULL},
        {"--kv-cache-dtype", MB_WORD, &kv_arg, NULL},
        {"--json", MB_FLAG, &json, NULL},
        {"--quantization", MB_WORD, &q_arg, NULL},
    };
    int rc = mb_parse_args(argc, argv, "disagg bench model --device cuda", opts,
                           (int)(sizeof opts / sizeof opts[0]),
                           "usage: disagg bench model MODEL --device cuda [--prompt-lens 512,4096] "
                           "[--batches 1,8,32,64,128] [--context 1024] [--long-context 4096] "
                           "[--gen-len 32] [--kv-cache-dtype auto|bfloat16|float32] "
                           "[--load-format auto|safetensors|dummy] [--quantization none|fp8] "
                           "[--json]",
                           &model_arg);
    if (rc) return rc < 0 ? 0 : rc;
    if (lf_arg && mb_load_format(lf_arg, &dummy)) return 2;
    if (q_arg && strcmp(q_arg, "none") && strcmp(q_arg, "fp8")) {
        fprintf(stderr,
                "disagg bench model: --quantization '%s' is not supported; accepted: none, fp8\n",
                q_arg);
        return 2;
    }
    /* fp8: the weights quantized at load (with dummy weights: 128 x 128 blocks, model/weights.h) */
    int load_flags =
        (dummy ? DECODER_LOAD_DUMMY : 0) | (q_arg && !strcmp(q_arg, "fp8") ? DECODER_LOAD_FP8 : 0);
    if (kv_arg && !strcmp(kv_arg, "float32")) {
        kv_dtype = DCU_F32;
    } else if (kv_arg && strcmp(kv_arg, "auto") && strcmp(kv_arg, "bfloat16")) {
        fprintf(stderr,
                "disagg bench model: --kv-cache-dtype '%s' is invalid; accepted: auto, bfloat16, "
                "float32\n",
                kv_arg);
        return 2;
    }
    char err[4096];
    backend *be = NULL;
    backend_options o;
    backend_options_init(&o);
    o.progress = 1;
    if (backend_open("cuda", &o, &be, err, sizeof err)) {
        fprintf(stderr, "disagg bench model: %s\n", err);
        return 1;
    }
    decoder_model m;
    double t0 = now_s();
    if (decoder_load_ex(&m, model_arg, be, 1, load_flags, err, sizeof err)) {
        fprintf(stderr, "disagg bench model: %s\n", err);
        backend_close(be);
        return 1;
    }
    double upload_s = now_s() - t0;
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
        decoder_free(&m);
        backend_close(be);
        return 2;
    }
    int per_ctx = (ctx + steps + 2 + BS - 1) / BS, per_long = (longest + BS - 1) / BS;
    int n_blocks = max_batch * per_ctx > per_long ? max_batch * per_ctx : per_long;
    int max_tokens = max_prompt > max_batch ? max_prompt : max_batch;
    kv_store kv;
    rc = kv_store_init_on(&kv, be, c, n_blocks, BS,
                          kv_dtype == DCU_F32 ? BACKEND_F32 : BACKEND_BF16, BACKEND_BUF_KV);
    decoder_state *s = rc ? NULL : decoder_state_create(&m, max_tokens);
    if (!s) {
        fprintf(stderr,
                "disagg bench model: out of GPU memory for the KV cache (%d blocks) or "
                "the workspace (%d tokens)\n",
                n_blocks, max_tokens);
        if (!rc) kv_store_free(&kv);
        decoder_free(&m);
        backend_close(be);
        return 1;
    }
    double copy = 0, gemm = 0, gemm_mlp = 0;
    backend_measure(be, &copy, &gemm, 8192, 8192, 8192);
    backend_measure(be, NULL, &gemm_mlp, 4096, 2 * c->intermediate_size, c->hidden_size);
    double h = c->hidden_size, kvd = (double)c->n_kv_heads * c->head_dim;
    int tied = m.w.lm_head.data == m.w.embed.data;
    /* a mixture of experts: a token multiplies with its top_k (bench/model_bench_moe.h) */
    double all_params, active_layers;
    mbm_params(c, tied, &all_params, &active_layers);
    /* bytes a decode step reads a parameter of the layers' matrices (a mixture's experts
     * stay bf16, stacked: theirs) and of the lm_head, as stored (--quantization fp8: e4m3 +
     * scales, the lm_head bf16) */
    const layer_weights *L0 = &m.w.layers[0], *Le = L0;
    for (int l = 0; l < c->n_layers; l++)
        if (model_layer_is_moe(c, l)) {
            Le = &m.w.layers[l];
            break;
        }
    const weight_mat *lm = &m.w.lm_head;
    backend_wscale no_scale = {0};
    double bpp_layers = c->n_experts ? read_bytes_per_param(Le->expert_dt, &no_scale)
                                     : read_bytes_per_param(L0->wq.dtype, &L0->wq.scale),
           bpp_lm = read_bytes_per_param(lm->dtype, &lm->scale), vh = (double)c->vocab_size * h;
    int fp8 = L0->wq.dtype == BACKEND_F8E4M3;
    double wbytes = 2.0 * all_params; /* the bf16 checkpoint's bytes (the upload's source) */
    double kv_tok = 2.0 * c->n_layers * kvd * (kv_dtype == DCU_BF16 ? 2 : 4);
    printf("GPU %s\n", backend_name(be));
    printf("model %s: %d layers, hidden %d, %d/%d heads, intermediate %d, vocab %d; %.2f GB of "
           "bf16 weights%s, KV %s\n",
           m.dir, c->n_layers, c->hidden_size, c->n_heads, c->n_kv_heads, c->intermediate_size,
           c->vocab_size, wbytes / 1e9,
           !fp8                ? " in HBM"
           : L0->wq.scale.twin ? " (the layers' matrices in HBM as FP8 e4m3 + scales, which a "
                                 "decode step reads, and a bf16 twin for prefill)"
                               : " (the layers' matrices in HBM as FP8 e4m3 + scales only)",
           kv_dtype == DCU_BF16 ? "bf16" : "f32");
    printf("ceilings (this run): HBM copy %.0f GB/s (cudaMemcpy D2D, read+write); cuBLASLt bf16 "
           "GEMM %.0f TFLOP/s at 8192^3, %.0f TFLOP/s at %dx%dx%d\n",
           copy, gemm, gemm_mlp, 4096, 2 * c->intermediate_size, c->hidden_size);
    if (c->n_experts)
        printf("mixture of experts: %d experts of width %d, top %d; %.2f GB active per token "
               "(%s)\n",
               c->n_experts, c->moe_intermediate_size, c->n_experts_per_tok,
               2.0 * (active_layers + (double)c->vocab_size * h) / 1e9,
               backend_moe_generic(be) ? "generic MoE: a plain loop over experts"
                                       : "the backend's MoE kernels");
    printf("weights page cache -> HBM: %.2f s (%.1f GB/s)\n", upload_s, wbytes / upload_s / 1e9);
    printf(
        "the serving forward (model/decoder.c over kernels/backend.h, as disagg serve runs it)\n");
    int32_t *tables = calloc((size_t)n_blocks, 4), *toks = calloc((size_t)max_tokens, 4);
    if (!tables || !toks) rc = -ENOMEM;
    printf("\n%-28s %12s %14s %12s\n", "prefill (one sequence)", "ms", "tok/s", "TFLOP/s");
    for (int i = 0; i < n_prompts && !rc; i++)
        rc = prefill_row(&m, s, &kv, prompts[i], active_layers, tables, toks);
    int cases[MB_MAXLIST + 1][2], n_cases = 0;
    cases[n_cases][0] = 1, cases[n_cases++][1] = long_ctx;
    for (int i = 0; i < n_batches; i++)
        cases[n_cases][0] = batches[i], cases[n_cases++][1] = ctx;
    for (int mode = 1; mode >= 0 && !rc; mode--) {
        /* mode 1: decode steps as CUDA graphs (serve's default); 0: --enforce-eager */
        if (decoder_state_set_graphs(s, mode ? max_batch : 0) < 0) rc = -ENOMEM;
        printf("\n%-10s %8s %12s %12s %14s %12s   %s\n", "decode", "context", "ms/step", "tok/s",
               "GB/s read", "of copy bw", mode ? "CUDA graphs" : "eager (--enforce-eager)");
        for (int i = 0; i < n_cases && !rc; i++) {
            int B = cases[i][0], C = cases[i][1];
            /* eager: the two target cases, or every case under DISAGG_CUDA_PROF (its per-op
             * tables time eager steps only) */
            if (!mode && !(B == 1 || B == 32 || getenv("DISAGG_CUDA_PROF"))) continue;
            int per = (C + steps + 2 + BS - 1) / BS;
            if ((long)per * B > n_blocks) continue;
            double sec = 0;
            rc = decode_run(&m, s, &kv, B, C, steps, tables, per, &sec);
            double sp = mbm_step_params(c, B);
            double bytes = bpp_layers * (sp - vh) + bpp_lm * vh + kv_tok * (C + steps / 2.0) * B;
            printf("%-10d %8d %12.3f %12.0f %14.0f %11.0f%%\n", B, C, sec * 1e3, B / sec,
                   bytes / sec / 1e9, 100.0 * bytes / sec / 1e9 / copy);
        }
    }
    printf("(best of 2 rounds of %d steps after 2 warm-ups; greedy argmax on the device, only the "
           "ids downloaded%s)\n",
           steps,
           c->n_experts ? "; MoE bytes: the experts a batch reads under uniform routing" : "");
    /* the first correct version in the same run: the generic MoE (a plain loop over experts,
     * the routing read back to the host, eager) where the backend has its own kernels */
    if (!rc && c->n_experts && !backend_moe_generic(be)) {
        setenv("DISAGG_MOE_GENERIC", "1", 1);
        decoder_state_set_graphs(s, 0);
        printf("\nbaseline: DISAGG_MOE_GENERIC=1 (kernels/backend_moe.c: per expert, gather, "
               "gate_up + down GEMMs, weighted scatter-add on the host; eager)\n");
        printf("%-28s %12s %14s %12s\n", "prefill (one sequence)", "ms", "tok/s", "TFLOP/s");
        for (int i = 0; i < n_prompts && !rc; i++)
            rc = prefill_row(&m, s, &kv, prompts[i], active_layers, tables, toks);
        printf("%-10s %8s %12s %12s\n", "decode", "context", "ms/step", "tok/s");
        for (int i = 0; i < n_cases && !rc; i++) {
            int B = cases[i][0], C = cases[i][1], per = (C + steps + 2 + BS - 1) / BS;
            if (!(B == 1 || B == max_batch) || (long)per * B > n_blocks) continue;
            double sec = 0;
            rc = decode_run(&m, s, &kv, B, C, steps, tables, per, &sec);
            printf("%-10d %8d %12.3f %12.0f\n", B, C, sec * 1e3, B / sec);
        }
        unsetenv("DISAGG_MOE_GENERIC");
    }
    if (rc) fprintf(stderr, "disagg bench model: CUDA forward failed (%d)\n", rc);
    (void)json;
    free(tables), free(toks);
    decoder_state_free(s);
    kv_store_free(&kv);
    decoder_free(&m);
    backend_close(be);
    return rc ? 1 : 0;
}
