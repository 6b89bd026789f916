"""netns — the multi-host test fixture: "hosts" made of Linux network
namespaces on this machine, the processes that run inside them, and their
teardown, even when a test fails.

Topology of one Cluster (all addresses test-only, 10.231.0.0/16):

    root namespace: the client, the proxy, colocated reference servers
        bridge dgbr<id>  10.231.L.1/24   (the "LAN", like the guide's 192.168.0.x)
          |-- host h0: lan0 10.231.L.2   (prefill)
          |-- host h1: lan0 10.231.L.3   (decode)  ...
    between two hosts, the KV "NICs": veth pairs named veth-a, veth-b in both
    namespaces, one /24 each: 10.231.(L+1+k).1 on the first host, .2 on the second.

Each host runs `ip netns exec NS disagg serve ...` with VLLM_HOST_IP = its LAN
address, so its segment name and side-channel address are LAN addresses; the
transfer engine's data paths follow kv_connector_extra_config.device_name
(naming veth-a/veth-b moves KV traffic onto those links).

Names carry a per-run id and the creating pid ("dgmh-<id>-<pid>-<host>"), so a
crashed run's leftovers are recognised and removed by the next run
(remove_stale).  Everything needs root and iproute2; `skip_reason()` says why
a test cannot run here.
"""
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import requests

from server_harness import BIN, MODEL, free_port

PREFIX = "dgmh-"
BRIDGE_ALIAS = "disagg-multihost-test"


