"""gen_golden_fp8: transformers reference logits for the random tiny FP8 checkpoints of
tools/gen_random_fp8.py.  transformers 5.24 loads FP8 checkpoints only with accelerate and a GPU
kernel path, so the reference is the checkpoint's f32-dequantized twin (every e4m3 weight times
its scale in f32: exactly the weights disagg's CPU backend computes with) loaded with
AutoModelForCausalLM in float32 on the CPU, eager attention.  Writes $OUT/golden-<variant>.json
in tools/gen_golden_logits.py's format (per prompt and position the reference top-16 ids plus 32
fixed ids with their logits, the 16-token greedy continuation) plus "accuracy_vs_unquantized":
the FP8 model against the f32 weights it was quantized from (max / mean |logprob difference| on
the unquantized model's top-16 tokens at every stored position, greedy tokens agreeing).
Usage: OUT=dir python3 tools/gen_golden_fp8.py [variant ...]"""
import json, os, sys, tempfile
import numpy as np, torch, transformers as T

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_random_fp8 as G  # noqa: E402

V = G.VOCAB
S = [int(i) for i in np.linspace(0, V - 1, 32).round()]


def prompts():  # as gen_golden_logits.py's
    r = np.random.Generator(np.random.PCG64(99))
    return [[151644], [151644, 872, 198, 9707, 11, 1879, 0], [int(x) for x in r.integers(0, 151643, 20)],
            [int(x) for x in r.integers(0, 151643, 200)]]


def run(m, ids):
    with torch.no_grad():
        lg = m(torch.tensor([ids])).logits[0].numpy()
        q = list(ids)
        for _ in range(16):
            q.append(int(m(torch.tensor([q])).logits[0, -1].argmax()))
    return lg, q[len(ids):]


def positions(n):
    return range(n) if n <= 20 else sorted(set(range(0, n, 8)) | {n - 1})


def logsm(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


torch.set_num_threads(os.cpu_count() or 1)
for name in sys.argv[1:] or sorted(G.VARIANTS):
    d, tw, og = tempfile.mkdtemp(), tempfile.mkdtemp(), tempfile.mkdtemp()
    dig = G.write(name, d, tw, og)
    m = T.AutoModelForCausalLM.from_pretrained(tw, dtype=torch.float32, attn_implementation="eager").eval()
    mo = T.AutoModelForCausalLM.from_pretrained(og, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(m).__name__ == G.VARIANTS[name]["arch"], type(m)
    cases, dmax, dsum, dn, agree, total = [], 0.0, 0.0, 0, 0, 0
    for ids in prompts():
        lg, greedy = run(m, ids)
        lo, greedy_o = run(mo, ids)
        n = len(ids)
        rows = []
        for p in positions(n):
            o = lg[p]
            c = [int(i) for i in np.argsort(-o, kind="stable")[:16]] + S
            srt = np.sort(o)
            rows.append({"pos": p, "ids": c, "logits": [float(o[i]) for i in c], "gap12": float(srt[-1] - srt[-2])})
            top = np.argsort(-lo[p], kind="stable")[:16]
            diff = np.abs(logsm(lg[p])[top] - logsm(lo[p])[top])
            dmax, dsum, dn = max(dmax, float(diff.max())), dsum + float(diff.sum()), dn + len(top)
        k = 0
        while k < 16 and greedy[k] == greedy_o[k]:
            k += 1
        agree, total = agree + k, total + 16
        cases.append({"prompt_ids": ids, "rows": rows, "greedy": greedy})
    acc = {"max_abs_logprob_diff_top16": dmax, "mean_abs_logprob_diff_top16": dsum / dn,
           "greedy_tokens_agreeing_before_first_divergence": agree, "greedy_tokens": total}
    inv = m.model.rotary_emb.inv_freq.tolist()
    out = {"model": name, "seed": G.VARIANTS[name]["seed"], "weights_sha256": dig,
           "reference": "f32-dequantized twin (transformers, float32, eager, CPU)",
           "transformers_version": T.__version__, "torch_version": torch.__version__,
           "numpy_version": np.__version__, "rope_inv_freq": inv,
           "rope_attention_scaling": float(m.model.rotary_emb.attention_scaling),
           "accuracy_vs_unquantized": acc, "cases": cases}
    json.dump(out, open(os.path.join(os.environ["OUT"], f"golden-{name}.json"), "w"))
    print(name, dig, acc, [c["greedy"][:4] for c in cases])
