#!/usr/bin/env python3
"""scale_sim — replay a request trace over a modelled N x P + M x D cluster and
compare the proxy's routing policies (docs/scaling.md, "Capacity model").

The model (deliberately small; every constant is a flag):

- a prefill instance runs one prefill at a time, FIFO: a request of L input
  tokens of which C are in its prefix cache takes (L - C) / prefill_rate
  seconds.  Each prefill keeps an LRU cache of --cache-prefixes prompt
  prefixes (a prefix is hit when the request's prefix id is in it);
- the KV of the L tokens then crosses the P->D link: L * kv_bytes_per_token /
  link_bandwidth seconds (one link per P, transfers on it FIFO);
- a decode instance runs up to --max-batch requests at once; a request of O
  output tokens admitted with B requests running takes O * (step_s +
  step_per_seq_s * B) seconds (the batch seen at admission; a fluid
  approximation that is enough to rank policies); beyond max-batch it waits;
- TTFT = arrival -> end of the KV transfer + one decode step; E2E = arrival
  -> last token.

The proxies' view (--proxies K, each request to a random one): least_loaded
sees its own proxy's outstanding requests exactly and
the instances' published load (running + waiting) only every --publish-s
(the etcd update period), as disagg proxy --discovery does; prefix is the
rendezvous hash of the prefix id bounded by load (POLICY_PREFIX_SLACK = 2 plus
a quarter of the least load, as src/proxy/policy.c); round_robin and random
ignore load.

A trace is JSON lines {"t": arrival_s, "in": tokens, "out": tokens,
"prefix": id, "prefix_len": tokens}; without --trace one is generated
(Poisson arrivals, log-normal lengths, Zipf prefixes).

usage:
    tools/scale_sim.py [--prefills 64] [--decodes 128] [--rate 400] [--requests 20000]
                       [--trace FILE] [--policies round_robin,least_loaded,prefix]
"""
import argparse
import hashlib
import heapq
import json
import math
import random
from collections import OrderedDict

SLACK = 2  # POLICY_PREFIX_SLACK in src/proxy/policy.h


def gen_trace(n, rate, seed, in_mean, out_mean, n_prefixes, prefix_frac):
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        lin = max(16, int(rng.lognormvariate(math.log(in_mean), 0.6)))
        lout = max(1, int(rng.lognormvariate(math.log(out_mean), 0.7)))
        # Zipf-like popularity of shared prefixes (system prompts, few-shot headers)
        pid = int(n_prefixes * (rng.random() ** 2.5))
        out.append({"t": t, "in": lin, "out": lout, "prefix": pid,
                    "prefix_len": int(lin * prefix_frac)})
    return out


def hrw(prefix, name):
    return hashlib.blake2b(f"{prefix}|{name}".encode(), digest_size=8).digest()


class Prefill:
    def __init__(self, i, cache):
        self.name, self.free_at, self.link_free_at = f"P{i}", 0.0, 0.0
        self.cache, self.cap = OrderedDict(), cache
        self.queue_ends = []  # finish times of admitted prefills (its load)
        self.busy = 0.0
        self.pub = 0  # published load

    def load(self, now):
        while self.queue_ends and self.queue_ends[0] <= now:
            heapq.heappop(self.queue_ends)
        return len(self.queue_ends)


class Decode:
    def __init__(self, i):
        self.name = f"D{i}"
        self.running = []  # end times
        self.pub = 0

    def load(self, now):
        while self.running and self.running[0] <= now:
            heapq.heappop(self.running)
        return len(self.running)


def pick(policy, insts, now, rr, rng, prefix=None, outstanding=None):
    def load(x):
        own = outstanding.get(x.name, 0) if outstanding else 0
        return max(own, x.pub)
    if policy == "round_robin":
        return insts[rr % len(insts)]
    if policy == "random":
        return rng.choice(insts)
    if policy == "p2c":  # the less loaded of two distinct random instances
        a, b = rng.sample(insts, 2) if len(insts) > 1 else (insts[0], insts[0])
        return b if load(b) < load(a) else a
    best = min(insts, key=lambda x: (load(x), rng.random()))
    if policy == "prefix" and prefix is not None:
        pref = max(insts, key=lambda x: hrw(prefix, x.name))
        lo = load(best)
        if load(pref) <= lo + SLACK + lo / 4:
            return pref
    return best


