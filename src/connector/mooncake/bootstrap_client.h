/*
 * bootstrap_client — the client side of the bootstrap HTTP API (PROTOCOL.md §2):
 * a prefill worker registers its side-channel endpoint (POST /register); a
 * decode worker or the proxy reads the table (GET /query) to learn
 * dp_rank -> engine_id and worker_addr[tp][pp].  libcurl, blocking, one handle
 * per call.
 *
 * Retries as vLLM's MooncakeConnector does: each attempt has a timeout
 * (VLLM_MOONCAKE_CONNECTOR_TIMEOUT), up to 3 attempts, backoff 1 s then 2 s
 * (doubling, capped at 10 s); connection errors and timeouts are retried, an
 * HTTP error answer is not; then a clear error — never a hang.  The backoff
 * sleep is injectable for tests.
 */
#ifndef DISAGG_CONNECTOR_MOONCAKE_BOOTSTRAP_CLIENT_H
#define DISAGG_CONNECTOR_MOONCAKE_BOOTSTRAP_CLIENT_H

#include <stddef.h>

#define BOOTSTRAP_EINVAL (-22) /* bad argument or malformed answer */
#define BOOTSTRAP_EHTTP  (-71) /* the server answered with an HTTP error (EPROTO) */
#define BOOTSTRAP_EUNREACH                                                                         \
    (-113) /* every attempt failed to connect or timed out (EHOSTUNREACH)                          \
            */
#define BOOTSTRAP_ENOMEM (-12)
#define BOOTSTRAP_EAUTH  (-13) /* the server refused our authentication (401/403) */

typedef struct bootstrap_retry {
    int attempts;         /* total attempts, >= 1 (default 3) */
    double timeout_s;     /* per attempt (default VLLM_MOONCAKE_CONNECTOR_TIMEOUT, 30) */
    double backoff_s;     /* sleep after the first failed attempt (default 1) */
    double backoff_max_s; /* cap of the doubling backoff (default 10) */
    void (*sleep_fn)(double seconds, void *ud); /* NULL = real sleep */
    void *sleep_ud;                             /* passed to sleep_fn */
} bootstrap_retry;

/* Defaults above with the given per-attempt timeout. */
void bootstrap_retry_init(bootstrap_retry *r, double timeout_s);

typedef struct bootstrap_registration {
    const char *engine_id; /* this instance's engine id */
    int dp_rank, tp_rank, pp_rank;
    const char *addr; /* side-channel endpoint, "tcp://ip:port" */
} bootstrap_registration;

/* server: "host:port", "[v6]:port" or "http://host:port".  Returns 0, or one of
 * the codes above with a message in err naming the server and the cause. */
int bootstrap_client_register(const char *server, const bootstrap_registration *reg,
                              const bootstrap_retry *retry, char *err, size_t err_cap);
/* The same, authenticated with the shared secret (NULL/"" = none): each
 * attempt carries a fresh X-Disagg-Auth header (bootstrap_server.h).  A 401
 * or 403 answer is BOOTSTRAP_EAUTH, with the server's reason in err. */
int bootstrap_client_register_auth(const char *server, const bootstrap_registration *reg,
                                   const char *secret, const bootstrap_retry *retry, char *err,
                                   size_t err_cap);
/* The X-Disagg-Auth header line ("X-Disagg-Auth: v1 ts=... mac=...") for body
 * at unix time ts, into out (exposed for tests).  Returns 0 or BOOTSTRAP_EINVAL. */
int bootstrap_auth_header(const char *secret, long long ts, const char *body, size_t len, char *out,
                          size_t cap);

/* One data-parallel rank of the table. */
typedef struct bootstrap_engine {
    int dp_rank;
    char *engine_id;
    int tp_size; /* max tp_rank + 1 (D infers P's TP size from it) */
    int pp_size; /* max pp_rank + 1 */
    char **addr; /* (tp_size, pp_size) addr[tp * pp_size + pp]; NULL where unregistered */
} bootstrap_engine;

typedef struct bootstrap_table {
    bootstrap_engine *engines; /* (n) sorted by dp_rank */
    size_t n;
} bootstrap_table;

int bootstrap_client_query(const char *server, const bootstrap_retry *retry, bootstrap_table *out,
                           char *err, size_t err_cap);
/* Parse a GET /query body (exposed for tests).  Ranks above 4096 are rejected. */
int bootstrap_table_parse(const char *json, size_t len, bootstrap_table *out, char *err,
                          size_t err_cap);
const bootstrap_engine *bootstrap_table_find(const bootstrap_table *t, int dp_rank);
/* Address of (tp, pp), NULL when absent. */
const char *bootstrap_engine_addr(const bootstrap_engine *e, int tp_rank, int pp_rank);
void bootstrap_table_free(bootstrap_table *t);

#endif
