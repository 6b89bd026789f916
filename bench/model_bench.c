/*
 * model_bench — `disagg bench model MODEL --prompt-len N --gen-len M --threads T [--json]`:
 * prefill tok/s, decode tok/s and the weight-streaming GB/s decode achieves, beside the
 * machine's ceilings measured in the same run: memory read bandwidth (threads streaming a
 * 1 GiB buffer) and a reference GEMM rate (OpenBLAS sgemm at the MLP shape, f32).
 * decode bound = read bandwidth / bytes of weights per token; prefill is compared with the
 * GEMM rate through the matmul FLOPs it performs.
 */
#include "bench/bench.h"
#include "bench/model_bench_args.h"
#include "bench/model_bench_moe.h"

#include "base/clock.h"
#include "base/flags.h"
#include "kernels/cpu/cpu_matmul.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/decoder.h"

#include <cblas.h>
#include <errno.h>
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- ceilings ----------------------------------------------------------------- */

typedef struct bw_job {
    const float *buf; /* (n) */
    size_t n;         /* floats */
    int parts;        /* tasks */
    float sums[256];  /* per task, keeps the loads alive */
} bw_job;

__attribute__((target("avx2"))) static void bw_task(void *ctx, int t) {
    bw_job *j = ctx;
    size_t per = j->n / (size_t)j->parts, beg = per * (size_t)t, end = beg + per;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = beg; i + 32 <= end; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_load_ps(j->buf + i));
        a1 = _mm256_add_ps(a1, _mm256_load_ps(j->buf + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_load_ps(j->buf + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_load_ps(j->buf + i + 24));
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    j->sums[t] = tmp[0] + tmp[7];
}

/* Best of 5 passes over 1 GiB, GB/s. */
static double measure_read_bw(cpu_pool *pool) {
    size_t bytes = (size_t)1 << 30, n = bytes / 4;
    float *buf = aligned_alloc(64, bytes);
    if (!buf) return 0;
    for (size_t i = 0; i < n; i++)
        buf[i] = (float)(i & 7);
    bw_job j = {buf, n, cpu_pool_threads(pool) * 4, {0}};
    double best = 0;
    for (int r = 0; r < 5; r++) {
        uint64_t t0 = clock_now_ns();
        cpu_pool_run(pool, j.parts, bw_task, &j);
        double gbs = (double)bytes / (double)(clock_now_ns() - t0);
        if (gbs > best) best = gbs;
    }
    free(buf);
    return best;
}

/* OpenBLAS sgemm C(M,N) = A(M,K) B(N,K)^T at the MLP shape, best of 3, GFLOP/s. */
static double measure_gemm(int threads, int M, int N, int K) {
    openblas_set_num_threads(threads);
    float *a = malloc((size_t)M * K * 4), *b = malloc((size_t)N * K * 4),
          *c = malloc((size_t)M * N * 4);
    if (!a || !b || !c) return 0;
    for (size_t i = 0; i < (size_t)M * K; i++)
        a[i] = (float)(i % 13) * 0.01f;
    for (size_t i = 0; i < (size_t)N * K; i++)
        b[i] = (float)(i % 7) * 0.01f;
    double best = 0;
    for (int r = 0; r < 3; r++) {
        uint64_t t0 = clock_now_ns();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, a, K, b, K, 0.0f, c, N);
        double g = 2.0 * M * N * K / (double)(clock_now_ns() - t0);
        if (g > best) best = g;
    }
    free(a);
    free(b);
    free(c);
    return best;
}

/* ---- the benchmark ------------------------------------------------------------ */

static const char *bm_model;
static int bm_dummy;

static int bm_load_format(flags_parser *p, const flag_def *d, const char *v) {
    return mb_load_format(v, &bm_dummy) ? -1 : 0;
}

static int bm_positional(flags_parser *p, const char *word) {
    if (bm_model) {
        flags_error(p, "unexpected argument '%s'", word);
        return -1;
    }
    bm_model = word;
    return 0;
}

static int bm_device(flags_parser *p, const flag_def *d, const char *v) {
    if (!strcmp(v, "cpu")) return 0; /* cuda: chosen before the parse */
    flags_error(p, "%s '%s' is invalid; accepted: cpu, cuda", d->name, v);
    return -1;
}

