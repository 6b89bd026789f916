/* cuda_tp_loader — finds the TP table in the loaded CUDA module (see cuda_tp.h).  The module
 * is dlopen()ed RTLD_LOCAL by cuda_loader.c; dladdr() on its API table names the file, and
 * dlopen(RTLD_NOLOAD) on that name returns the same handle for dlsym(). */
#include "kernels/cuda/cuda_tp.h"

#include "kernels/cuda/cuda_module.h"

#include <dlfcn.h>
#include <stdio.h>

const dtp_api *cuda_tp_load(char *err, size_t errlen) {
    const dcu_api *a = cuda_module_load(err, errlen);
    if (!a) return NULL;
    Dl_info info;
    if (!dladdr((const void *)a, &info) || !info.dli_fname) {
        snprintf(err, errlen, "cannot tell which file the CUDA module was loaded from");
        return NULL;
    }
    void *h = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
    dtp_api_fn fn = h ? (dtp_api_fn)dlsym(h, "disagg_cuda_tp_api_v1") : NULL;
    if (h) dlclose(h); /* drops the reference NOLOAD took; the module stays loaded */
    const dtp_api *t = fn ? fn() : NULL;
    if (!t || t->abi != DTP_ABI_VERSION) {
        snprintf(err, errlen,
                 "the CUDA module %s has %s; this binary needs TP ABI %d (rebuild both together)",
                 info.dli_fname, t ? "another TP ABI" : "no tensor-parallel table",
                 DTP_ABI_VERSION);
        return NULL;
    }
    return t;
}
