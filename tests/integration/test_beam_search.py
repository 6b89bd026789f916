"""vLLM's beam search (`use_beam_search`, beam width n, length_penalty, ignore_eos,
include_stop_str_in_output) against a reference written here: vLLM's algorithm driving the
same server's completions with max_tokens 1 and logprobs 2 * width, step by step.  The
beams (texts, token counts, finish reasons, order) must be equal; length_penalty must
change the ranking where beams of different lengths compete; chat (streaming too) and
P/D through `disagg proxy` give the colocated beams; bad values get a 400 naming the
field."""
import json

import openai
import pytest
import requests

from proxy_fixtures import ProxyProc
from server_harness import CPU_EXACT, Server, on_gpu
from test_pd import COMMON
from test_proxy_pd import Prefill, decode

TIMEOUT = 120
# on the tiny model, <|endoftext|> is among the top 20 after this prompt (logprob about
# -4.2): width 10 completes a short beam at the first step, which length_penalty ranks
EOS_PROMPT = "Thank you."
PROMPT = "The state of the Union"


@pytest.fixture(scope="module")
def colocated():
    s = Server(*COMMON)
    yield s
    assert s.stop() == 0, s.logs()


def post(url, path, body):
    r = requests.post(url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def eos_id(url):
    return post(url, "/tokenize", {"prompt": "<|endoftext|>"})["tokens"][0]


def reference(url, prompt, width, max_tokens, length_penalty=1.0, ignore_eos=False,
              include_stop=False):
    """vLLM's beam_search (serving_engine / protocol.py), each step through the server."""
    eos = eos_id(url)
    prompt_ids = post(url, "/tokenize", {"prompt": prompt})["tokens"]
    beams = [(list(prompt_ids), 0.0)]
    completed = []
    for _ in range(max_tokens):
        cands = []
        for toks, cum in beams:
            r = post(url, "/v1/completions", dict(model="tiny", prompt=toks, max_tokens=1,
                                                 logprobs=2 * width, temperature=0,
                                                 return_tokens_as_token_ids=True))
            for k, lp in r["choices"][0]["logprobs"]["top_logprobs"][0].items():
                cands.append((toks, int(k.split(":")[1]), cum + lp))
        live = []
        for toks, t, c in cands:
            if t == eos and not ignore_eos:
                completed.append((toks + [eos] if include_stop else toks, c, "stop"))
            else:
                live.append((toks + [t], c))
        live.sort(key=lambda b: -b[1])
        beams = live[:width]
    completed += [(t, c, "length") for t, c in beams]

    def score(b):
        n = len(b[0]) - (1 if b[0][-1] == eos else 0)
        return b[1] / n ** length_penalty

    best = sorted(completed, key=score, reverse=True)[:width]
    out = []
    for toks, cum, reason in best:
        gen = toks[len(prompt_ids):]
        shown = gen[:-1] if gen and gen[-1] == eos and not ignore_eos else gen
        text = post(url, "/detokenize", {"tokens": shown})["prompt"] if shown else ""
        out.append((text, len(gen), reason, cum))
    return out


def beam(url, prompt, width, max_tokens, **kw):
    body = dict(model="tiny", prompt=prompt, n=width, max_tokens=max_tokens,
                use_beam_search=True, temperature=0, **kw)
    r = post(url, "/v1/completions", body)
    return r


def summary(resp):
    return [(c["text"], c["finish_reason"]) for c in resp["choices"]]


@pytest.mark.skipif(on_gpu(), reason="beams batched differently than the reference's steps; " + CPU_EXACT)
@pytest.mark.parametrize("prompt,width,max_tokens,kw", [
    (PROMPT, 3, 8, {}),
    (PROMPT, 1, 6, {}),
    (EOS_PROMPT, 10, 6, {}),
    (EOS_PROMPT, 10, 6, {"length_penalty": 0.0}),
    (EOS_PROMPT, 10, 6, {"length_penalty": 2.0}),
    (EOS_PROMPT, 10, 6, {"include_stop_str_in_output": True}),
    (EOS_PROMPT, 4, 5, {"ignore_eos": True}),
])
def test_equals_reference(colocated, prompt, width, max_tokens, kw):
    url = colocated.url
    ref = reference(url, prompt, width, max_tokens, length_penalty=kw.get("length_penalty", 1.0),
                    ignore_eos=kw.get("ignore_eos", False),
                    include_stop=kw.get("include_stop_str_in_output", False))
    r = beam(url, prompt, width, max_tokens, **kw)
    assert summary(r) == [(t, reason) for t, _, reason, _ in ref]
    assert [c["index"] for c in r["choices"]] == list(range(width))
    assert r["usage"]["completion_tokens"] == sum(n for _, n, _, _ in ref)
    eos = eos_id(url)
    for c, (_, _, reason, _) in zip(r["choices"], ref):
        assert c["stop_reason"] == (eos if reason == "stop" else None)


def test_length_penalty_changes_ranking(colocated):
    url = colocated.url
    short_first = beam(url, EOS_PROMPT, 10, 6, length_penalty=0.0)["choices"]
    long_first = beam(url, EOS_PROMPT, 10, 6, length_penalty=2.0)["choices"]
    # the beam ended by eos at the first step: best with no length normalization,
    # beaten by the longer beams when length is rewarded
    assert short_first[0]["finish_reason"] == "stop" and short_first[0]["text"] == ""
    assert long_first[0]["finish_reason"] == "length"
    assert [c["text"] for c in short_first] != [c["text"] for c in long_first]


@pytest.mark.skipif(on_gpu(), reason="beams batched differently than the reference's steps; " + CPU_EXACT)
def test_prompts_and_openai_client(colocated):
    """A list of prompts: each gets its own search, choices p * n .. p * n + n - 1."""
    c = openai.OpenAI(base_url=colocated.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    r = c.completions.create(model="tiny", prompt=[PROMPT, EOS_PROMPT], n=2, max_tokens=5,
                             temperature=0, extra_body={"use_beam_search": True})
    one = [beam(colocated.url, p, 2, 5) for p in (PROMPT, EOS_PROMPT)]
    assert [ch.text for ch in r.choices] == [ch["text"] for o in one for ch in o["choices"]]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]


def test_completions_stream_is_one_body(colocated):
    """vLLM does not stream beam search on /v1/completions: one JSON body."""
    r = requests.post(colocated.url + "/v1/completions", timeout=TIMEOUT,
                      json=dict(model="tiny", prompt=PROMPT, n=2, max_tokens=5, temperature=0,
                                use_beam_search=True, stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert summary(r.json()) == summary(beam(colocated.url, PROMPT, 2, 5))


@pytest.mark.skipif(on_gpu(), reason="beams batched differently than the reference's steps; " + CPU_EXACT)
def test_chat(colocated):
    msgs = [{"role": "user", "content": "What is the state of the Union?"}]
    body = dict(model="tiny", messages=msgs, n=3, max_tokens=6, temperature=0, use_beam_search=True)
    full = post(colocated.url, "/v1/chat/completions", body)
    texts = [c["message"]["content"] for c in full["choices"]]
    assert len(set(texts)) == 3
    # the chat prompt through completions (the rendered ids) gives the same beams
    ids = post(colocated.url, "/tokenize", {"messages": msgs, "add_generation_prompt": True})["tokens"]
    cm = beam(colocated.url, ids, 3, 6)
    assert texts == [c["text"] for c in cm["choices"]]
    # streaming: each beam's text in one delta at the end, then its finish chunk
    r = requests.post(colocated.url + "/v1/chat/completions", json=dict(body, stream=True),
                      timeout=TIMEOUT, stream=True)
    assert r.status_code == 200
    got = {}
    reasons = {}
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ch = json.loads(line[6:])["choices"][0]
        got[ch["index"]] = got.get(ch["index"], "") + (ch["delta"].get("content") or "")
        if ch["finish_reason"]:
            reasons[ch["index"]] = ch["finish_reason"]
    assert [got[i] for i in range(3)] == texts
    assert reasons == {0: "length", 1: "length", 2: "length"}


@pytest.mark.parametrize("body,param,needle", [
    ({"n": 11}, "n", "accepted with use_beam_search: n from 1 to 10"),
    ({"n": 2, "best_of": 3}, "best_of", "must equal 'n'"),
    ({"logprobs": 2}, "logprobs", "not returned with use_beam_search"),
    ({"stop": ["x"]}, "stop", "not applied by beam search"),
    ({"top_p": 0.5}, "top_p", "not applied by beam search"),
    ({"seed": 1}, "seed", "not applied by beam search"),
    ({"echo": True}, "echo", "not available with use_beam_search"),
    ({"guided_regex": "a+"}, "guided_regex", "not applied by beam search"),
    ({"length_penalty": "long"}, "length_penalty", "must be a number"),
    ({"use_beam_search": "yes"}, "use_beam_search", "must be a boolean"),
])
def test_bad_values(colocated, body, param, needle):
    b = dict(model="tiny", prompt=PROMPT, max_tokens=4, use_beam_search=True)
    b.update(body)
    r = requests.post(colocated.url + "/v1/completions", json=b, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_client_leaves_mid_search(colocated):
    """The step requests in flight are aborted and no further step is submitted: the server
    drains to no load and keeps answering (under ASan the fixture's exit checks leaks)."""
    import time
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(colocated.url + "/v1/completions", timeout=0.5,
                      json=dict(model="tiny", prompt=PROMPT, n=4, max_tokens=400,
                                use_beam_search=True, temperature=0))
    deadline = time.time() + 30
    while requests.get(colocated.url + "/load", timeout=5).json()["server_load"] and time.time() < deadline:
        time.sleep(0.1)
    assert requests.get(colocated.url + "/load", timeout=5).json()["server_load"] == 0
    assert summary(beam(colocated.url, PROMPT, 2, 3))


def test_max_logprobs_caps_width():
    s = Server(*COMMON, "--max-logprobs", "6")
    try:
        r = requests.post(s.url + "/v1/completions", timeout=TIMEOUT,
                          json=dict(model="tiny", prompt=PROMPT, n=4, use_beam_search=True))
        assert r.status_code == 400 and "n from 1 to 3" in r.json()["error"]["message"], r.text
        assert summary(beam(s.url, PROMPT, 3, 4))
    finally:
        assert s.stop() == 0, s.logs()


def test_pd_equals_colocated(colocated):
    """Through the proxy: P prefills (a one-step search, n 1, max_tokens 1, keeping the
    prompt's KV); D's first step pulls it, every later step hits D's prefix cache."""
    p = Prefill()
    d = decode()
    px = ProxyProc([p], [d])
    try:
        px.wait_ready(30)
        url = f"http://127.0.0.1:{px.port}"
        for prompt, kw in ((PROMPT, {}), (EOS_PROMPT, {"length_penalty": 0.5})):
            got = beam(url, prompt, 4, 6, **kw)
            want = beam(colocated.url, prompt, 4, 6, **kw)
            assert summary(got) == summary(want)
            assert got["usage"]["kv_transfer"]["received_prompt_tokens"] > 0, got["usage"]
    finally:
        px.proc.terminate()
        assert px.proc.wait(10) == 0, px.output()
        assert d.stop() == 0, d.logs()
        assert p.server.stop() == 0, p.server.logs()
