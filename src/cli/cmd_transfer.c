/*
 * cmd_transfer — `disagg transfer <sub>`: command-line helpers around the
 * transfer engine, built only on its public header (include/disagg/transfer.h)
 * and src/base.  They are what the integration tests
 * (tests/integration/test_transfer_*.py) and a newcomer drive:
 *
 *   target  registers K patterned buffers, prints one JSON line, serves
 *   copy    one READ or WRITE against a target (bytes from/to a file or stdio)
 *   check   random READ/WRITE traffic against a target, every byte verified
 *   demo    forks a target and runs a check against it (the README's command)
 *
 * The buffer pattern is a contract with tests/integration/conftest.py
 * (pattern_bytes) and must agree with it:
 *   buffers are ranked k = 0, 1, ... by ascending address;
 *   byte i of buffer k = (uint8)(splitmix64(seed + (k << 40) + i / 8) >> (8 * (i % 8)))
 *   splitmix64(x) (base/rng.h rng_mix64): z = x + 0x9E3779B97F4A7C15;
 *                  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
 *                  z = (z ^ (z >> 27)) * 0x94D049BB133111EB;  return z ^ (z >> 31)
 * i.e. buffer k, read as little-endian u64 words, holds splitmix64(seed + (k<<40) + w).
 * The target surrounds each buffer with TARGET_GUARD_BYTES unregistered bytes
 * of value TARGET_GUARD_VALUE, so a test can see that nothing outside changed.
 *
 * Exit status: 0 ok, 1 runtime failure (message names the transfer_strerror),
 * 2 usage error (message names the bad value and what is accepted).
 */
#include "cli/commands.h"

#include "base/auth.h"
#include "base/bytesize.h"
#include "base/clock.h"
#include "base/stop_signal.h"
#include "base/net.h"
#include "base/rng.h"
#include "disagg/transfer.h"

#include <ctype.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define TARGET_GUARD_BYTES 4096           /* unregistered bytes on each side of a target buffer */
#define TARGET_GUARD_VALUE 0xA5           /* their value */
#define TARGET_MAX_BUFFERS 64             /* --buffers upper bound */
#define CHECK_MAX_SPAN     (256ull << 20) /* check verifies at most this much of each buffer */
#define CHECK_MAX_BATCH    1024
#define WAIT_SLACK_NS      (5 * NS_PER_S) /* batch_wait safety margin past the engine deadline */

/* ==== pattern ============================================================= */

/* Writes bytes [offset, offset+len) of buffer k's pattern into dst. */
static void pattern_fill(uint8_t *dst, uint64_t seed, uint64_t k, uint64_t offset, size_t len) {
    uint64_t base = seed + (k << 40);
    size_t i = 0;
    while (i < len && ((offset + i) & 7)) {
        uint64_t o = offset + i;
        dst[i++] = (uint8_t)(rng_mix64(base + (o >> 3)) >> (8 * (o & 7)));
    }
    for (; i + 8 <= len; i += 8) {
        uint64_t w = htole64(rng_mix64(base + ((offset + i) >> 3)));
        memcpy(dst + i, &w, 8);
    }
    while (i < len) {
        uint64_t o = offset + i;
        dst[i++] = (uint8_t)(rng_mix64(base + (o >> 3)) >> (8 * (o & 7)));
    }
}

/* Random bytes for WRITE payloads (not the pattern: any stream works). */
static void random_fill(uint8_t *dst, size_t len, uint64_t *state) {
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w = rng_mix64((*state)++);
        memcpy(dst + i, &w, 8);
    }
    if (i < len) {
        uint64_t w = rng_mix64((*state)++);
        memcpy(dst + i, &w, len - i);
    }
}

static uint64_t pick_next(uint64_t *state) {
    return rng_mix64((*state)++);
}
/* Uniform in [lo, hi] (hi >= lo). */
static uint64_t pick_range(uint64_t *state, uint64_t lo, uint64_t hi) {
    uint64_t span = hi - lo + 1;
    return span == 0 ? pick_next(state) : lo + pick_next(state) % span;
}

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

static void print_sub_usage(FILE *f, const sub_usage *u, const opt_spec *specs, size_t n) {
    fprintf(f, "usage: disagg transfer %s %s\n\n%s\n\noptions:\n", u->name, u->synopsis, u->about);
    for (size_t i = 0; i < n; i++) {
        char left[64];
        snprintf(left, sizeof left, "%s%s%s", specs[i].name, specs[i].metavar ? " " : "",
                 specs[i].metavar ? specs[i].metavar : "");
        fprintf(f, "  %-26s %s\n", left, specs[i].help);
    }
    fprintf(f, "  %-26s %s\n", "--help", "show this help");
}

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
static int opt_assign(const char *sub, const opt_spec *sp, const char *val) {
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

/* Parses argv[1..] ("--name value" or "--name=value").  Returns 0, 2 on a
 * usage error (printed), or -1 when --help was given (usage printed). */
static int opts_parse(const sub_usage *u, const opt_spec *specs, size_t n, int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            print_sub_usage(stdout, u, specs, n);
            return -1;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strncmp(arg, "--", 2) != 0) {
            fprintf(stderr,
                    "disagg transfer %s: unexpected argument '%s'; options start with -- "
                    "(see disagg transfer %s --help)\n",
                    u->name, arg, u->name);
            return 2;
        }
        const char *eq = strchr(arg, '=');
        size_t name_len = eq ? (size_t)(eq - arg) : strlen(arg);
        const opt_spec *sp = NULL;
        for (size_t j = 0; j < n; j++)
            if (strlen(specs[j].name) == name_len && !strncmp(specs[j].name, arg, name_len))
                sp = &specs[j];
        if (!sp) {
            fprintf(stderr, "disagg transfer %s: unknown option '%.*s'; accepted:", u->name,
                    (int)name_len, arg);
            for (size_t j = 0; j < n; j++)
                fprintf(stderr, " %s", specs[j].name);
            fprintf(stderr, " --help\n");
            return 2;
        }
        const char *val;
        if (sp->kind == OPT_FLAG) {
            if (eq) {
                fprintf(stderr, "disagg transfer %s: %s takes no value (got '%s')\n", u->name,
                        sp->name, eq + 1);
                return 2;
            }
            val = "";
        } else if (eq) {
            val = eq + 1;
        } else if (i + 1 < argc) {
            val = argv[++i];
        } else {
            fprintf(stderr, "disagg transfer %s: %s needs a value (%s)\n", u->name, sp->name,
                    sp->metavar ? sp->metavar : "value");
            return 2;
        }
        int rc = opt_assign(u->name, sp, val);
        if (rc) return rc;
    }
    return 0;
}

