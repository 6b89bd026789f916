"""Layer-wise P/D streaming (docs/connector.md "Layer-wise streaming"): a decoder that asks
("disagg_layerwise" in its pull) gets each layer of each prefill chunk written while the
producer's prefill still runs; its output equals a colocated instance's token for token, with
chunked prefill (chunk x layer) and without; usage.kv_transfer.layerwise and
disagg:kv_transfer_layerwise_requests_total say it streamed, on both sides; a decoder that
does not ask keeps the whole-request path.  Faults: the producer killed mid-stream fails the
decoder's request at once (its side channel closes), the decoder's client going away
mid-stream stops the stream and both sides free their blocks.

To be sure the pull is there while P prefills, each test sends D's request first and P's once
P has the pull waiting (disagg:kv_pending_unknown_pulls), as a proxy's D request can arrive
first; the fault tests use a larger random model (--load-format dummy) so that the prefill
lasts long enough to be interrupted."""
import concurrent.futures as cf
import json
import shutil
import signal
import socket
import time
import uuid

import pytest
import requests

from server_harness import MODEL, Server, free_port
from test_pd import BODY, TIMEOUT, assert_kv_pulled, completion_ids, corpus_prompts, wait_blocks_zero

COMMON = ("--max-model-len", "1024", "--kv-cache-memory", "96M", "--block-size", "16")
LW = "disagg:kv_transfer_layerwise_requests_total"


def kv_config(role, **extra):
    extra.setdefault("layerwise", True)  # the default: said explicitly, as these tests are about it
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "kv_connector_extra_config": dict({"mooncake_protocol": "tcp"}, **extra)})


def metric(server, name, **labels):
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else name
    return server.metrics().get(want, 0)


class Pair:
    """One producer and decoders (each with its own kv_connector_extra_config)."""

    def __init__(self, p_args=(), d_cfgs=({},), model=str(MODEL), extra=(), p_env=None, d_env=None):
        self.boot_port = free_port()
        env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.boot_port)}
        env.update(p_env or {})
        self.p = Server(*COMMON, *extra, *p_args, "--kv-transfer-config", kv_config("kv_producer"),
                        model=model, env=env)
        self.ds = []
        try:
            for cfg in d_cfgs:
                self.ds.append(Server(*COMMON, *extra, "--kv-transfer-config",
                                      kv_config("kv_consumer", **cfg), model=model, env=d_env))
        except Exception:
            self.stop()
            raise
        self.bootstrap = f"http://127.0.0.1:{self.boot_port}"
        self.engine_id = requests.get(self.bootstrap + "/query", timeout=10).json()["0"]["engine_id"]

    def stop(self):
        for s in self.ds + [self.p]:
            if s.proc.poll() is None:
                s.stop()

    def d_body(self, body, tid):
        return dict(body, kv_transfer_params={
            "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": self.engine_id,
            "remote_bootstrap_addr": self.bootstrap, "transfer_id": tid})

    def p_body(self, body, tid):
        pb = dict(body, max_tokens=1, stream=False)
        pb["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": tid}
        return pb

    def wait_pull_waiting(self, n=1, timeout=15):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.p.metric("disagg:kv_pending_unknown_pulls") >= n:
                return
            time.sleep(0.02)
        raise AssertionError("the decoder's pull never reached the producer")

    def send(self, body, d=0):
        """D's request first, P's once the pull waits there; returns (P response, D response)."""
        tid = "xfer-" + str(uuid.uuid4())
        with cf.ThreadPoolExecutor(2) as ex:
            fd = ex.submit(requests.post, self.ds[d].url + "/v1/completions", json=self.d_body(body, tid),
                           timeout=TIMEOUT)
            self.wait_pull_waiting()
            fp = ex.submit(requests.post, self.p.url + "/v1/completions", json=self.p_body(body, tid),
                           timeout=TIMEOUT)
            return fp.result(), fd.result()


@pytest.fixture(scope="module")
def pair():
    # P prefills in chunks of 48 tokens: a 200-word prompt is several chunks x 6 layers
    x = Pair(p_args=("--max-num-batched-tokens", "48"), d_cfgs=({}, {"layerwise": False}))
    yield x
    x.stop()


@pytest.fixture(scope="module")
def colocated():
    s = Server(*COMMON)
    yield s
    s.stop()


