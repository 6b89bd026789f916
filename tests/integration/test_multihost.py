"""Multi-host P/D ("Multi-host tests"): the prefill instance runs in one
network namespace ("host"), the decode instance in another, the client (and the
proxy) in the root namespace, all joined by a LAN bridge (netns.Cluster).  Two
veth links between the hosts, veth-a and veth-b, act as two NICs:
kv_connector_extra_config.device_name decides which of them carry the KV bytes,
which the kernel's per-interface counters show.  Outputs are compared token for
token with a colocated `disagg serve` in the root namespace."""
import concurrent.futures as cf
import json

import pytest
import requests

import netns
from netns import COMMON, HostPD, wait_blocks_zero
from server_harness import Server
from test_pd import assert_kv_pulled

TIMEOUT = 120
WORDS = ("Fellow-Citizens of the Senate and House of Representatives: the state of the Union "
         "is strong, and our commerce with foreign nations has grown in every year of peace").split()
BODY = {"model": "tiny", "max_tokens": 16, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True}

_reason = netns.skip_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")


def prompt(n, salt=0):
    """n words of the corpus, rotated by salt so that prompts share no block."""
    return " ".join(WORDS[(i + salt) % len(WORDS)] for i in range(n)) + f" {salt}"


def completion_ids(r):
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return [int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]], c["text"], c["finish_reason"]


@pytest.fixture(scope="module")
def cluster():
    c = netns.Cluster()
    yield c
    c.close()


@pytest.fixture(scope="module")
def colocated():
    s = Server(*COMMON)
    yield s
    s.stop()


def reference(colocated, body):
    return completion_ids(requests.post(colocated.url + "/v1/completions", json=body, timeout=TIMEOUT))


def kv_counters(host):
    return {i: host.tx_bytes(i) for i in ("veth-a", "veth-b", "lan0")}


def run_and_count(cluster, colocated, device_name, n_requests=4, words=200):
    """n requests through a P/D pair with that device_name; each output checked
    against colocated; returns (bytes P sent per interface, KV bytes sent)."""
    p, d = cluster.hosts
    pd = HostPD(p, d, device_name=device_name)
    try:
        before = kv_counters(p)
        for k in range(n_requests):
            body = dict(BODY, prompt=prompt(words, salt=k))
            pr, dr = pd.send(body)
            assert pr.status_code == 200, pr.text
            assert completion_ids(dr) == reference(colocated, body)
            assert_kv_pulled(dr.json()["usage"])
        after = kv_counters(p)
        kv = pd.p.metric("disagg:kv_transfer_bytes_total")
        assert pd.p.metric("disagg:kv_transfers_total") == n_requests
        wait_blocks_zero(pd.p)
        wait_blocks_zero(pd.d)
        return {i: after[i] - before[i] for i in after}, kv
    finally:
        pd.stop()


def test_two_nics_both_carry_kv(cluster, colocated):
    sent, kv = run_and_count(cluster, colocated, "veth-a,veth-b")
    assert kv > 2_000_000, kv
    # The KV bytes (plus TCP/IP headers) left P on the two named links, each a share.
    assert sent["veth-a"] + sent["veth-b"] >= kv, (sent, kv)
    assert sent["veth-a"] > 0.2 * kv and sent["veth-b"] > 0.2 * kv, (sent, kv)
    # The LAN carried only HTTP, the side channel and the handshakes.
    assert sent["lan0"] < 0.05 * kv, (sent, kv)


def test_one_nic_named_carries_all_kv(cluster, colocated):
    sent, kv = run_and_count(cluster, colocated, "veth-b", n_requests=3)
    assert sent["veth-b"] >= kv, (sent, kv)
    assert sent["veth-a"] < 20_000, (sent, kv)  # nothing but stray link-local chatter
    assert sent["lan0"] < 0.05 * kv, (sent, kv)


def test_no_device_name_uses_the_advertised_host(cluster, colocated):
    """Without device_name the data path is the segment's host (VLLM_HOST_IP, the LAN)."""
    sent, kv = run_and_count(cluster, colocated, None, n_requests=2)
    assert sent["lan0"] >= kv, (sent, kv)
    assert sent["veth-a"] < 20_000 and sent["veth-b"] < 20_000, (sent, kv)


def test_unknown_device_name_fails_startup_clearly(cluster):
    p, _ = cluster.hosts
    with pytest.raises(RuntimeError) as e:
        netns.NsServer(p, *COMMON, "--kv-transfer-config",
                       netns.kv_config("kv_producer", "veth-a,eth-missing"), port=8199)
    assert "eth-missing" in str(e.value)


