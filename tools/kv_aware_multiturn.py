#!/usr/bin/env python3
"""Multi-turn chats through `disagg proxy` under several --policy values: how much of the
prefills' prompt work their prefix caches saved, and the client latency.

For each policy: two kv_producer `disagg serve` instances (KV events on), one kv_consumer
and the proxy are started fresh (cold caches); C conversations run concurrently, each T
turns in sequence (a turn's prompt is the whole conversation so far, as a chat client sends
it).  Printed per policy: the prefills' prompt tokens computed vs found in their prefix
caches (their vllm:prompt_tokens_by_source), the proxy's kv_aware counters when it has
them, and the turns' latency (a non-streamed reply of --max-tokens tokens).  The policy
"kv_aware+pool" is kv_aware with --kv-pool-fetch over kv_both prefills (pool_fetch
--pool-mode): a turn that load sends away from its conversation's prefill fetches its
prefix from there ("fetched": the prefills' external_kv_transfer tokens, counted in the
cache share; "pool" after the kv_aware counters: the requests that named a pool source).

    python3 tools/kv_aware_multiturn.py --model models/disagg-sotu-tiny \\
        --policies least_loaded,round_robin,kv_aware --conversations 8 --turns 4
"""
import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from proxy_fixtures import ProxyProc  # noqa: E402
from server_harness import Server, free_port  # noqa: E402

TEXT = ("The state of the Union is strong, and the work of the Congress is before us. "
        "We meet in a season of change, and the people ask that we keep faith with them. ")


class Prefill:
    def __init__(self, model, common, pool=None):
        self.bootstrap_port, self.kv_port = free_port(), free_port()
        ev = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{self.kv_port}"}
        cfg = {"kv_connector": "MooncakeConnector", "kv_role": "kv_both" if pool else "kv_producer",
               "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
        if pool:  # the pool fetch (docs/kv_pool.md): its mode
            cfg["kv_connector_extra_config"]["pool_fetch"] = pool
        self.server = Server(*common, "--kv-transfer-config", json.dumps(cfg),
                             "--kv-events-config", json.dumps(ev), model=model,
                             env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap_port)})
        self.url = self.server.url


def by_source(server):
    m = server.metrics()
    get = lambda s: sum(v for k, v in m.items()
                        if k.startswith("vllm:prompt_tokens_by_source") and f'source="{s}"' in k)
    return get("local_compute"), get("local_cache_hit"), get("external_kv_transfer")


def run(policy, a):
    common = ("--max-model-len", str(a.max_model_len), "--block-size", "16",
              "--kv-cache-memory", a.kv_cache_memory)
    # "kv_aware+pool": kv_aware with --kv-pool-fetch, kv_both prefills (pool_fetch --pool-mode)
    pool = policy.endswith("+pool")
    policy = policy.split("+")[0]
    ps = [Prefill(a.model, common, a.pool_mode if pool else None) for _ in range(2)]
    dcfg = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    d = Server(*common, "--kv-transfer-config", json.dumps(dcfg), model=a.model)
    extra = ["--policy", policy]
    if policy == "kv_aware":
        extra += ["--tokenizer", a.model]
        for p in ps:
            extra += ["--kv-events-endpoint", f"{p.url}=tcp://127.0.0.1:{p.kv_port}"]
        if pool:
            extra += ["--kv-pool-fetch"]
    px = ProxyProc(ps, [d], extra=extra)
    lat, errors = [], []
    try:
        px.wait_ready(60)

        def conversation(i):
            msgs = [{"role": "system", "content": f"Conversation {i}: you keep the minutes."}]
            for t in range(a.turns):
                msgs.append({"role": "user", "content": f"Point {t}: " + TEXT})
                t0 = time.monotonic()
                r = requests.post(px.url + "/v1/chat/completions", timeout=300,
                                  json={"model": "tiny", "messages": msgs,
                                        "max_tokens": a.max_tokens, "temperature": 0})
                lat.append(time.monotonic() - t0)
                if r.status_code != 200:
                    errors.append(r.text)
                    return
                msgs.append({"role": "assistant",
                             "content": r.json()["choices"][0]["message"]["content"]})

        th = [threading.Thread(target=conversation, args=(i,)) for i in range(a.conversations)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        computed = cached = fetched = 0
        for p in ps:
            c, h, f = by_source(p.server)
            computed += c
            cached += h
            fetched += f
        m = px.metrics()
        kv = {r: int(m.get(f'disagg_proxy_kv_aware_requests_total{{result="{r}"}}', 0))
              for r in ("hit", "load", "miss")}
        return dict(policy=policy + ("+pool" if pool else ""), computed=int(computed),
                    cached=int(cached), fetched=int(fetched),
                    p50=statistics.median(lat), mean=statistics.mean(lat), errors=len(errors),
                    kv=kv if policy == "kv_aware" else None, pool=int(m.get(
                        "disagg_proxy_kv_pool_source_requests_total", 0)))
    finally:
        px.stop()
        d.stop()
        for p in ps:
            p.server.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "disagg-sotu-tiny"))
    ap.add_argument("--policies", default="least_loaded,kv_aware")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-memory", default="96M")
    ap.add_argument("--pool-mode", default="auto",
                    help="kv_aware+pool: the prefills' pool_fetch (auto, always)")
    a = ap.parse_args()
    rows = [run(p, a) for p in a.policies.split(",")]
    print(f"{a.conversations} conversations x {a.turns} turns, 2 prefills + 1 decode, "
          f"max_tokens {a.max_tokens}")
    print(f"{'policy':<14}{'prefill tokens computed':>25}{'from prefix cache':>19}"
          f"{'fetched':>9}{'cache share':>13}{'p50 s':>8}{'mean s':>8}  kv_aware hit/load/miss")
    for r in rows:
        share = r["cached"] / max(1, r["cached"] + r["computed"])
        kv = "/".join(str(r["kv"][k]) for k in ("hit", "load", "miss")) if r["kv"] else "-"
        share = (r["cached"] + r["fetched"]) / max(1, r["cached"] + r["fetched"] + r["computed"])
        print(f"{r['policy']:<14}{r['computed']:>25}{r['cached']:>19}{r['fetched']:>9}{share:>12.1%}"
              f"{r['p50']:>8.3f}{r['mean']:>8.3f}  {kv}"
              + (f"  pool {r['pool']}" if r["policy"].endswith("+pool") else "")
              + (f"  ({r['errors']} errors)" if r["errors"] else ""))


if __name__ == "__main__":
    main()
