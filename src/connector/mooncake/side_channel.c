/* side_channel — see side_channel.h.  Parts: the process-wide ZeroMQ context,
 * the reply hub shared by the server thread and the handler's threads, the
 * ROUTER server thread, the DEALER client. */
#include "connector/mooncake/side_channel.h"

#include "base/auth.h"
#include "base/clock.h"
#include "base/log.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define MOD          "side-channel"
#define HARD_MAX_MSG ((int64_t)SIDE_CHANNEL_MAX_MSG_BYTES * 4) /* ZeroMQ drops larger peers */
#define MAX_IDENTITY 256

/* ---- process-wide context ---------------------------------------------- */

static void *g_ctx;
static pthread_once_t g_ctx_once = PTHREAD_ONCE_INIT;
/* libzmq's default of 1,023 sockets per context is below what a decoder at its
 * cap of remote loads needs (a pull has its DEALER and two monitor sockets): a
 * decoder at ~340 pulls got "zmq_socket: Too many open files".  Every socket
 * also takes file descriptors (its mailbox, its connection): the process raises
 * RLIMIT_NOFILE to its hard limit at start (net_raise_nofile_limit). */
static void ctx_init(void) {
    g_ctx = zmq_ctx_new();
    if (!g_ctx) return;
    int limit = zmq_ctx_get(g_ctx, ZMQ_SOCKET_LIMIT);
    int want = SIDE_CHANNEL_MAX_SOCKETS;
    if (limit > 0 && want > limit) want = limit;
    if (zmq_ctx_set(g_ctx, ZMQ_MAX_SOCKETS, want) != 0)
        LOG_W(MOD, "cannot raise ZeroMQ's socket limit to %d: %s", want, zmq_strerror(zmq_errno()));
}
static void *zctx(void) {
    pthread_once(&g_ctx_once, ctx_init);
    return g_ctx;
}

/* ---- auth frames (side_channel.h, docs/security.md) ---------------------- */

#define AUTH_TAG       "DKA1"
#define AUTH_TAG_LEN   4
#define AUTH_NONCE     16
#define AUTH_OFF_KIND  4
#define AUTH_OFF_CTR   5
#define AUTH_OFF_NONCE 13
#define AUTH_OFF_MAC   29
#define SECRET_MAX     256
_Static_assert(AUTH_OFF_MAC + AUTH_MAC_LEN == SIDE_CHANNEL_AUTH_LEN, "auth frame layout");

static const char PULL_LABEL[] = "disagg-sc-pull-v1";
static const char REPLY_LABEL[] = "disagg-sc-reply-v1";
static const char CANCEL_LABEL[] = "disagg-sc-cancel-v1";

static void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}
static uint64_t get_be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}
static uint64_t wall_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* The MAC of an auth frame whose header (kind, counter, nonce) is filled. */
static int auth_frame_mac(const char *secret, const unsigned char *f, const void *payload,
                          size_t len, unsigned char mac[AUTH_MAC_LEN]) {
    const char *label = f[AUTH_OFF_KIND] == 'P'   ? PULL_LABEL
                        : f[AUTH_OFF_KIND] == 'C' ? CANCEL_LABEL
                                                  : REPLY_LABEL;
    const void *parts[4] = {label, f + AUTH_OFF_CTR, f + AUTH_OFF_NONCE, payload};
    size_t lens[4] = {strlen(label), 8, AUTH_NONCE, len};
    return auth_hmacv(secret, strlen(secret), parts, lens, 4, mac);
}

static int auth_frame_make(const char *secret, char kind, uint64_t ctr,
                           const unsigned char nonce[AUTH_NONCE], const void *payload, size_t len,
                           unsigned char out[SIDE_CHANNEL_AUTH_LEN]) {
    memcpy(out, AUTH_TAG, AUTH_TAG_LEN);
    out[AUTH_OFF_KIND] = (unsigned char)kind;
    put_be64(out + AUTH_OFF_CTR, ctr);
    memcpy(out + AUTH_OFF_NONCE, nonce, AUTH_NONCE);
    return auth_frame_mac(secret, out, payload, len, out + AUTH_OFF_MAC);
}

/* A frame that has the shape of an auth frame of the given kind. */
static int auth_frame_shaped(const void *f, size_t flen, char kind) {
    const unsigned char *b = f;
    return flen == SIDE_CHANNEL_AUTH_LEN && memcmp(b, AUTH_TAG, AUTH_TAG_LEN) == 0 &&
           b[AUTH_OFF_KIND] == (unsigned char)kind;
}

static int auth_frame_mac_ok(const char *secret, const unsigned char *f, const void *payload,
                             size_t len) {
    unsigned char mac[AUTH_MAC_LEN];
    return auth_frame_mac(secret, f, payload, len, mac) == 0 &&
           auth_equal(mac, f + AUTH_OFF_MAC, AUTH_MAC_LEN);
}

/* ---- reply hub ------------------------------------------------------------ */

typedef struct sc_out {
    struct sc_out *next;            /* FIFO link */
    size_t id_len;                  /* routing id of the DEALER */
    unsigned char id[MAX_IDENTITY]; /* (id_len) */
    char *data;                     /* (len) encoded reply, malloc'd */
    size_t len;
    int has_auth;                              /* auth is sent as a second frame */
    unsigned char auth[SIDE_CHANNEL_AUTH_LEN]; /* the reply's auth frame */
} sc_out;

typedef struct sc_hub {
    pthread_mutex_t mu;      /* guards everything below */
    int refs;                /* the server + every unreleased call */
    int closed;              /* the server stopped: replies are refused */
    int pending;             /* calls handed out and not finished */
    sc_out *head, *tail;     /* replies waiting for the server thread */
    int wake[2];             /* pipe: a byte per queued reply wakes the server thread */
    char secret[SECRET_MAX]; /* shared secret, "" = none (immutable after start) */
} sc_hub;

struct side_channel_call {
    sc_hub *hub;                     /* shared with the server */
    size_t id_len;                   /* routing id of the DEALER */
    unsigned char id[MAX_IDENTITY];  /* (id_len) */
    unsigned char nonce[AUTH_NONCE]; /* the authenticated pull's nonce (secret set) */
    uint64_t seq;                    /* next reply's sequence number (under hub->mu) */
    uint64_t conn;                   /* the connection it came on (0 = not known) */
};

