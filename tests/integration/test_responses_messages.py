"""/v1/responses (OpenAI Responses) and /v1/messages (Anthropic Messages) with the official
`openai` and `anthropic` packages against `disagg serve` on the tiny model: each answer
equals the chat completion of the same conversation (greedy), streaming and not; the event
sequences are the APIs'; function tools (tool_choice named / required / any) come back as
function_call items and tool_use blocks whose arguments follow the schema; earlier tool
calls and results in the input render as the chat's; text.format json_schema constrains
as response_format does; bad values get a 400 naming the field; through `disagg proxy`
(P/D) both answer as the colocated server."""
import json

import anthropic
import openai
import pytest
import requests

from proxy_fixtures import ProxyProc
from server_harness import Server
from test_pd import COMMON

TIMEOUT = 120
QUESTION = "What is the state of the Union?"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
          "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    s = Server(*COMMON)
    yield s
    assert s.stop() == 0, s.logs()


def oai(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def anth(s):
    return anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=TIMEOUT)


def chat_text(s, messages, max_tokens, **kw):
    r = requests.post(s.url + "/v1/chat/completions", timeout=TIMEOUT,
                      json=dict(model="tiny", messages=messages, max_tokens=max_tokens,
                                temperature=0, **kw))
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["message"]["content"], c["finish_reason"], r.json()["usage"]


# ---- /v1/responses ---------------------------------------------------------------------

def test_responses_equals_chat(server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    want, reason, usage = chat_text(server, msgs, 12)
    r = oai(server).responses.create(model="tiny", input=QUESTION, instructions="Be brief.",
                                     max_output_tokens=12, temperature=0, top_p=0.5,
                                     metadata={"k": "v"})
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == want
    assert r.status == ("incomplete" if reason == "length" else "completed")
    if reason == "length":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == usage["prompt_tokens"]
    assert r.usage.output_tokens == usage["completion_tokens"]
    assert r.usage.total_tokens == usage["total_tokens"]
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.top_p == 0.5
    assert r.temperature == 0 and r.metadata == {"k": "v"}


def test_responses_stream(server):
    msgs = [{"role": "user", "content": QUESTION}]
    want, _, _ = chat_text(server, msgs, 10)
    events = list(oai(server).responses.create(
        model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=10, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output_text == want and done.usage.output_tokens == 10
    assert events[-4].text == want


def test_responses_tools(server):
    tools = [{"type": "function", "name": "get_weather", "description": "weather",
              "parameters": PARAMS}]
    c = oai(server)
    r = c.responses.create(model="tiny", input="Weather in Paris?", tools=tools,
                           tool_choice={"type": "function", "name": "get_weather"},
                           max_output_tokens=200, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather" and r.status == "completed"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and len(args["city"]) <= 10
    events = list(c.responses.create(model="tiny", input="Weather in Paris?", tools=tools,
                                     tool_choice="required", max_output_tokens=200, temperature=0,
                                     stream=True))
    types = [e.type for e in events]
    assert "response.function_call_arguments.done" in types
    final = events[-1].response
    fc = [o for o in final.output if o.type == "function_call"]
    assert fc and json.loads(fc[0].arguments).keys() == {"city"}
    # the call and its result back in the input render as chat's tool_calls + tool message
    call = calls[0]
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name,
               "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    r2 = c.responses.create(model="tiny", input=follow, tools=tools, tool_choice="none",
                            max_output_tokens=8, temperature=0)
    chat_msgs = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"id": call.call_id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}]},
                 {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    want, _, _ = chat_text(server, chat_msgs, 8, tools=[{"type": "function", "function": {
        "name": "get_weather", "description": "weather", "parameters": PARAMS}}], tool_choice="none")
    assert r2.output_text == want


def test_responses_json_schema(server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = oai(server).responses.create(model="tiny", input="Give JSON", max_output_tokens=40,
                                     temperature=0, text={"format": {
                                         "type": "json_schema", "name": "x", "schema": schema}})
    want, _, _ = chat_text(server, [{"role": "user", "content": "Give JSON"}], 40,
                           response_format={"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": schema}})
    assert r.output_text == want


@pytest.mark.parametrize("body,param,needle", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "does not store responses"),
    ({"background": True}, "background", "not supported"),
    ({"frobnicate": 1}, "frobnicate", "accepted: input, instructions"),
    ({"input": None}, "input", "'input' is required"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "input_image"),
    ({"input": [{"type": "web_search_call"}]}, "input", "accepted: message"),
    ({"tools": [{"type": "web_search"}]}, "tools", "built-in tools"),
    ({"max_output_tokens": 0}, "max_output_tokens", "positive integer"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"text": {"format": {"type": "yaml"}}}, "text", "json_schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     None, "nope"),
])
def test_responses_bad_values(server, body, param, needle):
    b = {"model": "tiny", "input": "hi"}
    b.update(body)
    r = requests.post(server.url + "/v1/responses", json=b, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    if param:
        assert err["param"] == param, err


# ---- /v1/messages ------------------------------------------------------------------------

def test_messages_equals_chat(server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    want, reason, usage = chat_text(server, msgs, 10)
    m = anth(server).messages.create(model="tiny", max_tokens=10, system="Be brief.",
                                     messages=[{"role": "user", "content": QUESTION}],
                                     extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert m.stop_reason == ("max_tokens" if reason == "length" else "end_turn")
    assert m.usage.input_tokens == usage["prompt_tokens"]
    assert m.usage.output_tokens == usage["completion_tokens"]


def test_messages_stream_and_stop_sequence(server):
    want, _, _ = chat_text(server, [{"role": "user", "content": QUESTION}], 20)
    stop = want.split()[3]
    c = anth(server)
    with c.messages.stream(model="tiny", max_tokens=20, stop_sequences=[" " + stop],
                           messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
                           extra_body={"temperature": 0}) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in types and "content_block_stop" in types
    assert final.content[0].text == want[:want.index(" " + stop)]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == " " + stop


def test_messages_tools(server):
    tools = [{"name": "get_weather", "description": "weather", "input_schema": PARAMS}]
    c = anth(server)
    m = c.messages.create(model="tiny", max_tokens=200, tools=tools, tool_choice={"type": "any"},
                          messages=[{"role": "user", "content": "Weather in Paris?"}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and m.stop_reason == "tool_use"
    assert set(uses[0].input) == {"city"} and len(uses[0].input["city"]) <= 10
    with c.messages.stream(model="tiny", max_tokens=200, tools=tools,
                           tool_choice={"type": "tool", "name": "get_weather"},
                           messages=[{"role": "user", "content": "Weather in Paris?"}]) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert "input_json" in types
    assert final.content[-1].type == "tool_use" and set(final.content[-1].input) == {"city"}
    # tool_use / tool_result blocks render as chat's tool_calls / tool message
    u = uses[0]
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": u.id, "name": u.name,
                                                 "input": u.input}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                            "content": "sunny"}]}]
    m2 = c.messages.create(model="tiny", max_tokens=8, tools=tools, tool_choice={"type": "none"},
                           messages=follow, extra_body={"temperature": 0})
    chat_msgs = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"id": u.id, "type": "function", "function": {
                      "name": u.name, "arguments": json.dumps(u.input, separators=(",", ":"))}}]},
                 {"role": "tool", "tool_call_id": u.id, "content": "sunny"}]
    want, _, _ = chat_text(server, chat_msgs, 8, tool_choice="none", tools=[
        {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                          "parameters": PARAMS}}])
    assert m2.content[0].text == want


