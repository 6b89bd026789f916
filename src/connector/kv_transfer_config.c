/* kv_transfer_config — see kv_transfer_config.h.  Key tables first, then the
 * value checkers, the JSON walk and the environment. */
#include "connector/kv_transfer_config.h"

#include "base/auth.h"
#include "base/err.h"
#include "base/text.h"
#include "base/uuid.h"

#include "base/log.h"
#include "base/net.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "kv-config"

/* ---- tables ------------------------------------------------------------- */

static const char *const SUPPORTED_CONNECTOR = "MooncakeConnector";

/* vLLM connector names (v1 factory and v0) that are known but not built here. */
static const char *const OTHER_CONNECTORS[] = {
    "NixlConnector",      "P2pNcclConnector",         "LMCacheConnectorV1",
    "LMCacheMPConnector", "SharedStorageConnector",   "ExampleConnector",
    "MultiConnector",     "OffloadingConnector",      "DecodeBenchConnector",
    "MoRIIOConnector",    "MooncakeStoreConnector",   "FlexKVConnectorV1",
    "PyNcclConnector",    "LMCacheConnector",         "CPUConnector",
    "HF3FSKVConnector",   "LMCacheConnectorV1Dynamic"};
#define N_OTHER_CONNECTORS (sizeof OTHER_CONNECTORS / sizeof OTHER_CONNECTORS[0])

/* Type a vLLM KVTransferConfig field must have. */
typedef enum field_type {
    FT_STR,         /* str */
    FT_STR_OR_NULL, /* str | None */
    FT_INT,         /* int */
    FT_INT_OR_NULL, /* int | None */
    FT_NUMBER,      /* float (int accepted) */
    FT_BOOL,        /* bool */
    FT_OBJECT,      /* dict */
} field_type;

typedef struct top_key {
    const char *name; /* JSON key */
    field_type type;  /* type vLLM accepts */
    int used;         /* 1: used here; 0: accepted and noted as ignored */
} top_key;

/* Every field of vLLM's KVTransferConfig (vllm/config/kv_transfer.py). */
static const top_key TOP_KEYS[] = {
    {"kv_connector", FT_STR_OR_NULL, 1},
    {"engine_id", FT_STR_OR_NULL, 1},
    {"kv_buffer_device", FT_STR, 0},
    {"kv_buffer_size", FT_NUMBER, 0},
    {"kv_role", FT_STR_OR_NULL, 1},
    {"kv_rank", FT_INT_OR_NULL, 0},
    {"kv_parallel_size", FT_INT, 0},
    {"kv_ip", FT_STR, 0},
    {"kv_port", FT_INT, 0},
    {"kv_connector_extra_config", FT_OBJECT, 1},
    {"kv_connector_module_path", FT_STR_OR_NULL, 0},
    {"enable_permute_local_kv", FT_BOOL, 0},
    {"kv_load_failure_policy", FT_STR, 1},
};
#define N_TOP_KEYS (sizeof TOP_KEYS / sizeof TOP_KEYS[0])

static const char *const EXTRA_KEYS[] = {
    "num_workers", "mooncake_protocol", "device_name",         "bootstrap_server_address",
    "auth_secret", "max_pending_pulls", "first_token_handoff", "max_remote_loads",
    "layerwise",   "pool_fetch"};
#define N_EXTRA_KEYS (sizeof EXTRA_KEYS / sizeof EXTRA_KEYS[0])

static const char *const ROLE_NAMES[] = {"kv_producer", "kv_consumer", "kv_both"};
static const char *const PROTOCOL_NAMES[] = {"rdma", "tcp", "shm"};
static const char *const POLICY_NAMES[] = {"fail", "recompute"};

const char *kv_role_name(kv_role r) {
    return (unsigned)r < 3 ? ROLE_NAMES[r] : "?";
}
const char *kv_protocol_name(kv_protocol p) {
    return (unsigned)p < 3 ? PROTOCOL_NAMES[p] : "?";
}
const char *kv_load_failure_policy_name(kv_load_failure_policy p) {
    return (unsigned)p < 2 ? POLICY_NAMES[p] : "?";
}

