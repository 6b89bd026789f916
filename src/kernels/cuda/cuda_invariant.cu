/*
 * cuda_invariant — the batch-invariant GEMM and attention of the CUDA backend (see
 * cuda_invariant.h for what is fixed and why that makes a row's bits independent of the
 * batch).
 */
#include "kernels/cuda/cuda_invariant.h"
#include "kernels/cuda/cuda_common.cuh" /* bf16, lt_desc_nt, lt_cfg; cuda_mma.cuh */

/* ---- GEMM: one pinned cuBLASLt algorithm per (N, K) ------------------------------------ */

#define IV_ALGO_CAP 512
#define IV_CHECK_CAP 8192
#define IV_MAX_ROWS 8192 /* rows per cuBLASLt call at most (larger M runs in chunks) */
#define IV_CANDIDATES 16

#define IV_BUCKETS 14 /* row counts 1, 2, 4, .. 8192 */

/* One chosen algorithm and how many rows one call of it may take. */
typedef struct iv_pick {
    cublasLtMatmulAlgo_t algo;
    int max_rows; /* a power of two: the workspace holds this many rows' split-K partials */
} iv_pick;

typedef struct iv_algo {
    int dev, N, K, m_ref, splitk, buckets, out16, order;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a;
    cublasLtMatmulAlgo_t algo; /* the reference: chosen at m_ref, valid for every M */
    int max_rows;
    int ok; /* 0: no algorithm (every call fails) */
    /* per power-of-two row bucket: 0 unresolved, 1 bucket[b] (bit-identical to the reference
     * on the probe), 2 the reference */
    int bstate[IV_BUCKETS];
    iv_pick bucket[IV_BUCKETS];
} iv_algo;

typedef struct iv_check {
    const void *al; /* the algorithm checked (its address) */
    int M, state; /* 0 empty, 1 passed, -1 failed */
} iv_check;

static iv_algo g_algos[IV_ALGO_CAP];
static int g_n_algos;
static iv_check g_checks[IV_CHECK_CAP];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

iv_policy iv_policy_default(void) {
    iv_policy p = {64, 1, 1, 1, 1};
    const char *m = getenv("DISAGG_CUDA_INV_GEMM_M"), *s = getenv("DISAGG_CUDA_INV_SPLITK"),
               *b = getenv("DISAGG_CUDA_INV_BUCKETS"), *g = getenv("DISAGG_CUDA_INV_GU16"),
               *o = getenv("DISAGG_CUDA_INV_ORDER");
    if (g && (!strcmp(g, "0") || !strcmp(g, "1"))) p.gu16 = atoi(g);
    if (o && (!strcmp(o, "0") || !strcmp(o, "1"))) p.order = atoi(o);
    if (m && atoi(m) >= 1 && atoi(m) <= 65536) p.m_ref = atoi(m);
    if (s && (!strcmp(s, "0") || !strcmp(s, "1"))) p.splitk = atoi(s);
    if (b && (!strcmp(b, "0") || !strcmp(b, "1"))) p.buckets = atoi(b);
    return p;
}

/* $DISAGG_CUDA_INV_LOG set, not empty, not 0: log every algorithm choice */
static int iv_log(void) {
    const char *e = getenv("DISAGG_CUDA_INV_LOG");
    return e && *e && strcmp(e, "0");
}

static int check_algo(cublasLtHandle_t lt, const iv_algo *al, const cublasLtMatmulAlgo_t *algo,
                      int M, size_t ws_bytes) {
    cublasLtMatrixLayout_t b = NULL, c = NULL;
    if (cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, al->K, M, al->K) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&c, al->out16 ? CUDA_R_16BF : CUDA_R_32F, al->N, M, al->N) !=
            CUBLAS_STATUS_SUCCESS) {
        if (b) cublasLtMatrixLayoutDestroy(b);
        return 0;
    }
    cublasLtMatmulHeuristicResult_t r;
    memset(&r, 0, sizeof r);
    cublasStatus_t s = cublasLtMatmulAlgoCheck(lt, al->op, al->a, b, c, c, algo, &r);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    return s == CUBLAS_STATUS_SUCCESS && r.workspaceSize <= ws_bytes;
}

static int check_m(cublasLtHandle_t lt, const iv_algo *al, int M, size_t ws_bytes) {
    return check_algo(lt, al, &al->algo, M, ws_bytes);
}

