"""`disagg serve` as a prefill (kv_producer) and a decode (kv_consumer) instance, driven as
the proxy contract of PROTOCOL.md §1 says: P gets the request with max_tokens 1 and
do_remote_decode, D the same request with do_remote_prefill and P's engine id; D's output
equals the colocated greedy output and P's KV bytes really moved (/metrics)."""
import concurrent.futures as cf
import json
import uuid

import pytest
import requests

from server_harness import DATA, Server, free_port

GREEDY = json.loads((DATA / "sotu-tiny" / "greedy.json").read_text())


def kv_config(role):
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})


@pytest.fixture(scope="module")
def pd():
    boot = free_port()
    env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot), "VLLM_HOST_IP": "127.0.0.1"}
    p = Server("--kv-cache-memory", "64M", "--max-model-len", "512", "--kv-transfer-config",
               kv_config("kv_producer"), env=env)
    try:
        d = Server("--kv-cache-memory", "64M", "--max-model-len", "512", "--kv-transfer-config",
                   kv_config("kv_consumer"), env=env)
    except Exception:
        p.stop()
        raise
    yield p, d, f"http://127.0.0.1:{boot}"
    rd, rp = d.stop(), p.stop()
    assert rd == 0 and rp == 0, d.logs() + p.logs()


def test_disaggregated_request_equals_colocated(pd):
    p, d, boot = pd
    engine_id = requests.get(boot + "/query", timeout=10).json()["0"]["engine_id"]
    for case in [c for c in GREEDY["prompts"] if c["kind"] == "text"][:3]:
        body = {"model": "tiny", "prompt": case["prompt"] * 3, "max_tokens": 16, "temperature": 0}
        xfer = f"xfer-{uuid.uuid4()}"
        to_p = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                                           "transfer_id": xfer})
        to_d = dict(body, kv_transfer_params={"do_remote_decode": False, "do_remote_prefill": True,
                                              "remote_engine_id": engine_id, "remote_bootstrap_addr": boot,
                                              "transfer_id": xfer})
        with cf.ThreadPoolExecutor(2) as ex:
            fp = ex.submit(requests.post, p.url + "/v1/completions", json=to_p,
                           headers={"X-Request-Id": str(uuid.uuid4())}, timeout=120)
            fd = ex.submit(requests.post, d.url + "/v1/completions", json=to_d, timeout=120)
            rp, rd = fp.result(), fd.result()
        assert rp.status_code == 200 and rp.json()["kv_transfer_params"] is None
        assert rd.status_code == 200, rd.text
        colocated = requests.post(p.url + "/v1/completions", json=body, timeout=120).json()
        assert rd.json()["choices"][0]["text"] == colocated["choices"][0]["text"]
        assert rd.json()["usage"]["completion_tokens"] == 16
        # the prompt's KV came over the wire and P's first token with it (the first-token
        # handoff, docs/connector.md): D ran no prompt position
        kv = dict(rd.json()["usage"]["kv_transfer"])
        cached = rd.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        # streamed or not depends on whether the pull reached P before its prefill ended
        assert kv.pop("layerwise") in (True, False), rd.json()["usage"]
        assert kv == {"received_prompt_tokens": rd.json()["usage"]["prompt_tokens"] - cached,
                      "computed_prompt_tokens": 0}, rd.json()["usage"]
    assert p.metric("disagg:kv_transfer_bytes_total") > 0
    assert d.metrics()['disagg:kv_first_token_handoffs_total{outcome="used"}'] == 3


def pd_chat(p, d, boot, body, stream=False):
    """One chat request split as the proxy does (P: max_tokens 1 + do_remote_decode; D: the
    request with do_remote_prefill), D's side through the official openai client."""
    import openai
    engine_id = requests.get(boot + "/query", timeout=10).json()["0"]["engine_id"]
    xfer = f"xfer-{uuid.uuid4()}"
    to_p = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True,
                                                       "do_remote_prefill": False, "transfer_id": xfer})
    kv = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": engine_id,
          "remote_bootstrap_addr": boot, "transfer_id": xfer}
    c = openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0, timeout=120)
    with cf.ThreadPoolExecutor(2) as ex:
        fp = ex.submit(requests.post, p.url + "/v1/chat/completions", json=to_p, timeout=120)
        if stream:
            fd = ex.submit(lambda: "".join(
                ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                    stream=True, extra_body={"kv_transfer_params": kv}, **body) if ch.choices))
        else:
            fd = ex.submit(c.chat.completions.create, extra_body={"kv_transfer_params": kv}, **body)
        rp, out = fp.result(), fd.result()
    assert rp.status_code == 200, rp.text
    return out


def test_tools_without_a_call_return_the_text_through_pd(pd):
    """Disaggregated: D's chat with tools (tool_choice auto) whose output has
    no <tool_call> answers the text, streamed or not, as tool_choice none does."""
    p, d, boot = pd
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about taxes."}],
            "max_tokens": 12, "temperature": 0, "tools": tools}
    ref = requests.post(p.url + "/v1/chat/completions", json=dict(body, tool_choice="none"),
                        timeout=120).json()["choices"][0]["message"]["content"]
    assert ref and "<tool_call>" not in ref
    r = pd_chat(p, d, boot, body)
    assert r.choices[0].message.content == ref and not r.choices[0].message.tool_calls
    assert r.usage.completion_tokens == 12
    assert pd_chat(p, d, boot, body, stream=True) == ref


def test_pinned_engine_id_survives_a_restart():
    """kv_transfer_config.engine_id (vLLM's field) pins P's id in the bootstrap
    table, so a router that cached it (vllm-router) keeps working after P restarts; D pulls
    with the id read before the restart."""
    boot = free_port()
    env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot), "VLLM_HOST_IP": "127.0.0.1"}
    cfg = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                      "engine_id": "prefill-a", "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})
    args = ("--kv-cache-memory", "32M", "--max-model-len", "256", "--kv-transfer-config", cfg)
    p = Server(*args, env=env)
    d = Server("--kv-cache-memory", "32M", "--max-model-len", "256", "--kv-transfer-config",
               kv_config("kv_consumer"), env=env)
    try:
        url = f"http://127.0.0.1:{boot}"
        assert requests.get(url + "/query", timeout=10).json()["0"]["engine_id"] == "prefill-a"
        assert p.stop() == 0
        p = Server(*args, env=env)  # a new process, the same pinned id
        assert requests.get(url + "/query", timeout=10).json()["0"]["engine_id"] == "prefill-a"
        body = {"model": "tiny", "prompt": "The state of the Union", "max_tokens": 4, "temperature": 0}
        xfer = f"xfer-{uuid.uuid4()}"
        to_p = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": xfer})
        to_d = dict(body, kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "prefill-a",
                                              "remote_bootstrap_addr": url, "transfer_id": xfer})
        with cf.ThreadPoolExecutor(2) as ex:
            fp = ex.submit(requests.post, p.url + "/v1/completions", json=to_p, timeout=120)
            fd = ex.submit(requests.post, d.url + "/v1/completions", json=to_d, timeout=120)
            assert fp.result().status_code == 200
            rd = fd.result()
        assert rd.status_code == 200, rd.text
        assert rd.json()["usage"]["kv_transfer"]["received_prompt_tokens"] > 0
    finally:
        assert d.stop() == 0
        assert p.stop() == 0
