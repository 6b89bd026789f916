/*
 * fuzz_tokenizer_encode — prompt text (any client) through the tiny model's
 * tokenizer: tokenizer_encode with and without special tokens, then
 * tokenizer_decode and the stream decoder on the ids.  Checks: invalid UTF-8
 * is refused exactly when tokenizer_utf8_check says so; ids lie in the
 * vocabulary; the stream decoder's pieces concatenate to tokenizer_decode's
 * text (tokenizer.h promises it), with and without skip_special.
 */
#include "fuzz/fuzz_util.h"

#include "model/tokenizer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TINY_MODEL DISAGG_SOURCE_DIR "/models/disagg-sotu-tiny"

static tokenizer *g_tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    char err[512];
    if (tokenizer_load(TINY_MODEL, &g_tok, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz_tokenizer_encode: %s\n", err);
        abort();
    }
    return 0;
}

static void stream_equals_decode(const int32_t *ids, size_t n, bool skip) {
    char *text = NULL, err[256];
    size_t len = 0;
    if (tokenizer_decode(g_tok, ids, n, skip, &text, &len, err, sizeof err) != 0) abort();
    size_t cap = TOKENIZER_STREAM_OUT_CAP(g_tok);
    char *piece = malloc(cap);
    size_t off = 0, plen = 0;
    tokenizer_stream st;
    tokenizer_stream_init(&st, skip);
    for (size_t i = 0; i <= n; i++) {
        int rc = i < n ? tokenizer_stream_push(g_tok, &st, ids[i], piece, cap, &plen)
                       : tokenizer_stream_flush(&st, piece, cap, &plen);
        if (rc != 0 || off + plen > len || memcmp(text + off, piece, plen) != 0) {
            fprintf(stderr, "stream decode differs from decode at id %zu\n", i);
            abort();
        }
        off += plen;
    }
    if (off != len) abort();
    free(piece);
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *text = (const char *)data;
    size_t bad = tokenizer_utf8_check(text, size);
    if (bad > size) abort();
    for (int special = 0; special < 2; special++) {
        int32_t *ids = NULL;
        size_t n = 0;
        char err[256];
        int rc = tokenizer_encode(g_tok, text, size, special, &ids, &n, err, sizeof err);
        if (bad < size) {
            if (rc != -EILSEQ) abort(); /* invalid UTF-8 is refused, always */
            continue;
        }
        if (rc != 0) {
            fprintf(stderr, "valid UTF-8 refused: %s\n", err);
            abort();
        }
        int32_t vocab = tokenizer_vocab_size(g_tok);
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= vocab) abort();
        if (!special) {
            stream_equals_decode(ids, n, false);
            stream_equals_decode(ids, n, true);
        }
        free(ids);
    }
    /* Arbitrary ids (ones a client may send as a prompt) decode or are refused. */
    size_t nid = size / 2;
    int32_t *ids = malloc((nid + 1) * sizeof *ids);
    int32_t vocab = tokenizer_vocab_size(g_tok);
    for (size_t i = 0; i < nid; i++)
        ids[i] = (int32_t)((data[2 * i] | data[2 * i + 1] << 8) % (vocab + 8)) - 4;
    char *out = NULL, err[256];
    size_t olen = 0;
    int rc = tokenizer_decode(g_tok, ids, nid, false, &out, &olen, err, sizeof err);
    int any_bad = 0;
    for (size_t i = 0; i < nid; i++)
        any_bad |= ids[i] < 0 || ids[i] >= vocab;
    if ((rc == 0) == any_bad) abort();
    if (rc == 0 && tokenizer_utf8_check(out, olen) != olen)
        abort(); /* lossy decode is valid UTF-8 */
    free(out);
    free(ids);
    return 0;
}
