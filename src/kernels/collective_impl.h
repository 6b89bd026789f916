/*
 * collective_impl — the group handle shared by collective_shm.c (the segment, the step
 * channel, the CPU collectives) and collective_nccl.c (the device collectives of CUDA ranks).
 * Private to kernels/.
 */
#ifndef DISAGG_KERNELS_COLLECTIVE_IMPL_H
#define DISAGG_KERNELS_COLLECTIVE_IMPL_H

#include "kernels/collective.h"

#include <stdint.h>

struct coll_header;

struct collective {
    struct coll_header *h; /* the shared segment */
    int fd;                /* its memfd */
    int rank;              /* this process's rank, -1 before collective_join */
    uint64_t calls;        /* collectives made: the slot set of the next is calls % 2 */
    uint32_t msg_seen;     /* the step message sequence last received */
    int said_poison;       /* the group's failure was logged here */
    double coll_s;         /* seconds in collectives */
    long coll_n;           /* collectives made */
    void *scratch;         /* NCCL: host scratch of the unique id exchange */
    /* CUDA ranks (collective_attach_nccl): the device collectives, else NULL */
    void *nccl;           /* the module's dtp_comm */
    const void *nccl_api; /* its dtp_api */
    backend *nccl_be;     /* the backend whose buffers they take */
    int (*nccl_all_reduce)(collective *c, backend_stream *st, void *buf, backend_dtype dt,
                           size_t n);
    int (*nccl_all_gather)(collective *c, backend_stream *st, void *dst, const void *src,
                           size_t bytes);
    void (*nccl_free)(collective *c);
};

#endif
