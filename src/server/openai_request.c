/*
 * openai_request — request JSON → validated oai_request (see
 * openai_request.h).  One getter per JSON type names the field and the
 * accepted values when it refuses one.
 */
#include "base/text.h"
#include "server/openai_request.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void oai_error_set(oai_error *e, int status, const char *type, const char *param, const char *fmt,
                   ...) {
    e->status = status;
    e->type = type;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
}

char *oai_error_json(const oai_error *e) {
    json_t *inner = json_pack("{s:s, s:s, s:o, s:i}", "message", e->message, "type",
                              e->type ? e->type : "BadRequestError", "param",
                              e->param[0] ? json_string(e->param) : json_null(), "code", e->status);
    if (!inner) return NULL;
    json_t *root = json_pack("{s:o}", "error", inner);
    if (!root) return NULL;
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

void oai_defaults_init(oai_defaults *d) {
    memset(d, 0, sizeof *d);
    d->temperature = 1.0f;
    d->top_p = 1.0f;
    d->top_k = 0;
    d->repetition_penalty = 1.0f;
    d->max_logprobs = -1; /* no cap below OAI_MAX_LOGPROBS */
    d->max_tokens = -1;
}

#define OVERRIDE_KEYS "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens"

int oai_defaults_override(oai_defaults *d, const char *text, char *err, size_t errlen) {
    if (!text || !*text) return 0;
    json_error_t je;
    json_t *o = json_loads(text, JSON_REJECT_DUPLICATES, &je);
    if (!json_is_object(o)) {
        snprintf(err, errlen,
                 "expected a JSON object such as '{\"temperature\": 0.5}' (%s); accepted keys: "
                 "" OVERRIDE_KEYS,
                 o ? "got another JSON value" : je.text);
        json_decref(o);
        return -EINVAL;
    }
    oai_defaults n = *d;
    const char *k;
    json_t *v;
    int rc = 0;
    json_object_foreach(o, k, v) {
        double x = json_number_value(v);
        int num = json_is_number(v), integer = json_is_integer(v);
        const char *want = NULL;
        if (!strcmp(k, "temperature")) {
            if (num && x >= 0 && x <= 1e6)
                n.temperature = x < 1e-5 ? 0.0f : (float)x;
            else
                want = "a number >= 0";
        } else if (!strcmp(k, "top_p")) {
            if (num && x > 0 && x <= 1)
                n.top_p = (float)x;
            else
                want = "a number in (0, 1]";
        } else if (!strcmp(k, "top_k")) {
            if (integer && x >= -1 && x <= INT32_MAX)
                n.top_k = x < 0 ? 0 : (int)x;
            else
                want = "an integer >= -1 (-1 or 0: disabled)";
        } else if (!strcmp(k, "min_p")) {
            if (num && x >= 0 && x <= 1)
                n.min_p = (float)x;
            else
                want = "a number in [0, 1]";
        } else if (!strcmp(k, "repetition_penalty")) {
            if (num && x > 0 && x <= 1e6)
                n.repetition_penalty = (float)x;
            else
                want = "a number > 0";
        } else if (!strcmp(k, "max_new_tokens")) {
            if (integer && x >= 1 && x <= INT32_MAX)
                n.max_tokens = (int)x;
            else
                want = "an integer >= 1";
        } else {
            snprintf(err, errlen, "unknown key '%s'; accepted keys: " OVERRIDE_KEYS, k);
            rc = -EINVAL;
            break;
        }
        if (want) {
            char *vs = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
            snprintf(err, errlen, "'%s' must be %s, got %s", k, want, vs ? vs : "?");
            free(vs);
            rc = -EINVAL;
            break;
        }
    }
    json_decref(o);
    if (!rc) *d = n;
    return rc;
}

/* ---- typed getters ------------------------------------------------------
 * Each returns 1 when the field is present (and stores it), 0 when absent or
 * null (leaving the default), -EINVAL with err filled when it is invalid. */

static int bad(oai_error *err, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int bad(oai_error *err, const char *key, const char *fmt, ...) {
    char msg[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    oai_error_set(err, 400, "BadRequestError", key, "%s", msg);
    return -EINVAL;
}

static int get_bool(const json_t *o, const char *key, bool *out, oai_error *err) {
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v))
        return bad(err, key, "'%s' must be a boolean (true or false), got %s", key,
                   text_json_kind(v));
    *out = json_is_true(v);
    return 1;
}

/* Integers; a float with no fractional part is accepted as pydantic does. */
static int get_i64(const json_t *o, const char *key, long long lo, long long hi, long long *out,
                   oai_error *err) {
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    long long x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9e15) {
        x = (long long)json_real_value(v);
    } else {
        return bad(err, key, "'%s' must be an integer between %lld and %lld, got %s", key, lo, hi,
                   text_json_kind(v));
    }
    if (x < lo || x > hi)
        return bad(err, key, "'%s' must be an integer between %lld and %lld, got %lld", key, lo, hi,
                   x);
    *out = x;
    return 1;
}

