"""`disagg serve` with the flags of `vllm serve` deployment scripts ("Command line"):
each is accepted, honoured where disagg has the concept (tokenizer directory, revision in the
HF cache, chat-template file, generation config, logprob cap, CORS, hermes tool calls), or
refused with a message naming what is accepted (tensor parallel > 1, quantization, fp8_e5m2 KV
cache ...).  Real `disagg serve` processes, the official openai client and raw HTTP."""
import json
import os
import shutil
import subprocess

import openai
import pytest
import requests

from server_harness import BIN, MODEL, Server


def run_serve(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([BIN, "serve", *args], capture_output=True, text=True, timeout=120, env=e)


def refused(*args, env=None):
    """A start-up that must fail at the command line (exit 2) before any model loads."""
    r = run_serve(str(MODEL), "--host", "127.0.0.1", "--port", "0", *args, env=env)
    assert r.returncode == 2, (args, r.returncode, r.stderr)
    return r.stderr


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def max_model_len(srv):
    return requests.post(srv.url + "/tokenize", json={"prompt": "a"}).json()["max_model_len"]


# ---- accepted: values that change nothing, and vLLM's spellings ------------------------------

def test_vllm_deployment_flags_are_accepted_together():
    srv = Server("-tp", "1", "--pipeline-parallel-size=1", "-dp", "1", "--enforce-eager",
                 "--no-enforce-eager", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
                 "--kv-cache-dtype", "auto", "--gpu-memory-utilization", "0.9", "--max-logprobs", "20",
                 "--disable-log-stats", "--load-format", "safetensors", "--generation-config", "auto",
                 "--device", "cpu", "--root-path", "/api", "--swap-space", "4",
                 "--distributed-executor-backend", "mp", "--max_model_len=1024", "--trust-remote-code",
                 "--dtype", "auto", "--kv-cache-memory", "16M")
    try:
        assert max_model_len(srv) == 1024  # the --max_model_len=1024 spelling
        c = client(srv)
        r = c.completions.create(model="tiny", prompt="The", max_tokens=3, temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens == 3
        # --root-path is for a proxy that strips the prefix: the routes stay where they are
        assert requests.get(srv.url + "/v1/models").status_code == 200
        assert "--root-path /api" in srv.logs()
    finally:
        assert srv.stop() == 0


def test_kv_cache_dtype_float32_is_accepted():
    srv = Server("--kv-cache-dtype", "float32", "--kv-cache-memory", "16M", "--max-model-len", "256")
    try:
        r = client(srv).completions.create(model="tiny", prompt="The", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
    finally:
        assert srv.stop() == 0


# ---- refused: concepts disagg does not run (yet), with the accepted values named --------------

@pytest.mark.parametrize("args,words", [
    (("-tp", "3"), ["--tensor-parallel-size 3", "not supported", "accepted: 1, 2, 4 or 8"]),
    (("--tensor-parallel-size=16",), ["--tensor-parallel-size 16", "not supported"]),
    (("--pipeline-parallel-size", "2"), ["--pipeline-parallel-size 2", "not supported"]),
    (("-dp", "2"), ["--data-parallel-size 2", "disagg proxy"]),
    (("-tp", "0"), ["--tensor-parallel-size", "[1,"]),
    (("--quantization", "awq"), ["'awq'", "not supported", "unquantized", "accepted: none, fp8"]),
    (("-q", "gptq"), ["'gptq'", "not supported"]),
    (("--quantization", "zzz"), ["'zzz'", "not a vLLM quantization method"]),
    (("--kv-cache-dtype", "fp8_e5m2"), ["'fp8_e5m2'", "not supported", "only e4m3",
                                         "fp8, fp8_e4m3"]),
    (("--kv-cache-dtype", "int8"), ["'int8'", "not supported", "bfloat16", "fp8_e4m3"]),
    (("--kv-cache-dtype", "int4"), ["'int4'", "float32"]),
    (("--load-format", "pt"), ["'pt'", "not supported", "auto, safetensors"]),
    (("--load-format", "pickle"), ["'pickle'", "not a load format"]),
    (("--distributed-executor-backend", "ray"), ["'ray'", "not supported", "accepted: mp"]),
    (("--distributed-executor-backend", "slurm"), ["'slurm'", "not a backend"]),
    (("--max-logprobs", "21"), ["--max-logprobs 21", "at most 20"]),
    (("--max-logprobs", "x"), ["--max-logprobs", "integer"]),
    (("--swap-space", "-1"), ["--swap-space", "GiB"]),
    (("--gpu-memory-utilization", "1.5"), ["--gpu-memory-utilization", "(0, 1]"]),
    (("--device", "tpu"), ["'tpu'", "not supported", "cuda"]),
    (("--device", "gpu"), ["'gpu'", "not a device", "cuda:N"]),
    (("--generation-config", "/nonexistent"), ["/nonexistent/generation_config.json", "vllm"]),
    (("--tokenizer", "/nonexistent/tok"), ["--tokenizer", "/nonexistent/tok"]),
    (("--chat-template", "/nonexistent/t.jinja"), ["looks like a file path", "cannot be opened"]),
    (("--chat-template", "{{ messages }}"), ["--chat-template", "unsupported chat template"]),
    (("--allowed-origins", "*"), ["--allowed-origins", "JSON list"]),
    (("--allowed-origins", '["a", 1]'), ["--allowed-origins", "JSON list"]),
    (("--tool-call-parser", "pythonic"), ["'pythonic'", "not supported", "hermes, llama3_json, mistral"]),
    (("--enable-auto-tool-choice",), ["--enable-auto-tool-choice", "--tool-call-parser",
                                      "hermes, llama3_json, mistral"]),
    (("--enforce-eager=1",), ["--enforce-eager takes no value"]),
    (("--revision", "v2"), ["--revision"]),
])
def test_refused_with_a_clear_message(args, words, tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    if args[0] == "--revision":  # a hub name with no snapshot at that revision
        (tmp_path / "hub" / "models--org--tiny" / "snapshots").mkdir(parents=True)
        r = run_serve("org/tiny", "--port", "0", *args, env=env)
        assert r.returncode == 2, r.stderr
        err = r.stderr
        words = ["revision 'v2'", "org/tiny", "refs/v2"]
    else:
        err = refused(*args, env=env)
    for w in words:
        assert w in err, (args, w, err)
    assert "Traceback" not in err and "unknown option" not in err


# ---- unknown flags: always the nearest known one -----------------------------------------

@pytest.mark.parametrize("flag,nearest", [
    ("--max-model-lenn", "--max-model-len"),
    ("--tensor-paralel-size", "--tensor-parallel-size"),
    ("--max_num_seq", "--max-num-seqs"),
    ("--no-enforce-eagr", "--enforce-eager"),
    ("--allowed-origin", "--allowed-origins"),
    ("--max-num-batched-token", "--max-num-batched-tokens"),
])
def test_unknown_flag_names_the_nearest(flag, nearest):
    err = refused(flag, "1")
    assert f"unknown option '{flag.replace('_', '-')}'" in err, err
    assert "did you mean " + nearest in err, err


@pytest.mark.parametrize("flag", ["--frobnicate-the-widgets-now", "-tpx", "--zz", "--port-numberx",
                                  "--max"])
def test_unknown_flag_far_from_every_name_gets_no_hint(flag):
    """Only close names are suggested (the dash-less names differ in at most
    40 % of their characters, about difflib's ratio >= 0.6)."""
    err = refused(flag, "1")
    assert f"unknown option '{flag}'" in err and "did you mean" not in err, err


@pytest.mark.parametrize("args,words", [
    (("--reasoning-parser", "granite"), ["--reasoning-parser 'granite' is not supported",
                                         "accepted: qwen3, deepseek_r1"]),
    (("--structured-outputs-config", "{}"), ["structured outputs", "not supported"]),
    (("--speculative-config", "{}"), ["--speculative-config: speculative decoding is not supported"]),
    (("--enable-lora",), ["LoRA adapters are not supported"]),
    (("--lora-modules", "a=b"), ["LoRA adapters are not supported"]),
    (("--enable-expert-parallel",), ["expert parallelism is not supported"]),
    (("--ssl-keyfile", "k.pem"), ["TLS is not supported", "reverse proxy"]),
    (("--cpu-offload-gb", "4"), ["offloading weights", "not supported"]),
    (("--pipeline-parallel-size", "2"), ["--pipeline-parallel-size 2 is not supported", "accepted: 1"]),
    (("--quantization", "awq"), ["'awq' is not supported", "accepted: none, fp8"]),
])
def test_vllm_flags_disagg_lacks_say_so(args, words):
    """vLLM's flags for features disagg lacks name the feature, not a wrong
    flag ("--reasoning-parser" once suggested --tool-call-parser)."""
    err = refused(*args)
    for w in words:
        assert w in err, (args, w, err)
    assert "did you mean" not in err and "unknown option" not in err, err


def test_no_effect_flags_are_accepted_and_logged():
    """vLLM's compilation / uvicorn tuning flags start the server, each logged
    as having no effect."""
    flags = ["-O0", "-O", "3", "--compilation-config", '{"level": 3}', "--async-scheduling",
             "--no-async-scheduling", "--disable-uvicorn-access-log", "--enable-prompt-tokens-details"]
    srv = Server(*flags, "--kv-cache-memory", "16M", "--max-model-len", "256")
    try:
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 200, r.text
        logs = srv.logs()
        for f in ("-O0", "-O 3", '--compilation-config {"level": 3}', "--async-scheduling",
                  "--no-async-scheduling", "--disable-uvicorn-access-log",
                  "--enable-prompt-tokens-details"):
            assert f + ": accepted, no effect" in logs, (f, logs[-3000:])
    finally:
        assert srv.stop() == 0
    assert "needs a value" in refused("--compilation-config")


def test_served_model_names_all_served():
    """--served-model-name a b (vLLM's nargs +) serves both names; responses
    report the first; /v1/models lists both (once read `b` as MODEL and exited)."""
    srv = Server("--served-model-name", "alpha", "beta", "--kv-cache-memory", "16M",
                 "--max-model-len", "256", name=None)
    try:
        c = client(srv)
        assert [m.id for m in c.models.list().data] == ["alpha", "beta"]
        for name in ("alpha", "beta"):
            r = c.completions.create(model=name, prompt="a", max_tokens=2)
            assert r.model == "alpha"
            ch = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2)
            assert ch.model == "alpha"
            t = requests.post(srv.url + "/tokenize", json={"model": name, "prompt": "a b"})
            assert t.status_code == 200, t.text
        with pytest.raises(openai.NotFoundError) as ei:
            c.completions.create(model="gamma", prompt="a", max_tokens=2)
        assert '"alpha", "beta"' in str(ei.value)
        m = requests.get(srv.url + "/metrics").text
        assert 'vllm:prompt_tokens_total{model_name="alpha",engine="0"}' in m
    finally:
        assert srv.stop() == 0


def test_served_model_names_from_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("served-model-name:\n  - one\n  - two\n")
    srv = Server("--config", str(f), "--kv-cache-memory", "16M", "--max-model-len", "256", name=None)
    try:
        assert [m["id"] for m in requests.get(srv.url + "/v1/models").json()["data"]] == ["one", "two"]
    finally:
        assert srv.stop() == 0
    assert "a name is empty" in refused("--served-model-name", "")


def test_override_generation_config_applies():
    """--override-generation-config (vLLM's) replaces the generation config's
    defaults for requests that omit them; max_new_tokens caps max_tokens as vLLM's
    get_max_tokens does."""
    srv = Server("--override-generation-config", '{"temperature": 0, "max_new_tokens": 5}',
                 "--kv-cache-memory", "16M", "--max-model-len", "256")
    try:
        c = client(srv)
        prompt = "the state of the Union is"
        a = c.completions.create(model="tiny", prompt=prompt, max_tokens=5, seed=1)
        b = c.completions.create(model="tiny", prompt=prompt, max_tokens=5, seed=2)
        greedy = c.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
        assert a.choices[0].text == b.choices[0].text == greedy.choices[0].text  # temperature 0
        hot = {c.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=1.5,
                                    seed=s).choices[0].text for s in range(4)}
        assert len(hot) > 1  # the request's own temperature wins
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=50,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        assert "--override-generation-config" in srv.logs()
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("value,words", [
    ('{"temprature": 0.5}', ["unknown key 'temprature'", "accepted keys: temperature, top_p"]),
    ('{"top_p": 2}', ["'top_p' must be a number in (0, 1], got 2"]),
    ('{"max_new_tokens": 0}', ["'max_new_tokens' must be an integer >= 1"]),
    ('{"top_k": 1.5}', ["'top_k' must be an integer >= -1"]),
    ('[1]', ["expected a JSON object"]),
    ('{"temperature": ', ["expected a JSON object"]),
])
def test_override_generation_config_refused(value, words):
    err = refused("--override-generation-config", value)
    for w in words:
        assert w in err, (value, w, err)


# ---- honoured --------------------------------------------------------------------------

def test_max_logprobs_caps_requests():
    srv = Server("--max-logprobs", "2", "--kv-cache-memory", "16M", "--max-model-len", "256")
    try:
        c = client(srv)
        ok = c.completions.create(model="tiny", prompt="The", max_tokens=1, logprobs=2, temperature=0)
        assert len(ok.choices[0].logprobs.top_logprobs[0]) == 2
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="The", max_tokens=1, logprobs=3)
        assert "greater than max allowed: 2" in str(e.value)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=1, logprobs=True, top_logprobs=5)
        assert "greater than max allowed: 2" in str(e.value)
        r = requests.post(srv.url + "/v1/completions",
                          json={"prompt": "The", "max_tokens": 1, "prompt_logprobs": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    finally:
        assert srv.stop() == 0


def test_generation_config_dir_and_vllm(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    srv = Server("--generation-config", str(tmp_path), "--kv-cache-memory", "16M",
                 "--max-model-len", "256")
    try:
        c = client(srv)
        # temperature 0 from DIR/generation_config.json: unseeded requests are greedy
        outs = {c.completions.create(model="tiny", prompt="The state of the", max_tokens=12).choices[0].text
                for _ in range(3)}
        greedy = c.completions.create(model="tiny", prompt="The state of the", max_tokens=12,
                                      temperature=0).choices[0].text
        assert outs == {greedy}
        assert str(tmp_path / "generation_config.json") in srv.logs()
    finally:
        assert srv.stop() == 0
    srv = Server("--generation-config", "vllm", "--kv-cache-memory", "16M", "--max-model-len", "256")
    try:
        assert client(srv).completions.create(model="tiny", prompt="The", max_tokens=2).usage
        assert "default sampling from" not in srv.logs()  # the model's file is not read
    finally:
        assert srv.stop() == 0
    srv = Server("--kv-cache-memory", "16M", "--max-model-len", "256")  # auto: the model's
    try:
        assert "default sampling from generation_config.json: temperature 0.8" in srv.logs()
    finally:
        assert srv.stop() == 0


def tokenizer_without_template(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(MODEL / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((MODEL / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d, template


def test_tokenizer_dir_and_chat_template_file(tmp_path):
    tok, template = tokenizer_without_template(tmp_path)
    msgs = [{"role": "user", "content": "What is the state of the union?"}]
    # the tokenizer directory is the one used: it has no chat template, so chat is refused
    srv = Server("--tokenizer", str(tok), "--kv-cache-memory", "16M", "--max-model-len", "256")
    try:
        r = requests.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        assert r.status_code >= 400 and "chat template" in r.json()["error"]["message"]
        assert requests.post(srv.url + "/v1/completions",
                             json={"prompt": "The", "max_tokens": 2}).status_code == 200
    finally:
        assert srv.stop() == 0
    # --chat-template FILE supplies it
    f = tmp_path / "qwen.jinja"
    f.write_text(template)
    srv = Server("--tokenizer", str(tok), "--chat-template", str(f), "--kv-cache-memory", "16M",
                 "--max-model-len", "256")
    try:
        r = client(srv).chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0)
        assert r.choices[0].message.content is not None and r.usage.completion_tokens == 3
        t = requests.post(srv.url + "/tokenize", json={"messages": msgs}).json()
        text = requests.post(srv.url + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"]
        assert text.startswith("<|im_start|>system\n") and "state of the union?" in text
    finally:
        assert srv.stop() == 0


def test_chat_template_inline_text(tmp_path):
    tok, template = tokenizer_without_template(tmp_path)
    srv = Server("--tokenizer", str(tok), "--chat-template", template, "--kv-cache-memory", "16M",
                 "--max-model-len", "256")
    try:
        r = client(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
    finally:
        assert srv.stop() == 0


def make_hub(tmp_path):
    """A Hugging Face cache with org/tiny at two revisions: main (the model as is) and tag v2,
    whose config.json has max_position_embeddings 512."""
    repo = tmp_path / "hub" / "models--org--tiny"
    main_rev, v2_rev = "a" * 40, "b" * 40
    for rev in (main_rev, v2_rev):
        d = repo / "snapshots" / rev
        d.mkdir(parents=True)
        for f in MODEL.iterdir():
            if f.name != "config.json":
                os.symlink(f, d / f.name)
        cfg = json.loads((MODEL / "config.json").read_text())
        if rev == v2_rev:
            cfg["max_position_embeddings"] = 512
        (d / "config.json").write_text(json.dumps(cfg))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(main_rev)
    (repo / "refs" / "v2").write_text(v2_rev)
    return {"HF_HUB_CACHE": str(tmp_path / "hub")}, main_rev, v2_rev


@pytest.mark.parametrize("rev,expect", [(None, 2048), ("v2", 512), ("b" * 40, 512), ("main", 2048)])
def test_revision_selects_the_snapshot(tmp_path, rev, expect):
    env, _, _ = make_hub(tmp_path)
    extra = ("--revision", rev) if rev else ()
    srv = Server(*extra, "--kv-cache-memory", "16M", model="org/tiny", env=env)
    try:
        assert max_model_len(srv) == expect
        # the API name stays the hub name
        assert requests.get(srv.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        assert srv.stop() == 0


def test_tokenizer_hub_name(tmp_path):
    env, _, _ = make_hub(tmp_path)
    srv = Server("--tokenizer", "org/tiny", "--kv-cache-memory", "16M", "--max-model-len", "256", env=env)
    try:
        assert requests.post(srv.url + "/tokenize", json={"prompt": "The"}).json()["count"] >= 1
    finally:
        assert srv.stop() == 0
    r = run_serve(str(MODEL), "--port", "0", "--tokenizer", "org/absent", env=env)
    assert r.returncode == 2 and "org/absent" in r.stderr and "huggingface" in r.stderr, r.stderr


# ---- CORS ----------------------------------------------------------------------------------

def preflight(srv, origin, method="POST", headers="content-type, authorization"):
    return requests.options(srv.url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": headers})


def test_cors_default_allows_every_origin():
    srv = Server("--kv-cache-memory", "16M", "--max-model-len", "256")
    try:
        r = requests.get(srv.url + "/v1/models", headers={"Origin": "https://x.example"})
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
        assert "Access-Control-Allow-Origin" not in requests.get(srv.url + "/v1/models").headers
        p = preflight(srv, "https://x.example")
        assert p.status_code == 200 and p.text == "OK"
        assert p.headers["Access-Control-Allow-Origin"] == "*"
        assert "POST" in p.headers["Access-Control-Allow-Methods"]
        assert p.headers["Access-Control-Allow-Headers"] == "content-type, authorization"
        assert p.headers["Access-Control-Max-Age"] == "600"
    finally:
        assert srv.stop() == 0


def test_cors_allowed_origins_list():
    srv = Server("--allowed-origins", '["https://a.example"]', "--allowed-methods", '["GET", "POST"]',
                 "--allowed-headers", '["authorization"]', "--allow-credentials", "--api-key", "k",
                 "--kv-cache-memory", "16M", "--max-model-len", "256")
    try:
        ok = requests.get(srv.url + "/v1/models", headers={"Origin": "https://a.example",
                                                           "Authorization": "Bearer k"})
        assert ok.status_code == 200
        assert ok.headers["Access-Control-Allow-Origin"] == "https://a.example"
        assert ok.headers["Access-Control-Allow-Credentials"] == "true"
        assert "Origin" in ok.headers["Vary"]
        other = requests.get(srv.url + "/v1/models", headers={"Origin": "https://b.example",
                                                              "Authorization": "Bearer k"})
        assert other.status_code == 200 and "Access-Control-Allow-Origin" not in other.headers
        p = preflight(srv, "https://a.example")  # before the API key, as the browser sends it
        assert p.status_code == 200 and p.headers["Access-Control-Allow-Origin"] == "https://a.example"
        assert p.headers["Access-Control-Allow-Methods"] == "GET, POST"
        assert "authorization" in p.headers["Access-Control-Allow-Headers"]
        bad = preflight(srv, "https://b.example")
        assert bad.status_code == 400 and "Disallowed CORS origin" in bad.text
        bad = preflight(srv, "https://a.example", method="DELETE")
        assert bad.status_code == 400 and "method" in bad.text
        bad = preflight(srv, "https://a.example", headers="x-secret")
        assert bad.status_code == 400 and "headers" in bad.text
        # the openai client (no Origin) is not affected
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0)
        assert c.models.list().data[0].id == "tiny"
    finally:
        assert srv.stop() == 0


# ---- tool calls -----------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_auto_tool_choice_hermes_with_the_openai_client():
    srv = Server("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--kv-cache-memory", "16M",
                 "--max-model-len", "1024")
    try:
        c = client(srv)
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
        m = r.choices[0].message
        # the tiny model writes prose, not <tool_call> blocks: content, no tool calls
        assert isinstance(m.content, str) and not m.tool_calls
        assert r.choices[0].finish_reason in ("length", "stop")
        # a tool call in the history and a tool result render through the template
        msgs += [{"role": "assistant", "content": None, "tool_calls": [{
                     "id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        t = requests.post(srv.url + "/tokenize", json={"messages": msgs, "tools": TOOLS}).json()
        text = requests.post(srv.url + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"]
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
        assert "<tool_response>\nsunny\n</tool_response>" in text
        s = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=4,
                                      temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
    finally:
        assert srv.stop() == 0


def test_hermes_tool_calls_end_to_end(tmp_path):
    """A model whose greedy output is  <tool_call>{...}</tool_call>  (tool_call_model.py): the
    openai client gets OpenAI tool_calls, streaming and not."""
    import tool_call_model
    model = tmp_path / "toolcaller"
    call = tool_call_model.build(model)
    srv = Server("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--kv-cache-memory", "16M",
                 model=str(model))
    try:
        c = client(srv)
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=16, temperature=0)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert len(ch.message.tool_calls) == 1
        tc = ch.message.tool_calls[0]
        assert tc.type == "function" and tc.id.startswith("chatcmpl-tool-")
        assert tc.function.name == "get_weather"
        assert json.loads(tc.function.arguments) == call["arguments"]
        assert tc.function.arguments == '{"city": "Paris", "unit": "celsius"}'  # json.dumps spacing
        # streaming: the call arrives as a tool_calls delta with its index
        calls, content, reasons = {}, "", []
        for chunk in c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=16,
                                               temperature=0, stream=True):
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            content += d.content or ""
            for t in d.tool_calls or []:
                e = calls.setdefault(t.index, {"name": "", "arguments": ""})
                e["name"] += t.function.name or ""
                e["arguments"] += t.function.arguments or ""
            if chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)
        assert content == "" and reasons == ["tool_calls"]
        assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
        # tool_choice "none": the text as it is
        r = c.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="none",
                                      max_tokens=16, temperature=0)
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == "<tool_call>" + json.dumps(call) + "</tool_call>"
    finally:
        assert srv.stop() == 0


# ---- --config FILE ------------------------------------------------------------------------

def test_config_file_and_command_line_override(tmp_path):
    f = tmp_path / "vllm.yaml"
    f.write_text("# a vLLM config\n"
                 "max-model-len: 512\n"
                 "served_model_name: from-file\n"
                 "enforce-eager: true\n"
                 "enable-chunked-prefill: false\n"
                 "tensor-parallel-size: 1\n"
                 "kv-cache-memory: 16M\n"
                 "allowed-origins:\n  - https://a.example\n"
                 "max-logprobs: 3\n"
                 "tokenizer: null\n"
                 "revision:\n")
    srv = Server("--config", str(f), "--max-logprobs", "1")  # the harness passes --served-model-name tiny
    try:
        assert max_model_len(srv) == 512  # from the file
        assert requests.get(srv.url + "/v1/models").json()["data"][0]["id"] == "tiny"  # CLI wins
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1, "logprobs": 2})
        assert r.status_code == 400 and "max allowed: 1" in r.text  # CLI wins
        h = requests.get(srv.url + "/health", headers={"Origin": "https://a.example"}).headers
        assert h["Access-Control-Allow-Origin"] == "https://a.example"  # a YAML list
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("text,words", [
    ("max-model-lenn: 5\n", ["unknown option '--max-model-lenn'", "did you mean --max-model-len"]),
    ("tensor-parallel-size: 3\n", ["--tensor-parallel-size 3", "not supported"]),
    ("enforce-eager: maybe\n", ["'enforce-eager' is a switch", "true or false"]),
    ("a: [b\n", ["YAML error at line"]),
    ("- max-model-len\n", ["expected a mapping"]),
    ("kv-transfer-config:\n  kv_role: kv_both\n", ["nested mappings", "JSON text"]),
])
def test_config_file_errors(tmp_path, text, words):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    err = refused("--config", str(f))
    for w in words:
        assert w in err, (w, err)
    err = refused("--config", str(tmp_path / "absent.yaml"))
    assert "absent.yaml" in err and "cannot open" in err
