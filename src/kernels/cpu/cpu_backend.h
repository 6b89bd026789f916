/*
 * cpu_backend — the CPU implementation of kernels/backend.h: the kernels of cpu_matmul.h
 * and the attention, normalisation and activation loops of the original forward, on f32
 * activations and KV (weights f32, f16 or bf16, used in place from the safetensors
 * mapping).  Device addresses are host pointers; buffers are host memory (the KV region an
 * anonymous mapping with transparent huge pages).  Operations run to completion on the
 * calling thread and the stream's thread pool, so backend_stream_sync() has nothing to
 * wait for.  Results are bit-identical to the original code's whatever the pool size or
 * the ISA (cpu_matmul.h "Batch-invariant numerics").
 */
#ifndef DISAGG_KERNELS_CPU_BACKEND_H
#define DISAGG_KERNELS_CPU_BACKEND_H

#include "kernels/backend.h"
#include "kernels/cpu/cpu_pool.h"

/* backend_stream_create_threads on the CPU backend be: a stream with a pool of its own
 * (n_threads 1: none, the calling thread alone; 0: one per online CPU), freed with it.
 * NULL if be is not the CPU backend or on allocation failure (logged). */
backend_stream *cpu_backend_stream_create(backend *be, int n_threads);

#endif
