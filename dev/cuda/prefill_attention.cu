/*
 * dev/cuda/prefill_attention.cu — the previous prefill attention kernel of the CUDA module
 * (k_flash2: once the default, then behind DISAGG_CUDA_FLASH3=0, with DISAGG_CUDA_FLASH_PIPE=0
 * for its single-stage form): FlashAttention-2 layout on mma.sync m16n8k16, CTA = (64-row
 * tile, query head), 4 warps of 16 rows, Q fragments, S, P and O in registers, K/V tiles of
 * 64 keys from padded shared memory by ldmatrix, PIPE = cp.async double buffering.  The
 * module's k_prefill_attention_mma (128-row tiles, 32 rows a warp, Q in shared memory) grew
 * out of it (src/kernels/cuda/cuda_attention_prefill.cu); kept here as the simplest readable
 * form of the layout, with a CPU reference over the paged KV and a timing.
 *   nvcc -O3 -arch=sm_90 -std=c++17 dev/cuda/prefill_attention.cu -o /tmp/pa && /tmp/pa
 * Arguments: [T [cached]] new tokens (default 1024) after `cached` positions (default 77);
 * 28 query heads, 4 KV heads (the 7B shape), head_dim 128 and 64, block size 16.
 */
#include "common.h"

#define FA_BK 64 /* keys per tile */
#define FA_BQ 64 /* query rows per tile */

#define F2_PAD 8

static size_t flash2_smem(int hd, int pipe) {
    return (size_t)(pipe ? 2 : 1) * 2 * FA_BK * (hd + F2_PAD) * 2;
}

/* PIPE: K/V tiles through cp.async into two stages, the next tile's copy in flight while
 * the current one is computed (PIPE 0: one stage, synchronous loads) */
