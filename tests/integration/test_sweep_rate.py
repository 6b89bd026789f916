"""tools/sweep_rate.py end to end on the tiny model: it starts a colocated server, then a
P/D pair (KV over tcp) behind `disagg proxy`, runs `disagg bench serve` at each rate against
each, and leaves one JSON per run (vLLM's keys plus the sweep's setup) that
tools/plot_benchmarks.py --sweep draws."""
import json
import subprocess
import sys
from pathlib import Path

from server_harness import BIN, MODEL

ROOT = Path(__file__).resolve().parents[2]


def test_sweep_colocated_and_pd(tmp_path):
    out = tmp_path / "sweep"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "sweep_rate.py"), "--bin", BIN, "--out", str(out),
                        "--rates", "4,8", "--prompts-per-rate", "4", "--warmup", "1", "--start", str(MODEL),
                        "--serve-args", "--max-model-len 512 --block-size 16 --kv-cache-memory 32M --threads 1",
                        "--pd-protocol", "tcp", "--gpus-pd", "1",
                        "--", "--random-input-len", "48", "--random-output-len", "4", "--goodput", "ttft:60000"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    for setup in ("colocated", "pd"):
        for rate in (4, 8):
            j = json.loads((out / f"sweep-{setup}-r{rate}.json").read_text())
            assert j["completed"] == 4 and j["failed"] == 0 and j["total_output_tokens"] == 16, j
            assert j["request_rate"] == rate and j["request_goodput"] == j["request_throughput"]
            assert j["sweep"] == {"setup": setup, "rate": rate, "gpus": 1,
                                  "transport": "tcp" if setup == "pd" else "none", "device": "GPU"}
    # the P/D runs went through the proxy: the producer answered each request with its one
    # token (max_tokens 1), the consumer decoded the 4; the colocated server saw none of them
    logs = out / "sweep-logs"
    p_log, d_log = (logs / "prefill.log").read_text(), (logs / "decode.log").read_text()
    assert p_log.count("completion 1 tokens") == 4 + 4 + 1, p_log[-2000:]
    assert d_log.count("completion 4 tokens") == 4 + 4 + 1, d_log[-2000:]
    assert (logs / "colocated.log").read_text().count("completion 4 tokens") == 4 + 4 + 1
    img = tmp_path / "img"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_benchmarks.py"), "--sweep", str(out),
                        "--out", str(img)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert (img / "sweep_cpu_latency.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_refuses_bad_arguments(tmp_path):
    tool = str(ROOT / "tools" / "sweep_rate.py")
    r = subprocess.run([sys.executable, tool, "--out", str(tmp_path), "--rates", "1,-2", "--start", "m"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "request rates > 0" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, tool, "--bin", BIN, "--out", str(tmp_path), "--rates", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--start MODEL, or the running servers" in r.stderr, r.stderr
