"""Slow and large clients, over real sockets against the
real `disagg serve` and `disagg proxy`:

* a slow-loris client (one byte a second, never finishing its head) is cut
  off at the header deadline (--client-header-timeout), which its bytes do not
  extend: 408, then the connection closes;
* a slow-body client (head complete, then the body a byte a second) is cut
  off at the body deadline (--client-body-timeout), which its bytes do not
  extend either: 408, then close; disagg:http_deadline_closes_total{kind}
  counts header, body and keep-alive closes;
* the bootstrap server (`disagg bootstrap`) cuts off a slow-loris at its
  header deadline (--client-header-timeout) too;
* idle keep-alive connections expire (--timeout-keep-alive), on the server,
  on the proxy's client side, and in the proxy's upstream pool
  (--upstream-keepalive-timeout); a connection reused within the timeout works;
* while two clients post 30 MB prompts, /health keeps answering (the prompts
  are parsed and tokenized off the event loop; the measured latency goes to
  docs/benchmarks.md, the assertion is a generous liveness bound);
* JSON strings holding \\u0000 are accepted and tokenized as the Hugging Face
  tokenizer does (ids below from `tokenizers` 0.23.3 on
  models/disagg-sotu-tiny/tokenizer.json), also through the proxy.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from proxy_fixtures import ProxyProc, doubles, proxy_factory  # noqa: F401
from server_harness import Server

HEADER_S = 2.0
KEEPALIVE_S = 1.0
SLACK_S = 5.0  # generous: the machine is shared


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "1024", "--kv-cache-memory", "64M",
               "--client-header-timeout", str(HEADER_S), "--timeout-keep-alive", str(KEEPALIVE_S))
    yield s
    rc = s.stop()
    assert rc == 0, "disagg serve did not exit cleanly on SIGTERM: " + s.logs()


def slow_loris(port, limit_s):
    """Sends a request head one byte a second and never ends it; returns
    (seconds until the peer closed, bytes received)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 1000
    t0 = time.monotonic()
    s.sendall(head[:16])
    s.settimeout(1.0)
    got = b""
    i = 16
    try:
        while time.monotonic() - t0 < limit_s:
            try:
                c = s.recv(4096)
            except socket.timeout:
                s.sendall(head[i:i + 1])  # one byte a second keeps a per-read timeout alive
                i += 1
                continue
            if not c:
                return time.monotonic() - t0, got
            got += c
    except (ConnectionResetError, BrokenPipeError):
        return time.monotonic() - t0, got
    finally:
        s.close()
    return None, got


