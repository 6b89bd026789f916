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
 * with DISAGG_CPU_ISA=scalar|avx2 or cpu_isa_force().
 */
#ifndef DISAGG_KERNELS_CPU_MATMUL_H
#define DISAGG_KERNELS_CPU_MATMUL_H

#include "kernels/cpu/cpu_pool.h"

#include <stddef.h>
#include <stdint.h>

typedef enum cpu_dtype { CPU_F32 = 0, CPU_F16 = 1, CPU_BF16 = 2 } cpu_dtype;
typedef enum cpu_isa { CPU_ISA_SCALAR = 0, CPU_ISA_AVX2 = 1 } cpu_isa;

size_t cpu_dtype_size(cpu_dtype dt);
const char *cpu_dtype_name(cpu_dtype dt);

/* The ISA in use (detected on first call, DISAGG_CPU_ISA overrides). */
cpu_isa cpu_isa_get(void);
const char *cpu_isa_name(cpu_isa isa);
/* Forces an ISA (tests); returns -1 if the machine lacks it. */
int cpu_isa_force(cpu_isa isa);

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

/* Scalar reference implementations (cpu_ref.c); same results bit for bit. */
void cpu_ref_matmul(float *y, const float *x, const void *w, cpu_dtype wt, const float *bias, int T,
                    int N, int K);
float cpu_ref_dot(const float *a, const float *b, int n);
void cpu_ref_axpy(float *y, float a, const float *x, int n);
void cpu_ref_row_to_f32(float *out, const void *row, cpu_dtype dt, int n);
float cpu_ref_f16_to_f32(uint16_t h);
float cpu_ref_bf16_to_f32(uint16_t h);

#endif
