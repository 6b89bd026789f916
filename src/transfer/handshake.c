/* handshake — see handshake.h. */
#include "transfer/handshake.h"

#include "base/auth.h"
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
#include <sys/socket.h>
#include <unistd.h>

#define MOD               "transfer.handshake"
#define SERVE_DEADLINE_NS (2 * NS_PER_S) /* a client must finish its exchange within this */
#define MAX_ACTIVE        64             /* connections served at once; more wait in the backlog */
#define LABEL_SERVER      "disagg transfer handshake v1 server"
#define LABEL_CLIENT      "disagg transfer handshake v1 client"
#define NAME_MAX_LEN      96

struct handshake_server {
    int listen_fd;
    int stop_fd; /* eventfd: written by stop() */
    handshake_server_cfg cfg;
    pthread_t thread;
    pthread_mutex_t mu; /* guards active */
    pthread_cond_t idle;
    int active; /* connection threads running */
};

typedef struct hs_conn {
    handshake_server *s;
    int fd;
    char peer[80]; /* "ip:port" of the client, for logs */
} hs_conn;

void handshake_header_encode(uint8_t hdr[HANDSHAKE_HEADER_LEN], uint64_t body_len, uint8_t type) {
    uint64_t len = body_len + 1; /* Mooncake's writeString counts the type byte */
    for (int i = 0; i < 8; i++)
        hdr[i] = (uint8_t)(len >> (8 * i));
    hdr[8] = type;
}

int handshake_header_decode(const uint8_t hdr[HANDSHAKE_HEADER_LEN], uint64_t *body_len,
                            uint8_t *type) {
    uint64_t l = 0;
    for (int i = 0; i < 8; i++)
        l |= (uint64_t)hdr[i] << (8 * i);
    if (l == 0 || l > HANDSHAKE_MAX_FRAME) {
        *body_len = l;
        *type = hdr[8] <= HANDSHAKE_TYPE_PROBE ? hdr[8] : HANDSHAKE_TYPE_OLD;
        return TRANSFER_EPROTO;
    }
    if (hdr[8] <= HANDSHAKE_TYPE_PROBE) {
        *type = hdr[8];
        *body_len = l - 1;
    } else { /* Mooncake's readString: no type byte, the whole frame is the body */
        *type = HANDSHAKE_TYPE_OLD;
        *body_len = l;
    }
    return 0;
}

static int send_frame(int fd, uint8_t type, const char *body, uint64_t deadline) {
    uint8_t hdr[HANDSHAKE_HEADER_LEN];
    size_t len = strlen(body);
    handshake_header_encode(hdr, len, type);
    struct iovec iov[2] = {{hdr, sizeof hdr}, {(void *)body, len}};
    return net_writev_all(fd, iov, 2, deadline);
}

static int send_json(int fd, uint8_t type, json_t *o, uint64_t deadline) {
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!s) return -ENOMEM;
    int rc = send_frame(fd, type, s, deadline);
    free(s);
    return rc;
}

static void send_error(int fd, uint8_t type, const char *why, uint64_t deadline) {
    json_t *o = json_pack("{s:s}", "error", why);
    if (type != HANDSHAKE_TYPE_OLD) {
        send_json(fd, type, o, deadline);
        return;
    }
    /* Mooncake answers an untyped frame with an untyped one: no type byte. */
    char *b = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!b) return;
    uint64_t len = strlen(b);
    uint8_t hdr[8];
    for (int i = 0; i < 8; i++)
        hdr[i] = (uint8_t)(len >> (8 * i));
    struct iovec iov[2] = {{hdr, sizeof hdr}, {b, len}};
    net_writev_all(fd, iov, 2, deadline);
    free(b);
}

enum { FRAME_OK = 0, FRAME_EIO = 1, FRAME_ELEN = 2, FRAME_ENOMEM = 3 };

