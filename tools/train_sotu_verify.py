"""Re-checks the shipped default model against its committed reference outputs, on CPU.

Owns nothing; reads models/disagg-sotu-tiny/ and tests/data/sotu-tiny/ and checks, with
an independent run of PyTorch + transformers + tokenizers on this machine:
  1. the held-out token stream re-tokenized from the corpus equals heldout_ids.json, and
     the files' SHA-256 sums equal those recorded in heldout_eval.json;
  2. the held-out perplexity recomputed (definition in train_sotu_tiny.py) equals the
     committed one within --rtol (default 1e-6; different BLAS summation orders only);
  3. the unigram perplexity recomputed equals the committed one;
  4. greedy continuations from transformers' generate() equal greedy.json token for token.
Exit status 0 when all hold, 1 otherwise (each failure printed).

Usage: python3 tools/train_sotu_verify.py [--skip-ppl] [--rtol 1e-6] [--ref-dir D] [--model-dir D]
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_sotu_data as sd  # noqa: E402
import train_sotu_tiny as tt  # noqa: E402

REF_DIR = os.path.normpath(os.path.join(tt.HERE, "..", "tests", "data", "sotu-tiny"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-ppl", action="store_true", help="skip the (slow on CPU) perplexity recomputation")
    ap.add_argument("--rtol", type=float, default=1e-6)
    ap.add_argument("--data", default=None, help="sotu.txt.xz (default: $SOTU_DATA or ../shared/data/sotu/)")
    ap.add_argument("--ref-dir", default=REF_DIR, help="reference outputs (default: tests/data/sotu-tiny)")
    ap.add_argument("--model-dir", default=tt.MODEL_DIR, help="model (default: models/disagg-sotu-tiny)")
    args = ap.parse_args()
    ref_dir, model_dir = args.ref_dir, args.model_dir
    torch.backends.cuda.matmul.allow_tf32 = False
    with open(os.path.join(ref_dir, "heldout_eval.json")) as f:
        ev = json.load(f)
    with open(os.path.join(ref_dir, "heldout_ids.json")) as f:
        ref_ids = json.load(f)["ids"]
    with open(os.path.join(ref_dir, "greedy.json")) as f:
        gr = json.load(f)
    bad = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            bad.append(what)

    raw, train_docs, heldout_docs = sd.load_split(args.data)
    check(sd.sha256_hex(raw) == ev["sotu_txt_sha256"], "corpus sha256")
    check(sd.sha256_hex(sd.stream_text(heldout_docs)) == ev["heldout_stream_text_sha256"], "held-out text sha256")
    for name in ("tokenizer.json", "model.safetensors"):
        with open(os.path.join(model_dir, name), "rb") as f:
            got = sd.sha256_hex(f.read())
        check(got == ev[name.replace(".", "_") + "_sha256"], f"{name} sha256")
    tok = tt.load_tokenizer(model_dir)
    ids = tt.encode_docs(tok, heldout_docs)
    check(ids.tolist() == ref_ids, f"held-out ids ({len(ids)} tokens)")
    train_ids = tt.encode_docs(tok, train_docs)
    ctx = ev["eval_context"]
    uni, _ = tt.unigram(train_ids, ids, tok.get_vocab_size(), ctx, 0)
    check(math.isclose(uni, ev["unigram"]["perplexity"], rel_tol=1e-12), f"unigram ppl {uni:.6f}")

    if not args.skip_ppl:
        model = tt.load_fp32(model_dir, torch.device("cpu"))
        rows = tt.window_nll(model, ids, ctx, torch.device("cpu"))
        scored, total, _, ppl = tt.summarize(rows)
        check(scored == ev["scored_tokens"], f"scored tokens {scored}")
        check(math.isclose(ppl, ev["perplexity"], rel_tol=args.rtol),
              f"perplexity {ppl:.6f} vs {ev['perplexity']:.6f} (rel {abs(ppl / ev['perplexity'] - 1):.1e})")
        worst = max(abs(r[3] - w["sum_nll"]) / max(1.0, w["sum_nll"]) for r, w in zip(rows, ev["per_window"]))
        check(worst < 1e-5, f"per-window NLL sums (worst rel diff {worst:.1e})")

    prompts = [(p["kind"], p["prompt"]) for p in gr["prompts"]]
    got = tt.greedy(model_dir, prompts, gr["max_new_tokens"], torch.device("cpu"))
    for g, r in zip(got, gr["prompts"]):
        check(g["prompt_ids"] == r["prompt_ids"], f"prompt ids of {r['prompt']!r}")
        check(g["output_ids"] == r["output_ids"], f"greedy ids of {r['prompt']!r}")
    print(f"{len(bad)} failed" if bad else "all checks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    np.seterr(all="raise")
    sys.exit(main())
