"""`disagg serve --batch-invariant`: on the CPU, whose kernels are batch-invariant
by construction, the flag is accepted (and `--no-batch-invariant` undoes it), serves, and a
greedy completion is the same with and without it, alone and among concurrent requests.
The GPU side (the CUDA kernels it selects) is tests/unit/test_cuda_invariant.c and
tools/gpu_invariant_serve.py, run by scripts/gpu_check.sh on a GPU machine."""
import concurrent.futures as cf

import requests

from server_harness import Server

ARGS = ("--device", "cpu", "--kv-cache-memory", "16M", "--max-model-len", "256")
PROMPTS = ["The", "A long time ago in a galaxy", "One two three four five six seven eight"]


def completions(s, prompts):
    def one(p):
        r = requests.post(s.url + "/v1/completions",
                          json={"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0},
                          timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    single = [one(p) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts) * 2) as ex:
        batched = list(ex.map(one, prompts * 2))
    return single, batched


def test_flag_on_the_cpu_changes_nothing():
    outs = []
    for extra in (("--batch-invariant",), ("--batch-invariant", "--no-batch-invariant"), ()):
        s = Server(*ARGS, *extra)
        try:
            single, batched = completions(s, PROMPTS)
            assert batched == single * 2, (extra, single, batched)
            outs.append(single)
        finally:
            assert s.stop() == 0, s.logs()
    assert outs[0] == outs[1] == outs[2], outs


def test_vllm_env_switch():
    """VLLM_BATCH_INVARIANT (vLLM's switch for the same mode) is read as vLLM reads it (an
    integer, non-zero = on); the flags override it; a value that is not an integer is refused
    at start-up with a message naming the variable and what it accepts."""
    import subprocess
    from server_harness import BIN, MODEL
    s = Server(*ARGS, env={"VLLM_BATCH_INVARIANT": "1"})
    try:
        assert "batch-invariant requested" in s.logs(), s.logs()
        single, batched = completions(s, PROMPTS[:2])
        assert batched == single * 2, (single, batched)
    finally:
        assert s.stop() == 0, s.logs()
    for env, extra, on in (({"VLLM_BATCH_INVARIANT": "0"}, (), False),
                           ({"VLLM_BATCH_INVARIANT": "1"}, ("--no-batch-invariant",), False)):
        s = Server(*ARGS, *extra, env=env)
        try:
            assert ("batch-invariant requested" in s.logs()) == on, s.logs()
        finally:
            assert s.stop() == 0, s.logs()
    for bad in ("yes", "1x", " "):
        import os
        e = dict(os.environ, VLLM_BATCH_INVARIANT=bad)
        r = subprocess.run([BIN, "serve", str(MODEL), *ARGS, "--port", "0"], env=e,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (bad, r.returncode, r.stderr)
        assert f"VLLM_BATCH_INVARIANT='{bad}' is not an integer" in r.stderr, r.stderr
        assert "0 = off, 1 = on" in r.stderr, r.stderr
