/*
 * cpu_backend — kernels/backend.h on the CPU (see cpu_backend.h).  Threading as the
 * original forward had it: matmuls split weight rows (cpu_matmul.c), attention splits
 * (token, KV head) pairs or, for a decode step, (token, key chunk) pairs, SwiGLU splits
 * tokens; embeddings, norms, RoPE, KV writes and residual adds run on the calling thread.
 * None of these splits changes any value.
 */
#include "kernels/cpu/cpu_backend.h"

#include "base/log.h"
#include "kernels/backend_impl.h"
#include "kernels/cpu/cpu_matmul.h"
#include "kernels/fp8.h"

#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MOD "cpu_backend"

/* ---- device ------------------------------------------------------------------------ */

typedef struct cpu_ctx {
    cpu_pool *pool; /* the backend's own threads (NULL for backend_cpu_default) */
} cpu_ctx;

static const backend_iface cpu_iface;

static void cpu_fill(backend *be) {
    be->iface = &cpu_iface;
    snprintf(be->name, sizeof be->name, "cpu");
    snprintf(be->location, sizeof be->location, "cpu:0");
    be->is_cpu = 1;
    be->attention_window = 1;
    be->act_dtype = BACKEND_F32;
    be->kv_dtype = BACKEND_F32;
    be->kv_dtypes = 1u << BACKEND_F32 | 1u << BACKEND_BF16 |
                    1u << BACKEND_F8E4M3; /* bf16, fp8: opt-in (half, a quarter of the bytes) */
}

int cpu_backend_open(const backend_options *opts, backend **out, char *err, size_t errlen) {
    backend *be = calloc(1, sizeof *be);
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        snprintf(err, errlen, "out of memory opening the CPU backend");
        return -ENOMEM;
    }
    c->pool = cpu_pool_init(opts ? opts->n_threads : 0);
    if (!c->pool) {
        free(be);
        free(c);
        snprintf(err, errlen, "cannot start the CPU backend's threads");
        return -ENOMEM;
    }
    cpu_fill(be);
    be->ctx = c;
    *out = be;
    return 0;
}

backend *backend_cpu_default(void) {
    static backend g_cpu;
    static cpu_ctx g_ctx;
    static atomic_int g_init;
    if (!atomic_load(&g_init)) { /* racing initialisers write the same values */
        cpu_fill(&g_cpu);
        g_cpu.ctx = &g_ctx;
        g_cpu.is_static = 1;
        atomic_store(&g_init, 1);
    }
    return &g_cpu;
}

static void cpu_free(backend *be) {
    cpu_ctx *c = be->ctx;
    cpu_pool_free(c->pool);
    free(c);
    free(be);
}

static int cpu_memory(const backend *be, size_t *free_b, size_t *total_b) {
    long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES),
         page = sysconf(_SC_PAGESIZE);
    size_t total = pages > 0 && page > 0 ? (size_t)pages * (size_t)page : (size_t)8 << 30;
    size_t fr = avail > 0 && page > 0 ? (size_t)avail * (size_t)page : total;
    if (free_b) *free_b = fr;
    if (total_b) *total_b = total;
    return 0;
}

/* ---- buffers ---------------------------------------------------------------------- */

enum { BUF_HEAP = 0, BUF_MAP = 1, BUF_ALIAS = 2 }; /* b->impl holds one of these */

static int cpu_buffer_alloc(backend *be, backend_buffer *b, size_t bytes, int flags) {
    void *p;
    intptr_t kind;
    if (flags & BACKEND_BUF_KV) {
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
        if (p == MAP_FAILED) {
            LOG_E(MOD, "cannot map a KV region of %zu bytes: %s", bytes, strerror(errno));
            return -ENOMEM;
        }
        /* huge pages: fewer page pins for every KV transfer (shm and tcp), fewer TLB misses */
        madvise(p, bytes, MADV_HUGEPAGE);
        kind = BUF_MAP;
    } else {
        /* calloc: a large zeroed buffer comes as fresh zero pages, touched only when used */
        p = flags & BACKEND_BUF_ZERO ? calloc(1, bytes) : malloc(bytes);
        if (!p) {
            LOG_E(MOD, "out of memory allocating %zu bytes", bytes);
            return -ENOMEM;
        }
        kind = BUF_HEAP;
    }
    b->ptr = p;
    b->size = bytes;
    b->is_host = 1;
    b->impl = (void *)kind;
    return 0;
}