/* the shape's algorithm (chosen on first use; g_mu held) */
static iv_algo *algo_get(cublasLtHandle_t lt, int dev, const iv_policy *pol, int N, int K,
                         int out16, size_t ws_bytes) {
    for (int i = 0; i < g_n_algos; i++) {
        iv_algo *a = &g_algos[i];
        if (a->dev == dev && a->N == N && a->K == K && a->m_ref == pol->m_ref &&
            a->splitk == pol->splitk && a->buckets == pol->buckets && a->out16 == out16 &&
            a->order == pol->order)
            return a;
    }
    if (g_n_algos == IV_ALGO_CAP) return NULL;
    iv_algo *al = &g_algos[g_n_algos];
    memset(al, 0, sizeof *al);
    al->dev = dev, al->N = N, al->K = K, al->m_ref = pol->m_ref, al->splitk = pol->splitk;
    al->buckets = pol->buckets, al->out16 = out16, al->order = pol->order;
    if (lt_desc_nt(&al->op) != CUBLAS_STATUS_SUCCESS) return NULL;
    cublasLtMatrixLayoutCreate(&al->a, CUDA_R_16BF, K, N, K);
    g_n_algos++;
    cublasLtMatrixLayout_t b = NULL, c = NULL;
    cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, K, pol->m_ref, K);
    cublasLtMatrixLayoutCreate(&c, out16 ? CUDA_R_16BF : CUDA_R_32F, N, pol->m_ref, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                         sizeof ws_bytes);
    /* split-K only with a separate reduction step (partials in the workspace, summed in
     * split order); never in place */
    uint32_t mask = pol->splitk ? (CUBLASLT_REDUCTION_SCHEME_NONE |
                                   CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                                   CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE)
                                : CUBLASLT_REDUCTION_SCHEME_NONE;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask,
                                         sizeof mask);
    cublasLtMatmulHeuristicResult_t res[IV_CANDIDATES];
    int found = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, al->op, al->a, b, c, c, pref,
                                                      IV_CANDIDATES, res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    int pick = -1;
    for (int i = 0; s == CUBLAS_STATUS_SUCCESS && i < found && pick < 0; i++) {
        if (pol->splitk == 0 && lt_cfg(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1)
            continue;
        if (lt_cfg(&res[i].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) ==
            CUBLASLT_REDUCTION_SCHEME_INPLACE)
            continue;
        al->algo = res[i].algo;
        if (check_m(lt, al, 1, ws_bytes) && check_m(lt, al, pol->m_ref, ws_bytes)) pick = i;
    }
    if (pick < 0) {
        fprintf(stderr,
                "cuda: batch-invariant GEMM: cuBLASLt offers no algorithm for N=%d K=%d at M=%d "
                "(status %d, %d candidates)\n",
                N, K, pol->m_ref, (int)s, found);
        return al; /* ok = 0: calls fail */
    }
    al->max_rows = 1;
    while (al->max_rows < IV_MAX_ROWS && check_m(lt, al, al->max_rows * 2, ws_bytes))
        al->max_rows *= 2;
    al->ok = 1;
    if (iv_log())
        fprintf(stderr,
                "cuda: batch-invariant GEMM N=%d K=%d%s: algo %d tile %d stages %d split-K %d "
                "reduction %d (chosen at M=%d, candidate %d), rows per call <= %d\n",
                N, K, out16 ? " bf16 out" : "", lt_cfg(&al->algo, CUBLASLT_ALGO_CONFIG_ID),
                lt_cfg(&al->algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                lt_cfg(&al->algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                lt_cfg(&al->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                lt_cfg(&al->algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME), pol->m_ref, pick,
                al->max_rows);
    return al;
}

/* AlgoCheck of (algorithm, M), cached by the algorithm's address (g_mu held) */
static int m_ok(cublasLtHandle_t lt, const iv_algo *al, const cublasLtMatmulAlgo_t *algo, int M,
                size_t ws_bytes) {
    unsigned h = ((unsigned)(uintptr_t)algo * 2654435761u) ^ ((unsigned)M * 40503u);
    for (int probe = 0; probe < 16; probe++) {
        iv_check *c = &g_checks[(h + probe) % IV_CHECK_CAP];
        if (c->state && c->al == (const void *)algo && c->M == M) return c->state > 0;
        if (!c->state || probe == 15) {
            c->al = (const void *)algo, c->M = M;
            c->state = check_algo(lt, al, algo, M, ws_bytes) ? 1 : -1;
            return c->state > 0;
        }
    }
    return 0;
}

/* y (T, N) = x . w^T with one algorithm, in calls of at most max_rows rows (g_mu held) */
static int run_algo(cublasLtHandle_t lt, const iv_algo *al, const cublasLtMatmulAlgo_t *algo,
                    int max_rows, void *ws, size_t ws_bytes, cudaStream_t st, void *y,
                    const void *x, const void *w, int T) {
    float alpha = 1.0f, beta = 0.0f;
    int N = al->N, K = al->K;
    for (int r0 = 0; r0 < T; r0 += max_rows) {
        int M = T - r0 < max_rows ? T - r0 : max_rows;
        if (!m_ok(lt, al, algo, M, ws_bytes)) {
            fprintf(stderr,
                    "cuda: batch-invariant GEMM N=%d K=%d: the pinned algorithm does not take "
                    "M=%d (cublasLtMatmulAlgoCheck)\n",
                    N, K, M);
            return -EIO;
        }
        cublasLtMatrixLayout_t b = NULL, c = NULL;
        cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, K, M, K);
        cublasLtMatrixLayoutCreate(&c, al->out16 ? CUDA_R_16BF : CUDA_R_32F, N, M, N);
        const bf16 *xb = (const bf16 *)x + (size_t)r0 * K;
        char *yc = (char *)y + (size_t)r0 * N * (al->out16 ? 2 : 4);
        cublasStatus_t s = cublasLtMatmul(lt, al->op, &alpha, w, al->a, xb, b, &beta, yc, c, yc, c,
                                          algo, ws, ws_bytes, st);
        cublasLtMatrixLayoutDestroy(b);
        cublasLtMatrixLayoutDestroy(c);
        if (s != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "cuda: batch-invariant cublasLtMatmul M=%d N=%d K=%d failed (%d)\n", M,
                    N, K, (int)s);
            return -EIO;
        }
    }
    return 0;
}

__global__ void k_iv_fill(bf16 *p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t v = (uint32_t)i * 2654435761u ^ seed;
        v ^= v >> 13, v *= 0x5bd1e995u, v ^= v >> 15;
        p[i] = __float2bfloat16((float)(v & 0xffff) / 32768.0f - 1.0f);
    }
}

/* The order resolve_bucket tries cuBLASLt's candidates in (ord: a permutation of 0 .. found-1):
 * as offered, or (prefer, f32 output) for buckets of >= 512 rows first those whose tile is the
 * fast mode's prefill rule's (pf_rule in cuda_gemm.cu: N = 3584 the 112x128 then 128x128
 * tiles, N = 4608 the 144x128 tile, split-K 1) -- the heuristic's first at these sizes were
 * 7-13 % slower on the H200.  Any order is exact: whichever candidate is taken was proven equal
 * to the reference on the probe; the order only decides which of the equal ones runs. */
static void iv_order(const cublasLtMatmulHeuristicResult_t *res, int found, int N, int Mb,
                     int prefer, int *ord) {
    static const int t3584[] = {CUBLASLT_MATMUL_TILE_112x128, CUBLASLT_MATMUL_TILE_128x128};
    static const int t4608[] = {CUBLASLT_MATMUL_TILE_144x128};
    const int *pt = NULL;
    int npt = 0, n = 0, used[IV_CANDIDATES] = {0};
    if (prefer && Mb >= 512 && N == 3584) pt = t3584, npt = 2;
    if (prefer && Mb >= 512 && N == 4608) pt = t4608, npt = 1;
    for (int j = 0; j < npt; j++)
        for (int i = 0; i < found; i++)
            if (!used[i] && lt_cfg(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID) == pt[j] &&
                lt_cfg(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) <= 1)
                used[i] = 1, ord[n++] = i;
    for (int i = 0; i < found; i++)
        if (!used[i]) ord[n++] = i;
}

/* The algorithm for row bucket b (rows in (2^(b-1), 2^b]): the first of cuBLASLt's candidates
 * at 2^b rows (as offered, or with the reference's split-K count and reduction) whose output
 * on a probe -- P random rows times the call's own weights -- is bit for bit the reference's;
 * else the reference.  Deterministic (no timing): every process picks the same.  Eager calls
 * only (it synchronises the stream); g_mu held. */
