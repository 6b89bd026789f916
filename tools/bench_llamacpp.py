#!/usr/bin/env python3
"""bench_llamacpp — disagg's CPU engine side by side with llama.cpp, alternated runs.

Fetches nothing.  llama.cpp is not vendored here: build it yourself (docs/benchmarks.md,
"CPU engine against llama.cpp", says how it was built for the tables there), then:

  # 1. the same weights as a GGUF file (bf16 matrices, f32 norms and biases), written with
  #    llama.cpp's own gguf-py (pure numpy; its convert_hf_to_gguf.py needs torch)
  tools/bench_llamacpp.py convert MODEL_DIR OUT.gguf --gguf-py LLAMA_CPP/gguf-py

  # 2. rounds of: disagg bench model, llama-bench, llama-batched-bench, one after the other,
  #    so each pair of numbers comes from the same minutes; medians and ratios
  tools/bench_llamacpp.py compare MODEL_DIR OUT.gguf --disagg build/disagg \
      --llama-bin LLAMA_CPP/build-native/bin --threads 2 --rounds 3

  # 3. serving: `disagg serve` and `llama-server` (8 slots) each under `disagg bench serve`
  #    (8 clients, 64-word prompts, 64 tokens out, --ignore-eos), alternated rounds
  tools/bench_llamacpp.py serve MODEL_DIR OUT.gguf --disagg build/disagg \
      --llama-bin LLAMA_CPP/build-native/bin --threads 2 --rounds 3

Figures: prefill pp512; decode at an empty context (tg64 after no prompt); decode after
512 tokens (llama-bench -d 512 / disagg --prompt-len 512); aggregate decode of 8 streams
against 1 stream (llama-batched-bench -npp 32 -ntg 16 -npl 1,8 / disagg --streams 8 with
32-token prompts).  The machine is shared: every figure is a median over rounds, and each
ratio is taken within a round, never a single timing.
"""
import argparse
import json
import os
import re
import statistics
import struct
import subprocess
import sys

import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))
from ports import free_port  # noqa: E402  (ports outside the ephemeral range, never twice)


# ---- convert ------------------------------------------------------------------------------

def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        dt = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[info["dtype"]]
        out[name] = (info["dtype"], np.frombuffer(data[b:e], dtype=dt).reshape(info["shape"]))
    return out


def bf16_to_f32(a):
    return (a.astype(np.uint32) << 16).view(np.float32)


