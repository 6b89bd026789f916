/*
 * cuda_backend — kernels/backend.h on the GPU: the backend_iface table the registry
 * (kernels/backend.c) gets from disagg_backend_module_open(), on top of the op families of
 * cuda_common.cuh (the module's other files); the embedding gather and the SwiGLU / gather
 * of the generic ops are here.
 *
 * Device memory: every buffer is one cudaMalloc (the KV region too, zeroed).  Weights are
 * stored bf16 (f16/f32 converted on the device) after a copy through pinned staging.
 * Activations are f32 (backend_act_dtype): matmul inputs are rounded to bf16 on the way
 * into cuBLASLt (one conversion per distinct input of an op batch), accumulation and
 * outputs f32.  KV is bf16 (default) or f32.  Each backend_stream is a CUDA stream with its
 * own cuBLASLt workspace, split-attention scratch and copy of the plan's metadata.
 */
#include "kernels/backend_impl.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_invariant.h"
#include "kernels/cuda/cuda_moe.h"
#include "kernels/cuda/cuda_qknorm.h"
#include "kernels/cuda/cuda_window.h"

typedef struct cb_dev {
    int ord;
    dcu_info info;
    int progress;
    dcu_ctx *loader;      /* stream used by weights_load */
    void *stage[2];       /* pinned staging */
    cudaEvent_t ev[2];
    size_t stage_bytes;
    int next;
    void *conv;           /* device chunk for f16/f32 conversion */
    size_t loaded;        /* bytes of weights loaded (progress) */
    size_t last_shown;
    int inv;              /* backend_options.batch_invariant: cuda_invariant's GEMM/attention */
} cb_dev;

typedef struct cb_stream {
    dcu_ctx *c;
    int32_t *d_meta;      /* device: tok | seq | pos | out_rows | bt (dense S x stride) */
    int32_t *d_meta_cur;  /* the metadata the current plan uses (d_meta or a graph's) */
    size_t meta_cap;      /* int32 entries */
    int32_t *h_meta;      /* host staging (pageable) */
    size_t h_cap;
    int T, S, stride, n_out, max_ctx;
    int32_t *tok, *seq, *pos, *orow, *bt; /* into d_meta */
    int32_t *tiles, *rest;                /* prefill tiles (3 each) and the other tokens */
    int32_t *tiles3;                      /* the same sequences in tiles of FA_BQ3 rows */
    int n_tiles3;
    int n_tiles, n_rest, rest_ctx, flash_hd; /* flash_hd: head_dim the split assumed */
    void *xconv;          /* bf16 copy of a matmul input */
    size_t xconv_bytes;
    void *scr[4];         /* fused ops' intermediates: [0] the q|k|v GEMM, [1] gate|up,
                             [2] the mixture of experts' workspace (cuda_moe.h), [3] FP8
                             GEMMs' e4m3 activations and their per-token scales */
    size_t scr_bytes[4];
    /* recorded decode steps (backend_graph_*): one entry per (T, max_ctx, max_blocks) */
    struct cb_graph *graphs;
    int n_graphs, cap_graphs;
    struct cb_graph *cur;  /* the graph backend_graph_plan selected (NULL: eager plan) */
    int capturing;         /* 1 between a recording graph_begin and graph_end */
    int inv;               /* batch-invariant mode (cuda_invariant.h) */
    iv_policy pol;         /* its GEMM policy */
    iv_scratch ivs;        /* its attention partials */
    struct cb_prof *prof;  /* DISAGG_CUDA_PROF=T: per-op timing of eager steps of <= T tokens */
} cb_stream;

/* ---- per-op timing (DISAGG_CUDA_PROF=T) --------------------------------------------------
 * An eager step (backend_plan, not a recorded graph) of at most T tokens gets a cudaEvent
 * after its plan and after every op; at the next plan the deltas are added up per op name.
 * When the step shape (tokens, context) changes, and when the stream is freed, a table goes
 * to stderr: per op, calls a step, microseconds a step and the GB/s of the bytes it must read
 * (weights, KV).  Eager timing: a delta also holds the launch gap before the op when the GPU
 * ran dry (CUDA graphs hide most of those). */
#define PROF_EV 1024
#define PROF_OPS 32
typedef struct cb_prof {
    int max_T, on, n;          /* on: this step is timed; n: events recorded after ev[0] */
    cudaEvent_t ev[PROF_EV + 1];
    int op_of[PROF_EV];        /* index into name/us/bytes */
    char name[PROF_OPS][40];
    double us[PROF_OPS], bytes[PROF_OPS];
    long calls[PROF_OPS];
    int n_ops;
    long steps;
    int T, ctx;                /* the shape being summed */
} cb_prof;

/* The module links nothing of disagg itself (backend.c lives in the binary): these are
 * backend_kv_scale and backend_dtype_size for the KV dtypes, as kernels/backend.c defines them. */
static float cb_kv_scale(const backend_kv *kv, int layer, int which) {
    if (kv->dtype != BACKEND_F8E4M3) return 1.0f;
    const float *sc = which ? kv->v_scale : kv->k_scale;
    return sc ? sc[layer] : 1.0f;
}
static int cb_kv_elem(backend_dtype dt) {
    return dt == BACKEND_F32 ? 4 : dt == BACKEND_F8E4M3 ? 1 : 2;
}

static void prof_print(cb_prof *p) {
    if (!p->steps) return;
    double tot = 0;
    for (int i = 0; i < p->n_ops; i++)
        tot += p->us[i];
    fprintf(stderr, "prof: eager step, %d token(s), context %d+: %.1f us a step (%ld steps)\n", p->T,
            p->ctx, tot / p->steps, p->steps);
    fprintf(stderr, "prof:   %-28s %8s %10s %8s %9s\n", "op", "calls", "us/step", "us/call",
            "GB/s");
    for (int i = 0; i < p->n_ops; i++) {
        double us = p->us[i] / p->steps, per = p->calls[i] ? p->us[i] / p->calls[i] : 0;
        double gbs = p->bytes[i] > 0 && p->us[i] > 0 ? p->bytes[i] / (p->us[i] * 1e3) : 0;
        fprintf(stderr, "prof:   %-28s %8.1f %10.1f %8.2f %9.0f\n", p->name[i],
                (double)p->calls[i] / p->steps, us, per, gbs);
    }
    p->n_ops = 0;
    p->steps = 0;
}

/* the previous timed step into the sums (waits for it) */
static void prof_flush(cb_stream *s) {
    cb_prof *p = s->prof;
    if (!p || !p->on) return;
    p->on = 0;
    if (!p->n) return;
    cudaEventSynchronize(p->ev[p->n]);
    for (int i = 0; i < p->n; i++) {
        float ms = 0;
        cudaEventElapsedTime(&ms, p->ev[i], p->ev[i + 1]);
        p->us[p->op_of[i]] += ms * 1e3;
    }
    p->steps++;
}

static void prof_plan(cb_stream *s, int T, int ctx, int eager) {
    cb_prof *p = s->prof;
    if (!p) return;
    prof_flush(s);
    if (!eager || T > p->max_T) return;
    if (p->steps && (T != p->T || ctx < p->ctx || ctx > p->ctx + 256)) prof_print(p);
    if (!p->steps) p->T = T, p->ctx = ctx; /* a decode run: the context of its first step */
    p->n = 0;
    p->on = 1;
    cudaEventRecord(p->ev[0], s->c->stream);
}

static void prof_mark(cb_stream *s, const char *name, double bytes) {
    cb_prof *p = s->prof;
    if (!p || !p->on || s->capturing || p->n >= PROF_EV) return;
    int k = 0;
    while (k < p->n_ops && strcmp(p->name[k], name))
        k++;
    if (k == p->n_ops) {
        if (k == PROF_OPS) return;
        snprintf(p->name[k], sizeof p->name[k], "%s", name);
        p->us[k] = p->bytes[k] = 0;
        p->calls[k] = 0;
        p->n_ops++;
    }
    p->calls[k]++;
    p->bytes[k] += bytes;
    p->op_of[p->n] = k;
    cudaEventRecord(p->ev[++p->n], s->c->stream);
}

static int pm(cb_stream *s, int rc, const char *name, double bytes) {
    if (!rc) prof_mark(s, name, bytes);
    return rc;
}

static cb_prof *prof_new(void) {
    const char *e = getenv("DISAGG_CUDA_PROF");
    if (!e || atoi(e) <= 0) return NULL;
    cb_prof *p = (cb_prof *)calloc(1, sizeof *p);
    if (!p) return NULL;
    p->max_T = atoi(e);
    for (int i = 0; i <= PROF_EV; i++)
        if (cudaEventCreate(&p->ev[i]) != cudaSuccess) {
            for (int j = 0; j < i; j++)
                cudaEventDestroy(p->ev[j]);
            free(p);
            return NULL;
        }
    return p;
}

static void prof_free(cb_stream *s) {
    cb_prof *p = s->prof;
    if (!p) return;
    prof_flush(s);
    prof_print(p);
    for (int i = 0; i <= PROF_EV; i++)
        cudaEventDestroy(p->ev[i]);
    free(p);
    s->prof = NULL;
}

typedef struct cb_graph {
    int T, max_ctx, max_blocks;
    int32_t *d_meta;       /* this graph's metadata, at the addresses it was recorded with */
    size_t meta_cap;
    int uses;              /* graph_begin calls: 0 -> warm-up, 1 -> record, then replay */
    unsigned gen;          /* the context's scratch generation it was recorded in */
    cudaGraphExec_t exec;  /* NULL until recorded */
} cb_graph;

#define CB(st) ((cb_stream *)(st)->impl)
/* The calling thread's current device must be the stream's (cuda:N with N > 0): set it in
 * every entry point a new thread may start with (plan begins every forward). */
