/*
 * cpu_pool — a small fixed thread pool for the CPU kernels.  cpu_pool_run() splits
 * n_tasks among the workers and the calling thread (tasks are claimed from an atomic
 * counter) and returns when all are done.  Which thread runs a task never changes a
 * result: kernels give each task a disjoint slice of the output.
 */
#ifndef DISAGG_KERNELS_CPU_POOL_H
#define DISAGG_KERNELS_CPU_POOL_H

#include <stddef.h>

typedef struct cpu_pool cpu_pool;

/* fn(ctx, task): run one task, 0 <= task < n_tasks. */
typedef void (*cpu_pool_fn)(void *ctx, int task);

/* n_threads <= 0: one per online CPU.  Returns NULL on failure (logged). */
cpu_pool *cpu_pool_init(int n_threads);
void cpu_pool_free(cpu_pool *p);
int cpu_pool_threads(const cpu_pool *p);
/* Runs fn for every task in [0, n_tasks); p may be NULL (runs inline). Not reentrant. */
void cpu_pool_run(cpu_pool *p, int n_tasks, cpu_pool_fn fn, void *ctx);

/* Per-thread scratch buffer `slot` (0..CPU_SCRATCH_SLOTS-1) of at least n floats, 32-byte
 * aligned, kept for the thread's life (freed at thread exit).  NULL if out of memory. */
#define CPU_SCRATCH_SLOTS 5
float *cpu_scratch(int slot, size_t n);

#endif
