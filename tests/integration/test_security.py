"""Who may talk to which port (docs/security.md): the
attacks of the issue against real `disagg serve` / `disagg bootstrap`
processes, each refused, and the normal paths with and without a secret.

- listeners: under --host 127.0.0.1 the API, the embedded bootstrap server
  and the ZMQ side channel listen on 127.0.0.1 only (read from
  /proc/PID/net/tcp{,6} and the process's socket inodes);
- a fake prefill rank registered in the bootstrap table: refused (401 without
  the secret, 403 with a wrong MAC) and the table is unchanged;
- side-channel pulls without a MAC (a vLLM-shaped pyzmq DEALER): answered
  ERROR naming the cause, counted on /metrics;
- side-channel cancels: the decoder's, MAC'd, frees its blocks at once; one
  without a MAC or with a forged one is refused, counted, and cancels nothing;
- one-sided secrets: refused with a message naming the cause on both sides;
- a flood of thousands of bogus pulls (pyzmq): each costs O(1), real
  requests still complete; the latencies are printed (docs/benchmarks.md).
"""
import concurrent.futures as cf
import json
import os
import re
import subprocess
import threading
import time
import uuid

import msgpack
import pytest
import requests
import zmq

from server_harness import BIN, MODEL, Server, free_port
from test_pd import (BODY, COMMON, PD, blocks_used, completion_ids, consumer_config, corpus_prompts,
                     producer_config, wait_blocks_zero)
from test_pd_errors import d_params, metric, raw_post

TIMEOUT = 120
SECRET = "correct horse battery staple"


def no_secret_env():
    """The harness copies os.environ: make sure no secret leaks in from the caller."""
    os.environ.pop("DISAGG_KV_SECRET", None)


# ---- helpers ---------------------------------------------------------------------------------

def listening(pid):
    """{(ip, port)} of the TCP sockets process pid listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        m = re.match(r"socket:\[(\d+)\]", link)
        if m:
            inodes.add(m.group(1))
    out = set()
    for fam in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/{pid}/net/{fam}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A = LISTEN
                continue
            hexip, hexport = f[1].split(":")
            raw = bytes.fromhex(hexip)
            if fam == "tcp":
                ip = ".".join(str(b) for b in raw[::-1])
            else:  # four little-endian 32-bit words
                words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
                b = b"".join(words)
                ip = ":".join(b[i:i + 2].hex() for i in range(0, 16, 2))
                ip = {"0000:0000:0000:0000:0000:0000:0000:0000": "::",
                      "0000:0000:0000:0000:0000:0000:0000:0001": "::1"}.get(ip, ip)
            out.add((ip, int(hexport, 16)))
    return out


def side_channel_endpoint(bootstrap):
    table = requests.get(bootstrap + "/query", timeout=10).json()
    return table["0"]["worker_addr"]["0"]["0"]


def vllm_pull(transfer_id, req_id="d-evil", blocks=(1, 2, 3), block_len=4096):
    """A pull as vLLM's decode worker encodes it (msgspec map, omit_defaults)."""
    return msgpack.packb({
        "remote_hostname": "127.0.0.1", "remote_port": 9, "remote_tp_size": 1, "remote_tp_rank": 0,
        "req_blocks": {req_id: [transfer_id, [list(blocks)]]},
        "kv_caches_base_addr": [1 << 40], "block_lens": [block_len], "kv_block_lens": [block_len]})


def producer_block_len(endpoint):
    """What an attacker learns from one refused pull: the producer's block size."""
    reply = pull_once(endpoint, [vllm_pull("xfer-probe", block_len=1)])
    return int(re.search(r"producer's (\d+)", reply[0]["err_msg"]).group(1))


def pull_once(endpoint, frames, timeout_ms=10000):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    s.connect(endpoint)
    try:
        s.send_multipart(frames)
        return [msgpack.unpackb(f) if i == 0 else f for i, f in enumerate(s.recv_multipart())]
    finally:
        s.close()