static void hub_unref_locked_and_unlock(sc_hub *h) {
    int last = --h->refs == 0;
    pthread_mutex_unlock(&h->mu);
    if (!last) return;
    for (sc_out *o = h->head, *n; o; o = n) {
        n = o->next;
        free(o->data);
        free(o);
    }
    close(h->wake[0]);
    close(h->wake[1]);
    pthread_mutex_destroy(&h->mu);
    free(h);
}

int side_channel_call_reply(side_channel_call *call, const side_channel_reply *r) {
    if (!call || !r) return SIDE_CHANNEL_EINVAL;
    int final = r->status != SIDE_CHANNEL_CONTINUE;
    sc_out *o = calloc(1, sizeof *o);
    int rc = o ? side_channel_reply_encode(r, &o->data, &o->len) : SIDE_CHANNEL_ENOMEM;
    sc_hub *h = call->hub;
    pthread_mutex_lock(&h->mu);
    if (rc == 0 && h->closed) rc = SIDE_CHANNEL_ECLOSED;
    if (rc == 0 && h->secret[0]) { /* MAC'd in queue order: seq matches the wire order */
        if (auth_frame_make(h->secret, 'R', call->seq, call->nonce, o->data, o->len, o->auth) == 0)
            o->has_auth = 1, call->seq++;
        else
            rc = SIDE_CHANNEL_EIO;
    }
    if (rc == 0) {
        o->id_len = call->id_len;
        memcpy(o->id, call->id, call->id_len);
        if (h->tail)
            h->tail->next = o;
        else
            h->head = o;
        h->tail = o;
        char b = 1;
        if (write(h->wake[1], &b, 1) < 0) { /* full pipe: the thread is awake anyway */
        }
        o = NULL;
    }
    if (o) {
        free(o->data);
        free(o);
    }
    if (!final) {
        pthread_mutex_unlock(&h->mu);
        return rc;
    }
    h->pending--;
    free(call);
    hub_unref_locked_and_unlock(h);
    return rc;
}

uint64_t side_channel_call_conn(const side_channel_call *call) {
    return call ? call->conn : 0;
}

int side_channel_call_peer_is(const side_channel_call *call, const void *peer, size_t peer_len) {
    if (!call) return 0;
    size_t extra = call->hub->secret[0] ? AUTH_NONCE : 0; /* immutable after start */
    return peer_len == call->id_len + extra && memcmp(call->id, peer, call->id_len) == 0 &&
           (!extra || memcmp(call->nonce, (const unsigned char *)peer + call->id_len, extra) == 0);
}

void side_channel_pull_release(side_channel_pull *pull) {
    if (!pull) return;
    side_channel_pull_free(pull);
    free(pull);
}

/* ---- server ---------------------------------------------------------------- */

struct side_channel_server {
    void *router;            /* ZMQ_ROUTER, used only by the thread once started */
    uint16_t port;           /* bound port */
    side_channel_pull_fn fn; /* the producer's handler */
    _Atomic(side_channel_cancel_fn) cancel_fn; /* its cancel handler, or NULL */
    void *ud;                                  /* its argument */
    sc_hub *hub;                               /* replies from any thread */
    atomic_int stop;                           /* set by stop() */
    pthread_t thread;                          /* the loop */
    atomic_uint_fast64_t auth_rejected;        /* messages refused for authentication */
    uint64_t auth_logged_ns;                   /* last rejection log line (server thread only) */
    uint64_t auth_unlogged;                    /* rejections since that line */
    /* Connections (server thread only): a monitor reports accepts and
     * disconnects by file descriptor; conn_of[fd] is the accepted
     * connection's number (0 = none), so that a decoder that goes away
     * (crash, kill -9) is reported with the pulls it left (gone_fn). */
    void *mon;         /* PAIR reading the ROUTER's monitor, or NULL */
    uint64_t *conn_of; /* (n_conn_of) by fd */
    size_t n_conn_of;
    uint64_t next_conn;
    _Atomic(side_channel_gone_fn) gone_fn; /* the producer's handler, or NULL */
};

