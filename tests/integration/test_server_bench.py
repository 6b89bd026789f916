"""`disagg bench serve` against a real `disagg serve`: every request completes, the token
counts are the server's usage numbers, and --json writes vLLM's result keys."""
import json
import os
import subprocess

import pytest

from server_harness import BIN, Server
from upstream_double import UpstreamDouble


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


def test_bench_serve_times_each_event(tmp_path):
    """TTFT and ITL are taken when each SSE event arrives, not when the response ends: a
    server that sends each event 0.3 s after the one before (3 tokens, then usage and
    [DONE]) gives TTFT and ITL of at least 0.3 s and an end-to-end latency well beyond TTFT."""
    up = UpstreamDouble("decode")
    up.stream_interval = 0.3
    try:
        out = tmp_path / "r.json"
        r = subprocess.run([BIN, "bench", "serve", "--base-url", up.url, "--num-prompts", "2",
                            "--random-input-len", "8", "--random-output-len", "3",
                            "--max-concurrency", "1", "--json", str(out), "--disable-tqdm"],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, OPENAI_API_KEY="bench-key"))
        assert r.returncode == 0, r.stdout + r.stderr
        j = json.loads(out.read_text())
        assert j["completed"] == 2 and j["total_output_tokens"] == 6, j
        assert j["mean_ttft_ms"] >= 280 and j["mean_itl_ms"] >= 280, j
        assert j["mean_e2el_ms"] - j["mean_ttft_ms"] >= 1000, j
        # the model came from GET /v1/models; every request carried the key
        assert [q["path"] for q in up.requests if q["method"] == "GET"] == ["/v1/models"]
        assert all(q["headers"]["authorization"] == "Bearer bench-key" for q in up.requests)
        assert all(c["json"]["model"] == up.model and c["headers"]["content-type"] == "application/json"
                   for c in up.completions())
    finally:
        up.stop()


def test_bench_serve_pd(tmp_path):
    """--pd-prefill: each request goes to a real kv_producer and kv_consumer at once (as the
    proxy sends them); the P/D section counts every prefill and the decoder's KV loads."""
    from test_pd import PD
    pd = PD()
    try:
        out = tmp_path / "pd.json"
        r = subprocess.run([BIN, "bench", "serve", "--base-url", pd.d.url, "--pd-prefill", pd.p.url,
                            "--pd-bootstrap", pd.bootstrap, "--num-prompts", "4",
                            "--random-input-len", "40", "--random-output-len", "4", "--ignore-eos",
                            "--max-concurrency", "2", "--json", str(out), "--disable-tqdm"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "P/D (prefill instance, KV load)" in r.stdout
        j = json.loads(out.read_text())
        assert j["completed"] == 4 and j["failed"] == 0 and j["total_output_tokens"] == 16
        assert j["pd_prefill_ok"] == 4 and j["kv_loads"] == 4, j
        assert j["mean_prefill_latency_ms"] > 0 and j["mean_kv_wait_ms"] >= 0
        # a bootstrap address with nothing there: refused before any request, naming it
        r = subprocess.run([BIN, "bench", "serve", "--base-url", pd.d.url, "--pd-prefill", pd.p.url,
                            "--pd-bootstrap", "http://127.0.0.1:1", "--num-prompts", "1",
                            "--disable-tqdm"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "127.0.0.1:1/query" in r.stderr, r.stderr
    finally:
        pd.stop()
