"""Structured outputs (docs/structured_outputs.md): the grammar engine's token
masks against xgrammar's (golden data written by tools/grammar_xgrammar.py, xgrammar needs
torch), 1,000 constrained samples at temperature 1 on the default model that all
validate, the request forms vLLM accepts (response_format, structured_outputs, guided_*,
tool_choice required / named; chat and completions, streaming and not, n > 1) through the
official openai client, bad constraints answered 400 naming the problem, and P/D (P's
first token and D's decode both follow the constraint)."""
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import openai
import pytest
import requests

from server_harness import BIN, Server

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "grammar" / "xgrammar_masks.jsonl"
# beside the source tree, as tests/unit/test_tokenizer.c finds it
QWEN_TOKENIZER = ROOT.parent / "shared" / "data" / "qwen2.5-tokenizer"
TOKENIZER = QWEN_TOKENIZER if (QWEN_TOKENIZER / "tokenizer.json").exists() else None

# Steps where disagg's mask differs from xgrammar's on purpose (docs/structured_outputs.md).
EXPLAINED = {
    # xgrammar's length-bounded strings allow raw control characters (not JSON) and no
    # escapes; disagg's are JSON strings (escapes count as one character, no control chars)
    "length": lambda c: c["kind"] == "json_schema" and ("maxLength" in c["text"] or
                                                         "minLength" in c["text"]),
    # xgrammar's ipv4 takes octets with leading zeros ("01"), which RFC 2673's dotted quad (and
    # jsonschema's format check) refuses; disagg does not
    "ipv4": lambda c: '"ipv4"' in c["text"],
}


def explained(case):
    return [k for k, f in EXPLAINED.items() if f(case)]


@pytest.mark.skipif(TOKENIZER is None, reason="the Qwen2.5 tokenizer of the golden data is absent")
def test_masks_equal_xgrammar(tmp_path):
    rows = [json.loads(l) for l in GOLDEN.read_text().splitlines()]
    walks = [r for r in rows if "tokens" in r]
    cases = {(r["kind"], r["text"], r["compact"]) for r in rows}
    assert len(cases) >= 50 and len(walks) >= 50
    f = tmp_path / "cases.jsonl"
    f.write_text("".join(json.dumps({k: r[k] for k in ("kind", "text", "compact", "tokens")}) + "\n"
                         for r in walks))
    out = subprocess.run([BIN, "bench", "grammar", "--tokenizer", str(TOKENIZER), "--masks", str(f)],
                         capture_output=True, text=True, timeout=240, check=True).stdout.splitlines()
    assert len(out) == len(walks)
    equal = differ = 0
    for r, line in zip(walks, out):
        d = json.loads(line)
        assert "error" not in d, (r["text"], d)
        for i, x in enumerate(r["xgrammar"]):
            s = d["steps"][i] if i < len(d["steps"]) else None
            if s and s["hash"] == x["hash"] and s["accepting"] == x["accepting"]:
                equal += 1
                continue
            # a difference: only where explained, and then still what it was when checked
            assert explained(r), (r["kind"], r["text"], r["compact"], i, s, x)
            assert [t["hash"] for t in d["steps"]] == [t["hash"] for t in r["disagg"]], r["text"]
            differ += 1
    total = sum(len(r["xgrammar"]) for r in walks)
    print(f"masks equal to xgrammar's: {equal} of {total} steps over {len(walks)} walks, "
          f"{len(cases)} constraints; {differ} differ as explained")
    assert equal >= 0.95 * total


