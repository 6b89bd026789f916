"""`disagg demo`: P + D + proxy on free localhost ports, one chat
request through the proxy, the KV transfer reported, everything stopped."""
import os
import re
import signal
import subprocess
import time

from server_harness import BIN


def test_demo_streams_an_answer_and_reports_the_transfer():
    r = subprocess.run([BIN, "demo", "--max-tokens", "16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert re.search(r"prefill\s+pid \d+\s+http://127\.0\.0\.1:\d+", out)
    assert "assistant>" in out
    m = re.search(r"KV transfer: (\d+) bytes in (\d+) descriptor\(s\) over (\w+)", out)
    assert m and int(m.group(1)) > 0 and m.group(3) == "tcp", out
    assert "prefill, decode and proxy stopped" in out
    # nothing left running
    pids = [int(p) for p in re.findall(r"pid (\d+)", out)]
    time.sleep(0.2)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_demo_interrupted_stops_everything():
    p = subprocess.Popen([BIN, "demo", "--max-tokens", "2000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    out = ""
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until the answer starts
        line = p.stdout.readline()
        out += line
        if line.startswith("user>") or not line:
            break
    pids = [int(x) for x in re.findall(r"pid (\d+)", out)]
    assert len(pids) == 3, out
    p.send_signal(signal.SIGINT)
    rest, _ = p.communicate(timeout=60)
    assert p.returncode != 0
    time.sleep(0.2)
    for pid in pids:
        alive = os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
        assert not alive, f"pid {pid} still running after Ctrl-C: {out + rest}"


def test_demo_bad_option():
    r = subprocess.run([BIN, "demo", "--max-tokens", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--max-tokens" in r.stderr
