/*
 * cpu_matmul — AVX2/FMA kernels and run-time dispatch (see cpu_matmul.h for the canonical
 * dot every path follows).  Matmul work is split in tasks of (16 weight rows) x (64
 * tokens).  Decode-sized batches (T <= 2) convert weights in registers as they stream;
 * larger batches convert a 4-row panel to f32 once per task and run a 3-token x 4-row
 * register tile over it.  Both give the same canonical dots.  bf16-weight matmuls go to
 * cpu_avx512f.c (avx512f) or cpu_avx512bf16.c (avx512bf16*) when that ISA is in use.
 */
#include "kernels/cpu/cpu_matmul.h"

#include "base/log.h"

#include <cpuid.h>
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROWS_PER_TASK   16 /* weight rows per task (4 panels of 4) */
#define TOKENS_PER_TASK 96
#ifndef PREFETCH_GROUPS
#define PREFETCH_GROUPS 2 /* extra 4-row groups of prefetch distance in decode */
#endif

/* ---- ISA selection ------------------------------------------------------ */

static int g_isa = -1; /* cpu_isa, -1 until detected */
static char g_isa_why[256];

/* F16C through cpuid: clang before 15 does not know __builtin_cpu_supports("f16c"). */
static int isa_has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

static int isa_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && isa_has_f16c();
}

/* AVX512_BF16 is CPUID.(EAX=7,ECX=1):EAX[5]; __builtin_cpu_supports checks that the OS saves
 * the zmm state (XCR0) for the avx512 features. */
static int isa_has_avx512bf16(void) {
    unsigned a, b, c, d;
    if (!isa_has_avx2() || !__builtin_cpu_supports("avx512f") ||
        !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl"))
        return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    return (a >> 5) & 1;
}

/* AVX-512F (and the AVX2/FMA/F16C the rest of the kernels use) */
static int isa_has_avx512f(void) {
    return isa_has_avx2() && __builtin_cpu_supports("avx512f");
}

int cpu_isa_supported(cpu_isa isa) {
    switch (isa) {
    case CPU_ISA_SCALAR:
        return 1;
    case CPU_ISA_AVX2:
        return isa_has_avx2();
    case CPU_ISA_AVX512BF16:
    case CPU_ISA_AVX512BF16_FAST:
        return isa_has_avx512bf16();
    case CPU_ISA_AVX512F:
        return isa_has_avx512f();
    default:
        return 0;
    }
}

static const char *const ISA_NAMES[CPU_ISA_COUNT] = {"scalar", "avx2", "avx512bf16",
                                                     "avx512bf16-fast", "avx512f"};
/* The order cpu_isa_get() prefers (avx512bf16-fast is never chosen by itself). */
static const cpu_isa ISA_PREFERRED[] = {CPU_ISA_AVX512F, CPU_ISA_AVX512BF16, CPU_ISA_AVX2};

int cpu_isa_bf16_parts(cpu_isa isa) {
    return isa == CPU_ISA_AVX512BF16 ? 3 : isa == CPU_ISA_AVX512BF16_FAST ? 1 : 0;
}

static void isa_describe_cpu(char *buf, size_t len, const char *how) {
    __builtin_cpu_init();
    unsigned a = 0, b, c, d;
    int bf16 = __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1), avxvnni = (a >> 4) & 1;
    snprintf(buf, len, "%s (cpu has%s%s%s%s%s%s%s%s%s; %s)", ISA_NAMES[g_isa],
             __builtin_cpu_supports("avx2") ? " avx2" : "",
             __builtin_cpu_supports("fma") ? " fma" : "", isa_has_f16c() ? " f16c" : "",
             __builtin_cpu_supports("avx512f") ? " avx512f" : "",
             __builtin_cpu_supports("avx512bw") ? " avx512bw" : "",
             __builtin_cpu_supports("avx512vl") ? " avx512vl" : "", bf16 ? " avx512_bf16" : "",
             __builtin_cpu_supports("avx512vnni") ? " avx512_vnni" : "", avxvnni ? " avx_vnni" : "",
             how);
}

