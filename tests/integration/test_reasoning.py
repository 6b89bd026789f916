"""--reasoning-parser and chat_template_kwargs end to end, with the official openai
client against models whose greedy output is steered (tool_call_model.py: a bigram chain of
added tokens), so the <think> text the parser sees is known."""
import json
import pathlib

import openai
import pytest
import requests

import tool_call_model
from server_harness import Server

TEMPLATES = pathlib.Path(__file__).resolve().parents[1] / "data" / "chat_templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MSGS = [{"role": "user", "content": "What is 2 + 2?"}]


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def stream(c, **kw):
    """(reasoning, content, tool calls, finish reasons) of a streamed chat."""
    reasoning, content, calls, reasons = "", "", {}, []
    for chunk in c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0,
                                           stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        r = getattr(d, "reasoning_content", None)
        assert not (r and d.content), chunk  # one kind of text per delta
        reasoning += r or ""
        content += d.content or ""
        for t in d.tool_calls or []:
            e = calls.setdefault(t.index, {"name": "", "arguments": ""})
            e["name"] += t.function.name or ""
            e["arguments"] += t.function.arguments or ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    return reasoning, content, calls, reasons


@pytest.fixture(scope="module")
def qwen3_srv(tmp_path_factory):
    """Output  <think>I should add.</think>The answer is 4.  with --reasoning-parser qwen3 and the
    official Qwen3 template as --chat-template."""
    model = tmp_path_factory.mktemp("think") / "m"
    tool_call_model.build(model, ["<think>", "I should add.", "</think>", "The answer is 4."])
    srv = Server("--reasoning-parser", "qwen3", "--chat-template", str(TEMPLATES / "qwen3.jinja"),
                 "--kv-cache-memory", "16M", model=str(model))
    yield srv
    assert srv.stop() == 0


def test_qwen3_reasoning_content(qwen3_srv):
    c = client(qwen3_srv)
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0)
    m = r.choices[0].message
    assert m.reasoning_content == "I should add." and m.content == "The answer is 4.", m
    assert r.choices[0].finish_reason == "stop"
    reasoning, content, calls, reasons = stream(c)
    assert (reasoning, content, calls, reasons) == ("I should add.", "The answer is 4.", {}, ["stop"])


def test_reasoning_with_stop_string(qwen3_srv):
    """Stop strings apply to the text; the split follows (the stop cuts the content)."""
    c = client(qwen3_srv)
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0, stop=["answer"])
    m = r.choices[0].message
    assert m.reasoning_content == "I should add." and m.content == "The ", m
    assert stream(c, stop=["answer"])[:2] == ("I should add.", "The ")
    # a stop inside the reasoning: no </think>, so qwen3 (both tags needed) gives all content
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0, stop=["add"])
    m = r.choices[0].message
    assert m.reasoning_content is None and m.content == "<think>I should ", m


def test_chat_template_kwargs_reach_the_template(qwen3_srv):
    """enable_thinking false adds Qwen3's empty <think> block to the prompt; unknown keys are
    ignored (as Jinja ignores them); a non-object is refused."""
    def count(kw):
        body = {"messages": MSGS}
        if kw is not None:
            body["chat_template_kwargs"] = kw
        r = requests.post(qwen3_srv.url + "/tokenize", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["count"]
    base = count(None)
    assert count({"enable_thinking": True, "some_other_key": [1]}) == base
    assert count({"enable_thinking": False}) > base
    c = client(qwen3_srv)
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == count({"enable_thinking": False})
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4,
                                  extra_body={"chat_template_kwargs": "enable_thinking"})
    assert "chat_template_kwargs" in str(e.value)


@pytest.fixture(scope="module")
def r1_model(tmp_path_factory):
    """Output  checking the weather</think><tool_call>{...}</tool_call>  (no <think>: R1 opens
    it in the prompt)."""
    model = tmp_path_factory.mktemp("r1") / "m"
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    tool_call_model.build(model, ["checking the weather", "</think>", "<tool_call>", json.dumps(call),
                                  "</tool_call>"])
    return model


