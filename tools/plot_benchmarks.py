#!/usr/bin/env python3
"""Pictures of the benchmark runs (docs/benchmarks.md):

  transfer.png  transfer engine GB/s against block size (tcp and shm, read and
                write) beside the ceilings measured in the same run (memcpy,
                plain socket loop, streaming memcpy) and Mooncake's TCP figure
  decode.png    decode tokens/s against batch size (CPU: `bench serve`
                concurrency; H200: the fused forward of `bench model`)
  ttft.png      time to first token against prompt length, P/D and colocated
  KEY_latency.png   request-rate sweep (tools/sweep_rate.py): TTFT and ITL, median
                    and p99, against the request rate, colocated vs P/D
  KEY_goodput.png   the same sweep: goodput under the run's SLO (--goodput) and
                    request throughput against the request rate
  KEY_pareto.png    the same sweep: output tok/s per GPU against tok/s per user
                    (1000 / mean TPOT), one point per rate

  tools/plot_benchmarks.py --results bench-results --out docs/img
      reads what scripts/bench_all.sh wrote (transfer.txt, serve-c*.json,
      ttft-{colocated,pd}-LEN.json), writes the PNGs and benchmarks.json (the
      numbers plotted; parts the run does not produce, the H200 figures, are
      kept from the previous benchmarks.json)
  tools/plot_benchmarks.py --sweep sweep-out --sweep-key sweep_cpu --out docs/img
      reads tools/sweep_rate.py's JSONs (sweep-{colocated,pd}-rRATE.json) into
      benchmarks.json under KEY (sweep_cpu, sweep_gpu ...) and draws its PNGs
  tools/plot_benchmarks.py --out docs/img
      redraws the PNGs from docs/img/benchmarks.json alone
"""
import argparse
import glob
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
ROW = re.compile(r"^\s*(\d+) (KiB|MiB|GiB)\s+(\d+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s*\|\s*([\d.]+)\s+([\d.]+|-)\s*\|")
HEAD = re.compile(r"^== (tcp|shm) (read|write) ")
STREAM = re.compile(r"^streaming memcpy .*: ([\d.]+) GB/s")


def parse_transfer(text):
    """`disagg bench transfer` output -> {"tcp read": {block_bytes, gbps, memcpy_gbps,
    socket_gbps}, ..., "streaming_memcpy_gbps": {"tcp": x, "shm": y}}."""
    out, cur, stream = {}, None, {}
    for line in text.splitlines():
        m = HEAD.match(line)
        if m:
            cur = f"{m.group(1)} {m.group(2)}"
            out[cur] = {"block_bytes": [], "gbps": [], "memcpy_gbps": [], "socket_gbps": []}
            continue
        m = ROW.match(line)
        if m and cur:
            s = out[cur]
            s["block_bytes"].append(int(m.group(1)) * UNITS[m.group(2)])
            s["gbps"].append(float(m.group(4)))
            s["memcpy_gbps"].append(float(m.group(5)))
            s["socket_gbps"].append(None if m.group(6) == "-" else float(m.group(6)))
            continue
        m = STREAM.match(line)
        if m and cur:
            stream[cur.split()[0]] = float(m.group(1))
    if not out:
        raise ValueError("no `bench transfer` tables found")
    out["streaming_memcpy_gbps"] = stream
    return out


def load_json(path):
    with open(path) as f:
        return json.load(f)


