/*
 * backend — the registry (backend_open: "cpu" here, "cuda" from the module
 * libdisagg_cuda.so through dlopen) and the public functions of kernels/backend.h, which
 * check their arguments once here and call the backend's table (backend_impl.h).
 */
#include "kernels/backend_impl.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_matmul.h"
#include "kernels/cuda/cuda_transfer.h"

#include "base/clock.h"
#include "base/log.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#define MOD "backend"

/* ---- dtypes ------------------------------------------------------------------------ */

size_t backend_dtype_size(backend_dtype dt) {
    switch (dt) {
    case BACKEND_F32:
        return 4;
    case BACKEND_F16:
    case BACKEND_BF16:
        return 2;
    case BACKEND_F8E4M3:
        return 1;
    }
    return 0;
}

const char *backend_dtype_name(backend_dtype dt) {
    switch (dt) {
    case BACKEND_F32:
        return "float32";
    case BACKEND_F16:
        return "float16";
    case BACKEND_BF16:
        return "bfloat16";
    case BACKEND_F8E4M3:
        return "float8_e4m3fn";
    }
    return "?";
}

int backend_dtype_parse(const char *s, int *out) {
    static const struct {
        const char *name;
        int dt;
    } names[] = {{"auto", -1},           {"float32", BACKEND_F32},   {"f32", BACKEND_F32},
                 {"float", BACKEND_F32}, {"float16", BACKEND_F16},   {"f16", BACKEND_F16},
                 {"half", BACKEND_F16},  {"bfloat16", BACKEND_BF16}, {"bf16", BACKEND_BF16}};
    for (size_t i = 0; s && i < sizeof names / sizeof names[0]; i++)
        if (!strcasecmp(s, names[i].name)) {
            *out = names[i].dt;
            return 0;
        }
    return -EINVAL;
}

int backend_kv_dtype_parse(const char *s, int *out) {
    if (s && (!strcasecmp(s, "fp8") || !strcasecmp(s, "fp8_e4m3") ||
              !strcasecmp(s, "float8_e4m3fn"))) {
        *out = BACKEND_F8E4M3;
        return 0;
    }
    return backend_dtype_parse(s, out);
}

static int dt_ok(backend_dtype dt) {
    return backend_dtype_size(dt) != 0;
}

/* ---- devices ---------------------------------------------------------------------- */

void backend_options_init(backend_options *o) {
    memset(o, 0, sizeof *o);
}

void *backend_module_dlopen(char *why, size_t cap) {
    char tried[2][PATH_MAX];
    int n_tried = 0;
    void *h = NULL;
    const char *env = getenv("DISAGG_CUDA_MODULE");
    char last_err[512] = "";
    if (env && *env) {
        snprintf(tried[n_tried++], PATH_MAX, "%s", env);
    } else {
        char exe[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n > 0) {
            exe[n] = 0;
            char *slash = strrchr(exe, '/');
            if (slash) {
                *slash = 0;
                snprintf(tried[n_tried++], PATH_MAX, "%s/%s", exe, BACKEND_MODULE_NAME);
            }
        }
        snprintf(tried[n_tried++], PATH_MAX, "%s", BACKEND_MODULE_NAME);
    }
    for (int i = 0; i < n_tried && !h; i++) {
        h = dlopen(tried[i], RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char *e = dlerror();
            snprintf(last_err, sizeof last_err, "%s", e ? e : "unknown dlopen error");
        }
    }
    if (!h) snprintf(why, cap, "%s not found: %s", BACKEND_MODULE_NAME, last_err);
    return h;
}

void *backend_module_entry(const char *symbol, const char *what, char *err, size_t errlen) {
    char why[PATH_MAX + 600];
    void *h = backend_module_dlopen(why, sizeof why); /* never closed: see the header */
    if (!h) {
        snprintf(err, errlen, "the CUDA module: %s (set DISAGG_CUDA_MODULE to its path)", why);
        return NULL;
    }
    void *fn = dlsym(h, symbol);
    if (!fn)
        snprintf(err, errlen,
                 "the CUDA module %s has no %s (%s): a module of another build? (rebuild both "
                 "together)",
                 BACKEND_MODULE_NAME, what, symbol);
    return fn;
}

/* Opens the CUDA module (backend_module_dlopen) and its backend.  -ENOENT with err naming
 * what is missing. */
static int open_module(const backend_options *opts, backend **out, char *err, size_t errlen) {
    char why[PATH_MAX + 600];
    void *h = backend_module_dlopen(why, sizeof why);
    if (!h) {
        snprintf(err, errlen,
                 "--device cuda: this disagg was built without CUDA or its CUDA module is "
                 "missing (%s; set DISAGG_CUDA_MODULE to its path, or use --device cpu)",
                 why);
        return -ENOENT;
    }
    backend_module_open_fn fn =
        (backend_module_open_fn)(uintptr_t)dlsym(h, BACKEND_MODULE_OPEN_SYMBOL);
    if (!fn) {
        snprintf(err, errlen,
                 "--device cuda: %s has no entry point %s (a module of another build?)",
                 BACKEND_MODULE_NAME, BACKEND_MODULE_OPEN_SYMBOL);
        dlclose(h);
        return -ENOENT;
    }
    int rc = fn(BACKEND_ABI_VERSION, opts, out, err, errlen);
    if (rc) {
        dlclose(h);
        *out = NULL;
        return rc;
    }
    (*out)->module = h;
    return 0;
}