/* ==== shared helpers ====================================================== */

/* Memory for buffers: anonymous mapping, page aligned, zero on failure. */
static void *map_bytes(size_t len) {
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void format_bytes(char *buf, size_t cap, double b) {
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
static int initiator_create(transfer_protocol proto, const char *device, uint64_t timeout_ms,
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
 * hung: its own deadline (base + 1 ns/byte) plus WAIT_SLACK_NS. */
static uint64_t wait_budget_ns(uint64_t timeout_ms, uint64_t bytes) {
    uint64_t base = timeout_ms ? timeout_ms * NS_PER_MS : 30 * NS_PER_S;
    return base + bytes + WAIT_SLACK_NS;
}

static const char *op_name(transfer_opcode op) {
    return op == TRANSFER_READ ? "READ" : "WRITE";
}

/* Runs reqs[0..n) as one batch and waits.  Returns 0 or the first failing
 * request's error, with msg naming it; *failed_index gets its index (or -1). */
static int batch_run(transfer_engine *e, const transfer_request *reqs, size_t n, uint64_t wait_ns,
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
                         op_name(reqs[i].opcode), reqs[i].length, reqs[i].remote_addr,
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

/* ==== target ============================================================== */

typedef struct target_buf {
    uint8_t *map;  /* mapping incl. guards: (guard + length + guard) */
    uint8_t *data; /* map + guard: the registered bytes, (length) */
    size_t length; /* registered length */
} target_buf;

static int cmp_target_buf(const void *a, const void *b) {
    const target_buf *x = a, *y = b;
    return x->data < y->data ? -1 : x->data > y->data;
}

static int cmd_target(int argc, char **argv) {
    const char *host = NULL, *device = NULL, *metadata = NULL;
    uint64_t port = 0, data_port = 0, buffer_size = 64ull << 20, nbuf = 1, seed = 1, per_peer = 0;
    transfer_protocol proto = TRANSFER_PROTO_AUTO;
    bool exit_on_eof = false;
    // clang-format off
    const opt_spec specs[] = {
        {"--host", OPT_STR, &host, 0, 0, "IP", "address advertised in the segment name (default: VLLM_HOST_IP or first interface)"},
        {"--port", OPT_UINT, &port, 0, 65535, "N", "handshake (RPC) port, 0 = ephemeral (default 0)"},
        {"--data-port", OPT_UINT, &data_port, 0, 65535, "N", "tcp data port, 0 = ephemeral (default 0)"},
        {"--device-name", OPT_STR, &device, 0, 0, "LIST", "comma-separated interface whitelist (e.g. eth0,eth1)"},
        {"--protocol", OPT_PROTO, &proto, 0, 0, "auto|tcp|shm|rdma", "engine protocol (default auto; rdma: --device-name names the NICs, tcp when none)"},
        {"--buffer-size", OPT_SIZE, &buffer_size, 1, 1ull << 40, "BYTES", "size of each buffer (default 64M)"},
        {"--buffers", OPT_UINT, &nbuf, 1, TARGET_MAX_BUFFERS, "K", "number of buffers (default 1)"},
        {"--pattern", OPT_UINT, &seed, 0, UINT64_MAX, "SEED", "pattern seed of the buffer contents (default 1)"},
        {"--exit-on-stdin-eof", OPT_FLAG, &exit_on_eof, 0, 0, NULL, "also exit when stdin reaches EOF"},
        {"--metadata-server", OPT_STR, &metadata, 0, 0, "etcd://H:P", "also publish the segment in etcd in Mooncake's metadata layout (docs/scaling.md)"},
        {"--max-conns-per-peer", OPT_UINT, &per_peer, 0, 1024, "N", "open data connections from one address, 0 = $DISAGG_KV_MAX_CONNS_PER_PEER or 64 (docs/security.md)"},
    };
    // clang-format on
    const sub_usage u = {
        "target",
        "[options]",
        "Registers K buffers filled with the pattern (see src/cli/cmd_transfer.c) and\n"
        "serves them.  Prints one JSON line "
        "{\"segment\",\"tcp_data_port\",\"pid\",\"auth\",\"buffers\":[{\"addr\",\"length\"}],...}\n"
        "on start and one {\"event\":\"stats\",...} line on exit (SIGINT/SIGTERM).\n"
        "With $DISAGG_KV_SECRET set (also for copy and check) the ports require that\n"
        "shared secret (docs/transfer.md, Security).",
    };
    int prc = opts_parse(&u, specs, sizeof specs / sizeof specs[0], argc, argv);
    if (prc) return prc < 0 ? 0 : prc;

    /* SIGINT/SIGTERM make sfd readable (a process-wide handler: see base/stop_signal.h). */
    int sfd = stop_signal_fd();
    if (sfd < 0) {
        fprintf(stderr, "disagg transfer target: cannot install signal handlers: %s\n",
                strerror(-sfd));
        return 1;
    }

    transfer_config cfg;
    transfer_config_init(&cfg);
    cfg.local_hostname = host;
    cfg.rpc_port = (uint16_t)port;
    cfg.data_port = (uint16_t)data_port;
    cfg.protocol = proto;
    cfg.device_name = device;
    cfg.auth_secret = auth_secret_resolve(NULL); /* $DISAGG_KV_SECRET */
    cfg.metadata_server = metadata;
    cfg.max_conns_per_peer = (int)per_peer;
    transfer_engine *eng = NULL;
    int rc = transfer_engine_create(&cfg, &eng);
    if (rc) {
        fprintf(stderr,
                "disagg transfer target: cannot create the engine (host %s, port %" PRIu64
                ", data port %" PRIu64 ", devices %s): %s\n",
                host ? host : "default", port, data_port, device ? device : "all",
                transfer_strerror(rc));
        return 1;
    }

    target_buf bufs[TARGET_MAX_BUFFERS];
    size_t nb = 0;
    int status = 0;
    for (; nb < nbuf; nb++) {
        size_t maplen = (size_t)buffer_size + 2 * TARGET_GUARD_BYTES;
        uint8_t *m = map_bytes(maplen);
        if (!m) {
            fprintf(stderr,
                    "disagg transfer target: cannot map %" PRIu64 " bytes for buffer %zu: %s\n",
                    buffer_size, nb, strerror(errno));
            status = 1;
            break;
        }
        bufs[nb] = (target_buf){.map = m, .data = m + TARGET_GUARD_BYTES, .length = buffer_size};
    }
    qsort(bufs, nb, sizeof bufs[0], cmp_target_buf);
    size_t nreg = 0;
    for (size_t k = 0; status == 0 && k < nb; k++) {
        memset(bufs[k].map, TARGET_GUARD_VALUE, TARGET_GUARD_BYTES);
        memset(bufs[k].data + bufs[k].length, TARGET_GUARD_VALUE, TARGET_GUARD_BYTES);
        pattern_fill(bufs[k].data, seed, k, 0, bufs[k].length);
        rc = transfer_register(eng, bufs[k].data, bufs[k].length, "cpu:0");
        if (rc) {
            fprintf(stderr,
                    "disagg transfer target: transfer_register(buffer %zu, %zu bytes): %s\n", k,
                    bufs[k].length, transfer_strerror(rc));
            status = 1;
            break;
        }
        nreg++;
    }

    if (status == 0) {
        json_t *arr = json_array();
        for (size_t k = 0; k < nb; k++)
            json_array_append_new(arr, json_pack("{s:I,s:I,s:s}", "addr",
                                                 (json_int_t)(uintptr_t)bufs[k].data, "length",
                                                 (json_int_t)bufs[k].length, "location", "cpu:0"));
        json_t *line = json_pack("{s:s,s:i,s:i,s:b,s:s,s:I,s:i,s:i,s:o}", "segment",
                                 transfer_engine_segment_name(eng), "tcp_data_port",
                                 (int)transfer_engine_data_port(eng), "pid", (int)getpid(), "auth",
                                 cfg.auth_secret != NULL, "protocol", transfer_protocol_name(proto),
                                 "pattern", (json_int_t)seed, "guard_bytes", TARGET_GUARD_BYTES,
                                 "guard_value", TARGET_GUARD_VALUE, "buffers", arr);
        char *s = json_dumps(line, JSON_COMPACT);
        printf("%s\n", s);
        fflush(stdout);
        free(s);
        json_decref(line);

        bool stdin_open = exit_on_eof;
        for (;;) {
            struct pollfd pfd[2] = {{.fd = sfd, .events = POLLIN}, {.fd = 0, .events = POLLIN}};
            int np = stdin_open ? 2 : 1;
            int r = poll(pfd, (nfds_t)np, -1);
            if (r < 0) {
                if (errno == EINTR) continue;
                fprintf(stderr, "disagg transfer target: poll: %s\n", strerror(errno));
                status = 1;
                break;
            }
            if (pfd[0].revents) break; /* SIGINT / SIGTERM */
            if (np == 2 && pfd[1].revents) {
                char tmp[4096];
                ssize_t got = read(0, tmp, sizeof tmp);
                if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) break;
            }
        }

        transfer_stats st;
        transfer_engine_get_stats(eng, &st);
        json_t *sj =
            json_pack("{s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I}", "event", "stats", "auth_refused",
                      (json_int_t)st.auth_refused, "bytes_written", (json_int_t)st.bytes_written,
                      "bytes_read", (json_int_t)st.bytes_read, "requests_ok",
                      (json_int_t)st.requests_ok, "requests_failed", (json_int_t)st.requests_failed,
                      "bytes_served", (json_int_t)st.bytes_served, "requests_rejected",
                      (json_int_t)st.requests_rejected, "path_retries", (json_int_t)st.path_retries,
                      "shm_fallbacks", (json_int_t)st.shm_fallbacks);
        s = json_dumps(sj, JSON_COMPACT);
        printf("%s\n", s);
        fflush(stdout);
        free(s);
        json_decref(sj);
    }

    for (size_t k = 0; k < nreg; k++)
        transfer_unregister(eng, bufs[k].data);
    transfer_engine_destroy(eng);
    for (size_t k = 0; k < nb; k++)
        munmap(bufs[k].map, bufs[k].length + 2 * TARGET_GUARD_BYTES);
    return status;
}

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
    int prc = opts_parse(&u, specs, sizeof specs / sizeof specs[0], argc, argv);
    if (prc) return prc < 0 ? 0 : prc;
    if (op_str) {
        const opt_spec ops = {"--op", OPT_OP, &op, 0, 0, NULL, NULL};
        if (opt_assign("copy", &ops, op_str)) return 2;
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

    uint8_t *local = map_bytes(length);
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
    int rc = initiator_create(proto, device, timeout_ms, &eng);
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
    rc = batch_run(eng, &req, 1, wait_budget_ns(timeout_ms, length), NULL, msg, sizeof msg, &bad);
    transfer_unregister(eng, local);
    if (rc) {
        fprintf(stderr,
                "disagg transfer copy: %s of %" PRIu64 " bytes at 0x%" PRIx64 " on %s failed: %s\n",
                op_name(op), length, remote, target, transfer_strerror(rc));
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

/* ==== check =============================================================== */

typedef struct check_params {
    const char *target; /* segment name */
    transfer_protocol protocol;
    const char *device;  /* interface whitelist or NULL */
    uint64_t iterations; /* rounds: one mixed batch + one read-back batch each */
    uint64_t seed;       /* traffic seed */
    uint64_t max_length; /* longest request */
    uint64_t batch;      /* requests per batch */
    uint64_t pattern;    /* the target's pattern seed */
    uint64_t timeout_ms; /* engine deadline base, 0 = default */
    bool no_restore;     /* leave written bytes in the target */
    bool quiet;          /* no progress lines on stderr (demo) */
    bool progress;       /* a stderr line after every round */
} check_params;

typedef struct check_summary {
    bool ok;             /* everything verified */
    char error[600];     /* first failure */
    char protocol[16];   /* transport the engine used */
    size_t buffers;      /* target buffers checked */
    uint64_t span_bytes; /* bytes of target memory covered (sum over buffers) */
    uint64_t requests, reads, writes;
    uint64_t bytes_read, bytes_written;
    uint64_t verified_bytes;            /* bytes compared against the expected contents */
    uint64_t min_len, max_len;          /* request lengths seen */
    int rejected_expected, rejected_ok; /* out-of-range requests sent / rejected with EREMOTEADDR */
    double transfer_seconds;            /* time inside submit..wait of the random phase */
    double wall_seconds;
} check_summary;

typedef struct check_range {
    size_t k;     /* buffer rank */
    uint64_t off; /* offset in buffer */
    uint64_t len; /* bytes */
    transfer_opcode op;
} check_range;

typedef struct check_ctx {
    const check_params *p;
    check_summary *s;
    transfer_engine *eng;
    transfer_segment seg;
    transfer_buffer_info *bufs;    /* (buffers) sorted by addr */
    uint64_t *span;                /* (buffers) bytes checked per buffer */
    uint8_t **shadow;              /* (buffers)(span) expected contents */
    uint64_t *dirty_lo, *dirty_hi; /* (buffers) written extent */
    uint8_t *arena;                /* (2 * batch * max_length) registered local memory */
    size_t arena_len;
    uint64_t rng;
} check_ctx;

static int cmp_buffer_info(const void *a, const void *b) {
    const transfer_buffer_info *x = a, *y = b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

static bool check_fail(check_ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool check_fail(check_ctx *c, const char *fmt, ...) {
    if (c->s->ok) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->s->error, sizeof c->s->error, fmt, ap);
        va_end(ap);
    }
    c->s->ok = false;
    return false;
}

/* Compares got with the shadow for range r; records the first mismatch. */
static bool check_compare(check_ctx *c, const check_range *r, const uint8_t *got,
                          const char *what) {
    const uint8_t *want = c->shadow[r->k] + r->off;
    if (memcmp(got, want, r->len) == 0) {
        c->s->verified_bytes += r->len;
        return true;
    }
    uint64_t j = 0;
    while (got[j] == want[j])
        j++;
    return check_fail(c,
                      "%s of %" PRIu64 " bytes at buffer %zu offset %" PRIu64 ": byte %" PRIu64
                      " is 0x%02x, expected 0x%02x",
                      what, r->len, r->k, r->off, r->off + j, got[j], want[j]);
}

static uint64_t check_pick_len(check_ctx *c, uint64_t limit) {
    uint64_t max = c->p->max_length < limit ? c->p->max_length : limit;
    switch (pick_next(&c->rng) % 4) {
    case 0:
        return pick_range(&c->rng, 1, max < 64 ? max : 64);
    case 1:
        return pick_range(&c->rng, 1, max);
    default: { /* log-uniform */
        int bits = 0;
        while (bits < 63 && (1ull << (bits + 1)) <= max)
            bits++;
        uint64_t hi = 1ull << pick_range(&c->rng, 0, (uint64_t)bits);
        return pick_range(&c->rng, hi / 2 + 1 > max ? 1 : hi / 2 + 1, hi > max ? max : hi);
    }
    }
}

static bool ranges_overlap(const check_range *a, const check_range *b) {
    return a->k == b->k && a->off < b->off + b->len && b->off < a->off + a->len;
}

/* Runs n requests on arena slots (slot i at arena + i * max_length). */
static int check_submit(check_ctx *c, const check_range *rs, size_t n, uint8_t *slots,
                        double *secs) {
    transfer_request reqs[CHECK_MAX_BATCH];
    uint64_t base[CHECK_MAX_BATCH];
    uint64_t bytes = 0;
    for (size_t i = 0; i < n; i++) {
        reqs[i] = (transfer_request){.opcode = rs[i].op,
                                     .local = slots + i * c->p->max_length,
                                     .target = c->seg,
                                     .remote_addr = c->bufs[rs[i].k].addr + rs[i].off,
                                     .length = rs[i].len};
        base[i] = c->bufs[rs[i].k].addr;
        bytes += rs[i].len;
    }
    char msg[512];
    long bad;
    uint64_t t0 = clock_now_ns();
    int rc = batch_run(c->eng, reqs, n, wait_budget_ns(c->p->timeout_ms, bytes), base, msg,
                       sizeof msg, &bad);
    if (secs) *secs += (double)(clock_now_ns() - t0) / 1e9;
    if (rc) {
        check_fail(c, "%s", msg);
        return rc;
    }
    c->s->requests += n;
    for (size_t i = 0; i < n; i++) {
        if (rs[i].op == TRANSFER_READ)
            c->s->reads++, c->s->bytes_read += rs[i].len;
        else
            c->s->writes++, c->s->bytes_written += rs[i].len;
        if (!c->s->min_len || rs[i].len < c->s->min_len) c->s->min_len = rs[i].len;
        if (rs[i].len > c->s->max_len) c->s->max_len = rs[i].len;
    }
    return 0;
}

/* One round: a batch of non-overlapping random READs and WRITEs, READs verified;
 * then a batch reading every written range back, verified. */
static bool check_round(check_ctx *c, uint64_t round) {
    check_range rs[CHECK_MAX_BATCH] = {0};
    size_t n = 0;
    size_t want = c->p->batch;
    for (size_t tries = 0; n < want && tries < want * 8; tries++) {
        check_range r;
        r.k = pick_next(&c->rng) % c->s->buffers;
        uint64_t span = c->span[r.k];
        r.len = check_pick_len(c, span);
        uint64_t where = pick_next(&c->rng) % 8;
        if (round == 0 && n == 0)
            r.off = 0; /* the edges on the first round */
        else if (round == 0 && n == 1)
            r.off = span - r.len;
        else if (where == 0)
            r.off = 0;
        else if (where == 1)
            r.off = span - r.len;
        else
            r.off = pick_range(&c->rng, 0, span - r.len);
        r.op = (pick_next(&c->rng) & 1) ? TRANSFER_WRITE : TRANSFER_READ;
        bool clash = false;
        for (size_t i = 0; i < n && !clash; i++)
            clash = ranges_overlap(&r, &rs[i]);
        if (!clash) rs[n++] = r;
    }
    uint8_t *slots = c->arena, *back = c->arena + c->p->batch * c->p->max_length;
    for (size_t i = 0; i < n; i++)
        if (rs[i].op == TRANSFER_WRITE)
            random_fill(slots + i * c->p->max_length, rs[i].len, &c->rng);
    if (check_submit(c, rs, n, slots, &c->s->transfer_seconds)) return false;

    check_range wb[CHECK_MAX_BATCH] = {0};
    size_t nw = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t *slot = slots + i * c->p->max_length;
        if (rs[i].op == TRANSFER_READ) {
            if (!check_compare(c, &rs[i], slot, "READ")) return false;
            continue;
        }
        memcpy(c->shadow[rs[i].k] + rs[i].off, slot, rs[i].len);
        if (rs[i].off < c->dirty_lo[rs[i].k]) c->dirty_lo[rs[i].k] = rs[i].off;
        if (rs[i].off + rs[i].len > c->dirty_hi[rs[i].k])
            c->dirty_hi[rs[i].k] = rs[i].off + rs[i].len;
        wb[nw] = rs[i];
        wb[nw++].op = TRANSFER_READ;
    }
    if (nw == 0) return true;
    memset(back, 0, nw * c->p->max_length);
    if (check_submit(c, wb, nw, back, &c->s->transfer_seconds)) return false;
    for (size_t i = 0; i < nw; i++)
        if (!check_compare(c, &wb[i], back + i * c->p->max_length, "READ-back of WRITE"))
            return false;
    return true;
}

/* Sends one request outside every buffer; it must end with TRANSFER_EREMOTEADDR. */
static bool check_reject(check_ctx *c, transfer_opcode op, uint64_t remote, uint64_t len,
                         const char *what) {
    c->s->rejected_expected++;
    if (op == TRANSFER_WRITE) random_fill(c->arena, len, &c->rng);
    transfer_request req = {
        .opcode = op, .local = c->arena, .target = c->seg, .remote_addr = remote, .length = len};
    char msg[512];
    long bad;
    int rc = batch_run(c->eng, &req, 1, wait_budget_ns(c->p->timeout_ms, len), NULL, msg,
                       sizeof msg, &bad);
    if (rc == TRANSFER_EREMOTEADDR) {
        c->s->rejected_ok++;
        return true;
    }
    if (rc == 0)
        return check_fail(c,
                          "%s %s of %" PRIu64 " bytes at 0x%" PRIx64 " was accepted; expected %s",
                          what, op_name(op), len, remote, transfer_strerror(TRANSFER_EREMOTEADDR));
    return check_fail(c, "%s %s at 0x%" PRIx64 " failed with '%s'; expected '%s' (%s)", what,
                      op_name(op), remote, transfer_strerror(rc),
                      transfer_strerror(TRANSFER_EREMOTEADDR), msg);
}

static bool check_out_of_range(check_ctx *c) {
    /* A buffer whose end is not another buffer's start: straddle its end. */
    for (size_t k = 0; k < c->s->buffers; k++) {
        uint64_t end = c->bufs[k].addr + c->bufs[k].length;
        bool adjacent = false;
        for (size_t j = 0; j < c->s->buffers; j++)
            adjacent |= c->bufs[j].addr == end;
        if (adjacent) continue;
        uint64_t len = c->bufs[k].length < 8 ? c->bufs[k].length + 8 : 16;
        uint64_t at = end - (len - 8);
        if (!check_reject(c, TRANSFER_READ, at, len, "straddling the end of a buffer:"))
            return false;
        if (!check_reject(c, TRANSFER_WRITE, at, len, "straddling the end of a buffer:"))
            return false;
        break;
    }
    /* Past every buffer. */
    uint64_t top = 0;
    for (size_t k = 0; k < c->s->buffers; k++)
        if (c->bufs[k].addr + c->bufs[k].length > top) top = c->bufs[k].addr + c->bufs[k].length;
    return check_reject(c, TRANSFER_READ, top + 4096, 64, "past every buffer:");
}

/* Restores the written extents to the pattern (unless no_restore) and reads
 * every checked byte back, verified. */
static bool check_final(check_ctx *c) {
    uint64_t chunk = c->p->max_length;
    check_range rs[CHECK_MAX_BATCH] = {0};
    if (!c->p->no_restore) {
        for (size_t k = 0; k < c->s->buffers; k++) {
            if (c->dirty_hi[k] <= c->dirty_lo[k]) continue;
            pattern_fill(c->shadow[k] + c->dirty_lo[k], c->p->pattern, k, c->dirty_lo[k],
                         c->dirty_hi[k] - c->dirty_lo[k]);
            uint64_t off = c->dirty_lo[k];
            while (off < c->dirty_hi[k]) {
                size_t n = 0;
                for (; n < c->p->batch && off < c->dirty_hi[k]; n++) {
                    uint64_t len = c->dirty_hi[k] - off < chunk ? c->dirty_hi[k] - off : chunk;
                    rs[n] = (check_range){.k = k, .off = off, .len = len, .op = TRANSFER_WRITE};
                    memcpy(c->arena + n * chunk, c->shadow[k] + off, len);
                    off += len;
                }
                if (check_submit(c, rs, n, c->arena, NULL)) return false;
            }
        }
    }
    for (size_t k = 0; k < c->s->buffers; k++) {
        uint64_t off = 0;
        while (off < c->span[k]) {
            size_t n = 0;
            for (; n < c->p->batch && off < c->span[k]; n++) {
                uint64_t len = c->span[k] - off < chunk ? c->span[k] - off : chunk;
                rs[n] = (check_range){.k = k, .off = off, .len = len, .op = TRANSFER_READ};
                off += len;
            }
            if (check_submit(c, rs, n, c->arena, NULL)) return false;
            for (size_t i = 0; i < n; i++)
                if (!check_compare(c, &rs[i], c->arena + i * chunk, "final READ")) return false;
        }
    }
    return true;
}

/* The whole check; fills *s.  Returns 0 when everything verified, else 1. */
static int check_run(const check_params *p, check_summary *s) {
    memset(s, 0, sizeof *s);
    s->ok = true;
    snprintf(s->protocol, sizeof s->protocol, "%s", transfer_protocol_name(p->protocol));
    uint64_t t0 = clock_now_ns();
    check_ctx c = {.p = p, .s = s, .rng = p->seed * 0x2545F4914F6CDD1Dull + 7};
    transfer_buffer_info bufs[TARGET_MAX_BUFFERS];
    uint64_t span[TARGET_MAX_BUFFERS], lo[TARGET_MAX_BUFFERS], hi[TARGET_MAX_BUFFERS];
    uint8_t *shadow[TARGET_MAX_BUFFERS] = {0};
    c.bufs = bufs, c.span = span, c.dirty_lo = lo, c.dirty_hi = hi, c.shadow = shadow;

    int rc = initiator_create(p->protocol, p->device, p->timeout_ms, &c.eng);
    if (rc) {
        check_fail(&c, "cannot create the engine: %s", transfer_strerror(rc));
        goto out;
    }
    rc = transfer_open_segment(c.eng, p->target, &c.seg);
    if (rc) {
        check_fail(&c, "cannot open segment %s: %s", p->target, transfer_strerror(rc));
        goto out;
    }
    transfer_segment_info info;
    rc = transfer_segment_get_info(c.eng, c.seg, &info);
    if (rc) {
        check_fail(&c, "transfer_segment_get_info(%s): %s", p->target, transfer_strerror(rc));
        goto out;
    }
    snprintf(s->protocol, sizeof s->protocol, "%s", transfer_protocol_name(info.protocol));
    int nb = transfer_segment_get_buffers(c.eng, c.seg, bufs, TARGET_MAX_BUFFERS);
    if (nb <= 0) {
        check_fail(&c, "segment %s advertises no buffers%s%s", p->target, nb < 0 ? ": " : "",
                   nb < 0 ? transfer_strerror(nb) : "");
        goto out;
    }
    s->buffers = (size_t)nb;
    qsort(bufs, s->buffers, sizeof bufs[0], cmp_buffer_info);
    if (!p->quiet)
        fprintf(stderr, "disagg transfer check: opened %s (protocol %s, %zu buffers, pid %d)\n",
                p->target, s->protocol, s->buffers, info.pid);
    for (size_t k = 0; k < s->buffers; k++) {
        span[k] = bufs[k].length < CHECK_MAX_SPAN ? bufs[k].length : CHECK_MAX_SPAN;
        s->span_bytes += span[k];
        lo[k] = UINT64_MAX, hi[k] = 0;
        shadow[k] = map_bytes(span[k]);
        if (!shadow[k]) {
            check_fail(&c, "cannot map %" PRIu64 " bytes for the expected contents", span[k]);
            goto out;
        }
        pattern_fill(shadow[k], p->pattern, k, 0, span[k]);
    }
    c.arena_len = 2 * p->batch * p->max_length;
    c.arena = map_bytes(c.arena_len);
    if (!c.arena) {
        check_fail(&c, "cannot map %zu bytes of local memory", c.arena_len);
        goto out;
    }
    rc = transfer_register(c.eng, c.arena, c.arena_len, "cpu:0");
    if (rc) {
        check_fail(&c, "transfer_register(%zu bytes): %s", c.arena_len, transfer_strerror(rc));
        goto out;
    }

    if (!p->quiet) fprintf(stderr, "disagg transfer check: traffic started\n");
    for (uint64_t r = 0; r < p->iterations; r++) {
        if (!check_round(&c, r)) goto out;
        if (p->progress)
            fprintf(stderr, "disagg transfer check: round %" PRIu64 " ok, %" PRIu64 " requests\n",
                    r + 1, s->requests);
    }
    if (!check_out_of_range(&c)) goto out;
    check_final(&c);

out:
    if (c.arena) {
        if (c.eng) transfer_unregister(c.eng, c.arena);
        munmap(c.arena, c.arena_len);
    }
    if (c.eng) transfer_engine_destroy(c.eng);
    for (size_t k = 0; k < s->buffers; k++)
        if (shadow[k]) munmap(shadow[k], span[k]);
    s->wall_seconds = (double)(clock_now_ns() - t0) / 1e9;
    return s->ok ? 0 : 1;
}

static void check_print_json(const check_params *p, const check_summary *s) {
    double moved = (double)(s->bytes_read + s->bytes_written);
    json_t *j = json_pack(
        "{s:b,s:s,s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:i,s:i,s:f,s:f,s:f}", "ok",
        s->ok, "segment", p->target, "protocol", s->protocol, "buffers", (json_int_t)s->buffers,
        "span_bytes", (json_int_t)s->span_bytes, "seed", (json_int_t)p->seed, "requests",
        (json_int_t)s->requests, "reads", (json_int_t)s->reads, "writes", (json_int_t)s->writes,
        "bytes_read", (json_int_t)s->bytes_read, "bytes_written", (json_int_t)s->bytes_written,
        "verified_bytes", (json_int_t)s->verified_bytes, "min_length", (json_int_t)s->min_len,
        "max_length", (json_int_t)s->max_len, "rejected_expected", s->rejected_expected,
        "rejected_ok", s->rejected_ok, "transfer_seconds", s->transfer_seconds, "wall_seconds",
        s->wall_seconds, "gbps", s->transfer_seconds > 0 ? moved / s->transfer_seconds / 1e9 : 0.0);
    if (!s->ok) json_object_set_new(j, "error", json_string(s->error));
    char *str = json_dumps(j, JSON_COMPACT);
    printf("%s\n", str);
    fflush(stdout);
    free(str);
    json_decref(j);
}

/* The check options shared by `check` and `demo`. */
// clang-format off
#define CHECK_SPECS(P)                                                                                             \
    {"--protocol", OPT_PROTO, &(P).protocol, 0, 0, "auto|tcp|shm|rdma", "engine protocol (default auto; rdma: --device-name names the NICs, tcp when none)"},                \
    {"--device-name", OPT_STR, &(P).device, 0, 0, "LIST", "comma-separated interface whitelist"},                     \
    {"--iterations", OPT_UINT, &(P).iterations, 0, 100000000, "N", "rounds of random traffic (default 50)"},          \
    {"--seed", OPT_UINT, &(P).seed, 0, UINT64_MAX, "S", "traffic seed (default 1)"},                                   \
    {"--max-length", OPT_SIZE, &(P).max_length, 1, 1ull << 30, "L", "longest request (default 1M)"},                   \
    {"--batch", OPT_UINT, &(P).batch, 1, CHECK_MAX_BATCH, "N", "requests per batch (default 16)"},                    \
    {"--pattern", OPT_UINT, &(P).pattern, 0, UINT64_MAX, "SEED", "the target's pattern seed (default 1)"},            \
    {"--timeout-ms", OPT_UINT, &(P).timeout_ms, 1, 3600000, "MS", "request deadline base (default 30 s) + 1 ns/byte"}
// clang-format on

static void check_params_init(check_params *p) {
    *p = (check_params){.protocol = TRANSFER_PROTO_AUTO,
                        .iterations = 50,
                        .seed = 1,
                        .max_length = 1ull << 20,
                        .batch = 16,
                        .pattern = 1};
}

static int cmd_check(int argc, char **argv) {
    check_params p;
    check_params_init(&p);
    // clang-format off
    const opt_spec specs[] = {
        {"--target", OPT_SEG, &p.target, 0, 0, "SEG", "the target's segment name ip:port (required)"},
        CHECK_SPECS(p),
        {"--no-restore", OPT_FLAG, &p.no_restore, 0, 0, NULL, "leave the written bytes (default: restore the pattern)"},
        {"--progress", OPT_FLAG, &p.progress, 0, 0, NULL, "print a line on stderr after every round"},
    };
    // clang-format on
    const sub_usage u = {
        "check", "--target SEG [options]",
        "Random READs (verified against the pattern) and WRITEs (read back and verified)\n"
        "at random offsets and lengths inside the target's buffers, in batches; requests\n"
        "outside the buffers must be rejected; finally restores the pattern and verifies\n"
        "every byte (at most 256 MiB per buffer).  Prints one JSON summary line; exit 0\n"
        "only if everything verified."};
    int prc = opts_parse(&u, specs, sizeof specs / sizeof specs[0], argc, argv);
    if (prc) return prc < 0 ? 0 : prc;
    if (!p.target) {
        fprintf(
            stderr,
            "disagg transfer check: --target SEG is required (see disagg transfer check --help)\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    check_summary s;
    int rc = check_run(&p, &s);
    check_print_json(&p, &s);
    if (rc) fprintf(stderr, "disagg transfer check: FAILED: %s\n", s.error);
    return rc;
}

/* ==== demo ================================================================ */

/* Reads one line from fd into buf within deadline; 0 or -1. */
static int read_line(int fd, char *buf, size_t cap, uint64_t deadline) {
    size_t n = 0;
    while (n + 1 < cap) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int r = poll(&pfd, 1, clock_remaining_ms(deadline));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        ssize_t got = read(fd, buf + n, 1);
        if (got <= 0) return -1;
        if (buf[n] == '\n') break;
        n++;
    }
    buf[n] = 0;
    return 0;
}

static void child_reap(pid_t pid, uint64_t deadline) {
    int st;
    while (waitpid(pid, &st, WNOHANG) == 0) {
        if (clock_remaining_ns(deadline) == 0) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return;
        }
        clock_sleep_ns(10 * NS_PER_MS);
    }
}

static int transfer_demo(int argc, char **argv) {
    check_params p;
    check_params_init(&p);
    p.iterations = 64;
    p.quiet = true;
    p.max_length = 4ull << 20;
    uint64_t buffer_size = 64ull << 20;
    // clang-format off
    const opt_spec specs[] = {
        CHECK_SPECS(p),
        {"--buffer-size", OPT_SIZE, &buffer_size, 1, 1ull << 36, "BYTES", "the target's buffer size (default 64M)"},
    };
    // clang-format on
    const sub_usage u = {"demo", "[options]",
                         "Starts a transfer target (a child process), runs `check` against it and\n"
                         "prints what moved, that every byte verified, and the throughput."};
    int prc = opts_parse(&u, specs, sizeof specs / sizeof specs[0], argc, argv);
    if (prc) return prc < 0 ? 0 : prc;
    signal(SIGPIPE, SIG_IGN);

    int in_pipe[2], out_pipe[2];
    if (pipe2(in_pipe, O_CLOEXEC) < 0 || pipe2(out_pipe, O_CLOEXEC) < 0) {
        fprintf(stderr, "disagg transfer demo: pipe: %s\n", strerror(errno));
        return 1;
    }
    char size_arg[32], pattern_arg[32];
    snprintf(size_arg, sizeof size_arg, "%" PRIu64, buffer_size);
    snprintf(pattern_arg, sizeof pattern_arg, "%" PRIu64, p.pattern);
    char *const child_argv[] = {"disagg",
                                "transfer",
                                "target",
                                "--buffer-size",
                                size_arg,
                                "--pattern",
                                pattern_arg,
                                "--protocol",
                                (char *)transfer_protocol_name(p.protocol),
                                "--exit-on-stdin-eof",
                                NULL};
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "disagg transfer demo: fork: %s\n", strerror(errno));
        return 1;
    }
    if (pid == 0) {
        dup2(in_pipe[0], 0);
        dup2(out_pipe[1], 1);
        execv("/proc/self/exe", child_argv);
        fprintf(stderr, "disagg transfer demo: exec /proc/self/exe: %s\n", strerror(errno));
        _exit(127);
    }
    close(in_pipe[0]);
    close(out_pipe[1]);

    int status = 1;
    char line[8192];
    json_t *j = NULL;
    if (read_line(out_pipe[0], line, sizeof line, clock_now_ns() + 30 * NS_PER_S) < 0 ||
        !(j = json_loads(line, 0, NULL)) || !json_is_string(json_object_get(j, "segment"))) {
        fprintf(stderr,
                "disagg transfer demo: the target (pid %d) did not print its segment line\n",
                (int)pid);
        goto out;
    }
    char segment[128];
    snprintf(segment, sizeof segment, "%s", json_string_value(json_object_get(j, "segment")));
    p.target = segment;
    char sz[32];
    format_bytes(sz, sizeof sz, (double)buffer_size);
    printf("disagg transfer demo: target pid %d serves %s at %s\n", (int)pid, sz, segment);
    fflush(stdout);

    check_summary s;
    int rc = check_run(&p, &s);
    char rd[32], wr[32], mn[32], mx[32], vf[32];
    format_bytes(rd, sizeof rd, (double)s.bytes_read);
    format_bytes(wr, sizeof wr, (double)s.bytes_written);
    format_bytes(mn, sizeof mn, (double)s.min_len);
    format_bytes(mx, sizeof mx, (double)s.max_len);
    format_bytes(vf, sizeof vf, (double)s.verified_bytes);
    printf("  protocol %s: %" PRIu64 " requests (%" PRIu64 " READ, %" PRIu64 " WRITE) of %s..%s\n",
           s.protocol, s.requests, s.reads, s.writes, mn, mx);
    printf("  moved %s read + %s written; %.2f GB/s while transferring (%.2f s wall)\n", rd, wr,
           s.transfer_seconds > 0
               ? (double)(s.bytes_read + s.bytes_written) / s.transfer_seconds / 1e9
               : 0.0,
           s.wall_seconds);
    printf("  %s compared against the expected bytes; %d/%d out-of-range requests rejected\n", vf,
           s.rejected_ok, s.rejected_expected);

    close(in_pipe[1]); /* target exits on stdin EOF and prints its stats */
    in_pipe[1] = -1;
    if (read_line(out_pipe[0], line, sizeof line, clock_now_ns() + 10 * NS_PER_S) == 0) {
        json_t *st = json_loads(line, 0, NULL);
        if (st) {
            char served[32];
            format_bytes(served, sizeof served,
                         (double)json_integer_value(json_object_get(st, "bytes_served")));
            printf("  target served %s over tcp, rejected %" JSON_INTEGER_FORMAT " requests\n",
                   served, json_integer_value(json_object_get(st, "requests_rejected")));
            json_decref(st);
        }
    }
    if (rc == 0) {
        printf("OK: every byte verified\n");
        status = 0;
    } else {
        printf("FAILED: %s\n", s.error);
        fprintf(stderr, "disagg transfer demo: FAILED: %s\n", s.error);
    }
out:
    fflush(stdout);
    if (j) json_decref(j);
    if (in_pipe[1] >= 0) close(in_pipe[1]);
    child_reap(pid, clock_now_ns() + 10 * NS_PER_S);
    close(out_pipe[0]);
    return status;
}

/* ==== dispatch ============================================================ */

static void transfer_usage(FILE *f) {
    fprintf(f, "usage: disagg transfer <sub> [options]\n\n"
               "Helpers around the transfer engine (include/disagg/transfer.h):\n"
               "  target   register patterned buffers and serve them; prints a JSON line\n"
               "  copy     one READ or WRITE against a target (bytes from/to a file or stdio)\n"
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
    if (!strcmp(sub, "target")) return cmd_target(argc - 1, argv + 1);
    if (!strcmp(sub, "copy")) return cmd_copy(argc - 1, argv + 1);
    if (!strcmp(sub, "check")) return cmd_check(argc - 1, argv + 1);
    if (!strcmp(sub, "demo")) return transfer_demo(argc - 1, argv + 1);
    fprintf(stderr,
            "disagg transfer: unknown subcommand '%s'; accepted: target, copy, check, demo\n", sub);
    return 2;
}
