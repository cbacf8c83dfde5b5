#!/usr/bin/env python3
"""Did a strategy fill one pod's KV cache while another pod had room? Per strategy, over its
measured stages, from the pods' sampled `vllm:kv_cache_usage_perc` (one sample a second).

    .venv-bench/bin/python integration/bench/kv_pressure.py docs/results/<run> [--full 0.98] [--room 0.7]

A pod at `--full` or above has no KV left for a new sequence: vLLM queues or preempts there.
A sample where such a pod sits beside one below `--room` is load the router could have placed
elsewhere (issue 11: "neither mode overloads a pod while others have room"). Preemptions are
`vllm:num_preemptions_total` over the same window, summed over the pods.

Why a pod filled: over the samples with a full pod, the sequences (running + waiting) on each
full pod against the median of the other pods in the same sample, and the full pod's KV use per
running sequence as a multiple of the others' median. More sequences at the same KV each: the
router stacked requests there; the same sequences holding more KV each: the pod held more
prefixes (or longer prompts) than the others.

Reads `results.json` (each strategy's stage times) and `raw.tar.gz` of a published results
folder, or `raw/<strategy>/pod-samples.jsonl` of a run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Optional, Tuple

import podmetrics
from raw_files import json_lines, read_raw

KV = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
PREEMPTIONS = "vllm:num_preemptions_total"


def measured_windows(run: str) -> Dict[str, Tuple[float, float]]:
    """Each strategy's measured span: the first measured stage's start to the last one's end."""
    path = os.path.join(run, "results.json")
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        results = json.load(fh).get("results", [])
    windows = {}
    for res in results:
        stages = [s for s in res.get("stages") or [] if not s.get("warmup") and s.get("t_start")]
        if stages:
            windows[res["strategy"]] = (stages[0]["t_start"], stages[-1]["t_end"])
    return windows


def sequences(pod: dict) -> float:
    return float(pod.get(RUNNING) or 0) + float(pod.get(WAITING) or 0)


def kv_per_sequence(pod: dict) -> Optional[float]:
    running = float(pod.get(RUNNING) or 0)
    return pod[KV] / running if running > 0 else None


def mean(values: List[float]) -> Optional[float]:
    return statistics.fmean(values) if values else None


def pressure(rows: List[dict], window: Optional[Tuple[float, float]], full: float, room: float) -> dict:
    if window is not None:
        rows = [r for r in rows if window[0] <= r["t"] <= window[1]]
    good = [{name: pod for name, pod in r["pods"].items() if "error" not in pod} for r in rows]
    with_full = beside_room = 0
    pods_full = set()
    longest_queue = 0.0
    full_sequences, other_sequences, kv_ratios = [], [], []
    for pods in good:
        kv = {name: pod[KV] for name, pod in pods.items() if pod.get(KV) is not None}
        full_now = {name for name, v in kv.items() if v >= full}
        pods_full |= full_now
        if full_now:
            with_full += 1
            if any(v < room for v in kv.values()):
                beside_room += 1
            others = [pods[name] for name in kv if name not in full_now]
            if others:
                other_kv = [r for r in map(kv_per_sequence, others) if r is not None]
                other_kv_median = statistics.median(other_kv) if other_kv else None
                other_sequences.append(statistics.median(map(sequences, others)))
                for name in full_now:
                    full_sequences.append(sequences(pods[name]))
                    own = kv_per_sequence(pods[name])
                    if own is not None and other_kv_median:
                        kv_ratios.append(own / other_kv_median)
        longest_queue = max([longest_queue] + [float(p[WAITING]) for p in pods.values() if p.get(WAITING) is not None])
    present = [pods for pods in good if pods]
    preempted = podmetrics.counter_delta(present[0], present[-1], PREEMPTIONS) if present else None
    return {"samples": len(rows), "with_full": with_full, "beside_room": beside_room, "pods_full": len(pods_full),
            "longest_queue": longest_queue, "preemptions": preempted,
            "full_sequences": mean(full_sequences), "other_sequences": mean(other_sequences),
            "kv_per_sequence_ratio": mean(kv_ratios)}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a results folder (results.json, raw.tar.gz) or a run directory (results.json, raw/)")
    ap.add_argument("--full", type=float, default=0.98, help="KV use at which a pod counts as full")
    ap.add_argument("--room", type=float, default=0.7, help="KV use below which a pod counts as having room")
    args = ap.parse_args(argv)
    samples = read_raw(args.run, "pod-samples.jsonl")
    if not samples:
        raise SystemExit(f"no pod-samples.jsonl under {args.run}")
    windows = measured_windows(args.run)
    print(f"| strategy | samples | a pod ≥ {args.full:.0%} KV | … while another < {args.room:.0%} | "
          "pods that filled | longest queue | preemptions | sequences, full pod / others | "
          "KV per sequence, full pod ÷ others |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, text in samples.items():
        p = pressure(json_lines(text), windows.get(name), args.full, args.room)
        preempted = "—" if p["preemptions"] is None else f"{p['preemptions']:.0f}"
        stacked = "—" if p["full_sequences"] is None else f"{p['full_sequences']:.0f} / {p['other_sequences']:.0f}"
        ratio = "—" if p["kv_per_sequence_ratio"] is None else f"{p['kv_per_sequence_ratio']:.2f}"
        print(f"| {name} | {p['samples']} | {p['with_full']} | {p['beside_room']} | {p['pods_full']} | "
              f"{p['longest_queue']:.0f} | {preempted} | {stacked} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
