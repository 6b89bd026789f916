"""Who may talk to the transfer engine's ports (docs/transfer.md, Security):

* the handshake and data ports listen only on the advertised host (and the
  whitelisted interfaces), never on a wildcard address;
* with a shared secret ($DISAGG_KV_SECRET for the CLI), the handshake is an
  HMAC challenge-response and every data connection authenticates before any
  request frame is read: a peer without the secret, or with another one, a
  plain Mooncake engine and a raw-socket attacker are all refused, with a
  clear error on both sides, and cannot read or write a registered byte;
* the right secret works (copy and the pipelined, striped `transfer check`).
"""
import os
import socket
import struct
import subprocess
import time

import pytest

import mooncake_wire as mw
from conftest import child_env
from test_mooncake_interop import start_mooncake  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
SECRET = "correct horse battery staple"
STATUS_AUTH_REFUSED = 3


def env_with(secret):
    env = child_env()
    env.pop("DISAGG_KV_SECRET", None)
    if secret is not None:
        env["DISAGG_KV_SECRET"] = secret
    return env


def start(start_target, monkeypatch, secret, **kw):
    if secret is None:
        monkeypatch.delenv("DISAGG_KV_SECRET", raising=False)
    else:
        monkeypatch.setenv("DISAGG_KV_SECRET", secret)
    t = start_target(protocol="tcp", host=HOST, buffer_size=2 << 20, buffers=2, pattern=31, **kw)
    monkeypatch.delenv("DISAGG_KV_SECRET", raising=False)
    assert t.info["auth"] == (secret is not None)
    return t


def copy(disagg_bin, secret, *args, input=None):
    return subprocess.run([disagg_bin, "transfer", "copy", *map(str, args)], input=input,
                          capture_output=True, timeout=60, env=env_with(secret))


def read(disagg_bin, secret, t, k, off, n, protocol="tcp"):
    return copy(disagg_bin, secret, "--target", t.segment, "--op", "read", "--remote-addr",
                t.buffers[k]["addr"] + off, "--length", n, "--protocol", protocol)


def wait_for(pred, timeout=5.0):
    """pred() within timeout seconds (a liveness bound, polled)."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def stop_stats(t):
    rc, stats = t.stop()
    assert rc == 0
    return stats


# ---- binding ------------------------------------------------------------------

def listeners(port):
    """Local addresses of the LISTEN sockets on port (from /proc/net/tcp, tcp6)."""
    out = []
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            addr, p = f[1].split(":")
            if f[3] != "0A" or int(p, 16) != port:
                continue
            raw = bytes.fromhex(addr)
            if v6:
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                out.append(socket.inet_ntop(socket.AF_INET6, raw))
            else:
                out.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
    return out


@pytest.mark.parametrize("extra", [(), ("--device-name", "lo")], ids=["host", "device-name-lo"])
def test_ports_bind_only_the_selected_interfaces(start_target, monkeypatch, extra):
    t = start(start_target, monkeypatch, None, extra=extra)
    rpc = int(t.segment.rsplit(":", 1)[1])
    data = t.info["tcp_data_port"]
    wild = {"0.0.0.0", "::"}
    for port, what in ((rpc, "handshake"), (data, "data")):
        got = listeners(port)
        assert got, f"no listener found for the {what} port {port}"
        assert not wild & set(got), f"the {what} port listens on a wildcard address: {got}"
        assert set(got) <= {"127.0.0.1", "::1"}, f"the {what} port listens beyond lo: {got}"
    # Another local address (when the host has one) reaches neither port.
    try:
        others = [a for a in socket.gethostbyname_ex(socket.gethostname())[2] if not a.startswith("127.")]
    except OSError:
        others = []
    for a in others[:1]:
        for port in (rpc, data):
            with pytest.raises(OSError):
                socket.create_connection((a, port), timeout=2).close()


def test_foreign_advertised_host_falls_back_to_all_interfaces(start_target, monkeypatch):
    """A NAT'd VLLM_HOST_IP cannot be bound: the engine warns and listens everywhere."""
    monkeypatch.delenv("DISAGG_KV_SECRET", raising=False)
    monkeypatch.setenv("VLLM_HOST_IP", "203.0.113.7")  # TEST-NET-3, not on this host
    t = start_target(protocol="tcp", buffer_size=1 << 16)
    assert t.segment.startswith("203.0.113.7:")
    assert "is not an address of this host" in t.stderr()
    port = int(t.segment.rsplit(":", 1)[1])
    ftype, desc = mw.handshake(f"127.0.0.1:{port}", mw.FRAME_METADATA, {})
    assert desc["name"] == t.segment and desc["tcp_data_port"] == t.info["tcp_data_port"]


