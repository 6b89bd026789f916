"""Prefill and decode instances of different tensor-parallel sizes (docs/parallel.md), with
real `disagg serve -tp N` processes on the CPU, the producer's real bootstrap server and the
real side channels: every P rank registers under its tp_rank, D reads P's TP size from
/query and pulls, for each of its ranks, from every P rank that rank needs (vLLM's
TpKVTopology), each P rank writing its KV heads into the D rank's head slice.

- P TP 2 -> D TP 1, P TP 1 -> D TP 2 and P TP 2 -> D TP 2 (the tiny model's 2 KV heads),
  P TP 2 -> D TP 4 and P TP 4 -> D TP 2 (a random Llama with 4 KV heads, split at TP 4):
  greedy token ids and text equal a colocated server at D's TP size, every prompt token's
  KV came from P (usage), and no block stays in use on either side afterwards;
- P frees a request's blocks once every rank was pulled, or when the decoder releases it at
  any one rank (a vLLM-shaped release pull sent to tp_rank 1 only; a vLLM decoder's pull is
  checked against the block bytes its own TP rank holds);
- a P whose TP size does not fit the model's KV heads and D's is refused with a clear error
  and D's blocks are freed;
- a P rank dying (SIGKILL of a worker) stops that P with a message naming the rank; D's
  next request for it fails fast with a clear error, its blocks freed, D still serving; a
  pull waiting at P when its worker dies fails at once, naming the pull;
- a malformed DISAGG_TP_WORKER (what `serve -tp N` sets for its workers) is refused."""
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import msgpack
import pytest
import requests
import zmq

from server_harness import ROOT, Server, free_port, on_gpu
from test_pd import (BODY, COMMON, PD, blocks_used, completion_ids, consumer_config,
                     corpus_prompts, producer_config, wait_blocks_zero)
from test_pd_errors import d_params

pytestmark = pytest.mark.skipif(on_gpu(), reason="CPU tensor parallelism (shared memory)")

TP_ARGS = ("--threads", "1")
PROMPTS = ["The capital of France is", corpus_prompts()[7]]  # 1 block, and 8 blocks


class PDTP(PD):
    """A producer at -tp p_tp and a consumer at -tp d_tp (of model, default the tiny one)."""

    def __init__(self, p_tp, d_tp, model=None, common=COMMON):
        self.boot_port = free_port()
        env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.boot_port)}
        kw = {"model": model} if model else {}
        self.p = Server(*common, *TP_ARGS, "-tp", str(p_tp), "--kv-transfer-config",
                        producer_config(), env=env, **kw)
        try:
            self.d = Server(*common, *TP_ARGS, "-tp", str(d_tp), "--kv-transfer-config",
                            consumer_config(), **kw)
        except Exception:
            self.p.stop()
            raise
        self.bootstrap = f"http://127.0.0.1:{self.boot_port}"
        self.table = requests.get(self.bootstrap + "/query", timeout=10).json()
        self.engine_id = self.table["0"]["engine_id"]


@pytest.fixture(scope="module")
def colocated():
    servers = {}

    def get(tp):
        if tp not in servers:
            servers[tp] = Server(*COMMON, *TP_ARGS, "-tp", str(tp))
        return servers[tp]
    yield get
    for s in servers.values():
        s.stop()


def colocated_ids(srv, prompt):
    r = requests.post(srv.url + "/v1/completions", json=dict(BODY, prompt=prompt), timeout=120)
    return completion_ids(r)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 2)])
def test_pd_across_tp_sizes_equals_colocated_at_the_decoders_tp(colocated, p_tp, d_tp):
    pd = PDTP(p_tp, d_tp)
    try:
        # every P rank registered under its tp_rank, each with its own side channel
        ranks = pd.table["0"]["worker_addr"]
        assert sorted(ranks) == [str(r) for r in range(p_tp)], pd.table
        assert len({ranks[r]["0"] for r in ranks}) == p_tp
        for prompt in PROMPTS:
            p, d = pd.send(dict(BODY, prompt=prompt))
            assert p.status_code == 200, p.text
            ids, text, _ = completion_ids(d)
            want_ids, want_text, _ = colocated_ids(colocated(d_tp), prompt)
            assert ids == want_ids and text == want_text, (prompt, ids, want_ids)
            usage = d.json()["usage"]
            assert usage["kv_transfer"]["received_prompt_tokens"] == usage["prompt_tokens"], usage
        wait_blocks_zero(pd.d)
        wait_blocks_zero(pd.p)  # every P rank pulled: the blocks went back
    finally:
        pd.stop()


