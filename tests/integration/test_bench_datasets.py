"""`disagg bench serve`'s datasets as `vllm bench serve --dataset-name` names them (random,
prefix_repetition, custom JSONL prompts and multi-turn conversations, sharegpt), each against
a real `disagg serve` of the tiny model; the JSON's keys against vLLM's; bad dataset files
refused before any request with a message naming the file, the line and what is accepted;
a conversation's turn k+1 sent after turn k's answer and carrying it (the answer text in its
history, the server's prefix cache hit)."""
import json
import re
import subprocess

import pytest
import requests

from server_harness import BIN, Server
from upstream_double import UpstreamDouble

BLOCK = 16

# The keys of `vllm bench serve --save-result` (vllm/benchmarks/serve.py: the run's setup,
# benchmark()'s result and process_one_metric's mean/median/std/pXX for ttft, tpot, itl --
# its default --percentile-metrics -- with --metric-percentiles 99, vLLM's default).
VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "latencies", "queue_times",
    "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
} | {f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl") for s in ("mean", "median", "std", "p99")}
# --save-detailed adds the per-request lists vLLM removes without it
VLLM_DETAILED = {"input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"}
# with --max-concurrency (vLLM: client_queue_time; with a finite rate also the queue-inclusive E2EL)
VLLM_QUEUE = {f"{s}_{m}_ms" for m in ("client_queue_time", "e2el_including_client_queue")
              for s in ("mean", "median", "std", "p99")}


@pytest.fixture(scope="module")
def srv():
    s = Server("--max-model-len", "1024", "--kv-cache-memory", "64M", "--block-size", str(BLOCK))
    yield s
    rc = s.stop()
    assert rc == 0, "disagg serve did not exit cleanly on SIGTERM: " + s.logs()


def bench(url, *args, timeout=300):
    return subprocess.run([BIN, "bench", "serve", "--base-url", url, "--disable-tqdm", *args],
                          capture_output=True, text=True, timeout=timeout)


def run_json(url, tmp_path, *args):
    out = tmp_path / "r.json"
    r = bench(url, "--json", str(out), *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text()), r


def prefix_hits(url):
    """vllm:prefix_cache_hits_total (tokens) from /metrics."""
    m = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([\d.e+]+)$",
                  requests.get(url + "/metrics", timeout=10).text, re.M)
    assert m, "no vllm:prefix_cache_hits_total in /metrics"
    return float(m.group(1))


def test_random_keys_are_vllms(srv, tmp_path):
    j, r = run_json(srv.url, tmp_path, "--num-prompts", "4", "--random-input-len", "20",
                    "--random-output-len", "5", "--metric-percentiles", "99", "--save-detailed",
                    "--max-concurrency", "2", "--request-rate", "40",
                    "--goodput", "ttft:100000", "tpot:100000", "--label", "unit")
    missing = (VLLM_KEYS | VLLM_DETAILED | VLLM_QUEUE) - set(j)
    assert not missing, f"vLLM keys missing: {sorted(missing)}"
    # the random dataset ignores EOS as vLLM's does: every request runs to its length
    assert j["completed"] == 4 and j["total_output_tokens"] == 20 and j["output_lens"] == [5] * 4
    assert j["request_goodput"] == pytest.approx(j["request_throughput"])
    assert j["label"] == "unit" and j["backend"] == "openai" and j["dataset_name"] == "random"
    assert j["request_rate"] == 40 and j["max_concurrency"] == 2
    assert 1 <= j["max_concurrent_requests"] <= 2 and j["max_output_tokens_per_s"] >= 1
    assert len(j["itls"]) == 4 and all(len(x) == 4 for x in j["itls"])  # 5 tokens: 4 gaps
    assert j["errors"] == [""] * 4 and all(t for t in j["generated_texts"])
    assert "P99 TTFT (ms):" in r.stdout and "Peak concurrent requests:" in r.stdout
    assert "p90_ttft_ms" not in j  # only the percentiles asked for
    assert j["goodput_slo_ms"] == {"ttft": 100000, "tpot": 100000}
    # an SLO of 0 ms is an SLO (vLLM's check is value <= SLO): no request meets it
    j, _ = run_json(srv.url, tmp_path, "--num-prompts", "2", "--random-input-len", "8",
                    "--random-output-len", "2", "--goodput", "e2el:0")
    assert j["request_goodput"] == 0 and j["goodput_slo_ms"] == {"e2el": 0} and j["completed"] == 2
    j, _ = run_json(srv.url, tmp_path, "--num-prompts", "1", "--random-input-len", "8", "--random-output-len", "2")
    assert j["request_goodput"] is None and j["goodput_slo_ms"] is None


