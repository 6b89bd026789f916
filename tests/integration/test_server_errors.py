"""`disagg serve` bad-input matrix over raw HTTP (OpenAI-style error JSON with the right
status and the offending field named), API key, and command-line errors."""
import json
import socket
import subprocess
import time

import openai
import pytest
import requests

from server_harness import BIN, MODEL, Server, free_port


@pytest.fixture(scope="module")
def srv():
    s = Server("--max-model-len", "256", "--kv-cache-memory", "32M", "--max-body-bytes", "1M")
    yield s
    rc = s.stop()
    assert rc == 0, "disagg serve did not exit cleanly on SIGTERM: " + s.logs()


def err_of(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) >= {"message", "type", "param", "code"} and e["code"] == status
    return e


C = "/v1/completions"
CH = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD = [
    (C, {"prompt": "x", "temperature": -1}, "temperature", "between 0"),
    (C, {"prompt": "x", "temperature": "hot"}, "temperature", "number"),
    (C, {"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    (C, {"prompt": "x", "top_k": -5}, "top_k", "-1"),
    (C, {"prompt": "x", "min_p": 1.5}, "min_p", "between 0 and 1"),
    (C, {"prompt": "x", "presence_penalty": 9}, "presence_penalty", "between -2 and 2"),
    (C, {"prompt": "x", "frequency_penalty": -9}, "frequency_penalty", "between -2 and 2"),
    (C, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    (C, {"prompt": "x", "n": 0}, "n", "between 1"),
    (C, {"prompt": "x", "max_tokens": 0}, "max_tokens", "between 1"),
    (C, {"prompt": "x", "max_tokens": "ten"}, "max_tokens", "integer"),
    (C, {"prompt": "x", "logprobs": 50}, "logprobs", "between 0 and 20"),
    (C, {"prompt": "x", "stop": 3}, "stop", "list of strings"),
    (C, {"prompt": "x", "seed": "s"}, "seed", "integer"),
    (C, {"prompt": "x", "stream": "yes"}, "stream", "boolean"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    (C, {"prompt": 5}, "prompt", "list of token ids"),
    (C, {"prompt": ""}, "prompt", "empty"),
    (C, {"prompt": [1, 2, 999999]}, "prompt", "vocabulary"),
    (C, {"prompt": [1, -2]}, "prompt", "non-negative"),
    (C, {}, "prompt", "required"),
    (C, {"prompt": "x" * 2000, "max_tokens": 10}, "input_tokens", "256"),
    (C, {"prompt": "x", "max_tokens": 400}, "input_tokens", "maximum context length is 256"),
    (C, {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    (C, {"prompt": "x", "kv_transfer_params": 3}, "kv_transfer_params", "object"),
    (C, {"prompt": "x", "stop_token_ids": [999999]}, "stop_token_ids", "vocabulary"),
    (CH, {}, "messages", "required"),
    (CH, {"messages": []}, "messages", "non-empty"),
    (CH, {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "wizard"),
    (CH, {"messages": MSG, "logprobs": 3}, "logprobs", "boolean"),
    (CH, {"messages": MSG, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    (CH, {"messages": MSG, "tool_choice": "required", "tools": []}, "tool_choice", "non-empty 'tools'"),
    (CH, {"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens", "between 1"),
]


@pytest.mark.parametrize("path,body,param,needle", BAD,
                         ids=[f"{'chat' if b[0] == CH else 'cmpl'}-{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_field(srv, path, body, param, needle):
    e = err_of(requests.post(srv.url + path, json=body), 400)
    assert e["param"] == param
    assert needle in e["message"], e["message"]


def test_context_length_message_is_vllms(srv):
    """vLLM's current body and wording for a request beyond max_model_len (its renderer's
    check: BadRequestError, param input_tokens, the "(parameter=..., value=...)" tail), as
    the official client raises it; exact because clients parse it (the token counts)."""
    import openai
    cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as ei:
        cl.completions.create(model="tiny", prompt=[1] * 200, max_tokens=100)
    e = ei.value.body
    assert ei.value.status_code == 400
    assert e == {"message": "This model's maximum context length is 256 tokens. However, you requested 100 "
                            "output tokens and your prompt contains 200 input tokens, for a total of 300 "
                            "tokens. Please reduce the length of the input prompt or the number of requested "
                            "output tokens. (parameter=input_tokens, value=200)",
                 "type": "BadRequestError", "param": "input_tokens", "code": 400}
    # completions' default max_tokens is 16, as vLLM's
    e = err_of(requests.post(srv.url + C, json={"prompt": [1] * 250}), 400)
    assert "you requested 16 output tokens and your prompt contains 250 input tokens, for a total of " \
           "266 tokens" in e["message"]
    # chat without max_tokens takes the rest of the context: a prompt that fills it asks for 0
    e = err_of(requests.post(srv.url + CH, json={"messages": [{"role": "user", "content": "x " * 400}]}), 400)
    assert e["message"].startswith("This model's maximum context length is 256 tokens. However, you "
                                   "requested 0 output tokens and your prompt contains "), e["message"]
    # the chat endpoint says the same
    e = err_of(requests.post(srv.url + CH, json={"messages": MSG, "max_tokens": 300}), 400)
    assert e["param"] == "input_tokens" and "you requested 300 output tokens" in e["message"]


def test_unknown_model_keeps_the_accepted_names(srv):
    """vLLM's "The model `x` does not exist." (404 NotFoundError, param model), plus the
    accepted names."""
    e = err_of(requests.post(srv.url + C, json={"model": "gpt-4", "prompt": "x"}), 404)
    assert e["type"] == "NotFoundError"
    assert e["message"].startswith("The model `gpt-4` does not exist.") and '"tiny"' in e["message"]


def test_invalid_json_and_non_object(srv):
    e = err_of(requests.post(srv.url + C, data=b'{"prompt": "x",', headers={"Content-Type": "application/json"}), 400)
    assert "Invalid JSON" in e["message"]
    err_of(requests.post(srv.url + C, data=b"[1, 2]"), 400)
    err_of(requests.post(srv.url + C, data=b"\xff\xfe"), 400)


def test_unknown_model_route_method_and_size(srv):
    e = err_of(requests.post(srv.url + C, json={"model": "gpt-4", "prompt": "x"}), 404)
    assert e["param"] == "model" and "tiny" in e["message"]
    err_of(requests.get(srv.url + "/v1/nope"), 404)
    r = requests.get(srv.url + C)
    err_of(r, 405)
    assert r.headers["Allow"] == "POST"
    err_of(requests.post(srv.url + "/health"), 405)
    r = requests.post(srv.url + C, data=b'{"prompt":"' + b"a" * (2 << 20) + b'"}')
    assert r.status_code == 413
    # the server is still fine afterwards
    assert requests.post(srv.url + C, json={"prompt": "The", "max_tokens": 2}).status_code == 200


def test_truncated_and_garbage_requests_do_not_hang(srv):
    for raw in (b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"pro"):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(10)
            t0 = time.monotonic()
            try:
                got = s.recv(4096)
            except ConnectionResetError:
                got = b""
            except socket.timeout:  # neither an answer nor a close: the connection hangs
                raise AssertionError(f"no answer and no close within 10 s after {raw!r}")
            assert got == b"" or got.startswith(b"HTTP/1.1 4"), got  # closed, or a 4xx answer
            assert time.monotonic() - t0 < 10
    assert requests.get(srv.url + "/health").status_code == 200


def test_api_key():
    s = Server("--api-key", "sekret", "--max-model-len", "128", "--kv-cache-memory", "16M")
    try:
        # vLLM's AuthenticationMiddleware answers exactly {"error": "Unauthorized"}
        for r in (requests.post(s.url + C, json={"prompt": "x", "max_tokens": 1}),
                  requests.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"})):
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, r.text
            assert r.headers["Content-Type"].startswith("application/json")
        cl = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as ei:
            cl.completions.create(model="disagg-sotu-tiny", prompt="x", max_tokens=1)
        assert ei.value.status_code == 401 and ei.value.body == "Unauthorized"
        ok = requests.post(s.url + C, json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert requests.get(s.url + "/health").status_code == 200  # not behind the key, as vLLM
    finally:
        assert s.stop() == 0, s.logs()


def test_api_key_from_env():
    s = Server("--max-model-len", "128", "--kv-cache-memory", "16M", env={"VLLM_API_KEY": "envkey"})
    try:
        r = requests.get(s.url + "/v1/models")
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        assert requests.get(s.url + "/v1/models", headers={"Authorization": "Bearer envkey"}).status_code == 200
    finally:
        assert s.stop() == 0, s.logs()


def run_cli(*args):
    return subprocess.run([BIN, "serve", *args], capture_output=True, text=True, timeout=60)


def test_cli_errors():
    r = run_cli(str(MODEL), "--max-model-length", "5")
    assert r.returncode == 2 and "'--max-model-length'" in r.stderr and "--max-model-len" in r.stderr
    r = run_cli(str(MODEL), "--dtype", "int3")
    assert r.returncode == 2 and "int3" in r.stderr and "bfloat16" in r.stderr
    r = run_cli(str(MODEL), "--port", "http")
    assert r.returncode == 2 and "--port" in r.stderr
    r = run_cli(str(MODEL), "--kv-transfer-config", "{not json")
    assert r.returncode == 2 and "--kv-transfer-config" in r.stderr
    r = run_cli(str(MODEL), "--kv-transfer-config", '{"kv_connector": "MooncakeConnector", "kv_role": "kv_sideways"}')
    assert r.returncode == 2 and "kv_sideways" in r.stderr and "kv_producer" in r.stderr
    r = run_cli(str(MODEL), "--kv-cache-memory", "lots")
    assert r.returncode == 2 and "512M" in r.stderr
    r = run_cli("--help")
    assert r.returncode == 0 and "--served-model-name" in r.stdout
    r = run_cli("/nonexistent/model/dir", "--port", "0")
    assert r.returncode == 1 and "/nonexistent/model/dir" in r.stderr


def test_default_model_and_flags_accepted():
    s = Server("--dtype", "bfloat16", "--kv-transfer-config",
               json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                           "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}),
               "--uvicorn-log-level", "warning", "--disable-log-requests", "--no-enable-prefix-caching",
               "--block-size", "16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--seed", "3",
               "--kv-cache-memory", "16M", "--max-model-len", "256", model=None, name=None)
    try:
        m = requests.get(s.url + "/v1/models").json()
        assert m["data"][0]["id"] == "disagg-sotu-tiny"
        r = requests.post(s.url + C, json={"model": "disagg-sotu-tiny", "prompt": "The", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        assert s.stop() == 0, s.logs()


def test_503_while_loading_then_load_failure_exits_1():
    """A producer whose bootstrap server is unreachable retries for ~3 s while loading: the
    server answers meanwhile (503 on /health and generation, models listed), then exits 1."""
    port = free_port()
    dead = free_port()  # nothing listens there
    cfg = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"mooncake_protocol": "tcp",
                                                    "bootstrap_server_address": f"127.0.0.1:{dead}"}})
    p = subprocess.Popen([BIN, "serve", str(MODEL), "--host", "127.0.0.1", "--port", str(port),
                          "--kv-cache-memory", "16M", "--kv-transfer-config", cfg],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        seen = None
        for _ in range(400):  # up to 20 s on a loaded machine
            if p.poll() is not None:
                break
            try:
                seen = requests.get(url + "/health", timeout=2).status_code
                break
            except requests.ConnectionError:
                time.sleep(0.05)
        assert seen == 503
        e = err_of(requests.post(url + C, json={"prompt": "x"}), 503)
        assert "loading" in e["message"]
        err_of(requests.post(url + "/tokenize", json={"prompt": "x"}), 503)
        assert requests.get(url + "/v1/models").status_code == 200
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1
    assert "starting the KV connector failed" in out and f"127.0.0.1:{dead}" in out
