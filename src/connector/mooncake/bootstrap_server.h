/*
 * bootstrap_server — the Mooncake bootstrap HTTP server (PROTOCOL.md §2), the
 * registry through which decode instances find a prefill instance's
 * side-channel endpoints.  Same API as vLLM's MooncakeBootstrapServer:
 *
 *   POST /register {"engine_id","dp_rank","tp_rank","pp_rank","addr"}
 *        200 {"status":"ok"} (an identical repeat is also 200);
 *        400 {"detail": "..."} when addr is not tcp://HOST:PORT (HOST a hostname,
 *        IPv4 or [IPv6], PORT 1-65535), or the dp_rank belongs to another
 *        engine_id or that (dp,tp,pp) is registered at another address -- unless
 *        the side channels of those entries refuse connections, in which case
 *        they are replaced;
 *        422 {"detail": [{"type","loc","msg"}, ...]} (FastAPI's shape) for a
 *        body that is not JSON, not an object, or has missing/ill-typed fields.
 *   GET  /query -> {"<dp>": {"engine_id": "...", "worker_addr": {"<tp>": {"<pp>": "tcp://..."}}}}
 *
 * With a shared secret (docs/security.md) POST /register must carry
 *   X-Disagg-Auth: v1 ts=<unix seconds> mac=<64 hex digits>
 *   mac = HMAC-SHA256(secret, "disagg-bootstrap-register-v1\n" ts "\n" body)
 * with ts within BOOTSTRAP_AUTH_SKEW_S of the server's clock; without the
 * header the answer is 401, with a bad one 403, both {"detail": "..."} naming
 * the cause.  GET /query stays open (addresses only; the side channel they
 * name authenticates every pull).  Without a secret nothing changes.
 *
 * Liveness (vLLM's prefill registers once, at start, so there is no heartbeat
 * to expire entries by): every BOOTSTRAP_PROBE_INTERVAL_S
 * ($DISAGG_BOOTSTRAP_PROBE_INTERVAL seconds; 0 = no liveness checks at all,
 * neither these probes nor the replacement of dead conflicting entries
 * above) a thread TCP-connects
 * to each registered side channel; a worker whose address refused
 * BOOTSTRAP_PROBE_DROP probes in a row is dropped (logged).  Timeouts and
 * unreachable networks do not count: they may be this server's view only.
 *
 * base/http_server (the project's one HTTP/1.1 layer) on its own thread and
 * event_base, so a prefill instance can embed it (rank 0) and `disagg
 * bootstrap` can run it alone; stop() ends the loop from any thread and joins
 * it.  The table is guarded by a mutex so the embedding process may read it
 * directly.  The process must ignore SIGPIPE (bufferevents write with
 * writev): a client that disconnects early raises it.
 */
#ifndef DISAGG_CONNECTOR_MOONCAKE_BOOTSTRAP_SERVER_H
#define DISAGG_CONNECTOR_MOONCAKE_BOOTSTRAP_SERVER_H

#include <stddef.h>
#include <stdint.h>

#define BOOTSTRAP_MAX_BODY    65536 /* bytes of a /register body */
#define BOOTSTRAP_MAX_WORKERS 65536 /* registered (dp,tp,pp) entries */
#define BOOTSTRAP_MAX_STR     256   /* bytes of engine_id and addr */
/* What bootstrap_client's table parser accepts, so that the server never
 * serves a table its clients refuse: ranks 0..BOOTSTRAP_MAX_RANK, and per dp
 * rank a (max tp + 1) x (max pp + 1) grid of at most BOOTSTRAP_MAX_GRID. */
#define BOOTSTRAP_MAX_RANK    4096
#define BOOTSTRAP_MAX_GRID    65536
#define BOOTSTRAP_AUTH_HEADER "X-Disagg-Auth"
#define BOOTSTRAP_AUTH_LABEL  "disagg-bootstrap-register-v1"
#define BOOTSTRAP_AUTH_SKEW_S 300
#define BOOTSTRAP_PROBE_INTERVAL_S 2.0
#define BOOTSTRAP_PROBE_DROP       3

typedef struct bootstrap_server bootstrap_server; /* opaque */

/* Listen on host:port (host NULL = "0.0.0.0"; port 0 = ephemeral) and start the
 * server thread.  Returns 0, or -errno with a message in err (e.g. the port in
 * use).  */
int bootstrap_server_start(const char *host, uint16_t port, bootstrap_server **out, char *err,
                           size_t err_cap);
/* The same with the shared secret /register requires (NULL/"" = none). */
int bootstrap_server_start_auth(const char *host, uint16_t port, const char *secret,
                                bootstrap_server **out, char *err, size_t err_cap);
/* The default header deadline: a request head must be complete this long after
 * the connection was accepted, or after the previous response (keep-alive);
 * bytes do not extend it.  Past it: 408 and close (idle: just close). */
#define BOOTSTRAP_HEADER_TIMEOUT_S 10.0
/* bootstrap_server_start_auth with the header deadline given (seconds, > 0). */
int bootstrap_server_start_opts(const char *host, uint16_t port, const char *secret,
                                double header_timeout_s, bootstrap_server **out, char *err,
                                size_t err_cap);
/* /register requests refused for authentication (401 and 403). */
unsigned long bootstrap_server_auth_rejected(bootstrap_server *s);
/* Workers dropped because their side channel refused connections. */
unsigned long bootstrap_server_dropped(bootstrap_server *s);
/* The bound port (useful after port 0). */
uint16_t bootstrap_server_port(const bootstrap_server *s);
/* Stop the loop, join the thread, free everything.  NULL is a no-op. */
void bootstrap_server_stop(bootstrap_server *s);

/* The table as GET /query returns it (compact JSON, malloc'd; free()). */
char *bootstrap_server_query_json(bootstrap_server *s);
/* Number of (tp,pp) workers registered for dp_rank under engine_id (0 when the
 * dp_rank is unknown or belongs to another engine). */
int bootstrap_server_count_workers(bootstrap_server *s, int dp_rank, const char *engine_id);

#endif
