/*
 * cuda_gemm — the GEMMs of the CUDA module (cuda_common.cuh) through cuBLASLt: bf16 in, f32
 * accumulate, f32 out (matmul; the decode GEMV of cuda_gemv.cu where gemv_ok()), bf16 out
 * (matmul_bf16out), beta = 1 onto the residual (matmul_acc); per-shape plans, the fixed
 * prefill rule and the timing switches (DISAGG_CUDA_GEMM_TUNE / _SWEEP / _ALGO); the copy
 * and GEMM ceilings (measure).  lt_desc_nt / lt_cfg are the cuBLASLt glue that the
 * batch-invariant GEMM (cuda_invariant.cu) shares.
 */
#include "kernels/cuda/cuda_common.cuh"

/* column-major view: C (N, M) = W^T-as-stored (op T of a K x N matrix) x X (K x M) */
cublasStatus_t lt_desc_nt(cublasLtMatmulDesc_t *op) {
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasStatus_t s = cublasLtMatmulDescCreate(op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    return s;
}

int lt_cfg(const cublasLtMatmulAlgo_t *a, cublasLtMatmulAlgoConfigAttributes_t at) {
    uint32_t v = 0;
    size_t wr = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(a, at, &v, sizeof v, &wr) != CUBLAS_STATUS_SUCCESS)
        return -1;
    return (int)v;
}

/* ---- GEMM (cuBLASLt) -------------------------------------------------------------- */

/* DISAGG_CUDA_GEMM_TUNE=1: decode-sized GEMMs (T <= GEMM_TUNE_MAX_T) pick the fastest of
 * cuBLASLt's first GEMM_TUNE_ALGOS heuristic candidates, timed once per (device, T, N, K) in
 * the process and shared by every context (so every stream computes a shape with the same
 * kernel).  Off by default: on the H200 (7B shapes, batch 1..128) it measured no gain over
 * the first candidate, and a timing-based choice could differ between processes (P and D). */
#define GEMM_TUNE_MAX_T 256
#define GEMM_TUNE_ALGOS 8
#define GEMM_TUNED_CAP 1024
typedef struct gemm_tuned {
    int dev, T, N, K;
    cublasLtMatmulAlgo_t algo;
    float us;
} gemm_tuned;
static gemm_tuned g_tuned[GEMM_TUNED_CAP];
static int g_n_tuned;
static pthread_mutex_t g_tune_mu = PTHREAD_MUTEX_INITIALIZER;

static int tuned_find(int dev, int T, int N, int K, cublasLtMatmulAlgo_t *algo) {
    int found = 0;
    pthread_mutex_lock(&g_tune_mu);
    for (int i = 0; i < g_n_tuned && !found; i++)
        if (g_tuned[i].dev == dev && g_tuned[i].T == T && g_tuned[i].N == N && g_tuned[i].K == K) {
            *algo = g_tuned[i].algo;
            found = 1;
        }
    pthread_mutex_unlock(&g_tune_mu);
    return found;
}

/* times the candidates on x/w/y (y is overwritten; the caller's GEMM runs after) and returns
 * the index of the fastest, or 0 */
static int tune_pick(dcu_ctx *c, gemm_plan *p, const cublasLtMatmulHeuristicResult_t *res, int n,
                     const void *x, const void *w, void *y, float *best_us) {
    cudaEvent_t e0, e1;
    if (cudaEventCreate(&e0) != cudaSuccess) return 0;
    if (cudaEventCreate(&e1) != cudaSuccess) {
        cudaEventDestroy(e0);
        return 0;
    }
    float alpha = 1.0f, beta = 0.0f, best = 1e30f;
    int bi = 0;
    for (int i = 0; i < n; i++) {
        cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
        for (int r = 0; r < 4 && st == CUBLAS_STATUS_SUCCESS; r++) {
            if (r == 1) cudaEventRecord(e0, c->stream);
            st = cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, x, p->b, &beta, y, p->c, y, p->c,
                                &res[i].algo, c->ws, c->ws_bytes, c->stream);
        }
        cudaEventRecord(e1, c->stream);
        float ms = 0;
        if (st != CUBLAS_STATUS_SUCCESS || cudaEventSynchronize(e1) != cudaSuccess ||
            cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) {
            cudaGetLastError();
            continue;
        }
        if (ms < best) best = ms, bi = i;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    *best_us = best * 1e3f / 3;
    return bi;
}

