/*
 * cpu_matmul — the CPU compute kernels the Qwen2 forward needs: matrix multiply against
 * weights stored as f32, f16 or bf16 (converted to f32 in registers, never copied out),
 * dot products and axpy for attention, row conversion for embeddings.
 *
 * Batch-invariant numerics: every output element is one "canonical dot" computed the
 * same way whatever the batch, the tile it falls in, the thread or the ISA:
 *   8 lane accumulators a[l] += x[k]*w[k] (fused multiply-add) over full 8-blocks of k,
 *   s = ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), then s = fma(x[k], w[k], s) over the
 *   tail, then s + bias.
 * The AVX2/FMA kernels and the scalar reference (cpu_ref.c, compiled without AVX) give
 * bit-identical results; the ISA is chosen at run time (__builtin_cpu_supports), or forced
 * with DISAGG_CPU_ISA=scalar|avx2|avx512f|avx512bf16|avx512bf16-fast or cpu_isa_force().
 *
 * CPU_ISA_AVX512F (AVX-512F; the default wherever the CPU has it): bf16-weight matmuls widen
 * the weights to f32 in registers (one instruction per 16 weights) and use f32 FMAs with the
 * f32 activations: the "f32x16 dot" (cpu_avx512f.c: 16 lanes over the even then the odd
 * elements of each 32-k block, a fixed reduction tree).  Exact f32 products and fused adds
 * as in the canonical dot, a different summation order, so bf16 models give different
 * roundings than on avx2/scalar (not worse).  f32/f16 weights and the vector helpers keep
 * the canonical dot.
 *
 * CPU_ISA_AVX512BF16 (AVX-512F/BW/VL + AVX512_BF16): bf16-weight matmuls use `vdpbf16ps`
 * with the "bf16x3 dot" (cpu_avx512bf16.c: x split into three bf16 parts, 16 lanes of 32-k
 * blocks, a fixed reduction tree); f32/f16 weights and every vector helper below keep the
 * canonical dot above.  So batch invariance holds within each ISA, but bf16 models give
 * different (not worse: x keeps 24 significant bits) roundings on avx512bf16 than on
 * avx2/scalar: exactness across ISAs is not promised.  CPU_ISA_AVX512BF16_FAST (never chosen
 * by itself, only by DISAGG_CPU_ISA=avx512bf16-fast): the same with one part, i.e. the
 * activations rounded to bf16 as llama.cpp does -- about 3x the matmul throughput, relative
 * error up to 2^-9 per product.  AVX-VNNI and AMX have no kernels of their own yet.
 */
#ifndef DISAGG_KERNELS_CPU_MATMUL_H
#define DISAGG_KERNELS_CPU_MATMUL_H

#include "kernels/cpu/cpu_pool.h"

#include <stddef.h>
#include <stdint.h>

typedef enum cpu_dtype { CPU_F32 = 0, CPU_F16 = 1, CPU_BF16 = 2 } cpu_dtype;
typedef enum cpu_isa {
    CPU_ISA_SCALAR = 0,
    CPU_ISA_AVX2 = 1,
    CPU_ISA_AVX512BF16 = 2,
    CPU_ISA_AVX512BF16_FAST = 3, /* opt-in only: bf16 activations */
    CPU_ISA_AVX512F = 4,         /* bf16 weights widened to f32, f32 FMAs (cpu_avx512f.c) */
} cpu_isa;
#define CPU_ISA_COUNT 5
/* bf16 parts per activation of the bf16-weight matmul on isa: 3, 1, or 0 (not vdpbf16ps) */
int cpu_isa_bf16_parts(cpu_isa isa);

size_t cpu_dtype_size(cpu_dtype dt);
const char *cpu_dtype_name(cpu_dtype dt);

/* The ISA in use (detected on first call, DISAGG_CPU_ISA overrides). */
cpu_isa cpu_isa_get(void);
const char *cpu_isa_name(cpu_isa isa);
/* Forces an ISA (tests); returns -1 if the machine lacks it. */
int cpu_isa_force(cpu_isa isa);
/* 1 if this machine can run isa's kernels. */
int cpu_isa_supported(cpu_isa isa);
/* What the CPU offers and what was chosen, for the startup log: "avx512bf16 (cpu has
 * avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni avx_vnni; forced by
 * DISAGG_CPU_ISA)". */
const char *cpu_isa_describe(void);

/* y (T, N) = x (T, K) · w (N, K)^T + bias (N, may be NULL).  Rows of y are disjoint per
 * task; pool may be NULL. */
void cpu_matmul(cpu_pool *pool, float *y, const float *x, const void *w, cpu_dtype wt,
                const float *bias, int T, int N, int K);
