/* tcp_client — see tcp_client.h. */
#include "transfer/tcp_client.h"

#include "base/auth.h"
#include "base/clock.h"
#include "base/log.h"
#include "disagg/transfer.h"
#include "transfer/tcp_server.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MOD          "transfer.tcp"
#define GATHER_OPS   64         /* ops per sendmsg */
#define GATHER_BYTES (8u << 20) /* payload bytes per sendmsg */
#define RBUF         4096       /* receiver's buffer for status words */
#define DIRECT_MIN   2048       /* READ payload at least this goes straight to memory */
#define INLINE_SEND_MAX                                                                            \
    (64u << 10) /* WRITEs up to this are sent by the submitter on an idle lane */

typedef struct lane {
    struct tcp_client *cl;
    int path;                 /* index into cl->paths */
    pthread_mutex_t mu;       /* guards everything below */
    pthread_cond_t send_cv;   /* sender: work queued, or connection state changed */
    pthread_cond_t recv_cv;   /* receiver: ops in flight, or broken */
    xfer_op *q_head, *q_tail; /* queued, not yet sent */
    xfer_op *f_head, *f_tail; /* sent (or being sent), awaiting replies in order */
    int fd;                   /* -1 when not connected */
    uint32_t epoch;           /* bumped on every connect */
    int broken;               /* the connection failed; receiver cleans up */
    int draining;             /* a send failed because the peer closed: nothing more is sent,
                                 the receiver reads the replies it sent before closing (a
                                 write it rejected mid-payload), then the connection goes */
    int sending;              /* sender is writing on fd outside the lock */
    int stop;
    pthread_t sender, receiver;
    uint8_t rbuf[RBUF]; /* receiver's buffered input */
    size_t roff, rlen;
} lane;

struct tcp_client {
    const xfer_sink *sink;
    tcp_path paths[TCP_CLIENT_MAX_PATHS];
    int npaths;
    int lanes_per_path;
    lane *lanes; /* (npaths * lanes_per_path), path-major */
    int nlanes;
    uint64_t connect_timeout_ns;
    const char *secret;
    atomic_uint next; /* round-robin cursor */
    _Atomic uint64_t path_bytes[TCP_CLIENT_MAX_PATHS];
    _Atomic uint64_t retries;
    uint32_t max_tries; /* attempts per op across paths */
};

static void lane_enqueue_locked(lane *l, xfer_op *op) {
    op->next = NULL;
    if (l->q_tail)
        l->q_tail->next = op;
    else
        l->q_head = op;
    l->q_tail = op;
}

static void lane_flush_locked(lane *l, uint8_t (*hdrs)[TCP_HEADER_LEN], struct iovec *iov,
                              int max_ops);

static void lane_push(lane *l, xfer_op *op) {
    pthread_mutex_lock(&l->mu);
    if (l->stop) {
        pthread_mutex_unlock(&l->mu);
        xfer_done(l->cl->sink, op, TRANSFER_ECANCELED);
        return;
    }
    int idle = !l->q_head && !l->f_head && !l->sending && !l->broken && !l->draining && l->fd >= 0;
    lane_enqueue_locked(l, op);
    if (idle && (op->opcode == TRANSFER_READ || op->len <= INLINE_SEND_MAX)) {
        /* An idle connected lane: send from this thread, saving the sender's
         * wakeup on the latency path (the socket buffer is empty, so a small
         * request does not block). */
        uint8_t hdrs[1][TCP_HEADER_LEN];
        struct iovec iov[2];
        lane_flush_locked(l, hdrs, iov, 1);
    } else {
        pthread_cond_signal(&l->send_cv);
    }
    pthread_mutex_unlock(&l->mu);
}

void tcp_client_submit(tcp_client *c, xfer_op *op) {
    unsigned i = atomic_fetch_add(&c->next, 1) % (unsigned)c->nlanes;
    lane_push(&c->lanes[i], op);
}

