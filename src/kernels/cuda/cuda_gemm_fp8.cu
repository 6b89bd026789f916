/*
 * cuda_gemm_fp8 — FP8 tensor-core GEMMs for prefill-sized batches of FP8 weights (W8A8, as
 * vLLM's FP8 on Hopper: weights e4m3 with their checkpoint scales, activations quantized to
 * e4m3 per token on the fly):
 *
 *   fp8_act_quant  x (T, K) bf16 -> xq (T, K) e4m3 and sx (T) f32: sx[t] = amax(x[t]) / 448
 *                  (1 for an all-zero row), xq = e4m3(x * (1 / sx[t])), round to nearest even,
 *                  saturating.
 *   fp8_gemm       y (T, N) = sum_k xq[t][k] wq[n][k] * sx[t] * sw[n] through cuBLASLt's e4m3
 *                  GEMM with outer-vector scales (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F on
 *                  A and B), f32 accumulate; out f32 (beta 0 or 1: += onto y, the residual) or
 *                  bf16.  sw is one scale a weight row: FP8 weights whose scale blocks span the
 *                  row (per tensor, per channel).
 *   fp8_act_quant_g128 / fp8_gemm with block = 1: DeepSeek-style block FP8 (the checkpoints'
 *                  weight_block_size [128, 128], vLLM's W8A8 block FP8 on Hopper): x quantized
 *                  to e4m3 in groups of 128 columns a token (sx[t][g] = amax / 448 of the
 *                  group), the weights' 128 x 128 block scales as stored (row block major), and
 *                  cuBLASLt's e4m3 GEMM with CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F on A
 *                  (the weights) and _VEC128_32F on B (the activations; cuBLAS 12.9+, sm_90).
 *                  The activation scales' layout follows B's storage (K x T column-major: a
 *                  token's groups contiguous, sx[t * KB + g]); DISAGG_CUDA_FP8_BLOCK_SX=t puts
 *                  the tokens contiguous instead (sx[g * T + t]), the other reading of the
 *                  documentation, for the GPU tests to tell which cuBLASLt takes.
 *
 * A shape cuBLASLt has no algorithm for (or a cuBLASLt without these scale modes) returns
 * -ENOTSUP once and is remembered; the caller then runs the bf16 twin, as before this file.
 */
#include "kernels/cuda/cuda_common.cuh"

#define AQ_THREADS 256

