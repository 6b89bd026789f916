/*
 * cmd_serve — `disagg serve [MODEL] [options]`: parses `vllm serve`-style
 * flags into a server_config and runs the OpenAI-compatible server
 * (src/server).  Both "--flag VALUE" and "--flag=VALUE" are accepted; an
 * unknown flag is an error that names the closest known one.
 *
 * MODEL defaults to the repository's trained model, models/disagg-sotu-tiny,
 * found relative to the binary: <exe dir>/../models/disagg-sotu-tiny (a build
 * directory inside the source tree, e.g. build/disagg), then
 * <exe dir>/../share/disagg/models/disagg-sotu-tiny (an install prefix), then
 * ./models/disagg-sotu-tiny.
 */
#include "base/bytesize.h"
#include "base/file.h"
#include "base/text.h"
#include "cli/commands.h"
#include "cli/discovery_cli.h"

#include "base/log.h"
#include "connector/kv_transfer_config.h"
#include "kernels/backend.h"
#include "model/chat_template.h"
#include "model/hf_cache.h"
#include "server/openai_request.h"
#include "server/server.h"

#include <jansson.h>
#include <yaml.h>

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define DEFAULT_MODEL_NAME "disagg-sotu-tiny"

static void serve_usage(FILE *f) {
    fprintf(
        f,
        "usage: disagg serve [MODEL] [options]\n\n"
        "OpenAI-compatible server (POST /v1/completions, /v1/chat/completions, /tokenize,\n"
        "/detokenize; GET /v1/models, /health, /ping, /load, /version, /metrics), flags as `vllm "
        "serve`.\n"
        "MODEL: a Hugging Face model directory or a hub name in the HF cache (default: the\n"
        "repository's models/" DEFAULT_MODEL_NAME ").\n\n"
        "options:\n"
        "  --host HOST                     listen address (default 0.0.0.0)\n"
        "  --port PORT                     listen port (default 8000)\n"
        "  --model MODEL                   the model, as the positional MODEL (vllm accepts both)\n"
        "  --served-model-name NAME [NAME ...]   model names in the API, all served; responses "
        "report the first (default: MODEL)\n"
        "  --api-key KEY                   require 'Authorization: Bearer KEY' on /v1 (also "
        "VLLM_API_KEY)\n"
        "  --max-model-len N               context length (default: the model's)\n"
        "  --max-num-seqs N                most running requests (default 64)\n"
        "  --max-num-batched-tokens N      token budget per engine step (default 2048)\n"
        "  --block-size N                  tokens per KV-cache block (default: 128 on the CPU, 16 "
        "on CUDA)\n"
        "  --kv-cache-memory BYTES         KV-cache size, e.g. 2G or 512M (default on the CPU: "
        "25%% of RAM per instance, so two instances started with defaults on one host reserve "
        "half of it; give each its own size)\n"
        "  --enable-prefix-caching         reuse cached prompt blocks (default)\n"
        "  --no-enable-prefix-caching      disable prefix caching\n"
        "  --seed N                        engine seed for unseeded sampling (default 0)\n"
        "  --dtype auto|bfloat16|float16|float32   weight dtype check; the CPU computes in "
        "float32\n"
        "  --threads N                     compute threads (default: all cores)\n"
        "  --device auto|cpu|cuda|cuda:N   compute device (default auto: cuda when its module "
        "loads and a GPU is visible, else cpu)\n"
        "  --kv-cache-dtype auto|bfloat16|float16|float32   KV-cache element type (default "
        "auto: the device's, float32 on the CPU)\n"
        "  --gpu-memory-utilization F      GPU: this instance's budget, a fraction of the device's "
        "total memory, for its weights, activations and KV cache (default 0.9; the KV cache "
        "gets what is left; memory of other processes is not counted: two instances on one "
        "GPU: 0.45 each)\n"
        "  --enforce-eager, --no-enforce-eager   GPU: every step eager (default: decode steps of "
        "up to --max-num-seqs sequences run as CUDA graphs)\n"
        "  --batch-invariant, --no-batch-invariant   GPU: kernels whose result for a request "
        "does not depend on the batch or the prompt's chunking (default off, or "
        "VLLM_BATCH_INVARIANT=1; the CPU always is)\n"
        "  -tp, --tensor-parallel-size N   1 only (one device per process; scale out with more "
        "instances behind disagg proxy)\n"
        "  -pp, --pipeline-parallel-size N 1 only\n"
        "  -dp, --data-parallel-size N     1 only (run more instances behind disagg proxy)\n"
        "  --distributed-executor-backend B   uni|mp (one process; ray and external_launcher "
        "are refused)\n"
        "  --enable-chunked-prefill, --no-enable-chunked-prefill   accepted: prompts are always "
        "prefilled in chunks of --max-num-batched-tokens\n"
        "  -q, --quantization METHOD       refused: weights run unquantized (none is accepted)\n"
        "  --load-format auto|safetensors|dummy   weight format; dummy: config.json alone, random "
        "weights of its shapes made at load (benchmarks; the tokenizer files are still read); "
        "others, e.g. pt or gguf, are refused\n"
        "  --swap-space GiB                accepted (a preempted request is recomputed, nothing is "
        "swapped)\n"
        "  --tokenizer DIR|ORG/NAME        load the tokenizer from there (default: MODEL)\n"
        "  --revision REV                  MODEL's branch, tag or commit in the HF cache "
        "(default main)\n"
        "  --chat-template FILE|TEMPLATE   Jinja chat template: a file, or the template itself\n"
        "  --generation-config auto|vllm|DIR   sampling defaults: MODEL's generation_config.json "
        "(auto, default), none (vllm), or DIR's\n"
        "  --override-generation-config JSON   replace those defaults, e.g. '{\"temperature\": "
        "0.5}'; keys: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens (caps "
        "every request's max_tokens, as vLLM)\n"
        "  --max-logprobs N                most logprobs a request may ask, 0..20 (default 20; "
        "-1: 20)\n"
        "  --enable-auto-tool-choice       parse tool calls of chats with tools (disagg does by "
        "default)\n"
        "  --tool-call-parser hermes       tool-call format (Qwen2.5's <tool_call> JSON)\n"
        "  --allowed-origins JSON          CORS origins, e.g. '[\"https://a.example\"]' "
        "(default [\"*\"])\n"
        "  --allowed-methods JSON          CORS methods (default [\"*\"])\n"
        "  --allowed-headers JSON          CORS headers (default [\"*\"])\n"
        "  --allow-credentials             CORS: allow credentials\n"
        "  --root-path PATH                accepted: the prefix a proxy strips (routes stay at "
        "/v1/...)\n"
        "  --disable-log-stats             no periodic stats lines (disagg logs none)\n"
        "  --config FILE                   YAML file of flags (key: value, e.g. max-model-len: "
        "1024); the command line wins\n"
        "  --kv-transfer-config JSON       KV connector configuration (P/D disaggregation)\n"
        "  --max-body-bytes N              request body limit (default 32M) -> 413\n"
        "  --client-header-timeout S       a request head must be complete S seconds after its\n"
        "                                  first byte (a new connection: after connecting); bytes\n"
        "                                  do not extend it (nginx's; default 60) -> 408, close\n"
        "  --client-body-timeout S         a request body must be in S seconds after its head\n"
        "                                  (bytes do not extend it; default 60) -> 408, close\n"
        "  --timeout-keep-alive S          close a connection idle S seconds after a response\n"
        "                                  (uvicorn's; default 5, as vLLM)\n"
        "  --uvicorn-log-level LEVEL       debug|info|warning|error|critical|trace\n"
        "  --disable-log-requests          no per-request log lines\n"
        "  --enable-log-requests           per-request log lines (default)\n"
        "  --trust-remote-code             accepted for compatibility (no remote code is run)\n"
        "  -O0..-O3, -O LEVEL              accepted, no effect (logged): vLLM's compilation level\n"
        "  --compilation-config JSON       accepted, no effect (logged)\n"
        "  --async-scheduling, --no-async-scheduling   accepted, no effect (logged)\n"
        "  --disable-uvicorn-access-log    accepted, no effect (logged)\n"
        "  --enable-prompt-tokens-details  accepted, no effect (logged): usage always has "
        "prompt_tokens_details\n"
        "  --speculative-config, --enable-lora, --reasoning-parser, --structured-outputs-config, "
        "...   refused, naming the vLLM feature disagg lacks\n");
    discovery_cli_usage(f, 1);
}

