/*
 * cuda_norm — the element-wise op family of the CUDA module (cuda_common.cuh): bf16
 * conversion, RMSNorm (+ the residual add; the 16-byte k_rmsnorm4 and the shared-memory
 * k_rmsnorm for rows it cannot take), RoPE, SwiGLU (f32 and bf16 gate|up), add and bias, the
 * KV write into paged blocks and the q|k|v finish (bias + RoPE + q out + the KV write).
 */
#include "kernels/cuda/cuda_common.cuh"

__global__ void k_to_bf16(bf16 *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16(src[i]);
}

__global__ void k_f16_to_bf16(bf16 *dst, const __half *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16(__half2float(src[i]));
}

int to_bf16(dcu_ctx *c, void *dst, const float *src, size_t n) {
    k_to_bf16<<<grid_for(n, 256), 256, 0, c->stream>>>((bf16 *)dst, src, n);
    return launch_check("to_bf16");
}

void to_bf16_async(dcu_ctx *c, bf16 *dst, const float *src, size_t n) {
    k_to_bf16<<<grid_for(n, 256), 256, 0, c->stream>>>(dst, src, n);
}

void f16_to_bf16_async(dcu_ctx *c, bf16 *dst, const __half *src, size_t n) {
    k_f16_to_bf16<<<grid_for(n, 256), 256, 0, c->stream>>>(dst, src, n);
}

template <typename OT>
__global__ void k_rmsnorm(OT *out, float *x, const float *add, const float *w, const int32_t *rows,
                          int n, float eps, int write_back) {
    pdl_trigger();
    pdl_wait();
    int r = blockIdx.x;
    int src = rows ? rows[r] : r;
    float *xr = x + (size_t)src * n;
    const float *ar = add ? add + (size_t)src * n : NULL;
    extern __shared__ float vbuf[];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i];
        if (ar) v += ar[i];
        vbuf[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = vbuf[i];
        if (write_back) xr[i] = v;
        store_as(out + (size_t)r * n + i, w[i] * (v * inv));
    }
}

/* k_rmsnorm with 16-byte accesses, the row in registers (no shared-memory copy): thread i
 * holds float4s i, i + blockDim, ... (at most RN_VPT; blockDim = n / 4 / RN_VPT rounded up to
 * a warp); the residual written back and the added rows streamed (__stcs / __ldcs: neither is
 * read again before the next norm, while the bf16 out feeds the next GEMM from L2).  Needs
 * n % 4 == 0, n <= 4 * RN_VPT * 1024 and 16-byte aligned x, add, w (8-byte for a bf16 out). */
#define RN_VPT 8
template <typename OT>
__global__ void __launch_bounds__(1024)
    k_rmsnorm4(OT *out, float *x, const float *add, const float *w, const int32_t *rows, int n,
               float eps, int write_back) {
    pdl_trigger(); /* a one-wave kernel at decode: the next GEMV's CTAs may start streaming
                      their weights while it runs (launched with launch_pdl, c->norm_pdl) */
    pdl_wait();
    int r = blockIdx.x, n4 = n >> 2;
    int src = rows ? rows[r] : r;
    float4 *xr = (float4 *)(x + (size_t)src * n);
    const float4 *ar = add ? (const float4 *)(add + (size_t)src * n) : NULL;
    float4 v[RN_VPT];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RN_VPT; k++) {
        int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            float4 a = xr[i];
            if (ar) {
                float4 b = __ldcs(ar + i);
                a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
            }
            v[k] = a;
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
        }
    }
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    const float4 *w4 = (const float4 *)w;
#pragma unroll
    for (int k = 0; k < RN_VPT; k++) {
        int i = threadIdx.x + k * blockDim.x;
        if (i < n4) {
            float4 a = v[k], g = __ldg(w4 + i);
            if (write_back) __stcs(xr + i, a);
            float o0 = g.x * (a.x * inv), o1 = g.y * (a.y * inv), o2 = g.z * (a.z * inv),
                  o3 = g.w * (a.w * inv);
            if constexpr (sizeof(OT) == 2) {
                __nv_bfloat162 h[2] = {__floats2bfloat162_rn(o0, o1), __floats2bfloat162_rn(o2, o3)};
                *(uint2 *)(out + (size_t)r * n + 4 * (size_t)i) = *(const uint2 *)h;
            } else {
                *(float4 *)(out + (size_t)r * n + 4 * (size_t)i) = make_float4(o0, o1, o2, o3);
            }
        }
    }
}

