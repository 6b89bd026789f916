"""The pool fetch (docs/kv_pool.md): an instance that lacks a prefix another instance holds
pulls that prefix's KV over the transfer engine (kv_transfer_params.pool_source) instead of
computing it.  Real processes: two kv_both `disagg serve` instances A and B (tcp transport),
and for the routed case a kv_consumer D behind `disagg proxy --policy kv_aware
--kv-pool-fetch`.  Checked: the prefix is fetched (B's disagg:kv_pool_fetch_* and
vllm:external_prefix_cache_hits, A's served pins) and the answer (greedy tokens, logprobs,
top-3 logprobs) equals B computing the whole prompt; a holder that evicted the prefix, a
dead one and a stopped one all end in the prompt computed on B with the same answer; bad
pool_source values are refused with a 400 naming the field; no KV block stays in use or
pinned on either side afterwards."""
import json
import os
import signal
import subprocess
import threading
import time

import pytest
import requests

from proxy_fixtures import ProxyProc
from server_harness import BIN, MODEL, Server, free_port, on_gpu

BS = 16
BB = 49152 // (2 if on_gpu() else 1)  # one KV block of the tiny model (f32 CPU, bf16 GPU)
# on a GPU (DISAGG_TEST_DEVICE=cuda, scripts/gpu_check.sh ONLY=poolfetch) the batch-invariant
# mode: the rest of a prompt computed after a fetched prefix is then bit-equal to the whole
# prompt computed at once (the fast mode's attention splits depend on the chunk)
EXACT = ("--batch-invariant",) if on_gpu() else ()
TEXT = ("The state of the Union is strong, and the work of the Congress is before us. "
        "We meet in a season of change, and the people ask that we keep faith with them. ")


def both_config(engine_id, mode="always"):
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_both",
                       "engine_id": engine_id,
                       "kv_connector_extra_config": {"mooncake_protocol": "tcp",
                                                     "pool_fetch": mode}})


class PoolInstance:
    """A kv_both instance with a known engine id and bootstrap port, publishing KV events."""

    def __init__(self, engine_id, *extra, kv_memory="96M", max_len=1024, mode="always"):
        self.engine_id = engine_id
        self.bootstrap_port, self.kv_port = free_port(), free_port()
        ev = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{self.kv_port}"}
        self.server = Server("--max-model-len", str(max_len), "--block-size", str(BS),
                             "--kv-cache-memory", kv_memory, "--kv-transfer-config",
                             both_config(engine_id, mode), "--kv-events-config", json.dumps(ev),
                             *EXACT, *extra,
                             env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap_port)})
        self.url = self.server.url
        self.bootstrap = f"http://127.0.0.1:{self.bootstrap_port}"

    def m(self, name):
        return self.server.metric(name)

    def source(self, n_tokens):
        return {"remote_engine_id": self.engine_id, "remote_bootstrap_addr": self.bootstrap,
                "num_tokens": n_tokens}


@pytest.fixture(scope="module")
def pair():
    a = PoolInstance("pool-a")
    try:
        b = PoolInstance("pool-b")
    except Exception:
        a.server.stop()
        raise
    yield a, b
    rcs = [x.server.stop() for x in (a, b)]
    assert rcs == [0, 0], f"exit statuses {rcs} (a sanitizer report?): {b.server.logs()}"


