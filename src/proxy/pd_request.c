/* pd_request — see pd_request.h. */
#include "proxy/pd_request.h"

#include "base/text.h"
#include "proxy/policy.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int pd_parse_client_body(const char *buf, size_t len, json_t **out, char *err, size_t errcap) {
    json_error_t je;
    json_t *j = json_loadb(buf, len, JSON_ALLOW_NUL, &je); /* "\u0000" is valid JSON */
    if (!j) {
        snprintf(err, errcap, "request body is not valid JSON: %s (line %d, column %d)", je.text,
                 je.line, je.column);
        return -EINVAL;
    }
    if (!json_is_object(j)) {
        snprintf(err, errcap, "request body must be a JSON object, got a JSON %s",
                 json_is_array(j)     ? "array"
                 : json_is_string(j)  ? "string"
                 : json_is_null(j)    ? "null"
                 : json_is_boolean(j) ? "boolean"
                                      : "number");
        json_decref(j);
        return -EINVAL;
    }
    *out = j;
    return 0;
}

json_t *pd_prefill_body(const json_t *client, const char *transfer_id) {
    return pd_prefill_body_for(client, transfer_id, "/v1/completions");
}

json_t *pd_prefill_body_for(const json_t *client, const char *transfer_id, const char *path) {
    json_t *b = json_deep_copy(client);
    if (!b) return NULL;
    if (!strcmp(path, "/v1/responses"))
        json_object_set_new(b, "max_output_tokens", json_integer(1));
    else
        json_object_set_new(b, "max_tokens", json_integer(1));
    if (json_object_get(b, "max_completion_tokens"))
        json_object_set_new(b, "max_completion_tokens", json_integer(1));
    json_object_set_new(b, "stream", json_false());
    json_object_del(b, "stream_options");
    /* min_tokens > 1 contradicts max_tokens 1 and a server rejects it (vLLM's
     * own proxy drops these for P too); D still gets them. */
    json_object_del(b, "min_tokens");
    json_object_del(b, "min_completion_tokens");
    /* n > 1: P prefills the prompt once; D decodes the n choices on its KV.
     * best_of (>= n) is D's: P's copy drops it. */
    if (json_object_get(b, "n")) json_object_set_new(b, "n", json_integer(1));
    json_object_del(b, "best_of");
    json_object_set_new(b, "kv_transfer_params",
                        json_pack("{s:b, s:b, s:s}", "do_remote_decode", 1, "do_remote_prefill", 0,
                                  "transfer_id", transfer_id));
    return b;
}

/* ---- the checks of pd_check_client_body -------------------------------- */

static int refuse(char *param, size_t pcap, char *msg, size_t mcap, const char *key,
                  const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static int refuse(char *param, size_t pcap, char *msg, size_t mcap, const char *key,
                  const char *fmt, ...) {
    snprintf(param, pcap, "%s", key);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, mcap, fmt, ap);
    va_end(ap);
    return -EINVAL;
}

/* An integer in [lo, hi] as `disagg serve` reads it (an integral float is
 * accepted, as pydantic does): 1 and *out when present, 0 when absent or
 * null, -EINVAL with the server's wording otherwise. */
static int check_int(const json_t *o, const char *key, long long lo, long long hi, long long *out,
                     char *param, size_t pcap, char *msg, size_t mcap) {
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    long long x;
    if (json_is_integer(v))
        x = json_integer_value(v);
    else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
             fabs(json_real_value(v)) < 9e15)
        x = (long long)json_real_value(v);
    else
        return refuse(param, pcap, msg, mcap, key,
                      "'%s' must be an integer between %lld and %lld, got %s", key, lo, hi,
                      text_json_kind(v));
    if (x < lo || x > hi)
        return refuse(param, pcap, msg, mcap, key,
                      "'%s' must be an integer between %lld and %lld, got %lld", key, lo, hi, x);
    *out = x;
    return 1;
}

