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
#include "base/file.h"
#include "base/flags.h"
#include "cli/commands.h"
#include "cli/discovery_cli.h"
#include "cli/tp_launch.h"
#include "engine/tp_worker.h"
#include "kernels/collective.h"

#include "base/log.h"
#include "connector/kv_events_publisher.h"
#include "connector/kv_transfer_config.h"
#include "kernels/backend.h"
#include "model/chat_template.h"
#include "model/hf_cache.h"
#include "server/openai_request.h"
#include "server/reasoning.h"
#include "server/server.h"
#include "server/tool_parser.h"

#include <jansson.h>
#include <yaml.h>

#include <errno.h>
#include <signal.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define DEFAULT_MODEL_NAME "disagg-sotu-tiny"

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

/* ---- the flags ------------------------------------------------------------------------ */

/* What the flags set: the server's configuration and what is resolved after them. */
static struct serve_opts {
    server_config cfg;
    const char *model, *tokenizer, *revision, *chat_template, *tool_parser, *config;
    int auto_tool_choice;
    flag_list names; /* --served-model-name */
    discovery_cli disc;
    double offload_gib, offload_disk_gib; /* --kv-offloading-size, --kv-offloading-disk-size */
    int offload_backend;                  /* --kv-offloading-backend: 0 native */
    int tp;               /* --tensor-parallel-size */
    const char *executor; /* --distributed-executor-backend */
} S;

static int on_model(flags_parser *p, const char *word) {
    if (S.model) {
        flags_error(p, "one MODEL expected, got '%s' and '%s'", S.model, word);
        return -1;
    }
    S.model = word;
    return 0;
}

/* -tp/-pp/-dp: checked as integers by the table, then 1 only */
static int one_device(flags_parser *p, const flag_def *d, const char *v) {
    long x = strtol(v, NULL, 10);
    if (x == 1) return 0;
    flags_error(p,
                "%s %ld is not supported yet: one disagg serve process runs the whole model on one "
                "device; accepted: 1. Scale out with more instances behind `disagg proxy` instead",
                d->name, x);
    return -1;
}

/* -tp: 1, 2, 4 or 8 ranks (whether the model's heads and widths divide: at load) */
static int tp_size(flags_parser *p, const flag_def *d, const char *v) {
    (void)v;
    if (S.tp == 1 || S.tp == 2 || S.tp == 4 || S.tp == 8) return 0;
    flags_error(p,
                "%s %d is not supported; accepted: 1, 2, 4 or 8 (ranks as processes of this "
                "host, each holding 1/N of the heads and MLP; the model's heads must divide)",
                d->name, S.tp);
    return -1;
}

static int executor_backend(flags_parser *p, const flag_def *d, const char *v) {
    S.executor = v;
    if (!strcmp(v, "uni") || !strcmp(v, "mp")) return 0;
    flags_error(p,
                "%s '%s' is %s; accepted: mp (one process per tensor-parallel rank on this host, "
                "as vLLM's multiprocessing executor), uni (one process: --tensor-parallel-size 1)",
                d->name, v,
                !strcmp(v, "ray") || !strcmp(v, "external_launcher")
                    ? "not supported"
                    : "not a backend (vLLM's: ray, mp, uni, external_launcher)");
    return -1;
}

static int chunked_prefill(flags_parser *p, const flag_def *d, const char *v) {
    (void)d, (void)v;
    if (flags_negated(p))
        LOG_I("serve", "--no-enable-chunked-prefill: accepted; prompts are still prefilled in "
                       "chunks of --max-num-batched-tokens");
    return 0;
}

static const char *const QUANTIZATIONS[] = {"aqlm",
                                            "awq",
                                            "deepspeedfp",
                                            "tpu_int8",
                                            "fp8",
                                            "ptpc_fp8",
                                            "fbgemm_fp8",
                                            "modelopt",
                                            "modelopt_fp4",
                                            "marlin",
                                            "bitblas",
                                            "gguf",
                                            "gptq_marlin_24",
                                            "gptq_marlin",
                                            "gptq_bitblas",
                                            "awq_marlin",
                                            "gptq",
                                            "compressed-tensors",
                                            "bitsandbytes",
                                            "qqq",
                                            "hqq",
                                            "experts_int8",
                                            "neuron_quant",
                                            "ipex",
                                            "quark",
                                            "moe_wna16",
                                            "torchao",
                                            "auto-round",
                                            "rtn",
                                            "inc",
                                            "mxfp4",
                                            NULL};

static int quantization(flags_parser *p, const flag_def *d, const char *v) {
    S.cfg.engine.quant_fp8 = !strcmp(v, "fp8");
    if (!strcmp(v, "none") || !strcmp(v, "fp8")) return 0;
    flags_error(p,
                "%s '%s' is %s; disagg runs unquantized weights (bfloat16, float16 or float32 "
                "safetensors) and FP8 (fp8 / compressed-tensors checkpoints, or fp8 quantized at "
                "load); accepted: none, fp8",
                d->name, v,
                flags_one_of(v, QUANTIZATIONS) ? "not supported"
                                               : "not a vLLM quantization method");
    return -1;
}