/* "cuda" -> 0, "cuda:N" -> N; -1 when s is not a CUDA device name */
static int cuda_ordinal(const char *s) {
    if (!strcmp(s, "cuda")) return 0;
    if (strncmp(s, "cuda:", 5) != 0 || !s[5]) return -1;
    char *end;
    long n = strtol(s + 5, &end, 10);
    if (*end || n < 0 || n > 1023) return -1;
    return (int)n;
}

int backend_open(const char *device, const backend_options *opts, backend **out, char *err,
                 size_t errlen) {
    backend_options o;
    if (opts)
        o = *opts;
    else
        backend_options_init(&o);
    *out = NULL;
    if (!device || !*device) device = "cpu";
    if (!strcmp(device, "cpu") || !strcmp(device, "cpu:0"))
        return cpu_backend_open(&o, out, err, errlen);
    if (!strcmp(device, "auto")) {
        o.device_ord = 0;
        char why[512];
        if (open_module(&o, out, why, sizeof why) == 0) return 0;
        LOG_I(MOD, "--device auto: using the CPU (%s)", why);
        return cpu_backend_open(&o, out, err, errlen);
    }
    int ord = cuda_ordinal(device);
    if (ord < 0) {
        snprintf(err, errlen, "unknown device '%s' (accepted: %s)", device, BACKEND_DEVICE_NAMES);
        return -EINVAL;
    }
    o.device_ord = ord;
    return open_module(&o, out, err, errlen);
}

void backend_close(backend *be) {
    if (!be || be->is_static) return;
    void *module = be->module;
    be->iface->free(be);
    if (module) dlclose(module);
}

const char *backend_name(const backend *be) {
    return be->name;
}
void *backend_module_symbol(const backend *be, const char *name) {
    if (!be || !be->module || !name) return NULL;
    return dlsym(be->module, name);
}

int backend_transfer_device_ops(const backend *be, int device, struct transfer_device_ops *out,
                                char *err, size_t errlen) {
    dcu_transfer_api_fn fn =
        (dcu_transfer_api_fn)(uintptr_t)backend_module_symbol(be, DCU_TRANSFER_SYMBOL);
    const dcu_transfer_api *api = fn ? fn() : NULL;
    if (!api || api->abi != DCU_TRANSFER_ABI) {
        snprintf(err, errlen,
                 "the KV cache is in %s memory but %s has no transfer ops (%s%s): "
                 "rebuild disagg and libdisagg_cuda.so together",
                 be->location, be->module ? "the CUDA module" : "its backend", DCU_TRANSFER_SYMBOL,
                 api ? " of another ABI" : " missing");
        return -EINVAL;
    }
    char why[256] = "";
    if (api->device_ops(device, out, why, sizeof why)) {
        snprintf(err, errlen, "cannot get the %s memory ops: %s", be->location,
                 why[0] ? why : "unknown error");
        return -EINVAL;
    }
    return 0;
}

const char *backend_location(const backend *be) {
    return be->location;
}
int backend_is_cpu(const backend *be) {
    return be->is_cpu;
}
const char *backend_kernels_name(const backend *be) {
    return backend_is_cpu(be) ? cpu_isa_name(cpu_isa_get()) : "cuda";
}
const char *backend_kernels_describe(const backend *be) {
    return backend_is_cpu(be) ? cpu_isa_describe() : be->name;
}
void backend_row_to_f32(float *out, const void *row, backend_dtype dt, int n) {
    cpu_ref_row_to_f32(out, row, (cpu_dtype)dt, n); /* backend_dtype and cpu_dtype agree */
}
backend_dtype backend_act_dtype(const backend *be) {
    return be->act_dtype;
}
backend_dtype backend_mm_dtype(const backend *be) {
    return be->mm_dtype;
}
int backend_wants_cat(const backend *be) {
    return be && be->iface->weights_load_cat != NULL;
}
backend_dtype backend_kv_dtype_default(const backend *be) {
    return be->kv_dtype;
}
int backend_block_size_default(const backend *be) {
    /* the CPU attention reads each block's K (and V) rows of a layer as one run: 8 KiB at 16
     * tokens (0.5B shape, f32), 64 KiB at 128, which the hardware prefetchers stream ~1.7x
     * faster (docs/benchmarks.md); vLLM's CPU platform picks 128 as well for its
     * optimised (IPEX) attention.  The GPU kernels are tuned for 16, vLLM's CUDA default. */
    return backend_is_cpu(be) ? 128 : 16;
}
int backend_kv_dtype_ok(const backend *be, backend_dtype dt) {
    return dt_ok(dt) && (be->kv_dtypes & (1u << dt)) != 0;
}
int backend_memory(const backend *be, size_t *free_b, size_t *total_b) {
    return be->iface->memory(be, free_b, total_b);
}

/* ---- buffers ---------------------------------------------------------------------- */

backend_buffer *backend_buffer_alloc(backend *be, size_t bytes, int flags) {
    if (!be || bytes == 0) {
        LOG_E(MOD, "buffer_alloc: %s", !be ? "no backend" : "zero bytes");
        return NULL;
    }
    backend_buffer *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->be = be;
    b->flags = flags;
    if (flags & BACKEND_BUF_KV) b->flags |= BACKEND_BUF_ZERO;
    if (be->iface->buffer_alloc(be, b, bytes, b->flags)) {
        free(b);
        return NULL;
    }
    return b;
}

backend_buffer *backend_weights_load(backend *be, const void *src, backend_dtype src_dtype,
                                     size_t n, backend_dtype *stored) {
    if (!be || !src || n == 0 || !dt_ok(src_dtype) || !stored) {
        LOG_E(MOD, "weights_load: bad arguments (src %p, dtype %d, %zu elements)", src,
              (int)src_dtype, n);
        return NULL;
    }
    backend_buffer *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->be = be;
    if (be->iface->weights_load(be, b, src, src_dtype, n, stored)) {
        free(b);
        return NULL;
    }
    return b;
}

