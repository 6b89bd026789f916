/*
 * fuzz_model_config — a model directory's config.json and
 * generation_config.json (downloaded files: hostile input) through
 * model_config_parse.  The input is config.json, optionally followed by a NUL
 * byte and generation_config.json.  An accepted config must describe a model
 * the engine can size buffers for (positive dimensions, head_dim * heads
 * consistent with what the parser promises).
 */
#include "fuzz/fuzz_util.h"

#include "model/model_config.h"

#include <stdlib.h>

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *gen;
    size_t gen_len;
    int parts = fuzz_split_nul(data, size, &gen, &gen_len);
    size_t cfg_len = parts == 2 ? (size_t)(gen - data) - 1 : size;
    char *cfg = fuzz_strndup(data, cfg_len);
    char *gj = parts == 2 ? fuzz_strndup(gen, gen_len) : NULL;
    model_config c;
    char err[512];
    err[0] = 0;
    int rc = model_config_parse(&c, cfg, gj, "fuzz/config.json", err, sizeof err);
    if (rc != 0) {
        if (rc > 0 || !err[0]) abort();
    } else {
        if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.n_layers <= 0 || c.n_heads <= 0 ||
            c.n_kv_heads <= 0 || c.head_dim <= 0 || c.intermediate_size <= 0 || c.max_position <= 0)
            abort();
        if (c.n_eos < 0 || c.n_eos > MODEL_MAX_EOS) abort();
    }
    free(cfg);
    free(gj);
    return 0;
}
