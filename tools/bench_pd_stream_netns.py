#!/usr/bin/env python3
"""bench_pd_stream_netns — P/D TTFT against colocated TTFT across two "hosts" on this machine
(docs/benchmarks.md "Layer-wise streaming"): two network namespaces joined by a veth pair
shaped with tc tbf to --gbit Gbit/s each way (the KV link; the API traffic goes over the
namespaces' LAN bridge), a Qwen2.5-0.5B-shaped model with random weights (--load-format
dummy, bench/shapes/qwen2.5-0.5b, the Qwen2.5 tokenizer), --prompt-tokens random token ids
per request, a few output tokens.

In one run: colocated (one `disagg serve` on host 0), then one producer on host 0 and two
decoders on host 1 -- one with kv_connector_extra_config.layerwise false (the whole-request
path: the KV crosses the link after the prefill), one with the default (layer-wise
streaming) -- each request sent to P and D at the same time as the proxy does, D's TTFT
(time to its first streamed token) measured from the root namespace.  Prints a table and
the ratios to colocated.  Needs root, iproute2 and tc (tbf).

Usage: sudo python3 tools/bench_pd_stream_netns.py [--build build] [--prompt-tokens 2048]
       [--n 3] [--gbit 10] [--max-tokens 4] [--json out.json]"""
import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--build", default=os.environ.get("DISAGG_BUILD", "build"))
ap.add_argument("--prompt-tokens", type=int, default=2048)
ap.add_argument("--max-tokens", type=int, default=4)
ap.add_argument("--n", type=int, default=3, help="measured requests per stack (after one warm-up)")
ap.add_argument("--gbit", type=float, default=10.0)
ap.add_argument("--shape", default=str(ROOT / "bench" / "shapes" / "qwen2.5-0.5b"))
ap.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: shared/data)")
ap.add_argument("--serve-args", default="", help="more `disagg serve` flags for every instance")
ap.add_argument("--json", default=None)
a = ap.parse_args()
os.environ["DISAGG_BUILD"] = a.build

import netns  # noqa: E402 (after DISAGG_BUILD: server_harness reads it)
from server_harness import BIN  # noqa: E402

why = netns.skip_reason()
if why:
    sys.exit("bench_pd_stream_netns: " + why)
tok = Path(a.tokenizer) if a.tokenizer else next(
    (p for p in (ROOT.parent / "shared" / "data" / "qwen2.5-tokenizer", ROOT / "shared" / "data" / "qwen2.5-tokenizer")
     if p.is_dir()), None)
if not tok:
    sys.exit("bench_pd_stream_netns: no Qwen2.5 tokenizer (give --tokenizer DIR)")
model = Path(tempfile.mkdtemp(prefix="disagg-stream-model-"))
shutil.copy(Path(a.shape) / "config.json", model / "config.json")
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tok / f, model / f)
cfg = json.loads((model / "config.json").read_text())
SERVE = ["--load-format", "dummy", "--max-model-len", str(a.prompt_tokens + 256), "--kv-cache-memory", "512M",
         "--threads", str(os.cpu_count() or 1), "--served-model-name", "m"] + a.serve_args.split()


def kv_cfg(role, **extra):
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "kv_connector_extra_config": dict({"mooncake_protocol": "tcp", "device_name": "veth-a"},
                                                         **extra)})


class Srv:
    def __init__(self, host, port, *extra, env=None):
        self.url = f"http://{host.lan_ip}:{port}"
        self.log_path = Path(tempfile.gettempdir()) / f"disagg-stream-bench-{host.ns}-{port}.log"
        self.log = open(self.log_path, "w")
        e = dict(os.environ, VLLM_HOST_IP=host.lan_ip)
        e.update(env or {})
        self.proc = host.popen([BIN, "serve", str(model), "--host", host.lan_ip, "--port", str(port), *SERVE,
                                *extra], stdout=self.log, stderr=subprocess.STDOUT, env=e)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"disagg serve exited: {self.log_path.read_text()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        sys.exit(f"disagg serve did not come up: {self.log_path}")

    def metric(self, name):
        t = requests.get(self.url + "/metrics", timeout=10).text
        return sum(float(l.rsplit(" ", 1)[1]) for l in t.splitlines() if l.split("{")[0].split(" ")[0] == name)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def prompt(seed):
    r = random.Random(seed)
    return [r.randrange(1000, 30000) for _ in range(a.prompt_tokens)]


