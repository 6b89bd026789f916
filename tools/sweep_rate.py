#!/usr/bin/env python3
"""A request-rate sweep: `disagg bench serve` at each rate of --rates against a colocated
server and against a P/D pair behind `disagg proxy`, one JSON per run for
tools/plot_benchmarks.py --sweep.

Either give the servers (already running):
  tools/sweep_rate.py --bin build/disagg --out sweep --rates 1,2,4 \\
      --colocated http://host:8000 --pd http://host:9000 [--gpus-colocated 1 --gpus-pd 2] \\
      -- --random-input-len 3000 --random-output-len 150 --goodput ttft:2000 tpot:50

or let it start them (one after the other: colocated, then P + D + proxy), on one host:
  tools/sweep_rate.py --bin build/disagg --out sweep --rates 1,2,4 \\
      --start models/disagg-sotu-tiny --serve-args "--max-model-len 1024 --block-size 16" \\
      --pd-protocol tcp -- --random-input-len 128 --random-output-len 16

Everything after `--` goes to every `bench serve` run (dataset, lengths, --goodput ...);
--num-prompts is --prompts-per-rate, or rate x --seconds-per-rate (at least --min-prompts);
each rate gets its own --seed (--seed + 1000 x its position), so no run's prompts are already in
the server's prefix cache from an earlier rate.
Writes OUT/sweep-{colocated,pd}-r{RATE}.json: bench serve's JSON (vLLM's keys) plus
"sweep": {"setup", "rate", "gpus", "transport", "device"}; and OUT/sweep-logs/ (server logs).
Exit status 1 when a run fails (its JSON is still written when bench serve wrote one).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from ports import free_port  # noqa: E402  (ports outside the ephemeral range, never twice)




def healthy(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Proc:
    """One `disagg` process on a free port, up when /health answers 200."""

    def __init__(self, binary, name, args, logdir, env=None, ready_s=900):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        e = dict(os.environ)
        e.update(env or {})
        argv = [binary] + [a.replace("{port}", str(self.port)) for a in args]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        deadline = time.time() + ready_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"sweep_rate: {name} exited with {self.proc.returncode}; log {self.log_path}:\n"
                                 + open(self.log_path).read()[-2000:])
            if healthy(self.url):
                return
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"sweep_rate: {name} did not answer /health in {ready_s} s; log {self.log_path}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def kv_cfg(role, proto):
    extra = {"mooncake_protocol": proto} if proto else {}
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role, "kv_connector_extra_config": extra})


def parse_rates(text):
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"'{text}': comma-separated request rates > 0 expected, e.g. 0.5,1,2")
    return rates


def run_rates(a, setup, url, gpus, transport, bench_args):
    bad = 0
    for k, rate in enumerate(a.rates):
        n = a.prompts_per_rate or max(a.min_prompts, int(round(rate * a.seconds_per_rate)))
        out = os.path.join(a.out, f"sweep-{setup}-r{rate:g}.json")
        argv = [a.bin, "bench", "serve", "--base-url", url, "--request-rate", f"{rate:g}",
                "--num-prompts", str(n), "--seed", str(a.seed + 1000 * (k + 1)), "--json", out, "--disable-tqdm",
                "--label", f"{setup} r={rate:g}"] + bench_args
        print(f"sweep_rate: {setup} at {rate:g} req/s, {n} requests", flush=True)
        r = subprocess.run(argv, capture_output=True, text=True)
        sys.stdout.write("".join(l + "\n" for l in r.stdout.splitlines()
                                 if any(k in l for k in ("Successful", "Failed", "throughput", "Mean TTFT", "P99 TTFT",
                                                         "Mean ITL", "P99 ITL", "goodput"))))
        if r.returncode != 0:
            bad += 1
            print(f"sweep_rate: *** {setup} at {rate:g} req/s: bench serve exited {r.returncode}: {r.stderr.strip()[-800:]}",
                  flush=True)
        if os.path.exists(out):
            j = json.load(open(out))
            j["sweep"] = {"setup": setup, "rate": rate, "gpus": gpus, "transport": transport,
                          "device": a.device_name}
            with open(out, "w") as f:
                json.dump(j, f, indent=1)
    return bad


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/disagg", help="the disagg binary (default build/disagg)")
    ap.add_argument("--out", required=True, help="directory for the JSONs")
    ap.add_argument("--rates", type=parse_rates, required=True, help="request rates, e.g. 0.5,1,2,4")
    ap.add_argument("--prompts-per-rate", type=int, default=0, help="requests per rate (default: rate x --seconds-per-rate)")
    ap.add_argument("--seconds-per-rate", type=float, default=30, help="arrival span per rate (default 30 s)")
    ap.add_argument("--min-prompts", type=int, default=8, help="fewest requests per rate (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--colocated", metavar="URL", help="a running colocated server")
    ap.add_argument("--pd", metavar="URL", help="a running P/D proxy (disagg proxy, vLLM's toy proxy ...)")
    ap.add_argument("--gpus-colocated", type=int, default=1, help="GPUs the colocated server holds (per-GPU figures)")
    ap.add_argument("--gpus-pd", type=int, default=2, help="GPUs P and D hold together (default 2; 1 when they share one)")
    ap.add_argument("--device-name", default="GPU",
                    help="what --gpus-* count, for the per-device figures (default GPU; e.g. 'CPU host')")
    ap.add_argument("--start", metavar="MODEL", help="start the servers here from MODEL (colocated, then P + D + proxy)")
    ap.add_argument("--serve-args", default="", help="more `disagg serve` flags for every instance (--start)")
    ap.add_argument("--colocated-serve-args", default="", help="flags for the colocated instance only (--start)")
    ap.add_argument("--pd-serve-args", default="", help="flags for P and D only (--start), e.g. half the threads")
    ap.add_argument("--prefill-serve-args", default="", help="flags for P only (--start), e.g. --device cuda:0")
    ap.add_argument("--decode-serve-args", default="", help="flags for D only (--start), e.g. --device cuda:1")
    ap.add_argument("--pd-protocol", default=None,
                    help="mooncake_protocol of P and D (--start): tcp, shm, cuda_ipc; default: the connector's choice")
    ap.add_argument("--setups", default="colocated,pd", help="which to run: colocated,pd (default both)")
    ap.add_argument("--warmup", type=int, default=2, help="requests sent before each setup's sweep (default 2)")
    a = ap.parse_args(argv)
    setups = [s for s in a.setups.split(",") if s]
    if any(s not in ("colocated", "pd") for s in setups) or not setups:
        ap.error(f"--setups '{a.setups}': accepted: colocated, pd (comma-separated)")
    if not a.start and not ((a.colocated or "colocated" not in setups) and (a.pd or "pd" not in setups)):
        ap.error("give --start MODEL, or the running servers: --colocated URL and --pd URL")
    if not os.access(a.bin, os.X_OK):
        ap.error(f"--bin {a.bin}: not an executable")
    os.makedirs(a.out, exist_ok=True)
    logdir = os.path.join(a.out, "sweep-logs")
    os.makedirs(logdir, exist_ok=True)
    transport = a.pd_protocol or "auto"
    serve_args = shlex.split(a.serve_args)

    def warm(url):
        if a.warmup:
            subprocess.run([a.bin, "bench", "serve", "--base-url", url, "--num-prompts", str(a.warmup),
                            "--disable-tqdm", "--seed", "12345"] + bench_args, capture_output=True, text=True)

    bad = 0
    for setup in setups:
        procs = []
        try:
            if setup == "colocated":
                url = a.colocated
                if a.start:
                    c = Proc(a.bin, "colocated", ["serve", a.start, "--host", "127.0.0.1", "--port", "{port}",
                                                  *serve_args, *shlex.split(a.colocated_serve_args)], logdir)
                    procs.append(c)
                    url = c.url
                warm(url)
                bad += run_rates(a, "colocated", url, a.gpus_colocated, "none", bench_args)
            else:
                url = a.pd
                if a.start:
                    boot = free_port()
                    p = Proc(a.bin, "prefill", ["serve", a.start, "--host", "127.0.0.1", "--port", "{port}",
                                                "--kv-transfer-config", kv_cfg("kv_producer", a.pd_protocol),
                                                *serve_args, *shlex.split(a.pd_serve_args),
                                                *shlex.split(a.prefill_serve_args)], logdir, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot)})
                    procs.append(p)
                    d = Proc(a.bin, "decode", ["serve", a.start, "--host", "127.0.0.1", "--port", "{port}",
                                               "--kv-transfer-config", kv_cfg("kv_consumer", a.pd_protocol),
                                               *serve_args, *shlex.split(a.pd_serve_args),
                                               *shlex.split(a.decode_serve_args)], logdir)
                    procs.append(d)
                    x = Proc(a.bin, "proxy", ["proxy", "--host", "127.0.0.1", "--port", "{port}",
                                              "--prefill", p.url, str(boot), "--decode", d.url], logdir)
                    procs.append(x)
                    url = x.url
                warm(url)
                bad += run_rates(a, "pd", url, a.gpus_pd, transport, bench_args)
        finally:
            for pr in reversed(procs):
                pr.stop()
    print(f"sweep_rate: JSONs in {a.out}; {bad} failed run(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
