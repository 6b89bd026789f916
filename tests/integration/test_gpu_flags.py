"""GPU flags without a GPU: `disagg serve --gpu-memory-utilization` / `--enforce-eager` and
`disagg bench model --device cuda` refuse bad values naming what is accepted, and without
the CUDA module (or a GPU) fail naming what is missing -- never a crash or a hang."""
import os
import subprocess

import pytest

from server_harness import BIN, MODEL

NO_MODULE = {"DISAGG_CUDA_MODULE": "/nonexistent/libdisagg_cuda.so"}


def run(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=120, env=e)


def serve(*args, env=None):
    return run("serve", str(MODEL), "--port", "0", "--host", "127.0.0.1", "--kv-cache-memory", "16M",
               "--max-model-len", "256", *args, env=env)


def test_gpu_memory_utilization_bad_values():
    for bad in ("1.5", "0", "-0.2", "abc", ""):
        r = serve("--gpu-memory-utilization", bad)
        assert r.returncode == 2, (bad, r.stderr)
        assert "--gpu-memory-utilization" in r.stderr and "(0, 1]" in r.stderr, r.stderr


def test_gpu_flags_parse_then_the_missing_module_is_named():
    r = serve("--device", "cuda", "--gpu-memory-utilization", "0.5", "--enforce-eager", env=NO_MODULE)
    assert r.returncode != 0
    assert "libdisagg_cuda.so" in r.stderr and "--device cpu" in r.stderr, r.stderr
    assert "unknown option" not in r.stderr


def test_bench_model_device_values():
    r = run("bench", "model", str(MODEL), "--device", "tpu")
    assert r.returncode == 2 and "'tpu'" in r.stderr and "cuda" in r.stderr, r.stderr
    r = run("bench", "model", str(MODEL), "--device", "cuda", "--batches", "0,8")
    assert r.returncode == 2 and "--batches" in r.stderr, r.stderr
    r = run("bench", "model", str(MODEL), "--device", "cuda", "--kv-cache-dtype", "int4")
    assert r.returncode == 2 and "bfloat16" in r.stderr, r.stderr


# `bench model --device cuda` and its --batch-invariant form share one argument loop
# (bench/model_bench_args.c): the same errors, each naming the value and what is accepted
@pytest.mark.parametrize("extra,needles", [
    (["--batches", ",".join(["1"] * 17)], ["--batches", "at most 16"]),  # was cut to 16 silently
    (["--batches", "1,8,"], ["'1,8,'", "comma-separated integers"]),
    (["--context", "2,3"], ["--context '2,3'", "an integer in [1, 1048576]"]),
    (["--kv-cache-dtype"], ["--kv-cache-dtype needs a value"]),
    (["--frob"], ["--device cuda: unknown option '--frob'", "--kv-cache-dtype, --json"]),
    (["--batch-invariant", "--prompt-len", "1,2"], ["--prompt-len '1,2'", "an integer"]),
    (["--batch-invariant", "--inv-gemm-m", "x"], ["--inv-gemm-m 'x'"]),
    (["--batch-invariant", "--json"], ["--batch-invariant: unknown option '--json'", "--inv-gemm-m"]),
])
def test_bench_model_cuda_bad_arguments(extra, needles):
    r = run("bench", "model", str(MODEL), "--device", "cuda", *extra, env=NO_MODULE)
    assert r.returncode == 2, r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


def test_bench_model_cuda_needs_a_model():
    for extra in ([], ["--batch-invariant"]):
        r = run("bench", "model", "--device", "cuda", *extra)
        assert r.returncode == 2 and r.stderr.startswith("usage: disagg bench model MODEL"), r.stderr


def test_bench_model_cuda_without_module_or_gpu():
    r = run("bench", "model", str(MODEL), "--device", "cuda", env=NO_MODULE)
    # the same words as serve's (one loader: kernels/backend.c)
    assert r.returncode == 1 and "--device cuda" in r.stderr, r.stderr
    assert "libdisagg_cuda.so" in r.stderr and "--device cpu" in r.stderr, r.stderr
    r = run("bench", "model", str(MODEL), "--device", "cuda", "--batch-invariant", "--batches", "1,8",
            env=NO_MODULE)
    assert r.returncode == 1 and "libdisagg_cuda.so" in r.stderr, r.stderr
