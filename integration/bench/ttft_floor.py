#!/usr/bin/env python3
"""How far routing can lower a run's TTFT p90: each strategy's cold-prefill floor and the share
of requests at or above it, per measured stage.

    .venv-bench/bin/python integration/bench/ttft_floor.py docs/results/<run> [--first 4]

The floor is the shortest TTFT among the run's first `--first` requests by start time (default
4): the first of them reaches an idle pod with nothing cached, alone, so its TTFT is one cold
prefill and nothing else. No placement makes a request that misses its prefix faster than
that. When more than 10 % of a stage's requests take at least the floor, the stage's p90 is at
least the floor whatever the router did with them; only raising the hit rate moves it.

Reads `raw.tar.gz` of a published results folder or `raw/<strategy>/requests.jsonl.gz` of a
run directory.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional

from raw_files import json_lines, read_raw
from report import _pct


def load_requests(run: str) -> Dict[str, List[dict]]:
    """Requests by strategy name."""
    return {name: json_lines(text) for name, text in read_raw(run, "requests.jsonl.gz").items()}


def answered(requests: List[dict]) -> List[dict]:
    """The requests that got a first token."""
    return [r for r in requests if r.get("error") is None and r.get("ttft") is not None]


def floor_of(requests: List[dict], first: int) -> Optional[float]:
    ok = sorted(answered(requests), key=lambda r: r["start"])
    return min((r["ttft"] for r in ok[:first]), default=None)


def stage_rows(requests: List[dict], floor: float) -> List[dict]:
    rows = []
    for stage in sorted({r["stage"] for r in requests if r.get("stage", 0) > 0}):
        ttfts = [r["ttft"] for r in answered(requests) if r.get("stage") == stage]
        if ttfts:
            rows.append({"stage": stage, "requests": len(ttfts), "p90": _pct(ttfts, 90),
                         "at_floor": sum(t >= floor for t in ttfts) / len(ttfts)})
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a results folder (raw.tar.gz) or a run directory (raw/)")
    ap.add_argument("--first", type=int, default=4, help="first requests whose shortest TTFT is the floor")
    args = ap.parse_args(argv)
    by_strategy = load_requests(args.run)
    if not by_strategy:
        raise SystemExit(f"no requests.jsonl.gz under {args.run}")
    print("| strategy | floor (cold prefill) | stage | requests | TTFT p90 | share ≥ floor |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, requests in by_strategy.items():
        floor = floor_of(requests, args.first)
        if floor is None:
            continue
        for row in stage_rows(requests, floor):
            print(f"| {name} | {floor:.3f} s | {row['stage']} | {row['requests']} | {row['p90']:.3f} s | "
                  f"{100 * row['at_floor']:.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
