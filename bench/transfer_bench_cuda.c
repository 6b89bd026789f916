/*
 * transfer_bench_cuda — `disagg bench transfer --location cuda:N`: the transfer engine with
 * device memory on both sides, for every transport that can run on one host (cuda_ipc and
 * staged tcp), moving the KV cache of one prompt in the engine's block layout (a Qwen2.5-7B
 * shape by default: 28 layers x K,V x 16 tokens x 4 KV heads x 128 x bf16 = 917,504-byte
 * blocks, 4,096 tokens = 256 blocks = 235 MB), with the ceilings measured in the same run:
 *   cuda_ipc   one device-to-device copy of the whole KV through an IPC mapping of the
 *              target's memory (cudaMemcpyAsync, timed with events);
 *   staged tcp the engine's tcp with host memory on both sides (the same requests), a plain
 *              loopback socket loop, and the pinned PCIe copies each way.
 * The target is this binary forked with --mode target (device buffer of 2 x KV, a host
 * buffer of 1 x KV); it prints one line and then answers "verify" commands on stdin, so
 * every byte written is checked where it landed.  Layouts: contiguous (one request per
 * block, adjacent on both sides: cuda_ipc makes them one copy) and scattered (every other
 * block of the target's region: one copy per block, which cuda_ipc queues as one batch --
 * measured for each way the CUDA module can run a batch, DISAGG_CUDA_BATCH_COPY each /
 * memcpy_batch / kernel), and one layer of every block (layer-wise streaming's unit).
 */
#include "base/bytesize.h"
#include "base/flags.h"
#include "bench/bench.h"
#include "bench/transfer_bench.h"
#include "disagg/transfer.h"
#include "kernels/cuda/cuda_transfer.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TC_SLACK 4096 /* room for the unaligned offsets */

typedef struct tc_options {
    int device;
    int target;   /* --mode target */
    int ipc, tcp; /* transports to run */
    long tokens;  /* prompt tokens */
    long block_tokens;
    long layers, kv_heads, head_dim;
    long elem;    /* bytes of a KV element: --kv-cache-dtype (bfloat16 2, fp8 1, float32 4) */
    long reps;
    const char *host;
} tc_options;

static uint64_t tc_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static size_t tc_block_bytes(const tc_options *o) {
    return (size_t)o->layers * 2 * (size_t)o->block_tokens * (size_t)o->kv_heads *
           (size_t)o->head_dim * (size_t)o->elem;
}
static const char *tc_dtype(const tc_options *o) {
    return o->elem == 1 ? "fp8" : o->elem == 4 ? "float32" : "bfloat16";
}
static size_t tc_blocks(const tc_options *o) {
    return (size_t)((o->tokens + o->block_tokens - 1) / o->block_tokens);
}

/* --kv-cache-dtype: the KV element's bytes */
static int tc_flag_kv_dtype(flags_parser *p, const flag_def *d, const char *v) {
    long *elem = d->dst;
    if (!strcmp(v, "bfloat16") || !strcmp(v, "bf16") || !strcmp(v, "auto"))
        *elem = 2;
    else if (!strcmp(v, "fp8") || !strcmp(v, "fp8_e4m3") || !strcmp(v, "float8_e4m3fn"))
        *elem = 1;
    else if (!strcmp(v, "float32") || !strcmp(v, "f32"))
        *elem = 4;
    else {
        flags_error(p, "--kv-cache-dtype '%s' is not accepted; accepted: bfloat16, fp8, float32", v);
        return -1;
    }
    return 0;
}

/* --location cuda:N */
static int tc_flag_location(flags_parser *p, const flag_def *d, const char *v) {
    int *device = d->dst;
    char *end = NULL;
    long n = -1;
    if (!strncmp(v, "cuda:", 5) && v[5] >= '0' && v[5] <= '9') n = strtol(v + 5, &end, 10);
    if (n < 0 || n > 63 || *end) {
        flags_error(p, "--location '%s' is not accepted; accepted: cuda:N (N in 0..63)", v);
        return -1;
    }
    *device = (int)n;
    return 0;
}

