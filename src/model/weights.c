/*
 * weights — binds Hugging Face decoder tensor names (Qwen2/Qwen3/Llama/Mistral: the
 * same names, the description says which exist; Qwen3-MoE / Mixtral add their routers and
 * experts) to the forward's weight structs, in buffers of the model's backend; or, with
 * --load-format dummy, random weights of the same shapes and no files.
 */
#include "model/weights.h"

#include "base/rng.h"
#include "model/arch.h"
#include "model/quant.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int w_dtype(const char *s, backend_dtype *out) {
    if (!strcmp(s, "BF16"))
        *out = BACKEND_BF16;
    else if (!strcmp(s, "F16"))
        *out = BACKEND_F16;
    else if (!strcmp(s, "F32"))
        *out = BACKEND_F32;
    else
        return -1;
    return 0;
}

static const st_tensor *w_find(model_weights *w, const char *name, int n_dims, int64_t d0,
                               int64_t d1, char *err, size_t errlen) {
    const st_tensor *t = st_set_find(&w->st, name);
    if (!t) {
        snprintf(err, errlen, "missing tensor '%s' in the model's safetensors (%s%s)", name,
                 w->st.n_files ? w->st.files[0].path : "?", w->st.n_files > 1 ? ", ..." : "");
        return NULL;
    }
    backend_dtype dt;
    if (w_dtype(t->dtype, &dt) != 0 && !(n_dims == 2 && !strcmp(t->dtype, "F8_E4M3"))) {
        snprintf(err, errlen,
                 "%s: tensor '%s' has unsupported dtype %s (accepted: BF16, F16, F32%s)",
                 st_set_file_of(&w->st, t), name, t->dtype,
                 n_dims == 2 ? ", F8_E4M3 with its scales" : "");
        return NULL;
    }
    if (t->n_dims != n_dims || t->shape[0] != d0 || (n_dims == 2 && t->shape[1] != d1)) {
        char got[96] = "", want[64];
        size_t o = 0;
        for (int i = 0; i < t->n_dims; i++)
            o += (size_t)snprintf(got + o, sizeof got - o, "%s%lld", i ? ", " : "",
                                  (long long)t->shape[i]);
        if (n_dims == 2)
            snprintf(want, sizeof want, "%lld, %lld", (long long)d0, (long long)d1);
        else
            snprintf(want, sizeof want, "%lld", (long long)d0);
        snprintf(err, errlen, "%s: tensor '%s' has shape [%s], config.json implies [%s]",
                 st_set_file_of(&w->st, t), name, got, want);
        return NULL;
    }
    return t;
}

/* A tensor's bytes: from the safetensors, or (dummy) made up here -- bf16 uniform in
 * [-1/sqrt(cols), 1/sqrt(cols)) for matrices, f32 `fill` for vectors (norms 1, biases 0).
 * Made-up bytes live in w->dummy until w_release (the CPU backend aliases them: until
 * weights_free). */
typedef struct w_src {
    const void *data;
    backend_dtype dt;
    size_t nbytes;
    int rows, cols; /* the shape this rank holds (1-D: cols 1) */
} w_src;

/* keeps host bytes made here (dummy weights, a rank's copied slice) until w_release */
static int w_hold(model_weights *w, void *buf) {
    if (w->n_dummy == w->cap_dummy) {
        int cap = w->cap_dummy ? 2 * w->cap_dummy : 64;
        void **p = realloc(w->dummy, (size_t)cap * sizeof *p);
        if (!p) return -ENOMEM;
        w->dummy = p;
        w->cap_dummy = cap;
    }
    w->dummy[w->n_dummy++] = buf;
    return 0;
}

/* This rank's cut of out (the whole tensor, d0 x d1; model/tp_shard.h): rows in place, columns
 * and vocabulary rows copied (the whole made-up tensor freed then). */
static int w_cut(model_weights *w, w_src *out, const char *name, int n_dims, int64_t d0,
                 int64_t d1) {
    out->rows = (int)d0;
    out->cols = n_dims == 2 ? (int)d1 : 1;
    if (!w->tp) return 0;
    tp_split sp = tp_shard_split(w->tp, name);
    size_t es = backend_dtype_size(out->dt), cols = (size_t)out->cols;
    if (sp.kind == TP_WHOLE) return 0;
    if (sp.kind == TP_ROWS) {
        out->data = (const char *)out->data + (size_t)sp.first * cols * es;
        out->rows = sp.count;
        out->nbytes = (size_t)sp.count * cols * es;
        return 0;
    }
    size_t rows = sp.kind == TP_COLS ? (size_t)d0 : (size_t)sp.pad_rows;
    size_t ncols = sp.kind == TP_COLS ? (size_t)sp.count : cols;
    char *buf = calloc(rows * ncols, es);
    if (!buf || w_hold(w, buf)) {
        free(buf);
        return -ENOMEM;
    }
    const char *src = out->data;
    if (sp.kind == TP_COLS)
        for (size_t r = 0; r < rows; r++)
            memcpy(buf + r * ncols * es, src + (r * cols + (size_t)sp.first) * es, ncols * es);
    else if (sp.count > 0)
        memcpy(buf, src + (size_t)sp.first * cols * es, (size_t)sp.count * cols * es);
    /* a made-up whole tensor is not needed any more (the last one held before buf) */
    if (w->dummy_seed && w->n_dummy >= 2 && w->dummy[w->n_dummy - 2] == src) {
        free(w->dummy[w->n_dummy - 2]);
        w->dummy[w->n_dummy - 2] = buf;
        w->n_dummy--;
    }
    out->data = buf;
    out->rows = (int)rows;
    out->cols = (int)ncols;
    out->nbytes = rows * ncols * es;
    return 0;
}