template <int HD, typename OT, int PIPE>
__global__ void __launch_bounds__(128)
    k_flash2(OT *out, const float *q, const bf16 *kv, int bs, int n_layers, int layer,
             const int32_t *tiles, const int32_t *pos, const int32_t *bts, int bt_stride, int nh,
             int nkv, float scale) {
    constexpr int LD = HD + F2_PAD, NT = FA_BK / 8, DT = HD / 8, KS = HD / 16;
    int tile = blockIdx.x, h = blockIdx.y, kvh = h / (nh / nkv), kvd = nkv * HD;
    int t0 = tiles[3 * tile], rows = tiles[3 * tile + 1], sq = tiles[3 * tile + 2];
    const int32_t *bt = bts + (size_t)sq * bt_stride;
    int p0 = pos[t0], kmax = p0 + rows;
    extern __shared__ __align__(16) char smem[];
    bf16 *Ks = (bf16 *)smem, *Vs = Ks + FA_BK * LD;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wr0 = warp * 16;
    /* tile kt's K and V into stage stg (cp.async, one commit group) */
    auto load_async = [&](int stg, int kt) {
        bf16 *K_ = (bf16 *)smem + (size_t)stg * 2 * FA_BK * LD, *V_ = K_ + FA_BK * LD;
        for (int i = threadIdx.x; i < FA_BK * HD / 8; i += 128) {
            int r = i / (HD / 8), c8 = i % (HD / 8), j = kt + r;
            bf16 *kd = K_ + r * LD + c8 * 8, *vd = V_ + r * LD + c8 * 8;
            if (j < kmax) {
                cp_async16(kd, kv + kv_off(bt, j, bs, n_layers, kvd, layer, 0) + (size_t)kvh * HD +
                                   c8 * 8);
                cp_async16(vd, kv + kv_off(bt, j, bs, n_layers, kvd, layer, 1) + (size_t)kvh * HD +
                                   c8 * 8);
            } else {
                *(uint4 *)kd = make_uint4(0, 0, 0, 0);
                *(uint4 *)vd = make_uint4(0, 0, 0, 0);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    if (PIPE) load_async(0, 0);
    int g = lane >> 2, qd = lane & 3;
    /* Q fragments (rows wr0 + g, wr0 + g + 8), scaled, rounded to bf16 */
    uint32_t qa[KS][4];
    int r0 = wr0 + g, r1 = r0 + 8;
    const float *q0 = q + (size_t)(t0 + r0) * nh * HD + (size_t)h * HD;
    const float *q1 = q + (size_t)(t0 + r1) * nh * HD + (size_t)h * HD;
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        int c = kk * 16 + 2 * qd;
        float2 z = make_float2(0.f, 0.f);
        float2 x00 = r0 < rows ? *(const float2 *)(q0 + c) : z;
        float2 x10 = r1 < rows ? *(const float2 *)(q1 + c) : z;
        float2 x01 = r0 < rows ? *(const float2 *)(q0 + c + 8) : z;
        float2 x11 = r1 < rows ? *(const float2 *)(q1 + c + 8) : z;
        qa[kk][0] = pack_bf2(x00.x * scale, x00.y * scale);
        qa[kk][1] = pack_bf2(x10.x * scale, x10.y * scale);
        qa[kk][2] = pack_bf2(x01.x * scale, x01.y * scale);
        qa[kk][3] = pack_bf2(x11.x * scale, x11.y * scale);
    }
    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    int qp0 = p0 + r0, qp1 = p0 + r1; /* query positions of the two rows */
    for (int k0 = 0; k0 < kmax; k0 += FA_BK) {
        if (PIPE) {
            int stg = (k0 / FA_BK) & 1;
            if (k0 + FA_BK < kmax)
                load_async(stg ^ 1, k0 + FA_BK); /* the stage the previous tile used */
            else
                asm volatile("cp.async.commit_group;\n" ::);
            asm volatile("cp.async.wait_group 1;\n" ::); /* this tile's copy is done */
            Ks = (bf16 *)smem + (size_t)stg * 2 * FA_BK * LD;
            Vs = Ks + FA_BK * LD;
        } else {
            for (int i = threadIdx.x; i < FA_BK * HD / 8; i += 128) {
                int r = i / (HD / 8), c8 = i % (HD / 8), j = k0 + r;
                uint4 kz = make_uint4(0, 0, 0, 0), vz = kz;
                if (j < kmax) {
                    kz = *(const uint4 *)(kv + kv_off(bt, j, bs, n_layers, kvd, layer, 0) +
                                          (size_t)kvh * HD + c8 * 8);
                    vz = *(const uint4 *)(kv + kv_off(bt, j, bs, n_layers, kvd, layer, 1) +
                                          (size_t)kvh * HD + c8 * 8);
                }
                *(uint4 *)(Ks + r * LD + c8 * 8) = kz;
                *(uint4 *)(Vs + r * LD + c8 * 8) = vz;
            }
        }
        __syncthreads();
        if (wr0 < rows && k0 <= p0 + wr0 + 15) {
            float s[NT][4];
#pragma unroll
            for (int n = 0; n < NT; n++)
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; n++) {
#pragma unroll
                for (int kk = 0; kk < KS; kk += 2) {
                    /* matrices: keys n*8 .. +7, d = kk*16 + m*8 (m = 0..3) */
                    uint32_t b[4];
                    ldsm_x4(b, Ks + (n * 8 + (lane & 7)) * LD + kk * 16 + (lane >> 3) * 8);
                    mma_bf16(s[n], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
                    if (kk + 1 < KS)
                        mma_bf16(s[n], qa[kk + 1][0], qa[kk + 1][1], qa[kk + 1][2], qa[kk + 1][3],
                                 b[2], b[3]);
                }
            }
            /* causal mask and the online softmax on the fragments */
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                int j = k0 + n * 8 + 2 * qd;
                if (j > qp0 || r0 >= rows) s[n][0] = -INFINITY;
                if (j + 1 > qp0 || r0 >= rows) s[n][1] = -INFINITY;
                if (j > qp1 || r1 >= rows) s[n][2] = -INFINITY;
                if (j + 1 > qp1 || r1 >= rows) s[n][3] = -INFINITY;
                mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
                mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            float c0 = mn0 == -INFINITY ? 1.0f : __expf(m0 - mn0);
            float c1 = mn1 == -INFINITY ? 1.0f : __expf(m1 - mn1);
            float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
            uint32_t pa[NT][2];
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                float e0 = __expf(s[n][0] - b0), e1 = __expf(s[n][1] - b0);
                float e2 = __expf(s[n][2] - b1), e3 = __expf(s[n][3] - b1);
                pa[n][0] = pack_bf2(e0, e1);
                pa[n][1] = pack_bf2(e2, e3);
                __nv_bfloat162 p01 = *(__nv_bfloat162 *)&pa[n][0],
                               p23 = *(__nv_bfloat162 *)&pa[n][1];
                sum0 += __low2float(p01) + __high2float(p01); /* the weights P V uses */
                sum1 += __low2float(p23) + __high2float(p23);
            }
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
            l0 = l0 * c0 + sum0;
            l1 = l1 * c1 + sum1;
            m0 = mn0, m1 = mn1;
#pragma unroll
            for (int dn = 0; dn < DT; dn++) {
                o[dn][0] *= c0, o[dn][1] *= c0;
                o[dn][2] *= c1, o[dn][3] *= c1;
            }
            /* O += P V: k-steps of 16 keys; V fragments by ldmatrix.trans, two d-tiles a load */
#pragma unroll
            for (int kk = 0; kk < FA_BK / 16; kk++) {
#pragma unroll
                for (int dn = 0; dn < DT; dn += 2) {
                    /* matrices: keys kk*16 + (m&1)*8 .. +7, d = dn*8 + (m>>1)*8 */
                    uint32_t b[4];
                    int m = lane >> 3;
                    ldsm_x4_t(b, Vs + (kk * 16 + (m & 1) * 8 + (lane & 7)) * LD + dn * 8 +
                                     (m >> 1) * 8);
                    mma_bf16(o[dn], pa[2 * kk][0], pa[2 * kk][1], pa[2 * kk + 1][0],
                             pa[2 * kk + 1][1], b[0], b[1]);
                    mma_bf16(o[dn + 1], pa[2 * kk][0], pa[2 * kk][1], pa[2 * kk + 1][0],
                             pa[2 * kk + 1][1], b[2], b[3]);
                }
            }
        }
        __syncthreads();
    }
    float i0 = l0 > 0 ? 1.0f / l0 : 0.0f, i1 = l1 > 0 ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int dn = 0; dn < DT; dn++) {
        int d = dn * 8 + 2 * qd;
        if (r0 < rows) {
            OT *p = out + (size_t)(t0 + r0) * nh * HD + (size_t)h * HD + d;
            store_as(p, o[dn][0] * i0);
            store_as(p + 1, o[dn][1] * i0);
        }
        if (r1 < rows) {
            OT *p = out + (size_t)(t0 + r1) * nh * HD + (size_t)h * HD + d;
            store_as(p, o[dn][2] * i1);
            store_as(p + 1, o[dn][3] * i1);
        }
    }
}