/* ---- FP8 weights ---------------------------------------------------------------------- */

static float g_e4m3[256];
static pthread_once_t g_e4m3_once = PTHREAD_ONCE_INIT;

/* OCP e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
 * (m / 8 * 2^-6), S.1111.111 is NaN, no infinities.  Every value is exactly an f32. */
static void e4m3_table(void) {
    for (int i = 0; i < 256; i++) {
        int e = (i >> 3) & 15, m = i & 7;
        float v = e ? ldexpf(1.0f + (float)m / 8.0f, e - 7) : ldexpf((float)m / 8.0f, -6);
        if (e == 15 && m == 7) v = NAN;
        g_e4m3[i] = (i & 0x80) ? -v : v;
    }
}

void backend_e4m3_to_f32(float *out, const uint8_t *src, size_t n) {
    pthread_once(&g_e4m3_once, e4m3_table);
    for (size_t i = 0; i < n; i++)
        out[i] = g_e4m3[src[i]];
}

/* the generic form (the CPU): the matrix dequantized to f32 in a host buffer, each weight
 * e4m3 * scale rounded once, as a checkpoint's f32-dequantized twin computes it */
static int fp8_dequant_f32(backend *be, backend_buffer *b, const uint8_t *src, int N, int K,
                           const float *scales, int block_n, int block_k) {
    size_t n = (size_t)N * (size_t)K;
    if (be->iface->buffer_alloc(be, b, n * sizeof(float), 0)) return -ENOMEM;
    if (!b->is_host) {
        be->iface->buffer_free(be, b);
        return -ENOTSUP;
    }
    pthread_once(&g_e4m3_once, e4m3_table);
    float *w = b->ptr;
    int nkb = (K + block_k - 1) / block_k;
    for (int r = 0; r < N; r++) {
        const float *sr = scales + (size_t)(r / block_n) * nkb;
        const uint8_t *q = src + (size_t)r * K;
        float *o = w + (size_t)r * K;
        for (int k = 0; k < K; k++)
            o[k] = g_e4m3[q[k]] * sr[k / block_k];
    }
    return 0;
}

backend_buffer *backend_weights_load_fp8(backend *be, const uint8_t *src, int N, int K,
                                         const float *scales, int block_n, int block_k,
                                         backend_dtype *stored, backend_wscale *ws) {
    if (!be || !src || !scales || N < 1 || K < 1 || block_n < 1 || block_k < 1 || !stored || !ws) {
        LOG_E(MOD, "weights_load_fp8: bad arguments (%d x %d, blocks %d x %d)", N, K, block_n,
              block_k);
        return NULL;
    }
    memset(ws, 0, sizeof *ws);
    backend_buffer *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->be = be;
    int rc;
    if (be->iface->weights_load_fp8) {
        rc = be->iface->weights_load_fp8(be, b, src, N, K, scales, block_n, block_k, stored, ws);
    } else {
        rc = fp8_dequant_f32(be, b, src, N, K, scales, block_n, block_k);
        *stored = BACKEND_F32;
    }
    if (rc) {
        LOG_E(MOD, "weights_load_fp8: %s cannot place a %d x %d FP8 matrix (%s)", be->name, N, K,
              rc == -ENOTSUP ? "not supported" : "out of memory");
        free(b);
        return NULL;
    }
    return b;
}

backend_buffer *backend_weights_load_cat(backend *be, const void *const *srcs,
                                         const backend_dtype *src_dts, const size_t *ns,
                                         int n_parts, backend_dtype *stored) {
    int ok = be && srcs && src_dts && ns && n_parts >= 1 &&
             n_parts <= BACKEND_WEIGHTS_CAT_MAX_PARTS && stored;
    for (int i = 0; ok && i < n_parts; i++)
        ok = srcs[i] && ns[i] > 0 && dt_ok(src_dts[i]);
    if (!ok) {
        LOG_E(MOD, "weights_load_cat: bad arguments (%d parts)", n_parts);
        return NULL;
    }
    if (!be->iface->weights_load_cat) {
        LOG_E(MOD, "weights_load_cat: %s keeps matrices apart (backend_wants_cat is 0)", be->name);
        return NULL;
    }
    backend_buffer *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->be = be;
    if (be->iface->weights_load_cat(be, b, srcs, src_dts, ns, n_parts, stored)) {
        free(b);
        return NULL;
    }
    return b;
}

void backend_buffer_free(backend_buffer *b) {
    if (!b) return;
    b->be->iface->buffer_free(b->be, b);
    free(b);
}

void *backend_buffer_ptr(const backend_buffer *b) {
    return b->ptr;
}
size_t backend_buffer_size(const backend_buffer *b) {
    return b->size;
}
int backend_buffer_is_host(const backend_buffer *b) {
    return b->is_host;
}
const char *backend_buffer_location(const backend_buffer *b) {
    return b->be->location;
}
backend *backend_buffer_backend(const backend_buffer *b) {
    return b->be;
}

/* ---- streams ---------------------------------------------------------------------- */

backend_stream *backend_stream_create(backend *be) {
    backend_stream *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->be = be;
    if (be->iface->stream_create(be, st)) {
        free(st);
        return NULL;
    }
    return st;
}

backend_stream *backend_stream_create_threads(backend *be, int n_threads) {
    return be->is_cpu ? cpu_backend_stream_create(be, n_threads) : backend_stream_create(be);
}

