#!/usr/bin/env python3
"""Calibration evidence for vllm-sim (results go to integration/vllm-sim/README.md).

    calibrate.py ttft                       single-request TTFT, cold vs warm 7,200-token prompts (1 pod, real time)
    calibrate.py curve  [--scale S]         one pod: output tok/s and TTFT vs QPS (its 1/8 share of the reference)
    calibrate.py random8 [--scale S]        8 pods, 150 groups x 5 prompts, random routing vs group affinity
    calibrate.py cpu                        8 pods at 60 QPS, 1,000-token outputs: CPU used by the simulator
    calibrate.py clock [--pods P] [--scales 1 0.25]   closed loop, 80 in flight per pod: tok/s per time scale
    calibrate.py events [--route R]         8 pods, random or affinity routing: KV events replayed as an indexer would
    calibrate.py all

Workload (llm-d 73-capacity, inference-perf shared_prefix): per group a 6,000-token system prompt, 5 questions of
1,200 tokens, 1,000 output tokens (ignore_eos), streaming, pretokenized prompts (random ids, so the load generator
stays cheap). Arrivals are Poisson in simulated time; at most --max-inflight requests in flight (inference-perf's
worker concurrency; TTFT is timed from dispatch, as docs/benchmark-method.md explains). Throughput comes from the pods'
vllm:generation_tokens_total deltas over each stage; TTFT from the client. --scale < 1 runs the pods (and the
arrival clock) faster than real time; TTFTs are reported in simulated seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import simcluster  # noqa: E402

SYSTEM, QUESTION, OUTPUT = 6000, 1200, 1000


def workload(groups: int, per_group: int, seed: int = 7):
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        system = [rng.randrange(1000, 120000) for _ in range(SYSTEM)]
        for _ in range(per_group):
            prompts.append((g, system + [rng.randrange(1000, 120000) for _ in range(QUESTION)]))
    return prompts


def body(prompt, max_tokens=OUTPUT):
    return json.dumps({"model": "Qwen/Qwen3-32B", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()


async def stream_request(host, port, payload, timeout, on_first=None):
    """POST /v1/completions (streaming) and read to [DONE]; on_first() at the first data chunk. True if completed."""
    first = False
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return False
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (host.encode(), port, len(payload)) + payload)
        await writer.drain()
        tail = b""
        async with asyncio.timeout(timeout):
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    return False
                if not first and b"data: {" in chunk:
                    first = True
                    if on_first:
                        on_first()
                tail = (tail + chunk)[-64:]
                if b"[DONE]" in tail:
                    return True
    except (TimeoutError, OSError):
        return False
    finally:
        writer.close()


async def timed(host, port, payload, timeout=600):
    """Wall seconds to the first token of one streaming request."""
    t0 = time.monotonic()
    out = []
    await stream_request(host, port, payload, timeout, lambda: out.append(time.monotonic() - t0))
    return out[0] if out else float("nan")


def scrape(urls):
    import urllib.request
    out = []
    for u in urls:
        with urllib.request.urlopen(u + "/metrics", timeout=10) as r:
            vals = {}
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#") and "_bucket" not in line:
                    name = line.split("{")[0].split(" ")[0]
                    vals[name] = vals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            out.append(vals)
    return out


def total(snaps, name):
    return sum(s.get(name, 0.0) for s in snaps)


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def run_stages(cluster, prompts, stages, route, scale, max_inflight, seed=11, drain=120.0):
    """stages: [(qps, seconds)] in simulated time; route(group, rng) -> pod index. One row per stage."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_inflight)
    bodies = {}
    ttft = {}  # request number -> (stage, simulated TTFT or None)
    tasks = set()
    order = list(range(len(prompts)))
    rng.shuffle(order)

    async def one(stage, rid, idx, pod):
        ttft[rid] = (stage, None)
        async with sem:
            t0 = time.monotonic()

            def on_first():
                ttft[rid] = (stage, (time.monotonic() - t0) / scale)

            await stream_request(cluster.host, cluster.ports[pod], bodies[idx], 3600, on_first)

    rows = []
    rid = 0
    for si, (qps, secs) in enumerate(stages):
        before = scrape(cluster.urls)
        cpu_start = cluster.cpu_seconds()
        t_start = time.monotonic()
        t_end = t_start + secs * scale
        next_t = t_start
        while True:
            next_t += rng.expovariate(qps) * scale
            if next_t >= t_end:
                break
            while time.monotonic() < next_t:
                await asyncio.sleep(min(0.05, next_t - time.monotonic()))
            idx = order[rid % len(order)]
            if idx not in bodies:
                bodies[idx] = body(prompts[idx][1])
            t = asyncio.create_task(one(si, rid, idx, route(prompts[idx][0], rng)))
            rid += 1
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        await asyncio.sleep(max(0.0, t_end - time.monotonic()))
        cpu_cores = (cluster.cpu_seconds() - cpu_start) / (time.monotonic() - t_start)
        after = scrape(cluster.urls)
        gen = total(after, "vllm:generation_tokens_total") - total(before, "vllm:generation_tokens_total")
        q = total(after, "vllm:prefix_cache_queries_total") - total(before, "vllm:prefix_cache_queries_total")
        h = total(after, "vllm:prefix_cache_hits_total") - total(before, "vllm:prefix_cache_hits_total")
        rows.append({"qps": qps, "secs": secs, "out_tok_s": gen / secs, "hit_rate": h / q if q else float("nan"),
                     "waiting_end": total(after, "vllm:num_requests_waiting"),
                     "kv_usage_end": statistics.mean(s.get("vllm:kv_cache_usage_perc", 0) for s in after),
                     "cpu": cpu_cores})
    # Let dispatched requests reach their first token (bounded), then drop everything still open.
    deadline = time.monotonic() + drain * scale
    while time.monotonic() < deadline and any(v is None for v in (t for _, t in ttft.values())):
        await asyncio.sleep(0.2)
    for t in list(tasks):
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for si, row in enumerate(rows):
        tt = [v for s, v in ttft.values() if s == si and v is not None]
        row.update({"sent": sum(1 for s, _ in ttft.values() if s == si), "ttft_n": len(tt), "ttft_p50": pct(tt, 50),
                    "ttft_p90": pct(tt, 90), "ttft_mean": statistics.mean(tt) if tt else float("nan")})
    return rows


