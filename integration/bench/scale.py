#!/usr/bin/env python3
"""Fleet-scale yardstick (issue 10): what kvroute costs at 8, 100, 1,000 (and 5,000) pods.

    .venv/bin/python integration/bench/scale.py [--quick] [--results-dir DIR]     (make bench-scale)

The fleet is synthetic: N stub pods, one small asyncio process (`stub-pods`, started here and
stopped by its PID) listening on N ports of 127.0.0.1, answering every request with a tiny 200
chat completion (routed requests really complete: kvroute keeps what it learned only for pods
that answered) and `POST /tokenize` with token ids. Every pod states `capacity_blocks` 19,208
(one Qwen3-32B pod). With `--scrape-interval-ms`, kvroute-indexer also scrapes the pods'
`GET /metrics`, whose load moves at every scrape once the Envoy readings start (a busy fleet's
load changes; without the flag nothing scrapes and the load never changes).

Approximate mode (plugin-config endpoints), per N and `--concurrency` 2 and 8:
  Envoy RSS once started (the filter's tables are sized from capacity at configure time) and
  startup time; `kvroute.decision_us` p50/p99 of decisions whose 8k-token prompt is really
  cached (each probe sent once to teach, then again: only the second pass is counted, from
  the difference of Envoy's histogram buckets); added Envoy CPU per request for 30 KB and
  128 KB chat bodies (Envoy CPU per request with kvroute minus the same Envoy without it, same
  load, sent by wrk: one thread, --connections keep-alive connections; 5,000 pods: c2 only).
  The Envoy without kvroute runs beside kvroute's, and each reading is --cpu-rounds rounds of
  both, alternated: the added CPU is the median of the rounds' differences. The Envoy without
  kvroute balances over as many pods as the load has prompt variants (CPU_VARIANTS), the most
  kvroute sends them to: both then reuse their upstream connections, and neither pays a new one
  per request. CPU is the on-CPU time of all Envoy's threads as the scheduler counts it
  (/proc/<pid>/task/*/schedstat, ns), reported to 0.1 µs per request.
Precise mode (kvroute-indexer with `--pod ADDRESS@MODEL` per pod), per N up to 1,000:
  the indexer filled to 70 % of capacity by synthetic vLLM KV events over ZMQ (BlockStored
  batches of 512-block sequences, built as tests/indexer/indexer_harness.py builds them); feed
  snapshot size, idle poll size, delta bytes per second while every pod stores and removes
  200 blocks/s (fewer when that exceeds --max-churn-blocks-s, then extrapolated); then per
  `--concurrency`: time for a new Envoy to route on the full index (from its process's start until the
  snapshot is loaded and published, `feed.snapshots` ≥ 1 with nothing deferred, and then an
  8k-token prompt of a random pod is fully matched on that pod; or the failure as the result), its RSS,
  `kvroute.index.blocks`, `kvroute.decision_us` p50/p99 of fully matched decisions, and added
  CPU per chat request including the tokenizer call-out (the workers' token memo, the plugin's
  default `tokenizer.memo_bytes` unless --token-memo-bytes says otherwise, recalls the variants'
  token blocks after their first call-outs; with 0 every request makes the call-out; the counts
  of each are checked). Both modes also record the CPU of
  Envoy's main thread, where the singleton (the index's one writer) runs: per request, and in
  precise mode from start until the index is routable (with the singleton's own share of it:
  `kvroute.feed.apply_us` and `kvroute.index.flush_us`).
Every RSS is read with Envoy's allocator figures (admin `GET /memory`: live heap, free memory
tcmalloc holds, memory returned to the OS); in precise mode both are read again after the CPU
readings and --settle-seconds of idle.
Every reading is checked (verify()): decisions fully matched on the right pod, histogram
samples = probes, `kvroute.blocks.matched` growth = the headers' matched blocks, the indexer
holding every entry sent, load all answered; a failed check exits non-zero. Everything binds
127.0.0.1 and stops by itself; failures (Envoy exiting, a feed that never loads) are recorded as
results. Results: results.json, table.md in --results-dir (default build/bench-scale/<UTC time>).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "integration"))
sys.path.insert(0, str(REPO / "tests" / "indexer"))

from envoyctl import GATEWAY_PRECISE, render_gateway  # noqa: E402
from indexerctl import IndexerProcess  # noqa: E402
from proctools import wait_for  # noqa: E402

from benchlog import logger  # noqa: E402
from envoy_meter import (  # noqa: E402
    allocator_memory, decision_latency, envoy_cpu_per_request, envoy_running, failure_lines,
    main_thread_cpu_seconds, rss_bytes)
from feed_readings import KvEventSource, feed_bytes, fill  # noqa: E402
from scale_fleet import (  # noqa: E402
    CAPACITY_BLOCKS, CPU_VARIANTS, FILL, SEQUENCE_BLOCKS, Client, StubFleet, chat_bodies, parse_decision,
    post_each, sequence_tokens, token_request)
from scale_report import git_commit, machine, render, summary, verify  # noqa: E402
import wrk  # noqa: E402

# The plugin's default tokenizer.memo_bytes, so that a run reads the shipped setting.
PLUGIN_MEMO_BYTES = json.loads((REPO / "schema" / "plugin-config.schema.json").read_text())[
    "properties"]["tokenizer"]["properties"]["memo_bytes"]["default"]


log = logger("scale")


# ------------------------------------------------------------------ approximate mode


def approximate(fleet: StubFleet, concurrency: int, args) -> dict[str, Any]:
    pods = fleet.addresses
    plugin = {"endpoints": [{"address": a, "capacity_blocks": CAPACITY_BLOCKS} for a in pods]}
    result: dict[str, Any] = {}
    base: dict[str, Any] = {}
    result["envoy_without_kvroute"] = base
    with plain_envoy(pods, concurrency, args, base) as plain, \
            envoy_running(render_gateway(pods, plugin), concurrency, args.startup_timeout, result) as envoy:
        if envoy is None:
            return result
        envoy.wait_for_peers(timeout=60)
        result["rss_after_start_mb"] = round(rss_bytes(envoy.pid) / 2**20, 1)
        result["memory_after_start"] = allocator_memory(envoy)
        # Teach, then probe: each sequence is learned on the pod of its first decision.
        taught = [token_request(sequence_tokens(i, 0)) for i in range(args.probes)]
        teach = post_each(envoy.listener_port, taught)
        result["teach"] = teach
        envoy.wait_for_index_flush()  # the singleton publishes what the teaching pass taught
        result["decision"] = decision_latency(envoy, [(body, None) for body in taught])
        gauges = envoy.stats("kvroute.index")
        result["index_blocks"] = gauges.get("wasmcustom.kvroute.index.blocks")
        result["index_bytes"] = gauges.get("wasmcustom.kvroute.index.bytes")
        result["rss_after_probes_mb"] = round(rss_bytes(envoy.pid) / 2**20, 1)
        result["memory_after_probes"] = allocator_memory(envoy)
        result["cpu"] = {f"{kb}KB": envoy_cpu_per_request(envoy, chat_bodies(kb * 1024), args.cpu_seconds,
                                                          args.connections, plain, args.cpu_rounds)
                         for kb in (30, 128)}
    return result


@contextlib.contextmanager
def plain_envoy(pods: list[str], concurrency: int, args, result: dict):
    """The same load's Envoy without kvroute, run beside kvroute's for paired CPU readings (None
    when it did not start: the failure goes into `result`)."""
    # Over the whole fleet, least-request sends nearly every request to a pod it has no
    # connection to yet: the baseline would pay a connect per request that kvroute does not.
    baseline_pods = pods[:CPU_VARIANTS]
    with envoy_running(render_gateway(baseline_pods, kvroute=False), concurrency, args.startup_timeout,
                       result) as plain:
        if plain is not None:
            result["rss_mb"] = round(rss_bytes(plain.pid) / 2**20, 1)
        yield plain


# ------------------------------------------------------------------ precise mode


def precise_envoy(fleet: StubFleet, indexer: IndexerProcess, concurrency: int, sequences: int,
                  args) -> dict:
    pods = fleet.addresses
    # The tokenizer call-out's 50 ms timeout is widened: the stub pods tokenize in Python on a
    # busy 2-core machine, and a timed-out call-out would measure the byte fallback instead.
    plugin = {"default_capacity_blocks": CAPACITY_BLOCKS,
              "tokenizer": {"timeout_ms": 1000, "memo_bytes": args.token_memo_bytes}}
    if args.feed_poll_ms is not None:
        plugin["indexer"] = {"poll_ms": args.feed_poll_ms}
    if args.flush_ms is not None:
        plugin["index"] = {"flush_ms": args.flush_ms}
    config = render_gateway(pods, plugin, template=GATEWAY_PRECISE, indexer=indexer.address)
    rng = random.Random(concurrency)
    # Snapshot pages go by key range, so a full match on one pod can come before the index is
    # whole: "routes on the full index" waits until the snapshot is loaded and published, then
    # checks a full match on the right pod, on a pod apart from the measured probes (a probe
    # teaches its own decision locally, so a measured one is never repeated).
    last = max(2, len(pods) // 25)
    check = (rng.randrange(len(pods) - last, len(pods)), rng.randrange(sequences))
    order = [(rng.randrange(len(pods) - last), rng.randrange(sequences)) for _ in range(args.probes)]
    probes = iter(order)
    result: dict[str, Any] = {}
    with envoy_running(config, concurrency, args.startup_timeout, result) as envoy:
        if envoy is None:
            return result
        # from the process's start (not the harness's own work before it)
        t0 = envoy.started_at
        client = Client(envoy.listener_port)

        def loaded() -> bool:
            stats = envoy.stats("kvroute.")
            return (stats.get("wasmcustom.kvroute.feed.snapshots", 0) >= 1
                    and stats.get("wasmcustom.kvroute.index.deferred", 1) == 0)

        def routed() -> bool:
            pod, seq = check
            status, header = client.post(token_request(sequence_tokens(pod, seq)))
            d = parse_decision(header)
            return status == 200 and d["pod"] == pods[pod] and d["matched"] == d["total"] == SEQUENCE_BLOCKS

        loaded_at = wait_for(loaded, args.route_timeout, interval=0.05)
        result["snapshot_loaded_s"] = round(time.monotonic() - t0, 2) if loaded_at else None
        result["main_thread_cpu_s_to_load"] = round(main_thread_cpu_seconds(envoy.pid), 2)
        # of which the singleton's own wasm work: feed answers decoded and applied, and flushes
        singleton_us = envoy.stats("kvroute.")
        result["singleton_s_to_load"] = {
            "feed_apply": round(singleton_us.get("wasmcustom.kvroute.feed.apply_us", 0) / 1e6, 2),
            "index_flush": round(singleton_us.get("wasmcustom.kvroute.index.flush_us", 0) / 1e6, 2),
        }
        ok = bool(loaded_at) and routed()
        client.close()
        result["routes_on_full_index"] = ok
        result["time_to_route_s"] = round(time.monotonic() - t0, 2) if ok else None
        feed = envoy.stats("kvroute.feed")
        result["feed"] = {k.rsplit(".", 1)[-1]: v for k, v in feed.items()}
        result["rss_mb"] = round(rss_bytes(envoy.pid) / 2**20, 1)
        result["memory"] = allocator_memory(envoy)
        result["writer_memory_mb"] = round(envoy.stats("kvroute.index.writer_memory_bytes").get(
            "wasmcustom.kvroute.index.writer_memory_bytes", 0) / 2**20, 1)
        if ok:
            chosen = [next(probes) for _ in range(args.probes)]
            result["decision"] = decision_latency(
                envoy, [(token_request(sequence_tokens(p, s)), pods[p]) for p, s in chosen])
        else:
            result["failure"] = failure_lines(envoy.log_text())
        # the singleton records the gauge at its flush
        result["index_blocks"] = wait_for(
            lambda: envoy.stats("kvroute.index.blocks").get("wasmcustom.kvroute.index.blocks"), 10)
        result["index_bytes"] = envoy.stats("kvroute.index.bytes").get("wasmcustom.kvroute.index.bytes")
        # chat bodies without token ids: each request also makes the tokenizer call-out, or
        # (--token-memo-bytes) recalls its variant's token blocks
        result["cpu"] = {}
        # started only now: it must not share the machine with the snapshot's load
        base: dict[str, Any] = {}
        result["envoy_without_kvroute"] = base
        with plain_envoy(pods, concurrency, args, base) as plain:
            for kb in (30, 128):
                before = envoy.stats("kvroute.tokenizer.")
                cpu = envoy_cpu_per_request(envoy, chat_bodies(kb * 1024), args.cpu_seconds, args.connections,
                                            plain, args.cpu_rounds)
                after = envoy.stats("kvroute.tokenizer.")
                for outcome in ("ok", "failed", "recalled"):
                    key = f"wasmcustom.kvroute.tokenizer.{outcome}"
                    cpu[f"tokenizer_{outcome}"] = after.get(key, 0) - before.get(key, 0)
                result["cpu"][f"{kb}KB"] = cpu
        # again after the probes and the CPU readings (and --settle-seconds more): what the
        # allocator, which returns freed pages at a bounded rate (memory_allocator_manager), gave back
        time.sleep(args.settle_seconds)
        result["settle_s"] = args.settle_seconds
        result["rss_end_mb"] = round(rss_bytes(envoy.pid) / 2**20, 1)
        result["memory_end"] = allocator_memory(envoy)
        feed = envoy.stats("kvroute.feed")
        result["feed_end"] = {k.rsplit(".", 1)[-1]: v for k, v in feed.items()}
    return result


def precise(fleet: StubFleet, args) -> dict[str, Any]:
    pods = fleet.addresses
    flags = [f"--max-pods={max(1024, len(pods))}", "--pod-timeout-seconds=0",
             f"--scrape-interval-ms={args.scrape_interval_ms}",
             "--queue-capacity=1000000"]
    result: dict[str, Any] = {}
    with IndexerProcess(pods, *flags) as indexer:
        source = KvEventSource(indexer, pods)
        try:
            log(f"precise N={len(pods)}: filling the indexer to {FILL:.0%}")
            result["fill"] = fill(indexer, source, len(pods))
            log(f"precise N={len(pods)}: {result['fill']}")
            rate = 200 if len(pods) * 200 <= args.max_churn_blocks_s else args.max_churn_blocks_s // len(pods)
            result["feed"] = feed_bytes(indexer, source, len(pods), rate, args.churn_seconds)
            log(f"precise N={len(pods)}: feed {result['feed']}")
            result["fill_after_churn"] = sum(p.get("blocks", 0) for p in indexer.pods_debug().values())
            if args.scrape_interval_ms:
                # after the feed's byte figures, which count block events only
                fleet.start_moving()
            for c in ([] if args.no_envoy else args.concurrency):
                log(f"precise N={len(pods)} c{c}: Envoy")
                result[f"c{c}"] = precise_envoy(fleet, indexer, c, result["fill"]["sequences_per_pod"], args)
                log(f"precise N={len(pods)} c{c}: {summary(result[f'c{c}'])}")
            result["indexer_rss_mb"] = round(indexer.rss_bytes() / 2**20, 1)
            result["indexer_metrics"] = {k: indexer.metric(k) for k in (
                "kvroute_indexer_feed_requests_total", "kvroute_indexer_messages_rejected_total",
                "kvroute_indexer_seq_gaps_total", "kvroute_indexer_queue_dropped_total")}
        finally:
            source.close()
    return result


# ------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 and 100 pods, fewer requests: a few minutes")
    ap.add_argument("--pods", default=None, help="comma list of fleet sizes (default 8,100,1000; quick 8,100)")
    ap.add_argument("--approximate-only-pods", default=None,
                    help="fleet sizes run in approximate mode at --concurrency 2 only (default 5000; quick none)")
    ap.add_argument("--concurrency", default="2,8")
    ap.add_argument("--probes", type=int, default=None, help="fully cached decisions measured per Envoy")
    ap.add_argument("--cpu-seconds", type=int, default=None,
                    help="seconds of load per round of a CPU reading, for each Envoy (default 2; quick 1)")
    ap.add_argument("--cpu-rounds", type=int, default=5,
                    help="rounds per CPU reading: each reads kvroute's Envoy and the one without, alternated,"
                         " and the added CPU is the median of the rounds' differences")
    ap.add_argument("--connections", type=int, default=4, help="wrk's keep-alive connections in the CPU readings")
    ap.add_argument("--churn-seconds", type=float, default=None)
    ap.add_argument("--max-churn-blocks-s", type=int, default=20_000,
                    help="cap on generated stored blocks/s over the fleet (above: a lower per-pod rate, extrapolated)")
    ap.add_argument("--precise-only", action="store_true",
                    help="skip approximate mode for the --pods fleets")
    ap.add_argument("--no-envoy", action="store_true",
                    help="precise mode: fill the indexer and measure the feed only, start no Envoy")
    ap.add_argument("--settle-seconds", type=float, default=0,
                    help="precise mode: idle this long after the CPU readings before the last RSS reading")
    ap.add_argument("--scrape-interval-ms", type=int, default=0,
                    help="precise mode: the indexer scrapes the stub pods' /metrics this often; from the "
                         "Envoy readings on, each scrape changes every pod's load (default 0: no scrape)")
    ap.add_argument("--feed-poll-ms", type=int, default=None,
                    help="precise mode: the singleton's indexer.poll_ms (default: the plugin's)")
    ap.add_argument("--flush-ms", type=int, default=None,
                    help="precise mode: the singleton's index.flush_ms (default: the plugin's)")
    ap.add_argument("--startup-timeout", type=float, default=180)
    ap.add_argument("--route-timeout", type=float, default=60)
    ap.add_argument("--token-memo-bytes", type=int, default=PLUGIN_MEMO_BYTES,
                    help="precise mode: the workers' tokenizer.memo_bytes (default: the plugin's, "
                         f"{PLUGIN_MEMO_BYTES}; "
                         "0: every chat request makes the call-out)")
    ap.add_argument("--results-dir", default=None)
    args = ap.parse_args()
    wrk.require()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    sizes = [int(n) for n in (args.pods or ("8,100" if args.quick else "8,100,1000")).split(",")]
    big = [int(n) for n in (args.approximate_only_pods if args.approximate_only_pods is not None
                            else ("" if args.quick else "5000")).split(",") if n]
    # p99 of 400 decisions rests on the 4 slowest; of 100 (three runs at 1,000 pods read 290,
    # 680 and 990 us where 400 read 160 and 200) on the one or two a preemption hit.
    args.probes = args.probes or (100 if args.quick else 400)
    args.cpu_seconds = args.cpu_seconds or (1 if args.quick else 2)
    args.churn_seconds = args.churn_seconds or (5 if args.quick else 10)
    stamp = dt.datetime.now(dt.timezone.utc)
    out = Path(args.results_dir or REPO / "build" / "bench-scale" / stamp.strftime("%Y%m%dT%H%M%SZ"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"commit": git_commit(), "started": stamp.isoformat(timespec="seconds"),
                               "argv": sys.argv[1:], "machine": machine(), "capacity_blocks": CAPACITY_BLOCKS,
                               "fill": FILL, "sequence_blocks": SEQUENCE_BLOCKS, "concurrency": args.concurrency,
                               "route_timeout_s": args.route_timeout, "cpu_seconds_per_round": args.cpu_seconds,
                               "cpu_rounds": args.cpu_rounds,
                               "cpu_load": {"generator": "wrk " + " ".join(wrk.version()), "threads": 1,
                                            "connections": args.connections},
                               "token_memo_bytes": args.token_memo_bytes,
                               "fleets": {}}
    log(f"Envoy CPU per request: on-CPU ns of its threads (schedstat) over {args.cpu_rounds} rounds of "
        f"{args.cpu_seconds} s of wrk load on {args.connections} connections, reported to 0.1 µs")
    t0 = time.monotonic()
    for n in sizes + big:
        runs: dict[str, Any] = {"approximate": {}}
        results["fleets"][str(n)] = runs
        with StubFleet(n) as fleet:
            for c in ([] if args.precise_only and n not in big else [2] if n in big else args.concurrency):
                log(f"approximate N={n} c{c}")
                runs["approximate"][f"c{c}"] = approximate(fleet, c, args)
                log(f"approximate N={n} c{c}: {summary(runs['approximate'][f'c{c}'])}")
            if n not in big:
                runs["precise"] = precise(fleet, args)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    results["seconds"] = round(time.monotonic() - t0)
    results["checks"] = verify(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = render(results)
    (out / "table.md").write_text(table)
    print(table)
    checks = results["checks"]
    log(f"{checks['made'] - len(checks['failed'])}/{checks['made']} checks passed"
        + "".join(f"\n  FAILED: {name}" for name in checks["failed"]))
    log(f"results in {out} ({results['seconds']} s)")
    if checks["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
