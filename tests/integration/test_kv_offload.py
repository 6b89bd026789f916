"""KV offload tiers (--kv-offloading-size, --kv-offloading-disk): with a KV cache too
small for the working set, blocks the cache evicts go to host memory (and from there to
a disk slab) and come back by copy; the answers (greedy tokens, their logprobs and top
logprobs) equal those of the same server without the pool.  Disk faults: corrupt,
foreign and truncated slots are detected and recomputed, a failing write (file size
limit) degrades to recompute with a warning; the slab starts empty and is removed at
exit."""
import os
import resource
import stat
import sys

import pytest
import requests

import server_harness
from server_harness import Server, on_gpu

BS = 16
# DISAGG_TEST_DEVICE=cuda (scripts/gpu_check.sh ONLY=kvpool): bf16 KV on the GPU, the
# batch-invariant mode so that a prompt computed after a restored prefix is bit-equal to the
# whole prompt computed at once (the CPU engine is invariant anyway)
DEV = (("--device", "cuda", "--kv-cache-dtype", "bfloat16", "--batch-invariant") if on_gpu()
       else ("--device", "cpu"))
BB = 6 * 2 * BS * 2 * 32 * (2 if on_gpu() else 4)  # one KV block of the tiny model
STRIDE = (64 + BB + 4095) // 4096 * 4096  # one disk slot: header + block, 4 KiB aligned
BASE = DEV + ("--block-size", str(BS), "--max-model-len", "128",
              "--kv-cache-memory", str(12 * BB))  # 12 blocks: two 80-token prompts at most
PROMPTS = [[(k * 131 + i * 7) % 4000 + 1 for i in range(80)] for k in range(4)]


def gib(blocks, size=BB):
    return repr(blocks * size / 2**30)


def ask(s, p):
    r = requests.post(s.url + "/v1/completions", json={
        "model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0, "logprobs": 5},
        timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()
    return c["choices"][0]["logprobs"], c["usage"]["prompt_tokens_details"]["cached_tokens"]


def rounds(s, n=2):
    """Every prompt n times, round robin: each round evicts the previous one's blocks."""
    return [ask(s, p) for _ in range(n) for p in PROMPTS]


def m(s, name, tier=None):
    out = 0.0
    for k, v in s.metrics().items():
        if k.split("{")[0] == name and (tier is None or f'tier="{tier}"' in k):
            out += v
    return out


@pytest.fixture(scope="module")
def reference():
    s = Server(*BASE)
    try:
        yield [lp for lp, _ in rounds(s, 3)]
        assert m(s, "disagg:kv_cache_evicted_blocks_total") > 0
    finally:
        assert s.stop() == 0


def test_host_tier_outputs_unchanged(reference):
    s = Server(*BASE, "--kv-offloading-size", gib(64), "--kv-offloading-backend", "native")
    try:
        got = rounds(s, 3)
        assert [lp for lp, _ in got] == reference
        assert all(c == 64 for _, c in got[4:])  # 4 of 5 prompt blocks (the last token computes)
        assert m(s, "disagg:kv_cache_evicted_blocks_total") > 0
        loaded = m(s, "disagg:kv_offload_blocks_loaded_total", "host")
        assert loaded >= 8 * 4
        assert m(s, "disagg:kv_offload_blocks_stored_total", "host") >= 20
        assert m(s, "disagg:kv_offload_bytes_loaded_total", "host") == loaded * BB
        assert m(s, "disagg:kv_offload_load_seconds_total", "host") > 0
        assert m(s, "vllm:external_prefix_cache_hits_total") == loaded * BS
        assert m(s, "vllm:external_prefix_cache_queries_total") >= loaded * BS
        assert m(s, "disagg:kv_offload_blocks_capacity", "host") == 64
        assert m(s, "disagg:kv_offload_blocks_resident", "host") == 20
    finally:
        assert s.stop() == 0


def test_host_tier_lru_eviction(reference):
    """A host tier of 6 blocks cannot hold the 20: it evicts (LRU), the rest recompute."""
    s = Server(*BASE, "--kv-offloading-size", gib(6))
    try:
        assert [lp for lp, _ in rounds(s, 3)] == reference
        assert m(s, "disagg:kv_offload_blocks_evicted_total", "host") > 0
        assert m(s, "disagg:kv_offload_blocks_resident", "host") == 6
    finally:
        assert s.stop() == 0


def disk_server(tmp_path, *extra, disk_blocks=64, env=None):
    return Server(*BASE, "--kv-offloading-size", gib(2), "--kv-offloading-disk", str(tmp_path),
                  "--kv-offloading-disk-size", gib(disk_blocks, STRIDE), *extra, env=env)


def slab(tmp_path):
    files = [f for f in os.listdir(tmp_path) if f.startswith("disagg-kv-") and f.endswith(".slab")]
    assert len(files) == 1, files
    return tmp_path / files[0]


def dead_pid():
    pid = 4000000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


def test_disk_tier_outputs_unchanged_and_removed(tmp_path, reference):
    stale = tmp_path / f"disagg-kv-{dead_pid()}-0.slab"  # a killed run's slab
    stale.write_bytes(b"x" * STRIDE)
    mine = tmp_path / "disagg-kv-notes.txt"  # not a slab: left alone
    mine.write_text("keep")
    s = disk_server(tmp_path)
    assert not stale.exists() and mine.exists()
    mine.unlink()
    try:
        assert [lp for lp, _ in rounds(s, 3)] == reference
        assert m(s, "disagg:kv_offload_blocks_stored_total", "disk") > 0
        assert m(s, "disagg:kv_offload_blocks_loaded_total", "disk") > 0
        assert m(s, "disagg:kv_offload_corrupt_blocks_total") == 0
        assert os.path.getsize(slab(tmp_path)) > 0
        assert stat.S_IMODE(os.stat(slab(tmp_path)).st_mode) == 0o600
    finally:
        assert s.stop() == 0
    assert not os.listdir(tmp_path)  # the slab goes at exit: a restart starts empty


@pytest.mark.parametrize("fault", ["data", "layout", "truncate"])
def test_disk_faults_recomputed(tmp_path, reference, fault):
    s = disk_server(tmp_path)
    try:
        got = rounds(s, 1)
        assert m(s, "disagg:kv_offload_blocks_stored_total", "disk") > 0
        path = slab(tmp_path)
        size = os.path.getsize(path)
        if fault == "truncate":
            os.truncate(path, 0)
        else:
            with open(path, "r+b") as f:
                for off in range(0, size, STRIDE):
                    # data: a byte of the block; layout: the header's layout key
                    f.seek(off + (64 + 1000 if fault == "data" else 8))
                    b = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([b[0] ^ 0x40]))
        got += rounds(s, 2)
        assert [lp for lp, _ in got] == reference
        assert m(s, "disagg:kv_offload_corrupt_blocks_total") > 0
        # a truncated slab reads short ("truncated") until later writes extend the file past a
        # slot again: then the slot reads as the hole's zeros ("bad magic"); the loader reads
        # the slots after the step thread's writes of the same step, so either may come first
        whys = {"data": ["checksum mismatch"], "layout": ["another model, dtype or block layout"],
                "truncate": ["truncated", "bad magic"]}[fault]
        assert any(f"({why}): recomputed instead" in s.logs() for why in whys)
    finally:
        assert s.stop() == 0


def test_disk_write_failure_degrades(tmp_path, reference):
    """A file size limit of 3 slots: later writes fail (EFBIG), the blocks are dropped with a
    warning and recomputed; the server neither dies (SIGXFSZ) nor answers differently."""
    wrapper = tmp_path / "limited-disagg"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({3 * STRIDE}, {3 * STRIDE}))\n"
        f"os.execv({server_harness.BIN!r}, [{server_harness.BIN!r}] + sys.argv[1:])\n")
    wrapper.chmod(0o755)
    d = tmp_path / "disk"
    d.mkdir()
    old = server_harness.BIN
    server_harness.BIN = str(wrapper)
    try:
        s = Server(*BASE, "--kv-offloading-size", gib(2), "--kv-offloading-disk", str(d),
                   "--kv-offloading-disk-size", gib(64, STRIDE))
    finally:
        server_harness.BIN = old
    try:
        assert [lp for lp, _ in rounds(s, 3)] == reference
        assert m(s, "disagg:kv_offload_write_errors_total") > 0
        assert "the block is dropped and will be recomputed" in s.logs()
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("args,msg", [
    (("--kv-offloading-disk", "/tmp"), "--kv-offloading-disk needs the host tier above it"),
    (("--kv-offloading-size", "0.01", "--kv-offloading-disk", "/tmp"),
     "--kv-offloading-disk '/tmp' needs --kv-offloading-disk-size GiB"),
    (("--kv-offloading-size", "0.01", "--kv-offloading-disk", "/nonexistent/kv",
      "--kv-offloading-disk-size", "0.01"), "--kv-offloading-disk '/nonexistent/kv': cannot create"),
    (("--kv-offloading-size", "0.00000001"), "--kv-offloading-size holds no KV block"),
])
def test_bad_offload_flags(args, msg):
    with pytest.raises(RuntimeError) as ex:
        Server(*BASE, *args, ready_timeout=60)
    assert msg in str(ex.value)


