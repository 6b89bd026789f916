/* Unit tests: the ZeroMQ side channel (PROTOCOL.md §3).  Our ROUTER server and
 * DEALER client together (replies from other threads, CONTINUE...FINISH,
 * release pulls, undecodable and multi-frame pulls answered ERROR, receive
 * timeout, cancel, replies after stop, auth frames on pulls, replies and
 * cancels), and each against a vLLM-shaped peer in Python (pyzmq + msgspec,
 * tests/tools/side_channel_peer.py). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/auth.h"
#include "base/clock.h"
#include "connector/mooncake/side_channel.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

/* ---- a producer-like handler -------------------------------------------- */

typedef struct producer {
    int mode; /* 0: reply per request from a thread; 1: never reply */
    pthread_mutex_t mu;
    side_channel_call *held; /* mode 1: the call kept */
    side_channel_pull *held_pull;
    char last_host[64]; /* remote_hostname of the last pull */
} producer;

static atomic_int g_live_jobs; /* reply threads still running */

typedef struct job {
    side_channel_call *call;
    side_channel_pull *pull;
} job;

static void *reply_thread(void *arg) {
    job *j = arg;
    /* one CONTINUE per request but the last, then FINISH with the last */
    for (size_t i = 0; i < j->pull->n_reqs; i++) {
        usleep(2000);
        char *ok[1] = {j->pull->reqs[i].req_id};
        side_channel_reply r = {.status = i + 1 < j->pull->n_reqs ? SIDE_CHANNEL_CONTINUE
                                                                  : SIDE_CHANNEL_FINISH,
                                .ok_reqs = ok,
                                .n_ok = 1};
        if (side_channel_call_reply(j->call, &r) != 0) abort(); /* no cmocka asserts off-thread */
    }
    side_channel_pull_release(j->pull);
    free(j);
    atomic_fetch_sub(&g_live_jobs, 1);
    return NULL;
}

static void on_pull(void *ud, side_channel_call *call, side_channel_pull *pull) {
    producer *p = ud;
    pthread_mutex_lock(&p->mu);
    snprintf(p->last_host, sizeof p->last_host, "%s", pull->remote_hostname);
    pthread_mutex_unlock(&p->mu);
    if (p->mode == 1) {
        p->held = call;
        p->held_pull = pull;
        return;
    }
    if (pull->n_reqs == 0) { /* nothing to send: answer at once, on the server thread */
        side_channel_reply r = {.status = SIDE_CHANNEL_FINISH};
        side_channel_call_reply(call, &r);
        side_channel_pull_release(pull);
        return;
    }
    job *j = malloc(sizeof *j);
    j->call = call;
    j->pull = pull;
    pthread_t t;
    atomic_fetch_add(&g_live_jobs, 1);
    pthread_create(&t, NULL, reply_thread, j);
    pthread_detach(t);
}

typedef struct collected {
    int n;
    int status[16];
    char ok[16][32];
    char msg[256];
} collected;

static int collect(void *ud, const side_channel_reply *r) {
    collected *c = ud;
    if (c->n < 16) {
        c->status[c->n] = r->status;
        snprintf(c->ok[c->n], sizeof c->ok[0], "%s", r->n_ok ? r->ok_reqs[0] : "");
        c->n++;
    }
    if (r->err_msg) snprintf(c->msg, sizeof c->msg, "%s", r->err_msg);
    return 0;
}

static side_channel_pull make_pull(side_channel_req_blocks *reqs, size_t n) {
    static uint64_t base[] = {1ull << 40};
    static int64_t lens[] = {4096};
    side_channel_pull p = {.remote_hostname = "decode-1",
                           .remote_port = 17000,
                           .remote_tp_size = 1,
                           .reqs = reqs,
                           .n_reqs = n,
                           .kv_caches_base_addr = base,
                           .block_lens = lens,
                           .kv_block_lens = lens,
                           .n_regions = 1,
                           .remote_pp_size = 1};
    return p;
}

static side_channel_server *start_auth(producer *p, const char *secret, char *ep, size_t cap) {
    pthread_mutex_init(&p->mu, NULL);
    side_channel_server *s;
    char err[256];
    if (side_channel_server_start_auth("127.0.0.1", 0, secret, on_pull, p, &s, err, sizeof err))
        fail_msg("%s", err);
    snprintf(ep, cap, "tcp://127.0.0.1:%u", (unsigned)side_channel_server_port(s));
    return s;
}

static side_channel_server *start(producer *p, char *ep, size_t cap) {
    return start_auth(p, NULL, ep, cap);
}

