/*
 * serve_dataset — `disagg bench serve`'s datasets (serve_dataset.h).
 */
#include "bench/serve_dataset.h"

#include "base/rng.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const SD_NAMES[] = {"random", "prefix_repetition", "custom", "sharegpt", NULL};

static const char *WORDS[] = {
    "the",     "of",     "and",   "to",     "in",     "a",     "that",     "is",         "for",
    "it",      "as",     "was",   "with",   "be",     "by",    "on",       "not",        "he",
    "this",    "are",    "or",    "his",    "from",   "at",    "which",    "but",        "have",
    "an",      "had",    "they",  "you",    "were",   "their", "one",      "all",        "we",
    "can",     "her",    "has",   "there",  "been",   "if",    "more",     "when",       "will",
    "would",   "who",    "so",    "no",     "people", "time",  "year",     "government", "world",
    "country", "nation", "state", "work",   "new",    "great", "American", "Congress",   "America",
    "years",   "our",    "must",  "should", "law"};
#define NWORDS (sizeof WORDS / sizeof WORDS[0])

static void seterr(char *err, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
}

/* len words drawn from WORDS, space-separated; NULL when out of memory. */
static char *sd_words(uint64_t *rng, int len) {
    size_t cap = (size_t)len * 16 + 1, n = 0;
    char *text = malloc(cap);
    if (!text) return NULL;
    text[0] = 0;
    for (int i = 0; i < len; i++) {
        const char *w = WORDS[rng_splitmix64(rng) % NWORDS];
        n += (size_t)snprintf(text + n, cap - n, "%s%s", i ? " " : "", w);
    }
    return text;
}

/* Uniform in [L(1-r), L(1+r)], at least 1 (vLLM's --random-range-ratio). */
static int sd_len(uint64_t *rng, int l, double r) {
    int lo = (int)floor(l * (1 - r)), hi = (int)ceil(l * (1 + r));
    if (lo < 1) lo = 1;
    if (hi < lo) hi = lo;
    return lo + (int)(rng_splitmix64(rng) % (uint64_t)(hi - lo + 1));
}

static void sd_shuffle(uint64_t *rng, sd_item *v, int n) {
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(rng_splitmix64(rng) % (uint64_t)(i + 1));
        sd_item t = v[i];
        v[i] = v[j];
        v[j] = t;
    }
}

void sd_free(sd_item *items, int n) {
    for (int i = 0; items && i < n; i++) {
        free(items[i].prompt);
        json_decref(items[i].conv);
    }
    free(items);
}

/* ---- random and prefix_repetition ---------------------------------------------------------- */

static int sd_random(const sd_opts *o, sd_item **out, int *n, char *err, size_t cap) {
    sd_item *v = calloc((size_t)o->num_prompts, sizeof *v);
    if (!v) goto oom;
    for (int i = 0; i < o->num_prompts; i++) {
        v[i].in_len = sd_len(o->rng, o->input_len, o->range_ratio);
        v[i].out_len = sd_len(o->rng, o->output_len, o->range_ratio);
        v[i].n_turns = 1;
        v[i].prompt = sd_words(o->rng, v[i].in_len);
        if (!v[i].prompt) {
            sd_free(v, i);
            goto oom;
        }
    }
    *out = v;
    *n = o->num_prompts;
    return 0;
oom:
    seterr(err, cap, "out of memory building the random dataset");
    return -1;
}

/* vLLM's PrefixRepetitionRandomDataset: num_prefixes prefixes, num_prompts / num_prefixes
 * prompts each (prefix + its own suffix), shuffled unless --disable-shuffle. */