KV4_COMMON = ("--max-model-len", "256", "--kv-cache-memory", "16M", "--block-size", "16")


@pytest.mark.parametrize("p_tp,d_tp", [(2, 4), (4, 2)])
def test_pd_across_tp_sizes_with_split_kv_heads(tmp_path_factory, p_tp, d_tp):
    """A model with 4 KV heads: at TP 4 each rank holds one (split, not replicated), so a
    TP-2 rank's blocks go to two TP-4 ranks (and back)."""
    d = tmp_path_factory.mktemp("kv4") / "llama-kv4-tiny"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_random_model.py"), "--out", str(d),
                    "--variant", "llama-kv4-tiny"], check=True, capture_output=True)
    pd = PDTP(p_tp, d_tp, model=str(d), common=KV4_COMMON)
    colo = Server(*KV4_COMMON, *TP_ARGS, "-tp", str(d_tp), model=str(d))
    try:
        assert "1 of 4 KV heads" in (pd.p if p_tp == 4 else pd.d).logs()
        for prompt in ("The capital of France is", corpus_prompts()[6]):
            p, dr = pd.send(dict(BODY, prompt=prompt))
            assert p.status_code == 200, p.text
            ids, text, _ = completion_ids(dr)
            assert (ids, text) == colocated_ids(colo, prompt)[:2], prompt
            usage = dr.json()["usage"]
            assert usage["kv_transfer"]["received_prompt_tokens"] == usage["prompt_tokens"], usage
        wait_blocks_zero(pd.d)
        wait_blocks_zero(pd.p)
    finally:
        colo.stop()
        pd.stop()


def release_pull(transfer_id, block_len):
    """vLLM's decoder's "nothing to send, release your blocks" (no block ids)."""
    return msgpack.packb({
        "remote_hostname": "127.0.0.1", "remote_port": 9, "remote_tp_size": 1, "remote_tp_rank": 0,
        "req_blocks": {"d-release": [transfer_id, []]},
        "kv_caches_base_addr": [1 << 40], "block_lens": [block_len], "kv_block_lens": [block_len]})


def pull_once(endpoint, frame):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10000)
    s.connect(endpoint)
    try:
        s.send(frame)
        return msgpack.unpackb(s.recv())
    finally:
        s.close()


def test_a_release_at_one_prefill_rank_frees_the_request():
    pd = PDTP(2, 1)
    try:
        tid = "xfer-" + str(uuid.uuid4())
        r = requests.post(pd.p.url + "/v1/completions", timeout=60, json=dict(
            BODY, prompt=corpus_prompts()[6], max_tokens=1,
            kv_transfer_params={"do_remote_decode": True, "transfer_id": tid}))
        assert r.status_code == 200, r.text
        assert blocks_used(pd.p) > 0  # kept for the decoder's pulls
        rank_bytes = int(re.search(r"blocks of (\d+) bytes\)", pd.p.logs()).group(1))
        endpoint = pd.table["0"]["worker_addr"]["1"]["0"]  # tp_rank 1 only
        # a TP-1 decoder's blocks hold both ranks' heads: P's rank size is refused, naming it
        reply = pull_once(endpoint, release_pull(tid, rank_bytes))
        assert reply["status"] == 2 and (
            f"decoder blocks are {rank_bytes} bytes, producer's {2 * rank_bytes} (what decode "
            "tp_rank 0 of 1 holds)") in reply["err_msg"], reply
        assert blocks_used(pd.p) > 0
        reply = pull_once(endpoint, release_pull(tid, 2 * rank_bytes))
        assert reply["status"] == 0, reply  # FINISH
        wait_blocks_zero(pd.p, timeout=5)
    finally:
        pd.stop()


