/* kv_subscriber — see kv_subscriber.h. */
#include "proxy/kv_subscriber.h"

#include "base/log.h"

#include <errno.h>
#include <event2/event.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define MOD "proxy"

struct kv_subscriber {
    struct event_base *base; /* the proxy's loop */
    void *zctx;              /* ZMQ context (the proxy's) */
    char label[300];         /* the instance's URL */
    char endpoint[256];      /* PUB endpoint */
    char replay_ep[256];     /* replay ROUTER endpoint, "" = none */
    double replay_timeout_s; /* per replay */
    kv_index *idx;           /* fed */
    void *sub;               /* SUB socket */
    struct event *sub_ev;    /* its ZMQ_FD on the loop */
    void *dealer;            /* replay in progress: the DEALER, else NULL */
    struct event *dealer_ev; /* its ZMQ_FD */
    struct event *deadline;  /* the replay's deadline */
    int64_t expect;          /* next seq to apply (0 before any) */
    int64_t skip_upto;       /* after a replay: live batches up to this seq were applied */
    int64_t held_seq;        /* the batch that showed the gap (-1: none) */
    void *held;              /* (held_len) its payload */
    size_t held_len;         /* bytes */
    kv_subscriber_stats st;  /* counters */
};

static void apply(kv_subscriber *s, int64_t seq, const void *p, size_t n) {
    char err[256];
    if (kv_index_apply(s->idx, p, n, err, sizeof err)) {
        s->st.bad++;
        LOG_W(MOD, "prefill %s: KV event batch %lld: %s (skipped)", s->label, (long long)seq, err);
    }
    s->st.batches++;
    s->st.last_seq = seq;
    s->expect = seq + 1;
}

static int64_t seq_of(zmq_msg_t *m) {
    if (zmq_msg_size(m) != 8) return -2;
    const unsigned char *b = zmq_msg_data(m);
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | b[i];
    return (int64_t)v;
}

/* Receives one whole multipart message into parts[0..*np) (at most 4 kept, the rest
 * counted); 0, or -1 when nothing is waiting. */
static int recv_parts(void *sock, zmq_msg_t *parts, int *np, int *total) {
    *np = 0;
    *total = 0;
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return *total ? 0 : -1;
        }
        int more = zmq_msg_more(&m);
        if (*np < 4)
            parts[(*np)++] = m;
        else
            zmq_msg_close(&m);
        (*total)++;
        if (!more) return 0;
    }
}

static void close_parts(zmq_msg_t *parts, int np) {
    for (int i = 0; i < np; i++)
        zmq_msg_close(&parts[i]);
}

static void drain_sub(kv_subscriber *s);

static void replay_end(kv_subscriber *s, int ok, const char *why) {
    if (s->dealer_ev) event_free(s->dealer_ev);
    if (s->deadline) event_free(s->deadline);
    s->dealer_ev = s->deadline = NULL;
    if (s->dealer) zmq_close(s->dealer);
    s->dealer = NULL;
    int64_t held = s->held_seq;
    if (ok && s->expect < held) {
        ok = 0;
        why = "the replay buffer no longer holds the missing batches";
    }
    if (ok) {
        s->st.replays++;
        LOG_I(MOD, "prefill %s: KV events %lld..%lld replayed", s->label, (long long)held,
              (long long)(s->expect - 1));
    } else {
        s->st.replay_failed++;
        LOG_W(MOD,
              "prefill %s: KV event gap not filled (%s): its index is dropped and rebuilt "
              "from batch %lld on",
              s->label, why, (long long)held);
        kv_index_clear(s->idx);
        s->expect = held;
    }
    if (s->expect == held) apply(s, held, s->held, s->held_len);
    s->skip_upto = s->expect - 1;
    free(s->held);
    s->held = NULL;
    s->held_seq = -1;
    drain_sub(s); /* what the SUB socket queued meanwhile */
}

