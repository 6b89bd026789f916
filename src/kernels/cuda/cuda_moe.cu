/*
 * cuda_moe — the mixture-of-experts kernels (cuda_moe.h says what each path does).
 */
#include "kernels/backend.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_moe.h"

/* ---- small helpers ------------------------------------------------------------------- */

__device__ __forceinline__ float mo_lo(uint32_t v) {
    return __uint_as_float(v << 16);
}
__device__ __forceinline__ float mo_hi(uint32_t v) {
    return __uint_as_float(v & 0xffff0000u);
}
__device__ __forceinline__ float mo_dot8(uint4 a, uint4 b) {
    return mo_lo(a.x) * mo_lo(b.x) + mo_hi(a.x) * mo_hi(b.x) + mo_lo(a.y) * mo_lo(b.y) +
           mo_hi(a.y) * mo_hi(b.y) + mo_lo(a.z) * mo_lo(b.z) + mo_hi(a.z) * mo_hi(b.z) +
           mo_lo(a.w) * mo_lo(b.w) + mo_hi(a.w) * mo_hi(b.w);
}
/* expert weights: read once a step: no L1 allocation, first out of L2 */
__device__ __forceinline__ uint64_t mo_evict_first() {
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ uint4 mo_ld_stream(const uint4 *p, uint64_t pol) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(pol));
    return v;
}
__device__ __forceinline__ float mo_silu_mul(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}

static size_t align256(size_t n) {
    return (n + 255) & ~(size_t)255;
}

/* ---- routing ----------------------------------------------------------------------------
 * One warp a token row, E <= 512 (16 values a lane: expert e = lane + 32 i).  The max is
 * exact in any order; expf in parallel; the sum in expert order by lane 0 over shared memory
 * (the generic form's order); p_e = e_e / sum; top_k rounds of a warp arg-max over (p desc,
 * e asc); the renormalisation summed by lane 0 in selection order. */
#define RT_WARPS 4
__global__ void __launch_bounds__(32 * RT_WARPS)
    k_moe_route(int32_t *__restrict__ ids, float *__restrict__ wout,
                const float *__restrict__ logits, int T, int E, int k, int norm) {
    __shared__ float sh[RT_WARPS][BACKEND_MOE_MAX_EXPERTS];
    int wi = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * RT_WARPS + wi;
    if (row >= T) return;
    const float *l = logits + (size_t)row * E;
    float *s = sh[wi];
    float v[16];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        int e = lane + 32 * i;
        v[i] = e < E ? l[e] : -INFINITY;
        m = fmaxf(m, v[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
#pragma unroll
    for (int i = 0; i < 16; i++) {
        int e = lane + 32 * i;
        if (e < E) s[e] = expf(v[i] - m);
    }
    __syncwarp();
    float sum = 0.0f;
    if (lane == 0)
        for (int e = 0; e < E; e++)
            sum += s[e];
    sum = __shfl_sync(0xffffffffu, sum, 0);
    /* p in registers; -1 marks "not a candidate" (past E, or already chosen): p >= 0 */
#pragma unroll
    for (int i = 0; i < 16; i++) {
        int e = lane + 32 * i;
        v[i] = e < E ? s[e] / sum : -1.0f;
    }
    __syncwarp(); /* s is reused below for the chosen p */
    for (int j = 0; j < k; j++) {
        float bp = -2.0f;
        int be = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < 16; i++) /* ascending e: the first of equal p is the lowest e */
            if (v[i] > bp) bp = v[i], be = lane + 32 * i;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float op = __shfl_xor_sync(0xffffffffu, bp, o);
            int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (op > bp || (op == bp && oe < be)) bp = op, be = oe;
        }
        if ((be & 31) == lane) {
#pragma unroll
            for (int i = 0; i < 16; i++)
                if (lane + 32 * i == be) v[i] = -1.0f;
        }
        if (lane == 0) {
            ids[(size_t)row * k + j] = be;
            s[j] = bp;
        }
    }
    __syncwarp();
    if (lane == 0) {
        float tot = 0.0f;
        if (norm)
            for (int j = 0; j < k; j++)
                tot += s[j];
        for (int j = 0; j < k; j++)
            wout[(size_t)row * k + j] = norm ? s[j] / tot : s[j];
    }
}

int moe_route(cudaStream_t st, int32_t *ids, float *w, const float *logits, int T, int E, int k,
              int norm) {
    if (T <= 0) return 0;
    if (E < 1 || E > BACKEND_MOE_MAX_EXPERTS || k < 1 || k > E) return -EINVAL;
    k_moe_route<<<(T + RT_WARPS - 1) / RT_WARPS, 32 * RT_WARPS, 0, st>>>(ids, w, logits, T, E, k,
                                                                         norm);
    return launch_check("moe_route");
}

/* ---- shared pieces ----------------------------------------------------------------------- */

__global__ void k_moe_to_bf16(bf16 *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16(src[i]);
}

/* out (T, H) = per token t, over its top_k pairs in ascending expert index, acc += w * y[row],
 * acc from 0 in f32; row = inv ? inv[p] : p for pair p = t * k + j (y (rows, H) of YT: f32, or
 * bf16 with DISAGG_CUDA_MOE_Y_BF16); pairs of an invalid expert id (outside 0..E-1) add
 * nothing.  Grid (T, column blocks). */
