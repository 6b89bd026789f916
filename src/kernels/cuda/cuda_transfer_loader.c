/*
 * cuda_transfer_loader — cuda_transfer_load() (cuda_transfer.h): the CUDA module's transfer
 * table for a process without a backend.  Plain C, no CUDA dependency.
 */
#include "kernels/cuda/cuda_module.h"
#include "kernels/cuda/cuda_transfer.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static const dcu_transfer_api *api;
static char why[1024];
static int tried;

static void *open_module(char *err, size_t errlen) {
    const char *env = getenv("DISAGG_CUDA_MODULE");
    if (env && *env) {
        void *h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (!h) snprintf(err, errlen, "the CUDA module %s cannot load: %s", env, dlerror());
        return h;
    }
    char exe[PATH_MAX], path[PATH_MAX + 64];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) *slash = 0;
        snprintf(path, sizeof path, "%s/%s", exe, DCU_MODULE_NAME);
        if (access(path, F_OK) == 0) {
            void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
            if (!h) snprintf(err, errlen, "the CUDA module %s cannot load: %s", path, dlerror());
            return h;
        }
    }
    void *h = dlopen(DCU_MODULE_NAME, RTLD_NOW | RTLD_LOCAL);
    if (!h)
        snprintf(err, errlen,
                 "the CUDA module %s is not beside this binary nor on the library path (%s; "
                 "set DISAGG_CUDA_MODULE to its path)",
                 DCU_MODULE_NAME, dlerror());
    return h;
}

const dcu_transfer_api *cuda_transfer_load(char *err, size_t errlen) {
    pthread_mutex_lock(&mu);
    if (!tried) {
        tried = 1;
        void *h = open_module(why, sizeof why);
        if (h) {
            dcu_transfer_api_fn fn = (dcu_transfer_api_fn)(uintptr_t)dlsym(h, DCU_TRANSFER_SYMBOL);
            const dcu_transfer_api *a = fn ? fn() : NULL;
            if (!a)
                snprintf(why, sizeof why, "the CUDA module has no %s (a module of another build?)",
                         DCU_TRANSFER_SYMBOL);
            else if (a->abi != DCU_TRANSFER_ABI)
                snprintf(why, sizeof why,
                         "the CUDA module's transfer table has ABI %d; this binary "
                         "needs %d (rebuild both together)",
                         a->abi, DCU_TRANSFER_ABI);
            else
                api = a; /* kept loaded for the life of the process */
        }
    }
    const dcu_transfer_api *a = api;
    if (!a && err) snprintf(err, errlen, "%s", why);
    pthread_mutex_unlock(&mu);
    return a;
}
