"""`disagg serve --batch-invariant` (issue 15): on the CPU, whose kernels are batch-invariant
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
