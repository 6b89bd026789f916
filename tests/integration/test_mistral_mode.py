"""`disagg serve --tokenizer-mode mistral` (vLLM's MistralTokenizer): chats are encoded by
mistral-common's rules, not a chat template.  For each tokenizer version whose file
mistral-common ships (SentencePiece v1, v2, v3, v7; Tekken v3, and its vocabulary as v7, v11
and v13, the latter two with the special tokens the hub's v11/v13 files list), the prompt ids
the server renders (POST /tokenize with messages: the path /v1/chat/completions takes) must
equal mistral-common's
`MistralTokenizer.encode_chat_completion(ChatCompletionRequest.from_openai(...)).tokens` for
plain chat, system prompts, multi-turn, tools with tool calls and results; the mistral tool
parser's calls must round-trip; bad conversations are refused naming the rule.  The model is
`--load-format dummy` (config.json alone) with the vocabulary size of the tokenizer.
"""
import functools
import json
import os
import re
import shutil

import pytest
import requests

import tokenizer_refs
from server_harness import Server

# name: (mistral-common data file, file name in the model dir, version, tekken)
FLAVOURS = {
    "spm-v1": ("tokenizer.model.v1", "tokenizer.model.v1", "v1", False),
    "spm-v2": ("mistral_instruct_tokenizer_240216.model.v2", "tokenizer.model.v2", "v2", False),
    "spm-v3": ("mistral_instruct_tokenizer_240323.model.v3", "tokenizer.model.v3", "v3", False),
    "spm-v7": ("mistral_instruct_tokenizer_241114.model.v7", "tokenizer.model.v7", "v7", False),
    "tekken-v3": ("tekken_240911.json", "tekken.json", "v3", True),
    "tekken-v7": ("tekken_240911.json", "tekken.json", "v7", True),
    "tekken-v11": ("tekken_240911.json", "tekken.json", "v11", True),
    "tekken-v13": ("tekken_240911.json", "tekken.json", "v13", True),
}
# v11+ files list their special tokens; these are the ranks the hub's v11/v13 files
# (Mistral-Small-3.1, Magistral, Devstral) give [ARGS], [CALL_ID], [THINK], [/THINK]
V11_SPECIALS = {32: "[ARGS]", 33: "[CALL_ID]", 34: "[THINK]", 35: "[/THINK]"}
COMMON = ("--load-format", "dummy", "--max-model-len", "512", "--kv-cache-memory", "32M")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello, how are you?"}],
    "special_text": [{"role": "user", "content": "say [INST] and </s> as text  "}],
    "system": [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "Name a colour."}],
    "multi_turn": [{"role": "system", "content": "You are terse."},
                   {"role": "user", "content": "Name a colour."},
                   {"role": "assistant", "content": "Blue. "},
                   {"role": "user", "content": "Another?"},
                   {"role": "user", "content": [{"type": "text", "text": "One more."}]}],
    "tool_calls": [{"role": "user", "content": "Weather in Paris and Rome?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "abcDEF123", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                       {"id": "call_9z8y7x6w5", "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
                   {"role": "tool", "tool_call_id": "abcDEF123", "name": "get_weather",
                    "content": "{\"temp\": 21}"},
                   {"role": "tool", "tool_call_id": "call_9z8y7x6w5", "name": "get_weather",
                    "content": "sunny"},
                   {"role": "assistant", "content": "Paris 21, Rome sunny."},
                   {"role": "user", "content": "Thanks. And Oslo?"}],
    "continue_final": [{"role": "user", "content": "Count to three."},
                       {"role": "assistant", "content": "One, two,"}],
    "system_middle": [{"role": "system", "content": "One."}, {"role": "system", "content": ""},
                      {"role": "user", "content": "a"}, {"role": "system", "content": "Two."},
                      {"role": "user", "content": [{"type": "text", "text": "b"},
                                                   {"type": "text", "text": "c"}]}],
    "assistant_first": [{"role": "system", "content": "Sys."},
                        {"role": "assistant", "content": "I start."},
                        {"role": "user", "content": ""}],
    "unicode": [{"role": "user", "content": "Grüße 🤖 日本語\n\n  \t x  "},
                {"role": "assistant", "content": "  ok  "},
                {"role": "user", "content": "Ünïcødé"}],
}
# tool conversations of the versions with tool tokens (v2+); v7+ only where marked
TOOL_CONVERSATIONS = {
    "results_reordered": [{"role": "user", "content": "Two cities"},
                          {"role": "assistant", "tool_calls": [
                              {"id": "aaaaaaaa1", "type": "function",
                               "function": {"name": "get_weather", "arguments": "not json"}},
                              {"id": "bbbbbbbb2", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]},
                          {"role": "tool", "tool_call_id": "bbbbbbbb2", "content": ""},
                          {"role": "tool", "tool_call_id": "aaaaaaaa1",
                           "content": [{"type": "text", "text": "[1, 2.5, \"é\"]"}]}],
    "content_and_calls": [{"role": "user", "content": "Paris?"},
                          {"role": "assistant", "content": "Checking. ", "tool_calls": [
                              {"id": "ccccccccc", "type": "function",
                               "function": {"name": "get_weather",
                                            "arguments": {"city": "Paris", "n": [1, {"x": None}]}}}]},
                          {"role": "tool", "tool_call_id": "ccccccccc", "content": "{\"t\":1}"}],
}
# tools take part where the version has control tokens for them
WITH_TOOLS = {"tool_calls", "plain"}


_TEKKEN_CONVERTED = {}  # the conversion takes seconds: done once per special-token list


def build_model(d, flavour):
    """A model directory: tokenizer.json (+ config) converted from the mistral-common file,
    the file itself, and a tiny Mistral config.json of the tokenizer's vocabulary size."""
    data_file, name, version, tekken = FLAVOURS[flavour]
    src = os.path.join(tokenizer_refs.mistral_data_dir(), data_file)
    if tekken:
        with open(src, encoding="utf-8") as f:
            j = json.load(f)
        j["config"]["version"] = version
        if version in ("v11", "v13"):
            from mistral_common.tokens.tokenizers.tekken import Tekkenizer
            base = Tekkenizer.from_file(src)
            names = [V11_SPECIALS.get(i, base.id_to_piece(i)) for i in range(base.num_special_tokens)]
            j["special_tokens"] = [{"rank": i, "token_str": t, "is_control": True}
                                   for i, t in enumerate(names)]
        tek = d / "tekken.json"
        tek.write_text(json.dumps(j), encoding="utf-8")
        key = version in ("v11", "v13")  # the converted vocabulary: one per special-token list
        if key not in _TEKKEN_CONVERTED:
            tokenizer_refs.tekken_json(str(d), str(tek))
            _TEKKEN_CONVERTED[key] = d
        else:
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(_TEKKEN_CONVERTED[key] / f, d / f)
        vocab = j["config"]["default_vocab_size"]
        ref = str(tek)
    else:
        _, proto = tokenizer_refs.spm_faithful(str(d), data_file)
        shutil.copy(src, d / name)
        vocab = len(proto.pieces)
        ref = str(d / name)
    cfg = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": None,
           "tie_word_embeddings": True, "vocab_size": vocab, "hidden_act": "silu",
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return ref


@functools.lru_cache(maxsize=None)
def reference_tokenizer(ref_file):
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    return MistralTokenizer.from_file(ref_file)


def reference_ids(ref_file, messages, tools):
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    mt = reference_tokenizer(ref_file)
    msgs = json.loads(json.dumps(messages))
    for m in msgs:  # vLLM's truncate_tool_call_ids
        for tc in m.get("tool_calls") or []:
            tc["id"] = tc["id"][-9:]
        if "tool_call_id" in m:
            m["tool_call_id"] = m["tool_call_id"][-9:]
    req = ChatCompletionRequest.from_openai(messages=msgs, tools=tools)
    if msgs[-1]["role"] == "assistant":  # vLLM continues a final assistant message
        req.messages[-1].prefix = True
    return mt.encode_chat_completion(req).tokens


@pytest.fixture(scope="module", params=sorted(FLAVOURS))
def served(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    ref = build_model(d, request.param)
    s = Server(*COMMON, "--tokenizer-mode", "mistral", "--tool-call-parser", "mistral",
               model=str(d), ready_timeout=120)
    try:
        yield request.param, ref, s
    finally:
        assert s.stop() == 0


def cases(flavour):
    version = int(FLAVOURS[flavour][2][1:])
    for name, msgs in CONVERSATIONS.items():
        if version == 1 and name == "tool_calls":
            continue
        if version >= 7 and name == "assistant_first":
            continue  # mistral-common v7 encodes no [INST] before it: a prompt unlike training
        yield name, msgs, None
        if name in WITH_TOOLS and version != 1:
            yield name + "+tools", msgs, TOOLS
    for name, msgs in TOOL_CONVERSATIONS.items():
        if version == 2 and name == "results_reordered":
            continue  # v2 refuses two results of one turn (test_bad_conversations_are_refused_by_name)
        if version >= 2 and (version >= 7 or name != "content_and_calls"):
            yield name, msgs, TOOLS


def test_prompt_ids_equal_mistral_common(served):
    flavour, ref, s = served
    bad = []
    for name, msgs, tools in cases(flavour):
        body = {"model": "tiny", "messages": msgs}
        if tools:
            body["tools"] = tools
        r = requests.post(s.url + "/tokenize", json=body, timeout=30)
        assert r.status_code == 200, (name, r.text)
        want = reference_ids(ref, msgs, tools)
        if r.json()["tokens"] != want:
            bad.append((name, r.json()["tokens"], want))
    assert not bad, f"{flavour}: {bad}"


def test_chat_completion_runs_on_the_mistral_prompt(served):
    flavour, ref, s = served
    msgs = CONVERSATIONS["system"]
    r = requests.post(s.url + "/v1/chat/completions",
                      json={"model": "tiny", "messages": msgs, "max_tokens": 3, "temperature": 0,
                            "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(reference_ids(ref, msgs, None))


ENUM_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris"]}},
                                          "required": ["city"], "additionalProperties": False}}}]


