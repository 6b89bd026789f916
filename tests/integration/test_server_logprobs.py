"""`disagg serve` logprobs against transformers: the random tiny Qwen2 model
(tools/gen_random_qwen2.py, as tests/integration/test_model_cli.py builds it) and the logits
that transformers computed for it (tests/data/model/golden-tiny-bf16.json).  Greedy output
through the server equals transformers' greedy continuation; prompt_logprobs and the
generated tokens' top logprobs rank the same tokens as transformers' logits, and their
differences equal the logit differences (log-softmax only subtracts a constant)."""
import json
import subprocess
import sys

import pytest
import requests

import server_harness
from server_harness import DATA, ROOT, Server

GOLDEN = json.loads((DATA / "model" / "golden-tiny-bf16.json").read_text())
TOL = 2e-3  # f32 compute from bf16 weights, different summation order than torch


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-bf16")
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_random_qwen2.py"), "--out", str(d),
                          "--shape", "tiny", "--dtype", "bf16", "--seed", str(GOLDEN["seed"])],
                         check=True, capture_output=True, text=True).stdout
    assert f"weights_sha256 {GOLDEN['weights_sha256']}" in out
    s = Server("--max-model-len", "512", "--kv-cache-memory", "64M", model=str(d), name="tiny")
    yield s
    rc = s.stop()
    assert rc == 0, "disagg serve did not exit cleanly on SIGTERM: " + s.logs()


def check_against_logits(ours, row, extra=()):
    """ours: {token id: logprob} of the server's top list; row: transformers' ids and logits at that
    position; extra: {token id: logprob} outside the top list (the actual prompt token)."""
    ref = dict(zip(row["ids"], row["logits"]))
    top = sorted(ours, key=lambda i: -ours[i])
    # the most likely token agrees unless transformers itself had a near tie
    if row["gap12"] > TOL:
        assert top[0] == row["ids"][0]
    # every returned alternative is one transformers ranks in its top 16 (or a near tie at the edge)
    edge = row["logits"][15]
    for i in top:
        assert i in row["ids"][:16] or (i in ref and abs(ref[i] - edge) < TOL), (i, row["pos"])
    # differences of logprobs equal differences of logits
    both = {**ours, **dict(extra)}
    for i in both:
        if i in ref:
            assert abs((both[i] - ours[top[0]]) - (ref[i] - ref[top[0]])) < TOL, (i, row["pos"])


@pytest.mark.skipif(server_harness.on_gpu(), reason=server_harness.CPU_EXACT)
@pytest.mark.parametrize("case", range(len(GOLDEN["cases"])))
def test_greedy_and_logprobs_match_transformers(srv, case):
    c = GOLDEN["cases"][case]
    n_prompt = len(c["prompt_ids"])
    body = {"model": "tiny", "prompt": c["prompt_ids"], "max_tokens": len(c["greedy"]), "temperature": 0,
            "repetition_penalty": 1.0, "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True,
            "prompt_logprobs": 16}
    r = requests.post(srv.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    got = [int(t.split(":")[1]) for t in lp["tokens"]]
    assert got == c["greedy"]
    plp = ch["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None
    for row in c["rows"]:
        p = row["pos"]
        if p + 1 < n_prompt:  # logits at p predict prompt token p + 1
            e = plp[p + 1]
            assert str(c["prompt_ids"][p + 1]) in e
            ours = {int(k): v["logprob"] for k, v in e.items() if v["rank"] is not None}
            extra = {int(k): v["logprob"] for k, v in e.items() if v["rank"] is None}
            assert sorted(v["rank"] for v in e.values() if v["rank"] is not None) == list(range(1, 17))
            check_against_logits(ours, row, extra)
            continue
        else:  # the last prompt position predicts the first generated token
            assert p == n_prompt - 1
            ours = {int(k.split(":")[1]): v for k, v in lp["top_logprobs"][0].items()}
        check_against_logits(ours, row)
    # the generated tokens' own logprobs are the top of their lists (greedy)
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert abs(max(top.values()) - val) < 1e-6


def test_qwen_chat_template_through_server(srv):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    t = requests.post(srv.url + "/tokenize", json={"messages": msgs}).json()
    text = requests.post(srv.url + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"]
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    r = requests.post(srv.url + "/v1/chat/completions",
                      json={"messages": msgs, "max_tokens": 4, "temperature": 0, "repetition_penalty": 1.0,
                            "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == t["count"]
