/*
 * backend_moe — the mixture-of-experts operations of kernels/backend.h: argument checks, the
 * backend's own implementation where it has one (backend_iface.moe_route / .moe), else the
 * generic forms here, which are what the CPU backend runs and what DISAGG_MOE_GENERIC=1 forces
 * everywhere (the benchmark's plain loop over experts).
 *
 * The generic forms work on host copies of the routing: on the CPU the device memory is host
 * memory and nothing is copied; on a device backend the logits, ids and weights, the tokens'
 * rows and each expert's output travel through synchronous downloads and uploads.  The
 * experts' GEMMs run on the backend (backend_gate_up, backend_matmul) over each expert's
 * tokens gathered into one block, so the CPU's matmul kernels and thread pool do the work.
 */
#include "kernels/backend_impl.h"
#include "kernels/cpu/cpu_matmul.h"

#include "base/log.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MOD "backend"

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            LOG_E(MOD, __VA_ARGS__);                                                               \
            return -EINVAL;                                                                        \
        }                                                                                          \
    } while (0)

/* Scratch kept with the stream, grown as T grows: device blocks for one expert's tokens and
 * host arrays for the routing and the sums. */
struct backend_moe_scratch {
    backend_buffer *dev[4]; /* gathered x, gate (h), up (h2), expert output (f32) */
    size_t dev_bytes[4];
    void *host[6]; /* ids, weights, per-expert lists (+ their weights), acc, staging */
    size_t host_bytes[6];
    int *count; /* (BACKEND_MOE_MAX_EXPERTS + 1) list offsets */
};
enum { D_X, D_H, D_H2, D_Y };
enum { H_IDS, H_W, H_LIST, H_LISTW, H_ACC, H_STAGE };

void backend_moe_scratch_free(backend_stream *st) {
    struct backend_moe_scratch *s = st->moe;
    if (!s) return;
    for (int i = 0; i < 4; i++)
        backend_buffer_free(s->dev[i]);
    for (int i = 0; i < 6; i++)
        free(s->host[i]);
    free(s->count);
    free(s);
    st->moe = NULL;
}

static struct backend_moe_scratch *scratch(backend_stream *st) {
    if (!st->moe) st->moe = calloc(1, sizeof *st->moe);
    if (st->moe && !st->moe->count)
        st->moe->count = calloc(BACKEND_MOE_MAX_EXPERTS + 1, sizeof *st->moe->count);
    return st->moe && st->moe->count ? st->moe : NULL;
}

static void *dev_at_least(backend_stream *st, int i, size_t bytes) {
    struct backend_moe_scratch *s = st->moe;
    if (s->dev_bytes[i] < bytes) {
        backend_buffer_free(s->dev[i]);
        s->dev[i] = backend_buffer_alloc(st->be, bytes, 0);
        s->dev_bytes[i] = s->dev[i] ? bytes : 0;
    }
    return s->dev[i] ? backend_buffer_ptr(s->dev[i]) : NULL;
}

static void *host_at_least(struct backend_moe_scratch *s, int i, size_t bytes) {
    if (s->host_bytes[i] < bytes) {
        free(s->host[i]);
        s->host[i] = malloc(bytes);
        s->host_bytes[i] = s->host[i] ? bytes : 0;
    }
    return s->host[i];
}

/* DISAGG_MOE_GENERIC=1 forces the generic form on a backend with MoE kernels of its own (the
 * benchmarks' plain-loop baseline); unset or "0", a backend's own kernels run (the CUDA
 * module's passed their parity tests on the H200 on 3 December: docs/gpu.md "Mixture of
 * experts"). */
static int env_generic(void) {
    const char *e = getenv("DISAGG_MOE_GENERIC");
    return e && !strcmp(e, "1");
}

int backend_moe_generic(const backend *be) {
    return !be->iface->moe || !be->iface->moe_route || env_generic();
}

static int dt_ok(backend_dtype dt) {
    return backend_dtype_size(dt) != 0;
}

/* ---- routing ------------------------------------------------------------------------- */

