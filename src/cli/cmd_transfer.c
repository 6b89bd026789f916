/* cmd_transfer — `disagg transfer` helpers (being written; see issue 2). */
#include "cli/commands.h"

#include <stdio.h>

int cmd_transfer(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "disagg transfer: not built yet\n");
    return 1;
}