def d_body(pd, body, tid):
    return dict(body, kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": pd.engine_id,
                                          "remote_bootstrap_addr": pd.bootstrap, "transfer_id": tid})


def failed(r):
    return r.status_code >= 400 or r.json()["choices"][0]["finish_reason"] == "error"


@pytest.fixture(scope="module")
def colocated():
    no_secret_env()
    s = Server(*COMMON)
    yield s
    s.stop()


# ---- 1. listeners bound only where they must -----------------------------------------------

def test_listeners_bound_to_the_selected_host():
    """--host 127.0.0.1 (the harness), no VLLM_HOST_IP, no device_name: the
    API, the embedded bootstrap server and the side channel of P listen on
    127.0.0.1 only; D's API too.  (The transfer engine's handshake and data
    ports follow the same rule in src/transfer, tested with it.)"""
    no_secret_env()
    env = {"VLLM_HOST_IP": ""}
    x = PD(p_env=env, d_env=env)
    try:
        sc = side_channel_endpoint(x.bootstrap)
        assert sc.startswith("tcp://127.0.0.1:"), sc  # the KV host is --host's address
        sc_port = int(sc.rsplit(":", 1)[1])
        socks = listening(x.p.proc.pid)
        for port, what in ((x.p.port, "API"), (x.boot_port, "bootstrap"), (sc_port, "side channel")):
            bound = {ip for ip, p in socks if p == port}
            assert bound == {"127.0.0.1"}, f"P's {what} port {port} listens on {bound}: {socks}"
        bound = {ip for ip, p in listening(x.d.proc.pid) if p == x.d.port}
        assert bound == {"127.0.0.1"}, bound
        for s in (x.p, x.d):  # everything on loopback: no warning
            assert "SECURITY WARNING" not in s.log_path.read_text()
    finally:
        x.stop()


