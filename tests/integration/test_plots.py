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
