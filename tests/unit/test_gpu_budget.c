/* Unit tests: engine/gpu_budget — --gpu-memory-utilization as this instance's budget
 * (vLLM's reading): what other processes hold is not charged to it; the KV cache must
 * still fit in what is free; errors name the figures. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "engine/gpu_budget.h"

#include <string.h>

#define GiB ((size_t)1 << 30)
#define MiB ((size_t)1 << 20)

/* P at 0.2 on a 141 GB device, then D at 0.2 on the same device.  D starts
 * with P's 0.2 x total already taken (others); its own weights are 1 GiB. */
static void test_second_instance_on_one_gpu(void **state) {
    (void)state;
    size_t total = 141 * GiB;
    size_t p_use = (size_t)(0.2 * (double)total); /* P took its whole budget */
    gpu_budget_in in = {.total = total,
                        .free_before = total - p_use,
                        .free_now = total - p_use - 1 * GiB,
                        .utilization = 0.2,
                        .reserve = 512 * MiB};
    gpu_budget_out out;
    char err[1024] = "";
    assert_int_equal(gpu_budget_kv(&in, &out, err, sizeof err), 0);
    assert_int_equal(out.own, 1 * GiB);
    assert_int_equal(out.others, p_use);
    /* 0.2 x total - own - reserve, independent of P */
    size_t want = (size_t)(0.2 * (double)total) - 1 * GiB - 512 * MiB;
    assert_true(out.kv_bytes + 1 >= want && out.kv_bytes <= want + 1);
    /* the same instance alone on the device gets the same KV cache */
    gpu_budget_in alone = in;
    alone.free_before = total;
    alone.free_now = total - 1 * GiB;
    gpu_budget_out out2;
    assert_int_equal(gpu_budget_kv(&alone, &out2, err, sizeof err), 0);
    assert_int_equal(out2.kv_bytes, out.kv_bytes);
    assert_int_equal(out2.others, 0);
}

/* The budget is smaller than the instance's own weights: the error names the figures. */
static void test_budget_below_own_use(void **state) {
    (void)state;
    gpu_budget_in in = {.total = 80 * GiB,
                        .free_before = 70 * GiB,
                        .free_now = 54 * GiB, /* 16 GiB of weights */
                        .utilization = 0.2,   /* 16 GiB */
                        .reserve = 512 * MiB};
    gpu_budget_out out;
    char err[1024] = "";
    assert_int_equal(gpu_budget_kv(&in, &out, err, sizeof err), -1);
    assert_int_equal(out.kv_bytes, 0);
    assert_non_null(strstr(err, "--gpu-memory-utilization 0.20"));
    assert_non_null(strstr(err, "weights and activations take 17.18 GB"));
    assert_non_null(strstr(err, "raise it above 0.21"));
    assert_non_null(strstr(err, "other processes use 10.74 GB"));
    assert_non_null(strstr(err, "the device has 57.98 GB free")); /* 54 GiB */
}

/* Other processes leave less free than the budget asks: refused, naming free vs total and
 * the highest utilization that fits. */
static void test_budget_above_free(void **state) {
    (void)state;
    gpu_budget_in in = {.total = 100 * GiB,
                        .free_before = 30 * GiB, /* others: 70 GiB */
                        .free_now = 28 * GiB,    /* own: 2 GiB */
                        .utilization = 0.5,
                        .reserve = 512 * MiB};
    gpu_budget_out out;
    char err[1024] = "";
    assert_int_equal(gpu_budget_kv(&in, &out, err, sizeof err), -1);
    assert_non_null(strstr(err, "only 30.06 GB are free"));
    assert_non_null(strstr(err, "other processes use 75.16 GB"));
    assert_non_null(strstr(err, "of the device's 107.37 GB"));
    assert_non_null(strstr(err, "lower it to at most 0.30"));
    /* at that utilization it fits */
    in.utilization = 0.30;
    assert_int_equal(gpu_budget_kv(&in, &out, err, sizeof err), 0);
    assert_true(out.kv_bytes > 0 && out.kv_bytes <= in.free_now - in.reserve);
}

/* Freed memory between the two measurements (free_now > free_before) is no negative use. */
static void test_no_negative_use(void **state) {
    (void)state;
    gpu_budget_in in = {.total = 10 * GiB,
                        .free_before = 5 * GiB,
                        .free_now = 6 * GiB,
                        .utilization = 0.4,
                        .reserve = 0};
    gpu_budget_out out;
    char err[256];
    assert_int_equal(gpu_budget_kv(&in, &out, err, sizeof err), 0);
    assert_int_equal(out.own, 0);
    assert_int_equal(out.kv_bytes, (size_t)(0.4 * (double)(10 * GiB)));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_second_instance_on_one_gpu),
        cmocka_unit_test(test_budget_below_own_use),
        cmocka_unit_test(test_budget_above_free),
        cmocka_unit_test(test_no_negative_use),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
