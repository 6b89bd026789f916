"""An FP8 KV cache (--kv-cache-dtype fp8, e4m3) in P/D, through the real `disagg proxy`:
P and D both fp8 give the same greedy text as a colocated fp8 server, with the KV really
moved (a quarter of the f32 bytes); P fp8 with D auto (float32 on the CPU) is refused at the
first request, the error naming both dtypes, and the client gets an error instead of a
silently mis-read cache.  A checkpoint with per-layer k_scale / v_scale (vLLM's names; the older
kv_scale) serves with them, its fingerprint carries them, and a decoder of another checkpoint's
scales is refused naming both; a bad scale tensor is refused at start-up naming it."""
import json
import os
import shutil
import struct
import subprocess

import openai
import pytest
import requests

from proxy_fixtures import ProxyProc
from server_harness import BIN, MODEL, Server, free_port
from test_pd import COMMON, assert_kv_pulled, consumer_config, producer_config, wait_blocks_zero

TIMEOUT = 120
FP8 = ("--kv-cache-dtype", "fp8")


class Prefill:
    """A kv_producer `disagg serve` with its own bootstrap port (ProxyProc reads url and
    bootstrap_port)."""

    def __init__(self, *args, model=None):
        self.bootstrap_port = free_port()
        self.server = Server(*COMMON, *args, "--kv-transfer-config", producer_config(),
                             env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap_port)},
                             **({"model": model} if model else {}))
        self.url = self.server.url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


PROMPTS = ["Fellow-Citizens of the Senate and House of Representatives:",
           "The state of the Union is strong, and " * 12]


def test_pd_fp8_both_sides_equals_colocated_fp8():
    colocated = Server(*COMMON, *FP8)
    try:
        want = [client(colocated.url).completions.create(model="tiny", prompt=p, max_tokens=20,
                                                          temperature=0).choices[0].text
                for p in PROMPTS]
    finally:
        colocated.stop()
    p = Prefill(*FP8)
    d = None
    px = None
    try:
        d = Server(*COMMON, *FP8, "--kv-transfer-config", consumer_config())
        px = ProxyProc([p], [d])
        px.wait_ready(30)
        m0 = p.server.metrics()
        for prompt, w in zip(PROMPTS, want):
            got = client(px.url).completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                                    temperature=0)
            assert got.choices[0].text == w, (prompt, got.choices[0].text, w)
            assert_kv_pulled(got.usage.model_dump(), computed=0)
        m = p.server.metrics()
        assert m["disagg:kv_transfer_bytes_total"] > m0.get("disagg:kv_transfer_bytes_total", 0)
        log = open(p.server.log_path).read()
        assert "KV dtype mismatch" not in log and "KV layout mismatch" not in log, log
        wait_blocks_zero(p.server)
        wait_blocks_zero(d)
    finally:
        if px:
            px.proc.terminate()
            px.proc.wait(10)
        if d:
            d.stop()
        p.server.stop()


@pytest.mark.parametrize("d_args", [(), ("--kv-cache-dtype", "bfloat16")], ids=["auto", "bf16"])
def test_pd_kv_dtype_mismatch_refused_naming_both(d_args):
    """P fp8, D auto (float32 on the CPU) or bfloat16: P refuses the pull before writing a byte
    with 'KV dtype mismatch: prefill float8_e4m3fn, decode <D's>'; the client behind the proxy
    gets an error status (no text decoded from a mis-read cache); D's blocks come back."""
    d_name = "bfloat16" if d_args else "float32"
    p = Prefill(*FP8)
    d = None
    px = None
    try:
        d = Server(*COMMON, *d_args, "--kv-transfer-config", consumer_config())
        px = ProxyProc([p], [d])
        px.wait_ready(30)
        r = requests.post(px.url + "/v1/completions",
                          json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8,
                                "temperature": 0}, timeout=TIMEOUT)
        assert r.status_code >= 400, r.text
        want = f"KV dtype mismatch: prefill float8_e4m3fn, decode {d_name}"
        assert want in r.text, r.text
        assert f"refusing a pull: {want}" in open(p.server.log_path).read()
        wait_blocks_zero(d)
    finally:
        if px:
            px.proc.terminate()
            px.proc.wait(10)
        if d:
            d.stop()
        p.server.stop()


