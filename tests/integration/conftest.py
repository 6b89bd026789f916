"""Shared fixtures of the integration tests: the disagg binary, processes that
are always killed at teardown, the `disagg transfer target` helper process,
the buffer pattern (numpy, independent of the C code), and reading another
process's memory through /proc/<pid>/mem.

The pattern must agree with bench/transfer_harness.c (bench/transfer_pattern.c):
  buffers ranked k = 0, 1, ... by ascending address; buffer k read as
  little-endian u64 words holds splitmix64(seed + (k << 40) + w).
"""
import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MASK64 = (1 << 64) - 1
SANITIZER_MARKERS = ("AddressSanitizer", "LeakSanitizer", "UndefinedBehaviorSanitizer", "runtime error:")


# ---- the binary ------------------------------------------------------------

def binary_path():
    env = os.environ.get("DISAGG_BIN")
    return Path(env) if env else REPO_ROOT / "build" / "disagg"


@pytest.fixture(scope="session")
def disagg_bin():
    path = binary_path()
    if not path.is_file() or not os.access(path, os.X_OK):
        pytest.fail(f"disagg binary not found at {path}: build it (ninja -C build) or set DISAGG_BIN")
    return str(path)


@pytest.fixture(scope="session")
def sanitized(disagg_bin):
    """True when the binary is an ASan build (env DISAGG_SANITIZED=1 or the symbol is in it)."""
    env = os.environ.get("DISAGG_SANITIZED", "").strip().lower()
    if env in ("1", "on", "true", "yes"):
        return True
    with open(disagg_bin, "rb") as f:
        return b"__asan_init" in f.read()


def child_env():
    env = dict(os.environ)
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1")
    return env


# ---- processes -------------------------------------------------------------

class ProcessReaper:
    """Every process a test starts; all are killed (SIGKILL) at teardown."""

    def __init__(self):
        self.procs = []

    def popen(self, args, **kw):
        kw.setdefault("env", child_env())
        p = subprocess.Popen(args, **kw)
        self.procs.append(p)
        return p

    def reap(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for f in (p.stdin, p.stdout, p.stderr):
                if f:
                    f.close()


@pytest.fixture
def reaper():
    r = ProcessReaper()
    yield r
    r.reap()


def run_cli(disagg_bin, *args, input=None, timeout=30):
    """Runs `disagg ARGS` to completion (bounded), returns CompletedProcess with bytes."""
    return subprocess.run([disagg_bin, *map(str, args)], input=input, capture_output=True,
                          timeout=timeout, env=child_env())


def read_line(fd, timeout):
    """One line from a pipe fd within timeout seconds (bytes, without newline) or None."""
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return buf or None
        buf += chunk
    return buf.split(b"\n", 1)[0]


# ---- memory ----------------------------------------------------------------

def read_proc_mem(pid, addr, length):
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(addr)
        out = b""
        while len(out) < length:
            chunk = f.read(length - len(out))
            if not chunk:
                raise OSError(f"short read of /proc/{pid}/mem at 0x{addr:x}")
            out += chunk
        return out


def splitmix64(x):
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def pattern_bytes(seed, k, offset, length):
    """Bytes [offset, offset+length) of buffer k's pattern."""
    w0, w1 = offset // 8, (offset + length + 7) // 8
    with np.errstate(over="ignore"):
        words = np.arange(w0, w1, dtype=np.uint64) + np.uint64((seed + (k << 40)) & MASK64)
    raw = splitmix64(words).astype("<u8").tobytes()
    start = offset - w0 * 8
    return raw[start:start + length]


# ---- the target helper -----------------------------------------------------

class Target:
    """A running `disagg transfer target` process and what it advertised."""

    def __init__(self, proc, info, stderr_path):
        self.proc = proc
        self.info = info  # the JSON line
        self.stderr_path = stderr_path
        self.segment = info["segment"]
        self.pid = info["pid"]
        self.pattern = info["pattern"]
        self.guard = info["guard_bytes"]
        self.guard_value = info["guard_value"]
        self.buffers = sorted(info["buffers"], key=lambda b: b["addr"])

    def alive(self):
        return self.proc.poll() is None

    def stderr(self):
        return Path(self.stderr_path).read_text(errors="replace")

    def mem(self, addr, length):
        return read_proc_mem(self.pid, addr, length)

    def expected(self, k, offset, length):
        return pattern_bytes(self.pattern, k, offset, length)

    def require_mem_access(self):
        """Skips the test when /proc/<pid>/mem of the target cannot be read."""
        try:
            self.mem(self.buffers[0]["addr"], 1)
        except OSError as e:
            pytest.skip(f"cannot read /proc/{self.pid}/mem ({e}); needs root or ptrace permission")

    def assert_guards_intact(self):
        for b in self.buffers:
            before = self.mem(b["addr"] - self.guard, self.guard)
            after = self.mem(b["addr"] + b["length"], self.guard)
            want = bytes([self.guard_value]) * self.guard
            assert before == want, f"guard bytes before buffer 0x{b['addr']:x} changed"
            assert after == want, f"guard bytes after buffer 0x{b['addr']:x} changed"

    def assert_sanitizer_clean(self):
        err = self.stderr()
        for marker in SANITIZER_MARKERS:
            assert marker not in err, f"target stderr reports {marker}:\n{err[-4000:]}"

    def stop(self, timeout=15):
        """Closes stdin (target exits), returns (exit code, stats dict or None)."""
        self.proc.stdin.close()
        rc = self.proc.wait(timeout=timeout)
        rest = self.proc.stdout.read().decode(errors="replace").strip().splitlines()
        stats = json.loads(rest[-1]) if rest else None
        return rc, stats


@pytest.fixture
def start_target(disagg_bin, reaper, tmp_path):
    """start_target(protocol='auto', buffer_size=..., buffers=1, pattern=7, extra=[]) -> Target."""
    count = [0]

    def start(protocol="auto", buffer_size=1 << 20, buffers=1, pattern=7, host=None, extra=()):
        count[0] += 1
        err_path = tmp_path / f"target{count[0]}.stderr"
        args = [disagg_bin, "transfer", "target", "--protocol", protocol, "--buffer-size",
                str(buffer_size), "--buffers", str(buffers), "--pattern", str(pattern),
                "--exit-on-stdin-eof", *(["--host", host] if host else []), *map(str, extra)]
        with open(err_path, "wb") as err:
            proc = reaper.popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        line = read_line(proc.stdout.fileno(), timeout=20)
        if line is None:
            proc.kill()
            proc.wait(timeout=10)
            pytest.fail(f"target printed no JSON line; rc={proc.returncode} stderr:\n"
                        f"{err_path.read_text(errors='replace')[-4000:]}")
        info = json.loads(line)
        assert info["pid"] == proc.pid
        return Target(proc, info, err_path)

    return start
