/* Unit tests: the transfer engine in one process — a target engine and an
 * initiator engine talking over real loopback sockets (tcp) and
 * process_vm_writev (shm, same process counts as same host). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/clock.h"
#include "base/log.h"
#include "disagg/transfer.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define TBUF (8u << 20)

typedef struct fixture {
    transfer_engine *target, *init;
    uint8_t *tmem, *imem; /* registered buffers (TBUF each) */
    transfer_segment seg;
} fixture;

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static int setup_proto(void **state, transfer_protocol proto) {
    fixture *f = calloc(1, sizeof *f);
    transfer_config c;
    transfer_config_init(&c);
    c.local_hostname = "127.0.0.1";
    c.timeout_base_ns = 3 * NS_PER_S;
    c.connect_timeout_ns = NS_PER_S;
    if (transfer_engine_create(&c, &f->target)) return -1;
    c.protocol = proto;
    if (transfer_engine_create(&c, &f->init)) return -1;
    f->tmem = aligned_alloc(4096, TBUF);
    f->imem = aligned_alloc(4096, TBUF);
    for (size_t i = 0; i < TBUF; i++)
        f->tmem[i] = (uint8_t)(i * 31 + 7);
    if (transfer_register(f->target, f->tmem, TBUF, "cpu:0")) return -1;
    if (transfer_register(f->init, f->imem, TBUF, "cpu")) return -1;
    if (transfer_open_segment(f->init, transfer_engine_segment_name(f->target), &f->seg)) return -1;
    *state = f;
    return 0;
}
static int setup_tcp(void **state) {
    return setup_proto(state, TRANSFER_PROTO_TCP);
}
static int setup_shm(void **state) {
    return setup_proto(state, TRANSFER_PROTO_AUTO);
}

static int teardown(void **state) {
    fixture *f = *state;
    transfer_engine_destroy(f->init);
    transfer_engine_destroy(f->target);
    free(f->tmem);
    free(f->imem);
    free(f);
    return 0;
}

static int run_batch(fixture *f, const transfer_request *r, size_t n) {
    transfer_batch b;
    assert_int_equal(transfer_batch_alloc(f->init, n, &b), 0);
    assert_int_equal(transfer_batch_submit(f->init, b, r, n), 0);
    int rc = transfer_batch_wait(f->init, b, 20 * NS_PER_S);
    assert_int_equal(transfer_batch_free(f->init, b), 0);
    return rc;
}

/* The transport each setup asks for is the one used and the one that carries the bytes:
 * tcp goes through the target's data port (its bytes_served grows), shm (auto, same host:
 * here the same process) never touches it. */
static void check_protocol(fixture *f, transfer_protocol want) {
    transfer_segment_info info;
    assert_int_equal(transfer_segment_get_info(f->init, f->seg, &info), 0);
    if (info.protocol != want)
        fail_msg("segment opened via %s, expected %s",
                 info.protocol == TRANSFER_PROTO_SHM ? "shm" : "tcp",
                 want == TRANSFER_PROTO_SHM ? "shm" : "tcp");
    transfer_stats t0, t1, i1;
    transfer_engine_get_stats(f->target, &t0);
    transfer_request r = {TRANSFER_READ, f->imem, f->seg, (uint64_t)(uintptr_t)f->tmem + 3, 100000};
    assert_int_equal(run_batch(f, &r, 1), 0);
    assert_memory_equal(f->imem, f->tmem + 3, 100000);
    transfer_engine_get_stats(f->target, &t1);
    transfer_engine_get_stats(f->init, &i1);
    assert_int_equal(i1.shm_fallbacks, 0);
    assert_int_equal(i1.bytes_read, 100000);
    assert_int_equal(t1.bytes_served - t0.bytes_served, want == TRANSFER_PROTO_TCP ? 100000 : 0);
    assert_int_equal(transfer_segment_get_info(f->init, f->seg, &info), 0);
    assert_int_equal(info.protocol, want); /* still: no silent fallback */
}

