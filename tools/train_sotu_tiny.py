"""Trains, saves and evaluates disagg's shipped default model, models/disagg-sotu-tiny/.

Owns: the model's settings (PRESETS["full"] below), the training loop, the saved
Hugging Face files (config.json, generation_config.json, model.safetensors in bf16,
written by transformers' save_pretrained), and the reference outputs that the C
engine is checked against (tests/data/sotu-tiny/):
  heldout_eval.json  held-out perplexity computed by PyTorch, with its exact definition
  heldout_ids.json   the held-out token stream (ids) that the perplexity is over
  greedy.json        greedy continuations from transformers' generate() for fixed prompts

Data and split: train_sotu_data.py (training = addresses 1790..2016, held-out = the
last five, 2017..2021). Tokenizer: models/disagg-sotu-tiny/tokenizer.json, made by
train_sotu_tokenizer.py (run that first; this script only reads it).

Held-out perplexity, exactly (the C engine must reproduce it):
  stream  = for each held-out address in file order: <|endoftext|> then tok(body)
            (= tokenizing train_sotu_data.stream_text(heldout) with special tokens)
  windows = consecutive non-overlapping slices stream[s : s+EVAL_CTX], s = 0, EVAL_CTX, ...
            (the last one shorter); each window is run alone from an empty KV cache,
            positions 0..len-1
  scored  = every token of a window except its first, predicted from the window's
            tokens before it; NLL = -log softmax(logits)[token]
  ppl     = exp(sum of NLL over all scored tokens / number of scored tokens)
  compute = the bf16 safetensors loaded by transformers, cast to float32, eager
            attention, TF32 off; logits and log-softmax in float32, sums in float64.

Usage (GPU for "full"; "micro" is a seconds-long smoke test of the whole pipeline):
  python3 tools/train_sotu_tiny.py --preset full --model-out DIR --ref-out DIR
"""

import argparse
import json
import math
import os
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_sotu_data as sd  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.normpath(os.path.join(HERE, "..", "models", "disagg-sotu-tiny"))

# Settings. "full" is the shipped model; "micro" checks the pipeline in seconds.
PRESETS = {
    "full": dict(
        hidden=256, layers=6, heads=8, kv_heads=2, inter=1024, max_pos=2048, rope_theta=10000.0,
        seq=1024, batch=32, steps=500, lr=2e-3, min_lr_frac=0.1, warmup=40, wd=0.1,
        beta1=0.9, beta2=0.95, clip=1.0, eval_every=100, eval_ctx=1024, eval_tokens=0, seed=1234,
        gen_tokens=48,
    ),
    "micro": dict(
        hidden=64, layers=2, heads=4, kv_heads=2, inter=128, max_pos=256, rope_theta=10000.0,
        seq=128, batch=8, steps=30, lr=3e-3, min_lr_frac=0.1, warmup=5, wd=0.1,
        beta1=0.9, beta2=0.95, clip=1.0, eval_every=10, eval_ctx=128, eval_tokens=1000, seed=1234,
        gen_tokens=8,
    ),
}

PROMPTS = [  # fixed prompts of the greedy reference; "chat" ones go through the chat template
    ("text", "Fellow-Citizens of the Senate and House of"),
    ("text", "Mr. Speaker, Mr. Vice President, Members of Congress, my fellow Americans:"),
    ("text", "The state of the Union is"),
    ("text", "Gentlemen of the Senate and House of Representatives: The"),
    ("text", "We must never forget that"),
    ("chat", "What is the state of the Union?"),
]


def log(msg):
    print(msg, flush=True)


def load_tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def encode_docs(tok, docs):
    """Token stream of docs: <|endoftext|> + tok(body) per doc, as int64 numpy."""
    eot = tok.token_to_id(sd.EOT)
    out = []
    for enc in tok.encode_batch([d.body for d in docs], add_special_tokens=False):
        out.append(eot)
        out.extend(enc.ids)
    return np.array(out, dtype=np.int64)


def make_model(p, vocab, eot, im_end):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=p["hidden"], intermediate_size=p["inter"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"], max_position_embeddings=p["max_pos"],
        rope_theta=p["rope_theta"], rms_norm_eps=1e-6, tie_word_embeddings=True,
        hidden_act="silu", attention_dropout=0.0, use_sliding_window=False,
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, initializer_range=0.02,
    )
    torch.manual_seed(p["seed"])
    return Qwen2ForCausalLM(cfg)


