"""Trains the byte-level BPE tokenizer of the shipped default model (models/disagg-sotu-tiny/).

Owns: tokenizer.json and tokenizer_config.json of that model. The tokenizer is trained
with Hugging Face `tokenizers` on the TRAINING addresses only (train_sotu_data.py's
split), and has exactly Qwen2.5's shape, so that code written for Qwen2.5's tokenizer
handles it unchanged:
  - normalizer NFC, pre-tokenizer Sequence[Split(Qwen2 regex, Isolated),
    ByteLevel(add_prefix_space=false, use_regex=false)], ByteLevel post-processor and
    decoder: copied verbatim from ../shared/data/qwen2.5-tokenizer/tokenizer.json;
  - a BPE model with the 256 byte symbols and VOCAB - 3 - 256 merges (ids 0..VOCAB-4);
  - the added special tokens <|endoftext|>, <|im_start|>, <|im_end|> at ids VOCAB-3..VOCAB-1
    (as in Qwen2.5, where they follow the BPE vocabulary).
tokenizer_config.json is Qwen2.5-Instruct's (same chat template), with our added tokens,
eos = pad = <|endoftext|>.

Usage: python3 tools/train_sotu_tokenizer.py [--out models/disagg-sotu-tiny] [--vocab 4096]
"""

import argparse
import json
import os
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_sotu_data as sd  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids VOCAB-3, VOCAB-2, VOCAB-1


def qwen_dir():
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "shared", "data", "qwen2.5-tokenizer"))


def train(train_docs, vocab, qwen):
    """A trained tokenizers.Tokenizer with Qwen2.5's pipeline around a new BPE model."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    pre = qwen["pre_tokenizer"]["pretokenizers"]
    regex = pre[0]["pattern"]["Regex"]
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(SPECIALS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((d.body for d in train_docs), trainer=trainer, length=len(train_docs))
    got = tok.get_vocab_size()
    if got != vocab - len(SPECIALS):
        raise SystemExit(f"tokenizer: trainer made {got} BPE entries, wanted {vocab - len(SPECIALS)}")
    tok.add_special_tokens(SPECIALS)
    return tok


def to_qwen_shape(tok, qwen):
    """tokenizer.json dict of tok with Qwen2.5's non-model sections and BPE flags copied verbatim."""
    j = json.loads(tok.to_str())
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "truncation", "padding"):
        j[key] = qwen[key]
    for key in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                "fuse_unk", "byte_fallback", "ignore_merges"):
        j["model"][key] = qwen["model"][key]
    # added tokens: exactly Qwen2.5's entries for these three, with our ids
    qadded = {a["content"]: a for a in qwen["added_tokens"]}
    ours = {a["content"]: a["id"] for a in j["added_tokens"]}
    j["added_tokens"] = [dict(qadded[s], id=ours[s]) for s in SPECIALS]
    # same key order as Qwen2.5's file
    return {k: j[k] for k in qwen.keys()}


def make_config(qwen_cfg, tok_json, vocab):
    """tokenizer_config.json: Qwen2.5-Instruct's, with our added tokens and eos = pad = <|endoftext|>."""
    cfg = dict(qwen_cfg)
    ids = {a["content"]: a["id"] for a in tok_json["added_tokens"]}
    qdec = {v["content"]: v for v in qwen_cfg["added_tokens_decoder"].values()}
    cfg["added_tokens_decoder"] = {str(ids[s]): qdec[s] for s in SPECIALS}
    cfg["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>"]
    cfg["eos_token"] = "<|endoftext|>"
    cfg["pad_token"] = "<|endoftext|>"
    cfg["model_max_length"] = 2048
    return cfg


def check(path_dir, train_tok):
    """Reload the written files and check they tokenize like the trained tokenizer."""
    t = Tokenizer.from_file(os.path.join(path_dir, "tokenizer.json"))
    samples = [
        "Fellow-Citizens of the Senate and House of Representatives:",
        "Mr. Speaker, Mr. Vice President, Members of Congress, my fellow Americans: 2016's budget\n\nis $1,234.",
        "<|im_start|>user\nHello!<|im_end|>\n<|endoftext|>",
        "naïve café — “quoted” 你好",
    ]
    for s in samples:
        a, b = t.encode(s).ids, train_tok.encode(s).ids
        if a != b:
            raise SystemExit(f"tokenizer: reloaded file differs on {s!r}: {a} vs {b}")
        if t.decode(a, skip_special_tokens=False) != s:
            raise SystemExit(f"tokenizer: round trip failed on {s!r}: {t.decode(a)!r}")
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                  "models", "disagg-sotu-tiny"))
    ap.add_argument("--vocab", type=int, default=4096, help="total vocabulary incl. the 3 specials")
    ap.add_argument("--data", default=None, help="sotu.txt.xz (default: ../shared/data/sotu/)")
    args = ap.parse_args()

    with open(os.path.join(qwen_dir(), "tokenizer.json"), encoding="utf-8") as f:
        qwen = json.load(f)
    with open(os.path.join(qwen_dir(), "tokenizer_config.json"), encoding="utf-8") as f:
        qwen_cfg = json.load(f)
    _, train_docs, _ = sd.load_split(args.data)
    tok = train(train_docs, args.vocab, qwen)
    j = to_qwen_shape(tok, qwen)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(make_config(qwen_cfg, j, args.vocab), f, ensure_ascii=False, indent=2)
        f.write("\n")
    t = check(args.out, tok)
    n_train = sum(len(t.encode(d.body).ids) for d in train_docs[-20:])
    b_train = sum(len(d.body.encode()) for d in train_docs[-20:])
    print(f"tokenizer: {t.get_vocab_size()} tokens, {len(j['model']['merges'])} merges, "
          f"specials {[(a['content'], a['id']) for a in j['added_tokens']]}; "
          f"{b_train / n_train:.2f} bytes/token on the last 20 training addresses")


if __name__ == "__main__":
    main()
