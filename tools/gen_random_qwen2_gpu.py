#!/usr/bin/env python3
"""gen_random_qwen2_gpu — a random-weight bf16 Qwen2 checkpoint of a large shape, made with
torch on the GPU (fast: numpy would take minutes for 7.6 B parameters), for
`disagg bench model DIR --device cuda`.  Writes DIR/config.json (transformers 4.x
spelling), generation_config.json and model-0000N-of-0000M.safetensors shards with
model.safetensors.index.json, and the real Qwen2.5 tokenizer (tokenizer.json and
tokenizer_config.json from --tokenizer, default shared/data/qwen2.5-tokenizer beside or
inside the checkout) so that `disagg serve DIR` runs it (`disagg bench serve`).

Shapes: 7b = Qwen2.5-7B (hidden 3584, 28 layers, 28 q heads, 4 kv heads, intermediate 18944,
vocab 152064, untied: 7.62 B parameters, 15.2 GB); 0.5b = Qwen2.5-0.5B.
Usage: python3 tools/gen_random_qwen2_gpu.py --out /dev/shm/q7b --shape 7b"""
import argparse, json, os, shutil, sys, time
import torch
from safetensors.torch import save_file

SHAPES = {
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
}
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--shape", default="7b", choices=SHAPES)
ap.add_argument("--layers-per-shard", type=int, default=4)
HERE = os.path.dirname(os.path.abspath(__file__))
TOK_DEFAULT = [os.path.join(HERE, "..", "shared", "data", "qwen2.5-tokenizer"),
               os.path.join(HERE, "..", "..", "shared", "data", "qwen2.5-tokenizer")]
ap.add_argument("--tokenizer", default=None,
                help="folder with the Qwen2.5 tokenizer.json and tokenizer_config.json "
                     "(default: shared/data/qwen2.5-tokenizer in or beside the checkout)")
a = ap.parse_args()
tok_dir = a.tokenizer or next((d for d in TOK_DEFAULT if os.path.isfile(os.path.join(d, "tokenizer.json"))), None)
if not tok_dir or not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
    sys.exit("gen_random_qwen2_gpu: no Qwen2.5 tokenizer found (%s); give --tokenizer DIR"
             % (a.tokenizer or " or ".join(TOK_DEFAULT)))
s = SHAPES[a.shape]
os.makedirs(a.out, exist_ok=True)
cfg = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
           max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
           torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645, use_cache=True, **s)
json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=1)
json.dump({"bos_token_id": 151643, "eos_token_id": [151645, 151643]},
          open(os.path.join(a.out, "generation_config.json"), "w"))
h, L, H, kv, I, V = (s[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "intermediate_size", "vocab_size"))
kd = kv * h // H
g = torch.Generator(device="cuda").manual_seed(1234)


def rnd(*shape, std=0.02):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32, generator=g) * std).to(torch.bfloat16).cpu()


def ones(n):
    return (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16).cpu()


# ids the tokenizer has (151665 for Qwen2.5: the rest of the 152064 rows are padding): the
# lm_head rows beyond are zero, so a random model never emits an id that cannot be
# detokenized (its largest logit over 151k random ones is positive)
tj = json.load(open(os.path.join(tok_dir, "tokenizer.json")))
n_tok = max([max(tj["model"]["vocab"].values())] + [t["id"] for t in tj.get("added_tokens", [])]) + 1
groups = [list(range(i, min(L, i + a.layers_per_shard))) for i in range(0, L, a.layers_per_shard)]
n_sh = len(groups) + 1
wmap, total, t0 = {}, 0, time.time()
for si in range(n_sh):
    sd = {}
    if si == 0:
        sd["model.embed_tokens.weight"] = rnd(V, h)
        sd["model.norm.weight"] = ones(h)
        if not s["tie_word_embeddings"]:
            lm = rnd(V, h)
            lm[n_tok:] = 0
            sd["lm_head.weight"] = lm
    else:
        for l in groups[si - 1]:
            p = f"model.layers.{l}."
            sd[p + "input_layernorm.weight"] = ones(h)
            sd[p + "post_attention_layernorm.weight"] = ones(h)
            sd[p + "self_attn.q_proj.weight"] = rnd(h, h)
            sd[p + "self_attn.q_proj.bias"] = rnd(h, std=0.1)
            sd[p + "self_attn.k_proj.weight"] = rnd(kd, h)
            sd[p + "self_attn.k_proj.bias"] = rnd(kd, std=0.1)
            sd[p + "self_attn.v_proj.weight"] = rnd(kd, h)
            sd[p + "self_attn.v_proj.bias"] = rnd(kd, std=0.1)
            sd[p + "self_attn.o_proj.weight"] = rnd(h, h)
            sd[p + "mlp.gate_proj.weight"] = rnd(I, h)
            sd[p + "mlp.up_proj.weight"] = rnd(I, h)
            sd[p + "mlp.down_proj.weight"] = rnd(h, I)
    fn = "model-%05d-of-%05d.safetensors" % (si + 1, n_sh)
    save_file(sd, os.path.join(a.out, fn), metadata={"format": "pt"})
    for k, v in sd.items():
        wmap[k] = fn
        total += v.numel() * 2
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(tok_dir, f), os.path.join(a.out, f))
json.dump({"metadata": {"total_size": total}, "weight_map": wmap},
          open(os.path.join(a.out, "model.safetensors.index.json"), "w"))
print("gen_random_qwen2_gpu: %s shape %s, %.2f GB of bf16 in %d shards, %.1f s"
      % (a.out, a.shape, total / 1e9, n_sh, time.time() - t0))
