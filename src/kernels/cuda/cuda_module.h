/*
 * cuda_module — the shared types of the CUDA kernel module (libdisagg_cuda.so, built from
 * the .cu files of src/kernels/cuda when nvcc is found).  The `disagg` binary never links
 * CUDA: kernels/backend.c dlopen()s the module for `--device cuda` and calls its one entry
 * point, disagg_backend_module_open (kernels/backend_impl.h), which gives the
 * kernels/backend.h table (cuda_backend.cu; the module's files: cuda_common.cuh).  Every function of the module returns 0 or a
 * negative errno value and, where it takes err/errlen, writes one sentence saying what
 * failed and what to do.
 *
 * Shapes (all row-major):
 *   activations x (T, n) f32; GEMM inputs bf16 (T, K); weights w (N, K) bf16 in HBM;
 *   KV region (n_blocks, n_layers, 2 [K, V], block_size, kv_dim) of kv_dtype — exactly
 *   the CPU engine's kv_store layout (model/decoder.h), so P/D and the layout fingerprint
 *   agree given the same dtype.
 */
#ifndef DISAGG_KERNELS_CUDA_MODULE_H
#define DISAGG_KERNELS_CUDA_MODULE_H

#include <stddef.h>
#include <stdint.h>

/* element types; numbering equals cpu_dtype (CPU_F32 0, CPU_F16 1, CPU_BF16 2) */
typedef enum dcu_dtype { DCU_F32 = 0, DCU_F16 = 1, DCU_BF16 = 2, DCU_F8E4M3 = 3 } dcu_dtype;

typedef struct dcu_ctx dcu_ctx; /* one device, one stream, one cuBLASLt handle */

typedef struct dcu_info {
    int device;             /* ordinal used */
    int n_devices;          /* visible devices (CUDA_VISIBLE_DEVICES applies) */
    char name[256];         /* e.g. "NVIDIA H200" */
    int cc_major, cc_minor; /* compute capability */
    int n_sm;               /* multiprocessors */
    size_t total_mem;       /* bytes of device memory */
    size_t free_mem;        /* bytes free now */
    int driver_version;     /* cudaDriverGetVersion: CUDA version the driver supports */
    int runtime_version;    /* CUDART_VERSION the module was built with */
} dcu_info;

typedef struct dcu_kv {
    void *base; /* device pointer: (n_blocks, n_layers, 2, block_size, kv_dim) */
    int dtype;  /* DCU_BF16, DCU_F32 or DCU_F8E4M3 */
    int n_blocks, block_size, n_layers, kv_dim;
    float k_scale, v_scale; /* DCU_F8E4M3: the call's layer's scales (element = e4m3 * scale) */
} dcu_kv;

#endif
