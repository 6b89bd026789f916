/*
 * side_channel — the ZeroMQ transport of the Mooncake side channel
 * (PROTOCOL.md §3), message bodies in side_channel_msg.h.
 *
 * Producer (P): a ROUTER socket on its own thread.  A decode worker's DEALER
 * sends ONE frame (a pull); the ROUTER sees [identity, pull].  Each decoded
 * pull is handed to a callback together with a reply handle; the callback (the
 * producer's logic) returns at once and replies later, from any thread, as
 * often as it likes: CONTINUE ... then FINISH or ERROR, which ends the pull and
 * releases the handle.  A pull that does not decode is answered ERROR by the
 * transport itself (with the decoder's message), so the peer never waits.
 *
 * Consumer (D): side_channel_pull_run() opens a DEALER, sends one pull and
 * reads single-frame replies until FINISH or ERROR, each within the receive
 * timeout (vLLM: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s).  A connection
 * that is refused (or whose connect times out, 10 s) before it was ever made
 * fails the pull at once (SIDE_CHANNEL_EREFUSED: the pull never left); one the
 * producer closes after connecting fails it too (SIDE_CHANNEL_EIO).
 *
 * The server numbers the connections it accepts (a socket monitor) and reports
 * one that closes to side_channel_gone_fn with that number, which
 * side_channel_call_conn gives for each of its pulls: a decoder that dies is
 * noticed.
 *
 * Authentication (docs/security.md): with a shared secret
 * every message gets a second ZeroMQ frame, the auth frame
 * (SIDE_CHANNEL_AUTH_LEN bytes):
 *   pull  D->P: "DKA1" 'P' ts_ms(u64 BE, wall clock) nonce(16) mac(32)
 *               mac = HMAC-SHA256(secret, "disagg-sc-pull-v1" ts nonce payload)
 *   reply P->D: "DKA1" 'R' seq(u64 BE, 0,1,2.. per pull) nonce(16, the pull's) mac(32)
 *               mac = HMAC-SHA256(secret, "disagg-sc-reply-v1" seq nonce payload)
 *   cancel D->P: "DKA1" 'C' ts_ms(u64 BE) nonce(16, the pull's) mac(32)
 *               mac = HMAC-SHA256(secret, "disagg-sc-cancel-v1" ts nonce payload)
 * Every reply is MAC'd, CONTINUE heartbeats and the FINISH that acknowledges
 * a cancel included (they continue the pull's sequence).  A producer with a
 * secret drops (answers ERROR, counts, logs rate-limited) any pull or cancel
 * without a valid frame, and one whose ts is more than
 * SIDE_CHANNEL_AUTH_SKEW_S off its clock; the frame's kind, not the payload,
 * says whether it is a pull or a cancel, and a cancel reaches only the pull
 * whose nonce it carries (on the same connection).  A consumer with a secret
 * accepts only replies MAC'd for its own pull, in sequence.  Without a secret on both
 * sides the wire is exactly vLLM's (one frame); a secret on one side only is
 * refused with a message naming the cause on both sides.
 */
#ifndef DISAGG_CONNECTOR_MOONCAKE_SIDE_CHANNEL_H
#define DISAGG_CONNECTOR_MOONCAKE_SIDE_CHANNEL_H

#include "connector/mooncake/side_channel_msg.h"

#include <stdatomic.h>
#include <stdint.h>

#define SIDE_CHANNEL_ETIMEDOUT (-110) /* no reply within the receive timeout */
#define SIDE_CHANNEL_ECLOSED   (-32)  /* the server stopped (EPIPE) */
#define SIDE_CHANNEL_ECANCELED (-125) /* the caller's cancel flag was raised */
#define SIDE_CHANNEL_EIO       (-5)   /* ZeroMQ failure */
#define SIDE_CHANNEL_EAUTH     (-13)  /* a reply failed authentication (EACCES) */
#define SIDE_CHANNEL_EREFUSED  (-111) /* nothing accepts at the endpoint: the pull never left */

/* Sockets of the process-wide ZeroMQ context (libzmq's default is 1,023):
 * a consumer pull holds three (its DEALER and its connection monitor's two),
 * so this covers 2 x 4096 pulls, the server and a margin. */
#define SIDE_CHANNEL_MAX_SOCKETS (3 * 2 * 4096 + 64)

#define SIDE_CHANNEL_AUTH_LEN    61 /* bytes of the auth frame */
#define SIDE_CHANNEL_AUTH_SKEW_S 60 /* accepted |pull ts - producer clock| */

typedef struct side_channel_server side_channel_server; /* opaque */
typedef struct side_channel_call side_channel_call;     /* one pull awaiting replies */

/* Called on the server thread for each decoded pull.  Takes ownership of pull
 * (heap-allocated; release with side_channel_pull_release) and of call
 * (released by its final reply).  Must not block. */
typedef void (*side_channel_pull_fn)(void *ud, side_channel_call *call, side_channel_pull *pull);

/* Bind a ROUTER on tcp://bind_host:port (port 0 = ephemeral; bind_host NULL/""
 * = all interfaces) and start the server thread.  Returns 0 or a negative code
 * with a message in err.  The _auth form takes the shared secret (NULL/"" =
 * none: vLLM's wire, unauthenticated). */
int side_channel_server_start(const char *bind_host, uint16_t port, side_channel_pull_fn fn,
                              void *ud, side_channel_server **out, char *err, size_t err_cap);
int side_channel_server_start_auth(const char *bind_host, uint16_t port, const char *secret,
                                   side_channel_pull_fn fn, void *ud, side_channel_server **out,
                                   char *err, size_t err_cap);