void tcp_client_cancel(tcp_client *c, const struct batch *b) {
    for (int i = 0; i < c->nlanes; i++) {
        lane *l = &c->lanes[i];
        xfer_op *out = NULL, **pp;
        pthread_mutex_lock(&l->mu);
        l->q_tail = NULL;
        for (pp = &l->q_head; *pp;) {
            xfer_op *op = *pp;
            if (op->batch == b) {
                *pp = op->next;
                op->next = out;
                out = op;
            } else {
                l->q_tail = op;
                pp = &op->next;
            }
        }
        pthread_mutex_unlock(&l->mu);
        while (out) {
            xfer_op *n = out->next;
            xfer_done(c->sink, out, TRANSFER_ECANCELED);
            out = n;
        }
    }
}

/* The op failed on lane `from` with err: try another path, or end it. */
static void reroute(tcp_client *c, const lane *from, xfer_op *op, int err) {
    if (xfer_op_canceled(op)) {
        xfer_done(c->sink, op, TRANSFER_ECANCELED);
        return;
    }
    if (clock_now_ns() >= op->deadline_ns) {
        xfer_done(c->sink, op, TRANSFER_ETIMEDOUT);
        return;
    }
    if (++op->tries >= c->max_tries || err == TRANSFER_EAUTH) { /* another path won't help */
        xfer_done(c->sink, op, err);
        return;
    }
    atomic_fetch_add(&c->retries, 1);
    int path = (from->path + (int)op->tries) % c->npaths;
    unsigned k = atomic_fetch_add(&c->next, 1) % (unsigned)c->lanes_per_path;
    LOG_D(MOD, "retrying a %zu-byte chunk on path %s", op->len, c->paths[path].label);
    lane_push(&c->lanes[path * c->lanes_per_path + (int)k], op);
}

/* Caller holds l->mu: declare the current connection failed (once). */
static void lane_break_locked(lane *l, uint32_t epoch) {
    if (l->fd < 0 || l->epoch != epoch || l->broken) return;
    l->broken = 1;
    shutdown(l->fd, SHUT_RDWR);
    pthread_cond_broadcast(&l->recv_cv);
}

/* A request on lane `from` got no reply before its deadline: the peer, or the way to it,
 * went silent on that connection.  The other lanes of the same path were opened to the
 * same peer the same way, and a silent connection looks exactly like an idle one (no
 * error, no EOF): left open, each would hand a later request -- the next transfer of
 * another prefill -- a whole deadline of silence before it fails too.  Close them now;
 * their in-flight ops are retried (writes to fixed addresses: sending one again is
 * harmless) and their next op opens a fresh connection.  Caller holds no lane lock. */
static void break_path_siblings(tcp_client *c, const lane *from) {
    int n = 0;
    for (int k = 0; k < c->lanes_per_path; k++) {
        lane *s = &c->lanes[from->path * c->lanes_per_path + k];
        if (s == from) continue;
        pthread_mutex_lock(&s->mu);
        if (s->fd >= 0 && !s->broken) {
            lane_break_locked(s, s->epoch);
            n++;
        }
        pthread_mutex_unlock(&s->mu);
    }
    if (n)
        LOG_W(MOD, "%s went silent: closing its %d other connection%s too",
              c->paths[from->path].label, n, n == 1 ? "" : "s");
}

/* Caller holds l->mu, the lane is connected and nobody else is sending:
 * gather queued ops into one sendmsg and send it (the lock is dropped while
 * writing); returns with l->mu held. */
