#!/usr/bin/env python3
"""gpu_bench_serve — `disagg bench serve` against `disagg serve --device cuda` (colocated, one
process on the GPU) on a model directory with a tokenizer (the random 7B-shaped checkpoint of
tools/gen_random_qwen2_gpu.py carries the real Qwen2.5 tokenizer): random prompts of
--input-len words, --output-len tokens each (--ignore-eos), at concurrency 1, 16 and 64;
prints disagg bench serve's table for each (TTFT, TPOT, ITL, throughput) and a summary line.
Exit 1 when the server does not come up or a bench run fails.
Usage: python3 tools/gpu_bench_serve.py BIN MODEL_DIR WORKDIR [--input-len 512]
       [--output-len 128] [--concurrency 1,16,64]"""
import argparse, json, os, subprocess, sys, time
import urllib.request
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from ports import free_port  # noqa: E402  (ports outside the ephemeral range, never twice)

ap = argparse.ArgumentParser()
ap.add_argument("bin")
ap.add_argument("model")
ap.add_argument("workdir")
ap.add_argument("--input-len", type=int, default=512)
ap.add_argument("--output-len", type=int, default=128)
ap.add_argument("--concurrency", default="1,16,64")
ap.add_argument("--device", default="cuda")
a = ap.parse_args()
os.makedirs(a.workdir, exist_ok=True)
conc = [int(c) for c in a.concurrency.split(",")]




port = free_port()
url = "http://127.0.0.1:%d" % port
log_path = os.path.join(a.workdir, "serve-bench.log")
log = open(log_path, "w")
srv = subprocess.Popen([a.bin, "serve", a.model, "--host", "127.0.0.1", "--port", str(port),
                        "--device", a.device, "--max-model-len", "1024" if a.device == "cpu" else "4096", "--max-num-seqs", str(max(conc))],
                       stdout=log, stderr=subprocess.STDOUT)
t0 = time.time()
rc = 1
try:
    up = False
    while time.time() - t0 < 300 and srv.poll() is None:
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                up = True
                break
        except Exception:
            pass
        time.sleep(0.25)
    if not up:
        print("gpu_bench_serve: the server did not come up (exit %s); log:\n%s"
              % (srv.poll(), open(log_path).read()[-3000:]))
        sys.exit(1)
    print("gpu_bench_serve: disagg serve --device " + a.device + " ready in %.1f s" % (time.time() - t0))
    summary = []
    for c in conc:
        n = max(8, 4 * c)
        js = os.path.join(a.workdir, "bench-serve-c%d.json" % c)
        cmd = [a.bin, "bench", "serve", "--base-url", url, "--random-input-len", str(a.input_len),
               "--random-output-len", str(a.output_len), "--num-prompts", str(n), "--max-concurrency",
               str(c), "--ignore-eos", "--disable-tqdm", "--json", js]
        print("\n$ " + " ".join(cmd[1:]), flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        print(r.stdout[-4000:] + r.stderr[-2000:], flush=True)
        if r.returncode != 0:
            print("gpu_bench_serve: bench serve at concurrency %d failed (%d)" % (c, r.returncode))
            sys.exit(1)
        try:
            j = json.load(open(js))
            summary.append((c, n, j))
        except Exception as e:  # the table above is what counts
            print("gpu_bench_serve: no JSON from bench serve (%s)" % e)
    if summary:
        keys = ["mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                "mean_itl_ms", "request_throughput", "output_throughput", "total_token_throughput"]
        print("\nsummary (input %d words, output %d tokens, --ignore-eos)" % (a.input_len, a.output_len))
        print("%-12s %-8s " % ("concurrency", "requests") + " ".join("%14s" % k for k in keys))
        for c, n, j in summary:
            print("%-12d %-8d " % (c, n) + " ".join("%14s" % ("%.2f" % j[k] if isinstance(j.get(k), (int, float)) else "-") for k in keys))
    rc = 0
finally:
    srv.terminate()
    try:
        srv.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.kill()
    if rc:
        print(open(log_path).read()[-2000:])
sys.exit(rc)
