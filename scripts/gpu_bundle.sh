#!/usr/bin/env bash
# gpu_bundle — packs this tree's sources, the Qwen2.5 tokenizer (for the test models) and a
# prebuilt disagg + test_cuda_model with the shared libraries they need (the GPU machine
# has no C dev packages and no network) into DEST/bundle.tar.xz for scripts/gpu_check.sh.
# (WHEELS=dir: see below.)  BASE=commit: only files that differ from it travel (an overlay on that commit's checkout).
# On the GPU machine: copy the base checkout to w/src, tar xJf bundle.tar.xz -C w, cd w/src,
#   LD_LIBRARY_PATH=$PWD/../prebuilt/rt PREBUILT=$PWD/../prebuilt scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:?usage: gpu_bundle.sh DEST}
BUILD=${BUILD_DIR:-build}
STAGE=$(mktemp -d)
mkdir -p "$STAGE/src" "$STAGE/prebuilt/rt" "$STAGE/shared/data"
if [ -n "${BASE:-}" ]; then
  { git diff --name-only --diff-filter=d "$BASE"; git ls-files -o --exclude-standard; } | sort -u
else
  git ls-files -co --exclude-standard
fi | grep -v '^build' | tar cf - -T - | tar xf - -C "$STAGE/src"
# the tokenizer and the public-domain corpus of the multi-turn benchmarks
for d in qwen2.5-tokenizer sotu; do
  cp -r "../shared/data/$d" "$STAGE/shared/data/" 2>/dev/null || cp -r "/work/shared/data/$d" "$STAGE/shared/data/"
done
for b in disagg test_cuda_model test_backend_ops test_backend_ops_moe test_cuda_invariant test_gpu_transfer test_nccl test_quant libdisagg_cuda.so; do
  # a test this tree does not have (test_backend_ops_moe before the MoE model merge): skipped
  [ -e "$BUILD/$b" ] || [ "$b" != test_backend_ops_moe ] || { echo "gpu_bundle: no $b: skipped"; continue; }
  cp "$BUILD/$b" "$STAGE/prebuilt/" && strip --strip-debug "$STAGE/prebuilt/$b"
done
# WHEELS=dir (default: the repo's .whl/ when it exists, the device README's convention):
# Python wheels the GPU image lacks (the openai client and its needs: openai, pydantic,
# pydantic-core, annotated-types, typing-inspection, jiter, sniffio, httpx2, httpcore2,
# truststore, typing-extensions, idna, anyio, h11, and requests, urllib3, certifi,
# charset-normalizer for the server tests, cp312 manylinux) travel in
# prebuilt/whl; gpu_check.sh installs them when `import openai` fails there.
# They, msgspec and pyzmq (test_kv_events on the GPU) are fetched into .whl/ with their
# dependencies when one is missing there (best effort: this machine reaches PyPI, the GPU
# machine does not)
for pkg in openai requests msgspec pyzmq; do
  ls .whl/"$pkg"-*.whl >/dev/null 2>&1 ||
    python3 -m pip download -q "$pkg" --only-binary :all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 -d .whl 2>/dev/null ||
    echo "gpu_bundle: no $pkg wheel (the tests that import it will not run on the GPU machine)"
done
[ -z "${WHEELS:-}" ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && WHEELS=.whl
if [ -n "${WHEELS:-}" ]; then mkdir -p "$STAGE/prebuilt/whl" && cp "$WHEELS"/*.whl "$STAGE/prebuilt/whl/"; fi
ldd "$BUILD/disagg" "$BUILD/test_cuda_model" "$BUILD/test_cuda_invariant" "$BUILD/test_gpu_transfer" "$BUILD/test_nccl" | awk '/=>/{print $3}' | sort -u |
  grep -v -E '/(libc|libm|libpthread|libdl|librt|libgcc_s|libstdc\+\+|libresolv)\.so' |
  xargs -I{} cp -L {} "$STAGE/prebuilt/rt/"
echo "$(git rev-parse HEAD) $(git status --short | wc -l) uncommitted" > "$STAGE/src/.bundle-rev"
mkdir -p "$DEST"
tar cJf "$DEST/bundle.tar.xz" -C "$STAGE" .
rm -rf "$STAGE"
ls -la "$DEST/bundle.tar.xz"