void backend_stream_free(backend_stream *st) {
    if (!st) return;
    st->be->iface->stream_sync(st);
    backend_moe_scratch_free(st);
    st->be->iface->stream_free(st);
    free(st);
}

int backend_stream_sync(backend_stream *st) {
    return st->be->iface->stream_sync(st);
}
backend *backend_stream_backend(const backend_stream *st) {
    return st->be;
}

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            LOG_E(MOD, __VA_ARGS__);                                                               \
            return -EINVAL;                                                                        \
        }                                                                                          \
    } while (0)

int backend_upload(backend_stream *st, void *dev, const void *host, size_t bytes) {
    if (!bytes) return 0;
    CHECK(dev && host, "upload: null pointer (dev %p, host %p)", dev, host);
    return st->be->iface->upload(st, dev, host, bytes);
}
int backend_download(backend_stream *st, void *host, const void *dev, size_t bytes) {
    if (!bytes) return 0;
    CHECK(dev && host, "download: null pointer (dev %p, host %p)", dev, host);
    return st->be->iface->download(st, host, dev, bytes);
}
int backend_upload_async(backend_stream *st, void *dev, const backend_buffer *hb, size_t offset,
                         size_t bytes) {
    if (!bytes) return 0;
    CHECK(dev && hb, "upload_async: null pointer (dev %p, host buffer %p)", dev, (const void *)hb);
    CHECK(hb->be == st->be && hb->is_host && (hb->flags & BACKEND_BUF_HOST),
          "upload_async: the source must be a BACKEND_BUF_HOST buffer of the stream's backend "
          "(%s)",
          backend_name(st->be));
    CHECK(offset <= hb->size && bytes <= hb->size - offset,
          "upload_async: bytes [%zu, %zu) outside the host buffer of %zu bytes", offset,
          offset + bytes, hb->size);
    const void *host = (const char *)hb->ptr + offset;
    if (!st->be->iface->upload_async) return st->be->iface->upload(st, dev, host, bytes);
    return st->be->iface->upload_async(st, dev, host, bytes);
}
int backend_copy(backend_stream *st, void *dst, const void *src, size_t bytes) {
    if (!bytes || dst == src) return 0;
    CHECK(dst && src, "copy: null pointer (dst %p, src %p)", dst, src);
    CHECK((const char *)dst + bytes <= (const char *)src ||
              (const char *)src + bytes <= (const char *)dst,
          "copy: %zu bytes at %p and %p overlap", bytes, dst, src);
    return st->be->iface->copy(st, dst, src, bytes);
}
int backend_memset_zero(backend_stream *st, void *dev, size_t bytes) {
    if (!bytes) return 0;
    CHECK(dev, "memset_zero: null pointer");
    return st->be->iface->memset_zero(st, dev, bytes);
}

/* ---- the batch -------------------------------------------------------------------- */

int backend_plan(backend_stream *st, const backend_batch *b) {
    CHECK(b && b->n_tokens >= 1 && b->n_seqs >= 1 && b->n_seqs <= b->n_tokens,
          "plan: %d tokens of %d sequences (need 1 <= sequences <= tokens)", b ? b->n_tokens : 0,
          b ? b->n_seqs : 0);
    CHECK(b->tokens && b->tok_seq && b->tok_pos && b->qo_indptr && b->kv_len && b->bt_indptr &&
              b->bt_indices,
          "plan: a required array is NULL");
    CHECK(b->n_out >= 0 && (b->n_out == 0 || b->out_rows), "plan: n_out %d without out_rows",
          b->n_out);
    int T = b->n_tokens, S = b->n_seqs;
    CHECK(b->qo_indptr[0] == 0 && b->qo_indptr[S] == T && b->bt_indptr[0] == 0,
          "plan: qo_indptr must run from 0 to %d (got %d..%d), bt_indptr from 0", T,
          b->qo_indptr[0], b->qo_indptr[S]);
    for (int s = 0; s < S; s++) {
        int n = b->qo_indptr[s + 1] - b->qo_indptr[s];
        CHECK(n >= 1 && b->kv_len[s] >= n, "plan: sequence %d has %d new tokens and kv_len %d", s,
              n, b->kv_len[s]);
        CHECK(b->bt_indptr[s + 1] >= b->bt_indptr[s], "plan: bt_indptr decreases at sequence %d",
              s);
        for (int t = b->qo_indptr[s]; t < b->qo_indptr[s + 1]; t++)
            CHECK(b->tok_seq[t] == s && b->tok_pos[t] == b->kv_len[s] - n + (t - b->qo_indptr[s]),
                  "plan: token %d has sequence %d position %d; the ranges say %d, %d", t,
                  b->tok_seq[t], b->tok_pos[t], s, b->kv_len[s] - n + (t - b->qo_indptr[s]));
    }
    for (int r = 0; r < b->n_out; r++)
        CHECK(b->out_rows[r] >= 0 && b->out_rows[r] < T, "plan: out_rows[%d] = %d outside [0, %d)",
              r, b->out_rows[r], T);
    return st->be->iface->plan(st, b);
}

/* ---- recorded decode steps -------------------------------------------------------- */

int backend_graph_supported(const backend *be) {
    return be && be->iface->graph_plan != NULL;
}