def _non_loopback_address():
    """An address of this host that is not loopback (the route to a TEST-NET address;
    no packet is sent), or None."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        try:
            u.connect(("192.0.2.123", 9))
            ip = u.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_start_warns_when_kv_ports_listen_beyond_loopback_without_a_secret(secret):
    """A decoder whose KV host (VLLM_HOST_IP) is a LAN address: without a secret its
    start-up log says loudly that the transfer ports are open to anyone; with one, not."""
    ip = _non_loopback_address()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    no_secret_env()
    env = {"VLLM_HOST_IP": ip, **({"DISAGG_KV_SECRET": secret} if secret else {})}
    d = Server(*COMMON, "--kv-transfer-config", consumer_config(), env=env)
    try:
        log = d.log_path.read_text()
    finally:
        d.stop()
    if secret:
        assert "SECURITY WARNING" not in log
    else:
        assert "SECURITY WARNING: no shared secret (DISAGG_KV_SECRET / " \
               "kv_connector_extra_config.auth_secret) and KV ports listen beyond loopback " \
               f"(transfer handshake and data ports on {ip})" in log, log[-3000:]


def test_standalone_bootstrap_binds_its_host():
    port = free_port()
    p = subprocess.Popen([BIN, "bootstrap", "--host", "127.0.0.1", "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "listening on http://127.0.0.1" in p.stdout.readline()
        assert {ip for ip, q in listening(p.pid) if q == port} == {"127.0.0.1"}
    finally:
        p.terminate()
        p.wait(10)


# ---- 2. the bootstrap table ----------------------------------------------------------------

FAKE = {"engine_id": "evil", "dp_rank": 1, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://10.6.6.6:1"}


@pytest.fixture(scope="module")
def secret_pd():
    """P and D sharing the secret: P through the environment, D through the config key."""
    no_secret_env()
    x = PD(p_env={"DISAGG_KV_SECRET": SECRET},
           d_cfg=consumer_config({"auth_secret": SECRET}))
    yield x
    x.stop()


def test_fake_rank_registration_refused(secret_pd):
    before = requests.get(secret_pd.bootstrap + "/query", timeout=10).json()
    r = requests.post(secret_pd.bootstrap + "/register", json=FAKE, timeout=10)
    assert r.status_code == 401, r.text
    assert "requires authentication" in r.json()["detail"]
    assert "X-Disagg-Auth" in r.json()["detail"]
    # a guessed MAC (right shape, current time) and a replayed header over another body
    body = json.dumps(FAKE)
    hdr = {"X-Disagg-Auth": f"v1 ts={int(time.time())} mac={'ab' * 32}",
           "Content-Type": "application/json"}
    r = requests.post(secret_pd.bootstrap + "/register", data=body, headers=hdr, timeout=10)
    assert r.status_code == 403 and "MAC does not match" in r.json()["detail"], r.text
    # the same engine's rank moved to an attacker's address: refused before any table logic
    moved = dict(FAKE, engine_id=secret_pd.engine_id, dp_rank=0)
    r = requests.post(secret_pd.bootstrap + "/register", json=moved, timeout=10)
    assert r.status_code == 401
    assert requests.get(secret_pd.bootstrap + "/query", timeout=10).json() == before
    m = secret_pd.p.metrics()
    assert m['disagg:kv_auth_rejected_total{port="bootstrap"}'] >= 3


def test_secret_pd_equals_colocated(secret_pd, colocated):
    for prompt in corpus_prompts()[3:6]:
        body = dict(BODY, prompt=prompt)
        ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
        pr, dr = secret_pd.send(body)
        assert pr.status_code == 200, pr.text
        assert completion_ids(dr) == ref
    m = secret_pd.p.metrics()
    assert m['disagg:kv_transfers_total{side="producer",result="ok"}'] >= 3


def test_external_bootstrap_with_secret():
    """`disagg bootstrap --auth-secret`: a prefill without the secret fails to
    start naming the cause; with it (bootstrap_server_address) it registers."""
    no_secret_env()
    port = free_port()
    b = subprocess.Popen([BIN, "bootstrap", "--host", "127.0.0.1", "--port", str(port),
                          "--auth-secret", SECRET], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert "requires the shared secret" in b.stdout.readline()
        cfg = producer_config({"bootstrap_server_address": f"127.0.0.1:{port}"})
        r = subprocess.run([BIN, "serve", str(MODEL), "--host", "127.0.0.1", "--port", str(free_port()),
                            "--kv-cache-memory", "32M", "--max-model-len", "256", "--kv-transfer-config",
                            cfg], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert "refused our authentication (HTTP 401)" in r.stderr, r.stderr[-2000:]
        assert "this instance has no auth_secret" in r.stderr
        # the CLI client too, with a wrong secret: 403
        r = subprocess.run([BIN, "bootstrap", "register", "--server", f"127.0.0.1:{port}",
                            "--engine-id", "e", "--addr", "tcp://127.0.0.1:1", "--auth-secret", "nope"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and "HTTP 403" in r.stderr and "MAC does not match" in r.stderr
        good = producer_config({"bootstrap_server_address": f"127.0.0.1:{port}", "auth_secret": SECRET})
        p = Server(*COMMON, "--kv-transfer-config", good)
        try:
            table = requests.get(f"http://127.0.0.1:{port}/query", timeout=10).json()
            assert table["0"]["worker_addr"]["0"]["0"].startswith("tcp://127.0.0.1:")
        finally:
            p.stop()
    finally:
        b.terminate()
        b.wait(10)
    assert "refusing a /register" in b.stderr.read()


# ---- 3. the side channel -------------------------------------------------------------------

def test_side_channel_pull_without_mac_refused(secret_pd):
    ep = side_channel_endpoint(secret_pd.bootstrap)
    before = secret_pd.p.metrics()['disagg:kv_auth_rejected_total{port="side_channel"}']
    reply = pull_once(ep, [vllm_pull("xfer-" + str(uuid.uuid4()))])
    assert len(reply) == 1 and reply[0]["status"] == 2, reply  # ERROR, unauthenticated
    assert "unauthenticated pull refused" in reply[0]["err_msg"]
    # a forged auth frame of the right shape
    forged = b"DKA1P" + int(time.time() * 1000).to_bytes(8, "big") + os.urandom(16) + os.urandom(32)
    reply = pull_once(ep, [vllm_pull("xfer-x"), forged])
    assert "MAC does not match" in reply[0]["err_msg"], reply
    after = secret_pd.p.metrics()
    assert after['disagg:kv_auth_rejected_total{port="side_channel"}'] >= before + 2
    assert after["disagg:kv_pending_unknown_pulls"] == 0  # nothing reached the table


def test_cancel_with_secret_frees_blocks_and_forged_cancels_are_refused(secret_pd):
    """With the shared secret the decoder's cancel (client gone mid-pull) carries its MAC
    frame: P takes it and acknowledges, D frees its blocks at once.  Cancels from anyone
    else for that pull -- without a frame, or with a forged one, naming the transfer id and
    every likely req id -- are answered ERROR naming the refusal, counted, and cancel nothing."""
    x = secret_pd
    ep = side_channel_endpoint(x.bootstrap)
    tid = "xfer-" + str(uuid.uuid4())
    body = dict(BODY, prompt=corpus_prompts()[8], kv_transfer_params=d_params(x, transfer_id=tid))
    rejected_key = 'disagg:kv_auth_rejected_total{port="side_channel"}'
    rejected = x.p.metrics()[rejected_key]
    cancelled = metric(x.p, "disagg:kv_transfer_failures_total", side="producer", reason="cancelled")
    acked = metric(x.d, "disagg:kv_cancels_total", acked="yes")
    s = raw_post(x.d, body)
    try:
        deadline = time.time() + 10  # the pull waits at P: its transfer id has not arrived there
        while x.p.metrics()["disagg:kv_pending_unknown_pulls"] < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert x.p.metrics()["disagg:kv_pending_unknown_pulls"] >= 1, "the pull never reached P"
        assert blocks_used(x.d) > 0
        cancel = msgpack.packb({"disagg_cancel": {f"d-{i}": tid for i in range(256)}})
        reply = pull_once(ep, [cancel])
        assert len(reply) == 1 and reply[0]["status"] == 2, reply  # ERROR, unauthenticated
        assert "unauthenticated cancel refused" in reply[0]["err_msg"], reply
        forged = b"DKA1C" + int(time.time() * 1000).to_bytes(8, "big") + os.urandom(48)
        reply = pull_once(ep, [cancel, forged])
        assert "cancel authentication failed: the MAC does not match" in reply[0]["err_msg"], reply
        m = x.p.metrics()
        assert m[rejected_key] == rejected + 2
        assert m['disagg:kv_transfer_failures_total{side="producer",reason="cancelled"}'] == cancelled
        assert m["disagg:kv_pending_unknown_pulls"] >= 1  # the real pull still waits
        assert blocks_used(x.d) > 0
    finally:
        s.close()
    t0 = time.time()
    wait_blocks_zero(x.d, timeout=3)  # generous for "at once"; without the ack: 35 s quarantine
    print(f"decoder blocks free {time.time() - t0:.3f} s after the disconnect (secret set)")
    assert metric(x.d, "disagg:kv_cancels_total", acked="yes") == acked + 1
    assert metric(x.p, "disagg:kv_transfer_failures_total", side="producer",
                  reason="cancelled") == cancelled + 1
    assert x.p.metrics()[rejected_key] == rejected + 2  # D's own cancel was accepted
    # P's request for that transfer arrives late: its KV is released once ready
    r = requests.post(x.p.url + "/v1/completions", timeout=TIMEOUT, json=dict(
        body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid}))
    assert r.status_code == 200, r.text
    wait_blocks_zero(x.p, timeout=5)
    assert x.p.metrics()["disagg:kv_pending_unknown_pulls"] == 0
    pr, dr = x.send(dict(BODY, prompt=corpus_prompts()[3]))
    assert pr.status_code == 200 and dr.status_code == 200 and not failed(dr), dr.text


def test_one_sided_secret_refused_on_both_sides():
    """D without the secret against P with it, and the reverse: each request
    fails with a message naming the cause, and D's blocks are freed."""
    no_secret_env()
    for p_env, d_cfg, needle in (
            ({"DISAGG_KV_SECRET": SECRET}, None, "unauthenticated pull refused"),
            (None, consumer_config({"auth_secret": SECRET}), "this producer has no auth_secret")):
        x = PD(p_env=p_env, d_cfg=d_cfg)
        try:
            pr, dr = x.send(dict(BODY, prompt=corpus_prompts()[3]))
            assert pr.status_code == 200
            assert failed(dr), dr.text
            assert needle in dr.text or needle in x.d.logs(), (dr.text, x.d.logs())
            assert "refusing" in x.p.logs()  # the producer's side logs it too
            assert x.p.metrics()['disagg:kv_auth_rejected_total{port="side_channel"}'] >= 1
        finally:
            x.stop()