cpu_isa cpu_isa_get(void) {
    if (g_isa < 0) {
        int best = CPU_ISA_SCALAR;
        for (size_t i = 0; i < sizeof ISA_PREFERRED / sizeof ISA_PREFERRED[0]; i++)
            if (cpu_isa_supported(ISA_PREFERRED[i])) {
                best = ISA_PREFERRED[i];
                break;
            }
        const char *env = getenv("DISAGG_CPU_ISA"), *how = "the best this cpu runs";
        g_isa = best;
        if (env && *env) {
            int want = -1;
            for (int i = 0; i < CPU_ISA_COUNT; i++)
                if (!strcmp(env, ISA_NAMES[i])) want = i;
            if (want < 0)
                LOG_W("kernels",
                      "DISAGG_CPU_ISA='%s' not recognised (accepted: scalar, avx2, avx512f, "
                      "avx512bf16, avx512bf16-fast); using %s",
                      env, ISA_NAMES[best]);
            else if (!cpu_isa_supported((cpu_isa)want))
                LOG_W("kernels", "DISAGG_CPU_ISA=%s: this cpu cannot run it; using %s", env,
                      ISA_NAMES[best]);
            else
                g_isa = want, how = "forced by DISAGG_CPU_ISA";
        }
        isa_describe_cpu(g_isa_why, sizeof g_isa_why, how);
    }
    return (cpu_isa)g_isa;
}

const char *cpu_isa_describe(void) {
    cpu_isa_get();
    return g_isa_why;
}

int cpu_isa_force(cpu_isa isa) {
    if ((unsigned)isa >= CPU_ISA_COUNT || !cpu_isa_supported(isa)) return -1;
    cpu_isa_get(); /* detect first, so a later cpu_isa_get() does not undo the force */
    g_isa = isa;
    isa_describe_cpu(g_isa_why, sizeof g_isa_why, "forced");
    return 0;
}

