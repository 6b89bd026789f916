/*
 * transfer_harness (internal) — the transfer engine's command-line test
 * harness behind `disagg transfer target|check|demo` (transfer_harness.c)
 * and the pieces `disagg transfer copy` (src/cli/cmd_transfer.c) shares with
 * it (transfer_harness_opts.c): the option-table parser of the `disagg
 * transfer` verbs, an initiator engine, one batch run and waited for.  Built
 * on include/disagg/transfer.h and src/base only.
 */
#ifndef DISAGG_BENCH_TRANSFER_HARNESS_H
#define DISAGG_BENCH_TRANSFER_HARNESS_H

#include "disagg/transfer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TH_WAIT_SLACK_NS (5 * 1000000000ull) /* batch_wait safety margin past the engine deadline  \
                                              */

/* ==== option parsing ====================================================== */

typedef enum opt_kind {
    OPT_FLAG,  /* bool, no value */
    OPT_STR,   /* const char *, any non-empty string */
    OPT_SEG,   /* const char *, "ip:port" / "[ip6]:port" */
    OPT_UINT,  /* uint64_t, decimal, within [min, max] */
    OPT_SIZE,  /* uint64_t, a byte size (base/bytesize grammar), within [min, max] */
    OPT_ADDR,  /* uint64_t, decimal or 0x-hex address */
    OPT_PROTO, /* transfer_protocol: auto|tcp|shm|rdma */
    OPT_OP,    /* transfer_opcode: read|write */
} opt_kind;

typedef struct opt_spec {
    const char *name;    /* "--buffer-size" */
    opt_kind kind;       /* how the value parses */
    void *dst;           /* where it goes (type by kind) */
    uint64_t min, max;   /* accepted range for OPT_UINT / OPT_SIZE */
    const char *metavar; /* shown in --help */
    const char *help;    /* one line */
} opt_spec;

typedef struct sub_usage {
    const char *name;     /* "target" */
    const char *synopsis; /* text after "disagg transfer <name>" */
    const char *about;    /* paragraph */
} sub_usage;

/* Parses one value into spec->dst; prints the error and returns 2 if bad. */
int th_opt_assign(const char *sub, const opt_spec *sp, const char *val);
/* Parses argv[1..] ("--name value" or "--name=value").  Returns 0, 2 on a
 * usage error (printed), or -1 when --help was given (usage printed). */
int th_opts_parse(const sub_usage *u, const opt_spec *specs, size_t n, int argc, char **argv);

/* ==== shared helpers ====================================================== */

/* Memory for buffers: anonymous mapping, page aligned, NULL on failure. */
void *th_map_bytes(size_t len);
/* "12.0 MiB" into buf. */
void th_format_bytes(char *buf, size_t cap, double b);
/* Engine for an initiator ($DISAGG_KV_SECRET applies); timeout_ms 0 = engine defaults. */
int th_initiator_create(transfer_protocol proto, const char *device, uint64_t timeout_ms,
                        transfer_engine **out);
/* How long batch_wait may take for `bytes` bytes before we call the engine
 * hung: its own deadline (base + 1 ns/byte) plus TH_WAIT_SLACK_NS. */
uint64_t th_wait_budget_ns(uint64_t timeout_ms, uint64_t bytes);
const char *th_op_name(transfer_opcode op);
/* Runs reqs[0..n) as one batch and waits.  Returns 0 or the first failing
 * request's error, with msg naming it; *failed_index gets its index (or -1). */
int th_batch_run(transfer_engine *e, const transfer_request *reqs, size_t n, uint64_t wait_ns,
                 const uint64_t *req_base, char *msg, size_t cap, long *failed_index);

/* ==== the harness verbs (argv[0] is the verb; the exit status) =============== */

int transfer_harness_target(int argc, char **argv);
int transfer_harness_check(int argc, char **argv);
int transfer_harness_demo(int argc, char **argv);

#endif
