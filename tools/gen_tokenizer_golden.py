#!/usr/bin/env python3
"""Generate the tokenizer and chat-template golden data in tests/data/tokenizer/.

The reference is Hugging Face itself: `tokenizers` for ids and decodes,
`transformers` (AutoTokenizer.apply_chat_template, no torch needed) for chat
renderings.  The C tests (tests/unit/test_tokenizer.c, test_chat_template.c)
read the committed files; they never run Python.

    pip install tokenizers transformers jinja2
    python3 tools/gen_tokenizer_golden.py [--tokenizer-dir ../shared/data/qwen2.5-tokenizer]

Outputs (JSON lines, one object per line, UTF-8):
  encode.jsonl  {"cat": category, "text": input, "nfc": input is NFC, "ids": HF ids}
  added.json    {"added_tokens": extra added tokens with lstrip/rstrip/single_word/
                 normalized flags, appended to tokenizer.json's list by the test,
                 "vectors": [{"text": ..., "ids": ...}] encoded by that tokenizer}
  decode.jsonl  {"ids": [...], "skip_special": bool, "text": HF decode}
  meta.json     library versions, and the id count and FNV-1a 64 hash of the ids
                of the whole sotu corpus (../shared/data/sotu/sotu.txt.xz)
  chat.jsonl    {"name": ..., "messages": [...], "tools": [...] or null,
                 "add_generation_prompt": bool, "text": HF rendering}; list contents
                are joined with "\n" before rendering and, where
                "parse_tool_arguments" is true, string tool-call arguments are
                parsed (both as vLLM does before applying a template)
The inputs are pseudo-random with a fixed seed, so rerunning gives the same
files for the same library versions (recorded in meta.json).
"""
import argparse
import json
import lzma
import os
import random
import sys
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def rand_unicode_char(rng):
    """A random code point from a spread of blocks (no surrogates)."""
    ranges = [
        (0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF),
        (0x400, 0x4FF), (0x590, 0x5FF), (0x600, 0x6FF), (0x900, 0x97F), (0x980, 0x9FF),
        (0xB80, 0xBFF), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x1E00, 0x1EFF), (0x2000, 0x206F),
        (0x2070, 0x209F), (0x20A0, 0x20CF), (0x2100, 0x214F), (0x2190, 0x21FF), (0x2200, 0x22FF),
        (0x2460, 0x24FF), (0x2500, 0x257F), (0x3000, 0x303F), (0x3040, 0x30FF), (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3), (0xE000, 0xE0FF), (0xF900, 0xFAFF), (0xFE00, 0xFE0F), (0xFF00, 0xFFEF),
        (0x1F300, 0x1F64F), (0x1F900, 0x1F9FF), (0x10000, 0x1007F), (0x1D400, 0x1D4FF),
        (0x20000, 0x2A6DF),
    ]
    lo, hi = rng.choice(ranges)
    return chr(rng.randint(lo, hi))


WORDS = {
    "latin": "the quick brown fox jumps over lazy dog Hello World naïve café résumé "
             "Übermäßig Straße déjà vu façade coöperate Ærø smørrebrød Dvořák Łódź "
             "Tiếng Việt có dấu phở Nguyễn señor año pingüino".split(),
    "cjk": "你好 世界 我们 中华人民共和国 今天 天气 很好 日本語 こんにちは カタカナ ひらがな "
           "東京 한국어 안녕하세요 서울 감사합니다 漢字 简体中文 繁體中文".split(),
    "cyrillic": "Привет мир нещо на Български Україна ёжик съешь ещё этих мягких "
                "французских булок Ђорђе Љубљана".split(),
    "greek": "Καλημέρα κόσμε Ελληνικά ψυχή ΑΘΗΝΑ ἀρχή ὁ λόγος".split(),
    "arabic": "مرحبا بالعالم اللغة العربية السلام عليكم كتاب ١٢٣ ٤٥٦".split(),
    "hebrew": "שלום עולם עברית ספר".split(),
    "devanagari": "नमस्ते दुनिया हिन्दी भाषा क्षत्रिय ज्ञान ०१२३ श्री".split(),
    "thai": "สวัสดีชาวโลก ภาษาไทย กรุงเทพมหานคร ๑๒๓".split(),
    "other": "বাংলা தமிழ் ქართული Հայերեն ትግርኛ ᏣᎳᎩ ꯃꯤꯇꯩ ລາວ ខ្មែរ ᠮᠣᠩᠭᠣᠯ".split(),
}

