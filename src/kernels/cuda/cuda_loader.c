/*
 * cuda_loader — finds and dlopen()s the CUDA module (see cuda_module.h).  Plain C with no
 * CUDA dependency: the binary links this, never libcudart.
 */
#include "kernels/cuda/cuda_module.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef DISAGG_CUDA_BUILT
#define DISAGG_CUDA_BUILT 0
#endif

int cuda_module_built(void) {
    return DISAGG_CUDA_BUILT;
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static const dcu_api *api;
static char load_err[1024];
static int tried;

/* One sentence for a dlopen failure: which library is missing and what provides it. */
static void explain(char *out, size_t n, const char *path, const char *dl) {
    const char *lib = NULL;
    if (strstr(dl, "libcublasLt"))
        lib = "libcublasLt (CUDA's cuBLAS; e.g. apt install libcublas-13-0 or pip install "
              "nvidia-cublas, then add its lib folder to LD_LIBRARY_PATH)";
    else if (strstr(dl, "libcudart"))
        lib = "libcudart (the CUDA runtime of the CUDA major disagg was built with)";
    else if (strstr(dl, "libcuda.so"))
        lib = "libcuda.so.1 (the NVIDIA driver)";
    if (lib)
        snprintf(out, n, "the CUDA module %s cannot load: %s is missing (%s)", path, lib, dl);
    else
        snprintf(out, n, "the CUDA module %s cannot load: %s", path, dl);
}

static const dcu_api *try_path(const char *path, char *why, size_t whylen) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        explain(why, whylen, path, dlerror());
        return NULL;
    }
    dcu_api_fn fn = (dcu_api_fn)dlsym(h, "disagg_cuda_api_v1");
    if (!fn) {
        snprintf(why, whylen, "%s is not a disagg CUDA module (no disagg_cuda_api_v1)", path);
        dlclose(h);
        return NULL;
    }
    const dcu_api *a = fn();
    if (!a || a->abi != DCU_ABI_VERSION) {
        snprintf(why, whylen, "%s has ABI %d; this binary needs %d (rebuild both together)", path,
                 a ? a->abi : -1, DCU_ABI_VERSION);
        dlclose(h);
        return NULL;
    }
    return a; /* kept loaded for the life of the process */
}

const dcu_api *cuda_module_load(char *err, size_t errlen) {
    pthread_mutex_lock(&mu);
    if (!tried) {
        tried = 1;
        const char *env = getenv("DISAGG_CUDA_MODULE");
        char path[PATH_MAX + 64];
        if (env && *env) {
            api = try_path(env, load_err, sizeof load_err);
        } else {
            char exe[PATH_MAX];
            ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
            int found = 0;
            if (n > 0) {
                exe[n] = 0;
                char *slash = strrchr(exe, '/');
                if (slash) *slash = 0;
                snprintf(path, sizeof path, "%s/%s", exe, DCU_MODULE_NAME);
                if (access(path, F_OK) == 0) {
                    found = 1;
                    api = try_path(path, load_err, sizeof load_err);
                }
            }
            if (!found) {
                api = try_path(DCU_MODULE_NAME, load_err, sizeof load_err);
                if (!api && strstr(load_err, DCU_MODULE_NAME ": cannot open"))
                    snprintf(load_err, sizeof load_err,
                             "the CUDA module %s is not beside the disagg binary nor on the "
                             "library path (%s; set DISAGG_CUDA_MODULE to its path)",
                             DCU_MODULE_NAME,
                             DISAGG_CUDA_BUILT ? "it was built; was it copied with the binary?"
                                               : "this build has no CUDA: nvcc was not found "
                                                 "when it was configured");
            }
        }
    }
    const dcu_api *a = api;
    if (!a && err) snprintf(err, errlen, "%s", load_err);
    pthread_mutex_unlock(&mu);
    return a;
}

const dcu_api *cuda_open(int device, dcu_info *info, char *err, size_t errlen) {
    const dcu_api *a = cuda_module_load(err, errlen);
    if (!a) return NULL;
    dcu_info tmp;
    if (a->probe(device, info ? info : &tmp, err, errlen)) return NULL;
    return a;
}
