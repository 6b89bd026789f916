/*
 * fuzz_safetensors — weight files (downloaded: hostile) through st_set_open:
 * the 8-byte header length, the JSON header (dtypes, shapes, data_offsets)
 * and, for sharded models, model.safetensors.index.json.  Input byte 0 picks
 * the layout: even, the rest is model.safetensors; odd, the rest is the index
 * JSON, a NUL byte, then the one shard "model-00001-of-00001.safetensors".
 * Files are written to a private temporary directory.  An opened set must
 * have tensors whose bytes lie inside their file's mapping and agree with
 * dtype x shape; every tensor is then read once (ASan catches a range that
 * escapes the mapping).
 */
#include "fuzz/fuzz_util.h"

#include "model/safetensors.h"

#include <stdlib.h>
#include <string.h>

#define SHARD "model-00001-of-00001.safetensors"
#define INDEX "model.safetensors.index.json"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const char *dir = fuzz_tmpdir();
    const uint8_t *rest = data + 1;
    size_t rlen = size - 1;
    if (data[0] & 1) {
        const uint8_t *shard;
        size_t shard_len;
        if (fuzz_split_nul(rest, rlen, &shard, &shard_len) != 2) return 0;
        fuzz_remove_file(dir, "model.safetensors");
        fuzz_write_file(dir, INDEX, rest, (size_t)(shard - rest) - 1);
        fuzz_write_file(dir, SHARD, shard, shard_len);
    } else {
        fuzz_remove_file(dir, INDEX);
        fuzz_remove_file(dir, SHARD);
        fuzz_write_file(dir, "model.safetensors", rest, rlen);
    }
    st_set s;
    char err[512];
    err[0] = 0;
    if (st_set_open(&s, dir, err, sizeof err) != 0) {
        if (!err[0]) abort();
        return 0;
    }
    volatile uint8_t sink = 0;
    for (int i = 0; i < s.n_tensors; i++) {
        const st_tensor *t = &s.tensors[i];
        if (t->file < 0 || t->file >= s.n_files) abort();
        const st_file *f = &s.files[t->file];
        const uint8_t *p = t->data, *base = f->map;
        if (t->nbytes && (p < base || p + t->nbytes > base + f->size)) abort();
        if (t->n_dims < 0 || t->n_dims > ST_MAX_DIMS) abort();
        for (size_t b = 0; b < t->nbytes; b++)
            sink ^= p[b];
        if (st_set_find(&s, t->name) == NULL) abort();
        (void)st_set_file_of(&s, t);
    }
    (void)sink;
    st_set_free(&s);
    return 0;
}
