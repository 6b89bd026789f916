/*
 * cuda_gemv_fp8 — FP8 (e4m3) weights on the CUDA module (cuda_common.cuh):
 *
 *   gemv_fp8     the decode GEMV y (T, N) f32 = x (T, K) bf16 . dequant(w (N, K) e4m3)^T
 *                (+ bias) for T = 1..8 (T <= 2 of the shapes gemv_f8_ok takes run cuda_gemv.cu's
 *                GEMV family instead: split-K, fused epilogues, PDL): weight-only FP8 -- the activations stay bf16, each
 *                lane converts 16 e4m3 weights (one 16-byte load) to f32 with the hardware
 *                e4m3x2 -> f16x2 conversion (exact), dots them with x in f32 and multiplies
 *                the 16-term partial sum by the f32 scale of their block (backend_wscale:
 *                per tensor, per channel or 128 x 128); one warp a weight row, streaming
 *                1 byte a weight (half the bf16 GEMV's bytes).  Shapes the 16-byte loads
 *                cannot take (K % 16, a block_k neither a multiple of 16 nor >= K, x or w
 *                not 16-byte aligned) run a scalar form of it (k_gemv_fp8_any): every shape
 *                backend_wscale describes has a GEMV.
 *   fp8_dequant  e4m3 * scale -> bf16, at load: the bf16 twin the prefill GEMMs use (cuBLASLt
 *                bf16; an FP8 tensor-core GEMM for prefill is not here yet).
 */
#include "kernels/cuda/cuda_common.cuh"

#include <cuda_fp8.h>

#define GF_WARPS 8 /* rows (warps) per CTA */
#define GF_U     4 /* 16-byte weight loads in flight a lane */
#define GF_MAXT  8 /* tokens at most */

__device__ __forceinline__ uint64_t gf_evict_first() {
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ uint4 gf_ld_stream(const uint4 *p, uint64_t pol) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(pol));
    return v;
}
/* y (T, N) f32 = x (T, K) bf16 . (w e4m3 * scale)^T (+ bias).  K16 = K / 16 uint4 a row; the
 * scale of the 16 weights at columns 16 i .. 16 i + 15 is s[(row / bn) nkb + 16 i / bk]
 * (gemv_fp8_ok: bk a multiple of 16, or >= K, so the 16 share one): i >> ksh when bk / 16 is
 * 2^ksh (ksh 31 when one scale spans the row), else a division (ksh -1).  The scales are
 * loaded with the weights, not after their conversion. */