/* Prefill GEMMs (T >= PF_GEMM_MIN_T, fast mode: the batch-invariant mode's GEMMs are
 * iv_matmul's own): cuBLASLt's first PF_ALGOS heuristic candidates, and candidate
 * pf_rule() of them — a fixed rule from the H200 measurements (docs/gpu.md), so the
 * same shape runs the same kernel in every process (no timing decides).  DISAGG_CUDA_GEMM_ALGO=i
 * forces candidate i (0: the heuristic's first, the code before the rule); DISAGG_CUDA_GEMM_SWEEP=1 times every candidate once per plan and prints
 * them (stderr), =2 also takes the fastest (measuring only: that choice can differ between
 * processes). */
#define PF_GEMM_MIN_T 256
#define PF_ALGOS 16

/* The fixed rule (H200, cuBLASLt 13.0, Qwen2.5-7B shapes, T = 512 / 2048 / 4096 timed by
 * DISAGG_CUDA_GEMM_SWEEP, docs/benchmarks.md): for T >= 512 the f32-output GEMMs of N = 3584
 * rows (o: K = 3584, down: K = 18944) run the first candidate of tile 112x128, else of tile
 * 128x128, and those of N = 4608 (q|k|v) the first of tile 144x128 (no split-K either way);
 * where the list has none, and for every other shape (the bf16 gate|up too), the heuristic's
 * first.  The heuristic's first at T >= 2048 were 320x128 / 256x128 / 192x192 tiles, 7-13 %
 * slower on these N.  The candidate list is the same for a shape in every process, so is
 * the choice. */
static int pf_rule(const cublasLtMatmulHeuristicResult_t *res, int found, int T, int N,
                   int out16) {
    static const int t3584[] = {CUBLASLT_MATMUL_TILE_112x128, CUBLASLT_MATMUL_TILE_128x128};
    static const int t4608[] = {CUBLASLT_MATMUL_TILE_144x128};
    const int *pref = NULL;
    int n_pref = 0;
    if (out16 || T < 512) return 0;
    if (N == 3584) pref = t3584, n_pref = 2;
    if (N == 4608) pref = t4608, n_pref = 1;
    for (int j = 0; j < n_pref; j++)
        for (int i = 0; i < found; i++)
            if (lt_cfg(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID) == pref[j] &&
                lt_cfg(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) <= 1)
                return i;
    return 0;
}