static void lane_flush_locked(lane *l, uint8_t (*hdrs)[TCP_HEADER_LEN], struct iovec *iov,
                              int max_ops) {
    tcp_client *c = l->cl;
    const tcp_path *p = &c->paths[l->path];
    /* Gather queued ops; cancelled ones end here without being sent. */
    int n = 0, niov = 0;
    size_t bytes = 0;
    uint64_t deadline = UINT64_MAX;
    xfer_op *canceled = NULL;
    while (l->q_head && n < max_ops && bytes < GATHER_BYTES) {
        xfer_op *op = l->q_head;
        l->q_head = op->next;
        if (!l->q_head) l->q_tail = NULL;
        if (xfer_op_canceled(op)) {
            op->next = canceled;
            canceled = op;
            continue;
        }
        op->next = NULL;
        if (l->f_tail)
            l->f_tail->next = op;
        else
            l->f_head = op;
        l->f_tail = op;
        tcp_header_encode(hdrs[n], op->len, op->remote, (uint8_t)(TCP_OP_V2 | op->opcode));
        iov[niov++] = (struct iovec){hdrs[n], TCP_HEADER_LEN};
        if (op->opcode == TRANSFER_WRITE) {
            iov[niov++] = (struct iovec){op->local, op->len};
            bytes += op->len;
        }
        if (op->deadline_ns < deadline) deadline = op->deadline_ns;
        n++;
    }
    int fd = l->fd;
    uint32_t epoch = l->epoch;
    if (n > 0) pthread_cond_broadcast(&l->recv_cv);
    l->sending = 1;
    pthread_mutex_unlock(&l->mu);
    while (canceled) {
        xfer_op *nx = canceled->next;
        xfer_done(c->sink, canceled, TRANSFER_ECANCELED);
        canceled = nx;
    }
    int rc = n ? net_writev_all(fd, iov, niov, deadline) : 0;
    if (rc == 0) atomic_fetch_add(&c->path_bytes[l->path], bytes);
    pthread_mutex_lock(&l->mu);
    l->sending = 0;
    pthread_cond_broadcast(&l->recv_cv);
    if (rc != 0) {
        LOG_D(MOD, "send on %s failed: %s", p->label, strerror(-rc));
        if ((rc == -EPIPE || rc == -ECONNRESET) && l->f_head && l->fd >= 0 && l->epoch == epoch &&
            !l->broken) {
            /* the peer closed, maybe after answering: a Mooncake target rejects a write to a
             * range outside its buffers as soon as it has the header and closes without
             * reading the payload.  Its replies are still readable: the receiver takes them
             * (the rejected write fails as the rejection, not as a lost connection) and
             * breaks the connection at the end of them (EOF or reset). */
            l->draining = 1;
            shutdown(fd, SHUT_WR);
            pthread_cond_broadcast(&l->recv_cv);
        } else {
            lane_break_locked(l, epoch);
        }
    }
    if (l->q_head) pthread_cond_signal(&l->send_cv);
}

/* The secret's challenge-response on a fresh connection (tcp_server.h).
 * Returns 0, or a transfer_error with the reason logged. */
static int client_auth(tcp_client *c, int fd, const char *label, uint64_t deadline) {
    uint8_t cn[AUTH_NONCE_LEN], sn[AUTH_NONCE_LEN], mac[AUTH_MAC_LEN], want[AUTH_MAC_LEN];
    uint64_t w = 0;
    if (auth_random(cn, sizeof cn) != 0) return TRANSFER_ESYS;
    struct iovec iov[2] = {{(void *)TCP_AUTH_MAGIC, TCP_AUTH_MAGIC_LEN}, {cn, sizeof cn}};
    int rc = net_writev_all(fd, iov, 2, deadline);
    if (rc == 0) rc = net_recv_all(fd, &w, sizeof w, deadline);
    if (rc) {
        LOG_E(MOD,
              "data connection %s: the peer closed during authentication (%s): it has no "
              "auth_secret (a plain Mooncake or unauthenticated disagg engine), or another one",
              label, strerror(-rc));
        return TRANSFER_EAUTH;
    }
    if (w == (TCP_STATUS_MAGIC | TCP_STATUS_AUTH_REFUSED)) {
        LOG_E(MOD, "data connection %s: the peer refused authentication", label);
        return TRANSFER_EAUTH;
    }
    if (w != (TCP_STATUS_MAGIC | TCP_STATUS_AUTH_CHALLENGE)) {
        LOG_E(MOD,
              "data connection %s: the peer does not authenticate (it answered 0x%016llx: no "
              "auth_secret there); refusing it",
              label, (unsigned long long)w);
        return TRANSFER_EAUTH;
    }
    rc = net_recv_all(fd, sn, sizeof sn, deadline);
    if (rc == 0) rc = net_recv_all(fd, mac, sizeof mac, deadline);
    if (rc) {
        LOG_E(MOD, "data connection %s: truncated authentication challenge: %s", label,
              strerror(-rc));
        return TRANSFER_ECONN;
    }
    if (tcp_auth_mac(c->secret, 1, cn, sn, want) != 0 || !auth_equal(mac, want, sizeof mac)) {
        LOG_E(MOD,
              "data connection %s: the peer's proof does not verify (a different auth_secret / "
              "DISAGG_KV_SECRET); refusing it",
              label);
        return TRANSFER_EAUTH;
    }
    if (tcp_auth_mac(c->secret, 0, cn, sn, mac) != 0) return TRANSFER_ESYS;
    rc = net_send_all(fd, mac, sizeof mac, deadline);
    if (rc == 0) rc = net_recv_all(fd, &w, sizeof w, deadline);
    if (rc || w != (TCP_STATUS_MAGIC | TCP_STATUS_OK)) {
        LOG_E(MOD, "data connection %s: the peer refused this engine's proof (a different secret)",
              label);
        return TRANSFER_EAUTH;
    }
    return 0;
}