static int sd_prefix_repetition(const sd_opts *o, sd_item **out, int *n, char *err, size_t cap) {
    int per = o->num_prompts / o->num_prefixes;
    if (per == 0) {
        seterr(err, cap,
               "--num-prompts (%d) must be at least --prefix-repetition-num-prefixes (%d): each "
               "prefix gets --num-prompts / num-prefixes prompts",
               o->num_prompts, o->num_prefixes);
        return -1;
    }
    int total = per * o->num_prefixes, k = 0;
    sd_item *v = calloc((size_t)total, sizeof *v);
    if (!v) goto oom;
    for (int p = 0; p < o->num_prefixes; p++) {
        char *prefix = sd_words(o->rng, o->prefix_len);
        if (!prefix) goto oom_free;
        for (int s = 0; s < per; s++) {
            char *suffix = sd_words(o->rng, o->suffix_len);
            size_t len = strlen(prefix) + (suffix ? strlen(suffix) : 0) + 2;
            char *t = suffix ? malloc(len) : NULL;
            if (!t) {
                free(suffix);
                free(prefix);
                goto oom_free;
            }
            snprintf(t, len, "%s%s%s", prefix, *prefix && *suffix ? " " : "", suffix);
            free(suffix);
            v[k].prompt = t;
            v[k].in_len = o->prefix_len + o->suffix_len;
            v[k].out_len = o->prefix_output_len;
            v[k].n_turns = 1;
            k++;
        }
        free(prefix);
    }
    if (!o->disable_shuffle) sd_shuffle(o->rng, v, total);
    *out = v;
    *n = total;
    return 0;
oom_free:
    sd_free(v, k);
oom:
    seterr(err, cap, "out of memory building the prefix_repetition dataset");
    return -1;
}

/* ---- files ---------------------------------------------------------------------------------- */

