/*
 * kv_transfer_config — the `--kv-transfer-config` JSON and the VLLM_MOONCAKE_*
 * environment of a disaggregated instance (PROTOCOL.md §4).  Parsing validates every value and, on failure, writes one
 * message naming the key (or variable), the bad value and the accepted values.
 *
 * Accepted JSON is vLLM's KVTransferConfig: the keys that matter here
 * (kv_connector, kv_role, engine_id, kv_load_failure_policy,
 * kv_connector_extra_config) are used; the other KVTransferConfig fields that
 * people copy along (kv_buffer_device, kv_port, ...) are type-checked as vLLM
 * would, then noted once in the log as ignored; a key vLLM does not know is an
 * error with a did-you-mean hint.  Unknown keys inside kv_connector_extra_config
 * (other connectors' options live there) only get a warning.
 */
#ifndef DISAGG_CONNECTOR_KV_TRANSFER_CONFIG_H
#define DISAGG_CONNECTOR_KV_TRANSFER_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#define KV_CONFIG_EINVAL (-22) /* a bad value; the error buffer says which */

typedef enum kv_role {
    KV_ROLE_PRODUCER = 0, /* "kv_producer": prefill instance, serves pulls */
    KV_ROLE_CONSUMER = 1, /* "kv_consumer": decode instance, pulls KV */
    KV_ROLE_BOTH = 2,     /* "kv_both": either, per request params */
} kv_role;

typedef enum kv_load_failure_policy {
    KV_LOAD_FAILURE_FAIL = 0,      /* "fail" (vLLM's default since PR #34896) */
    KV_LOAD_FAILURE_RECOMPUTE = 1, /* "recompute": prefill locally on D */
} kv_load_failure_policy;

typedef enum kv_protocol {
    KV_PROTOCOL_RDMA = 0, /* "rdma" (the documented default) */
    KV_PROTOCOL_TCP = 1,  /* "tcp" */
    KV_PROTOCOL_SHM = 2,  /* "shm": same host, process_vm_* (ours) */
} kv_protocol;

#define KV_CONFIG_NUM_WORKERS_DEFAULT   10
#define KV_CONFIG_NUM_WORKERS_MAX       1024
#define KV_CONFIG_ENGINE_ID_MAX         128  /* bytes incl. NUL */
#define KV_CONFIG_KEYS_MAX              512  /* bytes of the ignored/unknown key lists */
#define KV_CONFIG_SECRET_MAX            256  /* bytes of auth_secret incl. NUL */
#define KV_CONFIG_PENDING_PULLS_DEFAULT 4096 /* max_pending_pulls */
#define KV_CONFIG_PENDING_PULLS_MAX     1048576
#define KV_CONFIG_REMOTE_LOADS_DEFAULT  512 /* max_remote_loads */
#define KV_CONFIG_REMOTE_LOADS_MAX      4096

typedef enum kv_pool_fetch_mode {
    KV_POOL_FETCH_AUTO = 0,
    KV_POOL_FETCH_ALWAYS = 1,
    KV_POOL_FETCH_NEVER = 2,
} kv_pool_fetch_mode;