/* ---- helpers ------------------------------------------------------------ */

int kv_config_edit_distance(const char *a, const char *b) {
    return text_edit_distance(a, b);
}

/* The closest of names[] to s when close enough to be a typo, else NULL. */
static const char *did_you_mean(const char *s, const char *const *names, size_t n) {
    const char *best = NULL;
    int best_d = 1 << 30;
    for (size_t i = 0; i < n; i++) {
        int d = kv_config_edit_distance(s, names[i]);
        if (d < best_d) best_d = d, best = names[i];
    }
    int len = (int)strlen(s);
    int limit = len / 3 > 2 ? len / 3 : 2;
    if (best_d <= limit) return best;
    /* a missing prefix or suffix ("both" for "kv_both") */
    for (size_t i = 0; i < n && len >= 3; i++)
        if (strstr(names[i], s)) return names[i];
    return NULL;
}

/* "a, b, c" of names[] into buf. */
static const char *join_names(const char *const *names, size_t n, char *buf, size_t cap) {
    size_t off = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n && off < cap; i++)
        off += (size_t)snprintf(buf + off, cap - off, "%s%s", i ? ", " : "", names[i]);
    return buf;
}

static void append_key(char *list, size_t cap, const char *key) {
    size_t len = strlen(list);
    if (len + 1 >= cap) return;
    snprintf(list + len, cap - len, "%s%s", len ? "," : "", key);
}

/* Short printable rendering of a JSON value for messages. */
static const char *json_short(const json_t *v, char *buf, size_t cap) {
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (!s) {
        snprintf(buf, cap, "?");
        return buf;
    }
    if (strlen(s) + 1 > cap && cap > 4) {
        memcpy(buf, s, cap - 4);
        memcpy(buf + cap - 4, "...", 4);
    } else {
        snprintf(buf, cap, "%s", s);
    }
    free(s);
    return buf;
}

static int type_ok(const json_t *v, field_type t) {
    switch (t) {
    case FT_STR:
        return json_is_string(v);
    case FT_STR_OR_NULL:
        return json_is_string(v) || json_is_null(v);
    case FT_INT:
        return json_is_integer(v);
    case FT_INT_OR_NULL:
        return json_is_integer(v) || json_is_null(v);
    case FT_NUMBER:
        return json_is_number(v);
    case FT_BOOL:
        return json_is_boolean(v);
    case FT_OBJECT:
        return json_is_object(v);
    }
    return 0;
}

static const char *type_want(field_type t) {
    switch (t) {
    case FT_STR:
        return "a string";
    case FT_STR_OR_NULL:
        return "a string or null";
    case FT_INT:
        return "an integer";
    case FT_INT_OR_NULL:
        return "an integer or null";
    case FT_NUMBER:
        return "a number";
    case FT_BOOL:
        return "true or false";
    case FT_OBJECT:
        return "an object";
    }
    return "?";
}

/* Index of s in names[] (exact), -1 if absent. */
static int find_name(const char *s, const char *const *names, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(s, names[i]) == 0) return (int)i;
    return -1;
}

/* An enum-valued string key: value must be one of names[]. */
static int parse_enum(const char *key, const json_t *v, const char *const *names, size_t n,
                      int *out, char *err, size_t cap) {
    char list[256], shown[96];
    if (!json_is_string(v)) {
        err_set(err, cap, "kv-transfer-config: %s: %s is %s, not a string; accepted: %s", key,
                json_short(v, shown, sizeof shown), text_json_kind(v),
                join_names(names, n, list, sizeof list));
        return KV_CONFIG_EINVAL;
    }
    const char *s = json_string_value(v);
    int i = find_name(s, names, n);
    if (i >= 0) {
        *out = i;
        return 0;
    }
    const char *hint = did_you_mean(s, names, n);
    err_set(err, cap, "kv-transfer-config: %s: '%s' is not accepted%s%s%s; accepted: %s", key, s,
            hint ? " (did you mean '" : "", hint ? hint : "", hint ? "'?)" : "",
            join_names(names, n, list, sizeof list));
    return KV_CONFIG_EINVAL;
}

