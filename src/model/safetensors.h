/*
 * safetensors — memory-mapped safetensors files (single or sharded through
 * model.safetensors.index.json).  Tensors are used in place from the mapping; the
 * header is validated on open (JSON, dtypes, shapes vs byte ranges, ranges inside the
 * file), and every error names the file and the tensor.
 */
#ifndef DISAGG_MODEL_SAFETENSORS_H
#define DISAGG_MODEL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define ST_MAX_DIMS 4

typedef struct st_tensor {
    char *name;                 /* tensor name */
    char dtype[8];              /* safetensors dtype string: BF16, F16, F32, ... */
    int n_dims;                 /* number of dimensions */
    int64_t shape[ST_MAX_DIMS]; /* dimensions */
    const void *data;           /* into the mapping */
    size_t nbytes;              /* byte length */
    int file;                   /* index into st_set.files */
} st_tensor;

typedef struct st_file {
    char *path;  /* file path */
    void *map;   /* mmap base */
    size_t size; /* file size */
} st_file;

typedef struct st_set {
    st_file *files; /* (n_files) */
    int n_files;
    st_tensor *tensors; /* (n_tensors) sorted by name */
    int n_tensors;
} st_set;

/* Opens dir/model.safetensors.index.json if present (all shards), else every *.safetensors
 * in dir (one expected).  err gets a message on failure.  Returns 0 or -errno/-EINVAL. */
int st_set_open(st_set *s, const char *dir, char *err, size_t errlen);
void st_set_free(st_set *s);
const st_tensor *st_set_find(const st_set *s, const char *name);
const char *st_set_file_of(const st_set *s, const st_tensor *t);
/* Bytes mapped in all files. */
size_t st_set_bytes(const st_set *s);
/* Reads every page once (page cache warm-up); progress on stderr when it is a tty. */
void st_set_prefault(const st_set *s, const char *what);

#endif