def tokens(inst, text):
    r = requests.post(inst.url + "/tokenize", json={"model": "tiny", "prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def complete(url, prompt, max_tokens=8, kv=None, timeout=60):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 3}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return requests.post(url + "/v1/completions", json=body, timeout=timeout)


def answer(r):
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]


def recompute(b, prompt):
    """B's answer with the whole prompt computed on B."""
    assert requests.post(b.url + "/reset_prefix_cache", timeout=10).status_code == 200
    return answer(complete(b.url, prompt))


def settle(*insts, timeout=10):
    """Until no KV block is in use or pinned on any of them (releases are asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        srv = [getattr(x, "server", x) for x in insts]
        got = [(s.metric("disagg:kv_blocks_used"), s.metric("disagg:kv_transfer_kept_requests"))
               for s in srv]
        if all(u == 0 and k == 0 for u, k in got):
            return
        assert time.monotonic() < deadline, f"blocks used / kept: {got}"
        time.sleep(0.05)


def fallbacks(b, reason):
    return b.server.metrics().get(f'disagg:kv_pool_fetch_fallbacks_total{{reason="{reason}"}}', 0)


def prompt_on(a, b, tag):
    """A prompt of about 200 tokens whose first 192 (12 blocks) A holds; B holds none."""
    ids = tokens(a, f"{tag}: " + TEXT * 6)
    assert len(ids) > 12 * BS
    answer(complete(a.url, ids[:12 * BS], max_tokens=1))
    assert requests.post(b.url + "/reset_prefix_cache", timeout=10).status_code == 200
    return ids


def test_prefix_fetched_equals_recompute(pair):
    a, b = pair
    ids = prompt_on(a, b, "Fetched")
    m0 = b.server.metrics()
    served0 = a.server.metrics().get('disagg:kv_pool_serve_requests_total{outcome="served"}', 0)
    got = answer(complete(b.url, ids, kv={"pool_source": a.source(12 * BS)}))
    m1 = b.server.metrics()
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
    assert d["disagg:kv_pool_fetch_requests_total"] == 1
    assert d["disagg:kv_pool_fetch_blocks_total"] == 12
    assert d["disagg:kv_pool_fetch_bytes_total"] > 0
    assert d["disagg:kv_pool_fetch_seconds_total"] > 0
    assert sum(v for k, v in d.items()
               if k.startswith("vllm:external_prefix_cache_hits_total")) == 12 * BS
    assert sum(v for k, v in d.items()
               if k.startswith("disagg:kv_pool_fetch_fallbacks_total")) == 0
    assert a.server.metrics()['disagg:kv_pool_serve_requests_total{outcome="served"}'] == served0 + 1
    settle(a, b)
    assert got == recompute(b, ids)
    settle(a, b)


def test_prefix_in_the_holders_host_tier_is_fetched(pair):
    """A holder whose device cache (40 blocks) evicted the prefix into its host tier: it copies
    the blocks back into device blocks to pin them, and the fetch succeeds."""
    _, b = pair
    c = PoolInstance("pool-c", "--kv-offloading-size", "0.05", kv_memory=str(40 * BB),
                     max_len=512)
    try:
        ids = prompt_on(c, b, "Tiered")
        for i in range(6):  # 6 x 13 blocks through a 40-block cache: the prefix goes to the tier
            answer(complete(c.url, tokens(c, f"Filler {i}: " + TEXT * 6)[:13 * BS], max_tokens=1))
        assert c.m("disagg:kv_cache_evicted_blocks_total") >= 12
        loaded0 = c.m("disagg:kv_offload_blocks_loaded_total")
        fetched0 = b.m("disagg:kv_pool_fetch_requests_total")
        got = answer(complete(b.url, ids, kv={"pool_source": c.source(12 * BS)}))
        assert b.m("disagg:kv_pool_fetch_requests_total") == fetched0 + 1
        assert c.m("disagg:kv_offload_blocks_loaded_total") - loaded0 >= 1
        settle(b, c)
        assert got == recompute(b, ids)
        settle(b, c)
    finally:
        assert c.server.stop() == 0, c.server.logs()


def test_auto_mode_fetches_before_anything_is_measured(pair):
    """pool_fetch "auto" weighs measured transfer and prefill times; before either was
    measured it fetches (the fetch measures); "never" computes.  Both count what they did."""
    a, _ = pair
    e = PoolInstance("pool-e", mode="auto")
    n = PoolInstance("pool-n", mode="never")
    try:
        ids = prompt_on(a, e, "Auto")
        got = answer(complete(e.url, ids, kv={"pool_source": a.source(12 * BS)}))
        assert e.m("disagg:kv_pool_fetch_requests_total") == 1
        assert got == answer(complete(n.url, ids, kv={"pool_source": a.source(12 * BS)}))
        m = n.server.metrics()
        assert m["disagg:kv_pool_fetch_requests_total"] == 0
        assert m['disagg:kv_pool_fetch_skipped_total{reason="pool_fetch_never"}'] == 1
        settle(a, e, n)
    finally:
        rcs = [e.server.stop(), n.server.stop()]
    assert rcs == [0, 0], rcs


def test_prompt_logprobs_request_is_not_fetched(pair):
    """prompt_logprobs need every prompt position computed: no pull, the same answer."""
    a, b = pair
    ids = prompt_on(a, b, "Prompt logprobs")
    f0 = b.m("disagg:kv_pool_fetch_requests_total")
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 1, "kv_transfer_params": {"pool_source": a.source(12 * BS)}}
    r = requests.post(b.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert b.m("disagg:kv_pool_fetch_requests_total") == f0
    settle(a, b)


def test_holder_evicted_recomputes(pair):
    a, b = pair
    ids = prompt_on(a, b, "Evicted")
    assert requests.post(a.url + "/reset_prefix_cache", timeout=10).status_code == 200
    f0, n0 = fallbacks(b, "evicted"), a.m("disagg:kv_pool_serve_requests_total")
    fetched0 = b.m("disagg:kv_pool_fetch_requests_total")
    got = answer(complete(b.url, ids, kv={"pool_source": a.source(12 * BS)}))
    assert fallbacks(b, "evicted") == f0 + 1
    assert b.m("disagg:kv_pool_fetch_requests_total") == fetched0
    assert a.server.metrics()['disagg:kv_pool_serve_requests_total{outcome="not_held"}'] >= 1
    assert a.m("disagg:kv_pool_serve_requests_total") == n0 + 1
    settle(a, b)
    assert got == recompute(b, ids)
    settle(a, b)


def test_dead_holder_recomputes(pair):
    a, b = pair
    ids = tokens(a, "Dead holder: " + TEXT * 6)
    dead = {"remote_engine_id": "gone", "remote_bootstrap_addr": f"127.0.0.1:{free_port()}",
            "num_tokens": 12 * BS}
    f0 = fallbacks(b, "unreachable")
    got = answer(complete(b.url, ids, kv={"pool_source": dead}))
    assert fallbacks(b, "unreachable") == f0 + 1
    settle(b)
    assert got == recompute(b, ids)


def test_stopped_holder_recomputes_within_the_deadline(pair):
    """A holder that accepts connections but answers nothing (SIGSTOP): B gives up after its
    bootstrap lookup's deadline (about 5 s) and computes the prompt."""
    a, b = pair
    ids = prompt_on(a, b, "Stopped")
    f0 = fallbacks(b, "unreachable") + fallbacks(b, "timeout")
    os.kill(a.server.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got = answer(complete(b.url, ids, kv={"pool_source": a.source(12 * BS)}, timeout=60))
        took = time.monotonic() - t0
    finally:
        os.kill(a.server.proc.pid, signal.SIGCONT)
    print(f"stopped holder: answered after {took:.1f} s")
    assert fallbacks(b, "unreachable") + fallbacks(b, "timeout") == f0 + 1
    settle(a, b)
    assert got == recompute(b, ids)


def test_short_or_cached_prefix_is_not_fetched(pair):
    a, b = pair
    ids = prompt_on(a, b, "Cached")
    answer(complete(b.url, ids[:12 * BS], max_tokens=1))  # now B holds it too
    s0 = b.server.metrics()
    answer(complete(b.url, ids, kv={"pool_source": a.source(12 * BS)}))
    answer(complete(b.url, ids[:10], kv={"pool_source": a.source(10)}))  # not one block
    s1 = b.server.metrics()
    key = 'disagg:kv_pool_fetch_skipped_total{reason="%s"}'
    assert s1[key % "cached_here"] == s0[key % "cached_here"] + 1
    assert s1[key % "too_short"] == s0[key % "too_short"] + 1
    assert s1["disagg:kv_pool_fetch_requests_total"] == s0["disagg:kv_pool_fetch_requests_total"]
    settle(a, b)


@pytest.mark.parametrize("source,msg", [
    ("x", "kv_transfer_params.pool_source must be an object"),
    ({}, "pool_source.remote_engine_id must be a non-empty string"),
    ({"remote_engine_id": "pool-a", "remote_bootstrap_addr": "127.0.0.1:1", "num_tokens": 16,
      "blocks": 1}, "pool_source has an unknown key 'blocks'"),
    ({"remote_engine_id": "pool-b", "remote_bootstrap_addr": "127.0.0.1:1", "num_tokens": 16},
     "'pool-b' is this instance"),
    ({"remote_engine_id": "pool-a", "remote_bootstrap_addr": "no port", "num_tokens": 16},
     "pool_source.remote_bootstrap_addr 'no port' is not accepted"),
    ({"remote_engine_id": "pool-a", "remote_bootstrap_addr": "127.0.0.1:1", "num_tokens": 0},
     "pool_source.num_tokens must be an integer from 1 to the prompt's"),
    ({"remote_engine_id": "pool-a", "remote_bootstrap_addr": "127.0.0.1:1", "num_tokens": 9999},
     "got 9999"),
    ({"remote_engine_id": "pool-a", "remote_bootstrap_addr": "127.0.0.1:1", "num_tokens": "16"},
     "got a string"),
])
def test_bad_pool_source_is_refused(pair, source, msg):
    _, b = pair
    r = complete(b.url, "Bad pool source " + TEXT, kv={"pool_source": source})
    assert r.status_code == 400, r.text
    assert msg in r.json()["error"]["message"], r.text
    settle(b)


def test_pool_source_with_remote_prefill_is_refused(pair):
    a, b = pair
    kv = {"do_remote_prefill": True, "transfer_id": "xfer-1", "remote_engine_id": "pool-a",
          "remote_bootstrap_addr": a.bootstrap, "pool_source": a.source(16)}
    r = complete(b.url, "Both " + TEXT, kv=kv)
    assert r.status_code == 400, r.text
    assert "cannot be combined with do_remote_prefill" in r.text
    settle(a, b)


def test_pool_source_on_a_producer_is_refused(pair):
    a, _ = pair
    cfg = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})
    p = Server("--max-model-len", "512", "--kv-cache-memory", "32M", "--kv-transfer-config", cfg,
               env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())})
    try:
        r = complete(p.url, "Producer " + TEXT, kv={"pool_source": a.source(16)})
        assert r.status_code == 400, r.text
        assert ("pool_source needs kv_role kv_consumer or kv_both (this instance pulls the "
                "prefix); this instance is kv_producer") in r.json()["error"]["message"]
    finally:
        assert p.stop() == 0, p.logs()


