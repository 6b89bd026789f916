"""Tensor parallelism on the CPU (docs/parallel.md): `disagg serve -tp N` runs N real
processes (rank 0 serving, N-1 workers it starts), each holding its share of the heads, the
MLP and the vocabulary, summing over shared memory.  Greedy output at TP 2 (KV heads split)
and TP 4 (the tiny model's 2 KV heads replicated) equals TP 1's, or differs only after a
near-tie (the all-reduce adds the ranks' partial sums, not one long dot); logprobs agree to
1e-3.  A worker that dies fails the running request and stops the server with a message
naming it; bad -tp / executor / data-parallel flags are refused clearly."""
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from server_harness import BIN, MODEL, ROOT, Server, on_gpu

pytestmark = pytest.mark.skipif(on_gpu(), reason="CPU tensor parallelism (shared memory)")

PROMPTS = [
    "The state of the union is",
    "Mr. Speaker, Mr. Vice President, members of Congress",
    "Our economy",
    "We will",
    "Tonight I want to talk about",
    "The American people",
    "In the last year,",
    "Health care",
]
N_TOKENS = 24


def greedy(srv, prompt):
    r = requests.post(srv.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0,
        "logprobs": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]


@pytest.fixture(scope="module")
def tp1():
    s = Server("--threads", "1", "--kv-cache-memory", "64M", "-tp", "1")
    yield s
    assert s.stop() == 0


@pytest.mark.parametrize("n", [2, 4])
def test_tp_greedy_equals_tp1(tp1, n):
    srv = Server("--threads", "1", "--kv-cache-memory", "64M", "-tp", str(n))
    try:
        assert f"tensor parallelism: rank 0 of {n}" in srv.logs()
        near_ties = 0
        for p in PROMPTS:
            want, want_lp, want_top = greedy(tp1, p)
            got, got_lp, _ = greedy(srv, p)
            for i, (a, b) in enumerate(zip(want, got)):
                if a != b:  # only where TP 1's two best were (nearly) tied
                    best = sorted(want_top[i].values(), reverse=True)
                    assert best[0] - best[1] < 1e-3, (p, i, a, b, want_top[i])
                    near_ties += 1
                    break
                assert abs(want_lp[i] - got_lp[i]) < 1e-3, (p, i, want_lp[i], got_lp[i])
        assert near_ties == 0  # none on these prompts (docs/parallel.md counts them)
    finally:
        assert srv.stop() == 0
    assert "tp-worker" in srv.log_path.read_text()


def test_tp_output_is_reproducible_run_to_run():
    """The shared-memory sum is rank 0 + rank 1 in order: two TP-2 servers give the same bits."""
    outs = []
    for _ in range(2):
        srv = Server("--threads", "1", "--kv-cache-memory", "64M", "-tp", "2")
        try:
            outs.append([greedy(srv, p)[1] for p in PROMPTS[:3]])
        finally:
            srv.stop()
    assert outs[0] == outs[1]


def serve_fails(*args):
    r = subprocess.run([BIN, "serve", str(MODEL), "--port", "1", *args], capture_output=True,
                       text=True, timeout=60)
    return r.returncode, r.stderr


def test_bad_parallel_flags_are_refused():
    rc, err = serve_fails("-tp", "3")
    assert rc == 2 and "--tensor-parallel-size 3 is not supported; accepted: 1, 2, 4 or 8" in err
    rc, err = serve_fails("--distributed-executor-backend", "ray")
    assert rc == 2 and "'ray' is not supported; accepted: mp" in err, err
    rc, err = serve_fails("-tp", "2", "--distributed-executor-backend", "uni")
    assert rc == 2 and "--tensor-parallel-size 2 needs mp" in err, err
    rc, err = serve_fails("--data-parallel-size", "2")
    assert rc == 2 and "--data-parallel-size 2 is not supported" in err, err
    rc, err = serve_fails("-tp", "2", "--device", "cuda:1")
    assert rc == 2 and "rank r runs on cuda:r" in err, err
    rc, err = serve_fails("-tp", "2", "--kv-transfer-config",
                          '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer",'
                          '"kv_connector_extra_config":{"layerwise":true}}')
    assert rc == 2 and ("kv_connector_extra_config.layerwise true with --tensor-parallel-size 2 "
                        "is not implemented") in err, err