static int get_int(const json_t *o, const char *key, int lo, int hi, int *out, oai_error *err) {
    long long x;
    int rc = get_i64(o, key, lo, hi, &x, err);
    if (rc == 1) *out = (int)x;
    return rc;
}

/* Numbers in [lo, hi] (lo_open: lo itself refused). */
static int get_num(const json_t *o, const char *key, double lo, int lo_open, double hi, float *out,
                   oai_error *err) {
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    const char *range_fmt = lo_open ? "'%s' must be a number greater than %g and at most %g"
                                    : "'%s' must be a number between %g and %g";
    char range[160];
    snprintf(range, sizeof range, range_fmt, key, lo, hi);
    if (!json_is_number(v)) return bad(err, key, "%s, got %s", range, text_json_kind(v));
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || (lo_open && x == lo) || x > hi)
        return bad(err, key, "%s, got %g", range, x);
    *out = (float)x;
    return 1;
}

static int get_string(const json_t *o, const char *key, const char **out, oai_error *err) {
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_string(v))
        return bad(err, key, "'%s' must be a string, got %s", key, text_json_kind(v));
    if (strlen(json_string_value(v)) != json_string_length(v)) /* a name, not text */
        return bad(err, key, "'%s' must not contain NUL characters (\\u0000)", key);
    *out = json_string_value(v);
    return 1;
}

/* ---- prompts ----------------------------------------------------------- */

/* A JSON string's bytes, NULs included ("\u0000" is valid JSON and vLLM
 * accepts it), NUL-terminated for convenience; *len is its byte length. */
static char *dup_json_string(const json_t *v, size_t *len) {
    *len = json_string_length(v);
    char *p = malloc(*len + 1);
    if (!p) return NULL;
    memcpy(p, json_string_value(v), *len);
    p[*len] = 0;
    return p;
}

static int ids_from_array(const json_t *a, const char *key, int32_t **ids, int *n, oai_error *err) {
    size_t len = json_array_size(a);
    *ids = malloc((len ? len : 1) * sizeof **ids);
    if (!*ids) return bad(err, key, "out of memory");
    for (size_t i = 0; i < len; i++) {
        const json_t *t = json_array_get(a, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) > INT32_MAX) {
            free(*ids);
            *ids = NULL;
            return bad(err, key, "'%s' token ids must be non-negative integers; element %zu is %s",
                       key, i, json_is_integer(t) ? "negative or too large" : text_json_kind(t));
        }
        (*ids)[i] = (int32_t)json_integer_value(t);
    }
    *n = (int)len;
    return 0;
}