def test_mistral_tool_parser_round_trip(served):
    """--tool-call-parser mistral: a named tool_choice constrains the output to the call format
    (v11+: [TOOL_CALLS]name[ARGS]{...}), the parser returns the call with a 9-character id, and
    that call and its result sent back encode as mistral-common encodes them."""
    flavour, ref, s = served
    if FLAVOURS[flavour][2] == "v1":
        pytest.skip("tokenizer v1 has no tool calls")
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = requests.post(s.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": msgs, "tools": ENUM_TOOLS, "max_tokens": 200, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls", ch
    calls = ch["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" and
                         json.loads(c["function"]["arguments"]) == {"city": "Paris"} for c in calls), calls
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls), calls
    turn = msgs + [{"role": "assistant", "content": None, "tool_calls": calls}] + [
        {"role": "tool", "tool_call_id": c["id"], "name": "get_weather", "content": "{\"temp\": 21}"}
        for c in calls]
    r = requests.post(s.url + "/tokenize", json={"model": "tiny", "messages": turn, "tools": ENUM_TOOLS},
                      timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == reference_ids(ref, turn, ENUM_TOOLS)


def test_bad_tools_are_refused_by_name(served):
    flavour, _, s = served
    if FLAVOURS[flavour][2] == "v1":
        pytest.skip("tokenizer v1 ignores tools")
    msgs = [{"role": "user", "content": "a"}]
    for tools, text in [([{"type": "function", "function": {"name": "x y"}}], "tools[0].function.name"),
                        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}],
                         "tools[0].function.parameters must be an object"),
                        ([{"type": "function", "function": {"name": "f", "description": 3}}],
                         "tools[0].function.description must be a string")]:
        r = requests.post(s.url + "/tokenize", json={"model": "tiny", "messages": msgs, "tools": tools},
                          timeout=30)
        assert r.status_code == 400 and text in r.json()["error"]["message"], r.text


