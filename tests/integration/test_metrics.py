"""/metrics of every process: a colocated `disagg serve`, a kv_producer
(P), a kv_consumer (D) and the `disagg proxy` in front of them.  Each endpoint's
text goes through the real tools: Prometheus's `promtool check metrics` and
prometheus_client's text parser (the parser vLLM's own scrapers use), and
vLLM's per-request histograms are checked against the requests made.

promtool lints two things that vLLM's own /metrics has too and that a drop-in
cannot change: colons in names (every vllm: series; disagg:'s connector series
follow it) and the histogram vllm:iteration_tokens_total whose vLLM name ends in
_total.  Those exact complaints are allowed; any other fails."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from etcd_harness import etcd_factory  # noqa: F401 (fixture)
from proxy_fixtures import ProxyProc
from server_harness import Server
from test_pd import COMMON, consumer_config, producer_config
from test_proxy_pd import Prefill

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "tools" / "grafana" / "disagg.json"
TIMEOUT = 120
# vLLM's names, which promtool's lint dislikes (see the module docstring)
ALLOWED_LINT = [re.compile(r"^\S+ metric names should not contain ':'$"),
                re.compile(r'^vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix$')]
PROMPTS = ["Fellow-Citizens of the Senate and House of Representatives:",
           "The state of the Union is strong, and " * 6,
           "Commerce"]
MAX_TOKENS = [5, 9, 3]
VLLM_HISTOGRAMS = ["vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                   "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
                   "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                   "vllm:request_params_n", "vllm:request_params_max_tokens",
                   "vllm:e2e_request_latency_seconds"]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def promtool():
    exe = shutil.which("promtool")
    assert exe, "promtool not found: scripts/setup.sh installs it (Debian package prometheus)"
    return exe


def scrape(url):
    r = requests.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/plain"), r.headers
    return r.text


SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
FAMILY_SAMPLES = {"counter": [""], "gauge": [""], "histogram": ["_bucket", "_count", "_sum"],
                  "summary": ["", "_count", "_sum"]}


def check_grouping(text):
    """The exposition's shape, line by line: each family's # HELP then # TYPE once, its samples
    right after them and nowhere else (a family split in two, or a sample under another
    family's TYPE, fails); histograms end each series with _count and _sum."""
    seen, fam, help_name = set(), None, None
    for n, line in enumerate(text.splitlines(), 1):
        where = f"line {n}: {line!r}"
        if line.startswith("# HELP "):
            help_name = line.split(" ", 3)[2]
            assert help_name not in seen, f"{where}: second HELP for {help_name}"
        elif line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ")
            assert name == help_name, f"{where}: TYPE without its HELP right before"
            assert name not in seen, f"{where}: family {name} written twice (not grouped)"
            assert typ in FAMILY_SAMPLES, where
            seen.add(name)
            fam, help_name = (name, typ), None
        else:
            assert line and not line.startswith("#"), where
            assert fam, f"{where}: a sample before any TYPE"
            name = SAMPLE_NAME.match(line).group(0)
            assert name in [fam[0] + sfx for sfx in FAMILY_SAMPLES[fam[1]]], \
                f"{where}: not a sample of the family above it ({fam[0]} {fam[1]})"
    assert text.endswith("\n") and seen, "empty or unterminated exposition"


def check_text(text):
    """promtool and prometheus_client over one exposition; returns {family name: family}."""
    check_grouping(text)
    pt = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True,
                        timeout=60)
    problems = [l for l in (pt.stdout + pt.stderr).splitlines() if l.strip()]
    bad = [p for p in problems if not any(a.match(p) for a in ALLOWED_LINT)]
    assert not bad, "promtool check metrics:\n" + "\n".join(bad)
    assert pt.returncode in (0, 3), pt  # 3 = lint problems only (all allowed above)
    fams = {}
    for f in text_string_to_metric_families(text):
        assert f.name not in fams, f"family {f.name} twice"
        fams[f.name] = f
        assert f.documentation, f"{f.name}: no HELP"
        assert f.type in ("counter", "gauge", "histogram", "summary"), f"{f.name}: type {f.type}"
        assert f.samples, f"{f.name}: no samples (a TYPE line its samples do not match)"
        if f.type == "counter":
            assert not f.name.endswith("_total"), f.name
            assert all(s.name == f.name + "_total" for s in f.samples), f.samples
        if f.type == "gauge":
            assert not f.name.endswith("_total"), f"gauge {f.name} named _total"
        if f.type == "histogram":
            check_histogram(f)
    return fams


