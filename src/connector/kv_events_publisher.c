/* kv_events_publisher — see kv_events_publisher.h. */
#include "connector/kv_events_publisher.h"

#include "base/log.h"
#include "base/text.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define MOD "kv_events"

/* ---- configuration ------------------------------------------------------------ */

static const char *const KEYS[] = {"enable_kv_cache_events", "publisher", "endpoint",
                                   "replay_endpoint", "buffer_steps", "hwm", "max_queue_size",
                                   "topic"};
#define NKEYS (sizeof KEYS / sizeof KEYS[0])
#define KEY_LIST                                                                                   \
    "enable_kv_cache_events, publisher, endpoint, replay_endpoint, buffer_steps, hwm, "            \
    "max_queue_size, topic"

static int set_err(char *err, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int set_err(char *err, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return -22;
}

static int get_str(const json_t *v, const char *key, int nullable, char *dst, size_t cap,
                   char *err, size_t errlen) {
    if (nullable && json_is_null(v)) {
        dst[0] = '\0';
        return 0;
    }
    if (!json_is_string(v))
        return set_err(err, errlen, "%s must be a string%s, got %s", key,
                       nullable ? " or null" : "", text_json_kind(v));
    if (json_string_length(v) + 1 > cap)
        return set_err(err, errlen, "%s is %zu bytes long; accepted: at most %zu", key,
                       json_string_length(v), cap - 1);
    memcpy(dst, json_string_value(v), json_string_length(v) + 1);
    return 0;
}

static int get_int(const json_t *v, const char *key, long long lo, long long hi, int *dst,
                   char *err, size_t errlen) {
    if (!json_is_integer(v))
        return set_err(err, errlen, "%s must be an integer, got %s", key, text_json_kind(v));
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return set_err(err, errlen, "%s is %lld; accepted: %lld..%lld", key, x, lo, hi);
    *dst = (int)x;
    return 0;
}

static int endpoint_ok(const char *ep) {
    return !strncmp(ep, "tcp://", 6) || !strncmp(ep, "ipc://", 6) || !strncmp(ep, "inproc://", 9);
}

int kv_events_config_parse(const char *json, kv_events_config *c, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    snprintf(c->endpoint, sizeof c->endpoint, "tcp://*:5557");
    c->buffer_steps = 10000;
    c->hwm = 100000;
    c->max_queue_size = 100000;
    json_error_t je;
    json_t *root = json_loads(json ? json : "", JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return set_err(err, errlen, "not valid JSON (%s at column %d); accepted: an object of " KEY_LIST,
                       je.text, je.column);
    int rc = 0;
    if (!json_is_object(root)) {
        rc = set_err(err, errlen, "must be a JSON object, got %s; accepted keys: " KEY_LIST,
                     text_json_kind(root));
        goto out;
    }
    const char *key;
    json_t *v;
    int have_publisher = 0;
    json_object_foreach(root, key, v) {
        if (!strcmp(key, "enable_kv_cache_events")) {
            if (!json_is_boolean(v)) {
                rc = set_err(err, errlen, "enable_kv_cache_events must be true or false, got %s",
                             text_json_kind(v));
                goto out;
            }
            c->enable_kv_cache_events = json_is_true(v);
        } else if (!strcmp(key, "publisher")) {
            if ((rc = get_str(v, key, 1, c->publisher, sizeof c->publisher, err, errlen))) {
                if (json_is_string(v))
                    rc = set_err(err, errlen, "publisher '%s' is not known; accepted: null, zmq",
                                 json_string_value(v));
                goto out;
            }
            if (c->publisher[0] && strcmp(c->publisher, "null") && strcmp(c->publisher, "zmq")) {
                rc = set_err(err, errlen, "publisher '%s' is not known; accepted: null, zmq",
                             c->publisher);
                goto out;
            }
            have_publisher = c->publisher[0] != '\0';
        } else if (!strcmp(key, "endpoint") || !strcmp(key, "replay_endpoint")) {
            int replay = key[0] == 'r';
            char *dst = replay ? c->replay_endpoint : c->endpoint;
            if ((rc = get_str(v, key, replay, dst, sizeof c->endpoint, err, errlen))) goto out;
            if ((dst[0] || !replay) && !endpoint_ok(dst)) {
                rc = set_err(err, errlen,
                             "%s '%s' is not a ZMQ endpoint; accepted: tcp://HOST:PORT (tcp://*:PORT "
                             "binds), ipc://PATH, inproc://NAME",
                             key, dst);
                goto out;
            }
        } else if (!strcmp(key, "buffer_steps")) {
            if ((rc = get_int(v, key, 1, 1000000, &c->buffer_steps, err, errlen))) goto out;
        } else if (!strcmp(key, "hwm")) {
            if ((rc = get_int(v, key, 0, 100000000, &c->hwm, err, errlen))) goto out;
        } else if (!strcmp(key, "max_queue_size")) {
            if ((rc = get_int(v, key, 1, 100000000, &c->max_queue_size, err, errlen))) goto out;
        } else if (!strcmp(key, "topic")) {
            if ((rc = get_str(v, key, 0, c->topic, sizeof c->topic, err, errlen))) goto out;
        } else {
            const char *best = NULL;
            int bd = 1 << 30, d;
            for (size_t i = 0; i < NKEYS; i++)
                if (text_close_name(key, KEYS[i], &d) && d < bd) {
                    bd = d;
                    best = KEYS[i];
                }
            char hint[96] = "";
            if (best) snprintf(hint, sizeof hint, " (did you mean '%s'?)", best);
            rc = set_err(err, errlen, "unknown key '%s'%s; accepted: " KEY_LIST, key, hint);
            goto out;
        }
    }
    const char *fmt = getenv("DISAGG_KV_EVENTS_FORMAT");
    if (fmt && *fmt && strcmp(fmt, "array") && strcmp(fmt, "map")) {
        rc = set_err(err, errlen,
                     "DISAGG_KV_EVENTS_FORMAT '%s' is not known; accepted: array (positional "
                     "events, the default), map (tagged maps, vLLM >= 0.26)",
                     fmt);
        goto out;
    }
    c->map_events = fmt && !strcmp(fmt, "map");
    if (!have_publisher)
        snprintf(c->publisher, sizeof c->publisher, "%s", c->enable_kv_cache_events ? "zmq" : "null");
    c->enabled = c->enable_kv_cache_events && !strcmp(c->publisher, "zmq");
out:
    json_decref(root);
    return rc;
}

/* ---- encoding ----------------------------------------------------------------- */

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

static void pack_hashes(msgpack_packer *pk, const kvev_event *e) {
    msgpack_pack_array(pk, (size_t)e->n_hashes);
    for (int i = 0; i < e->n_hashes; i++)
        msgpack_pack_uint64(pk, e->hashes[i]);
}

/* the event's tag, then (map) each field's name before its value */
static void pack_head(msgpack_packer *pk, int map, const char *tag, size_t nfields) {
    if (map) {
        msgpack_pack_map(pk, nfields + 1);
        pack_str(pk, "type");
    } else {
        msgpack_pack_array(pk, nfields + 1);
    }
    pack_str(pk, tag);
}

static void pack_key(msgpack_packer *pk, int map, const char *key) {
    if (map) pack_str(pk, key);
}

static void encode_batch(msgpack_sbuffer *sb, const kvev_log *log, double ts, int map) {
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, ts);
    msgpack_pack_array(&pk, (size_t)log->n);
    for (int i = 0; i < log->n; i++) {
        const kvev_event *e = &log->ev[i];
        switch (e->kind) {
        case KVEV_STORED:
            pack_head(&pk, map, "BlockStored", 7);
            pack_key(&pk, map, "block_hashes");
            pack_hashes(&pk, e);
            pack_key(&pk, map, "parent_block_hash");
            if (e->has_parent)
                msgpack_pack_uint64(&pk, e->parent);
            else
                msgpack_pack_nil(&pk);
            pack_key(&pk, map, "token_ids");
            msgpack_pack_array(&pk, (size_t)e->n_tokens);
            for (int t = 0; t < e->n_tokens; t++)
                msgpack_pack_int32(&pk, e->tokens[t]);
            pack_key(&pk, map, "block_size");
            msgpack_pack_int(&pk, e->block_size);
            pack_key(&pk, map, "lora_id");
            msgpack_pack_nil(&pk);
            pack_key(&pk, map, "medium");
            pack_str(&pk, kv_events_medium_name(e->medium));
            pack_key(&pk, map, "lora_name");
            msgpack_pack_nil(&pk);
            break;
        case KVEV_REMOVED:
            pack_head(&pk, map, "BlockRemoved", 2);
            pack_key(&pk, map, "block_hashes");
            pack_hashes(&pk, e);
            pack_key(&pk, map, "medium");
            pack_str(&pk, kv_events_medium_name(e->medium));
            break;
        case KVEV_CLEARED:
            pack_head(&pk, map, "AllBlocksCleared", 0);
            break;
        }
    }
    msgpack_pack_int(&pk, 0); /* data_parallel_rank */
}

/* ---- the publisher --------------------------------------------------------------- */

typedef struct payload {
    uint64_t seq; /* assigned by the thread when sent */
    char *data;
    size_t len;
    struct payload *next;
} payload;

struct kv_events_publisher {
    kv_events_config cfg;
    void *zctx, *pub, *replay;
    int wake[2]; /* pipe: the engine thread wakes the publisher */
    pthread_t thread;
    pthread_mutex_t mu;
    payload *q_head, *q_tail; /* queued, oldest first */
    int q_len;
    int stop;
    /* publisher thread: the replay ring */
    payload **ring; /* (buffer_steps) */
    int ring_head, ring_len;
    uint64_t next_seq;
    _Atomic uint64_t sent, dropped;
};

static void be64(uint8_t out[8], int64_t v) {
    uint64_t u = (uint64_t)v;
    for (int i = 7; i >= 0; i--, u >>= 8)
        out[i] = (uint8_t)u;
}

static void payload_free(payload *p) {
    if (!p) return;
    free(p->data);
    free(p);
}

static void service_replay(kv_events_publisher *p) {
    zmq_msg_t parts[4];
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, p->replay, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (n < 4)
            parts[n] = m;
        else
            zmq_msg_close(&m);
        n++;
    }
    if (n == 0) return; /* nothing after all */
    int kept = n < 4 ? n : 4;
    if (n != 3 || zmq_msg_size(&parts[2]) == 0 || zmq_msg_size(&parts[2]) > 8) {
        LOG_W(MOD, "invalid replay request of %d frames: accepted: [empty, start seq as 1..8 "
                   "big-endian bytes]",
              n - 1);
        for (int i = 0; i < kept; i++)
            zmq_msg_close(&parts[i]);
        return;
    }
    uint64_t start = 0;
    const uint8_t *b = zmq_msg_data(&parts[2]);
    for (size_t i = 0; i < zmq_msg_size(&parts[2]); i++)
        start = start << 8 | b[i];
    size_t idlen = zmq_msg_size(&parts[0]);
    char id[256];
    if (idlen > sizeof id) idlen = sizeof id;
    memcpy(id, zmq_msg_data(&parts[0]), idlen);
    for (int i = 0; i < kept; i++)
        zmq_msg_close(&parts[i]);
    uint8_t sq[8];
    for (int i = 0; i < p->ring_len; i++) {
        payload *x = p->ring[(p->ring_head + i) % p->cfg.buffer_steps];
        if (x->seq < start) continue;
        be64(sq, (int64_t)x->seq);
        zmq_send(p->replay, id, idlen, ZMQ_SNDMORE);
        zmq_send(p->replay, "", 0, ZMQ_SNDMORE);
        zmq_send(p->replay, sq, 8, ZMQ_SNDMORE);
        zmq_send(p->replay, x->data, x->len, 0);
    }
    be64(sq, -1);
    zmq_send(p->replay, id, idlen, ZMQ_SNDMORE);
    zmq_send(p->replay, "", 0, ZMQ_SNDMORE);
    zmq_send(p->replay, sq, 8, ZMQ_SNDMORE);
    zmq_send(p->replay, "", 0, 0);
}

