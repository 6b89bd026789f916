/*
 * gpu_budget — --gpu-memory-utilization as a per-instance budget (see gpu_budget.h).
 */
#include "engine/gpu_budget.h"

#include <math.h>
#include <stdio.h>

#define GB(x) ((double)(x) / 1e9)

int gpu_budget_kv(const gpu_budget_in *in, gpu_budget_out *out, char *err, size_t errlen) {
    out->kv_bytes = 0;
    out->own = in->free_before > in->free_now ? in->free_before - in->free_now : 0;
    out->others = in->total > in->free_before ? in->total - in->free_before : 0;
    double budget = (double)in->total * in->utilization;
    double need = (double)out->own + (double)in->reserve; /* before any KV block */
    if (budget <= need) {
        double min_util = in->total ? ceil(need / (double)in->total * 100) / 100 : 1.0;
        snprintf(err, errlen,
                 "--gpu-memory-utilization %.2f gives this instance %.2f GB of the device's "
                 "%.2f GB, but its weights and activations take %.2f GB and its workspaces "
                 "%.2f GB, leaving nothing for the KV cache; raise it above %.2f (the device has "
                 "%.2f GB free; other processes use %.2f GB)",
                 in->utilization, GB(budget), GB(in->total), GB(out->own), GB(in->reserve),
                 min_util, GB(in->free_now), GB(out->others));
        return -1;
    }
    double kv = budget - need;
    double room = in->free_now > in->reserve ? (double)(in->free_now - in->reserve) : 0.0;
    if (kv > room) {
        double max_util = in->total ? floor((need + room) / (double)in->total * 100) / 100 : 0.0;
        snprintf(err, errlen,
                 "--gpu-memory-utilization %.2f gives this instance %.2f GB of the device's "
                 "%.2f GB, but only %.2f GB are free (other processes use %.2f GB, this "
                 "instance %.2f GB): its KV cache of %.2f GB does not fit; lower it to at most "
                 "%.2f, or free the device",
                 in->utilization, GB(budget), GB(in->total), GB(in->free_now), GB(out->others),
                 GB(out->own), kv / 1e9, max_util);
        return -1;
    }
    out->kv_bytes = (size_t)kv;
    return 0;
}