/* One frame: its type and a malloc'd, NUL-terminated body. */
static int recv_frame(int fd, uint64_t deadline, uint8_t *type, char **body, uint64_t *len,
                      int *ioerr) {
    uint8_t hdr[HANDSHAKE_HEADER_LEN];
    *body = NULL;
    int rc = net_recv_all(fd, hdr, sizeof hdr, deadline);
    if (rc) {
        *ioerr = rc;
        return FRAME_EIO;
    }
    if (handshake_header_decode(hdr, len, type) != 0) return FRAME_ELEN;
    char *b = malloc(*len + 1);
    if (!b) return FRAME_ENOMEM;
    size_t off = 0;
    if (*type == HANDSHAKE_TYPE_OLD) b[off++] = (char)hdr[8];
    rc = net_recv_all(fd, b + off, *len - off, deadline);
    if (rc) {
        free(b);
        *ioerr = rc;
        return FRAME_EIO;
    }
    b[*len] = 0;
    *body = b;
    return FRAME_OK;
}

/* HMAC-SHA256(secret, label | cn | sn | server_name | client_name), each
 * string with its NUL so that no two tuples encode alike. */
static int hs_mac(const char *secret, const char *label, const uint8_t cn[AUTH_NONCE_LEN],
                  const uint8_t sn[AUTH_NONCE_LEN], const char *server_name,
                  const char *client_name, uint8_t out[AUTH_MAC_LEN]) {
    const void *parts[5] = {label, cn, sn, server_name, client_name};
    size_t lens[5] = {strlen(label) + 1, AUTH_NONCE_LEN, AUTH_NONCE_LEN, strlen(server_name) + 1,
                      strlen(client_name) + 1};
    return auth_hmacv(secret, strlen(secret), parts, lens, 5, out);
}

static int unhex(const char *s, uint8_t *out, size_t n) {
    if (!s || strlen(s) != 2 * n) return -1;
    for (size_t i = 0; i < 2 * n; i++) {
        char c = s[i];
        int v = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (v < 0) return -1;
        if (i % 2 == 0)
            out[i / 2] = (uint8_t)(v << 4);
        else
            out[i / 2] |= (uint8_t)v;
    }
    return 0;
}

/* The "disagg_auth" object of a JSON object, or NULL. */
static json_t *auth_obj(json_t *o) {
    json_t *a = o && json_is_object(o) ? json_object_get(o, "disagg_auth") : NULL;
    return a && json_is_object(a) ? a : NULL;
}

static const char *jstr(json_t *o, const char *key) {
    json_t *v = o ? json_object_get(o, key) : NULL;
    return v && json_is_string(v) ? json_string_value(v) : NULL;
}

static void send_descriptor(handshake_server *s, int fd, uint64_t deadline) {
    char *mine = s->cfg.describe(s->cfg.ctx);
    if (mine)
        send_frame(fd, HANDSHAKE_TYPE_METADATA, mine, deadline);
    else
        send_error(fd, HANDSHAKE_TYPE_METADATA, "out of memory", deadline);
    free(mine);
}

/* A metadata request with the secret set: challenge-response, then the
 * descriptor. */
static void count_refusal(handshake_server *s) {
    if (s->cfg.auth_refused) atomic_fetch_add(s->cfg.auth_refused, 1);
}

static void serve_connect_frame(handshake_server *s, hs_conn *c, const char *body, uint64_t len,
                                uint64_t deadline);

/* After a verified challenge with "then":"connect": ok, then the type-0 frame on this
 * connection (an rdma peer connecting its queue pair, authenticated). */
