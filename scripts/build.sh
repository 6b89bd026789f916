#!/usr/bin/env bash
# Build disagg (release-with-debug-info) into build/ with warnings as errors
# (-DDISAGG_WERROR=ON; later arguments win); pass -DDISAGG_SANITIZE=ON and a
# directory as BUILD_DIR for the sanitizer build.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DDISAGG_WERROR=ON "$@" >/dev/null
if grep -q '^DISAGG_CUDA_BUILT:INTERNAL=ON' "$BUILD_DIR/CMakeCache.txt"; then
  echo "build.sh: CUDA module libdisagg_cuda.so ($(sed -n 's/^DISAGG_CUDA_WHY:INTERNAL=//p' "$BUILD_DIR/CMakeCache.txt"))"
  echo "build.sh: $(sed -n 's/^DISAGG_NCCL_WHY:INTERNAL=//p' "$BUILD_DIR/CMakeCache.txt")"
else
  echo "build.sh: building CPU-only: $(sed -n 's/^DISAGG_CUDA_WHY:INTERNAL=//p' "$BUILD_DIR/CMakeCache.txt")"
fi
ninja -C "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
