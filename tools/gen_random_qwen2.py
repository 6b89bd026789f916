#!/usr/bin/env python3
"""gen_random_qwen2 — writes a random-weight Qwen2 model in Hugging Face format.

Output directory: config.json (transformers 4.x spelling, or 5.x with --config-style 5),
generation_config.json, model.safetensors (or shards + model.safetensors.index.json with
--shard-mb), and the Qwen2.5 tokenizer files copied from shared/data/qwen2.5-tokenizer.

Needs only numpy (no torch, no safetensors package): the safetensors container is written
by hand, so CI can regenerate the test models.  Weights come from numpy's PCG64 with a
fixed seed in a fixed tensor order, so the same arguments give byte-identical files on
every platform (tests compare the sha256 recorded beside the golden logits).

Shapes:
  tiny  2 layers, hidden 64, 4 heads, 2 KV heads, intermediate 160 (unit tests, golden logits)
  0.5b  24 layers, hidden 896, 14 heads, 2 KV heads, intermediate 4864, tied (benchmarks)
"""
import argparse
import hashlib
import json
import os
import shutil
import struct
import sys

import numpy as np

SHAPES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=160, max_position_embeddings=512,
                 std=0.1),
    "0.5b": dict(num_hidden_layers=24, hidden_size=896, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=32768,
                 std=0.02),
}
VOCAB = 151936
DTYPES = {"bf16": ("BF16", "bfloat16", 2), "f16": ("F16", "float16", 2), "f32": ("F32", "float32", 4)}
HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "..", "..", "shared", "data", "qwen2.5-tokenizer")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]


def to_bytes(a, dtype):
    """f32 array -> little-endian bytes of the requested dtype (bf16: round to nearest even)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "f32":
        return a.astype("<f4").tobytes()
    if dtype == "f16":
        return a.astype("<f2").tobytes()
    u = a.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype("<u2").tobytes()


def tensor_list(c, tie):
    """(name, shape, kind) in the fixed generation order. kind: w (normal*std), n (1+0.1n), b (bias)."""
    h, kvd = c["hidden_size"], c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"])
    inter = c["intermediate_size"]
    out = [("model.embed_tokens.weight", (VOCAB, h), "w")]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out += [
            (p + "input_layernorm.weight", (h,), "n"),
            (p + "self_attn.q_proj.weight", (h, h), "w"),
            (p + "self_attn.q_proj.bias", (h,), "b"),
            (p + "self_attn.k_proj.weight", (kvd, h), "w"),
            (p + "self_attn.k_proj.bias", (kvd,), "b"),
            (p + "self_attn.v_proj.weight", (kvd, h), "w"),
            (p + "self_attn.v_proj.bias", (kvd,), "b"),
            (p + "self_attn.o_proj.weight", (h, h), "w"),
            (p + "post_attention_layernorm.weight", (h,), "n"),
            (p + "mlp.gate_proj.weight", (inter, h), "w"),
            (p + "mlp.up_proj.weight", (inter, h), "w"),
            (p + "mlp.down_proj.weight", (h, inter), "w"),
        ]
    out.append(("model.norm.weight", (h,), "n"))
    if not tie:
        out.append(("lm_head.weight", (VOCAB, h), "w"))
    return out


def write_safetensors(path, items, dtype):
    """items: list of (name, bytes, shape). Writes the safetensors container by hand."""
    st_dtype = DTYPES[dtype][0]
    header, off = {}, 0
    for name, data, shape in items:
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    header["__metadata__"] = {"format": "pt"}
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for _, data, _ in items:
            f.write(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--untied", action="store_true", help="separate lm_head.weight (default: tied)")
    ap.add_argument("--config-style", choices=["4", "5"], default="4",
                    help="transformers 4.x (rope_theta, torch_dtype) or 5.x (rope_parameters, dtype)")
    ap.add_argument("--shard-mb", type=int, default=0, help="split into shards of about this size")
    ap.add_argument("--tokenizer-dir", default=TOKENIZER_DIR)
    a = ap.parse_args()

    c = dict(SHAPES[a.shape])
    std = c.pop("std")
    tie = not a.untied
    rng = np.random.Generator(np.random.PCG64(a.seed))
    os.makedirs(a.out, exist_ok=True)

    items = []
    digest = hashlib.sha256()  # over the tensors' bytes in generation order (gen_golden_logits checks it)
    for name, shape, kind in tensor_list(c, tie):
        x = rng.standard_normal(shape, dtype=np.float32)
        if kind == "w":
            x *= np.float32(std)
        elif kind == "n":
            x = np.float32(1.0) + np.float32(0.1) * x
        else:
            x *= np.float32(0.1)
        items.append((name, to_bytes(x, a.dtype), shape))
        digest.update(items[-1][1])

    for f in os.listdir(a.out):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(a.out, f))
    if a.shard_mb <= 0:
        write_safetensors(os.path.join(a.out, "model.safetensors"), items, a.dtype)
    else:
        shards, cur, size = [], [], 0
        for it in items:
            if cur and size + len(it[1]) > a.shard_mb << 20:
                shards.append(cur)
                cur, size = [], 0
            cur.append(it)
            size += len(it[1])
        shards.append(cur)
        wmap = {}
        for i, sh in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(a.out, fn), sh, a.dtype)
            for name, _, _ in sh:
                wmap[name] = fn
        total = sum(len(d) for _, d, _ in items)
        with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2)

    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "initializer_range": std,
        "rms_norm_eps": 1e-6,
        "sliding_window": c["max_position_embeddings"],
        "use_sliding_window": False,
        "max_window_layers": c["num_hidden_layers"],
        "tie_word_embeddings": tie,
        "use_cache": True,
        "vocab_size": VOCAB,
        **c,
    }
    if a.config_style == "4":
        cfg["rope_theta"] = 1000000.0
        cfg["rope_scaling"] = None
        cfg["torch_dtype"] = DTYPES[a.dtype][1]
        cfg["transformers_version"] = "4.45.0"
    else:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
        cfg["dtype"] = DTYPES[a.dtype][1]
        cfg["layer_types"] = ["full_attention"] * c["num_hidden_layers"]
        cfg["transformers_version"] = "5.0.0"
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": True,
                   "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}, f, indent=2)
    for fn in TOKENIZER_FILES:
        src = os.path.join(a.tokenizer_dir, fn)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(a.out, fn))
        else:
            print(f"gen_random_qwen2: warning: {src} not found; no tokenizer files", file=sys.stderr)

    print(f"weights_sha256 {digest.hexdigest()}")


if __name__ == "__main__":
    main()