static void test_pull_continue_finish(void **state) {
    (void)state;
    producer p = {0};
    char ep[64], err[256];
    side_channel_server *s = start(&p, ep, sizeof ep);
    int64_t ids[] = {1, 2, 3};
    side_channel_block_group g = {ids, 3};
    side_channel_req_blocks reqs[3] = {{"a", "xa", &g, 1}, {"b", "xb", &g, 1}, {"c", "xc", &g, 1}};
    side_channel_pull pull = make_pull(reqs, 3);
    collected c = {0};
    assert_int_equal(side_channel_pull_run(ep, &pull, 5.0, NULL, collect, &c, err, sizeof err), 0);
    assert_int_equal(c.n, 3);
    assert_int_equal(c.status[0], SIDE_CHANNEL_CONTINUE);
    assert_int_equal(c.status[1], SIDE_CHANNEL_CONTINUE);
    assert_int_equal(c.status[2], SIDE_CHANNEL_FINISH);
    assert_string_equal(c.ok[0], "a");
    assert_string_equal(c.ok[2], "c");
    assert_string_equal(p.last_host, "decode-1");
    /* a release pull (no requests) is answered from the server thread itself */
    side_channel_pull empty = make_pull(NULL, 0);
    memset(&c, 0, sizeof c);
    assert_int_equal(side_channel_pull_run(ep, &empty, 5.0, NULL, collect, &c, err, sizeof err), 0);
    assert_int_equal(c.n, 1);
    assert_int_equal(c.status[0], SIDE_CHANNEL_FINISH);
    /* many concurrent pulls, each on its own DEALER */
    for (int round = 0; round < 20; round++) {
        memset(&c, 0, sizeof c);
        assert_int_equal(side_channel_pull_run(ep, &pull, 5.0, NULL, collect, &c, err, sizeof err),
                         0);
        assert_int_equal(c.n, 3);
    }
    for (int i = 0; i < 100 && side_channel_server_pending(s) > 0; i++)
        usleep(10000);
    assert_int_equal(side_channel_server_pending(s), 0);
    side_channel_server_stop(s);
    for (int i = 0; i < 100 && atomic_load(&g_live_jobs) > 0; i++)
        usleep(10000);
    assert_int_equal(atomic_load(&g_live_jobs), 0);
}

/* A finished pull leaves its connection for the next pull to the same producer: twenty pulls
 * in turn use one; a pull that ended without the final reply does not leave its connection;
 * a producer that stopped and started again on the same port is reached on a new one. */
static void test_pull_connections_are_reused(void **state) {
    (void)state;
    producer p = {0};
    char ep[64], err[256];
    side_channel_server *s = start(&p, ep, sizeof ep);
    int64_t ids[] = {1};
    side_channel_block_group g = {ids, 1};
    side_channel_req_blocks req = {"a", "xa", &g, 1};
    side_channel_pull pull = make_pull(&req, 1);
    assert_int_equal(side_channel_idle_pull_connections(ep), 0);
    for (int round = 0; round < 20; round++) {
        collected c = {0};
        assert_int_equal(side_channel_pull_run(ep, &pull, 5.0, NULL, collect, &c, err, sizeof err),
                         0);
        assert_int_equal(c.status[c.n - 1], SIDE_CHANNEL_FINISH);
        assert_int_equal(side_channel_idle_pull_connections(ep), 1);
    }
    /* the producer goes away and a new one takes its port: the kept connection saw the
     * disconnect and is not used; the pull goes over a new one */
    uint16_t port = side_channel_server_port(s);
    side_channel_server_stop(s);
    for (int i = 0; i < 100 && atomic_load(&g_live_jobs) > 0; i++)
        usleep(10000);
    usleep(100000); /* the disconnect reaches the kept connection's monitor */
    producer p2 = {0};
    pthread_mutex_init(&p2.mu, NULL);
    side_channel_server *s2;
    assert_int_equal(side_channel_server_start("127.0.0.1", port, on_pull, &p2, &s2, err, sizeof err),
                     0);
    collected c = {0};
    assert_int_equal(side_channel_pull_run(ep, &pull, 5.0, NULL, collect, &c, err, sizeof err), 0);
    assert_int_equal(c.status[c.n - 1], SIDE_CHANNEL_FINISH);
    assert_int_equal(side_channel_idle_pull_connections(ep), 1);
    /* a pull that times out (the producer holds it) closes its connection */
    p2.mode = 1;
    memset(&c, 0, sizeof c);
    assert_int_equal(side_channel_pull_run(ep, &pull, 0.2, NULL, collect, &c, err, sizeof err),
                     SIDE_CHANNEL_ETIMEDOUT);
    assert_int_equal(side_channel_idle_pull_connections(ep), 0);
    side_channel_server_stop(s2);
    side_channel_reply fin = {.status = SIDE_CHANNEL_ERROR, .err_msg = "stopped"};
    side_channel_call_reply(p2.held, &fin);
    side_channel_pull_release(p2.held_pull);
    for (int i = 0; i < 100 && atomic_load(&g_live_jobs) > 0; i++)
        usleep(10000);
    assert_int_equal(atomic_load(&g_live_jobs), 0);
}

/* Raw DEALER exchange: send frames, return the one reply decoded. */
static void raw_exchange(const char *ep, const void *const *frames, const size_t *lens, int n,
                         side_channel_reply *out) {
    void *ctx = zmq_ctx_new();
    void *d = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0, rcv = 5000;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(d, ZMQ_RCVTIMEO, &rcv, sizeof rcv);
    assert_int_equal(zmq_connect(d, ep), 0);
    for (int i = 0; i < n; i++)
        assert_true(zmq_send(d, frames[i], lens[i], i + 1 < n ? ZMQ_SNDMORE : 0) >= 0);
    char buf[4096];
    int got = zmq_recv(d, buf, sizeof buf, 0);
    assert_true(got > 0);
    char err[256];
    assert_int_equal(side_channel_reply_decode(buf, (size_t)got, out, err, sizeof err), 0);
    zmq_close(d);
    zmq_ctx_term(ctx);
}