@pytest.mark.parametrize("prompt", corpus_prompts()[1::2], ids=lambda p: f"{len(p.split())}w")
def test_streamed_equals_colocated(pair, colocated, prompt):
    body = dict(BODY, prompt=prompt)
    ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
    p0, d0 = metric(pair.p, LW, side="producer"), metric(pair.ds[0], LW, side="consumer")
    pr, dr = pair.send(body)
    assert pr.status_code == 200, pr.text
    assert completion_ids(dr) == ref
    kv = dr.json()["usage"]["kv_transfer"]
    assert kv["layerwise"] is True, kv
    assert_kv_pulled(dr.json()["usage"])  # every prompt token's KV came from P
    assert metric(pair.p, LW, side="producer") == p0 + 1
    assert metric(pair.ds[0], LW, side="consumer") == d0 + 1
    wait_blocks_zero(pair.p)


def test_chunks_and_shared_prefix(pair, colocated):
    """A prompt whose start P has cached (its first chunk starts past those tokens: they go at
    once, the rest by chunk and layer), then concurrent streamed requests."""
    words = corpus_prompts()[-1].split()
    prompts = [" ".join(words[:150]), " ".join(words[:150] + words[:40])]
    prompts += [" ".join(words[i:i + 90]) for i in (3, 7, 11)]
    refs = [completion_ids(requests.post(colocated.url + "/v1/completions", json=dict(BODY, prompt=p),
                                         timeout=TIMEOUT)) for p in prompts]
    for p, ref in zip(prompts[:2], refs[:2]):
        pr, dr = pair.send(dict(BODY, prompt=p))
        assert completion_ids(dr) == ref and dr.json()["usage"]["kv_transfer"]["layerwise"] is True
    assert pr.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, pr.json()["usage"]
    tids = ["xfer-" + str(uuid.uuid4()) for _ in prompts[2:]]
    with cf.ThreadPoolExecutor(6) as ex:
        fds = [ex.submit(requests.post, pair.ds[0].url + "/v1/completions",
                         json=pair.d_body(dict(BODY, prompt=p), t), timeout=TIMEOUT)
               for p, t in zip(prompts[2:], tids)]
        pair.wait_pull_waiting(len(tids))
        fps = [ex.submit(requests.post, pair.p.url + "/v1/completions",
                         json=pair.p_body(dict(BODY, prompt=p), t), timeout=TIMEOUT)
               for p, t in zip(prompts[2:], tids)]
        for fd, fp, ref in zip(fds, fps, refs[2:]):
            assert fp.result().status_code == 200
            dr = fd.result()
            assert completion_ids(dr) == ref
            assert dr.json()["usage"]["kv_transfer"]["layerwise"] is True
    wait_blocks_zero(pair.p)
    wait_blocks_zero(pair.ds[0])


def test_decoder_that_does_not_ask_keeps_the_whole_path(pair, colocated):
    """layerwise false on D: no "disagg_layerwise" in its pull, the KV goes after the prefill
    (as to a vLLM decoder); the output is the same and nothing counts as streamed."""
    body = dict(BODY, prompt=corpus_prompts()[6])
    ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
    p0 = metric(pair.p, LW, side="producer")
    pr, dr = pair.send(body, d=1)
    assert completion_ids(dr) == ref
    assert dr.json()["usage"]["kv_transfer"]["layerwise"] is False
    assert "layerwise" not in pr.json()["usage"]["kv_transfer"]  # only a decoder says
    assert metric(pair.p, LW, side="producer") == p0
    assert metric(pair.ds[1], LW, side="consumer") == 0


