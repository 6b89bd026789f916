"""Failure paths between real processes: a request outside the target's
buffers is rejected (TRANSFER_EREMOTEADDR via `copy`), the target keeps
serving and no byte outside changes; a target killed (SIGKILL) or frozen
(SIGSTOP) while an initiator has a batch in flight fails the pending requests
within their deadline: the initiator exits non-zero with a clear error in
bounded time, never hangs."""
import json
import signal
import subprocess
import time

import pytest

from conftest import run_cli

pytestmark = pytest.mark.timeout(90)

REJECTED_MSG = "target rejected the remote address range"


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_copy_outside_buffers_rejected(disagg_bin, start_target, tmp_path, protocol):
    t = start_target(protocol=protocol, buffer_size=64 << 10, buffers=2, pattern=5)
    t.require_mem_access()
    b = t.buffers[0]
    end = b["addr"] + b["length"]
    before = t.mem(b["addr"], b["length"])
    payload = tmp_path / "p.bin"
    payload.write_bytes(b"\x11" * 32)
    cases = [
        ("write", end - 16, 32),           # straddles the end
        ("write", b["addr"] - 16, 32),     # straddles the start
        ("write", end + 64, 32),           # in the guard area after the buffer
        ("read", end, 1),                  # first byte past the end
        ("read", b["addr"] - 1, 1),        # last byte before the start
        ("read", 4096, 32),                # nowhere near
    ]
    for op, addr, length in cases:
        args = ["transfer", "copy", "--target", t.segment, "--op", op, "--remote-addr", hex(addr),
                "--length", length, "--protocol", protocol]
        if op == "write":
            args += ["--in", payload]
        proc = run_cli(disagg_bin, *args, timeout=30)
        err = proc.stderr.decode()
        assert proc.returncode == 1, f"{op} at {hex(addr)}: rc {proc.returncode}\n{err}"
        assert REJECTED_MSG in err, err
        assert hex(addr) in err or str(addr) in err, err
        assert proc.stdout == b""
        assert t.alive()
    assert t.mem(b["addr"], b["length"]) == before
    t.assert_guards_intact()
    # still serving: a valid read works
    proc = run_cli(disagg_bin, "transfer", "copy", "--target", t.segment, "--op", "read",
                   "--remote-addr", b["addr"], "--length", b["length"], "--protocol", protocol)
    assert proc.returncode == 0 and proc.stdout == before
    rc, _ = t.stop()
    assert rc == 0
    t.assert_sanitizer_clean()


def start_check(disagg_bin, reaper, t, protocol, timeout_ms, tmp_path):
    """A long-running check with big requests; returns (proc, stderr path) once
    it opened the segment.  stderr goes to a file so it can never fill a pipe."""
    err_path = tmp_path / "check.stderr"
    with open(err_path, "wb") as err:
        proc = reaper.popen([disagg_bin, "transfer", "check", "--target", t.segment, "--protocol",
                             protocol, "--iterations", "1000000", "--max-length", "4M", "--batch", "16",
                             "--pattern", str(t.pattern), "--timeout-ms", str(timeout_ms), "--progress"],
                            stdout=subprocess.PIPE, stderr=err)
    deadline = time.monotonic() + 20
    while b"round 2 ok" not in err_path.read_bytes():  # requests are flowing
        assert proc.poll() is None, f"check exited early: {err_path.read_text()}"
        assert time.monotonic() < deadline, "check completed no traffic round within 20 s"
        time.sleep(0.02)
    return proc, err_path


