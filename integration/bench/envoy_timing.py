"""Time to first token as Envoy sees it, per QPS stage, from the bench Envoys' access logs.

The load generator times each request from its own dispatch to the first token it reads. On a
machine it shares with the pods and the routers, that includes its own scheduling delays, and a
time-scaled run multiplies them by 1 / scale in simulated time. Envoy's access log
(envoy_bench.ACCESS_LOG_FORMAT) times the same request from its arrival at the proxy:
- `routing`: arrival → the upstream request began (body read, routing decision, tokenizer call-out);
- `ttft`: arrival → the pod's first body byte (the first token).
Both are reported in simulated seconds, per stage, like the client's columns.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from envoy_bench import ACCESS_LOG_FIELDS, access_log_lines
from report import _pct as percentile


def parse_line(line: str) -> Optional[Dict[str, float]]:
    """One access-log line → its fields; None for a request without a first body byte (failed, shed)."""
    # The quoted decision header after the fields holds spaces: left unsplit.
    parts = line.split(maxsplit=len(ACCESS_LOG_FIELDS))
    if len(parts) < len(ACCESS_LOG_FIELDS):
        return None
    rec = dict(zip(ACCESS_LOG_FIELDS, parts))
    try:
        return {"start": float(rec["start"]), "routing_us": float(rec["upstream_sent_us"]),
                "ttft_us": float(rec["first_byte_us"])}
    except ValueError:  # "-": that point was never reached
        return None


def per_stage(records: List[Dict[str, float]], stages: List[Dict[str, Any]], time_scale: float) -> Dict[str, Any]:
    """Per stage (by arrival time within the stage's window): requests seen, TTFT p50 / p90 and routing p90 at
    Envoy, in simulated seconds; plus the means over measured stages of TTFT p90 and routing p90."""
    k = 1e-6 / time_scale
    rows: List[Dict[str, Any]] = []
    for s in stages:
        if not s.get("t_start"):
            rows.append({"n": 0})
            continue
        inside = [r for r in records if s["t_start"] <= r["start"] <= s["t_end"]]
        ttft = [r["ttft_us"] * k for r in inside]
        routing = [r["routing_us"] * k for r in inside]
        rows.append({"n": len(inside), "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90),
                     "routing_p90": percentile(routing, 90)})
    measured = [r for r, s in zip(rows, stages) if not s.get("warmup") and r["n"]]

    def mean(key: str) -> Optional[float]:
        vals = [r[key] for r in measured if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    return {"stages": rows, "ttft_p90_mean": mean("ttft_p90"), "routing_p90_mean": mean("routing_p90"),
            "requests": sum(r["n"] for r in rows)}


def summarize(sdir: str, stages: List[Dict[str, Any]], time_scale: float) -> Optional[Dict[str, Any]]:
    """The Envoy-side timing of a strategy's run directory, or None when no Envoy logged (the peers)."""
    lines = access_log_lines(sdir)
    if not lines:
        return None
    return per_stage([r for r in map(parse_line, lines) if r is not None], stages, time_scale)
