/*
 * transfer_baseline — the ceilings `disagg bench transfer` prints beside the
 * engine's numbers, measured in the same run at the same block size and over
 * the same memory footprint:
 *   - single-thread memcpy bandwidth (the ceiling of the shm transport, which
 *     copies once), and
 *   - a plain blocking C socket request/response loop on loopback (the ceiling
 *     of the tcp transport): one connection, client sends a 24-byte header
 *     (+ block bytes for WRITE), server reads it fully and answers 8 bytes
 *     (+ block bytes for READ) — the shape of the engine's TCP v2 frames,
 *     without pipelining, lanes or threads.
 * Nothing here touches the transfer engine.
 */
#include "bench/transfer_bench.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void ceiling_finish(tb_ceiling *out, uint64_t ops, size_t block, uint64_t ns) {
    out->ops = ops;
    out->seconds = (double)ns / 1e9;
    out->gbps = ns ? (double)ops * (double)block / (double)ns : 0;
    out->mean_us = ops ? (double)ns / 1e3 / (double)ops : 0;
}

/* ---- memcpy ------------------------------------------------------------------ */

void tb_memcpy_ceiling(void *dst, const void *src, size_t block, size_t slots, double seconds,
                       tb_ceiling *out) {
    uint8_t *d = dst;
    const uint8_t *s = src;
    memcpy(d, s, block); /* warm */
    uint64_t t0 = now_ns(), limit = (uint64_t)(seconds * 1e9), ops = 0, t = t0;
    size_t slot = 0;
    while (t - t0 < limit) {
        for (int k = 0; k < 16; k++) {
            memcpy(d + slot * block, s + slot * block, block);
            if (++slot == slots) slot = 0;
        }
        ops += 16;
        t = now_ns();
    }
    ceiling_finish(out, ops, block, t - t0);
}

/* ---- blocking socket loop ------------------------------------------------------ */

typedef struct sock_server {
    int listen_fd; /* loopback listener, accepts one client */
    bool is_read;  /* answer with payload (READ) or take payload (WRITE) */
    uint8_t *buf;  /* (slots, block) server-side memory */
    size_t block;  /* bytes per request */
    size_t slots;  /* blocks in buf */
    int err;       /* 0 or -errno of the server thread */
} sock_server;

static int recv_full(int fd, void *buf, size_t len) {
    uint8_t *p = buf;
    while (len) {
        ssize_t r = recv(fd, p, len, MSG_WAITALL);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -errno;
        if (r == 0) return -ECONNRESET;
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

static int sendv_full(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w = sendmsg(fd, &mh, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return -errno;
        while (n > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return 0;
}

static void *sock_server_main(void *arg) {
    sock_server *s = arg;
    int fd = accept(s->listen_fd, NULL, NULL);
    if (fd < 0) {
        s->err = -errno;
        return NULL;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    size_t slot = 0;
    for (;;) {
        uint64_t hdr[3];
        int rc = recv_full(fd, hdr, sizeof hdr);
        if (rc) {
            s->err = rc;
            break;
        }
        if (hdr[0] == 0) break; /* end of the loop */
        uint64_t status = 0x4D43545600000000ull;
        uint8_t *p = s->buf + slot * s->block;
        if (++slot == s->slots) slot = 0;
        if (s->is_read) {
            struct iovec iov[2] = {{&status, 8}, {p, s->block}};
            rc = sendv_full(fd, iov, 2);
        } else {
            rc = recv_full(fd, p, s->block);
            if (!rc) {
                struct iovec iov[1] = {{&status, 8}};
                rc = sendv_full(fd, iov, 1);
            }
        }
        if (rc) {
            s->err = rc;
            break;
        }
    }
    close(fd);
    return NULL;
}

int tb_socket_ceiling(const char *host, bool is_read, size_t block, void *client_buf,
                      void *server_buf, size_t slots, double seconds, tb_ceiling *out, char *err,
                      size_t errcap) {
    struct sockaddr_in sa = {.sin_family = AF_INET};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
        snprintf(err, errcap, "socket ceiling: '%s' is not an IPv4 address", host);
        return -EINVAL;
    }
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0) {
        snprintf(err, errcap, "socket ceiling: socket: %s", strerror(errno));
        return -errno;
    }
    socklen_t sl = sizeof sa;
    if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, 1) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl)) {
        int e = errno;
        snprintf(err, errcap, "socket ceiling: listen on %s: %s", host, strerror(e));
        close(lfd);
        return -e;
    }
    sock_server srv = {
        .listen_fd = lfd, .is_read = is_read, .buf = server_buf, .block = block, .slots = slots};
    pthread_t tid;
    int prc = pthread_create(&tid, NULL, sock_server_main, &srv);
    if (prc) {
        snprintf(err, errcap, "socket ceiling: pthread_create: %s", strerror(prc));
        close(lfd);
        return -prc;
    }
    int rc = 0, fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa)) {
        rc = -errno;
        snprintf(err, errcap, "socket ceiling: connect to %s: %s", host, strerror(errno));
        if (fd >= 0) close(fd);
        shutdown(lfd, SHUT_RDWR); /* unblock accept */
        pthread_join(tid, NULL);
        close(lfd);
        return rc;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    uint8_t *cbuf = client_buf;
    uint64_t hdr[3] = {block, 0, 0x80 | (is_read ? 0 : 1)}, status;
    uint64_t t0 = now_ns(), limit = (uint64_t)(seconds * 1e9), ops = 0, t = t0;
    size_t slot = 0;
    /* one untimed request to warm both ends */
    for (int warm = 1; !rc && (warm || t - t0 < limit); warm = 0) {
        uint8_t *p = cbuf + slot * block;
        if (++slot == slots) slot = 0;
        if (is_read) {
            struct iovec iov[1] = {{hdr, sizeof hdr}};
            rc = sendv_full(fd, iov, 1);
            if (!rc) rc = recv_full(fd, &status, 8);
            if (!rc) rc = recv_full(fd, p, block);
        } else {
            struct iovec iov[2] = {{hdr, sizeof hdr}, {p, block}};
            rc = sendv_full(fd, iov, 2);
            if (!rc) rc = recv_full(fd, &status, 8);
        }
        if (warm)
            t0 = now_ns();
        else
            ops++;
        t = now_ns();
    }
    uint64_t end_hdr[3] = {0, 0, 0};
    struct iovec iov[1] = {{end_hdr, sizeof end_hdr}};
    if (!rc) sendv_full(fd, iov, 1);
    shutdown(fd, SHUT_WR);
    pthread_join(tid, NULL);
    close(fd);
    close(lfd);
    if (!rc && srv.err) rc = srv.err;
    if (rc) {
        snprintf(err, errcap, "socket ceiling: request/response loop failed: %s", strerror(-rc));
        return rc;
    }
    ceiling_finish(out, ops, block, t - t0);
    return 0;
}