int backend_graph_plan(backend_stream *st, const backend_batch *b, int max_ctx, int max_blocks) {
    CHECK(b && b->n_tokens >= 1 && b->n_seqs == b->n_tokens && b->n_out == b->n_tokens,
          "graph_plan: %d tokens, %d sequences, %d output rows (need one token per sequence, "
          "every row out)",
          b ? b->n_tokens : 0, b ? b->n_seqs : 0, b ? b->n_out : 0);
    CHECK(b->tokens && b->tok_seq && b->tok_pos && b->qo_indptr && b->kv_len && b->bt_indptr &&
              b->bt_indices && b->out_rows,
          "graph_plan: a required array is NULL");
    CHECK(max_ctx >= 1 && max_blocks >= 1, "graph_plan: max_ctx %d, max_blocks %d (need >= 1)",
          max_ctx, max_blocks);
    int S = b->n_seqs;
    CHECK(b->qo_indptr[0] == 0 && b->bt_indptr[0] == 0, "graph_plan: indptr must start at 0");
    for (int s = 0; s < S; s++) {
        int nb = b->bt_indptr[s + 1] - b->bt_indptr[s];
        CHECK(b->qo_indptr[s + 1] == s + 1 && b->tok_seq[s] == s,
              "graph_plan: token %d is not sequence %d's only token", s, s);
        CHECK(nb >= 0 && nb <= max_blocks && b->kv_len[s] >= 0 && b->kv_len[s] <= max_ctx &&
                  b->tok_pos[s] == b->kv_len[s] - 1,
              "graph_plan: sequence %d: kv_len %d, position %d, %d blocks (need position = "
              "kv_len - 1, kv_len <= %d, blocks <= %d)",
              s, b->kv_len[s], b->tok_pos[s], nb, max_ctx, max_blocks);
        CHECK(b->out_rows[s] == s, "graph_plan: out_rows[%d] = %d (need %d)", s, b->out_rows[s], s);
    }
    return st->be->iface->graph_plan ? st->be->iface->graph_plan(st, b, max_ctx, max_blocks)
                                     : -ENOTSUP;
}

int backend_graph_begin(backend_stream *st) {
    return st->be->iface->graph_begin ? st->be->iface->graph_begin(st) : -ENOTSUP;
}
int backend_graph_end(backend_stream *st, int ok) {
    return st->be->iface->graph_end ? st->be->iface->graph_end(st, ok) : -ENOTSUP;
}
void backend_graph_reset(backend_stream *st) {
    if (st && st->be->iface->graph_reset) st->be->iface->graph_reset(st);
}
int backend_graph_count(const backend_stream *st) {
    return st && st->be->iface->graph_count ? st->be->iface->graph_count(st) : 0;
}

/* ---- operations ------------------------------------------------------------------- */

int backend_embed(backend_stream *st, void *out, backend_dtype out_dt, const void *table,
                  backend_dtype table_dt, int hidden) {
    CHECK(out && table && hidden >= 1 && dt_ok(out_dt) && dt_ok(table_dt),
          "embed: bad arguments (hidden %d)", hidden);
    return st->be->iface->embed(st, out, out_dt, table, table_dt, hidden);
}

int backend_rmsnorm(backend_stream *st, void *out, backend_dtype out_dt, const void *x,
                    backend_dtype x_dt, const float *w, int rows, int n, float eps) {
    CHECK(out && x && w && rows >= 1 && n >= 1 && dt_ok(out_dt) && dt_ok(x_dt),
          "rmsnorm: bad arguments (rows %d, n %d)", rows, n);
    return st->be->iface->rmsnorm(st, out, out_dt, x, x_dt, w, rows, n, eps);
}

int backend_matmul(backend_stream *st, const backend_matmul_op *ops, int n_ops) {
    CHECK(ops && n_ops >= 1 && n_ops <= BACKEND_MATMUL_MAX_OPS, "matmul: %d ops (accepted 1..%d)",
          n_ops, BACKEND_MATMUL_MAX_OPS);
    for (int i = 0; i < n_ops; i++) {
        const backend_matmul_op *o = &ops[i];
        CHECK(o->y && o->x && o->w && o->T >= 1 && o->N >= 1 && o->K >= 1 && dt_ok(o->y_dt) &&
                  dt_ok(o->x_dt) && dt_ok(o->w_dt),
              "matmul: op %d has bad arguments (T %d, N %d, K %d)", i, o->T, o->N, o->K);
        CHECK((o->w_dt == BACKEND_F8E4M3) == (o->w_scale.s != NULL) &&
                  (!o->w_scale.s || (o->w_scale.block_n >= 1 && o->w_scale.block_k >= 1)),
              "matmul: op %d: FP8 weights need their scales (and only they have scales)", i);
    }
    return st->be->iface->matmul(st, ops, n_ops);
}

int backend_rope(backend_stream *st, void *q, int n_q_heads, void *k, int n_k_heads,
                 backend_dtype dt, int head_dim, const float *inv_freq) {
    CHECK(q && inv_freq && n_q_heads >= 1 && (!k || n_k_heads >= 1) && head_dim >= 2 &&
              head_dim % 2 == 0 && head_dim <= 1024 && dt_ok(dt),
          "rope: bad arguments (heads %d/%d, head_dim %d; head_dim must be even, <= 1024)",
          n_q_heads, n_k_heads, head_dim);
    return st->be->iface->rope(st, q, n_q_heads, k, n_k_heads, dt, head_dim, inv_freq);
}

size_t backend_kv_block_bytes(const backend_kv *kv) {
    return (size_t)kv->n_layers * 2 * (size_t)kv->block_size * (size_t)kv->n_kv_heads *
           (size_t)kv->head_dim * backend_dtype_size(kv->dtype);
}

