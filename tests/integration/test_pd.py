"""Prefill/decode disaggregation end to end: a kv_producer and a
kv_consumer `disagg serve`, requests sent the way vLLM's proxy sends them
(PROTOCOL.md section 1), output compared token for token with a colocated
`disagg serve` of the same model; failure handling, deadlines and block
accounting checked through /metrics."""
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import time
import uuid

import pytest
import requests

from server_harness import BIN, MODEL, Server, free_port

TIMEOUT = 120


def producer_config(extra=None, **kw):
    cfg = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
           "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    cfg["kv_connector_extra_config"].update(extra or {})
    cfg.update(kw)
    return json.dumps(cfg)


def consumer_config(extra=None, **kw):
    cfg = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
           "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    cfg["kv_connector_extra_config"].update(extra or {})
    cfg.update(kw)
    return json.dumps(cfg)


COMMON = ("--max-model-len", "1024", "--kv-cache-memory", "96M", "--block-size", "16")


class PD:
    """A producer, a consumer and the proxy's side of PROTOCOL.md section 1."""

    def __init__(self, p_env=None, d_env=None, p_cfg=None, d_cfg=None):
        self.boot_port = free_port()
        env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.boot_port)}
        env.update(p_env or {})
        self.p = Server(*COMMON, "--kv-transfer-config", p_cfg or producer_config(), env=env)
        try:
            self.d = Server(*COMMON, "--kv-transfer-config", d_cfg or consumer_config(), env=d_env)
        except Exception:
            self.p.stop()
            raise
        self.bootstrap = f"http://127.0.0.1:{self.boot_port}"
        table = requests.get(self.bootstrap + "/query", timeout=10).json()
        self.engine_id = table["0"]["engine_id"]

    def stop(self):
        for s in (self.d, self.p):
            if s.proc.poll() is None:
                s.stop()

    def send(self, body, endpoint="/v1/completions", p_body_edit=None, d_body_edit=None):
        """Send to P and D at the same time, as the proxy does; returns (P response, D response)."""
        tid = "xfer-" + str(uuid.uuid4())
        pb = dict(body, max_tokens=1, stream=False)
        pb.pop("stream_options", None)
        if "max_completion_tokens" in pb:
            pb["max_completion_tokens"] = 1
        pb["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
        if p_body_edit:
            p_body_edit(pb)
        db = dict(body)
        db["kv_transfer_params"] = {"do_remote_decode": False, "do_remote_prefill": True,
                                    "remote_engine_id": self.engine_id,
                                    "remote_bootstrap_addr": self.bootstrap, "transfer_id": tid}
        if d_body_edit:
            d_body_edit(db)
        with cf.ThreadPoolExecutor(2) as ex:
            fp = ex.submit(requests.post, self.p.url + endpoint, json=pb,
                           headers={"X-Request-Id": str(uuid.uuid4())}, timeout=TIMEOUT)
            fd = ex.submit(requests.post, self.d.url + endpoint, json=db, timeout=TIMEOUT)
            return fp.result(), fd.result()


def blocks_used(server):
    m = server.metrics()
    for k, v in m.items():
        if k.split("{")[0] == "disagg:kv_blocks_used":
            return v
    raise AssertionError("no disagg:kv_blocks_used gauge in /metrics")


def wait_blocks_zero(server, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if blocks_used(server) == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"blocks still in use after {timeout} s: {blocks_used(server)}")


@pytest.fixture(scope="module")
def pd():
    x = PD()
    yield x
    x.stop()


@pytest.fixture(scope="module")
def colocated():
    s = Server(*COMMON)
    yield s
    s.stop()


def corpus_prompts():
    words = ("Fellow-Citizens of the Senate and House of Representatives: the state of the Union "
             "is strong, and our commerce with foreign nations has grown in every year of peace").split()
    prompts = [[words[0]], words[:3]]
    for n in (16, 17, 31, 33, 64, 120, 200):  # 1 to > 10 blocks of 16 tokens
        prompts.append([words[i % len(words)] for i in range(n)])
    return [" ".join(p) for p in prompts]


def completion_ids(r):
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return [int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]], c["text"], c["finish_reason"]