#define ON_DEV(st) cudaSetDevice(CB(st)->c->device)

static void cb_free(backend *be) {
    cb_dev *d = (cb_dev *)be->ctx;
    if (d) {
        if (d->loader) ctx_free(d->loader);
        for (int i = 0; i < 2; i++) {
            if (d->stage[i]) cudaFreeHost(d->stage[i]);
            if (d->ev[i]) cudaEventDestroy(d->ev[i]);
        }
        cudaFree(d->conv);
        free(d);
    }
    free(be);
}

static int cb_memory(const backend *be, size_t *free_b, size_t *total_b) {
    cb_dev *d = (cb_dev *)be->ctx;
    cudaSetDevice(d->ord);
    CK(cudaMemGetInfo(free_b, total_b));
    return 0;
}

static int cb_buffer_alloc(backend *be, backend_buffer *b, size_t bytes, int flags) {
    cb_dev *d = (cb_dev *)be->ctx;
    cudaSetDevice(d->ord);
    void *p = NULL;
    if (flags & BACKEND_BUF_HOST) { /* page-locked host memory: copies at full PCIe speed */
        cudaError_t he = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable);
        if (he != cudaSuccess) {
            cudaGetLastError();
            fprintf(stderr, "cuda_backend: cannot allocate %.3f GB of pinned host memory (%s)\n",
                    bytes / 1e9, cudaGetErrorString(he));
            return -ENOMEM;
        }
        if (flags & BACKEND_BUF_ZERO) memset(p, 0, bytes);
        b->ptr = p;
        b->size = bytes;
        b->is_host = 1;
        b->impl = (void *)1; /* cudaFreeHost */
        return 0;
    }
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        cudaGetLastError();
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        fprintf(stderr,
                "cuda_backend: cannot allocate %.3f GB on cuda:%d (%s; %.2f GB free of %.2f GB)\n",
                bytes / 1e9, d->ord, cudaGetErrorString(e), fr / 1e9, tot / 1e9);
        return -ENOMEM;
    }
    if (flags & (BACKEND_BUF_ZERO | BACKEND_BUF_KV)) {
        if ((e = cudaMemset(p, 0, bytes)) != cudaSuccess) {
            fprintf(stderr, "cuda_backend: cudaMemset: %s\n", cudaGetErrorString(e));
            cudaFree(p);
            return -EIO;
        }
    }
    b->ptr = p;
    b->size = bytes;
    b->is_host = 0;
    b->impl = NULL;
    return 0;
}

static void cb_buffer_free(backend *be, backend_buffer *b) {
    if (b->ptr && b->impl == (void *)1)
        cudaFreeHost(b->ptr);
    else if (b->ptr)
        cudaFree(b->ptr);
    b->ptr = NULL;
}

/* n elements of src_dt at host src -> bf16 at device dst, through the pinned staging */
static int cb_upload_w(cb_dev *d, bf16 *dst, const void *src, backend_dtype src_dt, size_t n) {
    dcu_ctx *c = d->loader;
    size_t esz = src_dt == BACKEND_F32 ? 4 : 2, per = d->stage_bytes / esz;
    cudaSetDevice(d->ord);
    if (src_dt != BACKEND_BF16 && !d->conv && cudaMalloc(&d->conv, d->stage_bytes) != cudaSuccess)
        return -ENOMEM;
    for (size_t off = 0; off < n; off += per) {
        size_t cnt = n - off < per ? n - off : per;
        int k = d->next++ & 1;
        CK(cudaEventSynchronize(d->ev[k]));
        memcpy(d->stage[k], (const char *)src + off * esz, cnt * esz);
        if (src_dt == BACKEND_BF16) {
            CK(cudaMemcpyAsync(dst + off, d->stage[k], cnt * 2, cudaMemcpyHostToDevice, c->stream));
        } else {
            CK(cudaMemcpyAsync(d->conv, d->stage[k], cnt * esz, cudaMemcpyHostToDevice, c->stream));
            if (src_dt == BACKEND_F32)
                to_bf16_async(c, dst + off, (const float *)d->conv, cnt);
            else
                f16_to_bf16_async(c, dst + off, (const __half *)d->conv, cnt);
        }
        CK(cudaEventRecord(d->ev[k], c->stream));
        d->loaded += cnt * esz;
    }
    CK(cudaStreamSynchronize(c->stream));
    if (d->progress && isatty(2) && d->loaded - d->last_shown >= (1u << 30)) {
        fprintf(stderr, "\rcuda: %.1f GB of weights uploaded to HBM", d->loaded / 1e9);
        d->last_shown = d->loaded;
    }
    return 0;
}

static int dt_w_ok(backend_dtype dt) {
    return dt == BACKEND_BF16 || dt == BACKEND_F16 || dt == BACKEND_F32;
}

static int cb_weights_load(backend *be, backend_buffer *b, const void *src, backend_dtype src_dt,
                           size_t n, backend_dtype *stored) {
    cb_dev *d = (cb_dev *)be->ctx;
    if (!dt_w_ok(src_dt)) return -ENOTSUP;
    int rc = cb_buffer_alloc(be, b, n * 2, 0);
    if (rc) return rc;
    if ((rc = cb_upload_w(d, (bf16 *)b->ptr, src, src_dt, n))) {
        cb_buffer_free(be, b);
        return rc;
    }
    *stored = BACKEND_BF16;
    return 0;
}

/* q|k|v, gate|up: the parts one after the other in one bf16 buffer */
static int cb_weights_load_cat(backend *be, backend_buffer *b, const void *const *srcs,
                               const backend_dtype *dts, const size_t *ns, int n_parts,
                               backend_dtype *stored) {
    cb_dev *d = (cb_dev *)be->ctx;
    size_t total = 0;
    for (int i = 0; i < n_parts; i++) {
        if (!dt_w_ok(dts[i])) return -ENOTSUP;
        total += ns[i];
    }
    int rc = cb_buffer_alloc(be, b, total * 2, 0);
    if (rc) return rc;
    size_t off = 0;
    for (int i = 0; i < n_parts && !rc; i++) {
        rc = cb_upload_w(d, (bf16 *)b->ptr + off, srcs[i], dts[i], ns[i]);
        off += ns[i];
    }
    if (rc) {
        cb_buffer_free(be, b);
        return rc;
    }
    *stored = BACKEND_BF16;
    return 0;
}

/* An FP8 matrix: one buffer of [e4m3 (N, K)] [f32 scales] [bf16 twin (N, K)], each part
 * 256-byte aligned.  The decode GEMV streams the e4m3 bytes (gemv_fp8); the GEMMs of larger
 * batches run cuBLASLt bf16 on the twin, dequantized here once (e4m3 * scale, rounded to bf16):
 * 3 bytes a weight in HBM until an FP8 tensor-core GEMM takes the prefill. */
static int cb_weights_load_fp8(backend *be, backend_buffer *b, const uint8_t *src, int N, int K,
                               const float *scales, int block_n, int block_k,
                               backend_dtype *stored, backend_wscale *ws) {
    cb_dev *d = (cb_dev *)be->ctx;
    size_t n = (size_t)N * K, ng = (size_t)((N + block_n - 1) / block_n) *
                                   ((K + block_k - 1) / block_k);
    size_t o_s = (n + 255) & ~(size_t)255, o_t = (o_s + ng * 4 + 255) & ~(size_t)255;
    const char *tw = getenv("DISAGG_CUDA_FP8_TWIN"); /* 0: no bf16 twin (1 byte a weight) */
    int twin = !(tw && !strcmp(tw, "0"));
    int rc = cb_buffer_alloc(be, b, twin ? o_t + n * 2 : o_t, 0);
    if (rc) return rc;
    char *base = (char *)b->ptr;
    dcu_ctx *c = d->loader;
    cudaSetDevice(d->ord);
    /* copies and the dequantization ordered on the loader's stream (a pageable copy may
     * return before its DMA is done); the host arrays live until the sync below */
    if (cudaMemcpyAsync(base, src, n, cudaMemcpyHostToDevice, c->stream) != cudaSuccess ||
        cudaMemcpyAsync(base + o_s, scales, ng * 4, cudaMemcpyHostToDevice, c->stream) !=
            cudaSuccess ||
        (twin && fp8_dequant_bf16(c, (bf16 *)(base + o_t), (const uint8_t *)base,
                                  (const float *)(base + o_s), block_n, block_k, N, K)) ||
        cudaStreamSynchronize(c->stream) != cudaSuccess) {
        fprintf(stderr, "cuda: FP8 weights upload failed: %s\n",
                cudaGetErrorString(cudaGetLastError()));
        cb_buffer_free(be, b);
        return -EIO;
    }
    d->loaded += n * (twin ? 3 : 1) + ng * 4;
    ws->s = (const float *)(base + o_s);
    ws->block_n = block_n;
    ws->block_k = block_k;
    ws->twin = twin ? base + o_t : NULL;
    *stored = BACKEND_F8E4M3;
    return 0;
}

static int cb_stream_create(backend *be, backend_stream *st) {
    cb_dev *d = (cb_dev *)be->ctx;
    char err[256];
    cb_stream *s = (cb_stream *)calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    s->c = ctx_create(d->ord, err, sizeof err);
    if (!s->c) {
        fprintf(stderr, "cuda_backend: stream: %s\n", err);
        free(s);
        return -EIO;
    }
    s->inv = d->inv;
    s->pol = iv_policy_default();
    s->prof = prof_new();
    st->impl = s;
    return 0;
}

static void cb_graph_reset(backend_stream *st);

