/*
 * prep — request preparation off the event loop.  Parsing the JSON of a
 * 30 MB prompt and tokenizing it takes about a second; done on the loop, it
 * would stall every other connection (/health included) for that long.  A
 * request whose body is at least PREP_INLINE_MAX bytes is handed, with its
 * body, to one preparation thread; the loop gets it back through a queue and
 * an event, and carries on (generation, or the error reply).  Smaller bodies
 * are prepared on the loop as before: no thread hop for the common case.
 *
 * While a job is away, the request's close callback marks it detached (the
 * HTTP request is freed by base/http_server then); the loop frees the job's
 * own data when it comes back.  The tokenizer is thread-safe (its word
 * cache has a mutex); the chat template and the request parser keep no state.
 */
#include "server/server_ctx.h"

#include "base/http_server.h"
#include "base/log.h"

#include <event2/buffer.h>
#include <event2/event.h>
#include <stdlib.h>
#include <string.h>

struct prep {
    server *s;           /* owner */
    pthread_t thread;    /* the preparation thread */
    int started;         /* thread running */
    pthread_mutex_t mu;  /* guards the queues and stop */
    pthread_cond_t cv;   /* a job was queued, or stop */
    prep_job *todo_head; /* jobs for the thread, FIFO */
    prep_job *todo_tail;
    prep_job *done_head; /* jobs back for the loop, FIFO */
    prep_job *done_tail;
    int stop;              /* the thread must exit */
    struct event *done_ev; /* activated when a job is done */
    prep_job *away;        /* every job not yet finished on the loop (list by all_next) */
};

static void *prep_main(void *arg) {
    prep *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && !p->todo_head)
            pthread_cond_wait(&p->cv, &p->mu);
        if (p->stop) break;
        prep_job *j = p->todo_head;
        p->todo_head = j->next;
        if (!p->todo_head) p->todo_tail = NULL;
        pthread_mutex_unlock(&p->mu);
        size_t len = evbuffer_get_length(j->body);
        const char *body = len ? (const char *)evbuffer_pullup(j->body, -1) : "";
        j->work(j, body ? body : "", body ? len : 0);
        evbuffer_free(j->body);
        j->body = NULL;
        pthread_mutex_lock(&p->mu);
        j->next = NULL;
        if (p->done_tail)
            p->done_tail->next = j;
        else
            p->done_head = j;
        p->done_tail = j;
        event_active(p->done_ev, EV_READ, 0);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void job_forget(prep *p, prep_job *j) {
    for (prep_job **pp = &p->away; *pp; pp = &(*pp)->all_next)
        if (*pp == j) {
            *pp = j->all_next;
            return;
        }
}

/* Back on the loop: the job's done callback replies (or frees a detached request). */
static void job_finish(prep *p, prep_job *j) {
    job_forget(p, j);
    if (j->http) hs_req_set_close_cb(j->http, NULL, NULL);
    j->done(j);
}

static void prep_on_done(evutil_socket_t fd, short what, void *arg) {
    prep *p = arg;
    pthread_mutex_lock(&p->mu);
    prep_job *j = p->done_head;
    p->done_head = p->done_tail = NULL;
    pthread_mutex_unlock(&p->mu);
    while (j) {
        prep_job *next = j->next;
        job_finish(p, j);
        j = next;
    }
}

static void job_closed(hs_req *http, void *arg) {
    prep_job *j = arg;
    j->detached = 1;
    j->http = NULL; /* freed after this returns */
}

int prep_init(server *s) {
    prep *p = calloc(1, sizeof *p);
    if (!p) return -1;
    p->s = s;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->done_ev = event_new(s->base, -1, 0, prep_on_done, p);
    if (!p->done_ev || pthread_create(&p->thread, NULL, prep_main, p)) {
        if (p->done_ev) event_free(p->done_ev);
        pthread_mutex_destroy(&p->mu);
        pthread_cond_destroy(&p->cv);
        free(p);
        return -1;
    }
    p->started = 1;
    s->prep = p;
    return 0;
}

int prep_wants(server *s, hs_req *req) {
    return s->prep && evbuffer_get_length(hs_req_body_buffer(req)) >= PREP_INLINE_MAX;
}

void prep_submit(server *s, prep_job *j) {
    prep *p = s->prep;
    j->s = s;
    j->body = evbuffer_new();
    if (j->body) evbuffer_add_buffer(j->body, hs_req_body_buffer(j->http));
    hs_req_set_close_cb(j->http, job_closed, j);
    j->all_next = p->away;
    p->away = j;
    if (!j->body) { /* out of memory: the work sees an empty body and says so */
        j->work(j, "", 0);
        job_finish(p, j);
        return;
    }
    pthread_mutex_lock(&p->mu);
    j->next = NULL;
    if (p->todo_tail)
        p->todo_tail->next = j;
    else
        p->todo_head = j;
    p->todo_tail = j;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void prep_free(server *s) {
    prep *p = s->prep;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (p->started) pthread_join(p->thread, NULL);
    while (p->away) { /* queued, done, or never started: answer 503 and free */
        prep_job *j = p->away;
        p->away = j->all_next;
        if (j->body) evbuffer_free(j->body);
        j->body = NULL;
        if (j->http) {
            hs_req_set_close_cb(j->http, NULL, NULL);
            server_reply_text(j->http, 503, NULL, "", 0);
        }
        j->http = NULL;
        j->detached = 1;
        j->done(j);
    }
    event_free(p->done_ev);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
    s->prep = NULL;
}