static void test_bad_pulls_get_error_replies(void **state) {
    (void)state;
    producer p = {0};
    char ep[64];
    side_channel_server *s = start(&p, ep, sizeof ep);
    side_channel_reply r;
    const void *f1[] = {"\xdd\xff\xff\xff\xff"};
    size_t l1[] = {5};
    raw_exchange(ep, f1, l1, 1, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(r.err_msg, "malformed msgpack"));
    side_channel_reply_free(&r);
    const void *f2[] = {"\x80"}; /* {} */
    size_t l2[] = {1};
    raw_exchange(ep, f2, l2, 1, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(r.err_msg, "missing required key 'remote_hostname'"));
    side_channel_reply_free(&r);
    const void *f3[] = {"", "\x80"}; /* a REQ-style empty delimiter: two frames */
    size_t l3[] = {0, 1};
    raw_exchange(ep, f3, l3, 2, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(r.err_msg, "expected one frame, got 2"));
    side_channel_reply_free(&r);
    assert_int_equal(side_channel_server_pending(s), 0);
    side_channel_server_stop(s);
}

static void test_timeout_cancel_and_reply_after_stop(void **state) {
    (void)state;
    producer p = {.mode = 1};
    char ep[64], err[256];
    side_channel_server *s = start(&p, ep, sizeof ep);
    side_channel_req_blocks req = {"a", "xa", NULL, 0};
    side_channel_pull pull = make_pull(&req, 1);
    collected c = {0};
    uint64_t t0 = clock_now_ns();
    assert_int_equal(side_channel_pull_run(ep, &pull, 0.3, NULL, collect, &c, err, sizeof err),
                     SIDE_CHANNEL_ETIMEDOUT);
    double el = (double)(clock_now_ns() - t0) / 1e9;
    assert_true(el >= 0.29 && el < 2.0);
    assert_non_null(strstr(err, "no reply from tcp://127.0.0.1:"));
    assert_int_equal(c.n, 0);
    assert_int_equal(side_channel_server_pending(s), 1);
    /* a CONTINUE to the held call still works while the server runs */
    side_channel_reply cont = {.status = SIDE_CHANNEL_CONTINUE};
    assert_int_equal(side_channel_call_reply(p.held, &cont), 0);
    side_channel_server_stop(s);
    /* after stop: refused, but the final reply still releases the call */
    assert_int_equal(side_channel_call_reply(p.held, &cont), SIDE_CHANNEL_ECLOSED);
    side_channel_reply fin = {.status = SIDE_CHANNEL_ERROR, .err_msg = "shutting down"};
    assert_int_equal(side_channel_call_reply(p.held, &fin), SIDE_CHANNEL_ECLOSED);
    side_channel_pull_release(p.held_pull);
    /* cancel: nobody listens on this port */
    atomic_int cancel = 1;
    assert_int_equal(side_channel_pull_run(ep, &pull, 5.0, &cancel, collect, &c, err, sizeof err),
                     SIDE_CHANNEL_ECANCELED);
    assert_int_equal(
        side_channel_pull_run("nonsense", &pull, 1.0, NULL, collect, &c, err, sizeof err),
        SIDE_CHANNEL_EINVAL);
    assert_non_null(strstr(err, "'nonsense' is not accepted"));
}

/* ---- against vLLM-shaped Python peers ----------------------------------- */

static void test_python_dealer_against_our_router(void **state) {
    (void)state;
    producer p = {0};
    char ep[64];
    side_channel_server *s = start(&p, ep, sizeof ep);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "python3 %s/tests/tools/side_channel_peer.py dealer %s",
             DISAGG_SOURCE_DIR, ep);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    char out[1024] = "";
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    int st = pclose(f);
    if (st != 0) fail_msg("peer failed (%d): %s", st, out);
    assert_string_equal(out, "CONTINUE ok=d-1 err= msg=\nFINISH ok=d-2 err= msg=\n");
    assert_string_equal(p.last_host, "127.0.0.1");
    side_channel_server_stop(s);
    for (int i = 0; i < 100 && atomic_load(&g_live_jobs) > 0; i++)
        usleep(10000);
    assert_int_equal(atomic_load(&g_live_jobs), 0);
}

