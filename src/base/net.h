/*
 * net — socket helpers shared by the transfer engine, the servers and the
 * proxy: "host:port" parsing (IPv6 as "[addr]:port"), listening, connecting
 * with a deadline, whole-buffer send/recv with a deadline, and the list of
 * local interface addresses filtered by a device_name whitelist.
 * Functions return 0 / a non-negative fd, or -errno.
 */
#ifndef DISAGG_BASE_NET_H
#define DISAGG_BASE_NET_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>

typedef struct net_addr {
    struct sockaddr_storage ss;
    socklen_t len;
} net_addr;

/* Split "host:port", "[v6]:port" into host (no brackets) and port.  Returns
 * -EINVAL when malformed (missing port, port not 1..65535 — 0 allowed when
 * allow_zero_port, unbalanced brackets, host too long). */
int net_split_host_port(const char *s, char *host, size_t host_cap, uint16_t *port,
                        int allow_zero_port);
/* Resolve numeric or named host + port (getaddrinfo, first result). */
int net_resolve(const char *host, uint16_t port, net_addr *out);
/* 1 when a listener on host is reachable from this machine only: host
 * resolves to a loopback address (127.0.0.0/8, ::1, ::ffff:127.x).  0 for a
 * wildcard (NULL, "", 0.0.0.0, ::) and for anything that does not resolve. */
int net_host_is_loopback(const char *host);
/* Format as "ip:port" or "[ip6]:port". */
void net_addr_format(const net_addr *a, char *buf, size_t cap);
/* Numeric host part only ("10.0.0.1" / "fe80::1"). */
void net_addr_host(const net_addr *a, char *buf, size_t cap);
uint16_t net_addr_port(const net_addr *a);
void net_addr_set_port(net_addr *a, uint16_t port);

/* Listening TCP socket on addr (port 0 = ephemeral), SO_REUSEADDR, backlog. */
int net_listen(const net_addr *addr, int backlog);
/* The bound address of a socket. */
int net_local_addr(int fd, net_addr *out);
/* Connect (non-blocking fd returned) within deadline_ns (absolute clock_now_ns);
 * optional source address to bind (NULL = any).  TCP_NODELAY set. */
int net_connect(const net_addr *addr, const net_addr *source, uint64_t deadline_ns);
/* Send/receive exactly len bytes on a non-blocking fd (a blocking fd cannot
 * honour the deadline), polling until deadline_ns; sends never raise SIGPIPE.  -ETIMEDOUT at the
 * deadline, -ECONNRESET on EOF (recv). */
int net_send_all(int fd, const void *buf, size_t len, uint64_t deadline_ns);
int net_recv_all(int fd, void *buf, size_t len, uint64_t deadline_ns);
int net_writev_all(int fd, struct iovec *iov, int iovcnt, uint64_t deadline_ns);
int net_set_nodelay(int fd);
int net_set_nonblock(int fd, int on);
int net_set_bufsize(int fd, int bytes);
/* Raise RLIMIT_NOFILE's soft limit to the hard limit (servers hold a descriptor
 * per connection and ZeroMQ socket; a soft limit of 1,024 is common).  Returns
 * the soft limit in effect afterwards, or -1. */
long net_raise_nofile_limit(void);

typedef struct net_iface_addr {
    char ifname[32];
    net_addr addr; /* port 0 */
    int prefix_len;
} net_iface_addr;

/* Addresses of local interfaces that are up.  whitelist: comma-separated
 * interface names (NULL/"" = every non-loopback interface, or loopback when
 * there is none).  An unknown name in the whitelist is -ENODEV and *bad_name
 * (if given) points into a static copy of it.  Returns the count (<= max). */
int net_list_iface_addrs(const char *whitelist, net_iface_addr *out, int max,
                         const char **bad_name);
/* 1 when a and b are in the same subnet of prefix_len bits. */
int net_same_subnet(const net_addr *a, const net_addr *b, int prefix_len);

#endif