static int parse_prompt(oai_request *r, const json_t *body, oai_error *err) {
    const json_t *p = json_object_get(body, "prompt");
    const char *accepted = "a string, a list of strings, a list of token ids or a list of lists "
                           "of token ids";
    if (!p || json_is_null(p)) return bad(err, "prompt", "'prompt' is required: %s", accepted);
    if (json_is_string(p)) {
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts) return bad(err, "prompt", "out of memory");
        r->n_prompts = 1;
        r->prompts[0].text = dup_json_string(p, &r->prompts[0].text_len);
        if (!r->prompts[0].text) return bad(err, "prompt", "out of memory");
        if (r->prompts[0].text_len == 0) return bad(err, "prompt", "'prompt' must not be empty");
        return 0;
    }
    if (!json_is_array(p))
        return bad(err, "prompt", "'prompt' must be %s, got %s", accepted, text_json_kind(p));
    size_t len = json_array_size(p);
    if (len == 0) return bad(err, "prompt", "'prompt' must not be empty");
    const json_t *first = json_array_get(p, 0);
    if (json_is_integer(first)) { /* one prompt of ids */
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts) return bad(err, "prompt", "out of memory");
        r->n_prompts = 1;
        return ids_from_array(p, "prompt", &r->prompts[0].ids, &r->prompts[0].n_ids, err);
    }
    if (len > 1024)
        return bad(err, "prompt", "'prompt' holds %zu prompts; at most 1024 are accepted", len);
    r->prompts = calloc(len, sizeof *r->prompts);
    if (!r->prompts) return bad(err, "prompt", "out of memory");
    r->n_prompts = (int)len;
    for (size_t i = 0; i < len; i++) {
        const json_t *e = json_array_get(p, i);
        oai_prompt *op = &r->prompts[i];
        if (json_is_string(e) && json_is_string(first)) {
            op->text = dup_json_string(e, &op->text_len);
            if (!op->text) return bad(err, "prompt", "out of memory");
            if (op->text_len == 0) return bad(err, "prompt", "'prompt' element %zu is empty", i);
        } else if (json_is_array(e) && json_is_array(first)) {
            if (json_array_size(e) == 0)
                return bad(err, "prompt", "'prompt' element %zu is an empty token list", i);
            if (ids_from_array(e, "prompt", &op->ids, &op->n_ids, err)) return -EINVAL;
        } else {
            return bad(err, "prompt",
                       "'prompt' must be %s; element %zu is %s (mixed lists are not accepted)",
                       accepted, i, text_json_kind(e));
        }
    }
    return 0;
}

static int parse_stop(oai_request *r, const json_t *body, oai_error *err) {
    const json_t *s = json_object_get(body, "stop");
    if (!s || json_is_null(s)) return 0;
    size_t n = json_is_string(s) ? 1 : json_is_array(s) ? json_array_size(s) : 0;
    if (!json_is_string(s) && !json_is_array(s))
        return bad(err, "stop", "'stop' must be a string or a list of strings, got %s",
                   text_json_kind(s));
    if (n > OAI_MAX_STOPS)
        return bad(err, "stop", "'stop' holds %zu strings; at most %d are accepted", n,
                   OAI_MAX_STOPS);
    r->stop = calloc(n ? n : 1, sizeof *r->stop);
    if (!r->stop) return bad(err, "stop", "out of memory");
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_is_string(s) ? s : json_array_get(s, i);
        if (!json_is_string(e))
            return bad(err, "stop",
                       "'stop' must be a string or a list of strings; element %zu is %s", i,
                       text_json_kind(e));
        if (json_string_length(e) == 0 || strlen(json_string_value(e)) != json_string_length(e))
            return bad(err, "stop",
                       "'stop' strings must be non-empty and contain no NUL; element %zu is not",
                       i);
        r->stop[i] = strdup(json_string_value(e));
        if (!r->stop[i]) return bad(err, "stop", "out of memory");
        r->n_stop++;
    }
    return 0;
}

static int parse_stop_ids(oai_request *r, const json_t *body, oai_error *err) {
    const json_t *s = json_object_get(body, "stop_token_ids");
    if (!s || json_is_null(s)) return 0;
    if (!json_is_array(s))
        return bad(err, "stop_token_ids", "'stop_token_ids' must be a list of token ids, got %s",
                   text_json_kind(s));
    return ids_from_array(s, "stop_token_ids", &r->stop_token_ids, &r->n_stop_token_ids, err);
}

/* use_beam_search (vLLM's): beam width n, length_penalty, temperature, ignore_eos and
 * include_stop_str_in_output are what vLLM's beam search reads; the other sampling fields
 * would be dropped by it, so they are refused here naming the field. */