static int cpu_weights_load(backend *be, backend_buffer *b, const void *src, backend_dtype src_dt,
                            size_t n, backend_dtype *stored) {
    b->ptr = (void *)src; /* zero copy: the caller's mapping outlives the buffer */
    b->size = n * backend_dtype_size(src_dt);
    b->is_host = 1;
    b->impl = (void *)(intptr_t)BUF_ALIAS;
    *stored = src_dt;
    return 0;
}

static void cpu_buffer_free(backend *be, backend_buffer *b) {
    switch ((intptr_t)b->impl) {
    case BUF_MAP:
        munmap(b->ptr, b->size);
        break;
    case BUF_HEAP:
        free(b->ptr);
        break;
    default:
        break;
    }
}

/* ---- streams and the plan ------------------------------------------------------------ */

typedef struct cpu_stream {
    cpu_pool *pool;      /* threads for the work (NULL = inline) */
    cpu_pool *owned;     /* pool, when the stream made it (cpu_backend_stream_create) */
    backend_batch b;     /* the current plan; arrays point into the copies below */
    int32_t *tok_arrays; /* tokens, tok_seq, tok_pos, out_rows: 4 * tok_cap */
    int tok_cap;
    int32_t *seq_arrays; /* qo_indptr, kv_len, bt_indptr: 3 * (seq_cap + 1) */
    int seq_cap;
    int32_t *bt; /* bt_indices (bt_cap) */
    int bt_cap;
    int *att_c0; /* attention's chunk split: chunk offsets per token */
    size_t att_c0_cap;
    float *att_part;     /* and its partials */
    size_t att_part_cap; /* floats */
} cpu_stream;

static int stream_init(backend_stream *st, cpu_pool *pool) {
    cpu_stream *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    s->pool = pool;
    st->impl = s;
    return 0;
}

static int cpu_stream_create(backend *be, backend_stream *st) {
    return stream_init(st, ((cpu_ctx *)be->ctx)->pool);
}

backend_stream *cpu_backend_stream_create(backend *be, int n_threads) {
    if (!be || be->iface != &cpu_iface) {
        LOG_E(MOD, "cpu_backend_stream_create: %s is not the CPU backend",
              be ? be->name : "(null)");
        return NULL;
    }
    cpu_pool *pool = NULL;
    if (n_threads != 1 && !(pool = cpu_pool_init(n_threads))) return NULL;
    backend_stream *st = calloc(1, sizeof *st);
    if (st) st->be = be;
    if (!st || stream_init(st, pool)) {
        free(st);
        cpu_pool_free(pool);
        return NULL;
    }
    ((cpu_stream *)st->impl)->owned = pool;
    return st;
}

static void cpu_stream_free(backend_stream *st) {
    cpu_stream *s = st->impl;
    cpu_pool_free(s->owned);
    free(s->tok_arrays);
    free(s->seq_arrays);
    free(s->bt);
    free(s->att_c0);
    free(s->att_part);
    free(s);
}

static int cpu_stream_sync(backend_stream *st) {
    return 0; /* every operation finished before it returned */
}

static int cpu_upload(backend_stream *st, void *dev, const void *host, size_t bytes) {
    memcpy(dev, host, bytes);
    return 0;
}

static int cpu_copy(backend_stream *st, void *dst, const void *src, size_t bytes) {
    memcpy(dst, src, bytes);
    return 0;
}

static int cpu_memset_zero(backend_stream *st, void *dev, size_t bytes) {
    memset(dev, 0, bytes);
    return 0;
}

/* grows *arr to hold `need` elements of `per` int32 groups */
static int grow(int32_t **arr, int *cap, int need, int groups) {
    if (need <= *cap) return 0;
    int n = need > 2 * *cap ? need : 2 * *cap;
    int32_t *p = realloc(*arr, (size_t)n * (size_t)groups * sizeof *p);
    if (!p) return -ENOMEM;
    *arr = p;
    *cap = n;
    return 0;
}