static void cb_stream_free(backend_stream *st) {
    cb_stream *s = CB(st);
    if (!s) return;
    prof_free(s);
    cb_graph_reset(st);
    free(s->graphs);
    cudaFree(s->d_meta);
    cudaFree(s->xconv);
    iv_scratch_free(&s->ivs);
    cudaFree(s->scr[0]);
    cudaFree(s->scr[1]);
    cudaFree(s->scr[2]);
    cudaFree(s->scr[3]);
    free(s->h_meta);
    ctx_free(s->c);
    free(s);
    st->impl = NULL;
}

static int cb_stream_sync(backend_stream *st) {
    ON_DEV(st);
    cudaError_t e = cudaStreamSynchronize(CB(st)->c->stream);
    if (e != cudaSuccess) {
        fprintf(stderr, "cuda_backend: stream: %s\n", cudaGetErrorString(e));
        return -EIO;
    }
    return 0;
}

static int cb_upload(backend_stream *st, void *dev, const void *host, size_t n) {
    ON_DEV(st);
    return dupload(CB(st)->c, dev, host, n);
}
static int cb_download(backend_stream *st, void *host, const void *dev, size_t n) {
    ON_DEV(st);
    return ddownload(CB(st)->c, host, dev, n);
}
static int cb_copy(backend_stream *st, void *dst, const void *src, size_t n) {
    ON_DEV(st);
    if (dst == src) return 0;
    CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, CB(st)->c->stream));
    CK(cudaStreamSynchronize(CB(st)->c->stream));
    return 0;
}
static int cb_memset_zero(backend_stream *st, void *dev, size_t n) {
    ON_DEV(st);
    CK(cudaMemsetAsync(dev, 0, n, CB(st)->c->stream));
    CK(cudaStreamSynchronize(CB(st)->c->stream));
    return 0;
}

static size_t plan_need(int T, int S, int n_out, int stride) {
    return (size_t)4 * T + (size_t)n_out + (size_t)S * stride + 8 + 6 * ((size_t)T + S) +
           (size_t)T;
}

/* Copies the batch's metadata to d_meta (of at least plan_need entries) with block tables
 * of `stride` entries (>= every sequence's) and sets the stream's views; max_ctx: the
 * split-attention kernel's grid covers that many positions. */
static int plan_into(cb_stream *s, const backend_batch *b, int stride, int max_ctx,
                     int32_t *d_meta) {
    int T = b->n_tokens, S = b->n_seqs;
    size_t need = plan_need(T, S, b->n_out, stride);
    if (need > s->h_cap) {
        free(s->h_meta);
        s->h_meta = (int32_t *)malloc(need * 4);
        s->h_cap = s->h_meta ? need : 0;
        if (!s->h_meta) return -ENOMEM;
    }
    s->d_meta_cur = d_meta;
    int32_t *h = s->h_meta;
    memcpy(h, b->tokens, (size_t)T * 4);
    memcpy(h + T, b->tok_seq, (size_t)T * 4);
    memcpy(h + 2 * T, b->tok_pos, (size_t)T * 4);
    if (b->n_out) memcpy(h + 3 * T, b->out_rows, (size_t)b->n_out * 4);
    int32_t *bt = h + 3 * T + b->n_out;
    for (int i = 0; i < S; i++) {
        int n = b->bt_indptr[i + 1] - b->bt_indptr[i];
        memcpy(bt + (size_t)i * stride, b->bt_indices + b->bt_indptr[i], (size_t)n * 4);
        for (int k = n; k < stride; k++)
            bt[(size_t)i * stride + k] = 0;
    }
    /* prefill tiles for the tensor-core kernel (used when the KV is bf16, see cb_attention) */
    int32_t *tiles = bt + (size_t)S * stride, *rest = tiles + 3 * ((size_t)T + S);
    s->rest_ctx = split_batch(T, b->tok_seq, b->tok_pos, 1, FA_BQ, tiles,
                              &s->n_tiles, rest, &s->n_rest);
    /* the tiles of FA_BQ3 rows (k_prefill_attention_mma; the batch-invariant mode keeps its
     * FA_BQ) after rest */
    int32_t *tiles3 = rest + s->n_rest;
    s->n_tiles3 = 0;
    if (s->n_tiles && !s->inv) { /* the same sequences (>= 16 new tokens) as split_batch's */
        for (int t = 0; t < T;) {
            int e = t;
            while (e < T && b->tok_seq[e] == b->tok_seq[t])
                e++;
            if (e - t >= 16)
                for (int a = t; a < e; a += FA_BQ3) {
                    tiles3[3 * s->n_tiles3] = a;
                    tiles3[3 * s->n_tiles3 + 1] = e - a < FA_BQ3 ? e - a : FA_BQ3;
                    tiles3[3 * s->n_tiles3 + 2] = b->tok_seq[t];
                    s->n_tiles3++;
                }
            t = e;
        }
    }
    size_t n_meta = (size_t)(tiles3 - h) + 3 * (size_t)s->n_tiles3;
    /* pageable source: the copy is staged before cudaMemcpyAsync returns, and it is ordered
     * after the previous batch's kernels on this stream */
    CK(cudaMemcpyAsync(d_meta, h, n_meta * 4, cudaMemcpyHostToDevice, s->c->stream));
    s->tiles = d_meta + (tiles - h);
    s->rest = d_meta + (rest - h);
    s->tiles3 = s->n_tiles3 ? d_meta + (tiles3 - h) : NULL;
    s->tok = d_meta;
    s->seq = d_meta + T;
    s->pos = d_meta + 2 * T;
    s->orow = d_meta + 3 * T;
    s->bt = d_meta + 3 * T + b->n_out;
    s->T = T, s->S = S, s->stride = stride, s->n_out = b->n_out, s->max_ctx = max_ctx;
    return 0;
}

static int cb_plan(backend_stream *st, const backend_batch *b) {
    cb_stream *s = CB(st);
    ON_DEV(st);
    if (s->capturing) return -EINVAL;
    s->cur = NULL;
    int T = b->n_tokens, S = b->n_seqs, stride = 1, max_ctx = 0;
    for (int i = 0; i < S; i++) {
        int n = b->bt_indptr[i + 1] - b->bt_indptr[i];
        if (n > stride) stride = n;
        if (b->kv_len[i] > max_ctx) max_ctx = b->kv_len[i];
    }
    size_t need = plan_need(T, S, b->n_out, stride);
    if (need > s->meta_cap) {
        cudaFree(s->d_meta); /* synchronises: no enqueued kernel still reads it */
        s->d_meta = NULL;
        s->meta_cap = 0;
        if (cudaMalloc((void **)&s->d_meta, need * 2 * 4) != cudaSuccess) return -ENOMEM;
        s->meta_cap = need * 2;
    }
    int rc = plan_into(s, b, stride, max_ctx, s->d_meta);
    if (!rc) prof_plan(s, T, max_ctx, 1);
    return rc;
}

/* ---- recorded decode steps (CUDA graphs) ----------------------------------------------- */

static void graph_drop(cb_graph *g) {
    if (g->exec) cudaGraphExecDestroy(g->exec);
    g->exec = NULL;
    g->uses = 0;
}

static void cb_graph_reset(backend_stream *st) {
    cb_stream *s = CB(st);
    if (!s) return;
    if (s->n_graphs) cudaStreamSynchronize(s->c->stream);
    for (int i = 0; i < s->n_graphs; i++) {
        graph_drop(&s->graphs[i]);
        cudaFree(s->graphs[i].d_meta);
    }
    s->n_graphs = 0;
    s->cur = NULL;
}

static int cb_graph_count(const backend_stream *st) {
    const cb_stream *s = (const cb_stream *)st->impl;
    int n = 0;
    for (int i = 0; i < s->n_graphs; i++)
        n += s->graphs[i].exec != NULL;
    return n;
}

static int cb_graph_plan(backend_stream *st, const backend_batch *b, int max_ctx,
                         int max_blocks) {
    cb_stream *s = CB(st);
    ON_DEV(st);
    if (s->capturing) return -EINVAL;
    cb_graph *g = NULL;
    for (int i = 0; i < s->n_graphs && !g; i++)
        if (s->graphs[i].T == b->n_tokens && s->graphs[i].max_ctx == max_ctx &&
            s->graphs[i].max_blocks == max_blocks)
            g = &s->graphs[i];
    if (!g) {
        if (s->n_graphs == s->cap_graphs) {
            int cap = s->cap_graphs ? 2 * s->cap_graphs : 16;
            cb_graph *p = (cb_graph *)realloc(s->graphs, (size_t)cap * sizeof *p);
            if (!p) return -ENOMEM;
            s->graphs = p;
            s->cap_graphs = cap;
        }
        g = &s->graphs[s->n_graphs];
        memset(g, 0, sizeof *g);
        g->T = b->n_tokens, g->max_ctx = max_ctx, g->max_blocks = max_blocks;
        g->meta_cap = plan_need(b->n_tokens, b->n_seqs, b->n_out, max_blocks);
        if (cudaMalloc((void **)&g->d_meta, g->meta_cap * 4) != cudaSuccess) {
            cudaGetLastError();
            return -ENOMEM;
        }
        s->n_graphs++;
    }
    prof_plan(s, b->n_tokens, max_ctx, 0);
    int rc = plan_into(s, b, max_blocks, max_ctx, g->d_meta);
    s->cur = rc ? NULL : g;
    return rc;
}

static int cb_graph_begin(backend_stream *st) {
    cb_stream *s = CB(st);
    cb_graph *g = s->cur;
    if (!g || s->capturing) return -EINVAL;
    if (g->exec && g->gen != s->c->gen) graph_drop(g); /* a scratch buffer moved since */
    if (g->exec) {
        CK(cudaGraphLaunch(g->exec, s->c->stream));
        g->uses++;
        return 1;
    }
    if (g->uses++ == 0) return 0; /* warm-up: eager, grows the workspaces to this shape */
    g->gen = s->c->gen;
    CK(cudaStreamBeginCapture(s->c->stream, cudaStreamCaptureModeThreadLocal));
    s->capturing = 1;
    return 0;
}