template <typename OT, typename YT>
__global__ void __launch_bounds__(256)
    k_moe_combine(OT *__restrict__ out, const YT *__restrict__ y, const int32_t *__restrict__ ids,
                  const float *__restrict__ wts, const int32_t *__restrict__ inv, int H, int k,
                  int E) {
    __shared__ int ord[BACKEND_MOE_MAX_EXPERTS];
    __shared__ int n_ord;
    int t = blockIdx.x;
    const int32_t *id = ids + (size_t)t * k;
    if (threadIdx.x == 0) n_ord = 0;
    __syncthreads();
    /* rank of pair j among the token's valid pairs by (expert, j): the summation order */
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        int e = id[j];
        if (e < 0 || e >= E) continue;
        int r = 0;
        for (int i = 0; i < k; i++) {
            int f = id[i];
            if (f >= 0 && f < E && (f < e || (f == e && i < j))) r++;
        }
        ord[r] = j;
        atomicAdd(&n_ord, 1);
    }
    __syncthreads();
    int n = n_ord;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < H; c += gridDim.y * blockDim.x) {
        float acc = 0.0f;
        for (int q = 0; q < n; q++) {
            int j = ord[q];
            size_t p = (size_t)t * k + j;
            size_t row = inv ? (size_t)inv[p] : p;
            acc += wts[p] * load_f(y + row * H + c);
        }
        store_as(out + (size_t)t * H + c, acc);
    }
}

/* ---- decode: the chosen experts' rows, GEMV-style ------------------------------------------
 * Grid (row blocks, slots): slot s is the s-th distinct expert among the P = T * top_k ids in
 * ascending order (a CTA past the number of distinct experts exits); its pairs (ascending pair
 * index) go to shared memory and every warp of the CTA streams its weight rows once for up to
 * DT tokens at a time (more tokens: again, from L2).  Each CTA plans from the ids itself (P is
 * small): no sort kernel between the routing and the GEMVs. */
#define DEC_WARPS 8
#define DEC_U     8 /* uint4 loads of a row in flight a lane */
#define DEC_TT    4 /* tokens a pass */

/* the CTA's expert (or -1) and its pairs into pairs[]; returns the number of pairs.  The ids
 * are read once, in parallel, into sids (P <= MOE_DEC_MAXP); the rest works on shared memory. */
__device__ int moe_dec_plan(const int32_t *__restrict__ ids, int P, int E, int slot, int *sids,
                            int *pairs, unsigned *bits, int *sh_e, int *sh_n) {
    int tid = threadIdx.x;
    if (tid < BACKEND_MOE_MAX_EXPERTS / 32) bits[tid] = 0;
    for (int p = tid; p < P; p += blockDim.x)
        sids[p] = ids[p];
    __syncthreads();
    for (int p = tid; p < P; p += blockDim.x) {
        int e = sids[p];
        if (e >= 0 && e < E) atomicOr(&bits[e >> 5], 1u << (e & 31));
    }
    __syncthreads();
    if (tid == 0) {
        int s = slot, e = -1;
        for (int w = 0; w < BACKEND_MOE_MAX_EXPERTS / 32; w++) {
            int c = __popc(bits[w]);
            if (s < c) {
                unsigned b = bits[w];
                for (int q = 0; q < s; q++)
                    b &= b - 1; /* drop the lowest set bit s times */
                e = w * 32 + __ffs(b) - 1;
                break;
            }
            s -= c;
        }
        *sh_e = e;
    }
    __syncthreads();
    int e = *sh_e;
    if (e < 0) return 0;
    if (tid < 32) {
        int n = 0;
        for (int base = 0; base < P; base += 32) {
            int p = base + tid;
            int hit = p < P && sids[p] == e;
            unsigned m = __ballot_sync(0xffffffffu, hit);
            if (hit) pairs[n + __popc(m & ((1u << tid) - 1))] = p;
            n += __popc(m);
        }
        if (tid == 0) *sh_n = n;
    }
    __syncthreads();
    return *sh_n;
}

/* acc[r][t] (lane parts) = rows wr[r] . xr[t] over K8 uint4s, for t < nt; U uint4s of each
 * row in flight a lane */
template <int NR, int U>
__device__ __forceinline__ void moe_rows(float (&acc)[NR][DEC_TT], const uint4 *const *wr,
                                         const uint4 *const *xr, int nt, int K8, int lane,
                                         uint64_t pol) {
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int t = 0; t < DEC_TT; t++)
            acc[r][t] = 0.0f;
    for (int base = 0; base < K8; base += 32 * U) {
        uint4 wv[NR][U];
#pragma unroll
        for (int r = 0; r < NR; r++)
#pragma unroll
            for (int u = 0; u < U; u++) {
                int i = base + lane + 32 * u;
                wv[r][u] = i < K8 ? mo_ld_stream(wr[r] + i, pol) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = base + lane + 32 * u;
            if (i < K8) {
#pragma unroll
                for (int t = 0; t < DEC_TT; t++)
                    if (t < nt) {
                        uint4 xv = __ldg(xr[t] + i);
#pragma unroll
                        for (int r = 0; r < NR; r++)
                            acc[r][t] += mo_dot8(wv[r][u], xv);
                    }
            }
        }
    }
}

/* h (P, I) bf16, row = pair: silu(gate_e . x) * (up_e . x); a warp = one row i of I (its gate
 * row i and up row I + i of expert e's (2I, H) block); the CTA takes row blocks blockIdx.x,
 * + gridDim.x, .. (the plan once for several blocks: moe_dec_grid) */
