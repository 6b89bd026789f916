/*
 * test_cuda_loader — the CUDA module's extra tables for host C code (kernels/cuda/
 * cuda_loader.c: cuda_transfer_load and cuda_tp_load, both through backend_module_entry),
 * with no GPU needed:
 *   - no module at $DISAGG_CUDA_MODULE: NULL, and the error names the path tried and the
 *     variable to set;
 *   - a shared library that is not the module (libm): NULL, and the error names the table
 *     and its symbol;
 *   - the module this build made (beside the test binary), when there is one: both tables
 *     with the ABI this binary was built for (skipped, saying so, in a CPU-only build).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/backend_impl.h"
#include "kernels/cuda/cuda_tp.h"
#include "kernels/cuda/cuda_transfer.h"

static void test_missing_module(void **state) {
    char err[1024] = "";
    setenv("DISAGG_CUDA_MODULE", "/nonexistent/libdisagg_cuda.so", 1);
    assert_null(cuda_transfer_load(err, sizeof err));
    assert_non_null(strstr(err, "libdisagg_cuda.so not found"));
    assert_non_null(strstr(err, "/nonexistent/libdisagg_cuda.so"));
    assert_non_null(strstr(err, "set DISAGG_CUDA_MODULE"));
    err[0] = 0;
    assert_null(cuda_tp_load(err, sizeof err));
    assert_non_null(strstr(err, "/nonexistent/libdisagg_cuda.so"));
    assert_non_null(strstr(err, "set DISAGG_CUDA_MODULE"));
    unsetenv("DISAGG_CUDA_MODULE");
}

static void test_not_the_module(void **state) {
    char err[1024] = "";
    setenv("DISAGG_CUDA_MODULE", "libm.so.6", 1); /* loads, but exports no table */
    assert_null(cuda_transfer_load(err, sizeof err));
    assert_non_null(strstr(err, "no transfer table (" DCU_TRANSFER_SYMBOL ")"));
    assert_non_null(strstr(err, "another build"));
    err[0] = 0;
    assert_null(cuda_tp_load(err, sizeof err));
    assert_non_null(strstr(err, "no tensor-parallel table (" DTP_SYMBOL ")"));
    unsetenv("DISAGG_CUDA_MODULE");
}

static void test_built_module(void **state) {
    char exe[PATH_MAX], mod[PATH_MAX + 32];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    assert_true(n > 0);
    exe[n] = 0;
    *strrchr(exe, '/') = 0;
    snprintf(mod, sizeof mod, "%s/%s", exe, BACKEND_MODULE_NAME);
    if (access(mod, R_OK) != 0) {
        printf("******** SKIP test_built_module: no %s (a CPU-only build) ********\n", mod);
        skip();
    }
    char err[1024] = "";
    const dcu_transfer_api *t = cuda_transfer_load(err, sizeof err);
    if (!t) fail_msg("cuda_transfer_load: %s", err);
    assert_int_equal(t->abi, DCU_TRANSFER_ABI);
    assert_non_null(t->device_ops);
    const dtp_api *p = cuda_tp_load(err, sizeof err);
    if (!p) fail_msg("cuda_tp_load: %s", err);
    assert_int_equal(p->abi, DTP_ABI_VERSION);
    assert_non_null(p->all_reduce);
    /* the same table each time (the module stays loaded) */
    assert_ptr_equal(cuda_transfer_load(err, sizeof err), t);
    assert_ptr_equal(cuda_tp_load(err, sizeof err), p);
}

int main(void) {
    unsetenv("DISAGG_CUDA_MODULE");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_missing_module),
        cmocka_unit_test(test_not_the_module),
        cmocka_unit_test(test_built_module),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