/* Repository default model, resolved relative to the running binary. */
static int serve_default_model(char *out, size_t cap) {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    const char *cands[3];
    char a[PATH_MAX + 64], b[PATH_MAX + 64];
    int nc = 0;
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) *slash = 0;
        snprintf(a, sizeof a, "%s/../models/%s", exe, DEFAULT_MODEL_NAME);
        snprintf(b, sizeof b, "%s/../share/disagg/models/%s", exe, DEFAULT_MODEL_NAME);
        cands[nc++] = a;
        cands[nc++] = b;
    }
    cands[nc++] = "models/" DEFAULT_MODEL_NAME;
    for (int i = 0; i < nc; i++) {
        char cfg[PATH_MAX + 128];
        struct stat st;
        snprintf(cfg, sizeof cfg, "%s/config.json", cands[i]);
        if (stat(cfg, &st) == 0) {
            char *real = realpath(cands[i], NULL);
            snprintf(out, cap, "%s", real ? real : cands[i]);
            free(real);
            return 0;
        }
    }
    fprintf(stderr, "disagg serve: no MODEL given and the default model was not found in:");
    for (int i = 0; i < nc; i++)
        fprintf(stderr, "%s %s", i ? "," : "", cands[i]);
    fprintf(stderr, "\n  pass a model directory or a Hugging Face hub name\n");
    return -ENOENT;
}

static int parse_long(const char *flag, const char *v, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "disagg serve: %s expects an integer in [%ld, %ld], got '%s'\n", flag, lo,
                hi, v);
        return -EINVAL;
    }
    *out = x;
    return 0;
}