/* --protocol cuda_ipc, tcp or "cuda_ipc,tcp" */
static int tc_flag_protocol(flags_parser *p, const flag_def *d, const char *v) {
    tc_options *o = d->dst;
    char buf[64];
    int ok = strlen(v) < sizeof buf;
    o->ipc = o->tcp = 0;
    if (ok) strcpy(buf, v);
    for (char *save, *t = ok ? strtok_r(buf, ",", &save) : NULL; t && ok;
         t = strtok_r(NULL, ",", &save)) {
        if (!strcmp(t, "cuda_ipc"))
            o->ipc = 1;
        else if (!strcmp(t, "tcp"))
            o->tcp = 1;
        else
            ok = 0;
    }
    if (ok && (o->ipc || o->tcp)) return 0;
    flags_error(p, "--protocol '%s' is not accepted; accepted: cuda_ipc, tcp, \"cuda_ipc,tcp\"", v);
    return -1;
}

/* --kv-shape L,H,D */
static int tc_flag_kv_shape(flags_parser *p, const flag_def *d, const char *v) {
    tc_options *o = d->dst;
    char tail;
    if (sscanf(v, "%ld,%ld,%ld%c", &o->layers, &o->kv_heads, &o->head_dim, &tail) == 3 &&
        o->layers >= 1 && o->layers <= 1024 && o->kv_heads >= 1 && o->kv_heads <= 1024 &&
        o->head_dim >= 1 && o->head_dim <= 1024)
        return 0;
    flags_error(p,
                "--kv-shape '%s' is not accepted; accepted: L,H,D: layers, KV heads, head_dim, "
                "each 1..1024",
                v);
    return -1;
}

/* -1 = go on, else the exit status. */
static int tc_parse(int argc, char **argv, tc_options *o) {
    memset(o, 0, sizeof *o);
    o->device = -1;
    o->ipc = o->tcp = 1;
    o->tokens = 4096;
    o->block_tokens = 16;
    o->layers = 28;
    o->kv_heads = 4;
    o->head_dim = 128;
    o->elem = 2;
    o->reps = 20;
    o->host = "127.0.0.1";
    int mode = -1;
    const flag_def defs[] = {
        {FLAG_CUSTOM_("--location", &o->device, tc_flag_location), .metavar = "cuda:N",
         .help = "device memory of GPU N on both sides (required here)"},
        {FLAG_CHOICE_("--mode", &mode, "target"), .metavar = "target",
         .help = "the target end only (default: both ends)"},
        {FLAG_CUSTOM_("--protocol", o, tc_flag_protocol), .metavar = "P",
         .help = "cuda_ipc, tcp or \"cuda_ipc,tcp\" (default both)"},
        {FLAG_INT_("--tokens", &o->tokens, 1, 1 << 20), .help = "prompt tokens (default 4096)"},
        {FLAG_CUSTOM_("--kv-shape", o, tc_flag_kv_shape), .metavar = "L,H,D",
         .help = "layers, KV heads, head_dim (default 28,4,128: Qwen2.5-7B), blocks of "
                 "--block-tokens"},
        {FLAG_INT_("--block-tokens", &o->block_tokens, 1, 1024),
         .help = "tokens per KV block, 1..1024 (default 16)"},
        {FLAG_CUSTOM_("--kv-cache-dtype", &o->elem, tc_flag_kv_dtype), .metavar = "T",
         .help = "bfloat16 (default), fp8 (e4m3: half the bytes) or float32"},
        {FLAG_INT_("--reps", &o->reps, 1, 1000),
         .help = "timed repetitions per row, 1..1000 (default 20; tcp rows 5)"},
        {FLAG_STRING_("--local-hostname", &o->host), .metavar = "IP",
         .help = "address the engines use (default 127.0.0.1)"},
        {FLAG_TEXT_("-h, --help", "this text")},
        {0}};
    const flag_def *tables[] = {defs, NULL};
    const flags_spec spec = {
        .cmd = "bench transfer",
        .usage =
            "usage: disagg bench transfer --location cuda:N [options]\n"
            "\n"
            "The transfer engine with device memory on both sides (a forked target on the same\n"
            "GPU), moving one prompt's KV cache in the engine's block layout, for every transport\n"
            "that runs on one host, against ceilings measured in the same run: cuda_ipc vs one\n"
            "device-to-device copy through an IPC mapping; staged tcp vs the engine's tcp with\n"
            "host memory, a plain loopback socket loop and the pinned PCIe copies.\n"
            "\n"
            "options:\n",
        .epilog = "\n"
                  "exit status: 0 done (targets missed are reported), 1 engine error, "
                  "verification\n"
                  "mismatch or no GPU, 2 bad options.\n",
        .tables = tables,
        .help_col = 23,
        .underscores = 1,
        .list_on_unknown = 1};
    int pr = flags_parse(&spec, argc, argv);
    if (pr) return pr == FLAGS_HELP ? 0 : 2;
    o->target = mode == 0;
    if (o->device < 0) {
        fprintf(stderr, "disagg bench transfer: --location is missing; accepted: cuda:N\n");
        return 2;
    }
    if ((double)tc_block_bytes(o) * (double)tc_blocks(o) > 64e9) {
        fprintf(stderr,
                "disagg bench transfer: --tokens %ld x --kv-shape %ld,%ld,%ld is a KV of %.1f GB; "
                "accepted: a KV of at most 64 GB\n",
                o->tokens, o->layers, o->kv_heads, o->head_dim,
                (double)tc_block_bytes(o) * (double)tc_blocks(o) / 1e9);
        return 2;
    }
    return -1;
}

