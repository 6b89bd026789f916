/*
 * discovery — prefill and decode instances found through etcd
 * (docs/scaling.md).  Three parts, all on base/etcd:
 *
 *  - the `--discovery etcd://host:port[,host:port...]/prefix` URL
 *    (etcds:// for TLS) and its options (TTL, TLS files, user/password);
 *  - the instance record: one JSON value per instance under the key
 *    PREFIX/instances/ROLE/HOST:PORT — role, URL, bootstrap address, model,
 *    engine id, KV layout and load (running and waiting requests, KV usage);
 *  - a registrar (serve, bootstrap): a thread that holds a lease of TTL
 *    seconds, puts the record under it when the instance is ready, keeps the
 *    lease alive, re-puts the record when its load changes (every
 *    update_s at most) and deletes it on a clean stop, so that a killed
 *    instance vanishes when its lease expires; and a watcher (proxy): a
 *    thread that ranges over PREFIX/instances/ and then watches it, keeping
 *    the current set, which the owner copies (a snapshot, with a generation
 *    number that changes with the set).  When etcd is unreachable the
 *    watcher keeps the last set and says so (connected 0), retrying every
 *    half second and ranging again once it answers.
 *
 * The record format is the contract between `disagg serve --discovery`
 * (src/cli/discovery_cli.c) and `disagg proxy --discovery`
 * (src/proxy/membership.c); docs/scaling.md documents it.
 */
#ifndef DISAGG_BASE_DISCOVERY_H
#define DISAGG_BASE_DISCOVERY_H

#include <stddef.h>
#include <stdint.h>

#define DISCOVERY_DEFAULT_PREFIX "/disagg"
#define DISCOVERY_TTL_DEFAULT    5.0 /* lease TTL, seconds */
#define DISCOVERY_TTL_MIN        1.0
#define DISCOVERY_TTL_MAX        3600.0
#define DISCOVERY_UPDATE_DEFAULT 0.25 /* load re-published at most this often, seconds */

typedef struct discovery_opts {
    char url[1100];        /* as given (logs) */
    char endpoints[1024];  /* "host:port[,host:port...]" */
    char prefix[256];      /* "/disagg": no trailing slash */
    int tls;               /* etcds:// */
    const char *ca_file;   /* --etcd-cacert */
    const char *cert_file; /* --etcd-cert */
    const char *key_file;  /* --etcd-key */
    const char *user;      /* --etcd-user */
    const char *password;  /* $DISAGG_ETCD_PASSWORD (or --etcd-password) */
    double ttl_s;          /* --discovery-ttl */
    double update_s;       /* load publication period */
    double timeout_s;      /* per etcd request (2) */
} discovery_opts;

void discovery_opts_default(discovery_opts *o);
/* "etcd://h:p[,h:p...][/prefix]" or "etcds://..." into o (endpoints,
 * prefix, tls).  -EINVAL with a message naming the bad part. */
int discovery_parse_url(const char *url, discovery_opts *o, char *err, size_t errcap);
/* A TTL in seconds as a flag value: a number in [1, 3600]. */
int discovery_parse_ttl(const char *v, double *out, char *err, size_t errcap);

/* ---- the instance record -------------------------------------------------------- */

typedef struct discovery_record {
    char role[16];       /* "prefill", "decode" or "bootstrap" */
    char url[300];       /* "http://host:port" of its API (bootstrap: of the server) */
    char bootstrap[300]; /* prefill: "http://host:port" of its bootstrap server */
    char model[256];     /* served model name */
    char engine_id[256]; /* its engine id(s), "" when not known */
    char kv_layout[256]; /* KV layout fingerprint: P and D pair only when equal */
    int running;         /* requests running */
    int waiting;         /* requests waiting */
    double kv_usage;     /* KV cache usage, 0..1 */
    long pid;            /* process id (diagnostics) */
    char hostname[128];  /* host name (diagnostics) */
} discovery_record;

/* The key of r under prefix ("PREFIX/instances/ROLE/HOST:PORT"). */
int discovery_record_key(const char *prefix, const discovery_record *r, char *out, size_t cap);
/* The JSON value (malloc'ed). */
char *discovery_record_json(const discovery_record *r);
/* Parses a value; -EINVAL with a message for a bad one (wrong role, no url). */
int discovery_record_parse(const char *txt, size_t len, discovery_record *r, char *err,
                           size_t errcap);
/* 1 when r's published address/identity differs from o's (a new instance
 * for the proxy), 0 when only the load or engine id changed. */
int discovery_record_same_instance(const discovery_record *a, const discovery_record *b);

/* ---- registrar (serve, bootstrap) ----------------------------------------------- */

/* Refreshes *r (load, engine id) before a publication.  0: publish r; > 0:
 * not ready yet (nothing published, or the record is kept as it is). */
typedef int (*discovery_refresh_fn)(void *arg, discovery_record *r);

typedef struct discovery_registrar discovery_registrar;

/* Connects (a lease grant: etcd must answer now), then runs the thread.
 * NULL-free on failure with a message in err. */
int discovery_registrar_start(const discovery_opts *o, const discovery_record *r,
                              discovery_refresh_fn fn, void *arg, discovery_registrar **out,
                              char *err, size_t errcap);
/* Stops the thread, deletes the key and revokes the lease. */
void discovery_registrar_stop(discovery_registrar *g);

/* ---- watcher (proxy) ------------------------------------------------------------ */

typedef struct discovery_instance {
    char key[512];        /* etcd key */
    discovery_record rec; /* its record */
} discovery_instance;

typedef struct discovery_status {
    int connected;        /* etcd answered the last request */
    uint64_t generation;  /* changes whenever the set changes */
    uint64_t events;      /* watch events applied */
    uint64_t errors;      /* failed etcd requests (each loss of contact counts) */
    uint64_t bad_records; /* values that were not a valid record (ignored) */
    int instances;        /* records in the set */
    char last_error[512]; /* why etcd was last unreachable, "" if never */
} discovery_status;

typedef struct discovery_watcher discovery_watcher;

/* Ranges once (etcd must answer now: the initial set), then watches on a
 * thread.  -errno with a message in err. */
int discovery_watcher_start(const discovery_opts *o, discovery_watcher **out, char *err,
                            size_t errcap);
void discovery_watcher_stop(discovery_watcher *w);
/* A copy of the current set: (*n) entries in *list (free()); returns the generation. */
uint64_t discovery_watcher_snapshot(discovery_watcher *w, discovery_instance **list, int *n);
void discovery_watcher_status(discovery_watcher *w, discovery_status *st);

#endif
