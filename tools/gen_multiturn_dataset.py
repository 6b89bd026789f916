#!/usr/bin/env python3
"""A multi-turn conversation dataset for `disagg bench serve --dataset-name custom`.

Each line of the output (JSONL; or one JSON list when --out ends in .json) is one
conversation, in the shape vLLM's benchmarks/multi_turn tools use ({"id", "messages":
[{"role", "content"}]}):
user turns only -- the assistant turns are the server's own answers, which
`bench serve` appends to the history before it sends the next user turn, so the
prefix a turn shares with the one before is real.  The user turns are
consecutive passages of the public-domain State of the Union corpus
(shared/data/sotu beside the checkout, CC0; --corpus another text), each conversation starting at its own place, so
conversations share no prefix with one another (beyond the chat template).

Context growth: turn k's prompt holds k user passages and k-1 answers, so with
--user-words W, T turns and `bench serve --custom-output-len A` the last turn's
prompt is about T*W*r + (T-1)*A tokens (r: tokens per word, ~1.2 for Qwen2.5's
tokenizer on this English).  The defaults (64 conversations x 8 turns x 800
words) reach ~8.7k tokens at the 8th turn with A=150.

  tools/gen_multiturn_dataset.py --out multiturn.jsonl
  tools/gen_multiturn_dataset.py --conversations 4 --turns 3 --user-words 40 --out small.jsonl
  tools/gen_multiturn_dataset.py ... --tokenizer /work/shared/data/qwen2.5-tokenizer
      (prints the token counts with that tokenizer.json, if `tokenizers` is installed)
"""
import argparse
import json
import lzma
import os
import random
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# the corpus beside the checkout (shared/ or ../shared/), else the workstation's copy
CORPUS = next((p for p in (os.path.join(HERE, "..", "shared", "data", "sotu", "sotu.txt.xz"),
                           os.path.join(HERE, "..", "..", "shared", "data", "sotu", "sotu.txt.xz"))
               if os.path.exists(p)), "/work/shared/data/sotu/sotu.txt.xz")
ASKS = [
    "Summarize the passage above in one sentence.",
    "What does the speaker ask of Congress here?",
    "Continue the argument of this passage.",
    "Which policy is discussed, and what is proposed?",
    "Compare this with the earlier parts of our conversation.",
    "What is the main claim, and how is it supported?",
]


def corpus_words(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"<\|doc\|>[^\n]*\n", " ", text)  # the address headers
    return text.split()


def build(words, conversations, turns, user_words, seed):
    if len(words) < user_words * turns + 1:
        raise ValueError(f"the corpus has {len(words)} words; one conversation needs {user_words * turns}")
    rng = random.Random(seed)
    span = user_words * turns
    out = []
    for c in range(conversations):
        start = rng.randrange(0, len(words) - span)
        msgs = []
        for t in range(turns):
            passage = " ".join(words[start + t * user_words:start + (t + 1) * user_words])
            msgs.append({"role": "user", "content": f"{passage}\n\n{ASKS[(c + t) % len(ASKS)]}"})
        out.append({"id": f"conv-{c:04d}", "messages": msgs})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True,
                    help="the file to write: JSONL (one conversation a line), or a .json name for one JSON "
                         "list (vLLM's benchmarks/multi_turn input shape); bench serve reads both")
    ap.add_argument("--conversations", type=int, default=64, help="conversations (default 64)")
    ap.add_argument("--turns", type=int, default=8, help="user turns per conversation (default 8)")
    ap.add_argument("--user-words", type=int, default=800, help="corpus words per user turn (default 800)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", default=CORPUS, help=f"text corpus (default {CORPUS})")
    ap.add_argument("--tokenizer", help="a directory with tokenizer.json: print token counts")
    a = ap.parse_args(argv)
    for name in ("conversations", "turns", "user_words"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if not os.path.exists(a.corpus):
        ap.error(f"--corpus {a.corpus}: no such file")
    try:
        convs = build(corpus_words(a.corpus), a.conversations, a.turns, a.user_words, a.seed)
    except ValueError as e:
        ap.error(str(e))
    with open(a.out, "w", encoding="utf-8") as f:
        if a.out.endswith(".json"):
            json.dump(convs, f, ensure_ascii=False, indent=1)
        else:
            for c in convs:
                f.write(json.dumps(c, ensure_ascii=False) + "\n")
    msg = f"gen_multiturn_dataset: {len(convs)} conversations x {a.turns} turns x {a.user_words} words -> {a.out}"
    if a.tokenizer:
        try:
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(os.path.join(a.tokenizer, "tokenizer.json"))
            per_turn = [len(tok.encode(m["content"]).ids) for c in convs for m in c["messages"]]
            mean = sum(per_turn) / len(per_turn)
            msg += f"; {mean:.0f} tokens per user turn, so the last turn's prompt is ~{mean * a.turns:.0f} tokens + the answers"
        except ImportError:
            msg += "; (no `tokenizers` module: token counts not printed)"
    print(msg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