static void send_one(kv_events_publisher *p, payload *x) {
    x->seq = p->next_seq++;
    uint8_t sq[8];
    be64(sq, (int64_t)x->seq);
    size_t tl = strlen(p->cfg.topic);
    /* PUB never blocks: past the high-water mark ZMQ drops for that subscriber */
    if (zmq_send(p->pub, p->cfg.topic, tl, ZMQ_SNDMORE) < 0 ||
        zmq_send(p->pub, sq, 8, ZMQ_SNDMORE) < 0 || zmq_send(p->pub, x->data, x->len, 0) < 0)
        LOG_W(MOD, "sending event batch %llu failed: %s", (unsigned long long)x->seq,
              zmq_strerror(zmq_errno()));
    atomic_fetch_add(&p->sent, 1);
    if (p->ring_len == p->cfg.buffer_steps) { /* the oldest leaves the replay buffer */
        payload_free(p->ring[p->ring_head]);
        p->ring_head = (p->ring_head + 1) % p->cfg.buffer_steps;
        p->ring_len--;
    }
    p->ring[(p->ring_head + p->ring_len) % p->cfg.buffer_steps] = x;
    p->ring_len++;
}

static void *publisher_main(void *arg) {
    kv_events_publisher *p = arg;
    for (;;) {
        zmq_pollitem_t it[2] = {{NULL, p->wake[0], ZMQ_POLLIN, 0}, {p->replay, 0, ZMQ_POLLIN, 0}};
        int rc = zmq_poll(it, p->replay ? 2 : 1, 1000);
        if (rc < 0 && zmq_errno() != EINTR) {
            LOG_E(MOD, "poll failed: %s", zmq_strerror(zmq_errno()));
            break;
        }
        if (it[0].revents & ZMQ_POLLIN) {
            char buf[256];
            while (read(p->wake[0], buf, sizeof buf) > 0) {
            }
        }
        if (p->replay && (it[1].revents & ZMQ_POLLIN)) service_replay(p);
        pthread_mutex_lock(&p->mu);
        payload *q = p->q_head;
        p->q_head = p->q_tail = NULL;
        p->q_len = 0;
        int stop = p->stop;
        pthread_mutex_unlock(&p->mu);
        while (q) {
            payload *n = q->next;
            send_one(p, q);
            q = n;
        }
        if (stop) break;
    }
    return NULL;
}

