#!/usr/bin/env python3
"""bench_pd_overhead — what P/D adds to a small request on one host: a kv_producer, a
kv_consumer and `disagg proxy` on the tiny model (KV over tcp, no prefix caching, a 64 MB KV
cache so the blocks are warm), then N requests (max_tokens 1) of each kind, interleaved:

  colocated  the prompt to P as a plain request (no kv_transfer_params)
  P          the prefill part alone: P with do_remote_decode (as the proxy sends it)
  D          the decode part alone: D with do_remote_prefill, after P answered (pull + answer)
  proxy      the whole P/D request through `disagg proxy`

Prints the median and minimum of each (client side, ms) and D's mean remote-KV load time
(disagg:kv_load_seconds: bootstrap lookup, pull, KV in place).  Several binaries in one run
(--bin A --bin B) alternate, so a shared machine's load moves them alike.
Usage: python3 tools/bench_pd_overhead.py [--bin build/disagg ...] [--n 150] [--rounds 3]"""
import argparse
import json
import os
import re
import statistics as st
import subprocess
import sys
import time
import uuid

import requests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from ports import free_port  # noqa: E402  (ports outside the ephemeral range, never twice)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "disagg-sotu-tiny")
PROMPT = "hello there my friend how are you today in the state of the union"




def kv(role):
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})


def wait_up(url):
    for _ in range(300):
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    sys.exit("no /health from " + url)


def metric(text, name):
    m = re.search(r"^" + re.escape(name) + r" ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run(binary, n):
    procs = []

    def start(args, env=None):
        procs.append(subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env=dict(os.environ, **(env or {}))))

    boot, pp, dp, xp = free_port(), free_port(), free_port(), free_port()
    common = ["--host", "127.0.0.1", "--served-model-name", "tiny", "--no-enable-prefix-caching",
              "--kv-cache-memory", "64M"]
    P, D, X = (f"http://127.0.0.1:{p}" for p in (pp, dp, xp))
    start(["serve", MODEL, "--port", str(pp), *common, "--kv-transfer-config", kv("kv_producer")],
          {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot)})
    start(["serve", MODEL, "--port", str(dp), *common, "--kv-transfer-config", kv("kv_consumer")])
    start(["proxy", "--port", str(xp), "--prefill", P, str(boot), "--decode", D])
    try:
        for u in (P, D, X):
            wait_up(u)
        s = requests.Session()
        q = s.get(f"http://127.0.0.1:{boot}/query", timeout=5).json()
        eid = next(iter(q.values()))["engine_id"]
        t = {k: [] for k in ("colocated", "P", "D", "proxy")}
        for i in range(n + 5):
            body = {"model": "tiny", "prompt": f"{PROMPT} {i}", "max_tokens": 1, "temperature": 0}

            def timed(url, b):
                t0 = time.perf_counter()
                r = s.post(url + "/v1/completions", json=b, timeout=60)
                dt = time.perf_counter() - t0
                if r.status_code != 200:
                    sys.exit(f"{url}: {r.status_code} {r.text[:300]}")
                return r, dt

            tid = str(uuid.uuid4())
            _, a = timed(P, dict(body, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                                           "transfer_id": tid}))
            _, b = timed(D, dict(body, kv_transfer_params={
                "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": eid,
                "remote_bootstrap_addr": f"127.0.0.1:{boot}", "transfer_id": tid}))
            _, c = timed(X, dict(body, prompt=body["prompt"] + " x"))
            _, d = timed(P, dict(body, prompt=body["prompt"] + " y"))
            if i >= 5:  # warm-up: first connections, first blocks
                t["P"].append(a), t["D"].append(b), t["proxy"].append(c), t["colocated"].append(d)
        m = s.get(D + "/metrics", timeout=5).text
        load = metric(m, "disagg:kv_load_seconds_sum") / max(metric(m, "disagg:kv_load_seconds_count"), 1)
        return {k: (st.median(v) * 1e3, min(v) * 1e3) for k, v in t.items()}, load * 1e3
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", action="append", help="disagg binaries to compare (default build/disagg)")
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    bins = a.bin or [os.path.join(ROOT, "build", "disagg")]
    print("| binary | round | colocated | P (prefill part) | D (decode part) | proxy (P/D) | proxy − colocated "
          "| D's KV load mean |")
    print("|---|---|---|---|---|---|---|---|")
    for r in range(a.rounds):
        for b in bins:
            t, load = run(b, a.n)
            f = lambda k: "%.2f (min %.2f)" % t[k]
            print(f"| {b} | {r + 1} | {f('colocated')} | {f('P')} | {f('D')} | {f('proxy')} | "
                  f"{t['proxy'][0] - t['colocated'][0]:+.2f} | {load:.2f} |", flush=True)


if __name__ == "__main__":
    main()