/* one CTA a token row; K % 8 == 0, x 16-byte aligned */
__global__ void __launch_bounds__(AQ_THREADS)
    k_act_quant(uint8_t *__restrict__ q, float *__restrict__ sx, const uint4 *__restrict__ x,
                int K8) {
    __shared__ float red[AQ_THREADS / 32];
    int t = blockIdx.x;
    const uint4 *xr = x + (size_t)t * K8;
    float m = 0.0f;
    for (int i = threadIdx.x; i < K8; i += AQ_THREADS) {
        uint4 v = xr[i];
        uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++)
            m = fmaxf(m, fmaxf(fabsf(__uint_as_float(w[j] << 16)),
                               fabsf(__uint_as_float(w[j] & 0xffff0000u))));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = 0.0f;
#pragma unroll
    for (int i = 0; i < AQ_THREADS / 32; i++)
        m = fmaxf(m, red[i]);
    float s = m > 0.0f ? m / 448.0f : 1.0f, inv = 1.0f / s;
    if (threadIdx.x == 0) sx[t] = s;
    uint2 *qr = (uint2 *)(q + (size_t)t * K8 * 8);
    for (int i = threadIdx.x; i < K8; i += AQ_THREADS) {
        uint4 v = xr[i];
        uint32_t w[4] = {v.x, v.y, v.z, v.w}, o[2] = {0, 0};
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

int fp8_act_quant(dcu_ctx *c, uint8_t *q, float *sx, const void *x, int T, int K) {
    if (T <= 0) return 0;
    if (K % 8 || ((uintptr_t)x & 15) || ((uintptr_t)q & 7)) return -EINVAL;
    k_act_quant<<<T, AQ_THREADS, 0, c->stream>>>(q, sx, (const uint4 *)x, K / 8);
    return launch_check("fp8 act_quant");
}

/* one CTA a token row, a thread a uint4 (8 values) at a time, 16 threads a 128-column group
 * (their amax by half-warp shuffles); K % 128 == 0, x 16-byte aligned.  t_major: sx[g * T + t]
 * (DISAGG_CUDA_FP8_BLOCK_SX=t), else sx[t * KB + g] */
__global__ void __launch_bounds__(AQ_THREADS)
    k_act_quant_g128(uint8_t *__restrict__ q, float *__restrict__ sx, const uint4 *__restrict__ x,
                     int K8, int T, int t_major) {
    int t = blockIdx.x, KB = K8 / 16;
    const uint4 *xr = x + (size_t)t * K8;
    uint2 *qr = (uint2 *)(q + (size_t)t * K8 * 8);
    for (int i = threadIdx.x; i < K8; i += AQ_THREADS) { /* K8 % 16 == 0: whole groups a pass */
        uint4 v = xr[i];
        uint32_t w[4] = {v.x, v.y, v.z, v.w}, o[2] = {0, 0};
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++)
            m = fmaxf(m, fmaxf(fabsf(__uint_as_float(w[j] << 16)),
                               fabsf(__uint_as_float(w[j] & 0xffff0000u))));
#pragma unroll
        for (int off = 8; off > 0; off >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off, 16));
        float sc = m > 0.0f ? m / 448.0f : 1.0f, inv = 1.0f / sc;
        int g = i >> 4;
        if ((i & 15) == 0) sx[t_major ? (size_t)g * T + t : (size_t)t * KB + g] = sc;
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
    k_act_quant_g128<<<T, AQ_THREADS, 0, c->stream>>>(q, sx, (const uint4 *)x, K / 8, T,
                                                      c->fp8_block_sx_t);
    return launch_check("fp8 act_quant (128-column groups)");
}

/* plans: (T, N, K, out kind, block); a shape without an algorithm is kept as a refusal (valid
 * 2) */
typedef struct {
    int T, N, K, kind, block, valid; /* kind 0: f32 out, 1: f32 += (beta 1), 2: bf16 out;
                                        block 1: 128 x 128 weight blocks, 128-column groups */
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
static f8_plan *f8_plan_get(dcu_ctx *c, int T, int N, int K, int kind, int block,
                            const float *sw, const float *sx) {
    for (int i = 0; i < F8_PLANS; i++) {
        f8_plan *p = &g_f8_plans[i];
        if (p->valid && p->T == T && p->N == N && p->K == K && p->kind == kind &&
            p->block == block)
            return p->valid == 1 ? p : NULL;
    }
    f8_plan *p = &g_f8_plans[g_f8_next];
    g_f8_next = (g_f8_next + 1) % F8_PLANS;
    f8_plan_clear(p);
    p->T = T, p->N = N, p->K = K, p->kind = kind, p->block = block;
    cublasStatus_t s = cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s == CUBLAS_STATUS_SUCCESS) {
        cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        int32_t ma = block ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                           : CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
                mb = block ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                           : CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
        s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma,
                                           sizeof ma);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb,
                                               sizeof mb);
        /* the vector scales' pointers before the heuristic query: with them unset (NULL)
         * the H200 run of 3 December refused every shape (status 7, invalid value) */
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
                    "cuda: cuBLASLt has no e4m3 GEMM with %s scales for T=%d N=%d K=%d "
                    "(status %d): FP8 weights of such shapes run the bf16 twin\n",
                    block ? "128x128 block / 128-column group" : "outer-vector", T, N, K, (int)s);
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

/* cuBLASLt's FP8 rules: K, N multiples of 16 (T too, for its e4m3 B operand's leading
 * dimension rules we keep ld = K), 16-byte aligned operands */
int fp8_gemm_ok(int T, int N, int K) {
    return T > 0 && N % 16 == 0 && K % 16 == 0;
}

int fp8_gemm(dcu_ctx *c, void *y, int kind, int block, const uint8_t *xq, const float *sx,
             const void *w, const float *sw, int T, int N, int K) {
    if (T <= 0) return 0;
    if (!fp8_gemm_ok(T, N, K) || kind < 0 || kind > 2 || (block && K % 128)) return -ENOTSUP;
    pthread_mutex_lock(&g_f8_mu);
    f8_plan *p = f8_plan_get(c, T, N, K, kind, block, sw, sx);
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
        fprintf(stderr, "cuda: cublasLtMatmul (e4m3%s) T=%d N=%d K=%d failed (status %d)\n",
                block ? ", block scales" : "", T, N, K, (int)s);
        return -EIO;
    }
    return 0;
}
