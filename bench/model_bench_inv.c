/*
 * model_bench_inv — `disagg bench model MODEL --device cuda --batch-invariant`: what the
 * batch-invariant mode (kernels/cuda/cuda_invariant.h) costs on the serving path
 * (model/decoder.c over kernels/backend.h, as `disagg serve --device cuda` runs it), against
 * the fast mode in the same run: prefill of --batches sequences of --prompt-len tokens (in
 * forward calls of at most --max-tokens tokens, like --max-num-batched-tokens) and decode
 * steps of --batches sequences at --context cached tokens (CUDA graphs, serve's default).
 * --inv-gemm-m M1,M2..: one invariant run per reference row count of the GEMM algorithm
 * choice ($DISAGG_CUDA_INV_GEMM_M; default: the module's).
 */
#include "bench/bench.h"
#include "bench/model_bench_args.h"

#include "base/clock.h"
#include "kernels/backend.h"
#include "model/decoder.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define IB_BS   16
#define IB_MAXL MB_MAXLIST

static double ib_now(void) {
    return (double)clock_now_ns() / 1e9;
}

typedef struct ib_result {
    double prefill_tps[IB_MAXL];        /* tokens/s per batch */
    double long_tps;                    /* one --long-prompt prompt */
    double decode_ms[IB_MAXL][IB_MAXL]; /* ms per step per context, batch */
} ib_result;

/* best tokens/s of n prompts of plen tokens (toks: n * plen) from an empty cache */
static int ib_prefill(const decoder_model *m, decoder_state *s, const kv_store *kv, decoder_seq *q,
                      int32_t *toks, int32_t *tables, int per, float *logits, int n, int plen,
                      int max_tokens, double *tps) {
    int rc = 0, per_call = max_tokens / plen < 1 ? 1 : max_tokens / plen, V = m->cfg.vocab_size;
    double best = 1e30;
    for (int r = 0; r < 3 && !rc; r++) {
        double t0 = ib_now();
        for (int s0 = 0; s0 < n && !rc; s0 += per_call) {
            int k = n - s0 < per_call ? n - s0 : per_call;
            for (int i = 0; i < k; i++)
                q[i] = (decoder_seq){
                    toks + (size_t)(s0 + i) * plen, plen, 0,   tables + (size_t)(s0 + i) * per, per,
                    logits + (size_t)i * V,         0,    NULL, NULL};
            rc = decoder_forward(m, s, kv, q, k);
        }
        double el = ib_now() - t0;
        if (r && el < best) best = el; /* the first round warms up */
    }
    *tps = (double)n * plen / best;
    return rc;
}

static int ib_run(const char *model_arg, int inv, const int *batches, int n_b, int plen,
                  int long_plen, const int *ctxs, int n_c, int steps, int max_tokens,
                  ib_result *res) {
    char err[4096];
    backend *be = NULL;
    backend_options o;
    backend_options_init(&o);
    o.batch_invariant = inv;
    if (backend_open("cuda", &o, &be, err, sizeof err)) {
        fprintf(stderr, "disagg bench model: %s\n", err);
        return -ENODEV;
    }
    decoder_model m;
    if (decoder_load_on(&m, model_arg, be, 0, err, sizeof err)) {
        fprintf(stderr, "disagg bench model: %s\n", err);
        backend_close(be);
        return -EIO;
    }
    const model_config *c = &m.cfg;
    int B = 1, ctx = 0;
    for (int i = 0; i < n_b; i++)
        B = batches[i] > B ? batches[i] : B;
    for (int i = 0; i < n_c; i++)
        ctx = ctxs[i] > ctx ? ctxs[i] : ctx;
    if (long_plen > max_tokens) max_tokens = long_plen;
    int len = plen > ctx + steps + 2 ? plen : ctx + steps + 2;
    if (long_plen > len) len = long_plen;
    int per = (len + IB_BS - 1) / IB_BS, nb = B * per;
    kv_store kv;
    decoder_state *s = decoder_state_create(&m, max_tokens);
    size_t ntok = (size_t)B * plen + B;
    if (ntok < (size_t)long_plen) ntok = (size_t)long_plen;
    int32_t *tables = calloc((size_t)nb, 4), *toks = calloc(ntok, 4);
    float *logits = malloc((size_t)B * c->vocab_size * 4);
    decoder_seq *q = calloc((size_t)B, sizeof *q);
    int rc = kv_store_init_on(&kv, be, c, nb, IB_BS, BACKEND_BF16, BACKEND_BUF_KV);
    if (rc || !s || !tables || !toks || !logits || !q) {
        fprintf(stderr, "disagg bench model: --batch-invariant: out of memory\n");
        rc = rc ? rc : -ENOMEM;
        goto out;
    }
    for (int b = 0; b < nb; b++)
        tables[b] = b;
    for (size_t t = 0; t < ntok; t++)
        toks[t] = (int32_t)((t * 7919 + 1) % (c->vocab_size < 100000 ? c->vocab_size : 100000));
    for (int bi = 0; bi < n_b && !rc; bi++)
        rc = ib_prefill(&m, s, &kv, q, toks, tables, per, logits, batches[bi], plen, max_tokens,
                        &res->prefill_tps[bi]);
    if (!rc && long_plen > 0)
        rc = ib_prefill(&m, s, &kv, q, toks, tables, per, logits, 1, long_plen, max_tokens,
                        &res->long_tps);
    if (!rc && decoder_state_set_graphs(s, B) < 0) rc = -ENOMEM;
    for (int cb = 0; cb < n_c * n_b && !rc; cb++) {
        int ci = cb / n_b, bi = cb % n_b, ctx = ctxs[ci];
        int n = batches[bi];
        double best = 1e30;
        for (int round = 0; round < 2 && !rc; round++) {
            double t0 = 0;
            for (int st = 0; st < steps + 2 && !rc; st++) {
                if (st == 2) t0 = ib_now();
                for (int i = 0; i < n; i++) {
                    toks[i] = (i * 31 + st) % 1000;
                    q[i] = (decoder_seq){&toks[i], 1,
                                         ctx + st, tables + (size_t)i * per,
                                         per,      logits + (size_t)i * c->vocab_size,
                                         0,        NULL, NULL};
                }
                rc = decoder_forward(&m, s, &kv, q, n);
            }
            double el = (ib_now() - t0) / steps;
            if (el < best) best = el;
        }
        res->decode_ms[ci][bi] = best * 1e3;
    }
    if (rc) fprintf(stderr, "disagg bench model: --batch-invariant: forward failed (%d)\n", rc);
out:
    free(tables), free(toks), free(logits), free(q);
    decoder_state_free(s);
    kv_store_free(&kv);
    decoder_free(&m);
    backend_close(be);
    return rc;
}

