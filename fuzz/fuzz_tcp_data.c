/*
 * fuzz_tcp_data — bytes from the network to a transfer engine's tcp data port
 * (Mooncake TCP v2: 24-byte headers `u64 size | u64 addr | u8 opcode | 7
 * zero`, WRITE payloads after their header, and v1 without status words;
 * docs/transfer.md): a real
 * tcp_server runs in this process with one registered 64 KiB buffer, and each
 * input is sent to it over a loopback connection, then half-closed.
 *
 * So that the fuzzer can reach the registered buffer, the addr of each
 * header is taken as an offset from the buffer's base and rewritten before
 * sending (walking the stream as the server does: a WRITE header is followed
 * by its payload).  Checks: the
 * answer is exactly what the protocol prescribes for the input (status
 * words with the magic, each READ's payload after its OK), the buffer holds
 * exactly what the WRITEs wrote (a WRITE cut short by the end of the input
 * leaves the bytes that came, with no status: payloads land in place), and
 * the guard zones on both sides of the buffer are never written.
 */
#include "fuzz/fuzz_util.h"

#include "base/clock.h"
#include "base/net.h"
#include "disagg/transfer.h"
#include "transfer/registry.h"
#include "transfer/tcp_server.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GUARD     4096
#define BUF_BYTES 65536

static uint8_t *g_mem; /* (GUARD + BUF_BYTES + GUARD) the buffer with guard zones */
static registry g_regs;
static pthread_rwlock_t g_lock = PTHREAD_RWLOCK_INITIALIZER;
static _Atomic uint64_t g_served, g_rejected;
static tcp_server *g_srv;
static uint16_t g_port;
/* The same buffer behind a server with a shared secret: no input (the fuzzer
 * cannot forge the HMAC) may read or write a byte of it. */
static tcp_server *g_srv_auth;
static uint16_t g_port_auth;
static _Atomic uint64_t g_refused;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    signal(SIGPIPE, SIG_IGN);
    g_mem = calloc(1, GUARD + BUF_BYTES + GUARD);
    registry_init(&g_regs);
    if (!g_mem || registry_add(&g_regs, (uint64_t)(uintptr_t)(g_mem + GUARD), BUF_BYTES, "cpu:0"))
        abort();
    tcp_server_env env = {.reg_lock = &g_lock,
                          .regs = &g_regs,
                          .timeout_base_ns = NS_PER_S,
                          .timeout_per_byte_ns = 1.0,
                          .bytes_served = &g_served,
                          .rejected = &g_rejected};
    net_addr a;
    if (net_resolve("127.0.0.1", 0, &a) != 0 || tcp_server_start(&a, 1, &env, &g_srv, &g_port, NULL) != 0) {
        fprintf(stderr, "fuzz_tcp_data: cannot start the tcp server\n");
        abort();
    }
    env.secret = "fuzz-secret";
    env.auth_refused = &g_refused;
    if (tcp_server_start(&a, 1, &env, &g_srv_auth, &g_port_auth, NULL) != 0) {
        fprintf(stderr, "fuzz_tcp_data: cannot start the authenticated tcp server\n");
        abort();
    }
    return 0;
}

static int guards_clean(void) {
    for (size_t i = 0; i < GUARD; i++)
        if (g_mem[i] || g_mem[GUARD + BUF_BYTES + i]) return 0;
    return 1;
}

/* What the server must answer to msg (addresses already rewritten), computed
 * from the protocol: appends status words / READ payloads to exp and applies
 * WRITE payloads to shadow (the buffer as it must be afterwards). */
