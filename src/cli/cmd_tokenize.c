/*
 * cmd_tokenize — `disagg tokenize TOKENIZER`: encode and decode JSON lines with a
 * model's tokenizer.json, as the server does (model/tokenizer), without a model.
 * Each input line is one object:
 *   {"text": "...", "add_special_tokens": false}  ->  {"ids": [...]}
 *   {"ids": [...], "skip_special_tokens": false}  ->  {"text": "..."}
 * A bad line gets {"error": "..."} and the exit status is 1.  At the end the
 * encode throughput (bytes of text over the wall and CPU seconds spent in
 * encode) is printed on stderr: tools/bench_tokenizer.py compares it with HF tokenizers.
 */
#include "cli/commands.h"
#include "model/hf_cache.h"
#include "model/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int tok_usage(FILE *f, int rc) {
    fprintf(f, "usage: disagg tokenize TOKENIZER [--input FILE] [--output FILE]\n"
               "  TOKENIZER       directory with tokenizer.json (and tokenizer_config.json), or a\n"
               "                  hub name in the Hugging Face cache\n"
               "  --input FILE    JSON lines to read (default: standard input); each line is\n"
               "                  {\"text\": ..., \"add_special_tokens\": bool} to encode or\n"
               "                  {\"ids\": [...], \"skip_special_tokens\": bool} to decode\n"
               "  --output FILE   where the answers go, one JSON line each: {\"ids\": [...]},\n"
               "                  {\"text\": ...} or {\"error\": ...} (default: standard output)\n"
               "The encode throughput is printed on stderr at the end.\n");
    return rc;
}

static double now_s(clockid_t clk) {
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* One line -> one answer object (NULL on out of memory). */
static json_t *tok_line(const tokenizer *tok, const char *line, size_t len, double enc_s[2],
                        size_t *enc_bytes, int *failed) {
    json_error_t je;
    char err[512] = "";
    json_t *in = json_loadb(line, len, JSON_ALLOW_NUL, &je);
    json_t *text = json_object_get(in, "text"), *ids = json_object_get(in, "ids");
    json_t *ans = NULL;
    if (!json_is_object(in) || (!json_is_string(text) && !json_is_array(ids))) {
        snprintf(err, sizeof err,
                 in ? "line is neither {\"text\": string} nor {\"ids\": [integers]}"
                    : "malformed JSON: %s",
                 je.text);
    } else if (json_is_string(text)) {
        bool add = json_is_true(json_object_get(in, "add_special_tokens"));
        int32_t *out = NULL;
        size_t n = 0;
        double t0 = now_s(CLOCK_MONOTONIC), c0 = now_s(CLOCK_THREAD_CPUTIME_ID);
        int rc = tokenizer_encode(tok, json_string_value(text), json_string_length(text), add, &out,
                                  &n, err, sizeof err);
        enc_s[0] += now_s(CLOCK_MONOTONIC) - t0;
        enc_s[1] += now_s(CLOCK_THREAD_CPUTIME_ID) - c0;
        *enc_bytes += json_string_length(text);
        if (!rc) {
            json_t *arr = json_array();
            for (size_t i = 0; i < n; i++)
                json_array_append_new(arr, json_integer(out[i]));
            ans = json_pack("{s:o}", "ids", arr);
        }
        free(out);
    } else {
        size_t n = json_array_size(ids), i;
        int32_t *v = malloc((n ? n : 1) * sizeof *v);
        json_t *x;
        bool ok = v != NULL;
        json_array_foreach(ids, i, x) {
            ok = ok && json_is_integer(x) && json_integer_value(x) >= INT32_MIN &&
                 json_integer_value(x) <= INT32_MAX;
            if (!ok) break;
            v[i] = (int32_t)json_integer_value(x);
        }
        if (!ok) {
            snprintf(err, sizeof err, "ids[%zu] is not a 32-bit integer", i);
        } else {
            char *s = NULL;
            size_t sl = 0;
            bool skip = json_is_true(json_object_get(in, "skip_special_tokens"));
            if (!tokenizer_decode(tok, v, n, skip, &s, &sl, err, sizeof err))
                ans = json_pack("{s:s%}", "text", s, sl);
            free(s);
        }
        free(v);
    }
    json_decref(in);
    if (!ans) {
        *failed = 1;
        ans = json_pack("{s:s}", "error", err[0] ? err : "out of memory");
    }
    return ans;
}

int cmd_tokenize(int argc, char **argv) {
    const char *model = NULL, *in_path = NULL, *out_path = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return tok_usage(stdout, 0);
        if (!strcmp(a, "--input") || !strcmp(a, "--output")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "disagg tokenize: %s needs a file name\n", a);
                return 2;
            }
            *(a[2] == 'i' ? &in_path : &out_path) = argv[++i];
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "disagg tokenize: unknown option '%s'; accepted: --input, --output\n",
                    a);
            return 2;
        } else if (!model) {
            model = a;
        } else {
            fprintf(stderr, "disagg tokenize: one TOKENIZER only ('%s' is extra)\n", a);
            return 2;
        }
    }
    if (!model) return tok_usage(stderr, 2);
    char dir[4096], err[1024];
    if (hf_cache_resolve(model, dir, sizeof dir, err, sizeof err)) {
        fprintf(stderr, "disagg tokenize: %s\n", err);
        return 1;
    }
    tokenizer *tok = NULL;
    if (tokenizer_load(dir, &tok, err, sizeof err)) {
        fprintf(stderr, "disagg tokenize: %s\n", err);
        return 1;
    }
    FILE *in = in_path ? fopen(in_path, "rb") : stdin;
    FILE *out = out_path ? fopen(out_path, "wb") : stdout;
    if (!in || !out) {
        fprintf(stderr, "disagg tokenize: cannot open %s: %s\n", !in ? in_path : out_path,
                strerror(errno));
        if (in && in != stdin) fclose(in);
        tokenizer_free(tok);
        return 1;
    }
    char *line = NULL;
    size_t cap = 0, lines = 0, enc_bytes = 0;
    ssize_t len;
    double enc_s[2] = {0, 0}; /* wall, CPU seconds in tokenizer_encode */
    int failed = 0;
    while ((len = getline(&line, &cap, in)) >= 0) {
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
            len--;
        if (len == 0) continue;
        json_t *ans = tok_line(tok, line, (size_t)len, enc_s, &enc_bytes, &failed);
        if (!ans || json_dumpf(ans, out, JSON_COMPACT | JSON_ENSURE_ASCII) ||
            fputc('\n', out) == EOF)
            failed = 1;
        json_decref(ans);
        lines++;
    }
    free(line);
    if (in != stdin) fclose(in);
    if (out != stdout ? fclose(out) : fflush(out)) failed = 1;
    fprintf(stderr,
            "tokenize: %zu lines, %zu bytes encoded in %.3f s (%.3f s CPU): %.1f MB/s, %.1f MB "
            "per CPU second\n",
            lines, enc_bytes, enc_s[0], enc_s[1],
            enc_s[0] > 0 ? (double)enc_bytes / enc_s[0] / 1e6 : 0.0,
            enc_s[1] > 0 ? (double)enc_bytes / enc_s[1] / 1e6 : 0.0);
    tokenizer_free(tok);
    return failed ? 1 : 0;
}
