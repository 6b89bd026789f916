/*
 * transfer_bench — `disagg bench transfer`: throughput and latency of the
 * transfer engine (include/disagg/transfer.h, nothing else of it), in the
 * manner of Mooncake's transfer_engine_bench.
 *
 * Modes:
 *   --mode target      registers one buffer filled with a known pattern, prints
 *                      the target ready line (transfer_bench.h: one JSON object,
 *                      {"segment","pid","buffers":[{"addr","length"}],...}) on
 *                      stdout and serves until SIGINT/TERM.
 *   --mode initiator   opens --segment-id and runs the sweep against it.
 *   (no --mode)        single command: for each protocol, fork+exec
 *                      /proc/self/exe as a target, read its line from a pipe,
 *                      run the sweep, stop it.
 *
 * The target's buffer is split in two halves: READs read the first (never
 * written, so its pattern always holds), WRITEs write the second.  Thread t
 * moves slots [t*batch, (t+1)*batch) of block bytes: local slot s <-> remote
 * offset half + s*block, the same every iteration (like Mooncake's bench).
 *
 * For every block size the sweep prints the engine's GB/s, ops/s and batch
 * latency, then, measured right after at the same block size and footprint,
 * the single-thread memcpy bandwidth and (tcp) a plain blocking loopback
 * socket request/response loop (transfer_baseline.c), and the ratio.  Then
 * the single-request round trip (4 KiB, batch 1, one thread) and the issue's
 * targets, PASS or MISS.  --verify checks every byte moved (READ against the
 * target's pattern; WRITE by reading back); a mismatch exits 1.
 */
#include "base/auth.h"
#include "base/bytesize.h"
#include "base/flags.h"
#include "bench/bench.h"
#include "bench/transfer_bench.h"
#include "disagg/transfer.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TB_MAX_BLOCKS     32
#define TB_MAX_ROUNDS     9
#define TB_DEFAULT_BUFFER (512ull << 20)
#define TB_RTT_BLOCK      4096
#define TB_PAGE           4096ull

static uint64_t tb_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- options ------------------------------------------------------------------ */

typedef enum tb_mode { TB_MODE_SINGLE = 0, TB_MODE_TARGET, TB_MODE_INITIATOR } tb_mode;

typedef struct tb_options {
    tb_mode mode;                   /* single command unless --mode */
    transfer_protocol protocols[2]; /* TCP and/or SHM, in the order given */
    int nprotocols;                 /* 1 or 2 */
    transfer_opcode operations[2];  /* READ and/or WRITE */
    int noperations;                /* 1 or 2 */
    size_t blocks[TB_MAX_BLOCKS];   /* block sizes of the sweep, bytes */
    int nblocks;                    /* entries in blocks */
    long batch;                     /* requests per batch (capped by the buffer) */
    long threads;                   /* submitting threads */
    long rounds;                    /* interleaved engine/ceiling rounds per block size */
    double duration;                /* seconds per block size */
    const char *device_name;        /* interface whitelist, NULL = engine default */
    const char *local_hostname;     /* advertised address, NULL = engine default */
    const char *segment_id;         /* initiator: the target's "ip:port" */
    long port;                      /* target: rpc port, 0 = ephemeral */
    size_t buffer_size;             /* target buffer bytes (two halves) */
    bool verify;                    /* check every byte moved */
    bool json;                      /* machine-readable output on stdout */
    bool no_ceilings;               /* skip memcpy/socket ceilings (profiling the engine) */
    bool hugepages;                 /* MADV_HUGEPAGE on every buffer (target, local, ceilings) */
} tb_options;

static const char *tb_op_name(transfer_opcode op) {
    return op == TRANSFER_READ ? "read" : "write";
}

#define TB_USAGE                                                                                   \
    "usage: disagg bench transfer [options]\n"                                                     \
    "\n"                                                                                           \
    "Throughput and latency of the transfer engine, like Mooncake's transfer_engine_bench.\n"      \
    "Without --mode it runs both ends itself: it forks a target (this binary with\n"               \
    "--mode target), reads the target's ready line (its segment name and buffer address)\n"        \
    "from a pipe, and sweeps the block sizes against it.\n"                                        \
    "\n"                                                                                           \
    "options (also accepted as --name=value and with '_' for '-'):\n"

#define TB_EPILOG                                                                                  \
    "\n"                                                                                           \
    "Per block size: GB/s (10^9 bytes/s), ops/s, p50/p99 latency of one batch (submit to\n"        \
    "all completed), then ceilings measured right after at the same block size and memory\n"       \
    "footprint: single-thread memcpy GB/s, and for tcp a plain blocking loopback socket\n"         \
    "request/response loop (one connection: 24-byte header + block for write, 24-byte\n"           \
    "header then 8 + block bytes back for read), and the engine's ratio to its ceiling\n"          \
    "(tcp: socket loop; shm: memcpy).  Once per protocol, a streaming memcpy (1 MiB blocks\n"      \
    "over 64 MiB, beyond the caches) is measured too; the shm targets show the ratio to it\n"      \
    "beside the verdict.  Then the single-request round trip (4 KiB, batch 1, one thread)\n"       \
    "and the transfer targets, PASS or MISS: shm >= 64 KiB at >= 80% of memcpy, tcp >= 1 MiB\n"     \
    "at >= 80% of the socket loop, 4 KiB requests/s >= 60k (tcp) / 200k (shm), tcp\n"              \
    "single-request round trip p50 <= 40 us.\n"                                                    \
    "\n"                                                                                           \
    "examples:\n"                                                                                  \
    "  disagg bench transfer --protocol tcp,shm --operation read,write\n"                          \
    "  disagg bench transfer --protocol shm --block-size 1M --duration 3 --verify\n"               \
    "  disagg bench transfer --mode target --protocol tcp --local-hostname 10.0.0.2\n"             \
    "  disagg bench transfer --mode initiator --segment-id 10.0.0.2:40123 --threads 2\n"           \
    "\n"                                                                                           \
    "exit status: 0 done (targets missed are reported, not failures), 1 engine error or\n"         \
    "verification mismatch, 2 bad options.\n"

#define TB_SIZE_FORMS "sizes of 1..1G bytes: " BYTESIZE_FORMS

/* --protocol: tcp, shm, or the list "tcp,shm". */
static int tb_flag_protocols(flags_parser *p, const flag_def *d, const char *s) {
    tb_options *o = d->dst;
    char buf[64];
    int ok = strlen(s) < sizeof buf;
    o->nprotocols = 0;
    if (ok) strcpy(buf, s);
    for (char *save, *t = ok ? strtok_r(buf, ",", &save) : NULL; t && ok;
         t = strtok_r(NULL, ",", &save)) {
        transfer_protocol pr = !strcmp(t, "tcp") ? TRANSFER_PROTO_TCP : TRANSFER_PROTO_SHM;
        ok = (!strcmp(t, "tcp") || !strcmp(t, "shm")) && o->nprotocols < 2 &&
             !(o->nprotocols && o->protocols[0] == pr);
        if (ok) o->protocols[o->nprotocols++] = pr;
    }
    if (ok && o->nprotocols) return 0;
    flags_error(p, "--protocol '%s' is not accepted; accepted: tcp, shm, or the list tcp,shm", s);
    return -1;
}

/* --operation: read, write, or the list "read,write". */
static int tb_flag_operations(flags_parser *p, const flag_def *d, const char *s) {
    tb_options *o = d->dst;
    char buf[64];
    int ok = strlen(s) < sizeof buf;
    o->noperations = 0;
    if (ok) strcpy(buf, s);
    for (char *save, *t = ok ? strtok_r(buf, ",", &save) : NULL; t && ok;
         t = strtok_r(NULL, ",", &save)) {
        transfer_opcode op = !strcmp(t, "read") ? TRANSFER_READ : TRANSFER_WRITE;
        ok = (!strcmp(t, "read") || !strcmp(t, "write")) && o->noperations < 2 &&
             !(o->noperations && o->operations[0] == op);
        if (ok) o->operations[o->noperations++] = op;
    }
    if (ok && o->noperations) return 0;
    flags_error(
        p, "--operation '%s' is not accepted; accepted: read, write, or the list read,write", s);
    return -1;
}

