/*
 * collective_bench — `disagg bench collective`: the cost of the CPU tensor-parallel group's
 * shared-memory collectives (kernels/collective.h) alone, no model: N ranks as processes
 * (forked, each on its own handle of the segment, as serve's workers are) doing the sharded
 * forward's all-reduce of a decode step's hidden state (one token: hidden floats) and of a
 * prefill chunk's, and the lm_head's all-gather of a logits row.  Prints microseconds per
 * call (median over the iterations, rank 0's clock), the same layout for each size.
 */
#include "base/flags.h"
#include "bench/bench.h"
#include "kernels/collective.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int ranks = 2, hidden = 896, prefill = 512, vocab = 151936, iters = 2000;

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* every rank runs this; rank 0 prints */
static int run(collective *c) {
    size_t sizes[3] = {(size_t)hidden, (size_t)hidden * (size_t)prefill,
                       (size_t)(vocab + ranks - 1) / (size_t)ranks};
    const char *what[3] = {"all-reduce, decode (1 token x hidden)",
                           "all-reduce, prefill (prefill tokens x hidden)",
                           "all-gather, one logits row (vocab / N per rank)"};
    float *buf = calloc(sizes[1], sizeof *buf), *all = calloc(sizes[2] * (size_t)ranks, 4);
    double *t = calloc((size_t)iters, sizeof *t);
    if (!buf || !all || !t) return 1;
    for (int k = 0; k < 3; k++) {
        int n_it = k == 1 ? iters / 20 + 1 : iters;
        for (int i = 0; i < n_it; i++) {
            double t0 = now_us();
            int rc = k == 2 ? collective_all_gather(c, NULL, all, buf, sizes[2] * 4)
                            : collective_all_reduce(c, NULL, buf, BACKEND_F32, sizes[k]);
            if (rc) return 1;
            t[i] = now_us() - t0;
        }
        qsort(t, (size_t)n_it, sizeof *t, cmp);
        if (collective_rank(c) == 0)
            printf("%-50s %9zu floats  median %8.1f us  p90 %8.1f us  (%d calls)\n", what[k],
                   sizes[k], t[n_it / 2], t[n_it * 9 / 10], n_it);
    }
    free(buf);
    free(all);
    free(t);
    return 0;
}

static const flag_def FLAGS[] = {
    {FLAG_INT_("--ranks", &ranks, 2, COLLECTIVE_MAX_RANKS), .help = "processes (default 2)"},
    {FLAG_INT_("--hidden", &hidden, 1, 1 << 16), .help = "model width (default 896: Qwen2.5-0.5B)"},
    {FLAG_INT_("--prefill-tokens", &prefill, 1, 4096), .help = "tokens of a prefill chunk (512)"},
    {FLAG_INT_("--vocab", &vocab, 1, 1 << 20), .help = "vocabulary (default 151936)"},
    {FLAG_INT_("--iters", &iters, 1, 1000000), .help = "calls per size (default 2000)"},
    {0}};

int bench_collective_main(int argc, char **argv) {
    const flag_def *tables[] = {FLAGS, NULL};
    flags_spec spec = {.cmd = "bench collective",
                       .usage = "usage: disagg bench collective [options]\n\n"
                                "The CPU tensor-parallel group's shared-memory collectives alone "
                                "(kernels/collective.h).\n\n",
                       .tables = tables};
    int pr = flags_parse(&spec, argc, argv);
    if (pr) return pr == FLAGS_HELP ? 0 : 2;
    size_t slot = (size_t)hidden * (size_t)prefill * 4;
    size_t row = (size_t)(vocab + ranks - 1) / (size_t)ranks * 4;
    char err[256];
    collective *c = NULL;
    if (collective_create(ranks, slot > row ? slot : row, 4096, &c, err, sizeof err)) {
        fprintf(stderr, "disagg bench collective: %s\n", err);
        return 1;
    }
    pid_t pids[COLLECTIVE_MAX_RANKS] = {0};
    for (int r = 1; r < ranks; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            collective *k = NULL;
            if (collective_open(dup(collective_fd(c)), &k, err, sizeof err) ||
                collective_join(k, r))
                _exit(1);
            _exit(run(k));
        }
    }
    printf("%d ranks (processes) on %ld online CPUs\n", ranks, sysconf(_SC_NPROCESSORS_ONLN));
    int rc = collective_join(c, 0) || run(c);
    for (int r = 1; r < ranks; r++) {
        int st = 0;
        waitpid(pids[r], &st, 0);
        rc |= !WIFEXITED(st) || WEXITSTATUS(st);
    }
    collective_free(c);
    return rc ? 1 : 0;
}
