/*
 * moe_bench — `disagg bench moe`: the mixture-of-experts op alone (backend_moe_route +
 * backend_moe, kernels/backend.h) on random bf16 expert weights of one layer, beside the
 * device's copy ceiling measured in the same run (backend_measure).
 *
 *   disagg bench moe [--device cuda[:N]] [--experts 128] [--top-k 8] [--hidden 2048]
 *                    [--inter 768] [--tokens 1,64,4096] [--iters 50] [--routings 16]
 *
 * For each T: --routings different routings (random router logits through backend_moe_route)
 * are made first; a timed pass runs backend_moe once per routing, round-robin, so the experts
 * a call reads change from call to call (no L2 reuse across calls).  Printed per T: the mean
 * time of one call (eager: calls enqueued back to back, one sync; and, for T <= 64 where the
 * backend records graphs, one CUDA graph of --routings calls replayed), the route alone (one
 * call between two synchronisations: launch latency included), the
 * active bytes (the weights of the distinct experts the call's tokens chose, plus x and out)
 * and their rate against the copy ceiling.  DISAGG_MOE_GENERIC=1 (backend.c) forces the generic
 * form: run the benchmark again with it to compare.
 */
#include "bench/bench.h"

#include "base/clock.h"
#include "kernels/backend.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double now_s(void) {
    return (double)clock_now_ns() / 1e9;
}

static void usage(FILE *f) {
    fprintf(f, "usage: disagg bench moe [--device cuda[:N]] [--experts E] [--top-k K] "
               "[--hidden H] [--inter I] [--tokens T1,T2,..] [--iters N] [--routings R]\n"
               "  the mixture-of-experts op alone on random bf16 weights (defaults: the\n"
               "  Qwen3-30B-A3B layer: 128 experts, top 8, hidden 2048, inter 768; tokens\n"
               "  1,64,4096; 50 timed calls; 16 routings)\n");
}

static int parse_int(const char *flag, const char *v, int lo, int hi, int *out) {
    char *end;
    long x = strtol(v, &end, 10);
    if (!*v || *end || x < lo || x > hi) {
        fprintf(stderr, "disagg bench moe: %s '%s': need an integer in %d..%d\n", flag, v, lo, hi);
        return -EINVAL;
    }
    *out = (int)x;
    return 0;
}

/* random bf16 (bits of values in about [-1, 1)) */
static void fill_bf16(uint16_t *h, size_t n, uint64_t seed) {
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        /* sign, exponent 120..126, 7 mantissa bits */
        h[i] = (uint16_t)(((s >> 8) & 0x8000) | ((120 + (s % 7)) << 7) | ((s >> 20) & 0x7f));
    }
}

