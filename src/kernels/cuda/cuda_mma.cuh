/*
 * cuda_mma — the device helpers the CUDA module's tensor-core kernels share (the fast mode's
 * prefill and decode attention, cuda_attention_prefill.cu / cuda_attention_decode.cu;
 * cuda_invariant.cu: the batch-invariant attention): bf16 packing, mma.sync m16n8k16 (bf16
 * in, f32 accumulate),
 * ldmatrix x4 (plain and transposed), cp.async 16-byte copies with their commit/wait, and the
 * element offset of a position in the paged KV region.  Header-only (static inline device
 * functions): each translation unit gets its own copy, as before they were shared.
 */
#ifndef DISAGG_KERNELS_CUDA_MMA_CUH
#define DISAGG_KERNELS_CUDA_MMA_CUH

#include <cuda_bf16.h>
#include <stddef.h>
#include <stdint.h>

/* (lo, hi) rounded to bf16 (nearest even), lo in the low half */
static __device__ __forceinline__ uint32_t pack_bf2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

/* c (4 f32 accumulators) += A (a0..a3) . B (b0, b1), mma.sync.m16n8k16 row.col bf16 */
static __device__ __forceinline__ void mma_bf16(float *c, uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* four 8x8 b16 matrices from shared memory (p: this lane's row address) */
static __device__ __forceinline__ void ldsm_x4(uint32_t *r, const void *p) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
/* the same, transposed */
static __device__ __forceinline__ void ldsm_x4_t(uint32_t *r, const void *p) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

/* 16 bytes global -> shared, asynchronous (cp.async.cg: through L2 only) */
static __device__ __forceinline__ void cp_async16(void *smem_dst, const void *gsrc) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(gsrc));
}
static __device__ __forceinline__ void cp_async_commit(void) {
    asm volatile("cp.async.commit_group;\n" ::);
}
/* wait until at most N committed groups are still in flight */
template <int N> static __device__ __forceinline__ void cp_async_wait_group(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
static __device__ __forceinline__ void cp_async_wait_all(void) {
    asm volatile("cp.async.wait_all;\n" ::);
}

/* element offset of (block of pos, layer, which: 0 K / 1 V, slot) in the paged KV region:
 * blocks of (n_layers, 2, bs, kvd) */
static __device__ __forceinline__ size_t kv_off(const int32_t *bt, int pos, int bs, int n_layers,
                                                int kvd, int layer, int which) {
    size_t blk = (size_t)bt[pos / bs], slot = (size_t)(pos % bs);
    size_t per_block = (size_t)n_layers * 2 * bs * kvd;
    return blk * per_block + (((size_t)layer * 2 + which) * bs + slot) * kvd;
}

#endif
