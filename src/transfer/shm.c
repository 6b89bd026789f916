/* shm — see shm.h. */
#include "transfer/shm.h"

#include "base/clock.h"
#include "disagg/transfer.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/uio.h>

#define INLINE_MAX (64u << 10) /* ops up to this size run in the submitting thread */

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
    struct transfer_engine *e;
    shm_refused_fn refused;
    void *ctx;
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
        if (engine_op_canceled(op))
            engine_op_done(p->e, op, TRANSFER_ECANCELED);
        else if (now >= op->deadline_ns)
            engine_op_done(p->e, op, TRANSFER_ETIMEDOUT);
        else if (n < SHM_GROUP_OPS) {
            v[n] = op;
            li[n] = (struct iovec){op->local, op->len};
            ri[n] = (struct iovec){(void *)(uintptr_t)op->remote, op->len};
            n++;
        } else {
            engine_op_done(p->e, op, shm_copy(pid, op->opcode, op->local, op->remote, op->len));
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
            if (rc == TRANSFER_EPERM && p->refused) {
                for (; i < n; i++)
                    p->refused(p->ctx, v[i]);
                return;
            }
            engine_op_done(p->e, v[i++], rc);
            continue;
        }
        size_t left = (size_t)got;
        while (i < n && left >= li[i].iov_len) {
            left -= li[i].iov_len;
            engine_op_done(p->e, v[i++], 0);
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

int shm_pool_create(struct transfer_engine *e, int nthreads, shm_refused_fn refused, void *ctx,
                    shm_pool **out) {
    shm_pool *p = calloc(1, sizeof *p);
    if (!p) return TRANSFER_ENOMEM;
    p->e = e;
    p->refused = refused;
    p->ctx = ctx;
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
