/*
 * backend_moe — backend_moe_route and backend_moe (kernels/backend.h): the arguments checked,
 * then the backend's own form (backend_impl.h's moe_route / moe).
 *
 * The moecuda branch's minimal form, for the CUDA implementation and its tests: the model
 * branch's file of this name (the generic form, DISAGG_MOE_GENERIC, the scratch) replaces it
 * at the merge.
 */
#include "kernels/backend_impl.h"

#include "base/log.h"

#include <errno.h>

#define MOD "backend"
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            LOG_E(MOD, __VA_ARGS__);                                                               \
            return -EINVAL;                                                                        \
        }                                                                                          \
    } while (0)

static int dt_ok(backend_dtype dt) {
    return backend_dtype_size(dt) != 0;
}

int backend_moe_route(backend_stream *st, int32_t *ids, float *weights, const float *logits, int T,
                      int n_experts, int top_k, int norm) {
    CHECK(st && ids && weights && logits && T >= 1 && n_experts >= 1 &&
              n_experts <= BACKEND_MOE_MAX_EXPERTS && top_k >= 1 && top_k <= n_experts,
          "moe_route: bad arguments (T %d, n_experts %d, top_k %d; need 1 <= top_k <= "
          "n_experts <= %d)",
          T, n_experts, top_k, BACKEND_MOE_MAX_EXPERTS);
    if (!st->be->iface->moe_route) return -ENOTSUP;
    return st->be->iface->moe_route(st, ids, weights, logits, T, n_experts, top_k, norm);
}

int backend_moe(backend_stream *st, const backend_moe_op *o) {
    CHECK(st && o && o->x && o->out && o->ids && o->weights && o->T >= 1 && o->hidden >= 1 &&
              o->inter >= 1 && o->n_experts >= 1 && o->n_experts <= BACKEND_MOE_MAX_EXPERTS &&
              o->top_k >= 1 && o->top_k <= o->n_experts && dt_ok(o->x_dt) && dt_ok(o->w_dt) &&
              dt_ok(o->out_dt),
          "moe: bad arguments (T %d, hidden %d, inter %d, n_experts %d, top_k %d)", o ? o->T : 0,
          o ? o->hidden : 0, o ? o->inter : 0, o ? o->n_experts : 0, o ? o->top_k : 0);
    if (!st->be->iface->moe) return -ENOTSUP;
    return st->be->iface->moe(st, o);
}
