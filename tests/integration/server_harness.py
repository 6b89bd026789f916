"""Starts a real `disagg serve` process for the server integration tests
(tests/integration/test_server*.py) and stops it afterwards.

DISAGG_TEST_DEVICE=cpu|cuda|cuda:N runs every such server on that device (`--device`, unless
the test gives one itself; on a GPU without `--kv-cache-memory` or
`--gpu-memory-utilization` in the test's flags, `--kv-cache-memory 1G` so that several
servers share one GPU).  Unset: the binary's default (auto)."""
import os
import signal
import subprocess
import time
from pathlib import Path

import requests

from ports import free_port  # noqa: F401  (re-exported: the tests import it from here)

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("DISAGG_BIN", str(ROOT / "build" / "disagg"))
MODEL = ROOT / "models" / "disagg-sotu-tiny"
DATA = ROOT / "tests" / "data"


def device_args(extra):
    """The flags DISAGG_TEST_DEVICE adds to a `disagg serve` command line with flags extra."""
    dev = os.environ.get("DISAGG_TEST_DEVICE", "").strip()
    if not dev or "--device" in extra:
        return []
    if dev not in ("cpu", "cuda") and not (dev.startswith("cuda:") and dev[5:].isdigit()):
        raise RuntimeError(f"DISAGG_TEST_DEVICE={dev!r}; accepted: cpu, cuda, cuda:N")
    out = ["--device", dev]
    if dev != "cpu" and "--kv-cache-memory" not in extra and "--gpu-memory-utilization" not in extra:
        out += ["--kv-cache-memory", "1G"]
    return out


def on_gpu():
    """True when DISAGG_TEST_DEVICE puts the servers on a GPU."""
    return os.environ.get("DISAGG_TEST_DEVICE", "").strip().startswith("cuda")


# The CPU engine is exact against transformers' f32 reference (logprob differences < 0.002,
# greedy ids equal); the GPU computes in bf16 and is checked against references with bf16
# tolerances by test_cuda_model and tools/gpu_serve_smoke.py (docs/gpu.md).  Tests that pin
# the CPU's exactness skip on a GPU with this reason.
CPU_EXACT = "CPU-exact reference check (f32, tolerance 0.002); on the GPU bf16 tolerances apply (test_cuda_model, docs/gpu.md)"


class Server:
    """One `disagg serve` process on a free port; .url is http://127.0.0.1:PORT."""

    def __init__(self, *extra, model=str(MODEL), name="tiny", env=None, ready_timeout=180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [BIN, "serve"] + ([model] if model else []) + [
            "--host", "127.0.0.1", "--port", str(self.port), "--threads", "2",
        ]
        if name:
            args += ["--served-model-name", name]
        args += list(extra)
        args += device_args(extra)
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"disagg-serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        e = dict(os.environ)
        e.update(env or {})
        # never the default bootstrap port 8998: test processes run side by side
        e.setdefault("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(free_port()))
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        deadline = time.time() + ready_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"disagg serve exited with {self.proc.returncode}: {self.logs()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("disagg serve did not become ready: " + self.logs())

    def logs(self):
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()[-4000:]

    def metrics(self):
        """Prometheus text -> {name{labels}: value}."""
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def metric(self, name):
        """Sum of a series over its labels."""
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == name)

    def stop(self):
        """SIGTERM, then the exit status (0 = clean shutdown; sanitizer reports fail it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