def test_bad_layerwise_value_is_refused_at_startup():
    import subprocess
    from server_harness import BIN
    r = subprocess.run([BIN, "serve", str(MODEL), "--port", str(free_port()), "--kv-cache-memory", "32M",
                        "--kv-transfer-config", kv_config("kv_consumer", layerwise="yes")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "kv_connector_extra_config.layerwise" in r.stderr and "true (default) or false" in r.stderr


# ---- faults, on a model whose prefill takes long enough to interrupt ---------------------------

@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("slow")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL / f, d / f)
    cfg = json.loads((MODEL / "config.json").read_text())
    cfg.update(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
               num_key_value_heads=2, layer_types=["full_attention"] * 16)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def long_body():
    words = corpus_prompts()[-1].split()
    return dict(BODY, prompt=" ".join(words[i % len(words)] for i in range(700)), max_tokens=4)


def start_stream(x, body):
    """D's request, then P's; returns once P wrote the first bytes (the stream is under way)."""
    tid = "xfer-" + str(uuid.uuid4())
    ex = cf.ThreadPoolExecutor(2)
    fd = ex.submit(requests.post, x.ds[0].url + "/v1/completions", json=x.d_body(body, tid), timeout=TIMEOUT)
    x.wait_pull_waiting()
    fp = ex.submit(requests.post, x.p.url + "/v1/completions", json=x.p_body(body, tid), timeout=TIMEOUT)
    deadline = time.time() + 60
    while x.p.metric("disagg:kv_transfer_bytes_total") == 0 and time.time() < deadline:
        assert not fp.done(), "the prefill ended before the test could interrupt it: " + fp.result().text
        time.sleep(0.01)
    assert not fp.done(), "the prefill ended before the test could interrupt it"
    return ex, fp, fd


def test_producer_killed_mid_stream_fails_the_decoder_at_once(slow_model):
    x = Pair(p_args=("--max-num-batched-tokens", "32"), model=slow_model, extra=("--load-format", "dummy"))
    try:
        ex, fp, fd = start_stream(x, long_body())
        x.p.proc.send_signal(signal.SIGKILL)
        t0 = time.time()
        x.p.proc.wait(10)
        r = fd.result()
        elapsed = time.time() - t0
        print(f"decoder answered {elapsed * 1000:.0f} ms after the producer was killed mid-stream")
        ex.shutdown()
        assert r.status_code == 502, r.text
        # how D found out (the time is printed above, informational): its side channel saw
        # P's connection close, not its liveness probe of P's bootstrap server (seconds later)
        assert "closed the connection" in r.text, r.text
        # no decode from what had landed: the request failed; its blocks are held back from reuse
        # (P may have been writing) and then freed (the quarantine, docs/connector.md)
        assert metric(x.ds[0], "disagg:kv_transfer_failures_total", side="consumer",
                      reason="producer_unreachable") == 1
        assert metric(x.ds[0], LW, side="consumer") == 0
    finally:
        x.stop()


def test_decoder_client_gone_mid_stream_frees_both_sides(slow_model):
    """The decoder's client goes away while P streams: D cancels, P stops writing and
    acknowledges (FINISH), D frees its blocks at once; P's prefill runs to its end and its
    blocks are freed then (nobody will pull them)."""
    x = Pair(p_args=("--max-num-batched-tokens", "32"), model=slow_model, extra=("--load-format", "dummy"))
    try:
        body = long_body()
        tid = "xfer-" + str(uuid.uuid4())
        raw = json.dumps(dict(x.d_body(body, tid), stream=True)).encode()
        s = socket.create_connection(("127.0.0.1", x.ds[0].port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
        x.wait_pull_waiting()
        with cf.ThreadPoolExecutor(1) as ex:
            fp = ex.submit(requests.post, x.p.url + "/v1/completions", json=x.p_body(body, tid),
                           timeout=TIMEOUT)
            deadline = time.time() + 60
            while x.p.metric("disagg:kv_transfer_bytes_total") == 0 and time.time() < deadline:
                time.sleep(0.01)
            assert not fp.done(), "the prefill ended before the test could interrupt it"
            s.close()
            t0 = time.time()
            wait_blocks_zero(x.ds[0], timeout=5)  # acknowledged: no 35 s quarantine
            print(f"decoder blocks free {time.time() - t0:.3f} s after its client left mid-stream")
            assert fp.result().status_code == 200  # P's own request is not affected
        wait_blocks_zero(x.p, timeout=10)
        assert metric(x.p, "disagg:kv_transfer_failures_total", side="producer", reason="cancelled") >= 1
        assert metric(x.ds[0], "disagg:kv_cancels_total", acked="yes") == 1
        assert metric(x.p, LW, side="producer") == 0
        # both still serve, streamed
        pr, dr = x.send(dict(BODY, prompt=corpus_prompts()[5]))
        assert dr.status_code == 200 and dr.json()["usage"]["kv_transfer"]["layerwise"] is True, dr.text
    finally:
        x.stop()