def _ip(*args, check=True, ns=None):
    cmd = ["ip"] + (["-n", ns] if ns else []) + [str(a) for a in args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
    return r


def skip_reason():
    """None when namespaces can be made here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "multi-host tests need root (ip netns add, veth pairs); run as root or in CI"
    if not shutil.which("ip"):
        return "multi-host tests need iproute2's `ip` (apt-get install iproute2)"
    name = f"{PREFIX}probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` does not work here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    if not Path(BIN).is_file():
        return f"disagg binary not found at {BIN}"
    return None


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_ns_pids(ns):
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for tok in r.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError):
            pass


def remove_stale():
    """Delete namespaces and bridges left by runs whose process is gone."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if not ns.startswith(PREFIX):
            continue
        parts = ns.split("-")
        try:
            pid = int(parts[2])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            _kill_ns_pids(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    r = subprocess.run(["ip", "-j", "link", "show", "type", "bridge"], capture_output=True, text=True)
    try:
        links = json.loads(r.stdout or "[]")
    except ValueError:
        links = []
    for link in links:
        alias = link.get("ifalias", "")
        if alias.startswith(BRIDGE_ALIAS):
            try:
                pid = int(alias.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            if not _pid_alive(pid):
                subprocess.run(["ip", "link", "del", link["ifname"]], capture_output=True)


def _used_subnets():
    r = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    used = set()
    for line in r.stdout.split():
        if line.startswith("10.231."):
            used.add(int(line.split(".")[2]))
    return used


class Host:
    """One namespace: its name, LAN address and the KV links it has."""

    def __init__(self, cluster, index):
        self.cluster = cluster
        self.index = index
        self.ns = f"{PREFIX}{cluster.id}-{os.getpid()}-h{index}"
        self.lan_ip = f"10.231.{cluster.lan}.{index + 2}"
        self.links = {}  # interface name -> this host's address on it

    def exec_args(self, args):
        return ["ip", "netns", "exec", self.ns] + [str(a) for a in args]

    def run(self, *args, timeout=30, check=True):
        r = subprocess.run(self.exec_args(args), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, args))} in {self.ns} failed: {r.stderr.strip()}")
        return r

    def popen(self, args, **kw):
        p = subprocess.Popen(self.exec_args(args), **kw)
        self.cluster.procs.append(p)
        return p

    def tx_bytes(self, ifname):
        """Bytes sent by this host on ifname (the kernel's per-interface counter)."""
        r = _ip("-j", "-s", "link", "show", "dev", ifname, ns=self.ns)
        return int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])

    def rx_bytes(self, ifname):
        r = _ip("-j", "-s", "link", "show", "dev", ifname, ns=self.ns)
        return int(json.loads(r.stdout)[0]["stats64"]["rx"]["bytes"])

    def link_set(self, ifname, state):
        _ip("link", "set", "dev", ifname, state, ns=self.ns)

    def tc(self, *args):
        r = subprocess.run(self.exec_args(["tc"] + list(args)), capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            raise RuntimeError(f"tc {' '.join(args)} in {self.ns}: {r.stderr.strip()}")

    def rate_limit(self, ifname, mbit):
        """Token-bucket limit on what this host sends on ifname (None removes it)."""
        subprocess.run(self.exec_args(["tc", "qdisc", "del", "dev", ifname, "root"]), capture_output=True)
        if mbit:
            burst = max(32 * 1024, int(mbit * 1e6 / 8 / 250))  # ~4 ms of data
            self.tc("qdisc", "add", "dev", ifname, "root", "tbf", "rate", f"{mbit}mbit",
                    "burst", str(burst), "latency", "200ms")


class Cluster:
    """Namespaces joined by a LAN bridge in the root namespace, plus KV links.

    Use as a context manager or call close(); close() kills every process
    started through it and deletes every namespace and the bridge."""

    def __init__(self, n_hosts=2, kv_links=(("veth-a", "veth-b"),), link_pairs=((0, 1),)):
        remove_stale()
        self.id = "%04x" % random.randrange(1 << 16)
        self.procs = []
        self.hosts = []
        self.bridge = f"dgbr{self.id}"
        used = _used_subnets()
        free = [k for k in range(0, 252, 4) if not used & {k, k + 1, k + 2, k + 3}]
        if not free:
            raise RuntimeError("no free 10.231.x.0/24 block for the test network")
        self.lan = random.choice(free)
        self.root_ip = f"10.231.{self.lan}.1"
        self.closed = False
        try:
            self._build(n_hosts, kv_links, link_pairs)
        except Exception:
            self.close()
            raise

    def _build(self, n_hosts, kv_links, link_pairs):
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", "dev", self.bridge, "alias", f"{BRIDGE_ALIAS} {os.getpid()}")
        _ip("addr", "add", f"{self.root_ip}/24", "dev", self.bridge)
        _ip("link", "set", "dev", self.bridge, "up")
        for i in range(n_hosts):
            h = Host(self, i)
            _ip("netns", "add", h.ns)
            self.hosts.append(h)
            h.run("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
            h.run("sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1")
            _ip("link", "set", "dev", "lo", "up", ns=h.ns)
            outer = f"dg{self.id}h{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", "lan0", "netns", h.ns)
            _ip("link", "set", "dev", outer, "master", self.bridge)
            _ip("link", "set", "dev", outer, "up")
            _ip("addr", "add", f"{h.lan_ip}/24", "dev", "lan0", ns=h.ns)
            _ip("link", "set", "dev", "lan0", "up", ns=h.ns)
        for pi, (a, b) in enumerate(link_pairs):
            ha, hb = self.hosts[a], self.hosts[b]
            for k, name in enumerate(kv_links[pi] if pi < len(kv_links) else kv_links[0]):
                net = self.lan + 1 + k + 2 * pi
                if net >= self.lan + 4:
                    raise RuntimeError("at most two KV links per cluster")
                _ip("link", "add", name, "netns", ha.ns, "type", "veth", "peer", "name", name,
                    "netns", hb.ns)
                for h, last in ((ha, 1), (hb, 2)):
                    h.links[name] = f"10.231.{net}.{last}"
                    _ip("addr", "add", f"10.231.{net}.{last}/24", "dev", name, ns=h.ns)
                    _ip("link", "set", "dev", name, "up", ns=h.ns)

    def close(self):
        if self.closed:
            return
        self.closed = True
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for h in self.hosts:
            _kill_ns_pids(h.ns)
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class NsServer:
    """`disagg serve` inside a host's namespace, listening on its LAN address;
    the same surface as server_harness.Server (url, proc, logs, metrics, stop)."""

    def __init__(self, host, *extra, env=None, name="tiny", port=8100, ready_timeout=120, wait=True):
        self.host = host
        self.port = port
        self.url = f"http://{host.lan_ip}:{port}"
        args = [BIN, "serve", str(MODEL), "--host", host.lan_ip, "--port", str(port), "--threads", "1",
                "--served-model-name", name, "--disable-log-requests"] + [str(a) for a in extra]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"disagg-{host.ns}-{port}.log"
        self.log = open(self.log_path, "w")
        e = dict(os.environ)
        e["VLLM_HOST_IP"] = host.lan_ip
        e.update(env or {})
        self.proc = host.popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        if wait:
            self.wait_ready(ready_timeout)

    def wait_ready(self, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"disagg serve in {self.host.ns} exited with {self.proc.returncode}: "
                                   + self.logs())
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"disagg serve in {self.host.ns} did not become ready: " + self.logs())

    def logs(self):
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self):
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def metric(self, name):
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == name)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
        return self.proc.returncode