def assert_kv_pulled(usage, computed=None):
    """D's usage (docs/server.md, usage.kv_transfer): every prompt token not in D's own prefix
    cache had its KV sent by P, and D ran at most the last prompt token — 1 when it recomputed
    it for its logits (logprobs, n > 1), 0 when P's first token came with the KV (the
    first-token handoff, docs/connector.md); computed pins which.  A D that silently
    recomputed the prompt gives the same text but fails this."""
    kv = usage["kv_transfer"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert kv["received_prompt_tokens"] == usage["prompt_tokens"] - cached > 0, usage
    if computed is None:
        assert kv["computed_prompt_tokens"] in (0, 1), usage
    else:
        assert kv["computed_prompt_tokens"] == computed, usage


def assert_prefilled(usage):
    """P's usage: it computed the prompt (less its prefix-cache hits) and received nothing."""
    kv = usage["kv_transfer"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert kv["received_prompt_tokens"] == 0, usage
    assert kv["computed_prompt_tokens"] == usage["prompt_tokens"] - cached > 0, usage


BODY = {"model": "tiny", "max_tokens": 24, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True}


@pytest.mark.parametrize("prompt", corpus_prompts(), ids=lambda p: f"{len(p.split())}w")
def test_pd_greedy_equals_colocated(pd, colocated, prompt):
    body = dict(BODY, prompt=prompt)
    ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
    pr, dr = pd.send(body)
    assert pr.status_code == 200, pr.text
    assert pr.json()["kv_transfer_params"] is None
    assert len(pr.json()["choices"][0]["logprobs"]["tokens"]) == 1
    assert completion_ids(dr) == ref
    assert_prefilled(pr.json()["usage"])
    assert_kv_pulled(dr.json()["usage"], computed=1)  # logprobs: D recomputes the last position


def test_pd_seeded_sampling_equals_colocated(pd, colocated):
    body = dict(BODY, prompt=corpus_prompts()[5], temperature=0.9, top_p=0.95, seed=1234, max_tokens=32)
    ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
    _, dr = pd.send(body)
    assert completion_ids(dr) == ref
    assert_kv_pulled(dr.json()["usage"])


def test_pd_chat_streaming_equals_colocated(pd, colocated):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "What is the state of the Union?"}],
            "max_tokens": 20, "temperature": 0}
    ref = requests.post(colocated.url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json()
    sbody = dict(body, stream=True, stream_options={"include_usage": True})
    pr, dr = pd.send(sbody, endpoint="/v1/chat/completions")
    assert pr.status_code == 200 and dr.status_code == 200, (pr.text, dr.text)
    text, usage = "", None
    for line in dr.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                text += ch.get("delta", {}).get("content") or ""
            usage = ev.get("usage") or usage
    assert text == ref["choices"][0]["message"]["content"]
    assert_kv_pulled(usage, computed=0)  # n 1, no logprobs: P's first token is handed off
    assert dr.text.rstrip().endswith("data: [DONE]")


def test_pd_shared_prefixes_and_concurrency(pd, colocated):
    base = corpus_prompts()[-1]
    prompts = [base + f" and in the year {1800 + i} the Congress" for i in range(32)]
    bodies = [dict(BODY, prompt=p, max_tokens=12) for p in prompts]
    with cf.ThreadPoolExecutor(32) as ex:
        refs = list(ex.map(lambda b: completion_ids(
            requests.post(colocated.url + "/v1/completions", json=b, timeout=TIMEOUT)), bodies))
        outs = list(ex.map(lambda b: pd.send(b), bodies))
    for (pr, dr), ref in zip(outs, refs):
        assert pr.status_code == 200, pr.text
        assert completion_ids(dr) == ref
        assert_kv_pulled(dr.json()["usage"])  # each request's own KV, even with shared prefixes
    wait_blocks_zero(pd.p)
    wait_blocks_zero(pd.d)
    m = pd.p.metrics()
    assert m.get('disagg:kv_transfers_total{side="producer",result="ok"}', 0) >= 32
    assert m.get("disagg:kv_transfer_bytes_total", 0) > 0


def test_pull_before_prefill_waits(pd, colocated):
    """D's pull reaches P before P's request: P waits for the prefill, then sends."""
    body = dict(BODY, prompt=corpus_prompts()[4])
    ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
    tid = "xfer-" + str(uuid.uuid4())
    db = dict(body, kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": pd.engine_id,
                                        "remote_bootstrap_addr": pd.bootstrap, "transfer_id": tid})
    pb = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    with cf.ThreadPoolExecutor(2) as ex:
        fd = ex.submit(requests.post, pd.d.url + "/v1/completions", json=db, timeout=TIMEOUT)
        deadline = time.time() + 30  # D's pull has started (a blind sleep could race D's admission)
        while pd.d.metric("disagg:kv_transfer_loading_requests") != 1 and time.time() < deadline:
            time.sleep(0.05)
        assert pd.d.metric("disagg:kv_transfer_loading_requests") == 1
        time.sleep(1.0)  # its query and connect take milliseconds: the pull is waiting at P by now
        pr = requests.post(pd.p.url + "/v1/completions", json=pb, timeout=TIMEOUT)
        assert pr.status_code == 200
        assert completion_ids(fd.result()) == ref
        assert_kv_pulled(fd.result().json()["usage"])


