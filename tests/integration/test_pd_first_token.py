"""The first-token handoff (docs/connector.md): P's prefill samples the first output
token (the computation a colocated prefill does) and sends it with the KV, in the
pull's FINISH reply ("disagg_first_tokens"); D emits it as its first output token
without a forward step and decodes on from it, so D computes no prompt position
(usage.kv_transfer.computed_prompt_tokens == 0, disagg:kv_first_token_handoffs_total
{outcome="used"}).  Output equals a colocated `disagg serve` for greedy and seeded
sampling, streaming and not, with stop ids, stop strings, min_tokens and max_tokens 1
applied to P's token.  Requests the handoff cannot serve exactly (logprobs, n > 1)
and a switched-off handoff (first_token_handoff: false on either side) recompute the
last prompt position as before (computed_prompt_tokens == 1).  A producer that sends
a bad token (outside the vocabulary, a wrong shape) is not believed: D recomputes."""
import concurrent.futures as cf
import http.server
import json
import threading
import uuid

import msgpack
import pytest
import requests
import zmq

from server_harness import Server
from test_pd import COMMON, PD, TIMEOUT, consumer_config, producer_config, wait_blocks_zero

USED = 'disagg:kv_first_token_handoffs_total{outcome="used"}'
REFUSED = 'disagg:kv_first_token_handoffs_total{outcome="refused"}'

PROMPTS = ["Fellow-Citizens of the Senate",
           "Fellow-Citizens of the Senate and House of Representatives: the state of the Union "
           "is strong, and our commerce with foreign nations has grown",
           " ".join(["the state of the Union is strong"] * 12),
           list(range(300, 316)),   # token ids: exactly one block (16), P's token opens the next
           list(range(400, 432))]   # exactly two blocks


def pid(p):
    return f"{len(p)}ids" if isinstance(p, list) else f"{len(p)}c"


@pytest.fixture(scope="module")
def pd():
    x = PD()
    yield x
    rd, rp = x.d.stop(), x.p.stop()
    assert rd == 0 and rp == 0, x.d.logs() + x.p.logs()  # a clean exit: sanitizer reports fail it


@pytest.fixture(scope="module")
def colocated():
    s = Server(*COMMON)
    yield s
    assert s.stop() == 0, s.logs()


