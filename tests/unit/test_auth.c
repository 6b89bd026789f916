/* Unit tests: base/auth — HMAC-SHA256 against RFC 4231's test vectors (an
 * independent reference), the split-input form, constant-time compare, nonces,
 * and where the secret comes from. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "base/auth.h"

#include <stdlib.h>
#include <string.h>

static void test_rfc4231_case2(void **state) {
    (void)state;
    uint8_t mac[AUTH_MAC_LEN];
    char hex[2 * AUTH_MAC_LEN + 1];
    const char *msg = "what do ya want for nothing?";
    assert_int_equal(auth_hmac("Jefe", 4, msg, strlen(msg), mac), 0);
    auth_hex(mac, sizeof mac, hex);
    assert_string_equal(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    /* the same message in three parts gives the same MAC */
    const void *parts[3] = {"what do ", "ya want for ", "nothing?"};
    size_t lens[3] = {8, 12, 8};
    uint8_t mac2[AUTH_MAC_LEN];
    assert_int_equal(auth_hmacv("Jefe", 4, parts, lens, 3, mac2), 0);
    assert_true(auth_equal(mac, mac2, sizeof mac));
    mac2[31] ^= 1;
    assert_false(auth_equal(mac, mac2, sizeof mac));
}

static void test_rfc4231_case1(void **state) {
    (void)state;
    uint8_t key[20];
    memset(key, 0x0b, sizeof key);
    uint8_t mac[AUTH_MAC_LEN];
    char hex[2 * AUTH_MAC_LEN + 1];
    assert_int_equal(auth_hmac(key, sizeof key, "Hi There", 8, mac), 0);
    auth_hex(mac, sizeof mac, hex);
    assert_string_equal(hex, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
}

static void test_empty_key_rejected(void **state) {
    (void)state;
    uint8_t mac[AUTH_MAC_LEN];
    assert_int_equal(auth_hmac("", 0, "x", 1, mac), -22);
}

static void test_random_differs(void **state) {
    (void)state;
    uint8_t a[AUTH_NONCE_LEN], b[AUTH_NONCE_LEN];
    assert_int_equal(auth_random(a, sizeof a), 0);
    assert_int_equal(auth_random(b, sizeof b), 0);
    assert_false(auth_equal(a, b, sizeof a));
}

static void test_secret_resolve(void **state) {
    (void)state;
    unsetenv(AUTH_SECRET_ENV);
    assert_null(auth_secret_resolve(NULL));
    assert_null(auth_secret_resolve(""));
    setenv(AUTH_SECRET_ENV, "from-env", 1);
    assert_string_equal(auth_secret_resolve(NULL), "from-env");
    assert_string_equal(auth_secret_resolve("from-config"), "from-config");
    setenv(AUTH_SECRET_ENV, "", 1);
    assert_null(auth_secret_resolve(NULL));
    unsetenv(AUTH_SECRET_ENV);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rfc4231_case2),      cmocka_unit_test(test_rfc4231_case1),
        cmocka_unit_test(test_empty_key_rejected), cmocka_unit_test(test_random_differs),
        cmocka_unit_test(test_secret_resolve),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