static int pf_pick(dcu_ctx *c, gemm_plan *p, cublasLtMatmulPreference_t pref, const void *x,
                   const void *w, void *y, int T, int N, int K, int out16,
                   cublasLtMatmulAlgo_t *algo) {
    cublasLtMatmulHeuristicResult_t res[PF_ALGOS];
    int found = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref,
                                                      PF_ALGOS, res, &found);
    if (s != CUBLAS_STATUS_SUCCESS || found <= 0) return -1;
    int pick = c->gemm_algo >= 0 ? c->gemm_algo : pf_rule(res, found, T, N, out16);
    if (pick >= found) pick = 0;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(c->stream, &cap);
    if (c->gemm_sweep > 0 && cap == cudaStreamCaptureStatusNone && x && w && y) {
        cudaEvent_t e0, e1;
        if (cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess) {
            float alpha = 1.0f, beta = 0.0f, best = 1e30f;
            int bi = pick;
            for (int i = 0; i < found; i++) {
                cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
                for (int r = 0; r < 7 && st == CUBLAS_STATUS_SUCCESS; r++) {
                    if (r == 2) cudaEventRecord(e0, c->stream);
                    st = cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, x, p->b, &beta, y, p->c, y,
                                        p->c, &res[i].algo, c->ws, c->ws_bytes, c->stream);
                }
                cudaEventRecord(e1, c->stream);
                float ms = 0;
                if (st != CUBLAS_STATUS_SUCCESS || cudaEventSynchronize(e1) != cudaSuccess ||
                    cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) {
                    cudaGetLastError();
                    fprintf(stderr, "cuda gemm sweep: T=%d N=%d K=%d%s #%d: failed\n", T, N, K,
                            out16 ? " bf16" : "", i);
                    continue;
                }
                float us = ms * 1e3f / 5;
                if (us < best) best = us, bi = i;
                const cublasLtMatmulAlgo_t *a = &res[i].algo;
                fprintf(stderr,
                        "cuda gemm sweep: T=%d N=%d K=%d%s #%d: %8.1f us %4.0f TFLOP/s (id %d tile "
                        "%d stages %d splitk %d red %d swizzle %d cluster %d ws %zu)%s\n",
                        T, N, K, out16 ? " bf16" : "", i, us, 2.0 * T * N * K / us * 1e-6,
                        lt_cfg(a, CUBLASLT_ALGO_CONFIG_ID), lt_cfg(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                        lt_cfg(a, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                        lt_cfg(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                        lt_cfg(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                        lt_cfg(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                        lt_cfg(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), res[i].workspaceSize,
                        i == pick ? " <- rule" : "");
            }
            if (c->gemm_sweep >= 2) pick = bi;
            fprintf(stderr, "cuda gemm sweep: T=%d N=%d K=%d%s: fastest #%d, using #%d\n", T, N,
                    K, out16 ? " bf16" : "", bi, pick);
        }
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
    *algo = res[pick].algo;
    return 0;
}

static gemm_plan *plan_get(dcu_ctx *c, int T, int N, int K, const void *x, const void *w,
                           void *y) {
    for (int i = 0; i < PLAN_CACHE; i++)
        if (c->plans[i].valid && c->plans[i].T == T && c->plans[i].N == N && c->plans[i].K == K)
            return &c->plans[i];
    gemm_plan *p = &c->plans[c->next_plan];
    c->next_plan = (c->next_plan + 1) % PLAN_CACHE;
    if (p->valid) {
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->c);
        p->valid = 0;
    }
    if (lt_desc_nt(&p->op) != CUBLAS_STATUS_SUCCESS) return NULL;
    cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, K, N, K);
    cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, K, T, K);
    cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, N, T, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                         &c->ws_bytes, sizeof c->ws_bytes);
    cublasLtMatmulHeuristicResult_t res[GEMM_TUNE_ALGOS];
    int found = 0;
    int cacheable = T <= GEMM_TUNE_MAX_T && c->tune;
    if (!cacheable && T >= PF_GEMM_MIN_T &&
        pf_pick(c, p, pref, x, w, y, T, N, K, 0, &res[0].algo) == 0) {
        cublasLtMatmulPreferenceDestroy(pref);
        p->algo = res[0].algo;
        p->T = T, p->N = N, p->K = K, p->valid = 1;
        return p;
    }
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(c->stream, &cap);
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref,
                                                      cacheable ? GEMM_TUNE_ALGOS : 1, res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s == CUBLAS_STATUS_SUCCESS && found > 0 && cacheable) {
        cublasLtMatmulAlgo_t a;
        if (tuned_find(c->device, T, N, K, &a)) {
            res[0].algo = a;
        } else if (cap == cudaStreamCaptureStatusNone) {
            float us = 0;
            int bi = found > 1 ? tune_pick(c, p, res, found, x, w, y, &us) : 0;
            res[0].algo = res[bi].algo;
            pthread_mutex_lock(&g_tune_mu);
            if (g_n_tuned < GEMM_TUNED_CAP) {
                g_tuned[g_n_tuned] = (gemm_tuned){c->device, T, N, K, res[bi].algo, us};
                g_n_tuned++;
            }
            pthread_mutex_unlock(&g_tune_mu);
        }
    }
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
        fprintf(stderr, "cuda: cuBLASLt has no bf16 GEMM for T=%d N=%d K=%d (status %d)\n", T, N,
                K, (int)s);
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->c);
        return NULL;
    }
    p->algo = res[0].algo;
    p->T = T, p->N = N, p->K = K, p->valid = 1;
    return p;
}

