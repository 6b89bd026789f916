"""A token id in the padded tail of the vocabulary: Qwen2.5's embedding has 151936
rows, its tokenizer 151665 tokens.  A model that emits such an id must not end the stream
with "detokenization failed": Hugging Face tokenizers and vLLM decode it to an empty string
and carry on, and so does `disagg serve` (text "", logprob token "").

The model: the tiny random Qwen2 (tools/gen_random_qwen2.py, untied, f32) with its lm_head
zeroed except rows 151900 = +1 and 151901 = -1, so one of those two padded ids wins every
greedy step whatever the hidden state."""
import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import requests

from server_harness import ROOT, Server

PAD_A, PAD_B = 151900, 151901


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("padded-vocab")
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_random_qwen2.py"), "--out", str(d),
                    "--shape", "tiny", "--dtype", "f32", "--untied"], check=True,
                   stdout=subprocess.DEVNULL)
    path = d / "model.safetensors"
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        info = json.loads(f.read(n))["lm_head.weight"]
    assert info["dtype"] == "F32"
    rows, hidden = info["shape"]
    b, e = info["data_offsets"]
    w = np.memmap(path, dtype=np.float32, mode="r+", offset=8 + n + b, shape=(rows, hidden))
    w[:] = 0
    w[PAD_A] = 1.0
    w[PAD_B] = -1.0
    w.flush()
    del w
    return str(d)


def test_padded_ids_decode_to_nothing(padded_model):
    s = Server("--max-model-len", "256", "--kv-cache-memory", "16M", model=padded_model)
    try:
        body = {"model": "tiny", "prompt": "the state of the Union", "max_tokens": 6,
                "temperature": 0, "ignore_eos": True, "logprobs": 0}
        r = requests.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "length", c
        assert c["text"] == ""
        assert r.json()["usage"]["completion_tokens"] == 6
        assert c["logprobs"]["tokens"] == [""] * 6
        ids = requests.post(s.url + "/v1/completions", timeout=60,
                            json=dict(body, return_tokens_as_token_ids=True)).json()
        got = [int(t.split(":")[1]) for t in ids["choices"][0]["logprobs"]["tokens"]]
        assert set(got) <= {PAD_A, PAD_B}, got  # the model really emitted padded ids
        # streaming: every chunk arrives, the last says "length", nothing says "error"
        with requests.post(s.url + "/v1/completions", json=dict(body, stream=True), stream=True,
                           timeout=60) as st:
            assert st.status_code == 200
            events = [json.loads(line[6:]) for line in st.iter_lines(decode_unicode=True)
                      if line.startswith("data: ") and line != "data: [DONE]"]
        reasons = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
        assert reasons[-1] == "length" and "error" not in reasons, events
        assert "detokeniz" not in s.logs()
    finally:
        s.stop()