@pytest.fixture(scope="module")
def pd2(cluster):
    p, d = cluster.hosts
    x = HostPD(p, d, device_name="veth-a,veth-b", port=8110, boot_port=8997)
    yield x
    x.stop()


@pytest.mark.parametrize("words", [1, 15, 33, 120, 400])
def test_pd_across_hosts_equals_colocated(pd2, colocated, words):
    body = dict(BODY, prompt=prompt(words, salt=words), max_tokens=24)
    pr, dr = pd2.send(body)
    assert pr.status_code == 200, pr.text
    assert pr.json()["kv_transfer_params"] is None
    assert completion_ids(dr) == reference(colocated, body)
    assert_kv_pulled(dr.json()["usage"])


def test_pd_across_hosts_seeded_and_chat_stream(pd2, colocated):
    body = dict(BODY, prompt=prompt(64, salt=3), temperature=0.9, top_p=0.95, seed=77, max_tokens=24)
    _, dr = pd2.send(body)
    assert completion_ids(dr) == reference(colocated, body)
    assert_kv_pulled(dr.json()["usage"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "What is the state of the Union?"}],
            "max_tokens": 20, "temperature": 0}
    ref = requests.post(colocated.url + "/v1/chat/completions", json=chat, timeout=TIMEOUT).json()
    pr, dr = pd2.send(dict(chat, stream=True, stream_options={"include_usage": True}),
                      endpoint="/v1/chat/completions")
    assert pr.status_code == 200 and dr.status_code == 200, (pr.text, dr.text)
    import json
    text = ""
    for line in dr.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for ch in json.loads(line[6:]).get("choices", []):
                text += ch.get("delta", {}).get("content") or ""
    assert text == ref["choices"][0]["message"]["content"]


def test_pd_across_hosts_concurrent(pd2, colocated):
    bodies = [dict(BODY, prompt=prompt(40 + i, salt=100 + i), max_tokens=8) for i in range(12)]
    with cf.ThreadPoolExecutor(12) as ex:
        refs = list(ex.map(lambda b: reference(colocated, b), bodies))
        outs = list(ex.map(pd2.send, bodies))
    for (pr, dr), ref in zip(outs, refs):
        assert pr.status_code == 200, pr.text
        assert completion_ids(dr) == ref
        assert_kv_pulled(dr.json()["usage"])
    wait_blocks_zero(pd2.p)
    wait_blocks_zero(pd2.d)


# ---- striping over two rate-limited links ------------------------------------------------------

RATE_MBIT = 200  # per link (tc tbf on the prefill host's side)


def bench_write(cluster, device_name):
    """`disagg bench transfer` between the hosts: a target on d advertising the
    links of device_name, an initiator on p writing 1 MiB blocks; returns GB/s."""
    import subprocess
    p, d = cluster.hosts
    t = d.popen([netns.BIN, "bench", "transfer", "--mode", "target", "--protocol", "tcp",
                 "--device-name", device_name, "--local-hostname", d.lan_ip, "--buffer-size", "128M"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = t.stdout.readline()  # the target's ready line: one JSON object
        seg = json.loads(line)["segment"]
        r = p.run(netns.BIN, "bench", "transfer", "--mode", "initiator", "--protocol", "tcp",
                  "--device-name", device_name, "--segment-id", seg, "--operation", "write",
                  "--block-size", "1M", "--batch-size", "32", "--duration", "1", "--rounds", "1",
                  "--no-ceilings", "--json", timeout=90)
        row = json.loads(r.stdout)["runs"][0]["rows"][0]
        return row["gbps"]
    finally:
        t.terminate()
        t.wait(10)


def test_striping_over_two_rate_limited_links_doubles_throughput(cluster):
    """Each KV link limited to RATE_MBIT: one link moves about RATE_MBIT/8 MB/s,
    both about twice that (docs/multihost.md records the numbers)."""
    p, _ = cluster.hosts
    try:
        for i in ("veth-a", "veth-b"):
            p.rate_limit(i, RATE_MBIT)
        one = bench_write(cluster, "veth-a")
        two = bench_write(cluster, "veth-a,veth-b")
    finally:
        for i in ("veth-a", "veth-b"):
            p.rate_limit(i, None)
    print(f"\nKV write throughput, links at {RATE_MBIT} Mbit/s: one link {one * 1000:.1f} MB/s, "
          f"two links {two * 1000:.1f} MB/s, ratio {two / one:.2f}")
    limit = RATE_MBIT / 8 / 1000  # GB/s
    assert 0.7 * limit < one < 1.1 * limit, one
    assert two > 1.6 * one, (one, two)
