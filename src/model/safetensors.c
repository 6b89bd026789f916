/*
 * safetensors — parser and mapper.  Format: u64 little-endian header length N, N bytes
 * of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then
 * the data; offsets are relative to the end of the header.
 */
#include "model/safetensors.h"

#include "base/err.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_MAX_HEADER (256u << 20)

static int st_dtype_size(const char *dt) {
    if (!strcmp(dt, "F32") || !strcmp(dt, "I32") || !strcmp(dt, "U32")) return 4;
    if (!strcmp(dt, "F16") || !strcmp(dt, "BF16") || !strcmp(dt, "I16") || !strcmp(dt, "U16"))
        return 2;
    if (!strcmp(dt, "F64") || !strcmp(dt, "I64") || !strcmp(dt, "U64")) return 8;
    if (!strcmp(dt, "I8") || !strcmp(dt, "U8") || !strcmp(dt, "BOOL") || !strcmp(dt, "F8_E4M3") ||
        !strcmp(dt, "F8_E5M2"))
        return 1;
    return 0;
}

/* Maps one file and appends its tensors. */
static int st_add_file(st_set *s, const char *path, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return err_fail(err, errlen, -errno, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return err_fail(err, errlen, -e, "%s: stat failed: %s", path, strerror(e));
    }
    size_t size = (size_t)sb.st_size;
    if (size < 8) {
        close(fd);
        return err_fail(err, errlen, -EINVAL,
                        "%s: truncated safetensors file (%zu bytes, header needs 8)", path, size);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED)
        return err_fail(err, errlen, -errno, "%s: mmap failed: %s", path, strerror(errno));
    st_file *nf = realloc(s->files, (size_t)(s->n_files + 1) * sizeof *nf);
    if (!nf) {
        munmap(map, size);
        return err_fail(err, errlen, -ENOMEM, "out of memory");
    }
    s->files = nf;
    int fi = s->n_files++;
    s->files[fi] = (st_file){strdup(path), map, size};

    uint64_t hlen;
    memcpy(&hlen, map, 8);
    if (hlen > ST_MAX_HEADER || hlen > size - 8)
        return err_fail(
            err, errlen, -EINVAL,
            "%s: corrupt or truncated safetensors file: header length %llu, file size %zu", path,
            (unsigned long long)hlen, size);
    json_error_t je;
    json_t *root = json_loadb((const char *)map + 8, (size_t)hlen, 0, &je);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        return err_fail(err, errlen, -EINVAL, "%s: corrupt safetensors header (JSON: %s)", path,
                        root ? "not an object" : je.text);
    }
    const char *data = (const char *)map + 8 + hlen;
    size_t data_size = size - 8 - (size_t)hlen;
    const char *key;
    json_t *v;
    int rc = 0;
    json_object_foreach(root, key, v) {
        if (!strcmp(key, "__metadata__")) continue;
        json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape"),
               *jo = json_object_get(v, "data_offsets");
        if (!json_is_string(jd) || !json_is_array(js) || !json_is_array(jo) ||
            json_array_size(jo) != 2 || json_array_size(js) > ST_MAX_DIMS) {
            rc = err_fail(err, errlen, -EINVAL, "%s: tensor '%s': malformed header entry", path,
                          key);
            break;
        }
        st_tensor t = {0};
        t.file = fi;
        snprintf(t.dtype, sizeof t.dtype, "%s", json_string_value(jd));
        t.n_dims = (int)json_array_size(js);
        uint64_t numel = 1;
        for (int d = 0; d < t.n_dims; d++) {
            json_t *x = json_array_get(js, (size_t)d);
            if (!json_is_integer(x) || json_integer_value(x) < 0) {
                rc = err_fail(err, errlen, -EINVAL, "%s: tensor '%s': bad shape", path, key);
                break;
            }
            t.shape[d] = json_integer_value(x);
            numel *= (uint64_t)t.shape[d];
        }
        if (rc) break;
        json_t *b = json_array_get(jo, 0), *e = json_array_get(jo, 1);
        if (!json_is_integer(b) || !json_is_integer(e) || json_integer_value(b) < 0 ||
            json_integer_value(e) < json_integer_value(b)) {
            rc = err_fail(err, errlen, -EINVAL, "%s: tensor '%s': bad data_offsets", path, key);
            break;
        }
        uint64_t ob = (uint64_t)json_integer_value(b), oe = (uint64_t)json_integer_value(e);
        if (oe > data_size) {
            rc = err_fail(
                err, errlen, -EINVAL,
                "%s: tensor '%s': data [%llu, %llu) beyond the end of the file (%zu data bytes): "
                "truncated file?",
                path, key, (unsigned long long)ob, (unsigned long long)oe, data_size);
            break;
        }
        int es = st_dtype_size(t.dtype);
        if (es && numel * (uint64_t)es != oe - ob) {
            rc = err_fail(err, errlen, -EINVAL,
                          "%s: tensor '%s': %llu bytes for %llu elements of %s (expected %llu)",
                          path, key, (unsigned long long)(oe - ob), (unsigned long long)numel,
                          t.dtype, (unsigned long long)(numel * (uint64_t)es));
            break;
        }
        t.data = data + ob;
        t.nbytes = (size_t)(oe - ob);
        t.name = strdup(key);
        st_tensor *nt = realloc(s->tensors, (size_t)(s->n_tensors + 1) * sizeof *nt);
        if (!nt || !t.name) {
            free(t.name);
            rc = err_fail(err, errlen, -ENOMEM, "out of memory");
            break;
        }
        s->tensors = nt;
        s->tensors[s->n_tensors++] = t;
    }
    json_decref(root);
    return rc;
}