/* --block-size: one size or a comma list of at most TB_MAX_BLOCKS, each 1..1G (the tcp
 * protocol's limit). */
static int tb_flag_blocks(flags_parser *p, const flag_def *d, const char *s) {
    tb_options *o = d->dst;
    char buf[512];
    o->nblocks = 0;
    if (strlen(s) >= sizeof buf) {
        flags_error(p, "--block-size '%.40s...' is not accepted; accepted: at most 511 characters",
                    s);
        return -1;
    }
    if (!*s || s[0] == ',' || s[strlen(s) - 1] == ',' || strstr(s, ",,")) {
        flags_error(p,
                    "--block-size '%s' is not accepted; accepted: " TB_SIZE_FORMS
                    " (a list separates sizes by single commas)",
                    s);
        return -1;
    }
    strcpy(buf, s);
    for (char *save, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        size_t v;
        if (tb_parse_size("--block-size", t, 1, 1ull << 30, &v)) return -1;
        if (o->nblocks == TB_MAX_BLOCKS) {
            flags_error(p,
                        "--block-size '%s' is not accepted; accepted: a list of at most %d sizes",
                        s, TB_MAX_BLOCKS);
            return -1;
        }
        o->blocks[o->nblocks++] = v;
    }
    return 0;
}

static int tb_flag_duration(flags_parser *p, const flag_def *d, const char *s) {
    if (!tb_parse_duration(s, d->dst)) return 0;
    flags_error(p,
                "--duration '%s' is not accepted; accepted: seconds > 0 and <= 3600: a number "
                "with an optional s or ms suffix, e.g. 1, 0.5, 2s, 500ms",
                s);
    return -1;
}

/* A check after a string is stored: not empty (--device-name, --local-hostname), with a port
 * (--segment-id). */
static int tb_flag_nonempty(flags_parser *p, const flag_def *d, const char *s) {
    const char *what =
        !strcmp(d->name, "--segment-id")    ? "the target's segment name IP:PORT or [IPv6]:PORT"
        : !strcmp(d->name, "--device-name") ? "interface names such as lo or eth0,eth1"
                                            : "an IP address";
    if (*s && (strcmp(d->name, "--segment-id") || strchr(s, ':'))) return 0;
    flags_error(p, "%s '%s' is not accepted; accepted: %s", d->name, s, what);
    return -1;
}

/* Returns -1 to go on, or the exit status (0 after --help, 2 on a bad option). */
static int tb_parse_args(int argc, char **argv, tb_options *o) {
    static const size_t default_blocks[] = {4u << 10, 16u << 10, 64u << 10, 256u << 10,
                                            1u << 20, 4u << 20,  16u << 20, 64u << 20};
    memset(o, 0, sizeof *o);
    o->mode = TB_MODE_SINGLE;
    o->protocols[0] = TRANSFER_PROTO_TCP;
    o->nprotocols = 1;
    o->operations[0] = TRANSFER_READ;
    o->noperations = 1;
    for (size_t i = 0; i < sizeof default_blocks / sizeof default_blocks[0]; i++)
        o->blocks[o->nblocks++] = default_blocks[i];
    o->batch = 128;
    o->threads = 1;
    o->rounds = 3;
    o->duration = 1.0;
    o->buffer_size = TB_DEFAULT_BUFFER;
    o->port = -1; /* not given */
    int mode = -1, hugepages = 0;
    const flag_def defs[] = {
        {FLAG_CHOICE_("--mode", &mode, "target", "initiator"), .metavar = "target|initiator",
         .help = "run one end only (default: both, single command)"},
        {FLAG_CUSTOM_("--protocol", o, tb_flag_protocols), .metavar = "P",
         .help = "tcp, shm, or a list \"tcp,shm\" (default tcp); target: one"},
        {FLAG_CUSTOM_("--operation", o, tb_flag_operations), .metavar = "O",
         .help = "read, write, or \"read,write\" (default read)"},
        {FLAG_CUSTOM_("--block-size", o, tb_flag_blocks), .metavar = "S",
         .help = "one size or a list \"4K,1M\" (default 4K,16K,64K,256K,1M,4M,16M,64M); sizes "
                 "take K, M, G, T suffixes (1K = 1024)"},
        {FLAG_INT_("--batch-size", &o->batch, 1, 65536),
         .help = "requests per batch, 1..65536 (default 128); capped per block size so that "
                 "threads x batch x block fits half the buffer"},
        {FLAG_INT_("--threads", &o->threads, 1, 64),
         .help = "submitting threads, 1..64 (default 1)"},
        {FLAG_CUSTOM_("--duration", &o->duration, tb_flag_duration), .metavar = "T",
         .help = "seconds per block size: 1, 0.5, 2s, 500ms; > 0 (default 1)"},
        {FLAG_INT_("--rounds", &o->rounds, 1, TB_MAX_ROUNDS),
         .help = "split each size's time into N rounds, 1..9 (default 3): the engine and its "
                 "ceilings alternate round by round and each reports its best round (the machine "
                 "may be shared); batch latencies are pooled over all rounds"},
        {FLAG_STRING_("--device-name", &o->device_name), .metavar = "LIST", .fn = tb_flag_nonempty,
         .help = "comma-separated interfaces for the engine's tcp paths (default: none given, the "
                 "engine's default)"},
        {FLAG_STRING_("--local-hostname", &o->local_hostname), .metavar = "IP",
         .fn = tb_flag_nonempty,
         .help = "address the engines advertise (default: 127.0.0.1 in single-command mode, else "
                 "the engine's choice)"},
        {FLAG_STRING_("--segment-id", &o->segment_id), .metavar = "IP:PORT", .fn = tb_flag_nonempty,
         .help = "initiator: the target's segment name (required there)"},
        {FLAG_INT_("--port", &o->port, 0, 65535),
         .help = "target: handshake port (default 0, ephemeral)"},
        {FLAG_BYTES_("--buffer-size", &o->buffer_size, 2 * TB_PAGE, (double)(1ull << 50)),
         .metavar = "S",
         .help = "target buffer (default 512M; single-command mode grows it to 2 x threads x "
                 "largest block); READs use its first half, WRITEs its second half"},
        {FLAG_BOOL_("--verify", &o->verify),
         .help = "check every byte moved: the target's buffer holds a known pattern, READs "
                 "compare with it, WRITEs are read back and compared; mismatches are reported "
                 "and the exit status is 1. The timed loop then includes the checking."},
        {FLAG_CHOICE_("--hugepages", &hugepages, "on", "off"), .metavar = "on|off",
         .help = "back every buffer (the target's, the initiator's, the ceilings') with "
                 "transparent huge pages (MADV_HUGEPAGE) or 4 KiB pages (default on)"},
        {FLAG_BOOL_("--json", &o->json),
         .help = "print the results as one JSON object on stdout instead of tables"},
        /* never parsed here: bench_transfer_main hands the command to transfer_bench_cuda.c */
        {FLAG_STRING_("--location", (const char **)NULL), .metavar = "cuda:N",
         .help = "device memory on both sides (cuda_ipc and staged tcp against their ceilings; "
                 "its own options: --location cuda:0 --help)"},
        {FLAG_BOOL_("--no-ceilings", &o->no_ceilings),
         .help = "measure the engine only (no memcpy/socket loops, no ratios): for profiling it "
                 "with perf"},
        {FLAG_TEXT_("-h, --help", "this text")},
        {0}};
    const flag_def *tables[] = {defs, NULL};
    const flags_spec spec = {.cmd = "bench transfer",
                             .usage = TB_USAGE,
                             .epilog = TB_EPILOG,
                             .tables = tables,
                             .help_col = 23,
                             .underscores = 1,
                             .list_on_unknown = 1};
    int pr = flags_parse(&spec, argc, argv);
    if (pr) return pr == FLAGS_HELP ? 0 : 2;
    if (mode >= 0) o->mode = mode == 0 ? TB_MODE_TARGET : TB_MODE_INITIATOR;
    o->hugepages = hugepages == 0;
    bool port_given = o->port >= 0, segment_given = o->segment_id != NULL;
    if (!port_given) o->port = 0;
    if (o->mode == TB_MODE_INITIATOR && !segment_given) {
        fprintf(stderr, "disagg bench transfer: --mode initiator needs --segment-id IP:PORT (the "
                        "segment of the target's ready line)\n");
        return 2;
    }
    if (o->mode != TB_MODE_INITIATOR && segment_given) {
        fprintf(stderr, "disagg bench transfer: --segment-id '%s' is only for --mode initiator\n",
                o->segment_id);
        return 2;
    }
    if (o->mode != TB_MODE_TARGET && port_given) {
        fprintf(stderr, "disagg bench transfer: --port is only for --mode target\n");
        return 2;
    }
    if (o->mode == TB_MODE_TARGET && o->nprotocols != 1) {
        fprintf(stderr, "disagg bench transfer: --mode target serves one --protocol, tcp or shm "
                        "(got two)\n");
        return 2;
    }
    if (o->mode == TB_MODE_SINGLE) {
        if (!o->local_hostname) o->local_hostname = "127.0.0.1";
        size_t maxb = 0;
        for (int i = 0; i < o->nblocks; i++)
            if (o->blocks[i] > maxb) maxb = o->blocks[i];
        size_t need = 2 * (size_t)o->threads * maxb;
        if (need > o->buffer_size) o->buffer_size = need;
    }
    o->buffer_size = (o->buffer_size + 2 * TB_PAGE - 1) & ~(2 * TB_PAGE - 1);
    /* target buffer + initiator (local, ceiling side, verify scratch: half each) */
    double need = (double)o->buffer_size * (o->mode == TB_MODE_SINGLE ? 2.5 : 1.0);
    double phys = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    if (o->mode != TB_MODE_INITIATOR && phys > 0 && need > 0.75 * phys) {
        fprintf(stderr,
                "disagg bench transfer: this run needs about %.1f GiB of memory (target buffer "
                "%.1f GiB = 2 x threads x largest block or --buffer-size) but the machine has "
                "%.1f GiB; lower --threads, --block-size or --buffer-size\n",
                need / (1 << 30), (double)o->buffer_size / (1 << 30), phys / (1 << 30));
        return 2;
    }
    return -1;
}

