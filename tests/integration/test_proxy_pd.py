"""`disagg proxy` in front of real `disagg serve` instances: a
kv_producer and a kv_consumer behind the proxy, the official `openai` client
in front; answers compared with a colocated `disagg serve` of the same model."""
import json
import os
import signal
import subprocess
import time

import openai
import pytest
import requests

import server_harness
from proxy_fixtures import ProxyProc
from server_harness import BIN, MODEL, Server, free_port
from test_pd import COMMON, assert_kv_pulled, consumer_config, producer_config, wait_blocks_zero

TIMEOUT = 120


class Prefill:
    """A kv_producer `disagg serve` with its own bootstrap port; with `same_as`, a
    restart of that prefill: the same API and bootstrap ports."""

    def __init__(self, env=None, same_as=None):
        self.bootstrap_port = same_as.bootstrap_port if same_as else free_port()
        e = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap_port)}
        e.update(env or {})
        saved = server_harness.free_port
        if same_as:
            server_harness.free_port = lambda: same_as.server.port
        try:
            self.server = Server(*COMMON, "--kv-transfer-config", producer_config(), env=e)
        finally:
            server_harness.free_port = saved
        self.url = self.server.url


def decode(env=None):
    return Server(*COMMON, "--kv-transfer-config", consumer_config(), env=env)


@pytest.fixture(scope="module")
def colocated():
    s = Server(*COMMON)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stack():
    p = Prefill()
    d = decode()
    px = ProxyProc([p], [d])
    px.wait_ready(30)
    yield p, d, px
    px.proc.terminate()
    px.proc.wait(10)
    d.stop()
    p.server.stop()


PROMPTS = ["Fellow-Citizens of the Senate and House of Representatives:",
           "The state of the Union is strong, and " * 12,
           "Commerce"]


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long", "one"])
def test_completions_through_proxy_equal_colocated(stack, colocated, prompt):
    _, _, px = stack
    kw = dict(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    want = client(colocated.url).completions.create(**kw).choices[0].text
    got = client(px.url).completions.create(**kw)
    assert got.choices[0].text == want
    # D's KV came from P, and P's first token with it (the first-token handoff): D computed
    # no prompt position
    assert_kv_pulled(got.usage.model_dump(), computed=0)
    chunks = list(client(px.url).completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == want
    assert_kv_pulled(chunks[-1].usage.model_dump(), computed=0)


def test_chat_through_proxy_equal_colocated(stack, colocated):
    _, _, px = stack
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell the Congress about trade."}],
              max_tokens=24, temperature=0)
    want = client(colocated.url).chat.completions.create(**kw).choices[0].message.content
    got = client(px.url).chat.completions.create(**kw)
    assert got.choices[0].message.content == want
    assert_kv_pulled(got.usage.model_dump(), computed=0)
    parts = []
    for c in client(px.url).chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if c.choices and c.choices[0].delta.content:
            parts.append(c.choices[0].delta.content)
    assert "".join(parts) == want


def test_kv_really_moved_and_blocks_return(stack):
    p, d, px = stack
    ok = 'disagg:kv_transfers_total{side="producer",result="ok"}'
    m0 = p.server.metrics()
    got = client(px.url).completions.create(model="tiny", prompt=PROMPTS[1] + " again", max_tokens=4,
                                            temperature=0)
    assert_kv_pulled(got.usage.model_dump(), computed=0)
    m = p.server.metrics()  # this request's transfer, not an earlier test's
    assert m.get(ok, 0) == m0.get(ok, 0) + 1
    assert m.get("disagg:kv_transfer_bytes_total", 0) > m0.get("disagg:kv_transfer_bytes_total", 0)
    # the transport that carried it (host memory, mooncake_protocol tcp): tcp, nothing else
    t = 'disagg:kv_transfer_transport_%s_total{transport="%s"}'
    assert m[t % ("requests", "tcp")] == m0.get(t % ("requests", "tcp"), 0) + 1
    assert m[t % ("bytes", "tcp")] - m0.get(t % ("bytes", "tcp"), 0) == \
        m["disagg:kv_transfer_bytes_total"] - m0.get("disagg:kv_transfer_bytes_total", 0)
    for other in ("shm", "rdma", "cuda_ipc"):
        assert m[t % ("requests", other)] == 0
    assert "moved over tcp" in open(p.server.log_path).read()  # P names the transport once
    wait_blocks_zero(p.server)
    wait_blocks_zero(d)


ABORTED = 'vllm:request_success_total{model_name="tiny",engine="0",finished_reason="abort"}'


def test_client_cancel_mid_stream_frees_decoder_blocks(stack):
    p, d, px = stack
    aborted_before = d.metrics().get(ABORTED, 0)
    gen_before = d.metric("vllm:generation_tokens_total")
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 900, "ignore_eos": True, "stream": True,
            "temperature": 0}
    r = requests.post(px.url + "/v1/completions", json=body, stream=True, timeout=TIMEOUT)
    it = r.iter_lines()
    got = 0
    for line in it:
        if line.startswith(b"data: "):
            got += 1
            if got == 3:
                break
    r.close()  # the client goes away mid-stream
    wait_blocks_zero(d, timeout=20)
    wait_blocks_zero(p.server, timeout=20)
    # the proxy cancelled D's request: aborted there, not run to its 900 tokens
    assert d.metrics().get(ABORTED, 0) == aborted_before + 1
    assert d.metric("vllm:generation_tokens_total") - gen_before < 900


