#!/usr/bin/env python3
"""Markdown report + PNG plot from a benchmark run directory (results.json + raw/).

    .venv-bench/bin/python integration/bench/report.py build/bench/<run>

Summary numbers follow the reference's method: the llm-d inference-perf
reports' "summary across QPS" rows are the unweighted mean of the per-stage
values (checked against the per-stage tables of their 37-capacity report), so
output tok/s, TTFT p50/p90/mean here are means over the measured stages
(warm-up excluded) of inference-perf's own per-stage numbers. Pooled TTFT
percentiles over every measured request are given beside them.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional

# The published llm-d "73-capacity" table (docs/benchmark-method.md).
REFERENCE = [
    {"row": "precise", "label": "precise prefix", "tok_s": 8730.0, "ttft_p90": 0.542, "ttft_mean": 0.298, "waiting": 0.1},
    {"row": "approximate", "label": "approximate prefix", "tok_s": 6944.4, "ttft_p90": 31.083, "ttft_mean": 13.316, "waiting": 8.1},
    {"row": "random", "label": "random", "tok_s": 4428.7, "ttft_p90": 92.551, "ttft_mean": 45.281, "waiting": 27.3},
    {"row": "load", "label": "load (queue 1, KV 1)", "tok_s": 4266.4, "ttft_p90": 94.865, "ttft_mean": 46.987, "waiting": 28.9},
]
REF_BY_ROW = {r["row"]: r for r in REFERENCE}


def _mean(xs: List[Optional[float]]) -> Optional[float]:
    v = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(v) / len(v) if v else None


def _pct(xs: List[float], p: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    f, c = math.floor(k), math.ceil(k)
    return xs[f] if f == c else xs[f] + (xs[c] - xs[f]) * (k - f)


def load_requests(out: str, res: Dict[str, Any]) -> List[Dict[str, Any]]:
    f = res.get("requests_file")
    if not f or not os.path.exists(os.path.join(out, f)):
        return []
    with gzip.open(os.path.join(out, f), "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def summarize(out: str, res: Dict[str, Any]) -> Dict[str, Any]:
    st = [s for s in res.get("stages", []) if not s.get("warmup")]
    s: Dict[str, Any] = {
        "tok_s": _mean([x.get("output_tok_s") for x in st]),
        "ttft_p50": _mean([x.get("ttft_p50") for x in st]),
        "ttft_p90": _mean([x.get("ttft_p90") for x in st]),
        "ttft_mean": _mean([x.get("ttft_mean") for x in st]),
        "expected": sum(x.get("expected", 0) for x in st),
        "successes": sum(x.get("successes", 0) for x in st),
        "failures": sum(x.get("failures", 0) for x in st),
        "not_recorded": sum(x.get("not_recorded", 0) for x in st),
    }
    s["errors"] = s["failures"] + s["not_recorded"]
    reqs = [r for r in load_requests(out, res) if r.get("stage", 0) > 0]
    ttfts = [r["ttft"] for r in reqs if r.get("error") is None and r.get("ttft") is not None]
    s["pooled_ttft_p50"] = _pct(ttfts, 50)
    s["pooled_ttft_p90"] = _pct(ttfts, 90)
    s["pooled_ttft_mean"] = (sum(ttfts) / len(ttfts)) if ttfts else None
    ok = [r for r in reqs if r.get("error") is None]
    if ok:
        span = sum((max(r["end"] for r in ok if r["stage"] == k) - min(r["start"] for r in ok if r["stage"] == k))
                   for k in sorted({r["stage"] for r in ok}))
        s["pooled_tok_s"] = sum((r.get("out") or 0) for r in ok) / span if span > 0 else None
    else:
        s["pooled_tok_s"] = None
    pods = res.get("pods") or {}
    s["hit_rate"] = pods.get("hit_rate_measured", pods.get("hit_rate_all"))
    s["waiting"] = (pods.get("measured") or {}).get("vllm:num_requests_waiting")
    s["pod_ttft_mean"] = pods.get("pod_ttft_mean_measured")
    s["running"] = (pods.get("measured") or {}).get("vllm:num_requests_running")
    s["kv_usage"] = (pods.get("measured") or {}).get("vllm:kv_cache_usage_perc")
    s["preemptions"] = pods.get("preemptions")
    return s


def f_num(x: Optional[float], nd: int = 1) -> str:
    if x is None:
        return "—"
    return f"{x:,.{nd}f}"


def f_s(x: Optional[float]) -> str:
    if x is None:
        return "—"
    return f"{x:.3f} s" if x < 10 else f"{x:.1f} s"


def f_pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def plot(out: str, results: List[Dict[str, Any]], title: str) -> Optional[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    markers = "os^vD<>ph*"
    any_line = False
    # Stages of one rate (the restart profile) are told apart by their number.
    xkey, xlabel = ("stage", "measured stage") if rates_repeat(results) else ("rate", "offered load (QPS stage)")
    for i, res in enumerate(results):
        st = [s for s in res.get("stages", []) if not s.get("warmup") and s.get("output_tok_s") is not None]
        if not st:
            continue
        any_line = True
        q = [s[xkey] for s in st]
        kw = dict(marker=markers[i % len(markers)], label=res["label"], linewidth=2 if res["kind"] == "kvroute" else 1.2,
                  linestyle="-" if res["kind"] == "kvroute" else ("--" if res["kind"] == "envoy_lb" else ":"))
        axes[0].plot(q, [max(s.get("ttft_p90") or 0, 1e-3) for s in st], **kw)
        axes[1].plot(q, [s["output_tok_s"] for s in st], **kw)
    if not any_line:
        plt.close(fig)
        return None
    axes[0].set_yscale("log")
    from matplotlib.ticker import FuncFormatter

    axes[0].yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    axes[0].yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
    axes[0].set_xlabel(xlabel)
    axes[0].set_ylabel("TTFT p90 (s, log)")
    axes[0].set_title("TTFT p90 per QPS stage (lower is better)")
    axes[1].set_xlabel(xlabel)
    axes[1].set_ylabel("output tokens / s")
    axes[1].set_title("Output throughput per QPS stage (higher is better)")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, "plot.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def routing_facts(r: Dict[str, Any]) -> List[str]:
    """What the router itself says about its decisions (its own counters, over the whole run incl. warm-up)."""
    out: List[str] = []
    rs = r.get("router_stats") or {}
    kv = rs.get("kvroute") or {}
    if kv:
        req = kv.get("kvroute.requests", 0)
        out.append(f"kvroute counters: {req} requests routed, decision by prefix {kv.get('kvroute.decision.prefix', 0)}, "
                   f"by load {kv.get('kvroute.decision.load', 0)}; blocks matched {kv.get('kvroute.blocks.matched', 0)} of "
                   f"{kv.get('kvroute.blocks.total', 0)} hashed")
        fb = {k.split('.')[-1]: v for k, v in kv.items() if k.startswith("kvroute.fallback.")}
        if fb:
            out.append("kvroute fail-open fallbacks: " + ", ".join(f"{k} {v}" for k, v in sorted(fb.items())))
        if r.get("params", {}).get("mode") == "precise":
            ok, failed = kv.get("kvroute.tokenizer.ok", 0), kv.get("kvroute.tokenizer.failed", 0)
            recalled = kv.get("kvroute.tokenizer.recalled", 0)
            if ok or recalled:
                out.append(f"token ids: from the tokenizer call-out for {ok} requests, from the token memo for {recalled} "
                           f"({failed} call-outs failed and were routed on bytes)")
            else:
                out.append(f"**token ids: none** — the tokenizer call-out was used for 0 requests ({failed} failed): "
                           "these requests were hashed on bytes, so the indexer's token-domain entries from KV events could "
                           "not match them; this row measures byte-hash routing plus the indexer's shared learned entries, "
                           "not event-driven precise routing")
            out.append(f"feed: {kv.get('kvroute.feed.ok', 0)} polls ok, {kv.get('kvroute.feed.errors', 0)} errors, "
                       f"{kv.get('kvroute.feed.pods', 0)} pods known")
    im = rs.get("indexer_metrics") or {}
    if im:
        out.append(f"kvroute-indexer: {int(im.get('kvroute_indexer_messages_received_total', 0))} KV-event messages, "
                   f"{int(im.get('kvroute_indexer_blocks_stored_total', 0))} blocks stored, "
                   f"{int(im.get('kvroute_indexer_learned_accepted_total', 0))} learned entries accepted")
    pm = rs.get("prometheus") or {}
    hits = sum(v for k, v in pm.items() if k.startswith("vllm_router_kv_placement_lookups_total") and 'result="hit"' in k)
    miss = sum(v for k, v in pm.items() if k.startswith("vllm_router_kv_placement_lookups_total") and 'result="miss"' in k)
    if hits or miss:
        out.append(f"vllm-router KV placement lookups: {int(hits)} hit, {int(miss)} miss"
                   + (" — **its KV index never matched a request**: the events arrive (see below) and are indexed under "
                      "the published block hashes, but kv_aware computes its lookup keys with Rust's DefaultHasher "
                      "(SipHash over seed, parent key and token ids; vllm-project/router src/kv_index/block_hash.rs, whose "
                      "own comment calls it an approximation), which matches neither vLLM's sha256/xxhash block hashes nor "
                      "vllm-sim's; this row is kv_aware's least-load fallback (plus whatever its own short-lived speculative "
                      "entries give), not routing on the pods' events" if not hits else ""))
    if r.get("kv_events_relayed") is not None and r["kind"] in ("vllm_router", "kvroute"):
        out.append(f"KV-event messages published by the pods during the run: {r['kv_events_relayed']}")
    return out


def headline(results: List[Dict[str, Any]], sums: Dict[str, Dict[str, Any]]) -> List[str]:
    ok = [r for r in results if r["status"] == "ok" and sums[r["strategy"]].get("ttft_p90") is not None]
    if not ok:
        return ["No strategy completed: nothing to summarise."]
    S = lambda r: sums[r["strategy"]]  # noqa: E731
    best_t = min(ok, key=lambda r: S(r)["ttft_p90"])
    best_x = max(ok, key=lambda r: S(r)["tok_s"] or 0)
    out = [f"Lowest TTFT p90: **{best_t['label']}** ({f_s(S(best_t)['ttft_p90'])}); highest output throughput: "
           f"**{best_x['label']}** ({f_num(S(best_x)['tok_s'])} tok/s)."]
    rnd = next((r for r in ok if r["strategy"] == "envoy-random"), None)
    aware = [r for r in ok if r["strategy"] in ("kvroute-approx", "kvroute-precise", "sglang-cache-aware",
                                                "vllm-router-cache-aware", "vllm-router-kv-aware")]
    if rnd and aware:
        b = min(aware, key=lambda r: S(r)["ttft_p90"])
        out.append(f"Random vs the best prefix-aware router ({b['label']}): TTFT p90 {f_s(S(rnd)['ttft_p90'])} vs "
                   f"{f_s(S(b)['ttft_p90'])} ({S(rnd)['ttft_p90'] / max(S(b)['ttft_p90'], 1e-9):.1f}×), output "
                   f"{f_num(S(rnd)['tok_s'])} vs {f_num(S(b)['tok_s'])} tok/s; prefix-cache hit rate "
                   f"{f_pct(S(rnd)['hit_rate'])} vs {f_pct(S(b)['hit_rate'])}.")
    mine = [r for r in ok if r["kind"] == "kvroute" and r["strategy"] != "kvroute-load"]
    peers = [r for r in ok if r["kind"] in ("sglang", "vllm_router")]
    if mine and peers:
        m = min(mine, key=lambda r: S(r)["ttft_p90"])
        p = min(peers, key=lambda r: S(r)["ttft_p90"])
        better = S(m)["ttft_p90"] <= S(p)["ttft_p90"] and (S(m)["tok_s"] or 0) >= (S(p)["tok_s"] or 0)
        out.append(f"kvroute's best mode ({m['label']}) vs the best peer ({p['label']}): TTFT p90 {f_s(S(m)['ttft_p90'])} "
                   f"vs {f_s(S(p)['ttft_p90'])}, {f_num(S(m)['tok_s'])} vs {f_num(S(p)['tok_s'])} tok/s — "
                   + ("kvroute is ahead on both." if better else "**kvroute does not beat this peer**."))
    return out


# A stage counts as a loss when kvroute is worse by more than these margins (run-to-run noise on a
# shared 2-core machine); the report states the rule.
TTFT_MARGIN_REL, TTFT_MARGIN_ABS, TOK_MARGIN_REL = 0.05, 0.010, 0.02


def _worse_ttft(mine: Optional[float], other: Optional[float]) -> bool:
    if mine is None or other is None:
        return mine is None and other is not None
    return mine > other * (1 + TTFT_MARGIN_REL) and mine - other > TTFT_MARGIN_ABS


def _worse_tok(mine: Optional[float], other: Optional[float]) -> bool:
    if mine is None or other is None:
        return mine is None and other is not None
    return mine < other * (1 - TOK_MARGIN_REL)


def verdicts(results: List[Dict[str, Any]], sums: Dict[str, Dict[str, Any]]) -> List[str]:
    """Where kvroute (precise, then approximate) wins and loses, per competitor and per stage."""
    lines: List[str] = []
    ran = [r for r in results if r["status"] == "ok"]
    for mine in ("kvroute-precise", "kvroute-approx"):
        me = next((r for r in ran if r["strategy"] == mine), None)
        if not me:
            lines.append(f"- **{mine}** did not run to completion in this run: no claim is made for it.")
            continue
        my_st = {s["stage"]: s for s in me.get("stages", []) if not s.get("warmup")}
        label = dict(stage_columns(results))
        for other in ran:
            if other["kind"] == "kvroute" and other["strategy"] != "kvroute-load":
                continue
            o_st = {s["stage"]: s for s in other.get("stages", []) if not s.get("warmup")}
            worse_ttft = [q for q in my_st if q in o_st and _worse_ttft(my_st[q].get("ttft_p90"), o_st[q].get("ttft_p90"))]
            worse_tok = [q for q in my_st if q in o_st and _worse_tok(my_st[q].get("output_tok_s"), o_st[q].get("output_tok_s"))]
            a, b = sums[mine], sums[other["strategy"]]
            head = (f"- {me['label']} vs {other['label']}: TTFT p90 {f_s(a['ttft_p90'])} vs {f_s(b['ttft_p90'])}, "
                    f"{f_num(a['tok_s'])} vs {f_num(b['tok_s'])} output tok/s")
            if not worse_ttft and not worse_tok:
                lines.append(head + " — kvroute is better, or within noise, at every stage.")
            else:
                parts = []
                if worse_ttft:
                    parts.append("higher TTFT p90 at " + ", ".join(label[q] for q in sorted(worse_ttft)))
                if worse_tok:
                    parts.append("lower throughput at " + ", ".join(label[q] for q in sorted(worse_tok)))
                lines.append(head + " — **kvroute does not beat it everywhere**: " + "; ".join(parts) + ".")
    return lines


def stage_rates(results: List[Dict[str, Any]]) -> Dict[int, float]:
    """Measured stage index -> its rate."""
    return {st["stage"]: st["rate"] for r in results for st in r.get("stages", []) if not st.get("warmup")}


def rates_repeat(results: List[Dict[str, Any]]) -> bool:
    """True when two measured stages share a rate (the restart profile): stages are then named by number."""
    rates = stage_rates(results)
    return len(set(rates.values())) < len(rates)


def stage_columns(results: List[Dict[str, Any]]) -> List[tuple]:
    """(stage index, label) of the measured stages: "R QPS", with the stage number when a rate repeats."""
    repeated = rates_repeat(results)
    return [(k, f"{q:g} QPS" + (f" (stage {k})" if repeated else "")) for k, q in sorted(stage_rates(results).items())]


def restart_section(results: List[Dict[str, Any]]) -> List[str]:
    """The pod restart (profile `restart`): when, which pod, and the restart's stage before and after the kill."""
    rows = [r for r in results if r.get("restart")]
    if not rows:
        return []
    rec = rows[0]["restart"]
    L = ["### Pod restart", "",
         f"Pod {rec['pod_index']} (`{rec['pod']}`) was killed (SIGKILL: its queue, running requests and KV cache lost) "
         f"{rec['after_s']:g} s into stage {rec['stage']} (its first arrival seen in the seeded arrival schedule, so the "
         f"same point of the same request sequence for every strategy) and started again, empty, on the same address "
         f"{rec['down_s']:g} s later. Times are simulated seconds. Before / after: the stage's requests that started "
         "before / after the kill (TTFT of the answered ones; errors: failed or unanswered, e.g. cut when the pod died). "
         "Pod running / KV use: the restarted pod's mean `vllm:num_requests_running` and `vllm:kv_cache_usage_perc` "
         "over each part (how soon the router sends it work again). KV-event messages: what the relay passed on from "
         "the restarted process (its subscriptions outlive the old one), until the strategy's load ended.", "",
         "| strategy | restart (kill after / down) | before: requests, TTFT p50 / p90, errors | after: requests, TTFT p50 / p90, errors "
         "| in flight at the kill | sent while down | pod running before → after | pod KV use before → after "
         "| KV-event messages from the new process |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rs = r["restart"]
        w = rs.get("windows")
        if rs.get("status") != "done" or not w:
            L.append(f"| {r['label']} | **{rs.get('status')}**: {rs.get('reason')} | | | | | | | |")
            continue
        b, a = w["before"], w["after"]
        L.append(f"| {r['label']} | {f_num(rs['after_measured_s'], 1)} s / {f_num(rs['down_measured_s'], 1)} s | "
                 f"{b['requests']}, {f_s(b['ttft_p50'])} / {f_s(b['ttft_p90'])}, {b['errors']} | "
                 f"{a['requests']}, {f_s(a['ttft_p50'])} / {f_s(a['ttft_p90'])}, {a['errors']} | "
                 f"{w['in_flight_at_kill']} | {w['down_window_requests']} | "
                 f"{f_num(b['pod_running'], 1)} → {f_num(a['pod_running'], 1)} | {f_pct(b['pod_kv_usage'])} → {f_pct(a['pod_kv_usage'])} | "
                 f"{rs.get('kv_events_after_restart', '—')} |")
    L.append("")
    L.append("The per-stage tables below show the stages before (steady state) and after (recovery) the restart's.")
    L.append("")
    return L


def priority_section(results: List[Dict[str, Any]]) -> List[str]:
    """Per stage and priority class (runs that send a priority header): critical TTFT, sheddable
    requests refused (the proxy's 429s when the router sheds), and the longest pod queue."""
    rows = [(r, st, ps) for r in results for st, ps in zip(r.get("stages", []), (r.get("pods") or {}).get("per_stage", []))
            if st.get("by_priority") and not st.get("warmup")]
    if not rows:
        return []
    L = ["### Priority classes per stage", "",
         "Critical and sheddable requests are marked by the priority header (ipwrap.priority_of: a hash of the prompt, "
         "the same requests for every strategy). Shed: sheddable requests that got no answer (kvroute with `priority`: "
         "the proxy's 429). Longest queue: the largest per-pod `vllm:num_requests_waiting` per sample; max over the "
         "stage, and its mean over the stage's first and last third (a queue growing without bound ends far above "
         "where it started).", "",
         "| strategy | stage QPS | critical TTFT p50 | critical TTFT p90 | critical failed | sheddable TTFT p90 | shed / sheddable | longest queue max (first → last third) |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r, st, ps in rows:
        c, sh = st["by_priority"]["critical"], st["by_priority"]["sheddable"]
        q = ps.get("longest_queue") or {}
        shed = f"{sh['failed']} / {sh['requests']} ({sh['failed'] / sh['requests']:.0%})" if sh["requests"] else "—"
        queue = (f"{f_num(q.get('max'), 0)} ({f_num(q.get('first_third'), 1)} → {f_num(q.get('last_third'), 1)})"
                 if q.get("max") is not None else "—")
        L.append(f"| {r['label']} | {st['rate']:g} | {f_s(c['ttft_p50'])} | {f_s(c['ttft_p90'])} | {c['failed']} / {c['requests']} | "
                 f"{f_s(sh['ttft_p90'])} | {shed} | {queue} |")
    L.append("")
    return L


def envoy_timing_section(results: List[Dict[str, Any]], columns: List[tuple]) -> List[str]:
    """TTFT as the Envoy strategies' own access logs time it (envoy_timing.py) beside the client's."""
    rows = [r for r in results if r.get("envoy_timing")]
    if not rows:
        return []
    L = ["### Time to first token at Envoy", "",
         "The client times a request from its own dispatch; Envoy's access log times it from the request's arrival at "
         "the proxy to the pod's first body byte (the first token), and to the start of the upstream request (Envoy's "
         "routing: body read, decision, tokenizer call-out). The difference between the client's TTFT and Envoy's is "
         "spent in the load generator and on the loopback. Means over the measured stages of per-stage p90s, simulated "
         "seconds; requests: counted at Envoy / recorded by the client.", "",
         "| strategy | requests at Envoy / client | TTFT p90, client | TTFT p90, Envoy | routing p90, Envoy |",
         "|---|---:|---:|---:|---:|"]
    for r in rows:
        t = r["envoy_timing"]
        client = _mean([s.get("ttft_p90") for s in r.get("stages", []) if not s.get("warmup")])
        recorded = sum(s.get("recorded", 0) or 0 for s in r.get("stages", []))
        L.append(f"| {r['label']} | {t['requests']} / {recorded} | {f_s(client)} | {f_s(t.get('ttft_p90_mean'))} | "
                 f"{f_s(t.get('routing_p90_mean'))} |")
    L.append("")
    if columns:
        L += ["TTFT p90 per stage at Envoy:", "",
              "| strategy | " + " | ".join(lbl for _, lbl in columns) + " |",
              "|---|" + "---:|" * len(columns)]
        for r in rows:
            by = {s["stage"]: e for s, e in zip(r.get("stages", []), r["envoy_timing"]["stages"]) if not s.get("warmup")}
            L.append(f"| {r['label']} | " + " | ".join(f_s(by[k].get("ttft_p90")) if k in by else "—"
                                                      for k, _ in columns) + " |")
        L.append("")
    return L


def placement_section(results: List[Dict[str, Any]]) -> List[str]:
    """Where kvroute put the prefix groups (placement.py), with each pod's own prefix-cache hit rate."""
    rows = [r for r in results if r.get("placement")]
    if not rows:
        return []
    L = ["### Prefix groups per pod (kvroute's decisions)", "",
         "From `x-kvroute-decision` in Envoy's access log, per pod in address order: requests of which the pod held no "
         "block (mostly a prefix group's first request; warm-up included) / that the pod held whole / that it held in part "
         "(a shared prefix without the rest, or a token-memo recall), then the pod's prefix-cache hit rate over the "
         "measured stages. A pod given more groups than its cache holds reads many partial matches and a hit rate "
         "below the others' (docs/results/2026-12-06-precise-quick-repeats).", "",
         "| strategy | pod: first / whole / part, hits |", "|---|---|"]
    for r in rows:
        hits = (r.get("pods") or {}).get("hit_rate_per_pod_measured") or {}
        cells = [f"{pod}: {c['first']} / {c['whole']} / {c['part']}, {f_pct(hits.get(pod))}"
                 for pod, c in r["placement"].items()]
        L.append(f"| {r['label']} | " + "<br>".join(cells) + " |")
    L.append("")
    return L


def per_pod_section(results: List[Dict[str, Any]], prof: Dict[str, Any]) -> List[str]:
    """Who got the work on an unequal fleet: mean running / waiting per pod over the measured stages."""
    speeds = prof["sim"].get("pod_speeds") or []
    if len(set(speeds)) <= 1:
        return []
    blocks = prof["sim"].get("pod_blocks") or [prof["sim"]["num_gpu_blocks"]] * len(speeds)
    L = ["### Who got the work (unequal pods)", "",
         "Mean `vllm:num_requests_running` / `vllm:num_requests_waiting` per pod over the measured stages, pods in "
         "address order; speeds (relative to vllm-sim's default pod) and KV blocks: "
         + ", ".join(f"{sp:g} × {b}" for sp, b in zip(speeds, blocks)) + ".", "",
         "| strategy | " + " | ".join(f"pod {i} ({sp:g})" for i, sp in enumerate(speeds)) + " |",
         "|---|" + "---:|" * len(speeds)]
    for r in results:
        per = (r.get("pods") or {}).get("per_pod_measured") or {}
        if not per:
            continue
        cells = [f"{f_num(v.get('vllm:num_requests_running'), 1)} / {f_num(v.get('vllm:num_requests_waiting'), 1)}"
                 for _, v in sorted(per.items(), key=lambda kv: int(kv[0].rsplit(':', 1)[-1]))]
        L.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    L.append("")
    return L


def sessions_section(meta: Dict[str, Any], results: List[Dict[str, Any]]) -> List[str]:
    """A run continued with `run.py --resume`: which strategies ran in which session, when, at which commit
    (flagged when the sessions ran different code). Nothing for a run done in one session."""
    sessions = meta.get("sessions") or []
    if len(sessions) < 2:
        return []
    L = [f"**Run in {len(sessions)} sessions** (continued with `run.py --resume`; each session started fresh pods, "
         "flushed as usual before every strategy):", "",
         "| session | started (UTC) | ended (UTC) | commit | strategies recorded from it |", "|---|---|---|---|---|"]
    for s in sessions:
        g = s.get("git") or {}
        mine = [r["label"] for r in results if r.get("session", 1) == s["session"]]
        end = s.get("finished_utc") or (f"stopped {s['stopped_utc']} ({s.get('stopped_by', '')})" if s.get("stopped_utc")
                                        else "stopped (no end recorded: killed)")
        if s.get("closed"):
            end += f"; closed: {s['closed']}"
        L.append(f"| {s['session']} | {s.get('started_utc', '?')} | {end} | {str(g.get('commit', '?'))[:12]}"
                 f"{' (dirty)' if g.get('dirty') else ''} | {', '.join(mine) or '—'} |")
    L.append("")
    codes = {((s.get("git") or {}).get("commit"), bool((s.get("git") or {}).get("dirty")),
              json.dumps({k: v.get("sha256") for k, v in (s.get("artifacts") or {}).items()}, sort_keys=True))
             for s in sessions}
    if len(codes) > 1:
        L.append("> **The sessions ran different code** (commit, work-tree state or binaries differ; resumed with "
                 "`--resume-at-other-commit`): compare strategies from different sessions with care.")
        L.append("")
    again = [r for r in results if r.get("earlier_attempts")]
    if again:
        L.append("Run again after an earlier attempt: " + "; ".join(
            f"{r['label']} (" + ", ".join(f"session {a.get('session')}: {a.get('status')}" for a in r["earlier_attempts"]) + ")"
            for r in again) + ". Earlier attempts' raw data is kept beside the new one (`raw/<strategy>.before-session-N`).")
        L.append("")
    return L


def prompt_lengths_digest(out: str, res: Dict[str, Any]) -> str:
    """sha256 (16 hex) of the sorted (stage, prompt tokens) pairs of a strategy's requests."""
    import hashlib

    pairs = sorted((r.get("stage", 0), r.get("in") or 0) for r in load_requests(out, res))
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]


def workload_words(prof: Dict[str, Any]) -> str:
    """The workload in a few words for the plot's title."""
    conv = prof.get("conversation")
    words = (f"{conv['conversations']} conversations x {conv['turns']} turns" if conv else
             f"{prof['workload']['groups']}x{prof['workload']['prompts_per_group']} shared_prefix")
    clients = prof["load"].get("clients", 1)
    return words + (f", {clients} clients with a router each" if clients > 1 else "")


def write(out: str) -> str:
    data = json.load(open(os.path.join(out, "results.json")))
    meta, results = data["meta"], data["results"]
    prof = meta["profile"]
    sums = {r["strategy"]: summarize(out, r) for r in results}
    title = (f"kvroute benchmark, profile {prof['name']}: {prof['sim']['pods']} vllm-sim pods, "
             f"{workload_words(prof)}, cap {prof['load']['inflight_cap']} in flight"
             + (f", time scale {prof['sim']['time_scale']:g}" if prof["sim"].get("time_scale", 1.0) != 1.0 else "")
             + f" ({meta['started_utc']})")
    png = plot(out, results, title)
    L: List[str] = []
    L.append(f"# kvroute benchmark — `{prof['name']}` profile, {meta['started_utc']}")
    L.append("")
    if meta.get("pods_external"):
        L.append("> **Pods: external endpoints given with --endpoints, not vllm-sim.** These numbers say nothing about routing on the simulated cluster.")
        L.append("")
    L.append(f"Command (from the repository root): `{meta['command']}`")
    L.append("")
    if meta.get("kvroute_overrides"):
        L.append("**kvroute plugin-config overrides** (`run.py --kvroute-set`, merged over every kvroute strategy's "
                 "config): " + ", ".join(f"`{o}`" for o in meta["kvroute_overrides"]) + ".")
        L.append("")
    if meta.get("stopped"):
        L.append(f"**Stopped between strategies** (closed with `run.py --close`): {meta['stopped']}. "
                 "The strategies it did not reach are listed as *not run*.")
        L.append("")
    L.extend(sessions_section(meta, results))
    L.append(f"{prof['description']}. Simulated pods (vllm-sim) on one 2-core machine shared with the routers and the load "
             "generator: absolute numbers are not the reference's H100 numbers; compare strategies with each other "
             "and the *shape* (ratios) with the reference.")
    ts = prof["sim"].get("time_scale", 1.0)
    if ts != 1.0:
        L.append(f"**Time-scaled run: the pods ran at {ts:g} wall seconds per simulated second** (vllm-sim `--time-scale {ts:g}`), "
                 "the load compressed the same way (same requests per stage, stages shortened to round(duration × scale) s). "
                 f"Every time and rate below is in simulated seconds (wall TTFT ÷ {ts:g}, wall tok/s × {ts:g}), so it reads "
                 "like the reference. Routers' timers in simulated time: kvroute's are scaled with the pods (feed poll, "
                 "learned-entry TTL, snapshot interval and, from a1c6e17 on, kvroute-indexer's scrape of the pods' load "
                 "set to their shipped value × the scale, so they keep their shipped simulated length: 100 ms, 600 s, 2 s, "
                 "1 s; each strategy's notes list the wall values it ran with); every other router's timers "
                 f"(tree eviction, health checks) run on wall time, so a wall interval T lasts T ÷ {ts:g} simulated. "
                 "Wall-clock values are kept in results.json.")
        L.append("")
    L.append("## Summary")
    L.append("")
    L.extend(headline(results, sums))
    L.append("")
    L.append("## Results (measured stages, warm-up excluded)")
    L.append("")
    L.append("Output tok/s and TTFT columns: mean over the measured QPS stages of inference-perf's per-stage values "
             "(the reference's summary method). Pooled: over every measured request. Hit rate: Δ`vllm:prefix_cache_hits_total` / "
             "Δ`vllm:prefix_cache_queries_total` summed over pods during the measured stages. Pod TTFT mean: Δ`vllm:time_to_first_token_seconds` sum / count over the pods (arrival at the pod → first token); the client's TTFT mean minus it is time spent before the pod. Waiting: mean of per-pod "
             "`vllm:num_requests_waiting`, sampled every second. Errors: failed requests + requests never recorded, of requests planned.")
    L.append("")
    L.append("| strategy | status | output tok/s | TTFT p50 | TTFT p90 | TTFT mean | pod TTFT mean | pooled TTFT p90 | prefix-cache hit rate | mean waiting | errors / planned |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        s = sums[r["strategy"]]
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**"
        L.append(f"| {r['label']} | {status} | {f_num(s['tok_s'])} | {f_s(s['ttft_p50'])} | {f_s(s['ttft_p90'])} | "
                 f"{f_s(s['ttft_mean'])} | {f_s(s['pod_ttft_mean'])} | {f_s(s['pooled_ttft_p90'])} | {f_pct(s['hit_rate'])} | {f_num(s['waiting'], 2)} | "
                 f"{s['errors']} / {s['expected']} |")
    L.append("")
    L.extend(restart_section(results))
    L.extend(priority_section(results))
    L.extend(per_pod_section(results, prof))
    not_ok = [r for r in results if r["status"] != "ok"]
    if not_ok:
        L.append("Strategies that did not complete:")
        for r in not_ok:
            L.append(f"- {r['label']}: {r['status']} — {r.get('reason', '')}")
        L.append("")
    L.append("### The reference (llm-d, 8 × vLLM on 2 × H100, Qwen3-32B) beside ours")
    L.append("")
    L.append("| reference row | ref. output tok/s | ref. TTFT p90 | ref. TTFT mean | ref. waiting | our strategy | our output tok/s | our TTFT p90 | our TTFT mean | our waiting |")
    L.append("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for ref in REFERENCE:
        mine = [r for r in results if r.get("reference_row") == ref["row"]]
        if not mine:
            L.append(f"| {ref['label']} | {ref['tok_s']:,.1f} | {ref['ttft_p90']:.3f} s | {ref['ttft_mean']:.3f} s | {ref['waiting']} | — | | | | |")
        for r in mine:
            s = sums[r["strategy"]]
            L.append(f"| {ref['label']} | {ref['tok_s']:,.1f} | {ref['ttft_p90']:.3f} s | {ref['ttft_mean']:.3f} s | {ref['waiting']} | "
                     f"{r['label']} | {f_num(s['tok_s'])} | {f_s(s['ttft_p90'])} | {f_s(s['ttft_mean'])} | {f_num(s['waiting'], 2)} |")
    L.append("")
    pr, rd = sums.get("kvroute-precise"), sums.get("envoy-random")
    if pr and rd and pr.get("ttft_p90") and rd.get("ttft_p90") and pr.get("tok_s") and rd.get("tok_s"):
        L.append(f"Ratios, random ÷ precise TTFT p90: reference {92.551 / 0.542:.0f}×, ours {rd['ttft_p90'] / pr['ttft_p90']:.1f}×. "
                 f"Precise ÷ random throughput: reference {8730.0 / 4428.7:.2f}×, ours {pr['tok_s'] / rd['tok_s']:.2f}×.")
        L.append("")
    L.append("### Where kvroute wins and where it does not")
    L.append("")
    L.append(f"Per measured stage, kvroute loses a stage when its TTFT p90 is more than {TTFT_MARGIN_REL:.0%} and "
             f"{TTFT_MARGIN_ABS * 1e3:.0f} ms higher, or its output throughput more than {TOK_MARGIN_REL:.0%} lower, than "
             "the other strategy's (smaller differences are within run-to-run noise here).")
    L.append("")
    L.extend(verdicts(results, sums) or ["- nothing to compare."])
    L.append("")
    if png:
        L.append("![p90 TTFT and throughput per QPS stage](plot.png)")
        L.append("")
    # Per-stage tables.
    columns = stage_columns(results)
    if columns:
        for key, name, fmt in (("ttft_p90", "TTFT p90 per stage", f_s), ("output_tok_s", "Output tok/s per stage", f_num)):
            L.append(f"### {name}")
            L.append("")
            L.append("| strategy | " + " | ".join(lbl for _, lbl in columns) + " |")
            L.append("|---|" + "---:|" * len(columns))
            for r in results:
                by = {s["stage"]: s for s in r.get("stages", []) if not s.get("warmup")}
                L.append(f"| {r['label']} | " + " | ".join(fmt(by[k].get(key)) if k in by else "—" for k, _ in columns) + " |")
            L.append("")
        L.append("### Errors and pod state per stage")
        L.append("")
        L.append("| strategy | " + " | ".join(lbl for _, lbl in columns) + " |")
        L.append("|---|" + "---:|" * len(columns))
        for r in results:
            cells = []
            stg = [s for s in r.get("stages", []) if not s.get("warmup")]
            per = ((r.get("pods") or {}).get("per_stage") or [])[1:]
            for q, _ in columns:
                i = next((k for k, s in enumerate(stg) if s["stage"] == q), None)
                if i is None:
                    cells.append("—")
                    continue
                s = stg[i]
                p = per[i] if i < len(per) else {}
                cells.append(f"err {s.get('failures', 0) + s.get('not_recorded', 0)}/{s.get('expected', 0)}, "
                             f"hit {f_pct(p.get('hit_rate'))}, wait {f_num(p.get('waiting'), 1)}")
            L.append(f"| {r['label']} | " + " | ".join(cells) + " |")
        L.append("")
    L.extend(envoy_timing_section(results, columns))
    L.extend(placement_section(results))
    # Setup.
    w, ld, sim = prof["workload"], prof["load"], prof["sim"]
    L.append("## Setup")
    L.append("")
    L.append(f"- Pods: {sim['pods']} × vllm-sim, model `{sim['model']}`, block size {sim['block_size']}, "
             f"{sim['num_gpu_blocks']:,} KV blocks = {sim['num_gpu_blocks'] * sim['block_size']:,} tokens each, "
             f"max_num_seqs {sim['max_num_seqs']}, max_num_batched_tokens {sim['max_num_batched_tokens']}. "
             f"Flushed (`POST /admin/flush`) before every strategy after waiting for them to be idle. Addresses: "
             f"{', '.join(meta.get('pods', {}).get('addresses') or [])}.")
    argv = meta.get("pods", {}).get("argv")
    if argv and isinstance(argv[0], list):
        L.append("- vllm-sim: one process per pod (a pod restarts on its own): "
                 + "; ".join(f"`{' '.join(a)}`" for a in argv))
    elif argv:
        L.append(f"- vllm-sim command: `{' '.join(argv)}`")
    conv = prof.get("conversation")
    if conv:
        L.append(f"- Workload: inference-perf `conversation_replay`, {conv['conversations']} conversations × "
                 f"{conv['turns']} turns per stage, interleaved (request i of a stage is turn i ÷ {conv['conversations']} "
                 f"of conversation i mod {conv['conversations']}; a turn is sent once the previous one has its answer), "
                 f"system prompt {conv['shared_system_prompt_len']} tokens shared by the stage's conversations + "
                 f"{conv['system_prompt_len']} of its own, then per turn a {conv['user_len']}-token message and a "
                 f"{conv['output_len']}-token answer (ignore_eos): each turn's prompt is the previous prompt, its answer "
                 f"and the new message. Every stage starts new conversations (its own shared system prompt). "
                 "The answers are the pods' (vllm-sim picks each answer's words per request), so their words differ "
                 "between strategies and their token counts do not. `/v1/completions`, streaming; data seed "
                 f"{conv['seed']}, arrival seed {w['arrival_seed']}. Every conversation of a stage at full length = "
                 f"{100 * meta['resident_fraction']:.0f}% of cluster KV.")
    else:
        L.append(f"- Workload: inference-perf `shared_prefix`, {w['groups']} groups × {w['prompts_per_group']} prompts, "
                 f"system prompt {w['system_prompt_len']} tokens, question {w['question_len']}, output {w['output_len']} "
                 f"(ignore_eos), `/v1/completions`, streaming; data seed {w['seed']}, arrival seed {w['arrival_seed']}. "
                 f"Resident prefix set = {100 * meta['resident_fraction']:.0f}% of cluster KV.")
    clients = ld.get("clients", 1)
    if clients > 1:
        L.append(f"- **{clients} clients, one router each** (the mesh scenario: proxies beside their clients, as "
                 f"sidecars): {clients} inference-perf processes, client k sending to its own router only, at 1/{clients} "
                 f"of each stage's rate with arrival seed {w['arrival_seed']} + k, and items k, k + {clients}, … of the "
                 "data set (integration/bench/ipwrap.py), so together they send the requests one client would and every "
                 "client draws from every prompt group. Per stage, the clients' requests are merged into one table "
                 "(counts summed; TTFT percentiles and throughput recomputed over the union with inference-perf's own "
                 "formulas, run.merge_stage); the clients start each stage together (a barrier in ipwrap.py: each "
                 "waits until all have finished the previous stage), so a stage's window runs from their common "
                 "start to the last client's end. Routers: kvroute as one Envoy per client, "
                 "each with its own state (precise mode: every Envoy's singleton polls the same kvroute-indexer); "
                 "Envoy's LBs one Envoy per client; the peers one router process per client.")
    L.append(f"- Load: Poisson; warm-up {ld['warmup'][0]:g} QPS × {ld['warmup'][1]} s (excluded), then "
             + ", ".join(f"{r:g}×{d}s" for r, d in ld["stages"])
             + (f" (sent as " + ", ".join(f"{r:.4g}×{d}s" for r, d in ld["wall_stages"]) + " wall)" if ld.get("wall_stages") else "")
            + f". Client cap on requests in flight: "
             + (f"{ld['clients']} clients × " if ld.get("clients", 1) > 1 else "")
             + f"{ld['num_workers']} workers × {ld['worker_max_concurrency']} = "
             f"**{ld['inflight_cap']}** (TTFT is timed from dispatch). Per-request timeout {ld['request_timeout']:g} s.")
    fps = {r.get("workload_fingerprint") for r in results if r.get("workload_fingerprint")}
    scheds = {(r.get("inference_perf") or {}).get("schedule_sha") for r in results if (r.get("inference_perf") or {}).get("schedule_sha")}
    L.append(f"- Same workload for every strategy: inference-perf config fingerprint(s) {', '.join(sorted(fps)) or '—'} "
             f"({'identical' if len(fps) == 1 else 'NOT identical'}); arrival schedule sha256 {', '.join(sorted(scheds)) or '—'} "
             f"({'identical' if len(scheds) == 1 else 'NOT identical'}). Arrivals are seeded by integration/bench/ipwrap.py "
             "(inference-perf 0.7.0 does not seed its Poisson timer); it also keeps multi-turn sessions' system prompt "
             "across stages and splits the data set between several clients (README); nothing else in inference-perf "
             "is changed.")
    if conv:
        lengths = {r["strategy"]: prompt_lengths_digest(out, r) for r in results if r.get("requests_file")}
        L.append(f"- Prompt lengths (tokens per request, by stage; they depend on the answers' lengths): digest "
                 f"{', '.join(sorted(set(lengths.values()))) or '—'} "
                 f"({'identical' if len(set(lengths.values())) == 1 else 'NOT identical: requests failed or were not sent'}).")
    if meta.get("tokenizer_prime"):
        tp = meta["tokenizer_prime"]
        L.append(f"- Before the first strategy, every workload prompt ({tp['tokenized']} of {tp['prompts']}) went once through the "
                 "simulator's `POST /tokenize` (integration/bench/prime.py): the tokenizer's word cache outlives the flush, and "
                 "without this the first strategy alone paid its cold start.")
    L.append("- KV events: every pod binds its publisher on an `ipc://` path in the run directory; "
             "integration/bench/kvrelay.py republishes each pod's messages unchanged on its own 127.0.0.1 TCP port, "
             "which kvroute-indexer (kvroute precise) and vllm-router (kv_aware) subscribe to.")
    L.append("- Envoy strategies (with and without kvroute) share one overlay on the project's gateway config: "
             "`stream_idle_timeout: 0s`, cluster circuit-breaker limits 100,000 (integration/bench/envoy_bench.py). "
             "Peers run with their defaults apart from the flags listed below.")
    if meta.get("overrides"):
        L.append(f"- Profile overrides: {', '.join('`' + o + '`' for o in meta['overrides'])}")
    L.append("")
    L.append("### Routers and their flags")
    L.append("")
    for r in results:
        rt = r.get("router") or {}
        L.append(f"- **{r['label']}** ({r['description']})")
        for a in rt.get("argv", []):
            L.append(f"  - `{' '.join(a)}`")
        for n in rt.get("notes", []):
            L.append(f"  - {n}")
        if r.get("router_cpu_s") is not None:
            L.append(f"  - router CPU during the load run: {r['router_cpu_s']} s")
        if r.get("machine_cpu_busy") is not None:
            L.append(f"  - machine CPU busy during this strategy: {100 * r['machine_cpu_busy']:.0f}% of {meta.get('machine', {}).get('nproc', '?')} cores"
                     + (f", of which stolen by the hypervisor {100 * r['machine_cpu_stolen']:.0f}%"
                        if r.get("machine_cpu_stolen") is not None else "")
                     + (f" (vllm-sim used {r['sim_cpu_s']} CPU-s)" if r.get("sim_cpu_s") is not None else "")
                     + (f" (the load generator used {r['inference_perf']['cpu_s']} CPU-s)"
                        if (r.get("inference_perf") or {}).get("cpu_s") is not None else ""))
        for w in r.get("warnings", []):
            L.append(f"  - warning: {w}")
        for line in routing_facts(r):
            L.append(f"  - {line}")
    L.append("")
    L.append("### Versions and machine")
    L.append("")
    v = meta.get("versions", {})
    L.append("- " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    m = meta.get("machine", {})
    L.append(f"- Machine: {m.get('cpu', '?')}, {m.get('nproc')} cores, {m.get('mem_total', '?')}; {m.get('platform')}; "
             f"load average at start {m.get('loadavg_start', '?')}, at end {m.get('loadavg_end', '?')}.")
    g = meta.get("git", {})
    L.append(f"- kvroute commit {g.get('commit', '?')[:12]}{' (work tree dirty)' if g.get('dirty') else ''}.")
    arts = meta.get("artifacts") or {}
    if arts:
        L.append("- Binaries: " + "; ".join(f"{k} sha256 {v['sha256']}… built {v['mtime_utc']}" for k, v in arts.items()) + ".")
    L.append("")
    L.append("Raw data per strategy (inference-perf reports, per-request records, pod samples, router configs and "
             "metrics) is in the run directory's `raw/` (logs too); a published copy keeps it, without the logs and "
             "inference-perf's per-token timings, in `raw.tar.gz` beside this report.")
    L.append("")
    path = os.path.join(out, "report.md")
    with open(path, "w") as fh:
        fh.write("\n".join(L))
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: report.py RUN_DIR")
    print(write(sys.argv[1]))
