"""gen_golden_logits: transformers reference logits for the random tiny Qwen2 test models.
Rebuilds the weights exactly as tools/gen_random_qwen2.py does (PCG64 seed, same tensor order and
scaling; the weights_sha256 digest proves it), loads them into transformers' Qwen2ForCausalLM in
float32 on the CPU (eager attention), and writes $OUT/golden-<model>.json: per prompt (token ids)
and position the reference top-16 ids plus 32 fixed ids with their logits, and the greedy
continuation (16 tokens, full forward per step).  Self-contained so it runs on a machine that has
only torch+transformers+numpy (sent there with ast.unparse + gzip).  Usage: OUT=dir python3 this"""
import hashlib, json, os
import numpy as np, torch, transformers as T

V = 151936
MODELS = [("tiny-f32", 1234, torch.float32, False), ("tiny-bf16", 4321, torch.bfloat16, True)]


def build(seed, dt, tie):
    L, h, H, kv, I = 2, 64, 4, 2, 160  # gen_random_qwen2 --shape tiny
    kd = kv * h // H
    r = np.random.Generator(np.random.PCG64(seed))
    names = [("model.embed_tokens.weight", (V, h), 0)]
    for l in range(L):
        p = f"model.layers.{l}."
        for sfx, shp, kind in [("input_layernorm", (h,), 1), ("self_attn.q_proj", (h, h), 0), ("self_attn.q_proj", (h,), 2),
                               ("self_attn.k_proj", (kd, h), 0), ("self_attn.k_proj", (kd,), 2),
                               ("self_attn.v_proj", (kd, h), 0), ("self_attn.v_proj", (kd,), 2),
                               ("self_attn.o_proj", (h, h), 0), ("post_attention_layernorm", (h,), 1),
                               ("mlp.gate_proj", (I, h), 0), ("mlp.up_proj", (I, h), 0), ("mlp.down_proj", (h, I), 0)]:
            names.append((p + sfx + (".bias" if kind == 2 else ".weight"), shp, kind))
    names.append(("model.norm.weight", (h,), 1))
    if not tie:
        names.append(("lm_head.weight", (V, h), 0))
    sd, dig = {}, hashlib.sha256()
    for k, s, t in names:
        x = r.standard_normal(s, dtype=np.float32)
        x = [x * np.float32(0.1), np.float32(1) + np.float32(0.1) * x, x * np.float32(0.1)][t]
        w = torch.from_numpy(x).to(dt)  # bf16: round to nearest even, as the generator
        dig.update(w.view(torch.int16 if dt == torch.bfloat16 else torch.int32).numpy().tobytes())
        sd[k] = w.float()
    cf = T.Qwen2Config(vocab_size=V, hidden_size=h, intermediate_size=I, num_hidden_layers=L,
                       num_attention_heads=H, num_key_value_heads=kv, max_position_embeddings=512,
                       rms_norm_eps=1e-06, rope_theta=1e6, tie_word_embeddings=tie,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cf._attn_implementation = "eager"
    m = T.Qwen2ForCausalLM(cf)
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not unexpected and all(k == "lm_head.weight" and tie for k in missing), (missing, unexpected)
    m.eval()
    inv = m.model.rotary_emb.inv_freq
    assert abs(float(inv[1]) - 1e6 ** (-2 / 16)) < 1e-6, inv  # rope_theta really 1e6
    return m, dig.hexdigest()


def prompts():
    r = np.random.Generator(np.random.PCG64(99))
    return [[151644], [151644, 872, 198, 9707, 11, 1879, 0], [int(x) for x in r.integers(0, 151643, 20)],
            [int(x) for x in r.integers(0, 151643, 200)]]


S = [int(i) for i in np.linspace(0, V - 1, 32).round()]
torch.set_num_threads(os.cpu_count() or 1)
for name, seed, dt, tie in MODELS:
    m, dig = build(seed, dt, tie)
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
    out = {"model": name, "seed": seed, "weights_sha256": dig, "transformers_version": T.__version__,
           "torch_version": torch.__version__, "numpy_version": np.__version__, "cases": cases}
    json.dump(out, open(os.path.join(os.environ["OUT"], f"golden-{name}.json"), "w"))
    print(name, dig, [c["greedy"][:4] for c in cases])