const char *cpu_isa_name(cpu_isa isa) {
    return (unsigned)isa < CPU_ISA_COUNT ? ISA_NAMES[isa] : "unknown";
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

/* NT tokens (stride K, out stride N) against 2 weight rows (raw dtype) n0, n0+1: the weights
 * of each 8-block are converted once in registers and used by every token; 2 x 6 = 12
 * accumulators.  Decode batches of 3..8 tokens stream each weight row once this way. */
static inline __attribute__((always_inline)) void k_2xT(const int NT, float *y, int N,
                                                        const float *x, const void *w, cpu_dtype dt,
                                                        const float *bias, int n0, int K, int pf) {
    size_t o0 = (size_t)n0 * K, o1 = o0 + K;
    __m256 a0[6], a1[6];
    for (int t = 0; t < NT; t++)
        a0[t] = a1[t] = _mm256_setzero_ps();
    const size_t es = cpu_dtype_size(dt);
    const char *next = (const char *)w + (o0 + (size_t)pf * K) * es;
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        if (pf) {
            _mm_prefetch(next + (size_t)k * es, _MM_HINT_T0);
            _mm_prefetch(next + ((size_t)K + k) * es, _MM_HINT_T0);
        }
        __m256 w0 = load8(w, dt, o0 + k), w1 = load8(w, dt, o1 + k);
        for (int t = 0; t < NT; t++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)t * K + k);
            a0[t] = _mm256_fmadd_ps(xv, w0, a0[t]);
            a1[t] = _mm256_fmadd_ps(xv, w1, a1[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        const float *xt = x + (size_t)t * K;
        y[(size_t)t * N + n0] = finish(a0[t], xt, w, dt, o0, k, K, bias, n0);
        y[(size_t)t * N + n0 + 1] = finish(a1[t], xt, w, dt, o1, k, K, bias, n0 + 1);
    }
}

static inline __attribute__((always_inline)) void k_2xT_any(int nt, float *y, int N, const float *x,
                                                            const void *w, cpu_dtype dt,
                                                            const float *bias, int n0, int K,
                                                            int pf) {
    switch (nt) {
    case 1:
        k_2xT(1, y, N, x, w, dt, bias, n0, K, pf);
        break;
    case 2:
        k_2xT(2, y, N, x, w, dt, bias, n0, K, pf);
        break;
    case 3:
        k_2xT(3, y, N, x, w, dt, bias, n0, K, pf);
        break;
    case 4:
        k_2xT(4, y, N, x, w, dt, bias, n0, K, pf);
        break;
    case 5:
        k_2xT(5, y, N, x, w, dt, bias, n0, K, pf);
        break;
    default:
        k_2xT(6, y, N, x, w, dt, bias, n0, K, pf);
        break;
    }
}

/* ---- matmul ------------------------------------------------------------- */

#define STREAM_T 8 /* batches up to this many tokens stream the weights (decode) */

typedef struct mm_job {
    float *y;           /* (T, N) */
    const float *x;     /* (T, K) */
    const void *w;      /* (N, K) of wt */
    cpu_dtype wt;       /* weight dtype */
    const float *bias;  /* (N) or NULL */
    int T, N, K;        /* shapes */
    int rows_per_task;  /* weight rows per task (multiple of 4) */
    int row_tasks;      /* ceil(N / rows_per_task) */
    const uint16_t *xs; /* bf16 parts of x (avx512bf16* and bf16 weights), else NULL */
    int parts;          /* how many */
    const float *xp;    /* x rearranged for cpu_f32x_rows (avx512f, bf16 weights), else NULL */
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
    if (j->xs) {
        cpu_bf16x_rows(j->y + (size_t)t_beg * N, N,
                       j->xs + (size_t)t_beg * cpu_bf16x_stride(K, j->parts), t_end - t_beg, j->w,
                       j->bias, n_beg, n_end, K, j->T <= STREAM_T, j->parts);
        return;
    }
    if (j->xp) {
        cpu_f32x_rows(j->y + (size_t)t_beg * N, N, j->xp + (size_t)t_beg * cpu_f32x_stride(K),
                      t_end - t_beg, j->w, j->bias, n_beg, n_end, K, j->T <= STREAM_T);
        return;
    }
    if (t_end - t_beg <= 2) {
        for (; n + 4 <= n_end; n += 4)
            for (int t = t_beg; t < t_end; t++)
                k_1x4(j->y + (size_t)t * N, j->x + (size_t)t * K, j->w, dt, j->bias, n, K);
    } else if (j->T <= STREAM_T) {
        const int pf = 2 * (1 + PREFETCH_GROUPS);
        for (; n + 2 <= n_end; n += 2)
            for (int t = t_beg; t < t_end; t += 6) {
                int nt = t_end - t < 6 ? t_end - t : 6;
                k_2xT_any(nt, j->y + (size_t)t * N, N, j->x + (size_t)t * K, j->w, dt, j->bias, n,
                          K, t == t_beg && n + 2 + pf <= N ? pf : 0);
            }
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
    const int parts = cpu_isa_bf16_parts(cpu_isa_get());
    const int perm = cpu_isa_get() == CPU_ISA_AVX512F;
    for (int base = 0; base < n_ops; base += CPU_MATMUL_MAX_OPS) {
        mm_multi m = {.n = 0};
        int total = 0;
        /* avx512bf16: the activations of every bf16 op split once (ops sharing x share it) */
        size_t xs_need = 0;
        for (int i = base; parts && i < n_ops && i < base + CPU_MATMUL_MAX_OPS; i++)
            if (ops[i].wt == CPU_BF16 && ops[i].T > 0 && ops[i].N > 0)
                xs_need += (size_t)ops[i].T * cpu_bf16x_stride(ops[i].K, parts);
        uint16_t *xs_buf = xs_need ? (uint16_t *)cpu_scratch(2, (xs_need + 1) / 2 + 32) : NULL;
        size_t xs_used = 0;
        const uint16_t *xs_of[CPU_MATMUL_MAX_OPS] = {0};
        for (int i = base; xs_buf && i < n_ops && i < base + CPU_MATMUL_MAX_OPS; i++) {
            const cpu_matmul_op *op = &ops[i];
            if (op->wt != CPU_BF16 || op->T <= 0 || op->N <= 0) continue;
            for (int p = base; p < i && !xs_of[i - base]; p++)
                if (xs_of[p - base] && ops[p].x == op->x && ops[p].T == op->T && ops[p].K == op->K)
                    xs_of[i - base] = xs_of[p - base];
            if (xs_of[i - base]) continue;
            uint16_t *dst = xs_buf + xs_used;
            cpu_bf16x_split(dst, op->x, op->T, op->K, parts);
            xs_of[i - base] = dst;
            xs_used += (size_t)op->T * cpu_bf16x_stride(op->K, parts);
        }
        if (xs_need && !xs_buf) LOG_W("kernels", "out of memory for the bf16 split: avx2 path");
        /* avx512f: the activations of every bf16 op rearranged once (shared likewise) */
        size_t xp_need = 0;
        for (int i = base; perm && i < n_ops && i < base + CPU_MATMUL_MAX_OPS; i++)
            if (ops[i].wt == CPU_BF16 && ops[i].T > 0 && ops[i].N > 0)
                xp_need += (size_t)ops[i].T * cpu_f32x_stride(ops[i].K);
        float *xp_buf = xp_need ? cpu_scratch(2, xp_need + 16) : NULL;
        size_t xp_used = 0;
        const float *xp_of[CPU_MATMUL_MAX_OPS] = {0};
        for (int i = base; xp_buf && i < n_ops && i < base + CPU_MATMUL_MAX_OPS; i++) {
            const cpu_matmul_op *op = &ops[i];
            if (op->wt != CPU_BF16 || op->T <= 0 || op->N <= 0) continue;
            for (int p = base; p < i && !xp_of[i - base]; p++)
                if (xp_of[p - base] && ops[p].x == op->x && ops[p].T == op->T && ops[p].K == op->K)
                    xp_of[i - base] = xp_of[p - base];
            if (xp_of[i - base]) continue;
            float *dst = xp_buf + xp_used;
            cpu_f32x_perm(dst, op->x, op->T, op->K, op->T <= STREAM_T);
            xp_of[i - base] = dst;
            xp_used += (size_t)op->T * cpu_f32x_stride(op->K);
        }
        if (xp_need && !xp_buf)
            LOG_W("kernels", "out of memory for the f32x rearrangement: avx2 path");
        for (int i = base; i < n_ops && i < base + CPU_MATMUL_MAX_OPS; i++) {
            const cpu_matmul_op *op = &ops[i];
            if (op->T <= 0 || op->N <= 0) continue;
            /* decode-sized batches stream weights: few long contiguous row ranges per thread
             * keep the hardware prefetchers busy; larger batches use short panels (reuse) */
            int rpt = ROWS_PER_TASK;
            if (op->T <= STREAM_T) {
                int per = (op->N + cpu_pool_threads(pool) * 8 - 1) / (cpu_pool_threads(pool) * 8);
                rpt = per > rpt ? (per + 3) & ~3 : rpt;
            }
            mm_job *j = &m.jobs[m.n];
            *j = (mm_job){op->y,           op->x, op->w,          op->wt, op->bias,
                          op->T,           op->N, op->K,          rpt,    (op->N + rpt - 1) / rpt,
                          xs_of[i - base], parts, xp_of[i - base]};
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

/* ---- exp, softmax, SiLU and the attention pieces (AVX2 twins of cpu_ref.c) ------------ */

/* cpu_ref_expf on 8 lanes: the same operations in the same order */
static inline __attribute__((always_inline)) __m256 exp8(__m256 x) {
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_C1), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_C2), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    __m256 rr = _mm256_mul_ps(r, r);
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, rr, r), _mm256_set1_ps(1.0f));
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    /* out of range (x > HI: +inf, x < LO: 0); NaN: both compares false, NaN * scale = NaN */
    y = _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()),
                         _mm256_cmp_ps(x, _mm256_set1_ps(EXP_HI), _CMP_GT_OQ));
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(),
                         _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