def test_prefix_repetition(srv, tmp_path):
    """vLLM's counts (num_prompts // num_prefixes per prefix); the repeated prefixes hit the
    server's prefix cache: one request at a time, each later prompt of a prefix reuses at
    least the prefix's full blocks."""
    before = prefix_hits(srv.url)
    j, r = run_json(srv.url, tmp_path, "--dataset-name", "prefix_repetition",
                    "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "8",
                    "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3",
                    "--num-prompts", "7", "--max-concurrency", "1", "--ignore-eos")
    assert j["completed"] == 6 and j["total_output_tokens"] == 18  # 7 // 2 = 3 per prefix
    reused = 2 * (3 - 1) * (64 // BLOCK - 1) * BLOCK  # blocks wholly inside a 64-word prefix
    assert prefix_hits(srv.url) - before >= reused
    r = bench(srv.url, "--dataset-name", "prefix_repetition", "--num-prompts", "3")
    assert r.returncode == 2 and "--num-prompts (3) must be at least --prefix-repetition-num-prefixes (10)" in r.stderr


def test_custom_prompts(srv, tmp_path):
    ds = tmp_path / "p.jsonl"
    ds.write_text('{"prompt": "The state of the union is"}\n\n'
                  '{"prompt": "Congress shall make the law of the land"}\n'
                  '{"prompt": "The people of America"}\n')
    j, _ = run_json(srv.url, tmp_path, "--dataset-name", "custom", "--dataset-path", str(ds),
                    "--endpoint", "/v1/chat/completions", "--custom-output-len", "4",
                    "--num-prompts", "3", "--ignore-eos", "--save-detailed")
    assert j["completed"] == 3 and j["output_lens"] == [4] * 3 and j["backend"] == "openai-chat"
    # fewer lines than --num-prompts: repeated to the count as vLLM, unless --no-oversample
    j, _ = run_json(srv.url, tmp_path, "--dataset-name", "custom", "--dataset-path", str(ds),
                    "--custom-output-len", "2", "--num-prompts", "5")
    assert j["completed"] == 5
    j, _ = run_json(srv.url, tmp_path, "--dataset-name", "custom", "--dataset-path", str(ds),
                    "--custom-output-len", "2", "--num-prompts", "5", "--no-oversample")
    assert j["completed"] == 3


def conversations(n, turns, words=30):
    base = ("the nation and the people of America must work for a great new state of the "
            "world and the law of the land").split()
    out = []
    for c in range(n):
        msgs = [{"role": "system", "content": f"conversation {c}"}]
        for t in range(turns):
            msgs.append({"role": "user", "content": " ".join(base[(c + t + i) % len(base)]
                                                          for i in range(words))})
            if t == 0:
                msgs.append({"role": "assistant", "content": "replaced by the server's answer"})
        out.append({"id": f"c{c}", "messages": msgs})
    return out


def test_multiturn_against_server(srv, tmp_path):
    """Each turn is sent after the previous answer arrived (its start is after the previous
    end), its prompt holds the previous prompt and answer, and the server's prefix cache
    serves the previous turn's blocks."""
    ds = tmp_path / "mt.jsonl"
    ds.write_text("".join(json.dumps(c) + "\n" for c in conversations(3, 3)))
    before = prefix_hits(srv.url)
    j, r = run_json(srv.url, tmp_path, "--dataset-name", "custom", "--dataset-path", str(ds),
                    "--custom-output-len", "6", "--ignore-eos", "--num-prompts", "10",
                    "--request-rate", "20", "--save-detailed", "--disable-shuffle")
    assert "3 conversations" in r.stdout
    assert j["completed"] == 9 and j["num_conversations"] == 3 and j["num_requests"] == 9
    assert j["backend"] == "openai-chat"
    hits = prefix_hits(srv.url) - before
    reusable = 0
    for c in range(3):  # requests are listed conversation by conversation, turn by turn
        for t in range(1, 3):
            i = 3 * c + t
            assert j["start_times"][i] >= j["start_times"][i - 1] + j["latencies"][i - 1] - 1e-3
            assert j["input_lens"][i] > j["input_lens"][i - 1] + j["output_lens"][i - 1]
            reusable += (j["input_lens"][i - 1] // BLOCK - 1) * BLOCK
    assert hits >= reusable, (hits, reusable)
    # the by-turn summary: 3 turns of 3 conversations each, prompts growing
    assert j["turn_completed"] == [3, 3, 3] and len(j["turn_median_ttft_ms"]) == 3
    assert j["turn_mean_input_tokens"][0] < j["turn_mean_input_tokens"][1] < j["turn_mean_input_tokens"][2]
    assert "Multi-turn: median TTFT (ms) by turn" in r.stdout and "Turn 3 (3, ~" in r.stdout


def test_multiturn_history_carries_the_answers(tmp_path):
    """Against a recording double: turn k+1's messages are exactly turn k's messages, the
    answer streamed for turn k, then the next user message (the file's assistant message
    replaced); a failed turn fails the conversation's later turns unsent."""
    up = UpstreamDouble("decode")
    try:
        convs = conversations(2, 3, words=5)
        ds = tmp_path / "mt.json"  # vLLM's multi-turn file: one JSON list
        ds.write_text(json.dumps(convs))
        r = bench(up.url, "--dataset-name", "custom", "--dataset-path", str(ds),
                  "--custom-output-len", "3", "--disable-shuffle", "--max-concurrency", "2")
        assert r.returncode == 0, r.stdout + r.stderr
        posts = [q for q in up.completions() if q["path"] == "/v1/chat/completions"]
        assert len(posts) == 6
        by_conv = {}
        for q in posts:
            by_conv.setdefault(q["json"]["messages"][0]["content"], []).append(q)
        for c, conv in enumerate(convs):
            sent = sorted(by_conv[f"conversation {c}"], key=lambda q: len(q["json"]["messages"]))
            users = [m for m in conv["messages"] if m["role"] == "user"]
            assert [m["content"] for m in sent[0]["json"]["messages"]] == [f"conversation {c}", users[0]["content"]]
            for k in range(1, 3):
                prev, cur = sent[k - 1]["json"], sent[k]["json"]
                answer = "".join(up._text(prev, i) for i in range(3))
                assert cur["messages"] == prev["messages"] + [
                    {"role": "assistant", "content": answer}, {"role": "user", "content": users[k]["content"]}]
                assert sent[k]["time"] > sent[k - 1]["time"]
        # a turn that fails: the conversation's later turns are failed, not sent
        up.clear()
        up.fail_status = 500
        r = bench(up.url, "--dataset-name", "custom", "--dataset-path", str(ds), "--custom-output-len", "2")
        assert r.returncode == 1 and "failed" in r.stderr
        assert len([q for q in up.completions() if q["path"] == "/v1/chat/completions"]) == 2
    finally:
        up.stop()


def sharegpt_file(path):
    entries = [
        {"id": "a", "conversations": [
            {"from": "human", "value": "What is the state of the union today in America and the world?"},
            {"from": "gpt", "value": "The state of the union is strong and the nation is at work."}]},
        {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there my friend"}]},
        {"id": "one-turn", "conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "none"},
        {"id": "b", "conversations": [
            {"from": "human", "value": "Tell me about the Congress and the law of the land please."},
            {"from": "gpt", "value": "Congress makes the law of the land."},
            {"from": "human", "value": "a later turn, not used"}]},
    ]
    path.write_text(json.dumps(entries))
    return entries


def test_sharegpt(srv, tmp_path):
    """First turn the prompt, the gpt reply's token count (the server's tokenizer) the output
    length; entries with fewer than two turns or a prompt under 4 tokens are skipped (vLLM's
    filter); --sharegpt-output-len overrides the length."""
    ds = tmp_path / "sg.json"
    e = sharegpt_file(ds)

    def ntok(text):
        return requests.post(srv.url + "/tokenize", json={"prompt": text}, timeout=10).json()["count"]

    assert ntok("hi") < 4  # the entry "short" is filtered out
    j, _ = run_json(srv.url, tmp_path, "--dataset-name", "sharegpt", "--dataset-path", str(ds),
                    "--num-prompts", "2", "--ignore-eos", "--save-detailed")
    want = {ntok(e[0]["conversations"][0]["value"]): ntok(e[0]["conversations"][1]["value"]),
            ntok(e[4]["conversations"][0]["value"]): ntok(e[4]["conversations"][1]["value"])}
    assert j["completed"] == 2
    assert sorted(zip(j["input_lens"], j["output_lens"])) == sorted(want.items())
    j, _ = run_json(srv.url, tmp_path, "--dataset-name", "sharegpt", "--dataset-path", str(ds),
                    "--num-prompts", "3", "--ignore-eos", "--sharegpt-output-len", "5")
    assert j["completed"] == 3 and j["total_output_tokens"] == 15  # oversampled to 3


BAD = [
    ("custom", None, "--dataset-name custom needs --dataset-path FILE"),
    ("custom", "missing", "missing.jsonl: No such file or directory"),
    ("custom", '{"prompt": "a"}\n{"prompt": oops}\n', "line 2: bad JSON at column"),
    ("custom", '{"text": "a"}\n', 'line 1: keys "text"; accepted: {"prompt": "..."}'),
    ("custom", "\n  \n", "an empty dataset"),
    ("custom", '{"messages": [{"role": "bot", "content": "x"}]}\n', "turn 0 has role 'bot'; accepted: user, assistant, system"),
    ("custom", '{"messages": [{"role": "user"}]}\n', 'turn 0 has keys "role"; accepted: {"role"'),
    ("custom", '{"messages": [{"role": "system", "content": "s"}]}\n', "a conversation without a user turn"),
    ("custom", '[{"id": "x", "messages": 3}]', 'entry 0: keys "id", "messages"'),
    ("sharegpt", '{"prompt": "a"}\n{"prompt": "b"}\n', "a ShareGPT file is one JSON list"),
    ("sharegpt", '{"conversations": []}', "a ShareGPT file is a JSON list"),
    ("sharegpt", '[{"id": "x"}, {"conversations": [{"from": "human"}]}]', 'no entry with a "conversations" list of at least two turns'),
    ("sharegpt", '[{"conversations": [{"from": "human", "text": "q"}, {"from": "gpt", "value": "a"}]}]', 'turn 0 has keys "from", "text"'),
    ("random", "", "cannot use the 'random' dataset with --dataset-path"),
]


@pytest.mark.parametrize("name,content,message", BAD)
def test_bad_dataset_refused(tmp_path, name, content, message):
    """Refused with exit status 2 before any request (nothing listens at the URL)."""
    args = ["--dataset-name", name]
    if content is not None:
        path = tmp_path / ("missing.jsonl" if content == "missing" else "ds.jsonl")
        if content != "missing":
            path.write_text(content)
        args += ["--dataset-path", str(path)]
    r = bench("http://127.0.0.1:1", "--model", "m", *args, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Serving Benchmark Result" not in r.stdout


def test_generated_multiturn_dataset(srv, tmp_path):
    """tools/gen_multiturn_dataset.py's file (here from a small corpus of its own; JSONL and
    vLLM's JSON-list shape) runs as a custom multi-turn dataset: every conversation's turns
    in order, each prompt longer than the previous prompt plus its answer."""
    import sys
    from pathlib import Path
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("<|doc|> 1790_Washington_None\n" + " ".join(
        f"the people of the nation and the state must work {i}" for i in range(300)))
    tool = Path(__file__).resolve().parents[2] / "tools" / "gen_multiturn_dataset.py"
    for name in ("mt.jsonl", "mt.json"):
        out = tmp_path / name
        g = subprocess.run([sys.executable, str(tool), "--out", str(out), "--corpus", str(corpus),
                            "--conversations", "3", "--turns", "3", "--user-words", "24"],
                           capture_output=True, text=True, timeout=60)
        assert g.returncode == 0 and "3 conversations x 3 turns" in g.stdout, g.stderr
        j, _ = run_json(srv.url, tmp_path, "--dataset-name", "custom", "--dataset-path", str(out),
                        "--custom-output-len", "4", "--ignore-eos", "--num-prompts", "3",
                        "--save-detailed", "--disable-shuffle", "--max-concurrency", "2")
        assert j["completed"] == 9 and j["num_conversations"] == 3, j
        for c in range(3):
            lens = j["input_lens"][3 * c:3 * c + 3]
            assert lens[0] > 24 and all(lens[t] > lens[t - 1] + 4 + 24 for t in (1, 2)), lens


def test_a_vllm_command_line_runs_unchanged(srv, tmp_path):
    """`vllm bench serve`'s usual flags, as its docs write them: --backend, --host/--port,
    --percentile-metrics, --metric-percentiles, --save-result under vLLM's file name,
    --tokenizer and --trust-remote-code accepted (the server counts the tokens)."""
    port = srv.url.rsplit(":", 1)[1]
    r = subprocess.run([BIN, "bench", "serve", "--backend", "vllm", "--model", "tiny", "--host", "127.0.0.1",
                        "--port", port, "--dataset-name", "random", "--random-input-len", "16",
                        "--random-output-len", "4", "--num-prompts", "3", "--request-rate", "10",
                        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                        "--save-result", "--result-dir", str(tmp_path / "res"), "--tokenizer", "Qwen/x",
                        "--trust-remote-code", "--seed", "0", "--disable-tqdm"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    files = list((tmp_path / "res").glob("vllm-10.0qps-tiny-*.json"))
    assert len(files) == 1, list((tmp_path / "res").iterdir())
    j = json.loads(files[0].read_text())
    assert j["backend"] == "vllm" and j["completed"] == 3 and j["total_output_tokens"] == 12
    assert {"p50_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "p99_itl_ms"} <= set(j) and "p90_ttft_ms" not in j
    r = bench(srv.url, "--percentile-metrics", "ttft,latency", "--num-prompts", "1")
    assert r.returncode == 2 and "accepted: a comma-separated list of ttft, tpot, itl, e2el" in r.stderr
