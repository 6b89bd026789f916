"""tools/scale_sim.py (docs/scaling.md): it runs on a generated trace and on a
trace file, prints the paper model and one table row per policy, and its model
behaves as the document says: with shared prefixes, the prefix policy hits the
prefill caches far more often than round robin and so does less prefill work."""
import json
import subprocess
import sys

from server_harness import ROOT

SIM = str(ROOT / "tools" / "scale_sim.py")


def rows(out):
    table = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] in ("random", "round_robin", "least_loaded", "p2c", "prefix"):
            table[cells[0]] = {"ttft_p99": float(cells[2]), "busy": float(cells[5]),
                               "hits": float(cells[6].rstrip("%")) / 100}
    return table


def test_generated_trace_ranks_policies():
    r = subprocess.run([sys.executable, SIM, "--prefills", "16", "--decodes", "32", "--rate", "100",
                        "--requests", "3000"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "paper model:" in r.stdout
    t = rows(r.stdout)
    assert set(t) == {"random", "round_robin", "least_loaded", "p2c", "prefix"}, r.stdout
    assert t["prefix"]["hits"] > t["round_robin"]["hits"] + 0.3, r.stdout
    assert t["prefix"]["busy"] < t["round_robin"]["busy"], r.stdout


def test_trace_file(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"t": i * 0.01, "in": 500, "out": 20, "prefix": i % 3,
                                         "prefix_len": 400}) + "\n" for i in range(400)))
    r = subprocess.run([sys.executable, SIM, "--trace", str(trace), "--prefills", "4", "--decodes", "4",
                        "--policies", "round_robin,prefix"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "400 requests" in r.stdout and set(rows(r.stdout)) == {"round_robin", "prefix"}, r.stdout
