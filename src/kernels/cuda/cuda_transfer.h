/*
 * cuda_transfer — what the CUDA module (libdisagg_cuda.so) gives the transfer engine: the
 * device-memory ops table of include/disagg/transfer.h (transfer_device_ops) for one GPU,
 * plus the few device-memory helpers the GPU transfer tests and `disagg bench transfer
 * --location cuda:N` need.  The transfer layer never includes this (it does not know CUDA);
 * the layer that owns the GPU looks the symbol up in the loaded module (kernels/backend.h
 * backend_module_symbol for the engine's KV region; cuda_transfer_load below for a process
 * with no backend) and installs the table with transfer_engine_set_device_ops().
 *
 * The ops (cuda_transfer_ops.cu): streams are non-blocking CUDA streams on the device
 * (every call first makes the device current on the calling thread); copies are
 * cudaMemcpyAsync; pinned memory cudaHostAlloc (portable); ipc_export checks the pointer's
 * attributes (device memory of this device), finds its allocation's base
 * (cuMemGetAddressRange) and gives the allocation's cudaIpcMemHandle (64 bytes) and the
 * offset; ipc_open maps a peer's handle once (cudaIpcOpenMemHandle, lazy peer access) —
 * a handle this process exported itself resolves to its own allocation (CUDA refuses to
 * open it in the exporting process); ipc_close unmaps; get_dmabuf wraps
 * cuMemGetHandleForAddressRange (DMA-BUF fd of a page-aligned range).
 */
#ifndef DISAGG_KERNELS_CUDA_TRANSFER_H
#define DISAGG_KERNELS_CUDA_TRANSFER_H

#include "disagg/transfer.h"

#include <stddef.h>
#include <stdint.h>

#define DCU_TRANSFER_ABI    1
#define DCU_TRANSFER_SYMBOL "disagg_cuda_transfer_v1"

typedef struct dcu_transfer_api {
    int abi; /* DCU_TRANSFER_ABI */
    /* The transfer engine's device-memory ops for GPU `device` (all of them, the ipc four
     * and get_dmabuf included).  0, or -errno with err saying why (no driver, bad ordinal). */
    int (*device_ops)(int device, transfer_device_ops *out, char *err, size_t errlen);
    /* Device memory for tests and benchmarks: cudaMalloc'ed (zeroed), NULL when out. */
    void *(*alloc)(int device, size_t bytes);
    void (*free)(int device, void *p);
    /* cudaMemGetInfo of the device. */
    int (*mem_info)(int device, size_t *free_b, size_t *total_b);
    /* Peer mappings this process holds now (ipc_open not yet ipc_close'd). */
    int (*open_mappings)(void);
    /* copy_device calls so far (how many copies a batch became). */
    uint64_t (*d2d_copies)(void);
    /* One device-to-device copy of len bytes dst <- src timed with events on a fresh stream
     * (the copy ceiling), reps times after one warm-up; *seconds the mean per copy. */
    int (*time_copy)(int device, void *dst, const void *src, size_t len, int reps, double *seconds);
    /* The same for host <-> device with pinned host memory (to_host: 1 = D2H). */
    int (*time_pcie)(int device, void *host_pinned, void *dev, size_t len, int to_host, int reps,
                     double *seconds);
} dcu_transfer_api;

typedef const dcu_transfer_api *(*dcu_transfer_api_fn)(void);

/* For a process that has no backend open (the GPU tests, `disagg bench transfer`): loads
 * the module as backend_open does ($DISAGG_CUDA_MODULE, else beside the executable, else
 * the loader's path) and returns its table, or NULL with err saying why (no module, no
 * table, another ABI).  (cuda_loader.c; plain C, no CUDA dependency.) */
const dcu_transfer_api *cuda_transfer_load(char *err, size_t errlen);

#endif