template <int HD, int PIPE>
static void launch(float *out, const float *q, const bf16 *kv, int bs, const int32_t *tiles,
                   int n_tiles, const int32_t *pos, const int32_t *bt, int bt_stride, int nh,
                   int nkv, float scale) {
    size_t sh = flash2_smem(HD, PIPE);
    CK(cudaFuncSetAttribute(k_flash2<HD, float, PIPE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)sh));
    k_flash2<HD, float, PIPE><<<dim3(n_tiles, nh), 128, sh>>>(out, q, kv, bs, 1, 0, tiles, pos, bt,
                                                              bt_stride, nh, nkv, scale);
}

template <int HD> static int run(int T, int cached) {
    const int nh = 28, nkv = 4, bs = 16, kvd = nkv * HD, G = nh / nkv;
    int ctx = cached + T, n_blocks = (ctx + bs - 1) / bs, fails = 0;
    float scale = 1.0f / sqrtf((float)HD);
    /* the paged KV: (n_blocks, 1 layer, 2, bs, kvd) bf16, the blocks in a shuffled order */
    size_t kv_n = (size_t)n_blocks * 2 * bs * kvd;
    float *hkv = (float *)malloc(kv_n * 4);
    bf16 *bkv = (bf16 *)malloc(kv_n * 2);
    for (size_t i = 0; i < kv_n; i++)
        hkv[i] = bf16_round(frand());
    to_bf16_host(bkv, hkv, kv_n);
    int32_t *bt = (int32_t *)malloc((size_t)n_blocks * 4);
    for (int i = 0; i < n_blocks; i++)
        bt[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = (int)((frand() + 1.0f) * 0.5f * (i + 1)) % (i + 1), t = bt[i];
        bt[i] = bt[j], bt[j] = t;
    }
    float *hq = (float *)malloc((size_t)T * nh * HD * 4);
    for (size_t i = 0; i < (size_t)T * nh * HD; i++)
        hq[i] = frand();
    int32_t *pos = (int32_t *)malloc((size_t)T * 4);
    for (int t = 0; t < T; t++)
        pos[t] = cached + t;
    int n_tiles = (T + FA_BQ - 1) / FA_BQ;
    int32_t *tiles = (int32_t *)malloc((size_t)n_tiles * 3 * 4);
    for (int i = 0; i < n_tiles; i++) {
        tiles[3 * i] = i * FA_BQ;
        tiles[3 * i + 1] = T - i * FA_BQ < FA_BQ ? T - i * FA_BQ : FA_BQ;
        tiles[3 * i + 2] = 0;
    }
    bf16 *dkv = dev_copy(bkv, kv_n);
    float *dq = dev_copy(hq, (size_t)T * nh * HD), *dout = NULL;
    int32_t *dpos = dev_copy(pos, (size_t)T), *dtiles = dev_copy(tiles, (size_t)n_tiles * 3);
    int32_t *dbt = dev_copy(bt, (size_t)n_blocks);
    CK(cudaMalloc((void **)&dout, (size_t)T * nh * HD * 4));
    /* the CPU reference on every 7th token (all heads): q scaled and rounded to bf16 as the
     * kernel does, softmax in double */
    int n_chk = (T + 6) / 7;
    float *ref = (float *)malloc((size_t)n_chk * nh * HD * 4);
    float *got = (float *)malloc((size_t)T * nh * HD * 4);
    float *gsel = (float *)malloc((size_t)n_chk * nh * HD * 4);
    double *sc = (double *)malloc((size_t)ctx * 8);
    for (int c = 0; c < n_chk; c++) {
        int t = 7 * c, p = pos[t];
        for (int h = 0; h < nh; h++) {
            const float *qr = hq + ((size_t)t * nh + h) * HD;
            int kh = h / G;
            double mx = -1e300, sum = 0;
            for (int j = 0; j <= p; j++) {
                const float *kr = hkv + ((size_t)bt[j / bs] * 2 * bs + j % bs) * kvd + kh * HD;
                double s = 0;
                for (int d = 0; d < HD; d++)
                    s += (double)bf16_round(qr[d] * scale) * kr[d];
                sc[j] = s;
                if (s > mx) mx = s;
            }
            for (int j = 0; j <= p; j++)
                sum += sc[j] = exp(sc[j] - mx);
            for (int d = 0; d < HD; d++) {
                double o = 0;
                for (int j = 0; j <= p; j++)
                    o += sc[j] *
                         hkv[((size_t)bt[j / bs] * 2 * bs + bs + j % bs) * kvd + kh * HD + d];
                ref[((size_t)c * nh + h) * HD + d] = (float)(o / sum);
            }
        }
    }
    printf("k_flash2, head_dim %d: %d new tokens after %d cached, %d heads / %d KV heads\n", HD, T,
           cached, nh, nkv);
    for (int pipe = 1; pipe >= 0; pipe--) {
        auto go = [&] {
            if (pipe)
                launch<HD, 1>(dout, dq, dkv, bs, dtiles, n_tiles, dpos, dbt, n_blocks, nh, nkv,
                              scale);
            else
                launch<HD, 0>(dout, dq, dkv, bs, dtiles, n_tiles, dpos, dbt, n_blocks, nh, nkv,
                              scale);
        };
        CK(cudaMemset(dout, 0xff, (size_t)T * nh * HD * 4));
        go();
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(got, dout, (size_t)T * nh * HD * 4, cudaMemcpyDeviceToHost));
        for (int c = 0; c < n_chk; c++)
            memcpy(gsel + (size_t)c * nh * HD, got + (size_t)7 * c * nh * HD, (size_t)nh * HD * 4);
        char what[64];
        snprintf(what, sizeof what, "  PIPE %d vs CPU (every 7th token)", pipe);
        fails += check_close(what, gsel, ref, (size_t)n_chk * nh * HD, 2e-2f);
        float ms = time_ms(go, 20);
        double flops = 0;
        for (int t = 0; t < T; t++)
            flops += 4.0 * (pos[t] + 1) * HD * nh;
        printf("  PIPE %d: %.3f ms, %.1f TFLOP/s (causal)\n", pipe, ms, flops / (ms * 1e9));
    }
    cudaFree(dkv), cudaFree(dq), cudaFree(dout), cudaFree(dpos), cudaFree(dtiles), cudaFree(dbt);
    free(hkv), free(bkv), free(bt), free(hq), free(pos), free(tiles), free(ref), free(got);
    free(gsel), free(sc);
    return fails;
}

int main(int argc, char **argv) {
    int T = argc > 1 ? atoi(argv[1]) : 1024, cached = argc > 2 ? atoi(argv[2]) : 77;
    if (T < 1 || cached < 0) {
        fprintf(stderr, "usage: %s [T >= 1 [cached >= 0]]\n", argv[0]);
        return 2;
    }
    int fails = run<128>(T, cached) + run<64>(T, cached);
    printf("%s\n", fails ? "FAILED" : "all OK");
    return fails != 0;
}