def wait_bounded(proc, limit):
    t0 = time.monotonic()
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"initiator still running {limit} s after the target went away: it hangs")
    return time.monotonic() - t0


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_target_killed_mid_batch(disagg_bin, start_target, reaper, tmp_path, protocol):
    t = start_target(protocol=protocol, buffer_size=64 << 20, pattern=9)
    check, err_path = start_check(disagg_bin, reaper, t, protocol, 3000, tmp_path)
    time.sleep(0.1)  # batches of up to 16 x 4 MiB are continuously in flight
    assert check.poll() is None, "check ended before the target was killed"
    t.proc.send_signal(signal.SIGKILL)
    t.proc.wait(timeout=10)
    # deadline 3 s + 1 ns/byte (64 MiB: 0.07 s) + our 5 s wait slack: 12 s is the bound
    elapsed = wait_bounded(check, 15)
    out, err = check.stdout.read().decode(), err_path.read_text(errors="replace")
    assert check.returncode == 1, f"rc {check.returncode}\n{err}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] is False
    assert summary["requests"] > 0, "nothing completed before the kill"
    # a named engine error, not a verification mismatch
    assert any(m in summary["error"] for m in
               ("peer unreachable or connection lost", "deadline exceeded", "cancelled",
                "segment cannot be opened", "system error")), summary["error"]
    assert "FAILED" in err
    assert elapsed < 15
    print(f"{protocol}: initiator exited {elapsed:.2f} s after the kill: {summary['error']}")


def test_target_frozen_mid_batch_times_out(disagg_bin, start_target, reaper, tmp_path):
    """SIGSTOP: the connection stays open but nothing answers; the request
    deadline (--timeout-ms 1000 + 1 ns/byte) must fire."""
    t = start_target(protocol="tcp", buffer_size=64 << 20, pattern=9)
    check, err_path = start_check(disagg_bin, reaper, t, "tcp", 1000, tmp_path)
    time.sleep(0.1)
    assert check.poll() is None
    t.proc.send_signal(signal.SIGSTOP)
    try:
        elapsed = wait_bounded(check, 12)
    finally:
        t.proc.send_signal(signal.SIGCONT)
    out, err = check.stdout.read().decode(), err_path.read_text(errors="replace")
    assert check.returncode == 1, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] is False
    assert "deadline exceeded" in summary["error"], summary["error"]
    assert elapsed < 12
    print(f"frozen target: initiator exited {elapsed:.2f} s after SIGSTOP: {summary['error']}")
    # the target, thawed, still serves a fresh initiator
    proc = run_cli(disagg_bin, "transfer", "copy", "--target", t.segment, "--op", "read", "--protocol",
                   "tcp", "--remote-addr", t.buffers[0]["addr"], "--length", 4096, "--timeout-ms", 5000)
    assert proc.returncode == 0, proc.stderr.decode()


def test_copy_to_dead_target_fails_fast(disagg_bin, start_target):
    t = start_target(protocol="tcp", buffer_size=4096)
    seg, addr = t.segment, t.buffers[0]["addr"]
    t.proc.kill()
    t.proc.wait(timeout=10)
    t0 = time.monotonic()
    proc = run_cli(disagg_bin, "transfer", "copy", "--target", seg, "--op", "read",
                   "--remote-addr", addr, "--length", 16, "--timeout-ms", 2000, timeout=20)
    assert proc.returncode == 1
    assert f"cannot open segment {seg}" in proc.stderr.decode()
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_initiator_killed_mid_batch_target_survives(disagg_bin, start_target, reaper, tmp_path, protocol):
    """The other direction: the initiator dies with requests on the wire; the
    target keeps serving, and its memory outside the buffers is untouched."""
    import mooncake_wire as mw
    t = start_target(protocol=protocol, buffer_size=32 << 20, pattern=9)
    t.require_mem_access()
    b = t.buffers[0]
    for _ in range(2):
        check, _ = start_check(disagg_bin, reaper, t, protocol, 5000, tmp_path)
        time.sleep(0.1)
        check.kill()
        check.wait(timeout=10)
        time.sleep(0.1)
        assert t.alive(), t.stderr()[-4000:]
        t.assert_guards_intact()
        # the killed check left its WRITEs: put the pattern back over the raw wire
        with mw.DataConn.from_descriptor(t.segment, mw.fetch_descriptor(t.segment), timeout=20) as c:
            step = 8 << 20
            for off in range(0, b["length"], step):
                assert c.write(b["addr"] + off, t.expected(0, off, step)) == mw.STATUS_OK
    assert t.mem(b["addr"], b["length"]) == t.expected(0, 0, b["length"])
    proc = run_cli(disagg_bin, "transfer", "check", "--target", t.segment, "--protocol", protocol,
                   "--iterations", 5, "--pattern", 9, "--timeout-ms", 10000)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    rc, _ = t.stop()
    assert rc == 0
    t.assert_sanitizer_clean()
