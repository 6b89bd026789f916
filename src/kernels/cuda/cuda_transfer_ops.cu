/* cuda_transfer_ops — the transfer engine's device-memory ops on CUDA (cuda_transfer.h). */
#include "kernels/cuda/cuda_transfer.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT  extern "C" __attribute__((visibility("default")))
#define MAX_DEV 64

namespace {

struct dev_ctx {
    int device;
};
dev_ctx g_dev[MAX_DEV];

/* One copy of a batch (copy_device_batch), as the gather/scatter kernel reads it. */
struct copy_desc {
    const char *src;
    char *dst;
    unsigned long long len;
};

struct xstream {
    cudaStream_t s;
    int device;
    copy_desc *d_desc; /* device copy of the last batch's descriptors (grown as needed) */
    size_t desc_cap;
    copy_desc *h_desc; /* host array they are built in */
};

/* Own exports (CUDA refuses to open a handle in the process that made it): a handle
 * found here maps to the exporting allocation itself. */
struct own_export {
    cudaIpcMemHandle_t h;
    void *base;
};
pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
own_export g_own[256];
int g_n_own;
int g_open_maps; /* cudaIpcOpenMemHandle mappings not yet closed */
uint64_t g_d2d;  /* copy_device calls */

int fail(const char *what, cudaError_t e) {
    fprintf(stderr, "[cuda transfer] %s: %s (%s)\n", what, cudaGetErrorString(e),
            cudaGetErrorName(e));
    cudaGetLastError(); /* clear a non-sticky error */
    return e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO;
}

int set_dev(int device) {
    cudaError_t e = cudaSetDevice(device);
    return e == cudaSuccess ? 0 : fail("cudaSetDevice", e);
}

/* Driver entry points through the runtime (the module links the static runtime, not
 * libcuda): looked up once. */
typedef CUresult (*get_range_fn)(CUdeviceptr *, size_t *, CUdeviceptr);
typedef CUresult (*get_handle_fn)(void *, CUdeviceptr, size_t, CUmemRangeHandleType,
                                  unsigned long long);
get_range_fn g_get_range;
get_handle_fn g_get_handle;
pthread_once_t g_once = PTHREAD_ONCE_INIT;

void lookup_driver(void) {
    void *p = NULL;
    cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
        g_get_range = (get_range_fn)p;
    p = NULL;
    if (cudaGetDriverEntryPointByVersion("cuMemGetHandleForAddressRange", &p, 12000,
                                         cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
        g_get_handle = (get_handle_fn)p;
#else
    if (cudaGetDriverEntryPoint("cuMemGetAddressRange", &p, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
        g_get_range = (get_range_fn)p;
    p = NULL;
    if (cudaGetDriverEntryPoint("cuMemGetHandleForAddressRange", &p, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
        g_get_handle = (get_handle_fn)p;
#endif
    cudaGetLastError();
}

int op_stream_create(void *ctx, int device, void **out) {
    (void)ctx;
    if (set_dev(device)) return -EIO;
    xstream *x = (xstream *)calloc(1, sizeof *x);
    if (!x) return -ENOMEM;
    x->device = device;
    cudaError_t e = cudaStreamCreateWithFlags(&x->s, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(x);
        return fail("cudaStreamCreate", e);
    }
    *out = x;
    return 0;
}

void op_stream_destroy(void *ctx, void *stream) {
    (void)ctx;
    xstream *x = (xstream *)stream;
    if (!x) return;
    cudaSetDevice(x->device);
    cudaStreamSynchronize(x->s);
    if (x->d_desc) cudaFree(x->d_desc);
    cudaStreamDestroy(x->s);
    free(x->h_desc);
    free(x);
}

int copy_async(xstream *x, void *dst, const void *src, size_t len, cudaMemcpyKind kind,
               const char *what) {
    if (set_dev(x->device)) return -EIO;
    cudaError_t e = cudaMemcpyAsync(dst, src, len, kind, x->s);
    return e == cudaSuccess ? 0 : fail(what, e);
}

int op_copy_to_host(void *ctx, void *stream, void *host, const void *dev, size_t len) {
    (void)ctx;
    return copy_async((xstream *)stream, host, dev, len, cudaMemcpyDeviceToHost,
                      "device-to-host copy");
}

int op_copy_from_host(void *ctx, void *stream, void *dev, const void *host, size_t len) {
    (void)ctx;
    return copy_async((xstream *)stream, dev, host, len, cudaMemcpyHostToDevice,
                      "host-to-device copy");
}

int op_copy_device(void *ctx, void *stream, void *dst, const void *src, size_t len) {
    (void)ctx;
    __atomic_add_fetch(&g_d2d, 1, __ATOMIC_RELAXED);
    return copy_async((xstream *)stream, dst, src, len, cudaMemcpyDeviceToDevice,
                      "device-to-device copy");
}

/* The gather/scatter copy: blockIdx.y walks the descriptors, blockIdx.x and the threads a
 * descriptor's bytes -- 16 bytes a load where both ends are 16-aligned (the KV blocks are),
 * else byte by byte.  Every byte is copied exactly once; copies must not overlap. */
__global__ void gather_scatter_copy(const copy_desc *__restrict__ d, int n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (int i = blockIdx.y; i < n; i += gridDim.y) {
        const char *__restrict__ src = d[i].src;
        char *__restrict__ dst = d[i].dst;
        const size_t len = d[i].len;
        size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
        size_t done = 0;
        if ((((uintptr_t)src | (uintptr_t)dst) & 15) == 0) {
            const size_t n16 = len / 16;
            const uint4 *__restrict__ s16 = (const uint4 *)src;
            uint4 *__restrict__ d16 = (uint4 *)dst;
            size_t j = k;
            for (; j + 3 * stride < n16; j += 4 * stride) { /* four loads in flight */
                uint4 a = s16[j], b = s16[j + stride], c = s16[j + 2 * stride],
                      e = s16[j + 3 * stride];
                d16[j] = a;
                d16[j + stride] = b;
                d16[j + 2 * stride] = c;
                d16[j + 3 * stride] = e;
            }
            for (; j < n16; j += stride)
                d16[j] = s16[j];
            done = n16 * 16;
        }
        for (size_t j = done + k; j < len; j += stride)
            dst[j] = src[j];
    }
}

/* How a batch is copied: DISAGG_CUDA_BATCH_COPY=kernel (default: one launch of the kernel
 * above), memcpy_batch (cudaMemcpyBatchAsync, CUDA 12.8+), each (one cudaMemcpyAsync per
 * copy, as before).  Read per call, so a benchmark can compare them in one process. */
enum { BATCH_KERNEL, BATCH_MEMCPY, BATCH_EACH };
int batch_mode(void) {
    const char *m = getenv("DISAGG_CUDA_BATCH_COPY");
    if (!m || !*m || !strcmp(m, "kernel")) return BATCH_KERNEL;
    if (!strcmp(m, "memcpy_batch")) return BATCH_MEMCPY;
    if (!strcmp(m, "each")) return BATCH_EACH;
    static int warned;
    if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
        fprintf(stderr,
                "[cuda transfer] DISAGG_CUDA_BATCH_COPY=%s is not accepted (kernel, "
                "memcpy_batch, each); using kernel\n",
                m);
    return BATCH_KERNEL;
}

int op_copy_device_batch(void *ctx, void *stream, void *const *dst, const void *const *src,
                         const size_t *len, size_t n) {
    (void)ctx;
    xstream *x = (xstream *)stream;
    if (n == 0) return 0;
    if (set_dev(x->device)) return -EIO;
    int mode = batch_mode();
    if (n == 1 || mode == BATCH_EACH) {
        for (size_t i = 0; i < n; i++) {
            int rc = op_copy_device(ctx, stream, dst[i], src[i], len[i]);
            if (rc) return rc;
        }
        return 0;
    }
    __atomic_add_fetch(&g_d2d, 1, __ATOMIC_RELAXED); /* one device operation */
    cudaError_t e;
    if (mode == BATCH_MEMCPY) {
#if CUDART_VERSION >= 12080
        cudaMemcpyAttributes attr;
        memset(&attr, 0, sizeof attr);
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.srcLocHint.type = cudaMemLocationTypeDevice;
        attr.srcLocHint.id = x->device;
        attr.dstLocHint.type = cudaMemLocationTypeDevice;
        attr.dstLocHint.id = x->device;
        size_t idx = 0;
        e = cudaMemcpyBatchAsync((void *const *)dst, (const void *const *)src, len, n, &attr, &idx,
                                 1, x->s);
        return e == cudaSuccess ? 0 : fail("cudaMemcpyBatchAsync", e);
#else
        return fail("cudaMemcpyBatchAsync (needs CUDA 12.8)", cudaErrorNotSupported);
#endif
    }
    if (n > x->desc_cap) {
        size_t cap = x->desc_cap ? x->desc_cap : 256;
        while (cap < n)
            cap *= 2;
        copy_desc *h = (copy_desc *)realloc(x->h_desc, cap * sizeof *h);
        if (!h) return -ENOMEM;
        x->h_desc = h;
        /* the previous batch may still read the old array */
        if ((e = cudaStreamSynchronize(x->s)) != cudaSuccess) return fail("batch copy", e);
        if (x->d_desc) cudaFree(x->d_desc);
        x->d_desc = NULL;
        x->desc_cap = 0;
        if ((e = cudaMalloc((void **)&x->d_desc, cap * sizeof *x->d_desc)) != cudaSuccess)
            return fail("cudaMalloc (batch copy descriptors)", e);
        x->desc_cap = cap;
    }
    size_t max_len = 0;
    for (size_t i = 0; i < n; i++) {
        x->h_desc[i].src = (const char *)src[i];
        x->h_desc[i].dst = (char *)dst[i];
        x->h_desc[i].len = len[i];
        if (len[i] > max_len) max_len = len[i];
    }
    /* pageable source: the call returns once the bytes are staged, so h_desc may be
     * rebuilt at once; stream order keeps the kernel of the previous batch first */
    e = cudaMemcpyAsync(x->d_desc, x->h_desc, n * sizeof *x->h_desc, cudaMemcpyHostToDevice,
                        x->s);
    if (e != cudaSuccess) return fail("batch copy descriptors", e);
    const int threads = 256;
    size_t per_block = (size_t)threads * 16 * 8; /* eight 16-byte loads per thread */
    size_t gx = (max_len + per_block - 1) / per_block;
    dim3 grid((unsigned)(gx < 1 ? 1 : gx > 1024 ? 1024 : gx), (unsigned)(n < 65535 ? n : 65535));
    gather_scatter_copy<<<grid, threads, 0, x->s>>>(x->d_desc, (int)n);
    e = cudaGetLastError();
    return e == cudaSuccess ? 0 : fail("batch copy kernel", e);
}

int op_sync(void *ctx, void *stream) {
    (void)ctx;
    xstream *x = (xstream *)stream;
    cudaError_t e = cudaStreamSynchronize(x->s);
    return e == cudaSuccess ? 0 : fail("cudaStreamSynchronize", e);
}

void *op_alloc_pinned(void *ctx, size_t len) {
    dev_ctx *d = (dev_ctx *)ctx;
    if (set_dev(d->device)) return NULL;
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, len, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        fail("cudaHostAlloc", e);
        return NULL;
    }
    return p;
}

void op_free_pinned(void *ctx, void *p) {
    (void)ctx;
    if (p) cudaFreeHost(p);
}

/* dev must be device memory (of any device: the attributes say which). */
int check_device_ptr(const void *dev, int *device) {
    cudaPointerAttributes a;
    cudaError_t e = cudaPointerGetAttributes(&a, dev);
    if (e != cudaSuccess) return fail("cudaPointerGetAttributes", e);
    if (a.type != cudaMemoryTypeDevice) {
        fprintf(stderr,
                "[cuda transfer] %p is not device memory (cudaPointerGetAttributes type %d): "
                "only cudaMalloc'ed memory can be exported\n",
                dev, (int)a.type);
        return -EINVAL;
    }
    *device = a.device;
    return 0;
}

int alloc_base(const void *dev, size_t len, char **base) {
    pthread_once(&g_once, lookup_driver);
    if (!g_get_range) {
        fprintf(stderr, "[cuda transfer] the driver has no cuMemGetAddressRange\n");
        return -ENOTSUP;
    }
    CUdeviceptr b = 0;
    size_t sz = 0;
    CUresult r = g_get_range(&b, &sz, (CUdeviceptr)(uintptr_t)dev);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "[cuda transfer] cuMemGetAddressRange(%p) failed (%d)\n", dev, (int)r);
        return -EINVAL;
    }
    if ((uintptr_t)dev + len > (uintptr_t)b + sz) {
        fprintf(stderr,
                "[cuda transfer] [%p, +%zu) spans more than one allocation (its allocation is "
                "[0x%llx, +%zu))\n",
                dev, len, (unsigned long long)b, sz);
        return -EINVAL;
    }
    *base = (char *)(uintptr_t)b;
    return 0;
}

int op_ipc_export(void *ctx, const void *dev, size_t len, void *handle, size_t *handle_len,
                  uint64_t *offset) {
    (void)ctx;
    int device, rc;
    char *base;
    if ((rc = check_device_ptr(dev, &device)) != 0) return rc;
    if (set_dev(device)) return -EIO;
    if ((rc = alloc_base(dev, len, &base)) != 0) return rc;
    cudaIpcMemHandle_t h;
    cudaError_t e = cudaIpcGetMemHandle(&h, base);
    if (e != cudaSuccess) return fail("cudaIpcGetMemHandle", e);
    static_assert(sizeof h <= TRANSFER_IPC_HANDLE_MAX, "IPC handle too large");
    memcpy(handle, &h, sizeof h);
    *handle_len = sizeof h;
    *offset = (uint64_t)((const char *)dev - base);
    pthread_mutex_lock(&g_mu);
    int known = 0;
    for (int i = 0; i < g_n_own; i++)
        if (g_own[i].base == base) {
            g_own[i].h = h;
            known = 1;
        }
    if (!known && g_n_own < (int)(sizeof g_own / sizeof g_own[0])) {
        g_own[g_n_own].h = h;
        g_own[g_n_own].base = base;
        g_n_own++;
    }
    pthread_mutex_unlock(&g_mu);
    return 0;
}

void *own_base(const void *handle) {
    void *b = NULL;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < g_n_own && !b; i++)
        if (!memcmp(&g_own[i].h, handle, sizeof g_own[i].h)) b = g_own[i].base;
    pthread_mutex_unlock(&g_mu);
    return b;
}

int op_ipc_open(void *ctx, int device, const void *handle, size_t handle_len, void **base) {
    (void)ctx;
    if (handle_len != sizeof(cudaIpcMemHandle_t)) {
        fprintf(stderr, "[cuda transfer] an IPC handle of %zu bytes (CUDA's are %zu)\n", handle_len,
                sizeof(cudaIpcMemHandle_t));
        return -EINVAL;
    }
    if (void *own = own_base(handle)) { /* our own export */
        *base = own;
        return 0;
    }
    if (set_dev(device)) return -EIO;
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) return fail("cudaIpcOpenMemHandle", e);
    __atomic_add_fetch(&g_open_maps, 1, __ATOMIC_RELAXED);
    *base = p;
    return 0;
}

void op_ipc_close(void *ctx, void *base) {
    (void)ctx;
    if (!base) return;
    pthread_mutex_lock(&g_mu);
    int own = 0;
    for (int i = 0; i < g_n_own; i++)
        own |= g_own[i].base == base;
    pthread_mutex_unlock(&g_mu);
    if (own) return;
    cudaError_t e = cudaIpcCloseMemHandle(base);
    if (e != cudaSuccess)
        fail("cudaIpcCloseMemHandle", e);
    else
        __atomic_sub_fetch(&g_open_maps, 1, __ATOMIC_RELAXED);
}

int op_get_dmabuf(void *ctx, const void *dev, size_t len, int *fd, uint64_t *offset) {
    (void)ctx;
    pthread_once(&g_once, lookup_driver);
    if (!g_get_handle) {
        fprintf(stderr, "[cuda transfer] the driver has no cuMemGetHandleForAddressRange "
                        "(DMA-BUF needs CUDA 11.7+ and an open kernel module)\n");
        return -ENOTSUP;
    }
    /* The range must be page aligned: export the aligned cover, say where dev is in it. */
    const uintptr_t page = 4096;
    uintptr_t a = (uintptr_t)dev & ~(page - 1);
    uintptr_t end = ((uintptr_t)dev + len + page - 1) & ~(page - 1);
    int out = -1;
    CUresult r = g_get_handle(&out, (CUdeviceptr)a, (size_t)(end - a),
                              CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr,
                "[cuda transfer] cuMemGetHandleForAddressRange(%p, %zu bytes) failed (CUresult "
                "%d)\n",
                (void *)a, (size_t)(end - a), (int)r);
        return r == CUDA_ERROR_NOT_SUPPORTED ? -ENOTSUP : -EIO;
    }
    *fd = out;
    *offset = (uint64_t)((uintptr_t)dev - a);
    return 0;
}

int api_device_ops(int device, transfer_device_ops *out, char *err, size_t errlen) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(err, errlen, "no usable CUDA device: %s", cudaGetErrorString(e));
        cudaGetLastError();
        return -ENODEV;
    }
    if (device < 0 || device >= n || device >= MAX_DEV) {
        snprintf(err, errlen, "device cuda:%d out of range (%d visible)", device, n);
        return -EINVAL;
    }
    g_dev[device].device = device;
    memset(out, 0, sizeof *out);
    out->ctx = &g_dev[device];
    out->stream_create = op_stream_create;
    out->stream_destroy = op_stream_destroy;
    out->copy_to_host = op_copy_to_host;
    out->copy_from_host = op_copy_from_host;
    out->sync = op_sync;
    out->alloc_pinned = op_alloc_pinned;
    out->free_pinned = op_free_pinned;
    out->get_dmabuf = op_get_dmabuf;
    out->ipc_export = op_ipc_export;
    out->ipc_open = op_ipc_open;
    out->ipc_close = op_ipc_close;
    out->copy_device = op_copy_device;
    out->copy_device_batch = op_copy_device_batch;
    return 0;
}

