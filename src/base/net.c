/* net — see net.h. */
#include "net.h"

#include "clock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

int net_split_host_port(const char *s, char *host, size_t host_cap, uint16_t *port,
                        int allow_zero_port) {
    if (!s || !*s) return -EINVAL;
    const char *colon;
    const char *hbeg = s;
    size_t hlen;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (!close || close[1] != ':') return -EINVAL;
        hbeg = s + 1;
        hlen = (size_t)(close - hbeg);
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (!colon) return -EINVAL;
        if (memchr(s, ':', (size_t)(colon - s))) return -EINVAL; /* bare IPv6 needs [] */
        hlen = (size_t)(colon - s);
    }
    if (hlen == 0 || hlen >= host_cap) return -EINVAL;
    const char *p = colon + 1;
    if (!*p) return -EINVAL;
    unsigned long v = 0;
    for (; *p; p++) {
        if (*p < '0' || *p > '9') return -EINVAL;
        v = v * 10 + (unsigned long)(*p - '0');
        if (v > 65535) return -EINVAL;
    }
    if (v == 0 && !allow_zero_port) return -EINVAL;
    memcpy(host, hbeg, hlen);
    host[hlen] = 0;
    *port = (uint16_t)v;
    return 0;
}

int net_resolve(const char *host, uint16_t port, net_addr *out) {
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_family = AF_UNSPEC};
    struct addrinfo *res = NULL;
    char ps[8];
    snprintf(ps, sizeof ps, "%u", port);
    int rc = getaddrinfo(host, ps, &hints, &res);
    if (rc != 0 || !res) return -EHOSTUNREACH;
    memcpy(&out->ss, res->ai_addr, res->ai_addrlen);
    out->len = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

int net_host_is_loopback(const char *host) {
    net_addr a;
    if (!host || !*host || net_resolve(host, 0, &a) != 0) return 0;
    if (a.ss.ss_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)&a.ss)->sin_addr.s_addr) >> 24) == 127;
    if (a.ss.ss_family != AF_INET6) return 0;
    const struct in6_addr *a6 = &((const struct sockaddr_in6 *)&a.ss)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(a6)) return 1;
    return IN6_IS_ADDR_V4MAPPED(a6) && a6->s6_addr[12] == 127;
}

void net_addr_host(const net_addr *a, char *buf, size_t cap) {
    if (a->ss.ss_family == AF_INET6)
        inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)&a->ss)->sin6_addr, buf, (socklen_t)cap);
    else
        inet_ntop(AF_INET, &((const struct sockaddr_in *)&a->ss)->sin_addr, buf, (socklen_t)cap);
}

uint16_t net_addr_port(const net_addr *a) {
    if (a->ss.ss_family == AF_INET6) return ntohs(((const struct sockaddr_in6 *)&a->ss)->sin6_port);
    return ntohs(((const struct sockaddr_in *)&a->ss)->sin_port);
}

void net_addr_set_port(net_addr *a, uint16_t port) {
    if (a->ss.ss_family == AF_INET6)
        ((struct sockaddr_in6 *)&a->ss)->sin6_port = htons(port);
    else
        ((struct sockaddr_in *)&a->ss)->sin_port = htons(port);
}

void net_addr_format(const net_addr *a, char *buf, size_t cap) {
    char h[INET6_ADDRSTRLEN];
    net_addr_host(a, h, sizeof h);
    if (a->ss.ss_family == AF_INET6)
        snprintf(buf, cap, "[%s]:%u", h, net_addr_port(a));
    else
        snprintf(buf, cap, "%s:%u", h, net_addr_port(a));
}

int net_set_nodelay(int fd) {
    int one = 1;
    return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0 ? 0 : -errno;
}

int net_set_nonblock(int fd, int on) {
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) return -errno;
    fl = on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK);
    return fcntl(fd, F_SETFL, fl) == 0 ? 0 : -errno;
}

int net_set_bufsize(int fd, int bytes) {
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes) != 0) return -errno;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes) != 0) return -errno;
    return 0;
}

