/*
 * commands — the subcommands of the `disagg` binary.  Each takes the argv that
 * follows its own name (argv[0] is the subcommand name) and returns the
 * process exit status (0 ok, 1 runtime failure, 2 usage error).
 */
#ifndef DISAGG_CLI_COMMANDS_H
#define DISAGG_CLI_COMMANDS_H

int cmd_transfer(int argc, char **argv);  /* cmd_transfer.c: copy; target / check / demo (bench/) */
int cmd_bench(int argc, char **argv);     /* cmd_bench.c: bench transfer|... */
int cmd_generate(int argc, char **argv);  /* cmd_generate.c: CPU text generation from a model */
int cmd_bootstrap(int argc, char **argv); /* cmd_bootstrap.c: bootstrap server, register, query */
int cmd_serve(int argc, char **argv);     /* cmd_serve.c: the OpenAI-compatible server */
int cmd_demo(int argc, char **argv);      /* cmd_demo.c: P + D + proxy, one request */
int cmd_proxy(int argc, char **argv);     /* cmd_proxy.c: the P/D router */

#endif
