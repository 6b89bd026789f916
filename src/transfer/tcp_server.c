/* tcp_server — see tcp_server.h. */
#include "transfer/tcp_server.h"

#include "base/clock.h"
#include "base/log.h"
#include "disagg/transfer.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#define MOD       "transfer.tcp"
#define MAX_CONNS 1024
#define INBUF     65536
#define OUTMAX    512 /* status words batched before a flush */

typedef struct conn {
    struct conn *prev, *next; /* server's list */
    struct tcp_server *srv;
    int fd;
} conn;

struct tcp_server {
    tcp_server_env env;
    int listen_fd;
    int stop_fd;
    pthread_t accept_thread;
    pthread_mutex_t mu; /* guards conns, nconns, stopping */
    pthread_cond_t drained;
    conn *conns;
    int nconns;
    int stopping;
};

void tcp_header_encode(uint8_t h[TCP_HEADER_LEN], uint64_t size, uint64_t addr, uint8_t opcode) {
    for (int i = 0; i < 8; i++) {
        h[i] = (uint8_t)(size >> (8 * i));
        h[8 + i] = (uint8_t)(addr >> (8 * i));
    }
    h[16] = opcode;
    memset(h + 17, 0, 7);
}

void tcp_header_decode(const uint8_t h[TCP_HEADER_LEN], uint64_t *size, uint64_t *addr,
                       uint8_t *opcode) {
    uint64_t s = 0, a = 0;
    for (int i = 0; i < 8; i++) {
        s |= (uint64_t)h[i] << (8 * i);
        a |= (uint64_t)h[8 + i] << (8 * i);
    }
    *size = s;
    *addr = a;
    *opcode = h[16];
}

/* Per-connection state: buffered input and batched status replies. */
typedef struct conn_io {
    int fd;
    uint8_t in[INBUF];
    size_t in_off, in_len; /* unread bytes are in[in_off, in_len) */
    uint64_t out[OUTMAX];  /* status words waiting to be sent */
    size_t nout;
} conn_io;

static int flush_out(conn_io *io, uint64_t deadline) {
    if (io->nout == 0) return 0;
    int rc = net_send_all(io->fd, io->out, io->nout * sizeof io->out[0], deadline);
    io->nout = 0;
    return rc;
}

static int push_status(conn_io *io, uint64_t code, uint64_t deadline) {
    io->out[io->nout++] = TCP_STATUS_MAGIC | code; /* x86-64: little-endian in memory */
    return io->nout == OUTMAX ? flush_out(io, deadline) : 0;
}

/* Read at least `need` buffered bytes.  Before blocking, flush the replies of
 * requests already served (they are what the client waits for). */
static int fill(conn_io *io, size_t need, uint64_t deadline) {
    if (io->in_len - io->in_off >= need) return 0;
    if (io->in_off > 0) {
        memmove(io->in, io->in + io->in_off, io->in_len - io->in_off);
        io->in_len -= io->in_off;
        io->in_off = 0;
    }
    while (io->in_len < need) {
        ssize_t n = recv(io->fd, io->in + io->in_len, INBUF - io->in_len, MSG_DONTWAIT);
        if (n > 0) {
            io->in_len += (size_t)n;
            continue;
        }
        if (n == 0) return -ECONNRESET;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
        int rc = flush_out(io, deadline ? deadline : clock_now_ns() + 30 * NS_PER_S);
        if (rc) return rc;
        struct pollfd p = {.fd = io->fd, .events = POLLIN};
        int ms = deadline ? clock_remaining_ms(deadline) : -1;
        if (deadline && ms == 0) return -ETIMEDOUT;
        int r = poll(&p, 1, ms);
        if (r < 0 && errno != EINTR) return -errno;
    }
    return 0;
}

/* Move `size` payload bytes from the connection into dst (NULL = discard). */
static int recv_payload(conn_io *io, char *dst, uint64_t size, uint64_t deadline) {
    size_t have = io->in_len - io->in_off;
    size_t take = have < size ? have : (size_t)size;
    if (dst) memcpy(dst, io->in + io->in_off, take);
    io->in_off += take;
    size -= take;
    if (size == 0) return 0;
    if (dst) return net_recv_all(io->fd, dst + take, (size_t)size, deadline);
    while (size > 0) { /* discard through the input buffer */
        io->in_off = io->in_len = 0;
        int rc = fill(io, 1, deadline);
        if (rc) return rc;
        size_t t = io->in_len < size ? io->in_len : (size_t)size;
        io->in_off = t;
        size -= t;
    }
    return 0;
}