static void test_protocol_chosen(void **state) {
    fixture *f = *state;
    transfer_segment_info info;
    assert_int_equal(transfer_segment_get_info(f->init, f->seg, &info), 0);
    assert_int_equal(info.protocol, TRANSFER_PROTO_TCP);
    assert_int_equal(info.num_buffers, 1);
    transfer_buffer_info bi;
    assert_int_equal(transfer_segment_get_buffers(f->init, f->seg, &bi, 1), 1);
    assert_int_equal(bi.addr, (uint64_t)(uintptr_t)f->tmem);
    assert_int_equal(bi.length, TBUF);
    /* opening the same name again gives the same handle */
    transfer_segment again;
    assert_int_equal(
        transfer_open_segment(f->init, transfer_engine_segment_name(f->target), &again), 0);
    assert_true(again == f->seg);
    check_protocol(f, TRANSFER_PROTO_TCP);
}

static void test_protocol_chosen_auto_same_host(void **state) {
    check_protocol(*state, TRANSFER_PROTO_SHM);
}

/* Random READs and WRITEs, verified byte for byte. */
static void test_random_roundtrips(void **state) {
    fixture *f = *state;
    uint64_t tbase = (uint64_t)(uintptr_t)f->tmem;
    for (int round = 0; round < 20; round++) {
        transfer_request r[16];
        size_t n = 1 + rnd() % 16;
        size_t off = 0;
        /* disjoint local slices, random remote ranges */
        for (size_t i = 0; i < n; i++) {
            size_t len = 1 + rnd() % (rnd() % 4 == 0 ? (3u << 20) : 8192);
            if (off + len > TBUF / 2) len = 1;
            size_t roff = rnd() % (TBUF - len);
            r[i] = (transfer_request){TRANSFER_READ, f->imem + off, f->seg, tbase + roff, len};
            off += len;
        }
        assert_int_equal(run_batch(f, r, n), 0);
        for (size_t i = 0; i < n; i++)
            assert_memory_equal(r[i].local, (void *)(uintptr_t)r[i].remote_addr, r[i].length);
        /* now write fresh random bytes to non-overlapping remote ranges */
        off = 0;
        size_t roff = rnd() % 4096;
        for (size_t i = 0; i < n; i++) {
            size_t len = r[i].length;
            for (size_t k = 0; k < len; k++)
                f->imem[off + k] = (uint8_t)rnd();
            if (roff + len > TBUF) break;
            r[i] = (transfer_request){TRANSFER_WRITE, f->imem + off, f->seg, tbase + roff, len};
            off += len;
            roff += len + rnd() % 100;
        }
        assert_int_equal(run_batch(f, r, n), 0);
        for (size_t i = 0; i < n; i++)
            assert_memory_equal(r[i].local, (void *)(uintptr_t)r[i].remote_addr, r[i].length);
    }
}

static void test_large_striped(void **state) {
    fixture *f = *state;
    size_t len = 6u << 20;
    for (size_t i = 0; i < len; i++)
        f->imem[i] = (uint8_t)(i * 13 + 1);
    void *src[1] = {f->imem};
    uint64_t dst[1] = {(uint64_t)(uintptr_t)f->tmem + 12345};
    size_t lens[1] = {len};
    assert_int_equal(
        transfer_sync_write(f->init, transfer_engine_segment_name(f->target), src, dst, lens, 1),
        0);
    assert_memory_equal(f->imem, f->tmem + 12345, len);
    memset(f->imem, 0, len);
    assert_int_equal(
        transfer_sync_read(f->init, transfer_engine_segment_name(f->target), src, dst, lens, 1), 0);
    assert_memory_equal(f->imem, f->tmem + 12345, len);
}