# ---- 4. a flood of bogus pulls -------------------------------------------------------------

def final_reply(sock, timeout):
    """The pull's final reply (FINISH or ERROR) within timeout seconds, else None.  CONTINUEs
    are skipped as vLLM's decoder skips them (P sends one at once naming requests whose
    transfer id it does not know yet, "disagg_unknown_reqs")."""
    deadline = time.time() + timeout
    while True:
        left = deadline - time.time()
        if left <= 0 or not sock.poll(int(left * 1000)):
            return None
        r = msgpack.unpackb(sock.recv())
        if r["status"] != 1:
            return r
        assert r.get("disagg_unknown_reqs") in (None, ["d-evil"]), r


def test_pending_pull_cap_evicts_the_oldest(colocated):
    """max_pending_pulls 2: a third pull for an unknown transfer id evicts the
    first (answered at once, naming the key); the two newer ones keep waiting;
    real requests still work."""
    no_secret_env()
    x = PD(p_cfg=producer_config({"max_pending_pulls": 2}))
    ctx = zmq.Context.instance()
    socks = []
    try:
        ep = side_channel_endpoint(x.bootstrap)
        blen = producer_block_len(ep)
        for i in range(3):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            s.send(vllm_pull(f"xfer-wait-{i}-{uuid.uuid4()}", block_len=blen))
            socks.append(s)
            time.sleep(0.2)  # arrival order = eviction order
        r = final_reply(socks[0], 5)
        assert r is not None, "the oldest pull was not answered"
        assert r["status"] == 0 and r.get("err_reqs") == ["d-evil"], r  # FINISH, request failed
        assert "evicted" in r["err_msg"] and "max_pending_pulls" in r["err_msg"], r
        assert final_reply(socks[1], 0.3) is None and final_reply(socks[2], 0.3) is None  # waiting
        m = x.p.metrics()
        assert m["disagg:kv_pending_pulls_evicted_total"] == 1
        assert m["disagg:kv_pending_unknown_pulls"] == 2
        body = dict(BODY, prompt=corpus_prompts()[4])
        ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
        pr, dr = x.send(body)
        assert completion_ids(dr) == ref
    finally:
        for s in socks:
            s.close()
        x.stop()


