/*
 * discovery_cli — the etcd discovery flags shared by `disagg serve`,
 * `disagg bootstrap` and `disagg proxy` (--discovery, --discovery-ttl,
 * --discovery-advertise, --etcd-user, --etcd-cacert, --etcd-cert,
 * --etcd-key; the password from $DISAGG_ETCD_PASSWORD), and the
 * registration of a serve or bootstrap process (base/discovery's registrar
 * fed with the instance's own /health until it first answers, its engine's
 * counters and its bootstrap /query).
 */
#ifndef DISAGG_CLI_DISCOVERY_CLI_H
#define DISAGG_CLI_DISCOVERY_CLI_H

#include "base/discovery.h"
#include "base/flags.h"
#include "engine/engine.h"

#include <stdio.h>

#define DISCOVERY_PASSWORD_ENV "DISAGG_ETCD_PASSWORD"

typedef struct discovery_cli {
    discovery_opts o;      /* parsed options */
    int set;               /* --discovery given */
    const char *advertise; /* --discovery-advertise, or NULL */
} discovery_cli;

void discovery_cli_init(discovery_cli *d);
/* The flags as rows of a base/flags table (with_advertise: serve and bootstrap also have
 * --discovery-ttl and --discovery-advertise), ended by {0}; each applies to d. */
#define DISCOVERY_CLI_NFLAGS 7
void discovery_cli_flags(discovery_cli *d, int with_advertise,
                         flag_def out[DISCOVERY_CLI_NFLAGS + 1]);
/* Applies flag = val; -1 after printing "disagg CMD: ..." on a bad value. */
int discovery_cli_flag(const char *cmd, discovery_cli *d, const char *flag, const char *val);
/* After the flags: the password from the environment, consistency checks. */
int discovery_cli_finish(const char *cmd, discovery_cli *d);
/* The address others reach this process at: --discovery-advertise, else
 * $VLLM_HOST_IP, else listen_host unless it is a wildcard, else the host name. */
void discovery_cli_advertise(const discovery_cli *d, const char *listen_host, char *out,
                             size_t cap);

/* ---- serve ---------------------------------------------------------------------- */

typedef struct serve_registration serve_registration;

typedef struct serve_identity {
    const char *listen_host;        /* --host */
    int port;                       /* --port */
    const char *model_name;         /* served model name */
    const char *model_dir;          /* model directory or hub name (for the KV layout) */
    int block_size;                 /* --block-size (0 = 16) */
    const char *kv_dtype;           /* --kv-cache-dtype name, "auto" */
    const char *kv_transfer_config; /* the JSON (role, bootstrap address) */
} serve_identity;

/* Registers (a lease now; the record once /health answers 200).  On
 * failure prints "disagg serve: ..." and returns the exit status: 2 for a
 * usage error, 1 when etcd cannot be reached. */
int serve_registration_start(discovery_cli *d, const serve_identity *id, serve_registration **out);
void serve_registration_stop(serve_registration *r);
/* server_config.on_engine (arg: the serve_registration): the engine whose counters
 * (engine_get_stats) give the published load and the drain's "idle"; NULL before the engine
 * is destroyed.  Thread-safe. */
void serve_registration_set_engine(void *arg, engine *e);

/* ---- bootstrap ------------------------------------------------------------------ */

/* Registers a standalone bootstrap server (role "bootstrap") at host:port. */
int bootstrap_registration_start(discovery_cli *d, const char *listen_host, unsigned port,
                                 discovery_registrar **out);

#endif