__global__ void __launch_bounds__(32 * DEC_WARPS)
    k_moe_dec_gate_up(bf16 *__restrict__ h, const uint4 *__restrict__ x,
                      const uint4 *__restrict__ wgu, const int32_t *__restrict__ ids, int P,
                      int top_k, int E, int I, int H8) {
    __shared__ int sids[MOE_DEC_MAXP], pairs[MOE_DEC_MAXP];
    __shared__ unsigned bits[BACKEND_MOE_MAX_EXPERTS / 32];
    __shared__ int sh_e, sh_n;
    int n = moe_dec_plan(ids, P, E, blockIdx.y, sids, pairs, bits, &sh_e, &sh_n);
    if (n == 0) return;
    int e = sh_e, lane = threadIdx.x & 31, n_rb = (I + DEC_WARPS - 1) / DEC_WARPS;
    uint64_t pol = mo_evict_first();
    for (int rb = blockIdx.x; rb < n_rb; rb += gridDim.x) {
        int i = rb * DEC_WARPS + (threadIdx.x >> 5);
        if (i >= I) continue;
        const uint4 *wr[2] = {wgu + ((size_t)e * 2 * I + i) * H8,
                              wgu + ((size_t)e * 2 * I + I + i) * H8};
        for (int t0 = 0; t0 < n; t0 += DEC_TT) {
            int nt = min(DEC_TT, n - t0);
            const uint4 *xr[DEC_TT];
#pragma unroll
            for (int t = 0; t < DEC_TT; t++)
                xr[t] = x + (size_t)(pairs[t0 + min(t, nt - 1)] / top_k) * H8;
            float acc[2][DEC_TT];
            moe_rows<2, DEC_U>(acc, wr, xr, nt, H8, lane, pol);
#pragma unroll
            for (int t = 0; t < DEC_TT; t++) {
                float g = warp_sum(acc[0][t]), u = warp_sum(acc[1][t]);
                if (lane == 0 && t < nt)
                    h[(size_t)pairs[t0 + t] * I + i] = __float2bfloat16(mo_silu_mul(g, u));
            }
        }
    }
}

/* y (P, H) f32, row = pair: down_e . h[pair]; warp = DN_NR rows of down_e (H, I), DN_U loads
 * of each in flight a lane (the rows are short: inter 768 is 96 uint4s, 3 a lane) */
#define DN_NR 4
#define DN_U  4
__global__ void __launch_bounds__(32 * DEC_WARPS)
    k_moe_dec_down(float *__restrict__ y, const uint4 *__restrict__ h, const uint4 *__restrict__ wd,
                   const int32_t *__restrict__ ids, int P, int E, int H, int I8) {
    __shared__ int sids[MOE_DEC_MAXP], pairs[MOE_DEC_MAXP];
    __shared__ unsigned bits[BACKEND_MOE_MAX_EXPERTS / 32];
    __shared__ int sh_e, sh_n;
    int n = moe_dec_plan(ids, P, E, blockIdx.y, sids, pairs, bits, &sh_e, &sh_n);
    if (n == 0) return;
    int e = sh_e, lane = threadIdx.x & 31, n_rb = (H + DN_NR * DEC_WARPS - 1) / (DN_NR * DEC_WARPS);
    uint64_t pol = mo_evict_first();
    for (int rb = blockIdx.x; rb < n_rb; rb += gridDim.x) {
        int r0 = (rb * DEC_WARPS + (threadIdx.x >> 5)) * DN_NR;
        if (r0 >= H) continue;
        const uint4 *wr[DN_NR];
#pragma unroll
        for (int r = 0; r < DN_NR; r++) /* a row past H re-reads the last (not stored) */
            wr[r] = wd + ((size_t)e * H + min(r0 + r, H - 1)) * I8;
        for (int t0 = 0; t0 < n; t0 += DEC_TT) {
            int nt = min(DEC_TT, n - t0);
            const uint4 *xr[DEC_TT];
#pragma unroll
            for (int t = 0; t < DEC_TT; t++)
                xr[t] = h + (size_t)pairs[t0 + min(t, nt - 1)] * I8;
            float acc[DN_NR][DEC_TT];
            moe_rows<DN_NR, DN_U>(acc, wr, xr, nt, I8, lane, pol);
#pragma unroll
            for (int t = 0; t < DEC_TT; t++) {
                float v[DN_NR];
#pragma unroll
                for (int r = 0; r < DN_NR; r++)
                    v[r] = warp_sum(acc[r][t]);
                if (lane == 0 && t < nt) {
                    float *yr = y + (size_t)pairs[t0 + t] * H;
#pragma unroll
                    for (int r = 0; r < DN_NR; r++)
                        if (r0 + r < H) yr[r0 + r] = v[r];
                }
            }
        }
    }
}

/* Few pairs (P <= FD_MAXP: batch 1 and 2 at top 8): down and the weighted sum in one kernel,
 * out (T, H) directly.  A warp = one row r of H for every pair: the pairs sorted by (token,
 * expert) once a CTA, then in groups of FD_G, each group's rows of down_e (their experts')
 * streamed together (FD_G x DN_U loads in flight a lane) and dotted with the pairs' h, and
 * acc_t += w * dot in that order: per token ascending expert, from 0, as k_moe_combine sums
 * (the dot's lane split is moe_rows'). */
