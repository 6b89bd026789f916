"""Errors that say what happened, with real `disagg serve`
producer and consumer processes: unusable kv_transfer_params are a 400 naming
the field, an unreachable producer a 502 naming it, a pull for a transfer id
the producer never receives fails within DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT
with the decoder's blocks freed, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT counts
from the end of the prefill, a client that disconnects mid-pull gets its
decoder blocks freed at once (the producer acknowledges the cancel), the
entries P remembers for cancelled pulls stay within max_pending_pulls and are
forgotten after the unknown-transfer timeout, and each failure shows in a
/metrics counter."""
import concurrent.futures as cf
import json
import socket
import time
import uuid

import pytest
import requests

from server_harness import free_port
from test_pd import BODY, PD, TIMEOUT, blocks_used, corpus_prompts, producer_config, wait_blocks_zero


def d_params(x, **kw):
    p = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": x.engine_id,
         "remote_bootstrap_addr": x.bootstrap, "transfer_id": "xfer-" + str(uuid.uuid4())}
    p.update(kw)
    return p


def metric(server, name, **labels):
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else name
    return server.metrics().get(want, 0)


@pytest.fixture(scope="module")
def pd():
    x = PD(p_env={"DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT": "3"})
    yield x
    x.stop()


@pytest.mark.parametrize("field,value,needle", [
    ("do_remote_prefill", "yes", "do_remote_prefill must be true or false, got a string"),
    ("remote_engine_id", 7, "remote_engine_id must be a non-empty string"),
    ("remote_bootstrap_addr", "not an address", "remote_bootstrap_addr 'not an address' is not accepted"),
    ("remote_bootstrap_addr", "http://host:99999", "remote_bootstrap_addr"),
    ("remote_bootstrap_addr", ["x"], "remote_bootstrap_addr an array is not accepted"),
    ("transfer_id", [], "transfer_id must be a non-empty string"),
])
def test_malformed_kv_transfer_params_are_400_naming_the_field(pd, field, value, needle):
    body = dict(BODY, prompt="hello", kv_transfer_params=d_params(pd, **{field: value}))
    before = metric(pd.d, "disagg:kv_transfer_failures_total", side="consumer", reason="bad_params")
    r = requests.post(pd.d.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "BadRequestError"
    assert blocks_used(pd.d) == 0
    assert metric(pd.d, "disagg:kv_transfer_failures_total", side="consumer",
                  reason="bad_params") == before + 1


def test_unknown_engine_is_400_naming_remote_engine_id(pd):
    body = dict(BODY, prompt="hello", kv_transfer_params=d_params(pd, remote_engine_id="no-such-engine"))
    before = metric(pd.d, "disagg:kv_transfer_failures_total", side="consumer", reason="bad_params")
    r = requests.post(pd.d.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "no-such-engine" in msg and "remote_engine_id" in msg, msg
    assert r.json()["error"]["type"] == "BadRequestError"
    assert metric(pd.d, "disagg:kv_transfer_failures_total", side="consumer",
                  reason="bad_params") == before + 1
    wait_blocks_zero(pd.d)


def test_unreachable_producer_is_502_naming_it(pd):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    body = dict(BODY, prompt="hello", kv_transfer_params=d_params(pd, remote_bootstrap_addr=dead))
    r = requests.post(pd.d.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 502, r.text
    assert dead.split("//")[1] in r.json()["error"]["message"], r.text
    assert metric(pd.d, "disagg:kv_transfer_failures_total", side="consumer",
                  reason="bootstrap_unreachable") >= 1
    wait_blocks_zero(pd.d)


def test_bogus_transfer_id_fails_within_the_bound_and_frees_blocks(pd):
    body = dict(BODY, prompt=corpus_prompts()[6], kv_transfer_params=d_params(pd, transfer_id="xfer-bogus"))
    before = metric(pd.p, "disagg:kv_transfer_failures_total", side="producer", reason="unknown_transfer")
    t0 = time.time()
    r = requests.post(pd.d.url + "/v1/completions", json=body, timeout=TIMEOUT)
    took = time.time() - t0
    assert took < 20, took  # bound 3 s here (default 30 s), not the 480 s abort timeout
    assert r.status_code == 502, r.text
    msg = r.json()["error"]["message"]
    assert "xfer-bogus" in msg and "DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT" in msg, msg
    wait_blocks_zero(pd.d, timeout=3)  # P answered: no quarantine
    assert metric(pd.p, "disagg:kv_transfer_failures_total", side="producer",
                  reason="unknown_transfer") == before + 1
    assert metric(pd.d, "disagg:kv_transfer_failures_total", side="consumer", reason="producer_error") >= 1


def test_client_disconnect_mid_pull_frees_decoder_blocks_at_once(pd):
    """The pull waits at P (its transfer id has not arrived there); the client goes away;
    D cancels, P acknowledges, D frees the blocks without the 35 s quarantine."""
    body = dict(BODY, prompt=corpus_prompts()[8], kv_transfer_params=d_params(pd))
    s = raw_post(pd.d, body)
    deadline = time.time() + 10
    while blocks_used(pd.d) == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert blocks_used(pd.d) > 0, "the request never reached the pull"
    time.sleep(0.5)
    acked = metric(pd.d, "disagg:kv_cancels_total", acked="yes")
    s.close()
    t0 = time.time()
    wait_blocks_zero(pd.d, timeout=3)  # generous for "within 1 s"; the quarantine is 35 s
    print(f"decoder blocks free {time.time() - t0:.3f} s after the disconnect")
    assert metric(pd.d, "disagg:kv_cancels_total", acked="yes") == acked + 1
    assert metric(pd.d, "disagg:kv_transfer_failures_total", side="consumer", reason="cancelled") >= 1
    assert metric(pd.p, "disagg:kv_transfer_failures_total", side="producer", reason="cancelled") >= 1
    # P's request for that transfer arrives late: its KV is released once ready, not kept
    # for the 480 s abort timeout waiting for a pull that will not come
    tid = body["kv_transfer_params"]["transfer_id"]
    r = requests.post(pd.p.url + "/v1/completions", timeout=TIMEOUT, json=dict(
        body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid}))
    assert r.status_code == 200, r.text
    wait_blocks_zero(pd.p, timeout=5)
    # the instances still serve
    pr, dr = pd.send(dict(BODY, prompt=corpus_prompts()[3]))
    assert pr.status_code == 200 and dr.status_code == 200, dr.text


def test_cancelled_unknown_entries_are_capped_and_forgotten():
    """A cancelled pull for a transfer id P has not seen is remembered (so that a late request's
    KV is released once ready) in the capped list of pulls for unknown transfer ids: with
    max_pending_pulls 2 a third such entry evicts the oldest, and each is forgotten after
    DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT (3 s here): the gauge returns to 0, P keeps serving."""
    x = PD(p_env={"DISAGG_KV_UNKNOWN_TRANSFER_TIMEOUT": "3"},
           p_cfg=producer_config({"max_pending_pulls": 2}))
    try:
        def seen(m):
            return m["disagg:kv_pending_unknown_pulls"] + m["disagg:kv_pending_pulls_evicted_total"]
        for i in range(3):
            s = raw_post(x.d, dict(BODY, prompt=corpus_prompts()[8], kv_transfer_params=d_params(x)))
            deadline = time.time() + 10
            while seen(x.p.metrics()) < i + 1 and time.time() < deadline:
                time.sleep(0.05)
            assert seen(x.p.metrics()) == i + 1, x.p.metrics()
            s.close()
            wait_blocks_zero(x.d, timeout=3)  # acknowledged: no quarantine
        m = x.p.metrics()
        assert metric(x.d, "disagg:kv_cancels_total", acked="yes") == 3
        assert m["disagg:kv_pending_unknown_pulls"] == 2  # the remembered entries, capped
        assert m["disagg:kv_pending_pulls_evicted_total"] == 1
        deadline = time.time() + 15
        while x.p.metrics()["disagg:kv_pending_unknown_pulls"] > 0 and time.time() < deadline:
            time.sleep(0.1)
        assert x.p.metrics()["disagg:kv_pending_unknown_pulls"] == 0
        pr, dr = x.send(dict(BODY, prompt=corpus_prompts()[3]))
        assert pr.status_code == 200 and dr.status_code == 200, dr.text
        assert dr.json()["choices"][0]["finish_reason"] != "error", dr.text
    finally:
        x.stop()


def one_at_a_time_pd(p_env=None):
    """A PD whose producer runs one request at a time (a long one queues the next)."""
    from server_harness import Server
    from test_pd import COMMON, producer_config
    x = PD()
    x.p.stop()
    env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(x.boot_port)}
    env.update(p_env or {})
    x.p = Server(*COMMON, "--max-num-seqs", "1", "--kv-transfer-config", producer_config(), env=env)
    x.engine_id = requests.get(x.bootstrap + "/query", timeout=10).json()["0"]["engine_id"]
    return x


# long generations queued ahead on a one-at-a-time P (each well under 1 s alone; 4 of them took
# only ~0.75 s with the avx512f kernels and the chunked attention, too short for the tests below
# to queue behind them, so 12: ~2-5 s on the machines seen)
HOGS = 12


def submit_hogs(ex, x):
    """Queue HOGS long generations on P; the request sent next waits behind all of them."""
    hog = dict(BODY, prompt="x", max_tokens=900, ignore_eos=True)
    return [ex.submit(requests.post, x.p.url + "/v1/completions", json=hog, timeout=TIMEOUT)
            for _ in range(HOGS)]


def raw_post(server, body):
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


def test_client_disconnect_while_the_prefill_is_queued_frees_both_sides():
    """The pull waits on a request queued on P; the client leaves D: D's blocks are free at
    once (P acknowledged), and P frees its blocks as soon as that prefill ends instead of
    keeping them for a pull that will never come (480 s)."""
    x = one_at_a_time_pd()
    try:
        tid = "xfer-" + str(uuid.uuid4())
        body = dict(BODY, prompt=corpus_prompts()[7])
        with cf.ThreadPoolExecutor(HOGS + 1) as ex:
            hogs = submit_hogs(ex, x)
            time.sleep(0.3)
            fp = ex.submit(requests.post, x.p.url + "/v1/completions", timeout=TIMEOUT, json=dict(
                body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid}))
            s = raw_post(x.d, dict(body, kv_transfer_params=d_params(x, transfer_id=tid)))
            deadline = time.time() + 10
            while blocks_used(x.d) == 0 and time.time() < deadline:
                time.sleep(0.05)
            assert blocks_used(x.d) > 0
            time.sleep(0.3)
            assert not hogs[-1].done(), "the long requests ended before the test could queue behind them"
            s.close()
            wait_blocks_zero(x.d, timeout=3)
            assert metric(x.d, "disagg:kv_cancels_total", acked="yes") == 1
            assert all(h.result().status_code == 200 for h in hogs) and fp.result().status_code == 200
        wait_blocks_zero(x.p, timeout=10)  # not the 480 s abort timeout
        assert metric(x.p, "disagg:kv_transfer_failures_total", side="producer", reason="cancelled") == 1
        assert metric(x.p, "disagg:kv_transfer_expired_total") == 0
    finally:
        x.stop()


def test_abort_timeout_counts_from_the_end_of_the_prefill():
    """P runs one request at a time, with a 1 s abort timeout; a P/D request queued behind a
    long generation for more than 1 s still succeeds (vLLM counts the abort timeout from the
    end of P's prefill; a queued request on a live producer is not failed by it)."""
    x = one_at_a_time_pd({"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "1"})
    try:
        with cf.ThreadPoolExecutor(HOGS) as ex:
            t0 = time.time()
            hogs = submit_hogs(ex, x)
            time.sleep(0.3)
            pr, dr = x.send(dict(BODY, prompt=corpus_prompts()[5]))
            waited = time.time() - t0
            assert all(h.result().status_code == 200 for h in hogs)
        assert waited > 1.5, f"the hogs took only {waited:.2f} s: the test did not queue the request"
        assert pr.status_code == 200, pr.text
        assert dr.status_code == 200, dr.text
        assert dr.json()["choices"][0]["finish_reason"] != "error", dr.text
        wait_blocks_zero(x.d)
        wait_blocks_zero(x.p)
    finally:
        x.stop()