def test_bad_conversations_are_refused_by_name(served):
    flavour, ref, s = served
    version = FLAVOURS[flavour][2]
    bad = [([{"role": "assistant", "content": "hi"}], "start with a user message"),
           ([{"role": "user", "content": "a"}, {"role": "tool", "content": "x", "tool_call_id": "abcdefghi"}],
            "Unexpected role 'tool' after role 'user'"),
           ([{"role": "developer", "content": "a"}], "accepted: system, user, assistant, tool"),
           ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "accepts only")]
    if version in ("v3", "v7"):
        bad.append(([{"role": "user", "content": "a"},
                     {"role": "assistant", "tool_calls": [{"id": "a-b", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "a-b", "content": "1"}],
                    "Tool call id was a-b but must be a-z, A-Z, 0-9, with a length of 9"))
    bad += [("not a list", "messages"),
            ([{"role": "user", "content": 5}], "content must be a string, null or an array of text parts"),
            ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"id": "abcdefghi"}]}],
             "function.name must be a string"),
            ([{"role": "user", "content": "a"},
              {"role": "assistant", "tool_calls": [{"id": "abcdefghi", "function": {"name": "f g"}}]}],
             "Function name was f g"),
            ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": {"id": 1}}],
             "tool_calls must be an array"),
            ([{"role": "system"}, {"role": "user", "content": "a"}], "System prompt must have content")]
    if version in ("v11", "v13"):
        call = {"id": "abcdefghi", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        bad += [([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call, call]},
                  {"role": "tool", "tool_call_id": "abcdefghi", "content": "1"}],
                 "Duplicate tool call id abcdefghi in assistant message"),
                ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "abcdefghi", "content": "1"},
                  {"role": "tool", "tool_call_id": "abcdefghi", "content": "2"}],
                 "Duplicate tool call id abcdefghi in tool results"),
                ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "zzzzzzzzz", "content": "1"}],
                 "Unexpected tool call id zzzzzzzzz in tool results")]
    if version == "v2":
        bad.append((TOOL_CONVERSATIONS["results_reordered"], "does not support multiple tool results"))
    if version in ("v2", "v3"):
        bad.append((TOOL_CONVERSATIONS["content_and_calls"],
                    "must have either content or tool_calls, but not both"))
    for msgs, text in bad:
        r = requests.post(s.url + "/v1/chat/completions",
                          json={"model": "tiny", "messages": msgs, "max_tokens": 1}, timeout=30)
        if text == "messages":  # the request parser's own check
            assert r.status_code == 400, r.text
            continue
        assert r.status_code == 400, (msgs, r.text)
        assert text in r.json()["error"]["message"], r.text
        if text not in OWN_CHECKS:  # mistral-common's own rule: it refuses the conversation too
            with pytest.raises(Exception):
                reference_ids(ref, msgs, None)