def closed_after_idle(port, first_request, limit_s):
    """Sends one complete request on a keep-alive connection, reads its answer,
    then waits; returns seconds until the peer closed (None: still open)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(first_request)
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(4096)
    t0 = time.monotonic()
    s.settimeout(limit_s)
    try:
        while True:
            c = s.recv(4096)
            if not c:
                return time.monotonic() - t0
    except socket.timeout:
        return None
    except ConnectionResetError:
        return time.monotonic() - t0
    finally:
        s.close()


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


# ---- server ------------------------------------------------------------------

def test_server_cuts_off_a_slow_loris_at_the_header_deadline(server):
    took, got = slow_loris(server.port, HEADER_S + SLACK_S)
    assert took is not None, f"a 1 byte/s client still connected after {HEADER_S + SLACK_S} s"
    assert took >= HEADER_S - 0.5
    assert got.startswith(b"HTTP/1.1 408"), got
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_server_closes_a_silent_new_connection(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=HEADER_S + SLACK_S)
    try:
        assert s.recv(4096).startswith(b"HTTP/1.1 408")  # then EOF
    finally:
        s.close()


def test_server_expires_idle_keep_alive_connections(server):
    took = closed_after_idle(server.port, HEALTH, KEEPALIVE_S + SLACK_S)
    assert took is not None, f"idle keep-alive connection still open after {KEEPALIVE_S + SLACK_S} s"


def test_server_keep_alive_reuse_within_the_timeout(server):
    with requests.Session() as sess:
        for _ in range(3):
            assert sess.get(server.url + "/health", timeout=10).status_code == 200
            time.sleep(KEEPALIVE_S / 4)


def test_server_body_after_the_head_is_not_cut_by_the_header_deadline(server):
    """The header deadline covers the head only: a body that takes longer
    than it (but arrives) is served."""
    body = json.dumps({"prompt": "Fellow-Citizens", "max_tokens": 1}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body))
    time.sleep(HEADER_S + 0.5)
    s.sendall(body)
    buf = b""
    while b"\r\n\r\n" not in buf:
        c = s.recv(4096)
        assert c, "closed"
        buf += c
    s.close()
    assert buf.startswith(b"HTTP/1.1 200"), buf[:200]


# ---- body deadline and the deadline counter ------------------------------------------

BODY_S = 2.0


@pytest.fixture(scope="module")
def body_server():
    s = Server("--max-model-len", "1024", "--kv-cache-memory", "64M",
               "--client-header-timeout", str(HEADER_S), "--timeout-keep-alive", str(KEEPALIVE_S),
               "--client-body-timeout", str(BODY_S))
    yield s
    rc = s.stop()
    assert rc == 0, "disagg serve did not exit cleanly on SIGTERM: " + s.logs()


def slow_body(port, limit_s):
    """Sends a complete head, then its body one byte a second (never the whole
    of it); returns (seconds from the head until the peer closed, bytes received)."""
    body = json.dumps({"prompt": "x" * 1000, "max_tokens": 1}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body))
    t0 = time.monotonic()
    s.settimeout(1.0)
    got = b""
    i = 0
    try:
        while time.monotonic() - t0 < limit_s:
            try:
                c = s.recv(4096)
            except socket.timeout:
                s.sendall(body[i:i + 1])  # a byte a second: a per-read timeout never fires
                i += 1
                continue
            if not c:
                return time.monotonic() - t0, got
            got += c
    except (ConnectionResetError, BrokenPipeError):
        return time.monotonic() - t0, got
    finally:
        s.close()
    return None, got


def deadline_closes(srv):
    out = {}
    for k, v in srv.metrics().items():
        if k.startswith("disagg:http_deadline_closes_total{"):
            out[k.split('kind="')[1].split('"')[0]] = v
    assert set(out) == {"header", "body", "keepalive"}, out
    return out


def test_server_cuts_off_a_slow_body_at_the_body_deadline(body_server):
    before = deadline_closes(body_server)
    took, got = slow_body(body_server.port, BODY_S + SLACK_S)
    assert took is not None, f"a 1 byte/s body still connected after {BODY_S + SLACK_S} s"
    assert took >= BODY_S - 0.5
    assert got.startswith(b"HTTP/1.1 408"), got
    after = deadline_closes(body_server)
    assert after["body"] == before["body"] + 1, (before, after)
    assert after["header"] == before["header"]
    r = requests.post(body_server.url + "/v1/completions",
                      json={"prompt": "Fellow-Citizens", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text


def test_deadline_counter_counts_header_and_keepalive_closes(body_server):
    before = deadline_closes(body_server)
    took, got = slow_loris(body_server.port, HEADER_S + SLACK_S)
    assert took is not None and got.startswith(b"HTTP/1.1 408"), got
    took = closed_after_idle(body_server.port, HEALTH, KEEPALIVE_S + SLACK_S)
    assert took is not None
    after = deadline_closes(body_server)
    assert after["header"] == before["header"] + 1, (before, after)
    # the /metrics scrapes themselves may leave idle keep-alive connections: at least one
    assert after["keepalive"] >= before["keepalive"] + 1, (before, after)
    assert after["body"] == before["body"]


def test_server_refuses_a_bad_body_timeout():
    r = subprocess.run([os.environ.get("DISAGG_BIN", "disagg"), "serve", "x",
                        "--client-body-timeout", "soon"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert "--client-body-timeout expects seconds" in r.stderr and "'soon'" in r.stderr


# ---- bootstrap server header deadline -------------------------------------------

def start_bootstrap(*extra):
    p = subprocess.Popen([os.environ.get("DISAGG_BIN", "disagg"), "bootstrap", "--host",
                          "127.0.0.1", "--port", "0", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if "listening on http://127.0.0.1:" not in line:
        p.kill()
        raise RuntimeError(f"bootstrap did not start: {line!r} {p.stderr.read()}")
    return p, int(line.strip().rsplit(":", 1)[1])


def test_bootstrap_cuts_off_a_slow_loris_at_the_header_deadline():
    p, port = start_bootstrap("--client-header-timeout", str(HEADER_S))
    try:
        took, got = slow_loris(port, HEADER_S + SLACK_S)
        assert took is not None, f"a 1 byte/s client still connected after {HEADER_S + SLACK_S} s"
        assert took >= HEADER_S - 0.5
        assert got.startswith(b"HTTP/1.1 408"), got
        # a silent connection is closed too (no 408: nothing was asked)
        s = socket.create_connection(("127.0.0.1", port), timeout=HEADER_S + SLACK_S)
        try:
            assert s.recv(4096) == b""
        finally:
            s.close()
        # and the server still answers, also twice on one keep-alive connection
        with requests.Session() as sess:
            for _ in range(2):
                assert sess.get(f"http://127.0.0.1:{port}/query", timeout=10).status_code == 200
    finally:
        p.send_signal(2)
        assert p.wait(timeout=10) == 0, p.stderr.read()


def test_bootstrap_refuses_a_bad_header_timeout():
    r = subprocess.run([os.environ.get("DISAGG_BIN", "disagg"), "bootstrap",
                        "--client-header-timeout", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert "--client-header-timeout expects seconds" in r.stderr


# ---- long prompts do not stall the loop -------------------------------------------

POLLER = r"""
import sys, time, requests
url, stop_file = sys.argv[1], sys.argv[2]
import os
while not os.path.exists(stop_file):
    t = time.time()
    r = requests.get(url + "/health", timeout=60)
    print(f"{t:.6f} {time.time() - t:.6f} {r.status_code}", flush=True)
    time.sleep(0.02)