int net_listen(const net_addr *addr, int backlog) {
    int fd = socket(addr->ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -errno;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (addr->ss.ss_family == AF_INET6) { /* the wildcard is dual-stack, a specific address not */
        int v6only = !IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)&addr->ss)->sin6_addr);
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof v6only);
    }
    if (bind(fd, (const struct sockaddr *)&addr->ss, addr->len) != 0 || listen(fd, backlog) != 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    return fd;
}

int net_local_addr(int fd, net_addr *out) {
    out->len = sizeof out->ss;
    return getsockname(fd, (struct sockaddr *)&out->ss, &out->len) == 0 ? 0 : -errno;
}

static int wait_fd(int fd, short events, uint64_t deadline_ns) {
    for (;;) {
        int ms = clock_remaining_ms(deadline_ns);
        if (ms == 0) return -ETIMEDOUT;
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, ms);
        if (r > 0) return 0;
        if (r < 0 && errno != EINTR) return -errno;
    }
}

int net_connect(const net_addr *addr, const net_addr *source, uint64_t deadline_ns) {
    int fd = socket(addr->ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -errno;
    int rc = 0;
    if (source && bind(fd, (const struct sockaddr *)&source->ss, source->len) != 0) {
        rc = -errno;
        goto fail;
    }
    if (connect(fd, (const struct sockaddr *)&addr->ss, addr->len) != 0) {
        if (errno != EINPROGRESS) {
            rc = -errno;
            goto fail;
        }
        rc = wait_fd(fd, POLLOUT, deadline_ns);
        if (rc) goto fail;
        int err = 0;
        socklen_t el = sizeof err;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
        if (err) {
            rc = -err;
            goto fail;
        }
    }
    net_set_nodelay(fd);
    return fd; /* non-blocking: the *_all helpers poll with deadlines */
fail:
    close(fd);
    return rc;
}

int net_writev_all(int fd, struct iovec *iov, int iovcnt, uint64_t deadline_ns) {
    while (iovcnt > 0) {
        struct msghdr mh = {.msg_iov = iov,
                            .msg_iovlen = (size_t)(iovcnt > IOV_MAX ? IOV_MAX : iovcnt)};
        ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL); /* never SIGPIPE */
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int rc = wait_fd(fd, POLLOUT, deadline_ns);
                if (rc) return rc;
                continue;
            }
            return -errno;
        }
        size_t left = (size_t)n;
        while (iovcnt > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            iovcnt--;
        }
        if (iovcnt > 0) {
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

int net_send_all(int fd, const void *buf, size_t len, uint64_t deadline_ns) {
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    return net_writev_all(fd, &iov, 1, deadline_ns);
}

int net_recv_all(int fd, void *buf, size_t len, uint64_t deadline_ns) {
    char *p = buf;
    while (len > 0) {
        ssize_t n = recv(fd, p, len, 0);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n == 0) return -ECONNRESET;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = wait_fd(fd, POLLIN, deadline_ns);
            if (rc) return rc;
            continue;
        }
        return -errno;
    }
    return 0;
}

static int name_in_list(const char *list, const char *name) {
    size_t nl = strlen(name);
    const char *p = list;
    while (*p) {
        while (*p == ',' || *p == ' ')
            p++;
        const char *e = p;
        while (*e && *e != ',' && *e != ' ')
            e++;
        if ((size_t)(e - p) == nl && strncmp(p, name, nl) == 0) return 1;
        p = e;
    }
    return 0;
}

static int prefix_of(const struct sockaddr *mask) {
    if (!mask) return 0;
    const unsigned char *b;
    size_t n;
    if (mask->sa_family == AF_INET6) {
        b = (const unsigned char *)&((const struct sockaddr_in6 *)mask)->sin6_addr;
        n = 16;
    } else {
        b = (const unsigned char *)&((const struct sockaddr_in *)mask)->sin_addr;
        n = 4;
    }
    int bits = 0;
    for (size_t i = 0; i < n; i++)
        bits += __builtin_popcount(b[i]);
    return bits;
}