/* A byte size by base/bytesize's grammar ("4294967296", "512M", "1.5G"), 1..1P. */
static int parse_bytes(const char *flag, const char *v, size_t *out) {
    char what[64], err[512];
    uint64_t x;
    snprintf(what, sizeof what, "disagg serve: %s", flag);
    if (bytesize_parse_range(what, v, 1, 1ull << 50, &x, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return -EINVAL;
    }
    *out = (size_t)x;
    return 0;
}

/* Every flag: V takes a value, T is a switch, B a switch with a --no- form (vLLM's
 * BooleanOptionalAction). */
enum { V, T, B };
static const struct {
    const char *name;
    int kind;
} FLAGS[] = {{"--host", V},
             {"--port", V},
             {"--model", V},
             {"--served-model-name", V},
             {"--api-key", V},
             {"--max-model-len", V},
             {"--max-num-seqs", V},
             {"--max-num-batched-tokens", V},
             {"--block-size", V},
             {"--kv-cache-memory", V},
             {"--enable-prefix-caching", B},
             {"--seed", V},
             {"--dtype", V},
             {"--threads", V},
             {"--device", V},
             {"--kv-cache-dtype", V},
             {"--gpu-memory-utilization", V},
             {"--enforce-eager", B},
             {"--batch-invariant", B},
             {"--tensor-parallel-size", V},
             {"--pipeline-parallel-size", V},
             {"--data-parallel-size", V},
             {"--distributed-executor-backend", V},
             {"--enable-chunked-prefill", B},
             {"--quantization", V},
             {"--load-format", V},
             {"--swap-space", V},
             {"--tokenizer", V},
             {"--revision", V},
             {"--chat-template", V},
             {"--generation-config", V},
             {"--override-generation-config", V},
             {"--max-logprobs", V},
             {"--enable-auto-tool-choice", T},
             {"--tool-call-parser", V},
             {"--allowed-origins", V},
             {"--allowed-methods", V},
             {"--allowed-headers", V},
             {"--allow-credentials", T},
             {"--root-path", V},
             {"--disable-log-stats", T},
             {"--config", V},
             {"--kv-transfer-config", V},
             {"--max-body-bytes", V},
             {"--client-header-timeout", V},
             {"--timeout-keep-alive", V},
             {"--client-body-timeout", V},
             {"--uvicorn-log-level", V},
             {"--disable-log-requests", T},
             {"--enable-log-requests", T},
             {"--trust-remote-code", T},
             {"--discovery", V},
             {"--discovery-ttl", V},
             {"--discovery-advertise", V},
             {"--etcd-user", V},
             {"--etcd-cacert", V},
             {"--etcd-cert", V},
             {"--etcd-key", V},
             {"--help", T}};
#define NFLAGS (sizeof FLAGS / sizeof FLAGS[0])

/* vLLM's short spellings */
static const char *SHORT[][2] = {{"-tp", "--tensor-parallel-size"},
                                 {"-pp", "--pipeline-parallel-size"},
                                 {"-dp", "--data-parallel-size"},
                                 {"-q", "--quantization"}};

static int flag_kind(const char *f) {
    for (size_t i = 0; i < NFLAGS; i++)
        if (!strcmp(f, FLAGS[i].name)) return FLAGS[i].kind;
    return -1;
}

/* vLLM serve flags for features disagg does not have: refused, naming the feature. */
static const struct {
    const char *name, *why;
} UNSUPPORTED[] = {
    {"--reasoning-parser", "reasoning output parsing (reasoning_content) is not supported yet"},
    {"--reasoning-parser-plugin", "reasoning output parsing is not supported yet"},
    {"--structured-outputs-config",
     "structured outputs (json_schema, regex, grammar, choice) are not supported"},
    {"--guided-decoding-backend", "structured outputs (guided decoding) are not supported"},
    {"--speculative-config", "speculative decoding is not supported"},
    {"--enable-lora", "LoRA adapters are not supported"},
    {"--lora-modules", "LoRA adapters are not supported"},
    {"--max-loras", "LoRA adapters are not supported"},
    {"--max-lora-rank", "LoRA adapters are not supported"},
    {"--max-cpu-loras", "LoRA adapters are not supported"},
    {"--enable-expert-parallel",
     "expert parallelism is not supported (one process runs the whole model on one device)"},
    {"--enable-eplb", "expert-parallel load balancing is not supported"},
    {"--cpu-offload-gb", "offloading weights to host memory is not supported"},
    {"--limit-mm-per-prompt", "multimodal inputs are not supported (text models only)"},
    {"--mm-processor-kwargs", "multimodal inputs are not supported (text models only)"},
    {"--enable-prompt-embeds", "prompt embeddings as input are not supported"},
    {"--hf-overrides",
     "overriding config.json is not supported (edit a copy of the model directory)"},
    {"--logits-processors", "custom logits processors are not supported"},
    {"--enable-sleep-mode", "sleep mode is not supported"},
    {"--kv-events-config", "KV cache events are not published"},
    {"--otlp-traces-endpoint", "OpenTelemetry tracing is not supported (use GET /metrics)"},
    {"--ssl-keyfile", "TLS is not supported: terminate TLS in a reverse proxy in front"},
    {"--ssl-certfile", "TLS is not supported: terminate TLS in a reverse proxy in front"},
    {"--ssl-ca-certs", "TLS is not supported: terminate TLS in a reverse proxy in front"},
    {"--uds", "listening on a Unix socket is not supported (use --host and --port)"},
    {"--headless", "multi-node data parallelism is not supported"},
    {"--data-parallel-address", "data parallelism is not supported (run more instances behind "
                                "disagg proxy)"},
    {"--api-server-count", "one HTTP front end per process (run more instances behind disagg "
                           "proxy)"},
};

/* vLLM flags that tune what disagg does not have (compilation, uvicorn): accepted, no effect.
 * takes: 1 when the flag takes a value. */
static const struct {
    const char *name;
    int takes;
} NO_EFFECT[] = {{"--compilation-config", 1},         {"-O", 1},
                 {"--async-scheduling", 0},           {"--no-async-scheduling", 0},
                 {"--disable-uvicorn-access-log", 0}, {"--enable-prompt-tokens-details", 0}};

static void unknown_flag(const char *f) {
    for (size_t i = 0; i < sizeof UNSUPPORTED / sizeof UNSUPPORTED[0]; i++)
        if (!strcmp(f, UNSUPPORTED[i].name)) {
            fprintf(stderr, "disagg serve: %s: %s (see disagg serve --help)\n", f,
                    UNSUPPORTED[i].why);
            return;
        }
    const char *best = NULL;
    int bd = INT_MAX, d;
    for (size_t i = 0; i < NFLAGS; i++) {
        if (text_close_name(f, FLAGS[i].name, &d) && d < bd) bd = d, best = FLAGS[i].name;
        if (FLAGS[i].kind == B) {
            char no[80];
            snprintf(no, sizeof no, "--no-%s", FLAGS[i].name + 2);
            if (text_close_name(f, no, &d) && d < bd) bd = d, best = FLAGS[i].name;
        }
    }
    for (size_t i = 0; i < sizeof UNSUPPORTED / sizeof UNSUPPORTED[0]; i++)
        if (text_close_name(f, UNSUPPORTED[i].name, &d) && d < bd)
            bd = d, best = UNSUPPORTED[i].name;
    fprintf(stderr, "disagg serve: unknown option '%s'", f);
    if (best) fprintf(stderr, "; did you mean %s?", best);
    fprintf(stderr, " (see disagg serve --help)\n");
}

/* -O0..-O3 / -O LEVEL / --compilation-config JSON and the like: 1 when f is one (its value,
 * if any, consumed from argv), logged as having no effect; -1 on a missing value. */
static int no_effect_flag(const char *f, const char *eq, int argc, char **argv, int *i) {
    if (f[0] == '-' && f[1] == 'O' && f[2] >= '0' && f[2] <= '3' && !f[3]) {
        LOG_I("serve",
              "%s: accepted, no effect (vLLM's compilation level; disagg compiles "
              "nothing at run time)",
              f);
        return 1;
    }
    for (size_t k = 0; k < sizeof NO_EFFECT / sizeof NO_EFFECT[0]; k++) {
        if (strcmp(f, NO_EFFECT[k].name)) continue;
        const char *val = NULL;
        if (NO_EFFECT[k].takes) {
            if (eq)
                val = eq + 1;
            else if (*i + 1 < argc)
                val = argv[++*i];
            else {
                fprintf(stderr, "disagg serve: %s needs a value\n", f);
                return -1;
            }
        }
        LOG_I("serve",
              "%s%s%s: accepted, no effect (vLLM tuning that disagg has no counterpart "
              "for)",
              f, val ? " " : "", val ? val : "");
        return 1;
    }
    return 0;
}

/* --allowed-origins and friends: a JSON list of strings (vLLM parses them with json.loads). */
static int parse_json_list(const char *flag, const char *v, json_t **out) {
    json_error_t je;
    json_t *j = json_loads(v, JSON_DECODE_ANY, &je);
    int ok = json_is_array(j);
    size_t i;
    json_t *x;
    if (ok) json_array_foreach(j, i, x) ok &= json_is_string(x);
    if (!ok) {
        fprintf(stderr,
                "disagg serve: %s expects a JSON list of strings such as '[\"*\"]' or "
                "'[\"https://a.example\"]', got '%s'\n",
                flag, v);
        json_decref(j);
        return -EINVAL;
    }
    json_decref(*out);
    *out = j;
    return 0;
}

/* ---- --config FILE: vLLM's YAML config, one "flag-name: value" per key ---------------- */

typedef struct {
    char **v;
    int n, cap;
} strv;

static int strv_push(strv *a, const char *s, size_t len) {
    if (a->n == a->cap) {
        int nc = a->cap ? a->cap * 2 : 32;
        char **nv = realloc(a->v, (size_t)nc * sizeof *nv);
        if (!nv) return -ENOMEM;
        a->v = nv, a->cap = nc;
    }
    char *c = malloc(len + 1);
    if (!c) return -ENOMEM;
    memcpy(c, s, len);
    c[len] = 0;
    a->v[a->n++] = c;
    return 0;
}

static void strv_free(strv *a) {
    for (int i = 0; i < a->n; i++)
        free(a->v[i]);
    free(a->v);
}

static int yaml_true(const char *v) {
    return !strcmp(v, "true") || !strcmp(v, "True") || !strcmp(v, "TRUE") || !strcmp(v, "yes") ||
           !strcmp(v, "on");
}
static int yaml_false(const char *v) {
    return !strcmp(v, "false") || !strcmp(v, "False") || !strcmp(v, "FALSE") || !strcmp(v, "no") ||
           !strcmp(v, "off");
}

/* Appends the file's flags to out as command-line words. */
static int config_file_args(const char *path, strv *out) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "disagg serve: --config %s: cannot open (%s)\n", path, strerror(errno));
        return -ENOENT;
    }
    yaml_parser_t p;
    yaml_event_t ev;
    yaml_parser_initialize(&p);
    yaml_parser_set_input_file(&p, f);
    int rc = -EINVAL, depth = 0, in_seq = 0, done = 0;
    char key[128] = "";
    json_t *seq = NULL;
    while (!done) {
        if (!yaml_parser_parse(&p, &ev)) {
            fprintf(stderr, "disagg serve: --config %s: YAML error at line %zu: %s\n", path,
                    p.problem_mark.line + 1, p.problem ? p.problem : "syntax");
            goto out;
        }
        int t = ev.type;
        const char *val = t == YAML_SCALAR_EVENT ? (const char *)ev.data.scalar.value : NULL;
        size_t line = ev.start_mark.line + 1;
        if (t == YAML_STREAM_END_EVENT)
            done = 1;
        else if (t == YAML_MAPPING_START_EVENT) {
            if (depth++ || *key) {
                fprintf(stderr,
                        "disagg serve: --config %s line %zu: nested mappings are not flag "
                        "values; write the value as JSON text\n",
                        path, line);
                yaml_event_delete(&ev);
                goto out;
            }
        } else if (t == YAML_MAPPING_END_EVENT)
            depth--;
        else if (t == YAML_SEQUENCE_START_EVENT) {
            if (!*key || in_seq) {
                fprintf(stderr,
                        "disagg serve: --config %s line %zu: expected a mapping of flag "
                        "names to values\n",
                        path, line);
                yaml_event_delete(&ev);
                goto out;
            }
            in_seq = 1;
            seq = json_array();
        } else if (t == YAML_SEQUENCE_END_EVENT) {
            char *j = json_dumps(seq, JSON_COMPACT);
            json_decref(seq);
            seq = NULL;
            in_seq = 0;
            char flag[140];
            snprintf(flag, sizeof flag, "--%s", key);
            int bad = !j || strv_push(out, flag, strlen(flag)) || strv_push(out, j, strlen(j));
            free(j);
            key[0] = 0;
            if (bad) {
                yaml_event_delete(&ev);
                goto out;
            }
        } else if (t == YAML_SCALAR_EVENT && in_seq) {
            json_array_append_new(seq, json_string(val));
        } else if (t == YAML_SCALAR_EVENT && !*key) {
            if (depth != 1) {
                fprintf(stderr,
                        "disagg serve: --config %s line %zu: expected a mapping of flag "
                        "names to values\n",
                        path, line);
                yaml_event_delete(&ev);
                goto out;
            }
            snprintf(key, sizeof key, "%s", val);
        } else if (t == YAML_SCALAR_EVENT && ev.data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
                   (!*val || !strcmp(val, "~") || !strcmp(val, "null") || !strcmp(val, "Null") ||
                    !strcmp(val, "NULL"))) {
            key[0] = 0; /* null: the flag's default, as vLLM */
        } else if (t == YAML_SCALAR_EVENT) {
            char flag[140];
            snprintf(flag, sizeof flag, "--%s", key);
            for (char *q = flag; *q; q++)
                if (*q == '_') *q = '-';
            int kind = flag_kind(flag);
            int bad = 0;
            if (kind == T || kind == B) {
                if (yaml_true(val))
                    bad = strv_push(out, flag, strlen(flag));
                else if (yaml_false(val)) {
                    if (kind == B) {
                        snprintf(flag, sizeof flag, "--no-%s", key);
                        bad = strv_push(out, flag, strlen(flag));
                    }
                } else {
                    fprintf(stderr,
                            "disagg serve: --config %s line %zu: '%s' is a switch; "
                            "accepted: true or false, got '%s'\n",
                            path, line, key, val);
                    yaml_event_delete(&ev);
                    goto out;
                }
            } else if (!strcmp(flag, "--config")) {
                fprintf(stderr,
                        "disagg serve: --config %s line %zu: a config file cannot name "
                        "another\n",
                        path, line);
                yaml_event_delete(&ev);
                goto out;
            } else
                bad = strv_push(out, flag, strlen(flag)) || strv_push(out, val, strlen(val));
            key[0] = 0;
            if (bad) {
                yaml_event_delete(&ev);
                goto out;
            }
        }
        yaml_event_delete(&ev);
    }
    rc = 0;