EMOJI = [
    "😀", "🦙", "👍", "👍🏽", "👍🏿", "👨‍👩‍👧‍👦", "👩🏽‍💻", "🏳️‍🌈", "🇺🇸", "🇯🇵", "1️⃣", "#️⃣",
    "❤️", "✨", "🧑🏻‍🤝‍🧑🏾", "🤷‍♀️", "🙇🏼‍♂️", "👁‍🗨", "🐕‍🦺", "☺", "☺️", "🫠", "🪿",
]

COMBINING = [
    "e\u0301", "a\u0308", "A\u030a", "\u00c5", "\u212b", "\u2126", "o\u0302\u0301",
    "\u1100\u1161\u11a8", "n\u0303", "c\u0327", "\u0041\u0301\u0323", "\u1e0b\u0323",
    "q\u0307\u0323", "\ufb01", "\u2460", "\u00bd", "e\u0301\u0301\u0301", "\u0301abc",
    "\u0915\u093c", "\u0958", "\u05d0\u05b7", "\u0627\u0653", "ﾊﾟ", "\u304b\u3099",
]

SPACES = [" ", "  ", "\t", "\n", "\r\n", "\r", "\n\n", "\u00a0", "\u3000", "\u2003", "\u2009",
          "\u200b", "\u202f", "\u2028", "\u0085", "\u000b", "\u000c", " \n ", "\t\t", "    "]

CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M",
                "'LL", "'D", "'ſ", "’s", "''s", "'x"]

SPECIAL_LIKE = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|", "|im_end|>", "<|im_end",
    "<|IM_END|>", "< |im_end|>", "<|im_end|>>", "<<|im_end|>", "<tool_call>", "</tool_call>",
    "<tool_call", "<|fim_prefix|>", "<|fim_middle|>", "<|vision_start|>", "<|image_pad|>",
    "<|box_start|>", "<|im_<|im_end|>end|>", "<|endoftext|><|endoftext|>", "<|file_sep|>",
    "<|repo_name|>", "<|endoftext|", "<|", "|>", "<|>",
]

CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "const x = (a, b) => a?.b ?? `${b}`;\n",
    "<div class=\"row\"><span>Hi &amp; bye</span></div>",
    "   indented\n\t\ttabs\n\n\n   trailing   \n",
    "x=1;y=2;z=x+y*3-4/5%6^7&8|9",
    "if err != nil {\n\t\treturn fmt.Errorf(\"bad: %w\", err)\n\t}",
    "$ ls -la /usr/local/bin | grep -v '^d' > out.txt 2>&1",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
]

URLS = [
    "https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/tokenizer.json",
    "http://example.com:8080/a/b?c=d&e=f#frag", "mailto:someone@example.org",
    "ftp://ftp.gnu.org/gnu/", "www.例え.jp/パス?q=値", "/home/user/.cache/huggingface/hub",
    "C:\\Users\\Admin\\Documents\\file.txt", "user@host:~/src$ make -j2",
]


