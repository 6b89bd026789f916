/*
 * cmd_bench — `disagg bench <what>`: dispatches to the benchmarks in bench/.
 */
#include "bench/bench.h"
#include "cli/commands.h"

#include <stdio.h>
#include <string.h>

int cmd_bench(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        FILE *f = argc < 2 ? stderr : stdout;
        fprintf(f, "usage: disagg bench <what> [options]\n\n"
                   "  transfer   transfer-engine throughput and latency (tcp, shm)\n"
                   "  model      CPU model prefill/decode speed beside memory-bandwidth and GEMM "
                   "ceilings\n"
                   "  serve      an OpenAI-compatible server under load (vllm bench serve)\n"
                   "  proxy      P/D proxy added latency, relay rate, concurrent streams\n"
                   "  grammar    structured-output token masks: CPU per token, masks for "
                   "comparison\n"
                   "  moe        the mixture-of-experts op alone (route + experts) beside the copy "
                   "ceiling\n\n"
                   "  collective the CPU tensor-parallel group's shared-memory all-reduce and "
                   "all-gather\n\n"
                   "`disagg bench <what> --help` lists its options.\n");
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "transfer")) return bench_transfer_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "model")) return bench_model_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "serve")) return bench_serve_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "proxy")) return bench_proxy_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "grammar")) return bench_grammar_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "moe")) return bench_moe_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "collective")) return bench_collective_main(argc - 1, argv + 1);
    fprintf(stderr,
            "disagg bench: unknown benchmark '%s'; accepted: transfer, model, serve, proxy, "
            "grammar, moe, collective\n",
            argv[1]);
    return 2;
}
