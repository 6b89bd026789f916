"""The architectures beside Qwen2 through `disagg serve`: the random tiny Llama 3
(llama3 rope, tied), Qwen3 (q/k norm, head_dim 32 != 64/4, yarn, tied) and Mistral (sliding
window 8 shorter than the prompts, head_dim 24, linear rope) checkpoints of
tools/gen_random_model.py, against the logits transformers computed for them
(tests/data/model/golden-<variant>.json, tools/gen_golden_arch.py): greedy output and
prompt logprobs through the server equal transformers' on the CPU; P/D (a kv_producer and a
kv_consumer moving the KV) equals colocated for each, including prompts sharing a prefix
(the prefix cache) and prompts longer than Mistral's window; a P/D pair of two models, or of
two windows, is refused with the layout named; --load-format dummy serves config.json alone.
The mixtures of experts (Qwen3-MoE with a dense layer among sparse ones, Mixtral with its
sliding window) go through the same checks."""
import json
import re
import shutil
import subprocess
import sys

import pytest
import requests

import server_harness
from server_harness import DATA, ROOT, Server, free_port
from test_pd import PD, TIMEOUT, assert_kv_pulled, consumer_config, producer_config
from test_server_logprobs import check_against_logits

VARIANTS = ["llama-tiny", "qwen3-tiny", "mistral-tiny", "qwen3moe-tiny", "mixtral-tiny"]
GOLDEN = {v: json.loads((DATA / "model" / f"golden-{v}.json").read_text()) for v in VARIANTS}
COMMON = ("--max-model-len", "512", "--kv-cache-memory", "64M", "--block-size", "16")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for v in VARIANTS:
        d = tmp_path_factory.mktemp(v)
        got = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_random_model.py"), "--out", str(d),
                              "--variant", v], check=True, capture_output=True, text=True).stdout
        assert f"weights_sha256 {GOLDEN[v]['weights_sha256']}" in got
        out[v] = d
    return out


@pytest.fixture(scope="module")
def colocated(models):
    servers = {}
    try:
        for v in VARIANTS:
            servers[v] = Server(*COMMON, model=str(models[v]), name="tiny")
        yield servers
    finally:
        for s in servers.values():
            assert s.stop() == 0


@pytest.mark.skipif(server_harness.on_gpu(), reason=server_harness.CPU_EXACT)
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_and_prompt_logprobs_match_transformers(colocated, variant):
    srv = colocated[variant]
    for c in GOLDEN[variant]["cases"]:
        n_prompt = len(c["prompt_ids"])
        body = {"model": "tiny", "prompt": c["prompt_ids"], "max_tokens": len(c["greedy"]), "temperature": 0,
                "repetition_penalty": 1.0, "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True,
                "prompt_logprobs": 16}
        r = requests.post(srv.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        got = [int(t.split(":")[1]) for t in ch["logprobs"]["tokens"]]
        assert got == c["greedy"], (variant, n_prompt)
        plp = ch["prompt_logprobs"]
        for row in c["rows"]:
            p = row["pos"]
            if p + 1 < n_prompt:
                e = plp[p + 1]
                ours = {int(k): v["logprob"] for k, v in e.items() if v["rank"] is not None}
                extra = {int(k): v["logprob"] for k, v in e.items() if v["rank"] is None}
                check_against_logits(ours, row, extra)
            else:
                ours = {int(k.split(":")[1]): v for k, v in ch["logprobs"]["top_logprobs"][0].items()}
                check_against_logits(ours, row)


def pd_for(model_dir, d_dir=None):
    """A producer of model_dir and a consumer of d_dir (default the same)."""
    pd = PD.__new__(PD)
    pd.boot_port = free_port()
    pd.p = Server(*COMMON, "--kv-transfer-config", producer_config(), model=str(model_dir),
                  env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(pd.boot_port)})
    try:
        pd.d = Server(*COMMON, "--kv-transfer-config", consumer_config(), model=str(d_dir or model_dir))
    except Exception:
        pd.p.stop()
        raise
    pd.bootstrap = f"http://127.0.0.1:{pd.boot_port}"
    pd.engine_id = requests.get(pd.bootstrap + "/query", timeout=10).json()["0"]["engine_id"]
    return pd


