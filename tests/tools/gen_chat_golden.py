"""Writes tests/data/chat_templates/golden.jsonl (and conversations.json, the
conversations and tools it names): the official chat templates of
tests/data/chat_templates/*.jinja rendered by transformers' own render function
(transformers.utils.chat_template_utils.render_jinja_template: jinja2's sandbox
with trim_blocks, lstrip_blocks, loopcontrols, and transformers' tojson,
raise_exception and strftime_now) over many conversations.

Messages are stored in the OpenAI request form; before rendering they are
turned into what vLLM hands the template: content parts joined with "\\n",
null content "", tool_calls kept when not null with string arguments parsed
into objects (null / "" -> {}), and only role, content, tool_calls,
tool_call_id, name and reasoning_content (a string) kept.
tests/unit/test_chat_template.c renders the same cases natively and compares
byte for byte (or expects the same error).  strftime_now (Mistral-Small's
dated default system prompt) reads a fixed time, NOW, stored in those rows as
"now" (the C side renders with chat_template_opts.now).

The Mistral-Small templates are copies of the chat_template of
mistralai/Mistral-Small-24B-Instruct-2501 and of the tokenizer_config.json of
mistralai/Mistral-Small-3.1-24B-Instruct-2503 (as public GitHub copies quote
them; the HF repositories cannot be reached from here).

Run: USE_TORCH=0 python3 tests/tools/gen_chat_golden.py  (transformers and
jinja2 from PyPI; torch is not needed)."""
import calendar
import copy
import datetime
import json
import os
import pathlib

os.environ.setdefault("USE_TORCH", "0")
import transformers.utils.chat_template_utils as ctu  # noqa: E402
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

NOW = calendar.timegm((2025, 3, 5, 12, 0, 0))  # strftime_now's time (local time of this instant)


class FixedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime.datetime.fromtimestamp(NOW, tz)


ctu.datetime = FixedDatetime  # transformers' strftime_now calls datetime.now()

DIR = pathlib.Path(__file__).resolve().parents[1] / "data" / "chat_templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. 東京"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time", "return": {"type": "string"},
    "parameters": {"type": "object", "properties": {}, "required": []}}}
TOOLS = [WEATHER, TIME]


