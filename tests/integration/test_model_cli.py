"""disagg generate / disagg bench model on the random tiny Qwen2 model (tools/gen_random_qwen2.py):
greedy output equals Hugging Face transformers' greedy continuation recorded in
tests/data/model/golden-tiny-bf16.json; bad input gets a clear error and a usage exit code, never
a crash."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("DISAGG_BIN", os.path.join(ROOT, "build", "disagg"))
GOLDEN = json.load(open(os.path.join(ROOT, "tests", "data", "model", "golden-tiny-bf16.json")))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-bf16")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_random_qwen2.py"), "--out", str(d),
                          "--shape", "tiny", "--dtype", "bf16", "--seed", str(GOLDEN["seed"])],
                         check=True, capture_output=True, text=True).stdout
    assert f"weights_sha256 {GOLDEN['weights_sha256']}" in out
    return str(d)


def run(*args, timeout=120):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("case", [1, 2])
def test_greedy_matches_transformers(model, case):
    c = GOLDEN["cases"][case]
    ids = ",".join(str(i) for i in c["prompt_ids"])
    # --repetition-penalty 1: the model's generation_config.json asks for 1.05, transformers' greedy ran without
    r = run("generate", model, "--prompt-ids", ids, "--ids", "--temperature", "0", "--repetition-penalty", "1", "--ignore-eos",
            "--max-tokens", str(len(c["greedy"])), "--threads", "2")
    assert r.returncode == 0, r.stderr
    assert [int(x) for x in r.stdout.split()] == c["greedy"]


def test_text_prompt_streams_text(model):
    r = run("generate", model, "--prompt", "Hello, world", "--max-tokens", "5", "--temperature", "0.7",
            "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != ""
    again = run("generate", model, "--prompt", "Hello, world", "--max-tokens", "5", "--temperature", "0.7",
                "--seed", "1")
    assert again.stdout == r.stdout  # same seed, same text
    chat = run("generate", model, "--prompt", "Hi", "--chat", "--max-tokens", "3")
    assert chat.returncode == 0, chat.stderr
    assert "prompt tokens" in chat.stderr


@pytest.mark.parametrize("args,needle", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature -1"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p 1.5"),
    (["--prompt", "hi", "--top-k", "-5"], "top_k -5"),
    (["--prompt", "hi", "--min-p", "2"], "min_p 2"),
    (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["--prompt", "one two three four", "--max-model-len", "2"], "max_model_len is 2"),
    (["--prompt-ids", "1,2,x"], "--prompt-ids"),
    (["--prompt-ids", "999999999"], "outside the vocabulary"),
    (["--prompt", "hi", "--max-model-len", "100000"], "max_position_embeddings"),
    ([], "exactly one of --prompt"),
])
def test_bad_input(model, args, needle):
    r = run("generate", model, *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr


def test_missing_and_corrupt_model(tmp_path, model):
    r = run("generate", "NoSuchOrg/NoSuchModel", "--prompt", "hi")
    assert r.returncode == 1 and "huggingface-cli download NoSuchOrg/NoSuchModel" in r.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(open(os.path.join(model, "config.json")).read())
    (bad / "model.safetensors").write_bytes(open(os.path.join(model, "model.safetensors"), "rb").read()[:100000])
    r = run("generate", str(bad), "--prompt", "hi")
    assert r.returncode == 1 and "model.safetensors" in r.stderr and "truncated" in r.stderr


def test_bench_model_json(model):
    r = run("bench", "model", model, "--prompt-len", "32", "--gen-len", "4", "--threads", "2", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for k in ("prefill_tok_s", "decode_tok_s", "decode_weight_gb_s", "read_bw_gb_s", "gemm_gflop_s",
              "decode_vs_bound", "prefill_vs_gemm"):
        assert d[k] > 0, k
    r = run("bench", "model", model, "--prompt-len", "600")  # tiny model: 512 positions
    assert r.returncode == 2 and "max_position_embeddings" in r.stderr
    # a bf16 KV cache on the CPU (opt-in); a dtype the CPU lacks is refused with the list
    r = run("bench", "model", model, "--prompt-len", "32", "--gen-len", "4", "--threads", "2",
            "--repeat", "1", "--kv-cache-dtype", "bfloat16", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kv_dtype"] == "bfloat16" and d["decode_tok_s"] > 0, d
    r = run("bench", "model", model, "--kv-cache-dtype", "float16")
    assert r.returncode == 2 and "'float16'" in r.stderr and "float32, bfloat16" in r.stderr, r.stderr


SOTU = os.path.join(ROOT, "models", "disagg-sotu-tiny")
SOTU_GREEDY = json.load(open(os.path.join(ROOT, "tests", "data", "sotu-tiny", "greedy.json")))


@pytest.mark.parametrize("i", range(len(SOTU_GREEDY["prompts"])))
def test_generate_text_matches_transformers_on_trained_model(i):
    """Tokenizer + chat template + forward + streaming decode end to end: the text printed by
    `disagg generate --temperature 0` equals transformers' greedy output text."""
    p = SOTU_GREEDY["prompts"][i]
    args = ["generate", SOTU, "--prompt", p["prompt"], "--temperature", "0", "--max-tokens",
            str(SOTU_GREEDY["max_new_tokens"]), "--threads", "2"]
    if p["kind"] == "chat":
        assert p["messages"] == [{"role": "user", "content": p["prompt"]}]
        args.append("--chat")
    r = run(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout[:-1] == p["output_text"]  # generate ends the text with a newline