def flood(endpoint, n, block_len, secret_frame=None, stop=None):
    """n bogus pulls with distinct transfer ids from one DEALER, replies drained."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(endpoint)
    sent = got = 0
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    t_end = time.time() + 120
    idle_since = None
    while time.time() < t_end and not (stop and stop.is_set()):
        if sent < n:
            frames = [vllm_pull(f"xfer-bogus-{uuid.uuid4()}", req_id=f"d-b{sent}",
                                block_len=block_len)]
            if secret_frame:
                frames.append(secret_frame)
            s.send_multipart(frames)
            sent += 1
        n_before = got
        while poller.poll(0 if sent < n else 100):
            s.recv_multipart()
            got += 1
        if sent == n:  # all sent: drain until answered or 2 s without a reply
            if got == sent:
                break
            if got > n_before:
                idle_since = None
            elif idle_since is None:
                idle_since = time.time()
            elif time.time() - idle_since > 2:
                break
    s.close()
    return sent, got


def timed_request(pd, body):
    t0 = time.time()
    pr, dr = pd.send(body)
    return time.time() - t0, pr, dr


@pytest.mark.parametrize("with_secret", [False, True], ids=["no-secret", "secret"])
def test_bogus_pull_flood_does_not_delay_real_requests(with_secret, colocated):
    """Thousands of bogus pulls (pyzmq) while real requests go through: each
    real one still completes (generous liveness bound), bogus pulls beyond
    max_pending_pulls are refused at once (no secret) or never reach the table
    (secret).  Latencies are printed for docs/benchmarks.md."""
    no_secret_env()
    n_bogus = 20000
    if with_secret:
        x = PD(p_env={"DISAGG_KV_SECRET": SECRET}, d_env={"DISAGG_KV_SECRET": SECRET})
    else:
        x = PD(p_cfg=producer_config({"max_pending_pulls": 4096}))
    try:
        body = dict(BODY, prompt=corpus_prompts()[5])
        ref = completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
        base = []
        for _ in range(3):
            el, pr, dr = timed_request(x, body)
            assert completion_ids(dr) == ref
            base.append(el)
        ep = side_channel_endpoint(x.bootstrap)
        block_len = 4096 if with_secret else producer_block_len(ep)
        forged = (b"DKA1P" + int(time.time() * 1000).to_bytes(8, "big") + os.urandom(48)
                  if with_secret else None)
        result = {}
        stop = threading.Event()
        th = threading.Thread(target=lambda: result.update(r=flood(ep, n_bogus, block_len, forged, stop)))
        t_flood = time.time()
        th.start()
        during = []
        try:
            time.sleep(0.3)  # the flood is under way
            for _ in range(5):
                el, pr, dr = timed_request(x, body)
                assert pr.status_code == 200, pr.text
                assert completion_ids(dr) == ref  # the real request's KV still arrives intact
                assert el < 30, f"a real request took {el:.1f} s during the flood"
                during.append(el)
        finally:
            th.join(150)
            stop.set()
        flood_s = time.time() - t_flood
        sent, got = result["r"]
        m = x.p.metrics()
        print(f"\n[security flood] secret={with_secret} bogus={n_bogus} sent in {flood_s:.2f} s, "
              f"{got} answered; real request s: before "
              f"{' '.join(f'{v:.3f}' for v in base)}; during {' '.join(f'{v:.3f}' for v in during)}")
        # (replies beyond ZeroMQ's high-water mark of the flooder's own pipe are
        # dropped when it reads slower than it sends: its loss, not a real peer's)
        assert sent == n_bogus and got > 0, (sent, got)
        if with_secret:  # every one refused at once, none reached the table
            assert m['disagg:kv_auth_rejected_total{port="side_channel"}'] >= n_bogus
            assert m["disagg:kv_pending_unknown_pulls"] == 0
        else:  # at most max_pending_pulls wait; the older ones were evicted and answered
            assert m["disagg:kv_pending_unknown_pulls"] <= 4096
            assert m["disagg:kv_pending_pulls_evicted_total"] >= n_bogus - 4096
        # the pair still works after the flood
        el, pr, dr = timed_request(x, body)
        assert completion_ids(dr) == ref
    finally:
        x.stop()