static int serve_one(tcp_server *s, conn_io *io) {
    int rc = fill(io, TCP_HEADER_LEN, 0); /* idle connections may wait forever */
    if (rc) return rc;
    uint64_t size, addr;
    uint8_t opcode;
    tcp_header_decode(io->in + io->in_off, &size, &addr, &opcode);
    io->in_off += TCP_HEADER_LEN;
    double per = s->env.timeout_per_byte_ns * (double)size;
    uint64_t deadline =
        clock_now_ns() + s->env.timeout_base_ns + (per > 1e15 ? (uint64_t)1e15 : (uint64_t)per);
    if (!(opcode & TCP_OP_V2) || (opcode & 0x7f) > TRANSFER_WRITE) {
        LOG_W(MOD, "malformed request (opcode 0x%02x); closing the connection", opcode);
        push_status(io, TCP_STATUS_MALFORMED, deadline);
        flush_out(io, deadline);
        return -EPROTO;
    }
    int is_write = (opcode & 0x7f) == TRANSFER_WRITE;
    pthread_rwlock_rdlock(s->env.reg_lock);
    const registry_entry *e = registry_find(s->env.regs, addr, size);
    if (!e) {
        pthread_rwlock_unlock(s->env.reg_lock);
        atomic_fetch_add(s->env.rejected, 1);
        LOG_D(MOD, "rejected %s of %llu bytes at 0x%llx: not inside a registered buffer",
              is_write ? "WRITE" : "READ", (unsigned long long)size, (unsigned long long)addr);
        if (is_write && size > TCP_MAX_REQUEST) {
            push_status(io, TCP_STATUS_REJECTED, deadline);
            flush_out(io, deadline);
            return -EPROTO;
        }
        if (is_write && (rc = recv_payload(io, NULL, size, deadline)) != 0) return rc;
        return push_status(io, TCP_STATUS_REJECTED, deadline);
    }
    if (is_write) {
        rc = recv_payload(io, (char *)(uintptr_t)addr, size, deadline);
        pthread_rwlock_unlock(s->env.reg_lock);
        if (rc) return rc;
        atomic_fetch_add(s->env.bytes_served, size);
        return push_status(io, TCP_STATUS_OK, deadline);
    }
    /* READ: statuses so far, then this one's status and payload in one writev. */
    rc = push_status(io, TCP_STATUS_OK, deadline);
    if (rc == 0) {
        struct iovec iov[2] = {{io->out, io->nout * sizeof io->out[0]},
                               {(void *)(uintptr_t)addr, size}};
        rc = net_writev_all(io->fd, iov, 2, deadline);
        io->nout = 0;
    }
    pthread_rwlock_unlock(s->env.reg_lock);
    if (rc == 0) atomic_fetch_add(s->env.bytes_served, size);
    return rc;
}

static void conn_unlink(tcp_server *s, conn *c) {
    pthread_mutex_lock(&s->mu);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->nconns--;
    pthread_cond_broadcast(&s->drained);
    pthread_mutex_unlock(&s->mu);
}

static void *conn_main(void *arg) {
    conn *c = arg;
    tcp_server *s = c->srv;
    conn_io *io = malloc(sizeof *io);
    if (io) {
        io->fd = c->fd;
        io->in_off = io->in_len = io->nout = 0;
        int rc;
        while ((rc = serve_one(s, io)) == 0) {
        }
        /* Requests served before the end (the peer shut down its side, or a
         * later request failed) still get their batched statuses. */
        flush_out(io, clock_now_ns() + NS_PER_S);
        if (rc != -ECONNRESET && rc != -EPROTO)
            LOG_D(MOD, "data connection closed: %s", strerror(-rc));
        free(io);
    }
    conn_unlink(s, c);
    close(c->fd);
    free(c);
    return NULL;
}

static void *accept_main(void *arg) {
    tcp_server *s = arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = s->listen_fd, .events = POLLIN},
                              {.fd = s->stop_fd, .events = POLLIN}};
        int r = poll(p, 2, -1);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 || (p[1].revents & POLLIN)) break;
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        net_set_nodelay(fd);
        net_set_nonblock(fd, 1);
        conn *c = calloc(1, sizeof *c);
        pthread_mutex_lock(&s->mu);
        if (!c || s->nconns >= MAX_CONNS || s->stopping) {
            pthread_mutex_unlock(&s->mu);
            LOG_W(MOD, "refusing data connection (%d open, limit %d)", s->nconns, MAX_CONNS);
            free(c);
            close(fd);
            continue;
        }
        c->srv = s;
        c->fd = fd;
        c->next = s->conns;
        if (s->conns) s->conns->prev = c;
        s->conns = c;
        s->nconns++;
        pthread_mutex_unlock(&s->mu);
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &at, conn_main, c) != 0) {
            conn_unlink(s, c);
            close(fd);
            free(c);
        }
        pthread_attr_destroy(&at);
    }
    return NULL;
}

int tcp_server_start(const net_addr *addr, const tcp_server_env *env, tcp_server **out,
                     uint16_t *port) {
    tcp_server *s = calloc(1, sizeof *s);
    if (!s) return TRANSFER_ENOMEM;
    s->env = *env;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->drained, NULL);
    s->listen_fd = net_listen(addr, 512);
    if (s->listen_fd < 0) {
        char a[80];
        net_addr_format(addr, a, sizeof a);
        LOG_E(MOD, "cannot listen on %s for tcp data: %s", a, strerror(-s->listen_fd));
        free(s);
        return TRANSFER_ESYS;
    }
    net_addr bound;
    net_local_addr(s->listen_fd, &bound);
    *port = net_addr_port(&bound);
    s->stop_fd = eventfd(0, EFD_CLOEXEC);
    if (s->stop_fd < 0 || pthread_create(&s->accept_thread, NULL, accept_main, s) != 0) {
        close(s->listen_fd);
        if (s->stop_fd >= 0) close(s->stop_fd);
        free(s);
        return TRANSFER_ESYS;
    }
    *out = s;
    return 0;
}

void tcp_server_stop(tcp_server *s) {
    if (!s) return;
    uint64_t one = 1;
    ssize_t w = write(s->stop_fd, &one, sizeof one);
    (void)w;
    pthread_join(s->accept_thread, NULL);
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    for (conn *c = s->conns; c; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    while (s->nconns > 0)
        pthread_cond_wait(&s->drained, &s->mu);
    pthread_mutex_unlock(&s->mu);
    close(s->listen_fd);
    close(s->stop_fd);
    pthread_cond_destroy(&s->drained);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
