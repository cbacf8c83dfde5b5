"""Gateway (full index) vs sidecars (remote lookup): one workload, two placements (issue 10).

    .venv/bin/python integration/mesh_lookup.py [--sidecars 4] [--time-scale 1.0] [--out DIR]

Each arm starts fresh pods (vllm-sim, the quick benchmark profile's 4 pods × 3,072 blocks)
publishing KV events to a fresh kvroute-indexer (started first, so no event is missed), then
sends the quick profile's workload shape — 48 groups × 5 prompts, a 1,500-token shared system
prompt + a 300-token question, 100 output tokens, Poisson warm-up 10 QPS × 15 s then
15 / 30 / 45 QPS × 15 s (simulated seconds; --time-scale compresses them as vllm-sim does) —
as token-id completions, so both placements route on token blocks without a tokenizer:

- gateway: one Envoy in precise mode (envoy/gateway-precise.yaml: the singleton polls the feed),
- sidecars: the same requests spread round-robin over N Envoys that hold no index and no
  endpoint list; each looks every prompt up at the indexer (`remote_index`),
- plain (with --arms …,plain): one Envoy without kvroute (least-request), the cache-blind
  baseline of hit rate and of an Envoy's memory.

It prints and writes (--out) per arm: the pods' prefix-cache hit rate (Δ vllm:prefix_cache_hits
/ Δ queries, all requests and after the warm-up), requests failed, each Envoy's RSS, and the bytes
each Envoy received from the indexer (cluster upstream_cx_rx_bytes_total) per second.

render_sidecar() is the sidecar Envoy the e2e tests run too.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import random
import threading
import time
from pathlib import Path

import requests
import yaml

from envoyctl import GATEWAY_PRECISE, EnvoyProcess, render_gateway
from indexerctl import IndexerProcess
from simcluster import SimCluster, free_port_range

MODEL = "Qwen/Qwen3-32B"
INDEXER_CLUSTER = "kvroute_indexer"

# The quick profile (integration/bench/profiles.py `quick`).
PODS, GPU_BLOCKS, MAX_MODEL_LEN = 4, 3072, 8192
GROUPS, PROMPTS_PER_GROUP, SYSTEM_LEN, QUESTION_LEN, OUTPUT_LEN = 48, 5, 1500, 300, 100
WARMUP = (10.0, 15)
STAGES = [(15.0, 15), (30.0, 15), (45.0, 15)]
INFLIGHT_CAP = 320
# The shipped gateway's weights (envoy/gateway-precise.yaml), for both placements.
WEIGHTS = {"prefill": 4.0, "decode": 1.0, "queue": 0.5, "kv_usage": 0.0}


def render_sidecar(endpoints: list[str], indexer: str, plugin: dict | None = None) -> str:
    """An Envoy like a mesh sidecar with remote lookup: kvroute with no endpoint list, no feed
    (no singleton) and `remote_index` at the indexer; Envoy's own cluster still lists the pods
    (Istio's EDS), which its least-request LB uses when kvroute names none."""
    remote = {"cluster": INDEXER_CLUSTER, "authority": "kvroute-indexer", "timeout_ms": 200, "min_blocks": 4}
    merged = {"endpoints": [], "indexer": None, "tokenizer": None, "remote_index": remote, **(plugin or {})}
    cfg = yaml.safe_load(render_gateway(endpoints, merged, template=GATEWAY_PRECISE, indexer=indexer))
    del cfg["bootstrap_extensions"]  # no singleton: nothing polls the feed
    return yaml.safe_dump(cfg, sort_keys=False)


def workload(seed: int = 42) -> list[list[int]]:
    """Token ids of every request, in sending order: the 240 prompts, shuffled, repeated."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(100, 50000) for _ in range(n)]  # noqa: E731
    prompts = []
    for _ in range(GROUPS):
        system = ids(SYSTEM_LEN)
        prompts += [system + ids(QUESTION_LEN) for _ in range(PROMPTS_PER_GROUP)]
    total = sum(int(rate * seconds) for rate, seconds in [WARMUP] + STAGES)
    order = []
    while len(order) < total:
        batch = list(range(len(prompts)))
        rng.shuffle(batch)
        order += batch
    return [prompts[i] for i in order[:total]]


def schedule(time_scale: float, seed: int = 42) -> list[tuple[float, bool]]:
    """(wall send time, after warm-up) per request: Poisson arrivals, stage by stage."""
    rng = random.Random(seed + 1)
    out, start = [], 0.0
    for k, (rate, seconds) in enumerate([WARMUP] + STAGES):
        n, wall = int(rate * seconds), max(1.0, seconds * time_scale)
        t = start
        for _ in range(n):
            t += rng.expovariate(n / wall)
            out.append((min(t, start + wall), k > 0))
        start += wall
    return out


def pod_counters(sims: SimCluster) -> tuple[float, float]:
    hits = sum(sims.metric(i, "vllm:prefix_cache_hits_total") for i in range(sims.pods))
    queries = sum(sims.metric(i, "vllm:prefix_cache_queries_total") for i in range(sims.pods))
    return hits, queries


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def indexer_rx_bytes(envoy: EnvoyProcess) -> int:
    return envoy.stats(f"cluster.{INDEXER_CLUSTER}.upstream_cx_rx_bytes_total").get(
        f"cluster.{INDEXER_CLUSTER}.upstream_cx_rx_bytes_total", 0)


def send_all(envoys: list[EnvoyProcess], prompts: list[list[int]], times: list[tuple[float, bool]],
             sims: SimCluster) -> dict:
    """Sends request i through envoys[i % len] at its time; hit rate over all and after warm-up."""
    cap = threading.Semaphore(INFLIGHT_CAP)
    failed = [0]
    local = threading.local()

    def one(i: int) -> None:
        try:
            s = getattr(local, "session", None) or requests.Session()
            local.session = s
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": OUTPUT_LEN, "ignore_eos": True}
            r = s.post(envoys[i % len(envoys)].url + "/v1/completions", json=body, timeout=300)
            if r.status_code != 200:
                failed[0] += 1
        except requests.RequestException:
            failed[0] += 1
        finally:
            cap.release()

    marks = {}
    marks["start"] = pod_counters(sims)
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=INFLIGHT_CAP) as pool:
        futures = []
        for i, (at, measured) in enumerate(times):
            if measured and "warm" not in marks:
                # counters as the first measured request leaves (in-flight warm-up ones still count)
                marks["warm"] = pod_counters(sims)
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            cap.acquire()
            futures.append(pool.submit(one, i))
        cf.wait(futures)
    elapsed = time.monotonic() - t0
    end = pod_counters(sims)
    rate = lambda a, b: (b[0] - a[0]) / (b[1] - a[1]) if b[1] > a[1] else None  # noqa: E731
    return {"requests": len(times), "failed": failed[0], "seconds": round(elapsed, 1),
            "hit_rate_all": rate(marks["start"], end), "hit_rate_after_warmup": rate(marks["warm"], end)}


def run_arm(name: str, sidecars: int, time_scale: float, prompts, times) -> dict:
    port = free_port_range(PODS)
    addresses = [f"127.0.0.1:{port + i}" for i in range(PODS)]
    with contextlib.ExitStack() as stack:
        indexer = stack.enter_context(IndexerProcess(addresses, "--scrape-interval-ms=200"))
        sims = stack.enter_context(SimCluster(
            pods=PODS, port=port, num_gpu_blocks=GPU_BLOCKS, max_model_len=MAX_MODEL_LEN, max_num_seqs=256,
            max_num_batched_tokens=8192, time_scale=time_scale, kv_events_endpoint=indexer.zmq_endpoint))
        plugin = {"weights": WEIGHTS, "default_capacity_blocks": GPU_BLOCKS}
        if name == "gateway":
            configs = [render_gateway(addresses, plugin, template=GATEWAY_PRECISE, indexer=indexer.address)]
        elif name == "plain":
            configs = [render_gateway(addresses, kvroute=False)]
        else:
            configs = [render_sidecar(addresses, indexer.address, plugin) for _ in range(sidecars)]
        envoys = [stack.enter_context(EnvoyProcess(c)) for c in configs]
        for e in envoys:
            if name != "plain":
                e.wait_for_peers()
        time.sleep(1.0)  # the gateway's first feed poll
        rx_before = [indexer_rx_bytes(e) for e in envoys]
        t = time.monotonic()
        result = send_all(envoys, prompts, times, sims)
        seconds = time.monotonic() - t
        result["envoys"] = [{
            "rss_mb": round(rss_mb(e.pid), 1),
            "indexer_rx_bytes": indexer_rx_bytes(e) - before,
            "indexer_rx_bytes_per_s": round((indexer_rx_bytes(e) - before) / seconds),
            "kvroute": {k.removeprefix("wasmcustom."): v for k, v in e.settled_stats("wasmcustom.kvroute.").items()
                        if any(s in k for s in ("remote_lookup", "decision.", "fallback.", "feed.bytes", "requests"))},
        } for e, before in zip(envoys, rx_before)]
        result["indexer_lookups"] = indexer.metric("kvroute_indexer_lookups_total", result="answered")
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sidecars", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--arms", default="gateway,sidecars")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    prompts, times = workload(), schedule(args.time_scale)
    results = {"sidecars": args.sidecars, "time_scale": args.time_scale, "requests": len(prompts)}
    for arm in args.arms.split(","):
        results[arm] = run_arm(arm, args.sidecars, args.time_scale, prompts, times)
        print(json.dumps({arm: results[arm]}, indent=1), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
