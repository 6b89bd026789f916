"""Fixtures for the `disagg proxy` tests: a running proxy process in front of
upstream instances.  The upstreams here are UpstreamDouble objects
(upstream_double.py); anything with .url (and for a prefill .bootstrap_port)
can stand in, so tests that only look at what the client sees can run
against real `disagg serve` instances later."""
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from server_harness import free_port  # noqa: F401 (re-exported to the tests)
from upstream_double import UpstreamDouble

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("DISAGG_BIN", str(ROOT / "build" / "disagg"))
UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


class ProxyProc:
    """`disagg proxy` as a child process."""

    def __init__(self, prefills, decodes, extra=(), bootstrap_arg="port", nofile=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [BIN, "proxy", "--port", str(self.port), "--health-interval", "0.1",
                "--shutdown-timeout", "2"]
        for p in prefills:
            args += ["--prefill", p.url]
            if bootstrap_arg == "port":
                args.append(str(p.bootstrap_port))
            elif bootstrap_arg == "addr":
                args.append(f"127.0.0.1:{p.bootstrap_port}")
            elif bootstrap_arg == "url":
                args.append(f"http://127.0.0.1:{p.bootstrap_port}")
        for d in decodes:
            args += ["--decode", d.url]
        args += list(extra)
        self.args = args
        self.log = open(f"/tmp/disagg-proxy-test-{self.port}.log", "w+")
        def limit():
            if nofile:
                import resource
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=limit)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"proxy did not start: {self.output()}")
                time.sleep(0.02)

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def wait_ready(self, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = requests.get(self.url + "/health", timeout=2)
            if r.status_code == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"proxy not ready: {r.text}\n{self.output()}")

    def metrics(self):
        """{'name{labels}': value} of the Prometheus text."""
        r = requests.get(self.url + "/metrics", timeout=5)
        assert r.status_code == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        out = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def wait_metric(self, key, value, timeout=5):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.metrics().get(key) == value:
                return
            time.sleep(0.05)
        raise AssertionError(f"{key} != {value}: {self.metrics().get(key)}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("proxy did not stop on SIGTERM")
        rc = self.proc.returncode
        self.log.close()
        return rc


@pytest.fixture
def doubles():
    made = []

    def make(role, name, **kw):
        d = UpstreamDouble(role, name, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.release()
        d.stop()


@pytest.fixture
def proxy_factory():
    made = []

    def make(prefills, decodes, extra=(), ready=True, **kw):
        p = ProxyProc(prefills, decodes, extra, **kw)
        made.append(p)
        if ready:
            p.wait_ready()
        return p

    yield make
    for p in made:
        rc = p.stop()
        assert rc == 0, f"proxy exit status {rc}\n{p.output()}"


def assert_openai_error(r, status, *needles):
    assert r.status_code == status, r.text
    body = r.json()
    err = body["error"]
    assert set(err) >= {"message", "type", "code"}
    assert err["code"] == status
    for n in needles:
        assert n in err["message"], err["message"]
    return err


def raw_request(port, data, timeout=5):
    """Sends raw bytes, returns the raw answer (until the server closes or timeout)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(data)
    chunks = []
    try:
        while True:
            c = s.recv(65536)
            if not c:
                break
            chunks.append(c)
    except socket.timeout:
        pass
    s.close()
    return b"".join(chunks)


def split_response(raw):
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for l in lines[1:]:
        k, v = l.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    return status, headers, body


def sent(rec, timeout=5):
    """The exact body bytes a double sent for a recorded request (once it is done)."""
    assert rec["done"].wait(timeout), "upstream request still running"
    return rec["response_body"]


def json_body(rec):
    return json.loads(rec["body"])
