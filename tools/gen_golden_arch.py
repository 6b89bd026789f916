"""gen_golden_arch: transformers reference logits for the random tiny Llama / Qwen3 / Mistral /
Qwen3-MoE / Mixtral test models of tools/gen_random_model.py (the MoE ones with transformers'
eager loop over experts, experts_implementation="eager").  Writes each checkpoint with that script, loads it with
transformers' AutoModelForCausalLM.from_pretrained (so config.json is read as transformers reads
it: rope_scaling, head_dim, sliding_window, tying) in float32 on the CPU with eager attention, and
writes $OUT/golden-<variant>.json in tools/gen_golden_logits.py's format (per prompt and position
the reference top-16 ids plus 32 fixed ids with their logits, the 16-token greedy continuation).
Usage: OUT=dir python3 tools/gen_golden_arch.py [variant ...]"""
import json, os, sys, tempfile
import numpy as np, torch, transformers as T

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_random_model as G  # noqa: E402

V = G.VOCAB
S = [int(i) for i in np.linspace(0, V - 1, 32).round()]


def prompts():  # as gen_golden_logits.py's
    r = np.random.Generator(np.random.PCG64(99))
    return [[151644], [151644, 872, 198, 9707, 11, 1879, 0], [int(x) for x in r.integers(0, 151643, 20)],
            [int(x) for x in r.integers(0, 151643, 200)]]


torch.set_num_threads(os.cpu_count() or 1)
for name in sys.argv[1:] or sorted(G.VARIANTS):
    d = tempfile.mkdtemp()
    dig = G.write(name, d)
    kw = {"experts_implementation": "eager"} if G.VARIANTS[name].get("experts") else {}
    m = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager",
                                             output_loading_info=True, **kw)
    m, info = m
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    m.eval()
    assert type(m).__name__ == G.VARIANTS[name]["arch"], type(m)
    if G.VARIANTS[name].get("experts"):
        assert m.config._experts_implementation == "eager", m.config._experts_implementation
    cases = []
    for ids in prompts():
        with torch.no_grad():
            lg = m(torch.tensor([ids])).logits[0].numpy()
            q = list(ids)
            for _ in range(16):
                q.append(int(m(torch.tensor([q])).logits[0, -1].argmax()))
        n = len(ids)
        rows = []
        for p in (range(n) if n <= 20 else sorted(set(range(0, n, 8)) | {n - 1})):
            o = lg[p]
            c = [int(i) for i in np.argsort(-o, kind="stable")[:16]] + S
            srt = np.sort(o)
            rows.append({"pos": p, "ids": c, "logits": [float(o[i]) for i in c], "gap12": float(srt[-1] - srt[-2])})
        cases.append({"prompt_ids": ids, "rows": rows, "greedy": q[n:]})
    inv = m.model.rotary_emb.inv_freq.tolist()
    out = {"model": name, "seed": G.VARIANTS[name]["seed"], "weights_sha256": dig,
           "transformers_version": T.__version__, "torch_version": torch.__version__,
           "numpy_version": np.__version__, "rope_inv_freq": inv,
           "rope_attention_scaling": float(m.model.rotary_emb.attention_scaling), "cases": cases}
    json.dump(out, open(os.path.join(os.environ["OUT"], f"golden-{name}.json"), "w"))
    print(name, dig, [c["greedy"][:4] for c in cases])
