"""n > 1 across P/D: through `disagg proxy` with the official `openai`
client, the prompt is prefilled once on P and moved once (one transfer_id), and D
decodes the n choices sharing the pulled prompt blocks; the choices equal a
colocated `disagg serve` asked for the same n (greedy and seeded sampling,
streaming and not)."""
import json

import openai
import pytest
import requests

from proxy_fixtures import ProxyProc
from server_harness import Server
from test_pd import COMMON, PD, wait_blocks_zero
from test_proxy_pd import Prefill, decode

TIMEOUT = 120
BLOCK = 16  # COMMON's --block-size
OK = 'disagg:kv_transfers_total{side="producer",result="ok"}'


@pytest.fixture(scope="module")
def colocated():
    s = Server(*COMMON)
    yield s
    assert s.stop() == 0, s.logs()


@pytest.fixture(scope="module")
def stack():
    p = Prefill()
    d = decode()
    px = ProxyProc([p], [d])
    px.wait_ready(30)
    yield p, d, px
    px.proc.terminate()
    assert px.proc.wait(10) == 0, px.output()
    assert d.stop() == 0, d.logs()  # a clean exit: sanitizer reports fail it
    assert p.server.stop() == 0, p.server.logs()


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


PROMPT = "Fellow-Citizens of the Senate and House of Representatives: the state of the Union"


def assert_one_transfer_shared(usage, n):
    """D's usage: choice 0 received the prompt's KV (less D's own cache hits) and ran one
    token; each other choice found those blocks in D's prefix cache and ran at most the
    last, partial block — a D that recomputed the prompt per choice fails this."""
    kv = usage["kv_transfer"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert kv["received_prompt_tokens"] == usage["prompt_tokens"] - cached > 0, usage
    assert 1 + (n - 1) <= kv["computed_prompt_tokens"] <= 1 + (n - 1) * BLOCK, usage


def finished(server):
    """Choices the server finished (vllm:request_success_total over every reason)."""
    return sum(v for k, v in server.metrics().items() if k.startswith("vllm:request_success_total"))


def texts_by_index(choices):
    return [c.text for c in sorted(choices, key=lambda c: c.index)]


# the n choices differ (seeded sampling at temperature 1), or are all the greedy one
SAMPLINGS = [dict(temperature=0), dict(temperature=1.0, seed=1234), dict(temperature=0.8, top_p=0.9, seed=7)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded", "seeded-top-p"])
def test_completions_n_through_proxy_equal_colocated(stack, colocated, sampling):
    p, d, px = stack
    n = 3
    kw = dict(model="tiny", prompt=PROMPT + f" {sampling}", max_tokens=12, n=n, **sampling)
    want = texts_by_index(client(colocated.url).completions.create(**kw).choices)
    assert len(want) == n
    if "seed" in sampling:
        assert len(set(want)) > 1, want  # the choices really are different samples
    m0, f0 = p.server.metrics(), finished(p.server)
    got = client(px.url).completions.create(**kw)
    assert texts_by_index(got.choices) == want
    assert [c.index for c in sorted(got.choices, key=lambda c: c.index)] == list(range(n))
    assert all(c.finish_reason == "length" for c in got.choices)
    assert got.usage.completion_tokens == n * 12
    assert_one_transfer_shared(got.usage.model_dump(), n)
    assert p.server.metrics().get(OK, 0) == m0.get(OK, 0) + 1  # moved once
    assert finished(p.server) == f0 + 1  # P prefilled once: one request, not n

    # streaming: the same n texts, one transfer
    m0 = p.server.metrics()
    parts = [""] * n
    last = None
    for c in client(px.url).completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for ch in c.choices:
            parts[ch.index] += ch.text
        last = c
    assert parts == want
    assert_one_transfer_shared(last.usage.model_dump(), n)
    assert p.server.metrics().get(OK, 0) == m0.get(OK, 0) + 1
    wait_blocks_zero(p.server)
    wait_blocks_zero(d)


def test_chat_n_through_proxy_equal_colocated(stack, colocated):
    _, d, px = stack
    n = 2
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell the Congress about trade."}],
              max_tokens=10, n=n, temperature=1.0, seed=99)
    want = [c.message.content for c in sorted(client(colocated.url).chat.completions.create(**kw).choices,
                                               key=lambda c: c.index)]
    got = client(px.url).chat.completions.create(**kw)
    assert [c.message.content for c in sorted(got.choices, key=lambda c: c.index)] == want
    assert_one_transfer_shared(got.usage.model_dump(), n)
    parts = [""] * n
    roles = set()
    for c in client(px.url).chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            if ch.delta.role:
                roles.add(ch.index)
            parts[ch.index] += ch.delta.content or ""
    assert parts == want
    assert roles == set(range(n))  # every choice's stream starts with its role
    wait_blocks_zero(d)


@pytest.fixture(scope="module")
def pd():
    x = PD(p_env={"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "2"})
    yield x
    assert x.d.stop() == 0, x.d.logs()
    assert x.p.stop() == 0, x.p.logs()


def test_n_on_both_sides_directly_one_transfer_id(pd, colocated):
    """What failed before: n > 1 with one transfer_id ('transfer_id already in use') on P
    and on D.  P given n = 2 keeps one prefill for the transfer; D decodes n = 4 on it."""
    kw = dict(model="tiny", prompt=PROMPT + " directly", max_tokens=6, temperature=0, n=4)

    def p_two(pb):
        pb["n"] = 2

    rp, rd = pd.send(kw, p_body_edit=p_two)
    assert rp.status_code == 200, rp.text
    assert len(rp.json()["choices"]) == 2
    assert rd.status_code == 200, rd.text
    want = requests.post(colocated.url + "/v1/completions", json=kw, timeout=TIMEOUT).json()
    assert [c["text"] for c in rd.json()["choices"]] == [c["text"] for c in want["choices"]]
    assert_one_transfer_shared(rd.json()["usage"], 4)
    wait_blocks_zero(pd.p)
    wait_blocks_zero(pd.d)


def test_n_with_failed_transfer_fails_every_choice(pd):
    """A pull that fails (a transfer P never had) ends all n choices with the error, no hang."""
    params = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": pd.engine_id,
              "remote_bootstrap_addr": pd.bootstrap, "transfer_id": "xfer-n-no-such-transfer"}
    body = dict(model="tiny", prompt="x y z", max_tokens=4, n=3, kv_transfer_params=params)
    r = requests.post(pd.d.url + "/v1/completions", timeout=TIMEOUT, json=body)
    assert r.status_code >= 400, r.text
    assert "transfer" in r.json()["error"]["message"]
    r = requests.post(pd.d.url + "/v1/completions", timeout=TIMEOUT, stream=True,
                      json=dict(body, stream=True, kv_transfer_params=dict(params, transfer_id="xfer-n-none-2")))
    events = [l for l in r.iter_lines() if l]
    assert events[-1] == b"data: [DONE]"
    assert sum(1 for e in events if b'"error"' in e) == 3, events
    wait_blocks_zero(pd.d)
