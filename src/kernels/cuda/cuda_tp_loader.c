/* cuda_tp_loader — finds the TP table in the CUDA module (see cuda_tp.h).  The module is
 * opened as the backend opens it (backend_module_dlopen: the same file, the same handle) and
 * stays loaded for the life of the process. */
#include "kernels/cuda/cuda_tp.h"

#include "kernels/backend_impl.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>

const dtp_api *cuda_tp_load(char *err, size_t errlen) {
    char why[PATH_MAX + 600];
    void *h = backend_module_dlopen(why, sizeof why);
    if (!h) {
        snprintf(err, errlen, "the CUDA module: %s (set DISAGG_CUDA_MODULE to its path)", why);
        return NULL;
    }
    dtp_api_fn fn = (dtp_api_fn)(uintptr_t)dlsym(h, "disagg_cuda_tp_api_v1");
    const dtp_api *t = fn ? fn() : NULL;
    if (!t || t->abi != DTP_ABI_VERSION) {
        snprintf(err, errlen,
                 "the CUDA module %s has %s; this binary needs TP ABI %d (rebuild both together)",
                 BACKEND_MODULE_NAME, t ? "another TP ABI" : "no tensor-parallel table",
                 DTP_ABI_VERSION);
        return NULL;
    }
    return t;
}
