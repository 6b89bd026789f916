#!/usr/bin/env python3
"""gpu_invariant_serve — `disagg serve --device cuda --batch-invariant`, colocated, end to end:
R requests of mixed prompt lengths (greedy and seeded sampling, alternating) sent one at a
time, then all of them again 32 at a time (continuous batching, prompts prefilled in chunks
of --max-num-batched-tokens 256 interleaved with other requests' decode steps): every answer
must equal its single-request answer.  The same run against a server in the fast mode
(no --batch-invariant) is printed for comparison (how many differ there; not a failure).
With --pd, the same R requests then go 32 at a time through `disagg proxy` to a P and a D
(`--batch-invariant`, two processes on the GPU, KV over cuda_ipc): every answer must equal
the colocated single-request answer, greedy and seeded alike.
Exit 1 when a request fails or an invariant-mode answer differs.
Usage: python3 tools/gpu_invariant_serve.py BIN MODEL_DIR LOGDIR [R] [--inv-only] [--pd]"""
import concurrent.futures as cf, json, os, random, subprocess, sys, time
import requests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from ports import free_port  # noqa: E402  (ports outside the ephemeral range, never twice)

BIN, MODEL, LOGDIR = sys.argv[1:4]
INV_ONLY = "--inv-only" in sys.argv
PD = "--pd" in sys.argv
args = [a for a in sys.argv[4:] if a not in ("--inv-only", "--pd")]
R = int(args[0]) if args else 96
HERE = os.path.dirname(os.path.abspath(__file__))
golden = json.load(open(os.path.join(HERE, "..", "tests", "data", "sotu-tiny", "greedy.json")))
words = " ".join(p["prompt_text"] for p in golden["prompts"]).split()
rng = random.Random(15)
reqs = []
for i in range(R):
    n = rng.choice([3, 8, 20, 45, 90, 150, 240, 330])
    start_w = rng.randrange(len(words))
    text = " ".join((words * 40)[start_w:start_w + n])
    body = {"prompt": text, "max_tokens": 24}
    if i % 2:
        body.update(temperature=0.9, top_p=0.95, seed=1000 + i)
    else:
        body.update(temperature=0)
    reqs.append(body)




def start(name, *extra, env=None, cmd=None):
    port = free_port()
    log = open(os.path.join(LOGDIR, "serve-%s.log" % name), "w")
    argv = cmd(port) if cmd else [BIN, "serve", MODEL, "--host", "127.0.0.1", "--port", str(port), "--device",
                                  "cuda", "--max-model-len", "1024", "--max-num-batched-tokens", "256", *extra]
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})))
    url = "http://127.0.0.1:%d" % port
    for _ in range(600):
        if p.poll() is not None:
            raise SystemExit("serve %s exited %d; log: %s" % (name, p.returncode, open(log.name).read()[-2000:]))
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return p, url
        except requests.RequestException:
            pass
        time.sleep(0.2)
    p.kill()
    raise SystemExit("serve %s did not come up" % name)


def complete(url, body):
    r = requests.post(url + "/v1/completions", json=dict(body, model=MODEL), timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def run(name, *extra):
    p, url = start(name, *extra)
    try:
        t0 = time.time()
        single = [complete(url, b) for b in reqs]
        t1 = time.time()
        order = list(range(R))
        rng.shuffle(order)
        with cf.ThreadPoolExecutor(32) as ex:
            outs = dict(zip(order, ex.map(lambda i: complete(url, reqs[i]), order)))
        t2 = time.time()
    finally:
        p.terminate()
        p.wait(timeout=30)
    g = sum(outs[i] != single[i] for i in range(0, R, 2))
    s = sum(outs[i] != single[i] for i in range(1, R, 2))
    print("%-22s %d requests: single %.1f s, 32 concurrent %.1f s; differ from single: greedy %d/%d, "
          "seeded sampling %d/%d" % (name, R, t1 - t0, t2 - t1, g, (R + 1) // 2, s, R // 2))
    return (g + s, single) if name == "batch-invariant" else g + s


def kv_cfg(role):
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role})


def run_pd(single):
    """R requests, 32 at a time, through the proxy to P and D (both --batch-invariant)."""
    boot = free_port()
    mem = ("--batch-invariant", "--kv-cache-memory", "1G")
    procs = []
    try:
        P, purl = start("pd-P", *mem, "--kv-transfer-config", kv_cfg("kv_producer"),
                        env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot)})
        procs.append(P)
        D, durl = start("pd-D", *mem, "--kv-transfer-config", kv_cfg("kv_consumer"))
        procs.append(D)
        X, xurl = start("pd-proxy", cmd=lambda port: [BIN, "proxy", "--port", str(port), "--prefill", purl,
                                                      str(boot), "--decode", durl])
        procs.append(X)
        order = list(range(R))
        rng.shuffle(order)
        t0 = time.time()
        with cf.ThreadPoolExecutor(32) as ex:
            outs = dict(zip(order, ex.map(lambda i: complete(xurl, reqs[i]), order)))
        t1 = time.time()
        m = requests.get(purl + "/metrics", timeout=10).text
        ipc = [l for l in m.splitlines() if l.startswith('disagg:kv_transfer_transport_requests_total{transport="cuda_ipc"')]
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=30)
    g = sum(outs[i] != single[i] for i in range(0, R, 2))
    s = sum(outs[i] != single[i] for i in range(1, R, 2))
    print("%-22s %d requests, 32 concurrent through the proxy, %.1f s; differ from colocated single: greedy "
          "%d/%d, seeded sampling %d/%d; P's %s" % ("P/D batch-invariant", R, t1 - t0, g, (R + 1) // 2, s, R // 2,
                                                    ipc[0] if ipc else "cuda_ipc counter: missing"))
    n_ipc = float(ipc[0].rsplit(" ", 1)[1]) if ipc else 0.0
    if n_ipc < R:
        print("P/D batch-invariant: FAILED: only %d of %d requests' KV moved over cuda_ipc" % (n_ipc, R))
    return g + s + (n_ipc < R)


bad = 0
try:
    d, single = run("batch-invariant", "--batch-invariant")
    bad += d > 0
    if PD:
        bad += run_pd(single) > 0
    if not INV_ONLY:
        run("fast (default)")
except Exception as e:  # noqa
    print("invariant serve FAILED:", e)
    bad += 1
print(open(os.path.join(LOGDIR, "serve-batch-invariant.log")).read()[-1200:])
sys.exit(1 if bad else 0)