static int cpu_plan(backend_stream *st, const backend_batch *b) {
    cpu_stream *s = st->impl;
    int T = b->n_tokens, S = b->n_seqs, nbt = b->bt_indptr[S];
    if (grow(&s->tok_arrays, &s->tok_cap, T, 4) || grow(&s->seq_arrays, &s->seq_cap, S + 1, 3) ||
        grow(&s->bt, &s->bt_cap, nbt > 0 ? nbt : 1, 1)) {
        LOG_E(MOD, "out of memory planning %d tokens of %d sequences", T, S);
        return -ENOMEM;
    }
    int32_t *t = s->tok_arrays, *q = s->seq_arrays;
    size_t tc = (size_t)s->tok_cap, sc = (size_t)s->seq_cap;
    memcpy(t, b->tokens, (size_t)T * 4);
    memcpy(t + tc, b->tok_seq, (size_t)T * 4);
    memcpy(t + 2 * tc, b->tok_pos, (size_t)T * 4);
    if (b->n_out) memcpy(t + 3 * tc, b->out_rows, (size_t)b->n_out * 4);
    memcpy(q, b->qo_indptr, (size_t)(S + 1) * 4);
    memcpy(q + sc, b->kv_len, (size_t)S * 4);
    memcpy(q + 2 * sc, b->bt_indptr, (size_t)(S + 1) * 4);
    if (nbt) memcpy(s->bt, b->bt_indices, (size_t)nbt * 4);
    s->b = *b;
    s->b.tokens = t;
    s->b.tok_seq = t + tc;
    s->b.tok_pos = t + 2 * tc;
    s->b.out_rows = t + 3 * tc;
    s->b.qo_indptr = q;
    s->b.kv_len = q + sc;
    s->b.bt_indptr = q + 2 * sc;
    s->b.bt_indices = s->bt;
    return 0;
}

static const backend_batch *plan_of(backend_stream *st) {
    cpu_stream *s = st->impl;
    return s->tok_arrays ? &s->b : NULL;
}

#define NEED_PLAN(op)                                                                              \
    const backend_batch *pb = plan_of(st);                                                         \
    if (!pb) {                                                                                     \
        LOG_E(MOD, "%s before any backend_plan on the stream", op);                                \
        return -EINVAL;                                                                            \
    }

#define NEED_F32(op, cond)                                                                         \
    if (!(cond)) {                                                                                 \
        LOG_E(MOD, "%s: the CPU backend computes in float32 only", op);                            \
        return -ENOTSUP;                                                                           \
    }

/* ---- small operations ---------------------------------------------------------------- */

static int cpu_embed(backend_stream *st, void *out, backend_dtype out_dt, const void *table,
                     backend_dtype table_dt, int hidden) {
    NEED_PLAN("embed");
    NEED_F32("embed", out_dt == BACKEND_F32);
    size_t row_bytes = (size_t)hidden * backend_dtype_size(table_dt);
    for (int t = 0; t < pb->n_tokens; t++)
        cpu_row_to_f32((float *)out + (size_t)t * hidden,
                       (const char *)table + (size_t)pb->tokens[t] * row_bytes, (cpu_dtype)table_dt,
                       hidden);
    return 0;
}

/* out (n) = w * (x / sqrt(mean(x^2) + eps)) */
static void rmsnorm_row(float *out, const float *x, const float *w, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++)
        out[i] = w[i] * (x[i] * inv);
}

static int cpu_rmsnorm(backend_stream *st, void *out, backend_dtype out_dt, const void *x,
                       backend_dtype x_dt, const float *w, int rows, int n, float eps) {
    NEED_F32("rmsnorm", out_dt == BACKEND_F32 && x_dt == BACKEND_F32);
    for (int r = 0; r < rows; r++)
        rmsnorm_row((float *)out + (size_t)r * n, (const float *)x + (size_t)r * n, w, n, eps);
    return 0;
}

static int cpu_matmul_ops(backend_stream *st, const backend_matmul_op *ops, int n_ops) {
    cpu_matmul_op m[BACKEND_MATMUL_MAX_OPS];
    for (int i = 0; i < n_ops; i++) {
        NEED_F32("matmul", ops[i].x_dt == BACKEND_F32 && ops[i].y_dt == BACKEND_F32);
        m[i] = (cpu_matmul_op){ops[i].y,    ops[i].x, ops[i].w, (cpu_dtype)ops[i].w_dt,
                               ops[i].bias, ops[i].T, ops[i].N, ops[i].K};
    }
    cpu_matmul_batch(((cpu_stream *)st->impl)->pool, m, n_ops);
    return 0;
}

/* rotate-half RoPE on n_heads vectors of head_dim at vec (n_heads, head_dim) */
static void rope_heads(float *vec, int n_heads, int head_dim, const float *cosv,
                       const float *sinv) {
    int half = head_dim / 2;
    for (int hh = 0; hh < n_heads; hh++) {
        float *v = vec + (size_t)hh * head_dim;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cosv[i] - b * sinv[i];
            v[i + half] = b * cosv[i] + a * sinv[i];
        }
    }
}