static void drain_dealer(kv_subscriber *s) {
    while (s->dealer) {
        zmq_msg_t parts[4];
        int np, total;
        if (recv_parts(s->dealer, parts, &np, &total)) return;
        /* [empty, seq, payload] (a topic frame before seq is tolerated) */
        int64_t seq = np >= 3 ? seq_of(&parts[np - 2]) : -2;
        if (seq == -1) { /* the end marker */
            close_parts(parts, np);
            replay_end(s, 1, NULL);
            return;
        }
        if (seq < 0) {
            s->st.bad++;
        } else if (seq > s->expect) {
            close_parts(parts, np);
            replay_end(s, 0, "the replay buffer no longer holds the missing batches");
            return;
        } else if (seq == s->expect) {
            apply(s, seq, zmq_msg_data(&parts[np - 1]), zmq_msg_size(&parts[np - 1]));
        }
        close_parts(parts, np);
    }
}

static void on_dealer(evutil_socket_t fd, short what, void *arg) {
    kv_subscriber *s = arg;
    uint32_t evs;
    size_t sz = sizeof evs;
    while (s->dealer && zmq_getsockopt(s->dealer, ZMQ_EVENTS, &evs, &sz) == 0 && (evs & ZMQ_POLLIN))
        drain_dealer(s);
}

static void on_deadline(evutil_socket_t fd, short what, void *arg) {
    replay_end(arg, 0, "the replay endpoint did not answer in time");
}

