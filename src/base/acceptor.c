/* acceptor — see acceptor.h. */
#include "base/acceptor.h"

#include "base/log.h"
#include "base/net.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

struct acceptor {
    acceptor_cfg cfg;
    int listen_fd[ACCEPTOR_MAX_LISTEN];
    int nlisten;
    int stop_fd; /* eventfd: written by acceptor_stop */
    pthread_t thread;
    pthread_mutex_t mu;  /* guards conns, nconns */
    pthread_cond_t cond; /* a connection thread ended */
    acceptor_conn *conns;
    int nconns;
};

static void conn_unlink(acceptor *a, acceptor_conn *c) {
    pthread_mutex_lock(&a->mu);
    if (c->prev)
        c->prev->next = c->next;
    else
        a->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    a->nconns--;
    pthread_cond_broadcast(&a->cond);
    pthread_mutex_unlock(&a->mu);
}

static void *conn_main(void *arg) {
    acceptor_conn *c = arg;
    acceptor *a = c->owner;
    a->cfg.serve(a->cfg.ctx, c);
    conn_unlink(a, c); /* before close: acceptor_stop shuts listed fds down */
    close(c->fd);
    free(c);
    return NULL;
}

static void *accept_main(void *arg) {
    acceptor *a = arg;
    for (;;) {
        struct pollfd p[ACCEPTOR_MAX_LISTEN + 1];
        for (int i = 0; i < a->nlisten; i++)
            p[i] = (struct pollfd){.fd = a->listen_fd[i], .events = POLLIN};
        p[a->nlisten] = (struct pollfd){.fd = a->stop_fd, .events = POLLIN};
        int r = poll(p, (nfds_t)a->nlisten + 1, -1);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 || (p[a->nlisten].revents & POLLIN)) break;
        int li = 0;
        while (li < a->nlisten && !(p[li].revents & POLLIN))
            li++;
        if (li == a->nlisten) continue;
        net_addr from;
        socklen_t fl = sizeof from.ss;
        int fd = accept4(a->listen_fd[li], (struct sockaddr *)&from.ss, &fl, SOCK_CLOEXEC);
        if (fd < 0) continue;
        from.len = fl;
        if (a->cfg.nodelay) net_set_nodelay(fd);
        net_set_nonblock(fd, 1);
        pthread_mutex_lock(&a->mu);
        if (a->cfg.wait_when_full)
            while (a->nconns >= a->cfg.max_conns)
                pthread_cond_wait(&a->cond, &a->mu);
        acceptor_conn *c = calloc(1, sizeof *c);
        if (!c || a->nconns >= a->cfg.max_conns) {
            int n = a->nconns;
            pthread_mutex_unlock(&a->mu);
            LOG_W("acceptor", "refusing %s (%d open, limit %d)", a->cfg.what, n, a->cfg.max_conns);
            free(c);
            close(fd);
            continue;
        }
        c->fd = fd;
        net_addr_format(&from, c->peer, sizeof c->peer);
        c->owner = a;
        c->next = a->conns;
        if (a->conns) a->conns->prev = c;
        a->conns = c;
        a->nconns++;
        pthread_mutex_unlock(&a->mu);
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &at, conn_main, c) != 0) {
            conn_unlink(a, c);
            close(fd);
            free(c);
        }
        pthread_attr_destroy(&at);
    }
    return NULL;
}

int acceptor_start(const int *listen_fds, int n, const acceptor_cfg *cfg, acceptor **out) {
    int rc = -EINVAL;
    acceptor *a = NULL;
    if (n < 1 || n > ACCEPTOR_MAX_LISTEN || !cfg->serve || cfg->max_conns < 1) goto fail;
    rc = -ENOMEM;
    if (!(a = calloc(1, sizeof *a))) goto fail;
    a->cfg = *cfg;
    if (!a->cfg.what) a->cfg.what = "connection";
    for (int i = 0; i < n; i++)
        a->listen_fd[i] = listen_fds[i];
    a->nlisten = n;
    a->stop_fd = eventfd(0, EFD_CLOEXEC);
    if (a->stop_fd < 0) {
        rc = -errno;
        free(a);
        goto fail;
    }
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->cond, NULL);
    if ((rc = -pthread_create(&a->thread, NULL, accept_main, a)) != 0) {
        close(a->stop_fd);
        pthread_mutex_destroy(&a->mu);
        pthread_cond_destroy(&a->cond);
        free(a);
        goto fail;
    }
    *out = a;
    return 0;
fail:
    for (int i = 0; i < n && i < ACCEPTOR_MAX_LISTEN; i++)
        close(listen_fds[i]);
    return rc;
}

void acceptor_stop(acceptor *a) {
    if (!a) return;
    uint64_t one = 1;
    ssize_t w = write(a->stop_fd, &one, sizeof one);
    (void)w;
    pthread_join(a->thread, NULL);
    pthread_mutex_lock(&a->mu);
    if (a->cfg.shutdown_on_stop)
        for (acceptor_conn *c = a->conns; c; c = c->next)
            shutdown(c->fd, SHUT_RDWR);
    while (a->nconns > 0)
        pthread_cond_wait(&a->cond, &a->mu);
    pthread_mutex_unlock(&a->mu);
    for (int i = 0; i < a->nlisten; i++)
        close(a->listen_fd[i]);
    close(a->stop_fd);
    pthread_cond_destroy(&a->cond);
    pthread_mutex_destroy(&a->mu);
    free(a);
}