float backend_kv_scale(const backend_kv *kv, int layer, int which) {
    if (kv->dtype != BACKEND_F8E4M3) return 1.0f;
    const float *s = which ? kv->v_scale : kv->k_scale;
    return s ? s[layer] : 1.0f;
}

static int kv_ok(const backend_kv *kv, int layer) {
    return kv && kv->base && kv->n_blocks >= 1 && kv->block_size >= 1 && kv->n_layers >= 1 &&
           kv->n_kv_heads >= 1 && kv->head_dim >= 1 && dt_ok(kv->dtype) && layer >= 0 &&
           layer < kv->n_layers && kv->window >= 0 && backend_kv_scale(kv, layer, 0) > 0.0f &&
           backend_kv_scale(kv, layer, 1) > 0.0f;
}

int backend_attention_window(const backend *be) {
    return be && be->attention_window;
}

/* a sliding window on a backend whose attention has none: refused, never ignored */
static int window_ok(backend_stream *st, const backend_kv *kv) {
    if (!kv->window || st->be->attention_window) return 1;
    LOG_E(MOD, "attention: sliding window %d is not implemented on %s", kv->window, st->be->name);
    return 0;
}

int backend_kv_write(backend_stream *st, const backend_kv *kv, int layer, const void *k,
                     const void *v, backend_dtype dt) {
    CHECK(kv_ok(kv, layer) && k && v && dt_ok(dt), "kv_write: bad arguments (layer %d)", layer);
    return st->be->iface->kv_write(st, kv, layer, k, v, dt);
}

int backend_attention(backend_stream *st, void *out, const void *q, backend_dtype dt,
                      const backend_kv *kv, int layer, int n_heads, float scale) {
    CHECK(kv_ok(kv, layer) && out && q && out != q && dt_ok(dt),
          "attention: bad arguments (layer %d)", layer);
    CHECK(n_heads >= kv->n_kv_heads && n_heads % kv->n_kv_heads == 0 &&
              n_heads / kv->n_kv_heads <= 64,
          "attention: %d query heads over %d KV heads (need a multiple, at most 64 per KV head)",
          n_heads, kv->n_kv_heads);
    if (!window_ok(st, kv)) return -ENOTSUP;
    return st->be->iface->attention(st, out, q, dt, kv, layer, n_heads, scale);
}

int backend_swiglu(backend_stream *st, void *g, const void *u, backend_dtype dt, int rows, int n) {
    CHECK(g && u && rows >= 1 && n >= 1 && dt_ok(dt), "swiglu: bad arguments (rows %d, n %d)", rows,
          n);
    return st->be->iface->swiglu(st, g, u, dt, rows, n);
}

int backend_add(backend_stream *st, void *y, const void *x, backend_dtype dt, size_t n) {
    if (!n) return 0;
    CHECK(y && x && dt_ok(dt), "add: bad arguments");
    return st->be->iface->add(st, y, x, dt, n);
}

int backend_gather_rows(backend_stream *st, void *out, const void *x, backend_dtype dt, int width) {
    CHECK(out && x && out != x && width >= 1 && dt_ok(dt), "gather_rows: bad arguments (width %d)",
          width);
    return st->be->iface->gather_rows(st, out, x, dt, width);
}

int backend_argmax(backend_stream *st, int32_t *out, const float *logits, int rows, int vocab) {
    CHECK(out && logits && rows >= 1 && vocab >= 1, "argmax: bad arguments (rows %d, vocab %d)",
          rows, vocab);
    return st->be->iface->argmax(st, out, logits, rows, vocab);
}

int backend_token_bitmask(backend_stream *st, float *logits, int width, const int32_t *bitmask,
                          const int32_t *rows, int n, int vocab) {
    if (n == 0) return 0;
    CHECK(logits && bitmask && rows && n >= 1 && vocab >= 1 && vocab <= width,
          "token_bitmask: bad arguments (n %d, vocab %d, width %d; accepted: n >= 0, "
          "1 <= vocab <= width, non-null logits, bitmask and rows)",
          n, vocab, width);
    if (!st->be->iface->token_bitmask) return -ENOTSUP;
    return st->be->iface->token_bitmask(st, logits, width, bitmask, rows, n, vocab);
}

/* ---- fused operations: the backend's own, else the generic form ----------------------- */

int backend_add_rmsnorm(backend_stream *st, void *out, backend_dtype out_dt, void *x,
                        const void *add, backend_dtype x_dt, const float *w, int rows, int n,
                        float eps) {
    CHECK(out && x && w && rows >= 1 && n >= 1 && dt_ok(out_dt) && dt_ok(x_dt) && add != x,
          "add_rmsnorm: bad arguments (rows %d, n %d)", rows, n);
    if (st->be->iface->add_rmsnorm)
        return st->be->iface->add_rmsnorm(st, out, out_dt, x, add, x_dt, w, rows, n, eps);
    int rc = add ? backend_add(st, x, add, x_dt, (size_t)rows * n) : 0;
    return rc ? rc : backend_rmsnorm(st, out, out_dt, x, x_dt, w, rows, n, eps);
}

