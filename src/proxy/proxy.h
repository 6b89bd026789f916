/*
 * proxy — `disagg proxy`, the P/D router (PROTOCOL.md §1): configuration,
 * the HTTP front end on one libevent loop (routes /v1/completions,
 * /v1/chat/completions, /v1/models, /health, /metrics), the upstreams of both
 * roles with their periodic health probes, and the Prometheus metrics.  The
 * per-request P/D dispatch and relay live in relay.c.
 */
#ifndef DISAGG_PROXY_PROXY_H
#define DISAGG_PROXY_PROXY_H

#include "base/discovery.h"
#include "proxy/kv_route.h"
#include "proxy/policy.h"

#include <stddef.h>
#include <stdint.h>

struct event_base;

typedef struct proxy_upstream {
    const char *url;       /* "http://host:port" */
    const char *bootstrap; /* prefill only: NULL, "PORT", "host:port" or "http://host:port" */
} proxy_upstream;

typedef struct proxy_config {
    const char *host;        /* listen address (127.0.0.1) */
    uint16_t port;           /* listen port (8000; 0 = ephemeral) */
    proxy_upstream *prefill; /* (nprefill) prefill instances */
    int nprefill;            /* 1..POLICY_MAX_BACKENDS (0 with discovery) */
    proxy_upstream *decode;  /* (ndecode) decode instances */
    int ndecode;             /* 1..POLICY_MAX_BACKENDS (0 with discovery) */
    policy_kind policy;      /* upstream choice */
    const char
        *api_key; /* sent upstream as "Authorization: Bearer KEY"; NULL passes the client's */
    size_t max_body_bytes;     /* client request body cap (16 MiB) */
    int max_headers;           /* client request header count cap (100) */
    size_t max_head_bytes;     /* client request head bytes cap (64 KiB) */
    double connect_timeout_s;  /* upstream TCP connect (5) */
    double upstream_timeout_s; /* longest upstream silence while waiting for bytes (600) */
    double health_interval_s;  /* probe period (1) */
    double client_timeout_s;   /* to receive a client's whole request, from its first byte (60) */
    double client_header_timeout_s; /* to receive a request head, from its first byte (60) */
    double keepalive_timeout_s;     /* client connection idle between requests (75) */
    double upstream_keepalive_s;    /* pooled upstream connection idle before close (4) */
    double shutdown_timeout_s; /* on SIGTERM/SIGINT, wait this long for requests in flight (30) */
    int quiet;                 /* no start-up banner on stderr */
    const discovery_opts *discovery; /* --discovery: instances from etcd (NULL: none) */
    int prefix_bytes;                /* --policy prefix: prompt bytes hashed (256) */
    const kv_route_config *kv;       /* --policy kv_aware: its settings (NULL otherwise) */
} proxy_config;

typedef struct proxy proxy;

void proxy_config_default(proxy_config *c);
/* Validates cfg, binds the listen socket, starts probing.  NULL with err set. */
proxy *proxy_new(struct event_base *base, const proxy_config *cfg, char *err, size_t errcap);
void proxy_free(proxy *p);
uint16_t proxy_port(const proxy *p);
/* 1 once at least one prefill (engine table known) and one decode are ready. */
int proxy_ready(const proxy *p);
/* A libevent loop set up for the proxy (epoll change-list: adding and
 * removing write interest within one loop iteration costs no epoll_ctl). */
struct event_base *proxy_event_base_new(void);
/* Stops accepting, answers 503 to new requests on open connections, and
 * ends the loop once no request is in flight or after shutdown_timeout_s. */
void proxy_drain(proxy *p);
/* Runs a proxy until SIGINT/SIGTERM (drains; a second signal stops at
 * once); returns the exit status. */
int proxy_run(const proxy_config *cfg);

#endif
