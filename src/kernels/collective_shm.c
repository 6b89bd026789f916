/*
 * collective_shm — kernels/collective.h over one shared-memory segment (a memfd mapped
 * MAP_SHARED by every rank): a sense-reversing barrier on a futex, double-buffered slots
 * for the collectives (call k uses set k % 2, so one barrier per collective suffices: a
 * rank writing set k % 2 again at call k + 2 has passed call k + 1's barrier, which every
 * rank reached only after reading call k's slots), a one-message step channel, and one
 * robust mutex per rank whose owner's death any waiter can see.
 */
#include "kernels/collective.h"

#include "base/log.h"
#include "kernels/collective_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MOD        "collective"
#define COLL_MAGIC 0x434f4c4cu /* "COLL" */

typedef struct coll_header {
    uint32_t magic;               /* COLL_MAGIC */
    int n_ranks;                  /* group size */
    size_t slot_bytes, msg_bytes; /* per-rank slot, step message capacity */
    size_t seg_bytes;             /* the whole mapping */
    _Atomic uint32_t bar_count;   /* arrivals at the current barrier */
    _Atomic uint32_t bar_gen;     /* barrier generation (futex word) */
    _Atomic uint32_t poisoned;    /* 1: the group failed (futex word too: wakes waiters) */
    char poison_what[256];        /* why */
    _Atomic int joined[COLLECTIVE_MAX_RANKS];    /* 1 once rank r holds alive[r] */
    pthread_mutex_t alive[COLLECTIVE_MAX_RANKS]; /* robust: held by rank r while it lives */
    _Atomic uint32_t msg_seq;                    /* step messages sent (futex word) */
    _Atomic uint32_t msg_acks;                   /* ranks that took the current one (futex word) */
    size_t msg_len;                              /* bytes of the current message */
} coll_header;

static size_t hdr_bytes(void) {
    return (sizeof(coll_header) + 4095) & ~(size_t)4095;
}

static unsigned char *slot_of(collective *c, int set, int rank) {
    coll_header *h = c->h;
    return (unsigned char *)c->h + hdr_bytes() +
           ((size_t)set * (size_t)h->n_ranks + (size_t)rank) * h->slot_bytes;
}

static unsigned char *msg_area(collective *c) {
    coll_header *h = c->h;
    return (unsigned char *)c->h + hdr_bytes() + 2 * (size_t)h->n_ranks * h->slot_bytes;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t val, long ns) {
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void collective_poison(collective *c, const char *what) {
    coll_header *h = c->h;
    uint32_t z = 0;
    if (atomic_compare_exchange_strong(&h->poisoned, &z, 1)) {
        snprintf(h->poison_what, sizeof h->poison_what, "%s", what);
        LOG_E(MOD, "tensor-parallel group failed: %s", what);
    }
    /* everyone waiting anywhere wakes and sees the flag */
    atomic_fetch_add(&h->bar_gen, 0x10000u);
    futex_wake(&h->bar_gen);
    atomic_fetch_add(&h->msg_seq, 0x10000u);
    futex_wake(&h->msg_seq);
    futex_wake(&h->msg_acks);
}

int collective_poisoned(const collective *c) {
    return atomic_load(&c->h->poisoned) != 0;
}

/* -EPIPE when the group failed or a peer is gone (then the group is poisoned) */
static int check_peers(collective *c) {
    coll_header *h = c->h;
    if (atomic_load(&h->poisoned)) {
        if (!c->said_poison) {
            c->said_poison = 1;
            LOG_E(MOD, "rank %d: %s", c->rank, h->poison_what);
        }
        return -EPIPE;
    }
    for (int p = 0; p < h->n_ranks; p++) {
        if (p == c->rank || !atomic_load(&h->joined[p])) continue;
        int rc = pthread_mutex_trylock(&h->alive[p]);
        if (rc == EBUSY) continue;
        if (rc == EOWNERDEAD) pthread_mutex_consistent(&h->alive[p]);
        if (rc == 0 || rc == EOWNERDEAD) pthread_mutex_unlock(&h->alive[p]);
        char what[128];
        snprintf(what, sizeof what, "tensor-parallel rank %d %s", p,
                 rc == EOWNERDEAD ? "died" : "left the group");
        atomic_store(&h->joined[p], 0);
        collective_poison(c, what);
        c->said_poison = 1;
        return -EPIPE;
    }
    return 0;
}

/* Waits until *word != val: a short spin, then futex sleeps of 50 ms checking the peers. */
static int wait_change(collective *c, _Atomic uint32_t *word, uint32_t val) {
    for (int i = 0; i < 4000; i++) {
        if (atomic_load_explicit(word, memory_order_acquire) != val) return 0;
        __builtin_ia32_pause();
    }
    for (;;) {
        if (atomic_load_explicit(word, memory_order_acquire) != val) return 0;
        int rc = check_peers(c);
        if (rc) return rc;
        futex_wait(word, val, 50L * 1000 * 1000);
    }
}

static int barrier(collective *c) {
    coll_header *h = c->h;
    if (atomic_load(&h->poisoned)) return check_peers(c);
    uint32_t gen = atomic_load_explicit(&h->bar_gen, memory_order_acquire);
    if (atomic_fetch_add(&h->bar_count, 1) == (uint32_t)h->n_ranks - 1) {
        atomic_store(&h->bar_count, 0);
        atomic_fetch_add_explicit(&h->bar_gen, 1, memory_order_release);
        futex_wake(&h->bar_gen);
        return atomic_load(&h->poisoned) ? check_peers(c) : 0;
    }
    int rc = wait_change(c, &h->bar_gen, gen);
    return rc ? rc : atomic_load(&h->poisoned) ? check_peers(c) : 0;
}

/* ---- group -------------------------------------------------------------------------- */

static int map_segment(int fd, size_t bytes, collective **out, char *err, size_t errlen) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "cannot map the tensor-parallel segment (%zu bytes): %s", bytes,
                 strerror(errno));
        return -errno;
    }
    collective *c = calloc(1, sizeof *c);
    if (!c) {
        munmap(p, bytes);
        return -ENOMEM;
    }
    c->h = p;
    c->fd = fd;
    c->rank = -1;
    *out = c;
    return 0;
}

