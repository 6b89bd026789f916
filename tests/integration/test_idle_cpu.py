"""Idle processes sleep: a prefill (kv_producer), a
decode (kv_consumer), a kv_both instance, a colocated `disagg serve` (no
connector), a `disagg bootstrap` and a `disagg proxy`, started and left without traffic for 5 s, each use under
0.1 s of CPU time (utime + stime of every thread, read from /proc/PID/stat);
so do they after serving requests.  A failure names the threads that ran and
where they were waiting (/proc/PID/task/TID/{comm,wchan})."""
import json
import os
import subprocess
import time

import pytest
import requests

from server_harness import BIN, Server, free_port
from test_bootstrap import _env as bootstrap_env
from test_pd import COMMON, consumer_config, producer_config

IDLE_S = 5.0
LIMIT_S = 0.1
TICK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid):
    """utime + stime of the whole process, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def thread_ticks(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended
            continue
        out[tid] = (comm, int(fields[11]) + int(fields[12]))
    return out


def measure_idle(procs, seconds=IDLE_S):
    """{name: (cpu seconds used over `seconds`, description of the threads that ran)}."""
    t0 = {n: (cpu_ticks(p.pid), thread_ticks(p.pid)) for n, p in procs.items()}
    time.sleep(seconds)
    out = {}
    for n, p in procs.items():
        assert p.poll() is None, f"{n} exited with {p.returncode}"
        used = (cpu_ticks(p.pid) - t0[n][0]) / TICK
        busy = []
        for tid, (comm, ticks) in thread_ticks(p.pid).items():
            before = t0[n][1].get(tid, (comm, 0))[1]
            if ticks > before:
                busy.append(f"thread {tid} ({comm}) {(ticks - before) / TICK:.2f} s")
        out[n] = (used, ", ".join(busy) or "none")
    return out


class Proc:
    """A `disagg bootstrap` or `disagg proxy` child process."""

    def __init__(self, args, ready_url, env=None):
        self.log_path = f"/tmp/disagg-idle-{os.getpid()}-{free_port()}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env or dict(os.environ))
        deadline = time.time() + 30
        while time.time() < deadline:
            assert self.proc.poll() is None, f"{args[1]} exited: {open(self.log_path).read()}"
            try:
                requests.get(ready_url, timeout=1)
                return
            except requests.RequestException:
                time.sleep(0.05)
        raise RuntimeError(f"{args[1]} did not start: {open(self.log_path).read()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def logs(self):
        return open(self.log_path).read()[-4000:]


@pytest.fixture(scope="module")
def fleet():
    started = []
    try:
        boot_port = free_port()
        p = Server(*COMMON, "--kv-transfer-config", producer_config(),
                   env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot_port)})
        started.append(p)
        d = Server(*COMMON, "--kv-transfer-config", consumer_config())
        started.append(d)
        both_cfg = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})
        both = Server(*COMMON, "--kv-transfer-config", both_cfg,
                      env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())})
        started.append(both)
        colocated = Server(*COMMON)
        started.append(colocated)
        bport = free_port()
        boot = Proc([BIN, "bootstrap", "--host", "127.0.0.1", "--port", str(bport)],
                    f"http://127.0.0.1:{bport}/query", env=bootstrap_env())
        started.append(boot)
        xport = free_port()
        proxy = Proc([BIN, "proxy", "--port", str(xport), "--prefill", p.url, str(boot_port),
                      "--decode", d.url], f"http://127.0.0.1:{xport}/health")
        started.append(proxy)
        proxy.url = f"http://127.0.0.1:{xport}"
        deadline = time.time() + 30  # the proxy probes its upstreams before it routes
        while requests.get(proxy.url + "/health", timeout=5).status_code != 200:
            assert time.time() < deadline, "the proxy did not see its upstreams healthy"
            time.sleep(0.1)
        yield {"prefill": p, "decode": d, "kv_both": both, "colocated": colocated,
               "bootstrap": boot, "proxy": proxy}
    finally:
        bad = []
        for s in reversed(started):
            rc = s.stop()
            if rc != 0:
                bad.append(f"exit {rc}: {s.logs()}")
        assert not bad, "; ".join(bad)


def assert_idle(fleet):
    procs = {n: x.proc for n, x in fleet.items()}
    used = measure_idle(procs)
    report = "; ".join(f"{n}: {u:.2f} s CPU in {IDLE_S:.0f} s idle (busy: {b})"
                       for n, (u, b) in used.items())
    over = [n for n, (u, _) in used.items() if u >= LIMIT_S]
    assert not over, f"{', '.join(over)} used CPU while idle: {report}"


def test_idle_after_start_sleeps(fleet):
    time.sleep(1.0)  # let start-up work (loading, first health probes) finish
    assert_idle(fleet)


def test_idle_after_traffic_sleeps(fleet):
    body = {"prompt": "Fellow-Citizens of the Senate and House of Representatives:",
            "max_tokens": 8, "temperature": 0}
    for stream in (False, True):
        r = requests.post(fleet["proxy"].url + "/v1/completions", json=dict(body, stream=stream),
                          timeout=120)
        assert r.status_code == 200, r.text
    r = requests.post(fleet["kv_both"].url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    time.sleep(1.0)  # a bounded spin after a job (the CPU pool's) is allowed
    assert_idle(fleet)