def from_results(d, previous):
    """The numbers of one scripts/bench_all.sh run (directory d)."""
    data = dict(previous)
    src = "scripts/bench_all.sh"
    ups = "".join(open(p).read() for p in sorted(glob.glob(os.path.join(d, "uptime*.txt"))))
    if ups:  # "== load:  09:22:45 up 1:10, ... load average: 1.60, 1.92, 3.27"
        loads = sorted(re.findall(r"(\d\d:\d\d):\d\d .*load average: ([\d.]+)", ups))
        if loads:
            src += f", {loads[0][0]}-{loads[-1][0]} UTC, load {loads[0][1]}-{loads[-1][1]}"
    tr = os.path.join(d, "transfer.txt")
    if os.path.exists(tr):
        data["transfer"] = dict(parse_transfer(open(tr).read()), source=src)
    serve = sorted(glob.glob(os.path.join(d, "serve-c*.json")))
    if serve:
        runs = sorted((load_json(p) for p in serve), key=lambda r: r["max_concurrency"])
        data["decode_cpu"] = dict(previous.get("decode_cpu", {}), source=src,
                                  batch=[r["max_concurrency"] for r in runs],
                                  tok_s=[r["output_throughput"] for r in runs])
    ttft = {}
    for setup in ("colocated", "pd"):
        pts = []
        for p in glob.glob(os.path.join(d, f"ttft-{setup}-*.json")):
            r = load_json(p)
            if r.get("completed"):
                pts.append((r["total_input_tokens"] / r["completed"], r["mean_ttft_ms"]))
        pts.sort()
        if pts:
            ttft[setup] = {"prompt_tokens": [p[0] for p in pts], "ttft_ms": [p[1] for p in pts]}
    if ttft:
        data["ttft"] = dict(previous.get("ttft", {}), source=src, **ttft)
    return data


