/*
 * pd_request — the request rewriting of PROTOCOL.md section 1: the body the
 * prefill instance gets (max_tokens 1, stream false, stream_options removed,
 * kv_transfer_params do_remote_decode) and the body the decode instance gets
 * (client's body plus kv_transfer_params do_remote_prefill with P's
 * engine_id, bootstrap address and the shared transfer_id, ids from
 * base/uuid.h); and parsing of a bootstrap server's GET /query table
 * (section 2).  Pure functions on jansson values, no I/O.
 */
#ifndef DISAGG_PROXY_PD_REQUEST_H
#define DISAGG_PROXY_PD_REQUEST_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "base/uuid.h"

#define PD_UUID_LEN UUID_STR_LEN /* "xxxxxxxx-xxxx-4xxx-yxxx-xxxxxxxxxxxx" */

/* Parses a client body: must be a JSON object.  Returns 0 and a new
 * reference, or -EINVAL with a message for the client in err. */
int pd_parse_client_body(const char *buf, size_t len, json_t **out, char *err, size_t errcap);

/* The checks the proxy makes before contacting any instance: the fields that
 * P's copy rewrites (n, best_of, max_tokens, max_completion_tokens,
 * min_tokens, stream, stream_options), so that P could not reject them while
 * D does and P would then hold the request's KV for nothing; and the prompt
 * (completions) or messages (chat) being there.  The rules and wording are
 * `disagg serve`'s (src/server/openai_request.c) for these fields only; all
 * other fields are left to the instances.  Returns 0, or -EINVAL with the
 * offending field in param and a message for the client in msg. */
int pd_check_client_body(const json_t *body, int chat, char *param, size_t pcap, char *msg,
                         size_t mcap);

/* The prefill body (new reference) for client body `client`: n 1 and no
 * best_of (P prefills once; D generates the best_of sequences), also without min_tokens /
 * min_completion_tokens, which a 1-token request cannot honour. */
json_t *pd_prefill_body(const json_t *client, const char *transfer_id);
/* The same for the request of path: /v1/responses limits P with max_output_tokens 1 (its
 * field; max_tokens is not one of the Responses API), the other paths with max_tokens 1. */
json_t *pd_prefill_body_for(const json_t *client, const char *transfer_id, const char *path);
/* /v1/responses and /v1/messages: the fields P's copy rewrites (max_output_tokens or
 * max_tokens, stream) checked as the server checks them; 0 or -EINVAL as
 * pd_check_client_body. */
int pd_check_api_body(const json_t *body, const char *path, char *param, size_t pcap, char *msg,
                      size_t mcap);
/* The decode body (new reference). */
json_t *pd_decode_body(const json_t *client, const char *remote_engine_id,
                       const char *remote_bootstrap_addr, const char *transfer_id);

/* One row of a bootstrap /query table. */
typedef struct pd_engine {
    int dp_rank;     /* data-parallel rank (the JSON key) */
    char *engine_id; /* that rank's engine id (malloc'ed) */
    int tp_size;     /* number of tp ranks registered under worker_addr */
} pd_engine;

/* Parses `{"0": {"engine_id": "...", "worker_addr": {...}}, ...}` into
 * (*n) rows sorted by dp_rank.  Returns 0, or -EINVAL with a message naming
 * the bad part.  An empty table is -ENOENT (nothing registered yet). */
int pd_parse_query(const char *buf, size_t len, pd_engine **rows, int *n, char *err, size_t errcap);
void pd_engines_free(pd_engine *rows, int n);

/* The routing key of --policy prefix: a hash of the first nbytes of the
 * prompt ("prompt": a string, the first of a list of strings, or token ids
 * as JSON; "messages": their compact JSON), never 0; 0 when the body has
 * neither. */
uint64_t pd_prefix_hash(const json_t *client, size_t nbytes);

#endif
