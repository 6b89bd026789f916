"""KV offload tiers (--kv-offloading-size, --kv-offloading-disk): with a KV cache too
small for the working set, blocks the cache evicts go to host memory (and from there to
a disk slab) and come back by copy; the answers (greedy tokens, their logprobs and top
logprobs) equal those of the same server without the pool.  Disk faults: corrupt,
foreign and truncated slots are detected and recomputed, a failing write (file size
limit) degrades to recompute with a warning; the slab starts empty and is removed at
exit; the slab is O_DIRECT where the filesystem takes it (buffered on tmpfs), its writes run
on a writer thread whose full queue drops (counted) rather than blocking.  The copies run on the tiers' loader thread: a request waits for its copies (out of
the batch) while the others are served, an abort meanwhile frees every block, and the
copy-or-recompute model declines copies slower than the prefill they save."""
import json
import mmap
import os
import pathlib
import resource
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time

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
# every tier hit copied back whatever the copy-or-recompute model estimates: the tests that
# count the copies do not depend on how fast this machine copies or computes
ALWAYS = {"DISAGG_KV_OFFLOAD_COPY": "always"}


def wait_for(pred, timeout, what):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


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


def m(s, name, tier=None, label="tier"):
    """The sum of the series of metric name (with label=tier, when given)."""
    out = 0.0
    for k, v in s.metrics().items():
        if k.split("{")[0] == name and (tier is None or f'{label}="{tier}"' in k):
            out += v
    return out


def source(s, name):
    """vllm:prompt_tokens_by_source_total{source=name}."""
    return m(s, "vllm:prompt_tokens_by_source_total", name, label="source")


@pytest.fixture(scope="module")
def reference():
    s = Server(*BASE)
    try:
        yield [lp for lp, _ in rounds(s, 3)]
        assert m(s, "disagg:kv_cache_evicted_blocks_total") > 0
    finally:
        assert s.stop() == 0


def test_host_tier_outputs_unchanged(reference):
    s = Server(*BASE, "--kv-offloading-size", gib(64), "--kv-offloading-backend", "native",
               env=dict(ALWAYS, DISAGG_KV_OFFLOAD_LOADS="async"))  # every copy on the loader
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
        # the copied tokens are external_kv_transfer, as vLLM's OffloadingConnector counts
        # them; cached_tokens (usage) still reports them
        ext, hit = source(s, "external_kv_transfer"), source(s, "local_cache_hit")
        assert ext == loaded * BS and ext + hit == sum(c for _, c in got), (ext, hit, loaded)
        assert m(s, "disagg:kv_offload_blocks_capacity", "host") == 64
        assert m(s, "disagg:kv_offload_blocks_resident", "host") == 20
        # 8 requests waited for their copies (out of the batch), none waits now
        assert m(s, "disagg:kv_offload_load_waits_total") == 8
        assert m(s, "disagg:kv_offload_requests_loading") == 0
        assert m(s, "disagg:kv_offload_loads_in_flight") == 0
        # (the stats are published after the step that answered)
        wait_for(lambda: m(s, "disagg:kv_blocks_used") == 0, 10, "the blocks to be free")
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


def disk_server(tmp_path, *extra, disk_blocks=64, env=ALWAYS):
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


def direct_io_works(d):
    """Whether the filesystem of directory d takes an O_DIRECT write of 4 KiB."""
    p = os.path.join(d, "odirect-probe")
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            buf = mmap.mmap(-1, 4096)  # page-aligned
            return os.pwrite(fd, buf, 0) == 4096
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        if os.path.exists(p):
            os.unlink(p)


def writes_settled(s):
    wait_for(lambda: m(s, "disagg:kv_offload_writes_queued") == 0, 10, "the disk writes")