int collective_create(int n_ranks, size_t slot_bytes, size_t msg_bytes, collective **out, char *err,
                      size_t errlen) {
    *out = NULL;
    if (n_ranks < 2 || n_ranks > COLLECTIVE_MAX_RANKS || !slot_bytes || !msg_bytes) {
        snprintf(err, errlen, "tensor-parallel group of %d ranks: accepted 2..%d", n_ranks,
                 COLLECTIVE_MAX_RANKS);
        return -EINVAL;
    }
    slot_bytes = (slot_bytes + 63) & ~(size_t)63;
    size_t bytes = hdr_bytes() + 2 * (size_t)n_ranks * slot_bytes + msg_bytes;
    int fd = memfd_create("disagg-tp", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) {
        snprintf(err, errlen, "cannot make the tensor-parallel segment (%zu bytes): %s", bytes,
                 strerror(errno));
        if (fd >= 0) close(fd);
        return -ENOMEM;
    }
    int rc = map_segment(fd, bytes, out, err, errlen);
    if (rc) {
        close(fd);
        return rc;
    }
    coll_header *h = (*out)->h;
    h->n_ranks = n_ranks;
    h->slot_bytes = slot_bytes;
    h->msg_bytes = msg_bytes;
    h->seg_bytes = bytes;
    atomic_store(&h->msg_acks, (uint32_t)n_ranks - 1);
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    for (int r = 0; r < COLLECTIVE_MAX_RANKS; r++)
        pthread_mutex_init(&h->alive[r], &a);
    pthread_mutexattr_destroy(&a);
    h->magic = COLL_MAGIC;
    return 0;
}

int collective_open(int fd, collective **out, char *err, size_t errlen) {
    *out = NULL;
    coll_header probe;
    if (pread(fd, &probe, sizeof probe, 0) != (ssize_t)sizeof probe || probe.magic != COLL_MAGIC) {
        snprintf(err, errlen, "descriptor %d is not a tensor-parallel segment", fd);
        return -EINVAL;
    }
    return map_segment(fd, probe.seg_bytes, out, err, errlen);
}

int collective_fd(const collective *c) {
    return c->fd;
}

int collective_join(collective *c, int rank) {
    coll_header *h = c->h;
    if (rank < 0 || rank >= h->n_ranks || c->rank >= 0) return -EINVAL;
    int rc = pthread_mutex_trylock(&h->alive[rank]);
    if (rc == EOWNERDEAD)
        pthread_mutex_consistent(&h->alive[rank]);
    else if (rc)
        return -EINVAL; /* held: the rank is taken */
    c->rank = rank;
    atomic_store(&h->joined[rank], 1);
    return 0;
}

void collective_free(collective *c) {
    if (!c) return;
    if (c->nccl_free) c->nccl_free(c);
    free(c->scratch);
    if (c->rank >= 0) {
        atomic_store(&c->h->joined[c->rank], 0);
        pthread_mutex_unlock(&c->h->alive[c->rank]);
    }
    munmap(c->h, c->h->seg_bytes);
    close(c->fd);
    free(c);
}

