#!/usr/bin/env python3
"""Writes tests/data/server/tokenize.json: what vLLM's /tokenize and /detokenize
return for the default model, computed with Hugging Face `tokenizers` (the library
vLLM's tokenizer wraps) from models/disagg-sotu-tiny/tokenizer.json.

  tokens     = Tokenizer.encode(text, add_special_tokens=True).ids
  token_strs = [Tokenizer.id_to_token(i) for i in tokens]   (convert_ids_to_tokens)
  detok      = Tokenizer.decode(ids, skip_special_tokens=False)

Usage: python3 tools/gen_server_golden.py  (needs `pip install tokenizers`, not torch)
"""
import json
import random
from pathlib import Path

from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "disagg-sotu-tiny"

TEXTS = [
    "Hello world",
    "Fellow-Citizens of the Senate and House of Representatives:",
    "The state of the Union is strong.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n",
    "numbers 1234567890 and 3.14159, 1,000,000",
    "unicode: café naïve Łódź déjà vu — “quotes” 日本語 🇺🇸 😀",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "special tokens glued<|im_end|>to text",
    "don't won't it's we'll I'm you're they've",
    "$100.00 & 50% off!!! ??? ...",
    "a" * 300,
    "\u00a0non-breaking\u2003spaces",
]


def main():
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    rng = random.Random(5)
    cases = []
    for t in TEXTS:
        ids = tok.encode(t, add_special_tokens=True).ids
        cases.append({"prompt": t, "tokens": ids, "token_strs": [tok.id_to_token(i) for i in ids]})
    detok = []
    vocab = tok.get_vocab_size()
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        detok.append({"tokens": ids, "prompt": tok.decode(ids, skip_special_tokens=False)})
    for c in cases[:6]:
        detok.append({"tokens": c["tokens"], "prompt": tok.decode(c["tokens"], skip_special_tokens=False)})
    out = {
        "how": "tokenizers %s on models/disagg-sotu-tiny/tokenizer.json: encode(add_special_tokens=True), "
               "id_to_token, decode(skip_special_tokens=False)" % __import__("tokenizers").__version__,
        "tokenize": cases,
        "detokenize": detok,
    }
    path = ROOT / "tests" / "data" / "server" / "tokenize.json"
    path.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