static int st_cmp(const void *a, const void *b) {
    return strcmp(((const st_tensor *)a)->name, ((const st_tensor *)b)->name);
}

static int str_cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int st_set_open(st_set *s, const char *dir, char *err, size_t errlen) {
    memset(s, 0, sizeof *s);
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    int rc = 0;
    if (access(path, F_OK) == 0) {
        json_error_t je;
        json_t *root = json_load_file(path, 0, &je);
        json_t *wm = root ? json_object_get(root, "weight_map") : NULL;
        if (!json_is_object(wm)) {
            json_decref(root);
            return err_fail(err, errlen, -EINVAL, "%s: %s", path,
                            root ? "no \"weight_map\" object" : je.text);
        }
        /* distinct shard names, sorted */
        size_t n = json_object_size(wm), nu = 0;
        char **names = calloc(n ? n : 1, sizeof *names);
        const char *key;
        json_t *v;
        json_object_foreach(wm, key, v) {
            if (!json_is_string(v)) {
                free(names);
                rc = err_fail(err, errlen, -EINVAL,
                              "%s: weight_map[\"%s\"] must be a shard file name (a string)", path,
                              key);
                json_decref(root);
                return rc;
            }
            names[nu++] = (char *)json_string_value(v);
        }
        qsort(names, nu, sizeof *names, str_cmp);
        for (size_t i = 0; i < nu && rc == 0; i++) {
            if (i && !strcmp(names[i], names[i - 1])) continue;
            if (strchr(names[i], '/')) {
                rc = err_fail(err, errlen, -EINVAL,
                              "%s: shard name '%s' must be a file in the model directory", path,
                              names[i]);
                break;
            }
            char sp[4096];
            snprintf(sp, sizeof sp, "%s/%s", dir, names[i]);
            rc = st_add_file(s, sp, err, errlen);
        }
        free(names);
        if (rc == 0) { /* every indexed tensor must exist in its shard */
            /* qsort's base must not be NULL, even for 0 items */
            if (s->n_tensors > 0)
                qsort(s->tensors, (size_t)s->n_tensors, sizeof *s->tensors, st_cmp);
            json_object_foreach(wm, key, v) {
                if (!st_set_find(s, key)) {
                    rc = err_fail(err, errlen, -EINVAL,
                                  "%s: tensor '%s' listed for shard '%s' is not in it", path, key,
                                  json_string_value(v));
                    break;
                }
            }
        }
        json_decref(root);
    } else {
        DIR *d = opendir(dir);
        if (!d)
            return err_fail(err, errlen, -errno, "%s: cannot open directory: %s", dir,
                            strerror(errno));
        struct dirent *de;
        int found = 0;
        while ((de = readdir(d)) && rc == 0) {
            size_t l = strlen(de->d_name);
            /* consolidated*.safetensors: the same weights in Mistral's own format (other tensor
             * names), which hub repositories ship beside the Hugging Face files */
            if (!strncmp(de->d_name, "consolidated", 12)) continue;
            if (l > 12 && !strcmp(de->d_name + l - 12, ".safetensors")) {
                snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
                rc = st_add_file(s, path, err, errlen);
                found++;
            }
        }
        closedir(d);
        if (rc == 0 && !found)
            rc = err_fail(err, errlen, -ENOENT,
                          "%s: no *.safetensors weights (and no model.safetensors.index.json; "
                          "consolidated*.safetensors, Mistral's own format, are not read)",
                          dir);
        if (rc == 0 && s->n_tensors > 0)
            qsort(s->tensors, (size_t)s->n_tensors, sizeof *s->tensors, st_cmp);
    }
    if (rc == 0)
        for (int i = 1; i < s->n_tensors; i++)
            if (!strcmp(s->tensors[i].name, s->tensors[i - 1].name)) {
                rc = err_fail(err, errlen, -EINVAL, "tensor '%s' appears twice (%s and %s)",
                              s->tensors[i].name, s->files[s->tensors[i - 1].file].path,
                              s->files[s->tensors[i].file].path);
                break;
            }
    if (rc) st_set_free(s);
    return rc;
}