@pytest.mark.parametrize("body,param,needle", [
    ({"max_tokens": None}, "max_tokens", "'max_tokens' is required"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages", "images and documents are not supported"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "\"user\" | \"assistant\""),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking", "not supported"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice", "\"any\""),
    ({"stop_sequences": "x"}, "stop_sequences", "must be a list of strings"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
])
def test_messages_bad_values(server, body, param, needle):
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    b = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    b.update(body)
    b = {k: v for k, v in b.items() if v is not None}
    r = requests.post(server.url + "/v1/messages", json=b, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error", j
    assert needle in j["error"]["message"] and param in j["error"]["message"], j


def test_messages_errors_in_anthropic_shape(server):
    with pytest.raises(anthropic.BadRequestError, match="images and documents are not supported"):
        anth(server).messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    r = requests.post(server.url + "/v1/messages", timeout=TIMEOUT,
                      json={"model": "gpt-4", "max_tokens": 4,
                            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    # too long for max_model_len (1024): vLLM's wording, in Anthropic's shape
    r = requests.post(server.url + "/v1/messages", timeout=TIMEOUT,
                      json={"model": "tiny", "max_tokens": 5000,
                            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_api_key_as_x_api_key():
    s = Server(*COMMON, "--api-key", "sekret")
    try:
        ok = anthropic.Anthropic(base_url=s.url, api_key="sekret", max_retries=0, timeout=TIMEOUT)
        assert ok.messages.create(model="tiny", max_tokens=2,
                                  messages=[{"role": "user", "content": "hi"}]).content
        bad = anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0, timeout=TIMEOUT)
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert oai_key(s, "sekret").responses.create(model="tiny", input="hi", max_output_tokens=2)
    finally:
        assert s.stop() == 0, s.logs()


def oai_key(s, key):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


# ---- through disagg proxy (P/D) ---------------------------------------------------------

def received_tokens(s):
    """D's vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}."""
    text = requests.get(s.url + "/metrics", timeout=TIMEOUT).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total")
               and 'source="external_kv_transfer"' in line)


def test_pd_equals_colocated(server):
    """P gets max_output_tokens 1 (Responses) / max_tokens 1 (Messages) and keeps the prompt's
    KV; D pulls it and answers: the same output as the colocated server, streaming and not."""
    from test_proxy_pd import Prefill, decode
    p = Prefill()
    d = decode()
    px = ProxyProc([p], [d])
    try:
        px.wait_ready(30)
        via = type("U", (), {"url": px.url})
        before = received_tokens(d)
        kw = dict(model="tiny", input=QUESTION, instructions="Be brief.", max_output_tokens=10,
                  temperature=0)
        want = oai(server).responses.create(**kw).output_text
        assert oai(via).responses.create(**kw).output_text == want
        events = list(oai(via).responses.create(stream=True, **kw))
        assert events[-1].type == "response.completed" and events[-1].response.output_text == want
        mk = dict(model="tiny", max_tokens=10, system="Be brief.",
                  messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0})
        want = anth(server).messages.create(**mk).content[0].text
        assert anth(via).messages.create(**mk).content[0].text == want
        with anth(via).messages.stream(**mk) as s:
            for _ in s:
                pass
            assert s.get_final_message().content[0].text == want
        assert received_tokens(d) > before
        r = requests.post(px.url + "/v1/messages", timeout=TIMEOUT,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    finally:
        px.proc.terminate()
        assert px.proc.wait(10) == 0, px.output()
        assert d.stop() == 0, d.logs()
        assert p.server.stop() == 0, p.server.logs()
