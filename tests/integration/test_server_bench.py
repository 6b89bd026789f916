"""`disagg bench serve` against a real `disagg serve`: every request completes, the token
counts are the server's usage numbers, and --json writes vLLM's result keys."""
import json
import subprocess

import pytest

from server_harness import BIN, Server


@pytest.fixture(scope="module")
def srv():
    s = Server("--max-model-len", "512", "--kv-cache-memory", "32M")
    yield s
    rc = s.stop()
    assert rc == 0, "disagg serve did not exit cleanly on SIGTERM: " + s.logs()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve(srv, tmp_path, endpoint):
    out = tmp_path / "r.json"
    r = subprocess.run([BIN, "bench", "serve", "--base-url", srv.url, "--endpoint", endpoint,
                        "--num-prompts", "12", "--random-input-len", "32", "--random-output-len", "8",
                        "--ignore-eos", "--request-rate", "50", "--max-concurrency", "4",
                        "--goodput", "ttft:100000", "--json", str(out), "--disable-tqdm"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Serving Benchmark Result" in r.stdout
    j = json.loads(out.read_text())
    assert j["completed"] == 12 and j["failed"] == 0
    assert j["total_output_tokens"] == 12 * 8
    assert j["total_input_tokens"] >= 12 * 32 * 0.8
    assert j["request_goodput"] == pytest.approx(j["request_throughput"])
    for k in ("ttft", "tpot", "itl", "e2el"):
        for s in ("mean", "median", "p90", "p99"):
            assert j[f"{s}_{k}_ms"] >= 0
    assert j["median_e2el_ms"] >= j["median_ttft_ms"]


def test_bench_serve_errors():
    r = subprocess.run([BIN, "bench", "serve", "--endpoint", "/v2/x"], capture_output=True, text=True)
    assert r.returncode == 2 and "/v1/chat/completions" in r.stderr
    r = subprocess.run([BIN, "bench", "serve", "--base-url", "http://127.0.0.1:1", "--model", "m",
                        "--num-prompts", "2", "--disable-tqdm"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "failed" in r.stderr