def check_histogram(f):
    series = {}
    for s in f.samples:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        series.setdefault(key, {"buckets": [], "count": None, "sum": None})
        if s.name == f.name + "_bucket":
            series[key]["buckets"].append((float(s.labels["le"]), s.value))
        elif s.name == f.name + "_count":
            series[key]["count"] = s.value
        elif s.name == f.name + "_sum":
            series[key]["sum"] = s.value
        else:
            raise AssertionError(f"{f.name}: stray sample {s.name}")
    for key, h in series.items():
        b = h["buckets"]
        assert b and b[-1][0] == float("inf"), f"{f.name}{key}: no +Inf bucket"
        assert [x[0] for x in b] == sorted(x[0] for x in b), f"{f.name}: le not ascending"
        assert all(b[i][1] <= b[i + 1][1] for i in range(len(b) - 1)), f"{f.name}: not cumulative"
        assert h["count"] == b[-1][1], f"{f.name}{key}: _count != +Inf bucket"
        assert h["sum"] is not None, f"{f.name}{key}: no _sum"


def one(fams, family, suffix="", **labels):
    """The value of family's single sample named family+suffix with these labels."""
    got = [s.value for s in fams[family].samples if s.name == family + suffix
           and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(got) == 1, (family, suffix, labels, got)
    return got[0]


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def make_requests(url):
    """The PROMPTS, one completion each (n=1, temperature 0): their usage."""
    usages = []
    for prompt, mt in zip(PROMPTS, MAX_TOKENS):
        r = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=mt, temperature=0)
        usages.append(r.usage)
    return usages


def check_request_histograms(fams, usages, side):
    n = len(usages)
    L = dict(model_name="tiny", engine="0")
    for h in VLLM_HISTOGRAMS:
        assert one(fams, h, "_count", **L) == n, f"{side}: {h}_count"
    assert one(fams, "vllm:request_prompt_tokens", "_sum", **L) == sum(u.prompt_tokens for u in usages)
    if side != "P":  # P runs each request for one token (max_tokens 1); D and colocated as asked
        assert one(fams, "vllm:request_generation_tokens", "_sum", **L) == sum(u.completion_tokens for u in usages)
        assert one(fams, "vllm:request_params_max_tokens", "_sum", **L) == sum(MAX_TOKENS)
        assert one(fams, "vllm:request_decode_time_seconds", "_sum", **L) > 0
    assert one(fams, "vllm:request_params_n", "_sum", **L) == n
    assert one(fams, "vllm:request_params_n", "_bucket", le="1.0", **L) == n
    # vLLM's phases: inference = prefill + decode (one timeline); all within e2e
    inf = one(fams, "vllm:request_inference_time_seconds", "_sum", **L)
    pre = one(fams, "vllm:request_prefill_time_seconds", "_sum", **L)
    dec = one(fams, "vllm:request_decode_time_seconds", "_sum", **L)
    que = one(fams, "vllm:request_queue_time_seconds", "_sum", **L)
    e2e = one(fams, "vllm:e2e_request_latency_seconds", "_sum", **L)
    assert inf == pytest.approx(pre + dec, abs=1e-6) and pre > 0 and que >= 0
    assert que + inf <= e2e + 1e-3, (que, inf, e2e)
    # the token-count buckets are vLLM's 1-2-5 up to max_model_len (1024)
    les = [float(s.labels["le"]) for s in fams["vllm:request_prompt_tokens"].samples
           if s.name.endswith("_bucket")]
    assert les == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, float("inf")]
    les = [float(s.labels["le"]) for s in fams["vllm:request_queue_time_seconds"].samples
           if s.name.endswith("_bucket")]
    assert les == LATENCY_BUCKETS + [float("inf")]
    # tokens per engine step add up to the token counters, one observation per step; on D a
    # first token handed over by P (docs/connector.md) is generated without a step
    handed = sum(x.value for x in fams.get("disagg:kv_first_token_handoffs", type("", (), {"samples": []})).samples
                 if x.name == "disagg:kv_first_token_handoffs_total" and x.labels.get("outcome") == "used")
    if side == "D":
        assert handed == n, (side, handed)
    assert one(fams, "vllm:iteration_tokens_total", "_sum", **L) == (
        one(fams, "vllm:prompt_tokens", "_total", **L) + one(fams, "vllm:generation_tokens", "_total", **L)
        - handed)
    assert one(fams, "vllm:iteration_tokens_total", "_count", **L) == one(fams, "disagg:engine_steps", "_total", **L)
    assert one(fams, "vllm:request_success", "_total", finished_reason="length", **L) + one(
        fams, "vllm:request_success", "_total", finished_reason="stop", **L) == n
    info = [s for s in fams["vllm:cache_config_info"].samples]
    assert len(info) == 1 and info[0].value == 1, info
    assert info[0].labels["engine"] == "0" and info[0].labels["block_size"] == "16", info[0].labels
    assert int(info[0].labels["num_gpu_blocks"]) > 0, info[0].labels
    for f in fams.values():  # vLLM's label set on every vllm: series
        if f.name.startswith("vllm:") and f.name != "vllm:cache_config_info":
            assert all(s.labels.get("model_name") == "tiny" and s.labels.get("engine") == "0"
                       for s in f.samples), f.name


