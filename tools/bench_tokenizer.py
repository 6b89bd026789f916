#!/usr/bin/env python3
"""Encode throughput of disagg's tokenizer against Hugging Face `tokenizers`, per
family, on the same text (a benchmark, not a test: docs/benchmarks.md has the
figures).

    python3 tools/bench_tokenizer.py [--disagg build/disagg] [--families llama3,tekken]

Each family's tokenizer.json is built as tests/integration/tokenizer_refs.py
builds it (plus Qwen2.5's from ../shared/data/qwen2.5-tokenizer).  The text is
the public-domain sotu corpus (../shared/data/sotu/sotu.txt.xz, 10.8 MB) cut
into its lines (or --chunk pieces).  disagg: `disagg tokenize` reports the seconds spent in
tokenizer_encode (one thread) and their CPU time.  HF: Tokenizer.encode on
each piece in one Python thread (its per-call overhead included), and
encode_batch over all of them with RAYON_NUM_THREADS threads (default 1).
Throughput is bytes over CPU seconds (process CPU time for HF) so that a
loaded machine does not skew the comparison.  Ids are checked equal.
"""
import argparse
import json
import lzma
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--disagg", default=os.path.join(ROOT, "build", "disagg"))
    ap.add_argument("--families", default="qwen2.5,llama3,mistral_v3,mistral_v1,tekken")
    ap.add_argument("--chunk", type=int, default=0,
                    help="cut the text into pieces of about this many characters (0: lines)")
    ap.add_argument("--corpus", default=os.path.join(ROOT, "..", "shared", "data", "sotu",
                                                     "sotu.txt.xz"))
    args = ap.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import tokenizer_refs
    from tokenizers import Tokenizer

    text = lzma.open(args.corpus, "rt", encoding="utf-8").read()
    paras = [p for p in text.split("\n") if p.strip()]
    if args.chunk:  # prompt-sized pieces, cut after a space
        paras, i = [], 0
        while i < len(text):
            j = text.find(" ", i + args.chunk)
            j = len(text) if j < 0 else j + 1
            paras.append(text[i:j])
            i = j
    mb = sum(len(p.encode()) for p in paras) / 1e6
    print(f"corpus: {len(paras)} pieces, {mb:.2f} MB; HF tokenizers "
          f"{__import__('tokenizers').__version__}, RAYON_NUM_THREADS="
          f"{os.environ['RAYON_NUM_THREADS']}")
    print("| tokenizer | tokens | disagg MB/CPU-s | HF encode MB/CPU-s | HF encode_batch MB/CPU-s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        inp = os.path.join(tmp, "in.jsonl")
        with open(inp, "w", encoding="utf-8") as f:
            for p in paras:
                f.write(json.dumps({"text": p}) + "\n")
        for fam in args.families.split(","):
            if fam == "qwen2.5":
                tdir = os.path.join(ROOT, "..", "shared", "data", "qwen2.5-tokenizer")
            else:
                tdir = tokenizer_refs.FAMILIES[fam](os.path.join(tmp, fam)).dir
            hf = Tokenizer.from_file(os.path.join(tdir, "tokenizer.json"))
            outp = os.path.join(tmp, "out.jsonl")
            p = subprocess.run([args.disagg, "tokenize", tdir, "--input", inp, "--output", outp],
                               capture_output=True, text=True, check=True)
            m = re.search(r"encoded in [0-9.]+ s \(([0-9.]+) s CPU\)", p.stderr)
            d_mbs = mb / float(m.group(1))
            with open(outp, encoding="utf-8") as f:
                ours = [json.loads(line)["ids"] for line in f]
            t0 = time.process_time()
            ref = [hf.encode(q, add_special_tokens=False).ids for q in paras]
            h_mbs = mb / (time.process_time() - t0)
            t0 = time.process_time()
            hf.encode_batch(paras, add_special_tokens=False)
            hb_mbs = mb / (time.process_time() - t0)
            if ours != ref:
                sys.exit(f"{fam}: ids differ from HF tokenizers")
            ntok = sum(len(x) for x in ref)
            print(f"| {fam} | {ntok:,} | {d_mbs:.1f} | {h_mbs:.1f} | {hb_mbs:.1f} |")


if __name__ == "__main__":
    main()
