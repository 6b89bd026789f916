/*
 * cuda_tp — the TP communicator (see cuda_tp.h): NCCL, dlopen()ed on first use, one
 * communicator per rank with its own non-blocking stream, in-place sum all-reduce of f32 or
 * bf16 on the caller's stream.  nccl.h gives the prototypes (decltype of each function), so
 * the types cannot drift from the library's; nothing here links libnccl.
 */
#include "kernels/cuda/cuda_module.h"
#include "kernels/cuda/cuda_tp.h"

#include <cuda_runtime.h>

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if DISAGG_HAVE_NCCL
#include <nccl.h>
#endif

#ifndef DISAGG_NCCL_PATH
#define DISAGG_NCCL_PATH ""
#endif

static void tp_seterr(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

#if DISAGG_HAVE_NCCL
static_assert(sizeof(ncclUniqueId) == DTP_ID_BYTES, "ncclUniqueId is not 128 bytes");

/* ---- libnccl, resolved once ----------------------------------------------------------- */

typedef struct nccl_fns {
    decltype(&ncclGetVersion) get_version;
    decltype(&ncclGetUniqueId) get_unique_id;
    decltype(&ncclCommInitRank) comm_init_rank;
    decltype(&ncclCommDestroy) comm_destroy;
    decltype(&ncclCommAbort) comm_abort;
    decltype(&ncclCommGetAsyncError) comm_get_async_error;
    decltype(&ncclAllReduce) all_reduce;
    decltype(&ncclGetErrorString) error_string;
    decltype(&ncclGetLastError) last_error;
} nccl_fns;

static pthread_mutex_t nccl_mu = PTHREAD_MUTEX_INITIALIZER;
static nccl_fns nc;
static int nccl_tried, nccl_ok, nccl_version;
static char nccl_why[768];

static void *open_nccl(char *why, size_t cap) {
    const char *env = getenv("DISAGG_NCCL_LIB");
    if (env && *env) {
        void *h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (!h) tp_seterr(why, cap, "DISAGG_NCCL_LIB=%s cannot be loaded: %s", env, dlerror());
        return h;
    }
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
    char first[256];
    snprintf(first, sizeof first, "%s", dlerror());
    if (DISAGG_NCCL_PATH[0] && (h = dlopen(DISAGG_NCCL_PATH, RTLD_NOW | RTLD_LOCAL))) return h;
    tp_seterr(why, cap,
              "NCCL (libnccl.so.2) is not on the library path (%s) nor at %s, where the build "
              "found it; set DISAGG_NCCL_LIB to its path (the CUDA toolkit's lib64, or pip's "
              "nvidia-nccl-cu13 nvidia/nccl/lib)",
              first, DISAGG_NCCL_PATH[0] ? DISAGG_NCCL_PATH : "(nowhere)");
    return NULL;
}

static int tp_load(int *version, char *err, size_t errlen) {
    pthread_mutex_lock(&nccl_mu);
    if (!nccl_tried) {
        nccl_tried = 1;
        void *h = open_nccl(nccl_why, sizeof nccl_why);
        if (h) {
#define SYM(field, name)                                                                           \
    do {                                                                                           \
        *(void **)&nc.field = dlsym(h, name);                                                      \
        if (!nc.field && !nccl_why[0])                                                             \
            snprintf(nccl_why, sizeof nccl_why, "libnccl has no %s (NCCL older than 2.13?)",       \
                     name);                                                                        \
    } while (0)
            SYM(get_version, "ncclGetVersion");
            SYM(get_unique_id, "ncclGetUniqueId");
            SYM(comm_init_rank, "ncclCommInitRank");
            SYM(comm_destroy, "ncclCommDestroy");
            SYM(comm_abort, "ncclCommAbort");
            SYM(comm_get_async_error, "ncclCommGetAsyncError");
            SYM(all_reduce, "ncclAllReduce");
            SYM(error_string, "ncclGetErrorString");
            SYM(last_error, "ncclGetLastError");
#undef SYM
            if (!nccl_why[0] && nc.get_version(&nccl_version) != ncclSuccess)
                snprintf(nccl_why, sizeof nccl_why, "ncclGetVersion failed");
            if (!nccl_why[0] && nccl_version / 10000 != NCCL_VERSION_CODE / 10000)
                snprintf(nccl_why, sizeof nccl_why,
                         "libnccl is version %d, the module was built against %d (another "
                         "major); point DISAGG_NCCL_LIB at a NCCL %d.x",
                         nccl_version, NCCL_VERSION_CODE, NCCL_MAJOR);
            nccl_ok = !nccl_why[0];
            if (!nccl_ok) dlclose(h);
        }
    }
    int ok = nccl_ok;
    if (ok && version) *version = nccl_version;
    if (!ok) tp_seterr(err, errlen, "%s", nccl_why);
    pthread_mutex_unlock(&nccl_mu);
    return ok ? 0 : -ENOENT;
}

static int tp_unique_id(void *id, char *err, size_t errlen) {
    int rc = tp_load(NULL, err, errlen);
    if (rc) return rc;
    ncclUniqueId u;
    ncclResult_t r = nc.get_unique_id(&u);
    if (r != ncclSuccess) {
        tp_seterr(err, errlen, "ncclGetUniqueId: %s (%s)", nc.error_string(r), nc.last_error(NULL));
        return -EIO;
    }
    memcpy(id, &u, sizeof u);
    return 0;
}

/* ---- communicator ---------------------------------------------------------------------- */

struct dtp_comm {
    ncclComm_t comm;
    cudaStream_t stream; /* the communicator's own (non-blocking) */
    int device, rank, n_ranks;
};

/* The device machines forbid NVLink multicast: NCCL_NVLS_ENABLE=0 before any init. */
static void nvls_off(void) {
    const char *v = getenv("NCCL_NVLS_ENABLE");
    if (v && strcmp(v, "0") != 0)
        fprintf(stderr,
                "cuda_tp: NCCL_NVLS_ENABLE=%s overridden to 0 (NVLink multicast stays off)\n", v);
    setenv("NCCL_NVLS_ENABLE", "0", 1);
}

static dtp_comm *tp_comm_init(int device, int n_ranks, int rank, const void *id, char *err,
                              size_t errlen) {
    if (n_ranks < 1 || rank < 0 || rank >= n_ranks || !id) {
        tp_seterr(err, errlen, "TP communicator: rank %d of %d is not valid (0 <= rank < n >= 1)",
                  rank, n_ranks);
        return NULL;
    }
    if (tp_load(NULL, err, errlen)) return NULL;
    int n_dev = 0;
    cudaError_t ce = cudaGetDeviceCount(&n_dev);
    if (ce != cudaSuccess || device < 0 || device >= n_dev) {
        tp_seterr(err, errlen, "TP rank %d: CUDA device %d is not available (%d visible%s%s)", rank,
                  device, ce == cudaSuccess ? n_dev : 0, ce == cudaSuccess ? "" : ": ",
                  ce == cudaSuccess ? "" : cudaGetErrorString(ce));
        return NULL;
    }
    if ((ce = cudaSetDevice(device)) != cudaSuccess) {
        tp_seterr(err, errlen, "TP rank %d: cudaSetDevice(%d): %s", rank, device,
                  cudaGetErrorString(ce));
        return NULL;
    }
    dtp_comm *c = (dtp_comm *)calloc(1, sizeof *c);
    if (!c) {
        tp_seterr(err, errlen, "TP rank %d: out of memory", rank);
        return NULL;
    }
    c->device = device;
    c->rank = rank;
    c->n_ranks = n_ranks;
    if ((ce = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        tp_seterr(err, errlen, "TP rank %d: cudaStreamCreate: %s", rank, cudaGetErrorString(ce));
        free(c);
        return NULL;
    }
    nvls_off();
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclResult_t r = nc.comm_init_rank(&c->comm, n_ranks, u, rank);
    if (r != ncclSuccess) {
        tp_seterr(err, errlen, "TP rank %d of %d on device %d: ncclCommInitRank: %s (%s)", rank,
                  n_ranks, device, nc.error_string(r), nc.last_error(NULL));
        cudaStreamDestroy(c->stream);
        free(c);
        return NULL;
    }
    return c;
}

static void tp_comm_free(dtp_comm *c) {
    if (!c) return;
    cudaSetDevice(c->device);
    cudaStreamSynchronize(c->stream);
    nc.comm_destroy(c->comm);
    cudaStreamDestroy(c->stream);
    free(c);
}

static int tp_all_reduce(dtp_comm *c, void *buf, size_t count, int dtype, void *stream, char *err,
                         size_t errlen) {
    ncclDataType_t t;
    if (dtype == DCU_F32)
        t = ncclFloat32;
    else if (dtype == DCU_BF16)
        t = ncclBfloat16;
    else {
        tp_seterr(err, errlen, "all-reduce: dtype %d is not supported (f32 %d or bf16 %d)", dtype,
                  DCU_F32, DCU_BF16);
        return -EINVAL;
    }
    if (!c || (!buf && count)) {
        tp_seterr(err, errlen, "all-reduce: no communicator or no buffer");
        return -EINVAL;
    }
    cudaStream_t st = stream ? (cudaStream_t)stream : c->stream;
    ncclResult_t r = nc.all_reduce(buf, buf, count, t, ncclSum, c->comm, st);
    if (r != ncclSuccess) {
        tp_seterr(err, errlen, "TP rank %d: ncclAllReduce of %zu elements: %s (%s)", c->rank, count,
                  nc.error_string(r), nc.last_error(c->comm));
        return -EIO;
    }
    return 0;
}

static int tp_sync(dtp_comm *c, char *err, size_t errlen) {
    if (!c) return -EINVAL;
    cudaError_t ce = cudaStreamSynchronize(c->stream);
    ncclResult_t async = ncclSuccess;
    nc.comm_get_async_error(c->comm, &async);
    if (ce != cudaSuccess || async != ncclSuccess) {
        tp_seterr(err, errlen, "TP rank %d: %s%s%s", c->rank,
                  ce != cudaSuccess ? cudaGetErrorString(ce) : "",
                  ce != cudaSuccess && async != ncclSuccess ? "; " : "",
                  async != ncclSuccess ? nc.error_string(async) : "");
        return -EIO;
    }
    return 0;
}

static const dtp_api TP_API = {DTP_ABI_VERSION, NCCL_VERSION_CODE, DISAGG_NCCL_PATH,
                               tp_load,         tp_unique_id,      tp_comm_init,
                               tp_comm_free,    tp_all_reduce,     tp_sync};

#else /* built without NCCL: every call says so */

static int tp_none(char *err, size_t errlen) {
    tp_seterr(err, errlen,
              "this CUDA module was built without NCCL (CMake found no nccl.h / libnccl in the "
              "CUDA toolkit); tensor parallelism needs it");
    return -ENOTSUP;
}
static int tp_load(int *version, char *err, size_t errlen) {
    return tp_none(err, errlen);
}
static int tp_unique_id(void *id, char *err, size_t errlen) {
    return tp_none(err, errlen);
}
static dtp_comm *tp_comm_init(int device, int n_ranks, int rank, const void *id, char *err,
                              size_t errlen) {
    tp_none(err, errlen);
    return NULL;
}
static void tp_comm_free(dtp_comm *c) {}
static int tp_all_reduce(dtp_comm *c, void *buf, size_t count, int dtype, void *stream, char *err,
                         size_t errlen) {
    return tp_none(err, errlen);
}
static int tp_sync(dtp_comm *c, char *err, size_t errlen) {
    return tp_none(err, errlen);
}
static const dtp_api TP_API = {
    DTP_ABI_VERSION, 0,      "", tp_load, tp_unique_id, tp_comm_init, tp_comm_free,
    tp_all_reduce,   tp_sync};
#endif

extern "C" __attribute__((visibility("default"))) const dtp_api *disagg_cuda_tp_api_v1(void) {
    return &TP_API;
}