@pytest.fixture(scope="module")
def colocated():
    s = Server(*COMMON)
    yield s
    assert s.stop() == 0, s.logs()


@pytest.fixture(scope="module")
def stack():
    p = Prefill()
    d = Server(*COMMON, "--kv-transfer-config", consumer_config())
    px = ProxyProc([p], [d])
    px.wait_ready(30)
    yield p, d, px
    assert px.stop() == 0, px.output()
    assert d.stop() == 0, d.logs()
    assert p.server.stop() == 0, p.server.logs()


@pytest.fixture(scope="module")
def scraped(colocated, stack):
    """Requests to the colocated server and through the proxy, then every endpoint's text."""
    p, d, px = stack
    u_col = make_requests(colocated.url)
    u_pd = make_requests(px.url)
    texts = {"colocated": scrape(colocated.url), "P": scrape(p.url), "D": scrape(d.url),
             "proxy": scrape(px.url)}
    return texts, u_col, u_pd


@pytest.mark.parametrize("side", ["colocated", "P", "D", "proxy"])
def test_promtool_and_prometheus_client(scraped, side):
    texts, _, _ = scraped
    fams = check_text(texts[side])
    if side != "proxy":
        assert fams["vllm:prompt_tokens"].type == "counter"
        assert fams["vllm:request_success"].type == "counter"
    if side in ("P", "D"):
        for c in ("disagg:kv_transfers", "disagg:kv_transfer_bytes", "disagg:kv_auth_rejected",
                  "disagg:kv_pending_pulls_evicted"):
            assert fams[c].type == "counter", c
        assert fams["disagg:kv_load_seconds"].type == "histogram"
    if side == "proxy":
        assert fams["disagg_proxy_requests"].type == "counter"


def test_request_histograms_colocated(scraped):
    texts, u_col, _ = scraped
    check_request_histograms(check_text(texts["colocated"]), u_col, "colocated")


def test_request_histograms_pd(scraped):
    texts, _, u_pd = scraped
    check_request_histograms(check_text(texts["P"]), u_pd, "P")
    check_request_histograms(check_text(texts["D"]), u_pd, "D")
    d = check_text(texts["D"])
    assert one(d, "disagg:kv_transfers", "_total", side="consumer", result="ok") == len(u_pd)
    px = check_text(texts["proxy"])
    assert one(px, "disagg_proxy_requests", "_total", endpoint="/v1/completions") == len(u_pd)
    assert one(px, "disagg_proxy_phase_seconds", "_count", phase="total") == len(u_pd)