/* ---- kv_connector_extra_config ------------------------------------------ */

static int parse_extra(const json_t *extra, kv_transfer_config *c, char *err, size_t cap) {
    const char *key;
    json_t *v;
    char shown[96];
    json_object_foreach((json_t *)extra, key, v) {
        if (strcmp(key, "num_workers") == 0) {
            if (!json_is_integer(v) || json_integer_value(v) < 1 ||
                json_integer_value(v) > KV_CONFIG_NUM_WORKERS_MAX) {
                err_set(err, cap,
                        "kv-transfer-config: kv_connector_extra_config.num_workers: %s is not "
                        "accepted; accepted: an integer from 1 to %d (default %d)",
                        json_short(v, shown, sizeof shown), KV_CONFIG_NUM_WORKERS_MAX,
                        KV_CONFIG_NUM_WORKERS_DEFAULT);
                return KV_CONFIG_EINVAL;
            }
            c->num_workers = (int)json_integer_value(v);
        } else if (strcmp(key, "mooncake_protocol") == 0) {
            int p;
            if (parse_enum("kv_connector_extra_config.mooncake_protocol", v, PROTOCOL_NAMES, 3, &p,
                           err, cap))
                return KV_CONFIG_EINVAL;
            c->protocol = (kv_protocol)p;
        } else if (strcmp(key, "device_name") == 0) {
            if (!json_is_string(v) || strlen(json_string_value(v)) >= sizeof c->device_name) {
                err_set(err, cap,
                        "kv-transfer-config: kv_connector_extra_config.device_name: %s is not "
                        "accepted; accepted: a string of interface/NIC names (comma-separated, "
                        "\"\" = all), shorter than %zu bytes",
                        json_short(v, shown, sizeof shown), sizeof c->device_name);
                return KV_CONFIG_EINVAL;
            }
            snprintf(c->device_name, sizeof c->device_name, "%s", json_string_value(v));
        } else if (strcmp(key, "bootstrap_server_address") == 0) {
            const char *s = json_is_string(v) ? json_string_value(v) : NULL;
            if (s && strncmp(s, "http://", 7) == 0) s += 7; /* tolerate the URL form */
            char host[256];
            uint16_t port = 0;
            if (!s || net_split_host_port(s, host, sizeof host, &port, 0) != 0 || !host[0]) {
                err_set(err, cap,
                        "kv-transfer-config: kv_connector_extra_config.bootstrap_server_address: "
                        "%s is not accepted; accepted: \"host:port\" (port 1..65535, IPv6 as "
                        "\"[addr]:port\")",
                        json_short(v, shown, sizeof shown));
                return KV_CONFIG_EINVAL;
            }
            snprintf(c->bootstrap_host, sizeof c->bootstrap_host, "%s", host);
            c->bootstrap_port = port;
        } else if (strcmp(key, "auth_secret") == 0) {
            /* never echo the value: it is a secret */
            const char *sv = json_is_string(v) ? json_string_value(v) : NULL;
            size_t n = sv ? json_string_length(v) : 0;
            if (!sv || n == 0 || n >= sizeof c->auth_secret || strlen(sv) != n) {
                err_set(err, cap,
                        "kv-transfer-config: kv_connector_extra_config.auth_secret: %s is not "
                        "accepted; accepted: a non-empty string without NUL bytes, shorter than "
                        "%zu bytes (or leave it out: then $%s, else no authentication)",
                        !sv      ? text_json_kind(v)
                        : n == 0 ? "an empty string"
                                 : "a string too long or containing NUL",
                        sizeof c->auth_secret, AUTH_SECRET_ENV);
                return KV_CONFIG_EINVAL;
            }
            snprintf(c->auth_secret, sizeof c->auth_secret, "%s", sv);
        } else if (strcmp(key, "max_pending_pulls") == 0) {
            if (!json_is_integer(v) || json_integer_value(v) < 1 ||
                json_integer_value(v) > KV_CONFIG_PENDING_PULLS_MAX) {
                err_set(err, cap,
                        "kv-transfer-config: kv_connector_extra_config.max_pending_pulls: %s is "
                        "not accepted; accepted: an integer from 1 to %d (default %d)",
                        json_short(v, shown, sizeof shown), KV_CONFIG_PENDING_PULLS_MAX,
                        KV_CONFIG_PENDING_PULLS_DEFAULT);
                return KV_CONFIG_EINVAL;
            }
            c->max_pending_pulls = (int)json_integer_value(v);
        } else if (strcmp(key, "max_remote_loads") == 0) {
            if (!json_is_integer(v) || json_integer_value(v) < 1 ||
                json_integer_value(v) > KV_CONFIG_REMOTE_LOADS_MAX) {
                err_set(err, cap,
                        "kv-transfer-config: kv_connector_extra_config.max_remote_loads: %s is "
                        "not accepted; accepted: an integer from 1 to %d (default %d)",
                        json_short(v, shown, sizeof shown), KV_CONFIG_REMOTE_LOADS_MAX,
                        KV_CONFIG_REMOTE_LOADS_DEFAULT);
                return KV_CONFIG_EINVAL;
            }
            c->max_remote_loads = (int)json_integer_value(v);
        } else if (strcmp(key, "first_token_handoff") == 0) {
            if (!json_is_boolean(v)) {
                err_set(err, cap,
                        "kv-transfer-config: kv_connector_extra_config.first_token_handoff: %s is "
                        "not accepted; accepted: true (default) or false",
                        json_short(v, shown, sizeof shown));
                return KV_CONFIG_EINVAL;
            }
            c->first_token_handoff = json_is_true(v);
        } else if (strcmp(key, "layerwise") == 0) {
            if (!json_is_boolean(v)) {
                err_set(err, cap,
                        "kv-transfer-config: kv_connector_extra_config.layerwise: %s is not "
                        "accepted; accepted: true (default) or false",
                        json_short(v, shown, sizeof shown));
                return KV_CONFIG_EINVAL;
            }
            c->layerwise = json_is_true(v);
            c->layerwise_set = 1;
        } else if (strcmp(key, "pool_fetch") == 0) {
            const char *m = json_string_value(v);
            int k = !m ? -1
                    : !strcmp(m, "auto")   ? KV_POOL_FETCH_AUTO
                    : !strcmp(m, "always") ? KV_POOL_FETCH_ALWAYS
                    : !strcmp(m, "never")  ? KV_POOL_FETCH_NEVER
                                           : -1;
            if (k < 0) {
                err_set(err, cap,
                        "kv-transfer-config: kv_connector_extra_config.pool_fetch: %s is not "
                        "accepted; accepted: \"auto\" (default), \"always\" or \"never\"",
                        json_short(v, shown, sizeof shown));
                return KV_CONFIG_EINVAL;
            }
            c->pool_fetch = k;
        } else {
            const char *hint = did_you_mean(key, EXTRA_KEYS, N_EXTRA_KEYS);
            LOG_W(MOD,
                  "kv_connector_extra_config.%s is not a MooncakeConnector option here; "
                  "ignored%s%s%s",
                  key, hint ? " (did you mean '" : "", hint ? hint : "", hint ? "'?)" : "");
            append_key(c->unknown_extra_keys, sizeof c->unknown_extra_keys, key);
        }
    }
    return 0;
}