/* Several independent matmuls in one pool dispatch (fewer synchronisations per decode
 * step); each result equals its own cpu_matmul. */
#define CPU_MATMUL_MAX_OPS 8
typedef struct cpu_matmul_op {
    float *y;          /* (T, N) out */
    const float *x;    /* (T, K) */
    const void *w;     /* (N, K) of wt */
    cpu_dtype wt;      /* weight dtype */
    const float *bias; /* (N) or NULL */
    int T, N, K;       /* shapes */
} cpu_matmul_op;
void cpu_matmul_batch(cpu_pool *pool, const cpu_matmul_op *ops, int n_ops);
/* Canonical dot of two f32 vectors of length n. */
float cpu_dot(const float *a, const float *b, int n);
/* y[i] = fma(a, x[i], y[i]) for i < n. */
void cpu_axpy(float *y, float a, const float *x, int n);
/* Attention helpers for m query heads that share one key/value row (GQA), each head's
 * result equal to cpu_dot / cpu_axpy on its own:
 * out[h] = dot(q (m, n) row h, k (n));  y (m, n) row h += a[h] * x (n). */
void cpu_dot_heads(float *out, const float *q, const float *k, int m, int n);
void cpu_axpy_heads(float *y, const float *a, const float *x, int m, int n);
/* out (n) = row (n) of dtype dt converted to f32. */
void cpu_row_to_f32(float *out, const void *row, cpu_dtype dt, int n);

/* Softmax/SiLU exponential: a vectorised approximation (the AVX2 path evaluates the same
 * operations on 8 lanes, so results are bit-identical between scalar and AVX2).  Maximum
 * relative error against exp() in double precision: 2 ulp (2.4e-7) on [-87.3, 88.7]; 0
 * below -87.3 (including -inf), +inf above 88.7, NaN for NaN (tested in test_kernels). */
float cpu_expf(float x);
/* y[i] = cpu_expf(x[i]) */
void cpu_expf_vec(float *y, const float *x, int n);
/* g[i] = g[i] / (1 + cpu_expf(-g[i])) * u[i]  (SwiGLU's SiLU(gate) * up) */
void cpu_silu_mul(float *g, const float *u, int n);
/* Attention pieces (each the same bit for bit on scalar and AVX2; the AVX2 code vectorises
 * across key positions):
 * out[i] = canonical dot(q, k + i * stride) * scale, i < m;
 * softmax in place: e_i = cpu_expf(s_i - max), sum = the canonical sum (8 lanes over full
 *   8-blocks, the dot's tree, the tail in order), s_i = e_i / sum;
 * y (n) = fma(a[i], v_i, y) for i = 0 .. m-1 in order, v_i = v + i * stride. */
void cpu_dot_rows(float *out, const float *q, const float *k, size_t stride, int m, int n,
                  float scale);
void cpu_softmax(float *s, int n);
/* cpu_softmax without the division: s_i = cpu_expf(s_i - max) in place, *max_out = max, and
 * returns the canonical sum (attention's partial softmax over one chunk of key positions) */
float cpu_softmax_exp(float *s, int n, float *max_out);
void cpu_axpy_rows(float *y, const float *a, const float *v, size_t stride, int m, int n);
/* The same with bf16 key / value rows (a bf16 KV cache; stride in elements): each element
 * widened to f32 exactly, then the same arithmetic as the f32 versions. */
void cpu_dot_rows_bf16(float *out, const float *q, const uint16_t *k, size_t stride, int m, int n,
                       float scale);
void cpu_axpy_rows_bf16(float *y, const float *a, const uint16_t *v, size_t stride, int m, int n);
/* nh query heads at once (in calls of CPU_ATT_MAX_HEADS): head h's scores out[h] (m) from its
 * query q[h] (n) against the key rows k[h] / its values y[h] (n) += a[h] (m) . the value rows
 * v[h] (f32, or bf16 when bf16 != 0; stride in elements; heads of one KV head pass the same
 * rows, next to each other).  Each head's result equal bit for bit to cpu_dot_rows(_bf16) /
 * cpu_axpy_rows(_bf16) on its own; on the AVX-512 ISAs the heads sharing rows load each row
 * once for up to 6 (scores) / 4 (values) heads, and odd heads of different rows pair up. */
#define CPU_ATT_MAX_HEADS 64
void cpu_dot_rows_heads(float *const *out, const float *const *q, const void *const *k, int nh,
                        int bf16, size_t stride, int m, int n, float scale);
void cpu_axpy_rows_heads(float *const *y, const float *const *a, const void *const *v, int nh,
                         int bf16, size_t stride, int m, int n);
/* their AVX-512 parts (cpu_avx512f.c; nh <= CPU_ATT_MAX_HEADS): how many positions / columns
 * they did for every head */
