/*
 * cpu_pool — fixed thread pool: workers sleep on a condition variable, wake on a new
 * generation, claim tasks from an atomic counter, and the last one to finish signals
 * the caller.  The caller claims tasks too, so a 1-thread pool has no workers.
 */
#include "kernels/cpu/cpu_pool.h"

#include "base/log.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

struct cpu_pool {
    int n_threads;       /* workers + the caller */
    pthread_t *workers;  /* (n_threads - 1) */
    pthread_mutex_t mu;  /* guards gen, stop, fn, ctx, n_tasks, active */
    pthread_cond_t wake; /* workers wait for a new generation */
    pthread_cond_t done; /* caller waits for active == 0 */
    unsigned long gen;   /* bumped per cpu_pool_run */
    int stop;            /* set by cpu_pool_free */
    cpu_pool_fn fn;      /* current job */
    void *ctx;           /* current job's context */
    int n_tasks;         /* current job's task count */
    atomic_int next;     /* next task to claim */
    int active;          /* workers still inside the current job */
};

static void pool_drain(cpu_pool *p) {
    for (;;) {
        int t = atomic_fetch_add(&p->next, 1);
        if (t >= p->n_tasks) break;
        p->fn(p->ctx, t);
    }
}

static void *pool_worker(void *arg) {
    cpu_pool *p = arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->gen == seen)
            pthread_cond_wait(&p->wake, &p->mu);
        if (p->stop) break;
        seen = p->gen;
        pthread_mutex_unlock(&p->mu);
        pool_drain(p);
        pthread_mutex_lock(&p->mu);
        if (--p->active == 0) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
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
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    p->active = p->n_threads - 1;
    p->gen++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    pool_drain(p);
    pthread_mutex_lock(&p->mu);
    while (p->active > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