/* ---- memory ----------------------------------------------------------------------- */

/* Anonymous memory of len bytes.  huge: 2 MiB aligned with MADV_HUGEPAGE
 * (transparent huge pages in "madvise" mode), faulted in by the caller's
 * first write; else 4 KiB pages, populated now.  Free with tb_unmap(p, len). */
static void *tb_map(size_t len, bool huge) {
    if (!huge) {
        void *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    const size_t H = 2u << 20;
    size_t span = ((len + H - 1) & ~(H - 1)) + H;
    uint8_t *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    uint8_t *p = (uint8_t *)(((uintptr_t)raw + H - 1) & ~(uintptr_t)(H - 1));
    size_t body = (len + H - 1) & ~(H - 1);
    if (p > raw) munmap(raw, (size_t)(p - raw));
    if (raw + span > p + body) munmap(p + body, (size_t)(raw + span - (p + body)));
    madvise(p, body, MADV_HUGEPAGE);
    return p;
}

static void tb_unmap(void *p, size_t len, bool huge) {
    if (!p) return;
    if (huge) len = (len + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    munmap(p, len);
}

/* ---- target ----------------------------------------------------------------------- */

static int tb_engine_create(const tb_options *o, transfer_protocol proto, uint16_t port,
                            transfer_engine **out) {
    transfer_config cfg;
    transfer_config_init(&cfg);
    cfg.local_hostname = o->local_hostname;
    cfg.rpc_port = port;
    cfg.protocol = proto;
    cfg.device_name = o->device_name;
    cfg.auth_secret = auth_secret_resolve(NULL); /* $DISAGG_KV_SECRET (docs/transfer.md) */
    int rc = transfer_engine_create(&cfg, out);
    if (rc)
        fprintf(stderr,
                "disagg bench transfer: transfer_engine_create (%s, host %s, devices %s): %s\n",
                transfer_protocol_name(proto), o->local_hostname ? o->local_hostname : "(default)",
                o->device_name ? o->device_name : "(default)", transfer_strerror(rc));
    return rc;
}

static int tb_run_target(const tb_options *o) {
    /* Block the stop signals before the engine starts its threads, then sigwait. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, NULL);

    /* (buffer_size) pattern TB_SEED_TARGET by offset */
    uint8_t *buf = tb_map(o->buffer_size, o->hugepages);
    if (!buf) {
        fprintf(stderr, "disagg bench transfer: target: cannot map %zu bytes: %s\n", o->buffer_size,
                strerror(errno));
        return 1;
    }
    tb_pattern_fill(buf, 0, o->buffer_size, TB_SEED_TARGET);
    transfer_engine *eng;
    if (tb_engine_create(o, o->protocols[0], (uint16_t)o->port, &eng)) {
        tb_unmap(buf, o->buffer_size, o->hugepages);
        return 1;
    }
    int rc = transfer_register(eng, buf, o->buffer_size, "cpu:0");
    if (rc) {
        fprintf(stderr, "disagg bench transfer: target: transfer_register(%zu bytes): %s\n",
                o->buffer_size, transfer_strerror(rc));
        transfer_engine_destroy(eng);
        tb_unmap(buf, o->buffer_size, o->hugepages);
        return 1;
    }
    const tb_ready_buf ready = {(uintptr_t)buf, o->buffer_size, "cpu:0"};
    if (tb_ready_print(eng, auth_secret_resolve(NULL) != NULL, o->protocols[0], &ready, 1,
                       json_pack("{s:I}", "pattern", (json_int_t)TB_SEED_TARGET))) {
        transfer_unregister(eng, buf);
        transfer_engine_destroy(eng);
        tb_unmap(buf, o->buffer_size, o->hugepages);
        return 1;
    }
    fprintf(stderr,
            "disagg bench transfer: target %s serving %zu bytes at %p (SIGINT/SIGTERM stops)\n",
            transfer_engine_segment_name(eng), o->buffer_size, (void *)buf);
    int sig = 0;
    sigwait(&set, &sig);
    transfer_stats st;
    transfer_engine_get_stats(eng, &st);
    fprintf(stderr,
            "disagg bench transfer: target stopping (signal %d): %" PRIu64
            " bytes served over tcp, "
            "%" PRIu64 " requests rejected\n",
            sig, st.bytes_served, st.requests_rejected);
    transfer_unregister(eng, buf);
    transfer_engine_destroy(eng);
    tb_unmap(buf, o->buffer_size, o->hugepages);
    return 0;
}

/* A target forked by the single-command mode. */
typedef struct tb_child {
    tb_proc proc;      /* the target process (transfer_spawn.c) */
    pid_t pid;         /* its pid */
    char segment[128]; /* its segment name */
    uint64_t addr;     /* its buffer's address */
    size_t length;     /* its buffer's length */
} tb_child;

static int tb_child_spawn(const tb_options *o, transfer_protocol proto, tb_child *c) {
    char bufsz[32];
    snprintf(bufsz, sizeof bufsz, "%zu", o->buffer_size);
    const char *args[24];
    int n = 0;
    args[n++] = "disagg";
    args[n++] = "bench";
    args[n++] = "transfer";
    args[n++] = "--mode";
    args[n++] = "target";
    args[n++] = "--protocol";
    args[n++] = transfer_protocol_name(proto);
    args[n++] = "--buffer-size";
    args[n++] = bufsz;
    args[n++] = "--local-hostname";
    args[n++] = o->local_hostname;
    args[n++] = "--hugepages";
    args[n++] = o->hugepages ? "on" : "off";
    if (o->device_name) {
        args[n++] = "--device-name";
        args[n++] = o->device_name;
    }
    args[n] = NULL;
    /* The one line, within 30 s (the target fills its buffer first). */
    char line[1024];
    if (tb_spawn("disagg bench transfer", args, 30ull * 1000000000ull, &c->proc, line, sizeof line))
        return 1;
    c->pid = c->proc.pid;
    char why[768];
    json_t *ready = tb_ready_parse(line, why, sizeof why);
    if (!ready) {
        fprintf(stderr, "disagg bench transfer: the target printed %s\n", why);
        kill(c->pid, SIGKILL);
        tb_proc_stop(&c->proc, 0, 10ull * 1000000000ull);
        c->pid = 0;
        return 1;
    }
    snprintf(c->segment, sizeof c->segment, "%s",
             json_string_value(json_object_get(ready, "segment")));
    c->addr = tb_ready_u64(ready, 0, "addr");
    c->length = (size_t)tb_ready_u64(ready, 0, "length");
    json_decref(ready);
    return 0;
}

static void tb_child_stop(tb_child *c) {
    if (c->pid <= 0) return;
    int status = tb_proc_stop(&c->proc, SIGTERM, 10ull * 1000000000ull);
    if (status == -2)
        fprintf(stderr,
                "disagg bench transfer: target pid %d ignored SIGTERM for 10 s; killing it\n",
                (int)c->pid);
    else if (status >= 0 && WIFEXITED(status) && WEXITSTATUS(status))
        fprintf(stderr, "disagg bench transfer: target pid %d exited with status %d\n", (int)c->pid,
                WEXITSTATUS(status));
    else if (status >= 0 && WIFSIGNALED(status) && WTERMSIG(status) != SIGKILL)
        fprintf(stderr, "disagg bench transfer: target pid %d died of signal %d\n", (int)c->pid,
                WTERMSIG(status));
    c->pid = 0;
}

/* ---- the measured loop ------------------------------------------------------------ */

/* One measurement: op at block bytes, threads x batch requests in flight. */
typedef struct tb_run {
    transfer_engine *engine; /* the initiator engine */
    transfer_segment seg;    /* the opened target */
    transfer_opcode op;      /* READ or WRITE */
    uint8_t *local;          /* (threads*batch, block) registered: moved bytes */
    uint8_t *scratch;        /* (threads*batch, block) registered: WRITE read-back, or NULL */
    uint64_t remote_base;    /* absolute address of the target's buffer */
    uint64_t region_off;     /* offset of this op's half in the target's buffer */
    size_t block;            /* bytes per request */
    size_t batch;            /* requests per batch */
    int threads;             /* workers */
    double duration;         /* seconds */
    bool verify;             /* check the bytes */
    bool warmup;             /* one untimed batch per thread first */
    pthread_barrier_t start; /* all warmed up */
    atomic_int stop;         /* a worker failed: the others end */
} tb_run;

typedef struct tb_worker {
    tb_run *run;               /* shared */
    int index;                 /* 0..threads-1: owns slots [index*batch, (index+1)*batch) */
    pthread_t tid;             /* its thread */
    uint64_t start_ns, end_ns; /* timed loop */
    uint64_t ops;              /* requests completed in the timed loop */
    uint64_t *lat_ns;          /* (nlat) batch latencies */
    size_t nlat, caplat;       /* used, allocated */
    uint64_t checked_blocks;   /* verify: blocks compared */
    uint64_t bad_blocks;       /* verify: blocks with differing bytes */
    uint64_t bad_bytes;        /* verify: differing bytes */
    char first_bad[256];       /* verify: the first mismatch, described */
    int err;                   /* first engine error, 0 if none */
    char msg[256];             /* describes err */
} tb_worker;

static const char *tb_state_name(transfer_state st) {
    switch (st) {
    case TRANSFER_STATE_WAITING:
        return "WAITING";
    case TRANSFER_STATE_PENDING:
        return "PENDING";
    case TRANSFER_STATE_COMPLETED:
        return "COMPLETED";
    case TRANSFER_STATE_FAILED:
        return "FAILED";
    case TRANSFER_STATE_CANCELED:
        return "CANCELED";
    case TRANSFER_STATE_TIMEOUT:
        return "TIMEOUT";
    }
    return "in an unknown state";
}

/* alloc + submit + wait + free one batch; 0 or an error described in msg. */
static int tb_do_batch(tb_run *r, const transfer_request *reqs, size_t n, char *msg, size_t cap) {
    transfer_batch b;
    int rc = transfer_batch_alloc(r->engine, n, &b);
    if (rc) {
        snprintf(msg, cap, "transfer_batch_alloc(%zu): %s", n, transfer_strerror(rc));
        return rc;
    }
    rc = transfer_batch_submit(r->engine, b, reqs, n);
    if (rc) {
        snprintf(msg, cap, "transfer_batch_submit(%zu x %zu bytes): %s", n, reqs[0].length,
                 transfer_strerror(rc));
        transfer_batch_free(r->engine, b);
        return rc;
    }
    uint64_t bytes = (uint64_t)n * reqs[0].length;
    rc = transfer_batch_wait(r->engine, b, 60ull * 1000000000ull + bytes);
    if (rc) {
        size_t bad = n;
        transfer_status st = {0};
        for (size_t i = 0; i < n && bad == n; i++)
            if (!transfer_batch_get_status(r->engine, b, i, &st) &&
                st.state != TRANSFER_STATE_COMPLETED)
                bad = i;
        if (bad < n)
            snprintf(msg, cap,
                     "%s of %zu bytes at remote 0x%" PRIx64 " (request %zu of %zu) ended %s: %s",
                     tb_op_name(reqs[bad].opcode), reqs[bad].length, reqs[bad].remote_addr, bad, n,
                     tb_state_name(st.state), transfer_strerror(st.error ? st.error : rc));
        else
            snprintf(msg, cap, "transfer_batch_wait: %s", transfer_strerror(rc));
        if (rc == TRANSFER_ETIMEDOUT) {
            transfer_batch_cancel(r->engine, b);
            transfer_batch_wait(r->engine, b, 10ull * 1000000000ull);
        }
    } else if (r->verify) {
        transfer_status st;
        int grc = transfer_batch_get_overall(r->engine, b, &st);
        if (grc || st.state != TRANSFER_STATE_COMPLETED || st.transferred_bytes != bytes) {
            snprintf(msg, cap, "batch of %zu x %zu bytes completed but reports %s, %zu bytes (%s)",
                     n, reqs[0].length, tb_state_name(st.state), st.transferred_bytes,
                     transfer_strerror(grc));
            rc = grc ? grc : -1;
        }
    }
    int frc = transfer_batch_free(r->engine, b);
    if (!rc && frc) {
        snprintf(msg, cap, "transfer_batch_free: %s", transfer_strerror(frc));
        rc = frc;
    }
    return rc;
}

static void tb_worker_check(tb_worker *w, const uint8_t *base, uint64_t seed, const char *what) {
    tb_run *r = w->run;
    for (size_t i = 0; i < r->batch; i++) {
        size_t slot = (size_t)w->index * r->batch + i, first;
        uint64_t off = r->region_off + slot * r->block;
        size_t bad = tb_pattern_check(base + slot * r->block, off, r->block, seed, &first);
        w->checked_blocks++;
        if (!bad) continue;
        if (!w->bad_blocks)
            snprintf(w->first_bad, sizeof w->first_bad,
                     "%s block of %zu bytes at remote offset %" PRIu64 " (0x%" PRIx64
                     "): %zu bytes differ, the first at +%zu: expected 0x%02x, got 0x%02x",
                     what, r->block, off, r->remote_base + off, bad, first,
                     tb_pattern_byte(seed, off + first), base[slot * r->block + first]);
        w->bad_blocks++;
        w->bad_bytes += bad;
    }
}

static void tb_lat_push(tb_worker *w, uint64_t ns) {
    if (w->nlat == w->caplat) {
        size_t cap = w->caplat ? 2 * w->caplat : 4096;
        uint64_t *p = realloc(w->lat_ns, cap * sizeof *p);
        if (!p) return; /* drop the sample rather than fail the run */
        w->lat_ns = p;
        w->caplat = cap;
    }
    w->lat_ns[w->nlat++] = ns;
}

static void *tb_worker_main(void *arg) {
    tb_worker *w = arg;
    tb_run *r = w->run;
    size_t n = r->batch, block = r->block;
    transfer_request *reqs = calloc(n, sizeof *reqs);
    transfer_request *back = calloc(n, sizeof *back); /* WRITE read-back */
    if (!reqs || !back) {
        w->err = -1;
        snprintf(w->msg, sizeof w->msg, "out of memory for %zu requests", n);
        atomic_store(&r->stop, 1);
    } else {
        for (size_t i = 0; i < n; i++) {
            size_t slot = (size_t)w->index * n + i;
            uint64_t remote = r->remote_base + r->region_off + slot * block;
            reqs[i] = (transfer_request){r->op, r->local + slot * block, r->seg, remote, block};
            back[i] =
                (transfer_request){TRANSFER_READ, r->scratch ? r->scratch + slot * block : NULL,
                                   r->seg, remote, block};
        }
        /* warm-up batch: connections, page cache, code paths */
        if (r->warmup) w->err = tb_do_batch(r, reqs, n, w->msg, sizeof w->msg);
        if (w->err) atomic_store(&r->stop, 1);
    }
    pthread_barrier_wait(&r->start);
    w->start_ns = tb_now_ns();
    uint64_t deadline = w->start_ns + (uint64_t)(r->duration * 1e9), t = w->start_ns;
    uint8_t *mine = r->local + (size_t)w->index * n * block;
    for (uint64_t iter = 0; !w->err && !atomic_load(&r->stop) && t < deadline; iter++) {
        uint64_t seed = TB_SEED_WRITE ^ ((iter + 1) * 0x100000001b3ull) ^ (uint64_t)w->index;
        if (r->verify) {
            if (r->op == TRANSFER_READ)
                memset(mine, 0, n * block);
            else
                for (size_t i = 0; i < n; i++)
                    tb_pattern_fill(reqs[i].local,
                                    r->region_off + ((size_t)w->index * n + i) * block, block,
                                    seed);
        }
        uint64_t t0 = tb_now_ns();
        w->err = tb_do_batch(r, reqs, n, w->msg, sizeof w->msg);
        t = tb_now_ns();
        if (w->err) break;
        tb_lat_push(w, t - t0);
        w->ops += n;
        if (r->verify) {
            if (r->op == TRANSFER_READ) {
                tb_worker_check(w, r->local, TB_SEED_TARGET, "READ");
            } else {
                memset(r->scratch + (size_t)w->index * n * block, 0, n * block);
                w->err = tb_do_batch(r, back, n, w->msg, sizeof w->msg);
                if (w->err) break;
                tb_worker_check(w, r->scratch, seed, "WRITE (read back)");
            }
            t = tb_now_ns();
        }
    }
    if (w->err) atomic_store(&r->stop, 1);
    w->end_ns = t;
    free(reqs);
    free(back);
    return NULL;
}

/* The result of one block size. */
typedef struct tb_row {
    size_t block;                           /* bytes per request */
    size_t batch;                           /* requests per batch actually used */
    int threads;                            /* workers */
    uint64_t ops;                           /* requests completed */
    double seconds;                         /* wall time of the timed loops */
    double gbps;                            /* 10^9 bytes/s */
    double ops_per_s;                       /* requests/s */
    double p50_us, p99_us, mean_us, min_us; /* batch latency */
    tb_ceiling mem;                         /* memcpy ceiling */
    tb_ceiling sock;                        /* socket ceiling (tcp), ops == 0 if not measured */
    double ratio;                           /* gbps / ceiling (socket for tcp, memcpy for shm) */
    int nrounds;                            /* interleaved rounds measured */
    double round_gbps[TB_MAX_ROUNDS], round_mem[TB_MAX_ROUNDS], round_sock[TB_MAX_ROUNDS];
    uint64_t checked_blocks, bad_blocks, bad_bytes; /* verify */
    char first_bad[256];                            /* verify: first mismatch */
} tb_row;

static int tb_cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static double tb_pct_us(const uint64_t *v, size_t n, double q) {
    if (!n) return 0;
    size_t k = (size_t)(q * (double)n + 0.999999);
    k = k ? k - 1 : 0;
    if (k >= n) k = n - 1;
    return (double)v[k] / 1e3;
}

/* Batch latencies pooled over the rounds of one block size. */
typedef struct tb_lat {
    uint64_t *v;   /* (n) nanoseconds */
    size_t n, cap; /* used, allocated */
} tb_lat;

static void tb_lat_append(tb_lat *p, const uint64_t *v, size_t n) {
    if (!n) return;
    if (p->n + n > p->cap) {
        size_t cap = p->cap ? p->cap : 4096;
        while (cap < p->n + n)
            cap *= 2;
        uint64_t *q = realloc(p->v, cap * sizeof *q);
        if (!q) return; /* keep what we have rather than fail the run */
        p->v = q;
        p->cap = cap;
    }
    memcpy(p->v + p->n, v, n * sizeof *v);
    p->n += n;
}

/* p50/p99/mean/min of the pool into row; frees the pool. */
static void tb_lat_finish(tb_lat *p, tb_row *row) {
    if (p->n) {
        double sum = 0;
        for (size_t i = 0; i < p->n; i++)
            sum += (double)p->v[i];
        qsort(p->v, p->n, sizeof *p->v, tb_cmp_u64);
        row->p50_us = tb_pct_us(p->v, p->n, 0.50);
        row->p99_us = tb_pct_us(p->v, p->n, 0.99);
        row->min_us = (double)p->v[0] / 1e3;
        row->mean_us = sum / (double)p->n / 1e3;
    }
    free(p->v);
    memset(p, 0, sizeof *p);
}

/* Run one timed round of r: requests and wall time into *ops and *seconds,
 * batch latencies into pool, verification counts added to row.  Returns 0, or
 * 1 after printing the engine error. */
static int tb_measure(tb_run *r, uint64_t *ops, double *seconds, tb_lat *pool, tb_row *row) {
    tb_worker *ws = calloc((size_t)r->threads, sizeof *ws);
    if (!ws) return 1;
    atomic_store(&r->stop, 0);
    pthread_barrier_init(&r->start, NULL, (unsigned)r->threads);
    for (int i = 0; i < r->threads; i++) {
        ws[i].run = r;
        ws[i].index = i;
        if (pthread_create(&ws[i].tid, NULL, tb_worker_main, &ws[i])) {
            /* the barrier would never open: give up on the process */
            fprintf(stderr, "disagg bench transfer: pthread_create failed\n");
            exit(1);
        }
    }
    uint64_t t0 = UINT64_MAX, t1 = 0;
    int rc = 0;
    *ops = 0;
    for (int i = 0; i < r->threads; i++) {
        pthread_join(ws[i].tid, NULL);
        if (ws[i].err && !rc) {
            fprintf(stderr, "disagg bench transfer: %s, %zu-byte blocks: %s\n", tb_op_name(r->op),
                    r->block, ws[i].msg);
            rc = 1;
        }
        if (ws[i].start_ns < t0) t0 = ws[i].start_ns;
        if (ws[i].end_ns > t1) t1 = ws[i].end_ns;
        *ops += ws[i].ops;
        tb_lat_append(pool, ws[i].lat_ns, ws[i].nlat);
        free(ws[i].lat_ns);
        row->checked_blocks += ws[i].checked_blocks;
        row->bad_blocks += ws[i].bad_blocks;
        row->bad_bytes += ws[i].bad_bytes;
        if (ws[i].bad_blocks && !row->first_bad[0])
            snprintf(row->first_bad, sizeof row->first_bad, "%s", ws[i].first_bad);
    }
    pthread_barrier_destroy(&r->start);
    *seconds = t1 > t0 ? (double)(t1 - t0) / 1e9 : 0;
    free(ws);
    return rc;
}

/* ---- output -------------------------------------------------------------------------- */

/* One (protocol, operation) sweep's results. */
typedef struct tb_sweep {
    transfer_protocol proto;    /* tcp or shm */
    transfer_opcode op;         /* read or write */
    tb_row rows[TB_MAX_BLOCKS]; /* one per block size */
    int nrows;                  /* filled rows */
    tb_row rtt;                 /* 4 KiB, batch 1, one thread */
    tb_ceiling rtt_sock;        /* plain socket loop at 4 KiB (tcp) */
    tb_ceiling stream;          /* memcpy of 1 MiB blocks over 2 x 64 MiB (beyond the caches) */
} tb_sweep;

typedef struct tb_target {
    char what[96];    /* e.g. "tcp read 1 MiB vs socket loop" */
    double measured;  /* the value */
    double limit;     /* the target */
    bool at_most;     /* limit is an upper bound */
    const char *unit; /* "%", "req/s", "us" */
    char note[64];    /* shm: the ratio to streaming memcpy, else "" */
} tb_target;

static int tb_targets(const tb_sweep *s, tb_target *t, int max) {
    int n = 0;
    char sz[32];
    bool shm = s->proto == TRANSFER_PROTO_SHM;
    for (int i = 0; i < s->nrows && n < max; i++) {
        const tb_row *r = &s->rows[i];
        double ceil = shm ? r->mem.gbps : r->sock.gbps;
        if (ceil > 0 && (shm ? r->block >= (64u << 10) : r->block >= (1u << 20))) {
            snprintf(t[n].what, sizeof t[n].what, "%s %s %s: GB/s vs %s",
                     transfer_protocol_name(s->proto), tb_op_name(s->op),
                     tb_format_size(r->block, sz, sizeof sz), shm ? "memcpy" : "socket loop");
            t[n].measured = 100 * r->ratio;
            t[n].limit = 80;
            t[n].at_most = false;
            t[n].unit = "%";
            t[n].note[0] = 0;
            if (shm && s->stream.gbps > 0)
                snprintf(t[n].note, sizeof t[n].note, "; %.0f%% of streaming memcpy",
                         100 * r->gbps / s->stream.gbps);
            n++;
        }
        if (r->block == 4096 && n < max) {
            snprintf(t[n].what, sizeof t[n].what, "%s %s 4 KiB requests/s (batch %zu, %d thread%s)",
                     transfer_protocol_name(s->proto), tb_op_name(s->op), r->batch, r->threads,
                     r->threads > 1 ? "s" : "");
            t[n].measured = r->ops_per_s;
            t[n].limit = shm ? 200000 : 60000;
            t[n].at_most = false;
            t[n].unit = "req/s";
            t[n].note[0] = 0;
            n++;
        }
    }
    if (!shm && n < max) {
        snprintf(t[n].what, sizeof t[n].what, "tcp %s 4 KiB single-request round trip (p50)",
                 tb_op_name(s->op));
        t[n].measured = s->rtt.p50_us;
        t[n].limit = 40;
        t[n].at_most = true;
        t[n].unit = "us";
        t[n].note[0] = 0;
        n++;
    }
    return n;
}

static bool tb_target_pass(const tb_target *t) {
    return t->at_most ? t->measured <= t->limit : t->measured >= t->limit;
}

static void tb_print_header(const tb_options *o, const tb_sweep *s, const char *segment,
                            const char *how) {
    printf("\n== %s %s  target %s%s  threads %ld  batch <= %ld  %.2f s per size in %ld "
           "rounds%s ==\n",
           transfer_protocol_name(s->proto), tb_op_name(s->op), segment, how, o->threads, o->batch,
           o->duration, o->rounds, o->verify ? "  (verify: timing includes checks)" : "");
    printf("%9s %5s %9s %10s %9s %9s | %11s %11s | %s\n", "block", "batch", "GB/s", "ops/s",
           "p50 us", "p99 us", "memcpy GB/s", "socket GB/s", "ratio");
    fflush(stdout);
}

static void tb_print_row(const tb_sweep *s, const tb_row *r) {
    char sz[32], mem[32] = "-", sock[32] = "-", ratio[32] = "-";
    if (r->mem.ops) snprintf(mem, sizeof mem, "%.3f", r->mem.gbps);
    if (r->sock.ops) snprintf(sock, sizeof sock, "%.3f", r->sock.gbps);
    if (r->ratio > 0)
        snprintf(ratio, sizeof ratio, "%5.1f%% of %s", 100 * r->ratio,
                 s->proto == TRANSFER_PROTO_SHM ? "memcpy" : "socket");
    printf("%9s %5zu %9.3f %10.0f %9.1f %9.1f | %11s %11s | %s\n",
           tb_format_size(r->block, sz, sizeof sz), r->batch, r->gbps, r->ops_per_s, r->p50_us,
           r->p99_us, mem, sock, ratio);
    fflush(stdout);
}

static void tb_print_footer(const tb_options *o, const tb_sweep *s) {
    printf("single request (4 KiB, batch 1, 1 thread): p50 %.1f us, p99 %.1f us, mean %.1f us, "
           "min %.1f us (%.0f req/s)",
           s->rtt.p50_us, s->rtt.p99_us, s->rtt.mean_us, s->rtt.min_us, s->rtt.ops_per_s);
    if (s->rtt_sock.ops) printf("; plain socket loop: mean %.1f us", s->rtt_sock.mean_us);
    printf("\nstreaming memcpy (1 MiB blocks over 64 MiB, beyond the caches): %.3f GB/s\n",
           s->stream.gbps);
    if (o->verify) {
        uint64_t checked = s->rtt.checked_blocks, bad = s->rtt.bad_blocks;
        for (int i = 0; i < s->nrows; i++) {
            checked += s->rows[i].checked_blocks;
            bad += s->rows[i].bad_blocks;
        }
        printf("verify: %" PRIu64 " blocks checked, %" PRIu64 " mismatched\n", checked, bad);
        for (int i = 0; i < s->nrows; i++)
            if (s->rows[i].bad_blocks) printf("  MISMATCH: %s\n", s->rows[i].first_bad);
        if (s->rtt.bad_blocks) printf("  MISMATCH: %s\n", s->rtt.first_bad);
    }
    tb_target t[TB_MAX_BLOCKS * 2 + 1];
    int n = tb_targets(s, t, (int)(sizeof t / sizeof t[0]));
    if (n) printf("targets:\n");
    for (int i = 0; i < n; i++)
        printf("  %s  %-52s %10.1f %-5s (target %s %.0f%s)\n",
               tb_target_pass(&t[i]) ? "PASS" : "MISS", t[i].what, t[i].measured, t[i].unit,
               t[i].at_most ? "<=" : ">=", t[i].limit, t[i].note);
    fflush(stdout);
}

static json_t *tb_ceiling_json(const tb_ceiling *c) {
    if (!c->ops) return json_null();
    return json_pack("{s:f,s:I,s:f,s:f}", "gbps", c->gbps, "ops", (json_int_t)c->ops, "seconds",
                     c->seconds, "mean_us", c->mean_us);
}

static json_t *tb_row_json(const tb_row *r, bool verify) {
    json_t *j =
        json_pack("{s:I,s:I,s:i,s:I,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:o,s:o,s:f}", "block_size",
                  (json_int_t)r->block, "batch_size", (json_int_t)r->batch, "threads", r->threads,
                  "ops", (json_int_t)r->ops, "seconds", r->seconds, "gbps", r->gbps, "ops_per_s",
                  r->ops_per_s, "lat_p50_us", r->p50_us, "lat_p99_us", r->p99_us, "lat_mean_us",
                  r->mean_us, "lat_min_us", r->min_us, "memcpy", tb_ceiling_json(&r->mem), "socket",
                  tb_ceiling_json(&r->sock), "ratio", r->ratio);
    if (j && r->nrounds > 1) {
        json_t *rs = json_array();
        for (int k = 0; k < r->nrounds; k++)
            json_array_append_new(rs, json_pack("{s:f,s:f,s:f}", "gbps", r->round_gbps[k],
                                                "memcpy_gbps", r->round_mem[k], "socket_gbps",
                                                r->round_sock[k]));
        json_object_set_new(j, "rounds", rs);
    }
    if (j && verify)
        json_object_set_new(j, "verify",
                            json_pack("{s:I,s:I,s:I,s:s}", "checked_blocks",
                                      (json_int_t)r->checked_blocks, "bad_blocks",
                                      (json_int_t)r->bad_blocks, "bad_bytes",
                                      (json_int_t)r->bad_bytes, "first_mismatch", r->first_bad));
    return j;
}

static json_t *tb_sweep_json(const tb_options *o, const tb_sweep *s, const char *segment) {
    json_t *rows = json_array();
    for (int i = 0; i < s->nrows; i++)
        json_array_append_new(rows, tb_row_json(&s->rows[i], o->verify));
    json_t *rtt = tb_row_json(&s->rtt, o->verify);
    if (s->rtt_sock.ops) json_object_set_new(rtt, "socket_mean_us", json_real(s->rtt_sock.mean_us));
    tb_target t[TB_MAX_BLOCKS * 2 + 1];
    int n = tb_targets(s, t, (int)(sizeof t / sizeof t[0]));
    json_t *targets = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(targets,
                              json_pack("{s:s,s:f,s:s,s:f,s:s}", "what", t[i].what, "measured",
                                        t[i].measured, "unit", t[i].unit,
                                        t[i].at_most ? "at_most" : "at_least", t[i].limit, "result",
                                        tb_target_pass(&t[i]) ? "pass" : "miss"));
    return json_pack("{s:s,s:s,s:s,s:s,s:o,s:o,s:o,s:o}", "protocol",
                     transfer_protocol_name(s->proto), "operation", tb_op_name(s->op), "segment",
                     segment, "ratio_vs", s->proto == TRANSFER_PROTO_SHM ? "memcpy" : "socket",
                     "rows", rows, "single_request", rtt, "memcpy_streaming",
                     tb_ceiling_json(&s->stream), "targets", targets);
}

/* ---- initiator ----------------------------------------------------------------------- */

static bool tb_sweep_bad(const tb_sweep *s) {
    if (s->rtt.bad_blocks) return true;
    for (int i = 0; i < s->nrows; i++)
        if (s->rows[i].bad_blocks) return true;
    return false;
}

/* Run every operation of one protocol against an opened target.  expect_addr:
 * the buffer the target announced (0 = its first buffer).  Appends to runs
 * (JSON).  Returns 0, 1 (engine error / mismatch) or 2 (buffer too small). */
static int tb_run_initiator(const tb_options *o, transfer_protocol proto, const char *segment,
                            uint64_t expect_addr, const char *how, json_t *runs) {
    transfer_engine *eng;
    if (tb_engine_create(o, proto, 0, &eng)) return 1;
    int status = 0, rc;
    uint8_t *local = NULL, *scratch = NULL, *base = NULL;
    size_t foot = 0;
    transfer_segment seg;
    if ((rc = transfer_open_segment(eng, segment, &seg))) {
        fprintf(stderr, "disagg bench transfer: cannot open segment %s over %s: %s\n", segment,
                transfer_protocol_name(proto), transfer_strerror(rc));
        transfer_engine_destroy(eng);
        return 1;
    }
    transfer_segment_info info;
    transfer_buffer_info bufs[16];
    int nb = transfer_segment_get_buffers(eng, seg, bufs, 16);
    if ((rc = transfer_segment_get_info(eng, seg, &info)) || nb <= 0) {
        fprintf(stderr, "disagg bench transfer: segment %s: %s\n", segment,
                rc       ? transfer_strerror(rc)
                : nb < 0 ? transfer_strerror(nb)
                         : "no registered buffer");
        status = 1;
        goto out;
    }
    if (info.protocol != proto) {
        fprintf(stderr,
                "disagg bench transfer: asked for %s but the engine uses %s for %s (shm needs the "
                "same host and ptrace permission); not measuring it as %s\n",
                transfer_protocol_name(proto), transfer_protocol_name(info.protocol), segment,
                transfer_protocol_name(proto));
        status = 1;
        goto out;
    }
    const transfer_buffer_info *tbuf = &bufs[0];
    if (expect_addr) {
        tbuf = NULL;
        for (int i = 0; i < nb; i++)
            if (bufs[i].addr == expect_addr) tbuf = &bufs[i];
        if (!tbuf) {
            fprintf(stderr,
                    "disagg bench transfer: segment %s does not list the buffer 0x%" PRIx64
                    " the target announced\n",
                    segment, expect_addr);
            status = 1;
            goto out;
        }
    }
    size_t half = (size_t)(tbuf->length / 2) & ~(size_t)(TB_PAGE - 1);
    /* per block size: the batch that fits threads x batch x block in one half */
    size_t batch[TB_MAX_BLOCKS];
    for (int i = 0; i < o->nblocks; i++) {
        size_t per = (size_t)o->threads * o->blocks[i], fit = per ? half / per : 0;
        char a[32], b[32];
        if (!fit) {
            fprintf(stderr,
                    "disagg bench transfer: --block-size %s x --threads %ld needs %zu bytes per "
                    "operation, but the target's buffer half holds %s; give the target a "
                    "--buffer-size of at least %zu\n",
                    tb_format_size(o->blocks[i], a, sizeof a), o->threads, per,
                    tb_format_size(half, b, sizeof b), 2 * per);
            status = 2;
            goto out;
        }
        batch[i] = fit < (size_t)o->batch ? fit : (size_t)o->batch;
        if (batch[i] * per > foot) foot = batch[i] * per;
    }
    if (TB_RTT_BLOCK * (size_t)o->threads > foot) foot = TB_RTT_BLOCK * (size_t)o->threads;
    foot = (foot + TB_PAGE - 1) & ~(size_t)(TB_PAGE - 1);
    local = tb_map(foot, o->hugepages); /* (threads*batch, block) registered */
    base = tb_map(foot, o->hugepages);  /* (threads*batch, block) ceilings' other side */
    scratch = o->verify ? tb_map(foot, o->hugepages) : NULL; /* (threads*batch, block) registered */
    if (!local || !base || (o->verify && !scratch)) {
        fprintf(stderr, "disagg bench transfer: cannot map 3 x %zu bytes: %s\n", foot,
                strerror(errno));
        status = 1;
        goto out;
    }
    memset(local, 0x11, foot);
    if (scratch) memset(scratch, 0, foot);
    memset(base, 0x22, foot);
    if ((rc = transfer_register(eng, local, foot, "cpu:0")) ||
        (scratch && (rc = transfer_register(eng, scratch, foot, "cpu:0")))) {
        fprintf(stderr, "disagg bench transfer: transfer_register(%zu bytes): %s\n", foot,
                transfer_strerror(rc));
        status = 1;
        goto out;
    }
    /* The streaming memcpy reference, once per protocol: 1 MiB blocks over 64 MiB. */
    tb_ceiling stream = {0};
    uint8_t *sa = o->no_ceilings ? NULL : tb_map(64u << 20, o->hugepages);
    uint8_t *sb = o->no_ceilings ? NULL : tb_map(64u << 20, o->hugepages);
    if (sa && sb) {
        memset(sa, 0x33, 64u << 20);
        memset(sb, 0x44, 64u << 20);
        tb_memcpy_ceiling(sb, sa, 1u << 20, 64, o->duration < 0.3 ? o->duration : 0.3, &stream);
    }
    tb_unmap(sa, 64u << 20, o->hugepages);
    tb_unmap(sb, 64u << 20, o->hugepages);
    for (int k = 0; k < o->noperations && !status; k++) {
        tb_sweep *s = calloc(1, sizeof *s);
        if (!s) {
            status = 1;
            break;
        }
        s->proto = proto;
        s->op = o->operations[k];
        s->stream = stream;
        tb_run r = {.engine = eng,
                    .seg = seg,
                    .op = s->op,
                    .local = local,
                    .scratch = scratch,
                    .remote_base = tbuf->addr,
                    .region_off = s->op == TRANSFER_READ ? 0 : half,
                    .threads = (int)o->threads,
                    .duration = o->duration,
                    .verify = o->verify};
        /* memcpy gets ceil_s per block size, the socket loop twice that */
        double ceil_s = o->duration < 0.5 ? 0.4 * o->duration : 0.2 * o->duration;
        int rounds = (int)o->rounds;
        char err[256];
        if (!o->json) tb_print_header(o, s, segment, how);
        for (int i = 0; i < o->nblocks && !status; i++) {
            tb_row *row = &s->rows[s->nrows];
            tb_lat pool = {0};
            row->block = r.block = o->blocks[i];
            row->batch = r.batch = batch[i];
            row->threads = r.threads;
            r.duration = o->duration / rounds;
            size_t slots = row->batch * (size_t)row->threads;
            /* Engine and ceilings alternate, so that load from elsewhere on the
             * machine hits them alike; each keeps its best round. */
            for (int k = 0; k < rounds && !status; k++) {
                uint64_t ops;
                double secs;
                tb_ceiling mem, sock = {0};
                r.warmup = k == 0;
                if (tb_measure(&r, &ops, &secs, &pool, row)) {
                    status = 1;
                    break;
                }
                if (!o->no_ceilings)
                    tb_memcpy_ceiling(local, base, row->block, slots, ceil_s / rounds, &mem);
                else
                    memset(&mem, 0, sizeof mem);
                if (proto == TRANSFER_PROTO_TCP && !o->no_ceilings &&
                    tb_socket_ceiling("127.0.0.1", s->op == TRANSFER_READ, row->block, local, base,
                                      slots, 2 * ceil_s / rounds, &sock, err, sizeof err)) {
                    fprintf(stderr, "disagg bench transfer: %s\n", err);
                    status = 1;
                    break;
                }
                double gbps = secs > 0 ? (double)ops * (double)row->block / secs / 1e9 : 0;
                row->round_gbps[k] = gbps;
                row->round_mem[k] = mem.gbps;
                row->round_sock[k] = sock.gbps;
                row->nrounds = k + 1;
                if (k == 0 || gbps > row->gbps) {
                    row->gbps = gbps;
                    row->ops = ops;
                    row->seconds = secs;
                    row->ops_per_s = secs > 0 ? (double)ops / secs : 0;
                }
                if (k == 0 || mem.gbps > row->mem.gbps) row->mem = mem;
                if (k == 0 || sock.gbps > row->sock.gbps) row->sock = sock;
            }
            tb_lat_finish(&pool, row);
            if (status) break;
            s->nrows++;
            double ceil = proto == TRANSFER_PROTO_TCP ? row->sock.gbps : row->mem.gbps;
            row->ratio = ceil > 0 ? row->gbps / ceil : 0;
            if (!o->json) tb_print_row(s, row);
        }
        if (!status) {
            /* the single request: 4 KiB, batch 1, one thread, the full duration */
            tb_lat pool = {0};
            uint64_t ops;
            double secs;
            r.block = s->rtt.block = TB_RTT_BLOCK;
            r.batch = s->rtt.batch = 1;
            r.threads = s->rtt.threads = 1;
            r.duration = o->duration;
            r.warmup = true;
            if (tb_measure(&r, &ops, &secs, &pool, &s->rtt)) {
                status = 1;
            } else {
                s->rtt.ops = ops;
                s->rtt.seconds = secs;
                s->rtt.ops_per_s = secs > 0 ? (double)ops / secs : 0;
                s->rtt.gbps = s->rtt.ops_per_s * TB_RTT_BLOCK / 1e9;
                s->rtt.nrounds = 1;
                if (proto == TRANSFER_PROTO_TCP && !o->no_ceilings &&
                    tb_socket_ceiling("127.0.0.1", s->op == TRANSFER_READ, TB_RTT_BLOCK, local,
                                      base, 1, ceil_s, &s->rtt_sock, err, sizeof err)) {
                    fprintf(stderr, "disagg bench transfer: %s\n", err);
                    status = 1;
                }
            }
            tb_lat_finish(&pool, &s->rtt);
        }
        if (!status) {
            if (!o->json) tb_print_footer(o, s);
            json_array_append_new(runs, tb_sweep_json(o, s, segment));
            if (tb_sweep_bad(s)) {
                for (int i = 0; i < s->nrows; i++)
                    if (s->rows[i].bad_blocks)
                        fprintf(stderr, "disagg bench transfer: verification failed: %s\n",
                                s->rows[i].first_bad);
                if (s->rtt.bad_blocks)
                    fprintf(stderr, "disagg bench transfer: verification failed: %s\n",
                            s->rtt.first_bad);
                status = 1;
            }
        }
        free(s);
    }
    transfer_stats st;
    transfer_engine_get_stats(eng, &st);
    if (st.shm_fallbacks)
        fprintf(stderr,
                "disagg bench transfer: warning: the engine fell back from shm to tcp %" PRIu64
                " times; shm numbers above are not pure shm\n",
                st.shm_fallbacks);
out:
    if (scratch) transfer_unregister(eng, scratch);
    if (local) transfer_unregister(eng, local);
    transfer_close_segment(eng, seg);
    transfer_engine_destroy(eng);
    tb_unmap(local, foot, o->hugepages);
    tb_unmap(base, foot, o->hugepages);
    tb_unmap(scratch, foot, o->hugepages);
    return status;
}

/* ---- entry ---------------------------------------------------------------------------- */

int bench_transfer_main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) /* device memory on both sides: transfer_bench_cuda.c */
        if (!strncmp(argv[i], "--location", 10) && (argv[i][10] == 0 || argv[i][10] == '='))
            return bench_transfer_cuda_main(argc, argv);
    tb_options o;
    int rc = tb_parse_args(argc, argv, &o);
    if (rc >= 0) return rc;
    if (o.mode == TB_MODE_TARGET) return tb_run_target(&o);

    json_t *runs = json_array();
    int status = 0;
    if (o.mode == TB_MODE_INITIATOR) {
        for (int p = 0; p < o.nprotocols && !status; p++)
            status = tb_run_initiator(&o, o.protocols[p], o.segment_id, 0, "", runs);
    } else {
        for (int p = 0; p < o.nprotocols && !status; p++) {
            tb_child c = {0};
            if (tb_child_spawn(&o, o.protocols[p], &c)) {
                status = 1;
                break;
            }
            char how[64];
            snprintf(how, sizeof how, " (forked, pid %d)", (int)c.pid);
            status = tb_run_initiator(&o, o.protocols[p], c.segment, c.addr, how, runs);
            tb_child_stop(&c);
        }
    }
    if (o.json) {
        json_t *blocks = json_array();
        for (int i = 0; i < o.nblocks; i++)
            json_array_append_new(blocks, json_integer((json_int_t)o.blocks[i]));
        json_t *doc =
            json_pack("{s:s,s:s,s:o,s:I,s:I,s:f,s:b,s:s?,s:s?,s:o,s:i}", "benchmark", "transfer",
                      "mode", o.mode == TB_MODE_SINGLE ? "single" : "initiator", "block_sizes",
                      blocks, "batch_size", (json_int_t)o.batch, "threads", (json_int_t)o.threads,
                      "duration_s", o.duration, "verify", o.verify, "device_name", o.device_name,
                      "local_hostname", o.local_hostname, "runs", runs, "exit_status", status);
        char *text = doc ? json_dumps(doc, JSON_INDENT(2) | JSON_REAL_PRECISION(9)) : NULL;
        if (text) printf("%s\n", text);
        free(text);
        json_decref(doc);
    } else {
        json_decref(runs);
    }
    return status;
}
