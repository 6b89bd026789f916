"""`disagg transfer` command line: --help for the command and every
subcommand; bad input exits 2 with a message naming the bad value and what is
accepted, before anything connects or serves."""
import pytest

from conftest import run_cli

pytestmark = pytest.mark.timeout(60)

SUBS = ["target", "copy", "check", "demo"]


def test_transfer_help(disagg_bin):
    p = run_cli(disagg_bin, "transfer", "--help")
    assert p.returncode == 0
    out = p.stdout.decode()
    for sub in SUBS:
        assert sub in out


def test_transfer_without_sub_is_usage_error(disagg_bin):
    p = run_cli(disagg_bin, "transfer")
    assert p.returncode == 2 and b"usage: disagg transfer" in p.stderr


@pytest.mark.parametrize("sub", SUBS)
def test_sub_help(disagg_bin, sub):
    p = run_cli(disagg_bin, "transfer", sub, "--help")
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.decode()
    assert out.startswith(f"usage: disagg transfer {sub}")
    assert "--protocol" in out


SEG = "127.0.0.1:1"  # never contacted: every case fails in parsing

BAD = [
    (["frobnicate"], ["'frobnicate'", "target, copy, check, demo"]),
    (["target", "--buffer-size", "12Q"], ["--buffer-size", "'12Q'", "K, M, G"]),
    (["target", "--buffer-size", "0"], ["'0'", "1.."]),
    (["target", "--buffer-size", "-5"], ["'-5'"]),
    (["target", "--buffers", "0"], ["--buffers", "'0'", "1..64"]),
    (["target", "--buffers", "65"], ["'65'", "1..64"]),
    (["target", "--protocol", "udp"], ["'udp'", "auto, tcp, shm, rdma"]),
    (["target", "--port", "70000"], ["--port", "'70000'", "0..65535"]),
    (["target", "--port"], ["--port", "needs a value"]),
    (["target", "--pattern", "abc"], ["--pattern", "'abc'"]),
    (["target", "--frobnicate"], ["'--frobnicate'", "--buffer-size"]),
    (["target", "stray"], ["'stray'"]),
    (["target", "--exit-on-stdin-eof=yes"], ["--exit-on-stdin-eof", "'yes'"]),
    (["copy", "--op", "read", "--remote-addr", "1", "--length", "1"], ["--target", "required"]),
    (["copy", "--target", "nocolon", "--op", "read"], ["'nocolon'", "ip:port"]),
    (["copy", "--target", "1.2.3.4:0", "--op", "read"], ["'1.2.3.4:0'", "1..65535"]),
    (["copy", "--target", SEG, "--op", "frob", "--remote-addr", "1", "--length", "1"], ["'frob'", "read, write"]),
    (["copy", "--target", SEG, "--op", "read", "--remote-addr", "xyz", "--length", "1"], ["'xyz'", "0x-hex"]),
    (["copy", "--target", SEG, "--op", "read", "--remote-addr", "0xZZ", "--length", "1"], ["'0xZZ'"]),
    (["copy", "--target", SEG, "--op", "read", "--remote-addr", "1", "--length", "0"], ["--length", "'0'"]),
    (["copy", "--target", SEG, "--op", "read", "--remote-addr", "1"], ["--length", "required"]),
    (["copy", "--target", SEG, "--op", "read", "--remote-addr", "1", "--length", "1", "--in", "f"], ["--in", "'f'", "write only"]),
    (["copy", "--target", SEG, "--op", "write", "--remote-addr", "1", "--length", "1", "--out", "f"], ["--out", "'f'", "read only"]),
    (["copy", "--target", SEG, "--op", "read", "--remote-addr", "1", "--length", "1", "--timeout-ms", "0"], ["--timeout-ms", "'0'"]),
    (["check"], ["--target", "required"]),
    (["check", "--target", SEG, "--iterations", "-1"], ["--iterations", "'-1'"]),
    (["check", "--target", SEG, "--batch", "0"], ["--batch", "'0'", "1..1024"]),
    (["check", "--target", SEG, "--batch", "5000"], ["'5000'", "1..1024"]),
    (["check", "--target", SEG, "--max-length", "2G"], ["--max-length", "'2G'"]),
    (["check", "--target", SEG, "--seed", "1.5"], ["--seed", "'1.5'"]),
    (["check", "--target", "[::1:80", "--iterations", "1"], ["'[::1:80'"]),
    (["demo", "--protocol", "ib"], ["'ib'", "auto, tcp, shm, rdma"]),
    (["demo", "--buffer-size", "1X"], ["'1X'"]),
]