def check_prompt_sources(fams, usages, side):
    """vLLM's P/D series, with vLLM's names, labels and types:
    vllm:prompt_tokens_by_source_total{source=local_compute|local_cache_hit|external_kv_transfer}
    adds up to the prompts; vllm:external_prefix_cache_queries/_hits_total count D's
    remote-prefill prompt tokens asked of / received from P; the histogram
    vllm:request_prefill_kv_computed_tokens observes each request's computed prompt tokens."""
    L = dict(model_name="tiny", engine="0")
    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    src = {s.labels["source"]: s.value for s in fams["vllm:prompt_tokens_by_source"].samples}
    assert set(src) == {"local_compute", "local_cache_hit", "external_kv_transfer"}, src
    for f, t in (("vllm:prompt_tokens_by_source", "counter"), ("vllm:prompt_tokens_cached", "counter"),
                 ("vllm:external_prefix_cache_queries", "counter"),
                 ("vllm:external_prefix_cache_hits", "counter"),
                 ("vllm:request_prefill_kv_computed_tokens", "histogram")):
        assert fams[f].type == t, (f, fams[f].type)
    assert sum(src.values()) == prompt, (side, src, prompt)
    computed = one(fams, "vllm:request_prefill_kv_computed_tokens", "_sum", **L)
    assert one(fams, "vllm:request_prefill_kv_computed_tokens", "_count", **L) == len(usages)
    assert computed == src["local_compute"]
    queries = one(fams, "vllm:external_prefix_cache_queries", "_total", **L)
    hits = one(fams, "vllm:external_prefix_cache_hits", "_total", **L)
    if side == "D":  # every prompt token came from P or D's own prefix cache; none computed
        assert src["external_kv_transfer"] == prompt - cached > 0, (src, prompt, cached)
        assert src["local_cache_hit"] == cached and src["local_compute"] == 0, src
        assert queries == prompt and hits == src["external_kv_transfer"], (queries, hits)
        assert one(fams, "vllm:request_prefill_kv_computed_tokens", "_bucket", le="1.0", **L) == len(usages)
    else:
        assert src["external_kv_transfer"] == 0 and queries == 0 and hits == 0, (side, src)
        assert src["local_compute"] == prompt - cached > 0 and src["local_cache_hit"] == cached, src
    assert one(fams, "vllm:prompt_tokens_cached", "_total", **L) == (
        src["local_cache_hit"] + src["external_kv_transfer"])
    les = [float(s.labels["le"]) for s in fams["vllm:request_prefill_kv_computed_tokens"].samples
           if s.name.endswith("_bucket")]
    assert les == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, float("inf")]


def test_prompt_token_sources(scraped):
    texts, u_col, u_pd = scraped
    check_prompt_sources(check_text(texts["colocated"]), u_col, "colocated")
    check_prompt_sources(check_text(texts["P"]), u_pd, "P")
    check_prompt_sources(check_text(texts["D"]), u_pd, "D")


def test_label_values_escaped(tmp_path):
    """A served model name with a quote, a backslash and a newline stays one label value."""
    name = 'ti"ny\\x\ny'
    s = Server(*COMMON, name=name)
    try:
        fams = check_text(scrape(s.url))
        assert one(fams, "vllm:num_requests_running", model_name=name) == 0
    finally:
        assert s.stop() == 0, s.logs()


def test_grafana_dashboard_uses_exposed_names(scraped):
    """tools/grafana/disagg.json is a dashboard whose every query names series that
    the endpoints really expose (sample names as scraped)."""
    texts, _, _ = scraped
    exposed = set()
    for t in texts.values():
        for f in text_string_to_metric_families(t):
            exposed.update(s.name for s in f.samples)
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["panels"], "no panels"
    exprs = []

    def walk(o):
        if isinstance(o, dict):
            if "expr" in o:
                exprs.append(o["expr"])
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
    walk(dash)
    assert len(exprs) >= 10, exprs
    used = set()
    for e in exprs:
        used.update(re.findall(r"\b((?:vllm|disagg):[A-Za-z0-9_:]+|disagg_proxy_[A-Za-z0-9_]+)", e))
    missing = sorted(used - exposed)
    assert not missing, f"dashboard names no endpoint exposes: {missing}"
    for role in ("prefill", "decode", "proxy"):  # a row per process kind
        assert any(role in json.dumps(p).lower() for p in dash["panels"]), role