void *api_alloc(int device, size_t bytes) {
    if (set_dev(device)) return NULL;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        fail("cudaMalloc", e);
        return NULL;
    }
    if ((e = cudaMemset(p, 0, bytes)) != cudaSuccess ||
        (e = cudaDeviceSynchronize()) != cudaSuccess) {
        fail("cudaMemset", e);
        cudaFree(p);
        return NULL;
    }
    return p;
}

void api_free(int device, void *p) {
    if (!p || set_dev(device)) return;
    cudaFree(p);
}

int api_mem_info(int device, size_t *free_b, size_t *total_b) {
    if (set_dev(device)) return -EIO;
    cudaError_t e = cudaMemGetInfo(free_b, total_b);
    return e == cudaSuccess ? 0 : fail("cudaMemGetInfo", e);
}

int api_open_mappings(void) {
    return __atomic_load_n(&g_open_maps, __ATOMIC_RELAXED);
}

uint64_t api_d2d_copies(void) {
    return __atomic_load_n(&g_d2d, __ATOMIC_RELAXED);
}

int time_memcpy(int device, void *dst, const void *src, size_t len, cudaMemcpyKind kind, int reps,
                double *seconds) {
    if (set_dev(device)) return -EIO;
    if (reps < 1) reps = 1;
    cudaStream_t s;
    cudaEvent_t a, b;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) return fail("cudaStreamCreate", e);
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    e = cudaMemcpyAsync(dst, src, len, kind, s); /* warm-up */
    if (e == cudaSuccess) e = cudaEventRecord(a, s);
    for (int i = 0; i < reps && e == cudaSuccess; i++)
        e = cudaMemcpyAsync(dst, src, len, kind, s);
    if (e == cudaSuccess) e = cudaEventRecord(b, s);
    if (e == cudaSuccess) e = cudaEventSynchronize(b);
    float ms = 0;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, a, b);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaStreamDestroy(s);
    if (e != cudaSuccess) return fail("timed copy", e);
    *seconds = (double)ms / 1e3 / reps;
    return 0;
}

int api_time_copy(int device, void *dst, const void *src, size_t len, int reps, double *seconds) {
    return time_memcpy(device, dst, src, len, cudaMemcpyDeviceToDevice, reps, seconds);
}

int api_time_pcie(int device, void *host, void *dev, size_t len, int to_host, int reps,
                  double *seconds) {
    return to_host ? time_memcpy(device, host, dev, len, cudaMemcpyDeviceToHost, reps, seconds)
                   : time_memcpy(device, dev, host, len, cudaMemcpyHostToDevice, reps, seconds);
}

const dcu_transfer_api g_api = {
    DCU_TRANSFER_ABI,  api_device_ops, api_alloc,     api_free,      api_mem_info,
    api_open_mappings, api_d2d_copies, api_time_copy, api_time_pcie,
};

} // namespace

EXPORT const dcu_transfer_api *disagg_cuda_transfer_v1(void) {
    return &g_api;
}