static size_t expected_reply(const uint8_t *msg, size_t size, uint8_t *shadow, uint8_t **exp) {
    uint64_t base = (uint64_t)(uintptr_t)(g_mem + GUARD);
    size_t cap = 4096, n = 0, off = 0;
    uint8_t *e = malloc(cap);
#define PUT(p, l)                                                                                  \
    do {                                                                                           \
        while (n + (l) > cap)                                                                      \
            e = realloc(e, cap *= 2);                                                              \
        memcpy(e + n, (p), (l));                                                                   \
        n += (l);                                                                                  \
    } while (0)
    while (off + TCP_HEADER_LEN <= size) {
        uint64_t len, addr, w;
        uint8_t op;
        tcp_header_decode(msg + off, &len, &addr, &op);
        off += TCP_HEADER_LEN;
        if ((op & 0x7f) > TRANSFER_WRITE) {
            w = TCP_STATUS_MAGIC | TCP_STATUS_MALFORMED;
            PUT(&w, 8);
            break;
        }
        int is_write = (op & 0x7f) == TRANSFER_WRITE;
        int v2 = (op & TCP_OP_V2) != 0; /* v1 (Mooncake's legacy framing): no status words */
        uint64_t rel = addr - base;
        int inside = len > 0 && rel < BUF_BYTES && len <= BUF_BYTES - rel;
        if (!inside && !v2) break; /* v1 rejection: the connection closes */
        if (!inside) {
            w = TCP_STATUS_MAGIC | TCP_STATUS_REJECTED;
            if (is_write && len > TCP_MAX_REQUEST) {
                PUT(&w, 8);
                break;
            }
            if (is_write) {
                if (size - off < len) break; /* payload cut short: closed, no status */
                off += (size_t)len;
            }
            PUT(&w, 8);
            continue;
        }
        w = TCP_STATUS_MAGIC | TCP_STATUS_OK;
        if (is_write) {
            if (size - off < len) {
                /* Cut short: the bytes that came already landed in place
                 * (zero-copy receive), and no status follows. */
                memcpy(shadow + rel, msg + off, size - off);
                break;
            }
            memcpy(shadow + rel, msg + off, (size_t)len);
            off += (size_t)len;
            if (v2) PUT(&w, 8);
        } else {
            if (v2) PUT(&w, 8);
            PUT(shadow + rel, (size_t)len);
        }
    }
#undef PUT
    *exp = e;
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *msg = malloc(size ? size : 1);
    memcpy(msg, data, size);
    uint64_t base = (uint64_t)(uintptr_t)(g_mem + GUARD);
    size_t off = 0;
    while (off + TCP_HEADER_LEN <= size) {
        uint64_t len, addr;
        uint8_t op;
        tcp_header_decode(msg + off, &len, &addr, &op);
        tcp_header_encode(msg + off, len, base + addr, op);
        memcpy(msg + off + 17, data + off + 17, 7); /* keep the reserved bytes as given */
        off += TCP_HEADER_LEN;
        if ((op & 0x7f) > TRANSFER_WRITE) break; /* server closes */
        if ((op & 0x7f) == TRANSFER_WRITE) off += len < size - off ? (size_t)len : size - off;
    }
    static uint8_t shadow[BUF_BYTES];
    memcpy(shadow, g_mem + GUARD, BUF_BYTES);
    {
        /* At most: refusal, or challenge (status + nonce + proof) then refusal. */
        char r[8 + 64 + 8 + 1];
        long n = fuzz_exchange(g_port_auth, msg, size, r, sizeof r, 5000);
        if (n > 8 + 64 + 8 || memcmp(shadow, g_mem + GUARD, BUF_BYTES) != 0 || !guards_clean()) {
            fprintf(stderr, "the authenticated server answered %ld bytes or let memory change\n",
                    n);
            abort();
        }
    }
    uint8_t *exp;
    size_t exp_len = expected_reply(msg, size, shadow, &exp);
    uint8_t *reply = malloc(exp_len + 4096);
    long got = fuzz_exchange(g_port, msg, size, (char *)reply, exp_len + 4096, 5000);
    free(msg);
    if (got != (long)exp_len || memcmp(reply, exp, exp_len) != 0) {
        fprintf(stderr, "answer differs from the protocol: %ld bytes, expected %zu\n", got,
                exp_len);
        abort();
    }
    if (memcmp(shadow, g_mem + GUARD, BUF_BYTES) != 0) {
        fprintf(stderr, "the registered buffer differs from what the WRITEs wrote\n");
        abort();
    }
    if (!guards_clean()) {
        fprintf(stderr, "a request wrote outside the registered buffer\n");
        abort();
    }
    free(exp);
    free(reply);
    return 0;
}
