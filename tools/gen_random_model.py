#!/usr/bin/env python3
"""gen_random_model — random-weight test checkpoints of the architectures beside Qwen2, each with
its quirks switched on, in Hugging Face format (config.json, generation_config.json,
model.safetensors, the Qwen2.5 tokenizer files).  Like tools/gen_random_qwen2.py (whose helpers
it uses): numpy only, PCG64 with a fixed seed in a fixed tensor order, so the same arguments give
byte-identical files everywhere and tests check the printed weights_sha256 against the golden
file's (tools/gen_golden_arch.py).

Variants (all: 2 layers, hidden 64, 4 heads, 2 KV heads, intermediate 160, f32 weights):
  llama-tiny    LlamaForCausalLM: no biases, tied embeddings, rope_scaling llama3 (factor 8,
                low/high_freq_factor 1/4, original_max_position_embeddings 64: every band used)
  qwen3-tiny    Qwen3ForCausalLM: q_norm/k_norm, head_dim 32 != 64/4, tied, rope_scaling yarn
                (factor 4, original_max_position_embeddings 128)
  mistral-tiny  MistralForCausalLM: sliding_window 8 (shorter than the test prompts), head_dim
                24, untied lm_head, rope_scaling linear (factor 2)
  qwen3moe-tiny Qwen3MoeForCausalLM: 3 layers, layer 1 dense (mlp_only_layers [1],
                intermediate 160), layers 0 and 2 sparse: 8 experts of moe_intermediate_size
                32, top 2, norm_topk_prob true; q/k norm, no head_dim in config.json (so
                hidden / heads = 16, not Qwen3's 128), untied
  mixtral-tiny  MixtralForCausalLM: 4 experts of intermediate_size 48, top 2 (always
                renormalised), sliding_window 8, head_dim 16, untied
The experts are written per expert, as the Hub ships them and as transformers 5's
save_pretrained writes them (Qwen3-MoE: mlp.gate, mlp.experts.E.{gate,up,down}_proj; Mixtral:
block_sparse_moe.gate, block_sparse_moe.experts.E.{w1,w3,w2}).
"""
import argparse
import hashlib
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_random_qwen2 import TOKENIZER_DIR, TOKENIZER_FILES, VOCAB, to_bytes, write_safetensors  # noqa: E402

