/*
 * kv_events_publisher — `--kv-events-config` (vLLM's KVEventsConfig JSON) and
 * vLLM's ZmqEventPublisher: every engine step's KV cache events
 * (engine/kv_events.h) become one KVEventBatch, msgpack-encoded as msgspec
 * encodes vLLM's array_like structs, and go out on a ZMQ PUB socket as the
 * multipart message [topic, seq (8 bytes big-endian), payload]; the last
 * buffer_steps batches stay for the replay ROUTER socket: a client sends
 * [empty, start seq (big-endian)], gets [empty, seq, payload] for every
 * buffered batch from that seq, then [empty, -1 (8 bytes), empty].
 * Encoding (docs/kv_pool.md):
 *   batch        [ts (float64 seconds), [event...], data_parallel_rank (0)]
 *   BlockStored  ["BlockStored", [hash...], parent hash | nil, [token...], block_size,
 *                 lora_id nil, medium, lora_name nil]
 *   BlockRemoved ["BlockRemoved", [hash...], medium]
 *   AllBlocksCleared ["AllBlocksCleared"]
 * With $DISAGG_KV_EVENTS_FORMAT=map each event is instead a map tagged by "type"
 * ({"type": "BlockStored", "block_hashes": ..., ...}: the same fields by name), as vLLM
 * encodes them since 0.26; the batch stays positional.
 * Hashes are the prefix cache's 64-bit block hashes (msgpack unsigned ints).
 * Encoding runs on the engine thread; one publisher thread owns the sockets.
 */
#ifndef DISAGG_CONNECTOR_KV_EVENTS_PUBLISHER_H
#define DISAGG_CONNECTOR_KV_EVENTS_PUBLISHER_H

#include "engine/kv_events.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kv_events_config {
    int enabled;           /* enable_kv_cache_events and publisher "zmq" */
    int enable_kv_cache_events;
    char publisher[8];     /* "null" or "zmq" (default: zmq when enabled, else null) */
    char endpoint[256];    /* PUB endpoint (default: tcp on every interface, port 5557):
                              bound when it holds a '*' or '::' or is ipc or inproc,
                              else connected (vLLM's rule) */
    char replay_endpoint[256]; /* ROUTER endpoint, "" = no replay */
    int buffer_steps;      /* batches kept for replay (10000) */
    int hwm;               /* PUB send high-water mark (100000) */
    int max_queue_size;    /* batches waiting for the publisher thread (100000) */
    char topic[128];       /* first frame of every message ("") */
    int map_events;        /* $DISAGG_KV_EVENTS_FORMAT=map: events as tagged maps (vLLM >= 0.26,
                              vllm-project/vllm#42892); "array" (default): positional arrays */
} kv_events_config;

/* Parse the JSON; 0, or -22 with err naming the key, the bad value and what is accepted. */
int kv_events_config_parse(const char *json, kv_events_config *out, char *err, size_t errlen);

typedef struct kv_events_publisher kv_events_publisher;

/* Open and bind/connect the sockets, start the thread.  -1 with err on failure. */
int kv_events_publisher_create(const kv_events_config *c, kv_events_publisher **out, char *err,
                               size_t errlen);
/* Encode one step's events as a batch and queue it (never blocks; a full queue drops the
 * batch with a warning).  Engine thread: engine_kv_event_sink's publish. */
void kv_events_publisher_publish(void *pub, const kvev_log *log);
/* Batches published (sent) and dropped so far. */
void kv_events_publisher_counts(kv_events_publisher *p, uint64_t *sent, uint64_t *dropped);
/* Send what is queued (at most 1 s), close the sockets, stop the thread.  NULL is fine. */
void kv_events_publisher_destroy(kv_events_publisher *p);

#endif