/* A gap before seq: hold its batch and ask for the missing ones, or give up at once. */
static void gap(kv_subscriber *s, int64_t seq, const void *p, size_t n) {
    s->st.gaps++;
    s->held = malloc(n ? n : 1);
    if (!s->held) {
        kv_index_clear(s->idx);
        s->st.replay_failed++;
        apply(s, seq, p, n);
        return;
    }
    memcpy(s->held, p, n);
    s->held_len = n;
    s->held_seq = seq;
    LOG_I(MOD, "prefill %s: KV events %lld..%lld missed%s", s->label, (long long)s->expect,
          (long long)(seq - 1), s->replay_ep[0] ? "; asking the replay endpoint" : "");
    if (!s->replay_ep[0]) {
        replay_end(s, 0, "no replay endpoint");
        return;
    }
    int zero = 0;
    evutil_socket_t fd;
    size_t fsz = sizeof fd;
    unsigned char start[8];
    for (int i = 0; i < 8; i++)
        start[i] = (unsigned char)((uint64_t)s->expect >> (56 - 8 * i));
    s->dealer = zmq_socket(s->zctx, ZMQ_DEALER);
    if (!s->dealer || zmq_setsockopt(s->dealer, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_connect(s->dealer, s->replay_ep) || zmq_getsockopt(s->dealer, ZMQ_FD, &fd, &fsz) ||
        zmq_send(s->dealer, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(s->dealer, start, 8, ZMQ_DONTWAIT) < 0) {
        replay_end(s, 0, zmq_strerror(zmq_errno()));
        return;
    }
    s->dealer_ev = event_new(s->base, fd, EV_READ | EV_PERSIST, on_dealer, s);
    s->deadline = evtimer_new(s->base, on_deadline, s);
    struct timeval tv = {
        (time_t)s->replay_timeout_s,
        (suseconds_t)((s->replay_timeout_s - (double)(time_t)s->replay_timeout_s) * 1e6)};
    if (!s->dealer_ev || !s->deadline) {
        replay_end(s, 0, "out of memory");
        return;
    }
    event_add(s->dealer_ev, NULL);
    evtimer_add(s->deadline, &tv);
    on_dealer(fd, EV_READ, s); /* the send may have consumed the edge */
}

static void handle(kv_subscriber *s, int64_t seq, const void *p, size_t n) {
    if (seq <= s->skip_upto) return; /* the replay applied it */
    s->skip_upto = -1;
    if (s->st.last_seq >= 0 && seq <= s->st.last_seq) {
        s->st.restarts++;
        LOG_I(MOD,
              "prefill %s: KV event seq %lld after %lld: the instance restarted; its index "
              "is dropped",
              s->label, (long long)seq, (long long)s->st.last_seq);
        kv_index_clear(s->idx);
        s->st.last_seq = -1;
        s->expect = 0;
    }
    if (seq > s->expect)
        gap(s, seq, p, n);
    else
        apply(s, seq, p, n);
}

static void drain_sub(kv_subscriber *s) {
    uint32_t evs;
    size_t sz = sizeof evs;
    while (!s->dealer && zmq_getsockopt(s->sub, ZMQ_EVENTS, &evs, &sz) == 0 && (evs & ZMQ_POLLIN)) {
        zmq_msg_t parts[4];
        int np, total;
        if (recv_parts(s->sub, parts, &np, &total)) break;
        int64_t seq = np == 3 && total == 3 ? seq_of(&parts[1]) : -2;
        if (seq < 0) {
            if (!s->st.bad++)
                LOG_W(MOD, "prefill %s: a KV event message of %d frames, not [topic, seq, batch]",
                      s->label, total);
        } else {
            handle(s, seq, zmq_msg_data(&parts[2]), zmq_msg_size(&parts[2]));
        }
        close_parts(parts, np);
    }
}

static void on_sub(evutil_socket_t fd, short what, void *arg) {
    drain_sub(arg);
}

kv_subscriber *kv_subscriber_new(struct event_base *base, void *zctx, const char *label,
                                 const kv_subscriber_opts *o, kv_index *idx, char *err,
                                 size_t errcap) {
    kv_subscriber *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errcap, "out of memory");
        return NULL;
    }
    s->base = base;
    s->zctx = zctx;
    s->idx = idx;
    s->held_seq = -1;
    s->skip_upto = -1;
    s->st.last_seq = -1;
    s->replay_timeout_s = o->replay_timeout_s > 0 ? o->replay_timeout_s : 5;
    snprintf(s->label, sizeof s->label, "%s", label);
    snprintf(s->endpoint, sizeof s->endpoint, "%s", o->endpoint);
    snprintf(s->replay_ep, sizeof s->replay_ep, "%s", o->replay_endpoint ? o->replay_endpoint : "");
    int zero = 0, hwm = 100000;
    const char *topic = o->topic ? o->topic : "";
    evutil_socket_t fd;
    size_t fsz = sizeof fd;
    s->sub = zmq_socket(zctx, ZMQ_SUB);
    if (!s->sub || zmq_setsockopt(s->sub, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_setsockopt(s->sub, ZMQ_RCVHWM, &hwm, sizeof hwm) ||
        zmq_setsockopt(s->sub, ZMQ_SUBSCRIBE, topic, strlen(topic))) {
        snprintf(err, errcap, "cannot create a ZMQ SUB socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (zmq_connect(s->sub, s->endpoint)) {
        snprintf(err, errcap, "KV events endpoint '%s' of %s: %s; accepted: tcp://HOST:PORT",
                 s->endpoint, label, zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (zmq_getsockopt(s->sub, ZMQ_FD, &fd, &fsz) ||
        !(s->sub_ev = event_new(base, fd, EV_READ | EV_PERSIST, on_sub, s)) ||
        event_add(s->sub_ev, NULL)) {
        snprintf(err, errcap, "cannot watch the ZMQ SUB socket of %s", label);
        goto fail;
    }
    LOG_I(MOD, "prefill %s: KV events from %s%s%s", label, s->endpoint,
          s->replay_ep[0] ? ", replay " : "", s->replay_ep);
    return s;
fail:
    kv_subscriber_free(s);
    return NULL;
}

void kv_subscriber_free(kv_subscriber *s) {
    if (!s) return;
    if (s->sub_ev) event_free(s->sub_ev);
    if (s->dealer_ev) event_free(s->dealer_ev);
    if (s->deadline) event_free(s->deadline);
    if (s->dealer) zmq_close(s->dealer);
    if (s->sub) zmq_close(s->sub);
    free(s->held);
    free(s);
}

void kv_subscriber_reset(kv_subscriber *s, const char *why) {
    if (s->dealer) { /* a replay from the previous incarnation: abandon it */
        event_free(s->dealer_ev);
        event_free(s->deadline);
        zmq_close(s->dealer);
        s->dealer = NULL;
        s->dealer_ev = NULL;
        s->deadline = NULL;
        free(s->held);
        s->held = NULL;
        s->held_seq = -1;
    }
    s->st.restarts++;
    kv_index_clear(s->idx);
    s->st.last_seq = -1;
    s->expect = 0;
    s->skip_upto = -1;
    LOG_I(MOD, "prefill %s: %s: its KV index is dropped", s->label, why);
    drain_sub(s);
}

void kv_subscriber_get_stats(const kv_subscriber *s, kv_subscriber_stats *out) {
    *out = s->st;
}
