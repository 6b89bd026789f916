/* Unit tests: the ZeroMQ side channel (PROTOCOL.md §3).  Our ROUTER server and
 * DEALER client together (replies from other threads, CONTINUE...FINISH,
 * release pulls, undecodable and multi-frame pulls answered ERROR, receive
 * timeout, cancel, replies after stop), and each against a vLLM-shaped peer in
 * Python (pyzmq + msgspec, tests/tools/side_channel_peer.py). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/clock.h"
#include "connector/mooncake/side_channel.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

static side_channel_server *start(producer *p, char *ep, size_t cap) {
    pthread_mutex_init(&p->mu, NULL);
    side_channel_server *s;
    char err[256];
    if (side_channel_server_start("127.0.0.1", 0, on_pull, p, &s, err, sizeof err))
        fail_msg("%s", err);
    snprintf(ep, cap, "tcp://127.0.0.1:%u", (unsigned)side_channel_server_port(s));
    return s;
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
    g_cancel.calls++;
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
    assert_int_equal(side_channel_pull_run_ex(ep, &pull, 10.0, &cancel, 5.0, &acked, collect, &c,
                                              err, sizeof err),
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
    assert_int_equal(side_channel_pull_run_ex(ep, &pull, 10.0, &cancel, 5.0, &acked, collect, &c,
                                              err, sizeof err),
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
    assert_int_equal(side_channel_pull_run_ex(ep, &pull, 10.0, &cancel, 0.3, &acked, collect, &c,
                                              err, sizeof err),
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
    assert_int_equal(side_channel_pull_run_ex(ep, &pull, 10.0, &cancel, 5.0, &acked, collect, &c,
                                              err, sizeof err),
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
    assert_int_equal(side_channel_pull_run_ex(ep, &pull, 10.0, &cancel, 5.0, &acked, collect, &c,
                                              err, sizeof err),
                     SIDE_CHANNEL_ECANCELED);
    assert_int_equal(acked, 0);
    assert_non_null(fgets(line, sizeof line, f));
    assert_non_null(strstr(line, "cancel answered ERROR: "));
    assert_int_equal(pclose(f), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pull_continue_finish),
        cmocka_unit_test(test_bad_pulls_get_error_replies),
        cmocka_unit_test(test_timeout_cancel_and_reply_after_stop),
        cmocka_unit_test(test_python_dealer_against_our_router),
        cmocka_unit_test(test_our_dealer_against_python_router),
        cmocka_unit_test(test_cancel_acknowledged_by_the_producer),
        cmocka_unit_test(test_cancel_not_acknowledged),
        cmocka_unit_test(test_cancel_against_a_vllm_router_falls_back),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