static int cpu_rope(backend_stream *st, void *q, int n_q_heads, void *k, int n_k_heads,
                    backend_dtype dt, int head_dim, const float *inv_freq) {
    NEED_PLAN("rope");
    NEED_F32("rope", dt == BACKEND_F32);
    int half = head_dim / 2;
    float cosv[512], sinv[512]; /* head_dim <= 1024 (checked in backend.c) */
    for (int t = 0; t < pb->n_tokens; t++) {
        float pos = (float)pb->tok_pos[t];
        for (int i = 0; i < half; i++) {
            float a = pos * inv_freq[i];
            cosv[i] = cosf(a);
            sinv[i] = sinf(a);
        }
        rope_heads((float *)q + (size_t)t * n_q_heads * head_dim, n_q_heads, head_dim, cosv, sinv);
        if (k)
            rope_heads((float *)k + (size_t)t * n_k_heads * head_dim, n_k_heads, head_dim, cosv,
                       sinv);
    }
    return 0;
}

/* K (which = 0) or V (which = 1) of position pos of sequence seq, layer l: (kv_dim) elements
 * of the KV dtype (f32 or bf16) */
static inline void *kv_at(const backend_kv *kv, const backend_batch *pb, int seq, int pos, int l,
                          int which) {
    size_t kv_dim = (size_t)kv->n_kv_heads * kv->head_dim;
    size_t blk = (size_t)pb->bt_indices[pb->bt_indptr[seq] + pos / kv->block_size],
           slot = (size_t)(pos % kv->block_size);
    size_t per_block = (size_t)kv->n_layers * 2 * kv->block_size * kv_dim;
    return (char *)kv->base +
           (blk * per_block + (((size_t)l * 2 + which) * kv->block_size + slot) * kv_dim) *
               backend_dtype_size(kv->dtype);
}

static int cpu_kv_write(backend_stream *st, const backend_kv *kv, int layer, const void *k,
                        const void *v, backend_dtype dt) {
    NEED_PLAN("kv_write");
    NEED_F32("kv_write", dt == BACKEND_F32 && (kv->dtype == BACKEND_F32 ||
                                               kv->dtype == BACKEND_BF16 ||
                                               kv->dtype == BACKEND_F8E4M3));
    size_t kvd = (size_t)kv->n_kv_heads * kv->head_dim;
    for (int t = 0; t < pb->n_tokens; t++)
        for (int which = 0; which < 2; which++) {
            void *dst = kv_at(kv, pb, pb->tok_seq[t], pb->tok_pos[t], layer, which);
            const float *src = (const float *)(which ? v : k) + (size_t)t * kvd;
            if (kv->dtype == BACKEND_F8E4M3) { /* e4m3(x / scale), nearest even, saturated */
                float sc = backend_kv_scale(kv, layer, which);
                uint8_t *d8 = dst;
                for (size_t i = 0; i < kvd; i++)
                    d8[i] = fp8_e4m3_from_f32(src[i] / sc);
            } else if (kv->dtype == BACKEND_BF16)
                cpu_f32_to_bf16_row(dst, src, (int)kvd); /* round to nearest even */
            else
                memcpy(dst, src, kvd * 4);
        }
    return 0;
}

/* ---- attention ------------------------------------------------------------------------ */

/* Key positions per partial softmax.  Fixed (not derived from the batch, the threads or the
 * block size), so a token's result is the same whoever computes which chunk. */
#define ATT_CHUNK 256
/* Positions per kernel call at most (a piece): a block's rows of a layer are one run in
 * memory, and within a long run (the CPU's block size is 128) the prefetch of the piece two
 * ahead goes out 32 KiB at a time, not a whole block's 64 KiB in one burst that stalls the
 * loads behind it (docs/benchmarks.md).  Any cut gives the same bits: scores are
 * per position, and the values accumulate in position order across calls. */
#define ATT_PIECE 64
/* up to this many tokens the keys are split into chunks over the threads */
#define ATT_SPLIT_TOKENS     8
#define ATT_SPLIT_MAX_FLOATS ((size_t)16 << 20) /* 64 MiB of partials at most */
/* att_chunk hands cpu_*_rows_heads whole KV-head groups of at most CPU_ATT_MAX_HEADS heads;
 * backend_attention admits at most 64 query heads per KV head */
_Static_assert(CPU_ATT_MAX_HEADS >= 64, "a GQA group must fit one cpu_dot_rows_heads call");

typedef struct att_job {
    const backend_batch *pb; /* the plan */
    const backend_kv *kv;    /* the region */
    const float *q;          /* (T, n_heads, hd) */
    float *out;              /* (T, n_heads, hd) */
    int layer, n_heads;      /* which layer; query heads */
    float scale;             /* score scale */
    /* split over key chunks (few tokens): task = (token, chunk, KV-head part), the partials
     * of (token, chunk, head) at part + ((chunk0[t] + c) * n_heads + h) * (hd + 2); else
     * task = (token, KV head), its chunks one after another in the task's own scratch */
    int by_chunk;
    int kv_parts;      /* by_chunk: the KV heads split this many ways */
    const int *chunk0; /* by_chunk: (T + 1) prefix sums of the tokens' chunk counts */
    float *part;       /* by_chunk: the partials */
} att_job;