static void *sender_main(void *arg) {
    lane *l = arg;
    tcp_client *c = l->cl;
    const tcp_path *p = &c->paths[l->path];
    uint8_t hdrs[GATHER_OPS][TCP_HEADER_LEN];
    struct iovec iov[GATHER_OPS * 2];
    pthread_mutex_lock(&l->mu);
    while (!l->stop) {
        if (!l->q_head || l->broken || l->sending || l->draining) {
            pthread_cond_wait(&l->send_cv, &l->mu);
            continue;
        }
        if (l->fd < 0) {
            pthread_mutex_unlock(&l->mu);
            int fd = net_connect(&p->dst, p->has_src ? &p->src : NULL,
                                 clock_now_ns() + c->connect_timeout_ns);
            pthread_mutex_lock(&l->mu);
            if (fd >= 0 && l->stop) {
                close(fd);
                break;
            }
            int err = fd == -ETIMEDOUT ? TRANSFER_ETIMEDOUT : TRANSFER_ECONN;
            if (fd >= 0 && c->secret) {
                pthread_mutex_unlock(&l->mu);
                int ar = client_auth(c, fd, p->label, clock_now_ns() + c->connect_timeout_ns);
                pthread_mutex_lock(&l->mu);
                if (ar) {
                    close(fd);
                    fd = -1;
                    err = ar;
                } else if (l->stop) {
                    close(fd);
                    break;
                }
            } else if (fd < 0) {
                LOG_W(MOD, "cannot connect %s: %s", p->label, strerror(-fd));
            }
            if (fd < 0) {
                xfer_op *q = l->q_head;
                l->q_head = l->q_tail = NULL;
                pthread_mutex_unlock(&l->mu);
                while (q) {
                    xfer_op *n = q->next;
                    reroute(c, l, q, err);
                    q = n;
                }
                pthread_mutex_lock(&l->mu);
                continue;
            }
            net_set_bufsize(fd, 4 << 20);
            l->fd = fd;
            l->epoch++;
            l->roff = l->rlen = 0;
            pthread_cond_broadcast(&l->recv_cv);
        }
        lane_flush_locked(l, hdrs, iov, GATHER_OPS);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* Receive exactly n bytes into dst through the lane's buffer. */
static int lane_read(lane *l, int fd, void *dst, size_t n, uint64_t deadline) {
    char *d = dst;
    while (n > 0) {
        size_t have = l->rlen - l->roff;
        if (have > 0) {
            size_t t = have < n ? have : n;
            memcpy(d, l->rbuf + l->roff, t);
            l->roff += t;
            d += t;
            n -= t;
            continue;
        }
        if (n >= DIRECT_MIN) return net_recv_all(fd, d, n, deadline);
        l->roff = l->rlen = 0;
        ssize_t r = recv(fd, l->rbuf, RBUF, MSG_DONTWAIT);
        if (r > 0) {
            l->rlen = (size_t)r;
            continue;
        }
        if (r == 0) return -ECONNRESET;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
        int ms = clock_remaining_ms(deadline);
        if (ms == 0) return -ETIMEDOUT;
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, ms) < 0 && errno != EINTR) return -errno;
    }
    return 0;
}

