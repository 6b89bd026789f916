"""Scale-out through etcd (docs/scaling.md): real etcd processes (one
member, then a 3-member cluster), real `disagg serve` prefill/decode instances
registering with --discovery and real `disagg proxy --discovery` routers
watching them.  Instances join without a restart, a killed one disappears
after its lease TTL, a clean stop deregisters at once, P and D pair only
within one model + KV layout, proxies keep routing while etcd is down, and a
burst of requests has no error while a prefill and a decode restart."""
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests

from etcd_harness import etcd_factory, make_certs, need_etcd  # noqa: F401 (fixture)
from server_harness import BIN, MODEL, free_port

TTL = "2"
PREFIX = "/disagg-test"


def kv_config(role):
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})


def wait_for(pred, timeout, what, step=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Instance:
    """`disagg serve` as a prefill or decode instance registered in etcd."""

    def __init__(self, etcd_url, role, port=None, boot=None, extra=(), name="tiny", logdir="/tmp",
                 env=None):
        self.role, self.etcd_url, self.name, self.extra = role, etcd_url, name, list(extra)
        self.env = env or {}
        self.port = port or free_port()
        self.boot = boot or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = f"{PREFIX}/instances/{role}/127.0.0.1:{self.port}"
        self.logdir = Path(logdir)
        self.start()

    def start(self):
        env = dict(os.environ, VLLM_MOONCAKE_BOOTSTRAP_PORT=str(self.boot), VLLM_HOST_IP="127.0.0.1",
                   **self.env)
        self.log_path = self.logdir / f"{self.role}-{self.port}.log"
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [BIN, "serve", str(MODEL), "--host", "127.0.0.1", "--port", str(self.port), "--threads", "1",
             "--served-model-name", self.name, "--kv-cache-memory", "32M", "--max-model-len", "512",
             "--kv-transfer-config", kv_config("kv_producer" if self.role == "prefill" else "kv_consumer"),
             "--discovery", self.etcd_url, "--discovery-ttl", TTL] + self.extra,
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        wait_for(lambda: self.healthy(), 120, f"{self.role} {self.url} healthy")

    def healthy(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.role} exited {self.proc.returncode}: {self.logs()}")
        try:
            return requests.get(self.url + "/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def logs(self):
        self.log.flush()
        return self.log_path.read_text()[-3000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=40)
        return self.proc.returncode

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=10)


class Proxy:
    def __init__(self, etcd_url, extra=(), logdir="/tmp", env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(logdir) / f"proxy-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([BIN, "proxy", "--port", str(self.port), "--discovery", etcd_url,
                                      "--health-interval", "0.2"] + list(extra),
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **(env or {})))
        wait_for(self.up, 30, "proxy listening")

    def up(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"proxy exited {self.proc.returncode}: {self.logs()}")
        try:
            requests.get(self.url + "/healthcheck", timeout=1)
            return True
        except requests.RequestException:
            return False

    def logs(self):
        self.log.flush()
        return self.log_path.read_text()[-4000:]

    def metrics(self):
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def in_rotation(self, role):
        return int(self.metrics().get(f'disagg_proxy_discovery_instances{{role="{role}"}}', -1))

    def sent_to(self, inst):
        return self.metrics().get(
            f'disagg_proxy_backend_requests_total{{role="{inst.role}",backend="{inst.url}"}}', 0)

    def ready_for(self, inst):
        return self.metrics().get(
            f'disagg_proxy_backend_healthy{{role="{inst.role}",backend="{inst.url}"}}', 0) == 1

    def complete(self, prompt="The state of the union", max_tokens=4, timeout=60, **kw):
        return requests.post(self.url + "/v1/completions", timeout=timeout,
                             json=dict({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                        "temperature": 0}, **kw))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=40)
        return self.proc.returncode