static const char *const LOAD_FORMATS[] = {"pt",
                                           "npcache",
                                           "dummy",
                                           "tensorizer",
                                           "sharded_state",
                                           "gguf",
                                           "bitsandbytes",
                                           "mistral",
                                           "runai_streamer",
                                           "runai_streamer_sharded",
                                           "fastsafetensors",
                                           NULL};

static int load_format(flags_parser *p, const flag_def *d, const char *v) {
    S.cfg.engine.load_dummy = !strcmp(v, "dummy");
    if (!strcmp(v, "auto") || !strcmp(v, "safetensors") || !strcmp(v, "dummy")) return 0;
    flags_error(p, "%s '%s' is %s; accepted: auto, safetensors, dummy", d->name, v,
                flags_one_of(v, LOAD_FORMATS) ? "not supported" : "not a load format");
    return -1;
}

static int generation_config(flags_parser *p, const flag_def *d, const char *v) {
    if (!strcmp(v, "auto") || !strcmp(v, "vllm")) return 0;
    char g[PATH_MAX + 32];
    struct stat st;
    snprintf(g, sizeof g, "%s/generation_config.json", v);
    if (stat(g, &st) == 0) return 0;
    flags_error(p,
                "%s '%s': no %s (%s); accepted: auto (the model's), vllm (none), or a directory "
                "holding generation_config.json",
                d->name, v, g, strerror(errno));
    return -1;
}

static int override_generation_config(flags_parser *p, const flag_def *d, const char *v) {
    oai_defaults od;
    oai_defaults_init(&od);
    char err[512];
    if (!oai_defaults_override(&od, v, err, sizeof err)) return 0;
    flags_error(p, "%s '%s': %s", d->name, v, err);
    return -1;
}

static int max_logprobs(flags_parser *p, const flag_def *d, const char *v) {
    long long x = strtoll(v, NULL, 10);
    if (x > 20) {
        flags_error(p,
                    "%s %lld is not supported: the engine returns at most 20 logprobs per token; "
                    "accepted: -1 (no cap: 20) .. 20",
                    d->name, x);
        return -1;
    }
    S.cfg.max_logprobs = x < 0 ? 20 : (int)x;
    return 0;
}

static int reasoning_parser(flags_parser *p, const flag_def *d, const char *v) {
    reasoning_kind rk;
    if (reasoning_kind_from_name(v, &rk)) {
        flags_error(p,
                    "%s '%s' is not supported; accepted: " REASONING_PARSERS
                    " (<think>...</think> text goes to reasoning_content)",
                    d->name, v);
        return -1;
    }
    S.cfg.reasoning_parser = (int)rk;
    return 0;
}

static int tool_call_parser(flags_parser *p, const flag_def *d, const char *v) {
    const tool_parser *tp = tool_parser_find(v);
    if (!tp) {
        flags_error(p,
                    "%s '%s' is not supported; accepted: " TOOL_PARSER_NAMES
                    " (hermes: Qwen2.5's <tool_call>{...}</tool_call>; llama3_json: Llama 3.x's "
                    "{\"name\": ..., \"parameters\": ...}; mistral: [TOOL_CALLS]...)",
                    d->name, v);
        return -1;
    }
    S.cfg.tool_parser = tp;
    return 0;
}

static int kv_cache_dtype(flags_parser *p, const flag_def *d, const char *v) {
    if (backend_kv_dtype_parse(v, &S.cfg.engine.kv_cache_dtype)) {
        flags_error(p, "%s '%s' is not supported%s; accepted: %s", d->name, v,
                    !strncasecmp(v, "fp8", 3) ? " (of FP8, only e4m3 KV kernels exist)" : "",
                    BACKEND_KV_DTYPE_NAMES);
        return -1;
    }
    return 0;
}

static int weight_dtype(flags_parser *p, const flag_def *d, const char *v) {
    static const char *const ok[] = {"auto",    "bfloat16", "float16", "half",
                                     "float32", "float",    NULL};
    if (!flags_one_of(v, ok)) {
        flags_error(p,
                    "%s '%s' is not supported; accepted: auto, bfloat16, float16, half, float32, "
                    "float",
                    d->name, v);
        return -1;
    }
    if (strcmp(v, "auto"))
        LOG_I("serve",
              "--dtype %s: weights are read as stored and the CPU backend computes in float32", v);
    return 0;
}

static int device(flags_parser *p, const flag_def *d, const char *v) {
    if (!strcmp(v, "auto") || !strcmp(v, "cpu") || !strncmp(v, "cuda", 4)) {
        S.cfg.engine.device = v; /* "cuda:N" is checked when the backend opens */
        return 0;
    }
    static const char *const vllm[] = {"tpu", "xpu", "hpu", "neuron", "rocm", NULL};
    flags_error(p, "%s '%s' is %s; accepted: %s", d->name, v,
                flags_one_of(v, vllm) ? "not supported (disagg has CPU and CUDA backends)"
                                      : "not a device",
                BACKEND_DEVICE_NAMES);
    return -1;
}