def print_rows(title, rows):
    print(f"\n## {title}")
    print("| QPS | stage s | sent | TTFT n | TTFT p50 | TTFT p90 | TTFT mean | out tok/s | hit rate | waiting (end) | "
          "KV use (end) | sim CPU (cores) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['qps']} | {r['secs']} | {r['sent']} | {r['ttft_n']} | {r['ttft_p50']:.3f} | {r['ttft_p90']:.3f} | "
              f"{r['ttft_mean']:.3f} | {r['out_tok_s']:.0f} | {r['hit_rate']:.2f} | {r['waiting_end']:.0f} | "
              f"{r['kv_usage_end']:.2f} | {r['cpu']:.3f} |")
    sys.stdout.flush()


def cmd_ttft(args):
    prompts = workload(3, 2, seed=3)
    with simcluster.SimCluster(pods=1, time_scale=1.0) as c:
        print("\n## Single-request TTFT, 7,200-token prompts (1 pod, real time)")
        print("| group | cold TTFT s | warm TTFT s (6,000 cached) |\n|---|---|---|")
        for g in range(3):
            cold = asyncio.run(timed(c.host, c.ports[0], body(prompts[2 * g][1], 1)))
            warm = asyncio.run(timed(c.host, c.ports[0], body(prompts[2 * g + 1][1], 1)))
            print(f"| {g} | {cold:.3f} | {warm:.3f} |")


