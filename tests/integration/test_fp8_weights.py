"""FP8 checkpoints through `disagg serve` on the CPU (the f32 dequantization at load): the random
tiny compressed-tensors per-channel Llama of tools/gen_random_fp8.py gives transformers' greedy
output and prompt logprobs (tests/data/model/golden-llama-fp8-channel-tiny.json: transformers on
the checkpoint's f32-dequantized twin, tools/gen_golden_fp8.py); a P/D pair serving it equals
colocated; quantization methods disagg lacks, and FP8 tensors without their scales, are refused
at load naming what was wrong and what is accepted."""
import json
import shutil
import subprocess
import sys

import pytest
import requests

import server_harness
from server_harness import BIN, DATA, ROOT, Server
from test_models_arch import COMMON, ids_of, pd_for
from test_pd import TIMEOUT, assert_kv_pulled
from test_server_logprobs import check_against_logits

VARIANT = "llama-fp8-channel-tiny"
GOLDEN = json.loads((DATA / "model" / f"golden-{VARIANT}.json").read_text())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp(VARIANT)
    got = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_random_fp8.py"), "--out", str(d),
                          "--variant", VARIANT], check=True, capture_output=True, text=True).stdout
    assert f"weights_sha256 {GOLDEN['weights_sha256']}" in got
    return d


@pytest.fixture(scope="module")
def colocated(model):
    s = Server(*COMMON, model=str(model), name="tiny")
    try:
        yield s
    finally:
        assert s.stop() == 0


@pytest.mark.skipif(server_harness.on_gpu(), reason=server_harness.CPU_EXACT)
def test_greedy_and_prompt_logprobs_match_transformers(colocated):
    for c in GOLDEN["cases"]:
        n_prompt = len(c["prompt_ids"])
        body = {"model": "tiny", "prompt": c["prompt_ids"], "max_tokens": len(c["greedy"]), "temperature": 0,
                "repetition_penalty": 1.0, "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True,
                "prompt_logprobs": 16}
        r = requests.post(colocated.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert [int(t.split(":")[1]) for t in ch["logprobs"]["tokens"]] == c["greedy"], n_prompt
        plp = ch["prompt_logprobs"]
        for row in c["rows"]:
            p = row["pos"]
            if p + 1 < n_prompt:
                e = plp[p + 1]
                ours = {int(k): v["logprob"] for k, v in e.items() if v["rank"] is not None}
                extra = {int(k): v["logprob"] for k, v in e.items() if v["rank"] is None}
                check_against_logits(ours, row, extra)


def test_pd_equals_colocated(model, colocated):
    pd = pd_for(model)
    try:
        base = [int(x) for x in GOLDEN["cases"][3]["prompt_ids"]]
        for prompt in (base[:40], base):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0,
                    "ignore_eos": True, "return_tokens_as_token_ids": True}
            ref = ids_of(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))
            pr, dr = pd.send(body)
            assert pr.status_code == 200, pr.text
            assert ids_of(dr) == ref, len(prompt)
            assert_kv_pulled(dr.json()["usage"])
    finally:
        pd.stop()


