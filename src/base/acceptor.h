/*
 * acceptor — the accept loop of a blocking, thread-per-connection server
 * (the transfer engine's handshake port and its tcp data port): a thread
 * polls one or more listening sockets and a stop eventfd, accepts, and runs
 * the server's serve callback on a detached thread per connection, at most
 * max_conns at once (beyond that it either waits for a slot, leaving clients
 * in the backlog, or closes the new connection).  Stopping ends the accept
 * thread, optionally shuts the open connections down, and waits until every
 * connection thread has returned.  Accepted sockets are non-blocking and
 * close-on-exec; the serve callback does its own I/O with deadlines
 * (base/net.h) and must not close the socket.
 *
 * Idle eviction (max_per_peer, evict_idle): a serve callback that marks its
 * connection idle while it waits for the peer's next message
 * (acceptor_conn_idle) and busy once one arrived (acceptor_conn_busy) lets
 * the acceptor make room: when a new connection would exceed max_per_peer
 * connections from its peer's address (or max_conns in all), the connection
 * of that peer (resp. of anyone) that has been idle longest is shut down; only
 * when none is idle is the new one refused.  So idle connections cannot
 * starve working ones, and one address cannot take every slot.
 */
#ifndef DISAGG_BASE_ACCEPTOR_H
#define DISAGG_BASE_ACCEPTOR_H

#include <stdatomic.h>
#include <stdint.h>

#define ACCEPTOR_MAX_LISTEN 17

typedef struct acceptor acceptor;

/* One accepted connection, as the serve callback sees it. */
typedef struct acceptor_conn {
    int fd;                            /* the socket (closed by the acceptor after serve) */
    char peer[80];                     /* client "ip:port", for logs */
    char host[64];                     /* client address without the port (per-peer cap) */
    uint64_t accepted_ns;              /* clock_now_ns() at accept */
    _Atomic uint64_t idle_since;       /* (internal) 0 busy, else idle since; see below */
    struct acceptor_conn *prev, *next; /* the acceptor's list (internal) */
    acceptor *owner;                   /* (internal) */
} acceptor_conn;

typedef struct acceptor_cfg {
    const char *what;     /* for logs: "data connection", ... */
    int max_conns;        /* connections served at once */
    int wait_when_full;   /* 1: stop accepting until a slot frees; 0: close (and log) the new one */
    int nodelay;          /* 1: TCP_NODELAY on accepted sockets */
    int shutdown_on_stop; /* 1: acceptor_stop shuts open connections down; 0: waits for them */
    int max_per_peer;     /* connections from one address at once; 0 = no cap */
    int evict_idle;       /* 1: make room by shutting down the longest-idle connection (above) */
    const char *per_peer_hint; /* appended to the per-peer cap in logs (", set X to raise it") */
    /* Serves one connection on its own thread; returns when done with it. */
    void (*serve)(void *ctx, acceptor_conn *c);
    void *ctx; /* the server */
} acceptor_cfg;

/* Starts accepting on listen_fds (n of them, 1..ACCEPTOR_MAX_LISTEN; owned
 * from now on, closed by acceptor_stop or here on failure).  Returns 0, or
 * -EINVAL / -ENOMEM / -errno. */
int acceptor_start(const int *listen_fds, int n, const acceptor_cfg *cfg, acceptor **out);
/* Stops accepting, (shuts open connections down,) waits for every
 * connection thread, closes the listening sockets and frees a. */
void acceptor_stop(acceptor *a);

/* From the serve callback: the connection now waits for its peer's next
 * message (it may be evicted), resp. a message arrived.  acceptor_conn_busy
 * returns 0, or -1 when the connection was evicted meanwhile (its socket is
 * shut down: the callback should return). */
void acceptor_conn_idle(acceptor_conn *c);
int acceptor_conn_busy(acceptor_conn *c);

#endif
