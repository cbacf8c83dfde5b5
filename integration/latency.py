"""Precise-mode latencies (issue 4), printed as numbers; `make bench-latency`.

event-to-routable: a pyzmq publisher plays a vLLM pod and publishes a BlockStored for pod T
(fresh token ids each trial) to the real kvroute-indexer; after a delay d one pretokenized probe
goes through the real Envoy (precise config, singleton polling every 100 ms). The probe is
"routable" when kvroute sends it to T with every block matched. One probe per trial keeps the
probe's own learning out of the measurement; the fraction routable at each d is the latency CDF.

tokenizer: the same chat requests through the precise gateway with and without the /tokenize
call-out, interleaved; client-side latency percentiles and their difference.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import struct
import sys
import time
from pathlib import Path

import msgpack
import requests
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from envoyctl import GATEWAY_PRECISE, EnvoyProcess, render_gateway  # noqa: E402
from indexerctl import IndexerProcess  # noqa: E402
from simcluster import SimCluster  # noqa: E402

MODEL = "Qwen/Qwen3-32B"
BLOCKS = 20


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def decision_of(response: requests.Response) -> tuple[str, int]:
    fields = dict(p.split("=", 1) for p in response.headers["x-kvroute-decision"].split("; ") if "=" in p)
    return fields["pod"], int(fields["matched"].split("/")[0])


def event_to_routable(trials: int, delays_ms: list[int], verbose: bool = False) -> None:
    with SimCluster(pods=4, time_scale=0.05) as sims:
        target = sims.addresses[0]
        with IndexerProcess(sims.addresses, "--scrape-interval-ms=0") as indexer:
            config = render_gateway(sims.addresses, {}, template=GATEWAY_PRECISE, indexer=indexer.address)
            with EnvoyProcess(config) as envoy:
                envoy.wait_for_peers()
                ctx = zmq.Context()
                pub = ctx.socket(zmq.PUB)
                pub.connect(indexer.zmq_endpoint)
                time.sleep(1.0)  # ZMQ slow joiner: let the subscription arrive
                topic = f"kv@{target}@{MODEL}".encode()
                seq = 0
                rng = random.Random(7)
                print(f"event-to-routable: {trials} trials per delay, singleton poll 100 ms, {BLOCKS}-block prompts")
                print("delay_ms  routable  fraction")
                cdf = []
                for delay in delays_ms:
                    hits = 0
                    for _ in range(trials):
                        ids = [rng.randrange(100, 100_000) for _ in range(BLOCKS * 16)]
                        hashes = [rng.getrandbits(64) for _ in range(BLOCKS)]
                        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                                 "token_ids": ids, "block_size": 16, "lora_id": None, "medium": "GPU",
                                 "lora_name": None}
                        payload = msgpack.packb([time.time(), [event], 0])
                        pub.send_multipart([topic, struct.pack(">Q", seq), payload])
                        seq += 1
                        sent = time.monotonic()
                        time.sleep(max(0.0, delay / 1000 - (time.monotonic() - sent)))
                        r = requests.post(envoy.url + "/v1/completions",
                                          json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=10)
                        pod, matched = decision_of(r)
                        hits += pod == target and matched == BLOCKS
                        if verbose and not (pod == target and matched == BLOCKS):
                            print(f"  miss at {delay} ms: {r.headers['x-kvroute-decision']}")
                    cdf.append((delay, hits / trials))
                    print(f"{delay:8d}  {hits:8d}  {hits / trials:8.2f}")
                pub.close(linger=0)
                ctx.term()
                for q in (0.5, 0.99):
                    reached = next((d for d, f in cdf if f >= q), None)
                    print(f"p{int(q * 100)} event-to-routable <= {reached} ms" if reached is not None
                          else f"p{int(q * 100)} event-to-routable > {delays_ms[-1]} ms")


def tokenizer_latency(requests_per_arm: int) -> None:
    with SimCluster(pods=4, time_scale=0.01) as sims:
        with IndexerProcess(sims.addresses, "--scrape-interval-ms=0") as indexer:
            with_call = render_gateway(sims.addresses, {}, template=GATEWAY_PRECISE, indexer=indexer.address)
            without = render_gateway(sims.addresses, {"tokenizer": None}, template=GATEWAY_PRECISE,
                                     indexer=indexer.address)
            with EnvoyProcess(with_call) as a, EnvoyProcess(without) as b:
                a.wait_for_peers()
                b.wait_for_peers()
                times = {"with /tokenize": [], "without": []}
                session = requests.Session()
                for i in range(requests_per_arm):
                    body = {"model": MODEL, "max_tokens": 1, "messages": [
                        {"role": "system", "content": f"system {i % 20} " + "policy text " * 300},
                        {"role": "user", "content": f"question {i}"}]}
                    for name, envoy in (("with /tokenize", a), ("without", b)):
                        t0 = time.perf_counter()
                        r = session.post(envoy.url + "/v1/chat/completions", json=body, timeout=10)
                        times[name].append((time.perf_counter() - t0) * 1e3)
                        assert r.status_code == 200, r.text
                ok = a.stats("wasmcustom.kvroute.tokenizer")
                print(f"tokenizer call-out: {requests_per_arm} chat requests per arm (~4 KB bodies), interleaved")
                print("arm              p50_ms  p90_ms  p99_ms  mean_ms")
                for name, values in times.items():
                    print(f"{name:15s} {percentile(values, .5):7.2f} {percentile(values, .9):7.2f} "
                          f"{percentile(values, .99):7.2f} {statistics.mean(values):8.2f}")
                w, wo = times["with /tokenize"], times["without"]
                print(f"added p50 {percentile(w, .5) - percentile(wo, .5):.2f} ms, "
                      f"added p99 {percentile(w, .99) - percentile(wo, .99):.2f} ms; "
                      f"stats {json.dumps(ok, sort_keys=True)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    e = sub.add_parser("event-to-routable")
    e.add_argument("--trials", type=int, default=20)
    e.add_argument("--delays", default="10,25,50,75,100,125,150,200,250,300")
    e.add_argument("--verbose", action="store_true", help="print every probe that was not routable")
    t = sub.add_parser("tokenizer")
    t.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    if args.what == "event-to-routable":
        event_to_routable(args.trials, [int(d) for d in args.delays.split(",")], args.verbose)
    else:
        tokenizer_latency(args.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
