"""Real etcd processes for the discovery tests: a single member or a
cluster of members on 127.0.0.1 with free client and peer ports, data in a
temporary directory, killed at teardown.  Reads go through etcd's v3 JSON
gateway with requests (the same API disagg's base/etcd.c uses, written
independently here)."""
import base64
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import requests

from server_harness import free_port

ETCD = shutil.which("etcd")


def need_etcd():
    if not ETCD:
        pytest.skip("etcd is not installed (scripts/setup.sh installs Debian's etcd-server)")


def b64(s):
    return base64.b64encode(s.encode()).decode()


def prefix_end(p):
    return p[:-1] + chr(ord(p[-1]) + 1)


class Etcd:
    """n members of one cluster; .endpoints is "127.0.0.1:C1,127.0.0.1:C2,..."."""

    def __init__(self, root, n=1, tls=None, hosts=None):
        """tls: {"ca", "cert", "key", "client_cert", "client_key"} PEM paths: https with
        client certificates required (make_certs writes them).  hosts: netns.Host
        objects, member i runs in hosts[i]'s namespace on its LAN address (ports
        2379/2380 there: a namespace has no other listener)."""
        self.tls = tls
        self.hosts = hosts
        self.scheme = "https" if tls else "http"
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        token = "t-" + uuid.uuid4().hex[:8]
        if hosts:
            self.members = [{"name": f"m{i}", "ip": hosts[i].lan_ip, "client": 2379, "peer": 2380,
                             "dir": self.root / f"m{i}", "proc": None} for i in range(n)]
        else:
            self.members = [{"name": f"m{i}", "ip": "127.0.0.1", "client": free_port(),
                             "peer": free_port(), "dir": self.root / f"m{i}", "proc": None}
                            for i in range(n)]
        self.cluster = ",".join(f"{m['name']}=http://{m['ip']}:{m['peer']}" for m in self.members)
        self.token = token
        for i in range(n):
            self.start(i, wait=False)
        for i in range(n):
            self.wait_healthy(i)

    @property
    def endpoints(self):
        return ",".join(f"{m['ip']}:{m['client']}" for m in self.members)

    def url(self, prefix):
        return f"{'etcds' if self.tls else 'etcd'}://{self.endpoints}{prefix}"

    def _req(self):
        if not self.tls:
            return {}
        return {"verify": str(self.tls["ca"]), "cert": (str(self.tls["client_cert"]),
                                                        str(self.tls["client_key"]))}

    def start(self, i, wait=True):
        m = self.members[i]
        c, p = f"{self.scheme}://{m['ip']}:{m['client']}", f"http://{m['ip']}:{m['peer']}"
        tls = []
        if self.tls:
            tls = ["--cert-file", str(self.tls["cert"]), "--key-file", str(self.tls["key"]),
                   "--trusted-ca-file", str(self.tls["ca"]), "--client-cert-auth"]
        log = open(self.root / f"{m['name']}.log", "a")
        args = [ETCD, "--name", m["name"], "--data-dir", str(m["dir"]),
             "--listen-client-urls", c, "--advertise-client-urls", c,
             "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
             "--initial-cluster", self.cluster, "--initial-cluster-token", self.token,
             "--initial-cluster-state", "new",
             "--heartbeat-interval", "50", "--election-timeout", "500",
             "--logger", "zap", "--log-level", "warn"] + tls
        if self.hosts:
            m["proc"] = self.hosts[i].popen(args, stdout=log, stderr=subprocess.STDOUT)
        else:
            m["proc"] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_healthy(i)

    def wait_healthy(self, i, timeout=30):
        m = self.members[i]
        deadline = time.time() + timeout
        while time.time() < deadline:
            if m["proc"].poll() is not None:
                raise RuntimeError(f"etcd {m['name']} exited: " +
                                   (self.root / f"{m['name']}.log").read_text()[-2000:])
            try:
                r = requests.get(f"{self.scheme}://{m['ip']}:{m['client']}/health", timeout=1,
                                 **self._req())
                if r.status_code == 200 and r.json().get("health") == "true":
                    return
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd {m['name']} did not become healthy")

    def kill(self, i):
        p = self.members[i]["proc"]
        if p and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)

    def stop_all(self):
        for i in range(len(self.members)):
            self.kill(i)

    def _post(self, path, body, headers=None):
        last = None
        for m in self.members:
            if m["proc"] is None or m["proc"].poll() is not None:
                continue
            try:
                r = requests.post(f"{self.scheme}://{m['ip']}:{m['client']}{path}", json=body,
                                  timeout=3, headers=headers or {}, **self._req())
                if r.status_code == 200:
                    return r.json()
                last = r.text
            except requests.RequestException as e:
                last = str(e)
        raise RuntimeError(f"no etcd member answered {path}: {last}")

    def range(self, prefix):
        """{key: value (parsed JSON, or the raw text)} under prefix."""
        ans = self._post("/v3/kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))})
        out = {}
        for kv in ans.get("kvs", []):
            v = base64.b64decode(kv.get("value", "")).decode()
            try:
                v = json.loads(v)
            except ValueError:
                pass
            out[base64.b64decode(kv["key"]).decode()] = v
        return out

    def put(self, key, value):
        self._post("/v3/kv/put", {"key": b64(key), "value": b64(value)})

    def delete(self, key):
        self._post("/v3/kv/deleterange", {"key": b64(key)})


    def enable_auth(self, user, password):
        """A root user with password; then etcd requires authentication."""
        self._post("/v3/auth/role/add", {"name": "root"})
        self._post("/v3/auth/user/add", {"name": user, "password": password})
        self._post("/v3/auth/user/grant", {"user": user, "role": "root"})
        self._post("/v3/auth/enable", {})


def make_certs(d):
    """A CA, a server certificate for 127.0.0.1 and a client certificate (openssl CLI)."""
    if not shutil.which("openssl"):
        pytest.skip("the openssl command is not installed (scripts/setup.sh installs Debian's openssl)")
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=disagg-test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn in (("server", "127.0.0.1"), ("client", "root")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", f"{name}.key",
            "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.ext", "-out", f"{name}.pem")
    return {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key",
            "client_cert": d / "client.pem", "client_key": d / "client.key"}


@pytest.fixture
def etcd_factory(tmp_path):
    made = []

    def make(n=1, tls=None):
        need_etcd()
        e = Etcd(tmp_path / f"etcd{len(made)}", n, tls=tls)
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop_all()