float cpu_expf(float x) {
    return cpu_ref_expf(x);
}

void cpu_expf_vec(float *y, const float *x, int n) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        for (int i = 0; i < n; i++)
            y[i] = cpu_ref_expf(x[i]);
        return;
    }
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
    for (; i < n; i++)
        y[i] = cpu_ref_expf(x[i]);
}

void cpu_silu_mul(float *g, const float *u, int n) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        cpu_ref_silu_mul(g, u, n);
        return;
    }
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 d = _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, neg)));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(gv, d), _mm256_loadu_ps(u + i)));
    }
    if (i < n) cpu_ref_silu_mul(g + i, u + i, n - i);
}

/* 8 canonical dots at once, one per accumulator: lane p of the result is
 * ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) of A[p], the tree of hsum8. */
static inline __attribute__((always_inline)) __m256 hsum8x8(const __m256 *A) {
    __m256 x04 = _mm256_add_ps(_mm256_permute2f128_ps(A[0], A[4], 0x20),
                               _mm256_permute2f128_ps(A[0], A[4], 0x31));
    __m256 x15 = _mm256_add_ps(_mm256_permute2f128_ps(A[1], A[5], 0x20),
                               _mm256_permute2f128_ps(A[1], A[5], 0x31));
    __m256 x26 = _mm256_add_ps(_mm256_permute2f128_ps(A[2], A[6], 0x20),
                               _mm256_permute2f128_ps(A[2], A[6], 0x31));
    __m256 x37 = _mm256_add_ps(_mm256_permute2f128_ps(A[3], A[7], 0x20),
                               _mm256_permute2f128_ps(A[3], A[7], 0x31));
    /* [c0 c1 c2 c3] per position -> [c0+c2, c1+c3] */
    __m256 y01 = _mm256_add_ps(_mm256_shuffle_ps(x04, x15, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(x04, x15, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 y23 = _mm256_add_ps(_mm256_shuffle_ps(x26, x37, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(x26, x37, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __attribute__((always_inline)) void dot_rows_dt(float *out, const float *q,
                                                              const void *k, cpu_dtype dt,
                                                              size_t stride, int m, int n,
                                                              float scale) {
    const int n8 = n & ~7;
    const __m256 sc = _mm256_set1_ps(scale);
    int i = 0;
    for (; i + 8 <= m; i += 8) {
        const size_t kb = (size_t)i * stride;
        __m256 A[8];
        for (int p = 0; p < 8; p++)
            A[p] = _mm256_setzero_ps();
        for (int d = 0; d < n8; d += 8) {
            __m256 qv = _mm256_loadu_ps(q + d);
            for (int p = 0; p < 8; p++)
                A[p] = _mm256_fmadd_ps(qv, load8(k, dt, kb + (size_t)p * stride + d), A[p]);
        }
        __m256 s = hsum8x8(A);
        if (n8 < n) { /* the tail of each dot, in order, before the scale */
            float t[8];
            _mm256_storeu_ps(t, s);
            for (int p = 0; p < 8; p++)
                for (int d = n8; d < n; d++)
                    t[p] = __builtin_fmaf(q[d], load1(k, dt, kb + (size_t)p * stride + d), t[p]);
            s = _mm256_loadu_ps(t);
        }
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, sc));
    }
    for (; i < m; i++) {
        const size_t o = (size_t)i * stride;
        __m256 acc = _mm256_setzero_ps();
        int d = 0;
        for (; d + 8 <= n; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k, dt, o + d), acc);
        out[i] = finish(acc, q, k, dt, o, d, n, NULL, 0) * scale;
    }
}

void cpu_dot_rows(float *out, const float *q, const float *k, size_t stride, int m, int n,
                  float scale) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        cpu_ref_dot_rows(out, q, k, stride, m, n, scale);
        return;
    }
    dot_rows_dt(out, q, k, CPU_F32, stride, m, n, scale);
}

void cpu_dot_rows_bf16(float *out, const float *q, const uint16_t *k, size_t stride, int m, int n,
                       float scale) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        cpu_ref_dot_rows_bf16(out, q, k, stride, m, n, scale);
        return;
    }
    dot_rows_dt(out, q, k, CPU_BF16, stride, m, n, scale);
}