static void test_our_dealer_against_python_router(void **state) {
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "python3 %s/tests/tools/side_channel_peer.py router",
             DISAGG_SOURCE_DIR);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    char line[256];
    assert_non_null(fgets(line, sizeof line, f));
    int port = atoi(line);
    assert_true(port > 0);
    char ep[64], err[256];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    int64_t ids[] = {5, 6};
    side_channel_block_group g = {ids, 2};
    side_channel_req_blocks reqs[2] = {{"r1", "x1", &g, 1}, {"r2", "x2", &g, 1}};
    side_channel_pull pull = make_pull(reqs, 2);
    pull.layout = "fingerprint"; /* our extension: a vLLM peer must ignore it */
    collected c = {0};
    assert_int_equal(side_channel_pull_run(ep, &pull, 10.0, NULL, collect, &c, err, sizeof err), 0);
    assert_non_null(fgets(line, sizeof line, f));
    assert_string_equal(line, "pull host=decode-1 port=17000 reqs=r1,r2 blocks=[[5, 6]] "
                              "base=[1099511627776] pp=1\n");
    assert_int_equal(pclose(f), 0);
    assert_int_equal(c.n, 2);
    assert_int_equal(c.status[0], SIDE_CHANNEL_CONTINUE);
    assert_string_equal(c.ok[0], "r1");
    assert_int_equal(c.status[1], SIDE_CHANNEL_FINISH);
    assert_string_equal(c.ok[1], "r2");
}

/* ---- authentication (docs/security.md) -------------- */

static void put64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}

/* An auth frame built from the documented layout (side_channel.h), so that
 * the test checks the format, not our own helper. */
static void make_frame(unsigned char f[SIDE_CHANNEL_AUTH_LEN], const char *secret, char kind,
                       uint64_t ctr, const unsigned char nonce[16], const void *payload,
                       size_t len) {
    memcpy(f, "DKA1", 4);
    f[4] = (unsigned char)kind;
    put64(f + 5, ctr);
    memcpy(f + 13, nonce, 16);
    const char *label = kind == 'P'   ? "disagg-sc-pull-v1"
                        : kind == 'C' ? "disagg-sc-cancel-v1"
                                      : "disagg-sc-reply-v1";
    const void *parts[4] = {label, f + 5, f + 13, payload};
    size_t lens[4] = {strlen(label), 8, 16, len};
    assert_int_equal(auth_hmacv(secret, strlen(secret), parts, lens, 4, f + 29), 0);
}

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void test_auth_pulls(void **state) {
    (void)state;
    producer p = {0};
    char ep[64], err[512];
    side_channel_server *s = start_auth(&p, "s3cret", ep, sizeof ep);
    int64_t ids[] = {1, 2, 3};
    side_channel_block_group g = {ids, 3};
    side_channel_req_blocks reqs[3] = {{"a", "xa", &g, 1}, {"b", "xb", &g, 1}, {"c", "xc", &g, 1}};
    side_channel_pull pull = make_pull(reqs, 3);
    /* same secret: CONTINUE, CONTINUE, FINISH, each MAC'd in sequence */
    collected c = {0};
    assert_int_equal(
        side_channel_pull_run_auth(ep, &pull, "s3cret", 5.0, NULL, collect, &c, err, sizeof err),
        0);
    assert_int_equal(c.n, 3);
    assert_int_equal(c.status[2], SIDE_CHANNEL_FINISH);
    assert_string_equal(c.ok[2], "c");
    assert_int_equal(side_channel_server_auth_rejected(s), 0);
    /* no secret on the decoder: refused, and the decoder is told why */
    memset(&c, 0, sizeof c);
    assert_int_equal(side_channel_pull_run(ep, &pull, 5.0, NULL, collect, &c, err, sizeof err), 0);
    assert_int_equal(c.n, 1);
    assert_int_equal(c.status[0], SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(c.msg, "unauthenticated pull refused"));
    assert_non_null(strstr(c.msg, "DISAGG_KV_SECRET"));
    assert_int_equal(side_channel_server_auth_rejected(s), 1);
    /* a different secret: the MAC does not match */
    memset(&c, 0, sizeof c);
    assert_int_equal(
        side_channel_pull_run_auth(ep, &pull, "other", 5.0, NULL, collect, &c, err, sizeof err),
        SIDE_CHANNEL_EAUTH);
    assert_int_equal(c.n, 0);
    assert_non_null(strstr(err, "refused the pull"));
    assert_non_null(strstr(err, "MAC does not match"));
    assert_int_equal(side_channel_server_auth_rejected(s), 2);
    /* raw pulls: a forged MAC, a stale timestamp with a valid MAC, a bad shape */
    char *buf;
    size_t len;
    assert_int_equal(side_channel_pull_encode(&pull, &buf, &len), 0);
    unsigned char nonce[16] = {7}, f[SIDE_CHANNEL_AUTH_LEN];
    make_frame(f, "s3cret", 'P', now_ms(), nonce, buf, len);
    f[40] ^= 1;
    side_channel_reply r;
    const void *fr[2] = {buf, f};
    size_t fl[2] = {len, sizeof f};
    raw_exchange(ep, fr, fl, 2, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(r.err_msg, "MAC does not match"));
    side_channel_reply_free(&r);
    make_frame(f, "s3cret", 'P', now_ms() - 120000, nonce, buf, len);
    raw_exchange(ep, fr, fl, 2, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(r.err_msg, "timestamp is 120 s off"));
    side_channel_reply_free(&r);
    fl[1] = 10;
    raw_exchange(ep, fr, fl, 2, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(r.err_msg, "61-byte authentication frame"));
    side_channel_reply_free(&r);
    /* the documented frame with the right secret is accepted by a raw peer */
    make_frame(f, "s3cret", 'P', now_ms(), nonce, buf, len);
    fl[1] = sizeof f;
    raw_exchange(ep, fr, fl, 2, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_CONTINUE);
    side_channel_reply_free(&r);
    free(buf);
    assert_int_equal(side_channel_server_auth_rejected(s), 5);
    for (int i = 0; i < 100 && side_channel_server_pending(s) > 0; i++)
        usleep(10000);
    side_channel_server_stop(s);
    /* a producer without a secret refuses an authenticated pull, naming why */
    producer q = {0};
    s = start_auth(&q, NULL, ep, sizeof ep);
    memset(&c, 0, sizeof c);
    assert_int_equal(
        side_channel_pull_run_auth(ep, &pull, "s3cret", 5.0, NULL, collect, &c, err, sizeof err),
        SIDE_CHANNEL_EAUTH);
    assert_non_null(strstr(err, "this producer has no auth_secret"));
    assert_int_equal(side_channel_server_auth_rejected(s), 1);
    side_channel_server_stop(s);
    for (int i = 0; i < 100 && atomic_load(&g_live_jobs) > 0; i++)
        usleep(10000);
    assert_int_equal(atomic_load(&g_live_jobs), 0);
}

