"""Two real processes: `disagg transfer target` + `check` / `copy` / `demo`
over tcp, shm and auto; random sizes and offsets, READ and WRITE, every byte
verified by the initiator and, independently, by reading the target's memory
through /proc/<pid>/mem and recomputing the pattern with numpy."""
import json
import random

import pytest

from conftest import pattern_bytes, run_cli

pytestmark = pytest.mark.timeout(120)

PROTOCOLS = ["tcp", "shm", "auto", "rdma"]


def parse_summary(proc):
    lines = proc.stdout.decode().strip().splitlines()
    assert lines, f"check printed nothing; stderr:\n{proc.stderr.decode()[-3000:]}"
    return json.loads(lines[-1])


def test_pattern_matches_target_memory(start_target):
    """The numpy pattern (conftest) equals what the C target put in its buffers."""
    t = start_target(buffer_size=3 * 4096 + 5, buffers=3, pattern=123456789)
    t.require_mem_access()
    assert len(t.buffers) == 3
    for k, b in enumerate(t.buffers):
        assert b["length"] == 3 * 4096 + 5
        assert t.mem(b["addr"], b["length"]) == t.expected(k, 0, b["length"])
        assert t.mem(b["addr"] + 13, 100) == pattern_bytes(123456789, k, 13, 100)
    t.assert_guards_intact()
    rc, stats = t.stop()
    assert rc == 0 and stats["event"] == "stats"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_check_random_read_write(disagg_bin, start_target, protocol):
    t = start_target(protocol=protocol, buffer_size=4 << 20, buffers=2, pattern=99)
    t.require_mem_access()
    proc = run_cli(disagg_bin, "transfer", "check", "--target", t.segment, "--protocol", protocol,
                   "--iterations", 30, "--seed", 5, "--max-length", "256K", "--batch", 8,
                   "--pattern", 99, "--timeout-ms", 10000, timeout=60)
    s = parse_summary(proc)
    assert proc.returncode == 0, f"check failed: {s.get('error')}\n{proc.stderr.decode()[-3000:]}"
    assert s["ok"] is True
    # rdma: no machine here has a NIC, so both engines fall back to tcp, saying so
    expect_proto = {"tcp": "tcp", "shm": "shm", "auto": "shm", "rdma": "tcp"}[protocol]
    if protocol == "rdma":
        assert b"no RDMA device found" in proc.stderr or b"libibverbs" in proc.stderr, proc.stderr
    assert s["protocol"] == expect_proto
    assert s["buffers"] == 2
    assert s["reads"] > 30 and s["writes"] > 30
    assert s["bytes_written"] > 0 and s["bytes_read"] > 0
    assert s["min_length"] <= 64 and s["max_length"] > 64 << 10
    assert s["rejected_expected"] == 3 and s["rejected_ok"] == 3
    # Every checked byte + every random READ and READ-back was compared.
    assert s["verified_bytes"] >= s["span_bytes"]

    # Independent: check restored the pattern; the target's memory equals the
    # numpy pattern, and no guard byte changed (the out-of-range WRITE).
    for k, b in enumerate(t.buffers):
        assert t.mem(b["addr"], b["length"]) == t.expected(k, 0, b["length"]), f"buffer {k}"
    t.assert_guards_intact()
    assert t.alive()
    rc, stats = t.stop()
    assert rc == 0
    assert stats["requests_rejected"] >= (3 if expect_proto == "tcp" else 0)
    if expect_proto == "tcp":
        assert stats["bytes_served"] >= s["bytes_read"] + s["bytes_written"]
    t.assert_sanitizer_clean()


def test_check_no_restore_leaves_writes(disagg_bin, start_target):
    """--no-restore leaves check's WRITEs in place: the target memory differs
    from the pattern, and a second check (expecting the pattern) fails."""
    t = start_target(protocol="tcp", buffer_size=1 << 20, pattern=3)
    t.require_mem_access()
    proc = run_cli(disagg_bin, "transfer", "check", "--target", t.segment, "--protocol", "tcp",
                   "--iterations", 5, "--pattern", 3, "--no-restore", "--max-length", "64K")
    assert proc.returncode == 0, proc.stderr.decode()
    b = t.buffers[0]
    assert t.mem(b["addr"], b["length"]) != t.expected(0, 0, b["length"])
    proc = run_cli(disagg_bin, "transfer", "check", "--target", t.segment, "--protocol", "tcp",
                   "--iterations", 2, "--pattern", 3)
    s = parse_summary(proc)
    assert proc.returncode == 1 and s["ok"] is False
    assert "expected 0x" in s["error"]