# ---- the right secret ---------------------------------------------------------

def test_right_secret_works(disagg_bin, start_target, monkeypatch):
    t = start(start_target, monkeypatch, SECRET)
    for k, off, n in ((0, 3, 5000), (1, 12345, (1 << 20) + 7)):
        r = read(disagg_bin, SECRET, t, k, off, n)
        assert r.returncode == 0, r.stderr.decode()
        assert r.stdout == t.expected(k, off, n)
    data = os.urandom(3000)
    r = copy(disagg_bin, SECRET, "--target", t.segment, "--op", "write", "--remote-addr",
             t.buffers[0]["addr"] + 77, "--length", len(data), "--protocol", "tcp", input=data)
    assert r.returncode == 0, r.stderr.decode()
    r = read(disagg_bin, SECRET, t, 0, 77, len(data), protocol="auto")
    assert r.returncode == 0 and r.stdout == data, r.stderr.decode()
    r = copy(disagg_bin, SECRET, "--target", t.segment, "--op", "write", "--remote-addr",
             t.buffers[0]["addr"] + 77, "--length", len(data), "--protocol", "tcp",
             input=t.expected(0, 77, len(data)))  # restore the pattern for check
    assert r.returncode == 0, r.stderr.decode()
    # pipelined, striped, several lanes: every connection authenticates
    r = subprocess.run([disagg_bin, "transfer", "check", "--target", t.segment, "--protocol", "tcp",
                        "--pattern", "31", "--iterations", "10", "--max-length", "3M"],
                       capture_output=True, timeout=120, env=env_with(SECRET))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert stop_stats(t)["auth_refused"] == 0


# ---- refusals -------------------------------------------------------------------

def test_missing_secret_refused(disagg_bin, start_target, monkeypatch):
    t = start(start_target, monkeypatch, SECRET)
    r = read(disagg_bin, None, t, 0, 0, 64)
    err = r.stderr.decode()
    assert r.returncode == 1 and r.stdout == b""
    assert "authentication required" in err, err
    assert "refused handshake" in t.stderr() and "did not authenticate" in t.stderr()
    assert stop_stats(t)["auth_refused"] >= 1


def test_wrong_secret_refused(disagg_bin, start_target, monkeypatch):
    t = start(start_target, monkeypatch, SECRET)
    r = read(disagg_bin, "not the secret", t, 0, 0, 64)
    err = r.stderr.decode()
    assert r.returncode == 1 and r.stdout == b""
    assert "failed authentication" in err and "does not verify" in err, err
    # the client refuses the server first; the server logs when it reads that
    assert wait_for(lambda: "refused handshake" in t.stderr()), t.stderr()
    data = b"\x00" * 64
    r = copy(disagg_bin, "not the secret", "--target", t.segment, "--op", "write", "--remote-addr",
             t.buffers[0]["addr"], "--length", 64, "--protocol", "tcp", input=data)
    assert r.returncode == 1
    r = read(disagg_bin, SECRET, t, 0, 0, 64)
    assert r.returncode == 0 and r.stdout == t.expected(0, 0, 64), "a refused WRITE changed the target"
    assert wait_for(lambda: t.stderr().count("refused handshake") >= 2), t.stderr()
    assert stop_stats(t)["auth_refused"] >= 2


