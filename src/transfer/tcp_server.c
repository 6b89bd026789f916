/* tcp_server — see tcp_server.h. */
#include "transfer/tcp_server.h"

#include "base/acceptor.h"
#include "base/auth.h"
#include "base/clock.h"
#include "base/log.h"
#include "disagg/transfer.h"
#include "transfer/transport.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MOD              "transfer.tcp"
#define MAX_CONNS        TCP_MAX_CONNS
#define INBUF            65536
#define OUTMAX           512 /* status words batched before a flush */
#define MAX_LISTEN       ACCEPTOR_MAX_LISTEN
#define AUTH_DEADLINE_NS TCP_FIRST_MSG_NS
#define LOG_EVERY_NS     (10 * NS_PER_S)

typedef acceptor_conn conn; /* fd, peer "ip:port" */

struct tcp_server {
    tcp_server_env env;
    acceptor *acc; /* the accept loop: a thread per connection */
    /* Connections closed for sending nothing within TCP_FIRST_MSG_NS: one
     * log line per LOG_EVERY_NS with the count. */
    _Atomic uint64_t silent_closed, silent_logged_ns;
};

static void log_silent(tcp_server *s, const char *peer, const char *what) {
    uint64_t n = atomic_fetch_add(&s->silent_closed, 1) + 1;
    uint64_t now = clock_now_ns(), last = atomic_load(&s->silent_logged_ns);
    if (last && now - last < LOG_EVERY_NS) return;
    if (!atomic_compare_exchange_strong(&s->silent_logged_ns, &last, now)) return;
    atomic_fetch_sub(&s->silent_closed, n);
    LOG_W(MOD,
          "closed %llu data connection(s) (the latest from %s) that sent no %s within %.0f s of "
          "connecting",
          (unsigned long long)n, peer, what, (double)TCP_FIRST_MSG_NS / NS_PER_S);
}

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
    acceptor_conn *c;
    uint64_t first_deadline; /* the first request's header is due by then; 0 after it */
    uint8_t in[INBUF];
    size_t in_off, in_len; /* unread bytes are in[in_off, in_len) */
    uint64_t out[OUTMAX];  /* status words waiting to be sent */
    size_t nout;
    stage_pair stage; /* device memory staging, set up on first use */
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

/* WRITE into device memory: receive chunk k into slot k%2 while the
 * host->device copy of chunk k-1 runs on the other slot's stream. */
static int serve_write_device(tcp_server *s, conn_io *io, char *dst, uint64_t size,
                              uint64_t deadline) {
    const transfer_device_ops *d = io->stage.dev;
    int rc = 0, k = 0;
    for (uint64_t off = 0; off < size; off += STAGE_SLOT_BYTES, k ^= 1) {
        size_t n = size - off < STAGE_SLOT_BYTES ? (size_t)(size - off) : STAGE_SLOT_BYTES;
        if (off >= 2 * (uint64_t)STAGE_SLOT_BYTES && d->sync(d->ctx, io->stage.stream[k]) != 0)
            rc = -EIO;
        if (rc == 0) rc = recv_payload(io, io->stage.buf[k], n, deadline);
        if (rc) break;
        if (d->copy_from_host(d->ctx, io->stage.stream[k], dst + off, io->stage.buf[k], n) != 0) {
            rc = -EIO;
            break;
        }
    }
    for (int i = 0; i < 2; i++)
        if (d->sync(d->ctx, io->stage.stream[i]) != 0 && rc == 0) rc = -EIO;
    if (rc == -EIO) LOG_E(MOD, "host->device copy into cuda:%d failed", io->stage.device);
    if (rc == 0) atomic_fetch_add(&s->env.stage_stats->in, size);
    return rc;
}

/* READ of device memory: the device->host copy of chunk k+1 runs while
 * chunk k is sent; the first send carries the batched status words. */