template <int TT>
__global__ void __launch_bounds__(32 * GF_WARPS)
    k_gemv_fp8(float *__restrict__ y, const uint4 *__restrict__ x, const uint4 *__restrict__ w,
               const float *__restrict__ s, int bn, int bk, int nkb, int ksh,
               const float *__restrict__ bias, int N, int K16) {
    int row = blockIdx.x * GF_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const uint4 *wr = w + (size_t)row * K16;
    const float *sr = s + (size_t)(row / bn) * nkb;
    float acc[TT];
#pragma unroll
    for (int t = 0; t < TT; t++)
        acc[t] = 0.0f;
    uint64_t pol = gf_evict_first();
    int K8 = 2 * K16; /* uint4 of x a token row */
    for (int i0 = lane; i0 < K16; i0 += 32 * GF_U) {
        uint4 wv[GF_U];
        float sv[GF_U];
#pragma unroll
        for (int u = 0; u < GF_U; u++) {
            int i = i0 + 32 * u;
            wv[u] = i < K16 ? gf_ld_stream(wr + i, pol) : make_uint4(0, 0, 0, 0);
            sv[u] = i < K16 ? __ldg(sr + (ksh >= 0 ? i >> ksh : (16 * i) / bk)) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < GF_U; u++) {
            int i = i0 + 32 * u;
            if (i < K16) {
                float wf[16];
                f8_cvt4(wv[u].x, wf);
                f8_cvt4(wv[u].y, wf + 4);
                f8_cvt4(wv[u].z, wf + 8);
                f8_cvt4(wv[u].w, wf + 12);
#pragma unroll
                for (int t = 0; t < TT; t++) {
                    const uint4 *xr = x + (size_t)t * K8 + 2 * i;
                    acc[t] = fmaf(sv[u], f8_dot16(wf, __ldg(xr), __ldg(xr + 1)), acc[t]);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TT; t++) {
        float v = warp_sum(acc[t]);
        if (lane == 0) y[(size_t)t * N + row] = v + (bias ? bias[row] : 0.0f);
    }
}

/* the scalar form for the shapes the 16-byte loads cannot take: one warp a row, a lane a
 * column at a time, each weight times its own block's scale */
template <int TT>
__global__ void __launch_bounds__(32 * GF_WARPS)
    k_gemv_fp8_any(float *__restrict__ y, const bf16 *__restrict__ x,
                   const uint8_t *__restrict__ w, const float *__restrict__ s, int bn, int bk,
                   int nkb, const float *__restrict__ bias, int N, int K) {
    int row = blockIdx.x * GF_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const uint8_t *wr = w + (size_t)row * K;
    const float *sr = s + (size_t)(row / bn) * nkb;
    float acc[TT];
#pragma unroll
    for (int t = 0; t < TT; t++)
        acc[t] = 0.0f;
    for (int k = lane; k < K; k += 32) {
        __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)__ldg(wr + k), __NV_E4M3);
        float v = __half2float(*reinterpret_cast<__half *>(&h)) * __ldg(sr + k / bk);
#pragma unroll
        for (int t = 0; t < TT; t++)
            acc[t] = fmaf(v, __bfloat162float(x[(size_t)t * K + k]), acc[t]);
    }
#pragma unroll
    for (int t = 0; t < TT; t++) {
        float v = warp_sum(acc[t]);
        if (lane == 0) y[(size_t)t * N + row] = v + (bias ? bias[row] : 0.0f);
    }
}

/* whether the 16-byte-load kernel takes the shape (else gemv_fp8 runs the scalar form) */
int gemv_fp8_ok(int T, int K, int bk, const void *x, const void *w) {
    return T >= 1 && T <= GF_MAXT && K % 16 == 0 && (bk % 16 == 0 || bk >= K) &&
           !(((uintptr_t)x | (uintptr_t)w) & 15);
}

int gemv_fp8(dcu_ctx *c, float *y, const void *x, const void *w, const float *s, int bn, int bk,
             const float *bias, int T, int N, int K) {
    if (T < 1 || T > GF_MAXT || bn < 1 || bk < 1 || K < 1) return -EINVAL;
    int nkb = (K + bk - 1) / bk, K16 = K / 16, vec = gemv_fp8_ok(T, K, bk, x, w);
    int ksh = nkb == 1 ? 31 : -1; /* the scale column of uint4 i: i >> ksh, or 16 i / bk */
    if (ksh < 0 && bk % 16 == 0 && !((bk / 16) & (bk / 16 - 1))) {
        ksh = 0;
        while ((16 << ksh) < bk)
            ksh++;
    }
    dim3 g((N + GF_WARPS - 1) / GF_WARPS), b(32 * GF_WARPS);
    const uint4 *xv = (const uint4 *)x, *wv = (const uint4 *)w;
    switch (T) {
#define GF_(TT)                                                                                    \
    case TT:                                                                                       \
        if (vec)                                                                                   \
            k_gemv_fp8<TT><<<g, b, 0, c->stream>>>(y, xv, wv, s, bn, bk, nkb, ksh, bias, N, K16);  \
        else                                                                                       \
            k_gemv_fp8_any<TT><<<g, b, 0, c->stream>>>(y, (const bf16 *)x, (const uint8_t *)w, s,  \
                                                       bn, bk, nkb, bias, N, K);                   \
        break;
        GF_(1) GF_(2) GF_(3) GF_(4) GF_(5) GF_(6) GF_(7) GF_(8)
#undef GF_
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "cuda: kernel gemv_fp8 failed to launch: %s\n", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}

/* out (N, K) bf16 = e4m3 q * its block's scale, rounded to nearest even */
__global__ void k_fp8_dequant(bf16 *__restrict__ out, const uint8_t *__restrict__ q,
                              const float *__restrict__ s, int bn, int bk, int nkb, int K,
                              size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / (size_t)K;
        int k = (int)(i - r * K);
        __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q[i], __NV_E4M3);
        float v = __half2float(*reinterpret_cast<__half *>(&h));
        out[i] = __float2bfloat16(v * s[(r / bn) * nkb + k / bk]);
    }
}

int fp8_dequant_bf16(dcu_ctx *c, bf16 *out, const uint8_t *q, const float *s, int bn, int bk, int N,
                     int K) {
    size_t n = (size_t)N * K;
    int nkb = (K + bk - 1) / bk;
    size_t blocks = (n + 255) / 256;
    k_fp8_dequant<<<(unsigned)(blocks < 65535 * 8 ? blocks : 65535 * 8), 256, 0, c->stream>>>(
        out, q, s, bn, bk, nkb, K, n);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "cuda: kernel fp8_dequant failed to launch: %s\n", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}