int rmsnorm(dcu_ctx *c, void *out, int out_dtype, float *x, const float *add,
                   const float *w, const int32_t *rows, int n_rows, int n, float eps,
                   int write_back) {
    if (n_rows <= 0) return 0;
    if (n % 4 == 0 && n <= 4 * RN_VPT * 1024 &&
        !(((uintptr_t)x | (uintptr_t)add | (uintptr_t)w) & 15) &&
        !((uintptr_t)out & (out_dtype == DCU_BF16 ? 7 : 15))) {
        int th = (n / 4 + RN_VPT - 1) / RN_VPT;
        th = (th + 31) / 32 * 32;
        if (c->norm_pdl)
            return out_dtype == DCU_BF16
                       ? launch_pdl(c, "rmsnorm (16-byte)", k_rmsnorm4<bf16>, dim3(n_rows),
                                    dim3(th), 0, (bf16 *)out, x, add, w, rows, n, eps, write_back)
                       : launch_pdl(c, "rmsnorm (16-byte)", k_rmsnorm4<float>, dim3(n_rows),
                                    dim3(th), 0, (float *)out, x, add, w, rows, n, eps,
                                    write_back);
        if (out_dtype == DCU_BF16)
            k_rmsnorm4<bf16><<<n_rows, th, 0, c->stream>>>((bf16 *)out, x, add, w, rows, n, eps,
                                                           write_back);
        else
            k_rmsnorm4<float><<<n_rows, th, 0, c->stream>>>((float *)out, x, add, w, rows, n,
                                                            eps, write_back);
        return launch_check("rmsnorm (16-byte)");
    }
    int th = n >= 1024 ? 1024 : (n >= 256 ? 256 : 128);
    size_t sh = (size_t)n * sizeof(float);
    if (sh > 48 * 1024) return -EINVAL;
    if (out_dtype == DCU_BF16)
        return launch_pdl(c, "rmsnorm", k_rmsnorm<bf16>, dim3(n_rows), dim3(th), sh, (bf16 *)out,
                          x, add, w, rows, n, eps, write_back);
    return launch_pdl(c, "rmsnorm", k_rmsnorm<float>, dim3(n_rows), dim3(th), sh, (float *)out, x,
                      add, w, rows, n, eps, write_back);
}

__global__ void k_rope(float *x, int stride, const int32_t *pos, const float *inv_freq,
                       int n_heads, int hd) {
    int t = blockIdx.x, half = hd / 2;
    float p = (float)pos[t];
    for (int i = threadIdx.x; i < n_heads * half; i += blockDim.x) {
        int hh = i / half, j = i % half;
        float a = p * inv_freq[j];
        float cs = cosf(a), sn = sinf(a);
        float *v = x + (size_t)t * stride + (size_t)hh * hd;
        float u = v[j], w = v[j + half];
        v[j] = u * cs - w * sn;
        v[j + half] = w * cs + u * sn;
    }
}

int rope(dcu_ctx *c, float *x, int stride, const int32_t *pos, const float *inv_freq,
                int T, int n_heads, int hd) {
    if (T <= 0) return 0;
    k_rope<<<T, 128, 0, c->stream>>>(x, stride, pos, inv_freq, n_heads, hd);
    return launch_check("rope");
}

