"""A Qwen2 model in Hugging Face format whose greedy output is a Hermes tool call, for the
end-to-end tool-call tests: the tokenizer of models/disagg-sotu-tiny plus three added
(non-special) tokens -- "<tool_call>", the call's JSON, "</tool_call>" -- and weights that
make the model a bigram chain: its one layer is all zeros (the residual stream is the token
embedding), every ordinary token's embedding points at "<tool_call>", "<tool_call>" at the
JSON, the JSON at "</tool_call>" and "</tool_call>" at <|im_end|> (eos).  So any prompt
continues with  <tool_call>{...}</tool_call>  and stops.  float32, written by hand
(safetensors container), numpy only."""
import json
import shutil
import struct

import numpy as np

from server_harness import MODEL

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
H, INTER = 64, 64


def write_safetensors(path, tensors):
    header, off, blobs = {}, 0, []
    for name, a in tensors:
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    header["__metadata__"] = {"format": "pt"}
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


def build(out, chain=None, special=()):
    """Writes the model into directory out (a pathlib.Path); returns the call it emits.  chain:
    other texts to emit instead, one added token each (e.g. ["<think>", "...", "</think>", ...]);
    those in special are special tokens (dropped by skip_special_tokens, as Mistral's
    [TOOL_CALLS] and Llama's <|python_tag|>)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = json.loads((MODEL / "tokenizer.json").read_text())
    base = max(t["id"] for t in tok["added_tokens"]) + 1  # 4096
    eos = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_end|>")
    chain = chain or ["<tool_call>", json.dumps(CALL), "</tool_call>"]
    for i, content in enumerate(chain):
        tok["added_tokens"].append({"id": base + i, "content": content, "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": content in special})
    (out / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copy(MODEL / "tokenizer_config.json", out / "tokenizer_config.json")
    vocab = base + len(chain)
    cfg = json.loads((MODEL / "config.json").read_text())
    cfg.update(num_hidden_layers=1, hidden_size=H, intermediate_size=INTER, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=False, dtype="float32",
               layer_types=["full_attention"], max_position_embeddings=1024)
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    # slot 0: "say <tool_call>"; slot 1+i: chain token i says the next one
    emb = np.zeros((vocab, H), np.float32)
    emb[:, 0] = 1.0
    lm = np.zeros((vocab, H), np.float32)
    lm[base, 0] = 1.0
    for i in range(len(chain)):
        emb[base + i] = 0.0
        emb[base + i, 1 + i] = 1.0
        nxt = base + i + 1 if i + 1 < len(chain) else eos
        lm[nxt, 1 + i] = 1.0
    kvd = 2 * (H // 4)
    z = np.zeros
    p = "model.layers.0."
    write_safetensors(out / "model.safetensors", [
        ("model.embed_tokens.weight", emb),
        (p + "input_layernorm.weight", np.ones(H, np.float32)),
        (p + "self_attn.q_proj.weight", z((H, H))), (p + "self_attn.q_proj.bias", z(H)),
        (p + "self_attn.k_proj.weight", z((kvd, H))), (p + "self_attn.k_proj.bias", z(kvd)),
        (p + "self_attn.v_proj.weight", z((kvd, H))), (p + "self_attn.v_proj.bias", z(kvd)),
        (p + "self_attn.o_proj.weight", z((H, H))),
        (p + "post_attention_layernorm.weight", np.ones(H, np.float32)),
        (p + "mlp.gate_proj.weight", z((INTER, H))), (p + "mlp.up_proj.weight", z((INTER, H))),
        (p + "mlp.down_proj.weight", z((H, INTER))),
        ("model.norm.weight", np.ones(H, np.float32)),
        ("lm_head.weight", lm),
    ])
    return CALL
