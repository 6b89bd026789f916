/*
 * kv_subscriber — the proxy's subscription to one instance's KV events
 * (vLLM's ZmqEventPublisher, docs/kv_pool.md): a ZMQ SUB socket on the proxy's
 * libevent loop (through ZMQ_FD, drained on every wake) receiving
 * [topic, seq (8 bytes big-endian), KVEventBatch] and applying each batch to the
 * instance's kv_index in sequence order.
 *   - A gap (a seq beyond the next expected one, or a first seq other than 0)
 *     asks the instance's replay ROUTER, when one is configured, for the batches
 *     from the next expected seq (a DEALER sends [empty, seq]; the answer is
 *     [empty, seq, payload]... then [empty, -1, empty]); the SUB socket is not
 *     read meanwhile (it queues), and batches the replay already applied are
 *     skipped after it.  A replay that cannot fill the gap (no replay endpoint,
 *     the buffer moved on, no answer within the deadline) drops the instance's
 *     index and goes on from the batch that showed the gap.
 *   - A seq lower than the last one applied (the instance restarted and counts
 *     from 0 again) drops the index first.
 * The connection itself is ZMQ's: connect is asynchronous and reconnects by itself, so
 * an instance that is not up yet or restarts needs nothing here.
 */
#ifndef DISAGG_PROXY_KV_SUBSCRIBER_H
#define DISAGG_PROXY_KV_SUBSCRIBER_H

#include "proxy/kv_index.h"

#include <stddef.h>
#include <stdint.h>

struct event_base;

typedef struct kv_subscriber_opts {
    const char *endpoint;        /* the instance's PUB endpoint, tcp://HOST:PORT (connected) */
    const char *replay_endpoint; /* its replay ROUTER, or NULL / "" for none */
    const char *topic;           /* subscription prefix ("" = every message) */
    double replay_timeout_s;     /* one replay's deadline */
} kv_subscriber_opts;

typedef struct kv_subscriber_stats {
    uint64_t batches;       /* batches applied (live and replayed) */
    uint64_t gaps;          /* gaps in seq seen */
    uint64_t replays;       /* replays that filled their gap */
    uint64_t replay_failed; /* gaps not filled: the index was dropped */
    uint64_t restarts;      /* seq went backwards, or the instance's engine changed */
    uint64_t bad;           /* messages or batches that could not be read */
    int64_t last_seq;       /* last seq applied (-1: none) */
} kv_subscriber_stats;

typedef struct kv_subscriber kv_subscriber;

/* Connects a SUB socket of zctx to o->endpoint for the instance called label (its URL, for
 * logs), feeding idx.  NULL with err naming the bad endpoint. */
kv_subscriber *kv_subscriber_new(struct event_base *base, void *zctx, const char *label,
                                 const kv_subscriber_opts *o, kv_index *idx, char *err,
                                 size_t errcap);
void kv_subscriber_free(kv_subscriber *s);
/* The instance restarted (why, for the log): its index is dropped and its seq forgotten. */
void kv_subscriber_reset(kv_subscriber *s, const char *why);
void kv_subscriber_get_stats(const kv_subscriber *s, kv_subscriber_stats *out);

#endif