static int parse_beam_search(oai_request *r, const json_t *body, const oai_defaults *d,
                             oai_error *err) {
    r->length_penalty = 1.0f;
    if (get_bool(body, "use_beam_search", &r->use_beam_search, err) < 0) return -EINVAL;
    const json_t *lp = json_object_get(body, "length_penalty");
    if (lp && !json_is_null(lp)) {
        if (!json_is_number(lp) || !isfinite(json_number_value(lp)))
            return bad(err, "length_penalty", "'length_penalty' must be a number, got %s",
                       text_json_kind(lp));
        r->length_penalty = (float)json_number_value(lp);
    }
    if (!r->use_beam_search) return 0;
    int max_lp = d->max_logprobs >= 0 ? d->max_logprobs : OAI_MAX_LOGPROBS;
    if (2 * r->n > max_lp)
        return bad(err, "n",
                   "beam search with 'n' = %d asks for 2 * n = %d logprobs per step, more than the "
                   "maximum %d (--max-logprobs); accepted with use_beam_search: n from 1 to %d",
                   r->n, 2 * r->n, max_lp, max_lp / 2);
    static const char *const ignored[] = {
        "stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "top_p",
        "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
        "top_logprobs", "prompt_logprobs", "response_format", "structured_outputs",
        "guided_json", "guided_regex", "guided_choice", "guided_grammar"};
    for (size_t i = 0; i < sizeof ignored / sizeof *ignored; i++) {
        const json_t *v = json_object_get(body, ignored[i]);
        if (v && !json_is_null(v))
            return bad(err, ignored[i],
                       "'%s' is not applied by beam search (vLLM's beam search reads n, "
                       "max_tokens, temperature, length_penalty, ignore_eos and "
                       "include_stop_str_in_output); leave it out with use_beam_search",
                       ignored[i]);
    }
    if (r->best_of != r->n)
        return bad(err, "best_of", "'best_of' (%d) must equal 'n' (%d) with use_beam_search: the "
                   "beam width is n", r->best_of, r->n);
    if (r->logprobs >= 0)
        return bad(err, "logprobs",
                   "'logprobs' are not returned with use_beam_search; accepted: null%s",
                   r->kind == OAI_CHAT ? " or false" : "");
    if (r->echo) return bad(err, "echo", "'echo' is not available with use_beam_search");
    if (r->min_tokens > 0)
        return bad(err, "min_tokens", "'min_tokens' is not applied by beam search; accepted: 0");
    /* vLLM does not stream beam search on /v1/completions: the response is one JSON body */
    if (r->kind == OAI_COMPLETIONS) {
        r->stream = false;
        r->include_usage = r->continuous_usage_stats = false;
    }
    return 0;
}

static int parse_sampling(oai_request *r, const json_t *body, const oai_defaults *d,
                          oai_error *err) {
    engine_sampling *s = &r->sampling;
    s->temperature = d->temperature;
    s->top_p = d->top_p;
    s->top_k = d->top_k;
    s->min_p = d->min_p;
    s->repetition_penalty = d->repetition_penalty;
    s->presence_penalty = 0.0f;
    s->frequency_penalty = 0.0f;
    s->has_seed = 0;
    s->seed = 0;
    s->logprobs = -1;
    s->prompt_logprobs = -1;
    if (get_num(body, "temperature", 0.0, 0, 1e6, &s->temperature, err) < 0) return -EINVAL;
    if (s->temperature < 1e-5f) s->temperature = 0.0f; /* vLLM's _SAMPLING_EPS: greedy */
    if (get_num(body, "top_p", 0.0, 1, 1.0, &s->top_p, err) < 0) return -EINVAL;
    const json_t *tk = json_object_get(body, "top_k");
    if (tk && !json_is_null(tk)) {
        if (!json_is_integer(tk) || json_integer_value(tk) < -1 ||
            json_integer_value(tk) > INT32_MAX)
            return bad(err, "top_k",
                       "'top_k' must be -1 or 0 (disabled) or a positive integer, got %s",
                       json_is_integer(tk) ? "a value below -1" : text_json_kind(tk));
        s->top_k = (int)json_integer_value(tk);
        if (s->top_k < 0) s->top_k = 0;
    }
    if (get_num(body, "min_p", 0.0, 0, 1.0, &s->min_p, err) < 0) return -EINVAL;
    if (get_num(body, "presence_penalty", -2.0, 0, 2.0, &s->presence_penalty, err) < 0)
        return -EINVAL;
    if (get_num(body, "frequency_penalty", -2.0, 0, 2.0, &s->frequency_penalty, err) < 0)
        return -EINVAL;
    if (get_num(body, "repetition_penalty", 0.0, 1, 1e6, &s->repetition_penalty, err) < 0)
        return -EINVAL;
    long long seed;
    int rc = get_i64(body, "seed", INT64_MIN, INT64_MAX, &seed, err);
    if (rc < 0) return -EINVAL;
    if (rc == 1) {
        s->has_seed = 1;
        s->seed = (uint64_t)seed;
    }
    return 0;
}

