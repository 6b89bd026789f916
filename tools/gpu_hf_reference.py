#!/usr/bin/env python3
"""gpu_hf_reference — Hugging Face transformers reference logits and greedy continuations
computed ON THE GPU, for tests/unit/test_cuda_model.c (test_hf_gpu_reference).

For each --model NAME=DIR it loads the checkpoint twice on cuda:0 (bfloat16 and float32,
eager attention), runs the cases' prompts and writes OUT/NAME.json:
  cases: [{prompt_ids, rows: [{pos, ids, bf16, f32, max_abs_bf16, max_abs_f32}],
           greedy_bf16, greedy_f32}]
rows keep, at a few positions, the reference's top-32 ids (f32 run) plus 32 fixed ids with
both runs' logits, and each full row's max |logit| (the error scale).  Greedy continuations
are model.generate(do_sample=False) for 32 new tokens.
Prompts: the golden prompts of tests/data/sotu-tiny/greedy.json for the default model, plus
synthetic id sequences (one long: 600 tokens) to cross KV blocks and split attention.

Usage (GPU machine): python3 tools/gpu_hf_reference.py --out DIR \
    --model sotu-tiny=models/disagg-sotu-tiny --model tiny-bf16=/tmp/tiny-bf16"""
import argparse, json, os, sys
import torch, transformers as T

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--model", action="append", required=True, help="NAME=DIR")
ap.add_argument("--golden", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "sotu-tiny", "greedy.json"))
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
dev = "cuda:0"


def load(d, dt):
    try:
        m = T.AutoModelForCausalLM.from_pretrained(d, dtype=dt, attn_implementation="eager")
    except TypeError:
        m = T.AutoModelForCausalLM.from_pretrained(d, torch_dtype=dt, attn_implementation="eager")
    return m.to(dev).eval()


for spec in a.model:
    name, d = spec.split("=", 1)
    cfg = json.load(open(os.path.join(d, "config.json")))
    V, maxpos = cfg["vocab_size"], cfg.get("max_position_embeddings", 2048)
    prompts = []
    if name == "sotu-tiny" and os.path.exists(a.golden):
        prompts += [p["prompt_ids"] for p in json.load(open(a.golden))["prompts"]]
    long_n = min(600, maxpos - 40)
    prompts += [[(i * 7919 + 13) % min(V, 4000) for i in range(40)],
                [(i * 104729 + 7) % min(V, 4000) for i in range(long_n)]]
    fixed = [(i * 2654435761) % V for i in range(32)]
    ms = {"bf16": load(d, torch.bfloat16), "f32": load(d, torch.float32)}
    cases = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=dev)
            lg = {k: m(x).logits[0].float().cpu() for k, m in ms.items()}
            n = len(ids)
            rows = []
            for t in sorted(set([0, n // 2, n - 1, max(0, n - 2)])):
                top = torch.topk(lg["f32"][t], 32).indices.tolist()
                sel = list(dict.fromkeys(top + fixed))
                rows.append({"pos": t, "ids": sel,
                             "bf16": [float(lg["bf16"][t, i]) for i in sel],
                             "f32": [float(lg["f32"][t, i]) for i in sel],
                             "max_abs_bf16": float(lg["bf16"][t].abs().max()),
                             "max_abs_f32": float(lg["f32"][t].abs().max())})
            gen = {}
            for k, m in ms.items():
                o = m.generate(x, do_sample=False, max_new_tokens=32, min_new_tokens=32,
                               attention_mask=torch.ones_like(x), pad_token_id=0)
                gen[k] = o[0, n:].tolist()
            cases.append({"prompt_ids": ids, "rows": rows, "greedy_bf16": gen["bf16"], "greedy_f32": gen["f32"]})
    out = {"model": name, "how": "transformers %s, torch %s, %s, eager attention, bf16 and f32 copies of the checkpoint"
           % (T.__version__, torch.__version__, torch.cuda.get_device_name(0)), "cases": cases}
    with open(os.path.join(a.out, name + ".json"), "w") as f:
        json.dump(out, f)
    print("gpu_hf_reference: wrote %s/%s.json (%d cases)" % (a.out, name, len(cases)))