#define FD_MAXP 16
#define FD_G    4
template <typename OT>
__global__ void __launch_bounds__(32 * DEC_WARPS)
    k_moe_dec_down_fused(OT *__restrict__ out, const uint4 *__restrict__ h,
                         const uint4 *__restrict__ wd, const int32_t *__restrict__ ids,
                         const float *__restrict__ wts, int P, int top_k, int E, int H, int I8) {
    __shared__ int s_pair[FD_MAXP], s_ids[FD_MAXP], s_n;
    if (threadIdx.x < P) s_ids[threadIdx.x] = ids[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) { /* valid pairs, insertion-sorted by (token, expert, slot) */
        int n = 0;
        for (int p = 0; p < P; p++) {
            int e = s_ids[p];
            if (e < 0 || e >= E) continue;
            int q = n++;
            while (q > 0) {
                int o = s_pair[q - 1];
                int to = o / top_k, tp = p / top_k, eo = s_ids[o];
                if (to < tp || (to == tp && (eo < e || (eo == e && o < p)))) break;
                s_pair[q] = o;
                q--;
            }
            s_pair[q] = p;
        }
        s_n = n;
    }
    __syncthreads();
    int n = s_n, lane = threadIdx.x & 31;
    int r = blockIdx.x * DEC_WARPS + (threadIdx.x >> 5);
    if (r >= H) return;
    if (lane == 0) /* a token without a valid pair sums nothing: 0 (as k_moe_combine) */
        for (int t = 0; t < P / top_k; t++)
            store_as(out + (size_t)t * H + r, 0.0f);
    uint64_t pol = mo_evict_first();
    float acc = 0.0f;
    int cur_t = n > 0 ? s_pair[0] / top_k : 0;
    for (int g = 0; g < n; g += FD_G) {
        int ng = min(FD_G, n - g);
        const uint4 *wr[FD_G], *xr[FD_G];
#pragma unroll
        for (int q = 0; q < FD_G; q++) {
            int p = s_pair[g + min(q, ng - 1)];
            wr[q] = wd + ((size_t)s_ids[p] * H + r) * I8;
            xr[q] = h + (size_t)p * I8;
        }
        float part[FD_G];
#pragma unroll
        for (int q = 0; q < FD_G; q++)
            part[q] = 0.0f;
        for (int base = 0; base < I8; base += 32 * DN_U) {
            uint4 wv[FD_G][DN_U];
#pragma unroll
            for (int q = 0; q < FD_G; q++)
#pragma unroll
                for (int u = 0; u < DN_U; u++) {
                    int i = base + lane + 32 * u;
                    wv[q][u] =
                        q < ng && i < I8 ? mo_ld_stream(wr[q] + i, pol) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int u = 0; u < DN_U; u++) {
                int i = base + lane + 32 * u;
                if (i < I8)
#pragma unroll
                    for (int q = 0; q < FD_G; q++)
                        if (q < ng) part[q] += mo_dot8(wv[q][u], __ldg(xr[q] + i));
            }
        }
#pragma unroll
        for (int q = 0; q < FD_G; q++) {
            float d = warp_sum(part[q]);
            if (q < ng) {
                int p = s_pair[g + q], t = p / top_k;
                if (t != cur_t) { /* the previous token is complete */
                    if (lane == 0) store_as(out + (size_t)cur_t * H + r, acc);
                    acc = 0.0f;
                    cur_t = t;
                }
                acc += wts[p] * d;
            }
        }
    }
    if (n > 0 && lane == 0) store_as(out + (size_t)cur_t * H + r, acc);
}

/* ---- prefill: counting sort, grouped tensor-core GEMM --------------------------------------
 * k_moe_sort (one CTA): per-expert counts (shared integer atomics), offsets off[0..E], the
 * pairs sorted by expert (perm[pos] = pair; the order inside an expert's group is whatever
 * the atomics gave: each GEMM row is computed on its own, so no result depends on it),
 * inv[pair] = pos (-1: an invalid id), and the M-tile table of BM-row tiles (tile_e, tile_m0;
 * n_tiles).
 * The M tile BM (rows of an expert's group a CTA) is 128 for prefill and 64, 32 or 16 when an
 * expert has few tokens (batched decode: Mixtral at batch 32 is 8 tokens an expert): the N
 * tile is 128 weight rows at every BM, so a CTA streams the same weight bytes and its A rows
 * (and the MMAs over dead rows) shrink with BM.  moe_gemm_bm picks it. */
#define GM_BN 128
/* the K step: 64 (the default), or 32 (DISAGG_CUDA_MOE_GEMM=bk32, the first version; BM 128
 * only); cp.async stages 3 at BM 128, 4 below; smem rows padded by 8 (144 or 80 bytes:
 * ldmatrix conflict-free).  H200, 3 December, Qwen3-30B-A3B layer at 4,096 tokens: 1.68-1.70
 * ms against 1.99-2.01 ms with K step 32 (512 tokens 0.76 against 0.97; Mixtral's layer -10 %
 * and -20 %); K step 64 with 4 stages at BM 128 was slower (2.09-2.12 ms). */
