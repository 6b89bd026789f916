/*
 * weights — binds Hugging Face Qwen2 tensor names to the forward's weight structs, in
 * buffers of the model's backend.
 */
#include "model/weights.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    if (w_dtype(t->dtype, &dt) != 0) {
        snprintf(err, errlen, "%s: tensor '%s' has unsupported dtype %s (accepted: BF16, F16, F32)",
                 st_set_file_of(&w->st, t), name, t->dtype);
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

static int w_mat(model_weights *w, weight_mat *m, const char *name, int rows, int cols, char *err,
                 size_t errlen) {
    const st_tensor *t = w_find(w, name, 2, rows, cols, err, errlen);
    if (!t) return -EINVAL;
    backend_dtype src;
    if (w_dtype(t->dtype, &src)) return -EINVAL; /* w_find accepted it */
    backend_buffer *b =
        backend_weights_load(w->be, t->data, src, (size_t)rows * (size_t)cols, &m->dtype);
    if (!b || w_keep(w, b)) {
        backend_buffer_free(b);
        snprintf(err, errlen, "cannot place tensor '%s' (%zu bytes) on %s", name, t->nbytes,
                 backend_name(w->be));
        return -ENOMEM;
    }
    m->data = backend_buffer_ptr(b);
    m->rows = rows;
    m->cols = cols;
    w->matrix_bytes += t->nbytes;
    return 0;
}

/* Matrices of the same width as one buffer (rows of names[0] first); parts[i] become views
 * into it, *cat the whole. */
static int w_mat_cat(model_weights *w, weight_mat *cat, weight_mat **parts, const char **names,
                     const int *rows, int n, int cols, char *err, size_t errlen) {
    const void *srcs[4];
    backend_dtype dts[4];
    size_t ns[4], bytes = 0;
    int total = 0;
    for (int i = 0; i < n; i++) {
        const st_tensor *t = w_find(w, names[i], 2, rows[i], cols, err, errlen);
        if (!t || w_dtype(t->dtype, &dts[i])) return -EINVAL;
        srcs[i] = t->data;
        ns[i] = (size_t)rows[i] * (size_t)cols;
        bytes += t->nbytes;
        total += rows[i];
    }
    backend_buffer *b = backend_weights_load_cat(w->be, srcs, dts, ns, n, &cat->dtype);
    if (!b || w_keep(w, b)) {
        backend_buffer_free(b);
        snprintf(err, errlen, "cannot place tensors '%s'.. (%zu bytes) on %s", names[0], bytes,
                 backend_name(w->be));
        return -ENOMEM;
    }
    cat->data = backend_buffer_ptr(b);
    cat->rows = total;
    cat->cols = cols;
    size_t off = 0, es = backend_dtype_size(cat->dtype);
    for (int i = 0; i < n; i++) {
        parts[i]->data = (const char *)cat->data + off * es;
        parts[i]->dtype = cat->dtype;
        parts[i]->rows = rows[i];
        parts[i]->cols = cols;
        off += ns[i];
    }
    w->matrix_bytes += bytes;
    return 0;
}

/* an f32 vector on the device from a tensor of any supported dtype */
static int w_vec(model_weights *w, backend_stream *st, float **v, const char *name, int n,
                 char *err, size_t errlen) {
    const st_tensor *t = w_find(w, name, 1, n, 0, err, errlen);
    if (!t) return -EINVAL;
    backend_dtype dt;
    if (w_dtype(t->dtype, &dt)) return -EINVAL; /* w_find accepted it */
    float *host = malloc((size_t)n * sizeof *host);
    backend_buffer *b = host ? backend_buffer_alloc(w->be, (size_t)n * sizeof *host, 0) : NULL;
    int rc = -ENOMEM;
    if (b && !w_keep(w, b)) {
        backend_row_to_f32(host, t->data, dt, n);
        rc = backend_upload(st, backend_buffer_ptr(b), host, (size_t)n * sizeof *host);
        *v = backend_buffer_ptr(b);
        b = NULL; /* kept */
    }
    backend_buffer_free(b);
    free(host);
    if (rc) snprintf(err, errlen, "cannot place tensor '%s' on %s", name, backend_name(w->be));
    return rc;
}