/* First element of K (which = 0) or V (1) of block slot 0 of KV head kvh: slots are kv_dim
 * elements apart */
static inline const void *kv_block(const backend_kv *kv, int blk, int l, int which, int kvh) {
    size_t kv_dim = (size_t)kv->n_kv_heads * kv->head_dim;
    size_t per_block = (size_t)kv->n_layers * 2 * kv->block_size * kv_dim;
    return (const char *)kv->base +
           ((size_t)blk * per_block + ((size_t)l * 2 + which) * kv->block_size * kv_dim +
            (size_t)kvh * kv->head_dim) *
               backend_dtype_size(kv->dtype);
}

static inline int att_chunks(int np) {
    return (np + ATT_CHUNK - 1) / ATT_CHUNK;
}

/* The first key position a query at position pos attends to: 0, or pos - window + 1 with a
 * sliding window.  The chunks of a token start there: chunk c covers [lo + c * ATT_CHUNK, ..) */
static inline int att_lo(const backend_kv *kv, int pos) {
    return kv->window > 0 && pos + 1 > kv->window ? pos + 1 - kv->window : 0;
}

/* the token's chunk count: its keys lo..pos */
static inline int att_tok_chunks(const backend_kv *kv, int pos) {
    return att_chunks(pos + 1 - att_lo(kv, pos));
}

/* The rows of positions [p, p + n) (within one block) of K (which 0) or V (1), all KV heads,
 * when kvh < 0; else those of KV head kvh */
static inline const void *att_rows(const att_job *j, const int32_t *bt, int which, int kvh, int p) {
    const backend_kv *kv = j->kv;
    int bs = kv->block_size;
    return (const char *)kv_block(kv, bt[p / bs], j->layer, which, kvh < 0 ? 0 : kvh) +
           (size_t)(p % bs) * kv->n_kv_heads * kv->head_dim * backend_dtype_size(kv->dtype);
}

/* Chunk c of token t for the query heads of KV heads [kh0, kh1): per head, over the chunk's
 * positions [c * ATT_CHUNK, min(np, (c + 1) * ATT_CHUNK)): s_i = q.k_i * scale (cpu_dot_rows:
 * 8 key positions at a time), m = max s_i, e_i = cpu_expf(s_i - m), l = the canonical sum of
 * e_i (cpu_softmax_exp), o = sum e_i v_i in position order (cpu_axpy_rows); writes
 * (m, l, o[hd]) for query head g at part + (g - kh0 * group) * pstride.  The same arithmetic
 * whatever the batch, the chunk split or the thread. */
