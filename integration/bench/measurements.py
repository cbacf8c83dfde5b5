"""What one strategy's run measured, as results.json records it: inference-perf's reports per
stage (one client or several, merged), per-request records with their priority class, the pods'
sampled metrics over the measured stages, and the routers' own counters."""

from __future__ import annotations

import datetime as dt
import json
import os
from typing import Any, Dict, List, Optional

import ipwrap
import podmetrics
import profiles


def _div(x: Optional[float], d: float) -> Optional[float]:
    return None if x is None else x / d


_DURATIONS = ("ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99", "benchmark_time_s")


_RATES = ("output_tok_s", "requests_s", "achieved_rate")


def to_simulated_time(stage: Dict[str, Any], time_scale: float) -> Dict[str, Any]:
    """inference-perf's wall-clock numbers in simulated seconds (wall ones kept under "wall")."""
    if time_scale == 1.0:
        return stage
    stage["wall"] = {k: stage.get(k) for k in _DURATIONS + _RATES}
    for k in _DURATIONS:
        stage[k] = _div(stage.get(k), time_scale)
    for k in _RATES:
        stage[k] = None if stage.get(k) is None else stage[k] * time_scale
    return stage


def _stage_heads(profile: profiles.Profile) -> List[Dict[str, Any]]:
    """Every stage's identity (warm-up first): rate, duration, the requests it sends (all clients)."""
    rates = [profile.load.warmup[0]] + [r for r, _ in profile.load.stages]
    durs = [profile.load.warmup[1]] + [d for _, d in profile.load.stages]
    return [{"stage": i, "rate": rates[i], "duration": durs[i], "expected": exp, "warmup": i == 0}
            for i, exp in enumerate(profile.expected_requests())]


def _stage_report(ip_dir: str, i: int) -> Dict[str, Any]:
    """One client's numbers for stage i from inference-perf's own per-stage report (wall time)."""
    f = os.path.join(ip_dir, f"stage_{i}_lifecycle_metrics.json")
    if not os.path.exists(f):
        return {"recorded": 0, "successes": 0, "failures": 0}
    d = json.load(open(f))
    succ, fail = d.get("successes", {}), d.get("failures", {})
    ttft = (succ.get("latency") or {}).get("time_to_first_token") or {}
    thr = succ.get("throughput") or {}
    return {
        "recorded": d.get("load_summary", {}).get("count", 0),
        "successes": succ.get("count", 0),
        "failures": fail.get("count", 0),
        "failure_labels": {k: (v.get("count") if isinstance(v, dict) else v) for k, v in (fail.get("by_label") or {}).items()},
        "output_tok_s": thr.get("output_tokens_per_sec"),
        "requests_s": thr.get("requests_per_sec"),
        "ttft_mean": ttft.get("mean"),
        "ttft_p50": ttft.get("median", ttft.get("p50")),
        "ttft_p90": ttft.get("p90"),
        "ttft_p99": ttft.get("p99"),
        "achieved_rate": d.get("load_summary", {}).get("achieved_rate"),
        "benchmark_time_s": d.get("benchmark_time_seconds"),
    }


def _stage_window(ip_dir: str, i: int) -> Dict[str, float]:
    """Stage i's start and end (epoch seconds) from inference-perf's partial report, if written."""
    import yaml

    pf = os.path.join(ip_dir, f"inference-perf.partial.stage_{i}.yaml")
    if not os.path.exists(pf):
        return {}
    try:
        t = (yaml.safe_load(open(pf)) or {}).get("run", {}).get("time", {})
        return {"t_start": dt.datetime.fromisoformat(t["start"].replace("Z", "+00:00")).timestamp(),
                "t_end": dt.datetime.fromisoformat(t["end"].replace("Z", "+00:00")).timestamp()}
    except Exception:
        return {}