/* Outside the target's buffers: rejected, nothing outside touched, target keeps serving. */
static void test_remote_rejected(void **state) {
    fixture *f = *state;
    uint64_t tbase = (uint64_t)(uintptr_t)f->tmem;
    uint8_t *guard = malloc(4096); /* not registered on the target */
    memset(guard, 0xAB, 4096);
    memset(f->imem, 0x11, 8192);
    transfer_request r[4] = {
        {TRANSFER_WRITE, f->imem, f->seg, tbase + TBUF - 10, 20},           /* runs past the end */
        {TRANSFER_WRITE, f->imem, f->seg, (uint64_t)(uintptr_t)guard, 100}, /* another allocation */
        {TRANSFER_READ, f->imem, f->seg, tbase - 1, 2},                     /* starts before */
        {TRANSFER_WRITE, f->imem, f->seg, tbase + 100, 50},                 /* fine */
    };
    transfer_batch b;
    assert_int_equal(transfer_batch_alloc(f->init, 4, &b), 0);
    assert_int_equal(transfer_batch_submit(f->init, b, r, 4), 0);
    assert_int_equal(transfer_batch_wait(f->init, b, 10 * NS_PER_S), TRANSFER_EREMOTEADDR);
    transfer_status st;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(transfer_batch_get_status(f->init, b, (size_t)i, &st), 0);
        assert_int_equal(st.state, TRANSFER_STATE_FAILED);
        assert_int_equal(st.error, TRANSFER_EREMOTEADDR);
    }
    assert_int_equal(transfer_batch_get_status(f->init, b, 3, &st), 0);
    assert_int_equal(st.state, TRANSFER_STATE_COMPLETED);
    assert_int_equal(st.transferred_bytes, 50);
    assert_int_equal(transfer_batch_get_overall(f->init, b, &st), 0);
    assert_int_equal(st.state, TRANSFER_STATE_FAILED);
    assert_int_equal(transfer_batch_free(f->init, b), 0);
    for (int i = 0; i < 4096; i++)
        assert_int_equal(guard[i], 0xAB);
    assert_int_equal(f->tmem[TBUF - 10], (uint8_t)((TBUF - 10) * 31 + 7));
    free(guard);
    /* still serving */
    transfer_request ok = {TRANSFER_READ, f->imem, f->seg, tbase, 4096};
    assert_int_equal(run_batch(f, &ok, 1), 0);
    assert_memory_equal(f->imem, f->tmem, 4096);
}

/* Requests that follow one the engine routed (same segment, same local registration, same
 * remote buffer) reuse its route; one that leaves either range is checked in full: past the
 * remote buffer's end or after it fails alone, a local range past its registration fails
 * the submit. */
static void test_route_reuse_boundaries(void **state) {
    fixture *f = *state;
    uint64_t tbase = (uint64_t)(uintptr_t)f->tmem;
    memset(f->imem, 0x5A, 4096);
    transfer_request r[5] = {
        {TRANSFER_WRITE, f->imem, f->seg, tbase + 100, 50},             /* fine */
        {TRANSFER_WRITE, f->imem, f->seg, tbase + TBUF - 10, 20},       /* runs past the end */
        {TRANSFER_WRITE, f->imem + 8, f->seg, tbase + 200, 60},         /* fine */
        {TRANSFER_WRITE, f->imem + 16, f->seg, tbase + TBUF + 4096, 5}, /* after the end */
        {TRANSFER_WRITE, f->imem + 24, f->seg, tbase + 300, 70},        /* fine */
    };
    transfer_batch b;
    assert_int_equal(transfer_batch_alloc(f->init, 5, &b), 0);
    assert_int_equal(transfer_batch_submit(f->init, b, r, 5), 0);
    assert_int_equal(transfer_batch_wait(f->init, b, 10 * NS_PER_S), TRANSFER_EREMOTEADDR);
    for (int i = 0; i < 5; i++) {
        transfer_status st;
        assert_int_equal(transfer_batch_get_status(f->init, b, (size_t)i, &st), 0);
        if (i == 1 || i == 3) {
            assert_int_equal(st.state, TRANSFER_STATE_FAILED);
            assert_int_equal(st.error, TRANSFER_EREMOTEADDR);
        } else {
            assert_int_equal(st.state, TRANSFER_STATE_COMPLETED);
            assert_int_equal(st.transferred_bytes, r[i].length);
            assert_memory_equal(f->tmem + (r[i].remote_addr - tbase), r[i].local, r[i].length);
        }
    }
    assert_int_equal(transfer_batch_free(f->init, b), 0);
    transfer_request l[2] = {
        {TRANSFER_WRITE, f->imem, f->seg, tbase, 64},
        {TRANSFER_WRITE, f->imem + TBUF - 8, f->seg, tbase + 64, 16}, /* past the local buffer */
    };
    assert_int_equal(transfer_batch_alloc(f->init, 2, &b), 0);
    assert_int_equal(transfer_batch_submit(f->init, b, l, 2), TRANSFER_ENOTREG);
    assert_int_equal(transfer_batch_free(f->init, b), 0);
}

