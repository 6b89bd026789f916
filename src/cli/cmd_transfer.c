/*
 * cmd_transfer — `disagg transfer <verb>`: the transfer engine on the
 * command line, built only on its public header (include/disagg/transfer.h).
 *
 *   copy    one READ or WRITE against a target (bytes from/to a file or stdio)
 *           — the user-facing verb, here;
 *   target, check, demo — the engine's test harness (a patterned target, a
 *           verifying traffic generator, the two together: the README's
 *           one-command demonstration), implemented in bench/transfer_harness.c
 *           with the bench's pattern and reached from here.
 *
 * Exit status: 0 ok, 1 runtime failure (message names the transfer_strerror),
 * 2 usage error (message names the bad value and what is accepted).
 */
#include "cli/commands.h"

#include "bench/transfer_harness.h"
#include "disagg/transfer.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ==== copy ================================================================ */

/* Reads exactly len bytes from path ("-" or NULL = stdin) into dst. */
static int read_input(const char *path, uint8_t *dst, size_t len, size_t *got) {
    FILE *f = (!path || !strcmp(path, "-")) ? stdin : fopen(path, "rb");
    if (!f) return -errno;
    *got = 0;
    while (*got < len) {
        size_t r = fread(dst + *got, 1, len - *got, f);
        if (r == 0) break;
        *got += r;
    }
    int err = ferror(f) ? -EIO : 0;
    if (f != stdin) fclose(f);
    return err;
}

static int cmd_copy(int argc, char **argv) {
    const char *target = NULL, *in = NULL, *out = NULL, *device = NULL;
    transfer_opcode op = TRANSFER_READ;
    bool op_set = false;
    uint64_t remote = UINT64_MAX, length = 0, timeout_ms = 0;
    transfer_protocol proto = TRANSFER_PROTO_AUTO;
    const char *op_str = NULL;
    // clang-format off
    const opt_spec specs[] = {
        {"--target", OPT_SEG, &target, 0, 0, "SEG", "the target's segment name ip:port (required)"},
        {"--op", OPT_STR, &op_str, 0, 0, "read|write", "operation (required)"},
        {"--remote-addr", OPT_ADDR, &remote, 0, 0, "ADDR", "absolute address in the target, decimal or 0x-hex (required)"},
        {"--length", OPT_SIZE, &length, 1, 1ull << 40, "N", "bytes to move (required)"},
        {"--protocol", OPT_PROTO, &proto, 0, 0, "auto|tcp|shm|rdma", "engine protocol (default auto; rdma: --device-name names the NICs, tcp when none)"},
        {"--device-name", OPT_STR, &device, 0, 0, "LIST", "comma-separated interface whitelist"},
        {"--in", OPT_STR, &in, 0, 0, "FILE", "write: bytes to send (default stdin)"},
        {"--out", OPT_STR, &out, 0, 0, "FILE", "read: where the bytes go (default stdout)"},
        {"--timeout-ms", OPT_UINT, &timeout_ms, 1, 3600000, "MS", "request deadline base (default engine's 30 s) + 1 ns/byte"},
    };
    // clang-format on
    const sub_usage u = {
        "copy", "--target SEG --op read|write --remote-addr ADDR --length N [options]",
        "One READ or WRITE request against a target.  Exit 0 on success, 1 with the\n"
        "engine's error message otherwise."};
    int prc = th_opts_parse(&u, specs, sizeof specs / sizeof specs[0], argc, argv);
    if (prc) return prc < 0 ? 0 : prc;
    if (op_str) {
        const opt_spec ops = {"--op", OPT_OP, &op, 0, 0, NULL, NULL};
        if (th_opt_assign("copy", &ops, op_str)) return 2;
        op_set = true;
    }
    const char *missing = !target                ? "--target SEG"
                          : !op_set              ? "--op read|write"
                          : remote == UINT64_MAX ? "--remote-addr ADDR"
                          : !length              ? "--length N"
                                                 : NULL;
    if (missing) {
        fprintf(stderr, "disagg transfer copy: %s is required (see disagg transfer copy --help)\n",
                missing);
        return 2;
    }
    if (op == TRANSFER_READ && in) {
        fprintf(stderr, "disagg transfer copy: --in '%s' is for --op write only\n", in);
        return 2;
    }
    if (op == TRANSFER_WRITE && out) {
        fprintf(stderr, "disagg transfer copy: --out '%s' is for --op read only\n", out);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);

    uint8_t *local = th_map_bytes(length);
    if (!local) {
        fprintf(stderr, "disagg transfer copy: cannot map %" PRIu64 " bytes: %s\n", length,
                strerror(errno));
        return 1;
    }
    if (op == TRANSFER_WRITE) {
        size_t got = 0;
        int r = read_input(in, local, length, &got);
        if (r < 0 || got != length) {
            if (r < 0)
                fprintf(stderr, "disagg transfer copy: cannot read --in '%s': %s\n", in ? in : "-",
                        strerror(-r));
            else
                fprintf(stderr,
                        "disagg transfer copy: --in '%s' has %zu bytes, --length asks for %" PRIu64
                        "\n",
                        in ? in : "-", got, length);
            munmap(local, length);
            return 1;
        }
    }

    int status = 1;
    transfer_engine *eng = NULL;
    transfer_segment seg;
    char msg[512];
    int rc = th_initiator_create(proto, device, timeout_ms, &eng);
    if (rc) {
        fprintf(stderr, "disagg transfer copy: cannot create the engine: %s\n",
                transfer_strerror(rc));
        goto out;
    }
    rc = transfer_open_segment(eng, target, &seg);
    if (rc) {
        fprintf(stderr, "disagg transfer copy: cannot open segment %s: %s\n", target,
                transfer_strerror(rc));
        goto out;
    }
    rc = transfer_register(eng, local, length, "cpu:0");
    if (rc) {
        fprintf(stderr, "disagg transfer copy: transfer_register(%" PRIu64 " bytes): %s\n", length,
                transfer_strerror(rc));
        goto out;
    }
    transfer_request req = {
        .opcode = op, .local = local, .target = seg, .remote_addr = remote, .length = length};
    long bad;
    rc = th_batch_run(eng, &req, 1, th_wait_budget_ns(timeout_ms, length), NULL, msg, sizeof msg,
                      &bad);
    transfer_unregister(eng, local);
    if (rc) {
        fprintf(stderr,
                "disagg transfer copy: %s of %" PRIu64 " bytes at 0x%" PRIx64 " on %s failed: %s\n",
                th_op_name(op), length, remote, target, transfer_strerror(rc));
        goto out;
    }
    if (op == TRANSFER_READ) {
        FILE *f = (!out || !strcmp(out, "-")) ? stdout : fopen(out, "wb");
        if (!f) {
            fprintf(stderr, "disagg transfer copy: cannot open --out '%s': %s\n", out,
                    strerror(errno));
            goto out;
        }
        size_t w = fwrite(local, 1, length, f);
        int ferr = (f == stdout) ? fflush(f) : fclose(f);
        if (w != length || ferr) {
            fprintf(stderr, "disagg transfer copy: writing %" PRIu64 " bytes to '%s' failed: %s\n",
                    length, out ? out : "-", strerror(errno));
            goto out;
        }
    }
    status = 0;
out:
    if (eng) transfer_engine_destroy(eng);
    munmap(local, length);
    return status;
}