/* The CUDA module's table and the engine's device ops for o->device. */
static int tc_device(const tc_options *o, const dcu_transfer_api **api, transfer_device_ops *ops) {
    char err[512] = "";
    *api = cuda_transfer_load(err, sizeof err);
    if (!*api) {
        fprintf(stderr, "disagg bench transfer --location cuda:%d: %s\n", o->device, err);
        return 1;
    }
    if ((*api)->device_ops(o->device, ops, err, sizeof err)) {
        fprintf(stderr, "disagg bench transfer --location cuda:%d: %s\n", o->device, err);
        return 1;
    }
    return 0;
}

static int tc_engine(const tc_options *o, transfer_protocol proto, const transfer_device_ops *ops,
                     transfer_engine **out) {
    transfer_config c;
    transfer_config_init(&c);
    c.local_hostname = o->host;
    c.protocol = proto;
    int rc = transfer_engine_create(&c, out);
    if (rc == 0) rc = transfer_engine_set_device_ops(*out, ops);
    if (rc) fprintf(stderr, "disagg bench transfer: engine: %s\n", transfer_strerror(rc));
    return rc ? 1 : 0;
}

/* Fill device memory [dev, +len) with the pattern of seed keyed from key. */
static int tc_fill(const transfer_device_ops *ops, int device, void *dev, size_t len, uint64_t key,
                   uint64_t seed) {
    const size_t chunk = 64u << 20;
    void *h = ops->alloc_pinned(ops->ctx, chunk), *st = NULL;
    int rc = !h || ops->stream_create(ops->ctx, device, &st);
    for (size_t o = 0; rc == 0 && o < len; o += chunk) {
        size_t n = len - o < chunk ? len - o : chunk;
        tb_pattern_fill(h, key + o, n, seed);
        rc = ops->copy_from_host(ops->ctx, st, (char *)dev + o, h, n) || ops->sync(ops->ctx, st);
    }
    if (st) ops->stream_destroy(ops->ctx, st);
    if (h) ops->free_pinned(ops->ctx, h);
    return rc;
}

/* Bytes of device memory [dev, +len) that differ from the pattern; -1 on a copy failure. */
static long long tc_check(const transfer_device_ops *ops, int device, const void *dev, size_t len,
                          uint64_t key, uint64_t seed) {
    const size_t chunk = 64u << 20;
    void *h = ops->alloc_pinned(ops->ctx, chunk), *st = NULL;
    long long bad = (!h || ops->stream_create(ops->ctx, device, &st)) ? -1 : 0;
    for (size_t o = 0; bad >= 0 && o < len; o += chunk) {
        size_t n = len - o < chunk ? len - o : chunk;
        if (ops->copy_to_host(ops->ctx, st, h, (const char *)dev + o, n) || ops->sync(ops->ctx, st))
            bad = -1;
        else
            bad += (long long)tb_pattern_check(h, key + o, n, seed, NULL);
    }
    if (st) ops->stream_destroy(ops->ctx, st);
    if (h) ops->free_pinned(ops->ctx, h);
    return bad;
}

