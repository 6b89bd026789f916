"""A P/D pair under load and attack, with real
`disagg serve` producer and consumer processes on 127.0.0.1:

* D holds hundreds of concurrent KV pulls (each pull's ZeroMQ sockets fit the context's
  socket limit): 400 pulls waiting at once all wait, none fails with "Too many open files";
* at kv_connector_extra_config.max_remote_loads D refuses one more load with 503 "too many
  remote KV loads in flight" -- unless a load waits for a transfer id its producer does not
  know (a bogus pull): that one is evicted, so bogus pulls cannot starve real requests;
* a request D rejects (400) or whose decoder dies gets P's blocks freed within seconds, not
  VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (480 s);
* a hung (SIGSTOPped) producer, a bootstrap address that accepts but never answers, and a
  bootstrap entry pointing at a refused port fail D's request within seconds, naming the
  address.

Every wait polls with a deadline; the bounds are generous (the measured figures are in
docs/benchmarks.md, "P/D under load and attack")."""
import concurrent.futures as cf
import json
import os
import signal
import socket
import time
import types
import uuid

import pytest
import requests
import zmq

from proxy_fixtures import ProxyProc
from server_harness import Server, free_port
from test_pd import BODY, COMMON, PD, TIMEOUT, blocks_used, consumer_config, wait_blocks_zero
from test_pd_errors import d_params, metric, raw_post


def poll(fn, timeout, what):
    """fn() until truthy or timeout; returns its last value or fails naming what."""
    deadline = time.time() + timeout
    while True:
        v = fn()
        if v or time.time() >= deadline:
            assert v, f"{what}: not within {timeout} s"
            return v
        time.sleep(0.05)


def read_response(s, timeout=10):
    """The status and the body of the HTTP response on raw socket s."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split()[1]), body.decode(errors="replace")


def register(bootstrap, engine_id, addr, dp_rank):
    """Another data-parallel rank in P's bootstrap table (rank 0 is P itself)."""
    r = requests.post(bootstrap + "/register", timeout=10, json={
        "engine_id": engine_id, "dp_rank": dp_rank, "tp_rank": 0, "pp_rank": 0, "addr": addr})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def pd():
    x = PD(p_env={"DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT": "60"})
    yield x
    x.stop()


# ---- item 10: many concurrent pulls, the cap, eviction of bogus pulls -----------------------

def test_600_bogus_pulls_sent_to_d_do_not_starve_real_requests():
    """The issue's attack: 600 requests with bogus transfer ids sent straight to D, each making
    D pull from the real P.  Before, D failed every pull from ~340 on ("zmq_socket: Too many
    open files": 3 ZeroMQ sockets per pull, libzmq's default limit of 1,023) and real requests
    failed with them.  Now 512 (max_remote_loads) wait, the other 88 are refused or evict older
    bogus ones (P said it does not know their transfer ids), and real requests sent meanwhile
    succeed.  When the attacker leaves, D cancels them all and frees every block."""
    n = 600
    socks = []
    pd = PD(p_env={"DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT": "60"})
    try:
        t0 = time.time()
        for i in range(n):
            socks.append(raw_post(pd.d, dict(BODY, prompt="hello", max_tokens=2,
                                              kv_transfer_params=d_params(pd, transfer_id=f"bogus-{i}-{uuid.uuid4()}"))))

        def bogus_settled():
            m = pd.d.metrics()
            refused = sum(m.get(f'disagg:kv_transfer_failures_total{{side="consumer",reason="{r}"}}', 0)
                          for r in ("evicted", "too_many_loads"))
            return m["disagg:kv_transfer_loading_requests"] + refused >= n and refused >= n - 512
        poll(bogus_settled, 60, f"{n} bogus requests in flight or refused")
        print(f"{n} bogus requests settled {time.time() - t0:.2f} s after the first")
        assert pd.d.metric("disagg:kv_transfer_loading_requests") <= 512
        assert "Too many open files" not in pd.d.logs()
        assert metric(pd.d, "disagg:kv_transfer_failures_total", side="consumer",
                      reason="producer_unreachable") == 0, pd.d.logs()
        with cf.ThreadPoolExecutor(5) as ex:
            t1 = time.time()
            outs = list(ex.map(lambda k: pd.send(dict(BODY, prompt=f"The state of the Union {k}")), range(5)))
            took = time.time() - t1
        print(f"5 real requests alongside them: {took:.3f} s")
        for pr, dr in outs:
            assert pr.status_code == 200 and dr.status_code == 200, dr.text
            assert dr.json()["choices"][0]["finish_reason"] != "error", dr.text
        assert metric(pd.d, "disagg:kv_transfer_failures_total", side="consumer", reason="evicted") >= 5
        for s in socks:
            s.close()
        socks = []
        poll(lambda: pd.d.metric("disagg:kv_transfer_loading_requests") == 0, 30, "D's loads cancelled")
        wait_blocks_zero(pd.d, timeout=10)
    finally:
        for s in socks:
            s.close()
        pd.stop()


