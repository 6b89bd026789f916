#!/usr/bin/env python3
"""gen_random_fp8 — random-weight FP8 test checkpoints in the layouts vLLM loads (numpy only,
PCG64 with a fixed seed in a fixed tensor order: byte-identical files everywhere; the tests
check the printed weights_sha256 against the golden file's, tools/gen_golden_fp8.py).

Each variant draws f32 weights (normal * 0.1, norms 1 + 0.1 n) and quantizes the decoder's
linear layers to OCP e4m3 (round to nearest even, saturating at 448) with f32 scales
amax / 448 per block; embeddings, lm_head, norms and biases stay f32.

  qwen2-fp8-block-tiny     Qwen2 (q/k/v biases), hidden 192, head_dim 48, KV dim 96,
                           intermediate 320, untied lm_head; quant_method "fp8",
                           weight_block_size [128, 128] (weight_scale_inv): every matrix has
                           partial blocks in rows and columns (192 = 128 + 64, 96, 320 = 2.5 x 128)
  llama-fp8-channel-tiny   Llama 3, compressed-tensors FP8_DYNAMIC: per-channel weight_scale
                           [N, 1] stored bf16, dynamic per-token activations, lm_head ignored
  qwen3-fp8-tensor-tiny    Qwen3 (q/k norm), compressed-tensors per-tensor weight_scale [1] and
                           a static per-tensor input_scale [1] (activation scheme static)
  qwen2-fp8-block512-tiny  the block variant at hidden 512, intermediate 1024 (tied): every K a
                           multiple of 512, the shapes the CUDA W8A8 block GEMM takes (the GPU
                           test compares it with the CPU; no transformers golden)
  qwen3-fp8-ctblock-tiny   compressed-tensors strategy "block" with block_structure [128, 128] at
                           hidden 64: every scale grid has one block row or column ([1, 2],
                           [2, 1], [1, 1]); weight_scale F32 (no transformers golden: its test
                           compares it with its --twin served the same way)
  qwen2-online-tiny        an unquantized f32 Qwen2 checkpoint (hidden 192): what
                           `--quantization fp8` quantizes at load (per-channel); its --twin is
                           that quantization, done here with the same arithmetic

--twin DIR also writes the f32-dequantized twin (every FP8 matrix as e4m3 * scale in f32, no
quantization_config): transformers' reference.  --orig DIR writes the unquantized f32 model the
weights were drawn as (the accuracy baseline).
"""
import argparse
import hashlib
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_random_qwen2 import TOKENIZER_DIR, TOKENIZER_FILES, VOCAB  # noqa: E402

E4M3_MAX = np.float32(448.0)

