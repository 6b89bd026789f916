/* Unit tests: xfer_plan — tail pairing, coalescing and checks, against
 * addresses worked out by hand from PROTOCOL.md §3 ("block address = base +
 * block_id x block_len", "P sends the TAIL of its blocks", "contiguous block
 * runs are coalesced"). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "connector/mooncake/xfer_plan.h"

#include <string.h>

static void test_tail_and_coalescing(void **state) {
    (void)state;
    /* P holds blocks 10 11 12 20 21; D had a prefix hit and asks for 3 blocks
     * 5 6 9: pairs 12->5, 20->6, 21->9; 12,20 is not contiguous on P; 20,21 is,
     * but 6,9 is not on D: three runs of one block */
    int64_t p[] = {10, 11, 12, 20, 21}, d[] = {5, 6, 9};
    xfer_region pr = {0x100000, 0x1000, 0x1000}, dr = {0x900000, 0x1000, 0x1000};
    xfer_run runs[8];
    char err[256];
    int n = xfer_plan_request(p, 5, d, 3, &pr, &dr, 1, 64, runs, 8, err, sizeof err);
    assert_int_equal(n, 3);
    assert_true(runs[0].src == 0x100000 + 12 * 0x1000 && runs[0].dst == 0x900000 + 5 * 0x1000);
    assert_true(runs[0].len == 0x1000);
    assert_true(runs[1].src == 0x100000 + 20 * 0x1000 && runs[1].dst == 0x900000 + 6 * 0x1000);
    assert_true(runs[2].src == 0x100000 + 21 * 0x1000 && runs[2].dst == 0x900000 + 9 * 0x1000);
    /* both sides contiguous: one descriptor for 4 blocks */
    int64_t p2[] = {3, 4, 5, 6}, d2[] = {40, 41, 42, 43};
    n = xfer_plan_request(p2, 4, d2, 4, &pr, &dr, 1, 64, runs, 8, err, sizeof err);
    assert_int_equal(n, 1);
    assert_true(runs[0].src == 0x100000 + 3 * 0x1000 && runs[0].dst == 0x900000 + 40 * 0x1000);
    assert_true(runs[0].len == 4 * 0x1000);
    /* a run break in the middle */
    int64_t p3[] = {3, 4, 5, 6}, d3[] = {40, 41, 50, 51};
    n = xfer_plan_request(p3, 4, d3, 4, &pr, &dr, 1, 64, runs, 8, err, sizeof err);
    assert_int_equal(n, 2);
    assert_true(runs[0].len == 2 * 0x1000 && runs[1].len == 2 * 0x1000);
    assert_true(runs[1].src == 0x100000 + 5 * 0x1000 && runs[1].dst == 0x900000 + 50 * 0x1000);
    /* a release */
    assert_int_equal(xfer_plan_request(p3, 4, NULL, 0, &pr, &dr, 1, 64, runs, 8, err, sizeof err),
                     0);
}

static void test_sparse_blocks_and_two_regions(void **state) {
    (void)state;
    /* payload 0x800 in a 0x1000 stride (P) and 0x2000 stride (D): never coalesced */
    xfer_region pr[2] = {{0x10000, 0x1000, 0x800}, {0x80000, 0x400, 0x400}};
    xfer_region dr[2] = {{0x200000, 0x2000, 0x800}, {0x300000, 0x400, 0x400}};
    int64_t p[] = {1, 2}, d[] = {7, 8};
    xfer_run runs[8];
    char err[256];
    int n = xfer_plan_request(p, 2, d, 2, pr, dr, 2, 16, runs, 8, err, sizeof err);
    assert_int_equal(n, 3);
    assert_true(runs[0].src == 0x10000 + 0x1000 && runs[0].dst == 0x200000 + 7 * 0x2000);
    assert_true(runs[0].len == 0x800);
    assert_true(runs[1].src == 0x10000 + 2 * 0x1000 && runs[1].dst == 0x200000 + 8 * 0x2000);
    /* region 1 is dense: one run */
    assert_true(runs[2].src == 0x80000 + 0x400 && runs[2].dst == 0x300000 + 7 * 0x400);
    assert_true(runs[2].len == 0x800);
}

static void test_errors(void **state) {
    (void)state;
    xfer_region pr = {0x1000, 0x100, 0x100}, dr = {0x2000, 0x100, 0x100};
    xfer_run runs[2];
    char err[256];
    int64_t p[] = {1}, d[] = {1, 2};
    assert_int_equal(xfer_plan_request(p, 1, d, 2, &pr, &dr, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_ETOOFEW);
    assert_non_null(strstr(err, "asked for 2 blocks but the prefill side holds 1"));
    xfer_region bad = {0x2000, 0x100, 0x80};
    int64_t p1[] = {1}, d1[] = {1};
    assert_int_equal(xfer_plan_request(p1, 1, d1, 1, &pr, &bad, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "does not match"));
    int64_t pbig[] = {8}, dneg[] = {-1};
    assert_int_equal(xfer_plan_request(pbig, 1, d1, 1, &pr, &dr, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_int_equal(xfer_plan_request(p1, 1, dneg, 1, &pr, &dr, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "out of range"));
    xfer_region huge = {UINT64_MAX - 0x10, 0x100, 0x100};
    assert_int_equal(xfer_plan_request(p1, 1, d1, 1, &pr, &huge, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "overflows"));
    int64_t p3[] = {1, 3, 5}, d3[] = {1, 3, 5};
    assert_int_equal(xfer_plan_request(p3, 3, d3, 3, &pr, &dr, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_ENOSPC);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tail_and_coalescing),
        cmocka_unit_test(test_sparse_blocks_and_two_regions),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