#define GM_ST(BM)       ((BM) >= 128 ? 3 : 4)
#define GM_WM(BM)       ((BM) >= 32 ? 2 : 1) /* warps along M (4 along N) */
#define GM_SMEM(BM, BK) (GM_ST(BM) * ((BM) + GM_BN) * ((BK) + 8) * 2)

__global__ void __launch_bounds__(1024)
    k_moe_sort(int32_t *__restrict__ perm, int32_t *__restrict__ inv, int32_t *__restrict__ off,
               int32_t *__restrict__ tile_e, int32_t *__restrict__ tile_m0,
               int32_t *__restrict__ n_tiles, const int32_t *__restrict__ ids, int P, int E,
               int bm) {
    __shared__ int cnt[BACKEND_MOE_MAX_EXPERTS], cur[BACKEND_MOE_MAX_EXPERTS],
        toff[BACKEND_MOE_MAX_EXPERTS];
    int tid = threadIdx.x;
    for (int e = tid; e < E; e += blockDim.x)
        cnt[e] = 0;
    __syncthreads();
    int lane = tid & 31;
    /* warp-aggregated: the lanes of one expert add once (their leader), ranks by lane */
    for (int p0 = 0; p0 < P; p0 += blockDim.x) {
        int p = p0 + tid, e = p < P ? ids[p] : -1, ok = e >= 0 && e < E;
        unsigned peers = __match_any_sync(0xffffffffu, ok ? e : -1);
        if (ok && lane == __ffs(peers) - 1) atomicAdd(&cnt[e], __popc(peers));
    }
    __syncthreads();
    if (tid == 0) {
        int o = 0, to = 0;
        for (int e = 0; e < E; e++) {
            cur[e] = o;
            toff[e] = to;
            off[e] = o;
            o += cnt[e];
            to += (cnt[e] + bm - 1) / bm;
        }
        off[E] = o;
        *n_tiles = to;
    }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) {
        int nt = (cnt[e] + bm - 1) / bm;
        for (int m = 0; m < nt; m++) {
            tile_e[toff[e] + m] = e;
            tile_m0[toff[e] + m] = cur[e] + m * bm;
        }
    }
    __syncthreads();
    for (int p0 = 0; p0 < P; p0 += blockDim.x) {
        int p = p0 + tid, e = p < P ? ids[p] : -1, ok = e >= 0 && e < E;
        unsigned peers = __match_any_sync(0xffffffffu, ok ? e : -1);
        int leader = __ffs(peers) - 1, base = 0;
        if (ok && lane == leader) base = atomicAdd(&cur[e], __popc(peers));
        base = __shfl_sync(0xffffffffu, base, leader);
        if (p < P) {
            if (ok) {
                int pos = base + __popc(peers & ((1u << lane) - 1));
                perm[pos] = p;
                inv[p] = pos;
            } else {
                inv[p] = -1;
            }
        }
    }
}

/* MODE 0 (gate|up): A rows = x[perm[pos] / top_k] (K = H), B = expert e's rows interleaved so
 * that warp column wn holds gate rows n0 + 16 wn .. + 15 then the up rows of the same j
 * (n0 = 64 blockIdx.x); epilogue h[pos][j] = silu(g) * u in bf16.
 * MODE 1 (down): A rows = h[pos] (K = I), B = down_e rows n0 .. n0 + 127 (n0 = 128
 * blockIdx.x); epilogue y[pos][n] f32 (MODE 2: the same in bf16).
 * CTA tile BM x 128, K step BK (32 or 64), GM_ST cp.async stages, warps as GM_WM (M) x 4 (N)
 * of BM / GM_WM rows x 32 columns (MI = BM / 16 / GM_WM m16 slices), mma.sync m16n8k16 bf16
 * with f32 accumulators; blockIdx.y = M-tile (past n_tiles: exit).  Each output row's sum runs
 * over K in the same order at every BM and BK: the result does not depend on the tile. */
