"""Fault matrix across hosts: each fault hits a prefill/decode pair
running in two network namespaces (netns.Cluster); every test has a deadline
(pytest-timeout and the requests' own), and afterwards every instance's KV
blocks in use return to zero and a follow-up request is served correctly.

The links are slowed with tc tbf where a fault must land "during the
transfer"; the fault relay (fault_relay.py) sits in front of the decoder's
transfer-engine ports for latency, black holes and resets (no netem here)."""
import http.client
import json
import os
import subprocess
import time

import pytest
import requests

import mooncake_wire
import netns
from fault_relay import FaultRelay
from netns import COMMON, HostPD, NsServer, blocks_used, kv_config, wait_blocks_zero
from server_harness import BIN, MODEL, Server

TIMEOUT = 120
WORDS = ("Fellow-Citizens of the Senate and House of Representatives: the state of the Union "
         "is strong, and our commerce with foreign nations has grown in every year of peace").split()
BODY = {"model": "tiny", "max_tokens": 12, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True}
# VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT in these tests: long enough for a prefill
# that queues behind another one (seconds under ASan), short enough to test.
ABORT_S = "12" if os.environ.get("DISAGG_SANITIZED") in ("1", "ON", "TRUE", "true") else "5"
FAST = {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": ABORT_S, "VLLM_MOONCAKE_CONNECTOR_TIMEOUT": "2"}

_reason = netns.skip_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.timeout(150)]


def prompt(n, salt=0):
    return " ".join(WORDS[(i + salt) % len(WORDS)] for i in range(n)) + f" {salt}"


def completion_ids(r):
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return [int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]], c["text"], c["finish_reason"]


def failed_cleanly(r):
    """An HTTP error, or a 200 whose choice ended with finish_reason 'error'."""
    if r.status_code >= 400:
        return True
    return r.json()["choices"][0]["finish_reason"] == "error"


@pytest.fixture(scope="module")
def cluster():
    c = netns.Cluster()
    yield c
    c.close()


@pytest.fixture(scope="module")
def colocated():
    s = Server(*COMMON)
    yield s
    s.stop()


# A decoder that gave up on a pull without the producer's final reply keeps
# those blocks out of use for the producer's write deadline (35 s + 1 ns per
# byte, src/connector/mooncake/mooncake_connector.c pull_main): such decoders
# are checked at the end of the module, all at once, instead of one by one.
QUARANTINE_S = 50


@pytest.fixture(scope="module")
def quarantined():
    """Pairs whose decoder holds quarantined blocks: at module end every one
    of them must be back to zero blocks in use (within QUARANTINE_S)."""
    held = []
    yield held
    deadline = time.time() + QUARANTINE_S
    left = []
    for pd in held:
        try:
            wait_blocks_zero(pd.d, max(1.0, deadline - time.time()))
        except AssertionError as e:
            left.append(str(e))
    for pd in held:
        pd.stop()
    assert not left, left


_ports = iter(range(200))


@pytest.fixture
def pair(cluster, quarantined):
    """pair(**HostPD kwargs) -> HostPD on fresh ports, stopped (and the links
    restored) at teardown; defer(pd) hands it to the end-of-module check."""
    made = []
    p, d = cluster.hosts

    def make(**kw):
        kw.setdefault("device_name", "veth-a,veth-b")
        kw.setdefault("p_env", FAST)
        kw.setdefault("d_env", FAST)
        n = next(_ports)
        kw.setdefault("port", 8100 + n)
        kw.setdefault("boot_port", 8700 + n)
        x = HostPD(p, d, **kw)
        made.append(x)
        return x

    def defer(x):
        made.remove(x)
        quarantined.append(x)

    make.defer = defer

    yield make
    for x in made:
        x.stop()
    for h in cluster.hosts:
        for i in ("veth-a", "veth-b"):
            h.link_set(i, "up")
            h.rate_limit(i, None)


def reference(colocated, body):
    return completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))


def post_raw(server, body, path="/v1/completions"):
    """Starts a POST and returns the open connection (the test decides when to read or drop it)."""
    c = http.client.HTTPConnection(server.host.lan_ip, server.port, timeout=TIMEOUT)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    return c


def slow_kv_links(cluster, mbit):
    p, _ = cluster.hosts
    for i in ("veth-a", "veth-b"):
        p.rate_limit(i, mbit)