def with_scales(dst, scales):
    """A copy of the tiny model whose safetensors also hold scalar F32 tensors (name -> value)."""
    shutil.copytree(MODEL, dst)
    path = os.path.join(dst, "model.safetensors")
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    for name, v in scales.items():
        header[name] = {"dtype": "F32", "shape": [], "data_offsets": [len(data), len(data) + 4]}
        data += struct.pack("<f", v)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return dst


def scale_names(n_layers, k, v, old_layer=None):
    out = {}
    for layer in range(n_layers):
        if layer == old_layer:  # the older single name for both
            out[f"model.layers.{layer}.self_attn.kv_scale"] = k
        else:
            out[f"model.layers.{layer}.self_attn.k_scale"] = k
            out[f"model.layers.{layer}.self_attn.v_scale"] = v
    return out


def n_layers():
    return json.load(open(os.path.join(MODEL, "config.json")))["num_hidden_layers"]


def test_checkpoint_scales_used_and_a_pair_of_other_scales_refused(tmp_path):
    scaled = with_scales(str(tmp_path / "scaled"), scale_names(n_layers(), 0.05, 0.02, old_layer=1))
    p = Prefill(*FP8, model=scaled)
    d = None
    px = None
    try:
        log = open(p.server.log_path).read()
        assert "FP8 KV cache: e4m3 with per-tensor scales k_scale / v_scale from the checkpoint" in log
        r = requests.post(p.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0],
                                                           "max_tokens": 8, "temperature": 0},
                          timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        d = Server(*COMMON, *FP8, "--kv-transfer-config", consumer_config())  # scales 1.0
        px = ProxyProc([p], [d])
        px.wait_ready(30)
        r = requests.post(px.url + "/v1/completions",
                          json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8,
                                "temperature": 0}, timeout=TIMEOUT)
        assert r.status_code >= 400, r.text
        assert "KV scales mismatch: prefill kvs" in r.text and "decode 1.0" in r.text, r.text
        wait_blocks_zero(d)
    finally:
        if px:
            px.proc.terminate()
            px.proc.wait(10)
        if d:
            d.stop()
        p.server.stop()
    # the same scales with a bf16 cache: loaded, not used (they apply to fp8), logged
    s = Server(*COMMON, "--kv-cache-dtype", "bfloat16", model=scaled)
    try:
        assert "k_scale / v_scale are not used: the KV cache is bfloat16" in s.logs(), s.logs()
    finally:
        s.stop()


@pytest.mark.parametrize("value,words", [(-1.0, "must be positive and finite"),
                                         (float("inf"), "must be positive and finite")])
def test_bad_checkpoint_scale_refused_at_start(tmp_path, value, words):
    bad = with_scales(str(tmp_path / "bad"), {"model.layers.0.self_attn.k_scale": value})
    r = subprocess.run([BIN, "serve", bad, "--port", "0", "--kv-cache-dtype", "fp8",
                        "--kv-cache-memory", "16M", "--max-model-len", "256"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stderr
    assert "model.layers.0.self_attn.k_scale" in r.stderr and words in r.stderr, r.stderr


def test_output_scale_names(tmp_path):
    """Older llm-compressor checkpoints name the KV scales k_proj.output_scale /
    v_proj.output_scale (vLLM remaps them): the same scales as k_scale / v_scale, the same
    answers to the last logprob."""
    n = n_layers()
    new = with_scales(str(tmp_path / "new"), scale_names(n, 0.05, 0.02))
    old = {}
    for layer in range(n):
        old[f"model.layers.{layer}.self_attn.k_proj.output_scale"] = 0.05
        old[f"model.layers.{layer}.self_attn.v_proj.output_scale"] = 0.02
    old = with_scales(str(tmp_path / "old"), old)
    got = []
    for m in (new, old):
        s = Server(*COMMON, *FP8, model=m)
        try:
            assert "per-tensor scales k_scale / v_scale from the checkpoint" in open(s.log_path).read()
            r = requests.post(s.url + "/v1/completions", json={
                "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "logprobs": 3,
                "ignore_eos": True}, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["logprobs"])
        finally:
            assert s.stop() == 0
    assert got[0] == got[1]