static void send_frames(void *router, const unsigned char *id, size_t id_len, const void *data,
                        size_t len, const unsigned char *auth) {
    if (zmq_send(router, id, id_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(router, data, len, ZMQ_DONTWAIT | (auth ? ZMQ_SNDMORE : 0)) < 0 ||
        (auth && zmq_send(router, auth, SIDE_CHANNEL_AUTH_LEN, ZMQ_DONTWAIT) < 0))
        LOG_W(MOD, "dropping a reply: %s", zmq_strerror(zmq_errno()));
}

static void send_error(void *router, const unsigned char *id, size_t id_len, const char *msg) {
    side_channel_reply r = {.status = SIDE_CHANNEL_ERROR, .err_msg = (char *)msg};
    char *buf;
    size_t len;
    if (side_channel_reply_encode(&r, &buf, &len) == 0) {
        send_frames(router, id, id_len, buf, len, NULL);
        free(buf);
    }
}

static void flush_replies(side_channel_server *s) {
    pthread_mutex_lock(&s->hub->mu);
    sc_out *o = s->hub->head;
    s->hub->head = s->hub->tail = NULL;
    pthread_mutex_unlock(&s->hub->mu);
    while (o) {
        sc_out *n = o->next;
        send_frames(s->router, o->id, o->id_len, o->data, o->len, o->has_auth ? o->auth : NULL);
        free(o->data);
        free(o);
        o = n;
    }
}

/* Refuse a pull or cancel for authentication: count it, answer ERROR
 * (unauthenticated: the peer may not share the secret), log at most one line
 * per 10 s. */
static void auth_refuse(side_channel_server *s, const unsigned char *id, size_t id_len,
                        const char *why) {
    atomic_fetch_add(&s->auth_rejected, 1);
    s->auth_unlogged++;
    uint64_t now = clock_now_ns();
    if (!s->auth_logged_ns || now - s->auth_logged_ns >= 10 * NS_PER_S) {
        LOG_W(MOD,
              "refusing %" PRIu64 " side-channel pull(s) or cancel(s) (%" PRIu64 " in all): %s",
              s->auth_unlogged, (uint64_t)atomic_load(&s->auth_rejected), why);
        s->auth_logged_ns = now;
        s->auth_unlogged = 0;
    }
    send_error(s->router, id, id_len, why);
}

/* The payload names the cancel key (cheap; only decoding tells for sure). */
static int looks_like_cancel(zmq_msg_t *payload) {
    static const char key[] = SIDE_CHANNEL_CANCEL_KEY;
    return memmem(zmq_msg_data(payload), zmq_msg_size(payload), key, sizeof key - 1) != NULL;
}

/* With a secret: NULL when the message's auth frame is valid (*kind = 'P' for
 * a pull, 'C' for a cancel; *nonce = its nonce), else why not.  Without one:
 * NULL unless the peer sent an auth frame. */
static const char *auth_check_msg(side_channel_server *s, int frames, zmq_msg_t *payload,
                                  zmq_msg_t *af, char *buf, size_t cap, unsigned char *nonce,
                                  char *kind) {
    const char *secret = s->hub->secret;
    const unsigned char *f = frames == 2 ? zmq_msg_data(af) : NULL;
    size_t flen = frames == 2 ? zmq_msg_size(af) : 0;
    int shaped = f && (auth_frame_shaped(f, flen, 'P') || auth_frame_shaped(f, flen, 'C'));
    const char *what = shaped ? (f[AUTH_OFF_KIND] == 'C' ? "cancel" : "pull")
                              : (looks_like_cancel(payload) ? "cancel" : "pull");
    *kind = 0;
    if (!secret[0]) {
        if (!shaped) return NULL;
        snprintf(buf, cap,
                 "the %s carries an authentication frame but this producer has no auth_secret: "
                 "set the same secret (kv_connector_extra_config.auth_secret or "
                 "DISAGG_KV_SECRET) on both sides, or on neither",
                 what);
        return buf;
    }
    if (frames == 1) {
        snprintf(buf, cap,
                 "unauthenticated %s refused: this producer requires the shared secret "
                 "(kv_connector_extra_config.auth_secret or DISAGG_KV_SECRET) and the %s carried "
                 "no authentication frame",
                 what, what);
        return buf;
    }
    if (!shaped) {
        snprintf(buf, cap,
                 "%s refused: expected the %s and a %d-byte authentication frame, got %d frame(s)",
                 what, what, SIDE_CHANNEL_AUTH_LEN, frames);
        return buf;
    }
    int64_t skew = (int64_t)(wall_ms() - get_be64(f + AUTH_OFF_CTR));
    if (skew > SIDE_CHANNEL_AUTH_SKEW_S * 1000LL || skew < -SIDE_CHANNEL_AUTH_SKEW_S * 1000LL) {
        snprintf(buf, cap,
                 "%s refused: its timestamp is %.0f s off this producer's clock (accepted: "
                 "within %d s; are the hosts' clocks synchronized?)",
                 what, (double)skew / 1000.0, SIDE_CHANNEL_AUTH_SKEW_S);
        return buf;
    }
    if (!auth_frame_mac_ok(secret, f, zmq_msg_data(payload), zmq_msg_size(payload))) {
        snprintf(buf, cap,
                 "%s authentication failed: the MAC does not match (the decoder's auth_secret "
                 "differs from this producer's)",
                 what);
        return buf;
    }
    memcpy(nonce, f + AUTH_OFF_NONCE, AUTH_NONCE);
    *kind = (char)f[AUTH_OFF_KIND];
    return NULL;
}

/* A cancel (side_channel_msg.h) is handed to the cancel handler; returns 0
 * when the payload is not a cancel (then it is decoded as a pull) — unless
 * must (its auth frame says cancel): then that is an error too.  The peer
 * the handler gets is the routing id, followed with a secret by the nonce
 * the cancel was authenticated with (side_channel_call_peer_is compares
 * both: a cancel ends only the pull it was MAC'd for). */
static int handle_cancel(side_channel_server *s, const unsigned char *id, size_t id_len,
                         zmq_msg_t *payload, const unsigned char *nonce, int must) {
    const void *buf = zmq_msg_data(payload);
    size_t len = zmq_msg_size(payload);
    if (!must && !looks_like_cancel(payload)) return 0; /* pulls never carry the key */
    side_channel_cancel c;
    char err[512];
    int rc = side_channel_cancel_decode(buf, len, &c, err, sizeof err);
    if (rc == 1 && !must) return 0;
    if (rc == 1) {
        snprintf(err, sizeof err,
                 "side-channel cancel: the message authenticated as a cancel has no '%s' key",
                 SIDE_CHANNEL_CANCEL_KEY);
        rc = SIDE_CHANNEL_EINVAL;
    }
    side_channel_cancel_fn fn = atomic_load(&s->cancel_fn);
    if (rc < 0) {
        LOG_W(MOD, "rejecting a cancel: %s", err);
        send_error(s->router, id, id_len, err);
    } else if (!fn) {
        send_error(s->router, id, id_len, "side-channel cancel: not supported by this producer");
    } else {
        unsigned char peer[MAX_IDENTITY + AUTH_NONCE];
        size_t peer_len = id_len;
        memcpy(peer, id, id_len);
        if (s->hub->secret[0]) {
            memcpy(peer + id_len, nonce, AUTH_NONCE);
            peer_len += AUTH_NONCE;
        }
        fn(s->ud, peer, peer_len, &c);
    }
    side_channel_cancel_free(&c);
    return 1;
}

void side_channel_server_set_cancel_fn(side_channel_server *s, side_channel_cancel_fn fn) {
    atomic_store(&s->cancel_fn, fn);
}

void side_channel_server_set_gone_fn(side_channel_server *s, side_channel_gone_fn fn) {
    atomic_store(&s->gone_fn, fn);
}

/* Read the ROUTER monitor's waiting events: an accept numbers its connection,
 * a disconnect reports it gone. */
static void drain_monitor(side_channel_server *s) {
    for (int k = 0; s->mon && k < 1024; k++) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, s->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return;
        }
        uint16_t event = 0;
        uint32_t value = 0;
        if (zmq_msg_size(&ev) >= 6) {
            memcpy(&event, zmq_msg_data(&ev), 2);
            memcpy(&value, (char *)zmq_msg_data(&ev) + 2, 4);
        }
        while (zmq_msg_more(&ev)) { /* the endpoint frame */
            zmq_msg_close(&ev);
            zmq_msg_init(&ev);
            if (zmq_msg_recv(&ev, s->mon, 0) < 0) break;
        }
        zmq_msg_close(&ev);
        size_t fd = value;
        if (fd >= (1u << 22)) continue;
        if (event == ZMQ_EVENT_ACCEPTED) {
            if (fd >= s->n_conn_of) {
                size_t n = s->n_conn_of ? s->n_conn_of : 256;
                while (n <= fd)
                    n *= 2;
                uint64_t *t = realloc(s->conn_of, n * sizeof *t);
                if (!t) continue;
                memset(t + s->n_conn_of, 0, (n - s->n_conn_of) * sizeof *t);
                s->conn_of = t;
                s->n_conn_of = n;
            }
            s->conn_of[fd] = ++s->next_conn;
        } else if (event == ZMQ_EVENT_DISCONNECTED && fd < s->n_conn_of && s->conn_of[fd]) {
            uint64_t conn = s->conn_of[fd];
            s->conn_of[fd] = 0;
            side_channel_gone_fn fn = atomic_load(&s->gone_fn);
            if (fn) fn(s->ud, conn);
        }
    }
}