@pytest.fixture
def shm_dir():
    """A directory on tmpfs (/dev/shm): the buffered fallback."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = tempfile.mkdtemp(prefix="disagg-test-", dir="/dev/shm")
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("mode", ["direct", "buffered", "sync_writes"])
def test_disk_tier_outputs_unchanged_and_removed(tmp_path, shm_dir, reference, mode):
    """The disk tier in each I/O mode: O_DIRECT where the filesystem takes it (the test's
    /tmp), the buffered fallback on tmpfs, and the writes on the step thread
    (DISAGG_KV_OFFLOAD_WRITES=sync): the same answers, the slab gone at exit."""
    d = shm_dir if mode == "buffered" else tmp_path
    import fcntl
    old = time.time() - 60
    stale = d / f"disagg-kv-{dead_pid()}-0.slab"  # a killed run's slab
    stale.write_bytes(b"x" * STRIDE)
    os.utime(stale, (old, old))
    # a live run's slab in another PID namespace sharing the directory: its PID is gone here,
    # but it holds the slab's lock, so it stays
    foreign = d / f"disagg-kv-{dead_pid()}-1.slab"
    foreign.write_bytes(b"y" * STRIDE)
    os.utime(foreign, (old, old))
    lock = open(foreign, "rb")
    fcntl.flock(lock, fcntl.LOCK_EX)
    mine = d / "disagg-kv-notes.txt"  # not a slab: left alone
    mine.write_text("keep")
    env = dict(ALWAYS, DISAGG_KV_OFFLOAD_WRITES="sync") if mode == "sync_writes" else ALWAYS
    try:
        s = disk_server(d, env=env)
    finally:
        lock.close()
    assert not stale.exists() and mine.exists()
    assert foreign.read_bytes() == b"y" * STRIDE
    mine.unlink()
    foreign.unlink()
    try:
        assert [lp for lp, _ in rounds(s, 3)] == reference
        writes_settled(s)
        assert m(s, "disagg:kv_offload_blocks_stored_total", "disk") > 0
        assert m(s, "disagg:kv_offload_blocks_loaded_total", "disk") > 0
        assert m(s, "disagg:kv_offload_corrupt_blocks_total") == 0
        assert m(s, "disagg:kv_offload_writes_dropped_total") == 0
        direct = m(s, "disagg:kv_offload_disk_direct_io")
        if mode == "buffered":
            assert direct == 0 and "disk tier on tmpfs: buffered I/O" in s.logs()
        elif direct_io_works(str(d)) and not any(
                f"disk tier on {fs}:" in s.logs() for fs in ("tmpfs", "ramfs")):
            assert direct == 1 and "O_DIRECT (no page cache)" in s.logs()
        assert os.path.getsize(slab(d)) > 0
        assert stat.S_IMODE(os.stat(slab(d)).st_mode) == 0o600
    finally:
        assert s.stop() == 0
    assert not os.listdir(d)  # the slab goes at exit: a restart starts empty


def test_disk_write_queue_full_drops(tmp_path, reference):
    """A slow disk (300 ms a write) behind a queue of one write: the host tier's victims that
    find the queue full are not written (counted, a warning), the steps never wait for the
    disk, and the answers are the same."""
    s = disk_server(tmp_path, env=dict(ALWAYS, DISAGG_KV_OFFLOAD_WRITE_DELAY_MS="300",
                                       DISAGG_KV_OFFLOAD_WRITE_QUEUE="1"))
    try:
        assert [lp for lp, _ in rounds(s, 3)] == reference
        assert m(s, "disagg:kv_offload_writes_dropped_total") > 0
        assert "a block evicted from host memory is dropped instead of written" in s.logs()
        writes_settled(s)
        assert m(s, "disagg:kv_offload_write_errors_total") == 0
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("fault", ["data", "layout", "truncate"])
def test_disk_faults_recomputed(tmp_path, reference, fault):
    s = disk_server(tmp_path)
    try:
        got = rounds(s, 1)
        writes_settled(s)  # the writer thread's writes are on the file: then damage them
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
                   "--kv-offloading-disk-size", gib(64, STRIDE), env=ALWAYS)
    finally:
        server_harness.BIN = old
    try:
        assert [lp for lp, _ in rounds(s, 3)] == reference
        wait_for(lambda: m(s, "disagg:kv_offload_write_errors_total") > 0, 10, "a failed write")
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
    (("--kv-offloading-size", "0.01", "--kv-offloading-disk-size", "0.01"),
     "--kv-offloading-disk-size needs the directory of the disk tier"),
    (("--kv-offloading-size", "0.01", "--no-enable-prefix-caching"),
     "--kv-offloading-size needs the prefix cache"),
    (("--kv-offloading-size", "1000000"), "more than 90% of this machine's memory"),
    (("--kv-offloading-size", "0.01", "-tp", "2"),
     "--kv-offloading-size / --kv-offloading-disk with -tp > 1 are not implemented"),
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


# ---- asynchronous loads and the copy-or-recompute model --------------------------------

# each tier load sleeps 1 s on the loader first (a slow medium): a restored 4-block prefix
# waits >= 4 s for its copies, while the step thread serves the others
SLOW = dict(ALWAYS, DISAGG_KV_OFFLOAD_LOAD_DELAY_MS="1000", DISAGG_KV_OFFLOAD_LOADS="async")


def evict_round(s, reference):
    """Every prompt once: prompts 0 and 1 end in the host tier only (2 and 3 fill the cache)."""
    assert [ask(s, p)[0] for p in PROMPTS] == reference[:4]


def test_batch_steps_while_a_prefix_loads(reference):
    """Prompt 0's prefix comes back from the host tier at 1 s a block; a short request sent
    while it waits is answered meanwhile (forwards ran with copies pending), then prompt 0
    gets its answer, the same as without the pool, with its 64 prefix tokens copied."""
    s = Server(*BASE, "--kv-offloading-size", gib(64), env=SLOW)
    try:
        evict_round(s, reference)
        out = {}
        t = threading.Thread(target=lambda: out.update(r=ask(s, PROMPTS[0])))
        t.start()
        wait_for(lambda: m(s, "disagg:kv_offload_requests_loading") == 1, 30,
                 "prompt 0 to wait for its copies")
        assert m(s, "disagg:kv_offload_loads_in_flight") == 4
        r = requests.post(s.url + "/v1/completions", json={
            "model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 20, "temperature": 0,
            "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 20
        # answered while prompt 0 still waited (its copies take 4 s; this takes milliseconds)
        assert m(s, "disagg:kv_offload_requests_loading") == 1
        assert m(s, "disagg:kv_offload_steps_during_loads_total") >= 1
        t.join(60)
        lp, cached = out["r"]
        assert lp == reference[4] and cached == 64
        assert m(s, "disagg:kv_offload_blocks_loaded_total", "host") == 4
        assert m(s, "disagg:kv_offload_load_waits_total") == 1
        assert m(s, "disagg:kv_offload_load_wait_seconds_total") >= 4.0  # the loader's sleeps
        wait_for(lambda: m(s, "disagg:kv_blocks_used") == 0, 10, "the blocks to be free")
    finally:
        assert s.stop() == 0


def raw_post(s, body):
    data = json.dumps(body).encode()
    c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return c


def test_abort_while_loading_frees_every_block(reference):
    """The client leaves while its prefix is being copied back: the request ends at once,
    the copies' blocks go back when the copies end, nothing stays in use; the server goes
    on answering the same."""
    s = Server(*BASE, "--kv-offloading-size", gib(64), env=SLOW)
    try:
        evict_round(s, reference)
        c = raw_post(s, {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6})
        wait_for(lambda: m(s, "disagg:kv_offload_requests_loading") == 1, 30,
                 "prompt 0 to wait for its copies")
        c.close()
        wait_for(lambda: m(s, "disagg:kv_offload_requests_loading") == 0, 30, "the abort")
        wait_for(lambda: m(s, "disagg:kv_offload_loads_in_flight") == 0, 30, "the copies to end")
        wait_for(lambda: m(s, "disagg:kv_blocks_used") == 0, 10, "the blocks to be free")
        assert m(s, "disagg:kv_offload_load_waits_total") == 0  # nobody was left to wait
        assert ask(s, PROMPTS[3])[0] == reference[3]  # in the device cache: no copy
        wait_for(lambda: m(s, "disagg:kv_blocks_used") == 0, 10, "the blocks to be free")
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_copies_slower_than_the_prefill_are_declined(tmp_path, reference, tier):
    """DISAGG_KV_OFFLOAD_BANDWIDTH=<tier>=1 (one byte a second): every copy from that tier is
    slower than the prefill it would save, so those prefixes are recomputed and counted as
    declined; the answers do not change."""
    env = {"DISAGG_KV_OFFLOAD_BANDWIDTH": f"{tier}=1"}
    s = (Server(*BASE, "--kv-offloading-size", gib(64), env=env) if tier == "host"
         else disk_server(tmp_path, env=env))
    try:
        got = rounds(s, 3)
        assert [lp for lp, _ in got] == reference
        assert m(s, "disagg:kv_offload_blocks_loaded_total", tier) == 0
        assert m(s, "disagg:kv_offload_blocks_declined_total", tier) >= 8
        assert m(s, "disagg:kv_offload_bandwidth_bytes_per_second", tier) == 1
        assert m(s, "disagg:kv_offload_probes_total") == 0  # a set bandwidth is not re-measured
        if tier == "host":
            assert all(c == 0 for _, c in got)  # nothing came back: every prompt recomputed
    finally:
        assert s.stop() == 0


def test_sync_loads_same_answers(reference):
    """DISAGG_KV_OFFLOAD_LOADS=sync (the comparison mode): the copies run on the step
    thread, no forward runs with one pending; the answers are the same."""
    s = Server(*BASE, "--kv-offloading-size", gib(64),
               env=dict(ALWAYS, DISAGG_KV_OFFLOAD_LOADS="sync"))
    try:
        got = rounds(s, 3)
        assert [lp for lp, _ in got] == reference
        assert all(c == 64 for _, c in got[4:])
        loaded = m(s, "disagg:kv_offload_blocks_loaded_total", "host")
        assert loaded >= 32
        assert m(s, "disagg:kv_offload_steps_during_loads_total") == 0
        # copies on the step thread count as external_kv_transfer too
        ext, hit = source(s, "external_kv_transfer"), source(s, "local_cache_hit")
        assert ext == loaded * BS and ext + hit == sum(c for _, c in got), (ext, hit, loaded)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("var,value,msg", [
    ("DISAGG_KV_OFFLOAD_COPY", "sometimes", "DISAGG_KV_OFFLOAD_COPY='sometimes' is not accepted"),
    ("DISAGG_KV_OFFLOAD_BANDWIDTH", "disk=0", "DISAGG_KV_OFFLOAD_BANDWIDTH='disk=0' is not accepted"),
    ("DISAGG_KV_OFFLOAD_BANDWIDTH", "gpu=1G", "host=BYTES_PER_S,disk=BYTES_PER_S"),
    ("DISAGG_KV_OFFLOAD_LOADS", "later", "DISAGG_KV_OFFLOAD_LOADS='later' is not accepted"),
    ("DISAGG_KV_OFFLOAD_LOAD_DELAY_MS", "-1", "DISAGG_KV_OFFLOAD_LOAD_DELAY_MS='-1' is not accepted"),
    ("DISAGG_KV_OFFLOAD_WRITES", "later", "DISAGG_KV_OFFLOAD_WRITES='later' is not accepted"),
    ("DISAGG_KV_OFFLOAD_WRITE_QUEUE", "0", "DISAGG_KV_OFFLOAD_WRITE_QUEUE='0' is not accepted"),
    ("DISAGG_KV_OFFLOAD_WRITE_DELAY_MS", "x", "DISAGG_KV_OFFLOAD_WRITE_DELAY_MS='x' is not accepted"),
    ("DISAGG_KV_OFFLOAD_DIRECT_IO", "yes", "DISAGG_KV_OFFLOAD_DIRECT_IO='yes' is not accepted"),
])
def test_bad_load_switches(var, value, msg):
    with pytest.raises(RuntimeError) as ex:
        Server(*BASE, "--kv-offloading-size", gib(8), env={var: value}, ready_timeout=60)
    assert msg in str(ex.value)
