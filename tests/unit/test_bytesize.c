/* Unit tests: base/bytesize — a table of accepted inputs with their exact
 * byte counts, a table of refused inputs with the reason each must give, and
 * the range check's one message format. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/bytesize.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static const struct {
    const char *in;
    uint64_t want;
} ACCEPTED[] = {
    {"0", 0},
    {"1", 1},
    {"4096", 4096},
    {"4096B", 4096},
    {"4096b", 4096},
    {"1.0", 1},
    {"64K", 64ull << 10},
    {"64k", 64ull << 10},
    {"64KB", 64ull << 10},
    {"64KiB", 64ull << 10},
    {"64kib", 64ull << 10},
    {"512M", 512ull << 20},
    {"512MB", 512ull << 20},
    {"2G", 2ull << 30},
    {"2GiB", 2ull << 30},
    {"1T", 1ull << 40},
    {"1t", 1ull << 40},
    {"1.5G", 3ull << 29},
    {"1.5K", 1536},
    {"0.3K", 307}, /* 307.2 rounded down */
    {".5M", 512ull << 10},
    {"0.5T", 1ull << 39},
    {"1.123456789012345678999K", 1150}, /* 1150.42..., extra digits ignored */
    {"00012K", 12ull << 10},
    {"18446744073709551615", UINT64_MAX},
    {"16777215T", 16777215ull << 40},
    {"16777215.999999T", (16777215ull << 40) + 1099510528264ull}, /* floor(.999999 * 2^40) */
};

static const struct {
    const char *in;
    const char *why; /* a phrase of the reason */
} REFUSED[] = {
    {"", "empty"},
    {"-1", "negative"},
    {"-1G", "negative"},
    {"+1", "start with a digit"},
    {" 1", "start with a digit"},
    {"K", "start with a digit"},
    {"lots", "start with a digit"},
    {".", "start with a digit"},
    {"1.", "'.' is not followed"},
    {"1.K", "'.' is not followed"},
    {"1 K", "not K, M, G, T"},
    {"1K ", "not K, M, G, T"},
    {"12Q", "not K, M, G, T"},
    {"1P", "not K, M, G, T"},
    {"1KK", "not K, M, G, T"},
    {"1iB", "not K, M, G, T"},
    {"1Ki", "not K, M, G, T"},
    {"1GBB", "not K, M, G, T"},
    {"1.5.5G", "not K, M, G, T"},
    {"0x10", "not K, M, G, T"},
    {"1e9", "exponents"},
    {"1.5", "fraction of a byte"},
    {"0.5B", "fraction of a byte"},
    {"18446744073709551616", "more than 18446744073709551615"},
    {"99999999999999999999999", "more than 18446744073709551615"},
    {"16777216T", "more than 18446744073709551615"},
    {"17179869184G", "more than 18446744073709551615"},
    {"16777215.9999999999999T", NULL}, /* fits: floor stays below 2^64 */
};

static void test_accepted(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof ACCEPTED / sizeof ACCEPTED[0]; i++) {
        uint64_t v = 12345;
        const char *why = NULL;
        int rc = bytesize_parse(ACCEPTED[i].in, &v, &why);
        if (rc != 0 || v != ACCEPTED[i].want)
            fail_msg("'%s': rc %d (%s), got %llu, want %llu", ACCEPTED[i].in, rc, why ? why : "-",
                     (unsigned long long)v, (unsigned long long)ACCEPTED[i].want);
    }
}

static void test_refused(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof REFUSED / sizeof REFUSED[0]; i++) {
        uint64_t v = 12345;
        const char *why = NULL;
        int rc = bytesize_parse(REFUSED[i].in, &v, &why);
        if (!REFUSED[i].why) {
            assert_int_equal(rc, 0);
            continue;
        }
        if (rc != -EINVAL || v != 12345 || !why || !strstr(why, REFUSED[i].why))
            fail_msg("'%s': rc %d, why '%s', want a reason with '%s'", REFUSED[i].in, rc,
                     why ? why : "(null)", REFUSED[i].why);
    }
    uint64_t v;
    assert_int_equal(bytesize_parse(NULL, &v, NULL), -EINVAL);
}

static void test_range_message(void **state) {
    (void)state;
    char err[512];
    uint64_t v = 7;
    assert_int_equal(
        bytesize_parse_range("disagg x: --size", "2G", 1, 1ull << 40, &v, err, sizeof err), 0);
    assert_int_equal(v, 2ull << 30);
    /* 0 refused where min is 1, accepted where min is 0 */
    assert_int_equal(
        bytesize_parse_range("disagg x: --size", "0", 1, 1ull << 40, &v, err, sizeof err), -EINVAL);
    assert_string_equal(err, "disagg x: --size '0' is not accepted: it is less than 1; accepted: "
                             "a size of 1..1T bytes: " BYTESIZE_FORMS);
    assert_int_equal(bytesize_parse_range("disagg x: --size", "0", 0, 10, &v, err, sizeof err), 0);
    assert_int_equal(v, 0);
    assert_int_equal(
        bytesize_parse_range("disagg x: --size", "2K", 8192, 1ull << 30, &v, err, sizeof err),
        -EINVAL);
    assert_non_null(strstr(err, "it is less than 8K; accepted: a size of 8K..1G bytes"));
    assert_int_equal(
        bytesize_parse_range("disagg x: --size", "1.5T", 0, 1ull << 40, &v, err, sizeof err),
        -EINVAL);
    assert_non_null(strstr(err, "'1.5T' is not accepted: it is more than 1T"));
    assert_int_equal(bytesize_parse_range("--size", "lots", 1, UINT64_MAX, &v, err, sizeof err),
                     -EINVAL);
    assert_non_null(strstr(err, "--size 'lots' is not accepted: it does not start with a digit; "
                                "accepted: a size of 1..18446744073709551615 bytes"));
    assert_int_equal(v, 0); /* unchanged by the failures */
    /* a short buffer is truncated, never overrun */
    char small[16];
    assert_int_equal(bytesize_parse_range("--size", "-1", 1, 2, &v, small, sizeof small), -EINVAL);
    assert_int_equal(strlen(small), sizeof small - 1);
}

static void test_format(void **state) {
    (void)state;
    char b[32];
    const struct {
        uint64_t v;
        const char *s;
    } t[] = {{0, "0"},
             {1, "1"},
             {1536, "1536"},
             {1024, "1K"},
             {64ull << 20, "64M"},
             {3ull << 29, "1536M"},
             {1ull << 40, "1T"},
             {UINT64_MAX, "18446744073709551615"}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        bytesize_format(t[i].v, b, sizeof b);
        assert_string_equal(b, t[i].s);
        uint64_t back;
        assert_int_equal(bytesize_parse(b, &back, NULL), 0); /* round trip */
        assert_int_equal(back, t[i].v);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_accepted),
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_range_message),
        cmocka_unit_test(test_format),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