/* A fake producer (raw ROUTER): answers one pull with the given frames. */
typedef struct fake_router {
    void *ctx, *r;
    char ep[64];
    unsigned char nonce[16]; /* of the pull received */
} fake_router;

typedef struct forged {
    fake_router *fr;
    int mode; /* 0: no auth frame; 1: a MAC with a wrong secret; 2: wrong sequence */
} forged;

static void *forge_thread(void *arg) {
    forged *fg = arg;
    void *r = fg->fr->r;
    char id[256], pl[4096];
    unsigned char af[128];
    int idn = zmq_recv(r, id, sizeof id, 0), pn = zmq_recv(r, pl, sizeof pl, 0);
    int an = zmq_recv(r, af, sizeof af, 0);
    if (idn <= 0 || pn <= 0 || an != SIDE_CHANNEL_AUTH_LEN) return NULL;
    char *ok[1] = {"a"};
    side_channel_reply rep = {.status = SIDE_CHANNEL_FINISH, .ok_reqs = ok, .n_ok = 1};
    char *buf;
    size_t len;
    side_channel_reply_encode(&rep, &buf, &len);
    unsigned char f[SIDE_CHANNEL_AUTH_LEN];
    const char *key = fg->mode == 1 ? "wrong" : "s3cret";
    uint64_t seq = fg->mode == 2 ? 1 : 0;
    /* same layout as make_frame (no cmocka off-thread: build by hand) */
    memcpy(f, "DKA1", 4);
    f[4] = 'R';
    put64(f + 5, seq);
    memcpy(f + 13, af + 13, 16);
    const void *pp[4] = {"disagg-sc-reply-v1", f + 5, f + 13, buf};
    size_t ll[4] = {strlen("disagg-sc-reply-v1"), 8, 16, len};
    auth_hmacv(key, strlen(key), pp, ll, 4, f + 29);
    zmq_send(r, id, (size_t)idn, ZMQ_SNDMORE);
    zmq_send(r, buf, len, fg->mode == 0 ? 0 : ZMQ_SNDMORE);
    if (fg->mode != 0) zmq_send(r, f, sizeof f, 0);
    free(buf);
    return NULL;
}

static void test_auth_forged_replies_refused(void **state) {
    (void)state;
    static const char *const want[] = {"is not authenticated (no authentication frame)",
                                       "failed authentication", "failed authentication"};
    for (int mode = 0; mode < 3; mode++) {
        fake_router fr = {0};
        fr.ctx = zmq_ctx_new();
        fr.r = zmq_socket(fr.ctx, ZMQ_ROUTER);
        int linger = 0;
        zmq_setsockopt(fr.r, ZMQ_LINGER, &linger, sizeof linger);
        assert_int_equal(zmq_bind(fr.r, "tcp://127.0.0.1:*"), 0);
        size_t n = sizeof fr.ep;
        zmq_getsockopt(fr.r, ZMQ_LAST_ENDPOINT, fr.ep, &n);
        forged fg = {&fr, mode};
        pthread_t t;
        pthread_create(&t, NULL, forge_thread, &fg);
        side_channel_req_blocks req = {"a", "xa", NULL, 0};
        side_channel_pull pull = make_pull(&req, 1);
        collected c = {0};
        char err[512];
        assert_int_equal(side_channel_pull_run_auth(fr.ep, &pull, "s3cret", 5.0, NULL, collect, &c,
                                                    err, sizeof err),
                         SIDE_CHANNEL_EAUTH);
        assert_int_equal(c.n, 0); /* nothing forged reached the caller */
        if (!strstr(err, want[mode])) fail_msg("mode %d: '%s' lacks '%s'", mode, err, want[mode]);
        pthread_join(t, NULL);
        zmq_close(fr.r);
        zmq_ctx_term(fr.ctx);
    }
}

/* ---- cancel and its acknowledgement --------------------------------------- */

typedef struct cancel_seen {
    producer *p;
    int calls;
    int same_peer;
    char req[32], xfer[32];
    int ack; /* answer the held pull's FINISH */
} cancel_seen;