static int status_to_error(uint64_t st) {
    if ((st & 0xFFFFFFFF00000000ull) != TCP_STATUS_MAGIC) return TRANSFER_EPROTO;
    switch (st & 0xFFFFFFFFu) {
    case TCP_STATUS_OK:
        return 0;
    case TCP_STATUS_REJECTED:
        return TRANSFER_EREMOTEADDR;
    default:
        return TRANSFER_EPROTO;
    }
}

static void *receiver_main(void *arg) {
    lane *l = arg;
    tcp_client *c = l->cl;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        if (l->broken || (l->stop && l->fd >= 0)) {
            /* Close the failed connection (once the sender is off it); its
             * in-flight ops go elsewhere. */
            if (l->sending) {
                pthread_cond_wait(&l->recv_cv, &l->mu);
                continue;
            }
            xfer_op *f = l->f_head;
            l->f_head = l->f_tail = NULL;
            close(l->fd);
            l->fd = -1;
            l->broken = 0;
            l->draining = 0;
            int stop = l->stop;
            pthread_cond_broadcast(&l->send_cv);
            pthread_mutex_unlock(&l->mu);
            while (f) {
                xfer_op *n = f->next;
                if (stop)
                    xfer_done(c->sink, f, TRANSFER_ECANCELED);
                else
                    reroute(c, l, f, TRANSFER_ECONN);
                f = n;
            }
            pthread_mutex_lock(&l->mu);
            continue;
        }
        if (l->stop) break;
        if (l->fd < 0) {
            pthread_cond_wait(&l->recv_cv, &l->mu);
            continue;
        }
        if (!l->f_head && l->draining) { /* every reply read: the connection goes */
            lane_break_locked(l, l->epoch);
            continue;
        }
        if (!l->f_head) {
            /* Connected and idle: wait on the socket itself, so that the reply
             * to the next request wakes this thread once (the sender need not
             * wake it first).  Readable with nothing in flight means EOF or
             * unsolicited bytes: the connection goes. */
            int fd = l->fd;
            uint32_t epoch = l->epoch;
            pthread_mutex_unlock(&l->mu);
            struct pollfd pf = {.fd = fd, .events = POLLIN};
            int pr = poll(&pf, 1, 100);
            pthread_mutex_lock(&l->mu);
            if (pr > 0 && !l->f_head && l->epoch == epoch && l->roff == l->rlen)
                lane_break_locked(l, epoch);
            continue;
        }
        xfer_op *op = l->f_head;
        int fd = l->fd;
        uint32_t epoch = l->epoch;
        pthread_mutex_unlock(&l->mu);
        uint64_t st = 0;
        int rc = lane_read(l, fd, &st, sizeof st, op->deadline_ns);
        int err = rc == 0 ? status_to_error(st) : 0;
        if (rc == 0 && err == 0 && op->opcode == TRANSFER_READ) {
            rc = lane_read(l, fd, op->local, op->len, op->deadline_ns);
            if (rc == 0) atomic_fetch_add(&c->path_bytes[l->path], op->len);
        }
        pthread_mutex_lock(&l->mu);
        if (rc != 0 || err == TRANSFER_EPROTO) {
            if (rc == -ETIMEDOUT && l->f_head == op && l->epoch == epoch) {
                /* This op's reply is late: it fails; the stream is now out of
                 * sync, so the connection goes and the rest are retried. */
                l->f_head = op->next;
                if (!l->f_head) l->f_tail = NULL;
                pthread_mutex_unlock(&l->mu);
                LOG_W(MOD, "request of %zu bytes on %s timed out", op->len,
                      c->paths[l->path].label);
                /* before the op ends: once its batch has failed, the next transfer
                 * finds no connection of this path that went silent with it */
                break_path_siblings(c, l);
                xfer_done(c->sink, op, TRANSFER_ETIMEDOUT);
                pthread_mutex_lock(&l->mu);
            } else if (err == TRANSFER_EPROTO && l->f_head == op && l->epoch == epoch) {
                l->f_head = op->next;
                if (!l->f_head) l->f_tail = NULL;
                pthread_mutex_unlock(&l->mu);
                LOG_W(MOD, "peer %s answered with an invalid status word 0x%016llx",
                      c->paths[l->path].label, (unsigned long long)st);
                xfer_done(c->sink, op, TRANSFER_EPROTO);
                pthread_mutex_lock(&l->mu);
            }
            lane_break_locked(l, epoch);
            continue;
        }
        /* Completed (ok or rejected): it is the head of the in-flight FIFO. */
        l->f_head = op->next;
        if (!l->f_head) l->f_tail = NULL;
        pthread_mutex_unlock(&l->mu);
        xfer_done(c->sink, op, err);
        pthread_mutex_lock(&l->mu);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

int tcp_client_create(const xfer_sink *sink, const tcp_path *paths, int npaths, int lanes_per_path,
                      uint64_t connect_timeout_ns, const char *secret, tcp_client **out) {
    if (npaths <= 0 || npaths > TCP_CLIENT_MAX_PATHS || lanes_per_path <= 0) return TRANSFER_EINVAL;
    tcp_client *c = calloc(1, sizeof *c);
    if (!c) return TRANSFER_ENOMEM;
    c->sink = sink;
    memcpy(c->paths, paths, (size_t)npaths * sizeof *paths);
    c->npaths = npaths;
    c->lanes_per_path = lanes_per_path;
    c->nlanes = npaths * lanes_per_path;
    c->connect_timeout_ns = connect_timeout_ns;
    c->secret = secret && *secret ? secret : NULL;
    /* A connection loss usually breaks every lane of a path at once (a reset
     * link, a restarted relay), and a retry pushed onto a sibling lane may hit
     * a connection that has not noticed yet: allow one try per lane of a path
     * beyond one per path, so a retry always gets to a fresh connection. */
    c->max_tries = (uint32_t)(npaths + lanes_per_path > 2 ? npaths + lanes_per_path : 2);
    c->lanes = calloc((size_t)c->nlanes, sizeof *c->lanes);
    if (!c->lanes) {
        free(c);
        return TRANSFER_ENOMEM;
    }
    for (int i = 0; i < c->nlanes; i++) {
        lane *l = &c->lanes[i];
        l->cl = c;
        l->path = i / lanes_per_path;
        l->fd = -1;
        pthread_mutex_init(&l->mu, NULL);
        pthread_cond_init(&l->send_cv, NULL);
        pthread_cond_init(&l->recv_cv, NULL);
        pthread_create(&l->sender, NULL, sender_main, l);
        pthread_create(&l->receiver, NULL, receiver_main, l);
    }
    *out = c;
    return 0;
}

void tcp_client_destroy(tcp_client *c) {
    if (!c) return;
    for (int i = 0; i < c->nlanes; i++) {
        lane *l = &c->lanes[i];
        pthread_mutex_lock(&l->mu);
        l->stop = 1;
        if (l->fd >= 0) shutdown(l->fd, SHUT_RDWR);
        pthread_cond_broadcast(&l->send_cv);
        pthread_cond_broadcast(&l->recv_cv);
        pthread_mutex_unlock(&l->mu);
    }
    for (int i = 0; i < c->nlanes; i++) {
        lane *l = &c->lanes[i];
        pthread_join(l->sender, NULL);
        pthread_join(l->receiver, NULL);
        /* Whatever is left never reached the wire or lost its connection. */
        xfer_op *lists[2] = {l->q_head, l->f_head};
        for (int k = 0; k < 2; k++)
            for (xfer_op *op = lists[k]; op;) {
                xfer_op *n = op->next;
                xfer_done(c->sink, op, TRANSFER_ECANCELED);
                op = n;
            }
        if (l->fd >= 0) close(l->fd);
        pthread_mutex_destroy(&l->mu);
        pthread_cond_destroy(&l->send_cv);
        pthread_cond_destroy(&l->recv_cv);
    }
    free(c->lanes);
    free(c);
}

int tcp_client_num_lanes(const tcp_client *c) {
    return c->nlanes;
}
uint64_t tcp_client_path_bytes(const tcp_client *c, int path) {
    return path >= 0 && path < c->npaths ? atomic_load(&c->path_bytes[path]) : 0;
}
uint64_t tcp_client_retries(const tcp_client *c) {
    return atomic_load(&c->retries);
}
