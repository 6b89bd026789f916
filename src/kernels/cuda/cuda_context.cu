/*
 * cuda_context — the CUDA module's device context (cuda_common.cuh): the device probe (driver,
 * compute capability, memory), dcu_ctx create/free (stream, cuBLASLt handle and workspace,
 * the kernel switches read once from the environment; docs/gpu.md lists them) and the
 * blocking copies.
 */
#include "kernels/cuda/cuda_common.cuh"

void seterr(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

int probe(int device, dcu_info *info, char *err, size_t errlen) {
    dcu_info tmp;
    if (!info) info = &tmp;
    memset(info, 0, sizeof *info);
    info->device = device;
    info->runtime_version = CUDART_VERSION;
    int drv = 0;
    cudaError_t e = cudaDriverGetVersion(&drv);
    info->driver_version = drv;
    if (e != cudaSuccess || drv == 0) {
        seterr(err, errlen,
               "no NVIDIA driver found (libcuda.so.1 is not installed or cannot load%s%s); "
               "install the NVIDIA driver for CUDA %d.%d or newer, or use --device cpu",
               e != cudaSuccess ? ": " : "", e != cudaSuccess ? cudaGetErrorString(e) : "",
               CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
        return -ENODEV;
    }
    if (drv / 1000 < CUDART_VERSION / 1000) {
        seterr(err, errlen,
               "the NVIDIA driver supports CUDA %d.%d but this build needs CUDA %d.%d "
               "(CUDART_VERSION %d); install an NVIDIA driver for CUDA %d (e.g. the %s "
               "series) or rebuild disagg with CUDA %d's nvcc",
               drv / 1000, drv % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10,
               CUDART_VERSION, CUDART_VERSION / 1000, CUDART_VERSION >= 13000 ? "580" : "525",
               drv / 1000);
        return -ENODEV;
    }
    int n = 0;
    e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
        seterr(err, errlen, "no CUDA GPU is visible (%s%s%s); use --device cpu",
               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices",
               cvd ? ", CUDA_VISIBLE_DEVICES=" : "", cvd ? cvd : "");
        return -ENODEV;
    }
    info->n_devices = n;
    if (device < 0 || device >= n) {
        seterr(err, errlen, "CUDA device %d does not exist; %d visible (0..%d)", device, n,
               n - 1);
        return -ENODEV;
    }
    cudaDeviceProp p;
    if ((e = cudaGetDeviceProperties(&p, device)) != cudaSuccess) {
        seterr(err, errlen, "cudaGetDeviceProperties(%d): %s", device, cudaGetErrorString(e));
        return -ENODEV;
    }
    snprintf(info->name, sizeof info->name, "%s", p.name);
    info->cc_major = p.major;
    info->cc_minor = p.minor;
    info->n_sm = p.multiProcessorCount;
    info->total_mem = p.totalGlobalMem;
    if (p.major < 9) {
        seterr(err, errlen,
               "%s has compute capability %d.%d; this build runs on 9.0 (Hopper) and newer",
               p.name, p.major, p.minor);
        return -ENODEV;
    }
    int cur = -1;
    cudaGetDevice(&cur);
    if (cudaSetDevice(device) == cudaSuccess) {
        size_t fr = 0, tot = 0;
        if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) info->free_mem = fr;
    }
    return 0;
}

/* DISAGG_CUDA_GEMV_SPLIT / _QKV_SPLIT: unset or "auto" 0 (auto), "0" or "1" 1 (off), 2|4|8;
 * anything else auto */
static int split_env(const char *name) {
    const char *e = getenv(name);
    if (!e || !strcmp(e, "auto")) return 0;
    int v = atoi(e);
    return v == 0 && !strcmp(e, "0") ? 1 : v == 1 || v == 2 || v == 4 || v == 8 ? v : 0;
}