static int check_kv_transfer_config(flags_parser *p, const flag_def *d, const char *v) {
    kv_transfer_config kc;
    char err[512];
    if (!kv_transfer_config_parse(v, &kc, err, sizeof err)) return 0;
    flags_error(p, "%s: %s", d->name, err);
    return -1;
}

static int check_kv_events_config(flags_parser *p, const flag_def *d, const char *v) {
    kv_events_config ec;
    char err[512];
    if (!kv_events_config_parse(v, &ec, err, sizeof err)) return 0;
    flags_error(p, "%s: %s", d->name, err);
    return -1;
}

static int offloading_gib(flags_parser *p, const flag_def *d, const char *v) {
    (void)p, (void)v;
    double gib = *(double *)d->dst;
    size_t bytes = (size_t)(gib * 1073741824.0);
    if (d->dst == &S.offload_gib)
        S.cfg.engine.kv_offload_bytes = bytes;
    else
        S.cfg.engine.kv_offload_disk_bytes = bytes;
    return 0;
}

static int uvicorn_log_level(flags_parser *p, const flag_def *d, const char *v) {
    (void)p, (void)v;
    static const log_level map[] = {LOG_ERROR, LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG, LOG_DEBUG};
    log_set_level(map[*(int *)d->dst]);
    return 0;
}

static int uvicorn_level; /* --uvicorn-log-level's index */

#define SECONDS   "seconds"
#define NO_TUNING "vLLM tuning that disagg has no counterpart for"