def cmd_curve(args):
    prompts = workload(19, 5)  # one pod's share: 150 groups / 8 pods
    stages = [(q, args.stage) for q in (0.25, 0.5, 1, 1.5, 2, 3, 5, 7.5)]
    with simcluster.SimCluster(pods=1, time_scale=args.scale) as c:
        rows = asyncio.run(run_stages(c, prompts, stages, lambda g, r: 0, args.scale, args.max_inflight // 8))
    print_rows(f"One pod, 19 groups x 5 prompts, stages of {args.stage} s, cap {args.max_inflight // 8} in flight "
               f"(time scale {args.scale})", rows)


def cmd_random8(args):
    prompts = workload(150, 5)
    stages = [(15, args.warmup)] + [(q, args.stage) for q in args.qps]
    strategies = {"random": lambda g, r: r.randrange(8), "affinity": lambda g, r: g % 8}
    for name in args.strategies:
        route = strategies[name]
        with simcluster.SimCluster(pods=8, time_scale=args.scale) as c:
            t0 = time.monotonic()
            cpu0 = c.cpu_seconds()
            rows = asyncio.run(run_stages(c, prompts, stages, route, args.scale, args.max_inflight, drain=args.drain))
            cpu = (c.cpu_seconds() - cpu0) / (time.monotonic() - t0)
        print_rows(f"8 pods, 150 groups x 5 prompts, {name} routing, cap {args.max_inflight} in flight, time scale "
                   f"{args.scale} (sim CPU {cpu:.2f} cores)", rows)


def cmd_cpu(args):
    """Open loop (no in-flight cap): 60 requests/s really arrive, 1,000-token outputs, real time."""
    prompts = workload(150, 5)
    stages = [(60, args.stage), (60, args.stage)]
    with simcluster.SimCluster(pods=8, time_scale=1.0) as c:
        rows = asyncio.run(run_stages(c, prompts, stages, lambda g, r: g % 8, 1.0, 10**6, drain=0.0))
    print_rows(f"CPU: 8 pods, 60 QPS open loop, 1,000-token outputs, group affinity, real time, {args.stage} s stages",
               rows)


def cmd_clock(args):
    """Closed loop: 80 requests in flight per pod all the time (one group per pod's share, group affinity), so
    each pod decodes ~80 sequences; output tok/s in simulated time must not depend on the time scale."""
    prompts = workload(19 * args.pods, 5)
    inflight = args.max_inflight // 8
    print(f"\n## Clock: {args.pods} pod(s), {inflight} in flight per pod, closed loop, {args.warmup} s warm-up + "
          f"{args.stage} s measured (simulated)")
    print("| time scale | out tok/s per pod | TTFT p50 | TTFT p90 | sim CPU (cores) |\n|---|---|---|---|---|")
    for scale in args.scales:
        with simcluster.SimCluster(pods=args.pods, time_scale=scale, stream_interval=64) as c:
            row = asyncio.run(closed_loop(c, prompts, inflight, scale, args.warmup, args.stage))
        print(f"| {scale:g} | {row['tok_s']:.0f} | {row['p50']:.3f} | {row['p90']:.3f} | {row['cpu']:.3f} |")
        sys.stdout.flush()


async def closed_loop(cluster, prompts, per_pod, scale, warmup, stage):
    bodies = [body(p) for _, p in prompts]
    ttfts = []
    measuring = [False]
    stop = [False]

    pods = len(cluster.ports)
    mine = [[i for i, (g, _) in enumerate(prompts) if g % pods == p] for p in range(pods)]  # group affinity

    async def worker(pod, k):
        i = k
        while not stop[0]:
            idx = mine[pod][i % len(mine[pod])]
            t0 = time.monotonic()

            def on_first():
                if measuring[0]:
                    ttfts.append((time.monotonic() - t0) / scale)

            await stream_request(cluster.host, cluster.ports[pod], bodies[idx], 3600, on_first)
            i += per_pod

    tasks = [asyncio.create_task(worker(p, k)) for p in range(len(cluster.ports)) for k in range(per_pod)]
    await asyncio.sleep(warmup * scale)
    before, cpu0, t0 = scrape(cluster.urls), cluster.cpu_seconds(), time.monotonic()
    measuring[0] = True
    await asyncio.sleep(stage * scale)
    after, cpu1, wall = scrape(cluster.urls), cluster.cpu_seconds(), time.monotonic() - t0
    stop[0] = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    gen = total(after, "vllm:generation_tokens_total") - total(before, "vllm:generation_tokens_total")
    return {"tok_s": gen / (wall / scale) / len(cluster.ports), "p50": pct(ttfts, 50), "p90": pct(ttfts, 90),
            "cpu": (cpu1 - cpu0) / wall}


class EventLedger:
    """Replays KV events as an indexer does, counting live copies per (pod, group, hash); `present` is the view of
    an indexer that keeps a set of hashes instead (a second store is a no-op, the first removal forgets the hash)."""

    def __init__(self, prompt_tails=frozenset()):
        self.live = {}
        self.present = set()
        self.prompt_tails = prompt_tails  # last 16 tokens of each block-aligned prompt
        self.n = {"batches": 0, "stored": 0, "removed": 0, "dup_stores": 0, "dup_stores_last_block": 0,
                  "unknown_removals": 0, "unknown_parents": 0, "set_unknown_removals": 0, "set_unknown_parents": 0}

    def apply(self, topic, batch):
        self.n["batches"] += 1
        for e in batch[1]:
            kind = e.get("type")
            if kind == "AllBlocksCleared":
                self.live = {k: v for k, v in self.live.items() if k[0] != topic}
                self.present = {k for k in self.present if k[0] != topic}
            if kind not in ("BlockStored", "BlockRemoved") or e.get("medium") != "GPU":
                continue
            g = e.get("group_idx") or 0
            if kind == "BlockStored":
                parent = e.get("parent_block_hash")
                if parent is not None and (topic, g, parent) not in self.live:
                    self.n["unknown_parents"] += 1
                if parent is not None and (topic, g, parent) not in self.present:
                    self.n["set_unknown_parents"] += 1
                for i, h in enumerate(e["block_hashes"]):
                    self.n["stored"] += 1
                    self.present.add((topic, g, h))
                    if (topic, g, h) in self.live:
                        self.n["dup_stores"] += 1
                        bs = e["block_size"]
                        self.n["dup_stores_last_block"] += tuple(e["token_ids"][i * bs:(i + 1) * bs]) in self.prompt_tails
                    self.live[(topic, g, h)] = self.live.get((topic, g, h), 0) + 1
            else:
                for h in e["block_hashes"]:
                    self.n["removed"] += 1
                    if (topic, g, h) in self.present:
                        self.present.discard((topic, g, h))
                    else:
                        self.n["set_unknown_removals"] += 1
                    left = self.live.get((topic, g, h), 0) - 1
                    if left < 0:
                        self.n["unknown_removals"] += 1
                    elif left == 0:
                        del self.live[(topic, g, h)]
                    else:
                        self.live[(topic, g, h)] = left


def cmd_events(args):
    """8 pods under random routing (evictions everywhere) or group affinity (same prefixes meet on one pod), every
    pod's KV events received by one SUB and replayed as an indexer would: stores of a live hash, removals of an
    unknown hash, stores whose parent is unknown."""
    import threading

    import msgpack
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    prompts = workload(150, 5)
    tails = frozenset(tuple(p[-16:]) for _, p in prompts if len(p) % 16 == 0)
    ledger, stop, seqs = EventLedger(tails), threading.Event(), {}

    def receive():
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50):
                topic, seq, payload = sub.recv_multipart()
                seqs.setdefault(topic, []).append(int.from_bytes(seq, "big"))
                ledger.apply(topic, msgpack.unpackb(payload, raw=False, strict_map_key=False))

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    stages = [(15, args.warmup)] + [(q, args.stage) for q in args.qps]
    with simcluster.SimCluster(pods=8, time_scale=args.scale, kv_events_endpoint=f"tcp://127.0.0.1:{port}") as c:
        route = (lambda g, r: r.randrange(8)) if args.route == "random" else (lambda g, r: g % 8)
        rows = asyncio.run(run_stages(c, prompts, stages, route, args.scale, args.max_inflight, drain=0.0))
        time.sleep(1.0)
    stop.set()
    t.join()
    sub.close(linger=0)
    ctx.term()
    gaps = sum(len(v) - len(set(v)) + (max(v) + 1 - len(set(v))) for v in seqs.values())
    print(f"\n## KV events, 8 pods, {args.route} routing, stages {stages} (simulated s), time scale {args.scale}")
    print(f"out tok/s per stage: {[round(r['out_tok_s']) for r in rows]}; sequence gaps or repeats: {gaps}")
    print("| batches | blocks stored | blocks removed | stores of a live hash | removals of an unknown hash "
          "(copies counted / set of hashes) | stores with an unknown parent (copies / set) |\n|---|---|---|---|---|---|")
    n = ledger.n
    print(f"| {n['batches']} | {n['stored']} | {n['removed']} | {n['dup_stores']} (last block of a block-aligned "
          f"prompt: {n['dup_stores_last_block']}) | {n['unknown_removals']} / "
          f"{n['set_unknown_removals']} | {n['unknown_parents']} / {n['set_unknown_parents']} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["ttft", "curve", "random8", "cpu", "clock", "events", "all"])
    ap.add_argument("--scale", type=float, default=1.0, help="time scale of the pods (wall s per sim s)")
    ap.add_argument("--stage", type=float, default=30.0, help="seconds (simulated) per QPS stage")
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--qps", type=float, nargs="+", default=[10, 30, 60])
    ap.add_argument("--max-inflight", type=int, default=640)
    ap.add_argument("--drain", type=float, default=120.0, help="simulated s to wait for first tokens after the last stage")
    ap.add_argument("--strategies", nargs="+", default=["random", "affinity"], choices=["random", "affinity"],
                    help="random8: routing strategies (affinity = each group on one pod, ideal prefix routing)")
    ap.add_argument("--pods", type=int, default=1, help="clock: pods in one process")
    ap.add_argument("--route", default="random", choices=["random", "affinity"], help="events: routing")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.25], help="clock: time scales to compare")
    args = ap.parse_args()
    for name, fn in [("ttft", cmd_ttft), ("curve", cmd_curve), ("random8", cmd_random8), ("cpu", cmd_cpu),
                     ("clock", cmd_clock), ("events", cmd_events)]:
        if args.what in (name, "all"):
            fn(args)


if __name__ == "__main__":
    main()