def client(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "1024")
    yield s
    assert s.stop() == 0, s.logs()


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
SAMPLED = [
    ("json", PERSON),
    ("json", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "ok": {"type": "boolean"}}, "required": ["color"]}),
    ("json", {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}),
    ("json", {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "tag": {"type": "string", "maxLength": 6}}, "required": ["id"]}}, "required": ["user"]}),
    ("json", {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "null"}]}),
    ("json", {"$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99},
        "y": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["x", "y"]}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"]}),
    ("regex", r"[0-9]{3}-[0-9]{4}"),
    ("regex", r"(yes|no|maybe)!?"),
    ("regex", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"),
    ("choice", ["positive", "negative", "neutral", "mixed feelings"]),
]


def valid(kind, spec, text):
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
        return True
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    return text in spec


def test_thousand_samples_validate(server):
    """100 samples per constraint (two requests of n = 50), temperature 1: all validate."""
    c = client(server)
    n_ok = 0
    for k, (kind, spec) in enumerate(SAMPLED):
        for rep in range(2):
            r = c.completions.create(
                model="tiny", prompt="Fellow-Citizens of the Senate", n=50, temperature=1.0,
                max_tokens=200, seed=1000 * k + rep,
                extra_body={"structured_outputs": {kind: spec, "disable_any_whitespace": True}})
            for ch in r.choices:
                assert ch.finish_reason == "stop", (kind, spec, ch.text)
                assert valid(kind, spec, ch.text), (kind, spec, ch.text)
                n_ok += 1
    assert n_ok == 1000


def test_response_format_chat(server):
    c = client(server)
    msgs = [{"role": "user", "content": "Who are you?"}]
    r = c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=200, temperature=0.8, seed=3, n=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert len(r.choices) == 3
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), PERSON)
    # streaming, n > 1: each choice's deltas join into a valid object
    parts = {}
    for ev in c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=200, temperature=0.8, seed=4, n=2, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
            extra_body={"structured_outputs": {"disable_any_whitespace": True}}):
        for ch in ev.choices:
            parts[ch.index] = parts.get(ch.index, "") + (ch.delta.content or "")
    assert sorted(parts) == [0, 1]
    for t in parts.values():
        jsonschema.validate(json.loads(t), PERSON)
    # json_object: any JSON object (greedy: the model's whitespace habit is bounded by max_tokens)
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=300, temperature=0.7,
                                  seed=5, response_format={"type": "json_object"},
                                  extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("form", ["structured_outputs", "guided"])
def test_completions_forms(server, form, stream):
    c = client(server)
    specs = {"regex": r"\d{2}:\d{2}", "choice": ["alpha", "beta"],
             "grammar": 'root ::= "x=" [0-9]{1,3} (", " "y=" [0-9]{1,3})?',
             "json": {"type": "object", "properties": {"k": {"enum": [1, 2, 3]}}, "required": ["k"]}}
    for kind, spec in specs.items():
        # compact JSON (vLLM's disable_any_whitespace): the tiny model loves runs of spaces
        body = ({"structured_outputs": {kind: spec, "disable_any_whitespace": True}}
                if form == "structured_outputs"
                else {"guided_" + kind: json.dumps(spec) if kind == "json" else spec,
                      "guided_decoding_backend": "xgrammar:disable-any-whitespace"})
        r = c.completions.create(model="tiny", prompt="The time is", n=2, temperature=1.0,
                                 max_tokens=60, seed=11, stream=stream, extra_body=body)
        texts = {}
        for ev in (r if stream else [r]):
            for ch in ev.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        assert sorted(texts) == [0, 1]
        for t in texts.values():
            if kind == "grammar":
                assert re.fullmatch(r"x=[0-9]{1,3}(, y=[0-9]{1,3})?", t), t
            else:
                assert valid(kind, spec, t), (kind, t)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice(server, choice, stream):
    c = client(server)
    tc = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                  tools=TOOLS, tool_choice=tc, max_tokens=300, temperature=0.6,
                                  seed=21, stream=stream)
    if stream:
        calls, reason = {}, None
        for ev in r:
            for ch in ev.choices:
                for t in ch.delta.tool_calls or []:
                    e = calls.setdefault(t.index, {"name": "", "arguments": ""})
                    e["name"] += (t.function.name or "") if t.function else ""
                    e["arguments"] += (t.function.arguments or "") if t.function else ""
                reason = ch.finish_reason or reason
        calls = list(calls.values())
    else:
        reason = r.choices[0].finish_reason
        calls = [{"name": t.function.name, "arguments": t.function.arguments}
                 for t in r.choices[0].message.tool_calls or []]
    assert reason == "tool_calls" and calls, calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        if choice == "named":
            assert call["name"] == "get_time"
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