static int cb_graph_end(backend_stream *st, int ok) {
    cb_stream *s = CB(st);
    cb_graph *g = s->cur;
    if (!g) return -EINVAL;
    if (!s->capturing) return 0; /* the warm-up ran eagerly */
    s->capturing = 0;
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(s->c->stream, &graph);
    if (ok && e == cudaSuccess && g->gen == s->c->gen)
        e = cudaGraphInstantiate(&g->exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (!ok) {
        g->exec = NULL;
        g->uses = 0;
        cudaGetLastError();
        return 0;
    }
    if (e != cudaSuccess || !g->exec) {
        fprintf(stderr, "cuda_backend: recording a decode step (T=%d) failed: %s\n", g->T,
                e != cudaSuccess ? cudaGetErrorString(e) : "a workspace moved while recording");
        cudaGetLastError();
        g->exec = NULL;
        return -EIO;
    }
    CK(cudaGraphLaunch(g->exec, s->c->stream));
    return 0;
}

__device__ __forceinline__ float load_any(const __half *p) {
    return __half2float(*p);
}
template <typename TT, typename OT>
__global__ void k_embed_any(OT *out, const TT *table, const int32_t *tok, int h) {
    int t = blockIdx.x;
    const TT *row = table + (size_t)tok[t] * h;
    /* grid (T, blocks): one block walking a 3584-wide row took ~20 us at batch 1 */
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < h; i += gridDim.y * blockDim.x) {
        float v;
        if constexpr (sizeof(TT) == 4)
            v = load_f((const float *)row + i);
        else if constexpr (std::is_same<TT, __half>::value)
            v = load_any((const __half *)row + i);
        else
            v = load_f((const bf16 *)row + i);
        store_as(out + (size_t)t * h + i, v);
    }
}

static int cb_embed(backend_stream *st, void *out, backend_dtype out_dt, const void *table,
                    backend_dtype table_dt, int hidden) {
    cb_stream *s = CB(st);
    if (out_dt != BACKEND_F32 && out_dt != BACKEND_BF16) return -ENOTSUP;
    if (s->T <= 0) return 0;
    cudaStream_t cs = s->c->stream;
    int by = (hidden + 255) / 256;
    dim3 eg(s->T, by > 16 ? 16 : by);
#define EMB(TT)                                                                                  \
    (out_dt == BACKEND_F32                                                                      \
         ? k_embed_any<TT, float><<<eg, 256, 0, cs>>>((float *)out, (const TT *)table, s->tok,  \
                                                       hidden)                                  \
         : k_embed_any<TT, bf16><<<eg, 256, 0, cs>>>((bf16 *)out, (const TT *)table, s->tok,    \
                                                      hidden))
    if (table_dt == BACKEND_BF16)
        EMB(bf16);
    else if (table_dt == BACKEND_F16)
        EMB(__half);
    else if (table_dt == BACKEND_F32)
        EMB(float);
    else
        return -ENOTSUP;
#undef EMB
    return pm(s, launch_check("embed"), "embed", 0);
}

static int cb_rmsnorm(backend_stream *st, void *out, backend_dtype out_dt, const void *x,
                      backend_dtype x_dt, const float *w, int rows, int n, float eps) {
    if (x_dt != BACKEND_F32 || (out_dt != BACKEND_F32 && out_dt != BACKEND_BF16) || n > 12288)
        return -ENOTSUP;
    return pm(CB(st),
              rmsnorm(CB(st)->c, out, out_dt == BACKEND_BF16 ? DCU_BF16 : DCU_F32, (float *)x,
                      NULL, w, NULL, rows, n, eps, 0),
              "rmsnorm", 0);
}

/* FP8 weights at decode T (<= 2 and DISAGG_CUDA_FP8_GEMV) on cuda_gemv.cu's GEMV family
 * (split-K, the fused q|k|v and gate|up epilogues, PDL), not in the batch-invariant mode */
static int cb_f8_gemv(const cb_stream *s, int T, int K, const backend_wscale *ws, const void *x,
                      const void *w) {
    return !s->inv && ws->s && T <= s->c->fp8_gemv_max_t && gemv_f8_ok(T, K, ws->block_k, x, w);
}

/* FP8 weights at T <= DISAGG_CUDA_FP8_MMA (off by default) on the tensor-core e4m3 GEMV
 * (cuda_gemv_f8mma.cu), ahead of the CUDA-core GEMVs; not in the batch-invariant mode */
static int cb_f8_mma(const cb_stream *s, int T, int K, const backend_wscale *ws, const void *x,
                     const void *w) {
    return !s->inv && ws->s && T <= s->c->fp8_mma_max_t && gemv_f8mma_ok(T, K, ws->block_k, x, w);
}

/* DISAGG_CUDA_PROF: a matrix op's mark, named "what NxK suffix", reading bytes */
static void cb_prof_mat(cb_stream *s, const char *what, const char *suffix, int N, int K,
                        double bytes) {
    if (!s->prof || !s->prof->on) return;
    char nm[64];
    snprintf(nm, sizeof nm, "%s %dx%d%s", what, N, K, suffix);
    prof_mark(s, nm, bytes);
}

/* FP8 weights the block-scaled e4m3 GEMM takes: 128 x 128 scale blocks, K a multiple of 128 */
static int cb_f8_block(const backend_wscale *ws, int K) {
    return ws->s && ws->block_n == 128 && ws->block_k == 128 && K % 128 == 0;
}

static void *cb_scratch(cb_stream *s, int i, size_t bytes);

/* FP8 weights at prefill-sized T on the FP8 tensor cores (cuda_gemm_fp8.cu): x (T, K) bf16
 * quantized per token into scratch 3, then cuBLASLt's e4m3 GEMM into y (kind 0 f32, 1 f32 +=,
 * 2 bf16).  -ENOTSUP: not for these weights or this shape (the caller runs the bf16 twin);
 * never in the batch-invariant mode (DISAGG_CUDA_FP8_GEMM=0: never at all) */
static int cb_f8_gemm(cb_stream *s, void *y, int kind, const void *x, const backend_wscale *ws,
                      const void *w, int T, int N, int K) {
    /* 128 x 128 weight blocks only (DeepSeek-style block FP8): x in 128-column groups,
     * cuBLASLt's block-scaled e4m3 GEMM over the scales as stored.  The outer-vector form (one
     * scale a weight row, x a token) was removed: on the H200 its per-channel rows came out
     * wrong in the first run and its per-tensor ones in the second (3 December; cuBLASLt's
     * OUTER_VEC_32F scales not applied as we read its documentation) -- such weights run the
     * bf16 twin */
    if (s->inv || !s->c->fp8_gemm || !cb_f8_block(ws, K) || !fp8_gemm_ok(T, N, K) ||
        (((uintptr_t)x | (uintptr_t)w) & 15))
        return -ENOTSUP;
    size_t qb = ((size_t)T * K + 255) & ~(size_t)255;
    char *scr = (char *)cb_scratch(s, 3, qb + (size_t)T * (K / 128) * 4);
    if (!scr) return s->capturing ? -EINVAL : -ENOMEM;
    int rc = fp8_act_quant_g128(s->c, (uint8_t *)scr, (float *)(scr + qb), x, T, K);
    if (rc) return rc;
    rc = fp8_gemm(s->c, y, kind, (const uint8_t *)scr, (const float *)(scr + qb), w, ws->s, T, N,
                  K);
    if (!rc)
        cb_prof_mat(s, "fp8 gemm (block scales)", kind == 1 ? " (+= residual)" : "", N, K,
                    (double)N * K);
    return rc;
}

