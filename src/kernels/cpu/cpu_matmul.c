/*
 * cpu_matmul — AVX2/FMA kernels and run-time dispatch (see cpu_matmul.h for the canonical
 * dot every path follows).  Matmul work is split in tasks of (16 weight rows) x (64
 * tokens).  Decode-sized batches (T <= 2) convert weights in registers as they stream;
 * larger batches convert a 4-row panel to f32 once per task and run a 3-token x 4-row
 * register tile over it.  Both give the same canonical dots.
 */
#include "kernels/cpu/cpu_matmul.h"

#include "base/log.h"

#include <cpuid.h>
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define ROWS_PER_TASK   16 /* weight rows per task (4 panels of 4) */
#define TOKENS_PER_TASK 96
#ifndef PREFETCH_GROUPS
#define PREFETCH_GROUPS 2 /* extra 4-row groups of prefetch distance in decode */
#endif

/* ---- ISA selection ------------------------------------------------------ */

static int g_isa = -1; /* cpu_isa, -1 until detected */

/* F16C through cpuid: clang before 15 does not know __builtin_cpu_supports("f16c"). */
static int isa_has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

static int isa_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && isa_has_f16c();
}

cpu_isa cpu_isa_get(void) {
    if (g_isa < 0) {
        int avx2 = isa_has_avx2();
        const char *env = getenv("DISAGG_CPU_ISA");
        g_isa = avx2 ? CPU_ISA_AVX2 : CPU_ISA_SCALAR;
        if (env && !strcmp(env, "scalar"))
            g_isa = CPU_ISA_SCALAR;
        else if (env && strcmp(env, "avx2"))
            LOG_W("kernels", "DISAGG_CPU_ISA='%s' not recognised (accepted: scalar, avx2)", env);
    }
    return (cpu_isa)g_isa;
}

int cpu_isa_force(cpu_isa isa) {
    if (isa == CPU_ISA_AVX2 && !isa_has_avx2()) return -1;
    g_isa = isa;
    return 0;
}

const char *cpu_isa_name(cpu_isa isa) {
    return isa == CPU_ISA_AVX2 ? "avx2" : "scalar";
}

size_t cpu_dtype_size(cpu_dtype dt) {
    return dt == CPU_F32 ? 4 : 2;
}
const char *cpu_dtype_name(cpu_dtype dt) {
    return dt == CPU_F32 ? "f32" : dt == CPU_F16 ? "f16" : "bf16";
}

/* ---- AVX2 building blocks ----------------------------------------------- */

static inline __attribute__((always_inline)) __m256 load8(const void *w, cpu_dtype dt, size_t i) {
    if (dt == CPU_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dt == CPU_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm256_loadu_ps((const float *)w + i);
}

static inline __attribute__((always_inline)) float load1(const void *w, cpu_dtype dt, size_t i) {
    if (dt == CPU_BF16) return cpu_ref_bf16_to_f32(((const uint16_t *)w)[i]);
    if (dt == CPU_F16) return _cvtsh_ss(((const uint16_t *)w)[i]);
    return ((const float *)w)[i];
}

/* ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) */
static inline float hsum8(__m256 a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

static inline __attribute__((always_inline)) float finish(__m256 acc, const float *x, const void *w,
                                                          cpu_dtype dt, size_t woff, int k, int K,
                                                          const float *bias, int n) {
    float s = hsum8(acc);
    for (; k < K; k++)
        s = __builtin_fmaf(x[k], load1(w, dt, woff + k), s);
    return bias ? s + bias[n] : s;
}

/* One token against 4 weight rows (raw dtype): y[n0..n0+3]. */
static inline __attribute__((always_inline)) void
k_1x4(float *y, const float *x, const void *w, cpu_dtype dt, const float *bias, int n0, int K) {
    size_t o0 = (size_t)n0 * K, o1 = o0 + K, o2 = o1 + K, o3 = o2 + K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    /* the next 4 rows are prefetched as this group streams: rows are short (K * 2 bytes), too
     * short for the hardware prefetchers to pick up each one in time */
    const size_t es = cpu_dtype_size(dt);
    const char *next = (const char *)w + (o3 + K + (size_t)PREFETCH_GROUPS * 4 * K) * es;
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        _mm_prefetch(next + (size_t)k * 4 * es, _MM_HINT_T0);
        if (es == 4) _mm_prefetch(next + (size_t)k * 16 + 64, _MM_HINT_T0);
        __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(xv, load8(w, dt, o0 + k), a0);
        a1 = _mm256_fmadd_ps(xv, load8(w, dt, o1 + k), a1);
        a2 = _mm256_fmadd_ps(xv, load8(w, dt, o2 + k), a2);
        a3 = _mm256_fmadd_ps(xv, load8(w, dt, o3 + k), a3);
    }
    y[n0] = finish(a0, x, w, dt, o0, k, K, bias, n0);
    y[n0 + 1] = finish(a1, x, w, dt, o1, k, K, bias, n0 + 1);
    y[n0 + 2] = finish(a2, x, w, dt, o2, k, K, bias, n0 + 2);
    y[n0 + 3] = finish(a3, x, w, dt, o3, k, K, bias, n0 + 3);
}

static inline __attribute__((always_inline)) void
k_1x1(float *y, const float *x, const void *w, cpu_dtype dt, const float *bias, int n, int K) {
    size_t o = (size_t)n * K;
    __m256 a = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(w, dt, o + k), a);
    y[n] = finish(a, x, w, dt, o, k, K, bias, n);
}

