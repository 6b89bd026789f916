/* test_base — base/rng (fixed sequences), base/uuid (format, uniqueness, a
 * new seed after fork) and base/err (formatting, truncation, NULL buffers). */
#include "base/err.h"
#include "base/rng.h"
#include "base/uuid.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

/* splitmix64 and xoshiro256** reference values (Vigna's C code, seed 0 /
 * state seeded from splitmix64(0)); the sampler's seeded streams and
 * cmd_transfer's check pattern rely on these exact sequences. */
static void test_rng_sequences(void **state) {
    (void)state;
    assert_true(rng_mix64(0) == 0xe220a8397b1dcdafull);
    uint64_t x = 0;
    assert_true(rng_splitmix64(&x) == 0xe220a8397b1dcdafull);
    assert_true(rng_splitmix64(&x) == 0x6e789e6aa1b965f4ull);
    assert_true(rng_splitmix64(&x) == 0x06c45d188009454full);
    assert_true(x == 3 * 0x9e3779b97f4a7c15ull);
    rng_state a, b;
    rng_seed(&a, 42);
    rng_seed(&b, 42);
    for (int i = 0; i < 100; i++)
        assert_true(rng_next(&a) == rng_next(&b));
    rng_seed(&b, 43);
    assert_true(rng_next(&a) != rng_next(&b));
    /* xoshiro256** on state {1, 2, 3, 4}: first outputs */
    rng_state s = {{1, 2, 3, 4}};
    assert_true(rng_next(&s) == 11520ull);
    assert_true(rng_next(&s) == 0ull);
    assert_true(rng_next(&s) == 1509978240ull);
    assert_true(rng_next(&s) == 1215971899390074240ull);
    for (int i = 0; i < 1000; i++) {
        double u = rng_uniform(&a);
        assert_true(u >= 0.0 && u < 1.0);
    }
}

static int is_uuid4(const char *u) {
    if (strlen(u) != UUID_STR_LEN) return 0;
    for (int i = 0; i < UUID_STR_LEN; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (u[i] != '-') return 0;
        } else if (!strchr("0123456789abcdef", u[i])) {
            return 0;
        }
    }
    return u[14] == '4' && strchr("89ab", u[19]) != NULL;
}

static void test_uuid4(void **state) {
    (void)state;
    char a[UUID_STR_LEN + 1], b[UUID_STR_LEN + 1];
    uuid4(a);
    uuid4(b);
    assert_true(is_uuid4(a));
    assert_true(is_uuid4(b));
    assert_string_not_equal(a, b);
    /* a forked child draws its own seed: its next id differs from the parent's */
    int p[2];
    assert_int_equal(pipe(p), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char c[UUID_STR_LEN + 1];
        uuid4(c);
        ssize_t w = write(p[1], c, UUID_STR_LEN);
        _exit(w == UUID_STR_LEN ? 0 : 1);
    }
    char child[UUID_STR_LEN + 1] = "";
    assert_int_equal(read(p[0], child, UUID_STR_LEN), UUID_STR_LEN);
    child[UUID_STR_LEN] = 0;
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    uuid4(a);
    assert_true(is_uuid4(child));
    assert_string_not_equal(a, child);
    close(p[0]);
    close(p[1]);
}

static void test_err(void **state) {
    (void)state;
    char e[16];
    err_set(e, sizeof e, "bad %s: %d", "value", 7);
    assert_string_equal(e, "bad value: 7");
    err_set(e, sizeof e, "%s", "a message longer than sixteen bytes");
    assert_int_equal(strlen(e), sizeof e - 1); /* truncated, NUL-terminated */
    err_set(NULL, 10, "ignored %d", 1);        /* no buffer: nothing written */
    e[0] = 'x';
    err_set(e, 0, "ignored");
    assert_int_equal(e[0], 'x');
    assert_int_equal(err_fail(e, sizeof e, -EINVAL, "no %s", "way"), -EINVAL);
    assert_string_equal(e, "no way");
    assert_int_equal(err_fail(NULL, 0, -ENOENT, "x"), -ENOENT);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rng_sequences),
        cmocka_unit_test(test_uuid4),
        cmocka_unit_test(test_err),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