template <int MODE, int BK, int BM>
__global__ void __launch_bounds__(128 * GM_WM(BM))
    k_moe_gemm(void *__restrict__ outp, const bf16 *__restrict__ A, const bf16 *__restrict__ W,
               const int32_t *__restrict__ perm, const int32_t *__restrict__ off,
               const int32_t *__restrict__ tile_e, const int32_t *__restrict__ tile_m0,
               const int32_t *__restrict__ n_tiles, int top_k, int K, int Nrows, int Nout) {
    extern __shared__ __align__(16) unsigned char gsm[];
    constexpr int ST = GM_ST(BM), WM = GM_WM(BM), NT = 128 * WM, WR = BM / WM /* warp rows */,
                  MI = WR / 16, LD = BK + 8, CPR = BK / 8 /* 16-byte chunks a row */,
                  RP = NT / CPR /* rows a pass */, NQA = (BM + RP - 1) / RP, NQB = GM_BN / RP;
    static_assert(MI >= 1 && WR % 16 == 0 && GM_BN % RP == 0, "moe gemm tile");
    bf16 *As = (bf16 *)gsm;          /* [ST][BM][LD] */
    bf16 *Bs = As + ST * BM * LD;    /* [ST][BN][LD] */
    int tile = blockIdx.y;
    if (tile >= *n_tiles) return;
    int e = tile_e[tile], m0 = tile_m0[tile], m_end = off[e + 1];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
    /* this thread's A rows and B rows (chunk tid % CPR of 16 bytes within a K step) */
    int ch = tid % CPR;
    const bf16 *a_src[NQA], *b_src[NQB];
#pragma unroll
    for (int q = 0; q < NQA; q++) {
        int r = min(tid / CPR + RP * q, BM - 1);
        int pos = min(m0 + r, m_end - 1); /* a dead row re-reads the group's last */
        a_src[q] = MODE == 0 ? A + (size_t)(perm[pos] / top_k) * K : A + (size_t)pos * K;
    }
#pragma unroll
    for (int q = 0; q < NQB; q++) {
        int r = tid / CPR + RP * q, wrow;
        if (MODE == 0) {
            int I = Nout, rr = r & 31, j = blockIdx.x * 64 + (r >> 5) * 16 + (rr & 15);
            j = min(j, I - 1);
            wrow = rr < 16 ? j : I + j;
        } else {
            wrow = min(blockIdx.x * GM_BN + r, Nout - 1);
        }
        b_src[q] = W + ((size_t)e * Nrows + wrow) * K;
    }
    int KT = (K + BK - 1) / BK;
    /* 16-row slices of this warp's WR rows inside the group (a group's last tile is often
     * partial): the others skip their ldmatrix and mma (warp-uniform) */
    int live = (m_end - (m0 + wm * WR) + 15) / 16;
    live = live < 0 ? 0 : live > MI ? MI : live;
    auto load = [&](int kt, int st) {
        int k0 = kt * BK + ch * 8;
        /* K % 8 == 0: a 16-byte chunk is all in or all past K; the last K step's tail is
         * zeros (the barrier before use orders them) */
#pragma unroll
        for (int q = 0; q < NQA; q++) {
            int r = tid / CPR + RP * q;
            if (BM % RP != 0 && r >= BM) continue;
            bf16 *ad = As + ((size_t)st * BM + r) * LD + ch * 8;
            if (k0 < K)
                cp_async16(ad, a_src[q] + k0);
            else
                *(uint4 *)ad = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int q = 0; q < NQB; q++) {
            int r = tid / CPR + RP * q;
            bf16 *bd = Bs + ((size_t)st * GM_BN + r) * LD + ch * 8;
            if (k0 < K)
                cp_async16(bd, b_src[q] + k0);
            else
                *(uint4 *)bd = make_uint4(0, 0, 0, 0);
        }
    };
    float acc[MI][4][4];
#pragma unroll
    for (int a = 0; a < MI; a++)
#pragma unroll
        for (int b = 0; b < 4; b++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                acc[a][b][c] = 0.0f;
#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        if (s < KT) load(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait_group<ST - 2>();
        __syncthreads();
        int nk = kt + ST - 1;
        if (nk < KT) load(nk, nk % ST);
        cp_async_commit();
        const bf16 *as = As + (size_t)(kt % ST) * BM * LD;
        const bf16 *bs = Bs + (size_t)(kt % ST) * GM_BN * LD;
        if (live == 0) continue; /* this warp's rows are past the group: loads only */
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[MI][4], bfr[2][4];
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
                if (mi < live)
                    ldsm_x4(af[mi], as + (size_t)(wm * WR + mi * 16 + (lane & 15)) * LD + kk +
                                        (lane >> 4) * 8);
#pragma unroll
            for (int nj = 0; nj < 2; nj++)
                ldsm_x4(bfr[nj],
                        bs + (size_t)(wn * 32 + nj * 16 + (lane >> 4) * 8 + (lane & 7)) * LD +
                            kk + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
                if (mi < live)
#pragma unroll
                    for (int ni = 0; ni < 4; ni++)
                        mma_bf16(acc[mi][ni], af[mi][0], af[mi][1], af[mi][2], af[mi][3],
                                 bfr[ni >> 1][(ni & 1) * 2], bfr[ni >> 1][(ni & 1) * 2 + 1]);
        }
    }
    cp_async_wait_all();
    /* epilogue */
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            int pos = m0 + wm * WR + mi * 16 + (lane >> 2) + hr * 8;
            if (pos >= m_end) continue;
            if (MODE == 0) {
                int I = Nout;
                bf16 *h = (bf16 *)outp + (size_t)pos * I;
#pragma unroll
                for (int ni = 0; ni < 2; ni++) {
                    int j = blockIdx.x * 64 + wn * 16 + ni * 8 + (lane & 3) * 2;
                    if (j < I) {
                        float g0 = acc[mi][ni][hr * 2], g1 = acc[mi][ni][hr * 2 + 1];
                        float u0 = acc[mi][ni + 2][hr * 2], u1 = acc[mi][ni + 2][hr * 2 + 1];
                        *(__nv_bfloat162 *)(h + j) =
                            __floats2bfloat162_rn(mo_silu_mul(g0, u0), mo_silu_mul(g1, u1));
                    }
                }
            } else {
#pragma unroll
                for (int ni = 0; ni < 4; ni++) {
                    int n = blockIdx.x * GM_BN + wn * 32 + ni * 8 + (lane & 3) * 2;
                    if (n >= Nout) continue;
                    if (MODE == 2)
                        *(__nv_bfloat162 *)((bf16 *)outp + (size_t)pos * Nout + n) =
                            __floats2bfloat162_rn(acc[mi][ni][hr * 2], acc[mi][ni][hr * 2 + 1]);
                    else
                        *(float2 *)((float *)outp + (size_t)pos * Nout + n) =
                            make_float2(acc[mi][ni][hr * 2], acc[mi][ni][hr * 2 + 1]);
                }
            }
        }
}