int collective_rank(const collective *c) {
    return c->rank;
}
int collective_size(const collective *c) {
    return c->h->n_ranks;
}
size_t collective_slot_bytes(const collective *c) {
    return c->h->slot_bytes;
}

size_t collective_msg_bytes(const collective *c) {
    return c->h->msg_bytes;
}

void collective_stats(const collective *c, double *seconds, long *calls) {
    if (seconds) *seconds = c->coll_s;
    if (calls) *calls = c->coll_n;
}

/* ---- collectives ------------------------------------------------------------------- */

int collective_all_reduce(collective *c, backend_stream *st, void *buf, backend_dtype dt,
                          size_t n) {
    if (c->nccl_all_reduce) return c->nccl_all_reduce(c, st, buf, dt, n);
    coll_header *h = c->h;
    if (dt != BACKEND_F32 || n * 4 > h->slot_bytes || c->rank < 0) {
        LOG_E(MOD, "all-reduce of %zu elements of %s: accepted float32, at most %zu", n,
              backend_dtype_name(dt), h->slot_bytes / 4);
        return -EINVAL;
    }
    int rc = st ? backend_stream_sync(st) : 0;
    if (rc) return rc;
    double t0 = now_s();
    int set = (int)(c->calls++ & 1);
    memcpy(slot_of(c, set, c->rank), buf, n * 4);
    if ((rc = barrier(c))) return rc;
    /* rank 0 + rank 1 + ... in order, the same on every rank */
    float *out = buf;
    const float *s0 = (const float *)slot_of(c, set, 0);
    memcpy(out, s0, n * 4);
    for (int r = 1; r < h->n_ranks; r++) {
        const float *s = (const float *)slot_of(c, set, r);
        for (size_t i = 0; i < n; i++)
            out[i] += s[i];
    }
    c->coll_s += now_s() - t0;
    c->coll_n++;
    return 0;
}

int collective_all_gather(collective *c, backend_stream *st, void *dst, const void *src,
                          size_t bytes) {
    if (c->nccl_all_gather) return c->nccl_all_gather(c, st, dst, src, bytes);
    coll_header *h = c->h;
    if (bytes > h->slot_bytes || c->rank < 0) {
        LOG_E(MOD, "all-gather of %zu bytes per rank: at most %zu", bytes, h->slot_bytes);
        return -EINVAL;
    }
    int rc = st ? backend_stream_sync(st) : 0;
    if (rc) return rc;
    double t0 = now_s();
    int set = (int)(c->calls++ & 1);
    memcpy(slot_of(c, set, c->rank), src, bytes);
    if ((rc = barrier(c))) return rc;
    for (int r = 0; r < h->n_ranks; r++)
        memcpy((char *)dst + (size_t)r * bytes, slot_of(c, set, r), bytes);
    c->coll_s += now_s() - t0;
    c->coll_n++;
    return 0;
}

/* ---- the step channel --------------------------------------------------------------- */

int collective_send(collective *c, const void *msg, size_t n) {
    coll_header *h = c->h;
    if (n > h->msg_bytes) {
        LOG_E(MOD, "step message of %zu bytes: the channel holds %zu", n, h->msg_bytes);
        return -EMSGSIZE;
    }
    for (;;) { /* every rank took the previous one */
        uint32_t a = atomic_load_explicit(&h->msg_acks, memory_order_acquire);
        if (a == (uint32_t)h->n_ranks - 1) break;
        int rc = wait_change(c, &h->msg_acks, a);
        if (rc) return rc;
    }
    int rc = check_peers(c);
    if (rc) return rc;
    memcpy(msg_area(c), msg, n);
    h->msg_len = n;
    atomic_store(&h->msg_acks, 0);
    atomic_fetch_add_explicit(&h->msg_seq, 1, memory_order_release);
    futex_wake(&h->msg_seq);
    return 0;
}

int collective_recv(collective *c, void *msg, size_t cap, size_t *n) {
    coll_header *h = c->h;
    int rc = wait_change(c, &h->msg_seq, c->msg_seen);
    if (rc) return rc;
    if (atomic_load(&h->poisoned)) return check_peers(c);
    c->msg_seen = atomic_load_explicit(&h->msg_seq, memory_order_acquire);
    if (h->msg_len > cap) {
        LOG_E(MOD, "step message of %zu bytes: room for %zu", h->msg_len, cap);
        return -EMSGSIZE;
    }
    memcpy(msg, msg_area(c), h->msg_len);
    *n = h->msg_len;
    atomic_fetch_add_explicit(&h->msg_acks, 1, memory_order_release);
    futex_wake(&h->msg_acks);
    return 0;
}
