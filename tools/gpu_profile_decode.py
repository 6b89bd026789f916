#!/usr/bin/env python3
"""gpu_profile_decode — where one decode step's time goes, kernel by kernel, on the GPU.

Runs `disagg bench model SHAPE --device cuda --load-format dummy` at batch B and context C under
Nsight Compute (ncu, --clock-control none as METHOD.md asks: the clocks are left alone) with two
metrics per kernel (duration, DRAM bytes read + written), cuts the launches into decode steps at
the argmax kernel that ends each step, and prints the last complete step: per kernel name the
launches, the time, the bytes and the achieved GB/s, sorted by time, and the step's total against
the bytes it moved (the bandwidth floor the step would have at COPY_GBS, the device's copy rate
measured in the same run by bench model's ceilings line, or given).

Usage: tools/gpu_profile_decode.py DISAGG SHAPE_DIR [--batch 1] [--context 4096] [--copy-gbs 4249]
ncu's replay makes each kernel slower to *run* but its duration metric is the kernel's own."""
import argparse
import collections
import csv
import io
import os
import shutil
import subprocess
import sys


def ncu_path():
    p = shutil.which("ncu")
    if p:
        return p
    for root in ("/usr/local/cuda/bin", "/opt/nvidia/nsight-compute"):
        for dp, _, fs in os.walk(root):
            if "ncu" in fs:
                return os.path.join(dp, "ncu")
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("disagg")
    ap.add_argument("shape")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--copy-gbs", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    ncu = ncu_path()
    if not ncu:
        print("gpu_profile_decode: SKIP: ncu (Nsight Compute) not found", flush=True)
        return 0
    cmd = [ncu, "--clock-control", "none", "--csv", "--page", "raw",
           "--metrics", "gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum",
           a.disagg, "bench", "model", a.shape, "--device", "cuda", "--load-format", "dummy",
           "--prompt-lens", "16", "--batches", str(a.batch), "--context", str(a.context),
           "--long-context", str(a.context), "--gen-len", str(a.steps)]
    print("gpu_profile_decode:", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    out = r.stdout
    start = out.find('"ID"')
    if r.returncode or start < 0:
        print(out[-3000:], r.stderr[-3000:], sep="\n")
        print(f"gpu_profile_decode: ncu failed (exit {r.returncode})")
        return 1
    rows = list(csv.DictReader(io.StringIO(out[start:])))
    rows = [x for x in rows if x.get("Kernel Name") and x.get("gpu__time_duration.sum", "").replace(".", "").replace(",", "").isdigit()]

    def num(x, k):
        return float(x[k].replace(",", ""))
    # units: duration in ns (or us: ncu prints the unit in the first data row, which we dropped)
    ends = [i for i, x in enumerate(rows) if "argmax" in x["Kernel Name"] and "part" not in x["Kernel Name"]]
    if len(ends) < 2:
        print(f"gpu_profile_decode: found {len(ends)} argmax launches in {len(rows)} kernels; cannot cut a step")
        return 1
    step = rows[ends[-2] + 1: ends[-1] + 1]
    agg = collections.OrderedDict()
    for x in step:
        n = x["Kernel Name"].split("(")[0][:70]
        t, rb, wb = num(x, "gpu__time_duration.sum"), num(x, "dram__bytes_read.sum"), num(x, "dram__bytes_write.sum")
        c, tt, bb = agg.get(n, (0, 0.0, 0.0))
        agg[n] = (c + 1, tt + t, bb + rb + wb)
    tot_t = sum(v[1] for v in agg.values())
    tot_b = sum(v[2] for v in agg.values())
    print(f"\none decode step (batch {a.batch}, context {a.context}): {len(step)} kernels, "
          f"{tot_t / 1e3:.1f} us of kernel time, {tot_b / 1e9:.3f} GB moved "
          f"({tot_b / tot_t:.0f} GB/s over the kernels' time)")
    if a.copy_gbs:
        print(f"bandwidth floor at {a.copy_gbs:.0f} GB/s copy: {tot_b / a.copy_gbs / 1e3:.1f} us "
              f"-> kernels at {100 * tot_b / a.copy_gbs / tot_t:.1f} % of it")
    print(f"{'kernel':72s} {'n':>4s} {'us':>9s} {'%':>6s} {'MB':>9s} {'GB/s':>7s}")
    for n, (c, t, b) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"{n:72s} {c:4d} {t / 1e3:9.1f} {100 * t / tot_t:6.1f} {b / 1e6:9.1f} {b / t if t else 0:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