dcu_ctx *ctx_create(int device, char *err, size_t errlen) {
    dcu_info info;
    if (probe(device, &info, err, errlen)) return NULL;
    dcu_ctx *c = (dcu_ctx *)calloc(1, sizeof *c);
    if (!c) return NULL;
    c->device = device;
    c->n_sm = info.n_sm;
    c->gemv_max_t = getenv("DISAGG_CUDA_GEMV") ? atoi(getenv("DISAGG_CUDA_GEMV")) : 1;
    c->fp8_gemv_max_t = getenv("DISAGG_CUDA_FP8_GEMV") ? atoi(getenv("DISAGG_CUDA_FP8_GEMV")) : 8;
    if (c->fp8_gemv_max_t < 0 || c->fp8_gemv_max_t > 8) c->fp8_gemv_max_t = 8;
    {
        const char *m = getenv("DISAGG_CUDA_FP8_MMA");
        int v = m ? atoi(m) : 0;
        c->fp8_mma_max_t = v == 1 ? 16 : v >= 2 && v <= 16 ? v : 0;
    }
    c->fp8_mma_split = split_env("DISAGG_CUDA_FP8_MMA_SPLIT");
    c->fp8_mma_mt = getenv("DISAGG_CUDA_FP8_MMA_MT") ? atoi(getenv("DISAGG_CUDA_FP8_MMA_MT")) : 0;
    c->fp8_mma_db = getenv("DISAGG_CUDA_FP8_MMA_DB") ? atoi(getenv("DISAGG_CUDA_FP8_MMA_DB")) : -1;
    /* on by default since its H200 test against the W8A8 emulation passed (3 December) */
    c->fp8_gemm = !(getenv("DISAGG_CUDA_FP8_GEMM") && !strcmp(getenv("DISAGG_CUDA_FP8_GEMM"), "0"));
    if (c->gemv_max_t < 0 || c->gemv_max_t > GEMV_MAX_T) c->gemv_max_t = GEMV_MAX_T;
    c->pdl = !(getenv("DISAGG_CUDA_PDL") && !strcmp(getenv("DISAGG_CUDA_PDL"), "0"));
    c->norm_pdl =
        !(getenv("DISAGG_CUDA_NORM_PDL") && !strcmp(getenv("DISAGG_CUDA_NORM_PDL"), "0"));
    c->qkv_fuse =
        !(getenv("DISAGG_CUDA_QKV_FUSE") && !strcmp(getenv("DISAGG_CUDA_QKV_FUSE"), "0"));
    c->gemv_warps = getenv("DISAGG_CUDA_GEMV_WARPS") ? atoi(getenv("DISAGG_CUDA_GEMV_WARPS")) : 4;
    if (c->gemv_warps != 2 && c->gemv_warps != 4 && c->gemv_warps != 8) c->gemv_warps = 4;
    c->gemv_split = split_env("DISAGG_CUDA_GEMV_SPLIT");
    c->qkv_split = split_env("DISAGG_CUDA_QKV_SPLIT");
    c->gemv_split_rows = getenv("DISAGG_CUDA_GEMV_SPLIT_ROWS") &&
                                 atoi(getenv("DISAGG_CUDA_GEMV_SPLIT_ROWS")) == 1
                             ? 1
                             : 2;
    {
        const char *db = getenv("DISAGG_CUDA_GEMV_DB");
        c->gemv_db = !db || !strcmp(db, "f8") ? 1 : !strcmp(db, "0") ? 0 : 2;
    }
    c->flash_mt = getenv("DISAGG_CUDA_FLASH_MT") && atoi(getenv("DISAGG_CUDA_FLASH_MT")) == 1 ? 1 : 2;
    c->gu_bf16_min_t = getenv("DISAGG_CUDA_GU_BF16") ? atoi(getenv("DISAGG_CUDA_GU_BF16")) : 64;
    c->tune = getenv("DISAGG_CUDA_GEMM_TUNE") && atoi(getenv("DISAGG_CUDA_GEMM_TUNE")) > 0;
    c->flash_auto =
        !(getenv("DISAGG_CUDA_FLASH_AUTO") && !strcmp(getenv("DISAGG_CUDA_FLASH_AUTO"), "0"));
    c->gemm_sweep = getenv("DISAGG_CUDA_GEMM_SWEEP") ? atoi(getenv("DISAGG_CUDA_GEMM_SWEEP")) : 0;
    c->gemm_algo = getenv("DISAGG_CUDA_GEMM_ALGO") ? atoi(getenv("DISAGG_CUDA_GEMM_ALGO")) : -1;
    c->qkv_bf16_min_t = getenv("DISAGG_CUDA_QKV_BF16") ? atoi(getenv("DISAGG_CUDA_QKV_BF16")) : 64;
    c->resid_min_t = getenv("DISAGG_CUDA_RESID_GEMM") ? atoi(getenv("DISAGG_CUDA_RESID_GEMM")) : 64;
    cudaError_t e;
    if ((e = cudaSetDevice(device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        seterr(err, errlen, "CUDA device %d: %s", device, cudaGetErrorString(e));
        free(c);
        return NULL;
    }
    cublasStatus_t s = cublasLtCreate(&c->lt);
    if (s != CUBLAS_STATUS_SUCCESS) {
        seterr(err, errlen, "cublasLtCreate failed (status %d)", (int)s);
        cudaStreamDestroy(c->stream);
        free(c);
        return NULL;
    }
    c->ws_bytes = 64u << 20;
    if (cudaMalloc(&c->ws, c->ws_bytes) != cudaSuccess ||
        cudaMalloc((void **)&c->amax_tmp, (size_t)AMX_ROWS * AMX_PARTS * 2 * sizeof(int32_t)) !=
            cudaSuccess) {
        seterr(err, errlen, "out of GPU memory for the cuBLASLt workspace (64 MiB)");
        cublasLtDestroy(c->lt);
        cudaStreamDestroy(c->stream);
        free(c);
        return NULL;
    }
    return c;
}

void ctx_free(dcu_ctx *c) {
    if (!c) return;
    cudaStreamSynchronize(c->stream);
    for (int i = 0; i < PLAN_CACHE; i++)
        if (c->plans[i].valid) {
            cublasLtMatmulDescDestroy(c->plans[i].op);
            cublasLtMatrixLayoutDestroy(c->plans[i].a);
            cublasLtMatrixLayoutDestroy(c->plans[i].b);
            cublasLtMatrixLayoutDestroy(c->plans[i].c);
        }
    for (int i = 0; i < PLAN16_CACHE; i++)
        if (c->plans16[i].valid) {
            cublasLtMatmulDescDestroy(c->plans16[i].op);
            cublasLtMatrixLayoutDestroy(c->plans16[i].a);
            cublasLtMatrixLayoutDestroy(c->plans16[i].b);
            cublasLtMatrixLayoutDestroy(c->plans16[i].c);
        }
    cudaFree(c->ws);
    cudaFree(c->att_part);
    cudaFree(c->att_ml);
    cudaFree(c->amax_tmp);
    cublasLtDestroy(c->lt);
    cudaStreamDestroy(c->stream);
    free(c);
}

int dupload(dcu_ctx *c, void *dst, const void *src, size_t n) {
    CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, c->stream));
    CK(cudaStreamSynchronize(c->stream));
    return 0;
}
int ddownload(dcu_ctx *c, void *dst, const void *src, size_t n) {
    CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, c->stream));
    CK(cudaStreamSynchronize(c->stream));
    return 0;
}