def silent_producer(pd, engine_id):
    """A pyzmq ROUTER registered in P's bootstrap server as engine_id that takes pulls and
    never answers them (a producer that is alive but slow, as D sees it)."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    register(pd.bootstrap, engine_id, f"tcp://127.0.0.1:{port}", 1)
    return router


def test_512_loads_wait_and_the_513th_is_refused_with_503():
    """The documented cap at full scale: 512 loads on a producer that answers nothing all wait
    (1,536 ZeroMQ sockets), the 513th is refused with 503 "too many remote KV loads in flight"."""
    x = PD()
    router = None
    socks = []
    try:
        router = silent_producer(x, "silent-p")
        t0 = time.time()
        for _ in range(512):
            socks.append(raw_post(x.d, dict(BODY, prompt="hello", max_tokens=2,
                                             kv_transfer_params=d_params(x, remote_engine_id="silent-p"))))
        poll(lambda: x.d.metric("disagg:kv_transfer_loading_requests") == 512, 60, "512 loads in flight")
        print(f"512 loads waiting {time.time() - t0:.2f} s after the first request")
        r = requests.post(x.d.url + "/v1/completions", timeout=TIMEOUT, json=dict(
            BODY, prompt="hello", kv_transfer_params=d_params(x, remote_engine_id="silent-p")))
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert "too many remote KV loads in flight" in msg and "max_remote_loads 512" in msg, msg
        assert "Too many open files" not in x.d.logs()
    finally:
        for s in socks:
            s.close()
        if router is not None:
            router.close()
        x.stop()


def test_cap_refuses_one_more_load_with_503_and_evicts_bogus_pulls_first():
    """max_remote_loads 4.  Four loads on a producer that answers nothing: the fifth is refused
    with 503 "too many remote KV loads in flight" naming the key.  Then four bogus pulls (P says
    it does not know their transfer ids) fill the cap: a real request evicts the oldest of them
    (503 "evicted") and succeeds."""
    x = PD(p_env={"DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT": "60"},
           d_cfg=consumer_config({"max_remote_loads": 4}))
    router = None
    socks = []
    try:
        router = silent_producer(x, "silent-p")
        for _ in range(4):
            socks.append(raw_post(x.d, dict(BODY, prompt="hello", max_tokens=2,
                                             kv_transfer_params=d_params(x, remote_engine_id="silent-p"))))
        poll(lambda: x.d.metric("disagg:kv_transfer_loading_requests") == 4, 20, "4 loads in flight")
        r = requests.post(x.d.url + "/v1/completions", timeout=TIMEOUT, json=dict(
            BODY, prompt="hello", kv_transfer_params=d_params(x, remote_engine_id="silent-p")))
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert "too many remote KV loads in flight" in msg and "max_remote_loads 4" in msg, msg
        assert metric(x.d, "disagg:kv_transfer_failures_total", side="consumer", reason="too_many_loads") == 1
        # the silent producer goes away: D's four pulls fail at once (disconnect)
        router.close()
        router = None
        for s in socks:
            status, body = read_response(s)
            assert status == 502 and "closed the connection" in body, body
            s.close()
        socks = []
        # (their blocks stay quarantined: a producer that vanished without a final reply might
        # still be writing into them -- docs/connector.md)
        poll(lambda: x.d.metric("disagg:kv_transfer_loading_requests") == 0, 5, "the loads ended")

        # four bogus pulls on the real producer
        for i in range(4):
            socks.append(raw_post(x.d, dict(BODY, prompt="hello", max_tokens=2,
                                             kv_transfer_params=d_params(x, transfer_id=f"bogus-{i}"))))
            poll(lambda: x.d.metric("disagg:kv_loads_unknown_transfer") == i + 1, 20,
                 f"bogus pull {i} marked unknown")  # one at a time: socks[0] is the oldest
        pr, dr = x.send(dict(BODY, prompt="The state of the Union"))
        assert pr.status_code == 200 and dr.status_code == 200, dr.text
        assert dr.json()["choices"][0]["finish_reason"] != "error", dr.text
        status, body = read_response(socks[0])
        assert status == 503, body
        assert "too many remote KV loads in flight: evicted" in body and "max_remote_loads 4" in body, body
        assert metric(x.d, "disagg:kv_transfer_failures_total", side="consumer", reason="evicted") == 1
        assert x.d.metric("disagg:kv_loads_unknown_transfer") == 3
    finally:
        for s in socks:
            s.close()
        if router is not None:
            router.close()
        x.stop()


# ---- item 11: P frees what D will not pull --------------------------------------------------

@pytest.mark.parametrize("edit,needle", [
    ({"n": 0}, "n"),
    ({"max_tokens": 100000}, "maximum context length"),
])
def test_request_d_rejects_frees_p_blocks(pd, edit, needle):
    """P and D get the request at the same time (the proxy's contract); D refuses it (400) but P
    takes its one-token copy and keeps the KV for a pull.  D tells P to release (a pull with no
    block ids, as vLLM's D sends): P's blocks are free within seconds, not 480 s."""
    wait_blocks_zero(pd.p, timeout=10)
    pr, dr = pd.send(dict(BODY, prompt="Fellow-Citizens of the Senate and House of Representatives"),
                     d_body_edit=lambda b: b.update(edit))
    assert dr.status_code == 400, dr.text
    assert needle in dr.json()["error"]["message"], dr.text
    assert pr.status_code == 200, pr.text
    t0 = time.time()
    wait_blocks_zero(pd.p, timeout=5)  # target 1 s
    print(f"P's blocks free {time.time() - t0:.3f} s after D's 400")
    assert metric(pd.p, "disagg:kv_transfer_expired_total") == 0


def test_request_d_rejects_through_the_proxy_frees_p_blocks(pd):
    """The same through `disagg proxy`: a request over the context gets its 400 and P holds no
    blocks afterwards (whether the proxy refused it first or D did and told P)."""
    px = ProxyProc([types.SimpleNamespace(url=pd.p.url, bootstrap_port=pd.boot_port)], [pd.d])
    try:
        px.wait_ready(30)
        wait_blocks_zero(pd.p, timeout=10)
        for k in range(3):
            r = requests.post(px.url + "/v1/completions", timeout=TIMEOUT, json=dict(
                BODY, prompt=f"Fellow-Citizens of the Senate and House {k}", max_tokens=100000))
            assert r.status_code == 400, r.text
            assert "maximum context length" in r.json()["error"]["message"], r.text
        t0 = time.time()
        wait_blocks_zero(pd.p, timeout=5)
        print(f"P's blocks free {time.time() - t0:.3f} s after the proxy's 400s")
        r = requests.post(px.url + "/v1/completions", timeout=TIMEOUT, json=dict(BODY, prompt="Commerce"))
        assert r.status_code == 200, r.text
    finally:
        px.proc.terminate()
        px.proc.wait(10)


def test_request_d_rejects_before_p_has_it_frees_p_blocks_when_ready(pd):
    """D's refusal reaches P before P's copy of the request: P remembers the transfer and frees
    its KV as soon as the prefill ends."""
    wait_blocks_zero(pd.p, timeout=10)
    tid = "xfer-" + str(uuid.uuid4())
    body = dict(BODY, prompt="Fellow-Citizens of the Senate and House of Representatives")
    before = pd.p.metric("disagg:kv_pending_unknown_pulls")
    r = requests.post(pd.d.url + "/v1/completions", timeout=TIMEOUT,
                      json=dict(body, n=0, kv_transfer_params=d_params(pd, transfer_id=tid)))
    assert r.status_code == 400, r.text
    poll(lambda: pd.p.metric("disagg:kv_pending_unknown_pulls") == before + 1, 10,
         "the release reached P")  # remembered until the request comes
    r = requests.post(pd.p.url + "/v1/completions", timeout=TIMEOUT, json=dict(
        body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid}))
    assert r.status_code == 200, r.text
    wait_blocks_zero(pd.p, timeout=5)


def test_decoder_killed_with_pending_pulls_frees_p_blocks():
    """D's pull waits on P (P has not got the request yet); D is killed (-9).  P sees D's
    side-channel connection close, ends the pull and releases the transfer as soon as it is
    ready, without trying to write into a decoder that is gone (before, P's sender tried and
    failed -- or, to a host that vanished, hung for the transfer timeout)."""
    x = PD(p_env={"DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT": "60"})
    try:
        tid = "xfer-" + str(uuid.uuid4())
        body = dict(BODY, prompt="Fellow-Citizens of the Senate and House of Representatives")
        s = raw_post(x.d, dict(body, kv_transfer_params=d_params(x, transfer_id=tid)))
        poll(lambda: x.p.metric("disagg:kv_pending_unknown_pulls") == 1, 10, "D's pull waiting on P")
        x.d.proc.kill()
        x.d.proc.wait()
        s.close()
        r = requests.post(x.p.url + "/v1/completions", timeout=TIMEOUT, json=dict(
            body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid}))
        assert r.status_code == 200, r.text
        t0 = time.time()
        wait_blocks_zero(x.p, timeout=5)
        print(f"P's blocks free {time.time() - t0:.3f} s after its prefill (D killed before)")
        assert metric(x.p, "disagg:kv_transfer_expired_total") == 0
        assert metric(x.p, "disagg:kv_transfer_failures_total", side="producer", reason="write_failed") == 0
        assert metric(x.p, "disagg:kv_transfer_failures_total", side="producer", reason="cancelled") == 1
        assert "side-channel connection closed" in x.p.logs()
    finally:
        x.stop()


# ---- items 12, 14, 15: lookups and connections that never answer -----------------------------

def test_stopped_producer_fails_the_request_within_seconds(pd):
    """P is SIGSTOPped (hung): its bootstrap server accepts connections (the kernel does) but
    never answers.  D's lookup has a short answer deadline: the request fails with 502 naming
    the bootstrap address within seconds (was 61 s: two attempts of
    VLLM_MOONCAKE_CONNECTOR_TIMEOUT)."""
    os.kill(pd.p.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.time()
        r = requests.post(pd.d.url + "/v1/completions", timeout=20, json=dict(
            BODY, prompt="hello", kv_transfer_params=d_params(pd)))
        took = time.time() - t0
    finally:
        os.kill(pd.p.proc.pid, signal.SIGCONT)
    print(f"D failed the request {took:.2f} s after P hung")
    assert r.status_code == 502, r.text
    assert pd.bootstrap.split("//")[1] in r.json()["error"]["message"], r.text
    assert took < 10, took  # target 5 s
    wait_blocks_zero(pd.d, timeout=5)


def test_bootstrap_that_accepts_but_never_answers_fails_within_seconds(pd):
    """A remote_bootstrap_addr that accepts TCP and never answers: 502 naming it within
    seconds, and D's blocks free (was 61 s)."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(16)  # never accepted, never answered
    addr = f"127.0.0.1:{lst.getsockname()[1]}"
    try:
        t0 = time.time()
        r = requests.post(pd.d.url + "/v1/completions", timeout=20, json=dict(
            BODY, prompt="hello", kv_transfer_params=d_params(pd, remote_bootstrap_addr="http://" + addr)))
        took = time.time() - t0
    finally:
        lst.close()
    print(f"D failed the request {took:.2f} s after it started")
    assert r.status_code == 502, r.text
    assert addr in r.json()["error"]["message"], r.text
    assert took < 10, took
    wait_blocks_zero(pd.d, timeout=5)


def test_bootstrap_entry_at_a_refused_port_fails_fast_naming_it(pd):
    """A bootstrap entry whose side-channel address refuses connections (its instance is gone):
    ZeroMQ would retry silently until D's 540 s pull timeout; D fails the request at once with
    502 naming the address."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    addr = f"tcp://127.0.0.1:{lst.getsockname()[1]}"
    register(pd.bootstrap, "gone-p", addr, 2)  # registered while something listened there
    lst.close()  # now refused
    t0 = time.time()
    r = requests.post(pd.d.url + "/v1/completions", timeout=20, json=dict(
        BODY, prompt="hello", kv_transfer_params=d_params(pd, remote_engine_id="gone-p")))
    took = time.time() - t0
    print(f"D failed the request {took:.3f} s after it started")
    assert took < 5, took
    if r.status_code == 400:  # the bootstrap server dropped the dead entry itself: also fast
        assert "gone-p" in r.json()["error"]["message"], r.text
    else:
        assert r.status_code == 502, r.text
        msg = r.json()["error"]["message"]
        assert addr in msg and "refused" in msg, msg
    wait_blocks_zero(pd.d, timeout=5)