static cancel_seen g_cancel;

static void on_cancel(void *ud, const void *peer, size_t peer_len, const side_channel_cancel *c) {
    producer *p = ud;
    g_cancel.same_peer = side_channel_call_peer_is(p->held, peer, peer_len);
    if (c->n) {
        snprintf(g_cancel.req, sizeof g_cancel.req, "%s", c->req_ids[0]);
        snprintf(g_cancel.xfer, sizeof g_cancel.xfer, "%s", c->transfer_ids[0]);
    }
    if (g_cancel.ack && g_cancel.same_peer) {
        char *err[1] = {c->req_ids[0]};
        side_channel_reply r = {.status = SIDE_CHANNEL_FINISH,
                                .err_reqs = err,
                                .n_err = 1,
                                .err_msg = "cancelled by the decoder"};
        side_channel_call_reply(p->held, &r);
        side_channel_pull_release(p->held_pull);
        p->held = NULL;
        p->held_pull = NULL;
    }
    __atomic_fetch_add(&g_cancel.calls, 1, __ATOMIC_SEQ_CST); /* last: the tests poll it */
}

static void test_cancel_acknowledged_by_the_producer(void **state) {
    (void)state;
    producer p = {.mode = 1};
    char ep[64], err[256];
    side_channel_server *s = start(&p, ep, sizeof ep);
    side_channel_server_set_cancel_fn(s, on_cancel);
    memset(&g_cancel, 0, sizeof g_cancel);
    g_cancel.ack = 1;
    int64_t ids[] = {3};
    side_channel_block_group g = {ids, 1};
    side_channel_req_blocks req = {"d-7", "xfer-7", &g, 1};
    side_channel_pull pull = make_pull(&req, 1);
    collected c = {0};
    atomic_int cancel = SIDE_CHANNEL_CANCEL_ASK;
    int acked = -1;
    uint64_t t0 = clock_now_ns();
    assert_int_equal(side_channel_pull_run_ex(ep, &pull, NULL, 10.0, &cancel, 5.0, &acked, collect,
                                              &c, err, sizeof err),
                     SIDE_CHANNEL_ECANCELED);
    assert_int_equal(acked, 1);
    assert_true((double)(clock_now_ns() - t0) / 1e9 < 2.0);
    assert_non_null(strstr(err, "the producer acknowledged"));
    assert_int_equal(g_cancel.calls, 1);
    assert_int_equal(g_cancel.same_peer, 1);
    assert_string_equal(g_cancel.req, "d-7");
    assert_string_equal(g_cancel.xfer, "xfer-7");
    assert_int_equal(side_channel_server_pending(s), 0);
    side_channel_server_stop(s);
}

static void test_cancel_not_acknowledged(void **state) {
    (void)state;
    producer p = {.mode = 1};
    char ep[64], err[256];
    side_channel_server *s = start(&p, ep, sizeof ep);
    side_channel_req_blocks req = {"d-8", "xfer-8", NULL, 0};
    side_channel_pull pull = make_pull(&req, 1);
    collected c = {0};
    /* no cancel handler: the server answers ERROR, which is no acknowledgement */
    atomic_int cancel = SIDE_CHANNEL_CANCEL_ASK;
    int acked = -1;
    uint64_t t0 = clock_now_ns();
    assert_int_equal(side_channel_pull_run_ex(ep, &pull, NULL, 10.0, &cancel, 5.0, &acked, collect,
                                              &c, err, sizeof err),
                     SIDE_CHANNEL_ECANCELED);
    assert_int_equal(acked, 0);
    assert_true((double)(clock_now_ns() - t0) / 1e9 < 2.0);
    /* a handler that does not answer: no acknowledgement within the wait */
    side_channel_server_set_cancel_fn(s, on_cancel);
    memset(&g_cancel, 0, sizeof g_cancel);
    side_channel_pull_release(p.held_pull);
    side_channel_reply fin = {.status = SIDE_CHANNEL_FINISH};
    side_channel_call_reply(p.held, &fin);
    t0 = clock_now_ns();
    assert_int_equal(side_channel_pull_run_ex(ep, &pull, NULL, 10.0, &cancel, 0.3, &acked, collect,
                                              &c, err, sizeof err),
                     SIDE_CHANNEL_ECANCELED);
    double el = (double)(clock_now_ns() - t0) / 1e9;
    assert_int_equal(acked, 0);
    assert_true(el >= 0.29 && el < 3.0);
    assert_int_equal(g_cancel.calls, 1);
    /* DROP: stop without asking */
    side_channel_pull_release(p.held_pull);
    side_channel_call_reply(p.held, &fin);
    __atomic_store_n(&p.held_pull, NULL, __ATOMIC_SEQ_CST);
    atomic_store(&cancel, SIDE_CHANNEL_CANCEL_DROP);
    assert_int_equal(side_channel_pull_run_ex(ep, &pull, NULL, 10.0, &cancel, 5.0, &acked, collect,
                                              &c, err, sizeof err),
                     SIDE_CHANNEL_ECANCELED);
    assert_int_equal(acked, 0);
    /* the pull may or may not have reached the server (the DEALER closed at once) */
    for (int i = 0; i < 30 && !__atomic_load_n(&p.held_pull, __ATOMIC_SEQ_CST); i++)
        usleep(10000);
    usleep(50000);
    assert_int_equal(g_cancel.calls, 1); /* no cancel was sent */
    if (__atomic_load_n(&p.held_pull, __ATOMIC_SEQ_CST)) {
        side_channel_pull_release(p.held_pull);
        side_channel_call_reply(p.held, &fin);
    }
    side_channel_server_stop(s);
}