/* One token's routing as backend.h defines it: softmax in f32 (max subtracted, expf, the sum
 * in expert order), the top_k largest in descending order (ties: the lower index first),
 * renormalised when norm. */
static void route_row(int32_t *ids, float *w, const float *l, int E, int k, int norm, float *p) {
    float mx = l[0];
    for (int e = 1; e < E; e++)
        if (l[e] > mx) mx = l[e];
    float sum = 0.0f;
    for (int e = 0; e < E; e++) {
        p[e] = expf(l[e] - mx);
        sum += p[e];
    }
    for (int e = 0; e < E; e++)
        p[e] = p[e] / sum;
    unsigned char taken[BACKEND_MOE_MAX_EXPERTS] = {0};
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            /* strictly greater: the lower index wins ties; NaN never wins over a number */
            if (!taken[e] && (best < 0 || p[e] > p[best] || (isnan(p[best]) && !isnan(p[e]))))
                best = e;
        taken[best] = 1;
        ids[j] = best;
        w[j] = p[best];
    }
    if (norm) {
        float s = 0.0f;
        for (int j = 0; j < k; j++)
            s += w[j];
        for (int j = 0; j < k; j++)
            w[j] = w[j] / s;
    }
}

static int route_generic(backend_stream *st, int32_t *ids, float *weights, const float *logits,
                         int T, int E, int k, int norm) {
    struct backend_moe_scratch *s = scratch(st);
    int host = st->be->is_cpu, rc = 0;
    if (!s) return -ENOMEM;
    float *p = host_at_least(s, H_STAGE, ((size_t)E + (host ? 0 : (size_t)T * E)) * sizeof(float));
    int32_t *hid = host ? ids : host_at_least(s, H_IDS, (size_t)T * k * sizeof(int32_t));
    float *hw = host ? weights : host_at_least(s, H_W, (size_t)T * k * sizeof(float));
    if (!p || !hid || !hw) return -ENOMEM;
    const float *hl = logits;
    if (!host) {
        float *l = p + E;
        if ((rc = backend_download(st, l, logits, (size_t)T * E * sizeof(float)))) return rc;
        hl = l;
    }
    for (int t = 0; t < T; t++)
        route_row(hid + (size_t)t * k, hw + (size_t)t * k, hl + (size_t)t * E, E, k, norm, p);
    if (host) return 0;
    rc = backend_upload(st, ids, hid, (size_t)T * k * sizeof(int32_t));
    return rc ? rc : backend_upload(st, weights, hw, (size_t)T * k * sizeof(float));
}

int backend_moe_route(backend_stream *st, int32_t *ids, float *weights, const float *logits, int T,
                      int n_experts, int top_k, int norm) {
    CHECK(st && ids && weights && logits && T >= 1, "moe_route: bad arguments (T %d)", T);
    CHECK(top_k >= 1 && top_k <= n_experts && n_experts <= BACKEND_MOE_MAX_EXPERTS,
          "moe_route: top_k %d of %d experts (need 1 <= top_k <= experts <= %d)", top_k, n_experts,
          BACKEND_MOE_MAX_EXPERTS);
    if (!backend_moe_generic(st->be))
        return st->be->iface->moe_route(st, ids, weights, logits, T, n_experts, top_k, norm);
    return route_generic(st, ids, weights, logits, T, n_experts, top_k, norm);
}

/* ---- the experts ----------------------------------------------------------------------- */

/* f32 sums (T * hidden) into out of out_dt on the host (the device path's last step) */
static int narrow(void *out, const float *acc, size_t n, backend_dtype dt) {
    if (dt == BACKEND_F32) {
        memcpy(out, acc, n * sizeof(float));
    } else if (dt == BACKEND_BF16) {
        for (size_t i = 0; i < n; i += 1 << 20) {
            size_t m = n - i < (size_t)1 << 20 ? n - i : (size_t)1 << 20;
            cpu_f32_to_bf16_row((uint16_t *)out + i, acc + i, (int)m);
        }
    } else {
        LOG_E(MOD, "moe: the generic form writes float32 or bfloat16, not %s",
              backend_dtype_name(dt));
        return -ENOTSUP;
    }
    return 0;
}

