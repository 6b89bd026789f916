"""`disagg proxy` command-line forms of vLLM's example proxies and
`--api-key` (clients are checked, the key goes upstream).

The argument forms are those of vLLM's MooncakeConnector proxy
(examples/online_serving/disaggregated_serving/mooncake_connector/
mooncake_connector_proxy.py): `--prefill URL [BOOTSTRAP_PORT|none]` repeated,
`--decode URL` repeated, `--host`, `--port`; argparse's `--flag=value` too."""
import subprocess
import time

import openai
import pytest
import requests

from proxy_fixtures import BIN, assert_openai_error, doubles, free_port, json_body, proxy_factory  # noqa: F401


class Proc:
    """A `disagg proxy` started with exactly these arguments (plus a free --port)."""

    def __init__(self, args, port_form="--port"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        port_args = [f"--port={self.port}"] if port_form == "=" else ["--port", str(self.port)]
        self.proc = subprocess.Popen([BIN, "proxy", *port_args, "--health-interval", "0.1",
                                      "--shutdown-timeout", "2", *args],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                requests.get(self.url + "/healthcheck", timeout=1)
                return
            except requests.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"proxy did not start: {self.stop()}")
                time.sleep(0.05)

    def wait_ready(self, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = requests.get(self.url + "/health", timeout=2)
            if r.status_code == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"not ready: {r.text}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            assert self.proc.wait(10) == 0
        return self.proc.stderr.read()


def run_bad(*args):
    r = subprocess.run([BIN, "proxy", *args], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2, r
    return r.stderr


# --- argument forms -------------------------------------------------------------------------


@pytest.mark.parametrize("none", ["none", "None", "NONE"])
def test_prefill_url_none_means_default_bootstrap_port(doubles, none):
    """`--prefill URL none`: the default bootstrap port 8998 on the prefill host (not served
    here: the proxy names it while it waits, and is not ready)."""
    p, d = doubles("prefill", "p0"), doubles("decode", "d0")
    px = Proc(["--prefill", p.url, none, "--decode", d.url])
    time.sleep(0.3)
    r = requests.get(px.url + "/health", timeout=5)
    assert r.status_code == 503
    assert "8998" in r.json()["error"]["message"]
    assert f"prefill {p.url} (bootstrap http://127.0.0.1:8998)" in px.stop()


def test_prefill_url_port_and_equals_forms_serve(doubles):
    """`--prefill URL PORT` repeated, `--decode URL` repeated, `--host H`, and argparse's
    `--port=N` / `--prefill=URL PORT` / `--host=H`: requests go through with each
    prefill's bootstrap port."""
    p0, p1 = doubles("prefill", "p0"), doubles("prefill", "p1")
    d0, d1 = doubles("decode", "d0"), doubles("decode", "d1")
    for form in ("space", "="):
        if form == "space":
            args = ["--host", "127.0.0.1", "--prefill", p0.url, str(p0.bootstrap_port),
                    "--prefill", p1.url, str(p1.bootstrap_port), "--decode", d0.url, "--decode", d1.url,
                    "--policy", "round_robin"]
        else:
            args = ["--host=127.0.0.1", f"--prefill={p0.url}", str(p0.bootstrap_port),
                    f"--prefill={p1.url}", str(p1.bootstrap_port), f"--decode={d0.url}", f"--decode={d1.url}",
                    "--policy=round_robin"]
        px = Proc(args, port_form="=" if form == "=" else "--port")
        px.wait_ready()
        for _ in range(2):
            assert requests.post(px.url + "/v1/completions", json={"prompt": "a"}, timeout=10).status_code == 200
        px.stop()
    for p in (p0, p1):
        assert len(p.completions()) == 2
        for rec in p.completions():
            assert json_body(rec)["max_tokens"] == 1
    for d in (d0, d1):
        assert len(d.completions()) == 2
    addrs = {json_body(rec)["kv_transfer_params"]["remote_bootstrap_addr"]
             for d in (d0, d1) for rec in d.completions()}
    assert addrs == {f"http://127.0.0.1:{p0.bootstrap_port}", f"http://127.0.0.1:{p1.bootstrap_port}"}


def test_decode_takes_several_urls(doubles):
    """`--decode URL URL` (disagg_proxy_demo.py's nargs="+") is two decode instances."""
    p, d0, d1 = doubles("prefill", "p0"), doubles("decode", "d0"), doubles("decode", "d1")
    px = Proc(["--prefill", p.url, str(p.bootstrap_port), "--decode", d0.url, d1.url])
    px.wait_ready()
    j = requests.get(px.url + "/healthcheck", timeout=5).json()
    assert j["decode_instances"] == 2 and j["prefill_instances"] == 1
    px.stop()


@pytest.mark.parametrize("args,needle", [
    (["--prefill", "http://127.0.0.1:1", "9000", "9001", "--decode", "http://127.0.0.1:2"],
     "unexpected '9001'"),
    (["--prefill", "http://127.0.0.1:1", "nine", "--decode", "http://127.0.0.1:2"],
     "bootstrap 'nine' of http://127.0.0.1:1 is not accepted: give a port number, 'none'"),
    (["--prefill", "http://127.0.0.1:1", "70000", "--decode", "http://127.0.0.1:2"],
     "bootstrap port '70000'"),
    (["--prefill", "http://127.0.0.1:1", "--decode"], "--decode needs a URL"),
    (["--prefill=", "--decode", "http://127.0.0.1:2"], "--prefill needs a URL"),
    (["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port=x"], "--port 'x'"),
    (["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--nope=1"],
     "unknown option '--nope'"),
    (["--prefil", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
     "unknown option '--prefil'; did you mean --prefill?"),
    (["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--api_key=k"],
     "unknown option '--api_key'; did you mean --api-key?"),
])
def test_bad_forms_exit_2_naming_the_value(args, needle):
    assert needle in run_bad(*args)


# --- --api-key --------------------------------------------------------------------------------


@pytest.fixture
def keyed(doubles, proxy_factory):
    p, d = doubles("prefill", "p0"), doubles("decode", "d0")
    return p, d, proxy_factory([p], [d], ["--api-key", "sk-proxy"])


def test_api_key_required_on_v1_paths(keyed):
    p, d, px = keyed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-proxy"},
                    {"Authorization": "Bearer sk-proxy2"}, {"Authorization": "Bearer sk-prox"}):
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", "/v1/nothing")):
            r = requests.request(method, px.url + path, json={"prompt": "a"}, headers=headers, timeout=5)
            # vLLM's AuthenticationMiddleware body, exactly
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, r.text
            assert r.headers["WWW-Authenticate"] == "Bearer"
    assert not p.completions() and not d.completions()  # nothing went upstream
    # as vLLM: /health and /metrics need no key
    assert requests.get(px.url + "/health", timeout=5).status_code == 200
    m = px.metrics()
    assert m['disagg_proxy_errors_total{reason="unauthorized"}'] == 20


def test_api_key_accepted_and_forwarded_with_openai_client(keyed):
    p, d, px = keyed
    bad = openai.OpenAI(base_url=px.url + "/v1", api_key="not-it", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="m", prompt="a", max_tokens=2)
    good = openai.OpenAI(base_url=px.url + "/v1", api_key="sk-proxy", max_retries=0, timeout=10)
    out = good.completions.create(model="m", prompt="a", max_tokens=2)
    assert out.choices[0].text
    good.models.list()
    for rec in p.completions() + d.completions():
        assert rec["headers"]["authorization"] == "Bearer sk-proxy"
    models = [r for r in d.requests if r["path"] == "/v1/models"]
    assert models and all(r["headers"]["authorization"] == "Bearer sk-proxy" for r in models)


def test_without_api_key_no_check_and_client_header_passes(doubles, proxy_factory):
    p, d = doubles("prefill", "p0"), doubles("decode", "d0")
    px = proxy_factory([p], [d])
    assert requests.post(px.url + "/v1/completions", json={"prompt": "a"}, timeout=5).status_code == 200
    r = requests.post(px.url + "/v1/completions", json={"prompt": "a"}, timeout=5,
                      headers={"Authorization": "Bearer client-own"})
    assert r.status_code == 200
    assert d.completions()[-1]["headers"]["authorization"] == "Bearer client-own"