"""


def test_health_answers_while_two_clients_post_30mb_prompts(server, tmp_path):
    words = "Fellow-Citizens of the Senate and House of Representatives: the state of the Union. "
    prompt = (words * (30_000_000 // len(words) + 1))[:30_000_000]
    bodies = [json.dumps({"prompt": prompt, "max_tokens": 1}).encode(),
              json.dumps({"prompt": prompt}).encode()]
    stop = tmp_path / "stop"
    # the poller is another process: a Python thread here would wait for the GIL
    poller = subprocess.Popen([sys.executable, "-c", POLLER, server.url, str(stop)],
                              stdout=subprocess.PIPE, text=True)
    results = []

    def post(ep, body):
        t0 = time.time()
        r = requests.post(server.url + ep, data=body, headers={"Content-Type": "application/json"},
                          timeout=300)
        results.append((ep, t0, time.time(), r.status_code, r.text[:300]))

    time.sleep(0.3)
    threads = [threading.Thread(target=post, args=(ep, b))
               for ep, b in (("/v1/completions", bodies[0]), ("/tokenize", bodies[1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.touch()
    out, _ = poller.communicate(timeout=60)
    by_ep = {r[0]: r for r in results}
    assert by_ep["/v1/completions"][3] == 400 and "maximum context length" in by_ep["/v1/completions"][4]
    assert by_ep["/tokenize"][3] == 200 and by_ep["/tokenize"][4].startswith('{"count":')
    t_begin = min(r[1] for r in results)
    t_end = max(r[2] for r in results)
    during = [(float(t), float(lat), int(st)) for t, lat, st in (l.split() for l in out.split("\n") if l)
              if t_begin <= float(t) <= t_end]
    assert len(during) >= 3, f"/health was hardly polled while the posts ran: {during}"
    assert all(st == 200 for _, _, st in during)
    lats = sorted(lat for _, lat, _ in during)
    print(f"\n/health during two 30 MB posts ({t_end - t_begin:.2f} s): {len(lats)} answers, "
          f"median {1000 * lats[len(lats) // 2]:.1f} ms, max {1000 * lats[-1]:.1f} ms")
    # Liveness, generously: tokenized on the loop, a 30 MB /tokenize alone holds
    # it for seconds (parse, 7 M ids, 50 MB of JSON).
    assert lats[-1] < 1.0, f"/health waited {lats[-1]:.2f} s while the prompts were prepared"


def big_body(mb=30):
    words = "Fellow-Citizens of the Senate and House of Representatives: the state of the Union. "
    n = mb * 1_000_000
    return json.dumps({"prompt": (words * (n // len(words) + 1))[:n]}).encode()


def send_raw_post(port, path, body):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body)) + body)
    return s


def test_client_leaving_while_its_prompt_is_prepared():
    """The client closes while its 30 MB prompt is being tokenized off the
    loop: the server carries on and still exits cleanly (the sanitizer build
    checks that nothing leaks)."""
    s = Server("--max-model-len", "1024", "--kv-cache-memory", "64M")
    try:
        body = big_body()
        for path in ("/v1/completions", "/tokenize"):
            c = send_raw_post(s.port, path, body)
            time.sleep(0.2)
            c.close()
        time.sleep(1.0)
        assert requests.get(s.url + "/health", timeout=10).status_code == 200
        r = requests.post(s.url + "/tokenize", json={"prompt": "a\x00b"}, timeout=30)
        assert r.status_code == 200, r.text
        time.sleep(3.0)  # let the preparation thread finish both
    finally:
        rc = s.stop()
    assert rc == 0, "disagg serve did not exit cleanly: " + s.logs()


def test_shutdown_while_a_prompt_is_prepared():
    s = Server("--max-model-len", "1024", "--kv-cache-memory", "64M")
    try:
        c = send_raw_post(s.port, "/tokenize", big_body())
        time.sleep(0.3)
    finally:
        rc = s.stop()
    assert rc == 0, "disagg serve did not exit cleanly: " + s.logs()
    c.settimeout(10)
    try:
        got = c.recv(4096)
    except (ConnectionResetError, socket.timeout):
        got = b""
    c.close()
    assert got == b"" or got.startswith((b"HTTP/1.1 503", b"HTTP/1.1 200")), got[:200]


# ---- NUL in JSON strings -------------------------------------------------------------

NUL_TEXT = "Hello\x00 world\x00\x00!"
NUL_IDS = [39, 1343, 78, 188, 674, 188, 188, 0]  # HF tokenizers 0.23.3, tiny model


def test_tokenize_accepts_nul_like_hf(server):
    r = requests.post(server.url + "/tokenize", json={"prompt": NUL_TEXT, "add_special_tokens": False},
                      timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == NUL_IDS
    r = requests.post(server.url + "/detokenize", json={"tokens": NUL_IDS}, timeout=30)
    assert r.status_code == 200 and r.json()["prompt"] == NUL_TEXT


def test_completion_with_nul_prompt(server):
    body = {"prompt": NUL_TEXT, "max_tokens": 2, "echo": True, "temperature": 0}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["usage"]["prompt_tokens"] == len(NUL_IDS)
    assert j["choices"][0]["text"].startswith(NUL_TEXT)
    r = requests.post(server.url + "/v1/completions", json=dict(body, prompt=[NUL_TEXT, "a\x00b"]),
                      timeout=60)
    assert r.status_code == 200, r.text
    r = requests.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "a\x00b"}], "max_tokens": 1})
    assert r.status_code == 200, r.text
    r = requests.post(server.url + "/tokenize", timeout=30,
                      json={"messages": [{"role": "user", "content": "a\x00b"}]})
    assert r.status_code == 200, r.text
    toks = r.json()["tokens"]
    assert any(toks[i:i + 3] == [64, 188, 65] for i in range(len(toks))), toks  # "a\0b", as HF


def test_nul_in_a_name_is_refused_clearly(server):
    r = requests.post(server.url + "/v1/completions", json={"prompt": "x", "model": "tiny\x00evil"},
                      timeout=30)
    assert r.status_code == 400, r.text
    assert "NUL" in r.json()["error"]["message"] and r.json()["error"]["param"] == "model"


# ---- proxy ------------------------------------------------------------------------------

def pd_proxy(doubles, proxy_factory, extra):  # noqa: F811
    p = doubles("prefill", "p0")
    d = doubles("decode", "d0")
    return p, d, proxy_factory([p], [d], extra)


def test_proxy_cuts_off_a_slow_loris_at_the_header_deadline(doubles, proxy_factory):  # noqa: F811
    _, _, px = pd_proxy(doubles, proxy_factory, ["--client-header-timeout", str(HEADER_S)])
    took, got = slow_loris(px.port, HEADER_S + SLACK_S)
    assert took is not None, f"a 1 byte/s client still connected after {HEADER_S + SLACK_S} s"
    assert took >= HEADER_S - 0.5
    assert got.startswith(b"HTTP/1.1 408") and b"client-header-timeout" in got, got


def test_proxy_request_deadline_is_not_extended_by_body_bytes(doubles, proxy_factory):  # noqa: F811
    p, _, px = pd_proxy(doubles, proxy_factory, ["--client-timeout", str(HEADER_S)])
    s = socket.create_connection(("127.0.0.1", px.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    t0 = time.monotonic()
    s.settimeout(1.0)
    got = b""
    while time.monotonic() - t0 < HEADER_S + SLACK_S:
        try:
            c = s.recv(4096)
        except socket.timeout:
            s.sendall(b" ")
            continue
        if not c:
            break
        got += c
    s.close()
    assert got.startswith(b"HTTP/1.1 408"), got
    assert not p.completions()


def test_proxy_expires_idle_client_connections(doubles, proxy_factory):  # noqa: F811
    _, _, px = pd_proxy(doubles, proxy_factory, ["--timeout-keep-alive", str(KEEPALIVE_S)])
    took = closed_after_idle(px.port, HEALTH, KEEPALIVE_S + SLACK_S)
    assert took is not None, f"idle client connection still open after {KEEPALIVE_S + SLACK_S} s"


def open_conns(double):
    srv = [s for s in double._servers if s.kind == "api"][0]
    with srv.conns_lock:
        return len(srv.conns)


def test_proxy_upstream_pool_connections_expire(doubles, proxy_factory):  # noqa: F811
    p, d, px = pd_proxy(doubles, proxy_factory, ["--upstream-keepalive-timeout", "0.5",
                                                  "--health-interval", "3600"])
    r = requests.post(px.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 0.5 + SLACK_S
    while (open_conns(p) or open_conns(d)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_conns(p) == 0 and open_conns(d) == 0, \
        f"pooled upstream connections still open: prefill {open_conns(p)}, decode {open_conns(d)}"
    # the pool makes new connections afterwards
    r = requests.post(px.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_proxy_passes_nul_prompts(doubles, proxy_factory):  # noqa: F811
    p, d, px = pd_proxy(doubles, proxy_factory, [])
    r = requests.post(px.url + "/v1/completions", json={"prompt": NUL_TEXT, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    assert json.loads(p.completions()[-1]["body"])["prompt"] == NUL_TEXT
    assert json.loads(d.completions()[-1]["body"])["prompt"] == NUL_TEXT