static void test_batch_handles(void **state) {
    fixture *f = *state;
    transfer_batch b, b2;
    transfer_status st;
    assert_int_equal(transfer_batch_alloc(f->init, 0, &b), TRANSFER_EINVAL);
    assert_int_equal(transfer_batch_alloc(f->init, 2, &b), 0);
    assert_int_equal(transfer_batch_get_overall(f->init, b, &st), 0);
    assert_int_equal(st.state, TRANSFER_STATE_WAITING);
    assert_int_equal(transfer_batch_get_status(f->init, b, 0, &st), TRANSFER_EINVAL);
    transfer_request r[3] = {
        {TRANSFER_READ, f->imem, f->seg, (uint64_t)(uintptr_t)f->tmem, 10},
        {TRANSFER_READ, f->imem + 10, f->seg, (uint64_t)(uintptr_t)f->tmem, 10},
        {TRANSFER_READ, f->imem + 20, f->seg, (uint64_t)(uintptr_t)f->tmem, 10}};
    assert_int_equal(transfer_batch_submit(f->init, b, r, 3), TRANSFER_ENOSPACE);
    /* invalid requests fail the whole call, nothing queued */
    transfer_request bad = {TRANSFER_READ, (uint8_t *)&st, f->seg, (uint64_t)(uintptr_t)f->tmem, 4};
    assert_int_equal(transfer_batch_submit(f->init, b, &bad, 1), TRANSFER_ENOTREG);
    bad = r[0];
    bad.length = 0;
    assert_int_equal(transfer_batch_submit(f->init, b, &bad, 1), TRANSFER_EINVAL);
    bad = r[0];
    bad.opcode = (transfer_opcode)7;
    assert_int_equal(transfer_batch_submit(f->init, b, &bad, 1), TRANSFER_EINVAL);
    bad = r[0];
    bad.target = f->seg + 77;
    assert_int_equal(transfer_batch_submit(f->init, b, &bad, 1), TRANSFER_ESTALE);
    assert_int_equal(transfer_batch_submit(f->init, b, r, 2), 0);
    assert_int_equal(transfer_batch_wait(f->init, b, 10 * NS_PER_S), 0);
    assert_int_equal(transfer_batch_free(f->init, b), 0);
    /* the handle is now stale everywhere */
    assert_int_equal(transfer_batch_free(f->init, b), TRANSFER_ESTALE);
    assert_int_equal(transfer_batch_wait(f->init, b, 0), TRANSFER_ESTALE);
    assert_int_equal(transfer_batch_submit(f->init, b, r, 1), TRANSFER_ESTALE);
    assert_int_equal(transfer_batch_get_overall(f->init, b, &st), TRANSFER_ESTALE);
    assert_int_equal(transfer_batch_cancel(f->init, b), TRANSFER_ESTALE);
    /* the slot is reused with a new generation: the old handle stays stale */
    assert_int_equal(transfer_batch_alloc(f->init, 1, &b2), 0);
    assert_true(b2 != b);
    assert_int_equal(transfer_batch_get_overall(f->init, b, &st), TRANSFER_ESTALE);
    assert_int_equal(transfer_batch_free(f->init, b2), 0);
    assert_int_equal(transfer_batch_free(f->init, 0), TRANSFER_ESTALE);
    assert_int_equal(transfer_batch_free(f->init, 0xdeadbeef12345678ull), TRANSFER_ESTALE);
}

/* Cancel must stop what is not on the wire yet.  The target runs in a child process that
 * the test stops (SIGSTOP): a stopped peer reads nothing, so at most a socket's worth of the
 * batch can be on the wire when the cancel comes, whatever the machine's speed; the rest
 * must end CANCELED, having moved no byte.  (A no-op cancel completes them all.) */
static pid_t g_target_pid; /* test_cancel's child, killed by its teardown even on failure */

static int kill_target(void **state) {
    (void)state;
    if (g_target_pid > 0) {
        kill(g_target_pid, SIGKILL);
        waitpid(g_target_pid, NULL, 0);
    }
    g_target_pid = 0;
    return 0;
}