def generate(model_dir):
    return subprocess.run([BIN, "generate", str(model_dir), "--prompt-ids", "1,2,3", "--ids", "--max-tokens", "1"],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("qc,needles", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, ['quant_method "awq" is not supported', 'accepted:',
                                                            '"fp8"', '"compressed-tensors"']),
    ({"quant_method": "gptq", "bits": 4}, ['"gptq" is not supported']),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int",
                                                                                 "strategy": "channel"}}}},
     ["weights are int", "int8 w8a8", "accepted:"]),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, ['"modelopt" is not supported']),
])
def test_unsupported_methods_refused(model, tmp_path, qc, needles):
    d = tmp_path / "m"
    shutil.copytree(model, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    r = generate(d)
    assert r.returncode != 0
    for n in needles:
        assert n in r.stderr, r.stderr


@pytest.mark.parametrize("extra,needles", [
    ({"transform_config": {"config_groups": {"u": {"type": "hadamard", "apply": []}}}},
     ["transform_config", "not supported", "accepted:"]),
    ({"sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}},
     ['sparsity_config format "sparse-24-bitmask"', 'accepted: format "dense"']),
    ({"sparsity_config": {"format": "dense", "sparsity_structure": "unstructured"}}, None),
])
def test_compressed_tensors_extras(model, tmp_path, extra, needles):
    """The parts of a compressed-tensors config that change the math beyond FP8 weights are
    refused by name; a dense sparsity_config (values stored as they are) loads."""
    d = tmp_path / "m"
    shutil.copytree(model, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(extra)
    (d / "config.json").write_text(json.dumps(cfg))
    r = generate(d)
    if needles is None:
        assert r.returncode == 0, r.stderr
        return
    assert r.returncode != 0
    for n in needles:
        assert n in r.stderr, r.stderr


@pytest.mark.parametrize("name,body,needles", [
    ("quantize_config.json", {"bits": 4, "group_size": 128, "quant_method": "gptq"},
     ["a gptq-quantized checkpoint", "quantize_config.json", "accepted:"]),
    ("quantize_config.json", {"w_bit": 4, "q_group_size": 128}, ["gptq or awq", "accepted:"]),
    ("hf_quant_config.json", {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}},
     ["a NVFP4-quantized checkpoint", "hf_quant_config.json", "accepted:"]),
])
def test_quantization_beside_config_refused(model, tmp_path, name, body, needles):
    """AutoGPTQ/AutoAWQ's quantize_config.json and ModelOpt's hf_quant_config.json describe the
    quantization beside an unquantized-looking config.json: refused by name at load, not as a
    missing tensor."""
    d = tmp_path / "m"
    shutil.copytree(model, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    (d / name).write_text(json.dumps(body))
    r = generate(d)
    assert r.returncode != 0
    for n in needles:
        assert n in r.stderr, r.stderr


def test_fp8_without_scales_or_config_refused(model, tmp_path):
    # no quantization_config: the F8_E4M3 tensors are refused naming the missing config
    d = tmp_path / "noqc"
    shutil.copytree(model, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    r = generate(d)
    assert r.returncode != 0 and "F8_E4M3" in r.stderr and "quantization_config" in r.stderr, r.stderr


ONLINE = "qwen2-online-tiny"


@pytest.mark.skipif(server_harness.on_gpu(), reason=server_harness.CPU_EXACT)
def test_quantization_flag_end_to_end(model, tmp_path):
    """`serve -q fp8` on an unquantized checkpoint quantizes at load: greedy output and prompt
    logprobs equal transformers on the per-channel twin (golden-qwen2-online-tiny.json), and
    differ from the same checkpoint served unquantized; on an FP8 checkpoint the flag changes
    nothing; with -tp 2 it is refused naming what is accepted."""
    golden = json.loads((DATA / "model" / f"golden-{ONLINE}.json").read_text())
    d = tmp_path / ONLINE
    got = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_random_fp8.py"), "--out", str(d),
                          "--variant", ONLINE], check=True, capture_output=True, text=True).stdout
    assert f"weights_sha256 {golden['weights_sha256']}" in got

    def first_logprobs(srv, c):
        body = {"model": "tiny", "prompt": c["prompt_ids"], "max_tokens": len(c["greedy"]), "temperature": 0,
                "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True, "prompt_logprobs": 16}
        r = requests.post(srv.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    q = Server(*COMMON, "--quantization", "fp8", model=str(d), name="tiny")
    plain = Server(*COMMON, model=str(d), name="tiny")
    try:
        for c in golden["cases"]:
            ch = first_logprobs(q, c)
            assert [int(t.split(":")[1]) for t in ch["logprobs"]["tokens"]] == c["greedy"], len(c["prompt_ids"])
            n_prompt = len(c["prompt_ids"])
            for row in c["rows"]:
                p = row["pos"]
                if p + 1 < n_prompt:
                    e = ch["prompt_logprobs"][p + 1]
                    ours = {int(k): v["logprob"] for k, v in e.items() if v["rank"] is not None}
                    extra = {int(k): v["logprob"] for k, v in e.items() if v["rank"] is None}
                    check_against_logits(ours, row, extra)
        c = golden["cases"][0]
        assert first_logprobs(q, c)["logprobs"]["top_logprobs"] != first_logprobs(plain, c)["logprobs"]["top_logprobs"]
    finally:
        assert q.stop() == 0 and plain.stop() == 0
    # an FP8 checkpoint: the flag is a no-op (the same greedy as the golden)
    s = Server(*COMMON, "--quantization", "fp8", model=str(model), name="tiny")
    try:
        c = GOLDEN["cases"][0]
        ch = first_logprobs(s, c)
        assert [int(t.split(":")[1]) for t in ch["logprobs"]["tokens"]] == c["greedy"]
    finally:
        assert s.stop() == 0
    r = subprocess.run([BIN, "serve", str(d), "--port", "0", "-tp", "2", "-q", "fp8"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "FP8 weights with tensor parallelism" in r.stderr, r.stderr
    assert "accepted: -tp 1 with FP8" in r.stderr, r.stderr


@pytest.mark.skipif(server_harness.on_gpu(), reason=server_harness.CPU_EXACT)
def test_compressed_tensors_block_grids(tmp_path):
    """compressed-tensors strategy "block" (block_structure [128, 128]) at hidden 64: every scale
    grid has one block row or one block column ([1, 2], [2, 1], [1, 1]).  The CPU's dequantized
    weights are then numpy's (the checkpoint's f32 twin, tools/gen_random_fp8.py --twin), so
    the served logprobs are the twin's exactly."""
    v = "qwen3-fp8-ctblock-tiny"
    d, twin = tmp_path / v, tmp_path / "twin"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_random_fp8.py"), "--out", str(d), "--variant", v,
                    "--twin", str(twin)], check=True, capture_output=True)
    body = {"model": "tiny", "prompt": [(k * 7919) % 150000 for k in range(40)], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True}
    got = []
    for m in (d, twin):
        s = Server(*COMMON, model=str(m), name="tiny")
        try:
            r = requests.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["logprobs"])
        finally:
            assert s.stop() == 0
    assert got[0] == got[1]
    # a block_structure that is not two positive integers is refused naming it
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["block_structure"] = [128]
    (d / "config.json").write_text(json.dumps(cfg))
    r = generate(d)
    assert r.returncode != 0 and "block_structure" in r.stderr and "two positive integers" in r.stderr, r.stderr
