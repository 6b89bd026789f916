/*
 * gpu_budget — the KV cache size of a GPU instance from --gpu-memory-utilization,
 * as vLLM reads the flag: this instance's budget, a fraction of the device's total
 * memory, for its own weights, activations, workspaces and KV cache.  What other
 * processes hold on the device is not charged to it (two instances on one GPU at
 * 0.45 each both start); it only has to fit in what is free.  Pure arithmetic on
 * measured figures (unit-tested on the CPU).
 */
#ifndef DISAGG_ENGINE_GPU_BUDGET_H
#define DISAGG_ENGINE_GPU_BUDGET_H

#include <stddef.h>

typedef struct gpu_budget_in {
    size_t total;       /* device memory in all */
    size_t free_before; /* free before this instance loaded anything (after its context) */
    size_t free_now;    /* free after its weights and activations */
    double utilization; /* --gpu-memory-utilization, (0, 1] */
    size_t reserve;     /* workspaces not yet allocated (cuBLASLt, attention scratch, logits) */
} gpu_budget_in;

typedef struct gpu_budget_out {
    size_t kv_bytes; /* the KV cache this instance may allocate */
    size_t own;      /* this instance's use so far: free_before - free_now */
    size_t others;   /* what else held the device when it started: total - free_before */
} gpu_budget_out;

/* KV = utilization x total - own - reserve, which must also fit in free_now - reserve.
 * Returns 0, or -1 with err saying which limit failed, with the figures (GB): the budget,
 * this instance's use, the device's free and total memory and what other processes use,
 * and the utilization that would work. */
int gpu_budget_kv(const gpu_budget_in *in, gpu_budget_out *out, char *err, size_t errlen);

#endif
