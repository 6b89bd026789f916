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

/* A stream of the CPU backend be that runs its work on pool (borrowed: it must outlive
 * the stream; NULL: on the calling thread alone), instead of the backend's own pool.
 * NULL if be is not the CPU backend or on allocation failure (logged). */
backend_stream *cpu_backend_stream_create(backend *be, cpu_pool *pool);

#endif