static void tc_hex(const uint8_t *b, size_t n, char *out) {
    for (size_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", b[i]);
    out[2 * n] = 0;
}

/* ---- target -------------------------------------------------------------------------- */

static int tc_run_target(const tc_options *o) {
    const dcu_transfer_api *api;
    transfer_device_ops ops;
    if (tc_device(o, &api, &ops)) return 1;
    size_t kv = tc_block_bytes(o) * tc_blocks(o), dlen = 2 * kv + TC_SLACK;
    char *dev = api->alloc(o->device, dlen);
    char *host = malloc(kv + TC_SLACK);
    transfer_engine *e = NULL;
    if (!dev || !host || tc_engine(o, TRANSFER_PROTO_AUTO, &ops, &e)) {
        fprintf(stderr, "disagg bench transfer target: cannot allocate %zu bytes on cuda:%d\n",
                dlen, o->device);
        return 1;
    }
    char loc[16];
    snprintf(loc, sizeof loc, "cuda:%d", o->device);
    uint8_t handle[TRANSFER_IPC_HANDLE_MAX];
    size_t hl = 0;
    uint64_t off = 0;
    char hex[2 * TRANSFER_IPC_HANDLE_MAX + 1];
    int rc = transfer_register(e, dev, dlen, loc);
    if (rc == 0) rc = transfer_register(e, host, kv + TC_SLACK, "cpu");
    if (rc == 0) rc = ops.ipc_export(ops.ctx, dev, dlen, handle, &hl, &off) ? TRANSFER_ESYS : 0;
    if (rc) {
        fprintf(stderr, "disagg bench transfer target: register: %s\n", transfer_strerror(rc));
        return 1;
    }
    tc_hex(handle, hl, hex);
    /* the ready line: buffers[0] the device buffer, [1] the host one; its IPC handle */
    const tb_ready_buf ready[2] = {{(uintptr_t)dev, dlen, loc},
                                   {(uintptr_t)host, kv + TC_SLACK, "cpu"}};
    if (tb_ready_print(e, false, TRANSFER_PROTO_AUTO, ready, 2,
                       json_pack("{s:s,s:I}", "ipc", hex, "ipc_off", (json_int_t)off)))
        return 1;
    /* Commands: "verify OFF LEN KEY SEED" (device), "verifyhost OFF LEN KEY SEED",
     * "quit".  Each answers one line. */
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long a, l, k, s;
        if (sscanf(line, "verify %llu %llu %llu %llu", &a, &l, &k, &s) == 4 && a + l <= dlen) {
            printf("bad %lld\n", tc_check(&ops, o->device, dev + a, l, k, s));
        } else if (sscanf(line, "verifyhost %llu %llu %llu %llu", &a, &l, &k, &s) == 4 &&
                   a + l <= kv + TC_SLACK) {
            printf("bad %lld\n", (long long)tb_pattern_check(host + a, k, l, s, NULL));
        } else if (!strncmp(line, "quit", 4)) {
            break;
        } else {
            printf("error unknown command\n");
        }
        fflush(stdout);
    }
    transfer_engine_destroy(e);
    api->free(o->device, dev);
    free(host);
    return 0;
}

/* ---- initiator -------------------------------------------------------------------------- */

typedef struct tc_child {
    tb_proc proc; /* the target process (transfer_spawn.c) */
    pid_t pid;
    FILE *in, *out; /* its stdin, its stdout (proc's fds) */
    char segment[128];
    unsigned long long dev, host, ipc_off;
    size_t length;
    uint8_t ipc[TRANSFER_IPC_HANDLE_MAX];
    size_t ipc_len;
} tc_child;

static int tc_spawn(const tc_options *o, tc_child *c) {
    char loc[16], tokens[32], bt[32], shape[64];
    snprintf(loc, sizeof loc, "cuda:%d", o->device);
    snprintf(tokens, sizeof tokens, "%ld", o->tokens);
    snprintf(bt, sizeof bt, "%ld", o->block_tokens);
    snprintf(shape, sizeof shape, "%ld,%ld,%ld", o->layers, o->kv_heads, o->head_dim);
    const char *args[] = {"disagg",   "bench",
                          "transfer", "--location",
                          loc,        "--mode",
                          "target",   "--tokens",
                          tokens,     "--block-tokens",
                          bt,         "--kv-shape",
                          shape,      "--kv-cache-dtype",
                          tc_dtype(o), "--local-hostname",
                          o->host,    NULL};
    /* The target allocates and fills its device buffer first. */
    char line[4096], why[768] = "";
    if (tb_spawn("disagg bench transfer", args, 120ull * 1000000000ull, &c->proc, line,
                 sizeof line))
        return 1;
    pid_t pid = c->proc.pid;
    c->pid = pid;
    c->in = fdopen(c->proc.in, "w");
    c->out = fdopen(c->proc.out, "r");
    json_t *ready = tb_ready_parse(line, why, sizeof why);
    const char *hex = json_string_value(json_object_get(ready, "ipc"));
    if (ready && (json_array_size(json_object_get(ready, "buffers")) != 2 || !hex ||
                  strlen(hex) > 2 * TRANSFER_IPC_HANDLE_MAX || strlen(hex) % 2 ||
                  !json_is_integer(json_object_get(ready, "ipc_off"))))
        snprintf(why, sizeof why,
                 "a ready line without the device and host buffers, \"ipc\" "
                 "and \"ipc_off\": %.200s",
                 line);
    if (!c->in || !c->out || !ready || why[0]) {
        fprintf(stderr, "disagg bench transfer: the forked target (pid %d) printed %s\n", (int)pid,
                why[0] ? why : "no ready line (see its error above)");
        json_decref(ready);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        if (c->in)
            fclose(c->in);
        else
            close(c->proc.in);
        if (c->out)
            fclose(c->out);
        else
            close(c->proc.out);
        c->in = c->out = NULL;
        c->pid = 0;
        return 1;
    }
    snprintf(c->segment, sizeof c->segment, "%s",
             json_string_value(json_object_get(ready, "segment")));
    c->dev = tb_ready_u64(ready, 0, "addr");
    c->length = (size_t)tb_ready_u64(ready, 0, "length");
    c->host = tb_ready_u64(ready, 1, "addr");
    c->ipc_off = (unsigned long long)json_integer_value(json_object_get(ready, "ipc_off"));
    c->ipc_len = strlen(hex) / 2;
    for (size_t i = 0; i < c->ipc_len; i++) {
        unsigned v;
        sscanf(hex + 2 * i, "%2x", &v);
        c->ipc[i] = (uint8_t)v;
    }
    json_decref(ready);
    return 0;
}