def simulate(trace, a, policy):
    rng = random.Random(a.seed + 1)
    ps = [Prefill(i, a.cache_prefixes) for i in range(a.prefills)]
    ds = [Decode(i) for i in range(a.decodes)]
    ttft, e2e, hits = [], [], 0
    next_pub, rr = 0.0, 0
    # each proxy's outstanding requests: name -> count; requests go to a random proxy
    own_p = [{} for _ in range(a.proxies)]
    own_d = [{} for _ in range(a.proxies)]
    ends_p, ends_d = [], []  # (time, proxy, name) when an outstanding request leaves
    for req in trace:
        now = req["t"]
        while ends_p and ends_p[0][0] <= now:
            _, k, name = heapq.heappop(ends_p)
            own_p[k][name] -= 1
        while ends_d and ends_d[0][0] <= now:
            _, k, name = heapq.heappop(ends_d)
            own_d[k][name] -= 1
        px = rng.randrange(a.proxies)
        if now >= next_pub:  # the instances publish their load (etcd, every publish_s)
            for x in ps + ds:
                x.pub = x.load(now)
            next_pub = now + a.publish_s
        p = pick(policy, ps, now, rr, rng, req["prefix"], own_p[px])
        d = pick("least_loaded" if policy == "prefix" else policy, ds, now, rr, rng, None, own_d[px])
        rr += 1
        cached = 0
        if req["prefix"] in p.cache:
            p.cache.move_to_end(req["prefix"])
            cached, hits = req["prefix_len"], hits + 1
        else:
            p.cache[req["prefix"]] = True
            if len(p.cache) > p.cap:
                p.cache.popitem(last=False)
        work = (req["in"] - cached) / a.prefill_rate
        start = max(now, p.free_at)
        p.free_at = start + work
        p.busy += work
        heapq.heappush(p.queue_ends, p.free_at)
        xfer = req["in"] * a.kv_bytes_per_token / a.link_gbps / 1e9 * 8
        x_start = max(p.free_at, p.link_free_at)
        p.link_free_at = x_start + xfer
        kv_done = p.link_free_at
        own_p[px][p.name] = own_p[px].get(p.name, 0) + 1
        heapq.heappush(ends_p, (p.free_at, px, p.name))
        # decode: admitted when a slot is free
        b = d.load(kv_done)
        admit = kv_done
        if b >= a.max_batch:
            admit = sorted(d.running)[b - a.max_batch]
            b = a.max_batch - 1
        step = a.step_s + a.step_per_seq_s * (b + 1)
        end = admit + req["out"] * step
        heapq.heappush(d.running, end)
        own_d[px][d.name] = own_d[px].get(d.name, 0) + 1
        heapq.heappush(ends_d, (end, px, d.name))
        ttft.append(admit + step - now)
        e2e.append(end - now)
    span = max(trace[-1]["t"], 1e-9)
    q = lambda v, f: sorted(v)[min(len(v) - 1, int(f * len(v)))]
    return {"policy": policy, "ttft_p50": q(ttft, .5), "ttft_p99": q(ttft, .99),
            "e2e_p50": q(e2e, .5), "e2e_p99": q(e2e, .99),
            "p_util": sum(p.busy for p in ps) / (len(ps) * span), "hit": hits / len(trace)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefills", type=int, default=64)
    ap.add_argument("--decodes", type=int, default=128)
    ap.add_argument("--rate", type=float, default=400, help="requests/s (generated trace)")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--trace", help="JSON-lines trace instead of a generated one")
    ap.add_argument("--in-mean", type=float, default=2000)
    ap.add_argument("--out-mean", type=float, default=200)
    ap.add_argument("--prefixes", type=int, default=200, help="distinct shared prefixes")
    ap.add_argument("--prefix-frac", type=float, default=0.6, help="share of the prompt in the prefix")
    # defaults: Qwen2.5-7B bf16 on one H200 as docs/benchmarks.md measured disagg's serving
    # path: prefill ~30k tok/s (512-4096 tokens), decode step 7.0 ms at batch 1, 14.1 ms at 32
    ap.add_argument("--prefill-rate", type=float, default=30000, help="prefill tokens/s per P")
    ap.add_argument("--step-s", type=float, default=0.0068, help="decode step, batch of 0")
    ap.add_argument("--step-per-seq-s", type=float, default=0.00023, help="decode step cost per sequence")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--kv-bytes-per-token", type=float, default=57344,
                    help="Qwen2.5-7B bf16: 2 x 28 layers x 4 KV heads x 128 x 2 bytes")
    ap.add_argument("--link-gbps", type=float, default=100)
    ap.add_argument("--cache-prefixes", type=int, default=16, help="prefixes each P keeps cached")
    ap.add_argument("--publish-s", type=float, default=0.25, help="load publication period (etcd)")
    ap.add_argument("--proxies", type=int, default=1, help="proxies (each request to a random one)")
    ap.add_argument("--policies", default="random,round_robin,least_loaded,p2c,prefix")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.trace:
        with open(a.trace) as f:
            trace = sorted((json.loads(l) for l in f if l.strip()), key=lambda r: r["t"])
    else:
        trace = gen_trace(a.requests, a.rate, a.seed, a.in_mean, a.out_mean, a.prefixes, a.prefix_frac)
    lin = sum(r["in"] for r in trace) / len(trace)
    lout = sum(r["out"] for r in trace) / len(trace)
    span = trace[-1]["t"]
    lam = len(trace) / span
    print(f"{len(trace)} requests over {span:.1f} s ({lam:.0f}/s), mean {lin:.0f} in / {lout:.0f} out; "
          f"{a.prefills} P x {a.decodes} D")
    print(f"paper model: P busy {lam * lin / a.prefill_rate / a.prefills:.2f} (no cache), "
          f"KV per P link {lam * lin * a.kv_bytes_per_token * 8 / 1e9 / a.prefills:.1f} Gbit/s of {a.link_gbps:g}, "
          f"D slots needed {lam * lout * (a.step_s + a.step_per_seq_s * a.max_batch):.0f} of "
          f"{a.decodes * a.max_batch}; {a.proxies} prox{'y' if a.proxies == 1 else 'ies'}")
    print(f"\n| policy | TTFT p50 s | TTFT p99 s | E2E p50 s | E2E p99 s | P busy | prefix hits |")
    print("|---|---|---|---|---|---|---|")
    for pol in a.policies.split(","):
        r = simulate(trace, a, pol)
        print(f"| {pol} | {r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | {r['e2e_p50']:.2f} | "
              f"{r['e2e_p99']:.2f} | {r['p_util']:.2f} | {r['hit']:.0%} |")


if __name__ == "__main__":
    main()