/* CPU seconds this process used (all threads): on a shared machine, a decode's CPU time per
 * token moves much less with the other tenants than its wall-clock time does. */
static double process_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Decode of n sequences together (each with its own 32-token prompt, prefilled first),
 * gen tokens each: aggregate tok/s.  Best of `repeat` rounds of (1 sequence, n sequences). */
static double streams_round(const decoder_model *m, cpu_pool *pool, int n, int gen, int bs,
                            const int32_t *toks, int ntoks, double *cpu_s) {
    const model_config *c = &m->cfg;
    const int plen = 32 < ntoks ? 32 : ntoks, nb = (plen + gen + bs - 1) / bs;
    kv_store kv;
    decoder_state *s = decoder_state_init(m, n * plen > n ? n * plen : n, cpu_pool_threads(pool));
    int32_t *table = malloc((size_t)n * nb * sizeof *table), *next = malloc((size_t)n * 4);
    float *logits = malloc((size_t)n * c->vocab_size * 4);
    decoder_seq *q = calloc((size_t)n, sizeof *q);
    double tps = -1;
    if (!s || !table || !next || !logits || !q || kv_store_init(&kv, c, n * nb, bs)) goto out;
    for (int i = 0; i < n * nb; i++)
        table[i] = i;
    for (int i = 0; i < n; i++) /* prompts differ: rotated */
        q[i] =
            (decoder_seq){toks + i % (ntoks - plen + 1),      plen, 0,   table + (size_t)i * nb, nb,
                          logits + (size_t)i * c->vocab_size, 0,    NULL, NULL};
    if (decoder_forward(m, s, &kv, q, n)) goto out_kv;
    uint64_t t0 = clock_now_ns();
    double c0 = process_cpu_s();
    for (int g = 0; g < gen; g++) {
        for (int i = 0; i < n; i++) {
            const float *l = logits + (size_t)i * c->vocab_size;
            int best = 0;
            for (int v = 1; v < c->vocab_size; v++)
                if (l[v] > l[best]) best = v;
            next[i] = best;
            q[i] = (decoder_seq){next + i, 1,
                                 plen + g, table + (size_t)i * nb,
                                 nb,       logits + (size_t)i * c->vocab_size,
                                 0,        NULL, NULL};
        }
        if (decoder_forward(m, s, &kv, q, n)) goto out_kv;
    }
    tps = (double)n * gen / ((double)(clock_now_ns() - t0) / 1e9);
    *cpu_s = process_cpu_s() - c0;
out_kv:
    kv_store_free(&kv);
out:
    decoder_state_free(s);
    free(table);
    free(next);
    free(logits);
    free(q);
    return tps;
}

/* ... and the CPU seconds (all threads) per decode step of each, least over the rounds */
static int measure_streams(const decoder_model *m, cpu_pool *pool, int n, int gen, int repeat,
                           int bs, const int32_t *toks, int ntoks, double *one, double *many,
                           double *one_cpu, double *many_cpu) {
    *one = *many = 0;
    *one_cpu = *many_cpu = 1e30;
    for (int r = 0; r < repeat; r++) { /* alternated, so both see the same minutes */
        double ca = 0, cb = 0;
        double a = streams_round(m, pool, 1, gen, bs, toks, ntoks, &ca);
        double b = streams_round(m, pool, n, gen, bs, toks, ntoks, &cb);
        if (a < 0 || b < 0) return -1;
        *one = a > *one ? a : *one;
        *many = b > *many ? b : *many;
        *one_cpu = ca / gen < *one_cpu ? ca / gen : *one_cpu;
        *many_cpu = cb / gen < *many_cpu ? cb / gen : *many_cpu;
    }
    return 0;
}

