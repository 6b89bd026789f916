/*
 * dev/cuda/gemv_skinny.cu — a tensor-core GEMM for decode-sized T (k_skinny, once behind
 * DISAGG_CUDA_SKINNY=T in the CUDA module): y (T, N) f32 = x (T, K) bf16 . w (N, K)^T bf16
 * (+ bias) on mma.sync, the weights the M side.  It lost to cuBLASLt at T = 1..32 on the H200
 * (and the decode GEMV of src/kernels/cuda/cuda_gemv.cu is what runs at T = 1), so it left
 * src/; kept here with its CPU reference and timing.
 *   nvcc -O3 -arch=sm_90 -std=c++17 dev/cuda/gemv_skinny.cu -o /tmp/gemv_skinny && /tmp/gemv_skinny
 * Arguments: [N K] (default 3584 18944, the 7B down_proj).
 */
#include "common.h"

/* y (T, N) f32 = x (T, K) bf16 . w (N, K)^T bf16 (+ bias) for decode-sized T <= 32 on
 * mma.sync m16n8k16: the weights are the M side (16 rows a CTA), the tokens the N side (NT
 * tiles of 8), so a token's output never depends on the other tokens (the same per-column
 * sums for any T <= 32).  4 warps split K (whole 32-wide chunks) and add up in shared memory
 * in a fixed order.  Operands straight from global memory: within a 32-wide chunk the k
 * order is permuted alike for W and x (thread (g, qd) holds k0 + 8qd .. +7 of its rows as one
 * 16-byte load: words x, y feed k-step 0, z, w k-step 1), so every load is 16 bytes and the
 * weights stream once.  Needs K % 32 == 0, N % 16 == 0, 16-byte aligned x and w. */
#define SK_WARPS 8
template <int NT>
__global__ void __launch_bounds__(SK_WARPS * 32)
    k_skinny(float *__restrict__ y, const bf16 *__restrict__ x, const bf16 *__restrict__ w,
             const float *__restrict__ bias, int T, int N, int K) {
    int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, g = lane >> 2, qd = lane & 3;
    int m0 = blockIdx.x * 16, chunks = K / 32;
    int c0 = wp * chunks / SK_WARPS, c1 = (wp + 1) * chunks / SK_WARPS;
    const bf16 *wa = w + (size_t)(m0 + g) * K + 8 * qd, *wb = wa + (size_t)8 * K;
    const bf16 *xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        int tok = 8 * nt + g;
        xr[nt] = tok < T ? x + (size_t)tok * K + 8 * qd : NULL;
    }
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll 4
    for (int ch = c0; ch < c1; ch++) {
        size_t k = (size_t)ch * 32;
        uint4 ua = __ldcs((const uint4 *)(wa + k)), ub = __ldcs((const uint4 *)(wb + k));
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            uint4 xv = xr[nt] ? __ldg((const uint4 *)(xr[nt] + k)) : make_uint4(0, 0, 0, 0);
            mma_bf16(acc[nt], ua.x, ub.x, ua.y, ub.y, xv.x, xv.y);
            mma_bf16(acc[nt], ua.z, ub.z, ua.w, ub.w, xv.z, xv.w);
        }
    }
    __shared__ float red[SK_WARPS][16][8 * NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        int tk = 8 * nt + 2 * qd;
        red[wp][g][tk] = acc[nt][0];
        red[wp][g][tk + 1] = acc[nt][1];
        red[wp][g + 8][tk] = acc[nt][2];
        red[wp][g + 8][tk + 1] = acc[nt][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * T; i += blockDim.x) {
        int r = i % 16, tk = i / 16;
        float v = 0.0f;
#pragma unroll
        for (int q = 0; q < SK_WARPS; q++)
            v += red[q][r][tk];
        y[(size_t)tk * N + m0 + r] = v + (bias ? bias[m0 + r] : 0.0f);
    }
}

static void launch_skinny(float *y, const bf16 *x, const bf16 *w, const float *bias, int T, int N,
                          int K) {
    dim3 g(N / 16);
    switch ((T + 7) / 8) {
#define SK_(n)                                                                                     \
    case n:                                                                                        \
        k_skinny<n><<<g, SK_WARPS * 32>>>(y, x, w, bias, T, N, K);                                 \
        break;
        SK_(1) SK_(2) SK_(3) SK_(4)
#undef SK_
    }
}

int main(int argc, char **argv) {
    int N = argc > 2 ? atoi(argv[1]) : 3584, K = argc > 2 ? atoi(argv[2]) : 18944, fails = 0;
    if (N % 16 || K % 32) {
        fprintf(stderr, "N must be a multiple of 16 and K of 32\n");
        return 2;
    }
    const int TMAX = 32;
    float *hx = (float *)malloc((size_t)TMAX * K * 4), *hw = (float *)malloc((size_t)N * K * 4);
    float *hb = (float *)malloc((size_t)N * 4), *ref = (float *)malloc((size_t)TMAX * N * 4);
    float *got = (float *)malloc((size_t)TMAX * N * 4);
    bf16 *bx = (bf16 *)malloc((size_t)TMAX * K * 2), *bw = (bf16 *)malloc((size_t)N * K * 2);
    for (size_t i = 0; i < (size_t)TMAX * K; i++)
        hx[i] = bf16_round(frand());
    for (size_t i = 0; i < (size_t)N * K; i++)
        hw[i] = bf16_round(frand() * 0.05f);
    for (int i = 0; i < N; i++)
        hb[i] = frand();
    to_bf16_host(bx, hx, (size_t)TMAX * K);
    to_bf16_host(bw, hw, (size_t)N * K);
    bf16 *dx = dev_copy(bx, (size_t)TMAX * K), *dw = dev_copy(bw, (size_t)N * K);
    float *db = dev_copy(hb, (size_t)N), *dy = NULL;
    CK(cudaMalloc((void **)&dy, (size_t)TMAX * N * 4));
    for (int t = 0; t < TMAX; t++)
        for (int n = 0; n < N; n++) {
            double s = hb[n];
            for (int k = 0; k < K; k++)
                s += (double)hx[(size_t)t * K + k] * hw[(size_t)n * K + k];
            ref[(size_t)t * N + n] = (float)s;
        }
    printf("k_skinny, N %d K %d (weights %.1f MB)\n", N, K, (double)N * K * 2 / 1e6);
    int Ts[] = {1, 2, 8, 13, 32};
    for (int T : Ts) {
        launch_skinny(dy, dx, dw, db, T, N, K);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(got, dy, (size_t)T * N * 4, cudaMemcpyDeviceToHost));
        char what[64];
        snprintf(what, sizeof what, "T %d", T);
        fails += check_close(what, got, ref, (size_t)T * N, 1e-3f);
        float ms = time_ms([&] { launch_skinny(dy, dx, dw, db, T, N, K); }, 50);
        printf("  %.4f ms, %.0f GB/s of weights\n", ms, (double)N * K * 2 / (ms * 1e6));
    }
    printf("%s\n", fails ? "FAILED" : "all OK");
    return fails != 0;
}
