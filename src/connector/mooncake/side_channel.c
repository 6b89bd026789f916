/* side_channel — see side_channel.h.  Parts: the process-wide ZeroMQ context,
 * the reply hub shared by the server thread and the handler's threads, the
 * ROUTER server thread, the DEALER client. */
#include "connector/mooncake/side_channel.h"

#include "base/clock.h"
#include "base/log.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#define MOD          "side-channel"
#define HARD_MAX_MSG ((int64_t)SIDE_CHANNEL_MAX_MSG_BYTES * 4) /* ZeroMQ drops larger peers */
#define MAX_IDENTITY 256

/* ---- process-wide context ---------------------------------------------- */

static void *g_ctx;
static pthread_once_t g_ctx_once = PTHREAD_ONCE_INIT;
static void ctx_init(void) {
    g_ctx = zmq_ctx_new();
}
static void *zctx(void) {
    pthread_once(&g_ctx_once, ctx_init);
    return g_ctx;
}

/* ---- reply hub ------------------------------------------------------------ */

typedef struct sc_out {
    struct sc_out *next;            /* FIFO link */
    size_t id_len;                  /* routing id of the DEALER */
    unsigned char id[MAX_IDENTITY]; /* (id_len) */
    char *data;                     /* (len) encoded reply, malloc'd */
    size_t len;
} sc_out;

typedef struct sc_hub {
    pthread_mutex_t mu;  /* guards everything below */
    int refs;            /* the server + every unreleased call */
    int closed;          /* the server stopped: replies are refused */
    int pending;         /* calls handed out and not finished */
    sc_out *head, *tail; /* replies waiting for the server thread */
    int wake[2];         /* pipe: a byte per queued reply wakes the server thread */
} sc_hub;