def test_proxy_backend_label_escaped():
    """A backend host with a quote and a backslash (unresolvable, so never in rotation)
    stays one escaped label value of the proxy's per-backend series."""
    from types import SimpleNamespace
    bad = SimpleNamespace(url='http://a"b\\c:1', bootstrap_port=2)
    px = ProxyProc([bad], [SimpleNamespace(url="http://127.0.0.1:3")])
    try:
        fams = check_text(scrape(px.url))
        assert one(fams, "disagg_proxy_backend_healthy", role="prefill", backend='http://a"b\\c:1') == 0
    finally:
        assert px.stop() == 0, px.output()


def test_connector_engine_id_label_escaped():
    """kv-transfer-config accepts an engine_id with a quote and a backslash; the
    connector's disagg:kv_transfer_info keeps it one escaped label value."""
    from server_harness import free_port
    eid = 'e"x\\y'
    s = Server(*COMMON, "--kv-transfer-config", producer_config(engine_id=eid),
               env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())})
    try:
        fams = check_text(scrape(s.url))
        assert one(fams, "disagg:kv_transfer_info", engine_id=eid, role="kv_producer") == 1
    finally:
        assert s.stop() == 0, s.logs()


def test_discovery_proxy_metrics(etcd_factory, tmp_path):
    """`disagg proxy --discovery`'s own families (disagg_proxy_discovery_*, the published load
    of each instance) pass the same checks; the per-instance label is backend, as on every
    other disagg_proxy_backend_* series."""
    from test_discovery import PREFIX, Instance, Proxy, wait_for
    url = etcd_factory(1).url(PREFIX)
    p = Instance(url, "prefill", logdir=tmp_path)
    d = Instance(url, "decode", logdir=tmp_path)
    px = Proxy(url, logdir=tmp_path)
    try:
        keys = [f'disagg_proxy_backend_published_load{{role="{i.role}",backend="{i.url}"}}'
                for i in (p, d)]
        wait_for(lambda: all(k in px.metrics() for k in keys), 10, "the published loads")
        fams = check_text(scrape(px.url))
        for f, t in (("disagg_proxy_discovery_connected", "gauge"),
                     ("disagg_proxy_discovery_instances", "gauge"),
                     ("disagg_proxy_discovery_changes", "counter"),
                     ("disagg_proxy_discovery_events", "counter"),
                     ("disagg_proxy_discovery_errors", "counter"),
                     ("disagg_proxy_discovery_bad_records", "counter"),
                     ("disagg_proxy_backend_published_load", "gauge")):
            assert fams[f].type == t, (f, fams[f].type)
        assert one(fams, "disagg_proxy_discovery_connected") == 1
        assert one(fams, "disagg_proxy_discovery_instances", role="decode") == 1
        assert one(fams, "disagg_proxy_discovery_changes", "_total", change="joined") == 2
        load = fams["disagg_proxy_backend_published_load"].samples
        assert [s.labels for s in load] == [{"role": "prefill", "backend": p.url},
                                            {"role": "decode", "backend": d.url}], load
    finally:
        assert px.stop() == 0, px.logs()
        assert d.stop() == 0, d.logs()
        assert p.stop() == 0, p.logs()


def test_n_observed_once_per_prompt():
    """n=3 over two prompts: vllm:request_params_n once per prompt (value 3), the
    per-request histograms once per choice (6 engine requests), as vLLM's parent and
    child requests."""
    s = Server(*COMMON)
    try:
        r = client(s.url).completions.create(model="tiny", prompt=PROMPTS[:2], n=3, max_tokens=4,
                                             temperature=0.8, seed=1)
        fams = check_text(scrape(s.url))
        L = dict(model_name="tiny", engine="0")
        assert one(fams, "vllm:request_params_n", "_count", **L) == 2
        assert one(fams, "vllm:request_params_n", "_sum", **L) == 6
        assert one(fams, "vllm:request_params_n", "_bucket", le="2.0", **L) == 0
        assert one(fams, "vllm:request_params_n", "_bucket", le="5.0", **L) == 2
        assert one(fams, "vllm:request_prompt_tokens", "_count", **L) == 6
        assert one(fams, "vllm:request_prompt_tokens", "_sum", **L) == 3 * r.usage.prompt_tokens
        assert one(fams, "vllm:request_generation_tokens", "_sum", **L) == r.usage.completion_tokens
        assert one(fams, "vllm:request_params_max_tokens", "_sum", **L) == 6 * 4
    finally:
        assert s.stop() == 0, s.logs()
