/*
 * mooncake_connector — vLLM's MooncakeConnector, in C (PROTOCOL.md §1-4):
 * the engine's KV connector hooks (engine/kv_connector.h) for the three roles.
 *
 * Producer (kv_producer / kv_both, the prefill instance): embeds the
 * bootstrap server (unless bootstrap_server_address names one), binds the
 * ZMQ side channel and registers it; a request with do_remote_decode keeps
 * its KV blocks when it finishes; a pull from a decoder (possibly arriving
 * before the prefill, or before the request itself) waits for them, then a
 * sender pool (num_workers threads) writes P's blocks into D's through the
 * transfer engine, one descriptor per contiguous run, replies FINISH and frees
 * the blocks.  Blocks nobody pulls are freed after
 * VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT.
 *
 * Consumer (kv_consumer / kv_both, the decode instance): a request with
 * do_remote_prefill is parked with blocks for its prompt; a pull thread finds
 * the producer's side channel through its bootstrap server (cached), sends the
 * pull (our KV region, block ids not already in the local prefix cache, the
 * layout fingerprint) and reports the outcome to the engine, which emits the
 * producer's first token when the reply carried one ("disagg_first_tokens", the
 * first-token handoff; first_token_handoff: false turns it off on either side) or
 * recomputes the last prompt token, and decodes — or fails the request /
 * prefills locally per kv_load_failure_policy.  Every wait has a deadline.
 */
#ifndef DISAGG_CONNECTOR_MOONCAKE_CONNECTOR_H
#define DISAGG_CONNECTOR_MOONCAKE_CONNECTOR_H

#include "base/prom.h"
#include "engine/engine.h"

#include <stddef.h>
#include <stdint.h>

typedef struct mooncake_connector mooncake_connector;

/* Parses the --kv-transfer-config JSON and the VLLM_MOONCAKE_* environment,
 * creates the transfer engine (registering the engine's KV region), starts
 * the producer / consumer machinery and attaches the hooks to eng.  Producer
 * start-up registers with the bootstrap server (3 attempts with backoff) and
 * fails with a clear error when it cannot. */
int mooncake_connector_create(const char *kv_transfer_config_json, engine *eng,
                              mooncake_connector **out, char *err, size_t errlen);
/* The same for a server listening on listen_host (its --host; NULL, "",
 * "0.0.0.0" or "::" = all interfaces): the embedded bootstrap server binds
 * there, and the KV host is listen_host when it names one address and neither
 * VLLM_HOST_IP nor device_name chooses another (docs/security.md). */
int mooncake_connector_create_on(const char *kv_transfer_config_json, const char *listen_host,
                                 engine *eng, mooncake_connector **out, char *err, size_t errlen);
/* Detaches from the engine: call it before engine_destroy. */
void mooncake_connector_destroy(mooncake_connector *c);
/* Consumer: a request carrying kv_transfer_params (JSON text) was refused
 * before it reached the engine (a 400 at validation): when they ask for a
 * remote prefill, tell the producer in the background to free the KV it keeps
 * for the transfer (an empty pull, as vLLM's decoder sends).  Thread-safe. */
void mooncake_connector_release_unused(mooncake_connector *c, const char *kv_params);

typedef struct mooncake_stats {
    const char *role;     /* "kv_producer", "kv_consumer", "kv_both" */
    const char *protocol; /* transport in use: "tcp", "shm", "rdma", or "auto" (KV in HBM, no NIC:
                             cuda_ipc on this host, staged tcp elsewhere) */
    const char *engine_id;
    uint64_t bytes_sent;                     /* producer: KV bytes written to decoders */
    uint64_t descriptors_sent;               /* producer: contiguous runs written */
    uint64_t transfers_ok, transfers_failed; /* producer: per request */
    uint64_t pulls_ok, pulls_failed;         /* consumer: per request */
    uint64_t expired;                        /* producer: kept blocks freed by the abort timeout */
    int kept;                                /* producer: requests holding blocks for a pull */
    int loading;                             /* consumer: pulls in flight */
    /* consumer: remote-KV load latency (pull sent -> KV in place), histogram */
    uint64_t load_count;
    double load_sum_s;
    uint64_t load_buckets[12]; /* cumulative counts for MOONCAKE_LOAD_BUCKETS */
    uint64_t send_count; /* producer: requests whose KV was written (blocks ready -> written) */
    double send_sum_s;
    /* producer: per transport that carried the writes (MOONCAKE_TRANSPORTS order: tcp, shm,
     * rdma, cuda_ipc), KV bytes and requests (a request over two counts in both) */
    uint64_t transport_bytes[4];
    uint64_t transport_requests[4];
    /* requests whose KV moved layer by layer while the prefill ran: producer (streamed),
     * consumer (pulls answered as streamed) */
    uint64_t layerwise_sent, layerwise_pulled;
} mooncake_stats;

#define MOONCAKE_TRANSPORTS                                                                        \
    { "tcp", "shm", "rdma", "cuda_ipc" }

#define MOONCAKE_LOAD_BUCKETS                                                                      \
    { 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0 }

void mooncake_connector_get_stats(mooncake_connector *c, mooncake_stats *out);
/* Writes the connector's families (disagg:kv_*) to p (base/prom; counts as integers, no
 * constant labels; p's style and constant labels are left as they were).  0 or p's error. */
int mooncake_connector_metrics(mooncake_connector *c, prom *p);

#endif
