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
#include "base/text.h"
#include "cli/commands.h"

#include "base/log.h"
#include "connector/kv_transfer_config.h"
#include "kernels/backend.h"
#include "server/server.h"

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
        "/detokenize; GET /v1/models, /health, /version, /metrics), flags as `vllm serve`.\n"
        "MODEL: a Hugging Face model directory or a hub name in the HF cache (default: the\n"
        "repository's models/" DEFAULT_MODEL_NAME ").\n\n"
        "options:\n"
        "  --host HOST                     listen address (default 0.0.0.0)\n"
        "  --port PORT                     listen port (default 8000)\n"
        "  --model MODEL                   the model, as the positional MODEL (vllm accepts both)\n"
        "  --served-model-name NAME        model name in the API (default: MODEL)\n"
        "  --api-key KEY                   require 'Authorization: Bearer KEY' on /v1 (also "
        "VLLM_API_KEY)\n"
        "  --max-model-len N               context length (default: the model's)\n"
        "  --max-num-seqs N                most running requests (default 64)\n"
        "  --max-num-batched-tokens N      token budget per engine step (default 2048)\n"
        "  --block-size N                  tokens per KV-cache block (default 16)\n"
        "  --kv-cache-memory BYTES         KV-cache size, e.g. 2G or 512M (default: 25%% of RAM)\n"
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
        "  --gpu-memory-utilization F      GPU: fraction of device memory for weights, "
        "activations and KV cache (default 0.9; the KV cache gets what is left)\n"
        "  --enforce-eager                 GPU: every step eager (default: decode steps of up "
        "to --max-num-seqs sequences run as CUDA graphs)\n"
        "  --kv-transfer-config JSON       KV connector configuration (P/D disaggregation)\n"
        "  --max-body-bytes N              request body limit (default 32M) -> 413\n"
        "  --client-header-timeout S       a request head must be complete S seconds after its\n"
        "                                  first byte (a new connection: after connecting); bytes\n"
        "                                  do not extend it (nginx's; default 60) -> 408, close\n"
        "  --timeout-keep-alive S          close a connection idle S seconds after a response\n"
        "                                  (uvicorn's; default 5, as vLLM)\n"
        "  --uvicorn-log-level LEVEL       debug|info|warning|error|critical|trace\n"
        "  --disable-log-requests          no per-request log lines\n"
        "  --enable-log-requests           per-request log lines (default)\n"
        "  --trust-remote-code             accepted for compatibility (no remote code is run)\n");
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

/* "123", "64K", "512M", "2G", "1.5G" (binary units). */
static int parse_bytes(const char *flag, const char *v, size_t *out) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    double mult = 1;
    if (*end == 'K' || *end == 'k')
        mult = 1024.0, end++;
    else if (*end == 'M' || *end == 'm')
        mult = 1024.0 * 1024, end++;
    else if (*end == 'G' || *end == 'g')
        mult = 1024.0 * 1024 * 1024, end++;
    else if (*end == 'T' || *end == 't')
        mult = 1024.0 * 1024 * 1024 * 1024, end++;
    if (*end == 'i' || *end == 'B') end++;
    if (*end == 'B') end++;
    if (errno || end == v || *end || x <= 0 || x * mult > 1e15) {
        fprintf(stderr,
                "disagg serve: %s expects a positive byte count such as 4294967296, 512M or 2G, "
                "got '%s'\n",
                flag, v);
        return -EINVAL;
    }
    *out = (size_t)(x * mult);
    return 0;
}

static const char *FLAGS[] = {"--host",
                              "--port",
                              "--served-model-name",
                              "--api-key",
                              "--max-model-len",
                              "--max-num-seqs",
                              "--max-num-batched-tokens",
                              "--block-size",
                              "--kv-cache-memory",
                              "--enable-prefix-caching",
                              "--no-enable-prefix-caching",
                              "--seed",
                              "--dtype",
                              "--threads",
                              "--device",
                              "--kv-cache-dtype",
                              "--gpu-memory-utilization",
                              "--enforce-eager",
                              "--kv-transfer-config",
                              "--max-body-bytes",
                              "--client-header-timeout",
                              "--timeout-keep-alive",
                              "--uvicorn-log-level",
                              "--disable-log-requests",
                              "--enable-log-requests",
                              "--trust-remote-code",
                              "--help",
                              "--model"};
#define NFLAGS (sizeof FLAGS / sizeof FLAGS[0])

static void unknown_flag(const char *f) {
    const char *best = NULL;
    size_t bd = 99;
    for (size_t i = 0; i < NFLAGS; i++) {
        size_t d = (size_t)text_edit_distance(f, FLAGS[i]);
        if (d < bd) bd = d, best = FLAGS[i];
    }
    fprintf(stderr, "disagg serve: unknown option '%s'", f);
    if (best && bd <= 4) fprintf(stderr, "; did you mean %s?", best);
    fprintf(stderr, " (see disagg serve --help)\n");
}