def convert(args):
    sys.path.insert(0, args.gguf_py)
    import gguf  # llama.cpp's gguf-py

    cfg = json.load(open(os.path.join(args.model, "config.json")))
    tok = json.load(open(os.path.join(args.model, "tokenizer.json")))
    files = [f for f in sorted(os.listdir(args.model)) if f.endswith(".safetensors")]
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(os.path.join(args.model, f)))

    w = gguf.GGUFWriter(args.out, "qwen2")
    w.add_name(os.path.basename(os.path.normpath(args.model)))
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)

    # tokenizer: BPE (gpt2 style), Qwen2 pre-tokenizer, vocab padded to the embedding rows
    vocab_size = cfg["vocab_size"]
    rev = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else
                         gguf.TokenType.USER_DEFINED)
        elif i in rev:
            tokens.append(rev[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.get("bos_token_id", 151643))
    w.add_eos_token_id(cfg.get("eos_token_id", 151645))
    w.add_pad_token_id(cfg.get("bos_token_id", 151643))
    w.add_add_bos_token(False)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, (dt, a) in tensors.items():
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
            if not m or m.group(2) not in names:
                sys.exit(f"convert: unexpected tensor {name}")
            g = f"blk.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
        if a.ndim == 1:  # norms and biases in f32, as convert_hf_to_gguf.py writes them
            w.add_tensor(g, bf16_to_f32(a) if dt == "BF16" else a.astype(np.float32))
        elif dt == "BF16":
            w.add_tensor(g, np.ascontiguousarray(a), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(g, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}")


# ---- compare ------------------------------------------------------------------------------

def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return r.stdout


def disagg_bench(args, prompt_len, gen_len, streams=0, isa=None):
    env = dict(os.environ)
    if isa:
        env["DISAGG_CPU_ISA"] = isa
    cmd = [args.disagg, "bench", "model", args.model, "--prompt-len", str(prompt_len),
           "--gen-len", str(gen_len), "--threads", str(args.threads), "--repeat", "1", "--json"]
    if streams:
        cmd += ["--streams", str(streams)]
    return json.loads(run(cmd, env).strip().splitlines()[-1])


def llama_bench(args, extra):
    out = run([os.path.join(args.llama_bin, "llama-bench"), "-m", args.gguf, "-t",
               str(args.threads), "-r", "1", "-o", "json"] + extra)
    return json.loads(out)[0]["avg_ts"]


def llama_batched(args, npl):
    out = run([os.path.join(args.llama_bin, "llama-batched-bench"), "-m", args.gguf, "-t",
               str(args.threads), "-c", "2048", "-b", "512", "-npp", "32", "-ntg", "16", "-npl",
               ",".join(str(n) for n in npl), "--output-format", "jsonl"])
    tg = {}
    for line in out.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            tg[d["pl"]] = d["speed_tg"]
    return tg


def compare(args):
    isas = args.isa.split(",") if args.isa else [None]
    rows = {}  # figure -> list over rounds of (disagg per isa..., llama)

    def add(fig, key, v):
        rows.setdefault(fig, {}).setdefault(key, []).append(v)

    for r in range(args.rounds):
        for isa in isas:
            tag = f"disagg {isa or 'auto'}"
            d = disagg_bench(args, 512, 16, isa=isa)
            add("prefill pp512", tag, d["prefill_tok_s"])
            add("decode after 512", tag, d["decode_tok_s"])
            d = disagg_bench(args, 1, 64, streams=8, isa=isa)
            add("decode empty", tag, d["decode_tok_s"])
            add("decode 8 streams aggregate", tag, d["decode_streams_tok_s"])
            add("decode 1 stream (32-token prompt)", tag, d["decode_1stream_tok_s"])
            add("8-stream / 1-stream", tag, d["decode_streams_tok_s"] / d["decode_1stream_tok_s"])
        add("prefill pp512", "llama.cpp", llama_bench(args, ["-p", "512", "-n", "0"]))
        add("decode after 512", "llama.cpp", llama_bench(args, ["-p", "0", "-n", "16", "-d", "512"]))
        add("decode empty", "llama.cpp", llama_bench(args, ["-p", "0", "-n", "64"]))
        tg = llama_batched(args, [1, 8])
        add("decode 8 streams aggregate", "llama.cpp", tg[8])
        add("decode 1 stream (32-token prompt)", "llama.cpp", tg[1])
        add("8-stream / 1-stream", "llama.cpp", tg[8] / tg[1])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    keys = [f"disagg {i or 'auto'}" for i in isas] + ["llama.cpp"]
    print("| figure | " + " | ".join(keys) + " | " +
          " | ".join(f"{k} / llama.cpp" for k in keys[:-1]) + " |")
    print("|---" * (2 * len(keys)) + "|")
    for fig, by in rows.items():
        med = {k: statistics.median(by[k]) for k in keys}
        unit = "x" if "/" in fig else " tok/s"
        cells = [f"{med[k]:.2f}{unit}" for k in keys]
        # ratios within each round, then their median
        rat = [statistics.median([a / b for a, b in zip(by[k], by["llama.cpp"])]) for k in keys[:-1]]
        print(f"| {fig} | " + " | ".join(cells) + " | " + " | ".join(f"{x:.2f}" for x in rat) + " |")
    print(f"\n(medians of {args.rounds} alternated rounds, {args.threads} threads; raw: "
          + json.dumps(rows) + ")")




def wait_ready(url, proc, what):
    import time
    import urllib.request
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"{what} did not become ready")


def bench_serve(args, url, model_name):
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        run([args.disagg, "bench", "serve", "--base-url", url, "--model", model_name,
             "--random-input-len", "64", "--random-output-len", "64", "--num-prompts",
             str(args.prompts), "--max-concurrency", str(args.clients), "--ignore-eos",
             "--disable-tqdm", "--json", f.name])
        return json.load(open(f.name))["output_throughput"]


def serve(args):
    isas = args.isa.split(",") if args.isa else [None]
    res = {}
    for r in range(args.rounds):
        for isa in isas:
            env = dict(os.environ)
            if isa:
                env["DISAGG_CPU_ISA"] = isa
            port = free_port()
            p = subprocess.Popen([args.disagg, "serve", args.model, "--host", "127.0.0.1", "--port",
                                  str(port), "--threads", str(args.threads), "--served-model-name",
                                  "q", "--max-model-len", "1024"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_ready(f"http://127.0.0.1:{port}", p, "disagg serve")
                res.setdefault(f"disagg {isa or 'auto'}", []).append(
                    bench_serve(args, f"http://127.0.0.1:{port}", "q"))
            finally:
                p.terminate()
                p.wait()
        port = free_port()
        p = subprocess.Popen([os.path.join(args.llama_bin, "llama-server"), "-m", args.gguf,
                              "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
                              "-np", str(args.clients), "-c", str(1024 * args.clients),
                              "--no-webui", "-a", "q"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(f"http://127.0.0.1:{port}", p, "llama-server")
            res.setdefault("llama.cpp", []).append(bench_serve(args, f"http://127.0.0.1:{port}", "q"))
        finally:
            p.terminate()
            p.wait()
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"| server ({args.clients} clients, 64 tokens out) | output tok/s (median) | "
          "/ llama.cpp (median of per-round ratios) |")
    print("|---|---|---|")
    for k, v in res.items():
        rat = statistics.median([a / b for a, b in zip(v, res["llama.cpp"])])
        print(f"| {k} | {statistics.median(v):.1f} | {rat:.2f} |")
    print(f"\n(per-round values: {json.dumps(res)})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="safetensors model directory -> GGUF (bf16)")
    c.add_argument("model")
    c.add_argument("out")
    c.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py directory")
    b = sub.add_parser("compare", help="alternated rounds of disagg and llama.cpp")
    b.add_argument("model")
    b.add_argument("gguf")
    b.add_argument("--disagg", default="build/disagg")
    b.add_argument("--llama-bin", required=True, help="directory with llama-bench, llama-batched-bench")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--isa", default="", help="comma-separated DISAGG_CPU_ISA values (default: auto)")
    v = sub.add_parser("serve", help="alternated rounds of disagg serve and llama-server")
    v.add_argument("model")
    v.add_argument("gguf")
    v.add_argument("--disagg", default="build/disagg")
    v.add_argument("--llama-bin", required=True)
    v.add_argument("--threads", type=int, default=2)
    v.add_argument("--rounds", type=int, default=3)
    v.add_argument("--clients", type=int, default=8)
    v.add_argument("--prompts", type=int, default=16)
    v.add_argument("--isa", default="")
    args = ap.parse_args()
    {"convert": convert, "compare": compare, "serve": serve}[args.cmd](args)


if __name__ == "__main__":
    main()