def test_bad_backend_flag():
    import subprocess
    r = subprocess.run([server_harness.BIN, "serve", str(server_harness.MODEL),
                        "--kv-offloading-backend", "lmcache"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "--kv-offloading-backend" in r.stderr and "native" in r.stderr, r.stderr


def test_tier_events(tmp_path):
    """With --kv-events-config the tiers announce their blocks as vLLM's offloading does:
    BlockStored / BlockRemoved with medium CPU and DISK (no tokens, no parent)."""
    import json
    import time

    import zmq

    from test_kv_events import DEC, BlockRemoved, BlockStored
    port = server_harness.free_port()
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    s = disk_server(tmp_path, "--kv-events-config", cfg)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(1.0)  # slow joiner
        rounds(s, 2)
        seen = {}
        while sub.poll(1000):
            _, _, payload = sub.recv_multipart()
            for e in DEC.decode(payload).events:
                seen.setdefault((type(e).__name__, e.medium), []).append(e)
        for kind in ("BlockStored", "BlockRemoved"):
            for medium in ("GPU", "CPU", "DISK") if kind == "BlockStored" else ("GPU", "CPU"):
                assert (kind, medium) in seen, (kind, medium, list(seen))
        for e in seen[("BlockStored", "CPU")] + seen[("BlockStored", "DISK")]:
            assert e.token_ids == [] and e.parent_block_hash is None and e.block_size == BS
        # every block the host tier stored came from the device cache
        gpu = {h for e in seen[("BlockStored", "GPU")] for h in e.block_hashes}
        cpu = {h for e in seen[("BlockStored", "CPU")] for h in e.block_hashes}
        assert cpu and cpu <= gpu
        assert isinstance(seen[("BlockRemoved", "CPU")][0], BlockRemoved)
        assert isinstance(seen[("BlockStored", "DISK")][0], BlockStored)
    finally:
        sub.close(0)
        ctx.term()
        assert s.stop() == 0
