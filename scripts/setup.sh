#!/usr/bin/env bash
# The only install step: every Debian package and Python test package that the
# build, the tests and the tools need. Idempotent and non-interactive.
set -euo pipefail

DEBS=(
  build-essential cmake ninja-build pkg-config clang clang-format libclang-rt-dev
  libjansson-dev libzmq3-dev libmsgpack-dev libevent-dev libcurl4-openssl-dev
  libopenblas-dev libonig-dev libutf8proc-dev libxxhash-dev libcmocka-dev
  libibverbs-dev libssl-dev openssl libyaml-dev iproute2 xz-utils curl
  prometheus etcd-server etcd-client
)
PIPS=(pytest pytest-timeout openai anthropic pyzmq msgpack msgspec numpy requests prometheus-client matplotlib
      tokenizers transformers sentencepiece protobuf llama-models mistral-common
      jsonschema)
# jsonschema validates structured outputs (test_structured_outputs.py); the six before it are the tokenizer references (tests/integration/tokenizer_refs.py):
# HF tokenizers and transformers' converters (no torch), the SentencePiece
# library, and the packages that ship Llama 3's and Mistral's tokenizer files
# (they bring tiktoken).

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

missing=()
for p in "${DEBS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # prometheus is here for its promtool (tests/integration/test_metrics.py runs
  # `promtool check metrics`); the server daemon it ships is not wanted running
  if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
  # etcd-server is here for the discovery tests (tests/integration/test_discovery.py
  # start their own members on free ports); the packaged daemon is not wanted running
  if [[ " ${missing[*]} " == *" etcd-server "* ]] && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
fi

PY=${PYTHON:-python3}
if ! "$PY" -c 'import pytest, openai, anthropic, zmq, msgpack, msgspec, numpy, requests, pytest_timeout, prometheus_client, matplotlib, tokenizers, transformers, sentencepiece, google.protobuf, llama_models, mistral_common' 2>/dev/null; then
  echo "setup: installing Python test packages: ${PIPS[*]}"
  "$PY" -m pip install -q --disable-pip-version-check "${PIPS[@]}"
fi
# The real Mooncake transfer engine (tests/integration/test_mooncake_interop.py
# drives it against disagg). A 46 MB wheel for CPython x86_64 manylinux only:
# when it cannot be installed, setup goes on and those tests skip, naming why.
MOONCAKE_WHEEL=${MOONCAKE_WHEEL:-mooncake-transfer-engine-non-cuda==0.3.13.post1}
if ! "$PY" -c 'from mooncake.engine import TransferEngine' 2>/dev/null; then
  echo "setup: installing the Mooncake transfer engine wheel: $MOONCAKE_WHEEL"
  if ! "$PY" -m pip install -q --disable-pip-version-check "$MOONCAKE_WHEEL"; then
    echo "setup: WARNING: $MOONCAKE_WHEEL did not install; the Mooncake interop tests will skip" >&2
  elif ! "$PY" -c 'from mooncake.engine import TransferEngine' 2>/dev/null; then
    echo "setup: WARNING: $MOONCAKE_WHEEL installed but 'from mooncake.engine import TransferEngine' fails; the Mooncake interop tests will skip" >&2
  fi
fi
echo "setup: ok"
