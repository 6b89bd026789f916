/*
 * mask_worker — see mask_worker.h.  The rows of a step are claimed one at a time by the
 * threads (and by nobody else); a row's bitmask goes where the caller says, or into a buffer
 * of the worker's allocated once and reused, so the pointer mask_worker_add returns stays
 * valid for the step.
 */
#include "engine/mask_worker.h"

#include "base/clock.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct mask_row {
    grammar *g;              /* the row's constraint (borrowed) */
    grammar_state s;         /* its state before this step's token */
    const int32_t *stop_ids; /* (n_stop) the request's stop ids (borrowed) */
    int n_stop;
    uint32_t *dst; /* where its bitmask goes (the caller's, or bits[i]) */
} mask_row;

struct mask_worker {
    int vocab;    /* tokens a bitmask covers */
    int words;    /* (vocab + 31) / 32 */
    int32_t *eos; /* (n_eos) the model's stop tokens */
    int n_eos;
    mask_row *rows;  /* (n_rows) this step's rows */
    uint32_t **bits; /* (cap_rows) each row's bitmask (words), allocated on first use */
    int n_rows, cap_rows;

    int n_threads;       /* threads wanted */
    int n_started;       /* threads running (0 until the first overlapped step) */
    pthread_t *threads;  /* (n_threads) */
    pthread_mutex_t mu;  /* guards everything below */
    pthread_cond_t go;   /* a step was handed out, or quit */
    pthread_cond_t done; /* the last row of a step was filled */
    uint64_t gen;        /* steps handed out so far */
    int n_posted;        /* rows handed out this step (n_rows at start) */
    int next;            /* the next row to claim */
    int n_done;          /* rows filled this step */
    int quit;

    /* mask_worker_run's job: fn(ctx, i) for i < run_n (0: a mask step) */
    mask_worker_fn run_fn;
    void *run_ctx;
    int run_n;

    uint64_t fill_ns; /* this step's rows: time spent filling them */
    uint64_t wait_ns; /* and time the caller waited for them */
};

/* Row i's bitmask: the state's mask plus the stop tokens where the grammar accepts. */
static void fill_row(mask_worker *w, int i) {
    const mask_row *r = &w->rows[i];
    uint32_t *m = r->dst;
    memcpy(m, grammar_state_mask(r->g, r->s), (size_t)w->words * sizeof *m);
    if (!grammar_state_accepting(r->g, r->s)) return;
    for (int k = 0; k < w->n_eos; k++)
        if (w->eos[k] >= 0 && w->eos[k] < w->vocab) m[w->eos[k] >> 5] |= 1u << (w->eos[k] & 31);
    for (int k = 0; k < r->n_stop; k++)
        if (r->stop_ids[k] >= 0 && r->stop_ids[k] < w->vocab)
            m[r->stop_ids[k] >> 5] |= 1u << (r->stop_ids[k] & 31);
}

static void *worker_main(void *arg) {
    mask_worker *w = arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->quit && w->gen == seen)
            pthread_cond_wait(&w->go, &w->mu);
        if (w->quit) break;
        seen = w->gen;
        while (w->run_fn && w->next < w->run_n) { /* a mask_worker_run job */
            int i = w->next++;
            pthread_mutex_unlock(&w->mu);
            w->run_fn(w->run_ctx, i);
            pthread_mutex_lock(&w->mu);
            if (++w->n_done == w->run_n) pthread_cond_broadcast(&w->done);
        }
        while (!w->run_fn && w->next < w->n_posted) { /* claim rows until none is left */
            int i = w->next++;
            pthread_mutex_unlock(&w->mu);
            uint64_t t0 = clock_now_ns();
            fill_row(w, i);
            uint64_t dt = clock_now_ns() - t0;
            pthread_mutex_lock(&w->mu);
            w->fill_ns += dt;
            if (++w->n_done == w->n_posted) pthread_cond_signal(&w->done);
        }
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

mask_worker *mask_worker_new(int vocab, const int32_t *eos_ids, int n_eos, int n_threads) {
    mask_worker *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->vocab = vocab;
    w->words = (vocab + 31) / 32;
    w->n_threads = n_threads < 1 ? 1 : n_threads;
    w->eos = n_eos > 0 ? malloc((size_t)n_eos * sizeof *w->eos) : NULL;
    w->threads = calloc((size_t)w->n_threads, sizeof *w->threads);
    if ((n_eos > 0 && !w->eos) || !w->threads) {
        free(w->eos);
        free(w->threads);
        free(w);
        return NULL;
    }
    if (n_eos > 0) memcpy(w->eos, eos_ids, (size_t)n_eos * sizeof *w->eos);
    w->n_eos = n_eos > 0 ? n_eos : 0;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->go, NULL);
    pthread_cond_init(&w->done, NULL);
    return w;
}