/* Expert e's matrices: the per-expert arrays, else slices of the stacked ones. */
static void expert_w(const backend_moe_op *o, int e, const void **gate, const void **up,
                     const void **gate_up, const void **down) {
    size_t es = backend_dtype_size(o->w_dt), m = (size_t)o->inter * o->hidden * es;
    *gate_up = o->w_gate_up_all ? (const char *)o->w_gate_up_all + 2 * m * e : NULL;
    if (o->w_gate) {
        *gate = o->w_gate[e], *up = o->w_up[e], *down = o->w_down[e];
    } else {
        *gate = *gate_up, *up = (const char *)*gate_up + m;
        *down = (const char *)o->w_down_all + m * e;
    }
}

/* transformers: expert(x) * weight, then index_add: a product, then a sum (no fma) */
static void scatter_add(float *acc, const float *y, const int32_t *toks, const float *tw, int n,
                        int H) {
    for (int r = 0; r < n; r++) {
        float *a = acc + (size_t)toks[r] * H;
        const float *yr = y + (size_t)r * H, wr = tw[r];
        for (int i = 0; i < H; i++) {
            float prod = wr * yr[i];
            a[i] += prod;
        }
    }
}

/* The CPU's blocks: experts in ascending order, up to GROUP experts (at most GROUP_ROWS rows,
 * or one expert's tokens) per block, their gate and up matmuls as one dispatch of the thread
 * pool (decode: a few rows per expert, so fewer dispatches matter), one SwiGLU, their down
 * matmuls as another: each matmul's result equals its own (backend_matmul), so the sums are
 * those of one expert at a time. */
#define GROUP      4
#define GROUP_ROWS 64
typedef struct moe_sums {
    const backend_moe_op *o;
    const int32_t *list;
    const float *listw;
    const int *cnt;
    char *xe;
    void *h, *h2;
    float *ye, *acc;
    int cap;
    backend_dtype mm;
} moe_sums;

static int experts_grouped(backend_stream *st, const moe_sums *g) {
    const backend_moe_op *o = g->o;
    const int H = o->hidden, I = o->inter, E = o->n_experts;
    const size_t xrow = (size_t)H * backend_dtype_size(o->x_dt),
                 hrow = (size_t)I * backend_dtype_size(g->mm);
    int rc = 0;
    for (int e = 0; e < E && !rc;) {
        int ge[GROUP], gn = 0, rows = 0;
        for (; e < E && gn < GROUP; e++) {
            int n = g->cnt[e + 1] - g->cnt[e];
            if (!n) continue;
            if (gn && rows + n > g->cap) break;
            ge[gn++] = e, rows += n;
        }
        if (!gn) break;
        backend_matmul_op up[2 * GROUP], down[GROUP];
        for (int i = 0, off = 0; i < gn; i++) {
            int n = g->cnt[ge[i] + 1] - g->cnt[ge[i]];
            const int32_t *toks = g->list + g->cnt[ge[i]];
            for (int r = 0; r < n; r++)
                memcpy(g->xe + (size_t)(off + r) * xrow, (const char *)o->x + toks[r] * xrow, xrow);
            const void *wg, *wu, *wgu, *wd;
            expert_w(o, ge[i], &wg, &wu, &wgu, &wd);
            void *hi = (char *)g->h + off * hrow, *h2i = (char *)g->h2 + off * hrow;
            const void *xi = g->xe + off * xrow;
            up[2 * i] = (backend_matmul_op){hi, g->mm, xi, o->x_dt, wg, o->w_dt, NULL, n, I, H, {0}};
            up[2 * i + 1] =
                (backend_matmul_op){h2i, g->mm, xi, o->x_dt, wu, o->w_dt, NULL, n, I, H, {0}};
            down[i] = (backend_matmul_op){
                g->ye + (size_t)off * H, BACKEND_F32, hi, g->mm, wd, o->w_dt, NULL, n, H, I, {0}};
            off += n;
        }
        if ((rc = backend_matmul(st, up, 2 * gn)) ||
            (rc = backend_swiglu(st, g->h, g->h2, g->mm, rows, I)) ||
            (rc = backend_matmul(st, down, gn)))
            break;
        for (int i = 0, off = 0; i < gn; i++) {
            int n = g->cnt[ge[i] + 1] - g->cnt[ge[i]];
            scatter_add(g->acc, g->ye + (size_t)off * H, g->list + g->cnt[ge[i]],
                        g->listw + g->cnt[ge[i]], n, H);
            off += n;
        }
    }
    return rc;
}