static void att_chunk(const att_job *j, int t, int c, int kh0, int kh1, float *part,
                      size_t pstride) {
    const backend_kv *kv = j->kv;
    int hd = kv->head_dim, nkv = kv->n_kv_heads, group = j->n_heads / nkv, width = j->n_heads * hd;
    int bf16 = kv->dtype == BACKEND_BF16, fp8 = kv->dtype == BACKEND_F8E4M3, bs = kv->block_size;
    size_t kvd = (size_t)nkv * hd, es = backend_dtype_size(kv->dtype);
    int seq = j->pb->tok_seq[t], np = j->pb->tok_pos[t] + 1;
    int cs = att_lo(kv, np - 1) + c * ATT_CHUNK, ce = np - cs < ATT_CHUNK ? np : cs + ATT_CHUNK,
        nc = ce - cs;
    const int32_t *bt = j->pb->bt_indices + j->pb->bt_indptr[seq];
    int g0 = kh0 * group, g1 = kh1 * group;                        /* the query heads */
    float *scores = cpu_scratch(1, (size_t)(g1 - g0) * ATT_CHUNK); /* (g1 - g0, ATT_CHUNK) */
    if (!scores) abort(); /* a worker cannot report; a few KiB */
    const float *q = j->q + (size_t)t * width;
    /* the chunk cut at block boundaries and every ATT_PIECE positions within a block: piece i =
     * positions [ps[i], ps[i + 1]) */
    int ps[ATT_CHUNK + 1], npc = 0;
    for (int p = cs; p < ce;) {
        int n = bs - p % bs < ce - p ? bs - p % bs : ce - p;
        ps[npc++] = p;
        p += n < ATT_PIECE ? n : ATT_PIECE;
    }
    ps[npc] = ce;
    /* the K pieces, then the V pieces; each piece's rows read from memory once for all the
     * heads, the rows of the piece two steps ahead prefetched */
    size_t rowb = kvd * es * (size_t)(kh1 - kh0) / (size_t)nkv, skip = kvd * es * (size_t)kh0 / nkv;
    for (int s = 0; s < 2 && s < 2 * npc; s++) {
        int which = s >= npc, i = which ? s - npc : s, n = ps[i + 1] - ps[i];
        const char *a = (const char *)att_rows(j, bt, which, -1, ps[i]) + skip;
        for (int r = 0; r < n; r++)
            for (size_t o = 0; o < rowb; o += 64)
                __builtin_prefetch(a + r * kvd * es + o, 0, 3);
    }
    for (int s = 0; s < 2 * npc; s++) {
        if (s + 2 < 2 * npc) {
            int which = s + 2 >= npc, i = which ? s + 2 - npc : s + 2, n = ps[i + 1] - ps[i];
            const char *a = (const char *)att_rows(j, bt, which, -1, ps[i]) + skip;
            for (int r = 0; r < n; r++)
                for (size_t o = 0; o < rowb; o += 64)
                    __builtin_prefetch(a + r * kvd * es + o, 0, 3);
        }
        if (s == npc) /* the scores complete: the exps, the partial sums, o = 0 */
            for (int g = g0; g < g1; g++) {
                float *pg = part + (size_t)(g - g0) * pstride;
                pg[1] = cpu_softmax_exp(scores + (size_t)(g - g0) * ATT_CHUNK, nc, &pg[0]);
                memset(pg + 2, 0, (size_t)hd * sizeof(float));
            }
        int which = s >= npc, i = which ? s - npc : s, p = ps[i], n = ps[i + 1] - p;
        /* every query head of the task at once (the heads of a KV head next to each other):
         * each K / V row loaded once for several heads, the same results as one by one */
        float *dst[CPU_ATT_MAX_HEADS];
        const float *src[CPU_ATT_MAX_HEADS];
        const void *rows[CPU_ATT_MAX_HEADS];
        const int kstep = CPU_ATT_MAX_HEADS / group; /* KV heads per call (cpu_attention: >= 1) */
        /* FP8 KV: the piece's rows of these KV heads dequantized to f32 first (the exact e4m3
         * value times the layer's scale, rounded once to f32), then the f32 kernels on them */
        float *deq = NULL;
        if (fp8) {
            deq = cpu_scratch(4, (size_t)n * kvd);
            if (!deq) abort(); /* a worker cannot report; n * kv_dim floats */
            float sc = backend_kv_scale(kv, j->layer, which);
            const uint8_t *src8 = att_rows(j, bt, which, -1, p);
            for (int r = 0; r < n; r++)
                for (size_t e = (size_t)kh0 * hd; e < (size_t)kh1 * hd; e++)
                    deq[r * kvd + e] = fp8_e4m3_to_f32(src8[r * kvd + e]) * sc;
        }
        for (int ka = kh0; ka < kh1; ka += kstep) {
            int kb_end = ka + kstep < kh1 ? ka + kstep : kh1, nh = 0;
            for (int kvh = ka; kvh < kb_end; kvh++) {
                const void *kb = fp8 ? (const void *)(deq + (size_t)kvh * hd)
                                     : att_rows(j, bt, which, kvh, p);
                for (int g = kvh * group; g < (kvh + 1) * group; g++, nh++) {
                    float *sg = scores + (size_t)(g - g0) * ATT_CHUNK + (p - cs);
                    rows[nh] = kb;
                    dst[nh] = which ? part + (size_t)(g - g0) * pstride + 2 : sg;
                    src[nh] = which ? sg : q + (size_t)g * hd;
                }
            }
            if (!which)
                cpu_dot_rows_heads(dst, src, rows, nh, bf16, kvd, n, hd, j->scale);
            else
                cpu_axpy_rows_heads(dst, src, rows, nh, bf16, kvd, n, hd);
        }
    }
}

/* out (hd) = sum_c w_c o_c / sum_c w_c l_c, w_c = exp(m_c - max m), over the chunks in
 * order (partial c at p + c * cstride): scalar, the same on every ISA */