/* logit_bias {"token id": bias}, allowed_token_ids [ids], bad_words ["text"] (vLLM's forms
 * and messages; token ids are checked against the vocabulary by the engine). */
static int parse_logit_processors(oai_request *r, const json_t *body, oai_error *err) {
    engine_sampling *s = &r->sampling;
    const json_t *v = json_object_get(body, "logit_bias");
    if (v && !json_is_null(v)) {
        if (!json_is_object(v))
            return bad(err, "logit_bias",
                       "'logit_bias' must be an object mapping token ids to biases, got %s",
                       text_json_kind(v));
        size_t n = json_object_size(v), i = 0;
        r->logit_bias_ids = malloc((n ? n : 1) * sizeof *r->logit_bias_ids);
        r->logit_bias = malloc((n ? n : 1) * sizeof *r->logit_bias);
        if (!r->logit_bias_ids || !r->logit_bias) return bad(err, "logit_bias", "out of memory");
        const char *key;
        const json_t *b;
        json_object_foreach((json_t *)v, key, b) {
            char *end;
            errno = 0;
            long long id = strtoll(key, &end, 10);
            if (!key[0] || *end || errno || id < 0 || id > INT32_MAX)
                return bad(err, "logit_bias",
                           "Found token_id `%s` in logit_bias but token_id must be an integer or "
                           "string representing an integer (a token id of the vocabulary)",
                           key);
            if (!json_is_number(b))
                return bad(err, "logit_bias", "logit_bias[\"%s\"] must be a number, got %s", key,
                           text_json_kind(b));
            double x = json_number_value(b);
            r->logit_bias_ids[i] = (int32_t)id;
            r->logit_bias[i++] = (float)(x < -100.0 ? -100.0 : x > 100.0 ? 100.0 : x);
        }
        s->logit_bias_ids = r->logit_bias_ids, s->logit_bias = r->logit_bias;
        s->n_logit_bias = (int)i;
    }
    v = json_object_get(body, "allowed_token_ids");
    if (v && !json_is_null(v)) {
        if (!json_is_array(v))
            return bad(err, "allowed_token_ids",
                       "'allowed_token_ids' must be a list of token ids, got %s",
                       text_json_kind(v));
        if (json_array_size(v) == 0)
            return bad(err, "allowed_token_ids",
                       "'allowed_token_ids' is empty: give at least one token id, or null");
        if (ids_from_array(v, "allowed_token_ids", &r->allowed_token_ids,
                           &s->n_allowed_token_ids, err))
            return -EINVAL;
        s->allowed_token_ids = r->allowed_token_ids;
    }
    v = json_object_get(body, "bad_words");
    if (v && !json_is_null(v)) {
        if (!json_is_array(v))
            return bad(err, "bad_words", "'bad_words' must be a list of strings, got %s",
                       text_json_kind(v));
        size_t n = json_array_size(v);
        if (n > 128)
            return bad(err, "bad_words", "'bad_words' holds %zu words; at most 128 are accepted",
                       n);
        r->bad_words = calloc(n ? n : 1, sizeof *r->bad_words);
        if (!r->bad_words) return bad(err, "bad_words", "out of memory");
        for (size_t i = 0; i < n; i++) {
            const json_t *w = json_array_get(v, i);
            if (!json_is_string(w) || json_string_length(w) == 0)
                return bad(err, "bad_words", "'bad_words' element %zu must be a non-empty string, "
                           "got %s", i, json_is_string(w) ? "an empty string" : text_json_kind(w));
            size_t len;
            r->bad_words[i] = dup_json_string(w, &len);
            if (!r->bad_words[i]) return bad(err, "bad_words", "out of memory");
            r->n_bad_words = (int)i + 1;
        }
    }
    return 0;
}

static int parse_stream(oai_request *r, const json_t *body, oai_error *err) {
    if (get_bool(body, "stream", &r->stream, err) < 0) return -EINVAL;
    const json_t *so = json_object_get(body, "stream_options");
    if (!so || json_is_null(so)) return 0;
    if (!json_is_object(so))
        return bad(err, "stream_options", "'stream_options' must be an object, got %s",
                   text_json_kind(so));
    if (!r->stream)
        return bad(err, "stream_options", "'stream_options' can only be set when 'stream' is true");
    if (get_bool(so, "include_usage", &r->include_usage, err) < 0) return -EINVAL;
    if (get_bool(so, "continuous_usage_stats", &r->continuous_usage_stats, err) < 0) return -EINVAL;
    return 0;
}