/* The whole file, NUL-terminated; NULL with the reason in err. */
static char *sd_read(const char *path, size_t *len, char *err, size_t cap) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        seterr(err, cap, "--dataset-path %s: %s", path, strerror(errno));
        return NULL;
    }
    size_t n = 0, c = 1 << 16;
    char *buf = malloc(c);
    for (;;) {
        if (!buf) break;
        if (n + 1 >= c) {
            char *g = realloc(buf, c * 2);
            if (!g) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = g;
            c *= 2;
        }
        size_t r = fread(buf + n, 1, c - n - 1, f);
        n += r;
        if (r == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (!buf || bad) {
        free(buf);
        seterr(err, cap, "--dataset-path %s: %s", path, buf ? "read error" : "out of memory");
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

/* The keys of object j, comma-separated, into out. */
static void sd_keys(const json_t *j, char *out, size_t cap) {
    const char *k;
    json_t *v;
    size_t n = 0;
    out[0] = 0;
    if (!json_is_object(j)) {
        snprintf(out, cap, "%s",
                 json_is_array(j)    ? "(a list)"
                 : json_is_string(j) ? "(a string)"
                                     : "(not an object)");
        return;
    }
    json_object_foreach((json_t *)j, k, v) {
        if (n + 1 >= cap) break;
        n += (size_t)snprintf(out + n, cap - n, "%s\"%s\"", n ? ", " : "", k);
    }
    if (!n) snprintf(out, cap, "none");
}

/* One message of a conversation -> {"role", "content"}: {"role": "user"|"assistant"|"system",
 * "content": "..."}, or ShareGPT's {"from": "human"|"user"|"gpt"|..., "value": "..."}.  NULL
 * with the reason in err. */
static json_t *sd_message(const json_t *m, const char *where, int i, char *err, size_t cap) {
    const char *role = json_string_value(json_object_get(m, "role"));
    const char *content = json_string_value(json_object_get(m, "content"));
    if (!role && !content) {
        const char *from = json_string_value(json_object_get(m, "from"));
        content = json_string_value(json_object_get(m, "value"));
        if (from) {
            if (!strcmp(from, "human") || !strcmp(from, "user"))
                role = "user";
            else if (!strcmp(from, "gpt") || !strcmp(from, "assistant") ||
                     !strcmp(from, "chatgpt") || !strcmp(from, "bing") || !strcmp(from, "bard"))
                role = "assistant";
            else if (!strcmp(from, "system"))
                role = "system";
            else
                role = from;
        }
    }
    if (!role || !content) {
        char keys[200];
        sd_keys(m, keys, sizeof keys);
        seterr(err, cap,
               "%s: turn %d has keys %s; accepted: {\"role\": \"user\"|\"assistant\"|\"system\", "
               "\"content\": \"...\"} (or ShareGPT's {\"from\", \"value\"})",
               where, i, keys);
        return NULL;
    }
    if (strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "system")) {
        seterr(err, cap, "%s: turn %d has role '%s'; accepted: user, assistant, system", where, i,
               role);
        return NULL;
    }
    return json_pack("{s:s,s:s}", "role", role, "content", content);
}

/* One custom item (a JSONL line's object or an array element) into *it. */
static int sd_custom_item(const sd_opts *o, const json_t *j, const char *where, sd_item *it,
                          char *err, size_t cap) {
    const json_t *p = json_object_get(j, "prompt");
    const json_t *c = json_object_get(j, "messages");
    if (!c) c = json_object_get(j, "conversation");
    if (!c) c = json_object_get(j, "conversations");
    memset(it, 0, sizeof *it);
    it->out_len = o->custom_output_len;
    if (json_is_string(p)) {
        it->prompt = strdup(json_string_value(p));
        it->n_turns = 1;
        if (!it->prompt) goto oom;
        return 0;
    }
    if (!json_is_array(c)) {
        char keys[200];
        sd_keys(j, keys, sizeof keys);
        seterr(err, cap,
               "%s: keys %s; accepted: {\"prompt\": \"...\"} (one prompt), or {\"messages\": "
               "[...]} / {\"conversation\": [...]} (a multi-turn conversation of {\"role\", "
               "\"content\"} turns)",
               where, keys);
        return -1;
    }
    it->conv = json_array();
    if (!it->conv) goto oom;
    size_t i;
    json_t *m;
    json_array_foreach((json_t *)c, i, m) {
        json_t *msg = sd_message(m, where, (int)i, err, cap);
        if (!msg) return -1;
        if (!strcmp(json_string_value(json_object_get(msg, "role")), "user")) it->n_turns++;
        json_array_append_new(it->conv, msg);
    }
    if (it->n_turns == 0) {
        seterr(err, cap,
               "%s: a conversation without a user turn (%zu turns, none with role "
               "\"user\" or from \"human\")",
               where, json_array_size(c));
        return -1;
    }
    return 0;
oom:
    seterr(err, cap, "out of memory reading --dataset-path");
    return -1;
}

/* Takes o->num_prompts of the loaded items v[0..n) (shuffled unless --disable-shuffle):
 * fewer items are oversampled by random choice as vLLM's maybe_oversample_requests, except
 * conversations (a copy would only hit its original's cached prefix) and with
 * --no-oversample. */
static int sd_take(const sd_opts *o, sd_item *v, int n, sd_item **out, int *nout, char *err,
                   size_t cap) {
    if (!o->disable_shuffle) sd_shuffle(o->rng, v, n);
    int want = o->num_prompts, has_conv = 0;
    for (int i = 0; i < n; i++)
        has_conv |= v[i].conv != NULL;
    if (want <= n) {
        for (int i = want; i < n; i++) {
            free(v[i].prompt);
            json_decref(v[i].conv);
        }
        *out = v;
        *nout = want;
        return 0;
    }
    if (o->no_oversample || has_conv) {
        *out = v;
        *nout = n;
        return 0;
    }
    sd_item *g = realloc(v, (size_t)want * sizeof *v);
    if (!g) {
        sd_free(v, n);
        seterr(err, cap, "out of memory oversampling the dataset");
        return -1;
    }
    for (int i = n; i < want; i++) {
        g[i] = g[rng_splitmix64(o->rng) % (uint64_t)n];
        g[i].prompt = strdup(g[i].prompt);
        if (!g[i].prompt) {
            sd_free(g, i);
            seterr(err, cap, "out of memory oversampling the dataset");
            return -1;
        }
    }
    *out = g;
    *nout = want;
    return 0;
}

static int sd_custom(const sd_opts *o, sd_item **out, int *nout, char *err, size_t cap) {
    size_t len = 0;
    char *buf = sd_read(o->path, &len, err, cap);
    if (!buf) return -1;
    sd_item *v = NULL;
    int n = 0, cap_v = 0, rc = -1;
    char where[600];
    const char *s = buf;
    while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')
        s++;
    if (*s == '[') { /* a JSON array of items: vLLM's multi-turn format */
        json_error_t je;
        json_t *arr = json_loadb(buf, len, 0, &je);
        if (!arr) {
            seterr(err, cap, "--dataset-path %s: bad JSON at line %d, column %d: %s", o->path,
                   je.line, je.column, je.text);
            goto out;
        }
        v = calloc(json_array_size(arr) + 1, sizeof *v);
        size_t i;
        json_t *e;
        json_array_foreach(arr, i, e) {
            snprintf(where, sizeof where, "--dataset-path %s: entry %zu", o->path, i);
            if (!v || sd_custom_item(o, e, where, &v[n], err, cap)) {
                if (!v) seterr(err, cap, "out of memory reading --dataset-path");
                if (v) n++; /* its partial conversation is freed with the rest */
                json_decref(arr);
                goto out;
            }
            n++;
        }
        json_decref(arr);
    } else { /* JSONL: one object a line */
        int line = 0;
        for (char *p = buf; p && *p;) {
            char *nl = strchr(p, '\n');
            if (nl) *nl = 0;
            line++;
            const char *q = p;
            while (*q == ' ' || *q == '\t' || *q == '\r')
                q++;
            if (*q) {
                json_error_t je;
                json_t *j = json_loads(p, 0, &je);
                snprintf(where, sizeof where, "--dataset-path %s: line %d", o->path, line);
                if (!j) {
                    seterr(err, cap, "%s: bad JSON at column %d: %s", where, je.column, je.text);
                    goto out;
                }
                if (n == cap_v) {
                    cap_v = cap_v ? cap_v * 2 : 64;
                    sd_item *g = realloc(v, (size_t)cap_v * sizeof *v);
                    if (!g) {
                        json_decref(j);
                        seterr(err, cap, "out of memory reading --dataset-path");
                        goto out;
                    }
                    v = g;
                }
                int r = sd_custom_item(o, j, where, &v[n], err, cap);
                n++;
                json_decref(j);
                if (r) goto out;
            }
            p = nl ? nl + 1 : NULL;
        }
    }
    if (n == 0) {
        seterr(err, cap,
               "--dataset-path %s: an empty dataset; one JSON object a line expected: "
               "{\"prompt\": \"...\"} or {\"messages\": [{\"role\": \"user\", \"content\": "
               "\"...\"}, ...]}",
               o->path);
        goto out;
    }
    rc = sd_take(o, v, n, out, nout, err, cap);
    v = NULL;
    n = 0;
out:
    sd_free(v, n);
    free(buf);
    return rc;
}

/* vLLM's is_valid_sequence with its defaults. */
static int sd_valid(int prompt_len, int output_len, int skip_min_output) {
    return !(prompt_len < 4 || (!skip_min_output && output_len < 4) || prompt_len > 1024 ||
             prompt_len + output_len > 2048);
}

static int sd_sharegpt(const sd_opts *o, sd_item **out, int *nout, char *err, size_t cap) {
    size_t len = 0;
    char *buf = sd_read(o->path, &len, err, cap);
    if (!buf) return -1;
    json_error_t je;
    json_t *arr = json_loadb(buf, len, 0, &je);
    free(buf);
    if (!arr) {
        seterr(err, cap,
               "--dataset-path %s: bad JSON at line %d, column %d: %s (a ShareGPT file is one "
               "JSON list; JSONL files are --dataset-name custom)",
               o->path, je.line, je.column, je.text);
        return -1;
    }
    if (!json_is_array(arr)) {
        seterr(err, cap,
               "--dataset-path %s: a ShareGPT file is a JSON list of {\"conversations\": "
               "[{\"from\": \"human\", \"value\": ...}, {\"from\": \"gpt\", \"value\": ...}]}",
               o->path);
        json_decref(arr);
        return -1;
    }
    /* entries with at least two turns, in a shuffled order (vLLM's load_data) */
    size_t total = json_array_size(arr), ne = 0;
    size_t *idx = malloc((total + 1) * sizeof *idx);
    sd_item *v = calloc((size_t)o->num_prompts + 1, sizeof *v);
    int n = 0, rc = -1;
    if (!idx || !v) {
        seterr(err, cap, "out of memory reading --dataset-path");
        goto out;
    }
    for (size_t i = 0; i < total; i++) {
        json_t *c = json_object_get(json_array_get(arr, i), "conversations");
        if (json_is_array(c) && json_array_size(c) >= 2) idx[ne++] = i;
    }
    if (ne == 0) {
        seterr(err, cap,
               "--dataset-path %s: no entry with a \"conversations\" list of at least two turns "
               "(%zu entries); accepted: [{\"conversations\": [{\"from\": \"human\", \"value\": "
               "\"...\"}, {\"from\": \"gpt\", \"value\": \"...\"}]}]",
               o->path, total);
        goto out;
    }
    if (!o->disable_shuffle)
        for (size_t i = ne - 1; i > 0; i--) {
            size_t j = (size_t)(rng_splitmix64(o->rng) % (uint64_t)(i + 1)), t = idx[i];
            idx[i] = idx[j];
            idx[j] = t;
        }
    for (size_t k = 0; k < ne && n < o->num_prompts; k++) {
        json_t *c = json_object_get(json_array_get(arr, idx[k]), "conversations");
        const char *prompt = json_string_value(json_object_get(json_array_get(c, 0), "value"));
        const char *reply = json_string_value(json_object_get(json_array_get(c, 1), "value"));
        if (!prompt || !reply) {
            char keys[200];
            sd_keys(json_array_get(c, prompt ? 1 : 0), keys, sizeof keys);
            seterr(err, cap,
                   "--dataset-path %s: entry %zu: turn %d has keys %s; accepted: {\"from\": "
                   "\"human\"|\"gpt\", \"value\": \"...\"}",
                   o->path, idx[k], prompt ? 1 : 0, keys);
            goto out;
        }
        int pl = o->count(o->count_ctx, prompt);
        int ol = o->sharegpt_output_len ? o->sharegpt_output_len : o->count(o->count_ctx, reply);
        if (pl < 0 || ol < 0) {
            seterr(err, cap,
                   "the sharegpt dataset counts tokens with the server's POST /tokenize (as vLLM "
                   "counts them with the model's tokenizer), and it did not answer");
            goto out;
        }
        if (!sd_valid(pl, ol, o->sharegpt_output_len > 0)) continue;
        v[n].prompt = strdup(prompt);
        if (!v[n].prompt) {
            seterr(err, cap, "out of memory reading --dataset-path");
            goto out;
        }
        v[n].in_len = pl;
        v[n].out_len = ol;
        v[n].n_turns = 1;
        n++;
    }
    if (n == 0) {
        seterr(err, cap,
               "--dataset-path %s: no usable entry: %zu have two turns, none with a prompt of "
               "4..1024 tokens, a reply of at least 4 and both within 2048 (vLLM's limits)",
               o->path, ne);
        goto out;
    }
    {
        sd_opts o2 = *o;
        o2.disable_shuffle = 1; /* already in a shuffled order */
        rc = sd_take(&o2, v, n, out, nout, err, cap);
        v = NULL;
        n = 0;
    }
out:
    sd_free(v, n);
    free(idx);
    json_decref(arr);
    return rc;
}

int sd_load(const sd_opts *o, sd_item **items, int *n, char *err, size_t cap) {
    *items = NULL;
    *n = 0;
    int file = o->kind == SD_CUSTOM || o->kind == SD_SHAREGPT;
    if (file && !o->path) {
        seterr(err, cap, "--dataset-name %s needs --dataset-path FILE", SD_NAMES[o->kind]);
        return -1;
    }
    if (!file && o->path) {
        seterr(err, cap,
               "cannot use the '%s' dataset with --dataset-path %s; the datasets read from a "
               "file are custom (JSONL) and sharegpt (JSON)",
               SD_NAMES[o->kind], o->path);
        return -1;
    }
    switch (o->kind) {
    case SD_RANDOM:
        return sd_random(o, items, n, err, cap);
    case SD_PREFIX_REPETITION:
        return sd_prefix_repetition(o, items, n, err, cap);
    case SD_CUSTOM:
        return sd_custom(o, items, n, err, cap);
    default:
        return sd_sharegpt(o, items, n, err, cap);
    }
}