template <typename OT>
__global__ void k_swiglu(OT *out, const float *gu, int I) {
    int t = blockIdx.y;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < I; i += gridDim.x * blockDim.x) {
        float g = gu[(size_t)t * 2 * I + i], u = gu[(size_t)t * 2 * I + I + i];
        store_as(out + (size_t)t * I + i, g / (1.0f + expf(-g)) * u);
    }
}

/* h = silu(g) * u from a bf16 gate|up row (the GEMM's bf16 output): 8 elements a thread,
 * 16-byte loads (I % 8 == 0), else one */
template <typename OT>
__global__ void k_swiglu16(OT *out, const bf16 *gu, int I) {
    int t = blockIdx.y;
    const bf16 *g = gu + (size_t)t * 2 * I, *u = g + I;
    OT *o = out + (size_t)t * I;
    if (I % 8 == 0) {
        for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * 8; i < I;
             i += gridDim.x * blockDim.x * 8) {
            uint4 gv = *(const uint4 *)(g + i), uv = *(const uint4 *)(u + i);
            const bf16 *gp = (const bf16 *)&gv, *up = (const bf16 *)&uv;
            float hv[8];
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float x = __bfloat162float(gp[e]);
                hv[e] = x / (1.0f + expf(-x)) * __bfloat162float(up[e]);
            }
            if constexpr (sizeof(OT) == 2) { /* one 16-byte store */
                __nv_bfloat162 w[4];
#pragma unroll
                for (int e = 0; e < 4; e++)
                    w[e] = __floats2bfloat162_rn(hv[2 * e], hv[2 * e + 1]);
                *(uint4 *)(o + i) = *(const uint4 *)w;
            } else {
                *(float4 *)(o + i) = make_float4(hv[0], hv[1], hv[2], hv[3]);
                *(float4 *)(o + i + 4) = make_float4(hv[4], hv[5], hv[6], hv[7]);
            }
        }
    } else {
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < I; i += gridDim.x * blockDim.x) {
            float x = __bfloat162float(g[i]);
            store_as(o + i, x / (1.0f + expf(-x)) * __bfloat162float(u[i]));
        }
    }
}

int swiglu16(dcu_ctx *c, void *out, int out_dtype, const bf16 *gu, int T, int I) {
    if (T <= 0) return 0;
    int per = I % 8 == 0 ? 8 * 256 : 256;
    dim3 g((I + per - 1) / per, T);
    if (out_dtype == DCU_BF16)
        k_swiglu16<bf16><<<g, 256, 0, c->stream>>>((bf16 *)out, gu, I);
    else
        k_swiglu16<float><<<g, 256, 0, c->stream>>>((float *)out, gu, I);
    return launch_check("swiglu (bf16 gate|up)");
}

int swiglu(dcu_ctx *c, void *out, int out_dtype, const float *gu, int T, int I) {
    if (T <= 0) return 0;
    dim3 g((I + 255) / 256 > 64 ? 64 : (I + 255) / 256, T);
    if (out_dtype == DCU_BF16)
        k_swiglu<bf16><<<g, 256, 0, c->stream>>>((bf16 *)out, gu, I);
    else
        k_swiglu<float><<<g, 256, 0, c->stream>>>((float *)out, gu, I);
    return launch_check("swiglu");
}

__global__ void k_add(float *x, const float *y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

int add(dcu_ctx *c, float *x, const float *y, size_t n) {
    if (!n) return 0;
    k_add<<<grid_for(n, 256), 256, 0, c->stream>>>(x, y, n);
    return launch_check("add");
}

__global__ void k_bias(float *y, const float *b, int N, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] += b[i % N];
}

int add_bias(dcu_ctx *c, float *y, const float *b, int N, size_t n) {
    k_bias<<<grid_for(n, 256), 256, 0, c->stream>>>(y, b, N, n);
    return launch_check("bias");
}