static long long tc_remote_check(tc_child *c, const char *cmd, uint64_t off, size_t len,
                                 uint64_t key, uint64_t seed) {
    fprintf(c->in, "%s %llu %zu %llu %llu\n", cmd, (unsigned long long)off, len,
            (unsigned long long)key, (unsigned long long)seed);
    fflush(c->in);
    char line[128];
    long long bad = -1;
    if (!fgets(line, sizeof line, c->out) || sscanf(line, "bad %lld", &bad) != 1) return -1;
    return bad;
}

static void tc_stop(tc_child *c) {
    if (c->pid <= 0) return;
    fprintf(c->in, "quit\n");
    fclose(c->in);
    fclose(c->out);
    int st;
    for (int i = 0; i < 100 && waitpid(c->pid, &st, WNOHANG) == 0; i++)
        usleep(100000);
    if (waitpid(c->pid, &st, WNOHANG) == 0) {
        kill(c->pid, SIGKILL);
        waitpid(c->pid, &st, 0);
    }
}

static int tc_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct tc_result {
    double best_s, median_s;
    uint64_t copies; /* d2d copies per batch (cuda_ipc) */
    unsigned via;
    int rc;
} tc_result;

/* reps x (alloc, submit n requests, wait, free) */
static void tc_time(transfer_engine *e, const transfer_request *reqs, size_t n, long reps,
                    const dcu_transfer_api *api, tc_result *r) {
    double *t = calloc((size_t)reps, sizeof *t);
    memset(r, 0, sizeof *r);
    for (long i = 0; i < reps + 1 && r->rc == 0; i++) { /* +1: a warm-up */
        transfer_batch b;
        uint64_t c0 = api->d2d_copies(), t0 = tc_now();
        r->rc = transfer_batch_alloc(e, n, &b);
        if (r->rc) break;
        r->rc = transfer_batch_submit(e, b, reqs, n);
        if (r->rc == 0) r->rc = transfer_batch_wait(e, b, 60ull * 1000000000ull);
        double s = (double)(tc_now() - t0) / 1e9;
        transfer_status st;
        if (transfer_batch_get_overall(e, b, &st) == 0) r->via = st.transports;
        transfer_batch_free(e, b);
        r->copies = api->d2d_copies() - c0;
        if (i > 0) t[i - 1] = s;
    }
    if (r->rc == 0) {
        qsort(t, (size_t)reps, sizeof *t, tc_cmp);
        r->best_s = t[0];
        r->median_s = t[reps / 2];
    }
    free(t);
}

static const char *tc_via(unsigned via) {
    switch (via) {
    case 1u << TRANSFER_PROTO_CUDA_IPC:
        return "cuda_ipc";
    case 1u << TRANSFER_PROTO_TCP:
        return "tcp";
    case 1u << TRANSFER_PROTO_SHM:
        return "shm";
    case 1u << TRANSFER_PROTO_RDMA:
        return "rdma";
    }
    return via ? "mixed" : "none";
}

static void tc_row(const char *what, const char *layout, size_t n, const tc_result *r,
                   size_t bytes) {
    printf("%-22s %-11s %5zu %6" PRIu64 " %-9s %9.3f %9.3f %9.1f\n", what, layout, n, r->copies,
           tc_via(r->via), r->best_s * 1e3, r->median_s * 1e3, (double)bytes / r->median_s / 1e9);
}

