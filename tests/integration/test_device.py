"""`disagg serve --device` and `--kv-cache-dtype`: the compute backend is chosen at start-up
(kernels/backend.h).  Bad values are refused with the accepted list; --device cuda without
the CUDA module fails naming the module and what to do; auto falls back to the CPU and
serves; a KV dtype the device lacks is refused naming the device and its default."""
import os
import re
import subprocess

import requests

from server_harness import BIN, MODEL, Server


def run_cli(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([BIN, "serve", str(MODEL), "--port", "0", "--host", "127.0.0.1",
                           "--kv-cache-memory", "16M", "--max-model-len", "256", *args],
                          capture_output=True, text=True, timeout=120, env=e)


NO_MODULE = {"DISAGG_CUDA_MODULE": "/nonexistent/libdisagg_cuda.so"}


def test_bad_device_and_dtype_values():
    r = run_cli("--device", "tpu")
    assert r.returncode == 2 and "'tpu'" in r.stderr and "cuda:N" in r.stderr, r.stderr
    r = run_cli("--kv-cache-dtype", "int8")
    assert r.returncode == 2 and "'int8'" in r.stderr and "bfloat16" in r.stderr, r.stderr
    r = run_cli("--device", "cuda:x", env=NO_MODULE)
    assert r.returncode != 0 and "cuda:x" in r.stderr, r.stderr


def test_cuda_without_module_is_a_clear_error():
    for dev in ("cuda", "cuda:1"):
        r = run_cli("--device", dev, env=NO_MODULE)
        assert r.returncode == 1, r.stderr
        assert "libdisagg_cuda.so" in r.stderr and "--device cpu" in r.stderr, r.stderr


def test_kv_dtype_the_cpu_lacks():
    r = run_cli("--device", "cpu", "--kv-cache-dtype", "float16")
    assert r.returncode == 1, r.stderr
    assert "float16" in r.stderr and "cpu" in r.stderr and "float32" in r.stderr, r.stderr


def test_cpu_bf16_kv_cache_serves():
    """--kv-cache-dtype bfloat16 on the CPU (opt-in; half the KV bytes): K and V rounded to
    bf16, the attention widens them back; greedy output stays close to the f32 cache's."""
    body = {"model": "tiny", "prompt": "the state of the Union is", "max_tokens": 8,
            "temperature": 0}
    out = {}
    for dt in ("float32", "bfloat16"):
        s = Server("--device", "cpu", "--kv-cache-dtype", dt, "--kv-cache-memory", "16M",
                   "--max-model-len", "256")
        try:
            r = requests.post(s.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out[dt] = r.json()["choices"][0]["text"]
            assert r.json()["usage"]["completion_tokens"] == 8
            assert f"MiB, {dt})" in s.logs(), s.logs()
        finally:
            assert s.stop() == 0, s.logs()
    assert out["bfloat16"][:4] == out["float32"][:4], out


FP8_PROMPTS = ["the state of the Union is", "Mr. Speaker, the President of the United States",
               "our economy", "tonight I want to talk about", "we will not", "the American people"]


def blocks_of(log):
    m = re.search(r"KV cache (\d+) blocks x (\d+) tokens", log)
    assert m, log
    return int(m.group(1))


def test_cpu_fp8_kv_cache_serves_close_to_f32():
    """--kv-cache-dtype fp8 (vLLM's name; e4m3, scale 1.0 without checkpoint scales) serves on
    the CPU; the same --kv-cache-memory holds 4x the f32 blocks (2x bf16's); the dtype shows in
    the startup log and vllm:cache_config_info.  Greedy output against the f32 cache, measured
    (docs/server.md): a prompt's tokens may diverge only at a near tie of the f32 run (top-2
    logprob margin < 0.3 at the first differing position)."""
    out, blocks = {}, {}
    for dt in ("float32", "bfloat16", "fp8"):
        s = Server("--device", "cpu", "--kv-cache-dtype", dt, "--kv-cache-memory", "16M",
                   "--max-model-len", "256")
        try:
            log = s.logs()
            blocks[dt] = blocks_of(log)
            out[dt] = []
            for prompt in FP8_PROMPTS:
                r = requests.post(s.url + "/v1/completions",
                                  json={"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                        "temperature": 0, "ignore_eos": True, "logprobs": 2})
                assert r.status_code == 200, r.text
                out[dt].append(r.json()["choices"][0]["logprobs"])
            if dt == "fp8":
                assert "MiB, float8_e4m3fn)" in log, log
                assert "FP8 KV cache: e4m3 with per-tensor scales 1.0" in log, log
                info = [k for k in s.metrics() if k.startswith("vllm:cache_config_info{")]
                assert info and 'cache_dtype="float8_e4m3fn"' in info[0], info
        finally:
            assert s.stop() == 0, s.logs()
    # a quarter / half the bytes a block: 4x / 2x the blocks (floor of the same budget)
    assert blocks["fp8"] // 4 == blocks["float32"] and blocks["fp8"] // 2 == blocks["bfloat16"], blocks
    same, total, prefix, dlp = 0, 0, [], 0.0
    for ref, got in zip(out["float32"], out["fp8"]):
        a, b = ref["tokens"], got["tokens"]
        n = 0
        while n < len(a) and a[n] == b[n]:
            dlp = max(dlp, abs(ref["token_logprobs"][n] - got["token_logprobs"][n]))
            n += 1
        prefix.append(n)
        same += sum(x == y for x, y in zip(a, b))
        total += len(a)
        if n < len(a):
            top = sorted(ref["top_logprobs"][n].values(), reverse=True)
            assert len(top) >= 2 and top[0] - top[1] < 0.3, (n, ref["top_logprobs"][n], a, b)
    print(f"fp8 vs f32 KV, greedy 24 tokens x {len(FP8_PROMPTS)} prompts: common prefixes "
          f"{prefix}, {same}/{total} positions equal, max |logprob diff| on the common prefix "
          f"{dlp:.3f}")
    assert dlp < 0.5, dlp


def test_auto_falls_back_to_cpu_and_serves():
    s = Server("--device", "auto", "--kv-cache-dtype", "auto", "--kv-cache-memory", "16M",
               "--max-model-len", "256", env=NO_MODULE)
    try:
        r = requests.post(s.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "The", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        log = s.logs()
        assert "using the CPU" in log and re.search(r" on cpu[: ]", log) and "float32" in log, log
    finally:
        assert s.stop() == 0, s.logs()
    s = Server("--device", "cpu", "--kv-cache-dtype", "float32", "--kv-cache-memory", "16M",
               "--max-model-len", "256")
    try:
        r = requests.post(s.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "The", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        assert s.stop() == 0, s.logs()


def gpu_visible():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_two_instances_on_one_gpu_at_a_fifth_each():
    """--gpu-memory-utilization is this instance's budget (vLLM's reading:
    "two instances on one GPU: 0.5 each"), so a second instance at 0.2 starts next to a first
    at 0.2 with the same KV cache; its log names the other process's memory.  GPU only
    (scripts/gpu_check.sh runs this file); the arithmetic is unit-tested in test_gpu_budget."""
    if not gpu_visible():
        import pytest
        pytest.skip("no GPU visible (nvidia-smi -L)")
    args = ("--device", "cuda", "--gpu-memory-utilization", "0.2", "--max-model-len", "256")
    a = Server(*args)
    try:
        b = Server(*args)
        try:
            for s in (a, b):
                r = requests.post(s.url + "/v1/completions",
                                  json={"model": "tiny", "prompt": "the Union", "max_tokens": 4})
                assert r.status_code == 200, r.text
            blocks = [s.metric("disagg:kv_blocks_capacity") for s in (a, b)]
            assert blocks[0] > 0 and abs(blocks[0] - blocks[1]) <= 0.02 * blocks[0], blocks
            assert re.search(r"other processes [0-9.]+ GB", b.logs()), b.logs()[-3000:]
        finally:
            assert b.stop() == 0
    finally:
        assert a.stop() == 0
