#!/usr/bin/env python3
"""tp_compare — `disagg serve -tp N` against `-tp 1` on one device: greedy tokens and logprobs of
a few prompts, each server started and stopped here.  For the GPU (scripts/gpu_check.sh ONLY=tp,
on a machine with N GPUs): prints how many prompts match token for token, the largest logprob
difference, and exits 1 when a server fails or a logprob differs by more than --tol before the
first differing token (bf16 on the GPU: a near-tie may flip; the count says how many).

usage: tools/tp_compare.py BIN MODEL --tp N [--device cuda] [--tol 0.05]"""
import argparse
import os
import signal
import subprocess
import sys
import time

import requests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from ports import free_port as port  # noqa: E402  (ports outside the ephemeral range, never twice)

PROMPTS = ["The state of the union is", "Mr. Speaker, Mr. Vice President, members of Congress",
           "Our economy", "We will", "Tonight I want to talk about", "Health care"]




def serve(a, tp):
    p = port()
    log = open(f"/tmp/tp_compare_{tp}.log", "w")
    proc = subprocess.Popen([a.bin, "serve", a.model, "--port", str(p), "-tp", str(tp), "--device",
                             a.device, "--kv-cache-memory", "256M", "--served-model-name", "m"],
                            stdout=log, stderr=subprocess.STDOUT)
    for _ in range(1200):
        if proc.poll() is not None:
            sys.exit(f"serve -tp {tp} exited {proc.returncode}: {open(log.name).read()[-3000:]}")
        try:
            if requests.get(f"http://127.0.0.1:{p}/health", timeout=1).status_code == 200:
                return proc, p
        except requests.RequestException:
            pass
        time.sleep(0.2)
    sys.exit(f"serve -tp {tp} not ready: {open(log.name).read()[-3000:]}")


def gen(p, prompt):
    r = requests.post(f"http://127.0.0.1:{p}/v1/completions", timeout=300, json={
        "model": "m", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
        "logprobs": 1})
    r.raise_for_status()
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tol", type=float, default=0.05)
    a = ap.parse_args()
    one, p1 = serve(a, 1)
    many, pn = serve(a, a.tp)
    same, worst = 0, 0.0
    try:
        for pr in PROMPTS:
            t1, l1 = gen(p1, pr)
            tn, ln = gen(pn, pr)
            same += t1 == tn
            for x, y, u, v in zip(t1, tn, l1, ln):
                if x != y:
                    break
                worst = max(worst, abs(u - v))
    finally:
        for proc in (one, many):
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    print(f"tp_compare: -tp {a.tp} vs -tp 1 on {a.device}: {same}/{len(PROMPTS)} prompts equal "
          f"token for token; largest logprob difference before a divergence {worst:.2e}")
    return 0 if worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