int cpu_x512_dot_rows_heads(float *const *out, const float *const *q, const void *const *k,
                            int nh, int bf16, size_t stride, int m, int n, float scale);
int cpu_x512_axpy_rows_heads(float *const *y, const float *const *a, const void *const *v, int nh,
                             int bf16, size_t stride, int m, int n);
/* cpu_softmax_exp's exponentials on AVX-512 (cpu_avx512f.c): s[i] = cpu_expf(s[i] - mx) for
 * i < the returned count (n rounded down to 16), acc8 = their 8-lane sum in position order,
 * bit for bit what the 8-lane loop gives */
int cpu_x512_softmax_exps(float *s, int n, float mx, float acc8[8]);
/* f32 -> bf16, round to nearest even (NaN stays NaN), n elements */
void cpu_f32_to_bf16_row(uint16_t *out, const float *x, int n);

/* The vdpbf16ps path (cpu_avx512bf16.c; call only when cpu_isa_bf16_parts() > 0), with
 * parts = 3 or 1: elements per token of the split activations; the split (T tokens of K f32
 * -> xs); and rows [n_beg, n_end) of y (T, N) = x . w^T (+ bias) for bf16 w (stream:
 * decode-sized T, prefetch ahead, rows outer). */
size_t cpu_bf16x_stride(int K, int parts);
void cpu_bf16x_split(uint16_t *xs, const float *x, int T, int K, int parts);
void cpu_bf16x_rows(float *y, int N, const uint16_t *xs, int T, const uint16_t *w,
                    const float *bias, int n_beg, int n_end, int K, int stream, int parts);
/* The f32x16 path (cpu_avx512f.c; call only on CPU_ISA_AVX512F): elements per token of the
 * rearranged activations (K rounded up to 32); the rearrangement (T tokens of K f32 -> xp:
 * per 32-block the 16 even then the 16 odd elements, zeros after K; token by token, or with
 * interleave != 0 block by block, block b of token t at (b * T + t) * 32, which `stream`
 * below reads); rows [n_beg, n_end) of y (T, N) = x . w^T (+ bias) for bf16 w (stream:
 * decode-sized T <= 8, xp interleaved, all T tokens). */
size_t cpu_f32x_stride(int K);
void cpu_f32x_perm(float *xp, const float *x, int T, int K, int interleave);
void cpu_f32x_rows(float *y, int N, const float *xp, int T, const uint16_t *w, const float *bias,
                   int n_beg, int n_end, int K, int stream);

/* Scalar reference implementations (cpu_ref.c); same results bit for bit. */
void cpu_ref_matmul(float *y, const float *x, const void *w, cpu_dtype wt, const float *bias, int T,
                    int N, int K);
float cpu_ref_dot(const float *a, const float *b, int n);
void cpu_ref_axpy(float *y, float a, const float *x, int n);
void cpu_ref_row_to_f32(float *out, const void *row, cpu_dtype dt, int n);
float cpu_ref_f16_to_f32(uint16_t h);
float cpu_ref_bf16_to_f32(uint16_t h);
/* The bf16xP dot written out in scalar code (emulating vdpbf16ps: each bf16 x bf16 product
 * exact, added odd element then even, round to nearest even, denormals flushed). */
uint16_t cpu_ref_f32_to_bf16(float f);
float cpu_ref_bf16x_dot(const float *x, const uint16_t *w, int K, int parts);
/* The f32x16 dot of the avx512f path written out in scalar code. */
float cpu_ref_f32x_dot(const float *x, const uint16_t *w, int K);
float cpu_ref_expf(float x);
void cpu_ref_silu_mul(float *g, const float *u, int n);
void cpu_ref_dot_rows(float *out, const float *q, const float *k, size_t stride, int m, int n,
                      float scale);
void cpu_ref_softmax(float *s, int n);
float cpu_ref_softmax_exp(float *s, int n, float *max_out);
void cpu_ref_axpy_rows(float *y, const float *a, const float *v, size_t stride, int m, int n);
void cpu_ref_dot_rows_bf16(float *out, const float *q, const uint16_t *k, size_t stride, int m,
                           int n, float scale);
void cpu_ref_axpy_rows_bf16(float *y, const float *a, const uint16_t *v, size_t stride, int m,
                            int n);

/* cpu_ref_expf's constants, shared by its vector twins (exp8 in cpu_matmul.c, exp16 in
 * cpu_avx512f.c) so that they cannot drift apart */
#define EXP_HI    88.3762626647949f
#define EXP_LO    -87.3365402221680f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1    0.693359375f
#define EXP_C2    -2.12194440e-4f

#endif