static int serve_read_device(tcp_server *s, conn_io *io, const char *src, uint64_t size,
                             uint64_t deadline) {
    const transfer_device_ops *d = io->stage.dev;
    size_t n0 = size < STAGE_SLOT_BYTES ? (size_t)size : STAGE_SLOT_BYTES;
    int rc = d->copy_to_host(d->ctx, io->stage.stream[0], io->stage.buf[0], src, n0) ? -EIO : 0;
    int k = 0;
    for (uint64_t off = 0; rc == 0 && off < size; off += STAGE_SLOT_BYTES, k ^= 1) {
        size_t n = size - off < STAGE_SLOT_BYTES ? (size_t)(size - off) : STAGE_SLOT_BYTES;
        if (d->sync(d->ctx, io->stage.stream[k]) != 0) {
            rc = -EIO;
            break;
        }
        uint64_t next = off + n;
        if (next < size) {
            size_t nn = size - next < STAGE_SLOT_BYTES ? (size_t)(size - next) : STAGE_SLOT_BYTES;
            if (d->copy_to_host(d->ctx, io->stage.stream[k ^ 1], io->stage.buf[k ^ 1], src + next,
                                nn) != 0) {
                rc = -EIO;
                break;
            }
        }
        struct iovec iov[2] = {{io->out, io->nout * sizeof io->out[0]}, {io->stage.buf[k], n}};
        rc = net_writev_all(io->fd, iov, 2, deadline);
        io->nout = 0;
    }
    if (rc == -EIO) {
        LOG_E(MOD, "device->host copy from cuda:%d failed", io->stage.device);
        for (int i = 0; i < 2; i++)
            d->sync(d->ctx, io->stage.stream[i]);
    }
    if (rc == 0) atomic_fetch_add(&s->env.stage_stats->out, size);
    return rc;
}

static int serve_one(tcp_server *s, conn_io *io) {
    int rc = 0;
    if (io->in_len - io->in_off < TCP_HEADER_LEN) {
        /* Waiting for the peer: evictable (acceptor.h).  A pooled connection
         * may idle as long as it likes; a new one must speak first. */
        acceptor_conn_idle(io->c);
        rc = fill(io, TCP_HEADER_LEN, io->first_deadline);
        if (acceptor_conn_busy(io->c) != 0) return -ECONNRESET; /* evicted */
        if (rc == -ETIMEDOUT && io->first_deadline) log_silent(s, io->c->peer, "request");
        if (rc) return rc;
    }
    io->first_deadline = 0;
    uint64_t size, addr;
    uint8_t opcode;
    tcp_header_decode(io->in + io->in_off, &size, &addr, &opcode);
    io->in_off += TCP_HEADER_LEN;
    double per = s->env.timeout_per_byte_ns * (double)size;
    uint64_t deadline =
        clock_now_ns() + s->env.timeout_base_ns + (per > 1e15 ? (uint64_t)1e15 : (uint64_t)per);
    if ((opcode & 0x7f) > TRANSFER_WRITE) {
        LOG_W(MOD, "malformed request (opcode 0x%02x); closing the connection", opcode);
        push_status(io, TCP_STATUS_MALFORMED, deadline);
        flush_out(io, deadline);
        return -EPROTO;
    }
    int is_write = (opcode & 0x7f) == TRANSFER_WRITE;
    /* Mooncake's v1 framing (no 0x80 flag: MC_TCP_PROTO=1, or engines before
     * tcp_proto_version): no status words at all; a rejected request closes
     * the connection, as Mooncake's server does. */
    int v2 = (opcode & TCP_OP_V2) != 0;
    pthread_rwlock_rdlock(s->env.reg_lock);
    const registry_entry *e = registry_find(s->env.regs, addr, size);
    if (!e) {
        pthread_rwlock_unlock(s->env.reg_lock);
        atomic_fetch_add(s->env.rejected, 1);
        LOG_D(MOD, "rejected %s of %llu bytes at 0x%llx: not inside a registered buffer",
              is_write ? "WRITE" : "READ", (unsigned long long)size, (unsigned long long)addr);
        if (!v2) {
            flush_out(io, deadline);
            return -EPROTO;
        }
        if (is_write && size > TCP_MAX_REQUEST) {
            push_status(io, TCP_STATUS_REJECTED, deadline);
            flush_out(io, deadline);
            return -EPROTO;
        }
        if (is_write && (rc = recv_payload(io, NULL, size, deadline)) != 0) return rc;
        return push_status(io, TCP_STATUS_REJECTED, deadline);
    }
    int device = -1;
    if (location_is_device(e->location)) {
        const transfer_device_ops *d = s->env.dev ? *s->env.dev : NULL;
        rc = !d || stage_parse_device(e->location, &device) != 0
                 ? TRANSFER_EINVAL
                 : stage_pair_ready(&io->stage, d, device);
        if (rc) {
            pthread_rwlock_unlock(s->env.reg_lock);
            LOG_E(MOD, "cannot serve %s of %s memory: no staging (device ops missing or failed)",
                  is_write ? "WRITE" : "READ", e->location);
            if (v2) push_status(io, TCP_STATUS_REJECTED, deadline);
            flush_out(io, deadline);
            return -EPROTO; /* the payload (WRITE) is not read: the stream goes */
        }
    }
    if (device >= 0) {
        if (is_write) {
            rc = serve_write_device(s, io, (char *)(uintptr_t)addr, size, deadline);
            pthread_rwlock_unlock(s->env.reg_lock);
            if (rc) return rc;
            atomic_fetch_add(s->env.bytes_served, size);
            return v2 ? push_status(io, TCP_STATUS_OK, deadline) : 0;
        }
        rc = v2 ? push_status(io, TCP_STATUS_OK, deadline) : 0;
        /* Counted before the bytes go out: the initiator may see them (and
         * read the stats) before this thread runs again. */
        atomic_fetch_add(s->env.bytes_served, size);
        if (rc == 0) rc = serve_read_device(s, io, (const char *)(uintptr_t)addr, size, deadline);
        pthread_rwlock_unlock(s->env.reg_lock);
        if (rc) atomic_fetch_sub(s->env.bytes_served, size);
        return rc;
    }
    if (is_write) {
        rc = recv_payload(io, (char *)(uintptr_t)addr, size, deadline);
        pthread_rwlock_unlock(s->env.reg_lock);
        if (rc) return rc;
        atomic_fetch_add(s->env.bytes_served, size);
        return v2 ? push_status(io, TCP_STATUS_OK, deadline) : 0;
    }
    /* READ: statuses so far, then this one's status (v2) and payload in one writev. */
    rc = v2 ? push_status(io, TCP_STATUS_OK, deadline) : 0;
    /* Counted before the bytes go out: the initiator may see them (and read
     * the stats) before this thread runs again. */
    atomic_fetch_add(s->env.bytes_served, size);
    if (rc == 0) {
        struct iovec iov[2] = {{io->out, io->nout * sizeof io->out[0]},
                               {(void *)(uintptr_t)addr, size}};
        rc = net_writev_all(io->fd, iov, 2, deadline);
        io->nout = 0;
    }
    pthread_rwlock_unlock(s->env.reg_lock);
    if (rc) atomic_fetch_sub(s->env.bytes_served, size);
    return rc;
}

