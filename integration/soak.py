"""Soak: Envoy with kvroute in front of simulated pods at a sustained request rate for a long
time, with the proxy's memory sampled. What a production proxy must show: no error that plain
Envoy would not give, and memory that levels off instead of growing.

The traffic mixes what a gateway sees: conversations sharing long system prompts (they stick),
fresh prompts (routed by load), requests the pods refuse (unknown model, 404), bodies over
max_body_bytes (left to Envoy's balancer), and malformed JSON (the pods answer 400).

    .venv/bin/python integration/soak.py --minutes 30 --rate 20 --out build/soak.json

Prints one line per sample and a summary; --out keeps every sample as JSON.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from envoyctl import EnvoyProcess, render_gateway  # noqa: E402
from simcluster import SimCluster  # noqa: E402


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent)
    return out.stdout.strip() or "unknown"


class Traffic:
    """One request of the mix per call; counts outcomes by kind."""

    def __init__(self, url: str, model: str, groups: int, seed: int):
        self.url = url + "/v1/chat/completions"
        self.model = model
        self.rng = random.Random(seed)
        self.systems = [f"[group {g}] " + " ".join(f"rule {i} of group {g}" for i in range(300))
                        for g in range(groups)]
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.routed = 0

    def pick(self) -> tuple[str, bytes]:
        r = self.rng.random()
        if r < 0.70:
            system = self.rng.choice(self.systems)
            kind, model = "shared_prefix", self.model
        elif r < 0.85:
            system = f"[fresh {uuid.uuid4().hex}] " + "words " * 200
            kind, model = "fresh", self.model
        elif r < 0.93:
            system = "[refused] " + "x " * 2000
            kind, model = "unknown_model", "no-such-model"
        elif r < 0.97:
            return "oversize", json.dumps({"model": self.model, "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "y" * (5 << 20)}]}).encode()
        else:
            return "malformed", b'{"model": "' + self.model.encode() + b'", "messages": [{"role":'
        body = {"model": model, "max_tokens": self.rng.randint(2, 16),
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"question {self.rng.random()}"}]}
        return kind, json.dumps(body).encode()

    def send(self) -> None:
        with self.lock:
            kind, body = self.pick()
        try:
            r = requests.post(self.url, data=body, timeout=60, headers={"content-type": "application/json"})
            outcome = f"{kind}:{r.status_code}"
            routed = "pod=" in r.headers.get("x-kvroute-decision", "")
        except requests.RequestException as e:
            outcome, routed = f"{kind}:{type(e).__name__}", False
        with self.lock:
            self.counts[outcome] += 1
            self.routed += routed


def fill(envoy, model: str, target_blocks: int) -> None:
    """Fresh prompts until the learned index holds `target_blocks` (every pod's table nearly full)."""
    def one(_):
        body = {"model": model, "max_tokens": 1,
                "messages": [{"role": "user", "content": f"[fill {uuid.uuid4().hex}] " + "words " * 200}]}
        requests.post(envoy.url + "/v1/chat/completions", json=body, timeout=60)

    with ThreadPoolExecutor(max_workers=16) as pool:
        while envoy.stats("kvroute.index.blocks").get("wasmcustom.kvroute.index.blocks", 0) < target_blocks:
            list(pool.map(one, range(200)))
    print(f"index filled: {envoy.stats('kvroute.index.blocks')}", flush=True)


# What each kind must get: anything else is an error kvroute must not cause.
EXPECTED = {"shared_prefix": "200", "fresh": "200", "unknown_model": "404", "oversize": "200", "malformed": "400"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second, sustained")
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--groups", type=int, default=40, help="shared system prompts")
    ap.add_argument("--sample-seconds", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads")
    ap.add_argument("--fill-index", action="store_true",
                    help="first fill the learned index with fresh prompts, so the sampled run starts at steady state")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    # The commit under test: taken before the run, which may outlast later commits.
    commit = git_commit()
    samples = []
    with SimCluster(pods=args.pods, time_scale=0.2) as sims:
        config = render_gateway(sims.addresses)
        with EnvoyProcess(config, concurrency=args.concurrency) as envoy:
            envoy.wait_for_peers()
            traffic = Traffic(envoy.url, sims.model, args.groups, seed=1)
            if args.fill_index:
                fill(envoy, sims.model, target_blocks=int(0.95 * sum(sims.capacities)))
            started = time.monotonic()
            end = started + args.minutes * 60
            next_sample = started
            sent = 0
            with ThreadPoolExecutor(max_workers=64) as pool:
                while time.monotonic() < end:
                    now = time.monotonic()
                    if now >= next_sample:
                        sample = {"t_s": round(now - started, 1), "rss_kib": rss_kib(envoy.pid),
                                  "sent": sent, "counts": dict(traffic.counts)}
                        samples.append(sample)
                        print(f"t={sample['t_s']:7.1f}s rss={sample['rss_kib'] / 1024:7.1f} MiB sent={sent}",
                              flush=True)
                        next_sample += args.sample_seconds
                    pool.submit(traffic.send)
                    sent += 1
                    # Open loop at the target rate, whatever the answers' latency.
                    time.sleep(max(0.0, started + sent / args.rate - time.monotonic()))
            final = {"t_s": round(time.monotonic() - started, 1), "rss_kib": rss_kib(envoy.pid),
                     "sent": sent, "counts": dict(traffic.counts)}
            samples.append(final)
            kvroute_stats = envoy.stats("kvroute")
            too_large = envoy.stats("downstream_rq_too_large")

    errors = {k: v for k, v in traffic.counts.items() if k.split(":")[1] != EXPECTED[k.split(":")[0]]}
    warm = [s for s in samples if s["t_s"] >= min(120.0, args.minutes * 30)]
    summary = {
        "commit": commit,
        "command": "integration/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "minutes": args.minutes, "rate": args.rate, "pods": args.pods, "concurrency": args.concurrency,
        "requests": sum(traffic.counts.values()), "routed": traffic.routed, "counts": dict(traffic.counts),
        "unexpected": errors,
        "rss_mib": {"first": samples[0]["rss_kib"] / 1024, "after_warmup": warm[0]["rss_kib"] / 1024 if warm else None,
                    "max": max(s["rss_kib"] for s in samples) / 1024, "last": samples[-1]["rss_kib"] / 1024},
        "envoy_too_large": too_large, "kvroute": kvroute_stats,
    }
    if warm:
        summary["rss_growth_after_warmup_pct"] = round(
            100.0 * (samples[-1]["rss_kib"] - warm[0]["rss_kib"]) / warm[0]["rss_kib"], 2)
    print(json.dumps({k: v for k, v in summary.items() if k != "kvroute"}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "samples": samples}, indent=1) + "\n")
    # The soak must have really routed traffic, and lost nothing kvroute could be blamed for.
    if traffic.routed == 0 or errors:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