def gen_inputs(rng, corpus):
    out = []

    def add(cat, s):
        out.append((cat, s))

    # scripts: word sequences with spaces and punctuation
    for cat, words in WORDS.items():
        for _ in range(60):
            k = rng.randint(1, 12)
            sep = rng.choice([" ", " ", " ", "", ", ", "\n", "。", "、"])
            s = sep.join(rng.choice(words) for _ in range(k))
            if rng.random() < 0.3:
                s = rng.choice(SPACES) + s
            if rng.random() < 0.3:
                s += rng.choice([".", "!", "?", "...", ":", "\n", " "])
            add(cat, s)
    # emoji
    for _ in range(150):
        s = ""
        for _ in range(rng.randint(1, 8)):
            s += rng.choice(EMOJI + [" ", "a", "x ", "🦙.cpp", "\n"])
        add("emoji", s)
    # combining / NFC
    for _ in range(200):
        s = ""
        for _ in range(rng.randint(1, 6)):
            s += rng.choice(COMBINING + [" ", "x", "é", "Å"] + WORDS["latin"][:5])
        add("nfc", s)
    # digits
    for _ in range(200):
        r = rng.random()
        if r < 0.3:
            s = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 60)))
        elif r < 0.5:
            s = f"{rng.randint(0, 10**9):,}.{rng.randint(0, 99):02d}"
        elif r < 0.7:
            s = " ".join(str(rng.randint(-1000, 100000)) for _ in range(rng.randint(1, 8)))
        else:
            s = "".join(rng.choice("0123456789١٢٣٤٥٦٧٨٩٠０１２３４５６७८९²³½⅓Ⅻ① .,-e+")
                        for _ in range(rng.randint(1, 30)))
        add("digits", s)
    # whitespace runs
    for _ in range(250):
        s = ""
        for _ in range(rng.randint(1, 8)):
            s += rng.choice(SPACES) * rng.randint(1, 5)
            if rng.random() < 0.5:
                s += rng.choice(["a", "word", "x y", "1", "!", "中文", "é"])
        add("whitespace", s)
    # contractions
    for _ in range(200):
        s = ""
        for _ in range(rng.randint(1, 5)):
            s += rng.choice(["I", "it", "They", "WE", "you", "he", "don", "x", " ", "Bob"])
            s += rng.choice(CONTRACTIONS)
            s += rng.choice([" ", "", " good", ".", "s", "\n"])
        add("contractions", s)
    # code and URLs
    for _ in range(120):
        add("code", rng.choice(CODE) if rng.random() < 0.6 else
            rng.choice(CODE)[: rng.randint(1, 40)] + rng.choice(CODE))
    for _ in range(60):
        add("url", rng.choice(URLS) + rng.choice(["", " ", "\n", ") and more"]))
    # special-token look-alikes in text
    for _ in range(250):
        s = ""
        for _ in range(rng.randint(1, 6)):
            r = rng.random()
            if r < 0.5:
                s += rng.choice(SPECIAL_LIKE)
            elif r < 0.8:
                s += rng.choice(["user\n", "hello", " ", "\n", "assistant", "é", "你好", "  "])
            else:
                s += rng.choice(CODE)[:20]
        add("special", s)
    # random valid UTF-8 soup
    for _ in range(400):
        add("soup", "".join(rand_unicode_char(rng) for _ in range(rng.randint(1, 40))))
    # corpus slices
    lines = [l for l in corpus.split("\n") if l.strip()]
    for _ in range(400):
        r = rng.random()
        if r < 0.4:
            s = rng.choice(lines)[:rng.randint(1, 800)]
        elif r < 0.8:
            i = rng.randrange(len(corpus) - 3000)
            s = corpus[i: i + rng.randint(1, 600)]
        else:
            i = rng.randrange(len(corpus) - 3000)
            s = corpus[i: i + rng.randint(600, 2000)]
        add("corpus", s)
    # mixtures of everything
    pool = [w for ws in WORDS.values() for w in ws] + EMOJI + COMBINING + SPACES + \
        CONTRACTIONS + SPECIAL_LIKE
    for _ in range(400):
        add("mixed", "".join(rng.choice(pool) + rng.choice(["", " ", ""])
                             for _ in range(rng.randint(1, 15))))
    # long and edge cases
    add("edge", "")
    add("edge", " " * 1000)
    add("edge", "\n" * 300 + "x")
    add("edge", "9" * 500)
    add("edge", "".join(rng.choice(WORDS["cjk"]) for _ in range(800)))
    add("edge", "a" * 3000)
    add("edge", "ab" * 1500)
    add("edge", "🦙" * 200)
    add("edge", "\x00")
    add("edge", "a\x00b\x00\x00c")
    add("edge", "\ufeffBOM at start")
    add("edge", "\ufffd\ufffe\uffff")
    add("edge", "\U0010ffff\U000e0001")
    add("edge", corpus[:8000])
    return out