static void resolve_bucket(cublasLtHandle_t lt, iv_algo *al, int b, cudaStream_t st, void *ws,
                           size_t ws_bytes, const void *w) {
    int Mb = 1 << b, N = al->N, K = al->K, P = Mb < 128 ? Mb : 128;
    size_t es = al->out16 ? 2 : 4; /* bytes per output element */
    if ((size_t)N * P > (size_t)4 << 20) P = (int)(((size_t)4 << 20) / N) > 0 ? (int)(((size_t)4 << 20) / N) : 1;
    al->bstate[b] = 2;
    cublasLtMatrixLayout_t lb = NULL, lc = NULL;
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, Mb, K);
    cublasLtMatrixLayoutCreate(&lc, al->out16 ? CUDA_R_16BF : CUDA_R_32F, N, Mb, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                         sizeof ws_bytes);
    uint32_t mask = al->splitk ? (CUBLASLT_REDUCTION_SCHEME_NONE |
                                  CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                                  CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE)
                               : CUBLASLT_REDUCTION_SCHEME_NONE;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask,
                                         sizeof mask);
    cublasLtMatmulHeuristicResult_t res[IV_CANDIDATES];
    int found = 0;
    cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, al->op, al->a, lb, lc, lc, pref,
                                                       IV_CANDIDATES, res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    if (hs != CUBLAS_STATUS_SUCCESS) found = 0;
    bf16 *xp = NULL;
    void *y0 = NULL, *y1 = NULL, *h0 = malloc((size_t)P * N * es), *h1 = malloc((size_t)P * N * es);
    int tried = 0, pick = -1, variant = 0, ord[IV_CANDIDATES];
    iv_order(res, found, N, Mb, al->order && !al->out16, ord);
    if (!found || !h0 || !h1 || cudaMalloc((void **)&xp, (size_t)P * K * 2) != cudaSuccess ||
        cudaMalloc(&y0, (size_t)P * N * es) != cudaSuccess ||
        cudaMalloc(&y1, (size_t)P * N * es) != cudaSuccess)
        goto done;
    k_iv_fill<<<256, 256, 0, st>>>(xp, (size_t)P * K, 0x15u + (uint32_t)b);
    if (run_algo(lt, al, &al->algo, al->max_rows, ws, ws_bytes, st, y0, xp, w, P) ||
        cudaMemcpyAsync(h0, y0, (size_t)P * N * es, cudaMemcpyDeviceToHost, st) != cudaSuccess ||
        cudaStreamSynchronize(st) != cudaSuccess)
        goto done;
    {
        int rsplit = lt_cfg(&al->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
        int rred = lt_cfg(&al->algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
        for (int oi = 0; oi < found && pick < 0; oi++) {
            int i = ord[oi];
            for (int v = 0; v < 2 && pick < 0; v++) {
                cublasLtMatmulAlgo_t a = res[i].algo;
                int sp = lt_cfg(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
                if (v == 1) {
                    if (sp == rsplit) continue;
                    int32_t s32 = rsplit;
                    uint32_t r32 = (uint32_t)rred;
                    if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                             &s32, sizeof s32) ||
                        cublasLtMatmulAlgoConfigSetAttribute(
                            &a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &r32, sizeof r32))
                        continue;
                    sp = rsplit;
                }
                if (lt_cfg(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) ==
                    CUBLASLT_REDUCTION_SCHEME_INPLACE)
                    continue;
                if (!check_algo(lt, al, &a, P, ws_bytes) || !check_algo(lt, al, &a, 1, ws_bytes))
                    continue;
                tried++;
                al->bucket[b].algo = a;
                int mr = 1;
                while (mr < Mb && check_algo(lt, al, &a, mr * 2, ws_bytes))
                    mr *= 2;
                al->bucket[b].max_rows = mr;
                if (run_algo(lt, al, &al->bucket[b].algo, mr, ws, ws_bytes, st, y1, xp, w, P) ||
                    cudaMemcpyAsync(h1, y1, (size_t)P * N * es, cudaMemcpyDeviceToHost, st) !=
                        cudaSuccess ||
                    cudaStreamSynchronize(st) != cudaSuccess) {
                    cudaGetLastError();
                    continue;
                }
                if (!memcmp(h0, h1, (size_t)P * N * es)) pick = i, variant = v;
            }
        }
    }
    if (pick >= 0) al->bstate[b] = 1;
done:
    cudaGetLastError();
    if (iv_log()) {
        if (pick >= 0)
            fprintf(stderr,
                    "cuda: batch-invariant GEMM N=%d K=%d%s rows <= %d: candidate %d%s (tile %d "
                    "split-K %d) equals the reference bit for bit on a %d-row probe\n",
                    N, K, al->out16 ? " bf16 out" : "", Mb, pick, variant ? " with the reference's split-K" : "",
                    lt_cfg(&al->bucket[b].algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                    lt_cfg(&al->bucket[b].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), P);
        else
            fprintf(stderr,
                    "cuda: batch-invariant GEMM N=%d K=%d%s rows <= %d: the reference (%d "
                    "candidates tried, none equal on a %d-row probe)\n",
                    N, K, al->out16 ? " bf16 out" : "", Mb, tried, P);
    }
    if (xp) cudaFree(xp);
    if (y0) cudaFree(y0);
    if (y1) cudaFree(y1);
    free(h0), free(h1);
}

__global__ void k_iv_bias(float *y, const float *b, int N, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] += b[i % N];
}

