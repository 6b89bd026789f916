/* shm — see shm.h. */
#include "transfer/shm.h"

#include "base/clock.h"
#include "base/log.h"
#include "disagg/transfer.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/uio.h>

#define INLINE_MAX  (64u << 10) /* ops up to this size run in the submitting thread */
#define SHM_STRIPE  (4u << 20)  /* chunk bytes */
#define SHM_THREADS 2           /* workers */

static int map_errno(int e) {
    if (e == EPERM || e == ENOSYS) return TRANSFER_EPERM;
    if (e == ESRCH) return TRANSFER_ECONN;
    if (e == EFAULT) return TRANSFER_EREMOTEADDR;
    return TRANSFER_ESYS;
}

int shm_copy(pid_t pid, int opcode, void *local, uint64_t remote, size_t len) {
    if (len == 0) return 0;
    char *l = local;
    while (len > 0) {
        struct iovec li = {l, len}, ri = {(void *)(uintptr_t)remote, len};
        ssize_t n = opcode == TRANSFER_WRITE ? process_vm_writev(pid, &li, 1, &ri, 1, 0)
                                             : process_vm_readv(pid, &li, 1, &ri, 1, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            return map_errno(errno);
        }
        if (n == 0) return TRANSFER_EREMOTEADDR;
        l += n;
        remote += (uint64_t)n;
        len -= (size_t)n;
    }
    return 0;
}

typedef struct shm_job {
    xfer_op *ops; /* a group: same pid and opcode, linked by next */
    pid_t pid;
    struct shm_job *next;
} shm_job;

struct shm_pool {
    const xfer_sink *sink;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    shm_job *head, *tail;
    int stop;
    int nthreads;
    pthread_t *threads;
};

/* Run a group of ops with as few process_vm_* calls as possible (one when
 * nothing fails): every op is one local and one remote iovec of equal length. */
static void run_group(shm_pool *p, xfer_op *ops, pid_t pid) {
    struct iovec li[SHM_GROUP_OPS], ri[SHM_GROUP_OPS];
    xfer_op *v[SHM_GROUP_OPS];
    int n = 0;
    uint64_t now = clock_now_ns();
    while (ops) {
        xfer_op *op = ops;
        ops = op->next;
        if (xfer_op_canceled(op))
            xfer_done(p->sink, op, TRANSFER_ECANCELED);
        else if (now >= op->deadline_ns)
            xfer_done(p->sink, op, TRANSFER_ETIMEDOUT);
        else if (n < SHM_GROUP_OPS) {
            v[n] = op;
            li[n] = (struct iovec){op->local, op->len};
            ri[n] = (struct iovec){(void *)(uintptr_t)op->remote, op->len};
            n++;
        } else {
            xfer_done(p->sink, op, shm_copy(pid, op->opcode, op->local, op->remote, op->len));
        }
    }
    int i = 0;
    while (i < n) {
        ssize_t got = v[i]->opcode == TRANSFER_WRITE
                          ? process_vm_writev(pid, li + i, (unsigned long)(n - i), ri + i,
                                              (unsigned long)(n - i), 0)
                          : process_vm_readv(pid, li + i, (unsigned long)(n - i), ri + i,
                                             (unsigned long)(n - i), 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) { /* the op at i failed (a partial first op returns > 0 instead) */
            int rc = got < 0 ? map_errno(errno) : TRANSFER_EREMOTEADDR;
            if (rc == TRANSFER_EPERM && p->sink->reroute) {
                for (; i < n; i++)
                    p->sink->reroute(p->sink->ctx, v[i], rc);
                return;
            }
            xfer_done(p->sink, v[i++], rc);
            continue;
        }
        size_t left = (size_t)got;
        while (i < n && left >= li[i].iov_len) {
            left -= li[i].iov_len;
            xfer_done(p->sink, v[i++], 0);
        }
        if (left > 0) { /* partial op: continue where it stopped */
            li[i].iov_base = (char *)li[i].iov_base + left;
            li[i].iov_len -= left;
            ri[i].iov_base = (char *)ri[i].iov_base + left;
            ri[i].iov_len -= left;
        }
    }
}

static void *worker_main(void *arg) {
    shm_pool *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->stop)
            pthread_cond_wait(&p->cv, &p->mu);
        if (!p->head) break;
        shm_job *j = p->head;
        p->head = j->next;
        if (!p->head) p->tail = NULL;
        pthread_mutex_unlock(&p->mu);
        run_group(p, j->ops, j->pid);
        free(j);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int shm_pool_create(const xfer_sink *sink, int nthreads, shm_pool **out) {
    shm_pool *p = calloc(1, sizeof *p);
    if (!p) return TRANSFER_ENOMEM;
    p->sink = sink;
    p->nthreads = nthreads > 0 ? nthreads : 1;
    p->threads = calloc((size_t)p->nthreads, sizeof *p->threads);
    if (!p->threads) {
        free(p);
        return TRANSFER_ENOMEM;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    for (int i = 0; i < p->nthreads; i++)
        pthread_create(&p->threads[i], NULL, worker_main, p);
    *out = p;
    return 0;
}

void shm_pool_submit(shm_pool *p, xfer_op *ops, size_t bytes, pid_t pid) {
    shm_job *j = bytes > INLINE_MAX ? malloc(sizeof *j) : NULL;
    if (!j) { /* small (or no memory for a job): run here */
        run_group(p, ops, pid);
        return;
    }
    j->ops = ops;
    j->pid = pid;
    j->next = NULL;
    pthread_mutex_lock(&p->mu);
    if (p->tail)
        p->tail->next = j;
    else
        p->head = j;
    p->tail = j;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void shm_pool_destroy(shm_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1; /* workers drain the queue first: queued ops end normally */
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nthreads; i++)
        pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p);
}

