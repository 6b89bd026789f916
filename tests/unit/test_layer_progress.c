/* test_layer_progress — kernels/backend.h "layer progress" on the CPU backend: a layer of a
 * step is written once the model marked it (the CPU runs each operation before returning)
 * or the step ended; a waiter on another thread wakes at the mark; waits time out; bad
 * arguments are refused; one progress per backend; a stream of a backend without one marks
 * nothing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/clock.h"
#include "kernels/backend.h"

#include <errno.h>
#include <pthread.h>
#include <time.h>

typedef struct waiter {
    backend_layer_progress *lp;
    uint64_t step;
    int layer, rc;
    uint64_t woke_ns;
} waiter;

static void *wait_main(void *arg) {
    waiter *w = arg;
    w->rc = backend_layer_wait(w->lp, w->step, w->layer, 5 * NS_PER_S);
    w->woke_ns = clock_now_ns();
    return NULL;
}

static void test_marks_and_steps(void **state) {
    (void)state;
    backend *be;
    char err[256];
    assert_int_equal(backend_open("cpu", NULL, &be, err, sizeof err), 0);
    backend_stream *st = backend_stream_create(be);
    assert_non_null(st);
    assert_int_equal(backend_layer_mark(st, 0), 0); /* no progress attached: nothing */
    backend_layer_progress *lp = backend_layer_progress_new(be, 4);
    assert_non_null(lp);
    assert_null(backend_layer_progress_new(be, 4)); /* one per backend */

    backend_layer_progress_begin(lp, 1);
    assert_int_equal(backend_layer_wait(lp, 1, 0, 0), -ETIMEDOUT);
    assert_int_equal(backend_layer_mark(st, 0), 0);
    assert_int_equal(backend_layer_wait(lp, 1, 0, 0), 0);
    assert_int_equal(backend_layer_wait(lp, 1, 1, 1000000), -ETIMEDOUT); /* not marked yet */

    /* a waiter on another thread wakes at the mark, not at its deadline */
    waiter w = {lp, 1, 2, -1, 0};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, wait_main, &w), 0);
    struct timespec ts = {0, 50 * 1000000};
    nanosleep(&ts, NULL);
    uint64_t t0 = clock_now_ns();
    assert_int_equal(backend_layer_mark(st, 1), 0);
    assert_int_equal(backend_layer_mark(st, 2), 0);
    pthread_join(th, NULL);
    assert_int_equal(w.rc, 0);
    assert_true(w.woke_ns - t0 < NS_PER_S);

    /* the step's end completes every layer of it (a graph step marks nothing) */
    assert_int_equal(backend_layer_wait(lp, 1, 3, 0), -ETIMEDOUT);
    backend_layer_progress_end(lp, 1);
    assert_int_equal(backend_layer_wait(lp, 1, 3, 0), 0);
    assert_int_equal(backend_layer_progress_done(lp), 1);
    /* the next step's layers are not written by the last step's marks */
    backend_layer_progress_begin(lp, 2);
    assert_int_equal(backend_layer_wait(lp, 2, 0, 0), -ETIMEDOUT);
    assert_int_equal(backend_layer_mark(st, 0), 0);
    assert_int_equal(backend_layer_wait(lp, 2, 0, 0), 0);
    assert_int_equal(backend_layer_wait(lp, 1, 0, 0), 0); /* an earlier step: written */

    /* refusals */
    assert_int_equal(backend_layer_mark(st, 4), -EINVAL);
    assert_int_equal(backend_layer_mark(st, -1), -EINVAL);
    assert_int_equal(backend_layer_wait(lp, 2, 4, 0), -EINVAL);
    assert_int_equal(backend_layer_wait(NULL, 2, 0, 0), -EINVAL);
    assert_null(backend_layer_progress_new(NULL, 4));

    backend_layer_progress_free(lp);
    assert_int_equal(backend_layer_mark(st, 0), 0); /* detached */
    lp = backend_layer_progress_new(be, 2);         /* a new one may be attached */
    assert_non_null(lp);
    backend_layer_progress_free(lp);
    backend_stream_free(st);
    backend_close(be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_marks_and_steps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
