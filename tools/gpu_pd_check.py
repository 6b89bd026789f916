#!/usr/bin/env python3
"""gpu_pd_check — P/D with the KV cache in HBM, end to end on a GPU machine
(scripts/gpu_check.sh, step "P/D on the GPU"): a kv_producer and a kv_consumer, each a
`disagg serve --device cuda` process on the one GPU, behind `disagg proxy`, and the official
`openai` client in front; answers compared with a colocated `disagg serve --device cuda`.

Two rounds: the connector's default protocol (no NIC here: device memory of a same-host peer
goes over cuda_ipc) and `mooncake_protocol: "tcp"` (staged through pinned host buffers).
Each round: the golden prompts (tests/data/sotu-tiny/greedy.json) as completions and one
chat, greedy, must equal colocated; usage.kv_transfer must say D received the prompt's KV
and computed one token; P's per-transport counters
(disagg:kv_transfer_transport_requests_total{transport=...}) must show every request on the
round's transport and none on another, and P's log must name it; 16 concurrent requests
must equal their single answers.  Then TTFT (streamed, median of 9) at a long prompt, P/D
vs colocated, printed (not a pass/fail).  Exit 1 on any mismatch or failure.
Usage: python3 tools/gpu_pd_check.py BIN MODEL_DIR LOGDIR"""
import concurrent.futures as cf
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

import openai
import requests

BIN, MODEL, LOGDIR = sys.argv[1:4]
HERE = os.path.dirname(os.path.abspath(__file__))
golden = json.load(open(os.path.join(HERE, "..", "tests", "data", "sotu-tiny", "greedy.json")))
PROMPTS = [p["prompt_text"] for p in golden["prompts"]]
COMMON = ["--device", os.environ.get("DISAGG_PD_DEVICE", "cuda"), "--max-model-len", "2048", "--kv-cache-memory", "256M",
          "--block-size", "16", "--served-model-name", "tiny"]
bad = 0


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Proc:
    def __init__(self, name, args, env=None, health="/health"):
        self.port = free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        self.log_path = os.path.join(LOGDIR, "pd-%s.log" % name)
        self.log = open(self.log_path, "w")
        e = dict(os.environ)
        e.update(env or {})
        self.p = subprocess.Popen([BIN] + [a.replace("{port}", str(self.port)) for a in args],
                                  stdout=self.log, stderr=subprocess.STDOUT, env=e)
        for _ in range(900):
            if self.p.poll() is not None:
                raise SystemExit("%s exited %d: %s" % (name, self.p.returncode, self.text()[-3000:]))
            try:
                if requests.get(self.url + health, timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise SystemExit("%s did not come up: %s" % (name, self.text()[-3000:]))

    def text(self):
        self.log.flush()
        return open(self.log_path).read()

    def metrics(self):
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def serve(name, *extra, env=None):
    return Proc(name, ["serve", MODEL, "--host", "127.0.0.1", "--port", "{port}", *COMMON, *extra], env=env)


def kv_cfg(role, proto):
    extra = {"mooncake_protocol": proto} if proto else {}
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "kv_connector_extra_config": extra})


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def complete(url, prompt, n=32, **kw):
    return client(url).completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, **kw)


def ttft(url, prompt, n=9):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        for c in client(url).completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                                stream=True):
            if c.choices and c.choices[0].text:
                out.append(time.perf_counter() - t0)
                break
    return statistics.median(out) * 1e3


def check(cond, what):
    global bad
    print(("  ok: " if cond else "  *** FAILED: ") + what)
    bad += not cond


TRANSPORTS = ("tcp", "shm", "rdma", "cuda_ipc")
TREQ = 'disagg:kv_transfer_transport_requests_total{transport="%s"}'
TBYTES = 'disagg:kv_transfer_transport_bytes_total{transport="%s"}'

colo = serve("colocated")
want = {p: complete(colo.url, p).choices[0].text for p in PROMPTS}
chat_kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell the Congress about trade."}],
               max_tokens=24, temperature=0)
want_chat = client(colo.url).chat.completions.create(**chat_kw).choices[0].message.content
long_prompt = "The state of the Union is strong, and the Congress " * 150  # ~1.5k tokens
ttft_colo = ttft(colo.url, long_prompt)
results = []
for proto, expect in ((None, "cuda_ipc"), ("tcp", "tcp")):
    label = proto or "default"
    print("=== P/D on the GPU, mooncake_protocol %s: KV expected over %s" % (label, expect))
    boot = free_port()
    P = serve("P-" + label, "--kv-transfer-config", kv_cfg("kv_producer", proto),
              env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(boot)})
    D = serve("D-" + label, "--kv-transfer-config", kv_cfg("kv_consumer", proto))
    X = Proc("proxy-" + label, ["proxy", "--port", "{port}", "--prefill", P.url, str(boot), "--decode", D.url],
             health="/health")
    try:
        m0 = P.metrics()
        n_req = 0
        same = 0
        for p in PROMPTS:
            r = complete(X.url, p)
            n_req += 1
            kv = r.usage.model_dump().get("kv_transfer") or {}
            same += r.choices[0].text == want[p]
            if not (kv.get("received_prompt_tokens", 0) > 0 and kv.get("computed_prompt_tokens") == 1):
                check(False, "D received the prompt's KV from P (usage %s)" % kv)
        check(same == len(PROMPTS), "%d/%d greedy completions through the proxy equal colocated GPU serving"
              % (same, len(PROMPTS)))
        got_chat = client(X.url).chat.completions.create(**chat_kw).choices[0].message.content
        n_req += 1
        check(got_chat == want_chat, "chat through the proxy equals colocated")
        m1 = P.metrics()
        d_req = {t: m1.get(TREQ % t, 0) - m0.get(TREQ % t, 0) for t in TRANSPORTS}
        d_bytes = {t: m1.get(TBYTES % t, 0) - m0.get(TBYTES % t, 0) for t in TRANSPORTS}
        print("  P's counters for these %d requests: requests %s, bytes %s" % (n_req, d_req, d_bytes))
        check(d_req[expect] == n_req and d_bytes[expect] > 0 and
              all(d_req[t] == 0 for t in TRANSPORTS if t != expect),
              "every request's KV moved over %s (P's counters), none over another transport" % expect)
        check(re.search(r"moved over %s\b" % expect, P.text()) is not None,
              "P's log names %s" % expect)
        jobs = [i % len(PROMPTS) for i in range(16)]
        with cf.ThreadPoolExecutor(16) as ex:
            outs = list(ex.map(lambda i: complete(X.url, PROMPTS[i]).choices[0].text, jobs))
        diff = sum(o != want[PROMPTS[i]] for o, i in zip(outs, jobs))
        check(diff == 0, "16 concurrent requests through the proxy: %d differ from colocated" % diff)
        t = ttft(X.url, long_prompt)
        r = complete(X.url, long_prompt, n=1)
        results.append((label, expect, t, r.usage.prompt_tokens))
        print("  TTFT at %d prompt tokens (median of 9, streamed): P/D over %s %.2f ms, colocated %.2f ms"
              % (r.usage.prompt_tokens, expect, t, ttft_colo))
    finally:
        X.stop()
        D.stop()
        P.stop()
colo.stop()
print("=== TTFT summary (tiny model, GPU): colocated %.2f ms; %s" % (
    ttft_colo, "; ".join("P/D %s (%s) %.2f ms (+%.2f) at %d tokens" % (l, e, t, t - ttft_colo, n)
                         for l, e, t, n in results)))
print("gpu_pd_check: %d failure(s)" % bad)
sys.exit(1 if bad else 0)