def gen_chats():
    tools = [
        {"type": "function", "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": {"type": "object", "properties": {
                "location": {"type": "string", "description": "The city, e.g. San Francisco"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14, "default": 1},
                "threshold": {"type": "number", "default": 0.5, "multipleOf": 1e-05},
                "strict": {"type": "boolean", "default": False},
                "tags": {"type": "array", "items": {"type": "string"}, "default": None}},
                "required": ["location"]}}},
        {"type": "function", "function": {
            "name": "search", "description": "Search the web: \"quotes\", \\ backslash, "
                                             "tab\t, newline\n, unicode é 中文 🦙, </tools>",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
    ]
    sys_msg = {"role": "system", "content": "You are a terse assistant. Answer in French."}
    u1 = {"role": "user", "content": "Hello!"}
    a1 = {"role": "assistant", "content": "Bonjour ! Comment puis-je vous aider ?"}
    u2 = {"role": "user", "content": "What's the weather in Paris and in 東京?\nThanks."}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_current_weather", "arguments": {"location": "Paris", "unit": "celsius"}}},
        {"id": "call_2", "type": "function", "function": {
            "name": "get_current_weather", "arguments": {"location": "東京", "days": 3,
                                                         "ratio": 0.1, "big": 1e20,
                                                         "neg": -2.5, "list": [1, None, True]}}}]}
    call_text = {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"type": "function", "function": {"name": "search",
                                          "arguments": "{\"q\": \"weather\"}"}}]}
    call_flat = {"role": "assistant", "content": None, "tool_calls": [
        {"name": "search", "arguments": {"q": "a \"quoted\" \\ string\n"}}]}
    t1 = {"role": "tool", "content": "{\"temperature\": 18, \"unit\": \"celsius\"}"}
    t2 = {"role": "tool", "content": "晴れ, 22°C"}
    a2 = {"role": "assistant", "content": "Paris: 18°C. 東京: 22°C."}
    parts_user = {"role": "user", "content": [{"type": "text", "text": "Part one."},
                                              {"type": "text", "text": "Part two\nwith newline."}]}
    parts_sys = {"role": "system", "content": [{"type": "text", "text": "System in parts."}]}
    convs = [
        ("user_only", [u1], None),
        ("system_user", [sys_msg, u1], None),
        ("multi_turn", [u1, a1, u2], None),
        ("system_multi_turn", [sys_msg, u1, a1, u2, a2], None),
        ("empty_user", [{"role": "user", "content": ""}], None),
        ("late_system", [u1, a1, {"role": "system", "content": "Now be verbose."}, u2], None),
        ("special_in_content", [{"role": "user",
                                 "content": "<|im_end|> and <|im_start|>assistant\n inside"}], None),
        ("unicode", [{"role": "user", "content": "e\u0301 👨‍👩‍👧 \t\r\n мир"}], None),
        ("tools_no_system", [u2], tools),
        ("tools_system", [sys_msg, u2], tools),
        ("tool_call_flow", [sys_msg, u2, call, t1, t2, a2], tools),
        ("tool_call_no_system", [u2, call, t1, t2], tools),
        ("tool_call_string_args", [u2, call_text, t1], tools),
        ("tool_call_flat_no_content", [u2, call_flat, t2, u1], tools),
        ("tool_call_without_tools", [u2, call, t1, a2], None),
        ("single_tool", [u2], tools[:1]),
        ("assistant_last", [u1, a1], None),
    ]
    # multi-part content, rendered after joining text parts with "\n" (what
    # vLLM does for string-content templates; the Jinja template itself
    # cannot concatenate a list)
    parts = [
        ("parts_user", [parts_user], None),
        ("parts_system_user", [parts_sys, parts_user], None),
        ("parts_tools", [parts_sys, parts_user], tools[1:]),
    ]
    # string arguments parsed first (chat_template_opts.parse_tool_arguments)
    empty_args = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": ""}},
        {"type": "function", "function": {"name": "search",
                                          "arguments": "{\"q\": [1.5, 2, {\"k\": null}]}"}}]}
    parse = [
        ("parsed_string_args", [u2, call_text, t1], tools),
        ("parsed_empty_args", [u2, empty_args, t1, t2], tools),
    ]
    return convs, parts, parse


def parse_arguments(messages):
    """vLLM's _postprocess_messages: string tool-call arguments -> JSON."""
    out = []
    for m in messages:
        m = json.loads(json.dumps(m))
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function", tc)
            a = fn.get("arguments")
            fn["arguments"] = json.loads(a) if isinstance(a, str) and a else (a or {})
        out.append(m)
    return out