@pytest.fixture
def cluster(etcd_factory, tmp_path):
    """Processes started by a test; all stopped at teardown."""
    made = []

    class C:
        logdir = tmp_path

        @staticmethod
        def instance(url, role, **kw):
            i = Instance(url, role, logdir=tmp_path, **kw)
            made.append(i)
            return i

        @staticmethod
        def proxy(url, **kw):
            p = Proxy(url, logdir=tmp_path, **kw)
            made.append(p)
            return p

    yield C
    for p in made:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(timeout=10)


# ---- bad inputs -------------------------------------------------------------

@pytest.mark.parametrize("url,needle", [
    ("http://127.0.0.1:2379/x", "is not an etcd URL"),
    ("etcd:///x", "names no etcd endpoint"),
    ("etcd://host/x", "etcd endpoint 'host' is not accepted"),
    ("etcd://127.0.0.1:0/x", "is not accepted"),
    ("etcd://127.0.0.1:70000/x", "is not accepted"),
    ("etcd://127.0.0.1:2379,/x", "ends with a comma"),
    ("etcd://127.0.0.1:2379,,h:1/x", "is not accepted"),
    ("etcd://u:p@127.0.0.1:2379/x", "credentials do not go in the URL"),
])
def test_malformed_discovery_url(url, needle):
    for cmd in (["serve"], ["proxy"], ["bootstrap", "--port", "1234"]):
        r = subprocess.run([BIN, *cmd, "--discovery", url], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2, (cmd, r.stderr)
        assert "--discovery" in r.stderr and needle in r.stderr, (cmd, r.stderr)


@pytest.mark.parametrize("ttl", ["0", "0.5", "-1", "abc", "", "1e9", "nan"])
def test_bad_ttl(ttl):
    r = subprocess.run([BIN, "serve", "--discovery", "etcd://127.0.0.1:2379/x", "--discovery-ttl", ttl],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--discovery-ttl" in r.stderr and "[1, 3600]" in r.stderr, r.stderr


def test_bad_discovery_combinations(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    cases = [
        (["proxy", "--etcd-user", "u"], "need --discovery"),
        (["proxy", "--discovery", "etcd://127.0.0.1:2379/x", "--etcd-cacert", str(ca)], "etcds://"),
        (["proxy", "--discovery", "etcds://127.0.0.1:2379/x", "--etcd-cert", str(ca)], "go together"),
        (["proxy", "--discovery", "etcds://127.0.0.1:2379/x", "--etcd-cacert", str(tmp_path / "no")],
         "cannot be read"),
        (["proxy", "--discovery", "etcd://127.0.0.1:2379/x", "--discovery-ttl", "3"], "unknown option"),
        (["serve", "--discovery", "etcd://127.0.0.1:2379/x", "--discovery-advertise", "h:1"],
         "--discovery-advertise 'h:1' is not accepted"),
        (["bootstrap", "--port", "0", "--discovery", "etcd://127.0.0.1:2379/x"], "fixed --port"),
    ]
    for args, needle in cases:
        r = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)


def test_unreachable_etcd_at_start(tmp_path):
    dead = f"etcd://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/x"
    r = subprocess.run([BIN, "proxy", "--port", "0", "--discovery", dead], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1 and "cannot read the instances from etcd" in r.stderr, r.stderr
    assert r.stderr.count("Couldn't connect") == 2, r.stderr  # both endpoints were tried
    r = subprocess.run([BIN, "serve", "--host", "127.0.0.1", "--port", str(free_port()),
                        "--kv-transfer-config", kv_config("kv_producer"), "--discovery", dead],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "cannot register with etcd" in r.stderr, r.stderr
    r = subprocess.run([BIN, "serve", "--port", str(free_port()), "--discovery", dead],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "needs --kv-transfer-config" in r.stderr, r.stderr


# ---- one etcd member -----------------------------------------------------------

def test_single_member_lifecycle(etcd_factory, cluster):
    etcd = etcd_factory(1)
    url = etcd.url(PREFIX)
    d1 = cluster.instance(url, "decode")
    p1 = cluster.instance(url, "prefill")
    a, b = cluster.proxy(url), cluster.proxy(url)  # several proxies on one etcd
    recs = wait_for(lambda: (lambda r: r if len(r) == 2 else None)(etcd.range(PREFIX + "/instances/")),
                    10, "both records")
    rec = recs[p1.key]
    assert rec["role"] == "prefill" and rec["url"] == p1.url and rec["model"] == "tiny"
    assert rec["bootstrap"] == f"http://127.0.0.1:{p1.boot}" and rec["engine_id"]
    assert "layers=6" in rec["kv_layout"] and set(rec["load"]) == {"running", "waiting", "kv_usage"}
    assert recs[d1.key]["kv_layout"] == rec["kv_layout"]
    for px in (a, b):
        wait_for(lambda: px.ready_for(p1) and px.ready_for(d1), 10, "proxy ready")
        for _ in range(3):
            r = px.complete()
            assert r.status_code == 200, r.text

    # an instance that joins is used within about a second, without a restart
    p2 = cluster.instance(url, "prefill")
    t0 = time.time()
    def used():
        assert a.complete().status_code == 200
        return a.sent_to(p2) > 0
    wait_for(used, 10, "a request on the new prefill")
    print(f"\nnew prefill used {time.time() - t0:.2f} s after its /health answered")

    # an instance with another KV layout never pairs with these
    d_other = cluster.instance(url, "decode", extra=["--block-size", "32"])
    wait_for(lambda: a.in_rotation("decode") == 2, 10, "the other decode in rotation")
    for _ in range(6):
        assert a.complete().status_code == 200
    assert a.sent_to(d_other) == 0, a.logs()

    # kill -9: no new requests after the TTL; until then a refused connection is retried elsewhere
    p1.kill()
    t0 = time.time()
    for _ in range(6):
        r = a.complete()
        assert r.status_code == 200, r.text
    wait_for(lambda: a.in_rotation("prefill") == 1 and b.in_rotation("prefill") == 1, 10, "P1 gone")
    print(f"killed prefill out of rotation after {time.time() - t0:.2f} s (TTL {TTL} s)")
    assert p1.key not in etcd.range(PREFIX + "/instances/")

    # a clean stop deletes the key at once (no TTL wait)
    assert d_other.stop() == 0, d_other.logs()
    assert d_other.key not in etcd.range(PREFIX + "/instances/")
    assert "deregistered" in d_other.logs()

    # a killed decode: requests are retried on the other one (refused connection) or fail
    # fast (cut mid-reply), none hangs
    d2 = cluster.instance(url, "decode")
    wait_for(lambda: a.ready_for(d2), 10, "second decode ready")
    d1.kill()
    with cf.ThreadPoolExecutor(4) as ex:
        t0 = time.time()
        futs = [ex.submit(a.complete, max_tokens=4) for _ in range(8)]
        codes = [f.result().status_code for f in futs]
    assert time.time() - t0 < 20 and all(c in (200, 502) for c in codes), codes

    # all of etcd down: both proxies keep routing on the last known set, and say so
    etcd.stop_all()
    wait_for(lambda: a.metrics()["disagg_proxy_discovery_connected"] == 0, 10, "disconnected")
    for px in (a, b):
        for _ in range(4):
            r = px.complete()
            assert r.status_code == 200, r.text
    assert "etcd unreachable" in a.logs()
    m = a.metrics()
    assert m["disagg_proxy_discovery_errors_total"] >= 1 and a.in_rotation("prefill") == 1
    # etcd back (same data): the proxies reconnect, the instances re-publish
    etcd.start(0)
    wait_for(lambda: a.metrics()["disagg_proxy_discovery_connected"] == 1, 15, "reconnected")
    wait_for(lambda: p2.key in etcd.range(PREFIX + "/instances/"), 15, "P2 registered again")
    assert a.complete().status_code == 200
    for x in (a, b, p2, d2):
        assert x.stop() == 0, x.logs()


def test_bad_record_is_ignored(etcd_factory, cluster):
    etcd = etcd_factory(1)
    url = etcd.url(PREFIX)
    a = cluster.proxy(url)
    etcd.put(PREFIX + "/instances/prefill/x", "not json")
    etcd.put(PREFIX + "/instances/decode/y", json.dumps({"role": "decode", "url": "ftp://x"}))
    wait_for(lambda: a.metrics()["disagg_proxy_discovery_bad_records_total"] == 2, 5, "bad records")
    r = a.complete()
    assert r.status_code == 503 and "no prefill instance is known" in r.text, r.text
    assert "ignoring" in a.logs()


def test_standalone_bootstrap_registers(etcd_factory, cluster, tmp_path):
    etcd = etcd_factory(1)
    url = etcd.url(PREFIX)
    port = free_port()
    log = open(tmp_path / "bootstrap.log", "w")
    b = subprocess.Popen([BIN, "bootstrap", "--host", "127.0.0.1", "--port", str(port), "--discovery", url,
                          "--discovery-ttl", TTL], stdout=log, stderr=subprocess.STDOUT)
    try:
        key = f"{PREFIX}/instances/bootstrap/127.0.0.1:{port}"
        rec = wait_for(lambda: etcd.range(PREFIX + "/instances/").get(key), 10, "the bootstrap record")
        assert rec["role"] == "bootstrap" and rec["url"] == f"http://127.0.0.1:{port}"
        a = cluster.proxy(url)
        wait_for(lambda: a.in_rotation("bootstrap") == 1, 5, "the proxy counting it")
        b.send_signal(signal.SIGTERM)
        assert b.wait(timeout=20) == 0
        assert key not in etcd.range(PREFIX + "/instances/")
        wait_for(lambda: a.in_rotation("bootstrap") == 0, 5, "the proxy forgetting it")
        assert a.stop() == 0
    finally:
        if b.poll() is None:
            b.kill()
            b.wait()


def test_published_load_steers_least_loaded(etcd_factory, cluster):
    """Load the proxy did not cause (another proxy's, or a direct client's) reaches it
    through etcd: a decode holding parked requests gets no new ones."""
    import socket
    import threading
    import uuid
    etcd = etcd_factory(1)
    url = etcd.url(PREFIX)
    p = cluster.instance(url, "prefill")
    d1, d2 = cluster.instance(url, "decode"), cluster.instance(url, "decode")
    a = cluster.proxy(url)
    wait_for(lambda: all(a.ready_for(i) for i in (p, d1, d2)), 10, "all ready")
    silent = socket.socket()  # a "prefill bootstrap server" that never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    boot = f"http://127.0.0.1:{silent.getsockname()[1]}"

    def parked():
        try:
            requests.post(d1.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "held", "max_tokens": 2,
                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                       "remote_engine_id": "nobody", "remote_bootstrap_addr": boot,
                                       "transfer_id": f"xfer-{uuid.uuid4()}"}})
        except requests.RequestException:
            pass
    for _ in range(3):
        threading.Thread(target=parked, daemon=True).start()
    key = f'disagg_proxy_backend_published_load{{role="decode",backend="{d1.url}"}}'
    wait_for(lambda: a.metrics().get(key, 0) >= 3, 10, "D1's published load")
    assert etcd.range(PREFIX + "/instances/")[d1.key]["load"]["waiting"] >= 3
    n1, n2 = a.sent_to(d1), a.sent_to(d2)
    for _ in range(8):
        assert a.complete().status_code == 200
    assert a.sent_to(d1) == n1 and a.sent_to(d2) == n2 + 8
    d1.kill()  # its parked requests would hold its drain
    silent.close()


def test_load_is_read_from_the_engine(etcd_factory, cluster):
    """The registrar publishes the engine's counters without asking the instance over HTTP:
    once registered, the instance's request counter moves only with the test's own requests
    (it used to GET /health and /metrics over loopback at every refresh, 4 times a second)."""
    etcd = etcd_factory(1)
    url = etcd.url(PREFIX)
    d = cluster.instance(url, "decode")
    wait_for(lambda: d.key in etcd.range(PREFIX + "/instances/"), 10, "the record")
    time.sleep(0.5)  # the drainer's /health polls end with the first 200 too

    def http_requests():
        for line in requests.get(d.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("disagg:http_requests_total"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no disagg:http_requests_total in /metrics")
    a = http_requests()
    time.sleep(1.5)  # 6 refreshes
    b = http_requests()
    assert b - a == 1, f"{b - a - 1:.0f} requests from the instance itself in 1.5 s"
    rec = etcd.range(PREFIX + "/instances/")[d.key]
    assert rec["load"] == {"running": 0, "waiting": 0, "kv_usage": 0}, rec
    # the load still follows the engine: a request held on its KV counts as waiting
    import socket
    import threading
    import uuid
    silent = socket.socket()  # a "prefill bootstrap server" that never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)

    def parked():
        try:
            requests.post(d.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "held", "max_tokens": 2,
                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                       "remote_engine_id": "nobody",
                                       "remote_bootstrap_addr": f"http://127.0.0.1:{silent.getsockname()[1]}",
                                       "transfer_id": f"xfer-{uuid.uuid4()}"}})
        except requests.RequestException:
            pass
    threading.Thread(target=parked, daemon=True).start()
    wait_for(lambda: etcd.range(PREFIX + "/instances/")[d.key]["load"]["waiting"] == 1, 10,
             "the parked request in the record")
    d.kill()
    silent.close()


def test_deleted_key_is_restored(etcd_factory, cluster):
    """A record deleted by hand (or lost) is put again within a TTL; meanwhile the
    proxies take the instance out."""
    etcd = etcd_factory(1)
    url = etcd.url(PREFIX)
    p = cluster.instance(url, "prefill")
    a = cluster.proxy(url)
    wait_for(lambda: a.in_rotation("prefill") == 1, 10, "the prefill")
    etcd.delete(p.key)
    wait_for(lambda: a.in_rotation("prefill") == 0, 5, "the deletion seen")
    wait_for(lambda: a.in_rotation("prefill") == 1, int(TTL) + 3, "the record put again")
    assert p.key in etcd.range(PREFIX + "/instances/")
    assert a.stop() == 0 and p.stop() == 0


# ---- a 3-member cluster ------------------------------------------------------------

def test_cluster_member_loss_and_restart_burst(etcd_factory, cluster):
    etcd = etcd_factory(3)
    url = etcd.url(PREFIX)
    ps = [cluster.instance(url, "prefill") for _ in range(2)]
    ds = [cluster.instance(url, "decode") for _ in range(2)]
    a, b = cluster.proxy(url, extra=["--policy", "prefix"]), cluster.proxy(url, extra=["--policy", "p2c"])
    for px in (a, b):
        wait_for(lambda: px.in_rotation("prefill") == 2 and px.in_rotation("decode") == 2
                 and all(px.ready_for(i) for i in ps + ds), 10, "all in rotation")

    # one etcd member down (the first endpoint everyone tries): nothing changes
    etcd.kill(0)
    for px in (a, b):
        for _ in range(3):
            assert px.complete().status_code == 200
    p3 = cluster.instance(url, "prefill")  # registers through the others; proxies still watch
    wait_for(lambda: a.in_rotation("prefill") == 3 and b.in_rotation("prefill") == 3, 10, "P3 seen")

    # prefix policy: one long shared prefix keeps going to the same prefill
    before = {i.url: a.sent_to(i) for i in ps + [p3]}
    shared = "You are a helpful assistant. " * 20
    for k in range(6):
        assert a.complete(prompt=shared + f"question {k}").status_code == 200
    grew = [u for u, n in before.items() if a.sent_to(next(i for i in ps + [p3] if i.url == u)) > n]
    assert len(grew) == 1, grew

    # a burst of at least 500 requests over both proxies, going on until after one P and
    # one D have restarted: no errors
    errors, done = [], []
    state = {"back": None, "k": 0}

    def worker(w):
        while True:
            k = state["k"] = state["k"] + 1
            back = state["back"]
            if back is not None and len(done) + len(errors) >= 500 and time.time() > back + 0.3:
                return
            px = (a, b)[k % 2]
            r = px.complete(prompt=f"request {k} " + "words " * (k % 7), max_tokens=3)
            (done if r.status_code == 200 else errors).append((time.time(), r.status_code, r.text[:200]))

    with cf.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(worker, w) for w in range(6)]
        time.sleep(0.3)
        t_restart = time.time()
        for inst in (ps[0], ds[0]):
            assert inst.stop() == 0, inst.logs()
            inst.start()  # same address, new engine
        t_back = state["back"] = time.time()
        for f in futs:
            f.result()
    assert not errors, errors[:5]
    assert len(done) >= 500
    finished = sorted(t for t, _, _ in done)
    assert finished[0] < t_restart and finished[-1] > t_back
    print(f"\n{len(done)} requests, {sum(1 for t in finished if t_restart <= t <= t_back)} of them "
          f"during the {t_back - t_restart:.1f} s of restarts, 0 errors")
    wait_for(lambda: a.ready_for(ps[0]) and a.ready_for(ds[0]), 10, "restarted ones back")
    for x in (a, b, *ps, *ds, p3):
        assert x.stop() == 0, x.logs()


# ---- TLS and user/password -------------------------------------------------------------

def test_tls_and_client_certificates(etcd_factory, cluster, tmp_path):
    need_etcd()
    certs = make_certs(tmp_path / "certs")
    etcd = etcd_factory(1, tls=certs)
    url = etcd.url(PREFIX)
    tls = ["--etcd-cacert", str(certs["ca"]), "--etcd-cert", str(certs["client_cert"]),
           "--etcd-key", str(certs["client_key"])]
    p = cluster.instance(url, "prefill", extra=tls)
    a = cluster.proxy(url, extra=tls)
    wait_for(lambda: a.in_rotation("prefill") == 1, 10, "the prefill over TLS")
    assert etcd.range(PREFIX + "/instances/")[p.key]["url"] == p.url
    # without the CA the server certificate is not trusted; without a client certificate
    # etcd refuses the connection
    for flags, needle in ((tls[2:], "certificate"), (tls[:2], "no etcd endpoint answered")):
        r = subprocess.run([BIN, "proxy", "--port", "0", "--discovery", url, *flags],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and "cannot read the instances from etcd" in r.stderr, r.stderr
        assert needle in r.stderr, r.stderr
    assert a.stop() == 0 and p.stop() == 0


def test_user_password_auth(etcd_factory, cluster):
    etcd = etcd_factory(1)
    etcd.enable_auth("root", "s3cret")
    url = etcd.url(PREFIX)
    good = {"DISAGG_ETCD_PASSWORD": "s3cret"}
    d = cluster.instance(url, "decode", extra=["--etcd-user", "root"], env=good)
    a = cluster.proxy(url, extra=["--etcd-user", "root"], env=good)
    wait_for(lambda: a.in_rotation("decode") == 1, 10, "the decode with auth")
    for env, extra, needle in (({"DISAGG_ETCD_PASSWORD": "wrong"}, ["--etcd-user", "root"],
                                "authentication as user 'root'"),
                               ({}, [], "user name is empty")):
        r = subprocess.run([BIN, "proxy", "--port", "0", "--discovery", url, *extra],
                           capture_output=True, text=True, timeout=30, env=dict(os.environ, **env))
        assert r.returncode == 1 and needle in r.stderr, r.stderr
        assert "s3cret" not in r.stderr
    assert a.stop() == 0 and d.stop() == 0
