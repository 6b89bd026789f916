"""KV cache events in vLLM's format (--kv-events-config): a real `disagg serve`
publishes BlockStored / BlockRemoved / AllBlocksCleared batches on ZMQ PUB as
vLLM's ZmqEventPublisher does ([topic, seq (8 bytes big-endian), payload]), and
serves the replay ROUTER.  Decoded with msgspec Structs that mirror vLLM's own
(vllm/distributed/kv_events.py: EventBatch / KVCacheEvent with array_like=True,
omit_defaults=True, tag=True; BlockStored's fields in vLLM's order), so a
router that consumes vLLM's events decodes ours."""
import json
import os
import subprocess
import time

import msgspec
import pytest
import requests
import zmq

from server_harness import BIN, MODEL, Server, free_port

BS = 16


# ---- vLLM's event types (vllm/distributed/kv_events.py, array_like layout) ----

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The older vLLM layout (before lora_name): a decoder of it must read our batches too.
class OldStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBatch(EventBatch):
    events: list[OldStored | BlockRemoved | AllBlocksCleared]


DEC = msgspec.msgpack.Decoder(type=KVEventBatch)


@pytest.fixture(scope="module")
def srv():
    pub, rep = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
           "replay_endpoint": f"tcp://*:{rep}", "topic": "kv@test", "buffer_steps": 1000}
    # 12 blocks of 16 tokens: a few prompts fill the cache, so blocks are evicted
    s = Server("--device", "cpu", "--block-size", str(BS), "--max-model-len", "128",
               "--kv-cache-memory", str(12 * 6 * 2 * BS * 2 * 32 * 4),
               "--kv-events-config", json.dumps(cfg))
    s.pub, s.rep = pub, rep
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@test")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    time.sleep(1.0)  # PUB/SUB: the subscription must reach the publisher first (slow joiner)
    s.sub, s.ctx = sub, ctx
    yield s
    sub.close(0)
    ctx.term()
    assert s.stop() == 0, s.logs()