void st_set_free(st_set *s) {
    for (int i = 0; i < s->n_files; i++) {
        munmap(s->files[i].map, s->files[i].size);
        free(s->files[i].path);
    }
    for (int i = 0; i < s->n_tensors; i++)
        free(s->tensors[i].name);
    free(s->files);
    free(s->tensors);
    memset(s, 0, sizeof *s);
}

const st_tensor *st_set_find(const st_set *s, const char *name) {
    st_tensor key = {.name = (char *)name};
    return s->n_tensors ? bsearch(&key, s->tensors, (size_t)s->n_tensors, sizeof key, st_cmp)
                        : NULL;
}

const char *st_set_file_of(const st_set *s, const st_tensor *t) {
    return s->files[t->file].path;
}

size_t st_set_bytes(const st_set *s) {
    size_t n = 0;
    for (int i = 0; i < s->n_files; i++)
        n += s->files[i].size;
    return n;
}

void st_set_prefault(const st_set *s, const char *what) {
    size_t total = st_set_bytes(s), done = 0, page = 4096;
    int tty = isatty(2);
    volatile unsigned char sink = 0;
    int last_pct = -1;
    for (int f = 0; f < s->n_files; f++) {
        const unsigned char *p = s->files[f].map;
        madvise(s->files[f].map, s->files[f].size, MADV_WILLNEED);
        for (size_t o = 0; o < s->files[f].size; o += page) {
            sink ^= p[o];
            done += page;
            int pct =
                (int)(100.0 * (double)(done > total ? total : done) / (double)(total ? total : 1));
            if (tty && pct != last_pct) {
                fprintf(stderr, "\rloading %s: %3d%% (%.0f MB)", what, pct, (double)total / 1e6);
                last_pct = pct;
            }
        }
    }
    if (tty) fprintf(stderr, "\n");
    (void)sink;
}
