/* handshake — see handshake.h. */
#include "transfer/handshake.h"

#include "base/clock.h"
#include "base/log.h"
#include "disagg/transfer.h"

#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#define MOD               "transfer.handshake"
#define SERVE_DEADLINE_NS (2 * NS_PER_S) /* a client must send its frame within this */
#define MAX_ACTIVE        64             /* connections served at once; more wait in the backlog */

struct handshake_server {
    int listen_fd;
    int stop_fd; /* eventfd: written by stop() */
    handshake_describe_fn describe;
    void *ctx;
    pthread_t thread;
    pthread_mutex_t mu; /* guards active */
    pthread_cond_t idle;
    int active; /* connection threads running */
};

typedef struct hs_conn {
    handshake_server *s;
    int fd;
} hs_conn;

void handshake_header_encode(uint8_t hdr[HANDSHAKE_HEADER_LEN], uint64_t len, uint8_t type) {
    for (int i = 0; i < 8; i++)
        hdr[i] = (uint8_t)(len >> (8 * i));
    hdr[8] = type;
}

int handshake_header_decode(const uint8_t hdr[HANDSHAKE_HEADER_LEN], uint64_t *len, uint8_t *type) {
    uint64_t l = 0;
    for (int i = 0; i < 8; i++)
        l |= (uint64_t)hdr[i] << (8 * i);
    *len = l;
    *type = hdr[8];
    return l > HANDSHAKE_MAX_FRAME ? TRANSFER_EPROTO : 0;
}

static int send_frame(int fd, uint8_t type, const char *body, uint64_t deadline) {
    uint8_t hdr[HANDSHAKE_HEADER_LEN];
    size_t len = strlen(body);
    handshake_header_encode(hdr, len, type);
    struct iovec iov[2] = {{hdr, sizeof hdr}, {(void *)body, len}};
    return net_writev_all(fd, iov, 2, deadline);
}

static void send_error(int fd, uint8_t type, const char *why, uint64_t deadline) {
    char body[256];
    snprintf(body, sizeof body, "{\"error\":\"%s\"}", why);
    send_frame(fd, type, body, deadline);
}

/* Serve one connection: one frame in, one frame out. */
static void serve_conn(handshake_server *s, int fd) {
    uint64_t deadline = clock_now_ns() + SERVE_DEADLINE_NS;
    uint8_t hdr[HANDSHAKE_HEADER_LEN];
    uint64_t len;
    uint8_t type;
    if (net_recv_all(fd, hdr, sizeof hdr, deadline) != 0) {
        LOG_D(MOD, "client closed or timed out before a full frame header");
        return;
    }
    if (handshake_header_decode(hdr, &len, &type) != 0) {
        LOG_W(MOD, "rejecting handshake frame of %llu bytes (limit %u)", (unsigned long long)len,
              HANDSHAKE_MAX_FRAME);
        send_error(fd, type, "frame too long", deadline);
        return;
    }
    char *body = malloc(len + 1);
    if (!body) return;
    if (net_recv_all(fd, body, len, deadline) != 0) {
        LOG_D(MOD, "truncated handshake frame");
        free(body);
        return;
    }
    body[len] = 0;
    if (type == HANDSHAKE_TYPE_METADATA) {
        /* The client's descriptor is informative only; it must be a JSON object
         * when present ("{}" is fine). */
        json_error_t je;
        json_t *o = len ? json_loadb(body, len, 0, &je) : json_object();
        if (!o || !json_is_object(o)) {
            send_error(fd, type, "metadata frame must carry a JSON object", deadline);
        } else {
            char *mine = s->describe(s->ctx);
            if (mine) send_frame(fd, type, mine, deadline);
            free(mine);
        }
        json_decref(o);
    } else if (type == HANDSHAKE_TYPE_PROBE) {
        send_frame(fd, type, "{\"status\":\"ok\"}", deadline);
    } else {
        send_error(fd, type, "unsupported frame type (accepted: 1 metadata, 3 probe)", deadline);
    }
    free(body);
}

/* Each connection on its own short-lived thread, so that a silent client
 * (up to SERVE_DEADLINE_NS) never holds up the others. */
