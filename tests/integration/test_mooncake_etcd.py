"""disagg segments in etcd in Mooncake's metadata layout (optional
part): `disagg transfer target --metadata-server etcd://...` puts its
descriptor under mooncake/ram/<segment> and mooncake/rpc_meta/<segment>, and
the real Mooncake wheel, initialised with the same etcd as its metadata server
(not P2PHANDSHAKE), finds the segment by name and READs and WRITEs it; the
keys go when the target stops.  Skips, naming why, without the wheel or etcd."""
import json
import subprocess
import sys
import warnings

import pytest

from conftest import child_env, read_line
from etcd_harness import etcd_factory  # noqa: F401 (fixture)
from server_harness import free_port
from test_mooncake_interop import HERE, HOST, Mooncake, cases, wheel_problem

pytestmark = pytest.mark.timeout(120)


def test_mooncake_finds_disagg_segment_in_etcd(etcd_factory, start_target, reaper, tmp_path):
    problem = wheel_problem()
    if problem:
        warnings.warn(problem)
        pytest.skip(problem)
    etcd = etcd_factory(1)
    url = etcd.url("")
    t = start_target(protocol="tcp", host=HOST, buffer_size=2 << 20, buffers=2, pattern=99,
                     extra=["--metadata-server", url])
    keys = etcd.range("mooncake/")
    desc = keys[f"mooncake/ram/{t.segment}"]
    assert desc["name"] == t.segment and desc["protocol"] == "tcp"
    assert sorted(b["addr"] for b in desc["buffers"]) == [b["addr"] for b in t.buffers]
    assert keys[f"mooncake/rpc_meta/{t.segment}"] == {"ip_or_host_name": HOST,
                                                      "rpc_port": int(t.segment.rsplit(":", 1)[1])}

    err_path = tmp_path / "mooncake.stderr"
    with open(err_path, "wb") as err:
        proc = reaper.popen([sys.executable, str(HERE / "mooncake_driver.py"), HOST, str(4 << 20), "5", url],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=child_env())
    line = read_line(proc.stdout.fileno(), timeout=60)
    assert line, err_path.read_text(errors="replace")[-3000:]
    mc = Mooncake(proc, json.loads(line), err_path, 5)
    assert "mooncake/ram/" + mc.segment in etcd.range("mooncake/")  # it uses etcd, not P2P
    blen = t.buffers[0]["length"]
    for k, off, n in cases(blen):
        rc, got = mc.read(t.segment, t.buffers[k]["addr"] + off, n, offset=5)
        assert rc == 0, f"READ through etcd metadata failed ({rc}):\n{mc.stderr()[-2000:]}"
        assert got == t.expected(k, off, n)
    data = bytes(range(256)) * 16
    assert mc.write(t.segment, t.buffers[1]["addr"] + 100, data) == 0
    rc, got = mc.read(t.segment, t.buffers[1]["addr"] + 100, len(data), offset=8192)
    assert rc == 0 and got == data
    rc, _ = t.stop()
    assert rc == 0, t.stderr()
    assert f"mooncake/ram/{t.segment}" not in etcd.range("mooncake/")
    assert f"mooncake/rpc_meta/{t.segment}" not in etcd.range("mooncake/")


def test_metadata_server_errors(disagg_bin):
    for url, needle in ((f"etcd://127.0.0.1:{free_port()}", "no etcd endpoint answered"),
                        ("etcd://127.0.0.1:2379/prefix", "Mooncake's keys have no prefix"),
                        ("etcd://nohost", "is not accepted")):
        r = subprocess.run([disagg_bin, "transfer", "target", "--protocol", "tcp", "--host", HOST,
                            "--buffer-size", "4096", "--metadata-server", url],
                           capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode != 0 and needle in r.stderr, r.stderr