void kv_events_publisher_publish(void *arg, const kvev_log *log) {
    kv_events_publisher *p = arg;
    if (!log->n) return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    encode_batch(&sb, log, (double)ts.tv_sec + ts.tv_nsec * 1e-9, p->cfg.map_events);
    payload *x = calloc(1, sizeof *x);
    if (!x || !sb.data) {
        free(x);
        msgpack_sbuffer_destroy(&sb);
        atomic_fetch_add(&p->dropped, 1);
        LOG_W(MOD, "out of memory encoding a KV event batch: dropped");
        return;
    }
    x->len = sb.size;
    x->data = msgpack_sbuffer_release(&sb);
    pthread_mutex_lock(&p->mu);
    int full = p->q_len >= p->cfg.max_queue_size;
    if (!full) {
        if (p->q_tail)
            p->q_tail->next = x;
        else
            p->q_head = x;
        p->q_tail = x;
        p->q_len++;
    }
    pthread_mutex_unlock(&p->mu);
    if (full) {
        uint64_t d = atomic_fetch_add(&p->dropped, 1);
        if ((d & (d + 1)) == 0) /* 1st, 2nd, 4th, ... */
            LOG_W(MOD, "the event queue holds max_queue_size (%d) batches: batch dropped (%llu so far)",
                  p->cfg.max_queue_size, (unsigned long long)d + 1);
        payload_free(x);
        return;
    }
    ssize_t w = write(p->wake[1], "", 1); /* a full pipe already wakes the thread */
    (void)w;
}