static void test_cancel(void **state) {
    (void)state;
    enum { N = 64 };
    const size_t len = 4u << 20; /* 256 MiB in all: far more than the sockets buffer */
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) { /* the target: serve until killed */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(pfd[0]);
        transfer_config c;
        transfer_config_init(&c);
        c.local_hostname = "127.0.0.1";
        transfer_engine *t;
        uint8_t *mem = aligned_alloc(4096, TBUF);
        if (!mem || transfer_engine_create(&c, &t) || transfer_register(t, mem, TBUF, "cpu"))
            _exit(1);
        char msg[128] = {0};
        uint64_t addr = (uint64_t)(uintptr_t)mem;
        memcpy(msg, &addr, 8);
        snprintf(msg + 8, sizeof msg - 8, "%s", transfer_engine_segment_name(t));
        if (write(pfd[1], msg, sizeof msg) != (ssize_t)sizeof msg) _exit(1);
        for (;;)
            pause();
    }
    g_target_pid = pid;
    close(pfd[1]);
    char msg[128];
    assert_int_equal(read(pfd[0], msg, sizeof msg), (ssize_t)sizeof msg);
    close(pfd[0]);
    uint64_t taddr;
    memcpy(&taddr, msg, 8);
    transfer_config c;
    transfer_config_init(&c);
    c.local_hostname = "127.0.0.1";
    c.protocol = TRANSFER_PROTO_TCP; /* shm would write into the stopped process regardless */
    c.timeout_base_ns = 20 * NS_PER_S;
    transfer_engine *e;
    assert_int_equal(transfer_engine_create(&c, &e), 0);
    uint8_t *mem = aligned_alloc(4096, TBUF);
    memset(mem, 0x5A, TBUF);
    assert_int_equal(transfer_register(e, mem, TBUF, "cpu"), 0);
    transfer_segment seg;
    assert_int_equal(transfer_open_segment(e, msg + 8, &seg), 0);
    /* connections up before the target stops */
    transfer_request warm = {TRANSFER_WRITE, mem, seg, taddr, 4096};
    transfer_batch b;
    assert_int_equal(transfer_batch_alloc(e, 1, &b), 0);
    assert_int_equal(transfer_batch_submit(e, b, &warm, 1), 0);
    assert_int_equal(transfer_batch_wait(e, b, 10 * NS_PER_S), 0);
    assert_int_equal(transfer_batch_free(e, b), 0);

    int wst;
    assert_int_equal(kill(pid, SIGSTOP), 0);
    assert_int_equal(waitpid(pid, &wst, WUNTRACED), pid);
    assert_true(WIFSTOPPED(wst));
    transfer_request r[N];
    for (int i = 0; i < N; i++)
        r[i] = (transfer_request){TRANSFER_WRITE, mem + (size_t)(i % 2) * len, seg,
                                  taddr + (size_t)(i % 2) * len, len};
    assert_int_equal(transfer_batch_alloc(e, N, &b), 0);
    assert_int_equal(transfer_batch_submit(e, b, r, N), 0);
    usleep(200 * 1000); /* let the lanes fill the sockets: some requests are on the wire */
    assert_int_equal(transfer_batch_cancel(e, b), 0);
    assert_int_equal(kill(pid, SIGCONT), 0);
    assert_int_equal(transfer_batch_wait(e, b, 15 * NS_PER_S), TRANSFER_ECANCELED);
    int done = 0, canceled = 0;
    for (int i = 0; i < N; i++) {
        transfer_status st;
        assert_int_equal(transfer_batch_get_status(e, b, (size_t)i, &st), 0);
        if (st.state == TRANSFER_STATE_COMPLETED) {
            assert_int_equal(st.transferred_bytes, len);
            done++;
        } else if (st.state == TRANSFER_STATE_CANCELED) {
            assert_int_equal(st.error, TRANSFER_ECANCELED);
            canceled++;
        } else {
            fail_msg("request %d ended in state %d (error %d)", i, st.state, st.error);
        }
    }
    assert_int_equal(done + canceled, N);
    if (canceled < N / 2)
        fail_msg("cancel stopped only %d of %d requests (the target was stopped: at most a "
                 "socket's worth can have been on the wire)",
                 canceled, N);
    transfer_status all;
    assert_int_equal(transfer_batch_get_overall(e, b, &all), 0);
    assert_int_equal(all.state, TRANSFER_STATE_CANCELED);
    assert_true(all.transferred_bytes < (size_t)N * len / 2);
    assert_int_equal(transfer_batch_free(e, b), 0);
    /* the engine and its connections still work */
    assert_int_equal(transfer_batch_alloc(e, 1, &b), 0);
    assert_int_equal(transfer_batch_submit(e, b, &warm, 1), 0);
    assert_int_equal(transfer_batch_wait(e, b, 10 * NS_PER_S), 0);
    assert_int_equal(transfer_batch_free(e, b), 0);
    transfer_engine_destroy(e);
    free(mem);
}