struct side_channel_call {
    sc_hub *hub;                    /* shared with the server */
    size_t id_len;                  /* routing id of the DEALER */
    unsigned char id[MAX_IDENTITY]; /* (id_len) */
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

int side_channel_call_peer_is(const side_channel_call *call, const void *peer, size_t peer_len) {
    return call && peer_len == call->id_len && memcmp(call->id, peer, peer_len) == 0;
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
    void *ud;                /* its argument */
    sc_hub *hub;             /* replies from any thread */
    atomic_int stop;         /* set by stop() */
    pthread_t thread;        /* the loop */
};

static void send_frames(void *router, const unsigned char *id, size_t id_len, const void *data,
                        size_t len) {
    if (zmq_send(router, id, id_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(router, data, len, ZMQ_DONTWAIT) < 0)
        LOG_W(MOD, "dropping a reply: %s", zmq_strerror(zmq_errno()));
}

static void send_error(void *router, const unsigned char *id, size_t id_len, const char *msg) {
    side_channel_reply r = {.status = SIDE_CHANNEL_ERROR, .err_msg = (char *)msg};
    char *buf;
    size_t len;
    if (side_channel_reply_encode(&r, &buf, &len) == 0) {
        send_frames(router, id, id_len, buf, len);
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
        send_frames(s->router, o->id, o->id_len, o->data, o->len);
        free(o->data);
        free(o);
        o = n;
    }
}

/* A cancel (side_channel_msg.h) is handed to the cancel handler; returns 0
 * when the payload is not a cancel (then it is decoded as a pull). */
static int handle_cancel(side_channel_server *s, const unsigned char *id, size_t id_len,
                         zmq_msg_t *payload) {
    const void *buf = zmq_msg_data(payload);
    size_t len = zmq_msg_size(payload);
    static const char key[] = SIDE_CHANNEL_CANCEL_KEY;
    if (!memmem(buf, len, key, sizeof key - 1)) return 0; /* cheap: pulls never carry it */
    side_channel_cancel c;
    char err[512];
    int rc = side_channel_cancel_decode(buf, len, &c, err, sizeof err);
    if (rc == 1) return 0;
    side_channel_cancel_fn fn = atomic_load(&s->cancel_fn);
    if (rc < 0) {
        LOG_W(MOD, "rejecting a cancel: %s", err);
        send_error(s->router, id, id_len, err);
    } else if (!fn) {
        send_error(s->router, id, id_len, "side-channel cancel: not supported by this producer");
    } else {
        fn(s->ud, id, id_len, &c);
    }
    side_channel_cancel_free(&c);
    return 1;
}

void side_channel_server_set_cancel_fn(side_channel_server *s, side_channel_cancel_fn fn) {
    atomic_store(&s->cancel_fn, fn);
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
    zmq_msg_t payload;
    zmq_msg_init(&payload);
    while (more) {
        zmq_msg_init(&part);
        int got = zmq_msg_recv(&part, s->router, 0) >= 0;
        more = got && zmq_msg_more(&part);
        if (got && ++frames == 1) zmq_msg_copy(&payload, &part);
        zmq_msg_close(&part);
        if (!got) break;
    }
    size_t id_len = zmq_msg_size(&id);
    if (id_len > MAX_IDENTITY) id_len = MAX_IDENTITY;
    const unsigned char *idp = zmq_msg_data(&id);
    if (frames != 1) {
        char msg[128];
        snprintf(msg, sizeof msg, "side-channel pull: expected one frame, got %d", frames);
        LOG_W(MOD, "%s", msg);
        send_error(s->router, idp, id_len, msg);
    } else if (handle_cancel(s, idp, id_len, &payload)) {
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
            call->id_len = id_len;
            memcpy(call->id, idp, id_len);
            pthread_mutex_lock(&s->hub->mu);
            s->hub->refs++;
            s->hub->pending++;
            pthread_mutex_unlock(&s->hub->mu);
            s->fn(s->ud, call, pull); /* owns pull and call from here */
        }
    }
    zmq_msg_close(&payload);
    zmq_msg_close(&id);
    return 1;
}

static void *server_main(void *arg) {
    side_channel_server *s = arg;
    zmq_pollitem_t items[2] = {{s->router, 0, ZMQ_POLLIN, 0},
                               {NULL, s->hub->wake[0], ZMQ_POLLIN, 0}};
    while (!atomic_load(&s->stop)) {
        if (zmq_poll(items, 2, 1000) < 0) {
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
        flush_replies(s);
    }
    return NULL;
}

int side_channel_server_start(const char *bind_host, uint16_t port, side_channel_pull_fn fn,
                              void *ud, side_channel_server **out, char *err, size_t err_cap) {
    *out = NULL;
    if (!fn) {
        snprintf(err, err_cap, "side channel: a pull handler is required");
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
    if (v6) zmq_setsockopt(s->router, ZMQ_IPV6, &one, sizeof one);
    if (zmq_bind(s->router, ep) != 0) goto zfail;
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
    LOG_I(MOD, "side channel ROUTER bound on %s", last);
    *out = s;
    return 0;
zfail:
    snprintf(err, err_cap, "side channel: cannot bind ROUTER on %s: %s", ep,
             zmq_strerror(zmq_errno()));
    if (s->router) zmq_close(s->router);
    pthread_mutex_lock(&h->mu);
    hub_unref_locked_and_unlock(h);
    free(s);
    return SIDE_CHANNEL_EIO;
}

uint16_t side_channel_server_port(const side_channel_server *s) {
    return s->port;
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
    return side_channel_pull_run_ex(endpoint, pull, recv_timeout_s, cancel, 0, NULL, fn, ud, err,
                                    err_cap);
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

/* Send a cancel for pull's requests on d and wait for the producer's final
 * reply: 1 = FINISH (acknowledged), 0 = anything else within ack_timeout_s. */
static int cancel_and_wait_ack(void *d, void *mon, const side_channel_pull *pull,
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
    if (rc || zmq_send(d, buf, len, ZMQ_DONTWAIT) < 0) {
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
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, d, 0) < 0) {
            zmq_msg_close(&m);
            continue;
        }
        side_channel_reply r;
        char derr[256];
        int drc = zmq_msg_more(&m) ? SIDE_CHANNEL_EINVAL
                                   : side_channel_reply_decode(zmq_msg_data(&m), zmq_msg_size(&m),
                                                               &r, derr, sizeof derr);
        zmq_msg_close(&m);
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

int side_channel_pull_run_ex(const char *endpoint, const side_channel_pull *pull,
                             double recv_timeout_s, const atomic_int *cancel, double ack_timeout_s,
                             int *acked, side_channel_reply_fn fn, void *ud, char *err,
                             size_t err_cap) {
    if (acked) *acked = 0;
    char *buf = NULL;
    size_t len = 0;
    int rc = side_channel_pull_encode(pull, &buf, &len);
    if (rc) {
        snprintf(err, err_cap, "side channel: cannot encode the pull (out of memory)");
        return rc;
    }
    void *d = zmq_socket(zctx(), ZMQ_DEALER);
    if (!d) {
        free(buf);
        snprintf(err, err_cap, "side channel: zmq_socket: %s", zmq_strerror(zmq_errno()));
        return SIDE_CHANNEL_EIO;
    }
    int linger = 0, one = 1, snd_ms = recv_timeout_s > 0 ? (int)(recv_timeout_s * 1000) : 1000;
    int64_t maxmsg = HARD_MAX_MSG;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(d, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    zmq_setsockopt(d, ZMQ_SNDTIMEO, &snd_ms, sizeof snd_ms);
    if (endpoint && strchr(endpoint, '[')) zmq_setsockopt(d, ZMQ_IPV6, &one, sizeof one);
    /* Watch the connection: a producer that dies (or drops the connection)
     * after taking the pull can never answer it (its ROUTER forgot this
     * peer), so its disconnect fails the pull now instead of at the timeout. */
    static atomic_uint mon_seq;
    char mon_ep[64];
    snprintf(mon_ep, sizeof mon_ep, "inproc://side-channel-pull-%u", atomic_fetch_add(&mon_seq, 1));
    void *mon = NULL;
    if (zmq_socket_monitor(d, mon_ep, ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED) == 0) {
        mon = zmq_socket(zctx(), ZMQ_PAIR);
        if (mon && zmq_connect(mon, mon_ep) != 0) {
            zmq_close(mon);
            mon = NULL;
        }
    }
    int connected = 0;
    if (!endpoint || zmq_connect(d, endpoint) != 0) {
        snprintf(err, err_cap,
                 "side channel: endpoint '%s' is not accepted (%s); accepted: \"tcp://host:port\"",
                 endpoint ? endpoint : "(null)", zmq_strerror(zmq_errno()));
        rc = SIDE_CHANNEL_EINVAL;
        goto out;
    }
    if (zmq_send(d, buf, len, 0) < 0) {
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
                *acked = cancel_and_wait_ack(d, mon, pull, ack_timeout_s, endpoint);
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
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, d, 0) < 0) {
            zmq_msg_close(&m);
            continue;
        }
        int more = zmq_msg_more(&m);
        side_channel_reply r;
        char derr[512];
        rc = more ? (snprintf(derr, sizeof derr, "a multi-frame reply"), SIDE_CHANNEL_EINVAL)
                  : side_channel_reply_decode(zmq_msg_data(&m), zmq_msg_size(&m), &r, derr,
                                              sizeof derr);
        zmq_msg_close(&m);
        if (rc) {
            snprintf(err, err_cap, "side channel: bad reply from %s: %s", endpoint, derr);
            break;
        }
        int stop = fn ? fn(ud, &r) : 0;
        int final = r.status != SIDE_CHANNEL_CONTINUE;
        side_channel_reply_free(&r);
        if (stop || final) {
            rc = 0;
            break;
        }
        deadline = clock_now_ns() + timeout_ns; /* the timeout is per reply */
    }
out:
    if (mon) {
        zmq_socket_monitor(d, NULL, 0);
        zmq_close(mon);
    }
    zmq_close(d);
    free(buf);
    return rc;
}
