#!/usr/bin/env bash
# All tests: unit (cmocka) and integration (pytest) under ctest, first on the
# normal build, then on an AddressSanitizer + UBSan build.
set -euo pipefail
cd "$(dirname "$0")/.."
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
BUILD_DIR=build scripts/build.sh
(cd build && ctest --output-on-failure --timeout 1800)
BUILD_DIR=build-asan scripts/build.sh -DDISAGG_SANITIZE=ON
(cd build-asan && ctest --output-on-failure --timeout 1800)
