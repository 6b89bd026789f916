"""`disagg serve` with the official `openai` client and raw HTTP: completions and chat
against the transformers greedy references (tests/data/sotu-tiny/greedy.json),
streaming, stop strings, n, seeds, logprobs, echo, token-id prompts, /tokenize and
/detokenize against Hugging Face tokenizers (tests/data/server/tokenize.json)."""
import json

import openai
import pytest
import requests

import server_harness
from server_harness import DATA, ROOT, Server

GREEDY = json.loads((DATA / "sotu-tiny" / "greedy.json").read_text())
EOS = set(GREEDY["eos_token_ids"])
TEXT_CASES = [p for p in GREEDY["prompts"] if p["kind"] == "text"]
CHAT_CASES = [p for p in GREEDY["prompts"] if p["kind"] == "chat"]


@pytest.fixture(scope="module")
def srv():
    s = Server("--max-model-len", "1024", "--kv-cache-memory", "64M")
    yield s
    rc = s.stop()
    assert rc == 0, "disagg serve did not exit cleanly on SIGTERM: " + s.logs()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")


def expected_ids(case):
    """transformers' greedy ids; an eos that ended generation counts as a generated token (as vLLM
    counts it in usage and lists it in logprobs), its text is not shown."""
    ids = case["output_ids"]
    assert not case["stopped_on_eos"] or ids[-1] in EOS
    return ids


def ids_of(tokens):
    return [int(t.split(":", 1)[1]) for t in tokens]