/* Made-up bf16 values: uniform in [-scale, scale), one generator per chunk of DUMMY_CHUNK
 * values seeded from (seed, chunk), so that threads fill the chunks of a large tensor in
 * parallel (one generator for the whole tensor made 1 GB/s: a minute for a 61 GB MoE shape)
 * and the bytes never depend on the number of threads. */
#define DUMMY_CHUNK       ((size_t)1 << 20)
#define DUMMY_MAX_THREADS 32
typedef struct dummy_job {
    uint16_t *b;
    size_t n, next; /* next: the next chunk to take (atomic) */
    uint64_t seed;
    float a;
} dummy_job;

static void dummy_chunk(const dummy_job *j, size_t c) {
    rng_state rs;
    rng_seed(&rs, rng_mix64(j->seed ^ rng_mix64(c + 1)));
    size_t end = (c + 1) * DUMMY_CHUNK < j->n ? (c + 1) * DUMMY_CHUNK : j->n;
    for (size_t i = c * DUMMY_CHUNK; i < end; i += 4) {
        uint64_t r = rng_next(&rs);
        for (size_t k = 0; k < 4 && i + k < end; k++) {
            float f = (float)(int16_t)(r >> (16 * k)) * j->a;
            uint32_t u;
            memcpy(&u, &f, 4);
            j->b[i + k] = (uint16_t)(u >> 16);
        }
    }
}

