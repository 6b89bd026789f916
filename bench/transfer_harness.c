/*
 * transfer_harness — `disagg transfer target|check|demo`: the transfer
 * engine's command-line test harness, built only on its public header
 * (include/disagg/transfer.h) and src/base.  The integration tests
 * (tests/integration/test_transfer_*.py, test_mooncake_*.py, ...) drive it:
 *
 *   target  registers K patterned buffers, prints one JSON line, serves
 *   check   random READ/WRITE traffic against a target, every byte verified
 *   demo    forks a target and runs a check against it (the README's command)
 *
 * The buffer pattern is the bench's one pattern (transfer_pattern.c,
 * tb_pattern_*), keyed per buffer, and a contract with
 * tests/integration/conftest.py (pattern_bytes), which must agree with it:
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
#include "bench/transfer_harness.h"

#include "base/auth.h"
#include "base/clock.h"
#include "base/rng.h"
#include "base/stop_signal.h"
#include "bench/transfer_bench.h"
#include "disagg/transfer.h"

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

/* ==== pattern ============================================================= */

/* Writes bytes [offset, offset+len) of buffer k's pattern into dst: the
 * bench's one pattern (transfer_pattern.c) with seed + (k << 40). */
static void pattern_fill(uint8_t *dst, uint64_t seed, uint64_t k, uint64_t offset, size_t len) {
    tb_pattern_fill(dst, offset, len, seed + (k << 40));
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

int transfer_harness_target(int argc, char **argv) {
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
        "Registers K buffers filled with the pattern (see bench/transfer_harness.c) and\n"
        "serves them.  Prints the ready line of every transfer target (one JSON object:\n"
        "{\"segment\",\"tcp_data_port\",\"pid\",\"auth\",\"protocol\",\"buffers\":[{\"addr\","
        "\"length\",\n"
        "\"location\"}],\"pattern\",...}) on start and one {\"event\":\"stats\",...} line on exit\n"
        "(SIGINT/SIGTERM).\n"
        "With $DISAGG_KV_SECRET set (also for copy and check) the ports require that\n"
        "shared secret (docs/transfer.md, Security).",
    };
    int prc = th_opts_parse(&u, specs, sizeof specs / sizeof specs[0], argc, argv);
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
        uint8_t *m = th_map_bytes(maplen);
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

    tb_ready_buf ready[TARGET_MAX_BUFFERS];
    for (size_t k = 0; k < nb; k++)
        ready[k] = (tb_ready_buf){(uintptr_t)bufs[k].data, bufs[k].length, "cpu:0"};
    if (status == 0 &&
        tb_ready_print(eng, cfg.auth_secret != NULL, proto, ready, nb,
                       json_pack("{s:I,s:i,s:i}", "pattern", (json_int_t)seed, "guard_bytes",
                                 TARGET_GUARD_BYTES, "guard_value", TARGET_GUARD_VALUE)))
        status = 1;
    if (status == 0) {
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
        char *s = json_dumps(sj, JSON_COMPACT);
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
    int rc = th_batch_run(c->eng, reqs, n, th_wait_budget_ns(c->p->timeout_ms, bytes), base, msg,
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
    int rc = th_batch_run(c->eng, &req, 1, th_wait_budget_ns(c->p->timeout_ms, len), NULL, msg,
                          sizeof msg, &bad);
    if (rc == TRANSFER_EREMOTEADDR) {
        c->s->rejected_ok++;
        return true;
    }
    if (rc == 0)
        return check_fail(
            c, "%s %s of %" PRIu64 " bytes at 0x%" PRIx64 " was accepted; expected %s", what,
            th_op_name(op), len, remote, transfer_strerror(TRANSFER_EREMOTEADDR));
    return check_fail(c, "%s %s at 0x%" PRIx64 " failed with '%s'; expected '%s' (%s)", what,
                      th_op_name(op), remote, transfer_strerror(rc),
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

    int rc = th_initiator_create(p->protocol, p->device, p->timeout_ms, &c.eng);
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
        shadow[k] = th_map_bytes(span[k]);
        if (!shadow[k]) {
            check_fail(&c, "cannot map %" PRIu64 " bytes for the expected contents", span[k]);
            goto out;
        }
        pattern_fill(shadow[k], p->pattern, k, 0, span[k]);
    }
    c.arena_len = 2 * p->batch * p->max_length;
    c.arena = th_map_bytes(c.arena_len);
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

int transfer_harness_check(int argc, char **argv) {
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
    int prc = th_opts_parse(&u, specs, sizeof specs / sizeof specs[0], argc, argv);
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

int transfer_harness_demo(int argc, char **argv) {
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
    int prc = th_opts_parse(&u, specs, sizeof specs / sizeof specs[0], argc, argv);
    if (prc) return prc < 0 ? 0 : prc;
    signal(SIGPIPE, SIG_IGN);

    char size_arg[32], pattern_arg[32];
    snprintf(size_arg, sizeof size_arg, "%" PRIu64, buffer_size);
    snprintf(pattern_arg, sizeof pattern_arg, "%" PRIu64, p.pattern);
    const char *const child_argv[] = {"disagg",
                                      "transfer",
                                      "target",
                                      "--buffer-size",
                                      size_arg,
                                      "--pattern",
                                      pattern_arg,
                                      "--protocol",
                                      transfer_protocol_name(p.protocol),
                                      "--exit-on-stdin-eof",
                                      NULL};
    tb_proc child;
    char line[8192];
    if (tb_spawn("disagg transfer demo", child_argv, 30 * NS_PER_S, &child, line, sizeof line))
        return 1;
    pid_t pid = child.pid;
    int status = 1;
    char why[512];
    json_t *j = tb_ready_parse(line, why, sizeof why);
    if (!j) {
        fprintf(stderr, "disagg transfer demo: the target (pid %d) printed %s\n", (int)pid, why);
        goto out;
    }
    char segment[128];
    snprintf(segment, sizeof segment, "%s", json_string_value(json_object_get(j, "segment")));
    p.target = segment;
    char sz[32];
    th_format_bytes(sz, sizeof sz, (double)buffer_size);
    printf("disagg transfer demo: target pid %d serves %s at %s\n", (int)pid, sz, segment);
    fflush(stdout);

    check_summary s;
    int rc = check_run(&p, &s);
    char rd[32], wr[32], mn[32], mx[32], vf[32];
    th_format_bytes(rd, sizeof rd, (double)s.bytes_read);
    th_format_bytes(wr, sizeof wr, (double)s.bytes_written);
    th_format_bytes(mn, sizeof mn, (double)s.min_len);
    th_format_bytes(mx, sizeof mx, (double)s.max_len);
    th_format_bytes(vf, sizeof vf, (double)s.verified_bytes);
    printf("  protocol %s: %" PRIu64 " requests (%" PRIu64 " READ, %" PRIu64 " WRITE) of %s..%s\n",
           s.protocol, s.requests, s.reads, s.writes, mn, mx);
    printf("  moved %s read + %s written; %.2f GB/s while transferring (%.2f s wall)\n", rd, wr,
           s.transfer_seconds > 0
               ? (double)(s.bytes_read + s.bytes_written) / s.transfer_seconds / 1e9
               : 0.0,
           s.wall_seconds);
    printf("  %s compared against the expected bytes; %d/%d out-of-range requests rejected\n", vf,
           s.rejected_ok, s.rejected_expected);

    close(child.in); /* target exits on stdin EOF and prints its stats */
    child.in = -1;
    if (tb_proc_read_line(&child, line, sizeof line, 10 * NS_PER_S) == 0) {
        json_t *st = json_loads(line, 0, NULL);
        if (st) {
            char served[32];
            th_format_bytes(served, sizeof served,
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
    tb_proc_stop(&child, 0, 10 * NS_PER_S);
    return status;
}
