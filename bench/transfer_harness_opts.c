/*
 * transfer_harness_opts — see transfer_harness.h: the `disagg transfer`
 * verbs' option-table parser and the initiator helpers they share.
 */
#include "bench/transfer_harness.h"

#include "base/auth.h"
#include "base/bytesize.h"
#include "base/clock.h"
#include "base/flags.h"
#include "base/net.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* ==== option parsing ====================================================== */

static int parse_u64_dec(const char *s, uint64_t *out) {
    if (!s || !isdigit((unsigned char)s[0])) return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end) return -1;
    *out = v;
    return 0;
}

static int parse_addr(const char *s, uint64_t *out) {
    if (!s) return -1;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
        if (!isxdigit((unsigned char)s[2])) return -1;
        errno = 0;
        char *end;
        unsigned long long v = strtoull(s + 2, &end, 16);
        if (errno || *end) return -1;
        *out = v;
        return 0;
    }
    return parse_u64_dec(s, out);
}

static int parse_protocol(const char *s, transfer_protocol *out) {
    if (!strcmp(s, "auto"))
        *out = TRANSFER_PROTO_AUTO;
    else if (!strcmp(s, "tcp"))
        *out = TRANSFER_PROTO_TCP;
    else if (!strcmp(s, "shm"))
        *out = TRANSFER_PROTO_SHM;
    else if (!strcmp(s, "rdma"))
        *out = TRANSFER_PROTO_RDMA;
    else
        return -1;
    return 0;
}

/* Parses one value into spec->dst; prints the error and returns 2 if bad. */
int th_opt_assign(const char *sub, const opt_spec *sp, const char *val) {
    uint64_t v = 0;
    switch (sp->kind) {
    case OPT_FLAG:
        *(bool *)sp->dst = true;
        return 0;
    case OPT_STR:
        if (!*val) {
            fprintf(stderr, "disagg transfer %s: %s needs a non-empty value\n", sub, sp->name);
            return 2;
        }
        *(const char **)sp->dst = val;
        return 0;
    case OPT_SEG: {
        char host[256];
        uint16_t port;
        if (net_split_host_port(val, host, sizeof host, &port, 0) < 0 || !host[0]) {
            fprintf(stderr,
                    "disagg transfer %s: %s '%s' is not a segment name; accepted: ip:port or "
                    "[ipv6]:port with port 1..65535 (the target's \"segment\")\n",
                    sub, sp->name, val);
            return 2;
        }
        *(const char **)sp->dst = val;
        return 0;
    }
    case OPT_SIZE: {
        char what[96], err[512];
        snprintf(what, sizeof what, "disagg transfer %s: %s", sub, sp->name);
        if (bytesize_parse_range(what, val, sp->min, sp->max, &v, err, sizeof err)) {
            fprintf(stderr, "%s\n", err);
            return 2;
        }
        *(uint64_t *)sp->dst = v;
        return 0;
    }
    case OPT_UINT:
        if (parse_u64_dec(val, &v) < 0 || v < sp->min || v > sp->max) {
            fprintf(stderr,
                    "disagg transfer %s: %s '%s' is not accepted; accepted: an integer %" PRIu64
                    "..%" PRIu64 "\n",
                    sub, sp->name, val, sp->min, sp->max);
            return 2;
        }
        *(uint64_t *)sp->dst = v;
        return 0;
    case OPT_ADDR:
        if (parse_addr(val, &v) < 0) {
            fprintf(stderr,
                    "disagg transfer %s: %s '%s' is not an address; accepted: decimal or 0x-hex "
                    "64-bit integer\n",
                    sub, sp->name, val);
            return 2;
        }
        *(uint64_t *)sp->dst = v;
        return 0;
    case OPT_PROTO:
        if (parse_protocol(val, (transfer_protocol *)sp->dst) < 0) {
            fprintf(
                stderr,
                "disagg transfer %s: %s '%s' is not a protocol; accepted: auto, tcp, shm, rdma\n",
                sub, sp->name, val);
            return 2;
        }
        return 0;
    case OPT_OP:
        if (!strcmp(val, "read"))
            *(transfer_opcode *)sp->dst = TRANSFER_READ;
        else if (!strcmp(val, "write"))
            *(transfer_opcode *)sp->dst = TRANSFER_WRITE;
        else {
            fprintf(stderr,
                    "disagg transfer %s: %s '%s' is not an operation; accepted: read, write\n", sub,
                    sp->name, val);
            return 2;
        }
        return 0;
    }
    return 2;
}

/* One opt_spec row (d->dst) through th_opt_assign, which prints the error. */
static int assign_row(flags_parser *p, const flag_def *d, const char *val) {
    const char *sub = flags_cmd(p) + strlen("transfer ");
    return th_opt_assign(sub, d->dst, val ? val : "") ? -1 : 0;
}

static int no_positional(flags_parser *p, const char *word) {
    const char *sub = flags_cmd(p) + strlen("transfer ");
    fprintf(stderr,
            "disagg transfer %s: unexpected argument '%s'; options start with -- (see disagg "
            "transfer %s --help)\n",
            sub, word, sub);
    return -1;
}

#define TH_MAX_OPTS 40

/* Parses argv[1..] ("--name value" or "--name=value") with base/flags.  Returns 0, 2 on a
 * usage error (printed), or -1 when --help was given (usage printed). */
