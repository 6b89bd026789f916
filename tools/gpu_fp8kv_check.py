#!/usr/bin/env python3
"""gpu_fp8kv_check — the FP8 KV cache (--kv-cache-dtype fp8) served on the GPU, against the
bf16 cache in the same run, for each MODEL_DIR given (e.g. the tiny real model and a 7B-shaped
directory served with --load-format dummy):
  * `disagg serve --device cuda --kv-cache-dtype bfloat16` and then `fp8`, at the default
    --gpu-memory-utilization (0.9), --max-model-len 8192: the startup log's KV cache (blocks,
    tokens) for each, and the batch of 8k-context sequences that fits (tokens // 8192): fp8
    must hold >= 1.9x the bf16 tokens (a quarter of f32's, half of bf16's bytes a token);
  * greedy completions (prompts of a few hundred tokens, 32 tokens each, single and 16
    concurrent): every request answers 200 with 32 tokens; the fp8 answers against the bf16
    ones are counted (equal continuations, common prefix lengths) and printed, not checked
    (an 8-bit cache rounds K and V; docs/server.md).
Exit 1 when a server does not start, a request fails, or fp8 holds < 1.9x the bf16 tokens.
Usage: python3 tools/gpu_fp8kv_check.py BIN LOGDIR MODEL_DIR[:dummy[:TOKENIZER_DIR]] ..."""
import concurrent.futures as cf
import os
import re
import subprocess
import sys
import time

import requests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from ports import free_port  # noqa: E402  (ports outside the ephemeral range, never twice)

BIN, LOGDIR = sys.argv[1:3]
MODELS = sys.argv[3:]
CTX = 8192
PROMPTS = [("The state of the Union is strong, and our economy is growing. " * 20)[: 300 + 37 * i]
           for i in range(8)]




def start(model, dummy, dt, tok):
    port = free_port()
    name = "fp8kv-%s-%s" % (os.path.basename(model.rstrip("/")), dt)
    log_path = os.path.join(LOGDIR, name + ".log")
    log = open(log_path, "w")
    args = [BIN, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--device", "cuda",
            "--kv-cache-dtype", dt, "--max-model-len", str(CTX)]
    if dummy:
        args += ["--load-format", "dummy"]
    if tok:
        args += ["--tokenizer", tok]
    p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = "http://127.0.0.1:%d" % port
    for _ in range(1800):
        if p.poll() is not None:
            break
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return p, url, log_path
        except requests.RequestException:
            pass
        time.sleep(0.1)
    p.kill()
    p.wait()
    print("FAILED: %s did not start:\n%s" % (name, open(log_path).read()[-3000:]))
    return None, None, log_path


def complete(url, model, prompt):
    r = requests.post(url + "/v1/completions",
                      json={"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0,
                            "ignore_eos": True, "logprobs": 1}, timeout=300)
    if r.status_code != 200:
        return None, r.text[:300]
    c = r.json()["choices"][0]
    return c["logprobs"]["tokens"], None


def run(model, dummy, dt, tok):
    p, url, log_path = start(model, dummy, dt, tok)
    if not p:
        return None
    try:
        log = open(log_path).read()
        m = re.search(r"KV cache (\d+) blocks x (\d+) tokens \((\d+) tokens, ([\d.]+) MiB, (\S+)\)", log)
        if not m:
            print("FAILED: no KV cache line in %s" % log_path)
            return None
        res = {"blocks": int(m.group(1)), "tokens": int(m.group(3)), "mib": float(m.group(4)),
               "dtype": m.group(5), "single": [], "concurrent": [], "errors": []}
        for pr in PROMPTS:
            toks, err = complete(url, model, pr)
            res["single"].append(toks)
            if err:
                res["errors"].append(err)
        with cf.ThreadPoolExecutor(16) as ex:
            for toks, err in ex.map(lambda pr: complete(url, model, pr), PROMPTS * 2):
                res["concurrent"].append(toks)
                if err:
                    res["errors"].append(err)
        return res
    finally:
        p.terminate()
        p.wait(60)


def prefix(a, b):
    n = 0
    while a and b and n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


fails = 0
for spec in MODELS:
    model, mode, tok = (spec.split(":") + ["", ""])[:3]
    dummy = mode == "dummy"
    got = {dt: run(model, dummy, dt, tok) for dt in ("bfloat16", "fp8")}
    name = os.path.basename(model.rstrip("/")) + (" (dummy weights)" if dummy else "")
    if not all(got.values()):
        fails += 1
        continue
    b, f = got["bfloat16"], got["fp8"]
    for dt, r in got.items():
        bad = [t for t in r["single"] + r["concurrent"] if not t or len(t) != 32]
        print("fp8kv %-28s %-13s KV %7.0f MiB, %7d blocks, %9d tokens: %4d sequences of %d "
              "tokens; requests failed %d" % (name, r["dtype"], r["mib"], r["blocks"], r["tokens"],
                                               r["tokens"] // CTX, CTX, len(r["errors"]) + len(bad)))
        if r["errors"] or bad:
            fails += 1
            print("FAILED: %s %s: %s" % (name, dt, (r["errors"] or ["short answers"])[:2]))
    ratio = f["tokens"] / max(b["tokens"], 1)
    ok = ratio >= 1.9
    print("fp8kv %-28s max batch at %d context: bf16 %d, fp8 %d (x%.2f tokens)  %s"
          % (name, CTX, b["tokens"] // CTX, f["tokens"] // CTX, ratio, "PASS" if ok else "MISS"))
    fails += not ok
    pre = [prefix(x, y) for x, y in zip(b["single"], f["single"])]
    same = sum(x == y for x, y in zip(b["single"], f["single"]))
    csame = sum(x == y for x, y in zip(f["single"] * 2, f["concurrent"]))
    print("fp8kv %-28s greedy fp8 vs bf16 KV: %d of %d continuations equal, common prefixes %s; "
          "fp8 concurrent vs single: %d of %d equal (counted, not checked)"
          % (name, same, len(pre), pre, csame, len(f["concurrent"])))
print("gpu_fp8kv_check: %d failure(s)" % fails)
sys.exit(1 if fails else 0)