def wait_for(cond, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def kv_tx(cluster):
    p, _ = cluster.hosts
    return p.tx_bytes("veth-a") + p.tx_bytes("veth-b")


def all_blocks_free(*servers, timeout=15):
    for s in servers:
        wait_blocks_zero(s, timeout)


def follow_up_ok(pd, colocated, salt=999):
    """A new P/D request and a local request on D both equal colocated; they
    leave no block behind (D may still hold quarantined blocks of a fault)."""
    held = blocks_used(pd.d)
    body = dict(BODY, prompt=prompt(150, salt=salt))
    pr, dr = pd.send(body)
    assert pr.status_code == 200, pr.text
    assert completion_ids(dr) == reference(colocated, body)
    local = dict(BODY, prompt=prompt(200, salt=salt + 1))
    assert completion_ids(requests.post(pd.d.url + "/v1/completions", json=local, timeout=TIMEOUT)) == \
        reference(colocated, local)
    wait_blocks_zero(pd.p)
    wait_for(lambda: blocks_used(pd.d) <= held, 15, "D's follow-up blocks to be freed")


# ---- the client goes away --------------------------------------------------------------------

def test_client_disconnects_before_prefill_finishes(pair, colocated):
    pd = pair()
    pb, db, _ = pd.bodies(dict(BODY, prompt=prompt(900, salt=1)))
    cp, cd = post_raw(pd.p, pb), post_raw(pd.d, db)
    time.sleep(0.5)  # P prefills 900 tokens (seconds here)
    cd.close()  # the proxy drops both requests when its client goes
    cp.close()
    wait_blocks_zero(pd.p, timeout=20)
    follow_up_ok(pd, colocated)
    pair.defer(pd)  # D's blocks of the abandoned pull: quarantined


def test_client_disconnects_during_transfer(pair, cluster, colocated):
    pd = pair()
    # 2 Mbit/s a link: a 400-word prompt's KV takes seconds, so the pull is still in flight
    # when D's gauge is read even under ASan (at 8 Mbit/s CI saw the pull end first)
    slow_kv_links(cluster, 2)
    pb, db, _ = pd.bodies(dict(BODY, prompt=prompt(400, salt=2)))
    cd = post_raw(pd.d, db)
    t0 = kv_tx(cluster)
    cp = post_raw(pd.p, pb)
    assert cp.getresponse().status == 200  # prefill done, the transfer starts
    wait_for(lambda: kv_tx(cluster) - t0 > 200_000, 20, "KV bytes on the links")
    # D's pull in flight (the gauge is sampled: under ASan it lagged the link bytes once)
    wait_for(lambda: pd.d.metric("disagg:kv_transfer_loading_requests") == 1, 10,
             "D's pull in flight")
    cd.close()
    wait_blocks_zero(pd.p, timeout=30)
    slow_kv_links(cluster, None)
    follow_up_ok(pd, colocated)
    pair.defer(pd)


def test_client_disconnects_during_decode(pair, colocated):
    pd = pair()
    body = dict(BODY, prompt=prompt(100, salt=3), max_tokens=1500, ignore_eos=True, stream=True)
    pb, db, _ = pd.bodies(body)
    assert requests.post(pd.p.url + "/v1/completions", json=pb, timeout=TIMEOUT).status_code == 200
    with requests.post(pd.d.url + "/v1/completions", json=db, timeout=TIMEOUT, stream=True) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith(b"data: "):
                got += 1
                if got == 5:
                    break
        assert blocks_used(pd.d) > 0
    # the connection is closed here, mid-stream
    all_blocks_free(pd.p, pd.d, timeout=20)
    follow_up_ok(pd, colocated)


# ---- a process dies ----------------------------------------------------------------------------

def test_prefill_killed_during_prefill(pair, colocated):
    pd = pair(d_cfg=kv_config("kv_consumer", "veth-a,veth-b", kv_load_failure_policy="fail"))
    # 1802 prompt tokens (max-model-len 2048): P's prefill of them takes about
    # 1 s on an idle 2-core machine, in one engine step (so no gauge shows it
    # running); P is killed 0.2 s after it got the request. (900 words, 1159
    # tokens, and a 0.5 s sleep let an idle P finish before the kill.)
    pb, db, _ = pd.bodies(dict(BODY, prompt=prompt(1400, salt=4)))
    cd = post_raw(pd.d, db)
    wait_for(lambda: pd.d.metric("disagg:kv_transfer_loading_requests") >= 1, 20, "D's pull started")
    cp = post_raw(pd.p, pb)  # kept open: a dropped connection would abort P's request
    time.sleep(0.2)
    assert pd.p.proc.poll() is None
    t0 = time.time()
    pd.p.kill()
    r = cd.getresponse()
    body = r.read().decode()
    elapsed = time.time() - t0
    assert r.status >= 400 or json.loads(body)["choices"][0]["finish_reason"] == "error", body
    # The side channel sees P's connection drop: no wait for its receive timeout
    # (ABORT_REQUEST_TIMEOUT + 60 s).
    assert elapsed < 15, elapsed
    assert "closed the connection" in pd.d.logs(), pd.d.logs()
    cp.close()
    pair.defer(pd)


def test_prefill_killed_during_transfer_recompute(pair, cluster, colocated):
    pd = pair(d_cfg=kv_config("kv_consumer", "veth-a,veth-b", kv_load_failure_policy="recompute"))
    slow_kv_links(cluster, 8)
    body = dict(BODY, prompt=prompt(400, salt=5))
    pb, db, _ = pd.bodies(body)
    cd = post_raw(pd.d, db)
    t0 = kv_tx(cluster)
    cp = post_raw(pd.p, pb)
    assert cp.getresponse().status == 200
    wait_for(lambda: kv_tx(cluster) - t0 > 200_000, 20, "KV bytes on the links")
    pd.p.kill()
    r = cd.getresponse()
    text = r.read().decode()
    assert r.status == 200, text
    c = json.loads(text)["choices"][0]
    assert [int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]] == reference(colocated, body)[0]
    pair.defer(pd)