def test_check_wrong_pattern_fails(disagg_bin, start_target):
    """A check that expects another pattern seed must fail: the check can fail."""
    t = start_target(protocol="tcp", buffer_size=256 << 10, pattern=11)
    proc = run_cli(disagg_bin, "transfer", "check", "--target", t.segment, "--iterations", 3,
                   "--pattern", 12)
    s = parse_summary(proc)
    assert proc.returncode == 1 and s["ok"] is False
    assert "READ" in s["error"] and "expected" in s["error"]
    assert "FAILED" in proc.stderr.decode()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_copy_write_then_read_verified_in_target_memory(disagg_bin, start_target, tmp_path, protocol):
    t = start_target(protocol=protocol, buffer_size=2 << 20, buffers=2, pattern=42)
    t.require_mem_access()
    rng = random.Random(hash(protocol) & 0xFFFF)
    for _ in range(4):
        k = rng.randrange(2)
        b = t.buffers[k]
        length = rng.choice([1, 7, 4096, 65537, rng.randrange(1, b["length"])])
        off = rng.randrange(0, b["length"] - length + 1)
        data = rng.randbytes(length)
        src = tmp_path / "in.bin"
        src.write_bytes(data)
        w = run_cli(disagg_bin, "transfer", "copy", "--target", t.segment, "--op", "write",
                    "--remote-addr", hex(b["addr"] + off), "--length", length, "--in", src,
                    "--protocol", protocol)
        assert w.returncode == 0, w.stderr.decode()
        # Independent view of the target's memory: the bytes landed, nothing around changed.
        assert t.mem(b["addr"] + off, length) == data
        if off > 0:
            assert t.mem(b["addr"], off) == t.expected(k, 0, off)
        # READ back through the engine (stdout), a region around the write.
        lo, hi = max(0, off - 100), min(b["length"], off + length + 100)
        r = run_cli(disagg_bin, "transfer", "copy", "--target", t.segment, "--op", "read",
                    "--remote-addr", b["addr"] + lo, "--length", hi - lo, "--protocol", protocol)
        assert r.returncode == 0, r.stderr.decode()
        want = t.expected(k, lo, off - lo) + data + t.expected(k, off + length, hi - off - length)
        assert r.stdout == want
        # restore so the next round's expectation holds
        restore = tmp_path / "restore.bin"
        restore.write_bytes(t.expected(k, off, length))
        w = run_cli(disagg_bin, "transfer", "copy", "--target", t.segment, "--op", "write",
                    "--remote-addr", b["addr"] + off, "--length", length, "--in", restore,
                    "--protocol", protocol)
        assert w.returncode == 0, w.stderr.decode()
    t.assert_guards_intact()
    out = tmp_path / "out.bin"
    b = t.buffers[1]
    r = run_cli(disagg_bin, "transfer", "copy", "--target", t.segment, "--op", "read",
                "--remote-addr", b["addr"], "--length", b["length"], "--out", out, "--protocol", protocol)
    assert r.returncode == 0, r.stderr.decode()
    assert out.read_bytes() == t.expected(1, 0, b["length"])
    rc, _ = t.stop()
    assert rc == 0
    t.assert_sanitizer_clean()


def test_copy_write_from_stdin(disagg_bin, start_target):
    t = start_target(protocol="tcp", buffer_size=64 << 10)
    t.require_mem_access()
    b = t.buffers[0]
    w = run_cli(disagg_bin, "transfer", "copy", "--target", t.segment, "--op", "write",
                "--remote-addr", b["addr"] + 10, "--length", 5, input=b"hello")
    assert w.returncode == 0, w.stderr.decode()
    assert t.mem(b["addr"] + 10, 5) == b"hello"
    # short input is an error, and nothing is sent
    w = run_cli(disagg_bin, "transfer", "copy", "--target", t.segment, "--op", "write",
                "--remote-addr", b["addr"] + 20, "--length", 10, input=b"abc")
    assert w.returncode == 1
    assert "3 bytes" in w.stderr.decode() and "10" in w.stderr.decode()
    assert t.mem(b["addr"] + 20, 10) == t.expected(0, 20, 10)


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_demo(disagg_bin, protocol):
    proc = run_cli(disagg_bin, "transfer", "demo", "--protocol", protocol, "--iterations", 8,
                   "--buffer-size", "16M", timeout=60)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()[-3000:]
    assert f"protocol {protocol}" in out
    assert "OK: every byte verified" in out
    assert "3/3 out-of-range requests rejected" in out
    assert "GB/s" in out


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_check_many_small_requests(disagg_bin, start_target, protocol):
    """Batches of 512 requests of 1..64 bytes: pipelining and completion
    bookkeeping under many tiny requests, every byte verified."""
    t = start_target(protocol=protocol, buffer_size=256 << 10, buffers=3, pattern=1234)
    proc = run_cli(disagg_bin, "transfer", "check", "--target", t.segment, "--protocol", protocol,
                   "--iterations", 10, "--batch", 512, "--max-length", 64, "--pattern", 1234,
                   "--seed", 77, timeout=60)
    s = parse_summary(proc)
    assert proc.returncode == 0, s.get("error")
    assert s["buffers"] == 3 and s["max_length"] <= 64
    assert s["requests"] > 10 * 512
    rc, _ = t.stop()
    assert rc == 0
