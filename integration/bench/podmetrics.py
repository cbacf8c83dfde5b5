"""Pod-side metrics for the benchmark: scrape every pod's Prometheus /metrics.

The waiting queue and the prefix-cache hit rate in the report come from the
pods (vLLM metric names, as vllm-sim exports them), never from the router:
- `vllm:num_requests_waiting` / `vllm:num_requests_running` (gauges): sampled
  every `interval` seconds on every pod while a strategy runs; the report's
  "mean waiting queue" is the mean over samples of the per-pod value (the
  reference reports the vLLM wait queue per pod, averaged).
- `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total`
  (counters, tokens): hit rate = Δhits / Δqueries over the strategy's run.
- `vllm:kv_cache_usage_perc` (gauge, 0..1) is sampled as well.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from typing import Dict, List, Optional

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([^\s]+)")

GAUGES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
)
COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    # Pod-side TTFT (arrival at the pod → first token, simulated seconds): the
    # client's TTFT minus this is time spent before the pod (client, router).
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
)


def parse_prometheus(text: str) -> Dict[str, float]:
    """Sum every sample of a metric over its label sets: {name: value}."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, _labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + v
    return out


def scrape(address: str, timeout: float = 2.0) -> Dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as resp:
        return parse_prometheus(resp.read().decode("utf-8", "replace"))


def scrape_all(addresses: List[str]) -> Dict[str, Dict[str, float]]:
    return {a: scrape(a) for a in addresses}


class Sampler:
    """Background sampler of pod gauges; writes JSON lines to `path`."""

    def __init__(self, addresses: List[str], path: str, interval: float = 1.0) -> None:
        self.addresses = list(addresses)
        self.path = path
        self.interval = interval
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.scrape_errors = 0
        self.samples = 0

    def _run(self) -> None:
        with open(self.path, "a", buffering=1) as fh:
            while not self._stop.is_set():
                t0 = time.time()
                row: Dict[str, object] = {"t": t0, "pods": {}}
                for a in self.addresses:
                    try:
                        vals = scrape(a, timeout=max(0.5, self.interval))
                        row["pods"][a] = {k: vals.get(k) for k in GAUGES + COUNTERS}  # type: ignore[index]
                    except Exception as e:  # counted, never fatal
                        self.scrape_errors += 1
                        row["pods"][a] = {"error": str(e)[:200]}  # type: ignore[index]
                fh.write(json.dumps(row) + "\n")
                self.samples += 1
                self._stop.wait(max(0.0, self.interval - (time.time() - t0)))

    def __enter__(self) -> "Sampler":
        self._thread = threading.Thread(target=self._run, name="pod-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)


def load_samples(path: str) -> List[dict]:
    rows = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def summarize_samples(rows: List[dict], t0: float | None = None, t1: float | None = None) -> Dict[str, Optional[float]]:
    """Mean per-pod waiting/running/KV usage over samples in [t0, t1]."""
    acc: Dict[str, List[float]] = {k: [] for k in GAUGES}
    for r in rows:
        if t0 is not None and r["t"] < t0:
            continue
        if t1 is not None and r["t"] > t1:
            continue
        for pod in r["pods"].values():
            for k in GAUGES:
                v = pod.get(k)
                if v is not None:
                    acc[k].append(float(v))
    return {k: (sum(v) / len(v) if v else None) for k, v in acc.items()}


def per_pod(rows: List[dict], t0: float | None = None, t1: float | None = None) -> Dict[str, Dict[str, Optional[float]]]:
    """Mean waiting / running / KV usage of each pod over samples in [t0, t1] (who got the work)."""
    acc: Dict[str, Dict[str, List[float]]] = {}
    for r in rows:
        if (t0 is not None and r["t"] < t0) or (t1 is not None and r["t"] > t1):
            continue
        for name, pod in r["pods"].items():
            for k in GAUGES:
                if pod.get(k) is not None:
                    acc.setdefault(name, {g: [] for g in GAUGES})[k].append(float(pod[k]))
    return {name: {k: (sum(v) / len(v) if v else None) for k, v in vals.items()} for name, vals in sorted(acc.items())}


def waiting_trend(rows: List[dict], t0: float | None = None, t1: float | None = None) -> Dict[str, Optional[float]]:
    """The longest pod queue per sample in [t0, t1]: its maximum, and its mean over the first and the
    last third of the samples (a queue that grows without bound ends far above where it started)."""
    worst = []
    for r in rows:
        if (t0 is not None and r["t"] < t0) or (t1 is not None and r["t"] > t1):
            continue
        vals = [float(p["vllm:num_requests_waiting"]) for p in r["pods"].values()
                if p.get("vllm:num_requests_waiting") is not None]
        if vals:
            worst.append(max(vals))
    if not worst:
        return {"max": None, "first_third": None, "last_third": None}
    k = max(1, len(worst) // 3)
    return {"max": max(worst), "first_third": sum(worst[:k]) / k, "last_third": sum(worst[-k:]) / k}


def counter_delta(before: Dict[str, Dict[str, float]], after: Dict[str, Dict[str, float]], name: str) -> Optional[float]:
    """Sum over pods of after-before for a counter (a counter that went down was reset: use after)."""
    total = 0.0
    seen = False
    for pod, a in after.items():
        if name not in a:
            continue
        seen = True
        b = before.get(pod, {}).get(name, 0.0)
        d = a[name] - b
        total += d if d >= 0 else a[name]
    return total if seen else None