static void test_cancel_against_a_vllm_router_falls_back(void **state) {
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "python3 %s/tests/tools/side_channel_peer.py router-cancel",
             DISAGG_SOURCE_DIR);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    char line[512];
    assert_non_null(fgets(line, sizeof line, f));
    int port = atoi(line);
    assert_true(port > 0);
    char ep[64], err[256];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    int64_t ids[] = {5};
    side_channel_block_group g = {ids, 1};
    side_channel_req_blocks req = {"d-9", "xfer-9", &g, 1};
    side_channel_pull pull = make_pull(&req, 1);
    collected c = {0};
    atomic_int cancel = SIDE_CHANNEL_CANCEL_ASK;
    int acked = -1;
    assert_int_equal(side_channel_pull_run_ex(ep, &pull, NULL, 10.0, &cancel, 5.0, &acked, collect,
                                              &c, err, sizeof err),
                     SIDE_CHANNEL_ECANCELED);
    assert_int_equal(acked, 0);
    assert_non_null(fgets(line, sizeof line, f));
    assert_non_null(strstr(line, "cancel answered ERROR: "));
    assert_int_equal(pclose(f), 0);
}

/* ---- a cancel with a shared secret ----------------------------------------- */

typedef struct d_run {
    const char *ep;
    side_channel_pull *pull;
    collected c;
    atomic_int cancel;
    int acked, rc;
    char err[512];
} d_run;

static void *d_thread(void *arg) {
    d_run *d = arg;
    d->rc = side_channel_pull_run_ex(d->ep, d->pull, "s3cret", 10.0, &d->cancel, 5.0, &d->acked,
                                     collect, &d->c, d->err, sizeof d->err);
    return NULL;
}

/* Raw DEALER: send frames and do not wait for an answer. */
static void raw_send(const char *ep, const void *const *frames, const size_t *lens, int n) {
    void *ctx = zmq_ctx_new();
    void *d = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 1000;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    assert_int_equal(zmq_connect(d, ep), 0);
    for (int i = 0; i < n; i++)
        assert_true(zmq_send(d, frames[i], lens[i], i + 1 < n ? ZMQ_SNDMORE : 0) >= 0);
    zmq_close(d);
    zmq_ctx_term(ctx);
}

/* With a secret: CONTINUE heartbeats and the FINISH acknowledging a cancel are
 * MAC'd in the pull's sequence and accepted; the decoder's cancel carries a
 * 'C' auth frame and reaches the pull it was made for; a cancel without a
 * frame, or with a forged one, is refused (ERROR naming why, counted) and
 * reaches no handler; a valid cancel made for another pull (another nonce)
 * does not match the pull; a producer without a secret refuses an
 * authenticated cancel. */