int cmd_serve(int argc, char **argv) {
    server_config cfg;
    server_config_init(&cfg);
    cfg.engine.device = "auto";
    const char *model = NULL;
    static char default_model[PATH_MAX];
    const char *env_key = getenv("VLLM_API_KEY");
    if (env_key && *env_key) cfg.api_key = env_key;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-' || a[1] == 0) {
            if (model) {
                fprintf(stderr, "disagg serve: one MODEL expected, got '%s' and '%s'\n", model, a);
                return 2;
            }
            model = a;
            continue;
        }
        char flag[64];
        const char *val = NULL;
        const char *eq = strchr(a, '=');
        size_t fl = eq ? (size_t)(eq - a) : strlen(a);
        if (fl >= sizeof flag) fl = sizeof flag - 1;
        memcpy(flag, a, fl);
        flag[fl] = 0;
        for (char *p = flag; *p; p++)
            if (*p == '_') *p = '-'; /* vLLM accepts --max_model_len too */
        if (!strcmp(flag, "--help") || !strcmp(flag, "-h")) {
            serve_usage(stdout);
            return 0;
        }
        int takes_value =
            strcmp(flag, "--enable-prefix-caching") && strcmp(flag, "--no-enable-prefix-caching") &&
            strcmp(flag, "--disable-log-requests") && strcmp(flag, "--enable-log-requests") &&
            strcmp(flag, "--trust-remote-code") && strcmp(flag, "--enforce-eager");
        int known = 0;
        for (size_t k = 0; k < NFLAGS; k++)
            known |= !strcmp(flag, FLAGS[k]);
        if (!known) {
            unknown_flag(flag);
            return 2;
        }
        if (takes_value) {
            if (eq)
                val = eq + 1;
            else if (i + 1 < argc)
                val = argv[++i];
            else {
                fprintf(stderr, "disagg serve: %s needs a value (see disagg serve --help)\n", flag);
                return 2;
            }
        } else if (eq) {
            fprintf(stderr, "disagg serve: %s takes no value\n", flag);
            return 2;
        }
        long x;
        if (!strcmp(flag, "--host"))
            cfg.host = val;
        else if (!strcmp(flag, "--model"))
            model = val;
        else if (!strcmp(flag, "--port")) {
            if (parse_long(flag, val, 0, 65535, &x)) return 2;
            cfg.port = (int)x;
        } else if (!strcmp(flag, "--served-model-name"))
            cfg.served_model_name = val;
        else if (!strcmp(flag, "--api-key"))
            cfg.api_key = val;
        else if (!strcmp(flag, "--max-model-len")) {
            if (parse_long(flag, val, 1, 1 << 24, &x)) return 2;
            cfg.engine.max_model_len = (int)x;
        } else if (!strcmp(flag, "--max-num-seqs")) {
            if (parse_long(flag, val, 1, 1 << 16, &x)) return 2;
            cfg.engine.max_num_seqs = (int)x;
        } else if (!strcmp(flag, "--max-num-batched-tokens")) {
            if (parse_long(flag, val, 1, 1 << 24, &x)) return 2;
            cfg.engine.max_num_batched_tokens = (int)x;
        } else if (!strcmp(flag, "--block-size")) {
            if (parse_long(flag, val, 1, 1024, &x)) return 2;
            cfg.engine.block_size = (int)x;
        } else if (!strcmp(flag, "--kv-cache-memory")) {
            if (parse_bytes(flag, val, &cfg.engine.kv_cache_bytes)) return 2;
        } else if (!strcmp(flag, "--client-header-timeout") ||
                   !strcmp(flag, "--timeout-keep-alive")) {
            char *end;
            errno = 0;
            double d = strtod(val, &end);
            if (errno || end == val || *end || !(d > 0) || d > 86400) {
                fprintf(stderr,
                        "disagg serve: %s expects seconds, a number in (0, 86400], got '%s'\n",
                        flag, val);
                return 2;
            }
            if (flag[2] == 'c')
                cfg.header_timeout_s = d;
            else
                cfg.keepalive_timeout_s = d;
        } else if (!strcmp(flag, "--max-body-bytes")) {
            if (parse_bytes(flag, val, &cfg.max_body_bytes)) return 2;
        } else if (!strcmp(flag, "--enable-prefix-caching"))
            cfg.engine.enable_prefix_caching = 1;
        else if (!strcmp(flag, "--no-enable-prefix-caching"))
            cfg.engine.enable_prefix_caching = 0;
        else if (!strcmp(flag, "--seed")) {
            if (parse_long(flag, val, 0, LONG_MAX, &x)) return 2;
            cfg.engine.seed = (uint64_t)x;
        } else if (!strcmp(flag, "--threads")) {
            if (parse_long(flag, val, 0, 4096, &x)) return 2;
            cfg.engine.threads = (int)x;
        } else if (!strcmp(flag, "--device")) {
            if (strcmp(val, "auto") && strcmp(val, "cpu") && strncmp(val, "cuda", 4)) {
                fprintf(stderr, "disagg serve: --device '%s' is not a device; accepted: %s\n", val,
                        BACKEND_DEVICE_NAMES);
                return 2;
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
                return 2;
            }
            cfg.engine.gpu_memory_utilization = f;
        } else if (!strcmp(flag, "--enforce-eager")) {
            cfg.engine.enforce_eager = 1;
        } else if (!strcmp(flag, "--kv-cache-dtype")) {
            if (backend_dtype_parse(val, &cfg.engine.kv_cache_dtype)) {
                fprintf(stderr,
                        "disagg serve: --kv-cache-dtype '%s' is not supported; accepted: %s\n", val,
                        BACKEND_DTYPE_NAMES);
                return 2;
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
                return 2;
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
                return 2;
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
                return 2;
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
    if (!model) {
        if (serve_default_model(default_model, sizeof default_model)) return 2;
        model = default_model;
        if (!cfg.served_model_name) cfg.served_model_name = DEFAULT_MODEL_NAME;
    }
    cfg.model = model;
    cfg.engine.model = model;
    cfg.engine.progress = isatty(2);
    return server_run(&cfg) == 0 ? 0 : 1;
}