void cpu_softmax(float *s, int n) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        cpu_ref_softmax(s, n);
        return;
    }
    float mx;
    float sum = cpu_softmax_exp(s, n, &mx);
    int i;
    const __m256 sv = _mm256_set1_ps(sum);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(s + i, _mm256_div_ps(_mm256_loadu_ps(s + i), sv));
    for (; i < n; i++)
        s[i] = s[i] / sum;
}

static int isa_is_avx512(cpu_isa isa);

float cpu_softmax_exp(float *s, int n, float *max_out) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) return cpu_ref_softmax_exp(s, n, max_out);
    float mx = -__builtin_inff();
    int i = 0;
    __m256 mv = _mm256_set1_ps(mx);
    for (; i + 8 <= n; i += 8)
        mv = _mm256_max_ps(_mm256_loadu_ps(s + i), mv);
    float mm[8];
    _mm256_storeu_ps(mm, mv);
    for (int l = 0; l < 8; l++)
        mx = mm[l] > mx ? mm[l] : mx;
    for (; i < n; i++)
        mx = s[i] > mx ? s[i] : mx;
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    i = 0;
    if (isa_is_avx512(cpu_isa_get())) { /* 16 lanes at a time, the same operations */
        float a8[8];
        i = cpu_x512_softmax_exps(s, n, mx, a8);
        acc = _mm256_loadu_ps(a8);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mxv));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    for (; i < n; i++) {
        s[i] = cpu_ref_expf(s[i] - mx);
        sum += s[i];
    }
    *max_out = mx;
    return sum;
}

