/*
 * tp_worker — the loop of a tensor-parallel rank other than 0 (see tp_worker.h).
 */
#include "engine/tp_worker.h"

#include "base/log.h"
#include "kernels/backend.h"
#include "kernels/collective.h"
#include "model/decoder.h"
#include "model/tp_shard.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MOD "tp-worker"

/* The region kv (a host mapping of its backend) becomes the shared memfd kv_fd, mapped over
 * the same addresses (MAP_FIXED: the buffer keeps its pointer and size, and its free unmaps
 * the shared mapping).  rank 0 sized the memfd to exactly this region. */
static int kv_share(kv_store *kv, int kv_fd, int rank, char *err, size_t errlen) {
    size_t bytes = backend_buffer_size(kv->buf);
    struct stat sb;
    if (kv_fd < 0 || !backend_buffer_is_host(kv->buf) || fstat(kv_fd, &sb) ||
        (size_t)sb.st_size != bytes) {
        snprintf(err, errlen,
                 "rank %d: rank 0 shares KV regions, but this rank's %s (%zu bytes, memfd %d of "
                 "%lld bytes) cannot be mapped from it",
                 rank, kv_fd < 0 ? "has no memfd" : "region", bytes, kv_fd,
                 kv_fd < 0 ? 0LL : (long long)sb.st_size);
        return -EINVAL;
    }
    if (mmap(kv->base, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, kv_fd, 0) ==
        MAP_FAILED) {
        snprintf(err, errlen, "rank %d: cannot map its shared KV region: %s", rank,
                 strerror(errno));
        return -errno;
    }
    return 0;
}

int tp_worker_run(const engine_config *cfg, collective *coll, int kv_fd, char *err, size_t errlen) {
    int rank = collective_rank(coll);
    backend_options bo;
    backend_options_init(&bo);
    bo.n_threads = cfg->threads;
    bo.batch_invariant = cfg->batch_invariant;
    backend *be = NULL;
    decoder_model m;
    memset(&m, 0, sizeof m);
    kv_store kv;
    memset(&kv, 0, sizeof kv);
    decoder_state *st = NULL;
    tp_step step;
    memset(&step, 0, sizeof step);
    int rc = backend_open(cfg->device, &bo, &be, err, errlen);
    if (rc) return rc;
    if (!backend_is_cpu(be) && (rc = collective_attach_nccl(coll, be, rank, err, errlen))) goto out;
    if ((rc = decoder_load_tp(&m, cfg->model, be, 0, cfg->load_dummy, coll, err, errlen))) goto out;
    rc = tp_step_recv(coll, &step, m.cfg.vocab_size);
    if (rc != TP_MSG_INIT) {
        snprintf(err, errlen, "rank %d: expected the group's start from rank 0, got %s", rank,
                 rc < 0 ? strerror(-rc) : "another message");
        rc = rc < 0 ? rc : -EPROTO;
        goto out;
    }
    const tp_init_msg im = step.init;
    if ((rc = kv_store_init_on(&kv, be, &m.local, im.n_blocks, im.block_size,
                               (backend_dtype)im.kv_dtype, BACKEND_BUF_KV))) {
        snprintf(err, errlen, "rank %d: cannot allocate its KV cache of %d blocks on %s", rank,
                 im.n_blocks, backend_name(be));
        goto out;
    }
    if (im.kv_shared && (rc = kv_share(&kv, kv_fd, rank, err, errlen))) goto out;
    if (kv_fd >= 0) close(kv_fd);
    if (!(st = decoder_state_create(&m, im.max_tokens))) {
        snprintf(err, errlen, "rank %d: out of memory for the forward's workspace", rank);
        rc = -ENOMEM;
        goto out;
    }
    LOG_I(MOD,
          "rank %d of %d on %s: %d of %d query heads (from %d), %d KV heads (from %d), "
          "%d blocks",
          rank, m.tp->size, backend_name(be), m.tp->n_heads, m.cfg.n_heads, m.tp->head0,
          m.tp->n_kv_heads, m.tp->kv_head0, im.n_blocks);
    for (;;) {
        rc = tp_step_recv(coll, &step, m.cfg.vocab_size);
        if (rc == TP_MSG_STOP) {
            rc = 0;
            break;
        }
        if (rc != TP_MSG_STEP) {
            snprintf(err, errlen, "rank %d: the step channel failed (%s)", rank,
                     rc < 0 ? strerror(-rc) : "unexpected message");
            rc = rc < 0 ? rc : -EPROTO;
            break;
        }
        if ((rc = decoder_forward(&m, st, &kv, step.seqs, step.n_seqs))) {
            snprintf(err, errlen, "rank %d: the forward failed (%s)", rank, strerror(-rc));
            break;
        }
    }
out:
    tp_step_free(&step);
    decoder_state_free(st);
    kv_store_free(&kv);
    decoder_free(&m);
    backend_close(be);
    return rc;
}
