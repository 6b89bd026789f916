#!/usr/bin/env python3
"""gen_golden_moe_route: the router's choices as transformers computes them (Qwen3MoeTopKRouter /
MixtralTopKRouter: softmax(logits, dtype=float32), torch.topk, the top-k renormalised when
norm_topk_prob / always for Mixtral) for small logits cases, written to
tests/data/model/golden-moe-route.json for tests/unit/test_backend_ops_moe.c (CI needs no torch).

Each case: n_experts, top_k, norm, logits (T rows, float32 values written exactly), and torch's
ids and weights.  Cases: random rows (8 experts top 2, 128 experts top 8 as Qwen3-30B-A3B,
Mixtral's 8 top 2 without renormalisation off), rows whose softmax underflows to 0 for most
experts, and rows with exact ties.  torch.topk's order among equal values on the CPU is not
the lower index first (e.g. 8 equal logits, top 2: [6, 5] on torch 2.x): the case carries
"ties": true and the test then checks the chosen probabilities position by position, not the
ids (backend.h defines ties as the lower index first).
Usage: python3 tools/gen_golden_moe_route.py [OUT_JSON]"""
import json
import os
import sys

import numpy as np
import torch


def case(logits, k, norm):
    lg = torch.tensor(np.asarray(logits, dtype=np.float32))
    p = torch.nn.functional.softmax(lg, dtype=torch.float, dim=-1)
    pv, i = torch.topk(p, k, dim=-1)
    # a chosen probability that another expert shares: torch's order among them is its own
    ties = any(row.count(x) > 1 for row, sel in zip(p.tolist(), pv.tolist()) for x in sel)
    v = pv / pv.sum(dim=-1, keepdim=True) if norm else pv
    return {"n_experts": lg.shape[1], "top_k": k, "norm": bool(norm), "ties": ties,
            "logits": [[float(x) for x in row] for row in lg.tolist()],
            "ids": i.tolist(), "weights": [[float(x) for x in row] for row in v.tolist()]}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "model", "golden-moe-route.json")
    r = np.random.Generator(np.random.PCG64(2828))
    cases = [case(r.standard_normal((16, 8)), 2, True),
             case(r.standard_normal((16, 8)), 2, False),
             case(r.standard_normal((8, 128)) * 2, 8, False),
             case(r.standard_normal((8, 128)) * 2, 8, True),
             case(r.standard_normal((4, 64)) * 0.01, 6, True),
             case(r.standard_normal((2, 512)), 1, False),
             case([[0.5]], 1, True),
             case([[100.0] + [0.0] * 7], 1, True),  # the others' p underflow to 0: no tie in the top 1
             case([[-100.0] * 3 + [5.0] + [-100.0] * 60], 1, False),
             case([[0.0] * 8], 2, True),
             case([[1.0, 3.0, 3.0, 3.0, 2.0, 3.0, 0.0, 3.0]], 3, False),
             case([[100.0] + [0.0] * 7], 3, True)]
    doc = {"torch_version": torch.__version__, "cases": cases}
    with open(out, "w") as f:
        json.dump(doc, f)
    print(out, len(cases), "cases")


if __name__ == "__main__":
    main()
