#!/usr/bin/env bash
# gpu_check — the GPU suite and the GPU benchmarks in one command, on a machine with an
# NVIDIA GPU (Hopper, sm_90), nvcc 12/13 and python3 with torch + transformers + safetensors:
#   1. build (cmake + ninja; where the C dependencies' dev packages are missing, the
#      binaries given with PREBUILT=DIR are used and the CUDA module is rebuilt here
#      from source with nvcc),
#   2. tests/unit/test_cuda_model (the serving forward on the GPU vs the CPU, greedy vs the
#      golden continuations, CUDA graphs vs eager) and test_backend_ops (every op CUDA vs
#      CPU), also with DISAGG_CUDA_GEMV=0 (cuBLASLt for 1-token GEMMs too),
#   3. the serve smoke (tools/gpu_serve_smoke.py: cuda vs cpu, concurrent vs single, CUDA
#      graphs vs --enforce-eager),
#   4. `disagg bench model` on the default model and on 7B-shaped random bf16 weights
#      made here (tools/gen_random_qwen2_gpu.py), with the copy/GEMM ceilings of the run
#      (PERF_VARIANTS=1: decode again with each new kernel switched off), and
#      `disagg bench serve` against `disagg serve --device cuda` on those weights
#      (tools/gpu_bench_serve.py: concurrency 1, 16, 64),
#   5. Hugging Face transformers on the GPU (tools/gpu_hf_reference.py) for the default model
#      and the random tiny model, test_cuda_model again against those references, and
#      tests/integration/test_device.py.
#   6. KV from GPU to GPU (kv_steps below; ONLY=kv runs just the build and these):
#      test_gpu_transfer (cuda_ipc and staged tcp between two processes on the GPU),
#      P/D with the KV in HBM behind disagg proxy (tools/gpu_pd_check.py, the official openai
#      client: carried as wheels in $PREBUILT/whl when the image lacks it) and
#      `disagg bench transfer --location cuda:0`; KV_7B=1 adds TTFT at a 4k prompt on the
#      7B shape (random weights made here, the Qwen2.5 tokenizer), P/D vs colocated.
# ONLY=stream (layer-wise P/D streaming and one-launch KV copies; stream_steps below):
#      test_gpu_transfer (with the gather/scatter copy kernel, and with one copy per block),
#      `disagg bench transfer --location cuda:0` (256 scattered 917 KB blocks: one copy each vs
#      cudaMemcpyBatchAsync vs the kernel, one layer of every block, the contiguous ceiling),
#      the tiny-model P/D check (tools/gpu_pd_check.py, PD_QUICK) and tools/gpu_stream_check.py:
#      TTFT at a 4k prompt on the 7B shape, colocated vs P/D over cuda_ipc and staged tcp, the
#      whole-request path vs streaming against the same producer in the same run.
# NO_REBUILD=1 (with PREBUILT) uses the bundle's prebuilt CUDA module instead of rebuilding it.
# QUICK=1 skips the variant (GEMV=0) and the HF references (a short re-run);
# PERF_VARIANTS=1 re-runs the 7B decode/prefill with each kernel switch flipped;
# TEST_DEVICE_SUITE=1 adds the server integration tests against --device cuda.
# The batch-invariant mode (--batch-invariant) has its own steps: test_cuda_invariant
# (GEMM rows, attention schedules, the model alone / batched / chunked, also on the 7B-shaped
# weights), `disagg bench model --batch-invariant` (its cost against the fast mode, 7B) and
# tools/gpu_invariant_serve.py (serve: concurrent vs single answers; P/D through the proxy vs
# colocated).  ONLY=inv runs just
# those (with PREBUILT: the bundle's prebuilt module, no nvcc rebuild); INV_BENCH_ARGS replaces
# that benchmark's arguments (default: 256-token prompts and one of 4,096, decode at 1k and
# 4k context, 8 steps: the table of docs/benchmarks.md), INV_SERVE_ARGS to the serve check (--inv-only), INV_NO_FAST=1
# skips the test's fast-mode comparisons, INV_GEMM_BENCH=1 adds its GEMM timing table,
# INV_DECODE_BENCH=1 its decode-step parts (GEMMs, attention per kernel variant) and INV_LOG=
# (empty) silences the per-shape algorithm log.
# ONLY=prefill: the 7B weights, test_backend_ops (also with the 8-warp
# k_prefill_attention_mma8w for every grid, the f32 gate|up), test_cuda_model, bench model 7B,
# then the prefill with per-op times (DISAGG_CUDA_PROF=8192) and with the 8-warp kernel
# (PREFILL_VARIANTS adds env settings to that list; PREFILL_LIST replaces it).  PREFILL_QUICK_TESTS=1
# skips the f32 gate|up parity run, PREFILL_TEST_VARIANTS / PREFILL_MODEL_VARIANTS add
# test_backend_ops / test_cuda_model runs (settings joined by commas), PREFILL_INV=1 adds
# test_cuda_invariant, PREFILL_LENS the prompt lengths.
# ONLY=decode: test_backend_ops, test_cuda_model, the 7B decode
# table (DECODE_BASE_MODULE=an older libdisagg_cuda.so: its table too, the same run), decode
# with each switch in DECODE_VARIANTS flipped (a variant's settings joined by commas; at the
# batch sizes DECODE_VARIANT_BATCHES, default 1,2,8), the per-op timing of an eager 1-token
# step (DISAGG_CUDA_PROF=1; again with each of DECODE_PROF_VARIANTS) and the serve smoke
# (DECODE_NO_SMOKE=1 skips it).  DECODE_TEST_VARIANTS: the settings the two tests run again with.
# Tensor parallelism: tests/unit/test_nccl (NCCL loads, 1-rank all-reduce, and an
# N-process all-reduce when N >= 2 GPUs are visible); ONLY=tp runs just that.  NVLink
# multicast stays off (NCCL_NVLS_ENABLE=0, as the device machines require).
# ONLY=fp8kv (the FP8 KV cache): test_backend_ops (the FP8 KV cases on CUDA: kv_write,
# the q|k|v epilogues, decode and prefill attention vs a dequantizing reference; also with the
# 8-warp prefill kernel, the q|k|v GEMV off and cuBLASLt for one token), tools/gpu_fp8kv_check.py
# (serve --kv-cache-dtype bfloat16 vs fp8 on the tiny model and the Qwen2.5-7B shape with
# --load-format dummy: requests, the KV tokens at --gpu-memory-utilization 0.9 and the batch of
# 8k sequences that fits), `bench transfer --location cuda:0` of a 4k-token 7B KV for bfloat16
# and fp8 (cuda_ipc and staged tcp: the fp8/bf16 time ratios, target <= 0.5), and P/D with fp8
# on every instance (tools/gpu_pd_check.py, PD_QUICK): P/D equals colocated fp8.
# ONLY=sweep: the request-rate sweep of docs/benchmarks.md (tools/sweep_rate.py): colocated vs
# P/D behind disagg proxy with the KV over cuda_ipc, P and D sharing the one GPU, on the
# Qwen2.5-7B shape with dummy weights (bench/shapes/qwen2.5-7b + the Qwen2.5 tokenizer),
# ~3k-token random prompts, 150 tokens out, Poisson arrivals at SWEEP_RATES (default
# 1,2,4,6,8), each rate's arrivals spread over SWEEP_SECONDS (default 20), goodput under
# SWEEP_SLO (default "ttft:2000 tpot:50"); SWEEP_SETUPS=colocated or pd runs one half (two
# commands under the 10-minute limit; the same OUT keeps both halves); SWEEP_TWO_GPUS=1 puts
# P on cuda:0 and D on cuda:1.  JSONs in $OUT/sweep, pictures (key sweep_gpu) in $OUT/sweep-img.
# Everything is logged to $OUT/gpu_check.log (OUT defaults to /tmp/gpu-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
OUT=${OUT:-${TMPDIR:-/tmp}/gpu-check-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export NCCL_NVLS_ENABLE=0
# pip's nvidia-nccl package folder (include/, lib/), or nothing
nccl_py_dir() { python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null; }
step() { echo; echo "=== $(date -u +%T) $* ==="; }
fails=0
check() { if [ "$1" -ne 0 ]; then echo "*** FAILED: $2 (exit $1)"; fails=$((fails + 1)); else echo "--- ok: $2"; fi; }

# the openai client (and its needs), msgspec and pyzmq from the bundle's wheels when the image
# lacks them: the P/D check and the DISAGG_TEST_DEVICE server tests use openai, test_kv_events
# msgspec and zmq
if ! python3 -c 'import openai, msgspec, zmq' 2>/dev/null && [ -d "${PREBUILT:-/nonexistent}/whl" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-check-site "$PREBUILT"/whl/*.whl &&
    export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
fi

step machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
nvcc --version | tail -2
[ -n "${ONLY:-}" ] || python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' || true

step build
BUILD=${BUILD_DIR:-$SRC/build-gpu}
if [ -n "${PREBUILT:-}" ] && [ -n "${ONLY:-}${NO_REBUILD:-}" ] && [ -f "$PREBUILT/libdisagg_cuda.so" ]; then
  echo "${ONLY:+ONLY=$ONLY}${NO_REBUILD:+NO_REBUILD=1}: the prebuilt binaries and CUDA module in $PREBUILT (no rebuild)"
  BUILD=$PREBUILT
elif cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$OUT/cmake.log" 2>&1; then
  ninja -C "$BUILD" -j "$(nproc)" disagg test_cuda_model test_backend_ops test_cuda_invariant test_gpu_transfer test_nccl test_quant >>"$OUT/cmake.log" 2>&1
  check $? "cmake build in $BUILD"
elif [ -n "${PREBUILT:-}" ]; then
  echo "cmake configure failed here (missing C dev packages: $(grep -o 'package .* not found\|Could NOT find [A-Za-z]*' "$OUT/cmake.log" | head -3 | tr '\n' ' '))"
  echo "using the prebuilt binaries in $PREBUILT and rebuilding the CUDA module from source with nvcc"
  BUILD=$PREBUILT
  NCCL_INC=
  for d in /usr/local/cuda/include "$(nccl_py_dir)/include"; do
    [ -f "$d/nccl.h" ] && NCCL_INC=$d && break
  done
  NCCL_FLAGS="-DDISAGG_HAVE_NCCL=0"
  [ -n "$NCCL_INC" ] && NCCL_FLAGS="-DDISAGG_HAVE_NCCL=1 -I $NCCL_INC"
  echo "NCCL for the module: $NCCL_FLAGS"
  nvcc $NCCL_FLAGS -O3 -std=c++17 -shared -Xcompiler -fPIC,-fvisibility=hidden --Werror all-warnings \
    -gencode arch=compute_90,code=[sm_90,compute_90] -cudart static -I src -I include \
    -Xlinker -z,nodelete -o "$BUILD/libdisagg_cuda.so" src/kernels/cuda/*.cu -lcublasLt
  check $? "nvcc build of libdisagg_cuda.so (sm_90 + compute_90 PTX)"
else
  echo "cmake configure failed; see $OUT/cmake.log (or give PREBUILT=dir)"; exit 1
fi
cuobjdump --list-elf "$BUILD/libdisagg_cuda.so" 2>/dev/null | head -3
cuobjdump --list-ptx "$BUILD/libdisagg_cuda.so" 2>/dev/null | head -3
BIN=$BUILD/disagg
# libnccl for the TP module (dlopen()ed): the loader's path, else the toolkit's, else pip's
if [ -z "${DISAGG_NCCL_LIB:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2 '; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib "$(nccl_py_dir)/lib"; do
    [ -f "$d/libnccl.so.2" ] && export DISAGG_NCCL_LIB=$d/libnccl.so.2 && break
  done
fi
echo "DISAGG_NCCL_LIB=${DISAGG_NCCL_LIB:-unset: libnccl.so.2 from the library path}"
tp_steps() {
  step "tensor parallel: test_nccl (NCCL loads, 1-rank and $(nvidia-smi -L 2>/dev/null | wc -l)-GPU all-reduce, f32 and bf16)"
  "$BUILD/test_nccl"
  check $? test_nccl
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    step "tensor parallel: serve -tp 2 --device cuda (ranks on cuda:0, cuda:1, NCCL) against -tp 1"
    python3 tools/tp_compare.py "$BIN" "$SRC/models/disagg-sotu-tiny" --tp 2 --device cuda
    check $? "tp_compare -tp 2"
  fi
}
if [ "${ONLY:-}" = tp ]; then
  tp_steps
  step "summary"
  echo "gpu_check (ONLY=tp): $fails failed step(s)"
  exit $((fails > 0))
fi

# ONLY=grammar (structured outputs on the GPU; about 2 minutes after the build):
#   1. test_backend_ops' token-bitmask case on CUDA: backend_token_bitmask after
#      backend_upload_async from a page-locked buffer, against the reference (a vocabulary not a
#      multiple of 32, a logits row wider than the vocabulary, a row masked twice, the masked
#      rows' argmax); the step fails when the CUDA backend was skipped.
#   2. `disagg bench grammar --engine` on the Qwen2.5-7B shape with --load-format dummy and the
#      Qwen2.5 tokenizer: 64 requests in flight (a closed loop), each a 16-token prompt and up to
#      64 tokens under bench/grammar/typical_schema.json; greedy: none (no constraint), overlap
#      (the default: masks filled while the forward runs and applied on the device, the greedy
#      rows' argmax on the device, only ids back) and host (DISAGG_GRAMMAR_DEVICE_MASK=0's path:
#      the constrained rows' logits come to the host, which masks and draws them), alternated
#      twice, 48 steps each; then at temperature 1 (none, overlap: masked on the device then
#      drawn on the host, host), 32 steps each.  DISAGG_SAMPLE_THREADS is left at its default
#      (on CUDA min(8, CPUs / 2); the benchmark prints it).  Per step: rows, rows masked on the
#      device, step, forward, after-forward (sampling) ms, mask fill and mask wait ms.
#   3. against disagg serve --device cuda (tiny model, --batch-invariant): the device masks give
#      the host path's outputs and the overlapped masks the serial ones (test_structured_outputs).
# GRAMMAR_SEQS (default 64), GRAMMAR_ARGS (extra arguments of the benchmark, after the others:
# "--steps 4" shortens it), GRAMMAR_SHAPE (default bench/shapes/qwen2.5-7b) and GRAMMAR_DEVICE
# (default cuda; cpu runs the same logic on a machine without a GPU) change it.  Needs this
# tree's build (not a PREBUILT bundle's).
grammar_steps() {
  local dev=${GRAMMAR_DEVICE:-cuda} shape=${GRAMMAR_SHAPE:-$SRC/bench/shapes/qwen2.5-7b} rc run
  TOK=$SRC/../shared/data/qwen2.5-tokenizer
  [ -d "$TOK" ] || TOK=$SRC/shared/data/qwen2.5-tokenizer
  step "grammar: test_backend_ops test_token_bitmask (the device's token bitmask against the reference)"
  # the E lines are the bad-argument checks' own errors (expected)
  TEST_BACKEND_OPS_FILTER=test_token_bitmask "$BUILD/test_backend_ops" >"$OUT/grammar-ops.log" 2>&1
  rc=$?
  grep -v '^E .*backend: \(token_bitmask\|upload_async\)' "$OUT/grammar-ops.log" | tail -6
  if [ "$dev" = cuda ] && grep -q 'SKIP: CUDA' "$OUT/grammar-ops.log"; then
    echo "the CUDA backend was not tested (see the SKIP line)"
    rc=1
  fi
  check $rc "test_backend_ops test_token_bitmask ($dev)"
  for run in "0 none,overlap,host,none,overlap,host 48" "1 none,overlap,host 32"; do
    set -- $run
    step "grammar: bench grammar --engine $(basename "$shape") (dummy weights) --device $dev, seqs ${GRAMMAR_SEQS:-64}, temperature $1"
    # shellcheck disable=SC2086
    "$BIN" bench grammar --engine "$shape" --load-format dummy --device "$dev" --tokenizer "$TOK" \
      --json-schema "$SRC/bench/grammar/typical_schema.json" --seqs "${GRAMMAR_SEQS:-64}" \
      --temperature "$1" --steps "$3" --modes "$2" ${GRAMMAR_ARGS:-} 2>&1 | grep -v '^I ' |
      tee "$OUT/grammar-bench-t$1.log"
    rc=${PIPESTATUS[0]}
    # a device pick outside its row's mask (the engine's warning): the mask was not applied
    if grep -q 'not in its mask' "$OUT/grammar-bench-t$1.log"; then
      echo "a greedy pick on the device fell outside its row's grammar mask"
      rc=1
    fi
    check $rc "bench grammar --engine $(basename "$shape"), temperature $1"
  done
  if python3 -c 'import openai, jsonschema' 2>/dev/null; then
    step "grammar: device masks give the host path's outputs, overlapped masks the serial ones (disagg serve --device $dev, tiny model)"
    DISAGG_TEST_DEVICE=$dev DISAGG_BIN=$BIN python3 -m pytest -q -p no:cacheprovider \
      tests/integration/test_structured_outputs.py -k "device_mask_equals or mask_overlap_equals" 2>&1 | tail -5
    check ${PIPESTATUS[0]} "test_structured_outputs -k 'device_mask_equals or mask_overlap_equals' ($dev)"
  else
    echo "******** SKIP the equality tests: openai or jsonschema is not importable here ********"
  fi
}
if [ "${ONLY:-}" = grammar ]; then
  grammar_steps
  step "summary"
  echo "gpu_check (ONLY=grammar): $fails failed step(s)"
  exit $((fails > 0))
fi

# ONLY=moe (mixture of experts): test_backend_ops' CUDA MoE cases (the routing and every CUDA
# path of backend_moe against host references, skewed routing, CUDA graphs) and, where the tree
# has it, test_backend_ops_moe (the model branch's: CUDA, its generic form and the CPU against
# the reference and torch's routing); then `disagg bench moe` (the op alone at the
# Qwen3-30B-A3B layer shape: 128 experts, top 8, hidden 2048, inter 768; T 1, 64, 4096; us,
# GB/s of the active bytes and the fraction of the copy ceiling measured in the same run) by
# default, with DISAGG_MOE_GENERIC=1 (the generic form), DISAGG_CUDA_MOE_DEC_PAIRS=0 (the
# grouped GEMM at every T), DISAGG_CUDA_MOE_FUSED_DOWN=0 (batch 1: the down GEMV and the sum as
# two kernels) and DISAGG_CUDA_MOE_Y_BF16=1 (prefill: the down rows in bf16), and at the
# Mixtral-8x7B layer shape (8 experts, top 2, hidden 4096, inter 14336; T 1, 32, 4096); then,
# where the tree has the MoE model shapes (bench/shapes/qwen3-30b-a3b, mixtral-8x7b),
# test_cuda_model, `disagg bench model --load-format dummy` on each (its generic-MoE baseline
# comes in the same run) and the per-op timing of its eager decode steps.  MOE_OP_ARGS replaces
# the op benchmark's arguments, MOE_BENCH_ARGS / MIXTRAL_BENCH_ARGS the model benchmark's
# (default: prefill of 4,096 tokens, decode at batch 1 and 64 / 1 and 32, batch 1 at 4k).
moe_kernel_steps() {
  step "moe: test_backend_ops (CUDA MoE: routing, decode GEMVs, grouped GEMM, graphs)"
  TEST_BACKEND_OPS_FILTER='test_moe*' "$BUILD/test_backend_ops"
  check $? "test_backend_ops (moe)"
  if [ -x "$BUILD/test_backend_ops_moe" ]; then
    step "moe: test_backend_ops_moe (routing vs torch, experts vs reference: CUDA, generic, CPU)"
    "$BUILD/test_backend_ops_moe"
    check $? "test_backend_ops_moe"
  fi
  # MOE_QUICK=1: the default kernels and the generic baseline only, no per-op timing
  # DISAGG_MOE_GENERIC=0: the CUDA kernels (the default; =1: the generic form)
  variants=(DISAGG_MOE_GENERIC=0 DISAGG_MOE_GENERIC=1 "DISAGG_MOE_GENERIC=0 DISAGG_CUDA_MOE_DEC_PAIRS=0"
    "DISAGG_MOE_GENERIC=0 DISAGG_CUDA_MOE_FUSED_DOWN=0" "DISAGG_MOE_GENERIC=0 DISAGG_CUDA_MOE_Y_BF16=1"
    "DISAGG_MOE_GENERIC=0 DISAGG_CUDA_MOE_GEMM=bk32")
  [ -n "${MOE_QUICK:-}" ] && variants=(DISAGG_MOE_GENERIC=0 DISAGG_MOE_GENERIC=1)
  for v in "${variants[@]}"; do
    step "moe: bench moe (Qwen3-30B-A3B layer) ${v:-(default)}"
    # shellcheck disable=SC2086
    env $v "$BIN" bench moe ${MOE_OP_ARGS:-}
    check $? "bench moe ${v:-(default)}"
  done
  step "moe: bench moe (Mixtral-8x7B layer: 8 experts, top 2, hidden 4096, inter 14336)"
  DISAGG_MOE_GENERIC=0 "$BIN" bench moe --experts 8 --top-k 2 --hidden 4096 --inter 14336 --tokens 1,32,4096 \
    --iters 20
  check $? "bench moe (Mixtral layer)"
  if [ -d "$SRC/bench/shapes/qwen3-30b-a3b" ]; then
    step "moe: test_cuda_model (the Qwen3-MoE and Mixtral tiny models among the rest)"
    "$BUILD/test_cuda_model"
    check $? "test_cuda_model (moe)"
  fi
  for s in qwen3-30b-a3b mixtral-8x7b; do
    [ -d "$SRC/bench/shapes/$s" ] || { echo "(bench/shapes/$s not in this tree: skipped)"; continue; }
    args=${MOE_BENCH_ARGS:---prompt-lens 4096 --batches 1,64 --long-context 4096}
    [ "$s" = mixtral-8x7b ] && args=${MIXTRAL_BENCH_ARGS:---prompt-lens 4096 --batches 1,32 --long-context 4096}
    step "moe: bench model $s --load-format dummy $args"
    # shellcheck disable=SC2086
    DISAGG_MOE_GENERIC=0 "$BIN" bench model "$SRC/bench/shapes/$s" --device cuda --load-format dummy $args
    check $? "bench model $s (dummy weights)"
    [ -n "${MOE_QUICK:-}" ] && continue
    step "moe: per-op timing of eager 1-token and 64-token steps, $s (DISAGG_CUDA_PROF=64)"
    env DISAGG_CUDA_PROF=64 DISAGG_MOE_GENERIC=0 "$BIN" bench model "$SRC/bench/shapes/$s" --device cuda \
      --load-format dummy --prompt-lens 16 --batches 1,64 2>&1 | grep -E "^prof|^ *(1|64) "
    check ${PIPESTATUS[0]} "bench model $s, DISAGG_CUDA_PROF=64"
  done
}
# ONLY=moevar: the MoE grouped GEMM's M tiles (DISAGG_CUDA_MOE_BM=16, 32, 64 against the
# default pick and 128, with the grouped GEMM at every T: DISAGG_CUDA_MOE_DEC_PAIRS=0) and the
# decode GEMVs where the pairs fit (the default rule): test_backend_ops' MoE cases and
# test_backend_ops_moe with each forced tile, then `disagg bench moe` at the Qwen3-30B-A3B and
# Mixtral-8x7B layer shapes for decode and prefill sizes with each (a few seconds a run).
moevar_steps() {
  for bm in 16 32 64; do
    step "moevar: test_backend_ops (moe) and test_backend_ops_moe, grouped GEMM always, DISAGG_CUDA_MOE_BM=$bm"
    DISAGG_CUDA_MOE_DEC_PAIRS=0 DISAGG_CUDA_MOE_BM=$bm TEST_BACKEND_OPS_FILTER='test_moe*' "$BUILD/test_backend_ops" 2>&1 | tail -3
    check ${PIPESTATUS[0]} "test_backend_ops (moe), BM $bm"
    DISAGG_CUDA_MOE_DEC_PAIRS=0 DISAGG_CUDA_MOE_BM=$bm "$BUILD/test_backend_ops_moe" 2>&1 | tail -3
    check ${PIPESTATUS[0]} "test_backend_ops_moe, BM $bm"
  done
  for v in "DISAGG_CUDA_MOE_DEC_PAIRS=512" "DISAGG_CUDA_MOE_DEC_PAIRS=0" "DISAGG_CUDA_MOE_DEC_PAIRS=0 DISAGG_CUDA_MOE_BM=16" \
    "DISAGG_CUDA_MOE_DEC_PAIRS=0 DISAGG_CUDA_MOE_BM=32" "DISAGG_CUDA_MOE_DEC_PAIRS=0 DISAGG_CUDA_MOE_BM=64" \
    "DISAGG_CUDA_MOE_DEC_PAIRS=0 DISAGG_CUDA_MOE_BM=128"; do
    step "moevar: bench moe, $v (Qwen3-30B-A3B layer, then Mixtral-8x7B layer)"
    # shellcheck disable=SC2086
    env $v "$BIN" bench moe --tokens 1,4,8,16,32,64,128,512,4096 --iters 10
    check $? "bench moe qwen3 layer, $v"
    # shellcheck disable=SC2086
    env $v "$BIN" bench moe --experts 8 --top-k 2 --hidden 4096 --inter 14336 --tokens 1,4,8,16,32,64,512,4096 --iters 10
    check $? "bench moe mixtral layer, $v"
  done
  # MOEVAR_MODEL=1: the whole models' batched decode with the small tiles (DISAGG_CUDA_MOE_BM=auto)
  # against the default in the same run (Mixtral b32 takes the grouped GEMM by the path rule;
  # Qwen3-30B-A3B b64 only with DISAGG_CUDA_MOE_DEC_PAIRS=0)
  [ -n "${MOEVAR_MODEL:-}" ] || return 0
  for s in mixtral-8x7b qwen3-30b-a3b; do
    [ -d "$SRC/bench/shapes/$s" ] || continue
    b=32; [ "$s" = qwen3-30b-a3b ] && b=64
    for v in "DISAGG_CUDA_MOE_BM=128" "DISAGG_CUDA_MOE_BM=auto" "DISAGG_CUDA_MOE_DEC_PAIRS=0 DISAGG_CUDA_MOE_BM=auto"; do
      step "moevar: bench model $s --batches $b, $v"
      # shellcheck disable=SC2086
      env DISAGG_MOE_GENERIC=0 $v "$BIN" bench model "$SRC/bench/shapes/$s" --device cuda --load-format dummy \
        --prompt-lens 16 --batches "$b" --long-context 1024
      check $? "bench model $s b$b, $v"
    done
  done
}
if [ "${ONLY:-}" = moevar ]; then
  moevar_steps
  step "summary"
  echo "gpu_check (ONLY=moevar): $fails failed step(s)"
  exit $((fails > 0))
fi
if [ "${ONLY:-}" = moe ]; then
  moe_kernel_steps
  step "summary"
  echo "gpu_check (ONLY=moe): $fails failed step(s)"
  exit $((fails > 0))
fi

W7=/dev/shm/q7b
[ "$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -gt 20 ] 2>/dev/null || W7=/tmp/q7b
inv_steps() {
  step "batch-invariant mode: test_cuda_invariant (GEMM rows, attention schedules, the model alone/batched/chunked; 7B-shaped random weights)"
  [ -f "$W7/model.safetensors.index.json" ] || python3 tools/gen_random_qwen2_gpu.py --out "$W7" --shape 7b
  DISAGG_SRC=$SRC DISAGG_INV_NO_FAST=${INV_NO_FAST:-} DISAGG_INV_7B=$W7 DISAGG_INV_GEMM_BENCH=${INV_GEMM_BENCH:-} DISAGG_INV_DECODE_BENCH=${INV_DECODE_BENCH:-} DISAGG_CUDA_INV_LOG=${INV_LOG-1} "$BUILD/test_cuda_invariant"
  check $? test_cuda_invariant
  step "batch-invariant mode: its cost against the fast mode (serving path, 7B shape)"
  "$BIN" bench model "$W7" --device cuda --batch-invariant \
    ${INV_BENCH_ARGS:---prompt-len 256 --long-prompt 4096 --context 1024,4096 --gen-len 8}
  check $? "bench model 7b --device cuda --batch-invariant"
  step "batch-invariant mode: serve, 32 concurrent vs single (greedy and seeded sampling, mixed prompt lengths, colocated)"
  python3 tools/gpu_invariant_serve.py "$BIN" "$SRC/models/disagg-sotu-tiny" "$OUT" --pd ${INV_SERVE_ARGS:-}
  check $? gpu_invariant_serve
}
kv_steps() {
  step "KV from GPU to GPU: test_gpu_transfer (cuda_ipc and staged tcp, two processes on the GPU)"
  DISAGG_BIN=$BIN "$BUILD/test_gpu_transfer"
  check $? test_gpu_transfer

  step "KV from GPU to GPU: P/D with the KV in HBM behind disagg proxy (openai client; cuda_ipc, then staged tcp)"
  PD7=
  if [ -n "${KV_7B:-}" ]; then # TTFT at a 4k prompt on the 7B shape: random weights + the Qwen2.5 tokenizer
    W7=/dev/shm/q7b
    [ "$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -gt 20 ] 2>/dev/null || W7=/tmp/q7b
    [ -f "$W7/model.safetensors.index.json" ] || python3 tools/gen_random_qwen2_gpu.py --out "$W7" --shape 7b
    check $? "gen_random_qwen2_gpu 7b"
    TOK=$SRC/../shared/data/qwen2.5-tokenizer
    [ -d "$TOK" ] || TOK=$SRC/shared/data/qwen2.5-tokenizer
    cp "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json "$W7"/ && PD7=$W7
  fi
  if python3 -c 'import openai' 2>/dev/null; then
    PD_7B=$PD7 PYTHONUNBUFFERED=1 python3 tools/gpu_pd_check.py "$BIN" "$SRC/models/disagg-sotu-tiny" "$OUT"
    check $? gpu_pd_check
    step "KV from GPU to GPU: P/D with --batch-invariant on every instance: P/D must equal colocated token for token"
    mkdir -p "$OUT/pd-invariant"
    PD_SERVE_ARGS=--batch-invariant PD_QUICK=1 PYTHONUNBUFFERED=1 python3 tools/gpu_pd_check.py "$BIN" \
      "$SRC/models/disagg-sotu-tiny" "$OUT/pd-invariant"
    check $? "gpu_pd_check --batch-invariant"
  else
    echo "******** SKIP gpu_pd_check: the openai package is not importable here (bundle its wheels: WHEELS=dir scripts/gpu_bundle.sh, see docs/transfer.md) ********"
  fi

  step "bench transfer --location cuda:0 (cuda_ipc and staged tcp vs ceilings of the same run)"
  "$BIN" bench transfer --location cuda:0
  check $? "bench transfer --location cuda:0"
}
stream_steps() {
  step "stream: test_gpu_transfer (cuda_ipc batches as one gather/scatter kernel launch), then one copy per block"
  DISAGG_BIN=$BIN "$BUILD/test_gpu_transfer"
  check $? test_gpu_transfer
  DISAGG_CUDA_BATCH_COPY=each DISAGG_BIN=$BIN "$BUILD/test_gpu_transfer"
  check $? "test_gpu_transfer with DISAGG_CUDA_BATCH_COPY=each"
  step "stream: bench transfer --location cuda:0 --ipc (256 scattered 917 KB blocks: each / memcpy_batch / kernel; target <= 0.2 ms)"
  "$BIN" bench transfer --location cuda:0
  check $? "bench transfer --location cuda:0"
  step "stream: P/D on the tiny model (streaming is the default), P/D must equal colocated"
  if python3 -c 'import openai' 2>/dev/null; then
    mkdir -p "$OUT/pd-stream"
    PD_QUICK=1 PYTHONUNBUFFERED=1 python3 tools/gpu_pd_check.py "$BIN" "$SRC/models/disagg-sotu-tiny" "$OUT/pd-stream"
    check $? "gpu_pd_check (quick)"
  else
    echo "******** SKIP gpu_pd_check: the openai package is not importable here ********"
  fi
  step "stream: TTFT at a 4k prompt, 7B shape: colocated vs P/D (cuda_ipc, staged tcp) x (whole, streaming)"
  W7=/dev/shm/q7b
  [ "$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -gt 20 ] 2>/dev/null || W7=/tmp/q7b
  [ -f "$W7/model.safetensors.index.json" ] || python3 tools/gen_random_qwen2_gpu.py --out "$W7" --shape 7b
  check $? "gen_random_qwen2_gpu 7b"
  TOK=$SRC/../shared/data/qwen2.5-tokenizer
  [ -d "$TOK" ] || TOK=$SRC/shared/data/qwen2.5-tokenizer
  cp "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json "$W7"/
  PYTHONUNBUFFERED=1 python3 tools/gpu_stream_check.py "$BIN" "$W7" "$OUT/stream"
  check $? gpu_stream_check
}
prefill_steps() {
  step "prefill: 7B-shaped random bf16 weights"
  [ -f "$W7/model.safetensors.index.json" ] || python3 tools/gen_random_qwen2_gpu.py --out "$W7" --shape 7b
  check $? "gen_random_qwen2_gpu 7b"
  step "prefill: test_backend_ops (k_prefill_attention_mma, bf16 gate|up), then k_prefill_attention_mma8w"
  "$BUILD/test_backend_ops" 2>&1 | grep -E "attention|gate_up|OK|FAILED|PASSED|ERROR|SKIP"
  check ${PIPESTATUS[0]} test_backend_ops
  DISAGG_CUDA_FLASH_MT=1 "$BUILD/test_backend_ops" 2>&1 | grep -E "FAILED|PASSED|ERROR|SKIP|tolerance"
  check ${PIPESTATUS[0]} "test_backend_ops with DISAGG_CUDA_FLASH_MT=1"
  DISAGG_CUDA_FLASH_AUTO=0 "$BUILD/test_backend_ops" 2>&1 | grep -E "FAILED|PASSED|ERROR|SKIP|tolerance"
  check ${PIPESTATUS[0]} "test_backend_ops with DISAGG_CUDA_FLASH_AUTO=0 (k_prefill_attention_mma also for small grids)"
  DISAGG_CUDA_RESID_GEMM=0 DISAGG_CUDA_QKV_BF16=0 "$BUILD/test_backend_ops" 2>&1 | grep -E "FAILED|PASSED|ERROR|SKIP|tolerance"
  check ${PIPESTATUS[0]} "test_backend_ops with DISAGG_CUDA_RESID_GEMM=0 DISAGG_CUDA_QKV_BF16=0"
  for v in ${PREFILL_TEST_VARIANTS:-}; do
    env ${v//,/ } "$BUILD/test_backend_ops" 2>&1 | grep -E "FAILED|PASSED|ERROR|SKIP|tolerance"
    check ${PIPESTATUS[0]} "test_backend_ops with ${v//,/ }"
  done
  [ -n "${PREFILL_QUICK_TESTS:-}" ] || {
  DISAGG_CUDA_GU_BF16=0 "$BUILD/test_backend_ops" 2>&1 | grep -E "FAILED|PASSED|ERROR|SKIP|tolerance"
  check ${PIPESTATUS[0]} "test_backend_ops with DISAGG_CUDA_GU_BF16=0"
  }
  step "prefill: test_cuda_model"
  "$BUILD/test_cuda_model" 2>&1 | grep -vE "^  (matmul|rmsnorm|rope|swiglu)"
  check ${PIPESTATUS[0]} test_cuda_model
  DISAGG_CUDA_FLASH_MT=1 "$BUILD/test_cuda_model" 2>&1 | grep -E "FAILED|PASSED|ERROR"
  check ${PIPESTATUS[0]} "test_cuda_model with DISAGG_CUDA_FLASH_MT=1"
  for v in ${PREFILL_MODEL_VARIANTS:-}; do
    env ${v//,/ } "$BUILD/test_cuda_model" 2>&1 | grep -E "FAILED|PASSED|ERROR"
    check ${PIPESTATUS[0]} "test_cuda_model with ${v//,/ }"
  done
  if [ -n "${PREFILL_INV:-}" ]; then # the batch-invariant mode still exact (0 differing rows)
    step "prefill: test_cuda_invariant"
    DISAGG_SRC=$SRC DISAGG_INV_7B=$W7 DISAGG_INV_NO_FAST=${INV_NO_FAST-1} DISAGG_CUDA_INV_LOG= \
      timeout ${PREFILL_INV_TIMEOUT:-150} "$BUILD/test_cuda_invariant" > /tmp/tci.log 2>&1
    check $? test_cuda_invariant
    grep -E "differ|FAILED|PASSED|ERROR|SKIP" /tmp/tci.log | tail -25
  fi
  step "prefill: bench model 7b (prefill 512 and 4096; decode batch 1 and 32)"
  "$BIN" bench model "$W7" --device cuda --batches 1,32 ${BENCH_ARGS:-}
  check $? "bench model 7b --device cuda"
  P="--prompt-lens ${PREFILL_LENS:-512,4096} --batches 1 --gen-len 4"
  # PREFILL_LIST replaces the default list of variants (space-separated; a variant's settings
  # joined by commas), PREFILL_VARIANTS adds to it
  for v in ${PREFILL_LIST:-"DISAGG_CUDA_PROF=8192" "DISAGG_CUDA_GU_BF16=0" \
           "DISAGG_CUDA_FLASH_MT=1" "DISAGG_CUDA_PROF=8192,DISAGG_CUDA_FLASH_MT=1"} \
           ${PREFILL_VARIANTS:-}; do
    v=${v//,/ }
    echo "--- prefill with $v:"
    env $v "$BIN" bench model "$W7" --device cuda $P > "${TMPDIR:-/tmp}/prefill-variant.log" 2>&1
    check $? "bench model 7b, $v"
    grep -E "^ceilings|^[0-9]+ " "${TMPDIR:-/tmp}/prefill-variant.log"
    # DISAGG_CUDA_GEMM_SWEEP: every candidate into $OUT/gemm-sweep.log, the fastest and the
    # rule's here
    if grep -q "cuda gemm sweep" "${TMPDIR:-/tmp}/prefill-variant.log"; then
      { echo "--- $v"; grep "cuda gemm sweep" "${TMPDIR:-/tmp}/prefill-variant.log"; } >> "${OUT:-/tmp}/gemm-sweep.log"
      awk '/cuda gemm sweep: .*#[0-9]+: / { split($0, a, "#"); split(a[2], b, ":"); k = a[1]; t[k "#" b[1]] = $0 }
           /fastest #/ { k = $0; sub(/: fastest.*/, "", k); split($0, f, "fastest #"); split(f[2], g, ","); i = g[1];
                         print t[k " #0"]; if (i != "0") print t[k " #" i]; print }' \
        "${TMPDIR:-/tmp}/prefill-variant.log" | sed 's/cuda gemm sweep: //'
    fi
    # the last per-op table of each forward length
    awk '/^prof: eager step/ { n = $4; b[n] = $0 "\n"; next } /^prof:  / { b[n] = b[n] $0 "\n" }
         END { for (k in b) printf "%s", b[k] }' "${TMPDIR:-/tmp}/prefill-variant.log"
  done
}
decode_steps() {
  # the batch-1 decode: the parity tests, the 7B decode table (after and, with
  # DECODE_BASE_MODULE=path/libdisagg_cuda.so of the previous commit, before in the same run),
  # the kernel switches and the per-op timing of an eager step (DISAGG_CUDA_PROF=1)
  step "decode: 7B-shaped random weights (in the background), test_backend_ops, test_cuda_model"
  gen_pid=
  if [ ! -f "$W7/model.safetensors.index.json" ]; then
    python3 tools/gen_random_qwen2_gpu.py --out "$W7" --shape 7b > /tmp/gen7b.log 2>&1 &
    gen_pid=$!
  fi
  "$BUILD/test_backend_ops" > /tmp/tbo.log 2>&1
  check $? test_backend_ops
  grep -E "FAILED|ERROR|error|PASSED" /tmp/tbo.log | head -20
  "$BUILD/test_cuda_model" 2>&1 | grep -vE "^  (matmul|rmsnorm|rope|swiglu|attention)"
  check ${PIPESTATUS[0]} test_cuda_model
  for v in ${DECODE_TEST_VARIANTS-DISAGG_CUDA_QKV_FUSE=0 DISAGG_CUDA_PDL=0 DISAGG_CUDA_NORM_PDL=0 DISAGG_CUDA_GEMV=2 DISAGG_CUDA_GEMV_SPLIT=1,DISAGG_CUDA_QKV_SPLIT=1 DISAGG_CUDA_GEMV_SPLIT=8,DISAGG_CUDA_QKV_SPLIT=8,DISAGG_CUDA_GEMV=2 DISAGG_CUDA_GEMV_SPLIT_ROWS=1}; do
    env ${v//,/ } "$BUILD/test_backend_ops" > /tmp/tbo.log 2>&1
    check $? "test_backend_ops with $v"
    grep -E "FAILED|ERROR|error" /tmp/tbo.log | head -10
    env ${v//,/ } "$BUILD/test_cuda_model" 2>&1 | grep -E "graph|FAILED|ERROR|PASSED"
    check ${PIPESTATUS[0]} "test_cuda_model with $v"
  done
  if [ -n "$gen_pid" ]; then wait "$gen_pid"; check $? "gen_random_qwen2_gpu 7b"; cat /tmp/gen7b.log; fi
  step "decode: bench model 7b (this build)"
  "$BIN" bench model "$W7" --device cuda ${BENCH_ARGS:-}
  check $? "bench model 7b --device cuda"
  if [ -n "${DECODE_BASE_MODULE:-}" ] && [ -f "$DECODE_BASE_MODULE" ]; then
    step "decode: bench model 7b with the previous CUDA module ($DECODE_BASE_MODULE)"
    DISAGG_CUDA_MODULE=$DECODE_BASE_MODULE "$BIN" bench model "$W7" --device cuda --prompt-lens 512 2>&1 | sed -n '/^ceilings/p;/^decode/,/^$/p'
    check ${PIPESTATUS[0]} "bench model 7b, previous module"
  fi
  # a variant's settings joined by commas; list a variant twice, alternated with another, to
  # see the machine's drift within the run; DECODE_VARIANT_BATCHES: their batch sizes
  for v in ${DECODE_VARIANTS-DISAGG_CUDA_GEMV_SPLIT=1,DISAGG_CUDA_QKV_SPLIT=1 DISAGG_CUDA_GEMV_SPLIT_ROWS=1 DISAGG_CUDA_PDL=0 DISAGG_CUDA_NORM_PDL=0 DISAGG_CUDA_QKV_FUSE=0 DISAGG_CUDA_GEMV=2 DISAGG_CUDA_GEMV=0}; do
    echo "--- decode with $v:"
    env ${v//,/ } "$BIN" bench model "$W7" --device cuda --prompt-lens 16 --batches ${DECODE_VARIANT_BATCHES:-1,2,8} 2>&1 | sed -n '/^decode/,/^$/p' | grep -v '^$'
    check ${PIPESTATUS[0]} "bench model 7b --device cuda, $v"
  done
  # the per-op table, also with each of DECODE_PROF_VARIANTS (settings joined by commas)
  for v in "" ${DECODE_PROF_VARIANTS:-}; do
    step "decode: per-op timing of eager 1-token steps (DISAGG_CUDA_PROF=1${v:+ $v})"
    env DISAGG_CUDA_PROF=1 ${v//,/ } "$BIN" bench model "$W7" --device cuda --prompt-lens 16 --batches 1 2>&1 | grep -E "^prof|^1 "
    check ${PIPESTATUS[0]} "bench model 7b, DISAGG_CUDA_PROF=1${v:+ $v}"
  done
  if [ -z "${DECODE_NO_SMOKE:-}" ]; then
    step "decode: serve smoke (fast mode counted; single eager vs graphs and --batch-invariant concurrent vs single checked)"
    python3 tools/gpu_serve_smoke.py "$BIN" "$SRC/models/disagg-sotu-tiny" "$OUT" 2>&1 | grep -E "^serve|FAILED|Error"
    check ${PIPESTATUS[0]} gpu_serve_smoke
  fi
}
if [ "${ONLY:-}" = decode ]; then
  decode_steps
  step "summary"
  echo "gpu_check (ONLY=decode): $fails failed step(s)"
  exit $((fails > 0))
fi
# ONLY=arch: the ops the Llama 3 / Qwen3 / Mistral forward adds (q/k per-head norm,
# sliding-window attention: kernels/cuda/cuda_window.cu) and the three tiny architectures'
# forward vs the CPU, then `bench model --load-format dummy` on the Llama-3.1-8B and Qwen3-8B
# shapes (bench/shapes/: random bf16 weights made in HBM at load, no files); ARCH_BENCH_ARGS
# replaces the benchmark's arguments (default: prefill of 4,096 tokens, decode at batch 1, 32
# and 64 at 4k context).
arch_steps() {
  step "arch: test_backend_ops (q/k norm, sliding window: CUDA vs reference)"
  "$BUILD/test_backend_ops"
  check $? "test_backend_ops (arch ops)"
  step "arch: test_cuda_model (Llama 3, Qwen3, Mistral tiny models vs CPU)"
  "$BUILD/test_cuda_model"
  check $? "test_cuda_model (arch)"
  for s in llama-3.1-8b qwen3-8b; do
    step "arch: bench model $s --load-format dummy"
    # shellcheck disable=SC2086
    "$BIN" bench model "$SRC/bench/shapes/$s" --device cuda --load-format dummy \
      ${ARCH_BENCH_ARGS:---prompt-lens 4096 --batches 1,32,64 --long-context 4096}
    check $? "bench model $s (dummy weights)"
  done
}
# ONLY=profile: one decode step of each PROFILE_SHAPES shape (default llama-3.1-8b qwen3-8b) at
# batch 1, context 4096, kernel by kernel under Nsight Compute (tools/gpu_profile_decode.py:
# time, DRAM bytes and GB/s per kernel; skips loudly where ncu is missing or cannot read counters).
profile_steps() {
  for s in ${PROFILE_SHAPES:-llama-3.1-8b qwen3-8b}; do
    step "profile: one decode step of $s (batch 1, context 4096) under ncu"
    python3 tools/gpu_profile_decode.py "$BIN" "$SRC/bench/shapes/$s" --batch 1 --context 4096 \
      ${PROFILE_COPY_GBS:+--copy-gbs $PROFILE_COPY_GBS}
    check $? "profile $s"
  done
}
fp8kv_steps() {
  step "fp8 KV: test_backend_ops (FP8 KV write, q|k|v epilogues, decode and prefill attention on CUDA)"
  "$BUILD/test_backend_ops" > /tmp/tbo-fp8.log 2>&1
  check $? test_backend_ops
  grep -E "fp8|FAILED|ERROR|PASSED|SKIP" /tmp/tbo-fp8.log | head -30
  for v in DISAGG_CUDA_FLASH_MT=1 DISAGG_CUDA_FLASH_AUTO=0 DISAGG_CUDA_QKV_FUSE=0 DISAGG_CUDA_GEMV=0 DISAGG_CUDA_QKV_BF16=0; do
    env ${v//,/ } "$BUILD/test_backend_ops" > /tmp/tbo-fp8.log 2>&1
    check $? "test_backend_ops with $v"
    grep -E "FAILED|ERROR|tolerance|differ" /tmp/tbo-fp8.log | head -10
  done
  step "fp8 KV: serve bfloat16 vs fp8 (tiny model; Qwen2.5-7B shape, dummy weights): requests, KV tokens, batch at 8k"
  TOK=$SRC/../shared/data/qwen2.5-tokenizer
  [ -d "$TOK" ] || TOK=$SRC/shared/data/qwen2.5-tokenizer
  PYTHONUNBUFFERED=1 python3 tools/gpu_fp8kv_check.py "$BIN" "$OUT" "$SRC/models/disagg-sotu-tiny" \
    "$SRC/bench/shapes/qwen2.5-7b:dummy:$TOK"
  check $? gpu_fp8kv_check
  step "fp8 KV: bench transfer of a 4k-token KV of the 7B shape, bfloat16 then fp8 (cuda_ipc and staged tcp)"
  for dt in bfloat16 fp8; do
    "$BIN" bench transfer --location cuda:0 --kv-cache-dtype $dt > "$OUT/transfer-$dt.log" 2>&1
    check $? "bench transfer --location cuda:0 --kv-cache-dtype $dt"
    grep -E "^disagg bench transfer|^[a-z_ :]+ +(contiguous|scattered|one copy)|^  |^kv time" "$OUT/transfer-$dt.log"
  done
  awk '/^kv time bfloat16/ { bi = $9; bt = $13 } /^kv time fp8/ { fi = $9; ft = $13 }
       END { if (bi > 0 && bt > 0 && fi > 0 && ft > 0)
               printf "fp8 / bf16 KV transfer time: cuda_ipc %.3f / %.3f ms = %.2f (target <= 0.5 %s), staged tcp %.3f / %.3f ms = %.2f (target <= 0.5 %s)\n",
                      fi, bi, fi / bi, fi / bi <= 0.5 ? "PASS" : "MISS", ft, bt, ft / bt, ft / bt <= 0.5 ? "PASS" : "MISS";
             else print "fp8 / bf16 KV transfer time: a row is missing" }' \
    "$OUT/transfer-bfloat16.log" "$OUT/transfer-fp8.log"
  if python3 -c 'import openai' 2>/dev/null; then
    step "fp8 KV: P/D with --kv-cache-dtype fp8 on every instance (cuda_ipc, then staged tcp): P/D vs colocated fp8"
    mkdir -p "$OUT/pd-fp8"
    PD_SERVE_ARGS="--kv-cache-dtype fp8" PD_QUICK=1 PYTHONUNBUFFERED=1 python3 tools/gpu_pd_check.py "$BIN" \
      "$SRC/models/disagg-sotu-tiny" "$OUT/pd-fp8"
    check $? "gpu_pd_check --kv-cache-dtype fp8"
  else
    echo "******** SKIP gpu_pd_check fp8: the openai package is not importable here ********"
  fi
}
# M7: a Qwen2.5-7B-shape model folder for `disagg serve --load-format dummy` (the shape's
# config.json and the real Qwen2.5 tokenizer)
make_m7() {
  M7=$OUT/qwen2.5-7b-dummy
  TOK=$SRC/../shared/data/qwen2.5-tokenizer
  [ -d "$TOK" ] || TOK=$SRC/shared/data/qwen2.5-tokenizer
  mkdir -p "$M7" && cp bench/shapes/qwen2.5-7b/config.json "$TOK"/tokenizer.json "$TOK"/tokenizer_config.json "$M7"/
  check $? "the 7B-shape model folder (config + the Qwen2.5 tokenizer)"
}
sweep_steps() {
  step "sweep: request rate, colocated vs P/D (KV over cuda_ipc), Qwen2.5-7B shape, dummy weights"
  make_m7
  local pd_gpus=1 p_dev="" d_dev="" kv_pd=24G where="one GPU shared by P and D"
  if [ -n "${SWEEP_TWO_GPUS:-}" ]; then
    pd_gpus=2 p_dev="--device cuda:0" d_dev="--device cuda:1" kv_pd=48G where="P on cuda:0, D on cuda:1"
  fi
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 python3 tools/sweep_rate.py --bin "$BIN" --out "$OUT/sweep" \
    --rates "${SWEEP_RATES:-1,2,4,6,8}" --seconds-per-rate "${SWEEP_SECONDS:-20}" --min-prompts 16 \
    --setups "${SWEEP_SETUPS:-colocated,pd}" --start "$M7" \
    --serve-args "--device cuda --load-format dummy --max-model-len 8192 --block-size 16 --served-model-name qwen2.5-7b-dummy" \
    --colocated-serve-args "--kv-cache-memory 48G" --pd-serve-args "--kv-cache-memory $kv_pd" \
    --prefill-serve-args "$p_dev" --decode-serve-args "$d_dev" \
    --gpus-colocated 1 --gpus-pd "$pd_gpus" --device-name GPU \
    -- --random-input-len 3000 --random-output-len 150 --goodput ${SWEEP_SLO:-ttft:2000 tpot:50}
  check $? "sweep_rate (JSONs in $OUT/sweep)"
  mkdir -p "$OUT/sweep-img" # the docs' numbers plus this run's: copy it over docs/img/benchmarks.json
  [ -f "$OUT/sweep-img/benchmarks.json" ] || cp docs/img/benchmarks.json "$OUT/sweep-img/"
  python3 tools/plot_benchmarks.py --sweep "$OUT/sweep" --sweep-key sweep_gpu --out "$OUT/sweep-img" \
    --sweep-title "Qwen2.5-7B shape (dummy weights), ~3k tokens in / 150 out" \
    --sweep-source "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $where, $(date -u '+%F %H:%M') UTC"
  check $? "plot_benchmarks --sweep (PNGs in $OUT/sweep-img)"
  python3 - "$OUT/sweep" <<'PYEOF'
import glob, json, sys
rows = []
for p in sorted(glob.glob(sys.argv[1] + "/sweep-*.json")):
    j = json.load(open(p))
    rows.append((j["sweep"]["setup"], j["sweep"]["rate"], j))
print("| setup | rate | done | p50 TTFT ms | p99 TTFT ms | p50 ITL ms | p99 ITL ms | goodput req/s | out tok/s |")
print("|---|---|---|---|---|---|---|---|---|")
for setup, rate, j in sorted(rows, key=lambda r: (r[0] != "colocated", r[1])):
    print("| %s | %g | %d/%d | %.0f | %.0f | %.1f | %.1f | %.2f | %.0f |" % (
        setup, rate, j["completed"], j["completed"] + j["failed"], j["median_ttft_ms"], j["p99_ttft_ms"],
        j["median_itl_ms"], j["p99_itl_ms"], j["request_goodput"] or 0, j["output_throughput"]))
PYEOF
  # one archive of the JSONs, the logs and the PNGs: the device tool brings back a limited
  # number of files (the 3 December run lost most of them to that count)
  tar czf "$OUT/sweep-results.tgz" -C "$OUT" sweep sweep-img && rm -rf "$OUT/sweep" "$OUT/sweep-img"
  check $? "the sweep's files archived in $OUT/sweep-results.tgz"
}
if [ "${ONLY:-}" = sweep ]; then
  sweep_steps
  step "summary"
  echo "gpu_check (ONLY=sweep): $fails failed step(s)"
  exit $((fails > 0))
fi
# ONLY=fp8: FP8 weights -- test_quant (e4m3 conversion, quantizer, quantization_config),
# test_backend_ops (the e4m3 GEMV for T <= 8 and the bf16-twin GEMM for larger T, per tensor /
# channel / 128x128 scales with partial blocks, against a host reference; again with
# DISAGG_CUDA_FP8_GEMV=0: every T on the twin), test_cuda_model (the tiny FP8 checkpoints on the
# GPU vs the CPU's dequantization), then `bench model --load-format dummy` on the Qwen2.5-7B and
# Llama-3.1-8B shapes in bf16 and with --quantization fp8 (dummy weights quantized at load in
# 128 x 128 blocks) one after the other in the same run; FP8_BENCH_ARGS replaces the
# benchmark's arguments (default: prefill of 4,096 tokens, decode at batch 1 and 32 at 4k).
fp8_steps() {
  step "fp8: test_quant (e4m3 table, quantizer, quantization_config)"
  "$BUILD/test_quant" 2>&1 | tail -3
  check ${PIPESTATUS[0]} test_quant
  for v in "" DISAGG_CUDA_FP8_GEMV=0 DISAGG_CUDA_FP8_TWIN=0; do
    step "fp8: test_backend_ops ${v:-(default: FP8 GEMV for T <= 8)}"
    env $v "$BUILD/test_backend_ops" > /tmp/tbo8.log 2>&1
    check $? "test_backend_ops ${v}"
    grep -E "fp8|FAILED|ERROR|PASSED" /tmp/tbo8.log | head -20
  done
  step "fp8: test_cuda_model (FP8 tiny checkpoints, GPU vs CPU)"
  "$BUILD/test_cuda_model" 2>&1 | grep -E "fp8|FAILED|ERROR|PASSED|OK"
  check ${PIPESTATUS[0]} "test_cuda_model (fp8)"
  step "fp8: per-op timing of eager 1-token steps, Qwen2.5-7B shape, fp8 (DISAGG_CUDA_PROF=1; before the benchmarks: the run may be cut)"
  DISAGG_CUDA_PROF=1 "$BIN" bench model "$SRC/bench/shapes/qwen2.5-7b" --device cuda --load-format dummy \
    --quantization fp8 --prompt-lens 16 --batches 1 2>&1 | grep -E "^prof|^1 "
  check ${PIPESTATUS[0]} "bench model 7b fp8, DISAGG_CUDA_PROF=1"
  for s in qwen2.5-7b llama-3.1-8b; do
    for q in none fp8; do
      step "fp8: bench model $s --load-format dummy --quantization $q"
      # shellcheck disable=SC2086
      "$BIN" bench model "$SRC/bench/shapes/$s" --device cuda --load-format dummy --quantization $q \
        ${FP8_BENCH_ARGS:---prompt-lens 4096 --batches 1,32 --long-context 4096}
      check $? "bench model $s --quantization $q (dummy weights)"
    done
  done
}
# tbo_with SETTINGS FILTER LOG WHAT GREP: test_backend_ops' tests matching FILTER with SETTINGS
# (env settings joined by commas; "" none) into LOG, checked as WHAT, the lines matching GREP shown
tbo_with() {
  # shellcheck disable=SC2086
  env ${1//,/ } TEST_BACKEND_OPS_FILTER="$2" "$BUILD/test_backend_ops" > "$3" 2>&1
  check $? "$4"
  grep -E "$5" "$3" | head -"${6:-30}"
}
# ONLY=fp8block: the W8A8 prefill GEMM on the FP8 tensor cores (the default; DISAGG_CUDA_FP8_GEMM=0 off;
# cuda_gemm_fp8.cu; 128 x 128 weight blocks only): test_backend_ops' FP8 cases against the
# emulation of the activation quantization (x in 128-column groups a token),
# (the activation scales tokens-contiguous, PyTorch's layout for these cuBLASLt modes),
# test_cuda_model's FP8 checkpoints (the block-quantized one at prefill) with it on, then the
# Qwen2.5-7B shape's prefill of 4,096 tokens with --quantization fp8 (dummy weights in 128 x 128
# blocks) with it off (the bf16 twin) and on, and the per-op table of a 512-token prefill.
fp8block_steps() {
  for v in DISAGG_CUDA_FP8_GEMM=1; do
    step "fp8block: test_backend_ops FP8 cases with $v"
    tbo_with "$v" 'test_*fp8*' /tmp/tbo-f8b.log "test_backend_ops fp8 cases, $v" \
      "W8A8|FAILED|ERROR|PASSED|cuBLASLt|cublasLt"
  done
  step "fp8block: test_cuda_model (FP8 tiny checkpoints, GPU vs CPU) with DISAGG_CUDA_FP8_GEMM=1"
  DISAGG_CUDA_FP8_GEMM=1 "$BUILD/test_cuda_model" 2>&1 | grep -E "fp8|FAILED|ERROR|PASSED|cuBLASLt"
  check ${PIPESTATUS[0]} "test_cuda_model, DISAGG_CUDA_FP8_GEMM=1"
  for m in 0 1; do
    step "fp8block: bench model qwen2.5-7b --quantization fp8, DISAGG_CUDA_FP8_GEMM=$m: prefill 4096"
    DISAGG_CUDA_FP8_GEMM=$m "$BIN" bench model "$SRC/bench/shapes/qwen2.5-7b" --device cuda \
      --load-format dummy --quantization fp8 --prompt-lens 512,4096 --batches 1 2>&1 |
      grep -E "^ceilings|^prefill|^ *[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+$|^[0-9]+ +[0-9]+ |rror|^cuda"
    check ${PIPESTATUS[0]} "bench model 7b fp8 prefill, DISAGG_CUDA_FP8_GEMM=$m"
  done
  step "fp8block: per-op timing of a 512-token prefill, 7B fp8, DISAGG_CUDA_FP8_GEMM=1"
  DISAGG_CUDA_FP8_GEMM=1 DISAGG_CUDA_PROF=512 "$BIN" bench model "$SRC/bench/shapes/qwen2.5-7b" --device cuda \
    --load-format dummy --quantization fp8 --prompt-lens 512 --batches 1 2>&1 | grep -E "^prof" | grep -v k_prefill_attention | head -24
}
# ONLY=fp8gemv: the tensor-core FP8 decode GEMV (DISAGG_CUDA_FP8_MMA, cuda_gemv_f8mma.cu; off by
# default) -- test_backend_ops' test_fp8_mma_gemv / _gate_up / _qkv (against a host
# reference, T 1..16, the 7B shapes), the FP8 cases and test_cuda_model's FP8 checkpoints with
# the switch on, then `bench model` on the Qwen2.5-7B shape with --quantization fp8 (per-channel
# scales, dummy weights) with the switch off and on: the copy ceiling of the run, decode b1 @ 4k,
# b1 and b16 @ 1k (CUDA graphs), and per-op tables of eager steps (DISAGG_CUDA_PROF=16:
# "prof:" lines, GB/s of each GEMV's FP8 bytes).  FP8GEMV_BENCH_ARGS replaces the bench's
# arguments; FP8GEMV_VARIANTS adds runs with the switch on and other settings (below).
fp8gemv_steps() {
  step "fp8gemv: test_backend_ops test_fp8_mma_* (the tensor-core FP8 GEMV vs a host reference)"
  tbo_with "" 'test_fp8_mma*' /tmp/tbo-f8mma.log "test_backend_ops test_fp8_mma_*" \
    "fp8 mma|FAILED|ERROR|PASSED|SKIP|tolerance" 150
  step "fp8gemv: test_backend_ops FP8 cases with DISAGG_CUDA_FP8_MMA=1"
  tbo_with DISAGG_CUDA_FP8_MMA=1 'test_*fp8*' /tmp/tbo-f8mma2.log \
    "test_backend_ops fp8 cases, DISAGG_CUDA_FP8_MMA=1" "FAILED|ERROR|PASSED|tolerance" 20
  # the kernel forms the default shapes do not take: 32-row warps with single-buffered loads,
  # and with double-buffered loads at 2 splits
  for v in DISAGG_CUDA_FP8_MMA_MT=2,DISAGG_CUDA_FP8_MMA_DB=0 \
           DISAGG_CUDA_FP8_MMA_MT=2,DISAGG_CUDA_FP8_MMA_DB=1,DISAGG_CUDA_FP8_MMA_SPLIT=2; do
    step "fp8gemv: test_backend_ops test_fp8_mma_* with $v"
    tbo_with "$v" 'test_fp8_mma*' /tmp/tbo-f8mma3.log "test_backend_ops test_fp8_mma_*, $v" \
      "FAILED|ERROR|PASSED|tolerance" 20
  done
  step "fp8gemv: test_cuda_model (FP8 tiny checkpoints, GPU vs CPU) with DISAGG_CUDA_FP8_MMA=1"
  DISAGG_CUDA_FP8_MMA=1 "$BUILD/test_cuda_model" 2>&1 | grep -E "fp8|FAILED|ERROR|PASSED|OK"
  check ${PIPESTATUS[0]} "test_cuda_model, DISAGG_CUDA_FP8_MMA=1"
  for m in 0 1; do
    step "fp8gemv: bench model qwen2.5-7b --quantization fp8, DISAGG_CUDA_FP8_MMA=$m (per-op: DISAGG_CUDA_PROF=16)"
    # shellcheck disable=SC2086
    DISAGG_CUDA_FP8_MMA=$m DISAGG_CUDA_PROF=16 "$BIN" bench model "$SRC/bench/shapes/qwen2.5-7b" \
      --device cuda --load-format dummy --quantization fp8 \
      ${FP8GEMV_BENCH_ARGS:---prompt-lens 16 --batches 1,16 --long-context 4096} 2>&1 |
      grep -E "^ceilings|^decode|^[0-9]+ +[0-9]+ |^prof|rror|^disagg|^cuda"
    check ${PIPESTATUS[0]} "bench model 7b fp8, DISAGG_CUDA_FP8_MMA=$m"
  done
  # FP8GEMV_VARIANTS: more runs with the switch on and these settings (an entry's settings
  # joined by commas, e.g. "DISAGG_CUDA_FP8_MMA_MT=1 DISAGG_CUDA_FP8_MMA_SPLIT=4,DISAGG_CUDA_FP8_MMA_MT=2")
  for v in ${FP8GEMV_VARIANTS:-}; do
    step "fp8gemv: bench model qwen2.5-7b --quantization fp8, DISAGG_CUDA_FP8_MMA=1 $v"
    # shellcheck disable=SC2086
    env ${v//,/ } DISAGG_CUDA_FP8_MMA=1 DISAGG_CUDA_PROF=16 "$BIN" bench model "$SRC/bench/shapes/qwen2.5-7b" \
      --device cuda --load-format dummy --quantization fp8 \
      ${FP8GEMV_BENCH_ARGS:---prompt-lens 16 --batches 1,16 --long-context 4096} 2>&1 |
      grep -E "^ceilings|^decode|^[0-9]+ +[0-9]+ |^prof|rror|^disagg|^cuda"
    check ${PIPESTATUS[0]} "bench model 7b fp8, DISAGG_CUDA_FP8_MMA=1 $v"
  done
}
# ONLY=decvar: the GEMVs' double-buffered load loop (DISAGG_CUDA_GEMV_DB: f8, the default, for
# FP8 weights; 1 for every GEMV; 0 off; the same sums in the same order): test_backend_ops and
# test_cuda_model with it on for every GEMV and off, then batch-1 decode at 4k (and batch 32)
# on the Llama-3.1-8B shape (bf16) and the Qwen2.5-7B shape with --quantization fp8 with each,
# the default run twice (first and last: the machine's drift within the run).  (The first run,
# 3 December, also had DISAGG_CUDA_ATT_FUSE=1 -- the attention's split combine in its last CTA:
# Llama b1 @ 4k 5.67 against 5.00 ms, removed.)
decvar_steps() {
  for v in 1 0; do
    step "decvar: test_backend_ops and test_cuda_model with DISAGG_CUDA_GEMV_DB=$v"
    DISAGG_CUDA_GEMV_DB=$v "$BUILD/test_backend_ops" > /tmp/tbo-dv.log 2>&1
    check $? "test_backend_ops, DISAGG_CUDA_GEMV_DB=$v"
    grep -E "FAILED|ERROR|PASSED" /tmp/tbo-dv.log | head -20
    DISAGG_CUDA_GEMV_DB=$v "$BUILD/test_cuda_model" 2>&1 | grep -E "FAILED|ERROR|PASSED"
    check ${PIPESTATUS[0]} "test_cuda_model, DISAGG_CUDA_GEMV_DB=$v"
  done
  for v in f8 1 f8; do
    step "decvar: bench model llama-3.1-8b (bf16), DISAGG_CUDA_GEMV_DB=$v"
    DISAGG_CUDA_GEMV_DB=$v "$BIN" bench model "$SRC/bench/shapes/llama-3.1-8b" --device cuda --load-format dummy \
      --prompt-lens 16 --batches 1,32 --long-context 4096 2>&1 | grep -E "^ceilings|^decode|^ *[0-9]+ +[0-9]+ |rror"
    check ${PIPESTATUS[0]} "bench model llama-3.1-8b, DISAGG_CUDA_GEMV_DB=$v"
  done
  for v in f8 0 f8; do
    step "decvar: bench model qwen2.5-7b --quantization fp8, DISAGG_CUDA_GEMV_DB=$v"
    DISAGG_CUDA_GEMV_DB=$v "$BIN" bench model "$SRC/bench/shapes/qwen2.5-7b" --device cuda --load-format dummy \
      --quantization fp8 --prompt-lens 16 --batches 1,32 --long-context 4096 2>&1 |
      grep -E "^ceilings|^decode|^ *[0-9]+ +[0-9]+ |rror"
    check ${PIPESTATUS[0]} "bench model 7b fp8, DISAGG_CUDA_GEMV_DB=$v"
  done
}
# ONLY=kvpool: the KV offload tiers and KV events on the GPU (docs/kv_pool.md): the tiers'
# tests with bf16 KV in HBM and --batch-invariant (answers with the pool equal to those
# without, disk faults recomputed; the asynchronous loads: a request served while another
# waits for its copies on the loader's CUDA stream, an abort during a load, copies declined
# by the cost model, the sync mode), the events' tests, then the multi-turn benchmark of
# tools/kv_pool_bench.py on the Qwen2.5-7B shape (dummy weights, the real tokenizer):
# KVPOOL_CONVERSATIONS (24) conversations x 8 turns of 800 corpus words (contexts growing to
# about 9k tokens), Poisson arrivals at KVPOOL_RATE (6) a second, 8 at a time, an HBM KV cache of
# KVPOOL_KV_BLOCKS (5000) blocks of 16 tokens: room for the 8 running conversations (the first
# H200 run, 3 December, had 1,536 blocks: too few for the running batch, so both configurations
# queued for KV space and the TTFT ratio was 2.0x) but not for the 24; no tiers, a host tier
# holding them all, a small host tier + the disk (KVPOOL_LOADS: auto; KVPOOL_BENCH_ARGS replaces the sizes); with KVPOOL_SLOW=1 then
# the tiny model's host tier with 2 ms more per copy (a slow medium: the step time of the others
# while a prefix loads, async against sync).
kvpool_steps() {
  step "kvpool: test_kv_offload.py + test_kv_events.py on the GPU"
  DISAGG_TEST_DEVICE=cuda DISAGG_BIN=$BIN python3 -m pytest -q -p no:cacheprovider \
    tests/integration/test_kv_offload.py tests/integration/test_kv_events.py 2>&1 | tail -15
  check ${PIPESTATUS[0]} "kv offload and events tests (cuda)"
  make_m7
  step "kvpool: tools/kv_pool_bench.py --device cuda, Qwen2.5-7B shape, multi-turn (none, host, disk)"
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 python3 tools/kv_pool_bench.py --bin "$BIN" --device cuda --model "$M7" \
    --serve-args "--load-format dummy" --loads "${KVPOOL_LOADS:-auto}" \
    ${KVPOOL_BENCH_ARGS:---conversations ${KVPOOL_CONVERSATIONS:-24} --turns 8 --user-words 800 --output-len 64 --request-rate ${KVPOOL_RATE:-6} --max-concurrency 8 --max-model-len 10240 --kv-blocks ${KVPOOL_KV_BLOCKS:-5000} --host-blocks 16000 --small-host-blocks 1024 --disk-blocks 16000} \
    --json "$OUT/kvpool_bench_7b.json"
  check $? "kv_pool_bench (cuda, 7B shape)"
  # the chat-like form: shorter user turns (300 words), more of them (18), contexts to ~8.5k
  # tokens, so a turn's new text is ~10 % of its prompt (the 800-word form: ~22 %); no tiers and
  # the host tier only (KVPOOL_NO_SHORT=1: skipped), at each rate of KVPOOL_SHORT_RATES ("6 12"
  # a second: the TTFT ratio depends on how loaded the instance without tiers is -- at 6 a
  # second the H200 prefills every whole prompt with time to spare, at 12 it cannot keep up,
  # which is where Mooncake's traces put it)
  if [ -z "${KVPOOL_NO_SHORT:-}" ]; then
    for rate in ${KVPOOL_SHORT_RATES:-6 12}; do
      step "kvpool: tools/kv_pool_bench.py --device cuda, 7B shape, 24 conversations x 18 turns of 300 words at $rate/s (none, host)"
      PYTHONUNBUFFERED=1 python3 tools/kv_pool_bench.py --bin "$BIN" --device cuda --model "$M7" \
        --serve-args "--load-format dummy" --configs none,host --conversations 24 --turns 18 --user-words 300 \
        --output-len 64 --request-rate "$rate" --max-concurrency 8 --max-model-len 10240 --kv-blocks 5000 \
        --host-blocks 16000 --json "$OUT/kvpool_bench_7b_short_r$rate.json"
      check $? "kv_pool_bench short turns at $rate/s (cuda, 7B shape)"
    done
  fi
  [ -n "${KVPOOL_SLOW:-}" ] || return 0
  step "kvpool: tools/kv_pool_bench.py --device cuda, tiny model, 2 ms more per copy (a slow medium)"
  python3 tools/kv_pool_bench.py --bin "$BIN" --device cuda --configs host --loads async,sync --copy always --load-delay-ms 2 \
    --conversations 32 --turns 8 --user-words 90 --output-len 64 --request-rate 8 --max-concurrency 8 --kv-blocks 160 --host-blocks 16384 \
    --json "$OUT/kvpool_bench_slow.json"
  check $? "kv_pool_bench slow medium (cuda)"
}
# ONLY=tierio: the disk tier's I/O on the GPU machine (docs/kv_pool.md, "Disk I/O"): the disk
# tests of test_kv_offload.py with the KV in HBM (O_DIRECT, tmpfs-buffered and synchronous
# writes: answers equal to no pool; a full write queue dropping; the faults), then
# tools/kv_pool_bench.py on the disk configuration: the writes on the writer thread against the
# step thread, the slab O_DIRECT against buffered (the load bandwidth from the disk), and the
# writes against a slow disk (5 ms more a write: the step time of the others while the host
# tier spills).  The slab lives under TIERIO_DISK_DIR (default: the system's temporary dir).
tierio_steps() {
  step "tierio: test_kv_offload.py disk tests on the GPU"
  DISAGG_TEST_DEVICE=cuda DISAGG_BIN=$BIN python3 -m pytest -q -p no:cacheprovider \
    tests/integration/test_kv_offload.py -k "disk or bad" 2>&1 | tail -15
  check ${PIPESTATUS[0]} "kv offload disk tests (cuda)"
  step "tierio: tools/kv_pool_bench.py --device cuda --configs disk (writes async/sync x O_DIRECT/buffered)"
  # shellcheck disable=SC2086
  python3 tools/kv_pool_bench.py --bin "$BIN" --device cuda --configs disk --writes async,sync \
    --direct-io auto,off ${TIERIO_DISK_DIR:+--disk-dir "$TIERIO_DISK_DIR"} ${KVPOOL_BENCH_ARGS:---conversations 32 --turns 8 --user-words 90 --output-len 64 --request-rate 8 --max-concurrency 8 --kv-blocks 160 --host-blocks 16384 --small-host-blocks 256 --disk-blocks 16384} \
    --json "$OUT/tierio_bench.json"
  check $? "kv_pool_bench disk I/O (cuda)"
  step "tierio: tools/kv_pool_bench.py --device cuda --configs disk, 5 ms more per disk write"
  # shellcheck disable=SC2086
  python3 tools/kv_pool_bench.py --bin "$BIN" --device cuda --configs disk --writes async,sync \
    --write-delay-ms 5 ${TIERIO_DISK_DIR:+--disk-dir "$TIERIO_DISK_DIR"} ${KVPOOL_BENCH_ARGS:---conversations 32 --turns 8 --user-words 90 --output-len 64 --request-rate 8 --max-concurrency 8 --kv-blocks 160 --host-blocks 16384 --small-host-blocks 256 --disk-blocks 16384} \
    --json "$OUT/tierio_bench_slow.json"
  check $? "kv_pool_bench slow disk (cuda)"
}
# ONLY=poolfetch: the pool fetch across instances on the GPU (docs/kv_pool.md): its tests with
# the KV in HBM (a prefix fetched equals recompute, evicted / dead / stopped holders recomputed,
# the proxy naming the holder), then tools/pool_fetch_bench.py (TTFT of a moved conversation,
# fetched vs recomputed) over tcp (staged through host memory) and rdma (no NIC here: the
# transfer engine's auto path, cuda_ipc between the two processes' HBM).
poolfetch_steps() {
  step "poolfetch: test_kv_pool_fetch.py on the GPU"
  DISAGG_TEST_DEVICE=cuda DISAGG_BIN=$BIN python3 -m pytest -q -p no:cacheprovider \
    tests/integration/test_kv_pool_fetch.py 2>&1 | tail -15
  check ${PIPESTATUS[0]} "pool fetch tests (cuda)"
  make_m7
  for proto in tcp rdma; do
    step "poolfetch: tools/pool_fetch_bench.py --device cuda --protocol $proto, Qwen2.5-7B shape"
    # shellcheck disable=SC2086
    python3 tools/pool_fetch_bench.py --bin "$BIN" --device cuda --protocol $proto --model "$M7" \
      --serve-args "--load-format dummy" --threads 0 \
      ${POOLFETCH_BENCH_ARGS:---reps 3 --lengths 256,1024,4000,8000 --max-model-len 8448 --kv-cache-memory 8G} \
      --json "$OUT/poolfetch_bench_$proto.json"
    check $? "pool_fetch_bench (cuda, $proto)"
  done
}
# ONLY=pending: what the 4 December session wrote without device time, checked in one call --
# the MoE grouped GEMM's small M tiles (test_backend_ops' MoE cases and test_backend_ops_moe
# with the grouped GEMM at every T and each tile, then their layer times: moevar_steps),
# test_cuda_model (the block-FP8 checkpoint at K % 512 on the W8A8 GEMM among the rest), and
# the KV pool's tests on the GPU with the batched loader (test_kv_offload.py, test_kv_events.py,
# test_kv_pool_multiturn.py) before its benchmark (kvpool_steps).
pending_steps() {
  moevar_steps
  step "pending: test_cuda_model (FP8 checkpoints incl. qwen2-fp8-block512-tiny on the W8A8 GEMM)"
  "$BUILD/test_cuda_model" 2>&1 | grep -E "model .*fp8|FAILED|ERROR|PASSED|OK"
  check ${PIPESTATUS[0]} "test_cuda_model"
  step "pending: test_kv_pool_multiturn.py on the GPU"
  DISAGG_TEST_DEVICE=cuda DISAGG_BIN=$BIN python3 -m pytest -q -p no:cacheprovider \
    tests/integration/test_kv_pool_multiturn.py 2>&1 | tail -5
  check ${PIPESTATUS[0]} "kv pool multi-turn test (cuda)"
  kvpool_steps
}
if [ "${ONLY:-}" = pending ]; then
  pending_steps
  step "summary"
  echo "gpu_check (ONLY=pending): $fails failed step(s)"
  exit $((fails > 0))
fi
if [ "${ONLY:-}" = inv ] || [ "${ONLY:-}" = kv ] || [ "${ONLY:-}" = prefill ] || [ "${ONLY:-}" = arch ] ||
   [ "${ONLY:-}" = profile ] || [ "${ONLY:-}" = fp8kv ] || [ "${ONLY:-}" = fp8 ] || [ "${ONLY:-}" = fp8gemv ] ||
   [ "${ONLY:-}" = stream ] || [ "${ONLY:-}" = kvpool ] || [ "${ONLY:-}" = poolfetch ] ||
   [ "${ONLY:-}" = tierio ] || [ "${ONLY:-}" = fp8block ] || [ "${ONLY:-}" = decvar ]; then
  [ "$ONLY" = fp8block ] && fp8block_steps
  [ "$ONLY" = decvar ] && decvar_steps
  [ "$ONLY" = kvpool ] && kvpool_steps
  [ "$ONLY" = tierio ] && tierio_steps
  [ "$ONLY" = poolfetch ] && poolfetch_steps
  [ "$ONLY" = profile ] && profile_steps
  [ "$ONLY" = fp8kv ] && fp8kv_steps
  [ "$ONLY" = fp8 ] && fp8_steps
  [ "$ONLY" = fp8gemv ] && fp8gemv_steps
  [ "$ONLY" = arch ] && arch_steps
  [ "$ONLY" = stream ] && stream_steps
  [ "$ONLY" = inv ] && inv_steps
  [ "$ONLY" = kv ] && kv_steps
  [ "$ONLY" = prefill ] && prefill_steps
  step "summary"
  echo "gpu_check (ONLY=$ONLY): $fails failed step(s)"
  exit $((fails > 0))
fi

step "GPU parity test (ops and whole model vs CPU, greedy vs golden, serving path CUDA graphs vs eager)"
"$BUILD/test_cuda_model"
check $? test_cuda_model

tp_steps

step "backend parity test (every kernels/backend.h op, CUDA vs reference)"
"$BUILD/test_backend_ops"
check $? test_backend_ops

step "backend parity test (the MoE ops, CUDA and its generic form vs reference and torch)"
"$BUILD/test_backend_ops_moe"
check $? test_backend_ops_moe

if [ -z "${QUICK:-}" ]; then
step "GPU parity test with the small-batch GEMV off (DISAGG_CUDA_GEMV=0: cuBLASLt for 1 token too)"
DISAGG_CUDA_GEMV=0 "$BUILD/test_cuda_model" 2>&1 | grep -E "matmul|graph|OK|FAILED|PASSED|ERROR"
check ${PIPESTATUS[0]} "test_cuda_model with DISAGG_CUDA_GEMV=0"
fi

step "serve on the GPU (disagg serve --device cuda vs --device cpu, concurrent batching, CUDA graphs vs --enforce-eager)"
python3 tools/gpu_serve_smoke.py "$BIN" "$SRC/models/disagg-sotu-tiny" "$OUT"
check $? gpu_serve_smoke

step "bench model: default model on the GPU"
"$BIN" bench model models/disagg-sotu-tiny --device cuda
check $? "bench model sotu-tiny --device cuda"

step "bench model: 7B-shaped random bf16 weights"
[ -f "$W7/model.safetensors.index.json" ] || python3 tools/gen_random_qwen2_gpu.py --out "$W7" --shape 7b
check $? "gen_random_qwen2_gpu 7b"
"$BIN" bench model "$W7" --device cuda ${BENCH_ARGS:-}
check $? "bench model 7b --device cuda"
# MAIN_DECODE_VARIANTS: decode at batch 1 and 8 with each listed setting (commas join several),
# in the same run as the table above (an A/B of a default without PERF_VARIANTS' full list)
for v in ${MAIN_DECODE_VARIANTS:-}; do
  echo "--- decode with $v:"
  env ${v//,/ } "$BIN" bench model "$W7" --device cuda --prompt-lens 16 --batches 1,8 2>&1 | sed -n '/^decode/,/^$/p' | grep -v '^$'
  check ${PIPESTATUS[0]} "bench model 7b --device cuda, $v"
done
if [ -n "${PERF_VARIANTS:-}" ]; then
for v in DISAGG_CUDA_GEMV=0 DISAGG_CUDA_GEMV=2 DISAGG_CUDA_PDL=0 DISAGG_CUDA_NORM_PDL=0 DISAGG_CUDA_QKV_FUSE=0 DISAGG_CUDA_GEMV_WARPS=8 DISAGG_CUDA_GEMV_WARPS=2; do
  echo "--- decode with $v:"
  env "$v" "$BIN" bench model "$W7" --device cuda --prompt-lens 512 --batches 1,8,32 2>&1 | sed -n '/^decode/,/^$/p'
  check ${PIPESTATUS[0]} "bench model 7b --device cuda, $v"
done
echo "--- prefill on the 8-warp kernel for every grid (DISAGG_CUDA_FLASH_MT=1):"
DISAGG_CUDA_FLASH_MT=1 "$BIN" bench model "$W7" --device cuda --prompt-lens 512,4096 --batches 1 2>&1 | sed -n '/^prefill/,/^$/p'
check ${PIPESTATUS[0]} "bench model 7b --device cuda, DISAGG_CUDA_FLASH_MT=1"
fi

step "bench serve: disagg serve --device cuda on the 7B-shaped weights (real Qwen2.5 tokenizer), concurrency 1, 16, 64"
python3 tools/gpu_bench_serve.py "$BIN" "$W7" "${TMPDIR:-/tmp}/gpu-bench-serve"
check $? "bench serve 7b --device cuda"
if [ -z "${QUICK:-}" ]; then
echo "--- batch 1 and 8 without the small-batch GEMV (DISAGG_CUDA_GEMV=0), eager and CUDA graphs:"
DISAGG_CUDA_GEMV=0 "$BIN" bench model "$W7" --device cuda --prompt-lens 512 --batches 1,8 2>&1 | sed -n '/^decode/,$p'
check ${PIPESTATUS[0]} "bench model 7b --device cuda, DISAGG_CUDA_GEMV=0"
fi

if [ -z "${QUICK:-}" ]; then
step "Hugging Face transformers references on the GPU"
TINY=$(ls -d "${TMPDIR:-/tmp}"/disagg-test-models-"$(id -u)"/tiny-bf16-* 2>/dev/null | head -1)
python3 tools/gpu_hf_reference.py --out "$OUT/ref" --model sotu-tiny=models/disagg-sotu-tiny \
  ${TINY:+--model tiny-bf16=$TINY}
check $? gpu_hf_reference
DISAGG_GPU_REF_DIR=$OUT/ref "$BUILD/test_cuda_model" 2>&1 | grep -v "^  \(attention\|matmul\|rmsnorm\|rope\|swiglu\)"
check ${PIPESTATUS[0]} "test_cuda_model against HF on the GPU"
fi

inv_steps

step "integration: tests/integration/test_device.py"
DISAGG_BIN=$BIN python3 -m pytest -q -p no:cacheprovider tests/integration/test_device.py 2>&1 | tail -5
check ${PIPESTATUS[0]} test_device.py
if [ -n "${TEST_DEVICE_SUITE:-}" ]; then
step "integration: the server tests against disagg serve --device cuda (DISAGG_TEST_DEVICE=cuda)"
DISAGG_TEST_DEVICE=cuda DISAGG_BIN=$BIN python3 -m pytest -q -p no:cacheprovider \
  tests/integration/test_server_api.py tests/integration/test_server_logprobs.py \
  tests/integration/test_server_errors.py 2>&1 | tail -15
check ${PIPESTATUS[0]} "server tests with DISAGG_TEST_DEVICE=cuda"
else
echo "DISAGG_TEST_DEVICE=cuda for the server tests: TEST_DEVICE_SUITE=1 runs them (not yet run on a GPU; see docs/gpu.md)"
fi

kv_steps

step "summary"
echo "gpu_check: $fails failed step(s)"
exit $((fails > 0))