static int cb_matmul(backend_stream *st, const backend_matmul_op *ops, int n_ops) {
    cb_stream *s = CB(st);
    const void *last_x = NULL;
    int last_T = 0, last_K = 0;
    for (int i = 0; i < n_ops; i++) {
        const backend_matmul_op *o = &ops[i];
        int fp8 = o->w_dt == BACKEND_F8E4M3;
        if ((o->w_dt != BACKEND_BF16 && !fp8) || o->y_dt != BACKEND_F32 ||
            (o->x_dt != BACKEND_F32 && o->x_dt != BACKEND_BF16) ||
            (fp8 && !o->w_scale.s))
            return -ENOTSUP;
        const void *xb = o->x;
        if (o->x_dt == BACKEND_F32) {
            size_t n = (size_t)o->T * o->K;
            if (!(o->x == last_x && o->T == last_T && o->K == last_K)) {
                if (n * 2 > s->xconv_bytes) {
                    if (s->capturing) return -EINVAL; /* graph_begin's warm-up grew it */
                    s->c->gen++;
                    cudaFree(s->xconv); /* synchronises */
                    s->xconv = NULL;
                    s->xconv_bytes = 0;
                    if (cudaMalloc(&s->xconv, n * 2) != cudaSuccess) return -ENOMEM;
                    s->xconv_bytes = n * 2;
                }
                int rc = to_bf16(s->c, s->xconv, (const float *)o->x, n);
                if (rc) return rc;
                last_x = o->x, last_T = o->T, last_K = o->K;
            }
            xb = s->xconv;
        }
        /* FP8 weights: the e4m3 GEMV for decode-sized T where its 16-byte loads take the
         * shape (not in the batch-invariant mode, whose rows must not depend on T), else the
         * GEMM on the bf16 twin; without a twin (DISAGG_CUDA_FP8_TWIN=0) every T and shape on
         * the GEMV (its scalar form where the loads cannot), 8 tokens a launch: FP8's
         * memory, not a GEMM's speed for prefill */
        if (fp8 && cb_f8_mma(s, o->T, o->K, &o->w_scale, xb, o->w)) {
            dcu_f8scale f8 = {o->w_scale.s, o->w_scale.block_n, o->w_scale.block_k};
            int rc = gemv_f8mma(s->c, (float *)o->y, xb, o->w, &f8, o->bias, o->T, o->N, o->K);
            if (rc) return rc;
            cb_prof_mat(s, "fp8 mma gemv", "", o->N, o->K, (double)o->N * o->K);
            continue;
        }
        if (fp8 && o->T > s->c->fp8_gemv_max_t) {
            int rc = cb_f8_gemm(s, o->y, 0, xb, &o->w_scale, o->w, o->T, o->N, o->K);
            if (!rc && o->bias) rc = add_bias(s->c, (float *)o->y, o->bias, o->N, (size_t)o->T * o->N);
            if (rc != -ENOTSUP) {
                if (rc) return rc;
                continue;
            }
        }
        if (fp8 && cb_f8_gemv(s, o->T, o->K, &o->w_scale, xb, o->w)) {
            dcu_f8scale f8 = {o->w_scale.s, o->w_scale.block_n, o->w_scale.block_k};
            int rc = gemv_f8(s->c, (float *)o->y, xb, o->w, &f8, o->bias, o->T, o->N, o->K);
            if (rc) return rc;
            cb_prof_mat(s, "fp8 gemv", "", o->N, o->K, (double)o->N * o->K);
            continue;
        }
        if (fp8 && (!o->w_scale.twin || (!s->inv && o->T <= s->c->fp8_gemv_max_t &&
                                         gemv_fp8_ok(1, o->K, o->w_scale.block_k, xb, o->w)))) {
            for (int t0 = 0; t0 < o->T; t0 += 8) {
                int nt = o->T - t0 < 8 ? o->T - t0 : 8;
                int rc = gemv_fp8(s->c, (float *)o->y + (size_t)t0 * o->N,
                                  (const bf16 *)xb + (size_t)t0 * o->K, o->w, o->w_scale.s,
                                  o->w_scale.block_n, o->w_scale.block_k, o->bias, nt, o->N, o->K);
                if (rc) return rc;
            }
            cb_prof_mat(s, "fp8 gemv", "", o->N, o->K, (double)o->N * o->K);
            continue;
        }
        const void *wb = fp8 ? o->w_scale.twin : o->w;
        int rc = s->inv ? iv_matmul(s->c->lt, s->c->device, s->c->stream, s->c->ws, s->c->ws_bytes,
                                    &s->pol, (float *)o->y, xb, wb, o->bias, o->T, o->N, o->K)
                        : matmul(s->c, (float *)o->y, xb, wb, o->bias, o->T, o->N, o->K);
        if (rc) return rc;
        if (s->prof && s->prof->on) {
            char nm[40];
            snprintf(nm, sizeof nm, "matmul %dx%d", o->N, o->K);
            prof_mark(s, nm, (double)o->N * o->K * 2);
        }
    }
    return 0;
}

static int cb_rope(backend_stream *st, void *q, int nq, void *k, int nk, backend_dtype dt, int hd,
                   const float *inv_freq) {
    cb_stream *s = CB(st);
    if (dt != BACKEND_F32) return -ENOTSUP;
    int rc = rope(s->c, (float *)q, nq * hd, s->pos, inv_freq, s->T, nq, hd);
    if (!rc && k) rc = rope(s->c, (float *)k, nk * hd, s->pos, inv_freq, s->T, nk, hd);
    return rc;
}

/* the KV dtypes of the module: bf16, f32, FP8 e4m3 (with the layer's scales) */
static int kv_dt_ok(const backend_kv *kv) {
    return kv->dtype == BACKEND_BF16 || kv->dtype == BACKEND_F32 || kv->dtype == BACKEND_F8E4M3;
}
/* the launchers' kv_kind: 0 f32, 1 bf16, 2 e4m3 */
static int kv_kind(const backend_kv *kv) {
    return kv->dtype == BACKEND_BF16 ? 1 : kv->dtype == BACKEND_F8E4M3 ? 2 : 0;
}

static dcu_kv to_dkv(const backend_kv *kv, int layer) {
    dcu_kv d = {kv->base,
                kv->dtype == BACKEND_BF16     ? DCU_BF16
                : kv->dtype == BACKEND_F8E4M3 ? DCU_F8E4M3
                                              : DCU_F32,
                kv->n_blocks,
                kv->block_size,
                kv->n_layers,
                kv->n_kv_heads * kv->head_dim,
                cb_kv_scale(kv, layer, 0),
                cb_kv_scale(kv, layer, 1)};
    return d;
}

static int cb_kv_write(backend_stream *st, const backend_kv *kv, int layer, const void *k,
                       const void *v, backend_dtype dt) {
    cb_stream *s = CB(st);
    if (dt != BACKEND_F32 || !kv_dt_ok(kv)) return -ENOTSUP;
    dcu_kv d = to_dkv(kv, layer);
    return kv_write(s->c, &d, layer, (const float *)k, (const float *)v, d.kv_dim, s->pos, s->seq,
                    s->bt, s->stride, s->T);
}

static void *cb_scratch(cb_stream *s, int i, size_t bytes);

static int cb_attention_to(backend_stream *st, void *out, backend_dtype out_dt, const void *q,
                           backend_dtype dt, const backend_kv *kv, int layer, int n_heads,
                           float scale) {
    cb_stream *s = CB(st);
    if (dt != BACKEND_F32 || !kv_dt_ok(kv) || (out_dt != BACKEND_F32 && out_dt != BACKEND_BF16))
        return -ENOTSUP;
    if (kv->dtype == BACKEND_F8E4M3 && (kv->window > 0 || s->inv)) {
        fprintf(stderr, "cuda: an FP8 KV cache is not implemented with %s; accepted there: "
                        "--kv-cache-dtype bfloat16 or float32\n",
                kv->window > 0 ? "a sliding window (Mistral)" : "--batch-invariant");
        return -ENOTSUP;
    }
    if (kv->window > 0) /* Mistral's sliding window: every call of the model (cuda_window.h) */
        return pm(s,
                  cw_attention(s->c->stream, out, out_dt == BACKEND_BF16, (const float *)q,
                               kv->base, kv->dtype == BACKEND_BF16, kv->block_size, kv->n_layers,
                               layer, s->pos, s->seq, s->bt, s->stride, s->T, n_heads,
                               kv->n_kv_heads, kv->head_dim, scale, kv->window),
                  "attention (sliding window)", 0);
    if (s->inv) { /* f32 partials folded in position order; a bf16 output is rounded after */
        size_t n = (size_t)s->T * n_heads * kv->head_dim;
        float *o32 = (float *)out;
        if (out_dt == BACKEND_BF16) { /* scratch 0 (the q|k|v GEMM's) is dead by now */
            o32 = (float *)cb_scratch(s, 0, n * 4);
            if (!o32) return s->capturing ? -EINVAL : -ENOMEM;
        }
        int rc = iv_attention(s->c->stream, &s->ivs, &s->c->gen, s->capturing, o32,
                              (const float *)q, kv->base, kv->dtype == BACKEND_BF16,
                              kv->block_size, kv->n_layers, layer, s->pos, s->seq, s->bt,
                              s->stride, s->tiles, s->n_tiles, s->rest, s->n_rest,
                              s->n_tiles ? s->rest_ctx : s->max_ctx, n_heads, kv->n_kv_heads,
                              kv->head_dim, scale);
        return rc || out_dt != BACKEND_BF16 ? rc : to_bf16(s->c, out, o32, n);
    }
    dcu_kv d = to_dkv(kv, layer);
    int od = out_dt == BACKEND_BF16 ? DCU_BF16 : DCU_F32;
    double kvb = (double)s->max_ctx * 2 * kv->n_kv_heads * kv->head_dim *
                 (double)cb_kv_elem(kv->dtype) * (s->S > 0 ? s->S : 1);
    if (s->n_tiles && flash_ok(s->c, d.dtype, kv->head_dim))
        return pm(s, attention_mixed(s->c, out, od, (const float *)q, &d, layer, s->pos, s->seq, s->bt,
                               s->stride, s->T, n_heads, kv->n_kv_heads, kv->head_dim, scale,
                               s->tiles, s->n_tiles, s->tiles3, s->n_tiles3, s->rest, s->n_rest,
                               s->rest_ctx),
                  kv->head_dim < 32 ? "attention (prefill, k_prefill_attention_wmma)"
                  : prefill_mma8_for(s->c, s->n_tiles3, n_heads)
                      ? "attention (prefill, k_prefill_attention_mma8w)"
                      : "attention (prefill, k_prefill_attention_mma)",
                  0);
    return pm(s,
              attention_scaled(s->c, out, od, (const float *)q, &d, layer, s->pos, s->seq, s->bt,
                               s->stride, s->T, n_heads, kv->n_kv_heads, kv->head_dim,
                               s->max_ctx, scale),
              "attention (decode)", kvb);
}

static int cb_attention(backend_stream *st, void *out, const void *q, backend_dtype dt,
                        const backend_kv *kv, int layer, int n_heads, float scale) {
    return cb_attention_to(st, out, dt, q, dt, kv, layer, n_heads, scale);
}

/* a scratch buffer of the stream of at least bytes (grown outside recordings only: a decode
 * step's warm-up grows it to the shape before its recording) */