static void att_combine(float *out, const float *p, size_t cstride, int nch, int hd) {
    float mx = p[0];
    for (int c = 1; c < nch; c++)
        mx = p[c * cstride] > mx ? p[c * cstride] : mx;
    float l = 0;
    for (int d = 0; d < hd; d++)
        out[d] = 0;
    for (int c = 0; c < nch; c++) {
        const float *pc = p + c * cstride;
        float w = pc[0] == mx ? 1.0f : cpu_ref_expf(pc[0] - mx);
        l = __builtin_fmaf(w, pc[1], l);
        for (int d = 0; d < hd; d++)
            out[d] = __builtin_fmaf(w, pc[2 + d], out[d]);
    }
    for (int d = 0; d < hd; d++)
        out[d] = out[d] / l;
}

/* One token, one KV head (the (token, KV head) split): its chunks in order, then the combine */
static void att_task(void *ctx, int task) {
    const att_job *j = ctx;
    const backend_kv *kv = j->kv;
    int hd = kv->head_dim, nkv = kv->n_kv_heads, group = j->n_heads / nkv;
    int t = task / nkv, kvh = task % nkv, nch = att_tok_chunks(kv, j->pb->tok_pos[t]);
    size_t ps = (size_t)hd + 2; /* partial (c, g) at (c * group + g) * ps */
    float *part = cpu_scratch(3, (size_t)nch * group * ps);
    if (!part) abort(); /* a worker cannot report */
    for (int c = 0; c < nch; c++)
        att_chunk(j, t, c, kvh, kvh + 1, part + (size_t)c * group * ps, ps);
    float *out = j->out + ((size_t)t * j->n_heads + (size_t)kvh * group) * hd;
    for (int g = 0; g < group; g++)
        att_combine(out + (size_t)g * hd, part + (size_t)g * ps, (size_t)group * ps, nch, hd);
}

/* One chunk of one token for a share of the KV heads (the chunk split) */
static void att_chunk_task(void *ctx, int task) {
    const att_job *j = ctx;
    int nkv = j->kv->n_kv_heads, kp = task % j->kv_parts, ct = task / j->kv_parts, t = 0;
    while (j->chunk0[t + 1] <= ct)
        t++;
    size_t ps = (size_t)j->kv->head_dim + 2;
    int kh0 = nkv * kp / j->kv_parts, kh1 = nkv * (kp + 1) / j->kv_parts;
    att_chunk(j, t, ct - j->chunk0[t], kh0, kh1,
              j->part + ((size_t)ct * j->n_heads + (size_t)kh0 * (j->n_heads / nkv)) * ps, ps);
}

static int cpu_attention(backend_stream *st, void *out, const void *q, backend_dtype dt,
                         const backend_kv *kv, int layer, int n_heads, float scale) {
    NEED_PLAN("attention");
    NEED_F32("attention", dt == BACKEND_F32 && (kv->dtype == BACKEND_F32 ||
                                                kv->dtype == BACKEND_BF16 ||
                                                kv->dtype == BACKEND_F8E4M3));
    cpu_stream *cs = st->impl;
    cpu_pool *pool = cs->pool;
    int T = pb->n_tokens, nkv = kv->n_kv_heads, hd = kv->head_dim;
    int want = 2 * cpu_pool_threads(pool);
    att_job j = {pb, kv, q, out, layer, n_heads, scale, 0, 1, NULL, NULL};
    /* few tokens: split their keys into chunks over the threads (each thread reads its own
     * key range, once for all the heads), the partials combined here in chunk order */
    if (T * nkv < want || T <= ATT_SPLIT_TOKENS) {
        size_t total = 0;
        if ((size_t)T + 1 > cs->att_c0_cap) {
            int *c0 = realloc(cs->att_c0, ((size_t)T + 1) * sizeof *c0);
            if (!c0) return -ENOMEM;
            cs->att_c0 = c0;
            cs->att_c0_cap = (size_t)T + 1;
        }
        cs->att_c0[0] = 0;
        for (int t = 0; t < T; t++)
            cs->att_c0[t + 1] = cs->att_c0[t] + att_tok_chunks(kv, pb->tok_pos[t]);
        total = (size_t)cs->att_c0[T];
        size_t ps = (size_t)hd + 2, need = total * n_heads * ps;
        if (need <= ATT_SPLIT_MAX_FLOATS) {
            if (need > cs->att_part_cap) {
                free(cs->att_part);
                cs->att_part = malloc(need * sizeof(float));
                cs->att_part_cap = cs->att_part ? need : 0;
                if (!cs->att_part) return -ENOMEM;
            }
            j.by_chunk = 1;
            j.chunk0 = cs->att_c0;
            j.part = cs->att_part;
            j.kv_parts = total * 2 < (size_t)want ? nkv : 1; /* few chunks: split the heads too */
            cpu_pool_run(pool, (int)total * j.kv_parts, att_chunk_task, &j);
            for (int t = 0; t < T; t++) {
                int nch = cs->att_c0[t + 1] - cs->att_c0[t];
                const float *pt = cs->att_part + (size_t)cs->att_c0[t] * n_heads * ps;
                for (int h = 0; h < n_heads; h++)
                    att_combine((float *)out + ((size_t)t * n_heads + h) * hd, pt + (size_t)h * ps,
                                (size_t)n_heads * ps, nch, hd);
            }
            return 0;
        }
    }
    cpu_pool_run(pool, T * nkv, att_task, &j);
    return 0;
}