static void serve_connect_authed(handshake_server *s, hs_conn *c, uint64_t deadline) {
    if (!s->cfg.connect) {
        send_error(c->fd, HANDSHAKE_TYPE_METADATA,
                   "this engine does not run rdma: no queue pair to connect", deadline);
        return;
    }
    if (send_frame(c->fd, HANDSHAKE_TYPE_METADATA, "{\"disagg_auth\":{\"ok\":true}}", deadline))
        return;
    uint8_t type;
    char *body;
    uint64_t len;
    int ioerr = 0;
    int fr = recv_frame(c->fd, deadline, &type, &body, &len, &ioerr);
    if (fr != FRAME_OK) return;
    if (type == HANDSHAKE_TYPE_CONNECT)
        serve_connect_frame(s, c, body, len, deadline);
    else
        send_error(c->fd, type, "expected the connect frame (type 0) after authentication",
                   deadline);
    free(body);
}

static void serve_auth(handshake_server *s, hs_conn *c, json_t *au, uint64_t deadline) {
    int fd = c->fd;
    const char *then = jstr(au, "then");
    int then_connect = then && !strcmp(then, "connect");
    uint8_t cn[AUTH_NONCE_LEN], sn[AUTH_NONCE_LEN], mac[AUTH_MAC_LEN], want[AUTH_MAC_LEN];
    const char *cname = jstr(au, "name");
    if (unhex(jstr(au, "nonce"), cn, sizeof cn) != 0 || !cname || strlen(cname) >= NAME_MAX_LEN) {
        LOG_W(MOD, "refused handshake from %s: malformed disagg_auth request", c->peer);
        count_refusal(s);
        send_error(fd, HANDSHAKE_TYPE_METADATA,
                   "disagg_auth: nonce must be 64 hex digits and name a segment name", deadline);
        return;
    }
    char client_name[NAME_MAX_LEN];
    snprintf(client_name, sizeof client_name, "%s", cname);
    char hs[2 * AUTH_NONCE_LEN + 1], hm[2 * AUTH_MAC_LEN + 1];
    if (auth_random(sn, sizeof sn) != 0 ||
        hs_mac(s->cfg.secret, LABEL_SERVER, cn, sn, s->cfg.self_name, client_name, mac) != 0) {
        send_error(fd, HANDSHAKE_TYPE_METADATA, "server cannot draw a nonce", deadline);
        return;
    }
    auth_hex(sn, sizeof sn, hs);
    auth_hex(mac, sizeof mac, hm);
    if (send_json(fd, HANDSHAKE_TYPE_METADATA,
                  json_pack("{s:{s:s,s:s}}", "disagg_auth", "nonce", hs, "mac", hm), deadline) != 0)
        return;
    uint8_t type;
    char *body;
    uint64_t len;
    int ioerr = 0;
    int fr = recv_frame(fd, deadline, &type, &body, &len, &ioerr);
    if (fr != FRAME_OK) {
        LOG_W(MOD,
              "refused handshake from %s (%s): it closed during authentication instead of "
              "answering the challenge (%s)",
              c->peer, client_name, fr == FRAME_EIO ? strerror(-ioerr) : "bad frame");
        count_refusal(s);
        return;
    }
    json_error_t je;
    json_t *o = json_loadb(body, len, 0, &je);
    free(body);
    json_t *a2 = auth_obj(o);
    const char *perr = jstr(a2, "error");
    if (perr) {
        LOG_W(MOD, "refused handshake from %s (%s): the peer rejected this engine: %s", c->peer,
              client_name, perr);
        count_refusal(s);
    } else if (unhex(jstr(a2, "mac"), mac, sizeof mac) != 0 ||
               hs_mac(s->cfg.secret, LABEL_CLIENT, cn, sn, s->cfg.self_name, client_name, want) !=
                   0 ||
               !auth_equal(mac, want, sizeof mac)) {
        LOG_W(MOD,
              "refused handshake from %s (%s): authentication failed, its proof does not verify "
              "(a different auth_secret / DISAGG_KV_SECRET)",
              c->peer, client_name);
        count_refusal(s);
        send_error(fd, HANDSHAKE_TYPE_METADATA,
                   "authentication failed: the peer's auth_secret differs from this engine's",
                   deadline);
    } else if (then_connect) {
        serve_connect_authed(s, c, deadline);
    } else {
        send_descriptor(s, fd, deadline);
    }
    json_decref(o);
}