def plot_transfer(data, path):
    t = data["transfer"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for ax, proto in zip(axes, ("tcp", "shm")):
        for op, style in (("read", "o-"), ("write", "s-")):
            s = t.get(f"{proto} {op}")
            if not s:
                continue
            x = [b / 1024 for b in s["block_bytes"]]
            ax.plot(x, s["gbps"], style, label=f"disagg {proto} {op}")
            ax.plot(x, s["memcpy_gbps"], ":", color="grey" if op == "read" else "silver",
                    label=f"memcpy ceiling ({op} run)")
            if proto == "tcp":
                ax.plot(x, [v or 0 for v in s["socket_gbps"]], "--", color="tab:red" if op == "read" else "salmon",
                        label=f"plain socket loop ({op} run)")
        sm = t.get("streaming_memcpy_gbps", {}).get(proto)
        if sm:
            ax.axhline(sm, color="black", lw=0.8, ls="-.", label=f"streaming memcpy {sm:.1f} GB/s")
        mc = data.get("mooncake_tcp_quoted")
        if proto == "tcp" and mc:
            ax.errorbar([mc["block_bytes"] / 1024], [(mc["gbps_low"] + mc["gbps_high"]) / 2],
                        yerr=[(mc["gbps_high"] - mc["gbps_low"]) / 2], fmt="D", color="tab:purple",
                        capsize=4, label="Mooncake TCP (quoted, not run here)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({b / 1024 for k, v in t.items() if isinstance(v, dict) and "block_bytes" in v
                        for b in v["block_bytes"]})
        ax.set_xticks(ticks, [f"{k:g} KiB" if k < 1024 else f"{k / 1024:g} MiB" for k in ticks], fontsize=8)
        ax.set_xlabel("block size")
        ax.set_title(f"{proto}: GB/s against block size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("GB/s (10^9 B/s)")
    fig.suptitle(f"disagg bench transfer — {t.get('source', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_decode(data, path):
    panels = [(k, data[k]) for k in ("decode_cpu", "decode_gpu") if data.get(k, {}).get("batch")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.4), squeeze=False)
    for ax, (key, s) in zip(axes[0], panels):
        ax.plot(s["batch"], s["tok_s"], "o-", label="aggregate decode tok/s")
        base = s["tok_s"][0] / s["batch"][0]
        ax.plot(s["batch"], [base * b for b in s["batch"]], ":", color="grey",
                label="linear in batch from batch 1")
        tg = s.get("target")
        if tg:
            ax.plot([tg["batch"]], [tg["tok_s"]], "r*", ms=10, label=tg["label"])
        for b, v in zip(s["batch"], s["tok_s"]):
            ax.annotate(f"{v:,.0f}", (b, v), textcoords="offset points", xytext=(4, -10), fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(s["batch"], [str(b) for b in s["batch"]])
        ax.set_xlabel(s.get("batch_label", "batch size"))
        ax.set_ylabel("output tokens/s")
        ax.set_title(s.get("title", key) + "\n" + s.get("source", ""), fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft(data, path):
    t = data["ttft"]
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for setup, label, style in (("colocated", "colocated", "o-"), ("pd", "P/D (prefill + decode)", "s--")):
        s = t.get(setup)
        if s:
            ax.plot(s["prompt_tokens"], [v / 1e3 for v in s["ttft_ms"]], style, label=label)
    ax.set_xscale("log", base=2)
    lens = sorted({x for k in ("colocated", "pd") for x in t.get(k, {}).get("prompt_tokens", [])})
    ax.set_xticks(lens, [f"{x:g}" for x in lens])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title(t.get("title", "TTFT against prompt length") + "\n" + t.get("source", ""), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SWEEP_FIELDS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "mean_tpot_ms",
                "request_throughput", "request_goodput", "output_throughput", "completed", "failed")
SETUPS = (("colocated", "colocated", "o-", "tab:blue"), ("pd", "P/D", "s--", "tab:orange"))


def parse_sweep(d, title=""):
    """tools/sweep_rate.py's JSONs in directory d -> {"title", "slo_ms", "runs": {setup: [point
    per rate, sorted]}}; a point: rate, gpus, transport and SWEEP_FIELDS."""
    runs, slo, model, lens = {}, None, None, None
    paths = sorted(glob.glob(os.path.join(d, "sweep-*.json")))
    if not paths:
        raise ValueError(f"{d}: no sweep-*.json (tools/sweep_rate.py writes them)")
    for p in paths:
        j = load_json(p)
        sw = j.get("sweep")
        if not isinstance(sw, dict) or sw.get("setup") not in ("colocated", "pd"):
            raise ValueError(f"{p}: no 'sweep' object with setup colocated or pd (not tools/sweep_rate.py's)")
        missing = [k for k in SWEEP_FIELDS if k not in j]
        if missing:
            raise ValueError(f"{p}: missing {', '.join(missing)} (`disagg bench serve --json` keys)")
        pt = {"rate": sw["rate"], "gpus": sw.get("gpus", 1), "transport": sw.get("transport", ""),
              "device": sw.get("device", "GPU")}
        pt.update({k: j[k] for k in SWEEP_FIELDS})
        runs.setdefault(sw["setup"], []).append(pt)
        slo = slo or j.get("goodput_slo_ms")
        model = model or j.get("model_id")
        if j.get("completed"):
            lens = lens or (round(j["total_input_tokens"] / j["completed"]),
                            round(j["total_output_tokens"] / j["completed"]))
    for v in runs.values():
        v.sort(key=lambda pt: pt["rate"])
    if not title:
        title = f"{model}" + (f", ~{lens[0]} tokens in / {lens[1]} out" if lens else "")
    return {"title": title, "slo_ms": slo, "runs": runs}


def slo_text(slo):
    if not slo:
        return "no SLO given (goodput = throughput)"
    return "SLO: " + ", ".join(f"{k} <= {v:g} ms" for k, v in slo.items())


def plot_sweep_latency(s, path):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "itl", "ITL")):
        for setup, label, style, color in SETUPS:
            pts = s["runs"].get(setup)
            if not pts:
                continue
            x = [p["rate"] for p in pts]
            ax.plot(x, [p[f"median_{metric}_ms"] for p in pts], style, color=color, label=f"{label} p50")
            ax.plot(x, [p[f"p99_{metric}_ms"] for p in pts], style, color=color, alpha=0.45, lw=2.5,
                    label=f"{label} p99")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{name} against request rate")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(s["title"] + "\n" + s.get("source", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep_goodput(s, path):
    fig, ax = plt.subplots(figsize=(7, 4.6))
    top = 0
    for setup, label, style, color in SETUPS:
        pts = s["runs"].get(setup)
        if not pts:
            continue
        x = [p["rate"] for p in pts]
        good = [p["request_goodput"] if p["request_goodput"] is not None else p["request_throughput"] for p in pts]
        ax.plot(x, good, style, color=color, label=f"{label} goodput")
        ax.plot(x, [p["request_throughput"] for p in pts], ":", color=color, label=f"{label} throughput")
        top = max([top] + x)
    ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="-.", label="offered rate")
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("requests/s")
    ax.set_title("goodput under SLO — " + slo_text(s.get("slo_ms")), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(s["title"] + "\n" + s.get("source", ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep_pareto(s, path):
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for setup, label, style, color in SETUPS:
        pts = [p for p in s["runs"].get(setup, []) if p["mean_tpot_ms"] > 0]
        if not pts:
            continue
        x = [1000 / p["mean_tpot_ms"] for p in pts]
        y = [p["output_throughput"] / max(1, p["gpus"]) for p in pts]
        dev = pts[0].get("device", "GPU")
        ax.plot(x, y, style, color=color, label=f"{label} ({pts[0]['gpus']} {dev}{'s' if pts[0]['gpus'] > 1 else ''})")
        for p, xi, yi in zip(pts, x, y):
            ax.annotate(f"{p['rate']:g}/s", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("tok/s per user (1000 / mean TPOT)")
    devs = {p.get("device", "GPU") for v in s["runs"].values() for p in v}
    ax.set_ylabel(f"output tok/s per {devs.pop() if len(devs) == 1 else 'device'}")
    ax.set_title("throughput per device against speed per user (labels: request rate)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(s["title"] + "\n" + s.get("source", ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_keys(data):
    return sorted(k for k, v in data.items() if k.startswith("sweep") and isinstance(v, dict) and v.get("runs"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", help="a scripts/bench_all.sh output directory (bench-results)")
    ap.add_argument("--out", default="docs/img", help="where the PNGs and benchmarks.json go (docs/img)")
    ap.add_argument("--sweep", help="a tools/sweep_rate.py output directory")
    ap.add_argument("--sweep-key", default="sweep_cpu",
                    help="benchmarks.json key (and PNG prefix) of --sweep: sweep_cpu (default), sweep_gpu ...")
    ap.add_argument("--sweep-title", default="", help="the sweep's title (default: model and lengths)")
    ap.add_argument("--sweep-source", default="", help="where the sweep ran, for the pictures")
    a = ap.parse_args(argv)
    if a.sweep_key and not re.fullmatch(r"sweep[A-Za-z0-9_]*", a.sweep_key):
        ap.error(f"--sweep-key {a.sweep_key}: a name starting with 'sweep' (letters, digits, _)")
    rec = os.path.join(a.out, "benchmarks.json")
    previous = load_json(rec) if os.path.exists(rec) else {}
    if a.results:
        if not os.path.isdir(a.results):
            ap.error(f"--results {a.results}: not a directory (scripts/bench_all.sh writes bench-results/)")
        data = from_results(a.results, previous)
    elif previous or a.sweep:
        data = dict(previous)
    else:
        ap.error(f"no --results and no {rec} to redraw from")
    if a.sweep:
        if not os.path.isdir(a.sweep):
            ap.error(f"--sweep {a.sweep}: not a directory (tools/sweep_rate.py --out)")
        try:
            data[a.sweep_key] = dict(parse_sweep(a.sweep, a.sweep_title), source=a.sweep_source)
        except ValueError as e:
            ap.error(str(e))
    os.makedirs(a.out, exist_ok=True)
    drawn = []
    has = {"transfer.png": any(k.split()[0] in ("tcp", "shm") for k in data.get("transfer", {})),
           "decode.png": any(data.get(k, {}).get("batch") for k in ("decode_cpu", "decode_gpu")),
           "ttft.png": any(k in data.get("ttft", {}) for k in ("colocated", "pd"))}
    for key, fn, name in (("transfer", plot_transfer, "transfer.png"), ("decode", plot_decode, "decode.png"),
                          ("ttft", plot_ttft, "ttft.png")):
        if has[name]:
            fn(data, os.path.join(a.out, name))
            drawn.append(name)
        else:
            print(f"plot_benchmarks: no {key} numbers, {name} not drawn", file=sys.stderr)
    for key in sweep_keys(data):
        for suffix, fn in (("latency", plot_sweep_latency), ("goodput", plot_sweep_goodput),
                           ("pareto", plot_sweep_pareto)):
            fn(data[key], os.path.join(a.out, f"{key}_{suffix}.png"))
            drawn.append(f"{key}_{suffix}.png")
    if a.results or a.sweep:
        with open(rec, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    print(f"plot_benchmarks: wrote {', '.join(drawn)} in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