def test_health_models_version(srv):
    assert requests.get(srv.url + "/health").status_code == 200
    m = requests.get(srv.url + "/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "tiny"
    assert m["data"][0]["max_model_len"] == 1024
    assert "version" in requests.get(srv.url + "/version").json()


@pytest.mark.skipif(server_harness.on_gpu(), reason=server_harness.CPU_EXACT)
@pytest.mark.parametrize("case", TEXT_CASES, ids=lambda c: c["prompt"][:20])
def test_completion_greedy_matches_transformers(client, case):
    r = client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=GREEDY["max_new_tokens"],
                                  temperature=0, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    c = r.choices[0]
    want = expected_ids(case)
    assert ids_of(c.logprobs.tokens) == want
    assert c.text == case["output_text"]
    assert c.finish_reason == ("stop" if case["stopped_on_eos"] else "length")
    assert r.usage.prompt_tokens == len(case["prompt_ids"])
    assert r.usage.completion_tokens == len(want)


@pytest.mark.parametrize("case", CHAT_CASES, ids=lambda c: c["prompt"][:20])
def test_chat_greedy_matches_transformers(srv, client, case):
    tk = requests.post(srv.url + "/tokenize", json={"messages": case["messages"]}).json()
    assert tk["tokens"] == case["prompt_ids"]
    r = client.chat.completions.create(model="tiny", messages=case["messages"],
                                       max_completion_tokens=GREEDY["max_new_tokens"], temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.message.content == case["output_text"]
    assert r.usage.prompt_tokens == len(case["prompt_ids"])
    assert r.usage.completion_tokens == len(expected_ids(case))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_streaming_matches_non_streaming(client):
    case = TEXT_CASES[0]
    full = client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=30, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert len({ch.id for ch in chunks}) == 1


def test_chat_streaming_and_raw_sse(srv):
    case = CHAT_CASES[0]
    body = {"model": "tiny", "messages": case["messages"], "max_tokens": 20, "temperature": 0, "stream": True}
    r = requests.post(srv.url + "/v1/chat/completions", json=body, stream=True)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    raw = r.content.decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
    text = "".join(o["choices"][0]["delta"].get("content") or "" for o in objs)
    assert text == case["output_text"][: len(text)] and len(text) > 10
    assert objs[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_strings(client):
    case = TEXT_CASES[0]
    out = case["output_text"]
    stop = "the President"
    cut = out.index(stop)
    r = client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=48, temperature=0,
                                  stop=[stop, "zzz-never"])
    assert r.choices[0].text == out[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=48, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out[:cut]  # never partially emitted
    r = client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=48, temperature=0, stop=stop,
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == out[: cut + len(stop)]


def test_stop_token_ids(client):
    case = TEXT_CASES[0]
    ids = case["output_ids"]
    r = client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=48, temperature=0,
                                  extra_body={"stop_token_ids": [ids[3]]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == ids[3]
    assert r.usage.completion_tokens == ids.index(ids[3]) + 1


def test_n_and_seed_reproducible(client):
    kw = dict(model="tiny", prompt="The Congress shall", max_tokens=24, temperature=1.0, top_p=1.0)
    a = client.completions.create(n=3, seed=42, **kw)
    b = client.completions.create(n=3, seed=42, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each choice has its own seed
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others) > 1
    assert 3 <= a.usage.completion_tokens <= 72 and a.usage.prompt_tokens > 0


def test_logprobs_completions(client):
    case = TEXT_CASES[2]
    r = client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4
        assert tok in top and abs(top[tok] - val) < 1e-6
        assert val >= max(top.values()) - 1e-6  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_logprobs_chat(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT_CASES[0]["messages"], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.token == e.top_logprobs[0].token and bytes(e.bytes) == e.token.encode()


def test_echo_and_prompt_logprobs(client):
    case = TEXT_CASES[2]
    r = client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=3, temperature=0, echo=True,
                                  logprobs=1)
    c = r.choices[0]
    assert c.text.startswith(case["prompt"])
    n_prompt = len(case["prompt_ids"])
    assert len(c.logprobs.tokens) == n_prompt + 3
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert "".join(c.logprobs.tokens) == c.text
    r = client.completions.create(model="tiny", prompt=case["prompt"], max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == n_prompt
    for i, e in enumerate(plp[1:], 1):
        assert str(case["prompt_ids"][i]) in e
        assert all(v["logprob"] <= 0 for v in e.values())


def test_token_id_prompts_and_prompt_lists(client):
    a, b = TEXT_CASES[0], TEXT_CASES[2]
    r = client.completions.create(model="tiny", prompt=a["prompt_ids"], max_tokens=8, temperature=0)
    assert r.choices[0].text == a["output_text"][: len(r.choices[0].text)] and len(r.choices[0].text) > 0
    r = client.completions.create(model="tiny", prompt=[a["prompt"], b["prompt"]], max_tokens=8, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    assert b["output_text"].startswith(r.choices[2].text)
    assert r.usage.prompt_tokens == len(a["prompt_ids"]) + len(b["prompt_ids"])


def test_ignore_eos_and_min_tokens(tmp_path):
    """The tiny model never emits its eos (4093, 4095) in 200 greedy tokens, so against it
    ignore_eos and min_tokens change nothing.  Serve it with a generation_config whose eos
    list also holds the first greedy token after "The": then an eos comes at once, and both
    fields must change the output."""
    src = ROOT / "models" / "disagg-sotu-tiny"
    model = tmp_path / "tiny-eos"
    model.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    gen = json.loads((src / "generation_config.json").read_text())
    body = {"model": "tiny", "prompt": "The", "max_tokens": 40, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    s = Server("--max-model-len", "256", "--kv-cache-memory", "16M")
    try:
        greedy = ids_of(requests.post(s.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"])
    finally:
        s.stop()
    assert len(greedy) == 40 and not set(greedy) & EOS
    eos = greedy[0]
    gen["eos_token_id"] = gen["eos_token_id"] + [eos]
    (model / "generation_config.json").write_text(json.dumps(gen))
    s = Server("--max-model-len", "256", "--kv-cache-memory", "16M", model=str(model))
    try:
        def run(**kw):
            c = requests.post(s.url + "/v1/completions", json=dict(body, **kw)).json()["choices"][0]
            return ids_of(c["logprobs"]["tokens"]), c["finish_reason"]

        assert run() == ([eos], "stop")  # the eos counts as a generated token, as in vLLM
        assert run(ignore_eos=True) == (greedy, "length")
        # min_tokens: eos ignored for the first 12 tokens, then the next one ends it
        n = next((i + 1 for i in range(11, 40) if greedy[i] == eos), 40)
        assert run(min_tokens=12) == (greedy[:n], "stop" if n < 40 else "length")
    finally:
        assert s.stop() == 0


def test_kv_transfer_params_and_request_id(srv):
    body = {"model": "tiny", "prompt": "The", "max_tokens": 2, "kv_transfer_params": {"ignored_key": 1}}
    r = requests.post(srv.url + "/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200
    j = r.json()
    assert "kv_transfer_params" in j and j["kv_transfer_params"] is None
    assert j["id"] == "cmpl-abc-123" and r.headers["X-Request-Id"] == "abc-123"


def test_tokenize_detokenize_match_hf(srv):
    gold = json.loads((DATA / "server" / "tokenize.json").read_text())
    for c in gold["tokenize"]:
        r = requests.post(srv.url + "/tokenize", json={"prompt": c["prompt"], "return_token_strs": True}).json()
        assert r["tokens"] == c["tokens"], c["prompt"]
        assert r["token_strs"] == c["token_strs"], c["prompt"]
        assert r["count"] == len(c["tokens"]) and r["max_model_len"] == 1024
    for c in gold["detokenize"]:
        r = requests.post(srv.url + "/detokenize", json={"tokens": c["tokens"]}).json()
        assert r["prompt"] == c["prompt"]


def test_tools_rendered_through_template(srv):
    msgs = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}]
    plain = requests.post(srv.url + "/tokenize", json={"messages": msgs}).json()
    with_tools = requests.post(srv.url + "/tokenize", json={"messages": msgs, "tools": tools}).json()
    assert with_tools["count"] > plain["count"] + 20
    text = requests.post(srv.url + "/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    assert "# Tools" in text and "get_weather" in text and "<tools>" in text
    r = requests.post(srv.url + "/v1/chat/completions",
                      json={"messages": msgs, "tools": tools, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    msg = r.json()["choices"][0]["message"]
    assert msg["tool_calls"] == [] and isinstance(msg["content"], str)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("extra", [{}, {"stop": ["zzz-never"]}])
def test_tools_without_a_call_return_the_text(client, extra):
    """With tools and tool_choice auto (the default) an output without
    <tool_call> is the message content (vLLM's hermes parser), as with tool_choice none and as
    streamed -- not "" with 16 completion tokens."""
    msgs = [{"role": "user", "content": "Tell me about the economy."}]
    kw = dict(model="tiny", messages=msgs, max_tokens=16, temperature=0, **extra)
    auto = client.chat.completions.create(tools=TOOLS, **kw)
    none = client.chat.completions.create(tools=TOOLS, tool_choice="none", **kw)
    text = none.choices[0].message.content
    assert text and "<tool_call>" not in text
    msg = auto.choices[0].message
    assert msg.content == text, (msg.content, text)
    assert not msg.tool_calls and auto.choices[0].finish_reason == "length"
    assert auto.usage.completion_tokens == 16
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(tools=TOOLS, stream=True, **kw) if c.choices)
    assert streamed == text


def test_load_and_ping(srv):
    """vllm-router's power_of_two probes GET /load; /ping is vLLM's (GET and
    POST, 200 as /health)."""
    import time

    def load_drops_to_zero():
        """A request whose response the client has read may still be ending on the server
        (the last bytes reach the client before the count drops, as in vLLM's middleware):
        poll until the server counts none."""
        deadline = time.monotonic() + 10
        while True:
            r = requests.get(srv.url + "/load")
            if r.status_code != 200 or r.json() == {"server_load": 0} or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert r.status_code == 200 and r.json() == {"server_load": 0}, r.text

    load_drops_to_zero()  # the previous test's streamed request
    for m in ("GET", "POST"):
        assert requests.request(m, srv.url + "/ping").status_code == 200
    assert requests.put(srv.url + "/ping").status_code == 405
    # a request in flight counts: a long generation, /load read while it runs
    import threading
    t = threading.Thread(target=requests.post, args=(srv.url + "/v1/completions",),
                         kwargs={"json": {"model": "tiny", "prompt": "a", "max_tokens": 400,
                                          "ignore_eos": True}})
    t.start()
    try:
        deadline, seen = time.time() + 30, 0
        while time.time() < deadline and not seen:
            seen = requests.get(srv.url + "/load").json()["server_load"]
        assert seen == 1
    finally:
        t.join(120)
    load_drops_to_zero()


def test_metrics_names(srv):
    text = requests.get(srv.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
                 "disagg:kv_cache_usage_perc", "disagg:kv_blocks_used",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        assert name in text, name
    assert srv.metric("vllm:time_to_first_token_seconds_count") > 0
    assert srv.metric("vllm:generation_tokens_total") > 0