def test_decode_killed_while_prefill_holds_blocks(pair, cluster):
    pd = pair()
    # ~900 KB of KV over two 2 Mbit/s links: ~1.8 s, so D is killed mid-transfer
    # even on a loaded CI machine (at 8 Mbit/s the transfer could end before
    # the blocks gauge was read).
    slow_kv_links(cluster, 2)
    # (a) D dies in the middle of the transfer: P's writes fail, P frees the blocks.
    pb, db, _ = pd.bodies(dict(BODY, prompt=prompt(400, salt=6)))
    cd = post_raw(pd.d, db)  # kept open: a dropped connection would abort D's request
    t0 = kv_tx(cluster)
    assert post_raw(pd.p, pb).getresponse().status == 200
    # the engine publishes the count at the end of the step that answered
    wait_for(lambda: blocks_used(pd.p) > 0, 1.5, "P's kept blocks in disagg:kv_blocks_used")
    wait_for(lambda: kv_tx(cluster) - t0 > 200_000, 20, "KV bytes on the links")
    pd.d.kill()
    cd.close()
    wait_blocks_zero(pd.p, timeout=45)
    # (b) nobody pulls at all: P frees the blocks after ABORT_REQUEST_TIMEOUT.
    pb, _, _ = pd.bodies(dict(BODY, prompt=prompt(100, salt=7)))
    assert requests.post(pd.p.url + "/v1/completions", json=pb, timeout=TIMEOUT).status_code == 200
    # the engine publishes the count at the end of the step that answered (see test_pd.py)
    wait_for(lambda: blocks_used(pd.p) > 0, 1.5, "the kept blocks in disagg:kv_blocks_used")
    t0 = time.time()
    wait_blocks_zero(pd.p, timeout=float(ABORT_S) + 5)
    assert time.time() - t0 >= float(ABORT_S) - 1.0
    assert pd.p.metric("disagg:kv_transfer_expired_total") >= 1


# ---- the network fails -------------------------------------------------------------------------