def test_a_prefill_tp_that_does_not_fit_is_refused_with_a_clear_error():
    pd = PDTP(1, 1)
    try:
        # two more ranks of the same prefill engine: TP 3, which does not divide 2 KV heads
        for rank in (1, 2):
            r = requests.post(pd.bootstrap + "/register", timeout=10, json={
                "engine_id": pd.engine_id, "dp_rank": 0, "tp_rank": rank, "pp_rank": 0,
                "addr": f"tcp://127.0.0.1:{free_port()}"})
            assert r.status_code == 200, r.text
        p, d = pd.send(dict(BODY, prompt="The capital of Italy is"))
        assert d.status_code >= 500, d.text
        msg = d.json()["error"]["message"]
        assert "prefill tensor-parallel size 3 cannot hold 2 KV heads" in msg, msg
        wait_blocks_zero(pd.d)
    finally:
        pd.stop()


def test_a_prefill_rank_dying_fails_the_decoders_request_fast():
    pd = PDTP(2, 1)
    try:
        p, d = pd.send(dict(BODY, prompt=PROMPTS[0]))
        assert d.status_code == 200, d.text
        pid = int(re.search(r"rank 1: pid (\d+)", pd.p.logs()).group(1))
        os.kill(pid, signal.SIGKILL)
        assert pd.p.proc.wait(timeout=30) == 1
        assert "tensor-parallel worker rank 1" in pd.p.logs()
        t0 = time.time()
        d = requests.post(pd.d.url + "/v1/completions", timeout=120,
                          json=dict(BODY, prompt=PROMPTS[1], kv_transfer_params=d_params(pd)))
        took = time.time() - t0
        assert d.status_code >= 500, d.text
        msg = d.json()["error"]["message"]
        assert "remote prefill failed" in msg and pd.bootstrap.split("//")[1] in msg, msg
        print(f"request to a decoder whose prefill lost a rank failed in {took:.2f} s: {msg}")
        wait_blocks_zero(pd.d)
        ok = requests.post(pd.d.url + "/v1/completions", json=dict(BODY, prompt=PROMPTS[0]),
                           timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        pd.stop()


@pytest.mark.parametrize("value", ["1:3:x", "1:3:", "1:3:-1", "1:3:4:5", "0:3:4"])
def test_a_malformed_worker_environment_is_refused(value):
    """DISAGG_TP_WORKER=<rank>:<fd>[:<kv_fd>] is set by `serve -tp N` for its workers; anything
    else is refused naming the variable and the accepted form."""
    from server_harness import BIN, MODEL
    r = subprocess.run([BIN, "serve", str(MODEL), "--port", "1", "-tp", "2"], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, DISAGG_TP_WORKER=value))
    assert r.returncode != 0
    assert f"DISAGG_TP_WORKER='{value}': expected <rank>:<fd>[:<kv_fd>]" in r.stderr, r.stderr


def test_a_prefill_rank_dying_during_a_pull_fails_it_without_waiting_for_the_timeout():
    """D's pull waits at P (its transfer id never reaches P); a P worker is killed: P stops,
    and D fails the request at once (the side channel's connection closed), naming the pull,
    instead of after the pull's (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60) s.  (Its blocks then sit out the 35 s
    quarantine of a pull without a final reply, as at TP 1: not waited for here.)"""
    pd = PDTP(2, 1)
    try:
        import concurrent.futures as cf
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(requests.post, pd.d.url + "/v1/completions", timeout=60,
                            json=dict(BODY, prompt=PROMPTS[1], kv_transfer_params=d_params(pd)))
            deadline = time.time() + 10
            while blocks_used(pd.d) == 0 and time.time() < deadline:
                time.sleep(0.05)
            assert blocks_used(pd.d) > 0, "the request never reached its pull"
            pid = int(re.search(r"rank 1: pid (\d+)", pd.p.logs()).group(1))
            os.kill(pid, signal.SIGKILL)
            assert pd.p.proc.wait(timeout=30) == 1
            d = fut.result()
        assert d.status_code >= 500, d.text
        msg = d.json()["error"]["message"]
        # the side channel saw the connection close (or the probe the bootstrap server gone)
        assert "producer unreachable" in msg, msg
        assert "decode tp_rank 0 from prefill" in msg and "pull 1 of 2" in msg, msg
        ok = requests.post(pd.d.url + "/v1/completions", json=dict(BODY, prompt=PROMPTS[0]),
                           timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        pd.stop()