VARIANTS = {
    "qwen2-fp8-block-tiny": dict(arch="Qwen2ForCausalLM", model_type="qwen2", hidden=192, heads=4, kv_heads=2,
                                 head_dim=48, inter=320, tie=False, bias=True, qk_norm=False, seed=2901,
                                 scheme="block", scale_dtype="F32",
                                 extra={"rope_theta": 1000000.0, "use_sliding_window": False,
                                        "sliding_window": None, "max_window_layers": 2}),
    "llama-fp8-channel-tiny": dict(arch="LlamaForCausalLM", model_type="llama", hidden=64, heads=4, kv_heads=2,
                                   head_dim=16, inter=160, tie=True, bias=False, qk_norm=False, seed=2902,
                                   scheme="channel", scale_dtype="BF16",
                                   extra={"rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False}),
    "qwen3-fp8-tensor-tiny": dict(arch="Qwen3ForCausalLM", model_type="qwen3", hidden=64, heads=4, kv_heads=2,
                                  head_dim=32, inter=160, tie=True, bias=False, qk_norm=True, seed=2903,
                                  scheme="tensor", scale_dtype="F32",
                                  extra={"rope_theta": 1000000.0, "attention_bias": False,
                                         "use_sliding_window": False, "sliding_window": None,
                                         "max_window_layers": 2}),
    "qwen2-fp8-block512-tiny": dict(arch="Qwen2ForCausalLM", model_type="qwen2", hidden=512, heads=8,
                                    kv_heads=2, head_dim=64, inter=1024, tie=True, bias=True, qk_norm=False,
                                    seed=2905, scheme="block", scale_dtype="F32",
                                    extra={"rope_theta": 1000000.0, "use_sliding_window": False,
                                           "sliding_window": None, "max_window_layers": 2}),
    "qwen3-fp8-ctblock-tiny": dict(arch="Qwen3ForCausalLM", model_type="qwen3", hidden=64, heads=4, kv_heads=2,
                                   head_dim=32, inter=160, tie=True, bias=False, qk_norm=True, seed=2906,
                                   scheme="ctblock", scale_dtype="F32",
                                   extra={"rope_theta": 1000000.0, "attention_bias": False,
                                          "use_sliding_window": False, "sliding_window": None,
                                          "max_window_layers": 2}),
    "qwen2-online-tiny": dict(arch="Qwen2ForCausalLM", model_type="qwen2", hidden=192, heads=4, kv_heads=2,
                              head_dim=48, inter=320, tie=False, bias=True, qk_norm=False, seed=2904,
                              scheme="online", scale_dtype="F32",
                              extra={"rope_theta": 1000000.0, "use_sliding_window": False,
                                     "sliding_window": None, "max_window_layers": 2}),
}


def f32_to_e4m3(x):
    """f32 array -> uint8 e4m3fn codes: round to nearest even, saturate at +-448 (as
    src/model/quant.c quant_f32_to_e4m3)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    sign = ((u >> 24) & 0x80).astype(np.uint8)
    a = u & np.uint32(0x7FFFFFFF)
    out = np.zeros(x.shape, dtype=np.uint8)
    sat = a >= 0x43E00000
    sub = a < 0x3C800000
    nrm = ~sat & ~sub
    af = a.view(np.float32)
    out[sub] = np.rint(af[sub] * np.float32(512.0)).astype(np.uint8)
    r = (a[nrm].astype(np.uint64) + 0x7FFFF + ((a[nrm].astype(np.uint64) >> 20) & 1))
    e = (r >> 23).astype(np.int64) - 127 + 7
    m = ((r >> 20) & 7).astype(np.int64)
    out[nrm] = np.minimum((e << 3) | m, 0x7E).astype(np.uint8)
    out[sat] = 0x7E
    return out | sign


def e4m3_table():
    t = np.zeros(256, dtype=np.float32)
    for i in range(256):
        e, m = (i >> 3) & 15, i & 7
        v = np.ldexp(1.0 + m / 8.0, e - 7) if e else np.ldexp(m / 8.0, -6)
        if e == 15 and m == 7:
            v = np.nan
        t[i] = -v if i & 0x80 else v
    return t


E4M3 = e4m3_table()


def quantize(w, bn, bk):
    """(codes uint8 (N, K), scales f32 grid) with one scale amax / 448 per bn x bk block."""
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    q = np.zeros((n, k), dtype=np.uint8)
    s = np.zeros((gn, gk), dtype=np.float32)
    for i in range(gn):
        for j in range(gk):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            amax = np.float32(np.abs(blk).max())
            sc = amax / E4M3_MAX if amax > 0 else np.float32(1.0)
            s[i, j] = sc
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = f32_to_e4m3(blk / sc)
    return q, s


def dequantize(q, s, bn, bk):
    w = E4M3[q]
    rs = np.repeat(np.repeat(s, bn, axis=0)[:w.shape[0]], bk, axis=1)[:, :w.shape[1]]
    return (w * rs).astype(np.float32)


def bf16_round(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def tensor_list(v):
    h, hd, inter = v["hidden"], v["head_dim"], v["inter"]
    qd, kvd = v["heads"] * hd, v["kv_heads"] * hd
    out = [("model.embed_tokens.weight", (VOCAB, h), "e")]
    for l in range(2):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (h,), "n"),
                (p + "self_attn.q_proj.weight", (qd, h), "w"),
                (p + "self_attn.k_proj.weight", (kvd, h), "w"),
                (p + "self_attn.v_proj.weight", (kvd, h), "w")]
        if v["bias"]:
            out += [(p + "self_attn.q_proj.bias", (qd,), "b"), (p + "self_attn.k_proj.bias", (kvd,), "b"),
                    (p + "self_attn.v_proj.bias", (kvd,), "b")]
        if v["qk_norm"]:
            out += [(p + "self_attn.q_norm.weight", (hd,), "n"), (p + "self_attn.k_norm.weight", (hd,), "n")]
        out += [(p + "self_attn.o_proj.weight", (h, qd), "w"),
                (p + "post_attention_layernorm.weight", (h,), "n"),
                (p + "mlp.gate_proj.weight", (inter, h), "w"),
                (p + "mlp.up_proj.weight", (inter, h), "w"),
                (p + "mlp.down_proj.weight", (h, inter), "w")]
    out.append(("model.norm.weight", (h,), "n"))
    if not v["tie"]:
        out.append(("lm_head.weight", (VOCAB, h), "e"))
    return out


ST = {"F32": ("F32", lambda a: np.ascontiguousarray(a, "<f4").tobytes()),
      "BF16": ("BF16", lambda a: (np.ascontiguousarray(bf16_round(a)).view(np.uint32) >> 16).astype("<u2").tobytes()),
      "F8_E4M3": ("F8_E4M3", lambda a: np.ascontiguousarray(a, np.uint8).tobytes())}


def write_st(path, items):
    """items: (name, dtype, array, shape)."""
    header, blobs, off = {}, [], 0
    for name, dt, arr, shape in items:
        b = ST[dt][1](arr)
        header[name] = {"dtype": ST[dt][0], "shape": list(shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt"}
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for b in blobs:
            f.write(b)
    d = hashlib.sha256()
    for b in blobs:
        d.update(b)
    return d.hexdigest()


def quant_config(v):
    if v["scheme"] == "ctblock":
        w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
             "strategy": "block", "block_structure": [128, 128], "observer": "minmax"}
        ia = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group",
              "group_size": 128}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": ia}},
                "ignore": ["lm_head"], "kv_cache_scheme": None}
    if v["scheme"] == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
         "strategy": v["scheme"], "block_structure": None, "observer": "minmax"}
    ia = ({"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
          if v["scheme"] == "channel" else
          {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"})
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": ia}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def blocks(v, shape):
    s = v["scheme"]
    return (128, 128) if s in ("block", "ctblock") else (1, shape[1]) if s in ("channel", "online") else shape


def write_config(v, d, qc):
    os.makedirs(d, exist_ok=True)
    cfg = {"architectures": [v["arch"]], "model_type": v["model_type"], "bos_token_id": 151643,
           "eos_token_id": 151645, "hidden_act": "silu", "initializer_range": 0.1, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": v["tie"], "use_cache": True, "vocab_size": VOCAB, "head_dim": v["head_dim"],
           "torch_dtype": "float32", "transformers_version": "4.51.0", "num_hidden_layers": 2,
           "hidden_size": v["hidden"], "num_attention_heads": v["heads"], "num_key_value_heads": v["kv_heads"],
           "intermediate_size": v["inter"], "max_position_embeddings": 512, **v["extra"]}
    if qc:
        cfg["quantization_config"] = qc
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 151643, "eos_token_id": [151645, 151643]}, f, indent=2)
    for fn in TOKENIZER_FILES:
        src = os.path.join(TOKENIZER_DIR, fn)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(d, fn))


def write(variant, out_dir, twin_dir=None, orig_dir=None):
    """Writes the checkpoint (and the twin / original); returns the sha256 of its tensor bytes."""
    v = VARIANTS[variant]
    rng = np.random.Generator(np.random.PCG64(v["seed"]))
    items, twin, orig = [], [], []
    for name, shape, kind in tensor_list(v):
        x = rng.standard_normal(shape, dtype=np.float32)
        x = np.float32(1.0) + np.float32(0.1) * x if kind == "n" else x * np.float32(0.1)
        orig.append((name, "F32", x, shape))
        if kind != "w":
            items.append((name, "F32", x, shape))
            twin.append((name, "F32", x, shape))
            continue
        bn, bk = blocks(v, shape)
        q, s = quantize(x, bn, bk)
        if v["scheme"] != "online":
            base = name[:-len("weight")]
            items.append((name, "F8_E4M3", q, shape))
            if v["scheme"] == "block":
                items.append((base + "weight_scale_inv", "F32", s, s.shape))
            elif v["scheme"] == "ctblock":
                items.append((base + "weight_scale", "F32", s, s.shape))
            elif v["scheme"] == "channel":
                s = bf16_round(s)  # stored bf16: the twin uses the stored value
                items.append((base + "weight_scale", "BF16", s, (shape[0], 1)))
            else:
                items.append((base + "weight_scale", "F32", s.reshape(1), (1,)))
                items.append((base + "input_scale", "F32", np.array([0.05], np.float32), (1,)))
        else:
            items.append((name, "F32", x, shape))
        twin.append((name, "F32", dequantize(q, s, bn, bk), shape))
    write_config(v, out_dir, None if v["scheme"] == "online" else quant_config(v))
    dig = write_st(os.path.join(out_dir, "model.safetensors"), items)
    if twin_dir:
        write_config(v, twin_dir, None)
        write_st(os.path.join(twin_dir, "model.safetensors"), twin)
    if orig_dir:
        write_config(v, orig_dir, None)
        write_st(os.path.join(orig_dir, "model.safetensors"), orig)
    return dig


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    ap.add_argument("--twin", help="also write the f32-dequantized twin here")
    ap.add_argument("--orig", help="also write the unquantized f32 original here")
    a = ap.parse_args()
    print(f"weights_sha256 {write(a.variant, a.out, a.twin, a.orig)}")


if __name__ == "__main__":
    main()