/* ---- host side ------------------------------------------------------------------------------ */

int moe_path(int T, int top_k, int n_experts, int max_pairs, int force_gemm) {
    if (max_pairs > MOE_DEC_MAXP) max_pairs = MOE_DEC_MAXP;
    long P = (long)T * top_k, active = P < n_experts ? P : n_experts;
    /* more than DEC_TT pairs an expert on average: the decode GEMVs would read an expert's
     * rows once per DEC_TT of its tokens, the grouped GEMM reads them once */
    return !force_gemm && P <= max_pairs && P <= DEC_TT * active ? MOE_PATH_DECODE : MOE_PATH_GEMM;
}

int moe_gemm_bm(int T, int top_k, int n_experts, int force) {
    if (force == 16 || force == 32 || force == 64 || force == 128) return force;
    if (force != -1) return 128;
    long P = (long)T * top_k, active = P < n_experts ? P : n_experts;
    long avg = active > 0 ? (P + active - 1) / active : 1; /* pairs an expert, rounded up */
    return avg <= 16 ? 16 : avg <= 32 ? 32 : avg <= 64 ? 64 : 128;
}

int moe_shape_ok(int hidden, int inter) {
    return hidden >= 8 && inter >= 8 && hidden % 8 == 0 && inter % 8 == 0;
}

/* the grouped GEMM's M tile for a call: a->gemm_bm (moe_gemm_bm), 128 with the K step 32 */
static int moe_tile_m(const moe_args *a) {
    int bm = a->gemm_bm;
    return a->gemm_bk32 || (bm != 16 && bm != 32 && bm != 64) ? 128 : bm;
}

/* workspace layout: [xb (T, H) bf16 when x is f32] [h (P, I) bf16] [y (P, H) f32]
 * then for the GEMM path [perm P] [inv P] [off E + 1] [tile_e MT] [tile_m0 MT] [n_tiles 1] */
typedef struct moe_lay {
    size_t xb, h, y, perm, inv, off, te, tm, nt, total;
    int max_tiles;
} moe_lay;

static moe_lay moe_layout(const moe_args *a) {
    moe_lay L;
    size_t P = (size_t)a->T * a->top_k, o = 0;
    L.xb = o;
    o += a->x_bf16 ? 0 : align256((size_t)a->T * a->hidden * 2);
    L.h = o;
    o += align256(P * a->inter * 2);
    L.y = o;
    o += align256(P * a->hidden * 4);
    int bm = moe_tile_m(a);
    L.max_tiles = (int)((P + bm - 1) / bm + (size_t)(a->n_experts < (int)P ? a->n_experts : P));
    L.perm = o;
    L.inv = L.off = L.te = L.tm = L.nt = o;
    if (a->path == MOE_PATH_GEMM) {
        o += align256(P * 4);
        L.inv = o;
        o += align256(P * 4);
        L.off = o;
        o += align256(((size_t)a->n_experts + 1) * 4);
        L.te = o;
        o += align256((size_t)L.max_tiles * 4);
        L.tm = o;
        o += align256((size_t)L.max_tiles * 4);
        L.nt = o;
        o += 256;
    }
    L.total = o;
    return L;
}

size_t moe_ws_bytes(const moe_args *a) {
    return moe_layout(a).total;
}

/* the grouped GEMMs (gate|up, then down) of one K step and M tile */
template <int BK, int BM>
static int moe_gemms(cudaStream_t st, dim3 g1, dim3 g2, bf16 *h, const bf16 *x, void *y,
                     const moe_args *a, const int32_t *perm, const int32_t *off, const int32_t *te,
                     const int32_t *tm, const int32_t *nt) {
    static int attr_done[64]; /* per device: the kernels' dynamic shared memory limit */
    int dev = 0, H = a->hidden, I = a->inter, k = a->top_k;
    constexpr int SM = GM_SMEM(BM, BK), NT = 128 * GM_WM(BM);
    CK(cudaGetDevice(&dev));
    if (dev < 0 || dev >= 64 || !attr_done[dev]) {
        CK(cudaFuncSetAttribute(k_moe_gemm<0, BK, BM>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, SM));
        CK(cudaFuncSetAttribute(k_moe_gemm<1, BK, BM>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, SM));
        CK(cudaFuncSetAttribute(k_moe_gemm<2, BK, BM>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, SM));
        if (dev >= 0 && dev < 64) attr_done[dev] = 1;
    }
    k_moe_gemm<0, BK, BM><<<g1, NT, SM, st>>>(h, x, (const bf16 *)a->w_gate_up_all, perm, off,
                                               te, tm, nt, k, H, 2 * I, I);
    int rc = launch_check("moe gemm gate_up");
    if (rc) return rc;
    if (a->y_bf16)
        k_moe_gemm<2, BK, BM><<<g2, NT, SM, st>>>(y, h, (const bf16 *)a->w_down_all, perm, off,
                                                   te, tm, nt, k, I, H, H);
    else
        k_moe_gemm<1, BK, BM><<<g2, NT, SM, st>>>(y, h, (const bf16 *)a->w_down_all, perm, off,
                                                   te, tm, nt, k, I, H, H);
    return launch_check("moe gemm down");
}

