/*
 * tp_worker — a tensor-parallel rank other than 0 (vLLM's mp executor's worker): loads its
 * share of the model (model/tp_shard.h), makes its KV region (its KV heads; the block count
 * rank 0's engine chose) and runs, in lockstep with rank 0, the same decoder_forward for each
 * batch rank 0 sends, until rank 0 says stop or the group fails.  No scheduler, no API.
 */
#ifndef DISAGG_ENGINE_TP_WORKER_H
#define DISAGG_ENGINE_TP_WORKER_H

#include "engine/engine.h"

#include <stddef.h>

struct collective;

/* cfg: the same engine configuration rank 0 runs (the same command line); coll: the group,
 * joined as this rank; kv_fd: the memfd of its KV region when rank 0 shares it (rank 0 sizes
 * it and says so in its start message; the region is then mapped from it, so that rank 0's
 * KV connector reads and writes this rank's heads), else -1.  Returns 0 when rank 0 stopped the
 * group, else a negative errno with err saying what failed (loading, the region, a forward, the
 * group). */
int tp_worker_run(const engine_config *cfg, struct collective *coll, int kv_fd, char *err,
                  size_t errlen);

#endif