@pytest.mark.parametrize("args,needles", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exits_2_naming_the_value(disagg_bin, args, needles):
    p = run_cli(disagg_bin, "transfer", *args, timeout=10)
    err = p.stderr.decode()
    assert p.returncode == 2, f"rc {p.returncode}: {err}"
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    assert p.stdout == b""


def test_sizes_accept_suffixes(disagg_bin, start_target):
    """64K, 1MiB and plain bytes are all sizes the target accepts."""
    for size, want in (("64K", 64 << 10), ("1MiB", 1 << 20), ("12345", 12345)):
        t = start_target(buffer_size=size)
        assert t.buffers[0]["length"] == want
        rc, stats = t.stop()
        assert rc == 0 and stats["event"] == "stats"


def test_target_stops_on_sigterm(disagg_bin, reaper):
    import json
    import signal
    import subprocess
    from conftest import read_line
    p = reaper.popen([disagg_bin, "transfer", "target", "--buffer-size", "4K"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    info = json.loads(read_line(p.stdout.fileno(), 20))
    assert info["pid"] == p.pid and len(info["buffers"]) == 1
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 0
    assert json.loads(p.stdout.read().decode().strip().splitlines()[-1])["event"] == "stats"


# `disagg bench transfer --location cuda:N` (device memory on both sides): bad values exit 2
# naming the value and what is accepted; without a GPU (CI) it exits 1 saying why.
BENCH_BAD = [
    (["--location", "cpu"], ["--location", "'cpu'", "cuda:N"]),
    (["--location", "cuda:x"], ["'cuda:x'", "cuda:N"]),
    (["--location", "cuda:0", "--tokens", "0"], ["--tokens", "'0'", "[1, 1048576]"]),
    (["--location", "cuda:0", "--kv-shape", "28,4"], ["--kv-shape", "'28,4'", "L,H,D"]),
    (["--location", "cuda:0", "--protocol", "nvlink"], ["'nvlink'", "cuda_ipc, tcp"]),
    (["--location", "cuda:0", "--reps", "0"], ["--reps", "'0'"]),
    (["--location", "cuda:0", "--mode", "initiator"], ["--mode", "'initiator'", "target"]),
    (["--location", "cuda:0", "--frob", "1"], ["'--frob'", "--tokens"]),
]


@pytest.mark.parametrize("args,needles", BENCH_BAD, ids=[" ".join(a) for a, _ in BENCH_BAD])
def test_bench_transfer_location_bad_input(disagg_bin, args, needles):
    p = run_cli(disagg_bin, "bench", "transfer", *args, timeout=10)
    err = p.stderr.decode()
    assert p.returncode == 2, f"rc {p.returncode}: {err}"
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"


def test_bench_transfer_location_without_gpu_says_why(disagg_bin):
    p = run_cli(disagg_bin, "bench", "transfer", "--location", "cuda:0", timeout=30)
    if p.returncode == 0:
        pytest.skip("a GPU is here: the benchmark ran (scripts/gpu_check.sh covers it)")
    err = p.stderr.decode()
    assert p.returncode == 1, err
    assert "--location cuda:0" in err and ("CUDA" in err or "module" in err), err


# `disagg bench transfer` (host memory): its options come from one table (base/flags): each bad
# value exits 2 naming the flag, the value and what is accepted; a misspelt flag gets its
# closest name.  Nothing is mapped or served before the parse is through.
BENCH_CPU_BAD = [
    (["--mode", "both"], ["--mode", "'both'", "target, initiator"]),
    (["--protocol", "udp"], ["--protocol", "'udp'", "tcp, shm"]),
    (["--protocol", "tcp,tcp"], ["'tcp,tcp'", "the list tcp,shm"]),
    (["--operation", "copy"], ["--operation", "'copy'", "read, write"]),
    (["--block-size", "4K,,1M"], ["--block-size", "'4K,,1M'", "single commas"]),
    (["--block-size", "2G"], ["--block-size", "'2G'", "1..1G"]),
    (["--batch-size", "0"], ["--batch-size", "'0'", "[1, 65536]"]),
    (["--batch_size", "70000"], ["--batch-size", "'70000'", "[1, 65536]"]),
    (["--threads", "65"], ["--threads", "'65'", "[1, 64]"]),
    (["--duration", "0"], ["--duration", "'0'", "500ms"]),
    (["--rounds", "10"], ["--rounds", "'10'", "[1, 9]"]),
    (["--buffer-size", "1X"], ["--buffer-size", "'1X'", "K, M, G"]),
    (["--hugepages", "maybe"], ["--hugepages", "'maybe'", "on, off"]),
    (["--port", "70000"], ["--port", "'70000'", "[0, 65535]"]),
    (["--device-name="], ["--device-name", "''"]),
    (["--verify=yes"], ["--verify", "takes no value"]),
    (["--thread", "2"], ["'--thread'", "did you mean --threads?"]),
    (["stray"], ["'stray'"]),
    (["--mode", "initiator"], ["--segment-id", "needs"]),
    (["--mode", "initiator", "--segment-id", "nocolon"], ["--segment-id", "'nocolon'", "IP:PORT"]),
    (["--segment-id", "127.0.0.1:1"], ["--segment-id", "only for --mode initiator"]),
    (["--port", "5"], ["--port", "only for --mode target"]),
    (["--mode", "target", "--protocol", "tcp,shm"], ["--mode target serves one --protocol"]),
]


@pytest.mark.parametrize("args,needles", BENCH_CPU_BAD, ids=[" ".join(a) for a, _ in BENCH_CPU_BAD])
def test_bench_transfer_bad_input(disagg_bin, args, needles):
    p = run_cli(disagg_bin, "bench", "transfer", *args, timeout=10)
    err = p.stderr.decode()
    assert p.returncode == 2, f"rc {p.returncode}: {err}"
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    assert p.stdout == b""


def test_bench_transfer_help_is_generated_from_its_table(disagg_bin):
    p = run_cli(disagg_bin, "bench", "transfer", "--help")
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.decode()
    assert out.startswith("usage: disagg bench transfer")
    for flag in ("--mode", "--protocol", "--operation", "--block-size", "--batch-size",
                 "--threads", "--duration", "--rounds", "--device-name", "--local-hostname",
                 "--segment-id", "--port", "--buffer-size", "--verify", "--hugepages", "--json",
                 "--location", "--no-ceilings"):
        assert f"\n  {flag} " in out, flag


def test_every_target_prints_the_same_ready_line(disagg_bin, reaper):
    """`disagg transfer target` and `disagg bench transfer --mode target` print one ready
    line format (one JSON object: segment, tcp_data_port, pid, auth, protocol, buffers), and
    the bench initiator runs against the segment read from it."""
    import json
    import signal
    import subprocess
    from conftest import read_line
    lines = {}
    for name, args in (("harness", ["transfer", "target", "--protocol", "tcp", "--buffer-size", "64K"]),
                       ("bench", ["bench", "transfer", "--mode", "target", "--buffer-size",
                                  "64K", "--local-hostname", "127.0.0.1"])):
        p = reaper.popen([disagg_bin, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
        lines[name] = (p, json.loads(read_line(p.stdout.fileno(), 20)))
    keys = {"segment", "tcp_data_port", "pid", "auth", "protocol", "buffers"}
    for name, (p, info) in lines.items():
        assert keys <= set(info), (name, info)
        assert info["pid"] == p.pid and info["protocol"] == "tcp" and info["auth"] is False
        assert [set(b) for b in info["buffers"]] == [{"addr", "length", "location"}]
        assert info["buffers"][0]["length"] == 64 << 10
    p, info = lines["bench"]
    r = run_cli(disagg_bin, "bench", "transfer", "--mode", "initiator", "--segment-id",
                info["segment"], "--local-hostname", "127.0.0.1", "--block-size", "4K",
                "--batch-size", "4", "--duration", "0.05", "--rounds", "1", "--no-ceilings",
                "--verify", "--json", timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["runs"][0]["rows"][0]["ops"] > 0
    for p, _ in lines.values():
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0