int bench_model_inv_main(int argc, char **argv) {
    const char *model_arg = NULL;
    int batches[IB_MAXL] = {1, 8, 32, 64}, n_b = 4, mrefs[IB_MAXL] = {0}, n_m = 1;
    int plen = 512, ctxs[IB_MAXL] = {1024}, n_c = 1, long_plen = 0, steps = 32, max_tokens = 8192;
    int inv_flag = 0; /* --batch-invariant: how the caller got here */
    const mb_opt opts[] = {
        {"--batch-invariant", MB_FLAG, &inv_flag, NULL},
        {"--batches", MB_LIST, batches, &n_b},
        {"--prompt-len", MB_INT, &plen, NULL},
        {"--long-prompt", MB_INT, &long_plen, NULL},
        {"--context", MB_LIST, ctxs, &n_c},
        {"--gen-len", MB_INT, &steps, NULL},
        {"--max-tokens", MB_INT, &max_tokens, NULL},
        {"--inv-gemm-m", MB_LIST, mrefs, &n_m},
    };
    int rc = mb_parse_args(argc, argv, "disagg bench model --device cuda --batch-invariant", opts,
                           (int)(sizeof opts / sizeof opts[0]),
                           "usage: disagg bench model MODEL --device cuda --batch-invariant "
                           "[--batches 1,8,32,64] [--prompt-len 512] [--long-prompt N] "
                           "[--context 1024[,4096..]] [--gen-len 32] [--max-tokens 8192] "
                           "[--inv-gemm-m M,...]",
                           &model_arg);
    if (rc) return rc < 0 ? 0 : rc;
    if (max_tokens < plen) max_tokens = plen;
    ib_result fast, inv[IB_MAXL];
    memset(&fast, 0, sizeof fast);
    memset(inv, 0, sizeof inv);
    printf(
        "batch-invariant mode vs fast mode, serving path (model/decoder.c over kernels/backend.h, "
        "CUDA graphs for decode), one process\n");
    rc = ib_run(model_arg, 0, batches, n_b, plen, long_plen, ctxs, n_c, steps, max_tokens, &fast);
    for (int k = 0; k < n_m && !rc; k++) {
        if (mrefs[k] > 0) {
            char b[32];
            snprintf(b, sizeof b, "%d", mrefs[k]);
            setenv("DISAGG_CUDA_INV_GEMM_M", b, 1);
        }
        rc = ib_run(model_arg, 1, batches, n_b, plen, long_plen, ctxs, n_c, steps, max_tokens,
                    &inv[k]);
    }
    if (rc) return 1;
    for (int k = 0; k < n_m; k++) {
        if (mrefs[k] > 0)
            printf("\ninvariant GEMM algorithms chosen at M = %d (DISAGG_CUDA_INV_GEMM_M)\n",
                   mrefs[k]);
        printf("prefill (tokens/s)\n%-12s %14s %14s %8s\n", "batch", "fast", "invariant", "slower");
        for (int i = 0; i < n_b; i++)
            printf("%-4d x %-5d %14.0f %14.0f %7.1f%%\n", batches[i], plen, fast.prefill_tps[i],
                   inv[k].prefill_tps[i],
                   100.0 * (fast.prefill_tps[i] / inv[k].prefill_tps[i] - 1.0));
        if (long_plen > 0)
            printf("%-4d x %-5d %14.0f %14.0f %7.1f%%\n", 1, long_plen, fast.long_tps,
                   inv[k].long_tps, 100.0 * (fast.long_tps / inv[k].long_tps - 1.0));
        printf("decode (ms per step)\n%-6s %-8s %12s %12s %8s\n", "batch", "context", "fast",
               "invariant", "slower");
        for (int ci = 0; ci < n_c; ci++)
            for (int i = 0; i < n_b; i++)
                printf("%-6d %-8d %12.3f %12.3f %7.1f%%\n", batches[i], ctxs[ci],
                       fast.decode_ms[ci][i], inv[k].decode_ms[ci][i],
                       100.0 * (inv[k].decode_ms[ci][i] / fast.decode_ms[ci][i] - 1.0));
    }
    printf("(prefill: --batches sequences of %d tokens (and one of --long-prompt %d) from an "
           "empty cache, forward calls of <= %d tokens, best of 2 after a warm-up; decode: %d "
           "steps at each --context after 2 warm-ups, best of 2 rounds; bf16 KV)\n",
           plen, long_plen, max_tokens > long_plen ? max_tokens : long_plen, steps);
    return 0;
}