template <typename KT>
__global__ void k_kv_write(KT *kv, int bs, int n_layers, int kvd, int layer, const float *k,
                           const float *v, int stride, const int32_t *pos, const int32_t *seq,
                           const int32_t *bts, int bt_stride, float ksc, float vsc) {
    int t = blockIdx.x;
    if (pos[t] < 0) return; /* a padding row of a recorded decode step */
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    size_t ok = kv_off(bt, pos[t], bs, n_layers, kvd, layer, 0);
    size_t ov = kv_off(bt, pos[t], bs, n_layers, kvd, layer, 1);
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) {
        store_kv(kv + ok + i, k[(size_t)t * stride + i], ksc);
        store_kv(kv + ov + i, v[(size_t)t * stride + i], vsc);
    }
}

int kv_write(dcu_ctx *c, const dcu_kv *kv, int layer, const float *k, const float *v,
                    int stride, const int32_t *pos, const int32_t *seq, const int32_t *bts,
                    int bt_stride, int T) {
    if (T <= 0) return 0;
    if (kv->dtype == DCU_F8E4M3)
        k_kv_write<f8e4m3><<<T, 128, 0, c->stream>>>(
            (f8e4m3 *)kv->base, kv->block_size, kv->n_layers, kv->kv_dim, layer, k, v, stride,
            pos, seq, bts, bt_stride, kv->k_scale, kv->v_scale);
    else if (kv->dtype == DCU_BF16)
        k_kv_write<bf16><<<T, 128, 0, c->stream>>>((bf16 *)kv->base, kv->block_size, kv->n_layers,
                                                   kv->kv_dim, layer, k, v, stride, pos, seq, bts,
                                                   bt_stride, 1.0f, 1.0f);
    else
        k_kv_write<float><<<T, 128, 0, c->stream>>>((float *)kv->base, kv->block_size,
                                                    kv->n_layers, kv->kv_dim, layer, k, v, stride,
                                                    pos, seq, bts, bt_stride, 1.0f, 1.0f);
    return launch_check("kv_write");
}

/* The forward's fused step after the QKV GEMM: bias, RoPE on q and k, q to qout (T, nh*hd),
 * k and v into the KV cache. qkv (T, (nh + 2 nkv) hd) of IT: f32, or bf16 (the GEMM's output
 * rounded by its epilogue, prefill-sized T: half the bytes written and read back). */
__device__ __forceinline__ float ld_f(const float *p) {
    return *p;
}
__device__ __forceinline__ float ld_f(const bf16 *p) {
    return __bfloat162float(*p);
}
template <typename KT, typename IT = float>
__global__ void k_qkv_finish(float *qout, KT *kv, int bs, int n_layers, int layer, const IT *qkv,
                             const float *bias, const int32_t *pos, const int32_t *seq,
                             const int32_t *bts, int bt_stride, const float *inv_freq, int nh,
                             int nkv, int hd, float ksc, float vsc) {
    pdl_trigger();
    pdl_wait();
    int t = blockIdx.x, half = hd / 2, h = nh * hd, kvd = nkv * hd, W = h + 2 * kvd;
    const IT *row = qkv + (size_t)t * W;
    /* grid (T, blocks): the rope items (q and k heads, hd / 2 each) and the v elements,
     * each spread over the blocks of the token (one block took ~2,600 items alone at batch 1) */
    int n_rope = (nh + nkv) * half;
    int i0 = blockIdx.y * blockDim.x + threadIdx.x, istep = gridDim.y * blockDim.x;
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    int p = pos[t], pad = p < 0; /* a padding row of a recorded decode step: no KV */
    size_t ok = pad ? 0 : kv_off(bt, p, bs, n_layers, kvd, layer, 0);
    size_t ov = pad ? 0 : kv_off(bt, p, bs, n_layers, kvd, layer, 1);
    float fp = pad ? 0.0f : (float)p;
    /* a stride of whole heads (istep % half == 0: 128 threads, head_dim 64 / 128 / 256)
     * keeps j fixed for the thread: its cos / sin once, not once a head (the same values) */
    const int fixed_j = istep % half == 0 && i0 < n_rope;
    float cs0 = 0.0f, sn0 = 0.0f;
    if (fixed_j) {
        float a = fp * inv_freq[i0 % half];
        cs0 = cosf(a), sn0 = sinf(a);
    }
    for (int i = i0; i < n_rope; i += istep) {
        int hh = i / half, j = i % half;
        int o = hh * hd + j; /* q heads then k heads: contiguous in row */
        float u = ld_f(row + o) + (bias ? bias[o] : 0.0f);
        float w = ld_f(row + o + half) + (bias ? bias[o + half] : 0.0f);
        float cs = cs0, sn = sn0;
        if (!fixed_j) {
            float a = fp * inv_freq[j];
            cs = cosf(a), sn = sinf(a);
        }
        float r0 = u * cs - w * sn, r1 = w * cs + u * sn;
        if (hh < nh) {
            qout[(size_t)t * h + o] = r0;
            qout[(size_t)t * h + o + half] = r1;
        } else if (!pad) {
            int ko = o - h;
            store_kv(kv + ok + ko, r0, ksc);
            store_kv(kv + ok + ko + half, r1, ksc);
        }
    }
    if (pad) return;
    for (int vi = i0; vi < kvd; vi += istep)
        store_kv(kv + ov + vi, ld_f(row + h + kvd + vi) + (bias ? bias[h + kvd + vi] : 0.0f), vsc);
}

