#!/usr/bin/env python3
"""Self-checks of the benchmark harness's pure parts (no processes, no network).

    .venv-bench/bin/python integration/bench/selftest.py      (make bench-selftest)

Covers: profile arithmetic, Prometheus parsing and counter deltas, wrk output
parsing, the seeded arrival schedule (two timers from the same seed give the
same gaps, a different seed does not), the Envoy configs (baseline and kvroute
precise: overlay present, filter removed or singleton added; the access log and its per-stage
timing), kvroute's timers
scaled with the pods' time scale (singleton and filter), run.py --kvroute-set (schema-checked paths
and values, merged over each mode's plugin config), the mixed and overload
scenarios (per-pod capacities and speeds, priority classes by prompt hash, the
per-class and longest-queue summaries), the oversub and restart profiles (the restart's
before / after split and its report table), the multiturn and mesh scenarios (stage
sizes, conversation data, per-client configs, the clients' merge with
inference-perf's formulas, the routers' stats merge, inference-perf's
conversations growing across stages with ipwrap's fix, the clients' data
split and stage barrier), and the report on
a synthetic run directory (numbers, the not-run line, and the
"does not beat it everywhere" verdict).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import os
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import podmetrics  # noqa: E402
import profiles  # noqa: E402

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


@check
def profile_numbers():
    full = profiles.get("full")
    assert full.sim.num_gpu_blocks * full.sim.block_size == 307_328
    assert abs(full.resident_fraction() - 0.73) < 0.01
    assert full.load.inflight_cap == 640
    assert [r for r, _ in full.load.stages][0] == 3 and full.load.stages[-1] == (60.0, 20)
    assert all(20 <= d <= 38 for _, d in full.load.stages)
    quick = profiles.get("quick")
    assert abs(quick.resident_fraction() - 0.73) < 0.01
    assert quick.expected_requests() == [150, 225, 450, 675]
    o = profiles.get("quick", ["load.stages=[[5,10]]", "workload.groups=4"])
    assert o.load.stages == [(5, 10)] and o.workload.groups == 4


@check
def scenarios_mixed_and_overload():
    import strategies

    mixed = profiles.get("mixed")
    assert mixed.sim.capacities() == [3072] * 4 + [2304] * 4
    assert mixed.sim.speeds()[4] == mixed.sim.speeds()[0] / 2
    assert abs(mixed.resident_fraction() - 0.84) < 0.01
    eps = [f"127.0.0.1:{9000 + i}" for i in range(8)]
    plugin = strategies.kvroute_plugin_config("precise", eps, mixed.sim.capacities(), 16, speeds=mixed.sim.speeds())
    assert [e.get("speed") for e in plugin["endpoints"]] == [1.0] * 4 + [0.5] * 4
    assert plugin["endpoints"][7]["capacity_blocks"] == 2304 and "priority" not in plugin
    quick = strategies.kvroute_plugin_config("approximate", eps[:2], 3072, 16, speeds=[1.0, 1.0])
    assert all("speed" not in e for e in quick["endpoints"]), "equal pods: the config stays as shipped"
    overload = profiles.get("overload")
    r = profiles.OVERLOAD_SUSTAINABLE_QPS
    assert [rate for rate, _ in overload.load.stages] == [r / 2, 2 * r]
    shed = strategies.kvroute_plugin_config("approximate", eps[:4], 3072, 16, priority=True)
    assert shed["priority"]["default_class"] == "sheddable"


@check
def kvroute_plugin_overrides():
    import yaml

    import envoy_bench
    import run
    import strategies

    sets = run.kvroute_overrides(["weights.running=0.5", "weights.kv_usage=2", "indexer.poll_ms=50"])
    assert sets == {"weights": {"running": 0.5, "kv_usage": 2}, "indexer": {"poll_ms": 50}}
    for bad, says in (("weights.runing=0.5", "fields at weights: decode, kv_usage, prefill, queue, running"),
                      ("weights.running=-1", "less than the minimum"), ("nope=1", "not in the plugin-config schema"),
                      ("weights.running.x=1", "none (not an object)"), ("weights", "expected PATH=JSON")):
        try:
            run.kvroute_overrides([bad])
            raise AssertionError(f"{bad} accepted")
        except SystemExit as e:
            assert says in str(e), str(e)
    # The hook in strategies.start_kvroute: merged over the mode's config, so load-only keeps prefill 0.
    eps = ["127.0.0.1:1001"]
    envoyctl = strategies._import_integration("envoyctl")
    plugin = envoyctl._merge(strategies.kvroute_plugin_config("load", eps, 100, 16), sets)
    hcm = yaml.safe_load(envoy_bench.kvroute(eps, plugin, indexer_address="127.0.0.1:9"))
    filt = json.loads(hcm["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
                      ["http_filters"][0]["typed_config"]["config"]["configuration"]["value"])
    assert filt["weights"]["running"] == 0.5 and filt["weights"]["prefill"] == 0.0 and filt["indexer"]["poll_ms"] == 50
    single = json.loads(hcm["bootstrap_extensions"][0]["typed_config"]["config"]["configuration"]["value"])
    assert single["indexer"]["poll_ms"] == 50
    prof = profiles.get("quick")
    assert "kvroute_overrides" not in prof.to_dict(), "runs without overrides record the profile as before"
    prof.kvroute_overrides = sets
    assert prof.to_dict()["kvroute_overrides"] == sets


@check
def scenario_oversub():
    oversub, overload = profiles.get("oversub"), profiles.get("overload")
    assert abs(oversub.resident_fraction() - 1.5) < 0.01
    assert (oversub.sim.pods, oversub.sim.capacities(), oversub.sim.speeds()) == \
        (overload.sim.pods, overload.sim.capacities(), overload.sim.speeds()), "the overload cluster"
    # Each stage walks its first n prompts of the 490: a group is missed when none of its 5 is among them.
    w = oversub.workload
    prompts = w.groups * w.prompts_per_group
    for n in oversub.expected_requests()[1:]:
        missed = math.comb(prompts - w.prompts_per_group, n) / math.comb(prompts, n)
        assert missed < 0.05, f"a {n}-request stage misses {missed:.1%} of the groups"


@check
def scenario_restart():
    import report
    import pod_restart
    import simcluster

    prof = profiles.get("restart")
    assert (prof.sim.restart_pod, prof.sim.restart_stage) == (0, 2) and len(prof.load.stages) == 3
    assert len({r for r, _ in prof.load.stages}) == 1, "one rate: the stages differ only by the restart"
    for bad in ("sim.restart_pod=4", "sim.restart_stage=5"):
        try:
            profiles.get("restart", [bad])
            raise AssertionError(f"{bad} accepted")
        except SystemExit as e:
            assert "sim.restart_pod" in str(e)
    assert simcluster.pod_kv_events_endpoint("ipc:///r/ev", 0) == "ipc:///r/ev"
    assert simcluster.pod_kv_events_endpoint("ipc:///r/ev", 2) == "ipc:///r/ev-2"
    assert simcluster.pod_kv_events_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert simcluster.pod_kv_events_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5557", "connecting: shared"

    # The restart's stage split at the kill (request times: monotonic ÷ scale; samples: wall).
    d = tempfile.mkdtemp(prefix="bench-selftest-restart-")
    pod = "127.0.0.1:9000"
    rec = {"pod": pod, "pod_index": 0, "stage": 2, "after_s": 10.0, "down_s": 5.0, "status": "done",
           "killed_t": 110.0, "up_t": 115.0, "killed_wall": 5000.0, "after_measured_s": 10.1, "down_measured_s": 5.2}
    reqs = [{"stage": 1, "start": 90.0, "end": 91.0, "ttft": 9.0, "error": None}]
    reqs += [{"stage": 2, "start": 100.0 + k, "end": 100.5 + k, "ttft": 0.1 * (k + 1), "error": None} for k in range(5)]
    reqs += [{"stage": 2, "start": 108.0, "end": None, "ttft": None, "error": "ClientPayloadError"}]  # cut by the kill
    reqs += [{"stage": 2, "start": 112.0, "end": 114.0, "ttft": 2.0, "error": None},
             {"stage": 2, "start": 116.0, "end": 117.0, "ttft": 0.9, "error": None}]
    samples = os.path.join(d, "pod-samples.jsonl")
    with open(samples, "w") as fh:
        for t, running in ((4995.0, 10), (4999.0, 12), (5003.0, 0), (5006.0, 2), (5009.0, 30)):
            fh.write(json.dumps({"t": t, "pods": {pod: {"vllm:num_requests_running": running}}}) + "\n")
    w = pod_restart.restart_windows(rec, reqs, samples, 1.0)
    assert (w["before"]["requests"], w["before"]["errors"], w["before"]["ttft_p90"]) == (6, 1, 0.5), w
    assert (w["after"]["requests"], w["after"]["errors"], w["after"]["ttft_p90"]) == (2, 0, 2.0), w
    assert (w["before"]["pod_running"], w["after"]["pod_running"]) == (11.0, 1.0), w
    assert (w["in_flight_at_kill"], w["down_window_requests"]) == (1, 1), w
    rec["windows"] = w
    results = [{"strategy": "kvroute-approx", "label": "kvroute approximate", "restart": rec,
                "stages": [{"stage": k, "rate": 12.0, "warmup": k == 0} for k in range(4)]}]
    text = "\n".join(report.restart_section(results))
    assert "Pod 0 (`127.0.0.1:9000`) was killed" in text and "10 s into stage 2" in text
    assert "| kvroute approximate | 10.1 s / 5.2 s | 6, 0.300 s / 0.500 s, 1 | 2, 0.900 s / 2.000 s, 0 | 1 | 1 | 11.0 → 1.0 | — → — | — |" in text
    assert [lbl for _, lbl in report.stage_columns(results)] == ["12 QPS (stage 1)", "12 QPS (stage 2)", "12 QPS (stage 3)"]


@check
def output_tokens_from_server_usage():
    """ipwrap takes a streamed answer's output tokens from the server's usage; re-tokenizes only without it."""
    import ipwrap
    from inference_perf.apis.chat import ChatCompletionAPIData
    from inference_perf.apis.completion import CompletionAPIData
    from inference_perf.config import APIConfig
    from inference_perf.utils.custom_tokenizer import CustomTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    class Words:  # a stand-in tokenizer model: one token per word
        model_max_length = VERY_LARGE_INTEGER

        def __call__(self, text, **_):
            return types.SimpleNamespace(input_ids=text.split())

    tokenizer = CustomTokenizer.__new__(CustomTokenizer)
    tokenizer.tokenizer = Words()

    class Body:
        def __init__(self, events):
            self.events = events

        async def iter_any(self):
            for e in self.events:
                yield f"data: {json.dumps(e)}\n\n".encode() if isinstance(e, dict) else e

    def answer(delta, usage):
        events = [{"choices": [delta(w)]} for w in ("one ", "two ", "three")]
        if usage is not None:
            events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": usage}})
        return types.SimpleNamespace(content=Body(events + [b"data: [DONE]\n\n"]))

    ipwrap._install_server_output_count()
    config = APIConfig(streaming=True)
    completion = CompletionAPIData(prompt="p")
    chat = ChatCompletionAPIData(messages=[])
    for data, delta in ((completion, lambda w: {"text": w}), (chat, lambda w: {"delta": {"content": w}})):
        for usage, expected in ((7, 7), (None, 3)):
            info = asyncio.run(data.process_response(answer(delta, usage), config, tokenizer))
            assert info.response_metrics.output_tokens == expected, (type(data).__name__, usage)
    assert tokenizer.count_tokens("one two three", add_special_tokens=False) == 3


@check
def priority_classes_of_prompts():
    import ipwrap
    import measurements

    prompts = [f"prompt {i}" for i in range(2000)]
    classes = [ipwrap.priority_of(p, 0.2) for p in prompts]
    assert classes == [ipwrap.priority_of(p, 0.2) for p in prompts], "a function of the prompt"
    assert 0.17 < classes.count("critical") / len(prompts) < 0.23
    assert ipwrap.priority_of("x", 0.0) == "sheddable"
    assert measurements._prompt_of(json.dumps({"prompt": "p", "max_tokens": 3})) == "p"
    assert measurements._prompt_of("not json") == ""
    reqs = [{"priority": "critical", "ttft": t, "error": None} for t in (0.1, 0.2, 0.3, 0.4)]
    reqs += [{"priority": "sheddable", "ttft": None, "error": "HTTP 429"}, {"priority": "sheddable", "ttft": 1.0, "error": None}]
    c = measurements.by_priority(reqs)
    assert (c["critical"]["answered"], c["critical"]["ttft_p90"]) == (4, 0.4)
    assert (c["sheddable"]["requests"], c["sheddable"]["failed"]) == (2, 1)
    rows = [{"t": t, "pods": {"a": {"vllm:num_requests_waiting": w}, "b": {"vllm:num_requests_waiting": 0.0}}}
            for t, w in enumerate([0, 1, 2, 3, 4, 5])]
    trend = podmetrics.waiting_trend(rows)
    assert (trend["max"], trend["first_third"], trend["last_third"]) == (5.0, 0.5, 4.5)


@check
def prometheus_and_deltas():
    text = ('# HELP x\nvllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 5\n')
    m = podmetrics.parse_prometheus(text)
    assert m["vllm:num_requests_waiting"] == 3.0 and m["vllm:prefix_cache_hits_total"] == 15.0
    before = {"a": {"c": 10.0}, "b": {"c": 4.0}}
    after = {"a": {"c": 25.0}, "b": {"c": 1.0}}  # b was reset (flush): counts its new value
    assert podmetrics.counter_delta(before, after, "c") == 16.0
    rows = [{"t": 1.0, "pods": {"a": {"vllm:num_requests_waiting": 2}, "b": {"vllm:num_requests_waiting": 4}}},
            {"t": 2.0, "pods": {"a": {"vllm:num_requests_waiting": 0}, "b": {"error": "x"}}}]
    assert podmetrics.summarize_samples(rows)["vllm:num_requests_waiting"] == 2.0


@check
def wrk_parsing():
    import wrk

    out = """Running 10s test @ http://127.0.0.1:1
  1 threads and 4 connections
  Latency Distribution
     50%  180.00us
     75%  203.00us
     90%  335.00us
     99%    2.79ms
  18465 requests in 10.00s, 3.06MB read
  Non-2xx or 3xx responses: 7