static int iv_gemm(cublasLtHandle_t lt, int device, cudaStream_t st, void *ws, size_t ws_bytes,
                   const iv_policy *pol, void *y, int out16, const void *x, const void *w,
                   const float *bias, int T, int N, int K) {
    if (T <= 0) return 0;
    size_t es = out16 ? 2 : 4;
    pthread_mutex_lock(&g_mu);
    iv_algo *al = algo_get(lt, device, pol, N, K, out16, ws_bytes);
    pthread_mutex_unlock(&g_mu);
    if (!al || !al->ok) return -EIO;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(st, &cap);
    for (int r0 = 0; r0 < T; r0 += IV_MAX_ROWS) {
        int M = T - r0 < IV_MAX_ROWS ? T - r0 : IV_MAX_ROWS, bk = 0;
        while ((1 << bk) < M)
            bk++;
        pthread_mutex_lock(&g_mu);
        if (al->buckets && al->bstate[bk] == 0 && cap == cudaStreamCaptureStatusNone)
            resolve_bucket(lt, al, bk, st, ws, ws_bytes, w);
        const cublasLtMatmulAlgo_t *algo = &al->algo;
        int mr = al->max_rows;
        if (al->buckets && al->bstate[bk] == 1) algo = &al->bucket[bk].algo, mr = al->bucket[bk].max_rows;
        int rc = run_algo(lt, al, algo, mr, ws, ws_bytes, st, (char *)y + (size_t)r0 * N * es,
                          (const bf16 *)x + (size_t)r0 * K, w, M);
        pthread_mutex_unlock(&g_mu);
        if (rc) return rc;
    }
    if (bias) {
        size_t n = (size_t)T * N, g = (n + 255) / 256;
        k_iv_bias<<<(int)(g > 4096 ? 4096 : g), 256, 0, st>>>((float *)y, bias, N, n);
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "cuda: batch-invariant GEMM: %s\n", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}

int iv_matmul(cublasLtHandle_t lt, int device, cudaStream_t st, void *ws, size_t ws_bytes,
              const iv_policy *pol, float *y, const void *x, const void *w, const float *bias,
              int T, int N, int K) {
    return iv_gemm(lt, device, st, ws, ws_bytes, pol, y, 0, x, w, bias, T, N, K);
}

int iv_matmul_bf16out(cublasLtHandle_t lt, int device, cudaStream_t st, void *ws,
                      size_t ws_bytes, const iv_policy *pol, void *y, const void *x,
                      const void *w, int T, int N, int K) {
    return iv_gemm(lt, device, st, ws, ws_bytes, pol, y, 1, x, w, NULL, T, N, K);
}

/* ---- attention ------------------------------------------------------------------------- */

#define IV_PAD 8 /* bf16 elements of padding per shared-memory row (ldmatrix bank spread) */

/* K and V of keys k0 .. k0 + IV_BK - 1 (zero from kend on) into shared memory, bf16; the bf16
 * copies are issued (cp.async), not waited for */
template <int HD, typename KT, int NTH>
__device__ __forceinline__ void iv_load_issue(bf16 *Ks, bf16 *Vs, const KT *kv, const int32_t *bt,
                                              int k0, int kend, int bs, int n_layers, int kvd,
                                              int layer, int kvh) {
    constexpr int LD = HD + IV_PAD, C8 = HD / 8;
    for (int i = threadIdx.x; i < IV_BK * C8; i += NTH) {
        int r = i / C8, c8 = i % C8, j = k0 + r;
        bf16 *kd = Ks + r * LD + c8 * 8, *vd = Vs + r * LD + c8 * 8;
        if (j >= kend) {
            *(uint4 *)kd = make_uint4(0, 0, 0, 0);
            *(uint4 *)vd = make_uint4(0, 0, 0, 0);
            continue;
        }
        const KT *kp = kv + kv_off(bt, j, bs, n_layers, kvd, layer, 0) + (size_t)kvh * HD + c8 * 8;
        const KT *vp = kv + kv_off(bt, j, bs, n_layers, kvd, layer, 1) + (size_t)kvh * HD + c8 * 8;
        if constexpr (sizeof(KT) == 2) {
            cp_async16(kd, kp);
            cp_async16(vd, vp);
        } else {
            const float4 *k4 = (const float4 *)kp, *v4 = (const float4 *)vp;
            float4 a = k4[0], b = k4[1], c = v4[0], d = v4[1];
            *(uint4 *)kd = make_uint4(pack_bf2(a.x, a.y), pack_bf2(a.z, a.w), pack_bf2(b.x, b.y),
                                      pack_bf2(b.z, b.w));
            *(uint4 *)vd = make_uint4(pack_bf2(c.x, c.y), pack_bf2(c.z, c.w), pack_bf2(d.x, d.y),
                                      pack_bf2(d.z, d.w));
        }
    }
}
/* the same, waited for */
template <int HD, typename KT, int NTH>
__device__ __forceinline__ void iv_load(bf16 *Ks, bf16 *Vs, const KT *kv, const int32_t *bt,
                                        int k0, int kend, int bs, int n_layers, int kvd,
                                        int layer, int kvh) {
    iv_load_issue<HD, KT, NTH>(Ks, Vs, kv, bt, k0, kend, bs, n_layers, kvd, layer, kvh);
    cp_async_wait_all();
}

/* Q fragments of the warp's rows (row a: qrow0, row b: qrow1; NULL = padding), scaled and
 * rounded to bf16 */
template <int HD>
__device__ __forceinline__ void iv_load_q(uint32_t (&qa)[HD / 16][4], const float *q0,
                                          const float *q1, float scale) {
    int qd = threadIdx.x & 3;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        int c = kk * 16 + 2 * qd;
        float2 z = make_float2(0.f, 0.f);
        float2 x00 = q0 ? *(const float2 *)(q0 + c) : z, x10 = q1 ? *(const float2 *)(q1 + c) : z;
        float2 x01 = q0 ? *(const float2 *)(q0 + c + 8) : z;
        float2 x11 = q1 ? *(const float2 *)(q1 + c + 8) : z;
        qa[kk][0] = pack_bf2(__fmul_rn(x00.x, scale), __fmul_rn(x00.y, scale));
        qa[kk][1] = pack_bf2(__fmul_rn(x10.x, scale), __fmul_rn(x10.y, scale));
        qa[kk][2] = pack_bf2(__fmul_rn(x01.x, scale), __fmul_rn(x01.y, scale));
        qa[kk][3] = pack_bf2(__fmul_rn(x11.x, scale), __fmul_rn(x11.y, scale));
    }
}

/* One tile's partial for the warp's two rows per lane (positions qp0, qp1; -1 = none): the
 * row max m (-inf when every key is masked), l = sum of the bf16 weights, o = P V for the DW
 * head_dim tiles of 8 from tile dn0 on (all HD / 8 of them: dn0 = 0, DW = HD / 8; each output
 * column is its own accumulation, so a slice is bit for bit that part of the whole).  The one
 * place a tile's partial is computed, for every path. */
template <int HD, int DW = HD / 8>
__device__ __forceinline__ void iv_tile(const uint32_t (&qa)[HD / 16][4], const bf16 *Ks,
                                        const bf16 *Vs, int k0, int qp0, int qp1, float &m0,
                                        float &m1, float &l0, float &l1, float (&o)[DW][4],
                                        int dn0 = 0) {
    constexpr int LD = HD + IV_PAD, NT = IV_BK / 8, KS = HD / 16;
    static_assert(DW % 2 == 0 && DW <= HD / 8, "iv_tile: DW even, at most HD / 8");
    int lane = threadIdx.x & 31, qd = lane & 3;
    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KS; kk += 2) {
            uint32_t b[4];
            ldsm_x4(b, Ks + (n * 8 + (lane & 7)) * LD + kk * 16 + (lane >> 3) * 8);
            mma_bf16(s[n], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
            if (kk + 1 < KS)
                mma_bf16(s[n], qa[kk + 1][0], qa[kk + 1][1], qa[kk + 1][2], qa[kk + 1][3], b[2],
                         b[3]);
        }
    }
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        int j = k0 + n * 8 + 2 * qd;
        if (j > qp0) s[n][0] = -INFINITY;
        if (j + 1 > qp0) s[n][1] = -INFINITY;
        if (j > qp1) s[n][2] = -INFINITY;
        if (j + 1 > qp1) s[n][3] = -INFINITY;
        mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
        mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    float b0 = mx0 == -INFINITY ? 0.0f : mx0, b1 = mx1 == -INFINITY ? 0.0f : mx1;
    uint32_t pa[NT][2];
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        float e0 = __expf(__fsub_rn(s[n][0], b0)), e1 = __expf(__fsub_rn(s[n][1], b0));
        float e2 = __expf(__fsub_rn(s[n][2], b1)), e3 = __expf(__fsub_rn(s[n][3], b1));
        pa[n][0] = pack_bf2(e0, e1);
        pa[n][1] = pack_bf2(e2, e3);
        __nv_bfloat162 p01 = *(__nv_bfloat162 *)&pa[n][0], p23 = *(__nv_bfloat162 *)&pa[n][1];
        sum0 = __fadd_rn(sum0, __fadd_rn(__low2float(p01), __high2float(p01)));
        sum1 = __fadd_rn(sum1, __fadd_rn(__low2float(p23), __high2float(p23)));
    }
    sum0 = __fadd_rn(sum0, __shfl_xor_sync(0xffffffffu, sum0, 1));
    sum0 = __fadd_rn(sum0, __shfl_xor_sync(0xffffffffu, sum0, 2));
    sum1 = __fadd_rn(sum1, __shfl_xor_sync(0xffffffffu, sum1, 1));
    sum1 = __fadd_rn(sum1, __shfl_xor_sync(0xffffffffu, sum1, 2));
    m0 = mx0, m1 = mx1, l0 = sum0, l1 = sum1;