int matmul(dcu_ctx *c, float *y, const void *x, const void *w, const float *bias, int T,
                  int N, int K) {
    if (T <= 0) return 0;
    if (gemv_ok(c, T, K, x, w)) return gemv(c, y, x, w, bias, T, N, K);
    gemm_plan *p = plan_get(c, T, N, K, x, w, y);
    if (!p) return -EIO;
    float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t s = cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, x, p->b, &beta, y, p->c, y,
                                      p->c, &p->algo, c->ws, c->ws_bytes, c->stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuda: cublasLtMatmul T=%d N=%d K=%d failed (status %d)\n", T, N, K,
                (int)s);
        return -EIO;
    }
    if (bias) {
        size_t n = (size_t)T * N;
        return add_bias(c, y, bias, N, n);
    }
    return 0;
}

/* resid (T, N) f32 += x (T, K) bf16 . w (N, K)^T bf16 through cuBLASLt with beta = 1
 * and C = D = resid (in place, one layout): the GEMM's epilogue adds its f32 accumulator onto
 * the residual stream, alpha * acc + beta * C rounded once as x + y was (backend_matmul_residual
 * at prefill-sized T; decode keeps the add in the norm).  The plan is matmul's for the shape;
 * tmp (T, N) f32 takes the candidate timings of DISAGG_CUDA_GEMM_TUNE / _SWEEP when the plan is
 * new (never resid). */
int matmul_acc(dcu_ctx *c, float *resid, float *tmp, const void *x, const void *w, int T,
                      int N, int K) {
    if (T <= 0) return 0;
    gemm_plan *p = plan_get(c, T, N, K, x, w, tmp);
    if (!p) return -EIO;
    float alpha = 1.0f, beta = 1.0f;
    cublasStatus_t s = cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, x, p->b, &beta, resid, p->c,
                                      resid, p->c, &p->algo, c->ws, c->ws_bytes, c->stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuda: cublasLtMatmul (beta 1) T=%d N=%d K=%d failed (status %d)\n", T, N,
                K, (int)s);
        return -EIO;
    }
    return 0;
}

/* y (T, N) bf16 = x (T, K) bf16 . w (N, K)^T bf16 through cuBLASLt, f32 accumulate, the
 * output rounded to bf16 by the GEMM's epilogue (the prefill gate|up: half the bytes of
 * the f32 output written and read back by SwiGLU).  Its own plan cache (c->plans16). */
static gemm_plan *plan16_get(dcu_ctx *c, int T, int N, int K, const void *x, const void *w,
                             void *y) {
    for (int i = 0; i < PLAN16_CACHE; i++)
        if (c->plans16[i].valid && c->plans16[i].T == T && c->plans16[i].N == N &&
            c->plans16[i].K == K)
            return &c->plans16[i];
    gemm_plan *p = &c->plans16[c->next_plan16];
    c->next_plan16 = (c->next_plan16 + 1) % PLAN16_CACHE;
    if (p->valid) {
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->c);
        p->valid = 0;
    }
    if (lt_desc_nt(&p->op) != CUBLAS_STATUS_SUCCESS) return NULL;
    cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, K, N, K);
    cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, K, T, K);
    cublasLtMatrixLayoutCreate(&p->c, CUDA_R_16BF, N, T, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                         &c->ws_bytes, sizeof c->ws_bytes);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    if (T >= PF_GEMM_MIN_T && pf_pick(c, p, pref, x, w, y, T, N, K, 1, &res.algo) == 0) {
        cublasLtMatmulPreferenceDestroy(pref);
        p->algo = res.algo;
        p->T = T, p->N = N, p->K = K, p->valid = 1;
        return p;
    }
    cublasStatus_t s =
        cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
        fprintf(stderr,
                "cuda: cuBLASLt has no bf16-output GEMM for T=%d N=%d K=%d (status %d)\n", T, N,
                K, (int)s);
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->c);
        return NULL;
    }
    p->algo = res.algo;
    p->T = T, p->N = N, p->K = K, p->valid = 1;
    return p;
}