/* ---- top level ---------------------------------------------------------- */

static int parse_connector(const json_t *v, kv_transfer_config *c, char *err, size_t cap) {
    char shown[96];
    if (!v || json_is_null(v)) {
        err_set(err, cap, "kv-transfer-config: kv_connector is required; accepted: \"%s\"",
                SUPPORTED_CONNECTOR);
        return KV_CONFIG_EINVAL;
    }
    const char *s = json_string_value(v); /* type checked by the caller */
    if (strcmp(s, SUPPORTED_CONNECTOR) == 0) {
        snprintf(c->kv_connector, sizeof c->kv_connector, "%s", s);
        return 0;
    }
    if (find_name(s, OTHER_CONNECTORS, N_OTHER_CONNECTORS) >= 0) {
        err_set(err, cap,
                "kv-transfer-config: kv_connector: '%s' is a vLLM connector that disagg does not "
                "implement; accepted: \"%s\"",
                s, SUPPORTED_CONNECTOR);
        return KV_CONFIG_EINVAL;
    }
    const char *names[1] = {SUPPORTED_CONNECTOR};
    const char *hint = did_you_mean(s, names, 1);
    err_set(err, cap,
            "kv-transfer-config: kv_connector: %s is not a known connector%s%s%s; "
            "accepted: \"%s\"",
            json_short(v, shown, sizeof shown), hint ? " (did you mean '" : "", hint ? hint : "",
            hint ? "'?)" : "", SUPPORTED_CONNECTOR);
    return KV_CONFIG_EINVAL;
}