int net_list_iface_addrs(const char *whitelist, net_iface_addr *out, int max,
                         const char **bad_name) {
    static __thread char bad[64];
    struct ifaddrs *ifa = NULL;
    if (getifaddrs(&ifa) != 0) return -errno;
    int wl = whitelist && *whitelist;
    if (wl) { /* every whitelisted name must exist */
        const char *p = whitelist;
        while (*p) {
            while (*p == ',' || *p == ' ')
                p++;
            const char *e = p;
            while (*e && *e != ',' && *e != ' ')
                e++;
            if (e > p) {
                int found = 0;
                for (struct ifaddrs *i = ifa; i; i = i->ifa_next)
                    if (strlen(i->ifa_name) == (size_t)(e - p) &&
                        !strncmp(i->ifa_name, p, (size_t)(e - p)))
                        found = 1;
                if (!found) {
                    snprintf(bad, sizeof bad, "%.*s", (int)(e - p), p);
                    if (bad_name) *bad_name = bad;
                    freeifaddrs(ifa);
                    return -ENODEV;
                }
            }
            p = e;
        }
    }
    int n = 0;
    for (int pass = 0; pass < 2 && n == 0; pass++) {
        for (struct ifaddrs *i = ifa; i && n < max; i = i->ifa_next) {
            if (!i->ifa_addr || !(i->ifa_flags & IFF_UP)) continue;
            int fam = i->ifa_addr->sa_family;
            if (fam != AF_INET && fam != AF_INET6) continue;
            int loop = (i->ifa_flags & IFF_LOOPBACK) != 0;
            if (wl) {
                if (!name_in_list(whitelist, i->ifa_name)) continue;
            } else if (pass == 0 ? loop : !loop) {
                continue;
            }
            if (fam == AF_INET6 &&
                IN6_IS_ADDR_LINKLOCAL(&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr))
                continue;
            net_iface_addr *o = &out[n++];
            snprintf(o->ifname, sizeof o->ifname, "%s", i->ifa_name);
            o->addr.len =
                fam == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
            memcpy(&o->addr.ss, i->ifa_addr, o->addr.len);
            net_addr_set_port(&o->addr, 0);
            o->prefix_len = prefix_of(i->ifa_netmask);
        }
        if (wl) break;
    }
    freeifaddrs(ifa);
    return n;
}

int net_same_subnet(const net_addr *a, const net_addr *b, int prefix_len) {
    if (a->ss.ss_family != b->ss.ss_family) return 0;
    const unsigned char *x, *y;
    int max;
    if (a->ss.ss_family == AF_INET6) {
        x = (const unsigned char *)&((const struct sockaddr_in6 *)&a->ss)->sin6_addr;
        y = (const unsigned char *)&((const struct sockaddr_in6 *)&b->ss)->sin6_addr;
        max = 128;
    } else {
        x = (const unsigned char *)&((const struct sockaddr_in *)&a->ss)->sin_addr;
        y = (const unsigned char *)&((const struct sockaddr_in *)&b->ss)->sin_addr;
        max = 32;
    }
    if (prefix_len <= 0 || prefix_len > max) return 0;
    int full = prefix_len / 8, rem = prefix_len % 8;
    if (memcmp(x, y, (size_t)full) != 0) return 0;
    if (rem == 0) return 1;
    unsigned char m = (unsigned char)(0xFF << (8 - rem));
    return (x[full] & m) == (y[full] & m);
}

long net_raise_nofile_limit(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return -1;
    if (rl.rlim_cur < rl.rlim_max) {
        struct rlimit want = {rl.rlim_max, rl.rlim_max};
        if (setrlimit(RLIMIT_NOFILE, &want) == 0) rl.rlim_cur = rl.rlim_max;
    }
    return rl.rlim_cur == RLIM_INFINITY ? LONG_MAX : (long)rl.rlim_cur;
}
