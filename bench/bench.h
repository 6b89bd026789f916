/*
 * bench — entry points of the benchmarks that `disagg bench` runs.
 * argv[0] is the benchmark's name; return value is the exit status.
 */
#ifndef DISAGG_BENCH_H
#define DISAGG_BENCH_H

int bench_transfer_main(int argc, char **argv); /* transfer_bench.c */
/* `disagg bench transfer --location cuda:N` (transfer_bench_cuda.c) */
int bench_transfer_cuda_main(int argc, char **argv);
int bench_model_main(int argc, char **argv);      /* model_bench.c */
int bench_model_cuda_main(int argc, char **argv); /* model_bench_cuda.c: --device cuda */
int bench_model_inv_main(int argc, char **argv);  /* model_bench_inv.c: --batch-invariant */
int bench_serve_main(int argc, char **argv);      /* serve_bench.c: vllm bench serve */
int bench_proxy_main(int argc, char **argv);      /* proxy_bench.c */
int bench_grammar_main(int argc, char **argv);    /* grammar_bench.c: structured-output masks */
/* grammar_engine_bench.c: `bench grammar --engine MODEL`, the engine's step with masks */
int bench_grammar_engine_main(int argc, char **argv);
int bench_moe_main(int argc, char **argv);        /* moe_bench.c: the mixture-of-experts op */
int bench_collective_main(int argc, char **argv); /* collective_bench.c: CPU TP collectives */

#endif
