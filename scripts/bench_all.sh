#!/usr/bin/env bash
# Reproduces every number of docs/benchmarks.md in one go (about 15 minutes on
# the 2-core machine; run it on a quiet machine: each table compares with a
# ceiling or a baseline measured in the same run).  Output: bench-results/;
# at the end it redraws docs/img/*.png and docs/img/benchmarks.json from it
# (tools/plot_benchmarks.py; the GPU figures are kept from benchmarks.json).
#   scripts/bench_all.sh [MODEL_0.5B_DIR]     (generated if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
B=build/disagg
OUT=${OUT:-bench-results}
mkdir -p "$OUT"
M=${1:-/tmp/disagg-qwen2-0.5b-random}
TTFT_LENS=${TTFT_LENS:-128 256 512 1024}
[ -f "$M/model.safetensors" ] || python3 tools/gen_random_qwen2.py --out "$M" --shape 0.5b --dtype bf16
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_health() { for _ in $(seq 1 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done; echo "not ready: $1" >&2; return 1; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

echo "== load: $(uptime)" | tee "$OUT/uptime.txt"

echo "== transfer engine"
$B bench transfer --protocol tcp,shm --operation read,write | tee "$OUT/transfer.txt"

echo "== model runtime"
$B bench model "$M" --prompt-len 512 --gen-len 32 --threads 2 | tee "$OUT/model.txt"

echo "== server: 1, 2, 4 and 8 concurrent streams, 0.5B-shape bf16"
C=$(free_port)
$B serve "$M" --host 127.0.0.1 --port "$C" --kv-cache-memory 2G --max-model-len 2048 --threads 2 \
  --served-model-name m >"$OUT/serve-colocated.log" 2>&1 & pids+=($!)
wait_health "http://127.0.0.1:$C"
for conc in 1 2 4 8; do
  $B bench serve --base-url "http://127.0.0.1:$C" --random-input-len 64 --random-output-len 64 \
    --num-prompts 8 --max-concurrency $conc --ignore-eos --disable-tqdm --json "$OUT/serve-c$conc.json" \
    | tee "$OUT/serve-c$conc.txt"
done

echo "== P/D: colocated vs prefill + decode at concurrency 1, 512-token prompts"
P=$(free_port); D=$(free_port); BP=$(free_port)
VLLM_MOONCAKE_BOOTSTRAP_PORT=$BP $B serve "$M" --host 127.0.0.1 --port "$P" --kv-cache-memory 2G \
  --max-model-len 2048 --threads 2 --served-model-name m --kv-transfer-config \
  '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer","kv_connector_extra_config":{"mooncake_protocol":"tcp"}}' \
  >"$OUT/serve-p.log" 2>&1 & pids+=($!)
$B serve "$M" --host 127.0.0.1 --port "$D" --kv-cache-memory 2G --max-model-len 2048 --threads 2 \
  --served-model-name m --kv-transfer-config \
  '{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"mooncake_protocol":"tcp"}}' \
  >"$OUT/serve-d.log" 2>&1 & pids+=($!)
wait_health "http://127.0.0.1:$P"; wait_health "http://127.0.0.1:$D"
$B bench serve --base-url "http://127.0.0.1:$C" --random-input-len 512 --random-output-len 16 --num-prompts 4 \
  --max-concurrency 1 --ignore-eos --disable-tqdm --seed 7 --json "$OUT/pd-colocated.json" | tee "$OUT/pd-colocated.txt"
$B bench serve --base-url "http://127.0.0.1:$D" --pd-prefill "http://127.0.0.1:$P" \
  --pd-bootstrap "http://127.0.0.1:$BP" --random-input-len 512 --random-output-len 16 --num-prompts 4 \
  --max-concurrency 1 --ignore-eos --disable-tqdm --seed 7 --json "$OUT/pd.json" | tee "$OUT/pd.txt"

echo "== TTFT against prompt length (the plots): colocated and P/D, concurrency 1"
# warm-up (other prompts: the seed differs, so nothing below hits the prefix cache)
$B bench serve --base-url "http://127.0.0.1:$C" --random-input-len 32 --random-output-len 2 --num-prompts 1 \
  --ignore-eos --disable-tqdm --seed 99 >/dev/null
$B bench serve --base-url "http://127.0.0.1:$D" --pd-prefill "http://127.0.0.1:$P" --pd-bootstrap "http://127.0.0.1:$BP" \
  --random-input-len 32 --random-output-len 2 --num-prompts 1 --ignore-eos --disable-tqdm --seed 99 >/dev/null
for len in $TTFT_LENS; do
  $B bench serve --base-url "http://127.0.0.1:$C" --random-input-len "$len" --random-output-len 4 --num-prompts 3 \
    --max-concurrency 1 --ignore-eos --disable-tqdm --seed 9 --json "$OUT/ttft-colocated-$len.json" >/dev/null
  $B bench serve --base-url "http://127.0.0.1:$D" --pd-prefill "http://127.0.0.1:$P" \
    --pd-bootstrap "http://127.0.0.1:$BP" --random-input-len "$len" --random-output-len 4 --num-prompts 3 \
    --max-concurrency 1 --ignore-eos --disable-tqdm --seed 9 --json "$OUT/ttft-pd-$len.json" >/dev/null
  echo "prompt $len: colocated $(python3 -c "import json;print(round(json.load(open('$OUT/ttft-colocated-$len.json'))['mean_ttft_ms']))") ms, P/D $(python3 -c "import json;print(round(json.load(open('$OUT/ttft-pd-$len.json'))['mean_ttft_ms']))") ms"
done | tee "$OUT/ttft.txt"

echo "== proxy"
$B bench proxy | tee "$OUT/proxy.txt"
echo "== load: $(uptime)" | tee -a "$OUT/uptime.txt"

echo "== plots: docs/img/*.png from $OUT (tools/plot_benchmarks.py)"
python3 tools/plot_benchmarks.py --results "$OUT" --out docs/img