int tcp_auth_mac(const char *secret, int server_role, const uint8_t *cn, const uint8_t *sn,
                 uint8_t *out) {
    const char *label =
        server_role ? "disagg transfer data v1 server" : "disagg transfer data v1 client";
    const void *parts[3] = {label, cn, sn};
    size_t lens[3] = {strlen(label) + 1, AUTH_NONCE_LEN, AUTH_NONCE_LEN};
    return auth_hmacv(secret, strlen(secret), parts, lens, 3, out);
}

static void send_word(int fd, uint64_t code, uint64_t deadline) {
    uint64_t w = TCP_STATUS_MAGIC | code;
    net_send_all(fd, &w, sizeof w, deadline);
}

/* The secret's challenge-response, before any request frame is read. */
static int serve_auth(tcp_server *s, conn *c) {
    uint64_t deadline = clock_now_ns() + AUTH_DEADLINE_NS;
    uint8_t magic[TCP_AUTH_MAGIC_LEN], cn[AUTH_NONCE_LEN], sn[AUTH_NONCE_LEN];
    uint8_t mac[AUTH_MAC_LEN], want[AUTH_MAC_LEN];
    int rc = net_recv_all(c->fd, magic, sizeof magic, deadline);
    if (rc == 0 && memcmp(magic, TCP_AUTH_MAGIC, sizeof magic) != 0) {
        LOG_W(MOD,
              "refused data connection from %s: it did not authenticate (it has no auth_secret, "
              "or is a plain Mooncake engine); this engine requires the shared secret",
              c->peer);
        atomic_fetch_add(s->env.auth_refused, 1); /* counted before the peer can see it */
        send_word(c->fd, TCP_STATUS_AUTH_REFUSED, deadline);
        return -EACCES;
    }
    if (rc == 0) rc = net_recv_all(c->fd, cn, sizeof cn, deadline);
    if (rc) {
        /* Silent (a flood of idle sockets: one line per 10 s), evicted to
         * make room (the acceptor logs those), or closed by the peer. */
        atomic_fetch_add(s->env.auth_refused, 1);
        if (rc == -ETIMEDOUT)
            log_silent(s, c->peer, "authentication");
        else if (acceptor_conn_busy(c) == 0)
            LOG_D(MOD, "data connection from %s closed before authenticating (%s)", c->peer,
                  strerror(-rc));
        return -EACCES;
    }
    if (auth_random(sn, sizeof sn) != 0 || tcp_auth_mac(s->env.secret, 1, cn, sn, mac) != 0)
        return -EIO;
    uint64_t w = TCP_STATUS_MAGIC | TCP_STATUS_AUTH_CHALLENGE;
    struct iovec iov[3] = {{&w, sizeof w}, {sn, sizeof sn}, {mac, sizeof mac}};
    if ((rc = net_writev_all(c->fd, iov, 3, deadline)) != 0) return rc;
    rc = net_recv_all(c->fd, mac, sizeof mac, deadline);
    if (rc) {
        LOG_W(MOD,
              "refused data connection from %s: it closed during authentication (it rejected "
              "this engine's proof: a different auth_secret?)",
              c->peer);
        atomic_fetch_add(s->env.auth_refused, 1);
        return -EACCES;
    }
    if (tcp_auth_mac(s->env.secret, 0, cn, sn, want) != 0 || !auth_equal(mac, want, sizeof mac)) {
        LOG_W(MOD,
              "refused data connection from %s: authentication failed, its proof does not verify "
              "(a different auth_secret / DISAGG_KV_SECRET)",
              c->peer);
        atomic_fetch_add(s->env.auth_refused, 1); /* counted before the peer can see it */
        send_word(c->fd, TCP_STATUS_AUTH_REFUSED, deadline);
        return -EACCES;
    }
    send_word(c->fd, TCP_STATUS_OK, deadline);
    return 0;
}