int oai_model_name_ok(const oai_defaults *d, const char *m) {
    if (d->served_model_name && !strcmp(m, d->served_model_name)) return 1;
    if (d->model_path && !strcmp(m, d->model_path)) return 1;
    for (int i = 0; i < d->n_model_aliases; i++)
        if (d->model_aliases[i] && !strcmp(m, d->model_aliases[i])) return 1;
    return 0;
}

void oai_model_names_list(const oai_defaults *d, char *out, size_t cap) {
    size_t o = 0;
    if (cap) out[0] = 0;
    for (int i = -1; i < d->n_model_aliases && o < cap; i++) {
        const char *n = i < 0 ? d->served_model_name : d->model_aliases[i];
        if (!n) continue;
        int w = snprintf(out + o, cap - o, "%s\"%s\"", o ? ", " : "", n);
        if (w < 0) break;
        o += (size_t)w;
    }
}

static int parse_model(oai_request *r, const json_t *body, const oai_defaults *d, oai_error *err) {
    const char *m = NULL;
    if (get_string(body, "model", &m, err) < 0) return -EINVAL;
    if (!m) return 0;
    r->model = strdup(m);
    if (!r->model) return bad(err, "model", "out of memory");
    if (oai_model_name_ok(d, m)) return 0;
    char names[512];
    oai_model_names_list(d, names, sizeof names);
    oai_error_set(err, 404, "NotFoundError", "model",
                  "The model `%s` does not exist. Accepted: %s (see GET /v1/models)", m, names);
    return -EINVAL;
}

static int parse_chat(oai_request *r, const json_t *body, oai_error *err) {
    const json_t *m = json_object_get(body, "messages");
    if (!m || json_is_null(m))
        return bad(err, "messages", "'messages' is required: a non-empty list of messages");
    if (!json_is_array(m) || json_array_size(m) == 0)
        return bad(err, "messages",
                   "'messages' must be a non-empty list of message objects, got %s",
                   json_is_array(m) ? "an empty list" : text_json_kind(m));
    for (size_t i = 0; i < json_array_size(m); i++)
        if (!json_is_object(json_array_get(m, i)))
            return bad(err, "messages",
                       "'messages' element %zu must be an object with 'role' and 'content', got %s",
                       i, text_json_kind(json_array_get(m, i)));
    r->messages = json_incref((json_t *)m);
    const json_t *t = json_object_get(body, "tools");
    if (t && !json_is_null(t)) {
        if (!json_is_array(t))
            return bad(err, "tools", "'tools' must be a list of tool objects, got %s",
                       text_json_kind(t));
        for (size_t i = 0; i < json_array_size(t); i++) {
            const json_t *e = json_array_get(t, i);
            const json_t *f = json_object_get(e, "function");
            const json_t *ty = json_object_get(e, "type");
            if (!json_is_object(e) || !json_is_object(f) ||
                !json_is_string(json_object_get(f, "name")) ||
                (ty && !(json_is_string(ty) && !strcmp(json_string_value(ty), "function"))))
                return bad(err, "tools",
                           "'tools' element %zu must be {\"type\": \"function\", \"function\": "
                           "{\"name\": ..., \"parameters\": ...}}",
                           i);
        }
        if (json_array_size(t) > 0) r->tools = json_incref((json_t *)t);
    }
    const json_t *tc = json_object_get(body, "tool_choice");
    bool auto_choice = true;
    if (tc && !json_is_null(tc)) {
        if (json_is_string(tc) && !strcmp(json_string_value(tc), "none"))
            auto_choice = false;
        else if (!(json_is_string(tc) && (!strcmp(json_string_value(tc), "auto") ||
                                          !strcmp(json_string_value(tc), "required"))) &&
                 !(json_is_object(tc) &&
                   json_is_string(json_object_get(json_object_get(tc, "function"), "name"))))
            return bad(err, "tool_choice",
                       "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": "
                       "\"function\", \"function\": {\"name\": ...}}");
    }
    r->parse_tool_calls = r->tools && auto_choice;
    r->add_generation_prompt = true;
    if (get_bool(body, "add_generation_prompt", &r->add_generation_prompt, err) < 0) return -EINVAL;
    bool cont = false;
    if (get_bool(body, "continue_final_message", &cont, err) < 0) return -EINVAL;
    if (cont)
        return bad(err, "continue_final_message",
                   "'continue_final_message' is not supported; accepted: false");
    const json_t *ctk = json_object_get(body, "chat_template_kwargs");
    if (ctk && !json_is_null(ctk) && !json_is_object(ctk))
        return bad(err, "chat_template_kwargs",
                   "'chat_template_kwargs' must be an object of template variables (e.g. "
                   "{\"enable_thinking\": false}), got %s",
                   text_json_kind(ctk));
    if (json_is_object(ctk)) r->chat_template_kwargs = json_incref((json_t *)ctk);
    const char *tmpl = NULL;
    if (get_string(body, "chat_template", &tmpl, err) < 0) return -EINVAL;
    if (tmpl)
        return bad(err, "chat_template",
                   "a per-request 'chat_template' is not supported; the model's template is used");
    bool echo = false;
    if (get_bool(body, "echo", &echo, err) < 0) return -EINVAL;
    if (echo)
        return bad(err, "echo", "'echo' is not supported for chat completions; accepted: false");
    /* logprobs: bool + top_logprobs */
    bool lp = false;
    if (get_bool(body, "logprobs", &lp, err) < 0) return -EINVAL;
    int top = -1;
    if (get_int(body, "top_logprobs", 0, OAI_MAX_LOGPROBS, &top, err) < 0) return -EINVAL;
    if (top >= 0 && !lp)
        return bad(err, "top_logprobs", "'top_logprobs' needs 'logprobs' set to true");
    r->logprobs = lp ? (top < 0 ? 0 : top) : -1;
    /* max_completion_tokens wins over the deprecated max_tokens */
    int mt = -1;
    if (get_int(body, "max_tokens", 1, INT32_MAX, &mt, err) < 0) return -EINVAL;
    if (get_int(body, "max_completion_tokens", 1, INT32_MAX, &mt, err) < 0) return -EINVAL;
    r->max_tokens = mt;
    return 0;
}

