"""Discovery through etcd across hosts (network
namespaces as the multi-host tests use): four "hosts", a 3-member etcd cluster on three of them, two
prefill and three decode instances (a third prefill joins later), two proxies
in the root namespace.  An
instance that joins on another host is used; a host cut off the LAN (its link
down: its instance and its etcd member unreachable, nothing killed) leaves
the rotation when its lease expires, while the other two members keep quorum
and every request succeeds; when the link comes back the instance
registers again and is used."""
import time

import pytest

import netns
from etcd_harness import Etcd, need_etcd
from netns import COMMON, NsServer, kv_config
from test_discovery import PREFIX, TTL, Proxy, wait_for

_reason = netns.skip_reason()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.timeout(200)]


def serve(host, role, url, port=8100, boot=8998):
    return NsServer(host, *COMMON, "--kv-transfer-config",
                    kv_config("kv_producer" if role == "prefill" else "kv_consumer"),
                    "--discovery", url, "--discovery-ttl", TTL, port=port,
                    env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot)})


def test_hosts_join_partition_and_return(tmp_path):
    need_etcd()
    with netns.Cluster(n_hosts=4, kv_links=(), link_pairs=()) as c:
        h = c.hosts
        etcd = Etcd(tmp_path / "etcd", 3, hosts=h[:3])
        url = etcd.url(PREFIX)
        ps = [serve(h[0], "prefill", url), serve(h[1], "prefill", url)]
        ds = [serve(h[2], "decode", url), serve(h[3], "decode", url),
              serve(h[0], "decode", url, port=8101)]
        a, b = Proxy(url, logdir=tmp_path), Proxy(url, logdir=tmp_path)
        try:
            for px in (a, b):
                wait_for(lambda: px.in_rotation("prefill") == 2 and px.in_rotation("decode") == 3,
                         15, "five instances on four hosts")
            recs = etcd.range(PREFIX + "/instances/")
            assert {r["url"] for r in recs.values()} == {s.url for s in ps + ds}
            assert recs[f"{PREFIX}/instances/prefill/{h[1].lan_ip}:8100"]["bootstrap"] == \
                f"http://{h[1].lan_ip}:8998"
            for px in (a, b):
                wait_for(lambda: all(px.ready_for(type("I", (), {"role": r, "url": s.url}))
                                     for r, s in [("prefill", p) for p in ps] + [("decode", d) for d in ds]),
                         15, "all probed ready")
                for k in range(4):
                    r = px.complete(prompt=f"hello from host test {k}")
                    assert r.status_code == 200, r.text

            # a third prefill joins on the fourth host: used without a restart
            p3 = serve(h[3], "prefill", url, port=8101, boot=8999)
            p3i = type("I", (), {"role": "prefill", "url": p3.url})

            def used():
                assert a.complete().status_code == 200
                return a.sent_to(p3i) > 0
            wait_for(used, 15, "a request on the new host's prefill")

            # host 1 cut off the LAN: its prefill and its etcd member are unreachable
            h[1].link_set("lan0", "down")
            t0 = time.time()
            gone = lambda px: px.in_rotation("prefill") == 2  # noqa: E731
            wait_for(lambda: gone(a) and gone(b), 20, "the cut-off prefill out of rotation")
            print(f"\ncut-off host's prefill out of rotation after {time.time() - t0:.1f} s (TTL {TTL} s)")
            assert "its etcd key is gone" in a.logs()
            for px in (a, b):
                for k in range(6):
                    r = px.complete(prompt=f"while host 1 is away {k}")
                    assert r.status_code == 200, r.text
            assert a.metrics()["disagg_proxy_discovery_connected"] == 1  # two members left: quorum

            # the link back: the instance registers again and is used again
            h[1].link_set("lan0", "up")
            wait_for(lambda: a.in_rotation("prefill") == 3 and b.in_rotation("prefill") == 3, 30,
                     "the prefill of host 1 back")
            p1i = type("I", (), {"role": "prefill", "url": ps[1].url})
            before = a.sent_to(p1i)

            def used_again():
                assert a.complete().status_code == 200
                return a.sent_to(p1i) > before
            wait_for(used_again, 15, "a request on host 1's prefill again")
            for x in (a, b):
                assert x.stop() == 0, x.logs()
            for s in ps + ds + [p3]:
                assert s.stop() == 0, s.logs()
        finally:
            for px in (a, b):
                if px.proc.poll() is None:
                    px.proc.kill()
            etcd.stop_all()
