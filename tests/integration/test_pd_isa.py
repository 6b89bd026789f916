"""CPU kernel ISAs end to end: each `disagg serve` says which kernels it runs
(start-up log, /metrics disagg:kernels_info); a P/D pair whose CPUs run different kernels
(forced here with DISAGG_CPU_ISA: P avx2, D avx512bf16; P avx512f, D avx2) still moves the KV -- the layout is
the same -- and the producer reports the pair once, since the result is not promised to be
bit-identical to a colocated run.  On a CPU without AVX512_BF16 the cross-ISA test is
skipped, saying so.  A bf16 KV cache on the CPU (--kv-cache-dtype bfloat16) moves from P to D
and decodes as a colocated bf16 server does."""
import pytest
import requests

from server_harness import Server
from test_pd import BODY, COMMON, PD, TIMEOUT, assert_kv_pulled, completion_ids


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


HAVE_BF16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()
HAVE_AVX2 = {"avx2", "fma", "f16c"} <= cpu_flags()
HAVE_AVX512F = HAVE_AVX2 and "avx512f" in cpu_flags()
HAVE = {"scalar": True, "avx2": HAVE_AVX2, "avx512f": HAVE_AVX512F, "avx512bf16": HAVE_BF16,
        "avx512bf16-fast": HAVE_BF16}


def kernels_of(server):
    for k, v in server.metrics().items():
        if k.startswith("disagg:kernels_info{") and v == 1:
            return k.split('kernels="', 1)[1].split('"', 1)[0]
    raise AssertionError("no disagg:kernels_info in /metrics")


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512f", "avx512bf16"])
def test_forced_isa_is_reported(isa):
    if not HAVE[isa]:
        pytest.skip(f"SKIPPED: this CPU lacks {isa}: its kernels are NOT tested here")
    s = Server(*COMMON, env={"DISAGG_CPU_ISA": isa})
    try:
        assert kernels_of(s) == isa
        assert f"cpu kernels: {isa} (cpu has" in s.logs()
        r = requests.post(s.url + "/v1/completions", json=dict(BODY, prompt="the state of the Union"),
                          timeout=TIMEOUT)
        assert r.status_code == 200, r.text
    finally:
        s.stop()


def test_unknown_isa_warns_and_runs_the_best():
    s = Server(*COMMON, env={"DISAGG_CPU_ISA": "avx9000"})
    try:
        assert ("DISAGG_CPU_ISA='avx9000' not recognised (accepted: scalar, avx2, avx512f, "
                "avx512bf16, avx512bf16-fast)") in s.logs()
        assert kernels_of(s) == ("avx512f" if HAVE_AVX512F else "avx2" if HAVE_AVX2 else "scalar")
    finally:
        s.stop()


@pytest.mark.parametrize("p_isa,d_isa", [("avx2", "avx512bf16"), ("avx512f", "avx2")])
def test_pd_across_isas_moves_kv_and_is_reported(p_isa, d_isa):
    if not (HAVE[p_isa] and HAVE[d_isa]):
        pytest.skip(f"SKIPPED: this CPU lacks {p_isa} or {d_isa}: a P/D pair across them is NOT tested")
    pd = PD(p_env={"DISAGG_CPU_ISA": p_isa}, d_env={"DISAGG_CPU_ISA": d_isa})
    try:
        assert kernels_of(pd.p) == p_isa and kernels_of(pd.d) == d_isa
        body = dict(BODY, prompt=" ".join(["the state of the Union is strong"] * 6))
        for _ in range(2):
            pr, dr = pd.send(body)
            assert pr.status_code == 200, pr.text
            ids, text, finish = completion_ids(dr)
            assert len(ids) == BODY["max_tokens"] or finish == "stop"
            assert_kv_pulled(dr.json()["usage"])
        log = pd.p.logs()
        assert f"P/D pair across kernels: decoder {d_isa}, producer {p_isa}" in log, log
        assert log.count("P/D pair across kernels") == 1, log  # once, not per request
    finally:
        pd.stop()


def test_pd_layout_mismatch_still_refused():
    """Only the kernels field is left out of the comparison: another block size is refused."""
    import test_pd
    pd = PD.__new__(PD)
    pd.boot_port = test_pd.free_port()
    pd.p = Server(*COMMON, "--kv-transfer-config", test_pd.producer_config(),
                  env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(pd.boot_port)})
    try:
        pd.d = Server("--max-model-len", "1024", "--kv-cache-memory", "96M", "--block-size", "32",
                      "--kv-transfer-config", test_pd.consumer_config())
    except Exception:
        pd.p.stop()
        raise
    try:
        pd.bootstrap = f"http://127.0.0.1:{pd.boot_port}"
        pd.engine_id = requests.get(pd.bootstrap + "/query", timeout=10).json()["0"]["engine_id"]
        pr, dr = pd.send(dict(BODY, prompt=" ".join(["the state of the Union"] * 8)))
        assert pr.status_code == 200, pr.text
        assert dr.status_code != 200 or dr.json()["usage"]["kv_transfer"]["received_prompt_tokens"] == 0
        log = pd.p.logs()
        assert "refusing a pull: KV layout mismatch" in log and ":bs32:" in log and ":bs16:" in log, log
        assert "P/D pair across kernels" not in log
    finally:
        pd.stop()


def test_pd_bf16_kv_cache_equals_colocated():
    """--kv-cache-dtype bfloat16 on the CPU (opt-in): the bf16 KV bytes move from P
    to D and D's greedy tokens equal a colocated bf16-KV server's, token for token."""
    import test_pd
    bf16 = ("--kv-cache-dtype", "bfloat16")
    ref_srv = Server(*COMMON, *bf16)
    try:
        body = dict(BODY, prompt=" ".join(["the state of the Union is strong"] * 6))
        ref = completion_ids(requests.post(ref_srv.url + "/v1/completions", json=body,
                                           timeout=TIMEOUT))
    finally:
        ref_srv.stop()
    pd = PD.__new__(PD)
    pd.boot_port = test_pd.free_port()
    pd.p = Server(*COMMON, *bf16, "--kv-transfer-config", test_pd.producer_config(),
                  env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(pd.boot_port)})
    try:
        pd.d = Server(*COMMON, *bf16, "--kv-transfer-config", test_pd.consumer_config())
    except Exception:
        pd.p.stop()
        raise
    try:
        pd.bootstrap = f"http://127.0.0.1:{pd.boot_port}"
        pd.engine_id = requests.get(pd.bootstrap + "/query", timeout=10).json()["0"]["engine_id"]
        pr, dr = pd.send(body)
        assert pr.status_code == 200, pr.text
        assert_kv_pulled(dr.json()["usage"])
        assert completion_ids(dr) == ref
        assert ":bf16:" in pd.p.logs() or "bfloat16" in pd.p.logs(), pd.p.logs()
    finally:
        pd.stop()