def test_two_prefills_two_decodes_both_policies(colocated):
    ps = [Prefill(), Prefill()]
    ds = [decode(), decode()]
    try:
        for policy in ("round_robin", "least_loaded"):
            px = ProxyProc(ps, ds, extra=("--policy", policy))
            try:
                px.wait_ready(30)
                for i in range(8):
                    kw = dict(model="tiny", prompt=f"{PROMPTS[0]} number {i}", max_tokens=8, temperature=0)
                    want = client(colocated.url).completions.create(**kw).choices[0].text
                    got = client(px.url).completions.create(**kw)
                    assert got.choices[0].text == want
                    assert_kv_pulled(got.usage.model_dump(), computed=0)
            finally:
                px.proc.terminate()
                px.proc.wait(10)
        # every instance took part
        for s in [p.server for p in ps] + ds:
            m = s.metrics()
            n = sum(v for k, v in m.items() if k.startswith("vllm:request_success_total"))
            assert n >= 1, s.url
    finally:
        for s in ds + [p.server for p in ps]:
            s.stop()


def test_503_until_prefill_is_discovered_then_serves(colocated):
    bp = free_port()
    dead_url_port = free_port()

    class Late:  # the prefill's address before it exists
        url = f"http://127.0.0.1:{dead_url_port}"
        bootstrap_port = bp

    d = decode()
    px = ProxyProc([Late], [d])
    p = None
    try:
        r = requests.post(px.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                          timeout=10)
        assert r.status_code == 503 and "error" in r.json()
        # now start the real prefill on the address the proxy was given
        env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bp)}
        p = subprocess.Popen([BIN, "serve", str(MODEL), "--host", "127.0.0.1", "--port", str(dead_url_port),
                              "--served-model-name", "tiny", *COMMON, "--kv-transfer-config", producer_config()],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, **env))
        px.wait_ready(60)
        kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        want = client(colocated.url).completions.create(**kw).choices[0].text
        assert client(px.url).completions.create(**kw).choices[0].text == want
    finally:
        px.proc.terminate()
        px.proc.wait(10)
        d.stop()
        if p is not None:
            p.send_signal(signal.SIGTERM)
            p.wait(20)