/* k_qkv_finish for a bf16 q|k|v (the prefill path, cb_qkv) with two adjacent elements a
 * thread: bf16x2 loads, float2 / paired stores, the cos / sin of its two angles once (the
 * block's stride is whole heads).  Each element's arithmetic is k_qkv_finish's, so the
 * results are bit-identical; needs head_dim % 4 == 0 and blockDim % (head_dim / 4) == 0. */
template <typename KT> __device__ __forceinline__ void store2_as(KT *p, float a, float b, float sc);
template <> __device__ __forceinline__ void store2_as<float>(float *p, float a, float b, float sc) {
    *(float2 *)p = make_float2(a, b);
}
template <> __device__ __forceinline__ void store2_as<bf16>(bf16 *p, float a, float b, float sc) {
    *(__nv_bfloat162 *)p = __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ void store2_as<f8e4m3>(f8e4m3 *p, float a, float b, float sc) {
    p[0].b = f32_to_e4m3(a / sc);
    p[1].b = f32_to_e4m3(b / sc);
}
template <typename KT>
__global__ void k_qkv_finish_vec2(float *qout, KT *kv, int bs, int n_layers, int layer,
                                  const bf16 *qkv, const float *bias, const int32_t *pos,
                                  const int32_t *seq, const int32_t *bts, int bt_stride,
                                  const float *inv_freq, int nh, int nkv, int hd, float ksc,
                                  float vsc) {
    int t = blockIdx.x, half = hd / 2, hp = half / 2, h = nh * hd, kvd = nkv * hd, W = h + 2 * kvd;
    const bf16 *row = qkv + (size_t)t * W;
    int n_pairs = (nh + nkv) * hp;
    int i0 = blockIdx.y * blockDim.x + threadIdx.x, istep = gridDim.y * blockDim.x;
    const int32_t *bt = bts + (size_t)seq[t] * bt_stride;
    int p = pos[t], pad = p < 0;
    size_t ok = pad ? 0 : kv_off(bt, p, bs, n_layers, kvd, layer, 0);
    size_t ov = pad ? 0 : kv_off(bt, p, bs, n_layers, kvd, layer, 1);
    float fp = pad ? 0.0f : (float)p;
    int j = 2 * (i0 % hp); /* the same for every item of the thread (istep % hp == 0) */
    float a0 = fp * inv_freq[j], a1 = fp * inv_freq[j + 1];
    float c0 = cosf(a0), s0 = sinf(a0), c1 = cosf(a1), s1 = sinf(a1);
    for (int i = i0; i < n_pairs; i += istep) {
        int hh = i / hp, o = hh * hd + j;
        float2 u = __bfloat1622float2(*(const __nv_bfloat162 *)(row + o)),
               w = __bfloat1622float2(*(const __nv_bfloat162 *)(row + o + half));
        if (bias) {
            u.x += bias[o], u.y += bias[o + 1];
            w.x += bias[o + half], w.y += bias[o + half + 1];
        } else {
            u.x += 0.0f, u.y += 0.0f, w.x += 0.0f, w.y += 0.0f;
        }
        float r00 = u.x * c0 - w.x * s0, r10 = w.x * c0 + u.x * s0;
        float r01 = u.y * c1 - w.y * s1, r11 = w.y * c1 + u.y * s1;
        if (hh < nh) {
            *(float2 *)(qout + (size_t)t * h + o) = make_float2(r00, r01);
            *(float2 *)(qout + (size_t)t * h + o + half) = make_float2(r10, r11);
        } else if (!pad) {
            int ko = o - h;
            store2_as(kv + ok + ko, r00, r01, ksc);
            store2_as(kv + ok + ko + half, r10, r11, ksc);
        }
    }
    if (pad) return;
    for (int vi = 2 * i0; vi < kvd; vi += 2 * istep) {
        float2 v = __bfloat1622float2(*(const __nv_bfloat162 *)(row + h + kvd + vi));
        store2_as(kv + ov + vi, v.x + (bias ? bias[h + kvd + vi] : 0.0f),
                  v.y + (bias ? bias[h + kvd + vi + 1] : 0.0f), vsc);
    }
}

/* the launches of cb_qkv (cuda_backend.cu): blocks per token enough to fill the GPU at batch 1
 * (one item per thread), one at large T */
int qkv_finish(dcu_ctx *c, float *q, void *kv, int kv_kind, int bs, int n_layers, int layer,
               const void *qkv, int qkv_dtype, const float *bias, const int32_t *pos,
               const int32_t *seq, const int32_t *bts, int bt_stride, const float *inv_freq,
               int T, int nh, int nkv, int hd, float ksc, float vsc) {
    if (kv_kind != 2) ksc = vsc = 1.0f;
    if (qkv_dtype == DCU_BF16 && qkv_finish_vec2(hd)) { /* two elements a thread */
        int items = (nh + nkv) * (hd / 4), by = (items + 127) / 128;
        if (by > 1 && T > 1) by = (by + T - 1) / T;
        dim3 grid(T, by < 1 ? 1 : by);
#define VEC2(KT)                                                                                   \
    k_qkv_finish_vec2<KT><<<grid, 128, 0, c->stream>>>(q, (KT *)kv, bs, n_layers, layer,           \
                                                       (const bf16 *)qkv, bias, pos, seq, bts,     \
                                                       bt_stride, inv_freq, nh, nkv, hd, ksc, vsc)
        if (kv_kind == 2)
            VEC2(f8e4m3);
        else if (kv_kind)
            VEC2(bf16);
        else
            VEC2(float);
#undef VEC2
        return launch_check("qkv_finish2");
    }
    int items = (nh + nkv) * (hd / 2), by = (items + 127) / 128;
    if (by > 1 && T > 1) by = (by + T - 1) / T;
    dim3 grid(T, by < 1 ? 1 : by);
#define FIN(KT, IT)                                                                                \
    launch_pdl(c, "qkv_finish", k_qkv_finish<KT, IT>, grid, dim3(128), 0, q, (KT *)kv, bs,         \
               n_layers, layer, (const IT *)qkv, bias, pos, seq, bts, bt_stride, inv_freq, nh,     \
               nkv, hd, ksc, vsc)
    int rc;
    if (qkv_dtype == DCU_BF16)
        rc = kv_kind == 2 ? FIN(f8e4m3, bf16) : kv_kind ? FIN(bf16, bf16) : FIN(float, bf16);
    else
        rc = kv_kind == 2 ? FIN(f8e4m3, float) : kv_kind ? FIN(bf16, float) : FIN(float, float);
#undef FIN
    return rc;
}
