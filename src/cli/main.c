/*
 * main — the `disagg` binary: dispatches to subcommands, nothing else.
 */
#include "cli/commands.h"

#include <stdio.h>
#include <string.h>

#ifndef DISAGG_VERSION
#define DISAGG_VERSION "0.1.0"
#endif

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} command;

static const command COMMANDS[] = {
    {"demo", cmd_demo, "P + D + proxy on localhost, one chat request, on the default model"},
    {"transfer", cmd_transfer, "transfer engine: copy; its test harness: target, check, demo"},
    {"bench", cmd_bench, "measurements: bench transfer, bench model, bench serve, bench proxy"},
    {"generate", cmd_generate, "generate text from a model on the CPU (streams to stdout)"},
    {"bootstrap", cmd_bootstrap, "Mooncake bootstrap server alone; register/query helpers"},
    {"serve", cmd_serve, "OpenAI-compatible server: disagg serve [MODEL] --port 8000"},
    {"proxy", cmd_proxy, "P/D router: --prefill URL --decode URL, serves :8000"},
};
#define NCOMMANDS (sizeof COMMANDS / sizeof COMMANDS[0])

static void usage(FILE *f) {
    fprintf(f, "usage: disagg <command> [options]\n\n"
               "Prefill/decode disaggregated LLM serving.\n\ncommands:\n");
    for (size_t i = 0; i < NCOMMANDS; i++)
        fprintf(f, "  %-10s %s\n", COMMANDS[i].name, COMMANDS[i].summary);
    fprintf(f, "\n`disagg <command> --help` describes a command.\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *name = argv[1];
    if (!strcmp(name, "--help") || !strcmp(name, "-h") || !strcmp(name, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(name, "--version") || !strcmp(name, "version")) {
        printf("disagg %s\n", DISAGG_VERSION);
        return 0;
    }
    for (size_t i = 0; i < NCOMMANDS; i++)
        if (!strcmp(name, COMMANDS[i].name)) return COMMANDS[i].run(argc - 1, argv + 1);
    fprintf(stderr, "disagg: unknown command '%s'; accepted: ", name);
    for (size_t i = 0; i < NCOMMANDS; i++)
        fprintf(stderr, "%s%s", i ? ", " : "", COMMANDS[i].name);
    fprintf(stderr, " (see disagg --help)\n");
    return 2;
}
