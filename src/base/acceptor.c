/* acceptor — see acceptor.h. */
#include "base/acceptor.h"

#include "base/clock.h"
#include "base/log.h"
#include "base/net.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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
    /* Refusals and evictions: logged at most once per LOG_EVERY_NS (accept thread only). */
    uint64_t logged_ns;
    unsigned long refused, evicted; /* since the last line */
};

#define EVICTED      UINT64_MAX
#define LOG_EVERY_NS (10 * NS_PER_S)

void acceptor_conn_idle(acceptor_conn *c) {
    uint64_t now = clock_now_ns(), want = 0;
    atomic_compare_exchange_strong(&c->idle_since, &want, now ? now : 1);
}

int acceptor_conn_busy(acceptor_conn *c) {
    uint64_t cur = atomic_load(&c->idle_since);
    while (cur != 0 && cur != EVICTED)
        if (atomic_compare_exchange_weak(&c->idle_since, &cur, 0)) return 0;
    return cur == EVICTED ? -1 : 0;
}

/* Caller holds a->mu: shut down the longest-idle connection (of host, when
 * not NULL); 1 when one was evicted. */
static int evict_idle_locked(acceptor *a, const char *host) {
    for (int tries = 0; tries < 4; tries++) {
        acceptor_conn *victim = NULL;
        uint64_t oldest = EVICTED;
        for (acceptor_conn *c = a->conns; c; c = c->next) {
            uint64_t t = atomic_load(&c->idle_since);
            if (t != 0 && t < oldest && (!host || strcmp(c->host, host) == 0)) {
                oldest = t;
                victim = c;
            }
        }
        if (!victim) return 0;
        /* Lost to the connection becoming busy: look again. */
        if (!atomic_compare_exchange_strong(&victim->idle_since, &oldest, EVICTED)) continue;
        shutdown(victim->fd, SHUT_RDWR); /* its thread unlinks it (under mu) before closing */
        return 1;
    }
    return 0;
}

/* Caller holds a->mu: room for one more connection from host?  Evicts idle
 * connections when allowed; 0 = refuse.  *why names the cap that was hit. */
static int make_room_locked(acceptor *a, const char *host, const char **why, int *count) {
    if (a->cfg.max_per_peer > 0) {
        int n = 0;
        for (acceptor_conn *c = a->conns; c; c = c->next)
            if (strcmp(c->host, host) == 0 && atomic_load(&c->idle_since) != EVICTED) n++;
        if (n >= a->cfg.max_per_peer) {
            *why = "per-peer limit";
            *count = n;
            if (!a->cfg.evict_idle || !evict_idle_locked(a, host)) return 0;
            a->evicted++;
        }
    }
    int live = 0;
    for (acceptor_conn *c = a->conns; c; c = c->next)
        if (atomic_load(&c->idle_since) != EVICTED) live++;
    if (live >= a->cfg.max_conns) {
        *why = "limit";
        *count = live;
        if (!a->cfg.evict_idle || !evict_idle_locked(a, NULL)) return 0;
        a->evicted++;
    }
    /* Evicted connections still hold a thread until they notice; never more
     * than twice the limit at once. */
    return a->nconns < 2 * a->cfg.max_conns;
}

/* Accept thread: the periodic line about refusals and evictions. */
static void log_pressure(acceptor *a, const char *host, const char *why, int count) {
    uint64_t now = clock_now_ns();
    if (a->logged_ns && now - a->logged_ns < LOG_EVERY_NS) return;
    if (!a->refused && !a->evicted) return;
    a->logged_ns = now;
    int cap = strcmp(why, "per-peer limit") == 0 ? a->cfg.max_per_peer : a->cfg.max_conns;
    LOG_W("acceptor",
          "%s from %s: %d open (%s %d%s); since the previous such line %lu idle connection(s) "
          "closed to make room, %lu new one(s) refused (at most one line per %.0f s)",
          a->cfg.what, host, count, why, cap,
          strcmp(why, "per-peer limit") == 0 && a->cfg.per_peer_hint ? a->cfg.per_peer_hint : "",
          a->evicted, a->refused, (double)LOG_EVERY_NS / NS_PER_S);
    a->refused = a->evicted = 0;
}

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
        acceptor_conn *c = calloc(1, sizeof *c);
        if (c) {
            net_addr_format(&from, c->peer, sizeof c->peer);
            net_addr_host(&from, c->host, sizeof c->host);
            c->accepted_ns = clock_now_ns();
            atomic_init(&c->idle_since, a->cfg.evict_idle ? c->accepted_ns : 0);
        }
        pthread_mutex_lock(&a->mu);
        if (a->cfg.wait_when_full)
            while (a->nconns >= a->cfg.max_conns)
                pthread_cond_wait(&a->cond, &a->mu);
        const char *why = NULL;
        int count = 0;
        int room = a->cfg.evict_idle || a->cfg.max_per_peer > 0
                       ? make_room_locked(a, c ? c->host : "", &why, &count)
                       : a->nconns < a->cfg.max_conns;
        if (!c || !room) {
            int n = a->nconns;
            a->refused++;
            pthread_mutex_unlock(&a->mu);
            if (why)
                log_pressure(a, c ? c->host : "?", why, count);
            else
                LOG_W("acceptor", "refusing %s (%d open, limit %d)", a->cfg.what, n,
                      a->cfg.max_conns);
            free(c);
            close(fd);
            continue;
        }
        c->fd = fd;
        c->owner = a;
        c->next = a->conns;
        if (a->conns) a->conns->prev = c;
        a->conns = c;
        a->nconns++;
        pthread_mutex_unlock(&a->mu);
        if (why) log_pressure(a, c->host, why, count);
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