int th_opts_parse(const sub_usage *u, const opt_spec *specs, size_t n, int argc, char **argv) {
    flag_def rows[TH_MAX_OPTS + 1];
    size_t k = 0;
    for (; k < n && k < TH_MAX_OPTS; k++)
        rows[k] = (flag_def){FLAG_CUSTOM_(specs[k].name, (void *)&specs[k], assign_row),
                             .opts = specs[k].kind == OPT_FLAG ? FLAG_SWITCH : 0,
                             .metavar = specs[k].metavar, .help = specs[k].help};
    memset(&rows[k], 0, sizeof rows[k]);
    const flag_def *tables[] = {rows, NULL};
    char cmd[64], usage[2048];
    snprintf(cmd, sizeof cmd, "transfer %s", u->name);
    snprintf(usage, sizeof usage, "usage: disagg transfer %s %s\n\n%s\n\noptions:\n", u->name,
             u->synopsis, u->about);
    const flags_spec spec = {.cmd = cmd,
                             .usage = usage,
                             .epilog = "  --help                     show this help\n",
                             .tables = tables,
                             .help_col = 29,
                             .list_on_unknown = 1,
                             .positional = no_positional};
    int rc = flags_parse(&spec, argc, argv);
    return rc == FLAGS_HELP ? -1 : rc ? 2 : 0;
}

/* ==== shared helpers ====================================================== */

/* Memory for buffers: anonymous mapping, page aligned, zero on failure. */
void *th_map_bytes(size_t len) {
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void th_format_bytes(char *buf, size_t cap, double b) {
    const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (b >= 1024.0 && u < 4)
        b /= 1024.0, u++;
    if (u == 0)
        snprintf(buf, cap, "%.0f B", b);
    else
        snprintf(buf, cap, "%.1f %s", b, unit[u]);
}

/* Engine for an initiator; timeout_ms 0 = engine defaults. */
int th_initiator_create(transfer_protocol proto, const char *device, uint64_t timeout_ms,
                        transfer_engine **out) {
    transfer_config cfg;
    transfer_config_init(&cfg);
    cfg.protocol = proto;
    cfg.device_name = device;
    cfg.auth_secret = auth_secret_resolve(NULL); /* $DISAGG_KV_SECRET */
    if (timeout_ms) {
        cfg.timeout_base_ns = timeout_ms * NS_PER_MS;
        if (cfg.connect_timeout_ns == 0 || cfg.connect_timeout_ns > timeout_ms * NS_PER_MS)
            cfg.connect_timeout_ns = timeout_ms * NS_PER_MS;
    }
    return transfer_engine_create(&cfg, out);
}

/* How long batch_wait may take for `bytes` bytes before we call the engine
 * hung: its own deadline (base + 1 ns/byte) plus TH_WAIT_SLACK_NS. */
uint64_t th_wait_budget_ns(uint64_t timeout_ms, uint64_t bytes) {
    uint64_t base = timeout_ms ? timeout_ms * NS_PER_MS : 30 * NS_PER_S;
    return base + bytes + TH_WAIT_SLACK_NS;
}

const char *th_op_name(transfer_opcode op) {
    return op == TRANSFER_READ ? "READ" : "WRITE";
}

/* Runs reqs[0..n) as one batch and waits.  Returns 0 or the first failing
 * request's error, with msg naming it; *failed_index gets its index (or -1). */
int th_batch_run(transfer_engine *e, const transfer_request *reqs, size_t n, uint64_t wait_ns,
                 const uint64_t *req_base, char *msg, size_t cap, long *failed_index) {
    transfer_batch b;
    *failed_index = -1;
    int rc = transfer_batch_alloc(e, n, &b);
    if (rc) {
        snprintf(msg, cap, "transfer_batch_alloc(%zu): %s", n, transfer_strerror(rc));
        return rc;
    }
    rc = transfer_batch_submit(e, b, reqs, n);
    if (rc) {
        snprintf(msg, cap, "transfer_batch_submit of %zu requests: %s", n, transfer_strerror(rc));
        transfer_batch_free(e, b);
        return rc;
    }
    rc = transfer_batch_wait(e, b, wait_ns);
    transfer_status overall;
    if (rc == TRANSFER_ETIMEDOUT && transfer_batch_get_overall(e, b, &overall) == 0 &&
        overall.state == TRANSFER_STATE_PENDING) {
        snprintf(msg, cap,
                 "batch of %zu requests still pending %.1f s after submit, past the engine's own "
                 "deadline: %s",
                 n, (double)wait_ns / 1e9, transfer_strerror(rc));
        transfer_batch_cancel(e, b);
        transfer_batch_wait(e, b, 2 * NS_PER_S);
        transfer_batch_free(e, b);
        return rc;
    }
    if (rc) {
        for (size_t i = 0; i < n; i++) {
            transfer_status st;
            if (transfer_batch_get_status(e, b, i, &st) == 0 &&
                st.state != TRANSFER_STATE_COMPLETED) {
                int err = st.error ? st.error : rc;
                snprintf(msg, cap,
                         "%s of %zu bytes at remote 0x%" PRIx64 " (buffer offset %" PRIu64 "): %s",
                         th_op_name(reqs[i].opcode), reqs[i].length, reqs[i].remote_addr,
                         req_base ? reqs[i].remote_addr - req_base[i] : 0, transfer_strerror(err));
                *failed_index = (long)i;
                rc = err;
                break;
            }
        }
        if (*failed_index < 0)
            snprintf(msg, cap, "batch of %zu requests: %s", n, transfer_strerror(rc));
    }
    if (transfer_batch_free(e, b) == TRANSFER_EBUSY) {
        transfer_batch_cancel(e, b);
        transfer_batch_wait(e, b, 2 * NS_PER_S);
        transfer_batch_free(e, b);
    }
    return rc;
}