/* Pulls and cancels refused before reaching a handler because of
 * authentication (no or a bad auth frame, a stale timestamp, or an auth frame
 * with no secret here). */
uint64_t side_channel_server_auth_rejected(side_channel_server *s);
uint16_t side_channel_server_port(const side_channel_server *s);
/* Stop the thread and close the socket.  Calls still held by the handler stay
 * valid: replying to them returns SIDE_CHANNEL_ECLOSED (a final reply still
 * releases them). */
void side_channel_server_stop(side_channel_server *s);

/* Frees a pull handed to the handler: its contents and the struct. */
void side_channel_pull_release(side_channel_pull *pull);

/* Thread-safe.  Queue one reply to the pull behind call.  FINISH or ERROR is
 * the last: call is released and must not be used again. */
int side_channel_call_reply(side_channel_call *call, const side_channel_reply *r);

/* Called on the server thread for each decoded (and, with a secret,
 * authenticated) cancel (side_channel_msg.h); peer identifies its sender
 * opaquely: the DEALER's routing id and, with a secret, the nonce of the
 * pull it was MAC'd for.  See side_channel_call_peer_is.  Must not block.
 * Without a handler a cancel is answered ERROR. */
typedef void (*side_channel_cancel_fn)(void *ud, const void *peer, size_t peer_len,
                                       const side_channel_cancel *c);
/* Install the cancel handler (before pulls arrive; ud is the pull handler's). */
void side_channel_server_set_cancel_fn(side_channel_server *s, side_channel_cancel_fn fn);
/* 1 when call's pull came from peer (a cancel handler's: same DEALER and,
 * with a secret, the same authenticated pull). */
int side_channel_call_peer_is(const side_channel_call *call, const void *peer, size_t peer_len);

/* Called on the server thread when a decoder's connection closed (it
 * stopped, crashed or was killed): conn is what side_channel_call_conn
 * returns for the pulls that came on it; their replies can no longer reach
 * anyone.  Must not block. */
typedef void (*side_channel_gone_fn)(void *ud, uint64_t conn);
void side_channel_server_set_gone_fn(side_channel_server *s, side_channel_gone_fn fn);
/* The number of the connection call's pull came on (0 = not known). */
uint64_t side_channel_call_conn(const side_channel_call *call);

/* Number of pulls handed to the handler and not yet finished (for metrics). */
int side_channel_server_pending(side_channel_server *s);

/* Called for each reply of a pull (its memory is valid only during the call);
 * return non-zero to stop waiting. */
typedef int (*side_channel_reply_fn)(void *ud, const side_channel_reply *r);

/* Consumer: send pull to endpoint ("tcp://host:port") and deliver replies to fn
 * until FINISH or ERROR.  Each reply must arrive within recv_timeout_s.  cancel
 * (optional) is polled every 100 ms.  Returns 0 once a FINISH or ERROR reply
 * was delivered (or fn asked to stop), else SIDE_CHANNEL_ETIMEDOUT,
 * SIDE_CHANNEL_ECANCELED, SIDE_CHANNEL_EINVAL (undecodable reply),
 * SIDE_CHANNEL_EREFUSED (nothing accepts at endpoint) or SIDE_CHANNEL_EIO, with a
 * message naming the endpoint in err. */
int side_channel_pull_run(const char *endpoint, const side_channel_pull *pull,
                          double recv_timeout_s, const atomic_int *cancel, side_channel_reply_fn fn,
                          void *ud, char *err, size_t err_cap);
/* The same with the shared secret (NULL/"" = none).  With one, a reply that
 * is not authenticated for this pull ends it with SIDE_CHANNEL_EAUTH and a
 * message naming the cause (and the producer's own words when it refused). */
int side_channel_pull_run_auth(const char *endpoint, const side_channel_pull *pull,
                               const char *secret, double recv_timeout_s, const atomic_int *cancel,
                               side_channel_reply_fn fn, void *ud, char *err, size_t err_cap);

/* A pull that ended on the producer's final reply leaves its connection (a DEALER) open
 * for the next pull to the same endpoint, which then skips the connection's set-up; idle
 * ones are closed after 30 s, when the producer closes them, or beyond 32 kept.  How many
 * are kept idle for endpoint now. */
int side_channel_idle_pull_connections(const char *endpoint);

/* Values of the cancel flag for side_channel_pull_run_ex. */
#define SIDE_CHANNEL_CANCEL_ASK  1 /* tell the producer and wait for its acknowledgement */
#define SIDE_CHANNEL_CANCEL_DROP 2 /* just stop (the producer is unreachable) */

/* side_channel_pull_run_auth, and when *cancel becomes
 * SIDE_CHANNEL_CANCEL_ASK: sends a cancel for the pull's requests on the same
 * connection (with a secret, with its own auth frame) and waits up to
 * ack_timeout_s for the producer's final FINISH (with a secret, authenticated
 * in the pull's sequence); *acked = 1 when it came (no write into the pull's
 * blocks can happen any more), else 0 (no answer, an ERROR — a peer that does
 * not know the message, or refused it —, an unauthenticated answer, or a
 * disconnect).  Returns SIDE_CHANNEL_ECANCELED after a cancel either way. */
int side_channel_pull_run_ex(const char *endpoint, const side_channel_pull *pull,
                             const char *secret, double recv_timeout_s, const atomic_int *cancel,
                             double ack_timeout_s, int *acked, side_channel_reply_fn fn, void *ud,
                             char *err, size_t err_cap);

#endif