static void conn_serve(void *ctx, acceptor_conn *c) {
    tcp_server *s = ctx;
    int refused = s->env.secret && serve_auth(s, c) != 0;
    if (s->env.secret) auth_thread_stop(); /* before stop() can see this connection gone */
    if (acceptor_conn_busy(c) != 0) refused = 1; /* evicted while authenticating */
    conn_io *io = refused ? NULL : malloc(sizeof *io);
    if (io) {
        io->fd = c->fd;
        io->c = c;
        /* With a secret the clock restarts after the authentication. */
        io->first_deadline = (s->env.secret ? clock_now_ns() : c->accepted_ns) + TCP_FIRST_MSG_NS;
        io->in_off = io->in_len = io->nout = 0;
        memset(&io->stage, 0, sizeof io->stage);
        int rc;
        while ((rc = serve_one(s, io)) == 0) {
        }
        /* Requests served before the end (the peer shut down its side, or a
         * later request failed) still get their batched statuses. */
        flush_out(io, clock_now_ns() + NS_PER_S);
        if (rc != -ECONNRESET && rc != -EPROTO)
            LOG_D(MOD, "data connection closed: %s", strerror(-rc));
        stage_pair_free(&io->stage);
        free(io);
    }
}

int tcp_server_start(const net_addr *addrs, int naddrs, const tcp_server_env *env, tcp_server **out,
                     uint16_t *port, int *ok) {
    if (naddrs < 1 || naddrs > MAX_LISTEN) return TRANSFER_EINVAL;
    tcp_server *s = calloc(1, sizeof *s);
    if (!s) return TRANSFER_ENOMEM;
    s->env = *env;
    if (s->env.secret && !*s->env.secret) s->env.secret = NULL;
    int fds[MAX_LISTEN], nfds = 0;
    uint16_t p = net_addr_port(&addrs[0]);
    for (int i = 0; i < naddrs; i++) {
        net_addr a = addrs[i];
        net_addr_set_port(&a, p);
        int fd = net_listen(&a, 512);
        if (ok) ok[i] = fd >= 0;
        if (fd < 0) {
            char as[80];
            net_addr_format(&a, as, sizeof as);
            if (i == 0) {
                LOG_E(MOD, "cannot listen on %s for tcp data: %s", as, strerror(-fd));
                free(s);
                return TRANSFER_ESYS;
            }
            LOG_W(MOD, "cannot listen on %s for tcp data (%s): not advertised", as, strerror(-fd));
            continue;
        }
        if (i == 0) {
            net_addr bound;
            net_local_addr(fd, &bound);
            p = net_addr_port(&bound);
        }
        fds[nfds++] = fd;
    }
    *port = p;
    if (s->env.max_conns_per_peer <= 0) s->env.max_conns_per_peer = TCP_MAX_PER_PEER;
    acceptor_cfg ac = {.what = "data connection",
                       .max_conns = MAX_CONNS,
                       .max_per_peer = s->env.max_conns_per_peer,
                       .evict_idle = 1,
                       .per_peer_hint =
                           ", transfer max_conns_per_peer / DISAGG_KV_MAX_CONNS_PER_PEER",
                       .nodelay = 1,
                       .shutdown_on_stop = 1,
                       .serve = conn_serve,
                       .ctx = s};
    if (acceptor_start(fds, nfds, &ac, &s->acc) != 0) { /* closes the fds */
        free(s);
        return TRANSFER_ESYS;
    }
    *out = s;
    return 0;
}

void tcp_server_stop(tcp_server *s) {
    if (!s) return;
    acceptor_stop(s->acc); /* shuts the data connections down and waits for them */
    free(s);
}
