"""P/D across TP sizes on the CPU (docs/benchmarks.md "P/D across TP sizes"): for each pairing
P TP -> D TP, real `disagg serve -tp N` producer and consumer (tests/integration/test_pd_tp.py's
PDTP, the tiny model), REQUESTS requests of a TOKENS-word prompt each with a new first word (no
prefix-cache hit), and prints per pairing: KV bytes and descriptors P wrote per request, P's
write time per pull (disagg:kv_send_seconds) and D's load time (disagg:kv_load_seconds: pull
sent to KV in place, P's prefill included).

    DISAGG_BUILD=build python3 tools/bench_pd_tp.py [TOKENS [REQUESTS]]
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "integration"))
from test_pd_tp import BODY, PDTP, corpus_prompts  # noqa: E402


def metric(srv, name):
    return sum(v for k, v in srv.metrics().items() if k.split("{")[0] == name)


def main():
    n_words = int(sys.argv[1]) if len(sys.argv) > 1 else 700
    n_req = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    words = corpus_prompts()[8].split()
    prompt = " ".join(words[i % len(words)] for i in range(n_words))
    print("| P TP → D TP | prompt tokens | KV per request | descriptors per request | "
          "P's writes per pull | load (median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for p_tp, d_tp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        pd = PDTP(p_tp, d_tp)
        try:
            loads = []
            for i in range(n_req):
                l0 = metric(pd.d, "disagg:kv_load_seconds_sum")
                c0 = metric(pd.d, "disagg:kv_load_seconds_count")
                _, d = pd.send(dict(BODY, prompt=f"{i} " + prompt, max_tokens=2))
                assert d.status_code == 200, d.text
                loads.append((metric(pd.d, "disagg:kv_load_seconds_sum") - l0) /
                             max(metric(pd.d, "disagg:kv_load_seconds_count") - c0, 1))
            sends = metric(pd.p, "disagg:kv_send_seconds_count")
            send_s = metric(pd.p, "disagg:kv_send_seconds_sum") / max(sends, 1)
            desc = metric(pd.p, "disagg:kv_transfer_descriptors_total") / n_req
            mb = metric(pd.p, "disagg:kv_transfer_bytes_total") / n_req / 1e6
            print(f"| {p_tp} → {d_tp} | {d.json()['usage']['prompt_tokens']} | {mb:.2f} MB | "
                  f"{desc:.0f} | {send_s * 1e3:.1f} ms ({sends / n_req:.0f} pulls) | "
                  f"{statistics.median(loads) * 1e3:.0f} ms |", flush=True)
        finally:
            pd.stop()


if __name__ == "__main__":
    main()
