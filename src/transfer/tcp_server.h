/*
 * tcp_server — the target side of the tcp transport: accepts data
 * connections and serves Mooncake TCP v2 requests (docs/transfer.md) on each,
 * in order, so clients may pipeline.  A request is served only when
 * [addr, addr+size) lies inside one registered buffer (registry_find under
 * the engine's registration lock); WRITE payloads are received straight into
 * that memory (device memory: through pinned staging buffers, pipelined).  One thread per
 * connection; replies are batched while more requests are already buffered.
 */
#ifndef DISAGG_TRANSFER_TCP_SERVER_H
#define DISAGG_TRANSFER_TCP_SERVER_H

#include "base/net.h"
#include "transfer/registry.h"
#include "transfer/staging.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define TCP_HEADER_LEN            24
#define TCP_STATUS_MAGIC          0x4D43545600000000ull
#define TCP_STATUS_OK             0
#define TCP_STATUS_REJECTED       1
#define TCP_STATUS_MALFORMED      2
#define TCP_STATUS_AUTH_REFUSED   3 /* secret set: the peer did not (or could not) authenticate */
#define TCP_STATUS_AUTH_CHALLENGE 4 /* secret set: server nonce + proof follow */
/* Secret set: a data connection opens with TCP_AUTH_MAGIC + client nonce; the
 * server answers status AUTH_CHALLENGE + nonce + proof; the client sends its
 * proof; the server answers status OK (then requests flow) or AUTH_REFUSED
 * and closes.  No request frame is read before that. */
#define TCP_AUTH_MAGIC     "DGXAUTH1"
#define TCP_AUTH_MAGIC_LEN 8
#define TCP_OP_V2          0x80
#define TCP_MAX_REQUEST    (1ull << 30) /* larger rejected WRITEs close the connection */
/* Data connections: the first request (or, with a secret, the authentication)
 * must arrive within TCP_FIRST_MSG_NS of accept, else the connection is
 * closed; at most max_conns_per_peer (default TCP_MAX_PER_PEER) from one
 * address at once, and TCP_MAX_CONNS in all -- beyond either, the longest-idle
 * connection (of that address) is closed to make room, and the new one is
 * refused only when none is idle (docs/security.md). */
#define TCP_FIRST_MSG_NS (2ull * 1000000000ull)
#define TCP_MAX_PER_PEER 64
#define TCP_MAX_CONNS    1024

typedef struct tcp_server_env {
    pthread_rwlock_t *reg_lock; /* guards regs; held (read) while bytes move */
    const registry *regs;       /* this engine's registrations */
    uint64_t timeout_base_ns;   /* payload deadline = base + per_byte * size */
    double timeout_per_byte_ns;
    _Atomic uint64_t *bytes_served; /* stats */
    _Atomic uint64_t *rejected;
    const char *secret;             /* NULL = no authentication (Mooncake's frames) */
    _Atomic uint64_t *auth_refused; /* stats: data connections refused */
    /* Device memory (registered "cuda:N"): served through two pinned
     * staging buffers per connection (staging.h) with the engine's table. */
    const transfer_device_ops *const *dev;
    stage_stats *stage_stats;
    int max_conns_per_peer; /* open data connections from one address; 0 = TCP_MAX_PER_PEER */
} tcp_server_env;

typedef struct tcp_server tcp_server;

/* Listen on addrs[0] (its port, 0 = ephemeral; the bound one in *port) and
 * on addrs[1..n) with that same port.  A failure on addrs[0] fails the call;
 * on the others it is logged and ok[i] = 0 (ok may be NULL). */
int tcp_server_start(const net_addr *addrs, int naddrs, const tcp_server_env *env, tcp_server **out,
                     uint16_t *port, int *ok);
void tcp_server_stop(tcp_server *s);

/* Encode / decode the 24-byte request header (little-endian). */
void tcp_header_encode(uint8_t h[TCP_HEADER_LEN], uint64_t size, uint64_t addr, uint8_t opcode);
/* The data connection's proofs: HMAC-SHA256(secret, role label | cn | sn). */
int tcp_auth_mac(const char *secret, int server_role, const uint8_t *cn, const uint8_t *sn,
                 uint8_t *out);

void tcp_header_decode(const uint8_t h[TCP_HEADER_LEN], uint64_t *size, uint64_t *addr,
                       uint8_t *opcode);

#endif
