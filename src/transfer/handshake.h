/*
 * handshake — the engine's RPC port (the port in its segment name): frames
 * `u64 length (LE) | u8 type | JSON`, one connection per message, as
 * Mooncake's P2P handshake (docs/transfer.md).  The server answers metadata
 * (type 1) with this engine's descriptor and probes (type 3) with ok; the
 * client fetches a peer's descriptor.  Malformed frames get an error frame or
 * a closed connection, never a crash.
 */
#ifndef DISAGG_TRANSFER_HANDSHAKE_H
#define DISAGG_TRANSFER_HANDSHAKE_H

#include "base/net.h"
#include "transfer/segment_desc.h"

#include <stddef.h>
#include <stdint.h>

#define HANDSHAKE_TYPE_CONNECT  0
#define HANDSHAKE_TYPE_METADATA 1
#define HANDSHAKE_TYPE_NOTIFY   2
#define HANDSHAKE_TYPE_PROBE    3
#define HANDSHAKE_MAX_FRAME     (1u << 20)
#define HANDSHAKE_HEADER_LEN    9

typedef struct handshake_server handshake_server;

/* describe(ctx) returns this engine's descriptor as malloc'd JSON. */
typedef char *(*handshake_describe_fn)(void *ctx);

/* bound(ctx, port) learns the bound port before the first client is served. */
typedef void (*handshake_bound_fn)(void *ctx, uint16_t port);

/* Listen on addr (port 0 = ephemeral) and serve on a thread. */
int handshake_server_start(const net_addr *addr, handshake_describe_fn describe,
                           handshake_bound_fn bound, void *ctx, handshake_server **out);
void handshake_server_stop(handshake_server *s);

/* Encode a frame header; validate one (0, or TRANSFER_EPROTO if the length is
 * over HANDSHAKE_MAX_FRAME). */
void handshake_header_encode(uint8_t hdr[HANDSHAKE_HEADER_LEN], uint64_t len, uint8_t type);
int handshake_header_decode(const uint8_t hdr[HANDSHAKE_HEADER_LEN], uint64_t *len, uint8_t *type);

/* Send my descriptor (JSON) to the peer's RPC address and read its descriptor. */
int handshake_fetch(const net_addr *peer, const char *my_json, uint64_t deadline_ns,
                    segment_desc *out, char *err, size_t cap);

#endif
