/* fuzz_util — see fuzz_util.h. */
#include "fuzz/fuzz_util.h"

#include "base/log.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

char *fuzz_strndup(const uint8_t *data, size_t size) {
    char *s = malloc(size + 1);
    if (!s) abort();
    if (size) memcpy(s, data, size);
    s[size] = 0;
    return s;
}

int fuzz_split_nul(const uint8_t *data, size_t size, const uint8_t **b, size_t *blen) {
    const uint8_t *z = size ? memchr(data, 0, size) : NULL;
    if (!z) {
        *b = NULL;
        *blen = 0;
        return 1;
    }
    *b = z + 1;
    *blen = size - (size_t)(z + 1 - data);
    return 2;
}

static char g_dir[64];

static void tmpdir_cleanup(void) {
    if (!g_dir[0]) return;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "fuzz: could not remove %s\n", g_dir);
}

const char *fuzz_tmpdir(void) {
    if (!g_dir[0]) {
        const char *base = getenv("TMPDIR");
        snprintf(g_dir, sizeof g_dir, "%s/disagg-fuzz-XXXXXX", base && *base ? base : "/tmp");
        if (!mkdtemp(g_dir)) {
            perror("fuzz: mkdtemp");
            abort();
        }
        atexit(tmpdir_cleanup);
    }
    return g_dir;
}

void fuzz_write_file(const char *dir, const char *name, const void *data, size_t len) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        perror(path);
        abort();
    }
    const char *p = data;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            perror(path);
            abort();
        }
        p += n;
        len -= (size_t)n;
    }
    close(fd);
}

void fuzz_remove_file(const char *dir, const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    unlink(path);
}

static long exchange(uint16_t port, const void *data, size_t len, char *reply, size_t cap,
                     int timeout_ms, int half_close) {
    /* Non-blocking from the start: libFuzzer's -timeout alarm (SIGALRM every
     * second) must not be able to interrupt a blocking connect. */
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) abort();
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        if (errno != EINPROGRESS && errno != EINTR) {
            perror("fuzz: connect");
            abort();
        }
        struct pollfd c = {.fd = fd, .events = POLLOUT};
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        while (poll(&c, 1, 5000) < 0 && errno == EINTR) {
        }
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0 || soerr != 0) {
            fprintf(stderr, "fuzz: connect to port %u: %s\n", port, strerror(soerr));
            abort();
        }
    }
    /* Send while draining the answer, so a server that replies before it has
     * read everything (or closes early) cannot deadlock us. */
    const char *p = data;
    size_t sent = 0;
    long got = 0;
    int wr_open = 1;
    char sink[4096];
    for (;;) {
        if (wr_open && sent == len) {
            if (half_close) shutdown(fd, SHUT_WR);
            wr_open = 0;
        }
        struct pollfd pfd = {.fd = fd, .events = POLLIN | (wr_open ? POLLOUT : 0)};
        int r = poll(&pfd, 1, timeout_ms);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break; /* timeout: the server kept the connection open */
        if (pfd.revents & (POLLIN | POLLHUP | POLLERR)) {
            char *dst = reply && (size_t)got < cap ? reply + got : sink;
            size_t room = reply && (size_t)got < cap ? cap - (size_t)got : sizeof sink;
            ssize_t n = recv(fd, dst, room, MSG_DONTWAIT);
            if (n > 0) {
                got += n;
                continue;
            }
            if (n == 0 || (errno != EAGAIN && errno != EINTR)) break;
        }
        if (wr_open && (pfd.revents & POLLOUT)) {
            ssize_t n = send(fd, p + sent, len - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (n > 0)
                sent += (size_t)n;
            else if (n < 0 && errno != EAGAIN && errno != EINTR)
                wr_open = 0; /* the server closed on us: read what it said */
        }
    }
    close(fd);
    return got;
}

long fuzz_exchange(uint16_t port, const void *data, size_t len, char *reply, size_t cap,
                   int timeout_ms) {
    return exchange(port, data, len, reply, cap, timeout_ms, 1);
}

long fuzz_exchange_open(uint16_t port, const void *data, size_t len, char *reply, size_t cap,
                        int timeout_ms) {
    return exchange(port, data, len, reply, cap, timeout_ms, 0);
}

void fuzz_quiet_logs(void) {
    if (!getenv("DISAGG_LOG_LEVEL")) log_set_level(LOG_ERROR);
}
