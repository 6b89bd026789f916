/*
 * side_channel_msg — the two MessagePack messages of the Mooncake side channel
 * (PROTOCOL.md §3): the pull request D → P (vLLM's MooncakeXferMetadata) and
 * the reply P → D (MooncakeXferResponse).  vLLM encodes both as msgspec Structs
 * with omit_defaults=True and no array_like, i.e. a msgpack MAP keyed by field
 * name, required fields always present, defaulted fields omitted when equal to
 * their default; its decoder ignores unknown keys.  We do the same, plus one
 * extension key, "disagg_layout" (the KV layout fingerprint, DESIGN.md "The KV
 * region"), which vLLM peers ignore.
 *
 * Decoding is hardened against hostile input: the bytes are pre-scanned
 * (size, nesting depth, container counts against the remaining bytes, total
 * object count, no trailing bytes) before msgpack-c unpacks them, and the
 * SIDE_CHANNEL_MAX_* limits bound what a message may carry.  Every failure is a
 * negative return and a message naming the key and what was expected.
 */
#ifndef DISAGG_CONNECTOR_MOONCAKE_SIDE_CHANNEL_MSG_H
#define DISAGG_CONNECTOR_MOONCAKE_SIDE_CHANNEL_MSG_H

#include <stddef.h>
#include <stdint.h>

#define SIDE_CHANNEL_EINVAL (-22) /* malformed / out-of-limit message */
#define SIDE_CHANNEL_ENOMEM (-12)

#define SIDE_CHANNEL_MAX_MSG_BYTES (16u << 20) /* one frame */
#define SIDE_CHANNEL_MAX_REQS      16384       /* requests in one pull */
#define SIDE_CHANNEL_MAX_GROUPS    64          /* KV groups per request */
#define SIDE_CHANNEL_MAX_BLOCK_IDS (1u << 21)  /* block ids in one pull, all requests */
#define SIDE_CHANNEL_MAX_REGIONS   4096        /* registered KV regions (base addrs) */
#define SIDE_CHANNEL_MAX_STR       4096        /* bytes of any string */
#define SIDE_CHANNEL_MAX_DEPTH     16          /* msgpack nesting */

/* Key of our layout-fingerprint extension. */
#define SIDE_CHANNEL_LAYOUT_KEY "disagg_layout"
/* Key of the first-token extension of a reply: {"<D req id>": [token id]} for the
 * requests in ok_reqs whose first output token P sampled in its prefill (the
 * first-token handoff, docs/connector.md).  vLLM's decoder ignores it. */
#define SIDE_CHANNEL_FIRST_TOKENS_KEY "disagg_first_tokens"
/* Reply extension (a CONTINUE): the producer has no request with the transfer
 * id of these D requests yet (their pulls wait at most
 * DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT); a later CONTINUE without a request in it
 * means the request arrived.  A consumer at its cap of loads evicts such a pull
 * first.  msgspec ignores the key: a vLLM decoder reads an empty CONTINUE. */
#define SIDE_CHANNEL_UNKNOWN_KEY "disagg_unknown_reqs"
/* Layer-wise streaming (docs/connector.md "Layer-wise streaming").  In a pull, true: this
 * decoder accepts its blocks written layer by layer while the producer's prefill still
 * runs (it reads them only after the FINISH that lists the request in ok_reqs, as ever).
 * In a FINISH, ["<D req id>", ...]: the requests whose KV was streamed that way.  vLLM's
 * and Mooncake's peers ignore the key: they keep the whole-request path. */
#define SIDE_CHANNEL_LAYERWISE_KEY "disagg_layerwise"
/* A pool fetch (docs/kv_pool.md): in a pull of one request, the token ids of the prefix
 * whose cached KV the pulling instance wants.  The transfer id then names no request of
 * the producer: it pins the cached blocks of these tokens' full blocks (its device cache,
 * else its offload tiers), writes the tail the pull's block ids ask for, and releases them;
 * a prefix it no longer holds whole fails the request ("no longer holds").  vLLM's
 * peers do not know it (they answer "no such transfer" after their timeout). */
#define SIDE_CHANNEL_POOL_TOKENS_KEY "disagg_pool_tokens"
#define SIDE_CHANNEL_MAX_POOL_TOKENS (1u << 21) /* token ids of one pool fetch */

/* One KV group's newly allocated block ids on D. */
typedef struct side_channel_block_group {
    int64_t *ids; /* (n) block ids */
    size_t n;
} side_channel_block_group;

/* req_blocks[req_id] = [transfer_id, [[ids], ...]] */
typedef struct side_channel_req_blocks {
    char *req_id;                     /* D's request id (map key) */
    char *transfer_id;                /* shared P/D id, "xfer-<uuid4>" */
    side_channel_block_group *groups; /* (n_groups); 0 groups = release, nothing to send */
    size_t n_groups;
} side_channel_req_blocks;