# ---- a prefill and a decode instance on two hosts, and the proxy's side of them ----------

COMMON = ("--max-model-len", "2048", "--kv-cache-memory", "64M", "--block-size", "16")


def kv_config(role, device_name=None, **kw):
    extra = {"mooncake_protocol": "tcp"}
    if device_name is not None:
        extra["device_name"] = device_name
    cfg = {"kv_connector": "MooncakeConnector", "kv_role": role, "kv_connector_extra_config": extra}
    cfg.update(kw)
    return json.dumps(cfg)


class HostPD:
    """A kv_producer on host p and a kv_consumer on host d (netns.Host), and
    send(): the two requests of PROTOCOL.md section 1, as vLLM's proxy sends
    them, from the root namespace."""

    def __init__(self, p_host, d_host, device_name=None, p_env=None, d_env=None, p_cfg=None,
                 d_cfg=None, boot_port=8998, port=8100):
        env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot_port)}
        env.update(p_env or {})
        self.p = NsServer(p_host, *COMMON, "--kv-transfer-config",
                          p_cfg or kv_config("kv_producer", device_name), env=env, port=port)
        self.d = NsServer(d_host, *COMMON, "--kv-transfer-config",
                          d_cfg or kv_config("kv_consumer", device_name), env=d_env, port=port)
        self.bootstrap = f"http://{p_host.lan_ip}:{boot_port}"
        self.engine_id = requests.get(self.bootstrap + "/query", timeout=10).json()["0"]["engine_id"]

    def stop(self):
        for s in (self.d, self.p):
            s.stop()

    def bodies(self, body, tid=None):
        """(P body, D body, transfer_id) for one client body."""
        import uuid
        tid = tid or "xfer-" + str(uuid.uuid4())
        pb = dict(body, max_tokens=1, stream=False)
        pb.pop("stream_options", None)
        if "max_completion_tokens" in pb:
            pb["max_completion_tokens"] = 1
        pb["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                    "transfer_id": tid}
        db = dict(body)
        db["kv_transfer_params"] = {"do_remote_decode": False, "do_remote_prefill": True,
                                    "remote_engine_id": self.engine_id,
                                    "remote_bootstrap_addr": self.bootstrap, "transfer_id": tid}
        return pb, db, tid

    def send(self, body, endpoint="/v1/completions", timeout=120):
        """P and D at the same time; returns (P response, D response)."""
        import concurrent.futures as cf
        import uuid
        pb, db, _ = self.bodies(body)
        with cf.ThreadPoolExecutor(2) as ex:
            fp = ex.submit(requests.post, self.p.url + endpoint, json=pb,
                           headers={"X-Request-Id": str(uuid.uuid4())}, timeout=timeout)
            fd = ex.submit(requests.post, self.d.url + endpoint, json=db, timeout=timeout)
            return fp.result(), fd.result()


def blocks_used(server):
    return server.metric("disagg:kv_blocks_used")


def wait_blocks_zero(server, timeout=15):
    deadline = time.time() + timeout
    while True:
        n = blocks_used(server)
        if n == 0:
            return
        if time.time() >= deadline:
            raise AssertionError(f"{server.url}: {n} KV blocks still in use after {timeout} s")
        time.sleep(0.1)


# ---- the proxy, in the root namespace ---------------------------------------------------------

class Proxy:
    """`disagg proxy` in the root namespace in front of NsServer instances:
    prefills = [(NsServer, bootstrap_port)], decodes = [NsServer]."""

    def __init__(self, prefills, decodes, extra=(), ready_timeout=30):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [BIN, "proxy", "--host", "127.0.0.1", "--port", str(self.port), "--health-interval", "0.2"]
        for p, boot in prefills:
            args += ["--prefill", p.url, str(boot)]
        for d in decodes:
            args += ["--decode", d.url]
        args += list(extra)
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"disagg-proxy-mh-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"disagg proxy exited with {self.proc.returncode}: {self.logs()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("disagg proxy did not become ready: " + self.logs())
            time.sleep(0.1)

    def logs(self):
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
        return self.proc.returncode