static int tc_run(const tc_options *o) {
    const dcu_transfer_api *api;
    transfer_device_ops ops;
    tc_child c = {0};
    if (tc_device(o, &api, &ops)) return 1;
    if (tc_spawn(o, &c)) return 1; /* fork + exec: the target starts its own CUDA context */
    size_t bb = tc_block_bytes(o), nb = tc_blocks(o), kv = bb * nb;
    char loc[16];
    snprintf(loc, sizeof loc, "cuda:%d", o->device);
    char *dev = api->alloc(o->device, kv + TC_SLACK);
    char *host = malloc(kv + TC_SLACK);
    transfer_engine *ea = NULL, *et = NULL;
    transfer_segment sa = 0, st = 0;
    transfer_request *cont = NULL, *scat = NULL, *hostr = NULL;
    int status = 0;
    if (!dev || !host || tc_engine(o, TRANSFER_PROTO_AUTO, &ops, &ea) ||
        tc_engine(o, TRANSFER_PROTO_TCP, &ops, &et)) {
        fprintf(stderr, "disagg bench transfer: cannot allocate %zu bytes on cuda:%d\n", kv,
                o->device);
        status = 1;
        goto out;
    }
    if (transfer_register(ea, dev, kv + TC_SLACK, loc) ||
        transfer_register(et, dev, kv + TC_SLACK, loc) ||
        transfer_register(et, host, kv + TC_SLACK, "cpu") ||
        transfer_open_segment(ea, c.segment, &sa) || transfer_open_segment(et, c.segment, &st)) {
        fprintf(stderr, "disagg bench transfer: cannot register or open the target %s\n",
                c.segment);
        status = 1;
        goto out;
    }
    size_t free_b = 0, total_b = 0;
    api->mem_info(o->device, &free_b, &total_b);
    printf("disagg bench transfer --location %s: KV of %ld tokens, %ld layers x K,V x %ld tokens "
           "x %ld KV heads x %ld x %s = %zu-byte blocks, %zu blocks, %.1f MB; target pid %d "
           "on the same GPU (%.1f of %.1f GB free)\n",
           loc, o->tokens, o->layers, o->block_tokens, o->kv_heads, o->head_dim, tc_dtype(o), bb, nb,
           (double)kv / 1e6, (int)c.pid, (double)free_b / 1e9, (double)total_b / 1e9);

    /* Requests: local block i -> remote block i (contiguous) or 2i (scattered, every other
     * block of the target's 2 x KV region). */
    cont = calloc(nb, sizeof *cont);
    scat = calloc(nb, sizeof *scat);
    hostr = calloc(nb, sizeof *hostr);
    if (!cont || !scat || !hostr) {
        status = 1;
        goto out;
    }
    for (size_t i = 0; i < nb; i++) {
        cont[i] = (transfer_request){TRANSFER_WRITE, dev + i * bb, sa, c.dev + i * bb, bb};
        scat[i] = (transfer_request){TRANSFER_WRITE, dev + i * bb, sa, c.dev + 2 * i * bb, bb};
        hostr[i] = (transfer_request){TRANSFER_WRITE, host + i * bb, st, c.host + i * bb, bb};
    }
    const uint64_t seed = TB_SEED_WRITE ^ 0x6b76;
    if (tc_fill(&ops, o->device, dev, kv, 0, seed)) {
        fprintf(stderr, "disagg bench transfer: cannot fill the local device buffer\n");
        status = 1;
        goto out;
    }
    tb_pattern_fill(host, 0, kv, seed);

    printf("\n%-22s %-11s %5s %6s %-9s %9s %9s %9s\n", "transport", "layout", "reqs", "copies",
           "carried", "best ms", "median ms", "GB/s");
    double ceil_ipc = 0, ipc_cont = 0, tcp_dev = 0, tcp_host = 0;
    if (o->ipc) {
        /* ceiling: one copy of the whole KV through an IPC mapping of the target's memory */
        void *base = NULL;
        double s = 0;
        if (ops.ipc_open(ops.ctx, o->device, c.ipc, c.ipc_len, &base) == 0) {
            if (api->time_copy(o->device, (char *)base + c.ipc_off, dev, kv, (int)o->reps, &s) ==
                0) {
                ceil_ipc = (double)kv / s / 1e9;
                printf("%-22s %-11s %5d %6d %-9s %9s %9.3f %9.1f\n", "ceiling: d2d via IPC",
                       "one copy", 1, 1, "-", "-", s * 1e3, ceil_ipc);
            }
            ops.ipc_close(ops.ctx, base);
        }
        tc_result r;
        tc_time(ea, cont, nb, o->reps, api, &r);
        if (r.rc) {
            fprintf(stderr, "cuda_ipc contiguous: %s\n", transfer_strerror(r.rc));
            status = 1;
        } else {
            tc_row("cuda_ipc", "contiguous", nb, &r, kv);
            ipc_cont = r.median_s;
            long long bad = tc_remote_check(&c, "verify", 0, kv, 0, seed);
            if (bad != 0) {
                fprintf(stderr, "cuda_ipc contiguous: %lld bytes differ at the target\n", bad);
                status = 1;
            }
        }
        /* scattered: every block its own copy, as one batch operation (the gather/scatter
         * kernel, the default), cudaMemcpyBatchAsync, or one cudaMemcpyAsync each (before) */
        static const char *const modes[3] = {"each", "memcpy_batch", "kernel"};
        for (int m = 0; m < 3; m++) {
            setenv("DISAGG_CUDA_BATCH_COPY", modes[m], 1);
            char what[48];
            snprintf(what, sizeof what, "cuda_ipc (%s)", modes[m]);
            const uint64_t seed_m = seed ^ (0x51 + (uint64_t)m);
            if (tc_fill(&ops, o->device, dev, kv, 0, seed_m)) status = 1;
            tc_time(ea, scat, nb, o->reps, api, &r);
            if (r.rc) {
                fprintf(stderr, "%s scattered: %s\n", what, transfer_strerror(r.rc));
                status = 1;
                continue;
            }
            tc_row(what, "scattered", nb, &r, kv);
            long long bad = 0;
            for (size_t i = 0; i < nb && bad == 0; i++)
                bad = tc_remote_check(&c, "verify", 2 * i * bb, bb, i * bb, seed_m);
            if (bad != 0) {
                fprintf(stderr, "%s scattered: %lld bytes differ at the target\n", what, bad);
                status = 1;
            }
        }
        /* one layer of every block (layer-wise streaming's unit): bb / layers bytes at
         * layer 1's offset of each block, scattered as above */
        size_t lb = bb / (size_t)o->layers;
        transfer_request *lay = calloc(nb, sizeof *lay);
        for (int m = 0; lay && m < 3; m++) {
            setenv("DISAGG_CUDA_BATCH_COPY", modes[m], 1);
            for (size_t i = 0; i < nb; i++)
                lay[i] = (transfer_request){TRANSFER_WRITE, dev + i * bb + lb, sa,
                                            c.dev + 2 * i * bb + lb, lb};
            char what[48];
            snprintf(what, sizeof what, "cuda_ipc (%s)", modes[m]);
            tc_time(ea, lay, nb, o->reps, api, &r);
            if (r.rc) {
                fprintf(stderr, "%s one layer: %s\n", what, transfer_strerror(r.rc));
                status = 1;
                continue;
            }
            tc_row(what, "one layer", nb, &r, lb * nb);
        }
        free(lay);
        unsetenv("DISAGG_CUDA_BATCH_COPY");
    }
    if (o->tcp) {
        long reps = o->reps < 5 ? o->reps : 5;
        const uint64_t seed2 = seed ^ 0x7463;
        if (tc_fill(&ops, o->device, dev, kv, 0, seed2)) status = 1;
        for (size_t i = 0; i < nb; i++)
            cont[i].target = st;
        tc_result r;
        tc_time(et, cont, nb, reps, api, &r);
        if (r.rc) {
            fprintf(stderr, "staged tcp: %s\n", transfer_strerror(r.rc));
            status = 1;
        } else {
            tc_row("tcp (staged, d->d)", "contiguous", nb, &r, kv);
            tcp_dev = (double)kv / r.median_s / 1e9;
            long long bad = tc_remote_check(&c, "verify", 0, kv, 0, seed2);
            if (bad != 0) {
                fprintf(stderr, "staged tcp: %lld bytes differ at the target\n", bad);
                status = 1;
            }
        }
        tc_time(et, hostr, nb, reps, api, &r);
        if (r.rc) {
            fprintf(stderr, "host tcp: %s\n", transfer_strerror(r.rc));
            status = 1;
        } else {
            tc_row("ceiling: tcp host mem", "contiguous", nb, &r, kv);
            tcp_host = (double)kv / r.median_s / 1e9;
            long long bad = tc_remote_check(&c, "verifyhost", 0, kv, 0, seed);
            if (bad != 0) {
                fprintf(stderr, "host tcp: %lld bytes differ at the target\n", bad);
                status = 1;
            }
        }
        /* plain loopback socket loop, 1 MiB blocks over the same footprint */
        char *srv = malloc(kv + TC_SLACK), err[256];
        tb_ceiling sc;
        if (srv && tb_socket_ceiling(o->host, false, 1u << 20, host, srv, kv >> 20, 1.0, &sc, err,
                                     sizeof err) == 0)
            printf("%-22s %-11s %5s %6s %-9s %9s %9.3f %9.1f\n", "ceiling: socket loop", "1 MiB",
                   "-", "-", "-", "-", sc.mean_us / 1e3, sc.gbps);
        free(srv);
        /* pinned PCIe copies of the whole KV */
        void *pin = ops.alloc_pinned(ops.ctx, kv);
        double s;
        if (pin && api->time_pcie(o->device, pin, dev, kv, 1, (int)reps, &s) == 0)
            printf("%-22s %-11s %5d %6s %-9s %9s %9.3f %9.1f\n", "ceiling: pinned D2H", "one copy",
                   1, "-", "-", "-", s * 1e3, (double)kv / s / 1e9);
        if (pin && api->time_pcie(o->device, pin, dev, kv, 0, (int)reps, &s) == 0)
            printf("%-22s %-11s %5d %6s %-9s %9s %9.3f %9.1f\n", "ceiling: pinned H2D", "one copy",
                   1, "-", "-", "-", s * 1e3, (double)kv / s / 1e9);
        if (pin) ops.free_pinned(ops.ctx, pin);
    }
    /* DMA-BUF export of the device buffer (what rdma registers with WITH_NVIDIA_PEERMEM=0) */
    {
        int fd = -1;
        uint64_t doff = 0;
        int rc = ops.get_dmabuf(ops.ctx, dev, kv, &fd, &doff);
        if (rc == 0) {
            off_t sz = lseek(fd, 0, SEEK_END);
            printf("\ndma-buf export (cuMemGetHandleForAddressRange) of %.1f MB of cuda:%d: fd %d, "
                   "%lld bytes, offset %llu\n",
                   (double)kv / 1e6, o->device, fd, (long long)sz, (unsigned long long)doff);
            close(fd);
        } else {
            printf("\ndma-buf export (cuMemGetHandleForAddressRange) of cuda:%d: failed (%d)\n",
                   o->device, rc);
        }
    }
    printf("\ntargets:\n");
    if (o->ipc && ipc_cont > 0 && ceil_ipc > 0) {
        double gbs = (double)kv / ipc_cont / 1e9;
        int pass = ipc_cont <= 0.25e-3 && gbs >= 0.45 * ceil_ipc;
        printf("  cuda_ipc KV of %ld tokens in <= 0.25 ms and >= 45%% of the IPC copy: %.3f ms, "
               "%.0f%% of %.0f GB/s  %s\n",
               o->tokens, ipc_cont * 1e3, 100 * gbs / ceil_ipc, ceil_ipc, pass ? "PASS" : "MISS");
    }
    if (o->tcp && tcp_dev > 0 && tcp_host > 0)
        printf("  staged tcp >= 80%% of host-memory tcp: %.2f vs %.2f GB/s = %.0f%%  %s\n", tcp_dev,
               tcp_host, 100 * tcp_dev / tcp_host, tcp_dev >= 0.8 * tcp_host ? "PASS" : "MISS");
    /* one line to compare KV dtypes (gpu_check ONLY=fp8kv): the time of this prompt's KV */
    printf("kv time %s %ld tokens %.1f MB: cuda_ipc %.3f ms, staged tcp %.3f ms\n", tc_dtype(o),
           o->tokens, (double)kv / 1e6, o->ipc && ipc_cont > 0 ? ipc_cont * 1e3 : -1.0,
           o->tcp && tcp_dev > 0 ? (double)kv / (tcp_dev * 1e9) * 1e3 : -1.0);
out:
    free(cont);
    free(scat);
    free(hostr);
    transfer_engine_destroy(ea);
    transfer_engine_destroy(et);
    if (dev) api->free(o->device, dev);
    free(host);
    tc_stop(&c);
    return status;
}

int bench_transfer_cuda_main(int argc, char **argv) {
    tc_options o;
    int rc = tc_parse(argc, argv, &o);
    if (rc >= 0) return rc;
    return o.target ? tc_run_target(&o) : tc_run(&o);
}