int matmul_bf16out(dcu_ctx *c, bf16 *y, const void *x, const void *w, int T, int N,
                          int K) {
    if (T <= 0) return 0;
    gemm_plan *p = plan16_get(c, T, N, K, x, w, y);
    if (!p) return -EIO;
    float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t s = cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, x, p->b, &beta, y, p->c, y,
                                      p->c, &p->algo, c->ws, c->ws_bytes, c->stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuda: cublasLtMatmul (bf16 out) T=%d N=%d K=%d failed (status %d)\n", T,
                N, K, (int)s);
        return -EIO;
    }
    return 0;
}

/* ---- ceilings ------------------------------------------------------------------- */

__global__ void k_fill_rand(bf16 *p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u ^ seed;
        x ^= x >> 13;
        x *= 0x5bd1e995u;
        x ^= x >> 15;
        p[i] = __float2bfloat16(((x & 0xffff) / 65536.0f - 0.5f) * 0.1f);
    }
}

int measure(dcu_ctx *c, double *copy_gbs, double *gemm_tflops, int M, int N, int K) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    int rc = 0;
    /* copy: 2 GiB buffer, D2D, bytes read + written */
    size_t bytes = (size_t)2 << 30;
    void *a = NULL, *b = NULL;
    if (copy_gbs) {
        *copy_gbs = 0;
        if (cudaMalloc(&a, bytes) == cudaSuccess && cudaMalloc(&b, bytes) == cudaSuccess) {
            cudaMemsetAsync(a, 1, bytes, c->stream);
            for (int i = 0; i < 3; i++)
                cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, c->stream);
            cudaEventRecord(e0, c->stream);
            int reps = 10;
            for (int i = 0; i < reps; i++)
                cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, c->stream);
            cudaEventRecord(e1, c->stream);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            *copy_gbs = 2.0 * bytes * reps / (ms / 1e3) / 1e9;
        } else {
            cudaGetLastError();
            rc = -ENOMEM;
        }
        cudaFree(a);
        cudaFree(b);
    }
    if (gemm_tflops) {
        *gemm_tflops = 0;
        bf16 *x = NULL, *w = NULL;
        float *y = NULL;
        if (cudaMalloc((void **)&x, (size_t)M * K * 2) == cudaSuccess &&
            cudaMalloc((void **)&w, (size_t)N * K * 2) == cudaSuccess &&
            cudaMalloc((void **)&y, (size_t)M * N * 4) == cudaSuccess) {
            k_fill_rand<<<1024, 256, 0, c->stream>>>(x, (size_t)M * K, 1);
            k_fill_rand<<<1024, 256, 0, c->stream>>>(w, (size_t)N * K, 2);
            for (int i = 0; i < 3 && !rc; i++)
                rc = matmul(c, y, x, w, NULL, M, N, K);
            cudaEventRecord(e0, c->stream);
            int reps = 10;
            for (int i = 0; i < reps && !rc; i++)
                rc = matmul(c, y, x, w, NULL, M, N, K);
            cudaEventRecord(e1, c->stream);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            if (!rc) *gemm_tflops = 2.0 * M * N * K * reps / (ms / 1e3) / 1e12;
        } else {
            cudaGetLastError();
            rc = -ENOMEM;
        }
        cudaFree(x);
        cudaFree(w);
        cudaFree(y);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return rc;
}