static void *conn_main(void *arg) {
    hs_conn *c = arg;
    handshake_server *s = c->s;
    serve_conn(s, c->fd);
    close(c->fd);
    free(c);
    pthread_mutex_lock(&s->mu);
    s->active--;
    pthread_cond_broadcast(&s->idle);
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static void *server_main(void *arg) {
    handshake_server *s = arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = s->listen_fd, .events = POLLIN},
                              {.fd = s->stop_fd, .events = POLLIN}};
        int r = poll(p, 2, -1);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 || (p[1].revents & POLLIN)) break;
        if (!(p[0].revents & POLLIN)) continue;
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        net_set_nonblock(fd, 1);
        pthread_mutex_lock(&s->mu);
        while (s->active >= MAX_ACTIVE)
            pthread_cond_wait(&s->idle, &s->mu);
        s->active++;
        pthread_mutex_unlock(&s->mu);
        hs_conn *c = malloc(sizeof *c);
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (c) *c = (hs_conn){s, fd};
        if (!c || pthread_create(&t, &at, conn_main, c) != 0) {
            free(c);
            close(fd);
            pthread_mutex_lock(&s->mu);
            s->active--;
            pthread_mutex_unlock(&s->mu);
        }
        pthread_attr_destroy(&at);
    }
    pthread_mutex_lock(&s->mu); /* connection threads use s: wait for them */
    while (s->active > 0)
        pthread_cond_wait(&s->idle, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int handshake_server_start(const net_addr *addr, handshake_describe_fn describe,
                           handshake_bound_fn bound_fn, void *ctx, handshake_server **out) {
    handshake_server *s = calloc(1, sizeof *s);
    if (!s) return TRANSFER_ENOMEM;
    s->describe = describe;
    s->ctx = ctx;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->idle, NULL);
    s->listen_fd = net_listen(addr, 128);
    if (s->listen_fd < 0) {
        char a[80];
        net_addr_format(addr, a, sizeof a);
        LOG_E(MOD, "cannot listen on %s for the handshake port: %s", a, strerror(-s->listen_fd));
        free(s);
        return TRANSFER_ESYS;
    }
    s->stop_fd = eventfd(0, EFD_CLOEXEC);
    net_addr bound;
    net_local_addr(s->listen_fd, &bound);
    if (bound_fn) bound_fn(ctx, net_addr_port(&bound)); /* before any client can be served */
    if (s->stop_fd < 0 || pthread_create(&s->thread, NULL, server_main, s) != 0) {
        close(s->listen_fd);
        if (s->stop_fd >= 0) close(s->stop_fd);
        free(s);
        return TRANSFER_ESYS;
    }
    *out = s;
    return 0;
}

void handshake_server_stop(handshake_server *s) {
    if (!s) return;
    uint64_t one = 1;
    ssize_t w = write(s->stop_fd, &one, sizeof one);
    (void)w;
    pthread_join(s->thread, NULL);
    close(s->listen_fd);
    close(s->stop_fd);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->idle);
    free(s);
}

int handshake_fetch(const net_addr *peer, const char *my_json, uint64_t deadline_ns,
                    segment_desc *out, char *err, size_t cap) {
    char a[80];
    net_addr_format(peer, a, sizeof a);
    int fd = net_connect(peer, NULL, deadline_ns);
    if (fd < 0) {
        snprintf(err, cap, "cannot connect to handshake port %s: %s", a, strerror(-fd));
        return fd == -ETIMEDOUT ? TRANSFER_ETIMEDOUT : TRANSFER_ECONN;
    }
    int rc = send_frame(fd, HANDSHAKE_TYPE_METADATA, my_json ? my_json : "{}", deadline_ns);
    uint8_t hdr[HANDSHAKE_HEADER_LEN];
    uint64_t len = 0;
    uint8_t type = 0;
    if (rc == 0) rc = net_recv_all(fd, hdr, sizeof hdr, deadline_ns);
    if (rc != 0) {
        close(fd);
        snprintf(err, cap, "handshake with %s failed: %s", a, strerror(-rc));
        return rc == -ETIMEDOUT ? TRANSFER_ETIMEDOUT : TRANSFER_ECONN;
    }
    if (handshake_header_decode(hdr, &len, &type) != 0 || type != HANDSHAKE_TYPE_METADATA) {
        close(fd);
        snprintf(err, cap, "handshake with %s: unexpected reply frame (type %u, %llu bytes)", a,
                 type, (unsigned long long)len);
        return TRANSFER_EPROTO;
    }
    char *body = malloc(len + 1);
    if (!body) {
        close(fd);
        return TRANSFER_ENOMEM;
    }
    rc = net_recv_all(fd, body, len, deadline_ns);
    close(fd);
    if (rc != 0) {
        free(body);
        snprintf(err, cap, "handshake with %s: truncated reply: %s", a, strerror(-rc));
        return rc == -ETIMEDOUT ? TRANSFER_ETIMEDOUT : TRANSFER_ECONN;
    }
    rc = segment_desc_decode(body, len, out, err, cap);
    free(body);
    return rc;
}