/* The connection number of the message's connection (after the monitor's
 * events that precede it: its accept is reported before its first message). */
static uint64_t msg_conn(side_channel_server *s, zmq_msg_t *m) {
    if (!s->mon) return 0;
    drain_monitor(s);
    int fd = zmq_msg_get(m, ZMQ_SRCFD);
    return fd >= 0 && (size_t)fd < s->n_conn_of ? s->conn_of[fd] : 0;
}

/* Receive one whole multipart message if there is one; 0 = nothing waiting. */
static int handle_incoming(side_channel_server *s) {
    zmq_msg_t id, part;
    zmq_msg_init(&id);
    if (zmq_msg_recv(&id, s->router, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&id);
        return 0;
    }
    int frames = 0, more = zmq_msg_more(&id);
    zmq_msg_t payload, af;
    zmq_msg_init(&payload);
    zmq_msg_init(&af);
    while (more) {
        zmq_msg_init(&part);
        int got = zmq_msg_recv(&part, s->router, 0) >= 0;
        more = got && zmq_msg_more(&part);
        if (got && ++frames == 1) zmq_msg_copy(&payload, &part);
        if (got && frames == 2) zmq_msg_copy(&af, &part);
        zmq_msg_close(&part);
        if (!got) break;
    }
    size_t id_len = zmq_msg_size(&id);
    if (id_len > MAX_IDENTITY) id_len = MAX_IDENTITY;
    const unsigned char *idp = zmq_msg_data(&id);
    char why_buf[320], kind = 0;
    unsigned char nonce[AUTH_NONCE] = {0};
    const char *why = frames >= 1 ? auth_check_msg(s, frames, &payload, &af, why_buf,
                                                   sizeof why_buf, nonce, &kind)
                                  : NULL;
    if (why) {
        auth_refuse(s, idp, id_len, why);
    } else if (frames != (s->hub->secret[0] ? 2 : 1)) {
        char msg[128];
        snprintf(msg, sizeof msg, "side-channel pull: expected one frame, got %d", frames);
        LOG_W(MOD, "%s", msg);
        send_error(s->router, idp, id_len, msg);
    } else if ((!s->hub->secret[0] || kind == 'C') &&
               handle_cancel(s, idp, id_len, &payload, nonce, kind == 'C')) {
        /* a cancel: handled */
    } else {
        side_channel_pull *pull = calloc(1, sizeof *pull);
        side_channel_call *call = calloc(1, sizeof *call);
        char err[512];
        int rc = pull && call
                     ? side_channel_pull_decode(zmq_msg_data(&payload), zmq_msg_size(&payload),
                                                pull, err, sizeof err)
                     : (snprintf(err, sizeof err, "out of memory"), SIDE_CHANNEL_ENOMEM);
        if (rc) {
            LOG_W(MOD, "rejecting a pull: %s", err);
            send_error(s->router, idp, id_len, err);
            free(pull);
            free(call);
        } else {
            call->hub = s->hub;
            call->conn = msg_conn(s, &payload);
            call->id_len = id_len;
            memcpy(call->id, idp, id_len);
            memcpy(call->nonce, nonce, AUTH_NONCE);
            pthread_mutex_lock(&s->hub->mu);
            s->hub->refs++;
            s->hub->pending++;
            pthread_mutex_unlock(&s->hub->mu);
            s->fn(s->ud, call, pull); /* owns pull and call from here */
        }
    }
    zmq_msg_close(&payload);
    zmq_msg_close(&af);
    zmq_msg_close(&id);
    return 1;
}

static void *server_main(void *arg) {
    side_channel_server *s = arg;
    zmq_pollitem_t items[3] = {{s->router, 0, ZMQ_POLLIN, 0},
                               {NULL, s->hub->wake[0], ZMQ_POLLIN, 0},
                               {s->mon, 0, ZMQ_POLLIN, 0}};
    while (!atomic_load(&s->stop)) {
        if (zmq_poll(items, s->mon ? 3 : 2, 1000) < 0) {
            if (zmq_errno() == EINTR) continue;
            LOG_E(MOD, "zmq_poll: %s", zmq_strerror(zmq_errno()));
            break;
        }
        if (items[1].revents & ZMQ_POLLIN) {
            char buf[256];
            while (read(s->hub->wake[0], buf, sizeof buf) > 0) {
            }
        }
        flush_replies(s);
        for (int i = 0; i < 64 && handle_incoming(s); i++) {
        }
        drain_monitor(s);
        flush_replies(s);
    }
    return NULL;
}

int side_channel_server_start(const char *bind_host, uint16_t port, side_channel_pull_fn fn,
                              void *ud, side_channel_server **out, char *err, size_t err_cap) {
    return side_channel_server_start_auth(bind_host, port, NULL, fn, ud, out, err, err_cap);
}