def test_prefill_killed_client_gets_error_promptly():
    p = Prefill(env={"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "3"})
    d = decode(env={"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "3"})
    px = ProxyProc([p], [d])
    try:
        px.wait_ready(30)
        p.server.proc.send_signal(signal.SIGKILL)
        p.server.proc.wait(10)
        t0 = time.time()
        r = requests.post(px.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0],
                                                             "max_tokens": 8}, timeout=TIMEOUT)
        assert time.time() - t0 < 30
        assert r.status_code in (502, 503), r.text
        assert "prefill" in r.text.lower()
        wait_blocks_zero(d)
    finally:
        px.proc.terminate()
        px.proc.wait(10)
        d.stop()


def test_request_both_instances_reject_gets_the_prefills_400_unchanged(stack):
    """P and D both reject the request (a bad sampling value): the client gets a 400 with
    P's error body, every time (it used to be P's 502 or D's 400, whichever came first)."""
    p, d, px = stack
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": -1}
    direct = requests.post(p.url + "/v1/completions", json=dict(body, max_tokens=1), timeout=TIMEOUT)
    assert direct.status_code == 400, direct.text
    for _ in range(5):
        r = requests.post(px.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == direct.json()["error"]["message"]
    wait_blocks_zero(d)
    wait_blocks_zero(p.server)


# --- n/best_of, rewritten fields, stopped P, killed D -------------------------------------------------------------


def test_n_and_best_of_through_the_proxy(stack, colocated):
    """`n: 2, best_of: 2` works on serve and now through the proxy too."""
    _, _, px = stack
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, n=2, extra_body={"best_of": 2})
    want = client(colocated.url).completions.create(**kw)
    got = client(px.url).completions.create(**kw)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    assert len(got.choices) == 2


def test_best_of_greater_than_n(stack, colocated):
    """best_of 4, n 2 (vLLM's best_of): the two of the four seeded sequences with the highest
    cumulative logprob, in that order -- the same four sequences n 4 returns (choice i samples
    with seed + i) ranked here by the sums of their token logprobs; through the proxy (D
    generates them) equal to colocated; usage counts all four."""
    _, _, px = stack
    base = dict(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=77)
    four = client(colocated.url).completions.create(n=4, logprobs=0, **base)
    ranked = sorted(four.choices, key=lambda c: (-sum(c.logprobs.token_logprobs), c.index))
    assert len({c.text for c in four.choices}) > 1
    for url in (colocated.url, px.url):
        got = client(url).completions.create(n=2, extra_body={"best_of": 4}, **base)
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [c.text for c in ranked[:2]]
        assert got.usage.completion_tokens == four.usage.completion_tokens
        assert all(c.logprobs is None for c in got.choices)  # not asked for


def test_request_d_would_refuse_never_reaches_p(stack):
    """Fields P's copy rewrites (n, max_tokens, ...) are refused by the proxy
    with the server's 400 body shape and param, and P never gets the request (so it holds no
    KV for it)."""
    p, d, px = stack
    key = f'disagg_proxy_backend_requests_total{{role="prefill",backend="{p.url}"}}'
    before = px.metrics()[key]
    for field, value in (("n", 0), ("max_tokens", 0), ("best_of", 0)):
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, field: value}
        direct = requests.post(d.url + "/v1/completions", json=body, timeout=TIMEOUT)
        r = requests.post(px.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == direct.status_code == 400, (r.text, direct.text)
        e, de = r.json()["error"], direct.json()["error"]
        assert (e["type"], e["param"], e["code"]) == (de["type"], de["param"], de["code"]) == \
            ("BadRequestError", field, 400)
        assert e["message"].split(" between")[0] == de["message"].split(" between")[0], (e, de)
    assert px.metrics()[key] == before, "the prefill instance was contacted"
    wait_blocks_zero(p.server)


def test_stopped_prefill_gives_the_client_an_error_within_seconds():
    """P is SIGSTOPped (its sockets still accept): the client's request
    through the proxy ends in a 5xx within seconds — the proxy gives P up after its health
    probes go unanswered, without waiting for D — and the proxy stays up and serves again
    once P resumes."""
    p = Prefill()
    d = decode()
    px = ProxyProc([p], [d])
    stopped = False
    try:
        px.wait_ready(30)
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        assert requests.post(px.url + "/v1/completions", json=body, timeout=TIMEOUT).status_code == 200
        os.kill(p.server.proc.pid, signal.SIGSTOP)
        stopped = True
        t0 = time.monotonic()
        r = requests.post(px.url + "/v1/completions", json=body, timeout=60)
        took = time.monotonic() - t0
        print(f"client's error {took:.2f} s after P was stopped: {r.status_code} {r.text[:200]}")
        assert 500 <= r.status_code < 600, r.text
        assert took <= 10, took
        assert "prefill" in r.text.lower()
        hc = requests.get(px.url + "/healthcheck", timeout=5)
        assert hc.status_code == 200 and hc.json()["status"] == "ok"
        os.kill(p.server.proc.pid, signal.SIGCONT)
        stopped = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = requests.post(px.url + "/v1/completions", json=body, timeout=TIMEOUT)
            if r.status_code == 200:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
    finally:
        if stopped:
            os.kill(p.server.proc.pid, signal.SIGCONT)
        px.proc.terminate()
        px.proc.wait(10)
        d.stop()
        p.server.stop()


@pytest.mark.parametrize("chat", [False, True])
def test_decode_killed_mid_stream_gives_the_openai_client_an_api_error(chat):
    """D is killed (SIGKILL) during a streamed answer: the official openai
    client gets APIError naming the decode instance (the proxy's final error event), not a
    broken chunked encoding."""
    p = Prefill()
    d = decode()
    px = ProxyProc([p], [d])
    try:
        px.wait_ready(30)
        c = client(px.url)
        kw = dict(model="tiny", max_tokens=900, temperature=0, stream=True, extra_body={"ignore_eos": True})
        got = 0
        with pytest.raises(openai.APIError) as ei:
            if chat:
                it = c.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[0]}], **kw)
            else:
                it = c.completions.create(prompt=PROMPTS[0], **kw)
            for _ in it:
                got += 1
                if got == 3:
                    d.proc.send_signal(signal.SIGKILL)
                    d.proc.wait(10)
        assert not isinstance(ei.value, openai.APIConnectionError), repr(ei.value)
        assert "decode instance" in str(ei.value) and d.url in str(ei.value), str(ei.value)
        assert 3 <= got < 900
        assert requests.get(px.url + "/healthcheck", timeout=5).status_code == 200
    finally:
        px.proc.terminate()
        px.proc.wait(10)
        if d.proc.poll() is None:
            d.stop()
        p.server.stop()


