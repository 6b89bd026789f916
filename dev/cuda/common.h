/*
 * dev/cuda/common.h — what the standalone kernel programs of dev/cuda share (llm.c's
 * dev/cuda pattern): error checks, a deterministic RNG, bf16 rounding on the host, a
 * max-error check against a CPU reference and a timing loop.  The device helpers
 * (mma.sync, ldmatrix, cp.async, the paged-KV offset) are the module's own
 * (src/kernels/cuda/cuda_mma.cuh), so a kernel here compiles as it did in src/.
 */
#ifndef DISAGG_DEV_CUDA_COMMON_H
#define DISAGG_DEV_CUDA_COMMON_H

#include "../../src/kernels/cuda/cuda_mma.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef __nv_bfloat16 bf16;

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s failed: %s (%s:%d)\n", #call, cudaGetErrorString(e_), __FILE__,    \
                    __LINE__);                                                                     \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* uniform in [-1, 1) */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(z >> 40) / (float)(1u << 23) - 1.0f;
}

/* round to bf16 and back (round to nearest even), as the device does */
static float bf16_round(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, 4);
    return v;
}
static void to_bf16_host(bf16 *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = __float2bfloat16(src[i]);
}

template <typename T> __device__ __forceinline__ void store_as(T *p, float v);
template <> __device__ __forceinline__ void store_as<float>(float *p, float v) {
    *p = v;
}
template <> __device__ __forceinline__ void store_as<bf16>(bf16 *p, float v) {
    *p = __float2bfloat16(v);
}

template <typename T> static T *dev_copy(const T *h, size_t n) {
    T *d = NULL;
    CK(cudaMalloc((void **)&d, n * sizeof(T)));
    CK(cudaMemcpy(d, h, n * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

/* max |got - want| / (|want| + 1); prints and returns 0 when within tol */
static int check_close(const char *what, const float *got, const float *want, size_t n, float tol) {
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]) / (fabs((double)want[i]) + 1.0);
        if (!(e <= worst)) worst = e, at = i; /* NaN counts as worst */
    }
    int ok = worst <= tol;
    printf("%-40s max rel err %.3g at %zu (got %g want %g) %s\n", what, worst, at, got[at],
           want[at], ok ? "OK" : "FAILED");
    return ok ? 0 : 1;
}

/* mean milliseconds of `iters` launches after one warm-up */
template <typename F> static float time_ms(F launch, int iters) {
    launch();
    CK(cudaDeviceSynchronize());
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a));
    for (int i = 0; i < iters; i++)
        launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaGetLastError());
    return ms / iters;
}

#endif