int backend_qkv(backend_stream *st, const backend_qkv_op *o) {
    CHECK(o && o->x && o->q && o->inv_freq && kv_ok(o->kv, o->layer) && o->T >= 1 &&
              o->hidden >= 1 && o->n_heads >= 1 && dt_ok(o->x_dt) && dt_ok(o->w_dt) && dt_ok(o->dt),
          "qkv: bad arguments");
    CHECK(o->wqkv || (o->wq && o->wk && o->wv && o->k && o->v),
          "qkv: neither the concatenated matrix nor q, k, v weights with k/v scratch");
    CHECK(!o->q_norm == !o->k_norm, "qkv: q_norm and k_norm go together");
    if (o->wqkv && st->be->iface->qkv) return st->be->iface->qkv(st, o);
    CHECK(o->wq && o->wk && o->wv && o->k && o->v,
          "qkv: %s has no fused form: give wq, wk, wv and k/v scratch", st->be->name);
    const backend_kv *kv = o->kv;
    int T = o->T, kvd = kv->n_kv_heads * kv->head_dim, nq = o->n_heads * kv->head_dim;
    backend_matmul_op ops[3] = {
        {o->q, o->dt, o->x, o->x_dt, o->wq, o->w_dt, o->bq, T, nq, o->hidden, o->sq},
        {o->k, o->dt, o->x, o->x_dt, o->wk, o->w_dt, o->bk, T, kvd, o->hidden, o->sk},
        {o->v, o->dt, o->x, o->x_dt, o->wv, o->w_dt, o->bv, T, kvd, o->hidden, o->sv}};
    int rc = backend_matmul(st, ops, 3);
    if (!rc && o->q_norm)
        rc = backend_rmsnorm(st, o->q, o->dt, o->q, o->dt, o->q_norm, T * o->n_heads, kv->head_dim,
                             o->qk_eps);
    if (!rc && o->k_norm)
        rc = backend_rmsnorm(st, o->k, o->dt, o->k, o->dt, o->k_norm, T * kv->n_kv_heads,
                             kv->head_dim, o->qk_eps);
    if (!rc)
        rc = backend_rope(st, o->q, o->n_heads, o->k, kv->n_kv_heads, o->dt, kv->head_dim,
                          o->inv_freq);
    return rc ? rc : backend_kv_write(st, kv, o->layer, o->k, o->v, o->dt);
}

int backend_gate_up(backend_stream *st, const backend_mlp_op *o) {
    CHECK(o && o->x && o->h && o->T >= 1 && o->hidden >= 1 && o->inter >= 1 && dt_ok(o->x_dt) &&
              dt_ok(o->w_dt) && dt_ok(o->h_dt),
          "gate_up: bad arguments");
    if (o->w_gate_up && st->be->iface->gate_up) return st->be->iface->gate_up(st, o);
    CHECK(o->w_gate && o->w_up && o->h2,
          "gate_up: %s has no fused form: give w_gate, w_up and the h2 scratch", st->be->name);
    backend_matmul_op ops[2] = {{o->h, o->h_dt, o->x, o->x_dt, o->w_gate, o->w_dt, NULL, o->T,
                                 o->inter, o->hidden, o->s_gate},
                                {o->h2, o->h_dt, o->x, o->x_dt, o->w_up, o->w_dt, NULL, o->T,
                                 o->inter, o->hidden, o->s_up}};
    int rc = backend_matmul(st, ops, 2);
    return rc ? rc : backend_swiglu(st, o->h, o->h2, o->h_dt, o->T, o->inter);
}

int backend_matmul_residual(backend_stream *st, const backend_matmul_op *op, void *resid) {
    CHECK(op && resid && resid != op->y && resid != op->x,
          "matmul_residual: bad arguments (the residual must be neither y nor x)");
    if (st->be->iface->matmul_residual) {
        CHECK(op->y && op->x && op->w && op->T >= 1 && op->N >= 1 && op->K >= 1 &&
                  dt_ok(op->y_dt) && dt_ok(op->x_dt) && dt_ok(op->w_dt),
              "matmul_residual: bad arguments (T %d, N %d, K %d)", op->T, op->N, op->K);
        return st->be->iface->matmul_residual(st, op, resid);
    }
    int rc = backend_matmul(st, op, 1);
    return rc ? rc : backend_add(st, resid, op->y, op->y_dt, (size_t)op->T * op->N);
}

int backend_residual_fused(backend_stream *st, int T) {
    return st && T >= 1 && st->be->iface->residual_fused ? st->be->iface->residual_fused(st, T) : 0;
}

int backend_attention_to(backend_stream *st, void *out, backend_dtype out_dt, const void *q,
                         backend_dtype dt, const backend_kv *kv, int layer, int n_heads,
                         float scale) {
    if (out_dt == dt || !st->be->iface->attention_to)
        return out_dt == dt ? backend_attention(st, out, q, dt, kv, layer, n_heads, scale)
                            : -ENOTSUP;
    CHECK(kv_ok(kv, layer) && out && q && out != q && dt_ok(dt) && dt_ok(out_dt),
          "attention: bad arguments (layer %d)", layer);
    CHECK(n_heads >= kv->n_kv_heads && n_heads % kv->n_kv_heads == 0 &&
              n_heads / kv->n_kv_heads <= 64,
          "attention: %d query heads over %d KV heads (need a multiple, at most 64 per KV head)",
          n_heads, kv->n_kv_heads);
    if (!window_ok(st, kv)) return -ENOTSUP;
    return st->be->iface->attention_to(st, out, out_dt, q, dt, kv, layer, n_heads, scale);
}

int backend_measure(backend *be, double *copy_gbs, double *gemm_tflops, int M, int N, int K) {
    if (!be || !be->iface->measure) return -ENOTSUP;
    CHECK(M >= 1 && N >= 1 && K >= 1, "measure: M %d, N %d, K %d (need >= 1)", M, N, K);
    return be->iface->measure(be, copy_gbs, gemm_tflops, M, N, K);
}

/* ---- layer progress (backend.h) -------------------------------------------------------- */