int side_channel_server_start_auth(const char *bind_host, uint16_t port, const char *secret,
                                   side_channel_pull_fn fn, void *ud, side_channel_server **out,
                                   char *err, size_t err_cap) {
    *out = NULL;
    if (!fn) {
        snprintf(err, err_cap, "side channel: a pull handler is required");
        return SIDE_CHANNEL_EINVAL;
    }
    if (secret && strlen(secret) >= SECRET_MAX) {
        snprintf(err, err_cap, "side channel: the secret is longer than %d bytes", SECRET_MAX - 1);
        return SIDE_CHANNEL_EINVAL;
    }
    if (!bind_host || !bind_host[0]) bind_host = "0.0.0.0";
    side_channel_server *s = calloc(1, sizeof *s);
    sc_hub *h = calloc(1, sizeof *h);
    if (!s || !h) {
        free(s);
        free(h);
        return SIDE_CHANNEL_ENOMEM;
    }
    s->fn = fn;
    s->ud = ud;
    s->hub = h;
    h->refs = 1;
    if (secret) snprintf(h->secret, sizeof h->secret, "%s", secret);
    pthread_mutex_init(&h->mu, NULL);
    if (pipe2(h->wake, O_NONBLOCK | O_CLOEXEC) != 0) {
        snprintf(err, err_cap, "side channel: pipe: %s", strerror(errno));
        pthread_mutex_destroy(&h->mu);
        free(h);
        free(s);
        return SIDE_CHANNEL_EIO;
    }
    int v6 = strchr(bind_host, ':') != NULL, linger = 0, one = 1;
    int64_t maxmsg = HARD_MAX_MSG;
    char ep[300];
    if (port)
        snprintf(ep, sizeof ep, "tcp://%s%s%s:%u", v6 ? "[" : "", bind_host, v6 ? "]" : "",
                 (unsigned)port);
    else
        snprintf(ep, sizeof ep, "tcp://%s%s%s:*", v6 ? "[" : "", bind_host, v6 ? "]" : "");
    s->router = zmq_socket(zctx(), ZMQ_ROUTER);
    if (!s->router) goto zfail;
    zmq_setsockopt(s->router, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s->router, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    int backlog = 1024; /* a burst of decoders' pulls connects at once (default 100) */
    zmq_setsockopt(s->router, ZMQ_BACKLOG, &backlog, sizeof backlog);
    if (v6) zmq_setsockopt(s->router, ZMQ_IPV6, &one, sizeof one);
    if (zmq_bind(s->router, ep) != 0) goto zfail;
    char mon_ep[64];
    snprintf(mon_ep, sizeof mon_ep, "inproc://side-channel-router-%p", (void *)s);
    if (zmq_socket_monitor(s->router, mon_ep, ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED) == 0) {
        s->mon = zmq_socket(zctx(), ZMQ_PAIR);
        if (s->mon && zmq_connect(s->mon, mon_ep) != 0) {
            zmq_close(s->mon);
            s->mon = NULL;
        }
        if (!s->mon) zmq_socket_monitor(s->router, NULL, 0);
    }
    char last[300];
    size_t last_len = sizeof last;
    zmq_getsockopt(s->router, ZMQ_LAST_ENDPOINT, last, &last_len);
    const char *colon = strrchr(last, ':');
    s->port = colon ? (uint16_t)atoi(colon + 1) : port;
    int rc = pthread_create(&s->thread, NULL, server_main, s);
    if (rc) {
        errno = rc;
        goto zfail;
    }
    LOG_I(MOD, "side channel ROUTER bound on %s (%s)", last,
          h->secret[0] ? "pulls and cancels authenticated with the shared secret"
                       : "no authentication");
    *out = s;
    return 0;
zfail:
    snprintf(err, err_cap, "side channel: cannot bind ROUTER on %s: %s", ep,
             zmq_strerror(zmq_errno()));
    if (s->mon) {
        zmq_socket_monitor(s->router, NULL, 0);
        zmq_close(s->mon);
    }
    if (s->router) zmq_close(s->router);
    pthread_mutex_lock(&h->mu);
    hub_unref_locked_and_unlock(h);
    free(s);
    return SIDE_CHANNEL_EIO;
}

uint16_t side_channel_server_port(const side_channel_server *s) {
    return s->port;
}

uint64_t side_channel_server_auth_rejected(side_channel_server *s) {
    return (uint64_t)atomic_load(&s->auth_rejected);
}

int side_channel_server_pending(side_channel_server *s) {
    pthread_mutex_lock(&s->hub->mu);
    int n = s->hub->pending;
    pthread_mutex_unlock(&s->hub->mu);
    return n;
}

void side_channel_server_stop(side_channel_server *s) {
    if (!s) return;
    atomic_store(&s->stop, 1);
    char b = 1;
    if (write(s->hub->wake[1], &b, 1) < 0) { /* the loop wakes within 1 s anyway */
    }
    pthread_join(s->thread, NULL);
    if (s->mon) {
        zmq_socket_monitor(s->router, NULL, 0);
        zmq_close(s->mon);
    }
    free(s->conn_of);
    zmq_close(s->router);
    sc_hub *h = s->hub;
    pthread_mutex_lock(&h->mu);
    h->closed = 1;
    for (sc_out *o = h->head, *n; o; o = n) {
        n = o->next;
        free(o->data);
        free(o);
    }
    h->head = h->tail = NULL;
    hub_unref_locked_and_unlock(h);
    free(s);
}

/* ---- client ---------------------------------------------------------------- */

int side_channel_pull_run(const char *endpoint, const side_channel_pull *pull,
                          double recv_timeout_s, const atomic_int *cancel, side_channel_reply_fn fn,
                          void *ud, char *err, size_t err_cap) {
    return side_channel_pull_run_ex(endpoint, pull, NULL, recv_timeout_s, cancel, 0, NULL, fn, ud,
                                    err, err_cap);
}

int side_channel_pull_run_auth(const char *endpoint, const side_channel_pull *pull,
                               const char *secret, double recv_timeout_s, const atomic_int *cancel,
                               side_channel_reply_fn fn, void *ud, char *err, size_t err_cap) {
    return side_channel_pull_run_ex(endpoint, pull, secret, recv_timeout_s, cancel, 0, NULL, fn, ud,
                                    err, err_cap);
}

/* With a secret: 0 when reply frame m (and auth frame a, when has_a) is
 * authenticated as reply number seq of the pull with this nonce; else
 * SIDE_CHANNEL_EAUTH with the cause in err.  Without one: refuses an auth
 * frame (the producer expects a secret we do not have). */
static int auth_check_reply(const char *secret, const char *endpoint, zmq_msg_t *m, zmq_msg_t *a,
                            int has_a, uint64_t seq, const unsigned char *nonce, char *err,
                            size_t cap) {
    if (!secret) {
        if (!has_a) return 0;
        snprintf(err, cap,
                 "side channel: the reply from %s carries an authentication frame but this "
                 "decoder has no auth_secret: set the same secret "
                 "(kv_connector_extra_config.auth_secret or DISAGG_KV_SECRET) on both sides, or "
                 "on neither",
                 endpoint);
        return SIDE_CHANNEL_EAUTH;
    }
    if (!has_a) {
        /* An unauthenticated ERROR is still worth showing (the producer's own
         * words, e.g. that it wants a secret); nothing else of it is used. */
        side_channel_reply r;
        char derr[64];
        int decoded =
            side_channel_reply_decode(zmq_msg_data(m), zmq_msg_size(m), &r, derr, sizeof derr) == 0;
        if (decoded && r.status == SIDE_CHANNEL_ERROR && r.err_msg)
            snprintf(err, cap,
                     "side channel: the producer at %s refused the pull (unauthenticated "
                     "reply): %.300s",
                     endpoint, r.err_msg);
        else
            snprintf(err, cap,
                     "side channel: the reply from %s is not authenticated (no authentication "
                     "frame): the producer has no auth_secret; set the same secret on both sides, "
                     "or on neither",
                     endpoint);
        if (decoded) side_channel_reply_free(&r);
        return SIDE_CHANNEL_EAUTH;
    }
    const unsigned char *f = zmq_msg_data(a);
    if (!auth_frame_shaped(f, zmq_msg_size(a), 'R') ||
        memcmp(f + AUTH_OFF_NONCE, nonce, AUTH_NONCE) != 0 || get_be64(f + AUTH_OFF_CTR) != seq ||
        !auth_frame_mac_ok(secret, f, zmq_msg_data(m), zmq_msg_size(m))) {
        snprintf(err, cap,
                 "side channel: the reply from %s failed authentication (a MAC that does not "
                 "match this pull: the producer's auth_secret differs, or the reply is forged or "
                 "replayed)",
                 endpoint);
        return SIDE_CHANNEL_EAUTH;
    }
    return 0;
}

/* Read the reply waiting on d (one frame, and with a secret its auth frame):
 * 0 with *r decoded and authenticated as reply number *seq of the pull with
 * this nonce (then *seq advances); 1 = nothing could be read;
 * SIDE_CHANNEL_EAUTH with the cause in err; another error with the cause in
 * derr. */
static int read_reply(void *d, const char *secret, const char *endpoint, uint64_t *seq,
                      const unsigned char *nonce, side_channel_reply *r, char *derr, size_t dcap,
                      char *err, size_t err_cap) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, d, 0) < 0) {
        zmq_msg_close(&m);
        return 1;
    }
    int more = zmq_msg_more(&m), has_a = 0, extra = 0;
    zmq_msg_t a;
    zmq_msg_init(&a);
    if (more) { /* the auth frame, then nothing else */
        has_a = zmq_msg_recv(&a, d, 0) >= 0;
        for (more = has_a && zmq_msg_more(&a); more; extra++) {
            zmq_msg_t x;
            zmq_msg_init(&x);
            more = zmq_msg_recv(&x, d, 0) >= 0 && zmq_msg_more(&x);
            zmq_msg_close(&x);
        }
    }
    int rc =
        extra || (has_a && !secret && !auth_frame_shaped(zmq_msg_data(&a), zmq_msg_size(&a), 'R'))
            ? (snprintf(derr, dcap, "a multi-frame reply"), SIDE_CHANNEL_EINVAL)
            : auth_check_reply(secret, endpoint, &m, &a, has_a, *seq, nonce, err, err_cap);
    if (rc == 0) rc = side_channel_reply_decode(zmq_msg_data(&m), zmq_msg_size(&m), r, derr, dcap);
    zmq_msg_close(&a);
    zmq_msg_close(&m);
    if (rc != SIDE_CHANNEL_EAUTH) (*seq)++;
    return rc;
}