static void *cb_scratch(cb_stream *s, int i, size_t bytes) {
    if (bytes <= s->scr_bytes[i]) return s->scr[i];
    if (s->capturing) return NULL;
    s->c->gen++;
    cudaFree(s->scr[i]); /* synchronises */
    s->scr[i] = NULL;
    s->scr_bytes[i] = 0;
    if (cudaMalloc(&s->scr[i], bytes) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    s->scr_bytes[i] = bytes;
    return s->scr[i];
}

static int cb_add_rmsnorm(backend_stream *st, void *out, backend_dtype out_dt, void *x,
                          const void *add, backend_dtype x_dt, const float *w, int rows, int n,
                          float eps) {
    if (x_dt != BACKEND_F32 || (out_dt != BACKEND_F32 && out_dt != BACKEND_BF16) || n > 12288)
        return -ENOTSUP;
    return pm(CB(st),
              rmsnorm(CB(st)->c, out, out_dt == BACKEND_BF16 ? DCU_BF16 : DCU_F32, (float *)x,
                      (const float *)add, w, NULL, rows, n, eps, add != NULL),
              "add_rmsnorm", 0);
}

static int cb_matmul(backend_stream *st, const backend_matmul_op *ops, int n_ops);

static int cb_qkv_generic(backend_stream *st, const backend_qkv_op *o);

/* one GEMM over q|k|v into scratch, then bias + RoPE + q out + K/V into the cache */
static int cb_qkv(backend_stream *st, const backend_qkv_op *o) {
    cb_stream *s = CB(st);
    const backend_kv *kv = o->kv;
    int fp8 = o->w_dt == BACKEND_F8E4M3; /* through cb_matmul (the FP8 GEMV or the twin) */
    if (o->dt != BACKEND_F32 || (o->w_dt != BACKEND_BF16 && !fp8) || !kv_dt_ok(kv))
        return -ENOTSUP;
    const float ksc = cb_kv_scale(kv, o->layer, 0), vsc = cb_kv_scale(kv, o->layer, 1);
    const int kk = kv_kind(kv);
    int T = s->T, nh = o->n_heads, nkv = kv->n_kv_heads, hd = kv->head_dim,
        W = (nh + 2 * nkv) * hd;
    if (T <= 0) return 0;
    if (o->q_norm) { /* Qwen3: the q|k|v GEMM in f32, then norm, RoPE, KV (cuda_qknorm.h) */
        float *qkv = (float *)cb_scratch(s, 0, (size_t)T * W * 4);
        if (!qkv) return s->capturing ? -EINVAL : -ENOMEM;
        backend_matmul_op g = {qkv, BACKEND_F32, o->x, o->x_dt, o->wqkv, o->w_dt, NULL, T, W,
                               o->hidden, o->sqkv};
        int rc = cb_matmul(st, &g, 1);
        if (rc) return rc;
        return pm(s,
                  cq_qknorm_finish(s->c->stream, (float *)o->q, kv->base, kk, kv->block_size,
                                   kv->n_layers, o->layer, qkv, o->bqkv, o->q_norm, o->k_norm,
                                   o->qk_eps, s->pos, s->seq, s->bt, s->stride, o->inv_freq, T,
                                   nh, nkv, hd, ksc, vsc),
                  "qk norm finish (bias, q/k norm, rope, kv)", 0);
    }
    if (!fp8 && !s->inv && s->c->qkv_fuse && o->wqkv && o->x_dt == BACKEND_BF16 &&
        gemv_ok(s->c, T, o->hidden, o->x, o->wqkv)) {
        /* decode: one GEMV over q|k|v with bias, RoPE and the KV write in its epilogue */
        int rc = gemv_qkv(s->c, (float *)o->q, kv->base, kk, o->x, o->wqkv, NULL, o->bqkv, T,
                          o->hidden, kv->block_size, kv->n_layers, o->layer, s->pos, s->seq,
                          s->bt, s->stride, o->inv_freq, nh, nkv, hd, ksc, vsc);
        return pm(s, rc, "qkv gemv (bias, rope, kv)", (double)W * o->hidden * 2);
    }
    if (fp8 && s->c->qkv_fuse && o->wqkv && o->x_dt == BACKEND_BF16 && hd % 16 == 0 &&
        cb_f8_mma(s, T, o->hidden, &o->sqkv, o->x, o->wqkv)) {
        /* the same on the tensor cores (DISAGG_CUDA_FP8_MMA), T <= 16 */
        dcu_f8scale f8 = {o->sqkv.s, o->sqkv.block_n, o->sqkv.block_k};
        int rc = gemv_f8mma_qkv(s->c, (float *)o->q, kv->base, kk, o->x, o->wqkv, &f8, o->bqkv,
                                T, o->hidden, kv->block_size, kv->n_layers, o->layer, s->pos,
                                s->seq, s->bt, s->stride, o->inv_freq, nh, nkv, hd, ksc, vsc);
        return pm(s, rc, "fp8 mma qkv gemv (bias, rope, kv)", (double)W * o->hidden);
    }
    if (fp8 && s->c->qkv_fuse && o->wqkv && o->x_dt == BACKEND_BF16 &&
        cb_f8_gemv(s, T, o->hidden, &o->sqkv, o->x, o->wqkv)) {
        /* the same fused GEMV over FP8 q|k|v weights */
        dcu_f8scale f8 = {o->sqkv.s, o->sqkv.block_n, o->sqkv.block_k};
        int rc = gemv_qkv(s->c, (float *)o->q, kv->base, kk, o->x, o->wqkv, &f8, o->bqkv, T,
                          o->hidden, kv->block_size, kv->n_layers, o->layer, s->pos, s->seq,
                          s->bt, s->stride, o->inv_freq, nh, nkv, hd, ksc, vsc);
        return pm(s, rc, "fp8 qkv gemv (bias, rope, kv)", (double)W * o->hidden);
    }
    /* prefill-sized batches (T >= c->qkv_bf16_min_t, fast mode, bf16 x): the GEMM writes
     * q|k|v in bf16 (its epilogue rounds the f32 accumulator; the bias is added after, in
     * f32, then RoPE in f32) and k_qkv_finish reads that: 2 instead of 4 bytes of T x W
     * written and read back */
    if (!s->inv && o->x_dt == BACKEND_BF16 && s->c->qkv_bf16_min_t > 0 &&
        T >= s->c->qkv_bf16_min_t &&
        (!fp8 || (T > s->c->fp8_gemv_max_t &&
                  (o->sqkv.twin || cb_f8_block(&o->sqkv, o->hidden))))) {
        const void *wqkv = fp8 ? o->sqkv.twin : o->wqkv;
        bf16 *qkv16 = (bf16 *)cb_scratch(s, 0, (size_t)T * W * 2);
        if (!qkv16) return s->capturing ? -EINVAL : -ENOMEM;
        /* FP8 weights: the e4m3 tensor-core GEMM, else the bf16 twin */
        int rc = fp8 ? cb_f8_gemm(s, qkv16, 2, o->x, &o->sqkv, o->wqkv, T, W, o->hidden)
                     : -ENOTSUP;
        if (rc == -ENOTSUP && !wqkv) return cb_qkv_generic(st, o);
        if (rc == -ENOTSUP)
            rc = pm(s, matmul_bf16out(s->c, qkv16, o->x, wqkv, T, W, o->hidden),
                    "q|k|v GEMM (bf16 out)", (double)W * o->hidden * 2);
        if (rc) return rc;
        rc = qkv_finish(s->c, (float *)o->q, kv->base, kk, kv->block_size, kv->n_layers,
                        o->layer, qkv16, DCU_BF16, o->bqkv, s->pos, s->seq, s->bt, s->stride,
                        o->inv_freq, T, nh, nkv, hd, ksc, vsc);
        return pm(s, rc,
                  qkv_finish_vec2(hd) ? "qkv_finish2 (bf16 in; bias, rope, kv)"
                                      : "qkv_finish (bf16 q|k|v; bias, rope, kv)",
                  0);
    }
    return cb_qkv_generic(st, o);
}

/* cb_qkv's general form: the q|k|v matmul (cb_matmul: any weights, any T) into f32 scratch,
 * then bias + RoPE + q out + K/V into the cache */
static int cb_qkv_generic(backend_stream *st, const backend_qkv_op *o) {
    cb_stream *s = CB(st);
    const backend_kv *kv = o->kv;
    const float ksc = cb_kv_scale(kv, o->layer, 0), vsc = cb_kv_scale(kv, o->layer, 1);
    const int kk = kv_kind(kv);
    int T = s->T, nh = o->n_heads, nkv = kv->n_kv_heads, hd = kv->head_dim,
        W = (nh + 2 * nkv) * hd;
    float *qkv = (float *)cb_scratch(s, 0, (size_t)T * W * 4);
    if (!qkv) return s->capturing ? -EINVAL : -ENOMEM;
    backend_matmul_op g = {qkv, BACKEND_F32, o->x, o->x_dt, o->wqkv, o->w_dt, NULL, T, W,
                           o->hidden, o->sqkv};
    int rc = cb_matmul(st, &g, 1);
    if (rc) return rc;
    rc = qkv_finish(s->c, (float *)o->q, kv->base, kk, kv->block_size, kv->n_layers, o->layer,
                    qkv, DCU_F32, o->bqkv, s->pos, s->seq, s->bt, s->stride, o->inv_freq, T, nh,
                    nkv, hd, ksc, vsc);
    return pm(s, rc, "qkv_finish (bias, rope, kv)", 0);
}

/* one GEMM over gate|up into scratch, then h = silu(gate) * up in h_dt */
static int cb_gate_up(backend_stream *st, const backend_mlp_op *o) {
    cb_stream *s = CB(st);
    int fp8 = o->w_dt == BACKEND_F8E4M3; /* through cb_matmul (the FP8 GEMV or the twin) */
    if ((o->w_dt != BACKEND_BF16 && !fp8) || (o->h_dt != BACKEND_F32 && o->h_dt != BACKEND_BF16))
        return -ENOTSUP;
    int T = o->T, I = o->inter;
    const void *wgu = fp8 ? o->s_gate_up.twin : o->w_gate_up; /* what the bf16 GEMMs read */
    if (!fp8 && !s->inv && o->w_gate_up && o->x_dt == BACKEND_BF16 &&
        gemv_ok(s->c, T, o->hidden, o->x, o->w_gate_up))
        /* decode: one GEMV over gate|up with the SwiGLU in its epilogue (no f32 gate|up) */
        return pm(s,
                  gemv_gate_up(s->c, o->h, o->h_dt == BACKEND_BF16 ? DCU_BF16 : DCU_F32, o->x,
                               o->w_gate_up, NULL, T, I, o->hidden),
                  "gate_up+swiglu gemv", 2.0 * I * o->hidden * 2);
    if (fp8 && o->w_gate_up && o->x_dt == BACKEND_BF16 &&
        cb_f8_mma(s, T, o->hidden, &o->s_gate_up, o->x, o->w_gate_up)) {
        /* the same on the tensor cores (DISAGG_CUDA_FP8_MMA) */
        dcu_f8scale f8 = {o->s_gate_up.s, o->s_gate_up.block_n, o->s_gate_up.block_k};
        return pm(s,
                  gemv_f8mma_gate_up(s->c, o->h, o->h_dt == BACKEND_BF16 ? DCU_BF16 : DCU_F32,
                                     o->x, o->w_gate_up, &f8, T, I, o->hidden),
                  "fp8 mma gate_up+swiglu gemv", 2.0 * I * o->hidden);
    }
    if (fp8 && o->w_gate_up && o->x_dt == BACKEND_BF16 &&
        cb_f8_gemv(s, T, o->hidden, &o->s_gate_up, o->x, o->w_gate_up)) {
        /* the same over FP8 gate|up weights */
        dcu_f8scale f8 = {o->s_gate_up.s, o->s_gate_up.block_n, o->s_gate_up.block_k};
        return pm(s,
                  gemv_gate_up(s->c, o->h, o->h_dt == BACKEND_BF16 ? DCU_BF16 : DCU_F32, o->x,
                               o->w_gate_up, &f8, T, I, o->hidden),
                  "fp8 gate_up+swiglu gemv", 2.0 * I * o->hidden);
    }
    /* prefill-sized batches (T >= c->gu_bf16_min_t, fast mode, bf16 x): the GEMM writes
     * gate|up in bf16 and SwiGLU reads that (the f32 intermediate was 4 bytes x T x 2I
     * written and read back: 620 MB a layer at 4,096 tokens of the 7B shape) */
    if (!s->inv && o->x_dt == BACKEND_BF16 && s->c->gu_bf16_min_t > 0 &&
        T >= s->c->gu_bf16_min_t &&
        (!fp8 || (T > s->c->fp8_gemv_max_t &&
                  (wgu || (o->w_gate_up && cb_f8_block(&o->s_gate_up, o->hidden)))))) {
        bf16 *gu16 = (bf16 *)cb_scratch(s, 1, (size_t)T * 2 * I * 2);
        if (!gu16) return s->capturing ? -EINVAL : -ENOMEM;
        /* FP8 weights: the e4m3 tensor-core GEMM, else the bf16 twin */
        int rc = fp8 && o->w_gate_up ? cb_f8_gemm(s, gu16, 2, o->x, &o->s_gate_up, o->w_gate_up,
                                                  T, 2 * I, o->hidden)
                                     : -ENOTSUP;
        if (rc == -ENOTSUP && wgu)
            rc = pm(s, matmul_bf16out(s->c, gu16, o->x, wgu, T, 2 * I, o->hidden),
                    "gate|up GEMM (bf16 out)", 2.0 * 2 * I * o->hidden);
        if (rc == -ENOTSUP) goto general;
        if (rc) return rc;
        return pm(s,
                  swiglu16(s->c, o->h, o->h_dt == BACKEND_BF16 ? DCU_BF16 : DCU_F32, gu16, T, I),
                  "swiglu (bf16 gate|up)", 0);
    }
    /* the batch-invariant mode (bf16 x): gate|up in bf16 at EVERY row count, decode included,
     * so a row's rounding never depends on the batch (iv_matmul_bf16out's pinned and
     * probe-verified algorithms), then the same SwiGLU */
    if (s->inv && s->pol.gu16 && o->x_dt == BACKEND_BF16 && wgu) {
        bf16 *gu16 = (bf16 *)cb_scratch(s, 1, (size_t)T * 2 * I * 2);
        if (!gu16) return s->capturing ? -EINVAL : -ENOMEM;
        int rc = pm(s,
                    iv_matmul_bf16out(s->c->lt, s->c->device, s->c->stream, s->c->ws,
                                      s->c->ws_bytes, &s->pol, gu16, o->x, wgu, T, 2 * I,
                                      o->hidden),
                    "gate|up GEMM (invariant, bf16 out)", 2.0 * 2 * I * o->hidden);
        if (rc) return rc;
        return pm(s,
                  swiglu16(s->c, o->h, o->h_dt == BACKEND_BF16 ? DCU_BF16 : DCU_F32, gu16, T, I),
                  "swiglu (bf16 gate|up)", 0);
    }
general:;
    float *gu = (float *)cb_scratch(s, 1, (size_t)T * 2 * I * 4);
    if (!gu) return s->capturing ? -EINVAL : -ENOMEM;
    backend_matmul_op g = {gu, BACKEND_F32, o->x, o->x_dt, o->w_gate_up, o->w_dt, NULL, T,
                           2 * I, o->hidden, o->s_gate_up};
    int rc = cb_matmul(st, &g, 1);
    if (rc) return rc;
    return pm(s, swiglu(s->c, o->h, o->h_dt == BACKEND_BF16 ? DCU_BF16 : DCU_F32, gu, T, I),
              "swiglu", 0);
}

static int cb_measure(backend *be, double *copy_gbs, double *gemm_tflops, int M, int N, int K) {
    cb_dev *d = (cb_dev *)be->ctx;
    cudaSetDevice(d->ord);
    return measure(d->loader, copy_gbs, gemm_tflops, M, N, K);
}

__global__ void k_swiglu2(float *g, const float *u, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float x = g[i];
        g[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

static int cb_swiglu(backend_stream *st, void *g, const void *u, backend_dtype dt, int rows,
                     int n) {
    if (dt != BACKEND_F32) return -ENOTSUP;
    size_t cnt = (size_t)rows * n;
    k_swiglu2<<<grid_for(cnt, 256), 256, 0, CB(st)->c->stream>>>((float *)g, (const float *)u,
                                                                  cnt);
    return launch_check("swiglu");
}

static int cb_add(backend_stream *st, void *y, const void *x, backend_dtype dt, size_t n) {
    if (dt != BACKEND_F32) return -ENOTSUP;
    return pm(CB(st), add(CB(st)->c, (float *)y, (const float *)x, n), "add", 0);
}

__global__ void k_gather(float *out, const float *x, const int32_t *rows, int width) {
    int r = blockIdx.x;
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        out[(size_t)r * width + i] = x[(size_t)rows[r] * width + i];
}

static int cb_gather_rows(backend_stream *st, void *out, const void *x, backend_dtype dt,
                          int width) {
    cb_stream *s = CB(st);
    if (dt != BACKEND_F32) return -ENOTSUP;
    if (!s->n_out) return 0;
    k_gather<<<s->n_out, 256, 0, s->c->stream>>>((float *)out, (const float *)x, s->orow, width);
    return pm(s, launch_check("gather_rows"), "gather_rows", 0);
}

static int cb_argmax(backend_stream *st, int32_t *out, const float *logits, int rows, int vocab) {
    return pm(CB(st), argmax(CB(st)->c, out, logits, rows, vocab), "argmax", 0);
}

static int cb_token_bitmask(backend_stream *st, float *logits, int width, const int32_t *bitmask,
                            const int32_t *rows, int n, int vocab) {
    ON_DEV(st);
    return pm(CB(st), token_bitmask(CB(st)->c, logits, width, bitmask, rows, n, vocab),
              "token_bitmask", 0);
}

/* backend_upload_async: host is page-locked (a BACKEND_BUF_HOST buffer), so the copy runs
 * from it in the stream's order without a staging copy or a sync */
static int cb_upload_async(backend_stream *st, void *dev, const void *host, size_t n) {
    ON_DEV(st);
    if (CB(st)->capturing) return -EINVAL;
    CK(cudaMemcpyAsync(dev, host, n, cudaMemcpyHostToDevice, CB(st)->c->stream));
    return 0;
}

/* backend_residual_fused: the fast mode at T >= c->resid_min_t (DISAGG_CUDA_RESID_GEMM); never
 * in the batch-invariant mode, whose op sequence stays the plain one at every T */
static int cb_residual_fused(backend_stream *st, int T) {
    cb_stream *s = CB(st);
    return !s->inv && s->c->resid_min_t > 0 && T >= s->c->resid_min_t;
}

/* resid += x . w^T: cuBLASLt with beta = 1 onto resid where the GEMM would be cuBLASLt's (bf16
 * x, no bias, not the GEMV's T), else the generic form (GEMM into op->y,
 * then add) */
static int cb_matmul_residual(backend_stream *st, const backend_matmul_op *o, void *resid) {
    cb_stream *s = CB(st);
    dcu_ctx *c = s->c;
    /* FP8 weights at GEMM sizes: the e4m3 tensor-core GEMM with beta = 1 onto resid, else the
     * same over their bf16 twin */
    if (o->w_dt == BACKEND_F8E4M3 && o->T > c->fp8_gemv_max_t && cb_residual_fused(st, o->T) &&
        o->y_dt == BACKEND_F32 && o->x_dt == BACKEND_BF16 && !o->bias) {
        int rc = cb_f8_gemm(s, resid, 1, o->x, &o->w_scale, o->w, o->T, o->N, o->K);
        if (rc != -ENOTSUP) return rc;
    }
    int fp8 = o->w_dt == BACKEND_F8E4M3 && o->w_scale.twin && o->T > c->fp8_gemv_max_t;
    const void *wb = fp8 ? o->w_scale.twin : o->w;
    if (cb_residual_fused(st, o->T) && o->y_dt == BACKEND_F32 && o->x_dt == BACKEND_BF16 &&
        (o->w_dt == BACKEND_BF16 || fp8) && !o->bias && !gemv_ok(c, o->T, o->K, o->x, wb)) {
        int rc = matmul_acc(c, (float *)resid, (float *)o->y, o->x, wb, o->T, o->N, o->K);
        if (rc) return rc;
        if (s->prof && s->prof->on) {
            char nm[48];
            snprintf(nm, sizeof nm, "matmul %dx%d (+= residual)", o->N, o->K);
            prof_mark(s, nm, (double)o->N * o->K * 2);
        }
        return 0;
    }
    int rc = cb_matmul(st, o, 1);
    return rc ? rc : cb_add(st, resid, o->y, o->y_dt, (size_t)o->T * o->N);
}

/* ---- mixture of experts (cuda_moe.cu) ---------------------------------------------------- */

static int cb_moe_route(backend_stream *st, int32_t *ids, float *weights, const float *logits,
                        int T, int n_experts, int top_k, int norm) {
    return pm(CB(st), moe_route(CB(st)->c->stream, ids, weights, logits, T, n_experts, top_k, norm),
              "moe route", 0);
}

/* decode (few (token, expert) pairs): DISAGG_CUDA_MOE_DEC_PAIRS (default 512, at most
 * MOE_DEC_MAXP; 0: the grouped GEMM at every T), read at every call (tests switch it); the
 * batch-invariant mode always takes the grouped GEMM, whose rows do not depend on the batch */
static int moe_dec_pairs(void) {
    const char *e = getenv("DISAGG_CUDA_MOE_DEC_PAIRS");
    int v = e && *e ? atoi(e) : 512;
    return v < 0 ? 0 : v > MOE_DEC_MAXP ? MOE_DEC_MAXP : v;
}

static int cb_moe(backend_stream *st, const backend_moe_op *o) {
    cb_stream *s = CB(st);
    if (o->w_dt != BACKEND_BF16 || !o->w_gate_up_all || !o->w_down_all ||
        (o->x_dt != BACKEND_F32 && o->x_dt != BACKEND_BF16) ||
        (o->out_dt != BACKEND_F32 && o->out_dt != BACKEND_BF16) ||
        !moe_shape_ok(o->hidden, o->inter) ||
        (((uintptr_t)o->x | (uintptr_t)o->w_gate_up_all | (uintptr_t)o->w_down_all) & 15))
        return -ENOTSUP;
    moe_args a;
    a.x = o->x;
    a.x_bf16 = o->x_dt == BACKEND_BF16;
    a.T = o->T;
    a.hidden = o->hidden;
    a.inter = o->inter;
    a.n_experts = o->n_experts;
    a.top_k = o->top_k;
    a.ids = o->ids;
    a.weights = o->weights;
    a.w_gate_up_all = o->w_gate_up_all;
    a.w_down_all = o->w_down_all;
    a.out = o->out;
    a.out_bf16 = o->out_dt == BACKEND_BF16;
    a.path = moe_path(o->T, o->top_k, o->n_experts, moe_dec_pairs(), s->inv);
    const char *fd = getenv("DISAGG_CUDA_MOE_FUSED_DOWN");
    a.fused_down = !(fd && !strcmp(fd, "0"));
    const char *yb = getenv("DISAGG_CUDA_MOE_Y_BF16");
    a.y_bf16 = yb && !strcmp(yb, "1");
    const char *gc = getenv("DISAGG_CUDA_MOE_GEMM");
    a.gemm_bk32 = gc && !strcmp(gc, "bk32");
    const char *bm = getenv("DISAGG_CUDA_MOE_BM"); /* 16, 32, 64, 128, auto; default 128 */
    a.gemm_bm = moe_gemm_bm(o->T, o->top_k, o->n_experts,
                            !bm || !*bm ? 0 : !strcmp(bm, "auto") ? -1 : atoi(bm));
    size_t need = moe_ws_bytes(&a);
    void *ws = cb_scratch(s, 2, need);
    if (!ws) return s->capturing ? -EINVAL : -ENOMEM;
    double bytes = 0;
    if (s->prof && s->prof->on) { /* the weights of the distinct chosen experts, at most */
        long P = (long)o->T * o->top_k, ne = P < o->n_experts ? P : o->n_experts;
        bytes = (double)ne * 3 * o->inter * o->hidden * 2;
    }
    return pm(s, moe_run(s->c->stream, s->c->n_sm, ws, need, &a),
              a.path == MOE_PATH_DECODE ? "moe (decode GEMVs)" : "moe (grouped GEMM)", bytes);
}

/* ---- layer-progress events (backend.h "layer progress") ---------------------------------- */

static int cb_event_new(backend *be, void **ev) {
    cudaSetDevice(((cb_dev *)be->ctx)->ord);
    cudaEvent_t e;
    CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    *ev = (void *)e;
    return 0;
}

static void cb_event_free(backend *be, void *ev) {
    cudaSetDevice(((cb_dev *)be->ctx)->ord);
    cudaEventDestroy((cudaEvent_t)ev);
}

static int cb_event_record(backend_stream *st, void *ev) {
    cb_stream *s = CB(st);
    if (s->capturing) return 1; /* the graph's replays would not record it */
    CK(cudaEventRecord((cudaEvent_t)ev, s->c->stream));
    return 0;
}

static int cb_event_query(backend *be, void *ev) {
    cudaSetDevice(((cb_dev *)be->ctx)->ord);
    cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
    if (e == cudaSuccess) return 1;
    if (e == cudaErrorNotReady) return 0;
    fprintf(stderr, "cuda: cudaEventQuery (layer progress) failed: %s\n", cudaGetErrorString(e));
    return -EIO;
}

static const backend_iface CB_IFACE = {
    cb_free,     cb_memory,         cb_buffer_alloc, cb_weights_load, cb_buffer_free,
    cb_stream_create, cb_stream_free, cb_stream_sync, cb_upload,      cb_download,
    cb_copy,     cb_memset_zero,    cb_plan,         cb_embed,        cb_rmsnorm,
    cb_matmul,     cb_rope,         cb_kv_write,     cb_attention,    cb_swiglu,
    cb_add,      cb_gather_rows,    cb_argmax,       cb_graph_plan,   cb_graph_begin,
    cb_graph_end, cb_graph_reset,   cb_graph_count,   cb_weights_load_cat, cb_add_rmsnorm,
    cb_qkv,      cb_gate_up,        cb_attention_to,  cb_measure,     cb_matmul_residual,
    cb_residual_fused, cb_moe_route,  cb_moe, cb_weights_load_fp8, cb_event_new, cb_event_free,
    cb_event_record, cb_event_query, cb_upload_async, cb_token_bitmask,
};

extern "C" __attribute__((visibility("default"))) int
disagg_backend_module_open(int abi_version, const backend_options *opts, backend **out, char *err,
                           size_t errlen) {
    *out = NULL;
    if (abi_version != BACKEND_ABI_VERSION) {
        seterr(err, errlen,
               "--device cuda: the CUDA module speaks backend ABI %d, this disagg %d (rebuild "
               "them together)",
               BACKEND_ABI_VERSION, abi_version);
        return -EPROTO;
    }
    int ord = opts ? opts->device_ord : 0;
    cb_dev *d = (cb_dev *)calloc(1, sizeof *d);
    backend *be = (backend *)calloc(1, sizeof *be);
    if (!d || !be) {
        free(d);
        free(be);
        seterr(err, errlen, "out of host memory opening cuda:%d", ord);
        return -ENOMEM;
    }
    be->ctx = d;
    d->ord = ord;
    d->progress = opts ? opts->progress : 0;
    d->inv = opts ? opts->batch_invariant : 0;
    char why[512];
    if (probe(ord, &d->info, why, sizeof why)) {
        seterr(err, errlen, "--device cuda:%d: %s", ord, why);
        cb_free(be);
        return -ENODEV;
    }
    d->loader = ctx_create(ord, why, sizeof why);
    if (!d->loader) {
        seterr(err, errlen, "--device cuda:%d: %s", ord, why);
        cb_free(be);
        return -ENODEV;
    }
    d->stage_bytes = 32u << 20;
    for (int i = 0; i < 2; i++) {
        if (cudaHostAlloc(&d->stage[i], d->stage_bytes, cudaHostAllocDefault) != cudaSuccess ||
            cudaEventCreateWithFlags(&d->ev[i], cudaEventDisableTiming) != cudaSuccess) {
            seterr(err, errlen, "--device cuda:%d: cannot allocate pinned staging memory", ord);
            cb_free(be);
            return -ENOMEM;
        }
        cudaEventRecord(d->ev[i], d->loader->stream);
    }
    be->iface = &CB_IFACE;
    snprintf(be->name, sizeof be->name, "cuda:%d (%.60s)", ord, d->info.name);
    snprintf(be->location, sizeof be->location, "cuda:%d", ord);
    be->is_cpu = 0;
    be->attention_window = 1;
    be->act_dtype = BACKEND_F32;
    be->mm_dtype = BACKEND_BF16;
    be->kv_dtype = BACKEND_BF16;
    be->kv_dtypes = (1u << BACKEND_F32) | (1u << BACKEND_BF16) | (1u << BACKEND_F8E4M3);
    *out = be;
    return 0;
}
