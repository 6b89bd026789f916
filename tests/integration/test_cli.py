"""The disagg binary's command-line surface: help, version, bad commands."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("DISAGG_BIN", str(ROOT / "build" / "disagg"))


def run(*args):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=30)


def test_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0
    for cmd in ("transfer", "bench"):
        assert cmd in r.stdout


def test_no_command_is_usage_error():
    r = run()
    assert r.returncode == 2
    assert "usage: disagg" in r.stderr


def test_unknown_command_names_it_and_the_accepted_ones():
    r = run("frobnicate")
    assert r.returncode == 2
    assert "'frobnicate'" in r.stderr and "transfer" in r.stderr


def test_bench_unknown_benchmark():
    r = run("bench", "warp-drive")
    assert r.returncode == 2
    assert "'warp-drive'" in r.stderr and "transfer" in r.stderr