void mask_worker_free(mask_worker *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->quit = 1;
    pthread_cond_broadcast(&w->go);
    pthread_mutex_unlock(&w->mu);
    for (int t = 0; t < w->n_started; t++)
        pthread_join(w->threads[t], NULL);
    pthread_cond_destroy(&w->done);
    pthread_cond_destroy(&w->go);
    pthread_mutex_destroy(&w->mu);
    for (int i = 0; i < w->cap_rows; i++)
        free(w->bits[i]);
    free(w->bits);
    free(w->rows);
    free(w->threads);
    free(w->eos);
    free(w);
}

void mask_worker_reset(mask_worker *w) {
    w->n_rows = 0; /* the threads read only n_posted, under mu */
}

uint32_t *mask_worker_add(mask_worker *w, grammar *g, grammar_state s, const int32_t *stop_ids,
                          int n_stop, uint32_t *dst) {
    if (w->n_rows == w->cap_rows) {
        int cap = w->cap_rows ? 2 * w->cap_rows : 16;
        mask_row *rows = realloc(w->rows, (size_t)cap * sizeof *rows);
        if (!rows) return NULL;
        w->rows = rows;
        uint32_t **bits = realloc(w->bits, (size_t)cap * sizeof *bits);
        if (!bits) return NULL;
        w->bits = bits;
        for (int i = w->cap_rows; i < cap; i++)
            bits[i] = NULL;
        w->cap_rows = cap;
    }
    int i = w->n_rows;
    if (!dst && !w->bits[i] && !(w->bits[i] = malloc((size_t)w->words * sizeof(uint32_t))))
        return NULL;
    if (!dst) dst = w->bits[i];
    w->rows[i] = (mask_row){.g = g, .s = s, .stop_ids = stop_ids, .n_stop = n_stop, .dst = dst};
    w->n_rows++;
    return dst;
}

/* Start the threads not yet running; 0 when at least one runs. */
static int start_threads(mask_worker *w) {
    while (w->n_started < w->n_threads &&
           pthread_create(&w->threads[w->n_started], NULL, worker_main, w) == 0)
        w->n_started++;
    return w->n_started > 0 ? 0 : -1;
}

void mask_worker_start(mask_worker *w, int overlap) {
    uint64_t t0 = clock_now_ns();
    pthread_mutex_lock(&w->mu); /* the threads are idle (the last step was joined) */
    w->fill_ns = 0;
    pthread_mutex_unlock(&w->mu);
    w->wait_ns = 0;
    if (w->n_rows == 0) return;
    if (!overlap || start_threads(w) != 0) {
        for (int i = 0; i < w->n_rows; i++)
            fill_row(w, i);
        pthread_mutex_lock(&w->mu);
        w->n_posted = w->next = w->n_done = w->n_rows; /* join returns at once */
        w->fill_ns = clock_now_ns() - t0;
        pthread_mutex_unlock(&w->mu);
        w->wait_ns = w->fill_ns;
        return;
    }
    pthread_mutex_lock(&w->mu);
    w->n_posted = w->n_rows;
    w->next = 0;
    w->n_done = 0;
    w->gen++;
    pthread_cond_broadcast(&w->go);
    pthread_mutex_unlock(&w->mu);
    w->wait_ns = clock_now_ns() - t0;
}

void mask_worker_join(mask_worker *w) {
    if (w->n_rows == 0) return;
    uint64_t t0 = clock_now_ns();
    pthread_mutex_lock(&w->mu);
    while (w->next < w->n_posted) { /* rows no thread has taken yet (none got a core): here */
        int i = w->next++;
        pthread_mutex_unlock(&w->mu);
        uint64_t t1 = clock_now_ns();
        fill_row(w, i);
        uint64_t dt = clock_now_ns() - t1;
        pthread_mutex_lock(&w->mu);
        w->fill_ns += dt;
        w->n_done++;
    }
    while (w->n_done < w->n_posted)
        pthread_cond_wait(&w->done, &w->mu);
    pthread_mutex_unlock(&w->mu);
    w->wait_ns += clock_now_ns() - t0;
}

void mask_worker_run(mask_worker *w, int n, mask_worker_fn fn, void *ctx) {
    if (n <= 0) return;
    if (n == 1 || start_threads(w) != 0) {
        for (int i = 0; i < n; i++)
            fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&w->mu);
    w->run_fn = fn;
    w->run_ctx = ctx;
    w->run_n = n;
    w->next = 0;
    w->n_done = 0;
    w->gen++;
    pthread_cond_broadcast(&w->go);
    while (w->next < n) { /* the caller takes items too */
        int i = w->next++;
        pthread_mutex_unlock(&w->mu);
        fn(ctx, i);
        pthread_mutex_lock(&w->mu);
        w->n_done++;
    }
    while (w->n_done < n)
        pthread_cond_wait(&w->done, &w->mu);
    w->run_fn = NULL;
    w->next = w->n_done = w->n_posted; /* a mask step's state again (all joined) */
    pthread_mutex_unlock(&w->mu);
}

void mask_worker_last(mask_worker *w, int *rows, uint64_t *fill_ns, uint64_t *wait_ns) {
    *rows = w->n_rows;
    pthread_mutex_lock(&w->mu);
    *fill_ns = w->fill_ns;
    pthread_mutex_unlock(&w->mu);
    *wait_ns = w->wait_ns;
}