def complete(s, prompt, max_tokens=1):
    r = requests.post(s.url + "/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def recv_batches(s, until, timeout=10.0):
    """(seq, batch) messages until until(all so far) is true."""
    got = []
    end = time.time() + timeout
    while time.time() < end:
        if s.sub.poll(200):
            topic, seq, payload = s.sub.recv_multipart()
            assert topic == b"kv@test"
            assert len(seq) == 8
            got.append((int.from_bytes(seq, "big"), payload, DEC.decode(payload)))
            if until(got):
                return got
    raise AssertionError(f"events not seen in {timeout}s; got {[g[2] for g in got]}")


def events(got):
    return [e for _, _, b in got for e in b.events]


def prompt(seed, n):
    return [(seed * 131 + i * 7) % 4000 + 1 for i in range(n)]


def test_store_remove_clear_replay(srv):
    seen = []
    # 1. a 40-token prompt: its 2 full blocks (32 tokens) enter the prefix cache
    p1 = prompt(1, 40)
    complete(srv, p1)
    got = recv_batches(srv, lambda g: any(isinstance(e, BlockStored) for e in events(g)))
    seen += got
    st = [e for e in events(got) if isinstance(e, BlockStored)]
    assert len(st) == 1, st
    e = st[0]
    assert len(e.block_hashes) == 2 and e.parent_block_hash is None
    assert e.token_ids == p1[:32] and e.block_size == BS and e.medium == "GPU"
    assert e.lora_id is None and e.lora_name is None
    first_hashes = list(e.block_hashes)
    b = got[0][2]
    assert b.data_parallel_rank == 0 and abs(b.ts - time.time()) < 60
    # the older layout decodes the same bytes
    old = msgspec.msgpack.decode(got[0][1], type=OldBatch)
    assert [x.block_hashes for x in old.events if isinstance(x, OldStored)] == [first_hashes]

    # 2. the same prefix plus one more block: only the new block is stored, parented
    p2 = p1[:32] + prompt(2, 20)
    complete(srv, p2)
    got = recv_batches(srv, lambda g: any(isinstance(e, BlockStored) for e in events(g)))
    seen += got
    st = [e for e in events(got) if isinstance(e, BlockStored)]
    assert len(st) == 1 and len(st[0].block_hashes) == 1, st
    assert st[0].parent_block_hash == first_hashes[1]
    assert st[0].token_ids == p2[32:48]

    # 3. other prompts fill the 12-block cache: cached blocks are evicted -> BlockRemoved
    stored = set(first_hashes) | set(st[0].block_hashes)
    removed = set()
    for k in range(3, 9):
        complete(srv, prompt(k, 100))
        got = recv_batches(srv, lambda g: len(g) >= 1)
        seen += got
        for ev in events(got):
            if isinstance(ev, BlockStored):
                stored |= set(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert ev.medium == "GPU"
                removed |= set(ev.block_hashes)
        if set(first_hashes) <= removed:
            break
    assert removed and removed <= stored, (removed, stored)
    assert set(first_hashes) <= removed  # the least recently used went first

    # 4. reset_prefix_cache -> AllBlocksCleared
    r = requests.post(srv.url + "/reset_prefix_cache", timeout=10)
    assert r.status_code == 200
    got = recv_batches(srv, lambda g: any(isinstance(e, AllBlocksCleared) for e in events(g)))
    seen += got

    # sequence numbers: consecutive from 0, nothing missed
    seqs = [s for s, _, _ in seen]
    assert seqs == list(range(len(seqs))), seqs

    # 5. replay: from seq 2, every buffered batch byte for byte, then the end marker
    d = srv.ctx.socket(zmq.DEALER)
    d.connect(f"tcp://127.0.0.1:{srv.rep}")
    d.send_multipart([b"", (2).to_bytes(8, "big")])
    replayed = []
    while True:
        assert d.poll(5000), "no replay answer"
        empty, seq, payload = d.recv_multipart()
        assert empty == b""
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            break
        replayed.append((int.from_bytes(seq, "big"), payload))
    d.close(0)
    assert replayed == [(s, p) for s, p, _ in seen if s >= 2]


def test_prefix_hit_stores_nothing(srv):
    p = prompt(50, 36)
    complete(srv, p)
    recv_batches(srv, lambda g: any(isinstance(e, BlockStored) for e in events(g)))
    complete(srv, p)  # both blocks come from the cache: no store, no removal
    time.sleep(0.5)
    assert not srv.sub.poll(300)


@pytest.mark.parametrize("cfg,msg", [
    ('{"enable_kv_cache_event": true}', "unknown key 'enable_kv_cache_event' (did you mean 'enable_kv_cache_events'?)"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher 'kafka' is not known; accepted: null, zmq"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "endpoint 'localhost:5557' is not a ZMQ endpoint"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false, got a string"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps is 0; accepted: 1..1000000"),
    ('[1]', "must be a JSON object, got an array"),
    ('{', "not valid JSON"),
])
def test_bad_config(cfg, msg):
    r = subprocess.run([BIN, "serve", str(MODEL), "--kv-events-config", cfg], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert "--kv-events-config" in r.stderr and msg in r.stderr, r.stderr


def test_endpoint_in_use_fails_startup():
    with zmq.Context() as ctx, ctx.socket(zmq.PUB) as taken:
        port = free_port()
        taken.bind(f"tcp://*:{port}")
        cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
        with pytest.raises(RuntimeError) as ex:
            Server("--device", "cpu", "--kv-events-config", cfg, ready_timeout=60)
        assert f"endpoint 'tcp://*:{port}': cannot bind" in str(ex.value)


def test_connect_mode_and_disabled():
    """An endpoint without '*' is connected to (vLLM's rule): the subscriber binds."""
    with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sub:
        port = free_port()
        sub.bind(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"})
        s = Server("--device", "cpu", "--block-size", str(BS), "--max-model-len", "128",
                   "--kv-cache-memory", "4M", "--kv-events-config", cfg)
        try:
            # PUB drops what it sends before the subscription reaches it (ZMQ's slow joiner):
            # fresh prompts until one batch arrives
            for k in range(100, 150):
                complete(s, prompt(k, 20))
                if sub.poll(300):
                    break
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"" and int.from_bytes(seq, "big") == k - 100
            ev = DEC.decode(payload).events
            assert isinstance(ev[0], BlockStored) and ev[0].token_ids == prompt(k, 20)[:16]
        finally:
            assert s.stop() == 0
        # enable_kv_cache_events false: nothing is published (vLLM's null publisher)
        cfg = json.dumps({"enable_kv_cache_events": False, "endpoint": f"tcp://127.0.0.1:{port}"})
        s = Server("--device", "cpu", "--block-size", str(BS), "--max-model-len", "128",
                   "--kv-cache-memory", "4M", "--kv-events-config", cfg)
        try:
            complete(s, prompt(8, 20))
            assert not sub.poll(1000)
        finally:
            assert s.stop() == 0


def test_replay_bad_request_ignored(srv):
    """A replay request that is not [empty, 1..8-byte seq] is logged and dropped; the next
    good one is answered (from a seq past everything: just the end marker)."""
    d = srv.ctx.socket(zmq.DEALER)
    d.connect(f"tcp://127.0.0.1:{srv.rep}")
    try:
        d.send_multipart([b"", b"\x00" * 9])
        d.send_multipart([b"", b"x", b"y"])
        d.send_multipart([b"", (1 << 40).to_bytes(8, "big")])
        assert d.poll(5000)
        assert d.recv_multipart() == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        assert not d.poll(300)
        assert "invalid replay request" in srv.logs()
    finally:
        d.close(0)


# vLLM >= 0.26 (vllm-project/vllm#42892): the events lost array_like (tagged maps under
# "type"), the batch stayed positional.
class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class MapRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class MapCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapBatch(EventBatch):
    events: list[MapStored | MapRemoved | MapCleared]


def test_map_format():
    port = free_port()
    cfg = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    s = Server("--device", "cpu", "--block-size", str(BS), "--max-model-len", "128",
               "--kv-cache-memory", str(12 * 6 * 2 * BS * 2 * 32 * 4), "--kv-events-config", cfg,
               env={"DISAGG_KV_EVENTS_FORMAT": "map"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(1.0)
        for k in range(20, 26):
            complete(s, prompt(k, 100))
        requests.post(s.url + "/reset_prefix_cache", timeout=10)
        kinds = set()
        stored = None
        while sub.poll(1000):
            _, _, payload = sub.recv_multipart()
            raw = msgspec.msgpack.decode(payload)
            assert isinstance(raw, list) and isinstance(raw[1][0], dict)
            assert raw[1][0]["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
            for e in msgspec.msgpack.decode(payload, type=MapBatch).events:
                kinds.add(type(e).__name__)
                if isinstance(e, MapStored) and stored is None:
                    stored = e
        assert kinds == {"MapStored", "MapRemoved", "MapCleared"}, kinds
        assert stored.token_ids == prompt(20, 100)[:96] and stored.medium == "GPU"
    finally:
        sub.close(0)
        ctx.term()
        assert s.stop() == 0


def test_bad_format_env():
    r = subprocess.run([BIN, "serve", str(MODEL), "--kv-events-config",
                        '{"enable_kv_cache_events": true}'], capture_output=True, text=True,
                       timeout=30, env={**os.environ, "DISAGG_KV_EVENTS_FORMAT": "json"})
    assert r.returncode == 2
    assert "DISAGG_KV_EVENTS_FORMAT 'json' is not known; accepted: array" in r.stderr, r.stderr