int bench_model_main(int argc, char **argv) {
    const char *model_arg = NULL;
    int prompt_len = 512, gen_len = 32, threads = 0, json = 0, repeat = 2, streams = 0,
        block_size = 0;
    const char *kv_dt_arg = NULL;  /* checked after the parse: --device cuda parses its own */
    for (int i = 1; i < argc; i++) /* --device cuda: the GPU benchmark, its own options */
        if ((!strcmp(argv[i], "--device") && i + 1 < argc && !strcmp(argv[i + 1], "cuda")) ||
            !strcmp(argv[i], "--device=cuda"))
            return bench_model_cuda_main(argc, argv);
    const flag_def defs[] = {
        {FLAG_INT_("--prompt-len", &prompt_len, 1, 1 << 20),
         .help = "prompt tokens prefilled in one forward (default 512)"},
        {FLAG_INT_("--gen-len", &gen_len, 1, 1 << 20),
         .help = "tokens decoded one at a time after it (default 32)"},
        {FLAG_INT_("--threads", &threads, 1, 1024),
         .help = "worker threads (default: all online CPUs)"},
        {FLAG_BOOL_("--json", &json), .help = "one JSON object instead of the table"},
        {FLAG_INT_("--repeat", &repeat, 1, 100), .help = "measurement rounds, the best kept "
                                                         "(default 2)"},
        {FLAG_INT_("--streams", &streams, 0, 64), .metavar = "S",
         .help = "also: S sequences (32-token prompts) decoded together, aggregate tok/s beside 1 "
                 "sequence in the same rounds (default 0: off)"},
        {FLAG_STRING_("--kv-cache-dtype", &kv_dt_arg), .metavar = "float32|bfloat16",
         .help = "CPU KV-cache element type (default float32)"},
        {FLAG_INT_("--block-size", &block_size, 1, 1024),
         .help = "tokens per KV block, 1..1024 (default: disagg serve's on the CPU, 128)"},
        {FLAG_CUSTOM_("--load-format", NULL, bm_load_format), .metavar = "auto|safetensors|dummy",
         .help = "dummy: MODEL's config.json alone, random weights of its shapes (no safetensors; "
                 "bench/shapes/ has the common ones)"},
        {FLAG_CUSTOM_("--device", NULL, bm_device), .metavar = "cpu|cuda",
         .help = "cpu (default) or cuda: the GPU benchmark (options in docs/gpu.md)"},
        {FLAG_TEXT_("--batch-invariant", "with --device cuda: the batch-invariant mode against the "
                                         "fast mode (docs/gpu.md)")},
        {0}};
    const flag_def *tables[] = {defs, NULL};
    const flags_spec spec = {
        .cmd = "bench model",
        .usage = "usage: disagg bench model MODEL [--prompt-len N] [--gen-len M] [--threads T] "
                 "[--json]\n"
                 "  MODEL               model directory or hub name in the Hugging Face cache\n",
        .tables = tables,
        .help_col = 22,
        .positional = bm_positional};
    int pr = flags_parse(&spec, argc, argv);
    if (pr) return pr == FLAGS_HELP ? 0 : 2;
    model_arg = bm_model;
    if (!model_arg) {
        fprintf(stderr, "disagg bench model: MODEL is missing\n");
        flags_help(&spec, stderr);
        return 2;
    }
    int kv_dt = BACKEND_F32;
    if (kv_dt_arg && (backend_dtype_parse(kv_dt_arg, &kv_dt) ||
                      !backend_kv_dtype_ok(backend_cpu_default(), (backend_dtype)kv_dt))) {
        fprintf(stderr,
                "disagg bench model: --kv-cache-dtype '%s' is invalid on the CPU; accepted: "
                "float32, bfloat16\n",
                kv_dt_arg);
        return 2;
    }
    decoder_model m;
    char err[4096];
    if (decoder_load_ex(&m, model_arg, backend_cpu_default(), !bm_dummy, bm_dummy, err, sizeof err)) {
        fprintf(stderr, "disagg bench model: %s\n", err);
        return 1;
    }
    const model_config *c = &m.cfg;
    if (prompt_len + gen_len > c->max_position) {
        fprintf(stderr,
                "disagg bench model: --prompt-len %d + --gen-len %d exceeds "
                "max_position_embeddings %d\n",
                prompt_len, gen_len, c->max_position);
        decoder_free(&m);
        return 2;
    }
    cpu_pool *pool = cpu_pool_init(threads);
    threads = cpu_pool_threads(pool);
    int bs = block_size > 0 ? block_size : backend_block_size_default(backend_cpu_default()),
        n_blocks = (prompt_len + gen_len + bs - 1) / bs;
    kv_store kv;
    decoder_state *s = decoder_state_init(&m, prompt_len, threads);
    int32_t *table = malloc((size_t)n_blocks * sizeof *table),
            *toks = malloc((size_t)prompt_len * 4);
    float *logits = malloc((size_t)c->vocab_size * 4);
    if (!s || !table || !toks || !logits ||
        kv_store_init_on(&kv, backend_cpu_default(), c, n_blocks, bs, (backend_dtype)kv_dt,
                         BACKEND_BUF_KV)) {
        fprintf(stderr, "disagg bench model: out of memory\n");
        return 1;
    }
    for (int b = 0; b < n_blocks; b++)
        table[b] = b;
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < prompt_len; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        toks[i] = (int32_t)(x % 151643 % (uint64_t)c->vocab_size);
    }
    /* each round: ceilings, prefill (fresh KV), greedy decode; best of the rounds, so that a
     * busy machine penalises the model and the ceilings alike */
    double bw = 0, gemm = 0, prefill_s = 1e30, decode_s = 1e30, decode_cpu = 1e30,
           prefill_cpu = 1e30;
    int rc = 0;
    for (int r = 0; r < repeat && rc == 0; r++) {
        double v = measure_read_bw(pool);
        bw = v > bw ? v : bw;
        v = measure_gemm(threads, 512, c->intermediate_size, c->hidden_size);
        gemm = v > gemm ? v : gemm;
        decoder_seq q = {toks, prompt_len, 0, table, n_blocks, logits, 0, NULL, NULL};
        uint64_t t0 = clock_now_ns();
        double c0 = process_cpu_s();
        rc = decoder_forward(&m, s, &kv, &q, 1);
        double ps = (double)(clock_now_ns() - t0) / 1e9, pc = process_cpu_s() - c0;
        prefill_s = ps < prefill_s ? ps : prefill_s;
        prefill_cpu = pc < prefill_cpu ? pc : prefill_cpu;
        uint64_t t1 = clock_now_ns();
        double c1 = process_cpu_s();
        for (int i = 0; i < gen_len && rc == 0; i++) {
            int32_t next = 0;
            for (int v2 = 1; v2 < c->vocab_size; v2++)
                if (logits[v2] > logits[next]) next = v2;
            decoder_seq d = {&next, 1, prompt_len + i, table, n_blocks, logits, 0, NULL, NULL};
            rc = decoder_forward(&m, s, &kv, &d, 1);
        }
        double ds = (double)(clock_now_ns() - t1) / 1e9, dc = process_cpu_s() - c1;
        decode_s = ds < decode_s ? ds : decode_s;
        decode_cpu = dc < decode_cpu ? dc : decode_cpu;
    }
    if (rc) {
        fprintf(stderr, "disagg bench model: forward failed (%d)\n", rc);
        return 1;
    }
    double one_tps = 0, many_tps = 0, one_cpu = 0, many_cpu = 0;
    if (streams > 0 && measure_streams(&m, pool, streams, gen_len, repeat, bs, toks, prompt_len,
                                       &one_tps, &many_tps, &one_cpu, &many_cpu)) {
        fprintf(stderr, "disagg bench model: the --streams measurement failed\n");
        return 1;
    }
    /* work accounting */
    double h = c->hidden_size, all_params, active_layers; /* bench/model_bench_moe.h */
    int tied = m.w.lm_head.data == m.w.embed.data;
    mbm_params(c, tied, &all_params, &active_layers);
    double mm_flops_tok = 2.0 * active_layers; /* + lm_head on the last row only */
    double prefill_flops =
        mm_flops_tok * prompt_len + 2.0 * h * c->vocab_size +
        c->n_layers * 2.0 * 2.0 * (double)c->q_dim * (double)prompt_len * (prompt_len + 1) / 2.0;
    /* decode reads every matrix once per token; a mixture of experts its top_k experts */
    double bytes_tok = (double)m.w.matrix_bytes * mbm_step_params(c, 1) / all_params;
    double prefill_tps = prompt_len / prefill_s, decode_tps = gen_len / decode_s;
    double prefill_gflops = prefill_flops / prefill_s / 1e9;
    double decode_gbs = bytes_tok * decode_tps / 1e9, bound_tps = bw * 1e9 / bytes_tok;
    if (json) {
        printf("{\"model\":\"%s\",\"dtype\":\"%s\",\"kv_dtype\":\"%s\",\"isa\":\"%s\",\"threads\":%"
               "d,\"prompt_len\":%d,"
               "\"gen_len\":%d,\"block_size\":%d,"
               "\"prefill_tok_s\":%.2f,\"prefill_gflop_s\":%.2f,\"gemm_gflop_s\":%.2f,\"prefill_vs_"
               "gemm\":%.3f,"
               "\"decode_tok_s\":%.2f,\"decode_weight_gb_s\":%.2f,\"read_bw_gb_s\":%.2f,\"decode_"
               "bound_tok_s\":%.2f,"
               "\"decode_vs_bound\":%.3f,\"weight_bytes_per_token\":%.0f,\"repeat\":%d,"
               "\"streams\":%d,\"decode_1stream_tok_s\":%.2f,\"decode_streams_tok_s\":%.2f,"
               "\"decode_cpu_ms_per_token\":%.3f,\"prefill_cpu_ms_per_token\":%.3f,"
               "\"decode_1stream_cpu_ms_per_step\":%.3f,\"decode_streams_cpu_ms_per_step\":%.3f}\n",
               m.dir, cpu_dtype_name((cpu_dtype)m.w.dtype),
               backend_dtype_name((backend_dtype)kv_dt), cpu_isa_name(cpu_isa_get()), threads,
               prompt_len, gen_len, bs, prefill_tps, prefill_gflops, gemm, prefill_gflops / gemm,
               decode_tps, decode_gbs, bw, bound_tps, decode_tps / bound_tps, bytes_tok, repeat,
               streams, one_tps, many_tps, 1e3 * decode_cpu / gen_len,
               1e3 * prefill_cpu / prompt_len, 1e3 * one_cpu, 1e3 * many_cpu);
    } else {
        printf("model %s (%s weights, %d layers, hidden %d, %s KV in blocks of %d), %d threads, "
               "kernels %s\n",
               m.dir, cpu_dtype_name((cpu_dtype)m.w.dtype), c->n_layers, c->hidden_size,
               backend_dtype_name((backend_dtype)kv_dt), bs, threads, cpu_isa_describe());
        printf("%-34s %12s %14s %10s\n", "measurement", "value", "ceiling", "of ceiling");
        printf("%-34s %10.1f/s %14s %10s\n", "prefill tokens (one forward)", prefill_tps, "", "");
        printf("%-34s %8.1f GF/s %9.1f GF/s %9.0f%%\n", "prefill matmul+attention FLOP rate",
               prefill_gflops, gemm, 100 * prefill_gflops / gemm);
        printf("%-34s %10.2f/s %12.2f/s %9.0f%%\n", "decode tokens (batch 1)", decode_tps,
               bound_tps, 100 * decode_tps / bound_tps);
        printf("%-34s %8.2f GB/s %9.2f GB/s %9.0f%%\n", "decode weight streaming", decode_gbs, bw,
               100 * decode_gbs / bw);
        printf("%-34s %7.2f ms/tok\n", "prefill CPU time (all threads)",
               1e3 * prefill_cpu / prompt_len);
        printf("%-34s %7.2f ms/tok\n", "decode CPU time (all threads)", 1e3 * decode_cpu / gen_len);
        printf("(weights per token %.0f MB, tied lm_head counted once; ceilings: %d-thread memory "
               "read "
               "of 1 GiB, OpenBLAS sgemm %dx%dx%d; best of %d rounds)\n",
               bytes_tok / 1e6, threads, 512, c->intermediate_size, c->hidden_size, repeat);
        if (streams > 0)
            printf("decode %d streams together: %.2f tok/s aggregate; 1 stream: %.2f tok/s; "
                   "ratio %.2fx (32-token prompts, %d tokens each, best of %d alternated "
                   "rounds)\n",
                   streams, many_tps, one_tps, many_tps / one_tps, gen_len, repeat);
        if (streams > 0)
            printf("decode CPU time per step (all threads): %d streams %.2f ms, 1 stream %.2f ms: "
                   "ratio %.2fx in CPU time\n",
                   streams, 1e3 * many_cpu, 1e3 * one_cpu, streams * one_cpu / many_cpu);
    }
    free(table);
    free(toks);
    free(logits);
    kv_store_free(&kv);
    decoder_state_free(s);
    cpu_pool_free(pool);
    decoder_free(&m);
    return 0;
}