static int parse_engine_id(const json_t *v, kv_transfer_config *c, char *err, size_t cap) {
    if (!v || json_is_null(v)) {
        uuid4(c->engine_id);
        c->engine_id_generated = 1;
        return 0;
    }
    const char *s = json_string_value(v);
    size_t n = strlen(s);
    int printable = 1;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f) printable = 0;
    if (n == 0 || n >= sizeof c->engine_id || !printable) {
        char shown[96];
        err_set(err, cap,
                "kv-transfer-config: engine_id: %s is not accepted; accepted: a non-empty string "
                "of at most %zu bytes without control characters, or null/absent for a uuid4",
                json_short(v, shown, sizeof shown), sizeof c->engine_id - 1);
        return KV_CONFIG_EINVAL;
    }
    snprintf(c->engine_id, sizeof c->engine_id, "%s", s);
    return 0;
}

int kv_transfer_config_parse(const char *json_text, kv_transfer_config *out, char *err,
                             size_t err_cap) {
    kv_transfer_config c;
    memset(&c, 0, sizeof c);
    c.load_failure_policy = KV_LOAD_FAILURE_FAIL;
    c.num_workers = KV_CONFIG_NUM_WORKERS_DEFAULT;
    c.protocol = KV_PROTOCOL_RDMA;
    c.max_pending_pulls = KV_CONFIG_PENDING_PULLS_DEFAULT;
    c.max_remote_loads = KV_CONFIG_REMOTE_LOADS_DEFAULT;
    c.first_token_handoff = 1;
    c.layerwise = 1; /* streams only when both sides have it and the pull comes in time */
    if (err && err_cap) err[0] = '\0';
    if (!json_text) {
        err_set(err, err_cap, "kv-transfer-config: missing (NULL) text");
        return KV_CONFIG_EINVAL;
    }
    json_error_t jerr;
    json_t *root = json_loads(json_text, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (!root) {
        err_set(err, err_cap,
                "kv-transfer-config: not valid JSON (line %d, column %d: %s); accepted: a JSON "
                "object such as {\"kv_connector\":\"MooncakeConnector\",\"kv_role\":"
                "\"kv_producer\"}",
                jerr.line, jerr.column, jerr.text);
        return KV_CONFIG_EINVAL;
    }
    int rc = KV_CONFIG_EINVAL;
    char shown[96];
    if (!json_is_object(root)) {
        err_set(err, err_cap, "kv-transfer-config: the value is %s; accepted: a JSON object",
                text_json_kind(root));
        goto out;
    }
    /* 1. every key known to vLLM and of vLLM's type */
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        const top_key *k = NULL;
        for (size_t i = 0; i < N_TOP_KEYS; i++)
            if (strcmp(key, TOP_KEYS[i].name) == 0) k = &TOP_KEYS[i];
        if (!k) {
            const char *names[N_TOP_KEYS];
            for (size_t i = 0; i < N_TOP_KEYS; i++)
                names[i] = TOP_KEYS[i].name;
            const char *hint = did_you_mean(key, names, N_TOP_KEYS);
            char list[512];
            err_set(err, err_cap, "kv-transfer-config: unknown key '%s'%s%s%s; accepted keys: %s",
                    key, hint ? " (did you mean '" : "", hint ? hint : "", hint ? "'?)" : "",
                    join_names(names, N_TOP_KEYS, list, sizeof list));
            goto out;
        }
        if (!type_ok(v, k->type)) {
            err_set(err, err_cap, "kv-transfer-config: %s: %s is %s; accepted: %s", key,
                    json_short(v, shown, sizeof shown), text_json_kind(v), type_want(k->type));
            goto out;
        }
        if (!k->used) append_key(c.ignored_keys, sizeof c.ignored_keys, key);
    }
    /* 2. the keys used here */
    if (parse_connector(json_object_get(root, "kv_connector"), &c, err, err_cap)) goto out;
    v = json_object_get(root, "kv_role");
    if (!v || json_is_null(v)) {
        err_set(err, err_cap,
                "kv-transfer-config: kv_role is required with kv_connector; accepted: "
                "kv_producer, kv_consumer, kv_both");
        goto out;
    }
    int ival;
    if (parse_enum("kv_role", v, ROLE_NAMES, 3, &ival, err, err_cap)) goto out;
    c.role = (kv_role)ival;
    if (parse_engine_id(json_object_get(root, "engine_id"), &c, err, err_cap)) goto out;
    v = json_object_get(root, "kv_load_failure_policy");
    if (v) {
        if (parse_enum("kv_load_failure_policy", v, POLICY_NAMES, 2, &ival, err, err_cap)) goto out;
        c.load_failure_policy = (kv_load_failure_policy)ival;
    }
    v = json_object_get(root, "kv_connector_extra_config");
    if (v && parse_extra(v, &c, err, err_cap)) goto out;
    c.rdma_requested = c.protocol == KV_PROTOCOL_RDMA;
    if (!c.auth_secret[0]) { /* the key wins; else the environment */
        const char *env = auth_secret_resolve(NULL);
        if (env && strlen(env) >= sizeof c.auth_secret) {
            err_set(err, err_cap,
                    "%s is not accepted: %zu bytes; accepted: a non-empty secret shorter than %zu "
                    "bytes",
                    AUTH_SECRET_ENV, strlen(env), sizeof c.auth_secret);
            goto out;
        }
        if (env) {
            snprintf(c.auth_secret, sizeof c.auth_secret, "%s", env);
            c.auth_secret_from_env = 1;
        }
    }
    if (c.ignored_keys[0])
        LOG_I(MOD, "kv-transfer-config keys accepted but unused by disagg's MooncakeConnector: %s",
              c.ignored_keys);
    *out = c;
    rc = 0;
out:
    json_decref(root);
    return rc;
}

