/*
 * etcd — a small blocking client for etcd v3 through its HTTP/JSON gateway
 * (POST /v3/kv/range, /v3/kv/put, /v3/kv/deleterange, /v3/lease/grant,
 * /v3/lease/keepalive, /v3/lease/revoke, /v3/watch, /v3/auth/authenticate),
 * on libcurl and jansson: no gRPC stack.  Keys and values travel base64 as
 * the gateway wants; int64 fields are read whether the gateway writes them
 * as strings or numbers.
 *
 * One client = one curl handle: use it from one thread at a time (the
 * registrar and the watcher of discovery.c each own theirs).  A client knows
 * several endpoints of one cluster and fails over: a request that cannot
 * connect, times out or hits a member without a leader is sent to the next
 * endpoint, and the one that answered is used first from then on.  TLS
 * (https endpoints, CA/cert/key files) and user/password auth (a token from
 * /v3/auth/authenticate, renewed once when etcd says it is invalid) are
 * options.  Every failure returns a negative errno and leaves a message in
 * etcd_client_error(); the caller decides what to log.
 */
#ifndef DISAGG_BASE_ETCD_H
#define DISAGG_BASE_ETCD_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define ETCD_MAX_ENDPOINTS 16

typedef struct etcd_options {
    const char *endpoints; /* "host:port[,host:port...]" (required) */
    int tls;               /* 1: https to every endpoint */
    const char *ca_file;   /* TLS: CA bundle (PEM) to verify the members; NULL = system */
    const char *cert_file; /* TLS client certificate (PEM), or NULL */
    const char *key_file;  /* its key (PEM), or NULL */
    const char *user;      /* etcd auth user, or NULL for no auth */
    const char *password;  /* its password */
    double timeout_s;      /* per request and per endpoint (connect included); 0 = 2 s */
} etcd_options;

typedef struct etcd_kv {
    char *key;            /* NUL-terminated */
    char *value;          /* (value_len) bytes, NUL-terminated too */
    size_t value_len;     /* bytes of value */
    int64_t mod_revision; /* revision of its last change */
    int64_t lease;        /* lease id, 0 if none */
} etcd_kv;

typedef struct etcd_client etcd_client;

/* Parses o->endpoints and prepares the handle (nothing is sent yet).
 * -EINVAL with a message in err for a bad endpoint list. */
int etcd_client_new(const etcd_options *o, etcd_client **out, char *err, size_t errcap);
void etcd_client_free(etcd_client *c);
/* Makes every request return -ECANCELED soon after *flag becomes nonzero
 * (a blocked watch included).  NULL clears it. */
void etcd_client_set_abort(etcd_client *c, atomic_int *flag);
/* Message of the last failure. */
const char *etcd_client_error(const etcd_client *c);
/* "host:port" of the endpoint that answered last (the first one before). */
const char *etcd_client_endpoint(const etcd_client *c);

/* A lease of ttl_s seconds (1..): *id. */
int etcd_lease_grant(etcd_client *c, int64_t ttl_s, int64_t *id);
/* Renews lease id; *ttl_left (may be NULL) is the TTL etcd granted again.
 * -ENOENT when the lease expired or is unknown. */
int etcd_lease_keepalive(etcd_client *c, int64_t id, int64_t *ttl_left);
/* Revokes lease id (deleting its keys).  -ENOENT if unknown. */
int etcd_lease_revoke(etcd_client *c, int64_t id);
/* key = value (len bytes), attached to lease (0: none). */
int etcd_put(etcd_client *c, const char *key, const char *value, size_t len, int64_t lease);
/* Deletes key, or every key under it when prefix is 1; *deleted may be NULL. */
int etcd_delete(etcd_client *c, const char *key, int prefix, int64_t *deleted);
/* Every key under prefix: (*n) entries in *kvs (free with etcd_kvs_free) and
 * the store revision of the answer in *revision (may be NULL). */
int etcd_range_prefix(etcd_client *c, const char *prefix, etcd_kv **kvs, int *n, int64_t *revision);
void etcd_kvs_free(etcd_kv *kvs, int n);

/* Called once per watch event: is_delete 0 for a put.  Nonzero stops the
 * watch (etcd_watch_prefix returns -ECANCELED). */
typedef int (*etcd_watch_fn)(void *arg, int is_delete, const etcd_kv *kv);
/* Watches every key under prefix from revision start_rev (> 0) for at most
 * max_s seconds, calling fn per event; *next_rev is where the next watch
 * resumes (unchanged when nothing came).  Returns 0 when max_s ran out with
 * the stream healthy, -ERANGE when start_rev was compacted (range again),
 * -ECANCELED (fn or the abort flag), or another negative errno when no
 * endpoint could be watched. */
int etcd_watch_prefix(etcd_client *c, const char *prefix, int64_t start_rev, double max_s,
                      etcd_watch_fn fn, void *arg, int64_t *next_rev);

/* The end of the key range "every key starting with prefix" (etcd's
 * range_end): prefix with its last byte incremented; out needs strlen+1. */
void etcd_prefix_end(const char *prefix, char *out);

#endif