out:
    json_decref(seq);
    yaml_parser_delete(&p);
    fclose(f);
    return rc;
}

static int serve_args(int argc, char **argv);

int cmd_serve(int argc, char **argv) {
    /* --config FILE: its flags go first, so the command line overrides them (as vLLM) */
    const char *config = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config") && i + 1 < argc)
            config = argv[++i];
        else if (!strncmp(argv[i], "--config=", 9))
            config = argv[i] + 9;
    }
    if (!config) return serve_args(argc, argv);
    strv a = {0};
    int rc = 2;
    /* as vLLM: after a leading positional MODEL (so that a file's multi-word flag such as
     * --served-model-name does not take MODEL as one more word) */
    int first = argc > 1 && argv[1][0] != '-' ? 2 : 1;
    for (int i = 0; i < first; i++)
        if (strv_push(&a, argv[i], strlen(argv[i]))) goto out;
    if (config_file_args(config, &a)) goto out;
    for (int i = first; i < argc; i++)
        if (strv_push(&a, argv[i], strlen(argv[i]))) goto out;
    rc = serve_args(a.n, a.v);
out:
    strv_free(&a);
    return rc;
}

static int serve_args(int argc, char **argv) {
    server_config cfg;
    server_config_init(&cfg);
    cfg.engine.device = "auto";
    const char *model = NULL;
    static char default_model[PATH_MAX];
    static char model_dir[PATH_MAX], tok_dir[PATH_MAX];
    const char *tokenizer_arg = NULL, *revision = NULL, *chat_template_arg = NULL;
    const char *tool_parser = NULL;
    char *template_text = NULL;
    int auto_tool_choice = 0, rc = 2;
    enum { MAX_NAMES = 32 };
    static const char *names[MAX_NAMES];
    int n_names = 0;
    json_t *names_json = NULL; /* owns names[] when they came as a JSON list */
    discovery_cli disc;
    discovery_cli_init(&disc);
    const char *env_key = getenv("VLLM_API_KEY");
    if (env_key && *env_key) cfg.api_key = env_key;
    /* vLLM's switch for the same thing (int(os.getenv("VLLM_BATCH_INVARIANT", "0"))); the
     * flags below override it */
    const char *env_bi = getenv("VLLM_BATCH_INVARIANT");
    if (env_bi && *env_bi) {
        char *end;
        errno = 0;
        long v = strtol(env_bi, &end, 10);
        if (end == env_bi || *end || errno) {
            fprintf(stderr,
                    "disagg serve: VLLM_BATCH_INVARIANT='%s' is not an integer (accepted: 0 = "
                    "off, 1 = on, as vLLM reads it; or --batch-invariant / --no-batch-invariant)\n",
                    env_bi);
            goto fail;
        }
        cfg.engine.batch_invariant = v != 0;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-' || a[1] == 0) {
            if (model) {
                fprintf(stderr, "disagg serve: one MODEL expected, got '%s' and '%s'\n", model, a);
                goto fail;
            }
            model = a;
            continue;
        }
        char flag[80];
        const char *val = NULL;
        const char *eq = strchr(a, '=');
        size_t fl = eq ? (size_t)(eq - a) : strlen(a);
        if (fl >= sizeof flag) fl = sizeof flag - 1;
        memcpy(flag, a, fl);
        flag[fl] = 0;
        for (char *p = flag; *p; p++)
            if (*p == '_') *p = '-'; /* vLLM accepts --max_model_len too */
        for (size_t k = 0; k < sizeof SHORT / sizeof SHORT[0]; k++)
            if (!strcmp(flag, SHORT[k][0])) snprintf(flag, sizeof flag, "%s", SHORT[k][1]);
        if (!strcmp(flag, "--help") || !strcmp(flag, "-h")) {
            serve_usage(stdout);
            goto done_ok;
        }
        int negated = 0;
        int kind = flag_kind(flag);
        if (kind < 0 && !strncmp(flag, "--no-", 5)) {
            char pos[80];
            snprintf(pos, sizeof pos, "--%s", flag + 5);
            if (flag_kind(pos) == B) {
                kind = B, negated = 1;
                snprintf(flag, sizeof flag, "%s", pos);
            }
        }
        if (kind < 0) {
            int ne = no_effect_flag(flag, eq, argc, argv, &i);
            if (ne > 0) continue;
            if (ne == 0) unknown_flag(flag);
            goto fail;
        }
        if (kind == V) {
            if (eq)
                val = eq + 1;
            else if (i + 1 < argc)
                val = argv[++i];
            else {
                fprintf(stderr, "disagg serve: %s needs a value (see disagg serve --help)\n", flag);
                goto fail;
            }
        } else if (eq) {
            fprintf(stderr, "disagg serve: %s takes no value\n", flag);
            goto fail;
        }
        long x;
        if (discovery_cli_is_flag(flag, 1)) {
            if (discovery_cli_flag("serve", &disc, flag, val)) goto fail;
        } else if (!strcmp(flag, "--host"))
            cfg.host = val;
        else if (!strcmp(flag, "--model"))
            model = val;
        else if (!strcmp(flag, "--port")) {
            if (parse_long(flag, val, 0, 65535, &x)) goto fail;
            cfg.port = (int)x;
        } else if (!strcmp(flag, "--served-model-name")) {
            /* vLLM's nargs="+": every following word up to the next flag (the last
             * --served-model-name wins); a --config list arrives as a JSON list */
            n_names = 0;
            json_decref(names_json);
            names_json = NULL;
            if (val[0] == '[') {
                names_json = json_loads(val, 0, NULL);
                size_t k;
                json_t *x;
                int ok = json_is_array(names_json) && json_array_size(names_json) > 0;
                if (ok) json_array_foreach(names_json, k, x) ok &= json_is_string(x);
                if (!ok) {
                    fprintf(stderr,
                            "disagg serve: --served-model-name '%s': a list must be a non-empty "
                            "JSON list of strings\n",
                            val);
                    goto fail;
                }
                json_array_foreach(names_json, k, x) {
                    if (n_names == MAX_NAMES) break;
                    names[n_names++] = json_string_value(x);
                }
            } else
                names[n_names++] = val;
            int more = !eq && !names_json; /* a JSON list is the whole list */
            while (more && i + 1 < argc && argv[i + 1][0] != '-' && n_names < MAX_NAMES)
                names[n_names++] = argv[++i];
            if (more && i + 1 < argc && argv[i + 1][0] != '-') {
                fprintf(stderr, "disagg serve: --served-model-name: at most %d names\n", MAX_NAMES);
                goto fail;
            }
            for (int k = 0; k < n_names; k++)
                if (!*names[k]) {
                    fprintf(stderr, "disagg serve: --served-model-name: a name is empty\n");
                    goto fail;
                }
            cfg.served_model_name = names[0];
            cfg.more_model_names = names + 1;
            cfg.n_more_model_names = n_names - 1;
        } else if (!strcmp(flag, "--api-key"))
            cfg.api_key = val;
        else if (!strcmp(flag, "--max-model-len")) {
            if (parse_long(flag, val, 1, 1 << 24, &x)) goto fail;
            cfg.engine.max_model_len = (int)x;
        } else if (!strcmp(flag, "--max-num-seqs")) {
            if (parse_long(flag, val, 1, 1 << 16, &x)) goto fail;
            cfg.engine.max_num_seqs = (int)x;
        } else if (!strcmp(flag, "--max-num-batched-tokens")) {
            if (parse_long(flag, val, 1, 1 << 24, &x)) goto fail;
            cfg.engine.max_num_batched_tokens = (int)x;
        } else if (!strcmp(flag, "--block-size")) {
            if (parse_long(flag, val, 1, 1024, &x)) goto fail;
            cfg.engine.block_size = (int)x;
        } else if (!strcmp(flag, "--kv-cache-memory")) {
            if (parse_bytes(flag, val, &cfg.engine.kv_cache_bytes)) goto fail;
        } else if (!strcmp(flag, "--client-header-timeout") ||
                   !strcmp(flag, "--client-body-timeout") ||
                   !strcmp(flag, "--timeout-keep-alive")) {
            char *end;
            errno = 0;
            double d = strtod(val, &end);
            if (errno || end == val || *end || !(d > 0) || d > 86400) {
                fprintf(stderr,
                        "disagg serve: %s expects seconds, a number in (0, 86400], got '%s'\n",
                        flag, val);
                goto fail;
            }
            if (!strcmp(flag, "--client-header-timeout"))
                cfg.header_timeout_s = d;
            else if (!strcmp(flag, "--client-body-timeout"))
                cfg.body_timeout_s = d;
            else
                cfg.keepalive_timeout_s = d;
        } else if (!strcmp(flag, "--max-body-bytes")) {
            if (parse_bytes(flag, val, &cfg.max_body_bytes)) goto fail;
        } else if (!strcmp(flag, "--enable-prefix-caching"))
            cfg.engine.enable_prefix_caching = !negated;
        else if (!strcmp(flag, "--seed")) {
            if (parse_long(flag, val, 0, LONG_MAX, &x)) goto fail;
            cfg.engine.seed = (uint64_t)x;
        } else if (!strcmp(flag, "--threads")) {
            if (parse_long(flag, val, 0, 4096, &x)) goto fail;
            cfg.engine.threads = (int)x;
        } else if (!strcmp(flag, "--device")) {
            if (strcmp(val, "auto") && strcmp(val, "cpu") && strncmp(val, "cuda", 4)) {
                int vllm = !strcmp(val, "tpu") || !strcmp(val, "xpu") || !strcmp(val, "hpu") ||
                           !strcmp(val, "neuron") || !strcmp(val, "rocm");
                fprintf(stderr, "disagg serve: --device '%s' is %s; accepted: %s\n", val,
                        vllm ? "not supported (disagg has CPU and CUDA backends)" : "not a device",
                        BACKEND_DEVICE_NAMES);
                goto fail;
            }
            cfg.engine.device = val; /* "cuda:N" is checked when the backend opens */
        } else if (!strcmp(flag, "--gpu-memory-utilization")) {
            char *end;
            double f = strtod(val, &end);
            if (*val == 0 || *end || !(f > 0.0 && f <= 1.0)) {
                fprintf(stderr,
                        "disagg serve: --gpu-memory-utilization '%s' is invalid; accepted: a "
                        "fraction in (0, 1], e.g. 0.9\n",
                        val);
                goto fail;
            }
            cfg.engine.gpu_memory_utilization = f;
        } else if (!strcmp(flag, "--enforce-eager")) {
            cfg.engine.enforce_eager = !negated;
        } else if (!strcmp(flag, "--batch-invariant")) {
            cfg.engine.batch_invariant = !negated;
        } else if (!strcmp(flag, "--tensor-parallel-size") ||
                   !strcmp(flag, "--pipeline-parallel-size") ||
                   !strcmp(flag, "--data-parallel-size")) {
            if (parse_long(flag, val, 1, 1 << 20, &x)) goto fail;
            if (x != 1) {
                fprintf(stderr,
                        "disagg serve: %s %ld is not supported yet: one disagg serve process runs "
                        "the whole model on one device; accepted: 1. Scale out with more "
                        "instances behind `disagg proxy` instead\n",
                        flag, x);
                goto fail;
            }
        } else if (!strcmp(flag, "--distributed-executor-backend")) {
            if (strcmp(val, "uni") && strcmp(val, "mp")) {
                fprintf(stderr,
                        "disagg serve: --distributed-executor-backend '%s' is %s; accepted: uni, "
                        "mp (disagg runs in one process)\n",
                        val,
                        !strcmp(val, "ray") || !strcmp(val, "external_launcher")
                            ? "not supported"
                            : "not a backend (vLLM's: ray, mp, uni, external_launcher)");
                goto fail;
            }
        } else if (!strcmp(flag, "--enable-chunked-prefill")) {
            if (negated)
                LOG_I("serve", "--no-enable-chunked-prefill: accepted; prompts are still "
                               "prefilled in chunks of --max-num-batched-tokens");
        } else if (!strcmp(flag, "--quantization")) {
            static const char *known[] = {
                "aqlm",       "awq",          "deepspeedfp",        "tpu_int8",     "fp8",
                "ptpc_fp8",   "fbgemm_fp8",   "modelopt",           "modelopt_fp4", "marlin",
                "bitblas",    "gguf",         "gptq_marlin_24",     "gptq_marlin",  "gptq_bitblas",
                "awq_marlin", "gptq",         "compressed-tensors", "bitsandbytes", "qqq",
                "hqq",        "experts_int8", "neuron_quant",       "ipex",         "quark",
                "moe_wna16",  "torchao",      "auto-round",         "rtn",          "inc",
                "mxfp4"};
            int k = 0;
            for (size_t j = 0; j < sizeof known / sizeof known[0]; j++)
                k |= !strcmp(val, known[j]);
            if (strcmp(val, "none")) {
                fprintf(stderr,
                        "disagg serve: --quantization '%s' is %s; disagg runs unquantized "
                        "weights (bfloat16, float16 or float32 safetensors); accepted: none\n",
                        val, k ? "not supported" : "not a vLLM quantization method");
                goto fail;
            }
        } else if (!strcmp(flag, "--load-format")) {
            static const char *known[] = {"pt",
                                          "npcache",
                                          "dummy",
                                          "tensorizer",
                                          "sharded_state",
                                          "gguf",
                                          "bitsandbytes",
                                          "mistral",
                                          "runai_streamer",
                                          "runai_streamer_sharded",
                                          "fastsafetensors"};
            int k = 0;
            for (size_t j = 0; j < sizeof known / sizeof known[0]; j++)
                k |= !strcmp(val, known[j]);
            cfg.engine.load_dummy = !strcmp(val, "dummy");
            if (strcmp(val, "auto") && strcmp(val, "safetensors") && strcmp(val, "dummy")) {
                fprintf(stderr,
                        "disagg serve: --load-format '%s' is %s; accepted: auto, safetensors, "
                        "dummy\n",
                        val, k ? "not supported" : "not a load format");
                goto fail;
            }
        } else if (!strcmp(flag, "--swap-space")) {
            char *end;
            double g = strtod(val, &end);
            if (!*val || *end || !(g >= 0) || g > 1e6) {
                fprintf(stderr, "disagg serve: --swap-space expects GiB, a number >= 0, got '%s'\n",
                        val);
                goto fail;
            }
        } else if (!strcmp(flag, "--tokenizer")) {
            tokenizer_arg = val;
        } else if (!strcmp(flag, "--revision")) {
            revision = val;
        } else if (!strcmp(flag, "--chat-template")) {
            chat_template_arg = val;
        } else if (!strcmp(flag, "--generation-config")) {
            if (strcmp(val, "auto") && strcmp(val, "vllm")) {
                char g[PATH_MAX + 32];
                struct stat st;
                snprintf(g, sizeof g, "%s/generation_config.json", val);
                if (stat(g, &st)) {
                    fprintf(stderr,
                            "disagg serve: --generation-config '%s': no %s (%s); accepted: auto "
                            "(the model's), vllm (none), or a directory holding "
                            "generation_config.json\n",
                            val, g, strerror(errno));
                    goto fail;
                }
            }
            cfg.generation_config = val;
        } else if (!strcmp(flag, "--override-generation-config")) {
            oai_defaults d;
            oai_defaults_init(&d);
            char oerr[512];
            if (oai_defaults_override(&d, val, oerr, sizeof oerr)) {
                fprintf(stderr, "disagg serve: --override-generation-config '%s': %s\n", val, oerr);
                goto fail;
            }
            cfg.override_generation_config = val;
        } else if (!strcmp(flag, "--max-logprobs")) {
            if (parse_long(flag, val, -1, LONG_MAX, &x)) goto fail;
            if (x > 20) {
                fprintf(stderr,
                        "disagg serve: --max-logprobs %ld is not supported: the engine returns at "
                        "most 20 logprobs per token; accepted: -1 (no cap: 20) .. 20\n",
                        x);
                goto fail;
            }
            cfg.max_logprobs = x < 0 ? 20 : (int)x;
        } else if (!strcmp(flag, "--enable-auto-tool-choice")) {
            auto_tool_choice = 1;
        } else if (!strcmp(flag, "--tool-call-parser")) {
            if (strcmp(val, "hermes")) {
                fprintf(stderr,
                        "disagg serve: --tool-call-parser '%s' is not supported; accepted: "
                        "hermes (Qwen2.5's <tool_call>{...}</tool_call>)\n",
                        val);
                goto fail;
            }
            tool_parser = val;
        } else if (!strcmp(flag, "--allowed-origins")) {
            if (parse_json_list(flag, val, &cfg.cors_origins)) goto fail;
        } else if (!strcmp(flag, "--allowed-methods")) {
            if (parse_json_list(flag, val, &cfg.cors_methods)) goto fail;
        } else if (!strcmp(flag, "--allowed-headers")) {
            if (parse_json_list(flag, val, &cfg.cors_headers)) goto fail;
        } else if (!strcmp(flag, "--allow-credentials")) {
            cfg.cors_credentials = 1;
        } else if (!strcmp(flag, "--root-path")) {
            cfg.root_path = val;
        } else if (!strcmp(flag, "--disable-log-stats")) {
            cfg.log_stats = 0;
        } else if (!strcmp(flag, "--config")) {
            /* read before the loop (cmd_serve) */
        } else if (!strcmp(flag, "--kv-cache-dtype")) {
            if (!strncmp(val, "fp8", 3)) {
                fprintf(stderr,
                        "disagg serve: --kv-cache-dtype %s is not supported: no fp8 KV cache "
                        "kernels; accepted: %s\n",
                        val, BACKEND_DTYPE_NAMES);
                goto fail;
            }
            if (backend_dtype_parse(val, &cfg.engine.kv_cache_dtype)) {
                fprintf(stderr,
                        "disagg serve: --kv-cache-dtype '%s' is not supported; accepted: %s\n", val,
                        BACKEND_DTYPE_NAMES);
                goto fail;
            }
        } else if (!strcmp(flag, "--dtype")) {
            static const char *ok[] = {"auto", "bfloat16", "float16", "half", "float32", "float"};
            int good = 0;
            for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++)
                good |= !strcmp(val, ok[k]);
            if (!good) {
                fprintf(stderr,
                        "disagg serve: --dtype '%s' is not supported; accepted: auto, bfloat16, "
                        "float16, half, float32, float\n",
                        val);
                goto fail;
            }
            if (strcmp(val, "auto"))
                LOG_I("serve",
                      "--dtype %s: weights are read as stored and the CPU backend computes in "
                      "float32",
                      val);
        } else if (!strcmp(flag, "--kv-transfer-config")) {
            kv_transfer_config kc;
            char err[512];
            if (kv_transfer_config_parse(val, &kc, err, sizeof err)) {
                fprintf(stderr, "disagg serve: --kv-transfer-config: %s\n", err);
                goto fail;
            }
            cfg.kv_transfer_config = val;
        } else if (!strcmp(flag, "--uvicorn-log-level")) {
            static const char *lv[] = {"critical", "error", "warning", "info", "debug", "trace"};
            static const log_level map[] = {LOG_ERROR, LOG_ERROR, LOG_WARN,
                                            LOG_INFO,  LOG_DEBUG, LOG_DEBUG};
            int found = -1;
            for (int k = 0; k < 6; k++)
                if (!strcmp(val, lv[k])) found = k;
            if (found < 0) {
                fprintf(stderr,
                        "disagg serve: --uvicorn-log-level '%s'; accepted: critical, error, "
                        "warning, info, debug, trace\n",
                        val);
                goto fail;
            }
            log_set_level(map[found]);
        } else if (!strcmp(flag, "--disable-log-requests"))
            cfg.log_requests = 0;
        else if (!strcmp(flag, "--enable-log-requests"))
            cfg.log_requests = 1;
        else if (!strcmp(flag, "--trust-remote-code")) {
            /* accepted: no remote code exists to run */
        }
    }
    if (auto_tool_choice && !tool_parser) {
        fprintf(stderr, "disagg serve: --enable-auto-tool-choice needs --tool-call-parser; "
                        "accepted: hermes\n");
        goto fail;
    }
    if (!model) {
        if (serve_default_model(default_model, sizeof default_model)) goto fail;
        model = default_model;
        if (!cfg.served_model_name) cfg.served_model_name = DEFAULT_MODEL_NAME;
    }
    cfg.model = model;
    cfg.engine.model = model;
    char err[2048];
    if (revision) {
        struct stat st;
        if (stat(model, &st) == 0 && S_ISDIR(st.st_mode))
            LOG_I("serve", "--revision %s: MODEL %s is a local directory, used as is", revision,
                  model);
        else if (hf_cache_resolve_rev(model, revision, model_dir, sizeof model_dir, err,
                                      sizeof err)) {
            fprintf(stderr, "disagg serve: --revision: %s\n", err);
            goto fail;
        } else
            cfg.engine.model = model_dir; /* the snapshot; the API name stays MODEL */
    }
    if (tokenizer_arg) {
        if (hf_cache_resolve(tokenizer_arg, tok_dir, sizeof tok_dir, err, sizeof err)) {
            fprintf(stderr, "disagg serve: --tokenizer: %s\n", err);
            goto fail;
        }
        cfg.tokenizer_dir = tok_dir;
    }
    if (chat_template_arg) {
        /* vLLM: a file's contents; else, when it holds a template character, the template */
        template_text = file_read_text(chat_template_arg, 1 << 20);
        if (!template_text) {
            if (!strpbrk(chat_template_arg, "{}\n")) {
                fprintf(stderr,
                        "disagg serve: --chat-template '%s' looks like a file path, but it "
                        "cannot be opened (%s); accepted: a Jinja template file or the template "
                        "text itself\n",
                        chat_template_arg, strerror(errno));
                goto fail;
            }
            template_text = strdup(chat_template_arg);
        }
        chat_template *ct = NULL;
        if (!template_text || chat_template_init(template_text, &ct, err, sizeof err)) {
            fprintf(stderr, "disagg serve: --chat-template: %s\n",
                    template_text ? err : "out of memory");
            goto fail;
        }
        chat_template_free(ct);
        cfg.chat_template = template_text;
    }
    cfg.engine.progress = isatty(2);
    if (discovery_cli_finish("serve", &disc)) goto fail;
    serve_registration *reg = NULL;
    if (disc.set) {
        serve_identity id = {cfg.host,
                             cfg.port,
                             cfg.served_model_name ? cfg.served_model_name : model,
                             cfg.engine.model,
                             cfg.engine.block_size,
                             cfg.engine.kv_cache_dtype < 0
                                 ? "auto"
                                 : backend_dtype_name((backend_dtype)cfg.engine.kv_cache_dtype),
                             cfg.kv_transfer_config};
        int st = serve_registration_start(&disc, &id, &reg);
        if (st) {
            rc = st < 0 ? 1 : st;
            goto out;
        }
        cfg.on_engine = serve_registration_set_engine;
        cfg.on_engine_arg = reg;
    }
    rc = server_run(&cfg) == 0 ? 0 : 1;
    serve_registration_stop(reg);
    goto out;
done_ok:
    rc = 0;
    goto out;
fail:
    rc = 2;
out:
    json_decref(names_json);
    json_decref(cfg.cors_origins);
    json_decref(cfg.cors_methods);
    json_decref(cfg.cors_headers);
    free(template_text);
    return rc;
}
