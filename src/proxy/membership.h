/*
 * membership — the proxy's upstreams from etcd (`disagg proxy --discovery`): base/discovery's watcher keeps the set of registered instances
 * on its thread; a 100 ms timer on the proxy loop compares the set's
 * generation and, when it changed, reconciles the upstream slots with it: a
 * new key takes a free slot (upstream_init, then an immediate probe, so it
 * serves within a probe's time), a changed one updates its published load
 * (a new engine id — a restart on the same address — re-reads its engine
 * table), and a key that is gone (a clean stop, or the lease of a killed
 * instance expired) retires its slot: no new request goes there, and the
 * slot is freed once no request is outstanding on it (relays hold pointers
 * to their upstreams).  P and D carry a group "MODEL|KV_LAYOUT" and pair only
 * within one.  When etcd is unreachable the set stays as it was: routing
 * goes on with the last known instances, /metrics says so
 * (disagg_proxy_discovery_connected 0) and the watcher reconnects.
 */
#ifndef DISAGG_PROXY_MEMBERSHIP_H
#define DISAGG_PROXY_MEMBERSHIP_H

#include "base/prom.h"

#include <stddef.h>

struct proxy;

/* Reads the initial set (etcd must answer) and starts watching. */
int membership_start(struct proxy *px, char *err, size_t errcap);
void membership_stop(struct proxy *px);
/* The disagg_proxy_discovery_* series (nothing without --discovery). */
void membership_write_metrics(struct proxy *px, prom *o);
/* "; discovery: ..." for a 503 when no instance is known (nothing without). */
void membership_describe(const struct proxy *px, char *out, size_t cap);

#endif