def post(server, body, endpoint="/v1/completions"):
    r = requests.post(server.url + endpoint, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def outcome(j):
    """What must equal between colocated and P/D: every choice's text and ending."""
    ch = [(c.get("text", (c.get("message") or {}).get("content")), c["finish_reason"],
           c.get("stop_reason")) for c in j["choices"]]
    return ch, j["usage"]["completion_tokens"]


def kv_usage(j):
    kv = j["usage"]["kv_transfer"]
    cached = (j["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert kv["received_prompt_tokens"] == j["usage"]["prompt_tokens"] - cached > 0, j["usage"]
    return kv["computed_prompt_tokens"]


def send_pd(pd, body, endpoint="/v1/completions"):
    used = pd.d.metrics().get(USED, 0)
    pr, dr = pd.send(body, endpoint, p_body_edit=lambda pb: pb.pop("min_tokens", None))  # as the proxy
    assert pr.status_code == 200, pr.text
    assert pr.json()["kv_transfer_params"] is None  # the wire contract: unchanged
    assert dr.status_code == 200, dr.text
    return pr, dr, pd.d.metrics().get(USED, 0) - used


GREEDY = {"model": "tiny", "max_tokens": 20, "temperature": 0}
SEEDED = {"model": "tiny", "max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "seed": 1234,
          "repetition_penalty": 1.1}


@pytest.mark.parametrize("prompt", PROMPTS, ids=pid)
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_handoff_equals_colocated(pd, colocated, prompt, sampling):
    body = dict(sampling, prompt=prompt)
    ref = post(colocated, body)
    pr, dr, used = send_pd(pd, body)
    assert outcome(dr.json()) == outcome(ref)
    assert kv_usage(dr.json()) == 0, dr.json()["usage"]  # no prompt position computed on D
    assert used == 1
    # D's first output token is the one P answered with
    assert dr.json()["choices"][0]["text"].startswith(pr.json()["choices"][0]["text"])
    if isinstance(prompt, list):
        assert dr.json()["usage"]["prompt_tokens"] == len(prompt)


def sse_texts(r):
    texts, usage = [], None
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev.get("choices", []):
            t = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            if t:
                texts.append(t)
    return texts, usage


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_handoff_streaming(pd, colocated, sampling):
    body = dict(sampling, prompt=PROMPTS[1])
    ref = post(colocated, body)
    tid = "xfer-" + str(uuid.uuid4())
    pb = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                                      "transfer_id": tid})
    db = dict(body, stream=True, stream_options={"include_usage": True},
              kv_transfer_params={"do_remote_decode": False, "do_remote_prefill": True,
                                  "remote_engine_id": pd.engine_id,
                                  "remote_bootstrap_addr": pd.bootstrap, "transfer_id": tid})
    with cf.ThreadPoolExecutor(2) as ex:
        fp = ex.submit(requests.post, pd.p.url + "/v1/completions", json=pb, timeout=TIMEOUT)
        fd = ex.submit(requests.post, pd.d.url + "/v1/completions", json=db, stream=True, timeout=TIMEOUT)
        pr, dr = fp.result(), fd.result()
        assert pr.status_code == 200 and dr.status_code == 200, pr.text
        texts, usage = sse_texts(dr)
    assert "".join(texts) == ref["choices"][0]["text"]
    assert texts[0] == pr.json()["choices"][0]["text"]  # the first chunk carries P's token
    assert usage["kv_transfer"]["computed_prompt_tokens"] == 0, usage


def first_token(colocated, prompt):
    j = post(colocated, dict(GREEDY, prompt=prompt, max_tokens=1, logprobs=0,
                             return_tokens_as_token_ids=True))
    return int(j["choices"][0]["logprobs"]["tokens"][0].split(":", 1)[1]), j["choices"][0]["text"]


def test_stop_conditions_apply_to_p_token(pd, colocated):
    prompt = PROMPTS[1]
    t0, text0 = first_token(colocated, prompt)
    cases = [dict(GREEDY, max_tokens=1),                        # ends at P's token: length
             dict(GREEDY, stop_token_ids=[t0]),                 # P's token is a stop id
             dict(GREEDY, stop_token_ids=[t0], min_tokens=2),   # ... but min_tokens holds it
             dict(GREEDY, stop=[text0.strip() or text0])]       # a stop string in P's token
    for c in cases:
        body = dict(c, prompt=prompt)
        ref = post(colocated, body)
        _, dr, used = send_pd(pd, body)
        assert outcome(dr.json()) == outcome(ref), c
        assert kv_usage(dr.json()) == 0 and used == 1, (c, dr.json()["usage"])
    wait_blocks_zero(pd.p)
    wait_blocks_zero(pd.d)


def test_chat_handoff(pd, colocated):
    body = dict(GREEDY, messages=[{"role": "user", "content": PROMPTS[1]}])
    ref = post(colocated, body, "/v1/chat/completions")
    _, dr, used = send_pd(pd, body, "/v1/chat/completions")
    assert outcome(dr.json()) == outcome(ref)
    assert kv_usage(dr.json()) == 0 and used == 1


def test_fallbacks_recompute(pd, colocated):
    """logprobs (D must compute the first token's distribution) and n > 1 (the
    other choices share choice 0's blocks, deferred until its first token) keep
    recomputing the last prompt position."""
    refused = pd.d.metrics().get(REFUSED, 0)
    body = dict(GREEDY, prompt=PROMPTS[1], logprobs=2)
    ref = post(colocated, body)
    _, dr, used = send_pd(pd, body)
    assert dr.json()["choices"][0]["logprobs"] == ref["choices"][0]["logprobs"]
    assert kv_usage(dr.json()) == 1 and used == 0
    assert pd.d.metrics()[REFUSED] == refused + 1
    body = dict(SEEDED, prompt=PROMPTS[1], n=2)
    ref = post(colocated, body)
    _, dr, used = send_pd(pd, dict(body))
    assert outcome(dr.json()) == outcome(ref)
    assert kv_usage(dr.json()) >= 1 and used == 0
    assert pd.d.metrics()[REFUSED] == refused + 2


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_switched_off(colocated, side):
    off = {"first_token_handoff": False}
    x = PD(p_cfg=producer_config(off) if side == "producer" else None,
           d_cfg=consumer_config(off) if side == "consumer" else None)
    try:
        body = dict(GREEDY, prompt=PROMPTS[1])
        ref = post(colocated, body)
        _, dr, used = send_pd(x, body)
        assert outcome(dr.json()) == outcome(ref)
        assert kv_usage(dr.json()) == 1 and used == 0
    finally:
        rd, rp = x.d.stop(), x.p.stop()
    assert rd == 0 and rp == 0, x.d.logs() + x.p.logs()


def test_bad_switch_value_refused():
    import subprocess
    from server_harness import BIN, MODEL
    r = subprocess.run([str(BIN), "serve", str(MODEL), "--port", "1", "--kv-transfer-config",
                        consumer_config({"first_token_handoff": "no"})],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "kv_connector_extra_config.first_token_handoff" in r.stderr + r.stdout
    assert "true (default) or false" in r.stderr + r.stdout


# ---- a producer that lies: a pyzmq ROUTER answering every pull FINISH with a given
# "disagg_first_tokens" value (and writing no KV), behind a bootstrap /query answer


class FakeProducer:
    def __init__(self, first_tokens_value):
        self.value = first_tokens_value
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"tcp://127.0.0.1:{port}"
        self.stop_ev = threading.Event()
        self.pulls = 0
        self.t = threading.Thread(target=self.serve, daemon=True)
        self.t.start()
        table = {"0": {"engine_id": "fake-p", "worker_addr": {"0": {"0": self.addr}}}}

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(h):
                b = json.dumps(table).encode()
                h.send_response(200)
                h.send_header("Content-Type", "application/json")
                h.send_header("Content-Length", str(len(b)))
                h.end_headers()
                h.wfile.write(b)

            def log_message(h, *a):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.bootstrap = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def serve(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop_ev.is_set():
            if not poller.poll(100):
                continue
            ident, frame = self.sock.recv_multipart()
            pull = msgpack.unpackb(frame, raw=False)
            rids = list(pull["req_blocks"])
            self.pulls += 1
            reply = {"status": 0, "ok_reqs": rids,
                     "disagg_first_tokens": {r: self.value for r in rids}}
            self.sock.send_multipart([ident, msgpack.packb(reply)])

    def close(self):
        self.stop_ev.set()
        self.t.join(5)
        self.sock.close()
        self.http.shutdown()


@pytest.fixture(scope="module")
def lone_d():
    d = Server(*COMMON, "--kv-transfer-config", consumer_config())
    yield d
    assert d.stop() == 0, d.logs()


@pytest.mark.parametrize("value,used", [([5], 1), ([10 ** 8], 0), (["5"], 0), ([5, 6], 0), (5, 0)],
                         ids=["valid", "outside-vocab", "string", "two-tokens", "not-a-list"])
def test_producer_token_validated(lone_d, value, used):
    fake = FakeProducer(value)
    try:
        m0 = lone_d.metrics()
        body = dict(GREEDY, prompt=PROMPTS[1], max_tokens=1,
                    kv_transfer_params={"do_remote_decode": False, "do_remote_prefill": True,
                                        "remote_engine_id": "fake-p", "remote_bootstrap_addr": fake.bootstrap,
                                        "transfer_id": "xfer-" + str(uuid.uuid4())})
        j = post(lone_d, body)
        assert fake.pulls == 1
        m1 = lone_d.metrics()
        assert m1.get(USED, 0) - m0.get(USED, 0) == used
        assert kv_usage(j) == 1 - used
        if used:  # D's only output token is the one the producer sent
            tok = requests.post(lone_d.url + "/detokenize", json={"model": "tiny", "tokens": [5]},
                                timeout=10).json()["prompt"]
            assert j["choices"][0]["text"] == tok
        # a token outside the vocabulary reaches the engine and is refused there (logged);
        # malformed entries are dropped by the reply decoder
        assert m1.get(REFUSED, 0) - m0.get(REFUSED, 0) == (1 if value == [10 ** 8] else 0)
        if value == [10 ** 8]:
            assert "is not used (the token is outside the vocabulary" in lone_d.logs()
    finally:
        fake.close()


@pytest.mark.parametrize("prompt", [PROMPTS[1], PROMPTS[2]], ids=pid)
def test_prompt_logprobs_computed_on_d(pd, colocated, prompt):
    """prompt_logprobs and echo + logprobs through P/D: D received the prompt's KV but
    no logits for its positions, so it computes the prompt itself -- the values equal
    a colocated instance's, never made-up zeros (every prompt position computed on D)."""
    for extra in ({"prompt_logprobs": 3}, {"echo": True, "logprobs": 2},
                  {"prompt_logprobs": 0, "echo": True, "logprobs": 0}):
        body = dict(GREEDY, prompt=prompt, max_tokens=4, **extra)
        ref = post(colocated, body)
        _, dr, used = send_pd(pd, body)
        got = dr.json()
        assert used == 0
        assert got["usage"]["kv_transfer"]["computed_prompt_tokens"] == got["usage"]["prompt_tokens"]
        for c, rc in zip(got["choices"], ref["choices"]):
            assert c["text"] == rc["text"]
            assert c.get("prompt_logprobs") == rc.get("prompt_logprobs"), extra
            assert c["logprobs"] == rc["logprobs"], extra
        if "prompt_logprobs" in extra:
            plp = got["choices"][0]["prompt_logprobs"]
            assert plp[0] is None and len(plp) == got["usage"]["prompt_tokens"]
            assert all(e and max(v["logprob"] for v in e.values()) <= 0 for e in plp[1:])
            assert any(v["logprob"] < 0 for e in plp[1:] for v in e.values())
    # chat: prompt_logprobs sits beside the choices
    body = dict(GREEDY, max_tokens=4, prompt_logprobs=1,
                messages=[{"role": "user", "content": prompt}])
    ref = post(colocated, body, "/v1/chat/completions")
    _, dr, _ = send_pd(pd, body, "/v1/chat/completions")
    assert dr.json()["prompt_logprobs"] == ref["prompt_logprobs"] and ref["prompt_logprobs"]
