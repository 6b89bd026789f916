#!/usr/bin/env python3
"""pool_fetch_bench — TTFT of a conversation moved to another instance: its prefix fetched
from the instance that holds it (kv_transfer_params.pool_source, docs/kv_pool.md) against
computed again.  Two kv_both `disagg serve` instances A and B (tcp transport by default);
per prompt length: A computes the conversation's history (its prefix cache holds it), then
B answers the next turn (the history + --new-tokens) twice, its own cache emptied each time:
once computing the whole prompt, once with A as its pool source.  TTFT is measured by the
client (streamed, time to the first token); the median of --reps distinct conversations.

  tools/pool_fetch_bench.py [--bin build/disagg] [--model models/disagg-sotu-tiny]
      [--lengths 256,512,1024,2000] [--reps 5] [--new-tokens 16] [--threads 2]
      [--protocol tcp] [--device cpu|cuda] [--json out.json]

Prints a Markdown table (docs/benchmarks.md); timings are measurements, not checks.  The
instances run with pool_fetch "always" (the cost rule of "auto" would decide by itself)."""
import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time

import requests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from ports import free_port  # noqa: E402  (ports outside the ephemeral range, never twice)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("The state of the Union is strong, and the work of the Congress is before us. "
        "We meet in a season of change, and the people ask that we keep faith with them. ")




def metric(url, name):
    total = 0.0
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Instance:
    def __init__(self, args, engine_id):
        self.engine_id = engine_id
        self.port, self.bport = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = {"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "engine_id": engine_id,
               "kv_connector_extra_config": {"mooncake_protocol": args.protocol,
                                             "pool_fetch": "always"}}
        cmd = [args.bin, "serve", args.model, "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "m", "--max-model-len", str(args.max_model_len),
               "--block-size", str(args.block_size), "--kv-transfer-config", json.dumps(cfg),
               "--device", args.device]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.kv_cache_memory:
            cmd += ["--kv-cache-memory", args.kv_cache_memory]
        cmd += shlex.split(args.serve_args)
        env = dict(os.environ, VLLM_MOONCAKE_BOOTSTRAP_PORT=str(self.bport))
        self.log = open(f"/tmp/pool-fetch-bench-{engine_id}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{engine_id} exited: see {self.log.name}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        sys.exit(f"{engine_id} did not become ready")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def ttft(url, prompt, kv=None):
    """Seconds to the first streamed token."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    if kv:
        body["kv_transfer_params"] = kv
    t0 = time.perf_counter()
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        if r.status_code != 200:
            sys.exit(f"HTTP {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                return time.perf_counter() - t0
    sys.exit("no token streamed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "disagg"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "disagg-sotu-tiny"))
    ap.add_argument("--lengths", default="256,512,1024,2000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="256M")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--serve-args", default="",
                    help='more `disagg serve` arguments (e.g. "--load-format dummy")')
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.device != "cpu":
        args.threads = 0
    a = Instance(args, "bench-a")
    b = None
    rows = []
    try:
        b = Instance(args, "bench-b")
        source = {"remote_engine_id": a.engine_id,
                  "remote_bootstrap_addr": f"http://127.0.0.1:{a.bport}"}
        lengths = [int(x) for x in args.lengths.split(",")]
        reps = 400
        while True:  # a text long enough for the longest history and the new turn
            base = requests.post(a.url + "/tokenize", json={"model": "m", "prompt": TEXT * reps},
                                 timeout=60).json()["tokens"]
            if len(base) >= max(lengths) + args.new_tokens + 64:
                break
            reps *= 2
        for n in lengths:
            rec, fet = [], []
            blocks0 = metric(b.url, "disagg:kv_pool_fetch_blocks_total")
            bytes0 = metric(b.url, "disagg:kv_pool_fetch_bytes_total")
            for rep in range(args.reps):
                head = requests.post(a.url + "/tokenize", timeout=60, json={
                    "model": "m", "prompt": f"Conversation {n}-{rep}:"}).json()["tokens"]
                hist = (head + base)[:n]
                turn = hist + base[-args.new_tokens:]
                requests.post(a.url + "/v1/completions", timeout=600, json={
                    "model": "m", "prompt": hist, "max_tokens": 1}).raise_for_status()
                for fetch in (rep % 2 == 0, rep % 2 != 0):  # alternate which goes first
                    requests.post(b.url + "/reset_prefix_cache", timeout=30).raise_for_status()
                    if fetch:
                        fet.append(ttft(b.url, turn, {"pool_source": dict(source, num_tokens=n)}))
                    else:
                        rec.append(ttft(b.url, turn))
            blocks = (metric(b.url, "disagg:kv_pool_fetch_blocks_total") - blocks0) / args.reps
            nbytes = (metric(b.url, "disagg:kv_pool_fetch_bytes_total") - bytes0) / args.reps
            row = {"prompt_tokens": n + args.new_tokens, "fetched_tokens": n,
                   "blocks": blocks, "mib": nbytes / 2**20,
                   "ttft_recompute_ms": statistics.median(rec) * 1e3,
                   "ttft_fetched_ms": statistics.median(fet) * 1e3}
            rows.append(row)
            print(f"# {row}", file=sys.stderr)
        falls = metric(b.url, "disagg:kv_pool_fetch_fallbacks_total")
    finally:
        for x in (a, b):
            if x:
                x.stop()
    print(f"| prompt tokens | prefix fetched (tokens / blocks / MiB) | TTFT recomputed (ms) | "
          f"TTFT fetched (ms) | speed-up |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['fetched_tokens']} / {r['blocks']:.0f} / "
              f"{r['mib']:.1f} | {r['ttft_recompute_ms']:.1f} | {r['ttft_fetched_ms']:.1f} | "
              f"{r['ttft_recompute_ms'] / r['ttft_fetched_ms']:.2f}x |")
    print(f"\n(median of {args.reps} conversations per row; fallbacks: {falls:.0f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
