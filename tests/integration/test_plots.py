"""tools/plot_benchmarks.py: the pictures in docs/benchmarks.md come from
the numbers in docs/img/benchmarks.json, which hold what the docs' tables say, and
scripts/bench_all.sh redraws them from its own run."""
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "plot_benchmarks.py"
IMG = ROOT / "docs" / "img"
PNGS = ["transfer.png", "decode.png", "ttft.png"]
sys.path.insert(0, str(ROOT / "tools"))
import plot_benchmarks  # noqa: E402


def test_recorded_transfer_numbers_are_the_docs_final_run():
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("### The final run"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("### "))
    parsed = plot_benchmarks.parse_transfer("\n".join(lines[start:end]))
    recorded = json.loads((IMG / "benchmarks.json").read_text())["transfer"]
    for series in ("tcp read", "tcp write", "shm read", "shm write"):
        assert parsed[series] == {k: recorded[series][k] for k in parsed[series]}, series
        assert len(parsed[series]["gbps"]) == 8  # 4 KiB ... 64 MiB
    assert parsed["streaming_memcpy_gbps"] == recorded["streaming_memcpy_gbps"]


def test_redraw_from_recorded(tmp_path):
    (tmp_path / "benchmarks.json").write_text((IMG / "benchmarks.json").read_text())
    r = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    for png in PNGS:
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000, png


def test_docs_show_the_committed_pictures():
    md = (ROOT / "docs" / "benchmarks.md").read_text()
    for png in PNGS:
        assert f"](img/{png})" in md, png
        assert (IMG / png).read_bytes()[:4] == b"\x89PNG", png
    assert "tools/plot_benchmarks.py --results" in (ROOT / "scripts" / "bench_all.sh").read_text()


def test_bad_results_dir_named(tmp_path):
    r = subprocess.run([sys.executable, str(TOOL), "--results", str(tmp_path / "nope"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "nope: not a directory" in r.stderr, r.stderr


def test_parse_transfer_refuses_other_text():
    try:
        plot_benchmarks.parse_transfer("no tables here\n")
    except ValueError as e:
        assert "bench transfer" in str(e)
    else:
        raise AssertionError("accepted text without tables")


SWEEP_PNGS = ["sweep_cpu_latency.png", "sweep_cpu_goodput.png", "sweep_cpu_pareto.png"]


def sample_run(setup, rate, gpus):
    """A `disagg bench serve --json` result (vLLM's keys) as tools/sweep_rate.py leaves it."""
    k = 1 + rate / 4
    return {"model_id": "tiny", "completed": 8, "failed": 0, "total_input_tokens": 8 * 130,
            "total_output_tokens": 8 * 16, "request_throughput": rate * 0.98,
            "request_goodput": rate * (0.9 if setup == "pd" else 0.7), "output_throughput": rate * 16,
            "median_ttft_ms": 20 * k, "p99_ttft_ms": 60 * k, "median_itl_ms": 2 * k, "p99_itl_ms": 9 * k,
            "mean_tpot_ms": 3 * k, "goodput_slo_ms": {"ttft": 200.0, "tpot": 20.0},
            "sweep": {"setup": setup, "rate": rate, "gpus": gpus, "transport": "tcp"}}


def test_sweep_pictures_from_sample_json(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for setup, gpus in (("colocated", 1), ("pd", 2)):
        for rate in (1, 2, 4):
            (sweep / f"sweep-{setup}-r{rate}.json").write_text(json.dumps(sample_run(setup, rate, gpus)))
    out = tmp_path / "img"
    r = subprocess.run([sys.executable, str(TOOL), "--sweep", str(sweep), "--out", str(out),
                        "--sweep-source", "sample"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for png in SWEEP_PNGS:
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000, png
    rec = json.loads((out / "benchmarks.json").read_text())["sweep_cpu"]
    assert [p["rate"] for p in rec["runs"]["pd"]] == [1, 2, 4]
    assert rec["runs"]["colocated"][2]["p99_ttft_ms"] == 120 and rec["slo_ms"]["ttft"] == 200
    assert rec["source"] == "sample" and "tiny" in rec["title"]
    # redrawn from benchmarks.json alone
    for png in SWEEP_PNGS:
        (out / png).unlink()
    r = subprocess.run([sys.executable, str(TOOL), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and all((out / p).exists() for p in SWEEP_PNGS), r.stderr


def test_sweep_bad_input_named(tmp_path):
    (tmp_path / "benchmarks.json").write_text("{}")
    r = subprocess.run([sys.executable, str(TOOL), "--sweep", str(tmp_path / "none"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "none: not a directory" in r.stderr, r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([sys.executable, str(TOOL), "--sweep", str(empty), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no sweep-*.json" in r.stderr, r.stderr
    (empty / "sweep-pd-r1.json").write_text(json.dumps({"completed": 1}))
    r = subprocess.run([sys.executable, str(TOOL), "--sweep", str(empty), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no 'sweep' object" in r.stderr, r.stderr
    bad = sample_run("pd", 1, 1)
    del bad["p99_itl_ms"]
    (empty / "sweep-pd-r1.json").write_text(json.dumps(bad))
    r = subprocess.run([sys.executable, str(TOOL), "--sweep", str(empty), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "missing p99_itl_ms" in r.stderr, r.stderr


def test_docs_show_the_sweep_and_its_table_matches_the_json():
    """The CPU sweep's pictures are committed and shown, and docs/benchmarks.md's table holds
    the numbers benchmarks.json recorded from the sweep's JSONs."""
    md = (ROOT / "docs" / "benchmarks.md").read_text()
    for png in SWEEP_PNGS:
        assert f"](img/{png})" in md, png
        assert (IMG / png).read_bytes()[:4] == b"\x89PNG", png
    rec = json.loads((IMG / "benchmarks.json").read_text())["sweep_cpu"]["runs"]
    rows = re.findall(r"^\| (colocated|P/D)[^|]*\| ([\d.]+) \| \d+/\d+ \| (\d+) / (\d+) \| [\d.]+ / [\d.]+ \| "
                      r"[\d.]+ \| [\d.]+ \| ([\d.]+) \|", md, re.M)
    assert len(rows) == sum(len(v) for v in rec.values()), rows
    for setup, rate, p50, p99, good in rows:
        pt = next(p for p in rec["colocated" if setup == "colocated" else "pd"] if p["rate"] == float(rate))
        assert (int(p50), int(p99)) == (round(pt["median_ttft_ms"]), round(pt["p99_ttft_ms"])), (setup, rate)
        assert float(good) == round(pt["request_goodput"], 2), (setup, rate)