static void test_auth_cancel(void **state) {
    (void)state;
    producer p = {.mode = 1};
    char ep[64];
    side_channel_server *s = start_auth(&p, "s3cret", ep, sizeof ep);
    side_channel_server_set_cancel_fn(s, on_cancel);
    memset(&g_cancel, 0, sizeof g_cancel);
    g_cancel.ack = 1;
    int64_t ids[] = {3};
    side_channel_block_group g = {ids, 1};
    side_channel_req_blocks req = {"d-7", "xfer-7", &g, 1};
    side_channel_pull pull = make_pull(&req, 1);
    d_run d = {.ep = ep, .pull = &pull};
    pthread_t t;
    pthread_create(&t, NULL, d_thread, &d);
    for (int i = 0; i < 500 && !__atomic_load_n(&p.held, __ATOMIC_SEQ_CST); i++)
        usleep(10000);
    assert_non_null(__atomic_load_n(&p.held, __ATOMIC_SEQ_CST));
    /* two heartbeats: MAC'd replies 0 and 1, delivered */
    side_channel_reply cont = {.status = SIDE_CHANNEL_CONTINUE};
    assert_int_equal(side_channel_call_reply(p.held, &cont), 0);
    assert_int_equal(side_channel_call_reply(p.held, &cont), 0);
    for (int i = 0; i < 500 && __atomic_load_n(&d.c.n, __ATOMIC_SEQ_CST) < 2; i++)
        usleep(10000);
    assert_int_equal(__atomic_load_n(&d.c.n, __ATOMIC_SEQ_CST), 2);
    /* forged cancels for the held pull, from another DEALER */
    side_channel_cancel cx = {0};
    char *rid[1] = {"d-7"}, *tid[1] = {"xfer-7"};
    cx.req_ids = rid;
    cx.transfer_ids = tid;
    cx.n = 1;
    char *buf;
    size_t len;
    assert_int_equal(side_channel_cancel_encode(&cx, &buf, &len), 0);
    side_channel_reply r;
    const void *f1[1] = {buf};
    size_t l1[1] = {len};
    raw_exchange(ep, f1, l1, 1, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(r.err_msg, "unauthenticated cancel refused"));
    side_channel_reply_free(&r);
    unsigned char nonce[16] = {9}, f[SIDE_CHANNEL_AUTH_LEN];
    make_frame(f, "s3cret", 'C', now_ms(), nonce, buf, len);
    f[50] ^= 1;
    const void *f2[2] = {buf, f};
    size_t l2[2] = {len, sizeof f};
    raw_exchange(ep, f2, l2, 2, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(r.err_msg, "cancel authentication failed: the MAC does not match"));
    side_channel_reply_free(&r);
    make_frame(f, "other secret", 'C', now_ms(), nonce, buf, len);
    raw_exchange(ep, f2, l2, 2, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(r.err_msg, "MAC does not match"));
    side_channel_reply_free(&r);
    assert_int_equal(side_channel_server_auth_rejected(s), 3);
    assert_int_equal(g_cancel.calls, 0); /* none reached the handler */
    /* an authenticated 'C' frame over a payload that is not a cancel */
    char *pbuf;
    size_t plen;
    assert_int_equal(side_channel_pull_encode(&pull, &pbuf, &plen), 0);
    make_frame(f, "s3cret", 'C', now_ms(), nonce, pbuf, plen);
    const void *f3[2] = {pbuf, f};
    size_t l3[2] = {plen, sizeof f};
    raw_exchange(ep, f3, l3, 2, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(r.err_msg, "has no 'disagg_cancel' key"));
    side_channel_reply_free(&r);
    free(pbuf);
    /* a valid cancel, but MAC'd with another pull's nonce: reaches the
     * handler, matches no pull (it is not answered) */
    make_frame(f, "s3cret", 'C', now_ms(), nonce, buf, len);
    raw_send(ep, f2, l2, 2);
    for (int i = 0; i < 500 && __atomic_load_n(&g_cancel.calls, __ATOMIC_SEQ_CST) < 1; i++)
        usleep(10000);
    assert_int_equal(__atomic_load_n(&g_cancel.calls, __ATOMIC_SEQ_CST), 1);
    assert_int_equal(g_cancel.same_peer, 0);
    assert_int_equal(side_channel_server_pending(s), 1); /* the pull still waits */
    assert_int_equal(side_channel_server_auth_rejected(s), 3);
    /* the decoder's own cancel: authenticated, matched, acknowledged */
    uint64_t t0 = clock_now_ns();
    atomic_store(&d.cancel, SIDE_CHANNEL_CANCEL_ASK);
    pthread_join(t, NULL);
    if (d.rc != SIDE_CHANNEL_ECANCELED) fail_msg("rc %d: %s", d.rc, d.err);
    assert_int_equal(d.acked, 1);
    assert_true((double)(clock_now_ns() - t0) / 1e9 < 2.0);
    assert_non_null(strstr(d.err, "the producer acknowledged"));
    assert_int_equal(g_cancel.calls, 2);
    assert_int_equal(g_cancel.same_peer, 1);
    assert_string_equal(g_cancel.req, "d-7");
    assert_string_equal(g_cancel.xfer, "xfer-7");
    assert_int_equal(d.c.n, 2); /* the acknowledgement is not a reply to deliver */
    assert_int_equal(side_channel_server_pending(s), 0);
    assert_int_equal(side_channel_server_auth_rejected(s), 3);
    side_channel_server_stop(s);
    /* a producer without a secret refuses an authenticated cancel, naming why */
    producer q = {0};
    s = start_auth(&q, NULL, ep, sizeof ep);
    side_channel_server_set_cancel_fn(s, on_cancel);
    make_frame(f, "s3cret", 'C', now_ms(), nonce, buf, len);
    raw_exchange(ep, f2, l2, 2, &r);
    assert_int_equal(r.status, SIDE_CHANNEL_ERROR);
    assert_non_null(strstr(r.err_msg, "the cancel carries an authentication frame but this "
                                      "producer has no auth_secret"));
    side_channel_reply_free(&r);
    assert_int_equal(side_channel_server_auth_rejected(s), 1);
    assert_int_equal(g_cancel.calls, 2);
    side_channel_server_stop(s);
    free(buf);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pull_continue_finish),
        cmocka_unit_test(test_pull_connections_are_reused),
        cmocka_unit_test(test_bad_pulls_get_error_replies),
        cmocka_unit_test(test_timeout_cancel_and_reply_after_stop),
        cmocka_unit_test(test_python_dealer_against_our_router),
        cmocka_unit_test(test_our_dealer_against_python_router),
        cmocka_unit_test(test_auth_pulls),
        cmocka_unit_test(test_auth_forged_replies_refused),
        cmocka_unit_test(test_cancel_acknowledged_by_the_producer),
        cmocka_unit_test(test_cancel_not_acknowledged),
        cmocka_unit_test(test_cancel_against_a_vllm_router_falls_back),
        cmocka_unit_test(test_auth_cancel),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