/* Pull request D -> P (MooncakeXferMetadata). */
typedef struct side_channel_pull {
    char *remote_hostname;         /* D's transfer-engine host */
    int64_t remote_port;           /* D's transfer-engine port, 1..65535 */
    int64_t remote_tp_size;        /* >= 1 */
    int64_t remote_tp_rank;        /* 0..remote_tp_size-1 */
    side_channel_req_blocks *reqs; /* (n_reqs) */
    size_t n_reqs;
    uint64_t *kv_caches_base_addr; /* (n_regions) base address of each of D's regions */
    int64_t *block_lens;           /* (n_regions) byte stride between blocks */
    int64_t *kv_block_lens;        /* (n_regions) payload bytes per block, <= block_len */
    size_t n_regions;
    char **registered_layer_names; /* (n_layer_names) optional, 0 = absent */
    size_t n_layer_names;
    int64_t *registered_layer_indices; /* (n_layer_indices) optional */
    size_t n_layer_indices;
    int64_t *registered_group_indices; /* (n_group_indices) optional */
    size_t n_group_indices;
    int64_t remote_pp_size; /* default 1 */
    char *layout;           /* "disagg_layout" fingerprint, NULL = absent (vLLM peer) */
    int layerwise;          /* "disagg_layerwise": true (anything else reads as 0) */
    int64_t *pool_tokens;   /* (n_pool_tokens) "disagg_pool_tokens", 0 = absent */
    size_t n_pool_tokens;
    void *arena;            /* decode: owns every pointer above; NULL when built by hand */
} side_channel_pull;

typedef enum side_channel_status {
    SIDE_CHANNEL_FINISH = 0,   /* last reply of a pull */
    SIDE_CHANNEL_CONTINUE = 1, /* more replies follow */
    SIDE_CHANNEL_ERROR = 2,    /* the whole pull failed, see err_msg */
} side_channel_status;

/* Reply P -> D (MooncakeXferResponse). */
typedef struct side_channel_reply {
    side_channel_status status;
    char **ok_reqs; /* (n_ok) D request ids whose blocks were written */
    size_t n_ok;
    char **err_reqs; /* (n_err) D request ids that failed */
    size_t n_err;
    char *err_msg; /* NULL = absent */
    /* "disagg_first_tokens": P's first output token of request ft_reqs[i] is
     * ft_tokens[i] (n_ft = 0: absent, a vLLM peer).  Decoding keeps only entries
     * of the form "<req id>": [one integer 0..INT32_MAX] and drops others. */
    char **ft_reqs;
    int32_t *ft_tokens;
    size_t n_ft;
    /* "disagg_unknown_reqs" (SIDE_CHANNEL_UNKNOWN_KEY): D request ids whose
     * transfer id the producer does not know yet.  Lenient: a malformed value
     * is dropped (n_unknown 0). */
    char **unknown_reqs;
    size_t n_unknown;
    /* "disagg_layerwise" (SIDE_CHANNEL_LAYERWISE_KEY): D request ids whose KV the producer
     * streamed layer by layer.  Lenient like unknown_reqs. */
    char **lw_reqs;
    size_t n_lw;
    void *arena; /* decode: owns the pointers above */
} side_channel_reply;

/* Encode into a malloc'd buffer (*out, *out_len; free() it).  Defaults are
 * omitted: empty registered_* lists, remote_pp_size 1, NULL layout; in a reply,
 * empty ok/err lists and a NULL err_msg. */
int side_channel_pull_encode(const side_channel_pull *p, char **out, size_t *out_len);
int side_channel_reply_encode(const side_channel_reply *r, char **out, size_t *out_len);

/* Decode one message (the whole buffer).  On success *out owns its memory:
 * release with *_free.  On failure *out is zeroed and err says why. */
int side_channel_pull_decode(const void *buf, size_t len, side_channel_pull *out, char *err,
                             size_t err_cap);
int side_channel_reply_decode(const void *buf, size_t len, side_channel_reply *out, char *err,
                              size_t err_cap);
void side_channel_pull_free(side_channel_pull *p);
void side_channel_reply_free(side_channel_reply *r);

const char *side_channel_status_name(side_channel_status s);

/* ---- cancel (a disagg extension, D -> P on the pull's own DEALER) --------
 * {"disagg_cancel": {"<req_id>": "<transfer_id>", ...}}: "stop serving these
 * requests of my pull".  The producer answers with the pull's final FINISH
 * (the cancelled requests in err_reqs) once no write into the decoder's
 * blocks for them can happen any more: that FINISH is the acknowledgement.
 * A peer that does not know the message (vLLM) answers ERROR (it does not
 * decode as a pull), which the decoder reads as "no acknowledgement". */
#define SIDE_CHANNEL_CANCEL_KEY "disagg_cancel"

typedef struct side_channel_cancel {
    char **req_ids;      /* (n) */
    char **transfer_ids; /* (n) */
    size_t n;
    void *arena; /* decode: owns the pointers above */
} side_channel_cancel;

int side_channel_cancel_encode(const side_channel_cancel *c, char **out, size_t *out_len);
/* 0: buf is a cancel, decoded into *out (release with side_channel_cancel_free);
 * 1: buf is a msgpack map without the cancel key (decode it as a pull);
 * < 0: a malformed cancel or not a msgpack map, err says why. */
int side_channel_cancel_decode(const void *buf, size_t len, side_channel_cancel *out, char *err,
                               size_t err_cap);
void side_channel_cancel_free(side_channel_cancel *c);

#endif