def call(name, args, cid="abcDEF123"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
S = lambda c: {"role": "system", "content": c}  # noqa: E731
T = lambda c, cid="abcDEF123": {"role": "tool", "content": c, "tool_call_id": cid}  # noqa: E731

CONVS = {
    "user_only": [U("Hello!")],
    "system_user": [S("You are terse.\n"), U("  Hi there \n")],
    "multi_turn": [U("Hello!"), A("Bonjour !"), U("What's the weather in Paris and in 東京?\nThanks.")],
    "system_multi": [S("Be brief."), U("a"), A(" b "), U("c"), A("d"), U("e\u3000")],
    "parts": [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
    "null_content": [U("q"), {"role": "assistant", "content": None}, U("again")],
    "tool_round": [S("Use tools."), U("Weather in Paris?"),
                   {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Paris", "unit": "celsius"}')]},
                   T('{"temp": 21.5, "sky": "clear"}'), U("And now?")],
    "tool_round_end": [U("Weather in Paris?"),
                       {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris"})]},
                       T("21 C")],
    "two_tool_results": [U("Weather in Paris and Rome?"),
                         {"role": "assistant", "content": "Let me check.", "tool_calls": [call("get_weather", '{"city": "Paris"}', "abcDEF123"), call("get_weather", '{"city": "Rome"}', "xyzXYZ789")]},
                         T("21", "abcDEF123"), T("25", "xyzXYZ789")],
    "think_history": [U("2+2?"), A("<think>\nadd them\n</think>\n\n4"), U("3+3?")],
    "think_last": [U("2+2?"), A("<think>\nadd\n</think>\n\n4")],
    "think_reasoning_field": [U("2+2?"), {"role": "assistant", "content": "4", "reasoning_content": "\nadd them\n"}],
    "think_after_tool": [U("Weather?"),
                         {"role": "assistant", "content": "<think>need a tool</think>", "tool_calls": [call("get_weather", '{"city": "Oslo"}')]},
                         T("-3"), A("<think>\nit is cold\n</think>\n\nIt is -3 C.")],
    "think_no_open_tag": [U("hi"), A("reasoning only</think>answer"), U("more")],
    "tool_response_user": [U("first"), A("ok"), U("<tool_response>\nx\n</tool_response>"), A("<think>r</think>done")],
    "float_args": [U("calc"), {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"x": 1.5e-7, "y": 1e22, "z": [true, null, "\\u00e9\\n"]}')]}, T("ok"), U("thanks")],
    "tool_answer": [S("sys"), U("Weather in Paris?"),
                    {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Paris", "unit": "celsius", "n": 2.5}')]},
                    T('{"temp": 21.5}'), A("It is 21.5 C."), U("Thanks")],
    "system_middle": [U("a"), A("b"), S("new rule"), U("c")],
    "not_alternating": [U("a"), U("b")],
    "bad_tool_id": [U("w?"), {"role": "assistant", "content": None, "tool_calls": [call("get_weather", "{}", "short")]}, T("x", "short")],
    "two_calls_single_tool_model": [U("w?"), {"role": "assistant", "content": None, "tool_calls": [call("get_weather", "{}"), call("get_time", "{}")]}],
    "same_user_twice": [U("hi"), A("yo"), U("hi")],
    "system_only": [S("just a system prompt")],
}

# (template, conversation names, tools options, kwargs options)
ALL = list(CONVS)
PLAN = {
    "qwen2.5.jinja": (ALL, [None, TOOLS], [{}]),
    "qwen3.jinja": (ALL, [None, TOOLS], [{}, {"enable_thinking": False}, {"enable_thinking": True}]),
    "qwen3-initial.jinja": (ALL, [None, TOOLS], [{}, {"enable_thinking": False}]),
    "llama3.1.jinja": (ALL, [None, TOOLS], [{}, {"date_string": "05 Mar 2025"},
                                             {"tools_in_user_message": False, "date_string": "1 Jan 2025"},
                                             {"builtin_tools": ["brave_search", "code_interpreter", "get_weather"]},
                                             {"custom_tools": [TIME]}, {"unused_key": 1}]),
    "llama3.2.jinja": (ALL, [None, TOOLS], [{"date_string": "26 Jul 2024"},
                                             {"tools_in_user_message": False, "date_string": "2 Feb 2025"}]),
    "mistral-v0.3.jinja": (ALL, [None, TOOLS], [{}]),
    "mistral-nemo.jinja": (ALL, [None, TOOLS], [{}]),
    "mistral-small-2501.jinja": (ALL, [None, TOOLS], [{}]),
    "mistral-small-3.1.jinja": (ALL, [None, TOOLS], [{}]),
}
TOKENS = {"llama": ("<|begin_of_text|>", "<|eot_id|>"), "mistral": ("<s>", "</s>"), "qwen": (None, "<|im_end|>")}


def vllm_messages(msgs):
    out = []
    for m in msgs:
        c = m.get("content")
        if c is None:
            c = ""
        elif isinstance(c, list):
            c = "\n".join(p["text"] for p in c)
        r = {"role": m["role"], "content": c}
        if m.get("tool_calls") is not None:
            calls = copy.deepcopy(m["tool_calls"])
            for tc in calls:
                a = tc["function"].get("arguments")
                if a is None or a == "":
                    tc["function"]["arguments"] = {}
                elif isinstance(a, str):
                    tc["function"]["arguments"] = json.loads(a)
            r["tool_calls"] = calls
        for k in ("tool_call_id", "name"):
            if m.get(k) is not None:
                r[k] = m[k]
        if isinstance(m.get("reasoning_content"), str) and m["role"] == "assistant":
            r["reasoning_content"] = m["reasoning_content"]
        out.append(r)
    return out


def check_mistral_small_against_mistral_common():
    """The Mistral-Small templates render as mistral-common's Tekken v7 instruct tokenizer
    (InstructTokenizerV7, the tokenizer of those models) where both apply: a system prompt given,
    user/assistant turns, assistant text without trailing whitespace (mistral-common strips it;
    the templates keep it, and vLLM serves these models through the templates' tokenizer files
    too).  The templates are public copies, so this checks them against Mistral's own code."""
    try:
        import mistral_common
        from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
        from mistral_common.protocol.instruct.normalize import InstructRequestNormalizerV7
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
        from mistral_common.tokens.tokenizers.instruct import InstructTokenizerV7
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    except ImportError:
        print("mistral-common not installed: Mistral-Small templates not cross-checked")
        return
    tk = Tekkenizer.from_file(os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json"))
    it, norm = InstructTokenizerV7(tk), InstructRequestNormalizerV7.normalizer()
    mk = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    convs = [[S("Be brief."), U("a"), A(" b"), U("c")],
             [S("You are terse.\n"), U("  Hi there \n")],
             [S("sys"), U("What's the weather in Paris and in 東京?"), A("Sunny."), U("Thanks!")]]
    for tname in ("mistral-small-2501.jinja", "mistral-small-3.1.jinja"):
        text = (DIR / tname).read_text()
        for msgs in convs:
            out, _ = render_jinja_template(conversations=[msgs], chat_template=text, add_generation_prompt=True,
                                           bos_token="<s>", eos_token="</s>")
            req = ChatCompletionRequest(messages=[mk[m["role"]](content=m["content"]) for m in msgs])
            ids = it.encode_instruct(norm.from_chat_completion_request(req)).tokens
            ref = tk.decode(ids, special_token_policy=SpecialTokenPolicy.KEEP)
            assert out[0] == ref, (tname, out[0], ref)
    print("Mistral-Small templates equal mistral-common's v7 rendering on", len(convs), "conversations")


def main():
    check_mistral_small_against_mistral_common()
    rows = []
    for tname, (convs, tool_opts, kw_opts) in PLAN.items():
        text = (DIR / tname).read_text()
        fam = next(k for k in TOKENS if tname.startswith(k))
        bos, eos = TOKENS[fam]
        for cname in convs:
            for tools in tool_opts:
                for kw in kw_opts:
                    for agp in (True, False):
                        extra = dict(kw)
                        if bos:
                            extra["bos_token"] = bos
                        extra["eos_token"] = eos
                        row = {"template": tname, "name": cname, "tools": tools is not None,
                               "kwargs": kw, "add_generation_prompt": agp}
                        if "strftime_now" in text and tname.startswith("mistral-small"):
                            row["now"] = NOW
                        try:
                            out, _ = render_jinja_template(conversations=[vllm_messages(CONVS[cname])], tools=tools,
                                                           chat_template=text, add_generation_prompt=agp, **extra)
                            row["text"] = out[0]
                        except Exception as e:  # the template raised: the C renderer must fail too
                            row["error"] = str(e)
                        rows.append(row)
    with open(DIR / "conversations.json", "w") as f:
        json.dump({"conversations": CONVS, "tools": TOOLS}, f, ensure_ascii=False, indent=1)
    with open(DIR / "golden.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(len(rows), "cases,", sum("error" in r for r in rows), "errors")


if __name__ == "__main__":
    main()
