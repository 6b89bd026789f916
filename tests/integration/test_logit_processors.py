"""logit_bias, allowed_token_ids and bad_words (vLLM's sampling parameters) with the official
`openai` client against a colocated `disagg serve` and through `disagg proxy` in front of a
prefill and a decode instance: the generated token ids (return_tokens_as_token_ids) obey
each processor, P/D equals colocated (P samples the first token with the same processors),
and bad values are refused with a 400 naming the field."""
import openai
import pytest
import requests

from proxy_fixtures import ProxyProc
from server_harness import Server
from test_pd import COMMON
from test_proxy_pd import Prefill, decode

TIMEOUT = 120
PROMPT = "Fellow-Citizens of the Senate and House of Representatives: the state of the Union"


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
    assert d.stop() == 0, d.logs()
    assert p.server.stop() == 0, p.server.logs()


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def tokenize(url, text):
    r = requests.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def gen_ids(url, **kw):
    """The completion's token ids (logprobs with return_tokens_as_token_ids)."""
    r = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=12, logprobs=0,
                                       extra_body=dict(kw.pop("extra_body", {}), return_tokens_as_token_ids=True),
                                       **kw)
    toks = r.choices[0].logprobs.tokens
    return [int(t.split(":")[1]) for t in toks], r.choices[0].text


def test_logit_bias(colocated):
    base, _ = gen_ids(colocated.url, temperature=0)
    tok = tokenize(colocated.url, " Union")[0]
    assert tok not in base
    ids, _ = gen_ids(colocated.url, temperature=0, logit_bias={str(tok): 100})
    assert ids == [tok] * 12
    # a large negative bias on the greedy output's first token moves it
    ids, _ = gen_ids(colocated.url, temperature=0, logit_bias={str(base[0]): -100})
    assert ids[0] != base[0]


def test_allowed_token_ids(colocated):
    allowed = sorted(set(tokenize(colocated.url, " the state of the Union and the people")))
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=5)):
        ids, _ = gen_ids(colocated.url, extra_body={"allowed_token_ids": allowed}, **kw)
        assert ids and set(ids) <= set(allowed), (ids, allowed)


def test_bad_words(colocated):
    base, text = gen_ids(colocated.url, temperature=0)
    words = [w for w in text.split() if w.isalpha()]
    assert words, text
    word = words[0]
    banned = [tokenize(colocated.url, word), tokenize(colocated.url, " " + word)]
    ids, _ = gen_ids(colocated.url, temperature=0, extra_body={"bad_words": [word]})
    assert ids != base
    for seq in banned:
        n = len(seq)
        assert all(ids[i:i + n] != seq for i in range(len(ids) - n + 1)), (ids, seq)


CASES = [dict(temperature=0, extra_body={"bad_words": ["the", "Union"]}),
         dict(temperature=1.0, seed=3, extra_body={"allowed_token_ids": list(range(200, 900))}),
         dict(temperature=0.7, seed=9, logit_bias={"11": 5, "13": -100})]


@pytest.mark.parametrize("kw", CASES, ids=["bad_words", "allowed", "logit_bias"])
def test_pd_equals_colocated(stack, colocated, kw):
    _, _, px = stack
    want = gen_ids(colocated.url, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in kw.items()})
    got = gen_ids(px.url, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in kw.items()})
    assert got == want


@pytest.mark.parametrize("body,needle", [
    ({"logit_bias": {"99999999": 1}}, "outside the vocabulary"),
    ({"logit_bias": {"x": 1}}, "must be an integer"),
    ({"allowed_token_ids": [5, 99999999]}, "outside the vocabulary"),
    ({"allowed_token_ids": []}, "is empty"),
    ({"bad_words": [7]}, "must be a non-empty string"),
], ids=["bias-oov", "bias-key", "allowed-oov", "allowed-empty", "bad-words-type"])
def test_bad_values(colocated, body, needle):
    r = requests.post(colocated.url + "/v1/completions",
                      json=dict(model="tiny", prompt="hi", max_tokens=2, **body), timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text