def ids_of(r):
    assert r.status_code == 200, r.text
    return [int(t.split(":", 1)[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_pd_equals_colocated(models, colocated, variant):
    pd = pd_for(models[variant])
    try:
        base = [int(x) for x in GOLDEN[variant]["cases"][3]["prompt_ids"]]  # 200 tokens: > the window
        prompts = [base[:5], base[:40], base, base[:120] + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
        for i, prompt in enumerate(prompts):  # the last shares 120 tokens with the third: D's prefix cache
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0,
                    "ignore_eos": True, "return_tokens_as_token_ids": True}
            cr = requests.post(colocated[variant].url + "/v1/completions", json=body, timeout=TIMEOUT)
            ref = ids_of(cr)
            pr, dr = pd.send(body)
            assert pr.status_code == 200, pr.text
            assert ids_of(dr) == ref, (variant, len(prompt))
            assert_kv_pulled(dr.json()["usage"])
            if i == 3:  # 7 blocks of 16 of its first 120 tokens came from the prefix caches
                for u in (cr.json()["usage"], dr.json()["usage"]):
                    assert (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) >= 112, u
    finally:
        pd.stop()


def test_pd_of_different_models_or_windows_is_refused(models, tmp_path):
    """The layout fingerprint names the family, the RoPE and the window: Llama P with Qwen3 D
    (both 2 layers, 2 KV heads), two Llamas that differ only in rope_scaling (Llama 3.1's llama3
    scaling against 3.0's none: the cached K differ), and two Mistrals whose windows differ, are
    refused before a byte moves."""
    other = tmp_path / "mistral-w16"
    shutil.copytree(models["mistral-tiny"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["sliding_window"] = 16
    (other / "config.json").write_text(json.dumps(cfg))
    plain = tmp_path / "llama-no-scaling"
    shutil.copytree(models["llama-tiny"], plain)
    cfg = json.loads((plain / "config.json").read_text())
    assert cfg.pop("rope_scaling")["rope_type"] == "llama3"
    (plain / "config.json").write_text(json.dumps(cfg))
    for p_dir, d_dir, needles in [(models["llama-tiny"], models["qwen3-tiny"], ["llama:L2:", "qwen3:L2:"]),
                                  (models["llama-tiny"], plain, [":rope"]),
                                  (models["mistral-tiny"], other, [":swa8", ":swa16"])]:
        pd = pd_for(p_dir, d_dir)
        try:
            prompt = [int(x) for x in GOLDEN["llama-tiny"]["cases"][2]["prompt_ids"]]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 0,
                    "return_tokens_as_token_ids": True}
            pr, dr = pd.send(body)
            assert dr.status_code != 200 or dr.json()["usage"]["kv_transfer"]["received_prompt_tokens"] == 0
            log = pd.p.logs()
            assert "refusing a pull: KV layout mismatch" in log, log
            for n in needles:
                assert n in log, (n, log)
            ropes = set(re.findall(r":rope([0-9a-f]{8})", log))
            if d_dir == plain:  # the RoPE is the one difference
                assert len(ropes) == 2, (ropes, log)
            if d_dir == other:  # the window is: the same RoPE
                assert len(ropes) == 1, (ropes, log)
        finally:
            pd.stop()


def test_load_format_dummy_serves_config_alone(models, tmp_path):
    """vLLM's --load-format dummy: config.json (and the tokenizer files) without safetensors."""
    d = tmp_path / "dummy"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (models["qwen3-tiny"] / f).exists():
            shutil.copy(models["qwen3-tiny"] / f, d / f)
    with pytest.raises(RuntimeError, match="safetensors"):
        Server(*COMMON, model=str(d), ready_timeout=30)
    s = Server(*COMMON, "--load-format", "dummy", model=str(d))
    try:
        r = requests.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4,
                                                           "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert s.stop() == 0