struct backend_layer_progress {
    backend *be;
    int n_layers;
    pthread_mutex_t mu; /* guards everything below; held around event record and query */
    pthread_cond_t cv;  /* a mark completed or a step ended */
    uint64_t cur;       /* the step being enqueued */
    uint64_t done;      /* every layer of the steps <= done is written */
    uint64_t *marked;   /* (n_layers) the step of the layer's last recorded event */
    uint64_t *written;  /* (n_layers) the last step whose layer is known written */
    void **ev;          /* (n_layers) device events; NULL: a mark completes at once */
};

backend_layer_progress *backend_layer_progress_new(backend *be, int n_layers) {
    if (!be || n_layers <= 0 || be->layer_progress) {
        LOG_E("backend", "backend_layer_progress_new: %s",
              !be             ? "no backend"
              : n_layers <= 0 ? "no layers"
                              : "the backend has one already");
        return NULL;
    }
    backend_layer_progress *lp = calloc(1, sizeof *lp);
    if (!lp) return NULL;
    lp->be = be;
    lp->n_layers = n_layers;
    lp->marked = calloc((size_t)n_layers, sizeof *lp->marked);
    lp->written = calloc((size_t)n_layers, sizeof *lp->written);
    int ok = lp->marked && lp->written;
    if (ok && be->iface->event_new) {
        lp->ev = calloc((size_t)n_layers, sizeof *lp->ev);
        ok = lp->ev != NULL;
        for (int l = 0; ok && l < n_layers; l++)
            ok = be->iface->event_new(be, &lp->ev[l]) == 0;
    }
    pthread_mutex_init(&lp->mu, NULL);
    clock_cond_init(&lp->cv);
    if (!ok) {
        LOG_E("backend", "backend_layer_progress_new: cannot create %d layer events on %s",
              n_layers, be->name);
        be->layer_progress = lp;
        backend_layer_progress_free(lp);
        return NULL;
    }
    be->layer_progress = lp;
    return lp;
}

void backend_layer_progress_free(backend_layer_progress *lp) {
    if (!lp) return;
    if (lp->be->layer_progress == lp) lp->be->layer_progress = NULL;
    for (int l = 0; lp->ev && l < lp->n_layers; l++)
        if (lp->ev[l]) lp->be->iface->event_free(lp->be, lp->ev[l]);
    free(lp->ev);
    free(lp->marked);
    free(lp->written);
    pthread_mutex_destroy(&lp->mu);
    pthread_cond_destroy(&lp->cv);
    free(lp);
}

void backend_layer_progress_begin(backend_layer_progress *lp, uint64_t step) {
    if (!lp) return;
    pthread_mutex_lock(&lp->mu);
    lp->cur = step;
    pthread_mutex_unlock(&lp->mu);
}

void backend_layer_progress_end(backend_layer_progress *lp, uint64_t step) {
    if (!lp) return;
    pthread_mutex_lock(&lp->mu);
    if (step > lp->done) lp->done = step;
    pthread_cond_broadcast(&lp->cv);
    pthread_mutex_unlock(&lp->mu);
}

uint64_t backend_layer_progress_done(backend_layer_progress *lp) {
    if (!lp) return 0;
    pthread_mutex_lock(&lp->mu);
    uint64_t d = lp->done;
    pthread_mutex_unlock(&lp->mu);
    return d;
}

int backend_layer_mark(backend_stream *st, int layer) {
    backend_layer_progress *lp = st ? st->be->layer_progress : NULL;
    if (!lp) return 0;
    if (layer < 0 || layer >= lp->n_layers) {
        LOG_E("backend", "backend_layer_mark: layer %d out of range (0..%d)", layer,
              lp->n_layers - 1);
        return -EINVAL;
    }
    int rc = 0;
    pthread_mutex_lock(&lp->mu);
    if (!lp->ev) { /* the operations before it are done: the layer is written */
        lp->written[layer] = lp->cur;
        pthread_cond_broadcast(&lp->cv);
    } else {
        rc = lp->be->iface->event_record(st, lp->ev[layer]);
        if (rc == 0) lp->marked[layer] = lp->cur;
        rc = rc > 0 ? 0 : rc; /* recording a graph: the step's _end completes it */
    }
    pthread_mutex_unlock(&lp->mu);
    return rc;
}

/* How long a waiter sleeps between queries of a pending device event. */
#define LAYER_POLL_NS 20000u

int backend_layer_wait(backend_layer_progress *lp, uint64_t step, int layer, uint64_t timeout_ns) {
    if (!lp || layer < 0 || layer >= lp->n_layers) return -EINVAL;
    uint64_t deadline = clock_now_ns() + timeout_ns;
    int rc = 0;
    pthread_mutex_lock(&lp->mu);
    for (;;) {
        if (lp->done >= step || lp->written[layer] >= step) break;
        int pending = 0;
        if (lp->ev && lp->marked[layer] >= step) {
            int q = lp->be->iface->event_query(lp->be, lp->ev[layer]);
            if (q < 0) {
                rc = -EIO;
                break;
            }
            if (q > 0) { /* the event (of this step or a later one) completed */
                lp->written[layer] = lp->marked[layer];
                break;
            }
            pending = 1;
        }
        uint64_t now = clock_now_ns();
        if (now >= deadline) {
            rc = -ETIMEDOUT;
            break;
        }
        uint64_t until = pending && deadline - now > LAYER_POLL_NS ? now + LAYER_POLL_NS : deadline;
        struct timespec ts = clock_to_timespec(until);
        pthread_cond_timedwait(&lp->cv, &lp->mu, &ts);
    }
    pthread_mutex_unlock(&lp->mu);
    return rc;
}