/* Three tokens against a 4-row f32 panel p (4, K): y rows t0..t0+2 (stride N), cols n0..n0+3. */
static void k_3x4_panel(float *y, int N, const float *x, int K, const float *p, const float *bias,
                        int n0) {
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * (size_t)K;
    const float *p0 = p, *p1 = p + K, *p2 = p + 2 * (size_t)K, *p3 = p + 3 * (size_t)K;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
    __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00, c20 = c00, c21 = c00, c22 = c00, c23 = c00;
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k),
               v2 = _mm256_loadu_ps(x2 + k);
        __m256 w = _mm256_loadu_ps(p0 + k);
        c00 = _mm256_fmadd_ps(v0, w, c00);
        c10 = _mm256_fmadd_ps(v1, w, c10);
        c20 = _mm256_fmadd_ps(v2, w, c20);
        w = _mm256_loadu_ps(p1 + k);
        c01 = _mm256_fmadd_ps(v0, w, c01);
        c11 = _mm256_fmadd_ps(v1, w, c11);
        c21 = _mm256_fmadd_ps(v2, w, c21);
        w = _mm256_loadu_ps(p2 + k);
        c02 = _mm256_fmadd_ps(v0, w, c02);
        c12 = _mm256_fmadd_ps(v1, w, c12);
        c22 = _mm256_fmadd_ps(v2, w, c22);
        w = _mm256_loadu_ps(p3 + k);
        c03 = _mm256_fmadd_ps(v0, w, c03);
        c13 = _mm256_fmadd_ps(v1, w, c13);
        c23 = _mm256_fmadd_ps(v2, w, c23);
    }
    __m256 acc[3][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}};
    const float *xs[3] = {x0, x1, x2};
    for (int t = 0; t < 3; t++)
        for (int j = 0; j < 4; j++)
            y[(size_t)t * N + n0 + j] =
                finish(acc[t][j], xs[t], p, CPU_F32, (size_t)j * K, k, K, bias, n0 + j);
}

/* ---- matmul ------------------------------------------------------------- */

typedef struct mm_job {
    float *y;          /* (T, N) */
    const float *x;    /* (T, K) */
    const void *w;     /* (N, K) of wt */
    cpu_dtype wt;      /* weight dtype */
    const float *bias; /* (N) or NULL */
    int T, N, K;       /* shapes */
    int rows_per_task; /* weight rows per task (multiple of 4) */
    int row_tasks;     /* ceil(N / rows_per_task) */
} mm_job;

static inline __attribute__((always_inline)) void mm_task_dt(const mm_job *j, int task,
                                                             cpu_dtype dt) {
    int rt = task % j->row_tasks, tt = task / j->row_tasks;
    int n_beg = rt * j->rows_per_task, n_end = n_beg + j->rows_per_task;
    if (n_end > j->N) n_end = j->N;
    int t_beg = tt * TOKENS_PER_TASK, t_end = t_beg + TOKENS_PER_TASK;
    if (t_end > j->T) t_end = j->T;
    int K = j->K, N = j->N;
    int n = n_beg;
    if (t_end - t_beg <= 2) {
        for (; n + 4 <= n_end; n += 4)
            for (int t = t_beg; t < t_end; t++)
                k_1x4(j->y + (size_t)t * N, j->x + (size_t)t * K, j->w, dt, j->bias, n, K);
    } else {
        float *panel = cpu_scratch(0, 4 * (size_t)K); /* (4, K) f32 panel */
        for (; panel && n + 4 <= n_end; n += 4) {
            for (int r = 0; r < 4; r++) {
                const size_t o = (size_t)(n + r) * K;
                float *dst = panel + (size_t)r * K;
                int k = 0;
                for (; k + 8 <= K; k += 8)
                    _mm256_storeu_ps(dst + k, load8(j->w, dt, o + k));
                for (; k < K; k++)
                    dst[k] = load1(j->w, dt, o + k);
            }
            int t = t_beg;
            for (; t + 3 <= t_end; t += 3)
                k_3x4_panel(j->y + (size_t)t * N, N, j->x + (size_t)t * K, K, panel, j->bias, n);
            for (; t < t_end; t++)
                k_1x4(j->y + (size_t)t * N + n, j->x + (size_t)t * K, panel, CPU_F32,
                      j->bias ? j->bias + n : NULL, 0, K);
        }
    }
    for (; n < n_end; n++)
        for (int t = t_beg; t < t_end; t++)
            k_1x1(j->y + (size_t)t * N, j->x + (size_t)t * K, j->w, dt, j->bias, n, K);
}

