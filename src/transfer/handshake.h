/*
 * handshake — the engine's RPC port (the port in its segment name), framed as
 * Mooncake's P2P handshake (SocketHandShakePlugin, docs/transfer.md):
 * `u64 length (LE) | u8 type | JSON`, where length counts the type byte and
 * the JSON; a first byte above 3 is Mooncake's old, untyped frame.  One
 * request per connection: the server answers metadata (type 1) with this
 * engine's descriptor and probes (type 3) with {"status":"success"}, then
 * shuts down its side.  The client fetches a peer's descriptor.
 *
 * With a shared secret (docs/transfer.md, Security) a metadata exchange is a
 * challenge-response on the same connection: client nonce -> server nonce +
 * server proof -> client proof -> descriptor; each proof is HMAC-SHA256 over
 * a role label, both nonces and both segment names (base/auth.h).  A peer
 * without the secret, or with another one, gets an {"error": ...} frame and
 * no descriptor.  Malformed frames get an error frame or a closed
 * connection, never a crash.
 */
#ifndef DISAGG_TRANSFER_HANDSHAKE_H
#define DISAGG_TRANSFER_HANDSHAKE_H

#include "base/net.h"
#include "transfer/segment_desc.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define HANDSHAKE_TYPE_CONNECT  0
#define HANDSHAKE_TYPE_METADATA 1
#define HANDSHAKE_TYPE_NOTIFY   2
#define HANDSHAKE_TYPE_PROBE    3
#define HANDSHAKE_TYPE_OLD      0xff       /* Mooncake's untyped frame (first byte > 3) */
#define HANDSHAKE_MAX_FRAME     (1u << 20) /* Mooncake's default MC_HANDSHAKE_MAX_LENGTH */
#define HANDSHAKE_HEADER_LEN    9

typedef struct handshake_server handshake_server;

/* describe(ctx) returns this engine's descriptor as malloc'd JSON. */
typedef char *(*handshake_describe_fn)(void *ctx);

/* bound(ctx, port) learns the bound port before the first client is served. */
typedef void (*handshake_bound_fn)(void *ctx, uint16_t port);

typedef struct handshake_server_cfg {
    handshake_describe_fn describe;
    handshake_bound_fn bound;
    void *ctx;
    /* This engine's segment name (filled by bound() before any client is
     * served) and the shared secret (NULL = no authentication). */
    const char *self_name;
    const char *secret;
    _Atomic uint64_t *auth_refused; /* stats: handshakes refused (may be NULL) */
    /* Mooncake's type-0 frame (the rdma transport's queue-pair exchange):
     * request body in, reply JSON out (malloc'd), or NULL with err filled.
     * NULL connect = not offered (the frame gets an error). */
    char *(*connect)(void *ctx, const char *body, size_t len, char *err, size_t cap);
} handshake_server_cfg;

/* Listen on addr (port 0 = ephemeral) and serve on a thread. */
int handshake_server_start(const net_addr *addr, const handshake_server_cfg *cfg,
                           handshake_server **out);
void handshake_server_stop(handshake_server *s);

/* Encode a frame header for a body of body_len bytes (the length field is
 * body_len + 1: it counts the type byte).  Decode one: 0, or TRANSFER_EPROTO
 * when the length is 0 or over HANDSHAKE_MAX_FRAME.  *body_len excludes the
 * type byte; for an old (untyped) frame, hdr[8] is the body's first byte,
 * *type is HANDSHAKE_TYPE_OLD and *body_len is the whole length. */
void handshake_header_encode(uint8_t hdr[HANDSHAKE_HEADER_LEN], uint64_t body_len, uint8_t type);
int handshake_header_decode(const uint8_t hdr[HANDSHAKE_HEADER_LEN], uint64_t *body_len,
                            uint8_t *type);

/* Fetch the descriptor of the peer at `peer` (opened as peer_name) while
 * sending my_json; with a secret, authenticate both ways first (self_name is
 * this engine's segment name).  TRANSFER_EAUTH when authentication fails or
 * the peer refused it; err names the reason. */
int handshake_fetch(const net_addr *peer, const char *peer_name, const char *self_name,
                    const char *my_json, const char *secret, uint64_t deadline_ns,
                    segment_desc *out, char *err, size_t cap);

/* Send a type-0 (connect) frame with body to the peer's handshake port and
 * read its answer (malloc'd in *reply).  TRANSFER_EPROTO with err filled
 * when the peer answers an error (its reply_msg / error).  With a secret
 * (non-empty), the connection first runs the metadata challenge-response
 * (steps 1-3, step 1 saying "then":"connect"), the server answers
 * {"disagg_auth":{"ok":true}} instead of its descriptor, and only then is
 * the type-0 frame sent on that same, authenticated connection
 * (TRANSFER_EAUTH when either side's proof fails). */
int handshake_connect(const net_addr *peer, const char *peer_name, const char *self_name,
                      const char *secret, const char *body, uint64_t deadline_ns, char **reply,
                      size_t *reply_len, char *err, size_t cap);

#endif