@pytest.mark.parametrize("body,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "unknown type 'foo'"),
    ({"structured_outputs": {"json": {"type": "object", "not": {}}}}, "'not' is not supported"),
    ({"guided_regex": "(ab"}, "unbalanced '('"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "'undefined_rule' is used but not defined"),
    ({"structured_outputs": {"grammar": "expr ::= expr \"+\" \"1\" | \"1\"\nroot ::= expr"}}, "left-recursive"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "only one structured-output constraint"),
    ({"response_format": {"type": "xml"}}, "type 'xml' is not supported"),
    ({"guided_choice": []}, "non-empty list of strings"),
    ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
])
def test_bad_constraints_400(server, body, needle):
    r = requests.post(server.url + "/v1/chat/completions", timeout=30,
                      json=dict({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, **body))
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_pd_constrained():
    """P samples its one token under the constraint and hands it to D, which decodes on under
    the same constraint: the output validates and equals a colocated server's (same seed)."""
    from test_pd import COMMON, PD
    from test_pd_first_token import USED
    pd = PD()
    colo = Server(*COMMON)
    try:
        for k, (kind, spec) in enumerate(SAMPLED[:4] + SAMPLED[6:]):
            body = {"model": "tiny", "prompt": "Fellow-Citizens of the Senate", "max_tokens": 200,
                    "temperature": 1.0, "seed": 77 + k,
                    "structured_outputs": {kind: spec, "disable_any_whitespace": True}}
            used = pd.d.metrics().get(USED, 0)
            pr, dr = pd.send(body)
            assert pr.status_code == 200 and dr.status_code == 200, (pr.text, dr.text)
            ptext, dtext = pr.json()["choices"][0]["text"], dr.json()["choices"][0]["text"]
            assert dtext.startswith(ptext)  # P's token is D's first
            assert valid(kind, spec, dtext), (kind, dtext)
            assert pd.d.metrics().get(USED, 0) == used + 1  # the handoff held under the grammar
            cr = requests.post(colo.url + "/v1/completions", json=body, timeout=60)
            assert cr.json()["choices"][0]["text"] == dtext
    finally:
        pd.stop()
        colo.stop()


# The mask of each constrained row is filled on a worker thread while the forward runs
# (engine/mask_worker.h); DISAGG_GRAMMAR_OVERLAP=0 fills it on the step thread before the
# forward.  The masks are the same either way, so the outputs must be.
OVERLAP_CASES = [
    ("json", PERSON),
    ("json", SAMPLED[5][1]),  # $defs, nested objects
    ("json", {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string", "maxLength": 5}, "maxItems": 3}}, "required": ["tags"]}),
    ("regex", r"[0-9]{3}-[0-9]{4}"),
    ("regex", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"),
    ("choice", ["positive", "negative", "neutral", "mixed feelings"]),
    ("grammar", 'root ::= "x=" [0-9]{1,3} (", " "y=" [0-9]{1,3})?'),
    ("grammar", 'root ::= item ("," item)*\nitem ::= [a-c]+ | "[" root "]"'),
]


def overlap_servers():
    """The default (masks overlapped) and DISAGG_GRAMMAR_OVERLAP=0 (serial); on a GPU both
    --batch-invariant, so that the two servers' different batches give the same logits."""
    from server_harness import on_gpu
    args = ["--max-model-len", "1024"] + (["--batch-invariant"] if on_gpu() else [])
    # the overlapped one also draws its rows on three threads (DISAGG_SAMPLE_THREADS)
    return (Server(*args, env={"DISAGG_GRAMMAR_OVERLAP": "1", "DISAGG_SAMPLE_THREADS": "3"}),
            Server(*args, env={"DISAGG_GRAMMAR_OVERLAP": "0", "DISAGG_SAMPLE_THREADS": "1"}))


def constrained_outputs(s):
    """Every OVERLAP_CASES constraint, greedy and seeded at temperature 1 (n = 4), compact and
    with free whitespace, sent all at once so that the steps batch several constrained rows."""
    from concurrent.futures import ThreadPoolExecutor
    c = client(s)

    def one(job):
        (kind, spec), temp, compact = job
        so = {kind: spec}
        if compact:
            so["disable_any_whitespace"] = True
        r = c.completions.create(model="tiny", prompt="Fellow-Citizens of the Senate", n=1 if temp == 0 else 4,
                                 temperature=temp, seed=7, max_tokens=80,
                                 extra_body={"structured_outputs": so})
        return [(ch.text, ch.finish_reason) for ch in r.choices]

    jobs = [(case, temp, compact) for case in OVERLAP_CASES for temp in (0.0, 1.0)
            for compact in ((True, False) if case[0] == "json" else (False,))]
    with ThreadPoolExecutor(len(jobs)) as ex:
        return jobs, list(ex.map(one, jobs))


def test_mask_overlap_equals_serial():
    ov, se = overlap_servers()
    try:
        jobs, overlapped = constrained_outputs(ov)
        _, serial = constrained_outputs(se)
    finally:
        assert ov.stop() == 0, ov.logs()
        assert se.stop() == 0, se.logs()
    for job, a, b in zip(jobs, overlapped, serial):
        assert a == b, (job, a, b)
    # and they follow their constraints (those that finished)
    for ((kind, spec), _, _), outs in zip(jobs, overlapped):
        for text, reason in outs:
            if reason != "stop" or kind == "grammar":
                continue
            assert valid(kind, spec, text), (kind, spec, text)


def test_device_mask_equals_host():
    """A constrained row's bitmask applied to its logits by the backend (backend_token_bitmask:
    the default; greedy rows then take the backend's argmax and only the id comes back) gives
    the tokens of the host path (DISAGG_GRAMMAR_DEVICE_MASK=0: the logits come back and the
    sampler masks them), greedy and seeded at temperature 1; requests with logprobs keep the
    host path and report the raw distribution's logprobs either way."""
    from server_harness import on_gpu
    args = ["--max-model-len", "1024"] + (["--batch-invariant"] if on_gpu() else [])
    dev = Server(*args, env={"DISAGG_GRAMMAR_DEVICE_MASK": "1", "DISAGG_SAMPLE_THREADS": "3"})
    host = Server(*args, env={"DISAGG_GRAMMAR_DEVICE_MASK": "0", "DISAGG_SAMPLE_THREADS": "1"})
    try:
        jobs, on_dev = constrained_outputs(dev)
        _, on_host = constrained_outputs(host)
        lp = []
        for s in (dev, host):
            r = client(s).completions.create(
                model="tiny", prompt="Fellow-Citizens of the Senate", max_tokens=24, temperature=0,
                logprobs=2, extra_body={"structured_outputs": {"regex": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"}})
            lp.append((r.choices[0].text, r.choices[0].logprobs.token_logprobs,
                       r.choices[0].logprobs.top_logprobs))
    finally:
        assert dev.stop() == 0, dev.logs()
        assert host.stop() == 0, host.logs()
    for job, a, b in zip(jobs, on_dev, on_host):
        assert a == b, (job, a, b)
    assert lp[0] == lp[1]
    # raw logprobs: the chosen token's is below 0 and the top tokens need not be allowed ones
    assert all(x <= 0 for x in lp[0][1] if x is not None)


@pytest.mark.parametrize("var,value", [("DISAGG_GRAMMAR_OVERLAP", "yes"), ("DISAGG_GRAMMAR_DEVICE_MASK", "2"),
                                       ("DISAGG_SAMPLE_THREADS", "0"), ("DISAGG_SAMPLE_THREADS", "4x")])
def test_mask_overlap_bad_env(var, value):
    p = subprocess.run([BIN, "serve", str(ROOT / "models" / "disagg-sotu-tiny"), "--port", "1"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(__import__("os").environ, **{var: value}))
    assert p.returncode != 0
    assert f"{var}='{value}' is not accepted" in p.stderr, p.stderr