def test_tp_that_does_not_divide_the_heads_is_refused(tmp_path):
    d = tmp_path / "llama-tiny"  # 4 query heads, 2 KV heads
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_random_model.py"), "--out", str(d),
                    "--variant", "llama-tiny"], check=True, capture_output=True)
    r = subprocess.run([BIN, "serve", str(d), "--port", "1", "-tp", "8", "--threads", "1",
                        "--kv-cache-memory", "16M"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--tensor-parallel-size 8 does not divide the model's num_attention_heads 4" in r.stderr


def test_a_dying_worker_fails_the_request_and_stops_the_server():
    srv = Server("--threads", "1", "--kv-cache-memory", "64M", "-tp", "2")
    try:
        workers = subprocess.run(["pgrep", "-P", str(srv.proc.pid)], capture_output=True,
                                 text=True).stdout.split()
        assert len(workers) == 1, workers
        t0 = time.time()
        with requests.post(srv.url + "/v1/completions", stream=True, timeout=60, json={
                "model": "tiny", "prompt": "The state of the union is", "max_tokens": 1500,
                "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)  # generating
            os.kill(int(workers[0]), signal.SIGKILL)
            try:  # an error event, or (when the shutdown wins the race) the stream cut short
                rest = b"\n".join(x for x in lines)
                assert b"error" in rest and b'"finish_reason":"length"' not in rest, rest[-400:]
            except requests.exceptions.ChunkedEncodingError:
                pass
        assert srv.proc.wait(timeout=30) == 1
        assert time.time() - t0 < 30
        log = srv.logs()
        assert f"tensor-parallel worker rank 1 (pid {workers[0]}) was killed by signal 9" in log
        assert "the server cannot run without it; stopping" in log
    finally:
        srv.stop()


@pytest.mark.parametrize("variant", ["llama-tiny", "qwen3-tiny", "mistral-tiny", "qwen3moe-tiny",
                                     "mixtral-tiny"])
def test_tp2_equals_tp1_on_every_architecture(tmp_path, variant):
    """Qwen3's q/k norms, Mistral's window and untied lm_head, the MoE layers (router replicated,
    each expert's intermediate split): TP 2 gives TP 1's greedy tokens and logprobs."""
    d = tmp_path / variant
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_random_model.py"), "--out", str(d),
                    "--variant", variant], check=True, capture_output=True)
    one = Server("--threads", "1", "--kv-cache-memory", "32M", "-tp", "1", model=str(d))
    two = Server("--threads", "1", "--kv-cache-memory", "32M", "-tp", "2", model=str(d))
    try:
        for p in PROMPTS[:3]:
            want, want_lp, _ = greedy(one, p)
            got, got_lp, _ = greedy(two, p)
            assert want == got, (p, want, got)
            assert max(abs(a - b) for a, b in zip(want_lp, got_lp)) < 1e-4
    finally:
        assert one.stop() == 0
        assert two.stop() == 0


def test_tp2_batched_and_prompt_logprobs_equal_tp1(tp1):
    """Concurrent requests (one forward carries several sequences, prefill chunks and decodes
    mixed, each with its block table) and prompt logprobs (every prompt row's logits gathered
    over the ranks) at TP 2 equal TP 1's."""
    from concurrent.futures import ThreadPoolExecutor
    srv = Server("--threads", "1", "--kv-cache-memory", "64M", "-tp", "2",
                 "--max-num-batched-tokens", "64")
    try:
        want = [greedy(tp1, p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            got = list(ex.map(lambda p: greedy(srv, p), PROMPTS))
        for p, w, g in zip(PROMPTS, want, got):
            assert w[0] == g[0], p
            assert max(abs(a - b) for a, b in zip(w[1], g[1])) < 1e-3

        def plp(s):
            r = requests.post(s.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": PROMPTS[1] * 4, "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": 1})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["prompt_logprobs"]
        a, b = plp(tp1), plp(srv)
        assert len(a) == len(b) > 40
        for x, y in zip(a[1:], b[1:]):
            assert x.keys() == y.keys()
            for k in x:
                assert abs(x[k]["logprob"] - y[k]["logprob"]) < 1e-3
    finally:
        assert srv.stop() == 0