/* The monitor's next event (frame 1 is u16 event + u32 value, frame 2 the endpoint). */
static uint16_t monitor_event(void *mon) {
    zmq_msg_t ev;
    uint16_t event = 0;
    zmq_msg_init(&ev);
    if (zmq_msg_recv(&ev, mon, 0) >= 0 && zmq_msg_size(&ev) >= 2)
        memcpy(&event, zmq_msg_data(&ev), 2);
    while (zmq_msg_more(&ev)) {
        zmq_msg_close(&ev);
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, mon, 0) < 0) break;
    }
    zmq_msg_close(&ev);
    return event;
}

/* Send a cancel for pull's requests on d (with a secret, MAC'd like the
 * pull, kind 'C', with the pull's nonce) and wait for the producer's final
 * reply (authenticated in the pull's sequence, from *seq): 1 = FINISH
 * (acknowledged), 0 = anything else within ack_timeout_s. */
static int cancel_and_wait_ack(void *d, void *mon, const side_channel_pull *pull,
                               const char *secret, const unsigned char *nonce, uint64_t *seq,
                               double ack_timeout_s, const char *endpoint) {
    side_channel_cancel c = {0};
    c.n = pull->n_reqs;
    c.req_ids = calloc(c.n ? c.n : 1, sizeof *c.req_ids);
    c.transfer_ids = calloc(c.n ? c.n : 1, sizeof *c.transfer_ids);
    char *buf = NULL;
    size_t len = 0;
    int rc = c.req_ids && c.transfer_ids ? 0 : SIDE_CHANNEL_ENOMEM;
    for (size_t i = 0; rc == 0 && i < c.n; i++) {
        c.req_ids[i] = pull->reqs[i].req_id;
        c.transfer_ids[i] = pull->reqs[i].transfer_id;
    }
    if (rc == 0) rc = side_channel_cancel_encode(&c, &buf, &len);
    free(c.req_ids);
    free(c.transfer_ids);
    unsigned char af[SIDE_CHANNEL_AUTH_LEN];
    if (rc == 0 && secret && auth_frame_make(secret, 'C', wall_ms(), nonce, buf, len, af) != 0)
        rc = SIDE_CHANNEL_EIO;
    if (rc || zmq_send(d, buf, len, ZMQ_DONTWAIT | (secret ? ZMQ_SNDMORE : 0)) < 0 ||
        (secret && zmq_send(d, af, sizeof af, ZMQ_DONTWAIT) < 0)) {
        free(buf);
        return 0;
    }
    free(buf);
    uint64_t deadline = clock_now_ns() + (uint64_t)(ack_timeout_s * 1e9);
    for (;;) {
        int ms = clock_remaining_ms(deadline);
        if (ms <= 0) {
            LOG_W(MOD, "producer %s did not acknowledge a cancel within %.1f s", endpoint,
                  ack_timeout_s);
            return 0;
        }
        zmq_pollitem_t it[2] = {{d, 0, ZMQ_POLLIN, 0}, {mon, 0, ZMQ_POLLIN, 0}};
        int n = zmq_poll(it, mon ? 2 : 1, ms);
        if (n < 0 && zmq_errno() != EINTR) return 0;
        if (n <= 0) continue;
        if (mon && (it[1].revents & ZMQ_POLLIN) && monitor_event(mon) == ZMQ_EVENT_DISCONNECTED &&
            !(it[0].revents & ZMQ_POLLIN))
            return 0;
        if (!(it[0].revents & ZMQ_POLLIN)) continue;
        side_channel_reply r;
        char derr[256], aerr[512];
        int drc =
            read_reply(d, secret, endpoint, seq, nonce, &r, derr, sizeof derr, aerr, sizeof aerr);
        if (drc == 1) continue;
        if (drc == SIDE_CHANNEL_EAUTH)
            LOG_W(MOD, "the answer to a cancel is not accepted: %s; no acknowledgement", aerr);
        if (drc) return 0;
        side_channel_status st = r.status;
        int named_err = r.err_msg != NULL;
        if (st == SIDE_CHANNEL_ERROR)
            LOG_I(MOD, "producer %s answered the cancel with an error (%s): no acknowledgement",
                  endpoint, named_err ? r.err_msg : "no reason given");
        side_channel_reply_free(&r);
        if (st == SIDE_CHANNEL_FINISH) return 1;
        if (st == SIDE_CHANNEL_ERROR) return 0;
    }
}