BASE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=160, max_position_embeddings=512)
VARIANTS = {
    "llama-tiny": dict(arch="LlamaForCausalLM", model_type="llama", head_dim=16, tie=True, seed=2718,
                       extra={"rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False,
                              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64}}),
    "qwen3-tiny": dict(arch="Qwen3ForCausalLM", model_type="qwen3", head_dim=32, tie=True, seed=3141,
                       extra={"rope_theta": 1000000.0, "attention_bias": False, "use_sliding_window": False,
                              "sliding_window": None, "max_window_layers": 2,
                              "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 128}}),
    # Llama with as many KV heads as query heads (4): TP 4 splits them instead of replicating
    "llama-kv4-tiny": dict(arch="LlamaForCausalLM", model_type="llama", head_dim=16, tie=True, seed=4242,
                           extra={"rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False,
                                  "num_key_value_heads": 4}),
    "mistral-tiny": dict(arch="MistralForCausalLM", model_type="mistral", head_dim=24, tie=False, seed=1618,
                         extra={"rope_theta": 10000.0, "sliding_window": 8,
                                "rope_scaling": {"type": "linear", "factor": 2.0}}),
    "qwen3moe-tiny": dict(arch="Qwen3MoeForCausalLM", model_type="qwen3_moe", head_dim=None, tie=False, seed=2207,
                          layers=3, experts=8, moe_inter=32,
                          extra={"rope_theta": 1000000.0, "attention_bias": False, "use_sliding_window": False,
                                 "sliding_window": None, "num_experts": 8, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
                                 "mlp_only_layers": [1], "router_aux_loss_coef": 0.001,
                                 "output_router_logits": False}),
    "mixtral-tiny": dict(arch="MixtralForCausalLM", model_type="mixtral", head_dim=16, tie=False, seed=8087,
                         experts=4, moe_inter=48,
                         extra={"rope_theta": 1000000.0, "sliding_window": 8, "num_local_experts": 4,
                                "num_experts_per_tok": 2, "intermediate_size": 48, "router_jitter_noise": 0.0,
                                "router_aux_loss_coef": 0.02, "output_router_logits": False}),
}


def moe_layer(v, l):
    """transformers' rule: sparse unless in mlp_only_layers, every decoder_sparse_step-th layer"""
    e = v.get("extra", {})
    return v.get("experts", 0) > 0 and l not in e.get("mlp_only_layers", []) and \
        (l + 1) % e.get("decoder_sparse_step", 1) == 0


def tensor_list(v):
    """(name, shape, kind) in the fixed generation order. kind: w (normal*0.1), n (1+0.1n)."""
    c = {**BASE, "num_hidden_layers": v.get("layers", BASE["num_hidden_layers"]),
         "num_key_value_heads": v["extra"].get("num_key_value_heads", BASE["num_key_value_heads"])}
    h, inter = c["hidden_size"], c["intermediate_size"]
    hd = v["head_dim"] or h // c["num_attention_heads"]
    qd, kvd = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (VOCAB, h), "w")]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (h,), "n"),
                (p + "self_attn.q_proj.weight", (qd, h), "w"),
                (p + "self_attn.k_proj.weight", (kvd, h), "w"),
                (p + "self_attn.v_proj.weight", (kvd, h), "w")]
        if v["model_type"] in ("qwen3", "qwen3_moe"):
            out += [(p + "self_attn.q_norm.weight", (hd,), "n"), (p + "self_attn.k_norm.weight", (hd,), "n")]
        out += [(p + "self_attn.o_proj.weight", (h, qd), "w"),
                (p + "post_attention_layernorm.weight", (h,), "n")]
        if moe_layer(v, l):
            E, mi = v["experts"], v["moe_inter"]
            mix = v["model_type"] == "mixtral"
            b = p + ("block_sparse_moe." if mix else "mlp.")
            names = ("w1", "w3", "w2") if mix else ("gate_proj", "up_proj", "down_proj")
            out.append((b + "gate.weight", (E, h), "w"))
            for e in range(E):
                out += [(f"{b}experts.{e}.{names[0]}.weight", (mi, h), "w"),
                        (f"{b}experts.{e}.{names[1]}.weight", (mi, h), "w"),
                        (f"{b}experts.{e}.{names[2]}.weight", (h, mi), "w")]
            continue
        out += [(p + "mlp.gate_proj.weight", (inter, h), "w"),
                (p + "mlp.up_proj.weight", (inter, h), "w"),
                (p + "mlp.down_proj.weight", (h, inter), "w")]
    out.append(("model.norm.weight", (h,), "n"))
    if not v["tie"]:
        out.append(("lm_head.weight", (VOCAB, h), "w"))
    return out


def write(variant, out_dir, tokenizer_dir=TOKENIZER_DIR):
    """Writes the checkpoint; returns the weights' sha256 (over the f32 bytes in order)."""
    v = VARIANTS[variant]
    rng = np.random.Generator(np.random.PCG64(v["seed"]))
    os.makedirs(out_dir, exist_ok=True)
    items, digest = [], hashlib.sha256()
    for name, shape, kind in tensor_list(v):
        x = rng.standard_normal(shape, dtype=np.float32)
        x = x * np.float32(0.1) if kind == "w" else np.float32(1.0) + np.float32(0.1) * x
        items.append((name, to_bytes(x, "f32"), shape))
        digest.update(items[-1][1])
    write_safetensors(os.path.join(out_dir, "model.safetensors"), items, "f32")
    cfg = {"architectures": [v["arch"]], "model_type": v["model_type"], "bos_token_id": 151643,
           "eos_token_id": 151645, "hidden_act": "silu", "initializer_range": 0.1, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": v["tie"], "use_cache": True, "vocab_size": VOCAB,
           "torch_dtype": "float32", "transformers_version": "4.51.0",
           **BASE, "num_hidden_layers": v.get("layers", BASE["num_hidden_layers"]), **v["extra"]}
    if v["head_dim"]:
        cfg["head_dim"] = v["head_dim"]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 151643, "eos_token_id": [151645, 151643]}, f, indent=2)
    for fn in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, fn)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out_dir, fn))
    return digest.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    ap.add_argument("--tokenizer-dir", default=TOKENIZER_DIR)
    a = ap.parse_args()
    print(f"weights_sha256 {write(a.variant, a.out, a.tokenizer_dir)}")


if __name__ == "__main__":
    main()