# refusals of what mistral-common's Python types would not hold, or disagg does not take
OWN_CHECKS = {"accepted: system, user, assistant, tool", "accepts only",
              "content must be a string, null or an array of text parts", "function.name must be a string",
              "tool_calls must be an array"}


def test_tokenizer_mode_values(tmp_path):
    """auto picks mistral in a Mistral-format directory (consolidated*.safetensors) with a
    mistral-common file, as vLLM; hf beside the same files; an unknown mode is refused."""
    import subprocess
    from server_harness import BIN
    out = subprocess.run([BIN, "serve", str(tmp_path), "--tokenizer-mode", "fast"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "accepted: auto, hf, slow, mistral" in out.stderr + out.stdout
    d = tmp_path / "m"
    d.mkdir()
    build_model(d, "spm-v3")
    # auto without consolidated*.safetensors: hf (this tokenizer_config.json has no template)
    s = Server(*COMMON, model=str(d), ready_timeout=120)
    try:
        r = requests.post(s.url + "/tokenize", json={"model": "tiny", "messages": CONVERSATIONS["plain"]},
                          timeout=30)
        assert r.status_code == 400 and "no chat template" in r.text, r.text
    finally:
        assert s.stop() == 0
    (d / "consolidated.safetensors").write_bytes(b"")  # the Mistral-format weights' name (not read)
    s = Server(*COMMON, model=str(d), ready_timeout=120)  # auto
    try:
        msgs = CONVERSATIONS["system"]
        r = requests.post(s.url + "/tokenize", json={"model": "tiny", "messages": msgs}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == reference_ids(str(d / "tokenizer.model.v3"), msgs, None)
    finally:
        assert s.stop() == 0
    # --tokenizer-mode hf keeps the chat template: this tokenizer_config.json has none
    s = Server(*COMMON, "--tokenizer-mode", "hf", model=str(d), ready_timeout=120)
    try:
        r = requests.post(s.url + "/v1/chat/completions",
                          json={"model": "tiny", "messages": CONVERSATIONS["plain"], "max_tokens": 1},
                          timeout=30)
        assert r.status_code == 400 and "no chat template" in r.text, r.text
    finally:
        assert s.stop() == 0


def test_bad_tokenizer_files_are_refused_at_start(tmp_path):
    """A version mistral-common has no encoding for here, or a tokenizer.json that lacks the
    version's control tokens, stops the server naming the file and what is accepted."""
    d = tmp_path / "v15"
    d.mkdir()
    build_model(d, "tekken-v3")
    j = json.loads((d / "tekken.json").read_text(encoding="utf-8"))
    j["config"]["version"] = "v15"
    (d / "tekken.json").write_text(json.dumps(j), encoding="utf-8")
    with pytest.raises(RuntimeError, match=r'tokenizer version "v15" is not supported; accepted: v1, v2, v3'):
        Server(*COMMON, "--tokenizer-mode", "mistral", model=str(d), ready_timeout=60)
    d = tmp_path / "v1-as-v3"  # the v1 vocabulary has no [INST] token
    d.mkdir()
    build_model(d, "spm-v1")
    os.rename(d / "tokenizer.model.v1", d / "tokenizer.model.v3")
    with pytest.raises(RuntimeError, match=r"says version v3 but the tokenizer in .* has no \[INST\] token"):
        Server(*COMMON, "--tokenizer-mode", "mistral", model=str(d), ready_timeout=60)
    d = tmp_path / "none"  # mistral asked for, no mistral-common file
    d.mkdir()
    build_model(d, "spm-v3")
    os.remove(d / "tokenizer.model.v3")
    with pytest.raises(RuntimeError, match=r"no mistral-common tokenizer file \(tekken.json or tokenizer.model.v\*\)"):
        Server(*COMMON, "--tokenizer-mode", "mistral", model=str(d), ready_timeout=60)


TEXTS = ["Hi", "", " lead and trail ", "a\n\nb", "Grüße 🤖", "[INST] x [/INST]", "{\"k\": [1, 2]}",
         "not json {", "  ", "3.25", "tab\tand\r\nnewline", "日本語のテキスト"]


def random_conversation(rng, version):
    """A conversation of random roles and contents (many break mistral-common's rules)."""
    msgs = []
    pending = []
    for _ in range(rng.randint(1, 7)):
        role = rng.choice(["user", "user", "assistant", "system"] + (["tool"] if pending else []))
        text = rng.choice(TEXTS)
        if role == "tool":
            msgs.append({"role": "tool", "tool_call_id": pending.pop(0), "name": "get_weather",
                         "content": text if rng.random() < 0.8 else [{"type": "text", "text": text}]})
            continue
        if role == "assistant" and version >= 2 and rng.random() < 0.4:
            calls = [{"id": "".join(rng.choice("abcXYZ019") for _ in range(9)), "type": "function",
                      "function": {"name": "get_weather",
                                   "arguments": rng.choice(["{\"city\": \"Paris\"}", "{}", "", "[1, 2.5]",
                                                            "oops"])}}
                     for _ in range(rng.randint(1, 2))]
            msgs.append({"role": "assistant", "content": text if version >= 7 and rng.random() < 0.3 else None,
                         "tool_calls": calls})
            pending = [c["id"] for c in calls]
            continue
        content = text if rng.random() < 0.7 else [{"type": "text", "text": t} for t in rng.sample(TEXTS, 2)]
        msgs.append({"role": role, "content": content})
    return msgs


def test_random_conversations_equal_mistral_common(served):
    """200 random conversations a flavour (seeded): where mistral-common encodes one, the ids
    are equal; where it refuses one, so does disagg (400)."""
    import random
    flavour, ref, s = served
    version = int(FLAVOURS[flavour][2][1:])
    rng = random.Random(flavour)
    bad = []
    for k in range(200):
        msgs = random_conversation(rng, version)
        tools = TOOLS if version >= 2 and rng.random() < 0.5 else None
        try:
            want = reference_ids(ref, msgs, tools)
        except Exception as e:  # noqa: BLE001 - any refusal of mistral-common's
            want = e
        r = requests.post(s.url + "/tokenize", json={"model": "tiny", "messages": msgs, "tools": tools},
                          timeout=30)
        if isinstance(want, Exception):
            if r.status_code != 400:
                bad.append((k, msgs, "mistral-common refused: " + repr(want)[:200], r.text[:200]))
        elif r.status_code != 200 or r.json()["tokens"] != want:
            bad.append((k, msgs, r.text[:300]))
    assert not bad, f"{flavour}: {len(bad)} differ; first: {bad[:3]}"


def test_consolidated_weights_beside_the_hf_files_are_not_read(tmp_path):
    """A hub Mistral directory has consolidated.safetensors (Mistral's tensor names) beside
    model.safetensors: the weights load from the Hugging Face file alone."""
    import subprocess
    import sys
    import numpy as np
    from server_harness import ROOT
    sys.path.insert(0, str(ROOT / "tools"))
    from gen_random_qwen2 import to_bytes, write_safetensors
    d = tmp_path / "m"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_random_model.py"), "--out", str(d),
                    "--variant", "mistral-tiny"], check=True, capture_output=True)
    x = np.zeros((2, 2), dtype=np.float32)
    write_safetensors(str(d / "consolidated.safetensors"),
                      [("layers.0.attention.wq.weight", to_bytes(x, "f32"), (2, 2))], "f32")
    s = Server(*COMMON[2:], model=str(d), ready_timeout=120)
    try:
        r = requests.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                          timeout=60)
        assert r.status_code == 200, r.text
    finally:
        assert s.stop() == 0
