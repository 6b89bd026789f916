/* transfer_bench — `disagg bench transfer` (being written; see issue 2). */
#include "bench/bench.h"

#include <stdio.h>

int bench_transfer_main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "disagg bench transfer: not built yet\n");
    return 1;
}
