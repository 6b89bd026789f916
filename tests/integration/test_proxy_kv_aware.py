"""`disagg proxy --policy kv_aware`: two real kv_producer `disagg serve` instances publishing
their KV events (--kv-events-config) and one kv_consumer behind the proxy.  The proxy
subscribes to each prefill's events, indexes the blocks each one holds, tokenizes every
request with the instances' tokenizer and chat template, and sends the prefill to the
instance holding the longest prefix of the prompt.  Checked against what the instances
themselves report: which prefill served a request (its vllm:request_success), its prefix
cache hits, and its published event batches (disagg:kv_events_batches)."""
import json
import subprocess
import time

import pytest
import requests

import server_harness
from proxy_fixtures import ProxyProc
from server_harness import BIN, MODEL, Server, free_port, on_gpu
from test_pd import consumer_config, producer_config

BS = 16
BB = 49152 // (2 if on_gpu() else 1)  # one KV block of the tiny model (f32 CPU, bf16 GPU)
TEXT = ("The state of the Union is strong, and the work of the Congress is before us. "
        "We meet in a season of change, and the people ask that we keep faith with them. ")


class KVPrefill:
    """A kv_producer publishing its KV events on ZMQ (PUB and replay ROUTER bound)."""

    def __init__(self, blocks=None, port=None, ports=None):
        self.bootstrap_port, self.kv_port, self.replay_port = ports or (free_port(), free_port(),
                                                                          free_port())
        self.blocks = blocks
        ev = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{self.kv_port}",
              "replay_endpoint": f"tcp://*:{self.replay_port}"}
        mem = str(blocks * BB) if blocks else "96M"
        args = ("--max-model-len", "512", "--block-size", str(BS), "--kv-cache-memory", mem,
                "--kv-transfer-config", producer_config(), "--kv-events-config", json.dumps(ev))
        env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap_port)}
        if port:  # a restart on the same URL
            saved = server_harness.free_port
            server_harness.free_port = lambda: port
            try:
                self.server = Server(*args, env=env)
            finally:
                server_harness.free_port = saved
        else:
            self.server = Server(*args, env=env)
        self.url = self.server.url

    def published(self):
        return self.server.metrics().get('disagg:kv_events_batches_total{outcome="published"}', 0)

    def served(self):
        return self.server.metric("vllm:request_success_total")


def kv_flags(prefills, replay=True):
    out = ["--policy", "kv_aware", "--tokenizer", str(MODEL)]
    for p in prefills:
        out += ["--kv-events-endpoint", f"{p.url}=tcp://127.0.0.1:{p.kv_port}"]
        if replay:
            out += ["--kv-events-replay-endpoint", f"{p.url}=tcp://127.0.0.1:{p.replay_port}"]
    return out


@pytest.fixture(scope="module")
def stack():
    p0 = KVPrefill()
    p1 = KVPrefill(blocks=40)  # small: the eviction test fills it
    d = Server("--max-model-len", "512", "--block-size", str(BS), "--kv-cache-memory", "96M",
               "--kv-transfer-config", consumer_config())
    prefills = [p0, p1]
    px = ProxyProc(prefills, [d], extra=kv_flags(prefills))
    px.wait_ready(30)
    yield prefills, d, px
    px.stop()
    d.stop()
    # the list, not p0 and p1: test_restarted_prefill_starts_with_an_empty_index replaces
    # prefills[0] with a restarted instance, which must be stopped too
    for p in prefills:
        p.server.stop()


def series(px, name, p, medium=None):
    lab = f'backend="{p.url}"' + (f',medium="{medium}"' if medium else "")
    return px.metrics().get(f"{name}{{{lab}}}", 0)


def wait_synced(px, prefills, timeout=15):
    """Until the proxy applied every batch each prefill published."""
    deadline = time.monotonic() + timeout
    while True:
        got = [(series(px, "disagg_proxy_kv_event_batches_total", p), p.published())
               for p in prefills]
        if all(a == b for a, b in got):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"proxy batches vs published: {got}\n{px.output()[-3000:]}")
        time.sleep(0.05)


def results(px):
    m = px.metrics()
    return {r: m.get(f'disagg_proxy_kv_aware_requests_total{{result="{r}"}}', 0)
            for r in ("hit", "load", "miss", "no_tokens")}


def served_by(prefills, fn):
    """(index of the prefill that served the request fn sends, fn's answer)."""
    before = [p.served() for p in prefills]
    out = fn()
    after = [p.served() for p in prefills]
    who = [i for i in range(len(prefills)) if after[i] > before[i]]
    assert len(who) == 1, (before, after)
    return who[0], out