def test_one_link_down_mid_transfer(pair, cluster, colocated):
    """Two pairs, one per kv_load_failure_policy, transfer at once; the link
    carrying their KV goes down: each request completes on the other link or
    fails cleanly ("fail"), or is recomputed ("recompute"); blocks are freed."""
    p, _ = cluster.hosts
    pds = {policy: pair(d_cfg=kv_config("kv_consumer", "veth-a,veth-b", kv_load_failure_policy=policy))
           for policy in ("fail", "recompute")}
    slow_kv_links(cluster, 8)
    bodies = {k: dict(BODY, prompt=prompt(400, salt=8 + i)) for i, k in enumerate(pds)}
    refs = {k: reference(colocated, b) for k, b in bodies.items()}
    before = {i: p.tx_bytes(i) for i in ("veth-a", "veth-b")}
    conns = {}
    for k, pd in pds.items():
        pb, db, _ = pd.bodies(bodies[k])
        conns[k] = post_raw(pd.d, db)
        assert post_raw(pd.p, pb).getresponse().status == 200
    moved = lambda i: p.tx_bytes(i) - before[i]
    wait_for(lambda: max(moved("veth-a"), moved("veth-b")) > 150_000, 20, "KV bytes on the links")
    busiest = max(("veth-a", "veth-b"), key=moved)
    t0 = time.time()
    p.link_set(busiest, "down")
    outcome = {}
    for k, c in conns.items():
        r = c.getresponse()
        text = r.read().decode()
        if r.status == 200 and json.loads(text)["choices"][0]["finish_reason"] != "error":
            ch = json.loads(text)["choices"][0]
            assert [int(t.split(":", 1)[1]) for t in ch["logprobs"]["tokens"]] == refs[k][0], k
            outcome[k] = "ok"
        else:
            assert k == "fail", text  # recompute never fails the request
            outcome[k] = "failed"
    elapsed = time.time() - t0
    assert elapsed < 90, (elapsed, outcome)
    for pd in pds.values():
        all_blocks_free(pd.p, pd.d, timeout=30)
    p.link_set(busiest, "up")
    slow_kv_links(cluster, None)
    follow_up_ok(pds["fail"], colocated)


def with_extra(cfg, extra):
    """cfg (kv_config's JSON) with these kv_connector_extra_config keys added."""
    c = json.loads(cfg)
    c["kv_connector_extra_config"].update(extra or {})
    return json.dumps(c)


def send_streamed(pd, body):
    """D's request first, P's once D's pull waits there: P's prefill starts with the pull
    present, so a layer-wise pair streams it.  Returns (P response, D response)."""
    import concurrent.futures as cf
    pb, db, _ = pd.bodies(body)
    with cf.ThreadPoolExecutor(2) as ex:
        fd = ex.submit(requests.post, pd.d.url + "/v1/completions", json=db, timeout=TIMEOUT)
        wait_for(lambda: pd.p.metric("disagg:kv_pending_unknown_pulls") >= 1 or fd.done(), 20,
                 "D's pull to wait at P")
        fp = ex.submit(requests.post, pd.p.url + "/v1/completions", json=pb, timeout=TIMEOUT)
        return fp.result(), fd.result()


@pytest.fixture
def relayed(cluster):
    """relayed(**FaultRelay faults) -> HostPD whose decoder advertises the root
    namespace's LAN address: P reaches D's handshake and data ports through
    relays there; the data port's relay injects the faults."""
    made = []

    def make(policy="fail", extra=None, **faults):
        p, d = cluster.hosts
        env = dict(FAST, VLLM_HOST_IP=cluster.root_ip)
        n = next(_ports)
        pd = HostPD(p, d, device_name=None, p_env=FAST, d_env=env, port=8100 + n, boot_port=8700 + n,
                    p_cfg=with_extra(kv_config("kv_producer", None), extra),
                    d_cfg=with_extra(kv_config("kv_consumer", None, kv_load_failure_policy=policy), extra))
        made.append(pd)
        seg = [ln for ln in pd.d.logs().splitlines() if "transfer segment" in ln][0]
        rpc_port = int(seg.split("transfer segment ")[1].split(",")[0].rsplit(":", 1)[1])
        desc = mooncake_wire.fetch_descriptor(f"{d.lan_ip}:{rpc_port}")
        data_port = desc["tcp_data_port"]
        made.append(FaultRelay(cluster.root_ip, rpc_port, d.lan_ip, rpc_port))
        relay = FaultRelay(cluster.root_ip, data_port, d.lan_ip, data_port, **faults)
        made.append(relay)
        return pd, relay

    yield make
    for x in made:
        if isinstance(x, FaultRelay):
            x.close()
        else:
            x.stop()


def test_relay_latency_keeps_results_correct(relayed, colocated):
    pd, relay = relayed(delay_s=0.05)
    for k in range(3):
        body = dict(BODY, prompt=prompt(200, salt=20 + k))
        pr, dr = pd.send(body)
        assert pr.status_code == 200
        assert completion_ids(dr) == reference(colocated, body)
    assert sum(c["up"] for c in relay.stats()) > 1_000_000  # the KV went through the relay
    all_blocks_free(pd.p, pd.d)


