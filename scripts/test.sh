#!/usr/bin/env bash
# All tests: unit (cmocka) and integration (pytest) under ctest, first on the
# normal build, then on an AddressSanitizer + UBSan build; then a plain
# -DCMAKE_BUILD_TYPE=Release build (-O3, as a packager builds it; built with
# -Werror so -O3-only warnings fail CI, its tests not run); then the fuzz
# targets briefly (clang build).  ctest runs CTEST_JOBS tests at a time (default 4: the
# integration tests are one entry per file and mostly wait on their servers).
set -euo pipefail
cd "$(dirname "$0")/.."
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
BUILD_DIR=build scripts/build.sh
(cd build && ctest -j "${CTEST_JOBS:-4}" --output-on-failure --timeout 1800)
# (the ASan build leaves out the CUDA module: no test here can load it, and the normal and
# release builds compile it)
BUILD_DIR=build-asan scripts/build.sh -DDISAGG_SANITIZE=ON -DDISAGG_CUDA=OFF
(cd build-asan && ctest -j "${CTEST_JOBS:-4}" --output-on-failure --timeout 1800)
BUILD_DIR=build-release scripts/build.sh -DCMAKE_BUILD_TYPE=Release
# Fuzz targets (clang, libFuzzer + ASan/UBSan, docs/fuzzing.md): each replays its
# regression inputs and seed corpus, then fuzzes for FUZZ_SECONDS (default 5).
cmake -S . -B build-fuzz -G Ninja -DCMAKE_C_COMPILER=clang -DDISAGG_FUZZ=ON -DDISAGG_WERROR=ON \
    -DFUZZ_SECONDS="${FUZZ_SECONDS:-5}" >/dev/null
ninja -C build-fuzz -j "${JOBS:-$(nproc)}" fuzz
(cd build-fuzz && ctest -j "${CTEST_JOBS:-4}" -L fuzz --output-on-failure)