def test_bad_pool_fetch_mode_stops_start_up():
    cfg = json.loads(both_config("x"))
    cfg["kv_connector_extra_config"]["pool_fetch"] = "sometimes"
    r = subprocess.run([BIN, "serve", str(MODEL), "--kv-transfer-config", json.dumps(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert ('kv_connector_extra_config.pool_fetch: "sometimes" is not accepted; accepted: '
            '"auto" (default), "always" or "never"') in r.stderr, r.stderr


def test_proxy_names_the_holder_when_load_sends_the_prompt_elsewhere(pair):
    """A holds a conversation's first turn; while A is busy with another prefill (held up by
    SIGSTOP for a moment, so that the proxy counts its tokens queued there), the second
    turn goes to B, with A as its pool source: B fetches the prefix, D decodes, and the
    answer equals B computing everything."""
    a, b = pair
    d = Server("--max-model-len", "1024", "--block-size", str(BS), "--kv-cache-memory", "96M",
               *EXACT, "--kv-transfer-config", json.dumps(
                   {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                    "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}))
    flags = ["--policy", "kv_aware", "--tokenizer", str(MODEL), "--kv-pool-fetch"]
    for p in (a, b):
        flags += ["--kv-events-endpoint", f"{p.url}=tcp://127.0.0.1:{p.kv_port}"]
    px = ProxyProc([a, b], [d], extra=flags)
    try:
        px.wait_ready(30)
        for p in (a, b):
            assert requests.post(p.url + "/reset_prefix_cache", timeout=10).status_code == 200
        ids = tokens(a, "Turn one. " + TEXT * 6)
        answer(complete(a.url, ids[:12 * BS], max_tokens=1))  # the first turn, on A
        deadline = time.monotonic() + 15
        while px.metrics().get(f'disagg_proxy_kv_index_blocks{{backend="{a.url}",medium="GPU"}}',
                               0) < 12:
            assert time.monotonic() < deadline, px.output()[-3000:]
            time.sleep(0.05)
        fetched0 = b.m("disagg:kv_pool_fetch_requests_total")
        os.kill(a.server.proc.pid, signal.SIGSTOP)
        try:  # a long prompt sharing the prefix: routed to A (a hit), its prefill held up
            filler = threading.Thread(target=lambda: complete(
                px.url, ids[:12 * BS] + ids[:12 * BS] * 3, max_tokens=1, timeout=60))
            filler.start()
            time.sleep(0.3)
            out = {}
            turn2 = threading.Thread(target=lambda: out.update(r=complete(px.url, ids)))
            turn2.start()
            time.sleep(0.3)
        finally:
            os.kill(a.server.proc.pid, signal.SIGCONT)
        filler.join(60)
        turn2.join(60)
        got = answer(out["r"])
        m = px.metrics()
        assert m["disagg_proxy_kv_pool_source_requests_total"] == 1, px.output()[-3000:]
        assert m["disagg_proxy_kv_pool_source_tokens_total"] == 12 * BS
        assert b.m("disagg:kv_pool_fetch_requests_total") == fetched0 + 1
        settle(a, b, d)
        assert got == recompute(b, ids)
    finally:
        px.stop()
        rc = d.stop()
    assert rc == 0, d.logs()
    settle(a, b)