def chat(px, messages):
    r = requests.post(px.url + "/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": messages, "max_tokens": 8,
                            "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def completion(url, prompt, max_tokens=4):
    r = requests.post(url + "/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_second_turn_goes_to_the_prefill_holding_its_prefix(stack):
    ps, _, px = stack
    convs = [[{"role": "system", "content": f"Conversation {i}: you keep the minutes."},
              {"role": "user", "content": f"Summarise, point {i}: " + TEXT}] for i in range(4)]
    first = []
    for c in convs:  # no prefix anywhere: least_loaded spreads them over both prefills
        who, out = served_by(ps, lambda: chat(px, c))
        first.append(who)
        c += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
              {"role": "user", "content": "And the next point? " + TEXT}]
    assert set(first) == {0, 1}, first  # otherwise the test would prove nothing
    assert results(px)["miss"] >= 4
    wait_synced(px, ps)
    for p in ps:
        assert series(px, "disagg_proxy_kv_index_blocks", p, "GPU") > 0
    hits0 = results(px)["hit"]
    for i, c in enumerate(convs):
        h0 = [p.server.metric("vllm:prefix_cache_hits_total") for p in ps]
        who, _ = served_by(ps, lambda: chat(px, c))
        assert who == first[i], f"conversation {i}: turn 1 on prefill {first[i]}, turn 2 on {who}"
        # that prefill reused the first turn's blocks (at least the first turn's prompt minus
        # its last partial block)
        assert ps[who].server.metric("vllm:prefix_cache_hits_total") - h0[who] >= 3 * BS
        wait_synced(px, ps)
    assert results(px)["hit"] - hits0 == 4
    m = px.metrics()
    assert m["disagg_proxy_kv_aware_cached_tokens_total"] >= 4 * 3 * BS
    assert m["disagg_proxy_kv_aware_prompt_tokens_total"] > m["disagg_proxy_kv_aware_cached_tokens_total"]


def test_index_follows_eviction(stack):
    ps, _, px = stack
    p1 = ps[1]
    prompt = "Eviction probe. " + TEXT
    completion(p1.url, prompt)  # straight to prefill 1 (colocated): its cache holds the prompt
    wait_synced(px, ps)
    r0 = results(px)
    who, _ = served_by(ps, lambda: completion(px.url, prompt + " More."))
    assert who == 1 and results(px)["hit"] == r0["hit"] + 1
    # other prompts evict it: prefill 1 holds 40 blocks
    for i in range(12):
        completion(p1.url, f"Filler {i}: " + TEXT * 3, max_tokens=1)
    wait_synced(px, ps)
    assert p1.server.metric("disagg:kv_cache_evicted_blocks_total") > 0
    assert series(px, "disagg_proxy_kv_index_blocks", p1, "GPU") <= 40
    r1 = results(px)
    completion(px.url, prompt + " Once more.")  # nobody holds its prefix any more
    assert results(px)["miss"] == r1["miss"] + 1, results(px)


def test_reset_prefix_cache_drops_the_index(stack):
    ps, _, px = stack
    p0 = ps[0]
    completion(p0.url, "Reset probe. " + TEXT)
    wait_synced(px, ps)
    assert series(px, "disagg_proxy_kv_index_blocks", p0, "GPU") > 0
    drops = series(px, "disagg_proxy_kv_index_drops_total", p0)
    assert requests.post(p0.url + "/reset_prefix_cache", timeout=10).status_code == 200
    wait_synced(px, ps)
    assert series(px, "disagg_proxy_kv_index_blocks", p0, "GPU") == 0
    assert series(px, "disagg_proxy_kv_index_drops_total", p0) == drops + 1


def test_a_late_proxy_replays_what_it_missed(stack):
    """A proxy started after the instances published: its first batch shows a gap from 0,
    which the replay endpoints fill, so it knows what the first proxy knows."""
    ps, d, px = stack
    late = ProxyProc(ps, [d], extra=kv_flags(ps))
    try:
        late.wait_ready(30)
        # the gap shows at the next batch a prefill publishes (the SUB connects
        # asynchronously: a batch published before it joined is simply missed)
        deadline = time.monotonic() + 15
        while any(series(late, "disagg_proxy_kv_event_batches_total", p) == 0 for p in ps):
            assert time.monotonic() < deadline, late.output()[-3000:]
            for i, p in enumerate(ps):
                completion(p.url, f"Wake {i} " + str(time.monotonic()), max_tokens=1)
            time.sleep(0.1)
        wait_synced(late, ps)
        wait_synced(px, ps)
        for p in ps:
            assert series(late, "disagg_proxy_kv_event_replays_total", p) >= 1
            assert (series(late, "disagg_proxy_kv_index_blocks", p, "GPU") ==
                    series(px, "disagg_proxy_kv_index_blocks", p, "GPU"))
    finally:
        late.stop()
    # without a replay endpoint the gap cannot be filled: counted, the index starts over
    blind = ProxyProc(ps, [d], extra=kv_flags(ps, replay=False))
    try:
        blind.wait_ready(30)
        p0 = ps[0]
        deadline = time.monotonic() + 15
        while series(blind, "disagg_proxy_kv_event_batches_total", p0) == 0:
            assert time.monotonic() < deadline, blind.output()[-3000:]
            completion(p0.url, "Blind " + str(time.monotonic()), max_tokens=1)
            time.sleep(0.1)
        assert series(blind, "disagg_proxy_kv_event_gaps_total", p0) >= 1
        assert series(blind, "disagg_proxy_kv_event_replays_total", p0) == 0
        assert series(blind, "disagg_proxy_kv_index_drops_total", p0) >= 1
    finally:
        blind.stop()


def test_restarted_prefill_starts_with_an_empty_index(stack):
    ps, _, px = stack
    p0 = ps[0]
    prompt = "Restart probe. " + TEXT
    completion(p0.url, prompt)
    wait_synced(px, ps)
    assert series(px, "disagg_proxy_kv_index_blocks", p0, "GPU") > 0
    drops = series(px, "disagg_proxy_kv_index_drops_total", p0)
    p0.server.stop()
    # down for several probe periods (0.1 s); a restart quicker than one is seen too (every
    # probe re-reads the engine table: test_proxy_pd.py, test_proxy.py)
    time.sleep(0.5)
    ps[0] = KVPrefill(port=p0.server.port,
                      ports=(p0.bootstrap_port, p0.kv_port, p0.replay_port))
    # the proxy sees a new engine id (and, once it publishes, a seq from 0 again)
    deadline = time.monotonic() + 20
    while series(px, "disagg_proxy_kv_index_drops_total", p0) == drops:
        assert time.monotonic() < deadline, px.output()[-3000:]
        time.sleep(0.1)
    assert series(px, "disagg_proxy_kv_index_blocks", p0, "GPU") == 0
    px.wait_ready(30)
    r = results(px)
    completion(px.url, prompt + " Again.")  # the new instance holds nothing of it
    assert results(px)["miss"] == r["miss"] + 1


@pytest.mark.parametrize("args,msg", [
    (["--policy", "kv_aware"], "--policy kv_aware needs --tokenizer"),
    (["--kv-events-endpoint", "http://127.0.0.1:1=tcp://127.0.0.1:2"],
     "--kv-events-endpoint is only used by --policy kv_aware"),
    (["--policy", "kv_aware", "--tokenizer", str(MODEL), "--kv-events-endpoint", "tcp://h:1"],
     "give PREFILL_URL=tcp://HOST:PORT"),
    (["--policy", "kv_aware", "--tokenizer", str(MODEL), "--kv-events-endpoint",
      "http://127.0.0.1:1=http://127.0.0.1:5557"], "give PREFILL_URL=tcp://HOST:PORT"),
    (["--policy", "kv_aware", "--tokenizer", str(MODEL), "--kv-events-endpoint",
      "http://127.0.0.1:9=tcp://127.0.0.1:5557"], "is not one of the --prefill URLs"),
    (["--policy", "kv_aware", "--tokenizer", "/nonexistent/tok"], "--tokenizer /nonexistent/tok"),
    (["--policy", "kv_aware", "--tokenizer", str(MODEL), "--chat-template", "/no/such.jinja"],
     "looks like a file path"),
    (["--policy", "kv_aware", "--tokenizer", str(MODEL), "--kv-aware-load-weight", "-1"],
     "--kv-aware-load-weight"),
    (["--policy", "kv_awar"], "use least_loaded, round_robin, prefix, p2c or kv_aware"),
])
def test_bad_kv_aware_flags_refused(args, msg):
    r = subprocess.run([BIN, "proxy", "--prefill", "http://127.0.0.1:1", "--decode",
                        "http://127.0.0.1:2", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr, r.stderr
