"""The connector's transfer engine with a shared secret ($DISAGG_KV_SECRET;
docs/transfer.md, Security): a P/D pair with the same secret moves its KV over
authenticated transfer ports and D's output equals the colocated one, while
P's and D's transfer segments refuse a `disagg transfer copy` without the
secret or with another; a pair whose secrets differ moves no KV byte, says
why, and the request still ends (no hang)."""
import concurrent.futures as cf
import json
import re
import subprocess
import uuid

import pytest
import requests

from conftest import child_env
from server_harness import DATA, Server, free_port

pytestmark = pytest.mark.timeout(300)

GREEDY = json.loads((DATA / "sotu-tiny" / "greedy.json").read_text())


def kv_config(role):
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})


def start_pair(p_secret, d_secret):
    boot = free_port()
    env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot), "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "20"}
    p = Server("--kv-cache-memory", "64M", "--max-model-len", "512", "--kv-transfer-config",
               kv_config("kv_producer"), env={**env, "DISAGG_KV_SECRET": p_secret})
    try:
        d = Server("--kv-cache-memory", "64M", "--max-model-len", "512", "--kv-transfer-config",
                   kv_config("kv_consumer"), env={**env, "DISAGG_KV_SECRET": d_secret})
    except Exception:
        p.stop()
        raise
    return p, d, f"http://127.0.0.1:{boot}"


def pd_request(p, d, boot, prompt):
    engine_id = requests.get(boot + "/query", timeout=10).json()["0"]["engine_id"]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    xfer = f"xfer-{uuid.uuid4()}"
    to_p = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                                       "transfer_id": xfer})
    to_d = dict(body, kv_transfer_params={"do_remote_decode": False, "do_remote_prefill": True,
                                          "remote_engine_id": engine_id, "remote_bootstrap_addr": boot,
                                          "transfer_id": xfer})
    with cf.ThreadPoolExecutor(2) as ex:
        fp = ex.submit(requests.post, p.url + "/v1/completions", json=to_p,
                       headers={"X-Request-Id": str(uuid.uuid4())}, timeout=120)
        fd = ex.submit(requests.post, d.url + "/v1/completions", json=to_d, timeout=120)
        return body, fp.result(), fd.result()


def prompt():
    return [c for c in GREEDY["prompts"] if c["kind"] == "text"][0]["prompt"] * 3


def test_same_secret_moves_kv(disagg_bin):
    p, d, boot = start_pair("pd-secret", "pd-secret")
    try:
        body, rp, rd = pd_request(p, d, boot, prompt())
        assert rp.status_code == 200 and rd.status_code == 200, rd.text
        colocated = requests.post(p.url + "/v1/completions", json=body, timeout=120).json()
        assert rd.json()["choices"][0]["text"] == colocated["choices"][0]["text"]
        assert p.metric("disagg:kv_transfer_bytes_total") > 0
        assert "refused handshake" not in p.logs() + d.logs()
        # The connector gave its transfer engine the secret: its segments
        # refuse initiators without it, or with another.
        for srv in (p, d):
            seg = re.search(r"transfer segment (\S+),", srv.logs()).group(1)
            for secret, why in ((None, "authentication required"), ("wrong", "does not verify")):
                env = child_env()
                env.pop("DISAGG_KV_SECRET", None)
                if secret:
                    env["DISAGG_KV_SECRET"] = secret
                r = subprocess.run([disagg_bin, "transfer", "copy", "--target", seg, "--op", "read",
                                    "--remote-addr", "4096", "--length", "8", "--protocol", "tcp"],
                                   capture_output=True, timeout=60, env=env)
                assert r.returncode == 1 and why in r.stderr.decode(), r.stderr.decode()
    finally:
        rd_, rp_ = d.stop(), p.stop()
    assert rd_ == 0 and rp_ == 0


def test_different_secrets_move_no_kv():
    p, d, boot = start_pair("pd-secret", "another-secret")
    try:
        _, rp, rd = pd_request(p, d, boot, prompt())
        assert rp.status_code == 200
        # D either fails the request or recomputes it (kv_load_failure_policy);
        # either way no KV byte moved and the refusal is named.
        assert rd.status_code in (200, 500, 502, 503), rd.text
        # Whichever port refuses first (side channel or transfer engine) names it.
        if rd.status_code != 200:
            assert "authentication failed" in rd.text or "auth_secret differs" in rd.text, rd.text
        assert p.metric("disagg:kv_transfer_bytes_total") == 0
        logs = p.logs() + d.logs()
        assert re.search(r"auth_secret|authentication failed", logs), logs[-4000:]
    finally:
        d.stop()
        p.stop()