void kv_events_publisher_counts(kv_events_publisher *p, uint64_t *sent, uint64_t *dropped) {
    *sent = atomic_load(&p->sent);
    *dropped = atomic_load(&p->dropped);
}

static int binds(const char *ep) {
    return strchr(ep, '*') || strstr(ep, "::") || !strncmp(ep, "ipc://", 6) ||
           !strncmp(ep, "inproc://", 9);
}

static void close_all(kv_events_publisher *p) {
    if (p->pub) zmq_close(p->pub);
    if (p->replay) zmq_close(p->replay);
    if (p->zctx) zmq_ctx_term(p->zctx);
    if (p->wake[0] >= 0) close(p->wake[0]);
    if (p->wake[1] >= 0) close(p->wake[1]);
    for (int i = 0; p->ring && i < p->ring_len; i++)
        payload_free(p->ring[(p->ring_head + i) % p->cfg.buffer_steps]);
    free(p->ring);
    while (p->q_head) {
        payload *n = p->q_head->next;
        payload_free(p->q_head);
        p->q_head = n;
    }
    pthread_mutex_destroy(&p->mu);
    free(p);
}

int kv_events_publisher_create(const kv_events_config *c, kv_events_publisher **out, char *err,
                               size_t errlen) {
    *out = NULL;
    kv_events_publisher *p = calloc(1, sizeof *p);
    if (!p) {
        set_err(err, errlen, "out of memory");
        return -1;
    }
    p->cfg = *c;
    p->wake[0] = p->wake[1] = -1;
    pthread_mutex_init(&p->mu, NULL);
    p->ring = calloc((size_t)c->buffer_steps, sizeof *p->ring);
    if (!p->ring || pipe2(p->wake, O_CLOEXEC | O_NONBLOCK)) {
        set_err(err, errlen, "out of memory or file descriptors");
        close_all(p);
        return -1;
    }
    p->zctx = zmq_ctx_new();
    p->pub = p->zctx ? zmq_socket(p->zctx, ZMQ_PUB) : NULL;
    if (!p->pub) {
        set_err(err, errlen, "cannot create a ZMQ PUB socket: %s", zmq_strerror(zmq_errno()));
        close_all(p);
        return -1;
    }
    int linger = 0;
    zmq_setsockopt(p->pub, ZMQ_SNDHWM, &c->hwm, sizeof c->hwm);
    zmq_setsockopt(p->pub, ZMQ_LINGER, &linger, sizeof linger);
    int b = binds(c->endpoint);
    if ((b ? zmq_bind(p->pub, c->endpoint) : zmq_connect(p->pub, c->endpoint)) != 0) {
        set_err(err, errlen, "--kv-events-config endpoint '%s': cannot %s: %s", c->endpoint,
                b ? "bind" : "connect", zmq_strerror(zmq_errno()));
        close_all(p);
        return -1;
    }
    if (c->replay_endpoint[0]) {
        p->replay = zmq_socket(p->zctx, ZMQ_ROUTER);
        if (!p->replay) {
            set_err(err, errlen, "cannot create a ZMQ ROUTER socket: %s", zmq_strerror(zmq_errno()));
            close_all(p);
            return -1;
        }
        zmq_setsockopt(p->replay, ZMQ_LINGER, &linger, sizeof linger);
        if (zmq_bind(p->replay, c->replay_endpoint) != 0) {
            set_err(err, errlen, "--kv-events-config replay_endpoint '%s': cannot bind: %s",
                    c->replay_endpoint, zmq_strerror(zmq_errno()));
            close_all(p);
            return -1;
        }
    }
    if (pthread_create(&p->thread, NULL, publisher_main, p)) {
        set_err(err, errlen, "cannot start the KV event publisher thread");
        close_all(p);
        return -1;
    }
    LOG_I(MOD, "publishing KV cache events on %s (%s)%s%s, %s events", c->endpoint,
          b ? "bound" : "connected", c->replay_endpoint[0] ? ", replay on " : "",
          c->replay_endpoint, c->map_events ? "map" : "array");
    /* BlockStored carries every cached block's token ids: the prompts, unauthenticated (ZMQ
     * has no credentials here, as in vLLM) */
    if ((b && !strncmp(c->endpoint, "tcp://*", 7)) || !strncmp(c->replay_endpoint, "tcp://*", 7))
        LOG_W(MOD, "the KV events (and their replay) carry the token ids of every cached prompt "
                   "to anyone who can reach %s%s%s: bind a private address in --kv-events-config "
                   "or keep the port behind a firewall (docs/security.md)",
              b ? c->endpoint : "", b && c->replay_endpoint[0] ? " and " : "",
              c->replay_endpoint);
    *out = p;
    return 0;
}

void kv_events_publisher_destroy(kv_events_publisher *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_mutex_unlock(&p->mu);
    ssize_t w = write(p->wake[1], "", 1);
    (void)w;
    pthread_join(p->thread, NULL);
    LOG_I(MOD, "published %llu KV event batches (%llu dropped)",
          (unsigned long long)atomic_load(&p->sent), (unsigned long long)atomic_load(&p->dropped));
    close_all(p);
}
