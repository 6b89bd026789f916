/*
 * cuda_gemm_fp8 — FP8 tensor-core GEMMs for prefill-sized batches of block-quantized FP8
 * weights (W8A8 block FP8, as vLLM runs DeepSeek-style checkpoints on Hopper: the weights e4m3
 * in 128 x 128 blocks with their checkpoint scales, the activations quantized to e4m3 on the fly
 * in groups of 128 columns):
 *
 *   fp8_act_quant_g128  x (T, K) bf16 -> xq (T, K) e4m3 and sx (T x K / 128) f32: sx = amax /
 *                  448 of each 128-column group of a token (1 for an all-zero group), xq =
 *                  e4m3(x * (1 / sx)), round to nearest even, saturating.
 *   fp8_gemm       y (T, N) = sum over groups g of sx[t][g] sw[n / 128][g] sum_k xq[t][k] wq[n][k]
 *                  through cuBLASLt's e4m3 GEMM with CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
 *                  on A (the weights' scales as stored: a row block's K / 128 scales
 *                  contiguous) and _VEC128_32F on B (cuBLAS 12.9+, sm_90 only), f32
 *                  accumulate; out f32 (beta 0 or 1: += onto y, the residual) or bf16.
 *                  The scales' layouts are the ones PyTorch's _scaled_mm checks before it
 *                  hands the same cuBLASLt these modes ("block1x128_block128x128"): the
 *                  activations' scales outer-dimension-contiguous (sx[g * T + t], stride T),
 *                  the 128 x 128 blocks' with a row block's K blocks contiguous at a stride of
 *                  round_up(K / 128, 4) -- ours are stored at stride K / 128, so the GEMM
 *                  takes K a multiple of 512 (every hidden and intermediate size of the
 *                  families served) and leaves other K to the bf16 twin.  (The H200 run of
 *                  3 December had a token's groups contiguous and its test shapes K / 128 = 3
 *                  and 6: wrong; PyTorch's layout is what this follows now.)
 *
 * (An outer-vector form -- one scale a weight row, x quantized a token -- was removed: its rows
 * came out wrong on the H200.)  A shape cuBLASLt has no algorithm for (or a cuBLASLt without
 * these scale modes) returns -ENOTSUP once and is remembered; the caller then runs the bf16
 * twin.
 */
#include "kernels/cuda/cuda_common.cuh"

#define AQ_THREADS 256

/* one CTA a token row, a thread a uint4 (8 values) at a time, 16 threads a 128-column group
 * (their amax by half-warp shuffles; every thread of the CTA runs every pass, past K with
 * zeros, so the shuffles' full mask holds); K % 128 == 0, x 16-byte aligned; the scales
 * tokens-contiguous: sx[g * T + t] */
__global__ void __launch_bounds__(AQ_THREADS)
    k_act_quant_g128(uint8_t *__restrict__ q, float *__restrict__ sx, const uint4 *__restrict__ x,
                     int K8, int T) {
    int t = blockIdx.x;
    const uint4 *xr = x + (size_t)t * K8;
    uint2 *qr = (uint2 *)(q + (size_t)t * K8 * 8);
    for (int base = 0; base < K8; base += AQ_THREADS) {
        int i = base + threadIdx.x, in = i < K8; /* K8 % 16 == 0: a group is all in or all out */
        uint4 v = in ? xr[i] : make_uint4(0, 0, 0, 0);
        uint32_t w[4] = {v.x, v.y, v.z, v.w}, o[2] = {0, 0};
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++)
            m = fmaxf(m, fmaxf(fabsf(__uint_as_float(w[j] << 16)),
                               fabsf(__uint_as_float(w[j] & 0xffff0000u))));
#pragma unroll
        for (int off = 8; off > 0; off >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off, 16));
        if (!in) continue;
        float sc = m > 0.0f ? m / 448.0f : 1.0f, inv = 1.0f / sc;
        int g = i >> 4;
        if ((i & 15) == 0) sx[(size_t)g * T + t] = sc;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float2 f = make_float2(__uint_as_float(w[j] << 16) * inv,
                                   __uint_as_float(w[j] & 0xffff0000u) * inv);
            uint32_t b = __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3);
            o[j >> 1] |= b << (16 * (j & 1));
        }
        qr[i] = make_uint2(o[0], o[1]);
    }
}

int fp8_act_quant_g128(dcu_ctx *c, uint8_t *q, float *sx, const void *x, int T, int K) {
    if (T <= 0) return 0;
    if (K % 128 || ((uintptr_t)x & 15) || ((uintptr_t)q & 7)) return -EINVAL;
    /* AQ_THREADS is a multiple of 16: a group never straddles two passes of the loop */
    k_act_quant_g128<<<T, AQ_THREADS, 0, c->stream>>>(q, sx, (const uint4 *)x, K / 8, T);
    return launch_check("fp8 act_quant (128-column groups)");
}