static void *dummy_worker(void *arg) {
    dummy_job *j = arg;
    size_t chunks = (j->n + DUMMY_CHUNK - 1) / DUMMY_CHUNK, c;
    while ((c = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < chunks)
        dummy_chunk(j, c);
    return NULL;
}

static void dummy_fill_bf16(uint16_t *b, size_t n, uint64_t seed, float scale) {
    dummy_job j = {.b = b, .n = n, .seed = seed, .a = scale / 32768.0f};
    size_t chunks = (n + DUMMY_CHUNK - 1) / DUMMY_CHUNK;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int nt = cpus < 1 ? 1 : cpus > DUMMY_MAX_THREADS ? DUMMY_MAX_THREADS : (int)cpus;
    if ((size_t)nt > chunks) nt = (int)chunks;
    pthread_t th[DUMMY_MAX_THREADS];
    int started = 0;
    for (int t = 1; t < nt; t++) /* a thread that cannot start leaves its chunks to the rest */
        if (!pthread_create(&th[started], NULL, dummy_worker, &j)) started++;
    dummy_worker(&j);
    for (int t = 0; t < started; t++)
        pthread_join(th[t], NULL);
}

static int w_get(model_weights *w, w_src *out, const char *name, int n_dims, int64_t d0, int64_t d1,
                 float fill, char *err, size_t errlen) {
    if (!w->dummy_seed) {
        const st_tensor *t = w_find(w, name, n_dims, d0, d1, err, errlen);
        if (!t) return -EINVAL;
        if (w_dtype(t->dtype, &out->dt)) out->dt = BACKEND_F8E4M3; /* w_find allowed only it */
        if (w->st_used) w->st_used[t - w->st.tensors] = 1;
        out->data = t->data;
        out->nbytes = t->nbytes;
        return w_cut(w, out, name, n_dims, d0, d1);
    }
    size_t n = (size_t)d0 * (size_t)(n_dims == 2 ? d1 : 1);
    size_t es = n_dims == 2 ? 2 : 4;
    void *buf = malloc(n * es);
    if (!buf || w_hold(w, buf)) {
        free(buf);
        snprintf(err, errlen, "cannot allocate %zu bytes of dummy weights for '%s'", n * es, name);
        return -ENOMEM;
    }
    if (n_dims == 2) {
        /* seeded from the tensor's name: the same weights every load */
        uint64_t h = w->dummy_seed;
        for (const char *c = name; *c; c++)
            h = rng_mix64(h ^ (unsigned char)*c);
        dummy_fill_bf16(buf, n, h, 1.0f / sqrtf((float)d1));
        out->dt = BACKEND_BF16;
    } else {
        float *f = buf;
        for (size_t i = 0; i < n; i++)
            f[i] = fill;
        out->dt = BACKEND_F32;
    }
    out->data = buf;
    out->nbytes = n * es;
    return w_cut(w, out, name, n_dims, d0, d1);
}

/* bytes made here that the backend has copied: freed (not on the CPU, which aliases them) */
static void w_release(model_weights *w) {
    if (backend_is_cpu(w->be)) return;
    for (int i = 0; i < w->n_dummy; i++)
        free(w->dummy[i]);
    w->n_dummy = 0;
}

static int w_keep(model_weights *w, backend_buffer *b) {
    if (w->n_bufs == w->cap_bufs) {
        int cap = w->cap_bufs ? 2 * w->cap_bufs : 64;
        backend_buffer **p = realloc(w->bufs, (size_t)cap * sizeof *p);
        if (!p) return -ENOMEM;
        w->bufs = p;
        w->cap_bufs = cap;
    }
    w->bufs[w->n_bufs++] = b;
    return 0;
}

/* ---- FP8 matrices ----------------------------------------------------------------------- */

/* An FP8 matrix on the host: e4m3 bytes (q: the mapping's, or own when quantized here) and
 * its f32 scales (always own), one per bn x bk block. */
typedef struct w_fp8 {
    const uint8_t *q;
    uint8_t *q_own;
    float *s;
    int bn, bk;
} w_fp8;

static void w_fp8_free(w_fp8 *f) {
    free(f->q_own);
    free(f->s);
    memset(f, 0, sizeof *f);
}

/* the decoder's linear layers: what --quantization fp8 quantizes (not embed, not lm_head) */
static int w_quantizable(const char *name) {
    return !strncmp(name, "model.layers.", 13);
}

/* whether matrix `name` is quantized here: --quantization fp8, or --load-format dummy on an
 * FP8 config (its random weights quantized in the config's layout, so the model runs the FP8
 * kernels the real checkpoint would) */
static int w_quantize_here(const model_weights *w, const char *name) {
    return w_quantizable(name) &&
           (w->quant.kind == QUANT_FP8_ONLINE ||
            (w->dummy_seed && (w->quant.kind == QUANT_FP8 || w->quant.kind == QUANT_FP8_CT)));
}

/* marks <prefix>suffix used and returns it, or NULL */
static const st_tensor *w_side(model_weights *w, const char *name, const char *suffix) {
    char sn[300];
    size_t len = strlen(name);
    if (len < 6 || strcmp(name + len - 6, "weight")) return NULL;
    snprintf(sn, sizeof sn, "%.*s%s", (int)(len - 6), name, suffix);
    const st_tensor *t = st_set_find(&w->st, sn);
    if (t && w->st_used) w->st_used[t - w->st.tensors] = 1;
    return t;
}

/* --quantization fp8: row blocks [b0, b1) of t quantized into f (one thread's share) */
typedef struct w_qjob {
    const w_src *t;
    w_fp8 *f;
    int rows, cols, nkb, b0, b1, rc;
} w_qjob;

static void *w_qrun(void *arg) {
    w_qjob *j = arg;
    w_fp8 *f = j->f;
    size_t es = backend_dtype_size(j->t->dt);
    float *row = malloc((size_t)f->bn * j->cols * sizeof *row);
    if (!row) {
        j->rc = -ENOMEM;
        return NULL;
    }
    for (int b = j->b0; b < j->b1; b++) {
        int r0 = b * f->bn, nr = j->rows - r0 < f->bn ? j->rows - r0 : f->bn;
        backend_row_to_f32(row, (const char *)j->t->data + (size_t)r0 * j->cols * es, j->t->dt,
                           nr * j->cols);
        quant_fp8_matrix(f->q_own + (size_t)r0 * j->cols, f->s + (size_t)b * j->nkb, row, nr,
                         j->cols, f->bn, f->bk);
    }
    free(row);
    return NULL;
}

/* The scale blocks (bn rows x bk columns) a matrix quantized at load gets: the config's
 * layout for dummy weights of an FP8 config (fp8: weight_block_size, else one scale a tensor;
 * compressed-tensors: its strategy), else --quantization fp8's -- per channel, or 128 x 128
 * blocks for dummy weights (the FP8 tensor cores' form). */
static void w_quant_layout(const model_weights *w, int rows, int cols, int *bn, int *bk) {
    const model_quant *q = &w->quant;
    if (q->kind == QUANT_FP8) {
        *bn = q->block_n > 0 ? q->block_n : rows;
        *bk = q->block_k > 0 ? q->block_k : cols;
    } else if (q->kind == QUANT_FP8_CT && q->ct_strategy == QUANT_CT_BLOCK) {
        *bn = q->block_n;
        *bk = q->block_k;
    } else if (q->kind == QUANT_FP8_CT) {
        *bn = q->ct_strategy == QUANT_CT_TENSOR ? rows : 1;
        *bk = cols;
    } else {
        *bn = w->dummy_seed ? 128 : 1;
        *bk = w->dummy_seed ? 128 : cols;
    }
}

/* The e4m3 matrix `name` (rows, cols) of the checkpoint, or (online) t quantized here. */
static int w_fp8_get(model_weights *w, w_fp8 *f, const char *name, const w_src *t, int rows,
                     int cols, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    int nkb, ngrid;
    if (t->dt != BACKEND_F8E4M3) { /* --quantization fp8, or dummy weights of an FP8 config */
        w_quant_layout(w, rows, cols, &f->bn, &f->bk);
        nkb = (cols + f->bk - 1) / f->bk;
        ngrid = (rows + f->bn - 1) / f->bn * nkb;
        f->q_own = malloc((size_t)rows * cols);
        f->s = malloc((size_t)ngrid * sizeof *f->s);
        if (!f->q_own || !f->s) {
            w_fp8_free(f);
            snprintf(err, errlen, "cannot allocate the FP8 quantization of '%s'", name);
            return -ENOMEM;
        }
        /* the row blocks are independent: split over the CPUs (the same bytes either way) */
        int nblk = (rows + f->bn - 1) / f->bn;
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        int nt = ncpu > 16 ? 16 : ncpu < 1 ? 1 : (int)ncpu, rc = 0;
        if (nt > nblk) nt = nblk;
        w_qjob jobs[16];
        pthread_t th[16];
        int started[16] = {0};
        for (int i = 0; i < nt; i++) {
            jobs[i] = (w_qjob){
                t, f, rows, cols, nkb, (int)((long)nblk * i / nt), (int)((long)nblk * (i + 1) / nt),
                0};
            if (i > 0) started[i] = !pthread_create(&th[i], NULL, w_qrun, &jobs[i]);
            if (i > 0 && !started[i]) w_qrun(&jobs[i]); /* no thread: here */
        }
        w_qrun(&jobs[0]);
        for (int i = 0; i < nt; i++) {
            if (started[i]) pthread_join(th[i], NULL);
            if (jobs[i].rc) rc = jobs[i].rc;
        }
        if (rc) {
            w_fp8_free(f);
            snprintf(err, errlen, "cannot allocate the FP8 quantization of '%s'", name);
            return rc;
        }
        f->q = f->q_own;
        return 0;
    }
    /* a checkpoint's e4m3 tensor: its scale tensor says the granularity by its shape */
    f->q = t->data;
    const st_tensor *sc =
        w_side(w, name, w->quant.scale_suffix ? w->quant.scale_suffix : "weight_scale");
    if (!sc) sc = w_side(w, name, "weight_scale_inv");
    if (!sc) sc = w_side(w, name, "weight_scale");
    w_side(w, name, "input_scale"); /* static activation scheme: accepted, not used */
    const char *where = w->st.n_files ? w->st.files[0].path : "?";
    if (!sc) {
        snprintf(err, errlen,
                 "%s: FP8 tensor '%s' has no scale tensor (.weight_scale_inv or .weight_scale)%s",
                 where, name,
                 w->quant.kind == QUANT_NONE ? "; config.json has no quantization_config" : "");
        return -EINVAL;
    }
    if (w->quant.kind == QUANT_NONE) {
        snprintf(err, errlen,
                 "%s: tensor '%s' is F8_E4M3 but config.json has no quantization_config "
                 "(accepted: %s)",
                 st_set_file_of(&w->st, sc), name, QUANT_ACCEPTED);
        return -EINVAL;
    }
    backend_dtype sdt;
    int64_t numel = 1;
    for (int i = 0; i < sc->n_dims; i++)
        numel *= sc->shape[i];
    int bn0 = w->quant.block_n, bk0 = w->quant.block_k;
    if (numel == 1)
        f->bn = rows, f->bk = cols;
    else if (numel == rows && (sc->n_dims == 1 || (sc->n_dims == 2 && sc->shape[1] == 1)))
        f->bn = 1, f->bk = cols;
    else if (sc->n_dims == 2 && bn0 > 0 && sc->shape[0] == (rows + bn0 - 1) / bn0 &&
             sc->shape[1] == (cols + bk0 - 1) / bk0)
        f->bn = bn0, f->bk = bk0;
    else {
        snprintf(err, errlen,
                 "%s: scale tensor of '%s' has %lld elements in %d dims; accepted for a (%d, %d) "
                 "matrix: 1 (per tensor), %d (per channel) or the %s block grid",
                 st_set_file_of(&w->st, sc), name, (long long)numel, sc->n_dims, rows, cols, rows,
                 bn0 > 0 ? "weight_block_size / block_structure" : "128 x 128");
        return -EINVAL;
    }
    if (w_dtype(sc->dtype, &sdt)) {
        snprintf(err, errlen, "%s: scale tensor of '%s' has dtype %s (accepted: F32, BF16, F16)",
                 st_set_file_of(&w->st, sc), name, sc->dtype);
        return -EINVAL;
    }
    if (!(f->s = malloc((size_t)numel * sizeof *f->s))) return -ENOMEM;
    backend_row_to_f32(f->s, sc->data, sdt, (int)numel);
    for (int64_t i = 0; i < numel; i++)
        if (!(f->s[i] > 0.0f) || isinf(f->s[i])) {
            snprintf(err, errlen, "%s: scale %lld of '%s' is %g (accepted: finite and positive)",
                     st_set_file_of(&w->st, sc), (long long)i, name, (double)f->s[i]);
            w_fp8_free(f);
            return -EINVAL;
        }
    return 0;
}

static int w_fp8_place(model_weights *w, weight_mat *m, const char *name, const w_fp8 *f, int rows,
                       int cols, char *err, size_t errlen) {
    backend_buffer *b =
        backend_weights_load_fp8(w->be, f->q, rows, cols, f->s, f->bn, f->bk, &m->dtype, &m->scale);
    if (!b || w_keep(w, b)) {
        backend_buffer_free(b);
        snprintf(err, errlen, "cannot place FP8 tensor '%s' (%d x %d) on %s", name, rows, cols,
                 backend_name(w->be));
        return -ENOMEM;
    }
    m->data = backend_buffer_ptr(b);
    m->rows = rows;
    m->cols = cols;
    w->matrix_bytes += (size_t)rows * cols;
    return 0;
}

static int w_mat(model_weights *w, weight_mat *m, const char *name, int rows, int cols, char *err,
                 size_t errlen) {
    w_src t;
    int rc = w_get(w, &t, name, 2, rows, cols, 0, err, errlen);
    if (rc) return rc;
    if (t.dt == BACKEND_F8E4M3 && !w_quantizable(name) && strcmp(name, "lm_head.weight")) {
        snprintf(err, errlen,
                 "tensor '%s' is F8_E4M3: an FP8 embedding is not supported "
                 "(accepted: BF16, F16, F32 embeddings)",
                 name);
        return -EINVAL;
    }
    if (t.dt == BACKEND_F8E4M3 || w_quantize_here(w, name)) {
        w_fp8 f;
        rc = w_fp8_get(w, &f, name, &t, rows, cols, err, errlen);
        if (!rc) rc = w_fp8_place(w, m, name, &f, rows, cols, err, errlen);
        w_fp8_free(&f);
        w_release(w);
        return rc;
    }
    backend_buffer *b =
        backend_weights_load(w->be, t.data, t.dt, (size_t)t.rows * (size_t)t.cols, &m->dtype);
    w_release(w);
    if (!b || w_keep(w, b)) {
        backend_buffer_free(b);
        snprintf(err, errlen, "cannot place tensor '%s' (%zu bytes) on %s", name, t.nbytes,
                 backend_name(w->be));
        return -ENOMEM;
    }
    m->data = backend_buffer_ptr(b);
    m->rows = t.rows;
    m->cols = t.cols;
    w->matrix_bytes += t.nbytes;
    return 0;
}

/* Matrices of the same width as one buffer (rows of names[0] first); parts[i] become views
 * into it, *cat the whole. */
/* FP8 parts as one matrix: the e4m3 rows one after the other; the scale grids concatenated
 * when every part has the same blocks and whole blocks of rows, else every part's scales
 * expanded to one per row (the same column blocks; exact) */
static int w_mat_cat_fp8(model_weights *w, weight_mat *cat, weight_mat **parts, const char **names,
                         const int *rows, int n, int cols, const w_src *ts, char *err,
                         size_t errlen) {
    w_fp8 f[4];
    int rc = 0, total = 0, same = 1;
    memset(f, 0, sizeof f);
    for (int i = 0; i < n && !rc; i++) {
        rc = w_fp8_get(w, &f[i], names[i], &ts[i], rows[i], cols, err, errlen);
        total += rows[i];
    }
    for (int i = 0; i < n && !rc; i++) {
        if (f[i].bk != f[0].bk) {
            snprintf(err, errlen,
                     "FP8 tensors '%s' and '%s' have scales over %d and %d columns: "
                     "cannot concatenate them (accepted: the same column blocks)",
                     names[0], names[i], f[0].bk, f[i].bk);
            rc = -EINVAL;
        }
        if (f[i].bn != f[0].bn || (i < n - 1 && rows[i] % f[i].bn)) same = 0;
    }
    int bn = same ? f[0].bn : 1, bk = f[0].bk, nkb = (cols + bk - 1) / bk;
    uint8_t *q = rc ? NULL : malloc((size_t)total * cols);
    float *s = rc ? NULL : malloc((size_t)((total + bn - 1) / bn + n) * nkb * sizeof *s);
    if (!rc && (!q || !s)) rc = -ENOMEM;
    int off = 0;
    size_t soff = 0;
    for (int i = 0; i < n && !rc; i++) {
        memcpy(q + (size_t)off * cols, f[i].q, (size_t)rows[i] * cols);
        int g = same ? (rows[i] + bn - 1) / bn : rows[i];
        for (int r = 0; r < g; r++)
            memcpy(s + soff + (size_t)r * nkb, f[i].s + (size_t)(same ? r : r / f[i].bn) * nkb,
                   (size_t)nkb * sizeof *s);
        soff += (size_t)g * nkb;
        off += rows[i];
    }
    w_fp8 all = {q, NULL, s, bn, bk};
    if (!rc) rc = w_fp8_place(w, cat, names[0], &all, total, cols, err, errlen);
    off = 0;
    for (int i = 0; i < n && !rc; i++) {
        weight_mat *p = parts[i];
        size_t es = backend_dtype_size(cat->dtype);
        p->data = (const char *)cat->data + (size_t)off * cols * es;
        p->dtype = cat->dtype;
        p->rows = rows[i];
        p->cols = cols;
        p->scale = cat->scale;
        if (cat->scale.s) p->scale.s += (size_t)(off / bn) * nkb;
        if (cat->scale.twin)
            p->scale.twin = (const char *)cat->scale.twin + (size_t)off * cols * 2; /* bf16 */
        off += rows[i];
    }
    free(q);
    free(s);
    for (int i = 0; i < n; i++)
        w_fp8_free(&f[i]);
    w_release(w);
    return rc;
}

static int w_mat_cat(model_weights *w, weight_mat *cat, weight_mat **parts, const char **names,
                     const int *rows, int n, int cols, char *err, size_t errlen) {
    w_src fts[4];
    int any8 = 0;
    for (int i = 0; i < n; i++) {
        int rc = w_get(w, &fts[i], names[i], 2, rows[i], cols, 0, err, errlen);
        if (rc) return rc;
        any8 |= fts[i].dt == BACKEND_F8E4M3 || w_quantize_here(w, names[i]);
    }
    if (any8) return w_mat_cat_fp8(w, cat, parts, names, rows, n, cols, fts, err, errlen);
    const void *srcs[4];
    backend_dtype dts[4];
    size_t ns[4], bytes = 0;
    int total = 0, got_rows[4], got_cols = cols;
    for (int i = 0; i < n; i++) {
        w_src t = fts[i];
        srcs[i] = t.data;
        dts[i] = t.dt;
        ns[i] = (size_t)t.rows * (size_t)t.cols;
        bytes += t.nbytes;
        total += got_rows[i] = t.rows;
        got_cols = t.cols;
    }
    backend_buffer *b = backend_weights_load_cat(w->be, srcs, dts, ns, n, &cat->dtype);
    w_release(w);
    if (!b || w_keep(w, b)) {
        backend_buffer_free(b);
        snprintf(err, errlen, "cannot place tensors '%s'.. (%zu bytes) on %s", names[0], bytes,
                 backend_name(w->be));
        return -ENOMEM;
    }
    cat->data = backend_buffer_ptr(b);
    cat->rows = total;
    cat->cols = got_cols;
    size_t off = 0, es = backend_dtype_size(cat->dtype);
    for (int i = 0; i < n; i++) {
        parts[i]->data = (const char *)cat->data + off * es;
        parts[i]->dtype = cat->dtype;
        parts[i]->rows = got_rows[i];
        parts[i]->cols = got_cols;
        off += ns[i];
    }
    w->matrix_bytes += bytes;
    return 0;
}

/* an f32 vector on the device from a tensor of any supported dtype */
static int w_vec(model_weights *w, backend_stream *st, float **v, const char *name, int n,
                 float fill, char *err, size_t errlen) {
    w_src t;
    int rc = w_get(w, &t, name, 1, n, 0, fill, err, errlen);
    if (rc) return rc;
    n = t.rows;
    backend_dtype dt = t.dt;
    float *host = malloc((size_t)n * sizeof *host);
    backend_buffer *b = host ? backend_buffer_alloc(w->be, (size_t)n * sizeof *host, 0) : NULL;
    rc = -ENOMEM;
    if (b && !w_keep(w, b)) {
        backend_row_to_f32(host, t.data, dt, n);
        rc = backend_upload(st, backend_buffer_ptr(b), host, (size_t)n * sizeof *host);
        *v = backend_buffer_ptr(b);
        b = NULL; /* kept */
    }
    backend_buffer_free(b);
    free(host);
    w_release(w);
    if (rc) snprintf(err, errlen, "cannot place tensor '%s' on %s", name, backend_name(w->be));
    return rc;
}

/* f32 vectors as one buffer: *cat the whole, parts[i] views into it */
static int w_vec_cat(model_weights *w, backend_stream *st, float **cat, float **parts,
                     const char **names, const int *lens, int n, char *err, size_t errlen) {
    int total = 0, rc;
    w_src ts[4];
    for (int i = 0; i < n; i++) {
        if ((rc = w_get(w, &ts[i], names[i], 1, lens[i], 0, 0.0f, err, errlen))) return rc;
        total += ts[i].rows;
    }
    float *host = malloc((size_t)total * sizeof *host);
    backend_buffer *b = host ? backend_buffer_alloc(w->be, (size_t)total * sizeof *host, 0) : NULL;
    rc = -ENOMEM;
    if (b && !w_keep(w, b)) {
        int off = 0;
        for (int i = 0; i < n; i++) {
            backend_row_to_f32(host + off, ts[i].data, ts[i].dt, ts[i].rows);
            parts[i] = (float *)backend_buffer_ptr(b) + off;
            off += ts[i].rows;
        }
        rc = backend_upload(st, backend_buffer_ptr(b), host, (size_t)total * sizeof *host);
        *cat = backend_buffer_ptr(b);
        b = NULL; /* kept */
    }
    backend_buffer_free(b);
    free(host);
    w_release(w);
    if (rc)
        snprintf(err, errlen, "cannot place tensor '%s'.. on %s", names[0], backend_name(w->be));
    return rc;
}

/* A sparse MLP's experts (model/weights.h): per expert where the backend keeps matrices
 * apart (the CPU: zero-copy views), else stacked -- gate_0, up_0, gate_1, up_1, .. as one
 * buffer, down_0 .. down_{E-1} as another -- with the per-expert addresses pointing into them. */
static int w_experts(model_weights *w, layer_weights *L, const model_config *c, int l, int cat,
                     char *err, size_t errlen) {
    int E = c->n_experts, I = c->moe_intermediate_size, h = c->hidden_size, rc = 0;
    int mixtral = !strcmp(arch_family(c), "mixtral");
    /* Mixtral: w1 = gate, w3 = up, w2 = down */
    const char *pre = mixtral ? "block_sparse_moe" : "mlp";
    const char *kind[3] = {mixtral ? "w1" : "gate_proj", mixtral ? "w3" : "up_proj",
                           mixtral ? "w2" : "down_proj"};
    char n[256];
    snprintf(n, sizeof n, "model.layers.%d.%s.gate.weight", l, pre);
    if ((rc = w_mat(w, &L->router, n, E, h, err, errlen))) return rc;
    L->ex_gate = calloc((size_t)3 * E, sizeof *L->ex_gate);
    if (!L->ex_gate) return -ENOMEM;
    L->ex_up = L->ex_gate + E;
    L->ex_down = L->ex_gate + 2 * E;
    const void **dst[3] = {L->ex_gate, L->ex_up, L->ex_down};
    if (!cat) {
        for (int e = 0; e < E && !rc; e++)
            for (int k = 0; k < 3 && !rc; k++) {
                weight_mat m;
                snprintf(n, sizeof n, "model.layers.%d.%s.experts.%d.%s.weight", l, pre, e,
                         kind[k]);
                rc = w_mat(w, &m, n, k == 2 ? h : I, k == 2 ? I : h, err, errlen);
                if (rc) break;
                if (e == 0 && k == 0) L->expert_dt = m.dtype;
                if (m.dtype != L->expert_dt) {
                    snprintf(err, errlen,
                             "tensor '%s' is %s but expert 0's gate is %s: a layer's experts "
                             "must share one dtype",
                             n, backend_dtype_name(m.dtype), backend_dtype_name(L->expert_dt));
                    rc = -EINVAL;
                }
                dst[k][e] = m.data;
            }
        return rc;
    }
    /* stacked: 2 E parts (gate and up interleaved), then E parts (down) */
    const void **srcs = calloc((size_t)2 * E, sizeof *srcs);
    backend_dtype *dts = calloc((size_t)2 * E, sizeof *dts);
    size_t *ns = calloc((size_t)2 * E, sizeof *ns), bytes = 0;
    if (!srcs || !dts || !ns) rc = -ENOMEM;
    for (int pass = 0; pass < 2 && !rc; pass++) {
        int parts = pass ? E : 2 * E;
        for (int i = 0; i < parts && !rc; i++) {
            int e = pass ? i : i / 2, k = pass ? 2 : i % 2;
            w_src t;
            snprintf(n, sizeof n, "model.layers.%d.%s.experts.%d.%s.weight", l, pre, e, kind[k]);
            rc = w_get(w, &t, n, 2, k == 2 ? h : I, k == 2 ? I : h, 0, err, errlen);
            srcs[i] = t.data, dts[i] = t.dt, ns[i] = rc ? 0 : (size_t)t.rows * (size_t)t.cols;
            bytes += rc ? 0 : t.nbytes;
        }
        backend_dtype stored = BACKEND_BF16;
        backend_buffer *b =
            rc ? NULL : backend_weights_load_cat(w->be, srcs, dts, ns, parts, &stored);
        w_release(w);
        if (!rc && (!b || w_keep(w, b))) {
            backend_buffer_free(b);
            snprintf(err, errlen, "cannot place layer %d's experts (%zu bytes) on %s", l, bytes,
                     backend_name(w->be));
            rc = -ENOMEM;
        }
        if (rc) break;
        size_t m = ns[0] * backend_dtype_size(stored);
        const char *base = backend_buffer_ptr(b);
        L->expert_dt = stored;
        for (int e = 0; e < E; e++) {
            if (pass) {
                L->ex_down[e] = base + m * e;
            } else {
                L->ex_gate[e] = base + 2 * m * e;
                L->ex_up[e] = base + 2 * m * e + m;
            }
        }
        if (pass)
            L->ex_down_all = base;
        else
            L->ex_gate_up_all = base;
    }
    w->matrix_bytes += bytes;
    free(srcs);
    free(dts);
    free(ns);
    return rc;
}

/* One scalar scale tensor (shape [] or [1], F32/BF16/F16) as a positive finite f32.  1: found,
 * 0: absent, < 0: malformed (err says why). */
static int w_scalar(model_weights *w, const char *name, float *out, char *err, size_t errlen) {
    const st_tensor *t = st_set_find(&w->st, name);
    if (!t) return 0;
    backend_dtype dt;
    if (w_dtype(t->dtype, &dt) || t->n_dims > 1 || (t->n_dims == 1 && t->shape[0] != 1) ||
        t->nbytes != backend_dtype_size(dt)) {
        snprintf(err, errlen,
                 "%s: tensor '%s' (dtype %s, %d dimensions) is not one F32/BF16/F16 scale",
                 st_set_file_of(&w->st, t), name, t->dtype, t->n_dims);
        return -EINVAL;
    }
    backend_row_to_f32(out, t->data, dt, 1);
    if (!(*out > 0.0f) || !isfinite(*out)) {
        snprintf(err, errlen, "%s: tensor '%s' is %g: a KV cache scale must be positive and finite",
                 st_set_file_of(&w->st, t), name, (double)*out);
        return -EINVAL;
    }
    if (w->st_used) w->st_used[t - w->st.tensors] = 1;
    return 1;
}

/* The FP8 KV cache's k_scale / v_scale per layer (vLLM's checkpoint names; the older kv_scale
 * is both).  Absent in every layer: w->k_scale stays NULL (1.0).  Present in some layers
 * only: the others get 1.0, as vLLM's default. */
static int w_kv_scales(model_weights *w, const model_config *c, char *err, size_t errlen) {
    if (w->dummy_seed) return 0;
    int L = c->n_layers, any = 0;
    float *ks = malloc((size_t)L * sizeof *ks), *vs = malloc((size_t)L * sizeof *vs);
    if (!ks || !vs) {
        free(ks);
        free(vs);
        return -ENOMEM;
    }
    char n[256];
    for (int l = 0; l < L; l++) {
        ks[l] = vs[l] = 1.0f;
        float kv = 1.0f;
        int rc;
        snprintf(n, sizeof n, "model.layers.%d.self_attn.kv_scale", l);
        if ((rc = w_scalar(w, n, &kv, err, errlen)) < 0) goto bad;
        if (rc) ks[l] = vs[l] = kv, any = 1;
        /* older llm-compressor checkpoints name them k_proj.output_scale / v_proj.output_scale
         * (vLLM remaps those names to the same scales) */
        for (int which = 0; which < 2; which++) {
            const char *kv = which ? "v" : "k";
            float *dst = which ? &vs[l] : &ks[l];
            snprintf(n, sizeof n, "model.layers.%d.self_attn.%s_scale", l, kv);
            if ((rc = w_scalar(w, n, dst, err, errlen)) < 0) goto bad;
            any |= rc;
            if (rc) continue;
            snprintf(n, sizeof n, "model.layers.%d.self_attn.%s_proj.output_scale", l, kv);
            if ((rc = w_scalar(w, n, dst, err, errlen)) < 0) goto bad;
            any |= rc;
        }
        continue;
    bad:
        free(ks);
        free(vs);
        return rc;
    }
    if (!any) {
        free(ks);
        free(vs);
        return 0;
    }
    w->k_scale = ks;
    w->v_scale = vs;
    return 0;
}

int weights_load(model_weights *w, const model_config *c, const char *dir, char *err,
                 size_t errlen) {
    return weights_load_on(w, backend_cpu_default(), c, dir, err, errlen);
}

int weights_load_on(model_weights *w, backend *be, const model_config *c, const char *dir,
                    char *err, size_t errlen) {
    return weights_load_ex(w, be, c, dir, 0, err, errlen);
}

int weights_load_ex(model_weights *w, backend *be, const model_config *c, const char *dir,
                    uint64_t dummy_seed, char *err, size_t errlen) {
    return weights_load_tp(w, be, c, dir, dummy_seed, NULL, err, errlen);
}

int weights_load_tp(model_weights *w, backend *be, const model_config *c, const char *dir,
                    uint64_t dummy_seed, const tp_shard *tp, char *err, size_t errlen) {
    memset(w, 0, sizeof *w);
    w->be = be;
    w->tp = tp;
    w->dummy_seed = dummy_seed;
    w->quant = c->quant;
    int rc = dummy_seed ? 0 : st_set_open(&w->st, dir, err, errlen);
    if (rc) return rc;
    if (!dummy_seed && !(w->st_used = calloc((size_t)w->st.n_tensors + 1, 1))) {
        weights_free(w);
        return -ENOMEM;
    }
    backend_stream *st = backend_stream_create(be);
    if (!st) {
        snprintf(err, errlen, "cannot create a stream on %s", backend_name(be));
        weights_free(w);
        return -ENOMEM;
    }
    int h = c->hidden_size, kvd = c->n_kv_heads * c->head_dim, I = c->intermediate_size,
        qd = c->q_dim, hd = c->head_dim;
    int cat = backend_wants_cat(be);
    w->layers = calloc((size_t)c->n_layers, sizeof *w->layers);
    if (!w->layers) {
        backend_stream_free(st);
        weights_free(w);
        return -ENOMEM;
    }
    w->n_layers = c->n_layers;
    char n[256];
    rc = w_mat(w, &w->embed, "model.embed_tokens.weight", c->vocab_size, h, err, errlen);
    for (int l = 0; l < c->n_layers && !rc; l++) {
        layer_weights *L = &w->layers[l];
#define MAT(field, suffix, r, cc)                                                                  \
    if (!rc) {                                                                                     \
        snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);                                    \
        rc = w_mat(w, &L->field, n, r, cc, err, errlen);                                           \
    }
#define VEC(field, suffix, len, fill)                                                              \
    if (!rc) {                                                                                     \
        snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);                                    \
        rc = w_vec(w, st, &L->field, n, len, fill, err, errlen);                                   \
    }
        VEC(attn_norm, "input_layernorm.weight", h, 1.0f);
        if (cat) {
            char nq[256], nk[256], nv[256];
            snprintf(nq, sizeof nq, "model.layers.%d.self_attn.q_proj.weight", l);
            snprintf(nk, sizeof nk, "model.layers.%d.self_attn.k_proj.weight", l);
            snprintf(nv, sizeof nv, "model.layers.%d.self_attn.v_proj.weight", l);
            const char *names[3] = {nq, nk, nv};
            weight_mat *parts[3] = {&L->wq, &L->wk, &L->wv};
            int rows[3] = {qd, kvd, kvd};
            if (!rc) rc = w_mat_cat(w, &L->wqkv, parts, names, rows, 3, h, err, errlen);
            snprintf(nq, sizeof nq, "model.layers.%d.self_attn.q_proj.bias", l);
            snprintf(nk, sizeof nk, "model.layers.%d.self_attn.k_proj.bias", l);
            snprintf(nv, sizeof nv, "model.layers.%d.self_attn.v_proj.bias", l);
            float *bparts[3];
            if (!rc && c->qkv_bias)
                rc = w_vec_cat(w, st, &L->bqkv, bparts, names, rows, 3, err, errlen);
            if (!rc && c->qkv_bias) L->bq = bparts[0], L->bk = bparts[1], L->bv = bparts[2];
        } else {
            MAT(wq, "self_attn.q_proj.weight", qd, h);
            MAT(wk, "self_attn.k_proj.weight", kvd, h);
            MAT(wv, "self_attn.v_proj.weight", kvd, h);
            if (c->qkv_bias) {
                VEC(bq, "self_attn.q_proj.bias", qd, 0.0f);
                VEC(bk, "self_attn.k_proj.bias", kvd, 0.0f);
                VEC(bv, "self_attn.v_proj.bias", kvd, 0.0f);
            }
        }
        if (c->qk_norm) {
            VEC(q_norm, "self_attn.q_norm.weight", hd, 1.0f);
            VEC(k_norm, "self_attn.k_norm.weight", hd, 1.0f);
        }
        MAT(wo, "self_attn.o_proj.weight", h, qd);
        VEC(mlp_norm, "post_attention_layernorm.weight", h, 1.0f);
        if (model_layer_is_moe(c, l)) {
            if (!rc) rc = w_experts(w, L, c, l, cat, err, errlen);
            continue;
        }
        if (cat) {
            char ng[256], nu[256];
            snprintf(ng, sizeof ng, "model.layers.%d.mlp.gate_proj.weight", l);
            snprintf(nu, sizeof nu, "model.layers.%d.mlp.up_proj.weight", l);
            const char *names[2] = {ng, nu};
            weight_mat *parts[2] = {&L->w_gate, &L->w_up};
            int rows[2] = {I, I};
            if (!rc) rc = w_mat_cat(w, &L->w_gate_up, parts, names, rows, 2, h, err, errlen);
        } else {
            MAT(w_gate, "mlp.gate_proj.weight", I, h);
            MAT(w_up, "mlp.up_proj.weight", I, h);
        }
        MAT(w_down, "mlp.down_proj.weight", h, I);
#undef MAT
#undef VEC
    }
    if (!rc) rc = w_vec(w, st, &w->final_norm, "model.norm.weight", h, 1.0f, err, errlen);
    if (!rc) {
        if (c->tie_embeddings)
            w->lm_head = w->embed;
        else
            rc = w_mat(w, &w->lm_head, "lm_head.weight", c->vocab_size, h, err, errlen);
    }
    if (!rc) rc = w_kv_scales(w, c, err, errlen);
    if (!rc) rc = backend_stream_sync(st);
    backend_stream_free(st);
    /* a tensor the description has no place for means the description is wrong (a bias the
     * family has not, q_norm in a Llama): refused, never silently left out */
    for (int i = 0; !rc && w->st_used && i < w->st.n_tensors; i++) {
        const char *tn = w->st.tensors[i].name;
        size_t len = strlen(tn);
        if (w->st_used[i] || (c->tie_embeddings && !strcmp(tn, "lm_head.weight")) ||
            (len >= 19 && !strcmp(tn + len - 19, "rotary_emb.inv_freq")))
            continue;
        snprintf(err, errlen,
                 "%s: tensor '%s' has no place in %s as config.json describes it (%s, "
                 "attention_bias, qk norms, tying): refusing rather than ignoring it",
                 st_set_file_of(&w->st, &w->st.tensors[i]), tn, c->arch[0] ? c->arch : "the model",
                 c->qkv_bias ? "q/k/v biases" : "no q/k/v biases");
        rc = -EINVAL;
    }
    if (!rc && dummy_seed) w->dtype = BACKEND_BF16;
    if (!rc && !dummy_seed) { /* mixed dtypes work: each matrix carries its own */
        const st_tensor *e = st_set_find(&w->st, "model.embed_tokens.weight");
        w_dtype(e->dtype, &w->dtype);
    }
    if (rc) weights_free(w);
    return rc;
}

void weights_free(model_weights *w) {
    for (int i = 0; i < w->n_bufs; i++)
        backend_buffer_free(w->bufs[i]);
    free(w->bufs);
    free(w->st_used);
    for (int i = 0; i < w->n_dummy; i++)
        free(w->dummy[i]);
    free(w->dummy);
    free(w->k_scale);
    free(w->v_scale);
    st_set_free(&w->st);
    for (int l = 0; w->layers && l < w->n_layers; l++)
        free(w->layers[l].ex_gate);
    free(w->layers);
    memset(w, 0, sizeof *w);
}
