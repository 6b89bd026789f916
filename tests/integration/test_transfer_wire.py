"""The target's wire format, byte by byte, with an independent Python client
(mooncake_wire.py, written from Mooncake's source): the descriptor over the
handshake port, WRITE/READ over the TCP v2 data port, the bytes checked in the
target's memory through /proc/<pid>/mem; requests outside the buffers are
rejected with status code 1, the stream stays in sync, and no byte outside a
buffer changes.  That this format is Mooncake's is proven against the real
wheel in test_mooncake_interop.py; this file pins the details the wheel
cannot show (pipelining, exact status words, malformed opcodes)."""
import random
import struct

import pytest

import mooncake_wire as mw

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def target(start_target):
    t = start_target(protocol="tcp", buffer_size=1 << 20, buffers=2, pattern=2024)
    t.require_mem_access()
    return t


def data_conn(t):
    return mw.DataConn.from_descriptor(t.segment, mw.fetch_descriptor(t.segment))


def test_descriptor_matches_target(target):
    desc = mw.fetch_descriptor(target.segment)
    assert desc["name"] == target.segment
    assert desc["tcp_proto_version"] == 2
    assert isinstance(desc["tcp_data_port"], int) and 0 < desc["tcp_data_port"] < 65536
    got = sorted((b["addr"], b["length"]) for b in desc["buffers"])
    assert got == [(b["addr"], b["length"]) for b in target.buffers]
    assert all(b["name"].startswith("cpu") for b in desc["buffers"])
    assert desc["disagg"]["pid"] == target.pid
    assert desc["disagg"]["host_id"]
    # data_addrs is advertised only with a --device-name whitelist (see below)
    assert isinstance(desc["disagg"]["data_addrs"], list)
    # The client may send its own descriptor instead of {}.
    ftype, again = mw.handshake(target.segment, mw.FRAME_METADATA,
                                {"name": "10.9.9.9:1", "buffers": [], "protocol": "tcp"})
    assert ftype == mw.FRAME_METADATA and again["buffers"] == desc["buffers"]


def test_probe(target):
    ftype, body = mw.handshake(target.segment, mw.FRAME_PROBE, {})
    assert ftype == mw.FRAME_PROBE and body == {"status": "success"}  # Mooncake's answer


def test_write_read_over_data_port(target):
    rng = random.Random(7)
    with data_conn(target) as c:
        for _ in range(20):
            k = rng.randrange(2)
            b = target.buffers[k]
            length = rng.choice([1, 3, 8, 4095, 4096, 65536, rng.randrange(1, 300000)])
            off = rng.randrange(0, b["length"] - length + 1)
            data = rng.randbytes(length)
            assert c.write(b["addr"] + off, data) == mw.STATUS_OK
            assert target.mem(b["addr"] + off, length) == data
            code, got = c.read(b["addr"] + off, length)
            assert code == mw.STATUS_OK and got == data
            # an untouched neighbour region still holds the pattern
            restore = target.expected(k, off, length)
            assert c.write(b["addr"] + off, restore) == mw.STATUS_OK
        for k, b in enumerate(target.buffers):
            code, got = c.read(b["addr"], b["length"])
            assert code == mw.STATUS_OK and got == target.expected(k, 0, b["length"])
    target.assert_guards_intact()


def test_pipelined_requests_answered_in_order(target):
    b = target.buffers[0]
    chunks = [bytes([i]) * (1000 + i) for i in range(16)]
    offs = [i * 5000 for i in range(16)]
    with data_conn(target) as c:
        msg = b"".join(mw.encode_header(len(d), b["addr"] + o, mw.OP_WRITE) + d for d, o in zip(chunks, offs))
        msg += b"".join(mw.encode_header(len(d), b["addr"] + o, mw.OP_READ) for d, o in zip(chunks, offs))
        c.send(msg)
        for _ in chunks:
            assert c.status() == mw.STATUS_OK
        for d in chunks:
            assert c.status() == mw.STATUS_OK
            assert mw.recv_exact(c.sock, len(d)) == d
    for d, o in zip(chunks, offs):
        assert target.mem(b["addr"] + o, len(d)) == d


