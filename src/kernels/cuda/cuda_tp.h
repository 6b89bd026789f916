/*
 * cuda_tp — the tensor-parallel communicator of the CUDA module (docs/parallel.md):
 * one process per GPU, an NCCL communicator over the TP group, in-place all-reduce of bf16
 * or f32 on a CUDA stream (the backend's, for the sharded forward's two all-reduces per
 * layer).  Built into libdisagg_cuda.so from cuda_tp.cu (a second exported symbol,
 * disagg_cuda_tp_api_v1, beside disagg_cuda_api_v1); this header is its C ABI, with no CUDA
 * include, for host C code.
 *
 * NCCL is the CUDA toolkit's (CMake finds nccl.h and libnccl; the header gives the types
 * and prototypes).  The module does not link libnccl: it dlopen()s it on first use —
 * $DISAGG_NCCL_LIB if set, else libnccl.so.2 on the loader's path, else the library CMake
 * found — so libdisagg_cuda.so loads and serves TP=1 on a machine without NCCL, and the GPU
 * bundle does not carry NCCL's 200 MB.  NCCL_NVLS_ENABLE=0 is set (overriding any other
 * value, with a warning) before any communicator is made: the device machines forbid NVLink
 * multicast (.library/device/KINDS.md).
 *
 * Unique id exchange: rank 0 calls unique_id() and publishes the 128 bytes; the others wait
 * for them (kernels/tp_rendezvous.h does it through a file); then every rank calls
 * comm_init with the same id, its rank and its device.  comm_init returns once all n_ranks
 * joined (NCCL's own barrier) or fails; NCCL's init has no deadline of its own, so callers
 * give the rendezvous one and kill a group whose init does not return.
 */
#ifndef DISAGG_KERNELS_CUDA_TP_H
#define DISAGG_KERNELS_CUDA_TP_H

#include <stddef.h>

#define DTP_ABI_VERSION 1
#define DTP_ID_BYTES    128 /* sizeof(ncclUniqueId) */

/* The table's getter (a dtp_api_fn) the module exports. */
#define DTP_SYMBOL "disagg_cuda_tp_api_v1"

typedef struct dtp_comm dtp_comm; /* one rank's communicator + its own stream */

typedef struct dtp_api {
    int abi;               /* DTP_ABI_VERSION */
    int built_nccl;        /* NCCL_VERSION_CODE of the header built against; 0: built without */
    const char *nccl_path; /* the libnccl CMake found ("" when none) */
    /* dlopen()s libnccl (once); *version = ncclGetVersion().  No GPU needed. */
    int (*load)(int *version, char *err, size_t errlen);
    /* A fresh ncclUniqueId into id (DTP_ID_BYTES).  No GPU needed. */
    int (*unique_id)(void *id, char *err, size_t errlen);
    /* Rank `rank` of n_ranks on CUDA device `device` (sets it current for the calling
     * thread), joining the group of id.  NULL on failure, with the reason in err. */
    dtp_comm *(*comm_init)(int device, int n_ranks, int rank, const void *id, char *err,
                           size_t errlen);
    void (*comm_free)(dtp_comm *c); /* NULL is fine */
    /* In place: buf (count elements of dtype, device memory) = the sum over the ranks.
     * dtype is DCU_F32 (0) or DCU_BF16 (2) of cuda_module.h.  Enqueued on stream (a
     * cudaStream_t; NULL: the communicator's own stream); returns once enqueued. */
    int (*all_reduce)(dtp_comm *c, void *buf, size_t count, int dtype, void *stream, char *err,
                      size_t errlen);
    /* Waits for the communicator's own stream; reports NCCL's asynchronous errors. */
    int (*sync)(dtp_comm *c, char *err, size_t errlen);
} dtp_api;

typedef const dtp_api *(*dtp_api_fn)(void);

/* Host side (cuda_loader.c): loads the CUDA module (backend_module_entry) and returns its TP
 * table; NULL with err saying why (no module, a module without TP or of another TP ABI:
 * rebuild). */
const dtp_api *cuda_tp_load(char *err, size_t errlen);

#endif