#pragma unroll
    for (int j = 0; j < DW; j++)
        o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < IV_BK / 16; kk++) {
        uint32_t a[4] = {pa[2 * kk][0], pa[2 * kk][1], pa[2 * kk + 1][0], pa[2 * kk + 1][1]};
#pragma unroll
        for (int j = 0; j < DW; j += 2) {
            uint32_t b[4];
            int m = lane >> 3, dn = dn0 + j;
            ldsm_x4_t(b, Vs + (kk * 16 + (m & 1) * 8 + (lane & 7)) * LD + dn * 8 + (m >> 1) * 8);
            mma_bf16(o[j], a[0], a[1], a[2], a[3], b[0], b[1]);
            mma_bf16(o[j + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }
    }
}

/* The fold of a tile's partial (ms, ls, os) into the running (M, L, O), in tile order: the
 * one formula both paths use, every op explicitly rounded (no contraction). */
__device__ __forceinline__ void iv_coef(float M, float ms, float &mn, float &a, float &b) {
    mn = fmaxf(M, ms);
    a = M == -INFINITY ? 0.0f : __expf(__fsub_rn(M, mn));
    b = ms == -INFINITY ? 0.0f : __expf(__fsub_rn(ms, mn));
}
__device__ __forceinline__ float iv_mix(float X, float a, float x, float b) {
    return __fmaf_rn(X, a, __fmul_rn(x, b));
}
__device__ __forceinline__ float iv_final(float O, float L) {
    return L > 0.0f ? __fdiv_rn(O, L) : 0.0f;
}

/* Prefill tiles: CTA = (tile of <= 64 tokens of one sequence, 64 of its token-major
 * (token, group head) rows, KV head), 4 warps of 16 rows sharing each K/V tile in shared
 * memory; every key tile up to the CTA's last position is folded in registers. */
template <int HD, typename KT>
__global__ void __launch_bounds__(128)
    k_iv_prefill(float *out, const float *q, const KT *kv, int bs, int n_layers, int layer,
                 const int32_t *tiles, const int32_t *pos, const int32_t *bts, int bt_stride,
                 int nh, int nkv, float scale) {
    constexpr int LD = HD + IV_PAD, DT = HD / 8;
    /* one array: head_dim 16's ldmatrix.x4 for S reads 16 columns past a row's end */
    __shared__ __align__(16) bf16 KVs[2 * IV_BK * LD + 16];
    bf16 *Ks = KVs, *Vs = KVs + IV_BK * LD;
    int tile = blockIdx.x, kvh = blockIdx.z, G = nh / nkv, kvd = nkv * HD;
    int t0 = tiles[3 * tile], ntok = tiles[3 * tile + 1], sq = tiles[3 * tile + 2];
    int rows = ntok * G, rb = blockIdx.y * 64;
    if (rb >= rows) return;
    const int32_t *bt = bts + (size_t)sq * bt_stride;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, qd = lane & 3;
    int wr = rb + warp * 16, r0 = wr + g, r1 = r0 + 8;
    int last = (rows < rb + 64 ? rows : rb + 64) - 1;
    int kend = pos[t0 + last / G] + 1;
    int wlast = (rows < wr + 16 ? rows : wr + 16) - 1;
    int wmax = wr < rows ? pos[t0 + wlast / G] : -1;
    int tk0 = t0 + r0 / G, tk1 = t0 + r1 / G, h0 = kvh * G + r0 % G, h1 = kvh * G + r1 % G;
    int qp0 = r0 < rows ? pos[tk0] : -1, qp1 = r1 < rows ? pos[tk1] : -1;
    uint32_t qa[HD / 16][4];
    iv_load_q<HD>(qa, r0 < rows ? q + (size_t)tk0 * nh * HD + (size_t)h0 * HD : NULL,
                  r1 < rows ? q + (size_t)tk1 * nh * HD + (size_t)h1 * HD : NULL, scale);
    float M0 = -INFINITY, M1 = -INFINITY, L0 = 0.0f, L1 = 0.0f, O[DT][4], os[DT][4];
#pragma unroll
    for (int dn = 0; dn < DT; dn++)
        O[dn][0] = O[dn][1] = O[dn][2] = O[dn][3] = 0.0f;
    for (int k0 = 0; k0 < kend; k0 += IV_BK) {
        iv_load<HD, KT, 128>(Ks, Vs, kv, bt, k0, kend, bs, n_layers, kvd, layer, kvh);
        __syncthreads();
        if (k0 <= wmax) {
            float ms0, ms1, ls0, ls1, mn0, mn1, a0, a1, b0, b1;
            iv_tile<HD>(qa, Ks, Vs, k0, qp0, qp1, ms0, ms1, ls0, ls1, os);
            iv_coef(M0, ms0, mn0, a0, b0);
            iv_coef(M1, ms1, mn1, a1, b1);
            L0 = iv_mix(L0, a0, ls0, b0);
            L1 = iv_mix(L1, a1, ls1, b1);
            M0 = mn0, M1 = mn1;
#pragma unroll
            for (int dn = 0; dn < DT; dn++) {
                O[dn][0] = iv_mix(O[dn][0], a0, os[dn][0], b0);
                O[dn][1] = iv_mix(O[dn][1], a0, os[dn][1], b0);
                O[dn][2] = iv_mix(O[dn][2], a1, os[dn][2], b1);
                O[dn][3] = iv_mix(O[dn][3], a1, os[dn][3], b1);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int dn = 0; dn < DT; dn++) {
        int d = dn * 8 + 2 * qd;
        if (r0 < rows) {
            float *p = out + (size_t)tk0 * nh * HD + (size_t)h0 * HD + d;
            p[0] = iv_final(O[dn][0], L0);
            p[1] = iv_final(O[dn][1], L0);
        }
        if (r1 < rows) {
            float *p = out + (size_t)tk1 * nh * HD + (size_t)h1 * HD + d;
            p[0] = iv_final(O[dn][2], L1);
            p[1] = iv_final(O[dn][3], L1);
        }
    }
}

/* Prefill tiles, the wider form (default; $DISAGG_CUDA_INV_PF_ROWS=64 for k_iv_prefill): CTA
 * = 16 * NW of a tile's token-major (token, group head) rows of one KV head, NW warps of 16
 * rows sharing each K/V tile, which is copied once per CTA (cp.async) into one of two
 * shared-memory stages while the other is computed.  Every warp runs the same iv_load_q,
 * iv_tile and fold as k_iv_prefill on the same rows (a warp's rows start at a multiple of 16
 * of the tile), so the bits are k_iv_prefill's: the CTA's wider key range only adds keys
 * past a row's position, which iv_tile masks (weight 0) as it masks the CTA's later rows'
 * keys in k_iv_prefill, and a tile past all of a warp's rows is skipped (its fold would be the
 * identity). */
template <int HD, typename KT, int NW>
__global__ void __launch_bounds__(NW * 32)
    k_iv_prefill2(float *out, const float *q, const KT *kv, int bs, int n_layers, int layer,
                  const int32_t *tiles, const int32_t *pos, const int32_t *bts, int bt_stride,
                  int nh, int nkv, float scale) {
    constexpr int LD = HD + IV_PAD, DT = HD / 8, ROWS = 16 * NW, STAGE = 2 * IV_BK * LD + 16;
    extern __shared__ __align__(16) bf16 iv_psm[];
    int tile = blockIdx.x, kvh = blockIdx.z, G = nh / nkv, kvd = nkv * HD;
    int t0 = tiles[3 * tile], ntok = tiles[3 * tile + 1], sq = tiles[3 * tile + 2];
    int rows = ntok * G, rb = blockIdx.y * ROWS;
    if (rb >= rows) return;
    const int32_t *bt = bts + (size_t)sq * bt_stride;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, qd = lane & 3;
    int wr = rb + warp * 16, r0 = wr + g, r1 = r0 + 8;
    int last = (rows < rb + ROWS ? rows : rb + ROWS) - 1;
    int kend = pos[t0 + last / G] + 1;
    int wlast = (rows < wr + 16 ? rows : wr + 16) - 1;
    int wmax = wr < rows ? pos[t0 + wlast / G] : -1;
    int tk0 = t0 + r0 / G, tk1 = t0 + r1 / G, h0 = kvh * G + r0 % G, h1 = kvh * G + r1 % G;
    int qp0 = r0 < rows ? pos[tk0] : -1, qp1 = r1 < rows ? pos[tk1] : -1;
    uint32_t qa[HD / 16][4];
    iv_load_q<HD>(qa, r0 < rows ? q + (size_t)tk0 * nh * HD + (size_t)h0 * HD : NULL,
                  r1 < rows ? q + (size_t)tk1 * nh * HD + (size_t)h1 * HD : NULL, scale);
    float M0 = -INFINITY, M1 = -INFINITY, L0 = 0.0f, L1 = 0.0f, O[DT][4], os[DT][4];
#pragma unroll
    for (int dn = 0; dn < DT; dn++)
        O[dn][0] = O[dn][1] = O[dn][2] = O[dn][3] = 0.0f;
    iv_load_issue<HD, KT, NW * 32>(iv_psm, iv_psm + IV_BK * LD, kv, bt, 0, kend, bs, n_layers,
                                   kvd, layer, kvh);
    cp_async_commit();
    for (int k0 = 0, st = 0; k0 < kend; k0 += IV_BK, st ^= 1) {
        bf16 *Ks = iv_psm + st * STAGE, *Vs = Ks + IV_BK * LD;
        if (k0 + IV_BK < kend) {
            bf16 *Kn = iv_psm + (st ^ 1) * STAGE;
            iv_load_issue<HD, KT, NW * 32>(Kn, Kn + IV_BK * LD, kv, bt, k0 + IV_BK, kend, bs,
                                           n_layers, kvd, layer, kvh);
            cp_async_commit();
            cp_async_wait_group<1>();
        } else {
            cp_async_wait_group<0>();
        }
        __syncthreads();
        if (k0 <= wmax) {
            float ms0, ms1, ls0, ls1, mn0, mn1, a0, a1, b0, b1;
            iv_tile<HD>(qa, Ks, Vs, k0, qp0, qp1, ms0, ms1, ls0, ls1, os);
            iv_coef(M0, ms0, mn0, a0, b0);
            iv_coef(M1, ms1, mn1, a1, b1);
            L0 = iv_mix(L0, a0, ls0, b0);
            L1 = iv_mix(L1, a1, ls1, b1);
            M0 = mn0, M1 = mn1;
#pragma unroll
            for (int dn = 0; dn < DT; dn++) {
                O[dn][0] = iv_mix(O[dn][0], a0, os[dn][0], b0);
                O[dn][1] = iv_mix(O[dn][1], a0, os[dn][1], b0);
                O[dn][2] = iv_mix(O[dn][2], a1, os[dn][2], b1);
                O[dn][3] = iv_mix(O[dn][3], a1, os[dn][3], b1);
            }
        }
        __syncthreads(); /* the stage is refilled next */
    }
#pragma unroll
    for (int dn = 0; dn < DT; dn++) {
        int d = dn * 8 + 2 * qd;
        if (r0 < rows) {
            float *p = out + (size_t)tk0 * nh * HD + (size_t)h0 * HD + d;
            p[0] = iv_final(O[dn][0], L0);
            p[1] = iv_final(O[dn][1], L0);
        }
        if (r1 < rows) {
            float *p = out + (size_t)tk1 * nh * HD + (size_t)h1 * HD + d;
            p[0] = iv_final(O[dn][2], L1);
            p[1] = iv_final(O[dn][3], L1);
        }
    }
}

/* rows per prefill CTA: $DISAGG_CUDA_INV_PF_ROWS = 64 (k_iv_prefill) or 128 (default,
 * k_iv_prefill2 with 8 warps); the same bits by construction (the same per-row arithmetic;
 * test_cuda_invariant checks schedules within one setting, not the two against each other) */
static int iv_pf_rows(void) {
    static int v;
    if (!v) {
        const char *e = getenv("DISAGG_CUDA_INV_PF_ROWS");
        int r = e ? atoi(e) : 128;
        v = r == 64 ? 64 : 128;
    }
    return v;
}

template <int HD, typename KT, int NW>
static void iv_prefill2_launch(cudaStream_t st, float *out, const float *q, const KT *kv, int bs,
                               int n_layers, int layer, const int32_t *tiles, int n_tiles,
                               const int32_t *pos, const int32_t *bts, int bt_stride, int nh,
                               int nkv, float scale) {
    int G = nh / nkv;
    size_t smem = (size_t)2 * (2 * IV_BK * (HD + IV_PAD) + 16) * sizeof(bf16);
    static int attr_done; /* per instantiation */
    if (!attr_done) {
        cudaFuncSetAttribute(k_iv_prefill2<HD, KT, NW>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        attr_done = 1;
    }
    dim3 grid(n_tiles, (64 * G + 16 * NW - 1) / (16 * NW), nkv); /* tiles of <= 64 tokens */
    k_iv_prefill2<HD, KT, NW><<<grid, NW * 32, smem, st>>>(out, q, kv, bs, n_layers, layer, tiles,
                                                          pos, bts, bt_stride, nh, nkv, scale);
}

/* The other tokens: CTA = one warp = (token, 16 of its group's heads, KV head, key tile):
 * the tile's partial to part[((ti * nh + head) * nkt + kt) * (HD + 2)] (o, then m, l). */
template <int HD, typename KT>
__global__ void __launch_bounds__(32)
    k_iv_part(float *part, const float *q, const KT *kv, int bs, int n_layers, int layer,
              const int32_t *rest, const int32_t *pos, const int32_t *seq, const int32_t *bts,
              int bt_stride, int nh, int nkv, int nkt, float scale) {
    constexpr int LD = HD + IV_PAD, DT = HD / 8;
    /* one array: head_dim 16's ldmatrix.x4 for S reads 16 columns past a row's end */
    __shared__ __align__(16) bf16 KVs[2 * IV_BK * LD + 16];
    bf16 *Ks = KVs, *Vs = KVs + IV_BK * LD;
    int ti = blockIdx.x, kvh = blockIdx.z / nkt, kt = blockIdx.z % nkt;
    int t = rest[ti], p = pos[t], k0 = kt * IV_BK;
    if (p < k0) return; /* also padding rows (p = -1) */
    int G = nh / nkv, kvd = nkv * HD, lane = threadIdx.x, g = lane >> 2, qd = lane & 3;
    int r0 = blockIdx.y * 16 + g, r1 = r0 + 8, h0 = kvh * G + r0, h1 = kvh * G + r1;
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    uint32_t qa[HD / 16][4];
    iv_load_q<HD>(qa, r0 < G ? q + (size_t)t * nh * HD + (size_t)h0 * HD : NULL,
                  r1 < G ? q + (size_t)t * nh * HD + (size_t)h1 * HD : NULL, scale);
    iv_load<HD, KT, 32>(Ks, Vs, kv, bt, k0, p + 1, bs, n_layers, kvd, layer, kvh);
    __syncwarp();
    float ms0, ms1, ls0, ls1, os[DT][4];
    iv_tile<HD>(qa, Ks, Vs, k0, r0 < G ? p : -1, r1 < G ? p : -1, ms0, ms1, ls0, ls1, os);
    const size_t W = HD + 2;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int r = half ? r1 : r0, h = half ? h1 : h0;
        if (r >= G) continue;
        float *dst = part + (((size_t)ti * nh + h) * nkt + kt) * W;
#pragma unroll
        for (int dn = 0; dn < DT; dn++) {
            int d = dn * 8 + 2 * qd;
            dst[d] = os[dn][half * 2];
            dst[d + 1] = os[dn][half * 2 + 1];
        }
        if (qd == 0) {
            dst[HD] = half ? ms1 : ms0;
            dst[HD + 1] = half ? ls1 : ls0;
        }
    }
}

/* The other tokens, 4 warps a CTA: CTA = (token, 16 of its group's heads, KV head, split of
 * tps consecutive key tiles).  The 128 threads copy each tile's K/V once (cp.async, the next
 * tile's copy in flight while this one is computed); every warp computes the tile's S, max
 * and sum for its rows (the same code and operands as k_iv_part and the prefill kernel, so
 * the same bits), and the P V of a quarter of head_dim.  The partials go to the same place
 * as k_iv_part's, tile by tile: how many tiles a CTA takes (tps) changes no bit.  head_dim
 * 64 and 128. */
#define IV_DEC_WARPS 4
template <int HD, typename KT>
__global__ void __launch_bounds__(IV_DEC_WARPS * 32)
    k_iv_dec(float *part, const float *q, const KT *kv, int bs, int n_layers, int layer,
             const int32_t *rest, const int32_t *pos, const int32_t *seq, const int32_t *bts,
             int bt_stride, int nh, int nkv, int nkt, int tps, int nsp, float scale) {
    constexpr int LD = HD + IV_PAD, DW = HD / 8 / IV_DEC_WARPS, STAGE = 2 * IV_BK * LD;
    static_assert(DW >= 2, "k_iv_dec: head_dim 64 or 128");
    extern __shared__ __align__(16) bf16 iv_dsm[];
    int ti = blockIdx.x, kvh = blockIdx.z / nsp, sp = blockIdx.z % nsp;
    int t = rest[ti], p = pos[t], kt0 = sp * tps;
    if (p < kt0 * IV_BK) return; /* also padding rows (p = -1) */
    int kt1 = min(kt0 + tps, p / IV_BK + 1);
    int G = nh / nkv, kvd = nkv * HD, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, qd = lane & 3;
    int r0 = blockIdx.y * 16 + g, r1 = r0 + 8, h0 = kvh * G + r0, h1 = kvh * G + r1;
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    uint32_t qa[HD / 16][4];
    iv_load_q<HD>(qa, r0 < G ? q + (size_t)t * nh * HD + (size_t)h0 * HD : NULL,
                  r1 < G ? q + (size_t)t * nh * HD + (size_t)h1 * HD : NULL, scale);
    iv_load_issue<HD, KT, IV_DEC_WARPS * 32>(iv_dsm, iv_dsm + IV_BK * LD, kv, bt, kt0 * IV_BK,
                                             p + 1, bs, n_layers, kvd, layer, kvh);
    cp_async_commit();
    const size_t W = HD + 2;
    for (int kt = kt0; kt < kt1; kt++) {
        bf16 *Ks = iv_dsm + ((kt - kt0) & 1) * STAGE, *Vs = Ks + IV_BK * LD;
        if (kt + 1 < kt1) {
            bf16 *Kn = iv_dsm + ((kt - kt0 + 1) & 1) * STAGE;
            iv_load_issue<HD, KT, IV_DEC_WARPS * 32>(Kn, Kn + IV_BK * LD, kv, bt,
                                                     (kt + 1) * IV_BK, p + 1, bs, n_layers,
                                                     kvd, layer, kvh);
            cp_async_commit();
            cp_async_wait_group<1>();
        } else {
            cp_async_wait_group<0>();
        }
        __syncthreads();
        float ms0, ms1, ls0, ls1, os[DW][4];
        iv_tile<HD, DW>(qa, Ks, Vs, kt * IV_BK, r0 < G ? p : -1, r1 < G ? p : -1, ms0, ms1, ls0,
                        ls1, os, w * DW);
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int r = half ? r1 : r0, h = half ? h1 : h0;
            if (r >= G) continue;
            float *dst = part + (((size_t)ti * nh + h) * nkt + kt) * W;
#pragma unroll
            for (int j = 0; j < DW; j++) {
                int d = (w * DW + j) * 8 + 2 * qd;
                *(float2 *)(dst + d) = make_float2(os[j][half * 2], os[j][half * 2 + 1]);
            }
            if (w == 0 && qd == 0) *(float2 *)(dst + HD) = half ? make_float2(ms1, ls1)
                                                                : make_float2(ms0, ls0);
        }
        __syncthreads(); /* the stage is refilled next */
    }
}

/* folds the tiles 0 .. pos / IV_BK of each (token, head) in order */
template <int HD>
__global__ void k_iv_combine(float *out, const float *part, const int32_t *rest,
                             const int32_t *pos, int nh, int nkt) {
    int th = blockIdx.x, ti = th / nh, h = th % nh, d = threadIdx.x;
    if (d >= HD) return;
    int t = rest[ti], p = pos[t];
    int n = p < 0 ? 0 : p / IV_BK + 1;
    const size_t W = HD + 2;
    const float *src = part + ((size_t)ti * nh + h) * nkt * W;
    float M = -INFINITY, L = 0.0f, O = 0.0f;
    /* 8 tiles' loads in flight at a time; the fold itself strictly in tile order */
    for (int k0 = 0; k0 < n; k0 += 8) {
        float pm[8], pl[8], po[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const float *pp = src + (size_t)(k0 + u < n ? k0 + u : k0) * W;
            pm[u] = pp[HD], pl[u] = pp[HD + 1], po[u] = pp[d];
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            if (k0 + u >= n) break;
            float mn, a, b;
            iv_coef(M, pm[u], mn, a, b);
            L = iv_mix(L, a, pl[u], b);
            O = iv_mix(O, a, po[u], b);
            M = mn;
        }
    }
    out[(size_t)t * nh * HD + (size_t)h * HD + d] = iv_final(O, L);
}

void iv_scratch_free(iv_scratch *sc) {
    if (sc->part) cudaFree(sc->part);
    sc->part = NULL;
    sc->cap = 0;
}

/* Key tiles per CTA of the decode kernel k_iv_dec (0: the one-warp k_iv_part): a function
 * of the grid's shape only -- every choice computes the same partials, bit for bit.
 * $DISAGG_CUDA_INV_ATT=N forces N (0: k_iv_part; 1, 2, 4, 8, 16); default: the most tiles
 * per CTA (at most 8) that still leave >= 1024 CTAs. */
static int iv_dec_tps(int n_rest, int heads_kv, int nkt, int hd) {
    if (hd != 64 && hd != 128) return 0;
    const char *e = getenv("DISAGG_CUDA_INV_ATT");
    if (e && *e) {
        int v = atoi(e);
        if (v == 0 || v == 1 || v == 2 || v == 4 || v == 8 || v == 16) return v;
    }
    long base = (long)n_rest * heads_kv;
    int tps = 1;
    while (tps < 8 && base * ((nkt + 2 * tps - 1) / (2 * tps)) >= 1024)
        tps *= 2;
    return tps;
}

template <int HD, typename KT>
static int iv_launch(cudaStream_t st, iv_scratch *sc, float *out, const float *q, const KT *kv,
                     int bs, int n_layers, int layer, const int32_t *pos, const int32_t *seq,
                     const int32_t *bts, int bt_stride, const int32_t *tiles, int n_tiles,
                     const int32_t *rest, int n_rest, int nkt, int nh, int nkv, float scale) {
    int G = nh / nkv;
    if (n_tiles > 0 && iv_pf_rows() == 64) {
        dim3 grid(n_tiles, G, nkv); /* 64 tokens x G rows per tile, 64 rows per CTA */
        k_iv_prefill<HD, KT><<<grid, 128, 0, st>>>(out, q, kv, bs, n_layers, layer, tiles, pos,
                                                   bts, bt_stride, nh, nkv, scale);
    } else if (n_tiles > 0) {
        iv_prefill2_launch<HD, KT, 8>(st, out, q, kv, bs, n_layers, layer, tiles, n_tiles, pos,
                                      bts, bt_stride, nh, nkv, scale);
    }
    if (n_rest > 0) {
        int tps = iv_dec_tps(n_rest, (G + 15) / 16 * nkv, nkt, HD); /* 0 unless HD 64/128 */
        if constexpr (HD >= 64) {
            if (tps > 0) {
                int nsp = (nkt + tps - 1) / tps;
                size_t stage = (size_t)2 * IV_BK * (HD + IV_PAD) * sizeof(bf16);
                static int attr_done; /* per instantiation */
                if (!attr_done) {
                    cudaFuncSetAttribute(k_iv_dec<HD, KT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)(2 * stage));
                    attr_done = 1;
                }
                dim3 grid(n_rest, (G + 15) / 16, nkv * nsp);
                k_iv_dec<HD, KT><<<grid, IV_DEC_WARPS * 32, (tps > 1 ? 2 : 1) * stage, st>>>(
                    sc->part, q, kv, bs, n_layers, layer, rest, pos, seq, bts, bt_stride, nh,
                    nkv, nkt, tps, nsp, scale);
            }
        }
        if (tps == 0) {
            dim3 grid(n_rest, (G + 15) / 16, nkv * nkt);
            k_iv_part<HD, KT><<<grid, 32, 0, st>>>(sc->part, q, kv, bs, n_layers, layer, rest,
                                                   pos, seq, bts, bt_stride, nh, nkv, nkt, scale);
        }
        k_iv_combine<HD><<<n_rest * nh, HD < 32 ? 32 : HD, 0, st>>>(out, sc->part, rest, pos, nh,
                                                                   nkt);
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "cuda: batch-invariant attention failed to launch: %s\n",
                cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}

int iv_attention(cudaStream_t st, iv_scratch *sc, unsigned *gen, int capturing, float *out,
                 const float *q, const void *kv_base, int kv_bf16, int bs, int n_layers,
                 int layer, const int32_t *pos, const int32_t *seq, const int32_t *bts,
                 int bt_stride, const int32_t *tiles, int n_tiles, const int32_t *rest,
                 int n_rest, int ctx, int nh, int nkv, int hd, float scale) {
    if (nkv <= 0 || nh % nkv || (hd != 16 && hd != 32 && hd != 64 && hd != 128)) {
        fprintf(stderr,
                "cuda: batch-invariant attention with %d query heads, %d KV heads, head_dim %d "
                "is not supported; accepted: query heads a multiple of KV heads, head_dim 16, "
                "32, 64 or 128\n",
                nh, nkv, hd);
        return -ENOTSUP;
    }
    int nkt = ctx > 0 ? (ctx + IV_BK - 1) / IV_BK : 1;
    if (n_rest > 0) {
        size_t need = (size_t)n_rest * nh * nkt * (hd + 2);
        if (need > sc->cap) {
            if (capturing) return -EINVAL; /* the graph's warm-up grew it */
            iv_scratch_free(sc);
            (*gen)++;
            if (cudaMalloc((void **)&sc->part, need * 4) != cudaSuccess) {
                cudaGetLastError();
                fprintf(stderr, "cuda: batch-invariant attention: out of GPU memory (%.1f MB)\n",
                        need * 4 / 1e6);
                return -ENOMEM;
            }
            sc->cap = need;
        }
    }
#define IVL(H, KT)                                                                              \
    iv_launch<H, KT>(st, sc, out, q, (const KT *)kv_base, bs, n_layers, layer, pos, seq, bts,   \
                     bt_stride, tiles, n_tiles, rest, n_rest, nkt, nh, nkv, scale)
    if (kv_bf16)
        return hd == 16 ? IVL(16, bf16) : hd == 32 ? IVL(32, bf16) : hd == 64 ? IVL(64, bf16)
                                                                              : IVL(128, bf16);
    return hd == 16 ? IVL(16, float) : hd == 32 ? IVL(32, float) : hd == 64 ? IVL(64, float)
                                                                            : IVL(128, float);
#undef IVL
}