def test_out_of_range_rejected_stream_in_sync(target):
    b0, b1 = target.buffers
    end0 = b0["addr"] + b0["length"]
    before = {k: target.mem(b["addr"], b["length"]) for k, b in enumerate(target.buffers)}
    with data_conn(target) as c:
        # WRITE straddling the end: code 1, payload discarded, stream stays usable
        assert c.write(end0 - 8, b"\xee" * 16) == mw.STATUS_REJECTED
        # WRITE entirely before the first buffer (its guard page)
        assert c.write(b0["addr"] - 64, b"\xee" * 64) == mw.STATUS_REJECTED
        # READ outside: code 1 and no payload
        assert c.read(end0, 16) == (mw.STATUS_REJECTED, None)
        assert c.read(8, 16) == (mw.STATUS_REJECTED, None)
        # spanning both buffers (gap between them) is not inside ONE buffer
        assert c.read(b0["addr"], b1["addr"] + 16 - b0["addr"]) == (mw.STATUS_REJECTED, None)
        # size 0 is rejected
        assert c.read(b0["addr"], 0) == (mw.STATUS_REJECTED, None)
        # address arithmetic overflow: addr + size wraps around 2^64
        assert c.read((1 << 64) - 8, 16) == (mw.STATUS_REJECTED, None)
        # the same connection still works, in sync
        code, got = c.read(b0["addr"] + b0["length"] - 16, 16)
        assert code == mw.STATUS_OK and got == target.expected(0, b0["length"] - 16, 16)
        assert c.write(b0["addr"], b"ok") == mw.STATUS_OK
        assert c.write(b0["addr"], before[0][:2]) == mw.STATUS_OK
    for k, b in enumerate(target.buffers):
        assert target.mem(b["addr"], b["length"]) == before[k]
    target.assert_guards_intact()
    assert target.alive()
    rc, stats = target.stop()
    assert rc == 0
    assert stats["requests_rejected"] >= 7
    target.assert_sanitizer_clean()


def test_bad_opcode_answers_malformed_and_closes(target):
    b = target.buffers[0]
    with data_conn(target) as c:
        c.send(struct.pack("<QQB7x", 16, b["addr"], 0x05))  # no 0x80 flag
        assert c.status() == mw.STATUS_MALFORMED
        assert c.closed_by_peer()
    with data_conn(target) as c:
        c.send(struct.pack("<QQB7x", 16, b["addr"], 0x80 | 7))  # unknown op
        assert c.status() == mw.STATUS_MALFORMED
        assert c.closed_by_peer()
    with data_conn(target) as c:  # the target still serves
        code, got = c.read(b["addr"], 32)
        assert code == mw.STATUS_OK and got == target.expected(0, 0, 32)


def test_huge_write_rejected_and_closed(target):
    b = target.buffers[0]
    with data_conn(target) as c:
        c.send(mw.encode_header((1 << 30) + 1, b["addr"], mw.OP_WRITE))
        assert c.status() == mw.STATUS_REJECTED
        assert c.closed_by_peer()
    with data_conn(target) as c:
        assert c.read(b["addr"], 8)[0] == mw.STATUS_OK
    target.assert_guards_intact()


def whitelisted_target(start_target):
    names = [line.split(":")[0].strip() for line in open("/proc/net/dev").read().splitlines()[2:]]
    if "eth0" not in names:
        pytest.skip("no eth0 interface here")
    t = start_target(protocol="tcp", buffer_size=64 << 10, pattern=31, extra=["--device-name", "lo,eth0"])
    t.require_mem_access()
    return t, mw.fetch_descriptor(t.segment)


def assert_endpoints_serve(t, desc, addrs):
    b = t.buffers[0]
    for i, a in enumerate(addrs):
        host, port = mw.split_segment(a)
        assert port == desc["tcp_data_port"]
        with mw.DataConn(host, port) as c:
            assert c.write(b["addr"] + 100 * i, bytes([i + 1]) * 50) == mw.STATUS_OK
            assert c.read(b["addr"], 64)[0] == mw.STATUS_OK
        assert t.mem(b["addr"] + 100 * i, 50) == bytes([i + 1]) * 50


def test_data_addrs_per_whitelisted_interface(start_target):
    """--device-name lo,eth0: data endpoints on both interfaces; the IPv4 ones serve."""
    t, desc = whitelisted_target(start_target)
    addrs = desc["disagg"]["data_addrs"]
    v4 = [a for a in addrs if not a.startswith("[")]
    assert any(a.startswith("127.0.0.1:") for a in v4), addrs
    assert any(not a.startswith("127.") for a in v4), addrs
    assert len(addrs) == len(set(addrs))
    assert_endpoints_serve(t, desc, v4)


def test_advertised_ipv6_data_addrs_serve(start_target):
    t, desc = whitelisted_target(start_target)
    v6 = [a for a in desc["disagg"]["data_addrs"] if a.startswith("[")]
    if not v6:
        pytest.skip("no IPv6 address on lo/eth0")
    assert_endpoints_serve(t, desc, v6)


def test_concurrent_clients(target):
    """Eight raw clients at once, each writing and reading back its own region."""
    import threading
    b = target.buffers[1]
    errors = []

    def client(i):
        try:
            rng = random.Random(i)
            with data_conn(target) as c:
                for _ in range(20):
                    n = rng.randrange(1, 8192)
                    off = i * (b["length"] // 8) + rng.randrange(0, b["length"] // 8 - n)
                    data = rng.randbytes(n)
                    assert c.write(b["addr"] + off, data) == mw.STATUS_OK
                    code, got = c.read(b["addr"] + off, n)
                    assert code == mw.STATUS_OK and got == data
        except Exception as e:  # reported below
            errors.append(f"client {i}: {e!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not any(th.is_alive() for th in threads), "a client hung"
    assert not errors, errors
    target.assert_guards_intact()