static const flag_def SERVE_FLAGS[] = {
    {FLAG_STRING_("--host", &S.cfg.host), .metavar = "HOST",
     .help = "listen address (default 0.0.0.0)"},
    {FLAG_INT_("--port", &S.cfg.port, 0, 65535), .metavar = "PORT",
     .help = "listen port (default 8000)"},
    {FLAG_STRING_("--model", &S.model), .metavar = "MODEL",
     .help = "the model, as the positional MODEL (vllm accepts both)"},
    {FLAG_LIST_("--served-model-name", &S.names), .hi = 32, .unit = "name",
     .metavar = "NAME [NAME ...]",
     .help = "model names in the API, all served; responses report the first (default: MODEL)"},
    {FLAG_STRING_("--api-key", &S.cfg.api_key), .env = "VLLM_API_KEY", .metavar = "KEY",
     .help = "require 'Authorization: Bearer KEY' on /v1 (also VLLM_API_KEY)"},
    {FLAG_INT_("--max-model-len", &S.cfg.engine.max_model_len, 1, 1 << 24),
     .help = "context length (default: the model's)"},
    {FLAG_INT_("--max-num-seqs", &S.cfg.engine.max_num_seqs, 1, 1 << 16),
     .help = "most running requests (default 64)"},
    {FLAG_INT_("--max-num-batched-tokens", &S.cfg.engine.max_num_batched_tokens, 1, 1 << 24),
     .help = "token budget per engine step (default 2048)"},
    {FLAG_INT_("--block-size", &S.cfg.engine.block_size, 1, 1024),
     .help = "tokens per KV-cache block (default: 128 on the CPU, 16 on CUDA)"},
    {FLAG_BYTES_("--kv-cache-memory", &S.cfg.engine.kv_cache_bytes, 1, 1ull << 50),
     .help = "KV-cache size, e.g. 2G or 512M (default on the CPU: 25% of RAM per instance, so two "
             "instances started with defaults on one host reserve half of it; give each its own "
             "size)"},
    {FLAG_BOOL_("--enable-prefix-caching", &S.cfg.engine.enable_prefix_caching),
     .opts = FLAG_NEGATABLE,
     .help = "reuse cached prompt blocks (default); --no-enable-prefix-caching disables prefix "
             "caching"},
    {FLAG_INT_("--seed", &S.cfg.engine.seed, 0, LLONG_MAX),
     .help = "engine seed for unseeded sampling (default 0)"},
    {FLAG_CUSTOM_("--dtype", NULL, weight_dtype), .metavar = "auto|bfloat16|float16|float32",
     .help = "weight dtype check; the CPU computes in float32"},
    {FLAG_INT_("--threads", &S.cfg.engine.threads, 0, 4096),
     .help = "compute threads (default: all cores)"},
    {FLAG_CUSTOM_("--device", NULL, device), .metavar = "auto|cpu|cuda|cuda:N",
     .help = "compute device (default auto: cuda when its module loads and a GPU is visible, else "
             "cpu)"},
    {FLAG_CUSTOM_("--kv-cache-dtype", NULL, kv_cache_dtype),
     .metavar = "auto|bfloat16|float16|float32|fp8|fp8_e4m3",
     .help = "KV-cache element type (default auto: the device's, float32 on the CPU; fp8 = "
             "fp8_e4m3: e4m3 with the checkpoint's k_scale / v_scale, else 1.0)"},
    {FLAG_DOUBLE_("--gpu-memory-utilization", &S.cfg.engine.gpu_memory_utilization, 0, 1),
     .opts = FLAG_OPEN_LO, .unit = "a fraction", .metavar = "F",
     .help = "GPU: this instance's budget, a fraction of the device's total memory, for its "
             "weights, activations and KV cache (default 0.9; the KV cache gets what is left; "
             "memory of other processes is not counted: two instances on one GPU: 0.45 each)"},
    {FLAG_BOOL_("--enforce-eager", &S.cfg.engine.enforce_eager), .opts = FLAG_NEGATABLE,
     .help = "GPU: every step eager (default: decode steps of up to --max-num-seqs sequences run "
             "as CUDA graphs)"},
    {FLAG_BOOL_("--batch-invariant", &S.cfg.engine.batch_invariant), .opts = FLAG_NEGATABLE,
     .env = "VLLM_BATCH_INVARIANT",
     .help = "GPU: kernels whose result for a request does not depend on the batch or the "
             "prompt's chunking (default off, or VLLM_BATCH_INVARIANT=1; the CPU always is)"},
    {FLAG_INT_("--tensor-parallel-size", &S.tp, 1, 1 << 20), .aliases = "-tp", .fn = tp_size,
     .help = "tensor-parallel ranks: 1, 2, 4 or 8 processes on this host (rank 0 serves, the "
             "others are workers it starts; each holds 1/N of the heads, the MLP and the "
             "vocabulary; --device cuda: rank r on cuda:r)"},
    {FLAG_INT_("--pipeline-parallel-size", (int *)NULL, 1, 1 << 20), .aliases = "-pp",
     .fn = one_device, .help = "1 only"},
    {FLAG_INT_("--data-parallel-size", (int *)NULL, 1, 1 << 20), .aliases = "-dp", .fn = one_device,
     .help = "1 only (run more instances behind disagg proxy)"},
    {FLAG_CUSTOM_("--distributed-executor-backend", NULL, executor_backend), .metavar = "B",
     .help = "mp (the default with -tp > 1: one process per rank) or uni (one process, -tp 1); "
             "ray and external_launcher are refused"},
    {FLAG_CUSTOM_("--enable-chunked-prefill", NULL, chunked_prefill),
     .opts = FLAG_SWITCH | FLAG_NEGATABLE,
     .help = "accepted: prompts are always prefilled in chunks of --max-num-batched-tokens"},
    {FLAG_CUSTOM_("--quantization", NULL, quantization), .aliases = "-q", .metavar = "METHOD",
     .help = "none, or fp8: quantize an unquantized checkpoint's linear layers to FP8 e4m3 at "
             "load (one scale per output channel; with --load-format dummy 128x128 blocks); "
             "FP8 checkpoints (quantization_config fp8 / compressed-tensors) load without it; "
             "other methods (awq, gptq, ...) are refused"},
    {FLAG_CUSTOM_("--load-format", NULL, load_format), .metavar = "auto|safetensors|dummy",
     .help = "weight format; dummy: config.json alone, random weights of its shapes made at load "
             "(benchmarks; the tokenizer files are still read); others, e.g. pt or gguf, are "
             "refused"},
    {FLAG_DOUBLE_("--swap-space", (double *)NULL, 0, 1e6), .unit = "GiB", .metavar = "GiB",
     .help = "accepted (a preempted request is recomputed, nothing is swapped)"},
    {FLAG_STRING_("--tokenizer", &S.tokenizer), .metavar = "DIR|ORG/NAME",
     .help = "load the tokenizer from there (default: MODEL)"},
    {FLAG_CHOICE_("--tokenizer-mode", &S.cfg.tokenizer_mode, "auto", "hf", "slow", "mistral"),
     .help = "mistral: chats encoded by mistral-common's rules ([INST], [SYSTEM_PROMPT], "
             "[AVAILABLE_TOOLS], [TOOL_CALLS], [TOOL_RESULTS] by the version of tekken.json or "
             "tokenizer.model.vN), not the chat template; hf and slow: the chat template; auto "
             "(default, vLLM's rule): mistral when the tokenizer directory is in Mistral's format "
             "(consolidated*.safetensors) and has tekken.json or tokenizer.model.v*, else hf"},
    {FLAG_STRING_("--revision", &S.revision), .metavar = "REV",
     .help = "MODEL's branch, tag or commit in the HF cache (default main)"},
    {FLAG_STRING_("--chat-template", &S.chat_template), .metavar = "FILE|TEMPLATE",
     .help = "Jinja chat template: a file, or the template itself"},
    {FLAG_STRING_("--generation-config", &S.cfg.generation_config), .fn = generation_config,
     .metavar = "auto|vllm|DIR",
     .help = "sampling defaults: MODEL's generation_config.json (auto, default), none (vllm), or "
             "DIR's"},
    {FLAG_STRING_("--override-generation-config", &S.cfg.override_generation_config),
     .fn = override_generation_config, .metavar = "JSON",
     .help = "replace those defaults, e.g. '{\"temperature\": 0.5}'; keys: temperature, top_p, "
             "top_k, min_p, repetition_penalty, max_new_tokens (caps every request's max_tokens, "
             "as vLLM)"},
    {FLAG_INT_("--max-logprobs", (int *)NULL, -1, LLONG_MAX), .fn = max_logprobs,
     .help = "most logprobs a request may ask, 0..20 (default 20; -1: 20)"},
    {FLAG_BOOL_("--enable-auto-tool-choice", &S.auto_tool_choice),
     .help = "parse tool calls of chats with tools (disagg does by default)"},
    {FLAG_STRING_("--tool-call-parser", &S.tool_parser), .fn = tool_call_parser,
     .metavar = "hermes|llama3_json|mistral",
     .help = "tool-call format: hermes (Qwen2.5's <tool_call> JSON, the default), llama3_json "
             "(Llama 3.x's JSON), mistral ([TOOL_CALLS])"},
    {FLAG_CUSTOM_("--reasoning-parser", NULL, reasoning_parser), .metavar = "qwen3|deepseek_r1",
     .help = "<think>...</think> text of chat output goes to reasoning_content"},
    {FLAG_JSON_("--allowed-origins", &S.cfg.cors_origins, JSON_ARRAY), .opts = FLAG_STRINGS,
     .help = "CORS origins, e.g. '[\"https://a.example\"]' (default [\"*\"])"},
    {FLAG_JSON_("--allowed-methods", &S.cfg.cors_methods, JSON_ARRAY), .opts = FLAG_STRINGS,
     .help = "CORS methods (default [\"*\"])"},
    {FLAG_JSON_("--allowed-headers", &S.cfg.cors_headers, JSON_ARRAY), .opts = FLAG_STRINGS,
     .help = "CORS headers (default [\"*\"])"},
    {FLAG_BOOL_("--allow-credentials", &S.cfg.cors_credentials), .help = "CORS: allow credentials"},
    {FLAG_STRING_("--root-path", &S.cfg.root_path), .metavar = "PATH",
     .help = "accepted: the prefix a proxy strips (routes stay at /v1/...)"},
    {FLAG_BOOL_("--disable-log-stats", &S.cfg.log_stats), .opts = FLAG_STORE_FALSE,
     .help = "no periodic stats lines (disagg logs none)"},
    {FLAG_STRING_("--config", &S.config), .metavar = "FILE",
     .help = "YAML file of flags (key: value, e.g. max-model-len: 1024); the command line wins"},
    {FLAG_STRING_("--kv-transfer-config", &S.cfg.kv_transfer_config),
     .fn = check_kv_transfer_config, .metavar = "JSON",
     .help = "KV connector configuration (P/D disaggregation)"},
    {FLAG_DOUBLE_("--kv-offloading-size", &S.offload_gib, 0, 1 << 20), .fn = offloading_gib,
     .metavar = "GIB",
     .help = "host-memory KV tier of GIB GiB: blocks the KV cache evicts are kept there (LRU) "
             "and copied back instead of recomputed (vLLM's flag; default 0: none)"},
    {FLAG_CHOICE_("--kv-offloading-backend", &S.offload_backend, "native"),
     .help = "the offload tiers' implementation: native (disagg's own, the only one; vLLM's "
             "lmcache is not available)"},
    {FLAG_STRING_("--kv-offloading-disk", &S.cfg.engine.kv_offload_disk_dir), .metavar = "DIR",
     .help = "disk KV tier under the host tier: blocks the host tier evicts go to a "
             "checksummed slab file in DIR (created empty, removed at exit)"},
    {FLAG_DOUBLE_("--kv-offloading-disk-size", &S.offload_disk_gib, 0, 1 << 30),
     .fn = offloading_gib, .metavar = "GIB", .help = "the disk tier's size in GiB"},
    {FLAG_STRING_("--kv-events-config", &S.cfg.kv_events_config), .fn = check_kv_events_config,
     .metavar = "JSON",
     .help = "KV cache events (vLLM's KVEventsConfig): e.g. '{\"enable_kv_cache_events\": true, "
             "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' "
             "publishes BlockStored/BlockRemoved/AllBlocksCleared batches on ZMQ"},
    {FLAG_BYTES_("--max-body-bytes", &S.cfg.max_body_bytes, 1, 1ull << 50), .metavar = "N",
     .help = "request body limit (default 32M) -> 413"},
    {FLAG_DOUBLE_("--client-header-timeout", &S.cfg.header_timeout_s, 0, 86400),
     .opts = FLAG_OPEN_LO, .unit = SECONDS, .metavar = "S",
     .help = "a request head must be complete S seconds after its first byte (a new connection: "
             "after connecting); bytes do not extend it (nginx's; default 60) -> 408, close"},
    {FLAG_DOUBLE_("--client-body-timeout", &S.cfg.body_timeout_s, 0, 86400), .opts = FLAG_OPEN_LO,
     .unit = SECONDS, .metavar = "S",
     .help = "a request body must be in S seconds after its head (bytes do not extend it; default "
             "60) -> 408, close"},
    {FLAG_DOUBLE_("--timeout-keep-alive", &S.cfg.keepalive_timeout_s, 0, 86400),
     .opts = FLAG_OPEN_LO, .unit = SECONDS, .metavar = "S",
     .help = "close a connection idle S seconds after a response (uvicorn's; default 5, as vLLM)"},
    {FLAG_CHOICE_("--uvicorn-log-level", &uvicorn_level, "critical", "error", "warning", "info",
                  "debug", "trace"),
     .fn = uvicorn_log_level, .metavar = "LEVEL",
     .help = "debug|info|warning|error|critical|trace"},
    {FLAG_BOOL_("--disable-log-requests", &S.cfg.log_requests), .opts = FLAG_STORE_FALSE,
     .help = "no per-request log lines"},
    {FLAG_BOOL_("--enable-log-requests", &S.cfg.log_requests),
     .help = "per-request log lines (default)"},
    {FLAG_BOOL_("--trust-remote-code", (int *)NULL),
     .help = "accepted for compatibility (no remote code is run)"},
    /* vLLM flags that tune what disagg does not have (compilation, uvicorn): accepted, logged */
    {FLAG_NO_EFFECT_("-O0", "vLLM's compilation level; disagg compiles nothing at run time"),
     .aliases = "-O1 -O2 -O3", .opts = FLAG_SWITCH, .synopsis = "-O0..-O3, -O LEVEL",
     .help = "accepted, no effect (logged): vLLM's compilation level"},
    {FLAG_NO_EFFECT_("-O", NO_TUNING), .opts = FLAG_HIDDEN},
    {FLAG_NO_EFFECT_("--compilation-config", NO_TUNING), .metavar = "JSON",
     .help = "accepted, no effect (logged)"},
    {FLAG_NO_EFFECT_("--async-scheduling", NO_TUNING), .opts = FLAG_SWITCH | FLAG_NEGATABLE,
     .help = "accepted, no effect (logged)"},
    {FLAG_NO_EFFECT_("--disable-uvicorn-access-log", NO_TUNING), .opts = FLAG_SWITCH,
     .help = "accepted, no effect (logged)"},
    {FLAG_NO_EFFECT_("--enable-prompt-tokens-details", NO_TUNING), .opts = FLAG_SWITCH,
     .help = "accepted, no effect (logged): usage always has prompt_tokens_details"},
    /* vLLM serve flags for features disagg does not have: refused, naming the feature */
    {FLAG_TEXT_("--speculative-config, --enable-lora, --structured-outputs-config, ...",
                "refused, naming the vLLM feature disagg lacks")},
    {FLAG_REFUSED_("--reasoning-parser-plugin", "reasoning output parsing is not supported yet")},
    {FLAG_REFUSED_("--structured-outputs-config",
                   "structured outputs (json_schema, regex, grammar, choice) are not supported")},
    {FLAG_REFUSED_("--guided-decoding-backend",
                   "structured outputs (guided decoding) are not supported")},
    {FLAG_REFUSED_("--speculative-config", "speculative decoding is not supported")},
    {FLAG_REFUSED_("--enable-lora", "LoRA adapters are not supported")},
    {FLAG_REFUSED_("--lora-modules", "LoRA adapters are not supported")},
    {FLAG_REFUSED_("--max-loras", "LoRA adapters are not supported")},
    {FLAG_REFUSED_("--max-lora-rank", "LoRA adapters are not supported")},
    {FLAG_REFUSED_("--max-cpu-loras", "LoRA adapters are not supported")},
    {FLAG_REFUSED_("--enable-expert-parallel", "expert parallelism is not supported (one process "
                                               "runs the whole model on one device)")},
    {FLAG_REFUSED_("--enable-eplb", "expert-parallel load balancing is not supported")},
    {FLAG_REFUSED_("--cpu-offload-gb", "offloading weights to host memory is not supported")},
    {FLAG_REFUSED_("--limit-mm-per-prompt", "multimodal inputs are not supported (text models "
                                            "only)")},
    {FLAG_REFUSED_("--mm-processor-kwargs", "multimodal inputs are not supported (text models "
                                            "only)")},
    {FLAG_REFUSED_("--enable-prompt-embeds", "prompt embeddings as input are not supported")},
    {FLAG_REFUSED_("--hf-overrides",
                   "overriding config.json is not supported (edit a copy of the model directory)")},
    {FLAG_REFUSED_("--logits-processors", "custom logits processors are not supported")},
    {FLAG_REFUSED_("--enable-sleep-mode", "sleep mode is not supported")},
    {FLAG_REFUSED_("--otlp-traces-endpoint",
                   "OpenTelemetry tracing is not supported (use GET /metrics)")},
    {FLAG_REFUSED_("--ssl-keyfile", "TLS is not supported: terminate TLS in a reverse proxy in "
                                    "front")},
    {FLAG_REFUSED_("--ssl-certfile", "TLS is not supported: terminate TLS in a reverse proxy in "
                                     "front")},
    {FLAG_REFUSED_("--ssl-ca-certs", "TLS is not supported: terminate TLS in a reverse proxy in "
                                     "front")},
    {FLAG_REFUSED_("--uds", "listening on a Unix socket is not supported (use --host and --port)")},
    {FLAG_REFUSED_("--headless", "multi-node data parallelism is not supported")},
    {FLAG_REFUSED_("--data-parallel-address",
                   "data parallelism is not supported (run more instances behind disagg proxy)")},
    {FLAG_REFUSED_("--api-server-count",
                   "one HTTP front end per process (run more instances behind disagg proxy)")},
    {0}};

