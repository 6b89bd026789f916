/*
 * fuzz_util — helpers shared by the libFuzzer targets in fuzz/: NUL-terminated
 * copies of the input, splitting one input into several documents, a private
 * temporary directory for parsers that read files, and a loopback exchange
 * (connect, send the input, half-close, read the answer) for targets that
 * drive a real server thread in-process.  Targets keep the product's logging
 * quiet (errors only) so that the fuzzer's own output stays readable.
 */
#ifndef DISAGG_FUZZ_UTIL_H
#define DISAGG_FUZZ_UTIL_H

#include <stddef.h>
#include <stdint.h>

/* libFuzzer's entry points. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* malloc'ed copy of data[0..size) plus a NUL (abort on out-of-memory). */
char *fuzz_strndup(const uint8_t *data, size_t size);

/* Split data at the first NUL byte: part 0 is before it, part 1 after it (or
 * empty/NULL-length when there is none).  Returns how many parts (1 or 2). */
int fuzz_split_nul(const uint8_t *data, size_t size, const uint8_t **b, size_t *blen);

/* A directory private to this process (created once, removed at exit). */
const char *fuzz_tmpdir(void);
/* Write dir/name with len bytes (truncating).  Aborts when it cannot: a
 * fuzzer that cannot write its input would silently test nothing. */
void fuzz_write_file(const char *dir, const char *name, const void *data, size_t len);
/* Remove dir/name (missing is fine). */
void fuzz_remove_file(const char *dir, const char *name);

/* Connect to 127.0.0.1:port, send len bytes, shut down the write side and
 * read the answer until the server closes or timeout_ms passes.  Up to cap
 * bytes of the answer land in reply (may be NULL); returns the bytes read, or
 * -1 when the connection itself failed (which aborts: the server must be up). */
long fuzz_exchange(uint16_t port, const void *data, size_t len, char *reply, size_t cap,
                   int timeout_ms);
/* The same without the half-close (the write side stays open until the
 * server closes): for a complete request whose answer takes a while, since
 * an HTTP server takes a client's EOF for its going away (nginx, uvicorn and
 * base/http_server do) and drops the request. */
long fuzz_exchange_open(uint16_t port, const void *data, size_t len, char *reply, size_t cap,
                        int timeout_ms);

/* Quiet logs (errors only) unless DISAGG_LOG_LEVEL is set. */
void fuzz_quiet_logs(void);

#endif