def lr_at(step, p):
    """Linear warmup, then cosine from lr down to lr*min_lr_frac at the last step."""
    if step < p["warmup"]:
        return p["lr"] * (step + 1) / p["warmup"]
    t = (step - p["warmup"]) / max(1, p["steps"] - p["warmup"] - 1)
    return p["lr"] * (p["min_lr_frac"] + (1 - p["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def window_nll(model, ids, ctx, device, max_tokens=0):
    """Per-window (start, length, scored, sum NLL) over ids, as defined in the module doc."""
    if max_tokens:
        ids = ids[:max_tokens]
    rows = []
    for s in range(0, len(ids), ctx):
        x = torch.from_numpy(ids[s:s + ctx]).to(device)
        n = x.numel()
        if n < 2:
            rows.append((s, n, 0, 0.0))
            continue
        logits = model(input_ids=x[None]).logits[0].float()  # (n, vocab)
        logp = torch.log_softmax(logits[:-1], dim=-1)  # (n-1, vocab), float32
        nll = -logp.gather(1, x[1:, None])[:, 0]  # (n-1,)
        rows.append((s, n, n - 1, float(nll.double().sum())))
    return rows


def summarize(rows):
    scored = sum(r[2] for r in rows)
    total = sum(r[3] for r in rows)
    return scored, total, total / scored, math.exp(total / scored)


def train(p, train_ids, heldout_ids, vocab, eot, im_end, device):
    model = make_model(p, vocab, eot, im_end).to(device)
    n_params = sum(t.numel() for t in model.parameters())
    log(f"model: {n_params} parameters ({n_params / 1e6:.2f} M, tied embeddings counted once)")
    decay = [t for n, t in model.named_parameters() if t.dim() >= 2]
    no_decay = [t for n, t in model.named_parameters() if t.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": p["wd"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=p["lr"], betas=(p["beta1"], p["beta2"]), eps=1e-8,
        fused=(device.type == "cuda"),
    )
    data = torch.from_numpy(train_ids).to(device)
    gen = torch.Generator(device="cpu").manual_seed(p["seed"])
    seq, batch = p["seq"], p["batch"]
    offsets = torch.arange(seq + 1, device=device)
    amp = device.type == "cuda"
    history = []
    t0 = time.time()
    tokens_seen = 0
    for step in range(p["steps"]):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, p)
        starts = torch.randint(0, len(train_ids) - seq - 1, (batch,), generator=gen).to(device)
        xy = data[starts[:, None] + offsets[None, :]]  # (batch, seq+1)
        x, y = xy[:, :-1], xy[:, 1:]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x).logits  # (batch, seq, vocab)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), p["clip"])
        opt.step()
        tokens_seen += batch * seq
        if (step + 1) % p["eval_every"] == 0 or step + 1 == p["steps"]:
            model.eval()
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                # a quick look at held-out loss (first 8 windows, bf16): logged, never used to choose
                rows = window_nll(model, heldout_ids, p["eval_ctx"], device, 8 * p["eval_ctx"])
            model.train()
            hl = summarize(rows)[2]
            el = time.time() - t0
            history.append(dict(step=step + 1, train_loss=round(loss.item(), 4), heldout_loss_8win=round(hl, 4),
                                lr=lr_at(step, p), grad_norm=round(float(gnorm), 3), seconds=round(el, 1),
                                epochs=round(tokens_seen / len(train_ids), 2)))
            log(f"step {step + 1:5d}  loss {loss.item():.4f}  heldout(8 win) {hl:.4f}  lr {lr_at(step, p):.2e}  "
                f"gnorm {float(gnorm):.2f}  {el:.1f}s  {tokens_seen / el / 1e3:.0f}k tok/s  "
                f"epochs {tokens_seen / len(train_ids):.2f}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return model, n_params, time.time() - t0, tokens_seen, history


def save_model(model, model_out, eot, im_end):
    from transformers import GenerationConfig

    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=[eot, im_end], pad_token_id=eot,
        do_sample=True, temperature=0.8, top_p=0.95,
    )
    model.save_pretrained(model_out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(MODEL_DIR, name), os.path.join(model_out, name))


def load_fp32(model_out, device):
    """The saved bf16 weights, loaded by transformers and cast to float32 (reference precision)."""
    from transformers import Qwen2ForCausalLM

    m = Qwen2ForCausalLM.from_pretrained(model_out, dtype=torch.bfloat16, attn_implementation="eager")
    assert next(m.parameters()).dtype == torch.bfloat16
    return m.float().to(device).eval()


def unigram(train_ids, heldout_ids, vocab, ctx, max_tokens):
    """Add-one unigram model from the training stream, scored on the same held-out tokens."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64)
    logp = np.log((counts + 1.0) / (counts.sum() + vocab))
    ids = heldout_ids[:max_tokens] if max_tokens else heldout_ids
    mask = np.ones(len(ids), dtype=bool)
    mask[::ctx] = False  # the first token of each window is not scored
    nll = -logp[ids[mask]].sum()
    return float(math.exp(nll / mask.sum())), int(mask.sum())


def greedy(model_out, prompts, n_new, device):
    """Greedy continuations with transformers generate(), float32 from the bf16 weights."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_out)
    model = load_fp32(model_out, device)
    gc = GenerationConfig(do_sample=False, max_new_tokens=n_new, num_beams=1,
                          eos_token_id=model.generation_config.eos_token_id,
                          pad_token_id=model.generation_config.pad_token_id,
                          output_logits=True, return_dict_in_generate=True)
    out = []
    for kind, text in prompts:
        if kind == "chat":
            messages = [{"role": "user", "content": text}]
            rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            messages, rendered = None, text
        ids = tok(rendered, add_special_tokens=False).input_ids
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            g = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc)
        new = g.sequences[0, len(ids):].tolist()
        margins = []
        for i, lg in enumerate(g.logits):
            top = torch.topk(lg[0].float(), 2)
            assert int(top.indices[0]) == new[i], "generate() did not pick the argmax"
            margins.append(round(float(top.values[0] - top.values[1]), 5))
        out.append(dict(kind=kind, prompt=text, messages=messages, prompt_text=rendered, prompt_ids=ids,
                        output_ids=new, output_text=tok.decode(new, skip_special_tokens=False),
                        stopped_on_eos=bool(new and new[-1] in gc.eos_token_id),
                        top2_logit_margins=margins, min_margin=min(margins) if margins else None))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--steps", type=int, help="override the preset's step count")
    ap.add_argument("--model-out", required=True, help="directory for the saved model")
    ap.add_argument("--ref-out", required=True, help="directory for the reference JSON files")
    ap.add_argument("--data", default=None, help="sotu.txt.xz (default: $SOTU_DATA or ../shared/data/sotu/)")
    args = ap.parse_args()
    p = dict(PRESETS[args.preset])
    if args.steps:
        p["steps"] = args.steps
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True  # training only; switched off before evaluation
    torch.backends.cudnn.allow_tf32 = True
    import transformers

    env = dict(torch=torch.__version__, transformers=transformers.__version__, python=sys.version.split()[0],
               device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu")
    log(f"env: {env}")

    tok = load_tokenizer(MODEL_DIR)
    vocab = tok.get_vocab_size()
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    raw, train_docs, heldout_docs = sd.load_split(args.data)
    train_ids = encode_docs(tok, train_docs)
    heldout_ids = encode_docs(tok, heldout_docs)
    # the stream must equal tokenizing the one-string form with special tokens recognized
    text = sd.stream_text(heldout_docs)
    whole = tok.encode(text, add_special_tokens=False).ids
    if whole != heldout_ids.tolist():
        raise SystemExit("held-out stream: per-document and whole-text tokenizations differ")
    log(f"data: train {len(train_docs)} addresses {len(train_ids)} tokens; "
        f"held-out {len(heldout_docs)} addresses {len(heldout_ids)} tokens")

    model, n_params, train_s, tokens_seen, history = train(p, train_ids, heldout_ids, vocab, eot, im_end, device)
    os.makedirs(args.model_out, exist_ok=True)
    os.makedirs(args.ref_out, exist_ok=True)
    save_model(model, args.model_out, eot, im_end)
    del model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ctx, lim = p["eval_ctx"], p["eval_tokens"]
    results = {}
    for dev in ([device, torch.device("cpu")] if device.type == "cuda" else [device]):
        m = load_fp32(args.model_out, dev)
        t0 = time.time()
        rows = window_nll(m, heldout_ids, ctx, dev, lim)
        results[dev.type] = (rows, time.time() - t0)
        log(f"eval on {dev.type}: ppl {summarize(rows)[3]:.6f} ({time.time() - t0:.1f}s)")
        del m
    ref_dev = "cpu"
    rows = results[ref_dev][0]
    scored, total, mean, ppl = summarize(rows)
    uni_ppl, uni_scored = unigram(train_ids, heldout_ids, vocab, ctx, lim)
    assert uni_scored == scored
    log(f"held-out: {scored} scored tokens, mean NLL {mean:.6f}, ppl {ppl:.4f}; unigram ppl {uni_ppl:.4f}")

    with open(os.path.join(args.model_out, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    evaluation = dict(
        definition=("stream = for each held-out address in file order, <|endoftext|> then the tokens of its body; "
                    "windows = consecutive non-overlapping slices of eval_context tokens (the last shorter), each "
                    "run alone from position 0; every token of a window except its first is scored with "
                    "-log softmax(logits)[token] predicted from the window's earlier tokens; "
                    "ppl = exp(sum NLL / scored_tokens)"),
        precision=("bf16 safetensors loaded with transformers, cast to float32, eager attention, TF32 off; "
                   "log-softmax in float32, sums in float64"),
        reference_device=ref_dev,
        eval_context=ctx, eval_tokens_limit=lim, stride=ctx,
        heldout_addresses=[d.name for d in heldout_docs],
        heldout_bytes_in_sotu_txt=[heldout_docs[0].header_start, len(raw)],
        heldout_body_bytes=[[d.body_start, d.body_end] for d in heldout_docs],
        sotu_txt_sha256=sd.sha256_hex(raw),
        heldout_stream_text_sha256=sd.sha256_hex(text),
        tokenizer_json_sha256=sd.sha256_hex(open(os.path.join(MODEL_DIR, "tokenizer.json"), "rb").read()),
        model_safetensors_sha256=sd.sha256_hex(open(os.path.join(args.model_out, "model.safetensors"), "rb").read()),
        heldout_tokens=int(len(heldout_ids[:lim] if lim else heldout_ids)),
        windows=len(rows), scored_tokens=scored, sum_nll=total, mean_nll=mean, perplexity=ppl,
        per_window=[dict(start=r[0], length=r[1], scored=r[2], sum_nll=r[3]) for r in rows],
        other_devices={k: dict(perplexity=summarize(v[0])[3], sum_nll=summarize(v[0])[1], seconds=round(v[1], 2))
                       for k, v in results.items()},
        unigram=dict(perplexity=uni_ppl, definition=("add-one smoothed unigram over the vocabulary, counts from "
                                                     "the training stream, scored on the same tokens")),
    )
    training = dict(preset=args.preset, settings=p, parameters=n_params, train_tokens=int(len(train_ids)),
                    tokens_seen=tokens_seen, epochs=round(tokens_seen / len(train_ids), 2),
                    train_seconds=round(train_s, 1), env=env, history=history, config=cfg)
    with open(os.path.join(args.ref_out, "heldout_eval.json"), "w") as f:
        json.dump(dict(evaluation, training=training), f, indent=1)
    with open(os.path.join(args.ref_out, "heldout_ids.json"), "w") as f:
        json.dump(dict(eot_id=eot, ids=(heldout_ids[:lim] if lim else heldout_ids).tolist()), f, separators=(",", ":"))

    gens = {}
    for dev in ([torch.device("cpu"), device] if device.type == "cuda" else [device]):
        gens[dev.type] = greedy(args.model_out, PROMPTS, p["gen_tokens"], dev)
    ref = gens["cpu"]
    agree = {k: [a["output_ids"] == b["output_ids"] for a, b in zip(ref, v)] for k, v in gens.items()}
    for g in ref:
        log(f"greedy {g['prompt']!r} -> {g['output_text']!r} (min margin {g['min_margin']})")
    with open(os.path.join(args.ref_out, "greedy.json"), "w") as f:
        json.dump(dict(how=("transformers generate(), do_sample=False, num_beams=1, float32 compute from the bf16 "
                            "weights, eager attention, reference device cpu; prompts tokenized without added "
                            "tokens; chat prompts rendered with the tokenizer_config chat template "
                            "(add_generation_prompt=True); stops at max_new_tokens or an eos id"),
                       max_new_tokens=p["gen_tokens"], eos_token_ids=[eot, im_end], same_ids_on=agree,
                       prompts=ref), f, indent=1)
    log("done")


if __name__ == "__main__":
    main()