/* ==== dispatch ============================================================ */

static void transfer_usage(FILE *f) {
    fprintf(f, "usage: disagg transfer <sub> [options]\n\n"
               "The transfer engine (include/disagg/transfer.h) on the command line:\n"
               "  copy     one READ or WRITE against a target (bytes from/to a file or stdio)\n"
               "and its test harness (bench/transfer_harness.c):\n"
               "  target   register patterned buffers and serve them; prints a JSON line\n"
               "  check    random READ/WRITE traffic against a target, every byte verified\n"
               "  demo     start a target and check it: the one-command demonstration\n\n"
               "`disagg transfer <sub> --help` lists its options.\n");
}

int cmd_transfer(int argc, char **argv) {
    if (argc < 2) {
        transfer_usage(stderr);
        return 2;
    }
    const char *sub = argv[1];
    if (!strcmp(sub, "--help") || !strcmp(sub, "-h") || !strcmp(sub, "help")) {
        transfer_usage(stdout);
        return 0;
    }
    if (!strcmp(sub, "copy")) return cmd_copy(argc - 1, argv + 1);
    /* The harness (bench/transfer_harness.c). */
    if (!strcmp(sub, "target")) return transfer_harness_target(argc - 1, argv + 1);
    if (!strcmp(sub, "check")) return transfer_harness_check(argc - 1, argv + 1);
    if (!strcmp(sub, "demo")) return transfer_harness_demo(argc - 1, argv + 1);
    fprintf(stderr,
            "disagg transfer: unknown subcommand '%s'; accepted: target, copy, check, demo\n", sub);
    return 2;
}