int moe_run(cudaStream_t st, int n_sm, void *ws, size_t ws_bytes, const moe_args *a) {
    if (n_sm < 1) n_sm = 1;
    int T = a->T, H = a->hidden, I = a->inter, E = a->n_experts, k = a->top_k;
    if (T <= 0) return 0;
    if (!moe_shape_ok(H, I) || E < 1 || E > BACKEND_MOE_MAX_EXPERTS || k < 1 || k > E)
        return -EINVAL;
    moe_lay L = moe_layout(a);
    if (L.total > ws_bytes) return -ENOMEM;
    if (L.max_tiles > 65535) return -EINVAL;
    char *w = (char *)ws;
    int P = T * k;
    const bf16 *x = (const bf16 *)a->x;
    if (!a->x_bf16) {
        size_t n = (size_t)T * H;
        k_moe_to_bf16<<<grid_for(n, 256), 256, 0, st>>>((bf16 *)(w + L.xb), (const float *)a->x, n);
        int rc = launch_check("moe x to bf16");
        if (rc) return rc;
        x = (const bf16 *)(w + L.xb);
    }
    bf16 *h = (bf16 *)(w + L.h);
    void *y = w + L.y; /* f32, or bf16 on the GEMM path with y_bf16 */
    const int32_t *inv = NULL;
    if (a->path == MOE_PATH_DECODE) {
        if (P > MOE_DEC_MAXP) return -EINVAL;
        /* slots: the distinct experts at most; row blocks a CTA: about two CTAs an SM over
         * all slots (the plan amortised over several blocks, one wave) */
        int slots = E < P ? E : P;
        int rb1 = (I + DEC_WARPS - 1) / DEC_WARPS,
            rb2 = (H + DN_NR * DEC_WARPS - 1) / (DN_NR * DEC_WARPS);
        int want = 2 * n_sm / slots; /* at most one wave of 2 CTAs an SM (128 registers) */
        if (want < 1) want = 1;
        dim3 g1(want < rb1 ? want : rb1, slots), g2(want < rb2 ? want : rb2, slots);
        k_moe_dec_gate_up<<<g1, 32 * DEC_WARPS, 0, st>>>(
            h, (const uint4 *)x, (const uint4 *)a->w_gate_up_all, a->ids, P, k, E, I, H / 8);
        int rc = launch_check("moe decode gate_up");
        if (rc) return rc;
        if (P <= FD_MAXP && a->fused_down) { /* down + the weighted sum, out directly */
            int gd = (H + DEC_WARPS - 1) / DEC_WARPS;
            if (a->out_bf16)
                k_moe_dec_down_fused<bf16><<<gd, 32 * DEC_WARPS, 0, st>>>(
                    (bf16 *)a->out, (const uint4 *)h, (const uint4 *)a->w_down_all, a->ids,
                    a->weights, P, k, E, H, I / 8);
            else
                k_moe_dec_down_fused<float><<<gd, 32 * DEC_WARPS, 0, st>>>(
                    (float *)a->out, (const uint4 *)h, (const uint4 *)a->w_down_all, a->ids,
                    a->weights, P, k, E, H, I / 8);
            return launch_check("moe decode down (fused sum)");
        }
        k_moe_dec_down<<<g2, 32 * DEC_WARPS, 0, st>>>(
            (float *)y, (const uint4 *)h, (const uint4 *)a->w_down_all, a->ids, P, E, H, I / 8);
        rc = launch_check("moe decode down");
        if (rc) return rc;
    } else {
        int32_t *perm = (int32_t *)(w + L.perm), *invw = (int32_t *)(w + L.inv),
                *off = (int32_t *)(w + L.off), *te = (int32_t *)(w + L.te),
                *tm = (int32_t *)(w + L.tm), *nt = (int32_t *)(w + L.nt);
        int bm = moe_tile_m(a);
        k_moe_sort<<<1, 1024, 0, st>>>(perm, invw, off, te, tm, nt, a->ids, P, E, bm);
        int rc = launch_check("moe sort");
        if (rc) return rc;
        dim3 g1((I + 63) / 64, L.max_tiles), g2((H + GM_BN - 1) / GM_BN, L.max_tiles);
#define MOE_GEMMS(BK, BM) moe_gemms<BK, BM>(st, g1, g2, h, x, y, a, perm, off, te, tm, nt)
        rc = a->gemm_bk32 ? MOE_GEMMS(32, 128)
             : bm == 16   ? MOE_GEMMS(64, 16)
             : bm == 32   ? MOE_GEMMS(64, 32)
             : bm == 64   ? MOE_GEMMS(64, 64)
                          : MOE_GEMMS(64, 128);
#undef MOE_GEMMS
        if (rc) return rc;
        inv = invw;
    }
    int by = (H + 255) / 256;
    dim3 gc(T, by > 8 ? 8 : by);
    int y16 = a->path == MOE_PATH_GEMM && a->y_bf16;
#define MOE_COMB(OT, YT)                                                                           \
    k_moe_combine<OT, YT>                                                                          \
        <<<gc, 256, 0, st>>>((OT *)a->out, (const YT *)y, a->ids, a->weights, inv, H, k, E)
    if (a->out_bf16 && y16)
        MOE_COMB(bf16, bf16);
    else if (a->out_bf16)
        MOE_COMB(bf16, float);
    else if (y16)
        MOE_COMB(float, bf16);
    else
        MOE_COMB(float, float);
#undef MOE_COMB
    return launch_check("moe combine");
}