kv_protocol kv_transfer_config_effective_protocol(const kv_transfer_config *c, int rdma_available) {
    static atomic_int warned;
    if (c->protocol != KV_PROTOCOL_RDMA || rdma_available) return c->protocol;
    if (atomic_exchange(&warned, 1) == 0)
        LOG_W(MOD, "mooncake_protocol \"rdma\" (the default) but this build or host has no RDMA "
                   "device: using tcp instead (set kv_connector_extra_config.mooncake_protocol to "
                   "\"tcp\" or \"shm\" to silence this)");
    return KV_PROTOCOL_TCP;
}

/* ---- environment -------------------------------------------------------- */

/* Value of name, NULL when unset or empty. */
static const char *env_value(const char *name) {
    const char *s = getenv(name);
    return s && s[0] ? s : NULL;
}

/* Strict decimal number: the whole string, finite, > 0. */
static int parse_positive_seconds(const char *s, double *out) {
    char *end = NULL;
    errno = 0;
    double d = strtod(s, &end);
    if (errno || !(isdigit((unsigned char)s[0]) || s[0] == '.') || end == s || *end != '\0' ||
        !isfinite(d) || d <= 0 || d > 1e7)
        return -1;
    *out = d;
    return 0;
}

int kv_transfer_env_load(kv_transfer_env *out, char *err, size_t err_cap) {
    kv_transfer_env e;
    memset(&e, 0, sizeof e);
    e.bootstrap_port = KV_ENV_BOOTSTRAP_PORT_DEFAULT;
    e.connector_timeout_s = KV_ENV_CONNECTOR_TIMEOUT_DEFAULT;
    e.abort_request_timeout_s = KV_ENV_ABORT_REQUEST_TIMEOUT_DEFAULT;
    e.unknown_transfer_timeout_s = KV_ENV_UNKNOWN_TRANSFER_TIMEOUT_DEFAULT;
    e.with_nvidia_peermem = -1;
    if (err && err_cap) err[0] = '\0';

    const char *s = env_value("VLLM_MOONCAKE_BOOTSTRAP_PORT");
    if (s) {
        char *end = NULL;
        errno = 0;
        long p = strtol(s, &end, 10);
        if (errno || !isdigit((unsigned char)s[0]) || end == s || *end || p < 1 || p > 65535) {
            err_set(err, err_cap,
                    "VLLM_MOONCAKE_BOOTSTRAP_PORT='%s' is not accepted; accepted: a port number "
                    "from 1 to 65535 (default %d)",
                    s, KV_ENV_BOOTSTRAP_PORT_DEFAULT);
            return KV_CONFIG_EINVAL;
        }
        e.bootstrap_port = (uint16_t)p;
    }
    s = env_value("VLLM_MOONCAKE_CONNECTOR_TIMEOUT");
    if (s && parse_positive_seconds(s, &e.connector_timeout_s)) {
        err_set(err, err_cap,
                "VLLM_MOONCAKE_CONNECTOR_TIMEOUT='%s' is not accepted; accepted: seconds, a "
                "number > 0 (default 30.0)",
                s);
        return KV_CONFIG_EINVAL;
    }
    s = env_value("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT");
    if (s && parse_positive_seconds(s, &e.abort_request_timeout_s)) {
        err_set(err, err_cap,
                "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT='%s' is not accepted; accepted: seconds, a "
                "number > 0 (default 480)",
                s);
        return KV_CONFIG_EINVAL;
    }
    s = env_value("DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT");
    if (s && parse_positive_seconds(s, &e.unknown_transfer_timeout_s)) {
        err_set(err, err_cap,
                "DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT='%s' is not accepted; accepted: seconds, a "
                "number > 0 (default 30)",
                s);
        return KV_CONFIG_EINVAL;
    }
    s = env_value("VLLM_HOST_IP");
    if (s) {
        unsigned char buf[sizeof(struct in6_addr)];
        if (strlen(s) >= sizeof e.host_ip ||
            (inet_pton(AF_INET, s, buf) != 1 && inet_pton(AF_INET6, s, buf) != 1)) {
            err_set(err, err_cap,
                    "VLLM_HOST_IP='%s' is not accepted; accepted: a numeric IPv4 or IPv6 address "
                    "of this host (unset = detect)",
                    s);
            return KV_CONFIG_EINVAL;
        }
        snprintf(e.host_ip, sizeof e.host_ip, "%s", s);
    }
    s = env_value("WITH_NVIDIA_PEERMEM");
    if (s) {
        if (strcmp(s, "0") != 0 && strcmp(s, "1") != 0) {
            err_set(err, err_cap,
                    "WITH_NVIDIA_PEERMEM='%s' is not accepted; accepted: 1 (ibv_reg_mr through "
                    "nvidia-peermem) or 0 (DMA-BUF)",
                    s);
            return KV_CONFIG_EINVAL;
        }
        e.with_nvidia_peermem = s[0] - '0';
    }
    *out = e;
    return 0;
}