def _staged_requests(ip_dir: str, recorded: List[int]) -> List[tuple]:
    """(stage, raw record) for every request of one client, sorted by start; the stage from
    inference-perf's per-stage counts (stages run one after another: a stage ends only when all its
    requests have)."""
    f = os.path.join(ip_dir, "per_request_lifecycle_metrics.json")
    if not os.path.exists(f):
        return []
    raw = json.load(open(f))
    raw.sort(key=lambda x: x.get("start_time", 0.0))
    bounds = []
    acc = 0
    for n in recorded:
        acc += n
        bounds.append(acc)
    out = []
    k = 0
    for idx, r in enumerate(raw):
        while k < len(bounds) - 1 and idx >= bounds[k]:
            k += 1
        out.append((k, r))
    return out


def _slim_request(stage: int, r: Dict[str, Any], profile: profiles.Profile) -> Dict[str, Any]:
    cm = r.get("computed_metrics") or {}
    err = r.get("error")
    scale = profile.sim.time_scale
    extra = {}
    if profile.workload.critical_share > 0:
        extra["priority"] = ipwrap.priority_of(_prompt_of(r.get("request")), profile.workload.critical_share)
    return {
        "stage": stage,
        "start": _div(r.get("start_time"), scale),
        "end": _div(r.get("end_time"), scale),
        "ttft": _div(cm.get("time_to_first_token"), scale),
        "out": cm.get("output_tokens"),
        "in": cm.get("input_tokens"),
        "error": (err.get("error_type") if isinstance(err, dict) else str(err)) if err else None,
        **extra,
    }


def _add_priorities(profile: profiles.Profile, stages: List[Dict[str, Any]], reqs: List[Dict[str, Any]]) -> None:
    if profile.workload.critical_share > 0:
        for st in stages:
            st["by_priority"] = by_priority([r for r in reqs if r["stage"] == st["stage"]])


def parse_ip_reports(ip_dir: str, profile: profiles.Profile) -> Dict[str, Any]:
    """Per-stage numbers from inference-perf's own reports + a slim per-request record."""
    stages = []
    for st in _stage_heads(profile):
        st.update(_stage_report(ip_dir, st["stage"]))
        st["not_recorded"] = max(0, st["expected"] - st["recorded"])  # never sent or lost: counted as errors
        st.update(_stage_window(ip_dir, st["stage"]))
        stages.append(to_simulated_time(st, profile.sim.time_scale))
    reqs = [_slim_request(k, r, profile) for k, r in _staged_requests(ip_dir, [st["recorded"] for st in stages])]
    _add_priorities(profile, stages, reqs)
    return {"stages": stages, "requests": reqs}


