/* cuda_sampling — greedy sampling of the CUDA module (cuda_common.cuh): argmax over the logits
 * rows (one block a row, or two stages of AMX_PARTS blocks a row for up to AMX_ROWS rows), and
 * structured outputs' token bitmasks applied to the logits before it. */
#include "kernels/cuda/cuda_common.cuh"

/* ---- argmax --------------------------------------------------------------------- */

__global__ void k_argmax(int32_t *out, const float *logits, int vocab) {
    int r = blockIdx.x;
    const float *x = logits + (size_t)r * vocab;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = x[i];
        if (v > best || (v == best && i < bi)) best = v, bi = i;
    }
    __shared__ float sv[1024];
    __shared__ int si[1024];
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float v = sv[threadIdx.x + s];
            int i = si[threadIdx.x + s];
            if (v > sv[threadIdx.x] || (v == sv[threadIdx.x] && i < si[threadIdx.x]))
                sv[threadIdx.x] = v, si[threadIdx.x] = i;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[r] = si[0] == 0x7fffffff ? 0 : si[0];
}

/* the two-stage argmax: grid (rows, AMX_PARTS) blocks of 256 each take a slice of the row
 * (the lowest id wins ties, as k_argmax), then one warp a row reduces the parts.  One block
 * walking a 152k vocabulary took ~40 us; the slices read the row in parallel. */
__device__ __forceinline__ void amx_better(float &bv, int &bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}
__global__ void __launch_bounds__(256) k_argmax_part(int32_t *part, const float *logits,
                                                     int vocab) {
    int r = blockIdx.x, p = blockIdx.y, np = gridDim.y;
    const float *x = logits + (size_t)r * vocab;
    int per = (vocab + np - 1) / np, i0 = p * per, i1 = min(vocab, i0 + per);
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x)
        amx_better(best, bi, x[i], i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, best, o);
        int j = __shfl_xor_sync(0xffffffffu, bi, o);
        amx_better(best, bi, v, j);
    }
    __shared__ float sv[8];
    __shared__ int si[8];
    int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) sv[w] = best, si[w] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < (int)(blockDim.x >> 5); k++)
            amx_better(best, bi, sv[k], si[k]);
        size_t o = ((size_t)r * np + p) * 2;
        part[o] = __float_as_int(best);
        part[o + 1] = bi;
    }
}
__global__ void k_argmax_final(int32_t *out, const int32_t *part, int np) {
    int r = blockIdx.x, lane = threadIdx.x;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int p = lane; p < np; p += 32)
        amx_better(best, bi, __int_as_float(part[((size_t)r * np + p) * 2]),
                   part[((size_t)r * np + p) * 2 + 1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v = __shfl_xor_sync(0xffffffffu, best, o);
        int j = __shfl_xor_sync(0xffffffffu, bi, o);
        amx_better(best, bi, v, j);
    }
    if (lane == 0) out[r] = bi == 0x7fffffff ? 0 : bi;
}

int argmax(dcu_ctx *c, int32_t *out, const float *logits, int rows, int vocab) {
    if (rows <= 0) return 0;
    if (rows > AMX_ROWS || vocab < 64 * AMX_PARTS) {
        k_argmax<<<rows, 1024, 0, c->stream>>>(out, logits, vocab);
        return launch_check("argmax");
    }
    k_argmax_part<<<dim3(rows, AMX_PARTS), 256, 0, c->stream>>>(c->amax_tmp, logits, vocab);
    k_argmax_final<<<rows, 32, 0, c->stream>>>(out, c->amax_tmp, AMX_PARTS);
    return launch_check("argmax");
}

/* ---- token bitmask ---------------------------------------------------------------- */

/* grid (n, ceil(width / 1024)): block (k, p) takes 1024 tokens of row rows[k], one a thread;
 * a warp reads one bitmask word (32 consecutive tokens) */
__global__ void __launch_bounds__(256) k_token_bitmask(float *logits, int width,
                                                       const int32_t *bitmask,
                                                       const int32_t *rows, int vocab) {
    int k = blockIdx.x, words = (vocab + 31) >> 5;
    float *l = logits + (size_t)rows[k] * width;
    const uint32_t *m = (const uint32_t *)bitmask + (size_t)k * words;
    for (int t = blockIdx.y * 1024 + threadIdx.x; t < min(width, (blockIdx.y + 1) * 1024);
         t += blockDim.x) {
        int ok = t < vocab && ((m[t >> 5] >> (t & 31)) & 1u);
        if (!ok) l[t] = -INFINITY;
    }
}

int token_bitmask(dcu_ctx *c, float *logits, int width, const int32_t *bitmask, const int32_t *rows,
                  int n, int vocab) {
    if (n <= 0) return 0;
    k_token_bitmask<<<dim3(n, (width + 1023) / 1024), 256, 0, c->stream>>>(logits, width, bitmask,
                                                                          rows, vocab);
    return launch_check("token_bitmask");
}