typedef struct kv_transfer_config {
    char kv_connector[64];                      /* always "MooncakeConnector" after a parse */
    kv_role role;                               /* kv_role (required) */
    char engine_id[KV_CONFIG_ENGINE_ID_MAX];    /* given, or a generated uuid4 */
    int engine_id_generated;                    /* 1 when engine_id was not given */
    kv_load_failure_policy load_failure_policy; /* default fail */
    /* kv_connector_extra_config */
    int num_workers;          /* sender pool size, 1..1024, default 10 */
    kv_protocol protocol;     /* mooncake_protocol, default rdma */
    int rdma_requested;       /* 1 when protocol is rdma (asked or defaulted): the caller
                                 warns once and falls back to tcp without an RDMA device */
    char device_name[256];    /* NIC/interface whitelist, "" = all */
    char bootstrap_host[256]; /* bootstrap_server_address host, "" = embed one */
    uint16_t bootstrap_port;  /* its port (0 when none given) */
    /* Shared secret of the KV ports (docs/security.md): the auth_secret key,
     * else $DISAGG_KV_SECRET (auth_secret_resolve); "" = none, no
     * authentication (vLLM/Mooncake peers work unchanged).  Handed to the
     * side channel, the bootstrap client/server and the transfer engine. */
    char auth_secret[KV_CONFIG_SECRET_MAX];
    int auth_secret_from_env; /* 1 when auth_secret came from DISAGG_KV_SECRET */
    /* producer: pulls naming a transfer id this producer does not (yet) know
     * that may wait at once; one more evicts the oldest (its pull fails at
     * once): a flood of bogus pulls costs O(1) each.  1..1048576, default 4096. */
    int max_pending_pulls;
    /* consumer: remote KV loads (pulls) in flight at once; one more evicts the
     * oldest load its producer said it does not know the transfer of, else is
     * refused with 503 "too many remote KV loads in flight".  1..4096, default 512. */
    int max_remote_loads;
    /* first_token_handoff (default true): a producer sends the first output token
     * its prefill sampled with the KV ("disagg_first_tokens" in the pull's reply),
     * a consumer uses such a token instead of recomputing the last prompt position
     * (docs/connector.md).  false: neither. */
    int first_token_handoff;
    /* layerwise (default true): a consumer asks for its KV layer by layer while the
     * producer's prefill runs ("disagg_layerwise" in the pull), a producer streams it when
     * asked (docs/connector.md "Layer-wise streaming").  false: the whole-request path.
     * layerwise_set: the config named it (an instance of several TP ranks streams nothing
     * and refuses an explicit true; its default is quietly off there). */
    int layerwise, layerwise_set;
    /* pool_fetch: what a consumer does with a request's kv_transfer_params.pool_source (a
     * prefix of the prompt another instance holds, docs/kv_pool.md): "auto" (default) pulls
     * it when the estimated transfer time is below the prefill time it saves, "always"
     * pulls it, "never" computes the prompt here. */
    kv_pool_fetch_mode pool_fetch;
    /* what was accepted but means nothing here (comma-separated, for logs/tests) */
    char ignored_keys[KV_CONFIG_KEYS_MAX];       /* vLLM KVTransferConfig fields unused here */
    char unknown_extra_keys[KV_CONFIG_KEYS_MAX]; /* kv_connector_extra_config keys unknown */
} kv_transfer_config;

/* Parse and validate the JSON text of --kv-transfer-config into *out (fully
 * initialised, defaults applied).  Returns 0, or KV_CONFIG_EINVAL with a message
 * in err (always NUL-terminated when err_cap > 0).  Ignored keys are logged once
 * (info) and unknown extra-config keys warned, per call. */
int kv_transfer_config_parse(const char *json_text, kv_transfer_config *out, char *err,
                             size_t err_cap);

/* The transport to use: the configured one, except that "rdma" without an RDMA
 * device (rdma_available 0) falls back to tcp with one loud warning per
 * process.  The caller reports the result in logs and /metrics. */
kv_protocol kv_transfer_config_effective_protocol(const kv_transfer_config *c, int rdma_available);

/* Names of the enums, as written in the JSON. */
const char *kv_role_name(kv_role r);
const char *kv_protocol_name(kv_protocol p);
const char *kv_load_failure_policy_name(kv_load_failure_policy p);

/* Environment of the Mooncake connector (vLLM's names and defaults). */
typedef struct kv_transfer_env {
    uint16_t bootstrap_port;           /* VLLM_MOONCAKE_BOOTSTRAP_PORT, 1..65535, default 8998 */
    double connector_timeout_s;        /* VLLM_MOONCAKE_CONNECTOR_TIMEOUT, > 0, default 30.0 */
    double abort_request_timeout_s;    /* VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, > 0, default 480 */
    double unknown_transfer_timeout_s; /* DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT, > 0, default 30:
                                          how long a producer holds a pull for a transfer_id
                                          no request of its own carries */
    char host_ip[64];                  /* VLLM_HOST_IP, a numeric IPv4/IPv6 address, "" = unset */
    int with_nvidia_peermem;           /* WITH_NVIDIA_PEERMEM: 1, 0, or -1 when unset */
} kv_transfer_env;

#define KV_ENV_BOOTSTRAP_PORT_DEFAULT           8998
#define KV_ENV_CONNECTOR_TIMEOUT_DEFAULT        30.0
#define KV_ENV_ABORT_REQUEST_TIMEOUT_DEFAULT    480.0
#define KV_ENV_UNKNOWN_TRANSFER_TIMEOUT_DEFAULT 30.0

/* Read the variables above from the process environment (an empty value counts
 * as unset).  Returns 0, or KV_CONFIG_EINVAL with a message naming the variable,
 * its value and the accepted values. */
int kv_transfer_env_load(kv_transfer_env *out, char *err, size_t err_cap);

/* Levenshtein distance of a and b (ASCII, bytes); exposed for tests. */
int kv_config_edit_distance(const char *a, const char *b);

#endif
