/*
 * fuzz_tokenizer_json — a model directory's tokenizer.json and
 * tokenizer_config.json (downloaded files) through tokenizer_load.  The input
 * is tokenizer.json, optionally followed by a NUL byte and
 * tokenizer_config.json; both are written into a private temporary directory
 * (tokenizer_load reads a directory).  A tokenizer that loads must then
 * encode and decode a fixed text without failing on valid UTF-8, with ids in
 * its vocabulary.
 */
#include "fuzz/fuzz_util.h"

#include "model/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    return 0;
}

static const char SAMPLE[] =
    "Hello world! <|im_start|>user\n  12345 caf\xc3\xa9 \xe4\xbd\xa0\xe5\xa5"
    "\xbd<|im_end|>\n\t don't";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *dir = fuzz_tmpdir();
    const uint8_t *cfg;
    size_t cfg_len;
    int parts = fuzz_split_nul(data, size, &cfg, &cfg_len);
    size_t tj_len = parts == 2 ? (size_t)(cfg - data) - 1 : size;
    fuzz_write_file(dir, "tokenizer.json", data, tj_len);
    if (parts == 2)
        fuzz_write_file(dir, "tokenizer_config.json", cfg, cfg_len);
    else
        fuzz_remove_file(dir, "tokenizer_config.json");
    tokenizer *tok = NULL;
    char err[512];
    err[0] = 0;
    if (tokenizer_load(dir, &tok, err, sizeof err) != 0) {
        if (tok || !err[0]) abort();
        return 0;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    int32_t vocab = tokenizer_vocab_size(tok);
    if (tokenizer_encode(tok, SAMPLE, sizeof SAMPLE - 1, true, &ids, &n, err, sizeof err) == 0) {
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= vocab) abort();
        char *text = NULL;
        size_t len = 0;
        if (tokenizer_decode(tok, ids, n, false, &text, &len, err, sizeof err) == 0) free(text);
        free(ids);
    }
    (void)tokenizer_token_id(tok, "<|im_end|>");
    (void)tokenizer_eos_id(tok);
    (void)tokenizer_chat_template(tok);
    tokenizer_free(tok);
    return 0;
}
