/*
 * collective_nccl — the device collectives of CUDA ranks through the CUDA module's NCCL
 * communicator (kernels/cuda/cuda_tp.h), behind kernels/collective.h.  The communicator runs
 * on its own stream: each collective syncs the backend's stream first and waits for NCCL
 * after (correct, not overlapped; steps with collectives are not recorded as CUDA graphs).
 * All-gather is an all-reduce of a zeroed buffer holding this rank's part at its offset:
 * every element is one rank's value plus zeros, so the result is exact.
 */
#include "base/log.h"
#include "kernels/collective.h"
#include "kernels/collective_impl.h"
#include "kernels/cuda/cuda_tp.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#define MOD "collective"

static int nccl_all_reduce(collective *c, backend_stream *st, void *buf, backend_dtype dt,
                           size_t n) {
    const dtp_api *api = c->nccl_api;
    if (dt != BACKEND_F32 && dt != BACKEND_BF16) {
        LOG_E(MOD, "NCCL all-reduce of %s: accepted float32, bfloat16", backend_dtype_name(dt));
        return -EINVAL;
    }
    int rc = st ? backend_stream_sync(st) : 0;
    if (rc) return rc;
    char err[256];
    if (api->all_reduce(c->nccl, buf, n, dt == BACKEND_F32 ? 0 : 2, NULL, err, sizeof err) ||
        api->sync(c->nccl, err, sizeof err)) {
        collective_poison(c, err);
        return -EPIPE;
    }
    c->coll_n++;
    return 0;
}

static int nccl_all_gather(collective *c, backend_stream *st, void *dst, const void *src,
                           size_t bytes) {
    if (bytes % 4) {
        LOG_E(MOD, "NCCL all-gather of %zu bytes per rank: accepted whole float32s", bytes);
        return -EINVAL;
    }
    int n = collective_size(c), rc;
    if ((rc = backend_memset_zero(st, dst, bytes * (size_t)n)) ||
        (rc = backend_copy(st, (char *)dst + bytes * (size_t)collective_rank(c), src, bytes)))
        return rc;
    return nccl_all_reduce(c, st, dst, BACKEND_F32, bytes / 4 * (size_t)n);
}

static void nccl_free(collective *c) {
    const dtp_api *api = c->nccl_api;
    if (api && c->nccl) api->comm_free(c->nccl);
    c->nccl = NULL;
}

int collective_attach_nccl(collective *c, backend *be, int device, char *err, size_t errlen) {
    const dtp_api *api = cuda_tp_load(err, errlen);
    if (!api) return -ENOENT;
    int version = 0, rc;
    if ((rc = api->load(&version, err, errlen))) return rc < 0 ? rc : -ENOENT;
    unsigned char id[DTP_ID_BYTES];
    size_t got = 0;
    if (collective_rank(c) == 0) {
        if ((rc = api->unique_id(id, err, errlen))) return rc < 0 ? rc : -EIO;
        rc = collective_send(c, id, sizeof id);
    } else {
        rc = collective_recv(c, id, sizeof id, &got);
        if (!rc && got != sizeof id) rc = -EPROTO;
    }
    if (rc) {
        snprintf(err, errlen, "tensor-parallel rank %d: the NCCL id exchange failed (%s)",
                 collective_rank(c), strerror(-rc));
        return rc;
    }
    c->nccl = api->comm_init(device, collective_size(c), collective_rank(c), id, err, errlen);
    if (!c->nccl) return -EIO;
    c->nccl_api = api;
    c->nccl_be = be;
    c->nccl_all_reduce = nccl_all_reduce;
    c->nccl_all_gather = nccl_all_gather;
    c->nccl_free = nccl_free;
    LOG_I(MOD, "rank %d of %d: NCCL %d on cuda:%d", collective_rank(c), collective_size(c), version,
          device);
    return 0;
}
