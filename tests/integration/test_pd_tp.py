"""Tensor-parallel pairing of a decode instance with its prefill instance
(docs/parallel.md), with real `disagg serve` processes and the producer's real bootstrap
server: once a second prefill TP rank is registered for the producer's engine id, the
decoder reads P's TP size from /query (two tp_rank keys), works out that its only rank
must pull from both prefill ranks, and fails the request with a message saying so,
instead of pulling only tp_rank 0 and decoding from half the KV heads; its blocks are
freed.  (Pulling from several prefill ranks per request is not built yet.)"""
import requests

from server_harness import free_port
from test_pd import BODY, PD, blocks_used, wait_blocks_zero


def test_a_tp2_prefill_is_refused_by_a_tp1_decoder_with_a_clear_error():
    pd = PD()
    try:
        p, d = pd.send(dict(BODY, prompt="The capital of France is"))
        assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
        # a second TP rank of the same prefill engine registers
        r = requests.post(pd.bootstrap + "/register", timeout=10, json={
            "engine_id": pd.engine_id, "dp_rank": 0, "tp_rank": 1, "pp_rank": 0,
            "addr": f"tcp://127.0.0.1:{free_port()}"})
        assert r.status_code == 200, r.text
        table = requests.get(pd.bootstrap + "/query", timeout=10).json()
        assert sorted(table["0"]["worker_addr"]) == ["0", "1"]
        p, d = pd.send(dict(BODY, prompt="The capital of Italy is"))
        assert d.status_code >= 500, d.text
        msg = d.json()["error"]["message"]
        assert f"prefill engine {pd.engine_id} has TP 2" in msg, msg
        assert "decode tp_rank 0 of 1 must pull from 2 prefill ranks" in msg, msg
        wait_blocks_zero(pd.d)
        assert blocks_used(pd.d) == 0
    finally:
        pd.stop()
