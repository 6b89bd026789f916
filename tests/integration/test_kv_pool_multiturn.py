"""The multi-turn benchmark of docs/kv_pool.md, scaled down for CI (issue 31's CPU target): a
conversation dataset from tools/gen_multiturn_dataset.py sent by `disagg bench serve
--dataset-name custom` (each turn's history holds the server's own earlier answers) to an
instance whose KV cache holds about two of the four conversations, without tiers, with a host
tier, and with a small host tier over a disk tier.  Evicted prefixes come back from host memory
and from disk (counted per tier), and every answer of every turn is the same text as without
tiers."""
import json
import subprocess
import sys

import pytest
from server_harness import BIN, ROOT, Server, on_gpu
from test_kv_offload import BS, DEV, STRIDE, gib, m

CONVERSATIONS, TURNS, WORDS, ANSWER = 4, 4, 40, 12
# one KV block of the tiny model (f32 on the CPU); 40 blocks hold two conversations' last turns
BASE = DEV + ("--block-size", str(BS), "--max-model-len", "512",
              "--kv-cache-memory", str(40 * 6 * 2 * BS * 2 * 32 * (2 if on_gpu() else 4)))
TIERS = {
    "none": (),
    "host": ("--kv-offloading-size", gib(4096)),
    "disk": ("--kv-offloading-size", gib(8), "--kv-offloading-disk", "{disk}",
             "--kv-offloading-disk-size", gib(4096, STRIDE)),
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiturn") / "conversations.jsonl"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_multiturn_dataset.py"), "--out", str(out),
                    "--conversations", str(CONVERSATIONS), "--turns", str(TURNS), "--user-words", str(WORDS)],
                   check=True, capture_output=True)
    return out


def bench(tmp_path, dataset, config):
    """bench serve against a server of this tier config: its generated texts in the order of
    the dataset's turns, and its counters"""
    extra = [a.replace("{disk}", str(tmp_path)) for a in TIERS[config]]
    # every tier hit copied back (the test counts them, whatever this machine's speeds)
    s = Server(*BASE, *extra, env={"DISAGG_KV_OFFLOAD_COPY": "always"})
    try:
        out = tmp_path / f"bench-{config}.json"
        r = subprocess.run([BIN, "bench", "serve", "--base-url", s.url, "--dataset-name", "custom",
                            "--dataset-path", str(dataset), "--num-prompts", str(CONVERSATIONS),
                            "--custom-output-len", str(ANSWER), "--ignore-eos", "--request-rate", "inf",
                            "--max-concurrency", "2", "--seed", "0", "--save-detailed", "--json", str(out)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        res = json.loads(out.read_text())
        assert res["completed"] == CONVERSATIONS * TURNS, res
        counts = {t: m(s, "disagg:kv_offload_blocks_loaded_total", t) for t in ("host", "disk")}
        counts["evicted"] = m(s, "disagg:kv_cache_evicted_blocks_total")
        counts["corrupt"] = m(s, "disagg:kv_offload_corrupt_blocks_total")
        return res["generated_texts"], counts
    finally:
        assert s.stop() == 0


def test_multiturn_benchmark_tiers(tmp_path, dataset):
    texts, got = {}, {}
    for config in TIERS:
        d = tmp_path / config
        d.mkdir()
        texts[config], got[config] = bench(d, dataset, config)
    assert got["none"]["evicted"] > 0, got  # the cache is too small for the conversations
    assert got["host"]["host"] > 0, got  # evicted prefixes came back from host memory
    assert got["disk"]["disk"] > 0, got  # and from disk
    assert got["disk"]["corrupt"] == 0 and got["host"]["corrupt"] == 0, got
    # every answer of every turn unchanged by the tiers (greedy; the later turns' prompts hold
    # the earlier answers, so a changed answer would change every turn after it)
    assert len(texts["none"]) == CONVERSATIONS * TURNS and all(texts["none"]), texts["none"]
    assert texts["host"] == texts["none"]
    assert texts["disk"] == texts["none"]
