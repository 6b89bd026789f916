"""`disagg serve` under load and cancellation: 64 simultaneous streams all complete with
the same text as when run alone; a client that disconnects mid-stream gets its request
aborted and its KV blocks freed (visible in /metrics); a repeated prompt hits the
prefix cache (visible in /metrics and usage)."""
import concurrent.futures as cf
import json
import socket
import time

import openai
import pytest
import requests

import server_harness
from server_harness import DATA, Server

GREEDY = json.loads((DATA / "sotu-tiny" / "greedy.json").read_text())
PROMPTS = [p["prompt"] for p in GREEDY["prompts"] if p["kind"] == "text"]


@pytest.fixture(scope="module")
def srv():
    # "the same text as when run alone" compares batch compositions: exact on the CPU; on a
    # GPU (DISAGG_TEST_DEVICE=cuda) only with --batch-invariant (the fast mode's kernels
    # change with the batch size, docs/gpu.md)
    inv = ("--batch-invariant",) if server_harness.on_gpu() else ()
    # 16-token blocks (the CPU's default is 128): the prefix-cache tests below use short prompts
    s = Server("--max-model-len", "512", "--kv-cache-memory", "64M", "--max-num-seqs", "64",
               "--block-size", "16", *inv)
    yield s
    rc = s.stop()
    assert rc == 0, "disagg serve did not exit cleanly on SIGTERM: " + s.logs()


def wait_for(pred, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_64_simultaneous_streams(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    alone = {}
    for p in set(prompts[:8]):
        alone[p] = client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text

    def one(p):
        chunks = list(client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    with cf.ThreadPoolExecutor(64) as ex:
        results = list(ex.map(one, prompts))
    assert len(results) == 64
    for p, (text, n) in zip(prompts, results):
        assert n >= 1 and len(text) > 0
        if p in alone:
            assert text == alone[p]  # batching does not change a greedy result
    assert wait_for(lambda: srv.metric("vllm:num_requests_running") == 0)


def test_cancel_mid_stream_frees_blocks(srv):
    assert wait_for(lambda: srv.metric("disagg:kv_blocks_used") == 0)
    aborted_before = srv.metrics().get('vllm:request_success_total{model_name="tiny",engine="0",finished_reason="abort"}', 0)
    r = requests.post(srv.url + "/v1/completions", stream=True,
                      json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0,
                            "ignore_eos": True, "stream": True})
    it = r.iter_lines()
    got = 0
    for line in it:
        if line.startswith(b"data: "):
            got += 1
            if got == 3:
                break
    assert srv.metric("disagg:kv_blocks_used") > 0
    r.close()  # the client goes away mid-stream
    assert wait_for(lambda: srv.metric("disagg:kv_blocks_used") == 0 and srv.metric("vllm:num_requests_running") == 0)
    m = srv.metrics()
    assert m['vllm:request_success_total{model_name="tiny",engine="0",finished_reason="abort"}'] == aborted_before + 1
    assert srv.metric("vllm:generation_tokens_total") < 10_000


ABORTED = 'vllm:request_success_total{model_name="tiny",engine="0",finished_reason="abort"}'


def test_cancel_non_streaming_request():
    """A non-streaming client that goes away: its request is aborted (not run to its end, which
    would free the blocks too).  The request asks for ~2000 tokens (seconds of work) and the
    client leaves as soon as it runs, so it cannot have finished by itself."""
    s = Server("--max-model-len", "2048", "--kv-cache-memory", "64M")
    try:
        body = json.dumps({"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 2000, "ignore_eos": True})
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        assert wait_for(lambda: s.metric("vllm:num_requests_running") == 1, timeout=30)
        sock.close()  # the client goes away
        assert wait_for(lambda: s.metric("disagg:kv_blocks_used") == 0 and s.metric("vllm:num_requests_running") == 0)
        m = s.metrics()
        assert m.get(ABORTED, 0) == 1, m
        assert s.metric("vllm:generation_tokens_total") < 2000
    finally:
        assert s.stop() == 0


def test_prefix_cache_hit_on_repeated_prompt(srv):
    prompt = " ".join(PROMPTS) * 2  # well over a few 16-token blocks
    hits0 = srv.metric("vllm:prefix_cache_hits_total")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    a = requests.post(srv.url + "/v1/completions", json=body).json()
    b = requests.post(srv.url + "/v1/completions", json=body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    hits = srv.metric("vllm:prefix_cache_hits_total") - hits0
    n_prompt = a["usage"]["prompt_tokens"]
    assert hits >= 16 * ((n_prompt - 1) // 16) > 0


def test_prefix_cache_hit_in_usage(srv):
    prompt = " ".join(reversed(PROMPTS)) * 2
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    a = requests.post(srv.url + "/v1/completions", json=body).json()
    b = requests.post(srv.url + "/v1/completions", json=body).json()
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * ((a["usage"]["prompt_tokens"] - 1) // 16)


def test_default_block_size_prefix_cache():
    """--block-size left out: the device's default (128 tokens on the CPU, 16 on a GPU) shows in
    vllm:cache_config_info, and a repeated long prompt reuses its whole blocks of that size."""
    s = Server("--max-model-len", "1024", "--kv-cache-memory", "64M")
    try:
        info = [k for k in s.metrics() if k.startswith("vllm:cache_config_info{")]
        want = 16 if server_harness.on_gpu() else 128
        assert len(info) == 1 and f'block_size="{want}"' in info[0], info
        prompt = " ".join(PROMPTS) * 6  # several 128-token blocks
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        a = requests.post(s.url + "/v1/completions", json=body, timeout=60).json()
        b = requests.post(s.url + "/v1/completions", json=body, timeout=60).json()
        n = a["usage"]["prompt_tokens"]
        assert n > 2 * want and a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == want * ((n - 1) // want)
    finally:
        assert s.stop() == 0, s.logs()