static void serve_metadata(handshake_server *s, hs_conn *c, const char *body, uint64_t len,
                           uint64_t deadline) {
    /* The client's descriptor is informative only; it must be a JSON object
     * when present ("{}" is fine). */
    json_error_t je;
    json_t *o = len ? json_loadb(body, len, 0, &je) : json_object();
    if (!o || !json_is_object(o)) {
        send_error(c->fd, HANDSHAKE_TYPE_METADATA, "metadata frame must carry a JSON object",
                   deadline);
        json_decref(o);
        return;
    }
    json_t *au = auth_obj(o);
    if (!s->cfg.secret) {
        if (au)
            LOG_W(MOD,
                  "handshake from %s asks to authenticate, but this engine has no auth_secret "
                  "(kv_connector_extra_config.auth_secret / DISAGG_KV_SECRET): answering without "
                  "a proof, so the peer will refuse this engine",
                  c->peer);
        send_descriptor(s, c->fd, deadline);
    } else if (!au) {
        LOG_W(MOD,
              "refused handshake from %s: it did not authenticate (it has no auth_secret, or is a "
              "plain Mooncake engine); this engine requires the shared secret",
              c->peer);
        count_refusal(s);
        send_error(c->fd, HANDSHAKE_TYPE_METADATA,
                   "authentication required: this disagg engine has an auth_secret; give the peer "
                   "the same kv_connector_extra_config.auth_secret or DISAGG_KV_SECRET",
                   deadline);
    } else {
        serve_auth(s, c, au, deadline);
    }
    json_decref(o);
}

static void serve_connect_frame(handshake_server *s, hs_conn *c, const char *body, uint64_t len,
                                uint64_t deadline) {
    char why[256] = "";
    char *reply = s->cfg.connect(s->cfg.ctx, body, len, why, sizeof why);
    if (reply) {
        send_frame(c->fd, HANDSHAKE_TYPE_CONNECT, reply, deadline);
        free(reply);
    } else {
        LOG_W(MOD, "rdma connect from %s refused: %s", c->peer, why);
        json_t *o = json_pack("{s:s,s:s}", "reply_msg", why, "error", why);
        send_json(c->fd, HANDSHAKE_TYPE_CONNECT, o, deadline);
    }
}

/* Serve one connection: one request frame in, the answer out. */
static void serve_conn(handshake_server *s, hs_conn *c) {
    int fd = c->fd;
    uint64_t deadline = clock_now_ns() + SERVE_DEADLINE_NS;
    uint8_t type;
    char *body;
    uint64_t len;
    int ioerr = 0;
    int fr = recv_frame(fd, deadline, &type, &body, &len, &ioerr);
    if (fr == FRAME_EIO) {
        LOG_D(MOD, "client %s closed or timed out before a full frame", c->peer);
        return;
    }
    if (fr == FRAME_ELEN) {
        LOG_W(MOD, "rejecting handshake frame of %llu bytes from %s (accepted: 1..%u)",
              (unsigned long long)len, c->peer, HANDSHAKE_MAX_FRAME);
        send_error(fd, type, "frame length out of range", deadline);
        return;
    }
    if (fr != FRAME_OK) return;
    if (type == HANDSHAKE_TYPE_METADATA) {
        serve_metadata(s, c, body, len, deadline);
    } else if (type == HANDSHAKE_TYPE_CONNECT && s->cfg.connect && !s->cfg.secret) {
        serve_connect_frame(s, c, body, len, deadline);
    } else if (type == HANDSHAKE_TYPE_CONNECT && s->cfg.connect) {
        LOG_W(MOD,
              "refused rdma connect from %s: it did not authenticate first (this engine has an "
              "auth_secret)",
              c->peer);
        count_refusal(s);
        json_t *o = json_pack("{s:s,s:s}", "reply_msg", "authentication required", "error",
                              "authentication required: this disagg engine has an auth_secret; "
                              "a connect frame must follow the challenge on the same connection");
        send_json(fd, type, o, deadline);
    } else if (type == HANDSHAKE_TYPE_PROBE) {
        send_frame(fd, type, "{\"status\":\"success\"}", deadline); /* Mooncake's answer */
    } else {
        LOG_W(MOD, "handshake from %s: unsupported frame type %u", c->peer, type);
        send_error(fd, type,
                   "unsupported frame type (accepted: 1 metadata, 3 probe, and 0 connect when "
                   "this engine runs rdma; no notify)",
                   deadline);
    }
    free(body);
    /* As Mooncake: shut down our side, let the client close first (so that
     * the answer is never cut by a reset). */
    shutdown(fd, SHUT_WR);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    char tmp[256];
    while (poll(&p, 1, clock_remaining_ms(deadline)) > 0 && read(fd, tmp, sizeof tmp) > 0) {
    }
}