def test_relay_reset_mid_transfer_is_retried(relayed, colocated):
    pd, relay = relayed(reset_after=100_000, faulty={0, 1})
    body = dict(BODY, prompt=prompt(300, salt=30))
    pr, dr = pd.send(body)
    assert pr.status_code == 200
    assert completion_ids(dr) == reference(colocated, body)  # the chunk went again on a new connection
    st = relay.stats()
    assert any(c["outcome"].startswith("reset") for c in st), st
    assert len(st) >= 3, st  # the reset chunk went again on a new connection
    all_blocks_free(pd.p, pd.d)
    follow_up_ok(pd, colocated)


def test_relay_black_hole_fails_cleanly(relayed, colocated):
    pd, relay = relayed(stall_after=100_000, faulty={0, 1})
    body = dict(BODY, prompt=prompt(300, salt=40))
    t0 = time.time()
    pr, dr = pd.send(body)
    elapsed = time.time() - t0
    assert pr.status_code == 200
    if not failed_cleanly(dr):
        assert completion_ids(dr) == reference(colocated, body)
    assert elapsed < 90, elapsed
    assert any(c["outcome"].startswith("stalled") for c in relay.stats()), relay.stats()
    all_blocks_free(pd.p, pd.d, timeout=30)
    follow_up_ok(pd, colocated)


def test_relay_black_hole_layerwise_follow_up_gets_fresh_connections(relayed, colocated):
    """Layer-wise streaming on both sides.  A streamed request leaves both of P's data
    connections (lanes) to D open; then every open connection goes silent; a one-block
    request (one write, on one of them) fails at its chunk's deadline.  The streamed
    follow-up spreads its layers over both lanes: it must not hit the other silent one (P
    closes a path's other connections when one goes silent) and equals colocated."""
    pd, relay = relayed(extra={"layerwise": True})
    body = dict(BODY, prompt=prompt(150, salt=50))
    pr, dr = send_streamed(pd, body)
    assert pr.status_code == 200, pr.text
    assert completion_ids(dr) == reference(colocated, body)
    assert dr.json()["usage"]["kv_transfer"]["layerwise"] is True, dr.json()["usage"]
    assert relay.black_hole_open() >= 2, relay.stats()  # both lanes were open
    one_block = dict(BODY, prompt=prompt(4, salt=51))  # < 16 tokens: one block, one write
    t0 = time.time()
    pr, dr = send_streamed(pd, one_block)
    elapsed = time.time() - t0
    assert pr.status_code == 200, pr.text
    assert failed_cleanly(dr), dr.text  # its only write went into the black hole
    assert "deadline exceeded" in dr.text, dr.text
    assert elapsed < 90, elapsed
    all_blocks_free(pd.p, pd.d, timeout=30)
    body = dict(BODY, prompt=prompt(150, salt=52))
    pr, dr = send_streamed(pd, body)
    assert pr.status_code == 200, pr.text
    assert completion_ids(dr) == reference(colocated, body), relay.stats()
    assert dr.json()["usage"]["kv_transfer"]["layerwise"] is True
    assert "went silent: closing its 1 other connection" in pd.p.logs(), pd.p.logs()
    all_blocks_free(pd.p, pd.d)
    follow_up_ok(pd, colocated, salt=998)


# ---- start-up ----------------------------------------------------------------------------------

def test_bootstrap_unreachable_at_prefill_startup(cluster):
    p, _ = cluster.hosts
    dead = f"10.231.{cluster.lan}.250:8998"  # on the LAN, nobody there
    cfg = kv_config("kv_producer", None)
    cfg = json.loads(cfg)
    cfg["kv_connector_extra_config"]["bootstrap_server_address"] = dead
    env = dict(os.environ, VLLM_MOONCAKE_CONNECTOR_TIMEOUT="0.5", VLLM_HOST_IP=p.lan_ip)
    t0 = time.time()
    r = subprocess.run(p.exec_args([BIN, "serve", str(MODEL), "--host", p.lan_ip, "--port", "8150",
                                    "--threads", "1", *COMMON, "--kv-transfer-config", json.dumps(cfg)]),
                       capture_output=True, text=True, timeout=60, env=env)
    elapsed = time.time() - t0
    assert r.returncode != 0
    assert "3 attempt" in r.stderr or "attempts" in r.stderr, r.stderr[-2000:]
    assert dead in r.stderr, r.stderr[-2000:]
    assert 2.5 < elapsed < 30, elapsed  # backoff 1 s + 2 s, each attempt bounded by the timeout
