#!/usr/bin/env python3
"""Compare disagg's structured-output token masks with xgrammar's (the reference vLLM uses).

For each case of tools/grammar_cases.py: xgrammar compiles it over the Qwen2.5 vocabulary,
random walks go through it (xgrammar's masks pick the tokens), and at every step the set of
allowed tokens (stop and special tokens left out) is compared with disagg's
(`disagg bench grammar --masks`).  Writes the walks and xgrammar's masks (count and hash)
as golden data for tests/integration/test_structured_outputs.py, which checks disagg
against them without xgrammar (it needs torch, which CI does not install).

usage: tools/grammar_xgrammar.py DISAGG_BIN TOKENIZER_DIR OUT.jsonl [--walks N] [--steps N]
"""
import json
import random
import subprocess
import sys
import tempfile

import numpy as np
import xgrammar as xgr
from transformers import AutoTokenizer

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import grammar_cases  # noqa: E402


def mask_hash(ids):
    z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        return "%016x" % int(z.sum(dtype=np.uint64))


def compile_case(compiler, c):
    k, t = c["kind"], c["text"]
    if k == "json_schema":
        return compiler.compile_json_schema(t, any_whitespace=not c["compact"])
    if k == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=not c["compact"],
                                            strict_mode=False)
    if k == "regex":
        return compiler.compile_regex(t)
    if k == "choice":  # as vLLM writes a choice list
        alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(t))
        return compiler.compile_grammar("root ::= " + alts)
    return compiler.compile_grammar(t)


def main():
    disagg, tokdir, out = sys.argv[1:4]
    walks = int(sys.argv[sys.argv.index("--walks") + 1]) if "--walks" in sys.argv else 2
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 30
    tok = AutoTokenizer.from_pretrained(tokdir)
    V = len(tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    compiler = xgr.GrammarCompiler(info)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    drop = np.array(sorted(special | set(info.stop_token_ids)), dtype=np.int64)
    rnd = random.Random(7)
    rows = []
    for ci, c in enumerate(grammar_cases.cases()):
        try:
            ctx = compile_case(compiler, c)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(c, xgrammar_error=str(e)[:300]))
            continue
        for w in range(walks):
            m = xgr.GrammarMatcher(ctx)
            bm = xgr.allocate_token_bitmask(1, V)
            toks, xs = [], []
            for _ in range(steps + 1):
                m.fill_next_token_bitmask(bm)
                bits = bm[0].numpy().view(np.uint32)
                allowed = np.nonzero((bits[np.arange(V) >> 5] >> (np.arange(V) & 31)) & 1)[0]
                stop_ok = any(((bits[s >> 5] >> (s & 31)) & 1) for s in info.stop_token_ids)
                allowed = np.setdiff1d(allowed, drop)
                xs.append({"n": int(len(allowed)), "hash": mask_hash(allowed),
                           "accepting": int(stop_ok)})
                if len(toks) == steps or not len(allowed) or (stop_ok and rnd.random() < 0.25):
                    break
                short = [int(t) for t in allowed if len(tok.convert_ids_to_tokens(int(t))) <= 2]
                pick = rnd.choice(short) if short and rnd.random() < 0.5 else int(rnd.choice(allowed))
                assert m.accept_token(pick)
                toks.append(pick)
            rows.append(dict(c, walk=w, tokens=toks, xgrammar=xs))
        print(f"case {ci}: {c['kind']} walks done", file=sys.stderr)
    # disagg's masks along the same walks
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        todo = [r for r in rows if "tokens" in r]
        for r in todo:
            f.write(json.dumps({"kind": r["kind"], "text": r["text"], "compact": r["compact"],
                                "tokens": r["tokens"]}) + "\n")
    res = subprocess.run([disagg, "bench", "grammar", "--tokenizer", tokdir, "--masks", f.name],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    same = diff = 0
    for r, line in zip(todo, res):
        d = json.loads(line)
        r["disagg_error"] = d.get("error")
        ds = d.get("steps", [])
        r["disagg"] = [{"n": s["n"], "hash": s["hash"], "accepting": s["accepting"]} for s in ds]
        r["equal"] = [int(i < len(ds) and ds[i]["hash"] == x["hash"] and
                          ds[i]["accepting"] == x["accepting"]) for i, x in enumerate(r["xgrammar"])]
        same += sum(r["equal"])
        diff += len(r["equal"]) - sum(r["equal"])
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"steps equal {same}, different {diff}; cases {len(grammar_cases.cases())}, walks {len(todo)}")
    for r in todo:
        if r.get("disagg_error") or not all(r["equal"]):
            bad = [i for i, e in enumerate(r["equal"]) if not e]
            print(f"DIFF {r['kind']} {r['text'][:90]!r} compact={r['compact']} walk={r['walk']} "
                  f"steps {bad[:5]}.. err={r.get('disagg_error')} "
                  f"x={[r['xgrammar'][i]['n'] for i in bad[:3]]} d={[r['disagg'][i]['n'] if i < len(r['disagg']) else None for i in bad[:3]]}")


if __name__ == "__main__":
    main()