def test_bad_kv_transfer_params_rejected(pd):
    r = requests.post(pd.d.url + "/v1/completions", json=dict(
        BODY, prompt="x", kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t"}), timeout=30)
    assert r.status_code == 400 and "remote_engine_id" in r.text
    r = requests.post(pd.p.url + "/v1/completions", json=dict(
        BODY, prompt="x", kv_transfer_params={"do_remote_prefill": True, "transfer_id": "t",
                                              "remote_engine_id": "e", "remote_bootstrap_addr": "http://x:1"}),
        timeout=30)
    assert r.status_code == 400 and "kv_consumer" in r.text


def test_requests_without_params_are_colocated(pd, colocated):
    body = dict(BODY, prompt=corpus_prompts()[2])
    ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
    for s in (pd.p, pd.d):
        r = requests.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert completion_ids(r) == ref
        assert "kv_transfer" not in r.json()["usage"]  # a colocated request: no P/D accounting


# ---- deadlines and failures, each with its own small instances -------------------------------

def test_abort_timeout_frees_unpulled_blocks():
    x = PD(p_env={"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "2"})
    try:
        body = dict(BODY, prompt=corpus_prompts()[6], max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True, "transfer_id": "xfer-lonely"})
        assert requests.post(x.p.url + "/v1/completions", json=body, timeout=TIMEOUT).status_code == 200
        # kept for a pull that never comes; the engine publishes its block count at the end of
        # the step that answered, which a fast reply can beat: look again for up to 1.5 s
        # (the blocks are kept 2 s)
        t0 = time.time()
        while blocks_used(x.p) == 0 and time.time() - t0 < 1.5:
            time.sleep(0.02)
        assert blocks_used(x.p) > 0
        wait_blocks_zero(x.p, timeout=10)
        assert x.p.metrics().get("disagg:kv_transfer_expired_total", 0) >= 1
    finally:
        x.stop()


def test_unknown_transfer_fails_decode_within_deadline():
    x = PD(p_env={"DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT": "2"})
    try:
        body = dict(BODY, prompt=corpus_prompts()[3], kv_transfer_params={
            "do_remote_prefill": True, "remote_engine_id": x.engine_id,
            "remote_bootstrap_addr": x.bootstrap, "transfer_id": "xfer-never-sent-to-p"})
        t0 = time.time()
        r = requests.post(x.d.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert time.time() - t0 < 20
        assert r.status_code >= 400 or r.json()["choices"][0]["finish_reason"] == "error", r.text
        assert "transfer" in r.text
        wait_blocks_zero(x.d)
        wait_blocks_zero(x.p)
    finally:
        x.stop()


def test_prefill_rejected_fails_decoder_within_abort_timeout():
    """P rejects its request (bad max_tokens), so no request with that transfer_id
    ever reaches P's connector: D's pull is answered with an error when P's
    DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT passes, D's request fails cleanly, no block
    stays in use."""
    x = PD(p_env={"DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT": "2"})
    try:
        def break_p(pb):
            pb["max_tokens"] = -5

        t0 = time.time()
        pr, dr = x.send(dict(BODY, prompt=corpus_prompts()[3]), p_body_edit=break_p)
        assert pr.status_code == 400
        assert time.time() - t0 < 15
        assert dr.status_code >= 400 or dr.json()["choices"][0]["finish_reason"] == "error", dr.text
        assert "did not reach" in dr.text or "no request" in dr.text, dr.text
        wait_blocks_zero(x.d)
        wait_blocks_zero(x.p)
    finally:
        x.stop()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_producer_killed(policy, colocated):
    x = PD(p_env={"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "3"},
           d_cfg=consumer_config(kv_load_failure_policy=policy),
           d_env={"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "3", "VLLM_MOONCAKE_CONNECTOR_TIMEOUT": "1"})
    try:
        body = dict(BODY, prompt=corpus_prompts()[5])
        ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
        x.p.proc.send_signal(signal.SIGKILL)
        x.p.proc.wait(10)
        t0 = time.time()
        db = dict(body, kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": x.engine_id,
                                            "remote_bootstrap_addr": x.bootstrap, "transfer_id": "xfer-dead"})
        r = requests.post(x.d.url + "/v1/completions", json=db, timeout=TIMEOUT)
        assert time.time() - t0 < 70
        if policy == "recompute":
            assert completion_ids(r) == ref
            u = r.json()["usage"]  # nothing came over the wire: D computed the prompt itself
            assert u["kv_transfer"]["received_prompt_tokens"] == 0, u
            assert u["kv_transfer"]["computed_prompt_tokens"] == \
                u["prompt_tokens"] - (u["prompt_tokens_details"] or {}).get("cached_tokens", 0), u
        else:
            assert r.status_code >= 400 or r.json()["choices"][0]["finish_reason"] == "error", r.text
        wait_blocks_zero(x.d)
    finally:
        x.stop()


def test_bootstrap_unreachable_fails_startup_after_three_attempts():
    dead = free_port()
    cfg = producer_config({"bootstrap_server_address": f"127.0.0.1:{dead}"})
    env = dict(os.environ, VLLM_MOONCAKE_CONNECTOR_TIMEOUT="0.5")
    t0 = time.time()
    r = subprocess.run([BIN, "serve", str(MODEL), "--port", str(free_port()), "--kv-cache-memory", "32M",
                        "--max-model-len", "256", "--kv-transfer-config", cfg],
                       capture_output=True, text=True, timeout=60, env=env)
    elapsed = time.time() - t0
    assert r.returncode != 0
    assert "3 attempt" in r.stderr or "attempts" in r.stderr, r.stderr[-2000:]
    assert f"127.0.0.1:{dead}" in r.stderr
    assert 2.5 < elapsed < 30  # backoff 1 s + 2 s between the three attempts


@pytest.mark.parametrize("cfg,needle", [
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_prducer"}', "kv_role"),
    ('{"kv_connector":"NixlConnector","kv_role":"kv_producer"}', "NixlConnector"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_producer","kv_rol":1}', "kv_rol"),
    ('not json', "JSON"),
])
def test_bad_kv_transfer_config_rejected_at_startup(cfg, needle):
    r = subprocess.run([BIN, "serve", str(MODEL), "--port", str(free_port()), "--kv-cache-memory", "32M",
                        "--kv-transfer-config", cfg], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr[-2000:]


def test_producer_dies_while_decoder_waits_fails_fast():
    """ZeroMQ does not report a vanished peer: the decoder probes the producer's
    bootstrap server and gives up within seconds, not the 540 s pull timeout.
    The abandoned pull's blocks are quarantined (a late write could still land)
    and then freed."""
    x = PD()
    try:
        body = dict(BODY, prompt=corpus_prompts()[6], kv_transfer_params={
            "do_remote_prefill": True, "remote_engine_id": x.engine_id,
            "remote_bootstrap_addr": x.bootstrap, "transfer_id": "xfer-p-dies"})
        with cf.ThreadPoolExecutor(1) as ex:
            t0 = time.time()
            f = ex.submit(requests.post, x.d.url + "/v1/completions", json=body, timeout=TIMEOUT)
            time.sleep(1.5)  # the pull waits at P for a request that never comes
            x.p.proc.send_signal(signal.SIGKILL)
            x.p.proc.wait(10)
            r = f.result()
        assert time.time() - t0 < 20, "the decoder did not notice the dead producer"
        assert r.status_code >= 400 or r.json()["choices"][0]["finish_reason"] == "error", r.text
        assert "unreachable" in r.text, r.text
        assert blocks_used(x.d) > 0  # quarantined
        wait_blocks_zero(x.d, timeout=60)
    finally:
        x.stop()


# ---- kv_both and an external bootstrap server -------------------------------------------------

def pd_pair(p, p_bootstrap, d, body, endpoint="/v1/completions"):
    """One request prefilled on p and decoded on d (the proxy's two bodies, sent together)."""
    engine_id = requests.get(p_bootstrap + "/query", timeout=10).json()["0"]["engine_id"]
    tid = "xfer-" + str(uuid.uuid4())
    pb = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                                      "transfer_id": tid})
    db = dict(body, kv_transfer_params={"do_remote_decode": False, "do_remote_prefill": True,
                                        "remote_engine_id": engine_id, "remote_bootstrap_addr": p_bootstrap,
                                        "transfer_id": tid})
    with cf.ThreadPoolExecutor(2) as ex:
        fp = ex.submit(requests.post, p.url + endpoint, json=pb, timeout=TIMEOUT)
        fd = ex.submit(requests.post, d.url + endpoint, json=db, timeout=TIMEOUT)
        return fp.result(), fd.result()


def test_kv_both_is_producer_for_one_request_and_consumer_for_another(colocated):
    """Two kv_both instances A and B: request 1 prefilled on A and decoded on B, request 2
    prefilled on B and decoded on A, request 3 colocated on A; each equals the colocated
    answer, and each decoder's KV came from the other instance."""
    both = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})
    ports = (free_port(), free_port())
    a = Server(*COMMON, "--kv-transfer-config", both, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(ports[0])})
    try:
        b = Server(*COMMON, "--kv-transfer-config", both, env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(ports[1])})
    except Exception:
        a.stop()
        raise
    boot_a, boot_b = (f"http://127.0.0.1:{p}" for p in ports)
    try:
        prompts = corpus_prompts()
        for (p, bp, d), prompt in zip([(a, boot_a, b), (b, boot_b, a)], (prompts[6], prompts[7])):
            body = dict(BODY, prompt=prompt)
            ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
            pr, dr = pd_pair(p, bp, d, body)
            assert pr.status_code == 200, pr.text
            assert completion_ids(dr) == ref
            assert_prefilled(pr.json()["usage"])
            assert_kv_pulled(dr.json()["usage"])
        for s in (a, b):  # each served once as producer (and once as consumer, checked above)
            m = s.metrics()
            assert m.get('disagg:kv_transfers_total{side="producer",result="ok"}', 0) == 1, m
        body = dict(BODY, prompt=prompts[5])  # no kv_transfer_params on kv_both: colocated
        r = requests.post(a.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert completion_ids(r) == completion_ids(
            requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
        assert "kv_transfer" not in r.json()["usage"]
        wait_blocks_zero(a)
        wait_blocks_zero(b)
    finally:
        for s in (a, b):
            s.stop()


def test_prefill_registers_with_external_bootstrap(colocated):
    """`disagg bootstrap` started on its own; the prefill names it in bootstrap_server_address
    (and embeds none); its rank appears there; the decoder resolves the producer through it."""
    bs = subprocess.Popen([BIN, "bootstrap", "--host", "127.0.0.1", "--port", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p = d = None
    try:
        line = bs.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        ext = line.strip().rsplit(" ", 1)[1]  # http://127.0.0.1:PORT
        assert requests.get(ext + "/query", timeout=10).json() == {}
        embed_port = free_port()  # where an embedded server would listen: must stay closed
        p = Server(*COMMON, "--kv-transfer-config",
                   producer_config({"bootstrap_server_address": ext[len("http://"):]}),
                   env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(embed_port)})
        table = requests.get(ext + "/query", timeout=10).json()
        assert list(table) == ["0"], table
        assert table["0"]["engine_id"]
        assert table["0"]["worker_addr"]["0"]["0"].startswith("tcp://"), table
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{embed_port}/query", timeout=5)
        d = Server(*COMMON, "--kv-transfer-config", consumer_config())
        body = dict(BODY, prompt=corpus_prompts()[6])
        ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
        pr, dr = pd_pair(p, ext, d, body)
        assert pr.status_code == 200, pr.text
        assert completion_ids(dr) == ref
        assert_kv_pulled(dr.json()["usage"])
        wait_blocks_zero(p)
        wait_blocks_zero(d)
    finally:
        for s in (d, p):
            if s:
                s.stop()
        bs.send_signal(signal.SIGTERM)
        assert bs.wait(10) == 0
