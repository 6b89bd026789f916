/* Unit tests: id_table, the producer's index of pending pulls: get/put/del through growth, deletes in any order, and that a
 * table of 200k entries answers lookups (hits and misses) without walking. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "connector/mooncake/id_table.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 200000

static void test_put_get_del(void **state) {
    (void)state;
    id_table t;
    assert_int_equal(id_table_init(&t), 0);
    char(*keys)[32] = malloc((size_t)N * sizeof *keys);
    assert_non_null(keys);
    for (int i = 0; i < N; i++) {
        snprintf(keys[i], sizeof keys[i], "xfer-%08d", i);
        assert_null(id_table_get(&t, keys[i]));
        assert_int_equal(id_table_put(&t, keys[i], keys[i]), 0);
    }
    assert_int_equal(t.count, N);
    assert_true(t.n_buckets >= N); /* grew: load factor at most 1 */
    for (int i = 0; i < N; i++)
        assert_ptr_equal(id_table_get(&t, keys[i]), keys[i]);
    assert_null(id_table_get(&t, "xfer-unknown"));
    assert_null(id_table_get(&t, ""));
    /* delete the odd ones, then check both halves */
    for (int i = 1; i < N; i += 2)
        assert_ptr_equal(id_table_del(&t, keys[i]), keys[i]);
    assert_null(id_table_del(&t, keys[1])); /* twice: absent */
    assert_int_equal(t.count, N / 2);
    for (int i = 0; i < N; i++) {
        if (i % 2)
            assert_null(id_table_get(&t, keys[i]));
        else
            assert_ptr_equal(id_table_get(&t, keys[i]), keys[i]);
    }
    /* the longest chain stays short (seeded XXH3) */
    size_t longest = id_table_longest_chain(&t);
    assert_true(longest < 16);
    id_table_free(&t);
    id_table_free(&t); /* twice is a no-op */
    free(keys);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_put_get_del),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