/* plans: (T, N, K, out kind); a shape without an algorithm is kept as a refusal (valid 2) */
typedef struct {
    int T, N, K, kind, valid; /* kind 0: f32 out, 1: f32 += (beta 1), 2: bf16 out */
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
} f8_plan;
#define F8_PLANS 64
static f8_plan g_f8_plans[F8_PLANS];
static int g_f8_next;
static pthread_mutex_t g_f8_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_f8_said;

static void f8_plan_clear(f8_plan *p) {
    if (p->valid == 1) {
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->c);
    }
    p->valid = 0;
}

/* the plan of a shape (NULL: none; cuBLASLt refused it).  Plans are per process: cuBLASLt
 * handles of one device share them (descriptors are handle-independent; the algorithm was
 * found on that device kind) */
static f8_plan *f8_plan_get(dcu_ctx *c, int T, int N, int K, int kind, const float *sw,
                            const float *sx) {
    for (int i = 0; i < F8_PLANS; i++) {
        f8_plan *p = &g_f8_plans[i];
        if (p->valid && p->T == T && p->N == N && p->K == K && p->kind == kind)
            return p->valid == 1 ? p : NULL;
    }
    f8_plan *p = &g_f8_plans[g_f8_next];
    g_f8_next = (g_f8_next + 1) % F8_PLANS;
    f8_plan_clear(p);
    p->T = T, p->N = N, p->K = K, p->kind = kind;
    cublasStatus_t s = cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s == CUBLAS_STATUS_SUCCESS) {
        cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        int32_t ma = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
        s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma,
                                           sizeof ma);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb,
                                               sizeof mb);
        /* the scales' pointers before the heuristic query: with them unset (NULL) the H200
         * run of 3 December refused every shape (status 7, invalid value) */
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw,
                                               sizeof sw);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx,
                                               sizeof sx);
        if (s != CUBLAS_STATUS_SUCCESS) cublasLtMatmulDescDestroy(p->op);
    }
    if (s != CUBLAS_STATUS_SUCCESS) {
        p->valid = 2;
        return NULL;
    }
    cudaDataType_t ct = kind == 2 ? CUDA_R_16BF : CUDA_R_32F;
    cublasLtMatrixLayoutCreate(&p->a, CUDA_R_8F_E4M3, K, N, K);
    cublasLtMatrixLayoutCreate(&p->b, CUDA_R_8F_E4M3, K, T, K);
    cublasLtMatrixLayoutCreate(&p->c, ct, N, T, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                         &c->ws_bytes, sizeof c->ws_bytes);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    s = cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &res,
                                       &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
        if (!g_f8_said++)
            fprintf(stderr,
                    "cuda: cuBLASLt has no e4m3 GEMM with 128x128 block / 128-column group "
                    "scales for T=%d N=%d K=%d (status %d): FP8 weights of such shapes run the "
                    "bf16 twin\n",
                    T, N, K, (int)s);
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->c);
        p->valid = 2;
        return NULL;
    }
    p->algo = res.algo;
    p->valid = 1;
    return p;
}

/* cuBLASLt's FP8 rules: N a multiple of 16, 16-byte aligned operands; K a multiple of 512:
 * the block scales' row stride K / 128 must be the padded round_up(K / 128, 4) (above) */
int fp8_gemm_ok(int T, int N, int K) {
    return T > 0 && N % 16 == 0 && K % 512 == 0;
}

int fp8_gemm(dcu_ctx *c, void *y, int kind, const uint8_t *xq, const float *sx, const void *w,
             const float *sw, int T, int N, int K) {
    if (T <= 0) return 0;
    if (!fp8_gemm_ok(T, N, K) || kind < 0 || kind > 2) return -ENOTSUP;
    pthread_mutex_lock(&g_f8_mu);
    f8_plan *p = f8_plan_get(c, T, N, K, kind, sw, sx);
    cublasStatus_t s = CUBLAS_STATUS_NOT_SUPPORTED;
    if (p) {
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw,
                                       sizeof sw);
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx,
                                       sizeof sx);
        float alpha = 1.0f, beta = kind == 1 ? 1.0f : 0.0f;
        s = cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, xq, p->b, &beta, y, p->c, y, p->c,
                           &p->algo, c->ws, c->ws_bytes, c->stream);
    }
    pthread_mutex_unlock(&g_f8_mu);
    if (!p) return -ENOTSUP;
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuda: cublasLtMatmul (e4m3, block scales) T=%d N=%d K=%d failed (status %d)\n",
                T, N, K, (int)s);
        return -EIO;
    }
    return 0;
}