int pd_check_api_body(const json_t *b, const char *path, char *param, size_t pcap, char *msg,
                      size_t mcap) {
    param[0] = msg[0] = 0;
    int responses = !strcmp(path, "/v1/responses");
    const char *key = responses ? "max_output_tokens" : "max_tokens";
    const json_t *v = json_object_get(b, key);
    if (!responses && !v)
        return refuse(param, pcap, msg, mcap, key, "'max_tokens' is required: a positive integer");
    if (v && !json_is_null(v) && (!json_is_integer(v) || json_integer_value(v) < 1))
        return refuse(param, pcap, msg, mcap, key, "'%s' must be a positive integer", key);
    const json_t *st = json_object_get(b, "stream");
    if (st && !json_is_null(st) && !json_is_boolean(st))
        return refuse(param, pcap, msg, mcap, "stream",
                      "'stream' must be a boolean (true or false), got %s", text_json_kind(st));
    return 0;
}

int pd_check_client_body(const json_t *b, int chat, char *param, size_t pcap, char *msg,
                         size_t mcap) {
    param[0] = msg[0] = 0;
#define CHECK_INT(key, lo, hi, out)                                                                \
    if ((rc = check_int(b, key, lo, hi, out, param, pcap, msg, mcap)) < 0) return rc
    int rc;
    if (chat) {
        const json_t *m = json_object_get(b, "messages");
        if (!m || json_is_null(m))
            return refuse(param, pcap, msg, mcap, "messages",
                          "'messages' is required: a non-empty list of messages");
        if (!json_is_array(m) || json_array_size(m) == 0)
            return refuse(param, pcap, msg, mcap, "messages",
                          "'messages' must be a non-empty list of message objects, got %s",
                          json_is_array(m) ? "an empty list" : text_json_kind(m));
    } else {
        const json_t *p = json_object_get(b, "prompt");
        const char *accepted = "a string, a list of strings, a list of token ids or a list of "
                               "lists of token ids";
        if (!p || json_is_null(p))
            return refuse(param, pcap, msg, mcap, "prompt", "'prompt' is required: %s", accepted);
        if (!json_is_string(p) && !json_is_array(p))
            return refuse(param, pcap, msg, mcap, "prompt", "'prompt' must be %s, got %s", accepted,
                          text_json_kind(p));
    }
    long long n = 1, best_of = 0, max_tokens = -1, min_tokens = 0;
    CHECK_INT("n", 1, INT32_MAX, &n);
    rc = check_int(b, "best_of", 1, INT32_MAX, &best_of, param, pcap, msg, mcap);
    if (rc < 0) return rc;
    if (rc == 1 && best_of < n) /* P's copy drops it, D would refuse it */
        return refuse(param, pcap, msg, mcap, "best_of", "'best_of' (%lld) must be at least 'n' (%lld)",
                      best_of, n);
    CHECK_INT("max_tokens", 1, INT32_MAX, &max_tokens);
    if (chat) CHECK_INT("max_completion_tokens", 1, INT32_MAX, &max_tokens); /* it wins */
    CHECK_INT("min_tokens", 0, INT32_MAX, &min_tokens);
    if (max_tokens > 0 && min_tokens > max_tokens)
        return refuse(param, pcap, msg, mcap, "min_tokens",
                      "'min_tokens' (%lld) must be at most max_tokens (%lld)", min_tokens,
                      max_tokens);
#undef CHECK_INT
    const json_t *st = json_object_get(b, "stream");
    if (st && !json_is_null(st) && !json_is_boolean(st))
        return refuse(param, pcap, msg, mcap, "stream",
                      "'stream' must be a boolean (true or false), got %s", text_json_kind(st));
    int stream = json_is_true(st);
    const json_t *so = json_object_get(b, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so))
            return refuse(param, pcap, msg, mcap, "stream_options",
                          "'stream_options' must be an object, got %s", text_json_kind(so));
        if (!stream)
            return refuse(param, pcap, msg, mcap, "stream_options",
                          "'stream_options' can only be set when 'stream' is true");
    }
    if (stream && best_of > n)
        return refuse(param, pcap, msg, mcap, "best_of",
                      "'best_of' (%lld) greater than 'n' (%lld) cannot be streamed: the best "
                      "sequences are known only at the end; accepted with stream: best_of equal to n",
                      best_of, n);
    const json_t *plp = json_object_get(b, "prompt_logprobs");
    if (stream && plp && !json_is_null(plp))
        return refuse(param, pcap, msg, mcap, "prompt_logprobs",
                      "'prompt_logprobs' is not available when 'stream' is true");
    return 0;
}