/* ---- the transport interface (transport.h) -------------------------------- */

typedef struct shm_conn {
    pid_t pid;
} shm_conn;

/* Same host, host memory on both sides (process_vm_* cannot reach device
 * memory), and the range must be in the peer's descriptor (the transfer engine checks
 * that before routing here). */
static int shm_can_reach(const transport *t, const transport_peer *p, const char *local_loc,
                         const registry_entry *remote) {
    (void)t;
    return p->same_host && p->desc->pid > 0 && !location_is_device(local_loc) && remote &&
           !location_is_device(remote->location) && remote_reachable(remote, REACH_SHM);
}

static int shm_open_peer(transport *t, const transport_peer *p, void **conn) {
    (void)t;
    shm_conn *c = malloc(sizeof *c);
    if (!c) return TRANSFER_ENOMEM;
    c->pid = (pid_t)p->desc->pid;
    *conn = c;
    return 0;
}

/* Consecutive ops of one opcode travel in groups (one vectored
 * process_vm_* call each). */
static void shm_submit(transport *t, void *conn, xfer_op *ops) {
    shm_pool *p = t->state;
    pid_t pid = ((shm_conn *)conn)->pid;
    xfer_op *g_head = NULL, *g_tail = NULL;
    size_t g_n = 0, g_bytes = 0;
    while (ops) {
        xfer_op *op = ops;
        ops = op->next;
        op->next = NULL;
        if (g_head && (g_head->opcode != op->opcode || g_n == SHM_GROUP_OPS ||
                       g_bytes + op->len > SHM_GROUP_BYTES)) {
            shm_pool_submit(p, g_head, g_bytes, pid);
            g_head = NULL;
        }
        if (!g_head) {
            g_head = g_tail = op;
            g_n = 0;
            g_bytes = 0;
        } else {
            g_tail->next = op;
            g_tail = op;
        }
        g_n++;
        g_bytes += op->len;
    }
    if (g_head) shm_pool_submit(p, g_head, g_bytes, pid);
}

static void shm_close_peer(transport *t, void *conn) {
    (void)t;
    free(conn);
}

static void shm_destroy(transport *t) {
    if (!t) return;
    shm_pool_destroy(t->state);
    free(t);
}

static int shm_create(const transport_env *env, transport **out);

/* Preferred on the same host unless tcp or rdma was asked for; protocol
 * shm refuses a peer on another host. */
static int shm_prefer(const transport *t, const transport_peer *p) {
    transfer_protocol proto = t->env->protocol;
    if (proto == TRANSFER_PROTO_SHM && !p->same_host) {
        LOG_E("transfer", "segment %s is on another host; protocol shm needs the same host",
              p->name);
        return TRANSFER_ENOSEG;
    }
    return proto != TRANSFER_PROTO_TCP && proto != TRANSFER_PROTO_RDMA && p->same_host;
}

/* Every host-memory buffer is reachable by process_vm_*. */
static void shm_describe(transport *t, const registry *regs, segment_desc *d) {
    (void)t;
    (void)regs;
    for (size_t i = 0; i < d->buffers.n; i++)
        if (!location_is_device(d->buffers.v[i].location)) d->buffers.v[i].reach |= REACH_SHM;
}

const transport_ops shm_transport_ops = {
    .name = "shm",
    .proto = TRANSFER_PROTO_SHM,
    .create = shm_create,
    .prefer = shm_prefer,
    .describe = shm_describe,
    .reroute_why = "the kernel refused process_vm_writev/readv (ptrace policy)",
    .can_reach = shm_can_reach,
    .open_peer = shm_open_peer,
    .submit = shm_submit,
    .close_peer = shm_close_peer,
    .destroy = shm_destroy,
};

int shm_transport_create(const xfer_sink *sink, int nthreads, size_t stripe, transport **out) {
    transport *t = calloc(1, sizeof *t);
    if (!t) return TRANSFER_ENOMEM;
    t->ops = &shm_transport_ops;
    t->sink = sink;
    t->stripe = stripe;
    int rc = shm_pool_create(sink, nthreads, (shm_pool **)&t->state);
    if (rc) {
        free(t);
        return rc;
    }
    *out = t;
    return 0;
}

/* The table's entry: the peer's descriptor must list a request's range
 * (the target's threads are not involved, so nothing else checks it). */
static int shm_create(const transport_env *env, transport **out) {
    int rc = shm_transport_create(env->sink, SHM_THREADS, SHM_STRIPE, out);
    if (rc == 0) {
        (*out)->env = env;
        (*out)->flags = TRANSPORT_REFETCH | TRANSPORT_RANGE_CHECK;
    }
    return rc;
}