def test_secret_initiator_refuses_unauthenticated_target(disagg_bin, start_target, monkeypatch):
    t = start(start_target, monkeypatch, None)
    r = read(disagg_bin, SECRET, t, 0, 0, 64)
    err = r.stderr.decode()
    assert r.returncode == 1 and r.stdout == b""
    assert "did not authenticate" in err, err
    assert "asks to authenticate, but this engine has no auth_secret" in t.stderr()


def test_raw_attacker_refused(start_target, monkeypatch):
    t = start(start_target, monkeypatch, SECRET)
    t.require_mem_access()
    b = t.buffers[0]
    # handshake: no descriptor without the secret
    ftype, ans = mw.handshake(t.segment, mw.FRAME_METADATA, {})
    assert "authentication required" in ans.get("error", ""), ans
    # a forged challenge-response
    s = mw.connect(HOST, int(t.segment.rsplit(":", 1)[1]))
    s.sendall(mw.encode_frame(mw.FRAME_METADATA, {"disagg_auth": {"nonce": "ab" * 32, "name": "1.2.3.4:5"}}))
    _, chal = mw.read_frame(s)
    assert set(chal["disagg_auth"]) == {"nonce", "mac"}
    s.sendall(mw.encode_frame(mw.FRAME_METADATA, {"disagg_auth": {"mac": "00" * 32}}))
    _, ans = mw.read_frame(s)
    assert "authentication failed" in ans.get("error", ""), ans
    s.close()
    # data port: Mooncake frames straight away
    port = t.info["tcp_data_port"]
    with mw.DataConn(HOST, port) as c:
        c.send(mw.encode_header(64, b["addr"], mw.OP_READ))
        assert c.status() == STATUS_AUTH_REFUSED
        assert c.closed_by_peer(), "the data port kept a refused connection open"
    with mw.DataConn(HOST, port) as c:
        try:
            c.send(mw.encode_header(4096, b["addr"], mw.OP_WRITE) + b"\xee" * 4096)
        except OSError:
            pass
        assert c.status() == STATUS_AUTH_REFUSED
    # data port: the auth preamble with a wrong proof
    with mw.DataConn(HOST, port) as c:
        c.send(b"DGXAUTH1" + os.urandom(32))
        (word,) = struct.unpack("<Q", mw.recv_exact(c.sock, 8))
        assert word == mw.STATUS_MAGIC | 4  # challenge: server nonce + proof follow
        mw.recv_exact(c.sock, 64)
        c.send(os.urandom(32))
        assert c.status() == STATUS_AUTH_REFUSED
        assert c.closed_by_peer()
    assert t.mem(b["addr"], 8192) == t.expected(0, 0, 8192), "a refused WRITE changed the target"
    t.assert_guards_intact()
    err = t.stderr()
    assert "refused data connection" in err and "did not authenticate" in err, err
    assert "proof does not verify" in err
    assert stop_stats(t)["auth_refused"] >= 5


def test_mooncake_refused_by_secret_target(start_mooncake, start_target, monkeypatch):  # noqa: F811
    t = start(start_target, monkeypatch, SECRET)
    mc = start_mooncake()
    rc, _ = mc.read(t.segment, t.buffers[0]["addr"], 64)
    assert rc != 0, "a Mooncake engine without the secret read a registered buffer"
    rc = mc.write(t.segment, t.buffers[0]["addr"], b"\xee" * 64)
    assert rc != 0
    assert "did not authenticate" in t.stderr()
    assert stop_stats(t)["auth_refused"] >= 1


def test_secret_initiator_refuses_mooncake_target(disagg_bin, start_mooncake):  # noqa: F811
    mc = start_mooncake(size=1 << 20)
    r = copy(disagg_bin, SECRET, "--target", mc.segment, "--op", "read", "--remote-addr", mc.addr,
             "--length", 64, "--protocol", "tcp")
    assert r.returncode == 1 and r.stdout == b""
    assert "did not authenticate" in r.stderr.decode(), r.stderr.decode()