json_t *pd_decode_body(const json_t *client, const char *remote_engine_id,
                       const char *remote_bootstrap_addr, const char *transfer_id) {
    json_t *b = json_deep_copy(client);
    if (!b) return NULL;
    json_object_set_new(b, "kv_transfer_params",
                        json_pack("{s:b, s:b, s:s, s:s, s:s}", "do_remote_decode", 0,
                                  "do_remote_prefill", 1, "remote_engine_id", remote_engine_id,
                                  "remote_bootstrap_addr", remote_bootstrap_addr, "transfer_id",
                                  transfer_id));
    return b;
}

static int cmp_rank(const void *a, const void *b) {
    return ((const pd_engine *)a)->dp_rank - ((const pd_engine *)b)->dp_rank;
}

int pd_parse_query(const char *buf, size_t len, pd_engine **rows, int *n, char *err,
                   size_t errcap) {
    *rows = NULL;
    *n = 0;
    json_error_t je;
    json_t *j = json_loadb(buf, len, 0, &je);
    if (!j || !json_is_object(j)) {
        snprintf(err, errcap, "bootstrap /query answer is not a JSON object%s%s", j ? "" : ": ",
                 j ? "" : je.text);
        json_decref(j);
        return -EINVAL;
    }
    size_t cnt = json_object_size(j);
    if (cnt == 0) {
        snprintf(err, errcap, "bootstrap /query table is empty (no prefill rank registered yet)");
        json_decref(j);
        return -ENOENT;
    }
    pd_engine *r = calloc(cnt, sizeof *r);
    if (!r) {
        json_decref(j);
        return -ENOMEM;
    }
    int k = 0, rc = 0;
    const char *key;
    json_t *v;
    json_object_foreach(j, key, v) {
        char *end;
        long rank = strtol(key, &end, 10);
        const char *eid = json_string_value(json_object_get(v, "engine_id"));
        if (!isdigit((unsigned char)*key) || *end || rank < 0 || rank > 65535) {
            snprintf(err, errcap, "bootstrap /query key '%s' is not a dp rank (0..65535)", key);
            rc = -EINVAL;
            break;
        }
        if (!json_is_object(v) || !eid || !*eid) {
            snprintf(err, errcap, "bootstrap /query entry for dp rank %s has no engine_id string",
                     key);
            rc = -EINVAL;
            break;
        }
        json_t *wa = json_object_get(v, "worker_addr");
        r[k].dp_rank = (int)rank;
        r[k].engine_id = strdup(eid);
        r[k].tp_size = json_is_object(wa) ? (int)json_object_size(wa) : 0;
        k++;
    }
    json_decref(j);
    if (rc) {
        pd_engines_free(r, k);
        return rc;
    }
    qsort(r, (size_t)k, sizeof *r, cmp_rank);
    for (int i = 1; i < k; i++)
        if (r[i].dp_rank == r[i - 1].dp_rank) { /* "0" and "00" */
            snprintf(err, errcap, "bootstrap /query lists dp rank %d twice", r[i].dp_rank);
            pd_engines_free(r, k);
            return -EINVAL;
        }
    *rows = r;
    *n = k;
    return 0;
}

void pd_engines_free(pd_engine *rows, int n) {
    for (int i = 0; i < n; i++)
        free(rows[i].engine_id);
    free(rows);
}

uint64_t pd_prefix_hash(const json_t *client, size_t nbytes) {
    const json_t *prompt = json_object_get(client, "prompt");
    if (json_is_array(prompt) && json_is_string(json_array_get(prompt, 0)))
        prompt = json_array_get(prompt, 0);
    if (json_is_string(prompt)) {
        size_t n = json_string_length(prompt);
        return policy_hash(json_string_value(prompt), n < nbytes ? n : nbytes);
    }
    const json_t *src = prompt ? prompt : json_object_get(client, "messages");
    if (!src) return 0;
    char *txt = json_dumps(src, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!txt) return 0;
    size_t n = strlen(txt);
    uint64_t h = policy_hash(txt, n < nbytes ? n : nbytes);
    free(txt);
    return h;
}
