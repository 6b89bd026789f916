/*
 * cpu_pool — fixed thread pool.  Each cpu_pool_run publishes a job (on the caller's
 * stack) under the mutex; workers that wake in time join it and claim tasks from its
 * atomic counter, and the caller claims tasks too.  The caller waits for the tasks to be
 * done, not for every worker to show up: a worker descheduled by a busy machine that
 * wakes after the job finished finds no job and goes back to sleep, so it never delays
 * the caller.  Workers spin briefly before sleeping so back-to-back jobs (one per matmul
 * in a decode step) do not pay a futex wake-up each; the caller likewise polls for the
 * last tasks, and for the workers inside the job to leave it, before sleeping.
 */
#include "kernels/cpu/cpu_pool.h"

#include "base/log.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#define POOL_SPIN 20000 /* polls of the generation before a worker sleeps */

typedef struct pool_job {
    cpu_pool_fn fn;  /* task function */
    void *ctx;       /* its context */
    int n_tasks;     /* task count */
    atomic_int next; /* next task to claim */
    atomic_int done; /* tasks finished */
    atomic_int refs; /* workers inside the job (raised under mu while job is published) */
} pool_job;

struct cpu_pool {
    int n_threads;       /* workers + the caller */
    pthread_t *workers;  /* (n_threads - 1) */
    pthread_mutex_t mu;  /* guards job, stop, refs, and the condition variables */
    pthread_cond_t wake; /* workers wait for a job */
    pthread_cond_t done; /* caller waits for its job's tasks and refs */
    atomic_ulong gen;    /* bumped per published job (read without mu when spinning) */
    pool_job *job;       /* current job, NULL when none */
    int stop;            /* set by cpu_pool_free */
    int sleepers;        /* workers waiting on wake */
};

/* ---- per-thread scratch ---------------------------------------------------- */

typedef struct scratch_set {
    float *buf[CPU_SCRATCH_SLOTS]; /* buffers */
    size_t n[CPU_SCRATCH_SLOTS];   /* floats allocated */
} scratch_set;

static pthread_key_t g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;

static void scratch_destroy(void *p) {
    scratch_set *s = p;
    for (int i = 0; i < CPU_SCRATCH_SLOTS; i++)
        free(s->buf[i]);
    free(s);
}

static void scratch_key_init(void) {
    pthread_key_create(&g_scratch_key, scratch_destroy);
}

float *cpu_scratch(int slot, size_t n) {
    pthread_once(&g_scratch_once, scratch_key_init);
    scratch_set *s = pthread_getspecific(g_scratch_key);
    if (!s) {
        if (!(s = calloc(1, sizeof *s))) return NULL;
        pthread_setspecific(g_scratch_key, s);
    }
    if (s->n[slot] < n) {
        free(s->buf[slot]);
        s->buf[slot] = aligned_alloc(32, (n * sizeof(float) + 31) & ~(size_t)31);
        s->n[slot] = s->buf[slot] ? n : 0;
    }
    return s->buf[slot];
}

/* ---- pool -------------------------------------------------------------------- */

static void pool_drain(cpu_pool *p, pool_job *j) {
    for (;;) {
        int t = atomic_fetch_add(&j->next, 1);
        if (t >= j->n_tasks) break;
        j->fn(j->ctx, t);
        if (atomic_fetch_add(&j->done, 1) + 1 == j->n_tasks) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_broadcast(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

static void *pool_worker(void *arg) {
    cpu_pool *p = arg;
    unsigned long seen = 0;
    for (;;) {
        for (int i = 0; i < POOL_SPIN && atomic_load(&p->gen) == seen; i++)
            __builtin_ia32_pause();
        pthread_mutex_lock(&p->mu);
        while (!p->stop && atomic_load(&p->gen) == seen) {
            p->sleepers++;
            pthread_cond_wait(&p->wake, &p->mu);
            p->sleepers--;
        }
        if (p->stop) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        seen = atomic_load(&p->gen);
        pool_job *j = p->job;
        if (!j) { /* woke after that job finished */
            pthread_mutex_unlock(&p->mu);
            continue;
        }
        atomic_fetch_add(&j->refs, 1);
        pthread_mutex_unlock(&p->mu);
        pool_drain(p, j);
        /* j may be gone as soon as refs reaches 0 (the caller spins on it): no access after */
        if (atomic_fetch_sub(&j->refs, 1) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_broadcast(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

cpu_pool *cpu_pool_init(int n_threads) {
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    cpu_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    p->workers = calloc((size_t)n_threads, sizeof *p->workers);
    if (!p->workers) {
        free(p);
        return NULL;
    }
    for (int i = 0; i < n_threads - 1; i++) {
        if (pthread_create(&p->workers[i], NULL, pool_worker, p) != 0) {
            LOG_E("cpu_pool", "pthread_create failed for worker %d of %d", i + 1, n_threads - 1);
            p->n_threads = i + 1;
            cpu_pool_free(p);
            return NULL;
        }
    }
    return p;
}

void cpu_pool_free(cpu_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads - 1; i++)
        pthread_join(p->workers[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    free(p->workers);
    free(p);
}

int cpu_pool_threads(const cpu_pool *p) {
    return p ? p->n_threads : 1;
}

void cpu_pool_run(cpu_pool *p, int n_tasks, cpu_pool_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++)
            fn(ctx, t);
        return;
    }
    pool_job j = {.fn = fn, .ctx = ctx, .n_tasks = n_tasks};
    atomic_init(&j.next, 0);
    atomic_init(&j.done, 0);
    atomic_init(&j.refs, 0);
    pthread_mutex_lock(&p->mu);
    p->job = &j;
    atomic_fetch_add(&p->gen, 1);
    if (p->sleepers) pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    pool_drain(p, &j);
    /* the other tasks usually end within microseconds: poll before sleeping (a futex sleep
     * and wake-up per pool run costs more, and a decode step has a few per layer) */
    for (int i = 0; i < POOL_SPIN && atomic_load(&j.done) < n_tasks; i++)
        __builtin_ia32_pause();
    pthread_mutex_lock(&p->mu);
    while (atomic_load(&j.done) < n_tasks)
        pthread_cond_wait(&p->done, &p->mu);
    p->job = NULL; /* late workers find no job (refs rises only under mu with a job) */
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < POOL_SPIN && atomic_load(&j.refs) > 0; i++)
        __builtin_ia32_pause();
    if (atomic_load(&j.refs) > 0) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&j.refs) > 0)
            pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}