/* Each connection on its own short-lived thread, so that a silent client
 * (up to SERVE_DEADLINE_NS) never holds up the others. */
static void *conn_main(void *arg) {
    hs_conn *c = arg;
    handshake_server *s = c->s;
    serve_conn(s, c);
    close(c->fd);
    free(c);
    if (s->cfg.secret) auth_thread_stop(); /* before stop() can see this thread done */
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
        net_addr from;
        socklen_t fl = sizeof from.ss;
        int fd = accept4(s->listen_fd, (struct sockaddr *)&from.ss, &fl, SOCK_CLOEXEC);
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
        if (c) {
            c->s = s;
            c->fd = fd;
            from.len = fl;
            net_addr_format(&from, c->peer, sizeof c->peer);
        }
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

int handshake_server_start(const net_addr *addr, const handshake_server_cfg *cfg,
                           handshake_server **out) {
    handshake_server *s = calloc(1, sizeof *s);
    if (!s) return TRANSFER_ENOMEM;
    s->cfg = *cfg;
    if (s->cfg.secret && !*s->cfg.secret) s->cfg.secret = NULL;
    if (!s->cfg.self_name) s->cfg.self_name = "";
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
    if (s->cfg.bound) s->cfg.bound(s->cfg.ctx, net_addr_port(&bound)); /* before any client */
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

/* ---- client ---------------------------------------------------------------- */

static int io_error(int rc) {
    return rc == -ETIMEDOUT ? TRANSFER_ETIMEDOUT : TRANSFER_ECONN;
}

/* Read one answer frame of type METADATA as JSON (caller decrefs *o) and its
 * raw body (caller frees *raw, may be NULL). */
static int recv_answer(int fd, const char *a, uint64_t deadline, json_t **o, char **raw,
                       uint64_t *rawlen, char *err, size_t cap) {
    uint8_t type = 0;
    char *body;
    uint64_t len = 0;
    int ioerr = 0;
    *o = NULL;
    int fr = recv_frame(fd, deadline, &type, &body, &len, &ioerr);
    if (fr == FRAME_EIO) {
        snprintf(err, cap, "handshake with %s failed: %s", a, strerror(-ioerr));
        return io_error(ioerr);
    }
    if (fr == FRAME_ENOMEM) return TRANSFER_ENOMEM;
    if (fr != FRAME_OK || type != HANDSHAKE_TYPE_METADATA) {
        free(body);
        snprintf(err, cap, "handshake with %s: unexpected reply frame (type %u, %llu bytes)", a,
                 type, (unsigned long long)len);
        return TRANSFER_EPROTO;
    }
    json_error_t je;
    *o = json_loadb(body, len, 0, &je);
    const char *perr = jstr(*o, "error");
    if (perr) {
        snprintf(err, cap, "peer %s refused the handshake: %s", a, perr);
        int auth = strstr(perr, "authentication") != NULL;
        json_decref(*o);
        *o = NULL;
        free(body);
        return auth ? TRANSFER_EAUTH : TRANSFER_EPROTO;
    }
    if (raw) {
        *raw = body;
        *rawlen = len;
    } else {
        free(body);
    }
    return 0;
}

/* The secret's exchange; on success the descriptor's JSON is in *raw. */
static int client_auth(int fd, const char *a, const char *peer_name, const char *self_name,
                       const char *secret, const char *then, uint64_t deadline, char **raw,
                       uint64_t *rawlen, char *err, size_t cap) {
    uint8_t cn[AUTH_NONCE_LEN], sn[AUTH_NONCE_LEN], mac[AUTH_MAC_LEN], want[AUTH_MAC_LEN];
    char hx[2 * AUTH_MAC_LEN + 1];
    if (auth_random(cn, sizeof cn) != 0) {
        snprintf(err, cap, "cannot draw a nonce");
        return TRANSFER_ESYS;
    }
    auth_hex(cn, sizeof cn, hx);
    json_t *req =
        json_pack("{s:{s:i,s:s,s:s}}", "disagg_auth", "version", 1, "nonce", hx, "name", self_name);
    if (req && then)
        json_object_set_new(json_object_get(req, "disagg_auth"), "then", json_string(then));
    int rc = send_json(fd, HANDSHAKE_TYPE_METADATA, req, deadline);
    if (rc) {
        snprintf(err, cap, "handshake with %s failed: %s", a, strerror(-rc));
        return io_error(rc);
    }
    json_t *o = NULL;
    rc = recv_answer(fd, a, deadline, &o, NULL, NULL, err, cap);
    if (rc) return rc;
    json_t *au = auth_obj(o);
    if (!au || unhex(jstr(au, "nonce"), sn, sizeof sn) != 0 ||
        unhex(jstr(au, "mac"), mac, sizeof mac) != 0) {
        json_decref(o);
        snprintf(err, cap,
                 "peer %s did not authenticate: it answered without a proof (it has no "
                 "auth_secret / DISAGG_KV_SECRET, or is a plain Mooncake engine); refusing it",
                 a);
        return TRANSFER_EAUTH;
    }
    json_decref(o);
    if (hs_mac(secret, LABEL_SERVER, cn, sn, peer_name, self_name, want) != 0 ||
        !auth_equal(mac, want, sizeof mac)) {
        send_json(fd, HANDSHAKE_TYPE_METADATA,
                  json_pack("{s:{s:s}}", "disagg_auth", "error",
                            "authentication failed: the server's proof does not verify "
                            "(a different auth_secret)"),
                  deadline);
        snprintf(err, cap,
                 "peer %s failed authentication: its proof does not verify (a different "
                 "auth_secret / DISAGG_KV_SECRET, or it is not the segment %s)",
                 a, peer_name);
        return TRANSFER_EAUTH;
    }
    if (hs_mac(secret, LABEL_CLIENT, cn, sn, peer_name, self_name, mac) != 0) return TRANSFER_ESYS;
    auth_hex(mac, sizeof mac, hx);
    rc = send_json(fd, HANDSHAKE_TYPE_METADATA, json_pack("{s:{s:s}}", "disagg_auth", "mac", hx),
                   deadline);
    if (rc) {
        snprintf(err, cap, "handshake with %s failed: %s", a, strerror(-rc));
        return io_error(rc);
    }
    rc = recv_answer(fd, a, deadline, &o, raw, rawlen, err, cap);
    json_decref(o);
    return rc;
}

int handshake_fetch(const net_addr *peer, const char *peer_name, const char *self_name,
                    const char *my_json, const char *secret, uint64_t deadline_ns,
                    segment_desc *out, char *err, size_t cap) {
    char a[80];
    net_addr_format(peer, a, sizeof a);
    if (secret && !*secret) secret = NULL;
    int fd = net_connect(peer, NULL, deadline_ns);
    if (fd < 0) {
        snprintf(err, cap, "cannot connect to handshake port %s: %s", a, strerror(-fd));
        return io_error(fd);
    }
    char *body = NULL;
    uint64_t len = 0;
    int rc;
    if (secret) {
        rc = client_auth(fd, a, peer_name ? peer_name : a, self_name ? self_name : "", secret, NULL,
                         deadline_ns, &body, &len, err, cap);
    } else {
        rc = send_frame(fd, HANDSHAKE_TYPE_METADATA, my_json ? my_json : "{}", deadline_ns);
        if (rc) {
            snprintf(err, cap, "handshake with %s failed: %s", a, strerror(-rc));
            rc = io_error(rc);
        } else {
            json_t *o = NULL;
            rc = recv_answer(fd, a, deadline_ns, &o, &body, &len, err, cap);
            json_decref(o);
        }
    }
    close(fd);
    if (rc) {
        free(body);
        return rc;
    }
    rc = segment_desc_decode(body, len, out, err, cap);
    free(body);
    return rc;
}

int handshake_connect(const net_addr *peer, const char *peer_name, const char *self_name,
                      const char *secret, const char *body, uint64_t deadline_ns, char **reply,
                      size_t *reply_len, char *err, size_t cap) {
    char a[80];
    net_addr_format(peer, a, sizeof a);
    *reply = NULL;
    int fd = net_connect(peer, NULL, deadline_ns);
    if (fd < 0) {
        snprintf(err, cap, "cannot connect to handshake port %s: %s", a, strerror(-fd));
        return io_error(fd);
    }
    int rc = 0;
    if (secret && *secret) { /* authenticate this connection, then connect on it */
        char *ok = NULL;
        uint64_t oklen = 0;
        rc = client_auth(fd, a, peer_name ? peer_name : a, self_name ? self_name : "", secret,
                         "connect", deadline_ns, &ok, &oklen, err, cap);
        if (rc == 0) {
            json_t *o = json_loadb(ok, oklen, 0, NULL);
            json_t *au = auth_obj(o);
            if (!au || !json_is_true(json_object_get(au, "ok"))) {
                snprintf(err, cap,
                         "peer %s answered the authenticated connect without its ok (an engine "
                         "without authenticated rdma?)",
                         a);
                rc = TRANSFER_EPROTO;
            }
            json_decref(o);
        }
        free(ok);
        if (rc) {
            close(fd);
            return rc;
        }
    }
    rc = send_frame(fd, HANDSHAKE_TYPE_CONNECT, body, deadline_ns);
    uint8_t type = 0;
    char *rb = NULL;
    uint64_t len = 0;
    int ioerr = 0;
    if (rc) {
        snprintf(err, cap, "connect handshake with %s failed: %s", a, strerror(-rc));
        rc = io_error(rc);
    } else {
        int fr = recv_frame(fd, deadline_ns, &type, &rb, &len, &ioerr);
        if (fr == FRAME_EIO) {
            snprintf(err, cap, "connect handshake with %s failed: %s", a, strerror(-ioerr));
            rc = io_error(ioerr);
        } else if (fr != FRAME_OK || type != HANDSHAKE_TYPE_CONNECT) {
            snprintf(err, cap, "connect handshake with %s: unexpected reply (type %u)", a, type);
            rc = TRANSFER_EPROTO;
        }
    }
    close(fd);
    if (rc == 0) {
        json_t *o = json_loadb(rb, len, 0, NULL);
        const char *e = jstr(o, "error");
        if (!e) e = jstr(o, "reply_msg");
        if (e && *e) {
            snprintf(err, cap, "peer %s refused the connection: %s", a, e);
            rc = TRANSFER_EPROTO;
        }
        json_decref(o);
    }
    if (rc) {
        free(rb);
        return rc;
    }
    *reply = rb;
    *reply_len = (size_t)len;
    return 0;
}
