"""`disagg bootstrap` against PROTOCOL.md §2 (vLLM's MooncakeBootstrapServer API):
register/query responses and status codes checked with `requests`, malformed
bodies (422, FastAPI's detail shape), conflicts (400 with detail), and the
registration client's retry policy: 3 attempts, backoff 1 s then 2 s, bounded
time, clear error."""
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from server_harness import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("DISAGG_BIN", str(ROOT / "build" / "disagg"))


def _env(**extra):
    env = dict(os.environ)
    for k in ("VLLM_MOONCAKE_BOOTSTRAP_PORT", "VLLM_MOONCAKE_CONNECTOR_TIMEOUT", "http_proxy",
              "HTTP_PROXY"):
        env.pop(k, None)
    env.update(extra)
    return env


def start_server(port=0, **env):
    p = subprocess.Popen([BIN, "bootstrap", "--host", "127.0.0.1", "--port", str(port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(**env))
    line = p.stdout.readline()
    if "listening on http://127.0.0.1:" not in line:
        p.kill()
        raise RuntimeError(f"bootstrap did not start: {line!r} {p.stderr.read()}")
    return p, int(line.strip().rsplit(":", 1)[1])


def stop_server(p):
    p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()


@pytest.fixture
def server():
    # Liveness checks off: these tests register addresses nothing listens on (here,
    # or behind a REJECT firewall, refused: they would be dropped or replaced, which
    # is what the liveness tests below check).
    p, port = start_server(DISAGG_BOOTSTRAP_PROBE_INTERVAL="0")
    yield f"http://127.0.0.1:{port}"
    assert stop_server(p) == 0


def reg(url, engine_id="eng-A", dp=0, tp=0, pp=0, addr="tcp://10.0.0.2:53817"):
    return requests.post(url + "/register", json={"engine_id": engine_id, "dp_rank": dp,
                                                  "tp_rank": tp, "pp_rank": pp, "addr": addr},
                         timeout=10)


def test_register_and_query_shape(server):
    assert requests.get(server + "/query", timeout=10).json() == {}
    r = reg(server)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert r.headers["Content-Type"] == "application/json"
    assert reg(server, tp=1, addr="tcp://10.0.0.2:53818").status_code == 200
    assert reg(server, tp=0, pp=1, addr="tcp://10.0.0.2:53819").status_code == 200
    assert reg(server, engine_id="eng-B", dp=1, addr="tcp://10.0.0.3:50000").status_code == 200
    q = requests.get(server + "/query", timeout=10)
    assert q.status_code == 200
    assert q.json() == {
        "0": {"engine_id": "eng-A",
              "worker_addr": {"0": {"0": "tcp://10.0.0.2:53817", "1": "tcp://10.0.0.2:53819"},
                              "1": {"0": "tcp://10.0.0.2:53818"}}},
        "1": {"engine_id": "eng-B", "worker_addr": {"0": {"0": "tcp://10.0.0.3:50000"}}},
    }
    # identical re-registration (a client retry after its timeout) is accepted
    assert reg(server).status_code == 200
    assert requests.get(server + "/query", timeout=10).json()["0"]["worker_addr"]["0"]["0"] == \
        "tcp://10.0.0.2:53817"


def test_conflicts_are_400_with_detail(server):
    assert reg(server).status_code == 200
    r = reg(server, engine_id="eng-X", tp=3)
    assert r.status_code == 400
    detail = r.json()["detail"]
    assert isinstance(detail, str) and "eng-A" in detail and "eng-X" in detail
    assert "dp_rank=0" in detail
    r = reg(server, addr="tcp://10.0.0.2:1")
    assert r.status_code == 400
    assert "already registered at tcp://10.0.0.2:53817" in r.json()["detail"]
    # nothing changed
    assert requests.get(server + "/query", timeout=10).json() == {
        "0": {"engine_id": "eng-A", "worker_addr": {"0": {"0": "tcp://10.0.0.2:53817"}}}}


GOOD = {"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"}


@pytest.mark.parametrize("body,field,etype", [
    ({k: v for k, v in GOOD.items() if k != "addr"}, "addr", "missing"),
    ({k: v for k, v in GOOD.items() if k != "dp_rank"}, "dp_rank", "missing"),
    ({**GOOD, "dp_rank": "zero"}, "dp_rank", "int_type"),
    ({**GOOD, "tp_rank": 1.5}, "tp_rank", "int_type"),
    ({**GOOD, "pp_rank": None}, "pp_rank", "int_type"),
    ({**GOOD, "pp_rank": -1}, "pp_rank", "greater_than_equal"),
    ({**GOOD, "engine_id": 5}, "engine_id", "string_type"),
    ({**GOOD, "addr": ["tcp://h:1"]}, "addr", "string_type"),
])
def test_malformed_fields_are_422(server, body, field, etype):
    r = requests.post(server + "/register", json=body, timeout=10)
    assert r.status_code == 422
    errors = r.json()["detail"]
    assert isinstance(errors, list) and errors
    assert {"type": etype, "loc": ["body", field]}.items() <= errors[0].items()
    assert errors[0]["msg"]
    assert requests.get(server + "/query", timeout=10).json() == {}


def test_malformed_bodies_are_422(server):
    for data in (b"", b"not json", b"{\"engine_id\": ", b"[1,2]", b"\"str\"", b"null"):
        r = requests.post(server + "/register", data=data,
                          headers={"Content-Type": "application/json"}, timeout=10)
        assert r.status_code == 422, data
        assert isinstance(r.json()["detail"], list)
    r = requests.post(server + "/register", data=b"not json", timeout=10)
    assert r.json()["detail"][0]["type"] == "json_invalid"
    # every missing field is reported at once
    r = requests.post(server + "/register", json={}, timeout=10)
    assert r.status_code == 422
    assert sorted(e["loc"][1] for e in r.json()["detail"]) == \
        ["addr", "dp_rank", "engine_id", "pp_rank", "tp_rank"]


def test_oversized_body_and_other_routes(server):
    r = requests.post(server + "/register", data=b"{" + b" " * 100000 + b"}", timeout=10)
    assert r.status_code == 413
    r = requests.get(server + "/register", timeout=10)
    assert r.status_code == 405
    r = requests.post(server + "/query", timeout=10)
    assert r.status_code == 405
    r = requests.get(server + "/nothing", timeout=10)
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    # still serving
    assert reg(server).status_code == 200


def test_concurrent_registrations(server):
    results = []

    def worker(tp):
        results.append(reg(server, tp=tp, addr=f"tcp://10.0.0.2:{50000 + tp}").status_code)

    threads = [threading.Thread(target=worker, args=(tp,)) for tp in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 32
    wa = requests.get(server + "/query", timeout=10).json()["0"]["worker_addr"]
    assert sorted(int(k) for k in wa) == list(range(32))
    assert all(wa[str(tp)] == {"0": f"tcp://10.0.0.2:{50000 + tp}"} for tp in range(32))


def test_cli_register_and_query(server):
    hp = server[len("http://"):]
    r = subprocess.run([BIN, "bootstrap", "register", "--server", hp, "--engine-id", "cli-eng",
                        "--dp-rank", "2", "--tp-rank", "1", "--addr", "tcp://1.2.3.4:5"],
                       capture_output=True, text=True, timeout=30, env=_env())
    assert r.returncode == 0, r.stderr
    r = subprocess.run([BIN, "bootstrap", "query", "--server", server], capture_output=True,
                       text=True, timeout=30, env=_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout == "dp=2 engine_id=cli-eng tp=1 pp=0 addr=tcp://1.2.3.4:5\n"
    # a conflict is reported with the server's detail, not retried
    t0 = time.monotonic()
    r = subprocess.run([BIN, "bootstrap", "register", "--server", hp, "--engine-id", "other",
                        "--dp-rank", "2", "--addr", "tcp://1.2.3.4:6"],
                       capture_output=True, text=True, timeout=30, env=_env())
    assert r.returncode == 1
    assert "HTTP 400" in r.stderr and "Engine ID mismatch" in r.stderr
    assert time.monotonic() - t0 < 1.0




def test_register_unreachable_retries_then_fails():
    port = free_port()
    t0 = time.monotonic()
    r = subprocess.run([BIN, "bootstrap", "register", "--server", f"127.0.0.1:{port}",
                        "--engine-id", "e", "--addr", "tcp://1.2.3.4:5"],
                       capture_output=True, text=True, timeout=60,
                       env=_env(VLLM_MOONCAKE_CONNECTOR_TIMEOUT="0.5"))
    elapsed = time.monotonic() - t0
    assert r.returncode == 1
    assert "failed after 3 attempts" in r.stderr
    assert "attempt 1/3" in r.stderr and "retrying in 1.0 s" in r.stderr
    assert "attempt 2/3" in r.stderr and "retrying in 2.0 s" in r.stderr
    assert "attempt 3/3" not in r.stderr
    # backoff 1 s + 2 s; refused connections fail fast
    assert 2.9 <= elapsed < 6.0, elapsed


def test_register_timeout_per_attempt_is_bounded():
    # accepts TCP connections (kernel backlog) but never answers HTTP
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    port = lsock.getsockname()[1]
    try:
        t0 = time.monotonic()
        r = subprocess.run([BIN, "bootstrap", "query", "--server", f"127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=60,
                           env=_env(VLLM_MOONCAKE_CONNECTOR_TIMEOUT="0.4"))
        elapsed = time.monotonic() - t0
    finally:
        lsock.close()
    assert r.returncode == 1
    assert "failed after 3 attempts (timeout 0.4 s each" in r.stderr
    assert "imeout" in r.stderr
    # 3 x 0.4 s + 1 s + 2 s
    assert 4.1 <= elapsed < 8.0, elapsed


def test_register_succeeds_when_server_comes_up_during_backoff():
    port = free_port()
    proc = subprocess.Popen([BIN, "bootstrap", "register", "--server", f"127.0.0.1:{port}",
                             "--engine-id", "late", "--addr", "tcp://1.2.3.4:5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(VLLM_MOONCAKE_CONNECTOR_TIMEOUT="0.5"))
    time.sleep(0.5)  # first attempt refused; backoff 1 s
    srv, got = start_server(port)
    try:
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "attempt 1/3" in err
        q = requests.get(f"http://127.0.0.1:{got}/query", timeout=10).json()
        assert q["0"]["engine_id"] == "late"
    finally:
        assert stop_server(srv) == 0


def test_port_in_use_and_bad_env():
    p, port = start_server()
    try:
        r = subprocess.run([BIN, "bootstrap", "--host", "127.0.0.1", "--port", str(port)],
                           capture_output=True, text=True, timeout=30, env=_env())
        assert r.returncode == 1
        assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "in use" in r.stderr
    finally:
        assert stop_server(p) == 0
    r = subprocess.run([BIN, "bootstrap"], capture_output=True, text=True, timeout=30,
                       env=_env(VLLM_MOONCAKE_BOOTSTRAP_PORT="http"))
    assert r.returncode == 2
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT='http'" in r.stderr and "1 to 65535" in r.stderr
    r = subprocess.run([BIN, "bootstrap", "--port", "70000"], capture_output=True, text=True,
                       timeout=30, env=_env())
    assert r.returncode == 2 and "--port '70000'" in r.stderr
    r = subprocess.run([BIN, "bootstrap", "register", "--server", "nohostport", "--engine-id",
                        "e", "--addr", "a"], capture_output=True, text=True, timeout=30, env=_env())
    assert r.returncode == 1 and "'nohostport' is not accepted" in r.stderr
    r = subprocess.run([BIN, "bootstrap", "query", "--server", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=30,
                       env=_env(VLLM_MOONCAKE_CONNECTOR_TIMEOUT="-3"))
    assert r.returncode == 2 and "VLLM_MOONCAKE_CONNECTOR_TIMEOUT='-3'" in r.stderr


def test_env_port_default():
    port = free_port()
    p = subprocess.Popen([BIN, "bootstrap", "--host", "127.0.0.1"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=_env(VLLM_MOONCAKE_BOOTSTRAP_PORT=str(port)))
    try:
        assert p.stdout.readline().strip() == f"bootstrap server listening on http://127.0.0.1:{port}"
        assert requests.get(f"http://127.0.0.1:{port}/query", timeout=10).json() == {}
    finally:
        assert stop_server(p) == 0


# ---- addr validation and liveness -------------------------------------

ACCEPTED = "accepted: tcp://HOST:PORT with HOST a hostname, an IPv4 address or a bracketed IPv6"


@pytest.mark.parametrize("addr,why", [
    ("not a url", "does not start with tcp://"),
    ("http://10.0.0.2:5000", "does not start with tcp://"),
    ("tcp://10.0.0.2", "there is no :PORT"),
    ("tcp://:5000", "the host is empty"),
    ("tcp://10.0.0.2:0", "the port is not a number in 1-65535"),
    ("tcp://10.0.0.2:65536", "the port is not a number in 1-65535"),
    ("tcp://10.0.0.2:-1", "the port is not a number in 1-65535"),
    ("tcp://10.0.0.2:80x", "the port is not a number in 1-65535"),
    ("tcp://999.1.1.1:5000", "the host is not an IPv4 address"),
    ("tcp://a b:5000", "the host has a character other than"),
    ("tcp://-bad-.example:5000", "the host is not a valid hostname"),
    ("tcp://::1:5000", "an IPv6 host must be in brackets"),
    ("tcp://[::1:5000", "no closing ']'"),
    ("tcp://[not-v6]:5000", "not an IPv6 address"),
    ("tcp://[::1]5000", "no :PORT after the IPv6 address"),
])
def test_register_rejects_addresses_that_are_not_tcp_host_port(server, addr, why):
    r = reg(server, addr=addr)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert f"addr '{addr}' is not a side-channel address" in detail, detail
    assert why in detail and ACCEPTED in detail, detail
    assert requests.get(server + "/query", timeout=10).json() == {}


@pytest.mark.parametrize("addr", ["tcp://10.0.0.2:1", "tcp://[fe80::1]:65535",
                                  "tcp://prefill-0.example.com:5557", "tcp://localhost:5557"])
def test_register_accepts_hostnames_ipv4_and_bracketed_ipv6(server, addr):
    assert reg(server, addr=addr).status_code == 200
    assert requests.get(server + "/query", timeout=10).json()["0"]["worker_addr"]["0"]["0"] == addr


def _listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def _wait(pred, timeout, what):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def test_entries_whose_side_channel_refuses_are_dropped():
    """A worker whose side channel refuses connections (nothing listens: the instance
    is gone) leaves the table after 3 refused probes; a live one stays."""
    live = _listener()
    dead_port = free_port()
    p, port = start_server(DISAGG_BOOTSTRAP_PROBE_INTERVAL="0.2")
    url = f"http://127.0.0.1:{port}"
    try:
        live_addr = f"tcp://127.0.0.1:{live.getsockname()[1]}"
        assert reg(url, tp=0, addr=live_addr).status_code == 200
        assert reg(url, tp=1, addr=f"tcp://127.0.0.1:{dead_port}").status_code == 200
        t0 = time.monotonic()
        _wait(lambda: sorted(requests.get(url + "/query", timeout=10).json()["0"]["worker_addr"])
              == ["0"], 5.0, "the dead tp_rank 1 dropped")
        print(f"\ndead entry dropped {time.monotonic() - t0:.2f} s after registration "
              "(probe interval 0.2 s)")
        # the live one survives several more rounds
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert requests.get(url + "/query", timeout=10).json()["0"]["worker_addr"]["0"]["0"] \
                == live_addr
            time.sleep(0.1)
        live.close()  # now it is gone too: the engine leaves the table
        _wait(lambda: requests.get(url + "/query", timeout=10).json() == {}, 5.0,
              "the engine dropped once its last worker is gone")
    finally:
        live.close()
        assert stop_server(p) == 0
    err = p.stderr.read()
    assert f"dropping engine_id=eng-A dp_rank=0 tp_rank=1 pp_rank=0 at tcp://127.0.0.1:{dead_port}: " \
           "its side channel refused 3 connections in a row (the instance is gone)" in err, err


def test_a_restarted_prefill_replaces_its_dead_entry():
    """Periodic probes out of the way (1 h): a registration that conflicts with a dead
    entry (another engine_id on the dp_rank, or the same rank at another address)
    replaces it at once instead of 400; a conflict with a live entry stays 400."""
    p, port = start_server(DISAGG_BOOTSTRAP_PROBE_INTERVAL="3600")
    url = f"http://127.0.0.1:{port}"
    live = _listener()
    try:
        assert reg(url, engine_id="old", addr=f"tcp://127.0.0.1:{free_port()}").status_code == 200
        new_addr = f"tcp://127.0.0.1:{live.getsockname()[1]}"
        r = reg(url, engine_id="new", addr=new_addr)  # a restart with a new random engine id
        assert r.status_code == 200, r.text
        assert requests.get(url + "/query", timeout=10).json() == {
            "0": {"engine_id": "new", "worker_addr": {"0": {"0": new_addr}}}}
        # the same rank at another (live) address: the live one stands
        r = reg(url, engine_id="new", addr=f"tcp://127.0.0.1:{free_port()}")
        assert r.status_code == 400 and "already registered at" in r.json()["detail"]
        r = reg(url, engine_id="other", addr=new_addr)
        assert r.status_code == 400 and "Engine ID mismatch" in r.json()["detail"]
    finally:
        live.close()
        assert stop_server(p) == 0
    assert "replacing engine_id=old dp_rank=0 tp_rank=0 pp_rank=0" in p.stderr.read()


def test_probe_interval_env_is_validated():
    r = subprocess.run([BIN, "bootstrap", "--host", "127.0.0.1", "--port", "0"],
                       capture_output=True, text=True, timeout=30,
                       env=_env(DISAGG_BOOTSTRAP_PROBE_INTERVAL="soon"))
    assert r.returncode == 1
    assert "DISAGG_BOOTSTRAP_PROBE_INTERVAL='soon' is not seconds in [0, 3600]" in r.stderr


def test_warns_when_listening_beyond_loopback_without_a_secret():
    p = subprocess.Popen([BIN, "bootstrap", "--host", "0.0.0.0", "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(DISAGG_KV_SECRET=""))
    try:
        assert "listening on" in p.stdout.readline()
    finally:
        stop_server(p)
    err = p.stderr.read()
    assert "SECURITY WARNING: no shared secret" in err and "(0.0.0.0)" in err, err
    p, _ = start_server()  # 127.0.0.1: no warning
    stop_server(p)
    assert "SECURITY WARNING" not in p.stderr.read()