static void test_register_errors(void **state) {
    fixture *f = *state;
    char buf[100];
    assert_int_equal(transfer_register(f->init, buf, 0, "cpu"), TRANSFER_EINVAL);
    assert_int_equal(transfer_register(f->init, NULL, 10, "cpu"), TRANSFER_EINVAL);
    assert_int_equal(transfer_register(f->init, f->imem + 5, 10, "cpu"), TRANSFER_EOVERLAP);
    assert_int_equal(transfer_register(f->init, buf, sizeof buf, "cuda:0"), TRANSFER_EINVAL);
    assert_int_equal(transfer_register(f->init, buf, sizeof buf, "gpu"), TRANSFER_EINVAL);
    assert_int_equal(transfer_register(f->init, buf, sizeof buf, "cpu:1"), 0);
    assert_int_equal(transfer_unregister(f->init, buf + 1), TRANSFER_ENOTREG);
    assert_int_equal(transfer_unregister(f->init, buf), 0);
    assert_int_equal(transfer_unregister(f->init, buf), TRANSFER_ENOTREG);
}

static void test_open_errors(void **state) {
    (void)state;
    transfer_engine *e;
    transfer_config c;
    transfer_config_init(&c);
    c.local_hostname = "127.0.0.1";
    c.connect_timeout_ns = NS_PER_S;
    assert_int_equal(transfer_engine_create(&c, &e), 0);
    transfer_segment s;
    assert_int_equal(transfer_open_segment(e, "nonsense", &s), TRANSFER_EINVAL);
    assert_int_equal(transfer_open_segment(e, "127.0.0.1:0", &s), TRANSFER_EINVAL);
    uint64_t t0 = clock_now_ns();
    /* port 1 on loopback: nothing listens, refused at once */
    assert_int_equal(transfer_open_segment(e, "127.0.0.1:1", &s), TRANSFER_ENOSEG);
    assert_true(clock_now_ns() - t0 < 2 * NS_PER_S);
    c.device_name = "no-such-nic0";
    transfer_engine *e2 = NULL;
    assert_int_equal(transfer_engine_create(&c, &e2), TRANSFER_EINVAL);
    transfer_engine_destroy(e);
}

/* The target goes away with requests in flight: they fail, within the deadline. */
static void test_target_dies(void **state) {
    fixture *f = *state;
    enum { N = 64 };
    transfer_request r[N];
    for (int i = 0; i < N; i++)
        r[i] = (transfer_request){TRANSFER_WRITE, f->imem, f->seg, (uint64_t)(uintptr_t)f->tmem,
                                  TBUF / 2};
    transfer_batch b;
    assert_int_equal(transfer_batch_alloc(f->init, N, &b), 0);
    assert_int_equal(transfer_batch_submit(f->init, b, r, N), 0);
    transfer_engine_destroy(f->target);
    f->target = NULL;
    uint64_t t0 = clock_now_ns();
    int rc = transfer_batch_wait(f->init, b, 30 * NS_PER_S);
    assert_true(rc == TRANSFER_ECONN || rc == TRANSFER_ETIMEDOUT);
    assert_true(clock_now_ns() - t0 < 10 * NS_PER_S);
    assert_int_equal(transfer_batch_free(f->init, b), 0);
    transfer_stats st;
    transfer_engine_get_stats(f->init, &st);
    assert_true(st.requests_failed > 0);
}

