#!/usr/bin/env python3
"""gpu_serve_smoke — `disagg serve --device cuda` end to end on a GPU machine: starts the
server on the GPU and on the CPU (free ports), sends the golden prompts of
tests/data/sotu-tiny/greedy.json to /v1/completions (temperature 0, 32 tokens), prints both
continuations and whether they are equal, then sends 32 concurrent requests to the GPU
server (continuous batching) and counts those that differ from their single-request answer.
Then the same requests to a GPU server started with --enforce-eager (every step eager; the
first server ran decode steps as CUDA graphs): each single-request answer must equal the
first server's (one sequence: the same batch in both).  The fast mode is not batch-invariant
(a sequence's kernels, cuBLASLt's choice or the decode GEMV, change with the batch size:
docs/gpu.md), so its concurrent answers are only counted; a third server with
--batch-invariant serves the 32 concurrent requests, and each must equal its own
single-request answer there.  Exit 1 when a request fails, an eager single answer differs
from the CUDA-graph one, or a --batch-invariant concurrent answer differs from its single
one.
Usage: python3 tools/gpu_serve_smoke.py BIN MODEL_DIR LOGDIR"""
import concurrent.futures as cf, json, os, subprocess, sys, time
import requests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from ports import free_port  # noqa: E402  (ports outside the ephemeral range, never twice)

BIN, MODEL, LOGDIR = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
golden = json.load(open(os.path.join(HERE, "..", "tests", "data", "sotu-tiny", "greedy.json")))
prompts = [p["prompt_text"] for p in golden["prompts"]]




def start(dev, *extra, name=None):
    port = free_port()
    log = open(os.path.join(LOGDIR, "serve-%s.log" % (name or dev.replace(":", ""))), "w")
    p = subprocess.Popen([BIN, "serve", MODEL, "--host", "127.0.0.1", "--port", str(port), "--device", dev,
                          "--max-model-len", "1024", *extra], stdout=log, stderr=subprocess.STDOUT)
    url = "http://127.0.0.1:%d" % port
    for _ in range(600):
        if p.poll() is not None:
            raise SystemExit("serve --device %s exited %d; log: %s" % (dev, p.returncode, open(log.name).read()[-2000:]))
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:  # 503 while loading
                return p, url
        except requests.RequestException:
            pass
        time.sleep(0.2)
    p.kill()
    raise SystemExit("serve --device %s did not come up" % dev)


def complete(url, prompt, n=32):
    r = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n,
                                                      "temperature": 0}, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


bad = 0
gpu, gurl = start("cuda")
cpu, curl_ = start("cpu", "--kv-cache-memory", "256M")
try:
    same = 0
    single = {}
    for i, p in enumerate(prompts):
        t0 = time.time()
        g = complete(gurl, p)
        dt = time.time() - t0
        c = complete(curl_, p)
        single[i] = g
        same += g == c
        print("prompt %d (%.0f ms on the GPU): %s\n  gpu: %r\n  cpu: %r" % (i, dt * 1e3, "equal" if g == c else "DIFFERENT", g, c))
    print("serve: %d/%d greedy completions equal between --device cuda and --device cpu" % (same, len(prompts)))
    jobs = [i % len(prompts) for i in range(32)]
    t0 = time.time()
    with cf.ThreadPoolExecutor(32) as ex:
        outs = list(ex.map(lambda i: complete(gurl, prompts[i]), jobs))
    dt = time.time() - t0
    diff = sum(o != single[i] for o, i in zip(outs, jobs))
    print("serve: 32 concurrent requests on the GPU in %.2f s; %d differ from their single-request answer "
          "(fast mode, not batch-invariant: counted, not checked)" % (dt, diff))
    gpu.terminate()
    gpu.wait(timeout=30)
    gpu, gurl = start("cuda", "--enforce-eager", name="cuda-eager")
    eager_single = [complete(gurl, p) for p in prompts]
    with cf.ThreadPoolExecutor(32) as ex:
        eager_outs = list(ex.map(lambda i: complete(gurl, prompts[i]), jobs))
    ediff = sum(e != single[i] for i, e in enumerate(eager_single))
    cdiff = sum(e != o for e, o in zip(eager_outs, outs))
    print("serve: --enforce-eager vs CUDA graphs on the GPU: %d of %d single-request greedy answers differ "
          "(checked); concurrent: %d of %d (batches differ with timing: counted)" % (ediff, len(prompts), cdiff, len(jobs)))
    bad += ediff > 0
    gpu.terminate()
    gpu.wait(timeout=30)
    gpu, gurl = start("cuda", "--batch-invariant", name="cuda-invariant")
    inv_single = [complete(gurl, p) for p in prompts]
    with cf.ThreadPoolExecutor(32) as ex:
        inv_outs = list(ex.map(lambda i: complete(gurl, prompts[i]), jobs))
    idiff = sum(o != inv_single[i] for o, i in zip(inv_outs, jobs))
    print("serve: --batch-invariant: %d of 32 concurrent requests differ from their single-request answer (checked)" % idiff)
    bad += idiff > 0
except Exception as e:  # noqa
    print("serve smoke FAILED:", e)
    bad += 1
finally:
    for p in (gpu, cpu):
        p.terminate()
        p.wait(timeout=30)
print(open(os.path.join(LOGDIR, "serve-cuda.log")).read()[-1500:])
for name in ("serve-cuda-eager.log", "serve-cuda-invariant.log"):
    if os.path.exists(os.path.join(LOGDIR, name)):
        print(open(os.path.join(LOGDIR, name)).read()[-600:])
sys.exit(1 if bad else 0)