/* ---- MLP activation, residual, gather, argmax ----------------------------------------- */

typedef struct act_job {
    float *g;       /* (rows, n) gate in, silu(gate) * up out */
    const float *u; /* (rows, n) up */
    int n;          /* row width */
} act_job;

static void act_task(void *ctx, int t) {
    const act_job *j = ctx;
    float *g = j->g + (size_t)t * j->n;
    const float *u = j->u + (size_t)t * j->n;
    cpu_silu_mul(g, u, j->n);
}

static int cpu_swiglu(backend_stream *st, void *g, const void *u, backend_dtype dt, int rows,
                      int n) {
    NEED_F32("swiglu", dt == BACKEND_F32);
    act_job j = {g, u, n};
    cpu_pool_run(((cpu_stream *)st->impl)->pool, rows, act_task, &j);
    return 0;
}

static int cpu_add(backend_stream *st, void *y, const void *x, backend_dtype dt, size_t n) {
    NEED_F32("add", dt == BACKEND_F32);
    float *yy = y;
    const float *xx = x;
    for (size_t i = 0; i < n; i++)
        yy[i] += xx[i];
    return 0;
}

static int cpu_gather_rows(backend_stream *st, void *out, const void *x, backend_dtype dt,
                           int width) {
    NEED_PLAN("gather_rows");
    size_t row = (size_t)width * backend_dtype_size(dt);
    for (int r = 0; r < pb->n_out; r++)
        memcpy((char *)out + (size_t)r * row, (const char *)x + (size_t)pb->out_rows[r] * row, row);
    return 0;
}

static int cpu_argmax(backend_stream *st, int32_t *out, const float *logits, int rows, int vocab) {
    for (int r = 0; r < rows; r++) {
        const float *l = logits + (size_t)r * vocab;
        int best = 0;
        for (int i = 1; i < vocab; i++)
            if (l[i] > l[best] || (isnan(l[best]) && !isnan(l[i]))) best = i;
        out[r] = best;
    }
    return 0;
}

/* Structured outputs' token masks: -inf on every token of the named rows that the row's
 * bitmask does not allow (tokens >= vocab never are). */
static int cpu_token_bitmask(backend_stream *st, float *logits, int width, const int32_t *bitmask,
                             const int32_t *rows, int n, int vocab) {
    (void)st;
    int words = (vocab + 31) / 32;
    for (int k = 0; k < n; k++) {
        float *l = logits + (size_t)rows[k] * (size_t)width;
        const uint32_t *m = (const uint32_t *)bitmask + (size_t)k * (size_t)words;
        for (int w = 0; w < words; w++) {
            uint32_t a = m[w];
            int base = w * 32, end = base + 32 < vocab ? base + 32 : vocab;
            if (a == 0xFFFFFFFFu && end == base + 32) continue;
            for (int t = base; t < end; t++)
                if (!(a >> (t - base) & 1u)) l[t] = -INFINITY;
        }
        for (int t = vocab; t < width; t++)
            l[t] = -INFINITY;
    }
    return 0;
}

static const backend_iface cpu_iface = {
    .free = cpu_free,
    .memory = cpu_memory,
    .buffer_alloc = cpu_buffer_alloc,
    .weights_load = cpu_weights_load,
    .buffer_free = cpu_buffer_free,
    .stream_create = cpu_stream_create,
    .stream_free = cpu_stream_free,
    .stream_sync = cpu_stream_sync,
    .upload = cpu_upload,
    .download = cpu_upload, /* both are memcpy(dst, src) on the host */
    .copy = cpu_copy,
    .memset_zero = cpu_memset_zero,
    .plan = cpu_plan,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul_ops,
    .rope = cpu_rope,
    .kv_write = cpu_kv_write,
    .attention = cpu_attention,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .gather_rows = cpu_gather_rows,
    .argmax = cpu_argmax,
    .upload_async = cpu_upload, /* host memory: the copy is the whole of it */
    .token_bitmask = cpu_token_bitmask,
};