static int narrow_out(const backend_moe_op *o, float *acc) {
    return acc == o->out ? 0 : narrow(o->out, acc, (size_t)o->T * o->hidden, o->out_dt);
}

static int moe_generic(backend_stream *st, const backend_moe_op *o) {
    struct backend_moe_scratch *s = scratch(st);
    if (!s) return -ENOMEM;
    backend *be = st->be;
    const int host = be->is_cpu, T = o->T, k = o->top_k, E = o->n_experts, H = o->hidden;
    const size_t n_sel = (size_t)T * k, xrow = (size_t)H * backend_dtype_size(o->x_dt);
    const backend_dtype mm = backend_mm_dtype(be);
    int rc;
    /* the routing on the host */
    const int32_t *ids = o->ids;
    const float *wts = o->weights;
    if (!host) {
        int32_t *hi = host_at_least(s, H_IDS, n_sel * sizeof(int32_t));
        float *hw = host_at_least(s, H_W, n_sel * sizeof(float));
        if (!hi || !hw) return -ENOMEM;
        if ((rc = backend_download(st, hi, ids, n_sel * sizeof(int32_t))) ||
            (rc = backend_download(st, hw, wts, n_sel * sizeof(float))))
            return rc;
        ids = hi, wts = hw;
    }
    /* each expert's tokens in ascending order (a counting sort), with their weights */
    int *cnt = s->count;
    memset(cnt, 0, (size_t)(E + 1) * sizeof *cnt);
    for (size_t i = 0; i < n_sel; i++)
        CHECK(ids[i] >= 0 && ids[i] < E, "moe: ids[%zu] = %d outside [0, %d)", i, ids[i], E);
    for (size_t i = 0; i < n_sel; i++)
        cnt[ids[i] + 1]++;
    for (int e = 0; e < E; e++)
        cnt[e + 1] += cnt[e];
    int32_t *list =
        host_at_least(s, H_LIST, n_sel * sizeof(int32_t) + (size_t)(E + 1) * sizeof(int));
    float *listw = host_at_least(s, H_LISTW, n_sel * sizeof(float));
    if (!list || !listw) return -ENOMEM;
    int *fill = (int *)(list + n_sel);
    memcpy(fill, cnt, (size_t)(E + 1) * sizeof *fill);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e = ids[(size_t)t * k + j], at = fill[e]++;
            list[at] = t;
            listw[at] = wts[(size_t)t * k + j];
        }
    int max_n = 0;
    for (int e = 0; e < E; e++)
        if (cnt[e + 1] - cnt[e] > max_n) max_n = cnt[e + 1] - cnt[e];
    /* the sums: out itself on the CPU when it is f32, else a host array */
    float *acc = host && o->out_dt == BACKEND_F32
                     ? o->out
                     : host_at_least(s, H_ACC, (size_t)T * H * sizeof(float));
    const char *xh = o->x;
    float *yh = NULL;
    if (!host) {
        char *stage = host_at_least(s, H_STAGE,
                                    (size_t)T * xrow + (size_t)max_n * xrow +
                                        (size_t)max_n * H * sizeof(float));
        if (!stage) return -ENOMEM;
        if ((rc = backend_download(st, stage, o->x, (size_t)T * xrow))) return rc;
        xh = stage;
        yh = (float *)(stage + (size_t)T * xrow + (size_t)max_n * xrow);
    }
    /* rows of one block: an expert's tokens; on the CPU a group of experts' (GROUP_ROWS) */
    int cap = max_n > 0 ? max_n : 1;
    if (host && cap < GROUP_ROWS) cap = (size_t)GROUP_ROWS < n_sel ? GROUP_ROWS : (int)n_sel;
    size_t hb = (size_t)cap * o->inter * backend_dtype_size(mm);
    char *xe = dev_at_least(st, D_X, (size_t)cap * xrow);
    void *h = dev_at_least(st, D_H, hb), *h2 = dev_at_least(st, D_H2, hb);
    float *ye = dev_at_least(st, D_Y, (size_t)cap * H * sizeof(float));
    if (!acc || !xe || !h || !h2 || !ye) return -ENOMEM;
    memset(acc, 0, (size_t)T * H * sizeof(float));
    if (host) {
        moe_sums g = {o, list, listw, cnt, xe, h, h2, ye, acc, cap, mm};
        rc = experts_grouped(st, &g);
        return rc ? rc : narrow_out(o, acc);
    }
    /* experts in ascending order: each token's sum runs over its experts in that order */
    for (int e = 0; e < E; e++) {
        int n = cnt[e + 1] - cnt[e];
        if (!n) continue;
        const int32_t *toks = list + cnt[e];
        const float *tw = listw + cnt[e];
        char *gx = (char *)yh - (size_t)max_n * xrow;
        for (int r = 0; r < n; r++)
            memcpy(gx + (size_t)r * xrow, xh + (size_t)toks[r] * xrow, xrow);
        if ((rc = backend_upload(st, xe, gx, (size_t)n * xrow))) return rc;
        const void *gate, *up, *gate_up, *down;
        expert_w(o, e, &gate, &up, &gate_up, &down);
        backend_mlp_op g = {.x = xe,
                            .x_dt = o->x_dt,
                            .T = n,
                            .hidden = H,
                            .inter = o->inter,
                            .w_gate = gate,
                            .w_up = up,
                            .w_dt = o->w_dt,
                            .w_gate_up = gate_up,
                            .h = h,
                            .h2 = h2,
                            .h_dt = mm};
        if ((rc = backend_gate_up(st, &g))) return rc;
        backend_matmul_op d = {ye, BACKEND_F32, h, mm, down, o->w_dt, NULL, n, H, o->inter, {0}};
        if ((rc = backend_matmul(st, &d, 1))) return rc;
        if ((rc = backend_download(st, yh, ye, (size_t)n * H * sizeof(float)))) return rc;
        scatter_add(acc, yh, toks, tw, n, H);
    }
    char *outh = host_at_least(s, H_LIST, (size_t)T * H * backend_dtype_size(o->out_dt));
    if (!outh) return -ENOMEM;
    if ((rc = narrow(outh, acc, (size_t)T * H, o->out_dt))) return rc;
    return backend_upload(st, o->out, outh, (size_t)T * H * backend_dtype_size(o->out_dt));
}

int backend_moe(backend_stream *st, const backend_moe_op *o) {
    CHECK(st && o && o->x && o->ids && o->weights && o->out && o->T >= 1 && o->hidden >= 1 &&
              o->inter >= 1 && dt_ok(o->x_dt) && dt_ok(o->w_dt) && dt_ok(o->out_dt),
          "moe: bad arguments (T %d, hidden %d, inter %d)", o ? o->T : 0, o ? o->hidden : 0,
          o ? o->inter : 0);
    CHECK(o->top_k >= 1 && o->top_k <= o->n_experts && o->n_experts <= BACKEND_MOE_MAX_EXPERTS,
          "moe: top_k %d of %d experts (need 1 <= top_k <= experts <= %d)", o->top_k, o->n_experts,
          BACKEND_MOE_MAX_EXPERTS);
    CHECK((o->w_gate && o->w_up && o->w_down) || (o->w_gate_up_all && o->w_down_all),
          "moe: neither per-expert matrices (w_gate, w_up, w_down) nor stacked ones "
          "(w_gate_up_all, w_down_all)");
    CHECK(o->out != o->x, "moe: out must not be x");
    if (!backend_moe_generic(st->be)) return st->be->iface->moe(st, o);
    return moe_generic(st, o);
}
