/*
 * cuda_loader — the CUDA module's tables for host C code beside the backend's:
 * cuda_transfer_load() (cuda_transfer.h) and cuda_tp_load() (cuda_tp.h).  Both find their
 * getter with backend_module_entry (kernels/backend.c: the module opened as backend_open
 * opens it, the same file, the same handle, kept loaded) and check the table's ABI against
 * the one this binary was built with.  Plain C, no CUDA dependency.
 */
#include "kernels/backend_impl.h"
#include "kernels/cuda/cuda_tp.h"
#include "kernels/cuda/cuda_transfer.h"

#include <stdint.h>
#include <stdio.h>

/* 1 when the module's table (its abi field; NULL: the getter gave none) is the ABI this
 * binary needs, else 0 with err naming both. */
static int abi_ok(const char *what, const int *abi, int want, char *err, size_t errlen) {
    if (abi && *abi == want) return 1;
    if (abi)
        snprintf(err, errlen,
                 "the CUDA module's %s has ABI %d; this binary needs %d (rebuild both together)",
                 what, *abi, want);
    else
        snprintf(err, errlen, "the CUDA module %s gave no %s (rebuild both together)",
                 BACKEND_MODULE_NAME, what);
    return 0;
}

const dcu_transfer_api *cuda_transfer_load(char *err, size_t errlen) {
    static const char what[] = "transfer table";
    dcu_transfer_api_fn fn = (dcu_transfer_api_fn)(uintptr_t)backend_module_entry(
        DCU_TRANSFER_SYMBOL, what, err, errlen);
    const dcu_transfer_api *t = fn ? fn() : NULL;
    return fn && abi_ok(what, t ? &t->abi : NULL, DCU_TRANSFER_ABI, err, errlen) ? t : NULL;
}

const dtp_api *cuda_tp_load(char *err, size_t errlen) {
    static const char what[] = "tensor-parallel table";
    dtp_api_fn fn = (dtp_api_fn)(uintptr_t)backend_module_entry(DTP_SYMBOL, what, err, errlen);
    const dtp_api *t = fn ? fn() : NULL;
    return fn && abi_ok(what, t ? &t->abi : NULL, DTP_ABI_VERSION, err, errlen) ? t : NULL;
}
