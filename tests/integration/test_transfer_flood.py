"""Idle-connection floods on the transfer engine's tcp data port
(docs/security.md "Connection floods"), with and without a shared secret, loopback only:

* a connection that sends nothing within 2 s of connecting (no request, or with a
  secret no authentication) is closed, so idle sockets cannot pile up;
* one address holds at most max_conns_per_peer (default 64) connections at once:
  beyond it the longest-idle connection of that address is closed to make room, so a
  real transfer from the same address still gets through while the flood goes on;
* connections that already carried a request (a pooled lane, idle between
  transfers) stay open below the cap.

The flood is bounded (300 connections) and every wait is a polled deadline."""
import os
import select
import socket
import subprocess
import time

import pytest

import mooncake_wire as mw
from conftest import child_env

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
SECRET = "flood test secret"
FLOOD = 300
PER_PEER = 64  # the documented default
FIRST_MSG_S = 2.0  # the documented deadline


def env_with(secret):
    env = child_env()
    env.pop("DISAGG_KV_SECRET", None)
    env.pop("DISAGG_KV_MAX_CONNS_PER_PEER", None)
    if secret is not None:
        env["DISAGG_KV_SECRET"] = secret
    return env


def start(start_target, monkeypatch, secret, extra=()):
    monkeypatch.delenv("DISAGG_KV_MAX_CONNS_PER_PEER", raising=False)
    if secret is None:
        monkeypatch.delenv("DISAGG_KV_SECRET", raising=False)
    else:
        monkeypatch.setenv("DISAGG_KV_SECRET", secret)
    t = start_target(protocol="tcp", host=HOST, buffer_size=1 << 20, buffers=1, pattern=41,
                     extra=extra)
    monkeypatch.delenv("DISAGG_KV_SECRET", raising=False)
    return t


def transfer(disagg_bin, secret, t, length=256 << 10):
    """A real `disagg transfer copy` READ of the target; returns elapsed ms."""
    t0 = time.monotonic()
    r = subprocess.run([disagg_bin, "transfer", "copy", "--target", t.segment, "--op", "read",
                        "--remote-addr", str(t.buffers[0]["addr"]), "--length", str(length),
                        "--protocol", "tcp", "--timeout-ms", "10000"],
                       capture_output=True, timeout=60, env=env_with(secret))
    ms = (time.monotonic() - t0) * 1e3
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    assert r.stdout == t.expected(0, 0, length)
    return ms


def is_closed(s):
    """The peer closed s (EOF or reset); never blocks."""
    r, _, _ = select.select([s], [], [], 0)
    if not r:
        return False
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except BlockingIOError:
        return False


def wait_closed(socks, want, timeout):
    """Polls until at least `want` of socks are closed by the peer; returns (n, seconds)."""
    t0 = time.monotonic()
    while True:
        n = sum(is_closed(s) for s in socks)
        if n >= want or time.monotonic() - t0 > timeout:
            return n, time.monotonic() - t0
        time.sleep(0.05)


def flood(port, n):
    socks = []
    for _ in range(n):
        s = socket.create_connection((HOST, port), timeout=5)
        s.setblocking(False)
        socks.append(s)
    return socks


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_idle_flood_is_closed_and_transfers_still_work(disagg_bin, start_target, monkeypatch,
                                                       secret):
    t = start(start_target, monkeypatch, secret)
    port = t.info["tcp_data_port"]
    t0 = time.monotonic()
    socks = flood(port, FLOOD)
    try:
        flood_s = time.monotonic() - t0
        ms = transfer(disagg_bin, secret, t)  # from the flooding address, during the flood
        # Every idle connection is closed: the ones past the cap at accept, the rest once
        # they have sent nothing for 2 s (bounded generously: 2 s deadline + 4 s slack).
        n, waited = wait_closed(socks, FLOOD, FIRST_MSG_S + 4.0 + flood_s)
        assert n == FLOOD, f"only {n} of {FLOOD} idle connections were closed"
        print(f"\n{FLOOD} idle connections ({'secret' if secret else 'no secret'}): opened in "
              f"{flood_s * 1e3:.0f} ms, transfer of 256 KiB during the flood {ms:.0f} ms, all "
              f"closed {time.monotonic() - t0:.2f} s after the flood began")
        err = t.stderr()
        assert f"per-peer limit {PER_PEER}" in err, err[-2000:]
        if secret is None:
            assert "sent no request within 2 s of connecting" in err, err[-2000:]
        else:
            assert "no authentication within 2 s" in err, err[-2000:]
        transfer(disagg_bin, secret, t)  # and after it
    finally:
        for s in socks:
            s.close()
    rc, stats = t.stop()
    assert rc == 0


def test_connections_that_spoke_stay_open_below_the_cap(start_target, monkeypatch):
    """A connection that carried a request is a pooled lane: no 2 s deadline; but one
    address holds at most max_conns_per_peer of them (oldest idle closed first)."""
    cap = 16
    t = start(start_target, monkeypatch, None, extra=("--max-conns-per-peer", cap))
    port = t.info["tcp_data_port"]
    addr = t.buffers[0]["addr"]
    conns = []
    try:
        for _ in range(cap):
            c = mw.DataConn(HOST, port)
            assert c.read(addr, 8) == (mw.STATUS_OK, t.expected(0, 0, 8))
            conns.append(c)
            # the server marks a lane idle just after its reply: a pause keeps the idle order
            # the order of the connections (on a loaded machine the next one could overtake)
            time.sleep(0.05)
        socks = [c.sock for c in conns]
        # Past the first-message deadline, pooled connections are still open.
        t_end = time.monotonic() + FIRST_MSG_S + 0.5
        while time.monotonic() < t_end:
            assert not any(is_closed(s) for s in socks), "a pooled connection was closed"
            time.sleep(0.1)
        # More from the same address: the oldest idle ones make room, one each.
        extra = []
        for _ in range(cap // 2):
            c = mw.DataConn(HOST, port)
            assert c.read(addr, 8) == (mw.STATUS_OK, t.expected(0, 0, 8))
            extra.append(c)
        n, _ = wait_closed(socks, cap // 2, 5.0)
        closed = [i for i, s in enumerate(socks) if is_closed(s)]
        assert len(closed) == cap // 2, f"connections {closed} closed, {cap // 2} expected"
        assert closed == list(range(cap // 2)), f"connections {closed} closed, not the oldest"
        assert not any(is_closed(c.sock) for c in extra)
        conns += extra
    finally:
        for c in conns:
            c.close()
    assert f"per-peer limit {cap}" in t.stderr()
    rc, _ = t.stop()
    assert rc == 0


def test_max_conns_per_peer_is_validated(disagg_bin):
    env = env_with(None)
    env["DISAGG_KV_MAX_CONNS_PER_PEER"] = "lots"
    r = subprocess.run([disagg_bin, "transfer", "target", "--host", HOST, "--buffer-size", "4096"],
                       capture_output=True, text=True, timeout=30, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    assert "DISAGG_KV_MAX_CONNS_PER_PEER='lots' is not an integer in 1..1024" in r.stderr, r.stderr