static int parse_completions(oai_request *r, const json_t *body, oai_error *err) {
    if (parse_prompt(r, body, err)) return -EINVAL;
    const json_t *sfx = json_object_get(body, "suffix");
    if (sfx && !json_is_null(sfx) && !(json_is_string(sfx) && json_string_length(sfx) == 0))
        return bad(err, "suffix", "'suffix' is not supported; accepted: null");
    if (get_int(body, "logprobs", 0, OAI_MAX_LOGPROBS, &r->logprobs, err) < 0) return -EINVAL;
    if (get_bool(body, "echo", &r->echo, err) < 0) return -EINVAL;
    int mt = 16; /* OpenAI's and vLLM's default for completions */
    if (get_int(body, "max_tokens", 1, INT32_MAX, &mt, err) < 0) return -EINVAL;
    r->max_tokens = mt;
    return 0;
}

int oai_request_parse(oai_request *r, oai_kind kind, const char *body, size_t len,
                      const oai_defaults *d, oai_error *err) {
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->n = 1;
    r->max_tokens = -1;
    r->logprobs = -1;
    r->prompt_logprobs = -1;
    r->skip_special_tokens = true;
    r->add_special_tokens = kind == OAI_COMPLETIONS;
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    if (!root) {
        oai_error_set(err, 400, "BadRequestError", NULL,
                      "Invalid JSON body: %s at line %d column %d", je.text, je.line, je.column);
        return -EINVAL;
    }
    int rc = -EINVAL;
    if (!json_is_object(root)) {
        bad(err, NULL, "The request body must be a JSON object, got %s", text_json_kind(root));
        goto out;
    }
    /* First: a request refused below still names its transfer, so that a
     * decoder can tell the producer to free the KV kept for it. */
    const json_t *kv = json_object_get(root, "kv_transfer_params");
    if (kv && !json_is_null(kv)) {
        if (!json_is_object(kv)) {
            bad(err, "kv_transfer_params", "'kv_transfer_params' must be an object or null, got %s",
                text_json_kind(kv));
            goto out;
        }
        r->kv_transfer_params = json_incref((json_t *)kv);
    }
    if (parse_model(r, root, d, err)) goto out;
    if ((kind == OAI_CHAT ? parse_chat(r, root, err) : parse_completions(r, root, err))) goto out;
    if (get_int(root, "n", 1, OAI_MAX_N, &r->n, err) < 0) goto out;
    long long best_of = 0;
    if (get_i64(root, "best_of", 1, OAI_MAX_N, &best_of, err) < 0) goto out;
    if (best_of && best_of < r->n) {
        bad(err, "best_of", "'best_of' (%lld) must be at least 'n' (%d)", best_of, r->n);
        goto out;
    }
    r->best_of = best_of ? (int)best_of : r->n;
    if (get_int(root, "min_tokens", 0, INT32_MAX, &r->min_tokens, err) < 0) goto out;
    if (r->max_tokens > 0 && r->min_tokens > r->max_tokens) {
        bad(err, "min_tokens", "'min_tokens' (%d) must be at most max_tokens (%d)", r->min_tokens,
            r->max_tokens);
        goto out;
    }
    if (get_bool(root, "ignore_eos", &r->ignore_eos, err) < 0) goto out;
    if (parse_stop(r, root, err) || parse_stop_ids(r, root, err)) goto out;
    if (parse_sampling(r, root, d, err) || parse_logit_processors(r, root, err)) goto out;
    if (parse_stream(r, root, err)) goto out;
    if (get_int(root, "prompt_logprobs", 0, OAI_MAX_LOGPROBS, &r->prompt_logprobs, err) < 0)
        goto out;
    if (get_bool(root, "return_tokens_as_token_ids", &r->return_tokens_as_token_ids, err) < 0)
        goto out;
    if (get_bool(root, "skip_special_tokens", &r->skip_special_tokens, err) < 0) goto out;
    if (get_bool(root, "include_stop_str_in_output", &r->include_stop_str_in_output, err) < 0)
        goto out;
    if (get_bool(root, "add_special_tokens", &r->add_special_tokens, err) < 0) goto out;
    if (r->stream && r->best_of > r->n) {
        bad(err, "best_of", "'best_of' (%d) greater than 'n' (%d) cannot be streamed: the best "
            "sequences are known only at the end; accepted with stream: best_of equal to n",
            r->best_of, r->n);
        goto out;
    }
    if (parse_beam_search(r, root, d, err)) goto out;
    if (r->stream && r->prompt_logprobs >= 0) {
        bad(err, "prompt_logprobs", "'prompt_logprobs' is not available when 'stream' is true");
        goto out;
    }
    if (d->max_logprobs >= 0 &&
        (r->logprobs > d->max_logprobs || r->prompt_logprobs > d->max_logprobs)) {
        int asked = r->logprobs > r->prompt_logprobs ? r->logprobs : r->prompt_logprobs;
        bad(err,
            r->logprobs > d->max_logprobs ? (kind == OAI_CHAT ? "top_logprobs" : "logprobs")
                                          : "prompt_logprobs",
            "Requested sample logprobs of %d, which is greater than max allowed: %d (the server's "
            "--max-logprobs)",
            asked, d->max_logprobs);
        goto out;
    }
    r->sampling.logprobs = r->logprobs;
    int plp = r->prompt_logprobs;
    if (r->echo && r->logprobs >= 0 && r->logprobs > plp) plp = r->logprobs;
    r->sampling.prompt_logprobs = plp;
    /* best_of > n ranks the sequences by cumulative logprob: each token's is needed */
    if (r->best_of > r->n && r->sampling.logprobs < 0) r->sampling.logprobs = 0;
    r->body = json_incref(root);
    rc = 0;
out:
    json_decref(root);
    if (rc) {
        json_t *keep = json_incref(r->kv_transfer_params);
        oai_request_free(r);
        r->kv_transfer_params = keep;
    }
    return rc;
}

void oai_request_free(oai_request *r) {
    free(r->model);
    for (int i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].text);
        free(r->prompts[i].ids);
    }
    free(r->prompts);
    json_decref(r->messages);
    json_decref(r->tools);
    json_decref(r->chat_template_kwargs);
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->stop_token_ids);
    free(r->logit_bias_ids);
    free(r->logit_bias);
    free(r->allowed_token_ids);
    for (int i = 0; i < r->n_bad_words; i++)
        free(r->bad_words[i]);
    free(r->bad_words);
    free(r->bad_word_ids);
    free(r->bad_word_lens);
    json_decref(r->kv_transfer_params);
    json_decref(r->body);
    memset(r, 0, sizeof *r);
}
