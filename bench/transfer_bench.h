/*
 * transfer_bench (internal) — pieces shared by the files of `disagg bench
 * transfer`: the verification pattern (transfer_pattern.c), the ceilings the
 * engine is compared with (transfer_baseline.c: single-thread memcpy and a
 * plain blocking loopback socket request/response loop) and the option
 * parsers (transfer_options.c).  transfer_bench.c drives the engine through
 * include/disagg/transfer.h only.
 */
#ifndef DISAGG_BENCH_TRANSFER_BENCH_H
#define DISAGG_BENCH_TRANSFER_BENCH_H

#include "base/rng.h"
#include "disagg/transfer.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- verification pattern ------------------------------------------------ */

/* The one byte pattern of the transfer bench and harness (the harness's
 * buffer k uses seed + (k << 40); tests/integration/conftest.py pattern_bytes
 * is the independent reference): the byte at offset o of a patterned buffer
 * is byte (o % 8) (little-endian) of the 64-bit word tb_pattern_word(seed,
 * o / 8) = splitmix64(seed + o / 8): every byte depends on its offset, so a
 * block landing at the wrong address or shifted by a byte fails the check.  The target fills its
 * buffer with TB_SEED_TARGET keyed by the offset from the buffer's start; both ends know the
 * function. */
#define TB_SEED_TARGET 0x7472616e73666572ull /* "transfer" */
#define TB_SEED_WRITE  0x6469736167675772ull /* base seed of WRITE payloads */

static inline uint64_t tb_pattern_word(uint64_t seed, uint64_t k) {
    return rng_mix64(seed + k); /* splitmix64 (base/rng.h) */
}
/* Fill buf[0, len) with the pattern of seed for offsets [offset, offset+len). */
void tb_pattern_fill(void *buf, uint64_t offset, size_t len, uint64_t seed);
/* Count the bytes of buf[0, len) that differ from the pattern at [offset,
 * offset+len); *first (if given) gets the index of the first one (len if none). */
size_t tb_pattern_check(const void *buf, uint64_t offset, size_t len, uint64_t seed, size_t *first);
/* The expected byte at offset. */
uint8_t tb_pattern_byte(uint64_t seed, uint64_t offset);

/* ---- a forked target (transfer_spawn.c) ------------------------------------ */

typedef struct tb_proc {
    int pid; /* 0 = none */
    int in;  /* its stdin (write end), -1 = closed */
    int out; /* its stdout (read end), -1 = closed */
} tb_proc;

/* The one spawner of the transfer bench and harness: fork this binary
 * (/proc/self/exe) with argv (a target's arguments), its stdin and stdout
 * piped to us, SIGTERM when we die, and read its "target ready" line (the
 * first line it prints, without the newline) into line within timeout_ns.
 * 0, or 1 with a message prefixed `who` (the child killed and reaped). */
int tb_spawn(const char *who, const char *const argv[], uint64_t timeout_ns, tb_proc *c, char *line,
             size_t cap);
/* The one "target ready" line of every transfer target (`disagg transfer target`,
 * `disagg bench transfer --mode target` and its `--location cuda:N` form): one JSON object
 * on one line,
 *   {"segment": "IP:PORT", "tcp_data_port": N, "pid": P, "auth": bool, "protocol": "tcp",
 *    "buffers": [{"addr": A, "length": L, "location": "cpu:0"}, ...], ...}
 * the target's own members (extra's: "pattern", "ipc", ...) after those. */
typedef struct tb_ready_buf {
    uint64_t addr, length;
    const char *location; /* "cpu:0", "cuda:0" */
} tb_ready_buf;
/* Prints it on stdout (and flushes) for engine e serving bufs[0..n); extra (may be NULL) is
 * consumed.  0, or -1 (out of memory, said on stderr). */
int tb_ready_print(transfer_engine *e, bool auth, transfer_protocol protocol,
                   const tb_ready_buf *bufs, size_t n, json_t *extra);
/* Parses a ready line: the object with a string "segment", an integer "pid" and a non-empty
 * "buffers" array of objects with integer "addr" and "length"; NULL with why in err
 * otherwise.  The caller json_decref()s it. */
json_t *tb_ready_parse(const char *line, char *err, size_t cap);
/* Member k of its buffer i (addr, length), or 0. */
uint64_t tb_ready_u64(const json_t *ready, size_t i, const char *k);

/* Its next stdout line within timeout_ns: 0 or -1. */
int tb_proc_read_line(tb_proc *c, char *line, size_t cap, uint64_t timeout_ns);
/* Close its stdin, send sig (0 = none), wait up to timeout_ns for it to
 * exit (then SIGKILL), close its stdout.  The wait status; -2 when it had to
 * be killed, -1 when there was none. */
int tb_proc_stop(tb_proc *c, int sig, uint64_t timeout_ns);

/* ---- ceilings --------------------------------------------------------------- */

typedef struct tb_ceiling {
    double gbps;    /* 10^9 bytes per second */
    uint64_t ops;   /* blocks copied / requests answered */
    double seconds; /* measured wall time */
    double mean_us; /* seconds / ops in microseconds */
} tb_ceiling;

/* Single-thread memcpy of block bytes, slot by slot over slots blocks of src
 * into dst (the same footprint the engine moves), for about seconds. */
void tb_memcpy_ceiling(void *dst, const void *src, size_t block, size_t slots, double seconds,
                       tb_ceiling *out);

/* A plain blocking socket request/response loop on loopback host `host` ("127.0.0.1"):
 * one connection, one client thread, one server thread.  is_read = false: the
 * client sends a 24-byte header plus block bytes, the server reads it all into
 * its buffer and answers 8 bytes (the engine's WRITE).  is_read = true: the
 * client sends a 24-byte header, the server answers 8 bytes plus block bytes
 * (the engine's READ).  Both ends cycle over slots blocks of their buffer.
 * Returns 0, or -errno with a message in err. */
int tb_socket_ceiling(const char *host, bool is_read, size_t block, void *client_buf,
                      void *server_buf, size_t slots, double seconds, tb_ceiling *out, char *err,
                      size_t errcap);

/* ---- option values ---------------------------------------------------------- */

/* "4096", "64K", "1M", "2G" (also "64k", "64KiB", "64KB"): KiB-based.  0 and
 * overflow are errors.  Returns 0 or -1. */
int tb_parse_size(const char *opt, const char *s, uint64_t min, uint64_t max, size_t *out);
/* Seconds: "1", "0.5", "2s", "500ms"; must be > 0 and <= 3600.  Returns 0 or -1. */
int tb_parse_duration(const char *s, double *out);
/* "4 KiB", "64 MiB", "1000 B" into buf. */
const char *tb_format_size(size_t n, char *buf, size_t cap);

#endif