def test_deepseek_r1_reasoning_and_tool_calls(r1_model):
    srv = Server("--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice", "--tool-call-parser",
                 "hermes", "--kv-cache-memory", "16M", model=str(r1_model))
    try:
        c = client(srv)
        r = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=16, temperature=0)
        ch = r.choices[0]
        assert ch.message.reasoning_content == "checking the weather", ch
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert [(t.function.name, t.function.arguments) for t in ch.message.tool_calls] == \
            [("get_weather", '{"city": "Paris"}')]
        reasoning, content, calls, reasons = stream(c, tools=TOOLS)
        assert reasoning == "checking the weather" and content == "" and reasons == ["tool_calls"]
        assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        # without tools: everything after </think> is content; before a </think> it is reasoning
        r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0)
        assert r.choices[0].message.reasoning_content == "checking the weather"
        assert r.choices[0].message.content.startswith("<tool_call>")
        r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, temperature=0)
        m = r.choices[0].message
        assert m.reasoning_content == "checking the weather" and m.content is None  # no </think> yet
    finally:
        assert srv.stop() == 0


def test_qwen3_closing_tag_only(r1_model):
    """vLLM's qwen3 parser: an output with "</think>" but no "<think>" (Qwen3-Thinking-2507's
    templates open the block in the prompt) has the text before "</think>" as reasoning, final
    and streamed; after a prompt that closed a block (the official template's enable_thinking
    false) the stream is all content, as vLLM's reasoning-ended check of the prompt makes it."""
    srv = Server("--reasoning-parser", "qwen3", "--chat-template", str(TEMPLATES / "qwen3.jinja"),
                 "--kv-cache-memory", "16M", model=str(r1_model))
    try:
        c = client(srv)
        r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0)
        m = r.choices[0].message
        assert m.reasoning_content == "checking the weather", m
        assert m.content.startswith("<tool_call>"), m
        reasoning, content, _, _ = stream(c)
        assert reasoning == "checking the weather" and content == m.content
        reasoning, content, _, _ = stream(c, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert reasoning == "" and content.startswith("checking the weather</think><tool_call>")
        # no "</think>" in the output (cut by max_tokens): all content in the final form
        r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, temperature=0)
        m = r.choices[0].message
        assert m.reasoning_content is None and m.content == "checking the weather", m
    finally:
        assert srv.stop() == 0


def test_no_parser_keeps_think_in_content(r1_model):
    srv = Server("--kv-cache-memory", "16M", model=str(r1_model))
    try:
        r = client(srv).chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0)
        m = r.choices[0].message
        assert getattr(m, "reasoning_content", None) is None
        assert m.content.startswith("checking the weather</think>")
    finally:
        assert srv.stop() == 0


def test_responses_reasoning_item(qwen3_srv):
    """/v1/responses: the <think> part is a reasoning item before the message, streamed as
    response.reasoning_text.delta events that close before the text starts."""
    c = client(qwen3_srv)
    r = c.responses.create(model="tiny", input="What is 2 + 2?", max_output_tokens=16, temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "I should add." and r.output_text == "The answer is 4."
    events = list(c.responses.create(model="tiny", input="What is 2 + 2?", max_output_tokens=16,
                                     temperature=0, stream=True))
    types = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "I should add."
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "message"]
    assert done.output[0].content[0].text == "I should add." and done.output_text == "The answer is 4."
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]


def test_messages_thinking_block(qwen3_srv):
    """/v1/messages: the <think> part is a thinking block before the text, streamed as
    thinking_delta events (the anthropic SDK accumulates them)."""
    import anthropic
    c = anthropic.Anthropic(base_url=qwen3_srv.url, api_key="x", max_retries=0, timeout=60)
    kw = dict(model="tiny", max_tokens=16, messages=[{"role": "user", "content": "What is 2 + 2?"}],
              extra_body={"temperature": 0})
    m = c.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "I should add." and m.content[1].text == "The answer is 4."
    with c.messages.stream(**kw) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert "thinking" in types
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "I should add." and final.content[1].text == "The answer is 4."