def merge_stage(raw: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A stage's numbers from several clients' raw per-request records, with inference-perf's own
    formulas (reportgen.base.summarize_requests): throughput over max(end) - min(start) of every
    request, achieved rate over the span of starts, TTFT percentiles by its `summarize` (numpy)."""
    from inference_perf.reportgen.base import summarize

    if not raw:
        return {}
    total = max(r["end_time"] for r in raw) - min(r["start_time"] for r in raw)
    sending = max(r["start_time"] for r in raw) - min(r["start_time"] for r in raw)
    ok = [r for r in raw if r.get("error") is None]
    ttft = summarize([t for t in ((r.get("computed_metrics") or {}).get("time_to_first_token") for r in ok)
                      if t is not None], [50, 90, 99]) or {}
    out_tokens = sum((r.get("computed_metrics") or {}).get("output_tokens") or 0 for r in ok)
    return {
        "output_tok_s": out_tokens / total if total > 0 else 0.0,
        "requests_s": len(ok) / total if total > 0 else 0.0,
        "ttft_mean": ttft.get("mean"),
        "ttft_p50": ttft.get("median"),
        "ttft_p90": ttft.get("p90"),
        "ttft_p99": ttft.get("p99"),
        "achieved_rate": len(raw) / sending if sending > 0 else 0.0,
    }


def parse_mesh_reports(ip_dir: str, profile: profiles.Profile) -> Dict[str, Any]:
    """The mesh scenario's clients merged into one per-stage table: counts summed from each client's
    inference-perf report, TTFT and throughput recomputed over the union of their requests
    (merge_stage), the stage window from the first client's start to the last one's end (the clients
    start each stage together, ipwrap.py's barrier, and end it when their own requests have)."""
    dirs = [os.path.join(ip_dir, f"client-{k}") for k in range(profile.load.clients)]
    per_client = [[_stage_report(d, st["stage"]) for st in _stage_heads(profile)] for d in dirs]
    staged = [_staged_requests(d, [st["recorded"] for st in rows]) for d, rows in zip(dirs, per_client)]
    stages = []
    for st in _stage_heads(profile):
        i = st["stage"]
        rows = [c[i] for c in per_client]
        labels: Dict[str, int] = {}
        for row in rows:
            for k, v in (row.get("failure_labels") or {}).items():
                labels[k] = labels.get(k, 0) + (v or 0)
        st.update({key: sum(row[key] for row in rows) for key in ("recorded", "successes", "failures")})
        st["failure_labels"] = labels
        st.update(merge_stage([r for reqs in staged for k, r in reqs if k == i]))
        times = [row.get("benchmark_time_s") for row in rows if row.get("benchmark_time_s") is not None]
        st["benchmark_time_s"] = max(times) if times else None
        st["not_recorded"] = max(0, st["expected"] - st["recorded"])
        windows = [w for w in (_stage_window(d, i) for d in dirs) if w]
        if windows:
            st["t_start"] = min(w["t_start"] for w in windows)
            st["t_end"] = max(w["t_end"] for w in windows)
        st["clients"] = [{"client": k, "recorded": row["recorded"], "successes": row["successes"],
                          "failures": row["failures"]} for k, row in enumerate(rows)]
        stages.append(to_simulated_time(st, profile.sim.time_scale))
    reqs = sorted(({**_slim_request(k, r, profile), "client": c} for c, reqs in enumerate(staged) for k, r in reqs),
                  key=lambda r: r["start"] or 0.0)
    _add_priorities(profile, stages, reqs)
    return {"stages": stages, "requests": reqs}


def _prompt_of(request_data: Any) -> str:
    """The prompt of a recorded request body (completion API), '' when unreadable."""
    try:
        body = json.loads(request_data) if isinstance(request_data, str) else (request_data or {})
        return str(body.get("prompt", ""))
    except (ValueError, AttributeError):
        return ""


def answered_ttfts(reqs: List[Dict[str, Any]]) -> List[float]:
    """Sorted TTFTs of the requests that were answered."""
    return sorted(r["ttft"] for r in reqs if not r.get("error") and r.get("ttft") is not None)


def nearest_rank(xs: List[float], p: float) -> Optional[float]:
    """The p-th percentile of sorted xs, nearest rank (None when empty)."""
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


def by_priority(reqs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per priority class: requests, answered, failed (sheddable failures are the proxy's 429s when
    the router sheds), TTFT p50/p90 of the answered ones."""
    out: Dict[str, Any] = {}
    for cls in ("critical", "sheddable"):
        mine = [r for r in reqs if r.get("priority") == cls]
        ok = answered_ttfts(mine)
        failed = [r for r in mine if r.get("error")]
        out[cls] = {"requests": len(mine), "answered": len(ok), "failed": len(failed),
                    "errors": sorted({str(r["error"]) for r in failed}),
                    "ttft_p50": nearest_rank(ok, 50), "ttft_p90": nearest_rank(ok, 90)}
    return out


def pod_summary(samples_path: str, before: Dict[str, Dict[str, float]], after: Dict[str, Dict[str, float]],
                stages: List[Dict[str, Any]]) -> Dict[str, Any]:
    rows = podmetrics.load_samples(samples_path) if os.path.exists(samples_path) else []
    measured = [s for s in stages if not s["warmup"] and s.get("t_start")]
    t0 = measured[0]["t_start"] if measured else None
    t1 = measured[-1]["t_end"] if measured else None
    out: Dict[str, Any] = {"samples": len(rows)}
    out["measured"] = podmetrics.summarize_samples(rows, t0, t1)
    out["per_pod_measured"] = podmetrics.per_pod(rows, t0, t1)
    out["all"] = podmetrics.summarize_samples(rows)
    q = podmetrics.counter_delta(before, after, "vllm:prefix_cache_queries_total")
    h = podmetrics.counter_delta(before, after, "vllm:prefix_cache_hits_total")
    out["prefix_cache_queries"] = q
    out["prefix_cache_hits"] = h
    out["hit_rate_all"] = (h / q) if q else None
    out["preemptions"] = podmetrics.counter_delta(before, after, "vllm:num_preemptions_total")

    # Hit rate over the measured stages only, from the sampled counters.
    def counters_at(t: Optional[float], first: bool) -> Dict[str, Dict[str, float]]:
        cand = [r for r in rows if t is not None and (r["t"] >= t if first else r["t"] <= t)]
        if not cand:
            return {}
        r = cand[0] if first else cand[-1]
        return {p: v for p, v in r["pods"].items() if "error" not in v}

    b, a = counters_at(t0, True), counters_at(t1, False)
    out["hit_rate_measured"] = _hit_rate(b, a)
    out["hit_rate_per_pod_measured"] = {pod: _hit_rate({pod: b[pod]}, {pod: a[pod]}) for pod in sorted(set(a) & set(b))}
    ts = podmetrics.counter_delta(b, a, "vllm:time_to_first_token_seconds_sum") if b and a else None
    tc = podmetrics.counter_delta(b, a, "vllm:time_to_first_token_seconds_count") if b and a else None
    out["pod_ttft_mean_measured"] = (ts / tc) if tc else None
    # Per-stage waiting/hit rate.
    per = []
    for s in stages:
        if not s.get("t_start"):
            per.append({})
            continue
        g = podmetrics.summarize_samples(rows, s["t_start"], s["t_end"])
        bs, as_ = counters_at(s["t_start"], True), counters_at(s["t_end"], False)
        per.append({"waiting": g.get("vllm:num_requests_waiting"), "running": g.get("vllm:num_requests_running"),
                    "kv_usage": g.get("vllm:kv_cache_usage_perc"), "hit_rate": _hit_rate(bs, as_),
                    "longest_queue": podmetrics.waiting_trend(rows, s["t_start"], s["t_end"])})
    out["per_stage"] = per
    return out


def _hit_rate(before: Dict[str, Dict[str, float]], after: Dict[str, Dict[str, float]]) -> Optional[float]:
    """Prefix-cache hits over queries between two samples; None when unknown or nothing was queried."""
    if not before or not after:
        return None
    queries = podmetrics.counter_delta(before, after, "vllm:prefix_cache_queries_total")
    hits = podmetrics.counter_delta(before, after, "vllm:prefix_cache_hits_total")
    return hits / queries if queries and hits is not None else None


def _prom_values(text: str, prefixes: tuple) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(prefixes):
            continue
        try:
            key, val = line.rsplit(" ", 1)
            out[key] = float(val)
        except ValueError:
            continue
    return out


def router_stats(st: Dict[str, Any], sdir: str) -> Dict[str, Any]:
    """Routing-side counters worth reporting: kvroute's Envoy stats, the indexer's and peers' metrics."""
    out: Dict[str, Any] = {}
    if "kvroute" in st:
        out["kvroute"] = {k.replace("wasmcustom.", ""): v for k, v in st["kvroute"].items()
                          if k.startswith("wasmcustom.kvroute.") and isinstance(v, (int, float)) and v}
    for key, fname, prefixes in (("indexer_metrics", "indexer-metrics.txt", ("kvroute_indexer",)),
                                 ("prometheus", "router-metrics.txt",
                                  ("vllm_router_kv", "vllm_router_prefix", "smg_router_cache", "smg_policy",
                                   "sgl_router_cache", "sgl_router_policy", "vllm_router_cache"))):
        if st.get(key):
            with open(os.path.join(sdir, fname), "w") as fh:
                fh.write(st[key])
            out[key] = _prom_values(st[key], prefixes)
    if st.get("envoy_stats_text"):
        with open(os.path.join(sdir, "envoy-stats.txt"), "w") as fh:
            fh.write(st["envoy_stats_text"])
    if "indexer_cpu_seconds" in st:
        out["indexer_cpu_s_total"] = st["indexer_cpu_seconds"]
    return out