def ttft_stream(url, body):
    """Seconds to the first streamed token of a completion; the final usage."""
    t0 = time.perf_counter()
    first, usage = None, None
    with requests.post(url + "/v1/completions", json=dict(body, stream=True, stream_options={"include_usage": True}),
                       stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            j = json.loads(line[6:])
            if first is None and j.get("choices") and j["choices"][0].get("text") is not None:
                first = time.perf_counter() - t0
            if j.get("usage"):
                usage = j["usage"]
    return first, usage


def colocated_one(srv, seed):
    return ttft_stream(srv.url, {"model": "m", "prompt": prompt(seed), "max_tokens": a.max_tokens,
                                 "temperature": 0, "ignore_eos": True})


def pd_one(p, boot, d, engine_id, seed):
    tid = "xfer-" + str(uuid.uuid4())
    body = {"model": "m", "prompt": prompt(seed), "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}
    pb = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    db = dict(body, kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": engine_id,
                                        "remote_bootstrap_addr": boot, "transfer_id": tid})
    with cf.ThreadPoolExecutor(2) as ex:
        fp = ex.submit(requests.post, p.url + "/v1/completions", json=pb, timeout=900)
        t, u = ttft_stream(d.url, db)
        fp.result().raise_for_status()
    return t, u


with netns.Cluster() as cl:
    h0, h1 = cl.hosts
    for h in (h0, h1):  # the KV link, both directions
        h.rate_limit("veth-a", int(a.gbit * 1000))
    print(f"hosts {h0.lan_ip} (P, colocated) and {h1.lan_ip} (D), KV link veth-a shaped to {a.gbit:g} Gbit/s "
          f"(tbf); {cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')}, "
          f"{a.prompt_tokens}-token prompts, {a.max_tokens} tokens out, {a.n} requests per stack", flush=True)
    # every instance up at once (an idle one costs nothing); the stacks take turns request by
    # request, so a change in the machine's load hits them alike
    colo = Srv(h0, 8200)
    boot_port = 8998
    p = Srv(h0, 8100, "--kv-transfer-config", kv_cfg("kv_producer"),
            env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot_port)})
    ds = {"whole": Srv(h1, 8100, "--kv-transfer-config", kv_cfg("kv_consumer", layerwise=False)),
          "streaming": Srv(h1, 8101, "--kv-transfer-config", kv_cfg("kv_consumer"))}
    boot = f"http://{h0.lan_ip}:{boot_port}"
    engine_id = requests.get(boot + "/query", timeout=10).json()["0"]["engine_id"]
    rows = {"colocated": [], "P/D whole": [], "P/D streaming": []}
    lw = {"whole": [], "streaming": []}
    exposed = {"whole": [], "streaming": []}  # P's send time after its prefill ended
    try:
        colocated_one(colo, 999)  # warm-ups
        for k, d in enumerate(ds.values()):
            pd_one(p, boot, d, engine_id, 997 - k)
        tx0 = h0.tx_bytes("veth-a")
        for s in range(a.n):  # a prompt of its own for every request: P's prefix cache stays out
            rows["colocated"].append(colocated_one(colo, 3 * s)[0])
            for k, (mode, d) in enumerate(ds.items()):
                s0, c0 = p.metric("disagg:kv_send_seconds_sum"), p.metric("disagg:kv_send_seconds_count")
                t, u = pd_one(p, boot, d, engine_id, 3 * s + 1 + k)
                time.sleep(0.2)  # P counts the send when its FINISH went
                dc = p.metric("disagg:kv_send_seconds_count") - c0
                exposed[mode].append((p.metric("disagg:kv_send_seconds_sum") - s0) / dc if dc else float("nan"))
                rows["P/D " + mode].append(t)
                lw[mode].append(((u or {}).get("kv_transfer") or {}).get("layerwise"))
            print(f"  round {s + 1}/{a.n}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in rows.items()),
                  flush=True)
        kv_bytes = (h0.tx_bytes("veth-a") - tx0) / (2 * a.n)
    finally:
        for srv in list(ds.values()) + [p, colo]:
            srv.stop()

base = statistics.mean(rows["colocated"])
print(f"\nKV per request over the link: {kv_bytes / 1e6:.1f} MB ({kv_bytes * 8 / (a.gbit * 1e9) * 1e3:.1f} ms at "
      f"{a.gbit:g} Gbit/s); P's KV send left after its prefill ended (disagg:kv_send_seconds), mean: "
      + ", ".join(f"{m} {statistics.mean(v) * 1e3:.1f} ms" for m, v in exposed.items()))
print("| stack | TTFT mean ms | TTFT median ms | min | max | vs colocated | layerwise (usage) |")
print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
for name, ts in rows.items():
    m = statistics.mean(ts)
    flag = ""
    if name.startswith("P/D"):
        flag = ",".join(str(x).lower() for x in lw[name.split()[1]])
    print(f"| {name} | {m * 1e3:.1f} | {statistics.median(ts) * 1e3:.1f} | {min(ts) * 1e3:.1f} | "
          f"{max(ts) * 1e3:.1f} | {m / base:.3f}x | {flag} |")
if a.json:
    Path(a.json).write_text(json.dumps({"rows": rows, "layerwise": lw, "kv_bytes": kv_bytes, "exposed": exposed,
                                        "args": vars(a)}, indent=1))
shutil.rmtree(model, ignore_errors=True)
