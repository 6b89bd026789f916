/*
 * tp_launch — `disagg serve -tp N`'s processes, as vLLM's mp executor lays them out: this
 * process is rank 0 (the engine front: scheduler and API) and spawns ranks 1..N-1, each the
 * same command line re-executed (/proc/self/exe, /proc/self/cmdline) with
 * DISAGG_TP_WORKER=<rank>:<fd>[:<kv_fd>] in its environment (fd: the group's shared segment,
 * kernels/collective.h; kv_fd: an empty memfd for the rank's KV region, given when the region
 * is shared with rank 0 for P/D, engine.h tp_kv_fds), which makes that `disagg serve` a worker
 * (engine/tp_worker.h) instead of a server.  A worker dies with rank 0 (PR_SET_PDEATHSIG); a worker
 * that exits while the server runs fails the group and stops the server (SIGTERM to itself) with
 * its exit status logged, so nothing hangs on a missing rank.
 */
#ifndef DISAGG_CLI_TP_LAUNCH_H
#define DISAGG_CLI_TP_LAUNCH_H

#include <stddef.h>

struct collective;

#define TP_LAUNCH_ENV "DISAGG_TP_WORKER"

/* Rank 0: makes the group of n ranks and starts the workers and their watcher.  share_kv:
 * also make one empty memfd per worker for its KV region (tp_launch_kv_fds), which rank 0
 * sizes and maps too (the KV connector moves every rank's heads from rank 0's process).
 * 0, or a negative errno with err. */
int tp_launch_start(int n, int share_kv, struct collective **out, char *err, size_t errlen);
/* The KV memfds of tp_launch_start(share_kv = 1), indexed by rank (entry 0 is -1), or NULL. */
const int *tp_launch_kv_fds(void);
/* After the engine sent its workers stop (abort: rank 0 stops without that, e.g. a failure
 * before serving: the group is failed first so the workers leave): waits (up to 10 s, then
 * SIGKILL) for them and frees the group.  Returns 1 when the group failed while serving (a
 * worker died), else 0. */
int tp_launch_stop(struct collective *c, int abort);

/* In a worker: 1 and its rank, the group's descriptor and its KV memfd (-1: none) when
 * DISAGG_TP_WORKER is set and well formed; 0 when unset; -1 when malformed (err says why). */
int tp_launch_worker_env(int *rank, int *fd, int *kv_fd, char *err, size_t errlen);

#endif