/* ---- idle pull connections ------------------------------------------------ */

/* A pull's DEALER (with its monitor), connected to one producer's side channel, is kept
 * after a pull that ended on the producer's final reply, so that the next pull to the same
 * endpoint skips the socket set-up and the connection's handshake (TCP, then the ZMTP
 * greeting: two round trips, most of a small pull's latency on one host).  One pull uses it
 * at a time.  It is closed instead when its monitor saw the connection go while it was idle,
 * when a message waits on it that nobody asked for, after DEALER_IDLE_NS idle, or when
 * DEALER_POOL others are kept.  vLLM's decoder opens a socket per pull; a producer sees no
 * difference beyond a connection that outlives a pull (its ROUTER serves any peer). */
#define DEALER_POOL    32
#define DEALER_IDLE_NS (30 * NS_PER_S)

typedef struct idle_dealer {
    char ep[192];
    void *d, *mon;
    uint64_t since;
} idle_dealer;

static pthread_mutex_t g_pool_mu = PTHREAD_MUTEX_INITIALIZER;
static idle_dealer g_pool[DEALER_POOL];
static int g_pool_n;

static void dealer_close(void *d, void *mon) {
    if (mon) {
        zmq_socket_monitor(d, NULL, 0);
        zmq_close(mon);
    }
    zmq_close(d);
}

/* An idle DEALER for endpoint (1, taken out of the pool), or 0; expired ones are closed. */
static int dealer_take(const char *endpoint, void **d, void **mon) {
    uint64_t now = clock_now_ns();
    idle_dealer drop[DEALER_POOL];
    int nd = 0, found = 0;
    pthread_mutex_lock(&g_pool_mu);
    for (int i = g_pool_n - 1; i >= 0; i--) { /* newest last: the newest match is taken */
        idle_dealer *e = &g_pool[i];
        int expired = now - e->since > DEALER_IDLE_NS;
        if (!expired && (found || strcmp(e->ep, endpoint))) continue;
        if (expired) {
            drop[nd++] = *e;
        } else {
            *d = e->d, *mon = e->mon;
            found = 1;
        }
        memmove(e, e + 1, sizeof *e * (size_t)(g_pool_n - 1 - i));
        g_pool_n--;
    }
    pthread_mutex_unlock(&g_pool_mu);
    for (int i = 0; i < nd; i++)
        dealer_close(drop[i].d, drop[i].mon);
    return found;
}

/* Whether an idle DEALER can carry a pull: no message waits on it and its monitor saw
 * nothing but connections since it was put back. */
static int dealer_still_good(void *d, void *mon) {
    for (;;) {
        zmq_pollitem_t it[2] = {{d, 0, ZMQ_POLLIN, 0}, {mon, 0, ZMQ_POLLIN, 0}};
        int n = zmq_poll(it, 2, 0);
        if (n < 0) return 0;
        if (n == 0) return 1;
        if (it[0].revents & ZMQ_POLLIN) return 0;
        if (monitor_event(mon) != ZMQ_EVENT_CONNECTED) return 0;
    }
}

static void dealer_put(const char *endpoint, void *d, void *mon) {
    idle_dealer old = {0};
    if (strlen(endpoint) >= sizeof old.ep) {
        dealer_close(d, mon);
        return;
    }
    pthread_mutex_lock(&g_pool_mu);
    if (g_pool_n == DEALER_POOL) { /* full: the oldest goes */
        old = g_pool[0];
        memmove(g_pool, g_pool + 1, sizeof *g_pool * (DEALER_POOL - 1));
        g_pool_n--;
    }
    idle_dealer *e = &g_pool[g_pool_n++];
    snprintf(e->ep, sizeof e->ep, "%s", endpoint);
    e->d = d, e->mon = mon;
    e->since = clock_now_ns();
    pthread_mutex_unlock(&g_pool_mu);
    if (old.d) dealer_close(old.d, old.mon);
}

int side_channel_idle_pull_connections(const char *endpoint) {
    int n = 0;
    pthread_mutex_lock(&g_pool_mu);
    for (int i = 0; i < g_pool_n; i++)
        n += !strcmp(g_pool[i].ep, endpoint);
    pthread_mutex_unlock(&g_pool_mu);
    return n;
}