/* ---- shared secret (docs/transfer.md, Security) ---------------------------- */

static transfer_engine *secret_engine(const char *secret) {
    transfer_config c;
    transfer_config_init(&c);
    c.local_hostname = "127.0.0.1";
    c.protocol = TRANSFER_PROTO_TCP;
    c.connect_timeout_ns = NS_PER_S;
    c.timeout_base_ns = 3 * NS_PER_S;
    c.auth_secret = secret;
    transfer_engine *e = NULL;
    assert_int_equal(transfer_engine_create(&c, &e), 0);
    return e;
}

/* Same secret: data moves (several lanes, striped); missing or different:
 * the open fails with TRANSFER_EAUTH and the target counts the refusal. */
static void test_auth_secret(void **state) {
    (void)state;
    char key[] = "s3cret";
    transfer_engine *t = secret_engine(key);
    key[0] = 'X'; /* the engine keeps its own copy */
    enum { LEN = 3u << 20 };
    uint8_t *tm = malloc(LEN), *im = malloc(LEN);
    for (size_t i = 0; i < LEN; i++)
        tm[i] = (uint8_t)(i * 13 + 1);
    assert_int_equal(transfer_register(t, tm, LEN, "cpu:0"), 0);
    const char *name = transfer_engine_segment_name(t);

    transfer_engine *ok = secret_engine("s3cret");
    assert_int_equal(transfer_register(ok, im, LEN, "cpu:0"), 0);
    void *dst[1] = {im + 1};
    uint64_t src[1] = {(uint64_t)(uintptr_t)(tm + 3)};
    size_t len[1] = {LEN - 5};
    assert_int_equal(transfer_sync_read(ok, name, dst, src, len, 1), 0);
    assert_memory_equal(im + 1, tm + 3, LEN - 5);
    transfer_engine_destroy(ok);

    const char *bad[] = {NULL, "", "other"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        transfer_engine *e = secret_engine(bad[i]);
        transfer_segment seg;
        assert_int_equal(transfer_open_segment(e, name, &seg), TRANSFER_EAUTH);
        transfer_engine_destroy(e);
    }
    /* The wrong-secret client refuses the server first; the server counts
     * when it reads that refusal, just after the open returned. */
    transfer_stats st;
    uint64_t until = clock_now_ns() + 5 * NS_PER_S;
    do {
        transfer_engine_get_stats(t, &st);
        if (st.auth_refused < 3) usleep(10000);
    } while (st.auth_refused < 3 && clock_now_ns() < until);
    assert_true(st.auth_refused >= 3);

    /* a secret initiator refuses a target without one */
    transfer_engine *plain = secret_engine(NULL);
    transfer_engine *e = secret_engine("s3cret");
    transfer_segment seg;
    assert_int_equal(transfer_open_segment(e, transfer_engine_segment_name(plain), &seg),
                     TRANSFER_EAUTH);
    transfer_engine_destroy(e);
    transfer_engine_destroy(plain);
    transfer_engine_destroy(t);
    free(tm);
    free(im);
}

int main(void) {
    log_set_level(LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_protocol_chosen, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_protocol_chosen_auto_same_host, setup_shm, teardown),
        cmocka_unit_test_setup_teardown(test_random_roundtrips, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_random_roundtrips, setup_shm, teardown),
        cmocka_unit_test_setup_teardown(test_large_striped, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_large_striped, setup_shm, teardown),
        cmocka_unit_test_setup_teardown(test_remote_rejected, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_remote_rejected, setup_shm, teardown),
        cmocka_unit_test_setup_teardown(test_route_reuse_boundaries, setup_tcp, teardown),
        cmocka_unit_test_setup_teardown(test_route_reuse_boundaries, setup_shm, teardown),
        cmocka_unit_test_setup_teardown(test_batch_handles, setup_tcp, teardown),
        cmocka_unit_test_teardown(test_cancel, kill_target),
        cmocka_unit_test_setup_teardown(test_register_errors, setup_tcp, teardown),
        cmocka_unit_test(test_open_errors),
        cmocka_unit_test_setup_teardown(test_target_dies, setup_tcp, teardown),
        cmocka_unit_test(test_auth_secret),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