/* f32 vectors as one buffer: *cat the whole, parts[i] views into it */
static int w_vec_cat(model_weights *w, backend_stream *st, float **cat, float **parts,
                     const char **names, const int *lens, int n, char *err, size_t errlen) {
    int total = 0;
    const st_tensor *ts[4];
    for (int i = 0; i < n; i++) {
        if (!(ts[i] = w_find(w, names[i], 1, lens[i], 0, err, errlen))) return -EINVAL;
        total += lens[i];
    }
    float *host = malloc((size_t)total * sizeof *host);
    backend_buffer *b = host ? backend_buffer_alloc(w->be, (size_t)total * sizeof *host, 0) : NULL;
    int rc = -ENOMEM;
    if (b && !w_keep(w, b)) {
        int off = 0;
        for (int i = 0; i < n; i++) {
            backend_dtype dt = BACKEND_F32;
            w_dtype(ts[i]->dtype, &dt); /* w_find accepted it */
            backend_row_to_f32(host + off, ts[i]->data, dt, lens[i]);
            parts[i] = (float *)backend_buffer_ptr(b) + off;
            off += lens[i];
        }
        rc = backend_upload(st, backend_buffer_ptr(b), host, (size_t)total * sizeof *host);
        *cat = backend_buffer_ptr(b);
        b = NULL; /* kept */
    }
    backend_buffer_free(b);
    free(host);
    if (rc)
        snprintf(err, errlen, "cannot place tensor '%s'.. on %s", names[0], backend_name(w->be));
    return rc;
}

int weights_load(model_weights *w, const model_config *c, const char *dir, char *err,
                 size_t errlen) {
    return weights_load_on(w, backend_cpu_default(), c, dir, err, errlen);
}

int weights_load_on(model_weights *w, backend *be, const model_config *c, const char *dir,
                    char *err, size_t errlen) {
    memset(w, 0, sizeof *w);
    w->be = be;
    int rc = st_set_open(&w->st, dir, err, errlen);
    if (rc) return rc;
    backend_stream *st = backend_stream_create(be);
    if (!st) {
        snprintf(err, errlen, "cannot create a stream on %s", backend_name(be));
        weights_free(w);
        return -ENOMEM;
    }
    int h = c->hidden_size, kvd = c->n_kv_heads * c->head_dim, I = c->intermediate_size;
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
#define VEC(field, suffix, len)                                                                    \
    if (!rc) {                                                                                     \
        snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);                                    \
        rc = w_vec(w, st, &L->field, n, len, err, errlen);                                         \
    }
        VEC(attn_norm, "input_layernorm.weight", h);
        if (cat) {
            char nq[256], nk[256], nv[256];
            snprintf(nq, sizeof nq, "model.layers.%d.self_attn.q_proj.weight", l);
            snprintf(nk, sizeof nk, "model.layers.%d.self_attn.k_proj.weight", l);
            snprintf(nv, sizeof nv, "model.layers.%d.self_attn.v_proj.weight", l);
            const char *names[3] = {nq, nk, nv};
            weight_mat *parts[3] = {&L->wq, &L->wk, &L->wv};
            int rows[3] = {h, kvd, kvd};
            if (!rc) rc = w_mat_cat(w, &L->wqkv, parts, names, rows, 3, h, err, errlen);
            snprintf(nq, sizeof nq, "model.layers.%d.self_attn.q_proj.bias", l);
            snprintf(nk, sizeof nk, "model.layers.%d.self_attn.k_proj.bias", l);
            snprintf(nv, sizeof nv, "model.layers.%d.self_attn.v_proj.bias", l);
            float *bparts[3];
            if (!rc) rc = w_vec_cat(w, st, &L->bqkv, bparts, names, rows, 3, err, errlen);
            if (!rc) L->bq = bparts[0], L->bk = bparts[1], L->bv = bparts[2];
        } else {
            MAT(wq, "self_attn.q_proj.weight", h, h);
            VEC(bq, "self_attn.q_proj.bias", h);
            MAT(wk, "self_attn.k_proj.weight", kvd, h);
            VEC(bk, "self_attn.k_proj.bias", kvd);
            MAT(wv, "self_attn.v_proj.weight", kvd, h);
            VEC(bv, "self_attn.v_proj.bias", kvd);
        }
        MAT(wo, "self_attn.o_proj.weight", h, h);
        VEC(mlp_norm, "post_attention_layernorm.weight", h);
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
    if (!rc) rc = w_vec(w, st, &w->final_norm, "model.norm.weight", h, err, errlen);
    if (!rc) {
        if (c->tie_embeddings)
            w->lm_head = w->embed;
        else
            rc = w_mat(w, &w->lm_head, "lm_head.weight", c->vocab_size, h, err, errlen);
    }
    if (!rc) rc = backend_stream_sync(st);
    backend_stream_free(st);
    if (!rc) { /* mixed dtypes work: each matrix carries its own */
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
    st_set_free(&w->st);
    free(w->layers);
    memset(w, 0, sizeof *w);
}
