#!/usr/bin/env python3
"""kv_pool_bench — the multi-turn benchmark of docs/kv_pool.md with and without the KV
offload tiers: one `disagg serve` per configuration (a KV cache too small for the
conversations), `disagg bench serve --dataset-name custom` with a multi-turn file from
tools/gen_multiturn_dataset.py, then /metrics: where the prompt tokens came from (the
device prefix cache, the host tier, the disk tier, computed) and TTFT P50/P90.

  tools/kv_pool_bench.py [--bin build/disagg] [--model models/disagg-sotu-tiny]
      [--conversations 16] [--turns 8] [--user-words 80] [--output-len 24]
      [--kv-blocks 128] [--block-size 16] [--max-model-len 2048]
      [--configs none,host,disk] [--loads auto[,async,sync]] [--load-delay-ms MS]
      [--copy cost|always] [--writes async[,sync]] [--direct-io auto[,off]]
      [--write-delay-ms MS] [--disk-dir DIR] [--serve-args "ARGS"] [--corpus FILE]
      [--json out.json]

--loads runs each tier configuration with DISAGG_KV_OFFLOAD_LOADS = auto (the default: copies
estimated under a tenth of a step inline, the others on the loader thread), async (every copy
on the loader thread) and/or sync (every copy on the step thread, the comparison);
--load-delay-ms makes each copy wait that long first (DISAGG_KV_OFFLOAD_LOAD_DELAY_MS: a slow
medium); --copy always copies every tier hit back (DISAGG_KV_OFFLOAD_COPY), cost lets the
copy-or-recompute model decide.  "wait ms" is the mean time a request waited for its copies;
ITL is the inter-token latency of every stream (the other requests' steps while one loads).

--writes runs the 'disk' configuration with the disk writes on the tiers' writer thread
(async, the default) and/or on the step thread (sync, DISAGG_KV_OFFLOAD_WRITES: the host tier's
victim written before the step goes on); --direct-io with the slab opened O_DIRECT where the
filesystem takes it (auto) and/or buffered through the page cache (off,
DISAGG_KV_OFFLOAD_DIRECT_IO); --write-delay-ms makes each disk write wait that long first (a
slow disk); --disk-dir puts the slab there (default: under the system's temporary directory).
"drops" counts the disk copies dropped because the write queue was full; "step thread in disk
stores" is the time the step thread spent handing the host tier's victims to the disk (the
write itself when sync, the copy into a write buffer when async).

--serve-args adds arguments to every `disagg serve` (e.g. "--load-format dummy" with a model
folder holding a shape's config.json and a tokenizer: bench/shapes/); --corpus is the dataset
tool's text (default: the State of the Union corpus beside the checkout).

Prints a Markdown table (docs/benchmarks.md); timings are measurements, not checks.
Device runs: --device cuda plus a 7B model and larger sizes (docs/kv_pool.md)."""
import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from ports import free_port  # noqa: E402  (ports outside the ephemeral range, never twice)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




def metrics(url):
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = out.get(k, 0.0) + float(v)
    return out


def metric(ms, name, tier=None):
    return sum(v for k, v in ms.items()
               if k.split("{")[0] == name and (tier is None or f'tier="{tier}"' in k))


def block_bytes(model, block_size, dtype_bytes):
    c = json.load(open(os.path.join(model, "config.json")))
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * block_size * c["num_key_value_heads"] * hd * dtype_bytes