# ---- a prefill restarted on the same ports --------------------------------------------


def refreshes(px, p, trigger):
    return px.metrics().get(f'disagg_proxy_engine_table_refreshes_total{{backend="{p.url}",'
                            f'trigger="{trigger}"}}')


def engine_ids(p):
    return sorted(e["engine_id"] for e in requests.get(
        f"http://127.0.0.1:{p.bootstrap_port}/query", timeout=5).json().values())


def test_prefill_restarted_within_a_probe_period_is_used_with_its_new_engine_id(colocated):
    """P killed and started again on the same ports before the proxy's next health
    probe: no probe ever failed, the proxy still holds the old engine id, and D
    answers 400 "bootstrap server ... knows no engine".  The proxy re-reads P's
    table and resends D once with the new id (same transfer): the client sees
    the answer, D pulled P's KV."""
    p, d = Prefill(), decode()
    started = [p.server, d]
    # no periodic probe within the test: the restart is "faster than the probe period"
    px = ProxyProc([p], [d], extra=["--health-interval", "300"])
    try:
        px.wait_ready(30)
        kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        want = client(colocated.url).completions.create(**kw).choices[0].text
        assert client(px.url).completions.create(**kw).choices[0].text == want
        old = engine_ids(p)
        p.server.proc.kill()
        p.server.proc.wait()
        p = Prefill(same_as=p)
        started.append(p.server)
        assert engine_ids(p) != old  # a restart registers new engine ids
        assert refreshes(px, p, "unknown_engine") == 0
        got = client(px.url).completions.create(**kw)  # openai raises on the stale-id 400
        assert got.choices[0].text == want
        assert_kv_pulled(got.usage.model_dump(), computed=0)  # D pulled the restarted P's KV
        m = px.metrics()
        assert m["disagg_proxy_stale_engine_retries_total"] == 1, px.output()[-3000:]
        assert refreshes(px, p, "unknown_engine") == 1
        assert refreshes(px, p, "probe") == 0
        assert m['disagg_proxy_errors_total{reason="decode_rejected"}'] == 0
        assert "restarted" in px.output() and old[0] in px.output()
        # the table is current now: the next requests (streamed too) go straight through
        chunks = list(client(px.url).completions.create(stream=True, **kw))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert px.metrics()["disagg_proxy_stale_engine_retries_total"] == 1
    finally:
        assert px.stop() == 0, px.output()[-3000:]
        for s in started:
            s.stop()
    assert all(s.proc.poll() is not None for s in started)


def test_prefill_restarted_slower_than_the_probe_period(colocated):
    """P down for several probe periods (0.1 s): the failed probes take it out,
    the passing one re-reads its table; requests use the new id from the start."""
    p, d = Prefill(), decode()
    started = [p.server, d]
    px = ProxyProc([p], [d])
    try:
        px.wait_ready(30)
        kw = dict(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=0)
        want = client(colocated.url).completions.create(**kw).choices[0].text
        assert client(px.url).completions.create(**kw).choices[0].text == want
        p.server.stop()
        deadline = time.monotonic() + 10
        while requests.get(px.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, px.output()[-3000:]
            time.sleep(0.05)
        p = Prefill(same_as=p)
        started.append(p.server)
        px.wait_ready(30)
        got = client(px.url).completions.create(**kw)
        assert got.choices[0].text == want
        assert_kv_pulled(got.usage.model_dump(), computed=0)
        assert refreshes(px, p, "probe") == 1
        assert px.metrics()["disagg_proxy_stale_engine_retries_total"] == 0
    finally:
        assert px.stop() == 0, px.output()[-3000:]
        for s in started:
            s.stop()
    assert all(s.proc.poll() is not None for s in started)