static flag_def DISCOVERY_FLAGS[DISCOVERY_CLI_NFLAGS + 1];
static const flag_def *const SERVE_TABLES[] = {SERVE_FLAGS, DISCOVERY_FLAGS, NULL};

static const flags_spec SERVE_SPEC = {
    .cmd = "serve",
    .usage = "usage: disagg serve [MODEL] [options]\n\n"
             "OpenAI-compatible server (POST /v1/completions, /v1/chat/completions, /tokenize,\n"
             "/detokenize; GET /v1/models, /health, /ping, /load, /version, /metrics), flags as "
             "`vllm serve`.\n"
             "MODEL: a Hugging Face model directory or a hub name in the HF cache (default: the\n"
             "repository's models/" DEFAULT_MODEL_NAME ").\n"
             "Every flag also takes its value as --flag=VALUE; --max_model_len means "
             "--max-model-len.\n\n"
             "options:\n",
    .tables = SERVE_TABLES,
    .help_col = 34,
    .underscores = 1,
    .positional = on_model,
};

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
            int neg = 0;
            const flag_def *d = flags_find(&SERVE_SPEC, flag, &neg);
            int bad = 0;
            if (d && !neg && flags_is_switch(d)) {
                if (yaml_true(val))
                    bad = strv_push(out, flag, strlen(flag));
                else if (yaml_false(val)) {
                    if (d->opts & FLAG_NEGATABLE) {
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

/* -tp N: the device of rank r ("cuda" -> "cuda:r"; "auto" resolved first, the same way on
 * every rank), the threads of each rank (default: the cores shared out), and the checks. */
static int tp_setup(server_config *cfg, int rank) {
    static char dev[32];
    const char *d = cfg->engine.device;
    if (S.executor && !strcmp(S.executor, "uni")) {
        fprintf(stderr,
                "disagg serve: --distributed-executor-backend uni runs one process; "
                "--tensor-parallel-size %d needs mp (one process per rank)\n",
                S.tp);
        return -1;
    }
    kv_transfer_config kc;
    char kerr[256];
    if (cfg->kv_transfer_config &&
        !kv_transfer_config_parse(cfg->kv_transfer_config, &kc, kerr, sizeof kerr) &&
        kc.layerwise && kc.layerwise_set) {
        fprintf(stderr,
                "disagg serve: kv_connector_extra_config.layerwise true with "
                "--tensor-parallel-size %d is not implemented (an instance of several ranks "
                "sends and pulls whole requests); accepted: layerwise at -tp 1, or -tp %d "
                "without layerwise\n",
                S.tp, S.tp);
        return -1;
    }
    if (!strcmp(d, "auto")) {
        backend *be = NULL;
        char err[512];
        if (backend_open("auto", NULL, &be, err, sizeof err)) {
            fprintf(stderr, "disagg serve: --device auto: %s\n", err);
            return -1;
        }
        d = backend_is_cpu(be) ? "cpu" : "cuda";
        backend_close(be);
    }
    if (!strncmp(d, "cuda:", 5)) {
        fprintf(stderr,
                "disagg serve: --device %s with --tensor-parallel-size %d: rank r runs "
                "on cuda:r; accepted: cuda, cpu, auto\n",
                d, S.tp);
        return -1;
    }
    if (!strcmp(d, "cuda"))
        snprintf(dev, sizeof dev, "cuda:%d", rank);
    else
        snprintf(dev, sizeof dev, "%s", d);
    cfg->engine.device = dev;
    if (cfg->engine.threads == 0 && !strncmp(dev, "cpu", 3)) {
        long nc = sysconf(_SC_NPROCESSORS_ONLN);
        cfg->engine.threads = nc / S.tp > 0 ? (int)(nc / S.tp) : 1;
    }
    return 0;
}

int cmd_serve(int argc, char **argv) {
    discovery_cli_init(&S.disc);
    discovery_cli_flags(&S.disc, 1, DISCOVERY_FLAGS);
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
    server_config *cfg = &S.cfg;
    server_config_init(cfg);
    cfg->engine.device = "auto";
    static char default_model[PATH_MAX];
    static char model_dir[PATH_MAX], tok_dir[PATH_MAX];
    char *template_text = NULL;
    collective *tp_group = NULL;
    int rc = 2;
    S.tp = 1;
    int pr = flags_parse(&SERVE_SPEC, argc, argv);
    if (pr == FLAGS_HELP) goto done_ok;
    if (pr) goto fail;
    if (S.names.n) {
        cfg->served_model_name = S.names.v[0];
        cfg->more_model_names = S.names.v + 1;
        cfg->n_more_model_names = S.names.n - 1;
    }
    const char *model = S.model;
    if (S.auto_tool_choice && !S.tool_parser) {
        fprintf(stderr, "disagg serve: --enable-auto-tool-choice needs --tool-call-parser; "
                        "accepted: " TOOL_PARSER_NAMES "\n");
        goto fail;
    }
    if (!model) {
        if (serve_default_model(default_model, sizeof default_model)) goto fail;
        model = default_model;
        if (!cfg->served_model_name) cfg->served_model_name = DEFAULT_MODEL_NAME;
    }
    cfg->model = model;
    cfg->engine.model = model;
    char err[2048];
    if (S.revision) {
        struct stat st;
        if (stat(model, &st) == 0 && S_ISDIR(st.st_mode))
            LOG_I("serve", "--revision %s: MODEL %s is a local directory, used as is", S.revision,
                  model);
        else if (hf_cache_resolve_rev(model, S.revision, model_dir, sizeof model_dir, err,
                                      sizeof err)) {
            fprintf(stderr, "disagg serve: --revision: %s\n", err);
            goto fail;
        } else
            cfg->engine.model = model_dir; /* the snapshot; the API name stays MODEL */
    }
    if (S.tokenizer) {
        if (hf_cache_resolve(S.tokenizer, tok_dir, sizeof tok_dir, err, sizeof err)) {
            fprintf(stderr, "disagg serve: --tokenizer: %s\n", err);
            goto fail;
        }
        cfg->tokenizer_dir = tok_dir;
    }
    if (S.chat_template) {
        /* vLLM: a file's contents; else, when it holds a template character, the template */
        template_text = file_read_text(S.chat_template, 1 << 20);
        if (!template_text) {
            if (!strpbrk(S.chat_template, "{}\n")) {
                fprintf(stderr,
                        "disagg serve: --chat-template '%s' looks like a file path, but it "
                        "cannot be opened (%s); accepted: a Jinja template file or the template "
                        "text itself\n",
                        S.chat_template, strerror(errno));
                goto fail;
            }
            template_text = strdup(S.chat_template);
        }
        chat_template *ct = NULL;
        if (!template_text || chat_template_init(template_text, &ct, err, sizeof err)) {
            fprintf(stderr, "disagg serve: --chat-template: %s\n",
                    template_text ? err : "out of memory");
            goto fail;
        }
        chat_template_free(ct);
        cfg->chat_template = template_text;
    }
    cfg->engine.progress = isatty(2);
    int tp_rank = 0, tp_fd = -1, tp_kv_fd = -1;
    int worker = tp_launch_worker_env(&tp_rank, &tp_fd, &tp_kv_fd, err, sizeof err);
    if (worker < 0 || (worker && S.tp <= tp_rank)) {
        fprintf(stderr, "disagg serve: %s\n",
                worker < 0 ? err : "a tensor-parallel worker of a larger group than -tp says");
        goto fail;
    }
    if (S.tp > 1 && tp_setup(cfg, tp_rank)) goto fail;
    if (worker) { /* rank tp_rank of the group rank 0 started: no server */
        cfg->engine.progress = 0;
        /* a terminal's Ctrl-C reaches the whole process group: rank 0 stops the workers */
        signal(SIGINT, SIG_IGN);
        if (collective_open(tp_fd, &tp_group, err, sizeof err) ||
            collective_join(tp_group, tp_rank) ||
            tp_worker_run(&cfg->engine, tp_group, tp_kv_fd, err, sizeof err)) {
            fprintf(stderr, "disagg serve: tensor-parallel worker rank %d: %s\n", tp_rank, err);
            rc = 1;
        } else
            rc = 0;
        collective_free(tp_group);
        tp_group = NULL;
        goto out;
    }
    if (S.tp > 1) {
        /* with a KV connector, rank 0 maps every rank's KV region (P/D across TP sizes) */
        if (tp_launch_start(S.tp, cfg->kv_transfer_config != NULL, &tp_group, err, sizeof err)) {
            fprintf(stderr, "disagg serve: --tensor-parallel-size %d: %s\n", S.tp, err);
            goto fail;
        }
        cfg->engine.tp_group = tp_group;
        cfg->engine.tp_kv_fds = tp_launch_kv_fds();
    }
    if (discovery_cli_finish("serve", &S.disc)) goto fail;
    serve_registration *reg = NULL;
    if (S.disc.set) {
        serve_identity id = {cfg->host,
                             cfg->port,
                             cfg->served_model_name ? cfg->served_model_name : model,
                             cfg->engine.model,
                             cfg->engine.block_size,
                             cfg->engine.kv_cache_dtype < 0
                                 ? "auto"
                                 : backend_dtype_name((backend_dtype)cfg->engine.kv_cache_dtype),
                             cfg->kv_transfer_config};
        int st = serve_registration_start(&S.disc, &id, &reg);
        if (st) {
            rc = st < 0 ? 1 : st;
            goto out;
        }
        cfg->on_engine = serve_registration_set_engine;
        cfg->on_engine_arg = reg;
    }
    rc = server_run(cfg) == 0 ? 0 : 1;
    serve_registration_stop(reg);
    if (tp_group && tp_launch_stop(tp_group, 0)) rc = 1; /* a worker died while serving */
    tp_group = NULL;
    goto out;
done_ok:
    rc = 0;
    goto out;
fail:
    rc = 2;
out:
    if (tp_group) tp_launch_stop(tp_group, 1); /* started, then a later step failed */
    flag_list_free(&S.names);
    json_decref(cfg->cors_origins);
    json_decref(cfg->cors_methods);
    json_decref(cfg->cors_headers);
    free(template_text);
    return rc;
}