def run(a, name, extra, dataset, tmp, env=None):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    bb = block_bytes(a.model, a.block_size, a.kv_bytes)
    args = [a.bin, "serve", a.model, "--host", "127.0.0.1", "--port", str(port),
            "--block-size", str(a.block_size), "--max-model-len", str(a.max_model_len),
            "--kv-cache-memory", str(a.kv_blocks * bb), "--device", a.device] + extra + \
        shlex.split(a.serve_args)
    if a.device != "cpu":
        args += ["--kv-cache-dtype", "bfloat16"]
    if a.threads:
        args += ["--threads", str(a.threads)]
    log = open(os.path.join(tmp, f"serve-{name}.log"), "w")
    p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                         env=dict(os.environ, **(env or {})))
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        else:
            raise SystemExit(f"{name}: the server did not start; see {log.name}")
        out = os.path.join(tmp, f"bench-{name}.json")
        subprocess.run([a.bench_bin, "bench", "serve", "--base-url", url, "--dataset-name",
                        "custom", "--dataset-path", dataset, "--num-prompts",
                        str(a.conversations), "--custom-output-len", str(a.output_len),
                        "--ignore-eos", "--request-rate", str(a.request_rate),
                        "--max-concurrency", str(a.max_concurrency), "--seed", "0",
                        "--json", out], check=True, stdout=subprocess.DEVNULL)
        res = json.load(open(out))
        ms = metrics(url)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    prompt = res["total_input_tokens"]
    # cached prompt tokens of the finished requests (device cache or a tier), less the tiers'
    # loads: vllm:prefix_cache_hits counts every admission attempt's lookups, not tokens served
    cached = sum(v for k, v in ms.items() if k.startswith("vllm:prompt_tokens_by_source_total")
                 and 'source="local_cache_hit"' in k)
    dev = cached - a.block_size * metric(ms, "disagg:kv_offload_blocks_loaded_total")
    host = a.block_size * metric(ms, "disagg:kv_offload_blocks_loaded_total", "host")
    disk = a.block_size * metric(ms, "disagg:kv_offload_blocks_loaded_total", "disk")
    return {
        "config": name, "requests": res["completed"], "prompt_tokens": prompt,
        "device_hit": dev / prompt, "host_hit": host / prompt, "disk_hit": disk / prompt,
        "computed": metric(ms, "vllm:prompt_tokens_total") / prompt,
        "evicted_blocks": metric(ms, "disagg:kv_cache_evicted_blocks_total"),
        "ttft_p50_ms": res["median_ttft_ms"], "ttft_p90_ms": res.get("p90_ttft_ms"),
        "output_tok_s": res["output_throughput"],
        "load_ms_per_block": 1000 * metric(ms, "disagg:kv_offload_load_seconds_total") /
        max(1.0, metric(ms, "disagg:kv_offload_blocks_loaded_total")),
        "corrupt": metric(ms, "disagg:kv_offload_corrupt_blocks_total"),
        "ttft_p99_ms": res.get("p99_ttft_ms"),
        "itl_p50_ms": res.get("median_itl_ms"), "itl_p99_ms": res.get("p99_itl_ms"),
        "load_wait_ms": 1000 * metric(ms, "disagg:kv_offload_load_wait_seconds_total") /
        max(1.0, metric(ms, "disagg:kv_offload_load_waits_total")),
        "declined": metric(ms, "disagg:kv_offload_blocks_declined_total"),
        "steps_during_loads": metric(ms, "disagg:kv_offload_steps_during_loads_total"),
        "disk_load_ms_per_block": 1000 * metric(ms, "disagg:kv_offload_load_seconds_total", "disk") /
        max(1.0, metric(ms, "disagg:kv_offload_blocks_loaded_total", "disk")),
        "disk_load_mb_s": metric(ms, "disagg:kv_offload_bytes_loaded_total", "disk") / 1e6 /
        max(1e-9, metric(ms, "disagg:kv_offload_load_seconds_total", "disk")),
        "disk_stored": metric(ms, "disagg:kv_offload_blocks_stored_total", "disk"),
        "writes_dropped": metric(ms, "disagg:kv_offload_writes_dropped_total"),
        "direct_io": metric(ms, "disagg:kv_offload_disk_direct_io"),
        "disk_store_s": metric(ms, "disagg:kv_offload_store_seconds_total", "disk"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "disagg"))
    ap.add_argument("--bench-bin", default=None, help="the bench client (default --bin)")
    ap.add_argument("--dataset-tool", default=os.path.join(ROOT, "tools", "gen_multiturn_dataset.py"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "disagg-sotu-tiny"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-words", type=int, default=80)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--request-rate", type=float, default=4)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=128, help="the device KV cache, in blocks")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--host-blocks", type=int, default=4096)
    ap.add_argument("--small-host-blocks", type=int, default=64, help="the host tier of 'disk'")
    ap.add_argument("--disk-blocks", type=int, default=4096)
    ap.add_argument("--configs", default="none,host,disk")
    ap.add_argument("--loads", default="auto", help="auto, async, sync or several (auto,async,sync)")
    ap.add_argument("--load-delay-ms", type=int, default=0)
    ap.add_argument("--copy", default="cost", choices=["cost", "always"])
    ap.add_argument("--writes", default="async", help="async, sync or both (async,sync)")
    ap.add_argument("--direct-io", default="auto", help="auto, off or both (auto,off)")
    ap.add_argument("--write-delay-ms", type=int, default=0)
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument("--serve-args", default="", help="more `disagg serve` arguments")
    ap.add_argument("--corpus", default=None, help="the dataset tool's --corpus")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.bench_bin = a.bench_bin or a.bin
    a.kv_bytes = 4 if a.device == "cpu" else 2  # f32 KV on the CPU, bf16 on CUDA
    tmp = tempfile.mkdtemp(prefix="kv-pool-bench-")
    dataset = os.path.join(tmp, "multiturn.jsonl")
    subprocess.run([sys.executable, a.dataset_tool, "--out", dataset, "--conversations",
                    str(a.conversations), "--turns", str(a.turns), "--user-words",
                    str(a.user_words)] + (["--corpus", a.corpus] if a.corpus else []),
                   check=True, stdout=subprocess.DEVNULL)
    bb = block_bytes(a.model, a.block_size, a.kv_bytes)
    gib = lambda blocks, size=bb: repr(blocks * size / 2**30)
    stride = (64 + bb + 4095) // 4096 * 4096
    disk_dir = tempfile.mkdtemp(prefix="kv-pool-bench-disk-", dir=a.disk_dir)
    cfgs = {
        "none": [],
        "host": ["--kv-offloading-size", gib(a.host_blocks)],
        "disk": ["--kv-offloading-size", gib(a.small_host_blocks), "--kv-offloading-disk",
                 disk_dir, "--kv-offloading-disk-size", gib(a.disk_blocks, stride)],
    }
    rows = []
    for c in a.configs.split(","):
        for mode in (["auto"] if c == "none" else a.loads.split(",")):
            for wr in (a.writes.split(",") if c == "disk" else ["async"]):
                for dio in (a.direct_io.split(",") if c == "disk" else ["auto"]):
                    env = {"DISAGG_KV_OFFLOAD_LOADS": mode, "DISAGG_KV_OFFLOAD_COPY": a.copy,
                           "DISAGG_KV_OFFLOAD_LOAD_DELAY_MS": str(a.load_delay_ms),
                           "DISAGG_KV_OFFLOAD_WRITES": wr, "DISAGG_KV_OFFLOAD_DIRECT_IO": dio,
                           "DISAGG_KV_OFFLOAD_WRITE_DELAY_MS": str(a.write_delay_ms)}
                    name = c
                    if c != "none" and a.loads != "auto":
                        name += f" {mode}"
                    if c == "disk" and a.writes != "async":
                        name += f" writes={wr}"
                    if c == "disk" and a.direct_io != "auto":
                        name += f" io={dio}"
                    rows.append(run(a, name.replace(" ", "-").replace("=", "-"), cfgs[c],
                                    dataset, tmp, env))
                    rows[-1]["config"] = name
    print(f"{a.conversations} conversations x {a.turns} turns x {a.user_words} words, "
          f"{a.output_len}-token answers, rate {a.request_rate}/s, concurrency "
          f"{a.max_concurrency}; KV cache {a.kv_blocks} blocks of {a.block_size} tokens; "
          f"host tier {a.host_blocks} blocks ('disk': {a.small_host_blocks} + disk "
          f"{a.disk_blocks}); copies {a.copy}, {a.load_delay_ms} ms extra a copy, "
          f"{a.write_delay_ms} ms extra a disk write; slab in {disk_dir}\n")
    print("| tiers | prompt tokens | device hit | host hit | disk hit | computed | "
          "device evictions | TTFT P50 ms | TTFT P90 ms | out tok/s | load ms/block | "
          "wait ms | ITL P50 ms | ITL P99 ms | declined |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['prompt_tokens']} | {r['device_hit']:.1%} | "
              f"{r['host_hit']:.1%} | {r['disk_hit']:.1%} | {r['computed']:.1%} | "
              f"{r['evicted_blocks']:.0f} | {r['ttft_p50_ms']:.1f} | "
              f"{r['ttft_p90_ms'] or 0:.1f} | {r['output_tok_s']:.1f} | "
              f"{r['load_ms_per_block']:.3f} | {r['load_wait_ms']:.2f} | "
              f"{r['itl_p50_ms'] or 0:.1f} | {r['itl_p99_ms'] or 0:.1f} | {r['declined']:.0f} |")
    if any(r["config"].startswith("disk") for r in rows):
        print("\n| disk config | O_DIRECT | disk blocks stored | drops | disk loads | "
              "disk load ms/block | disk load MB/s | step thread in disk stores ms | ITL P50 ms | "
              "ITL P99 ms |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r["config"].startswith("disk"):
                print(f"| {r['config']} | {'yes' if r['direct_io'] else 'no'} | "
                      f"{r['disk_stored']:.0f} | {r['writes_dropped']:.0f} | "
                      f"{r['disk_hit'] * r['prompt_tokens'] / a.block_size:.0f} | "
                      f"{r['disk_load_ms_per_block']:.3f} | {r['disk_load_mb_s']:.0f} | "
                      f"{1000 * r['disk_store_s']:.1f} | "
                      f"{r['itl_p50_ms'] or 0:.2f} | {r['itl_p99_ms'] or 0:.2f} |")
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(disk_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
