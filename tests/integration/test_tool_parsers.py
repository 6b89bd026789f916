"""--enable-auto-tool-choice --tool-call-parser llama3_json | mistral end to end, with the official
openai client against models whose greedy output is steered (tool_call_model.py: a bigram chain
of added tokens) to write each family's tool-call text, its leading token a special one as in the
real tokenizers ([TOOL_CALLS], [ARGS], <|python_tag|>).  The parsers' own cases (from vLLM's
tests) are in tests/unit/test_tool_parser.c; the refusals of unknown names in test_vllm_flags.py."""
import json
import re

import openai
import pytest

import tool_call_model
from server_harness import Server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
# for the constrained (tool_choice required / named) outputs: the bigram model writes one
# character per token there, so the arguments must be finite
ENUM_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris"]}},
                                          "required": ["city"], "additionalProperties": False}}}]
ARGS = '{"city": "Paris"}'


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def stream(c, **kw):
    """(content, {index: {"id", "name", "arguments"}}, finish reasons) of a streamed chat."""
    content, calls, reasons = "", {}, []
    for chunk in c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0,
                                           stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            e = calls.setdefault(t.index, {"id": "", "name": "", "arguments": ""})
            e["id"] += t.id or ""
            e["name"] += t.function.name or ""
            e["arguments"] += t.function.arguments or ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    return content, calls, reasons


def serve(tmp_path_factory, chain, special, parser):
    model = tmp_path_factory.mktemp(parser) / "m"
    tool_call_model.build(model, chain, special=special)
    return Server("--enable-auto-tool-choice", "--tool-call-parser", parser, "--kv-cache-memory", "16M",
                  model=str(model))


def check_calls(c, id_pattern):
    """One get_weather call, non-streaming and streaming, with ids matching id_pattern."""
    r = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=16, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    assert [(t.type, t.function.name, t.function.arguments) for t in ch.message.tool_calls] == \
        [("function", "get_weather", ARGS)]
    assert re.fullmatch(id_pattern, ch.message.tool_calls[0].id), ch.message.tool_calls[0].id
    content, calls, reasons = stream(c, tools=TOOLS)
    assert content == "" and reasons == ["tool_calls"]
    assert list(calls) == [0] and re.fullmatch(id_pattern, calls[0]["id"])
    assert (calls[0]["name"], calls[0]["arguments"]) == ("get_weather", ARGS)


@pytest.fixture(scope="module")
def mistral_srv(tmp_path_factory):
    """Output  [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]  (v0.3)."""
    srv = serve(tmp_path_factory, ["[TOOL_CALLS]", ' [{"name": "get_weather", "arguments": ' + ARGS + "}]"],
                {"[TOOL_CALLS]"}, "mistral")
    yield srv
    assert srv.stop() == 0


def test_mistral(mistral_srv):
    c = client(mistral_srv)
    check_calls(c, r"[A-Za-z0-9]{9}")
    # tool_choice "none": special tokens skipped as usual, the text is content
    r = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="none",
                                  max_tokens=16, temperature=0)
    m = r.choices[0].message
    assert not m.tool_calls and m.content == ' [{"name": "get_weather", "arguments": ' + ARGS + "}]"
    # no tools: no parsing
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    # the eos that ends the output is not text, special tokens kept or not (as vLLM), unless
    # include_stop_str_in_output
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + ARGS + "}]"
    for extra, want in (({"skip_special_tokens": False}, text),
                        ({"skip_special_tokens": False, "include_stop_str_in_output": True}, text + "<|im_end|>")):
        r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=16, temperature=0, extra_body=extra)
        assert r.choices[0].message.content == want, extra


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_mistral_named_tool_choice_follows_the_format(mistral_srv):
    """A named tool_choice: the output is constrained to a  [TOOL_CALLS] [{...}]  call of it, which
    the mistral parser reads back.  ("required" is the same grammar with more calls allowed; the
    bigram model would not stop adding them.)"""
    c = client(mistral_srv)
    r = c.chat.completions.create(model="tiny", messages=MSGS, tools=ENUM_TOOLS, tool_choice=NAMED,
                                  max_tokens=200, temperature=0, logprobs=True)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.tool_calls and all((t.function.name, t.function.arguments) == ("get_weather", ARGS)
                                         for t in ch.message.tool_calls)
    assert "".join(t.token for t in ch.logprobs.content).startswith('[TOOL_CALLS] [{"name": "get_weather", ')


def test_mistral_v11(tmp_path_factory):
    """Tekken (v11+):  [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}  after some content."""
    srv = serve(tmp_path_factory, ["Let me check.", "[TOOL_CALLS]", "get_weather", "[ARGS]", ARGS],
                {"[TOOL_CALLS]", "[ARGS]"}, "mistral")
    try:
        c = client(srv)
        r = c.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=16, temperature=0)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == "Let me check.", ch
        assert [(t.function.name, t.function.arguments) for t in ch.message.tool_calls] == [("get_weather", ARGS)]
        assert re.fullmatch(r"[A-Za-z0-9]{9}", ch.message.tool_calls[0].id)
        content, calls, reasons = stream(c, tools=TOOLS)
        assert content == "Let me check." and reasons == ["tool_calls"]
        assert (calls[0]["name"], calls[0]["arguments"]) == ("get_weather", ARGS)
        # tool_choice named: constrained to [TOOL_CALLS]get_weather[ARGS]{...} (the tokenizer has [ARGS])
        r = c.chat.completions.create(model="tiny", messages=MSGS, tools=ENUM_TOOLS, max_tokens=200,
                                      temperature=0, logprobs=True, tool_choice=NAMED)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
        assert [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls] == \
            [("get_weather", {"city": "Paris"})]
        assert "".join(t.token for t in ch.logprobs.content).startswith("[TOOL_CALLS]get_weather[ARGS]{")
    finally:
        assert srv.stop() == 0


def test_llama3_json(tmp_path_factory):
    """Llama 3.1:  <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}."""
    srv = serve(tmp_path_factory, ["<|python_tag|>", '{"name": "get_weather", "parameters": ' + ARGS + "}"],
                {"<|python_tag|>"}, "llama3_json")
    try:
        c = client(srv)
        check_calls(c, r"chatcmpl-tool-[0-9a-f]{32}")
        r = c.chat.completions.create(model="tiny", messages=MSGS, tools=ENUM_TOOLS, max_tokens=200,
                                      temperature=0, tool_choice=NAMED, logprobs=True)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        assert all((t.function.name, t.function.arguments) == ("get_weather", ARGS) for t in ch.message.tool_calls)
        assert "".join(t.token for t in ch.logprobs.content).startswith('{"name": "get_weather", "parameters": ')
    finally:
        assert srv.stop() == 0


def test_default_parser_is_hermes(tmp_path_factory):
    """Without --tool-call-parser the Hermes parser reads the output: a Mistral call stays text."""
    model = tmp_path_factory.mktemp("plain") / "m"
    tool_call_model.build(model, ["[TOOL_CALLS]", ' [{"name": "get_weather", "arguments": ' + ARGS + "}]"],
                          special={"[TOOL_CALLS]"})
    srv = Server("--kv-cache-memory", "16M", model=str(model))
    try:
        r = client(srv).chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=16,
                                                temperature=0)
        m = r.choices[0].message
        assert not m.tool_calls and m.content.startswith(' [{"name": "get_weather"'), m
    finally:
        assert srv.stop() == 0