int bench_moe_main(int argc, char **argv) {
    const char *device = "cuda";
    int E = 128, K = 8, H = 2048, I = 768, iters = 50, R = 16;
    int Ts[16], nT = 0;
    const char *tokens = "1,64,4096";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "disagg bench moe: unknown option or missing value: '%s'\n", a);
            usage(stderr);
            return 2;
        }
        if (!strcmp(a, "--device"))
            device = v;
        else if (!strcmp(a, "--experts"))
            rc = parse_int(a, v, 1, BACKEND_MOE_MAX_EXPERTS, &E);
        else if (!strcmp(a, "--top-k"))
            rc = parse_int(a, v, 1, BACKEND_MOE_MAX_EXPERTS, &K);
        else if (!strcmp(a, "--hidden"))
            rc = parse_int(a, v, 8, 65536, &H);
        else if (!strcmp(a, "--inter"))
            rc = parse_int(a, v, 8, 65536, &I);
        else if (!strcmp(a, "--tokens"))
            tokens = v;
        else if (!strcmp(a, "--iters"))
            rc = parse_int(a, v, 1, 100000, &iters);
        else if (!strcmp(a, "--routings"))
            rc = parse_int(a, v, 1, 256, &R);
        else {
            fprintf(stderr, "disagg bench moe: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
        if (rc) return 2;
        i++;
    }
    if (K > E) {
        fprintf(stderr, "disagg bench moe: --top-k %d is more than --experts %d\n", K, E);
        return 2;
    }
    for (const char *p = tokens; *p && nT < 16;) {
        char buf[16];
        size_t n = strcspn(p, ",");
        if (n == 0 || n >= sizeof buf) {
            fprintf(stderr, "disagg bench moe: --tokens '%s': need T1,T2,.. (at most 16)\n",
                    tokens);
            return 2;
        }
        memcpy(buf, p, n);
        buf[n] = 0;
        if (parse_int("--tokens", buf, 1, 1 << 20, &Ts[nT++])) return 2;
        p += n + (p[n] == ',');
    }
    char err[512];
    backend *be = NULL;
    if (backend_open(device, NULL, &be, err, sizeof err)) {
        fprintf(stderr, "disagg bench moe: %s\n", err);
        return 1;
    }
    double copy_gbs = 0;
    if (backend_measure(be, &copy_gbs, NULL, 1, 1, 1) < 0) copy_gbs = 0;
    const char *gen = getenv("DISAGG_MOE_GENERIC");
    printf("moe bench: %s, experts %d, top %d, hidden %d, inter %d; copy ceiling %.0f GB/s%s\n",
           backend_name(be), E, K, H, I, copy_gbs,
           gen && !strcmp(gen, "1") ? " (the generic form: DISAGG_MOE_GENERIC=1)" : "");
    size_t ngu = (size_t)E * 2 * I * H, nd = (size_t)E * H * I;
    uint16_t *hw = malloc(sizeof(uint16_t) * (ngu > nd ? ngu : nd));
    if (!hw) {
        fprintf(stderr, "disagg bench moe: out of host memory for %zu weights\n", ngu);
        backend_close(be);
        return 1;
    }
    backend_dtype sgu, sd;
    fill_bf16(hw, ngu, 1);
    backend_buffer *bgu = backend_weights_load(be, hw, BACKEND_BF16, ngu, &sgu);
    fill_bf16(hw, nd, 2);
    backend_buffer *bd = bgu ? backend_weights_load(be, hw, BACKEND_BF16, nd, &sd) : NULL;
    free(hw);
    backend_stream *st = bd ? backend_stream_create(be) : NULL;
    int rc = 1;
    if (!st) {
        fprintf(stderr, "disagg bench moe: cannot load %.2f GB of expert weights on %s\n",
                (double)(ngu + nd) * 2 / 1e9, backend_name(be));
        goto out;
    }
    /* per-expert addresses into the stacked buffers, for a backend or form that wants them */
    const void **wg = calloc((size_t)E, sizeof *wg), **wu = calloc((size_t)E, sizeof *wu),
               **wdn = calloc((size_t)E, sizeof *wdn);
    if (!wg || !wu || !wdn) goto out_w;
    size_t es = backend_dtype_size(sgu);
    for (int e = 0; e < E; e++) {
        wg[e] = (const char *)backend_buffer_ptr(bgu) + (size_t)e * 2 * I * H * es;
        wu[e] = (const char *)wg[e] + (size_t)I * H * es;
        wdn[e] = (const char *)backend_buffer_ptr(bd) + (size_t)e * H * I * es;
    }
    int failed = 0;
    printf("%7s %12s %12s %12s %10s %10s %8s\n", "tokens", "route us", "moe us", "graph us",
           "active MB", "GB/s", "of copy");
    for (int ti = 0; ti < nT; ti++) {
        int T = Ts[ti], ok_t = 0;
        char *used = NULL;
        size_t nx = (size_t)T * H;
        uint16_t *hx = malloc(nx * 2);
        float *lg = malloc(sizeof(float) * (size_t)T * E);
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * K);
        backend_buffer *bx = backend_buffer_alloc(be, nx * 2, 0),
                       *bo = backend_buffer_alloc(be, nx * 4, 0),
                       *bl = backend_buffer_alloc(be, sizeof(float) * (size_t)T * E, 0),
                       *bid = backend_buffer_alloc(be, sizeof(int32_t) * (size_t)T * K * R, 0),
                       *bw = backend_buffer_alloc(be, sizeof(float) * (size_t)T * K * R, 0);
        if (!hx || !lg || !ids || !bx || !bo || !bl || !bid || !bw) {
            fprintf(stderr, "disagg bench moe: out of memory at T %d\n", T);
            goto next;
        }
        fill_bf16(hx, nx, 3 + T);
        if (backend_upload(st, backend_buffer_ptr(bx), hx, nx * 2)) goto next;
        double active = 0, t_route = 0;
        uint64_t s = 77 + T;
        used = calloc((size_t)E, 1);
        for (int r = 0; r < R && used; r++) {
            for (size_t i = 0; i < (size_t)T * E; i++) {
                s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                lg[i] = (float)((double)(s >> 11) / 9007199254740992.0 * 4.0 - 2.0);
            }
            int32_t *rid = (int32_t *)backend_buffer_ptr(bid) + (size_t)r * T * K;
            float *rw = (float *)backend_buffer_ptr(bw) + (size_t)r * T * K;
            if (backend_upload(st, backend_buffer_ptr(bl), lg, sizeof(float) * (size_t)T * E))
                goto next;
            backend_stream_sync(st);
            double t0 = now_s();
            int rr = backend_moe_route(st, rid, rw, backend_buffer_ptr(bl), T, E, K, 1);
            if (rr) {
                fprintf(stderr, "disagg bench moe: backend_moe_route failed at T %d (%d)\n", T, rr);
                goto next;
            }
            backend_stream_sync(st);
            t_route += now_s() - t0;
            if (backend_download(st, ids, rid, sizeof(int32_t) * (size_t)T * K)) goto next;
            memset(used, 0, (size_t)E);
            int ne = 0;
            for (size_t i = 0; i < (size_t)T * K; i++)
                if (ids[i] >= 0 && ids[i] < E && !used[ids[i]]) used[ids[i]] = 1, ne++;
            active += (double)ne * 3 * I * H * 2 + (double)nx * 2 + (double)nx * 4;
        }
        active /= R;
        backend_moe_op op = {.x = backend_buffer_ptr(bx),
                             .x_dt = BACKEND_BF16,
                             .T = T,
                             .hidden = H,
                             .inter = I,
                             .n_experts = E,
                             .top_k = K,
                             .w_gate = wg,
                             .w_up = wu,
                             .w_down = wdn,
                             .w_gate_up_all = backend_buffer_ptr(bgu),
                             .w_down_all = backend_buffer_ptr(bd),
                             .w_dt = sgu,
                             .out = backend_buffer_ptr(bo),
                             .out_dt = BACKEND_F32};
        /* warm-up (grows the workspaces), then the timed calls */
        int bad = 0;
        for (int r = 0; r < R && !bad; r++) {
            op.ids = (const int32_t *)backend_buffer_ptr(bid) + (size_t)r * T * K;
            op.weights = (const float *)backend_buffer_ptr(bw) + (size_t)r * T * K;
            bad = backend_moe(st, &op);
        }
        if (bad || backend_stream_sync(st)) {
            fprintf(stderr, "disagg bench moe: backend_moe failed at T %d (%d)\n", T, bad);
            goto next;
        }
        double t0 = now_s();
        for (int i = 0; i < iters && !bad; i++) {
            int r = i % R;
            op.ids = (const int32_t *)backend_buffer_ptr(bid) + (size_t)r * T * K;
            op.weights = (const float *)backend_buffer_ptr(bw) + (size_t)r * T * K;
            bad = backend_moe(st, &op);
        }
        bad = bad || backend_stream_sync(st);
        double us = (now_s() - t0) / iters * 1e6;
        /* one graph of R calls (padding sequences: no KV), T <= 64 */
        double gus = 0;
        int generic = gen && *gen && strcmp(gen, "0");
        if (!bad && T <= 64 && backend_graph_supported(be) && !generic) { /* the generic form
                                                                           may synchronise */
            int32_t *z = calloc((size_t)T * 4 + 2, sizeof(int32_t));
            int32_t *qo = malloc(sizeof(int32_t) * (size_t)(T + 1)),
                    *pos = malloc(sizeof(int32_t) * (size_t)T),
                    *seq = malloc(sizeof(int32_t) * (size_t)T),
                    *btp = calloc((size_t)T + 1, sizeof(int32_t));
            if (z && qo && pos && seq && btp) {
                for (int t = 0; t < T; t++)
                    qo[t] = t, pos[t] = -1, seq[t] = t;
                qo[T] = T;
                backend_batch b = {T, T, z, seq, pos, qo, z, btp, z, T, qo};
                int reps = 0;
                double g0 = 0;
                for (int pass = 0; pass < 3 + (iters + R - 1) / R && !bad; pass++) {
                    if (pass == 3) {
                        backend_stream_sync(st);
                        g0 = now_s();
                    }
                    if ((bad = backend_graph_plan(st, &b, 1, 1)) != 0) break;
                    int g = backend_graph_begin(st);
                    if (g < 0) {
                        bad = g;
                        break;
                    }
                    if (g == 0) {
                        int e2 = 0;
                        for (int r = 0; r < R && !e2; r++) {
                            op.ids = (const int32_t *)backend_buffer_ptr(bid) + (size_t)r * T * K;
                            op.weights = (const float *)backend_buffer_ptr(bw) + (size_t)r * T * K;
                            e2 = backend_moe(st, &op);
                        }
                        bad = backend_graph_end(st, !e2) || e2;
                    }
                    if (pass >= 3) reps++;
                }
                if (!bad && !backend_stream_sync(st) && reps)
                    gus = (now_s() - g0) / ((double)reps * R) * 1e6;
                backend_graph_reset(st);
                bad = 0;
            }
            free(z), free(qo), free(pos), free(seq), free(btp);
        }
        double best = gus > 0 && gus < us ? gus : us;
        double gbs = active / (best * 1e3);
        printf("%7d %12.1f %12.1f %12.1f %10.1f %10.0f %7.0f%%\n", T, t_route / R * 1e6, us, gus,
               active / 1e6, gbs, copy_gbs > 0 ? 100.0 * gbs / copy_gbs : 0.0);
        fflush(stdout);
        ok_t = 1;
    next:
        if (!ok_t) failed = 1;
        free(used), free(hx), free(lg), free(ids);
        backend_buffer_free(bx), backend_buffer_free(bo), backend_buffer_free(bl),
            backend_buffer_free(bid), backend_buffer_free(bw);
    }
    rc = failed;
out_w:
    free(wg), free(wu), free(wdn);
out:
    backend_stream_free(st);
    backend_buffer_free(bgu);
    backend_buffer_free(bd);
    backend_close(be);
    return rc;
}