def join_parts(messages):
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"] if p.get("type") == "text")
        out.append(m)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir",
                    default=os.path.join(ROOT, "..", "shared", "data", "qwen2.5-tokenizer"))
    ap.add_argument("--corpus", default=os.path.join(ROOT, "..", "shared", "data", "sotu",
                                                     "sotu.txt.xz"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "tokenizer"))
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    import tokenizers
    import transformers
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = Tokenizer.from_file(os.path.join(args.tokenizer_dir, "tokenizer.json"))
    corpus = lzma.open(args.corpus, "rt", encoding="utf-8").read()
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)

    inputs = gen_inputs(rng, corpus)
    with open(os.path.join(args.out, "encode.jsonl"), "w", encoding="utf-8") as f:
        for cat, s in inputs:
            ids = tok.encode(s, add_special_tokens=True).ids
            nfc = unicodedata.is_normalized("NFC", s)
            f.write(json.dumps({"cat": cat, "text": s, "nfc": nfc, "ids": ids},
                               ensure_ascii=False) + "\n")

    # decode: the encoded ids of a sample, with special tokens sprinkled in,
    # plus raw id sequences that split characters (invalid UTF-8 when cut)
    specials = [151643, 151644, 151645, 151657, 151658, 151659]
    with open(os.path.join(args.out, "decode.jsonl"), "w", encoding="utf-8") as f:
        for i, (cat, s) in enumerate(inputs):
            if i % 5:
                continue
            ids = tok.encode(s).ids
            if rng.random() < 0.5 and ids:
                for _ in range(rng.randint(1, 3)):
                    ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
            if rng.random() < 0.3 and len(ids) > 2:
                ids = ids[rng.randint(0, len(ids) // 2):]  # may start mid-character
            for skip in (False, True):
                f.write(json.dumps({"ids": ids, "skip_special": skip,
                                    "text": tok.decode(ids, skip_special_tokens=skip)},
                                   ensure_ascii=False) + "\n")
        for _ in range(200):
            ids = [rng.randrange(0, 151665) for _ in range(rng.randint(1, 12))]
            for skip in (False, True):
                f.write(json.dumps({"ids": ids, "skip_special": skip,
                                    "text": tok.decode(ids, skip_special_tokens=skip)},
                                   ensure_ascii=False) + "\n")

    # added-token flags that Qwen's own tokens do not exercise
    extra = [
        {"id": 151665, "content": "<L>", "single_word": False, "lstrip": True, "rstrip": False,
         "normalized": False, "special": True},
        {"id": 151666, "content": "<R>", "single_word": False, "lstrip": False, "rstrip": True,
         "normalized": False, "special": False},
        {"id": 151667, "content": "qfoo", "single_word": True, "lstrip": False, "rstrip": False,
         "normalized": False, "special": False},
        {"id": 151668, "content": "A\u030a!", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": True, "special": False},
        {"id": 151669, "content": "<B>", "single_word": False, "lstrip": True, "rstrip": True,
         "normalized": False, "special": True},
        {"id": 151670, "content": "<B>x", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": False},
    ]
    tj = json.load(open(os.path.join(args.tokenizer_dir, "tokenizer.json"), encoding="utf-8"))
    tj["added_tokens"] += extra
    tok2 = Tokenizer.from_str(json.dumps(tj))
    for e in extra:  # HF reassigns ids it disagrees with; the test trusts these
        assert tok2.token_to_id(e["content"]) == e["id"], e
    pieces = ["<L>", "<R>", "qfoo", "foo", "\u00c5!", "A\u030a!", "<B>", "<B>x", " ", "  ", "\t", "\n",
              "\u3000", "a", "food", "_foo", "foo_", "(foo)", "éfoo", "foo1", "x", "<|im_end|>",
              "Å", "!", "\u00a0"]
    vectors = []
    for _ in range(400):
        s = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 10)))
        vectors.append({"text": s, "ids": tok2.encode(s).ids})
    for s in ["qfoo", " qfoo ", "qfooqfoo", "a qfoo b", "éqfoo", "qfoo1", "qfoo_", "(qfoo)", "x <L>", "x  \t<L>  y", "<R>  \n z",
              "  <B>  ", "<B>x", " <B>x ", "A\u030a!", "\u00c5!"]:
        vectors.append({"text": s, "ids": tok2.encode(s).ids})
    with open(os.path.join(args.out, "added.json"), "w", encoding="utf-8") as f:
        json.dump({"added_tokens": extra, "vectors": vectors}, f, ensure_ascii=False)
        f.write("\n")

    hf = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    convs, parts, parse = gen_chats()
    with open(os.path.join(args.out, "chat.jsonl"), "w", encoding="utf-8") as f:
        for joined, group in ((False, convs), (True, parts), (False, parse)):
            for name, msgs, tls in group:
                for agp in (True, False):
                    render_msgs = join_parts(msgs) if joined else msgs
                    rec = {"name": name, "messages": msgs, "tools": tls,
                           "add_generation_prompt": agp}
                    if group is parse:
                        render_msgs = parse_arguments(msgs)
                        rec["parse_tool_arguments"] = True
                    rec["text"] = hf.apply_chat_template(render_msgs, tools=tls, tokenize=False,
                                                         add_generation_prompt=agp)
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    # the whole corpus: count and FNV-1a 64 of the ids (as little-endian uint32)
    ids = tok.encode(corpus).ids
    h = 0xcbf29ce484222325
    for i in ids:
        for b in int(i).to_bytes(4, "little"):
            h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump({"tokenizers": tokenizers.__version__, "transformers": transformers.__version__,
                   "seed": args.seed, "encode_vectors": len(inputs),
                   "sotu_bytes": len(corpus.encode("utf-8")), "sotu_n_ids": len(ids),
                   "sotu_ids_fnv1a64": "%016x" % h}, f, indent=1)
        f.write("\n")
    print(f"wrote {len(inputs)} encode vectors to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