int side_channel_pull_run_ex(const char *endpoint, const side_channel_pull *pull,
                             const char *secret, double recv_timeout_s, const atomic_int *cancel,
                             double ack_timeout_s, int *acked, side_channel_reply_fn fn, void *ud,
                             char *err, size_t err_cap) {
    if (acked) *acked = 0;
    char *buf = NULL;
    size_t len = 0;
    if (secret && !secret[0]) secret = NULL;
    int rc = side_channel_pull_encode(pull, &buf, &len);
    if (rc) {
        snprintf(err, err_cap, "side channel: cannot encode the pull (out of memory)");
        return rc;
    }
    unsigned char af[SIDE_CHANNEL_AUTH_LEN], nonce[AUTH_NONCE];
    uint64_t seq = 0;
    if (secret && (auth_random(nonce, sizeof nonce) != 0 ||
                   auth_frame_make(secret, 'P', wall_ms(), nonce, buf, len, af) != 0)) {
        free(buf);
        snprintf(err, err_cap,
                 "side channel: cannot authenticate the pull (no randomness or HMAC)");
        return SIDE_CHANNEL_EIO;
    }
    void *d = NULL, *mon = NULL;
    int connected = 0, reusable = 0;
    while (endpoint && dealer_take(endpoint, &d, &mon)) {
        if (dealer_still_good(d, mon)) {
            connected = 1; /* its CONNECTED event came during an earlier pull */
            break;
        }
        dealer_close(d, mon);
        d = mon = NULL;
    }
    int snd_ms = recv_timeout_s > 0 ? (int)(recv_timeout_s * 1000) : 1000;
    if (d) {
        zmq_setsockopt(d, ZMQ_SNDTIMEO, &snd_ms, sizeof snd_ms);
    } else {
        d = zmq_socket(zctx(), ZMQ_DEALER);
        if (!d) {
            free(buf);
            snprintf(err, err_cap, "side channel: zmq_socket: %s", zmq_strerror(zmq_errno()));
            return SIDE_CHANNEL_EIO;
        }
        int linger = 0, one = 1;
        int64_t maxmsg = HARD_MAX_MSG;
        zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
        zmq_setsockopt(d, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
        zmq_setsockopt(d, ZMQ_SNDTIMEO, &snd_ms, sizeof snd_ms);
        int conn_ms = 10000; /* a connect that hangs (dropped SYNs) ends in a retry: see below */
        zmq_setsockopt(d, ZMQ_CONNECT_TIMEOUT, &conn_ms, sizeof conn_ms);
        if (endpoint && strchr(endpoint, '[')) zmq_setsockopt(d, ZMQ_IPV6, &one, sizeof one);
        /* Watch the connection: a producer that dies (or drops the connection)
         * after taking the pull can never answer it (its ROUTER forgot this
         * peer), so its disconnect fails the pull now instead of at the timeout. */
        static atomic_uint mon_seq;
        char mon_ep[64];
        snprintf(mon_ep, sizeof mon_ep, "inproc://side-channel-pull-%u",
                 atomic_fetch_add(&mon_seq, 1));
        if (zmq_socket_monitor(d, mon_ep,
                               ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED |
                                   ZMQ_EVENT_CONNECT_RETRIED) == 0) {
            mon = zmq_socket(zctx(), ZMQ_PAIR);
            if (mon && zmq_connect(mon, mon_ep) != 0) {
                zmq_close(mon);
                mon = NULL;
            }
        }
        if (!endpoint || zmq_connect(d, endpoint) != 0) {
            snprintf(err, err_cap,
                     "side channel: endpoint '%s' is not accepted (%s); accepted: "
                     "\"tcp://host:port\"",
                     endpoint ? endpoint : "(null)", zmq_strerror(zmq_errno()));
            rc = SIDE_CHANNEL_EINVAL;
            goto out;
        }
    }
    if (zmq_send(d, buf, len, secret ? ZMQ_SNDMORE : 0) < 0 ||
        (secret && zmq_send(d, af, sizeof af, 0) < 0)) {
        snprintf(err, err_cap, "side channel: sending the pull to %s: %s", endpoint,
                 zmq_strerror(zmq_errno()));
        rc = SIDE_CHANNEL_EIO;
        goto out;
    }
    uint64_t timeout_ns = (uint64_t)(recv_timeout_s * 1e9);
    uint64_t deadline = clock_now_ns() + timeout_ns;
    for (;;) {
        if (cancel && atomic_load(cancel)) {
            if (atomic_load(cancel) == SIDE_CHANNEL_CANCEL_ASK && ack_timeout_s > 0 && acked)
                *acked =
                    cancel_and_wait_ack(d, mon, pull, secret, nonce, &seq, ack_timeout_s, endpoint);
            snprintf(err, err_cap, "side channel: pull to %s canceled%s", endpoint,
                     acked && *acked ? " (the producer acknowledged)" : "");
            rc = SIDE_CHANNEL_ECANCELED;
            break;
        }
        int ms = clock_remaining_ms(deadline);
        if (ms <= 0) {
            snprintf(err, err_cap, "side channel: no reply from %s within %.1f s", endpoint,
                     recv_timeout_s);
            rc = SIDE_CHANNEL_ETIMEDOUT;
            break;
        }
        zmq_pollitem_t it[2] = {{d, 0, ZMQ_POLLIN, 0}, {mon, 0, ZMQ_POLLIN, 0}};
        int n = zmq_poll(it, mon ? 2 : 1, ms < 100 ? ms : 100);
        if (n < 0 && zmq_errno() != EINTR) {
            snprintf(err, err_cap, "side channel: zmq_poll: %s", zmq_strerror(zmq_errno()));
            rc = SIDE_CHANNEL_EIO;
            break;
        }
        if (n <= 0) continue;
        if (mon && (it[1].revents & ZMQ_POLLIN)) {
            uint16_t event = monitor_event(mon);
            if (event == ZMQ_EVENT_CONNECTED) connected = 1;
            /* ZeroMQ retries a refused (or timed-out) connect forever and
             * silently: the first retry before any connection means nothing
             * accepts at that address -- fail now, naming it. */
            if (event == ZMQ_EVENT_CONNECT_RETRIED && !connected) {
                snprintf(err, err_cap,
                         "side channel: producer unreachable: the connection to %s was refused "
                         "or timed out (nothing accepts there; a stale or wrong bootstrap entry?)",
                         endpoint);
                rc = SIDE_CHANNEL_EREFUSED;
                break;
            }
            if (event == ZMQ_EVENT_DISCONNECTED && connected && !(it[0].revents & ZMQ_POLLIN)) {
                snprintf(err, err_cap,
                         "side channel: producer unreachable: the producer at %s closed the "
                         "connection before answering (it stopped or crashed)",
                         endpoint);
                rc = SIDE_CHANNEL_EIO;
                break;
            }
            if (!(it[0].revents & ZMQ_POLLIN)) continue;
        }
        if (!(it[0].revents & ZMQ_POLLIN)) continue;
        side_channel_reply r;
        char derr[512];
        rc = read_reply(d, secret, endpoint, &seq, nonce, &r, derr, sizeof derr, err, err_cap);
        if (rc == 1) continue;
        if (rc == SIDE_CHANNEL_EAUTH) break;
        if (rc) {
            snprintf(err, err_cap, "side channel: bad reply from %s: %s", endpoint, derr);
            break;
        }
        int stop = fn ? fn(ud, &r) : 0;
        int final = r.status != SIDE_CHANNEL_CONTINUE;
        side_channel_reply_free(&r);
        if (stop || final) {
            rc = 0;
            reusable = final; /* nothing more comes on it for this pull */
            break;
        }
        deadline = clock_now_ns() + timeout_ns; /* the timeout is per reply */
    }
out:
    if (reusable && mon && endpoint)
        dealer_put(endpoint, d, mon);
    else
        dealer_close(d, mon);
    free(buf);
    return rc;
}