Requests/sec:   1846.50
"""
    r = wrk.parse(out)
    assert abs(r["p50"] - 180e-6) < 1e-12 and abs(r["p99"] - 2.79e-3) < 1e-12
    assert r["requests"] == 18465 and r["non2xx"] == 7 and r["rps"] == 1846.5


@check
def overhead_wasm_variants():
    import overhead

    with tempfile.NamedTemporaryFile(suffix=".wasm") as f:
        assert overhead.wasm_variants([f"simd={f.name}"]) == {"envoy+kvroute@simd": os.path.abspath(f.name)}
    for bad in ("simd", "=x.wasm", "simd=/nonexistent/kvroute.wasm"):
        try:
            overhead.wasm_variants([bad])
        except SystemExit:
            continue
        raise AssertionError(f"--wasm-variant {bad!r} must be refused")
    cpu = {"envoy": (150, 170), "envoy+kvroute": (300, 330), "envoy+kvroute@simd": (290, 300)}
    runs = [{"target": t, "size": 30720, "round": k, "cpu_us_per_req": c[k], "p50": 1e-3, "p99": 2e-3, "rps": 1000,
             "non2xx": 0} for t, c in cpu.items() for k in (0, 1)]
    meta = {"started_utc": "T", "command": "overhead.py", "wrk": ["4.2"], "pods": ["127.0.0.1:1"], "nproc": 2,
            "args": {"connections": 4, "duration": 6, "rounds": 2, "time_scale": 0.001},
            "loadavg_start": "0", "loadavg_end": "0", "versions": {},
            "wasm_variants": {"envoy+kvroute@simd": {"path": "/x/simd.wasm", "sha256": "ab"}}}
    targets = {t: {} for t in cpu}
    targets["envoy+kvroute"]["kvroute_counters"] = {"kvroute.requests": 4, "kvroute.decision.prefix": 3,
                                                    "kvroute.decision.load": 1, "kvroute.blocks.matched": 90,
                                                    "kvroute.blocks.total": 120}
    md = overhead.render({"meta": meta, "targets": targets, "notes": {}, "runs": runs})
    assert "decisions by prefix 3 / by load 1, blocks matched 90 of 120" in md, md
    assert "- envoy+kvroute@simd: made no routing decision" in md, md
    assert "- envoy+kvroute: made no routing decision" not in md, md
    assert "| envoy+kvroute@simd | 30720 B | 1.000 ms | 2.000 ms | +0.000 ms | +0.000 ms | envoy |" in md, md
    # Paired by round: 290 - 300 and 300 - 330, median -20.
    assert "30720 B: CPU per request minus envoy+kvroute's in the same round, median -20 µs" in md, md
    assert "answers were errors" not in md, md
    runs[0]["non2xx"] = 7
    md = overhead.render({"meta": meta, "targets": targets, "notes": {}, "runs": runs})
    assert "**30720 B: 7 answers were errors**" in md, md
    # The unrouted target's figure stands only when kvroute was loaded and routed none of its requests.
    targets["envoy+kvroute-unrouted"] = {"kvroute_counters": {"kvroute.peers": 2}}
    md = overhead.render({"meta": meta, "targets": targets, "notes": {}, "runs": runs})
    assert "- envoy+kvroute-unrouted: kvroute loaded (its counters read) and counted 0 requests on a routed " \
        "path (none, as intended)" in md, md
    targets["envoy+kvroute-unrouted"]["kvroute_counters"]["kvroute.requests"] = 5
    md = overhead.render({"meta": meta, "targets": targets, "notes": {}, "runs": runs})
    assert "counted 5 requests on a routed path: **not the cost of unrouted traffic**" in md, md
    targets["envoy+kvroute-unrouted"] = {}
    md = overhead.render({"meta": meta, "targets": targets, "notes": {}, "runs": runs})
    assert "- envoy+kvroute-unrouted: **kvroute's counters could not be read**" in md, md
    assert overhead.in_repo(os.path.join(overhead.REPO, "build", "x.wasm")) == os.path.join("build", "x.wasm")
    assert overhead.in_repo("/usr/bin/wrk") == "/usr/bin/wrk"


@check
def seeded_arrivals():
    import importlib

    import ipwrap
    from inference_perf.loadgen import load_timer

    def gaps(seed):
        importlib.reload(load_timer)
        ipwrap._install_seeded_timers(seed, None)
        t = load_timer.PoissonLoadTimer(rate=20.0, duration=5)
        g = t.start_timer(0.0)
        return [round(next(g), 9) for _ in range(50)]

    a, b, c = gaps(7), gaps(7), gaps(8)
    importlib.reload(load_timer)
    assert a == b, "same seed must give the same arrival schedule"
    assert a != c, "another seed must give another schedule"
    assert all(y >= x for x, y in zip(a, a[1:]))


@check
def envoy_configs():
    import yaml

    import envoy_bench

    eps = ["127.0.0.1:1001", "127.0.0.1:1002"]
    base = yaml.safe_load(envoy_bench.baseline(eps, "random"))
    hcm = base["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["stream_idle_timeout"] == "0s"
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    cl = base["static_resources"]["clusters"][0]
    assert cl["lb_policy"] == "RANDOM" and cl["circuit_breakers"]["thresholds"][0]["max_requests"] == 100000
    pr = yaml.safe_load(envoy_bench.kvroute(eps, {"block_size": 16}, indexer_address="127.0.0.1:9"))
    names = [c["name"] for c in pr["static_resources"]["clusters"]]
    assert "kvroute_indexer" in names and "vllm_tokenizer" in names
    single = json.loads(pr["bootstrap_extensions"][0]["typed_config"]["config"]["configuration"]["value"])
    assert single["role"] == "singleton" and single["indexer"]["cluster"] == "kvroute_indexer"
    hcm = pr["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["http_filters"][0]["name"] == "kvroute" and hcm["stream_idle_timeout"] == "0s"
    assert single["indexer"]["poll_ms"] == 100
    assert "access_log" not in hcm
    logged = yaml.safe_load(envoy_bench.kvroute(eps, {"block_size": 16}, access_log="/tmp/x/envoy-access.log"))
    hcm = logged["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (al,) = hcm["access_log"]
    assert al["typed_config"]["path"] == "/tmp/x/envoy-access.log"
    assert "US_RX_BODY_BEG" in al["typed_config"]["log_format"]["text_format_source"]["inline_string"]


@check
def envoy_access_log_timing():
    import envoy_timing

    # Two stages (warm-up, then one measured); time scale 0.25: 100 ms wall = 0.4 s simulated.
    stages = [{"warmup": True, "t_start": 1000.0, "t_end": 1010.0}, {"warmup": False, "t_start": 1010.0, "t_end": 1020.0}]
    decided = '"pod=127.0.0.1:8001; matched=3/4 tokens; candidates=4"'
    lines = ["1001.5 900 2000 2500 50000 200 127.0.0.1:8001 \"-\"\n",  # warm-up: 50 ms wall to the first token
             f"1011.0 900 3000 3500 100000 200 127.0.0.1:8001 {decided}\n",  # 100 ms → 0.4 s, routing 3 ms → 0.012 s
             "1012.0 900 5000 5500 200000 200 127.0.0.1:8002 \"-\"\n",  # measured: 200 ms → 0.8 s
             "1013.0 900 - - - 503 - \"-\"\n",                 # no upstream answer: not a first token
             "1014.0 900 5000 5500 200000 200\n",                # fields missing
             "garbage\n"]
    recs = [r for r in map(envoy_timing.parse_line, lines) if r]
    assert len(recs) == 3
    t = envoy_timing.per_stage(recs, stages, 0.25)
    assert [row["n"] for row in t["stages"]] == [1, 2] and t["requests"] == 3
    m = t["stages"][1]
    assert math.isclose(m["ttft_p50"], 0.6) and math.isclose(m["ttft_p90"], 0.76)
    assert math.isclose(t["ttft_p90_mean"], 0.76) and math.isclose(t["routing_p90_mean"], 0.0192)


@check
def placement_counts_prefix_groups_per_pod():
    import placement

    def line(pod: str, decision: str) -> str:
        return f"1011.0 900 3000 3500 100000 200 {pod} {decision}\n"

    lines = [line("127.0.0.1:8010", '"pod=127.0.0.1:8010; matched=0/112 tokens; candidates=4"'),
             line("127.0.0.1:8010", '"pod=127.0.0.1:8010; matched=93/112 tokens; cost=76.0"'),
             line("127.0.0.1:8010", '"pod=127.0.0.1:8010; matched=112/112 tokens"'),
             line("127.0.0.1:8002", '"pod=127.0.0.1:8002; matched=0/7 bytes"'),
             line("127.0.0.1:8002", '"pod=127.0.0.1:8002; matched=88/110 tokens; recalled"'),
             line("127.0.0.1:8002", '"-"'),                # no decision (another filter's answer)
             "1013.0 900 - - - 503 - \"fallback=no_endpoints\"\n",  # failed open: no match to count
             "garbage\n"]
    placed = placement.count(lines)
    assert list(placed) == ["127.0.0.1:8002", "127.0.0.1:8010"], placed  # address order, by port
    assert placed["127.0.0.1:8010"] == {"first": 1, "whole": 1, "part": 1}
    assert placed["127.0.0.1:8002"] == {"first": 1, "whole": 0, "part": 1}
    assert placement.parse_line(line("127.0.0.1:8010", '"-"')) is None


@check
def each_pods_hit_rate_over_the_measured_stages():
    from measurements import pod_summary

    def pod(queries: float, hits: float) -> dict:
        return {"vllm:prefix_cache_queries_total": queries, "vllm:prefix_cache_hits_total": hits}

    samples = [{"t": 1000.0, "pods": {"a:1": pod(50, 40), "b:1": pod(10, 10)}},   # end of the warm-up
               {"t": 1010.0, "pods": {"a:1": pod(150, 130), "b:1": pod(10, 10)}},
               {"t": 1021.0, "pods": {"a:1": pod(250, 220), "b:1": pod(20, 15)}}]  # after the stage
    stages = [{"warmup": True, "t_start": 990.0, "t_end": 1000.0},
              {"warmup": False, "t_start": 1000.0, "t_end": 1020.0}]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "pod-samples.jsonl")
        with open(path, "w") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in samples)
        per_pod = pod_summary(path, {}, {}, stages)["hit_rate_per_pod_measured"]
    # a:1 over 1000..1010 s: 90 of 100 queried tokens hit; b:1 was asked nothing.
    assert per_pod == {"a:1": 0.9, "b:1": None}, per_pod


@check
def kvroute_timers_scale_with_the_pods():
    import yaml

    import envoy_bench
    import strategies

    assert strategies.kvroute_timers(1.0) == strategies.KVROUTE_TIMERS
    assert strategies.kvroute_timers(0.25) == {"poll_ms": 25, "ttl_seconds": 150, "flush_ms": 25,
                                               "scrape_interval_ms": 250, "scrape_timeout_ms": 125}
    assert strategies.kvroute_timers(0.01)["poll_ms"] == 10  # the config's minimum
    eps = ["127.0.0.1:1001"]
    plugin = strategies.kvroute_plugin_config("precise", eps, 100, 16, time_scale=0.25)
    pr = yaml.safe_load(envoy_bench.kvroute(eps, plugin, indexer_address="127.0.0.1:9"))
    single = json.loads(pr["bootstrap_extensions"][0]["typed_config"]["config"]["configuration"]["value"])
    hcm = pr["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filt = json.loads(hcm["http_filters"][0]["typed_config"]["config"]["configuration"]["value"])
    assert single["indexer"]["poll_ms"] == 25 and filt["indexer"]["poll_ms"] == 25
    assert filt["index"] == single["index"] == {"ttl_seconds": 150, "flush_ms": 25}


@check
def report_on_synthetic_run():
    import report

    d = tempfile.mkdtemp(prefix="bench-selftest-")
    prof = profiles.get("quick")

    def strat(name, label, kind, ttft90, tok, ref=None, status="ok"):
        stages = [{"stage": 0, "rate": 10.0, "duration": 15, "warmup": True, "expected": 150, "recorded": 150,
                   "successes": 150, "failures": 0, "not_recorded": 0, "output_tok_s": 1.0, "ttft_p90": 9.0}]
        for i, (q, t9, tk) in enumerate(zip((15.0, 30.0), ttft90, tok), start=1):
            stages.append({"stage": i, "rate": q, "duration": 15, "warmup": False, "expected": int(q * 15),
                           "recorded": int(q * 15), "successes": int(q * 15) - 1, "failures": 1, "not_recorded": 0,
                           "output_tok_s": tk, "ttft_p50": t9 / 2, "ttft_p90": t9, "ttft_mean": t9 / 2})
        os.makedirs(os.path.join(d, "raw", name), exist_ok=True)
        with gzip.open(os.path.join(d, "raw", name, "requests.jsonl.gz"), "wt") as fh:
            for k in (1, 2):
                fh.write(json.dumps({"stage": k, "start": k * 10.0, "end": k * 10.0 + 2, "ttft": ttft90[k - 1],
                                     "out": 100, "in": 1800, "error": None}) + "\n")
        return {"strategy": name, "label": label, "kind": kind, "params": {}, "reference_row": ref,
                "description": label, "status": status, "stages": stages if status == "ok" else [],
                "requests_file": f"raw/{name}/requests.jsonl.gz",
                "pods": {"hit_rate_measured": 0.5, "measured": {"vllm:num_requests_waiting": 1.5}}}

    results = [strat("envoy-random", "Envoy random", "envoy_lb", (1.0, 9.0), (1000.0, 1500.0), "random"),
               strat("kvroute-approx", "kvroute approximate", "kvroute", (0.5, 2.0), (1100.0, 1400.0), "approximate"),
               strat("kvroute-precise", "kvroute precise", "kvroute", (0.2, 0.3), (1200.0, 2500.0), "precise",
                     status="not run")]
    results[2]["reason"] = "kvroute-indexer binary not built"
    meta = {"command": "x", "profile": prof.to_dict(), "overrides": [], "expected_requests": prof.expected_requests(),
            "resident_fraction": prof.resident_fraction(), "started_utc": "T", "machine": {}, "git": {},
            "versions": {}, "pods_external": False}
    with open(os.path.join(d, "results.json"), "w") as fh:
        json.dump({"meta": meta, "results": results}, fh)
    md = open(report.write(d)).read()
    assert "| Envoy random | ok | 1,250.0 | 2.500 s | 5.000 s |" in md, md
    assert "kvroute precise: not run — kvroute-indexer binary not built" in md
    assert "**kvroute does not beat it everywhere**: lower throughput at 30 QPS" in md
    assert "errors / planned" in md and "| 2 / 675 |" in md
    assert os.path.exists(os.path.join(d, "plot.png"))


@check
def scenarios_multiturn_and_mesh():
    import run

    mt = profiles.get("multiturn")
    conv = mt.conversation
    # Every measured stage is the conversations' turns, once: none is replayed within a stage.
    assert mt.expected_requests()[1:] == [conv.conversations * conv.turns] * 2
    assert abs(mt.resident_fraction() - 0.552) < 0.01
    data = run.data_config(mt)["conversation_replay"]
    assert data["turns_per_conversation"] == {"type": "fixed", "mean": 5, "min": 5, "max": 5}
    assert data["num_conversations"] == 48 and data["max_model_len"] == mt.sim.max_model_len
    assert run.data_config(profiles.get("quick"))["type"] == "shared_prefix"

    mesh = profiles.get("mesh")
    assert mesh.load.clients == 4 and mesh.load.inflight_cap == 320
    assert mesh.expected_requests() == [96, 160, 320]
    assert mesh.client_stages() == [(2.0, 12), (2.0, 20), (4.0, 20)]
    cfg = run.ip_config(mesh, "/tok", "http://router-0", "/out/inference-perf")
    c2 = run.mesh_client_config(mesh, cfg, 2, "http://router-2", "/out/inference-perf")
    assert c2["server"]["base_url"] == "http://router-2" and c2["load"]["base_seed"] == 44
    assert [st["rate"] for st in c2["load"]["stages"]] == [2.0, 2.0, 4.0]
    assert c2["storage"]["local_storage"]["path"] == "/out/inference-perf/client-2"
    assert cfg["load"]["stages"][2]["rate"] == 16.0  # the base config is untouched
    scaled = profiles.get("mesh", ["sim.time_scale=0.5"])
    for (rate, wall), n in zip(scaled.client_stages(), scaled.expected_requests()):
        assert int(rate * wall) == n // 4  # each client sends its share on the faster clock
    try:  # conversations split between clients whole, or not at all
        profiles.get("multiturn", ["load.clients=5"])
        raise AssertionError("48 conversations accepted for 5 clients")
    except SystemExit as e:
        assert "multiple of load.clients" in str(e)


@check
def mesh_merges_clients_with_inference_perfs_formulas():
    import measurements

    def rec(start, end, ttft, out, error=None):
        r = {"start_time": start, "end_time": end, "error": error}
        if error is None:
            r["computed_metrics"] = {"time_to_first_token": ttft, "output_tokens": out}
        return r

    raw = [rec(0.0, 4.0, 0.5, 10), rec(1.0, 3.0, 1.5, 10), rec(2.0, 10.0, 2.5, 20),
           rec(3.0, 5.0, None, 0, error={"error_type": "timeout"})]
    m = measurements.merge_stage(raw)
    assert abs(m["output_tok_s"] - 40 / 10.0) < 1e-9  # successes' tokens over max(end) - min(start)
    assert abs(m["requests_s"] - 3 / 10.0) < 1e-9 and abs(m["achieved_rate"] - 4 / 3.0) < 1e-9
    assert m["ttft_p50"] == 1.5 and abs(m["ttft_mean"] - 1.5) < 1e-9 and abs(m["ttft_p90"] - 2.3) < 1e-9


@check
def mesh_router_stats_merge():
    import strategies

    a = {"cpu_seconds": 1.5, "kvroute": {"wasmcustom.kvroute.requests": 10, "wasmcustom.kvroute.feed.pods": 4},
         "envoy_stats_text": "first"}
    b = {"cpu_seconds": 2.0, "kvroute": {"wasmcustom.kvroute.requests": 5, "wasmcustom.kvroute.feed.pods": 4},
         "envoy_stats_text": "second"}
    m = strategies.merge_router_stats([a, b])
    assert m["cpu_seconds"] == 3.5 and m["routers"] == 2 and m["envoy_stats_text"] == "first"
    assert m["kvroute"] == {"wasmcustom.kvroute.requests": 15, "wasmcustom.kvroute.feed.pods": 4}
    assert strategies.merge_router_stats([a]) is a
    text = strategies._sum_prometheus(["# HELP x\nx_total{p=\"a\"} 2\ny 1", "x_total{p=\"a\"} 3"])
    assert 'x_total{p="a"} 5' in text and "y 1" in text and "HELP" not in text


@check
def conversations_grow_and_clients_split():
    """The pinned inference-perf's conversation_replay data with ipwrap's two patches: every stage's
    turns carry their conversation (the re-prime fix), and K clients partition the data (split)."""
    import asyncio

    import ipwrap
    import run
    from inference_perf.apis.base import LazyLoadInferenceAPIData
    from inference_perf.apis.user_session import LocalUserSession
    from inference_perf.config import APIConfig, CustomTokenizerConfig, DataConfig
    from inference_perf.datagen.replay.conversation_replay_datagen import ConversationReplayDataGenerator
    from inference_perf.datagen.synthetic.shared_prefix_datagen import SharedPrefixDataGenerator
    from inference_perf.utils.custom_tokenizer import CustomTokenizer

    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    tok = CustomTokenizer(CustomTokenizerConfig(pretrained_model_name_or_path=run.prepare_tokenizer(tempfile.mkdtemp())))
    p = profiles.get("multiturn", ["conversation.conversations=2", "conversation.turns=3",
                                   "conversation.system_prompt_len=30", "conversation.user_len=10"])
    data = DataConfig(**run.data_config(p))
    saved = {cls: dict(vars(cls)) for cls in (ConversationReplayDataGenerator, SharedPrefixDataGenerator)}

    async def turns(gen, stage):
        prompts = []
        for i in range(4):  # 2 conversations, 2 turns each
            d = gen.load_lazy_data(LazyLoadInferenceAPIData(data_index=i, stage_id=stage))
            await d.to_request_body("m", 5, True, True)
            d.model_response = " the cache routes"
            d.user_session.update_context(d.prompt + " " + d.model_response)
            prompts.append(d.prompt)
        return prompts

    try:
        gen = ConversationReplayDataGenerator(APIConfig(type="completion", streaming=True), data, tok)
        first = asyncio.run(turns(gen, 0))
        assert first[2].startswith(first[0]) and " the cache routes" in first[2]  # turn 1 = turn 0 + answer + message
        LocalUserSession.clear_instances()  # what inference-perf does between stages
        bare = asyncio.run(turns(gen, 1))
        assert not bare[2].startswith(bare[0])  # upstream: the second stage's turns lose their conversation
        ipwrap._install_conversation_reprime_fix()
        LocalUserSession.clear_instances()
        fixed = asyncio.run(turns(gen, 2))
        assert fixed[2].startswith(fixed[0]) and len(fixed[0]) > len(bare[0]) + 50
        ipwrap._install_client_split(1, 4)
        assert [d.data_index for d, _ in zip(gen.get_data(), range(3))] == [1, 5, 9]
        assert ipwrap.client_of("3/4") == (3, 4)
    finally:
        LocalUserSession.clear_instances()
        for cls, attrs in saved.items():
            for name in ("get_data", "_new_session"):
                if name in attrs:
                    setattr(cls, name, attrs[name])


@check
def mesh_clients_start_each_stage_together():
    import asyncio

    import ipwrap
    from inference_perf.loadgen.load_generator import LoadGenerator

    d = tempfile.mkdtemp(prefix="bench-barrier-")
    orig = LoadGenerator.run_stage
    started = []

    async def stub(self, stage_id, *args, **kwargs):  # type: ignore[no-untyped-def]
        started.append(stage_id)

    async def scenario():
        task = asyncio.ensure_future(LoadGenerator.run_stage(None, 3))
        await asyncio.sleep(0.2)
        assert started == [] and os.path.exists(os.path.join(d, "stage3.client0"))  # client 1 not there yet
        open(os.path.join(d, "stage3.client1"), "w").close()
        await asyncio.wait_for(task, 5)
        assert started == [3]

    try:
        LoadGenerator.run_stage = stub
        ipwrap._install_stage_barrier(d, 0, 2)
        asyncio.run(scenario())
    finally:
        LoadGenerator.run_stage = orig


def main() -> int:
    failed = 0
    for fn in CHECKS:
        try:
            fn()
            print(f"ok   {fn.__name__}")
        except Exception as e:  # report every failure, then exit non-zero
            failed += 1
            print(f"FAIL {fn.__name__}: {type(e).__name__}: {e}")
    print(f"{len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