static inline __attribute__((always_inline)) void
axpy_rows_dt(float *y, const float *a, const void *v, cpu_dtype dt, size_t stride, int m, int n) {
    int c = 0;
    for (; c + 64 <= n; c += 64) { /* 64 columns of y stay in registers over all rows */
        __m256 acc[8];
        for (int r = 0; r < 8; r++)
            acc[r] = _mm256_loadu_ps(y + c + 8 * r);
        for (int i = 0; i < m; i++) {
            const size_t vi = (size_t)i * stride + c;
            __m256 av = _mm256_set1_ps(a[i]);
            for (int r = 0; r < 8; r++)
                acc[r] = _mm256_fmadd_ps(av, load8(v, dt, vi + 8 * r), acc[r]);
        }
        for (int r = 0; r < 8; r++)
            _mm256_storeu_ps(y + c + 8 * r, acc[r]);
    }
    for (; c + 8 <= n; c += 8) {
        __m256 acc = _mm256_loadu_ps(y + c);
        for (int i = 0; i < m; i++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(a[i]), load8(v, dt, (size_t)i * stride + c), acc);
        _mm256_storeu_ps(y + c, acc);
    }
    for (; c < n; c++)
        for (int i = 0; i < m; i++)
            y[c] = __builtin_fmaf(a[i], load1(v, dt, (size_t)i * stride + c), y[c]);
}

void cpu_axpy_rows(float *y, const float *a, const float *v, size_t stride, int m, int n) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        cpu_ref_axpy_rows(y, a, v, stride, m, n);
        return;
    }
    axpy_rows_dt(y, a, v, CPU_F32, stride, m, n);
}

void cpu_axpy_rows_bf16(float *y, const float *a, const uint16_t *v, size_t stride, int m, int n) {
    if (cpu_isa_get() == CPU_ISA_SCALAR) {
        cpu_ref_axpy_rows_bf16(y, a, v, stride, m, n);
        return;
    }
    axpy_rows_dt(y, a, v, CPU_BF16, stride, m, n);
}

void cpu_f32_to_bf16_row(uint16_t *out, const float *x, int n) {
    for (int i = 0; i < n; i++)
        out[i] = cpu_ref_f32_to_bf16(x[i]);
}

static int isa_is_avx512(cpu_isa isa) {
    return isa == CPU_ISA_AVX512F || isa == CPU_ISA_AVX512BF16 || isa == CPU_ISA_AVX512BF16_FAST;
}

static const void *kv_row(const void *k, int bf16, size_t off) {
    return bf16 ? (const void *)((const uint16_t *)k + off)
                : (const void *)((const float *)k + off);
}

void cpu_dot_rows_heads(float *const *out, const float *const *q, const void *const *k, int nh,
                        int bf16, size_t stride, int m, int n, float scale) {
    for (; nh > CPU_ATT_MAX_HEADS; out += CPU_ATT_MAX_HEADS, q += CPU_ATT_MAX_HEADS,
                                   k += CPU_ATT_MAX_HEADS, nh -= CPU_ATT_MAX_HEADS)
        cpu_dot_rows_heads(out, q, k, CPU_ATT_MAX_HEADS, bf16, stride, m, n, scale);
    int i = isa_is_avx512(cpu_isa_get())
                ? cpu_x512_dot_rows_heads(out, q, k, nh, bf16, stride, m, n, scale)
                : 0;
    if (i >= m) return;
    for (int h = 0; h < nh; h++) {
        const void *kr = kv_row(k[h], bf16, (size_t)i * stride);
        if (bf16)
            cpu_dot_rows_bf16(out[h] + i, q[h], kr, stride, m - i, n, scale);
        else
            cpu_dot_rows(out[h] + i, q[h], kr, stride, m - i, n, scale);
    }
}

void cpu_axpy_rows_heads(float *const *y, const float *const *a, const void *const *v, int nh,
                         int bf16, size_t stride, int m, int n) {
    for (; nh > CPU_ATT_MAX_HEADS; y += CPU_ATT_MAX_HEADS, a += CPU_ATT_MAX_HEADS,
                                   v += CPU_ATT_MAX_HEADS, nh -= CPU_ATT_MAX_HEADS)
        cpu_axpy_rows_heads(y, a, v, CPU_ATT_MAX_HEADS, bf16, stride, m, n);
    int c = isa_is_avx512(cpu_isa_get())
                ? cpu_x512_axpy_rows_heads(y, a, v, nh, bf16, stride, m, n)
                : 0;
    if (c >= n) return;
    for (int h = 0; h < nh; h++) {
        const void *vc = kv_row(v[h], bf16, (size_t)c);
        if (bf16)
            cpu_axpy_rows_bf16(y[h] + c, a[h], vc, stride, m, n - c);
        else
            cpu_axpy_rows(y[h] + c, a[h], vc, stride, m, n - c);
    }
}