static void mm_task(void *ctx, int task) {
    const mm_job *j = ctx;
    switch (j->wt) {
    case CPU_BF16:
        mm_task_dt(j, task, CPU_BF16);
        break;
    case CPU_F16:
        mm_task_dt(j, task, CPU_F16);
        break;
    default:
        mm_task_dt(j, task, CPU_F32);
        break;
    }
}

typedef struct mm_multi {
    mm_job jobs[CPU_MATMUL_MAX_OPS];   /* one per op */
    int first[CPU_MATMUL_MAX_OPS + 1]; /* first task of each op; first[n] = total */
    int n;                             /* ops */
} mm_multi;

static void mm_multi_task(void *ctx, int task) {
    const mm_multi *m = ctx;
    int o = 0;
    while (task >= m->first[o + 1])
        o++;
    mm_task((void *)&m->jobs[o], task - m->first[o]);
}

void cpu_matmul_batch(cpu_pool *pool, const cpu_matmul_op *ops, int n_ops) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        for (int i = 0; i < n_ops; i++)
            if (ops[i].T > 0 && ops[i].N > 0)
                cpu_ref_matmul(ops[i].y, ops[i].x, ops[i].w, ops[i].wt, ops[i].bias, ops[i].T,
                               ops[i].N, ops[i].K);
        return;
    }
    for (int base = 0; base < n_ops; base += CPU_MATMUL_MAX_OPS) {
        mm_multi m = {.n = 0};
        int total = 0;
        for (int i = base; i < n_ops && i < base + CPU_MATMUL_MAX_OPS; i++) {
            const cpu_matmul_op *op = &ops[i];
            if (op->T <= 0 || op->N <= 0) continue;
            /* decode-sized batches stream weights: few long contiguous row ranges per thread
             * keep the hardware prefetchers busy; larger batches use short panels (reuse) */
            int rpt = ROWS_PER_TASK;
            if (op->T <= 2) {
                int per = (op->N + cpu_pool_threads(pool) * 8 - 1) / (cpu_pool_threads(pool) * 8);
                rpt = per > rpt ? (per + 3) & ~3 : rpt;
            }
            mm_job *j = &m.jobs[m.n];
            *j = (mm_job){op->y, op->x, op->w, op->wt, op->bias,
                          op->T, op->N, op->K, rpt,    (op->N + rpt - 1) / rpt};
            m.first[m.n++] = total;
            total += j->row_tasks * ((op->T + TOKENS_PER_TASK - 1) / TOKENS_PER_TASK);
        }
        m.first[m.n] = total;
        cpu_pool_run(pool, total, mm_multi_task, &m);
    }
}

void cpu_matmul(cpu_pool *pool, float *y, const float *x, const void *w, cpu_dtype wt,
                const float *bias, int T, int N, int K) {
    cpu_matmul_op op = {y, x, w, wt, bias, T, N, K};
    cpu_matmul_batch(pool, &op, 1);
}

/* ---- vector helpers ----------------------------------------------------- */

float cpu_dot(const float *a, const float *b, int n) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) return cpu_ref_dot(a, b, n);
    __m256 acc = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= n; k += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    return finish(acc, a, b, CPU_F32, 0, k, n, NULL, 0);
}

void cpu_axpy(float *y, float a, const float *x, int n) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        cpu_ref_axpy(y, a, x, n);
        return;
    }
    __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] = __builtin_fmaf(a, x[i], y[i]);
}

void cpu_dot_heads(float *out, const float *q, const float *k, int m, int n) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        for (int h = 0; h < m; h++)
            out[h] = cpu_ref_dot(q + (size_t)h * n, k, n);
        return;
    }
    for (int h = 0; h < m; h++) {
        const float *a = q + (size_t)h * n;
        __m256 acc = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= n; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(k + i), acc);
        out[h] = finish(acc, a, k, CPU_F32, 0, i, n, NULL, 0);
    }
}

void cpu_axpy_heads(float *y, const float *a, const float *x, int m, int n) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        for (int h = 0; h < m; h++)
            cpu_ref_axpy(y + (size_t)h * n, a[h], x, n);
        return;
    }
    for (int h = 0; h < m; h++) {
        float *yh = y + (size_t)h * n;
        __m256 av = _mm256_set1_ps(a[h]);
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(yh + i,
                             _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(yh + i)));
        for (; i < n; i++)
            yh[i] = __builtin_fmaf(a[h], x[i], yh[i]);
    }
}

void cpu_row_to_f32(float *out, const void *row, cpu_dtype dt, int n) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        cpu_ref_row_to_f32(out, row, dt, n);
        return;
    }
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, load8(row, dt, (size_t)i));
    for (; i < n; i++)
        out[i] = load1(row, dt, (size_t)i);
}
